"""Stick-breaking attention (sums over the keys after each key, ``Reduction.scan``), causal:
its reference code (a product with ``ones(N, N).tril(-1)``) and the flipped cumulative sum;
flashlight against plain torch.compile (Inductor), forward and forward + backward, bf16.
FlexAttention cannot express it (a score modification sees one score, not its row).

    python -m benchmarks.scans [--b 4] [--h 16] [--n 2048] [--d 64]

The forward is one kernel that walks the key blocks last to first; the backward one generated
kernel over query blocks that walks them twice, adding dK and dV with fp32 atomics. The decode
row (one query, 8 n keys, B = 1) runs split-KV: each split scans from 0, the combine scales. Writes ``$OUT/scans.csv`` when ``OUT`` is set.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from flashlight.examples import stick_breaking

from .joined import compare, parser


def flipped_cumsum(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).triu()
    log_beta = F.logsigmoid(-s).masked_fill(mask, 0)
    after = log_beta.flip(-1).cumsum(-1).flip(-1) - log_beta
    return torch.exp(F.logsigmoid(s).masked_fill(mask, -1e5) + after) @ v


def main(argv=None) -> None:
    a = parser(__doc__, b=4, h=16, n=2048, d=64).parse_args(argv)
    qkv = [(a.b, a.h, a.n, a.d)] * 3
    decode = [(1, a.h, 1, a.d)] + [(1, a.h, 8 * a.n, a.d)] * 2      # one query, 8 n keys: split-KV
    compare({"stick_breaking": (stick_breaking.attention, qkv), "flipped_cumsum": (flipped_cumsum, qkv),
             "decode": (stick_breaking.attention, decode)}, a.device, "scans.csv")


if __name__ == "__main__":
    main()
