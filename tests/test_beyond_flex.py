"""Programs FlexAttention cannot express fuse into one kernel each and match float64 eager,
forward and backward: differential attention, gated output, hand-written softmax, softmax-free
attention, Evoformer gated attention with pair bias, learned relative-position tables."""
import math

import pytest
import torch
import torch.nn.functional as F

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


def _diff_transformer_layer(x, wq, wk, wv, lq1, lk1, lq2, lk2, subln, H=2, lambda_init=0.2):
    """The reference code's MultiheadDiffAttn.forward (no rotary, n_rep = 1), its lines as
    written: q, k, v projections, ``q *= scaling`` on a view, an additive causal mask built by
    ``torch.triu(torch.zeros(..).float().fill_(-inf))``, ``nan_to_num`` of the scores, a float32
    softmax cast back, the maps of heads 2h and 2h + 1 combined before the product with v."""
    bsz, tgt_len, embed_dim = x.shape
    src_len = tgt_len
    head_dim = embed_dim // H // 2
    q, k, v = x @ wq, x @ wk, x @ wv
    q = q.view(bsz, tgt_len, 2 * H, head_dim)
    k = k.view(bsz, src_len, 2 * H, head_dim)
    v = v.view(bsz, src_len, H, 2 * head_dim)
    offset = src_len - tgt_len
    q = q.transpose(1, 2)
    k = k.transpose(1, 2)
    v = v.transpose(1, 2)
    q *= head_dim ** -0.5
    attn_weights = torch.matmul(q, k.transpose(-1, -2))
    attn_mask = torch.triu(torch.zeros([tgt_len, src_len]).float().fill_(float("-inf")).type_as(attn_weights),
                           1 + offset)
    attn_weights = torch.nan_to_num(attn_weights)
    attn_weights += attn_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).type_as(attn_weights)
    lambda_1 = torch.exp(torch.sum(lq1 * lk1, dim=-1).float()).type_as(q)
    lambda_2 = torch.exp(torch.sum(lq2 * lk2, dim=-1).float()).type_as(q)
    lambda_full = lambda_1 - lambda_2 + lambda_init
    attn_weights = attn_weights.view(bsz, H, 2, tgt_len, src_len)
    attn_weights = attn_weights[:, :, 0] - lambda_full * attn_weights[:, :, 1]
    attn = torch.matmul(attn_weights, v)
    attn = attn * torch.rsqrt(attn.pow(2).mean(-1, keepdim=True) + 1e-5) * subln
    attn = attn * (1 - lambda_init)
    return attn.transpose(1, 2).reshape(bsz, tgt_len, H * 2 * head_dim)



def test_diff_transformer_reference_code_as_written():
    """A model's own attention code fuses unchanged, forward and backward: every weight,
    λ's four vectors and the sub-layer norm get float64's gradients from the generated kernels."""
    E, H = 32, 2
    hd = E // H // 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 37, E, generator=g)
    ws = [torch.randn(E, E, generator=g) / math.sqrt(E) for _ in range(3)]
    lams = [0.1 * torch.randn(hd, generator=g) for _ in range(4)]
    inputs = (x, *ws, *lams, 1 + 0.1 * torch.randn(2 * hd, generator=g))
    _, report = check_fused(_diff_transformer_layer, *inputs)
    assert {"block-sparse", "2-scores"} <= set(report.regions[0].features)
    assert not any(f.endswith("-pass") for f in report.regions[0].features)
    check_grads(_diff_transformer_layer, inputs)


def test_post_softmax_gate_and_renormalisation_is_one_pass():
    _, report = check_fused(post_softmax.attention, *post_softmax.make_inputs(B=1, H=2, M=37, D=16))
    assert not any(f.endswith("-pass") for f in report.regions[0].features)
