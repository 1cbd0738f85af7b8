"""Thresholded attention: the softmax's probabilities below a threshold t are dropped and the
rest, lowered by t, renormalised — relu(p - t) / sum relu(p - t) — so each query keeps only the
keys that carry more than t of its attention. Which keys survive depends on the whole row's
normaliser, so a first pass over the keys computes it and a second applies it; FlexAttention's
score_mod sees one score at a time and cannot express this. Causal, with t half the uniform
weight over the keys (0.5 / N): a row's largest probability, at least 1 / N, always survives.
The backward reverses both passes: the second pass's bodies reach the normaliser l, whose
gradient is then a sum over the keys (``codegen.backward.SumsWriter``)."""
import torch

from .vanilla import make_inputs  # noqa: F401


def attention(q, k, v):
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    causal = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=q.device).tril(s.shape[-1] - s.shape[-2])
    p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
    p = torch.relu(p - 0.5 / k.shape[-2])
    return (p / p.sum(-1, keepdim=True)) @ v
