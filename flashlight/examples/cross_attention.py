"""Cross attention (encoder-decoder) with Nq != Nk, written with einsum on a BSHD layout."""
import torch


def attention(q, k, v):
    # q: [B, M, H, D], k/v: [B, N, H, D]  (the layout a Linear projection produces)
    scores = torch.einsum("bmhd,bnhd->bhmn", q, k) * q.shape[-1] ** -0.5
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhmn,bnhd->bhmd", probs, v)


def make_inputs(B=2, H=4, M=128, N=None, D=64, dtype=torch.float32, device="cpu"):
    N = N or (M * 3) // 2 + 7
    q = torch.randn(B, M, H, D, dtype=dtype, device=device)
    k, v = (torch.randn(B, N, H, D, dtype=dtype, device=device) for _ in range(2))
    return q, k, v
