"""Causal (autoregressive) attention, mask spelled as ``ones(...).tril()`` — no N×N tensor is built."""
import torch

from .vanilla import make_inputs  # noqa: F401


def attention(q, k, v):
    M, N = q.shape[-2], k.shape[-2]
    keep = torch.ones(M, N, dtype=torch.bool, device=q.device).tril()
    scores = (q @ k.mT) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v
