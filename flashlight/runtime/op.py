"""Runtime (DESIGN.md §7): each fused region is a call of the ``flashlight::region`` custom op.

The op takes the region's key and its input tensors. It has a fake implementation (shapes only)
and registered autograd, so Dynamo, AOT autograd, Inductor and CUDA graphs treat it as opaque.
On CUDA it launches the generated kernel; on CPU it runs the same kernel under the Triton
interpreter when ``TRITON_INTERPRET=1``, and otherwise the region's reference evaluator.
The backward (``flashlight::region_backward``) currently differentiates the reference evaluator.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton

from ..codegen import generate
from ..ir import Region
from ..ir.evaluate import compute_dtype, evaluate, evaluate_all
from ..tune import Config, TuningCache, bucket, candidates, head_block
from . import decode
from .cache import load_module, source_hash

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
    split: object = None             # decode.SplitKernels once compiled (False: not splittable)

    @property
    def out_shape(self) -> tuple[int, ...]:
        r = self.region
        return (*r.batch, r.M, r.DV)

    # -- forward ------------------------------------------------------------------------------
    def check(self, inputs: list[torch.Tensor]) -> None:
        spec = self.region.inputs
        if len(inputs) != len(spec):
            raise ValueError(f"{self.name}: expected {len(spec)} inputs, got {len(inputs)}")
        for x, s in zip(inputs, spec):
            if tuple(x.shape) != s.shape:
                raise ValueError(f"{self.name}: input {s.name} has shape {tuple(x.shape)}, compiled for {s.shape}")
        devices = {x.device for x in inputs if x.dim() > 0}
        if len(devices) > 1:
            raise RuntimeError(f"{self.name}: inputs on several devices: {sorted(map(str, devices))}")

    def uses_kernel(self, inputs: list[torch.Tensor]) -> bool:
        if compute_dtype(inputs) == torch.float64:
            return False     # float64 (gradcheck) runs the reference: tl.dot has no fp64 path
        return inputs[0].device.type == "cuda" or interpreting()

    def forward(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return self.forward_all(inputs)[0]

    def forward_all(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The output and the region's extra row outputs (each (*batch, M))."""
        self.check(inputs)
        if not self.uses_kernel(inputs):
            outs = evaluate_all(self.region, inputs)
            return [x.to(dt) for x, dt in zip(outs, self.out_dtypes)]
        cfg = self.config(inputs)
        if MEASURE_SPARSITY:
            self.skipped = skipped_fraction(self.region, inputs, cfg.BLOCK_M, cfg.BLOCK_N)
        return self.launch(inputs, cfg)

    @property
    def out_dtypes(self) -> list[torch.dtype]:
        return [self.region.out_dtype] + [x.dtype for x in self.region.rows]

    def new_outputs(self, like: torch.Tensor) -> list[torch.Tensor]:
        r = self.region
        rows = [like.new_empty((*r.batch, r.M), dtype=x.dtype) for x in r.rows]
        return [like.new_empty(self.out_shape, dtype=r.out_dtype), *rows]

    def launch(self, inputs: list[torch.Tensor], cfg: Config) -> list[torch.Tensor]:
        r = self.region
        outs = self.new_outputs(inputs[0])
        split = self.split_kernels() if decode.may_split(r, inputs[0].device) else None
        if not (split and split.launch(inputs, outs, cfg)):
            grid = (triton.cdiv(r.M, cfg.BLOCK_M), math.prod(r.batch))
            self.kernel[grid](*kernel_args(r, self.stats, inputs, outs, cfg), **launch_meta(r, cfg))
        self.launches += 1
        return outs

    def split_kernels(self):
        """The split-KV kernels (compiled at first use; None when the region needs several passes)."""
        if self.split is None:
            self.split = decode.compile_split(self.region, torch.backends.cuda.matmul.allow_tf32,
                                              interpreting()) or False
        return self.split or None

    def config(self, inputs: list[torch.Tensor]) -> Config:
        """Launch config for these sizes: memory, then disk, then autotuning (CUDA only)."""
        r = self.region
        shape_bucket = bucket(r.M, r.N, math.prod(r.batch))
        if shape_bucket in self.tuned:          # the per-call path: one dict lookup
            return self.tuned[shape_bucket]
        on_gpu = inputs[0].device.type == "cuda" and not interpreting()
        configs = candidates(r.M, r.N, max(head_block(r.DK), head_block(r.DV)), on_gpu, len(r.dots))
        if len(configs) > 1:
            key = TuningCache.key(shape_bucket, torch.cuda.get_device_name(inputs[0].device))
            disk = TuningCache(self.path.parent, self.name)
            best = disk.load().get(key)
            if best is None:
                best = self.autotune(inputs, configs)
                disk.store(key, best)
            configs = [best]
        self.tuned[shape_bucket] = configs[0]
        return configs[0]

    def autotune(self, inputs, configs: list[Config]) -> Config:
        from triton.testing import do_bench
        best, best_t = configs[0], float("inf")
        for cfg in configs:
            try:
                t = do_bench(lambda: self.launch(inputs, cfg), warmup=5, rep=20, return_mode="median")
            except Exception:  # noqa: BLE001 — a config that does not fit (shared memory) is skipped
                continue
            if t < best_t:
                best, best_t = cfg, t
        return best

    # -- backward -----------------------------------------------------------------------------
    def backward(self, inputs: list[torch.Tensor], grad: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
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
                cfg: Config) -> list:
    """Positional arguments of a generated kernel: inputs, outputs (with strides), the block
    statistics its sparsity scan reads, and the sizes."""
    args: list = []
    for x in [*inputs, *outs]:
        args += [x, *x.stride()]
    stats: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    for st in block_stats:     # ids read along m and along n: one reduction when blocks agree
        key = (st.input, st.dim, cfg.BLOCK_M if st.var == "m" else cfg.BLOCK_N)
        if key not in stats:
            stats[key] = block_minmax(inputs[st.input], st.dim, key[2])
        lo, hi = stats[key]
        args += [lo, hi, *lo.stride()]
    return args + [*r.batch, r.M, r.N]


def launch_meta(r: Region, cfg: Config) -> dict:
    """Constexpr and launch keyword arguments of a generated kernel."""
    return dict(DK=r.DK, DV=r.DV, EVEN_M=r.M % cfg.BLOCK_M == 0, EVEN_N=r.N % cfg.BLOCK_N == 0,
                SCAN_BLOCKS=triton.next_power_of_2(triton.cdiv(r.N, cfg.BLOCK_N)),
                BLOCK_DK=head_block(r.DK), BLOCK_DV=head_block(r.DV), **cfg.as_kwargs())


def skipped_fraction(region: Region, inputs, block_m: int, block_n: int) -> float | None:
    """Fraction of (M, N) blocks outside each row block's [first live, last live] range — what
    the kernel's scan skips when its intervals are exact (index masks, sorted ids); None when the
    score grid is too large to evaluate here."""
    from ..ir.evaluate import Evaluator
    from ..sparsity import dead_predicate, useful
    if math.prod(region.batch) * region.M * region.N > 1 << 26:
        return None
    members = region.passes()[0]
    dead = dead_predicate(region, members)
    if not useful(dead):
        return 0.0
    ev = Evaluator(region, inputs)
    d = ev.full(ev.ctx_s(dead), ev.ctx_s).bool().flatten(0, -3)       # [batch, M, N]
    nm, nn = triton.cdiv(region.M, block_m), triton.cdiv(region.N, block_n)
    pad = torch.nn.functional.pad(d, (0, nn * block_n - region.N, 0, nm * block_m - region.M), value=True)
    live = ~pad.view(-1, nm, block_m, nn, block_n).all(4).all(2)      # [batch, nm, nn]
    idx = torch.arange(nn).expand_as(live)
    first = torch.where(live, idx, nn).amin(-1, keepdim=True)
    last = torch.where(live, idx, -1).amax(-1, keepdim=True)
    visited = (idx >= first) & (idx <= last)
    return 1.0 - visited.float().mean().item()


def block_minmax(x: torch.Tensor, dim: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of ``x`` over blocks of ``block`` along ``dim`` (O(numel), every call)."""
    if x.dtype == torch.bool:
        x = x.to(torch.int8)
    n = x.shape[dim]
    nb = triton.cdiv(n, block)
    xt = x.movedim(dim, -1)
    info = torch.finfo(x.dtype) if x.is_floating_point() else torch.iinfo(x.dtype)
    pad = nb * block - n

    def reduce(fill, fn):
        y = torch.nn.functional.pad(xt, (0, pad), value=fill) if pad else xt
        return fn(y.unflatten(-1, (nb, block)), -1).movedim(-1, dim).contiguous()
    return reduce(info.max, torch.amin), reduce(info.min, torch.amax)


def compile_region(region: Region) -> CompiledRegion:
    """Generate, write and import the kernel for ``region``; register it under its key."""
    placeholder = "fl_fwd"
    source, stats = generate(region, placeholder, allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                             interpret=interpreting())
    name = f"fl_fwd_{source_hash(source)}"
    source = source.replace(f"def {placeholder}(", f"def {name}(")
    # one kernel per source (shared by all lengths); one registry entry per region and sizes
    key = f"{name}_{source_hash(str(region))}"
    if key not in REGISTRY:
        module, path = load_module(name, source)
        REGISTRY[key] = CompiledRegion(region, source, name, path, getattr(module, name), stats, key=key)
    return REGISTRY[key]


@torch.library.custom_op("flashlight::region", mutates_args=())
def region_op(key: str, inputs: list[torch.Tensor]) -> torch.Tensor:
    return REGISTRY[key].forward(list(inputs))


@region_op.register_fake
def _region_fake(key: str, inputs: list[torch.Tensor]) -> torch.Tensor:
    c = REGISTRY[key]
    return inputs[0].new_empty(c.out_shape, dtype=c.region.out_dtype)


@torch.library.custom_op("flashlight::region_backward", mutates_args=())
def region_backward(key: str, inputs: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    return REGISTRY[key].backward(list(inputs), grad)


@region_backward.register_fake
def _region_backward_fake(key: str, inputs: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    return [torch.empty_like(x) for x in inputs]     # each gradient in its input's layout


def _setup_context(ctx, inputs, output):
    key, tensors = inputs
    ctx.key = key
    ctx.save_for_backward(*tensors)


def _backward(ctx, grad):
    tensors = list(ctx.saved_tensors)
    grads = region_backward(ctx.key, tensors, grad)
    return None, [g if t.is_floating_point() else None for g, t in zip(grads, tensors)]


region_op.register_autograd(_backward, setup_context=_setup_context)


# -- regions with extra row outputs (logsumexp, row max, ...): one op returning all of them ------
@torch.library.custom_op("flashlight::region_rows", mutates_args=())
def region_rows_op(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return REGISTRY[key].forward_all(list(inputs))


@region_rows_op.register_fake
def _region_rows_fake(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return REGISTRY[key].new_outputs(inputs[0])


@torch.library.custom_op("flashlight::region_rows_backward", mutates_args=())
def region_rows_backward(key: str, inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return REGISTRY[key].backward(list(inputs), list(grads))


@region_rows_backward.register_fake
def _region_rows_backward_fake(key: str, inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(x) for x in inputs]


def _setup_rows_context(ctx, inputs, output):
    _setup_context(ctx, inputs, output)
    ctx.out_like = [(o.shape, o.dtype) for o in output]


def _backward_rows(ctx, grads):
    tensors = list(ctx.saved_tensors)
    like = tensors[0]
    grads = [g if g is not None else like.new_zeros(shape, dtype=dt) for g, (shape, dt) in zip(grads, ctx.out_like)]
    grads = region_rows_backward(ctx.key, tensors, grads)
    return None, [g if t.is_floating_point() else None for g, t in zip(grads, tensors)]


region_rows_op.register_autograd(_backward_rows, setup_context=_setup_rows_context)
