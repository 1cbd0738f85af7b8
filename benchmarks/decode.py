"""Decoding attention in plain PyTorch: ``q_len`` new tokens (1 when decoding) against a KV cache
of ``kv_len`` tokens, GQA (K/V heads shared by groups of query heads), causal with an offset.

Query ``i`` sits at position ``offset + i`` with ``offset = kv_len - q_len`` (the cache already
holds the new tokens' keys), so it sees keys ``0 .. offset + i``. Flashlight fuses these programs
like any other; the FlexAttention spellings below (``FLEX``) and SDPA spellings (``sdpa_call``)
compute the same values.
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
    return torch.softmax(s.masked_fill(kv_idx > q_pos, float("-inf")), dim=-1) @ v


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
    """Zero-argument SDPA call: lower-right causal alignment is the offset mask (no mask at all
    when every query sees the whole cache); ALiBi as a small additive [1, H, M, N] bias built
    outside the timed call."""
    q, k, v = inputs
    M, N, H = q.shape[-2], k.shape[-2], q.shape[1]
    if name == "decode_causal":
        if M == 1:
            return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        from torch.nn.attention.bias import causal_lower_right
        bias = causal_lower_right(M, N)
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    if name == "decode_alibi":
        from .flex_equivalents import alibi_slopes
        q_pos = torch.arange(M, device=q.device)[:, None] + (N - M)
        kv_idx = torch.arange(N, device=q.device)[None, :]
        bias = alibi_slopes(H, q.device)[:, None, None] * (kv_idx - q_pos)
        bias = bias.masked_fill(kv_idx > q_pos, float("-inf"))[None].to(q.dtype)
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    return None
