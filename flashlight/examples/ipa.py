"""Invariant point attention (AlphaFold2's structure module, Jumper et al. 2021,
https://www.nature.com/articles/s41586-021-03819-2, suppl. Alg. 22): scalar q·k, a pair bias and
squared distances between 3-D query and key points, summed over points and xyz, in the logits."""
import torch
import torch.nn.functional as F


def attention(q, k, v, q_pts, k_pts, pair_bias, head_weights):
    # q: [B, H, M, D], k, v: [B, H, N, D], q_pts: [B, H, M, P, 3], k_pts: [B, H, N, P, 3] (Å),
    # pair_bias: [B, M, N, H] (linear_b of the pair representation), head_weights: [H]
    P = q_pts.shape[-2]
    w_c = (2.0 / (9 * P)) ** 0.5
    w_l = 3 ** -0.5
    gamma = F.softplus(head_weights).view(1, -1, 1, 1)
    d2 = ((q_pts[:, :, :, None] - k_pts[:, :, None, :]) ** 2).sum(dim=(-1, -2))    # [B, H, M, N]
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + pair_bias.permute(0, 3, 1, 2) - 0.5 * w_c * gamma * d2
    return torch.softmax(w_l * s, dim=-1) @ v


def make_inputs(B=2, H=4, M=128, N=None, D=64, dtype=torch.float32, device="cpu", P=4):
    N = N or M
    q = torch.randn(B, H, M, D, dtype=dtype, device=device)
    k = torch.randn(B, H, N, D, dtype=dtype, device=device)
    v = torch.randn(B, H, N, D, dtype=dtype, device=device)
    # points in the global frame at protein scale: ~N(0, 10²) Å, so |x|² ~ 300 per point; each
    # key's points lie within a few Å of one query's. Head weights γ = softplus(w) ~ 0.02 keep the
    # distance logits O(1) (a trained model's scale), so the softmax is not one-hot.
    q_pts = 10 * torch.randn(B, H, M, P, 3, dtype=dtype, device=device)
    k_pts = q_pts[:, :, torch.arange(N, device=device) % M] + 3 * torch.randn(B, H, N, P, 3, dtype=dtype, device=device)
    pair_bias = torch.randn(B, M, N, H, dtype=dtype, device=device)
    head_weights = -4 + 0.5 * torch.randn(H, dtype=dtype, device=device)
    return q, k, v, q_pts, k_pts, pair_bias, head_weights
