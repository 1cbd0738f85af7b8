"""Split-KV decoding at run time: when to split the keys, and the two launches.

With few queries (M ≤ 16) the forward grid is tiny (one M block per batch index), so a long key
loop runs on a handful of SMs. Splitting the keys gives ``splits`` programs per (M block, batch
index) and a small combine kernel (``codegen/split.py``). Query heads that share a K/V head
(GQA) are packed into the rows of one program first, so each K/V tile is loaded once per group.

Heuristic (per call, from sizes only): aim for ``PROGRAMS_PER_SM`` programs per SM, without
giving a split fewer than ``MIN_BLOCKS`` key blocks (below that the scratch round trip and the
combine cost more than the parallelism gains)::

    splits = min(ceil(PROGRAMS_PER_SM * SMs / programs), n_blocks // MIN_BLOCKS)   # 1 = no split

``FORCE_SPLITS`` overrides it (tests under the interpreter, which has no SMs, and experiments).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .._compat import fast_launch
from ..codegen.split import generate_split, pack_heads, splittable, width
from ..tune import cdiv
from .buffers import unwritten
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


def may_split(region, device: torch.device) -> bool:
    """Cheap test before the split kernels are compiled: few queries on a GPU, or forced."""
    return FORCE_SPLITS is not None or (region.M <= MAX_M and sm_count(device) > 0)


def plan(M: int, N: int, programs: int, block_n: int, sms: int) -> tuple[int, int]:
    """(splits, key blocks per split) for a forward of ``programs`` (M block, batch) programs."""
    n_blocks = cdiv(N, block_n)
    if FORCE_SPLITS is not None:
        splits = FORCE_SPLITS
    elif M > MAX_M or sms == 0:
        splits = 1
    else:
        splits = min(cdiv(PROGRAMS_PER_SM * sms, programs), n_blocks // MIN_BLOCKS)
    splits = max(1, min(splits, n_blocks))
    per = cdiv(n_blocks, splits)
    return cdiv(n_blocks, per), per


class LaunchPlan(NamedTuple):
    """What a split launch under one config computes once: the split, grids, shapes, constexprs."""
    splits: int
    per: int
    split_grid: tuple
    combine_grid: tuple
    workspace: tuple
    out_shape: tuple
    row_shape: tuple
    meta: dict


@dataclass
class SplitKernels:
    """The split and combine kernels of each pass of a region, generated for ``region``: the
    original one, or with grouped query heads packed into rows (``group`` > 1, see
    ``codegen.split.pack_heads``). ``kernels``: (split, combine, block statistics) per pass."""
    region: object
    group: int
    kernels: list
    source: str
    launches: int = 0
    plans: dict = field(default_factory=dict)     # (config, stats, device, FORCE_SPLITS) -> LaunchPlan | None

    def launch(self, inputs: list[torch.Tensor], outs: list[torch.Tensor], rowstats: torch.Tensor, cfg,
               stats: bool = True, block_stats: dict | None = None) -> bool:
        """Run split + combine into ``outs`` and ``rowstats`` (*batch, M, W; a placeholder when
        ``stats`` is off) if the plan splits the keys; False otherwise."""
        device = inputs[0].device
        key = (cfg, stats, device, FORCE_SPLITS)
        if key not in self.plans:     # per config: the split plan, grids and constexprs (host time on every call)
            self.plans[key] = self.launch_plan(cfg, stats, device)
        p = self.plans[key]
        if p is None:
            return False
        r = self.region
        views = [outs[0].view(p.out_shape)] + [o.view(p.row_shape) for o in outs[1:]]
        ws = unwritten(torch.empty(p.workspace, dtype=torch.float32, device=device))
        if stats:
            rowstats = rowstats.view(*p.row_shape, rowstats.shape[-1])     # packed rows: same memory order
        for split, combine, stats_ in self.kernels:      # pass by pass: each reads the earlier ones' finals
            args = [*op.kernel_args(r, stats_, inputs, views, rowstats, block_stats), ws, p.splits, p.per]
            split[p.split_grid](*args, **p.meta)
            combine[p.combine_grid](*args, **p.meta)
        self.launches += 1
        return True

    def launch_plan(self, cfg, stats: bool, device: torch.device) -> LaunchPlan | None:
        r = self.region
        programs_b = math.prod(r.batch)
        grid_m = cdiv(r.M, cfg.BLOCK_M)
        splits, per = plan(r.M, r.N, grid_m * programs_b, cfg.BLOCK_N, sm_count(device))
        if splits == 1:
            return None
        finals = len(self.kernels) > 1      # a row block more: the earlier passes' final values
        return LaunchPlan(splits, per, (grid_m, programs_b, splits), (grid_m, programs_b),
                          (splits + finals, programs_b, r.M, width(r)), (*r.batch, r.M, r.DV), (*r.batch, r.M),
                          op.launch_meta(r, cfg, stats))


def compile_split(region, allow_tf32: bool, interpret: bool) -> SplitKernels | None:
    """The split-KV kernels of a region, its query heads packed when they share K/V heads (None
    where ``splittable`` says no)."""
    if not splittable(region):
        return None
    region, group = pack_heads(region, MAX_M) or (region, 1)
    placeholder = "fl_dec"
    source, stats = generate_split(region, placeholder, allow_tf32, interpret)
    mod_name = f"fl_dec_{source_hash(source)}"
    source = source.replace(f"def {placeholder}_", f"def {mod_name}_")
    module, _ = load_module(mod_name, source)
    kernels = [(fast_launch(getattr(module, f"{mod_name}_split{p}"), interpret),
                fast_launch(getattr(module, f"{mod_name}_combine{p}"), interpret), stats[p]) for p in range(len(stats))]
    return SplitKernels(region, group, kernels, source)


# at the end: op imports this module (a function-level import would cost ~1 µs on every launch)
from . import op  # noqa: E402
