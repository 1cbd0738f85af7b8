"""Where a compiled call's GPU time goes: every CUDA kernel of one call, from torch.profiler.

    python -m benchmarks.kernels --variants sliding_window,causal [--d 64] [--n 4096] [--b 4] [--step] [--flex] [--inductor]

Per variant, the flashlight-compiled call (``--step``: forward + backward, as
``benchmarks.backward`` times it) runs ``--reps`` times under the profiler; each kernel's
device time per call is printed next to the call's ``do_bench`` median and its host time (per
call, unsynchronised), so time outside the generated kernels (Inductor ops around the region,
copies, host gaps) shows as the difference.
Writes ``kernels_d{D}_n{N}[_step].csv`` to ``$OUT`` (or ``--out``).
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
from collections import defaultdict

import torch

import flashlight
from flashlight.examples import VARIANTS

from .overhead import host_us
from .smoke import configure_dynamo, make_bench


def kernel_times(fn, reps: int) -> dict[str, tuple[float, float]]:
    """kernel name -> (µs per call, launches per call), from ``reps`` profiled calls."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            t = totals[ev.name[:80]]
            t[0] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            t[1] += 1
    return {k: (us / reps, n / reps) for k, (us, n) in totals.items()}


def host_profile(fn, calls: int = 200, top: int = 25) -> None:
    """cProfile's top entries (by own time) over ``calls`` calls: where the host time goes."""
    import cProfile
    import pstats
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n")[0])
    p.add_argument("--variants", default="causal")
    p.add_argument("--b", type=int, default=4)
    p.add_argument("--h", type=int, default=16)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--step", action="store_true", help="forward + backward (gradients of the floating inputs)")
    p.add_argument("--flex", action="store_true", help="also profile FlexAttention's call (cached block mask)")
    p.add_argument("--inductor", action="store_true", help="also profile plain torch.compile's call (Inductor)")
    p.add_argument("--profile", action="store_true", help="cProfile the host side of 200 calls (top entries)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = p.parse_args(argv)
    configure_dynamo()
    bench = make_bench("cuda", 25, 100)
    rows = []
    for name in args.variants.split(","):
        mod = VARIANTS[name]
        torch.manual_seed(0)
        inputs = mod.make_inputs(args.b, args.h, M=args.n, D=args.d, dtype=torch.bfloat16, device="cuda")
        if args.step:
            inputs = [x.requires_grad_() if x.is_floating_point() else x for x in inputs]
        fl = torch.compile(mod.attention, backend="flashlight", dynamic=False)
        calls = {"flashlight": lambda: fl(*inputs)}
        if args.flex:
            from . import flex_equivalents as fe
            bm = fe.make_block_mask(name, inputs)
            calls["flex"] = lambda: fe.run_flex(name, inputs, bm)
        if args.inductor:
            ind = torch.compile(mod.attention, dynamic=False)
            calls["inductor"] = lambda: ind(*inputs)
        for system, fwd in calls.items():
            if args.step:
                leaves = [x for x in inputs if x.is_floating_point()] if system != "flex" else inputs[:3]
                dout = torch.randn_like(fwd())
                call = lambda fwd=fwd, leaves=leaves, dout=dout: torch.autograd.grad(fwd(), leaves, dout)  # noqa: E731
            else:
                call = fwd
            call()
            flashlight.wait()       # kernels compiling in the background (Gluon) take over first
            ms = bench(call)
            times = kernel_times(call, args.reps)
            gpu = sum(us for us, _ in times.values())
            host = host_us(call, 100)
            print(f"{name} {system} D={args.d} N={args.n} {'fwd+bwd' if args.step else 'fwd'}: "
                  f"do_bench {ms * 1e3:.1f} µs, kernels {gpu:.1f} µs, host {host:.1f} µs", flush=True)
            for k, (us, n) in sorted(times.items(), key=lambda kv: -kv[1][0]):
                print(f"    {us:9.1f} µs  x{n:g}  {k}")
                rows.append(dict(variant=name, system=system, d=args.d, n=args.n, step=args.step,
                                 call_us=ms * 1e3, host_us=host, kernel=k, kernel_us=us, launches=n))
            if args.profile:
                host_profile(call)
    out_dir = os.environ.get("OUT") or args.out
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"kernels_d{args.d}_n{args.n}{'_step' if args.step else ''}.csv"), "w",
              newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["variant"])
        w.writeheader()
        w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
