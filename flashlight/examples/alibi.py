"""ALiBi (Press et al. 2021, https://arxiv.org/abs/2108.12409): a per-head linear distance bias, causal."""
import torch

from .vanilla import make_inputs  # noqa: F401


def attention(q, k, v):
    H, M, N = q.shape[1], q.shape[-2], k.shape[-2]
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1, device=q.device) / H)
    dist = torch.arange(N, device=q.device)[None, :] - torch.arange(M, device=q.device)[:, None]
    bias = slopes[:, None, None] * dist          # [H, M, N] broadcast, computed in the kernel
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + bias
    scores = scores.masked_fill(dist > 0, float("-inf"))
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v       # fp32 scores (the bias is fp32), P in V's type
