"""The Hopper Gluon kernels — the forward (codegen/gluon.py) and the backward's dK/dV and dQ
kernels (codegen/gluon_backward.py), with runtime/gluon.py — on a machine without a GPU: which
regions and layouts get them, their background compiles and fallbacks, snapshots of their
source, and that the generated source compiles for sm_90 with Triton's own compiler and ptxas
(no driver needed). Their numerics and barrier protocol: tests/test_gluon_emulated.py (on the
CPU, emulated) and tests/test_gpu.py (compiled, on an sm_90 GPU)."""
import threading
from types import SimpleNamespace

import pytest
import torch

import flashlight
from benchmarks.offline import capture
from helpers import compile_offline
from flashlight.codegen.gluon import gluon_pays, gluon_support
from flashlight.codegen.gluon_backward import tiles_support
from flashlight.examples import VARIANTS
from flashlight.runtime import backward as rb
from flashlight.runtime import gluon as rg
from flashlight.runtime import op as rt


@pytest.fixture
def region(monkeypatch):
    """The captured region of a variant (B=1 H=2 N=256, bf16), as compiled for CUDA."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def get(name, d=128, n=256):
        return capture(VARIANTS[name], 1, 2, n, d)
    yield get
    rt.REGISTRY.clear()


@pytest.mark.parametrize("name", ["vanilla", "causal", "sliding_window", "prefix_lm", "document_mask", "alibi",
                                  "softcap", "gated", "hand_softmax", "merged_heads"])
def test_one_softmax_regions_have_gluon_forward_and_backward_kernels(region, name):
    c, _ = region(name)
    assert gluon_support(c.region) == "" and tiles_support(c.region) == ""


@pytest.mark.parametrize("name,d,why", [
    ("diff_attention", 128, "one score tile"),          # two softmax maps
    ("sinks", 128, "one online softmax"),               # a sink's extra element
    ("relu_attention", 128, "reductions ['dot']"),      # no softmax
    ("post_softmax", 128, "reductions"),                # a second sum of the probabilities
    ("cross_attention", 128, "whole rows"),             # K, V as [B, N, H, D]: not [key, head] rows
    ("causal", 80, "head dims 80"),
])
def test_other_regions_keep_the_triton_forward(region, name, d, why):
    c, _ = region(name, d)
    assert why in gluon_support(c.region)


@pytest.mark.parametrize("name,d,n,why", [
    ("causal", 64, 4096, "head dims 64"), ("document_mask", 128, 4096, "loaded inside"),
    ("softcap", 128, 4096, "['tanh']"), ("sliding_window", 128, 4096, "a band of keys"),
    ("causal", 128, 1024, "masked rows of 1024 keys"), ("vanilla", 128, 512, "512 keys"),
    ("causal", 128, 4096, ""), ("alibi", 128, 4096, ""), ("prefix_lm", 128, 4096, ""), ("vanilla", 128, 1024, "")])
def test_gluon_is_the_default_only_where_it_measured_faster(region, name, d, n, why):
    c, _ = region(name, d, n)
    assert (why in gluon_pays(c.region)) if why else gluon_pays(c.region) == ""


def test_launch_checks_the_layouts():
    """Whole 128-key blocks, K and V as [rows, head] with batch strides in whole rows, 16-bit."""
    x = torch.empty(2, 4, 256, 64, dtype=torch.bfloat16)
    assert rg.operand_rows(x, 2, 64)
    assert not rg.operand_rows(x.transpose(1, 2).contiguous().transpose(1, 2), 2, 64)    # BSHD storage
    assert not rg.operand_rows(x.flatten()[1:1 + 2 * 4 * 255 * 64].view(2, 4, 255, 64), 2, 64)   # not 16-byte aligned
    assert not rg.operand_rows(x.transpose(2, 3), 2, 256)                              # head dim not contiguous
    wide = torch.empty(2, 4, 256, 128, dtype=torch.bfloat16)
    assert not rg.operand_rows(wide, 2, 64)      # a region reading k[..., :64] of it: copies would overrun
    assert rg.operand_rows(wide[..., :64], 2, 64)    # that view passed in itself: [rows, 64] with row stride 128
    assert not rg.operand_rows(x[:, :, :1].expand(2, 4, 256, 64), 2, 64)               # one key, broadcast
    assert rg.descriptor_rows(x, 2) == 2 * 4 * 256
    shared = x[:, :1].expand(2, 4, 256, 64)      # one K head read by four query heads (stride 0)
    assert rg.operand_rows(shared, 2, 64) and rg.descriptor_rows(shared, 2) == 4 * 256 + 256
    assert not rg.hopper(torch.device("cpu"))


def test_an_fp32_q_keeps_the_triton_forward(region):
    """A float32 Q against bf16 K: the Triton kernel's product is fp32; Gluon's would round Q."""
    def make_inputs(B, H, M, N, D, dtype, device):
        q = torch.randn(B, H, M, D, dtype=torch.float32, device=device)
        return (q, *(torch.randn(B, H, N, D, dtype=dtype, device=device) for _ in range(2)))
    mod = SimpleNamespace(make_inputs=make_inputs, attention=lambda q, k, v: torch.softmax(
        q @ k.float().mT * 0.125, -1).to(v.dtype) @ v)
    c, _ = capture(mod, 1, 2, 256, 128)
    assert "keeps Q's precision" in gluon_support(c.region)


def test_a_failed_first_gluon_launch_falls_back(region, monkeypatch):
    """A Gluon kernel that fails to compile (its first launch, FLASHLIGHT_BACKGROUND=0) leaves the
    Triton kernel for good; under FLASHLIGHT_STRICT=1, or after a launch that worked, the error is
    raised."""
    monkeypatch.setenv("FLASHLIGHT_BACKGROUND", "0")
    c, inputs = region("causal")
    events = []

    def broken(*args):
        raise RuntimeError("ptxas failed")
    monkeypatch.setattr(rt, "compile_gluon", lambda c: object())
    monkeypatch.setattr(rg, "launch", broken)
    monkeypatch.setattr(rt, "launch_kernel", lambda *args: events.append("triton"))
    monkeypatch.setattr(rt.CompiledRegion, "gluon_applies", lambda self, inputs: self.gfwd.kernel is not False)
    cfg = c.default_config()
    monkeypatch.setenv("FLASHLIGHT_STRICT", "1")
    with pytest.raises(RuntimeError, match="ptxas"):
        c.launch(inputs, cfg)
    monkeypatch.delenv("FLASHLIGHT_STRICT")
    c.gfwd = rt.background.Tier()
    c.launch(inputs, cfg)
    c.launch(inputs, cfg)
    assert events == ["triton"] * 2 and c.gfwd.kernel is False
    c.gfwd = rt.background.Tier(kernel=object(), launched=True)
    with pytest.raises(RuntimeError, match="ptxas"):
        c.launch(inputs, cfg)


def test_the_gluon_kernel_compiles_in_the_background(region, monkeypatch):
    """The first launch runs the Triton kernel, then submits the Gluon kernel's generation and
    compile to a background thread (after the Triton kernel's compile, not beside it); the Triton
    kernel serves until that is done, the Gluon kernel from the next launch on. A failed compile
    leaves the Triton kernel for good, or is raised under FLASHLIGHT_STRICT=1."""
    c, inputs = region("causal")
    events, go, kernel = [], threading.Event(), object()

    def compile_for(c_, args, inputs_, stats):
        events.append("compile")
        go.wait(30)
        return kernel
    monkeypatch.setattr(rt, "compile_gluon_for", compile_for)
    monkeypatch.setattr(rt, "launch_kernel", lambda *args: events.append("triton"))
    monkeypatch.setattr(rg, "launch", lambda k, *args: events.append("gluon" if k is kernel else "?"))
    monkeypatch.setattr(rt.CompiledRegion, "gluon_applies", lambda self, inputs: self.gfwd.kernel is not False)
    cfg = c.default_config()
    c.launch(inputs, cfg)
    assert events[0] == "triton" and c.gfwd.future is not None and c.gfwd.kernel is None
    c.launch(inputs, cfg)        # still compiling
    go.set()
    flashlight.wait()
    c.launch(inputs, cfg)
    assert [e for e in events if e != "compile"] == ["triton", "triton", "gluon"] and events.count("compile") == 1
    assert c.gfwd.kernel is kernel and c.gfwd.launched

    def broken(*args):
        raise RuntimeError("ptxas failed")
    monkeypatch.setattr(rt, "compile_gluon_for", broken)
    for strict in ("1", "0"):
        monkeypatch.setenv("FLASHLIGHT_STRICT", strict)
        c.gfwd = rt.background.Tier()
        events.clear()
        c.launch(inputs, cfg)
        flashlight.wait()
        if strict == "1":
            with pytest.raises(RuntimeError, match="ptxas"):
                c.launch(inputs, cfg)
        else:
            c.launch(inputs, cfg)
            c.launch(inputs, cfg)
            assert events == ["triton"] * 3 and c.gfwd.kernel is False


def test_generated_gluon_compiles_for_sm90():
    """Five kernels (one without a mask: its one softmax body; one storing merged heads) as the runtime would launch them (arguments, descriptors, constexprs),
    compiled to cubins by ``benchmarks.offline`` in a process of its own: Gluon's wrappers of
    triton.language cannot compile in this one, whose interpreter is on. Each must be
    warp-specialised into async wgmma without spills."""
    out = compile_offline("-m", "benchmarks.offline", "--variants", "vanilla,causal,document_mask,softcap,merged_heads",
                          "--b", "1", "--h", "2", "--n", "256", "--d", "64", "--kernels", "gfwd")
    rows = [line.split() for line in out.splitlines() if " gfwd " in line]
    assert [r[0] for r in rows] == ["vanilla", "causal", "document_mask", "softcap", "merged_heads"], out
    for r in rows:      # variant gfwd gluon secs regs spills smem async sass...
        assert r[5] == "0/0" and r[7] == "async" and any(x.startswith("HGMMA=") for x in r), r
        assert any(x.startswith("UTMALDG=") for x in r), r


def test_explain_says_which_forward_hopper_runs(region):
    from flashlight.explain import hopper_forward
    causal, _ = region("causal", 128, 4096)
    assert hopper_forward(causal.region).startswith("Gluon forward")
    document, _ = region("document_mask", 128, 4096)
    assert hopper_forward(document.region) == "Triton kernel (score tiles loaded inside a partition)"


def test_gluon_backward_prototype_compiles_for_sm90():
    """benchmarks/gluon_backward.py (the hand-written dK/dV kernel the generated one follows)
    keeps compiling: async wgmma, no serialisation."""
    out = compile_offline("-m", "benchmarks.gluon_backward", "--offline")
    lines = [line for line in out.splitlines() if line.startswith("D=128")]
    assert len(lines) == 2 and all("'serialized': False" in x for x in lines), out
    assert "'HGMMA': 48" in lines[0] and "'HGMMA': 96" in lines[1], out     # causal: masked, unmasked loops


# -- the dK/dV kernel of the generated backward (codegen/gluon_backward.py) ---------------------
@pytest.mark.parametrize("name,why", [
    ("diff_attention", "one score tile"), ("sinks", "one online softmax"), ("cross_attention", "whole rows")])
def test_other_regions_keep_the_triton_dkdv_kernel(region, name, why):
    c, _ = region(name)
    assert why in tiles_support(c.region)


def test_a_score_program_without_a_gradient_keeps_the_triton_dkdv_kernel():
    """softmax(floor(s)) @ v: no gradient reaches the score tile (only dV), so there is no dK to
    accumulate; the Gluon writer would need one. (Captured on CPU tensors: the meta capture
    helper cannot evaluate floor.)"""
    rt.REGISTRY.clear()
    q, k, v = (torch.randn(1, 1, 128, 64, dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        torch.compile(lambda q, k, v: torch.softmax(torch.floor(q @ k.mT) * 0.125, -1) @ v,
                      backend="flashlight")(q, k, v)
    (c,) = rt.REGISTRY.values()
    assert gluon_support(c.region) == "" and "no gradient reaches" in tiles_support(c.region)
    rt.REGISTRY.clear()


def _softmax_eps(q, k, v):
    e = torch.exp(q @ k.mT * 0.125 - (q @ k.mT * 0.125).amax(-1, keepdim=True))
    return e / (e.sum(-1, keepdim=True) + 1e-3) @ v


def test_a_shift_taking_a_gradient_runs_gluon_only_without_statistics(monkeypatch):
    """A softmax with an epsilon in its denominator: its max takes a gradient at the argmax the
    Triton forward saves. Inference launches run the Gluon forward; training launches (row
    statistics) run the Triton kernel, and the backward keeps its Triton tile kernels."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("FLASHLIGHT_BACKGROUND", "0")
    c, inputs = capture(SimpleNamespace(attention=_softmax_eps, make_inputs=VARIANTS["vanilla"].make_inputs), 1, 2, 256, 128)
    assert gluon_support(c.region) == "" and "shift takes a gradient" in tiles_support(c.region)
    events = []
    monkeypatch.setattr(rt, "compile_gluon", lambda c: object())
    monkeypatch.setattr(rg, "launch", lambda *args: events.append("gluon"))
    monkeypatch.setattr(rt, "launch_kernel", lambda *args: events.append("triton"))
    monkeypatch.setattr(rt.CompiledRegion, "gluon_applies", lambda self, inputs: True)
    cfg = c.default_config()
    c.launch(inputs, cfg, stats=False)
    c.launch(inputs, cfg, stats=True)
    assert events == ["gluon", "triton"]
    rt.REGISTRY.clear()


def test_a_learned_bias_keeps_the_triton_dkdv_kernel(region):
    """A bias that takes a gradient is scattered per tile by the Triton dK/dV kernel."""
    def make_inputs(B, H, M, N, D, dtype, device):
        q, k, v = (torch.randn(B, H, n, D, dtype=dtype, device=device) for n in (M, N, N))
        return q, k, v, torch.randn(H, M, N, dtype=dtype, device=device)
    mod = SimpleNamespace(make_inputs=make_inputs, attention=lambda q, k, v, bias: torch.softmax(
        (q @ k.mT + bias) * 0.125, -1) @ v)
    c, _ = capture(mod, 1, 2, 256, 128)
    assert gluon_support(c.region) == "" and "take gradients" in tiles_support(c.region)


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
def test_tile_launch_checks_the_layouts(region, kernel):
    """Whole blocks (dK/dV: 64 queries, 128 keys; dQ: 128 queries, 64 keys), Q, K and V as rows,
    dR one [rows, DV] tile of 16 bits, the gradients' rows aligned, the row statistics contiguous."""
    c, inputs = region("causal")
    ddot = torch.empty(2, 256, 128, dtype=torch.bfloat16)
    grads = [torch.empty_like(inputs[1]), torch.zeros(inputs[2].shape)]     # a stored gradient, an fp32 buffer
    rows = [torch.empty(1, 2, 256, 2)]

    def usable(inputs=inputs, ddot=ddot, grads=grads, rows=rows, c=c):
        return rg.tiles_usable(kernel, c.region, inputs, ddot, grads, rows)
    assert usable()
    assert not usable(ddot=ddot.float())
    assert not usable(ddot=torch.empty(2, 256, 256, dtype=torch.bfloat16))
    assert not usable(inputs=[inputs[0].transpose(2, 3).contiguous().transpose(2, 3), *inputs[1:]])
    assert not usable(grads=[grads[0].transpose(2, 3).contiguous().transpose(2, 3)])
    assert not usable(grads=[torch.empty(2 * 256 * 128 + 1)[1:].view(1, 2, 256, 128)])
    assert not usable(rows=[torch.empty(1, 2, 256, 3)[..., :2]])
    ragged, ragged_inputs = region("causal", 128, 200)
    assert not usable(c=ragged, inputs=ragged_inputs, ddot=torch.empty(2, 200, 128, dtype=torch.bfloat16))
    # 192 rows: whole 64-query blocks but not 128-key ones (dK/dV), nor 128-query ones (dQ)
    odd, odd_inputs = region("causal", 128, 192)
    assert not usable(c=odd, inputs=odd_inputs, ddot=torch.empty(2, 192, 128, dtype=torch.bfloat16))


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
def test_the_gluon_tile_kernels_compile_in_the_background(region, monkeypatch, kernel):
    """As the forward's: the first backward runs the Triton kernel and then submits the Gluon
    kernel's compile; later backwards run the Gluon kernel once it is ready; a failed compile
    leaves the Triton kernel for good. The two tile kernels have tiers of their own."""
    c, inputs = region("causal")
    k = c.backward_kernels()
    events, fn = [], object()
    monkeypatch.setattr(type(k), "gluon_tile_applies",
                        lambda self, kind, inputs, rowstats, drows, bufs: self.tier(kind).kernel is not False)
    monkeypatch.setattr(rb, "compile_gluon_tile_for",
                        lambda k, kind, *args: events.append(f"compile {kind}") or fn)
    monkeypatch.setattr(rg, "launch_tile", lambda kind, f, *args: events.append(f"gluon {kind}" if f is fn else "?"))
    rowstats = torch.zeros(c.rowstats_shape)
    drows = (torch.zeros(c.rowstats_shape), torch.zeros(*k.ddot_shape, dtype=torch.bfloat16))
    bufs = k.buffers(inputs)

    def step():
        k.run_tile(kernel, inputs, rowstats, drows, bufs, {}, lambda: events.append("triton"))
    step()
    flashlight.wait()
    step()
    assert events == ["triton", f"compile {kernel}", f"gluon {kernel}"] and k.tier(kernel).launched
    other = k.tier("dq" if kernel == "dkdv" else "dkdv")
    assert other.kernel is None and other.future is None

    def broken(*args):
        raise RuntimeError("ptxas failed")
    monkeypatch.setattr(rb, "compile_gluon_tile_for", broken)
    for strict in ("1", "0"):
        monkeypatch.setenv("FLASHLIGHT_STRICT", strict)
        k.gdkdv, k.gdq = rt.background.Tier(), rt.background.Tier()
        events.clear()
        step()
        flashlight.wait()
        if strict == "1":
            with pytest.raises(RuntimeError, match="ptxas"):
                step()
        else:
            step()
            step()
            assert events == ["triton"] * 3 and k.tier(kernel).kernel is False


def test_generated_gluon_tile_kernels_compile_for_sm90():
    """The dK/dV and dQ kernels of three regions as the runtime would launch them (the Triton
    kernels' arguments, the descriptors, the constexprs), compiled to cubins in a process of its
    own: warp-specialised, async wgmma; causal has its masked and mask-free loops (twice the
    products of the mask-free vanilla), ALiBi loads its per-head slope in the partition. The dQ
    kernel spills nothing at D=128."""
    out = compile_offline("-m", "benchmarks.offline", "--variants", "vanilla,causal,alibi",
                          "--b", "1", "--h", "2", "--n", "256", "--d", "128", "--kernels", "gdkdv,gdq")
    rows = [line.split() for line in out.splitlines() if " gdkdv " in line or " gdq " in line]
    assert [(r[0], r[1]) for r in rows] == [(v, k) for v in ("vanilla", "causal", "alibi") for k in ("gdkdv", "gdq")], out
    hgmma = {(r[0], r[1]): next(x for x in r if x.startswith("HGMMA=")) for r in rows}
    assert hgmma == {("vanilla", "gdkdv"): "HGMMA=48", ("causal", "gdkdv"): "HGMMA=96", ("alibi", "gdkdv"): "HGMMA=96",
                     ("vanilla", "gdq"): "HGMMA=40", ("causal", "gdq"): "HGMMA=80", ("alibi", "gdq"): "HGMMA=80"}, out
    for r in rows:      # variant kernel gluon secs regs spills smem async sass...
        assert r[7] == "async" and any(x.startswith("UTMALDG=") for x in r), r
        assert r[1] != "gdq" or r[5] == "0/0", r


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
def test_score_loads_are_issued_with_the_products_in_flight(region, kernel):
    """A document mask's ids of the loop's blocks load before the wait for S (their latency
    hidden behind the products), the other side's once in the prologue; the body reuses them."""
    from flashlight.codegen.gluon_backward import generate_gluon_tile
    c, _ = region("document_mask")
    src, _ = generate_gluon_tile(c.region, "k", kernel)
    compute = src[src.index("def k_compute("):src.index("def k_compute0(")]
    prologue, loop = compute.split("for i in range(0, n_mask):")[0], compute.split("for i in range(0, n_mask):")[1]
    step = loop.split("for i in range(n_mask, hi - lo):")[0]
    loads = [line.split("=")[0].strip() for line in step.splitlines() if "tl.load(in" in line]
    assert len(loads) == 1, step                       # the ids of this step's block
    assert step.index(loads[0] + " = tl.load") < step.index("warpgroup_mma_wait(1")
    assert step.count(loads[0]) >= 2                   # and the mask reads them
    assert prologue.count("tl.load(in") == 1, prologue   # the program's own rows' ids, once


@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
def test_snapshot_of_the_gluon_kernels(region, kernel):
    """The generated Gluon forward (the GPU-validated one), dK/dV and dQ kernels of the causal
    region: a change in their source shows up in review (``UPDATE_SNAPSHOTS=1`` rewrites)."""
    import os
    from pathlib import Path

    from flashlight.codegen.gluon import generate_gluon
    from flashlight.codegen.gluon_backward import generate_gluon_tile
    c, _ = region("causal")
    src = generate_gluon(c.region, "k")[0] if kernel == "fwd" else generate_gluon_tile(c.region, "k", kernel)[0]
    path = Path(__file__).parent / "snapshots" / f"gluon_causal_{kernel}.py"
    if os.environ.get("UPDATE_SNAPSHOTS") == "1" or not path.exists():
        path.write_text(src)
    assert src == path.read_text(), "generated source changed: review, then UPDATE_SNAPSHOTS=1"


def test_a_permuted_output_needs_strides_the_epilogue_can_assert():
    """The Gluon epilogue asserts that every output stride but the last is a multiple of 16
    (its partition's arguments lost Triton's specialisation): a transposed output [B, H, D, M]
    has stride M, so M = 200 keeps the Triton forward and M = 256 has the Gluon one."""
    def transposed(q, k, v):
        return (torch.softmax(q @ k.mT * 0.125, -1) @ v).transpose(-1, -2)
    for m, why in ((200, "not a multiple of 16"), (256, "")):
        rt.REGISTRY.clear()
        torch.compiler.reset()
        with torch.no_grad():
            torch.compile(transposed, backend="flashlight")(*(torch.randn(1, 2, m, 64, dtype=torch.bfloat16)
                                                               for _ in range(3)))
        (c,) = rt.REGISTRY.values()
        assert (why in gluon_support(c.region)) if why else gluon_support(c.region) == ""
    rt.REGISTRY.clear()


def test_a_computed_k_keeps_the_triton_forward_before_it_is_read_as_rows(monkeypatch):
    """A K computed in the kernel (``k * scale[h]``: one tensor along the keys, so not a leaf) has
    no Gluon forward, and ``gluon_applies`` says so before ``gluon.usable`` reads K and V as
    loads: that raised a TypeError at the first call on sm_90 (session 19, RoPE on an H100 with
    FLASHLIGHT_KV_LEAVES=0)."""
    monkeypatch.setenv("FLASHLIGHT_GLUON", "all")

    def attention(q, k, v, scale):
        return torch.softmax(q @ (k * scale).mT * 0.088, -1) @ v
    q, k, v = (torch.randn(1, 2, 128, 128) for _ in range(3))
    rt.REGISTRY.clear()
    torch.compile(attention, backend="flashlight")(q, k, v, torch.rand(1, 2, 1, 1) + 0.5)
    (c,) = rt.REGISTRY.values()
    monkeypatch.setattr(rg, "runs_on", lambda device: True)
    assert c.region.dots[0].k.op == "mul" and gluon_support(c.region)
    assert not c.gluon_applies([q, k, v])
    rt.REGISTRY.clear()
