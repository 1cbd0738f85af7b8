"""Two score products with contractions of different lengths, added, run as one product over the
concatenated contraction (capture/products.py): fused whole, no N x N tensor outside the kernel."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import flashlight
from flashlight.capture import products
from helpers import check_fused, check_grads

B, H, M, N, D, R = 2, 2, 37, 45, 16, 6


def decoupled_rope(q, k, v, qr, kr):
    # a content product and a rotary one over its own 6 dims, each scaled, the second subtracted
    s = q @ k.transpose(-1, -2) * 0.25 - 0.3 * (qr @ kr.transpose(-1, -2))
    return torch.softmax(s, -1) @ v


def absorbed_mla(q_nope, q_pe, kv, pe):
    # DeepSeek-V3 inference/model.py, attn_impl="absorb": the latent kv is both K and V
    scores = (torch.einsum("bshc,btc->bsht", q_nope, kv) + torch.einsum("bshr,btr->bsht", q_pe, pe)) * 0.2
    return torch.einsum("bsht,btc->bshc", scores.softmax(dim=-1), kv)


def hand_softmax(q, k, v, qr, kr):
    # the softmax written out (exp of the scores less their max, over its row sum)
    s = q @ k.transpose(-1, -2) * 0.25 + qr @ kr.transpose(-1, -2) * 0.5
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)) @ v


def equal_lengths(q, k, v, q2, k2):
    return torch.softmax(q @ k.mT * 0.25 + q2 @ k2.mT * 0.25, -1) @ v


def rope_inputs():
    return [torch.randn(B, H, M, D), torch.randn(B, H, N, D), torch.randn(B, H, N, D),
            torch.randn(B, H, M, R), torch.randn(B, H, N, R)]


def mla_inputs():
    return [torch.randn(B, 9, 5, D), torch.randn(B, 9, 5, R), torch.randn(B, N, D), torch.randn(B, N, R)]


@pytest.mark.parametrize("fn, make, dk", [(decoupled_rope, rope_inputs, D + R), (absorbed_mla, mla_inputs, D + R),
                                          (hand_softmax, rope_inputs, D + R)])
def test_products_of_different_lengths_run_as_one_dot(fn, make, dk):
    inputs = make()
    _, report = check_fused(fn, *inputs)        # no score-sized tensor computed outside the kernel
    assert report.regions[0].shapes["DK"] == dk and "bias" not in report.regions[0].features, report
    check_grads(fn, inputs)


def test_products_of_equal_lengths_stay_two_dots():
    inputs = rope_inputs()[:3] + [torch.randn(B, H, M, D), torch.randn(B, H, N, D)]
    _, report = check_fused(equal_lengths, *inputs)
    assert report.regions[0].shapes["DK"] == D


def _joined(fn, *inputs):
    """(sums joined, the graph module after) of ``fn``'s pre-dispatch ATen graph traced on fakes."""
    gm = make_fx(fn, tracing_mode="fake", pre_dispatch=True)(*inputs)
    return products.join(gm), gm


def test_join_rewrites_only_scores_a_softmax_reads():
    a, b, c, d = torch.randn(4, 8), torch.randn(8, 5), torch.randn(4, 3), torch.randn(3, 5)
    n, _ = _joined(lambda a, b, c, d: a @ b + c @ d, a, b, c, d)        # a sum of products: not scores
    assert n == 0
    scores = lambda a, b, c, d: torch.softmax(a @ b * 2 - c @ d / 4, -1)     # noqa: E731
    n, gm = _joined(scores, a, b, c, d)
    graph = str(gm.graph)
    assert n == 1 and graph.count("aten.matmul") == 1 and graph.count("aten.cat") == 2, graph
    torch.testing.assert_close(gm(a, b, c, d), scores(a, b, c, d))


def _inplace_after_product(q, k, v, qr, kr):
    q = q * 1.0
    s1 = q @ k.mT
    q.mul_(3.0)                      # written after the first product read it
    return torch.softmax(s1 * 0.25 + (qr @ kr.mT) * 0.3, -1) @ v + q[..., :1]


def _inplace_after_second(q, k, v, qr, kr):
    kr = kr.clone()
    s2 = qr @ kr.mT
    kr.zero_()
    return torch.softmax(q @ k.mT * 0.25 + s2, -1) @ v + kr.sum()


@pytest.mark.parametrize("fn", [_inplace_after_product, _inplace_after_second])
def test_no_join_across_an_in_place_write(fn):
    """The joined product would read an operand after an in-place write the product came before
    (a review's reproducers: relative error 0.18 and 0.92). Unjoined, the second product is an
    N x N tensor computed outside the kernel."""
    check_fused(fn, *rope_inputs(), score_numel=B * H * M * N + 1)


def test_no_join_across_grad_mode_or_autocast_switches():
    def no_grad_term(q, k, v, qr, kr):
        with torch.no_grad():
            s2 = qr @ kr.mT
        return torch.softmax(q @ k.mT * 0.25 + s2 * 0.3, -1) @ v

    inputs = [x.requires_grad_() for x in rope_inputs()]
    out = torch.compile(no_grad_term, backend="flashlight")(*inputs)
    got = torch.autograd.grad(out.sum(), inputs, allow_unused=True)
    want = torch.autograd.grad(no_grad_term(*inputs).sum(), inputs, allow_unused=True)
    assert [g is None for g in got] == [g is None for g in want] == [False, False, False, True, True]

    def sum_under_autocast(q, k, v, qr, kr):
        s1, s2 = q @ k.mT * 0.25, qr @ kr.mT * 0.3      # float32, outside the autocast block
        with torch.autocast("cpu", dtype=torch.bfloat16):
            s = s1 + s2
            o = torch.softmax(s, -1).float() @ v.float()
        return o, s
    inputs = rope_inputs()
    got, want = torch.compile(sum_under_autocast, backend="flashlight")(*inputs), sum_under_autocast(*inputs)
    assert got[1].dtype == want[1].dtype == torch.float32
    torch.testing.assert_close(got[1], want[1])


def test_integer_products_and_zero_scales_are_not_joined():
    def int_scores(q, k, v, qr, kr):
        s = q @ k.mT * 0.05 + qr @ kr.mT * 0.1
        return torch.softmax(s, -1).to(v.dtype) @ v
    q, k, v, qr, kr = rope_inputs()
    ints = [x.mul(2).round().long() for x in (q, k, qr, kr)]
    check_fused(int_scores, ints[0], ints[1], v, ints[2], ints[3], score_numel=B * H * M * N + 1)
    a, b, c, d = torch.randn(4, 8), torch.randn(8, 5), torch.randn(4, 3), torch.randn(3, 5)
    n, _ = _joined(lambda a, b, c, d: torch.softmax(a @ b / 0.0 + c @ d, -1), a, b, c, d)
    assert n == 0


WEIGHTS_SECOND = {
    # slot attention's spelling of P @ V: the weights the second operand
    "einsum": lambda q, k, v: torch.einsum("bhjd,bhij->bhid", v, (torch.einsum("bhid,bhjd->bhij", q, k) * 0.25).softmax(-1)),
    # V^T times [keys, queries] weights (a softmax over dim -2), transposed back
    "matmul": lambda q, k, v: (v.mT @ torch.softmax(k @ q.mT * 0.25, -2)).mT,
}


@pytest.mark.parametrize("name", list(WEIGHTS_SECOND))
def test_weights_written_second_fuse(name):
    """``einsum("bhjd,bhij->bhid", v, attn)``, ``(v^T @ attn)^T`` (products.weights_first swaps
    the operands): fused whole, outputs and gradients against float64. Before, the product was
    read as V^T times the weights and nothing fused, without a reason."""
    inputs = [torch.randn(B, H, L, D) for L in (M, N, N)]
    check_fused(WEIGHTS_SECOND[name], *inputs)
    check_grads(WEIGHTS_SECOND[name], [x.requires_grad_() for x in inputs])


def test_a_softmax_over_the_queries_in_weights_written_second_has_a_reason():
    """Slot attention normalises over the slots (the queries), then over the inputs: it does not
    fuse, and explain() says why instead of listing nothing."""
    def slot_attention(slots, k, v):
        attn = torch.einsum("bid,bjd->bij", slots * 0.25, k).softmax(dim=1) + 1e-8
        return torch.einsum("bjd,bij->bid", v, attn / attn.sum(dim=-1, keepdim=True))
    report = flashlight.explain(slot_attention, torch.randn(2, 7, D), torch.randn(2, N, D), torch.randn(2, N, D))
    assert not report.regions and "softmax over dim 1" in report.fallbacks[0].reason, report
