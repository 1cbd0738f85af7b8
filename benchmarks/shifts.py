"""Softmaxes whose shift is written another way, causal: softpick (its reference code: the
output depends on the max shift through its epsilon), softmax_1 (the shift clamped at 0, a +1
in the denominator) and a hand-written softmax with an epsilon in its denominator; flashlight
against plain torch.compile (Inductor), forward and forward + backward, bf16. FlexAttention
expresses none of them.

    python -m benchmarks.shifts [--b 4] [--h 16] [--n 4096] [--d 64]

Before the shift rules (rewrite ``clamp_shifts``, ``seed_sums``; ``shift_gradients``) softpick
computed its max and its isfinite mask outside the kernel as N x N tensors, softmax_1 took two
passes over the keys, and all three trained through the reference VJP (scores materialised).
Writes ``$OUT/shifts.csv`` when ``OUT`` is set.
"""
from __future__ import annotations

import torch

from flashlight.examples import softpick

from .joined import compare, parser


def _causal(s):
    keep = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril()
    return s.masked_fill(~keep, float("-inf"))


def softmax_one(q, k, v):
    s = _causal(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5)
    m = s.amax(-1, keepdim=True).clamp(min=0)
    e = torch.exp(s - m)
    return e / (torch.exp(-m) + e.sum(-1, keepdim=True)) @ v


def softmax_eps(q, k, v):
    s = _causal(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return e / (e.sum(-1, keepdim=True) + 1e-6) @ v


def main(argv=None) -> None:
    a = parser(__doc__, b=4, h=16, n=4096, d=64).parse_args(argv)
    qkv = [(a.b, a.h, a.n, a.d)] * 3
    compare({"softpick": (softpick.attention, qkv), "softmax_one": (softmax_one, qkv),
             "softmax_eps": (softmax_eps, qkv)}, a.device, "shifts.csv")


if __name__ == "__main__":
    main()
