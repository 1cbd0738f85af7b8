"""Programs FlexAttention cannot express fuse into one kernel each and match float64 eager,
forward and backward: differential attention, gated output, hand-written softmax, softmax-free
attention, Evoformer gated attention with pair bias, learned relative-position tables."""
import pytest

from flashlight.examples import (BEYOND_NAMES, VARIANTS, diff_attention, diff_transformer, evoformer, post_softmax,
                                 relative_position)
from helpers import check_fused, check_grads


@pytest.mark.parametrize("name", BEYOND_NAMES)
def test_fuses_and_matches_fp64(name):
    mod = VARIANTS[name]
    check_fused(mod.attention, *mod.make_inputs(B=1, H=2, M=37, D=16))


def test_diff_attention_is_one_kernel_with_shared_v():
    _, report = check_fused(diff_attention.attention, *diff_attention.make_inputs(B=1, H=2, M=40, D=16))
    r = report.regions[0]
    assert "2-scores" in r.features
    loop = r.kernel_source.split("for start_n")[1]
    v_ptr = loop.split("tl.dot(p")[1].split(",")[1].strip()          # the V tile of the first P @ V
    assert loop.count(f"{v_ptr} = tl.load") == 1 and loop.count(f", {v_ptr},") == 2


@pytest.mark.parametrize("mod", [diff_attention, diff_transformer, evoformer, relative_position, post_softmax],
                         ids=lambda m: m.__name__.rsplit(".")[-1])
def test_gradients_reach_lambda_biases_and_tables(mod):
    """All from the generated backward: DiffAttn's lambda and RMSNorm weight (a dv-sum in the
    epilogue, a head-merging store; written both ways), Evoformer's gate and pair bias, the
    relative-position table and the post-softmax gate."""
    check_grads(mod.attention, mod.make_inputs(B=1, H=2, M=21, D=16))


def test_diff_transformer_product_of_two_maps_is_split_into_one_pass():
    """The reference code's ``(w1 - λ w2) @ v`` reads two softmaxes in one product: split into
    one product per map (``rewrite.split_sums``), the kernel is one pass with two accumulators,
    like ``diff_attention``'s, and trains with the generated kernels (above)."""
    _, report = check_fused(diff_transformer.attention, *diff_transformer.make_inputs(B=1, H=2, M=37, D=16))
    r = report.regions[0]
    assert not any(f.endswith("-pass") for f in r.features), r.features
    loop = r.kernel_source.split("for start_n")[1].split("\n    for ")[0]       # the loop over unmasked blocks
    assert loop.count("tl.dot(p") == 2


def test_post_softmax_gate_and_renormalisation_is_one_pass():
    _, report = check_fused(post_softmax.attention, *post_softmax.make_inputs(B=1, H=2, M=37, D=16))
    assert not any(f.endswith("-pass") for f in report.regions[0].features)
