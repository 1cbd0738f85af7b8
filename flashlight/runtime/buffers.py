"""Fresh buffers that a kernel must write in full (outputs, row statistics, gradients, the
split-KV workspace): ``torch.empty`` as they are, or filled with NaN under
``FLASHLIGHT_POISON=1`` — the test suite's setting. An element a kernel fails to write (or one it
reads before writing it) then shows as NaN, instead of reading back a freed buffer's stale values:
the caching allocator often hands back the previous call's memory, which held the right answer.
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
