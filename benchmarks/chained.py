"""Sums read by a later pass: thresholded attention (``examples.threshold``, causal:
relu(p - t) renormalised) and a square root of the probabilities renormalised (no mask), beside
plain causal attention at the same size for scale; flashlight against plain torch.compile
(Inductor), forward and forward + backward, bf16. FlexAttention cannot express either (its
score_mod sees one score, not the row's normaliser).

    python -m benchmarks.chained [--b 4] [--h 16] [--n 4096] [--d 64]

The forwards are two passes over the keys; the backward adds a kernel that walks the keys once
more to complete the normaliser's row gradient (``codegen.backward.SumsWriter``) before the dK/dV
and dQ kernels. Writes ``$OUT/chained.csv`` when ``OUT`` is set.
"""
from __future__ import annotations

import torch

from flashlight.examples import causal, threshold

from .joined import compare, parser


def sqrt_weights(q, k, v):
    w = (torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) + 1e-4).sqrt()
    return (w / w.sum(-1, keepdim=True)) @ v


def main(argv=None) -> None:
    a = parser(__doc__, b=4, h=16, n=4096, d=64).parse_args(argv)
    qkv = [(a.b, a.h, a.n, a.d)] * 3
    compare({"causal": (causal.attention, qkv), "threshold": (threshold.attention, qkv),
             "sqrt_weights": (sqrt_weights, qkv)}, a.device, "chained.csv")


if __name__ == "__main__":
    main()
