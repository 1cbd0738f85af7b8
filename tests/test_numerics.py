"""Numerics at the edges of the input dtype: masks at finfo.min, logits beyond fp16's range, integer
arithmetic at the edges of the kernel's int32 and of narrow integer dtypes."""
import pytest
import torch

import flashlight
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


def _positions(q, k, dtype=torch.int64):
    return torch.arange(q.shape[-2], dtype=dtype)[:, None], torch.arange(k.shape[-2], dtype=dtype)[None, :]


def _hash_of_positions(q, k, v, pad):
    i, j = _positions(q, k)         # int64 in eager: no wrap
    return torch.softmax((q @ k.mT * 0.25).masked_fill((i * 173856093 + j * 19349663) % 97 >= 48, float("-inf")), -1) @ v


def _constant_beyond_int32(q, k, v, pad):
    i, j = _positions(q, k)
    return torch.softmax((q @ k.mT * 0.25).masked_fill((i * 2654435761 + j) % 97 >= 60, float("-inf")), -1) @ v


def _int32_positions_that_wrap(q, k, v, pad):
    i, j = _positions(q, k, torch.int32)     # int32 in eager: (i - j) * 2**28 wraps
    return torch.softmax((q @ k.mT * 0.25).masked_fill((i - j) * 2 ** 28 < 0, float("-inf")), -1) @ v


def _uint8_below_zero(q, k, v, pad):
    return torch.softmax((q @ k.mT * 0.25).masked_fill((pad[:, None, None, :] - 1) > 0, float("-inf")), -1) @ v


def _int16_positions_that_wrap(q, k, v, pad):
    i, j = _positions(q, k, torch.int16)
    return torch.softmax((q @ k.mT * 0.25).masked_fill(i * 2000 - j * 1000 < 0, float("-inf")), -1) @ v


@pytest.mark.parametrize("fn", [_hash_of_positions, _constant_beyond_int32, _int32_positions_that_wrap,
                                _uint8_below_zero, _int16_positions_that_wrap], ids=lambda f: f.__name__[1:])
def test_integer_arithmetic_beyond_the_kernels_range_falls_back(fn):
    """The kernel computes index arithmetic in int32 and does not wrap narrow integer tensors:
    a hash of int64 positions overflowed it (output error 1.04), a constant beyond int32 crashed
    it, the block scan skipped blocks by the unwrapped values of int32 positions that eager
    wraps (0.62), a uint8 ``pad - 1`` that eager wraps to 255 was -1 (0.58), and int16
    positions that eager wraps were not (1.78). Each falls back with the reason
    (``capture.ranges``) and matches float64."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 20, 16), torch.randn(1, 2, 33, 16), torch.randn(1, 2, 33, 16)
    pad = torch.randint(0, 2, (1, 33), dtype=torch.uint8)
    pad[:, 0] = 1
    report = flashlight.explain(fn, q, k, v, pad)
    assert not report.regions and "range" in report.fallbacks[0].reason, report
    out = torch.compile(fn, backend="flashlight")(q, k, v, pad)     # unfused: eager's NaN rows
    assert rel_error(out.nan_to_num(), reference(fn, q, k, v, pad)) < 1e-5


def test_integer_arithmetic_within_range_still_fuses():
    """Within range, integer masks fuse: chunks by floor division, a uint8 padding compared as
    is or cast to int64 before ``- 1``, windows over int32 positions, int16 lengths minus int64
    positions, int64 document ids (their values unknown here: taken as moderate, as eager's own
    arithmetic on them does)."""
    def masks(q, k, v, pad, ids):
        i, j = _positions(q, k, torch.int32)
        lengths = pad.to(torch.int16).sum(-1)[:, None, None, None]       # int16 minus int64: int64
        keep = (i // 8 == j // 8) | ((pad[:, None, None, :] == 1) & ((i - j).abs() < 5)) | \
            (ids[:, None, :20, None] * 3 - 1 == ids[:, None, None, :] * 3 - 1) | \
            ((pad.long()[:, None, None, :] - 1 < 0) & (lengths - torch.arange(33) > 30))
        return torch.softmax((q @ k.mT * 0.25).masked_fill(~keep, float("-inf")), -1) @ v
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 20, 16), torch.randn(1, 2, 33, 16), torch.randn(1, 2, 33, 16)
    pad = torch.randint(0, 2, (1, 33), dtype=torch.uint8)
    ids = torch.sort(torch.randint(0, 3, (1, 33))).values
    check_fused(masks, q, k, v, pad, ids)
