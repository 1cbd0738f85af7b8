"""Gated attention output (as in AlphaFold2 and Qwen3-Next, https://arxiv.org/abs/2505.06708):
a sigmoid gate multiplies the attention output, fused as the kernel's epilogue."""
import torch


def attention(q, k, v, gate):
    out = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1) @ v
    return torch.sigmoid(gate) * out


def make_inputs(B=2, H=4, M=128, N=None, D=64, dtype=torch.float32, device="cpu"):
    N = N or M
    q = torch.randn(B, H, M, D, dtype=dtype, device=device)
    k, v = (torch.randn(B, H, N, D, dtype=dtype, device=device) for _ in range(2))
    return q, k, v, torch.randn(B, H, M, D, dtype=dtype, device=device)
