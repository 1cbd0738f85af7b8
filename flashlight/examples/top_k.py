"""Top-k attention (Gupta et al. 2021, https://arxiv.org/abs/2106.06899; the same row-wise
top-k selection as DeepSeek's sparse attention indexer applies to its index scores): each query
keeps its k largest causal scores and a softmax runs over those alone. Written as models write
it, ``s.topk(k).values[..., -1:]`` as the threshold; the threshold depends on the whole row, so
a first pass over the keys keeps each row's k largest scores so far (``tl.topk`` per key block,
merged into the candidates) and the softmax runs in the second. FlexAttention's score_mod sees
one score at a time and cannot express it; eager and torch.compile materialise the N x N scores
to sort them. The backward treats the threshold as a constant (it is only compared)."""
import torch

from .vanilla import make_inputs  # noqa: F401

K = 16


def attention(q, k, v):
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    causal = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=q.device).tril(s.shape[-1] - s.shape[-2])
    s = s.masked_fill(~causal, float("-inf"))
    kth = s.topk(min(K, s.shape[-1]), dim=-1).values[..., -1:]
    return torch.softmax(s.masked_fill(s < kth, float("-inf")), dim=-1) @ v
