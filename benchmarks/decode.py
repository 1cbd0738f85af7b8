"""Decoding attention in plain PyTorch: ``q_len`` new tokens (1 when decoding) against a KV cache
of ``kv_len`` tokens, GQA (K/V heads shared by groups of query heads), causal with an offset.

Query ``i`` sits at position ``offset + i`` with ``offset = kv_len - q_len`` (the cache already
holds the new tokens' keys), so it sees keys ``0 .. offset + i``. Flashlight fuses these programs
like any other; the FlexAttention (``flex_causal``, ``flex_alibi``) and SDPA (``sdpa_call``)
spellings below compute the same values.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

KV_HEADS = 8


def _expand_kv(x, heads: int):
    """[B, Hkv, N, D] -> [B, H, N, D] without a copy (the GQA spelling Flashlight captures)."""
    B, Hkv, N, D = x.shape
    return x[:, :, None].expand(B, Hkv, heads // Hkv, N, D).reshape(B, heads, N, D)


def _positions(q, k):
    M, N = q.shape[-2], k.shape[-2]
    q_pos = torch.arange(M, device=q.device)[:, None] + (N - M)
    kv_idx = torch.arange(N, device=q.device)[None, :]
    return q_pos, kv_idx


def causal(q, k, v):
    # q: [B, H, M, D] (M = 1 when decoding), k/v: [B, Hkv, N, D]
    H, D = q.shape[1], q.shape[-1]
    k, v = _expand_kv(k, H), _expand_kv(v, H)
    q_pos, kv_idx = _positions(q, k)
    s = (q @ k.transpose(-2, -1)) * D ** -0.5
    return torch.softmax(s.masked_fill(kv_idx > q_pos, float("-inf")), dim=-1) @ v


def alibi(q, k, v):
    H, D = q.shape[1], q.shape[-1]
    k, v = _expand_kv(k, H), _expand_kv(v, H)
    q_pos, kv_idx = _positions(q, k)
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1, device=q.device) / H)
    s = (q @ k.transpose(-2, -1)) * D ** -0.5 + slopes[:, None, None] * (kv_idx - q_pos)
    return torch.softmax(s.masked_fill(kv_idx > q_pos, float("-inf")), dim=-1).to(v.dtype) @ v   # fp32 scores


def threshold(q, k, v):
    """Thresholded attention renormalised (``flashlight.examples.threshold``): two passes over
    the cache, split pass by pass (``codegen.split``); neither FlexAttention nor SDPA expresses it."""
    H, D = q.shape[1], q.shape[-1]
    k, v = _expand_kv(k, H), _expand_kv(v, H)
    q_pos, kv_idx = _positions(q, k)
    s = (q @ k.transpose(-2, -1)) * D ** -0.5
    p = torch.relu(torch.softmax(s.masked_fill(kv_idx > q_pos, float("-inf")), dim=-1) - 0.5 / k.shape[-2])
    return (p / p.sum(-1, keepdim=True)) @ v


def softpick(q, k, v):
    """Softpick (``flashlight.examples.softpick``): two passes, and a max whose argmax the
    combine merges across splits."""
    from flashlight.examples.softpick import softpick as rectified
    H, D = q.shape[1], q.shape[-1]
    k, v = _expand_kv(k, H), _expand_kv(v, H)
    q_pos, kv_idx = _positions(q, k)
    s = (q @ k.transpose(-2, -1)) * D ** -0.5
    return rectified(s.masked_fill(kv_idx > q_pos, float("-inf"))) @ v


def top_k(q, k, v):
    """Top-k attention (``flashlight.examples.top_k``): each query keeps its 64 largest scores of
    the cache, as a sparse-attention indexer selects; each split keeps its own candidates and the
    combine merges them (``codegen.split``)."""
    H, D = q.shape[1], q.shape[-1]
    k, v = _expand_kv(k, H), _expand_kv(v, H)
    q_pos, kv_idx = _positions(q, k)
    s = ((q @ k.transpose(-2, -1)) * D ** -0.5).masked_fill(kv_idx > q_pos, float("-inf"))
    kth = s.topk(min(64, s.shape[-1]), dim=-1).values[..., -1:]
    return torch.softmax(s.masked_fill(s < kth, float("-inf")), dim=-1) @ v


def make_inputs(B=8, H=32, M=1, N=4096, D=128, dtype=torch.float32, device="cpu", kv_heads=KV_HEADS):
    kv_heads = min(kv_heads, H)
    q = torch.randn(B, H, M, D, dtype=dtype, device=device)
    k, v = (torch.randn(B, kv_heads, N, D, dtype=dtype, device=device) for _ in range(2))
    return q, k, v


# ------------------------------------------------------------------------- other spellings
def _offset_mask(offset: int):
    def mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset
    return mask


def _alibi_score(slopes, offset: int):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx - offset)
    return score_mod


def mask_mod(inputs):
    q, k = inputs[0], inputs[1]
    return _offset_mask(k.shape[-2] - q.shape[-2])


def flex_causal(inputs):
    q, k, v = inputs
    return q, k, v, None, mask_mod(inputs), {"enable_gqa": True}, lambda out: out


def flex_alibi(inputs):
    from .flex_equivalents import alibi_slopes
    q, k, v = inputs
    score = _alibi_score(alibi_slopes(q.shape[1], q.device), k.shape[-2] - q.shape[-2])
    return q, k, v, score, mask_mod(inputs), {"enable_gqa": True}, lambda out: out


def sdpa_call(name: str, inputs):
    """Zero-argument SDPA call for q_len = 1 (None otherwise): the query heads sharing a KV head
    become the rows of one query (``[B, Hkv, G, D]``, the usual GQA decoding layout), so every
    SDPA backend may take it without repeating K/V. The one query sees the whole cache, so causal
    needs no mask; ALiBi is a small [1, Hkv, G, N] bias built outside the timed call."""
    q, k, v = inputs
    B, H, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[-2]
    if M != 1:
        return None
    rows = q.reshape(B, Hkv, H // Hkv, D)       # head h = kv * G + g, as _expand_kv pairs them
    bias = None
    if name == "decode_alibi":
        from .flex_equivalents import alibi_slopes
        dist = torch.arange(N, device=q.device) - (N - 1)
        bias = (alibi_slopes(H, q.device)[:, None] * dist).reshape(1, Hkv, H // Hkv, N).to(q.dtype)
    return lambda: F.scaled_dot_product_attention(rows, k, v, attn_mask=bias).reshape(B, H, 1, D)
