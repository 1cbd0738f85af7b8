"""Split-KV decoding at run time: when to split the keys, and the two launches.

With few queries (M ≤ 16) the forward grid is tiny (one M block per batch index), so a long key
loop runs on a handful of SMs. Splitting the keys gives ``splits`` programs per (M block, batch
index) and a small combine kernel (``codegen/split.py``).

Heuristic (per call, from sizes only): aim for ``PROGRAMS_PER_SM`` programs per SM, without
giving a split fewer than ``MIN_BLOCKS`` key blocks (below that the scratch round trip and the
combine cost more than the parallelism gains)::

    splits = min(ceil(PROGRAMS_PER_SM * SMs / programs), n_blocks // MIN_BLOCKS)   # 1 = no split

``FORCE_SPLITS`` overrides it (tests under the interpreter, which has no SMs, and experiments).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton

from ..codegen.split import generate_split, splittable
from .cache import load_module, source_hash

MAX_M = 16
PROGRAMS_PER_SM = 4
MIN_BLOCKS = 4
FORCE_SPLITS: int | None = None
_SMS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (0 elsewhere: the interpreter splits only when forced)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return 0
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def plan(M: int, N: int, programs: int, block_n: int, sms: int) -> tuple[int, int]:
    """(splits, key blocks per split) for a forward of ``programs`` (M block, batch) programs."""
    n_blocks = triton.cdiv(N, block_n)
    if FORCE_SPLITS is not None:
        splits = FORCE_SPLITS
    elif M > MAX_M or sms == 0:
        splits = 1
    else:
        splits = min(triton.cdiv(PROGRAMS_PER_SM * sms, programs), n_blocks // MIN_BLOCKS)
    splits = max(1, min(splits, n_blocks))
    per = triton.cdiv(n_blocks, splits)
    return triton.cdiv(n_blocks, per), per


@dataclass
class SplitKernels:
    split: object
    combine: object
    source: str
    launches: int = 0


def compile_split(name: str, region, allow_tf32: bool, interpret: bool) -> SplitKernels | None:
    """The split and combine kernels of a region (None when its reductions need several passes)."""
    if not splittable(region):
        return None
    placeholder = "fl_dec"
    source, _ = generate_split(region, placeholder, allow_tf32, interpret)
    mod_name = f"fl_dec_{source_hash(source)}"
    source = source.replace(f"def {placeholder}_", f"def {mod_name}_")
    module, _ = load_module(mod_name, source)
    return SplitKernels(getattr(module, f"{mod_name}_split"), getattr(module, f"{mod_name}_combine"), source)


def launch_split(kernels: SplitKernels, region, args: list, meta: dict, cfg, splits: int, per: int,
                 device: torch.device) -> None:
    """Run the split kernel over (M blocks, batch, splits), then the combine over (M blocks, batch)."""
    programs_b = math.prod(region.batch)
    width = sum(1 if red.kind != "dot" else region.DV for red in region.reductions)
    ws = torch.empty((splits, programs_b, region.M, width), dtype=torch.float32, device=device)
    full = [*args, ws, splits, per]
    grid_m = triton.cdiv(region.M, cfg.BLOCK_M)
    kernels.split[(grid_m, programs_b, splits)](*full, **meta)
    kernels.combine[(grid_m, programs_b)](*full, **meta)
    kernels.launches += 1
