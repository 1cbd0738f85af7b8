"""Sliding-window causal attention (Longformer / Mistral, https://arxiv.org/abs/2004.05150)."""
import torch

from .vanilla import make_inputs  # noqa: F401

WINDOW = 256


def attention(q, k, v, window=WINDOW):
    q_idx = torch.arange(q.shape[-2], device=q.device)[:, None]
    kv_idx = torch.arange(k.shape[-2], device=q.device)[None, :]
    keep = (kv_idx <= q_idx) & (q_idx - kv_idx < window)
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.where(keep, scores, float("-inf")).softmax(-1) @ v
