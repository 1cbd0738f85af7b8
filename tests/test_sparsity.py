"""Block sparsity: skipped blocks never hold an unmasked element (property test over random
index predicates), the sparse kernel equals the dense one (up to the order of its sums: the
masked head and tail blocks run after the full ones), data-dependent masks are recomputed
every call, and the dead-predicate rules fire on the usual mask spellings."""
import math
import random

import pytest
import torch

import flashlight
from flashlight.codegen import generate
from flashlight.examples import document_mask, key_padding
from flashlight.ir import Reduction, call, const, dot, red, var
from flashlight.ir.evaluate import evaluate
from flashlight.rewrite import rewrite
from flashlight.runtime.op import CompiledRegion, compile_region
from flashlight.sparsity import dead_predicate, useful
from flashlight.testing import rel_error
from test_ir import softmax_region

m, n, b0 = var("m"), var("n"), var("b0")


def random_index(rng, depth=2):
    if depth == 0 or rng.random() < 0.3:
        return rng.choice([m, n, const(rng.randint(-20, 40))])
    op = rng.choice(["add", "sub", "mul", "floordiv", "mod", "minimum", "maximum", "abs"])
    if op in ("floordiv", "mod"):
        return call(op, random_index(rng, depth - 1), const(rng.randint(1, 9)))
    if op == "mul":
        return call(op, random_index(rng, depth - 1), const(rng.randint(-3, 3)))
    if op == "abs":
        return call(op, random_index(rng, depth - 1))
    return call(op, random_index(rng, depth - 1), random_index(rng, depth - 1))


def random_predicate(rng, depth=2):
    if depth == 0 or rng.random() < 0.4:
        cmp = rng.choice(["lt", "le", "gt", "ge", "eq", "ne"])
        return call(cmp, random_index(rng), random_index(rng))
    op = rng.choice(["and", "or", "not"])
    if op == "not":
        return call("not", random_predicate(rng, depth - 1))
    return call(op, random_predicate(rng, depth - 1), random_predicate(rng, depth - 1))


def masked_region(keep, B=1, M=45, N=53, D=16):
    r = softmax_region(B, M, N, D)
    s = call("where", keep, call("mul", dot(0), const(0.5)), const(float("-inf")))
    e = call("exp", call("sub", s, red(0)))
    r.reductions = [Reduction("max", s), Reduction("sum", e), Reduction("dot", e, r.reductions[2].v)]
    return rewrite(r)


def dense_twin(c: CompiledRegion) -> CompiledRegion:
    from flashlight.runtime.cache import load_module
    src, _, tma = generate(c.region, "fl_fwd_dense_" + c.name[-8:], sparse=False, interpret=True)
    mod, path = load_module("fl_fwd_dense_" + c.name[-8:], src)
    return CompiledRegion(c.region, src, "dense", path, getattr(mod, "fl_fwd_dense_" + c.name[-8:]), tma=tma)


@pytest.mark.parametrize("seed", range(40))
def test_random_index_masks_never_lose_an_element(seed):
    rng = random.Random(seed)
    keep = random_predicate(rng)
    r = masked_region(keep)
    q, k, v = torch.randn(1, 45, 16), torch.randn(1, 53, 16), torch.randn(1, 53, 16)
    c = compile_region(r)
    ref = evaluate(r, [q, k, v])
    got = c.forward([q, k, v])
    assert rel_error(got, ref) < 1e-5, (keep, c.source)
    # a lost key of weight w moves the output by ~w (>= 1e-4 here); reordered fp32 sums by ~1e-7
    assert rel_error(got, dense_twin(c).forward([q, k, v])) < 1e-6, (keep, c.source)


def test_dead_predicate_rules():
    keep = call("le", n, m)
    r = masked_region(keep)
    dead = dead_predicate(r, [0, 1, 2])
    assert dead == call("not", keep) and useful(dead)
    # no mask: nothing to skip
    assert not useful(dead_predicate(rewrite(softmax_region()), [0, 1, 2]))


def test_document_mask_sparse_and_recomputed_every_call():
    q, k, v, ids = document_mask.make_inputs(B=2, H=2, M=90, D=16)
    fast = torch.compile(document_mask.attention, backend="flashlight")
    for docs in (12, 3, 1, 90):
        ids = document_mask.doc_ids_for(2, 90, docs=docs)
        out = fast(q, k, v, ids)
        ref = document_mask.attention(q.double(), k.double(), v.double(), ids)
        assert rel_error(out, ref) < 1e-5
    report = flashlight.explain(document_mask.attention, q, k, v, ids)
    assert "block-sparse" in report.regions[0].features


def test_key_padding_with_empty_rows_sparse():
    q, k, v, valid = key_padding.make_inputs(B=3, H=2, M=40, N=70, D=16, lengths=[0, 1, 70])
    out = torch.compile(key_padding.attention, backend="flashlight")(q, k, v, valid)
    ref = key_padding.attention(q.double(), k.double(), v.double(), valid).nan_to_num(0)
    assert rel_error(out, ref) < 1e-5


def test_explain_reports_skipped_fraction():
    from flashlight.examples import sliding_window
    q, k, v = sliding_window.make_inputs(B=1, H=1, M=128, D=16)
    r = flashlight.explain(lambda q, k, v: sliding_window.attention(q, k, v, window=16), q, k, v).regions[0]
    assert "block-sparse" in r.features
    assert 0.7 < r.skipped < 1.0          # a 16-wide band over 128 keys, 16x16 blocks
    assert "blocks skipped" in str(r)


def test_causal_kernel_has_mask_free_full_segment():
    from flashlight.examples import causal
    r = flashlight.explain(causal.attention, *causal.make_inputs(B=1, H=1, M=70, D=16)).regions[0]
    full_loop = r.kernel_source.split("# full blocks: no masks")[1].split("\n    for ")[0]   # up to the next loop
    assert "tl.where(t" not in full_loop and "offs_m" not in full_loop.split("tl.dot")[1]


@pytest.mark.parametrize("example", ["document_mask", "key_padding"])
def test_blocks_wider_than_a_statistics_entry(example):
    """GPU-sized blocks in the interpreter: each kernel reduces the BLOCK // STAT_BLOCK entries of
    its blocks (the last one repeated past a ragged end), the forward, dK/dV and dQ each under a
    different config; documents of length 1 and an empty key row included. Output and gradients
    against float64."""
    from flashlight.examples import load
    from flashlight.runtime.op import REGISTRY
    from flashlight.tune import Config, bucket
    mod = load(example)
    if example == "document_mask":
        q, k, v, ids = mod.make_inputs(B=2, H=2, M=100, D=16)
        ids = torch.tensor([[0] + [1] * 40 + [2] + list(range(3, 61)), [0] * 99 + [1]], dtype=torch.int32)
    else:
        q, k, v, ids = mod.make_inputs(B=3, H=2, M=70, N=100, D=16, lengths=[0, 1, 77])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    c = REGISTRY[flashlight.explain(mod.attention, *leaves, ids).regions[0].key]
    b = bucket(c.region.M, c.region.N, math.prod(c.region.batch))
    for kernel, cfg in (("fwd", Config(32, 64, 4, 1)), ("dkdv", Config(32, 64, 4, 1)), ("dq", Config(64, 32, 4, 1))):
        c.tuned[b if kernel == "fwd" else (kernel, *b)] = cfg
    try:
        torch._dynamo.reset()
        out = torch.compile(mod.attention, backend="flashlight")(*leaves, ids)
        ref64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
        ref = mod.attention(*ref64, ids).nan_to_num(0)
        assert rel_error(out, ref) < 1e-5
        dout = torch.randn_like(out)
        got = torch.autograd.grad(out, leaves, dout)
        want = torch.autograd.grad(ref, ref64, dout.double())
        assert max(rel_error(a, w) for a, w in zip(got, want)) < 1e-4
        assert c.bwd_launches > 0
    finally:
        c.tuned.clear()


def test_one_statistics_reduction_per_training_step(monkeypatch):
    """The document ids' block min/max is computed once per step: the forward's serves its
    backward's two tile kernels (the ids are saved tensors, so an in-place change in between
    is an autograd error, not a stale statistic)."""
    from flashlight.runtime import op as rt
    calls = []
    real = rt.block_minmax
    monkeypatch.setattr(rt, "block_minmax", lambda *a: calls.append(a[1:]) or real(*a))
    q, k, v, ids = document_mask.make_inputs(B=2, H=2, M=50, D=16)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    torch._dynamo.reset()
    fn = torch.compile(document_mask.attention, backend="flashlight")
    out = fn(*leaves, ids)
    assert len(calls) == 1
    out.sum().backward()
    assert len(calls) == 1 and all(x.grad is not None for x in leaves)
    out = fn(*leaves, ids)
    ids.add_(0)       # an in-place change after the forward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("side", ["keys", "queries"])
def test_a_mask_over_a_float_tensor_skips_blocks_and_trains(side):
    """A mask from a trained float tensor's statistics (``k.sum(-1) > 0`` over keys, or a
    query-side one): its block test compares float bounds. Triton's interpreter types a float
    comparison as float, and the scan's ``&`` with a boolean failed (the dK/dV kernel, whose
    key side is a scalar). Forward and gradients of q, k, v against float64, blocks skipped."""
    from helpers import check_fused, check_grads

    def masked(q, k, v):
        if side == "keys":
            keep = k.sum(-1)[..., None, :] > 0
        else:       # rows whose q sums to <= 0 keep their first 16 keys: no row fully masked
            keep = (q.sum(-1)[..., :, None] > 0) | (torch.arange(k.shape[-2])[None, :] < 16)
        s = q @ k.transpose(-1, -2) / 4
        return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 150, 16, generator=g) for _ in range(3))
    (k if side == "keys" else q)[..., 8:148, :] -= 10         # whole blocks of masked keys (or of rows)
    _, report = check_fused(masked, q, k, v)
    assert report.regions[0].skipped > 0.2, report
    check_grads(masked, [q, k, v])
