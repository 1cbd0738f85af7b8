"""Where a first call's time goes: Dynamo, Flashlight's capture and code generation, Inductor,
Triton's compiles, and the rest, for Flashlight and for FlexAttention on the same program.

    python -m benchmarks.first_call --variants causal,document_12 --d 128 [--b 4 --n 4096] [--step]

Each variant runs in a process of its own with empty Triton, Inductor and Flashlight caches
(every compile is cold, as ``benchmarks.run`` measures first calls). Columns, in seconds (a phase
inside another counts in both):

    wall        the whole first call (forward, or forward and backward with --step)
    dynamo      Dynamo's compiles (bytecode tracing, the backend, guards), its own timers
    guards      of which building guards
    backend     of which the backend (Flashlight's, or Inductor for Flex)
    trace       of which Flashlight's trace to ATen and region search (its own timer)
    lower       of which Flashlight's verify, rewrite, code generation and module import
    inductor    Inductor's compiles (inside dynamo, or at the first backward for its graph)
    triton      Triton's compiles on the calling thread (Flashlight's kernels compile at their
                first launch, after Dynamo; Inductor's compile in its worker processes, unseen)
    triton_bg   Triton's compiles on other threads (background kernels; they overlap the call)
    rest        wall - dynamo - triton: launcher builds, module loads, kernels, waits

Timers, not a profiler: under cProfile, session 14's table on the device (Python 3.12, where
cProfile runs on ``sys.monitoring``) read 0 in every phase; these timers do not depend on it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

PHASES = ("dynamo", "guards", "backend", "trace", "lower", "inductor", "triton", "triton_bg", "rest")
# Dynamo's timer names (torch._dynamo.utils.compilation_time_metrics, via flashlight._compat)
DYNAMO = {"dynamo": "_compile.compile_inner", "guards": "build_guards",
          "backend": "OutputGraph.call_user_compiler", "inductor": "compile_fx_inner"}


class TritonTimes:
    """Seconds of Triton's compiles (cache misses) on the calling thread and on others, through
    Triton's compilation listener (``triton.knobs.compilation.listener``)."""

    def __init__(self):
        self.main, self.other, self.thread = 0.0, 0.0, threading.get_ident()

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        if not cache_hit:
            if threading.get_ident() == self.thread:
                self.main += times.total / 1e6
            else:
                self.other += times.total / 1e6


def child(system: str, variant: str, b: int, n: int, d: int, device: str, step: bool = False) -> dict:
    """One first call in this (fresh) process: ``system`` (a ``benchmarks.run`` backend) on the
    flex suite's ``variant`` at (B, N, D), as ``benchmarks.run`` builds it; ``step``: forward and
    backward (gradients of q, k, v), as the training suite runs it."""
    import contextlib

    import torch

    from .measure import Env, build, with_backward
    from .run import configure_dynamo
    from .suites import Case, cases, make_inputs
    configure_dynamo()
    found = next(c for c in cases("flex") if c.variant == variant)
    case = Case("flex", variant, found.program, b, found.H, n, n, d, extra=found.extra)
    env = Env(device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    xs = list(make_inputs(case, env.dtype, env.device))
    if step:
        xs[:3] = leaves = [x.detach().requires_grad_() for x in xs[:3]]
    call = build(system, case, xs, env, {})        # the block mask is built here for Flex, as there
    if step:
        dout = torch.randn(xs[0].shape[:-1] + (xs[2].shape[-1],), dtype=env.dtype, device=device)
        call = with_backward(call, leaves, dout)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    from triton import knobs

    from flashlight._compat import dynamo_compile_seconds
    from flashlight.backend import _LISTENERS
    triton, reports, before = TritonTimes(), [], dynamo_compile_seconds()
    knobs.compilation.listener = triton
    _LISTENERS.append(reports)
    t0 = time.perf_counter()
    with contextlib.nullcontext() if step else torch.no_grad():
        call()
    sync()
    wall = time.perf_counter() - t0
    knobs.compilation.listener = None
    after = dynamo_compile_seconds()
    row = {"wall": wall, **{k: after.get(name, 0.0) - before.get(name, 0.0) for k, name in DYNAMO.items()},
           "trace": sum(r.seconds.get("trace", 0.0) for r in reports),
           "lower": sum(r.seconds.get("lower", 0.0) for r in reports),
           "triton": triton.main, "triton_bg": triton.other}
    row["rest"] = wall - row["dynamo"] - row["triton"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="causal", help="the flex suite's names (sliding_256, document_12, ...)")
    p.add_argument("--systems", default="flashlight,flex",
                   help="flashlight, flex, and flashlight_b: flashlight under --b-env")
    p.add_argument("--b-env", default="", help="NAME=VALUE[,NAME=VALUE]: flashlight_b's environment")
    p.add_argument("--b", type=int, default=4)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--device", default="cuda", help="cpu: a plumbing check (the interpreter; no Flex)")
    p.add_argument("--step", action="store_true", help="forward and backward (the training suite's first call)")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.b, args.n, args.d, args.device, args.step)))
        return
    print(f"{'variant':14s} {'system':12s} {'wall':>6s} " + " ".join(f"{k:>9s}" for k in PHASES))
    for variant in args.variants.split(","):
        for system in args.systems.split(","):
            extra = dict(kv.split("=", 1) for kv in args.b_env.split(",") if kv) if system == "flashlight_b" else {}
            with tempfile.TemporaryDirectory() as tmp:
                env = {**os.environ, "TRITON_CACHE_DIR": f"{tmp}/triton", "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor",
                       "FLASHLIGHT_CACHE_DIR": f"{tmp}/flashlight",
                       "TRITON_INTERPRET": "1" if args.device == "cpu" else "0", **extra}
                res = subprocess.run([sys.executable, "-m", "benchmarks.first_call", "--child",
                                      "flashlight" if system == "flashlight_b" else system, variant,
                                      "--b", str(args.b), "--n", str(args.n), "--d", str(args.d),
                                      "--device", args.device, *(["--step"] if args.step else [])],
                                     capture_output=True, text=True, env=env)
            if res.returncode:
                print(f"{variant:14s} {system:12s} failed: {res.stderr.strip().splitlines()[-1:]}")
                continue
            row = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"{variant:14s} {system:12s} {row['wall']:6.2f} " + " ".join(f"{row[k]:9.2f}" for k in PHASES),
                  flush=True)


if __name__ == "__main__":
    main()
