"""Where the time of one call goes: GPU kernel time against the host-side layers around it.

    python -m benchmarks.overhead --variants sliding_window,vanilla --d 64

For each variant (bf16, CUDA) it times, with ``triton.testing.do_bench`` (median):
the compiled function, the ``flashlight::region_infer`` op called directly, ``CompiledRegion.infer``,
``CompiledRegion.launch`` and the kernel alone (``do_bench_cudagraph`` of the launch: no host
cost). ``host_us`` columns are host time per call (200 calls without synchronising, divided):
when a layer's host time exceeds the kernel time, the call is launch-bound. With ``--profile``
it prints cProfile's top entries for the compiled function. ``--step`` times a training step
instead (forward and backward of the compiled function, a fixed dO): its median, its host time,
the GPU time of its kernels (torch.profiler's CUDA events summed per step) and, with
``--profile``, cProfile's entries by own and by cumulative time.
"""
from __future__ import annotations

import argparse
import cProfile
import csv
import os
import pstats
import time

import torch
from triton.testing import do_bench, do_bench_cudagraph

import flashlight  # noqa: F401 — registers the backend
from flashlight.examples import VARIANTS
from flashlight.runtime import op as rt


def host_us(fn, calls: int = 200) -> float:
    """Host time per call: ``calls`` calls queued without synchronising (the queue does not fill
    at these counts), divided."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="vanilla,sliding_window,document_mask")
    p.add_argument("--b", type=int, default=4)
    p.add_argument("--h", type=int, default=16)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--m", type=int, help="query length (default: --n; 1 for decoding)")
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--step", action="store_true", help="time a training step (forward + backward)")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = p.parse_args()
    out_dir = os.environ.get("OUT", args.out)
    os.makedirs(out_dir, exist_ok=True)
    row_of = step_row if args.step else layers_row
    rows = [row_of(name, args) for name in args.variants.split(",")]
    with open(os.path.join(out_dir, "overhead_step.csv" if args.step else "overhead.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _inputs(name: str, args) -> list:
    return VARIANTS[name].make_inputs(args.b, args.h, args.m or args.n, args.n, args.d, torch.bfloat16, "cuda")


def _report(row: dict, fn, calls: int, profile: bool, orders: tuple[str, ...], top: int) -> dict:
    """Print ``row``; with ``profile``, cProfile's ``top`` entries of ``calls`` calls of ``fn`` per order."""
    print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        for order in orders:
            pstats.Stats(prof).sort_stats(order).print_stats(top)
    return row


def layers_row(name: str, args) -> dict:
    """One forward call's layers: the compiled function, the op, ``infer``, ``launch``, the kernel."""
    inputs = _inputs(name, args)
    fn = torch.compile(VARIANTS[name].attention, backend="flashlight", fullgraph=True)
    captured: dict[str, list] = {}
    run_all = rt.CompiledRegion.run_all

    def recording(self, inputs, *args, **kwargs):
        captured[self.key] = inputs
        return run_all(self, inputs, *args, **kwargs)
    rt.CompiledRegion.run_all = recording     # this script's probe: record the region inputs
    fn(*inputs)
    rt.CompiledRegion.run_all = run_all
    (key, leaves), = captured.items()
    c = rt.REGISTRY[key]
    cfg = c.config(leaves)
    layers = {
        "compiled": lambda: fn(*inputs),
        "op": lambda: torch.ops.flashlight.region_infer(key, leaves),
        "infer": lambda: c.infer(leaves),
        "launch": lambda: c.launch(leaves, cfg, stats=False),
    }
    row = dict(variant=name, d=args.d, n=args.n)
    for layer, f in layers.items():
        row[f"{layer}_us"] = 1e3 * do_bench(f, warmup=10, rep=50, return_mode="median")
        row[f"{layer}_host_us"] = host_us(f)
    row["kernel_us"] = 1e3 * do_bench_cudagraph(layers["launch"], rep=50, return_mode="median")
    return _report(row, layers["compiled"], 200, args.profile, ("tottime",), 18)


def gpu_us(fn, calls: int = 20) -> float:
    """GPU time per call: the CUDA kernels' durations in torch.profiler, summed."""
    from .kernels import kernel_times
    return sum(us for us, _ in kernel_times(fn, calls).values())


def step_row(name: str, args) -> dict:
    """A training step (forward and backward, a fixed dO): median, host and GPU time."""
    inputs = _inputs(name, args)
    leaves = [x.requires_grad_() for x in inputs[:3]]
    fn = torch.compile(VARIANTS[name].attention, backend="flashlight")
    dout = torch.randn_like(fn(*inputs))

    def step():
        return torch.autograd.grad(fn(*inputs), leaves, dout)
    row = dict(variant=name, d=args.d, n=args.n, step_us=1e3 * do_bench(step, warmup=10, rep=100, return_mode="median"),
               step_host_us=host_us(step, 100), step_gpu_us=gpu_us(step))
    return _report(row, step, 100, args.profile, ("tottime", "cumulative"), 25)


if __name__ == "__main__":
    main()
