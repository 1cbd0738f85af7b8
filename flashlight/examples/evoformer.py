"""Evoformer row-wise gated self-attention with pair bias (AlphaFold2, Jumper et al. 2021,
https://www.nature.com/articles/s41586-021-03819-2), on 5-D [B, S, R, H, C] activations; the
output is transposed back, gated and flattened to [B, S, R, H * C] as OpenFold does, in the
kernel's epilogue."""
import torch


def attention(q, k, v, pair_bias, mask_bias, gate):
    # q, k, v, gate: [B, S, R, H, C]; pair_bias: [B, 1, H, R, R]; mask_bias: [B, S, 1, 1, R]
    qt, kt, vt = (x.transpose(-2, -3) for x in (q, k, v))          # [B, S, H, R, C]
    s = qt @ kt.transpose(-1, -2) * q.shape[-1] ** -0.5 + pair_bias + mask_bias
    o = (torch.softmax(s, dim=-1) @ vt).transpose(-2, -3)            # [B, S, R, H, C]
    o = o * torch.sigmoid(gate)
    return o.reshape(*o.shape[:-2], -1)                               # [B, S, R, H * C]


def make_inputs(B=1, H=4, M=64, N=None, D=32, dtype=torch.float32, device="cpu", S=3):
    R = M
    q, k, v, gate = (torch.randn(B, S, R, H, D, dtype=dtype, device=device) for _ in range(4))
    pair_bias = torch.randn(B, 1, H, R, R, dtype=dtype, device=device)
    residue_mask = (torch.rand(B, S, R, device=device) > 0.1).to(dtype)
    mask_bias = (1e9 * (residue_mask - 1))[:, :, None, None, :]
    return q, k, v, pair_bias, mask_bias, gate
