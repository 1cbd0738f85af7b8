"""Capture accepts the common spellings of attention, and falls back (with a reason) otherwise."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import flashlight
from flashlight.ir import walk
from flashlight.testing import reference, rel_error
from helpers import check_fused, check_grads, grads

B, H, M, N, D = 2, 2, 21, 35, 16


def qkv(m=M, n=N, d=D, h=H, hkv=None):
    return (torch.randn(B, h, m, d), torch.randn(B, hkv or h, n, d), torch.randn(B, hkv or h, n, d))


SPELLINGS = {
    "bmm_3d": lambda q, k, v: torch.bmm(torch.softmax(torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)) / 4, -1),
                                        v.flatten(0, 1)),
    "einsum": lambda q, k, v: torch.einsum("bhmn,bhnd->bhmd", torch.einsum("bhmd,bhnd->bhmn", q, k).softmax(-1), v),
    "mT_and_scaled_q": lambda q, k, v: F.softmax((q * 0.25) @ k.mT, dim=-1) @ v,
    "divide_scores": lambda q, k, v: torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / 4.0, -1), v),
    "softmax_fp32_then_cast": lambda q, k, v: (q @ k.mT).softmax(-1, dtype=torch.float32).to(q.dtype) @ v,
    "additive_float_mask": lambda q, k, v: torch.softmax(
        q @ k.mT + torch.zeros(M, N).masked_fill((torch.arange(M * N).view(M, N) * 7) % 10 > 6, float("-inf")), -1) @ v,
    "finite_mask": lambda q, k, v: torch.softmax((q @ k.mT).masked_fill(
        torch.arange(N)[None, :] > torch.arange(M)[:, None] + 3, -1e9), -1) @ v,
    "triu_mask": lambda q, k, v: torch.softmax((q @ k.mT).masked_fill(
        torch.ones(M, N, dtype=torch.bool).triu(1), float("-inf")), -1) @ v,
    "log_softmax_exp": lambda q, k, v: torch.exp(torch.log_softmax(q @ k.mT, -1)) @ v,
    "scores_transposed": lambda q, k, v: torch.softmax((k @ q.mT).mT * 0.25, -1) @ v,     # K @ Q^T, then .mT
    "einsum_k_first": lambda q, k, v: torch.einsum("bhjd,bhid->bhij", k, q).softmax(-1) @ v,
    # [keys, queries] scores normalised over dim -2 (their keys), then read transposed
    "softmax_over_keys_first": lambda q, k, v: torch.softmax(k @ q.mT * 0.25, -2).mT @ v,
    "einsum_softmax_over_keys_first": lambda q, k, v: torch.einsum(
        "bhnm,bhnd->bhmd", torch.einsum("bhnd,bhmd->bhnm", k, q).softmax(dim=-2), v),
    "log_softmax_over_keys_first": lambda q, k, v: torch.log_softmax(k @ q.mT, 2).exp().transpose(2, 3) @ v,
}


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spelling_fuses(name):
    check_fused(SPELLINGS[name], *qkv())


def test_scores_computed_transposed_train():
    """``(k @ q^T)^T``: the dot's operands read the other way round (``rules.contraction``), with
    a bias that reads the transposed tile's positions; gradients against float64."""
    def attn(q, k, v, bias):
        st = k @ (q * 0.25).mT + bias                 # [.., N, M]
        return torch.softmax(st.transpose(-1, -2), -1) @ v
    inputs = [*qkv(), torch.randn(H, N, M)]
    check_fused(attn, *inputs, score_numel=B * H * M * N)
    check_grads(attn, [x.requires_grad_() for x in inputs])


@pytest.mark.parametrize("shape", [(H, 1, N), (B, 1, M, N), (1, 1, 1, N), (M, 1), (B, H, M, N)])
def test_bias_of_any_broadcast_shape(shape):
    bias = torch.randn(shape)
    # a full [B, H, M, N] bias is an input tensor: reading it is fine, building one is not
    numel = B * H * M * N + 1 if shape == (B, H, M, N) else None
    check_fused(lambda q, k, v, b: torch.softmax(q @ k.mT * 0.25 + b, -1) @ v, *qkv(), bias, score_numel=numel)


def test_bias_read_twice():
    bias = torch.randn(H, M, N)
    check_fused(lambda q, k, v, b: torch.softmax(q @ k.mT + b - 0.5 * b.abs(), -1) @ v, *qkv(), bias,
                score_numel=B * H * M * N)


@pytest.mark.parametrize("how", ["repeat_interleave", "view_5d", "expand_reshape"])
def test_gqa_spellings(how):
    q, k, v = qkv(h=4, hkv=2)

    def attn(q, k, v):
        if how == "repeat_interleave":
            k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        elif how == "expand_reshape":
            k = k[:, :, None].expand(B, 2, 2, N, D).reshape(B, 4, N, D)
            v = v[:, :, None].expand(B, 2, 2, N, D).reshape(B, 4, N, D)
        else:
            qg = q.view(B, 2, 2, M, D)
            out = torch.softmax(qg @ k[:, :, None].mT * 0.25, -1) @ v[:, :, None]
            return out.reshape(B, 4, M, D)
        return torch.softmax(q @ k.mT * 0.25, -1) @ v
    _, report = check_fused(attn, q, k, v)
    assert "gqa" in report.regions[0].features


def _mqa_einsum(q, k, v):
    # K and V shared by the heads: the head letter is in the query's operand only
    return torch.einsum("bhst,btd->bhsd", torch.einsum("bhsd,btd->bhst", q, k).mul(0.25).softmax(-1), v)


def _absorbed_mla(q, kv, pos):
    # DeepSeek-V3's absorbed MLA (inference/model.py), one latent per key for every head, the
    # query positions in the output's second letter: rows are the heads, each (b, s) a batch
    # element; a causal mask at an offset, indexed by s, the batch letter
    s = torch.einsum("bshc,btc->bsht", q, kv) * 0.25
    mask = torch.arange(kv.shape[1])[None, :] > pos[:, None] + torch.arange(q.shape[1])[:, None]
    s = s + torch.where(mask, float("-inf"), 0.0)[None, :, None, :]
    return torch.einsum("bsht,btc->bshc", s.softmax(-1), kv)


def _mqa_bshd(q, k, v):
    # the output in [B, S, H, D], as a model then merges the heads: rows s in both einsums
    return torch.einsum("bhst,btd->bshd", torch.einsum("bhsd,btd->bhst", q, k).mul(0.25).softmax(-1), v)


def test_einsum_with_a_batch_letter_one_operand_lacks():
    """Einsums where an output letter besides the rows is in the query's operand only (MQA's heads,
    MLA's query positions) fuse, that letter a batch dim K and V broadcast over; forward and
    gradients against float64."""
    q, k, v = torch.randn(B, H, M, D), torch.randn(B, N, D), torch.randn(B, N, D)
    _, report = check_fused(_mqa_einsum, q, k, v)
    assert report.regions[0].shapes["M"] == M
    check_grads(_mqa_einsum, [q, k, v])
    check_fused(_mqa_bshd, q, k, v)         # the rows letter from each operand's order, not the output's
    q, kv, pos = torch.randn(B, 7, 5, D), torch.randn(B, N, D), torch.tensor([N - 7])
    _, report = check_fused(_absorbed_mla, q, kv, pos)
    assert report.regions[0].shapes["M"] == 5, report      # the heads: FlashMLA's rows
    check_grads(_absorbed_mla, [q, kv, pos])


def _einsum_attention(eq_s, eq_o):
    return lambda q, k, v: torch.einsum(eq_o, torch.einsum(eq_s, q, k).mul(0.25).softmax(-1), v)


@pytest.mark.parametrize("eq_s, eq_o, kv_shape", [
    ("bhmd,bhnd->bhmn", "bhmn,bhnd->bhmd", (B, 1, N, D)),          # K and V of one head, size 1 where q has H
    ("... i d, ... j d -> ... i j", "... i j, ... j d -> ... i d", (B, H, N, D)),      # lucidrains' spelling
    ("... i d, ... j d -> ... i j", "... i j, ... j d -> ... i d", (1, N, D)),         # right-aligned: k's dim meets h
])
def test_einsum_broadcasting_and_ellipses(eq_s, eq_o, kv_shape):
    """A letter where K and V have size 1 broadcasts (it read q's index there, not 0: relative
    error 0.98 before), and ``...`` expands right-aligned, as torch.einsum has them; forward and
    gradients (K's and V's summed over the broadcast) against float64."""
    fn = _einsum_attention(eq_s, eq_o)
    q, k, v = torch.randn(B, H, M, D), torch.randn(kv_shape), torch.randn(kv_shape)
    check_fused(fn, q, k, v)
    check_grads(fn, [q, k, v])


@pytest.mark.parametrize("eq", ["bhmd,bhnd->bhmnd", "bhmd,bhmd->bhmm", "bhmd,bhnd->bhm", "bhdd,bhnd->bhdn",
                                "bhmde,bhnde->bhmn", "bhmd,bhnd->bhmn"])
def test_einsum_letters_accepts_one_contraction(eq):
    from flashlight.capture.rules import einsum_letters
    assert (einsum_letters(eq) is not None) == (eq == "bhmd,bhnd->bhmn")
    assert einsum_letters("bshc,btc->bsht")[3] == "bsht"      # rows h (the last letter only in a)
    assert einsum_letters("bhsd,btd->bhst")[3] == "bhst"
    from flashlight.capture.rules import expand_ellipsis
    assert expand_ellipsis("... i d, ... j d -> ... i j", [4, 3]) == "ABid,Bjd->ABij"
    assert expand_ellipsis("...id,...jd->...ij", [2, 2]) == "id,jd->ij"


def test_non_contiguous_bshd_inputs():
    q, k, v = (torch.randn(B, L, H, D).transpose(1, 2) for L in (M, N, N))
    check_fused(lambda q, k, v: torch.softmax(q @ k.mT / 4, -1) @ v, q, k, v)


def test_relative_position_index_bias():
    table = torch.randn(H, 2 * 64 + 1)

    def attn(q, k, v, table):
        rel = torch.arange(N)[None, :] - torch.arange(M)[:, None] + 64
        return torch.softmax(q @ k.mT + table[:, rel], -1) @ v
    args = (*qkv(), table)
    out = torch.compile(attn, backend="flashlight")(*args)   # the gather is still a leaf today
    assert rel_error(out, reference(attn, *args)) < 1e-3


# ------------------------------------------------------------------------------------ fallbacks
def test_softmax_over_query_dim_falls_back_with_reason():
    def attn(q, k, v):
        return torch.softmax(q @ k.mT, dim=-2) @ v     # over queries: not attention over keys
    q, k, v = qkv(m=N)
    report = flashlight.explain(attn, q, k, v)
    assert not report.regions
    assert "softmax over dim -2, read along the queries" in report.fallbacks[0].reason, report
    out = torch.compile(attn, backend="flashlight")(q, k, v)
    assert rel_error(out, reference(attn, q, k, v)) < 1e-6


def test_softmax_over_keys_of_transposed_scores_trains():
    """Scores computed as [keys, queries], masked causally, and a softmax over dim -2 (the keys
    there): fused, outputs and gradients against float64 (it fell back, naming the dim)."""
    def attn(q, k, v, bias):
        st = (k @ q.mT * 0.25 + bias).masked_fill(torch.ones(N, M, dtype=torch.bool).tril(-1), float("-inf"))
        return torch.softmax(st, dim=-2).mT @ v
    inputs = [*qkv(), torch.randn(H, N, 1)]
    check_fused(attn, *inputs, score_numel=B * H * M * N)
    check_grads(attn, [x.requires_grad_() for x in inputs])


@pytest.mark.parametrize("log", [False, True])
def test_a_softmax_over_the_heads_in_a_region_is_computed_outside(log):
    """A softmax over a [H] gate's heads, read in the epilogue and in the scores: computed outside
    the kernel, not taken for a reduction over the keys. Before, the kernel reduced the gate over
    key positions: relative error 1.0 (0.56 with log_softmax) when N != H."""
    norm = torch.log_softmax if log else torch.softmax

    def attn(q, k, v, g):
        o = torch.softmax(q @ k.mT * 0.25 + norm(g, -1)[:, None, None], -1) @ v
        return o * norm(g * 2, -1)[:, None, None]
    inputs = [*qkv(), torch.randn(H)]
    check_fused(attn, *inputs)
    check_grads(attn, [x.requires_grad_() for x in inputs])


def test_dropout_of_everything_falls_back_with_reason_and_source_line():
    def attn(q, k, v):
        return F.dropout(torch.softmax(q @ k.mT, -1), p=1.0, training=True) @ v
    report = flashlight.explain(attn, *qkv())
    assert not report.regions
    assert report.fallbacks and "dropout" in report.fallbacks[0].reason
    assert "test_capture.py" in report.fallbacks[0].source
    assert "fallback" in str(report)


def test_scores_used_elsewhere_still_correct():
    """A program that also returns the probabilities: the output fuses, the probabilities are
    computed as before for the user."""
    def attn(q, k, v):
        p = torch.softmax(q @ k.mT * 0.25, -1)
        return p @ v, p
    q, k, v = qkv()
    out, p = torch.compile(attn, backend="flashlight")(q, k, v)
    ref_out, ref_p = attn(*(x.double() for x in (q, k, v)))
    assert rel_error(out, ref_out) < 1e-3 and rel_error(p, ref_p) < 1e-5


def _top_k(q, k, v):
    s = q @ k.mT * 0.25
    return torch.softmax(s.masked_fill(s < s.topk(8, dim=-1).values[..., -1:], float("-inf")), -1) @ v


def _threshold_of_a_second_product(q, k, v):
    s = q @ k.mT * 0.25
    with torch.no_grad():
        t = (q @ k.mT * 0.25).topk(6, dim=-1).values[..., -1:]
    return torch.softmax(s.masked_fill(s < t, float("-inf")), -1) @ v


def _hard_attention_on_a_detached_max(q, k, v):
    s = q @ k.mT * 0.25
    return torch.softmax(s.masked_fill(s != s.detach().amax(-1, keepdim=True), float("-inf")), -1) @ v


def _sign_against_top_k(q, k, v):
    s = q @ k.mT * 0.25
    return torch.softmax(s + torch.sign(s - s.topk(6, dim=-1).values[..., -1:]), -1) @ v


def _relu_above_top_k(q, k, v):
    s = q @ k.mT * 0.25
    p = torch.relu(s - s.topk(4, dim=-1).values[..., -1:])
    return (p / (p.sum(-1, keepdim=True) + 1e-6)) @ v


@pytest.mark.parametrize("fn", [_top_k, _threshold_of_a_second_product, _sign_against_top_k, _relu_above_top_k],
                         ids=lambda f: f.__name__[1:])
def test_thresholds_from_the_scores_top_k_fuse(fn):
    """Thresholds taken from the scores' own top-k (under no_grad from a second product of the
    same q and k, the k-th score under sign or relu). Before session 32 the top-k ran outside
    the region and each fell back: the kernel recomputes the scores, not bitwise as eager's
    single product, and the comparison flipped at the k-th score itself (output errors of
    3-66 % in fp32). Now the k-th value is a ``kth`` reduction of the kernel's own scores,
    compared with the same recomputed scores: fused, output and gradients match float64 (relu's
    s - kth takes a gradient at the k-th key: the reference VJP, ``backward_support``)."""
    torch.manual_seed(0)
    xs = [x.requires_grad_() for x in qkv()]
    report = flashlight.explain(fn, *xs)
    assert len(report.regions) == 1 and "top-k" in report.regions[0].features, report
    inputs = [x.detach() for x in xs]
    assert rel_error(torch.compile(fn, backend="flashlight")(*inputs), fn(*(x.double() for x in inputs))) < 1e-5
    for a, b in zip(grads(torch.compile(fn, backend="flashlight"), inputs, fp64=False), grads(fn, inputs, fp64=True)):
        assert rel_error(a, b) < 1e-4


def test_scores_meeting_their_own_values_still_fuse():
    """The same scores used smoothly outside (a detached copy added back), a threshold from an
    input, hard attention against the kernel's own row max without gradients (in training the
    detached copies fuse as ``stop`` expressions: no score-sized tensor outside), and a bias from
    a product of other tensors (Evoformer's pair bias through a Linear) under clamp and a
    threshold off the kernel's own row max, in training too: fused, exact. (A first version of
    the check refused anything with a product among a load's ancestors.)"""
    def smooth(q, k, v):
        s = q @ k.mT * 0.25
        return torch.softmax(s + 0.5 * s.detach().tanh(), -1) @ v

    def input_threshold(q, k, v, t):
        s = q @ k.mT * 0.25
        return torch.softmax(s.masked_fill(s < t, float("-inf")), -1) @ v
    def projected_bias(q, k, v, pair, w):       # Evoformer's pair bias through a Linear, clamped
        s = q @ k.mT * 0.25 + (pair @ w).permute(0, 3, 1, 2)
        return torch.softmax(s.clamp(min=-2.0).masked_fill(s < s.amax(-1, keepdim=True) - 3, float("-inf")), -1) @ v
    torch.manual_seed(0)
    xs = qkv()
    for fn, args in ((smooth, xs), (input_threshold, (*xs, torch.randn(B, H, M, 1))),
                     (_hard_attention_on_a_detached_max, xs),
                     (projected_bias, (*xs, torch.randn(B, M, N, 8), torch.randn(8, H)))):
        assert len(flashlight.explain(fn, *args).regions) == 1, fn.__name__
        assert rel_error(torch.compile(fn, backend="flashlight")(*args), reference(fn, *args)) < 1e-5
    for fn in (smooth, _hard_attention_on_a_detached_max):     # in training the detached copies fuse as stops
        leaves = [x.clone().requires_grad_() for x in xs]
        report = flashlight.explain(fn, *leaves)
        assert len(report.regions) == 1 and not any("matmul" in g.code for g in report.graphs), report
        for a, b in zip(grads(torch.compile(fn, backend="flashlight"), leaves, fp64=False), grads(fn, leaves, fp64=True)):
            assert rel_error(a, b) < 1e-4
    trained = [x.requires_grad_() for x in (*xs, torch.randn(B, M, N, 8), torch.randn(8, H))]
    assert len(flashlight.explain(projected_bias, *trained).regions) == 1      # clamp is a kink: training too
    for a, b in zip(grads(torch.compile(projected_bias, backend="flashlight"), trained, fp64=False),
                    grads(projected_bias, trained, fp64=True)):
        assert rel_error(a, b) < 1e-4


def test_plain_matmuls_are_left_alone():
    def mlp(x, w1, w2):
        return torch.relu(x @ w1) @ w2
    x, w1, w2 = torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 4)
    report = flashlight.explain(mlp, x, w1, w2)
    assert not report.regions and not report.fallbacks


def test_hand_written_softmax_on_empty_rows_gives_zero():
    """Found by the fuzzer: exp(s - max) / sum on an all -inf row is 0/0; like softmax, 0."""
    def attn(q, k, v, valid):
        s = (q @ k.mT).masked_fill(~valid[:, None, None, :], float("-inf"))
        e = torch.exp(s - s.amax(-1, keepdim=True))
        return (e / e.sum(-1, keepdim=True)) @ v
    q, k, v = qkv()
    valid = torch.arange(N)[None, :] < torch.tensor([0, 9])[:, None]
    out, _ = check_fused(attn, q, k, v, valid)
    assert torch.all(out[0] == 0)


@pytest.mark.parametrize("m,n", [(1, 1), (1, 7), (5, 1)])
def test_single_query_or_key_with_gqa(m, n):
    """Found by the fuzzer: a size-1 key dim folded to index 0 left K a [DK, 1] tile."""
    q, k, v = torch.randn(2, 4, m, 16), torch.randn(2, 1, n, 16), torch.randn(2, 1, n, 16)

    def attn(q, k, v):
        k, v = k[:, :, None].expand(2, 1, 4, n, 16).reshape(2, 4, n, 16), v.repeat_interleave(4, dim=1)
        return torch.softmax(q @ k.mT / 4, -1) @ v
    check_fused(attn, q, k, v)


def test_a_mask_written_through_a_view_is_read_as_written():
    """``keep = ones(M, N).tril(); keep[:7] = False``: the write goes through a view of the mask,
    which its own expression (the causal predicate) does not show, so the kernel reads the mask
    tensor as the program left it (rows 0-6 fully masked with a finite fill: eager averages V
    there). Same for scores updated through a view (``s[..., :3] = -1e4``)."""
    def masked(q, k, v):
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        keep[:7] = False
        return torch.softmax((q @ k.mT).masked_fill(~keep, torch.finfo(q.dtype).min), dim=-1) @ v

    def scores_view(q, k, v):
        s = q @ k.mT * q.shape[-1] ** -0.5
        s[..., :3] = -1e4
        return torch.softmax(s, dim=-1) @ v
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    for fn in (masked, scores_view):
        torch.compiler.reset()
        out = torch.compile(fn, backend="flashlight")(q, k, v)
        assert rel_error(out, reference(fn, q, k, v)) < 1e-4, fn.__name__
    report = flashlight.explain(masked, q, k, v)
    assert len(report.regions) == 1 and "tril" in report.regions[0].ir     # the mask, loaded


def test_an_in_place_update_seen_through_an_earlier_view_is_not_read_as_out_of_place():
    """``t = s[..., :]; s.mul_(0.25)``: t shows the update (it shares s's memory), which an
    out-of-place reading of the update would not give t (``symbolic.written_later`` loads such
    a tensor instead); the same through a ``reshape`` of the base. Results match eager."""
    def sliced(q, k, v):
        s = q @ k.mT
        t = s[..., :]
        s.mul_(0.25)
        return torch.softmax(t, -1) @ v

    def reshaped(q, k, v):
        s = (q @ k.mT).reshape(-1, N)
        t = s.view(B, H, M, N)
        s.add_(1.0).mul_(3.0)
        return torch.softmax(t, -1) @ v
    q, k, v = qkv()
    for fn in (sliced, reshaped):
        torch.compiler.reset()
        out = torch.compile(fn, backend="flashlight")(q, k, v)
        assert rel_error(out, reference(fn, q, k, v)) < 1e-4, fn.__name__


def test_torch_max_and_min_of_two_tensors():
    """``torch.max(s, floor)`` / ``torch.min(s, ceil)`` (the ``other`` overloads; OPT clamps its
    scores with a 0-d tensor this way) fuse as maximum / minimum, forward and gradients."""
    def opt(q, k, v, floor):
        s = torch.max(q @ k.mT * 0.25 + torch.zeros(M, N).masked_fill(torch.ones(M, N).triu(1).bool(), -1e4), floor)
        return torch.softmax(torch.min(s, torch.tensor(3.0)), -1) @ v
    inputs = (*qkv(), torch.tensor(-50.0))
    check_fused(opt, *inputs)
    check_grads(opt, inputs)


def test_embedding_table_read_in_the_kernel():
    """T5's relative-position bias: ``F.embedding(bucket, table)`` of a bucket computed from
    q - kv is the table read at the bucket in the kernel (no query-by-key bias built outside),
    and the table's gradient is scatter-added, against float64."""
    def t5(q, k, v, table):
        rel = torch.arange(N)[None, :] - torch.arange(M)[:, None]
        bucket = torch.clamp(rel, -7, 7) + 7 + 15 * (rel > 0).long()
        bias = F.embedding(bucket, table).permute(2, 0, 1)[None]        # [1, H, M, N]
        return torch.softmax(q @ k.mT + bias, -1) @ v
    inputs = (*qkv(), torch.randn(30, H))
    _, report = check_fused(t5, *inputs, score_numel=M * N)
    assert "(30, 2)" in report.regions[0].ir
    check_grads(t5, inputs)


def test_index_select_table_read_in_the_kernel():
    """Swin's relative-position bias through ``index_select`` of a flattened bucket index: the
    table read at the bucket in the kernel, its gradient scatter-added, against float64."""
    def swin(q, k, v, table):
        rel = (torch.arange(N)[None, :] - torch.arange(M)[:, None]).clamp(-7, 7) + 7
        bias = table.index_select(0, rel.reshape(-1)).view(M, N, H).permute(2, 0, 1)
        return torch.softmax(q @ k.mT + bias[None], -1) @ v
    inputs = (*qkv(), torch.randn(15, H))
    _, report = check_fused(swin, *inputs, score_numel=M * N)
    assert "(15, 2)" in report.regions[0].ir
    check_grads(swin, inputs)


def test_gathered_relative_position_scores():
    """DeBERTa's disentangled attention: ``gather(q @ rel_k^T, -1, clamp(m - n + K, 0, 2K - 1))``
    (content to position) and its transposed position-to-content twin. The products are
    query-by-2K (small, computed outside) and read in the kernel at the gathered index: no
    query-by-key tensor is built outside; gradients reach q, k and the position embeddings."""
    K = 4

    def deberta(q, k, v, rel_k, rel_q):
        pos = (torch.arange(M)[:, None] - torch.arange(N)[None, :]).clamp(-K, K - 1) + K       # [M, N] in [0, 2K)
        c2p = torch.gather(q @ rel_k.mT, -1, pos.expand(B, H, M, N))
        p2c = torch.gather(k @ rel_q.mT, -1, (2 * K - 1 - pos).mT.expand(B, H, N, M)).mT
        return torch.softmax((q @ k.mT + c2p + p2c) * 0.2, -1) @ v
    inputs = (*qkv(), torch.randn(H, 2 * K, D), torch.randn(H, 2 * K, D))
    _, report = check_fused(deberta, *inputs)
    planes = [n.name for g in report.graphs for n in g.graph.nodes if n.op == "call_function" and
              isinstance(n.meta.get("val"), torch.Tensor) and set(n.meta["val"].shape[-2:]) == {M, N}]
    assert not planes, planes
    check_grads(deberta, inputs)


@pytest.mark.parametrize("start", [0, 8])
def test_concatenated_mask_pieces_are_index_expressions(start):
    """Llama 3's mask, ``hstack([zeros((L, start_pos)), triu(full(-inf), 1)])``: an empty piece
    drops out (start_pos 0), two pieces are read piecewise along the key dim; both stay index
    masks (blocks skipped). A piece that is a loaded tensor is read at its clamped index."""
    def llama3(q, k, v):
        L = q.shape[-2]
        mask = torch.triu(torch.full((L, L), float("-inf")), diagonal=1)
        mask = torch.hstack([torch.zeros((L, start)), mask])
        return torch.softmax(q @ k.mT * 0.25 + mask, -1) @ v
    q, k, v = qkv(m=40, n=40 + start)
    _, report = check_fused(llama3, q, k, v)
    assert {"block-sparse", "index-mask"} <= set(report.regions[0].features)
    check_grads(llama3, (q, k, v))

    def loaded_piece(q, k, v, keep):
        mask = torch.cat([keep, torch.arange(N - 5)[None, :] <= torch.arange(M)[:, None]], dim=-1)
        return torch.softmax((q @ k.mT).masked_fill(~mask, float("-inf")), -1) @ v
    keep = torch.rand(M, 5) > 0.3
    keep[:, 0] = True
    check_fused(loaded_piece, *qkv(), keep)


def test_nan_to_num_of_the_scores():
    """``nan_to_num`` (the DIFF Transformer applies it to its scores): a NaN query row scores 0
    everywhere (a uniform row), an infinite key takes its rows' whole weight or none; with
    explicit replacement values too. Against float64 eager (where ±inf go to float64's extremes:
    the same weights)."""
    q, k, v = qkv()
    q[0, 1, 4] = float("nan")
    k[1, 0, 9, 0] = float("inf")
    mask = torch.arange(N)[None, :] > torch.arange(M)[:, None] + 10

    def f(q, k, v):
        s = torch.nan_to_num(q @ k.mT * D ** -0.5).masked_fill(mask, float("-inf"))
        return torch.softmax(s, -1) @ v

    def g(q, k, v):
        return torch.softmax(torch.nan_to_num(q @ k.mT, nan=-1.0, posinf=30.0, neginf=-30.0), -1) @ v
    for fn in (f, g):
        out, _ = check_fused(fn, q, k, v)
        assert out.isfinite().all()


def test_stacked_layers_fuse_without_spurious_reasons():
    """Two pre-norm layers: both attentions fuse, and explain() gives no reason for the second
    layer's q @ k^T (it reached the first layer's softmax through its P @ V and a projection,
    and was reported as an attention product that failed to fuse)."""
    g = torch.Generator().manual_seed(5)
    w = [torch.randn(32, 32, generator=g) / 6 for _ in range(4)]

    def layer(x, wq, wk):
        h = F.layer_norm(x, (32,))
        q, k, v = (t.unflatten(-1, (2, 16)).transpose(1, 2) for t in (h @ wq, h @ wk, h))
        o = torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v
        return x + o.transpose(1, 2).flatten(-2)

    def two_layers(x, w0, w1, w2, w3):
        return layer(layer(x, w0, w1), w2, w3)
    x = torch.randn(2, 24, 32, generator=g)
    report = flashlight.explain(two_layers, x, *w)
    assert len(report.regions) == 2 and not report.fallbacks, report
    assert rel_error(torch.compile(two_layers, backend="flashlight")(x, *w), reference(two_layers, x, *w)) < 1e-3


def test_layers_stacked_without_projection_fuse_without_spurious_reasons():
    """The first layer's output is the second's q: the candidate that sees the first layer's
    P @ V through the second q @ k^T fails to lower, but the second region computes its root,
    so explain() gives no reason."""
    def stacked(q, k, v):
        o = torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v
        return torch.softmax(o @ k.transpose(-1, -2) * 0.25, -1) @ v
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    report = flashlight.explain(stacked, q, k, v)
    assert len(report.regions) == 2 and not report.fallbacks, report
    assert rel_error(torch.compile(stacked, backend="flashlight")(q, k, v), reference(stacked, q, k, v)) < 1e-4


def test_a_layer_that_does_not_fuse_keeps_its_reason_beside_a_later_one_that_does():
    """The second layer's candidate reads the first layer's unfused output: its reason stays
    (the first layer still runs unfused), unlike a candidate whose nodes a region computes."""
    def as_v(q, k, v):
        o = torch.softmax((q @ k.transpose(-1, -2) * 0.25).cumprod(-1), -1) @ v
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ o
    q, k, v = (torch.randn(4, 40, 16) for _ in range(3))
    report = flashlight.explain(as_v, q, k, v)
    assert len(report.regions) == 1 and ["cumprod" in f.reason for f in report.fallbacks] == [True], report


def test_the_output_dtype_is_part_of_a_regions_identity():
    """Two programs alike but for a cast of the output (float-to-float casts are no IR op):
    the second took the first's registered region, and its float32 output."""
    def plain(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    def cast(q, k, v):
        return plain(q, k, v).to(torch.bfloat16)
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    assert torch.compile(plain, backend="flashlight")(q, k, v).dtype == torch.float32
    out = torch.compile(cast, backend="flashlight")(q, k, v)
    assert out.dtype == torch.bfloat16 and rel_error(out.double(), plain(q, k, v).double()) < 1e-2


def _bloom(q, k, v, alibi):
    """BLOOM's attention: the scores by ``torch.baddbmm`` with the ALiBi bias as its input, over
    heads flattened into the batch."""
    B, H, M, D = q.shape
    N = k.shape[-2]
    scores = torch.baddbmm(alibi, q.reshape(B * H, M, D), k.reshape(B * H, N, D).transpose(1, 2),
                           beta=0.5, alpha=D ** -0.5)
    p = torch.softmax(scores.view(B, H, M, N), -1)
    return torch.bmm(p.view(B * H, M, N), v.reshape(B * H, N, D)).view(B, H, M, D)


def test_baddbmm_scores_fuse_with_their_bias():
    """``baddbmm(bias, q, k^T, beta, alpha)`` (BLOOM) is a score contraction plus a bias: one
    region; forward and the gradients of q, k, v and the bias table against float64."""
    g = torch.Generator().manual_seed(8)
    B, H, N, D = 2, 4, 37, 16
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    slopes = torch.tensor([2 ** (-8 * (i + 1) / H) for i in range(H)])
    alibi = (slopes[:, None] * torch.arange(N)[None, :]).repeat(B, 1)[:, None, :].contiguous()    # [B*H, 1, N]
    _, report = check_fused(_bloom, q, k, v, alibi)
    assert "gqa" not in report.regions[0].features      # heads flattened into the batch: as many K heads as Q
    check_grads(_bloom, [q, k, v, alibi])


def test_baddbmm_with_beta_zero_ignores_its_input():
    """``baddbmm(torch.empty(...), q, k^T, beta=0, alpha=a)`` (Megatron, GPT-NeoX): PyTorch
    ignores the input when beta is 0, NaN and inf included; the region must not read it
    (0 * NaN is NaN: the whole output was NaN)."""
    def scores_from_a_buffer(q, k, v, buf):
        s = torch.baddbmm(buf, q, k.transpose(1, 2), beta=0.0, alpha=0.25)
        return torch.bmm(torch.softmax(s, -1), v)
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(8, 24, 16, generator=g) for _ in range(3))
    buf = torch.full((8, 24, 24), float("nan"))
    buf[:, :, :5] = float("inf")
    check_fused(scores_from_a_buffer, q, k, v, buf)


def test_computed_query_operands_load_as_leaves_in_training():
    """In training, a Q operand that reads two or more floating [m, dk] tiles (RoPE on q, q plus a
    learned position table) is computed once outside the kernel and loaded: the dK/dV kernel
    would compute every Q tile again for each key block, and the dQ kernel would hold the
    operand's tiles across its loop for the chain rule. For inference it stays in the kernel
    (computed once per query block), and so does a per-row factor in training (``q * g[m]``).
    Gradients of every input, the tables' included, against float64."""
    from flashlight.examples import VARIANTS
    from flashlight.runtime.op import REGISTRY
    rope = VARIANTS["rope"]

    def positioned(q, k, v, pos):
        return torch.softmax((q + pos) @ k.mT * 0.25, -1) @ v

    def row_scaled(q, k, v, g):
        return torch.softmax((q * g[..., None]) @ k.mT * 0.25, -1) @ v

    def fresh():
        REGISTRY.clear()
        torch.compiler.reset()

    def q_operand(fn, inputs, grad):
        fresh()
        with torch.set_grad_enabled(grad):
            check_fused(fn, *[x.detach().requires_grad_(grad) for x in inputs])
        (c,) = REGISTRY.values()
        return c.region.dots[0].q.op

    for fn, inputs, inferred, trained in [
            (rope.attention, rope.make_inputs(B=B, H=H, M=M, N=N, D=D), "add", "load"),
            (positioned, (*qkv(), torch.randn(M, D)), "add", "load"),
            (row_scaled, (*qkv(), torch.rand(B, H, M) + 0.5), "mul", "mul")]:
        assert q_operand(fn, inputs, grad=False) == inferred, fn.__name__
        assert q_operand(fn, inputs, grad=True) == trained, fn.__name__
        fresh()
        check_grads(fn, [x.detach().requires_grad_() for x in inputs])


@pytest.mark.parametrize("causal", [False, True])
def test_qk_norm_fuses_when_the_keys_are_as_many_as_the_head_dim(causal):
    """Qwen3's QK-norm (an RMSNorm over the head dim of q and of k) at N == D: the mean over the
    head dim is not a reduction over the keys, though as long. It fell back ("reduction over N
    read at a varying key position"); now the means are computed outside the kernel, and the
    program fuses with its gradients."""
    def qk_norm(q, k, v, wq, wk):
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * wq
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * wk
        s = q @ k.mT * 0.25
        if causal:
            s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(s, -1) @ v
    inputs = [*qkv(m=N, d=N), 1 + 0.1 * torch.randn(N), 1 + 0.1 * torch.randn(N)]
    check_fused(qk_norm, *inputs, score_numel=B * H * N * N + 1)     # q and k are score-sized here
    check_grads(qk_norm, [x.requires_grad_() for x in inputs])


@pytest.mark.parametrize("kv_leaves", ["1", "0"])
def test_computed_key_and_value_operands_load_as_leaves(kv_leaves, monkeypatch):
    """A K or V operand that reads two or more floating tensors along the keys (RoPE on k, QK-norm,
    ``v * gate``; matmul or einsum) is computed once outside the kernel and loaded: in the kernel every query
    block would compute its tiles again. Q stays in the kernel, and so do a K scaled per head (one
    tensor along the keys) and a gather through a page table (an integer index).
    ``FLASHLIGHT_KV_LEAVES=0`` keeps all of them in the kernel. Forward and gradients against
    float64 both ways."""
    from flashlight.examples import VARIANTS
    from flashlight.runtime.op import REGISTRY
    monkeypatch.setenv("FLASHLIGHT_KV_LEAVES", kv_leaves)
    torch.compiler.reset()

    def operands():
        (c,) = REGISTRY.values()
        d = c.region.dots[0]
        return d.q.op, d.k.op, c.region.reductions[-1].v.op

    def qknorm_gated(q, k, v, gate):
        qn, kn = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
        return torch.softmax(qn @ kn.mT * 4.0, -1) @ (v * torch.sigmoid(gate))

    def head_scaled(q, k, v, scale):
        return torch.softmax(q @ (k * scale).mT * 0.25, -1) @ v

    def einsum_rope(q, k, v, cos, sin):
        k = k * cos + VARIANTS["rope"].rotate_half(k) * sin
        s = torch.einsum("bhmd,bhnd->bhmn", q, k) * 0.25
        return torch.einsum("bhmn,bhnd->bhmd", s.softmax(-1), v * cos)

    rope = VARIANTS["rope"]
    leaves = kv_leaves == "1"
    for fn, inputs, want in [
            (rope.attention, rope.make_inputs(B=B, H=H, M=M, N=N, D=D), ("add", "load" if leaves else "add", "load")),
            (qknorm_gated, (*qkv(), torch.randn(B, H, N, D)), ("div", "load" if leaves else "div",
                                                                "load" if leaves else "mul")),
            (head_scaled, (*qkv(), torch.rand(1, H, 1, 1) + 0.5), ("load", "mul", "load")),
            (einsum_rope, rope.make_inputs(B=B, H=H, M=M, N=N, D=D), ("load", "load" if leaves else "add",
                                                                      "load" if leaves else "mul"))]:
        REGISTRY.clear()
        check_fused(fn, *inputs)
        assert operands() == want, (fn.__name__, operands())
        check_grads(fn, inputs)

    def rope_then_gqa(expand):
        """Llama's order: RoPE on k at its own Hkv heads, then ``repeat_kv`` up to the query heads,
        as ``repeat_interleave`` or as Hugging Face's expand and reshape."""
        def repeat(x):
            if expand:
                b, h, n, d = x.shape
                return x[:, :, None].expand(b, h, 2, n, d).reshape(b, 2 * h, n, d)
            return x.repeat_interleave(2, dim=1)

        def fn(q, k, v, cos, sin):
            k = repeat(k * cos + VARIANTS["rope"].rotate_half(k) * sin)
            return torch.softmax(q @ k.mT * 0.25, -1) @ repeat(v)
        return fn

    for expand in (False, True):
        q, k, v, cos, sin = rope.make_inputs(B=B, H=2 * H, M=M, N=N, D=D)
        inputs = (q, k[:, :H].contiguous(), v[:, :H].contiguous(), cos, sin)
        REGISTRY.clear()
        check_fused(rope_then_gqa(expand), *inputs)
        (c,) = REGISTRY.values()
        k_inputs = {c.region.inputs[x.args[0]].shape for x in walk(c.region.dots[0].k) if x.op == "load"}
        assert k_inputs == ({(B, H, N, D)} if leaves else {(B, H, N, D), (N, D)}), (expand, k_inputs)
        check_grads(rope_then_gqa(expand), inputs)

    def written_after_its_copy(copy):
        """The rotated k is copied (GQA's repeat, a clone), then written in place: the kernel
        runs after the write, so it loads the copy, not the tensor the copy was made from."""
        def fn(q, k, v, cos, sin):
            kr = k * cos + VARIANTS["rope"].rotate_half(k) * sin
            kk = kr.repeat_interleave(2, dim=1) if copy == "repeat" else kr.clone()
            kr.mul_(3.0)
            return torch.softmax(q @ kk.mT * 0.25, -1) @ (v.repeat_interleave(2, dim=1) if copy == "repeat" else v)
        return fn

    for copy in ("repeat", "clone"):
        q, k, v, cos, sin = rope.make_inputs(B=B, H=2 * H, M=M, N=N, D=D)
        heads = H if copy == "repeat" else 2 * H
        REGISTRY.clear()
        check_fused(written_after_its_copy(copy), q, k[:, :heads].contiguous(), v[:, :heads].contiguous(), cos, sin)

    paged = VARIANTS["paged_decode"]
    REGISTRY.clear()
    check_fused(paged.attention, *paged.make_inputs(B=2, H=4, M=37, D=16, queries=3))
    (c,) = REGISTRY.values()
    assert any(x.op == "load" and x.kind == "i" for x in walk(c.region.dots[0].k))     # the page table, read in the kernel


def test_explain_gives_each_programs_own_line():
    """Two programs with the same region share its compiled entry; explain() names the line of
    the program at hand, not the first one's."""
    first = lambda q, k, v: torch.softmax(q @ k.mT, -1) @ v      # noqa: E731
    second = lambda q, k, v: torch.softmax(q @ k.mT, -1) @ v     # noqa: E731
    a, b = (flashlight.explain(f, *qkv()).regions[0] for f in (first, second))
    assert a.key == b.key and a.source != b.source and "second" in b.source, (a.source, b.source)


def test_explain_names_pytorchs_fast_path_and_graph_breaks():
    """What never reaches the backend as an attention program gets a line too: PyTorch's fused
    fast path of an nn.TransformerEncoderLayer in eval mode (one opaque op; with the fast path
    off the layer fuses), and a Dynamo graph break between the scores and the softmax."""
    layer = torch.nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, batch_first=True).eval()
    x, keep = torch.randn(2, 29, 32), torch.arange(29)[None, :] >= torch.tensor([29, 17])[:, None]
    with torch.no_grad():
        report = flashlight.explain(lambda x: layer(x, src_key_padding_mask=keep), x)
        assert not report.regions and "set_fastpath_enabled(False)" in report.fallbacks[0].reason, report
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            assert len(flashlight.explain(lambda x: layer(x, src_key_padding_mask=keep), x).regions) == 1
        finally:
            torch.backends.mha.set_fastpath_enabled(True)

    def broken(q, k, v):
        s = q @ k.mT
        warnings.warn("scores computed")
        return torch.softmax(s, -1) @ v
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = flashlight.explain(broken, *qkv())
    assert not report.regions and "graph break" in str(report) and "warn" in report.graph_breaks[0], report
