"""Find attention regions in an ATen graph and build their IR.

A candidate is every contraction ``P @ V`` (matmul, bmm, einsum). Its output tile (.., m, dv)
is evaluated symbolically (``symbolic.py``); it is an attention region when that evaluation
reaches at least one score contraction ``Q @ K^T`` through supported ops. The region grows
downstream through its epilogue (``epilogue.py``: gates, λ-mixing of two attention outputs,
per-head norms, the transpose back to the model's layout), so several ``P @ V`` products that
feed one expression fuse into one kernel.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..ir import Expr, Input, Region, Row, const, free_vars, refs, walk
from ..ir.expr import JUMPS
from .autocast import CASTS
from .epilogue import CONTRACTIONS, extend, packet
from .ranges import check_integer_ranges
from .rules import einsum_letters, expand_ellipsis, permute_back
from .symbolic import GRAD_MODE, RULES, STOPS, Builder, Unsupported, carries_grad, meta, moved, static_shape

aten = torch.ops.aten
SOFTMAX_LIKE = {aten.softmax, aten._softmax, aten._safe_softmax, aten.exp, aten.log_softmax}


@dataclass
class Match:
    """One fusable region: the IR, the node it replaces, and the nodes feeding the kernel."""
    root: fx.Node
    region: Region
    leaves: list[fx.Node]
    inner: set[fx.Node] = field(default_factory=set)
    rows: list[fx.Node] = field(default_factory=list)    # nodes replaced by region.rows, in order


@dataclass
class Fallback:
    """A candidate that stays unfused, with the reason and where the user wrote it."""
    node: str
    op: str
    reason: str
    source: str

    def __str__(self) -> str:
        return f"{self.node} ({self.op}): {self.reason}" + (f"\n      at {self.source}" if self.source else "")


def source_line(node: fx.Node) -> str:
    """'file.py:12: code' of the innermost user frame in the node's stack trace."""
    st = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', st)
    if not frames:
        return ""
    path, line, code = frames[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}: {code.strip()}"


def _operands(node: fx.Node) -> list[fx.Node]:
    if packet(node) == aten.einsum:
        return list(node.args[1])
    return [a for a in node.args[:2] if isinstance(a, fx.Node)]


def _geometry(node: fx.Node) -> tuple[tuple[int, ...], int, int, int, tuple[int, ...]] | None:
    """(batch, M, N, DV, order) of a candidate ``P @ V``, or None if it is not shaped like one;
    ``order`` lists the node's dim of each (batch..., m, dv) dim (an einsum may permute them)."""
    ops = _operands(node)
    if len(ops) != 2 or meta(node) is None or meta(node).dim() < 2:
        return None
    shape = static_shape(meta(node))
    order = tuple(range(len(shape)))
    if packet(node) == aten.einsum:
        ranks = [meta(x).dim() if meta(x) is not None else -1 for x in ops]
        letters = einsum_letters(expand_ellipsis(node.args[0], ranks))
        if letters is None:
            return None
        a, _, summed, _, order = letters
        n = static_shape(meta(ops[0]))[a.index(summed)]
        shape = tuple(shape[o] for o in order)
    else:
        n = static_shape(meta(ops[0]))[-1]
    return shape[:-2], shape[-2], n, shape[-1], order


def _is_attention(b: Builder) -> bool:
    """Scores normalised over keys, or keys that are per-sequence data. ``act(x @ W1) @ W2``
    (an MLP: keys are a weight shared by every batch element) is left to Inductor and cuBLAS."""
    if any(r.kind != "dot" for r in b.reductions):
        return True
    return any(free_vars(d.k) & {v.args[0] for v in b.bvars} for d in b.dots)


def from_softmax(operand: fx.Node, depth: int = 12) -> bool:
    """Is ``operand`` computed from a softmax (or another ``SOFTMAX_LIKE`` op)? Not through
    another product: in stacked layers, the next layer's q @ k^T reaches the last layer's softmax
    only through its P @ V and a projection."""
    frontier, seen = [operand], set()
    while frontier and depth:
        depth -= 1
        nxt = []
        for x in frontier:
            if x in seen or not isinstance(x, fx.Node):
                continue
            seen.add(x)
            if packet(x) in SOFTMAX_LIKE:
                return True
            if packet(x) not in CONTRACTIONS:
                nxt.extend(a for a in x.all_input_nodes)
        frontier = nxt
    return False


def build(contraction: fx.Node, fuse_stops: frozenset = frozenset()) -> tuple[Match | None, Builder | None]:
    """Build the region rooted at ``contraction`` (extended through its epilogue). Returns the
    match (None if this is no attention region) and the builder, whose leaves explain why not.
    Stopped values (``detach()``, ``torch.no_grad()``) that copy the region's scores — a row max
    detached to stabilise a softmax, a temperature computed under ``no_grad`` from an entropy —
    would be loaded, computed outside from score-sized tensors: the region is built again with
    them fused as ``stop`` expressions (``fuse_stops``; no gradient through them)."""
    geom = _geometry(contraction)
    if geom is None:
        return None, None
    batch, M, N, DV, order = geom
    b = Builder(batch, M, N, DV, grad_mode=contraction.meta.get(GRAD_MODE, False), fuse_stops=fuse_stops)
    tile = b.bvars + (b.m, b.dv)
    epi = extend(contraction, permute_back(tile, order), tile)
    b.epilogue = epi.nodes - {contraction}
    root = epi.exit
    out = b.sym(epi.value)(epi.index)
    if not b.dots or not any(r.kind == "dot" for r in b.reductions) or not refs(out, "red"):
        return None, b
    if not _is_attention(b):
        return None, None
    rows = _row_outputs(b, root, epi.nodes | {contraction})
    region = Region(
        batch=batch, M=M, N=N, DK=b.DK, DV=DV,
        inputs=[Input(n.name, static_shape(meta(n)), meta(n).dtype) for n in b.inputs],
        dots=list(b.dots), reductions=list(b.reductions), out=out,
        out_dtype=meta(root).dtype, source=source_line(contraction),
        out_shape=None if epi.store is None else static_shape(meta(root)), out_index=epi.store,
        rows=[Row(e, meta(n).dtype) for n, e in rows.items()],
    )
    copies = frozenset(stopped_copies(region, list(b.inputs))) - fuse_stops
    if copies:
        try:
            fused = build(contraction, fuse_stops | copies)
        except Unsupported:
            fused = None, None
        if fused[0] is not None:
            return fused
    _check_no_recomputed_jump(region, list(b.inputs), carries_grad(root) or any(carries_grad(n) for n in rows), contraction)
    inner = b.inner | epi.nodes | set(rows)
    check_integer_ranges(inner, list(b.inputs), contraction)
    return Match(root, region, list(b.inputs), inner, list(rows)), b


# Ops of the scores whose value jumps (comparisons, rounding, casts to integer or boolean) or,
# in training, whose derivative jumps (kinks), at some score value.
KINKS = frozenset({"relu", "abs", "maximum", "minimum"})
PRODUCTS = {aten.matmul, aten.bmm, aten.einsum, aten.baddbmm, aten.mm, aten.addmm, aten.linear}


def _score_sources(region: Region, leaves: list[fx.Node]) -> list[set[fx.Node]]:
    """Per score product, the tensors its Q and K operands load (through casts and moves)."""
    return [{_source(leaves[i]) for i in refs(d.q, "load") | refs(d.k, "load")} for d in region.dots]


def _copies_scores(node: fx.Node, operands: list[set[fx.Node]]) -> bool:
    """Is ``node`` computed from a product of the same q and k as one of the region's?"""
    return any(packet(n) in PRODUCTS and any(ops <= {n} | _upstream({n}) for ops in operands)
               for n in {node} | _upstream({node}))


def stopped_copies(region: Region, leaves: list[fx.Node]) -> list[fx.Node]:
    """The loaded stopped values (``symbolic.STOPS``) computed from the region's own scores:
    every product they are computed from is one of the region's score products (a teacher's
    P @ V under ``no_grad`` stays a region of its own, a bias from a ``Linear`` a load)."""
    operands = _score_sources(region, leaves)

    def scores(n: fx.Node) -> bool:
        return any(ops <= {_source(a) for a in _operands(n)} for ops in operands)
    found = []
    for x in leaves:
        products = [n for n in {x} | _upstream({x}) if packet(n) in PRODUCTS]
        if x.meta.get(STOPS, False) and products and all(scores(n) for n in products):
            found.append(x)
    return found


def _check_no_recomputed_jump(region: Region, leaves: list[fx.Node], differentiated: bool,
                              contraction: fx.Node) -> None:
    """Refuse a region whose scores meet, in a comparison or another op that jumps (a kink in
    training), a value the kernel loads that was computed from a product outside it: top-k
    attention (``s < s.topk(k).values[..., -1:]``), a threshold from a second ``q @ k^T``, hard
    attention against a detached row max (the row max over the loaded detached copy).
    Eager computes both sides from one product, bitwise; the kernel recomputes the scores, and
    a recomputed product need not be bitwise what the outside op read, so at the k-th score
    itself the comparison flips (a 9 % output error in fp32), and in training the backward's
    kernels put a kink's tie on either side (dQ 30 % off). A copy of the scores is a load with
    a product among its ancestors that itself reads the q and k one of the region's score
    products loads. Smooth uses of such a copy (``s + s.detach()``) differ only by rounding
    and still fuse; so do thresholds from constants, from the kernel's own reductions and from
    other tensors, products included (a bias from a ``Linear``). A threshold that reaches the
    compiled function as an input cannot be told from any other input: computed from the same
    scores outside it, it meets the same rounding (README)."""
    operands = _score_sources(region, leaves)
    copies: dict[int, bool] = {}

    def copies_scores(i: int) -> bool:      # asked only of loads that meet the scores in a jump
        if i not in copies:
            copies[i] = _copies_scores(leaves[i], operands)
        return copies[i]
    ops = JUMPS | KINKS if differentiated else JUMPS
    memo: dict[int, tuple[bool, frozenset[int]]] = {}

    def reach(e: Expr) -> tuple[bool, frozenset[int]]:
        """Whether ``e`` reads the scores, and the inputs it loads, through the max and sum
        reductions of the scores it reads (not through P @ V products)."""
        dots, loads = bool(refs(e, "dot")), refs(e, "load")
        for j in refs(e, "red"):
            r = region.reductions[j]
            if r.kind == "dot":
                continue
            if j not in memo:
                memo[j] = (False, frozenset())      # a reduction never reads itself
                parts = [reach(x) for x in (r.body, r.extra) if x is not None]
                memo[j] = (any(d for d, _ in parts), frozenset().union(*(ls for _, ls in parts)))
            dots, loads = dots or memo[j][0], loads | memo[j][1]
        return dots, loads

    for e in [region.out, *(r.body for r in region.reductions), *(row.expr for row in region.rows)]:
        for x in walk(e):
            if x.op in ops:
                dots, loads = reach(x)
                derived = {i for i in loads if copies_scores(i)} if dots else set()
                if derived:
                    names = ", ".join(region.inputs[i].name for i in sorted(derived))
                    raise Unsupported(f"the scores meet {names} in {x.op}, a value computed outside the region from "
                                      "the same q and k: the kernel recomputes the scores, not bitwise as eager's one "
                                      "product, and at equal values the result would flip", contraction)


def _source(n: fx.Node) -> fx.Node:
    """The tensor that ``n`` casts or moves (``autocast.CASTS``, ``symbolic.MOVES``), through any
    number of them: a product's narrowed operand is a leaf of its own (``rules._cast``), and
    autocast narrows each product's operands by casts of their own."""
    while True:
        if n.op == "call_function" and n.target in CASTS and n.args and isinstance(n.args[0], fx.Node):
            n = n.args[0]
        elif (x := moved(n, narrowing=False)) is not None:     # a slice of a packed qkv is not qkv
            n = x
        else:
            return n


def _downstream(nodes: set[fx.Node]) -> set[fx.Node]:
    out, stack = set(), list(nodes)
    while stack:
        n = stack.pop()
        for u in n.users:
            if u not in out:
                out.add(u)
                stack.append(u)
    return out


def _upstream(nodes: set[fx.Node]) -> set[fx.Node]:
    out, stack = set(), list(nodes)
    while stack:
        for i in stack.pop().all_input_nodes:
            if i not in out:
                out.add(i)
                stack.append(i)
    return out


def _row_index(b: Builder, node: fx.Node) -> tuple | None:
    """The kernel's row index for a (*batch, M) or (*batch, M, 1) tensor, else None."""
    t = meta(node)
    if t is None or t.dtype == torch.bool:
        return None
    shape, nb = static_shape(t), len(b.batch)
    if shape[:nb] != b.batch or shape[nb:nb + 1] != (b.M,) or shape[nb + 1:] not in ((), (1,)):
        return None
    return b.bvars + (b.m,) + (const(0),) * (len(shape) - nb - 1)


def _row_outputs(b: Builder, root: fx.Node, epilogue: set[fx.Node]) -> dict[fx.Node, Expr]:
    """Row-shaped values the program computes from the region's reductions (logsumexp, row max,
    entropy ...) become extra outputs of the same kernel. Each candidate is evaluated with the
    region's builder, so its reductions over N are shared with the region's (logsumexp reuses
    softmax's max and sum) or added to it; a candidate that does not reduce to a row expression
    is rolled back. Returns the nodes other code still reads, with their expressions.
    ``epilogue``: the P @ V contraction and the epilogue nodes up to ``root``, already fused."""
    after, touched, feeds = _downstream(epilogue | {root}), _downstream(b.inner), _upstream(b.leaves)
    accepted: dict[fx.Node, Expr] = {}
    for node in root.graph.nodes:
        if node in b.inner or node in epilogue or node in after or node in feeds or node not in touched or packet(node) not in RULES:
            continue     # (a value the region itself loads cannot be one of its outputs)
        idx = _row_index(b, node)
        if idx is None:
            continue
        saved = b.snapshot()
        try:
            e = b.sym(node)(idx)
        except Unsupported:
            e = None
        if e is None or "n" in free_vars(e) or refs(e, "dot") or not refs(e, "red") or \
                any(b.reductions[j].kind == "dot" for j in refs(e, "red")) or \
                (b.leaves - saved.leaves) & (after | _downstream(set(accepted))):
            b.restore(saved)
            continue
        accepted[node] = e
    done = b.inner | epilogue | set(accepted) | {root}
    return {n: e for n, e in accepted.items() if any(u not in done for u in n.users)}


# PyTorch's fused fast paths of nn.TransformerEncoderLayer / nn.MultiheadAttention (eval mode,
# no gradients): one opaque op each, with no attention program in the graph to capture
FAST_PATHS = {op for op in (getattr(aten, "_transformer_encoder_layer_fwd", None),
                            getattr(aten, "_native_multi_head_attention", None)) if op is not None}


def find_regions(graph: fx.Graph) -> tuple[list[Match], list[Fallback]]:
    matches, fallbacks, claimed = [], [], set()
    for node in list(graph.nodes):
        if packet(node) in FAST_PATHS:
            fallbacks.append(Fallback(node.name, str(node.target), "PyTorch's fused fast path (an nn.Transformer "
                                      "layer or nn.MultiheadAttention in eval mode without gradients) is one "
                                      "opaque op; torch.backends.mha.set_fastpath_enabled(False) runs it as "
                                      "plain PyTorch, which fuses", source_line(node)))
        if packet(node) not in CONTRACTIONS or node in claimed:
            continue
        try:
            match, builder = build(node)
        except Unsupported as e:
            where = e.node or node
            fallbacks.append(Fallback(node.name, str(node.target), str(e), source_line(where) or source_line(node)))
            continue
        if match is None:
            if from_softmax(_operands(node)[0]):      # a P @ V worth a reason in explain()
                fallbacks.append(Fallback(node.name, str(node.target), _why_not(builder), source_line(node)))
            continue
        claimed |= match.inner
        matches.append(match)
    return matches, fallbacks


def _why_not(b: Builder | None) -> str:
    """Name the score-sized tensor that no rule could see through."""
    for leaf in sorted(b.leaves if b else (), key=lambda n: n.name):
        shape = tuple(meta(leaf).shape)
        if shape[-2:] in ((b.M, b.N), (b.N, b.M)) and leaf.op == "call_function":     # (or transposed)
            where = source_line(leaf)
            why = b.declined.get(leaf) or f"the scores pass through {leaf.target}, which has no fusion rule"
            return why + (f" ({where})" if where else "")
    return "no score contraction q @ k^T reaches this product through supported ops"
