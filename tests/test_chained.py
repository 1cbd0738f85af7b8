"""Sums read by a later pass (``codegen.backward.read_sums``): a body over the normalised
probabilities e / l — a threshold, a square root, an entropy — makes the forward two passes and
its backward take dL/dl through every key. The generated backward completes those row gradients
in a kernel of its own (``SumsWriter``: a walk over the keys per pass, last pass first) before
the tile kernels; gradients of every input match float64 eager at ragged shapes, under masks
with empty rows, GQA and biases read in both passes. The max shift stays a constant wherever the
output is invariant to it (``ir.scaling.scaled_sums``)."""
import pytest
import torch

import flashlight
from flashlight.codegen.backward import backward_support
from flashlight.examples import threshold
from flashlight.ir import Input, Reduction, Region, call, const, load, red, var
from flashlight.ir.scaling import ANY, degree, scaled_sums, shift_gradients
from flashlight.testing import rel_error
from helpers import check_fused, check_grads


def _scores(q, k):
    return q @ k.mT * q.shape[-1] ** -0.5


def soft_threshold(q, k, v):
    p = torch.relu(torch.softmax(_scores(q, k), -1) - 0.02)
    return (p / p.sum(-1, keepdim=True).clamp_min(1e-6)) @ v


def hard_threshold(q, k, v):
    """l only in the comparison: no gradient reaches it through the bodies, no sums kernel."""
    p = torch.softmax(_scores(q, k), -1)
    p = torch.where(p > 0.03, p, 0.0)
    return (p / p.sum(-1, keepdim=True).clamp_min(1e-9)) @ v


def sqrt_weights(q, k, v):
    w = (torch.softmax(_scores(q, k), -1) + 0.01).sqrt()
    return (w / w.sum(-1, keepdim=True)) @ v


def exp_of_softmax(q, k, v):
    return torch.softmax(_scores(q, k) * 4, -1).exp() @ v


def entropy(q, k, v):
    """A row output over the probabilities, log(p + eps) not split into s - m - log l."""
    p = torch.softmax(_scores(q, k), -1)
    return p @ v, -(p * torch.log(p + 1e-9)).sum(-1)


def twice(q, k, v):
    """Two thresholds, each renormalised: three passes, two walks."""
    p = torch.relu(torch.softmax(_scores(q, k), -1) - 0.01)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-6)
    p = torch.relu(p - 0.03)
    return (p / p.sum(-1, keepdim=True).clamp_min(1e-6)) @ v


def adaptive_temperature(q, k, v):
    """Veličković et al.'s adaptive temperature (https://arxiv.org/abs/2410.01104): a second
    softmax sharpened by a polynomial of the first one's entropy. Three passes; the third's
    bodies reverse into the entropy and l, the second's into l."""
    s = _scores(q, k)
    p = torch.softmax(s, -1)
    h = -(p * torch.log(p + 1e-9)).sum(-1, keepdim=True)
    beta = torch.where(h > 0.5, torch.clamp(-0.037 * h**4 + 0.481 * h**3 - 2.3 * h**2 + 4.917 * h - 1.791, min=1.0), 1.0)
    return torch.softmax(s * beta, -1) @ v


def biased(q, k, v, bias):
    """A [H, M, N] bias read by both passes' bodies: its gradient sums both reverses."""
    p = torch.relu(torch.softmax(_scores(q, k) + bias, -1) - 0.02)
    return (p / p.sum(-1, keepdim=True).clamp_min(1e-6)) @ v


def gqa(q, k, v):
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    return soft_threshold(q, k, v)


PROGRAMS = {f.__name__: f for f in (soft_threshold, hard_threshold, sqrt_weights, exp_of_softmax, twice,
                                    adaptive_temperature)}
WALKS = {"soft_threshold": 1, "hard_threshold": 0, "sqrt_weights": 1, "exp_of_softmax": 1, "twice": 2,
         "adaptive_temperature": 2}


def _qkv(M, N, D=16, H=2, Hkv=None):
    g = torch.Generator().manual_seed(M * 1000 + N)
    return [torch.randn(1, h, L, D, generator=g) for h, L in ((H, M), (Hkv or H, N), (Hkv or H, N))]


@pytest.mark.parametrize("M, N", [(21, 37), (40, 40)])
@pytest.mark.parametrize("name", PROGRAMS)
def test_gradients_through_the_normaliser_match_fp64(name, M, N):
    """Forward and every gradient against float64 eager, from the generated kernels; a sums
    kernel with one walk per pass that reverses into a normaliser (none where l is only
    compared)."""
    fn, xs = PROGRAMS[name], _qkv(M, N)
    _, report = check_fused(fn, *xs)
    source = report.regions[0].backward_source
    assert "generated" in report.regions[0].backward, report.regions[0].backward
    walks = source.split("_sums(")[1].split("@triton.jit")[0].count("reversed into the sums") if "_sums(" in source \
        else 0
    assert walks == WALKS[name]
    check_grads(fn, xs)


def test_a_row_output_over_the_probabilities_trains():
    """The output and the entropy row, each with a random weight, against float64."""
    xs = _qkv(21, 37)
    report = flashlight.explain(entropy, *xs)
    assert "generated" in report.regions[0].backward and "_sums(" in report.regions[0].backward_source
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(1, 2, 21, 16, generator=g), torch.randn(1, 2, 21, generator=g)]

    def loss(fn, xs):
        return sum((y * w.to(y.dtype)).sum() for y, w in zip(fn(*xs), weights))
    xs = [x.requires_grad_() for x in xs]
    got = torch.autograd.grad(loss(torch.compile(entropy, backend="flashlight"), xs), xs)
    x64 = [x.detach().double().requires_grad_() for x in xs]
    for a, b in zip(got, torch.autograd.grad(loss(entropy, x64), x64)):
        assert rel_error(a, b) < 1e-3


def test_bias_read_by_both_passes_and_gqa():
    q, k, v = _qkv(19, 33)
    bias = torch.randn(2, 19, 33)
    check_grads(biased, (q, k, v, bias))
    check_grads(gqa, _qkv(21, 37, H=4, Hkv=2))


def test_rows_without_keys_get_zero_gradients():
    """A mask leaving rows 3, 10, 17 without a key: 0 out and no gradient (the oracle spells
    that out: eager's softmax gives NaN there); sparsity skips the masked blocks in every walk."""
    q, k, v = _qkv(20, 35)

    def keep(q, k):
        qi, ki = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
        return (ki <= qi) & (qi % 7 != 3)

    def attn(q, k, v):
        p = torch.softmax(_scores(q, k).masked_fill(~keep(q, k), float("-inf")), -1)
        p = torch.relu(p - 0.02)
        return (p / p.sum(-1, keepdim=True).clamp_min(1e-6)) @ v

    def oracle(q, k, v):
        mask = keep(q, k)
        live = mask.any(-1, keepdim=True)
        s = _scores(q, k).masked_fill(~mask, float("-inf")).masked_fill(~live, 0.0)
        p = torch.relu(torch.softmax(s, -1) * live - 0.02)
        return (p / p.sum(-1, keepdim=True).clamp_min(1e-6)) @ v
    check_grads(attn, (q, k, v), ref_fn=oracle)


def test_threshold_example_trains_through_the_sums_kernel(monkeypatch):
    """... and the sums kernel's launch for autotuning (``op.tuned_run``) adds into a copy of the
    row gradients: run twice before the real launch, it returns the same sums both times, and
    the gradients stay right."""
    from flashlight.runtime import op
    xs = threshold.make_inputs(B=1, H=2, M=45, D=16)
    report = flashlight.explain(threshold.attention, *xs)
    r = report.regions[0]
    assert "2-pass" in r.features and "shift-gradient" not in r.features
    assert "_sums(" in r.backward_source
    fitting, timed = op.CompiledRegion.fitting, []

    def tuning_first(self, inputs, launch, kernel="fwd", tune=None):
        if kernel == "sums":
            cfg = self.config(inputs, kernel)
            a = [x.clone() for x in tune(cfg)]
            b = tune(cfg)
            timed.append(len(a) == 1 and torch.allclose(a[0], b[0], rtol=0, atol=0, equal_nan=True))
        return fitting(self, inputs, launch, kernel, tune)
    monkeypatch.setattr(op.CompiledRegion, "fitting", tuning_first)
    check_grads(threshold.attention, xs)
    assert timed == [True]


def test_a_max_the_output_depends_on_keeps_the_reference():
    """sqrt(exp(s - m) + 0.1) is not homogeneous in exp(-m): the output depends on the max, which
    takes a gradient at its argmax; a body reading the max other than as its shift is left to
    the reference VJP (still exact), as is a max taking a gradient beside sums a later pass
    reads."""
    def offset(q, k, v):
        s = _scores(q, k)
        w = ((s - s.amax(-1, keepdim=True)).exp() + 0.1).sqrt()
        return (w / w.sum(-1, keepdim=True)) @ v

    def eps_softmax(q, k, v):
        s = _scores(q, k)
        e = (s - s.amax(-1, keepdim=True)).exp()
        return (e / (e.sum(-1, keepdim=True) + 1e-3)).exp() @ v
    xs = _qkv(13, 13)
    for fn, reason in ((offset, "other than its softmax shift"), (eps_softmax, "a max taking a gradient")):
        report = flashlight.explain(fn, *xs)
        assert "shift-gradient" in report.regions[0].features
        assert "reference VJP" in report.regions[0].backward and reason in report.regions[0].backward
        check_grads(fn, xs, generated=False)


def _region(reductions, out) -> Region:
    return Region((1,), 4, 4, 1, 1, [Input("s", (1, 4, 4), torch.float32)], [], reductions, out, torch.float32)


def test_degrees_of_later_sums():
    """``scaled_sums``: a later pass's sum over e / l is homogeneous in exp(-m) (degree 1 for
    where(e / l > t, e, 0) and e log(e / l), 0 for a sum of (e / l)^2); one it cannot follow
    (exp(e) over l's pass) is None, so the output depends on the max. A constant 0 is of any
    degree, and a comparison of equal degrees is invariant."""
    s = load(0, (var("b0"), var("m"), var("n")), "f")
    e = call("exp", s - red(0))
    p = call("div", e, red(1))
    base = [Reduction("max", s), Reduction("sum", e, online=0)]
    cases = [(call("where", call("gt", p, const(0.1)), e, const(0.0)), 1.0),
             (e * call("log", p), 1.0),
             (p * p, 0.0),
             (call("exp", e), None)]
    for body, want in cases:
        r = _region(base + [Reduction("sum", body)], call("div", red(2), red(1)))
        assert scaled_sums(r, 0) == {1: 1.0, 2: want}
        assert shift_gradients(r) == ([] if want == 1.0 else [0])
    assert degree(call("maximum", red(1), const(0.0)), {1}) == 1.0
    assert degree(call("gt", red(1), const(0.0)), {1}) == 0.0
    assert degree(call("gt", red(1), const(0.5)), {1}) is None
    assert degree(call("mul", red(1), const(0.0)), {1}) == 0.0 and ANY == float("inf")


def test_support_reasons():
    """A later pass may read plain sums; not a max taking a gradient beside them."""
    s = load(0, (var("b0"), var("m"), var("n")), "f")
    e = call("exp", s - red(0))
    soft = call("relu", call("div", e, red(1)) - 0.1)
    r = _region([Reduction("max", s), Reduction("sum", e, online=0), Reduction("sum", soft)], red(2))
    assert backward_support(r) is None and shift_gradients(r) == []
    r.out = call("div", red(2), red(1))        # red2 is of degree 0, red1 of 1: the max takes a gradient
    assert "a max taking a gradient" in backward_support(r)
