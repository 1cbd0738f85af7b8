"""Partial sums over the keys (``Reduction.scan``): stick-breaking attention written the ways
its reference code and users write the sums over the keys after each key (a triangle product,
a flipped cumulative sum) and before it (a cumulative sum, a ``triu`` product). Each fuses into
one kernel that walks the key blocks in the scan's direction, matches float64 eager forward and
backward, and skips the blocks its underflowing mask kills. The backward is one generated kernel
over query blocks that walks the key blocks twice (``GradPlan.fused_kv``)."""
import math
import re

import pytest
import torch
import torch.nn.functional as F

import flashlight
from flashlight.capture.scans import COL, triangle
from flashlight.examples import stick_breaking, vanilla
from flashlight.ir import call, const, var
from flashlight.ir.expr import scan
from flashlight.ir.scaling import scan_degree
from flashlight.sparsity import nonneg, nonpos, zero_when
from helpers import check_fused, check_grads

B, H, M, N, D = 1, 2, 37, 70, 16


def _logits(q, k):
    return q @ k.mT / math.sqrt(q.shape[-1])


def _masks(q, k, attend_current=False):
    Mq, Nk = q.shape[-2], k.shape[-2]
    return torch.ones(Mq, Nk, dtype=torch.bool, device=q.device).triu(Nk - Mq + int(attend_current))


def flipped_cumsum(fill=-1e5):
    """The suffix sums as ``flip(cumsum(flip(x)))``, the key itself subtracted."""
    def attention(q, k, v):
        s, mask = _logits(q, k), _masks(q, k)
        log_z = F.logsigmoid(s).masked_fill(mask, fill)
        log_beta = F.logsigmoid(-s).masked_fill(mask, 0)
        after = log_beta.flip(-1).cumsum(-1).flip(-1) - log_beta
        return torch.exp(log_z + after) @ v
    return attention


def softplus_total_minus_prefix(q, k, v):
    """The same weights from a prefix sum: sum over k > j = total - sum over k <= j, with
    log(1 - sigmoid(s)) = -softplus(s) and the mask as -inf."""
    s, mask = _logits(q, k), _masks(q, k)
    neg = F.softplus(s).masked_fill(mask, 0)
    after = neg.sum(-1, keepdim=True) - neg.cumsum(-1)
    return torch.exp(F.logsigmoid(s).masked_fill(mask, float("-inf")) - after) @ v


def triu_product(q, k, v):
    """A prefix sum as a product with ``triu(1)``: each key weighs in the gates of the keys
    before it (a "forward" stick-breaking over the key order), a per-key gate loaded."""
    s = _logits(q, k)
    T = k.shape[-2]
    before = torch.einsum("bhij,jk->bhik", torch.sigmoid(s) * 0.1, torch.ones(T, T, dtype=s.dtype, device=s.device).triu(1))
    return torch.softmax(s - before, -1) @ v


PROGRAMS = {
    "reference_triangle_product": stick_breaking.attention,
    "flipped_cumsum": flipped_cumsum(),
    "softplus_total_minus_prefix": softplus_total_minus_prefix,
    "triu_product": triu_product,
}


def _inputs(M=M, N=N):
    return vanilla.make_inputs(B=B, H=H, M=M, N=N, D=D)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_fuses_one_pass_and_matches_fp64(name):
    _, report = check_fused(PROGRAMS[name], *_inputs())
    r = report.regions[0]
    # the total less the prefix sums is the suffix scan (``rewrite.total_less_partial``)
    assert "key-scan" in r.features and "2-pass" not in r.features, r.features
    assert ("block-sparse" in r.features) == (name != "triu_product"), r.features
    assert r.backward.startswith("generated"), r.backward


# (M, N): two key blocks of the interpreter's 16, more keys than queries (the queries the last M
# positions), and a first query that sees no key (M == N)
SHAPES = [(21, 21), (13, 40), (33, 33)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_gradients_match_fp64(name, shape):
    check_grads(PROGRAMS[name], _inputs(*shape))


def test_the_backward_is_one_kernel_walking_the_keys_twice():
    """No dK/dV kernel: the dQ kernel's first key loop totals dL/d(partial sums) per row, its
    second reverses the scan from that total and adds dK and dV per tile."""
    r = flashlight.explain(PROGRAMS["flipped_cumsum"], *_inputs()).regions[0]
    src = r.backward_source
    assert r.backward.startswith("generated"), r.backward
    kernels = re.findall(r"^def (fl_bwd\w*)\(", src, re.M)
    assert sorted(k.split("_")[-1] for k in kernels) == ["dq", "rows"], kernels
    assert "dx0 = tl.where(mask_mn, t0 - u0 - tl.cumsum(g0, 1, reverse=True), 0.0)" in src, src
    assert "tl.atomic_add" in src, src


def _gates(q, k, v, bias, temp, pair):
    """Stick-breaking with learned inputs in both bodies: a per-key bias and a per-head
    temperature inside the sums over the keys, a pair bias read by the weights; the weights
    renormalised (a sum reading the partial sums besides the product)."""
    s, mask = _logits(q, k) * temp[None, :, None, None], _masks(q, k, attend_current=True)
    log_beta = F.logsigmoid(-s - bias[:, None, None, :]).masked_fill(mask, 0)
    after = log_beta.flip(-1).cumsum(-1).flip(-1) - log_beta
    w = torch.exp(F.logsigmoid(s + pair).masked_fill(mask, -1e5) + after)
    return (w / (w.sum(-1, keepdim=True) + 1.0)) @ v


def test_loads_in_both_bodies_take_their_gradients():
    M, N = 19, 35
    q, k, v = _inputs(M, N)
    bias, temp, pair = torch.randn(B, N), torch.rand(H) + 0.5, torch.randn(M, N)
    _, report = check_fused(_gates, q, k, v, bias, temp, pair)
    assert "key-scan" in report.regions[0].features
    check_grads(_gates, [q, k, v, bias, temp, pair])


def test_gqa_keys_shared_by_heads_add_their_gradients():
    """Two query heads per K/V head: the dQ kernel's per-tile dK and dV adds meet in the shared head."""
    def fn(q, k, v):
        return stick_breaking.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    q = torch.randn(B, 4, 25, D)
    k, v = torch.randn(B, 2, 25, D), torch.randn(B, 2, 25, D)
    check_grads(fn, [q, k, v])


def test_remaining_stick_takes_its_gradient_too():
    """The stick left over (a row output) and the output, both differentiated."""
    def attention(q, k, v):
        att = stick_breaking.stick_breaking(_logits(q, k))
        o = att @ v
        return o * (1 - att.sum(-1, keepdim=True))
    check_grads(attention, _inputs(M=N))


def test_suffix_scan_walks_the_key_blocks_last_to_first():
    source = flashlight.explain(PROGRAMS["flipped_cumsum"], *_inputs()).regions[0].kernel_source
    assert "tl.cumsum(x0, 1, reverse=True)" in source and "start_n = ((" in source, source


def test_remaining_stick_and_rows_without_keys():
    """IBM's reference also returns the stick left over, 1 - sum_j A_ij (a row output read from
    a sum in the scan's pass); the first query sees no key: its output is 0 and its stick 1."""
    def attention(q, k, v):
        att = stick_breaking.stick_breaking(_logits(q, k))
        return att @ v, 1 - att.sum(-1)
    q, k, v = _inputs(M=N)
    out, rem = torch.compile(attention, backend="flashlight")(q, k, v)
    want = attention(q.double(), k.double(), v.double())
    assert (out - want[0]).norm() / want[0].norm() < 1e-5 and (rem - want[1]).abs().max() < 1e-5
    assert out[:, :, 0].abs().max() == 0 and rem[:, :, 0].eq(1).all()


def test_a_later_pass_computes_the_partial_sums_again():
    """Softpick (its max in one pass, its sums in the next) of scores less a suffix scan: both
    passes read the partial sums, and the second computes them again (``recomputed_scans``)."""
    def fn(q, k, v):
        s, mask = _logits(q, k), _masks(q, k)
        g = torch.sigmoid(s).masked_fill(mask, 0) * 0.1
        x = (s - g.flip(-1).cumsum(-1).flip(-1)).masked_fill(mask, float("-inf"))
        m = x.amax(-1, keepdim=True)
        e = torch.exp(x - m) - torch.exp(-m)
        return F.relu(e) / torch.where(x.isfinite(), e.abs(), 0).sum(-1, keepdim=True) @ v
    _, report = check_fused(fn, *_inputs(M=N))
    r = report.regions[0]
    assert "2-pass" in r.features and "block-sparse" in r.features, r.features
    second = r.kernel_source.split("# pass 1")[1]
    assert "sc0 = c0 + tl.cumsum" in second and "sc0 = r0 + tl.cumsum" in r.kernel_source.split("# pass 1")[0]


def test_a_recomputed_scan_computes_the_score_tile_only_it_reads():
    """The same with the scan's body on a second score product and read through ``tril(-1)``
    (the key's own term excluded): the second pass's bodies read only the partial sums, so the
    score tile is the recomputed scan's alone (its kernel once failed on it, KeyError)."""
    def fn(q, k, v, q2, k2):
        s, mask = _logits(q, k), _masks(q, k, attend_current=True)
        g = torch.sigmoid(q2 @ k2.mT).masked_fill(mask, 0) * 0.1
        x = (s - g @ torch.ones(N, N, dtype=g.dtype).tril(-1)).masked_fill(mask, float("-inf"))
        m = x.amax(-1, keepdim=True)
        e = torch.exp(x - m) - torch.exp(-m)
        return F.relu(e) / torch.where(x.isfinite(), e.abs(), 0).sum(-1, keepdim=True) @ v
    q, k, v = _inputs(M=N)
    _, report = check_fused(fn, q, k, v, *_inputs(M=N)[:2])
    assert {"2-pass", "2-scores", "key-scan"} <= set(report.regions[0].features), report


def test_a_fill_that_does_not_underflow_keeps_every_block():
    """-10 is no mask for exp: the blocks above the diagonal still contribute e^-10 each."""
    _, report = check_fused(flipped_cumsum(fill=-10.0), *_inputs())
    assert "block-sparse" not in report.regions[0].features


def test_scans_both_ways_in_one_pass_fall_back_with_a_reason():
    def attention(q, k, v):
        g = torch.sigmoid(_logits(q, k))
        return (g * g.cumsum(-1) * g.flip(-1).cumsum(-1).flip(-1)) @ v
    report = flashlight.explain(attention, *_inputs())
    assert not report.regions and "prefix and suffix" in str(report), str(report)
    q, k, v = _inputs()
    out = torch.compile(attention, backend="flashlight")(q, k, v)
    want = attention(q.double(), k.double(), v.double())
    assert (out - want).norm() / want.norm() < 1e-6


def test_flips_and_cumulative_sums_of_the_output_stay_outside_the_epilogue():
    """They move elements of the output tile (not pointwise): the region ends before them."""
    def attention(q, k, v):
        o = torch.softmax(_logits(q, k), -1) @ v
        return o.flip(-1) * 2 + o.cumsum(-2)
    check_fused(attention, *_inputs())


@pytest.mark.parametrize("keep, want", [
    ("tril(-1)", ("suffix", False)), ("tril(0)", ("suffix", True)), ("triu(1)", ("prefix", False)),
    ("triu(0)", ("prefix", True)), ("tril(-2)", None), ("triu(2)", None),
])
def test_triangles_of_ones_are_scans(keep, want):
    """W[n, c] over (contracted key n, output column c) as ``_tri`` captures it: kept where
    c - n <= d (tril) or >= d (triu)."""
    n = var("n")
    d = int(keep[5:-1])
    cond = call("le" if keep.startswith("tril") else "ge", call("sub", COL, n), const(d))
    assert triangle(call("where", cond, const(1.0), const(0.0)), n) == want
    assert triangle(call("to_f", cond), n) == want
    assert triangle(call("where", cond, const(2.0), const(0.0)), n) is None


def test_underflow_rule_reads_the_sign_of_the_scan():
    s = var("n").__mul__(1)         # any key-varying int; the rule only needs signs
    logsig = call("sub", call("minimum", call("to_f", s), const(0.0)),
                  call("log1p", call("exp", call("neg", call("abs", call("to_f", s))))))
    assert nonpos(logsig) and not nonneg(logsig)
    mask = call("ge", var("n"), var("m"))
    part = call("minimum", scan(0, (var("m"), var("n"))), const(0.0))      # a sum of non-positive terms
    body = call("exp", call("add", call("where", mask, const(-1e5), logsig), part))
    assert zero_when(body) == mask
    unsigned = call("exp", call("add", call("where", mask, const(-1e5), logsig), scan(0, (var("m"), var("n")))))
    assert zero_when(unsigned).op == "const" and zero_when(unsigned).args[0] is False


def test_degree_of_a_body_in_its_partial_sums():
    """``scan_degree`` (``ir.scaling.degree`` with the partial sums moving): exp(log z + S) scales
    as exp(t) when S moves by t, a difference of the same sums is invariant, a detached copy
    moves with its value, and a sum S itself (a move, not a scaling) or one compared has none."""
    S, T = scan(0, (var("m"), var("n"))), scan(1, (var("m"), var("n")))
    z = call("sigmoid", call("to_f", var("n")))
    assert scan_degree(call("exp", call("add", call("log", z), S)), 0) == 1.0
    assert scan_degree(call("exp2", call("mul", S, const(-2.0))), 0) == pytest.approx(-2 * math.log(2))
    assert scan_degree(call("sigmoid", call("sub", S, S)), 0) == 0.0
    assert scan_degree(call("exp", call("stop", S)), 0) == 1.0
    assert scan_degree(call("exp", T), 0) == 0.0 and scan_degree(call("exp", T), 1) == 1.0
    assert scan_degree(S, 0) is None and scan_degree(call("exp", call("div", S, const(0.0))), 0) is None
    assert scan_degree(call("where", call("gt", S, const(0.0)), call("exp", S), const(0.0)), 0) is None


def test_a_cumsum_of_per_key_data_stays_a_load():
    """FoX (forgetting attention): the cumulative log forget gates are a per-position vector,
    read at the query and at the key; computed outside the kernel and loaded, so the region
    keeps its generated backward (no scan)."""
    def fox(q, k, v, log_f):
        c = log_f.cumsum(-1)
        s = _logits(q, k) + c[:, :, :, None] - c[:, :, None, :]
        return torch.softmax(s.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf")), -1) @ v
    q, k, v = _inputs(M=N)
    log_f = F.logsigmoid(torch.randn(B, H, N) + 3)
    _, report = check_fused(fox, q, k, v, log_f)
    r = report.regions[0]
    assert "key-scan" not in r.features and r.backward.startswith("generated"), (r.features, r.backward)


def _bthd_stick_breaking(q, k, v, attend_current=False):
    """The way reference implementations write it in [B, T, H, D]: einsum products, the scores
    in float32, the log-weights cast back to the input's type, the stick left over returned too."""
    T, D = q.shape[1], q.shape[-1]
    logits = torch.einsum("bthd,bshd->bhts", q, k).mul(D ** -0.5).float()
    mask = torch.ones(T, T, device=q.device).triu(0 + int(attend_current)).bool()[None, None]
    log_z = F.logsigmoid(logits).masked_fill(mask, -1e5).to(q.dtype)
    log_beta = F.logsigmoid(-logits).masked_fill(mask, 0).to(q.dtype)
    after = torch.einsum("bhij,jk->bhik", log_beta, torch.ones(T, T, device=q.device).tril(-1).to(log_beta))
    att = (log_z + after).exp()
    return torch.einsum("bhts,bshd->bthd", att, v).to(q.dtype), (1 - att.sum(-1).transpose(1, 2)).to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("attend_current", [False, True])
def test_bthd_reference_spelling_is_one_kernel(dtype, attend_current):
    """One region (the output stored back as [B, T, H, D], the stick's remainder a row output);
    in fp16 no further from float64 than eager's own fp16 (the kernel sums in float32)."""
    q, k, v = (torch.randn(2, 90, 2, D, dtype=dtype) for _ in range(3))

    def fn(q, k, v):
        return _bthd_stick_breaking(q, k, v, attend_current)
    report = flashlight.explain(fn, q, k, v)
    assert len(report.regions) == 1 and not report.fallbacks, report
    assert {"key-scan", "block-sparse", "permuted-store"} <= set(report.regions[0].features), report
    got = torch.compile(fn, backend="flashlight")(q, k, v)
    want = fn(q.double(), k.double(), v.double())
    eager = fn(q, k, v)
    for g, w, e in zip(got, want, eager):
        err = ((g.double() - w).norm() / w.norm()).item()
        assert err < max(1e-5, 1.5 * ((e.double() - w).norm() / w.norm()).item()), err


def _padded_prefix(q, k, v, valid):
    """softmax(s - prefix sums of g), keys padded on the left (-inf; g 0 there)."""
    s = _logits(q, k)
    pad = ~valid[:, None, None, :]
    g = (torch.sigmoid(s) * 0.2).masked_fill(pad, 0)
    return torch.softmax((s - g.cumsum(-1)).masked_fill(pad, float("-inf")), -1) @ v


def _window_prefix(q, k, v):
    """The same with a causal window of 64 keys and the sum as a product with triu(1)."""
    s = _logits(q, k)
    T = s.shape[-1]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    mask = (j > i) | (i - j >= 64)
    g = (torch.sigmoid(s) * 0.2).masked_fill(mask, 0)
    return torch.softmax((s - g @ torch.ones(T, T, dtype=s.dtype).triu(1)).masked_fill(mask, float("-inf")), -1) @ v


@pytest.mark.parametrize("case", ["left_padding", "window"])
def test_prefix_scans_walk_the_blocks_in_key_order(case):
    """A block-sparse pass runs its mask-free blocks before the masked head and tail, which is
    any order to a sum but not to a prefix scan's carry: a first live block that is partly
    masked (8 padded keys, a window's first block) came after the full ones (a review found
    relative errors of 1.27 and 0.57)."""
    if case == "left_padding":
        q, k, v = (torch.randn(1, 1, L, 8) for L in (4, 64, 64))
        valid = torch.zeros(1, 64, dtype=torch.bool)
        valid[0, 8:] = True
        fn, args = _padded_prefix, (q, k, v, valid)
    else:
        fn, args = _window_prefix, tuple(torch.randn(1, 1, 128, 8) for _ in range(3))
    _, report = check_fused(fn, *args, tol=1e-5)
    assert "block-sparse" in report.regions[0].features


def test_softplus_of_very_negative_scores_keeps_its_digits():
    """softplus(s - 20) = log1p(e^(s - 20)) ~ 2e-9: ``tl.log(1.0 + x)`` rounded it to 0 (the
    whole output 0); the kernel's log1p keeps it (``emit.fl_log1p``)."""
    def fn(q, k, v):
        w = F.softplus(_logits(q, k) - 20.0)
        return (w / w.sum(-1, keepdim=True)) @ v
    check_fused(fn, *(torch.randn(1, 1, 16, 8) for _ in range(3)), tol=1e-5)


def test_rows_past_m_stay_out_of_the_per_tile_key_gradients():
    """A per-query divisor loads as 0 in the rows that pad the last query block (0 / 0 there):
    the dQ kernel's mask-free key blocks are whole key blocks only, and it adds dK, dV and the
    per-key loads' gradients per tile, summed over rows (NaN in every mask-free key block's dK
    and dV before; found by review)."""
    def fn(q, k, v, tq, bias):
        s, mask = _logits(q, k) / tq[..., None], _masks(q, k)
        log_beta = F.logsigmoid(-s - bias[:, None, None, :]).masked_fill(mask, 0)
        after = log_beta.flip(-1).cumsum(-1).flip(-1) - log_beta
        return torch.exp(F.logsigmoid(s).masked_fill(mask, -1e5) + after) @ v
    q, k, v = _inputs(21, 37)
    check_grads(fn, [q, k, v, torch.rand(B, H, 21) + 0.5, torch.randn(B, 37)])


def _total_less(x, own: bool, flip: bool):
    """Σ_k x_k less the partial sums before each key (``own``: and the key's own term), the
    partial sums as a cumulative sum (``flip``: of the flipped row, the keys after each key)."""
    c = x.flip(-1).cumsum(-1).flip(-1) if flip else x.cumsum(-1)
    return x.sum(-1, keepdim=True) - (c if own else c - x)


@pytest.mark.parametrize("flip", [False, True], ids=["prefix", "suffix"])
@pytest.mark.parametrize("own", [True, False], ids=["inclusive", "exclusive"])
def test_a_total_less_partial_sums_is_the_other_scan(own, flip):
    """One pass, the total dropped, the scan turned round; gradients generated."""
    def fn(q, k, v):
        s, mask = _logits(q, k), _masks(q, k)
        x = F.softplus(s).masked_fill(mask, 0)
        return torch.exp(F.logsigmoid(s).masked_fill(mask, float("-inf")) - _total_less(x, own, flip)) @ v
    _, report = check_fused(fn, *_inputs())
    r = report.regions[0]
    assert "2-pass" not in r.features and r.kernel_source.count("#   red") == 2, r.kernel_source[:3000]
    want = "scan=prefix" if flip else "scan=suffix"
    assert want in r.kernel_source, r.kernel_source[:3000]
    check_grads(fn, _inputs(21, 21))


def test_a_total_read_elsewhere_stays():
    """The total also read as itself (a normaliser): the scan turns, the total stays."""
    def fn(q, k, v):
        s = _logits(q, k)
        x = torch.sigmoid(s) * 0.1
        total = x.sum(-1, keepdim=True)
        return torch.softmax(s - (total - x.cumsum(-1)) + total, -1) @ v
    _, report = check_fused(fn, *_inputs())
    assert "scan=suffix" in report.regions[0].kernel_source
    check_grads(fn, _inputs(21, 21), generated=False)


def test_partial_sums_read_otherwise_keep_their_direction():
    def fn(q, k, v):
        s = _logits(q, k)
        x = torch.sigmoid(s) * 0.1
        return torch.softmax(s - (x.sum(-1, keepdim=True) - x.cumsum(-1)) - x.cumsum(-1) ** 2, -1) @ v
    _, report = check_fused(fn, *_inputs())
    assert "scan=prefix" in report.regions[0].kernel_source and "2-pass" in report.regions[0].features


def test_partial_sums_read_through_a_comparison_only():
    """A budget mask: each query keeps the keys until the gates summed so far reach 1.5 (nearest
    first: the sums over the keys after each key). No gradient reaches the partial sums (a
    comparison), but the kernels compute them to mask the scores: generated, one dQ kernel."""
    def fn(q, k, v):
        s, mask = _logits(q, k), _masks(q, k, attend_current=True)
        g = torch.sigmoid(s).masked_fill(mask, 0)
        after = g.flip(-1).cumsum(-1).flip(-1) - g
        return torch.softmax(s.masked_fill(mask | (after > 1.5), float("-inf")), -1) @ v
    _, report = check_fused(fn, *_inputs(M=N))
    r = report.regions[0]
    assert r.backward.startswith("generated") and "dx0" not in r.backward_source, r.backward
    check_grads(fn, _inputs(33, 33))


@pytest.mark.parametrize("program", ["reference_triangle_product", "flipped_cumsum", "gqa", "prefix_decay"])
@pytest.mark.parametrize("M", [1, 3])
def test_decoding_splits_the_keys(program, M, monkeypatch):
    """Few queries against many keys: each split computes its partial sums from 0, and the
    combine scales a split's state by exp(C_s), C_s the totals of the splits after it (before
    it: prefix), here over three splits of 100 keys in 16-key blocks."""
    from flashlight.runtime import decode
    from flashlight.runtime.op import REGISTRY
    monkeypatch.setattr(decode, "FORCE_SPLITS", 3)

    def gqa(q, k, v):
        return stick_breaking.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))

    def prefix_decay(q, k, v):
        """Each key weighed down by the gates of the keys before it (exp(-sum), a prefix scan of
        a non-negative body: d = -1)."""
        s = _logits(q, k)
        g = torch.sigmoid(s) * 0.3
        return (torch.exp(-(g.cumsum(-1) - g)) * torch.sigmoid(s)) @ v
    fn = {"gqa": gqa, "prefix_decay": prefix_decay}.get(program) or PROGRAMS[program]
    q, k, v = _inputs(M=M, N=100)
    if program == "gqa":
        q, k, v = torch.randn(B, 4, M, D), k, v
    report = flashlight.explain(fn, q, k, v)
    c = REGISTRY[report.regions[0].key]
    got = torch.compile(fn, backend="flashlight")(q, k, v)
    assert c.split and c.split.launches, "the split-KV path did not run"
    want = fn(q.double(), k.double(), v.double())
    assert (got - want).norm() / want.norm() < 1e-5


def test_decoding_a_softmax_of_partial_sums_keeps_one_kernel(monkeypatch):
    """A max over scores less a scan would move with the other splits' keys: no split."""
    from flashlight.runtime import decode
    from flashlight.runtime.op import REGISTRY
    monkeypatch.setattr(decode, "FORCE_SPLITS", 3)
    q, k, v = _inputs(M=2, N=100)
    report, _ = flashlight.explain(PROGRAMS["triu_product"], q, k, v), None
    c = REGISTRY[report.regions[0].key]
    got = torch.compile(PROGRAMS["triu_product"], backend="flashlight")(q, k, v)
    assert c.split is False or not c.split.launches
    want = PROGRAMS["triu_product"](q.double(), k.double(), v.double())
    assert (got - want).norm() / want.norm() < 1e-5


def test_a_split_forward_is_followed_by_the_generated_backward(monkeypatch):
    """The combine stores the row statistics as the one-kernel forward does."""
    from flashlight.runtime import decode
    monkeypatch.setattr(decode, "FORCE_SPLITS", 3)
    check_grads(stick_breaking.attention, _inputs(M=3, N=100))
