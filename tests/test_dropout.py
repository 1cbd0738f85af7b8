"""Fused dropout on the attention probabilities: a keep mask of 16-bit Philox draws made in the
kernel (one Philox call per 8 keys of a row), seeded from torch's generator per call. The
reference path and the generated backward redraw exactly the kernel's mask; keep rate and
expectation are statistically right."""
import torch
import torch.nn.functional as F

import flashlight
from flashlight.examples.attention_dropout import P, attention as attn
from flashlight.ir.philox import LEVELS, rand16
from flashlight.runtime.op import REGISTRY
from flashlight.testing import rel_error, score_sized_nodes

B, H, M, N, D = 1, 2, 37, 37, 16


def probs(q, k):
    return torch.softmax(q.double() @ k.double().mT * D ** -0.5, -1)


def kernel_mask(seed_of_call: int) -> torch.Tensor:
    """The mask of the call made right after ``torch.manual_seed(seed_of_call)``: the seed op's
    draw, then rand16 at row (b, h, m) and column n."""
    torch.manual_seed(seed_of_call)
    seed = torch.randint(0, 1 << 62, (), dtype=torch.int64)
    return rand16(seed, torch.arange(B * H * M).view(B, H, M, 1), torch.arange(N)) >= round(P * LEVELS)


def inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, H, M, D, generator=g), torch.randn(B, H, N, D, generator=g)


def run(fn, *args, seed: int):
    torch.manual_seed(seed)
    return fn(*args)


def test_fuses_and_uses_the_mask_the_reference_draws():
    q, k = inputs()
    eye = torch.eye(N).expand(B, H, N, N)           # out = dropout(P) itself: the kernel's mask
    report = flashlight.explain(attn, q, k, eye)
    assert len(report.regions) == 1 and "dropout" in report.regions[0].features
    assert not any(score_sized_nodes(g, B * H * M * N) for g in report.graphs)
    out = run(torch.compile(attn, backend="flashlight"), q, k, eye, seed=7)
    mask = kernel_mask(7)
    assert torch.equal(out != 0, mask)
    assert rel_error(out, probs(q, k) * mask / (1 - P)) < 1e-5


def test_backward_recomputes_the_same_mask():
    q, k = inputs()
    v = torch.randn(B, H, N, D)
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    w = torch.randn(B, H, M, D)
    bwd = sum(c.bwd_launches for c in REGISTRY.values())
    (run(torch.compile(attn, backend="flashlight"), *xs, seed=11) * w).sum().backward()
    assert sum(c.bwd_launches for c in REGISTRY.values()) > bwd    # the generated kernel redraws it
    mask = kernel_mask(11)
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ((probs(x64[0], x64[1]) * mask / (1 - P)) @ x64[2] * w.double()).sum().backward()
    for a, b in zip(xs, x64):
        assert rel_error(a.grad, b.grad) < 1e-4


def test_keep_rate_and_expectation():
    """Over 3 calls (8214 probabilities): keep rate 1 - p and E[dropout(P) / P] = 1, each within
    5 standard deviations."""
    q, k = inputs()
    eye = torch.eye(N).expand(B, H, N, N)
    fast = torch.compile(attn, backend="flashlight")
    ratio = torch.cat([(run(fast, q, k, eye, seed=s) / probs(q, k)).flatten() for s in range(3)])
    n = ratio.numel()
    keep = (ratio != 0).double().mean().item()
    assert abs(keep - (1 - P)) < 5 * (P * (1 - P) / n) ** 0.5
    assert abs(ratio.mean().item() - 1) < 5 * (P / (1 - P) / n) ** 0.5
    assert torch.allclose(ratio[ratio != 0], torch.full_like(ratio[ratio != 0], 1 / (1 - P)), rtol=1e-4)


def test_same_seed_is_bitwise_reproducible_and_another_differs():
    q, k = inputs()
    v = torch.randn(B, H, N, D)
    fast = torch.compile(attn, backend="flashlight")
    a, b, c = (run(fast, q, k, v, seed=s) for s in (5, 5, 6))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(run(fast, q, k, v, seed=5), fast(q, k, v))   # the generator moved on


def test_eval_mode_dropout_is_the_identity():
    def eval_attn(q, k, v):
        return F.dropout(torch.softmax(q @ k.mT, -1), P, training=False) @ v
    q, k = inputs()
    v = torch.randn(B, H, N, D)
    report = flashlight.explain(eval_attn, q, k, v)
    assert "dropout" not in report.regions[0].features
    ref = torch.softmax(q.double() @ k.double().mT, -1) @ v.double()
    assert rel_error(torch.compile(eval_attn, backend="flashlight")(q, k, v), ref) < 1e-5


def test_two_products_of_one_dropped_tensor_share_its_mask():
    """dropout(P) @ v1 and dropout(P) @ v2 are two regions; eager uses one mask for both."""
    def two(q, k, v1, v2):
        p = F.dropout(torch.softmax(q @ k.mT, -1), P, training=True)
        return p @ v1, p @ v2
    q, k = inputs()
    eye = torch.eye(N).expand(B, H, N, N)
    assert len(flashlight.explain(two, q, k, eye, 2 * eye).regions) == 2
    a, b = torch.compile(two, backend="flashlight")(q, k, eye, 2 * eye)
    assert (a != 0).float().mean() < 1 and torch.equal(2 * a, b)
