"""Time every launch config of the generated backward's two tile kernels (dK/dV and dQ), each
checked against float64 autograd.

    python -m benchmarks.backward_configs --variants causal,alibi --d 128 [--n 4096] [--configs 32x64w4s3,...]

For each variant (bf16 on CUDA; ``--device cpu`` dry-runs it at a small size under Triton's
interpreter), one compiled training step records the region's inputs, row statistics, output and
incoming gradient, and float64 autograd of the eager program gives the reference gradients. Each
config of each kernel then runs alone, with nothing carried over from the previous config:
  - the row gradients are computed afresh;
  - the output buffers are fresh and NaN-filled (``FLASHLIGHT_POISON=1``), so an element a
    config leaves unwritten shows.
The relative error of the gradients that kernel wrote, against float64, is recorded (bf16
rounding gives ~3e-3; a wrong config gives O(1)). Then ``do_bench`` times the kernel (median).
Writes ``backward_configs_d{D}.csv`` to ``$OUT`` (or ``--out``) and prints one line per config.
"""
from __future__ import annotations

import argparse
import csv
import os

os.environ.setdefault("FLASHLIGHT_POISON", "1")     # before flashlight is imported (runtime.buffers)

import torch  # noqa: E402

from flashlight.examples import VARIANTS  # noqa: E402
from flashlight.runtime import op as rt  # noqa: E402
from flashlight.testing import rel_error  # noqa: E402
from flashlight.tune import INTERPRETER, ROWS, Config, backward_candidates, head_block  # noqa: E402

from .configs import parse_config  # noqa: E402
from .smoke import configure_dynamo  # noqa: E402


# the row-gradient kernel's configs (elementwise: BLOCK_N and stages unused)
ROW_CONFIGS = [Config(64, 16, 8, 1), Config(64, 16, 4, 1), Config(32, 16, 8, 1), Config(32, 16, 4, 1), Config(16, 16, 4, 1)]


def capture_step(mod, inputs: list[torch.Tensor]):
    """(region, its inputs, row statistics, output, incoming gradient) of one compiled step."""
    seen = {}
    backward = rt.CompiledRegion.backward

    def recording(self, tensors, rowstats, out, grad, *args, **kwargs):
        seen.update(c=self, args=(tensors, rowstats, out, grad))
        return backward(self, tensors, rowstats, out, grad, *args, **kwargs)
    rt.CompiledRegion.backward = recording      # this script's own probe
    try:
        fn = torch.compile(mod.attention, backend="flashlight", dynamic=False)
        out = fn(*inputs)
        torch.autograd.grad(out, [x for x in inputs if x.requires_grad], torch.randn_like(out))
    finally:
        rt.CompiledRegion.backward = backward
    return seen["c"], *seen["args"]


def float64_grads(mod, inputs: list[torch.Tensor], grad: torch.Tensor) -> dict:
    """(data pointer, shape) of each floating program input -> its float64 gradient."""
    ref_in = [x.detach().double().requires_grad_() if x.is_floating_point() else x for x in inputs]
    leaves = [x for x in ref_in if x.requires_grad]
    grads = torch.autograd.grad(mod.attention(*ref_in), leaves, grad.double())
    return {(x.data_ptr(), x.shape): g for x, g in zip([x for x in inputs if x.is_floating_point()], grads)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="causal,alibi")
    p.add_argument("--b", type=int, default=4)
    p.add_argument("--h", type=int, default=16)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--kernels", default="dkdv,dq", help="comma list of rows, dkdv, dq")
    p.add_argument("--configs", help="only these configs for every kernel, e.g. 32x64w4s3,64x64w4s3")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    out_dir = os.environ.get("OUT", args.out)
    os.makedirs(out_dir, exist_ok=True)
    configure_dynamo()
    if cuda:
        from triton.testing import do_bench
    else:       # the interpreter: one small config, no timing
        do_bench = None
    rows = []
    for name in args.variants.split(","):
        mod = VARIANTS[name]
        torch.manual_seed(0)
        inputs = [x.requires_grad_() if x.is_floating_point() else x for x in
                  mod.make_inputs(args.b, args.h, args.n, args.n, args.d,
                                  torch.bfloat16 if cuda else torch.float32, args.device)]
        c, tensors, rowstats, out, grad = capture_step(mod, inputs)
        refs = float64_grads(mod, inputs, grad)
        k = c.backward_kernels()
        block_d = max(head_block(c.region.DK), head_block(c.region.DV))
        row_default = ROWS if cuda else INTERPRETER
        launches = {"rows": lambda drows, bufs, cfg: k.launch_rows(tensors, rowstats, out, grad, bufs, cfg),
                    "dkdv": lambda drows, bufs, cfg: k.launch_dkdv(tensors, rowstats, drows, bufs, {}, cfg),
                    "dq": lambda drows, bufs, cfg: k.launch_dq(tensors, rowstats, drows, bufs, {}, cfg)}
        for kernel in args.kernels.split(","):
            launch = launches[kernel]
            space = ([parse_config(s) for s in args.configs.split(",")] if args.configs
                     else ROW_CONFIGS if kernel == "rows" else backward_candidates(block_d, kernel)) if cuda \
                else [INTERPRETER, Config(32, 32, 1, 1)]
            default = row_default if kernel == "rows" else c.config(tensors, kernel)
            for cfg in space:
                row = dict(variant=name, d=args.d, n=args.n, kernel=kernel,
                           config=str(cfg),
                           default=cfg == default, err=float("nan"), ms=float("nan"), note="")
                try:
                    bufs = k.buffers(tensors)
                    # the row kernel under test writes its own (fresh) row gradients
                    drows = None if kernel == "rows" else k.launch_rows(tensors, rowstats, out, grad, bufs, row_default)
                    launch(drows, bufs, cfg)
                    written = k.plan.written(kernel)
                    errs = [rel_error(bufs[i], refs[tensors[i].data_ptr(), tensors[i].shape]) for i in written
                            if (tensors[i].data_ptr(), tensors[i].shape) in refs]
                    row["err"] = max(errs) if errs else float("nan")
                    if do_bench is not None:
                        row["ms"] = do_bench(lambda: launch(drows, bufs, cfg),
                                             warmup=10, rep=50, return_mode="median")
                except Exception as e:  # noqa: BLE001 — a config that does not fit is reported, not fatal
                    row["note"] = f"{type(e).__name__}: {str(e)[:100]}"
                rows.append(row)
                print(f"{name:14s} D={args.d} {kernel:4s} {row['config']:12s} {'*' if row['default'] else ' '} "
                      f"err {row['err']:.1e}  {row['ms']:.3f} ms  {row['note']}", flush=True)
    path = os.path.join(out_dir, f"backward_configs_d{args.d}.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"csv: {path}  (* = the default config)")


if __name__ == "__main__":
    main()
