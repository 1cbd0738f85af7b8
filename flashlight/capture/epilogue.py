"""Grow a region through its epilogue: the ops after ``P @ V`` that the kernel applies to its
output tile before the store (gates, λ-mixing, per-head norms, the transpose back to the
model's layout).

The epilogue is a single-exit subgraph below the contraction (the *root*): every node in it but
the exit is used only inside it, so once the exit is replaced by the fused op the rest is dead.
Each node is classified against the root's tile index (b..., m, dv):

    full   the values of tile elements, possibly permuted or reshaped: it carries an index map
           from the tile index to its own index (the exit's map is where the kernel stores)
    row    a sum / mean over dv (keepdim) of a full node, and pointwise ops of row nodes only

Operands from outside (a gate, λ, a norm weight) may be anything that does not depend on the
root. Reshapes only end the epilogue: they move the tile in memory, not its values, so the
kernel evaluates the node before them and stores at the reshaped index.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..ir import Expr, var
from .rules import _norm_dim, relinearize
from .symbolic import RULES, Unsupported, carries_grad, meta, static_shape

aten = torch.ops.aten
CONTRACTIONS = {aten.matmul, aten.bmm, aten.einsum}
PERMUTES = {aten.permute, aten.transpose, aten.t, aten.mT}
RESHAPES = {aten.view, aten.reshape, aten._unsafe_view}
ROW_SUMS = {aten.sum, aten.mean}
NOT_POINTWISE = {aten.amax, aten.softmax, aten._softmax, aten._safe_softmax, aten.log_softmax,
                 aten._log_softmax, aten.logsumexp, aten.cat, aten.slice, aten.select, aten.index,
                 aten.expand, aten.expand_as, aten.repeat, aten.repeat_interleave, aten.squeeze,
                 aten.unsqueeze, aten.flip, aten.cumsum, aten.gather} | CONTRACTIONS | PERMUTES | RESHAPES | ROW_SUMS


def packet(node: fx.Node):
    return getattr(node.target, "overloadpacket", None) if node.op == "call_function" else None


@dataclass
class Epilogue:
    exit: fx.Node                       # the node the fused op replaces
    value: fx.Node                      # the exit without its trailing reshapes: gives the values
    index: tuple[Expr, ...]             # value's index of tile element (b..., m, dv)
    store: tuple[Expr, ...] | None      # exit's index of it; None when that is the tile itself
    nodes: set[fx.Node]


def _descendants(root: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [root]
    while stack:
        for u in stack.pop().users:
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


def _permuted(node: fx.Node, idx: tuple) -> tuple | None:
    rank = len(idx)
    p = packet(node)
    if p == aten.permute:
        dims = [_norm_dim(d, rank) for d in node.args[1]]
    else:
        d0, d1 = (-2, -1) if p == aten.mT or (p == aten.t and rank == 2) else \
            ((0, 0) if p == aten.t else node.args[1:3])
        dims = list(range(rank))
        d0, d1 = _norm_dim(d0, rank), _norm_dim(d1, rank)
        dims[d0], dims[d1] = dims[d1], dims[d0]
    return tuple(idx[d] for d in dims)


class _Grower:
    def __init__(self, root: fx.Node, index: tuple[Expr, ...], tile: tuple[Expr, ...]):
        self.root, self.desc, self.tile = root, _descendants(root), tile
        self.maps: dict[fx.Node, tuple] = {root: index}      # full nodes -> index map
        self.rows: set[fx.Node] = set()
        self.reshaped: set[fx.Node] = set()                # full nodes at or after a reshape
        self.order: list[fx.Node] = [root]

    def classify(self, u: fx.Node) -> str | None:
        """Add ``u`` if it extends the epilogue; returns how (None: it does not)."""
        p = packet(u)
        if p is None or p not in RULES or meta(u) is None or carries_grad(u) != carries_grad(self.root):
            return None         # (a region is differentiated at its root as at its contraction)
        ins = [a for a in u.all_input_nodes if a in self.desc or a is self.root]
        if not ins or any(a not in self.maps and a not in self.rows for a in ins):
            return None
        full = [a for a in ins if a in self.maps]
        x = u.args[0] if u.args else None
        if p in ROW_SUMS:
            dims = u.args[1] if len(u.args) > 1 else None
            dims = [dims] if isinstance(dims, int) else dims
            keep = (u.args[2] if len(u.args) > 2 else u.kwargs.get("keepdim", False))
            if x in self.maps and x not in self.reshaped and dims and len(dims) == 1 and keep and \
                    _norm_dim(dims[0], meta(x).dim()) == meta(x).dim() - 1 and self.maps[x][-1] == var("dv"):
                self.rows.add(u)
                return "row"
            return None
        if p in PERMUTES or p in RESHAPES:
            if x not in self.maps or (p in PERMUTES and x in self.reshaped):
                return None
            if p in PERMUTES:
                self.maps[u] = _permuted(u, self.maps[x])
            else:
                try:
                    self.maps[u] = relinearize(self.maps[x], static_shape(meta(x)), static_shape(meta(u)))
                except Unsupported:
                    return None
                self.reshaped.add(u)
            return "full"
        if p in NOT_POINTWISE:
            return None
        if not full:
            if meta(u).shape[-1] != 1:
                return None
            self.rows.add(u)
            return "row"
        maps = {self.maps[a] for a in full}
        if len(maps) != 1 or any(meta(a).shape != meta(u).shape or a in self.reshaped for a in full):
            return None
        self.maps[u] = maps.pop()
        return "full"

    def grow(self) -> None:
        changed = True
        while changed:
            changed = False
            for node in list(self.order):
                for u in node.users:
                    if u not in self.maps and u not in self.rows and self.classify(u):
                        self.order.append(u)
                        changed = True

    def best(self) -> Epilogue:
        """The largest single-exit epilogue: the latest full node whose ancestors in the
        epilogue are used only inside it."""
        position = {n: i for i, n in enumerate(self.root.graph.nodes)}
        for exit in sorted(self.maps, key=position.get, reverse=True):
            nodes = self._ancestors(exit)
            if any(u not in nodes for n in nodes - {exit} for u in n.users):
                continue
            value = exit
            while packet(value) in RESHAPES:      # nothing but reshapes follows a reshape
                value = value.args[0]
            natural = self.maps[exit] == self.tile and meta(exit).dim() == len(self.tile)
            store = None if natural else self.maps[exit]
            return Epilogue(exit, value, self.maps[value], store, nodes)
        raise AssertionError("the root alone is always a valid epilogue")

    def _ancestors(self, exit: fx.Node) -> set[fx.Node]:
        nodes, stack = {exit}, [exit]
        while stack:
            for a in stack.pop().all_input_nodes:
                if a not in nodes and (a in self.maps or a in self.rows):
                    nodes.add(a)
                    stack.append(a)
        return nodes


def extend(root: fx.Node, index: tuple[Expr, ...], tile: tuple[Expr, ...]) -> Epilogue:
    """The epilogue below contraction ``root``; ``index`` is root's index of tile element
    ``tile`` = (b..., m, dv) (a permutation of it for an einsum with permuted output letters)."""
    g = _Grower(root, index, tile)
    g.grow()
    return g.best()
