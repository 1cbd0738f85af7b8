"""Training step with attention dropout (p = 0.1): Flashlight (mask drawn in the kernel) against
the same plain-PyTorch program in eager mode and under ``torch.compile`` (Inductor).

    python -m benchmarks.dropout [--b 4] [--h 16] [--n 2048] [--d 64]

Times forward and forward + backward (``do_bench`` median, bf16) and writes ``dropout.csv`` to
``$OUT`` (or ``--out``). Outputs agree only in distribution (each side draws its own mask), so
the check here is the mean of the output against eager's, not elementwise.
"""
from __future__ import annotations

import argparse
import csv
import os

import torch
from triton.testing import do_bench

import flashlight  # noqa: F401 — registers the backend
from flashlight.examples import attention_dropout as ex


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--b", type=int, default=4)
    p.add_argument("--h", type=int, default=16)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = p.parse_args()
    out_dir = os.environ.get("OUT", args.out)
    os.makedirs(out_dir, exist_ok=True)
    torch._dynamo.config.cache_size_limit = 1000
    xs = [x.requires_grad_() for x in ex.make_inputs(args.b, args.h, args.n, args.n, args.d, torch.bfloat16, "cuda")]
    dout = torch.randn_like(xs[0])
    fns = {"flashlight": torch.compile(ex.attention, backend="flashlight"),
           "inductor": torch.compile(ex.attention), "eager": ex.attention}
    rows = []
    for name, fn in fns.items():
        means = [fn(*xs).float().mean().item() for _ in range(3)]
        fwd = do_bench(lambda: fn(*xs), return_mode="median")
        step = do_bench(lambda: torch.autograd.grad(fn(*xs), xs, dout), return_mode="median")
        rows.append(dict(backend=name, B=args.b, H=args.h, N=args.n, D=args.d, fwd_ms=fwd, fwd_bwd_ms=step,
                         out_mean=sum(means) / 3))
    base = rows[0]
    for r in rows:
        r["x_fwd"] = r["fwd_ms"] / base["fwd_ms"]
        r["x_fwd_bwd"] = r["fwd_bwd_ms"] / base["fwd_bwd_ms"]
        print(f"{r['backend']:10s} fwd {r['fwd_ms']:.3f} ms ({r['x_fwd']:.2f}x)  fwd+bwd {r['fwd_bwd_ms']:.3f} ms "
              f"({r['x_fwd_bwd']:.2f}x)  mean(out) {r['out_mean']:+.5f}", flush=True)
    with open(os.path.join(out_dir, "dropout.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
