"""``torch.autocast`` around or inside a compiled program: the fused region computes what eager
computes under autocast (``capture.autocast``), with eager's output dtype.

Before, the region was built from the ops as written and ignored autocast: under a bfloat16
autocast its output was float32 where eager's is bfloat16 (and its products ran on float32
operands)."""
import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

import flashlight
from flashlight.testing import rel_error


def attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v


def attention_inside(q, k, v):
    with torch.autocast("cpu", torch.bfloat16):
        return attention(q, k, v)


def attention_disabled_inside(q, k, v):
    with torch.autocast("cpu", torch.bfloat16):
        s = q @ k.transpose(-1, -2) * 0.25          # bfloat16 scores
        with torch.autocast("cpu", enabled=False):
            return torch.softmax(s.float(), -1) @ v  # float32 product: autocast off


def _close_to_eager(fn, args, outside):
    """Compiled and eager under the same autocast: same output dtype, and an error against
    float64 no larger than twice eager's own (bfloat16 rounding; the kernel keeps the scores in
    float32), gradients likewise."""
    leaves = [x.detach().double().requires_grad_() for x in args]
    ref = attention(*leaves)
    ctx = torch.autocast("cpu", torch.bfloat16) if outside else contextlib.nullcontext()
    torch.compiler.reset()
    with ctx:
        report = flashlight.explain(fn, *args)
        assert len(report.regions) == 1 and not report.fallbacks, report
        torch.compiler.reset()
        out = torch.compile(fn, backend="flashlight")(*args)
        want = fn(*args)
    assert out.dtype == want.dtype
    bound = max(2 * rel_error(want.double(), ref), 1e-5)
    assert rel_error(out.double(), ref) <= bound
    got = torch.autograd.grad(out.float().sum(), args)
    eager = torch.autograd.grad(want.float().sum(), args)
    for g, e, r in zip(got, eager, torch.autograd.grad(ref.sum(), leaves)):
        assert g.dtype == e.dtype
        assert rel_error(g.double(), r) <= max(2 * rel_error(e.double(), r), 1e-5)
    return out


@pytest.mark.parametrize("fn, outside, dtype", [
    (attention, True, torch.bfloat16),
    (attention_inside, False, torch.bfloat16),
    (attention_disabled_inside, False, torch.float32),
], ids=["outside", "inside", "disabled-inside"])
def test_a_region_under_autocast_computes_what_eager_does(fn, outside, dtype):
    torch.manual_seed(0)
    args = [torch.randn(2, 2, 37, 16, requires_grad=True) for _ in range(3)]
    assert _close_to_eager(fn, args, outside).dtype == dtype


class _Block(torch.nn.Module):
    """Projections (bfloat16 under autocast), a padding mask built in the program, SDPA."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

    def forward(self, x, lengths):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 16)).permute(2, 0, 3, 1, 4).unbind(0)
        keep = torch.arange(x.shape[1])[None, None, None, :] < lengths[:, None, None, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.out(o.transpose(1, 2).flatten(-2))


def test_a_model_trains_under_autocast_with_its_attention_fused():
    """A block with Linear projections under a bfloat16 autocast, SDPA with a padding mask:
    the attention fuses, the output and every parameter's gradient are as close to float64 as
    eager's under the same autocast."""
    torch.manual_seed(0)
    model, x, lengths = _Block(), torch.randn(2, 29, 32), torch.tensor([29, 17])
    model64 = copy.deepcopy(model).double()
    ref = model64(x.double(), lengths)
    ref.sum().backward()
    with torch.autocast("cpu", torch.bfloat16):
        report = flashlight.explain(model, x, lengths)
        assert len(report.regions) == 1 and not report.fallbacks, report
        torch.compiler.reset()
        out = torch.compile(model, backend="flashlight")(x, lengths)
        eager_model = copy.deepcopy(model)
        want = eager_model(x, lengths)
    assert out.dtype == want.dtype == torch.bfloat16
    assert rel_error(out.double(), ref) <= max(2 * rel_error(want.double(), ref), 1e-5)
    out.float().sum().backward()
    want.float().sum().backward()
    for (name, p), e, r in zip(model.named_parameters(), eager_model.parameters(), model64.parameters()):
        assert rel_error(p.grad.double(), r.grad) <= max(2 * rel_error(e.grad.double(), r.grad), 1e-5), name


def test_a_graph_without_autocast_is_left_as_it_is():
    """Autocast for another device type does not apply to these tensors, and a graph without
    autocast gets no casts (the rewrite is off)."""
    from flashlight.capture import autocast
    from flashlight.backend import trace

    def fn(q, k, v):
        return attention(q, k, v)
    gm = torch.fx.symbolic_trace(fn)
    args = [torch.randn(1, 2, 20, 16) for _ in range(3)]
    aten_gm, _ = trace(gm, args)
    assert not any(n.target == torch.ops.aten._to_copy.default for n in aten_gm.graph.nodes)
    assert not autocast.make_explicit(aten_gm.graph, {"cuda": torch.float16})
    assert not autocast.make_explicit(aten_gm.graph, {})
