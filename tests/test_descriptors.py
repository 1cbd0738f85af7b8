"""Tensor-descriptor (TMA) loads: which tiles the codegen reads through descriptors, when the
launch turns them on (``FLASHLIGHT_TMA=1``), and that both load paths compute the same function
(the interpreter runs the descriptor path like the GPU: one descriptor per program, zeros past
the bounds)."""
import pytest
import torch

import flashlight
from flashlight.examples import causal, gqa, vanilla
from flashlight.runtime import descriptors
from flashlight.runtime.op import REGISTRY

from helpers import check_fused, check_grads


def sources(fn, *inputs) -> tuple[str, str]:
    r = flashlight.explain(fn, *inputs).regions[0]
    return r.kernel_source, r.backward_source


def test_loop_operands_load_through_descriptors():
    fwd, bwd = sources(causal.attention, *causal.make_inputs(B=1, H=2, M=40, D=16))
    # forward: K (read transposed) and V per key block; Q, loaded once per program, is not
    assert "desc" in fwd and ".load([start_n, 0]).T" in fwd and ".load([start_n, 0])\n" in fwd
    assert fwd.count("tl.make_tensor_descriptor") == 2
    # backward: Q^T per query block in the dK/dV kernel, K and V per key block in dQ's
    dkdv, dq = bwd.split("def fl_bwd_")[1:3]
    assert ".load([start_m, 0]).T" in dkdv and dkdv.count("tl.make_tensor_descriptor") == 1
    assert dq.count("tl.make_tensor_descriptor") == 2


@pytest.fixture
def tma(monkeypatch):
    monkeypatch.setenv("FLASHLIGHT_TMA", "1")


def test_gqa_descriptor_starts_at_the_shared_head(tma):
    inputs = gqa.make_inputs(B=2, H=8, M=32, D=16)        # 2 K/V heads, groups of 4
    fwd, _ = sources(gqa.attention, *inputs)
    line = next(x for x in fwd.splitlines() if "tl.make_tensor_descriptor(in1_ptr" in x)
    assert "* in1_s0 +" in line and "* in1_s1," in line     # at (batch, h // 4), once per program
    assert set(launched_tma(lambda: check_fused(gqa.attention, *inputs, tol=1e-5))) == {True}


def test_ready_checks_the_layouts_tma_accepts(tma):
    x = torch.randn(2, 3, 40, 16)
    reqs = {0: {2}}
    assert descriptors.ready(reqs, [x], interpret=True)
    assert not descriptors.ready(reqs, [x.transpose(-1, -2)], interpret=True)      # last stride 16
    assert not descriptors.ready(reqs, [torch.randn(2 * 3 * 40 * 16 + 1)[1:].view(2, 3, 40, 16)], True)  # address
    assert not descriptors.ready(reqs, [torch.randn(2, 3, 40, 6)], interpret=True)  # rows of 24 bytes
    assert not descriptors.ready(reqs, [torch.randn(2, 3, 1, 16).expand(2, 3, 40, 16)], True)  # stride 0 rows
    assert not descriptors.ready({}, [x], interpret=True)
    assert not descriptors.ready(reqs, [x], interpret=False)       # a CPU tensor without the interpreter


@pytest.mark.parametrize("value", [None, "0"])
def test_ready_is_off_unless_asked_for(value, monkeypatch):
    if value is None:
        monkeypatch.delenv("FLASHLIGHT_TMA", raising=False)
    else:
        monkeypatch.setenv("FLASHLIGHT_TMA", value)
    assert not descriptors.ready({0: {2}}, [torch.randn(2, 3, 40, 16)], interpret=True)


def launched_tma(fn):
    """The TMA constexpr of every generated kernel launch while ``fn`` runs."""
    from flashlight.runtime import op
    seen, real = [], op.launch_kernel

    def spy(kernel, grid, args, meta, scratch):
        seen.append(meta.get("TMA"))
        return real(kernel, grid, args, meta, scratch)
    op.launch_kernel = spy        # this test's own probe of the launch path
    try:
        fn()
    finally:
        op.launch_kernel = real
    return seen


@pytest.mark.parametrize("tma", ["1", "0"])
def test_both_load_paths_match_float64_with_ragged_lengths(tma, monkeypatch):
    monkeypatch.setenv("FLASHLIGHT_TMA", tma)
    inputs = causal.make_inputs(B=1, H=2, M=45, N=45, D=24)     # 45: no block multiple; DK 24 pads to 32
    seen = launched_tma(lambda: check_fused(causal.attention, *inputs, tol=1e-5))
    assert seen and all(t is (tma == "1") for t in seen)
    inputs = [x.requires_grad_() for x in causal.make_inputs(B=1, H=2, M=37, N=37, D=16)]
    seen = launched_tma(lambda: check_grads(causal.attention, inputs))
    assert set(seen) == {tma == "1"} and len(seen) >= 3     # forward, dK/dV, dQ


def test_a_layout_tma_rejects_falls_back_to_pointer_loads(tma):
    q, k, v = vanilla.make_inputs(B=1, H=2, M=33, D=16)
    k = k.transpose(-1, -2).contiguous().transpose(-1, -2)     # same values, head dim strided
    seen = launched_tma(lambda: check_fused(vanilla.attention, q, k, v, tol=1e-5))
    assert set(seen) == {False}
    assert any(c.tma for c in REGISTRY.values())


def nan_padded(shape, dims: dict[int, int]) -> torch.Tensor:
    """A random tensor of ``shape`` viewed inside a NaN-filled buffer larger along ``dims``
    (dim -> extra size): a descriptor read past the region's extents would bring NaN in."""
    full = [s + dims.get(d, 0) for d, s in enumerate(shape)]
    buf = torch.full(full, float("nan"))
    view = buf[tuple(slice(0, s) for s in shape)]
    view.copy_(torch.randn(shape))
    return view


def attend_kt(q, kt, v):
    """K stored transposed ([B, H, D, N]): the descriptor's inner dim is the key index."""
    return torch.softmax(q @ kt * q.shape[-1] ** -0.5, -1) @ v


@pytest.mark.parametrize("case", ["longer_cache", "wider_head", "k_transposed", "pieces_d80", "cross"])
def test_descriptor_reads_stay_inside_the_region(case, tma):
    """Memory past every extent is NaN; forward and gradients match float64 on the descriptor path."""
    if case == "longer_cache":       # a KV cache of 64 rows, attention over its first 37
        fn, q = vanilla.attention, torch.randn(1, 2, 37, 16)
        k, v = nan_padded((1, 2, 37, 16), {2: 27}), nan_padded((1, 2, 37, 16), {2: 27})
    elif case == "wider_head":       # head dim 24 inside rows of 32 (pads to a 32-wide tile)
        fn, q = vanilla.attention, torch.randn(1, 2, 33, 24)
        k, v = nan_padded((1, 2, 33, 24), {3: 8}), nan_padded((1, 2, 33, 24), {3: 8})
    elif case == "k_transposed":
        fn, q = attend_kt, torch.randn(1, 2, 40, 16)
        k, v = nan_padded((1, 2, 16, 40), {3: 8}), nan_padded((1, 2, 40, 16), {2: 8})
    elif case == "pieces_d80":       # QK^T and P @ V in pieces 64 + 16
        fn, q = causal.attention, torch.randn(1, 1, 35, 80)
        k, v = nan_padded((1, 1, 35, 80), {2: 13}), nan_padded((1, 1, 35, 80), {2: 13})
    else:                            # cross attention, M != N
        fn, q = vanilla.attention, torch.randn(1, 2, 29, 16)
        k, v = nan_padded((1, 2, 45, 16), {2: 3}), nan_padded((1, 2, 45, 16), {2: 3})
    seen = launched_tma(lambda: check_fused(fn, q, k, v, tol=1e-5))
    assert set(seen) == {True}
    inputs = [x.requires_grad_() for x in (q, k, v)]
    seen = launched_tma(lambda: check_grads(fn, inputs))
    assert set(seen) == {True}
