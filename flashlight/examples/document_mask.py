"""Document (packed-sequence) masking: tokens attend only within their document, causally."""
import torch

DOCS = 12


def attention(q, k, v, doc_ids):
    same_doc = doc_ids[:, None, :, None] == doc_ids[:, None, None, :]
    q_idx = torch.arange(q.shape[-2], device=q.device)[:, None]
    kv_idx = torch.arange(k.shape[-2], device=q.device)[None, :]
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~(same_doc & (kv_idx <= q_idx)), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def doc_ids_for(B, N, docs=DOCS, device="cpu", generator=None):
    """Random document boundaries (documents of length >= 1), as sorted ids per batch row."""
    ids = torch.zeros(B, N, dtype=torch.int32, device=device)
    for b in range(B):
        cuts = torch.randperm(N - 1, generator=generator)[: min(docs, N) - 1] + 1
        ids[b, cuts.to(device)] = 1
    return ids.cumsum(-1).to(torch.int32)


def make_inputs(B=2, H=4, M=128, N=None, D=64, dtype=torch.float32, device="cpu"):
    q = torch.randn(B, H, M, D, dtype=dtype, device=device)
    k, v = (torch.randn(B, H, M, D, dtype=dtype, device=device) for _ in range(2))
    return q, k, v, doc_ids_for(B, M, device=device)
