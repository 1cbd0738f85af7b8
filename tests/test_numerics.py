"""Numerics at the edges of the input dtype: masks at finfo.min, logits beyond fp16's range."""
import pytest
import torch

from flashlight.examples import causal, key_padding
from flashlight.testing import reference, rel_error
from helpers import check_fused


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_finfo_min_mask_matches_eager(dtype):
    """The most negative finite value of the score dtype as the mask (HF models do this): fully
    masked rows are a uniform average in eager, and here too; nothing overflows to -inf - -inf."""
    def attn(q, k, v, valid):
        s = q @ k.mT * q.shape[-1] ** -0.5
        return torch.softmax(s.masked_fill(~valid[:, None, None, :], torch.finfo(s.dtype).min), -1) @ v
    q, k, v, valid = key_padding.make_inputs(B=2, H=2, M=20, N=33, D=16, lengths=[0, 5], dtype=dtype)
    out, _ = check_fused(attn, q, k, v, valid, tol=1e-3 if dtype == torch.float32 else 2e-2)
    assert out[0].abs().sum() > 0 and torch.isfinite(out).all()


def test_fp16_logits_beyond_fp16_range():
    """fp16 inputs whose scores exceed 65504: eager's fp16 matmul overflows to inf (NaN output);
    the kernel accumulates q @ k^T in fp32 and matches float64."""
    q, k, v = causal.make_inputs(B=1, H=2, M=40, D=16, dtype=torch.float16)
    q, k = q * 120, k * 120
    assert not torch.isfinite(causal.attention(q, k, v)).all()      # eager overflows
    out = torch.compile(causal.attention, backend="flashlight")(q, k, v)
    assert rel_error(out, reference(causal.attention, q, k, v)) < 2e-3


def test_float_index_arithmetic_divides_exactly():
    """Chunks spelled with float division (``(arange(M) / 41).floor()``): the kernel may multiply
    scores by a reciprocal, never index arithmetic — floor(41 * fl32(1/41)) is 0, not 1."""
    def chunked(q, k, v):
        cq = (torch.arange(q.shape[-2]) / 41).floor()
        ck = (torch.arange(k.shape[-2]) / 41).floor()
        s = (q @ k.mT * 0.25).masked_fill(cq[:, None] != ck[None, :], float("-inf"))
        return torch.softmax(s, -1) @ v
    q, k, v = (torch.randn(1, 1, 96, 16) for _ in range(3))
    check_fused(chunked, q, k, v)
