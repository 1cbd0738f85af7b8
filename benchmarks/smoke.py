"""Smoke benchmark: every ``flashlight.examples`` variant against FlexAttention, SDPA and Inductor.

    python -m benchmarks.smoke [--n 4096] [--b 4] [--h 16] [--d 64] [--out DIR] [--variants a,b]

For each variant (bf16 inputs on CUDA): is it fused (``flashlight.explain``), relative error
against an fp32 eager reference for flashlight / flex / SDPA, median time
(``triton.testing.do_bench``) of flashlight, flex (cached block mask), flex with
``create_block_mask`` inside the timed call, SDPA cuDNN and flash (where SDPA can express the
variant), and plain ``torch.compile`` (Inductor); first-call (compile) time of flashlight and flex;
TFLOP/s counting ``4 B H M N D * density`` useful FLOPs. Every measured path is wrapped: a failure
records NaN plus a note and the run goes on. Results go to ``$OUT/smoke.csv`` when ``OUT`` is set,
else ``--out`` (default ``benchmarks/results``); a fixed-width table is printed last.

Nothing touches CUDA at import time.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F

import flashlight
from flashlight.examples import FLEX_NAMES, VARIANTS
from flashlight.testing import rel_error

from . import flex_equivalents as fe

NAN = float("nan")

COLUMNS = ["variant", "fused", "err_flashlight", "err_flex", "err_sdpa", "ms_flashlight", "ms_flex",
           "ms_flex_with_mask", "ms_sdpa_cudnn", "ms_sdpa_flash", "ms_compile", "speedup_vs_flex",
           "compile_s_flashlight", "compile_s_flex", "tflops_flashlight", "tflops_flex", "density",
           "compile_s_inductor", "err_compile", "shapes", "notes"]

SDPA_VARIANTS = ("vanilla", "causal", "gqa", "key_padding", "cross_attention")


# ------------------------------------------------------------------------------------ helpers
def configure_dynamo() -> None:
    cfg = torch._dynamo.config
    for attr in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(cfg, attr):
            try:
                setattr(cfg, attr, 1000)
            except Exception:   # an alias that refuses assignment: the other name did it
                pass


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def short(e: BaseException, limit: int = 200) -> str:
    """One line: the exception, with its root cause first when it was chained (Dynamo wraps)."""
    root, seen = e, set()
    while (root.__cause__ or root.__context__) is not None and id(root) not in seen:
        seen.add(id(root))
        root = root.__cause__ or root.__context__
    msg = " ".join(str(e).split())
    if root is not e:
        msg = f"[{type(root).__name__}: {' '.join(str(root).split())[:120]}] {msg}"
    return f"{type(e).__name__}: {msg}"[:limit]


class Notes:
    """Collects per-variant failure messages; ``attempt`` turns an exception into NaN."""

    def __init__(self):
        self.items: list[str] = []

    def attempt(self, label: str, fn, default=NAN):
        try:
            return fn()
        except Exception as e:   # noqa: BLE001 — a smoke run must never abort
            self.items.append(f"{label}: {short(e)}")
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                try:
                    torch.cuda.synchronize()
                except Exception:
                    pass
                torch.cuda.empty_cache()
            return default

    def __str__(self) -> str:
        return " | ".join(self.items)


def make_bench(device: str, warmup: int, rep: int):
    if device.startswith("cuda"):
        from triton.testing import do_bench

        def bench(fn):
            return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    else:   # CPU dry run of the script's logic (not a benchmark)
        def bench(fn):
            fn()
            ts = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
            return sorted(ts)[1]
    return bench


def first_call(fn, device: str):
    """(output, seconds) of the first call: compile + autotune + one run."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def to_fp32(x):
    return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def qkv_dims(name: str, inputs):
    """B, H (query heads), M, N, D of the attention ``attention(*inputs)`` computes."""
    q, k = inputs[0], inputs[1]
    if name == "cross_attention":      # BSHD
        B, M, H, D = q.shape
        N = k.shape[1]
    else:
        B, H, M, D = q.shape
        N = k.shape[-2]
    return B, H, M, N, D


# ---------------------------------------------------------------------------------- density
def density(name: str, inputs) -> float:
    """Exact fraction of (q, kv) pairs that are attended, computed on the CPU in O(M) memory per
    row chunk (never an N x N tensor on the GPU)."""
    B, H, M, N, D = qkv_dims(name, inputs)
    q = torch.arange(M, dtype=torch.int64)
    if name in ("vanilla", "softcap", "gqa", "cross_attention"):
        return 1.0
    if name in ("causal", "alibi"):
        kept = (q + 1).clamp(max=N)
    elif name == "sliding_window":
        lo = (q - fe.WINDOW + 1).clamp(min=0)
        hi = q.clamp(max=N - 1)
        kept = (hi - lo + 1).clamp(min=0)
    elif name == "prefix_lm":
        kept = (q + 1).clamp(min=fe.PREFIX).clamp(max=N)
    elif name == "key_padding":
        valid = inputs[3].to("cpu")
        return float(valid.sum().item()) * M / (B * M * N)
    elif name == "document_mask":
        ids = inputs[3].to("cpu")
        kv = torch.arange(N)
        total, chunk = 0, 512
        for b in range(B):
            for s in range(0, M, chunk):
                qi = torch.arange(s, min(s + chunk, M))
                keep = (ids[b, qi][:, None] == ids[b, :N][None, :]) & (kv[None, :] <= qi[:, None])
                total += int(keep.sum())
        return total / (B * M * N)
    else:
        raise KeyError(name)
    return float(kept.sum().item()) / (M * N)


# ------------------------------------------------------------------------------------- SDPA
def sdpa_call(name: str, inputs):
    """A zero-argument SDPA call computing the same attention, or None if SDPA can't say it."""
    sdpa = F.scaled_dot_product_attention
    if name == "vanilla":
        q, k, v = inputs
        return lambda: sdpa(q, k, v)
    if name == "causal":
        q, k, v = inputs
        return lambda: sdpa(q, k, v, is_causal=True)
    if name == "gqa":
        q, k, v = inputs
        return lambda: sdpa(q, k, v, enable_gqa=True)
    if name == "key_padding":
        q, k, v, key_valid = inputs
        mask = key_valid[:, None, None, :]
        return lambda: sdpa(q, k, v, attn_mask=mask)
    if name == "cross_attention":      # BSHD in, attention() returns BHSD: transpose inputs only
        q, k, v = (x.transpose(1, 2) for x in inputs)
        return lambda: sdpa(q, k, v)
    return None


def bench_sdpa_backend(bench, call, backend):
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel(backend), warnings.catch_warnings():
        warnings.simplefilter("ignore")    # "flash can't take attn_mask" etc.: the note says it
        call()                          # raise here (not inside do_bench) if unsupported
        return bench(call)


# ---------------------------------------------------------------------------------- a variant
def run_variant(name: str, args, bench) -> dict:
    from torch.nn.attention import SDPBackend

    mod = VARIANTS[name]
    dev = args.device
    notes = Notes()
    row = {c: NAN for c in COLUMNS}
    row.update(variant=name, fused="?", notes="")
    log = lambda msg: print(f"  [{name}] {msg}", flush=True)  # noqa: E731

    torch.manual_seed(0)
    inputs = mod.make_inputs(args.b, args.h, M=args.n, D=args.d, dtype=torch.bfloat16, device=dev)
    B, H, M, N, D = qkv_dims(name, inputs)
    row["shapes"] = f"B={B} H={H} M={M} N={N} D={D}"
    row["density"] = notes.attempt("density", lambda: density(name, inputs))
    flops = 4.0 * B * H * M * N * D * row["density"]
    log(f"{row['shapes']} density={row['density']:.4f}")

    # fp32 eager reference (fully masked rows are NaN in eager; defined as 0, like flex)
    def reference():
        with torch.no_grad():
            out = mod.attention(*(to_fp32(x) for x in inputs))
        return torch.nan_to_num(out, nan=0.0)
    ref = notes.attempt("reference", reference, default=None)
    sync(dev)

    def err(label, out_fn):
        if ref is None:
            return NAN
        return notes.attempt(f"err_{label}", lambda: rel_error(out_fn(), ref))

    # flashlight
    fl = torch.compile(mod.attention, backend="flashlight", dynamic=False)
    res = notes.attempt("flashlight first call", lambda: first_call(lambda: fl(*inputs), dev), default=None)
    if res is not None:
        out, row["compile_s_flashlight"] = res
        row["err_flashlight"] = err("flashlight", lambda: out)
        del out
    report = notes.attempt("explain", lambda: flashlight.explain(mod.attention, *inputs), default=None)
    if report is not None:
        row["fused"] = "yes" if report.regions else "no"
        if not report.regions and report.fallbacks:
            notes.items.append("fallback: " + " ".join(str(report.fallbacks[0]).split())[:200])
    if res is not None:
        row["ms_flashlight"] = notes.attempt("ms_flashlight", lambda: bench(lambda: fl(*inputs)))
    log(f"flashlight fused={row['fused']} err={row['err_flashlight']:.2e} "
        f"ms={row['ms_flashlight']:.3f} compile={row['compile_s_flashlight']:.1f}s")

    # FlexAttention
    bm = notes.attempt("create_block_mask", lambda: fe.make_block_mask(name, inputs), default="fail")
    if bm != "fail":
        res = notes.attempt("flex first call", lambda: first_call(lambda: fe.run_flex(name, inputs, bm), dev),
                            default=None)
        if res is not None:
            out, row["compile_s_flex"] = res
            row["err_flex"] = err("flex", lambda: out)
            del out
            row["ms_flex"] = notes.attempt("ms_flex", lambda: bench(lambda: fe.run_flex(name, inputs, bm)))
    row["ms_flex_with_mask"] = notes.attempt(
        "ms_flex_with_mask",
        lambda: bench(lambda: fe.run_flex(name, inputs, fe.make_block_mask(name, inputs))))
    del bm
    log(f"flex err={row['err_flex']:.2e} ms={row['ms_flex']:.3f} "
        f"ms+mask={row['ms_flex_with_mask']:.3f} compile={row['compile_s_flex']:.1f}s")

    # SDPA (default backend choice for the error; cuDNN / flash timed where they accept it)
    call = sdpa_call(name, inputs)
    if call is not None:
        row["err_sdpa"] = err("sdpa", call)
        row["ms_sdpa_cudnn"] = notes.attempt(
            "sdpa_cudnn", lambda: bench_sdpa_backend(bench, call, SDPBackend.CUDNN_ATTENTION))
        row["ms_sdpa_flash"] = notes.attempt(
            "sdpa_flash", lambda: bench_sdpa_backend(bench, call, SDPBackend.FLASH_ATTENTION))
        log(f"sdpa err={row['err_sdpa']:.2e} cudnn={row['ms_sdpa_cudnn']:.3f} "
            f"flash={row['ms_sdpa_flash']:.3f}")

    # plain torch.compile (Inductor)
    if not args.no_inductor:
        ic = torch.compile(mod.attention, dynamic=False)
        res = notes.attempt("inductor first call", lambda: first_call(lambda: ic(*inputs), dev), default=None)
        if res is not None:
            out, row["compile_s_inductor"] = res
            row["err_compile"] = err("compile", lambda: out)
            del out
            row["ms_compile"] = notes.attempt("ms_compile", lambda: bench(lambda: ic(*inputs)))
        log(f"inductor err={row['err_compile']:.2e} ms={row['ms_compile']:.3f} "
            f"compile={row['compile_s_inductor']:.1f}s")

    row["speedup_vs_flex"] = row["ms_flex"] / row["ms_flashlight"]
    row["tflops_flashlight"] = flops / (row["ms_flashlight"] * 1e-3) / 1e12
    row["tflops_flex"] = flops / (row["ms_flex"] * 1e-3) / 1e12
    row["notes"] = str(notes)
    del ref, inputs
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


# ------------------------------------------------------------------------------------ output
def out_dir(args) -> str:
    d = os.environ.get("OUT") or args.out
    os.makedirs(d, exist_ok=True)
    return d


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({c: (f"{r[c]:.6g}" if isinstance(r[c], float) else r[c]) for c in COLUMNS})


def fmt(x, spec: str) -> str:
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return "-" if math.isnan(x) else "inf"
    return format(x, spec)


TABLE = [  # header, key, width, format
    ("variant", "variant", 15, "s"), ("fus", "fused", 3, "s"),
    ("err_fl", "err_flashlight", 7, ".0e"), ("err_fx", "err_flex", 7, ".0e"),
    ("ms_fl", "ms_flashlight", 7, ".3f"), ("ms_flex", "ms_flex", 7, ".3f"),
    ("ms_fx+bm", "ms_flex_with_mask", 8, ".3f"), ("cudnn", "ms_sdpa_cudnn", 7, ".3f"),
    ("flash", "ms_sdpa_flash", 7, ".3f"), ("inductr", "ms_compile", 7, ".3f"),
    ("xflex", "speedup_vs_flex", 5, ".2f"), ("TF/s", "tflops_flashlight", 5, ".0f"),
    ("cfl_s", "compile_s_flashlight", 5, ".1f"), ("cfx_s", "compile_s_flex", 5, ".1f"),
]


def table(rows: list[dict]) -> str:
    head = " ".join(f"{h:>{w}}" if i else f"{h:<{w}}" for i, (h, _, w, _) in enumerate(TABLE))
    lines = [head]
    for r in rows:
        cells = []
        for i, (_, key, w, spec) in enumerate(TABLE):
            s = fmt(r[key], spec)[:w]
            cells.append(f"{s:>{w}}" if i else f"{s:<{w}}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


# -------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.smoke", description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=4096, help="sequence length M = N (cross: N chosen by make_inputs)")
    p.add_argument("--b", type=int, default=4)
    p.add_argument("--h", type=int, default=16)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    p.add_argument("--variants", default=",".join(FLEX_NAMES), help="comma-separated subset")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    p.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    p.add_argument("--no-inductor", action="store_true", help="skip plain torch.compile")
    p.add_argument("--device", default="cuda", help="'cpu' only dry-runs the script's logic")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        print(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    configure_dynamo()
    torch.set_float32_matmul_precision("highest")     # fp32 reference without TF32
    bench = make_bench(args.device, args.warmup, args.rep)
    path = os.path.join(out_dir(args), "smoke.csv")
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"smoke: torch {torch.__version__}, {gpu}, B={args.b} H={args.h} N={args.n} D={args.d} "
          f"bf16 -> {path}", flush=True)

    rows, t_start = [], time.perf_counter()
    for i, name in enumerate(names):
        t0 = time.perf_counter()
        print(f"[{i + 1}/{len(names)}] {name}", flush=True)
        try:
            row = run_variant(name, args, bench)
        except Exception as e:   # noqa: BLE001 — belt and braces: keep going
            row = {c: NAN for c in COLUMNS}
            row.update(variant=name, fused="?", shapes="", notes=f"run_variant: {short(e, 300)}")
        rows.append(row)
        write_csv(rows, path)    # after every variant, so a killed run keeps what it measured
        print(f"[{i + 1}/{len(names)}] {name} done in {time.perf_counter() - t0:.1f}s", flush=True)

    print(f"total {time.perf_counter() - t_start:.1f}s; csv: {path}", flush=True)
    noted = [r for r in rows if r["notes"]]
    if noted:
        print("notes:")
        for r in noted:
            print(f"  {r['variant']}: {r['notes'][:300]}")
    print("errors: rel. to fp32 eager; ms: do_bench median; xflex = ms_flex / ms_fl; "
          "TF/s = flashlight, 4BHMND*density")
    print(table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
