"""Algebra on reductions over N (DESIGN.md §3), as rule tables.

Three tables:

* ``CONCAT``: a max / sum over scores with one column appended (``torch.cat`` of a sink logit)
  is the reduction over the N keys combined with the body at the appended position, which
  becomes the reduction's row-level ``extra`` element: the key loop is unchanged and the sink
  only seeds the running state.
* ``FACTOR``: a row-constant factor of a ``dot`` reduction's summand moves into the output,
  so ``softmax(s) @ v`` needs no normalised P inside the loop.
* ``ONLINE``: when a summand depends on a running max ``m`` only through ``exp(x - m)`` it scales
  by ``exp(m_old - m_new)`` as ``m`` grows, so the reduction can run in the same pass as the max
  with a rescale (the flash-attention recurrence). Reductions that fit no rule run in a later
  pass of the same kernel, which recomputes the scores (see ``Region.passes``).

Rules return None to decline.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ..ir import Expr, Region, call, const, free_vars, red, refs, substitute, var, verify, walk


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


def row_constant(e: Expr, region: Region) -> bool:
    """Same value for every key n of a row: no ``n`` and no score tile."""
    return "n" not in free_vars(e) and not refs(e, "dot")


# dot_n(f(x, r) * v) = g(dot_n(x * v), r) for a row constant r.
# Each row: op -> (which operand is x, how the accumulated value is combined with r).
FACTOR: dict[str, tuple[int, Callable[[Expr, Expr], Expr]]] = {
    "div_safe": (0, lambda acc, r: call("div_safe", acc, r)),  # sum(x/r * v) = sum(x*v) / r  (0 if r == 0)
    "div": (0, lambda acc, r: call("div_safe", acc, r)),       # sum(x/r * v) = sum(x*v) / r; 0/0 -> 0 (empty row)
    "mul": (0, lambda acc, r: call("mul", acc, r)),            # sum(x*r * v) = sum(x*v) * r
}


def factor_rows(region: Region) -> Region | None:
    for j, r in enumerate(region.reductions):
        if r.kind != "dot" or r.body.op not in FACTOR:
            continue
        pos, combine = FACTOR[r.body.op]
        for xi in (pos, 1 - pos) if r.body.op == "mul" else (pos,):
            x, fac = r.body.args[xi], r.body.args[1 - xi]
            if row_constant(fac, region) and not row_constant(x, region):
                reds = list(region.reductions)
                reds[j] = replace(r, body=x)
                new_red = combine(red(j), fac)
                out = substitute(region.out, lambda e: new_red if e == red(j) else None)
                return replace(region, reductions=reds, out=out)
    return None


# scales(e, j): e(m') == e(m) * exp(m - m') where m = red(j), the running max.
def _free(e: Expr, j: int) -> bool:
    return j not in refs(e, "red")


ONLINE: dict[str, Callable[[Expr, int], bool]] = {
    "exp": lambda e, j: e.args[0].op == "sub" and e.args[0].args[1] == red(j) and _free(e.args[0].args[0], j),
    "mul": lambda e, j: (scales(e.args[0], j) and _free(e.args[1], j)) or (_free(e.args[0], j) and scales(e.args[1], j)),
    "div": lambda e, j: scales(e.args[0], j) and _free(e.args[1], j),
    "where": lambda e, j: _free(e.args[0], j) and all(scales(a, j) or _is_zero(a) for a in e.args[1:]),
    "to_f": lambda e, j: scales(e.args[0], j),
}


def _is_zero(e: Expr) -> bool:
    return e.op == "const" and e.args[0] == 0


def scales(e: Expr, j: int) -> bool:
    rule = ONLINE.get(e.op)
    return bool(rule and rule(e, j))


def make_online(region: Region) -> Region | None:
    for i, r in enumerate(region.reductions):
        if r.kind == "max" or r.online is not None:
            continue
        maxes = [j for j in refs(r.body, "red") if region.reductions[j].kind == "max"]
        for j in maxes:
            others = r.reads() - {j}
            # an extra element is seeded before the loop: the max it reads must be seeded too
            seeded = r.extra is None or (scales(r.extra, j) and region.reductions[j].extra is not None)
            if scales(r.body, j) and seeded and \
                    all(region.reductions[o].kind != "dot" for o in others):
                reds = list(region.reductions)
                reds[i] = replace(r, online=j)
                return replace(region, reductions=reds)
    return None


RULES: list[tuple[str, Callable[[Region], Region | None]]] = [
    ("split-concat", split_concat),
    ("factor-rows", factor_rows),
    ("online", make_online),
]


def rewrite(region: Region, debug: Callable[[str, Region], None] | None = None) -> Region:
    """Apply the rules to a fixed point, verifying after each step."""
    changed = True
    while changed:
        changed = False
        for name, rule in RULES:
            new = rule(region)
            if new is not None:
                region = verify(new)
                changed = True
                if debug:
                    debug(name, region)
    return region
