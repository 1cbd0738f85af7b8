"""The quick start of a masked region (``CompiledRegion.quick_start``): its first calls run a
kernel that compiles faster, while its own kernel compiles in the background.

A region whose mask skips key blocks compiles to a kernel of two loops (a masked head and tail
around a mask-free middle) after a block scan. The same program generated without block
sparsity (``codegen.generate(sparse=False)``) has one masked loop and no scan, compiles a third
faster, and computes the same outputs and row statistics, visiting the dead blocks too. In
session 11's cold first calls on the H200 (docs/notes.md) every case slower than FlexAttention's
first call was masked, and masked cases took 1.5-2.5 s against the unmasked softcap's 1.0-1.3 s
(but for the sliding window at 4x4096: 1.04 s).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .. import _compat
from .._compat import fast_launch
from ..codegen import CodegenError, generate
from ..ir import Region
from ..tune import Config
from . import background, descriptors
from .cache import load_module, source_hash


@dataclass
class QuickStart:
    """A masked region's dense kernel (module doc) and the background compile of its own. Its
    compile: 0.36-0.48 s in 7 of 8 offline measurements (one 0.74 s) against the two-loop
    kernel's 0.61-0.81 s (causal, ALiBi, sliding window, document mask at D=128, N = 4096 and
    1024, on the CPU machine, session 12)."""
    kernel: object          # the dense kernel (FastLaunch)
    stats: list             # its block statistics (none: it has no scan)
    tma: dict               # the inputs its tensor descriptors read
    future: object = None   # the region's own kernel compiling in the background

    def launch(self, r: Region, cfg: Config, stats: bool, inputs, outs, rowstats, grid) -> None:
        """One launch; SCAN_BLOCKS (the scan's vector of blocks, a power of two per length) is 1:
        this kernel has no scan, and one compile then serves every length."""
        tma = descriptors.flag(self.tma, inputs)
        args = op.kernel_args(r, self.stats, inputs, outs, rowstats)
        meta = op.launch_meta(r, cfg, stats, tma, scan=False)
        op.launch_kernel(self.kernel, grid, args, meta, inputs[0].device if tma else None)


# (kernel name, SCAN_BLOCKS) of the kernels this process compiled: a region sharing one skips the
# quick start. The scan's vector size is a constexpr, a power of two per length: the same kernel
# at a length in another bucket compiles again (session 24: the flex suite's first calls at
# 1x16384 after 4x4096 compiled the two-loop kernel on the calling thread)
OWN_COMPILED: set[tuple[str, int]] = set()


def quick_wanted(c, inputs: list[torch.Tensor], gluon_ok: bool, scan: int) -> bool:
    """Does this region start with the quick kernel? A mask that skips blocks (``c.sparse``: the
    two-loop kernel), compiles in the background (``FLASHLIGHT_BACKGROUND``), no autotuning, a
    GPU launch, its own kernel not already compiled by this process for this launch's
    SCAN_BLOCKS (``scan``). ``FLASHLIGHT_QUICK=0`` turns it off; ``force`` also under the
    interpreter (the CPU tests)."""
    mode = os.environ.get("FLASHLIGHT_QUICK", "1")
    if mode == "0" or not c.sparse or not background.enabled() or c.max_autotune or not gluon_ok \
            or (c.name, scan) in OWN_COMPILED:
        return False
    return mode == "force" or (inputs[0].is_cuda and not op.interpreting())


def compile_quick(c) -> QuickStart | bool:
    """The region's dense kernel, or False where it has none."""
    placeholder = "fl_fwdq"
    try:
        source, stats, tma = generate(c.region, placeholder, allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                                      interpret=op.interpreting(), sparse=False)
    except CodegenError:
        return False
    if op.reads_scan(source, placeholder):      # a scan after all: with SCAN_BLOCKS=1 it would be wrong
        return False
    name = f"fl_fwdq_{source_hash(source)}"
    module, _ = load_module(name, source.replace(f"def {placeholder}(", f"def {name}("))
    return QuickStart(fast_launch(getattr(module, name), op.interpreting()), stats, tma)


def compile_own_for(c, args: list, meta: tuple):
    """Triton's compile of the region's own kernel for this launch (no launch), its launcher
    built alongside: the background task of a quick start. Under the interpreter, nothing to
    compile."""
    OWN_COMPILED.add((c.name, meta[1]["SCAN_BLOCKS"]))
    if op.interpreting():
        return
    _compat.warm(c.kernel, meta[0], args, meta[1])


# at the end: op imports this module; its helpers are looked up there per call (tests spy on them)
from . import op  # noqa: E402
