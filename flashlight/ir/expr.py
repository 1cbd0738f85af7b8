"""Scalar expressions over the index space of an attention region.

An ``Expr`` is an immutable, structurally hashed node: equal sub-expressions are equal objects
for dict purposes, which gives common-subexpression elimination for free in codegen and the
reference evaluator. Every expression has a *kind*: ``"b"`` (bool), ``"i"`` (integer index
arithmetic, int64) or ``"f"`` (floating point, computed in fp32 — or fp64 in the reference).

Leaves:
    var(name)      an index variable: ``b0..bk`` (batch dims), ``m``, ``n``, ``dk``, ``dv``
    const(x)       a Python scalar
    load(i, idx)   element ``idx`` of the region's i-th input tensor
    dot(i)         the i-th score contraction ``sum_dk q_i[b, m, dk] * k_i[b, n, dk]``
    red(j)         the value of the region's j-th reduction over N (a row value)
    scan(j, idx)   the partial sum of reduction j (a ``scan``) at the key of ``idx`` = (b..., m, n):
                   over the keys before n (a prefix scan) or after it (a suffix scan), n excluded
    tile(name)     a value computed by a kernel writer (backward seeds, see ir/derivative.py)
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterator

KINDS = ("b", "i", "f")


@dataclass(frozen=True)
class Expr:
    op: str
    args: tuple = ()
    kind: str = "f"

    def __post_init__(self):
        assert self.kind in KINDS, self.kind

    # Operator sugar keeps rewrite rules and tests readable.
    def __add__(self, o): return call("add", self, lift(o))
    def __radd__(self, o): return call("add", lift(o), self)
    def __sub__(self, o): return call("sub", self, lift(o))
    def __rsub__(self, o): return call("sub", lift(o), self)
    def __mul__(self, o): return call("mul", self, lift(o))
    def __rmul__(self, o): return call("mul", lift(o), self)
    def __floordiv__(self, o): return call("idiv", self, lift(o))
    def __mod__(self, o): return call("imod", self, lift(o))

    def __repr__(self) -> str:
        return fmt(self)


def var(name: str) -> Expr:
    return Expr("var", (name,), "i")


def const(value) -> Expr:
    if isinstance(value, bool):
        return Expr("const", (value,), "b")
    if isinstance(value, int):
        return Expr("const", (value,), "i")
    return Expr("const", (float(value),), "f")


def lift(x) -> Expr:
    return x if isinstance(x, Expr) else const(x)


def load(index: int, idx: tuple, kind: str) -> Expr:
    return Expr("load", (index, tuple(idx)), kind)


def dot(i: int) -> Expr:
    return Expr("dot", (i,), "f")


def red(j: int) -> Expr:
    return Expr("red", (j,), "f")


def scan(j: int, idx: tuple) -> Expr:
    return Expr("scan", (j, tuple(idx)), "f")


# ---------------------------------------------------------------------------------------------
# Pointwise operators: name -> (arity, result kind or None for "same as first operand").
# One row per operator; codegen and the reference evaluator each have one row per name too.
# ---------------------------------------------------------------------------------------------
POINTWISE: dict[str, tuple[int, str | None]] = {
    "add": (2, None), "sub": (2, None), "mul": (2, None),
    "div": (2, "f"),            # true division
    "div_safe": (2, "f"),       # a / b, but 0 where b == 0 (softmax of a fully masked row)
    "idiv": (2, "i"),           # floor division of non-negative index arithmetic
    "imod": (2, "i"),           # remainder of non-negative index arithmetic
    "floordiv": (2, None),      # Python/torch floor division (any sign)
    "mod": (2, None),           # Python/torch remainder (sign of the divisor)
    "maximum": (2, None), "minimum": (2, None),
    "pow": (2, "f"),
    "eq": (2, "b"), "ne": (2, "b"), "lt": (2, "b"), "le": (2, "b"), "gt": (2, "b"), "ge": (2, "b"),
    "and": (2, "b"), "or": (2, "b"), "xor": (2, "b"), "not": (1, "b"),
    "neg": (1, None), "abs": (1, None), "sign": (1, None),
    "exp": (1, "f"), "exp2": (1, "f"), "log": (1, "f"), "log2": (1, "f"), "log1p": (1, "f"),
    "expm1": (1, "f"), "sqrt": (1, "f"), "rsqrt": (1, "f"), "reciprocal": (1, "f"),
    "tanh": (1, "f"), "sigmoid": (1, "f"), "relu": (1, None), "erf": (1, "f"),
    "sin": (1, "f"), "cos": (1, "f"), "floor": (1, None), "ceil": (1, None), "round": (1, None),
    "where": (3, None),         # kind follows the second operand (promoted with the third)
    "to_f": (1, "f"), "to_i": (1, "i"), "to_b": (1, "b"),
    # the value itself, with no gradient through it: ``detach()`` or a ``torch.no_grad()`` block
    # in the program, fused with the region's scores (capture's ``fuse_stops``)
    "stop": (1, None),
    # torch.cat([x, e], -1) of an (.., N) score tensor and one (.., 1) column: x at keys n < N,
    # the row value e at position N. A max / sum whose body reads it spans N + 1 positions;
    # rewrite.split_concat turns that into a reduction over the keys plus an ``extra`` element.
    "cat_n": (2, None),
    # sum over the output's head dim dv of an output-tile value (a row value: dv is bound), for
    # norms in the epilogue (DiffAttn's per-head RMSNorm). Only in a region's ``out``.
    "sum_dv": (1, "f"),
    # rand16(seed, row, col): uniform integer in [0, 65536), one 16-bit lane (col % 8) of
    # Philox-4x32-10 at counter (col // 8, row): 8 keys share a call (ir/philox.py; dropout)
    "rand16": (3, "i"),
}
BINDS: dict[str, frozenset[str]] = {"sum_dv": frozenset({"dv"})}   # op -> index vars it sums out
# ops whose value jumps as their operands move continuously: comparisons, rounding, conversions
# to integers or bools. Where a recomputed or re-associated value meets one, its rounding can
# flip the result (capture's recomputed-threshold check, codegen's score rewrites).
JUMPS = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "sign", "floor", "ceil", "round", "to_i", "to_b",
                   "floordiv", "mod"})


def promote(*kinds: str) -> str:
    return max(kinds, key=KINDS.index)


def call(op: str, *args: Expr) -> Expr:
    arity, kind = POINTWISE[op]
    assert len(args) == arity, (op, args)
    args = tuple(lift(a) for a in args)
    if kind is None:
        kind = promote(*(a.kind for a in (args[1:] if op == "where" else args)))
        if kind == "b" and op in ("add", "sub", "mul", "neg", "abs", "floordiv", "mod"):
            kind = "i"
    return simplify(Expr(op, args, kind))


# ---------------------------------------------------------------------------------------------
# Light algebraic simplification; enough to keep index arithmetic from views readable.
# ---------------------------------------------------------------------------------------------
def is_const(e: Expr, value=None) -> bool:
    return e.op == "const" and (value is None or e.args[0] == value)


_FOLD: dict[str, Callable] = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "idiv": lambda a, b: a // b, "imod": lambda a, b: a % b,
    "floordiv": lambda a, b: a // b, "mod": lambda a, b: a % b,
    "neg": lambda a: -a, "not": lambda a: not a, "abs": abs, "minimum": min, "maximum": max,
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
    "and": lambda a, b: a and b, "or": lambda a, b: a or b,
    "to_f": float, "to_i": int, "to_b": bool,
}


def simplify(e: Expr) -> Expr:
    a = e.args
    if e.op in _FOLD and all(is_const(x) for x in a):
        try:
            return _const_of_kind(_FOLD[e.op](*(x.args[0] for x in a)), e.kind)
        except (ZeroDivisionError, OverflowError, ValueError):
            return e
    if e.op == "add":
        if is_const(a[0], 0) and a[1].kind == e.kind: return a[1]
        if is_const(a[1], 0) and a[0].kind == e.kind: return a[0]
    if e.op == "sub" and is_const(a[1], 0) and a[0].kind == e.kind:
        return a[0]
    if e.op == "sub" and e.kind == "i" and is_const(a[0]) and a[1].op == "sub" and a[1].args[0] == a[0]:
        return a[1].args[1]                                                  # c - (c - x) = x: flip(flip(x))
    if e.op == "mul" and e.kind == "i":
        if is_const(a[0], 0) or is_const(a[1], 0): return const(0)
        if is_const(a[0], 1): return a[1]
        if is_const(a[1], 1): return a[0]
    if e.op == "idiv" and is_const(a[1], 1):
        return a[0]
    if e.op == "imod" and is_const(a[1], 1):
        return const(0)
    if e.op == "where":
        if is_const(a[0], True): return _coerce(a[1], e.kind)
        if is_const(a[0], False): return _coerce(a[2], e.kind)
        if is_const(a[1], True) and is_const(a[2], False): return a[0]       # where(c, T, F) = c
        if is_const(a[1], False) and is_const(a[2], True): return call("not", a[0])
    if e.op == "ne" and a[0] == a[1] and a[0].op == "mul" and a[0].kind == "f":   # isnan(y * c) = isnan(y)
        for y, c in (a[0].args, a[0].args[::-1]):
            if is_const(c) and c.kind == "f" and c.args[0] != 0 and math.isfinite(c.args[0]):
                return call("ne", y, y)
    if e.op == "not" and a[0].op == "not":
        return a[0].args[0]                                                  # not(not c) = c
    if e.op == "abs" and a[0].op == "neg":
        return simplify(Expr("abs", a[0].args, e.kind))                      # |-x| = |x|: log-sigmoids of s and -s share it
    if e.op in ("and", "or") and a[0] == a[1]:
        return a[0]                                                          # x & x = x | x = x
    if e.op == "and":
        if is_const(a[0], False) or is_const(a[1], False): return const(False)
        if is_const(a[0], True): return a[1]
        if is_const(a[1], True): return a[0]
    if e.op == "or":
        if is_const(a[0], True) or is_const(a[1], True): return const(True)
        if is_const(a[0], False): return a[1]
        if is_const(a[1], False): return a[0]
    if e.op in ("to_f", "to_i", "to_b") and a[0].kind == e.kind:
        return a[0]
    return e


def _const_of_kind(v, kind):
    if kind == "b": return const(bool(v))
    if kind == "i": return const(int(v))
    return const(float(v))


def _coerce(x: Expr, kind: str) -> Expr:
    if x.kind == kind:
        return x
    return call({"f": "to_f", "i": "to_i", "b": "to_b"}[kind], x)


def coerce(x: Expr, kind: str) -> Expr:
    """Cast ``x`` to ``kind`` (no-op when it already has it)."""
    return _coerce(lift(x), kind)


# ---------------------------------------------------------------------------------------------
# Traversal
# ---------------------------------------------------------------------------------------------
INDEXED = ("load", "scan")      # leaves (number, index): their index expressions are their children


def children(e: Expr) -> tuple[Expr, ...]:
    if e.op in INDEXED:
        return e.args[1]
    if e.op in ("var", "const", "dot", "red", "tile"):
        return ()
    return e.args


def walk(e: Expr) -> Iterator[Expr]:
    """Post-order, each distinct sub-expression once."""
    seen: set[Expr] = set()
    stack = [(e, False)]
    while stack:
        x, done = stack.pop()
        if done:
            yield x
            continue
        if x in seen:
            continue
        seen.add(x)
        stack.append((x, True))
        stack.extend((c, False) for c in reversed(children(x)))


@functools.lru_cache(maxsize=65536)
def free_vars(e: Expr) -> frozenset[str]:
    found: dict[Expr, frozenset[str]] = {}
    for x in walk(e):       # post-order: children first
        if x.op == "var":
            found[x] = frozenset(x.args)
        else:
            found[x] = frozenset().union(*(found[c] for c in children(x))) - BINDS.get(x.op, frozenset())
    return found[e]


@functools.lru_cache(maxsize=65536)
def refs(e: Expr, op: str) -> frozenset[int]:
    """Indices of the ``dot``/``red``/``load`` leaves that ``e`` reads."""
    return frozenset(x.args[0] for x in walk(e) if x.op == op)


def substitute(e: Expr, fn: Callable[[Expr], Expr | None]) -> Expr:
    """Rebuild ``e`` bottom-up; ``fn`` may return a replacement for any node (or None)."""
    memo: dict[Expr, Expr] = {}
    for x in walk(e):
        if x.op in INDEXED:
            new = Expr(x.op, (x.args[0], tuple(memo[c] for c in x.args[1])), x.kind)
        elif children(x):
            new = simplify(Expr(x.op, tuple(memo[c] for c in x.args), x.kind))
        else:
            new = x
        r = fn(new)
        memo[x] = new if r is None else r
    return memo[e]


def linear(ie: Expr, signed: bool = False) -> tuple[dict[str, int], int] | None:
    """An int index as ({var: coefficient}, constant) where it is linear in its vars (adds and
    products with constants; with ``signed``, subtractions and negations too), else None."""
    if ie.kind != "i":
        return None
    if ie.op == "const":
        return {}, ie.args[0]
    if ie.op == "var":
        return {ie.args[0]: 1}, 0
    if signed and ie.op == "neg":
        a = linear(ie.args[0], signed)
        return None if a is None else ({v: -c for v, c in a[0].items()}, -a[1])
    if ie.op in ("add", "mul") or (signed and ie.op == "sub"):
        a, b = (linear(x, signed) for x in ie.args)
        if a is None or b is None:
            return None
        if ie.op != "mul":
            sign = -1 if ie.op == "sub" else 1
            return {v: a[0].get(v, 0) + sign * b[0].get(v, 0) for v in {*a[0], *b[0]}}, a[1] + sign * b[1]
        (f, c), (lin, k) = (a, b) if not a[0] else (b, a)
        if f:
            return None         # a product of two vars
        return {v: c * x for v, x in lin.items()}, c * k
    return None


def fmt(e: Expr) -> str:
    if e.op == "var":
        return e.args[0]
    if e.op == "const":
        v = e.args[0]
        return repr(v) if not (isinstance(v, float) and math.isinf(v)) else ("-inf" if v < 0 else "inf")
    if e.op in INDEXED:
        name = "in" if e.op == "load" else "scan"
        return f"{name}{e.args[0]}[{', '.join(fmt(i) for i in e.args[1])}]"
    if e.op in ("dot", "red", "tile"):
        return f"{e.op}{e.args[0]}"
    return f"{e.op}({', '.join(fmt(a) for a in e.args)})"
