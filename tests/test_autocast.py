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


def test_operands_of_mixed_dtypes_under_autocast():
    """A bfloat16 q times float32 k and v is well-typed only under autocast, which casts the
    products' operands: the trace pins autocast's dtypes first (``backend.autocast_dtypes_pinned``;
    before, the trace failed and the program ran unfused)."""
    torch.manual_seed(0)
    args = [torch.randn(2, 2, 37, 16, dtype=dtype).requires_grad_()
            for dtype in (torch.bfloat16, torch.float32, torch.float32)]
    assert _close_to_eager(attention_inside, args, outside=False).dtype == torch.bfloat16


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


class _HFBlock(torch.nn.Module):
    """HF's eager attention (Llama, Qwen): projections, an additive causal mask of the dtype's
    minimum, a float32 softmax cast back to q's dtype, under an autocast its forward enters. Its
    P @ V multiplies that bfloat16 cast by a projection autocast narrows, which the trace records
    as float32: well-typed only under autocast (``backend.autocast_dtypes_pinned``)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(32, 32, bias=False) for _ in range(4))

    @torch.autocast("cpu", torch.bfloat16)      # as accelerate wraps a model's forward
    def forward(self, x):
        q, k, v = (p(x).unflatten(-1, (2, 16)).transpose(1, 2) for p in (self.q, self.k, self.v))
        mask = torch.full((x.shape[1], x.shape[1]), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)
        w = torch.matmul(q, k.transpose(2, 3)) * 16 ** -0.5 + mask
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o(torch.matmul(w, v).transpose(1, 2).flatten(-2))


@pytest.mark.parametrize("block", [_Block, _HFBlock])
def test_a_model_trains_under_autocast_with_its_attention_fused(block):
    """A block with Linear projections under a bfloat16 autocast, SDPA with a padding mask
    (autocast entered around the compiled model) or HF's eager spelling (entered inside its
    forward): the attention fuses, the output and every parameter's gradient are as
    close to float64 as eager's under the same autocast."""
    torch.manual_seed(0)
    model = block()
    args = (torch.randn(2, 29, 32), torch.tensor([29, 17]))[:2 if block is _Block else 1]
    model64 = copy.deepcopy(model).double()
    ref = model64(args[0].double(), *args[1:])
    ref.sum().backward()
    with torch.autocast("cpu", torch.bfloat16) if block is _Block else contextlib.nullcontext():
        report = flashlight.explain(model, *args)
        assert len(report.regions) == 1 and not report.fallbacks, report
        torch.compiler.reset()
        out = torch.compile(model, backend="flashlight")(*args)
        eager_model = copy.deepcopy(model)
        want = eager_model(*args)
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


def _gqa_inside(q, k, v):
    with torch.autocast("cpu", torch.bfloat16):
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v


def _sdpa_inside(q, k, v):
    with torch.autocast("cpu", torch.bfloat16):
        i = torch.arange(q.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=i[:, None] >= i[None, :])


def _narrowed_alibi(q, k, v):
    """Casts written out (no autocast), the ALiBi bias built in the program and cast too."""
    low = torch.bfloat16 if q.dtype == torch.float32 else q.dtype
    i = torch.arange(q.shape[-2])
    slopes = torch.exp2(-torch.arange(1, q.shape[1] + 1, dtype=q.dtype))
    bias = (slopes[:, None, None] * (i[None, None, :] - i[None, :, None])).to(low)
    s = q.to(low) @ k.to(low).transpose(-1, -2) * 0.25 + bias
    return torch.softmax(s.float(), -1).to(low) @ v.to(low)


@pytest.mark.parametrize("fn, kv_heads", [
    (attention_inside, 4), (_gqa_inside, 2), (_sdpa_inside, 4), (_narrowed_alibi, 4),
], ids=["inside", "gqa-inside", "sdpa-inside", "explicit-casts"])
def test_products_read_the_narrow_operands_the_program_casts_to(fn, kv_heads):
    """float32 q, k, v narrowed to bfloat16 before their products (by autocast, or written
    out): the region loads the narrowed q, k and v, so its products run on bfloat16 as eager's
    do. Before, it loaded the float32 tensors and multiplied in float32 (an fp32 product path on
    a GPU). The casts go to k and v themselves, not to GQA's expanded copies or k's transpose,
    and a bias built in the program is not materialised. Output and gradients stay within twice
    eager's error against float64 (bf16-exact inputs: the written-out casts round nothing)."""
    torch.manual_seed(0)
    shapes = [(2, 4, 37, 16), (2, kv_heads, 37, 16), (2, kv_heads, 37, 16)]
    args = [torch.randn(s).bfloat16().float().requires_grad_() for s in shapes]
    report = flashlight.explain(fn, *args)
    assert len(report.regions) == 1 and not report.fallbacks, report
    ir = report.regions[0].ir
    loads = [line for line in ir.splitlines() if line.strip().startswith("in")]
    assert len(loads) == 3 and all("torch.bfloat16" in line for line in loads), ir
    assert [line.split("(")[1].split(")")[0] for line in loads] == \
        [", ".join(map(str, s)) for s in shapes], ir       # k's own layout and heads
    leaves = [x.detach().double().requires_grad_() for x in args]
    ref = fn(*leaves)
    torch.compiler.reset()
    out = torch.compile(fn, backend="flashlight")(*args)
    want = fn(*args)
    assert out.dtype == want.dtype == torch.bfloat16
    assert rel_error(out.double(), ref) <= max(2 * rel_error(want.double(), ref), 1e-5)
    got = torch.autograd.grad(out.float().sum(), args)
    eager = torch.autograd.grad(want.float().sum(), args)
    for g, e, r in zip(got, eager, torch.autograd.grad(ref.sum(), leaves)):
        assert g.dtype == e.dtype == torch.float32
        assert rel_error(g.double(), r) <= max(2 * rel_error(e.double(), r), 1e-5)


def _clone_written_after(q, k, v):
    kk = k * 1
    kc = kk.clone()
    kk.mul_(2.0)                    # kc keeps the values before
    with torch.autocast("cpu", torch.bfloat16):
        return torch.softmax(q @ kc.transpose(-1, -2) * 0.25, -1) @ v


def _frozen_transpose(q, k, v):
    with torch.no_grad():
        kt = k.transpose(-1, -2)    # no gradient reaches k through it
    with torch.autocast("cpu", torch.bfloat16):
        return torch.softmax(q @ kt * 0.25, -1) @ v


def _top8_from_a_second_product(q, k, v):
    with torch.autocast("cpu", torch.bfloat16):
        s = q @ k.transpose(-1, -2) * 0.25
        s = s.masked_fill(s < (q @ k.transpose(-1, -2) * 0.25).topk(8, dim=-1).values[..., -1:], float("-inf"))
        return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("fn", [_clone_written_after, _frozen_transpose, _top8_from_a_second_product],
                         ids=["clone-then-in-place", "no-grad-transpose", "top8-second-product"])
def test_autocast_casts_keep_what_the_program_reads(fn):
    """Found by a review of the narrowing above (each was wrong with it, right before it):
    autocast's cast moved up to k read k after an in-place write the program's clone predates
    (relative error 1.0), and replayed a transpose made under no_grad under grad mode (k got a
    gradient eager does not give); the narrowed operands, leaves of their own, hid that a top-k
    threshold came from a second product of the same q and k (refused: the kernel's recomputed
    scores are not bitwise eager's, error 0.15 against eager's 0.03). Now a graph that writes in
    place or switches grad mode keeps each cast where autocast makes it, and the check follows a
    leaf through casts and moves to the tensor it reads. (Since session 32 the top-k is the
    kernel's own ``kth`` reduction of its scores, which the second product is: it fuses.)"""
    torch.manual_seed(0)
    shape = (1, 2, 21, 16) if fn is _top8_from_a_second_product else (2, 4, 37, 16)   # (the interpreter's top-k is slow)
    args = [torch.randn(*shape, requires_grad=True) for _ in range(3)]
    torch.compiler.reset()
    report = flashlight.explain(fn, *args)
    torch.compiler.reset()
    out = torch.compile(fn, backend="flashlight")(*args)
    want = fn(*args)
    assert len(report.regions) == 1, report
    leaves = [x.detach().double().requires_grad_() for x in args]
    ref = fn(*leaves)
    assert rel_error(out.double(), ref) <= max(2 * rel_error(want.double(), ref), 1e-5)
    dout = torch.randn(out.shape)
    got = torch.autograd.grad((out.float() * dout).sum(), args, allow_unused=True)
    eager = torch.autograd.grad((want.float() * dout).sum(), args, allow_unused=True)
    for g, e, r in zip(got, eager, torch.autograd.grad((ref * dout).sum(), leaves, allow_unused=True)):
        assert (g is None) == (e is None) == (r is None)
        if g is not None:
            assert rel_error(g.double(), r) <= max(2 * rel_error(e.double(), r), 1e-5)


def test_a_threshold_from_q_alone_of_a_packed_qkv_still_fuses():
    """q and k sliced from one packed tensor, the scores masked by a threshold from a product
    of q alone: that product does not copy the scores, so the region fuses under autocast.
    The check follows a narrowed operand to the tensor it reads through casts and element
    moves, but not through slices (``symbolic.moved(narrowing=False)``): through them q and k
    both led to the packed tensor, and any product of q then counted as the scores'."""
    def packed(x, v, w):
        with torch.autocast("cpu", torch.bfloat16):
            q, k = x[..., :16], x[..., 16:]
            s = q @ k.mT * 0.25
            return torch.softmax(s.masked_fill(s < q @ w, float("-inf")), -1) @ v

    torch.manual_seed(0)
    x, v, w = torch.randn(1, 2, 32, 32), torch.randn(1, 2, 32, 16), torch.randn(16, 1) * 0.1
    torch.compiler.reset()
    report = flashlight.explain(packed, x, v, w)
    assert len(report.regions) == 1, report
    torch.compiler.reset()
    out, want = torch.compile(packed, backend="flashlight")(x, v, w), packed(x, v, w)
    ref = packed(*(t.double() for t in (x, v, w)))
    assert rel_error(out.double(), ref) <= max(2 * rel_error(want.double(), ref), 1e-5)
