"""Compiled-kernel tests: they need a GPU and ``TRITON_INTERPRET=0`` (the suite's conftest sets the
interpreter by default), and skip otherwise. On the device: ``TRITON_INTERPRET=0 python -m pytest
tests/test_gpu.py``."""
import os

import pytest
import torch

import flashlight
from flashlight._compat import FastLaunch
from flashlight.codegen.gluon_backward import tiles_support
from flashlight.examples import VARIANTS
from flashlight.runtime.op import REGISTRY
from flashlight.testing import rel_error, to64
from helpers import causal_gqa

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="compiled Triton kernels need a GPU (and TRITON_INTERPRET=0)")

# bf16 inputs, fp32 accumulation: the error floor of bf16 outputs and of FA2-style bf16 dot operands
FWD_TOL, GRAD_TOL = 2e-2, 5e-2


def _inputs(name, **kw):
    torch.manual_seed(0)
    return [x.cuda() for x in VARIANTS[name].make_inputs(**kw)]


@pytest.mark.parametrize("name,D", [("causal", 64), ("alibi", 64), ("document_mask", 64), ("sliding_window", 64),
                                    ("diff_attention", 64), ("diff_transformer", 64), ("evoformer", 64), ("causal", 80),
                                    ("gated", 96), ("rope", 128), ("ipa", 64), ("post_softmax", 64),
                                    ("relative_position", 64)])
def test_bf16_forward_and_gradients_match_float64(name, D):
    """Ten variants at D = 64 (DiffAttn both ways: its gradients stored into interleaved heads
    in the second; IPA's and post_softmax's body gradients summed across the loops, IPA's pair
    bias stored per tile; T5's table added once per uniform tile), two head dims whose QK^T and P @ V run in power-of-two pieces, and RoPE at
    D = 128 (in training its rotated Q and K load as leaves: the Gluon forward and tile kernels,
    the cos and sin tables' gradients through Inductor)."""
    check_bf16(name, D)


@pytest.mark.parametrize("name,D", [("causal", 64), ("evoformer", 64), ("gated", 96), ("gqa", 128)])
def test_descriptor_loads_match_float64(name, D, monkeypatch):
    """The same with ``FLASHLIGHT_TMA=1``: K, V (and the backward's Q) through tensor descriptors,
    a 5-D Evoformer input, DV pieces, GQA's shared heads."""
    monkeypatch.setenv("FLASHLIGHT_TMA", "1")
    check_bf16(name, D)
    assert any(c.tma for c in REGISTRY.values())


def check_bf16(name, D):
    mod = VARIANTS[name]
    inputs = [x.to(torch.bfloat16) if x.is_floating_point() else x
              for x in _inputs(name, B=2, H=4, M=333, D=D)]
    leaves = [x.requires_grad_() for x in inputs if x.is_floating_point()]
    out = torch.compile(mod.attention, backend="flashlight")(*inputs)
    dout = torch.randn_like(out)
    check_against_float64(mod, inputs, out, torch.autograd.grad(out, leaves, dout), dout)


def check_against_float64(mod, inputs, out, grads, dout):
    """``out`` and the gradients of sum(out * dout) match ``mod.attention`` in float64."""
    ref_in = [to64(x).detach().requires_grad_() if x.is_floating_point() else x for x in inputs]
    ref = mod.attention(*ref_in)
    ref_grads = torch.autograd.grad(ref, [x for x in ref_in if x.is_floating_point()], to64(dout))
    assert rel_error(out, ref) < FWD_TOL
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert rel_error(g, r) < GRAD_TOL, (i, rel_error(g, r))


@pytest.mark.parametrize("case", ["decoupled_rope", "absorbed_mla", "mqa_einsum"])
def test_joined_products_and_shared_kv_einsums_bf16(case):
    """Two score products of different lengths run as one dot over 64 + 16 dims (padded to 128 in
    the kernel), and einsums whose K and V lack the head letter, in bf16 against float64."""
    from types import SimpleNamespace

    from test_capture import _mqa_einsum
    from test_products import absorbed_mla, decoupled_rope
    torch.manual_seed(0)
    B, H, M, N, D, R = 2, 4, 333, 300, 64, 16
    fn, shapes = {"decoupled_rope": (decoupled_rope, [(B, H, M, D), (B, H, N, D), (B, H, N, D), (B, H, M, R), (B, H, N, R)]),
                  "absorbed_mla": (absorbed_mla, [(B, 57, 16, D), (B, 57, 16, R), (B, N, D), (B, N, R)]),
                  "mqa_einsum": (_mqa_einsum, [(B, H, M, D), (B, N, D), (B, N, D)])}[case]
    inputs = [torch.randn(s, device="cuda", dtype=torch.bfloat16).requires_grad_() for s in shapes]
    report = flashlight.explain(fn, *inputs)
    assert len(report.regions) == 1 and "bias" not in report.regions[0].features, report
    out = torch.compile(fn, backend="flashlight")(*inputs)
    dout = torch.randn_like(out)
    check_against_float64(SimpleNamespace(attention=fn), inputs, out, torch.autograd.grad(out, inputs, dout), dout)


@pytest.mark.parametrize("case", ["softpick", "softmax_one_causal", "softmax_eps", "max_read_back"])
def test_shifts_bf16(case):
    """Softpick (the example, two passes: its epsilon's gradient at each row's argmax), softmax_1
    (its shift a seeded max), an epsilon in a hand-written softmax, the max read back: generated
    backward, the argmax kept by the compiled kernel's ``if STATS`` branch."""
    from types import SimpleNamespace

    from test_shifts import PROGRAMS, SHIFT_GRADIENTS
    fn = {**PROGRAMS, **SHIFT_GRADIENTS, "softpick": VARIANTS["softpick"].attention}[case]
    torch.manual_seed(0)
    inputs = [torch.randn(2, 4, 333, 64, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
    if case != "softpick":      # test_shifts' programs mask for its own lengths (M = 37, N = 70)
        inputs = [x[:, :, :37].detach().requires_grad_() if i == 0 else x[:, :, :70].detach().requires_grad_()
                  for i, x in enumerate(inputs)]
    r = flashlight.explain(fn, *inputs).regions[0]
    assert ("2-pass" in r.features) == (case == "softpick") and r.backward.startswith("generated"), \
        (r.features, r.backward)
    out = torch.compile(fn, backend="flashlight")(*inputs)
    dout = torch.randn_like(out)
    check_against_float64(SimpleNamespace(attention=fn), inputs, out, torch.autograd.grad(out, inputs, dout), dout)


@pytest.mark.parametrize("case", ["reference_triangle_product", "flipped_cumsum", "softplus_total_minus_prefix",
                                  "triu_product"])
def test_scans_bf16(case):
    """Stick-breaking's sums over the keys after each key (and a prefix sum): the compiled
    forward walks the key blocks in the scan's direction (tl.cumsum per block, the carry across
    blocks), and so does the generated backward, twice. 333 keys: a ragged last block, processed first by a suffix scan; the first
    query sees no key."""
    from types import SimpleNamespace

    from test_scans import PROGRAMS
    torch.manual_seed(0)
    inputs = [torch.randn(2, 4, 333, 64, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
    r = flashlight.explain(PROGRAMS[case], *inputs).regions[0]
    assert "key-scan" in r.features, r.features
    assert r.backward.startswith("generated"), r.backward
    out = torch.compile(PROGRAMS[case], backend="flashlight")(*inputs)
    dout = torch.randn_like(out)
    check_against_float64(SimpleNamespace(attention=PROGRAMS[case]), inputs, out,
                          torch.autograd.grad(out, inputs, dout), dout)


@pytest.mark.parametrize("sharp", [1.0, 4.0])
def test_scans_long_rows_bf16(sharp):
    """2048 keys: the backward reverses the scan as the row's total adjoint less the part walked
    so far, both summed by the same kernel in the same order. Its gradients are within bf16's
    reach of float64 (eager bf16, which sums the log-weights in bf16, is given for scale only),
    with scores of unit spread and four times that (log-weights of -4 a key: row sums of -8000)."""
    from flashlight.examples import stick_breaking
    torch.manual_seed(0)
    xs = [torch.randn(1, 4, 2048, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    xs[0] = (xs[0] * sharp).bfloat16()
    xs = [x.requires_grad_() for x in xs]
    fn = stick_breaking.attention
    out = torch.compile(fn, backend="flashlight")(*xs)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, xs, dout)
    eager = torch.autograd.grad(fn(*xs), xs, dout)
    x64 = [to64(x).detach().requires_grad_() for x in xs]
    ref = torch.autograd.grad(fn(*x64), x64, to64(dout))
    for i, (g, e, r) in enumerate(zip(got, eager, ref)):
        assert rel_error(g, r) < 2e-2, (i, rel_error(g, r), rel_error(e, r))


@pytest.mark.parametrize("case", ["threshold", "twice", "sqrt_weights", "biased"])
def test_sums_read_by_a_later_pass_bf16(case):
    """The normaliser read by a later pass (a threshold renormalised, twice; a square root of
    p; a bias read by both passes): the compiled sums kernel walks the keys between the row
    kernel and the tile kernels (``SumsWriter``), 333 queries against 1000 keys in bf16, q
    scaled so that rows are peaked enough to keep keys above the fixed thresholds."""
    from types import SimpleNamespace

    from flashlight.examples import threshold
    from test_chained import PROGRAMS, biased
    torch.manual_seed(0)
    fn = {"threshold": threshold.attention, "biased": biased, **PROGRAMS}[case]
    shapes = [(2, 4, 333, 64), (2, 4, 1000, 64), (2, 4, 1000, 64)] + ([(4, 333, 1000)] if case == "biased" else [])
    inputs = [torch.randn(s, device="cuda") for s in shapes]
    inputs[0] *= 3      # peaked rows: a few keys above the fixed thresholds of 1000
    inputs = [x.to(torch.bfloat16).requires_grad_() for x in inputs]
    r = flashlight.explain(fn, *inputs).regions[0]
    assert r.backward.startswith("generated") and "sums kernel" in r.backward, r.backward
    out = torch.compile(fn, backend="flashlight")(*inputs)
    dout = torch.randn_like(out)
    check_against_float64(SimpleNamespace(attention=fn), inputs, out, torch.autograd.grad(out, inputs, dout), dout)


@pytest.mark.parametrize("case", ["lse_causal", "entropy", "row_max"])
def test_row_output_gradients_bf16(case):
    """A logsumexp, the attention entropy and the row max returned next to the output: their
    gradients seed the compiled row kernel (the row max's at the saved argmax)."""
    import test_outputs
    fn = getattr(test_outputs, case)
    torch.manual_seed(0)
    xs = [torch.randn(2, 4, 333, 64, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
    assert flashlight.explain(fn, *xs).regions[0].backward.startswith("generated")
    o, row = torch.compile(fn, backend="flashlight")(*xs)
    do, drow = torch.randn_like(o), torch.randn_like(row)
    got = torch.autograd.grad((o, row), xs, (do, drow))
    x64 = [to64(x).detach().requires_grad_() for x in xs]
    o64, row64 = fn(*x64)
    ref = torch.autograd.grad((o64, row64), x64, (to64(do), to64(drow)))
    assert rel_error(o, o64) < FWD_TOL and rel_error(row, row64) < FWD_TOL
    for i, (a, b) in enumerate(zip(got, ref)):
        assert rel_error(a, b) < GRAD_TOL, (i, rel_error(a, b))


@pytest.mark.parametrize("name,D", [("causal", 128), ("document_mask", 64), ("diff_attention", 64), ("gqa", 128)])
def test_fused_dq_bf16(name, D, monkeypatch):
    """``FLASHLIGHT_ATOMIC_DQ=1``: the dK/dV kernel adds dQ with fp32 atomics, no dQ kernel."""
    monkeypatch.setenv("FLASHLIGHT_ATOMIC_DQ", "1")
    REGISTRY.clear()
    torch.compiler.reset()
    try:
        check_bf16(name, D)
        assert all(c.bwd_kernel.plan.fused_dq for c in REGISTRY.values() if c.bwd_kernel)
    finally:
        REGISTRY.clear()        # this test's regions alone (the option is part of the registry key)
        torch.compiler.reset()


def test_fast_launch_recompiles_for_a_misaligned_view(monkeypatch):
    """The same compiled region called on an aligned q, then on a view 2 bytes into its storage:
    the launcher's key sends the second through Triton (another specialisation), and both agree
    with eager. Without the quick start: its dense kernel serves the first calls while the
    region's own kernel compiles in the background, and whether that kernel is ready by the
    fifth call depends on the host. (The test passed while an earlier test's causal kernel of
    the same name turned the quick start off; keyed per scan bucket since session 24, it did
    not, and the test failed in session 25.)"""
    monkeypatch.setenv("FLASHLIGHT_QUICK", "0")
    REGISTRY.clear()            # read at a region's first launch: no region of an earlier test
    torch.compiler.reset()
    mod = VARIANTS["causal"]
    q, k, v = (x.to(torch.bfloat16) for x in _inputs("causal", B=1, H=2, M=200, D=64))
    fast = torch.compile(mod.attention, backend="flashlight", dynamic=False)
    ref = mod.attention(*(to64(x) for x in (q, k, v)))
    for _ in range(3):
        assert rel_error(fast(q, k, v), ref) < FWD_TOL
    flat = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)
    q2 = flat[1:].view_as(q)
    q2.copy_(q)
    assert q2.data_ptr() % 16 != 0
    for _ in range(2):
        assert rel_error(fast(q2, k, v), ref) < FWD_TOL
    launchers = [c.kernel for c in REGISTRY.values() if hasattr(c.kernel, "kernels")]
    assert launchers and max(len(x.kernels) for x in launchers) >= 2


def test_split_kv_decoding_with_key_padding():
    """One query against 3000 keys with a padding mask: the split-KV kernels (BLOCK_M = 16, one
    16-position statistics entry per query block) skip the padded key blocks; an empty row gives 0."""
    mod = VARIANTS["key_padding"]
    torch.manual_seed(0)
    inputs = [x.cuda() for x in mod.make_inputs(B=3, H=4, M=1, N=3000, D=64, dtype=torch.bfloat16, lengths=[0, 17, 2500])]
    out = torch.compile(mod.attention, backend="flashlight")(*inputs)
    ref = mod.attention(*[to64(x) if x.is_floating_point() else x for x in inputs]).nan_to_num(0)
    assert rel_error(out, ref) < FWD_TOL


@pytest.mark.parametrize("name", ["decode_threshold", "decode_softpick", "decode_top_k"])
def test_split_kv_decoding_of_two_pass_programs(name):
    """Thresholded attention, softpick and top-k (64 of the cache) decoding one query per head
    against 8192 cached keys (GQA 32/8): the heuristic splits the keys (132 SMs, 32 packed
    programs), a split and a combine kernel per pass; softpick's argmax and top-k's candidates
    merged by the first combine. Against float64, and the gradients of the generated backward
    after the split forward."""
    from benchmarks import decode
    from flashlight.runtime import decode as split_kv
    fn = getattr(decode, name.removeprefix("decode_"))
    torch.manual_seed(0)
    q, k, v = [x.cuda().to(torch.bfloat16) for x in decode.make_inputs(B=2, H=32, M=1, N=8192, D=128)]
    q = q * 2       # peaked rows: keys above the threshold
    r = flashlight.explain(fn, q, k, v).regions[0]
    c = REGISTRY[r.key]
    assert "2-pass" in r.features and split_kv.may_split(c.region, q.device)
    out = torch.compile(fn, backend="flashlight")(q, k, v)
    assert c.split and c.split.launches > 0 and len(c.split.kernels) == 2
    ref = fn(*(to64(x) for x in (q, k, v)))
    assert rel_error(out, ref) < FWD_TOL
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = torch.compile(fn, backend="flashlight")(*leaves)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [to64(x).requires_grad_() for x in leaves]
    want = torch.autograd.grad(fn(*ref_leaves), ref_leaves, to64(dout))
    for a, b in zip(got, want):
        assert rel_error(a, b) < GRAD_TOL


@pytest.mark.parametrize("rank", [16, 100])
def test_top_k_attention_bf16(rank):
    """Top-k attention at 1000 keys in bf16 (ranks 16 and 100: 16 and 128 candidates per row):
    the first pass's candidates against eager's topk, and, in training, the dK/dV kernel's
    transposed score tiles compared with the forward's threshold (a flip at the k-th key
    would move its probability). Against float64."""
    from types import SimpleNamespace

    from flashlight.examples import top_k
    torch.manual_seed(0)
    old, top_k.K = top_k.K, rank
    try:
        inputs = [torch.randn(2, 4, n, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
                  for n in (333, 1000, 1000)]
        r = flashlight.explain(top_k.attention, *inputs).regions[0]
        assert "top-k" in r.features and r.backward.startswith("generated"), (r.features, r.backward)
        out = torch.compile(top_k.attention, backend="flashlight")(*inputs)
        dout = torch.randn_like(out)
        check_against_float64(SimpleNamespace(attention=top_k.attention), inputs, out,
                              torch.autograd.grad(out, inputs, dout), dout)
    finally:
        top_k.K = old


GLUON_CASES = [("vanilla", 128, {}), ("causal", 64, {}), ("causal", 128, {}), ("sliding_window", 128, {}),
               ("prefix_lm", 64, {}), ("document_mask", 128, {}), ("alibi", 128, {}), ("softcap", 64, {}),
               ("gqa", 128, {}), ("gated", 64, {}), ("key_padding", 64, {"lengths": [0, 300]}),
               ("merged_heads", 128, {})]


@pytest.mark.parametrize("name,D,kw", GLUON_CASES)
def test_gluon_forward_matches_float64(name, D, kw, monkeypatch):
    """The Hopper Gluon forward (codegen/gluon.py) where the region and layouts qualify: N a
    multiple of its 128-key blocks (M = N = 384: three key blocks per row, masked and mask-free
    ones), a fully padded batch row (key padding: the output is 0 there), GQA's shared heads and
    an epilogue (gated: the backward reads the stored product). Its output against float64 and
    the Triton kernel's, and the generated backward's gradients from its row statistics."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("Gluon kernels are for sm_90")
    monkeypatch.setenv("FLASHLIGHT_GLUON", "all")      # also where the Triton kernel is the default
    monkeypatch.setenv("FLASHLIGHT_GLUON_DKDV", "all")
    monkeypatch.setenv("FLASHLIGHT_GLUON_DQ", "all")
    monkeypatch.setenv("FLASHLIGHT_BACKGROUND", "0")   # the first call runs it
    REGISTRY.clear()        # this case's region alone
    mod = VARIANTS[name]
    torch.manual_seed(0)
    inputs = [x.cuda() for x in mod.make_inputs(B=2, H=4, M=384, D=D, dtype=torch.bfloat16, **kw)]
    leaves = [x.requires_grad_() for x in inputs if x.is_floating_point()]
    fn = torch.compile(mod.attention, backend="flashlight", dynamic=False)
    out = fn(*inputs)
    assert any(c.gfwd.launched for c in REGISTRY.values()), "the Gluon kernel did not run"
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    (c,) = REGISTRY.values()      # the Gluon dK/dV and dQ kernels too, where the region has them
    why = tiles_support(c.region)
    assert c.bwd_kernel.gdkdv.launched == c.bwd_kernel.gdq.launched == (why == ""), why
    ref_in = [to64(x).detach().requires_grad_() if x.is_floating_point() else x for x in inputs]
    ref = mod.attention(*ref_in)
    ref_grads = torch.autograd.grad(ref, [x for x in ref_in if x.is_floating_point()], to64(dout).nan_to_num(0))
    ref = ref.nan_to_num(0)       # a fully masked row: 0, FlexAttention's convention and ours
    assert rel_error(out, ref) < FWD_TOL
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert rel_error(g, r.nan_to_num(0)) < GRAD_TOL, (i, rel_error(g, r))
    monkeypatch.setenv("FLASHLIGHT_GLUON_DKDV", "0")     # the Triton tile kernels on the same row statistics
    monkeypatch.setenv("FLASHLIGHT_GLUON_DQ", "0")
    triton_grads = torch.autograd.grad(fn(*inputs), leaves, dout)
    for i, (g, t) in enumerate(zip(grads, triton_grads)):   # both round P and dS to bf16 alike: tighter
        assert rel_error(g, t.double()) < FWD_TOL, (i, rel_error(g, t.double()))
    monkeypatch.setenv("FLASHLIGHT_GLUON", "0")
    with torch.no_grad():
        triton_out = fn(*inputs)
    assert rel_error(out, triton_out.double()) < FWD_TOL


def test_gluon_forward_ragged_queries_and_fallbacks(monkeypatch):
    """M = 200 queries (the second program's second warpgroup has no rows) through the Gluon
    kernel; a ragged N (300 keys) and BSHD-strided K / V (cross attention) fall back to Triton."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("Gluon kernels are for sm_90")
    monkeypatch.setenv("FLASHLIGHT_GLUON", "all")
    monkeypatch.setenv("FLASHLIGHT_BACKGROUND", "0")
    torch.manual_seed(0)
    q = torch.randn(2, 4, 200, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 4, 256, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mod = VARIANTS["vanilla"]
    REGISTRY.clear()
    with torch.no_grad():
        out = torch.compile(mod.attention, backend="flashlight", dynamic=False)(q, k, v)
    assert rel_error(out, mod.attention(*(to64(x) for x in (q, k, v)))) < FWD_TOL
    assert any(c.gfwd.launched for c in REGISTRY.values())
    for name, kw in (("vanilla", dict(M=300)), ("cross_attention", dict(M=128, N=256))):
        REGISTRY.clear()
        inputs = [x.cuda() for x in VARIANTS[name].make_inputs(B=2, H=4, D=64, dtype=torch.bfloat16, **kw)]
        with torch.no_grad():
            out = torch.compile(VARIANTS[name].attention, backend="flashlight", dynamic=False)(*inputs)
        assert rel_error(out, VARIANTS[name].attention(*(to64(x) for x in inputs))) < FWD_TOL
        assert not any(c.gfwd.launched for c in REGISTRY.values()), name


def test_gluon_compiles_in_the_background(monkeypatch):
    """The default: the first call runs the Triton kernel while the Gluon kernel compiles, the
    first call after ``flashlight.wait()`` runs the Gluon kernel; both match float64."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("Gluon kernels are for sm_90")
    monkeypatch.setenv("FLASHLIGHT_GLUON", "all")
    monkeypatch.delenv("FLASHLIGHT_BACKGROUND", raising=False)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mod = VARIANTS["causal"]
    REGISTRY.clear()
    fn = torch.compile(mod.attention, backend="flashlight", dynamic=False)
    ref = mod.attention(*(to64(x) for x in (q, k, v)))
    with torch.no_grad():
        first = fn(q, k, v)
        (c,) = REGISTRY.values()
        assert not c.gfwd.launched and c.gfwd.future is not None
        flashlight.wait()
        second = fn(q, k, v)
    assert c.gfwd.launched
    assert rel_error(first, ref) < FWD_TOL and rel_error(second, ref) < FWD_TOL


def test_gluon_declines_what_its_copies_cannot_read(monkeypatch):
    """K read as a prefix of a wider tensor (copies of whole rows would overrun the shared
    buffers), a broadcast key (stride 0) and an fp32 Q against bf16 K run the Triton kernel,
    and match float64."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("Gluon kernels are for sm_90")
    monkeypatch.setenv("FLASHLIGHT_GLUON", "all")
    torch.manual_seed(0)
    q, v = (torch.randn(2, 4, 256, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    wide = torch.randn(2, 4, 256, 256, device="cuda", dtype=torch.bfloat16)
    programs = [
        (lambda q, k, v: torch.softmax(q @ k[..., :128].mT * 0.088, -1) @ v, (q, wide, v)),
        (lambda q, k, v: torch.softmax(q @ k.mT * 0.088, -1) @ v, (q, q, v[:, :, :1].expand(2, 4, 256, 128))),
        (lambda q, k, v: torch.softmax(q @ k.to(q.dtype).mT * 0.088, -1).to(v.dtype) @ v, (q.float(), q, v)),
    ]
    for fn, args in programs:
        REGISTRY.clear()
        with torch.no_grad():
            out = torch.compile(fn, backend="flashlight", dynamic=False)(*args)
        assert rel_error(out, fn(*(to64(x) for x in args))) < FWD_TOL
        assert not any(c.gfwd.launched for c in REGISTRY.values())


@pytest.mark.parametrize("name,D,M,N", [("causal", 128, 1024, 1024), ("vanilla", 64, 512, 1024),
                                        ("prefix_lm", 128, 640, 640), ("causal", 128, 200, 256),
                                        ("causal", 128, 256, 320)])
def test_gluon_tile_kernels_long_loops_and_fallbacks(name, D, M, N, monkeypatch):
    """The Gluon dK/dV and dQ kernels over many blocks (16 query blocks per dK/dV program: the
    ring's phases wrap eight times), fewer queries than keys (cross lengths), and sizes that are
    not whole blocks of one of them and keep its Triton kernel (200 queries: neither; 320 keys:
    whole 64-key blocks for dQ, not 128-key ones for dK/dV); gradients against float64."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("Gluon kernels are for sm_90")
    monkeypatch.setenv("FLASHLIGHT_GLUON", "all")
    monkeypatch.setenv("FLASHLIGHT_GLUON_DKDV", "all")
    monkeypatch.setenv("FLASHLIGHT_GLUON_DQ", "all")
    monkeypatch.setenv("FLASHLIGHT_BACKGROUND", "0")
    mod = VARIANTS[name]
    REGISTRY.clear()        # this case's region alone
    torch.manual_seed(0)
    q = torch.randn(1, 2, M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    fn = torch.compile(mod.attention, backend="flashlight", dynamic=False)
    out = fn(q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    (c,) = REGISTRY.values()
    assert c.bwd_kernel.gdkdv.launched == (M % 64 == 0 and N % 128 == 0)
    assert c.bwd_kernel.gdq.launched == (M % 128 == 0 and N % 64 == 0)
    ref_in = [to64(x).detach().requires_grad_() for x in (q, k, v)]
    ref = mod.attention(*ref_in)
    ref_grads = torch.autograd.grad(ref, ref_in, to64(dout))
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert rel_error(g, r) < GRAD_TOL, (i, rel_error(g, r))


@pytest.mark.parametrize("tiles", ["all", "0"])
@pytest.mark.parametrize("fn,B,H,Hkv,D,N", [(VARIANTS["gqa"].attention, 2, 8, 2, 128, 512),
                                            (causal_gqa, 1, 8, 1, 64, 640)], ids=["gqa", "causal-mqa"])
def test_the_dkdv_group_loop(fn, B, H, Hkv, D, N, tiles, monkeypatch):
    """``FLASHLIGHT_GROUP_LOOP=1``: a dK/dV program visits the query heads sharing its K/V head
    (GQA: 4; causal MQA: 8) and stores dK and dV once, in the Gluon tile kernel ("all") and the
    Triton one ("0"); bf16 gradients against float64."""
    from flashlight.codegen.gradients import Group
    if tiles == "all" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("Gluon kernels are for sm_90")
    monkeypatch.setenv("FLASHLIGHT_GROUP_LOOP", "1")
    monkeypatch.setenv("FLASHLIGHT_GLUON_DKDV", tiles)
    monkeypatch.setenv("FLASHLIGHT_BACKGROUND", "0")
    REGISTRY.clear()
    torch.manual_seed(0)
    q = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = torch.compile(fn, backend="flashlight", dynamic=False)(q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    (c,) = REGISTRY.values()
    assert c.bwd_kernel.plan.group == Group(1, H // Hkv)
    assert c.bwd_kernel.gdkdv.launched == (tiles == "all")
    ref_in = [to64(x).detach().requires_grad_() for x in (q, k, v)]
    ref_grads = torch.autograd.grad(fn(*ref_in), ref_in, to64(dout))
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert rel_error(g, r) < GRAD_TOL, (i, rel_error(g, r))
    REGISTRY.clear()


@pytest.mark.parametrize("name,D", [("causal", 128), ("document_mask", 64)])
def test_quick_start_then_the_regions_own_kernel(name, D, monkeypatch):
    """A masked region's first call runs the dense kernel (runtime.op.QuickStart) while its own
    compiles on a background thread (Triton's warmup and the launcher); after ``flashlight.wait()``
    the own kernel serves. Outputs against float64 both times; gradients from the dense kernel's
    row statistics."""
    from flashlight.runtime import op
    monkeypatch.setenv("FLASHLIGHT_GLUON", "0")     # the Triton kernels only
    op.OWN_COMPILED.clear()
    REGISTRY.clear()
    inputs = _inputs(name, B=2, H=4, M=384, D=D, dtype=torch.bfloat16)
    leaves = [x.requires_grad_() for x in inputs if x.is_floating_point()]
    fn = torch.compile(VARIANTS[name].attention, backend="flashlight", dynamic=False)
    ref_in = [to64(x).detach().requires_grad_() if x.is_floating_point() else x for x in inputs]
    ref = VARIANTS[name].attention(*ref_in).nan_to_num(0)
    out = fn(*inputs)
    (c,) = REGISTRY.values()
    assert isinstance(c.quick, op.QuickStart)
    assert rel_error(out, ref) < FWD_TOL
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_grads = torch.autograd.grad(VARIANTS[name].attention(*ref_in), [x for x in ref_in if x.is_floating_point()],
                                    to64(dout))
    for g, r in zip(grads, ref_grads):
        assert rel_error(g, r.nan_to_num(0)) < GRAD_TOL
    flashlight.wait()
    with torch.no_grad():
        out = fn(*inputs)
    assert c.quick is False and c.name in {name for name, _ in op.OWN_COMPILED}
    assert rel_error(out, ref) < FWD_TOL


def test_the_backward_compiles_from_the_first_forward(monkeypatch):
    """The first differentiable forward starts the three backward kernels' compiles on background
    threads (``CompiledRegion.prefetch_backward``); they succeed, and the backward's gradients
    match float64."""
    monkeypatch.setenv("FLASHLIGHT_GLUON", "0")
    REGISTRY.clear()
    inputs = _inputs("causal", B=2, H=4, M=384, D=64, dtype=torch.bfloat16)
    leaves = [x.requires_grad_() for x in inputs]
    fn = torch.compile(VARIANTS["causal"].attention, backend="flashlight", dynamic=False)
    out = fn(*inputs)
    (c,) = REGISTRY.values()
    futures = list(c.bwd_prefetch.values())
    assert len(futures) == 3 and all(f.exception() is None for f in futures)
    k = c.bwd_kernel

    def compiled(name):     # kernels in Triton's in-memory cache of that JIT function, this device
        fn = getattr(k, name)
        fn = fn.fn if isinstance(fn, FastLaunch) else fn
        return len(fn.device_caches[torch.cuda.current_device()][0])
    before = {name: compiled(name) for name in ("rows", "dkdv", "dq")}
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    assert {name: compiled(name) for name in before} == before, "a launch compiled again"
    ref_in = [to64(x).detach().requires_grad_() for x in inputs]
    refs = torch.autograd.grad(VARIANTS["causal"].attention(*ref_in), ref_in, to64(dout))
    for g, r in zip(grads, refs):
        assert rel_error(g, r) < GRAD_TOL


@pytest.mark.parametrize("name", ["causal", "document_mask"])
def test_reduce_overhead_replays_the_regions_in_cuda_graphs(name):
    """``mode="reduce-overhead"``: Inductor's CUDA graph trees record the regions' launches
    (forward and backward) and replay them. After the warm-up steps, a training step on new
    inputs launches nothing from Python (the regions' launch counters stand still) and matches
    float64."""
    mod = VARIANTS[name]
    torch.compiler.reset()
    fn = torch.compile(mod.attention, backend="flashlight", mode="reduce-overhead")

    def step(seed):
        torch.manual_seed(seed)
        inputs = [x.cuda().to(torch.bfloat16).requires_grad_() if x.is_floating_point() else x.cuda()
                  for x in mod.make_inputs(B=2, H=4, M=333, D=64)]
        leaves = [x for x in inputs if x.is_floating_point()]
        out = fn(*inputs)
        dout = torch.randn_like(out)
        return inputs, out.clone(), [g.clone() for g in torch.autograd.grad(out, leaves, dout)], dout

    def launches():
        return sum(c.launches + c.bwd_launches for c in REGISTRY.values())
    for seed in range(3):
        step(seed)
    before = launches()
    inputs, out, grads, dout = step(10)
    assert launches() == before
    check_against_float64(mod, inputs, out, grads, dout)


@pytest.mark.parametrize("name", ["causal", "document_mask"])
def test_autocast_bf16_from_float32_inputs(name):
    """Float32 q, k, v under a bfloat16 autocast: the region returns bfloat16 as eager does, and
    output and float32 gradients are as close to float64 as a bf16 computation gets."""
    mod = VARIANTS[name]
    inputs = _inputs(name, B=2, H=4, M=333, D=64)
    leaves = [x.requires_grad_() for x in inputs if x.is_floating_point()]
    with torch.autocast("cuda", torch.bfloat16):
        out = torch.compile(mod.attention, backend="flashlight")(*inputs)
        want = mod.attention(*inputs)
    assert out.dtype == want.dtype == torch.bfloat16
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    assert all(g.dtype == torch.float32 for g in grads)
    check_against_float64(mod, inputs, out, grads, dout)
