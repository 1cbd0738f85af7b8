"""Extra outputs: row values a program returns next to the attention output (logsumexp, row max,
attention entropy) come out of the same kernel, computed from its reductions, with gradients."""
import math

import pytest
import torch

import flashlight
from flashlight.runtime.op import REGISTRY
from flashlight.testing import rel_error, score_sized_nodes, to64


def lse_and_max(q, k, v):
    s = q @ k.mT * q.shape[-1] ** -0.5
    m, n = torch.arange(s.shape[-2])[:, None], torch.arange(s.shape[-1])
    s = s.masked_fill(n > m - 5, float("-inf"))            # rows 0..4: every key masked
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1), s.amax(-1, keepdim=True)


def entropy(q, k, v):
    s = q @ k.mT * q.shape[-1] ** -0.5
    p = torch.softmax(s, -1)
    return p @ v, -(p * torch.log_softmax(s, -1)).sum(-1)


def hand_lse(q, k, v):
    """The statistics written out by hand: max, sum of exp, their logsumexp."""
    s = q @ k.mT / 4.0
    mx = s.amax(-1, keepdim=True)
    l = (s - mx).exp().sum(-1, keepdim=True)
    return ((s - mx).exp() / l) @ v, (mx + l.log()).squeeze(-1)


def compare(fn, *args, tol=1e-4):
    """Compile ``fn``, check it fused into one region with row outputs and no score-sized tensor
    left to Inductor, and compare every output with float64 eager (-inf where eager has -inf;
    NaN rows of the attention output are 0, Flashlight's convention)."""
    report = flashlight.explain(fn, *args)
    assert len(report.regions) == 1, str(report)
    r = report.regions[0]
    assert "row0" in r.ir
    numel = math.prod(r.shapes["batch"]) * r.shapes["M"] * r.shapes["N"]
    assert not any(score_sized_nodes(g, numel) for g in report.graphs)
    launches = REGISTRY[r.key].launches
    got = torch.compile(fn, backend="flashlight")(*args)
    assert REGISTRY[r.key].launches > launches
    ref = fn(*(to64(a) for a in args))
    for a, b in zip(got, ref):
        assert a.shape == b.shape and a.dtype == args[0].dtype
        assert torch.equal(torch.isneginf(a), torch.isneginf(b))
        fin = torch.isfinite(b)
        assert rel_error(a[fin], b[fin]) < tol
    return got, r


def test_logsumexp_and_row_max_share_the_softmax_reductions():
    q, k, v = (torch.randn(1, 2, 37, 16) for _ in range(3))
    (_, lse, _), r = compare(lse_and_max, q, k, v)
    assert torch.isneginf(lse[..., :5]).all()                        # fully masked rows, like eager
    assert r.ir.count("max_n") == 1 and r.ir.count("sum_n") == 1      # one max, one sum for all outputs


def test_hand_written_statistics():
    q, k, v = (torch.randn(2, 3, 21, 8) for _ in range(3))
    compare(hand_lse, q, k, v)


def test_entropy_is_an_extra_sum_in_the_same_pass():
    """-sum(p * (s - lse)) = lse - sum(e * s) / l: an online sum next to softmax's."""
    q, k, v = (torch.randn(1, 2, 37, 16) for _ in range(3))
    _, r = compare(entropy, q, k, v)
    assert not any(f.endswith("-pass") for f in r.features)


def test_row_output_with_bf16_inputs_keeps_eager_dtype():
    q, k, v = (torch.randn(1, 2, 19, 16, dtype=torch.bfloat16) for _ in range(3))
    compare(hand_lse, q, k, v, tol=2e-2)


def lse_causal(q, k, v):
    s = q @ k.mT * q.shape[-1] ** -0.5
    n, m = torch.arange(s.shape[-1], device=s.device), torch.arange(s.shape[-2], device=s.device)
    s = s.masked_fill(n > m[:, None], float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def row_max(q, k, v):
    """The row max returned: its gradient reaches the score at each row's argmax."""
    s = q @ k.mT * q.shape[-1] ** -0.5
    n, m = torch.arange(s.shape[-1], device=s.device), torch.arange(s.shape[-2], device=s.device)
    s = s.masked_fill(n > m[:, None] + 3, float("-inf"))
    return torch.softmax(s, -1) @ v, s.amax(-1)


@pytest.mark.parametrize("fn", [lse_causal, entropy, hand_lse, row_max])
def test_gradients_through_row_outputs(fn):
    """Gradients reach q, k, v from the output and from the row output, through the generated
    kernels (the row outputs' gradients seed the row kernel); a logsumexp is invariant to the
    softmax's shift, the row max is not (``shift-gradient``)."""
    def loss(f, xs):
        o, row = f(*xs)
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(o.dtype)
        return (o * w).sum() + row.square().sum()
    xs = [torch.randn(2, 2, 37, 16, requires_grad=True) for _ in range(3)]
    r = flashlight.explain(fn, *xs).regions[0]
    assert r.backward.startswith("generated"), r.backward
    assert ("shift-gradient" in r.features) == (fn is row_max), r.features
    x64 = [x.detach().double().requires_grad_() for x in xs]
    bwd = REGISTRY[r.key].bwd_launches
    got = torch.autograd.grad(loss(torch.compile(fn, backend="flashlight"), xs), xs)
    assert REGISTRY[r.key].bwd_launches > bwd
    ref = torch.autograd.grad(loss(fn, x64), x64)
    for a, b in zip(got, ref):
        assert rel_error(a, b) < 1e-3


def test_row_value_of_the_output_is_not_a_row_output():
    """``o.sum(-1)`` is computed from the region's output: it stays outside (no cycle)."""
    def f(q, k, v):
        o = torch.softmax(q @ k.mT, -1) @ v
        return o, o.sum(-1)
    q, k, v = (torch.randn(1, 2, 17, 16) for _ in range(3))
    report = flashlight.explain(f, q, k, v)
    assert len(report.regions) == 1 and "row0" not in report.regions[0].ir
    got = torch.compile(f, backend="flashlight")(q, k, v)
    for a, b in zip(got, f(*(to64(x) for x in (q, k, v)))):
        assert rel_error(a, b) < 1e-4


@pytest.mark.parametrize("path", ["as is", "inductor"])
def test_row_outputs_no_gradient_reaches_take_the_inference_op(path):
    """Inputs that need no gradient: ``flashlight::region_rows_infer``, whose kernel stores no
    row statistics (its launch runs with STATS off), in a graph that runs as is and in one
    Inductor compiles; the outputs match float64."""
    w = torch.randn(16, 16) / 4

    def fn(q, k, v):
        o, lse = lse_causal(q, k, v)
        return (o, lse) if path == "as is" else (o @ w.to(o.dtype), lse * 2)
    q, k, v = (torch.randn(1, 2, 37, 16) for _ in range(3))
    report = flashlight.explain(fn, q, k, v)
    ops = [getattr(n.target, "__name__", "") for g in report.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert [x for x in ops if "region" in x] == ["region_rows_direct" if path == "as is" else "region_rows_infer.default"], ops
    got = torch.compile(fn, backend="flashlight")(q, k, v)
    want = fn(*(to64(x) for x in (q, k, v)))
    assert all(rel_error(a, b) < 1e-5 for a, b in zip(got, want))
    metas = REGISTRY[report.regions[0].key].metas        # (config, STATS, TMA) of each launch
    assert metas and not any(stats for _, stats, _ in metas), metas
