"""``flashlight.explain``: which regions fused, with what features, and why others did not."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import _compat
from .capture import Fallback
from .capture.sdpa import OP as SDPA_OP
from .ir import Region, free_vars, refs, walk
from .ir.scaling import shift_gradients


def features(region: Region) -> list[str]:
    """Human-readable features of a region, derived from its IR."""
    feats = set()
    bodies = [r.body for r in region.reductions]
    nodes = [x for b in bodies for x in walk(b)]
    from .sparsity import live_branch
    if any(live_branch(x) for x in nodes):
        feats.add("mask")
    if any(x.op == "load" and x.kind != "f" for x in nodes):
        feats.add("data-mask")
    if any(x.op == "load" and x.kind == "f" and {"m", "n"} & free_vars(x) for x in nodes):
        feats.add("bias")
    if any(x.kind == "b" and {"m", "n"} <= free_vars(x) and not refs(x, "load") and not refs(x, "dot")
           for x in nodes):
        feats.add("index-mask")
    bvars = set(region.batch_vars)
    for d in region.dots:     # K/V heads shared by query heads: fewer batch vars, or h // group
        def divisions(e):     # (heads flattened into the batch divide it in Q and K alike: BLOOM)
            return {x for x in walk(e) if x.op == "idiv" and free_vars(x) & bvars}
        if free_vars(d.k) & bvars != free_vars(d.q) & bvars or divisions(d.k) - divisions(d.q):
            feats.add("gqa")
    if any(x.kind == "f" and x.op not in ("load", "const") and {"m", "n"} & free_vars(x)
           and not refs(x, "dot") and not refs(x, "red") for x in nodes):
        feats.add("bias")
    if any(x.op == "tanh" for x in nodes):
        feats.add("softcap")
    if any(x.op == "rand16" for x in nodes):
        feats.add("dropout")
    if any(r.online is not None for r in region.reductions):
        feats.add("online-softmax")
    if len(region.passes()) > 1:
        feats.add(f"{len(region.passes())}-pass")
    if any(r.extra is not None for r in region.reductions):
        feats.add("sink")
    if any(r.scan for r in region.reductions):
        feats.add("key-scan")       # partial sums over the keys (stick-breaking)
    if any(r.kind == "kth" for r in region.reductions):
        feats.add("top-k")              # a row's k-th largest value (topk(...).values[..., -1:]) in the kernel
    if shift_gradients(region):
        feats.add("shift-gradient")     # the output depends on a max shift: its argmax is saved
    if any(r.stopped for r in region.reductions) or any(x.op == "stop" for e in region.exprs() for x in walk(e)):
        feats.add("stop-gradient")      # detach() / no_grad values computed in the kernel, no gradient
    if len(region.dots) > 1:
        feats.add(f"{len(region.dots)}-scores")
    if refs(region.out, "load"):
        feats.add("epilogue")
    if any(x.op == "sum_dv" for x in walk(region.out)):
        feats.add("epilogue-norm")
    if region.out_index is not None:
        feats.add("permuted-store")
    if any(x.op == "load" and refs(x, "load") - {x.args[0]} for d in region.dots for x in walk(d.k)):
        feats.add("paged-kv")       # K read through an index tensor (a block table)
    from .codegen.split import splittable
    from .runtime.decode import MAX_M
    if region.M <= MAX_M and splittable(region):
        feats.add("split-kv")
    if region.rows:
        feats.add(f"{len(region.rows)}-row-outputs")
    from .sparsity import dead_predicate, useful
    if any(useful(dead_predicate(region, p)) for p in region.passes()):
        feats.add("block-sparse")
    if region.M != region.N:
        feats.add("cross")
    return sorted(feats)


@dataclass
class RegionReport:
    kernel: str
    key: str
    path: str
    shapes: dict
    features: list[str]
    source: str
    ir: str
    kernel_source: str
    skipped: float | None = None     # fraction of key blocks the kernel skipped on these inputs
    backward: str = ""               # which backward the region uses, and why
    backward_source: str = ""        # the generated backward kernel ("" for the reference VJP)
    hopper: str = ""                 # the forward (and dK/dV kernel) on an sm_90 GPU: Gluon or Triton, and why

    def __str__(self) -> str:
        s = ", ".join(f"{k}={v}" for k, v in self.shapes.items())
        skip = f"  blocks skipped: {self.skipped:.0%}" if self.skipped else ""
        return f"{self.kernel}  [{s}]  features: {', '.join(self.features) or '-'}{skip}" + \
            f"\n      backward: {self.backward}" + (f"\n      on sm_90: {self.hopper}" if self.hopper else "") + \
            (f"\n      at {self.source}" if self.source else "")


@dataclass
class Report:
    regions: list[RegionReport] = field(default_factory=list)
    fallbacks: list[Fallback] = field(default_factory=list)
    graphs: list[torch.fx.GraphModule] = field(default_factory=list)   # what Inductor received
    graph_breaks: list[str] = field(default_factory=list)   # Dynamo's, during this compile: code around them may run eagerly

    def __str__(self) -> str:
        kept = [f for f in self.fallbacks if f.op == SDPA_OP]   # left to SDPA by design, not failures
        failed = [f for f in self.fallbacks if f not in kept]
        lines = [f"flashlight: {len(self.regions)} fused region(s), {len(failed)} fallback(s)"
                 + (f", {len(kept)} SDPA call(s) left to SDPA" if kept else "")]
        lines += [f"  fused    {r}" for r in self.regions]
        lines += [f"  fallback {f}" for f in failed]
        lines += [f"  sdpa     {f}" for f in kept]
        lines += [f"  break    Dynamo graph break (code around it may run eagerly, unfused): {b}" for b in self.graph_breaks]
        return "\n".join(lines)


def region_report(c, source: str) -> RegionReport:
    """``c``'s report; ``source``: the line of the program that fused it this time (``c.region``
    keeps the first program's: a compiled entry is shared)."""
    r = c.region
    shapes = dict(batch=r.batch, M=r.M, N=r.N, DK=r.DK, DV=r.DV)
    backward = "generated (float64 inputs use the reference VJP)" if c.backward_kernels() is not None else \
        f"reference VJP of the evaluator, materialises the scores ({c.bwd_reason})"
    if c.bwd_kernel is not None and c.bwd_kernel.plan.group:
        backward += f"; {group_note(c.bwd_kernel.plan)}"
    if c.bwd_kernel is not None and c.bwd_kernel.plan.chained:
        sums = sorted({i for reads in c.bwd_kernel.plan.chained.values() for i in reads})
        backward += f"; a sums kernel walks the keys to complete the row gradients of {', '.join(f'red{i}' for i in sums)}" \
            " (read by a later pass)"
    hopper = hopper_forward(r) + (f"; {hopper_backward(r, c.bwd_kernel.plan.fused_dq)}" if c.bwd_kernel is not None
                                  else "")
    return RegionReport(c.name, c.key, str(c.path), shapes, features(r), source, str(r), c.source, c.skipped,
                        backward, c.bwd_source, hopper)


def group_note(plan) -> str:
    """The dK/dV kernel's group loop (``GradPlan.group``), in words."""
    kv = {s.input for s in plan.sites if s.ctx in ("k", "v")}
    how = "stored once" if kv <= plan.stored else "added with atomics (part of the group per program)"
    return f"each dK/dV program visits {plan.group.size} query heads sharing its K/V rows, dK/dV {how}"


def hopper_forward(r: Region) -> str:
    """Which forward an sm_90 GPU runs for this region (``codegen.gluon``), layouts permitting."""
    from .codegen.gluon import gluon_pays, gluon_support
    why = gluon_support(r) or gluon_pays(r)
    return f"Triton kernel ({why})" if why else "Gluon forward (warp-specialised), when K and V are whole [key, head] rows"


def hopper_backward(r: Region, fused_dq: bool = False) -> str:
    """Which tile kernels of the generated backward an sm_90 GPU runs (``codegen.gluon_backward``)."""
    from .codegen.gluon import gluon_pays
    from .codegen.gluon_backward import tiles_support
    from .runtime.gluon import mode
    if any(rd.scan for rd in r.reductions):     # before fused_dq: the scans' plan drops it
        return "a Triton dQ kernel that adds dK and dV with fp32 atomics (partial sums over the keys)"
    if fused_dq:
        return "a Triton dK/dV kernel that adds dQ with fp32 atomics (FLASHLIGHT_ATOMIC_DQ)"
    modes = {mode(k) for k in ("dkdv", "dq")}
    why = tiles_support(r) or ("off: FLASHLIGHT_GLUON_DKDV / _DQ" if "0" in modes else "") or \
        (gluon_pays(r) if "1" in modes else "")
    return f"Triton dK/dV and dQ kernels ({why})" if why else \
        "Gluon dK/dV and dQ kernels (warp-specialised), on whole blocks of 16-bit rows"


def _first_lines(reason: str) -> str:
    """A graph-break reason's first line and its explanation, if it gives one."""
    lines = [ln.strip() for ln in reason.splitlines() if ln.strip()]
    return " ".join(lines[:1] + [ln for ln in lines[1:] if ln.startswith("Explanation:")][:1])


def explain(fn, *args, **kwargs) -> Report:
    """Compile ``fn`` with the flashlight backend, run it once on the given inputs, and report
    every fused region and every attention-like candidate that fell back (with the reason)."""
    from .backend import _LISTENERS, flashlight_backend
    from .runtime import op

    collected: list = []

    def backend(gm, example_inputs):   # a fresh backend object forces a fresh compile
        return flashlight_backend(gm, example_inputs)

    _LISTENERS.append(collected)
    op.MEASURE_SPARSITY = True
    breaks = _compat.graph_breaks()
    try:
        torch.compile(fn, backend=backend)(*args, **kwargs)
    finally:
        _LISTENERS.remove(collected)
        op.MEASURE_SPARSITY = False
    report = Report(graph_breaks=[_first_lines(why) for why, count in _compat.graph_breaks().items()
                                  if count > breaks.get(why, 0)])
    for g in collected:
        report.regions += [region_report(c, s) for c, s in zip(g.regions, g.sources)]
        report.fallbacks += g.fallbacks
        report.graphs.append(g.graph)
    return report
