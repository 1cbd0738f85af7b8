"""Two score products whose contractions differ in length, added, joined into one product over
the concatenated contraction, so that the kernel computes both in one tensor-core dot:

    q1 @ k1^T * s1 + q2 @ k2^T * s2  =  cat([q1 * s1, q2 * s2], -1) @ cat([k1, k2], -1)^T

DeepSeek-V3's absorbed MLA adds a product over the 512-wide latent to one over the 64-wide rotary
part (``einsum("bshc,btc->bsht", q_nope, kv) + einsum("bshr,btr->bsht", q_pe, pe)``), decoupled
rotary embeddings add a rotated product to an unrotated one. A region has one contraction length
(``DK``): before this pass the second product was computed outside the kernel and read back as
an N x N bias. The concatenated operands are computed once outside the kernel (O(N D) memory,
differentiated there), as a computed K operand already is (``rules.computed_operand``).

Products with equal lengths are left alone (the region holds both as dots, DiffAttn's way), and
so are integer operands. A per-term scale is a Python number (``mul`` / ``div`` by a nonzero
scalar): one both terms share multiplies the joined product, others are folded into the first
operands. The joined product is computed where the sum was, so nothing between the earlier
product and the sum may write a tensor in place or switch grad mode or autocast. The pass
rewrites only a sum a softmax-like op reads (``regions.SOFTMAX_LIKE``: the scores of attention,
a softmax written by hand with ``exp`` included): elsewhere two products
stay two products. ``join`` rewrites the ATen graph in place, tracing the joined product on the
fake values of its operands (their shapes, dtypes and devices), and returns how many sums it
joined.

``weights_first`` runs before it: a product that writes ``P @ V`` with the weights second
(``einsum("bjd,bij->bid", v, attn)``, ``(v^T @ attn)^T``) gets its operands swapped.
"""
from __future__ import annotations

import operator
import string
from dataclasses import dataclass

import torch
import torch.fx as fx

from .. import _compat
from . import sdpa
from .epilogue import packet
from .regions import SOFTMAX_LIKE, from_softmax
from .rules import einsum_letters, expand_ellipsis
from .symbolic import meta

aten = torch.ops.aten
PRODUCTS = {aten.matmul.default, aten.einsum.default}
SCALES = {aten.mul.Tensor: operator.mul, aten.div.Tensor: operator.truediv}


def weights_first(gm: fx.GraphModule) -> int:
    """Swap the operands of a product that multiplies V by the attention weights written second
    (slot attention's ``einsum("bjd,bij->bid", v, attn)``; ``(v^T @ attn)^T``, a matmul, becomes
    the einsum ``...jk,...ij->...ik`` of the weights first), so that a candidate ``P @ V``'s
    first operand is P, as ``regions`` reads it; the result is the same. Returns how many it
    swapped."""
    swapped = 0
    for n in gm.graph.nodes:
        if n.target == aten.einsum.default and len(n.args[1]) == 2 and "->" in n.args[0]:
            (x, y), (operands, out) = n.args[1], n.args[0].replace(" ", "").split("->")
        elif n.target == aten.matmul.default and all(meta(t) is not None and meta(t).dim() >= 2 for t in n.args[:2]):
            (x, y), (operands, out) = n.args[:2], ("...ij,...jk", "...ik")
        else:
            continue
        if from_softmax(y) and not from_softmax(x):
            a, c = operands.split(",")
            n.target, n.args, n.kwargs = aten.einsum.default, (f"{c},{a}->{out}", [y, x]), {}
            swapped += 1
    if swapped:
        gm.recompile()
    return swapped


@dataclass
class Term:
    product: fx.Node
    scale: float        # the term is product * scale
    x: fx.Node          # the product's operands
    y: fx.Node
    ax: int             # the contracted dim of x, and of y
    ay: int
    equation: str | None = None     # an einsum's, its ellipses written as letters, the contracted one ``#``


def _term(n: fx.Node) -> Term | None:
    """``n`` as a product of two tensors times a Python number, or None."""
    scale = 1.0
    if n.op == "call_function" and n.target in SCALES and isinstance(n.args[1], (int, float)) and \
            not isinstance(n.args[1], bool) and n.args[1] != 0 and isinstance(n.args[0], fx.Node) and len(n.users) == 1:
        scale, n = SCALES[n.target](1.0, n.args[1]), n.args[0]
    if n.op != "call_function" or n.target not in PRODUCTS or len(n.users) != 1:
        return None
    einsum = n.target == aten.einsum.default
    if einsum and len(n.args[1]) != 2:
        return None
    x, y = n.args[1] if einsum else n.args[:2]
    if any(meta(t) is None or meta(t).dim() < 2 for t in (x, y)):
        return None
    if not einsum:
        return Term(n, scale, x, y, meta(x).dim() - 1, meta(y).dim() - 2)
    eq = expand_ellipsis(n.args[0], [meta(x).dim(), meta(y).dim()])
    letters = einsum_letters(eq)
    if letters is None:
        return None
    a, c, k, _, _ = letters
    return Term(n, scale, x, y, a.index(k), c.index(k), eq.replace(k, "#"))


def _joinable(t1: Term, t2: Term) -> bool:
    if t1.product.target != t2.product.target or t1.equation != t2.equation or (t1.ax, t1.ay) != (t2.ax, t2.ay):
        return False
    x1, y1, x2, y2 = (meta(n) for n in (t1.x, t1.y, t2.x, t2.y))
    if len({x1.dtype, y1.dtype, x2.dtype, y2.dtype}) != 1 or not x1.dtype.is_floating_point or \
            x1.dim() != x2.dim() or y1.dim() != y2.dim():
        return False
    rest = lambda s, ax: s[:ax] + s[ax + 1:]        # noqa: E731
    return x1.shape[t1.ax] != x2.shape[t1.ax] and rest(x1.shape, t1.ax) == rest(x2.shape, t1.ax) and \
        rest(y1.shape, t1.ay) == rest(y2.shape, t1.ay)


def _undisturbed(first: fx.Node, last: fx.Node) -> bool:
    """Nothing between ``first`` and ``last`` writes a tensor in place or switches grad mode or
    autocast (a call that is no ATen op: ``_set_grad_enabled``, ``_enter_autocast``), so the
    earlier product's operands read at ``last`` are what the product read, in the same modes."""
    n = first.next
    while n is not last and n.op != "root":
        if n.op == "call_function" and n.target is not operator.getitem and (
                not _compat.is_aten_op(n.target) or _compat.mutates(n.target)):
            return False
        n = n.next
    return n is last


def _feeds_softmax(n: fx.Node, depth: int = 12) -> bool:
    frontier, seen = [n], set()
    while frontier and depth:
        depth -= 1
        nxt = []
        for x in frontier:
            if x in seen:
                continue
            seen.add(x)
            if packet(x) in SOFTMAX_LIKE:
                return True
            if x.op == "call_function" and x.target not in PRODUCTS:
                nxt.extend(x.users)
        frontier = nxt
    return False


def _joined(t1: Term, t2: Term, sign: float):
    ax, ay, eq = t1.ax, t1.ay, t1.equation
    s1, s2 = t1.scale, t2.scale * sign
    if eq is not None:
        eq = eq.replace("#", next(ch for ch in string.ascii_letters if ch not in eq))

    common = s1 if s1 == s2 else 1.0        # a shared scale multiplies the product, not an operand

    def fn(x1, y1, x2, y2):
        x = torch.cat([x1 if s1 == common else x1 * s1, x2 if s2 == common else x2 * s2], ax)
        y = torch.cat([y1, y2], ay)
        p = torch.matmul(x, y) if eq is None else torch.einsum(eq, x, y)
        return p if common == 1 else p * common
    return fn


def join(gm: fx.GraphModule) -> int:
    joined = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in (aten.add.Tensor, aten.sub.Tensor) or \
                n.kwargs.get("alpha", 1) != 1 or not all(isinstance(a, fx.Node) for a in n.args[:2]):
            continue
        t1, t2 = (_term(a) for a in n.args[:2])
        if t1 is None or t2 is None or not _joinable(t1, t2) or not _feeds_softmax(n):
            continue
        position = {x: i for i, x in enumerate(gm.graph.nodes)}
        if not _undisturbed(min(t1.product, t2.product, key=position.get), n):
            continue
        operands = [t1.x, t1.y, t2.x, t2.y]
        sign = -1.0 if n.target == aten.sub.Tensor else 1.0
        sub = _compat.trace_on_fakes(_joined(t1, t2, sign), [meta(x) for x in operands])
        env = dict(zip([p for p in sub.graph.nodes if p.op == "placeholder"], operands))
        with gm.graph.inserting_before(n):
            out = gm.graph.graph_copy(sub.graph, env)
        for new in env.values():
            if new not in operands:
                new.meta.setdefault("stack_trace", n.meta.get("stack_trace"))
                if sdpa.TAG in n.meta:      # part of a decomposed SDPA call's program
                    new.meta[sdpa.TAG] = n.meta[sdpa.TAG]
        n.replace_all_uses_with(out)
        dead = [n, *(a for a in n.args[:2] if a not in (t1.product, t2.product)), t1.product, t2.product]
        for d in dict.fromkeys(dead):       # the sum, its scaled terms, their products
            gm.graph.erase_node(d)
        joined += 1
    if joined:
        gm.recompile()
    return joined
