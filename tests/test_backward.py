"""Generated backward kernels (codegen/backward.py): gradients of every floating input match
float64 eager, the generated kernel (not the reference VJP) ran, and what it does not support
falls back to the reference with a reason. The derivative table is checked op by op."""
import contextlib
import copy

import pytest
import torch

import flashlight
from flashlight.codegen.backward import backward_support
from flashlight.ir.scaling import degree, shift_gradients
from flashlight.examples import NAMES, VARIANTS
from flashlight.ir import Input, Reduction, Region, call, const, load, red, var
from flashlight.ir.derivative import DERIVATIVE, vjp
from flashlight.ir.evaluate import Evaluator
from flashlight.testing import rel_error
from helpers import check_grads


@pytest.mark.parametrize("name", NAMES)
def test_every_example_has_fp64_gradients_from_the_generated_kernel(name):
    mod = VARIANTS[name]
    check_grads(mod.attention, mod.make_inputs(B=1, H=2, M=21, D=16), generated=True)


def test_biases_of_every_broadcast_shape_and_a_score_scalar():
    """Gradients into body loads are atomic adds at the load's address, reduced over broadcast dims."""
    H, M, N, D = 2, 19, 23, 16
    q, k, v = torch.randn(1, H, M, D), torch.randn(1, H, N, D), torch.randn(1, H, N, D)
    col, head, row, temp = torch.randn(N), torch.randn(H, 1, 1), torch.randn(1, M, 1), torch.tensor(0.7)

    def attn(q, k, v, col, head, row, temp):
        s = ((q @ k.mT) * temp * head + col + col.sigmoid()) * row.sigmoid()   # col read twice
        return torch.softmax(s, -1) @ v     # (an additive per-row bias would have zero gradient)
    check_grads(attn, (q, k, v, col, head, row, temp))


def test_learned_alibi_slopes_get_their_gradient():
    """A learned per-head slope times the query-key distance: base 2 folds log2(e) into the
    slope (one value per program) and the distance becomes float(n) - float(m); the slope's
    gradient (a sum over every score of its head) and q/k/v's still match float64."""
    H, M, N, D = 3, 19, 23, 16
    q, k, v = torch.randn(1, H, M, D), torch.randn(1, H, N, D), torch.randn(1, H, N, D)
    slopes = torch.rand(H) * 0.5

    def attn(q, k, v, slopes):
        dist = torch.arange(N)[None, :] - torch.arange(M)[:, None]
        s = q @ k.mT * D ** -0.5 + slopes[:, None, None] * dist
        return torch.softmax(s.masked_fill(dist > 0, float("-inf")), -1) @ v
    check_grads(attn, (q, k, v, slopes))


def test_fully_masked_rows_get_zero_gradients():
    """A row whose every key is masked outputs 0 (FlexAttention's convention) and passes no
    gradient; the oracle spells that semantics out (eager softmax would give NaN)."""
    q, k, v = (torch.randn(1, 2, L, 16) for L in (20, 35, 35))

    def keep(q, k):
        qi, ki = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
        return (ki <= qi) & (qi % 7 != 3)            # rows 3, 10, 17 see no key

    def attn(q, k, v):
        s = (q @ k.mT * 0.25).masked_fill(~keep(q, k), float("-inf"))
        return torch.softmax(s, -1) @ v

    def oracle(q, k, v):
        mask = keep(q, k)
        live = mask.any(-1, keepdim=True)
        s = (q @ k.mT * 0.25).masked_fill(~mask, float("-inf")).masked_fill(~live, 0.0)
        return (torch.softmax(s, -1) * live) @ v
    check_grads(attn, (q, k, v), ref_fn=oracle)


def test_rows_masked_by_a_finite_fill_past_the_last_key():
    """A window mask filled with -1e9 leaves rows past N + window with every key at -1e9 (eager
    averages them). Out-of-range keys of the last block pass the window test, score 0 and
    exp(0 - (-1e9)) = inf there: the tile's dS must drop them (found by fuzz seed 21, #195)."""
    q, k, v = (torch.randn(1, 2, L, 16) for L in (31, 17, 17))

    def attn(q, k, v):
        qi, ki = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
        s = torch.where((ki <= qi) & (qi - ki < 6), q @ k.mT, -1e9)
        return torch.softmax(s, -1) @ v
    check_grads(attn, (q, k, v))


def test_half_precision_gradients():
    mod = VARIANTS["causal"]
    check_grads(mod.attention, mod.make_inputs(B=1, H=2, M=21, D=16, dtype=torch.float16), tol=2e-2)


def _kernels(source: str) -> dict[str, str]:
    """The generated backward's kernels by role: the dK/dV kernel, ``_dq`` and ``_rows``."""
    kernels = {}
    for chunk in source.split("@triton.jit")[1:]:
        name = chunk.split("(")[0].split()[-1]
        if name.startswith("fl_bwd"):
            kernels["dq" if name.endswith("_dq") else "rows" if name.endswith("_rows") else "dkdv"] = chunk
    return kernels


def _matches_float64(fn, q, k, v):
    """The compiled ``fn``'s output and the gradients of its sum match float64 eager."""
    torch.compiler.reset()
    out = torch.compile(fn, backend="flashlight")(q, k, v)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = fn(*leaves)
    assert rel_error(out, want) < 1e-5
    for a, b in zip(torch.autograd.grad(out.sum(), [q, k, v]), torch.autograd.grad(want.sum(), leaves)):
        assert rel_error(a, b) < 1e-4


def test_a_value_computed_and_never_used_is_no_row_output():
    """A row max the program computes and never uses (left over from an edit) was a row output
    of the region, whose backward then was the reference VJP (the scores materialised). Dead
    values are dropped before capture (mutations and random draws are impure: they stay)."""
    def leftover(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.25
        unused = torch.exp(s - s.amax(-1, keepdim=True))       # noqa: F841
        return torch.softmax(s, -1) @ v
    q, k, v = (torch.randn(1, 2, 40, 16, requires_grad=True) for _ in range(3))
    report = flashlight.explain(leftover, q, k, v)
    assert len(report.regions) == 1 and not any("row-outputs" in f for f in report.regions[0].features), report
    assert report.regions[0].backward.startswith("generated"), report.regions[0].backward
    _matches_float64(leftover, q, k, v)


@pytest.mark.filterwarnings("ignore:All-NaN slice")
def test_block_sparse_backward_never_reads_dead_tiles():
    """Causal, 4 x 4 blocks of 16 (the interpreter's): the last key block is live only for the
    last query block, the first query block only sees the first key block. NaN queries in the
    first three query blocks would reach the last key block's dK through dK += Q^T dS (NaN * 0)
    if the dK/dV kernel visited its dead tiles; NaN keys after the first block would reach the
    first query block's dQ through dQ += dS K if the dQ kernel visited its dead tiles."""
    mod = VARIANTS["causal"]
    q, k, v = (x.requires_grad_() for x in mod.make_inputs(B=1, H=1, M=64, D=16))
    report = flashlight.explain(mod.attention, q, k, v)
    assert report.regions[0].backward.startswith("generated")
    fast = torch.compile(mod.attention, backend="flashlight")
    with torch.no_grad():
        q[..., :48, :] = float("nan")
    dk, dv = torch.autograd.grad(fast(q, k, v).sum(), [k, v])
    assert dk[..., 48:, :].isfinite().all() and dv[..., 48:, :].isfinite().all()
    assert dk[..., :48, :].isnan().any()      # the NaNs do flow where the scores are live
    q, k, v = (x.detach().requires_grad_() for x in mod.make_inputs(B=1, H=1, M=64, D=16))
    with torch.no_grad():
        k[..., 16:, :] = float("nan")
    (dq,) = torch.autograd.grad(fast(q, k, v).sum(), [q])
    assert dq[..., :16, :].isfinite().all() and dq[..., 16:, :].isnan().any()


def test_two_kernel_backward_stores_what_one_program_owns():
    """dQ comes from its own kernel over query blocks, written once per program with a store (no
    atomics at all for plain causal attention: dK and dV are stored too); with GQA, the query
    heads sharing a K/V head meet in its gradient (atomic adds) while dQ is still stored."""
    causal = VARIANTS["causal"]
    src = flashlight.explain(causal.attention, *causal.make_inputs(B=1, H=2, M=20, D=16)).regions[0].backward_source
    kernels = _kernels(src)
    assert set(kernels) == {"dkdv", "dq", "rows"}
    assert "atomic_add" not in src and kernels["dq"].count("tl.store(") == 1
    torch.compiler.reset()
    gqa = VARIANTS["gqa"]
    inputs = gqa.make_inputs(B=1, H=4, M=21, D=16)
    kernels = _kernels(flashlight.explain(gqa.attention, *inputs).regions[0].backward_source)
    assert "atomic_add" not in kernels["dq"] and "tl.store(" in kernels["dq"]
    assert kernels["dkdv"].count("atomic_add") == 2
    assert kernels["dkdv"].count('sem="relaxed"') == 2      # the adds order nothing: no fences
    check_grads(gqa.attention, inputs)


def _causal_bucket_table(q, k, v, table):
    """Causal, a learned bias per head at the distance m - n clipped to [0, 19]: the tiles far
    below the diagonal read one bucket."""
    m = torch.arange(q.shape[-2])[:, None]
    n = torch.arange(k.shape[-2])[None, :]
    s = q @ k.mT * q.shape[-1] ** -0.5 + table[:, torch.clamp(m - n, 0, 19)]
    return torch.softmax(s.masked_fill(n > m, float("-inf")), -1) @ v


def _doc_table(q, k, v, table, doc):
    """A learned bias per (head, key document), read through loaded ids: not bounded per tile."""
    return torch.softmax(q @ k.mT * q.shape[-1] ** -0.5 + table[:, doc][:, None, :], -1) @ v


@pytest.mark.parametrize("case", ["relative_position", "causal_bucket", "doc_table"])
def test_gathered_table_adds_a_uniform_tile_once(case):
    """A table gathered at a computed index gets its gradient by atomic adds per score; where the
    index, bounded over the tile (``IntervalWriter``), is one bucket, the tile adds its sum once
    (``gradients.uniform_add``). T5's clipped relative positions and a clipped causal distance
    take that branch (M = 150: most tiles read one clipped bucket, the others several, the last
    block ragged); an index through loaded ids cannot be bounded and keeps the per-score adds.
    Gradients of every input against float64 either way."""
    torch.manual_seed(0)
    if case == "relative_position":
        fn, inputs = VARIANTS[case].attention, list(VARIANTS[case].make_inputs(B=1, H=2, M=150, D=16))
    else:
        q, k, v = (torch.randn(1, 2, 150, 16) for _ in range(3))
        fn, inputs = ((_causal_bucket_table, [q, k, v, torch.randn(2, 20)]) if case == "causal_bucket" else
                      (_doc_table, [q, k, v, torch.randn(2, 6), torch.randint(0, 6, (150,)).sort().values]))
    src = _kernels(flashlight.explain(fn, *inputs).regions[0].backward_source)["dkdv"]
    torch.compiler.reset()
    branches = src.count("if (")        # one per tile loop (the masked and the mask-free blocks)
    assert branches == (0 if case == "doc_table" else src.count("tm_lo = start_m"))
    assert case == "doc_table" or branches > 0
    assert "atomic_add" in src
    check_grads(fn, inputs)


PB, PN, PH, PD = 1, 21, 2, 16      # the packed projections' batch, length, heads, head dim


def _chunked(qkv):
    """A packed qkv projection's output, [PB, PN, 3·PH·PD], cut into q, k and v (timm's chunk)."""
    q, k, v = (t.view(PB, PN, PH, PD).transpose(1, 2) for t in qkv.chunk(3, -1))
    return torch.softmax(q @ k.mT * PD ** -0.5, -1) @ v


def _chunked_q_twice(qkv):
    """k's third is never read: its gradient is zero there."""
    q, _, v = (t.view(PB, PN, PH, PD).transpose(1, 2) for t in qkv.chunk(3, -1))
    return torch.softmax(q @ q.mT * PD ** -0.5, -1) @ v


def _chunked_gqa(qkv):
    """One K/V head in the packed tensor, shared by the PH query heads."""
    q = qkv[..., :PH * PD].view(PB, PN, PH, PD).transpose(1, 2)
    k, v = (qkv[..., c:c + PD].view(PB, PN, 1, PD).transpose(1, 2).expand(PB, PH, PN, PD)
            for c in (PH * PD, PH * PD + PD))
    return torch.softmax(q @ k.mT * PD ** -0.5, -1) @ v


@pytest.mark.parametrize("fn, width, stored", [(_chunked, 3 * PH * PD, True), (_chunked_q_twice, 3 * PH * PD, False),
                                                (_chunked_gqa, (PH + 2) * PD, False)])
def test_slices_that_tile_one_tensor_are_stored(fn, width, stored):
    """A packed qkv's q, k and v are slices of one tensor, written by two kernels: where the
    slices' writes tile the tensor, each is a store into one uninitialised (NaN-poisoned)
    buffer, no atomics, no zero fill. Where they do not (a third unread; a K/V head shared
    by the query heads), every write is an atomic add into zeros. Both match float64."""
    from flashlight.codegen.gradients import grad_plan
    from flashlight.runtime.op import REGISTRY
    inputs = (torch.randn(PB, PN, width),)
    region = flashlight.explain(fn, *inputs).regions[0]
    src = region.backward_source
    assert (grad_plan(REGISTRY[region.key].region).stored == {0}) == stored
    assert ("atomic_add" in src) != stored
    check_grads(fn, inputs)
    if stored:      # one kernel run alone (a config being tuned) leaves the other's slices at 0
        k = REGISTRY[region.key].backward_kernels()
        assert k.buffers(list(inputs))[0].isnan().all() and k.buffers(list(inputs), "dq")[0].eq(0).all()


@pytest.mark.parametrize("name", ["diff_attention", "diff_transformer"])
def test_diff_attention_half_heads_are_stored(name):
    """DiffAttn's q and k are each read as two half-width heads: both halves are stored. In the
    reference code's layout (``diff_transformer``) they are heads 2h and 2h + 1 of the projection,
    interleaved: indices 2h·d + dk and (2h + 1)·d + dk, not one stride's layout. The gradients'
    float64 check (NaN-poisoned buffers) is in test_beyond_flex."""
    diff = VARIANTS[name]
    src = flashlight.explain(diff.attention, *diff.make_inputs(B=1, H=2, M=20, D=16)).regions[0].backward_source
    kernels = _kernels(src)
    assert "atomic_add" not in kernels["dkdv"] and "atomic_add" not in kernels["dq"]
    assert kernels["dkdv"].count("tl.store(") == 3 and kernels["dq"].count("tl.store(") == 2


def test_index_sets_of_interleaved_heads():
    """``owned``'s per-dim sets: a dense layout is a range; interleaved heads are listed and tile
    the dim together; a coefficient inside the smaller terms' span (two values per index) or a
    set too large to list is refused."""
    from flashlight.codegen import gradients
    assert gradients._indices([(16, 2), (1, 8)], 8) == frozenset([*range(8, 16), *range(24, 32)])
    assert gradients._indices([(8, 4), (1, 8)], 0) == range(0, 32)
    assert gradients._indices([(2, 5)], 1) == range(1, 11, 2)
    assert gradients._indices([(4, 2), (1, 8)], 0) is None
    assert gradients.partition([(gradients._indices([(16, 2), (1, 8)], c), range(3)) for c in (0, 8)], (32, 3))
    assert not gradients.partition([(gradients._indices([(16, 2), (1, 8)], c), range(3)) for c in (0, 16)], (32, 3))
    assert gradients._indices([(1, 1024), (2048, 1024), (1 << 22, 2)], 0) is None     # 2^21 values


def test_product_row_gradients_are_stored_as_the_value_operand():
    """dL/d(P @ V) = dO / l is a tl.dot operand of both tile kernels: on the GPU it is written in
    V's bf16 (FA2 feeds dO as stored), one DV-wide column group per distinct row gradient in a
    tensor of its own (rows DV elements apart: 16-byte aligned for DV a multiple of 8), and loaded
    without a cast; fp32 under the interpreter (its bf16 dots run in fp32) and for fp32 inputs.
    DiffAttn's two products differ by a row factor, so they share one column group."""
    from flashlight.codegen.backward import dot_grads, generate_backward
    from flashlight.runtime.op import REGISTRY
    diff = VARIANTS["diff_attention"]
    for dtype, interpret, want in ((torch.bfloat16, False, torch.bfloat16), (torch.bfloat16, True, torch.float32),
                                   (torch.float32, False, torch.float32)):
        inputs = diff.make_inputs(B=1, H=2, M=20, D=16, dtype=dtype)
        r = REGISTRY[flashlight.explain(diff.attention, *inputs).regions[0].key].region
        dg = dot_grads(r, interpret)
        products = [j for j, rd in enumerate(r.reductions) if rd.kind == "dot"]
        assert len(products) == 2 and dg.dtype == want
        assert [dg.cols[j] for j in products] == [0, 0] and dg.width == r.DV
        src = generate_backward(r, "k", interpret=interpret)[0]
        assert "ddot_ptr.dtype.element_ty" in src and not any(f"dr{j}.to(" in src for j in products)


def _two_maps(combine, oracle=False):
    """Two softmax maps over half-width heads (DiffAttn's scores), combined by ``combine``; the
    second map's first row sees no key (``oracle``: its 0 spelled out, where eager gives NaN)."""
    def softmax(s, keep):
        if not oracle:
            return torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
        live = keep.any(-1, keepdim=True)
        return torch.softmax(s.masked_fill(~keep, float("-inf")).masked_fill(~live, 0.0), -1) * live

    def attn(q, k, v, lam, *v2):
        q1, q2 = q.chunk(2, -1)
        k1, k2 = k.chunk(2, -1)
        qi, ki = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
        a1 = softmax(q1 @ k1.mT * 0.3, ki <= qi)
        a2 = softmax(q2 @ k2.mT * 0.3, ki < qi)
        return combine(a1, a2, v, lam, *v2)
    return attn


TWO_MAPS = {    # name -> (combination, do the products share one row gradient?)
    "difference": (lambda a1, a2, v, lam: a1 @ v - lam * (a2 @ v), True),
    "gated sum": (lambda a1, a2, v, lam: (a1 @ v + (a2 @ v) * lam.sigmoid()) * 0.5, True),
    "two values": (lambda a1, a2, v, lam, v2: a1 @ v - lam * (a2 @ v2), False),
    "product": (lambda a1, a2, v, lam: (a1 @ v) * (a2 @ v) * lam, False),
}


@pytest.mark.parametrize("name", list(TWO_MAPS))
def test_products_whose_row_gradients_differ_by_a_row_factor_share_one_tile(name):
    """dL/d(P_j @ V) = c_j G for one V and one [M, DV] tile G (a difference or a gated sum of
    two maps): the row kernel writes G once and c_j as a row value, and each tile computes
    G V^T once and adds (c_1 P_1 + c_2 P_2)^T G to dV — one dot each instead of two. Products
    with different V operands, or gradients that are not row multiples of one tile (a
    product of the two maps), keep one tile each. Gradients match float64 either way."""
    from flashlight.codegen.backward import dot_grads, generate_backward
    from flashlight.runtime.op import REGISTRY
    combine, shared = TWO_MAPS[name]
    attn = _two_maps(combine)
    inputs = [torch.randn(1, 2, 21, 32), torch.randn(1, 2, 27, 32), torch.randn(1, 2, 27, 16), torch.tensor(0.6)]
    inputs += [torch.randn(1, 2, 27, 16)] * (name == "two values")
    r = REGISTRY[flashlight.explain(attn, *inputs).regions[0].key].region
    dg = dot_grads(r, interpret=True)
    products = [j for j, rd in enumerate(r.reductions) if rd.kind == "dot"]
    assert len(products) == 2 and (len(dg.shared) == 2) == shared
    assert dg.width == (1 if shared else 2) * r.DV
    src = generate_backward(r, "k", interpret=True)[0]
    assert (f"dp{products[1]} =" not in src) == shared   # the second product's own dR @ V^T (both kernels)
    check_grads(attn, inputs, ref_fn=_two_maps(combine, oracle=True))


def test_gradients_keep_their_input_dtype_and_layout():
    """Stored gradients go straight into empty_like(x) in x's dtype (here a BSHD-strided q and
    fp16), accumulated ones (a broadcast bias) through fp32; all keep the input's strides."""
    q, k, v = (torch.randn(1, 19, 2, 16).transpose(1, 2).half() for _ in range(3))
    bias = torch.randn(2, 1, 19).half()
    leaves = [x.requires_grad_() for x in (q, k, v, bias)]

    def attn(q, k, v, bias):
        return torch.softmax(q @ k.mT * 0.25 + bias, -1) @ v
    grads = torch.autograd.grad(torch.compile(attn, backend="flashlight")(*leaves).sum(), leaves)
    for g, x in zip(grads, leaves):
        assert g.dtype == x.dtype and g.stride() == x.stride()
    check_grads(attn, [x.detach() for x in leaves], tol=2e-2)


# -- IR level ---------------------------------------------------------------------------------
def _region(body, out=None) -> Region:
    x = [load(i, (var("b0"), var("m"), var("n")), "f") for i in range(3)]
    return Region((2,), 5, 7, 4, 4, [Input(f"x{i}", (2, 5, 7), torch.float64) for i in range(3)], [],
                  [Reduction("sum", body(*x))], out if out is not None else red(0), torch.float64)


UNARY_DOMAIN = {"log": 1, "log2": 1, "log1p": 1, "sqrt": 1, "rsqrt": 1, "reciprocal": 1, "pow": 1}


@pytest.mark.parametrize("op", sorted(DERIVATIVE))
def test_derivative_rows_match_torch_autograd(op):
    """vjp of op(x0, x1) with adjoint x2, evaluated in float64, equals torch autograd's."""
    from flashlight.ir.expr import POINTWISE
    arity = POINTWISE[op][0]
    if op == "where":
        body = lambda a, b, g: call("where", call("gt", a, 0.0), a * b, b)          # noqa: E731
    elif op == "stop":      # stop(a) * b + a: d/da = 1, not 1 + b
        body = lambda a, b, g: call("stop", a) * b + a                                # noqa: E731
    elif arity == 2:
        body = lambda a, b, g: call(op, a, b)                                         # noqa: E731
    else:
        body = lambda a, b, g: call(op, a)                                            # noqa: E731
    r = _region(body)
    torch.manual_seed(0)
    xs = [torch.randn(2, 5, 7, dtype=torch.float64) for _ in range(3)]
    if op in UNARY_DOMAIN:
        xs[0] = xs[0].abs() + 0.5
    xs[1][0, 0, :2] = xs[0][0, 0, :2]               # ties for maximum/minimum
    leaves = [x.clone().requires_grad_() for x in xs[:2]] + [xs[2]]
    ev = Evaluator(r, leaves)
    y = ev.full(ev.ctx_s(r.reductions[0].body), ev.ctx_s)
    ref = torch.autograd.grad(y, leaves[:2], xs[2], allow_unused=True)
    adj = vjp({r.reductions[0].body: load(2, (var("b0"), var("m"), var("n")), "f")})
    ev = Evaluator(r, xs)
    for i in range(2):
        x = load(i, (var("b0"), var("m"), var("n")), "f")
        got = ev.full(ev.ctx_s(adj[x]), ev.ctx_s) if x in adj else torch.zeros_like(xs[i])
        want = ref[i] if ref[i] is not None else torch.zeros_like(xs[i])
        torch.testing.assert_close(got, want)


def test_max_shift_takes_a_gradient_unless_it_cancels():
    """The max is a constant in the backward when the output is homogeneous of degree 0 in the
    sums it rescales (l / l); otherwise (l alone, a logsumexp-like output; the max read back) it
    is in ``shift_gradients`` and the generated backward takes it at the argmax — unless its
    extra element is a load (a sink logit would take the gradient) or its body reads another
    reduction."""
    s = load(0, (var("b0"), var("m"), var("n")), "f")
    r = _region(lambda a, b, g: a)
    r.reductions = [Reduction("max", s), Reduction("sum", call("exp", s - red(0)), online=0)]
    assert degree(call("div_safe", red(1), red(1)), {1}) == 0 and degree(red(1), {1}) == 1
    r.out = call("sigmoid", call("div", red(1), red(1)))
    assert backward_support(r) is None and shift_gradients(r) == []
    r.out = call("div", red(1), call("add", call("exp", call("neg", red(0))), red(1)))    # softmax_1's +1
    assert backward_support(r) is None and shift_gradients(r) == []
    for out in (red(1), red(0), call("div", red(1), call("add", red(1), const(1e-3)))):
        r.out = out
        assert backward_support(r) is None and shift_gradients(r) == [0]
    r.reductions[0] = Reduction("max", s, extra=load(1, (var("b0"), var("m"), var("n")), "f"))
    assert "extra element" in backward_support(r)
    r.reductions = [Reduction("sum", s), Reduction("max", s * red(0)),
                    Reduction("sum", call("exp", s - red(1)), online=1)]
    r.out = red(2)
    assert "reads other reductions" in backward_support(r)


def _stopped_programs():
    def detached_operands(q, k, v, b):      # detach() on a key, a bias and the values
        s = q @ k.detach().transpose(-1, -2) * 0.25 + b.detach() * 2
        return torch.softmax(s, -1) @ v.detach() + v

    def detached_scores(q, k, v, b):        # stop-gradient through the scores themselves
        s = q @ k.transpose(-1, -2) * 0.25 + b
        return torch.softmax(s.detach(), -1) @ v + torch.softmax(s, -1) @ v * 0.5

    def no_grad_block(q, k, v, b):          # a mask bias built from q under no_grad
        with torch.no_grad():
            bias = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25 + b, -1) @ v + bias * 0.5

    def all_detached(q, k, v, b):           # no gradient reaches the region: the inference op,
        o = attention(q.detach(), k.detach(), v.detach(), b)       # through Inductor (cumsum)
        return o.cumsum(-1) + q * 2

    def rows_of_detached(q, k, v, b):       # a row output (logsumexp) of a region no gradient reaches
        s = q.detach() @ k.detach().transpose(-1, -2)
        return torch.softmax(s, -1) @ v.detach() * b[:, :16] + torch.logsumexp(s, -1, keepdim=True)

    def chunk_under_no_grad(q, k, v, b):    # a rule reads through the chunk to its input
        with torch.no_grad():
            q1, q2 = q.chunk(2, -1)
        k1, k2 = k.chunk(2, -1)
        return torch.softmax((q1 @ k1.transpose(-1, -2) + q2 @ k2.transpose(-1, -2)) * 0.25, -1) @ v
    def inference_mode_block(q, k, v, b):   # what Dynamo records for it, the ATen trace drops
        with torch.inference_mode():
            teacher = attention(q, k, v, b)
        return attention(q, k, v, b) + teacher
    def nested_inference_mode(q, k, v, b):  # an inner inference_mode(False) ends no outer block
        with torch.inference_mode():
            with torch.inference_mode(False):
                unused = q * 1.0  # noqa: F841
            teacher = attention(q, k, v, b)
        return attention(q, k, v, b) + teacher

    def data_operands(q, k, v, b):          # .data bypasses the dispatcher: the trace froze it as a constant
        return torch.softmax(q @ k.data.transpose(-1, -2) * 0.25 + b.data, -1) @ v + q.data
    return [detached_operands, detached_scores, no_grad_block, all_detached, rows_of_detached, chunk_under_no_grad,
            inference_mode_block, nested_inference_mode, data_operands]


def attention(q, k, v, b):
    return torch.softmax(q @ k.transpose(-1, -2) * 0.25 + b, -1) @ v


def _scaled_in_place_under_no_grad(q, k, v, b):
    s = q @ k.transpose(-1, -2)
    with torch.no_grad():
        s.mul_(0.5)                         # eager's gradient passes the write unchanged
    return torch.softmax(s + b, -1) @ v


def _func_grad_inside(q, k, v, b):
    """A torch.func transform inside the program: left to Inductor (the ATen trace failed
    halfway and left functorch's nesting raised: Dynamo's guards then failed on their own frame)."""
    g = torch.func.grad(lambda x: attention(x, k, v, b).sum())(q)
    return attention(q, k, v, b) + g


def _hook_inside(q, k, v, b):
    """A tensor hook inside the program (the ATen trace dropped it: its gradient was missing)."""
    h = q * 1.0
    h.register_hook(lambda g: g * 3.0)
    return attention(h, k, v, b)


class _ReverseGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return -2.0 * g


def _autograd_function_inside(q, k, v, b):
    """A user autograd.Function (the trace ran its forward under no_grad and read it as a
    stopped gradient: q got none)."""
    return attention(_ReverseGradient.apply(q), k, v, b) + _ReverseGradient.apply(attention(q, k, v, b))


UNFUSED = (_scaled_in_place_under_no_grad, _func_grad_inside, _hook_inside, _autograd_function_inside)
# ^ fall back, with eager's gradients


@pytest.mark.parametrize("fn", _stopped_programs() + list(UNFUSED), ids=lambda f: f.__name__)
@pytest.mark.parametrize("trained", ["q k v b", "q"])
def test_a_stopped_gradient_stays_stopped_inside_a_region(fn, trained):
    """``detach()`` and ``torch.no_grad()`` inside a fused program: no gradient flows through
    them (the region loads the stopped value; before, the capture fused through ``detach`` as a
    view and through the no_grad block, and gave their inputs gradients they do not have; a
    region no gradient reached crashed Inductor's tracing or kept a backward). Every input's
    gradient, absent ones as zeros, matches float64 eager, with every input trained and with q
    alone; each program but those in UNFUSED (which fall back) is fused (a product of
    detached scores alone is not a region: it has no score contraction)."""
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(1, 2, 37, 16, generator=g) for _ in range(3)] + [torch.randn(37, 37, generator=g)]
    names = "q k v b".split()

    def gradients(f, cast):
        leaves = [cast(x).requires_grad_(n in trained.split()) for x, n in zip(xs, names)]
        out = f(*leaves)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
        wanted = [x for x in leaves if x.requires_grad]
        if not out.requires_grad:           # no trained input reaches the output (both sides)
            return [torch.zeros_like(x) for x in wanted]
        return torch.autograd.grad((out * w).sum(), wanted, allow_unused=True, materialize_grads=True)
    torch.compiler.reset()
    report = flashlight.explain(fn, *[x.clone().requires_grad_(n in trained.split()) for x, n in zip(xs, names)])
    assert fn in UNFUSED or report.regions, report
    torch.compiler.reset()
    got = gradients(torch.compile(fn, backend="flashlight"), lambda x: x.clone())
    want = gradients(fn, lambda x: x.double())
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_error(a, b) < 1e-3 if b.abs().max() > 0 else a.abs().max() == 0, i


@pytest.mark.parametrize("variant", ["causal", "alibi", "document_mask"])
def test_a_gradient_of_a_gradient_matches_eager(variant):
    """``create_graph=True`` through a fused region (a gradient penalty on every input, and a
    Hessian-vector product in q): the second-order gradients match float64 eager. Before, the
    backward was ``once_differentiable`` with kernel gradients that autograd saw as constants:
    the HVP came out without the attention's terms, silently."""
    mod = VARIANTS[variant]
    g = torch.Generator().manual_seed(3)
    xs = list(mod.make_inputs(B=1, H=2, M=37, D=16))
    floats = [i for i, x in enumerate(xs) if x.is_floating_point()]
    vec = torch.randn(xs[0].shape, generator=g)
    w = torch.randn(xs[0].shape[:-1] + (xs[2].shape[-1],), generator=g)

    def second_order(fn, cast):
        leaves = [cast(x).requires_grad_() if i in floats else x for i, x in enumerate(xs)]
        wanted = [leaves[i] for i in floats]
        out = fn(*leaves)
        grads = torch.autograd.grad((out * w.to(out.dtype)).sum(), wanted, create_graph=True)
        penalty = sum((gr ** 2).sum() for gr in grads)
        hvp = (grads[0] * vec.to(grads[0].dtype)).sum()
        return [*torch.autograd.grad(penalty, wanted, retain_graph=True), *torch.autograd.grad(hvp, wanted)]
    torch.compiler.reset()
    assert flashlight.explain(mod.attention, *[x.clone().requires_grad_() if i in floats else x
                                               for i, x in enumerate(xs)]).regions
    torch.compiler.reset()
    got = second_order(torch.compile(mod.attention, backend="flashlight"), lambda x: x.clone())
    want = second_order(mod.attention, lambda x: x.double())
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_error(a, b) < 1e-3, i


def _forward_runs(model, x, w) -> tuple[torch.Tensor, list[int]]:
    """The compiled ``model(x)``, then ``(out * w).sum().backward()``: the output and how many
    region forwards ran by the end of each (a checkpointed body's regions run again in the
    backward)."""
    from flashlight.runtime import op
    runs, run = [], op.CompiledRegion.run

    def counted(self, *args, **kwargs):
        runs.append(self.key)
        return run(self, *args, **kwargs)
    torch.compiler.reset()
    compiled = torch.compile(model, backend="flashlight")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(op.CompiledRegion, "run", counted)
        out = compiled(x)
        after_forward = len(runs)
        (out * w).sum().backward()
    return out, [after_forward, len(runs)]


class _CheckpointedLayers(torch.nn.Module):
    """Two pre-norm layers, each under ``torch.utils.checkpoint`` (the second nested one level
    deeper), and an attention outside any checkpoint."""

    def __init__(self, d: int, n: int):
        super().__init__()
        self.proj = torch.nn.ModuleList(torch.nn.Linear(d, 3 * d) for _ in range(2))
        self.bias = torch.nn.Parameter(torch.randn(n, n) / 4)

    def layer(self, i, x):
        q, k, v = self.proj[i](torch.nn.functional.layer_norm(x, x.shape[-1:])).chunk(3, -1)
        s = q @ k.transpose(-1, -2) * 0.25 + self.bias
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).tril().logical_not(), float("-inf"))
        return x + torch.softmax(s, -1) @ v

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        x = checkpoint(self.layer, 0, x, use_reentrant=False)
        x = checkpoint(lambda y: checkpoint(self.layer, 1, y, use_reentrant=False) * 2, x, use_reentrant=False)
        return attention(x, x, x, self.bias)


def test_activation_checkpointing_fuses_each_checkpointed_body():
    """``torch.utils.checkpoint`` (Dynamo's ``tag_activation_checkpoint``): each checkpointed body
    fuses, nested ones too, and the checkpoint stays — the backward recomputes the bodies' regions
    (their forward kernels run again) instead of saving what the bodies compute. Gradients of the
    input and of every parameter match float64 eager. The attention between the checkpoints
    fuses too (a piece of the graph of its own); a classifier's log_softmax there is no
    attention. Before, the whole graph went to Inductor, unfused."""
    torch.manual_seed(0)
    model, x = _CheckpointedLayers(16, 37), torch.randn(1, 2, 37, 16)
    model64 = copy.deepcopy(model).double()
    torch.compiler.reset()
    report = flashlight.explain(model, x.clone().requires_grad_())
    assert len(report.regions) == 3 and not report.fallbacks, report

    def with_a_head(x, w):          # a classifier's log_softmax outside the checkpoint is no attention
        return torch.log_softmax(model(x).mean(-2) @ w, -1)
    torch.compiler.reset()
    report = flashlight.explain(with_a_head, x.clone().requires_grad_(), torch.randn(16, 5))
    assert len(report.regions) == 3 and not report.fallbacks, report
    w = torch.randn(x.shape)
    leaves = [x.clone().requires_grad_(), x.double().requires_grad_()]
    out, runs = _forward_runs(model, leaves[0], w)
    assert runs == [3, 5]          # the bodies recomputed in the backward: the checkpoints were kept
    (model64(leaves[1]) * w.double()).sum().backward()
    assert rel_error(out, model64(leaves[1])) < 1e-5
    assert rel_error(leaves[0].grad, leaves[1].grad) < 1e-3
    for (name, p), p64 in zip(model.named_parameters(), model64.parameters()):
        assert rel_error(p.grad, p64.grad) < 1e-3, name


class _CheckpointedMLP(torch.nn.Module):
    """Pre-norm blocks that checkpoint only their MLP (selective recomputation): the causal
    attention (its second softmax written by hand) runs between the checkpoints."""

    def __init__(self, d: int):
        super().__init__()
        self.qkv, self.up, self.down = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def mlp(self, x):
        return self.down(torch.nn.functional.gelu(self.up(torch.nn.functional.layer_norm(x, x.shape[-1:]))))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for i in range(2):
            q, k, v = self.qkv(torch.nn.functional.layer_norm(x, x.shape[-1:])).unflatten(-1, (3, 2, -1)).unbind(-3)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
            s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
            e = torch.exp(s - s.amax(-1, keepdim=True))        # the second softmax written by hand
            x = x + ((torch.softmax(s, -1) if i == 0 else e / e.sum(-1, keepdim=True)) @ v).transpose(1, 2).flatten(-2)
            x = x + checkpoint(self.mlp, x, use_reentrant=False)
        return x


def test_attention_between_checkpoints_fuses_and_is_not_recomputed():
    """Checkpointing only the MLPs: both attentions fuse (each a piece of the graph between the
    checkpoints), run once in the forward and are not recomputed in the backward (the MLPs
    are). Gradients of the input and of every parameter match float64 eager."""
    torch.manual_seed(0)
    model, x = _CheckpointedMLP(16), torch.randn(2, 37, 16)
    model64 = copy.deepcopy(model).double()
    torch.compiler.reset()
    report = flashlight.explain(model, x.clone().requires_grad_())
    assert len(report.regions) == 2 and not report.fallbacks, report
    leaves = [x.clone().requires_grad_(), x.double().requires_grad_()]
    w = torch.randn(x.shape)
    out, runs = _forward_runs(model, leaves[0], w)
    assert runs == [2, 2]
    want = model64(leaves[1])
    (want * w.double()).sum().backward()
    assert rel_error(out, want) < 1e-5
    assert rel_error(leaves[0].grad, leaves[1].grad) < 1e-3
    for (name, p), p64 in zip(model.named_parameters(), model64.parameters()):
        assert rel_error(p.grad, p64.grad) < 1e-3, name


def _ckpt_scale(t):
    from torch.utils.checkpoint import checkpoint
    return checkpoint(lambda x: x * 1.0, t, use_reentrant=False)


def _attn(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v


def _no_grad_over_a_checkpoint(q, k, v):
    with torch.no_grad():
        o = _attn(q, _ckpt_scale(k), v) * 2
    return _attn(q, k, v) + o


def _mutated_checkpoint_output(q, k, v):
    from torch.utils.checkpoint import checkpoint
    o, a = checkpoint(lambda q, k, v: (_attn(q, k, v), q * 1.0), q, k, v, use_reentrant=False)
    a.mul_(2)
    return _attn(a, k, v) + o


def _split_by_a_checkpoint(q, k, v):
    return _ckpt_scale(torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1)) @ v


@pytest.mark.parametrize("fn, regions, reason", [
    # a piece would be fused under the compile's grad mode: both attentions were one region,
    # differentiated, and q and v got 3x eager's gradients
    (_no_grad_over_a_checkpoint, 0, "switches grad mode"),
    # a piece's inputs were traced as leaves, so its in-place update failed the whole graph's fusion
    (_mutated_checkpoint_output, 2, None),
    (_split_by_a_checkpoint, 0, "a checkpoint op splits this attention"),
], ids=["no_grad", "in_place", "split"])
def test_pieces_between_checkpoints_keep_eager_semantics(fn, regions, reason):
    """Cutting a graph at its checkpoints: a grad-mode switch anywhere keeps every piece
    unfused (with the reason), a piece may update its inputs in place, and an attention that a
    checkpoint splits is named. Outputs and gradients match float64 eager."""
    q, k, v = (torch.randn(1, 2, 20, 16, requires_grad=True) for _ in range(3))
    torch.compiler.reset()
    report = flashlight.explain(fn, q, k, v)
    assert len(report.regions) == regions, report
    assert all(reason in f.reason for f in report.fallbacks) and bool(report.fallbacks) == bool(reason), report
    _matches_float64(fn, q, k, v)


def _autocast_over_a_checkpoint(q, k, v):
    from torch.utils.checkpoint import checkpoint
    with torch.autocast("cpu", torch.bfloat16):
        return checkpoint(_attn, q, k, v, use_reentrant=False)


def _enable_grad_over_a_checkpoint(q, k, v):     # called under no_grad
    from torch.utils.checkpoint import checkpoint
    with torch.enable_grad():
        return checkpoint(_attn, q * 1.0, k, v, use_reentrant=False)


@pytest.mark.parametrize("fn", [_autocast_over_a_checkpoint, _enable_grad_over_a_checkpoint])
def test_a_checkpointed_body_fuses_under_the_modes_it_runs_in(fn):
    """A body is fused under the grad mode and autocast that the graph's switches before it
    set (not the compile's): under a bfloat16 autocast block its region returned float32; under
    ``enable_grad`` in a graph compiled under ``no_grad`` it was built without a backward."""
    q, k, v = (torch.randn(1, 2, 20, 16, requires_grad=True) for _ in range(3))
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    with torch.no_grad() if fn is _enable_grad_over_a_checkpoint else contextlib.nullcontext():
        torch.compiler.reset()
        out = torch.compile(fn, backend="flashlight")(q, k, v)
        eager = fn(q, k, v)
        want = fn(*leaves)
    assert out.dtype == eager.dtype
    assert rel_error(out.double(), want) <= max(2 * rel_error(eager.double(), want), 1e-5)
    for a, b in zip(torch.autograd.grad(out.float().sum(), [q, k, v]), torch.autograd.grad(want.sum(), leaves)):
        assert rel_error(a.double(), b) < 1e-2


def test_checkpointing_without_gradients_fuses_the_whole_graph():
    """A checkpointed model run without gradients recomputes nothing: its checkpoints become
    plain calls, and the whole graph fuses, the attention outside them included. A checkpointed
    SDPA call with its mask passed in stays SDPA and runs, where Inductor alone fails ("does not
    support RNG ops in recompute regions": it counts SDPA among random ops). Outputs match float64."""
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    model, x = _CheckpointedLayers(16, 37), torch.randn(1, 2, 37, 16)
    with torch.no_grad():
        torch.compiler.reset()
        report = flashlight.explain(model, x)
        assert len(report.regions) == 3 and not any("checkpoint" in f.reason for f in report.fallbacks), report
        torch.compiler.reset()
        assert rel_error(torch.compile(model, backend="flashlight")(x), copy.deepcopy(model).double()(x.double())) < 1e-5

    def sdpa_layer(q, k, v, keep):
        return checkpoint(torch.nn.functional.scaled_dot_product_attention, q, k, v, keep, use_reentrant=False)
    q, k, v = (torch.randn(1, 2, 37, 16) for _ in range(3))
    keep = torch.rand(37, 37) > 0.3
    keep[:, 0] = True
    torch.compiler.reset()
    out = torch.compile(sdpa_layer, backend="flashlight")(q, k, v, keep)
    assert rel_error(out, sdpa_layer(*(x.double() for x in (q, k, v)), keep)) < 1e-5


@pytest.mark.parametrize("name,D", [("causal", 16), ("document_mask", 16), ("gqa", 16), ("diff_attention", 32),
                                    ("evoformer", 16), ("relative_position", 16), ("sinks", 16), ("ipa", 16),
                                    ("causal", 80)])
def test_fused_dq_adds_dq_in_the_dkdv_kernel(name, D, monkeypatch):
    """``FLASHLIGHT_ATOMIC_DQ=1`` (``GradPlan.fused_dq``): the dK/dV kernel adds each tile's
    dS K into an fp32 dQ with atomics and no dQ kernel is generated or launched; every gradient
    still matches float64 — two score tiles over halves of q (DiffAttn), GQA, block sparsity,
    biases, a gathered table, sinks, head-dim pieces (D=80), and q read as k too."""
    from flashlight.runtime.op import REGISTRY
    monkeypatch.setenv("FLASHLIGHT_ATOMIC_DQ", "1")
    REGISTRY.clear()        # this test's regions alone (the option is part of the registry key)
    torch.compiler.reset()
    mod = VARIANTS[name]
    try:
        check_grads(mod.attention, mod.make_inputs(B=1, H=2, M=37, D=D))
        if name == "causal" and D == 16:
            x, v = torch.randn(1, 2, 45, 32), torch.randn(1, 2, 45, 32)
            check_grads(lambda x, v: torch.softmax(x @ x.mT * 0.2, -1) @ v, (x, v))
        kernels = [c.bwd_kernel for c in REGISTRY.values() if c.bwd_kernel]
        assert kernels and all(k.plan.fused_dq and k.dq is None and "dq" not in k.needed_kernels(None)
                               for k in kernels)
        assert all("_dq(" not in c.bwd_source for c in REGISTRY.values() if c.bwd_kernel)
    finally:
        REGISTRY.clear()        # later tests get regions with the default backward
        torch.compiler.reset()


@pytest.mark.parametrize("kv_leaves", ["1", "0"])
@pytest.mark.parametrize("v_norm", ["rms", "l2"])
def test_operands_that_divide_by_a_loaded_norm_stay_finite_in_padding(v_norm, kv_leaves, monkeypatch):
    """QK-norm with a learned scale (``q / q.norm()``, k likewise) and a normalised V: the
    operand tiles divide by a loaded norm, which reads 0 in the rows past M or N that pad the
    last block, and 0 / 0 there reached the products (NaN times the zero it meets is NaN):
    every gradient of q and k was NaN (found by a review), and with ``v / v.norm()`` the
    forward's output was NaN too. Lengths that are not whole blocks. K and V computed in the
    kernel too (``FLASHLIGHT_KV_LEAVES=0``; by default they load as leaves, Q does not)."""
    monkeypatch.setenv("FLASHLIGHT_KV_LEAVES", kv_leaves)
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 37, 32), torch.randn(1, 2, 45, 32), torch.randn(1, 2, 45, 32)
    scale = torch.tensor(4.0)

    def qk_norm(q, k, v, scale):
        qn, kn = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
        vn = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) if v_norm == "rms" else \
            v / v.norm(dim=-1, keepdim=True)
        return torch.softmax(qn @ kn.mT * scale, -1) @ vn
    torch.compiler.reset()
    out = torch.compile(qk_norm, backend="flashlight")(q, k, v, scale)
    assert rel_error(out.double(), qk_norm(q.double(), k.double(), v.double(), scale.double())) < 1e-5
    check_grads(qk_norm, (q, k, v, scale))


def test_padding_rows_are_not_summed_into_an_operand_read_at_one_key():
    """One key (N = 1) of a K/V head shared by 4 query heads, normalised after the copy (fuzz
    seed 199, #232): the load of k drops the key index (k[b, 0, 0, dk]) while its norm keeps it,
    so the rows that pad the dK/dV program's key block read k over a norm of 0. The adjoint
    there is 0 * inf, and k's gradient sums those rows (its load does not use the tile's key
    var): every element was NaN. The operands' gradients are now masked to the tile's in-range
    elements before such sums. A sink logit gives the softmax a second column, so q and k have
    gradients that are not all zero."""
    B, H, M, D = 2, 4, 5, 24
    q, k, v = torch.randn(B, H, M, D), torch.randn(B, 1, 1, D), torch.randn(B, 1, 1, D)
    sinks = torch.randn(H)

    def attn(q, k, v, sinks):
        k, v = (x[:, :, None].expand(B, 1, H, 1, D).reshape(B, H, 1, D) for x in (k, v))
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
        s = torch.cat([q @ k.mT * 4.0, sinks.view(1, H, 1, 1).expand(B, H, M, 1)], dim=-1)
        return torch.softmax(s, -1)[..., :1] @ v
    check_grads(attn, (q, k, v, sinks))
