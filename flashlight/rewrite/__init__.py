"""Algebra on reductions over N (DESIGN.md §3), as rule tables.

Tables:

* ``CONCAT``: a max / sum over scores with one column appended (``torch.cat`` of a sink logit)
  is the reduction over the N keys combined with the body at the appended position, which
  becomes the reduction's row-level ``extra`` element: the key loop is unchanged and the sink
  only seeds the running state.
* ``PULL``: a row-constant factor of a sum's or a ``dot`` reduction's summand moves out of the
  sum, so ``softmax(s) @ v`` needs no normalised P inside the loop, and post-softmax gates,
  second masks and re-normalisations (``p * g / (p * g).sum(-1)``) stay one pass.
* ``OFFSET``: ``sum(x * (y - c)) = sum(x * y) - c * sum(x)`` for a row constant c, so the
  attention entropy ``-sum(p * log p)`` is a sum in the same pass as the softmax.
* ``ONLINE`` (``ir.scaling``): when a summand depends on a running max ``m`` only through
  ``exp(x - m)``, each bounded by 1, it scales by ``exp(m_old - m_new)`` as ``m`` grows, so the
  reduction can run in the same pass as the max with a rescale (the flash-attention
  recurrence). Reductions that fit no rule run in a later pass of the same kernel, which
  recomputes the scores (see ``Region.passes``).
* ``clamp-shifts`` / ``seed-sums``: row terms of a clamped shift and of a normaliser become the
  reductions' ``extra`` elements (softmax_1 as a sink of logit 0).
* ``total-less-partial``: a sum of x less a prefix scan of x is a suffix scan of x (and the other
  way round): ``x.sum(-1, keepdim=True) - x.cumsum(-1)`` runs in one pass.

Rules return None to decline.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from ..ir import Dot, Expr, Reduction, Region, call, const, dot, free_vars, red, refs, substitute, var, verify, walk
from ..ir.expr import INDEXED, children, simplify
from ..ir.scaling import Shift, is_zero, scales, shifted


# reduce over n in [0, N] of f(cat_n(x, e)) = combine(reduce over n < N of f(x), f(e) at n = N).
# Each row: reduction kind -> how the element at the appended position joins the reduction.
CONCAT: dict[str, Callable[[Expr, Expr], Expr]] = {
    "max": lambda acc, x: call("maximum", acc, x),    # max(x_0 .. x_N) = max(max_{n<N} x_n, x_N)
    "sum": lambda acc, x: call("add", acc, x),        # sum(x_0 .. x_N) = sum_{n<N} x_n + x_N
}


def _has_cat(e: Expr) -> bool:
    return any(x.op == "cat_n" for x in walk(e))


def split_concat(region: Region) -> Region | None:
    """Every max / sum whose body reads an appended column loops over the keys only and gets the
    body at position N as its ``extra`` element (all at once, before ``online`` sees them)."""
    reds, changed = list(region.reductions), False
    n_at_end = const(region.N)
    for j, r in enumerate(reds):
        if r.kind not in CONCAT or not _has_cat(r.body):
            continue
        keys = substitute(r.body, lambda e: e.args[0] if e.op == "cat_n" else None)
        last = substitute(r.body, lambda e: e.args[1] if e.op == "cat_n" else n_at_end if e == var("n") else None)
        if refs(last, "dot") or _has_cat(keys):
            return None     # not the one-column layout capture builds
        extra = last if r.extra is None else CONCAT[r.kind](r.extra, last)
        reds[j] = replace(r, body=keys, extra=extra)
        changed = True
    return replace(region, reductions=reds) if changed else None


def _map(region: Region, fn: Callable[[Expr], Expr | None]) -> Region:
    """``region`` with ``substitute(e, fn)`` applied to every expression of ``Region.exprs``."""
    conv = lambda e: None if e is None else substitute(e, fn)        # noqa: E731
    reds = [replace(r, body=conv(r.body), extra=conv(r.extra)) for r in region.reductions]
    return replace(region, reductions=reds, out=conv(region.out),
                   rows=[replace(x, expr=conv(x.expr)) for x in region.rows])


def _through(region: Region, j: int, form: Callable[[Expr], Expr | None]) -> tuple[Region, Expr] | None:
    """When red j is read only as ``form(e)`` of one and the same (other) argument: the region
    with those reads replaced by red j itself, and the argument; else None."""
    found = [x for e in region.exprs() for x in walk(e) if form(x) is not None]
    if not found:
        return None
    target, arg = found[0], form(found[0])
    hole = var("red_through")
    new = _map(region, lambda x: hole if x == target else None)
    if any(j in refs(e, "red") for e in new.exprs()):
        return None         # read some other way too
    return _map(new, lambda x: red(j) if x == hole else None), arg


def _other_arg(x: Expr, op: str, j: int, ok: Callable[[Expr], bool]) -> Expr | None:
    """b when x is ``op(red j, b)`` or ``op(b, red j)`` and ``ok(b)``."""
    if x.op != op:
        return None
    for a, b in (x.args, x.args[::-1]):
        if a == red(j) and ok(b):
            return b
    return None


def _as_float(c: Expr) -> Expr:
    if c.kind == "f":
        return c
    return const(float(c.args[0])) if c.op == "const" else call("to_f", c)


def clamp_shifts(region: Region) -> Region | None:
    """A running max read only as ``maximum(max_n x, c)`` for a row value c is the max over the
    keys and one more element c, the max's ``extra`` (as a sink logit's): softmax_1 ("quiet"
    attention) clamps its shift at 0, ``m = s.amax(-1).clamp(min=0)``, so that its +1 term
    ``exp(-m)`` cannot overflow. Its exp(-m) terms are then bounded (``ir.scaling.bounded``)
    and the sums that read them may run in its pass."""
    for j, r in enumerate(region.reductions):
        if r.kind != "max":
            continue
        ok = lambda c: row_constant(c, region) and not refs(c, "red")      # noqa: E731
        found = _through(region, j, lambda x: _other_arg(x, "maximum", j, ok))
        if found is None:
            continue
        new, c = found
        c = _as_float(c)
        reds = list(new.reductions)
        reds[j] = replace(reds[j], extra=c if r.extra is None else call("maximum", r.extra, c))
        return replace(new, reductions=reds)
    return None


def seed_sums(region: Region) -> Region | None:
    """A sum read only as ``sum_n x + t``, for a row value t that scales with the max that x
    scales with, is the sum seeded with t (its ``extra``, as a sink's exp(sink - m)) — where
    the max is seeded too, so that t is finite before the loop. softmax_1's normaliser
    ``exp(-m) + sum_n exp(s - m)`` then leaves the output free of the shift m, which the
    generated backward needs (``backward_support``)."""
    for k, r in enumerate(region.reductions):
        if r.kind != "sum" or r.scan:
            continue
        for j in refs(r.body, "red"):
            m = region.reductions[j]
            if m.kind != "max" or m.extra is None or not scales(r.body, Shift.of(region, j)):
                continue
            ok = lambda t: row_constant(t, region) and refs(t, "red") == {j} and scales(t, Shift.of(region, j))  # noqa: E731
            found = _through(region, k, lambda x: _other_arg(x, "add", k, ok))
            if found is None:
                continue
            new, t = found
            reds = list(new.reductions)
            reds[k] = replace(reds[k], extra=t if r.extra is None else call("add", r.extra, t))
            return replace(new, reductions=reds)
    return None


def row_constant(e: Expr, region: Region) -> bool:
    """Same value for every key n of a row: no ``n`` and no score tile."""
    return "n" not in free_vars(e) and not refs(e, "dot")


# Row factors: sum_n(f(x, r) * v) = g(sum_n(x * v), r) for a row constant r (no n, no scores).
# ``pull(e)`` splits a summand into x and the outer combinations g, innermost first; each row
# of PULL returns None to decline. Applies to sums and P @ V products alike.
Pulled = tuple[Expr, tuple[Callable[[Expr], Expr], ...]]


def _div_by_row(e: Expr, region: Region) -> Pulled | None:
    x, r = e.args
    if not row_constant(r, region) or row_constant(x, region):
        return None
    inner, gs = pull(x, region)
    return inner, gs + (lambda acc: call("div_safe", acc, r),)     # sum(x/r) = sum(x) / r; 0/0 -> 0


def _mul(e: Expr, region: Region) -> Pulled | None:
    a, b = e.args
    if row_constant(a, region) != row_constant(b, region):
        x, r = (b, a) if row_constant(a, region) else (a, b)
        inner, gs = pull(x, region)
        return inner, gs + (lambda acc: call("mul", acc, r),)      # sum(x*r) = sum(x) * r
    (xa, ga), (xb, gb) = pull(a, region), pull(b, region)
    return (call("mul", xa, xb), ga + gb) if ga or gb else None   # (x/r) * y = (x*y) / r


def _where(e: Expr, region: Region) -> Pulled | None:
    c, a, b = e.args
    for live, other, put in ((a, b, lambda x: call("where", c, x, other)), (b, a, lambda x: call("where", c, other, x))):
        if is_zero(other):
            inner, gs = pull(live, region)
            return (put(inner), gs) if gs else None                # where(c, x/r, 0) = where(c, x, 0) / r
    return None


PULL: dict[str, Callable[[Expr, Region], Pulled | None]] = {
    "div_safe": _div_by_row,
    "div": _div_by_row,
    "mul": _mul,
    "where": _where,
    "to_f": lambda e, region: (lambda p: (call("to_f", p[0]), p[1]) if p[1] else None)(pull(e.args[0], region)),
    "neg": lambda e, region: (lambda p: (p[0], p[1] + (lambda acc: call("neg", acc),)) if p[1] else None)(
        pull(e.args[0], region)),                                   # sum(-x) = -sum(x)
}


def pull(e: Expr, region: Region) -> Pulled:
    rule = PULL.get(e.op)
    return (rule(e, region) if rule else None) or (e, ())


def _replace_red(region: Region, j: int, new: Expr, reds: list) -> Region:
    """``region`` with reductions ``reds`` and every later read of red(j) replaced by ``new``."""
    swap = lambda e: substitute(e, lambda x: new if x == red(j) else None)   # noqa: E731
    reds = [replace(r, body=swap(r.body)) if i > j else r for i, r in enumerate(reds)]
    rows = [replace(x, expr=swap(x.expr)) for x in region.rows]
    return replace(region, reductions=reds, out=swap(region.out), rows=rows)


def factor_rows(region: Region) -> Region | None:
    for j, r in enumerate(region.reductions):
        if not r.additive or r.extra is not None or r.scan:
            continue     # (a sink element is not scaled by the factor: it would need dividing)
        x, gs = pull(r.body, region)
        if not gs:
            continue
        acc = red(j)
        for g in gs:
            acc = g(acc)
        reds = list(region.reductions)
        reds[j] = replace(r, body=x, online=None)     # online-ness is re-derived for the new body
        return _replace_red(region, j, acc, reds)
    return None


# Split sums: sum_n(x + y) = sum_n(x) + sum_n(y), for sums and P @ V products alike. The official
# DiffAttn spells its map as one product, (softmax(s1) - λ softmax(s2)) @ v: the summand reads two
# running maxes, so no single recurrence rescales it, and the product would need a second pass
# over the keys. Split, each part is one softmax's product (a row factor pulled out, then online)
# and the kernel keeps one pass, at the cost of one more accumulator. Applied only where the sum
# as written is not one-pass and every part is. Each row: op -> how the two parts' sums combine.
SPLIT: dict[str, Callable[[Expr, Expr], Expr]] = {
    "add": lambda a, b: call("add", a, b),
    "sub": lambda a, b: call("sub", a, b),
}


def one_pass(body: Expr, region: Region) -> bool:
    """Can a sum of ``body`` run in the pass of the reductions it reads: it reads none, or after
    pulling out its row factors it rescales with one running max (``make_online``'s test)?"""
    x, _ = pull(body, region)
    reads = refs(x, "red")
    return not reads or any(rescales_with(x, j, reads, region) for j in reads)


def _insert_red(region: Region, j: int, new: Reduction, combined: Expr) -> Region:
    """``region`` with ``new`` as reduction j + 1 (later ones renumbered) and every read of red j
    after it replaced by ``combined`` (which reads red j and red j + 1)."""
    def comb(e: Expr) -> Expr:
        shifted = substitute(e, lambda x: red(x.args[0] + 1) if x.op == "red" and x.args[0] > j else None)
        return substitute(shifted, lambda x: combined if x == red(j) else None)

    def moved(r: Reduction) -> Reduction:
        return replace(r, body=comb(r.body), extra=None if r.extra is None else comb(r.extra),
                       online=r.online + 1 if r.online is not None and r.online > j else r.online)
    reds = [*region.reductions[:j + 1], new, *(moved(r) for r in region.reductions[j + 1:])]
    rows = [replace(x, expr=comb(x.expr)) for x in region.rows]
    return replace(region, reductions=reds, out=comb(region.out), rows=rows)


def split_sums(region: Region) -> Region | None:
    for j, r in enumerate(region.reductions):
        if not r.additive or r.extra is not None or r.scan or r.body.op not in SPLIT or one_pass(r.body, region):
            continue
        a, b = r.body.args
        if not (one_pass(a, region) and one_pass(b, region)):
            continue
        reds = list(region.reductions)
        reds[j] = replace(r, body=a, online=None)
        region = replace(region, reductions=reds)
        return _insert_red(region, j, replace(r, body=b, online=None), SPLIT[r.body.op](red(j), red(j + 1)))
    return None


# Row offsets: sum_n(x * (y - c)) = sum_n(x * y) - c * sum_n(x) for a row constant c, when
# sum_n(x) is already a reduction of the region (softmax's normaliser, for the entropy).
OFFSET: dict[str, Callable[[Expr, Expr, Expr], Expr]] = {
    "sub": lambda xy, c, sx: call("sub", xy, call("mul", c, sx)),
    "add": lambda xy, c, sx: call("add", xy, call("mul", c, sx)),
}


def split_offsets(region: Region) -> Region | None:
    for j, r in enumerate(region.reductions):
        if not r.additive or r.body.op != "mul" or r.extra is not None or r.scan:
            continue
        for x, yc in (r.body.args, r.body.args[::-1]):
            if yc.op not in OFFSET or row_constant(x, region) or not row_constant(yc.args[1], region):
                continue
            y, c = yc.args
            same = [i for i, o in enumerate(region.reductions[:j]) if (o.kind, o.body, o.v, o.extra) == (r.kind, x, r.v, None)]
            if not same:
                continue
            reds = list(region.reductions)
            reds[j] = replace(r, body=call("mul", x, y), online=None)
            return _replace_red(region, j, OFFSET[yc.op](red(j), c, red(same[0])), reds)
    return None


def rescales_with(body: Expr, j: int, reads: frozenset[int], region: Region) -> bool:
    """May a sum of ``body`` (which, with its extra element, reads reductions ``reads``) run in the
    pass of max ``j``: it scales with j, and no other reduction it reads is a P @ V product?"""
    m = region.reductions[j]
    return m.kind == "max" and scales(body, Shift.of(region, j)) and \
        all(region.reductions[o].kind != "dot" for o in reads - {j})


def make_online(region: Region) -> Region | None:
    for i, r in enumerate(region.reductions):
        if not r.additive or r.online is not None or r.scan:
            continue
        for j in refs(r.body, "red"):
            # an extra element is seeded before the loop: the max it reads must be seeded too
            m = region.reductions[j]
            seeded = r.extra is None or (scales(r.extra, Shift.of(region, j)) and m.extra is not None)
            if seeded and rescales_with(r.body, j, r.reads(), region):
                reds = list(region.reductions)
                reds[i] = replace(r, online=j)
                return replace(region, reductions=reds)
    return None


# Base 2 (FlashAttention's exp2 trick): exp(x - m) = exp2(x log2(e) - m'), m' = max(x log2(e)).
# The GPU's exp is exp2 of a product by log2(e) anyway; with the max in log2 units that product
# folds into the constant factor the scores already have (the 1/sqrt(d) scale, a softcap's
# multiplier, a -inf / -1e9 / finfo.min fill). Each row: op -> the expression times log2(e)
# with no new multiply, or None (the rule then leaves the region alone: no slower, and no new
# overflow — a folded factor never grows a value past the unfolded one, and a constant that
# would overflow clamps to the largest float, so equal fills stay equal).
LOG2E = 1.0 / math.log(2.0)
FLT_MAX = 3.4028234663852886e38
BOUNDED = {"tanh", "sigmoid"}       # |x| <= 1: any constant factor is safe


def _scaled_const(c: float) -> Expr:
    return const(max(-FLT_MAX, min(FLT_MAX, c * LOG2E)) if math.isfinite(c) else c)


def per_program(e: Expr) -> bool:
    """Is ``e`` one value per kernel program: a float of batch indices only (ALiBi's per-head
    slope, a loaded per-head scale), computed once outside the key loop?"""
    return e.kind == "f" and not refs(e, "dot") and not refs(e, "red") and \
        all(v[0] == "b" and v[1:].isdigit() for v in free_vars(e))


def _fold_mul(e: Expr) -> Expr | None:
    """``x * c`` in log2 units: ``x * (c log2(e))`` where ``_foldable``, or a per-program scale
    c times an index-valued x or a product (QK-norm's learned logit scale)."""
    for x, c in (e.args, e.args[::-1]):
        if c.op == "const" and c.kind == "f" and _foldable(x, c.args[0] * LOG2E):
            return call("mul", x, const(c.args[0] * LOG2E))
    for x, c in (e.args, e.args[::-1]):
        if c.op != "const" and per_program(c) and (_index_valued(x) or x.op == "dot"):   # scaled once per program
            return call("mul", x, call("mul", c, const(LOG2E)))
    return None


def _foldable(x: Expr, factor: float) -> bool:
    """May ``x`` times a constant take the constant times log2(e), ``factor``, instead? Where
    that cannot overflow where the program's product did not: a factor of at most 1, or a
    bounded x; or could only where the program's product is already within log2(e) of FLT_MAX:
    a product times any constant (a temperature below 1.44, QK-norm's logit scale), as the
    ``dot`` row argues."""
    return abs(factor) <= 1 or (x.op in BOUNDED | {"dot"} and abs(factor) <= FLT_MAX)


def _index_valued(x: Expr) -> bool:
    """An integer expression, or a difference of positions in float (``float_positions``):
    a factor of at most ~2^24, so scaling its per-program partner by log2(e) cannot overflow
    where the product did not (a huge per-head fill times 1 still declines, as a constant's)."""
    if x.kind == "i":
        return True
    return x.op in ("add", "sub") and all(a.op == "to_f" and _position(a.args[0]) for a in x.args)


def _fold_div(e: Expr) -> Expr | None:
    """``x / c`` for a constant c, as ``x * (log2(e) / c)`` where ``_foldable``."""
    x, c = e.args
    if c.op == "const" and c.args[0] and _foldable(x, LOG2E / c.args[0]):
        return call("mul", x, const(LOG2E / c.args[0]))
    return None


def _fold_all(e: Expr) -> Expr | None:
    """Pointwise ops linear in their float operands (a where's condition is not scaled)."""
    first = 1 if e.op == "where" else 0
    folded = [fold_log2e(a) for a in e.args[first:]]
    return None if None in folded else call(e.op, *e.args[:first], *folded)


FOLD_LOG2E: dict[str, Callable[[Expr], Expr | None]] = {
    "const": lambda e: _scaled_const(e.args[0]) if e.kind == "f" else None,
    # a product with no constant factor (none in the program; one on Q or K moved onto the
    # product by factor_dot_scales is folded there): one multiply per score, which tl.exp pays
    # anyway. It overflows only where |s| > FLT_MAX / log2(e) ~ 2.4e38, which no score reaches
    "dot": lambda e: call("mul", e, const(LOG2E)),
    "mul": _fold_mul,
    "div": _fold_div,
    "neg": _fold_all, "add": _fold_all, "sub": _fold_all, "where": _fold_all,
    "maximum": _fold_all, "minimum": _fold_all,     # a positive factor commutes with max and min
}


def fold_log2e(e: Expr) -> Expr | None:
    rule = FOLD_LOG2E.get(e.op)
    return rule(e) if rule else None


def _shifts(e: Expr, j: int) -> list[Expr]:
    """The x of every exp(x - red j) in e."""
    return [shifted(x, j) for x in walk(e) if x.op == "exp" and shifted(x, j) is not None]


def _to_base2(e: Expr, j: int) -> Expr:
    """exp(x - red j) -> exp2(x log2(e) - red j); any other read of red j -> red j * ln 2."""
    memo: dict[Expr, Expr] = {}

    def go(x: Expr) -> Expr:
        if x in memo:
            return memo[x]
        if x.op == "exp" and shifted(x, j) is not None:
            new = call("exp2", call("sub", fold_log2e(go(shifted(x, j))), red(j)))
        elif x == red(j):
            new = call("mul", red(j), const(math.log(2.0)))
        elif x.op in INDEXED:
            new = Expr(x.op, (x.args[0], tuple(go(c) for c in x.args[1])), x.kind)
        elif children(x):
            new = simplify(Expr(x.op, tuple(go(c) for c in x.args), x.kind))
        else:
            new = x
        memo[x] = new
        return new
    return go(e)


def base2(region: Region) -> Region | None:
    """A running max whose body, extra element and every exp(x - max) argument (in any reduction,
    the output or a row output) fold log2(e) goes to log2 units."""
    for j, r in enumerate(region.reductions):
        members = [o for o in region.reductions if o.online == j]
        if r.kind != "max" or r.base2 or not members or fold_log2e(r.body) is None:
            continue
        if r.extra is not None and fold_log2e(r.extra) is None:
            continue
        readers = [e for o in region.reductions for e in (o.body, o.extra) if e is not None]
        readers += [region.out] + [x.expr for x in region.rows]
        if any(fold_log2e(x) is None for e in readers for x in _shifts(e, j)):
            continue
        conv = lambda e: _to_base2(e, j) if e is not None else None      # noqa: E731
        extra = None if r.extra is None else fold_log2e(r.extra)
        reds = [replace(r, body=fold_log2e(r.body), base2=True, extra=extra) if i == j else
                replace(o, body=conv(o.body), extra=conv(o.extra)) for i, o in enumerate(region.reductions)]
        rows = [replace(x, expr=conv(x.expr)) for x in region.rows]
        return replace(region, reductions=reds, out=conv(region.out), rows=rows)
    return None


POSITION_LIMIT = 1 << 20      # |offset| of a position i + c that float_positions rewrites


def _position(e: Expr) -> str | None:
    """The query or key index of ``e`` when it is ``m`` or ``n``, maybe plus or minus a small
    integer constant; else None."""
    if e.op == "var" and e.args[0] in ("m", "n"):
        return e.args[0]
    if e.op in ("add", "sub") and e.kind == "i":
        a, b = e.args
        if b.op == "const" and abs(b.args[0]) <= POSITION_LIMIT:
            return _position(a)
        if e.op == "add" and a.op == "const" and abs(a.args[0]) <= POSITION_LIMIT:
            return _position(b)
    return None


def _float_distance(e: Expr) -> Expr | None:
    """``n - m`` (or a sum, of positions) as the difference of the two positions in float:
    two conversions of [BLOCK] vectors instead of one per score — an int-to-float conversion
    runs at the rate of exp on the GPU. Exact while positions stay below 2^24 - 2^20."""
    if e.kind != "i" or e.op not in ("add", "sub"):
        return None
    a, b = e.args
    pa, pb = _position(a), _position(b)
    if pa is None or pb is None or pa == pb:
        return None
    return call(e.op, call("to_f", a), call("to_f", b))


FLOAT_OPERAND = ("add", "sub", "mul", "div")     # float arithmetic that promotes an int operand


def _float_operands(x: Expr) -> Expr | None:
    """``x`` with its position-difference operands in float (``_float_distance``), if it is
    float arithmetic that has one; else None."""
    if x.kind != "f" or x.op not in FLOAT_OPERAND:
        return None
    args = tuple(_float_distance(c) or c for c in x.args)
    return None if args == x.args else simplify(Expr(x.op, args, x.kind))


def float_positions(region: Region) -> Region | None:
    """A distance between a query and a key position used in float arithmetic (ALiBi's
    ``slope * (n - m)``, relative-position biases) is computed as ``float(n) - float(m)``."""
    new = _map(region, _float_operands)
    return None if new == region else new


def _constant_factor(e: Expr) -> tuple[Expr, float] | None:
    """(x, c) when ``e`` is x * c, c * x or x / c for a nonzero float constant c, else None."""
    if e.op == "mul":
        for x, c in (e.args, e.args[::-1]):
            if c.op == "const" and c.kind == "f" and c.args[0]:
                return x, c.args[0]
    if e.op == "div" and e.args[1].op == "const" and e.args[1].kind == "f" and e.args[1].args[0]:
        return e.args[0], 1.0 / e.args[1].args[0]
    return None


def _strip_factors(e: Expr) -> tuple[Expr, float]:
    """``e`` without its constant factors, and their product."""
    c = 1.0
    while (found := _constant_factor(e)) is not None:
        e, c = found[0], c * found[1]
    return e, c


def factor_dot_scales(region: Region) -> Region | None:
    """Constant factors of a product's operands (``q = q * scale`` before ``q @ k^T``: timm's
    spelling) move onto the product: (a q)(b k)^T = ab (q k^T). The operands are then read as
    they are stored (the Gluon kernels copy Q and K as rows), and the factor joins the score
    arithmetic, where base 2 folds log2(e) into it. The scores change only by the rounding of
    a q to the input's dtype, which eager does and the kernel no longer does."""
    for j, d in enumerate(region.dots):
        (q, a), (k, b) = _strip_factors(d.q), _strip_factors(d.k)
        if a == b == 1.0:
            continue
        dots = list(region.dots)
        dots[j] = Dot(q, k)
        scaled = call("mul", dot(j), const(a * b))
        return replace(_map(region, lambda y: scaled if y == dot(j) else None), dots=dots)
    return None


def _drop_red(region: Region, j: int) -> Region:
    """``region`` without reduction j, which nothing reads; later reductions renumbered."""
    def down(e: Expr) -> Expr:
        return substitute(e, lambda x: Expr(x.op, (x.args[0] - 1, *x.args[1:]), x.kind)
                          if x.op in ("red", "scan") and x.args[0] > j else None)
    reds = [replace(r, body=down(r.body), extra=None if r.extra is None else down(r.extra),
                    online=r.online - 1 if r.online is not None and r.online > j else r.online)
            for i, r in enumerate(region.reductions) if i != j]
    return replace(region, reductions=reds, out=down(region.out), rows=[replace(x, expr=down(x.expr))
                                                                         for x in region.rows])


def total_less_partial(region: Region) -> Region | None:
    """Σ_k x_k − Σ_{k≤n} x_k = Σ_{k>n} x_k: a sum of x less a prefix scan of the same x (with the
    key's own term: ``x.sum(-1, keepdim=True) - x.cumsum(-1)``, or without it) is a suffix scan,
    and the other way round. Where a scan's partial sums are read only so, the scan turns
    direction and the total, if nothing else reads it, goes: one pass instead of two (the total
    before the partial sums), and the partial sums come out as sums, not as a difference of
    two large ones."""
    for p, rp in enumerate(region.reductions):
        if not rp.scan:
            continue
        for t, rt in enumerate(region.reductions):
            if rt.kind != "sum" or rt.scan or rt.extra is not None or t == p:
                continue
            # the total of the scan's body: red t itself, or c red t (``factor-rows`` took c out of it)
            c = [a for a in rp.body.args if a != rt.body] if rp.body.op == "mul" and rt.body in rp.body.args else []
            totals = {red(t)} if rt.body == rp.body else {call("mul", red(t), c[0]), call("mul", c[0], red(t))} \
                if len(c) == 1 and c[0].op == "const" else set()
            if not totals:
                continue
            marks: dict[Expr, Expr] = {}

            def flip(x: Expr) -> Expr | None:
                if x.op != "sub" or x.args[0] not in totals:
                    return None
                y = x.args[1]
                if y.op == "sub" and y.args[1] == rp.body and y.args[0].op == "add" and rp.body in y.args[0].args:
                    y = [a for a in y.args[0].args if a != rp.body][0] if y.args[0].args[0] != y.args[0].args[1] \
                        else y          # (P + x) - x: the partial sums written with the key's term taken back out
                if y.op == "scan" and y.args[0] == p:       # the key's own term in neither: add it
                    marks.setdefault(y, var(f"_flipped{len(marks)}"))
                    return call("add", marks[y], rp.body)
                for a, b in (y.args, y.args[::-1]) if y.op == "add" else ():
                    if a.op == "scan" and a.args[0] == p and b == rp.body:
                        marks.setdefault(a, var(f"_flipped{len(marks)}"))
                        return marks[a]
                return None
            new = _map(region, flip)
            if not marks or any(p in refs(e, "scan") for e in new.exprs()):
                continue        # a partial sum read otherwise too
            back = {v: leaf for leaf, v in marks.items()}
            new = _map(new, lambda x: back.get(x))
            reds = list(new.reductions)
            reds[p] = replace(rp, scan="prefix" if rp.scan == "suffix" else "suffix")
            new = replace(new, reductions=reds)
            if not any(t in refs(e, "red") for e in new.exprs()):
                new = _drop_red(new, t)
            return new
    return None


def _reads_outside_stops(e: Expr, j: int, memo: dict) -> bool:
    """Does ``e`` read red j other than inside a ``stop`` (``detach()``)?"""
    if e not in memo:
        memo[e] = e == red(j) or (e.op != "stop" and any(
            isinstance(a, Expr) and _reads_outside_stops(a, j, memo) for a in e.args))
    return memo[e]


def stopped_maxima(region: Region) -> Region | None:
    """A max read only inside ``detach()`` (``s - s.amax(-1, keepdim=True).detach()``, as
    hand-written softmaxes often stabilise): the max is ``stopped`` — it takes no gradient,
    whatever the output's dependence on it — and the stops around it alone (``stop(red j)``, or
    of an expression of it and constants) go, so that the sums it shifts are recognised as such
    and run online in its pass."""
    for j, r in enumerate(region.reductions):
        memo: dict = {}
        if r.kind != "max" or r.stopped or not any(j in refs(e, "red") for e in region.exprs()) or \
                any(_reads_outside_stops(e, j, memo) for e in region.exprs()):
            continue
        reds = [replace(x, stopped=True) if i == j else x for i, x in enumerate(region.reductions)]
        alone = lambda x: x.args[0] if x.op == "stop" and refs(x.args[0], "red") == {j} and not any(   # noqa: E731
            refs(x.args[0], op) for op in ("dot", "load", "scan", "tile")) else None
        return _map(replace(region, reductions=reds), alone)
    return None


def safe_normalisers(region: Region) -> Region | None:
    """x / r -> div_safe(x, r) where r is a row value read from the reductions (a normaliser
    left in a body: relu(e / l - t)): a row whose every key is masked gives 0, not 0/0's NaN,
    as the division pulled out of a sum does (``_div_by_row``; README, "Semantics decided here")."""
    def fn(x: Expr) -> Expr | None:
        if x.op == "div" and refs(x.args[1], "red") and row_constant(x.args[1], region):
            return call("div_safe", *x.args)
        return None
    new = _map(region, fn)
    return new if new != region else None


RULES: list[tuple[str, Callable[[Region], Region | None]]] = [
    ("dot-scales", factor_dot_scales),
    ("stopped-maxima", stopped_maxima),
    ("safe-normalisers", safe_normalisers),
    ("split-concat", split_concat),
    ("clamp-shifts", clamp_shifts),
    ("seed-sums", seed_sums),
    ("split-sums", split_sums),
    ("factor-rows", factor_rows),
    ("split-offsets", split_offsets),
    ("online", make_online),
    ("base-2", base2),
    ("float-positions", float_positions),
    ("total-less-partial", total_less_partial),
]
SCAN_RULES = {"total-less-partial"}     # the rules that may change a scan (``rewrite``)


def _scans(region: Region) -> list[tuple[int, Reduction]]:
    return [(j, r) for j, r in enumerate(region.reductions) if r.scan]


def rewrite(region: Region, debug: Callable[[str, Region], None] | None = None) -> Region:
    """Apply the rules to a fixed point, verifying after each step. A step that would change a
    scan or its position is declined: the bodies read its partial sums as they are (the rules
    that pull factors out of sums or split them skip scans themselves) — but for the rules of
    ``SCAN_RULES``, which change scans and their reads together."""
    changed = True
    while changed:
        changed = False
        for name, rule in RULES:
            new = rule(region)
            if new is not None and (name in SCAN_RULES or _scans(new) == _scans(region)):
                region = verify(new)
                changed = True
                if debug:
                    debug(name, region)
    return region
