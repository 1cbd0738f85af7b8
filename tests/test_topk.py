"""Top-k attention: ``s.topk(k).values[..., -1:]``, the row's k-th largest score, becomes a
``kth`` reduction (``capture.rules._topk_values``): a first pass over the keys keeps each row's k
largest values so far (``tl.topk`` of each key block merged into the candidates), the softmax
over the scores it keeps runs in the next pass. The threshold, read only through comparisons,
is a constant of the generated backward. Outputs and gradients against float64 eager at ragged
shapes, ranks below and above a key block, rows with fewer than k keys and rows without any."""
import pytest
import torch

import flashlight
from flashlight.codegen import kernel
from flashlight.runtime import decode
from flashlight.runtime.op import REGISTRY
from flashlight.testing import reference, rel_error
from helpers import check_fused, check_grads


def _scores(q, k):
    return q @ k.mT * q.shape[-1] ** -0.5


def top_k(k):
    """Keep each row's k largest scores (masked_fill below the k-th), then a softmax."""
    def attention(q, key, v):
        s = _scores(q, key)
        kth = s.topk(k, dim=-1).values[..., -1:]
        return torch.softmax(s.masked_fill(s < kth, float("-inf")), -1) @ v
    return attention


def causal_top_k(q, key, v):
    """Causal, ``torch.where(s >= kth, ...)``: the first rows have fewer than 10 keys (the
    threshold is -inf there, every live key stays); the k-th read as ``values[..., k - 1, None]``."""
    s = _scores(q, key)
    M, N = s.shape[-2:]
    s = s.masked_fill(~torch.ones(M, N, dtype=torch.bool, device=q.device).tril(N - M), float("-inf"))
    kth = s.topk(10, dim=-1).values[..., 9, None]
    return torch.softmax(torch.where(s >= kth, s, float("-inf")), -1) @ v


def top_k_probabilities(q, key, v):
    """The k largest probabilities renormalised (three passes: the softmax's sums, the k-th
    largest probability, the sum of the kept ones; its backward walks the keys for the
    normaliser, ``SumsWriter``)."""
    p = torch.softmax(_scores(q, key), -1)
    kth = p.topk(6, dim=-1).values[..., -1:]
    p = torch.where(p >= kth, p, 0.0)
    return (p / p.sum(-1, keepdim=True)) @ v


def late_rows(q, key, v):
    """Rows 0..4 see no key: their threshold and output are those of an empty row (0; nan_to_num,
    for eager's gradients, keeps the division in the product: three passes)."""
    s = _scores(q, key)
    i, j = torch.arange(s.shape[-2])[:, None], torch.arange(s.shape[-1])[None, :]
    s = s.masked_fill(j >= i - 4, float("-inf"))
    kth = s.topk(3, dim=-1).values[..., -1:]
    return torch.softmax(s.masked_fill(s < kth, float("-inf")), -1).nan_to_num(0.0) @ v


PROGRAMS = {"k5": (top_k(5), 2), "causal": (causal_top_k, 2), "probabilities": (top_k_probabilities, 3),
            "late_rows": (late_rows, 3)}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_top_k_fuses_and_trains(name):
    """One region, the expected passes, float64's outputs and gradients (the interpreter's 16-key
    blocks hold the candidates of these ranks: 8 and 16)."""
    fn, passes = PROGRAMS[name]
    q, k, v = torch.randn(1, 2, 37, 16), torch.randn(1, 2, 45, 16), torch.randn(1, 2, 45, 16)
    _, report = check_fused(fn, q, k, v)
    r = report.regions[0]
    assert "top-k" in r.features and f"{passes}-pass" in r.features, r.features
    assert r.backward.startswith("generated"), r.backward
    check_grads(fn, [x.clone().requires_grad_() for x in (q, k, v)])


@pytest.mark.parametrize("inserts", [-1, None], ids=["topk", "default"])
@pytest.mark.parametrize("rank", [20, 33])
def test_ranks_wider_than_a_key_block(monkeypatch, rank, inserts):
    """Ranks 20 and 33 keep 32 and 64 candidates, more than the interpreter's 16-key blocks: a
    block merged by ``tl.topk`` is widened with -inf first (``kernel.kth_merge``), once and twice;
    by default such narrow blocks are inserted value by value."""
    if inserts is not None:
        monkeypatch.setattr(kernel, "kth_inserts", lambda red: inserts)
    N = 2 * rank + 28       # the rank nearer the largest end (counted from the other past N / 2)
    q, k, v = torch.randn(1, 1, 5, 16), torch.randn(1, 1, N, 16), torch.randn(1, 1, N, 16)
    _, report = check_fused(top_k(rank), q, k, v)
    assert f"rank={rank}" in str(REGISTRY[report.regions[0].key].region), REGISTRY[report.regions[0].key].region


@pytest.mark.parametrize("inserts,program", [(-1, "k5"), (-1, "ties"), (10 ** 6, "k5"), (10 ** 6, "causal"),
                                             (10 ** 6, "ties")])
def test_each_merge_alone(monkeypatch, inserts, program):
    """``kth_merge`` inserts a block's few entering values one by one, or merges the block by
    ``tl.topk``: each way alone (the other's branch never taken) keeps the same candidates (causal
    rows reach tl.topk by default too: a row's first blocks all enter)."""
    monkeypatch.setattr(kernel, "kth_inserts", lambda red: inserts)
    fn = {"k5": top_k(5), "causal": causal_top_k, "ties": top_k(4)}[program]
    q, k = torch.randn(1, 2, 21, 16), torch.randn(1, 2, 83, 16)
    if program == "ties":
        q, k = torch.randint(-1, 2, q.shape).float(), torch.randint(-1, 2, k.shape).float()
    _, report = check_fused(fn, q, k, torch.randn(1, 2, 83, 16))
    assert f"<= {inserts}:" in REGISTRY[report.regions[0].key].source


SPELLINGS = {   # a row threshold over 150 keys: past KTH_MAX from the largest end, some are counted from the smallest
    "kthvalue": lambda s: s.kthvalue(s.shape[-1] - 3, -1, keepdim=True).values,          # the 4th largest
    "kthvalue_squeezed": lambda s: s.kthvalue(2, -1).values[..., None],                  # the 149th: -(2nd of -s)
    "sort": lambda s: s.sort(-1, descending=True).values[..., 4:5],
    "sort_stable_ascending": lambda s: torch.sort(s, dim=-1, stable=True).values[..., 1:2],
    "amin_of_topk": lambda s: s.topk(6, -1).values.amin(-1, keepdim=True),
    "min_of_smallest": lambda s: s.topk(3, -1, largest=False).values.max(-1, keepdim=True).values,
    "topk_index_list": lambda s: s.topk(5, -1).values[..., [-1]],                  # a graph constant
    "sort_index_select": lambda s: s.sort(-1, descending=True).values.index_select(
        -1, torch.tensor([2], device=s.device)),
}


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_order_statistic_spellings(name):
    """Other spellings of a row's k-th value: ``kthvalue``, ``sort`` (stable or not) read at a
    constant position, the min or max of sorted top-k values; a rank past KTH_MAX from one end is
    counted from the other (``rules._ranked``). Outputs against float64, and gradients where the
    threshold is counted from the smallest or read off the top-k values."""
    thr = SPELLINGS[name]

    def attention(q, key, v):
        s = _scores(q, key)
        return torch.softmax(torch.where(s >= thr(s), s, float("-inf")), -1) @ v
    q, k, v = torch.randn(1, 2, 21, 16), torch.randn(1, 2, 150, 16), torch.randn(1, 2, 150, 16)
    _, report = check_fused(attention, q, k, v)
    assert "top-k" in report.regions[0].features
    if name in ("kthvalue_squeezed", "amin_of_topk", "topk_index_list"):
        check_grads(attention, [x.clone().requires_grad_() for x in (q, k, v)])


def test_extremes_of_values_sorted_along_another_dim_are_reductions():
    """The max over the keys of a bias's top-3 along the queries, and the max and min of values
    sorted along a head-sized dim: only values sorted along the reduced dim have their extreme
    at an end (``_sorted_end``); the first was read at entry 0 (relative error 0.42)."""
    def along_queries(q, key, v, bias):
        t = bias.topk(3, dim=-2).values.amax(-1, keepdim=True)
        return torch.softmax(_scores(q, key) + t[..., :1, :] * bias, -1) @ v

    def along_keys(q, key, v, bias):
        t = bias.sort(-1).values.amax(-1, keepdim=True) + \
            bias[..., :8].sort(-1, descending=True).values.amin(-1, keepdim=True)
        return torch.softmax(_scores(q, key) + t, -1) @ v
    q, k, v, bias = torch.randn(1, 2, 37, 16), torch.randn(1, 2, 45, 16), torch.randn(1, 2, 45, 16), \
        torch.randn(1, 2, 37, 45)
    check_fused(along_queries, q, k, v, bias)
    check_fused(along_keys, q, k, v, bias)


def test_sorted_values_read_whole_are_loaded():
    """A bias sorted along the keys and added whole: the sorted values are computed outside the
    region and loaded (only entries read at a constant position are order statistics)."""
    def sorted_bias(q, key, v, b):
        return torch.softmax(_scores(q, key) + b.sort(-1).values, -1) @ v
    check_fused(sorted_bias, torch.randn(1, 2, 6, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16),
                torch.randn(6, 40))


def test_a_rank_far_from_both_ends_falls_back_with_a_reason():
    def median(q, key, v):
        s = _scores(q, key)
        return torch.softmax(s.masked_fill(s < s.median(-1, keepdim=True).values, float("-inf")), -1) @ v

    def sorted_median(q, key, v):
        s = _scores(q, key)
        t = s.sort(-1).values[..., 150:151]
        return torch.softmax(s.masked_fill(s < t, float("-inf")), -1) @ v
    q, k, v = torch.randn(1, 1, 5, 16), torch.randn(1, 1, 300, 16), torch.randn(1, 1, 300, 16)
    report = flashlight.explain(sorted_median, q, k, v)
    assert not report.regions and "the 150-th largest of 300" in str(report), str(report)
    assert not flashlight.explain(median, q, k, v).regions


def test_ties_at_the_threshold_are_kept():
    """Scores with many equal values (integer-valued q and k): every key equal to the k-th
    largest stays, as eager's ``s < kth`` keeps it (duplicates count toward k)."""
    fn = top_k(4)
    q, k, v = torch.randint(-1, 2, (1, 2, 21, 16)).float(), torch.randint(-1, 2, (1, 2, 33, 16)).float(), \
        torch.randn(1, 2, 33, 16)
    check_fused(fn, q, k, v)


def test_a_threshold_read_arithmetically_keeps_the_reference_backward():
    """s - kth would take a gradient at the k-th key, which the generated backward does not
    give: the forward fuses, the backward is the reference VJP (and right)."""
    def attention(q, key, v):
        s = _scores(q, key)
        return torch.softmax(s - s.topk(3, dim=-1).values[..., -1:], -1) @ v
    q, k, v = (torch.randn(1, 2, 19, 16) for _ in range(3))
    _, report = check_fused(attention, q, k, v)
    assert "top-k value" in report.regions[0].backward, report.regions[0].backward
    check_grads(attention, [x.clone().requires_grad_() for x in (q, k, v)], generated=False)


def test_more_than_the_kernel_keeps_falls_back_with_a_reason():
    """The 200th largest of 1000 keys is past KTH_MAX from both ends; of 300 keys it is the
    101st smallest (``rules._ranked``), which fuses."""
    fn = top_k(200)
    q, k, v = torch.randn(1, 1, 5, 16), torch.randn(1, 1, 1000, 16), torch.randn(1, 1, 1000, 16)
    report = flashlight.explain(fn, q, k, v)
    assert not report.regions and "at most 128" in str(report), str(report)
    assert flashlight.explain(fn, q, k[:, :, :300], v[:, :, :300]).regions


@pytest.mark.parametrize("rank", [16])
def test_split_kv_decoding_merges_the_splits_candidates(monkeypatch, rank):
    """Split-KV decoding: each split keeps its own candidates, the combine merges them by
    ``tl.topk`` (``codegen.split``); then the softmax's pass splits too. GQA heads packed, a
    sequence whose keys are fewer than the rank (every key kept) and one without keys."""
    monkeypatch.setattr(decode, "FORCE_SPLITS", 3)

    def attention(q, key, v, lens):
        key, v = key.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        s = _scores(q, key).masked_fill(torch.arange(key.shape[2]) >= lens[:, None, None, None], float("-inf"))
        kth = s.topk(rank, dim=-1).values[..., -1:]
        return torch.softmax(s.masked_fill(s < kth, float("-inf")), -1).nan_to_num(0.0) @ v
    q, k, v = torch.randn(3, 4, 1, 16), torch.randn(3, 2, 120, 16), torch.randn(3, 2, 120, 16)
    lens = torch.tensor([120, rank - 2, 0])
    report = flashlight.explain(attention, q, k, v, lens)
    c = REGISTRY[report.regions[0].key]
    before = c.split.launches if c.split else 0
    out = torch.compile(attention, backend="flashlight")(q, k, v, lens)
    assert c.split and c.split.launches > before and c.split.group == 2
    assert torch.all(out[2] == 0)
    assert rel_error(out, reference(attention, q, k, v, lens)) < 1e-4
