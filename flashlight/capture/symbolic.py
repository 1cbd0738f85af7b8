"""Symbolic evaluation of ATen nodes into region IR.

Every tensor node in a candidate region becomes a ``Sym``: its shape and a function from an index
(one ``Expr`` per dim) to the scalar ``Expr`` of that element. View ops compose index maps,
pointwise ops combine operands after broadcasting, index generators (arange, ones().tril())
become index arithmetic, and anything without a rule becomes a *leaf*: a tensor the kernel loads
with the real strides it has at run time. Reductions over the key dim and the two contractions
register themselves on the ``Builder`` when evaluated at the position a kernel tile computes.

Rule signature (one row per ATen op packet in ``RULES``, filled by ``rules.py``)::

    rule(b: Builder, node: fx.Node, *args, **kwargs) -> Sym | None   # None declines: leaf
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.fx as fx

from .. import _compat
from ..ir import Dot, Expr, Reduction, call, const, dot, free_vars, load, red, refs, substitute, var, walk
from ..ir.expr import scan

aten = torch.ops.aten
Idx = tuple  # tuple[Expr, ...]
RULES: dict = {}   # op packet (or operator.getitem) -> rule; see rules.py
CONSTANT_LITERALS = 64   # elements: a graph constant this small is read as literals where it can be


class Unsupported(Exception):
    """The candidate region cannot be fused; the message becomes a fallback reason."""

    def __init__(self, msg: str, node: fx.Node | None = None):
        super().__init__(msg)
        self.node = node


def kind_of(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "b"
    return "f" if dtype.is_floating_point else "i"


def meta(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


# ops each of whose elements is an element of their first argument: views, copies, and GQA's
# expansion of k and v by ``repeat_interleave`` or ``repeat``. A cast commutes with them
# (``autocast``), and a K or V operand computed outside the kernel is loaded from the tensor
# they move (``rules.computed_operand``).
MOVES = {aten.view, aten.reshape, aten._unsafe_view, aten.permute, aten.transpose, aten.t, aten.mT,
         aten.unsqueeze, aten.squeeze, aten.flatten, aten.unflatten, aten.expand, aten.expand_as,
         aten.slice, aten.select, aten.repeat_interleave, aten.repeat, aten.alias, aten.contiguous,
         aten.clone}
NARROWING = {aten.slice, aten.select}       # moves that keep part of their argument


def moved(n: fx.Node, narrowing: bool = True) -> fx.Node | None:
    """The tensor whose elements ``n`` moves (``MOVES``; not ``NARROWING`` ones unless
    ``narrowing``) in the same dtype, or None. Not a bitcast (``view.dtype``), nor
    ``repeat_interleave(repeats)``, whose first argument is the integer repeats."""
    packet = getattr(n.target, "overloadpacket", None) if n.op == "call_function" else None
    if packet not in MOVES or not n.args or n.target is aten.repeat_interleave.Tensor \
            or (not narrowing and packet in NARROWING):
        return None
    x = n.args[0]
    if meta(x) is None or meta(n) is None or meta(x).dtype != meta(n).dtype:
        return None
    return x


def static_shape(t: torch.Tensor) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in t.shape)
    except (TypeError, ValueError) as e:
        raise Unsupported(f"symbolic shape {tuple(t.shape)}") from e


@dataclass
class Sym:
    shape: tuple[int, ...]
    kind: str
    fn: Callable[[Idx], Expr]
    memo: dict = field(default_factory=dict)

    def __call__(self, idx: Idx) -> Expr:
        assert len(idx) == len(self.shape), (idx, self.shape)
        if idx not in self.memo:
            self.memo[idx] = self.fn(idx)
        return self.memo[idx]


def align(idx: Idx, out_shape: Sequence[int], shape: Sequence[int]) -> Idx:
    """Index of an operand of ``shape`` broadcast into ``out_shape`` at ``idx`` (right-aligned)."""
    tail = idx[len(idx) - len(shape):] if shape else ()
    tail_out = tuple(out_shape)[len(out_shape) - len(shape):] if shape else ()
    return tuple(const(0) if s == 1 and o != 1 else i for i, s, o in zip(tail, shape, tail_out))


def scalar(value) -> Sym:
    e = const(value)
    return Sym((), e.kind, lambda idx: e)


# ---------------------------------------------------------------------------------------------
# The builder: geometry, leaves, dots and reductions of one candidate region.
# ---------------------------------------------------------------------------------------------
def _users_on_first(node: fx.Node):
    return [u for u in node.users if u.op == "call_function" and u.args and u.args[0] is node]


def _aliases(node: fx.Node) -> list[fx.Node]:
    """``node`` and its views, through any number of them (schema: the result aliases the first
    argument)."""
    aliases, todo = [node], [node]
    while todo:
        views = [u for u in _users_on_first(todo.pop()) if _compat.first_argument_alias(u.target) == "view"]
        aliases += views
        todo += views
    return aliases


# in-place ops that write a tensor's metadata, not its values (``torch.tensor([2])`` in a traced
# program is a constant detached in place)
KEEP_VALUES = frozenset({aten.detach_.default})


def _writes(aliases: list[fx.Node]) -> list[fx.Node]:
    return [u for a in aliases for u in _users_on_first(a)
            if _compat.first_argument_alias(u.target) == "write" and u.target not in KEEP_VALUES]


def written_after(node: fx.Node, after: fx.Node) -> bool:
    """Is ``node``'s memory written in place (through it or a view) after ``after`` in the
    graph? A copy made at ``after`` then holds values that ``node`` no longer does."""
    writes = _writes(_aliases(node))
    if not writes:
        return False
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return any(order[w] > order[after] for w in writes)


def written_later(node: fx.Node) -> bool:
    """Is ``node``'s memory written in place and then read through ``node`` or a view of it, so
    that what its readers see is not its own expression? ``keep = ones(M, N).tril();
    keep[:7] = False`` writes through a view and then reads ``keep``. An update the program
    goes on through (``s *= c``, also on a view of a product: tracing makes the later readers
    read the in-place op's node, whose rule evaluates the update) is not such a write."""
    aliases = _aliases(node)
    writes = _writes(aliases)
    if not writes:
        return False
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    first = min(order[w] for w in writes)
    return any(order[u] > first and u not in writes for a in aliases for u in a.users)


CARRIES, STOPS, GRAD_MODE = "flashlight_carries_grad", "flashlight_stops_grad", "flashlight_grad_mode"  # node.meta


def mark_gradients(graph: fx.Graph, example_inputs) -> None:
    """For a graph that may be differentiated, mark in each node's meta:

    - ``GRAD_MODE``: grad mode where it runs (the graph's own ``torch.no_grad()`` blocks switch it);
    - ``CARRIES``: may its value need a gradient? An input that requires grad, a module attribute
      (unknown), a floating result of one under grad mode unless ``detach()``ed, and a tensor
      written in place (under ``no_grad`` too: eager keeps its history);
    - ``STOPS``: is it a floating value computed from gradient-carrying ones that does not pass
      their gradient on: ``detach()``, a result under ``no_grad`` (and the values a ``no_grad``
      block computes from such results: a rule may read through them, as a chunk's items read
      the chunk's input), and an in-place write under ``no_grad`` (eager's gradient skips the
      write: not the op's derivative).

    A region whose contraction runs under grad mode loads stopped values instead of fusing
    through them (its derived backward would send gradient into them), and its epilogue grows
    only through values that carry a gradient as its contraction does; one whose root carries
    none takes the inference op on detached inputs (``backend.replace``). Unmarked nodes (a
    graph no gradient reaches) carry and stop nothing."""
    enabled, inputs = torch.is_grad_enabled(), iter(example_inputs)
    for n in graph.nodes:
        if _compat.sets_grad_mode(n):
            enabled = bool(n.args[0])
            continue
        n.meta[GRAD_MODE] = enabled
        if n.op == "placeholder":
            x = next(inputs, None)
            n.meta[CARRIES] = isinstance(x, torch.Tensor) and x.requires_grad
            continue
        if n.op == "get_attr":
            n.meta[CARRIES] = True
            continue
        val = n.meta.get("val")
        floating = not isinstance(val, torch.Tensor) or val.is_floating_point() or val.is_complex()
        ins = n.all_input_nodes
        if n.op == "call_function" and _compat.first_argument_alias(n.target) == "write" and \
                isinstance(n.args[0], fx.Node) and carries_grad(n.args[0]):
            n.meta[CARRIES], n.meta[STOPS] = True, not enabled
            continue
        n.meta[CARRIES] = floating and enabled and n.target is not aten.detach.default and \
            any(carries_grad(i) for i in ins)
        n.meta[STOPS] = floating and not n.meta[CARRIES] and (any(carries_grad(i) for i in ins) or (
            not enabled and any(i.meta.get(STOPS, False) for i in ins)))    # a no_grad block's later values


def carries_grad(node: fx.Node) -> bool:
    return node.meta.get(CARRIES, False)


class Builder:
    def __init__(self, batch: tuple[int, ...], M: int, N: int, DV: int, grad_mode: bool = False,
                 fuse_stops: frozenset = frozenset()):
        self.batch, self.M, self.N, self.DV = batch, M, N, DV
        self.grad_mode = grad_mode      # a contraction under grad mode in a marked graph: STOPS nodes are leaves
        # ... but these, copies of the region's scores (``regions.build``), which fuse as ``stop``
        # expressions, and the stopped values they are computed from (``stopping``: inside one)
        self.fuse_stops, self.stopping = fuse_stops, 0
        self.DK: int | None = None
        self.bvars = tuple(var(f"b{i}") for i in range(len(batch)))
        self.m, self.n, self.dk, self.dv = var("m"), var("n"), var("dk"), var("dv")
        self.inputs: list[fx.Node] = []
        self.dots: list[Dot] = []
        self.reductions: list[Reduction] = []
        self.syms: dict[fx.Node, Sym] = {}
        self.inner: set[fx.Node] = set()     # nodes evaluated through a rule
        self.leaves: set[fx.Node] = set()
        self.declined: dict[fx.Node, str] = {}   # why a rule left a node as a leaf
        self.epilogue: set[fx.Node] = set()      # nodes after P @ V: their sums run over dv

    # -- trial evaluation ------------------------------------------------------------------
    def snapshot(self) -> "Builder":
        """A copy of the state, for ``restore`` after a trial evaluation that is rejected."""
        saved = Builder(self.batch, self.M, self.N, self.DV, self.grad_mode, self.fuse_stops)
        saved.DK = self.DK
        for name in ("inputs", "dots", "reductions", "syms", "inner", "leaves", "declined"):
            setattr(saved, name, type(getattr(self, name))(getattr(self, name)))
        return saved

    def restore(self, saved: "Builder") -> None:
        for name in ("DK", "inputs", "dots", "reductions", "syms", "inner", "leaves", "declined"):
            setattr(self, name, getattr(saved, name))
        for s in self.syms.values():     # memoised elements may name rolled-back dots/reductions
            s.memo.clear()

    # -- operands ---------------------------------------------------------------------------
    def sym(self, arg) -> Sym:
        if isinstance(arg, (bool, int, float)):
            return scalar(arg)
        if not isinstance(arg, fx.Node):
            raise Unsupported(f"operand {arg!r} of type {type(arg).__name__}")
        if arg not in self.syms:
            self.syms[arg] = self._build(arg)
        return self.syms[arg]

    def _build(self, node: fx.Node) -> Sym:
        if meta(node) is None:
            raise Unsupported(f"{node.name} is not a tensor", node)
        if written_later(node):     # its expression is not what its readers see: load it instead
            self.decline(node, "written in place after it is computed (e.g. through a view)")
            return self.leaf(node)
        stops = self.grad_mode and node.meta.get(STOPS, False)     # no gradient flows through it
        if stops and node not in self.fuse_stops and not self.stopping:
            self.decline(node, "its gradient is stopped (detach() or no_grad) in a region under grad mode")
            return self.leaf(node)
        if node.op == "get_attr":
            return self.constant(node)
        key = getattr(node.target, "overloadpacket", node.target)
        rule = RULES.get(key) if node.op == "call_function" else None
        self.stopping += stops
        try:
            s = rule(self, node, *node.args, **node.kwargs) if rule else None
        finally:
            self.stopping -= stops
        if s is None:
            return self.leaf(node)
        self.inner.add(node)
        if node in self.fuse_stops:
            return Sym(s.shape, s.kind, lambda idx: call("stop", s(idx)) if s.kind == "f" else s(idx))
        return s

    def leaf(self, node: fx.Node) -> Sym:
        t = meta(node)
        kind = kind_of(t.dtype)

        def fn(idx):
            if node not in self.inputs:
                self.inputs.append(node)
                self.leaves.add(node)
            return load(self.inputs.index(node), idx, kind)
        return Sym(static_shape(t), kind, fn)

    def constant(self, node: fx.Node) -> Sym:
        """A tensor the graph holds. One the program created from literals (the list in
        ``values[..., [-1]]``), small, integer or bool, read at constant positions, is literals,
        so the rules reading it see the position (top-k's threshold entry). Otherwise it is
        loaded like an input: floating ones, and parameters and buffers (their values change
        between calls)."""
        leaf = self.leaf(node)
        gm = node.graph.owning_module
        value = getattr(gm, node.target, None) if gm is not None and _compat.traced_constant(node) else None
        if not isinstance(value, torch.Tensor) or _compat.is_fake(value) or value.numel() > CONSTANT_LITERALS \
                or value.is_floating_point() or value.is_complex():
            return leaf
        value = value.cpu()

        def fn(idx):
            if all(e.op == "const" for e in idx):
                return const(value[tuple(e.args[0] for e in idx)].item())
            return leaf(idx)
        return Sym(leaf.shape, leaf.kind, fn)

    def decline(self, node: fx.Node, why: str) -> None:
        """A rule's reason for returning None (shown by explain() when fusion fails there)."""
        self.declined[node] = why
        return None

    # -- tiles the kernel computes -----------------------------------------------------------
    def size(self, axis: Expr) -> int:
        """The extent of the tile axis ``axis`` (m: M, n: N, dk: DK, dv: DV)."""
        return {"m": self.M, "n": self.N, "dk": self.DK, "dv": self.DV}[axis.args[0]]

    def is_tile(self, idx: Idx, row: Expr, col: Expr) -> bool:
        inner = {"m", "n", "dk", "dv"}
        return idx[-2:] == (row, col) and not any(free_vars(i) & inner for i in idx[:-2])

    def add_dot(self, q: Expr, k: Expr) -> Expr:
        d = Dot(q, k)
        if d not in self.dots:
            self.dots.append(d)
        return dot(self.dots.index(d))

    def add_reduction(self, kind: str, body: Expr, v: Expr | None = None, size: int | None = None,
                      rank: int = 0) -> Expr:
        """Register ``kind``_n ``body`` (over ``size`` positions along the key axis: N, or N + 1
        when the body reads a column appended with ``torch.cat``, which rewrite splits off;
        ``rank``: a ``kth`` reduction's)."""
        if "n" not in free_vars(body) and not refs(body, "dot") and kind != "dot":
            raise Unsupported(f"{kind} over the key dim of a value that does not vary along it")
        if any(x.op == "cat_n" for x in walk(body)):
            if kind == "dot" or size in (None, self.N):    # P @ V contracts the N rows of V only
                body = substitute(body, lambda e: e.args[0] if e.op == "cat_n" else None)
            elif size != self.N + 1:
                raise Unsupported(f"{kind} over {size} positions of an axis with {self.N} keys and a column")
        if kind == "kth" and size not in (None, self.N):
            raise Unsupported("top-k over the keys and an appended column")
        r = Reduction(kind, body, v, rank=rank)
        if r not in self.reductions:
            self.reductions.append(r)
        return red(self.reductions.index(r))

    def add_scan(self, body: Expr, direction: str) -> Expr:
        """Register a sum of ``body`` over the keys whose partial sums the region reads (a
        ``direction`` scan: "prefix" or "suffix"); returns them at the tile's key, the key itself
        excluded."""
        if any(x.op == "cat_n" for x in walk(body)):
            raise Unsupported("a cumulative sum over the keys and an appended column")
        r = Reduction("sum", body, scan=direction)
        if r not in self.reductions:
            self.reductions.append(r)
        return scan(self.reductions.index(r), (*self.bvars, self.m, self.n))
