"""Rewrite rules on the IR: each rule fires where its algebra holds, and declines elsewhere."""
import pytest
import torch

from flashlight.ir import Reduction, call, const, dot, red, var, walk
from flashlight.ir.evaluate import evaluate
from flashlight.ir.expr import load
from flashlight.ir.region import Dot, Input
from flashlight.ir.scaling import Shift
from flashlight.rewrite import base2, factor_rows, make_online, rewrite, scales, split_offsets, split_sums
from test_ir import softmax_region

n = var("n")


def test_online_rule_fires_for_softmax():
    r = rewrite(softmax_region())
    assert [x.online for x in r.reductions] == [None, 0, 0]
    assert r.passes() == [[0, 1, 2]]


def test_factor_rule_moves_normaliser_to_output():
    r = softmax_region()
    s = call("mul", dot(0), const(0.5))
    p = call("div_safe", call("exp", call("sub", s, red(0))), red(1))
    r.reductions[2] = Reduction("dot", p, r.reductions[2].v)
    r.out = red(2)
    q, k, v = torch.randn(2, 5, 4), torch.randn(2, 7, 4), torch.randn(2, 7, 4)
    before = evaluate(r, [q, k, v])
    r2 = factor_rows(r)
    assert r2 is not None and r2.out == call("div_safe", red(2), red(1))
    assert torch.allclose(evaluate(r2, [q, k, v]), before, atol=1e-6)
    assert make_online(r2) is not None


def test_scales_declines_when_not_homogeneous():
    s, m = dot(0), Shift(0)
    assert scales(call("exp", call("sub", s, red(0))), m)
    assert scales(call("mul", call("exp", call("sub", s, red(0))), n), m)
    assert scales(call("where", call("lt", n, const(3)), call("exp", call("sub", s, red(0))), const(0.0)), m)
    assert not scales(call("exp", call("sub", s, call("mul", red(0), const(2.0)))), m)   # exp(x - 2m)
    assert not scales(call("add", call("exp", call("sub", s, red(0))), const(1.0)), m)    # + 1
    assert not scales(call("sub", s, red(0)), m)


def test_a_row_term_scales_online_only_under_a_max_that_bounds_it():
    """exp(-m) scales with m, but in m's pass only where the max starts at or above 0 (softmax_1's
    clamp): under a running max that starts at -inf, exp(-m_running) is unbounded."""
    e = call("exp", call("neg", red(0)))
    assert scales(e, Shift(0, online=False)) and not scales(e, Shift(0))
    assert scales(e, Shift(0, extra=const(0.0))) and scales(e, Shift(0, extra=const(1.0)))
    assert not scales(e, Shift(0, extra=const(-100.0)))
    sink = load(1, (var("b0"),), "f")
    assert scales(call("exp", call("sub", sink, red(0))), Shift(0, extra=call("maximum", sink, const(0.0))))


def test_non_online_reduction_gets_second_pass():
    """sum_n (s - m)^2 does not rescale: it must wait for the max, in a second pass."""
    r = softmax_region()
    s = call("mul", dot(0), const(0.5))
    d = call("sub", s, red(0))
    r.reductions[1] = Reduction("sum", call("mul", d, d))
    r = rewrite(r)
    assert r.reductions[1].online is None
    assert r.passes() == [[0, 2], [1]]


def test_split_concat_turns_the_appended_column_into_an_extra_element():
    """softmax(cat([s, e], -1))[..., :N] @ v: the max and the sum span N + 1 positions."""
    from flashlight.ir import Input, load
    from flashlight.rewrite import split_concat
    r = softmax_region()
    r.inputs.append(Input("sink", (2,), torch.float32))
    s = call("mul", dot(0), const(0.5))
    col = call("cat_n", s, load(3, (var("b0"),), "f"))
    e = call("exp", call("sub", col, red(0)))
    r.reductions = [Reduction("max", col), Reduction("sum", e),
                    Reduction("dot", call("exp", call("sub", s, red(0))), r.reductions[2].v)]
    r2 = split_concat(r)
    assert [x.extra for x in r2.reductions] == [load(3, (var("b0"),), "f"),
                                                call("exp", call("sub", load(3, (var("b0"),), "f"), red(0))), None]
    assert "cat_n" not in str(r2) and split_concat(r2) is None
    q, k, v, sink = torch.randn(2, 5, 4), torch.randn(2, 7, 4), torch.randn(2, 7, 4), torch.randn(2)
    scores = torch.cat([q @ k.mT * 0.5, sink[:, None, None].expand(2, 5, 1)], -1)
    ref = torch.softmax(scores, -1)[..., :-1] @ v
    assert torch.allclose(evaluate(rewrite(r), [q, k, v, sink]), ref, atol=1e-6)
    assert rewrite(r).passes() == [[0, 1, 2]]      # the sink seeds the state: still one pass


def test_online_declines_an_extra_whose_max_is_not_seeded():
    """sum(exp(cat(s, e) - max_keys(s))): the max has no extra, so the seeded sum would be lost
    by the first rescale; the sum waits for a second pass instead."""
    from flashlight.ir import Input, load
    r = softmax_region()
    r.inputs.append(Input("sink", (2,), torch.float32))
    s = call("mul", dot(0), const(0.5))
    sink = load(3, (var("b0"),), "f")
    r.reductions[1] = Reduction("sum", call("exp", call("sub", s, red(0))),
                                extra=call("exp", call("sub", sink, red(0))))
    r = rewrite(r)
    assert r.reductions[1].online is None and r.passes() == [[0, 2], [1]]


def _softmax_parts():
    s = call("mul", dot(0), const(0.5))
    return s, call("exp", call("sub", s, red(0)))


def test_gate_and_second_mask_after_softmax_stay_one_pass():
    """where(c, softmax * g, 0) @ v: the normaliser leaves the sum, the gate and mask stay."""
    r = softmax_region()
    _, e = _softmax_parts()
    g = call("to_f", n)
    p = call("where", call("lt", n, const(3)), const(0.0), call("mul", call("div_safe", e, red(1)), g))
    r.reductions[2] = Reduction("dot", p, r.reductions[2].v)
    r.out = red(2)
    q, k, v = torch.randn(2, 5, 4), torch.randn(2, 7, 4), torch.randn(2, 7, 4)
    before = evaluate(r, [q, k, v])
    r2 = rewrite(r)
    assert r2.passes() == [[0, 1, 2]] and r2.out == call("div_safe", red(2), red(1))
    assert torch.allclose(evaluate(r2, [q, k, v]), before, atol=1e-6)


def test_renormalisation_becomes_an_online_sum():
    """p = softmax * g; p / p.sum(): the second normaliser is sum(e * g) / l, online too."""
    r = softmax_region()
    _, e = _softmax_parts()
    pg = call("mul", call("div_safe", e, red(1)), call("to_f", n))
    r.reductions.insert(2, Reduction("sum", pg))
    r.reductions[3] = Reduction("dot", call("div", pg, red(2)), r.reductions[3].v)
    r.out = red(3)
    q, k, v = torch.randn(2, 5, 4), torch.randn(2, 7, 4), torch.randn(2, 7, 4)
    before = evaluate(r, [q, k, v])
    r2 = rewrite(r)
    assert r2.passes() == [[0, 1, 2, 3]]
    assert torch.allclose(evaluate(r2, [q, k, v]), before, atol=1e-5)


def test_entropy_offset_is_split_against_the_normaliser():
    """sum(e * (s - c)) = sum(e * s) - c * sum(e) when sum(e) is a reduction already."""
    r = softmax_region()
    s, e = _softmax_parts()
    c = call("add", call("log", red(1)), red(0))
    r.reductions.append(Reduction("sum", call("mul", e, call("sub", s, c))))
    r.out = call("add", red(2), red(3))
    r2 = split_offsets(r)
    assert r2 is not None and r2.reductions[3].body == call("mul", e, s)
    q, k, v = torch.randn(2, 5, 4), torch.randn(2, 7, 4), torch.randn(2, 7, 4)
    assert torch.allclose(evaluate(r2, [q, k, v]), evaluate(r, [q, k, v]), atol=1e-5)
    assert rewrite(r).passes() == [[0, 1, 2, 3]]
    r.reductions[3] = Reduction("sum", call("mul", call("exp", s), call("sub", s, c)))
    assert split_offsets(r) is None          # sum(exp(s)) is not a reduction of the region


def _masked_softmax(fill, bias=None, keep="le"):
    """softmax(where(n <= m, 0.5 s (+ bias), fill)) @ v, as capture builds it (``keep="lt"``:
    row 0 sees no key)."""
    r = softmax_region()
    s = call("mul", dot(0), const(0.5))
    if bias is not None:
        s = call("add", s, bias)
    s = call("where", call(keep, n, var("m")), s, const(fill))
    r.reductions[0] = Reduction("max", s)
    r.reductions[1] = Reduction("sum", call("exp", call("sub", s, red(0))))
    r.reductions[2] = Reduction("dot", call("exp", call("sub", s, red(0))), r.reductions[2].v)
    return r


def test_base2_folds_log2e_into_the_scale_and_the_fill():
    """max(0.5 s) in log2 units is max(0.5 log2(e) s): one multiply, as before the rule; the sums
    read exp2 of the same tile, the -inf fill stays -inf, and the values do not change."""
    from flashlight.rewrite import LOG2E
    r = rewrite(_masked_softmax(float("-inf")))
    mx = r.reductions[0]
    assert mx.base2 and mx.body == call("where", call("le", n, var("m")), call("mul", dot(0), const(0.5 * LOG2E)),
                                        const(float("-inf")))
    assert r.reductions[1].body == call("exp2", call("sub", mx.body, red(0)))
    assert [x.online for x in r.reductions] == [None, 0, 0] and r.passes() == [[0, 1, 2]]
    q, k, v = torch.randn(2, 5, 4), torch.randn(2, 7, 4), torch.randn(2, 7, 4)
    assert torch.allclose(evaluate(r, [q, k, v]), evaluate(_masked_softmax(float("-inf")), [q, k, v]), atol=1e-6)


def test_base2_folds_log2e_into_an_unscaled_product():
    """softmax(s) @ v with the scale already in Q (``q = q * scale``: timm's spelling) or none:
    the product takes log2(e) itself (the one multiply tl.exp had), so such programs run in base
    2 and get the Gluon forward too; same values."""
    from flashlight.rewrite import LOG2E
    plain = softmax_region()
    s = dot(0)
    plain.reductions = [Reduction("max", s), Reduction("sum", call("exp", call("sub", s, red(0)))),
                        Reduction("dot", call("exp", call("sub", s, red(0))), plain.reductions[2].v)]
    r = rewrite(plain)
    assert r.reductions[0].base2 and r.reductions[0].body == call("mul", dot(0), const(LOG2E))
    q, k, v = torch.randn(2, 5, 4), torch.randn(2, 7, 4), torch.randn(2, 7, 4)
    assert torch.allclose(evaluate(r, [q, k, v]), torch.softmax(q @ k.mT, -1) @ v, atol=1e-6)


def test_a_constant_factor_of_q_moves_onto_the_product():
    """softmax((0.5 q) k^T) @ v (the scale applied to Q first): the factor moves onto the scores,
    so Q is read as stored and the softmax folds log2(e) into 0.5, as for s * 0.5; same values.
    Division by a constant and a factor of K move too."""
    from flashlight.rewrite import LOG2E, factor_dot_scales
    scaled = softmax_region()
    s = dot(0)
    scaled.reductions = [Reduction("max", s), Reduction("sum", call("exp", call("sub", s, red(0)))),
                         Reduction("dot", call("exp", call("sub", s, red(0))), scaled.reductions[2].v)]
    q, k = scaled.dots[0].q, scaled.dots[0].k
    scaled.dots = [Dot(call("mul", q, const(0.5)), call("div", k, const(4.0)))]
    r = rewrite(scaled)
    assert r.dots[0] == Dot(q, k) and r.reductions[0].base2
    assert r.reductions[0].body == call("mul", dot(0), const(0.5 * 0.25 * LOG2E))
    assert factor_dot_scales(r) is None
    q_, k_, v_ = torch.randn(2, 5, 4), torch.randn(2, 7, 4), torch.randn(2, 7, 4)
    want = torch.softmax((0.5 * q_) @ (k_ / 4).mT, -1) @ v_
    assert torch.allclose(evaluate(r, [q_, k_, v_]), want, atol=1e-6)


@pytest.mark.parametrize("scores", ["times 8", "over 0.5", "times a learned scale"])
def test_base2_folds_log2e_into_a_large_scale_of_the_product(scores):
    """QK-norm's logit scale (8, or a learned per-head value) and a temperature below log2(e)
    (s / 0.5) scale the product by more than 1 / log2(e): folding log2(e) into them overflows
    only where eager's own score is within log2(e) of FLT_MAX, the ``dot`` row's argument. They
    went to base e before (exp, and no Gluon forward); same values."""
    r = softmax_region()
    if scores == "times a learned scale":
        r.inputs.append(Input("scale", (2,), torch.float32))
        s = call("mul", dot(0), load(3, (var("b0"),), "f"))
    else:
        s = call("mul", dot(0), const(8.0)) if scores == "times 8" else call("div", dot(0), const(0.5))
    r.reductions = [Reduction("max", s), Reduction("sum", call("exp", call("sub", s, red(0)))),
                    Reduction("dot", call("exp", call("sub", s, red(0))), r.reductions[2].v)]
    got = rewrite(r)
    assert got.reductions[0].base2
    q, k, v, c = torch.randn(2, 5, 4), torch.randn(2, 7, 4), torch.randn(2, 7, 4), 4 + torch.rand(2)
    args = [q, k, v, c] if scores == "times a learned scale" else [q, k, v]
    assert torch.allclose(evaluate(got, args), evaluate(r, args), atol=1e-6)


def test_base2_keeps_a_finite_fill_finite_and_rows_it_fills_uniform():
    """finfo.min * log2(e) overflows float32: the folded fill clamps to -finfo.max, so a row
    whose every key is filled still averages V (eager's result for a finite fill)."""
    fill = torch.finfo(torch.float32).min
    r = rewrite(_masked_softmax(fill, keep="lt"))
    assert r.reductions[0].base2
    assert const(-3.4028234663852886e38) in list(walk(r.reductions[0].body))
    q, k, v = torch.randn(2, 5, 4), torch.randn(2, 7, 4), torch.randn(2, 7, 4)
    got = evaluate(r, [q, k, v])
    assert torch.allclose(got[:, 0], v.mean(1), atol=1e-6)          # row 0: every key filled
    assert torch.allclose(got, evaluate(_masked_softmax(fill, keep="lt"), [q, k, v]), atol=1e-6)


def test_base2_declines_where_folding_would_add_a_multiply():
    """An additive bias tensor (e.g. an HF-style finfo.min padding mask) has no constant factor
    to fold into: scaling it would add a multiply per score and could overflow it to -inf."""
    bias = load(3, (var("b0"), n), "f")
    r = _masked_softmax(float("-inf"), bias=bias)
    r.inputs.append(Input("bias", (2, 7), torch.float32))
    assert base2(rewrite_online_only(r)) is None


def rewrite_online_only(r):
    while (nxt := make_online(r)) is not None:
        r = nxt
    return r


def test_base2_declines_when_the_output_reads_an_unfoldable_shift():
    """exp(t - m) in the output with a loaded t: the rule must decline, not build a broken IR."""
    r = softmax_region()
    r.inputs.append(Input("t", (2, 5), torch.float32))
    t = load(3, (var("b0"), var("m")), "f")
    r.out = call("mul", call("div_safe", red(2), red(1)), call("exp", call("sub", t, red(0))))
    r = rewrite(r)
    assert not r.reductions[0].base2
    q, k, v, tt = torch.randn(2, 5, 4), torch.randn(2, 7, 4), torch.randn(2, 7, 4), torch.randn(2, 5)
    s = q @ k.mT * 0.5
    ref = (torch.softmax(s, -1) @ v) * torch.exp(tt - s.amax(-1))[..., None]
    assert torch.allclose(evaluate(r, [q, k, v, tt]), ref, atol=1e-5)


def _alibi(slope_shape=(2,)):
    """softmax(where(n <= m, 0.5 s + slope[b0] * (n - m), -inf)) @ v with a loaded per-batch
    slope, as capture builds ALiBi (distance in integers, promoted by the multiply)."""
    slope = load(3, (var("b0"),), "f")
    r = _masked_softmax(float("-inf"), bias=call("mul", slope, call("sub", n, var("m"))))
    r.inputs.append(Input("slope", slope_shape, torch.float32))
    return r


def test_base2_folds_log2e_into_a_per_program_factor():
    """ALiBi's slope is one value per program (batch indices only): log2(e) goes into it, once
    per program, and the softmax runs in base 2 like the unbiased one — same values."""
    from flashlight.rewrite import LOG2E
    r = rewrite(_alibi())
    assert r.reductions[0].base2
    slope = load(3, (var("b0"),), "f")
    assert call("mul", slope, const(LOG2E)) in list(walk(r.reductions[0].body))
    q, k, v, s = torch.randn(2, 5, 4), torch.randn(2, 7, 4), torch.randn(2, 7, 4), torch.rand(2)
    assert torch.allclose(evaluate(r, [q, k, v, s]), evaluate(_alibi(), [q, k, v, s]), atol=1e-6)


def test_float_positions_turn_a_distance_in_float_arithmetic_into_a_float_difference():
    """slope * (n - m) computes (n - m) as float(n) - float(m): per score one float subtract
    instead of an integer subtract and a conversion. The mask's integer compare keeps n <= m,
    and an integer distance that indexes a table is left alone."""
    from flashlight.rewrite import float_positions
    r = rewrite(_alibi())
    body = list(walk(r.reductions[0].body))
    fdist = call("sub", call("to_f", n), call("to_f", var("m")))
    assert fdist in body and call("sub", n, var("m")) not in body and call("le", n, var("m")) in body
    assert float_positions(r) is None                              # a fixed point
    table = load(3, (call("add", call("sub", n, var("m")), const(6)),), "f")     # a relative-position table
    t = _masked_softmax(float("-inf"), bias=table)
    t.inputs.append(Input("table", (13,), torch.float32))
    assert float_positions(t) is None
    shifted = _masked_softmax(float("-inf"), bias=call("mul", const(0.1), call("sub", call("add", n, const(3)), var("m"))))
    assert call("to_f", call("add", n, const(3))) in list(walk(float_positions(shifted).reductions[0].body))


def test_base2_does_not_fold_into_a_per_program_factor_of_a_float_value():
    """A per-head value times a float score term (a huge finite per-head fill, say) is not
    scaled by log2(e): only products with a position difference are, which cannot overflow."""
    big = call("mul", load(3, (var("b0"),), "f"), const(-3e38))
    r = _masked_softmax(float("-inf"), bias=big)
    r.inputs.append(Input("flag", (2,), torch.float32))
    assert base2(rewrite_online_only(r)) is None


def test_a_product_of_two_softmaxes_is_split_into_one_pass():
    """(p1 - p2 / 2) @ v with p1, p2 softmaxes of two temperatures (two maxes): split into one
    product per map, each online in the first pass; the same values. A product that one max
    rescales already (e1 + e1 * n, e1 = exp(s - m)) is left alone, and so is one whose part needs a second pass."""
    r = softmax_region()
    s2 = call("mul", dot(0), const(0.25))
    r.reductions += [Reduction("max", s2), Reduction("sum", call("exp", call("sub", s2, red(3))))]
    p1 = call("div_safe", call("exp", call("sub", call("mul", dot(0), const(0.5)), red(0))), red(1))
    p2 = call("div_safe", call("exp", call("sub", s2, red(3))), red(4))
    v = r.reductions[2].v
    r.reductions.append(Reduction("dot", call("sub", p1, call("mul", p2, const(0.5))), v))
    r.out = red(5)
    q, k, vv = torch.randn(2, 5, 4), torch.randn(2, 7, 4), torch.randn(2, 7, 4)
    before = evaluate(r, [q, k, vv])
    r2 = split_sums(r)
    assert r2 is not None and len(r2.reductions) == 7 and r2.out == call("sub", red(5), red(6))
    assert torch.allclose(evaluate(r2, [q, k, vv]), before, atol=1e-6)
    assert rewrite(r).passes() == [list(range(7))]
    e1 = call("exp", call("sub", call("mul", dot(0), const(0.5)), red(0)))
    r.reductions[5] = Reduction("dot", call("add", e1, call("mul", e1, call("to_f", n))), v)
    assert split_sums(r) is None                                        # one max rescales it already
    d = call("sub", call("mul", dot(0), const(0.5)), red(0))
    r.reductions[5] = Reduction("dot", call("sub", p2, call("mul", d, d)), v)
    assert split_sums(r) is None                                        # (s - m)^2 waits for m anyway
