"""Flashlight benchmarks: one command per suite, or all of them.

    python -m benchmarks.run --suite flex                  # or sparsity, beyond, training, decode
    python -m benchmarks.run --suite all --quick           # fewer shapes
    python -m benchmarks.run --suite flex --only causal,alibi --rep 100
    python -m benchmarks.run --suite flex --shapes 16x1024,1x16384    # some (B, N) of the suite
    python -m benchmarks.run --suite flex --dims 128                  # one head dim
    TRITON_INTERPRET=1 python -m benchmarks.run --suite all --device cpu --tiny    # plumbing check

Every case times Flashlight and its competitors on the same inputs (``measure.py``), checks each
output against an fp32 eager reference, appends one row to ``OUT/results.csv`` as soon as the case
is done, prints it, and at the end prints a summary table and writes PNG plots (``plots.py``).
OUT is ``--out``, else ``$OUT``, else ``benchmarks/results/<gpu>-<date>``; runs into the same OUT
add to the same CSV, so suites can be measured by separate commands and plotted together.

Every run starts with empty caches (fresh ``FLASHLIGHT_CACHE_DIR``, ``TRITON_CACHE_DIR`` and
``TORCHINDUCTOR_CACHE_DIR``), so first-call times include every system's cold compile (and
Flashlight's autotuning, when asked for); ``--keep-tune-cache`` uses the usual ones.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import sys
import tempfile
import time

import torch

from . import suites
from .measure import Env, measure, release, short
from .plots import plot_all
from .report import LEGEND, CsvSink, backend_line, read_csv, table

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def configure_dynamo() -> None:
    """Every case compiles new graphs of the same few functions: lift Dynamo's recompile caps."""
    cfg = torch._dynamo.config
    for attr in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(cfg, attr):
            try:
                setattr(cfg, attr, 4096)
            except Exception:   # noqa: BLE001 — an alias that refuses assignment: the other name did it
                pass


def default_out(device: str) -> str:
    if os.environ.get("OUT"):
        return os.environ["OUT"]
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-") or "gpu"
    return os.path.join("benchmarks", "results", f"{slug}-{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}")


def select(args) -> list[suites.Case]:
    names = suites.SUITES if args.suite == "all" else [s.strip() for s in args.suite.split(",") if s.strip()]
    size = "tiny" if args.tiny else "quick" if args.quick else "full"
    cases = [c for s in names for c in suites.cases(s, size)]
    if args.only:
        only = {v.strip() for v in args.only.split(",")}
        cases = [c for c in cases if c.variant in only or c.program in only]
    if args.shapes:
        shapes = {tuple(int(x) for x in s.strip().lower().split("x")) for s in args.shapes.split(",")}
        cases = [c for c in cases if (c.B, c.N) in shapes]
    if args.dims:
        dims = {int(d) for d in args.dims.split(",")}
        cases = [c for c in cases if c.D in dims]
    return cases


SHARED = "measured in suite"


def reuse_key(variant, mode, shape, dtype, device) -> tuple:
    return (variant, mode, shape, str(dtype).replace("torch.", ""), device)


def wanted(case: suites.Case, env: Env) -> list[str]:
    return [b for b in case.backends if env.backends is None or b in env.backends]


def attempted(row: dict) -> set[str]:
    """Backends with a time, an n/a or an error in ``row``."""
    return {b for b in suites.BACKENDS if row.get(f"{b}_ms") not in (None, "") or row.get(f"{b}_note")}


def run_case(case: suites.Case, env: Env, done: dict) -> dict:
    """Measure ``case``, or list the measurement another suite made of the same case (in this
    run or an earlier one into the same CSV) when it covers this suite's backends."""
    key = reuse_key(case.variant, case.mode, case.shape, env.dtype, env.device)
    prev = done.get(key)
    if prev is not None and prev["suite"] != case.suite and set(wanted(case, env)) <= attempted(prev):
        shared = f"{SHARED} {prev['suite']}"
        return dict(prev, suite=case.suite, notes=f"{prev['notes']} | {shared}" if prev["notes"] else shared)
    try:
        row = measure(case, env)
    except Exception as e:   # noqa: BLE001 — inputs or FLOP count failed: record, go on
        row = dict(suite=case.suite, variant=case.variant, program=case.program, mode=case.mode,
                   B=case.B, H=case.H, M=case.M, N=case.N, D=case.D, shape=case.shape,
                   dtype=str(env.dtype).replace("torch.", ""), device=env.device,
                   notes="case failed: " + short(e, 300))
        release(env)
    done[key] = row
    return row


def progress(total: int):
    """A tqdm bar on a terminal; otherwise (tqdm missing, output captured to a file, where every
    redraw would be a line) a stand-in with the same methods: each row line counts [i/n]."""
    try:
        from tqdm import tqdm
        if sys.stderr.isatty():
            return tqdm(total=total, unit="case", dynamic_ncols=True, file=sys.stderr)
        raise ImportError
    except ImportError:
        class Bar:
            def set_postfix_str(self, s):
                pass

            def update(self, n=1):
                pass

            def write(self, s):
                print(s, flush=True)

            def close(self):
                pass
        return Bar()


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument("--suite", default="all", help=f"all, or a comma list of {', '.join(suites.SUITES)}")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer shapes")
    size.add_argument("--tiny", action="store_true", help="tiny shapes (CPU plumbing check)")
    p.add_argument("--only", help="comma list of variant (or program) names")
    p.add_argument("--shapes", help="comma list of BxN (batch x key length) to keep, e.g. 16x1024,1x16384")
    p.add_argument("--backends", help="comma list of backends to run (default: each case's): "
                   + ", ".join(suites.BACKENDS))
    p.add_argument("--dims", help="comma list of head dims to keep, e.g. 128")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=DTYPES, help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--rep", type=int, default=50, help="do_bench repetition time, ms")
    p.add_argument("--warmup", type=int, default=10, help="do_bench warmup time, ms")
    p.add_argument("--out", help="results directory (default $OUT, else benchmarks/results/<gpu>-<date>)")
    p.add_argument("--time-limit", type=float, help="start no new case after this many seconds")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--keep-tune-cache", action="store_true",
                   help="reuse the on-disk caches: Flashlight's tuning results, Triton's and Inductor's compiled "
                        "code (default: fresh ones per run, so every system's first call compiles cold)")
    p.add_argument("--b-env", help="also time flashlight_b: Flashlight with these environment variables, "
                   "e.g. FLASHLIGHT_TMA=1 (comma list of NAME=VALUE); the table's xB = B ms / A ms")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="also time flashlight_cg and flex_cg: both under mode=\"reduce-overhead\" (CUDA graphs)")
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cases = select(args)
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2
    if args.list:
        for c in cases:
            print(f"{c.suite:9} {c.variant:18} {c.mode:8} {c.shape}  [{', '.join(c.backends)}]")
        print(f"{len(cases)} cases")
        return 0
    if not cases:
        print("no case matches", file=sys.stderr)
        return 2
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("note: without TRITON_INTERPRET=1 Flashlight's CPU path is its reference evaluator, "
              "not the generated kernels", file=sys.stderr)
    if not args.keep_tune_cache:     # first calls compile cold: Flex's kernels are not left warm by an
        # earlier run on the machine (session 8: five Flex first calls read 0.4-0.5 s after training)
        for var, prefix in (("FLASHLIGHT_CACHE_DIR", "flashlight-bench-"), ("TRITON_CACHE_DIR", "triton-bench-"),
                            ("TORCHINDUCTOR_CACHE_DIR", "inductor-bench-")):
            os.environ[var] = tempfile.mkdtemp(prefix=prefix)
    configure_dynamo()
    torch.set_float32_matmul_precision("highest")      # the fp32 reference without TF32
    dtype = DTYPES[args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")]
    env = Env(device=args.device, dtype=dtype, warmup=args.warmup, rep=args.rep,
              tol=1e-3 if dtype == torch.float32 else 2e-2,
              backends=tuple(args.backends.split(",")) if args.backends else None,
              b_env=dict(kv.split("=", 1) for kv in args.b_env.split(",")) if args.b_env else {})
    if env.b_env:       # right after flashlight in every case (and kept by --backends)
        cases = [dataclasses.replace(c, backends=(c.backends[0], "flashlight_b", *c.backends[1:])) for c in cases]
        if env.backends and "flashlight_b" not in env.backends:
            env.backends += ("flashlight_b",)
    if args.cuda_graphs:    # both after the rest (their CUDA graph pools stay allocated for the case)
        graphed = [g for g in ("flashlight_cg", "flex_cg") if env.backends is None or g[:-3] in env.backends]
        cases = [dataclasses.replace(c, backends=(*c.backends, *(g for g in graphed if g[:-3] in c.backends)))
                 for c in cases]
        if env.backends:
            env.backends += tuple(graphed)
    out = args.out or default_out(args.device)
    os.makedirs(out, exist_ok=True)
    sink = CsvSink(os.path.join(out, "results.csv"))
    gpu = torch.cuda.get_device_name() if env.cuda else "cpu"
    print(f"benchmarks: {len(cases)} cases, torch {torch.__version__}, {gpu}, {str(dtype).replace('torch.', '')} "
          f"-> {sink.path}", flush=True)

    rows, t0 = [], time.perf_counter()
    done = {reuse_key(r["variant"], r["mode"], r["shape"], r["dtype"], r["device"]): r
            for r in read_csv(sink.path) if SHARED not in r["notes"]}
    bar = progress(len(cases))
    for i, case in enumerate(cases):
        if args.time_limit is not None and time.perf_counter() - t0 > args.time_limit:
            bar.write(f"time limit: {len(cases) - i} cases not started")
            break
        bar.set_postfix_str(f"{case.suite} {case.variant} {case.shape}")
        t_case = time.perf_counter()
        row = run_case(case, env, done)
        sink.write(row)
        rows.append(row)
        lines = "\n    ".join(backend_line(row, b) for b in wanted(case, env))
        bar.write(f"[{i + 1}/{len(cases)} at {time.perf_counter() - t0:.0f}s] {case.suite} {case.variant} "
                  f"{case.shape} {case.mode} ({time.perf_counter() - t_case:.1f}s)\n    {lines}")
        bar.update(1)
    bar.close()

    print(f"\ntotal {time.perf_counter() - t0:.0f}s, {len(rows)} rows -> {sink.path}")
    if not args.no_plots:
        for p in plot_all(read_csv(sink.path), out):
            print(f"plot: {p}")
    summary = f"{LEGEND}\n{table(rows)}"
    with open(os.path.join(out, "summary.txt"), "a") as f:
        f.write(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {gpu}\n{summary}\n\n")
    print(summary, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
