"""Post-softmax gating with re-normalisation (e.g. key-importance gates as in
https://arxiv.org/abs/2505.06708, and token-dropping masks applied after the softmax): the
probabilities are multiplied by a per-key gate, masked again, and re-normalised before ``@ v``.
Fused in one pass: a per-(m, n) factor commutes with the row normalisation."""
import torch

from .vanilla import make_inputs as _qkv


def attention(q, k, v, gate):
    # gate: [B, H, N] in (0, 1)
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    p = torch.softmax(s, dim=-1) * gate[:, :, None, :]
    dropped = torch.arange(k.shape[-2], device=q.device) % 7 == 3          # a second mask, after the softmax
    p = p.masked_fill(dropped, 0.0)
    p = p / p.sum(-1, keepdim=True)
    return p @ v


def make_inputs(B=2, H=8, M=128, N=None, D=64, dtype=torch.float32, device="cpu"):
    q, k, v = _qkv(B=B, H=H, M=M, N=N, D=D, dtype=dtype, device=device)
    return q, k, v, torch.rand(B, H, k.shape[-2], dtype=dtype, device=device)
