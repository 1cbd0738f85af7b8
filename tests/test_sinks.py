"""Attention sinks written with ``torch.cat`` (gpt-oss): the appended logit column joins the
softmax's max and sum as a row-level extra element, never P @ V, and never widens the key loop."""
import pytest
import torch

from flashlight.examples import sinks, sinks_sliding_window
from flashlight.testing import reference, rel_error
from helpers import check_fused, check_grads

B, H, M, N, D = 1, 2, 37, 70, 16


def _masked(keep):
    """A sink program whose scores are masked with ``keep(i, j)`` before the concatenation."""
    def attention(q, k, v, s_h):
        Bq, Hq, Mq, _ = q.shape
        i, j = torch.arange(Mq)[:, None], torch.arange(k.shape[-2])[None, :]
        s = (q @ k.mT * 0.25).masked_fill(~keep(i, j), float("-inf"))
        col = s_h.view(1, -1, 1, 1).expand(Bq, Hq, Mq, 1)
        return torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :N] @ v
    return attention


PROGRAMS = {
    "reshape_expand": sinks.attention,
    "causal_sliding": sinks_sliding_window.attention,
    "causal": _masked(lambda i, j: j <= i),
    # rows 0..9 see no key at all: the sink alone keeps their denominator positive (output 0)
    "fully_masked_rows": _masked(lambda i, j: j < i - 9),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_sink_fuses_and_matches_fp64(name):
    inputs = sinks.make_inputs(B=B, H=H, M=M, N=N, D=D)
    _, report = check_fused(PROGRAMS[name], *inputs)
    r = report.regions[0]
    assert "sink" in r.features and "online-softmax" in r.features
    assert "cat_n" not in r.ir and r.ir.count("extra=") == 2      # the max and the sum, not P @ V


def test_fully_masked_rows_are_zero_not_nan():
    inputs = sinks.make_inputs(B=B, H=H, M=M, N=N, D=D)
    out = torch.compile(PROGRAMS["fully_masked_rows"], backend="flashlight")(*inputs)
    assert torch.isfinite(out).all() and out[:, :, :10].abs().max() == 0


def test_sink_logit_read_back_is_the_column():
    """softmax(cat)[..., -1] is the sink's probability: the column at position N, with no P @ V."""
    def attention(q, k, v, s_h):
        s = torch.cat([q @ k.mT * 0.25, s_h.view(1, -1, 1, 1).expand(B, H, M, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)
        return p[..., :-1] @ v * (1 - p[..., -1:])
    check_fused(attention, *sinks.make_inputs(B=B, H=H, M=M, N=N, D=D))


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_sink_gradients_by_the_generated_backward(name):
    """q, k, v and the sink logits (a per-head parameter, summed over batch and rows by the row
    kernel) against float64, through the generated kernels; rows with no key included."""
    inputs = [x.requires_grad_() for x in sinks.make_inputs(B=2, H=H, M=M, N=N, D=D)]
    check_grads(PROGRAMS[name], inputs)


def test_gpt_oss_sdpa_gradients():
    T, Hkv, G, Dh = 37, 2, 2, 16
    args = [x.requires_grad_() for x in (torch.randn(T, Hkv, G, Dh), torch.randn(T, Hkv, Dh),
                                         torch.randn(T, Hkv, Dh), torch.randn(Hkv * G))]
    check_grads(_gpt_oss_sdpa, args)


def test_sink_gradcheck_fp64():
    inputs = [x.requires_grad_() for x in sinks.make_inputs(B=1, H=1, M=5, N=6, D=4, dtype=torch.float64)]
    fast = torch.compile(sinks.attention, backend="flashlight")
    assert torch.autograd.gradcheck(lambda *xs: fast(*xs), inputs)


def test_other_concatenations_stay_unfused_leaves():
    """A cat along the head dim (rotary embeddings' rotate_half) is computed outside the kernel."""
    def attention(q, k, v):
        half = q.shape[-1] // 2
        rot = torch.cat([-q[..., half:], q[..., :half]], dim=-1)
        return torch.softmax((q + rot) @ k.mT * 0.25, -1) @ v
    q, k, v = (torch.randn(B, H, M, D), torch.randn(B, H, N, D), torch.randn(B, H, N, D))
    _, report = check_fused(attention, q, k, v)
    assert "sink" not in report.regions[0].features


def _gpt_oss_sdpa(Q, K, V, S, sm_scale=0.25, sliding_window=8):
    """gpt-oss's reference ``sdpa`` verbatim (github.com/openai/gpt-oss, gpt_oss/torch/model.py):
    GQA layout [T, H_kv, G, D], einsums with a permuted output, in-place score updates."""
    n_tokens, n_heads, q_mult, d_head = Q.shape
    assert K.shape == (n_tokens, n_heads, d_head)
    assert V.shape == (n_tokens, n_heads, d_head)
    K = K[:, :, None, :].expand(-1, -1, q_mult, -1)
    V = V[:, :, None, :].expand(-1, -1, q_mult, -1)
    S = S.reshape(n_heads, q_mult, 1, 1).expand(-1, -1, n_tokens, -1)
    mask = torch.triu(Q.new_full((n_tokens, n_tokens), -float("inf")), diagonal=1)
    if sliding_window > 0:
        mask += torch.tril(mask.new_full((n_tokens, n_tokens), -float("inf")), diagonal=-sliding_window)
    QK = torch.einsum("qhmd,khmd->hmqk", Q, K)
    QK *= sm_scale
    QK += mask[None, None, :, :]
    QK = torch.cat([QK, S], dim=-1)
    W = torch.softmax(QK, dim=-1)
    W = W[..., :-1]
    attn = torch.einsum("hmqk,khmd->qhmd", W, V)
    return attn.reshape(n_tokens, -1)


def test_gpt_oss_sdpa_verbatim_is_one_kernel():
    T, Hkv, G, Dh = 37, 2, 2, 16
    args = (torch.randn(T, Hkv, G, Dh), torch.randn(T, Hkv, Dh), torch.randn(T, Hkv, Dh), torch.randn(Hkv * G))
    _, report = check_fused(_gpt_oss_sdpa, *args)      # no score-sized in-place update left behind
    assert {"sink", "gqa", "permuted-store", "block-sparse"} <= set(report.regions[0].features)


def test_inplace_update_of_a_tensor_read_later_stays_outside():
    """``s *= c`` where s is returned too: the update is visible outside, so Inductor does it."""
    def attention(q, k, v):
        s = q @ k.mT
        s *= 0.25
        return torch.softmax(s, -1) @ v, s
    q, k, v = torch.randn(B, H, M, D), torch.randn(B, H, N, D), torch.randn(B, H, N, D)
    got = torch.compile(attention, backend="flashlight")(q, k, v)
    for i in range(2):
        assert rel_error(got[i], reference(lambda *a: attention(*a)[i], q, k, v)) < 1e-5
