"""The generated Triton kernels compile for sm_90 (Triton's compiler and its bundled ptxas, no
driver): what the interpreter cannot check. It computes every dot in fp32, so operand types that
tl.dot rejects on a GPU (a bf16 K against an fp32 Q) pass there."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

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
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", MIXED], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).parents[1], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [line.split()[1] for line in res.stdout.splitlines() if line.startswith("compiled")] == \
        ["fwd", "rows", "dkdv", "dq"], res.stdout
