"""The generated backward at run time (``codegen/backward.py``): the gradient tensors and the
three launches — row gradients, then the dK/dV kernel over key blocks, then the dQ kernel over
query blocks (and, right after the row gradients, the sums kernel where a later pass reads sums). The two tile kernels take independent configs (``CompiledRegion.backward`` picks,
tunes and shrinks them separately).
"""
from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .. import _compat
from ..codegen.backward import KernelStats
from ..codegen.emit import CodegenError
from ..codegen.gluon import gluon_pays
from ..codegen.gluon_backward import generate_gluon_tile, tiles_support
from ..codegen.gradients import GROUP_MODES, GradPlan
from ..ir import Region
from ..tune import Config, cdiv, head_block, pow2
from . import background, descriptors, gluon
from .buffers import unwritten
from .cache import load_module, source_hash


def fused_dq() -> bool:
    """``FLASHLIGHT_ATOMIC_DQ=1``: backward kernels generated from now on add dQ in the dK/dV
    kernel with fp32 atomics (``GradPlan.fused_dq``) instead of a dQ kernel. Off by default: on
    the H200 its dK/dV kernel alone took 2.1-3.6x the two-kernel dK/dV and dQ (design.md,
    "Fused dQ, again")."""
    return os.environ.get("FLASHLIGHT_ATOMIC_DQ", "0") == "1"


def group_loop() -> str:
    """``FLASHLIGHT_GROUP_LOOP`` (``gradients.GROUP_MODES``): backward kernels generated from now
    on loop over GQA's query heads in one dK/dV program (``auto``, the default: where that leaves
    enough programs; ``1``: wherever correct) or add each head's dK and dV with atomics (``0``)."""
    mode = os.environ.get("FLASHLIGHT_GROUP_LOOP", "auto")
    if mode not in GROUP_MODES:
        raise ValueError(f"FLASHLIGHT_GROUP_LOOP={mode!r}: one of {', '.join(GROUP_MODES)}")
    return mode


@dataclass
class BackwardKernels:
    region: Region
    stats: KernelStats    # and the gradient plan the kernels were generated from (``plan``)
    rows: object          # the @triton.jit functions
    dkdv: object
    dq: object
    sums: object = None   # the row gradients of sums a later pass reads (``codegen.backward.SumsWriter``)
    metas: dict = field(default_factory=dict)      # (kernel, config, TMA) -> (grid, launch_meta)
    scans: dict = field(default_factory=lambda: {"dkdv": True, "dq": True, "sums": True})   # reads SCAN_BLOCKS
    gdkdv: background.Tier = field(default_factory=background.Tier)     # the Gluon tile kernels (Hopper)
    gdq: background.Tier = field(default_factory=background.Tier)

    @property
    def plan(self) -> GradPlan:
        return self.stats.plan

    def tier(self, kernel: str) -> background.Tier:
        """The Gluon ``kernel``'s ("dkdv", "dq") tier over the Triton one."""
        return self.gdkdv if kernel == "dkdv" else self.gdq

    @functools.cached_property
    def writes(self) -> dict[str | None, list[int]]:
        """``plan.written`` per kernel (None: any), fixed with the plan: read on every launch."""
        return {kernel: self.plan.written(kernel) for kernel in (None, "rows", "dkdv", "dq", "sums")}

    @functools.cached_property
    def ddot_shape(self) -> tuple[int, int, int]:
        r = self.region
        return math.prod(r.batch), r.M, self.stats.dot_grads.width

    TILES = ("dkdv", "dq")

    @functools.cached_property
    def tiles(self) -> tuple[str, ...]:
        """The tile kernels there are: no dQ kernel where the dK/dV kernel adds dQ
        (``GradPlan.fused_dq``), no dK/dV kernel where the dQ kernel adds dK and dV
        (``GradPlan.fused_kv``: partial sums over the keys)."""
        return ("dkdv",) if self.plan.fused_dq else ("dq",) if self.plan.fused_kv else self.TILES

    def needed_kernels(self, needed) -> tuple[str, ...]:
        """The tile kernels that write a gradient in ``needed`` (a flag per input; None: all)."""
        if needed is None:
            return self.tiles
        return tuple(kernel for kernel in self.tiles if any(needed[i] for i in self.writes[kernel]))

    def buffers(self, inputs: list[torch.Tensor], kernels: str | tuple[str, ...] = TILES,
                device: str | None = None) -> dict[int, torch.Tensor]:
        """What the row kernel and the tile ``kernels`` (``"dkdv"``, ``"dq"``; one name: that
        kernel alone) write each gradient into: ``empty_like(x)`` where one program owns each
        address (a store in x's dtype, ``plan.stored``), fp32 zeros for atomic adds
        (``zeros_like(x)`` itself when x is fp32: no copy afterwards). A stored gradient that
        kernels not in ``kernels`` write slices of (a packed qkv's; a config timed alone) starts
        as zeros, so what the others leave is defined, and so does one stored per tile
        (``plan.zeroed``: skipped tiles write nothing). ``device="meta"``: the same layouts
        without memory (what a compile specialises on)."""
        kernels = (kernels,) if isinstance(kernels, str) else ("rows", *kernels)
        written = sorted({i for kernel in kernels for i in self.writes[kernel]})
        bufs = {}
        for i in written:
            x = inputs[i]
            if i in self.plan.zeroed or i in self.plan.stored and any(
                    i in self.writes[k] for k in ("rows", *self.TILES) if k not in kernels):
                bufs[i] = torch.zeros_like(x, device=device)
            elif i in self.plan.stored:
                bufs[i] = unwritten(torch.empty_like(x, device=device))
            elif x.dtype == torch.float32:
                bufs[i] = torch.zeros_like(x, device=device)
            else:
                bufs[i] = torch.zeros(x.shape, dtype=torch.float32, device=device or x.device)
        return bufs

    @staticmethod
    def results(inputs: list[torch.Tensor], bufs: dict[int, torch.Tensor],
                needed: Sequence[bool] | None = None) -> list[torch.Tensor | None]:
        """Each gradient in its input's dtype and layout (what the fake implementation promises);
        None for integer and bool inputs (ids, masks), which have none, and for inputs not
        ``needed``."""
        out = []
        for i, x in enumerate(inputs):
            g = bufs.get(i)
            if needed is not None and not needed[i]:
                out.append(None)
            elif g is None:
                out.append(torch.zeros_like(x) if x.is_floating_point() else None)
            elif g.dtype == x.dtype and g.stride() == x.stride():
                out.append(g)
            else:
                out.append(torch.empty_like(x).copy_(g))
        return out

    def common(self, inputs, bufs, kernel: str, rowstats, drow, ddot, out=None, dout=None, row_grads=()) -> list:
        r, args = self.region, []
        for x in inputs:
            args += [x, *x.stride()]
        for i in self.writes[kernel]:
            args += [bufs[i], *bufs[i].stride()]
        if dout is not None:        # the row kernel: the forward's output and its gradient
            args += [out, *out.stride(), dout, *dout.stride()]
            for g in row_grads:     # and the extra row outputs' (*batch, M)
                args += [g, *g.stride()]
        return args + [rowstats, drow, r.M * rowstats.shape[-1], rowstats.shape[-1], ddot, *ddot.stride()[:2]]

    def meta(self, kernel: str, cfg: Config, tma: bool | None = None) -> tuple[tuple, dict]:
        """The grid and the constexprs of ``kernel`` (``"rows"``, ``"dkdv"``, ``"dq"``) under
        ``cfg``: computed once per config, like the forward's ``CompiledRegion.metas`` (host time
        on every call)."""
        key = (kernel, cfg, tma)
        if key not in self.metas:
            self.metas[key] = self.grid_and_meta(kernel, cfg, tma)
        return self.metas[key]

    def grid_and_meta(self, kernel: str, cfg: Config, tma: bool | None) -> tuple[tuple, dict]:
        r = self.region
        batch = math.prod(r.batch)
        if kernel == "rows":
            return (cdiv(r.M, cfg.BLOCK_M), batch), dict(DV=r.DV, BLOCK_M=cfg.BLOCK_M, BLOCK_DV=head_block(r.DV),
                                                          num_warps=cfg.num_warps)
        if kernel == "dkdv":        # over key blocks
            return (cdiv(r.N, cfg.BLOCK_N), self.plan.programs(r.batch)), dict(
                DK=r.DK, DV=r.DV, SCAN_BLOCKS=pow2(cdiv(r.M, cfg.BLOCK_M)) if self.scans["dkdv"] else 1,
                BLOCK_DK=head_block(r.DK), BLOCK_DV=head_block(r.DV), **cfg.as_kwargs(),
                **({} if tma is None else {"TMA": tma}))
        # dQ and the sums' walks, over query blocks: the forward's constexprs
        return (cdiv(r.M, cfg.BLOCK_M), batch), op.launch_meta(r, cfg, tma=tma, scan=self.scans[kernel])

    def launch_rows(self, inputs, rowstats, out, grad, bufs, cfg: Config, row_grads=()) -> tuple[torch.Tensor, torch.Tensor]:
        """dL/dr_j: of the row sums into a tensor laid out like the row statistics (only the
        columns the tile kernels read are written, so it needs no zero fill), of the P @ V
        products into their own [batch, M, width] tensor (``codegen.backward.DotGrads``).
        ``out``: the forward's output, from which a plain softmax's product is recomputed
        (``ir.region.from_output``). ``row_grads``: the gradients of the extra row outputs."""
        drow, ddot = self.row_outputs(rowstats)
        grid, meta = self.meta("rows", cfg)
        self.rows[grid](*self.rows_args(inputs, rowstats, out, grad, bufs, drow, ddot, row_grads), **meta)
        return drow, ddot

    def row_outputs(self, rowstats: torch.Tensor, device: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The row kernel's outputs: the sums' row gradients (laid out like the row statistics)
        and the products' ([batch, M, width]); ``device="meta"``: their layouts alone."""
        drow = unwritten(torch.empty_like(rowstats, device=device))
        ddot = unwritten(torch.empty(self.ddot_shape, dtype=self.stats.dot_grads.dtype, device=device or rowstats.device))
        return drow, ddot

    def rows_args(self, inputs, rowstats, out, grad, bufs, drow, ddot, row_grads=()) -> list:
        return self.common(inputs, bufs, "rows", rowstats, drow, ddot, out=out, dout=grad, row_grads=row_grads) + \
            [*self.region.batch, self.region.M]

    def prefetch(self, inputs, rowstats, out, block_stats: dict, configs: dict) -> list:
        """The three kernels' compiles for a backward of these inputs, each on a compile thread
        (``runtime.background``), started at the region's first differentiable forward: the
        first backward then waits for what is left of them instead of compiling the three one
        after the other. Each is compiled for the arguments its launch will have — the output
        stands in for its gradient (same shape and dtype; a gradient laid out otherwise only
        compiles again), meta tensors of the same layouts for the gradients and row gradients (a
        compile reads a tensor's dtype and address alignment: a meta tensor's address is 0, as
        Triton's own warmup stand-ins', and the backward's fresh buffers are aligned; no memory
        is taken). A gradient whose layout differs from the output's (``out.sum()``'s expanded
        one) makes the row kernel compile again at the backward: time, not results.
        ``configs``: each kernel's launch config (``rows``, ``dkdv``, ``dq``). Returns the
        futures by kernel."""
        bufs = self.buffers(inputs, device="meta")
        drow, ddot = self.row_outputs(rowstats, device="meta")
        jobs = {"rows": (self.rows, *self.meta("rows", configs["rows"]),
                         self.rows_args(inputs, rowstats, out, out, bufs, drow, ddot))}
        for kernel in self.needed_kernels(None) + (("sums",) if self.sums is not None else ()):
            fn, grid, meta, _ = self.tile_launch(kernel, inputs, configs[kernel])
            jobs[kernel] = (fn, grid, meta, self.tile_args(kernel, inputs, rowstats, (drow, ddot), bufs, block_stats))
        return {kernel: background.submit(_compat.warm, inputs[0].device, fn, grid, args, meta)
                for kernel, (fn, grid, meta, args) in jobs.items()}

    def launch_dkdv(self, inputs, rowstats, drows, bufs, block_stats: dict, cfg: Config) -> None:
        self.launch_tile("dkdv", inputs, rowstats, drows, bufs, block_stats, cfg)

    def launch_dq(self, inputs, rowstats, drows, bufs, block_stats: dict, cfg: Config) -> None:
        self.launch_tile("dq", inputs, rowstats, drows, bufs, block_stats, cfg)

    def tile_args(self, kernel: str, inputs, rowstats, drows, bufs, block_stats: dict) -> list:
        """The positional arguments of a tile kernel (``"dkdv"``, ``"dq"`` or ``"sums"``)."""
        r = self.region
        args = self.common(inputs, bufs, kernel, rowstats, *drows)
        return args + op.block_stat_args(self.stats.of(kernel)[0], inputs, block_stats) + [*r.batch, r.M, r.N]

    def tile_launch(self, kernel: str, inputs, cfg: Config) -> tuple:
        """A tile kernel's function, grid, constexprs and TMA flag for these inputs under ``cfg``."""
        fn = {"dkdv": self.dkdv, "dq": self.dq, "sums": self.sums}[kernel]
        tma = descriptors.flag(self.stats.of(kernel)[1], inputs)
        return (fn, *self.meta(kernel, cfg, tma), tma)

    def launch_tile(self, kernel: str, inputs, rowstats, drows, bufs, block_stats: dict, cfg: Config) -> None:
        """One tile kernel: ``"dkdv"`` over key blocks, or ``"dq"`` or ``"sums"`` over query blocks."""
        args = self.tile_args(kernel, inputs, rowstats, drows, bufs, block_stats)
        fn, grid, meta, tma = self.tile_launch(kernel, inputs, cfg)
        op.launch_kernel(fn, grid, args, meta, inputs[0].device if tma else None)

    def run_tile(self, kernel: str, inputs, rowstats, drows, bufs, block_stats: dict, triton_launch) -> None:
        """The ``kernel`` ("dkdv": dK and dV; "dq") of one backward: the Gluon kernel
        (``codegen/gluon_backward.py``) where it applies and is compiled, else ``triton_launch()``
        (the Triton kernel under its config), after whose first launch the Gluon kernel compiles
        in the background (``background.Tier``)."""
        ddot = drows[1]
        applies = self.gluon_tile_applies(kernel, inputs, rowstats, drows, bufs)
        tier = self.tier(kernel)
        if applies:
            args = self.tile_args(kernel, inputs, rowstats, drows, bufs, block_stats)
            if tier.launch(lambda: compile_gluon_tile(self, kernel),
                           lambda fn: gluon.launch_tile(kernel, fn, self.region, self.plan, args, inputs, ddot)):
                return
        triton_launch()
        if applies:
            tier.submit_after(compile_gluon_tile_for, inputs[0].device, self, kernel, args, inputs, ddot)

    def gluon_tile_applies(self, kernel: str, inputs, rowstats, drows, bufs) -> bool:
        """May this backward run the Gluon ``kernel``: sm_90, ``FLASHLIGHT_GLUON_DKDV`` / ``_DQ``
        (default ``1``: only where the Gluon forward measured faster; ``all``: wherever it
        applies), a region it supports, a usable layout of the inputs, the row statistics and
        gradients and the gradient tensors it writes (``runtime.gluon.tiles_usable``), unless it
        failed? The cheap tests first: this runs on every backward."""
        mode = gluon.mode(kernel)
        if (self.tier(kernel).kernel is False or mode == "0" or not gluon.runs_on(inputs[0].device)
                or (mode != "all" and self.gluon_tiles_slower)
                or self.gluon_tiles_unsupported):
            return False
        r = self.region
        operands = (r.dots[0].k, r.reductions[2].v) if kernel == "dkdv" else (r.dots[0].q, )
        grads = [bufs[e.args[0]] for e in operands]
        return gluon.tiles_usable(kernel, r, inputs, drows[1], grads, [rowstats, drows[0]])

    @functools.cached_property
    def gluon_tiles_unsupported(self) -> str:
        if self.plan.fused_dq:
            return "the dK/dV kernel adds dQ (FLASHLIGHT_ATOMIC_DQ): the Gluon one does not"
        if self.plan.fused_kv:
            return "partial sums over the keys: the dQ kernel adds dK and dV, the Gluon one does not"
        return tiles_support(self.region, self.plan)

    @functools.cached_property
    def gluon_tiles_slower(self) -> str:
        """Where the Gluon forward is not the default (``gluon_pays``), neither are these kernels
        (the same schedule: it needs long loops of long products)."""
        return gluon_pays(self.region)


def compile_gluon_tile(k: BackwardKernels, kernel: str):
    """The region's Gluon ``kernel`` ("dkdv", "dq"; ``codegen.gluon_backward``; a ``FastLaunch``), or None. Its
    scan reads the same block statistics as the Triton kernel's (checked here)."""
    placeholder = f"fl_g{kernel}"
    try:
        source, stats = generate_gluon_tile(k.region, placeholder, kernel, k.plan)
        if stats != (k.stats.dkdv if kernel == "dkdv" else k.stats.dq):
            raise CodegenError(f"the Gluon {kernel} kernel's block statistics differ from the Triton kernel's")
    except CodegenError:
        if os.environ.get("FLASHLIGHT_STRICT") == "1":
            raise
        return None         # the Triton kernel serves
    name = f"{placeholder}_{source_hash(source)}"
    module, _ = load_module(name, source.replace(placeholder, name))
    return _compat.fast_launch(getattr(module, name), op.interpreting())


def compile_gluon_tile_for(k: BackwardKernels, kernel: str, args: list, inputs: list[torch.Tensor], ddot: torch.Tensor):
    """``compile_gluon_tile``, then its Triton compile for this launch (the background task)."""
    fn = compile_gluon_tile(k, kernel)
    if fn is not None:
        gluon.compile_tile_for(kernel, fn, k.region, k.plan, args, inputs, ddot)
    return fn


# at the end: op imports this module (a function-level import would cost ~1 µs on every launch); its launch
# helpers are looked up there per call, where tests spy on them
from . import op  # noqa: E402
