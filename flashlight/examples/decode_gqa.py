"""Decoding with grouped-query attention (Ainslie et al. 2023, https://arxiv.org/abs/2305.13245):
a few new queries per sequence, at the end of a long KV cache (causal with offset N - M), and
the same with ALiBi (https://arxiv.org/abs/2108.12409). Fused as split-KV kernels with the query
heads of a group packed into one program."""
import torch


def _expand(x, H):
    B, Hkv, N, D = x.shape
    return x[:, :, None].expand(B, Hkv, H // Hkv, N, D).reshape(B, H, N, D)   # no copy is made


def attention(q, k, v):
    H, M, N, D = q.shape[1], q.shape[2], k.shape[2], q.shape[3]
    s = q @ _expand(k, H).transpose(-2, -1) * D ** -0.5
    q_pos = N - M + torch.arange(M, device=q.device)[:, None]       # the queries are the last M tokens
    s = s.masked_fill(torch.arange(N, device=q.device) > q_pos, float("-inf"))
    return torch.softmax(s, dim=-1) @ _expand(v, H)


def attention_alibi(q, k, v):
    H, M, N, D = q.shape[1], q.shape[2], k.shape[2], q.shape[3]
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1, device=q.device) / H)
    dist = torch.arange(N, device=q.device)[None, :] - (N - M + torch.arange(M, device=q.device)[:, None])
    s = q @ _expand(k, H).transpose(-2, -1) * D ** -0.5 + slopes[:, None, None] * dist
    s = s.masked_fill(dist > 0, float("-inf"))
    return torch.softmax(s, dim=-1).to(v.dtype) @ _expand(v, H)    # fp32 scores (the bias is fp32)


def make_inputs(B=8, H=32, M=1, N=None, D=128, dtype=torch.float32, device="cpu", group=4, queries=1):
    """``queries`` new tokens per sequence against a cache of N keys (default M)."""
    N, group = N or M, min(group, H)
    q = torch.randn(B, H, queries, D, dtype=dtype, device=device)
    k, v = (torch.randn(B, H // group, N, D, dtype=dtype, device=device) for _ in range(2))
    return q, k, v
