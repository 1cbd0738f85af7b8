"""Decoding from a paged KV cache (vLLM's PagedAttention, https://arxiv.org/abs/2309.06180): each
sequence's keys live in fixed-size pages of a shared cache, found through a block table; grouped
query heads, causal with the queries at the end of the cache. Fused, the pages are read through
the table inside the kernel and long caches are split across programs (split-KV)."""
import torch

PAGE = 16


def attention(q, k_cache, v_cache, block_table):
    # q: [B, H, M, D] (M new tokens); k_cache, v_cache: [pages, PAGE, Hkv, D]; block_table: [B, P]
    B, H, M, D = q.shape
    Hkv = k_cache.shape[2]
    k = k_cache[block_table].flatten(1, 2).transpose(1, 2)          # [B, Hkv, N, D], N = P * PAGE
    v = v_cache[block_table].flatten(1, 2).transpose(1, 2)
    N = k.shape[2]
    k = k[:, :, None].expand(B, Hkv, H // Hkv, N, D).reshape(B, H, N, D)
    v = v[:, :, None].expand(B, Hkv, H // Hkv, N, D).reshape(B, H, N, D)
    s = q @ k.transpose(-2, -1) * D ** -0.5
    q_pos = N - M + torch.arange(M, device=q.device)[:, None]       # the queries are the last M tokens
    s = s.masked_fill(torch.arange(N, device=q.device) > q_pos, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def make_inputs(B=2, H=8, M=1, N=None, D=64, dtype=torch.float32, device="cpu", group=4, queries=1):
    """``queries`` new tokens per sequence against a cache of N keys (default M, rounded up to
    whole pages); the pages of all sequences are shuffled in one cache."""
    pages = -(-(N or M) // PAGE)
    group = min(group, H)
    q = torch.randn(B, H, queries, D, dtype=dtype, device=device)
    k_cache, v_cache = (torch.randn(B * pages + 3, PAGE, H // group, D, dtype=dtype, device=device)
                        for _ in range(2))
    block_table = torch.randperm(B * pages + 3, device=device)[:B * pages].view(B, pages)
    return q, k_cache, v_cache, block_table
