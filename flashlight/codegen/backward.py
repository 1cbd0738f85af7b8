"""Backward kernel generation (FA2): the derivative of the region's program, reversed with
``ir.derivative.vjp`` on recomputed tiles, in three generated kernels launched in this order:

1. ``name_rows`` (``row_gradient_kernel``), one program per (M block, batch index): dL/dr_j for
   every reduction r_j from the output expression (FA2's preprocessing ``D = rowsum(dO * O)``).
   Where a later pass reads sums (a threshold on e / l), ``name_sums`` (``SumsWriter``) then
   adds their gradients through those bodies, a walk over the keys per pass.
2. ``name`` (``DKDVWriter``), one program per (N block, batch index) looping over the live query
   blocks: dK and dV in registers, and the gradients of the loads in the reduction bodies
   (biases of any broadcast shape, gathered tables) scattered per tile.
3. ``name_dq`` (``DQWriter``), one program per (M block, batch index) looping over the live key
   blocks with the forward's own sparsity scan: dQ in registers, written once.

Per (M block, N block) tile, for the reductions of the region (r_j = sum_n body_j, or
r_j = sum_n body_j V_j for a P @ V product), given the row gradients dR_j::

    d body_j = dR_j (sum)  or  dR_j @ V_j^T (P @ V)         dV_j += body_j^T @ dR_j
    (d dot_i, d loads) = vjp of the bodies                  dK_i += dS_i^T @ Q_i,  dQ_i += dS_i @ K_i

Both tile kernels recompute the score tiles (FA2's price for having no dQ atomics: N / BLOCK_N
programs would otherwise contend on every dQ row). The Q, K and V operand expressions are reversed
from their accumulators once per program; where those gradients go — a plain store, or an fp32
atomic add where programs share an address (GQA, broadcast, gather) — is ``gradients.grad_plan``.
A max reduction is treated as a constant: ``backward_support`` only accepts regions where it is a
softmax shift the output is invariant to (zero total derivative).

Partial sums over the keys (scans, ``GradPlan.fused_kv``) leave out the dK/dV kernel: the dQ
kernel walks the key blocks in the scan's order twice — totalling each row's adjoint of the
partial sums, then reversing the scan from that total — and adds dK, dV and the per-tile loads'
gradients with fp32 atomics.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import torch

from ..ir import Expr, Region, call, const, dot, free_vars, red, refs, walk
from ..ir.derivative import ZERO, not_differentiable, tile, vjp
from ..ir.expr import BINDS, children
from ..ir.region import every_pass, from_output, rowstat_columns
from ..ir.scaling import output_exprs, shift_gradients, shifted_sums
from ..sparsity import TRUE, BlockStat, IntervalWriter, dead_predicate, full_body, full_predicate, useful
from .emit import KEY_START, Block, CodegenError, Ctx, Emitter, prelude
from .gradients import GradPlan, carry_init, extra_seeds, flush, grad_plan, in_bounds, output_seeds, per_head, scatter
from .kernel import (CTX_K, CTX_KN, CTX_O, CTX_Q, CTX_QT, CTX_ROW, CTX_S, CTX_ST, CTX_V, SCAN_ORDER, TILE, TL_DTYPE,
                     KernelWriter, batch_index, block_loops, dk_chunks, dv_state, full_tile, group_member, key_block,
                     operand_dtype, out_offsets, partial_sums, piece_ctx, piece_suffix, segment_bounds, short_expr)


def backward_support(region: Region) -> str | None:
    """Why the generated backward cannot handle ``region`` (None: it can).

    A max reduction m only shifts the sums it rescales (``online``): they scale as exp(-m), so
    when the output is homogeneous of degree 0 in them the total derivative through m is zero and
    m is a constant in the backward; else (``shift_gradients``) dL/dm reaches the score at the
    argmax the forward saved, which needs a body of scores and loads and a constant extra
    element (the argmax may be it). The sums a max shifts may run in its pass or a later one
    (``ir.scaling.shifted_sums``). A sum body may read maxima the output is invariant to (constants)
    and plain sums of earlier passes (``read_sums``: their row gradients take a walk over the
    keys per pass, ``SumsWriter``), not beside a max taking a gradient or a scan. A sink element (``extra``:
    one more row-level element) shifts with the max too; a sum's gets its row gradient in the
    row kernel, which scatters it into the loads it reads (the sink logits). Partial sums over
    the keys (scans) take one kernel over query blocks (``GradPlan.fused_kv``); their bodies read
    no other reduction or partial sums, and no expression reads a scan's total."""
    scans = {j: r.scan for j, r in enumerate(region.reductions) if r.scan}
    if len(set(scans.values())) > 1:
        return "prefix and suffix scans over the keys in one region"
    for j in scans:
        if refs(region.reductions[j].body, "scan") or refs(region.reductions[j].body, "red"):
            return f"red{j}'s partial sums read other reductions"
    totals = set().union(*(refs(e, "red") for e in region.exprs()))
    if totals & set(scans):
        return f"an expression reads the total of scan red{min(totals & set(scans))}"
    for row in region.rows:
        if any(region.reductions[j].kind == "dot" for j in refs(row.expr, "red")):
            return "a row output reads a P @ V product"
    kths = [j for j, r in enumerate(region.reductions) if r.kind == "kth"]
    if kths:        # a top-k threshold read only through comparisons is a constant of the backward
        seeds = output_exprs(region) + [r.body for r in region.reductions if r.additive]
        reached = vjp({e: tile("g") for e in seeds})
        taking = [j for j in kths if red(j) in reached]
        if taking:
            return f"red{taking[0]}, a top-k value, would take a gradient (read other than through a comparison)"
    shifted = shift_gradients(region)
    shift = {k: j for j, m in enumerate(region.reductions) if m.kind == "max" for k in shifted_sums(region, j)}
    read = read_sums(region)
    for i in read:
        if region.reductions[i].kind != "sum" or region.reductions[i].extra is not None or region.reductions[i].scan:
            return f"red{i}, read by a later pass, is not a plain sum (a product, or one with an extra element)"
    if read and shifted:
        return f"a max taking a gradient (red{shifted[0]}) beside sums a later pass reads"
    if read and scans:
        return "partial sums over the keys beside sums a later pass reads"
    for j, r in enumerate(region.reductions):
        if r.extra is not None:
            inner = {v for v in free_vars(r.extra) if not v.startswith("b")} - {"m"}
            if inner or refs(r.extra, "red") - {shift.get(j)} or refs(r.extra, "dot"):
                return f"red{j}'s extra element is not a row value of its shift"
            op = not_differentiable(r.extra)
            if op:
                return f"no derivative rule for {op}"
        if r.kind == "kth":
            continue
        if r.kind == "max":
            if j not in shifted:
                continue
            if refs(r.body, "red"):
                return f"red{j}, a max taking a gradient, reads other reductions"
            if r.extra is not None and r.extra.op != "const":
                return f"red{j}'s extra element would take the gradient of its shift"
            continue
        other = refs(r.body, "red") - {shift.get(j)} - set(read)
        other -= {i for i in other if region.reductions[i].kind in ("max", "kth") and i not in shifted}    # constants
        if other:
            return f"red{j} reads reductions {sorted(other)} other than its softmax shift"
    exprs = output_exprs(region) + [e for d in region.dots for e in (d.q, d.k)]
    exprs += [e for j, r in enumerate(region.reductions) if r.additive or j in shifted
              for e in (r.body, r.v) if e is not None]
    for e in exprs:
        op = not_differentiable(e)
        if op:
            return f"no derivative rule for {op}"
    return None


def read_sums(region: Region, readers: list[int] | None = None) -> list[int]:
    """The sums a later pass's bodies read (the normaliser l of a sum over where(e / l > t, e,
    0)): their row gradients sum over the keys too (``SumsWriter``). ``readers``: the
    reductions whose bodies count (default: every sum and product)."""
    if readers is None:
        readers = [j for j, r in enumerate(region.reductions) if r.additive]
    return sorted({i for j in readers for i in refs(region.reductions[j].body, "red")
                   if region.reductions[i].additive})


class DotGrads(NamedTuple):
    """Where the row kernel writes dL/dr_j of each P @ V product r_j: DV columns from ``cols[j]``
    of a [*batch, M, width] tensor of type ``dtype`` — the V operands' tensor-core type (FA2 reads
    dO as stored: a bf16 tl.dot operand loaded as is, from rows a multiple of DV apart), fp32 when
    the products' V operands differ in type.

    Products over one V operand whose row gradients are one [M, DV] tile G times a row factor
    each (DiffAttn: dL/dr_1 = G / l_1 and dL/dr_2 = -λ G / l_2) share G's columns: ``shared[j]``
    is (c_j, G), and c_j goes to the row-gradient column of r_j. A tile then computes G V^T once
    for the group (d body_j = c_j G V^T) and adds (sum_j c_j body_j)^T G to dV in one product."""
    cols: dict[int, int]
    width: int
    dtype: torch.dtype
    shared: dict[int, tuple[Expr, Expr]]

    def group(self, j: int) -> list[int]:
        """The products whose gradient shares r_j's columns (``[j]`` when it has its own)."""
        return sorted(k for k in self.cols if self.cols[k] == self.cols[j])


def row_factor(e: Expr, along_dv: Callable[[Expr], bool]) -> tuple[Expr, Expr]:
    """(c, x) with e = c * x, c constant along dv (``along_dv`` false), found through products,
    negation, division by and masks on row values: dL/dr_j of DiffAttn's second map is
    ``div_safe(-(G * λ), l_2)``, so c = div_safe(-λ, l_2) and x = G. The masks' zero branch
    moves into c, so c * x differs from e only where x is not finite (the row kernel zeroes G
    wherever every factor of its group is 0)."""
    if not along_dv(e):
        return e, const(1.0)
    if e.op == "neg":
        c, x = row_factor(e.args[0], along_dv)
        return call("neg", c), x
    if e.op == "mul":
        for a, b in (e.args, e.args[::-1]):
            if not along_dv(a):
                c, x = row_factor(b, along_dv)
                return call("mul", a, c), x
    if e.op in ("div", "div_safe") and not along_dv(e.args[1]):
        c, x = row_factor(e.args[0], along_dv)
        return call(e.op, c, e.args[1]), x
    if e.op == "where" and not along_dv(e.args[0]):
        cond, a, b = e.args
        for live, zero, put in ((a, b, lambda c: call("where", cond, c, ZERO)),
                                (b, a, lambda c: call("where", cond, ZERO, c))):
            if zero.op == "const" and zero.args[0] == 0:
                c, x = row_factor(live, along_dv)
                return put(c), x
    return const(1.0), e


def output_varies_along_dv(region: Region) -> Callable[[Expr], bool]:
    """Does an expression of the output's vjp vary along dv? dO and the products' rows do, and
    loads indexed by dv; a ``sum_dv`` (a norm) does not."""
    memo: dict[Expr, bool] = {}

    def varies(e: Expr) -> bool:
        for x in walk(e):
            if x in memo:
                continue
            if x.op == "var":
                memo[x] = x.args[0] == "dv"
            elif x.op == "tile":
                memo[x] = True
            elif x.op == "red":
                memo[x] = region.reductions[x.args[0]].kind == "dot"
            elif x.op in BINDS:
                memo[x] = False
            else:
                memo[x] = any(memo[c] for c in children(x))
        return memo[e]
    return varies


def dot_grads(region: Region, interpret: bool) -> DotGrads:
    adjoints = vjp({region.out: tile("do")})
    stat_cols, _ = rowstat_columns(region)
    varies = output_varies_along_dv(region)
    split, groups = {}, {}
    for j, rd in enumerate(region.reductions):
        if rd.kind == "dot" and red(j) in adjoints and stat_cols[j] is not None:
            split[j] = row_factor(adjoints[red(j)], varies)
            groups.setdefault((rd.v, split[j][1]), []).append(j)
    # a constant tile (gradients that do not vary along dv) is not worth a column, nor a valid tile
    shared = {j: split[j] for (_, x), js in groups.items() if len(js) > 1 and x.op != "const" for j in js}
    cols, first, types = {}, {}, set()
    for j, rd in enumerate(region.reductions):
        if rd.kind == "dot":
            key = (rd.v, shared[j][1]) if j in shared else j
            cols[j] = first.setdefault(key, len(first) * region.DV)
            types.add(operand_dtype(rd.v, region, interpret))
    return DotGrads(cols, max(len(first) * region.DV, 1), types.pop() if len(types) == 1 else torch.float32,
                    shared)


def row_gradient_kernel(region: Region, plan: GradPlan, name: str, dg: DotGrads) -> str:
    """FA2's preprocessing step, generalised: one program per (M block, batch index) reverses
    the output expression on [BLOCK_M, DV] tiles (``vjp`` of ``out`` with the adjoint dO) into
    dL/dr_j for every reduction — a row value (summed over dv) in the layout of the row
    statistics, a P @ V product's [BLOCK_M, DV] tile into ``dg`` — and scatters the gradients of
    the inputs the epilogue reads (gates, lambda). dO is read through the forward's store index
    (a permuted or head-merged output: ``kernel.out_offsets``).
    For ``out = acc / l`` this is dacc = dO / l and dl = -rowsum(dO * O) / l (FA2's D)."""
    em, block, nb = Emitter(), Block(), len(region.batch)
    cols, _ = rowstat_columns(region)
    block.lines += [
        "pid_m = tl.program_id(0)", *batch_index(nb),
        "offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
        "offs_dv = tl.arange(0, BLOCK_DV)",
        "mask_m = offs_m < M",
        "mask_dv = offs_dv < DV",
        "mask_o = mask_m[:, None] & mask_dv[None, :]",
        "row = pid_b * rowstats_sb + offs_m[:, None] * rowstats_sm",
    ]
    block.lines.append(f"do = tl.load(dout_ptr + {out_offsets(region, em, block, 'dout')}, mask=mask_o, "
                       "other=0.0).to(tl.float32)")
    for k in range(len(region.rows)):       # a row output's gradient, in the tile's first column
        offs = " + ".join([f"b{d} * rowgrad{k}_s{d}" for d in range(nb)] + [f"offs_m * rowgrad{k}_s{nb}"])
        block.lines += [f"go{k} = tl.load(rowgrad{k}_ptr + {offs}, mask=mask_m, other=0.0).to(tl.float32)",
                        f"go{k} = tl.where(offs_dv[None, :] == 0, go{k}[:, None], 0.0)"]
    rebuilt = from_output(region)
    read = set().union(*(refs(e, "red") for e in output_exprs(region)))
    for j in sorted(read, key=lambda j: j in rebuilt):     # a rebuilt product's sum first
        reduction = region.reductions[j]
        if j in rebuilt:        # red_j = out * red_k: the stored output (FA2 reads O for its D)
            block.lines.append(f"r{j} = tl.load(out_ptr + {out_offsets(region, em, block, 'out')}, mask=mask_o, "
                               f"other=0.0).to(tl.float32) * r{rebuilt[j]}")
        else:
            dv = " + offs_dv[None, :]" if reduction.kind == "dot" else ""
            mask = "mask_o" if reduction.kind == "dot" else "mask_m[:, None]"
            block.lines.append(f"r{j} = tl.load(rowstats_ptr + row + {cols[j]}{dv}, mask={mask}, other=0.0)")
        em.red_names[j] = f"r{j}"
    for k in sorted(set().union(*(refs(r.extra, "red") for r in region.reductions if r.extra is not None))
                    - set(em.red_names)):     # the shifts a sink element reads
        block.lines.append(f"r{k} = tl.load(rowstats_ptr + row + {cols[k]}, mask=mask_m[:, None], other=0.0)")
        em.red_names[k] = f"r{k}"
    adjoints = vjp(output_seeds(region))
    for j, reduction in enumerate(region.reductions):
        if red(j) not in adjoints and j in plan.members and reduction.kind == "sum":
            block.lines.append(f"tl.store(drow_ptr + row + {cols[j]}, tl.zeros([BLOCK_M, 1], tl.float32), "
                               "mask=mask_m[:, None])  # read by a later pass alone: ``SumsWriter`` adds it")
        if red(j) not in adjoints or reduction.kind == "max":
            continue        # a reduction the output does not read, or a max (``shift_gradients``: below)
        if j in dg.shared:  # c_j into r_j's row-gradient column; the group's G once, 0 where every c is
            c = em.emit(dg.shared[j][0], CTX_O, block)
            block.lines.append(f"tl.store(drow_ptr + row + {cols[j]}, tl.zeros([BLOCK_M, 1], tl.float32) + {c}, "
                               "mask=mask_m[:, None])")
            group = dg.group(j)
            if j != group[0]:
                continue
            live = " | ".join(f"({em.emit(dg.shared[k][0], CTX_O, block)} != 0)" for k in group)
            g = f"tl.where(mask_o & ({live}), tl.broadcast_to({em.emit(dg.shared[j][1], CTX_O, block)}, " \
                "[BLOCK_M, BLOCK_DV]), 0.0)"
        else:
            g = f"tl.where(mask_o, tl.broadcast_to({em.emit(adjoints[red(j)], CTX_O, block)}, " \
                "[BLOCK_M, BLOCK_DV]), 0.0)"
        if reduction.kind == "dot":
            block.lines.append(f"tl.store(ddot_ptr + pid_b * ddot_sb + offs_m[:, None] * ddot_sm + {dg.cols[j]} + "
                               f"offs_dv[None, :], {g}.to(ddot_ptr.dtype.element_ty), mask=mask_o)")
        else:       # named: a sink element's gradient reads it (``extra_seeds``)
            block.lines += [f"dr{j} = tl.sum({g}, 1, keep_dims=True)",
                            f"tl.store(drow_ptr + row + {cols[j]}, dr{j}, mask=mask_m[:, None])"]
    for j in shift_gradients(region):    # dL/dm = dL/dm|direct - c sum_k <dL/dr_k, r_k>, r_k ~ exp(-c m)
        c = const(math.log(2.0) if region.reductions[j].base2 else 1.0)
        total = adjoints.get(red(j), ZERO)
        for k in shifted_sums(region, j):
            if red(k) in adjoints:
                total = call("sub", total, call("mul", call("mul", adjoints[red(k)], red(k)), c))
        g = f"tl.where(mask_o, tl.broadcast_to({em.emit(total, CTX_O, block)}, [BLOCK_M, BLOCK_DV]), 0.0)"
        block.lines += [f"dr{j} = tl.sum({g}, 1, keep_dims=True)  # the shift's gradient, for its argmax key",
                        f"tl.store(drow_ptr + row + {cols[j]}, dr{j}, mask=mask_m[:, None])"]
    scatter(em, adjoints, CTX_O, block, plan.stored, "mask_o")
    scatter(em, vjp(extra_seeds(region, plan.members)), CTX_ROW, block, plan.stored, "mask_m[:, None]")
    args = tensor_args(region, "in", range(len(region.inputs))) + tensor_args(region, "g", plan.written("rows"))
    args += ["out_ptr", *[f"out_s{d}" for d in range(len(region.result_shape))]]
    args += ["dout_ptr", *[f"dout_s{d}" for d in range(len(region.result_shape))]]
    for k in range(len(region.rows)):
        args += [f"rowgrad{k}_ptr", *[f"rowgrad{k}_s{d}" for d in range(nb + 1)]]
    args += ["rowstats_ptr", "drow_ptr", "rowstats_sb", "rowstats_sm", "ddot_ptr", "ddot_sb", "ddot_sm"]
    args += [f"B{d}" for d in range(nb)] + ["M", "DV: tl.constexpr", "BLOCK_M: tl.constexpr", "BLOCK_DV: tl.constexpr"]
    sig = ",\n".join("    " + a for a in args)
    body = "\n".join("    " + line for line in block.lines)
    return f"\n\n@triton.jit\ndef {name}(\n{sig},\n):\n{body}\n"




def tensor_args(region: Region, base: str, inputs) -> list[str]:
    """Pointer and stride arguments of the inputs (``in``) or their gradients (``g``)."""
    return [a for i in inputs for a in [f"{base}{i}_ptr"] + [f"{base}{i}_s{d}" for d in range(len(region.inputs[i].shape))]]


class LoopEmitter(Emitter):
    """Hoists what does not vary along the loop's axis (``m``: the dK/dV kernel's query loop;
    ``n``: the dQ kernel's key loop) out of it. Score tiles and seeds (``tile``) always vary; the
    softmax shifts (``red``) do in the query loop, which loads them per query block."""

    def __init__(self, axis: str):
        super().__init__()
        self.axis = axis
        self.group: tuple[str, int] | None = None   # (batch var, L): the dK/dV kernel's group loop

    def variant(self, e: Expr) -> bool:
        fv = free_vars(e)
        return (self.axis in fv or (self.axis == "n" and KEY_START in fv) or bool(refs(e, "dot") or refs(e, "tile"))
                or (self.axis == "m" and bool(refs(e, "red"))) or (self.group is not None and per_head(e, *self.group)))


def const_factor(e: Expr) -> tuple[Expr, float]:
    """(x, c) with e = x * c for a finite constant c, found through products and masks with a
    zero branch: the softmax scale and base 2's ln 2 of a dS (c = 1.0: none)."""
    if e.op == "mul":
        for x, k in (e.args, e.args[::-1]):
            if k.op == "const" and k.kind == "f" and math.isfinite(k.args[0]):
                inner, c = const_factor(x)
                return inner, c * k.args[0]
    if e.op == "where":
        cond, a, b = e.args
        for live, zero, put in ((a, b, lambda x: call("where", cond, x, zero)),
                                (b, a, lambda x: call("where", cond, zero, x))):
            if zero.op == "const" and zero.args[0] == 0:
                inner, c = const_factor(live)
                if c != 1.0:
                    return put(inner), c
    return e, 1.0


class TileWriter(KernelWriter):
    """What the two tile kernels share: on one (M block, N block) tile, recompute the score tiles
    and reduction bodies from the saved row statistics and reverse the bodies (``vjp``).

    A head dim like 80 or 96 runs in power-of-two pieces (``dk_chunks``: 80 = 64 + 16), as the
    forward's does: QK^T as chained dots over DK pieces, dR V^T over DV pieces, and one dQ / dK /
    dV register tile per piece, each written through its piece's context — unless a load in an
    operand expression does not vary along that head dim (a per-row gate on q): its gradient sums
    over the whole head, so those accumulators keep one padded tile (``pieces``)."""
    split_dv = False    # the forward's epilogue pieces: not this kernel's
    axis = ""           # the loop's axis
    kernel = ""         # "dkdv" or "dq"
    kinds: tuple[str, ...] = ()     # the accumulators: "dq", "dk", "dv"
    transposed = False  # score tiles as [N, M] (the dK/dV kernel): row values are [1, BLOCK_M]

    @property
    def ctx_s(self) -> Ctx:
        return CTX_ST if self.transposed else CTX_S

    def __init__(self, region: Region, plan: GradPlan, name: str, allow_tf32: bool = False,
                 interpret: bool = False, sparse: bool = True):
        super().__init__(region, name, allow_tf32, interpret, sparse)
        self.plan = plan
        self.dg = dot_grads(region, interpret)
        self.em = LoopEmitter(self.axis)
        # "dq"/"dk"/"dv" -> operand expression -> register tile per piece (``pieces``)
        self.accs: dict[str, dict[Expr, list[str]]] = {}
        self.folded: dict[str, dict[Expr, float]] = {}  # "dq"/"dk" -> operand expression -> scale (folded_scales)
        self.piece_cache: dict[str, list | None] = {}
        # the body loads whose gradient this kernel sums across its loop (``GradPlan.carried``)
        self.carried = {x: f"gc{c}" for c, x in enumerate(x for x, k in plan.carried.items() if k == self.kernel)}
        self.tile_inits: list[str] = []     # zeroed per tile: the accumulators ``per_tile`` writes
        self.active: list[int] | None = None    # the members this tile reverses (None: all, ``members``)

    @property
    def members(self) -> list[int]:
        """The reductions whose bodies this kernel reverses: the plan's members, or those of one
        pass (``SumsWriter``'s walks)."""
        return self.plan.members if self.active is None else self.active

    def carry(self, loop: Block, adjoints: dict[Expr, Expr], sums: dict | None = None) -> None:
        """This tile's part of each carried gradient, into its register (``sums``: the tile's
        reductions so far, ``gradients.factored_sum``)."""
        mine = {x: adjoints[x] for x in self.carried if x in adjoints}
        scatter(self.em, mine, self.ctx_s, loop, self.plan.stored, "mask_mn", carried=self.carried, sums=sums)

    def pieces(self, kind: str) -> list[tuple[int, int]] | None:
        """The head-dim pieces of accumulator ``kind`` (dq / dk: DK; dv: DV), or None for one
        padded tile: a power-of-two head dim, or an operand reading a load that does not vary
        along that dim (its gradient, a sum over the whole head, would be split across pieces —
        harmless for an atomic add, wrong for a plain store; any such load keeps one tile)."""
        if kind not in self.piece_cache:
            dim = "dv" if kind == "dv" else "dk"
            pieces = dk_chunks(self.r.DV if kind == "dv" else self.r.DK)
            operands = [rd.v for rd in self.r.reductions if rd.kind == "dot"] if kind == "dv" else \
                [x for d in self.r.dots for x in (d.q, d.k)]
            if any(x.op == "load" and not any(dim in free_vars(i) for i in x.args[1])
                   for e in operands for x in walk(e)):
                pieces = None
            self.piece_cache[kind] = pieces
        return self.piece_cache[kind]

    def piece_ctxs(self, kind: str, base: Ctx) -> list[Ctx]:
        """``base`` per piece of ``kind`` (or ``[base]``)."""
        pieces = self.pieces(kind)
        return [piece_ctx(base, "dv" if kind == "dv" else "dk", off, w) for off, w in pieces] if pieces else [base]

    @staticmethod
    def cast(x: str, dt: torch.dtype) -> str:
        """An fp32 tile as a tl.dot operand of type ``dt`` (FA2 feeds P and dS in fp16/bf16)."""
        return x if dt == torch.float32 else f"{x}.to({TL_DTYPE[dt]})"

    def row_values(self, block: Block) -> None:
        """The forward's softmax shifts (saved per row) and dL/dr_j (from the row kernel)."""
        cols, _ = rowstat_columns(self.r)
        row = "pid_b * rowstats_sb + offs_m * rowstats_sm"
        vec = "[None, :]" if self.transposed else "[:, None]"
        block.lines.append("# the forward's softmax shifts, and dL/d(reduction) from the output expression")
        for j, rd in enumerate(self.r.reductions):
            if rd.kind in ("max", "kth"):       # a k-th largest is a constant here (``backward_support``)
                block.lines.append(f"r{j}_s = tl.load(rowstats_ptr + {row} + {cols[j]}, mask=mask_m, other=0.0){vec}")
                self.em.red_names[j] = f"r{j}_s"
                if j in self.plan.members:      # its gradient, and the key it reaches (-1: none)
                    block.lines += [
                        f"dr{j} = tl.load(drow_ptr + {row} + {cols[j]}, mask=mask_m, other=0.0){vec}",
                        f"am{j} = tl.load(rowstats_ptr + {row} + {self.argmax[j]}, mask=mask_m, "
                        f"other=-1.0).to(tl.int32){vec}"]
            elif j not in self.plan.members:
                continue
            elif rd.kind == "sum":
                block.lines.append(f"dr{j} = tl.load(drow_ptr + {row} + {cols[j]}, mask=mask_m, other=0.0){vec}")
            else:               # [BLOCK_M, DV] as written, per DV piece (a group's shared G once)
                if j in self.dg.shared:
                    block.lines.append(f"dc{j} = tl.load(drow_ptr + {row} + {cols[j]}, mask=mask_m, other=0.0){vec}")
                if j != self.dg.group(j)[0]:
                    continue
                for ctx in self.piece_ctxs("dv", CTX_O):
                    block.lines.append(f"d{dv_state(j, ctx)} = tl.load(ddot_ptr + pid_b * ddot_sb + offs_m[:, None] * ddot_sm"
                                       f" + {self.dg.cols[j]} + {ctx.vars['dv']}, mask={ctx.mask('m', 'dv')}, other=0.0)")
        for i in read_sums(self.r, self.plan.members):      # as the forward saved them
            block.lines.append(f"r{i}_v = tl.load(rowstats_ptr + {row} + {cols[i]}, mask=mask_m, other=0.0){vec}")
            self.em.red_names[i] = f"r{i}_v"

    @property
    def ctxs(self) -> dict[str, Ctx]:
        """The accumulators' tile contexts."""
        return {"dq": CTX_Q, "dk": CTX_KN if self.transposed else CTX_K, "dv": CTX_V}

    def per_tile(self, kind: str) -> bool:
        """Is accumulator ``kind`` written per tile (the dQ kernel's dK and dV under
        ``GradPlan.fused_kv``) rather than once after the loop?"""
        return self.kernel == "dq" and kind != "dq" and self.plan.fused_kv

    def accumulators(self) -> None:
        """One fp32 register tile per distinct operand expression in the plan (DiffAttn's two
        P @ V products share one dV) and head-dim piece (``pieces``), zero before the loop (or
        before each tile: ``per_tile``)."""
        for kind in self.kinds:
            ctx = self.ctxs[kind]
            pieces = self.piece_ctxs(kind, ctx)
            for e in self.plan.accs[kind]:
                acc = f"{kind}{len(self.accs.setdefault(kind, {}))}"
                self.accs[kind][e] = [acc + piece_suffix(pc, ctx) for pc in pieces]
                inits = [f"{name} = tl.zeros({TILE[pc.name][2]}, dtype=tl.float32)"
                         for name, pc in zip(self.accs[kind][e], pieces)]
                (self.tile_inits if self.per_tile(kind) else self.outer.lines).extend(inits)

    def tile_adjoints(self, loop: Block, full: bool, totals: bool = False) -> tuple[dict[Expr, Expr], dict[int, tuple]]:
        """Recompute the score tiles and bodies of one tile and reverse them: the adjoints of the
        leaves (score tiles, loads) and each score tile's tl.dot operands. ``full``: a block the
        sparsity scan proved inside every mask (mask-free bodies, as the forward's). With scans
        (``GradPlan.scans``) their partial sums are computed first (``scan_tiles``) and their
        bodies reversed from the adjoint of the partial sums (``scan_adjoints``); ``totals``:
        the first of the two key loops, which only sums those adjoints per row (no dV)."""
        r, em, ctx = self.r, self.em, self.ctx_s
        if full and self.per_tile("dk"):    # a whole key block, not always a whole query block: the
            # per-tile dK, dV and loads' adds sum over the rows, where a padded one can be 0 * inf
            loop.lines.append(f"mask_mn = tl.broadcast_to(mask_m[:, None], {TILE[ctx.name][2]})")
        elif full:      # every mask keeps the tile and rows past M are never stored: no masks
            loop.lines.append(f"mask_mn = tl.full({TILE[ctx.name][2]}, 1, tl.int1)")
        else:
            loop.lines.append("mask_mn = mask_n[:, None] & mask_m[None, :]  # of the [N, M] tile" if self.transposed
                              else "mask_mn = mask_m[:, None] & mask_n[None, :]")
        loop.lines.append("# recompute the score tiles")
        em.dot_names, operands = {}, {}
        # S^T = K Q^T from K [N, DK] and Q^T [DK, M], both as loaded, in the transposed kernel
        qctx, kctx = (CTX_QT, CTX_KN) if self.transposed else (CTX_Q, CTX_K)
        kind = self.kinds[0] if self.kinds else "dq"
        for i in self.plan.dots:     # one dot per DK piece (of the accumulator's pieces), chained
            operands[i] = [self.score_dot(i, q, k, loop, transposed=self.transposed, acc=f"qk{i}" if c else None)
                           for c, (q, k) in enumerate(zip(self.piece_ctxs(kind, qctx), self.piece_ctxs(kind, kctx)))]
            em.dot_names[i] = f"qk{i}"
        self.scan_tiles(loop, full)
        loop.lines.append("# d body: dR (sum) or dR @ V^T (P @ V)" + (", and dV += body^T @ dR" if "dv" in self.kinds else ""))
        drs: dict[int, list[str]] = {}      # a group's first product -> its dR tile per DV piece
        for j in self.members:
            rd = r.reductions[j]
            body = full_body(rd.body) if full else rd.body
            if rd.kind == "max":       # d body = dL/dm at the argmax key, 0 elsewhere
                hit = f"offs_n[:, None] == am{j}" if self.transposed else f"offs_n[None, :] == am{j}"
                loop.lines.append(f"db{j} = tl.where(mask_mn & ({hit}), dr{j}, 0.0)")
                continue
            if rd.kind == "sum":       # d body = dR_j, broadcast along n
                loop.lines.append(f"db{j} = tl.where(mask_mn, dr{j}, 0.0)")
                continue
            # d body = dR_j @ V_j^T;  dV_j += body^T @ dR_j (per DV piece). A group sharing one G:
            # d body_j = c_j (G @ V^T), computed once, and dV += (sum_j c_j body_j)^T @ G
            group = self.dg.group(j)
            lead = group[0]
            if j == lead:
                drs[lead] = []
                for c, (vctx, octx) in enumerate(zip(self.piece_ctxs("dv", CTX_V), self.piece_ctxs("dv", CTX_O))):
                    v, vdt = self.dot_operand(rd.v, vctx, loop)
                    dr = f"d{dv_state(j, octx)}"
                    dr = dr if self.dg.dtype == vdt else self.cast(dr, vdt)
                    acc = f"dp{j}" if c else None
                    dp = self.tl_dot(v, f"tl.trans({dr})", vdt, acc) if self.transposed else \
                        self.tl_dot(dr, f"tl.trans({v})", vdt, acc)
                    loop.lines.append(f"dp{j} = {dp}")
                    drs[lead].append(dr)
            scale = f" * dc{j}" if j in self.dg.shared else ""
            loop.lines.append(f"db{j} = tl.where(mask_mn, dp{lead}{scale}, 0.0)")
            if "dv" not in self.kinds or totals:
                continue
            vdt = operand_dtype(rd.v, r, self.interpret)
            p = f"tl.where(mask_mn, {full_tile(em.emit(body, ctx, loop), body, ctx, r)}, 0.0)"
            if j in self.dg.shared:
                loop.lines.append(f"p{j} = {p}")
                if j != group[-1]:
                    continue
                loop.lines.append(f"p{lead} = {self.cast('(' + ' + '.join(f'dc{k} * p{k}' for k in group) + ')', vdt)}")
            else:
                loop.lines.append(f"p{j} = {self.cast(p, vdt)}")
            pt = f"p{lead}" if self.transposed else f"tl.trans(p{lead})"
            for acc, dr in zip(self.accs["dv"][rd.v], drs[lead]):
                loop.lines.append(f"{acc} = {self.tl_dot(pt, dr, vdt, acc=acc)}")
        adjoints = vjp(self.seeds(full))
        if self.plan.scans:
            self.scan_adjoints(loop, adjoints, full, totals)
        return adjoints, operands

    def scan_init(self, totals: bool) -> list[str]:
        """Before a key loop: each scan's carried partial sums, and its adjoints' (``totals``:
        the first loop, their row totals t{j}; the second: their sums over the keys walked)."""
        lines = []
        for j in self.plan.scans:
            lines.append(f"c{j} = tl.zeros([BLOCK_M, 1], tl.float32)  # red{j}'s sums over the key blocks walked")
            lines.append(f"t{j} = tl.zeros([BLOCK_M, 1], tl.float32)  # dL/d(partial sums), summed over the keys"
                         if totals else f"u{j} = tl.zeros([BLOCK_M, 1], tl.float32)  # t{j}'s part walked so far")
        return lines

    def scan_tiles(self, loop: Block, full: bool) -> None:
        """Each scan's partial sums on this tile, as the forward's kernel computes them (this
        key excluded), carried across the key blocks the loop walks in the scan's order."""
        for j in self.plan.scans:
            rd = self.r.reductions[j]
            body = full_body(rd.body) if full else rd.body
            x = self.em.emit(body, self.ctx_s, loop)
            x = full_tile(x, body, self.ctx_s, self.r) if full else f"tl.where(mask_mn, {x}, 0.0)"
            partial_sums(self.em, loop, j, rd.scan, x, f"c{j}")
            loop.lines.append(f"c{j} = c{j} + tl.sum(x{j}, 1, keep_dims=True)")

    def scan_adjoints(self, loop: Block, adjoints: dict[Expr, Expr], full: bool, totals: bool) -> None:
        """Reverse each scan: its partial sum at key j (suffix: over the keys k > j) has the
        adjoint g_j, so its body at key k has the adjoint of the partial sums that include k,
        sum_{j < k} g_j (prefix: j > k) — a partial sum the other way, here the row's total t
        (the first loop's) less the sum over the keys walked so far, k's own included. Its
        body's vjp is added to ``adjoints``; the scan leaves leave them. ``totals``: only
        t += the tile's g."""
        for j in self.plan.scans:
            gs = [g for x, g in adjoints.items() if x.op == "scan" and x.args[0] == j]
            if not gs:
                continue
            g = gs[0]
            for h in gs[1:]:
                g = g + h
            loop.lines.append(f"g{j} = tl.where(mask_mn, tl.broadcast_to({self.em.emit(g, self.ctx_s, loop)}, "
                              f"{TILE[self.ctx_s.name][2]}), 0.0)  # dL/d(partial sums)")
            if totals:
                loop.lines.append(f"t{j} = t{j} + tl.sum(g{j}, 1, keep_dims=True)")
                continue
            reverse = self.r.reductions[j].scan == "suffix"
            loop.lines += [f"dx{j} = tl.where(mask_mn, t{j} - u{j} - tl.cumsum(g{j}, 1, reverse={reverse}), 0.0)",
                           f"u{j} = u{j} + tl.sum(g{j}, 1, keep_dims=True)"]
            body = full_body(self.r.reductions[j].body) if full else self.r.reductions[j].body
            for x, dx in vjp({body: tile(f"dx{j}")}).items():
                adjoints[x] = adjoints[x] + dx if x in adjoints else dx
        for x in [x for x in adjoints if x.op == "scan"]:
            del adjoints[x]

    def seeds(self, full: bool) -> dict[Expr, Expr]:
        """The adjoint of every member body (mask-free in ``full`` blocks): the ``db{j}`` tiles."""
        seeds: dict[Expr, Expr] = {}
        for j in self.members:
            body = full_body(self.r.reductions[j].body) if full else self.r.reductions[j].body
            seeds[body] = seeds[body] + tile(f"db{j}") if body in seeds else tile(f"db{j}")
        return seeds

    def folded_scales(self, kind: str) -> dict[Expr, float]:
        """Accumulators of ``kind`` whose every dS is ``X * c`` for one constant c (the softmax
        scale): the loop accumulates X and the accumulator is scaled once after it (FA2's
        ``dk *= sm_scale``) instead of scaling every score tile."""
        if kind in self.folded:
            return self.folded[kind]
        if self.plan.fused_kv:      # dS feeds dQ and dK alike: scaled per tile
            self.folded[kind] = {}
            return self.folded[kind]
        operand = (lambda i: self.r.dots[i].k) if kind == "dk" else (lambda i: self.r.dots[i].q)
        found: dict[Expr, set] = {}
        for full in (False, True):
            adjoints = vjp(self.seeds(full))
            for i in self.plan.dots:
                e = adjoints.get(dot(i))
                if e is None:
                    continue
                _, c = const_factor(e)
                found.setdefault(operand(i), set()).add(c if c != 1.0 else None)
        self.folded[kind] = {e: cs.pop() for e, cs in found.items() if len(cs) == 1 and None not in cs}
        return self.folded[kind]

    def score_grads(self, loop: Block, adjoints: dict[Expr, Expr], operands: dict[int, tuple]) -> None:
        """dS_i of every score tile a gradient reaches, into this kernel's accumulators
        (dK_i += dS_i^T Q_i, and / or dQ_i += dS_i K_i)."""
        kinds = [kind for kind in ("dk", "dq") if kind in self.kinds]
        folded = self.folded_scales(kinds[0])       # one kind, or none folded (``fused_kv``)
        for i in self.plan.dots:
            if dot(i) not in adjoints:
                continue        # no gradient reaches this score tile (e.g. floor(s))
            ds = adjoints[dot(i)]
            if (self.r.dots[i].k if kinds[0] == "dk" else self.r.dots[i].q) in folded:
                ds = const_factor(ds)[0]    # its constant factor is applied after the loop
            # out-of-range keys can score exp(+large) when the shift is a finite fill (-1e9): 0 * inf
            # there would reach dQ through K's zero padding (fuzz seed 21, #195)
            loop.lines.append(f"ds{i} = tl.where(mask_mn, tl.broadcast_to({self.em.emit(ds, self.ctx_s, loop)}, "
                              f"{TILE[self.ctx_s.name][2]}), 0.0)")
            for kind in kinds:
                accs = self.accs[kind][self.r.dots[i].k if kind == "dk" else self.r.dots[i].q]
                for acc, (q, qdt, k, kdt) in zip(accs, operands[i]):     # per DK piece
                    if kind == "dk" and self.transposed:     # dK [N, DK] += dS^T [N, M] @ Q [M, DK]
                        dk = self.tl_dot(self.cast(f'ds{i}', qdt), f'tl.trans({q})', qdt, acc=acc)
                    elif kind == "dk":                       # dK^T [DK, N] += Q^T [DK, M] @ dS [M, N]
                        dk = self.tl_dot(f'tl.trans({q})', self.cast(f'ds{i}', qdt), qdt, acc=acc)
                    else:
                        dk = self.tl_dot(self.cast(f'ds{i}', kdt), f'tl.trans({k})', kdt, acc=acc)
                    loop.lines.append(f"{acc} = {dk}")

    def write_grads(self, kind: str, ctx: Ctx, block: Block | None = None) -> None:
        """The gradients of the operands behind accumulator ``kind``, once per program (into
        ``block``: once per tile)."""
        block = block or self.outer
        folded = self.folded_scales(kind) if kind != "dv" else {}
        for e, names in self.accs.get(kind, {}).items():
            for name, pctx in zip(names, self.piece_ctxs(kind, ctx)):
                if e in folded:
                    block.lines.append(f"{name} = {name} * {folded[e]!r}")
                scatter(self.em, vjp({e: tile(name)}), pctx, block, self.plan.stored,
                        sum_mask=in_bounds(pctx))

    def common_args(self, kernel: str) -> list[str]:
        args = tensor_args(self.r, "in", range(len(self.r.inputs))) + tensor_args(self.r, "g", self.plan.written(kernel))
        args += ["rowstats_ptr", "drow_ptr", "rowstats_sb", "rowstats_sm", "ddot_ptr", "ddot_sb", "ddot_sm"]
        for k, st in enumerate(self.stats):
            args += [f"aux{k}_min", f"aux{k}_max"]
            args += [f"aux{k}_s{d}" for d in range(len(self.r.inputs[st.input].shape))]
        return args + [f"B{d}" for d in range(len(self.r.batch))] + ["M", "N", "DK: tl.constexpr", "DV: tl.constexpr"]


class DKDVWriter(TileWriter):
    """FA2's first backward kernel: one program per (key block, batch index) loops over the live
    query blocks; dK and dV stay in registers, the loads of the bodies (biases, tables) get their
    gradients scattered per tile."""
    axis, kernel, kinds, transposed = "m", "dkdv", ("dk", "dv"), True

    def query_block(self, full: bool) -> list[str]:
        """One query block of the dK/dV loop; ``full``: inside every mask and both bounds (no
        masks, mask-free bodies — as the forward's middle segment)."""
        loop = Block(parent=self.outer)
        loop.lines += ["offs_m = start_m + tl.arange(0, BLOCK_M)",
                       "mask_m = tl.full([BLOCK_M], 1, tl.int1)" if full else "mask_m = offs_m < M"]
        self.row_values(loop)
        adjoints, operands = self.tile_adjoints(loop, full)
        loop.lines.append("# reverse through the bodies: loaded biases and tables, then dS -> dK")
        carried = self.plan.carried
        per_tile, sums = {x: g for x, g in adjoints.items() if x not in carried}, {}
        scatter(self.em, per_tile, self.ctx_s, loop, self.plan.stored, "mask_mn",  # (reductions read: constant shifts)
                index_bounds=lambda x: self.index_bounds(x, loop), sums=sums)
        self.carry(loop, adjoints, sums)
        self.score_grads(loop, adjoints, operands)
        if self.plan.fused_dq:
            self.add_dq(loop, adjoints, operands)
        return loop.lines

    def index_bounds(self, x: Expr, loop: Block) -> list[tuple[str, str]] | None:
        """Scalar (lo, hi) code per index dim of load ``x`` over this query block's tile (rows
        [start_m, its last], the program's key block), by ``IntervalWriter``; lines added to
        ``loop``. None where a dim reads more than positions and batch indices or cannot be
        bounded without block statistics (an index through loaded ids)."""
        if any(free_vars(ie) - {"m", "n", *self.r.batch_vars} for ie in x.args[1]):
            return None
        lines, stats = [], []
        iw = IntervalWriter(self.r, stats, lines, self.em.fresh, names={"m": ("tm_lo", "tm_hi"), "n": ("n_lo", "n_hi")})
        bounds = [iw.interval(ie) for ie in x.args[1]]
        if stats or any(b is None for b in bounds):
            return None
        if "tm_lo = start_m" not in loop.lines:
            loop.lines += ["tm_lo = start_m", "tm_hi = tl.minimum(start_m + BLOCK_M, M) - 1"]
        loop.lines += lines
        return bounds

    def add_dq(self, loop: Block, adjoints: dict[Expr, Expr], operands: dict[int, tuple]) -> None:
        """The fused dQ (``GradPlan.fused_dq``): this tile's dQ_i = dS_i K_i ([M, DK], from the
        transposed dS^T score_grads left, times the constant it folded out for dK), summed over
        the score tiles that share a Q operand and added into the fp32 gradient per head-dim
        piece. dS and K are already in registers; the atomics add one [BLOCK_M, DK] tile per
        (query block, key block) instead of a dQ kernel's second pass over S, P and dP."""
        folded = self.folded_scales("dk")
        tiles: dict[Expr, list[list[str]]] = {}
        for i in self.plan.dots:
            if dot(i) not in adjoints or self.r.dots[i].q not in self.plan.accs["dq"]:
                continue
            c = const_factor(adjoints[dot(i)])[1] if self.r.dots[i].k in folded else 1.0
            names = []
            for piece, (_, _, k, kdt) in enumerate(operands[i]):
                ds = "tl.trans(" + self.cast(f"ds{i}", kdt) + ")"
                scale = f" * {c!r}" if c != 1.0 else ""
                loop.lines.append(f"dqt{i}_{piece} = {self.tl_dot(ds, k, kdt)}{scale}")
                names.append(f"dqt{i}_{piece}")
            tiles.setdefault(self.r.dots[i].q, []).append(names)
        for a, (e, per_dot) in enumerate(tiles.items()):
            for piece, ctx in enumerate(self.piece_ctxs("dq", CTX_Q)):
                loop.lines.append(f"dqs{a}_{piece} = {' + '.join(names[piece] for names in per_dot)}")
                scatter(self.em, vjp({e: tile(f"dqs{a}_{piece}")}), ctx, loop, self.plan.stored,
                        sum_mask=in_bounds(ctx))

    def predicates(self) -> tuple:
        """The forward's dead predicate over all its passes (a tile it holds is skipped) and the
        bodies' full predicate (a tile it holds takes the mask-free bodies)."""
        return (dead_predicate(self.r, every_pass(self.r)),
                full_predicate([self.r.reductions[j].body for j in self.plan.members]))

    def query_scan(self) -> tuple[str, str, str, str]:
        """The bounds (lo, hi, f0, f1), in query blocks, of this key block's live query blocks
        [lo, hi) and of the mask-free run [f0, f1) inside them, computed by lines added to the
        kernel's prologue. With a useful mask: [first live, last live] query block — the
        forward's dead predicate, interval-tested for every query block at once (a skipped tile
        contributes exactly zero to every gradient) — and its first run of full blocks; without
        one, every block, all mask-free but a ragged tail. Blocks are mask-free only in a
        complete key block."""
        dead, keep = self.predicates()
        f = self.em.fresh
        lo, hi, f0, f1 = f("lo"), f("hi"), f("f"), f("f")
        n_whole = "(n_hi - n_lo == BLOCK_N - 1)"
        if not (self.sparse and useful(dead)):
            whole = f"tl.where({n_whole}, M // BLOCK_M, 0)" if keep == TRUE else "0"
            self.outer.lines += [f"{lo} = 0", f"{f0} = 0", f"{f1} = {whole}", f"{hi} = tl.cdiv(M, BLOCK_M)"]
            return lo, hi, f0, f1
        scan = [f"pid_m = {self.arange('SCAN_BLOCKS', 'rows')}     # every query block, as a vector",
                "mblk_valid = pid_m < tl.cdiv(M, BLOCK_M)",
                "m_lo = pid_m * BLOCK_M",
                "m_hi = tl.minimum(m_lo + BLOCK_M, M) - 1"]
        iw = IntervalWriter(self.r, self.stats, scan, self.em.fresh, vector="m", arange=lambda n: self.arange(n, "cols"))
        live = iw.live(dead)
        _, may_f = iw.truth(keep)
        ff, fe = f("ff"), f("fe")
        full_v = (f"({may_f} == 0) & mblk_live & (m_hi - m_lo == BLOCK_M - 1) & {n_whole}"
                  if may_f != "True" else "pid_m < 0")
        self.outer.lines += [f"# block sparsity: visit only query blocks where not {short_expr(dead)}", *scan,
                             f"mblk_live = ({live}) & mblk_valid & blk_valid",
                             f"mblk_full = {full_v}",
                             *segment_bounds("pid_m", "mblk_live", "mblk_full", (lo, hi, ff, fe, f0, f1))]
        return lo, hi, f0, f1

    def query_loop(self) -> list[str]:
        """The loops over this key block's live query blocks (``query_scan``): a mask-free middle
        and one loop over the masked head and tail (``block_loops``). Under a group loop
        (``GradPlan.group``: the query heads sharing this key block's K and V rows) each loop
        visits the blocks of every head of the group, setting the head's batch index and flat
        batch index in each iteration; what reads them is computed there, the rest (K and V,
        read at ``b // G``, and the scan, which does not read b) once before the loops."""
        lo, hi, f0, f1 = self.query_scan()
        segs = [(lo, f0, False), (f0, f1, True), (f1, hi, False)]
        group = self.plan.group
        heads = (group.size, group_member(len(self.r.batch), group, "gi")) if group else None
        return block_loops("start_m", "BLOCK_M", segs, self.query_block, self.em.fresh("i"), heads)

    def signature(self) -> list[str]:
        return self.common_args("dkdv") + ["SCAN_BLOCKS: tl.constexpr", "BLOCK_M: tl.constexpr",
                                           "BLOCK_N: tl.constexpr", "BLOCK_DK: tl.constexpr", "BLOCK_DV: tl.constexpr",
                                           *self.tma_arg()]

    def write(self) -> str:
        group = self.plan.group
        self.em.group = (self.r.batch_vars[group.dim], group.size) if group else None
        self.outer.lines += [
            "pid_n = tl.program_id(0)", *batch_index(len(self.r.batch), group),
            *(group_member(len(self.r.batch), group, "0") if group else []),     # the group's first head
            "start_n = pid_n * BLOCK_N",
            "offs_n = start_n + tl.arange(0, BLOCK_N)",
            "offs_dk = tl.arange(0, BLOCK_DK)",
            "offs_dv = tl.arange(0, BLOCK_DV)",
            "mask_n = offs_n < N",
            "mask_dk = offs_dk < DK",
            "mask_dv = offs_dv < DV",
            "n_lo = start_n",
            "n_hi = tl.minimum(n_lo + BLOCK_N, N) - 1",
            "blk = pid_n       # this program's key block, for the sparsity scan",
            "blk_valid = n_lo < N",
        ]
        self.accumulators()
        self.outer.lines += carry_init(self.carried, self.ctx_s)
        self.outer.lines += self.query_loop()
        self.outer.lines.append("# gradients of the K and V operands, accumulated over all query blocks")
        flush(self.em, self.carried, self.ctx_s, self.outer, self.plan.stored)
        self.write_grads("dk", CTX_KN)
        self.write_grads("dv", CTX_V)
        return self.assemble()


class DQWriter(TileWriter):
    """FA2's second backward kernel: one program per (query block, batch index) loops over the
    live key blocks exactly as the forward does (``KernelWriter.segments``: a mask-free middle
    and one loop over the masked head and tail) and accumulates dQ = sum_n dS K in registers,
    written once at the end — no atomics across key blocks — and likewise the gradients of the
    body loads read per query (``GradPlan.carried``); the dK/dV kernel owns the others."""
    axis, kernel = "n", "dq"

    @property
    def kinds(self) -> tuple[str, ...]:
        return ("dq", "dk", "dv") if self.plan.fused_kv else ("dq",)

    def signature(self) -> list[str]:
        return self.common_args(self.kernel) + ["EVEN_M: tl.constexpr", "EVEN_N: tl.constexpr", "SCAN_BLOCKS: tl.constexpr",
                                         "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr",
                                         "BLOCK_DK: tl.constexpr", "BLOCK_DV: tl.constexpr", *self.tma_arg()]

    def key_block_grads(self, loop: Block, full: bool) -> None:
        key_block(loop, full)
        loop.lines += self.tile_inits
        adjoints, operands = self.tile_adjoints(loop, full)
        if self.plan.fused_kv:      # every load's gradient but the per-query ones, per tile
            loop.lines.append("# reverse through the bodies: loads, dS -> dQ and dK, and dV, per tile")
            per_tile, sums = {x: g for x, g in adjoints.items() if x not in self.carried}, {}
            scatter(self.em, per_tile, self.ctx_s, loop, self.plan.stored, "mask_mn", sums=sums)
            self.carry(loop, adjoints, sums)
        else:
            loop.lines.append(f"# reverse through the bodies: {'per-query loads, ' if self.carried else ''}dS -> dQ")
            self.carry(loop, adjoints)
        self.score_grads(loop, adjoints, operands)
        for kind in ("dk", "dv"):
            if kind in self.kinds:
                self.write_grads(kind, self.ctxs[kind], loop)

    def scan_totals(self, loop: Block, full: bool) -> None:
        """The first key loop (``GradPlan.scans``): per row, the total adjoint of each scan's
        partial sums, which the second loop's reverse of the scan starts from."""
        key_block(loop, full)
        self.tile_adjoints(loop, full, totals=True)

    def write(self) -> str:
        self.prologue()
        self.row_values(self.outer)
        if self.plan.fused_kv and self.pieces("dk") != self.pieces("dq"):
            raise CodegenError("partial sums over the keys with a head dim split unlike Q's")
        self.accumulators()
        self.outer.lines += carry_init(self.carried, self.ctx_s)
        passes = every_pass(self.r)
        if self.plan.scans:     # two walks over the same live blocks: their scan once
            order = SCAN_ORDER[self.r.reductions[self.plan.scans[0]].scan]
            segments = self.segments(passes)
            self.outer.lines += ["# the adjoints of the partial sums over the keys, totalled per row", *self.scan_init(True)]
            self.outer.lines += self.key_loops(passes, self.scan_totals, order, segments)
            self.outer.lines += ["# the gradients, the key blocks walked again", *self.scan_init(False)]
            self.outer.lines += self.key_loops(passes, self.key_block_grads, order, segments)
        else:
            self.outer.lines += self.key_loops(passes, self.key_block_grads)
        self.outer.lines.append("# gradients of the Q operands, accumulated over all key blocks")
        flush(self.em, self.carried, self.ctx_s, self.outer, self.plan.stored)
        self.write_grads("dq", CTX_Q)
        return self.assemble()


class SumsWriter(DQWriter):
    """The row gradients of the sums a later pass reads (``read_sums``: l in a sum over
    where(e / l > t, e, 0)), completed between the row kernel and the tile kernels: dL/dl is
    the output's part (the row kernel's) plus sum_n dL/d body_k(n) * d body_k(n) / dl over the
    bodies that read l, a sum over the keys. One program per (query block, batch index) walks
    the live key blocks once per pass that reads such sums, last pass first, recomputing that
    pass's bodies and reversing them (``tile_adjoints``) into the sums they read; after the walk
    of pass p every sum of pass p - 1 has its whole gradient, which the next walk seeds its
    bodies with. The totals overwrite the row kernel's columns, which the tile kernels then read
    as they read any row gradient."""
    kernel, kinds = "sums", ()

    def sum_block(self, targets: list[int], loop: Block, full: bool) -> None:
        key_block(loop, full)
        adjoints, _ = self.tile_adjoints(loop, full)
        for i in targets:
            if red(i) in adjoints:
                g = self.em.emit(adjoints[red(i)], self.ctx_s, loop)
                loop.lines.append(f"gs{i} = gs{i} + tl.sum(tl.where(mask_mn, tl.broadcast_to({g}, "
                                  f"{TILE[self.ctx_s.name][2]}), 0.0), 1, keep_dims=True)")

    def write(self) -> str:
        self.prologue()
        self.row_values(self.outer)
        r, chained = self.r, self.plan.chained
        passes = every_pass(r)
        segments = self.segments(passes)
        done = []
        for p in reversed(r.passes()[1:]):
            self.active = [j for j in p if j in chained]
            targets = sorted({i for j in self.active for i in chained[j]})
            if not targets:
                continue
            self.outer.lines += [f"# pass {r.passes().index(p)}'s bodies reversed into the sums they read"]
            self.outer.lines += [f"gs{i} = tl.zeros([BLOCK_M, 1], tl.float32)" for i in targets]
            self.outer.lines += self.key_loops(passes, functools.partial(self.sum_block, targets), segments=segments)
            self.outer.lines += [f"dr{i} = dr{i} + gs{i}" for i in targets]
            done += targets
        cols, _ = rowstat_columns(r)
        for i in sorted(set(done)):
            self.outer.lines.append(f"tl.store(drow_ptr + pid_b * rowstats_sb + offs_m[:, None] * rowstats_sm + "
                                    f"{cols[i]}, dr{i}, mask=mask_m[:, None])")
        return self.assemble()


class KernelStats(NamedTuple):
    """The per-block statistics each tile kernel's sparsity scan reads (``sparsity.BlockStat``),
    the layout of the P @ V products' row gradients, and the inputs each tile kernel's tensor
    descriptors read (``Emitter.tma``), and the gradient plan the kernels follow."""
    dkdv: list[BlockStat]
    dq: list[BlockStat]
    dot_grads: DotGrads
    tma_dkdv: dict[int, set[int]]
    tma_dq: dict[int, set[int]]
    plan: GradPlan
    sums: list[BlockStat] = []
    tma_sums: dict[int, set[int]] = {}

    def of(self, kernel: str) -> tuple[list[BlockStat], dict[int, set[int]]]:
        """The block statistics and TMA inputs of tile kernel ``kernel`` ("dkdv", "dq", "sums")."""
        return {"dkdv": (self.dkdv, self.tma_dkdv), "dq": (self.dq, self.tma_dq),
                "sums": (self.sums, self.tma_sums)}[kernel]


def generate_backward(region: Region, name: str, allow_tf32: bool = False, interpret: bool = False,
                      sparse: bool = True, fused_dq: bool = False, group: str = "auto") -> tuple[str, KernelStats]:
    """Triton source of the backward kernels — ``name_rows`` (row gradients, launched first),
    ``name`` (dK, dV and the body loads' gradients; none with scans: the dQ kernel adds them,
    ``GradPlan.fused_kv``) and ``name_dq`` (none with ``fused_dq``: the dK/dV kernel adds dQ,
    ``GradPlan.fused_dq``) — and the per-block statistics of the tile kernels; raises
    CodegenError (the reason) when the region needs the reference backward."""
    reason = backward_support(region)
    if reason:
        raise CodegenError(reason)
    plan = grad_plan(region, fused_dq, group)
    kv = None if plan.fused_kv else DKDVWriter(region, plan, name, allow_tf32, interpret, sparse)
    source = kv.write() if kv else ""
    dq = None if plan.fused_dq else DQWriter(region, plan, f"{name}_dq", allow_tf32, interpret, sparse)
    if dq is not None:
        source += f"\n\n{dq.write()}"
    sums = SumsWriter(region, plan, f"{name}_sums", allow_tf32, interpret, sparse) if plan.chained else None
    if sums is not None:
        source += f"\n\n{sums.write()}"
    dg = (kv or dq or sums).dg
    source += row_gradient_kernel(region, plan, f"{name}_rows", dg)
    return prelude(source) + source, KernelStats(kv.stats if kv else [], dq.stats if dq else [], dg,
                                                 kv.em.tma if kv else {}, dq.em.tma if dq else {}, plan,
                                                 sums.stats if sums else [], sums.em.tma if sums else {})
