"""Session 9, run 3: why the generated forward with descriptor loads is slower than with pointer
loads (run 2) while the hand-written kernel gains 8% from them (run 1). Same inputs, timings
interleaved (A B A B) to expose drift: the hand kernel (pointer / TMA), the generated kernel
through the compiled function (FLASHLIGHT_TMA=1 / 0), launched directly through Triton's JIT
(a process-wide allocator), and through FastLaunch + with_scratch."""
import os
import sys

import torch
import triton
from triton.testing import do_bench

import flashlight
from benchmarks.hand_forward import run as hand
from benchmarks.smoke import configure_dynamo
from flashlight._compat import FastLaunch, with_scratch
from flashlight.examples import VARIANTS
from flashlight.runtime import op
from flashlight.tune import Config

configure_dynamo()
DEV = "cuda" if torch.cuda.is_available() else "cpu"      # cpu: a dry run (TRITON_INTERPRET=1)
B, H, N = (4, 16, 4096) if DEV == "cuda" else (1, 2, 128)
rows = []
seen = {}
real_launch = op.CompiledRegion.launch


def recording(self, inputs, cfg, stats=True, block_stats=None):
    seen["inputs"] = list(inputs)
    return real_launch(self, inputs, cfg, stats, block_stats)


op.CompiledRegion.launch = recording      # this probe's own: the op's inputs, in the region's order


def t(fn):
    if DEV == "cpu":
        fn()
        return 0.0
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


for name, D in [("vanilla", 128), ("document_mask", 128), ("causal", 128), ("vanilla", 64)]:
    torch.manual_seed(0)
    mod = VARIANTS[name]
    inputs = mod.make_inputs(B, H, N, N, D, torch.bfloat16 if DEV == "cuda" else torch.float32, DEV)
    op.REGISTRY.clear()
    fn = torch.compile(mod.attention, backend="flashlight", dynamic=False)
    with torch.no_grad():
        ref = fn(*inputs)
    (c,) = op.REGISTRY.values()
    xs = seen["inputs"]
    cfg = c.config(xs)
    r = c.region
    outs = c.new_outputs(xs[0])
    rowstats = torch.empty(1, device=DEV)
    args = op.kernel_args(r, c.stats, xs, outs, rowstats, None)
    grid = (-(-r.M // cfg.BLOCK_M), B * H)

    def direct(tma):
        meta = op.launch_meta(r, cfg, False, tma)
        jit = c.kernel.fn if isinstance(c.kernel, FastLaunch) else c.kernel     # FastLaunch wraps the JIT function
        return lambda: jit[grid](*args, **meta)

    def fast(tma):
        meta = op.launch_meta(r, cfg, False, tma)
        return lambda: with_scratch(xs[0].device, lambda: c.kernel[grid](*args, **meta))

    def env(v):
        def call():
            os.environ["FLASHLIGHT_TMA"] = v
            with torch.no_grad():
                return fn(*inputs)
        return call
    calls = {"compiled tma": env("1"), "compiled ptr": env("0"), "fast tma": fast(True), "fast ptr": fast(False)}
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=DEV))
    calls.update({"jit tma": direct(True), "jit ptr": direct(False)})
    if name == "vanilla":
        q, k, v = inputs
        bm = ((128, 128, 8, 3) if D == 128 else (128, 64, 4, 3)) if DEV == "cuda" else (32, 32, 4, 1)
        calls.update({"hand tma": lambda: hand(q, k, v, bm, 0, 0, 1), "hand ptr": lambda: hand(q, k, v, bm, 0, 0, 0)})
    for k_, call in calls.items():     # compile / warm every variant first
        call()
    if DEV == "cuda":
        torch.cuda.synchronize()
    res = {k_: [] for k_ in calls}
    for rep in range(3):
        for k_, call in (calls.items() if rep % 2 == 0 else reversed(list(calls.items()))):
            res[k_].append(t(call))
    os.environ.pop("FLASHLIGHT_TMA", None)
    line = f"{name} D={D} {cfg}: " + "  ".join(f"{k_} {' '.join(f'{x:.3f}' for x in v)}" for k_, v in res.items())
    print(line, flush=True)
    rows.append(line)
with open(os.path.join(os.environ.get("OUT", "."), "tma_probe.txt"), "w") as f:
    f.write("\n".join(rows) + "\n")
