"""Scaled dot-product attention (Vaswani et al. 2017, https://arxiv.org/abs/1706.03762)."""
import math

import torch


def attention(q, k, v):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1) @ v


def make_inputs(B=2, H=4, M=128, N=None, D=64, dtype=torch.float32, device="cpu"):
    N = N or M
    return tuple(torch.randn(B, H, L, D, dtype=dtype, device=device) for L in (M, N, N))
