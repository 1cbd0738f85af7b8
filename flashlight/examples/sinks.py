"""Attention sinks as gpt-oss writes them (https://github.com/openai/gpt-oss, model.py ``sdpa``;
Xiao et al. 2023, https://arxiv.org/abs/2309.17453): a learned per-head logit concatenated to
every row of scores joins the softmax normalisation but has no value row."""
import torch


def attention(q, k, v, sinks):
    # q: [B, H, M, D], k, v: [B, H, N, D], sinks: [H]
    B, H, M, _ = q.shape
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    col = sinks.reshape(1, H, 1, 1).expand(B, H, M, 1)
    p = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]     # drop the sink column
    return p @ v


def make_inputs(B=2, H=4, M=128, N=None, D=64, dtype=torch.float32, device="cpu"):
    N = N or M
    q = torch.randn(B, H, M, D, dtype=dtype, device=device)
    k = torch.randn(B, H, N, D, dtype=dtype, device=device)
    v = torch.randn(B, H, N, D, dtype=dtype, device=device)
    sinks = torch.randn(H, dtype=dtype, device=device)
    return q, k, v, sinks
