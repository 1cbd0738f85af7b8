"""Invariant point attention: squared distances between 3-D points, summed over points and xyz,
are unrolled into the score expression (exact differences, no ||a||² + ||b||² - 2a·b
cancellation), so AlphaFold-scale coordinates match float64."""
import pytest
import torch

from flashlight.examples import ipa
from helpers import check_fused, check_grads


@pytest.mark.parametrize("offset", [0.0, 1000.0], ids=["centered", "far_from_origin"])
def test_ipa_fuses_and_matches_fp64(offset):
    """Points ~N(0, 10²) Å; then the same structure translated 1 µm away, where the expanded
    form's |x|² ~ 10⁶ would cancel away the distances in fp32."""
    q, k, v, qp, kp, pb, hw = ipa.make_inputs(B=1, H=2, M=37, N=70, D=16)
    _, report = check_fused(ipa.attention, q, k, v, qp + offset, kp + offset, pb, hw)
    ir = report.regions[0].ir
    assert "dot0:" in ir and "dot1:" not in ir       # q·k only: the distances use no contraction


def test_ipa_points_and_heads_of_other_sizes():
    q, k, v, qp, kp, pb, hw = ipa.make_inputs(B=2, H=3, M=21, N=19, D=16, P=8)
    check_fused(ipa.attention, q, k, v, qp, kp, pb, hw)


def test_ipa_gradients_reach_points_bias_and_head_weights():
    check_grads(ipa.attention, ipa.make_inputs(B=1, H=2, M=21, N=30, D=16))


def test_a_large_sum_over_other_dims_is_not_unrolled():
    """A sum over 128 terms of a non-key dim is left to Inductor (with the reason)."""
    def attention(q, k, v, x):
        return torch.softmax(q @ k.mT * 0.25 + x.sum(-1), -1) @ v
    q, k, v = torch.randn(1, 2, 21, 16), torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16)
    _, report = check_fused(attention, q, k, v, torch.randn(1, 2, 21, 30, 128), score_numel=1 << 30)
    assert "in2: sum_1 (1, 2, 21, 30)" in report.regions[0].ir       # a loaded leaf, not 128 terms
