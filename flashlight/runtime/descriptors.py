"""Tensor-descriptor loads at run time (``codegen.emit.Emitter.descriptor_load``).

A generated kernel with descriptor loads takes a ``TMA`` constexpr, off by default: on the H200
the descriptor path measured slower than pointer loads in almost every case (docs/notes.md,
session 9: full attention at D=128 1.147 against 1.044 ms; a document mask 0.353 against 0.206,
its kernel's shared memory 1 KB past what two programs per multiprocessor may use), while a
hand-written kernel gained 8% from it. ``FLASHLIGHT_TMA=1`` turns it on where every input read
through a descriptor has a layout the bulk tensor copy accepts: last stride 1, every other
stride and the address 16-byte aligned, and a positive stride along the tile's outer dim. The
check runs per call (a layout can change between calls of one shape), and the kernel is compiled
once per value. Never on GPUs before Hopper (sm_90) or on ROCm; under the interpreter as on
Hopper. Launch configs (the OutOfResources fallback, tuning results on disk) are not keyed by
the constexpr: a config chosen with it on is reused with it off.

Descriptors are made on the device, one per program, in global scratch that Triton asks an
allocator for at launch: ``_compat.with_scratch`` supplies one for our launches only.
"""
from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    """An NVIDIA GPU of compute capability 9.0 or later (ROCm reports 9.x for MI200 and MI300,
    where Triton lowers descriptors back to pointer loads: no point compiling a second kernel)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def enabled(x: torch.Tensor, interpret: bool) -> bool:
    """May kernels on ``x``'s device use descriptor loads at all?"""
    if os.environ.get("FLASHLIGHT_TMA") != "1":
        return False
    if x.device.type == "cuda" and not interpret:
        return _hopper(x.device.index if x.device.index is not None else torch.cuda.current_device())
    return interpret


def flag(reqs: dict[int, set[int]], inputs: list[torch.Tensor]) -> bool | None:
    """A kernel's TMA constexpr for this call (``ready``); None for a kernel without descriptor
    loads (no ``reqs``), which takes no such argument. On every launch: off by default, it
    costs one environment lookup."""
    if not reqs:
        return None
    if os.environ.get("FLASHLIGHT_TMA") != "1":
        return False
    from .op import interpreting
    return ready(reqs, inputs, interpreting())


def ready(reqs: dict[int, set[int]], inputs: list[torch.Tensor], interpret: bool) -> bool:
    """Is ``TMA`` on for a kernel whose descriptors read ``reqs`` (input -> the dims its tiles
    stride over)?"""
    if not reqs or not enabled(inputs[0], interpret):
        return False
    for i, outer in reqs.items():
        x = inputs[i]
        size, strides = x.element_size(), x.stride()
        if strides[-1] != 1 or x.data_ptr() % 16 or any(s * size % 16 for s in strides[:-1]):
            return False
        if any(strides[d] <= 0 for d in outer):
            return False
    return True
