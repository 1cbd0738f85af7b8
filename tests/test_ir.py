"""Region IR: expression simplification, verifier, reference evaluator."""
import pytest
import torch

from flashlight.ir import Dot, Input, Reduction, Region, VerifyError, call, const, dot, load, red, var, verify
from flashlight.ir.evaluate import evaluate
from flashlight.ir.expr import free_vars, substitute

m, n, dk, dv, b0 = var("m"), var("n"), var("dk"), var("dv"), var("b0")


def test_simplify_folds_index_arithmetic():
    assert (m * 1 + 0) // 1 == m
    assert call("add", const(2), const(3)) == const(5)
    assert call("where", call("le", n, m), const(True), const(False)) == call("le", n, m)
    assert call("not", call("not", call("lt", n, m))) == call("lt", n, m)
    assert (m % 1) == const(0)


def test_free_vars_and_substitute():
    e = call("add", m, call("mul", n, const(2)))
    assert free_vars(e) == {"m", "n"}
    assert substitute(e, lambda x: const(3) if x == n else None) == call("add", m, const(6))


def softmax_region(B=2, M=5, N=7, D=4):
    ins = [Input("q", (B, M, D), torch.float32), Input("k", (B, N, D), torch.float32),
           Input("v", (B, N, D), torch.float32)]
    s = call("mul", dot(0), const(0.5))
    reds = [Reduction("max", s), Reduction("sum", call("exp", call("sub", s, red(0)))),
            Reduction("dot", call("exp", call("sub", s, red(0))), load(2, (b0, n, dv), "f"))]
    return Region((B,), M, N, D, D, ins, [Dot(load(0, (b0, m, dk), "f"), load(1, (b0, n, dk), "f"))],
                  reds, call("div_safe", red(2), red(1)), torch.float32)


def test_evaluator_matches_torch_softmax():
    r = verify(softmax_region())
    q, k, v = torch.randn(2, 5, 4), torch.randn(2, 7, 4), torch.randn(2, 7, 4)
    ref = torch.softmax(q @ k.mT * 0.5, -1) @ v
    assert torch.allclose(evaluate(r, [q, k, v]), ref, atol=1e-6)


def test_verifier_rejects_bad_scoping():
    r = softmax_region()
    r.dots[0] = Dot(load(0, (b0, n, dk), "f"), r.dots[0].k)        # q must not depend on n
    with pytest.raises(VerifyError, match="dot0.q"):
        verify(r)
    r = softmax_region()
    r.reductions[0] = Reduction("max", red(1))                      # reads a later reduction
    with pytest.raises(VerifyError, match="before it is computed"):
        verify(r)


def test_passes_follow_dependencies():
    r = softmax_region()
    assert r.passes() == [[0], [1, 2]]          # not yet online: a second pass over N


def test_sum_dv_binds_dv_and_is_only_allowed_in_out():
    x = call("mul", load(2, (b0, m, dv), "f"), load(2, (b0, m, dv), "f"))
    assert free_vars(call("sum_dv", x)) == {"b0", "m"}
    r = softmax_region()
    r.reductions[1] = Reduction("sum", call("sum_dv", x))
    with pytest.raises(VerifyError, match="sums over dv"):
        verify(r)


def test_evaluator_norm_epilogue_and_permuted_store():
    """out = o * rsqrt(mean_dv(o^2)), stored transposed into a (M, B, DV) tensor."""
    r = softmax_region()
    o = r.out
    r.out = call("mul", o, call("rsqrt", call("mul", call("sum_dv", call("mul", o, o)), const(0.25))))
    r.out_shape, r.out_index = (5, 2, 4), (m, b0, dv)
    r = verify(r)
    q, k, v = torch.randn(2, 5, 4), torch.randn(2, 7, 4), torch.randn(2, 7, 4)
    att = torch.softmax(q @ k.mT * 0.5, -1) @ v
    ref = (att * torch.rsqrt(att.pow(2).mean(-1, keepdim=True))).transpose(0, 1)
    assert torch.allclose(evaluate(r, [q, k, v]), ref, atol=1e-5)
