"""Training-step benchmark: forward + backward of every FlexAttention-expressible variant,
flashlight's generated backward against FlexAttention's (cached block mask).

    python -m benchmarks.backward [--n 4096] [--b 4] [--h 16] [--d 64] [--variants a,b] [--inductor]

Per variant (bf16 on CUDA): which backward flashlight used (``explain``), the largest relative
error over the gradients of all floating inputs (flashlight) or of q, k, v (flex) against fp32
eager autograd, median ``do_bench`` time of
the forward alone and of forward + backward (``torch.autograd.grad`` with a fixed dO), and
``xflex = flex ms / flashlight ms`` for forward + backward (``--inductor``: also plain
torch.compile's, ``xinductor``; the only comparison for programs Flex cannot express). Results
go to ``$OUT/backward_d{D}.csv`` when ``OUT`` is set, else ``--out``. ``--device cpu`` (with
``TRITON_INTERPRET=1``) only dry-runs the script's logic at a small size.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

import flashlight
from flashlight.examples import FLEX_NAMES, VARIANTS
from flashlight.runtime.op import REGISTRY
from flashlight.testing import rel_error

from . import flex_equivalents as fe
from .smoke import NAN, Notes, configure_dynamo, make_bench, to_fp32

COLUMNS = ["variant", "backward", "gerr_flashlight", "gerr_flex", "ms_fwd_flashlight", "ms_fwd_flex",
           "ms_step_flashlight", "ms_step_flex", "xflex_step", "ms_step_inductor", "xinductor_step", "configs", "notes"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.backward", description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--b", type=int, default=4)
    p.add_argument("--h", type=int, default=16)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    p.add_argument("--variants", default=",".join(FLEX_NAMES))
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--device", default="cuda")
    p.add_argument("--inductor", action="store_true", help="also time plain torch.compile (Inductor)")
    p.add_argument("--tune", action="store_true",
                   help="autotune every kernel (as mode='max-autotune') and report the configs chosen")
    return p.parse_args(argv)


def step(fn, leaves, dout):
    """One training step's attention work: forward, then the gradients of q, k, v."""
    return torch.autograd.grad(fn(), leaves, dout)


def run_variant(name: str, args, bench) -> dict:
    mod, notes = VARIANTS[name], Notes()
    row = {c: NAN for c in COLUMNS}
    row.update(variant=name, backward="?", notes="")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    inputs = [x.requires_grad_() if x.is_floating_point() else x
              for x in mod.make_inputs(args.b, args.h, M=args.n, D=args.d, dtype=dtype, device=args.device)]
    leaves, qkv = [x for x in inputs if x.is_floating_point()], inputs[:3]
    fl = torch.compile(mod.attention, backend="flashlight", dynamic=False)
    dout = torch.randn_like(fl(*inputs))

    ref32 = [to_fp32(x).detach().requires_grad_() if x.is_floating_point() else x for x in inputs]
    ref = notes.attempt("reference", lambda: step(lambda: mod.attention(*ref32).nan_to_num(0),
                                                  [x for x in ref32 if x.is_floating_point()], dout.float()),
                        default=None)

    def gerr(grads):
        return max(rel_error(a, b) for a, b in zip(grads, ref)) if ref is not None else NAN

    report = notes.attempt("explain", lambda: flashlight.explain(mod.attention, *inputs), default=None)
    if report is not None and report.regions:
        row["backward"] = report.regions[0].backward.split(" (")[0]
    before = {k: c.bwd_launches for k, c in REGISTRY.items()}
    row["gerr_flashlight"] = notes.attempt("flashlight grads", lambda: gerr(step(lambda: fl(*inputs), leaves, dout)))
    if not any(c.bwd_launches > before.get(k, 0) for k, c in REGISTRY.items()):
        notes.items.append("generated backward did not run")
    flashlight.wait()   # the Gluon kernels compiling in the background take over before the timing, not in it
    row["ms_fwd_flashlight"] = notes.attempt("fwd flashlight", lambda: bench(lambda: fl(*inputs)))
    row["ms_step_flashlight"] = notes.attempt("step flashlight",
                                              lambda: bench(lambda: step(lambda: fl(*inputs), leaves, dout)))

    bm = notes.attempt("create_block_mask", lambda: fe.make_block_mask(name, inputs), default="fail")
    if bm != "fail":
        run = lambda: fe.run_flex(name, inputs, bm)     # noqa: E731
        row["gerr_flex"] = notes.attempt("flex grads", lambda: gerr(step(run, qkv, dout)))
        row["ms_fwd_flex"] = notes.attempt("fwd flex", lambda: bench(run))
        row["ms_step_flex"] = notes.attempt("step flex", lambda: bench(lambda: step(run, qkv, dout)))
    row["xflex_step"] = row["ms_step_flex"] / row["ms_step_flashlight"]
    if args.inductor:
        ind = torch.compile(mod.attention, dynamic=False)
        row["ms_step_inductor"] = notes.attempt("step inductor",
                                                lambda: bench(lambda: step(lambda: ind(*inputs), leaves, dout)))
        row["xinductor_step"] = row["ms_step_inductor"] / row["ms_step_flashlight"]
    row["configs"] = " ".join(f"{'/'.join(map(str, k)) if isinstance(k, tuple) else k}={c}"
                              for key, reg in REGISTRY.items() if reg.bwd_launches > before.get(key, 0)
                              for k, c in reg.tuned.items())
    row["notes"] = str(notes)
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    configure_dynamo()
    if args.tune:
        os.environ["FLASHLIGHT_AUTOTUNE"] = "1"
    torch.set_float32_matmul_precision("highest")
    bench = make_bench(args.device, args.warmup, args.rep)
    out_dir = os.environ.get("OUT") or args.out
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"backward_d{args.d}.csv")
    print(f"backward: torch {torch.__version__}, {args.device}, B={args.b} H={args.h} N={args.n} D={args.d}",
          flush=True)
    rows = []
    for name in names:
        rows.append(run_variant(name, args, bench))
        r = rows[-1]
        print(f"{name:16s} {r['backward']:10s} gerr fl {r['gerr_flashlight']:.1e} flex {r['gerr_flex']:.1e}  "
              f"fwd {r['ms_fwd_flashlight']:.3f}/{r['ms_fwd_flex']:.3f}  fwd+bwd {r['ms_step_flashlight']:.3f}/"
              f"{r['ms_step_flex']:.3f} ms  x{r['xflex_step']:.2f}  inductor {r['ms_step_inductor']:.3f} ms  "
              f"{r['configs']}  {r['notes'][:200]}", flush=True)
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows)
    ratios = [r["xflex_step"] for r in rows if r["xflex_step"] == r["xflex_step"]]
    if ratios:
        geo = torch.tensor(ratios).log().mean().exp().item()
        print(f"fwd+bwd geometric mean x flex {geo:.2f}, min {min(ratios):.2f}; csv: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
