"""Key-padding mask for a batch of variable-length sequences (BERT-style), softmax in float32."""
import torch
import torch.nn.functional as F


def attention(q, k, v, key_valid):
    # key_valid: [B, N] bool, False on padding
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~key_valid[:, None, None, :], float("-inf"))
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def make_inputs(B=2, H=4, M=128, N=None, D=64, dtype=torch.float32, device="cpu", lengths=None):
    N = N or M
    q = torch.randn(B, H, M, D, dtype=dtype, device=device)
    k, v = (torch.randn(B, H, N, D, dtype=dtype, device=device) for _ in range(2))
    if lengths is None:
        lengths = torch.randint(1, N + 1, (B,))
    valid = torch.arange(N)[None, :] < torch.as_tensor(lengths)[:, None]
    return q, k, v, valid.to(device)
