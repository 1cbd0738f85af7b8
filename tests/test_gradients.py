"""The gradient plan (codegen/gradients.py): where the backward kernels write each gradient. Here
the dK/dV kernel's group loop (``gradients.Group``): a program visits the query heads that share
its K and V rows (GQA, MQA) and stores their summed dK and dV, where it is correct; gradients
match float64 with it, with part of a group per program (atomics), and without it."""
import pytest
import torch

import flashlight
from flashlight.codegen import gradients
from flashlight.codegen.gradients import Group
from flashlight.runtime.op import REGISTRY
from helpers import check_grads

B, H, M, N, D = 2, 8, 37, 45, 16        # 16 batch indices, one key block of 128: 16 dK/dV programs


def _keep(m, n):
    qi, ki = torch.arange(m)[:, None], torch.arange(n)[None, :]
    return (ki <= qi + n - m) & (qi % 7 != 3)        # causal, bottom-right; rows 3, 10, 17... see no key


def _grouped(q, k, v, slopes):
    """GQA by ``repeat_interleave`` (K/V head h // G), a learned ALiBi slope per query head, a
    causal mask with fully masked rows."""
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    dist = (torch.arange(k.shape[2])[None, :] - torch.arange(q.shape[2])[:, None]).to(q.dtype)
    s = q @ k.mT * D ** -0.5 + slopes[:, None, None] * dist
    return torch.softmax(s.masked_fill(~_keep(q.shape[2], k.shape[2]), float("-inf")), -1) @ v


def _grouped_oracle(q, k, v, slopes):
    """``_grouped`` where a row with no key outputs 0 and passes no gradient (eager: NaN)."""
    live = _keep(q.shape[2], k.shape[2]).any(-1, keepdim=True)
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    dist = (torch.arange(k.shape[2])[None, :] - torch.arange(q.shape[2])[:, None]).to(q.dtype)
    s = (q @ k.mT * D ** -0.5 + slopes[:, None, None] * dist).masked_fill(~_keep(q.shape[2], k.shape[2]), float("-inf"))
    return (torch.softmax(s.masked_fill(~live, 0.0), -1) * live) @ v


def _mqa(q, k, v):
    """One K/V head for all query heads (``expand``: the head var is not read)."""
    k, v = (x.expand(-1, q.shape[1], -1, -1) for x in (k, v))
    return torch.softmax(q @ k.mT * D ** -0.5, -1) @ v


def _per_head_window(q, k, v, window):
    """GQA with a window per query head: the live query blocks differ within a group."""
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    dist = torch.arange(q.shape[2])[:, None] - torch.arange(k.shape[2])[None, :]
    keep = (dist >= 0) & (dist < window[:, None, None])
    return torch.softmax((q @ k.mT * D ** -0.5).masked_fill(~keep, float("-inf")), -1) @ v


def _per_head_key_scale(q, k, v, scale):
    """GQA whose K operand is scaled per query head: the heads' K operands differ."""
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    return torch.softmax(q @ (k * scale[:, None, None]).mT * D ** -0.5, -1) @ v


@pytest.fixture
def fresh(monkeypatch):
    """A registry of this test's regions alone (the loop's mode is part of the key); 16
    programs per key block suffice for "auto" (``MIN_PROGRAMS``) with half a group of 4."""
    monkeypatch.setattr(gradients, "MIN_PROGRAMS", 8)
    REGISTRY.clear()
    torch.compiler.reset()
    yield monkeypatch
    REGISTRY.clear()
    torch.compiler.reset()


def plan_and_source():
    (c,) = [c for c in REGISTRY.values() if c.bwd_kernel is not None]
    return c.bwd_kernel.plan, c.bwd_source.split("_dq(")[0]      # the dK/dV kernel's source


@pytest.mark.parametrize("mode, size", [("1", 4), ("auto", 2), ("0", None)])
def test_the_dkdv_kernel_visits_the_query_heads_sharing_its_keys(fresh, mode, size):
    """GQA with a per-query-head ALiBi slope and fully masked rows, lengths that are not whole
    blocks: the whole group per program stores dK and dV (no atomics, no zero fill); half a
    group adds them with atomics; no loop adds every head's. The slopes' gradients (one per
    query head) are per-tile atomics inside the loop. All match float64."""
    fresh.setenv("FLASHLIGHT_GROUP_LOOP", mode)
    torch.manual_seed(0)
    inputs = (torch.randn(B, H, M, D), torch.randn(B, 2, N, D), torch.randn(B, 2, N, D), torch.rand(H) * 0.3)
    check_grads(_grouped, inputs, ref_fn=_grouped_oracle)
    plan, src = plan_and_source()
    assert plan.group == (Group(1, size) if size else None)
    kv = {s.input for s in plan.sites if s.ctx in ("k", "v")}
    assert kv <= plan.stored if size == 4 else not kv & plan.stored
    assert (f"in range(0, {size} * " in src) == (size is not None)     # each block loop visits the heads
    assert plan.programs((B, H)) == B * H // (size or 1)


def test_one_key_head_for_all_query_heads_is_one_group(fresh):
    """MQA (K and V expanded, the head var unread): the group is every head; explain() says so."""
    fresh.setenv("FLASHLIGHT_GROUP_LOOP", "1")
    inputs = (torch.randn(B, H, M, D), torch.randn(B, 1, N, D), torch.randn(B, 1, N, D))
    check_grads(_mqa, inputs)
    plan, src = plan_and_source()
    assert plan.group == Group(1, H) and {1, 2} <= plan.stored and "atomic_add" not in src
    (report,) = flashlight.explain(_mqa, *(x.requires_grad_() for x in inputs)).regions
    assert f"visits {H} query heads sharing its K/V rows, dK/dV stored once" in report.backward


@pytest.mark.parametrize("fn, extra", [(_per_head_window, torch.tensor([5, 9, 40, 3, 17, 8, 45, 2])),
                                       (_per_head_key_scale, torch.rand(H) + 0.5)])
def test_no_group_loop_where_the_heads_of_a_group_differ(fresh, fn, extra):
    """A window per query head (each head's live query blocks differ) or a K operand scaled per
    query head (the heads' K operands differ): no loop, atomics, still float64's gradients."""
    fresh.setenv("FLASHLIGHT_GROUP_LOOP", "1")
    torch.manual_seed(1)
    check_grads(fn, (torch.randn(B, H, M, D), torch.randn(B, 2, N, D), torch.randn(B, 2, N, D), extra))
    plan, src = plan_and_source()
    assert plan.group is None and "# the query head" not in src


def gqa_region(batch: tuple[int, int], n: int, group: int = 4, d: int = 64, dtype=torch.float32):
    """softmax(q k^T / 2) v with K/V head b1 // group, built directly (no kernel runs)."""
    from flashlight.ir import Dot, Input, Reduction, Region, call, const, dot, load, red, var
    (b0, b1), m, nv, dk, dv = (var(x) for x in ("b0", "b1")), var("m"), var("n"), var("dk"), var("dv")
    ins = [Input("q", (*batch, n, d), dtype), *(Input(x, (batch[0], batch[1] // group, n, d), dtype) for x in "kv")]
    s = call("mul", dot(0), const(0.5))
    reds = [Reduction("max", s), Reduction("sum", call("exp", call("sub", s, red(0)))),
            Reduction("dot", call("exp", call("sub", s, red(0))), load(2, (b0, b1 // group, nv, dv), "f"))]
    return Region(batch, n, n, d, d, ins, [Dot(load(0, (b0, b1, m, dk), "f"), load(1, (b0, b1 // group, nv, dk), "f"))],
                  reds, call("div_safe", red(2), red(1)), dtype)


def test_auto_keeps_enough_programs():
    """"auto" visits the largest part of the group that leaves ``MIN_PROGRAMS`` (256) dK/dV
    programs: the whole group of 4 at B=4, H=16, N=4096 (512 programs); half of it at N=1024
    (8 key blocks x 32); none at B=1, H=16, N=1024 (128 programs with no loop)."""
    def loop(batch, n, mode="auto"):
        r = gqa_region(batch, n)
        return gradients.grad_plan(r, group=mode).group
    assert loop((4, 16), 4096) == Group(1, 4)
    assert loop((4, 16), 1024) == Group(1, 2)
    assert loop((1, 16), 1024) is None
    assert loop((1, 16), 1024, "1") == Group(1, 4)
    assert loop((4, 16), 4096, "0") is None
    assert {1, 2} <= gradients.grad_plan(gqa_region((4, 16), 4096)).stored
    assert not {1, 2} & gradients.grad_plan(gqa_region((4, 16), 1024)).stored



def _points(q, k, v, bias, a, b, temp, oracle=False):
    """A full [B, H, M, N] bias, squared distances between a query's and a key's 3-D points
    (far from the origin: coordinates ~30, differences ~1) times a per-head temperature, a
    causal mask with fully masked rows (``oracle``: they output 0, as flashlight's do)."""
    d2 = ((a[:, :, :, None] - b[:, :, None]) ** 2).sum(-1)
    s = q @ k.mT * D ** -0.5 + bias - temp[:, None, None] * d2
    s = s.masked_fill(~_keep(q.shape[2], k.shape[2]), float("-inf"))
    if not oracle:
        return torch.softmax(s, -1) @ v
    live = _keep(q.shape[2], k.shape[2]).any(-1, keepdim=True)
    return (torch.softmax(s.masked_fill(~live, 0.0), -1) * live) @ v


def test_body_gradients_are_summed_across_the_loop_and_stored(fresh):
    """Where a body load's index misses a tile axis its gradient is summed in registers across
    the loop and written once (``GradPlan.carried``): the key points by the dK/dV kernel
    (stored), the query points by the dQ kernel (stored), the temperature per head (one add per
    dK/dV program). The full-rank bias is stored per tile into zeros (the causal mask skips
    tiles). The points' sums are factored (``factored_sum``): a_m sum_n G - sum_n G b_n, with
    coordinates 30 times their differences. All match float64."""
    torch.manual_seed(0)
    a = 30 + torch.randn(B, H, M, 3)
    inputs = (torch.randn(B, H, M, D), torch.randn(B, H, N, D), torch.randn(B, H, N, D), torch.randn(B, H, M, N),
              a, a[:, :, torch.arange(N) % M] + torch.randn(B, H, N, 3), torch.rand(H) * 0.1)
    check_grads(_points, inputs, ref_fn=lambda *x: _points(*x, oracle=True))
    (c,) = [c for c in REGISTRY.values() if c.bwd_kernel is not None]
    plan, r = c.bwd_kernel.plan, c.region
    carried = {x.args[0]: where for x, where in plan.carried.items()}
    by_shape = {tuple(x.shape): i for i, x in enumerate(r.inputs)}       # the four shapes differ
    bias, qpts, kpts, temp = (by_shape[tuple(x.shape)] for x in inputs[3:])
    assert carried == {qpts: "dq", kpts: "dkdv", temp: "dkdv"}
    assert {bias, qpts, kpts} <= plan.stored and plan.zeroed == {bias}
    dkdv, dq = c.bwd_source.split("_dq(")[0], c.bwd_source.split("_dq(")[1].split("_rows(")[0]
    assert dkdv.count("atomic_add") == 1 and "atomic_add" not in dq      # the temperature's, after the loop
    assert "fs" in dkdv and "fs" in dq


def test_terms_take_out_what_a_sum_does_not_vary_along():
    """``terms``: G (a_m - b_n) + G (a_m - b_n) over n is 2 G a_m - 2 G b_n; a sum whose parts
    both vary along n (G + G') stays one factor."""
    from flashlight.ir import call, load, var
    from flashlight.ir.derivative import tile
    g, g2 = tile("db1"), tile("db2")
    a, b = load(0, (var("b0"), var("m")), "f"), load(1, (var("b0"), var("n")), "f")
    t = call("sub", a, b)
    got = {(c, frozenset(fs)) for c, fs in gradients.terms(g * t + g * t, {"n"})}
    assert got == {(2.0, frozenset({g, a})), (-2.0, frozenset({g, b}))}
    assert gradients.terms((g + g2) * a, {"n"}) == [(1.0, (g + g2, a))]


def _head_and_key_terms(q, k, v, kb, kb2, w, c):
    """Per-head and per-key loads in one score: w_h (kb_n + c_h) + c_h kb2_n. Their factored
    sums include sum_{m,n} G (for w and c) and sum_m G (for kb): one summand, two reductions."""
    s = q @ k.mT * D ** -0.5 + w[:, None, None] * (kb[:, None, None, :] + c[:, None, None]) + c[:, None, None] * kb2[:, None, None]
    return torch.softmax(s, -1) @ v


def test_factored_sums_over_different_axes_are_kept_apart(fresh):
    """A tile's reductions are shared by (axes, summand), not by summand alone: the first form
    gave kb the sum over both axes (one constant for every key; session 26's review)."""
    torch.manual_seed(0)
    check_grads(_head_and_key_terms, (torch.randn(B, H, M, D), torch.randn(B, H, N, D), torch.randn(B, H, N, D),
                                      torch.randn(B, N), torch.randn(B, 1, N), torch.rand(H) + 0.5, torch.randn(H)))


def _bucket_over_norm(q, k, v, table, qn):
    """A gathered table (query buckets of 8, clipped) times rsqrt of a per-query norm: the
    factor taken out of the sum is inf at padded rows, where the norm loads as 0."""
    idx = (torch.arange(q.shape[2]) // 8).clamp(max=3)
    bias = table[:, idx][None, :, :, None] * torch.rsqrt(qn)[..., None]
    return torch.softmax(q @ k.mT * D ** -0.5 + bias * k[..., 0][:, :, None, :], -1) @ v


def test_a_factored_gathered_gradient_masks_padded_rows(fresh):
    """With the fused dQ the per-query table gradient is added per tile (``uniform_add``): the
    factored sum is inf * 0 at padded rows, so the write is masked, not the summand alone (a
    NaN reached the clipped bucket before; session 26's review)."""
    fresh.setenv("FLASHLIGHT_ATOMIC_DQ", "1")
    torch.manual_seed(0)
    check_grads(_bucket_over_norm, (torch.randn(B, H, M, D), torch.randn(B, H, N, D), torch.randn(B, H, N, D),
                                    torch.randn(H, 4), torch.rand(B, H, M) + 0.5))


def _weighted_distance(q, k, v, a, b, w):
    d2 = ((a[:, :, :, None] - b[:, :, None]) ** 2).sum(-1)
    return torch.softmax(q @ k.mT * D ** -0.5 - w[:, :, None, :] * d2, -1) @ v


def test_factoring_stays_linear_in_the_points(fresh):
    """A per-key weight on the squared distance: its gradient sums G (a - b)^2 over m, which
    must not expand to a^2 - 2ab + b^2 (relative error 3e-3 with coordinates 300 times their
    spread before; 2e-7 now). The points' sums are factored linearly (errors ~ offset x 6e-8)."""
    torch.manual_seed(0)
    a = 300 + torch.randn(B, H, M, 3)
    check_grads(_weighted_distance, (torch.randn(B, H, M, D), torch.randn(B, H, N, D), torch.randn(B, H, N, D),
                                     a, a[:, :, torch.arange(N) % M] + torch.randn(B, H, N, 3), 0.1 * torch.rand(B, H, N)),
                tol=1e-4)
