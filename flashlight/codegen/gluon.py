"""Hopper forward kernels in Gluon (Triton's lower-level dialect), FA3's schedule, for regions of
one online softmax: ``P = softmax(E)``, ``out = f(P @ V)``.

Triton 3.6 cannot overlap a softmax with the matrix products on sm_90 (docs/notes.md, session 9:
each warpgroup waits for its QK^T, then runs the softmax with the tensor cores idle). Gluon has
explicit warpgroups, barriers and async wgmma, so each program here is warp-specialised:

- the default partition (4 warps) issues the TMA copies of the live K and V blocks into a ring of
  ``STAGES`` shared buffers, each with a ready and an empty mbarrier;
- two compute warpgroups own 64 of the program's 128 query rows each and never wait for each
  other, so one's softmax runs while the other's products use the tensor cores;
- inside a warpgroup, block j's QK^T and block j-1's P @ V are in flight together, and block j's
  softmax runs between the two waits.

Everything program-specific comes from the IR as in ``kernel.KernelWriter`` (whose sparsity
scan, expression emitter and statistics layout this reuses): the score program E and the
epilogue f are emitted by ``emit.Emitter`` into Gluon (``gluon_tl`` is the ``tl`` they call),
the block scan's live range and mask-free run bound the key loop, and the row statistics are
those the generated backward reads. ``gluon_support`` says which regions qualify; the runtime
(``runtime.gluon``) checks the inputs' layouts per call and otherwise runs the Triton kernel.
On the H200, hand-written in this form (``benchmarks/gluon_forward.py``), it ran full attention
at D=128 1.28x faster than the Triton kernel and 1.05x cuDNN's (docs/notes.md, session 10).
"""
from __future__ import annotations

import math

import torch

from ..ir import Region, const, free_vars, refs, substitute, walk
from ..ir.region import rowstat_columns
from ..sparsity import dead_predicate, full_body, useful
from .emit import HELPERS as TRITON_HELPERS
from .emit import TRITON, Block, CodegenError, Ctx, helpers_for, jump_reads, max_terms, plain
from .kernel import NEG_INF, KernelWriter, batch_index, operand_dtype, out_offsets, positive_scale

BLOCK_M = 128        # query rows per program: two warpgroups of 64
WG_ROWS = 64
BLOCK_N = 128
STAGES = 2           # K/V ring depth (3 measured no faster at D=128, and needs 229 KB of shared memory)
MAXNREG = 168        # 12 warps x 168 = 64.5 K registers: compute warpgroups get 240, the loader 24
HEAD_DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)      # the operand types of its wgmma

# IR ops whose emitted code uses only names Gluon (with ``gluon_tl``) has
GLUON_OPS = set(TRITON) - {"rand16", "sum_dv"} | {"var", "const", "red", "dot", "load", "tile"}


def q_ctx(w: int) -> Ctx:
    """Warpgroup ``w``'s Q rows, which the kernel loads before the fork (in a partition the
    compiler no longer knows the arguments' alignment, and loads one element at a time)."""
    return Ctx(f"gq{w}", vars={"m": f"gq{w}_m[:, None]", "dk": "gq_k[None, :]"},
               masks={"m": f"gq{w}_mask_m[:, None]", "dk": "gq_mask_k[None, :]"})


# a compute warpgroup's tiles: ``offs_m`` and friends are the score tile's rows and the key
# block's columns; the epilogue rebinds them to the output tile's
GCTX_S = Ctx("s", vars={"m": "offs_m[:, None]", "n": "offs_n[None, :]"},
             masks={"m": "mask_m[:, None]", "n": "mask_n[None, :]"}, key_start="start_n")
# the score tile's rows as a vector (a per-row term of a row max: ``emit.max_terms``)
GCTX_ROW = Ctx("srow", vars={"m": "offs_m"}, masks={"m": "mask_m"}, key_start="start_n")
GCTX_O = Ctx("o", vars={"m": "offs_m[:, None]", "dv": "offs_dv[None, :]"},
             masks={"m": "mask_m[:, None]", "dv": "mask_dv[None, :]"})

HELPERS = TRITON_HELPERS.replace("@triton.jit", "@gluon.jit")      # fl_floordiv, fl_mod


def wgmma_layout(name: str, n: str) -> str:
    """The line declaring ``name`` the layout of a warpgroup's [64, n] wgmma accumulator."""
    return (f"{name}: tl.constexpr = tl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], "
            f"instr_shape=[16, {n}, 16])")


def bulk_operand(e, n: str, d: str) -> bool:
    """Is ``e`` a bare load whose last two indices are the vars ``n`` and ``d`` and whose others
    depend on batch indices only (one TMA copy per block)?"""
    if e.op != "load":
        return False
    idx = e.args[1]
    return (len(idx) >= 2 and idx[-1].op == "var" and idx[-1].args[0] == d and idx[-2].op == "var"
            and idx[-2].args[0] == n and all(not (free_vars(x) - {v for v in free_vars(x) if v.startswith("b")})
                                             for x in idx[:-2]))


def gluon_support(region: Region) -> str:
    """Why ``region`` has no Gluon forward ('' when it has one): one pass of a row max, a sum
    and one P @ V product of the same exponentials (a plain softmax), one QK^T, head dims of 64
    or 128, K and V read as whole [key, head] rows, and only ops Gluon has. The output may be
    stored permuted (a head merge: ``o.transpose(1, 2).reshape(B, M, H * D)``)."""
    r = region
    if r.DK not in HEAD_DIMS or r.DV not in HEAD_DIMS:
        return f"head dims {r.DK}, {r.DV} (Gluon kernels: {HEAD_DIMS})"
    if len(r.dots) != 1 or len(r.passes()) != 1 or r.rows:
        return "not one score tile in one pass without row outputs"
    kinds = [red.kind for red in r.reductions]
    if kinds != ["max", "sum", "dot"]:
        return f"reductions {kinds} (a softmax's max, sum, P @ V)"
    mx, sm, pv = r.reductions
    if not mx.base2 or sm.online != 0 or pv.online != 0 or sm.body != pv.body or any(
            red.extra is not None for red in r.reductions):
        return "not one online softmax feeding its P @ V"
    if not bulk_operand(r.dots[0].k, "n", "dk") or not bulk_operand(pv.v, "n", "dv"):
        return "K or V is not read as whole rows"
    if not {"m", "dk"} <= free_vars(r.dots[0].q):
        return "Q does not vary along its rows and head"
    k_dtype, q_dtype = r.inputs[r.dots[0].k.args[0]].dtype, operand_dtype(r.dots[0].q, r, False)
    if k_dtype not in DTYPES:
        return f"{k_dtype} operands (Gluon kernels take 16-bit ones)"
    if q_dtype != k_dtype:
        return f"Q in {q_dtype} against K in {k_dtype} (the Triton kernel keeps Q's precision)"
    if 2 not in refs(r.out, "red"):
        return "the output is not built from the product"
    shape = r.result_shape      # the runtime's contiguous output, whose strides the epilogue asserts
    if any(math.prod(shape[d + 1:]) % 16 for d in range(len(shape) - 1)):
        return f"an output stride of {tuple(shape)} is not a multiple of 16 elements"
    for e in (mx.body, sm.body, r.out, r.dots[0].q):
        bad = {x.op for x in walk(e)} - GLUON_OPS
        if bad:
            return f"ops without a Gluon lowering: {sorted(bad)}"
    return ""


# Score ops beyond the softmax's own that make it the longer of the two halves the schedule
# overlaps (softcap's tanh: 0.89-0.99x the Triton kernel at D=128, session 10)
SLOW_OPS = {"exp", "log", "log2", "log1p", "expm1", "sqrt", "rsqrt", "tanh", "sigmoid", "erf", "sin", "cos", "pow"}


def gluon_pays(region: Region) -> str:
    """Why the Triton kernel is the faster choice for ``region`` ('' when the Gluon one is), from
    session 10's A/Bs on the H200 (docs/notes.md; ratios are Triton ms / Gluon ms):
    - head dims below 128: the products are too short to hide the softmax behind (0.89x at 64);
    - score tiles loaded inside a partition go one element at a time (its arguments no longer
      carry the alignment Triton specialised on): the document mask ran 0.41-0.70x;
    - more transcendentals than the softmax's exp2 keep the tensor cores waiting either way
      (softcap 0.89-0.99x);
    - short key loops do not fill the pipeline: a mask that leaves the last query only a band
      of recent keys (sliding window: 0.48-0.65x at every length), and masked rows under 4096
      keys (causal, prefix-LM, ALiBi at 1024: 0.65-0.82x; at 4096 and more 0.97-1.27x). Full
      rows pay from 1024 keys (1.05-1.06x; 1.16-1.18x at 4096 and more)."""
    r = region
    if (r.DK, r.DV) != (128, 128):
        return f"head dims {r.DK}, {r.DV}: the Triton kernel is as fast below 128"
    if r.M < BLOCK_M:
        return f"{r.M} queries: fewer than a program's rows (unmeasured: the Triton kernel's blocks fit)"
    bodies = [red.body for red in r.reductions[:2]]
    if any(free_vars(x) & {"m", "n"} for b in bodies for x in walk(b) if x.op == "load"):
        return "score tiles loaded inside a partition"
    slow = {x.op for b in bodies for x in walk(b)} & SLOW_OPS
    if slow:
        return f"score ops {sorted(slow)} make the softmax the longer half"
    dead = dead_predicate(r, r.passes()[0])
    if not useful(dead):
        return "" if r.N >= 1024 else f"{r.N} keys: too few blocks"
    if banded(dead, r):
        return "a band of keys per query: too few blocks"
    return "" if r.N >= 4096 else f"masked rows of {r.N} keys: too few blocks"


def banded(dead, region: Region) -> bool:
    """Is the last query's first key dead (batch indices 0)? Then the live keys of a row are a
    band that does not grow with N: a sliding window, not a causal or prefix mask."""
    point = {"m": region.M - 1, "n": 0, **{v: 0 for v in region.batch_vars}}
    e = substitute(dead, lambda x: const(point[x.args[0]]) if x.op == "var" and x.args[0] in point else None)
    return e.op == "const" and e.args[0] is True


# the block scan's layouts: scanned blocks along rows, a block's statistics entries along columns
SCAN_LAYOUTS = ["SCAN2: tl.constexpr = tl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])",
                "SCAN_ROWS: tl.constexpr = tl.SliceLayout(1, SCAN2)",
                "SCAN_COLS: tl.constexpr = tl.SliceLayout(0, SCAN2)"]


def key_bounds(w: KernelWriter, members: list[int]) -> tuple[str, str, str, str, bool]:
    """The key loop of ``KernelWriter.segments`` as scalar bounds (code added to ``w``'s
    prologue): live key blocks [lo, hi), the mask-free run [f0, f1) inside them, and whether
    every block is mask-free (no mask; the launches take whole key blocks only)."""
    loops = w.segments(members)
    segs = loops[0][1]
    if len(segs) == 3:          # a useful mask: masked head, mask-free middle, masked tail
        (lo, f0, _), (_, f1, _), (_, hi, _) = segs
    elif len(loops) == 1:       # every block masked
        lo, hi = segs[0][:2]
        f0 = f1 = lo
    else:                       # every block mask-free but a ragged last one
        lo, f0, f1, hi = "0", "0", "N // BLOCK_N", "tl.cdiv(N, BLOCK_N)"
    return lo, f0, f1, hi, len(loops) == 2


def scan_arange(n: str, axis: str) -> str:
    """``KernelWriter.arange`` for Gluon: a block scan's range with its layout."""
    return f"tl.arange(0, {n}, layout={'SCAN_ROWS' if axis == 'rows' else 'SCAN_COLS'})"


def check_layouts(lines: list[str]) -> None:
    """Every tensor a Gluon kernel's prologue makes needs a layout (the scan's code is shared
    with the Triton kernels): a CodegenError where one has none."""
    for line in lines:
        if "tl.full(" in line or "tl.zeros(" in line or ("tl.arange(" in line and "layout=" not in line):
            raise CodegenError(f"scan code without a Gluon layout: {line}")


def row_base(em, e, block: Block) -> str:
    """Element offset of a bulk operand's batch indices (``bulk_operand``: its rows start there)."""
    i, idx = e.args
    terms = [f"{em.emit(x, GCTX_S, block)} * in{i}_s{d}" for d, x in enumerate(idx[:-2])
             if not (x.op == "const" and x.args[0] == 0)]
    return " + ".join(terms) or "0"


def descriptor_row(em, e, block: Block) -> str:
    """The int32 row of a bulk operand's first [row, head] tile in its descriptor (TMA
    coordinates are 32-bit: the runtime keeps every descriptor under 2^31 rows)."""
    i, idx = e.args
    return f"(({row_base(em, e, block)}) // in{i}_s{len(idx) - 2}).to(tl.int32)"


class GluonWriter(KernelWriter):
    """The Gluon module of one region (``generate_gluon``): a loader, a compute warpgroup body
    (emitted once, instantiated for warpgroups 0 and 1) and the kernel, which runs the block scan
    and forks the partitions. The kernel's arguments are the Triton forward's
    (``KernelWriter.signature``) plus the K and V tensor descriptors, so the runtime's
    ``kernel_args`` serve both."""
    split_dv = False
    bulk_loads = False

    def __init__(self, region: Region, name: str):
        super().__init__(region, name)
        self.compute = Block()           # the compute warpgroup's prologue (hoisted invariants)
        self.mask_free = False           # no mask: every (whole) key block takes the mask-free bodies

    def arange(self, n: str, axis: str) -> str:
        return scan_arange(n, axis)

    # -- the kernel: batch indices, block scan, buffers, partitions ----------------------------
    def scan(self) -> None:
        """The kernel's first lines: batch indices, the block scan of ``KernelWriter.segments``
        (scalar bounds: live blocks [lo, hi), mask-free run [f0, f1)) and the rows where this
        program's K and V start in their descriptors."""
        r, out = self.r, self.outer
        out.lines += ["pid_m = tl.program_id(0)", *batch_index(len(r.batch)),
                      "m_lo = pid_m * BLOCK_M", "m_hi = tl.minimum(m_lo + BLOCK_M, M) - 1", *SCAN_LAYOUTS]
        lo, f0, f1, hi, self.mask_free = key_bounds(self, [0, 1, 2])
        check_layouts(out.lines)
        k, v = r.dots[0].k, r.reductions[2].v
        out.lines += [f"k_row = {descriptor_row(self.em, k, out)}", f"v_row = {descriptor_row(self.em, v, out)}",
                      f"lo = {lo}", f"hi = tl.maximum({hi}, lo)", f"f0 = {f0}", f"f1 = {f1}",
                      "stats = tl.to_tensor(STATS)"]

    def fork(self) -> None:
        """Shared buffers (Q loaded into them), barriers and the three partitions."""
        em, out = self.em, self.outer
        em.loop_reds = set()
        out.lines += [
            f"q_smem = tl.allocate_shared_memory(k_desc.dtype, [2, {WG_ROWS}, DK], k_desc.layout)  # Q's layout is K's",
            "Q_LAYOUT: tl.constexpr = tl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])",
            "gq_k = tl.arange(0, DK, layout=tl.SliceLayout(0, Q_LAYOUT))",
            "gq_mask_k = gq_k < DK"]
        qe = self.r.dots[0].q
        for w in (0, 1):
            out.lines += [f"gq{w}_m = pid_m * {BLOCK_M} + {w * WG_ROWS} + tl.arange(0, {WG_ROWS}, "
                          "layout=tl.SliceLayout(1, Q_LAYOUT))", f"gq{w}_mask_m = gq{w}_m < M"]
            # a bare load keeps its storage type: no round trip through fp32
            q = em.load(qe, q_ctx(w), out) if qe.op == "load" else em.emit(qe, q_ctx(w), out)
            out.lines.append(f"q_smem.index({w}).store({q}.to(k_desc.dtype))")
        out.lines += [
            "fence_async_shared()  # generic-proxy stores, then wgmma reads (after the fork's barrier)",
            "k_smem = tl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, DK], k_desc.layout)",
            "v_smem = tl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, DV], v_desc.layout)",
            *[f"{b} = tl.allocate_shared_memory(tl.int64, [STAGES, 1], mbarrier.MBarrierLayout())"
              for b in ("k_ready", "k_empty", "v_ready", "v_empty")],
            "for i in tl.static_range(STAGES):",
            "    mbarrier.init(k_ready.index(i), count=1)",
            "    mbarrier.init(v_ready.index(i), count=1)",
            "    mbarrier.init(k_empty.index(i), count=2)  # both compute warpgroups release a buffer",
            "    mbarrier.init(v_empty.index(i), count=2)",
            f"compute_args = ({', '.join(self.compute_params())})",
            "# the loader is the default partition: triton 3.6 verifies a reduction as it is built, and",
            "# the default partition's ops are built before it has a warp count, so reductions must be",
            "# in a worker; it keeps what registers the compute warpgroups leave (MAXNREG per thread)",
            "tl.warp_specialize([",
            f"    ({self.name}_loader, (k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, "
            "k_row, v_row, lo, hi)),",
            f"    ({self.name}_compute0, compute_args),",
            f"    ({self.name}_compute1, compute_args),",
            "], [4, 4], [240, 240])",
        ]

    def compute_params(self) -> list[str]:
        """What a compute warpgroup reads: every pointer, stride and size of the signature, the
        batch indices, the loop bounds, the buffers and barriers. (Constexprs passed through
        ``warp_specialize`` arrive as tensors in triton 3.6: the warpgroup takes its block sizes
        from the buffers' shapes and ``STATS`` as a value.)"""
        sig = [a for a in self.signature() if ":" not in a]
        nb = len(self.r.batch)
        return [*sig, "pid_m", "pid_b", *[f"b{d}" for d in range(nb)], "lo", "hi", "f0", "f1", "stats",
                "q_smem", "k_smem", "v_smem", "k_ready", "k_empty", "v_ready", "v_empty"]

    # -- one compute warpgroup ---------------------------------------------------------------
    def softmax_block(self, full: bool) -> list[str]:
        """One key block's online softmax on ``qk0`` (the block's scores): P (fp32), the new row
        max and sum, and ``alpha``, the accumulator's rescale. Mask-free blocks use the bodies'
        mask-free forms (``sparsity.full_body``), others the masked forms and the bounds mask."""
        r, em = self.r, self.em
        loop = Block(parent=self.compute)
        mx, sm, _ = r.reductions
        em.dot_names = {0: "qk0"}
        em.red_names = {}
        em.loop_reds = {0, 1, 2}
        mbody, sbody = (full_body(mx.body), full_body(sm.body)) if full else (mx.body, sm.body)
        inner, scale = positive_scale(mbody)
        exact = 0 in jump_reads(r.exprs())     # the region compares the max: scores as written
        sctx = plain(GCTX_S) if exact else GCTX_S
        inner, rows = max_terms(inner) if not exact else (inner, None)
        e = em.emit(inner, sctx, loop)
        if not full:
            e = f"tl.where(mask_n[None, :], {e}, {NEG_INF})"
        row_max = f"tl.max({e}, 1)"
        if rows is not None:        # the per-row terms as a vector of the rows' layout
            row_max = f"({row_max} + {em.emit(rows, GCTX_ROW, loop)})"
        row_max += f" * {scale!r}" if scale != 1.0 else ""
        loop.lines += [f"m_new = tl.maximum(m_i, {row_max})",
                       f"m_safe = tl.where(m_new == {NEG_INF}, 0.0, m_new)  # exp(-inf - 0) = 0, not NaN",
                       "alpha = tl.exp2(m_i - m_safe)"]
        em.red_names[0] = "m_safe[:, None]"
        p = em.emit(sbody, sctx, loop)
        if not full:
            p = f"tl.where(mask_n[None, :], {p}, 0.0)"
        loop.lines += [f"p_f32 = {p}", "l_i = l_i * alpha + tl.sum(p_f32, 1)", "m_i = m_new"]
        return loop.lines

    def block_code(self, indent: str, form: str) -> list[str]:
        """The softmax of block ``j`` (its scores in ``s``) in ``form``: "masked", "full" (the
        mask-free bodies), or "either" (mask-free inside [f0, f1))."""
        head = ["start_n = j * BLOCK_N",
                "offs_n = start_n + tl.arange(0, BLOCK_N, layout=tl.SliceLayout(0, S_LAYOUT))",
                "mask_n = offs_n < N", "qk0 = s"]
        if form != "either":
            body = head + self.softmax_block(form == "full")
        else:
            body = head + ["if (j >= f0) & (j < f1):"] + ["    " + x for x in self.softmax_block(True)] + \
                ["else:"] + ["    " + x for x in self.softmax_block(False)]
        return [indent + x for x in body]

    def compute_function(self) -> str:
        r, em = self.r, self.em
        pre = self.compute.lines
        pre += [
            "STAGES: tl.constexpr = k_smem.type.shape[0]",
            "BLOCK_N: tl.constexpr = k_smem.type.shape[1]",
            "DK: tl.constexpr = k_smem.type.shape[2]",
            "DV: tl.constexpr = v_smem.type.shape[2]",
            wgmma_layout("S_LAYOUT", "BLOCK_N"),
            wgmma_layout("O_LAYOUT", "DV"),
            "P_LAYOUT: tl.constexpr = tl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)",
            f"m0 = pid_m * {BLOCK_M} + W * {WG_ROWS}",
            "q = q_smem.index(W)  # stored by the kernel before the fork",
            f"offs_m = m0 + tl.arange(0, {WG_ROWS}, layout=tl.SliceLayout(1, S_LAYOUT))",
            "mask_m = offs_m < M",
            f"zero_s = tl.zeros([{WG_ROWS}, BLOCK_N], tl.float32, S_LAYOUT)",
            f"acc = tl.zeros([{WG_ROWS}, DV], tl.float32, O_LAYOUT)",
            f"m_i = tl.full([{WG_ROWS}], {NEG_INF}, tl.float32, tl.SliceLayout(1, S_LAYOUT))",
            f"l_i = tl.zeros([{WG_ROWS}], tl.float32, tl.SliceLayout(1, S_LAYOUT))",
            "alpha = l_i",
        ]
        # without a mask every block is mask-free (the launch takes whole key blocks only): one
        # softmax body per warpgroup instead of three, a third of the compile
        first = self.block_code("    ", "full" if self.mask_free else "masked")
        steady = self.block_code("        ", "full" if self.mask_free else "either")
        loop = [
            "if hi > lo:",
            "    j = lo",
            "    mbarrier.wait(k_ready.index(0), 0)",
            "    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)",
            "    s = warpgroup_mma_wait(0, deps=(s, ))",
            "    mbarrier.arrive(k_empty.index(0), count=1)",
            *first,
            "    p = tl.convert_layout(p_f32.to(v_smem.dtype), P_LAYOUT)",
            "    for i in range(1, hi - lo):",
            "        j = lo + i",
            "        st = i % STAGES",
            "        prev = (i - 1) % STAGES",
            "        mbarrier.wait(k_ready.index(st), (i // STAGES) & 1)",
            "        s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)",
            "        acc = acc * tl.convert_layout(alpha, tl.SliceLayout(1, O_LAYOUT))[:, None]",
            "        mbarrier.wait(v_ready.index(prev), ((i - 1) // STAGES) & 1)",
            "        acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)",
            "        s = warpgroup_mma_wait(1, deps=(s, ))  # QK^T done, P @ V still in flight",
            "        mbarrier.arrive(k_empty.index(st), count=1)",
            *steady,
            "        acc, p = warpgroup_mma_wait(0, deps=(acc, p))",
            "        mbarrier.arrive(v_empty.index(prev), count=1)",
            "        p = tl.convert_layout(p_f32.to(v_smem.dtype), P_LAYOUT)",
            "    last = (hi - lo - 1) % STAGES",
            "    acc = acc * tl.convert_layout(alpha, tl.SliceLayout(1, O_LAYOUT))[:, None]",
            "    mbarrier.wait(v_ready.index(last), ((hi - lo - 1) // STAGES) & 1)",
            "    acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)",
            "    acc, p = warpgroup_mma_wait(0, deps=(acc, p))",
            "    mbarrier.arrive(v_empty.index(last), count=1)",
        ]
        epi = Block()
        cols = rowstat_columns(r)[0]
        nd = len(r.result_shape)
        # the output is the runtime's own contiguous tensor, which the partition's arguments no
        # longer say: its last stride is 1 and the others multiples of 16 (gluon_support checks)
        epi.lines += [f"out_s{nd - 1} = 1"] + [f"out_s{d} = tl.multiple_of(out_s{d}, 16)" for d in range(nd - 1)]
        epi.lines += [
            "m_safe = tl.where(m_i == float(\"-inf\"), 0.0, m_i)",
            "# statistics for the backward (see rowstat_columns)",
            "if stats:",
            f"    tl.store(rowstats_ptr + pid_b * rowstats_sb + offs_m * rowstats_sm + {cols[0]}, m_safe, mask=mask_m)",
            f"    tl.store(rowstats_ptr + pid_b * rowstats_sb + offs_m * rowstats_sm + {cols[1]}, l_i, mask=mask_m)",
            "ROW_O: tl.constexpr = tl.SliceLayout(1, O_LAYOUT)",
            f"offs_m = m0 + tl.arange(0, {WG_ROWS}, layout=ROW_O)",
            "mask_m = offs_m < M",
            "offs_dv = tl.arange(0, DV, layout=tl.SliceLayout(0, O_LAYOUT))",
            "mask_dv = offs_dv < DV",
            "m_o = tl.convert_layout(m_i, ROW_O)  # the raw max, as the Triton epilogue reads it",
            "l_o = tl.convert_layout(l_i, ROW_O)",
        ]
        if cols[2] is not None:     # an epilogue: the backward reads the product itself
            epi.lines += ["if stats:",
                          f"    tl.store(rowstats_ptr + pid_b * rowstats_sb + offs_m[:, None] * rowstats_sm + {cols[2]} "
                          "+ offs_dv[None, :], acc, mask=mask_m[:, None] & mask_dv[None, :])"]
        em.loop_reds = set()
        em.red_names = {0: "m_o[:, None]", 1: "l_o[:, None]", 2: "acc"}
        val = em.emit(r.out, GCTX_O, epi)
        epi.lines.append(f"tl.store(out_ptr + {out_offsets(r, em, epi, 'out', GCTX_O, gluon=True)}, "
                         f"{val}.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_dv[None, :])")
        params = ", ".join(["W: tl.constexpr", *self.compute_params()])
        body = "\n".join("    " + x for x in pre + loop + epi.lines)
        return f"@gluon.jit\ndef {self.name}_compute({params}):\n{body}\n"

    # -- the module ----------------------------------------------------------------------------
    def write(self) -> str:
        self.scan()             # first: the scan adds the block statistics' arguments
        compute = self.compute_function()
        self.fork()
        sig = [a for a in self.signature() if a not in ("EVEN_M: tl.constexpr", "EVEN_N: tl.constexpr",
                                                        "BLOCK_DK: tl.constexpr", "BLOCK_DV: tl.constexpr")]
        sig += ["k_desc", "v_desc", "STAGES: tl.constexpr"]
        return gluon_module(self, sig, LOADER.format(name=self.name), compute)


def gluon_module(w: KernelWriter, signature: list[str], loader: str, compute: str) -> str:
    """The source of a warp-specialised Gluon module: the loader partition, the compute
    warpgroup body ``compute`` (``{name}_compute``, its first argument the warpgroup), its
    wrappers for warpgroups 0 and 1, and the kernel (``w.outer``'s lines), which forks them."""
    params = ", ".join(w.compute_params())
    wrappers = "".join(f"\n\n@gluon.jit\ndef {w.name}_compute{g}({params}):\n    {w.name}_compute({g}, {params})\n"
                       for g in (0, 1))
    doc = "\n".join("    # " + line for line in w.r.describe(sizes=False).splitlines())
    body = "\n".join("    " + x for x in w.outer.lines)
    kernel = f"@gluon.jit\ndef {w.name}(\n" + ",\n".join("    " + a for a in signature) + f",\n):\n{doc}\n{body}\n"
    own = "\n\n" + loader + "\n\n\n" + compute + wrappers + "\n\n" + kernel
    return GLUON_PRELUDE + HELPERS + helpers_for(own).replace("@triton.jit", "@gluon.jit") + own


GLUON_PRELUDE = '''import triton
from triton.experimental import gluon
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from flashlight.codegen import gluon_tl as tl
'''

LOADER = '''@gluon.jit
def {name}_loader(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, k_row, v_row, lo, hi):
    # the live key blocks [lo, hi) in order, through a ring of STAGES buffers per operand
    STAGES: tl.constexpr = k_smem.type.shape[0]
    BLOCK_N: tl.constexpr = k_smem.type.shape[1]
    for i in range(hi - lo):
        s = i % STAGES
        ph = (i // STAGES) & 1
        n0 = (lo + i) * BLOCK_N
        # an empty barrier starts with its phase 1 complete: the first STAGES waits pass
        mbarrier.wait(k_empty.index(s), ph ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row + n0, 0], k_ready.index(s), k_smem.index(s))
        mbarrier.wait(v_empty.index(s), ph ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [v_row + n0, 0], v_ready.index(s), v_smem.index(s))'''


def generate_gluon(region: Region, name: str) -> tuple[str, list]:
    """Gluon source of the forward kernel ``name`` for ``region`` (``gluon_support`` must be
    empty) and the block statistics its scan reads; raises CodegenError where the emitted code
    would need what Gluon lacks."""
    why = gluon_support(region)
    if why:
        raise CodegenError(why)
    w = GluonWriter(region, name)
    return w.write(), w.stats
