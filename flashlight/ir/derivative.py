"""Reverse mode over the IR: the local derivative of every op as one table row, and the
vector-Jacobian product of an expression DAG built from them.

``vjp({e: g})`` returns, for every differentiable leaf ``e`` reads (score tiles ``dot``, float
``load`` s, reductions ``red``, partial sums ``scan``), an *expression* for its adjoint. Adjoints are ordinary IR
expressions over the primal nodes and the seeds, so codegen emits them with the same CSE as the
forward values (``exp(x)``'s derivative reuses the ``exp`` already computed). Seeds are usually
``tile`` leaves: values the kernel writer computed itself (dP = dO @ V^T, a row gradient).
"""
from __future__ import annotations

import functools
import math
from typing import Callable

from .expr import Expr, call, const, refs, walk

LN2 = math.log(2.0)
TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
ZERO = const(0.0)


def _where(c: Expr, a, b) -> Expr:
    return call("where", c, a, b)


def _tie_split(win: Expr, tie: Expr, g: Expr) -> Expr:
    """torch's maximum/minimum backward: the winner takes g, a tie splits it in half."""
    return _where(win, g, _where(tie, g * 0.5, ZERO))


# op -> (y, g) -> one adjoint per argument (None: not differentiable through that argument).
# ``y`` is the node itself (its arguments are y.args), ``g`` its adjoint.
DERIVATIVE: dict[str, Callable[[Expr, Expr], tuple]] = {
    "add": lambda y, g: (g, g),
    "sub": lambda y, g: (g, call("neg", g)),
    "mul": lambda y, g: (g * y.args[1], g * y.args[0]),
    "div": lambda y, g: (call("div", g, y.args[1]), call("neg", call("div", g * y, y.args[1]))),  # d(a/b)/db = -y/b
    "div_safe": lambda y, g: (call("div_safe", g, y.args[1]),                        # 0 where b == 0, like y
                              call("neg", call("div_safe", g * y, y.args[1]))),
    "neg": lambda y, g: (call("neg", g),),
    "maximum": lambda y, g: (_tie_split(call("gt", *y.args), call("eq", *y.args), g),
                             _tie_split(call("lt", *y.args), call("eq", *y.args), g)),
    "minimum": lambda y, g: (_tie_split(call("lt", *y.args), call("eq", *y.args), g),
                             _tie_split(call("gt", *y.args), call("eq", *y.args), g)),
    "pow": lambda y, g: (g * y.args[1] * call("pow", y.args[0], y.args[1] - 1.0),    # b a^(b-1)
                         g * y * call("log", y.args[0])),                            # a^b log a
    "abs": lambda y, g: (g * call("sign", y.args[0]),),
    "relu": lambda y, g: (_where(call("gt", y, 0.0), g, ZERO),),
    "exp": lambda y, g: (g * y,),                                                    # (e^x)' = e^x
    "exp2": lambda y, g: (g * y * LN2,),
    "log": lambda y, g: (call("div", g, y.args[0]),),
    "log2": lambda y, g: (call("div", g, y.args[0] * LN2),),
    "log1p": lambda y, g: (call("div", g, y.args[0] + 1.0),),
    "expm1": lambda y, g: (g * (y + 1.0),),
    "sqrt": lambda y, g: (call("div", g * 0.5, y),),
    "rsqrt": lambda y, g: (g * -0.5 * y * y * y,),                                   # (x^-1/2)' = -x^-3/2 / 2
    "reciprocal": lambda y, g: (call("neg", g * y * y),),
    "tanh": lambda y, g: (g * (1.0 - y * y),),
    "sigmoid": lambda y, g: (g * y * (1.0 - y),),
    "erf": lambda y, g: (g * TWO_OVER_SQRT_PI * call("exp", call("neg", y.args[0] * y.args[0])),),
    "sin": lambda y, g: (g * call("cos", y.args[0]),),
    "cos": lambda y, g: (call("neg", g * call("sin", y.args[0])),),
    "floor": lambda y, g: (None,), "ceil": lambda y, g: (None,), "round": lambda y, g: (None,),
    "sign": lambda y, g: (None,),
    "where": lambda y, g: (None, _where(y.args[0], g, ZERO), _where(y.args[0], ZERO, g)),
    "to_f": lambda y, g: (g,),
    "stop": lambda y, g: (None,),       # detach(): no gradient through it
    # y[m] = sum_dv x[m, dv], only in the output's [M, DV] tile, where an adjoint is per element:
    # y broadcast along dv is used once per element, so its adjoint sums g over dv (RMSNorm's rsqrt)
    "sum_dv": lambda y, g: (call("sum_dv", g),),
}
# a scan leaf (the partial sums of scan j at the tile's keys) is a leaf too: its adjoint becomes
# the seed of the scan's body through a partial sum the other way (``codegen.backward``)
LEAVES = ("dot", "load", "red", "scan")


@functools.lru_cache(maxsize=65536)
def needs_grad(e: Expr) -> bool:
    """Does a float leaf (score tile, float load, reduction) influence ``e`` through floats?"""
    if e.kind != "f":
        return False
    if e.op in LEAVES:
        return True
    if e.op in ("load", "tile", "stop") or not e.args:
        return False
    return any(isinstance(a, Expr) and needs_grad(a) for a in e.args)


def not_differentiable(e: Expr) -> str | None:
    """The first op on a gradient path of ``e`` without a DERIVATIVE row, or None."""
    for x in walk(e):
        if needs_grad(x) and x.op not in LEAVES and x.op not in DERIVATIVE:
            return x.op
    return None


def vjp(seeds: dict[Expr, Expr]) -> dict[Expr, Expr]:
    """Adjoints of the leaves for the given adjoints of ``seeds``' keys (reverse topological
    order over the DAG of all keys: every node is complete before it is propagated)."""
    roots = Expr("seq", tuple(seeds), "f")       # one DFS over every root: reverse post-order is topological
    adj: dict[Expr, Expr] = dict(seeds)
    for y in reversed(list(walk(roots))[:-1]):
        g = adj.get(y)
        if g is None or y.op in LEAVES or not needs_grad(y):
            continue
        for a, da in zip(y.args, DERIVATIVE[y.op](y, g)):
            if da is not None and needs_grad(a):
                adj[a] = adj[a] + da if a in adj else da
    return {x: g for x, g in adj.items() if x.op in LEAVES and needs_grad(x)}


def tile(name: str) -> Expr:
    """A value the kernel writer computed (a seed adjoint): emitted as the Triton name itself."""
    return Expr("tile", (name,), "f")


def reads_tile(e: Expr) -> bool:
    return bool(refs(e, "tile"))
