"""Static ranges of a region's integer arithmetic, and the checks that the kernel computes what
eager does (``verify`` calls ``check_integer_ranges``).

The kernel computes index arithmetic in int32 (``tl.arange``, program ids); eager computes it in
the tensors' dtypes: int64 for ``torch.arange``'s default, which never wraps at these sizes, and
int32, int16, int8 or uint8 for tensors of those dtypes, which wrap. The two agree while every
value stays within both ranges, and the block-sparsity analysis (``sparsity.IntervalWriter``)
assumes that no value wraps. So a region is refused where:

- an integer expression of index variables and constants (no loads) can leave int32: a hash of
  the positions (``(i * 73856093 + j) % 97``), or a constant beyond int32;
- arithmetic on a loaded 8- or 16-bit integer tensor can leave that dtype's range: eager wraps
  it (a uint8 ``pad - 1`` is 255 where pad is 0), the kernel does not.

Loads of int32 and int64 tensors (document ids, positions) are values the program chose; their
range is unknown here and taken as moderate, as eager's own arithmetic on them assumes.
"""
from __future__ import annotations

import torch

from .expr import Expr, children, fmt, refs, walk

INT32 = (-(2 ** 31), 2 ** 31 - 1)
NARROW = {torch.uint8: (0, 255), torch.int8: (-128, 127), torch.int16: (-(2 ** 15), 2 ** 15 - 1)}
ARITHMETIC = ("add", "sub", "mul", "neg", "abs", "floordiv", "idiv", "mod", "imod")

Range = tuple[int, int] | None      # None: unknown


def _span(values) -> Range:
    values = list(values)
    return min(values), max(values)


def int_range(e: Expr, variables: dict[str, int], inputs: list, memo: dict | None = None) -> Range:
    """[lo, hi] of the integer or boolean expression ``e``: index variable ``x`` ranges over
    [0, variables[x]); an integer load over its dtype's range where that is 8 or 16 bits, else
    unknown (None), as is anything float."""
    memo = {} if memo is None else memo
    if e in memo:
        return memo[e]
    r = _range(e, variables, inputs, memo)
    memo[e] = r
    return r


def _range(e: Expr, variables: dict[str, int], inputs: list, memo: dict) -> Range:
    if e.kind == "f":
        return None
    if e.kind == "b":
        return 0, 1
    if e.op == "var":
        n = variables.get(e.args[0])
        return None if n is None else (0, max(n - 1, 0))
    if e.op == "const":
        return int(e.args[0]), int(e.args[0])
    if e.op == "load":
        return NARROW.get(inputs[e.args[0]].dtype)
    args = [int_range(c, variables, inputs, memo) for c in children(e)]
    if e.op == "where":
        args = args[1:]
        return None if None in args else _span(x for a in args for x in a)
    if None in args:
        return None
    if e.op in ("add", "sub", "mul"):
        (a0, a1), (b0, b1) = args
        if e.op == "add":
            return a0 + b0, a1 + b1
        if e.op == "sub":
            return a0 - b1, a1 - b0
        return _span(x * y for x in (a0, a1) for y in (b0, b1))
    if e.op == "neg":
        return -args[0][1], -args[0][0]
    if e.op == "abs":
        lo, hi = args[0]
        return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi))), max(abs(lo), abs(hi))
    if e.op in ("minimum", "maximum"):
        (a0, a1), (b0, b1) = args
        f = min if e.op == "minimum" else max
        return f(a0, b0), f(a1, b1)
    if e.op in ("floordiv", "idiv") and args[1][0] == args[1][1] and args[1][0] > 0:
        c = args[1][0]
        return args[0][0] // c, args[0][1] // c
    if e.op in ("mod", "imod") and args[1][0] == args[1][1] and args[1][0] > 0:
        return 0, args[1][0] - 1
    if e.op == "sign":
        return -1, 1
    if e.op == "to_i":
        return args[0]
    return None


def check_integer_ranges(region, what: str, e: Expr, variables: dict[str, int]) -> str:
    """Why the kernel's integer arithmetic in ``e`` may not be eager's, or ""."""
    memo: dict = {}
    for x in walk(e):
        if x.kind != "i" or x.op in ("load", "var", "const"):
            continue
        r = int_range(x, variables, region.inputs, memo)
        loads = refs(x, "load")
        if r is not None and not loads and (r[0] < INT32[0] or r[1] > INT32[1]):
            return (f"{what}: the integer arithmetic {fmt(x)} reaches {r[1] if r[1] > INT32[1] else r[0]}, beyond "
                    "the int32 range the kernel computes index arithmetic in (eager: the tensors' dtypes)")
        narrow = [region.inputs[i].dtype for i in loads if region.inputs[i].dtype in NARROW]
        if x.op in ARITHMETIC and narrow and r is not None:
            lo, hi = max(NARROW[d][0] for d in narrow), min(NARROW[d][1] for d in narrow)
            if r[0] < lo or r[1] > hi:
                return (f"{what}: {fmt(x)} on a {str(narrow[0]).replace('torch.', '')} tensor can leave its range, "
                        "where eager wraps around and the kernel does not")
    return ""
