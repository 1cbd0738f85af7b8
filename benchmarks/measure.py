"""Measuring one case: build every backend's call on the same inputs, time its first call
(compile + tune), check its output against an fp32 eager reference, and time it (median).

    row = measure(case, env)      # a dict with the CSV columns of ``report.COLUMNS``

Backends (a call that one cannot make is "n/a" — printed "–" — never an error):

    flashlight      torch.compile(fn, backend="flashlight", dynamic=False), fresh per case
    flex            torch.compile(flex_attention, dynamic=False), fresh per case; block mask
                    built once, outside the timed call (eager flex_attention on CPU)
    flex_mask       the same compiled flex, with create_block_mask inside the timed call
    sdpa_cudnn/flash/efficient   F.scaled_dot_product_attention under sdpa_kernel(backend)
    inductor        torch.compile(fn) with default settings, one per (program, mode) for the
                    whole run: what a plain user gets (shapes turn dynamic after a change)
    eager           fn itself
    flashlight_b    flashlight again, compiled afresh, every call under the environment
                    variables of ``Env.b_env`` (``run --b-env FLASHLIGHT_TMA=1``): an A/B of an
                    env-gated code path in one process, on the same inputs
    flashlight_cg   flashlight and flex under ``mode="reduce-overhead"`` (``run --cuda-graphs``):
    flex_cg         Inductor's CUDA graph trees replay each call, the host path gone for both

An exception in any backend is recorded in its ``note`` column and the run goes on.
"""
from __future__ import annotations

import gc
import math
import os
import time
import types
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

import flashlight
from flashlight.testing import rel_error

from . import flops as fl
from .report import NA
from .suites import FLASHLIGHTS, PROGRAMS, Case, Program, make_inputs

NO_KERNEL = ("No available kernel", "No viable backend")     # SDPA refusing these inputs
REF_HEADS = 4             # heads the fp32 reference keeps when heads are independent


class NotApplicable(Exception):
    """This backend cannot compute this program; the message says why."""


@dataclass
class Env:
    """Run-wide settings and state shared by every case."""
    device: str
    dtype: torch.dtype
    warmup: int = 10           # do_bench warmup, ms
    rep: int = 50              # do_bench repetitions, ms
    tol: float = 2e-2          # forward rel. error that counts as ok (training: 2.5x)
    backends: tuple[str, ...] | None = None     # None: every backend of the case
    inductor: dict = field(default_factory=dict)     # (program, mode) -> compiled fn
    b_env: dict = field(default_factory=dict)        # flashlight_b's environment (empty: not run)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


# ------------------------------------------------------------------------------ plumbing
def sync(env: Env) -> None:
    if env.cuda:
        torch.cuda.synchronize()


def short(e: BaseException, limit: int = 240) -> str:
    """One line: the exception, with its root cause first when it was chained (Dynamo wraps)."""
    root, seen = e, set()
    while (root.__cause__ or root.__context__) is not None and id(root) not in seen:
        seen.add(id(root))
        root = root.__cause__ or root.__context__
    msg = " ".join(str(e).split())
    if root is not e:
        msg = f"[{type(root).__name__}: {' '.join(str(root).split())[:120]}] {msg}"
    return f"{type(e).__name__}: {msg}"[:limit]


def bench(run: Callable, env: Env) -> float:
    """Median milliseconds of ``run()``: ``triton.testing.do_bench`` on CUDA; on CPU (a plumbing
    check, not a benchmark) one timed call."""
    if env.cuda:
        from triton.testing import do_bench
        return float(do_bench(run, warmup=env.warmup, rep=env.rep, return_mode="median"))
    t0 = time.perf_counter()
    run()
    return (time.perf_counter() - t0) * 1e3


def release(env: Env) -> None:
    """Give cached GPU memory back (after a failure, and between cases)."""
    if env.cuda:
        gc.collect()
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except RuntimeError:     # a broken context: every later case will say so in its notes
            pass


def timed_first_call(run: Callable, env: Env):
    """(result, seconds) of the first call: for compiled backends, compile + tune + one run."""
    sync(env)
    t0 = time.perf_counter()
    out = run()
    sync(env)
    return out, time.perf_counter() - t0


def timed(fn: Callable) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def flashlight_reports(run: Callable):
    """Call ``run`` while collecting the backend's per-graph reports (fused regions and
    fallbacks) instead of compiling a second time through ``flashlight.explain``."""
    from flashlight.backend import _LISTENERS
    collected: list = []
    _LISTENERS.append(collected)
    try:
        return run(), collected
    finally:
        _LISTENERS.remove(collected)


# ------------------------------------------------------------------------------- backends
def _flex_fn(env: Env, shared: dict, mode: str | None = None):
    """A fresh compiled ``flex_attention`` per case and ``mode``, shared by ``flex`` and
    ``flex_mask``."""
    from torch.nn.attention.flex_attention import flex_attention
    if env.cuda:
        if mode not in shared:
            shared[mode] = torch.compile(flex_attention, dynamic=False, mode=mode)
        return shared[mode]
    # CPU: eager flex (its reference implementation) checks the spellings; it warns that it is
    # unfused, which a plumbing check knows
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    return flex_attention


def block_mask(prog: Program, xs):
    from torch.nn.attention.flex_attention import create_block_mask
    q, k, _v, _score, mask_mod, _kw, _out = prog.flex(xs)
    if mask_mod is None:
        return None
    B = q.shape[0] if prog.batch_dependent else None
    return create_block_mask(mask_mod, B=B, H=None, Q_LEN=q.shape[-2], KV_LEN=k.shape[-2], device=q.device)


def _flex_call(prog: Program, xs, fn, mask: Callable):
    q, k, v, score_mod, _mask_mod, kwargs, out_transform = prog.flex(xs)    # spelled once
    return lambda: out_transform(fn(q, k, v, score_mod=score_mod, block_mask=mask(), **kwargs))


def build(backend: str, case: Case, xs, env: Env, shared: dict) -> Callable:
    """A zero-argument call computing ``case``'s program on ``xs`` with ``backend``; ``shared``
    holds what the backends of one case share (the compiled flex)."""
    prog = PROGRAMS[case.program]
    if backend in ("flashlight", "flashlight_cg"):
        fn = torch.compile(prog.fn, backend="flashlight", dynamic=False, mode=CUDA_GRAPHS.get(backend))
        return lambda: fn(*xs)
    if backend == "flashlight_b":
        if not env.b_env:
            raise NotApplicable("no --b-env")
        fn = torch.compile(own_code(prog.fn), backend="flashlight", dynamic=False)
        return lambda: with_environ(env.b_env, lambda: fn(*xs))
    if backend == "inductor":
        key = (case.program, case.mode)
        if key not in env.inductor:
            env.inductor[key] = torch.compile(prog.fn)
        fn = env.inductor[key]
        return lambda: fn(*xs)
    if backend == "eager":
        return lambda: prog.fn(*xs)
    if backend in ("flex", "flex_mask", "flex_cg"):
        if prog.flex is None:
            raise NotApplicable("FlexAttention cannot express this program")
        if backend == "flex_mask" and prog.mask_mod(xs) is None:
            raise NotApplicable("no mask")
        if case.mode == "fwd+bwd" and not env.cuda:
            raise NotApplicable("FlexAttention has no backward on CPU")
        fn = _flex_fn(env, shared, CUDA_GRAPHS.get(backend))
        if backend == "flex_mask":
            return _flex_call(prog, xs, fn, lambda: block_mask(prog, xs))
        bm = block_mask(prog, xs)
        return _flex_call(prog, xs, fn, lambda: bm)
    if backend.startswith("sdpa_"):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        call = prog.sdpa(xs) if prog.sdpa is not None else None
        if call is None:
            raise NotApplicable("SDPA cannot express this program")
        which = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
                 "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]

        def run():
            with sdpa_kernel(which), warnings.catch_warnings():
                warnings.simplefilter("ignore")     # "cuDNN can't take attn_mask": n/a says so
                return call()
        return run
    raise KeyError(backend)


CUDA_GRAPHS = {"flashlight_cg": "reduce-overhead", "flex_cg": "reduce-overhead"}    # backend -> compile mode


def own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own: Dynamo caches a function's compiled graphs on its
    code object, so flashlight_b's compile of the same function could otherwise reuse
    flashlight's graphs, captured without flashlight_b's environment."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def with_environ(values: dict, call: Callable):
    """``call()`` with ``os.environ`` updated by ``values``, restored afterwards."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        return call()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def with_backward(call: Callable, leaves, dout) -> Callable:
    """fwd+bwd: the output and the gradients of ``sum(out * dout)`` w.r.t. q, k, v."""
    def run():
        out = call()
        return (out, *torch.autograd.grad(out, leaves, dout))
    return run


# ------------------------------------------------------------------------------ reference
def slice_input(x, i: int, prog: Program, heads: int | None):
    """Batch 0 (and the first ``heads`` heads) of input ``i``: what the reference computes."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or i in prog.unbatched:
        return x
    x = x[:1]
    return x[:, :heads] if heads and x.dim() == 4 else x


def ref_heads(case: Case) -> int | None:
    # GQA (group > 1): K/V have H / group heads, so slicing q, k, v all to the first heads would
    # pair each query head with the wrong K/V head; the reference then runs every head
    grouped = dict(case.extra).get("group", 1) > 1
    return REF_HEADS if PROGRAMS[case.program].head_sliceable and not grouped and case.H > REF_HEADS else None


def slice_results(results, case: Case) -> list[torch.Tensor]:
    """The part of a backend's (output, *grads) that the reference computed."""
    prog, heads = PROGRAMS[case.program], ref_heads(case)
    out = slice_input(results[0], 0, prog, heads)
    grads = [slice_input(g, i, prog, heads) for i, g in enumerate(results[1:])]
    return [out, *grads]


def reference(case: Case, xs, dout) -> list[torch.Tensor]:
    """fp32 eager on batch 0 (first heads where independent): output (and q, k, v gradients).
    Rows with every key masked come out NaN in eager and 0 in Flashlight and Flex: use 0."""
    prog, heads = PROGRAMS[case.program], ref_heads(case)
    small = [slice_input(x.detach(), i, prog, heads) for i, x in enumerate(xs)]
    small = [x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in small]
    if case.mode == "fwd":
        with torch.no_grad():
            return [torch.nan_to_num(prog.fn(*small), nan=0.0)]
    leaves = [x.requires_grad_() for x in small[:3]]
    out = prog.fn(*leaves, *small[3:])
    d = slice_input(dout, 0, prog, heads).float()
    return [torch.nan_to_num(out.detach(), nan=0.0), *torch.autograd.grad(out, leaves, d)]


def max_rel_error(results, ref, case: Case) -> float:
    got = slice_results(results if isinstance(results, tuple) else (results,), case)
    return max(rel_error(g.detach(), r) for g, r in zip(got, ref))


# ------------------------------------------------------------------------------- one case
def case_flops(case: Case, xs) -> tuple[float, float]:
    """(FLOPs of one call, density = unmasked pairs / all pairs)."""
    prog = PROGRAMS[case.program]
    pairs = fl.unmasked_pairs(prog.mask_mod(xs), case.B, case.M, case.N, xs[0].device, prog.batch_dependent)
    heads = case.H * prog.maps(dict(case.extra))
    fwd = fl.forward_flops(pairs, heads, prog.pair_flops(case.D))
    return fl.total_flops(fwd, case.mode), pairs / (case.B * case.M * case.N)


def measure_backend(backend: str, case: Case, xs, leaves, dout, ref, env: Env, shared: dict) -> dict:
    """ms, err, ok, first_s and note of one backend (ms stays None when it failed)."""
    cell = dict(ms=None, err=None, ok=None, first_s=None, ready_s=None, note="", fused=None)
    try:
        call = build(backend, case, xs, env, shared)
        run = call if case.mode == "fwd" else with_backward(call, leaves, dout)
        if backend in FLASHLIGHTS:
            (results, first_s), graphs = flashlight_reports(lambda: timed_first_call(run, env))
            cell["fused"] = sum(len(g.regions) for g in graphs)
            fallbacks = [f for g in graphs for f in g.fallbacks]
            if fallbacks:
                cell["note"] = "fallback: " + " ".join(str(fallbacks[0]).split())[:200]
        else:
            results, first_s = timed_first_call(run, env)
        cell["first_s"] = NA if backend in ("eager", "flex_mask") or backend.startswith("sdpa") else first_s
        if ref is not None:
            cell["err"] = max_rel_error(results, ref, case)
        del results
        if backend in FLASHLIGHTS:
            # kernels compiling in the background (the Gluon forward: runtime/background.py) take
            # over once ready; the time is measured, and the output checked, after that
            cell["ready_s"] = first_s + timed(flashlight.wait)
            if ref is not None:
                results = run()
                cell["err"] = max(cell["err"], max_rel_error(results, ref, case))
                del results
        if ref is not None:
            tol = env.tol * (2.5 if case.mode == "fwd+bwd" else 1.0)
            cell["ok"] = bool(cell["err"] <= tol)
        cell["ms"] = bench(run, env)
    except NotApplicable as e:
        cell.update(ms=NA, err=NA, ok=NA, first_s=NA, note=f"n/a: {e}")
    except Exception as e:   # noqa: BLE001 — a benchmark run never aborts on one backend
        if any(m in str(e) for m in NO_KERNEL):
            cell.update(ms=NA, err=NA, ok=NA, first_s=NA, note="n/a: no SDPA kernel for these inputs")
        else:
            cell["note"] = "error: " + short(e)
    if cell["note"].startswith("error"):
        release(env)      # here, not in the except block: its traceback still holds the tensors
    return cell


def measure(case: Case, env: Env) -> dict:
    """Every backend of ``case`` on one set of inputs; returns the row (``report.COLUMNS``)."""
    torch.manual_seed(0)
    xs = list(make_inputs(case, env.dtype, env.device))
    row = dict(suite=case.suite, variant=case.variant, program=case.program, mode=case.mode,
               B=case.B, H=case.H, M=case.M, N=case.N, D=case.D, shape=case.shape,
               dtype=str(env.dtype).replace("torch.", ""), device=env.device, notes="")
    notes = []
    leaves, dout = None, None
    if case.mode == "fwd+bwd":
        xs[:3] = leaves = [x.detach().requires_grad_() for x in xs[:3]]
    try:
        flops, row["density"] = case_flops(case, xs)
        row["gflop"] = flops / 1e9
    except Exception as e:   # noqa: BLE001
        flops = math.nan
        notes.append("flops: " + short(e))
    ref = None
    try:
        if case.mode == "fwd+bwd":
            with torch.no_grad():     # the output's shape, from a run on meta tensors
                meta = [x.detach().to("meta") if isinstance(x, torch.Tensor) else x for x in xs]
                out = PROGRAMS[case.program].fn(*meta)
            dout = torch.randn(out.shape, dtype=out.dtype, device=env.device)
        ref = reference(case, xs, dout)
        row["ref"] = "fp32 eager, batch 0" + (f", heads 0-{ref_heads(case) - 1}" if ref_heads(case) else "")
    except Exception as e:   # noqa: BLE001
        row["ref"] = "none"
        notes.append("reference: " + short(e))
    shared: dict = {}
    for b in case.backends:
        if env.backends is not None and b not in env.backends:
            continue
        cell = measure_backend(b, case, xs, leaves, dout, ref, env, shared)
        if b == "flashlight":
            row["fused"] = cell["fused"]
        for k in ("ms", "err", "ok", "first_s", "ready_s", "note"):
            row[f"{b}_{k}"] = cell[k]
        if isinstance(cell["ms"], float):
            row[f"{b}_tflops"] = fl.tflops(flops, cell["ms"])
        elif cell["ms"] == NA:
            row[f"{b}_tflops"] = NA
    add_speedups(row)
    row["notes"] = " | ".join(notes)
    del xs, leaves, dout, ref
    release(env)
    return row


def add_speedups(row: dict) -> None:
    """``{b}_vs_flex`` = flex ms / b ms (> 1: b is faster than Flex), and Flashlight's speedup
    over torch.compile, eager and the fastest SDPA backend."""
    def ms(b):
        v = row.get(f"{b}_ms")
        return v if isinstance(v, float) else None
    flex = ms("flex")
    for b in [k[:-3] for k in list(row) if k.endswith("_ms")]:
        if ms(b) is not None:
            row[f"{b}_vs_flex"] = flex / ms(b) if flex is not None else NA
    fl_ms = ms("flashlight")
    sdpa = [ms(b) for b in ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient") if ms(b) is not None]
    for name, other in (("compile", ms("inductor")), ("eager", ms("eager")), ("sdpa", min(sdpa) if sdpa else None)):
        if fl_ms is not None and other is not None:
            row[f"flashlight_vs_{name}"] = other / fl_ms
