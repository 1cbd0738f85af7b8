"""A/B of split-KV decoding (session 32): the decode suite's programs with the heuristic's splits
against FORCE_SPLITS=1 (one program per packed (M block, batch) walking every key), same process.
Arguments: the programs of ``benchmarks.decode`` (default causal, threshold, softpick)."""
import sys

import torch
import triton.testing

import flashlight
from benchmarks import decode as programs
from flashlight.runtime import decode

torch._dynamo.config.cache_size_limit = 64
rows = []
for name in sys.argv[1:] or ("causal", "threshold", "softpick"):
    fn = getattr(programs, name)
    for N in (4096, 32768):
        q, k, v = programs.make_inputs(B=8, H=32, M=1, N=N, D=128, dtype=torch.bfloat16, device="cuda")
        times = {}
        for splits in (None, 1):
            decode.FORCE_SPLITS = splits
            torch.compiler.reset()
            f = torch.compile(fn, backend="flashlight")
            f(q, k, v)
            flashlight.wait()
            times[splits] = triton.testing.do_bench(lambda: f(q, k, v), warmup=25, rep=200, return_mode="median")
        rows.append((name, N, times[None], times[1]))
decode.FORCE_SPLITS = None
print(f"{'program':<10} {'N':>6} {'split ms':>9} {'one ms':>8} {'x':>6}")
for name, N, a, b in rows:
    print(f"{name:<10} {N:>6} {a:>9.3f} {b:>8.3f} {b / a:>6.2f}")
