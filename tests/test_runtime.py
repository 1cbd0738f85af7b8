"""Runtime: autograd through the fused op, fp64 gradcheck, call-time errors, kernel cache,
and isolation from programs compiled with the default backend."""
import math
from types import SimpleNamespace

import pytest
import torch

import flashlight
from flashlight.examples import alibi, causal, document_mask, key_padding, vanilla
from flashlight.runtime.cache import load_module
from flashlight.testing import rel_error, to64


def test_gradient_into_learnable_bias_read_twice():
    q, k, v = (torch.randn(1, 2, 13, 16) for _ in range(3))
    bias = torch.randn(2, 13, 13, requires_grad=True)

    def attn(q, k, v, b):
        return torch.softmax(q @ k.mT * 0.25 + b + b.tanh(), -1) @ v
    torch.compile(attn, backend="flashlight")(q, k, v, bias).square().sum().backward()
    b64 = bias.detach().double().requires_grad_()
    attn(q.double(), k.double(), v.double(), b64).square().sum().backward()
    assert rel_error(bias.grad, b64.grad) < 1e-3


@pytest.mark.parametrize("mod", [causal, alibi, document_mask], ids=lambda m: m.__name__.rsplit(".")[-1])
def test_gradcheck_fp64(mod):
    inputs = mod.make_inputs(B=1, H=1, M=6, D=4, dtype=torch.float64)
    inputs = [x.requires_grad_() if x.is_floating_point() else x for x in inputs]
    fast = torch.compile(mod.attention, backend="flashlight")
    assert torch.autograd.gradcheck(lambda *xs: fast(*xs), inputs)


def test_mismatched_head_dims_raise_like_eager():
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 12), torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError):
        causal.attention(q, k, v)
    with pytest.raises(RuntimeError):
        torch.compile(causal.attention, backend="flashlight")(q, k, v)


def test_corrupt_cache_file_is_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHLIGHT_CACHE_DIR", str(tmp_path))
    src = "VALUE = 42\n"
    (tmp_path / "fl_test_mod.py").write_text("this is not python(")
    mod, path = load_module("fl_test_mod", src)
    assert mod.VALUE == 42 and path.read_text() == src


def test_second_compile_reuses_kernel_file():
    inputs = causal.make_inputs(B=1, H=2, M=20, D=16)
    r1 = flashlight.explain(causal.attention, *inputs).regions[0]
    torch.compiler.reset()
    r2 = flashlight.explain(causal.attention, *inputs).regions[0]
    assert r1.kernel == r2.kernel and r1.path == r2.path


def test_default_backend_is_untouched():
    """Compiling with flashlight must not change what the default backend does."""
    inputs = causal.make_inputs(B=1, H=2, M=20, D=16)
    before = torch.compile(causal.attention)(*inputs)
    torch.compile(causal.attention, backend="flashlight")(*inputs)
    torch.compiler.reset()
    after_fn = torch.compile(causal.attention)
    after = after_fn(*inputs)
    assert torch.equal(before, after)
    report = flashlight.explain(causal.attention, *inputs)
    assert report.regions     # and flashlight still fuses in the same process


def test_backend_registered_by_name():
    from torch._dynamo import list_backends
    assert "flashlight" in list_backends(exclude_tags=())


def test_gradients_of_bshd_views_keep_their_layout():
    """Found by the fuzzer: gradients must come back in the layout the fake impl promises."""
    q, k, v = (torch.randn(2, L, 2, 16).transpose(1, 2).requires_grad_() for L in (9, 11, 11))
    out = torch.compile(causal.attention, backend="flashlight")(q, k, v)
    grads = torch.autograd.grad(out.sum(), [q, k, v])
    ref = torch.autograd.grad(causal.attention(q, k, v).sum(), [q, k, v])
    for a, b in zip(grads, ref):
        assert rel_error(a, b) < 1e-3


def test_tuning_cache_round_trip_and_corruption(tmp_path):
    from flashlight.tune import Config, TuningCache
    cache = TuningCache(tmp_path, "fl_fwd_x")
    key = TuningCache.key((4096, 4096, 64), "NVIDIA H200")
    cache.store(key, Config(128, 64, 8, 3))
    assert TuningCache(tmp_path, "fl_fwd_x").load() == {key: Config(128, 64, 8, 3)}
    cache.path.write_text("{not json")
    assert TuningCache(tmp_path, "fl_fwd_x").load() == {}
    cache.store(key, Config(64, 64, 4, 3))        # a corrupt file is replaced
    assert TuningCache(tmp_path, "fl_fwd_x").load()[key] == Config(64, 64, 4, 3)


def test_gpu_tuning_path_uses_and_fills_the_disk_cache(tmp_path, monkeypatch):
    """The CUDA branch of config(), driven on CPU. By default: the heuristic, nothing timed.
    With max-autotune: tune once; a fresh object (a second process) reads the winner from disk
    without timing anything, in either mode."""
    from flashlight.runtime import op
    from flashlight.tune import Config, heuristic
    monkeypatch.setenv("FLASHLIGHT_CACHE_DIR", str(tmp_path))
    r = flashlight.explain(causal.attention, *causal.make_inputs(B=1, H=1, M=20, D=16)).regions[0]
    c = op.REGISTRY[r.key]

    def fresh(max_autotune):
        return op.CompiledRegion(c.region, c.source, c.name, tmp_path / f"{c.name}.py", c.kernel, c.stats,
                                 max_autotune=max_autotune)
    two = [Config(32, 16, 4, 2), Config(16, 16, 4, 2)]
    monkeypatch.setattr(op, "candidates", lambda *a, **k: two)
    monkeypatch.setattr(op, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "FakeGPU")
    timed = []
    monkeypatch.setattr(op.CompiledRegion, "autotune", lambda self, launch, cfgs, default: timed.append(1) or cfgs[1])
    inputs = [SimpleNamespace(device=torch.device("cuda"))]    # config() only asks where inputs live
    assert fresh(False).config(inputs) == heuristic(16, 1, False) and timed == []
    assert fresh(True).config(inputs) == two[1] and timed == [1]
    assert fresh(True).config(inputs) == two[1] and timed == [1]
    assert fresh(False).config(inputs) == two[1] and timed == [1]


def test_backward_defaults_follow_the_mask_and_the_score_tiles():
    """The backward kernels' default configs (``tune.backward_heuristic``) see what the region
    is: a mask that reads loaded values at the query position (document ids: short runs of live
    key blocks) gets the dQ config measured for it; an index-only mask (causal) and a key
    padding mask (loaded, but at the key position only) do not; two score tiles at D=128
    (DiffAttn) get their own dK/dV config; a score program of many loads (IPA's 26) gets the
    small tiles of both kernels, Evoformer's two loads do not."""
    from flashlight.examples import VARIANTS
    from flashlight.runtime import op
    from flashlight.tune import Config

    def defaults(name, D):
        mod = VARIANTS[name]
        r = flashlight.explain(mod.attention, *mod.make_inputs(B=1, H=2, M=40, D=D)).regions[0]
        c = op.REGISTRY[r.key]
        return c.default_config("dkdv"), c.default_config("dq")
    doc, causal_, diff = defaults("document_mask", 128), defaults("causal", 128), defaults("diff_attention", 128)
    assert doc[1] == Config(64, 32, 4, 4) != causal_[1]
    assert diff[0] == Config(16, 64, 4, 4) != causal_[0] == doc[0]
    assert defaults("document_mask", 64)[1] == Config(64, 32, 4, 4) != defaults("causal", 64)[1]
    assert defaults("sdpa_document", 128)[1] == doc[1] != defaults("key_padding", 128)[1]
    assert defaults("ipa", 64) == (Config(16, 64, 4, 4), Config(64, 32, 4, 2)) != defaults("evoformer", 64)
    # fewer query rows than a tile holds: tiles of the rows there are (16 at least)
    few = lambda M: tuple(op.REGISTRY[flashlight.explain(causal.attention, *causal.make_inputs(     # noqa: E731
        B=1, H=2, M=M, D=128)).regions[0].key].default_config(k) for k in ("dkdv", "dq"))
    assert [c.BLOCK_M for c in few(5)] == [16, 16] and [c.BLOCK_M for c in few(20)] == [32, 32]
    from flashlight.tune import fit_rows
    assert few(5)[1].num_warps == 4 and fit_rows(Config(128, 64, 8, 3), 300) == Config(128, 64, 8, 3)


def test_max_autotune_mode_reaches_the_compiled_region():
    from flashlight._compat import mode_options
    from flashlight.backend import wants_autotune
    from flashlight.runtime import op

    def wants(mode, options):
        return wants_autotune(mode_options(mode, options))
    assert wants("max-autotune-no-cudagraphs", None) and wants(None, {"max_autotune": True})
    assert not wants(None, None) and not wants("reduce-overhead", {})
    xs = causal.make_inputs(B=1, H=1, M=20, D=16)
    torch.compile(causal.attention, backend="flashlight", mode="max-autotune")(*xs)
    assert any(c.max_autotune and c.region.M == 20 for c in op.REGISTRY.values())


def test_dynamic_shapes_fuse_per_length_with_one_kernel():
    """dynamic=True (or Dynamo's automatic dynamic shapes after a second length): every length
    still fuses, and all lengths share one generated kernel."""
    from flashlight.runtime import op
    fast = torch.compile(causal.attention, backend="flashlight", dynamic=True)
    names = set()
    for n in (19, 33, 50):
        inputs = causal.make_inputs(B=1, H=2, M=n, D=16)
        before = {k: c.launches for k, c in op.REGISTRY.items()}
        out = fast(*inputs)
        assert rel_error(out, causal.attention(*(to64(x) for x in inputs))) < 1e-3
        launched = [c for k, c in op.REGISTRY.items() if c.launches > before.get(k, 0)]
        assert len(launched) == 1
        names.add(launched[0].name)
    assert len(names) == 1


def test_automatic_dynamic_after_second_length_keeps_fusing():
    from flashlight.runtime import op
    fast = torch.compile(causal.attention, backend="flashlight")
    for n in (17, 29, 41):
        inputs = causal.make_inputs(B=1, H=1, M=n, D=16)
        total = sum(c.launches for c in op.REGISTRY.values())
        assert rel_error(fast(*inputs), causal.attention(*(to64(x) for x in inputs))) < 1e-3
        assert sum(c.launches for c in op.REGISTRY.values()) == total + 1


def test_dynamic_shapes_training():
    fast = torch.compile(alibi.attention, backend="flashlight", dynamic=True)
    for n in (13, 22):
        inputs = [x.requires_grad_() for x in alibi.make_inputs(B=1, H=2, M=n, D=16)]
        grads = torch.autograd.grad(fast(*inputs).square().sum(), inputs)
        ref_in = [to64(x).detach().requires_grad_() for x in inputs]
        ref = torch.autograd.grad(alibi.attention(*ref_in).square().sum(), ref_in)
        assert all(rel_error(a, b) < 1e-3 for a, b in zip(grads, ref))


def test_dynamic_graph_without_attention_compiles_once(monkeypatch):
    from flashlight import _compat
    calls = []
    real = _compat.compile_fx
    monkeypatch.setattr(_compat, "compile_fx", lambda gm, ex, *rest: calls.append(1) or real(gm, ex, *rest))

    def mlp(x, w):
        return torch.relu(x @ w).sum(-1)
    fast = torch.compile(mlp, backend="flashlight", dynamic=True)
    w = torch.randn(16, 8)
    for n in (5, 9, 13):
        x = torch.randn(n, 16)
        assert torch.allclose(fast(x, w), mlp(x, w), atol=1e-5)
    assert len(calls) == 1


def test_internal_error_falls_back_with_reason(monkeypatch):
    from flashlight import backend
    monkeypatch.delenv("FLASHLIGHT_STRICT")
    monkeypatch.setattr(backend, "find_regions", lambda graph: 1 / 0)
    inputs = causal.make_inputs(B=1, H=1, M=9, D=16)
    report = flashlight.explain(causal.attention, *inputs)
    assert not report.regions and "internal error" in report.fallbacks[0].reason
    out = torch.compile(causal.attention, backend="flashlight")(*inputs)
    assert rel_error(out, causal.attention(*(to64(x) for x in inputs))) < 1e-5


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
def test_compile_mode_reaches_inductor(monkeypatch, mode):
    """``torch.compile(mode=...)`` gives Inductor the options it gives without Flashlight
    (``torch._inductor.list_mode_options``; before, Inductor compiled the rest with defaults).
    A graph of regions alone still runs as is on CPU inputs; with CUDA inputs under CUDA graphs
    ("reduce-overhead", "max-autotune") it goes to Inductor, whose CUDA graph trees replay the
    regions' launches (``backend.graphed``; on the GPU: ``test_gpu``). An option Inductor does
    not know raises its error. Outputs stay exact."""
    from unittest import mock

    from torch._inductor import list_mode_options

    from flashlight import _compat, backend
    patches = []
    real = _compat.compile_fx
    monkeypatch.setattr(_compat, "compile_fx", lambda gm, ex, p=None: patches.append(p) or real(gm, ex, p))
    q, k, v = causal.make_inputs(B=1, H=2, M=20, D=16)
    w = torch.randn(16, 16) / 4

    def projected(q, k, v, w):
        return causal.attention(q @ w, k, v)
    for fn, args, compiled in ((projected, (q, k, v, w), [list_mode_options(mode)]), (causal.attention, (q, k, v), [])):
        torch.compiler.reset()
        patches.clear()
        out = torch.compile(fn, backend="flashlight", mode=mode)(*args)
        assert rel_error(out, fn(*(to64(x) for x in args))) < 1e-5
        assert patches == compiled, fn
    cuda = mock.Mock(spec=torch.Tensor, is_cuda=True)
    assert backend.graphed([cuda], list_mode_options(mode)) == (mode == "reduce-overhead")
    assert not backend.graphed([q], list_mode_options(mode))
    torch.compiler.reset()
    with pytest.raises(Exception, match="Unexpected optimization option"):
        torch.compile(projected, backend="flashlight", options={"no_such_option": 1})(q, k, v, w)


def test_graph_of_only_regions_and_views_skips_inductor(monkeypatch):
    """A function that is just attention runs as the traced FX module (no Inductor compile, no
    wrapper); one with other compute (a projection) still goes to Inductor. Both stay exact."""
    from flashlight import _compat
    calls = []
    real = _compat.compile_fx
    monkeypatch.setattr(_compat, "compile_fx", lambda *a: calls.append(1) or real(*a))
    q, k, v = causal.make_inputs(B=1, H=2, M=20, D=16)
    bshd = [x.transpose(1, 2).contiguous() for x in (q, k, v)]

    def attention_bshd(q, k, v):          # layout changes around the region are views
        return causal.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    out = torch.compile(attention_bshd, backend="flashlight")(*bshd)
    assert calls == [] and rel_error(out, attention_bshd(*map(to64, bshd))) < 1e-3
    w = torch.randn(16, 16)
    out = torch.compile(lambda q, k, v: causal.attention(q @ w, k, v), backend="flashlight")(q, k, v)
    assert calls == [1] and rel_error(out, causal.attention(to64(q) @ to64(w), to64(k), to64(v))) < 1e-3


@pytest.mark.parametrize("path", ["as is", "inductor"])
def test_a_region_no_gradient_reaches_takes_the_inference_op(monkeypatch, path):
    """In a training graph, a region under the program's own ``torch.no_grad()`` (a frozen
    teacher) and one whose inputs need no gradient take ``flashlight::region_infer``: no row
    statistics kept, no backward compiles started (``FLASHLIGHT_PREFETCH=force``: only the
    trained region's three are). The trained region keeps the differentiable op; gradients
    match float64."""
    from flashlight import _compat
    from flashlight.runtime import op
    monkeypatch.setenv("FLASHLIGHT_PREFETCH", "force")
    op.REGISTRY.clear()
    torch.compiler.reset()
    warmed = []
    monkeypatch.setattr(_compat, "warm", lambda fn, grid, args, meta: warmed.append(fn))
    g = torch.Generator().manual_seed(3)
    q, k, v = (x.requires_grad_() for x in causal.make_inputs(B=1, H=2, M=40, D=16))
    qt, kt, vt = alibi.make_inputs(B=1, H=2, M=40, D=16)[:3]      # a frozen teacher's: no grad
    w = torch.randn(16, 16, generator=g) / 4

    def step(q, k, v, qt, kt, vt):
        with torch.no_grad():
            teacher = alibi.attention(qt, kt, q)            # q requires grad, but not under no_grad
        frozen = alibi.attention(kt, qt, vt)                # no input requires grad
        student = causal.attention(q, k, v)
        if path == "inductor":
            student = student @ w.to(q.dtype)
        return student + teacher + frozen

    report = flashlight.explain(step, q, k, v, qt, kt, vt)
    ops = [n.target for gr in report.graphs for n in gr.graph.nodes if getattr(n.target, "namespace", "") == "flashlight"]
    # as is, the frozen attention joins the student's region through the sum (a second score
    # program whose inputs need no gradient); the teacher's, under no_grad, is loaded by it
    infer = 1 if path == "as is" else 2
    assert sorted(str(t) for t in ops) == ["flashlight.region.default"] + ["flashlight.region_infer.default"] * infer
    op.REGISTRY.clear()
    torch.compiler.reset()
    warmed.clear()
    out = torch.compile(step, backend="flashlight")(q, k, v, qt, kt, vt)
    flashlight.wait()
    assert len(warmed) == 3         # rows, dK/dV, dQ: the trained region's alone
    dout = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, [q, k, v], dout)
    leaves = [to64(x).detach().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(step(*leaves, *map(to64, (qt, kt, vt))), leaves, to64(dout))
    for a, b in zip(got, want):
        assert rel_error(a, b) < 1e-3


def test_training_graph_that_runs_as_is_calls_the_autograd_function():
    """A differentiable graph of only regions and views calls ``RegionFunction`` (no dispatcher);
    one with other compute keeps the custom op for Inductor. Both give float64's gradients and
    run the generated backward."""
    import operator

    from flashlight.runtime.op import REGISTRY, region_train_direct
    q, k, v, ids = document_mask.make_inputs(B=1, H=2, M=37, D=16)
    w = torch.randn(16, 16)
    programs = {"as is": (document_mask.attention, lambda q, k, v: document_mask.attention(q, k, v, ids)),
                "inductor": (lambda q, k, v, ids: document_mask.attention(q @ w, k, v, ids),
                             lambda q, k, v: document_mask.attention(q @ to64(w), k, v, ids))}
    for name, (fn, ref_fn) in programs.items():
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        report = flashlight.explain(fn, *leaves, ids)
        targets = {n.target for g in report.graphs for n in g.graph.nodes
                   if n.op == "call_function" and n.target is not operator.getitem}
        before = sum(c.bwd_launches for c in REGISTRY.values())
        torch._dynamo.reset()
        got = torch.autograd.grad(torch.compile(fn, backend="flashlight")(*leaves, ids), leaves, torch.ones(1, 2, 37, 16))
        ref64 = [to64(x).requires_grad_() for x in (q, k, v)]
        ref = torch.autograd.grad(ref_fn(*ref64), ref64, torch.ones(1, 2, 37, 16, dtype=torch.float64))
        assert max(rel_error(a, b) for a, b in zip(got, ref)) < 1e-3, name
        assert sum(c.bwd_launches for c in REGISTRY.values()) > before, name
        op = torch.ops.flashlight.region.default
        assert (region_train_direct in targets, op in targets) == ((True, False) if name == "as is" else (False, True))


@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
def test_a_config_that_does_not_fit_falls_back_to_a_smaller_one_for_good(kernel):
    """A default config can exceed shared memory for a heavy kernel (OutOfResources at its first
    compile): the next smaller config of the ladder runs, and is kept for that size and kernel
    (the backward's two tile kernels shrink independently)."""
    from triton.runtime.errors import OutOfResources

    from flashlight.runtime import op
    from flashlight.tune import Config, bucket
    r = flashlight.explain(causal.attention, *causal.make_inputs(B=1, H=1, M=20, D=16)).regions[0]
    c = op.REGISTRY[r.key]
    key = bucket(c.region.M, c.region.N, 1)
    key = key if kernel == "fwd" else (kernel, *key)
    c.tuned[key] = Config(128, 128, 8, 3)
    tried = []

    def launch(cfg):
        tried.append(cfg)
        if cfg.BLOCK_M * cfg.BLOCK_N * cfg.num_stages > 64 * 64 * 2:
            raise OutOfResources(295424, 232448, "shared memory")
        return "ran"
    try:
        assert c.fitting([], launch, kernel) == "ran"
        assert c.tuned[key] == Config(64, 64, 4, 2) == tried[-1] and len(tried) == 5
    finally:
        del c.tuned[key]


def test_graphs_without_gradients_store_no_row_statistics(monkeypatch):
    """A graph compiled without grad (no input requires it, or under no_grad) calls the inference
    op, whose kernel skips the row-statistics stores; a training graph keeps them."""
    from flashlight.runtime import op as rt
    seen = []
    launch = rt.CompiledRegion.launch

    def spy(self, inputs, cfg, stats=True, block_stats=None):
        seen.append(stats)
        return launch(self, inputs, cfg, stats, block_stats)
    monkeypatch.setattr(rt.CompiledRegion, "launch", spy)
    q, k, v = (torch.randn(1, 2, 37, 16) for _ in range(3))
    ref = causal.attention(*(x.double() for x in (q, k, v)))
    torch._dynamo.reset()
    out = torch.compile(causal.attention, backend="flashlight")(q, k, v)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    torch._dynamo.reset()
    with torch.no_grad():
        out_ng = torch.compile(causal.attention, backend="flashlight")(*leaves)
    torch._dynamo.reset()
    out_tr = torch.compile(causal.attention, backend="flashlight")(*leaves)
    out_tr.sum().backward()
    assert seen == [False, False, True]
    assert max(rel_error(o, ref) for o in (out, out_ng, out_tr)) < 1e-3
    assert leaves[0].grad is not None and leaves[0].grad.abs().sum() > 0
    report = flashlight.explain(causal.attention, q, k, v)
    assert "if STATS:" in report.regions[0].kernel_source


def test_enable_grad_inside_a_no_grad_compile():
    """A graph compiled under no_grad that turns grad back on inside needs the differentiable op
    (the backend reads grad mode at compile time; the graph's own switch overrides it)."""
    def f(q, k, v):
        with torch.enable_grad():
            return torch.softmax((q * 1.0) @ k.mT * 0.25, -1) @ v
    q, k, v = (torch.randn(2, 32, 16) for _ in range(3))
    q.requires_grad_(True)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(f, backend="flashlight")(q, k, v)
    assert out.requires_grad
    out.sum().backward()
    q64 = q.detach().double().requires_grad_()
    f(q64, k.double(), v.double()).sum().backward()
    assert rel_error(q.grad, q64.grad) < 1e-3


class _Kernel:
    """A CompiledKernel's launch surface (``run``, ``function``, ``packed_metadata``)."""

    def __init__(self, key):
        self.key, self.function, self.packed_metadata, self.launches = key, object(), object(), []

    def run(self, *args):
        self.launches.append(args)


class _JitFn:
    """A @triton.jit function's launch surface: ``fn[grid](*args, **meta)`` compiles (counts) and
    returns the CompiledKernel, which it also launches."""
    arg_names = ["x_ptr", "x_s0", "n", "BLOCK"]

    def __init__(self):
        self.compiled = []

    def __getitem__(self, grid):
        def run(*args, **meta):
            kernel = _Kernel((args, tuple(meta.items())))
            self.compiled.append(kernel)
            kernel.run(*grid, *args)
            return kernel
        return run


def test_fast_launch_reuses_a_kernel_only_for_the_same_specialisation():
    """The second launch with the same constexprs, scalars, dtypes and pointer alignment calls
    the compiled kernel's launcher (grid, stream, then every argument with the constexprs last);
    a different scalar, dtype, alignment (a view 2 bytes in), constexpr or current device goes
    through Triton."""
    from flashlight._compat import FastLaunch

    fn, device = _JitFn(), [0]
    k = FastLaunch(fn, current=(lambda: device[0], lambda dev: f"stream{dev}"))
    x = torch.zeros(64, dtype=torch.bfloat16)
    k[(3, 2)](x, 1, 64, BLOCK=16, num_warps=4)
    k[(3, 2)](x, 1, 64, BLOCK=16, num_warps=4)
    assert len(fn.compiled) == 1 and len(fn.compiled[0].launches) == 2
    grid_x, grid_y, grid_z, stream, _, _, *rest = fn.compiled[0].launches[1]
    assert (grid_x, grid_y, grid_z, stream) == (3, 2, 1, "stream0")
    assert rest[:3] == [None, None, None] and rest[3:] == [x, 1, 64, 16]
    k[(3, 2)](torch.zeros(64, dtype=torch.bfloat16), 1, 64, BLOCK=16, num_warps=4)   # another aligned tensor
    assert len(fn.compiled) == 1
    for args, meta in [((x, 1, 48), dict(BLOCK=16, num_warps=4)), ((x.float(), 1, 64), dict(BLOCK=16, num_warps=4)),
                       ((x[1:], 1, 64), dict(BLOCK=16, num_warps=4)), ((x, 1, 64), dict(BLOCK=32, num_warps=4)),
                       ((x, 1, 64), dict(BLOCK=16, num_warps=8))]:
        before = len(fn.compiled)
        k[(3, 2)](*args, **meta)
        assert len(fn.compiled) == before + 1, (args, meta)
    device[0] = 1               # another current device: Triton's caches are per device, so is ours
    k[(3, 2)](x, 1, 64, BLOCK=16, num_warps=4)
    k[(3, 2)](x, 1, 64, BLOCK=16, num_warps=4)
    assert fn.compiled[-1].launches[-1][3] == "stream1" and len(fn.compiled[-1].launches) == 2
    before = len(fn.compiled)
    for _ in range(2):          # not the argument kinds of the first launch: every call goes to Triton
        k[(3, 2)](7, 1, 64, BLOCK=16, num_warps=4)
        k[(3, 2)](x, x, 64, BLOCK=16, num_warps=4)
    assert len(fn.compiled) == before + 4
    for scalar in (True, 1.0):  # hash like 1, typed apart by Triton (u1, fp32)
        k[(3, 2)](x, scalar, 64, BLOCK=16, num_warps=8)
    assert len(fn.compiled) == before + 6


class _Descriptor:
    """A host tensor descriptor's surface (Triton's and Gluon's ``TensorDescriptor``)."""

    def __init__(self, base, block_shape, layout, rows=None):
        self.base, self.block_shape, self.layout, self.padding = base, block_shape, layout, "zero"
        self.shape, self.strides = [rows or base.shape[0], base.shape[1]], [base.stride(0), 1]


def test_fast_launch_passes_each_calls_own_descriptors():
    """Gluon kernels take host tensor descriptors as keyword arguments, new objects every call:
    they key the launch by what they hold but the address (dtype, alignment, shape, strides,
    block shape, the layout object), and the launcher gets the current call's descriptors, in
    signature order, with the constexprs — never the first call's (its base would be stale)."""
    from flashlight._compat import FastLaunch

    class Fn(_JitFn):
        arg_names = ["x_ptr", "n", "k_desc", "BLOCK", "v_desc"]
    fn, layout = Fn(), object()
    k = FastLaunch(fn, current=(lambda: 0, lambda dev: "stream"))
    x = torch.zeros(64, dtype=torch.bfloat16)

    def launch(kd, vd, n=64, block=16):
        k[(2,)](x, n, k_desc=kd, BLOCK=block, v_desc=vd, num_warps=4)
    a, b = torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(128, 64, dtype=torch.bfloat16)
    launch(_Descriptor(a, [64, 64], layout), _Descriptor(b, [64, 64], layout))
    kd, vd = _Descriptor(b, [64, 64], layout), _Descriptor(a, [64, 64], layout)   # other tensors, same layouts
    launch(kd, vd)
    assert len(fn.compiled) == 1 and len(fn.compiled[0].launches) == 2
    _, _, _, _, _, _, *rest = fn.compiled[0].launches[1]
    assert rest[:3] == [None, None, None] and len(rest) == 8
    assert rest[3] is x and rest[4] == 64 and rest[5] is kd and rest[6] == 16 and rest[7] is vd
    c = torch.zeros(256, 64, dtype=torch.bfloat16)
    for changed in [(_Descriptor(a, [128, 64], layout), vd),              # block shape
                    (_Descriptor(c[::2], [64, 64], layout), vd),          # strides
                    (_Descriptor(a, [64, 64], layout, rows=64), vd),      # shape
                    (_Descriptor(a.float(), [64, 64], layout), vd),       # dtype
                    (_Descriptor(a, [64, 64], object()), vd)]:            # another layout object
        before = len(fn.compiled)
        launch(*changed)
        assert len(fn.compiled) == before + 1, changed
    before = len(fn.compiled)
    launch(kd, vd, block=32)                # a constexpr still keys it
    launch(kd, vd)
    assert len(fn.compiled) == before + 1


def test_fast_launch_prebuilds_the_launcher_once_before_the_first_compile(monkeypatch):
    """The first launch hands its arguments to ``prebuild_launcher`` (gcc builds Triton's
    launcher on a thread while the kernel compiles: tests/test_sm90.py checks it is the same
    launcher) before Triton compiles; later launches do not."""
    from flashlight import _compat
    events = []
    monkeypatch.setattr(_compat, "prebuild_launcher", lambda fn, args, meta: events.append(("prebuild", args, meta)))

    class Fn(_JitFn):
        def __getitem__(self, grid):
            events.append("compile")
            return super().__getitem__(grid)
    k = _compat.FastLaunch(Fn(), current=(lambda: 0, lambda dev: "stream"))
    x = torch.zeros(64, dtype=torch.bfloat16)
    for n in (64, 64, 48):
        k[(1,)](x, 1, n, BLOCK=16, num_warps=4)
    assert events == [("prebuild", (x, 1, 64), dict(BLOCK=16, num_warps=4)), "compile", "compile"]


def test_plain_softmax_saves_two_floats_per_row_and_rebuilds_the_product_from_the_output():
    """out = (P @ V) / l: the forward saves only the max and the sum per row (the product is
    out * l, read back from the output, as FA2 reads O), and a backward call without the output
    — a graph compiled before the op took it — falls back to the reference VJP, still exact."""
    from flashlight.ir.region import from_output
    from flashlight.runtime.op import REGISTRY
    q, k, v = causal.make_inputs(B=1, H=2, M=33, D=16)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    c = REGISTRY[flashlight.explain(causal.attention, *leaves).regions[0].key]
    assert from_output(c.region) and c.rowstats_shape[-1] == 2
    out, rowstats = torch.ops.flashlight.region(c.key, [q, k, v])
    grad = torch.randn_like(out)
    ref64 = [to64(x).requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(causal.attention(*ref64), ref64, grad.double())
    for extra, generated in (([out], 1), ([], 0)):
        before = c.bwd_launches
        got = torch.ops.flashlight.region_backward(c.key, [q, k, v], rowstats, grad, *extra)
        assert max(rel_error(a, b) for a, b in zip(got, want)) < 1e-3
        assert c.bwd_launches - before == generated


def test_autotune_never_picks_a_config_whose_results_disagree(monkeypatch):
    """The tuner times only configs whose outputs match the default config's: a faster config
    that computes something else (a block shape the compiler gets wrong) is rejected, a faster
    one that differs by summation order is kept, infinities must sit in the same places, and
    when the default does not fit the reference comes from the smaller configs ``fitting``
    falls back to — not from a wrong candidate tried first."""
    import triton.testing
    from triton.runtime.errors import OutOfResources
    from flashlight.runtime import op
    from flashlight.tune import Config, smaller
    default, wrong, reordered, slow = (Config(64, 64, 4, 3), Config(32, 128, 4, 3), Config(32, 64, 4, 3),
                                       Config(128, 64, 8, 3))
    torch.manual_seed(0)
    ref = torch.randn(64, 64).to(torch.bfloat16)
    rows = torch.tensor([1.0, float("-inf")])
    few_rows = ref.clone()
    few_rows[3] = 0                                           # one row of 64 left unwritten
    results = {default: [ref, rows], slow: [ref, rows], smaller(default): [ref, rows],
               reordered: [(ref.float() * (1 + 2e-3 * torch.randn(64, 64))).to(torch.bfloat16), rows],
               wrong: [few_rows, rows]}
    times = {default: 3.0, wrong: 1.0, reordered: 2.0, slow: 4.0}
    current, too_big = [], set()

    def launch(cfg):
        if cfg in too_big:
            raise OutOfResources(1, 0, "shared memory")
        current[:] = [cfg]
        return results[cfg][0], (results[cfg][1], None)      # nested, as the forward's (outs, rowstats)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), times[current[0]])[1])
    c = SimpleNamespace()
    tune = op.CompiledRegion.autotune
    assert tune(c, launch, [wrong, reordered, slow], default) == reordered
    assert tune(c, launch, [wrong, slow], default) == default
    too_big.add(default)                                      # the reference: smaller(default)'s results
    assert tune(c, launch, [wrong, slow], default) == slow
    too_big.clear()
    results[reordered][1] = torch.tensor([1.0, 0.0])        # a -inf row statistic became finite
    assert tune(c, launch, [wrong, reordered, slow], default) == default


def test_agreement_tolerates_rounding_and_noise_not_wrong_elements():
    from flashlight.runtime import op
    torch.manual_seed(0)
    g = torch.randn(32, 16)
    noise = 1e-7 * torch.randn(32)                            # a gradient that is zero up to fp32 rounding
    assert op.agree([g, noise], [g, 1e-7 * torch.randn(32)])
    assert op.agree([g.bfloat16()], [(g * (1 + 4e-3)).bfloat16()])       # an ulp or so
    assert not op.agree([g * torch.where(torch.arange(32)[:, None] == 5, 1.2, 1.0)], [g])     # one row off
    assert op.agree([g], [g]) and not op.agree([g], [g, g]) and not op.agree([g * float("nan")], [g])


def test_tuning_launch_of_a_backward_kernel_returns_its_gradients(monkeypatch):
    """What the tuner times and compares for a backward tile kernel (``tuned_run``): that kernel
    alone, into fresh buffers, returning the gradients it wrote — those of autograd's step."""
    from flashlight.runtime import op
    from flashlight.tune import INTERPRETER
    xs = [x.requires_grad_() if x.is_floating_point() else x for x in document_mask.make_inputs(B=1, H=2, M=40, D=16)]
    seen = {}
    run = op.CompiledRegion.run
    monkeypatch.setattr(op.CompiledRegion, "run", lambda self, inputs, *a: seen.update(c=self, inputs=inputs) or
                        run(self, inputs, *a))
    out = torch.compile(document_mask.attention, backend="flashlight")(*xs)
    grad = torch.randn_like(out)
    grads = {(x.data_ptr(), x.shape): g for x, g in zip(xs, torch.autograd.grad(out, xs[:3], grad))}
    c, inputs = seen["c"], [x.detach() for x in seen["inputs"]]
    o, rowstats = c.run(inputs)
    k = c.backward_kernels()
    drows = k.launch_rows(inputs, rowstats, o, grad, k.buffers(inputs), INTERPRETER)
    for kernel, launch in (("dkdv", k.launch_dkdv), ("dq", k.launch_dq)):
        got = op.tuned_run(k, kernel, launch, inputs, rowstats, drows, {}, INTERPRETER)
        want = [grads[inputs[i].data_ptr(), inputs[i].shape] for i in k.plan.written(kernel)]
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            assert rel_error(g, w) < 1e-6


def test_the_suite_runs_with_poisoned_buffers():
    """Every kernel test runs with outputs, row statistics, gradients and workspaces NaN-filled
    before the launch (FLASHLIGHT_POISON=1, set in conftest): an element a kernel fails to write
    fails its test instead of reading back a freed buffer's stale values."""
    from flashlight.runtime import buffers, op
    assert buffers.POISON
    r = flashlight.explain(causal.attention, *causal.make_inputs(B=1, H=1, M=20, D=16)).regions[0]
    c = op.REGISTRY[r.key]
    out, = c.new_outputs(torch.zeros(1))
    assert out.isnan().all()
    xs = causal.make_inputs(B=1, H=1, M=20, D=16)
    stored = c.backward_kernels().buffers(list(xs))
    assert stored and all(b.isnan().all() for b in stored.values())       # causal: every gradient stored
    assert not buffers.unwritten(torch.zeros(3, dtype=torch.int32)).any()      # integer buffers as they are


# -- the quick start (runtime.op.QuickStart) ------------------------------------------------------
def grads64(mod, inputs, dout):
    """Float64 eager's output and gradients of the floating inputs for ``dout``."""
    leaves = [to64(x).detach().requires_grad_() if x.is_floating_point() else x for x in inputs]
    out = mod.attention(*leaves)
    return out, torch.autograd.grad(out, [x for x in leaves if x.is_floating_point()], to64(dout))


@pytest.mark.parametrize("mod", [causal, document_mask, key_padding], ids=lambda m: m.__name__.rsplit(".")[-1])
def test_a_masked_region_starts_with_the_dense_kernel(mod, monkeypatch):
    """``FLASHLIGHT_QUICK=force`` (the GPU default, forced under the interpreter): the first call
    runs the kernel without block sparsity while the region's own compiles in the background, the
    calls after it the region's own; outputs and gradients (the backward reads the dense kernel's
    row statistics) match float64 either way, at a ragged size, and with a batch row whose keys
    are all padding (its rows fully masked: 0, the fused op's convention)."""
    from flashlight.runtime import op
    monkeypatch.setenv("FLASHLIGHT_QUICK", "force")
    op.OWN_COMPILED.clear()
    op.REGISTRY.clear()
    launched = []
    real = op.launch_kernel
    monkeypatch.setattr(op, "launch_kernel", lambda k, *a: launched.append(k) or real(k, *a))
    kw = {"B": 2, "lengths": [0, 41]} if mod is key_padding else {"B": 1}
    inputs = [x.requires_grad_() if x.is_floating_point() else x for x in mod.make_inputs(H=2, M=70, D=16, **kw)]
    fn = torch.compile(mod.attention, backend="flashlight")
    for call in range(2):
        launched.clear()
        out = fn(*inputs)
        (c,) = op.REGISTRY.values()
        if call == 0:
            assert isinstance(c.quick, op.QuickStart) and launched[0] is c.quick.kernel
        else:
            assert c.quick is False and launched[0] is c.kernel
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(call))
        got = torch.autograd.grad(out, [x for x in inputs if x.is_floating_point()], dout)
        ref, want = grads64(mod, inputs, dout)
        assert rel_error(out, ref.nan_to_num(0)) < 1e-3
        for g, w in zip(got, want):
            assert rel_error(g, w.nan_to_num(0)) < 1e-3
        flashlight.wait()


def test_a_length_in_a_new_scan_bucket_starts_with_the_dense_kernel(monkeypatch):
    """The two-loop kernel's SCAN_BLOCKS (its scan's vector of blocks) is a power of two per
    length, so the kernel one length compiled compiles again at a length in another bucket. A
    region there starts with the dense kernel too — launched with SCAN_BLOCKS=1, having no scan,
    so one compile serves every length — while its own compiles in the background; at a length
    in a bucket already compiled, with its own kernel."""
    from flashlight.runtime import op
    monkeypatch.setenv("FLASHLIGHT_QUICK", "force")
    op.OWN_COMPILED.clear()
    op.REGISTRY.clear()
    torch.compiler.reset()
    launched = []
    real = op.launch_kernel
    monkeypatch.setattr(op, "launch_kernel", lambda k, grid, args, meta, s: launched.append((k, meta))
                        or real(k, grid, args, meta, s))
    fn = torch.compile(causal.attention, backend="flashlight", dynamic=False)
    scans = {}
    for m, quick in ((70, True), (300, True), (75, False)):
        launched.clear()
        with torch.no_grad():
            out = fn(*(inputs := causal.make_inputs(B=1, H=2, M=m, D=16)))
        (c,) = [c for c in op.REGISTRY.values() if c.region.M == m]
        assert (launched[0][0] is not c.kernel) == quick, m
        assert launched[0][1]["SCAN_BLOCKS"] == 1 if quick else launched[0][1]["SCAN_BLOCKS"] == scans[70]
        assert rel_error(out, causal.attention(*(to64(x) for x in inputs))) < 1e-3
        flashlight.wait()
        scans[m] = next(iter(c.metas.values()))[1]["SCAN_BLOCKS"]      # its own kernel's
    assert scans[70] == scans[75] != scans[300]
    assert {(c.name, scans[70]), (c.name, scans[300])} <= op.OWN_COMPILED
    op.REGISTRY.clear()


@pytest.mark.parametrize("mod", [vanilla, causal], ids=["vanilla", "causal"])
def test_kernels_without_a_scan_take_one_scan_block_at_every_length(mod, monkeypatch):
    """SCAN_BLOCKS sizes a block scan's vector: a power of two per length, so a new bucket of
    lengths compiles a kernel again. Kernels without a scan (every kernel of a region without
    a useful mask) are launched with 1 — one compile for every length — and those with one
    (causal's forward, dK/dV and dQ) with the power of two; gradients match float64 at both
    lengths."""
    from flashlight.runtime import op
    monkeypatch.setenv("FLASHLIGHT_QUICK", "0")
    op.REGISTRY.clear()
    torch.compiler.reset()
    metas = []
    real = op.launch_kernel
    monkeypatch.setattr(op, "launch_kernel", lambda k, grid, args, meta, s: metas.append(meta)
                        or real(k, grid, args, meta, s))
    fn = torch.compile(mod.attention, backend="flashlight", dynamic=False)
    for m in (40, 300):
        metas.clear()
        inputs = [x.requires_grad_() for x in mod.make_inputs(B=1, H=2, M=m, D=16)]
        out = fn(*inputs)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(m))
        got = torch.autograd.grad(out, inputs, dout)
        ref, want = grads64(mod, inputs, dout)
        assert rel_error(out, ref) < 1e-3 and all(rel_error(g, w) < 1e-3 for g, w in zip(got, want))
        scans = [meta["SCAN_BLOCKS"] for meta in metas if "SCAN_BLOCKS" in meta]
        assert len(scans) == 3          # the forward, dK/dV and dQ
        assert all(x == 1 for x in scans) == (mod is vanilla), scans
    op.REGISTRY.clear()


def test_no_quick_start_without_a_mask_or_background(monkeypatch):
    """A region without a useful mask has one kernel already; with compiles blocking
    (``FLASHLIGHT_BACKGROUND=0``) or ``FLASHLIGHT_QUICK=0`` the region's own kernel runs first;
    under the interpreter, by default, too (nothing to save)."""
    from flashlight.runtime import op
    cases = [(vanilla, {"FLASHLIGHT_QUICK": "force"}),
             (causal, {"FLASHLIGHT_QUICK": "force", "FLASHLIGHT_BACKGROUND": "0"}),
             (causal, {"FLASHLIGHT_QUICK": "0"}), (causal, {})]
    for mod, env in cases:
        op.OWN_COMPILED.clear()
        op.REGISTRY.clear()
        torch.compiler.reset()
        for k in ("FLASHLIGHT_QUICK", "FLASHLIGHT_BACKGROUND"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with torch.no_grad():
            torch.compile(mod.attention, backend="flashlight")(*mod.make_inputs(B=1, H=1, M=20, D=16))
        (c,) = op.REGISTRY.values()
        assert c.quick is False, (mod.__name__, env)


# -- the backward's compiles from the first forward (CompiledRegion.prefetch_backward) ---------------
def launch_key(grid, args, meta) -> tuple:
    """What Triton specialises a launch on, and more: the grid, every argument (a tensor by dtype,
    shape and strides) and the constexprs."""
    return (tuple(grid), tuple((a.dtype, tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a
                               for a in args), sorted(meta.items()))


class Spy:
    """A kernel wrapper recording each launch's ``launch_key``."""

    def __init__(self, fn, seen):
        self.fn, self.seen = fn, seen

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.seen.append((self.fn, launch_key(grid, args, meta)))
            return self.fn[grid](*args, **meta)
        return launch


@pytest.mark.parametrize("path", ["as is", "inductor"])
def test_the_backward_compiles_from_the_first_forward(monkeypatch, path):
    """``FLASHLIGHT_PREFETCH=force`` (the GPU default, forced under the interpreter): the first
    differentiable forward generates the backward and submits its three kernels' compiles, each
    for exactly the launch the first backward then makes (grid, constexprs, arguments' dtypes,
    shapes, strides and values: the same specialisation); the backward waits for them, and its
    gradients match float64. Inference (no input requires grad) starts none. Both for a graph
    that runs as is (``RegionFunction``) and for one with other compute, which Inductor compiles
    around the custom op (a model's layer: the gradient reaches the region through Inductor's
    backward graph)."""
    from flashlight import _compat
    from flashlight.runtime import op
    monkeypatch.setenv("FLASHLIGHT_PREFETCH", "force")
    op.REGISTRY.clear()
    warmed = []
    monkeypatch.setattr(_compat, "warm", lambda fn, grid, args, meta: warmed.append((fn, launch_key(grid, args, meta))))
    inputs = document_mask.make_inputs(B=1, H=2, M=70, D=16)
    w = torch.randn(16, 16, generator=torch.Generator().manual_seed(1)) / 4
    program = {"as is": document_mask.attention,                  # a projection: Inductor compiles the graph
               "inductor": lambda q, k, v, ids: document_mask.attention(q @ w.to(q.dtype), k, v, ids)}[path]
    with torch.no_grad():
        torch.compile(program, backend="flashlight")(*inputs)
    assert not warmed
    torch.compiler.reset()
    op.REGISTRY.clear()
    inputs = [x.requires_grad_() if x.is_floating_point() else x for x in inputs]
    inductor = []
    real = _compat.compile_fx
    monkeypatch.setattr(_compat, "compile_fx", lambda *a: inductor.append(1) or real(*a))
    fn = torch.compile(program, backend="flashlight")
    out = fn(*inputs)
    flashlight.wait()
    (c,) = op.REGISTRY.values()
    k = c.bwd_kernel
    assert c.bwd_compiled and [w[0] for w in warmed] == [k.rows, k.dkdv, k.dq]
    launched = []
    k.rows, k.dkdv, k.dq = (Spy(f, launched) for f in (k.rows, k.dkdv, k.dq))
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    got = torch.autograd.grad(out, [x for x in inputs if x.is_floating_point()], dout)
    assert launched == warmed and bool(inductor) == (path == "inductor")
    _, want = grads64(SimpleNamespace(attention=program), inputs, dout)
    for g, w in zip(got, want):
        assert rel_error(g, w) < 1e-3


@pytest.mark.parametrize("path", ["as is", "inductor"])
@pytest.mark.parametrize("trained,kernels", [("sinks", ["rows"]), ("v", ["rows", "dkdv"]), ("q", ["rows", "dq"]),
                                             ("q k v sinks", ["rows", "dkdv", "dq"])])
def test_the_backward_launches_only_the_kernels_of_needed_gradients(monkeypatch, path, trained, kernels):
    """A tile kernel none of whose gradients autograd needs is not launched: frozen attention
    with trainable sink logits (the row kernel scatters their gradient) runs the row kernel
    alone; a trainable V alone, the dK/dV kernel too; Q alone, the dQ kernel. The wanted
    gradients match float64 either way. Both for a graph that runs as is (``RegionFunction``:
    ``needs_input_grad``) and for one Inductor compiles around the custom op
    (``flashlight::region_backward`` takes the list)."""
    from flashlight.examples import sinks
    from flashlight.runtime import op
    op.REGISTRY.clear()
    torch.compiler.reset()
    g = torch.Generator().manual_seed(2)
    inputs = dict(zip(["q", "k", "v", "sinks"], sinks.make_inputs(B=1, H=2, M=70, D=16)))
    for name in trained.split():
        inputs[name].requires_grad_()
    w = torch.randn(16, 16, generator=g) / 4
    mod = SimpleNamespace(attention={"as is": sinks.attention,       # a projection: Inductor compiles the graph
                                     "inductor": lambda q, k, v, s: sinks.attention(q, k, v, s) @ w.to(q.dtype)}[path])
    args = list(inputs.values())
    out = torch.compile(mod.attention, backend="flashlight")(*args)
    (c,) = op.REGISTRY.values()
    bk = c.backward_kernels()
    launched = []
    bk.rows, bk.dkdv, bk.dq = (Spy(f, launched) for f in (bk.rows, bk.dkdv, bk.dq))
    dout = torch.randn(out.shape, generator=g)
    wanted = [t for t in args if t.requires_grad]
    got = torch.autograd.grad(out, wanted, dout)
    names = {bk.rows.fn: "rows", bk.dkdv.fn: "dkdv", bk.dq.fn: "dq"}
    assert [names[fn] for fn, _ in launched] == kernels
    _, want = grads64(mod, args, dout)
    want = [wt for wt, t in zip(want, args) if t.requires_grad]
    for gt, wt in zip(got, want):
        assert rel_error(gt, wt) < 1e-3


def test_a_backward_that_fails_to_generate_fails_the_backward_not_the_forward(monkeypatch):
    """The prefetch generates the backward at the first forward; an unexpected error there (not
    a CodegenError, which picks the reference VJP) is the backward's to raise: the forward runs
    (an evaluation without no_grad never calls backward), the backward generates it again and
    raises. Under ``FLASHLIGHT_STRICT=1`` (the tests' setting) the forward raises it."""
    from flashlight.runtime import op
    monkeypatch.setenv("FLASHLIGHT_PREFETCH", "force")

    def broken(region, name, **kw):
        raise RuntimeError("backward generator broke")
    monkeypatch.setattr(op, "generate_backward", broken)
    inputs = [x.requires_grad_() for x in causal.make_inputs(B=1, H=1, M=20, D=16)]
    for strict in ("1", "0"):
        monkeypatch.setenv("FLASHLIGHT_STRICT", strict)
        op.REGISTRY.clear()
        torch.compiler.reset()
        fn = torch.compile(causal.attention, backend="flashlight")
        if strict == "1":
            with pytest.raises(RuntimeError, match="generator broke"):
                fn(*inputs)
            continue
        out = fn(*inputs)
        (c,) = op.REGISTRY.values()
        assert not c.bwd_compiled and c.bwd_kernel is None
        with pytest.raises(RuntimeError, match="generator broke"):
            out.sum().backward()


def test_a_float_argument_that_changes_between_calls_keeps_fusing():
    """A temperature passed as a Python float: after it changes, Dynamo lifts it to a 0-d tensor
    read with ``.item()`` (automatic dynamic), which a trace on fake tensors cannot follow, so
    every later call ran unfused. The region now reads the 0-d tensor (``items_as_tensors``):
    every call launches the kernel, each with its own temperature, with no recompile after the
    second, also through Python arithmetic on the number (its reciprocal). A use the rewrite
    does not cover (``math.sqrt``) falls back, and stays exact."""
    from flashlight.backend import _LISTENERS
    from flashlight.runtime import op

    def scaled(q, k, v, t):
        return torch.softmax(q @ k.transpose(-1, -2) * t, -1) @ v

    def reciprocal(q, k, v, t):
        return torch.softmax(q @ k.transpose(-1, -2) * (1.0 / t) - t * 2, -1) @ v

    def root(q, k, v, t):
        return torch.softmax(q @ k.transpose(-1, -2) * math.sqrt(t), -1) @ v
    xs = causal.make_inputs(B=1, H=2, M=21, D=16)
    for fn, fused in ((scaled, True), (reciprocal, True), (root, False)):
        torch.compiler.reset()
        reports = []
        _LISTENERS.append(reports)
        try:
            fast = torch.compile(fn, backend="flashlight")
            for t in (0.25, 0.5, 0.3, 2.0):
                before = sum(c.launches for c in op.REGISTRY.values())
                assert rel_error(fast(*xs, t), fn(*(to64(x) for x in xs), t)) < 1e-3
                assert sum(c.launches for c in op.REGISTRY.values()) - before == (1 if fused or t == 0.25 else 0)
        finally:
            _LISTENERS.remove(reports)
        assert len(reports) == 2, reports       # the constant, then the lifted argument
        assert bool(reports[1].regions) == fused


@pytest.mark.parametrize("training", [False, True])
def test_dynamic_shapes_with_a_module_float_attribute(training):
    """dynamic=True lifts a module's float attribute (nn.Dropout's p) to a 0-d tensor read with
    ``.item()`` inside the dropout: it crashed (the probe's failure compiled each shape with
    concrete inputs through Inductor). Now it runs, eval mode exact, training mode dropping
    about p of the output — p read at every call (changing it needs no recompile)."""
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.1)

        def forward(self, q, k, v):
            return self.drop(causal.attention(q, k, v))
    layer = Layer().train(training)
    fast = torch.compile(layer, backend="flashlight", dynamic=True)
    for n, p in ((19, 0.5), (33, 0.9)):
        layer.drop.p = p
        xs = causal.make_inputs(B=2, H=2, M=n, D=16)
        out = fast(*xs)
        if training:
            assert abs((out == 0).float().mean().item() - p) < 0.05
        else:
            assert rel_error(out, causal.attention(*(to64(x) for x in xs))) < 1e-3


def test_an_item_of_a_trained_tensor_stays_without_gradient():
    """``s * t.item()`` with ``t`` a trained scalar (Dynamo traces ``.item()`` with
    ``capture_scalar_outputs``): the region reads ``t`` detached, since a Python number carries
    no gradient — ``t`` gets none, as in eager, and q, k, v get float64's."""
    def fn(q, k, v, t):
        return torch.softmax(q @ k.transpose(-1, -2) * t.item(), -1) @ v
    xs = [x.requires_grad_() for x in causal.make_inputs(B=1, H=2, M=21, D=16)]
    t = torch.tensor(0.3, requires_grad=True)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        assert flashlight.explain(fn, *xs, t).regions
        torch.compiler.reset()
        out = torch.compile(fn, backend="flashlight")(*xs, t)
    grads = torch.autograd.grad(out.sum(), [*xs, t], allow_unused=True)
    assert grads[3] is None
    ref = [to64(x).detach().requires_grad_() for x in xs]
    want = torch.autograd.grad(fn(*ref, t).sum(), ref)
    assert all(rel_error(g, w) < 1e-3 for g, w in zip(grads[:3], want))
