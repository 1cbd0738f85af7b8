"""The ``tl`` of generated Gluon kernels: Gluon's language, plus the few functions the expression
emitter (``codegen/emit.py``) calls that Gluon does not have. The emitter writes ``tl.where``,
``tl.exp2``, ``tl.load`` ... over tiles it did not create, and those are the same in Gluon, so one
emitter serves both dialects; ``codegen.gluon.GLUON_OPS`` lists the IR ops whose code only uses
names this module provides."""
from triton.experimental import gluon
from triton.experimental.gluon.language import *  # noqa: F401,F403 — the generated code's namespace
from triton.experimental.gluon.language import exp


@gluon.jit
def sigmoid(x):
    return 1.0 / (1.0 + exp(-x))
