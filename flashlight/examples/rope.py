"""Causal attention with rotary position embeddings (RoFormer, https://arxiv.org/abs/2104.09864)
applied inside the attention function, as Llama's ``apply_rotary_pos_emb`` does: q and k are
rotated by position-dependent angles before their product. With fewer K/V heads than query
heads (``group`` > 1), k and v are then repeated up to the query heads, in Llama's order
(``repeat_kv`` after the rotation). The rotated K is computed once outside the kernel, at its own
K/V heads (``capture.rules.computed_operand``); the rotated Q in the kernel for inference, and
outside it too in training, where the backward would compute it again per key block."""
import torch


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def attention(q, k, v, cos, sin):
    # cos, sin: [N, D] tables of the key positions; the queries are the last M of them
    M, N = q.shape[-2], k.shape[-2]
    q = q * cos[N - M:] + rotate_half(q) * sin[N - M:]
    k = k * cos + rotate_half(k) * sin
    group = q.shape[1] // k.shape[1]
    if group > 1:       # GQA: each K/V head serves `group` query heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    keep = torch.ones(M, N, dtype=torch.bool, device=q.device).tril(N - M)
    scores = (q @ k.mT) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v


def make_inputs(B=2, H=4, M=128, N=None, D=64, dtype=torch.float32, device="cpu", base=10000.0, group=1):
    N, group = N or M, min(group, H)
    q = torch.randn(B, H, M, D, dtype=dtype, device=device)
    k, v = (torch.randn(B, H // group, N, D, dtype=dtype, device=device) for _ in range(2))
    inv_freq = base ** -(torch.arange(0, D, 2, device=device, dtype=torch.float32) / D)
    angles = torch.arange(N, device=device, dtype=torch.float32)[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return q, k, v, angles.cos().to(dtype), angles.sin().to(dtype)
