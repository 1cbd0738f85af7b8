"""The generated Gluon kernels' numerics and barrier protocol on the CPU (tests/gluon_emulator.py):
the forward, dK/dV and dQ kernels of each region that has them, launched with the runtime's own
arguments and descriptors (``runtime.gluon.launch`` / ``launch_tile``) on fp16 inputs, against the
Triton kernels on the same inputs and row statistics, and against float64. Every partition runs
in a thread of its own, so a wrong barrier phase or count hangs here too (reported, not hung)."""
import re

import numpy as np
import pytest
import torch

import flashlight
import gluon_emulator as emu
from flashlight.codegen.gluon import gluon_support
from flashlight.codegen.gluon_backward import tiles_support
from flashlight.examples import VARIANTS
from flashlight.ir.evaluate import evaluate
from flashlight.ir.region import rowstat_columns
from flashlight.runtime import gluon as rg
from flashlight.runtime import op as rt
from flashlight.testing import reference, rel_error, to64
from helpers import causal_gqa

# (variant, head dim, length, make_inputs' other arguments): whole Gluon blocks (the forward: 128
# queries x 128 keys; dK/dV: 64 x 128; dQ: 128 x 64); the band and the prefix are the examples'
# own (256 keys); key padding with a batch row of padding only (its rows fully masked: 0); the
# heads merged into the output's rows (a permuted store)
CASES = [("vanilla", 64, 256, {}), ("causal", 64, 384, {}), ("causal", 128, 256, {}), ("sliding_window", 64, 512, {}),
         ("prefix_lm", 64, 512, {}), ("document_mask", 64, 384, {}), ("document_mask", 128, 256, {}),
         ("alibi", 64, 256, {}), ("softcap", 64, 256, {}), ("gqa", 64, 256, {}), ("gated", 64, 256, {}),
         ("hand_softmax", 64, 256, {}), ("key_padding", 64, 256, dict(B=2, lengths=[0, 200])),
         ("merged_heads", 128, 256, {})]
IDS = [f"{name}-d{d}-n{n}" for name, d, n, _ in CASES]


@pytest.fixture
def traced():
    """The region of a variant on fp16 CPU inputs (B=1 H=2) and the op's inputs, in its order."""
    def get(name: str, d: int, n: int, extra: dict):
        torch.manual_seed(0)
        inputs = VARIANTS[name].make_inputs(**{"B": 1, "H": 2, "M": n, "D": d, "dtype": torch.float16, **extra})
        ((key, xs),) = emu.traced_regions(VARIANTS[name].attention, *inputs).items()
        return rt.REGISTRY[key], xs, inputs
    yield get
    rt.REGISTRY.clear()


@pytest.mark.parametrize("name,d,n,extra", CASES, ids=IDS)
def test_gluon_forward(traced, name, d, n, extra):
    """Output and row statistics of the emulated Gluon forward against the Triton kernel's
    (same inputs) and the output against float64."""
    c, xs, inputs = traced(name, d, n, extra)
    assert gluon_support(c.region) == "" and rg.usable(c.region, xs)
    out_t, stats_t = c.run(xs)
    out, stats = emu.forward(c, xs)
    assert rel_error(out, out_t.double()) < 1e-3
    assert rel_error(out, reference(VARIANTS[name].attention, *inputs)) < 2e-3
    assert torch.equal(torch.isfinite(stats_t), torch.isfinite(stats))
    (shift, total, product), _ = rowstat_columns(c.region)
    for j in (shift, total):        # the shift and the row sum: fp32 arithmetic on the same scores
        assert rel_error(stats[..., j], stats_t[..., j].double()) < 1e-5
    if product is not None:         # an epilogue's P @ V, from P in fp16 under each kernel's shifts
        assert rel_error(stats[..., product:], stats_t[..., product:].double()) < 1e-3


@pytest.mark.parametrize("name,d,n,extra", CASES, ids=IDS)
def test_gluon_tile_kernels(traced, name, d, n, extra):
    """The gradients of a backward whose dK/dV and dQ are the emulated Gluon kernels (on the
    Triton row kernel's row gradients) against the all-Triton backward's and float64's; the
    gradient buffers start NaN-filled (FLASHLIGHT_POISON), so an element never written fails."""
    c, xs, _ = traced(name, d, n, extra)
    check_tile_kernels(c, xs)


def check_tile_kernels(c, xs):
    """``test_gluon_tile_kernels``' checks of region ``c`` on the op's inputs ``xs``."""
    assert tiles_support(c.region) == ""
    out, stats = c.run(xs)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    triton = c.backward(xs, stats, out, dout)
    got = emu.tile_gradients(c, xs, out, stats, dout)
    floats = [i for i, x in enumerate(xs) if x.is_floating_point()]
    want = dict(zip(floats, reference_grads(c, xs, dout)))
    for i in floats:
        assert rel_error(got[i], triton[i].double()) < 1e-3, i
        assert rel_error(got[i], want[i]) < 2e-3, i


@pytest.mark.parametrize("fn,b,h,hkv,d,n", [(VARIANTS["gqa"].attention, 1, 4, 2, 64, 128),
                                             (causal_gqa, 2, 2, 1, 64, 256)], ids=["gqa-d64", "causal-mqa-d64"])
def test_the_gluon_dkdv_kernel_visits_the_heads_sharing_its_keys(monkeypatch, fn, b, h, hkv, d, n):
    """Under a group loop (``GradPlan.group``, forced: ``FLASHLIGHT_GROUP_LOOP=1``) the Gluon
    dK/dV program runs the query loop of each head of the group, its loader streaming their Q
    and dR rows one head after the other through one ring, and stores dK and dV once: against
    the Triton kernels and float64, GQA (2 heads per K/V head) and causal MQA (2 heads, masked
    and mask-free blocks, two batch indices)."""
    from flashlight.codegen.gradients import Group
    monkeypatch.setenv("FLASHLIGHT_GROUP_LOOP", "1")
    torch.manual_seed(0)
    inputs = (torch.randn(b, h, n, d, dtype=torch.float16),
              *(torch.randn(b, hkv, n, d, dtype=torch.float16) for _ in range(2)))
    try:
        ((key, xs),) = emu.traced_regions(fn, *inputs).items()
        c = rt.REGISTRY[key]
        plan = c.backward_kernels().plan
        assert plan.group == Group(1, h // hkv) and {1, 2} <= plan.stored
        check_tile_kernels(c, xs)
    finally:
        rt.REGISTRY.clear()


def reference_grads(c, xs, dout):
    """float64 gradients of the region's own inputs (its reference evaluator's VJP)."""
    floats = [i for i, x in enumerate(xs) if x.is_floating_point()]
    leaves = [to64(x).requires_grad_() if x.is_floating_point() else x for x in xs]
    out = evaluate(c.region, leaves)
    return torch.autograd.grad(out, [leaves[i] for i in floats], to64(dout))


def drop(line: str):
    """An edit of a kernel's source: every line starting with ``line`` (indented) becomes ``pass``."""
    return lambda s: re.sub(r"^(\s*)" + re.escape(line) + r".*$", r"\1pass", s, flags=re.M)


def swap(first: str, second: str):
    """An edit of a kernel's source: the adjacent lines ``first`` and ``second`` change places."""
    def edit(s):
        assert f"{first}\n{second}" in s
        return s.replace(f"{first}\n{second}", f"{second}\n{first}")
    return edit


WAIT = "        dv0, dk0, pb, dsb = warpgroup_mma_wait(0, deps=(dv0, dk0, pb, dsb))"
# A partition that reads without waiting is caught at its read or, when it runs ahead of the
# loader (CI's load did that), when the copy is issued under its wgmma, which never acquired the
# slot: either way the report is the missing wait, not an early release.
UNWAITED = "reads shared memory .* without having waited"
BROKEN = {   # (kernel, what is broken, edit, what the emulator reports)
    "no slot release": ("dq", drop("mbarrier.arrive(k_empty.index(st)"), "never completed|did not finish"),
    "no wait for K": ("fwd", drop("mbarrier.wait(k_ready"), UNWAITED),
    "no wait for own tiles": ("dq", drop("mbarrier.wait(own_bar"), UNWAITED),
    "slot released before its products": ("dkdv", swap(WAIT, "        mbarrier.arrive(q_empty.index(st), count=1)"),
                                          "issued into shared memory an async wgmma still reads"),
}


@pytest.mark.parametrize("broken", list(BROKEN))
def test_a_broken_barrier_protocol_is_reported(traced, monkeypatch, broken):
    """The emulator checks the kernels' protocol whatever the threads' timing: a partition that
    never releases its ring slots stalls the loader once the ring has wrapped (a hang, reported);
    one that reads a TMA copy's buffer without waiting for the copy's barrier, or releases a
    slot while its products still read it (the next copy into it is then issued under them),
    fails at that read or copy."""
    monkeypatch.setattr(emu, "TIMEOUT", 2.0)
    kernel, edit, reported = BROKEN[broken]
    c, xs, _ = traced("causal", 64, 512, {})      # 4 blocks through rings of 2
    out, stats = c.run(xs)
    with pytest.raises(Exception, match=reported):
        if kernel == "fwd":
            emu.forward(c, xs, edit)
        else:
            emu.tile_gradients(c, xs, out, stats, torch.ones_like(out), kernels=(kernel, ), edit=edit)


def test_the_protocol_check_names_the_missing_wait_whatever_the_timing():
    """A wgmma issued on a slot before any copy into it (its partition never waited: it ran
    ahead of the loader, as under CI's load) is reported as the missing wait when the copy
    comes; one whose partition waited for the copy and released the slot early, as the early
    release. Before, the first also read as an early release."""
    import triton.language as tl

    from flashlight.runtime.gluon import descriptor
    with emu._COND:
        emu._COPIED.clear()
        emu._READING.clear()
    s, other = (emu.allocate_shared_memory(tl.float16, [16, 16], emu.Layout()) for _ in range(2))
    bar = emu.Barriers(1)
    emu.mbarrier.init(bar, 1)
    desc = emu.Descriptor(descriptor(torch.ones(16, 16, dtype=torch.float16), 0, rows=16))
    emu.InFlight(s, other, None, False)
    with pytest.raises(emu.ProtocolError, match="without having waited"):
        emu.tma.async_copy_global_to_shared(desc, [0, 0], bar, s)
    with emu._COND:
        emu._READING.clear()
    emu.mbarrier.expect(bar, desc.block_type.nbytes)
    emu.tma.async_copy_global_to_shared(desc, [0, 0], bar, s)
    emu.mbarrier.wait(bar, 0)
    emu.InFlight(s, other, None, False)
    with pytest.raises(emu.ProtocolError, match="still reads"):
        emu.tma.async_copy_global_to_shared(desc, [0, 0], bar, s)
    while emu._COPIES:
        emu._COPIES.pop().join(emu.TIMEOUT)


def test_emulated_shared_memory_starts_nan():
    """A read of shared memory before any write shows as NaN (fp16 and bf16 storage)."""
    import triton.language as tl
    for dtype in (tl.float16, tl.bfloat16):
        s = emu.allocate_shared_memory(dtype, [2, 4], emu.Layout())
        assert np.isnan(emu.to_f32(s.data, dtype)).all()


def test_the_gluon_kernels_take_over_through_torch_compile_and_autograd(monkeypatch):
    """The runtime's whole Hopper path, with the kernels emulated: the first training step runs
    the Triton kernels and submits the Gluon forward, dK/dV and dQ kernels' compiles; the next
    step runs all three (their tiers say so), and both steps' outputs and gradients match
    float64 and each other. The submitted compiles run at once on the calling thread: the
    emulator rewrites each kernel's AST as Triton's interpreter does, and CPython's ast is not
    thread-safe (two compile threads and the main thread's interpreter failed in CI with
    "AST constructor recursion depth mismatch")."""
    from concurrent.futures import Future

    from flashlight.examples import causal
    from flashlight.runtime import background
    from flashlight.runtime import backward as rb

    def run_now(fn, device, *args):
        future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001 — the tier raises it at its next launch, as from a thread
            future.set_exception(e)
        return future
    monkeypatch.setattr(background, "submit", run_now)
    compile_gluon, compile_tile = rt.compile_gluon, rb.compile_gluon_tile
    monkeypatch.setattr(rg, "runs_on", lambda device: True)         # as on an H200 ...
    monkeypatch.setattr(rg, "warm", lambda *args: None)             # ... whose compiles the emulator needs not
    monkeypatch.setattr(rt, "compile_gluon", lambda c: emu.Kernel(compile_gluon(c)))
    monkeypatch.setattr(rb, "compile_gluon_tile", lambda k, kernel: emu.Kernel(compile_tile(k, kernel)))
    for kernel in ("", "_DKDV", "_DQ"):
        monkeypatch.setenv(f"FLASHLIGHT_GLUON{kernel}", "all")
    rt.REGISTRY.clear()
    torch.manual_seed(0)
    inputs = [x.requires_grad_() for x in causal.make_inputs(B=1, H=2, M=256, D=64, dtype=torch.float16)]
    dout = torch.randn(1, 2, 256, 64, dtype=torch.float16)
    fn = torch.compile(causal.attention, backend="flashlight")
    steps = []
    for _ in range(2):
        out = fn(*inputs)
        steps.append([out, *torch.autograd.grad(out, inputs, dout)])
        flashlight.wait()
    (c,) = rt.REGISTRY.values()
    k = c.bwd_kernel
    assert c.gfwd.launched and k.tier("dkdv").launched and k.tier("dq").launched
    ref = [to64(x).detach().requires_grad_() for x in inputs]
    want = causal.attention(*ref)
    want = [want, *torch.autograd.grad(want, ref, to64(dout))]
    for triton, gluon, w in zip(*steps, want):
        assert rel_error(gluon, w) < 2e-3 and rel_error(gluon, triton.double()) < 1e-3


@pytest.mark.parametrize("i", [3, 34, 79])
def test_random_programs_on_the_gluon_kernels(i):
    """Three programs of the Gluon fuzz (tests/gluon_fuzz.py, seed 3; drawn, not picked for being
    easy) against their Triton kernels: BSHD inputs, a boolean mask tensor, softcap and a
    hand-written softmax; GQA by expand with the scale in Q (moved onto the scores, so Q is
    copied as rows), a prefix, softcap and a gate; the document mask with a -1e9 fill, ALiBi,
    softcap and merged heads at D=128."""
    import gluon_fuzz
    p = gluon_fuzz.gluon_program(3, i)
    ok, msg = gluon_fuzz.check(p)
    assert ok and "fwd" in msg and "grads" in msg, (p.desc, msg)
