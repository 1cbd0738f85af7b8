"""Stick-breaking attention (Tan et al. 2024, https://arxiv.org/abs/2410.17980): each query
breaks a stick from the nearest key backwards, key j taking the share beta_ij = sigmoid(s_ij)
of what the keys between them left, A_ij = beta_ij prod_{j<k<i} (1 - beta_ik). No softmax:
in log space a sum over the keys after j, written as its reference code writes it, a product
with a triangle of ones (``tril(-1)``). The kernel computes that sum as it walks the key blocks
from the last to the first (``Reduction.scan``); the masked log-weights (-1e5) underflow, so
the blocks above the diagonal are skipped. The backward is one generated kernel over query
blocks that walks the key blocks the same way twice: first totalling each row's adjoint of the
partial sums, then reversing the scan from that total (``GradPlan.fused_kv``)."""
import math

import torch
import torch.nn.functional as F

from .vanilla import make_inputs  # noqa: F401


def stick_breaking(logits, attend_current=False):
    """Attention weights from the scores (..., M, N), the M queries at the last M positions;
    each sees the keys before its own position (and its own with ``attend_current``)."""
    M, N = logits.shape[-2:]
    mask = torch.ones(M, N, dtype=torch.bool, device=logits.device).triu(N - M + int(attend_current))
    log_z = F.logsigmoid(logits).masked_fill(mask, -1e5)
    log_beta = F.logsigmoid(-logits).masked_fill(mask, 0)
    cum_weight = torch.ones(N, N, dtype=logits.dtype, device=logits.device).tril(-1)
    re_cum_log_beta = torch.einsum("bhij,jk->bhik", log_beta, cum_weight)
    return torch.exp(log_z + re_cum_log_beta)


def attention(q, k, v):
    return stick_breaking(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])) @ v
