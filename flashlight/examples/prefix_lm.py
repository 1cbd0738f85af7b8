"""Prefix-LM attention (T5 / UniLM, https://arxiv.org/abs/1910.10683): bidirectional over a prefix, causal after."""
import torch

from .vanilla import make_inputs  # noqa: F401

PREFIX = 256


def attention(q, k, v, prefix=PREFIX):
    q_idx = torch.arange(q.shape[-2], device=q.device).view(-1, 1)
    kv_idx = torch.arange(k.shape[-2], device=q.device).view(1, -1)
    keep = (kv_idx < prefix) | (kv_idx <= q_idx)
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(keep.logical_not(), float("-inf")), -1) @ v
