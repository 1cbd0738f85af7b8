"""Softpick (Zuhri et al. 2025, https://arxiv.org/abs/2504.20966): a rectified softmax,
relu(e^s - 1) / sum |e^s - 1|, whose rows need not sum to 1 (no attention sink), causal, as its
reference code computes it: the row max taken with ``torch.max(...).values``, masked scores
dropped with ``isfinite``, an epsilon in the denominator. The epsilon makes the output depend on
the max shift, so its gradient reaches the score at each row's argmax (``shift_gradients``)."""
import torch
import torch.nn.functional as F

from .vanilla import make_inputs  # noqa: F401


def softpick(x, dim=-1, eps=1e-8):
    x_m = torch.max(x, dim=dim, keepdim=True).values
    x_e_1 = torch.exp(x - x_m) - torch.exp(-x_m)
    a = torch.where(x.isfinite(), torch.abs(x_e_1), 0)
    return F.relu(x_e_1) / (a.sum(dim=dim, keepdim=True) + eps)


def attention(q, k, v):
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    causal = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=q.device).tril(s.shape[-1] - s.shape[-2])
    return softpick(s.masked_fill(~causal, float("-inf"))) @ v
