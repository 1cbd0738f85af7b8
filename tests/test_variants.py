"""Every example variant fuses into one generated kernel and matches float64 eager."""
import pytest
import torch

import flashlight

from flashlight.examples import VARIANTS, key_padding
from helpers import check_fused

SHAPES = [dict(B=1, H=2, M=37, D=16), dict(B=2, H=2, M=70, D=32), dict(B=1, H=2, M=64, D=24)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{M}D{D}".format(**s))
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_fuses_and_matches_fp64(name, shape):
    mod = VARIANTS[name]
    check_fused(mod.attention, *mod.make_inputs(**shape))


def test_small_window_and_prefix_change_the_result():
    """Window/prefix sizes smaller than the sequence, so the masks actually cut."""
    from flashlight.examples import prefix_lm, sliding_window
    q, k, v = sliding_window.make_inputs(B=1, H=2, M=50, D=16)
    check_fused(lambda q, k, v: sliding_window.attention(q, k, v, window=7), q, k, v)
    check_fused(lambda q, k, v: prefix_lm.attention(q, k, v, prefix=9), q, k, v)


def test_fully_masked_rows_give_zero_not_nan():
    q, k, v, valid = key_padding.make_inputs(B=2, H=2, M=20, N=33, D=16, lengths=[0, 5])
    out, _ = check_fused(key_padding.attention, q, k, v, valid)
    assert torch.all(out[0] == 0)
    assert not torch.isnan(out).any()


def test_finite_mask_value_matches_eager_on_empty_rows():
    """-1e9 instead of -inf: an all-masked row is a uniform average in eager, and here too."""
    def attn(q, k, v, valid):
        s = q @ k.mT * q.shape[-1] ** -0.5
        return torch.softmax(s.masked_fill(~valid[:, None, None, :], -1e9), -1) @ v
    q, k, v, valid = key_padding.make_inputs(B=2, H=2, M=20, N=33, D=16, lengths=[0, 5])
    out, _ = check_fused(attn, q, k, v, valid)
    assert out[0].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    mod = VARIANTS["causal"]
    check_fused(mod.attention, *mod.make_inputs(B=1, H=2, M=40, D=16, dtype=dtype), tol=2e-2)


@pytest.mark.parametrize("name,D", [("vanilla", 48), ("causal", 80), ("gqa", 96), ("alibi", 48),
                                    ("document_mask", 80), ("softcap", 48)])
def test_head_dims_that_are_not_powers_of_two_compute_no_padding(name, D):
    """QK^T and P @ V of a head dim like 80 or 96 run as chained dots over power-of-two pieces
    (64 + 16, 64 + 32) instead of one dot padded to 128: the kernel has one dot per piece, and
    no [BLOCK_M, BLOCK_DV] accumulator or output tile."""
    from flashlight.codegen.kernel import dk_chunks
    mod = VARIANTS[name]
    _, report = check_fused(mod.attention, *mod.make_inputs(B=1, H=2, M=37, D=D))
    src = report.regions[0].kernel_source
    for off, width in dk_chunks(D):
        assert f"({off} + tl.arange(0, {width}))" in src and f"tl.full([BLOCK_M, {width}], 0.0" in src
    assert "[BLOCK_M, BLOCK_DV]" not in src


def test_value_pieces_under_gates_head_merging_and_gradients():
    """P @ V in pieces with column-wise epilogues: a sigmoid gate read per (m, dv) at Dv = 80,
    and a head-merging store (out.transpose(1, 2).reshape) at Dv = 96, forward and gradients
    against float64; the backward's dQ, dK and dV in pieces (causal, D = 80), except where an
    operand reads a per-row gate; a norm over the head (a sum over dv) keeps one padded tile."""
    from helpers import check_grads
    gated = VARIANTS["gated"]
    inputs = gated.make_inputs(B=1, H=2, M=29, N=35, D=80)
    _, report = check_fused(gated.attention, *inputs)
    assert "tl.arange(0, 16))[None, :]" in report.regions[0].kernel_source
    check_grads(gated.attention, inputs)

    def merged(q, k, v):
        return (torch.softmax(q @ k.mT * 0.1, -1) @ v).transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
    q, k, v = torch.randn(2, 2, 21, 96), torch.randn(2, 2, 33, 96), torch.randn(2, 2, 33, 96)
    _, report = check_fused(merged, q, k, v)
    assert "tl.full([BLOCK_M, 32], 0.0" in report.regions[0].kernel_source
    check_grads(merged, (q, k, v))

    def causal80(q, k, v):
        s = (q @ k.mT * 0.1).masked_fill(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril().logical_not(),
                                          float("-inf"))
        return torch.softmax(s, -1) @ v
    q80, k80, v80 = torch.randn(1, 2, 45, 80), torch.randn(1, 2, 45, 80), torch.randn(1, 2, 45, 80)
    _, report = check_fused(causal80, q80, k80, v80)
    bwd = flashlight.explain(causal80, q80.requires_grad_(), k80, v80).regions[0].backward_source
    for acc in ("dk0_0_64", "dk0_64_16", "dv0_0_64", "dv0_64_16", "dq0_0_64", "dq0_64_16"):
        assert f"{acc} = tl.zeros" in bwd, acc
    tiles = bwd.split("_rows(")[0]       # the two tile kernels: no padded [*, BLOCK_D*] tile
    assert not any(t in tiles for t in (", BLOCK_DK]", ", BLOCK_DV]", "[BLOCK_DK, ", "[BLOCK_DV, "))
    check_grads(causal80, (q80.detach(), k80, v80))

    def row_scaled(q, k, v, g):     # g's gradient sums over the whole head: dQ/dK keep one tile
        return torch.softmax((q * g[..., None]) @ k.mT * 0.1, -1) @ v
    g = torch.rand(1, 2, 45) + 0.5
    bwd = flashlight.explain(row_scaled, q80.detach().requires_grad_(), k80, v80, g).regions[0].backward_source
    assert "dk0 = tl.zeros([BLOCK_N, BLOCK_DK]" in bwd and "dv0_64_16 = tl.zeros" in bwd
    check_grads(row_scaled, (q80.detach(), k80, v80, g))

    def normed(q, k, v):
        o = torch.softmax(q @ k.mT * 0.1, -1) @ v
        return o * torch.rsqrt((o * o).mean(-1, keepdim=True) + 1e-6)
    _, report = check_fused(normed, q, k, v)
    assert "[BLOCK_M, BLOCK_DV]" in report.regions[0].kernel_source


def test_chunked_head_dim_with_bshd_layout_other_value_dim_and_gradients():
    """Dqk = 48 (32 + 16) with Dv = 24, strided BSHD inputs, and the backward through them."""
    from helpers import check_grads
    q, k = torch.randn(1, 29, 2, 48).transpose(1, 2), torch.randn(1, 41, 2, 48).transpose(1, 2)
    v = torch.randn(1, 41, 2, 24).transpose(1, 2)

    def attn(q, k, v):
        return torch.softmax(q @ k.mT / 48 ** 0.5, -1) @ v
    out, report = check_fused(attn, q, k, v)
    assert "(32 + tl.arange(0, 16))" in report.regions[0].kernel_source
    check_grads(attn, (q, k, v))
