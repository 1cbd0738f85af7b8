"""The generated backward's two tile kernels (``backward.DKDVWriter``, ``backward.DQWriter``) in
Gluon, for Hopper, in the warp-specialised form of the Gluon forward (``codegen/gluon.py``).

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

The dQ kernel is the same machine with the roles swapped (``GluonTiles`` holds what they
share): a program owns 128 queries, copies their Q and dR once and streams the live key blocks'
K and V through the ring (the forward's key scan, ``gluon.key_bounds``); per key block of 64,
S = Q K^T and dP = dR V^T are in flight together, then dQ += dS K takes dS as a register
operand. Not yet run on a GPU (docs/notes.md, session 12).
"""
from __future__ import annotations

from typing import NamedTuple

from ..ir import Expr, Region, dot, refs, substitute, walk
from ..ir.derivative import vjp
from ..ir.expr import var
from ..ir.region import rowstat_columns
from ..ir.scaling import shift_gradients
from ..sparsity import TRUE, full_body, useful
from .backward import DKDVWriter, DQWriter, backward_support, const_factor, dot_grads
from .emit import Block, CodegenError, Ctx
from .gluon import (DTYPES, SCAN_LAYOUTS, bulk_operand, check_layouts, descriptor_row, gluon_module, gluon_support,
                    key_bounds, scan_arange, wgmma_layout)
from .gradients import GradPlan, atomic_add, grad_plan
from .kernel import batch_index, group_member

WG = 64              # a compute warpgroup's own rows (dK/dV: keys; dQ: queries)
RING = 64            # rows of the other operand per step (dK/dV: queries; dQ: keys)
# (BLOCK_M, BLOCK_N) per kernel: a dK/dV program owns 2 x 64 keys and steps over 64 queries, a dQ
# program owns 2 x 64 queries and steps over 64 keys
BLOCKS = {"dkdv": (RING, 2 * WG), "dq": (2 * WG, RING)}
STAGES = 2
MAXNREG = 168        # as the forward: 240 registers per compute thread, 24 for the loader

# a compute warpgroup's score tile: [keys, queries] in the dK/dV kernel, [queries, keys] in dQ's.
# The dK/dV kernel's expressions stay as the region writes them (``terms`` off): there
# ``emit.score_terms`` cut ALiBi's FP32 ops (offline sm_90 SASS at D=128: 900 -> 712), but the
# kernel, at its register limit, went from 43 to 75 spill stores, most in its loop. In dQ's:
# 900 -> 716 and no spills either way.
GCTX_ST = Ctx("gst", vars={"n": "offs_n[:, None]", "m": "offs_m[None, :]"}, masks={}, key_start="start_n",
              terms=False)
GCTX_S = Ctx("gs", vars={"m": "offs_m[:, None]", "n": "offs_n[None, :]"}, masks={}, key_start="start_n")


class Acc(NamedTuple):
    """A compute warpgroup's gradient accumulator: its register tile, the operand expression
    whose gradient it holds, the head dim constexpr, its layout and its kind in the plan."""
    name: str
    operand: Expr
    width: str          # "DK" or "DV"
    layout: str
    kind: str           # "dk", "dv" or "dq" (``grad_plan``)


def tiles_support(region: Region, plan: GradPlan | None = None) -> str:
    """Why ``region`` has no Gluon dK/dV or dQ kernel ('' when it has both): a region with a Gluon
    forward (``gluon_support``: one softmax, K and V read as rows), Q read as rows too, a
    generated backward, no load in the score program taking a gradient (those are scattered per
    tile) and one P @ V product whose row gradient is one [M, DV] tile in K's 16-bit type.
    ``plan``: the Triton kernels' (default: ``grad_plan``'s)."""
    why = gluon_support(region) or backward_support(region)
    if why:
        return why
    if shift_gradients(region):
        return "the shift takes a gradient (at the argmax the Triton forward saves)"
    if not bulk_operand(region.dots[0].q, "m", "dk"):
        return "Q is not read as whole rows"
    plan = plan or grad_plan(region)
    if any(s.body for s in plan.sites):
        return "loads in the score program take gradients (per tile, or summed across the loop)"
    if 2 not in plan.members or plan.dots != [0] or not plan.accs["dk"]:
        return "no gradient reaches the score tile (softmax(floor(s)) @ v)"
    dg = dot_grads(region, interpret=False)
    if dg.width != region.DV or dg.shared or dg.dtype not in DTYPES:
        return "the product's row gradient is not one 16-bit [M, DV] tile"
    return ""


class GluonTiles:
    """What the Gluon dK/dV and dQ writers share (mixed into ``DKDVWriter`` and ``DQWriter``,
    whose IR-side code they reuse): a program owns two warpgroups' rows of one operand pair (the
    "own" tiles, copied once), and a loader streams the other pair's live blocks through a ring
    (``LOADER``), the masked blocks first, then the mask-free run, as the compute warpgroups
    visit them. The arguments are the Triton kernel's (``common_args``) plus four descriptors.

    A subclass names its operands (``ring``, ``own``: buffer names, with their head dims), its
    scan (``scan``: the kernel's first lines, ending with the descriptor rows and the bounds
    ``lo``, ``f0``, ``f1``, ``hi``), the prologue of a compute warpgroup (``compute_prologue``),
    one step of its loop (``step``) and its accumulators (``accs``)."""
    kernel = ""                     # "dkdv" or "dq": the Triton kernel's name in the plan
    ring: tuple[str, str] = ("", "")     # buffers the loader streams (ready/empty barriers each)
    own: tuple[str, str] = ("", "")      # buffers copied once per program
    heads = {"q": "DK", "do": "DV", "k": "DK", "v": "DV"}
    own_rows, ring_rows = "", ""    # the constexprs of the two tiles' rows (BLOCK_M / BLOCK_N)

    def __init__(self, region: Region, name: str, plan: GradPlan):
        super().__init__(region, plan, name)
        self.compute = Block()       # the compute warpgroup's prologue (hoisted invariants)
        self.group = plan.group if self.kernel == "dkdv" else None     # the dK/dV kernel's group loop
        # where a step's invariants go: the prologue, or under a group loop (``GradPlan.group``)
        # the lines of each visited head, a root of their own (its loads read its batch index)
        self.hoist = Block() if self.group else self.compute
        self.mask_free = False       # every live block is mask-free: one body, not two

    def arange(self, n: str, axis: str) -> str:
        return scan_arange(n, axis)

    def bounds(self, lo: str, f0: str, f1: str, hi: str) -> None:
        """The scan's live blocks [lo, hi) and mask-free run [f0, f1) inside them (empty: all
        equal) as the kernel's scalars; a mask-free kernel takes every block as mask-free (the
        launch takes whole blocks only, and the masked loop is not compiled): [f0, f1) = [lo, hi)
        by construction, so the loader's order is the compute loop's whatever the sizes."""
        if self.mask_free:
            f0, f1 = lo, hi
        check_layouts(self.outer.lines)
        self.outer.lines += [f"lo = {lo}", f"hi = tl.maximum({hi}, lo)",
                             f"f0 = tl.minimum(tl.maximum({f0}, lo), hi)", f"f1 = tl.minimum(tl.maximum({f1}, f0), hi)"]

    def fork(self) -> None:
        (a, b), (x, y) = self.ring, self.own
        self.outer.lines += [
            *[f"{n}_smem = tl.allocate_shared_memory({n}_desc.dtype, [STAGES, {self.ring_rows}, {self.heads[n]}], "
              f"{n}_desc.layout)" for n in (a, b)],
            *[f"{n}_smem = tl.allocate_shared_memory({n}_desc.dtype, [{self.own_rows}, {self.heads[n]}], {n}_desc.layout)"
              for n in (x, y)],
            "own_bar = tl.allocate_shared_memory(tl.int64, [1], mbarrier.MBarrierLayout())",
            *[f"{n}_{e} = tl.allocate_shared_memory(tl.int64, [STAGES, 1], mbarrier.MBarrierLayout())"
              for n in (a, b) for e in ("ready", "empty")],
            "mbarrier.init(own_bar, count=1)",
            "for i in tl.static_range(STAGES):",
            f"    mbarrier.init({a}_ready.index(i), count=1)",
            f"    mbarrier.init({b}_ready.index(i), count=1)",
            f"    mbarrier.init({a}_empty.index(i), count=2)  # both compute warpgroups release a buffer",
            f"    mbarrier.init({b}_empty.index(i), count=2)",
            f"compute_args = ({', '.join(self.compute_params())})",
            "tl.warp_specialize([",
            f"    ({self.name}_loader, ({a}_desc, {b}_desc, {x}_desc, {y}_desc, {a}_smem, {b}_smem, {x}_smem, "
            f"{y}_smem, own_bar, {a}_ready, {a}_empty, {b}_ready, {b}_empty, {a}_row, {b}_row, {x}_row, {y}_row, "
            f"lo, f0, f1, hi{f', {a}_step, {b}_step' if self.group else ''})),",
            f"    ({self.name}_compute0, compute_args),",
            f"    ({self.name}_compute1, compute_args),",
            "], [4, 4], [240, 240])",
        ]

    def compute_params(self) -> list[str]:
        """Every pointer, stride and size of the signature, the batch indices, the scan's
        bounds, the buffers and barriers (constexprs reach partitions as tensors in triton 3.6:
        the warpgroup reads its block sizes from the buffers' shapes)."""
        sig = [a for a in self.signature() if ":" not in a and not a.endswith("_desc")]
        (a, b), (x, y) = self.ring, self.own
        pid = "pid_n" if self.kernel == "dkdv" else "pid_m"
        grp = ["grp"] if self.group else []
        return [*sig, pid, "pid_b", *[f"b{d}" for d in range(len(self.r.batch))], *grp, "lo", "f0", "f1", "hi",
                f"{a}_smem", f"{b}_smem", f"{x}_smem", f"{y}_smem", "own_bar",
                f"{a}_ready", f"{a}_empty", f"{b}_ready", f"{b}_empty"]

    def signature(self) -> list[str]:
        return self.common_args(self.kernel) + ["SCAN_BLOCKS: tl.constexpr", "BLOCK_M: tl.constexpr",
                                                "BLOCK_N: tl.constexpr", "q_desc", "do_desc", "k_desc", "v_desc",
                                                "STAGES: tl.constexpr"]

    def row_values(self, block: Block) -> None:
        """The forward's softmax shifts and the sums' row gradients at the rows ``offs_m``, as
        rows ([1, WG]) of the dK/dV kernel's transposed tile or columns ([WG, 1]) of dQ's (the
        product's row gradient is the dR tile)."""
        row = "pid_b * rowstats_sb + offs_m * rowstats_sm"
        vec = "[None, :]" if self.transposed else "[:, None]"
        cols = rowstat_columns(self.r)[0]
        for j, rd in enumerate(self.r.reductions):
            if rd.kind == "max":
                block.lines.append(f"r{j}_s = tl.load(rowstats_ptr + {row} + {cols[j]}){vec}")
                self.em.red_names[j] = f"r{j}_s"
            elif rd.kind == "sum" and j in self.plan.members:
                block.lines.append(f"dr{j} = tl.load(drow_ptr + {row} + {cols[j]}){vec}")

    def prefetch(self, full: bool, loop: Block) -> None:
        """The score program's loads of this step (a document mask's ids, a bias tile), issued
        with the products in flight: emitted where the body would load them, they would wait
        for S first and stall the warpgroup for their latency. (Loads that do not change along
        the loop are hoisted to the prologue as before; the body reuses these names.)"""
        body = self.r.reductions[2].body
        ctx = GCTX_ST if self.transposed else GCTX_S
        for x in walk(full_body(body) if full else body):
            if x.op == "load" and not refs(x, "dot") and not refs(x, "red"):
                self.em.emit(x, ctx, loop)

    def score_and_grad(self, full: bool, loop: Block) -> None:
        """The score program's body ``p`` on ``qk0`` (between the two products' waits), then the
        wait for ``dp`` and the score tile's gradient ``ds`` (the softmax scale folded out: it is
        applied to the accumulator once, after the loop)."""
        r, em = self.r, self.em
        ctx = GCTX_ST if self.transposed else GCTX_S
        body = r.reductions[2].body
        loop.lines.append(f"p = {em.emit(full_body(body) if full else body, ctx, loop)}")
        loop.lines.append("dp = warpgroup_mma_wait(0, deps=(dp, ))")
        for j in self.plan.members:        # d body_j: dR_j (a sum), dR V^T (the product)
            loop.lines.append(f"db{j} = {'dp' if r.reductions[j].kind == 'dot' else f'dr{j}'}")
        ds = vjp(self.seeds(full))[dot(0)]
        operand = r.dots[0].k if self.kernel == "dkdv" else r.dots[0].q
        if operand in self.folded_scales("dk" if self.kernel == "dkdv" else "dq"):
            ds = const_factor(ds)[0]
        loop.lines.append(f"ds = {em.emit(ds, ctx, loop)}")

    def gradient_stores(self) -> list[str]:
        """The accumulators (``accs``: this warpgroup's WG rows of each gradient) at their
        operands' load addresses: a store where the program owns them (``grad_plan``), else an
        fp32 atomic add (GQA's shared heads)."""
        em = self.em
        epi = Block(parent=self.compute)
        accs = self.accs_of()
        # the gradient tensors' rows are contiguous and 16-byte aligned (``runtime.gluon.tiles_usable``
        # checks), which the partition's arguments no longer say: vector stores, not one per element.
        # No bounds masks: whole blocks only
        for i in sorted({a.operand.args[0] for a in accs}):
            nd = len(self.r.inputs[i].shape)
            epi.lines += [f"g{i}_s{nd - 1} = 1", f"g{i}_ptr = tl.multiple_of(g{i}_ptr, 16)"]
            epi.lines += [f"g{i}_s{d} = tl.multiple_of(g{i}_s{d}, 8)" for d in range(nd - 1)]
        axis, start = ("n", "start_n") if self.kernel == "dkdv" else ("m", "start_m")
        for acc, e, width, layout, kind in accs:
            ctx = Ctx(f"g{acc}", vars={axis: f"{acc}_r[:, None]", width.lower(): f"{acc}_d[None, :]"}, masks={})
            epi.lines += [f"{acc}_r = {start} + tl.arange(0, {WG}, layout=tl.SliceLayout(1, {layout}))",
                          f"{acc}_d = tl.arange(0, {width}, layout=tl.SliceLayout(0, {layout}))"]
            scale = self.folded_scales(kind).get(e) if kind != "dv" else None
            val = f"{acc} * {scale!r}" if scale is not None else acc
            ptr, _ = em.address(e, ctx, epi, "g")
            i = e.args[0]
            if i in self.plan.stored:
                epi.lines.append(f"tl.store({ptr}, ({val}).to(g{i}_ptr.dtype.element_ty))")
            else:
                epi.lines.append(atomic_add(ptr, val))
        return epi.lines

    def compute_function(self) -> str:
        pre = self.compute.lines
        # the row statistics are our own contiguous [*batch, M, W] tensors (the launch checks): a
        # known row stride keeps the row values' addresses out of the registers (causal dK/dV at
        # D=128 offline: 360 -> 208 bytes of spills)
        pre.append(f"rowstats_sm = {rowstat_columns(self.r)[1]}")
        self.compute_prologue()
        full = self.step(True)
        masked = [] if self.mask_free else self.step(False)
        blocks = ["# the masked blocks [lo, f0) and [f1, hi) first, then the mask-free run [f0, f1): the loader's order",
                  "n_head = f0 - lo",
                  "n_mask = n_head + hi - f1"]
        if masked:
            blocks += ["for i in range(0, n_mask):",
                       "    j = tl.where(i < n_head, lo + i, f1 + i - n_head)",
                       *["    " + x for x in masked]]
        blocks += ["for i in range(n_mask, hi - lo):",
                   "    j = f0 + i - n_mask",
                   *["    " + x for x in full]]
        loop = ["mbarrier.wait(own_bar, 0)", *self.group_loop(blocks)]
        epi = self.gradient_stores()
        params = ", ".join(["W: tl.constexpr", *self.compute_params()])
        body = "\n".join("    " + x for x in pre + loop + epi)
        return f"@gluon.jit\ndef {self.name}_compute({params}):\n{body}\n"

    def group_loop(self, blocks: list[str]) -> list[str]:
        """The compute loops over the live blocks, under a group loop (``GradPlan.group``) once
        per visited query head: its batch index, its invariants (``hoist``), the ring's slots
        counted on from the heads before it (``base``, as the loader counts them)."""
        group = self.group
        if group is None:
            return blocks
        nb = len(self.r.batch)
        head = [*group_member(nb, group, "gi"), "base = gi * (hi - lo)", *self.hoist.lines]
        return [f"for gi in range({group.size}):  # the query heads sharing this K/V head",
                *("    " + x for x in head + blocks), *group_member(nb, group, "0")]

    def write(self) -> str:
        self.scan()                  # first: the scan adds the block statistics' arguments
        compute = self.compute_function()
        self.fork()
        return gluon_module(self, self.signature(), loader(self.name, self.group), compute)

    # -- per kernel --------------------------------------------------------------------------
    def scan(self) -> None:
        raise NotImplementedError

    def compute_prologue(self) -> None:
        raise NotImplementedError

    def step(self, full: bool) -> list[str]:
        raise NotImplementedError

    def accs_of(self) -> list[Acc]:
        """This kernel's accumulators."""
        raise NotImplementedError


class GluonDKDVWriter(GluonTiles, DKDVWriter):
    """The dK/dV kernel: a program owns 2 x 64 keys (K and V copied once) and steps over the
    live query blocks' Q and dR (``DKDVWriter.query_scan``)."""
    kernel, ring, own, own_rows, ring_rows = "dkdv", ("q", "do"), ("k", "v"), "BLOCK_N", "BLOCK_M"

    def scan(self) -> None:
        r, out = self.r, self.outer
        group = self.group
        first = group_member(len(r.batch), group, "0") if group else []     # the group's first query head
        out.lines += ["pid_n = tl.program_id(0)", *batch_index(len(r.batch), group), *first,
                      "n_lo = pid_n * BLOCK_N",
                      "n_hi = tl.minimum(n_lo + BLOCK_N, N) - 1",
                      "blk = pid_n       # this program's key block, for the sparsity scan",
                      "blk_valid = n_lo < N", *SCAN_LAYOUTS]
        lo, hi, f0, f1 = self.query_scan()
        dead, keep = self.predicates()
        self.mask_free = not (self.sparse and useful(dead)) and keep == TRUE
        q, k, v = r.dots[0].q, r.dots[0].k, r.reductions[2].v
        out.lines += [
            f"q_row = {descriptor_row(self.em, q, out)}",
            "do_row = (pid_b * (ddot_sb // ddot_sm)).to(tl.int32)  # dR: our own [batch * M, DV] rows",
            f"k_row = {descriptor_row(self.em, k, out)} + n_lo.to(tl.int32)",
            f"v_row = {descriptor_row(self.em, v, out)} + n_lo.to(tl.int32)"]
        if group:       # the loader's rows of the next query head: Q's descriptor row, dR's batch row
            b = var(r.batch_vars[group.dim])
            later = "".join(f" * B{d}" for d in range(group.dim + 1, len(r.batch)))
            out.lines += [f"q_step = {descriptor_row(self.em, substitute(q, lambda x: b + 1 if x == b else None), out)}"
                          " - q_row",
                          f"do_step = (1{later} * (ddot_sb // ddot_sm)).to(tl.int32)"]
        self.bounds(lo, f0, f1, hi)

    def compute_prologue(self) -> None:
        self.compute.lines += [
            "STAGES: tl.constexpr = q_smem.type.shape[0]",
            "BLOCK_M: tl.constexpr = q_smem.type.shape[1]",
            "DK: tl.constexpr = q_smem.type.shape[2]",
            "DV: tl.constexpr = do_smem.type.shape[2]",
            wgmma_layout("S_LAYOUT", "BLOCK_M"),
            wgmma_layout("DK_LAYOUT", "DK"),
            wgmma_layout("DV_LAYOUT", "DV"),
            "PT_LAYOUT: tl.constexpr = tl.DotOperandLayout(operand_index=0, parent=DV_LAYOUT, k_width=2)",
            "DST_LAYOUT: tl.constexpr = tl.DotOperandLayout(operand_index=0, parent=DK_LAYOUT, k_width=2)",
            f"start_n = pid_n * {2 * WG} + W * {WG}  # this warpgroup's keys",
            f"offs_n = start_n + tl.arange(0, {WG}, layout=tl.SliceLayout(1, S_LAYOUT))",
            f"k = k_smem.slice(W * {WG}, {WG})",
            f"v = v_smem.slice(W * {WG}, {WG})",
            f"zero_s = tl.zeros([{WG}, BLOCK_M], tl.float32, S_LAYOUT)",
            f"dk0 = tl.zeros([{WG}, DK], tl.float32, DK_LAYOUT)",
            f"dv0 = tl.zeros([{WG}, DV], tl.float32, DV_LAYOUT)",
        ]

    def step(self, full: bool) -> list[str]:
        """One query block ``j`` (ring slot ``i``) of a compute warpgroup: the two products in,
        the body and its reverse, the two products out. ``full``: inside every mask (the
        bodies' mask-free forms). No bounds masks: the launch takes whole blocks only
        (``runtime.gluon.tiles_usable``), and a [64, 64] tile of them costs registers the
        accumulators need."""
        loop = Block(parent=self.hoist)
        self.em.dot_names, self.em.red_names = {0: "qk0"}, {}
        ring = "(base + i)" if self.group else "i"
        loop.lines += [
            f"st = {ring} % STAGES",
            f"ph = ({ring} // STAGES) & 1",
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
        self.prefetch(full, loop)
        loop.lines.append("qk0 = warpgroup_mma_wait(1, deps=(qk0, ))  # S^T done, dP^T in flight")
        self.score_and_grad(full, loop)
        loop.lines += [
            "pb = tl.convert_layout(p.to(do_smem.dtype), PT_LAYOUT)",
            "dsb = tl.convert_layout(ds.to(q_smem.dtype), DST_LAYOUT)",
            "dv0 = warpgroup_mma(pb, do, dv0, is_async=True)  # dV += P^T dR",
            "dk0 = warpgroup_mma(dsb, q, dk0, is_async=True)  # dK += dS^T Q",
            "dv0, dk0, pb, dsb = warpgroup_mma_wait(0, deps=(dv0, dk0, pb, dsb))",
            "mbarrier.arrive(q_empty.index(st), count=1)",
            "mbarrier.arrive(do_empty.index(st), count=1)",
        ]
        return loop.lines

    def accs_of(self):
        r = self.r
        return [Acc("dk0", r.dots[0].k, "DK", "DK_LAYOUT", "dk"), Acc("dv0", r.reductions[2].v, "DV", "DV_LAYOUT", "dv")]


class GluonDQWriter(GluonTiles, DQWriter):
    """The dQ kernel: a program owns 2 x 64 queries (Q and dR copied once; each warpgroup's row
    statistics loaded once) and steps over the live key blocks' K and V (the forward's key scan,
    ``gluon.key_bounds``)."""
    kernel, ring, own, own_rows, ring_rows = "dq", ("k", "v"), ("q", "do"), "BLOCK_M", "BLOCK_N"

    def scan(self) -> None:
        r, out = self.r, self.outer
        # the last query blocks first: under a causal mask they are the longest programs, and a
        # long program starting in the last wave is the kernel's tail (the dK/dV kernel's
        # heaviest blocks, the first keys, already start first)
        out.lines += ["pid_m = tl.num_programs(0) - 1 - tl.program_id(0)", *batch_index(len(r.batch)),
                      "m_lo = pid_m * BLOCK_M", "m_hi = tl.minimum(m_lo + BLOCK_M, M) - 1", *SCAN_LAYOUTS]
        lo, f0, f1, hi, self.mask_free = key_bounds(self, r.passes()[0])
        q, k, v = r.dots[0].q, r.dots[0].k, r.reductions[2].v
        out.lines += [
            f"q_row = {descriptor_row(self.em, q, out)} + m_lo.to(tl.int32)",
            "do_row = (pid_b * (ddot_sb // ddot_sm) + m_lo).to(tl.int32)  # dR: our own [batch * M, DV] rows",
            f"k_row = {descriptor_row(self.em, k, out)}",
            f"v_row = {descriptor_row(self.em, v, out)}"]
        self.bounds(lo, f0, f1, hi)

    def compute_prologue(self) -> None:
        self.compute.lines += [
            "STAGES: tl.constexpr = k_smem.type.shape[0]",
            "BLOCK_N: tl.constexpr = k_smem.type.shape[1]",
            "DK: tl.constexpr = k_smem.type.shape[2]",
            wgmma_layout("S_LAYOUT", "BLOCK_N"),
            wgmma_layout("DQ_LAYOUT", "DK"),
            "DS_LAYOUT: tl.constexpr = tl.DotOperandLayout(operand_index=0, parent=DQ_LAYOUT, k_width=2)",
            f"start_m = pid_m * {2 * WG} + W * {WG}  # this warpgroup's queries",
            f"offs_m = start_m + tl.arange(0, {WG}, layout=tl.SliceLayout(1, S_LAYOUT))",
            f"q = q_smem.slice(W * {WG}, {WG})",
            f"do = do_smem.slice(W * {WG}, {WG})",
            f"zero_s = tl.zeros([{WG}, BLOCK_N], tl.float32, S_LAYOUT)",
            f"dq0 = tl.zeros([{WG}, DK], tl.float32, DQ_LAYOUT)",
            "# this warpgroup's row statistics, once",
        ]
        self.em.red_names = {}
        self.row_values(self.compute)

    def step(self, full: bool) -> list[str]:
        """One key block ``j`` (ring slot ``i``): S = Q K^T and dP = dR V^T in, the body and its
        reverse, dQ += dS K out. V's slot is released once dP is done, K's after dQ's product.
        No bounds masks (whole blocks only, ``runtime.gluon.tiles_usable``)."""
        loop = Block(parent=self.hoist)
        self.em.dot_names = {0: "qk0"}
        loop.lines += [
            "st = i % STAGES",
            "ph = (i // STAGES) & 1",
            "start_n = j * BLOCK_N",
            "mbarrier.wait(k_ready.index(st), ph)",
            "kb = k_smem.index(st)",
            "qk0 = warpgroup_mma(q, kb.permute((1, 0)), zero_s, use_acc=False, is_async=True)  # S = Q K^T",
            "mbarrier.wait(v_ready.index(st), ph)",
            "dp = warpgroup_mma(do, v_smem.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)  # dP = dR V^T",
            "offs_n = start_n + tl.arange(0, BLOCK_N, layout=tl.SliceLayout(0, S_LAYOUT))",
        ]
        self.prefetch(full, loop)
        loop.lines.append("qk0 = warpgroup_mma_wait(1, deps=(qk0, ))  # S done, dP in flight")
        self.score_and_grad(full, loop)
        loop.lines += [
            "mbarrier.arrive(v_empty.index(st), count=1)",
            "dsb = tl.convert_layout(ds.to(k_smem.dtype), DS_LAYOUT)",
            "dq0 = warpgroup_mma(dsb, kb, dq0, is_async=True)  # dQ += dS K",
            "dq0, dsb = warpgroup_mma_wait(0, deps=(dq0, dsb))",
            "mbarrier.arrive(k_empty.index(st), count=1)",
        ]
        return loop.lines

    def accs_of(self):
        return [Acc("dq0", self.r.dots[0].q, "DK", "DQ_LAYOUT", "dq")]


LOADER = '''@gluon.jit
def {name}_loader(a_desc, b_desc, x_desc, y_desc, a_smem, b_smem, x_smem, y_smem, own_bar, a_ready, a_empty,
                  b_ready, b_empty, a_row, b_row, x_row, y_row, lo, f0, f1, hi{steps}):
    # this program's own tiles x and y once (dK/dV: K, V; dQ: Q, dR), then a and b (dK/dV: Q, dR;
    # dQ: K, V) of every live block through a ring of STAGES buffers, in the compute warpgroups'
    # order: masked [lo, f0) and [f1, hi), then [f0, f1){heads}
    STAGES: tl.constexpr = a_smem.type.shape[0]
    BLOCK: tl.constexpr = a_smem.type.shape[1]
    mbarrier.expect(own_bar, x_desc.block_type.nbytes + y_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [x_row, 0], own_bar, x_smem)
    tma.async_copy_global_to_shared(y_desc, [y_row, 0], own_bar, y_smem)
    n_head = f0 - lo
    n_mask = n_head + hi - f1
    {loop}
        j = tl.where(i < n_head, lo + i, tl.where(i < n_mask, f1 + i - n_head, f0 + i - n_mask))
        s = {it} % STAGES
        ph = ({it} // STAGES) & 1
        r0 = j * BLOCK
        # an empty barrier starts with its phase 1 complete: the first STAGES waits pass
        mbarrier.wait(a_empty.index(s), ph ^ 1)
        mbarrier.expect(a_ready.index(s), a_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [{a_row} + r0, 0], a_ready.index(s), a_smem.index(s))
        mbarrier.wait(b_empty.index(s), ph ^ 1)
        mbarrier.expect(b_ready.index(s), b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(b_desc, [{b_row} + r0, 0], b_ready.index(s), b_smem.index(s))'''


def loader(name: str, group=None) -> str:
    """The loader partition; under a group loop (``GradPlan.group``) it streams the live blocks
    of each of the group's query heads in turn, a and b ``a_step`` and ``b_step`` rows further
    on per head, its ring's slots counted on across the heads (as the compute loops count)."""
    if group is None:
        return LOADER.format(name=name, steps="", heads="", loop="for i in range(hi - lo):", it="i",
                             a_row="a_row", b_row="b_row")
    loop = (f"for it in range({group.size} * (hi - lo)):\n"
            "        g = it // (hi - lo)  # the query head\n"
            "        i = it - g * (hi - lo)")
    return LOADER.format(name=name, steps=", a_step, b_step", heads=", for each query head of the group",
                         loop=loop, it="it", a_row="a_row + g * a_step", b_row="b_row + g * b_step")


def generate_gluon_tile(region: Region, name: str, kernel: str, plan: GradPlan | None = None) -> tuple[str, list]:
    """Gluon source of the ``kernel`` ("dkdv" or "dq") tile kernel ``name`` for ``region`` and
    the block statistics its scan reads (the Triton kernel's: the runtime checks); raises
    CodegenError where the region has none (``tiles_support``) or the emitted code would need
    what Gluon lacks. ``plan``: the Triton kernels' (default: ``grad_plan``'s)."""
    plan = plan or grad_plan(region)
    why = tiles_support(region, plan)
    if why:
        raise CodegenError(why)
    w = (GluonDKDVWriter if kernel == "dkdv" else GluonDQWriter)(region, name, plan)
    return w.write(), w.stats
