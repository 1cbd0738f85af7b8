"""Differential attention (Ye et al. 2024, https://arxiv.org/abs/2410.05258): the difference of two
softmax maps over half-width heads, with a learned λ, the per-head RMSNorm sub-layer norm scaled
by (1 - λ_init), and the heads merged back to [B, M, H * Dv] — all in the kernel's epilogue."""
import torch


def attention(q, k, v, lam, norm_weight, lambda_init: float = 0.2):
    # q, k: [B, H, N, 2*d] (two half-heads each), v: [B, H, N, Dv], lam: scalar, norm_weight: [Dv]
    B, H, M, _ = q.shape
    q1, q2 = q.chunk(2, dim=-1)
    k1, k2 = k.chunk(2, dim=-1)
    scale = q1.shape[-1] ** -0.5
    a1 = torch.softmax(q1 @ k1.transpose(-2, -1) * scale, dim=-1)
    a2 = torch.softmax(q2 @ k2.transpose(-2, -1) * scale, dim=-1)
    out = a1 @ v - lam * (a2 @ v)
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_weight   # subln (RMSNorm)
    out = out * (1 - lambda_init)
    return out.transpose(1, 2).reshape(B, M, -1)


def make_inputs(B=2, H=4, M=128, N=None, D=64, dtype=torch.float32, device="cpu"):
    N = N or M
    q = torch.randn(B, H, M, D, dtype=dtype, device=device)
    k = torch.randn(B, H, N, D, dtype=dtype, device=device)
    v = torch.randn(B, H, N, D, dtype=dtype, device=device)
    lam = torch.tensor(0.8, dtype=dtype, device=device) - torch.tensor(0.3, dtype=dtype, device=device).exp() * 0.2
    norm_weight = 1 + 0.1 * torch.randn(D, dtype=dtype, device=device)
    return q, k, v, lam, norm_weight
