"""The Gluon forward at run time (``codegen/gluon.py``): when a launch may use it, its tensor
descriptors, and the launch itself. The Triton kernel stays the fallback: every other GPU, the
interpreter, and inputs whose layout the descriptors cannot read.

``FLASHLIGHT_GLUON`` chooses: ``1`` (the default) where it measured faster than the Triton
kernel (``codegen.gluon.gluon_pays``), ``all`` wherever it applies (the GPU tests), ``0`` never
(an A/B in one process: ``benchmarks.run --b-env FLASHLIGHT_GLUON=0``).
"""
from __future__ import annotations

import functools
import math
import os

import torch

from ..codegen.gluon import BLOCK_M, BLOCK_N, DTYPES, MAXNREG, STAGES
from ..ir import Region
from ..tune import cdiv, pow2

def mode() -> str:
    """``FLASHLIGHT_GLUON``: "1", "all" or "0" (read per launch: the tests and A/Bs switch it)."""
    return os.environ.get("FLASHLIGHT_GLUON", "1")


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def hopper(device: torch.device) -> bool:
    """sm_90 (H100, H200): the Gluon kernels use its wgmma and TMA (sm_100 has neither form)."""
    return device.type == "cuda" and _capability(device.index if device.index is not None
                                                 else torch.cuda.current_device()) == (9, 0)


def operand_rows(x: torch.Tensor, n_dim: int, head: int) -> bool:
    """Can one 2-D descriptor [rows, head] read ``x``'s [key, head] tiles for every batch index?
    All of its last dim is the head (a prefix slice's copies would overrun the shared buffers),
    contiguous; its key stride is nonzero (not a broadcast key) and 16-byte aligned; every other
    stride is a multiple of the key stride (the batch offset is then a whole number of rows)."""
    s, n = x.stride(), x.stride(n_dim)
    if x.shape[-1] != head or s[-1] != 1 or n <= 0 or n * x.element_size() % 16 or x.data_ptr() % 16:
        return False
    return (descriptor_rows(x, n_dim) < 2 ** 31
            and all(st % n == 0 for d, st in enumerate(s[:-1]) if d != n_dim and x.shape[d] > 1))


def descriptor_rows(x: torch.Tensor, n_dim: int) -> int:
    """Rows of ``x``'s descriptor: up to the last element it addresses."""
    return sum((size - 1) * st for size, st in zip(x.shape[:-1], x.stride()[:-1])) // x.stride(n_dim) + 1


@functools.lru_cache(maxsize=None)
def _layout(head: int, dtype: torch.dtype):
    """The shared layout of a [BLOCK_N, head] tile (computed once: half a descriptor's host time)."""
    from triton.experimental.gluon import language as gl
    return gl.NVMMASharedLayout.get_default_for([BLOCK_N, head], {torch.bfloat16: gl.bfloat16,
                                                                  torch.float16: gl.float16}[dtype])


def descriptor(x: torch.Tensor, n_dim: int):
    """The [rows, head] descriptor of ``x`` (every element it can address), [BLOCK_N, head] blocks."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    head = x.shape[-1]
    return TensorDescriptor(x, [descriptor_rows(x, n_dim), head], [x.stride(n_dim), 1], [BLOCK_N, head],
                            _layout(head, x.dtype))


def usable(region: Region, inputs: list[torch.Tensor]) -> bool:
    """May this launch run the Gluon kernel? Whole key blocks (a ragged last block's rows would be
    read from the next batch index: masked to -inf, but 0 * a NaN there is NaN), and K and V
    readable as rows (``operand_rows``) in a 16-bit type."""
    k, v = operand(region, inputs, "k"), operand(region, inputs, "v")
    return (region.N % BLOCK_N == 0 and all(x.dtype in DTYPES and operand_rows(x, d, head)
                                            for (x, d), head in ((k, region.DK), (v, region.DV))))


def operand(region: Region, inputs: list[torch.Tensor], which: str) -> tuple[torch.Tensor, int]:
    """The input K (``"k"``) or V is read from, and its key dim."""
    e = region.dots[0].k if which == "k" else region.reductions[2].v
    return inputs[e.args[0]], len(e.args[1]) - 2


def launch_meta(region: Region, inputs: list[torch.Tensor], stats: bool) -> dict:
    """The launch's keyword arguments: K's and V's descriptors, the constexprs, the warps and
    the register cap that the warp-specialised partitions divide."""
    r = region
    return dict(k_desc=descriptor(*operand(r, inputs, "k")), v_desc=descriptor(*operand(r, inputs, "v")),
                DK=r.DK, DV=r.DV, SCAN_BLOCKS=pow2(cdiv(r.N, BLOCK_N)), STATS=stats, BLOCK_M=BLOCK_M,
                BLOCK_N=BLOCK_N, STAGES=STAGES, num_warps=4, maxnreg=MAXNREG)


def grid(region: Region) -> tuple[int, int]:
    return cdiv(region.M, BLOCK_M), math.prod(region.batch)


def launch(kernel, region: Region, args: list, inputs: list[torch.Tensor], stats: bool) -> None:
    """One forward: ``args`` are the Triton kernel's (``op.kernel_args``)."""
    kernel[grid(region)](*args, **launch_meta(region, inputs, stats))


def compile_for(kernel, region: Region, args: list, inputs: list[torch.Tensor], stats: bool) -> None:
    """Compile the kernel for this launch's specialisation without launching it (Triton's
    ``warmup``; ``runtime.background`` runs it on a compile thread)."""
    kernel.warmup(*args, grid=grid(region), **launch_meta(region, inputs, stats))
