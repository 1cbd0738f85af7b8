"""Split-KV decoding: few queries against many keys run as a split kernel plus a combine kernel,
for every variant (GQA, causal with the queries at the end, ALiBi, paged KV caches, extra row
outputs), matching float64 eager; fully masked rows give 0 (and logsumexp -inf)."""
import pytest
import torch

import flashlight
from flashlight.examples import decode_gqa, paged_decode, relu_attention, softpick, threshold, top_k
from flashlight.runtime import decode
from flashlight.runtime.op import REGISTRY
from flashlight.testing import reference, rel_error, to64

import test_chained


def padded_with_lse(q, k, v, lens):
    """Per-sequence cache lengths; a sequence of length 0 has every key masked."""
    s = q @ k.mT * q.shape[-1] ** -0.5
    s = s.masked_fill(torch.arange(k.shape[2]) >= lens[:, None, None, None], float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


@pytest.fixture
def splits(monkeypatch):
    monkeypatch.setattr(decode, "FORCE_SPLITS", 3)


def run_split(fn, *args, tol=1e-4):
    """Compile ``fn``, run it, check that the split kernels ran, return (outputs, eager fp64)."""
    report = flashlight.explain(fn, *args)
    assert len(report.regions) == 1, str(report)
    c = REGISTRY[report.regions[0].key]
    before = c.split.launches if c.split else 0
    got = torch.compile(fn, backend="flashlight")(*args)
    assert c.split and c.split.launches > before, "the split-KV path did not run"
    return got, report


@pytest.mark.parametrize("M,N,hkv", [(1, 333, 2), (4, 517, 2), (1, 301, 1)], ids=["gqa-m1", "gqa-m4", "mqa"])
def test_gqa_causal_with_offset(splits, M, N, hkv):
    q = torch.randn(2, 4, M, 16)
    k, v = torch.randn(2, hkv, N, 16), torch.randn(2, hkv, N, 16)
    out, report = run_split(decode_gqa.attention, q, k, v)
    assert REGISTRY[report.regions[0].key].split.group == 4 // hkv    # query heads per K/V tile load
    assert rel_error(out, reference(decode_gqa.attention, q, k, v)) < 1e-4


@pytest.mark.parametrize("hkv", [4, 2], ids=["mha", "gqa"])
def test_alibi(splits, hkv):
    fn = decode_gqa.attention_alibi
    q, k, v = torch.randn(1, 4, 2, 16), torch.randn(1, hkv, 421, 16), torch.randn(1, hkv, 421, 16)
    out, report = run_split(fn, q, k, v)
    assert REGISTRY[report.regions[0].key].split.group == 4 // hkv
    assert rel_error(out, reference(fn, q, k, v)) < 1e-4


def test_paged_kv_cache_is_read_through_the_block_table(splits):
    inputs = paged_decode.make_inputs(B=2, H=4, M=300, D=16, group=2)
    out, report = run_split(paged_decode.attention, *inputs)
    ir = report.regions[0].ir
    k_index = ir.split("dot0:")[1].split("\n")[0]
    assert "[b0, idiv(n, 16)]" in k_index, ir     # K's page: the block table read at (b, n // PAGE)
    assert rel_error(out, reference(paged_decode.attention, *inputs)) < 1e-4


def test_fully_masked_rows_and_logsumexp(splits):
    q, k, v = torch.randn(3, 2, 1, 16), torch.randn(3, 2, 350, 16), torch.randn(3, 2, 350, 16)
    lens = torch.tensor([350, 0, 100])
    (out, lse), _ = run_split(padded_with_lse, q, k, v, lens)
    ref_out, ref_lse = padded_with_lse(*(to64(x) for x in (q, k, v)), lens)
    assert torch.all(out[1] == 0) and torch.isneginf(lse[1]).all()
    assert rel_error(out, torch.nan_to_num(ref_out, nan=0.0)) < 1e-4
    fin = torch.isfinite(ref_lse)
    assert rel_error(lse[fin], ref_lse[fin]) < 1e-4


def _two_pass(q, k, v):
    """A hand-written softmax whose normaliser is not online (squared): two passes."""
    s = q @ k.mT
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return (p / p.sum(-1, keepdim=True)).square() @ v


def _padded_threshold(q, k, v, lens):
    """Thresholded and renormalised, per-sequence cache lengths (0: every key masked)."""
    s = q @ k.mT * q.shape[-1] ** -0.5
    s = s.masked_fill(torch.arange(k.shape[2]) >= lens[:, None, None, None], float("-inf"))
    p = torch.relu(torch.softmax(s, -1) - 0.5 / k.shape[-2])
    return (p / p.sum(-1, keepdim=True).clamp_min(1e-6)) @ v


def _eps_softmax(q, k, v):
    """An epsilon in the denominator: the output depends on the max, whose gradient reaches the
    score at its argmax."""
    s = q @ k.mT * q.shape[-1] ** -0.5
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return e / (e.sum(-1, keepdim=True) + 0.5) @ v


def _max_read_back(q, k, v):
    s = q @ k.mT * q.shape[-1] ** -0.5
    return torch.softmax(s, -1) @ v + 0.5 * s.amax(-1, keepdim=True)


MULTI_PASS = {"two_pass": (_two_pass, "2-pass"), "threshold": (threshold.attention, "2-pass"),
              "softpick": (softpick.attention, "shift-gradient"),
              "twice": (test_chained.twice, "3-pass"), "adaptive": (test_chained.adaptive_temperature, "3-pass"),
              "eps_softmax": (_eps_softmax, "shift-gradient"), "max_read_back": (_max_read_back, "shift-gradient"),
              "top_k": (top_k.attention, "top-k")}


@pytest.mark.parametrize("name", list(MULTI_PASS))
def test_multi_pass_and_shift_gradient_regions_split(splits, name):
    """A split and a combine kernel per pass, each pass reading the earlier ones' final values
    from the workspace: the output of float64 eager. A max that takes a gradient (an epsilon,
    a max read back, softpick) has its argmax merged by the combine (the first split holding
    the max), top-k's candidates by tl.topk: the generated backward after a split forward has
    float64's gradients."""
    from helpers import check_grads
    fn, feature = MULTI_PASS[name]
    q, k, v = torch.randn(1, 2, 3, 16) * 2, torch.randn(1, 2, 301, 16), torch.randn(1, 2, 301, 16)
    out, report = run_split(fn, q, k, v)
    assert feature in report.regions[0].features
    assert rel_error(out, reference(fn, q, k, v)) < 1e-4
    if feature == "shift-gradient" or name in ("threshold", "top_k"):
        check_grads(fn, [x.clone().requires_grad_() for x in (q, k, v)])


def test_multi_pass_gqa_rows_without_keys_and_row_outputs(splits):
    """Packed GQA heads, a sequence whose every key is masked (0 out) and an entropy returned
    beside the output, through three passes' splits."""
    fn = _padded_threshold
    q, k, v = torch.randn(3, 4, 1, 16) * 2, torch.randn(3, 2, 333, 16), torch.randn(3, 2, 333, 16)
    gqa = lambda q, k, v, lens: fn(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), lens)  # noqa: E731
    lens = torch.tensor([333, 0, 100])
    out, report = run_split(gqa, q, k, v, lens)
    assert REGISTRY[report.regions[0].key].split.group == 2 and "2-pass" in report.regions[0].features
    assert torch.all(out[1] == 0)
    assert rel_error(out, reference(gqa, q, k, v, lens)) < 1e-4
    (out, ent), _ = run_split(test_chained.entropy, q[:, :2], k, v)
    ref_out, ref_ent = test_chained.entropy(*(to64(x) for x in (q[:, :2], k, v)))
    assert rel_error(out, ref_out) < 1e-4 and rel_error(ent, ref_ent) < 1e-4


@pytest.mark.parametrize("M,N,programs,sms,expect", [
    (1, 4096, 256, 132, (3, 22)),      # B=8 H=32: a few splits to reach 4 programs per SM
    (1, 32768, 64, 132, (9, 57)),      # few programs (GQA-packed heads): more splits
    (1, 256, 8, 132, (1, 4)),          # 4 key blocks: too short to split
    (64, 4096, 8, 132, (1, 64)),       # prefill: never split
    (1, 4096, 8, 0, (1, 64)),          # no SMs (interpreter): not unless forced
])
def test_split_heuristic(M, N, programs, sms, expect):
    assert decode.plan(M, N, programs, 64, sms) == expect


def test_softmax_free_attention_has_no_max_to_merge(splits):
    """relu(s)^2 / N @ v: no max, only a P @ V product, merged by adding the splits."""
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 333, 16), torch.randn(1, 2, 333, 16)
    out, _ = run_split(relu_attention.attention, q, k, v)
    assert rel_error(out, reference(relu_attention.attention, q, k, v)) < 1e-4


@pytest.mark.parametrize("hkv", [4, 2], ids=["mha", "gqa"])
def test_sinks_join_one_split_only(splits, hkv):
    """gpt-oss sinks: every split's max includes the sink, its sum only split 0's (combined once);
    with GQA packing each packed row reads its own query head's sink."""
    def attn(q, k, v, sinks):
        B, H, M, _ = q.shape
        g = H // k.shape[1]
        s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
        col = sinks.reshape(1, H, 1, 1).expand(B, H, M, 1)
        p = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]
        return p @ v.repeat_interleave(g, 1)
    q, k, v, s = torch.randn(1, 4, 2, 16), torch.randn(1, hkv, 300, 16), torch.randn(1, hkv, 300, 16), torch.randn(4)
    out, report = run_split(attn, q, k, v, s)
    assert REGISTRY[report.regions[0].key].split.group == 4 // hkv
    assert rel_error(out, reference(attn, q, k, v, s)) < 1e-4


def test_split_forward_saves_row_statistics_for_the_generated_backward(splits):
    """The combine kernel stores the row statistics the one-kernel forward would (packed GQA
    rows included), so the generated backward runs after a split forward."""
    from helpers import check_grads
    q, k, v = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 301, 16), torch.randn(1, 2, 301, 16)
    c_before = {key: c.split.launches for key, c in REGISTRY.items() if c.split}
    check_grads(decode_gqa.attention, [q, k, v], generated=True)
    assert any(c.split and c.split.launches > c_before.get(key, 0) for key, c in REGISTRY.items())
