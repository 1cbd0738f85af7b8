"""The generated backward at run time (``codegen/backward.py``): the gradient tensors and the
three launches — row gradients, then the dK/dV kernel over key blocks, then the dQ kernel over
query blocks. The two tile kernels take independent configs (``CompiledRegion.backward`` picks,
tunes and shrinks them separately).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..codegen.backward import KernelStats
from ..codegen.gradients import GradPlan
from ..ir import Region
from ..tune import Config, cdiv, head_block, pow2
from . import descriptors
from .buffers import unwritten


@dataclass
class BackwardKernels:
    region: Region
    plan: GradPlan
    stats: KernelStats
    rows: object          # the @triton.jit functions
    dkdv: object
    dq: object

    def buffers(self, inputs: list[torch.Tensor], kernel: str | None = None) -> dict[int, torch.Tensor]:
        """What the kernels (``kernel`` alone: ``"dkdv"`` or ``"dq"``; default all) write each
        gradient into: ``empty_like(x)`` where one program owns each address (a store in x's
        dtype, ``plan.stored``), fp32 zeros for atomic adds (``zeros_like(x)`` itself when x is
        fp32: no copy afterwards)."""
        bufs = {}
        for i in self.plan.written(kernel):
            x = inputs[i]
            if i in self.plan.stored:
                bufs[i] = unwritten(torch.empty_like(x))
            elif x.dtype == torch.float32:
                bufs[i] = torch.zeros_like(x)
            else:
                bufs[i] = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return bufs

    @staticmethod
    def results(inputs: list[torch.Tensor], bufs: dict[int, torch.Tensor]) -> list[torch.Tensor | None]:
        """Each gradient in its input's dtype and layout (what the fake implementation promises);
        None for integer and bool inputs (ids, masks), which have none."""
        out = []
        for i, x in enumerate(inputs):
            g = bufs.get(i)
            if g is None:
                out.append(torch.zeros_like(x) if x.is_floating_point() else None)
            elif g.dtype == x.dtype and g.stride() == x.stride():
                out.append(g)
            else:
                out.append(torch.empty_like(x).copy_(g))
        return out

    def common(self, inputs, bufs, kernel: str, rowstats, drow, ddot, out=None, dout=None) -> list:
        r, args = self.region, []
        for x in inputs:
            args += [x, *x.stride()]
        for i in self.plan.written(kernel):
            args += [bufs[i], *bufs[i].stride()]
        if dout is not None:        # the row kernel: the forward's output and its gradient
            args += [out, *out.stride(), dout, *dout.stride()]
        return args + [rowstats, drow, r.M * rowstats.shape[-1], rowstats.shape[-1], ddot, *ddot.stride()[:2]]

    def launch_rows(self, inputs, rowstats, out, grad, bufs, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
        """dL/dr_j: of the row sums into a tensor laid out like the row statistics (only the
        columns the tile kernels read are written, so it needs no zero fill), of the P @ V
        products into their own [batch, M, width] tensor (``codegen.backward.DotGrads``).
        ``out``: the forward's output, from which a plain softmax's product is recomputed
        (``ir.region.from_output``)."""
        r, dg = self.region, self.stats.dot_grads
        drow = unwritten(torch.empty_like(rowstats))
        ddot = unwritten(torch.empty((math.prod(r.batch), r.M, dg.width), dtype=dg.dtype, device=rowstats.device))
        args = self.common(inputs, bufs, "rows", rowstats, drow, ddot, out=out, dout=grad) + [*r.batch, r.M]
        self.rows[(cdiv(r.M, cfg.BLOCK_M), math.prod(r.batch))](
            *args, DV=r.DV, BLOCK_M=cfg.BLOCK_M, BLOCK_DV=head_block(r.DV), num_warps=cfg.num_warps)
        return drow, ddot

    def launch_dkdv(self, inputs, rowstats, drows, bufs, block_stats: dict, cfg: Config) -> None:
        from .op import block_stat_args, launch_kernel
        r = self.region
        args = self.common(inputs, bufs, "dkdv", rowstats, *drows)
        args += block_stat_args(self.stats.dkdv, inputs, block_stats) + [*r.batch, r.M, r.N]
        tma = descriptors.flag(self.stats.tma_dkdv, inputs)
        launch_kernel(self.dkdv, (cdiv(r.N, cfg.BLOCK_N), math.prod(r.batch)), args,
                      dict(DK=r.DK, DV=r.DV, SCAN_BLOCKS=pow2(cdiv(r.M, cfg.BLOCK_M)), BLOCK_DK=head_block(r.DK),
                           BLOCK_DV=head_block(r.DV), **cfg.as_kwargs(), **({} if tma is None else {"TMA": tma})),
                      inputs[0].device if tma else None)

    def launch_dq(self, inputs, rowstats, drows, bufs, block_stats: dict, cfg: Config) -> None:
        from .op import block_stat_args, launch_kernel, launch_meta
        r = self.region
        args = self.common(inputs, bufs, "dq", rowstats, *drows)
        args += block_stat_args(self.stats.dq, inputs, block_stats) + [*r.batch, r.M, r.N]
        tma = descriptors.flag(self.stats.tma_dq, inputs)
        launch_kernel(self.dq, (cdiv(r.M, cfg.BLOCK_M), math.prod(r.batch)), args, launch_meta(r, cfg, tma=tma),
                      inputs[0].device if tma else None)
