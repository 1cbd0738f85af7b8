"""Codegen: generated kernels run (Triton interpreter) and match the reference evaluator;
a snapshot makes any change in the generated source visible in review."""
import os
from pathlib import Path

import pytest
import torch

from flashlight.codegen import generate, generate_backward
from flashlight.ir import Reduction, call, const, dot, red, var
from flashlight.ir.evaluate import evaluate
from flashlight.rewrite import rewrite
from flashlight.runtime.op import compile_region
from flashlight.testing import rel_error
from test_ir import softmax_region

SNAPSHOT = Path(__file__).parent / "snapshots" / "softmax_region.py"
BACKWARD_SNAPSHOT = Path(__file__).parent / "snapshots" / "softmax_region_backward.py"
m, n = var("m"), var("n")


def run_both(region, *inputs):
    c = compile_region(rewrite(region))
    return c.forward(list(inputs)), evaluate(c.region, list(inputs))


@pytest.mark.parametrize("gen, path, name", [(generate, SNAPSHOT, "fl_fwd_snapshot"),
                                             (generate_backward, BACKWARD_SNAPSHOT, "fl_bwd_snapshot")],
                         ids=["forward", "backward"])
def test_snapshot_of_softmax_kernels(gen, path, name):
    src = gen(rewrite(softmax_region()), name)[0]
    if os.environ.get("UPDATE_SNAPSHOTS") == "1" or not path.exists():
        path.write_text(src)
    assert src == path.read_text(), "generated source changed: review, then UPDATE_SNAPSHOTS=1"


def test_multi_pass_kernel_matches_evaluator():
    """sum_n (s - max)^2 cannot be rescaled online: the kernel makes a second pass over N."""
    r = softmax_region(B=2, M=19, N=41, D=16)
    s = call("mul", dot(0), const(0.5))
    d = call("sub", s, red(0))
    r.reductions[1] = Reduction("sum", call("add", call("mul", d, d), const(1.0)))
    r.out = call("div", red(2), red(1))
    q, k, v = torch.randn(2, 19, 16), torch.randn(2, 41, 16), torch.randn(2, 41, 16)
    got, ref = run_both(r, q, k, v)
    assert rel_error(got, ref) < 1e-5
    assert "# pass 1" in compile_region(rewrite(r)).source


def test_python_floor_semantics_for_negative_index_arithmetic():
    r = softmax_region(B=1, M=17, N=23, D=16)
    s = call("add", call("mul", dot(0), const(0.5)),
             call("mul", call("to_f", call("floordiv", call("sub", n, m), const(3))), const(0.1)))
    s = call("add", s, call("mul", call("to_f", call("mod", call("sub", n, m), const(4))), const(0.2)))
    r.reductions = [Reduction("max", s), Reduction("sum", call("exp", call("sub", s, red(0)))),
                    Reduction("dot", call("exp", call("sub", s, red(0))), r.reductions[2].v)]
    q, k, v = torch.randn(1, 17, 16), torch.randn(1, 23, 16), torch.randn(1, 23, 16)
    got, ref = run_both(r, q, k, v)
    assert rel_error(got, ref) < 1e-5


def test_extra_element_seeds_a_later_pass():
    """A sum with a sink element that cannot run online (its max has none) is seeded at the start
    of its own pass, from the final max."""
    from flashlight.ir import Input, load
    r = softmax_region(B=2, M=19, N=41, D=16)
    r.inputs.append(Input("sink", (2,), torch.float32))
    s = call("mul", dot(0), const(0.5))
    sink = load(3, (var("b0"),), "f")
    r.reductions[1] = Reduction("sum", call("exp", call("sub", s, red(0))),
                                extra=call("exp", call("sub", sink, red(0))))
    q, k, v, e = torch.randn(2, 19, 16), torch.randn(2, 41, 16), torch.randn(2, 41, 16), torch.randn(2)
    got, ref = run_both(r, q, k, v, e)
    assert rel_error(got, ref) < 1e-5
    assert "# pass 1" in compile_region(rewrite(r)).source


def test_positive_scale_is_factored_out_of_a_max_only_when_exact():
    """max(x * c) == max(x) * c for a constant c > 0 (rounding is monotone), through -inf fills;
    a negative or zero scale, one that is not a normal fp32 number (it would round to 0 or inf
    in the kernel and turn a -inf max into NaN), a finite fill or a product of two tensors stays
    as is."""
    from flashlight.codegen.kernel import positive_scale
    x, keep = dot(0), call("le", var("n"), var("m"))
    assert positive_scale(x * 0.5) == (x, 0.5)
    assert positive_scale(call("mul", const(0.5), x)) == (x, 0.5)
    masked = call("where", keep, x * 0.5, const(float("-inf")))
    assert positive_scale(masked) == (call("where", keep, x, const(float("-inf"))), 0.5)
    flipped = call("where", keep, const(float("-inf")), x * 0.5)
    assert positive_scale(flipped) == (call("where", keep, const(float("-inf")), x), 0.5)
    for e in (x * -0.5, x * 0.0, x * float("inf"), x * 1e-45, x * 1e39,
              call("where", keep, x * 0.5, const(-1e9)), x * dot(1)):
        assert positive_scale(e) == (e, 1.0)


def test_masked_head_and_tail_share_one_loop():
    """A masked kernel compiles its masked body once (head and tail blocks in one loop): two key
    loops in the forward, two query loops in the dK/dV kernel, two key loops in dQ."""
    import flashlight
    from flashlight.examples import sliding_window
    rep = flashlight.explain(sliding_window.attention, *sliding_window.make_inputs(B=1, H=1, M=70, D=16))
    src = rep.regions[0].kernel_source
    assert src.count("\n    for start_n in range(") == 1 and src.count("\n    for i") == 1
    bwd = rep.regions[0].backward_source
    assert bwd.count("for start_m in range(") == 1 and bwd.count("for start_n in range(") == 1


def test_only_operands_that_can_blow_up_at_zero_are_masked():
    """A tl.dot operand computed in the kernel is zeroed past its tile's bounds only where a
    zero load can make it non-finite (``kernel.finite_at_zero``): q / q.norm() is, q * 0.125
    (SDPA's scaling split onto q and k) and a bare load are not, and keep their one multiply."""
    from flashlight.codegen.kernel import finite_at_zero
    from flashlight.ir import load
    q = load(0, (var("b0"), var("m"), var("dk")), "f")
    norm = load(1, (var("b0"), var("m")), "f")
    assert finite_at_zero(q) and finite_at_zero(call("mul", q, const(0.125)))
    assert finite_at_zero(call("div", q, const(8.0)))
    assert not finite_at_zero(call("div", q, norm)) and not finite_at_zero(call("mul", q, call("rsqrt", norm)))
    from flashlight.ir.region import Dot, Input

    def score_line(scale_q):
        r = softmax_region()
        r.inputs.append(Input("norm", (2, 5), torch.float32))
        r.dots[0] = Dot(scale_q(r.dots[0].q), r.dots[0].k)
        source, *_ = generate(rewrite(r), "fl_test", interpret=True)
        return next(line for line in source.splitlines() if "qk0 = tl.dot(" in line)
    assert "tl.where(mask_m" not in score_line(lambda x: call("mul", x, const(0.125)))
    assert "tl.where(mask_m" in score_line(lambda x: call("div", x, load(3, (var("b0"), var("m")), "f")))


@pytest.mark.parametrize("slope", [0.7, 2.0 ** -13])
def test_relative_position_terms_split_per_axis(slope):
    """ALiBi's ``slope * (n - m)``, queries at the end of the keys (``m + N - M``), is emitted as
    ``(n - n0) * slope`` along the keys minus ``(m + N - M - n0) * slope`` along the queries, n0
    the key block's first index (``emit.relative_positions``), and the per-row term joins the
    row max after the reduction and the softmax shift before the subtraction (``emit.score_terms``):
    a score pays a multiply-add and the shift's subtraction, as causal's does. Each term is
    rounded at the size of its distance to n0, so over 3000 keys, at a steep inexact (0.7) and
    a nearly flat slope, the output and the gradients stay as close to float64 as eager's fp32
    (measured: 1.4-3.8e-7 against eager's 0.9-3.8e-7)."""
    import re
    from flashlight.runtime.op import REGISTRY
    from helpers import check_fused, check_grads

    def alibi(q, k, v):
        M, N = q.shape[-2], k.shape[-2]
        dist = torch.arange(N)[None, :] - (torch.arange(M) + N - M)[:, None]
        s = q @ k.mT * 0.25 + slope * dist
        return torch.softmax(s.masked_fill(dist > 0, float("-inf")), -1) @ v

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 24, 16), torch.randn(1, 2, 3000, 16), torch.randn(1, 2, 3000, 16)
    REGISTRY.clear()
    check_fused(alibi, q, k, v, tol=1e-6)
    (c,) = REGISTRY.values()
    assert "(offs_n[None, :] - start_n)" in c.source
    assert re.search(r"tl\.max\(t\d+, 1, keep_dims=True\) \+ t\d+\)", c.source)     # max(t) + the row's term
    REGISTRY.clear()        # the gradients over 600 keys, which the interpreter runs quickly
    check_grads(alibi, [x[:, :, -600:].contiguous() if x is not q else x for x in (q, k, v)], tol=1e-5)
    (c,) = REGISTRY.values()
    dkdv, dq = c.bwd_source.split("_dq(")[0], c.bwd_source.split("_dq(")[1].split("_rows(")[0]
    assert "(offs_n[:, None] - start_n)" in dkdv and "(offs_n[None, :] - start_n)" in dq    # dK/dV: S^T
    assert re.search(r"\(r0_s \+ t\d+\)", dkdv) and re.search(r"\(r0_s \+ t\d+\)", dq)      # the shifts


def test_relative_positions_stay_as_written_below_jumps():
    """The split of ``(n - m) * c`` rounds differently from eager's product, so where the value
    meets an op that jumps (a floor bucketing the distance, a comparison masking by it) the
    expression stays as written: with c = 0.1 the split flips ``floor`` in about 1 % of the
    pairs (relative error 7e-3, and 3e-2 for the comparison, before ``emit._smooth``)."""
    from helpers import check_fused

    def bucketed(q, k, v):
        dist = (torch.arange(k.shape[-2])[None, :] - torch.arange(q.shape[-2])[:, None]).float()
        return torch.softmax(q @ k.mT * 0.25 + torch.floor(dist * 0.1), -1) @ v

    def compared(q, k, v):
        dist = (torch.arange(k.shape[-2])[None, :] - torch.arange(q.shape[-2])[:, None]).float()
        s = (q @ k.mT * 0.25).masked_fill(dist * 0.1 < -2.0, float("-inf"))
        return torch.softmax(s, -1) @ v

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 64, 16), torch.randn(1, 1, 64, 16), torch.randn(1, 1, 64, 16)
    for fn in (bucketed, compared):
        check_fused(fn, q, k, v, tol=1e-6)


def test_score_terms_keep_what_eager_computes():
    """Found by a review of ``emit.score_terms``, each wrong with its first version:
    - hard attention ``s >= s.amax(-1)`` with ALiBi: the max, taken over the split terms,
      rounded apart from the compared scores, and rows matched no key (NaN);
    - absolute positions ``n + P``, ``m + P``: each term was rounded at the size of P (relative
      error 5e-4 at P = 1e5); the reference position now takes the key's constant, and P
      cancels in integers;
    - a per-row bias of -1e30 on some rows: moved out of the scores it no longer absorbed them,
      and the rows were softmax(s) where eager's (and float64's) are uniform (error 0.62)."""
    from helpers import check_fused, check_grads

    def slopes(H):
        return 2.0 ** (-8.0 * torch.arange(1, H + 1) / H)

    def hard(q, k, v):
        dist = torch.arange(k.shape[-2])[None, :] - torch.arange(q.shape[-2])[:, None]
        s = q @ k.mT * 0.25 + slopes(q.shape[1])[:, None, None] * dist
        w = (s >= s.amax(-1, keepdim=True)).to(q.dtype)
        return (w @ v) / w.sum(-1, keepdim=True)

    def absolute(q, k, v):
        P = 100_000
        dist = torch.arange(P, P + k.shape[-2])[None, :] - torch.arange(P, P + q.shape[-2])[:, None]
        s = q @ k.mT * 0.25 + slopes(q.shape[1])[:, None, None] * dist.float()
        return torch.softmax(s.masked_fill(dist > 0, float("-inf")), -1) @ v

    def padded_rows(q, k, v, qb):
        return torch.softmax(q @ k.mT * 0.25 + qb, -1) @ v

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 12, 64, 16), torch.randn(1, 12, 64, 16), torch.randn(1, 12, 64, 16)
    check_fused(hard, q, k, v, tol=1e-6)
    check_fused(absolute, q, k, v, tol=1e-6)
    qb = torch.randn(1, 12, 64, 1)
    qb[:, :, 32:] = -1e30
    check_fused(padded_rows, q, k, v, qb, tol=1e-6)
    qb2 = qb[:, :2].contiguous()      # its own gradient is 0 analytically (a per-row bias under softmax)
    check_grads(lambda q, k, v: padded_rows(q, k, v, qb2), (q[:, :2], k[:, :2], v[:, :2]))
