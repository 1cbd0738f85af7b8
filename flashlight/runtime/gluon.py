"""The Gluon kernels at run time (``codegen/gluon.py``, ``codegen/gluon_backward.py``): when a
launch may use them, their tensor descriptors, and the launches themselves. The Triton kernels
stay the fallback: every other GPU, the interpreter, and inputs whose layout the descriptors
cannot read.

``FLASHLIGHT_GLUON`` chooses: ``1`` (the default) where the Gluon forward measured faster than
the Triton kernel (``codegen.gluon.gluon_pays``), ``all`` wherever it applies (the GPU tests),
``0`` never (an A/B in one process: ``benchmarks.run --b-env FLASHLIGHT_GLUON=0``).
``FLASHLIGHT_GLUON_DKDV`` and ``FLASHLIGHT_GLUON_DQ`` do the same for the backward's dK/dV and dQ
kernels, whose default is ``1`` too: in session 18's per-kernel profile on the H200
(docs/notes.md) they were faster than the Triton tile kernels only where the Gluon forward is
(causal and ALiBi at D=128: dK/dV 1166 against 1216 µs, dQ 659 against 741), slower at D=64
(document mask dK/dV 309 against 244 µs) and on the document mask at D=128 (462 against 355).
"""
from __future__ import annotations

import functools
import math
import os

import torch

from .._compat import warm
from ..codegen import gluon_backward as gb
from ..codegen.gluon import BLOCK_M, BLOCK_N, DTYPES, MAXNREG, STAGES
from ..codegen.gradients import GradPlan
from ..ir import Region
from ..tune import cdiv, pow2


def mode(kernel: str = "fwd") -> str:
    """``FLASHLIGHT_GLUON`` for the forward, ``FLASHLIGHT_GLUON_DKDV`` / ``_DQ`` for the tile
    kernels ("dkdv", "dq"): "1", "all" or "0" (read per launch: the tests and A/Bs switch them).
    Every default is ``1`` (module doc: measured, session 18)."""
    return os.environ.get("FLASHLIGHT_GLUON" if kernel == "fwd" else f"FLASHLIGHT_GLUON_{kernel.upper()}", "1")


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def runs_on(device: torch.device) -> bool:
    """Can the Gluon kernels run on ``device``: an sm_90 GPU, Triton's interpreter off (it does
    not run Gluon). The one place the runtime asks (tests/test_gluon_emulated.py answers yes on
    the CPU, where its emulator runs them)."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1" and hopper(device)


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
def _layout(rows: int, head: int, dtype: torch.dtype):
    """The shared layout of a [rows, head] tile (computed once: half a descriptor's host time)."""
    from triton.experimental.gluon import language as gl
    return gl.NVMMASharedLayout.get_default_for([rows, head], {torch.bfloat16: gl.bfloat16,
                                                               torch.float16: gl.float16}[dtype])


def descriptor(x: torch.Tensor, n_dim: int, rows: int = BLOCK_N):
    """The [rows, head] descriptor of ``x`` (every element it can address), [rows, head] blocks."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    head = x.shape[-1]
    return TensorDescriptor(x, [descriptor_rows(x, n_dim), head], [x.stride(n_dim), 1], [rows, head],
                            _layout(rows, head, x.dtype))


def usable(region: Region, inputs: list[torch.Tensor]) -> bool:
    """May this launch run the Gluon kernel? Whole key blocks (a ragged last block's rows would be
    read from the next batch index: masked to -inf, but 0 * a NaN there is NaN), and K and V
    readable as rows (``operand_rows``) in a 16-bit type."""
    k, v = operand(region, inputs, "k"), operand(region, inputs, "v")
    return (region.N % BLOCK_N == 0 and all(x.dtype in DTYPES and operand_rows(x, d, head)
                                            for (x, d), head in ((k, region.DK), (v, region.DV))))


def operand(region: Region, inputs: list[torch.Tensor], which: str) -> tuple[torch.Tensor, int]:
    """The input Q (``"q"``), K (``"k"``) or V is read from, and its query or key dim."""
    e = region.dots[0].q if which == "q" else region.dots[0].k if which == "k" else region.reductions[2].v
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
    """Compile the kernel for this launch's specialisation without launching it
    (``_compat.warm``; ``runtime.background`` runs it on a compile thread)."""
    warm(kernel, grid(region), args, launch_meta(region, inputs, stats))


# -- the backward's tile kernels (codegen/gluon_backward.py): "dkdv" and "dq" -------------------
def tiles_usable(kernel: str, region: Region, inputs: list[torch.Tensor], ddot: torch.Tensor,
                 grads: list[torch.Tensor], rows: list[torch.Tensor]) -> bool:
    """May this backward run the Gluon ``kernel`` ("dkdv" or "dq")? Whole query and key blocks
    (``gluon_backward.BLOCKS``), Q, K and V readable as rows (``operand_rows``) in a 16-bit type,
    the product's row gradient ``ddot`` one [batch * M, DV] tile of rows, the tensors the kernel
    writes its gradients into (``grads``) with contiguous 16-byte aligned rows, as its stores
    assume, and the row statistics and row gradients (``rows``) contiguous, as its loads assume."""
    r = region
    bm, bn = gb.BLOCKS[kernel]
    return (r.M % bm == 0 and r.N % bn == 0 and ddot.shape[-1] == r.DV and ddot.dtype in DTYPES
            and all(x.is_contiguous() for x in rows)
            and all(x.dtype in DTYPES and operand_rows(x, d, head)
                    for (x, d), head in ((operand(r, inputs, "q"), r.DK), (operand(r, inputs, "k"), r.DK),
                                         (operand(r, inputs, "v"), r.DV)))
            and all(aligned_rows(g) for g in grads))


def aligned_rows(x: torch.Tensor) -> bool:
    """Last stride 1, the address 16-byte aligned, and every other stride of a dim longer than 1
    a multiple of 8 elements and of 16 bytes (the stores' ``tl.multiple_of(stride, 8)`` hints)."""
    return (x.stride(-1) == 1 and x.data_ptr() % 16 == 0
            and all(st % 8 == 0 and st * x.element_size() % 16 == 0
                    for st, size in zip(x.stride()[:-1], x.shape[:-1]) if size > 1))


def tile_meta(kernel: str, region: Region, inputs: list[torch.Tensor], ddot: torch.Tensor) -> dict:
    """A tile kernel's keyword arguments: the Q, dR, K and V descriptors (of BLOCK_M query rows
    and BLOCK_N key rows), the constexprs, the warps and the register cap."""
    r = region
    bm, bn = gb.BLOCKS[kernel]
    scan = cdiv(r.M, bm) if kernel == "dkdv" else cdiv(r.N, bn)      # the blocks its scan visits
    return dict(q_desc=descriptor(*operand(r, inputs, "q"), rows=bm), do_desc=descriptor(ddot, 1, bm),
                k_desc=descriptor(*operand(r, inputs, "k"), rows=bn), v_desc=descriptor(*operand(r, inputs, "v"), rows=bn),
                DK=r.DK, DV=r.DV, SCAN_BLOCKS=pow2(scan), BLOCK_M=bm, BLOCK_N=bn, STAGES=gb.STAGES, num_warps=4,
                maxnreg=gb.MAXNREG)


def tile_grid(kernel: str, region: Region, plan: GradPlan) -> tuple[int, int]:
    """dK/dV: a program per key block (and batch index, or group of them: ``GradPlan.group``);
    dQ: per query block and batch index."""
    bm, bn = gb.BLOCKS[kernel]
    if kernel == "dkdv":
        return cdiv(region.N, bn), plan.programs(region.batch)
    return cdiv(region.M, bm), math.prod(region.batch)


def launch_tile(kernel: str, fn, region: Region, plan: GradPlan, args: list, inputs: list[torch.Tensor],
                ddot: torch.Tensor) -> None:
    """One launch of the Gluon ``kernel``: ``args`` are the Triton kernel's (``BackwardKernels.tile_args``)."""
    fn[tile_grid(kernel, region, plan)](*args, **tile_meta(kernel, region, inputs, ddot))


def compile_tile_for(kernel: str, fn, region: Region, plan: GradPlan, args: list, inputs: list[torch.Tensor],
                     ddot: torch.Tensor) -> None:
    """``compile_for`` of a tile kernel."""
    warm(fn, tile_grid(kernel, region, plan), args, tile_meta(kernel, region, inputs, ddot))
