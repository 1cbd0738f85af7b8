"""Differential attention as the DIFF Transformer's reference code writes it (Ye et al. 2024,
https://arxiv.org/abs/2410.05258, ``multihead_diffattn.py``): q and k projected to 2H heads of
width d, one causal softmax over all 2H maps, the maps of heads 2h and 2h + 1 combined as
``w[:, :, 0] - λ w[:, :, 1]`` *before* the product with v (H heads of width 2d), then the per-head
RMSNorm scaled by (1 - λ_init). ``diff_attention`` is the same model with the two products
written out; here the rewrite splits the one product (``rewrite.split_sums``)."""
import torch


def attention(q, k, v, lam, norm_weight, lambda_init: float = 0.2):
    # q, k: [B, N, 2H * d] (projection outputs), v: [B, N, H * 2d], lam: scalar, norm_weight: [2d]
    B, N, _ = q.shape
    dv = norm_weight.shape[0]
    H = v.shape[-1] // dv
    q = q.view(B, N, 2 * H, dv // 2).transpose(1, 2)
    k = k.view(B, N, 2 * H, dv // 2).transpose(1, 2)
    v = v.view(B, N, H, dv).transpose(1, 2)
    s = q @ k.transpose(-1, -2) * (dv // 2) ** -0.5
    future = torch.triu(torch.ones(N, N, dtype=torch.bool, device=q.device), 1)
    w = torch.softmax(s.masked_fill(future, float("-inf")), dim=-1).view(B, H, 2, N, N)
    out = (w[:, :, 0] - lam * w[:, :, 1]) @ v
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_weight   # subln (RMSNorm)
    out = out * (1 - lambda_init)
    return out.transpose(1, 2).reshape(B, N, H * dv)


def make_inputs(B=2, H=4, M=128, N=None, D=64, dtype=torch.float32, device="cpu"):
    # D: the width of a head of v (each of q's and k's two heads per head is D / 2 wide). Self-
    # attention: N = M.
    assert N is None or N == M, "the reference code's causal self-attention: N = M"
    q, k, v = (torch.randn(B, M, H * D, dtype=dtype, device=device) for _ in range(3))
    lam = torch.tensor(0.8, dtype=dtype, device=device) - torch.tensor(0.3, dtype=dtype, device=device).exp() * 0.2
    norm_weight = 1 + 0.1 * torch.randn(D, dtype=dtype, device=device)
    return q, k, v, lam, norm_weight
