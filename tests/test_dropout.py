"""Fused dropout on the attention probabilities: a keep mask of 16-bit Philox draws made in the
kernel (one Philox call per 8 keys of a row), seeded from torch's generator per call. The
reference path and the generated backward redraw exactly the kernel's mask; keep rate and
expectation are statistically right."""
import pytest
import torch
import torch.nn.functional as F

import flashlight
from flashlight.codegen.emit import prelude
from flashlight.examples.attention_dropout import P, attention as attn
from flashlight.ir.philox import LEVELS, M32, philox, rand16
from flashlight.runtime.cache import load_module
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
    from flashlight.runtime.op import region_direct     # the graph runs as is: seed, region, no Inductor
    assert region_direct in {n.target for g in report.graphs for n in g.graph.nodes}
    assert not any(score_sized_nodes(g, B * H * M * N) for g in report.graphs)
    out = run(torch.compile(attn, backend="flashlight"), q, k, eye, seed=7)
    mask = kernel_mask(7)
    assert torch.equal(out != 0, mask)
    sources = [c.source for r in report.regions for c in [REGISTRY[r.key]]]
    assert all("= fl_rand16_block(" in src for src in sources)     # one Philox call per 8 keys
    assert rel_error(out, probs(q, k) * mask / (1 - P)) < 1e-5


def checkpointed(q, k, v):
    from torch.utils.checkpoint import checkpoint
    return checkpoint(attn, q, k, v, use_reentrant=False)


@pytest.mark.parametrize("fn", [attn, checkpointed], ids=["plain", "checkpointed"])
def test_backward_recomputes_the_same_mask(fn):
    """The generated backward redraws the forward's mask from the saved seed. Under
    ``torch.utils.checkpoint`` the backward recomputes the forward too: the seed op then runs
    again from the generator state Inductor saved for it (it crashed before: Inductor's
    ``run_and_save_rng_state`` found no device in the op's arguments)."""
    q, k = inputs()
    v = torch.randn(B, H, N, D)
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    w = torch.randn(B, H, M, D)
    torch.compiler.reset()
    assert len(flashlight.explain(fn, *xs).regions) == 1
    torch.compiler.reset()
    bwd = sum(c.bwd_launches for c in REGISTRY.values())
    (run(torch.compile(fn, backend="flashlight"), *xs, seed=11) * w).sum().backward()
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


# -- the draws themselves: Triton helpers against ir/philox.py --------------------------------
DRAWS = """
@triton.jit
def philox_words(seed_ptr, off_ptr, out_ptr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    w0, w1, w2, w3 = tl.randint4x(tl.load(seed_ptr), tl.load(off_ptr + o))
    tl.store(out_ptr + o * 4, w0)
    tl.store(out_ptr + o * 4 + 1, w1)
    tl.store(out_ptr + o * 4 + 2, w2)
    tl.store(out_ptr + o * 4 + 3, w3)


@triton.jit
def draws_block(seed_ptr, row_ptr, out_ptr, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    u = fl_rand16_block(tl.load(seed_ptr), tl.load(row_ptr + offs_m)[:, None], start_n, BLOCK_M, BLOCK_N)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], u, mask=offs_n[None, :] < N)


@triton.jit
def draws_any(seed_ptr, row_ptr, col_ptr, out_ptr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(out_ptr + o, fl_rand16(tl.load(seed_ptr), tl.load(row_ptr + o), tl.load(col_ptr + o)))
"""
SEED = torch.tensor((1 << 61) + 12345, dtype=torch.int64)       # both key words non-zero


@pytest.fixture(scope="module")
def draws():
    return load_module("test_dropout_draws", prelude(DRAWS) + DRAWS)[0]


def test_reference_philox_is_tritons(draws):
    """ir/philox.py's Philox-4x32-10 at counter (offset lo, offset hi, 0, 0) is tl.randint4x,
    with 64-bit offsets across the 2**32 boundary."""
    off = torch.tensor([0, 1, 7, 8, M32 - 1, M32, M32 + 1, (1 << 40) + 9], dtype=torch.int64)
    out = torch.empty(8, 4, dtype=torch.int32)
    draws.philox_words[(1,)](SEED, off, out, BLOCK=8)
    ref = torch.stack(philox(SEED, (off & M32, off >> 32, 0 * off, 0 * off)), -1)
    assert torch.equal(out.long() & M32, ref)


def test_kernel_draws_match_the_reference(draws):
    """The score tile's grouped draws (rows across 2**32, a ragged N = 45, key blocks starting
    anywhere) and the per-element fallback (random rows and columns) are rand16 bit for bit."""
    rows = torch.tensor([0, 1, M32 - 1, M32, M32 + 1, (1 << 40) + 3, 77, 123456789012], dtype=torch.int64)
    N = 45
    out = torch.empty(8, N, dtype=torch.int32)
    draws.draws_block[(3,)](SEED, rows, out, N, BLOCK_M=8, BLOCK_N=16)
    assert torch.equal(out.long(), rand16(SEED, rows[:, None], torch.arange(N)))
    g = torch.Generator().manual_seed(0)
    row = torch.randint(0, 1 << 62, (64,), generator=g)
    col = torch.cat([torch.tensor([0, 7, 8, M32 * 8 - 1, M32 * 8, (1 << 40) - 1]),
                     torch.randint(0, 1 << 35, (58,), generator=g)])
    out = torch.empty(64, dtype=torch.int32)
    draws.draws_any[(1,)](SEED, row, col, out, BLOCK=64)
    assert torch.equal(out.long(), rand16(SEED, row, col))


def test_keep_rate_of_16_bit_draws():
    """Over a 256 x 512 tile the keep rate is 1 - p within 4 standard errors for p = 0.1 and
    0.5, overall and in each of the 8 lanes that share a Philox call (the kernel's draws are
    these, bit for bit)."""
    u = rand16(SEED, torch.arange(256)[:, None], torch.arange(512))
    for p in (0.1, 0.5):
        keep = u >= round(p * LEVELS)
        for k in [keep.flatten(), *keep.view(256, 64, 8).unbind(-1)]:
            rate = k.double().mean().item()
            assert abs(rate - (1 - p)) < 4 * (p * (1 - p) / k.numel()) ** 0.5, (p, rate)


def test_dropout_along_the_queries_draws_per_element():
    """Dropout of the transposed probabilities: its last axis is the queries, so each score
    runs its own Philox call (fl_rand16), at row (b, h, n) and column m."""
    def transposed(q, k, v):
        return F.dropout(torch.softmax(q @ k.mT, -1).mT, P, training=True).mT @ v
    q, k = inputs()
    eye = torch.eye(N).expand(B, H, N, N)
    out = run(torch.compile(transposed, backend="flashlight"), q, k, eye, seed=3)
    torch.manual_seed(3)
    seed = torch.randint(0, 1 << 62, (), dtype=torch.int64)
    mask = rand16(seed, torch.arange(B * H * N).view(B, H, N, 1), torch.arange(M)) >= round(P * LEVELS)
    assert torch.equal(out != 0, mask.mT)
