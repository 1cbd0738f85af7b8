"""Fresh buffers the kernels write (outputs, row statistics, gradients, row gradients, the
split-KV workspace): ``torch.empty`` as they are, or filled with NaN under
``FLASHLIGHT_POISON=1`` — the test suite's setting. Every element that is read (by the caller, or
by a later kernel: the row gradients are written only in the columns the tile kernels read) must
have been written; one that was not then shows as NaN, instead of reading back a freed buffer's
stale values — the caching allocator often hands back the previous call's memory, which held the
right answer.
"""
from __future__ import annotations

import os

import torch

POISON = os.environ.get("FLASHLIGHT_POISON") == "1"


def unwritten(x: torch.Tensor) -> torch.Tensor:
    """``x`` (just allocated), NaN-filled under ``FLASHLIGHT_POISON=1`` when it is floating."""
    if POISON and x.is_floating_point():
        x.fill_(float("nan"))
    return x
