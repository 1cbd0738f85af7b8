"""Where the backward kernels write each input's gradient, decided once per region so that the
three generated kernels and the runtime (which allocates the gradient tensors) agree.

A *site* is one ``scatter`` of a load's adjoint: the row kernel's (epilogue loads), the dK/dV
kernel's per tile (loads in the reduction bodies: biases, tables) or after its query loop (the K
and V operands), the dQ kernel's after its key loop (the Q operands). An input whose sites are
each written once per program, at addresses that program alone owns, and whose sites' boxes
(``owned``) do not overlap and together cover the tensor, is *stored*: ``tl.store`` in the input's
dtype into ``empty_like(x)``, no zero fill, no fp32 copy. That is one site over the whole tensor,
or slices of one (a packed qkv's q, k and v; DiffAttn's two half-width heads). Every other
gradient is accumulated with ``tl.atomic_add`` into fp32 zeros (broadcast biases, gathered
tables, an input read twice at the same address).

GQA's query heads share their K and V head: a dK/dV program per (key block, query head) would
add its dK and dV into the shared head with atomics. The plan's *group loop* (``Group``) makes a
program visit the group's query heads instead, one after the other, dK and dV staying in
registers (FA2's and Flex's GQA backward): the program then owns its K/V head's rows and stores
them. Fewer programs, though: where the whole group leaves too few (``MIN_PROGRAMS``), a program
visits part of the group and adds it with atomics, or the whole group is left to atomics.
"""
from __future__ import annotations

import collections
import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from ..ir import Expr, Region, dot, free_vars, red, refs, substitute, walk
from ..ir.derivative import tile, vjp
from ..ir.expr import is_const, linear, var
from ..ir.region import every_pass
from ..ir.scaling import shift_gradients
from ..sparsity import dead_predicate, full_predicate
from .emit import Block, Ctx, Emitter
from .kernel import TILE

# the tile axis that tells a kernel's programs apart, per context (grid axis 0)
PROGRAM_AXIS = {"o": "m", "row": "m", "q": "m", "k": "n", "kn": "n", "v": "n"}


@dataclass(frozen=True)
class Site:
    input: int
    load: Expr
    ctx: str            # the tile context of the scatter (see codegen.kernel.TILE)
    kernel: str         # "rows", "dkdv" or "dq"
    once: bool          # written once per program (after the loop), not per tile
    body: bool = False  # a load of a reduction body (a bias, a table, points), not a Q/K/V operand

    @property
    def writers(self) -> tuple[str, ...]:
        """The tile axes that tell the site's writes apart: the program's, for a site written
        once per program; both, for one written per tile (each tile is visited once)."""
        return (PROGRAM_AXIS[self.ctx],) if self.once else ("m", "n")


class Group(NamedTuple):
    """The dK/dV kernel's group loop: a program visits ``size`` consecutive indices of batch dim
    ``dim`` (query heads whose K and V operands are the same), summing their dK and dV."""
    dim: int
    size: int


# the group loop's modes (FLASHLIGHT_GROUP_LOOP): "auto" keeps at least MIN_PROGRAMS dK/dV
# programs of NOMINAL_KEYS keys each (two waves of an H100's or H200's 132 SMs), "1" visits
# the whole group wherever that is correct, "0" never loops (atomics)
GROUP_MODES = ("auto", "1", "0")
MIN_PROGRAMS = 256
NOMINAL_KEYS = 128


@dataclass
class GradPlan:
    """What the backward kernels compute and where they write it.

    Args:
        members: reductions with a row gradient (sums and P @ V products the output reads, the
            sums their bodies read, and the maxima in ``shift_gradients``: theirs reaches the
            argmax key alone).
        dots: score tiles that some member body reads (recomputed per tile).
        accs: ``"dq"``/``"dk"``/``"dv"`` -> the Q / K / V operand expressions whose gradients
            accumulate in registers (one accumulator per distinct expression).
        sites: every gradient write; ``stored``: inputs written by ``tl.store`` (see module doc);
            ``zeroed``: stored inputs written per tile, which start as zeros (the tiles the
            sparsity scan skips write nothing).
        fused_dq: the dK/dV kernel also adds each tile's dS K into dQ with fp32 atomics (cuDNN's
            and FA3's backward), so S, P and dP are computed once per tile, not again by a dQ
            kernel; the Q operands' gradients are then per-tile sites of the dK/dV kernel.
        scans: the scans whose partial sums the member bodies read (``fused_kv``); where a
            gradient reaches the partial sums, their bodies are reversed too.
        chained: the members whose bodies take the gradient of sums of an earlier pass (a sum
            of relu(e / l - t)), and those sums: the sums kernel (``codegen.backward.SumsWriter``)
            completes their row gradients.
    """
    members: list[int]
    dots: list[int]
    accs: dict[str, list[Expr]]
    sites: list[Site] = field(default_factory=list)
    stored: frozenset[int] = frozenset()
    zeroed: frozenset[int] = frozenset()
    fused_dq: bool = False      # dQ added by the dK/dV kernel per tile (fp32 atomics): no dQ kernel
    group: Group | None = None
    scans: list[int] = field(default_factory=list)  # scans whose partial sums the bodies read
    chained: dict[int, list[int]] = field(default_factory=dict)     # member -> the sums its body reverses into

    @property
    def fused_kv(self) -> bool:
        """Partial sums over the keys (``scans``): one kernel over query blocks walks the key
        blocks in the scans' order, carrying the forward's partial sums and their adjoints' row
        by row, and adds dK, dV and the body loads' gradients per tile with fp32 atomics (a
        program over key blocks would need every row's partial sums at its block's edge). No
        dK/dV kernel."""
        return bool(self.scans)

    @property
    def carried(self) -> dict[Expr, str]:
        """The body loads whose gradient a kernel (``"dkdv"``, ``"dq"``) sums across its loop and
        writes once, not per tile (``summing_kernel``), in the order of their sites."""
        return {s.load: s.kernel for s in self.sites if s.body and s.once}

    def programs(self, batch: tuple[int, ...]) -> int:
        """The dK/dV kernel's programs per key block (its grid's axis 1)."""
        return math.prod(batch) // (self.group.size if self.group else 1)

    def written(self, kernel: str | None = None) -> list[int]:
        """Inputs whose gradient ``kernel`` (any kernel: None) writes: its ``g`` arguments."""
        return sorted({s.input for s in self.sites if kernel is None or s.kernel == kernel})


def loads(adjoints: dict[Expr, Expr]) -> list[Expr]:
    return [x for x in adjoints if x.op == "load"]


def extra_seeds(region: Region, members: list[int]) -> dict[Expr, Expr]:
    """The adjoint of every member sum's extra element (a sink logit's exp(s_h - m)): its row
    gradient ``dr{j}``, as the row kernel names it (r_j = extra_j + sum_n body_j)."""
    seeds: dict[Expr, Expr] = {}
    for j in members:
        e = region.reductions[j].extra
        if e is not None and region.reductions[j].kind != "max":     # a max's: a constant
            seeds[e] = seeds[e] + tile(f"dr{j}") if e in seeds else tile(f"dr{j}")
    return seeds


def _distinct(exprs) -> list[Expr]:
    return list(dict.fromkeys(exprs))


def _divisions(e: Expr, name: str) -> set[int]:
    """The constants c of every ``b // c`` of the var ``name`` in ``e``."""
    return {x.args[1].args[0] for x in walk(e) if x.op in ("idiv", "floordiv") and x.args[0] == var(name)
            and is_const(x.args[1]) and x.args[1].kind == "i" and x.args[1].args[0] > 1}


def _quotient(name: str, fits, new: str):
    """A ``substitute`` rule: ``name // c`` -> the var ``new``, for every constant c with ``fits(c)``."""
    def fn(x: Expr) -> Expr | None:
        if x.op in ("idiv", "floordiv") and x.args[0] == var(name) and is_const(x.args[1]) and fits(x.args[1].args[0]):
            return var(new)
        return None
    return fn


def per_head(e: Expr, name: str, size: int) -> bool:
    """Does ``e`` change between ``size`` aligned consecutive values of the var ``name`` (a group
    loop's heads): does it read ``name`` other than as ``name // c`` for a c that ``size`` divides?"""
    return name in free_vars(e) and name in free_vars(substitute(e, _quotient(name, lambda c: c % size == 0, "_q")))


def group_loop(region: Region, accs: dict[str, list[Expr]], mode: str = "auto") -> Group | None:
    """The dK/dV kernel's group loop (``Group``; module doc), where one is correct and ``mode``
    takes it: the K and V operands read some batch var b only as ``b // G`` (G consecutive
    indices share them: GQA's heads), or not at all (G is b's extent: MQA's one K/V head, or
    K and V broadcast over the batch), G divides b's extent, and the scan of live query blocks
    does not read b (every head the loop visits has the key block's blocks). The loop visits the
    largest divisor of G that leaves MIN_PROGRAMS programs ("auto"), or all of G ("1")."""
    operands = accs["dk"] + accs["dv"]
    if mode == "0" or not operands:
        return None
    scan = None         # the vars the scan's predicates read, found at the first candidate
    blocks = -(-region.N // NOMINAL_KEYS)
    for d, name in enumerate(region.batch_vars):
        read = any(name in free_vars(e) for e in operands)     # unread: every index shares them (MQA)
        sizes = set().union(*(_divisions(e, name) for e in operands)) if read else {region.batch[d]} - {1}
        for g in sorted(sizes, reverse=True):
            if region.batch[d] % g or any(
                    name in free_vars(substitute(e, _quotient(name, lambda c: c == g, "grp"))) for e in operands):
                continue
            if scan is None:
                scan = free_vars(dead_predicate(region, every_pass(region))) | free_vars(
                    full_predicate([rd.body for rd in region.reductions]))     # a max's too (shift_gradients)
            if name in scan:
                continue
            loops = [s for s in range(g, 1, -1) if g % s == 0
                     and (mode == "1" or blocks * math.prod(region.batch) // s >= MIN_PROGRAMS)]
            return Group(d, loops[0]) if loops else None
    return None


def output_seeds(region: Region) -> dict[Expr, Expr]:
    """The adjoints the row kernel starts from: dO for the output's [M, DV] tile, and for each
    extra row output (a logsumexp) its gradient ``go{k}``, which the row kernel puts in the
    tile's first column only (its reverse sums adjoints over dv)."""
    seeds = {region.out: tile("do")}
    for k, row in enumerate(region.rows):
        seeds[row.expr] = seeds[row.expr] + tile(f"go{k}") if row.expr in seeds else tile(f"go{k}")
    return seeds


def grad_plan(region: Region, fused_dq: bool = False, group: str = "auto") -> GradPlan:
    """The plan of a region ``backward_support`` accepts (``fused_dq``: see ``GradPlan``;
    ``group``: ``group_loop``'s mode)."""
    row_adj = vjp(output_seeds(region))
    shifted = shift_gradients(region)      # maxima taking a gradient (at their argmax)
    members = {j for j, rd in enumerate(region.reductions) if (rd.kind != "max" and red(j) in row_adj) or j in shifted}
    body_adj: dict[Expr, Expr] = {}
    while True:     # and the sums the members' bodies read (``read_sums``), to a fixed point
        body_adj = vjp({region.reductions[j].body: tile("db") for j in members}) if members else {}
        found = {x.args[0] for x in body_adj if x.op == "red" and region.reductions[x.args[0]].kind != "max"}
        if found <= members:
            break
        members |= found
    members = sorted(members)
    chained = {}        # member -> the member sums its body reads on a gradient path
    for j in members:
        if region.reductions[j].kind != "max":
            adj = vjp({region.reductions[j].body: tile("db")})
            reads = sorted(x.args[0] for x in adj if x.op == "red" and region.reductions[x.args[0]].kind != "max")
            if reads:
                chained[j] = reads
    # the scans the bodies read (their partial sums recomputed), reversed where a gradient reaches them
    scans = sorted({d for j in members for d in refs(region.reductions[j].body, "scan")})
    reached = sorted({x.args[0] for x in body_adj if x.op == "scan"})
    if reached:     # the scans' bodies, seeded with the adjoint of their partial sums
        body_adj = {**vjp({region.reductions[j].body: tile("dx") for j in reached}), **body_adj}
    dots = sorted({i for j in members + scans for i in refs(region.reductions[j].body, "dot")})
    grad_dots = [i for i in dots if dot(i) in body_adj]
    accs = {"dq": _distinct(region.dots[i].q for i in grad_dots),
            "dk": _distinct(region.dots[i].k for i in grad_dots),
            "dv": _distinct(region.reductions[j].v for j in members if region.reductions[j].kind == "dot")}
    plan = GradPlan(members, dots, accs, fused_dq=fused_dq and not scans, scans=scans,
                    group=None if scans else group_loop(region, accs, group), chained=chained)
    fused_dq = plan.fused_dq
    plan.sites = [Site(x.args[0], x, "o", "rows", True) for x in loads(row_adj)]
    plan.sites += [Site(x.args[0], x, "row", "rows", True) for x in loads(vjp(extra_seeds(region, members)))]
    # the bodies' loads: ``full_body`` (a block inside every mask) drops masks, never adds a load
    tiles = "dq" if plan.fused_kv else "dkdv"      # the kernel that writes per tile
    for x in loads(body_adj):
        kernel = summing_kernel(region, x, fused_dq, plan.group, plan.fused_kv)
        if kernel is None:
            plan.sites.append(Site(x.args[0], x, "s", tiles, False, body=True))
        else:
            plan.sites.append(Site(x.args[0], x, "kn" if kernel == "dkdv" else "q", kernel, True, body=True))
    dq_site = ("dkdv", False) if fused_dq else ("dq", True)
    kv_site = ("dq", False) if plan.fused_kv else ("dkdv", True)
    for kind, ctx, (kernel, once) in (("dk", "k", kv_site), ("dv", "v", kv_site), ("dq", "q", dq_site)):
        for e in accs[kind]:
            plan.sites += [Site(x.args[0], x, ctx, kernel, once) for x in loads(vjp({e: tile("g")}))]
    by_input: dict[int, list[Site]] = {}
    for s in plan.sites:
        by_input.setdefault(s.input, []).append(s)
    # a per-tile site's tile is visited once whatever the group loop (``owned`` asks every batch
    # var, the head's too, of its index)
    group = {s: plan.group if s.kernel == "dkdv" and s.once else None for s in plan.sites}
    plan.stored = frozenset(i for i, ss in by_input.items() if partition(
        [owned(s.load, s.writers, region, group[s]) for s in ss], region.inputs[i].shape))
    plan.zeroed = frozenset(i for i in plan.stored if any(not s.once for s in by_input[i]))
    return plan


def summing_kernel(region: Region, x: Expr, fused_dq: bool, group: Group | None,
                   fused_kv: bool = False) -> str | None:
    """The kernel that sums body load ``x``'s adjoint across its loop and writes it once, where
    its index misses one of the tile's axes: per key (IPA's key points, a key padding bias), the
    dK/dV kernel, whose program owns the key block; per query, the dQ kernel (none with
    ``fused_dq``); per head (IPA's γ, a temperature), the dK/dV kernel — unless a group loop
    changes the head inside the loop. None: read per score, written per tile (a pair bias, a
    gathered table). Per tile, each such site was a tile sum and an atomic add per row or
    column (IPA: 24 a tile, into addresses every key block's program shares). With ``fused_kv``
    only the dQ kernel runs: it sums the per-query ones and writes the others per tile."""
    used = _used(x)
    if {"m", "n"} <= used:
        return None
    if "m" in used:
        return None if fused_dq else "dq"
    if fused_kv:
        return None
    if group is not None and any(per_head(ie, region.batch_vars[group.dim], group.size) for ie in x.args[1]):
        return None
    return "dkdv"


Box = tuple[range | frozenset, ...]       # per dim of a tensor, the indices a site writes
MAX_ENUMERATED = 1 << 20        # a dim's index set listed element by element only up to this size


def _indices(terms: list[tuple[int, int]], start: int) -> range | frozenset | None:
    """The set {start + sum of coef * i, 0 <= i < extent} of (coef, extent) terms, where each
    value has one such sum: every coefficient is past the largest sum of the smaller ones (a
    slice, or heads 2h and 2h + 1 of a projection viewed as 2H heads). A range when the terms are
    one stride's dense layout; None when not one-to-one or too large to list."""
    terms = sorted(terms)
    span, step, dense = 0, terms[0][0] if terms else 1, True
    for coef, e in terms:
        if coef <= span:
            return None
        dense = dense and coef == span + step
        span += coef * (e - 1)
    count = math.prod(e for _, e in terms)
    if dense:
        return range(start, start + step * count, step)
    if count > MAX_ENUMERATED:
        return None
    values = [start]
    for coef, e in terms:
        values = [x + coef * i for x in values for i in range(e)]
    return frozenset(values)


def owned(x: Expr, axes: tuple[str, ...], region: Region, group: Group | None = None) -> Box | None:
    """The indices of load ``x``'s tensor that the kernel's programs write, each program its own
    part of them, or None where programs may share an address. Each dim's index is a constant
    plus vars, each value reached once (``_indices``: a slice, a dim read at one place, a packed
    qkv's ``h·D + dk + 2·H·D``, the DIFF Transformer's heads ``2h·d + dk`` and ``(2h + 1)·d +
    dk``), no var in two dims, inside the dim; the vars include every batch var and the tile
    ``axes`` that tell the writers apart (``Site.writers``: no GQA sharing, no broadcast over
    a grid axis, no gather). Under a
    group loop a program visits ``group.size`` indices b of one batch dim: its grid var is
    b // size, and an address reached as b // size is that program's."""
    extent = {"m": region.M, "n": region.N, "dk": region.DK, "dv": region.DV,
              **dict(zip(region.batch_vars, region.batch))}
    grid = [*region.batch_vars, *axes]
    index = x.args[1]
    if group is not None:
        name = region.batch_vars[group.dim]
        extent["grp"], grid[group.dim] = region.batch[group.dim] // group.size, "grp"
        index = [substitute(ie, _quotient(name, lambda c: c == group.size, "grp")) for ie in index]
    seen: set[str] = set()
    box = []
    for ie, size in zip(index, region.inputs[x.args[0]].shape):
        lin = linear(ie)
        if lin is None or any(v not in extent or v in seen for v in lin[0]):
            return None
        idx = _indices([(c, extent[v]) for v, c in lin[0].items() if extent[v] > 1], lin[1])
        if idx is None or not idx or min(idx) < 0 or max(idx) >= size:
            return None
        seen.update(lin[0])
        box.append(idx)
    return tuple(box) if {v for v in grid if extent[v] > 1} <= seen else None


def _disjoint(a: range | frozenset, b: range | frozenset) -> bool:
    small, large = (a, b) if len(a) <= len(b) else (b, a)
    return not any(i in large for i in small)


def partition(boxes: list[Box | None], shape) -> bool:
    """Do the boxes tile a tensor of ``shape``: none missing, none overlapping, all of it covered
    (disjoint boxes inside it whose sizes add up to its own)?"""
    if not boxes or any(b is None for b in boxes):
        return False
    for a, b in itertools.combinations(boxes, 2):
        if not any(_disjoint(da, db) for da, db in zip(a, b)):
            return False
    return sum(math.prod(len(d) for d in b) for b in boxes) == math.prod(shape)


def in_bounds(ctx: Ctx) -> str | None:
    """The mask of a tile's in-range elements (its two vars' masks), for ``scatter``'s
    ``sum_mask``: an operand's adjoint in the rows that pad a block can be 0 * inf (a K
    divided by its norm, which loads as 0 there), and where the operand's load does not use the
    tile's var (N = 1 reads k at key 0) those rows are summed into an in-range gradient."""
    rows, cols, _ = TILE[ctx.name]
    masks = [ctx.masks[v] for v in (rows, cols) if v in ctx.masks]
    return " & ".join(masks) or None


def gathered(x: Expr) -> bool:
    """Does load ``x`` read its tensor through a computed index (a table at a bucket of the
    position, a per-document bias at the document id): an index not linear in its vars?"""
    return any(linear(ie) is None for ie in x.args[1])


def uniform_add(x: Expr, val: str, ptr: str, mask: str, bounds: list[tuple[str, str]]) -> list[str]:
    """Lines that add a tile's adjoint ``val`` into the gathered gradient of load ``x`` (at
    ``ptr``; ``mask``: the in-range elements, where ``val`` is not already 0 outside them):
    one add of the tile's sum where the index, bounded over the tile (``bounds``: each dim's
    (lo, hi) scalars, ``TileWriter.index_bounds``), takes one value, else one add per element.
    Per element, many adds meet at an address (T5's relative-position table: 65 buckets a
    head, nearly every score in the two clipped ones) and queue in L2; a tile away from the
    diagonal takes one add instead of BLOCK_M x BLOCK_N."""
    i = x.args[0]
    one = " & ".join(f"({lo} == {hi})" for lo, hi in bounds if lo != hi) or "True"
    at = " + ".join([f"g{i}_ptr"] + [f"{lo} * g{i}_s{d}" for d, (lo, _) in enumerate(bounds) if lo != "0"])
    part = f"tl.where({mask}, {val}, 0.0)" if mask else val
    return [f"if {one}:",
            "    " + atomic_add(at, f"tl.sum(tl.sum({part}, 1), 0)"),
            "else:",
            "    " + atomic_add(ptr, val, mask)]


def atomic_add(ptr: str, val: str, mask: str = "") -> str:
    """An fp32 accumulation into a gradient (``mask``: the elements to add, "" for all).
    Relaxed: the adds order nothing (the gradient is read after the kernel), and Triton's
    default, acq_rel, puts a fence around each one (PyTorch's Inductor made its own relaxed in
    pytorch#129133)."""
    return f"tl.atomic_add({ptr}, {val}{f', mask={mask}' if mask else ''}, sem=\"relaxed\")"


def write(x: Expr, ptr: str, val: str, mask: str, stored: frozenset[int]) -> str:
    """The line that writes ``val`` into load ``x``'s gradient: ``tl.store`` in the gradient's
    dtype for a ``stored`` input, else an fp32 ``atomic_add``."""
    i = x.args[0]
    if i in stored:
        return f"tl.store({ptr}, {val}.to(g{i}_ptr.dtype.element_ty){', mask=' + mask if mask else ''})"
    return atomic_add(ptr, val, mask)


def _used(x: Expr) -> set[str]:
    return set().union(*(free_vars(i) for i in x.args[1]))


def tile_sum(x: str, axes: set[str], rows: str, cols: str, keep_dims: bool) -> str:
    """The sum of tile ``x`` over ``axes`` (of its ``rows`` and ``cols``): one dim kept as 1, or
    both (a [1, 1] tile where ``keep_dims``, else a scalar)."""
    if axes == {rows, cols}:
        kd = ", keep_dims=True" if keep_dims else ""
        return f"tl.sum(tl.sum({x}, 1{kd}), 0{kd})"
    return f"tl.sum({x}, {0 if rows in axes else 1}, keep_dims=True)"


def carry_init(carried: dict[Expr, str], ctx: Ctx) -> list[str]:
    """Zeros for each carried load's sum (``carried``: load -> register name): the tile
    ``ctx``'s shape, 1 along each axis its index does not use."""
    rows, cols, shape = TILE[ctx.name]
    r, c = shape.strip("[]").split(", ")
    return [f"{acc} = tl.zeros([{r if rows in _used(x) else 1}, {c if cols in _used(x) else 1}], dtype=tl.float32)"
            for x, acc in carried.items()]


def flush(em: Emitter, carried: dict[Expr, str], ctx: Ctx, block: Block, stored: frozenset[int]) -> None:
    """Write each carried load's sum (``carry_init``) once, after the loop."""
    rows, cols, _ = TILE[ctx.name]
    for x, acc in carried.items():
        val = acc if _used(x) & {rows, cols} else tile_sum(acc, {rows, cols}, rows, cols, keep_dims=False)
        ptr, mask = em.address(x, ctx, block, "g")
        block.lines.append(write(x, ptr, val, mask, stored))


Term = tuple[float, tuple[Expr, ...]]     # coefficient, factors
MAX_TERMS = 16


def tile_axes(e: Expr) -> set[str]:
    """The tile axes (m, n) along which ``e`` varies: its vars, m for a row value, both for a
    score or a writer's tile."""
    if refs(e, "dot") or refs(e, "tile"):
        return {"m", "n"}
    return (set(free_vars(e)) & {"m", "n"}) | ({"m"} if refs(e, "red") else set())


def terms(e: Expr, axes: set[str]) -> list[Term]:
    """``e`` as a sum of products, like terms merged: distributed over a sum where that takes a
    factor constant along ``axes`` out of a term (a - b of a query's and a key's coordinate;
    not dR_1 + dR_2, whose parts both vary), through products of up to ``MAX_TERMS`` terms, and
    linearly: a product of two such sums stays one factor ((a - b)^2 expanded to a^2 - 2ab + b^2
    cancels quadratically in the offset of a and b from 0: a weight's gradient at relative
    error 3e-3 with coordinates 300 times their spread, session 26's review). The form
    ``factored_sum`` splits."""
    memo: dict[Expr, list[Term]] = {}

    def free(t: Term) -> bool:
        return any(not tile_axes(f) & axes for f in t[1])

    def mixed(ts: list[Term]) -> bool:      # a sum with a part taken out
        return len(ts) > 1 and any(map(free, ts))

    def expand(x: Expr) -> list[Term]:
        if x not in memo:
            memo[x] = split(x)
        return memo[x]

    def split(x: Expr) -> list[Term]:
        if x.op == "const" and x.kind == "f":
            return [(x.args[0], ())]
        if x.op in ("add", "sub") and x.kind == "f":
            a, b = expand(x.args[0]), expand(x.args[1])
            if any(map(free, a + b)):
                return a + (b if x.op == "add" else [(-c, f) for c, f in b])
        if x.op == "neg":
            return [(-c, f) for c, f in expand(x.args[0])]
        if x.op == "mul" and x.kind == "f":
            a, b = expand(x.args[0]), expand(x.args[1])
            if len(a) * len(b) <= MAX_TERMS and not (mixed(a) and mixed(b)):
                return [(ca * cb, fa + fb) for ca, fa in a for cb, fb in b]
        return [(1.0, (x,))]
    merged: dict[frozenset, list] = {}
    for c, fs in expand(e):
        merged.setdefault(frozenset(collections.Counter(fs).items()), [0.0, fs])[0] += c
    return [(c, fs) for c, fs in merged.values() if c != 0.0]


def factored_sum(em: Emitter, g: Expr, ctx: Ctx, block: Block, axes: set[str], zero: str | None,
                 sums: dict[tuple, str]) -> str | None:
    """The sum of the adjoint ``g`` over the tile ``axes`` its load does not read, with the
    factors that do not vary along them taken out of the sum: sum_n G (a_m - b_n) =
    a_m sum_n G - sum_n G b_n, one reduction per distinct factor taken out, and each reduction
    shared across the loads of one tile (``sums``: (the axes, the summand) -> its name). A
    difference of a query's and a key's coordinate (IPA's points) is then no tile that lives
    from the score's recomputation to dS (the summands load what they read again,
    ``Emitter.emit_reloaded``). None where nothing factors out (the plain sum is one reduction).
    It costs precision where the parts taken out are large and their difference small: sum_n G
    is ~0 for a softmax, so a_m sum_n G is roundoff times |a| (docs/design.md, "Backward")."""
    groups: dict[frozenset, list] = {}       # the factors taken out -> (them, the summand's terms)
    for c, fs in terms(g, axes):
        out = [f for f in fs if not tile_axes(f) & axes]
        inner = [f for f in fs if tile_axes(f) & axes]
        if not inner:
            return None         # constant along the sum: a count of the in-range elements
        prod = functools.reduce(lambda a, b: a * b, inner)
        groups.setdefault(frozenset(collections.Counter(out).items()), [out, []])[1].append(
            prod if c == 1.0 else prod * c)
    if all(not out for out, _ in groups.values()):
        return None
    rows, cols, shape = TILE[ctx.name]
    parts = []
    for out, summands in groups.values():
        summand = functools.reduce(lambda a, b: a + b, summands)
        key = (frozenset(axes), summand)
        if key not in sums:
            x = f"tl.broadcast_to({em.emit_reloaded(summand, ctx, block)}, {shape})"
            x = f"tl.where({zero}, {x}, 0.0)" if zero else x
            sums[key] = em.fresh("fs")
            block.lines.append(f"{sums[key]} = {tile_sum(x, axes, rows, cols, keep_dims=True)}")
        parts.append(" * ".join([*(em.emit(f, ctx, block) for f in out), sums[key]]))
    return " + ".join(parts)


def scatter(em: Emitter, adjoints: dict[Expr, Expr], ctx: Ctx, block: Block,
            stored: frozenset[int] = frozenset(), tile_mask: str | None = None,
            sum_mask: str | None = None, index_bounds=None, carried: dict[Expr, str] | None = None,
            sums: dict[tuple, str] | None = None) -> None:
    """Write every load's adjoint at the load's address in its gradient tensor ``g{i}``, first
    summed over the tile axes its index does not use (broadcast dims): ``tl.store`` in the
    gradient's dtype for a ``stored`` input, else ``tl.atomic_add`` into fp32; a load in
    ``carried`` (load -> register, ``carry_init``) adds the sum to its register instead
    (``flush`` writes it after the loop); a sum over a score tile is ``factored_sum``'s where it
    factors. ``tile_mask``: the tile's in-range elements; the others are zeroed before the sums
    (a padded row's adjoint can be 0 * inf, e.g. through an epilogue's division by a dv-sum that
    is 0 there).
    ``sum_mask``: the same, applied only where there is a sum (elsewhere the write's own mask
    already skips them). ``index_bounds(x)``: a gathered load's index bounded over the tile
    (``uniform_add``), or None where it cannot be. ``sums``: ``factored_sum``'s reductions,
    shared with other calls on the same tile."""
    rows, cols, shape = TILE[ctx.name]
    score = {rows, cols} == {"m", "n"}
    sums = {} if sums is None else sums
    for x, g in adjoints.items():
        if x.op != "load":
            continue
        used = _used(x)
        zero = tile_mask or (sum_mask if rows not in used or cols not in used else None)
        axes = {rows, cols} - used
        factored = axes and score and (val := factored_sum(em, g, ctx, block, axes, zero, sums)) is not None
        if factored:
            if len(axes) == 2:
                val = tile_sum(val, axes, rows, cols, keep_dims=False)     # [1, 1] -> the scalar the plain sum gives
            zero = None     # the factors taken out are not masked: an out-of-range one can be inf
        else:
            val = f"tl.broadcast_to({em.emit(g, ctx, block)}, {shape})"
            if zero:
                val = f"tl.where({zero}, {val}, 0.0)"
            if axes:
                val = tile_sum(val, axes, rows, cols, keep_dims=False)
        if carried and x in carried:
            block.lines.append(f"{carried[x]} = {carried[x]} + {val}")
            continue
        ptr, mask = em.address(x, ctx, block, "g")
        if (x.args[0] not in stored and index_bounds and gathered(x) and used & {rows, cols}
                and (iv := index_bounds(x)) is not None):
            block.lines += uniform_add(x, val, ptr, "" if zero else mask, iv)
        else:
            block.lines.append(write(x, ptr, val, mask, stored))
