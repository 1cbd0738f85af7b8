"""How expressions change when a running max grows: the algebra behind the online softmax
(``rewrite.make_online``) and behind the backward's treatment of a max (``shift_gradients``).

A max m = red j over the keys *shifts* the sums whose summands read it only as exp(x - m): when
m becomes m', each such summand scales by exp(m - m') > 0 (``scales``, table ``ONLINE``). A sum
run in m's pass (online) is rescaled by that factor as m grows, which is safe only where every
exp(x - m) stays <= 1 under the running max: x a key's own score (the max saw it first), or a
row value the max starts from (its extra element, ``bounded``). Otherwise the sum takes a later
pass, where m is final — the algebra is the same, which is what the backward needs.

Whether the program's outputs depend on m at all is ``degree``: an output of degree 0 in the
sums m shifts (and in its own exp(x - m) terms) is invariant, and the backward treats m as a
constant; else m takes a gradient at its argmax (``shift_gradients``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .expr import Expr, const, free_vars, red, refs, walk

if TYPE_CHECKING:
    from .region import Region


def _free(e: Expr, j: int) -> bool:
    return j not in refs(e, "red")


def is_zero(e: Expr) -> bool:
    return e.op == "const" and e.args[0] == 0


@dataclass(frozen=True)
class Shift:
    """The max red ``j`` a summand may scale with: its units (``base2``: exp2), the element it
    starts from (``extra``: a constant, a sink logit), and whether the sum runs in its pass
    (``online``: then every exp(x - m) must be ``bounded``)."""
    j: int
    base2: bool = False
    extra: Expr | None = None
    online: bool = True

    @staticmethod
    def of(region: "Region", j: int, online: bool = True) -> "Shift":
        m = region.reductions[j]
        return Shift(j, m.base2, m.extra, online)


def _dominated(x: Expr, extra: Expr | None) -> bool:
    """Is x <= the max's starting element: x is it (a sink's exp(sink - m)), one of its maximum's
    arguments, or a constant at most it (softmax_1's exp(0 - m) under a clamp at 0)?"""
    if extra is None:
        return False
    if x == extra or (extra.op == "maximum" and any(_dominated(x, a) for a in extra.args)):
        return True
    return x.op == "const" and extra.op == "const" and x.kind == "f" and x.args[0] <= extra.args[0]


def bounded(x: Expr, s: Shift) -> bool:
    """exp(x - m) <= 1 under the running max: x a score at this key (the max's pass saw it
    before the sums read it), or dominated by the max's starting element. exp(-m) under an
    unseeded max is not: exp(-m_running) overflows where an early block's max is below -88, and
    while the running max is -inf the rescale by exp(-inf - m) would drop its terms."""
    return "n" in free_vars(x) or bool(refs(x, "dot")) or _dominated(x, s.extra)


def shifted(e: Expr, j: int) -> Expr | None:
    """x when e = f(x - red j) with x free of red j, or 0 when e = f(-red j) (``exp(-m)``:
    softmax_1's and softpick's row term); else None."""
    a = e.args[0]
    if a.op == "sub" and a.args[1] == red(j) and _free(a.args[0], j):
        return a.args[0]
    return const(0.0) if a.op == "neg" and a.args[0] == red(j) else None


def _shift(e: Expr, s: Shift) -> bool:
    x = shifted(e, s.j)
    return x is not None and (not s.online or bounded(x, s))


# scales(e, s): e(m') == e(m) * exp(m - m') where m = red(s.j), the running max.
ONLINE: dict[str, Callable[[Expr, Shift], bool]] = {
    # exp(x - m), or exp2(x - m) when m is in log2 units (only the base-2 rule writes that)
    "exp": lambda e, s: not s.base2 and _shift(e, s),
    "exp2": lambda e, s: s.base2 and _shift(e, s),
    "mul": lambda e, s: (scales(e.args[0], s) and _free(e.args[1], s.j)) or
    (_free(e.args[0], s.j) and scales(e.args[1], s)),
    "div": lambda e, s: scales(e.args[0], s) and _free(e.args[1], s.j),
    "div_safe": lambda e, s: scales(e.args[0], s) and _free(e.args[1], s.j),
    "neg": lambda e, s: scales(e.args[0], s),
    "add": lambda e, s: scales(e.args[0], s) and scales(e.args[1], s),     # e(m) + f(m) scale alike
    "sub": lambda e, s: scales(e.args[0], s) and scales(e.args[1], s),
    "where": lambda e, s: _free(e.args[0], s.j) and all(scales(a, s) or is_zero(a) for a in e.args[1:]),
    "to_f": lambda e, s: scales(e.args[0], s),
    # positively homogeneous: f(c x) = c f(x) for the factor c = exp(m - m') > 0 (softpick's
    # relu(exp(s - m) - exp(-m)) over sum |exp(s - m) - exp(-m)|)
    "relu": lambda e, s: scales(e.args[0], s),
    "abs": lambda e, s: scales(e.args[0], s),
    "maximum": lambda e, s: all(scales(a, s) or is_zero(a) for a in e.args),
    "minimum": lambda e, s: all(scales(a, s) or is_zero(a) for a in e.args),
}


def scales(e: Expr, s: Shift) -> bool:
    rule = ONLINE.get(e.op)
    return bool(rule and rule(e, s))


def shifted_sums(region: "Region", j: int) -> list[int]:
    """The sums and P @ V products max j shifts: online in its pass, or in a later pass with
    summands (and extra elements) that scale with it and read no other reduction."""
    found = []
    for k, r in enumerate(region.reductions):
        if r.kind == "max" or j not in refs(r.body, "red"):
            continue
        exprs = [r.body] + ([r.extra] if r.extra is not None else [])
        later = all(refs(e, "red") <= {j} and scales(e, Shift.of(region, j, online=False)) for e in exprs)
        if r.online == j or later:
            found.append(k)
    return found


# the degree of a constant 0, which is of every degree (c 0 = 0): it takes its siblings'
ANY = math.inf


def _same(ds: list[float]) -> float | None:
    live = [d for d in ds if d != ANY]
    return ANY if not live else live[0] if all(d == live[0] for d in live) else None


def _quotient(ds: list[float]) -> float | None:
    return ANY if ds[0] == ANY else None if ds[1] == ANY else ds[0] - ds[1]


def _compare(ds: list[float]) -> float | None:
    """a < b iff c^d a < c^d b (c > 0): a comparison of equal degrees is invariant."""
    return None if _same(ds) is None else 0.0


# How an expression changes when the shift m of a group of sums G grows: the sums scale by some
# c > 0 (c = exp(m_old - m_new), exp2 in base 2) and m moves by -log c (in its own units). An
# expression either scales, e -> c^d e (degree d), or moves, e -> e + a ln c (a move a);
# invariant is degree 0, which is move 0 too. Each DEGREE row: op -> degrees of the arguments ->
# degree (None: not homogeneous).
DEGREE: dict[str, Callable[[list[float]], float | None]] = {
    "mul": lambda d: d[0] + d[1],
    "div": _quotient,
    "div_safe": _quotient,      # b == 0 iff c b == 0 (c > 0)
    "add": _same, "sub": _same, "maximum": _same, "minimum": _same,
    "neg": lambda d: d[0], "to_f": lambda d: d[0],
    "relu": lambda d: d[0], "abs": lambda d: d[0],      # c > 0: relu(c x) = c relu(x), |c x| = c |x|
    "where": lambda d: _same(d[1:]) if d[0] == 0 else None,
    **{op: _compare for op in ("gt", "lt", "ge", "le", "eq", "ne")},
}
LN2 = math.log(2.0)


def _const(e: Expr) -> float | None:
    return float(e.args[0]) if e.op == "const" and e.kind == "f" else None


# Each MOVES row: (node, [(kind, value) of the arguments: kind "mul" (a degree) or "add" (a move)])
# -> (kind, value), or None to leave the node to DEGREE: exp of a move scales (softmax's
# exp(s - m)), log of a scaled value moves (a logsumexp's log l), moves add.
def _moved(ch: tuple) -> float | None:
    return ch[1] if ch[0] == "add" else 0.0 if ch[1] in (0, ANY) else None


def _scaled(ch: tuple) -> float | None:
    return ch[1] if ch[0] == "mul" else None


def _logged(ch: tuple, unit: float) -> tuple | None:
    """log of c^d x moves by d ln c (log(0) = -inf stays)."""
    d = _scaled(ch)
    return None if d is None else ("add", 0.0 if d == ANY else d * unit)


def _moves_sum(x: Expr, ch: list) -> tuple | None:
    if not any(c[0] == "add" for c in ch) or any(_moved(c) is None for c in ch):
        return None
    a = [_moved(c) for c in ch]
    return "add", a[0] + a[1] if x.op == "add" else a[0] - a[1] if x.op == "sub" else -a[0]


def _moves_scaled(x: Expr, ch: list) -> tuple | None:
    """A move times (or over) a constant."""
    k = [_const(a) for a in x.args]
    for i in (0, 1) if x.op == "mul" else (0,):
        if ch[i][0] == "add" and k[1 - i] is not None and (x.op == "mul" or k[1 - i] != 0):
            return "add", ch[i][1] * k[1 - i] if x.op == "mul" else ch[i][1] / k[1 - i]
    return None


MOVES: dict[str, Callable[[Expr, list], tuple | None]] = {
    "exp": lambda x, ch: None if _moved(ch[0]) is None else ("mul", _moved(ch[0])),
    "exp2": lambda x, ch: None if _moved(ch[0]) is None else ("mul", _moved(ch[0]) * LN2),
    "log": lambda x, ch: _logged(ch[0], 1.0),
    "log2": lambda x, ch: _logged(ch[0], 1 / LN2),
    "add": _moves_sum, "sub": _moves_sum, "neg": _moves_sum,
    "mul": _moves_scaled, "div": _moves_scaled,
}


def degree(e: Expr, group: set[int] | dict[int, float | None], shift: int | None = None,
           base2: bool = False, scan: int | None = None) -> float | None:
    """The degree of ``e`` in the sums ``group`` (a set: each of degree 1; a dict: each of its
    degree, None for one that does not scale): 0 where it is invariant (a move of 0 too), None
    where it neither scales nor stays. ``shift``: the max of the group, which moves by -ln c
    (-log2 c in ``base2`` units). A constant 0 is of any degree (``ANY``); ops without a row
    are of degree 0 when their arguments are (sigmoid(a/l)). ``scan``: a scan whose partial sums
    move by ln c instead (``scan_degree``)."""
    memo: dict[Expr, tuple | None] = {}
    for x in walk(e):
        if x.op == "red":
            j = x.args[0]
            d = (group[j] if isinstance(group, dict) else 1.0) if j in group else None
            memo[x] = ("mul", d) if d is not None else None if j in group else \
                ("add", -1 / LN2 if base2 else -1.0) if j == shift else ("mul", 0.0)
            continue
        if is_zero(x):
            memo[x] = ("mul", ANY)
            continue
        if x.op == "scan" and x.args[0] == scan:
            memo[x] = ("add", 1.0)
            continue
        if x.op == "stop":      # detach(): a constant to the gradient, which a shift's degree is
            memo[x] = ("mul", 0.0) if scan is None else memo[x.args[0]]     # about; a scan's: values
            continue
        ch = [memo[a] for a in x.args if isinstance(a, Expr)] if x.op != "load" else []
        if any(c is None for c in ch):
            memo[x] = None
            continue
        found = MOVES[x.op](x, ch) if x.op in MOVES else None
        if found is None:
            ds = [_scaled(c) if c[1] else 0.0 for c in ch]
            if any(d is None for d in ds):
                memo[x] = None
                continue
            d = DEGREE[x.op](ds) if x.op in DEGREE else 0.0 if all(d in (0, ANY) for d in ds) else None
            found = None if d is None else ("mul", d)
        memo[x] = None if found is None else (found[0], round(found[1], 9))
    ch = memo[e]
    return None if ch is None else 0.0 if ch[1] == ANY else ch[1] if ch[0] == "mul" or ch[1] == 0 else None


def output_exprs(region: "Region") -> list[Expr]:
    """What the program returns: the output, then the extra row outputs (a logsumexp)."""
    return [region.out, *(row.expr for row in region.rows)]


def scaled_sums(region: "Region", j: int) -> dict[int, float | None]:
    """The degree of every reduction max j scales, or None where it changes but does not scale:
    its ``shifted_sums`` (degree 1), then, in order, every reduction whose body (or extra
    element) reads j or one found before — a later pass's sum over the normalised
    probabilities (sum of where(e / l > t, e, 0): degree 1; of e log(e / l): 1; of (e / l)^2:
    0). A max reading them is of degree 0 where its terms are (a temperature computed from an
    entropy), else None; so is any body ``degree`` cannot follow."""
    r = region.reductions[j]
    found: dict[int, float | None] = {k: 1.0 for k in shifted_sums(region, j)}
    for k, rd in enumerate(region.reductions):
        exprs = [rd.body] + ([rd.extra] if rd.extra is not None else [])
        if k in found or k == j or not any(refs(e, "red") & ({j} | set(found)) for e in exprs):
            continue
        ds = {degree(e, found, shift=j, base2=r.base2) for e in exprs}
        d = ds.pop() if len(ds) == 1 else None
        found[k] = d if rd.kind != "max" or d == 0 else None     # a max of invariant terms is invariant
    return found


def shift_gradients(region: "Region") -> list[int]:
    """The running maxima the output is not invariant to, which therefore take a gradient: a
    max m scales the sums it shifts (``online``) as exp(-m), and the later sums over their
    normalised terms by some power of it (``scaled_sums``); where the outputs are homogeneous
    of degree 0 in them and in its own exp(y - m) terms, dL/dm = 0 and the backward treats m as
    a constant. Otherwise (a softmax with an epsilon in its denominator: p = e / (sum e + eps),
    softpick's) dL/dm = dL/dm|direct - sum_k <dL/dr_k, r_k> over the sums r_k it shifts, and
    it reaches the score at the row's argmax, which the forward saves (``rowstat_columns``)."""
    found = []
    for j, r in enumerate(region.reductions):
        if r.kind != "max" or r.stopped:
            continue
        group = scaled_sums(region, j)
        if any(degree(e, group, shift=j, base2=r.base2) != 0 for e in output_exprs(region)):
            found.append(j)
    return found


def scan_degree(e: Expr, j: int) -> float | None:
    """d with e(S + t) = exp(d t) e(S) for every t, S scan j's partial sums (0: e does not read
    them), or None. A split of the keys computes its partial sums from 0; the keys of the other
    splits add a row constant C to them, so a sum of such an e is exp(d C) times the split's
    (stick-breaking's exp(log z + S) @ v: d = 1; ``codegen.split``)."""
    return degree(e, set(), scan=j) if j in refs(e, "scan") else 0.0
