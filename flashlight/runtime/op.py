"""Runtime (DESIGN.md §7): each fused region is a call of the ``flashlight::region`` custom op.

The op takes the region's key and its input tensors. It has a fake implementation (shapes only)
and registered autograd, so Dynamo, AOT autograd, Inductor and CUDA graphs treat it as opaque.
On CUDA it launches the generated kernel; on CPU it runs the same kernel under the Triton
interpreter when ``TRITON_INTERPRET=1``, and otherwise the region's reference evaluator.
The op also returns the fp32 row statistics of every reduction (``ir.region.rowstat_columns``),
which autograd saves with the inputs — never a score-sized tensor. The backward
(``flashlight::region_backward``) launches the generated FA2-style kernels (``codegen/backward.py``,
``runtime/backward.py``) when the region supports it and the inputs run kernels; otherwise
(float64, unsupported regions) it differentiates the reference evaluator. A graph with nothing
but regions and views (``backend.runs_as_is``) calls the same implementations without the
dispatcher: ``region_direct`` for inference, ``RegionFunction`` for training.
"""
from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from .._compat import fast_launch, with_scratch
from ..codegen import CodegenError, generate, generate_backward
from ..codegen.gluon import generate_gluon, gluon_pays, gluon_support
from ..ir import Region
from ..ir.evaluate import evaluate, evaluate_all, evaluate_with_rowstats
from ..ir.region import body_loads, from_output, rowstat_columns
from ..ir.scaling import shift_gradients
from ..sparsity import STAT_BLOCK, dead_predicate, reads_loaded_rows, useful
from ..tune import (INTERPRETER, ROWS, Config, TuningCache, backward_candidates, backward_heuristic, bucket, candidates,
                    cdiv, fit_rows, head_block, heuristic, pow2, smaller)
from . import background, decode, descriptors, gluon
from .backward import BackwardKernels, fused_dq, group_loop
from .buffers import unwritten
from .cache import load_module, source_hash
from .quick import OWN_COMPILED, QuickStart, compile_own_for, compile_quick, quick_wanted  # noqa: F401

REGISTRY: dict[str, "CompiledRegion"] = {}
MEASURE_SPARSITY = False     # set by explain(): record the fraction of key blocks skipped


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass
class CompiledRegion:
    region: Region
    source: str
    name: str
    path: Path
    kernel: object
    stats: list = field(default_factory=list)       # sparsity.BlockStat, recomputed every call
    key: str = ""                                   # registry key: kernel name + sizes
    tuned: dict = field(default_factory=dict)      # shape bucket -> Config
    launches: int = 0
    skipped: float | None = None     # fraction of (M, N) blocks skipped on the last measured call
    max_autotune: bool = False       # time the config space (a compile asked for mode="max-autotune")
    sparse: bool = False             # the mask may skip key blocks (picks the default config)
    loaded_rows: bool = False        # the mask reads a loaded value at the query position (document ids)
    body_loads: int = 0              # floating loads in the score program (picks the backward's default)
    bwd_kernel: BackwardKernels | None = None    # generated backward, or None: the reference VJP (bwd_reason says why)
    bwd_compiled: bool = False       # compile_backward ran (first differentiable forward or backward, or explain())
    bwd_name: str = ""
    bwd_source: str = ""             # all three backward kernels (row gradients, dK/dV, dQ)
    bwd_reason: str = ""
    bwd_launches: int = 0
    split: object = None             # decode.SplitKernels once compiled (False: not splittable)
    metas: dict = field(default_factory=dict)       # (config, stats, TMA) -> (grid, launch_meta)
    gfwd: background.Tier = field(default_factory=background.Tier)   # the Gluon forward (runtime.gluon)
    quick: QuickStart | bool | None = None      # the first calls' kernel (None: not decided; False: none)
    bwd_prefetch: dict | None = None  # kernel -> its background compile (None: not started)
    tma: dict = field(default_factory=dict)         # input -> dims its descriptor loads stride over
    fused_dq: bool = False           # its backward adds dQ in the dK/dV kernel (FLASHLIGHT_ATOMIC_DQ, read once)
    group_loop: str = "auto"         # its dK/dV kernel's group loop (FLASHLIGHT_GROUP_LOOP, read once)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.region.result_shape

    @functools.cached_property
    def shape_bucket(self) -> tuple[int, ...]:
        """The tuning bucket of this region's sizes (fixed: a registry entry is per sizes)."""
        r = self.region
        return bucket(r.M, r.N, math.prod(r.batch))

    # -- forward ------------------------------------------------------------------------------
    def check(self, inputs: list[torch.Tensor]) -> None:
        spec = self.region.inputs
        if len(inputs) != len(spec):
            raise ValueError(f"{self.name}: expected {len(spec)} inputs, got {len(inputs)}")
        for x, s in zip(inputs, spec):
            if x.shape != s.shape:        # a torch.Size compares as the tuple it is
                raise ValueError(f"{self.name}: input {s.name} has shape {tuple(x.shape)}, compiled for {s.shape}")
        devices = {x.device for x in inputs if x.dim() > 0}
        if len(devices) > 1:
            raise RuntimeError(f"{self.name}: inputs on several devices: {sorted(map(str, devices))}")

    def uses_kernel(self, inputs: list[torch.Tensor]) -> bool:
        return not self.float64 and (inputs[0].is_cuda or interpreting())

    @functools.cached_property
    def float64(self) -> bool:
        """A float64 input with dims (gradcheck): the reference evaluator runs, since tl.dot has
        no fp64 path. A float64 scalar (a Python float Dynamo lifted) promotes nothing, as
        torch's rule for 0-d tensors says. Fixed per entry (the key holds the input dtypes)."""
        return any(x.dtype == torch.float64 for x in self.region.inputs if len(x.shape))

    @functools.cached_property
    def rowstats_shape(self) -> tuple[int, ...]:
        """Fixed per entry, like ``shape_bucket``: read on every training forward."""
        r = self.region
        return (*r.batch, r.M, rowstat_columns(r)[1])

    def forward(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return self.run(inputs)[0]

    def infer(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        """The output alone (``flashlight::region_infer``): the kernel stores no row statistics."""
        return self.infer_all(inputs)[0]

    def infer_all(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The output and the row outputs (``flashlight::region_rows_infer``), no statistics."""
        return self.run_all(inputs, stats=False)[0]

    def run(self, inputs: list[torch.Tensor], block_stats: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The output and the row statistics the backward reads (``flashlight::region``).
        ``block_stats``: filled with the sparsity statistics computed here (``block_stat_args``),
        which the backward may reuse — the inputs they come from are saved tensors, so autograd's
        version check rejects an in-place change in between."""
        outs, rowstats = self.run_all(inputs, block_stats=block_stats)
        return outs[0], rowstats

    def forward_all(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The output, the region's extra row outputs (each (*batch, M)) and the row statistics
        the generated backward reads (``flashlight::region_rows``); from the reference evaluator,
        statistics of the same shape that its backward (the reference VJP) never reads."""
        outs, rowstats = self.run_all(inputs)
        if rowstats is None:
            rowstats = inputs[0].new_empty(self.rowstats_shape, dtype=torch.float32)
        return [*outs, rowstats]

    def run_all(self, inputs: list[torch.Tensor], stats: bool = True,
                block_stats: dict | None = None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """[output, *row outputs] and the row statistics (None from the reference evaluator of a
        region with row outputs, which only ``forward_all`` runs, and when ``stats`` is off)."""
        self.check(inputs)
        if not self.uses_kernel(inputs):
            if self.region.rows:
                outs = evaluate_all(self.region, inputs)
                return [x.to(dt) for x, dt in zip(outs, self.out_dtypes)], None
            if not stats:
                return [evaluate(self.region, inputs).to(self.region.out_dtype)], None
            out, rowstats = evaluate_with_rowstats(self.region, inputs)
            return [out.to(self.region.out_dtype)], rowstats
        if MEASURE_SPARSITY:
            cfg = self.config(inputs)
            self.skipped = skipped_fraction(self.region, inputs, cfg.BLOCK_M, cfg.BLOCK_N)
        return self.fitting(inputs, lambda cfg: self.launch(inputs, cfg, stats, block_stats))

    def fitting(self, inputs: list[torch.Tensor], launch, kernel: str = "fwd", tune=None):
        """``launch`` under this size's config for ``kernel`` (``"fwd"``, or the backward's
        ``"dkdv"`` / ``"dq"``); a config that does not fit the kernel (shared memory, at its
        first compile) is replaced for good by the next smaller one. ``tune``: a launch free of
        side effects, for timing configs (default ``launch``)."""
        cfg = self.config(inputs, kernel, tune or launch)
        while True:
            try:
                return launch(cfg)
            except OutOfResources:
                cfg = smaller(cfg)
                if cfg is None:
                    raise
                self.tuned[self.tuning_key(kernel)] = cfg

    def tuning_key(self, kernel: str) -> tuple:
        return self.shape_bucket if kernel == "fwd" else (kernel, *self.shape_bucket)

    @property
    def out_dtypes(self) -> list[torch.dtype]:
        return [self.region.out_dtype] + [x.dtype for x in self.region.rows]

    def new_outputs(self, like: torch.Tensor, fresh=unwritten) -> list[torch.Tensor]:
        r = self.region
        rows = [fresh(like.new_empty((*r.batch, r.M), dtype=x.dtype)) for x in r.rows]
        return [fresh(like.new_empty(self.out_shape, dtype=r.out_dtype)), *rows]

    def launch(self, inputs: list[torch.Tensor], cfg: Config, stats: bool = True,
               block_stats: dict | None = None, gluon_ok: bool = True) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """One forward: [output, *row outputs] and the fp32 row statistics (the split-KV combine
        kernel stores them too, so the generated backward serves both paths). Without ``stats``
        the kernels skip those stores (they get a one-element placeholder) and None is returned.
        The split-KV kernels first, then the Gluon forward where it applies (``gluon_ok``: the
        autotuner times Triton configs), else the Triton kernel under ``cfg``."""
        r = self.region
        outs = self.new_outputs(inputs[0])
        rowstats = unwritten(inputs[0].new_empty(self.rowstats_shape if stats else (1,), dtype=torch.float32))
        split = self.split_kernels() if decode.may_split(r, inputs[0].device) else None
        done = bool(split) and split.launch(inputs, outs, rowstats, cfg, stats, block_stats)
        # a shift taking a gradient needs its argmax saved, which only the Triton forward keeps
        gluon_applies = not done and gluon_ok and not (stats and self.keeps_argmax) and self.gluon_applies(inputs)
        if gluon_applies:
            done = self.gfwd.launch(lambda: compile_gluon(self), lambda kernel: gluon.launch(
                kernel, r, kernel_args(r, self.stats, inputs, outs, rowstats, block_stats), inputs, stats))
        if not done:
            tma = descriptors.flag(self.tma, inputs)
            meta = self.metas.get((cfg, stats, tma))
            if meta is None:      # per config: the grid and the constexprs (host time on every call)
                meta = self.metas[cfg, stats, tma] = ((cdiv(r.M, cfg.BLOCK_M), math.prod(r.batch)),
                                                      launch_meta(r, cfg, stats, tma, self.scans))
            args = kernel_args(r, self.stats, inputs, outs, rowstats, block_stats)
            quick = self.quick_start(inputs, gluon_ok, meta[1]["SCAN_BLOCKS"])
            if quick is None:
                launch_kernel(self.kernel, meta[0], args, meta[1], inputs[0].device if tma else None)
            else:
                quick.launch(r, cfg, stats, inputs, outs, rowstats, meta[0])
            if gluon_applies:       # by default the Gluon forward compiles in the background from here
                self.gfwd.submit_after(compile_gluon_for, inputs[0].device, self, args, inputs, stats)
            if quick is not None and quick.future is None:      # then this region's own kernel
                quick.future = background.submit(compile_own_for, inputs[0].device, self, args, meta)
        self.launches += 1
        return outs, (rowstats if stats else None)

    def gluon_applies(self, inputs: list[torch.Tensor]) -> bool:
        """May this launch run the Gluon forward (sm_90, ``FLASHLIGHT_GLUON``, where it measured
        faster, ``runtime.gluon.usable``), unless it has none or it failed? By default it
        compiles on a background thread (``runtime.background.Tier``: its code generation,
        import and Triton compile), submitted right after the first call's Triton launch, and
        the Triton kernel serves every call until it is ready (a tiered JIT)."""
        mode = gluon.mode()
        return not (self.gfwd.kernel is False or mode == "0" or (mode != "all" and self.gluon_slower)
                    or not gluon.runs_on(inputs[0].device) or self.gluon_unsupported
                    or not gluon.usable(self.region, inputs))

    @functools.cached_property
    def gluon_unsupported(self) -> bool:
        """Has the region no Gluon forward (``gluon_support``)? Asked before ``gluon.usable``, which
        reads K and V as loads: a K computed in the kernel (``k * scale[h]``) raised there at
        the first call on sm_90 (session 19, H100, RoPE with FLASHLIGHT_KV_LEAVES=0)."""
        return bool(gluon_support(self.region))

    @functools.cached_property
    def keeps_argmax(self) -> bool:
        """Does the forward save a max's argmax for the backward (``shift_gradients``)?"""
        return bool(shift_gradients(self.region))

    @functools.cached_property
    def gluon_slower(self) -> bool:
        """Did the Triton kernel measure faster for regions like this one (``gluon_pays``)?"""
        return bool(gluon_pays(self.region))

    @functools.cached_property
    def scans(self) -> bool:
        """Does the forward kernel read SCAN_BLOCKS (``reads_scan``)?"""
        return reads_scan(self.source, self.name)

    def quick_start(self, inputs: list[torch.Tensor], gluon_ok: bool, scan: int) -> QuickStart | None:
        """The kernel of this launch if it is the quick one (``QuickStart``), else None: decided
        at the region's first launch (``scan``: its SCAN_BLOCKS), and None for good once its own
        kernel has compiled."""
        if not gluon_ok:        # the autotuner times the region's own kernel's configs
            return None
        q = self.quick
        if q is None:
            q = self.quick = quick_wanted(self, inputs, gluon_ok, scan) and compile_quick(self)
        if not q:
            return None
        capturing = inputs[0].is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing or (q.future is not None and q.future.done()):
            # its own kernel is compiled (a failed compile raises at its launch); a CUDA graph
            # being captured waits for it: a replay would keep the dense kernel for good
            if q.future is not None:
                q.future.exception()
            self.quick = False
            return None
        return q

    def split_kernels(self):
        """The split-KV kernels (compiled at first use; None where the region cannot split, ``codegen.split.splittable``)."""
        if self.split is None:
            self.split = decode.compile_split(self.region, torch.backends.cuda.matmul.allow_tf32,
                                              interpreting()) or False
        return self.split or None

    def config(self, inputs: list[torch.Tensor], kernel: str = "fwd", tune=None) -> Config:
        """Launch config of ``kernel`` for these sizes: memory, then disk (an earlier tuning), then
        autotuning when it was asked for (CUDA only; ``tune`` launches a config, default the
        forward), else the heuristic. The backward's two tile kernels (``"dkdv"``, ``"dq"``) have
        their own spaces, heuristics and tuning results."""
        r = self.region
        mem_key = self.tuning_key(kernel)
        if mem_key in self.tuned:          # the per-call path: one dict lookup
            return self.tuned[mem_key]
        if inputs[0].device.type != "cuda" or interpreting():
            cfg = INTERPRETER
        else:
            block_d = max(head_block(r.DK), head_block(r.DV))
            key = TuningCache.key(bucket(r.M, r.N, math.prod(r.batch)), torch.cuda.get_device_name(inputs[0].device))
            disk = TuningCache(self.path.parent, self.name if kernel == "fwd" else f"{self.bwd_name}_{kernel}")
            cfg = disk.load().get(key)
            default = self.default_config(kernel)
            if cfg is None and self.max_autotune:
                space = candidates(block_d, len(r.dots), r.M) if kernel == "fwd" else backward_candidates(block_d, kernel)
                cfg = self.autotune(tune or (lambda c: self.launch(inputs, c, gluon_ok=False)), space, default)
                disk.store(key, cfg)
            elif cfg is None:
                cfg = default
        self.tuned[mem_key] = cfg
        return cfg

    def default_config(self, kernel: str = "fwd") -> Config:
        """The GPU launch config of ``kernel`` without tuning (``tune.heuristic`` for the forward,
        ``tune.backward_heuristic`` for ``"dkdv"`` / ``"dq"``)."""
        r = self.region
        block_d = max(head_block(r.DK), head_block(r.DV))
        return heuristic(block_d, len(r.dots), self.sparse, r.M) if kernel == "fwd" else \
            fit_rows(backward_heuristic(block_d, kernel, self.sparse, len(r.dots),
                                        self.loaded_rows, self.body_loads, any(rd.scan for rd in r.reductions)), r.M)

    def autotune(self, launch, configs: list[Config], default: Config) -> Config:
        """The fastest of ``default`` and ``configs`` (``launch(cfg)`` runs one and returns what
        it wrote: tensors, in lists or tuples) whose results agree with the default's
        (``agree``): a block shape the compiler gets wrong is never picked, however fast. The
        reference is the default's results (the config the GPU tests run), or where it does not
        fit those of the smaller configs ``fitting`` would fall back to, in order — never an
        arbitrary candidate, which could be the wrong one."""
        from triton.testing import do_bench
        ref, fallback = None, default
        while ref is None and fallback is not None:     # what fitting() would run, in order
            try:
                ref = tensors_in(launch(fallback))
            except Exception:  # noqa: BLE001 — does not fit: the next smaller one
                fallback = smaller(fallback)
        best, best_t = default, float("inf")
        for cfg in [default] + [c for c in configs if c != default]:
            try:
                if ref is None or not agree(ref if cfg == fallback else tensors_in(launch(cfg)), ref):
                    continue
                t = do_bench(lambda: launch(cfg), warmup=5, rep=20, return_mode="median")
            except Exception:  # noqa: BLE001 — a config that does not fit (shared memory) is skipped
                continue
            if t < best_t:
                best, best_t = cfg, t
        return best

    # -- backward -----------------------------------------------------------------------------
    def backward(self, inputs: list[torch.Tensor], rowstats: torch.Tensor, out: torch.Tensor | None,
                 grad: torch.Tensor, block_stats: dict | None = None,
                 needed: Sequence[bool] | None = None, row_grads: list[torch.Tensor] | None = None) -> list[torch.Tensor | None]:
        """The generated kernels: row gradients, then dK/dV (and the body loads' gradients) over
        key blocks, then dQ over query blocks, each tile kernel under its own config. Integer and
        bool inputs may get None. ``out``: the forward's output (None from a graph compiled
        before the op took it). ``block_stats``: the forward's sparsity statistics, if kept.
        ``needed``: which inputs' gradients are wanted (autograd's ``needs_input_grad``; None:
        all): a kernel that writes none of them is not launched, and the unneeded gradients are
        None (trainable sink logits under frozen q, k, v need the row kernel alone). ``row_grads``:
        the extra row outputs' gradients (``flashlight::region_rows``)."""
        k = self.backward_kernels()
        if k is None or not self.uses_kernel(inputs) or (out is None and from_output(self.region)):
            return self.reference_backward(inputs, grad if row_grads is None else [grad, *row_grads])
        tiles = k.needed_kernels(needed)
        rows = self.rows_config(inputs)
        bufs = k.buffers(inputs, tiles)
        block_stats = {} if block_stats is None else block_stats    # shared by the two tile kernels
        self.prefetched("rows")
        drows = k.launch_rows(inputs, rowstats, grad if out is None else out, grad, bufs, rows,   # out unread then
                              row_grads or ())
        if k.sums is not None and tiles:        # the row gradients of sums a later pass reads
            self.prefetched("sums")
            sums = functools.partial(k.launch_tile, "sums")
            self.fitting(inputs, lambda cfg: sums(inputs, rowstats, drows, bufs, block_stats, cfg), "sums",
                         tune=lambda cfg: tuned_run(k, "sums", sums, inputs, rowstats, drows, block_stats, cfg))
        for kernel, launch in (("dkdv", k.launch_dkdv), ("dq", k.launch_dq)):
            self.prefetched(kernel)
            if kernel not in tiles:
                continue

            def triton(kernel=kernel, launch=launch):
                self.fitting(inputs, lambda cfg: launch(inputs, rowstats, drows, bufs, block_stats, cfg), kernel,
                             tune=lambda cfg: tuned_run(k, kernel, launch, inputs, rowstats, drows, block_stats, cfg))
            k.run_tile(kernel, inputs, rowstats, drows, bufs, block_stats, triton)   # on Hopper, Gluon where it applies
        self.bwd_launches += 1
        return k.results(inputs, bufs, needed)

    def prefetch_backward(self, inputs: list[torch.Tensor], out: torch.Tensor, rowstats: torch.Tensor,
                          block_stats: dict) -> None:
        """At the first forward that may be differentiated: generate the backward and start its
        three kernels' compiles on background threads (``BackwardKernels.prefetch``), in
        parallel and while the program goes on to its loss; the first backward waits for them.
        On a GPU with background compiles, no autotuning (which times configs at the backward)
        and ``FLASHLIGHT_PREFETCH`` not ``0``; ``force`` also under the interpreter (CPU tests:
        the launches are built, the compiles are Triton's interpreter's no-ops)."""
        if self.bwd_prefetch is not None:
            return
        self.bwd_prefetch = {}
        mode = os.environ.get("FLASHLIGHT_PREFETCH", "1")
        if mode == "0" or not background.enabled() or self.max_autotune or self.bwd_launches or \
                not (mode == "force" or (inputs[0].is_cuda and not interpreting())):
            return
        try:
            k = self.backward_kernels()
            if k is None or not self.uses_kernel(inputs):
                return
            configs = {"rows": self.rows_config(inputs), "dkdv": self.config(inputs, "dkdv"),
                       "dq": self.config(inputs, "dq"), "sums": self.config(inputs, "sums")}
            self.bwd_prefetch = k.prefetch(inputs, rowstats, out, block_stats, configs)
        except Exception:  # noqa: BLE001 — a forward never fails for its backward: that reports it
            if os.environ.get("FLASHLIGHT_STRICT") == "1":
                raise
            self.bwd_compiled, self.bwd_kernel = False, None

    def prefetched(self, kernel: str) -> None:
        """Wait for ``kernel``'s compile started at the first forward, if any (its error, if
        any, is the launch's to raise: the launch compiles it again)."""
        if self.bwd_prefetch:
            future = self.bwd_prefetch.pop(kernel, None)
            if future is not None:
                future.exception()

    def rows_config(self, inputs: list[torch.Tensor]) -> Config:
        return ROWS if inputs[0].is_cuda and not interpreting() else INTERPRETER

    def backward_kernels(self) -> BackwardKernels | None:
        """The generated backward, compiled at first use (~0.1 s of a first call that inference
        never needs); None when the region uses the reference VJP (``bwd_reason``)."""
        if not self.bwd_compiled:
            compile_backward(self)
        return self.bwd_kernel

    def differentiable_backward(self, inputs: Sequence[torch.Tensor], grad: torch.Tensor,
                                needed: Sequence[bool]) -> list[torch.Tensor | None]:
        """The gradients of a backward under ``create_graph=True`` (a gradient penalty, a
        Hessian-vector product): the reference program's, recomputed from the saved inputs with
        autograd recording, so a second backward differentiates them exactly (the kernels' are
        constants to autograd: their second-order terms would silently be zero). Materialises
        the scores, as eager does; None for inputs not ``needed``."""
        wanted = [x for x, want in zip(inputs, needed) if want]
        with torch.enable_grad():
            out = evaluate(self.region, list(inputs))
            got = iter(torch.autograd.grad(out, wanted, grad.to(out.dtype), create_graph=True, allow_unused=True))
        return [next(got) if want else None for want in needed]

    def reference_backward(self, inputs: list[torch.Tensor], grad: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
        """Vector-Jacobian product of the reference evaluator. ``torch.func.vjp`` rather than
        ``torch.autograd.grad``: a custom op's implementation runs below the autograd key.
        ``grad`` is a list (output, then rows) for a region with extra row outputs."""
        pos = [i for i, x in enumerate(inputs) if x.is_floating_point()]
        run = evaluate_all if isinstance(grad, list) else evaluate

        def fn(*floats):
            xs = list(inputs)
            for i, f in zip(pos, floats):
                xs[i] = f
            return run(self.region, xs)
        out, vjp = torch.func.vjp(fn, *(inputs[i] for i in pos))
        grads = dict(zip(pos, vjp([g.to(o.dtype) for g, o in zip(grad, out)] if isinstance(grad, list)
                                  else grad.to(out.dtype))))
        # each gradient takes its input's layout, as the fake implementation promises
        return [torch.empty_like(x).copy_(grads[i]) if i in grads else torch.zeros_like(x)
                for i, x in enumerate(inputs)]


def kernel_args(r: Region, block_stats: list, inputs: list[torch.Tensor], outs: list[torch.Tensor],
                rowstats: torch.Tensor, cache: dict | None = None) -> list:
    """Positional arguments of a generated kernel: inputs, outputs (with strides), the row
    statistics for the backward (*batch, M, W), the block statistics its sparsity scan reads,
    and the sizes."""
    args: list = []
    for x in [*inputs, *outs]:
        args += [x, *x.stride()]
    args += [rowstats, r.M * rowstats.shape[-1], rowstats.shape[-1]]
    args += block_stat_args(block_stats, inputs, cache)
    return args + [*r.batch, r.M, r.N]


def tensors_in(result) -> list[torch.Tensor]:
    """The tensors in a launch's result (nested lists and tuples; None skipped)."""
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for x in result or () for t in tensors_in(x)]


def tuned_run(k: BackwardKernels, kernel: str, run, inputs: list[torch.Tensor], rowstats: torch.Tensor, drows,
              block_stats: dict, cfg: Config) -> list[torch.Tensor]:
    """One backward tile kernel (``kernel``: ``"dkdv"``, ``"dq"`` or ``"sums"``, launched by
    ``run``) into buffers of its own, for timing configs: the gradients it wrote. The sums
    kernel adds into the row gradients: it runs on a copy of them, which it returns."""
    bufs = k.buffers(inputs, kernel)
    drow = drows[0].clone() if kernel == "sums" else drows[0]
    run(inputs, rowstats, (drow, *drows[1:]), bufs, block_stats, cfg)
    return [bufs[i] for i in k.plan.written(kernel)] + ([drow] if kernel == "sums" else [])


TUNE_AGREEMENT = 2e-2      # per element, relative to |reference| + its tensor's RMS
NEGLIGIBLE = 1e-5          # a tensor this small against the largest result is rounding noise


def agree(got: list[torch.Tensor], ref: list[torch.Tensor], tol: float = TUNE_AGREEMENT) -> bool:
    """Do two configs' results match up to summation order? Infinities and NaNs in the same
    places, and every other element within ``tol`` * (|reference| + the reference tensor's RMS):
    reordered fp32 sums stored in bf16 differ by an ulp or two (<= 0.8%), a miscompiled block
    shape by O(1) in the elements it touches, however few. A tensor whose RMS is below
    ``NEGLIGIBLE`` times the largest one's (a gradient that is zero up to rounding, such as a
    per-query bias's under a softmax: fp32 atomics leave noise there) is checked only for
    infinities and NaNs."""
    if len(got) != len(ref):
        return False
    finite = [torch.where(y.isfinite(), y.float(), 0.0) for y in ref]
    rms = [float(y.square().mean().sqrt()) if y.numel() else 0.0 for y in finite]
    largest = max(rms, default=0.0)
    for x, y, y0, s in zip(got, ref, finite, rms):
        x, y = x.float(), y.float()
        same = (x == y) | (x.isnan() & y.isnan())
        diff = torch.where(same, 0.0, x - y)
        if not bool(diff.isfinite().all()):
            return False
        if s >= NEGLIGIBLE * largest and not bool((diff.abs() <= tol * (y0.abs() + s)).all()):
            return False
    return True


def reads_scan(source: str, name: str) -> bool:
    """Does the ``@triton.jit`` function ``name`` in ``source`` read its SCAN_BLOCKS constexpr
    (a block scan's vector size, a power of two per length), beyond declaring it? Kernels without
    a scan get 1: the same compile then serves every length. True where ``name`` is not found
    (a kernel named otherwise than its region: the value it always had)."""
    start = source.find(f"def {name}(")
    if start < 0:
        return True
    body = source[start:]
    end = body.find("\n@triton.jit", 1)
    return (body if end < 0 else body[:end]).count("SCAN_BLOCKS") > 1


def launch_meta(r: Region, cfg: Config, stats: bool | None = None, tma: bool | None = None,
                scan: bool = True) -> dict:
    """Constexpr and launch keyword arguments of a generated kernel (``stats``: the forward's
    STATS constexpr, ``tma``: the TMA one; None for kernels without it; ``scan``: the kernel
    reads SCAN_BLOCKS, ``reads_scan``)."""
    return dict(DK=r.DK, DV=r.DV, EVEN_M=r.M % cfg.BLOCK_M == 0, EVEN_N=r.N % cfg.BLOCK_N == 0,
                SCAN_BLOCKS=pow2(cdiv(r.N, cfg.BLOCK_N)) if scan else 1,
                BLOCK_DK=head_block(r.DK), BLOCK_DV=head_block(r.DV), **cfg.as_kwargs(),
                **({} if stats is None else {"STATS": stats}), **({} if tma is None else {"TMA": tma}))


def launch_kernel(kernel, grid, args: list, meta: dict, scratch) -> None:
    """``kernel[grid](*args, **meta)``; ``scratch``: the device of a launch whose kernel makes
    tensor descriptors (its global scratch comes from ``_compat.with_scratch``), else None."""
    if scratch is None:
        kernel[grid](*args, **meta)
    else:
        with_scratch(scratch, lambda: kernel[grid](*args, **meta))


def skipped_fraction(region: Region, inputs, block_m: int, block_n: int) -> float | None:
    """Fraction of (M, N) blocks outside each row block's [first live, last live] range — what
    the kernel's scan skips when its intervals are exact (index masks, sorted ids); None when the
    score grid is too large to evaluate here."""
    from ..ir.evaluate import Evaluator
    if math.prod(region.batch) * region.M * region.N > 1 << 26:
        return None
    members = region.passes()[0]
    dead = dead_predicate(region, members)
    if not useful(dead):
        return 0.0
    ev = Evaluator(region, inputs)
    d = ev.full(ev.ctx_s(dead), ev.ctx_s).bool().flatten(0, -3)       # [batch, M, N]
    nm, nn = cdiv(region.M, block_m), cdiv(region.N, block_n)
    pad = torch.nn.functional.pad(d, (0, nn * block_n - region.N, 0, nm * block_m - region.M), value=True)
    live = ~pad.view(-1, nm, block_m, nn, block_n).all(4).all(2)      # [batch, nm, nn]
    idx = torch.arange(nn, device=live.device).expand_as(live)
    first = torch.where(live, idx, nn).amin(-1, keepdim=True)
    last = torch.where(live, idx, -1).amax(-1, keepdim=True)
    visited = (idx >= first) & (idx <= last)
    return 1.0 - visited.float().mean().item()


def block_stat_args(block_stats: list, inputs: list[torch.Tensor], cache: dict | None = None) -> list:
    """Kernel arguments of the per-block min/max a sparsity test reads (sparsity.BlockStat),
    per STAT_BLOCK positions whatever the kernel's blocks. ``cache`` shares them between kernels:
    the backward's two tile kernels, and the forward's with its backward (``RegionFunction``)."""
    args, cache = [], {} if cache is None else cache
    for st in block_stats:
        key = (st.input, st.dim)
        if key not in cache:
            cache[key] = block_minmax(inputs[st.input], st.dim, STAT_BLOCK)
        lo, hi = cache[key]
        args += [lo, hi, *lo.stride()]
    return args


def block_minmax(x: torch.Tensor, dim: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of ``x`` over blocks of ``block`` along ``dim`` (O(numel), every call).

    Few host calls on purpose — this runs on the host path of every call: the ragged last block
    is padded by repeating the last element (neutral for both min and max), one ``aminmax``
    reduces, and the results are strided views (the kernel takes their strides), not copies."""
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    n = x.shape[dim]
    nb = cdiv(n, block)
    last = dim in (-1, x.dim() - 1)
    xt = x if last else x.movedim(dim, -1)
    if nb * block != n:
        xt = torch.cat([xt, xt[..., -1:].expand(*xt.shape[:-1], nb * block - n)], -1)
    lo, hi = torch.aminmax(torch.unflatten(xt, -1, (nb, block)), dim=-1)     # not Tensor.unflatten's wrapper
    return (lo, hi) if last else (lo.movedim(-1, dim), hi.movedim(-1, dim))


def compile_region(region: Region) -> CompiledRegion:
    """Generate, write and import the kernel for ``region``; register it under its key."""
    placeholder = "fl_fwd"
    source, stats, tma = generate(region, placeholder, allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                                  interpret=interpreting())
    name = f"fl_fwd_{source_hash(source)}"
    source = source.replace(f"def {placeholder}(", f"def {name}(")
    # one kernel per source (shared by all lengths); one registry entry per region and sizes, and
    # per backward option (an A/B of FLASHLIGHT_ATOMIC_DQ or _GROUP_LOOP in one process compiles both backwards)
    atomic_dq, group = fused_dq(), group_loop()
    key = f"{name}_{source_hash(str(region))}" + ("_atomic_dq" if atomic_dq else "") + \
        ("" if group == "auto" else f"_group{group}")
    if key not in REGISTRY:
        module, path = load_module(name, source)
        kernel = fast_launch(getattr(module, name), interpreting())
        dead = dead_predicate(region, region.passes()[0])
        sparse = useful(dead)
        c = CompiledRegion(region, source, name, path, kernel, stats, key=key, sparse=sparse,
                           loaded_rows=sparse and reads_loaded_rows(dead), tma=tma, fused_dq=atomic_dq,
                           group_loop=group, body_loads=body_loads(region))
        REGISTRY[key] = c
    return REGISTRY[key]


def compile_gluon(c: CompiledRegion):
    """The region's Gluon forward kernel (``codegen.gluon``; a ``FastLaunch``), or None where it has none. Its
    block scan reads the same statistics as the Triton kernel's (``c.stats``: the generators
    derive both from the region the same way; checked here)."""
    if gluon_support(c.region):
        return None
    placeholder = "fl_gfwd"
    try:
        source, stats = generate_gluon(c.region, placeholder)
        if stats != c.stats:
            raise CodegenError("the Gluon kernel's block statistics differ from the Triton kernel's")
    except CodegenError:
        if os.environ.get("FLASHLIGHT_STRICT") == "1":
            raise
        return None         # the Triton kernel serves: a fused region never fails for want of Gluon
    name = f"fl_gfwd_{source_hash(source)}"
    module, _ = load_module(name, source.replace(placeholder, name))
    return fast_launch(getattr(module, name), interpreting())     # descriptors and all (_compat.FastLaunch)


def compile_gluon_for(c: CompiledRegion, args: list, inputs: list[torch.Tensor], stats: bool):
    """``compile_gluon``, then Triton's compile of the kernel for this launch's specialisation
    (no launch): the background task of the Gluon forward's tier (``CompiledRegion.gfwd``)."""
    kernel = compile_gluon(c)
    if kernel is not None:
        gluon.compile_for(kernel, c.region, args, inputs, stats)
    return kernel


def compile_backward(c: CompiledRegion) -> None:
    """Generate and import the region's backward kernels, or record why it uses the reference."""
    placeholder = "fl_bwd"
    c.bwd_compiled = True
    try:
        source, stats = generate_backward(c.region, placeholder, interpret=interpreting(),
                                          allow_tf32=torch.backends.cuda.matmul.allow_tf32, fused_dq=c.fused_dq,
                                          group=c.group_loop)
    except CodegenError as e:
        c.bwd_reason = str(e)
        return
    c.bwd_name = f"fl_bwd_{source_hash(source)}"
    c.bwd_source = source.replace(f"def {placeholder}", f"def {c.bwd_name}")     # and its _dq, _rows
    module, _ = load_module(c.bwd_name, c.bwd_source)
    kernel = lambda suffix: fast_launch(getattr(module, f"{c.bwd_name}{suffix}"), interpreting())       # noqa: E731
    plan = stats.plan
    sums = bool(plan.chained)      # the sums kernel (codegen.backward.SumsWriter)
    c.bwd_kernel = BackwardKernels(c.region, stats, kernel("_rows"), None if plan.fused_kv else kernel(""),
                                   None if plan.fused_dq else kernel("_dq"), kernel("_sums") if sums else None,
                                   scans={"dkdv": not plan.fused_kv and reads_scan(c.bwd_source, c.bwd_name),
                                          "dq": not plan.fused_dq and reads_scan(c.bwd_source, f"{c.bwd_name}_dq"),
                                          "sums": sums and reads_scan(c.bwd_source, f"{c.bwd_name}_sums")})


@torch.library.custom_op("flashlight::region", mutates_args=())
def region_op(key: str, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, fp32 row statistics for the backward). A graph calls this op only where it may
    be differentiated (``backend.replace``; else ``region_infer``), and inside a compiled
    graph its inputs no longer say which need a gradient: the first call starts the backward's
    compiles, as ``RegionFunction.forward`` does."""
    c, inputs, block_stats = REGISTRY[key], list(inputs), {}
    out, rowstats = c.run(inputs, block_stats)
    if c.bwd_prefetch is None:
        c.prefetch_backward(inputs, out, rowstats, block_stats)
    return out, rowstats


@region_op.register_fake
def _region_fake(key: str, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    c = REGISTRY[key]
    return (inputs[0].new_empty(c.out_shape, dtype=c.region.out_dtype),
            inputs[0].new_empty(c.rowstats_shape, dtype=torch.float32))


@torch.library.custom_op("flashlight::region_infer", mutates_args=())
def region_infer_op(key: str, inputs: list[torch.Tensor]) -> torch.Tensor:
    """The output alone, for graphs that need no gradient (no row statistics are stored)."""
    return REGISTRY[key].infer(list(inputs))


@region_infer_op.register_fake
def _region_infer_fake(key: str, inputs: list[torch.Tensor]) -> torch.Tensor:
    c = REGISTRY[key]
    return inputs[0].new_empty(c.out_shape, dtype=c.region.out_dtype)


def region_direct(key: str, inputs: list[torch.Tensor]) -> torch.Tensor:
    """``flashlight::region_infer`` without the dispatcher: what an FX graph that runs as is
    (no Inductor, no autograd, backend.runs_as_is) calls."""
    return REGISTRY[key].infer(inputs)


def region_rows_direct(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flashlight::region_rows_infer`` without the dispatcher (``region_direct``'s twin)."""
    return REGISTRY[key].infer_all(list(inputs))


class RegionFunction(torch.autograd.Function):
    """``flashlight::region`` and its registered autograd without the dispatcher: what an FX
    graph that runs as is calls where it may be differentiated. The custom op's Python autograd
    layer (pytree flattening, redispatch, and a second op for the backward) cost more host time
    per training step than the four kernel launches (docs/notes.md, session 5); the saved
    tensors and the kernels are the same."""

    @staticmethod
    def forward(ctx, key: str, *tensors: torch.Tensor):
        ctx.block_stats = {}        # the sparsity statistics, reused by the backward
        c = REGISTRY[key]
        out, rowstats = c.run(list(tensors), ctx.block_stats)
        if c.bwd_prefetch is None and any(ctx.needs_input_grad[1:]):
            c.prefetch_backward(list(tensors), out, rowstats, ctx.block_stats)
        ctx.key = key
        ctx.mark_non_differentiable(rowstats)
        ctx.set_materialize_grads(False)       # no zero fill for the row statistics' (absent) gradient
        ctx.save_for_backward(*tensors, rowstats, out)      # the inputs, O(M) row statistics, the output
        return out, rowstats

    @staticmethod
    def backward(ctx, grad, _grad_rowstats):
        *tensors, rowstats, out = ctx.saved_tensors
        if grad is None:        # the output did not reach the loss
            return None, *[None] * len(tensors)
        needed = ctx.needs_input_grad[1:]
        if torch.is_grad_enabled():     # create_graph=True: these gradients are differentiated in turn
            return None, *REGISTRY[ctx.key].differentiable_backward(tensors, grad, needed)
        grads = REGISTRY[ctx.key].backward(tensors, rowstats, out, grad, ctx.block_stats, needed)
        return None, *[g if want else None for g, want in zip(grads, needed)]


def region_train_direct(key: str, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``flashlight::region`` (with autograd) for an FX graph that runs as is."""
    return RegionFunction.apply(key, *inputs)


@torch.library.custom_op("flashlight::region_backward", mutates_args=())
def region_backward(key: str, inputs: list[torch.Tensor], rowstats: torch.Tensor, grad: torch.Tensor,
                    out: torch.Tensor | None = None, needed: list[bool] | None = None) -> list[torch.Tensor]:
    """``out`` and ``needed`` last and optional: a backward graph compiled (and cached on disk
    by Inductor) before they were arguments still calls this op correctly (the reference VJP
    then serves regions whose backward reads the output; every gradient is computed).
    ``needed``: which inputs' gradients the graph uses (the others are zeros)."""
    grads = REGISTRY[key].backward(list(inputs), rowstats, out, grad, needed=needed)
    return [unused_gradient(x) if needed is not None and not needed[i] else torch.zeros_like(x) if g is None else g
            for i, (g, x) in enumerate(zip(grads, inputs))]     # the schema: tensors


def unused_gradient(x: torch.Tensor) -> torch.Tensor:
    """What ``region_backward`` returns for an input whose gradient the graph drops (the schema
    returns a tensor per input): one zero broadcast to its shape (stride 0), not a memset of
    its size. The fake implementation returns the same layout (Inductor checks it)."""
    return x.new_zeros(()).expand(x.shape)


@region_backward.register_fake
def _region_backward_fake(key: str, inputs: list[torch.Tensor], rowstats: torch.Tensor, grad: torch.Tensor,
                          out: torch.Tensor | None = None, needed: list[bool] | None = None) -> list[torch.Tensor]:
    return [unused_gradient(x) if needed is not None and not needed[i] else torch.empty_like(x)
            for i, x in enumerate(inputs)]      # each gradient in its input's layout


def _setup_context(ctx, inputs, output):
    key, tensors = inputs
    ctx.key = key
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(*tensors, output[1], output[0])      # the inputs, O(M) row statistics, the output


def _backward(ctx, grad, _grad_rowstats):
    *tensors, rowstats, out = ctx.saved_tensors
    needed = list(ctx.needs_input_grad[1])      # (key, [one per tensor]): the op's arguments' structure
    grads = region_backward(ctx.key, tensors, rowstats, grad, out, needed)
    return None, [g if want else None for g, want in zip(grads, needed)]


region_op.register_autograd(_backward, setup_context=_setup_context)


# -- regions with extra row outputs (logsumexp, row max, ...): one op returning all of them ------
# [output, *row outputs, row statistics]: the generated backward reads the statistics (and the
# output) as ``flashlight::region``'s does, with the row outputs' gradients as more seeds of the
# row kernel (``codegen.gradients.output_seeds``).
@torch.library.custom_op("flashlight::region_rows", mutates_args=())
def region_rows_op(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return REGISTRY[key].forward_all(list(inputs))


@region_rows_op.register_fake
def _region_rows_fake(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    c = REGISTRY[key]       # shapes only: nothing to poison
    return [*c.new_outputs(inputs[0], fresh=lambda x: x), inputs[0].new_empty(c.rowstats_shape, dtype=torch.float32)]


@torch.library.custom_op("flashlight::region_rows_infer", mutates_args=())
def region_rows_infer_op(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """[output, *row outputs] for graphs that need no gradient: no row statistics are stored."""
    return REGISTRY[key].infer_all(list(inputs))


@region_rows_infer_op.register_fake
def _region_rows_infer_fake(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return REGISTRY[key].new_outputs(inputs[0], fresh=lambda x: x)


@torch.library.custom_op("flashlight::region_rows_backward", mutates_args=())
def region_rows_backward(key: str, inputs: list[torch.Tensor], grads: list[torch.Tensor],
                         rowstats: torch.Tensor | None = None, out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``rowstats`` and ``out`` last and optional: a backward graph compiled before they were
    arguments still calls this op (the reference VJP then serves it)."""
    c, inputs = REGISTRY[key], list(inputs)
    if rowstats is None or out is None:
        return c.reference_backward(inputs, list(grads))
    grads = c.backward(inputs, rowstats, out, grads[0], row_grads=list(grads[1:]))
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]    # the schema: tensors


@region_rows_backward.register_fake
def _region_rows_backward_fake(key: str, inputs: list[torch.Tensor], grads: list[torch.Tensor],
                               rowstats: torch.Tensor | None = None, out: torch.Tensor | None = None) -> list[torch.Tensor]:
    return [torch.empty_like(x) for x in inputs]


def _setup_rows_context(ctx, inputs, output):
    key, tensors = inputs
    ctx.key = key
    ctx.mark_non_differentiable(output[-1])
    ctx.save_for_backward(*tensors, output[-1], output[0])     # the inputs, row statistics, the output
    ctx.out_like = [(o.shape, o.dtype) for o in output[:-1]]


def _backward_rows(ctx, grads):
    *tensors, rowstats, out = ctx.saved_tensors
    like = tensors[0]
    grads = [g if g is not None else like.new_zeros(shape, dtype=dt) for g, (shape, dt) in zip(grads, ctx.out_like)]
    grads = region_rows_backward(ctx.key, tensors, grads, rowstats, out)
    return None, [g if t.is_floating_point() else None for g, t in zip(grads, tensors)]


region_rows_op.register_autograd(_backward_rows, setup_context=_setup_rows_context)
