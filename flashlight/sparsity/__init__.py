"""Sparsity (DESIGN.md §4): find, per (M block, N block), whether a block can be skipped.

Two steps, both derived from the IR of the user's program:

1. ``dead_predicate``: a boolean expression D(b, m, n) such that D implies every reduction of a
   pass receives its identity at (b, m, n) — ``-inf`` for a max, ``0`` for a sum or a P @ V
   product. Built by the rule tables ``NEG_INF_WHEN`` and ``ZERO_WHEN`` (``where(mask, s, -inf)``
   is -inf where the mask is false; ``exp(-inf) = 0``; a product is 0 where a factor is 0).
2. ``IntervalWriter``: sound interval arithmetic of D over a block, emitted as scalar Triton code.
   Index variables range over the block; loads that vary along m or n read per-block min/max
   statistics (``BlockStat``) that the runtime recomputes on every call at O(N) cost, so changing
   document ids never recompiles and is never stale. A block is skipped only when D is provably
   true on all of it.

The statistics are kept per ``STAT_BLOCK`` positions, whatever the kernels' block sizes: each
kernel reduces the BLOCK // STAT_BLOCK entries of its blocks, so one reduction per call serves
the forward and both backward tile kernels (each a different BLOCK_M x BLOCK_N). On the H200
host each extra reduction cost 68 µs of host time under cProfile (docs/notes.md, session 5).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..ir import Expr, Region, call, const, free_vars, refs, substitute, walk

TRUE, FALSE = const(True), const(False)
NEG_INF = float("-inf")
STAT_BLOCK = 16     # positions per min/max entry: divides every block size a kernel is launched with


def _pos_const(e: Expr) -> bool:
    return e.op == "const" and e.kind != "b" and e.args[0] > 0


def neg_inf_when(e: Expr) -> Expr:
    rule = NEG_INF_WHEN.get(e.op)
    return rule(e) if rule else FALSE


def zero_when(e: Expr) -> Expr:
    rule = ZERO_WHEN.get(e.op)
    return rule(e) if rule else FALSE


def _branches(c: Expr, wa: Expr, wb: Expr) -> Expr:
    return call("or", call("and", true_when(c), wa), call("and", false_when(c), wb))


def _static(c: Expr) -> bool:
    """A condition of indices and loads only (a mask), which the block scan can evaluate."""
    return not refs(c, "dot") and not refs(c, "red") and not refs(c, "scan")


def true_when(c: Expr) -> Expr:
    """A predicate implying the condition ``c``: ``c`` itself for a mask, else by ``TRUE_WHEN``
    (softpick's ``isfinite(s)`` holds where s is not masked), else never."""
    rule = TRUE_WHEN.get(c.op)
    found = rule(c) if rule else None
    return found if found is not None else c if _static(c) else FALSE


def false_when(c: Expr) -> Expr:
    """A predicate implying ``not c`` (see ``true_when``)."""
    rule = FALSE_WHEN.get(c.op)
    found = rule(c) if rule else None
    return found if found is not None else call("not", c) if _static(c) else FALSE


def finite_when(e: Expr) -> Expr:
    rule = FINITE_WHEN.get(e.op)
    return rule(e) if rule else FALSE


def _float_class(c: Expr) -> tuple[str, Expr] | None:
    """("finite", x) for ``isfinite(x)`` (captured as abs(x) < inf), ("inf", x) for ``isinf(x)``
    (abs(x) == inf) or ``isneginf(x)`` (x == -inf); else None."""
    if len(c.args) != 2:
        return None
    a, b = c.args
    if b.op == "const" and b.args[0] == math.inf and a.op == "abs" and c.op in ("lt", "eq"):
        return ("finite" if c.op == "lt" else "inf"), a.args[0]
    if b.op == "const" and b.args[0] == NEG_INF and c.op == "eq":
        return "inf", a
    return None


# a float class test -> (predicate under which it holds, under which it fails)
CLASS_WHEN: dict[str, tuple[Callable[[Expr], Expr], Callable[[Expr], Expr]]] = {
    "finite": (finite_when, neg_inf_when),
    "inf": (neg_inf_when, finite_when),
}


def _class_rule(holds: bool) -> Callable[[Expr], Expr | None]:
    def rule(c: Expr) -> Expr | None:
        found = _float_class(c)
        return None if found is None else CLASS_WHEN[found[0]][0 if holds else 1](found[1])
    return rule


# Conditions that read the scores, as predicates of the masks: c holds (TRUE_WHEN), c fails
# (FALSE_WHEN) wherever the predicate does. Rows return None to decline.
TRUE_WHEN: dict[str, Callable[[Expr], Expr | None]] = {
    "lt": _class_rule(True), "eq": _class_rule(True),
    "not": lambda c: false_when(c.args[0]),
    "and": lambda c: call("and", true_when(c.args[0]), true_when(c.args[1])),
    "or": lambda c: call("or", true_when(c.args[0]), true_when(c.args[1])),
}
FALSE_WHEN: dict[str, Callable[[Expr], Expr | None]] = {
    "lt": _class_rule(False), "eq": _class_rule(False),
    "not": lambda c: true_when(c.args[0]),
    "and": lambda c: call("or", false_when(c.args[0]), false_when(c.args[1])),
    "or": lambda c: call("and", false_when(c.args[0]), false_when(c.args[1])),
}

# e is finite whenever the predicate holds (scores are: as NEG_INF_WHEN assumes).
FINITE_WHEN: dict[str, Callable[[Expr], Expr]] = {
    "const": lambda e: TRUE if e.kind != "f" or math.isfinite(e.args[0]) else FALSE,
    "dot": lambda e: TRUE,
    "where": lambda e: _branches(e.args[0], finite_when(e.args[1]), finite_when(e.args[2])),
    "add": lambda e: call("and", finite_when(e.args[0]), finite_when(e.args[1])),
    "sub": lambda e: call("and", finite_when(e.args[0]), finite_when(e.args[1])),
    "mul": lambda e: call("and", finite_when(e.args[0]), finite_when(e.args[1])),
    "div": lambda e: finite_when(e.args[0]) if e.args[1].op == "const" and e.args[1].args[0] else FALSE,
    "neg": lambda e: finite_when(e.args[0]),
    "to_f": lambda e: finite_when(e.args[0]),
    "stop": lambda e: finite_when(e.args[0]),
}


def nonneg(e: Expr) -> bool:
    """Is ``e`` >= 0 (or NaN) wherever it is defined, by ``SIGN``?"""
    rule = SIGN.get(e.op)
    return rule(e, 1) if rule else False


def nonpos(e: Expr) -> bool:
    """Is ``e`` <= 0 (or NaN) wherever it is defined, by ``SIGN``?"""
    rule = SIGN.get(e.op)
    return rule(e, -1) if rule else False


def _signed(e: Expr, s: int) -> bool:
    return nonneg(e) if s > 0 else nonpos(e)


def _cancels(e: Expr, s: int) -> bool:
    """(a + b) - b has a's sign, rounded too (rounding is monotone: a <= 0 gives a + b <= b):
    a flipped cumulative sum less the key's own term, the sum over the keys after it."""
    a, b = e.args
    return a.op == "add" and a.args[1] == b and _signed(a.args[0], s)


# op -> whether its value has sign s (1: >= 0, -1: <= 0) given its operands' signs
SIGN: dict[str, Callable[[Expr, int], bool]] = {
    "const": lambda e, s: e.kind != "b" and s * e.args[0] >= 0,
    "exp": lambda e, s: s > 0, "exp2": lambda e, s: s > 0, "abs": lambda e, s: s > 0,
    "relu": lambda e, s: s > 0, "sigmoid": lambda e, s: s > 0, "sqrt": lambda e, s: s > 0,
    "log1p": lambda e, s: _signed(e.args[0], s),
    "neg": lambda e, s: _signed(e.args[0], -s),
    "add": lambda e, s: _signed(e.args[0], s) and _signed(e.args[1], s),
    "sub": lambda e, s: (_signed(e.args[0], s) and _signed(e.args[1], -s)) or _cancels(e, s),
    "mul": lambda e, s: any(_signed(e.args[0], t) and _signed(e.args[1], s * t) for t in (1, -1)),
    "minimum": lambda e, s: (_signed(e.args[0], s) and _signed(e.args[1], s)) if s > 0 else
                            (_signed(e.args[0], s) or _signed(e.args[1], s)),
    "maximum": lambda e, s: (_signed(e.args[0], s) or _signed(e.args[1], s)) if s > 0 else
                            (_signed(e.args[0], s) and _signed(e.args[1], s)),
    "where": lambda e, s: _signed(e.args[1], s) and _signed(e.args[2], s),
    "to_f": lambda e, s: e.args[0].kind != "b" and _signed(e.args[0], s),
    "stop": lambda e, s: _signed(e.args[0], s),
}


def _relu_zero_when(e: Expr) -> Expr:
    """relu(x) is 0 where x is -inf, or x = a - b with a = 0 and b >= 0 (softpick's
    ``relu(exp(s - m) - exp(-m))`` at a masked s)."""
    x = e.args[0]
    if x.op == "sub" and nonneg(x.args[1]):
        return call("or", neg_inf_when(x), zero_when(x.args[0]))
    return neg_inf_when(x)


# e == -inf whenever the predicate holds (non-masked scores are finite).
NEG_INF_WHEN: dict[str, Callable[[Expr], Expr]] = {
    "const": lambda e: TRUE if e.args[0] == NEG_INF else FALSE,
    "where": lambda e: _branches(e.args[0], neg_inf_when(e.args[1]), neg_inf_when(e.args[2])),   # masks
    "add": lambda e: call("or", neg_inf_when(e.args[0]), neg_inf_when(e.args[1])),   # -inf + finite
    "sub": lambda e: neg_inf_when(e.args[0]),                                        # -inf - finite
    "mul": lambda e: neg_inf_when(e.args[0]) if _pos_const(e.args[1]) else
                     neg_inf_when(e.args[1]) if _pos_const(e.args[0]) else FALSE,    # c * -inf, c > 0
    "div": lambda e: neg_inf_when(e.args[0]) if _pos_const(e.args[1]) else FALSE,
    "minimum": lambda e: call("or", neg_inf_when(e.args[0]), neg_inf_when(e.args[1])),
    "maximum": lambda e: call("and", neg_inf_when(e.args[0]), neg_inf_when(e.args[1])),
    "to_f": lambda e: neg_inf_when(e.args[0]),
    "stop": lambda e: neg_inf_when(e.args[0]),
}

UNDERFLOW = -1100.0     # exp(x) and exp2(x) of x <= this are 0, in float64 as in float32


def underflow_when(e: Expr) -> Expr:
    rule = UNDERFLOW_WHEN.get(e.op)
    return rule(e) if rule else FALSE


def _sum_under(a: Expr, b: Expr) -> Expr:
    """a + b <= UNDERFLOW: one term is and the other is <= 0."""
    return call("or", underflow_when(a) if nonpos(b) else FALSE, underflow_when(b) if nonpos(a) else FALSE)


# e <= UNDERFLOW (or -inf) whenever the predicate holds: a large negative fill (stick-breaking's
# ``masked_fill(mask, -1e5)`` of its log-weights) plus a term that cannot be positive.
UNDERFLOW_WHEN: dict[str, Callable[[Expr], Expr]] = {
    "const": lambda e: TRUE if e.kind == "f" and e.args[0] <= UNDERFLOW else FALSE,
    "where": lambda e: _branches(e.args[0], underflow_when(e.args[1]), underflow_when(e.args[2])),
    "add": lambda e: call("or", neg_inf_when(e), _sum_under(*e.args)),
    "sub": lambda e: call("or", neg_inf_when(e), underflow_when(e.args[0]) if nonneg(e.args[1]) else FALSE),
    "mul": lambda e: call("or", neg_inf_when(e), underflow_when(e.args[0]) if _at_least_one(e.args[1]) else
                          underflow_when(e.args[1]) if _at_least_one(e.args[0]) else FALSE),
    "to_f": lambda e: underflow_when(e.args[0]),
    "stop": lambda e: underflow_when(e.args[0]),
}


def _at_least_one(c: Expr) -> bool:
    return c.op == "const" and c.kind == "f" and c.args[0] >= 1


# e == 0 whenever the predicate holds.
ZERO_WHEN: dict[str, Callable[[Expr], Expr]] = {
    "const": lambda e: TRUE if e.args[0] == 0 else FALSE,
    "exp": lambda e: call("or", neg_inf_when(e.args[0]), underflow_when(e.args[0])),  # exp(-inf) = 0
    "exp2": lambda e: call("or", neg_inf_when(e.args[0]), underflow_when(e.args[0])),
    "mul": lambda e: call("or", zero_when(e.args[0]), zero_when(e.args[1])),
    "div": lambda e: zero_when(e.args[0]),
    "div_safe": lambda e: zero_when(e.args[0]),
    "where": lambda e: _branches(e.args[0], zero_when(e.args[1]), zero_when(e.args[2])),
    "to_f": lambda e: zero_when(e.args[0]),
    "stop": lambda e: zero_when(e.args[0]),
    "relu": _relu_zero_when,
    "abs": lambda e: zero_when(e.args[0]),
}


def dead_predicate(region: Region, members: list[int]) -> Expr:
    """D(b, m, n): every reduction in ``members`` gets its identity at (b, m, n)."""
    dead = TRUE
    for j in members:
        r = region.reductions[j]
        body = signed_scans(region, r.body)
        dead = call("and", dead, neg_inf_when(body) if r.kind in ("max", "kth") else zero_when(body))
    return dead


def signed_scans(region: Region, e: Expr) -> Expr:
    """``e`` with each scan leaf whose body has a sign clamped to it (``minimum(scan, 0)`` for a
    sum of non-positive terms: the same value, with the sign ``SIGN`` can read)."""
    def clamp(x: Expr) -> Expr | None:
        if x.op != "scan":
            return None
        body = region.reductions[x.args[0]].body
        return call("minimum", x, const(0.0)) if nonpos(body) else \
            call("maximum", x, const(0.0)) if nonneg(body) else None
    return substitute(e, clamp)


def _dead_value(e: Expr) -> bool:
    """0 or -inf. (Not a finite fill that underflows: a mask filled with finfo.min, whose dead
    blocks are not proven, would then lose its mask-free blocks and run one masked loop.)"""
    return e.op == "const" and e.kind == "f" and e.args[0] in (0.0, NEG_INF)


def live_branch(e: Expr) -> tuple[Expr, Expr] | None:
    """For a mask ``where`` (one branch -inf or 0): (condition that keeps the other branch, it)."""
    if e.op != "where":
        return None
    c, a, b = e.args
    if _dead_value(b) and not _dead_value(a):
        return c, a
    if _dead_value(a) and not _dead_value(b):
        return call("not", c), b
    return None


def full_predicate(bodies: list[Expr]) -> Expr:
    """F(b, m, n): every mask ``where`` in the bodies keeps its live branch. On a block where F is
    proven, ``full_body`` is exact."""
    keep = TRUE
    for body in bodies:
        for x in walk(body):
            lb = live_branch(x)
            if lb is not None:
                keep = call("and", keep, true_when(lb[0]))
    return keep


def full_body(body: Expr) -> Expr:
    """The body with every mask ``where`` replaced by its live branch."""
    return substitute(body, lambda x: (live_branch(x) or (None, None))[1])


def useful(dead: Expr) -> bool:
    """Worth a block scan: the predicate can be false and depends on the key index."""
    return not (dead.op == "const") and "n" in free_vars(dead) and not refs(dead, "dot")


def reads_loaded_rows(dead: Expr) -> bool:
    """Does the dead predicate read a loaded tensor at the query position? Document ids do
    (``ids[m] != ids[n]``): each query block's live key blocks are then a short run, while a key
    padding mask (``valid[n]``) or an index mask (causal) reads none."""
    return any(x.op == "load" and any("m" in free_vars(i) for i in x.args[1]) for x in walk(dead))


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockStat:
    """Min and max of input ``input`` along ``dim`` per ``STAT_BLOCK`` positions; the kernel
    reads them as aux{k}_min / aux{k}_max with the input's other dims and reduces the entries of
    its BLOCK_M or BLOCK_N blocks, as the load's index is m or n (one statistic serves both: ids
    compared along m and along n)."""
    input: int
    dim: int


EXACT = {"add": "{0} + {1}", "sub": "{0} - {1}", "neg": "-{0}", "mul": "{0} * {1}",
         "idiv": "fl_floordiv({0}, {1})", "floordiv": "fl_floordiv({0}, {1})", "imod": "fl_mod({0}, {1})",
         "mod": "fl_mod({0}, {1})", "minimum": "tl.minimum({0}, {1})", "maximum": "tl.maximum({0}, {1})",
         "abs": "tl.abs({0})"}


class IntervalWriter:
    """Emits scalar Triton code for the interval of an expression over one (M, N) block."""

    def __init__(self, region: Region, stats: list[BlockStat], lines: list[str], fresh, vector: str = "n",
                 arange=lambda n: f"tl.arange(0, {n})", names: dict[str, tuple[str, str]] | None = None):
        """``vector``: the var whose blocks the code scans as a vector (the forward and dQ: key
        blocks ``blk``; dK/dV: query blocks ``pid_m``); the other var's block is a scalar.
        ``arange(n)``: the code of a range over a block's statistics entries (along axis 1 of
        the scanned blocks; a Gluon kernel gives it a layout). ``names``: the code's names of
        the block's bounds per var (default ``m_lo``, ``m_hi``, ``n_lo``, ``n_hi``)."""
        self.r, self.stats, self.lines, self.fresh = region, stats, lines, fresh
        self.vector, self.arange = vector, arange
        self.names = names or {v: (f"{v}_lo", f"{v}_hi") for v in ("m", "n")}
        self.memo: dict[Expr, tuple[str, str] | None] = {}

    def live(self, dead: Expr) -> str:
        """Name of a scalar that is false only when ``dead`` holds on the whole block."""
        _, may_false = self.truth(dead)
        return may_false

    # -- booleans: (may be true, may be false) --------------------------------------------------
    def truth(self, e: Expr) -> tuple[str, str]:
        key = ("truth", e)
        if key not in self.memo:
            self.memo[key] = self._truth(e)
        return self.memo[key]

    def _truth(self, e: Expr) -> tuple[str, str]:
        if e.op == "const":
            return ("True", "False") if e.args[0] else ("False", "True")
        if e.op == "not":
            t, f = self.truth(e.args[0])
            return f, t
        if e.op in ("and", "or"):
            (ta, fa), (tb, fb) = self.truth(e.args[0]), self.truth(e.args[1])
            if e.op == "and":
                return self._let(f"{ta} & {tb}"), self._let(f"{fa} | {fb}")
            return self._let(f"{ta} | {tb}"), self._let(f"{fa} & {fb}")
        if e.op in ("lt", "le", "gt", "ge", "eq", "ne"):
            a, b = self.interval(e.args[0]), self.interval(e.args[1])
            if a is None or b is None:
                return "True", "True"
            (alo, ahi), (blo, bhi) = a, b
            if e.op in ("gt", "ge"):       # a > b  <=>  b < a
                (alo, ahi), (blo, bhi) = (blo, bhi), (alo, ahi)
            strict = e.op in ("lt", "gt")
            # Triton's interpreter types a float comparison as float (its data 0.0 / 1.0), and an
            # & with a boolean then fails or, in a where, misreads it: through int8 it is a
            # boolean there too (a no-op once compiled). Integer comparisons need nothing.
            wrap = "({}).to(tl.int8) != 0" if "f" in (e.args[0].kind, e.args[1].kind) else "{}"
            if e.op in ("lt", "le", "gt", "ge"):
                cmp, ncmp = ("<", ">=") if strict else ("<=", ">")
                return (self._let(wrap.format(f"{alo} {cmp} {bhi}")),
                        self._let(wrap.format(f"{ahi} {ncmp} {blo}")))
            overlap = self._let(f"({wrap.format(f'{alo} <= {bhi}')}) & ({wrap.format(f'{blo} <= {ahi}')})")
            single = self._let(f"({wrap.format(f'{alo} == {ahi}')}) & ({wrap.format(f'{blo} == {bhi}')}) & "
                               f"({wrap.format(f'{alo} == {blo}')})")
            may_t, may_f = overlap, self._let(f"{single} == 0")
            return (may_t, may_f) if e.op == "eq" else (may_f, may_t)
        if e.kind == "b" and e.op in ("load", "to_b"):
            iv = self.interval(e.args[0] if e.op == "to_b" else e)
            if iv is not None:
                return self._let(f"{iv[1]} != 0"), self._let(f"{iv[0]} == 0")
        return "True", "True"

    # -- numbers: (lo, hi) or None for unknown -------------------------------------------------
    def interval(self, e: Expr) -> tuple[str, str] | None:
        if e not in self.memo:
            self.memo[e] = self._interval(e)
        return self.memo[e]

    def _interval(self, e: Expr):
        op, a = e.op, e.args
        if op == "var":
            return self.names.get(a[0], (a[0], a[0]))
        if op == "const":
            if e.kind == "b" or (isinstance(a[0], float) and not math.isfinite(a[0])):
                return None
            return (repr(a[0]), repr(a[0]))
        if op == "load":
            return self._load(e)
        if op in ("red", "dot", "tile"):    # an earlier pass's row value (a key padding length reduced
            return None                     # from ids), a product: not bounded per block here
        if op in ("to_i", "to_f", "stop"):
            return self.interval(a[0]) if a[0].kind != "b" else None
        args = [self.interval(x) for x in a if x.kind != "b"]
        if any(x is None for x in args):
            return None
        if op in EXACT and all(lo == hi for lo, hi in args) and len(args) == len(a):
            v = self._let(EXACT[op].format(*(lo for lo, _ in args)))    # batch-only: one value
            return v, v
        if op == "add":
            (alo, ahi), (blo, bhi) = args
            return self._let(f"{alo} + {blo}"), self._let(f"{ahi} + {bhi}")
        if op == "sub":
            (alo, ahi), (blo, bhi) = args
            return self._let(f"{alo} - {bhi}"), self._let(f"{ahi} - {blo}")
        if op == "neg":
            lo, hi = args[0]
            return self._let(f"-{hi}"), self._let(f"-{lo}")
        if op == "mul":
            (alo, ahi), (blo, bhi) = args
            p = [self._let(f"{x} * {y}") for x in (alo, ahi) for y in (blo, bhi)]
            return (self._let(f"tl.minimum(tl.minimum({p[0]}, {p[1]}), tl.minimum({p[2]}, {p[3]}))"),
                    self._let(f"tl.maximum(tl.maximum({p[0]}, {p[1]}), tl.maximum({p[2]}, {p[3]}))"))
        if op in ("idiv", "floordiv") and _pos_const(a[1]) and a[1].kind == "i":
            (lo, hi), k = args[0], a[1].args[0]
            return self._let(f"fl_floordiv({lo}, {k})"), self._let(f"fl_floordiv({hi}, {k})")
        if op in ("imod", "mod") and _pos_const(a[1]) and a[1].kind == "i":
            return "0", repr(a[1].args[0] - 1)
        if op in ("minimum", "maximum"):
            (alo, ahi), (blo, bhi) = args
            f = f"tl.{op}"
            return self._let(f"{f}({alo}, {blo})"), self._let(f"{f}({ahi}, {bhi})")
        if op == "abs":
            lo, hi = args[0]
            return (self._let(f"tl.where({lo} > 0, {lo}, tl.where({hi} < 0, -{hi}, 0))"),
                    self._let(f"tl.maximum(-{lo}, {hi})"))
        if op == "where":
            (alo, ahi), (blo, bhi) = args
            # a condition decided on the whole block picks its branch's interval (a negative
            # index wrapped by torch's indexing, where(i < 0, i + size, i), for i >= 0)
            may_t, may_f = self.truth(a[0])
            if may_f == "False" or may_t == "False":
                return (alo, ahi) if may_f == "False" else (blo, bhi)
            lo, hi = self._let(f"tl.minimum({alo}, {blo})"), self._let(f"tl.maximum({ahi}, {bhi})")
            if (may_t, may_f) == ("True", "True"):
                return lo, hi
            return (self._let(f"tl.where({may_f}, tl.where({may_t}, {lo}, {blo}), {alo})"),
                    self._let(f"tl.where({may_f}, tl.where({may_t}, {hi}, {bhi}), {ahi})"))
        return None

    def _load(self, e: Expr):
        i, idx = e.args
        inner = [(d, x) for d, x in enumerate(idx) if free_vars(x) & {"m", "n", "dk", "dv"}]
        if not inner:      # batch-only index: the exact value
            ptr = " + ".join([f"in{i}_ptr"] + [f"{self._index(x)} * in{i}_s{d}" for d, x in enumerate(idx)
                                               if not (x.op == "const" and x.args[0] == 0)])
            v = self._let(f"tl.load({ptr})")
            return v, v
        if len(inner) != 1 or inner[0][1].op != "var" or inner[0][1].args[0] not in ("m", "n"):
            return None
        d, v = inner[0]
        stat, var = BlockStat(i, d), v.args[0]
        if stat not in self.stats:
            self.stats.append(stat)
        k = self.stats.index(stat)
        blk, block, size = ("pid_m", "BLOCK_M", "M") if var == "m" else ("blk", "BLOCK_N", "N")
        # the block's STAT_BLOCK entries, clamped to the last one: a repeat is neutral for min and
        # max, and keeps blocks past the end (masked later) in bounds
        vec = var == self.vector
        sub = self.arange(f"{block} // {STAT_BLOCK}")
        first = f"{blk}[:, None] * ({block} // {STAT_BLOCK}) + {sub}[None, :]" if vec else \
            f"{blk} * ({block} // {STAT_BLOCK}) + {sub}"
        entry = self._let(f"tl.minimum({first}, ({size} - 1) // {STAT_BLOCK})")
        offs = [f"{entry if dd == d else self._index(x)} * aux{k}_s{dd}" for dd, x in enumerate(idx)
                if dd == d or not (x.op == "const" and x.args[0] == 0)]
        off = " + ".join(offs)
        axis = 1 if vec else 0
        return (self._let(f"tl.min(tl.load(aux{k}_min + {off}), {axis})"),
                self._let(f"tl.max(tl.load(aux{k}_max + {off}), {axis})"))

    def _index(self, x: Expr) -> str:
        iv = self.interval(x)
        assert iv is not None and iv[0] == iv[1], x
        return iv[0]

    def _let(self, code: str) -> str:
        name = self.fresh("iv")
        self.lines.append(f"{name} = {code}")
        return name
