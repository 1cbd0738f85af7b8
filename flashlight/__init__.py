"""Flashlight: plain-PyTorch attention programs compiled to fused Triton kernels.

    import flashlight
    fast = torch.compile(attn, backend="flashlight")
    print(flashlight.explain(attn, q, k, v))
    flashlight.wait()       # kernels compiling in the background are ready (runtime/background.py)
"""
from . import _compat
from .backend import flashlight_backend
from .explain import Report, explain
from .runtime.background import wait

__version__ = "0.1.0"
__all__ = ["flashlight_backend", "explain", "Report", "wait", "__version__"]

_compat.register_backend("flashlight", flashlight_backend)
