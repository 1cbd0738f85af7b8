"""Forward kernel generation: one Triton program per (M block, batch index), a loop over N blocks
per pass, online reduction state in fp32 registers, ``tl.dot`` for every contraction.

The loop nest, the number of score tiles, the reduction states and the epilogue all come from
the region IR; nothing here knows what "causal" or "ALiBi" is.
"""
from __future__ import annotations

import torch

from ..ir import Expr, Region, call, free_vars, refs, walk
from ..ir.region import argmax_columns, rowstat_columns
from ..sparsity import TRUE, BlockStat, IntervalWriter, dead_predicate, full_body, full_predicate, useful
from .emit import Block, CodegenError, Ctx, Emitter, jump_reads, max_terms, plain, prelude

TL_DTYPE = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32"}
NEG_INF = 'float("-inf")'


# the tile of each var: offsets = start + arange(width) (start_m: the dK/dV kernel's query loop)
BLOCKS = {"m": ("start_m", "BLOCK_M"), "n": ("start_n", "BLOCK_N"), "dk": ("0", "BLOCK_DK"), "dv": ("0", "BLOCK_DV")}
# a scan's pass walks its key blocks in this order (``block_loops``)
SCAN_ORDER = {"prefix": "forward", "suffix": "reverse"}


def _ctx(name: str, rows: tuple[str, str], cols: tuple[str, str], key_start: str | None = None) -> Ctx:
    """A tile context: ``rows`` = (var, offsets) laid along axis 0, ``cols`` along axis 1."""
    (rv, ro), (cv, co) = rows, cols
    return Ctx(name,
               vars={rv: f"{ro}[:, None]", cv: f"{co}[None, :]"},
               masks={rv: f"mask_{rv}[:, None]", cv: f"mask_{cv}[None, :]"}, key_start=key_start,
               blocks={v: BLOCKS[v] for v in (rv, cv)})


CTX_Q = _ctx("q", ("m", "offs_m"), ("dk", "offs_dk"))
CTX_K = _ctx("k", ("dk", "offs_dk"), ("n", "offs_n"))       # K is loaded transposed: [DK, N]
CTX_S = _ctx("s", ("m", "offs_m"), ("n", "offs_n"), key_start="start_n")   # offs_n = start_n + arange
CTX_V = _ctx("v", ("n", "offs_n"), ("dv", "offs_dv"))
CTX_O = _ctx("o", ("m", "offs_m"), ("dv", "offs_dv"))
# the backward's dK/dV kernel works on transposed tiles (S^T = K Q^T: [N, M]) so that P^T and
# dS^T, computed in registers, are the left operands of its dots (no register transposes)
CTX_ST = _ctx("st", ("n", "offs_n"), ("m", "offs_m"), key_start="start_n")
CTX_KN = _ctx("kn", ("n", "offs_n"), ("dk", "offs_dk"))
CTX_QT = _ctx("qt", ("dk", "offs_dk"), ("m", "offs_m"))
TILE = {"q": ("m", "dk", "[BLOCK_M, BLOCK_DK]"), "k": ("dk", "n", "[BLOCK_DK, BLOCK_N]"),
        "s": ("m", "n", "[BLOCK_M, BLOCK_N]"), "v": ("n", "dv", "[BLOCK_N, BLOCK_DV]"),
        "o": ("m", "dv", "[BLOCK_M, BLOCK_DV]"), "st": ("n", "m", "[BLOCK_N, BLOCK_M]"),
        "kn": ("n", "dk", "[BLOCK_N, BLOCK_DK]"), "qt": ("dk", "m", "[BLOCK_DK, BLOCK_M]"),
        "row": ("m", "-", "[BLOCK_M, 1]")}
# a row value over (b..., m): a [BLOCK_M, 1] tile (the row-gradient kernel's sinks; "-": no var)
CTX_ROW = Ctx("row", vars={"m": "offs_m[:, None]"}, masks={"m": "mask_m[:, None]"})


def dk_chunks(dk: int) -> list[tuple[int, int]] | None:
    """Power-of-two pieces (offset, width), each >= 16 (``tl.dot``'s minimum), that cover a head
    dim exactly — 96 = 64 + 32, 80 = 64 + 16, 192 = 128 + 64 — so QK^T runs as chained dots
    without the padding to 128 or 256; None for a power of two or a dim that is not a multiple
    of 16 (one padded tile, as before)."""
    if dk & (dk - 1) == 0 or dk % 16:
        return None
    pieces, off = [], 0
    for bit in reversed(range(4, dk.bit_length())):
        if dk - off >= 1 << bit:
            pieces.append((off, 1 << bit))
            off += 1 << bit
    return pieces if off == dk else None


def dv_pieces(region: Region) -> list[tuple[int, int]] | None:
    """DV as power-of-two pieces (``dk_chunks``) for the forward's P @ V products — 80 = 64 + 16
    computes 80 columns, not 128 — when the epilogue is column-wise: no sum over dv (a norm
    over the head; every other op is per element, and ``verify`` keeps row outputs off the
    products). None: one padded tile."""
    pieces = dk_chunks(region.DV) if region.DV else None
    exprs = [region.out, *(row.expr for row in region.rows)]
    if not pieces or any(x.op == "sum_dv" for e in exprs for x in walk(e)):
        return None
    return pieces


def piece_suffix(ctx: Ctx, base: Ctx) -> str:
    """``_{off}_{width}`` when ``ctx`` is a head-dim piece of ``base`` (``piece_ctx``), else ''."""
    return ctx.name[len(base.name):]


def dv_state(j: int, octx: Ctx) -> str:
    """The register tile of P @ V product ``j`` on output context ``octx``: ``r{j}`` for the whole
    tile, ``r{j}_{off}_{width}`` for a DV piece."""
    return f"r{j}{piece_suffix(octx, CTX_O)}"


def piece_ctx(base: Ctx, dim: str, off: int, width: int) -> Ctx:
    """``base`` with head-dim var ``dim`` (``dk`` or ``dv``) narrowed to the piece ``off +
    arange(width)`` — in bounds by construction, so without that var's mask — and its tile
    shape registered in TILE (one entry per piece, any region)."""
    axis = base.vars[dim][base.vars[dim].index("["):]        # "[None, :]" or "[:, None]"
    name = f"{base.name}_{off}_{width}"
    rows, cols, shape = TILE[base.name]
    TILE.setdefault(name, (rows, cols, shape.replace(f"BLOCK_{dim.upper()}", str(width))))
    return Ctx(name, vars={**base.vars, dim: f"({off} + tl.arange(0, {width})){axis}"},
               masks={v: m for v, m in base.masks.items() if v != dim}, key_start=base.key_start,
               blocks={**base.blocks, dim: (str(off), str(width))}, terms=base.terms)


def block_loops(var: str, block: str, segs: list[tuple[str, str, bool]], body, it: str,
                heads: tuple[int, list[str]] | None = None, order: str | None = None) -> list[str]:
    """Loops setting ``var`` to the start of every block in ``segs`` ((lo, hi, mask-free?) block
    ranges; ``body(full)`` returns one block's lines): a mask-free range gets its own loop, and
    so does a single masked range; two masked ranges — the head and the tail around the full run
    — share one loop over their concatenation (``it`` counts it; an empty or inverted range
    counts 0), so the masked body is compiled once, not twice: a third less code for Triton to
    compile in a masked kernel, the first call's main cost. ``heads`` = (L, lines): each loop
    runs its blocks L times, ``gi`` = 0..L-1 (the dK/dV kernel's group loop: its query heads),
    the lines first in every iteration — one loop, not a loop of loops: Triton kept the nest's
    accumulators in more registers (offline sm_90, D=64: 158 -> 255 and spills). ``order``:
    the blocks in key order ("forward": a prefix scan's pass) or last to first ("reverse": a
    suffix scan's), each range in its own loop, the ranges in that order."""
    if order is not None:
        lines = []
        for lo, hi, full in (reversed(segs) if order == "reverse" else segs):
            first = f"(({hi}) - 1 - {it})" if order == "reverse" else f"(({lo}) + {it})"
            lines += [f"for {it} in range(0, ({hi}) - ({lo})):" + ("  # full blocks: no masks" if full else ""),
                      f"    {var} = {first} * {block}", *("    " + x for x in body(full))]
        return lines
    lines, masked = [], [seg for seg in segs if not seg[2]]
    if len(masked) > 2:
        raise CodegenError("more than two masked block ranges")

    def loop(count: str, first: str, full: bool, n: str) -> None:
        """A loop over ``count`` blocks from ``first(i)``, L times under ``heads``."""
        note = "  # full blocks: no masks" if full else ""
        if heads is None:
            lines.append(f"for {n} in range(0, {count}):{note}")
            lines.append(f"    {var} = ({first}) * {block}")
        else:
            lines.extend([f"{n}_n = {count}", f"for {n}_g in range(0, {heads[0]} * {n}_n):{note}",
                          f"    gi = {n}_g // {n}_n  # the query head", f"    {n} = {n}_g - gi * {n}_n",
                          f"    {var} = ({first}) * {block}", *("    " + x for x in heads[1])])
        lines.extend("    " + x for x in body(full))

    for lo, hi, full in segs:
        if heads is None and (full or len(masked) == 1):
            lines.append(f"for {var} in range(({lo}) * {block}, ({hi}) * {block}, {block}):"
                         + ("  # full blocks: no masks" if full else ""))
            lines += ["    " + x for x in body(full)]
        elif full or len(masked) == 1:
            loop(f"tl.maximum(({hi}) - ({lo}), 0)", f"({lo}) + {it}{'f' if full else ''}", full,
                 f"{it}{'f' if full else ''}")
    if len(masked) == 2:
        (lo, f0, _), (f1, hi, _) = masked
        lines.append(f"{it}_head = tl.maximum(({f0}) - ({lo}), 0)  # masked blocks: [{lo}, {f0}), then [{f1}, {hi})")
        loop(f"{it}_head + tl.maximum(({hi}) - ({f1}), 0)",
             f"({lo}) + {it} + tl.where({it} < {it}_head, 0, ({f1}) - ({lo}) - {it}_head)", False, it)
    return lines


FP32_NORMAL = (2.0 ** -126, 3.4028234663852886e38)


def positive_scale(e: Expr) -> tuple[Expr, float]:
    """``e`` as (x, c) with e == x * c for a constant c > 0, looking through masks that fill
    with -inf (1.0 when there is no such factor). A row max of ``x`` times c equals the row max
    of ``e`` exactly (rounding is monotone), and leaves ``x * c - max`` to the sums: in mask-free
    blocks one fused multiply-add per score instead of a multiply and a subtraction. Only a c
    that is a normal fp32 number (what the kernel multiplies by): a c that rounds to 0 or inf
    would turn a -inf row max into NaN."""
    if e.op == "mul":
        for x, c in (e.args, e.args[::-1]):
            if c.op == "const" and isinstance(c.args[0], float) and FP32_NORMAL[0] <= c.args[0] <= FP32_NORMAL[1]:
                return x, c.args[0]
    if e.op == "where":
        cond, a, b = e.args
        for i, fill in ((1, b), (2, a)):
            if fill.op == "const" and fill.args[0] == float("-inf"):
                x, c = positive_scale(e.args[i])
                if c != 1.0:
                    return call("where", *(x if k == i else arg for k, arg in enumerate(e.args))), c
    return e, 1.0


def segment_bounds(idx: str, live: str, full: str, names: tuple[str, ...]) -> list[str]:
    """Lines that turn a scan's block vector ``idx`` and its live / full flags into the bounds of
    the masked head [lo, f0), mask-free middle [f0, f1) and masked tail [f1, hi): the first run
    of full blocks, clamped to [first live, last live] (the forward's key loop, the backward's
    query loop)."""
    lo, hi, ff, fe, f0, f1 = names
    return [
        f"{lo} = tl.min(tl.where({live}, {idx}, SCAN_BLOCKS), 0)",
        f"{hi} = tl.max(tl.where({live}, {idx}, -1), 0) + 1",
        f"{ff} = tl.min(tl.where({full}, {idx}, SCAN_BLOCKS), 0)",
        f"{fe} = tl.min(tl.where(({full} == 0) & ({idx} > {ff}), {idx}, SCAN_BLOCKS), 0)",
        f"{f0} = tl.minimum(tl.maximum({ff}, {lo}), {hi})",
        f"{f1} = tl.minimum(tl.maximum({fe}, {f0}), {hi})",
    ]


def full_tile(val: str, e: Expr, ctx: Ctx, region: Region) -> str:
    """``val`` broadcast to its context's whole tile when ``e`` is constant along a tile axis
    (a size-1 dim folded to index 0, a row-only value): tl.dot and stores need full tiles.
    Score tiles and P @ V accumulators already are full."""
    rows, cols, shape = TILE[ctx.name]
    full_reds = {j for j, r in enumerate(region.reductions) if r.kind == "dot"} if ctx.name[0] == "o" else set()
    if refs(e, "dot") or refs(e, "red") & full_reds or {rows, cols} <= free_vars(e):
        return val
    return f"tl.broadcast_to({val}, {shape})"


def finite_at_zero(e: Expr) -> bool:
    """Is ``e`` finite wherever its loads read 0 (the padding past M or N that a bounds mask
    loads as 0)? A tl.dot operand that is not (a division by a loaded norm, a log, a reciprocal
    square root) is zeroed there: a non-finite padded row times the zero it meets in the other
    operand is NaN, and the product's every element with it. Conservative: any such op counts."""
    for x in walk(e):
        if x.op == "div" and not (x.args[1].op == "const" and x.args[1].args[0] != 0):
            return False
        if x.op in ("log", "log2", "rsqrt", "reciprocal", "pow", "floordiv", "mod"):
            return False
    return True


def operand_dtype(e: Expr, region: Region, interpret: bool) -> torch.dtype:
    """Tensor-core operand type of a dot operand: that of the tensor it reads (fp32 otherwise).
    Triton 3.6's interpreter computes bf16 dots wrongly, so there bf16 operands go as fp32."""
    for i in sorted(refs(e, "load")):
        dt = region.inputs[i].dtype
        if dt in TL_DTYPE:
            return torch.float32 if interpret and dt == torch.bfloat16 else dt
    return torch.float32


def out_offsets(region: Region, em: Emitter, block: Block, base: str, ctx: Ctx = CTX_O, gluon: bool = False) -> str:
    """Offsets of the output tile of ``ctx`` ([BLOCK_M, BLOCK_DV], or a DV piece's) in a tensor
    of the output's shape with strides ``{base}_s{d}``: the forward's store, the backward's load
    of dO. A permuted or reshaped output (DiffAttn's head merge) takes its index from the epilogue's views, broadcast
    to the whole tile (with one query, M = 1, no index term varies along m); ``gluon``: Gluon has
    no ``broadcast_to`` (a shape needs a layout), so the index broadcasts against the tile's own
    row and column offsets instead."""
    nb = len(region.batch)
    if region.out_index is None:
        return " + ".join([f"b{d} * {base}_s{d}" for d in range(nb)] + [f"offs_m[:, None] * {base}_s{nb}",
                                                                       f"{ctx.vars['dv']} * {base}_s{nb + 1}"])
    terms = [f"{em.emit(i, ctx, block)} * {base}_s{d}" for d, i in enumerate(region.out_index)
             if not (i.op == "const" and i.args[0] == 0)]
    if gluon:
        return f"tl.broadcast({' + '.join(terms) or '0'}, {ctx.vars['m']} + {ctx.vars['dv']})[0]"
    return f"tl.broadcast_to({' + '.join(terms) or '0'}, {TILE[ctx.name][2]})"


class KernelWriter:
    # P @ V in power-of-two pieces of DV (see ``dv_pieces``); the split-KV kernels keep whole
    # [BLOCK_M, BLOCK_DV] states in their workspace
    split_dv = True
    # loop-variant tl.dot operands may load through tensor descriptors (``Emitter.descriptor_load``)
    bulk_loads = True
    recomputed: list[int] = []      # the current pass's scans of earlier passes (``recomputed_scans``)

    def __init__(self, region: Region, name: str, allow_tf32: bool = False, interpret: bool = False,
                 sparse: bool = True):
        self.r, self.name, self.interpret, self.sparse = region, name, interpret, sparse
        self.precision = '"tf32"' if allow_tf32 else '"ieee"'
        self.em = Emitter()
        self.outer = Block()
        self.stats: list[BlockStat] = []
        self.argmax = argmax_columns(region)      # max -> the column of its saved argmax (shift_gradients)
        # (V context, output context) of each DV piece of a P @ V product, or of the whole
        # padded tile; a product's state is r{j} plus the output context's suffix (``dv_state``)
        pieces = dv_pieces(region) if self.split_dv else None
        self.dv_ctxs = [(piece_ctx(CTX_V, "dv", off, w), piece_ctx(CTX_O, "dv", off, w)) for off, w in pieces] \
            if pieces else [(CTX_V, CTX_O)]

    # -- operands of tl.dot -----------------------------------------------------------------
    def dot_operand(self, e: Expr, ctx: Ctx, block: Block, dt: torch.dtype | None = None) -> tuple[str, torch.dtype]:
        """The tile of ``e`` as a tl.dot operand of type ``dt`` (default ``operand_dtype``)."""
        dt = dt or operand_dtype(e, self.r, self.interpret)
        if e.op == "load":   # a bare load keeps its storage type: no round trip through fp32
            raw = self.em.load(e, ctx, block, bulk=self.bulk_loads)
            val = raw if self.r.inputs[e.args[0]].dtype == dt else f"{raw}.to({TL_DTYPE[dt]})"
        else:
            val = self.em.emit(e, ctx, block)
            val = val if dt == torch.float32 else f"{val}.to({TL_DTYPE[dt]})"
        val = full_tile(val, e, ctx, self.r)
        rows, cols, _ = TILE[ctx.name]
        mask = ctx.mask(rows, cols)
        if mask and not finite_at_zero(e):      # padding reads 0: q / q.norm() is 0 / 0 there
            val = f"tl.where({mask}, {val}, 0.0)"
        return val, dt

    def score_dot(self, i: int, q_ctx: Ctx, k_ctx: Ctx, block: Block, transposed: bool = False,
                  acc: str | None = None) -> tuple[str, torch.dtype, str, torch.dtype]:
        """``qk{i} = Q_i K_i^T`` on the two contexts' tiles (``K Q^T`` when ``transposed``: the
        dK/dV kernel's [N, M] tiles), added to ``acc``; returns the operands and their types."""
        d = self.r.dots[i]
        # both operands in one type: a bf16 K against an fp32 Q goes as fp32 (tl.dot takes one type)
        dt = torch.promote_types(*(operand_dtype(e, self.r, self.interpret) for e in (d.q, d.k)))
        q, qdt = self.dot_operand(d.q, q_ctx, block, dt)
        k, kdt = self.dot_operand(d.k, k_ctx, block, dt)
        a, b = (k, q) if transposed else (q, k)
        block.lines.append(f"qk{i} = {self.tl_dot(a, b, qdt, acc=acc)}")
        return q, qdt, k, kdt

    def tl_dot(self, a: str, b: str, dt: torch.dtype, acc: str | None = None) -> str:
        prec = f", input_precision={self.precision}" if dt == torch.float32 else ""
        acc = f", {acc}" if acc else ""
        return f"tl.dot({a}, {b}{acc}{prec})"

    # -- one pass over N ----------------------------------------------------------------------
    def write_pass(self, members: list[int]) -> None:
        r, em, out = self.r, self.em, self.outer
        em.loop_reds = set(members)
        self.recomputed = recomputed_scans(r, members)
        scans = {r.reductions[j].scan for j in members + self.recomputed} - {None}
        if len(scans) > 1:
            raise CodegenError("prefix and suffix scans over the keys in one pass")
        out.lines += [f"c{j} = tl.zeros([BLOCK_M, 1], tl.float32)  # red{j}'s partial sums again: this pass reads them"
                      for j in self.recomputed]
        for j in members:
            kind = r.reductions[j].kind
            init = NEG_INF if kind == "max" else "0.0"
            if kind == "dot":
                out.lines += [f"{dv_state(j, o)} = tl.full({TILE[o.name][2]}, {init}, tl.float32)" for _, o in self.dv_ctxs]
            elif kind == "kth":
                out.lines.append(f"r{j}_c = tl.full([BLOCK_M, {kth_width(r.reductions[j])}], {NEG_INF}, tl.float32)"
                                 f"  # the {r.reductions[j].rank} largest so far")
            else:
                out.lines.append(f"r{j} = tl.full([BLOCK_M, 1], {init}, tl.float32)")
            if j in self.argmax:
                out.lines.append(f"r{j}_at = tl.full([BLOCK_M, 1], -1, tl.int32)  # -1: the extra element, or no key")
        self.seed(members)
        out.lines += self.key_loops(members + self.recomputed, lambda loop, full: self.loop_body(members, loop, full),
                                    order=SCAN_ORDER.get(next(iter(scans), None)))
        for j in members:
            if r.reductions[j].kind == "kth":
                out.lines += kth_value(j, r.reductions[j])
            if r.reductions[j].kind == "max":
                out.lines.append(f"r{j}_s = tl.where(r{j} == {NEG_INF}, 0.0, r{j})")
                em.red_names[j] = f"r{j}_s"
            elif r.reductions[j].kind == "dot" and len(self.dv_ctxs) > 1:
                em.red_names.pop(j, None)       # a state per piece: only the epilogue reads them
            else:
                em.red_names[j] = f"r{j}"

    def key_loops(self, members: list[int], body, order: str | None = None, segments=None) -> list[str]:
        """The loops over key blocks of a pass (``segments``); ``body(loop, full)`` writes one
        block into ``loop``. Returns the lines; the bodies come first so that their hoisted
        invariants precede every guard. (The backward's dQ kernel reuses this with its own body.)
        ``order``: the blocks in key order, "forward" or "reverse" (a scan's pass: ``block_loops``);
        None, any order. ``segments``: ``segments(members)`` already computed (a second walk over
        the same blocks)."""
        loops = []
        segments = segments or self.segments(members)
        for guard, segs in (reversed(segments) if order == "reverse" else segments):
            indent = "    " if guard else ""
            segs = [(self.bounds(lo), self.bounds(hi), full) for lo, hi, full in segs]

            def lines_of(full: bool) -> list[str]:
                loop = Block(parent=self.outer)
                body(loop, full)
                return loop.lines
            loops += ([guard] if guard else []) + [
                indent + line for line in block_loops("start_n", "BLOCK_N", segs, lines_of, self.em.fresh("i"),
                                                      order=order)]
        return loops

    def seed(self, members: list[int]) -> None:
        """Reductions with an ``extra`` element (a sink column) start from it: maxima first,
        then the sums, which read the seeded maxima exactly as the loop's rescale expects."""
        r, em, out = self.r, self.em, self.outer
        seeded = [j for j in members if r.reductions[j].extra is not None]
        if not seeded:
            return
        # a context of its own per pass: red(j) names the seeded max here, the loop's state later
        row = Ctx(em.fresh("row"), vars={"m": "offs_m[:, None]"}, masks={"m": "mask_m[:, None]"})
        for j in sorted(seeded, key=lambda j: r.reductions[j].kind != "max"):
            val = em.emit(r.reductions[j].extra, row, out)
            if r.reductions[j].kind == "max":
                out.lines.append(f"r{j} = tl.maximum(r{j}, {val})")
                out.lines.append(f"r{j}_0 = tl.where(r{j} == {NEG_INF}, 0.0, r{j})")
                em.red_names[j] = f"r{j}_0"
            else:
                out.lines.append(f"r{j} = r{j} + {self.once(val)}")

    def arange(self, n: str, axis: str) -> str:
        """A range in the block scan: over the scanned blocks (``axis`` "rows") or over a
        block's statistics entries ("cols"). A Gluon kernel gives each its layout."""
        return f"tl.arange(0, {n})"

    def bounds(self, blk: str) -> str:
        """A loop bound (in key blocks); the split-KV kernel clamps it to its share of N."""
        return blk

    def once(self, val: str) -> str:
        """A seeded sum's extra element; a split-KV kernel adds it in one split only."""
        return val

    def loop_body(self, members: list[int], loop: Block, full: bool) -> None:
        """One N block. ``full``: the block is inside N and every mask is proven to keep all of
        it, so bodies use the mask-free form (``sparsity.full_body``) and no bounds mask."""
        r, em = self.r, self.em
        reds = [(j, r.reductions[j]) for j in members]
        # the recomputed scans' bodies too: their score tiles may be theirs alone
        bodies = {j: full_body(r.reductions[j].body) if full else r.reductions[j].body for j in members + self.recomputed}
        key_block(loop, full)
        em.dot_names = {}
        chunks = dk_chunks(r.DK)
        for i in sorted(set().union(*(refs(b, "dot") for b in bodies.values()))):
            if chunks:      # a head dim like 96: one dot per power-of-two piece, accumulated
                for c, (off, width) in enumerate(chunks):
                    self.score_dot(i, piece_ctx(CTX_Q, "dk", off, width), piece_ctx(CTX_K, "dk", off, width), loop,
                                   acc=f"qk{i}" if c else None)
            else:
                self.score_dot(i, CTX_Q, CTX_K, loop)
            em.dot_names[i] = f"qk{i}"
        bound = (lambda x, _: x) if full else (lambda x, ident: f"tl.where(mask_n[None, :], {x}, {ident})")
        # a max the region compares is computed from the scores as written, and so are the sums
        # of its pass, which then share those scores (emit.max_terms)
        exact = jump_reads(r.exprs()) & set(members)
        sctx = plain(CTX_S) if exact else CTX_S
        for j in sorted(self.recomputed + [j for j, red in reds if red.scan]):    # scans first: bodies read them
            x = full_tile(bound(em.emit(bodies[j], sctx, loop), "0.0"), bodies[j], sctx, r)
            partial_sums(em, loop, j, r.reductions[j].scan, x, f"r{j}" if j in members else f"c{j}")
            if j not in members:
                loop.lines.append(f"c{j} = c{j} + tl.sum(x{j}, 1, keep_dims=True)")
        for j, red in reds:      # running maxima first: the others rescale by them
            if red.kind != "max":
                continue
            inner, scale = positive_scale(bodies[j])
            inner, rows = max_terms(inner) if not exact else (inner, None)
            body = bound(em.emit(inner, sctx, loop), NEG_INF)
            row_max = f"tl.max({body}, 1, keep_dims=True)"
            if rows is not None:
                row_max = f"({row_max} + {em.emit(rows, sctx, loop)})"
            row_max += f" * {scale!r}" if scale != 1.0 else ""
            if j in self.argmax:      # the first key of the maximum, for the shift's gradient
                loop.lines += [f"r{j}_blk = {row_max}", "if STATS:",
                               f"    r{j}_at = tl.where(r{j}_blk > r{j}, start_n + tl.argmax({body}, 1, keep_dims=True), "
                               f"r{j}_at)"]
                row_max = f"r{j}_blk"
            loop.lines += [
                f"r{j}_new = tl.maximum(r{j}, {row_max})",
                f"r{j}_safe = tl.where(r{j}_new == {NEG_INF}, 0.0, r{j}_new)  # exp(-inf - 0) = 0, not NaN",
                f"alpha{j} = {'tl.exp2' if red.base2 else 'tl.exp'}(r{j} - r{j}_safe)  # rescale of sums taken under the old max",
            ]
            em.red_names[j] = f"r{j}_safe"
        for j, red in reds:
            if red.kind == "max":
                continue
            if red.scan:
                loop.lines.append(f"r{j} = r{j} + tl.sum(x{j}, 1, keep_dims=True)")
                continue
            if red.kind == "kth":
                x = full_tile(bound(em.emit(bodies[j], sctx, loop), NEG_INF), bodies[j], sctx, r)
                loop.lines += kth_merge(j, red, x)
                continue
            contrib = bound(em.emit(bodies[j], sctx, loop), "0.0")
            scaled = f"r{j} * alpha{red.online}" if red.online is not None else f"r{j}"
            if red.kind == "sum":
                loop.lines.append(f"r{j} = {scaled} + tl.sum({contrib}, 1, keep_dims=True)")
            else:                       # P @ V: a product per DV piece (or the whole tile), one P tile
                p = None
                for vctx, octx in self.dv_ctxs:
                    v, vdt = self.dot_operand(red.v, vctx, loop)
                    if p is None:
                        p = em.fresh("p")
                        loop.lines.append(f"{p} = {full_tile(contrib, bodies[j], sctx, r)}.to({TL_DTYPE[vdt]})")
                    acc = dv_state(j, octx)
                    scaled = f"{acc} * alpha{red.online}" if red.online is not None else acc
                    loop.lines.append(f"{acc} = {self.tl_dot(p, v, vdt, acc=scaled)}")
        for j, red in reds:
            if red.kind == "max":
                loop.lines.append(f"r{j} = r{j}_new")

    def segments(self, members: list[int]) -> list[tuple[str, list[tuple[str, str, bool]]]]:
        """The N loops of a pass: (guard, [(lo block, hi block, mask-free?)]) in order; a guard is
        an ``if``/``else`` line choosing between alternatives at run time.

        Without a useful mask: all full blocks, then the ragged tail (compiled out when N fits the
        blocks). With one: a vectorised scan evaluates the pass's dead and full predicates with
        interval arithmetic over every block and keeps [first live, last live], split as masked
        head / mask-free middle / masked tail (``block_loops`` runs head and tail in one loop).
        (Choosing one masked loop at run time when the full run is short was measured slower
        overall on the H200: see docs/notes.md.)"""
        dead = dead_predicate(self.r, members)
        keep = full_predicate([self.r.reductions[j].body for j in members])
        if not (self.sparse and useful(dead)):
            if keep == TRUE:
                return [("", [("0", "N // BLOCK_N", True)]),
                        ("if not EVEN_N:", [("N // BLOCK_N", "tl.cdiv(N, BLOCK_N)", False)])]
            return [("", [("0", "tl.cdiv(N, BLOCK_N)", False)])]
        scan: list[str] = []
        iw = IntervalWriter(self.r, self.stats, scan, self.em.fresh, arange=lambda n: self.arange(n, "cols"))
        live = iw.live(dead)
        may_t, may_f = iw.truth(keep)
        f = self.em.fresh
        lo, hi, ff, fe, f0, f1 = (f(x) for x in ("lo", "hi", "ff", "fe", "f", "f"))
        live_v = "blk_valid" if live == "True" else f"({live}) & blk_valid"
        full_v = f"({may_f} == 0) & blk_live & (n_hi - n_lo == BLOCK_N - 1)" if may_f != "True" else "blk < 0"
        self.outer.lines += [
            f"# block sparsity: skip key blocks where {short_expr(dead)}",
            f"blk = {self.arange('SCAN_BLOCKS', 'rows')}",
            "blk_valid = blk < tl.cdiv(N, BLOCK_N)",
            "n_lo = blk * BLOCK_N",
            "n_hi = tl.minimum(n_lo + BLOCK_N, N) - 1",
            *scan,
            f"blk_live = {live_v}",
            f"blk_full = {full_v}",
            *segment_bounds("blk", "blk_live", "blk_full", (lo, hi, ff, fe, f0, f1)),
        ]
        return [("", [(lo, f0, False), (f0, f1, True), (f1, hi, False)])]

    def store_rowstats(self) -> None:
        """Every reduction's final value, for the generated backward (O(M) per row: no scores)."""
        self.outer.lines += ["# statistics for the backward (see rowstat_columns); STATS is off when no",
                             "# gradient is needed (flashlight::region_infer)", "if STATS:"]
        row = "rowstats_ptr + pid_b * rowstats_sb + offs_m[:, None] * rowstats_sm"
        for j, (red, c) in enumerate(zip(self.r.reductions, rowstat_columns(self.r)[0])):
            if c is None:
                continue        # recomputed from the output (ir.region.from_output)
            if red.kind == "dot":
                self.outer.lines += [f"    tl.store({row} + {c} + {o.vars['dv']}, {dv_state(j, o)}, mask={o.mask('m', 'dv')})"
                                     for _, o in self.dv_ctxs]
            else:
                self.outer.lines.append(f"    tl.store({row} + {c}, {self.em.red_names[j]}, mask=mask_m[:, None])")
        for j, c in self.argmax.items():
            self.outer.lines.append(f"    tl.store({row} + {c}, r{j}_at.to(tl.float32), mask=mask_m[:, None])")

    # -- whole kernel -------------------------------------------------------------------------
    def signature(self) -> list[str]:
        args = []
        for i, x in enumerate(self.r.inputs):
            args.append(f"in{i}_ptr")
            args += [f"in{i}_s{d}" for d in range(len(x.shape))]
        nb = len(self.r.batch)
        args.append("out_ptr")
        args += [f"out_s{d}" for d in range(len(self.r.result_shape))]
        for k in range(len(self.r.rows)):
            args.append(f"row{k}_ptr")
            args += [f"row{k}_s{d}" for d in range(nb + 1)]
        args += ["rowstats_ptr", "rowstats_sb", "rowstats_sm"]
        for k, st in enumerate(self.stats):
            args += [f"aux{k}_min", f"aux{k}_max"]
            args += [f"aux{k}_s{d}" for d in range(len(self.r.inputs[st.input].shape))]
        args += [f"B{d}" for d in range(nb)] + ["M", "N"]
        return args + ["DK: tl.constexpr", "DV: tl.constexpr", "EVEN_M: tl.constexpr", "EVEN_N: tl.constexpr",
                       "SCAN_BLOCKS: tl.constexpr", "STATS: tl.constexpr",
                       "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr",
                       "BLOCK_DK: tl.constexpr", "BLOCK_DV: tl.constexpr", *self.tma_arg()]

    def tma_arg(self) -> list[str]:
        """The TMA constexpr, in kernels with descriptor loads (``Emitter.descriptor_load``)."""
        return ["TMA: tl.constexpr"] if self.em.tma else []

    def epilogue(self) -> None:
        """Store the row statistics (for the backward), the output tile and the extra row outputs
        from the final reduction values."""
        r, out, nb = self.r, self.outer, len(self.r.batch)
        self.store_rowstats()
        self.em.loop_reds = set()
        self.em.red_names = {j: f"r{j}" for j in range(len(r.reductions))}
        for _, ctx in self.dv_ctxs:     # the output expression per DV piece's columns (or on the whole tile)
            self.em.red_names.update({j: dv_state(j, ctx) for j, red in enumerate(r.reductions) if red.kind == "dot"})
            val = full_tile(self.em.emit(r.out, ctx, out), r.out, ctx, r)
            out.lines.append(f"tl.store(out_ptr + {out_offsets(r, self.em, out, 'out', ctx)}, "
                             f"{val}.to(out_ptr.dtype.element_ty), mask={ctx.mask('m', 'dv')})")
        self.em.red_names = {j: f"r{j}" for j in range(len(r.reductions))}
        for k, row in enumerate(r.rows):
            val = f"tl.broadcast_to({self.em.emit(row.expr, CTX_O, out)}, [BLOCK_M, 1])"
            offs = [f"b{d} * row{k}_s{d}" for d in range(nb)] + [f"offs_m[:, None] * row{k}_s{nb}"]
            out.lines.append(f"tl.store(row{k}_ptr + {' + '.join(offs)}, {val}.to(row{k}_ptr.dtype.element_ty), "
                             f"mask=mask_m[:, None])")

    def prologue(self) -> None:
        """Program ids, batch indices, row offsets and bounds masks."""
        nb, out = len(self.r.batch), self.outer
        out.lines += ["pid_m = tl.program_id(0)", *batch_index(nb)]
        out.lines += [
            "offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
            "offs_dk = tl.arange(0, BLOCK_DK)",
            "offs_dv = tl.arange(0, BLOCK_DV)",
            # bounds masks; constant true (and folded away) where the sizes fit the blocks
            "mask_m = tl.full([BLOCK_M], 1, tl.int1) if EVEN_M else offs_m < M",
            "m_lo = pid_m * BLOCK_M",
            "m_hi = tl.minimum(m_lo + BLOCK_M, M) - 1",
            "mask_dk = tl.full([BLOCK_DK], 1, tl.int1) if DK == BLOCK_DK else offs_dk < DK",
            "mask_dv = tl.full([BLOCK_DV], 1, tl.int1) if DV == BLOCK_DV else offs_dv < DV",
        ]

    def passes(self) -> None:
        for p, members in enumerate(self.r.passes()):
            self.outer.lines.append(f"# pass {p}: reductions {members} over N")
            self.write_pass(members)

    def assemble(self) -> str:
        """The ``@triton.jit`` function of the lines written so far."""
        body = "\n".join("    " + line for line in self.outer.lines)
        sig = ",\n".join("    " + a for a in self.signature())
        doc = "\n".join("    # " + line for line in self.r.describe(sizes=False).splitlines())
        return f"@triton.jit\ndef {self.name}(\n{sig},\n):\n{doc}\n{body}\n"

    def write(self) -> str:
        self.prologue()
        self.passes()
        self.epilogue()
        source = self.assemble()
        return prelude(source) + source


def kth_width(red) -> int:
    """The candidates a ``kth`` reduction keeps per row: its rank, rounded up to a power of two
    (``tl.topk`` and ``tl.sort`` work on power-of-two widths)."""
    return 1 << max(red.rank - 1, 0).bit_length()


def kth_inserts(red) -> int:
    """The most values entering a key block's rows that ``kth_merge`` inserts one by one; above
    it the block is merged by ``tl.topk``. An insertion is a row max, a row min and two selects
    (a few ops per element); a bitonic top-k of the block and then of the candidates ~log2(k)^2
    compare-and-swap rounds of several ops each (measured on the H100: docs/notes.md, session 33)."""
    return kth_width(red) // 2


def kth_merge(j: int, red, x: str) -> list[str]:
    """One key block's values ``x`` ([BLOCK_M, BLOCK_N], -inf where masked) into ``r{j}_c``,
    the largest ``kth_width`` values so far, unordered (a multiset: duplicates count, as in
    ``topk``). Only values above the smallest candidate enter. Where at most ``kth_inserts``
    enter any row of the tile (most blocks once a row's candidates have settled), each is
    inserted in place of the smallest candidate in turn: a loop of that many steps, uniform over
    the tile. Otherwise the block's ``tl.topk`` and the candidates' go through one more
    ``tl.topk``; a block narrower than the candidates is widened with -inf first (constexpr
    branches: BLOCK_N is at least 16)."""
    kp = kth_width(red)
    lines = [f"x{j}_k = {x}",
             f"x{j}_lo = tl.min(r{j}_c, 1, keep_dims=True)  # the smallest candidate: only larger values enter",
             f"x{j}_in = tl.max(tl.sum((x{j}_k > x{j}_lo).to(tl.int32), 1))  # the most entering any row",
             f"if x{j}_in <= {kth_inserts(red)}:",
             f"    x{j}_e = tl.where(x{j}_k > x{j}_lo, x{j}_k, {NEG_INF})",
             f"    for _ in range(x{j}_in):",
             f"        x{j}_m, x{j}_at = tl.max(x{j}_e, 1, return_indices=True, keep_dims=True)",
             f"        x{j}_e = tl.where(tl.arange(0, BLOCK_N)[None, :] == x{j}_at, {NEG_INF}, x{j}_e)",
             f"        x{j}_lo, x{j}_lo_at = tl.min(r{j}_c, 1, return_indices=True, keep_dims=True)",
             f"        r{j}_c = tl.where((tl.arange(0, {kp})[None, :] == x{j}_lo_at) & (x{j}_m > x{j}_lo), x{j}_m, r{j}_c)",
             "else:",
             f"    x{j}_w = x{j}_k"]
    w = 1
    while 16 * w * 2 <= max(kp, 16):
        lines += [f"    if BLOCK_N * {2 * w} <= {kp}:",
                  f"        x{j}_w = tl.reshape(tl.join(x{j}_w, tl.full([BLOCK_M, {w} * BLOCK_N], {NEG_INF}, tl.float32)), "
                  f"[BLOCK_M, {2 * w} * BLOCK_N])"]
        w *= 2
    return lines + [f"    r{j}_c = tl.topk(tl.reshape(tl.join(r{j}_c, tl.topk(x{j}_w, {kp}, dim=1)), [BLOCK_M, {2 * kp}]), "
                    f"{kp}, dim=1)"]


def kth_value(j: int, red) -> list[str]:
    """``r{j}``: the rank-th largest of the candidates (their minimum when the rank is their width)."""
    kp = kth_width(red)
    if kp == red.rank:
        return [f"r{j} = tl.min(r{j}_c, 1, keep_dims=True)  # the {red.rank}-th largest"]
    return [f"r{j} = tl.sum(tl.where(tl.arange(0, {kp})[None, :] == {red.rank - 1}, "
            f"tl.sort(r{j}_c, dim=1, descending=True), 0.0), 1, keep_dims=True)  # the {red.rank}-th largest"]


def partial_sums(em: Emitter, loop: Block, j: int, scan: str, x: str, carry: str) -> None:
    """Scan j's partial sums on a key block, this key excluded: ``x{j}`` the block's masked
    body tile, ``carry`` the sum over the blocks already walked; the bodies read ``sc{j}``."""
    loop.lines += [f"x{j} = {x}", f"sc{j} = {carry} + tl.cumsum(x{j}, 1, reverse={scan == 'suffix'}) - x{j}"
                   "  # the partial sums, this key excluded"]
    em.scan_names[j] = f"sc{j}"


def recomputed_scans(region: Region, members: list[int]) -> list[int]:
    """The scans of earlier passes whose partial sums the bodies of ``members`` read (or those
    scans' own bodies): a pass computes them again alongside its reductions (softpick's second
    pass over scores less a scan its max's pass computed)."""
    found: set[int] = set()
    todo = [region.reductions[j].body for j in members]
    while todo:
        for d in refs(todo.pop(), "scan"):
            if d not in members and d not in found:
                found.add(d)
                todo.append(region.reductions[d].body)
    return sorted(found)


def key_block(loop: Block, full: bool) -> None:
    """Offsets and bounds mask of the key block at ``start_n`` (constant true in full blocks)."""
    loop.lines.append("offs_n = start_n + tl.arange(0, BLOCK_N)")
    loop.lines.append("mask_n = tl.full([BLOCK_N], 1, tl.int1)" if full else
                      "mask_n = tl.full([BLOCK_N], 1, tl.int1) if EVEN_N else offs_n < N")


def batch_index(nb: int, group=None) -> list[str]:
    """The batch indices b0.. of this program from grid axis 1 (row-major, b0 slowest). Under a
    group loop (``gradients.Group``: dim d, size L) axis 1 counts B_d // L along d: the program's
    ``grp``, whose L indices of b_d the loop visits (``group_member``)."""
    pid = "pid_g" if group else "pid_b"
    lines, rest = [f"{pid} = tl.program_id(1).to(tl.int64)"], pid
    for d in reversed(range(nb)):
        size, name = (f"(B{d} // {group.size})", "grp") if group and d == group.dim else (f"B{d}", f"b{d}")
        lines.append(f"{name} = {rest} % {size}")
        if d:
            lines.append(f"rest{d} = {rest} // {size}")
            rest = f"rest{d}"
    return lines


def group_member(nb: int, group, i: str) -> list[str]:
    """The batch index b_d of the group loop's member ``i`` (an int: 0 is the group's first) and
    its flat batch index ``pid_b`` (the row statistics' and row gradients' batch row)."""
    flat = "b0"
    for d in range(1, nb):
        flat = f"({flat}) * B{d} + b{d}"
    return [f"b{group.dim} = grp * {group.size} + {i}", f"pid_b = {flat}"]


def short_expr(e: Expr, limit: int = 100) -> str:
    text = str(e)
    return text if len(text) <= limit else text[:limit] + "..."


def generate(region: Region, name: str, allow_tf32: bool = False, interpret: bool = False,
             sparse: bool = True) -> tuple[str, list[BlockStat], dict[int, set[int]]]:
    """Triton source of the forward kernel for ``region``, the per-block statistics its
    sparsity scan reads, and the inputs its tensor descriptors read (input -> the dims they
    stride over; ``runtime.descriptors.ready``); raises CodegenError if unsupported.
    ``interpret``: the kernel will run under Triton's CPU interpreter."""
    if region.DK is None:
        raise CodegenError("region has no score contraction")
    w = KernelWriter(region, name, allow_tf32, interpret, sparse)
    return w.write(), w.stats, w.em.tma
