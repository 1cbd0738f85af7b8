"""Attention sinks with gpt-oss's causal sliding-window mask (https://github.com/openai/gpt-oss):
the mask is built as -inf matrices with ``triu``/``tril``, the [H] sink logit is broadcast into
the concatenated column; rows keep a positive denominator even where every key is masked."""
import torch


def attention(q, k, v, sinks, window: int = 16):
    # q: [B, H, M, D], k, v: [B, H, N, D], sinks: [H]
    B, H, M, _ = q.shape
    N = k.shape[-2]
    mask = torch.triu(q.new_full((M, N), float("-inf")), diagonal=1)
    mask = mask + torch.tril(q.new_full((M, N), float("-inf")), diagonal=-window)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask
    s = torch.cat([s, sinks[None, :, None, None].expand(B, H, M, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :-1]
    return p @ v


def make_inputs(B=2, H=4, M=128, N=None, D=64, dtype=torch.float32, device="cpu"):
    N = N or M
    q = torch.randn(B, H, M, D, dtype=dtype, device=device)
    k = torch.randn(B, H, N, D, dtype=dtype, device=device)
    v = torch.randn(B, H, N, D, dtype=dtype, device=device)
    sinks = torch.randn(H, dtype=dtype, device=device)
    return q, k, v, sinks
