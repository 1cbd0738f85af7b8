"""Backward kernel generation (FA2): one Triton program per (N block, batch index) loops over the
query blocks, recomputes the score tiles and reduction bodies from the saved row statistics, and
reverses the bodies with ``ir.derivative.vjp``.

Per (M block, N block) tile, for the reductions of the region (r_j = sum_n body_j, or
r_j = sum_n body_j V_j for a P @ V product), given the row gradients dR_j that a first kernel
(``row_gradient_kernel``) derived from the output expression::

    d body_j = dR_j (sum)  or  dR_j @ V_j^T (P @ V)         dV_j += body_j^T @ dR_j
    (d dot_i, d loads) = vjp of the bodies                  dK_i += dS_i^T @ Q_i,  dQ_i += dS_i @ K_i

dK and dV accumulate in registers over the query loop; dQ, and the gradients of every float input
the bodies or the Q/K/V operands load (biases of any broadcast shape, gathered tables), go to fp32
buffers with ``tl.atomic_add`` at the load's own address, so broadcast dims are reduced and
gathered indices scatter-add. A max reduction is treated as a constant: ``backward_support`` only
accepts regions where it is a softmax shift the output is invariant to (zero total derivative).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..ir import Expr, Region, dot, free_vars, red, refs, walk
from ..ir.derivative import not_differentiable, tile, vjp
from ..ir.region import rowstat_columns
from ..sparsity import IntervalWriter, dead_predicate, useful
from .emit import Block, CodegenError, Ctx, Emitter, prelude
from .kernel import CTX_K, CTX_O, CTX_Q, CTX_S, CTX_V, TILE, TL_DTYPE, KernelWriter, batch_index, full_tile, short_expr


def _same(ds: list[int]) -> int | None:
    return ds[0] if all(d == ds[0] for d in ds) else None


# Degree of homogeneity of an expression in a group of reductions G (all scaled by one factor c):
# e(c r) = c^d e(r). Each row: op -> degrees of the arguments -> degree (None: not homogeneous).
DEGREE: dict[str, Callable[[list[int]], int | None]] = {
    "mul": lambda d: d[0] + d[1],
    "div": lambda d: d[0] - d[1],
    "div_safe": lambda d: d[0] - d[1],      # b == 0 iff c b == 0 (c > 0)
    "add": _same, "sub": _same, "maximum": _same, "minimum": _same,
    "neg": lambda d: d[0], "to_f": lambda d: d[0],
    "where": lambda d: _same(d[1:]) if d[0] == 0 else None,
}


def degree(e: Expr, group: set[int]) -> int | None:
    """Ops without a row are homogeneous of degree 0 when their arguments are (sigmoid(a/l))."""
    memo: dict[Expr, int | None] = {}
    for x in walk(e):
        if x.op == "red":
            memo[x] = 1 if x.args[0] in group else 0
            continue
        args = [memo[a] for a in x.args if isinstance(a, Expr)] if x.op != "load" else []
        if any(d is None for d in args):
            memo[x] = None
        elif x.op in DEGREE:
            memo[x] = DEGREE[x.op](args)
        else:
            memo[x] = 0 if all(d == 0 for d in args) else None
    return memo[e]


def backward_support(region: Region) -> str | None:
    """Why the generated backward cannot handle ``region`` (None: it can).

    A max reduction m only shifts the sums it rescales (``online``): they scale as exp(-m), so
    when the output is homogeneous of degree 0 in them the total derivative through m is zero and
    m is a constant in the backward. Bodies may read no other reduction (a row gradient of a sum
    read inside a body would need a pass over N before the tile loop)."""
    if region.out_index is not None:
        return "the output is stored through a permuted or reshaped index (dO would be read that way)"
    if region.rows:
        return "the region has extra row outputs (flashlight::region_rows: the reference VJP)"
    for j, r in enumerate(region.reductions):
        if r.extra is not None:
            return f"red{j} has a sink element (its gradient has no rule yet)"
        if r.kind == "max":
            if j in refs(region.out, "red"):
                return f"the output reads the maximum red{j} itself"
            group = {k for k, o in enumerate(region.reductions) if o.online == j}
            if degree(region.out, group) != 0:
                return f"the output is not invariant to the shift red{j}"
            continue
        other = refs(r.body, "red") - {r.online}
        if other:
            return f"red{j} reads reductions {sorted(other)} other than its softmax shift"
    exprs = [region.out] + [e for d in region.dots for e in (d.q, d.k)]
    exprs += [e for r in region.reductions if r.kind != "max" for e in (r.body, r.v) if e is not None]
    for e in exprs:
        op = not_differentiable(e)
        if op:
            return f"no derivative rule for {op}"
    return None


def epilogue_grad_inputs(region: Region) -> list[int]:
    """Float inputs the output expression loads (their gradients come from the row kernel)."""
    return sorted({x.args[0] for x in walk(region.out) if x.op == "load" and x.kind == "f"})


def grad_inputs(region: Region) -> list[int]:
    """Float inputs the tile kernel writes gradients for: those the score program loads."""
    exprs = [e for d in region.dots for e in (d.q, d.k)]
    exprs += [e for r in region.reductions if r.kind != "max" for e in (r.body, r.v) if e is not None]
    return sorted({x.args[0] for e in exprs for x in walk(e) if x.op == "load" and x.kind == "f"})


def scatter(em: Emitter, adjoints: dict[Expr, Expr], ctx: Ctx, block: Block) -> None:
    """atomic_add every load's adjoint into its gradient buffer at the load's address, first
    summed over the tile axes its index does not use (broadcast dims)."""
    rows, cols, shape = TILE[ctx.name]
    for x, g in adjoints.items():
        if x.op != "load":
            continue
        val = f"tl.broadcast_to({em.emit(g, ctx, block)}, {shape})"
        used = set().union(*(free_vars(i) for i in x.args[1]))
        if rows not in used and cols not in used:
            val = f"tl.sum(tl.sum({val}, 1), 0)"
        elif rows not in used:
            val = f"tl.sum({val}, 0, keep_dims=True)"
        elif cols not in used:
            val = f"tl.sum({val}, 1, keep_dims=True)"
        ptr, mask = em.address(x, ctx, block, "g")
        block.lines.append(f"tl.atomic_add({ptr}, {val}" + (f", mask={mask})" if mask else ")"))


def row_gradient_kernel(region: Region, name: str) -> str:
    """FA2's preprocessing step, generalised: one program per (M block, batch index) reverses
    the output expression on [BLOCK_M, DV] tiles (``vjp`` of ``out`` with the adjoint dO) into
    dL/dr_j for every reduction — stored in the layout of the row statistics, summed over dv for
    a row value — and scatters the gradients of the inputs the epilogue reads (gates, lambda).
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
        "do = tl.load(dout_ptr + " + " + ".join([f"b{d} * dout_s{d}" for d in range(nb)]
                                               + [f"offs_m[:, None] * dout_s{nb}", f"offs_dv[None, :] * dout_s{nb + 1}"])
        + ", mask=mask_o, other=0.0).to(tl.float32)",
    ]
    for j in sorted(refs(region.out, "red")):
        reduction = region.reductions[j]
        dv = " + offs_dv[None, :]" if reduction.kind == "dot" else ""
        mask = "mask_o" if reduction.kind == "dot" else "mask_m[:, None]"
        block.lines.append(f"r{j} = tl.load(rowstats_ptr + row + {cols[j]}{dv}, mask={mask}, other=0.0)")
        em.red_names[j] = f"r{j}"
    adjoints = vjp({region.out: tile("do")})
    for j, reduction in enumerate(region.reductions):
        if red(j) not in adjoints:
            continue        # a max (a constant shift), or a reduction the output does not read
        g = f"tl.where(mask_o, tl.broadcast_to({em.emit(adjoints[red(j)], CTX_O, block)}, [BLOCK_M, BLOCK_DV]), 0.0)"
        if reduction.kind == "dot":
            block.lines.append(f"tl.store(drow_ptr + row + {cols[j]} + offs_dv[None, :], {g}, mask=mask_o)")
        else:
            block.lines.append(f"tl.store(drow_ptr + row + {cols[j]}, tl.sum({g}, 1, keep_dims=True), "
                               "mask=mask_m[:, None])")
    scatter(em, adjoints, CTX_O, block)
    args = [a for i, x in enumerate(region.inputs) for a in [f"in{i}_ptr"] + [f"in{i}_s{d}" for d in range(len(x.shape))]]
    args += [a for i in epilogue_grad_inputs(region) for a in [f"g{i}_ptr"] + [f"g{i}_s{d}" for d in range(len(region.inputs[i].shape))]]
    args += ["dout_ptr", *[f"dout_s{d}" for d in range(nb + 2)], "rowstats_ptr", "drow_ptr", "rowstats_sb", "rowstats_sm"]
    args += [f"B{d}" for d in range(nb)] + ["M", "DV: tl.constexpr", "BLOCK_M: tl.constexpr", "BLOCK_DV: tl.constexpr"]
    sig = ",\n".join("    " + a for a in args)
    body = "\n".join("    " + line for line in block.lines)
    return f"\n\n@triton.jit\ndef {name}(\n{sig},\n):\n{body}\n"


class RowLoopEmitter(Emitter):
    """The backward's inner loop runs over query blocks: what does not vary along m (K and V
    tiles, key-only loads) is hoisted out of it."""

    def variant(self, e: Expr) -> bool:
        return "m" in free_vars(e) or bool(refs(e, "dot") or refs(e, "red") or refs(e, "tile"))


class BackwardWriter(KernelWriter):
    def __init__(self, region: Region, name: str, allow_tf32: bool = False, interpret: bool = False,
                 sparse: bool = True):
        super().__init__(region, name, allow_tf32, interpret, sparse)
        self.em = RowLoopEmitter()
        self.grads = grad_inputs(region)
        self.members = [j for j, rd in enumerate(region.reductions) if rd.kind != "max"]
        self.accs: dict[str, dict[Expr, str]] = {}      # "dk"/"dv" -> operand expression -> register tile

    @staticmethod
    def cast(x: str, dt: torch.dtype) -> str:
        """An fp32 tile as a tl.dot operand of type ``dt`` (FA2 feeds P and dS in fp16/bf16)."""
        return x if dt == torch.float32 else f"{x}.to({TL_DTYPE[dt]})"

    # -- one (M block, N block) tile ------------------------------------------------------------
    def row_values(self, loop: Block) -> None:
        """The forward's softmax shifts (saved per row) and dL/dr_j (from the row kernel)."""
        cols, _ = rowstat_columns(self.r)
        row = "pid_b * rowstats_sb + offs_m * rowstats_sm"
        loop.lines += ["mask_mn = mask_m[:, None] & mask_n[None, :]",
                       "# the forward's softmax shifts, and dL/d(reduction) from the output expression"]
        for j, rd in enumerate(self.r.reductions):
            if rd.kind == "max":
                loop.lines.append(f"r{j}_s = tl.load(rowstats_ptr + {row} + {cols[j]}, mask=mask_m, other=0.0)[:, None]")
                self.em.red_names[j] = f"r{j}_s"
            elif rd.kind == "sum":
                loop.lines.append(f"dr{j} = tl.load(drow_ptr + {row} + {cols[j]}, mask=mask_m, other=0.0)[:, None]")
            else:
                loop.lines.append(f"dr{j} = tl.load(drow_ptr + pid_b * rowstats_sb + offs_m[:, None] * rowstats_sm"
                                  f" + {cols[j]} + offs_dv[None, :], mask=mask_m[:, None] & mask_dv[None, :], other=0.0)")

    def body_seeds(self, loop: Block) -> dict[Expr, Expr]:
        """The adjoint of every reduction body on this tile; accumulates dV on the way."""
        r, em = self.r, self.em
        loop.lines.append("# d body: dR (sum) or dR @ V^T (P @ V), and dV += body^T @ dR")
        seeds: dict[Expr, Expr] = {}
        for j in self.members:
            rd = r.reductions[j]
            if rd.kind == "sum":       # d body = dR_j, broadcast along n
                loop.lines.append(f"db{j} = tl.where(mask_mn, dr{j}, 0.0)")
            else:                      # d body = dR_j @ V_j^T;  dV_j += body^T @ dR_j
                v, vdt = self.dot_operand(rd.v, CTX_V, loop)
                p = full_tile(em.emit(rd.body, CTX_S, loop), rd.body, CTX_S, r)
                dr = self.cast(f"dr{j}", vdt)
                loop.lines += [
                    f"db{j} = tl.where(mask_mn, {self.tl_dot(dr, f'tl.trans({v})', vdt)}, 0.0)",
                    f"p{j} = {self.cast(f'tl.where(mask_mn, {p}, 0.0)', vdt)}",
                    f"{self.acc('dv', rd.v)} += {self.tl_dot(f'tl.trans(p{j})', dr, vdt)}",
                ]
            seeds[rd.body] = seeds[rd.body] + tile(f"db{j}") if rd.body in seeds else tile(f"db{j}")
        return seeds

    def tile_body(self, loop: Block) -> None:
        r, em = self.r, self.em
        self.row_values(loop)
        em.dot_names, operands = {}, {}
        used = sorted(set().union(*(refs(r.reductions[j].body, "dot") for j in self.members)))
        loop.lines.append("# recompute the score tiles")
        for i in used:
            q, qdt = self.dot_operand(r.dots[i].q, CTX_Q, loop)
            k, kdt = self.dot_operand(r.dots[i].k, CTX_K, loop)
            loop.lines.append(f"qk{i} = {self.tl_dot(q, k, qdt)}")
            em.dot_names[i], operands[i] = f"qk{i}", (q, qdt, k, kdt)
        adjoints = vjp(self.body_seeds(loop))
        loop.lines.append("# reverse through the bodies: loaded biases and tables, then dS -> dK, dQ")
        scatter(self.em, adjoints, CTX_S, loop)             # (the reductions read are constant shifts)
        for i in used:
            if dot(i) not in adjoints:
                continue        # no gradient reaches this score tile (e.g. floor(s))
            q, qdt, k, kdt = operands[i]
            ds = em.emit(adjoints[dot(i)], CTX_S, loop)
            loop.lines += [
                # out-of-range keys can score exp(+large) when the shift is a finite fill (-1e9):
                # 0 * inf there would reach dQ through K's zero padding
                f"ds{i} = tl.where(mask_mn, tl.broadcast_to({ds}, [BLOCK_M, BLOCK_N]), 0.0)",
                f"{self.acc('dk', r.dots[i].k)} += {self.tl_dot(f'tl.trans({q})', self.cast(f'ds{i}', qdt), qdt)}",
                f"dq{i} = {self.tl_dot(self.cast(f'ds{i}', kdt), f'tl.trans({k})', kdt)}",
            ]
            scatter(self.em, vjp({r.dots[i].q: tile(f"dq{i}")}), CTX_Q, loop)

    def acc(self, kind: str, e: Expr) -> str:
        """Register accumulator of the gradient of a K (dk, [DK, N]) or V (dv, [N, DV]) operand,
        one per distinct expression (DiffAttn's two P @ V products share one dV)."""
        accs = self.accs.setdefault(kind, {})
        if e not in accs:
            accs[e] = f"{kind}{len(accs)}"
            shape = "[BLOCK_DK, BLOCK_N]" if kind == "dk" else "[BLOCK_N, BLOCK_DV]"
            self.outer.lines.append(f"{accs[e]} = tl.zeros({shape}, dtype=tl.float32)")
        return accs[e]

    # -- whole kernel -------------------------------------------------------------------------
    def query_loop(self) -> list[str]:
        """The loop over query blocks. With a useful mask it runs over [first live, last live]
        query block of this key block only — the forward's dead predicate, interval-tested for
        every query block at once (a skipped tile contributes exactly zero to every gradient)."""
        loop = Block(parent=self.outer)
        loop.lines += ["offs_m = start_m + tl.arange(0, BLOCK_M)", "mask_m = offs_m < M"]
        self.tile_body(loop)
        dead = dead_predicate(self.r, self.r.passes()[0])
        bounds = "0, M, BLOCK_M"
        if self.sparse and useful(dead):
            scan = ["pid_m = tl.arange(0, SCAN_BLOCKS)     # every query block, as a vector",
                    "mblk_valid = pid_m < tl.cdiv(M, BLOCK_M)",
                    "m_lo = pid_m * BLOCK_M",
                    "m_hi = tl.minimum(m_lo + BLOCK_M, M) - 1"]
            iw = IntervalWriter(self.r, self.stats, scan, self.em.fresh, {"m": "mblk_valid", "n": "blk_valid"})
            live = iw.live(dead)
            lo, hi = self.em.fresh("lo"), self.em.fresh("hi")
            self.outer.lines += [f"# block sparsity: visit only query blocks where not {short_expr(dead)}", *scan,
                                 f"mblk_live = ({live}) & mblk_valid & blk_valid",
                                 f"{lo} = tl.min(tl.where(mblk_live, pid_m, SCAN_BLOCKS), 0)",
                                 f"{hi} = tl.max(tl.where(mblk_live, pid_m, -1), 0) + 1"]
            bounds = f"{lo} * BLOCK_M, {hi} * BLOCK_M, BLOCK_M"
        return ([f"for start_m in range({bounds}):"]
                + ["    " + x for x in loop.lines])

    def signature(self) -> list[str]:
        args = []
        for i, x in enumerate(self.r.inputs):
            args.append(f"in{i}_ptr")
            args += [f"in{i}_s{d}" for d in range(len(x.shape))]
        for i in self.grads:
            args.append(f"g{i}_ptr")
            args += [f"g{i}_s{d}" for d in range(len(self.r.inputs[i].shape))]
        args += ["rowstats_ptr", "drow_ptr", "rowstats_sb", "rowstats_sm"]
        for k, st in enumerate(self.stats):
            args += [f"aux{k}_min", f"aux{k}_max"]
            args += [f"aux{k}_s{d}" for d in range(len(self.r.inputs[st.input].shape))]
        args += [f"B{d}" for d in range(len(self.r.batch))] + ["M", "N"]
        return args + ["DK: tl.constexpr", "DV: tl.constexpr", "SCAN_BLOCKS: tl.constexpr",
                       "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr", "BLOCK_DK: tl.constexpr",
                       "BLOCK_DV: tl.constexpr"]

    def write(self) -> str:
        out = self.outer
        out.lines += [
            "pid_n = tl.program_id(0)", *batch_index(len(self.r.batch)),
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
        loop = self.query_loop()
        out.lines += loop
        out.lines.append("# gradients of the K and V operands, accumulated over all query blocks")
        for e, name in self.accs.get("dk", {}).items():
            scatter(self.em, vjp({e: tile(name)}), CTX_K, out)
        for e, name in self.accs.get("dv", {}).items():
            scatter(self.em, vjp({e: tile(name)}), CTX_V, out)
        body = "\n".join("    " + line for line in out.lines)
        sig = ",\n".join("    " + a for a in self.signature())
        doc = "\n".join("    # " + line for line in self.r.describe(sizes=False).splitlines())
        source = (f"@triton.jit\ndef {self.name}(\n{sig},\n):\n{doc}\n{body}\n"
                  + row_gradient_kernel(self.r, f"{self.name}_rows"))
        return prelude(source) + source


def generate_backward(region: Region, name: str, allow_tf32: bool = False, interpret: bool = False,
                      sparse: bool = True):
    """Triton source of the backward kernels (``name``: the tile kernel; ``name_rows``: the row
    gradients it reads, launched first) and the per-block statistics the tile kernel's sparsity
    scan reads; raises CodegenError (the reason) when the region needs the reference backward."""
    reason = backward_support(region)
    if reason:
        raise CodegenError(reason)
    w = BackwardWriter(region, name, allow_tf32, interpret, sparse)
    return w.write(), w.stats
