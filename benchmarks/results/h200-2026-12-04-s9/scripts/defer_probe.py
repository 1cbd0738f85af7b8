"""Session 9, run 4: the generated causal D=128 forward, hand-edited so each key block's P @ V
is issued in the next iteration, after that block's QK^T (defer/causal_d128_defer.py, fp32 P
carried): same arguments as the generated kernel, outputs compared, timings interleaved."""
import importlib.util
import os
import sys

import torch
from triton.testing import do_bench

from benchmarks.smoke import configure_dynamo
from flashlight._compat import FastLaunch
from flashlight.examples import VARIANTS
from flashlight.runtime import op

configure_dynamo()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
B, H, N = (4, 16, 4096) if DEV == "cuda" else (1, 2, 128)
seen = {}
real_launch = op.CompiledRegion.launch


def recording(self, inputs, cfg, stats=True, block_stats=None):
    seen["inputs"] = list(inputs)
    return real_launch(self, inputs, cfg, stats, block_stats)


op.CompiledRegion.launch = recording
here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("defer", os.path.join(here, "defer", "causal_d128_defer.py"))
edited = importlib.util.module_from_spec(spec)
spec.loader.exec_module(edited)
rows = []
for n, b in [(N, B), (16384 if DEV == "cuda" else N, 1)]:
    torch.manual_seed(0)
    mod = VARIANTS["causal"]
    inputs = mod.make_inputs(b, H, n, n, 128, torch.bfloat16, DEV)
    op.REGISTRY.clear()
    fn = torch.compile(mod.attention, backend="flashlight", dynamic=False)
    with torch.no_grad():
        fn(*inputs)
    (c,) = op.REGISTRY.values()
    xs = seen["inputs"]
    cfg = c.config(xs)
    r = c.region
    jit = c.kernel.fn if isinstance(c.kernel, FastLaunch) else c.kernel
    new = getattr(edited, jit.__name__)
    grid = (-(-r.M // cfg.BLOCK_M), b * H)
    meta = op.launch_meta(r, cfg, False, False)
    outs = {}

    def call(k, tag):
        def run():
            o = c.new_outputs(xs[0])
            k[grid](*op.kernel_args(r, c.stats, xs, o, torch.empty(1, device=DEV), None), **meta)
            outs[tag] = o[0]
        return run
    calls = {"generated": call(jit, "generated"), "deferred": call(new, "deferred")}
    for k_, f in calls.items():
        f()
    err = ((outs["deferred"].float() - outs["generated"].float()).norm() / outs["generated"].float().norm()).item()
    res = {k_: [] for k_ in calls}
    for rep in range(4):
        for k_, f in (calls.items() if rep % 2 == 0 else reversed(list(calls.items()))):
            res[k_].append(do_bench(f, warmup=25, rep=100, return_mode="median") if DEV == "cuda" else 0.0)
    line = f"causal D=128 B={b} N={n} {cfg}: rel diff {err:.1e}  " + "  ".join(
        f"{k_} {' '.join(f'{x:.3f}' for x in v)}" for k_, v in res.items())
    print(line, flush=True)
    rows.append(line)
with open(os.path.join(os.environ.get("OUT", "."), "defer_probe.txt"), "w") as f:
    f.write("\n".join(rows) + "\n")
