"""Seeds for fused dropout: ``flashlight::seed`` draws one from torch's generator per call.

Capture inserts a call of this op in front of every fused dropout, and the region reads the seed
as a 0-d input. Drawing it from the device's default generator means ``torch.manual_seed``
reproduces the masks; being a region input, it is saved for the backward, which redraws the
same mask from it (``ir/philox.py``). The op is tagged nondeterministic-seeded so AOT autograd's
partitioner never recomputes it in the backward (that would draw a new seed).
"""
from __future__ import annotations

import torch


@torch.library.custom_op("flashlight::seed", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def seed(anchor: torch.Tensor) -> torch.Tensor:
    """A seed drawn on ``anchor``'s device (an empty tensor: a tensor argument is how Inductor's
    ``run_and_save_rng_state`` finds whose generator state to save under checkpointing)."""
    return torch.randint(0, 1 << 62, (), dtype=torch.int64, device=anchor.device)


@seed.register_fake
def _seed_fake(anchor: torch.Tensor) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device=anchor.device)
