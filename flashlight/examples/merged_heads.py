"""Causal attention as a model's layer writes it: the heads merged back into [B, M, H * D] rows
for the output projection (``o.transpose(1, 2).reshape(B, M, H * D)``). The kernel stores the
merged rows itself, so no transposed copy of the output is made (FlexAttention returns
[B, H, M, D] and leaves that copy to the caller)."""
import torch

from .vanilla import make_inputs  # noqa: F401


def attention(q, k, v):
    B, H, M, D = q.shape
    keep = torch.ones(M, k.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = (q @ k.mT) * D ** -0.5
    o = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v
    return o.transpose(1, 2).reshape(B, M, H * D)
