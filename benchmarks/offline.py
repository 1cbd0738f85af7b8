"""Compile a variant's generated kernels for the H200 (sm_90) on a machine without a GPU, and
report what ptxas made of them: registers, spills, shared memory and the instruction mix.

    python -m benchmarks.offline --variants causal,vanilla --d 128 [--n 4096] [--kernels fwd,rows,sums,dkdv,dq]
                                 [--config fwd=128x128w8s3,dkdv=32x64w4s3] [--dump DIR]

The region is captured on meta tensors (nothing is computed), the kernels are generated as for
CUDA (bf16 operands, not the interpreter's fp32 ones), and each launch the runtime would make
for a B x H x N x N step is recorded with CPU tensors of the real shapes, so the compiled kernel
has the specialisation (16-divisible strides and sizes, pointer alignment) a GPU launch gets.
Triton then compiles it for ``GPUTarget("cuda", 90, 32)`` with its bundled ptxas. Per kernel:
compile seconds, registers, spill stores / loads (bytes), shared memory, and SASS counts of the
instructions that bound attention kernels (``HGMMA``, ``MUFU.EX2``, ``FMUL``/``FFMA``/``FADD``,
``F2F``/``F2FP`` conversions, ``BAR``, ``LDG``/``STG``/``LDS``/``STS``). ``--dump`` keeps the
Triton source, PTX and SASS of each kernel. Offline numbers say what changed in the compiled
code; only a GPU run says what that is worth.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import torch

from flashlight.examples import VARIANTS
from flashlight.codegen.gluon import gluon_support
from flashlight.runtime import gluon
from flashlight.runtime import op as rt
from flashlight.runtime.backward import compile_gluon_tile
from flashlight.runtime.quick import compile_quick
from flashlight.tune import ROWS, cdiv

from .configs import parse_config

SASS_OPS = ["HGMMA", "MUFU.EX2", "FMUL", "FFMA", "FADD", "FMNMX", "F2FP", "F2F", "I2F", "BAR", "LDG", "STG",
            "LDS", "STS", "LDSM", "UTMALDG", "SYNCS", "WARPGROUP"]


class Recorder:
    """Stands in for a generated kernel: ``k[grid](*args, **meta)`` records the launch."""

    def __init__(self, fn):
        self.fn = fn
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launches.append((args, meta))


def capture(mod, b: int, h: int, n: int, d: int):
    """The region's CompiledRegion and CPU tensors with the shapes, strides and dtypes of the
    op's inputs (bf16, as on the GPU), in the region's order."""
    meta = [x.requires_grad_() if x.is_floating_point() else x
            for x in mod.make_inputs(b, h, n, n, d, torch.bfloat16, "meta")]
    rt.REGISTRY.clear()
    torch._dynamo.reset()
    seen, run_all = {}, rt.CompiledRegion.run_all

    def recording(self, inputs, *args, stats=True, **kwargs):
        seen["inputs"] = list(inputs)
        if self.region.rows:
            return run_all(self, inputs, *args, stats=stats, **kwargs)
        # the reference evaluator indexes with scalar tensors (Evoformer's gathers), which meta
        # tensors cannot read: the outputs' shapes are all the graph needs, as the op's fake gives
        out = inputs[0].new_empty(self.out_shape, dtype=self.region.out_dtype)
        return [out], inputs[0].new_empty(self.rowstats_shape, dtype=torch.float32) if stats else None
    rt.CompiledRegion.run_all = recording       # this tool's own probe: the op's inputs
    try:
        # Inductor's constant folding of the joint graph evaluates it on meta tensors, and for
        # RoPE's rotate_half (slice_scatter of a full) left the backward reading a value defined
        # after it (an FX lint error); on a GPU it folds real values
        with torch._inductor.config.patch(joint_graph_constant_folding=False):
            torch.compile(mod.attention, backend="flashlight", dynamic=False)(*meta)
    finally:
        rt.CompiledRegion.run_all = run_all
    (c,) = rt.REGISTRY.values()
    torch.manual_seed(0)
    inputs = []
    # where Inductor computes some of the op's inputs (RoPE's rotated k), its code on meta tensors
    # calls the op's fake, not run_all: those inputs are taken contiguous, as Inductor makes them
    layouts = [(x.shape, x.stride(), x.dtype) for x in seen["inputs"]] if "inputs" in seen else \
        [(s.shape, torch.empty(s.shape, device="meta").stride(), s.dtype) for s in c.region.inputs]
    for shape, stride, dtype in layouts:
        y = torch.empty_strided(shape, stride, dtype=dtype)
        inputs.append(y.normal_() if y.is_floating_point() else y.random_(0, 2 if y.dtype == torch.bool else 12))
    return c, inputs


def record(c, inputs, configs: dict) -> dict[str, tuple[object, tuple, dict]]:
    """kernel name -> (JIT function, args, meta) of each launch of one forward and backward."""
    cfg = {"fwd": c.default_config("fwd"), "rows": ROWS,
           "dkdv": c.default_config("dkdv"), "dq": c.default_config("dq"), "sums": c.default_config("sums")}
    cfg.update(configs)
    fwd = Recorder(c.kernel.fn)
    c.kernel = fwd
    c.split = False     # the full-size forward, not split-KV
    out = c.new_outputs(inputs[0])[0]
    rowstats = torch.empty(c.rowstats_shape, dtype=torch.float32)
    c.launch(inputs, cfg["fwd"])
    found = {"fwd": (fwd.fn, *fwd.launches[0], cfg["fwd"])}
    quick = c.sparse and compile_quick(c)     # a masked region's first-call kernel (runtime.quick)
    if quick:
        qcfg = cfg.get("qfwd", cfg["fwd"])
        quick.kernel = Recorder(quick.kernel.fn)
        grid = (cdiv(c.region.M, qcfg.BLOCK_M), math.prod(c.region.batch))
        quick.launch(c.region, qcfg, True, inputs, c.new_outputs(inputs[0]), rowstats, grid)
        found["qfwd"] = (quick.kernel.fn, *quick.kernel.launches[0], qcfg)
    if not gluon_support(c.region):       # the Hopper forward (runtime.gluon), with the same arguments
        found["gfwd"] = (jit(rt.compile_gluon(c)), tuple(fwd.launches[0][0]), gluon.launch_meta(c.region, inputs, True),
                         "gluon")
    k = c.backward_kernels()
    if k is None:
        return found
    tiles = k.needed_kernels(None)        # one tile kernel where one adds the other's gradients
    k.rows = Recorder(k.rows.fn)
    k.dkdv = Recorder(k.dkdv.fn) if "dkdv" in tiles else None
    k.dq = Recorder(k.dq.fn) if "dq" in tiles else None
    sums = ("sums",) if k.sums is not None else ()      # a later pass reads sums (codegen.backward.SumsWriter)
    k.sums = Recorder(k.sums.fn) if sums else None
    bufs = k.buffers(inputs, tiles)
    drows = k.launch_rows(inputs, rowstats, out, torch.empty_like(out), bufs, cfg["rows"])
    for kernel in sums + tiles:
        k.launch_tile(kernel, inputs, rowstats, drows, bufs, {}, cfg[kernel])
    for name in ("rows", *sums, *tiles):
        rec = getattr(k, name)
        found[name] = (rec.fn, *rec.launches[0], cfg[name])
    if not k.gluon_tiles_unsupported:     # the Hopper tile kernels, with the Triton kernels' arguments
        for kernel, rec in (("dkdv", k.dkdv), ("dq", k.dq)):
            found[f"g{kernel}"] = (jit(compile_gluon_tile(k, kernel)), tuple(rec.launches[0][0]),
                                   gluon.tile_meta(kernel, c.region, inputs, drows[1]), "gluon")
    return found


def jit(kernel):
    """The ``@triton.jit`` function a runtime kernel (``_compat.FastLaunch``) launches."""
    return getattr(kernel, "fn", kernel)


def compile_sm90(fn, args: tuple, meta: dict):
    """Triton's own specialisation of this launch, compiled for sm_90 (no driver needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **meta)
    options, signature, constexprs, attrs = fn._pack_args(backend, meta, bound, specialization, options)
    if fn.is_gluon():       # Gluon's own source: its passes, not Triton's (no pipeliner, no layout inference)
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def ptxas_usage(ptx: str, arch: str = "sm_90a") -> dict:
    """Registers, spill bytes and shared memory from ``ptxas -v`` on the PTX."""
    from triton.backends.nvidia.compiler import get_ptxas
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "k.ptx")
        src.write_text(ptx)
        res = subprocess.run([get_ptxas(90).path, "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(tmp, "k.o"))],
                             capture_output=True, text=True)
    log = res.stderr
    def num(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0
    return dict(regs=num(r"Used (\d+) registers"), spill_st=num(r"(\d+) bytes spill stores"),
                spill_ld=num(r"(\d+) bytes spill loads"),
                serialized="wgmma.mma_async instructions are serialized" in log)


def sass_text(cubin: bytes) -> str:
    """``cuobjdump -sass`` of a cubin: all of it (``triton.tools.disasm.get_sass`` drops the
    default partition of a warp-specialised kernel)."""
    import tempfile
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "k.cubin")
        path.write_bytes(cubin)
        tool = Path(get_ptxas(90).path).with_name("cuobjdump")
        return subprocess.run([str(tool), "-sass", str(path)], capture_output=True, text=True, check=True).stdout


def sass_counts(cubin: bytes) -> Counter:
    counts: Counter = Counter()
    for line in sass_text(cubin).splitlines():
        m = re.match(r"\s*\S+\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)     # "ctrl  [@P0] OP ..."
        if m:
            op = m.group(1)
            for name in SASS_OPS:
                if op == name or op.startswith(name + "."):
                    counts[name] += 1
                    break
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="causal")
    p.add_argument("--b", type=int, default=4)
    p.add_argument("--h", type=int, default=16)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--kernels", default="fwd,qfwd,gfwd,rows,sums,dkdv,gdkdv,dq,gdq",
                   help="qfwd: a masked region's quick-start forward (runtime.quick); gfwd, gdkdv, gdq: the "
                        "Gluon forward, dK/dV and dQ kernels, where they apply")
    p.add_argument("--config", default="", help="kernel=config pairs, e.g. fwd=128x128w8s3,dkdv=32x64w4s3")
    p.add_argument("--tma", type=int, default=1, help="the TMA constexpr of kernels with descriptor loads (0: off)")
    p.add_argument("--dump", help="write each kernel's Triton source, PTX and SASS here")
    args = p.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)      # the kernels as generated for CUDA
    overrides = {k: parse_config(v) for k, v in (kv.split("=") for kv in args.config.split(",") if kv)}
    print(f"{'variant':14s} {'kernel':5s} {'config':15s} {'s':>5s} {'regs':>4s} {'spill':>9s} {'smem':>6s} {'wgmma':6s} sass")
    for name in args.variants.split(","):
        c, inputs = capture(VARIANTS[name], args.b, args.h, args.n, args.d)
        for kernel, (fn, largs, meta, cfg) in record(c, inputs, overrides).items():
            if kernel not in args.kernels.split(","):
                continue
            if "TMA" in fn.arg_names:     # the CPU tensors recorded it off: as a Hopper launch would
                meta = {**meta, "TMA": bool(args.tma)}
            t0 = time.perf_counter()
            ck = compile_sm90(fn, largs, meta)
            secs = time.perf_counter() - t0
            use = ptxas_usage(ck.asm["ptx"])
            sass = sass_counts(ck.asm["cubin"])
            ops = " ".join(f"{k}={sass[k]}" for k in SASS_OPS if sass[k])
            tag = str(cfg) + ("" if "TMA" not in fn.arg_names else " tma" if args.tma else " ptr")
            print(f"{name:14s} {kernel:5s} {tag:15s} {secs:5.1f} {use['regs']:4d} {use['spill_st']:4d}/{use['spill_ld']:<4d} "
                  f"{ck.metadata.shared:6d} {'SERIAL' if use['serialized'] else 'async':6s} {ops}", flush=True)
            if args.dump:
                d = Path(args.dump)
                d.mkdir(parents=True, exist_ok=True)
                stem = d / f"{name}_d{args.d}_{kernel}_{tag}"
                stem.with_suffix(".ptx").write_text(ck.asm["ptx"])
                stem.with_suffix(".sass").write_text(sass_text(ck.asm["cubin"]))
                stem.with_suffix(".ttgir").write_text(ck.asm["ttgir"])
                src = c.source if kernel == "fwd" else fn.src if kernel in ("gfwd", "gdkdv", "gdq") else c.bwd_source
                stem.with_suffix(".py").write_text(src)


if __name__ == "__main__":
    main()
