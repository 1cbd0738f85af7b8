"""Attention dropout (Srivastava et al. 2014, https://jmlr.org/papers/v15/srivastava14a.html, as
in the original Transformer): training-mode dropout on the probabilities, fused with a Philox
mask drawn in the kernel and redrawn in the backward. Not in the demo table: eager draws its
mask from another generator, so outputs agree only in distribution (tests/test_dropout.py)."""
import torch
import torch.nn.functional as F

from .vanilla import make_inputs  # noqa: F401

P = 0.1


def attention(q, k, v):
    p = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1)
    return F.dropout(p, P, training=True) @ v
