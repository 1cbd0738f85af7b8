"""The generated Triton kernels compile for sm_90 (Triton's compiler and its bundled ptxas, no
driver): what the interpreter cannot check. It computes every dot in fp32, so operand types that
tl.dot rejects on a GPU (a bf16 K against an fp32 Q) pass there."""
import textwrap

from helpers import compile_offline

# Compiled in a process of its own: this one's interpreter is on (``benchmarks.offline``).
MIXED = textwrap.dedent("""
    from types import SimpleNamespace
    import torch
    from benchmarks.offline import capture, compile_sm90, record

    def make_inputs(B, H, M, N, D, dtype, device):
        q = torch.randn(B, H, M, D, dtype=torch.float32, device=device)
        return (q, *(torch.randn(B, H, N, D, dtype=dtype, device=device) for _ in range(2)))
    mod = SimpleNamespace(make_inputs=make_inputs, attention=lambda q, k, v: torch.softmax(
        q @ k.float().mT * 0.125, -1).to(v.dtype) @ v)
    c, inputs = capture(mod, 1, 2, 256, 64)
    for name, (fn, args, meta, _) in record(c, inputs, {}).items():
        compile_sm90(fn, args, meta)
        print("compiled", name)
""")


def test_a_bf16_k_against_an_fp32_q_compiles_for_sm90():
    """Q fp32, K and V bf16 (``q @ k.float().mT``): the score product takes both as fp32, in the
    forward and in the backward's recomputation."""
    out = compile_offline("-c", MIXED)
    assert [line.split()[1] for line in out.splitlines() if line.startswith("compiled")] == \
        ["fwd", "rows", "dkdv", "dq"], out


# The launcher Flashlight prebuilds on a thread (``_compat.launcher_source``) against the one
# Triton builds after compiling (``CudaLauncher``: ``make_launcher`` of the compiled kernel's
# source), for every kernel of a masked training step (the quick start's forward too); and its gcc
# build, linked without the driver library this machine lacks.
LAUNCHERS = textwrap.dedent("""
    import os, tempfile
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import include_dirs, make_launcher
    from triton.compiler import make_backend
    from triton.runtime.build import _build
    from triton.runtime.jit import create_function_from_signature
    from benchmarks.offline import capture, compile_sm90, record
    from flashlight._compat import launcher_source
    from flashlight.examples import VARIANTS

    backend = make_backend(GPUTarget("cuda", 90, 32))
    c, inputs = capture(VARIANTS["alibi"], 1, 2, 256, 64)
    for name, (fn, args, meta, _) in record(c, inputs, {}).items():
        if name.startswith("g"):
            continue        # Gluon kernels: descriptors, whose launcher needs the compiled kernel (no prebuild)
        if "TMA" in fn.arg_names:
            meta = {**meta, "TMA": False}
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        ours = launcher_source(fn, backend, binder, args, meta)
        src = compile_sm90(fn, args, meta).src
        assert ours == make_launcher(src.constants, src.signature, None), name
        tmp = tempfile.mkdtemp()
        path = os.path.join(tmp, "launcher.c")
        open(path, "w").write(ours)
        _build("__triton_launcher", path, tmp, [], include_dirs, [], [])
        print("same launcher", name)
""")


def test_prebuilt_launchers_are_the_ones_triton_builds():
    out = compile_offline("-c", LAUNCHERS)
    assert [line.split()[2] for line in out.splitlines() if line.startswith("same launcher")] == \
        ["fwd", "qfwd", "rows", "dkdv", "dq"], out
