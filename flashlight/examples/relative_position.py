"""Learned relative-position bias (T5, https://arxiv.org/abs/1910.10683): a per-head table indexed
by a clipped bucket of q_idx - kv_idx, gathered inside the kernel."""
import torch

MAX_DISTANCE = 32


def attention(q, k, v, table):
    # table: [H, 2 * MAX_DISTANCE + 1]
    q_idx = torch.arange(q.shape[-2], device=q.device)[:, None]
    kv_idx = torch.arange(k.shape[-2], device=q.device)[None, :]
    bucket = torch.clamp(kv_idx - q_idx, -MAX_DISTANCE, MAX_DISTANCE) + MAX_DISTANCE
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + table[:, bucket]
    return torch.softmax(s, dim=-1) @ v


def make_inputs(B=2, H=4, M=128, N=None, D=64, dtype=torch.float32, device="cpu"):
    N = N or M
    q = torch.randn(B, H, M, D, dtype=dtype, device=device)
    k, v = (torch.randn(B, H, N, D, dtype=dtype, device=device) for _ in range(2))
    return q, k, v, torch.randn(H, 2 * MAX_DISTANCE + 1, dtype=dtype, device=device)
