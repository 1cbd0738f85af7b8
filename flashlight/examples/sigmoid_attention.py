"""Sigmoid attention (Ramapuram et al. 2024, https://arxiv.org/abs/2409.04431): sigmoid(s - log N)."""
import math

import torch

from .vanilla import make_inputs  # noqa: F401


def attention(q, k, v):
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    return torch.sigmoid(s - math.log(k.shape[-2])) @ v
