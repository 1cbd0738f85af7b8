"""Forward kernel generation: one Triton program per (M block, batch index), a loop over N blocks
per pass, online reduction state in fp32 registers, ``tl.dot`` for every contraction.

The loop nest, the number of score tiles, the reduction states and the epilogue all come from
the region IR; nothing here knows what "causal" or "ALiBi" is.
"""
from __future__ import annotations

import torch

from ..ir import Expr, Region, refs
from ..sparsity import BlockStat, IntervalWriter, dead_predicate, useful
from .emit import HELPERS, Block, CodegenError, Ctx, Emitter

TL_DTYPE = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32"}
NEG_INF = 'float("-inf")'


def _ctx(name: str, rows: tuple[str, str], cols: tuple[str, str]) -> Ctx:
    """A tile context: ``rows`` = (var, offsets) laid along axis 0, ``cols`` along axis 1."""
    (rv, ro), (cv, co) = rows, cols
    return Ctx(name,
               vars={rv: f"{ro}[:, None]", cv: f"{co}[None, :]"},
               masks={rv: f"mask_{rv}[:, None]", cv: f"mask_{cv}[None, :]"})


CTX_Q = _ctx("q", ("m", "offs_m"), ("dk", "offs_dk"))
CTX_K = _ctx("k", ("dk", "offs_dk"), ("n", "offs_n"))       # K is loaded transposed: [DK, N]
CTX_S = _ctx("s", ("m", "offs_m"), ("n", "offs_n"))
CTX_V = _ctx("v", ("n", "offs_n"), ("dv", "offs_dv"))
CTX_O = _ctx("o", ("m", "offs_m"), ("dv", "offs_dv"))


def operand_dtype(e: Expr, region: Region, interpret: bool) -> torch.dtype:
    """Tensor-core operand type of a dot operand: that of the tensor it reads (fp32 otherwise).
    Triton 3.6's interpreter computes bf16 dots wrongly, so there bf16 operands go as fp32."""
    for i in sorted(refs(e, "load")):
        dt = region.inputs[i].dtype
        if dt in TL_DTYPE:
            return torch.float32 if interpret and dt == torch.bfloat16 else dt
    return torch.float32


class KernelWriter:
    def __init__(self, region: Region, name: str, allow_tf32: bool = False, interpret: bool = False,
                 sparse: bool = True):
        self.r, self.name, self.interpret, self.sparse = region, name, interpret, sparse
        self.precision = '"tf32"' if allow_tf32 else '"ieee"'
        self.em = Emitter()
        self.outer = Block()
        self.stats: list[BlockStat] = []

    # -- operands of tl.dot -----------------------------------------------------------------
    def dot_operand(self, e: Expr, ctx: Ctx, block: Block) -> tuple[str, torch.dtype]:
        dt = operand_dtype(e, self.r, self.interpret)
        if e.op == "load":   # a bare load keeps its storage type: no round trip through fp32
            raw = self.em.load(e, ctx, block)
            return (raw if self.r.inputs[e.args[0]].dtype == dt else f"{raw}.to({TL_DTYPE[dt]})"), dt
        val = self.em.emit(e, ctx, block)
        return (val if dt == torch.float32 else f"{val}.to({TL_DTYPE[dt]})"), dt

    def tl_dot(self, a: str, b: str, dt: torch.dtype, acc: str | None = None) -> str:
        prec = f", input_precision={self.precision}" if dt == torch.float32 else ""
        acc = f", {acc}" if acc else ""
        return f"tl.dot({a}, {b}{acc}{prec})"

    # -- one pass over N ----------------------------------------------------------------------
    def write_pass(self, members: list[int]) -> None:
        r, em, out = self.r, self.em, self.outer
        loop = Block(parent=out)
        em.loop_reds = set(members)
        reds = [r.reductions[j] for j in members]
        for j, red in zip(members, reds):
            init = NEG_INF if red.kind == "max" else "0.0"
            cols = "BLOCK_DV" if red.kind == "dot" else "1"
            out.lines.append(f"r{j} = tl.full([BLOCK_M, {cols}], {init}, tl.float32)")
        loop.lines.append("offs_n = start_n + tl.arange(0, BLOCK_N)")
        loop.lines.append("mask_n = tl.full([BLOCK_N], 1, tl.int1) if EVEN_N else offs_n < N")
        needed = set().union(*(refs(x.body, "dot") for x in reds))
        em.dot_names = {}
        for i in sorted(needed):
            q, qdt = self.dot_operand(r.dots[i].q, CTX_Q, loop)
            k, _ = self.dot_operand(r.dots[i].k, CTX_K, loop)
            loop.lines.append(f"qk{i} = {self.tl_dot(q, k, qdt)}")
            em.dot_names[i] = f"qk{i}"
        for j, red in zip(members, reds):     # running maxima first: the others rescale by them
            if red.kind != "max":
                continue
            body = em.emit(red.body, CTX_S, loop)
            loop.lines += [
                f"r{j}_new = tl.maximum(r{j}, tl.max(tl.where(mask_n[None, :], {body}, {NEG_INF}), 1, keep_dims=True))",
                f"r{j}_safe = tl.where(r{j}_new == {NEG_INF}, 0.0, r{j}_new)  # exp(-inf - 0) = 0, not NaN",
                f"alpha{j} = tl.exp(r{j} - r{j}_safe)  # rescale of sums taken under the old max",
            ]
            em.red_names[j] = f"r{j}_safe"
        for j, red in zip(members, reds):
            if red.kind == "max":
                continue
            body = em.emit(red.body, CTX_S, loop)
            scaled = f"r{j} * alpha{red.online}" if red.online is not None else f"r{j}"
            contrib = f"tl.where(mask_n[None, :], {body}, 0.0)"
            if red.kind == "sum":
                loop.lines.append(f"r{j} = {scaled} + tl.sum({contrib}, 1, keep_dims=True)")
            else:
                v, vdt = self.dot_operand(red.v, CTX_V, loop)
                p = em.fresh("p")
                loop.lines.append(f"{p} = {contrib}.to({TL_DTYPE[vdt]})")
                loop.lines.append(f"r{j} = {self.tl_dot(p, v, vdt, acc=scaled)}")
        for j, red in zip(members, reds):
            if red.kind == "max":
                loop.lines.append(f"r{j} = r{j}_new")
        out.lines.append(f"for start_n in range({self.block_range(members)}, BLOCK_N):")
        out.lines += ["    " + line for line in loop.lines]
        for j, red in zip(members, reds):
            if red.kind == "max":
                out.lines.append(f"r{j}_s = tl.where(r{j} == {NEG_INF}, 0.0, r{j})")
                em.red_names[j] = f"r{j}_s"
            else:
                em.red_names[j] = f"r{j}"

    def block_range(self, members: list[int]) -> str:
        """Bounds of the N loop: all blocks, or the live ones found by a scalar scan that
        evaluates the pass's dead-predicate with interval arithmetic per block."""
        dead = dead_predicate(self.r, members)
        if not (self.sparse and useful(dead)):
            return "0, N"
        out = self.outer
        scan: list[str] = []
        live = IntervalWriter(self.r, self.stats, scan, self.em.fresh).live(dead)
        first, last = self.em.fresh("first"), self.em.fresh("last")
        out.lines += [
            f"# block sparsity: skip key blocks where {_short(dead)}",
            f"{first} = pid_m * 0 - 1",
            f"{last} = pid_m * 0 - 2",
            "for blk in range(0, tl.cdiv(N, BLOCK_N)):",
            "    n_lo = blk * BLOCK_N",
            "    n_hi = tl.minimum(n_lo + BLOCK_N, N) - 1",
            *("    " + line for line in scan),
            f"    {first} = tl.where(({live}) & ({first} < 0), blk, {first})",
            f"    {last} = tl.where({live}, blk, {last})",
        ]
        return f"tl.maximum({first}, 0) * BLOCK_N, ({last} + 1) * BLOCK_N"

    # -- whole kernel -------------------------------------------------------------------------
    def signature(self) -> list[str]:
        args = []
        for i, x in enumerate(self.r.inputs):
            args.append(f"in{i}_ptr")
            args += [f"in{i}_s{d}" for d in range(len(x.shape))]
        nb = len(self.r.batch)
        args.append("out_ptr")
        args += [f"out_s{d}" for d in range(nb + 2)]
        for k, st in enumerate(self.stats):
            args += [f"aux{k}_min", f"aux{k}_max"]
            args += [f"aux{k}_s{d}" for d in range(len(self.r.inputs[st.input].shape))]
        args += [f"B{d}" for d in range(nb)] + ["M", "N"]
        return args + ["DK: tl.constexpr", "DV: tl.constexpr", "EVEN_M: tl.constexpr", "EVEN_N: tl.constexpr",
                       "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr",
                       "BLOCK_DK: tl.constexpr", "BLOCK_DV: tl.constexpr"]

    def write(self) -> str:
        r, out = self.r, self.outer
        nb = len(r.batch)
        out.lines += ["pid_m = tl.program_id(0)", "pid_b = tl.program_id(1).to(tl.int64)"]
        rest = "pid_b"
        for d in reversed(range(nb)):
            out.lines.append(f"b{d} = {rest} % B{d}")
            if d:
                out.lines.append(f"rest{d} = {rest} // B{d}")
                rest = f"rest{d}"
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
        for p, members in enumerate(r.passes()):
            out.lines.append(f"# pass {p}: reductions {members} over N")
            self.write_pass(members)
        self.em.loop_reds = set()
        self.em.red_names = {j: f"r{j}" for j in range(len(r.reductions))}
        val = self.em.emit(r.out, CTX_O, out)
        offs = [f"b{d} * out_s{d}" for d in range(nb)]
        offs += [f"offs_m[:, None] * out_s{nb}", f"offs_dv[None, :] * out_s{nb + 1}"]
        out.lines.append(f"tl.store(out_ptr + {' + '.join(offs)}, {val}.to(out_ptr.dtype.element_ty), "
                         f"mask=mask_m[:, None] & mask_dv[None, :])")
        body = "\n".join("    " + line for line in out.lines)
        sig = ",\n".join("    " + a for a in self.signature())
        doc = "\n".join("    # " + line for line in str(r).splitlines())
        return (f"import triton\nimport triton.language as tl\n{HELPERS}\n\n@triton.jit\ndef {self.name}(\n{sig},\n):\n"
                f"{doc}\n{body}\n")


def _short(e: Expr, limit: int = 100) -> str:
    text = str(e)
    return text if len(text) <= limit else text[:limit] + "..."


def generate(region: Region, name: str, allow_tf32: bool = False, interpret: bool = False,
             sparse: bool = True) -> tuple[str, list[BlockStat]]:
    """Triton source of the forward kernel for ``region`` and the per-block statistics its
    sparsity scan reads; raises CodegenError if unsupported.
    ``interpret``: the kernel will run under Triton's CPU interpreter."""
    if region.DK is None:
        raise CodegenError("region has no score contraction")
    w = KernelWriter(region, name, allow_tf32, interpret, sparse)
    return w.write(), w.stats
