"""Softmax shifts written other ways: softmax_1 ("quiet" attention: a +1 in the denominator, its
shift clamped at 0: one pass), softpick (relu(e^s - 1) / sum |e^s - 1|, shifted by the row max
taken with ``torch.max(...).values``, masked scores dropped with ``isfinite``: two passes, since
its exp(-m) is unbounded under a running max). Each skips the blocks its mask kills and matches
float64 eager forward and backward through the generated kernels."""
import pytest
import torch
import torch.nn.functional as F

import flashlight
from flashlight.examples import vanilla
from helpers import check_fused, check_grads

B, H, M, N, D = 1, 2, 37, 70, 16


def _scores(q, k, keep):
    i, j = torch.arange(q.shape[-2], device=q.device)[:, None], torch.arange(k.shape[-2], device=q.device)[None, :]
    return (q @ k.mT * q.shape[-1] ** -0.5).masked_fill(~keep(i, j), float("-inf"))


def causal(i, j):
    return j <= i + (N - M)


def late(i, j):          # rows 0..9 see no key
    return j < i - 9


def softmax_one(keep):
    """exp(s_i) / (1 + sum_j exp(s_j)), shifted by max(rowmax, 0) so that exp(-m) cannot overflow."""
    def attention(q, k, v):
        s = _scores(q, k, keep)
        m = s.amax(-1, keepdim=True).clamp(min=0)
        e = torch.exp(s - m)
        return e / (torch.exp(-m) + e.sum(-1, keepdim=True)) @ v
    return attention


def softpick(keep, eps=1e-8):
    """Softpick (Zuhri et al. 2025) as its reference code computes it."""
    def attention(q, k, v):
        x = _scores(q, k, keep)
        x_m = torch.max(x, dim=-1, keepdim=True).values
        x_e_1 = torch.exp(x - x_m) - torch.exp(-x_m)
        a = torch.where(x.isfinite(), torch.abs(x_e_1), 0)
        return F.relu(x_e_1) / (a.sum(-1, keepdim=True) + eps) @ v
    return attention


PROGRAMS = {
    "softmax_one_causal": softmax_one(causal),
    "softmax_one_rows_without_keys": softmax_one(late),
    "softpick_causal": softpick(causal, eps=0.0),
}


def _inputs(**kw):
    return vanilla.make_inputs(B=kw.get("B", B), H=H, M=M, N=N, D=D)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_block_sparse_and_exact(name):
    _, report = check_fused(PROGRAMS[name], *_inputs())
    r = report.regions[0]
    assert ("2-pass" in r.features) == name.startswith("softpick"), r.features
    assert "block-sparse" in r.features and "shift-gradient" not in r.features, r.features
    assert r.backward.startswith("generated"), r.backward


def test_softmax_one_is_a_sink_of_logit_zero():
    """The clamp seeds the max with 0 and exp(-m) seeds the sum: the output reads no shift."""
    r = flashlight.explain(PROGRAMS["softmax_one_causal"], *_inputs()).regions[0]
    assert "sink" in r.features and r.ir.count("extra=") == 2, r.ir


def test_rows_without_keys_are_zero():
    out = torch.compile(PROGRAMS["softmax_one_rows_without_keys"], backend="flashlight")(*_inputs())
    assert torch.isfinite(out).all() and out[:, :, :10].abs().max() == 0


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_gradients_by_the_generated_backward(name):
    check_grads(PROGRAMS[name], [x.requires_grad_() for x in _inputs(B=2)])


def softmax_eps(keep, eps, fill=float("-inf")):
    """A softmax written by hand with an epsilon in its denominator: not invariant to the shift."""
    def attention(q, k, v):
        i, j = torch.arange(q.shape[-2], device=q.device)[:, None], torch.arange(k.shape[-2], device=q.device)[None, :]
        s = (q @ k.mT * q.shape[-1] ** -0.5).masked_fill(~keep(i, j), fill)
        e = torch.exp(s - s.amax(-1, keepdim=True))
        return e / (e.sum(-1, keepdim=True) + eps) @ v
    return attention


def max_read_back(q, k, v):
    """The output reads the row max itself (its gradient reaches the argmax key's score)."""
    s = _scores(q, k, causal)
    m = s.amax(-1, keepdim=True)
    return torch.softmax(s, -1) @ v + m * 0.5


SHIFT_GRADIENTS = {
    "softpick": softpick(causal),
    "softmax_eps": softmax_eps(causal, eps=0.5),
    # rows 0..9 keep no key: every score there is the fill, a tie the first key takes (no
    # gradient reaches a filled score either way)
    "softmax_eps_filled_rows": softmax_eps(late, eps=0.5, fill=-1e9),
    "max_read_back": max_read_back,
}


@pytest.mark.parametrize("name", list(SHIFT_GRADIENTS))
def test_shift_gradient_at_the_argmax(name):
    """Outputs that depend on the shift (an epsilon, a read of the max): dL/dm reaches the score
    at the argmax the forward saved, through the generated kernels."""
    fn = SHIFT_GRADIENTS[name]
    _, report = check_fused(fn, *_inputs())
    r = report.regions[0]
    assert ("2-pass" in r.features) == (name == "softpick"), r.features
    assert r.backward.startswith("generated"), r.backward
    assert "shift-gradient" in r.features
    check_grads(fn, [x.requires_grad_() for x in _inputs(B=2)])


def test_clamped_max_read_unclamped_too_stays_exact():
    """The clamp becomes the max's extra element only where every read of the max is clamped."""
    def attention(q, k, v):
        s = _scores(q, k, causal)
        mx = s.amax(-1, keepdim=True)
        e = torch.exp(s - mx.clamp(min=0))
        return e / e.sum(-1, keepdim=True) @ v + mx
    _, report = check_fused(attention, *_inputs())
    assert "extra=" not in report.regions[0].ir


def test_unclamped_softmax_one():
    """Without the clamp the max is not seeded (exp(-m) may overflow before the loop, as in eager):
    the +1 stays in the output, which reads the shift only as exp(-m), invariant with the sums:
    no shift gradient."""
    def attention(q, k, v):
        s = q @ k.mT * q.shape[-1] ** -0.5
        m = s.amax(-1, keepdim=True)
        e = torch.exp(s - m)
        return e / (torch.exp(-m) + e.sum(-1, keepdim=True)) @ v
    _, report = check_fused(attention, *_inputs())
    r = report.regions[0]
    assert "shift-gradient" not in r.features and "sink" not in r.features, r.features
    check_grads(attention, [x.requires_grad_() for x in _inputs()])


def test_float_class_tests_and_amin_fuse():
    """``isneginf``, ``isinf``, ``isnan`` and ``amin`` in the score program: captured, not
    computed as score-sized tensors outside the kernel."""
    def attention(q, k, v):
        s = _scores(q, k, causal)
        e = torch.exp(s - s.amax(-1, keepdim=True)).masked_fill(s.isneginf() | s.isnan(), 0.0)
        e = torch.where(s.isinf(), 0.0, e) + 0.01 * (s.amin(-1, keepdim=True) > -1e30)
        return e / e.sum(-1, keepdim=True) @ v
    _, report = check_fused(attention, *_inputs())
    assert "block-sparse" not in report.regions[0].features     # the 0.01 term keeps every key


KB = torch.zeros(N)
KB[:16] = -100.0        # the first key block far below the rest (a distance penalty, ALiBi's)


def softpick_penalised(q, k, v):
    x = q @ k.mT * 0.25 + KB
    x_m = torch.max(x, dim=-1, keepdim=True).values
    x_e_1 = torch.exp(x - x_m) - torch.exp(-x_m)
    return F.relu(x_e_1) / (torch.where(x.isfinite(), x_e_1.abs(), 0).sum(-1, keepdim=True) + 1e-8) @ v


def softpick_padded(q, k, v):
    """Masked keys without softpick's isfinite guard: each adds exp(-m) to the denominator."""
    x = (q @ k.mT * 0.25).masked_fill(torch.arange(N) < 20, float("-inf"))
    x_m = x.amax(-1, keepdim=True)
    x_e_1 = torch.exp(x - x_m) - torch.exp(-x_m)
    return F.relu(x_e_1) / (x_e_1.abs().sum(-1, keepdim=True) + 1e-8) @ v


def softmax_one_clamped_low(q, k, v):
    s = q @ k.mT * 0.25
    m = s.amax(-1, keepdim=True).clamp(min=-100.0)
    e = torch.exp(s - m)
    return e / (torch.exp(-m) + e.sum(-1, keepdim=True)) @ v


@pytest.mark.parametrize("fn", [softpick_penalised, softpick_padded, softmax_one_clamped_low],
                         ids=lambda f: f.__name__)
def test_unbounded_row_terms_wait_for_the_final_max(fn):
    """exp(-m) under a running max that starts at -inf, or below the clamp, is unbounded: an early
    block far below the rest made exp(-m_running) overflow (outputs 0 or NaN), and while the
    running max was -inf the rescale dropped masked keys' terms (rel error 0.29); a clamp at -100
    seeded the sum with exp(100) = inf. Such a sum takes a second pass (or the term stays in the
    output), and still trains through the generated kernels (a review's reproducers)."""
    check_fused(fn, *_inputs())
    check_grads(fn, [x.requires_grad_() for x in _inputs()])
