"""The generated backward's dK/dV kernel (``backward.DKDVWriter``) in Gluon, for Hopper, in the
warp-specialised form of the Gluon forward (``codegen/gluon.py``).

Triton 3.6 runs the dK/dV kernel's four products and its pointwise work one after the other,
and at D=128 the kernel keeps only 32 query rows per step (its dK and dV tiles fill the
registers). Here one program owns 128 keys of one batch index:

- the default partition (4 warps) copies the program's K and V once, then every live query
  block's Q and dR (the row kernel's dO / l tile) through a ring of ``STAGES`` shared buffers,
  with ready and empty mbarriers;
- two compute warpgroups own 64 of the keys each and never wait for each other: per query block
  of 64 rows, S^T = K Q^T and dP^T = V dR^T are in flight together, the score program's body P^T
  is recomputed while dP^T completes, then dV += P^T dR and dK += dS^T Q take P^T and dS^T as
  register operands.

Everything program-specific comes from the IR as in the Triton kernel: the query blocks' scan
(``DKDVWriter.query_scan``: live range and mask-free run), the body and its reverse (``vjp`` of
the bodies into dS, the softmax scale folded out of the loop), the row statistics and row
gradients (the same columns the Triton kernel reads), the gradients' addresses (``grad_plan``:
a store, or an atomic add where programs share K or V). The masked blocks run first, then the
mask-free ones, each in a loop of its own; the loader copies the blocks in that order.
On the H200 a hand-written kernel of this form (``benchmarks/gluon_backward.py``) ran 1.38x
(full) and 1.18x (causal) the Triton dK/dV kernel at D=128 (docs/notes.md, session 11).
"""
from __future__ import annotations

from ..ir import Region, dot
from ..ir.derivative import vjp
from ..ir.region import rowstat_columns
from ..sparsity import TRUE, full_body, useful
from .backward import DKDVWriter, backward_support, const_factor, dot_grads
from .emit import Block, CodegenError, Ctx
from .gluon import (DTYPES, SCAN_LAYOUTS, bulk_operand, check_layouts, descriptor_row, gluon_module, gluon_support,
                    scan_arange)
from .gradients import grad_plan
from .kernel import batch_index

BLOCK_M = 64         # query rows per step: the ring's Q and dR tiles
WG_KEYS = 64         # keys per compute warpgroup
BLOCK_N = 2 * WG_KEYS    # keys per program
STAGES = 2
MAXNREG = 168        # as the forward: 240 registers per compute thread, 24 for the loader

# a compute warpgroup's transposed tile [keys, queries]
GCTX_ST = Ctx("gst", vars={"n": "offs_n[:, None]", "m": "offs_m[None, :]"}, masks={}, key_start="start_n")


def dkdv_support(region: Region) -> str:
    """Why ``region`` has no Gluon dK/dV kernel ('' when it has one): a region with a Gluon
    forward (``gluon_support``: one softmax, K and V read as rows), Q read as rows too, a
    generated backward, no load in the score program taking a gradient (those are scattered per
    tile) and one P @ V product whose row gradient is one [M, DV] tile in K's 16-bit type."""
    why = gluon_support(region) or backward_support(region)
    if why:
        return why
    if not bulk_operand(region.dots[0].q, "m", "dk"):
        return "Q is not read as whole rows"
    plan = grad_plan(region)
    if any(s.kernel == "dkdv" and not s.once for s in plan.sites):
        return "loads in the score program take gradients (scattered per tile)"
    if 2 not in plan.members or plan.dots != [0] or not plan.accs["dk"]:
        return "no gradient reaches the score tile (softmax(floor(s)) @ v)"
    dg = dot_grads(region, interpret=False)
    if dg.width != region.DV or dg.shared or dg.dtype not in DTYPES:
        return "the product's row gradient is not one 16-bit [M, DV] tile"
    return ""


class GluonDKDVWriter(DKDVWriter):
    """The Gluon module of one region's dK/dV kernel (``generate_gluon_dkdv``): a loader, a
    compute warpgroup body (instantiated for warpgroups 0 and 1) and the kernel, which runs
    the query blocks' scan and forks the partitions. Its arguments are the Triton dK/dV
    kernel's (``DKDVWriter.common_args``) plus the Q, dR, K and V tensor descriptors, so the
    runtime's argument list serves both."""

    def __init__(self, region: Region, name: str):
        super().__init__(region, grad_plan(region), name)
        self.compute = Block()       # the compute warpgroup's prologue (hoisted invariants)
        self.mask_free = False       # every live query block is mask-free: one body, not two

    def arange(self, n: str, axis: str) -> str:
        return scan_arange(n, axis)

    # -- the kernel: batch indices, query scan, buffers, partitions ----------------------------
    def scan(self) -> None:
        r, out = self.r, self.outer
        out.lines += ["pid_n = tl.program_id(0)", *batch_index(len(r.batch)),
                      "n_lo = pid_n * BLOCK_N",
                      "n_hi = tl.minimum(n_lo + BLOCK_N, N) - 1",
                      "blk = pid_n       # this program's key block, for the sparsity scan",
                      "blk_valid = n_lo < N", *SCAN_LAYOUTS]
        lo, hi, f0, f1 = self.query_scan()
        # nothing to mask: every block is mask-free (the launch takes whole blocks only,
        # ``runtime.gluon.dkdv_usable``), and the masked loop is not compiled; [f0, f1) = [lo, hi)
        # by construction, so the loader's order is the compute loop's whatever the sizes
        dead, keep = self.predicates()
        self.mask_free = not (self.sparse and useful(dead)) and keep == TRUE
        if self.mask_free:
            f0, f1 = lo, hi
        check_layouts(out.lines)
        q, k, v = r.dots[0].q, r.dots[0].k, r.reductions[2].v
        out.lines += [
            f"q_row = {descriptor_row(self.em, q, out)}",
            "do_row = (pid_b * (ddot_sb // ddot_sm)).to(tl.int32)  # dR: our own [batch * M, DV] rows",
            f"k_row = {descriptor_row(self.em, k, out)} + n_lo.to(tl.int32)",
            f"v_row = {descriptor_row(self.em, v, out)} + n_lo.to(tl.int32)",
            # live query blocks [lo, hi), the mask-free run [f0, f1) inside them (empty: all equal)
            f"lo = {lo}", f"hi = tl.maximum({hi}, lo)",
            f"f0 = tl.minimum(tl.maximum({f0}, lo), hi)", f"f1 = tl.minimum(tl.maximum({f1}, f0), hi)"]

    def fork(self) -> None:
        self.outer.lines += [
            "q_smem = tl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_M, DK], q_desc.layout)",
            "do_smem = tl.allocate_shared_memory(do_desc.dtype, [STAGES, BLOCK_M, DV], do_desc.layout)",
            "k_smem = tl.allocate_shared_memory(k_desc.dtype, [BLOCK_N, DK], k_desc.layout)",
            "v_smem = tl.allocate_shared_memory(v_desc.dtype, [BLOCK_N, DV], v_desc.layout)",
            "kv_bar = tl.allocate_shared_memory(tl.int64, [1], mbarrier.MBarrierLayout())",
            *[f"{b} = tl.allocate_shared_memory(tl.int64, [STAGES, 1], mbarrier.MBarrierLayout())"
              for b in ("q_ready", "q_empty", "do_ready", "do_empty")],
            "mbarrier.init(kv_bar, count=1)",
            "for i in tl.static_range(STAGES):",
            "    mbarrier.init(q_ready.index(i), count=1)",
            "    mbarrier.init(do_ready.index(i), count=1)",
            "    mbarrier.init(q_empty.index(i), count=2)  # both compute warpgroups release a buffer",
            "    mbarrier.init(do_empty.index(i), count=2)",
            f"compute_args = ({', '.join(self.compute_params())})",
            "tl.warp_specialize([",
            f"    ({self.name}_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, "
            "q_ready, q_empty, do_ready, do_empty, q_row, do_row, k_row, v_row, lo, f0, f1, hi)),",
            f"    ({self.name}_compute0, compute_args),",
            f"    ({self.name}_compute1, compute_args),",
            "], [4, 4], [240, 240])",
        ]

    def compute_params(self) -> list[str]:
        """Every pointer, stride and size of the signature, the batch indices, the scan's
        bounds, the buffers and barriers (constexprs reach partitions as tensors in triton 3.6:
        the warpgroup reads its block sizes from the buffers' shapes)."""
        sig = [a for a in self.signature() if ":" not in a and not a.endswith("_desc")]
        return [*sig, "pid_n", "pid_b", *[f"b{d}" for d in range(len(self.r.batch))], "lo", "f0", "f1", "hi",
                "q_smem", "do_smem", "k_smem", "v_smem", "kv_bar", "q_ready", "q_empty", "do_ready", "do_empty"]

    def signature(self) -> list[str]:
        return self.common_args("dkdv") + ["SCAN_BLOCKS: tl.constexpr", "BLOCK_M: tl.constexpr",
                                           "BLOCK_N: tl.constexpr", "q_desc", "do_desc", "k_desc", "v_desc",
                                           "STAGES: tl.constexpr"]

    # -- one compute warpgroup ---------------------------------------------------------------
    def query_step(self, full: bool) -> list[str]:
        """One query block ``j`` (ring slot ``i``) of a compute warpgroup: the two products in,
        the body and its reverse, the two products out. ``full``: inside every mask (the
        bodies' mask-free forms). No bounds masks: the launch takes whole blocks only
        (``runtime.gluon.dkdv_usable``), and a [64, 64] tile of them costs registers the
        accumulators need."""
        r, em = self.r, self.em
        loop = Block(parent=self.compute)
        em.dot_names, em.red_names = {0: "qk0"}, {}
        loop.lines += [
            "st = i % STAGES",
            "ph = (i // STAGES) & 1",
            "start_m = j * BLOCK_M",
            "mbarrier.wait(q_ready.index(st), ph)",
            "q = q_smem.index(st)",
            "qk0 = warpgroup_mma(k, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)  # S^T = K Q^T",
            "mbarrier.wait(do_ready.index(st), ph)",
            "do = do_smem.index(st)",
            "dp = warpgroup_mma(v, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)  # dP^T = V dR^T",
            "offs_m = start_m + tl.arange(0, BLOCK_M, layout=tl.SliceLayout(0, S_LAYOUT))",
        ]
        self.row_values(loop)
        loop.lines.append("qk0 = warpgroup_mma_wait(1, deps=(qk0, ))  # S^T done, dP^T in flight")
        body = r.reductions[2].body
        loop.lines.append(f"p = {em.emit(full_body(body) if full else body, GCTX_ST, loop)}")
        loop.lines.append("dp = warpgroup_mma_wait(0, deps=(dp, ))")
        for j in self.plan.members:        # d body_j: dR_j (a sum), dR V^T (the product)
            loop.lines.append(f"db{j} = {'dp' if r.reductions[j].kind == 'dot' else f'dr{j}'}")
        ds = vjp(self.seeds(full))[dot(0)]
        if r.dots[0].k in self.folded_scales("dk"):
            ds = const_factor(ds)[0]        # the softmax scale: applied to dK once, after the loop
        loop.lines += [
            f"ds = {em.emit(ds, GCTX_ST, loop)}",
            "pb = tl.convert_layout(p.to(do_smem.dtype), PT_LAYOUT)",
            "dsb = tl.convert_layout(ds.to(q_smem.dtype), DST_LAYOUT)",
            "dv0 = warpgroup_mma(pb, do, dv0, is_async=True)  # dV += P^T dR",
            "dk0 = warpgroup_mma(dsb, q, dk0, is_async=True)  # dK += dS^T Q",
            "dv0, dk0, pb, dsb = warpgroup_mma_wait(0, deps=(dv0, dk0, pb, dsb))",
            "mbarrier.arrive(q_empty.index(st), count=1)",
            "mbarrier.arrive(do_empty.index(st), count=1)",
        ]
        return loop.lines

    def row_values(self, block: Block) -> None:
        """The forward's softmax shifts and the sums' row gradients of this query block, as
        [1, BLOCK_M] rows of the transposed tile (the product's row gradient is the dR tile)."""
        row = "pid_b * rowstats_sb + offs_m * rowstats_sm"
        cols = rowstat_columns(self.r)[0]
        for j, rd in enumerate(self.r.reductions):
            if rd.kind == "max":
                block.lines.append(f"r{j}_s = tl.load(rowstats_ptr + {row} + {cols[j]})[None, :]")
                self.em.red_names[j] = f"r{j}_s"
            elif rd.kind == "sum" and j in self.plan.members:
                block.lines.append(f"dr{j} = tl.load(drow_ptr + {row} + {cols[j]})[None, :]")

    def gradient_stores(self) -> list[str]:
        """dK and dV of this warpgroup's 64 keys at the K and V loads' addresses: a store where
        the program owns them (``grad_plan``), else an fp32 atomic add (GQA's shared heads)."""
        r, em = self.r, self.em
        epi = Block(parent=self.compute)
        # the gradient tensors' rows are contiguous and 16-byte aligned (``runtime.gluon.dkdv_usable``
        # checks), which the partition's arguments no longer say: vector stores, not one per element.
        # No bounds masks: whole blocks only
        for i in sorted({r.dots[0].k.args[0], r.reductions[2].v.args[0]}):
            nd = len(r.inputs[i].shape)
            epi.lines += [f"g{i}_s{nd - 1} = 1", f"g{i}_ptr = tl.multiple_of(g{i}_ptr, 16)"]
            epi.lines += [f"g{i}_s{d} = tl.multiple_of(g{i}_s{d}, 8)" for d in range(nd - 1)]
        for acc, e, width, layout in (("dk0", r.dots[0].k, "DK", "DK_LAYOUT"), ("dv0", r.reductions[2].v, "DV", "DV_LAYOUT")):
            ctx = Ctx(f"g{acc}", vars={"n": f"{acc}_n[:, None]", width.lower(): f"{acc}_d[None, :]"}, masks={})
            epi.lines += [f"{acc}_n = start_n + tl.arange(0, {WG_KEYS}, layout=tl.SliceLayout(1, {layout}))",
                          f"{acc}_d = tl.arange(0, {width}, layout=tl.SliceLayout(0, {layout}))"]
            scale = self.folded_scales("dk").get(e) if acc == "dk0" else None
            val = f"{acc} * {scale!r}" if scale is not None else acc
            ptr, _ = em.address(e, ctx, epi, "g")
            i = e.args[0]
            if i in self.plan.stored:
                epi.lines.append(f"tl.store({ptr}, ({val}).to(g{i}_ptr.dtype.element_ty))")
            else:
                epi.lines.append(f"tl.atomic_add({ptr}, {val})")
        return epi.lines

    def compute_function(self) -> str:
        pre = self.compute.lines
        pre += [
            # the row statistics are our own contiguous [*batch, M, W] tensors (the launch checks):
            # a known row stride keeps the row values' addresses out of the registers (causal D=128
            # offline: 360 -> 208 bytes of spills)
            f"rowstats_sm = {rowstat_columns(self.r)[1]}",
            "STAGES: tl.constexpr = q_smem.type.shape[0]",
            "BLOCK_M: tl.constexpr = q_smem.type.shape[1]",
            "DK: tl.constexpr = q_smem.type.shape[2]",
            "DV: tl.constexpr = do_smem.type.shape[2]",
            "S_LAYOUT: tl.constexpr = tl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], "
            "instr_shape=[16, BLOCK_M, 16])",
            "DK_LAYOUT: tl.constexpr = tl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], "
            "instr_shape=[16, DK, 16])",
            "DV_LAYOUT: tl.constexpr = tl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], "
            "instr_shape=[16, DV, 16])",
            "PT_LAYOUT: tl.constexpr = tl.DotOperandLayout(operand_index=0, parent=DV_LAYOUT, k_width=2)",
            "DST_LAYOUT: tl.constexpr = tl.DotOperandLayout(operand_index=0, parent=DK_LAYOUT, k_width=2)",
            f"start_n = pid_n * {BLOCK_N} + W * {WG_KEYS}  # this warpgroup's keys",
            f"offs_n = start_n + tl.arange(0, {WG_KEYS}, layout=tl.SliceLayout(1, S_LAYOUT))",
            f"k = k_smem.slice(W * {WG_KEYS}, {WG_KEYS})",
            f"v = v_smem.slice(W * {WG_KEYS}, {WG_KEYS})",
            f"zero_s = tl.zeros([{WG_KEYS}, BLOCK_M], tl.float32, S_LAYOUT)",
            f"dk0 = tl.zeros([{WG_KEYS}, DK], tl.float32, DK_LAYOUT)",
            f"dv0 = tl.zeros([{WG_KEYS}, DV], tl.float32, DV_LAYOUT)",
        ]
        full = self.query_step(True)
        masked = [] if self.mask_free else self.query_step(False)
        loop = ["mbarrier.wait(kv_bar, 0)",
                "# the masked blocks [lo, f0) and [f1, hi) first, then the mask-free run [f0, f1): the loader's order",
                "n_head = f0 - lo",
                "n_mask = n_head + hi - f1"]
        if masked:
            loop += ["for i in range(0, n_mask):",
                     "    j = tl.where(i < n_head, lo + i, f1 + i - n_head)",
                     *["    " + x for x in masked]]
        loop += ["for i in range(n_mask, hi - lo):",
                 "    j = f0 + i - n_mask",
                 *["    " + x for x in full]]
        epi = self.gradient_stores()
        params = ", ".join(["W: tl.constexpr", *self.compute_params()])
        body = "\n".join("    " + x for x in pre + loop + epi)
        return f"@gluon.jit\ndef {self.name}_compute({params}):\n{body}\n"

    # -- the module ----------------------------------------------------------------------------
    def write(self) -> str:
        self.scan()                  # first: the scan adds the block statistics' arguments
        compute = self.compute_function()
        self.fork()
        return gluon_module(self, self.signature(), LOADER.format(name=self.name), compute)


LOADER = '''@gluon.jit
def {name}_loader(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty,
                  do_ready, do_empty, q_row, do_row, k_row, v_row, lo, f0, f1, hi):
    # this program's K and V once, then Q and dR of every live query block through a ring of
    # STAGES buffers, in the compute warpgroups' order: masked [lo, f0) and [f1, hi), then [f0, f1)
    STAGES: tl.constexpr = q_smem.type.shape[0]
    BLOCK_M: tl.constexpr = q_smem.type.shape[1]
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [k_row, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [v_row, 0], kv_bar, v_smem)
    n_head = f0 - lo
    n_mask = n_head + hi - f1
    for i in range(hi - lo):
        j = tl.where(i < n_head, lo + i, tl.where(i < n_mask, f1 + i - n_head, f0 + i - n_mask))
        s = i % STAGES
        ph = (i // STAGES) & 1
        m0 = j * BLOCK_M
        # an empty barrier starts with its phase 1 complete: the first STAGES waits pass
        mbarrier.wait(q_empty.index(s), ph ^ 1)
        mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + m0, 0], q_ready.index(s), q_smem.index(s))
        mbarrier.wait(do_empty.index(s), ph ^ 1)
        mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [do_row + m0, 0], do_ready.index(s), do_smem.index(s))'''


def generate_gluon_dkdv(region: Region, name: str) -> tuple[str, list]:
    """Gluon source of the dK/dV kernel ``name`` for ``region`` and the block statistics its
    scan reads (the Triton dK/dV kernel's: the runtime checks); raises CodegenError where the
    region has none (``dkdv_support``) or the emitted code would need what Gluon lacks."""
    why = dkdv_support(region)
    if why:
        raise CodegenError(why)
    w = GluonDKDVWriter(region, name)
    return w.write(), w.stats
