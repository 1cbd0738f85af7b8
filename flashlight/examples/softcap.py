"""Tanh logit soft-capping (Gemma 2, https://arxiv.org/abs/2408.00118)."""
import torch

from .vanilla import make_inputs  # noqa: F401

CAP = 30.0


def attention(q, k, v, cap=CAP):
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    scores = cap * torch.tanh(scores / cap)
    return torch.softmax(scores, dim=-1) @ v
