"""Cumulative sums over the keys: the partial sums a region's bodies read (``Reduction.scan``).

Stick-breaking attention weighs key j of query i by beta_ij times the product of (1 - beta_ik)
over the keys k between them: in log space, a sum over the keys after j of log(1 - beta_ik), a
suffix sum along each row of the scores. Reference code writes it three ways, and each is read
here as the same scan, computed in the kernel's loop over key blocks (a suffix scan's loop runs
them last to first, carrying the sum of the blocks it has passed):

* ``x.cumsum(-1)``: the prefix sum, key n included;
* ``x.flip(-1).cumsum(-1).flip(-1)``: the suffix sum, key n included (a flip is a view, so the
  cumulative sum is read at key N - 1 - n);
* ``x @ W`` (or an einsum) with W an N x N triangle of ones, ``ones(N, N).tril(-1)``: the sum
  over the keys past n (IBM's reference code), or before it (``triu(1)``), or either with
  the key itself (``tril()``, ``triu()``).

The result is ``scan(j) + body`` (or ``scan(j)`` alone for the strict triangles), where scan(j)
excludes the key itself.
"""
from __future__ import annotations

import torch.fx as fx

from ..ir import Expr, call, coerce, const, free_vars, refs, var
from ..ir.expr import fmt, linear
from .symbolic import Builder, Sym, Unsupported, kind_of, meta, static_shape

COL = var("scan_col")       # the output column of a triangle product while it is classified

# a comparison of t = (contracted index) - (output column) with 0, as t >= lo (lower bound) or
# t <= hi (upper bound), from (op, sign of t): op's constant moves to the bound
BOUND = {("ge", 1): ("lo", 0), ("gt", 1): ("lo", 1), ("le", 1): ("hi", 0), ("lt", 1): ("hi", -1),
         ("ge", -1): ("hi", 0), ("gt", -1): ("hi", -1), ("le", -1): ("lo", 0), ("lt", -1): ("lo", 1)}
# (bound, value) -> (direction, key itself included?): sum over n' >= n + 1 is the suffix scan
TRIANGLES = {("lo", 1): ("suffix", False), ("lo", 0): ("suffix", True),
             ("hi", -1): ("prefix", False), ("hi", 0): ("prefix", True)}


def triangle(w: Expr, n: Expr) -> tuple[str, bool] | None:
    """(direction, inclusive) when ``w``, the right operand of a product at (contracted key n,
    output column ``COL``), is 1 on one side of the diagonal and 0 on the other; else None."""
    if w.op == "where" and w.args[1].op == "const" and w.args[2].op == "const" \
            and {w.args[1].args[0], w.args[2].args[0]} == {0, 1}:
        cond = w.args[0] if w.args[1].args[0] == 1 else call("not", w.args[0])
    elif w.kind == "b" or (w.op == "to_f" and w.args[0].kind == "b"):
        cond = w if w.kind == "b" else w.args[0]
    else:
        return None
    flip = cond.op == "not"
    cond = cond.args[0] if flip else cond
    if cond.op not in ("ge", "gt", "le", "lt"):
        return None
    lin = linear(call("sub", *cond.args), signed=True)
    if lin is None or set(lin[0]) - {n.args[0], COL.args[0]}:
        return None
    sign = lin[0].get(n.args[0], 0)
    if sign not in (1, -1) or lin[0].get(COL.args[0], 0) != -sign:
        return None
    op = {"ge": "lt", "gt": "le", "le": "gt", "lt": "ge"}[cond.op] if flip else cond.op
    side, offset = BOUND[(op, sign)]
    bound = offset - sign * lin[1]          # sign * t + c (op) 0  ->  t (op') -sign * c
    return TRIANGLES.get((side, bound))


def key_triangle(b: Builder, sy: Sym, ay: tuple) -> tuple[str, bool] | None:
    """``triangle`` of the right operand of a product over the keys, an N x N tensor (None for
    any other operand; a loaded one leaves no trace in the builder)."""
    if sy.shape[-2:] != (b.N, b.N) or sy.kind != "f":
        return None
    saved = b.snapshot()
    found = triangle(sy(ay + (b.n, COL)), b.n)
    if found is None:
        b.restore(saved)        # W may be a tensor: its trial load is not the region's
    return found


def triangle_product(b: Builder, sx: Sym, sy: Sym, ax: tuple, ay: tuple) -> Expr | None:
    """``x @ W`` at the score tile (b..., m, n) when W is a triangle of ones over the keys: the
    scan of x's row; None when W is not one (the product is then something else)."""
    found = key_triangle(b, sy, ay) if sx.shape[-1] == b.N else None
    if found is None:
        return None
    direction, inclusive = found
    body = coerce(sx(ax + (b.m, b.n)), "f")
    if not row_data(body):
        return None
    partial = b.add_scan(body, direction)
    return call("add", partial, body) if inclusive else partial


def cumsum(b: Builder, node: fx.Node, x, dim, dtype=None) -> Sym | None:
    """``torch.cumsum`` over the keys, read at key n (a prefix sum) or at N - 1 - n (under a
    flip: a suffix sum)."""
    s = b.sym(x)
    rank = len(s.shape)
    if rank < 2 or dim % rank != rank - 1 or s.shape[-1] != b.N or s.kind != "f":
        return b.decline(node, "cumsum over a dim other than the keys, or of integers")
    flipped = call("sub", const(b.N - 1), b.n)
    leaf = b.leaf(node)

    def fn(idx):
        head, last = idx[:-1], idx[-1]
        direction = "prefix" if last == b.n else "suffix" if last == flipped else None
        if direction is None or any("n" in free_vars(i) for i in head) or not row_data(s(head + (last,))):
            if refs(s(idx), "dot") or refs(s(idx), "red"):
                raise Unsupported(f"scores' cumsum over the keys read at key {fmt(last)}: only at n or, "
                                  "flipped, N - 1 - n", node)
            return leaf(idx)        # computed outside: a cumsum along the keys of per-key data
        body = s(head + (last,))
        return coerce(call("add", b.add_scan(body, direction), body), kind_of(meta(node).dtype))
    return Sym(static_shape(meta(node)), kind_of(meta(node).dtype), fn)


def row_data(body: Expr) -> bool:
    """Does ``body`` vary along the query rows or read the scores (a scan's body in the kernel)?
    A cumulative sum of per-key data (FoX's forget gates, a sequence's positions) is O(N),
    computed once outside the kernel and loaded, as before scans."""
    return "m" in free_vars(body) or bool(refs(body, "dot")) or bool(refs(body, "red"))
