"""Time every launch config of one variant's generated kernel (a tuning-space report).

    python -m benchmarks.configs --variants sliding_window,vanilla --d 64 [--n 4096] [--extra]

For each variant: compile it with flashlight, run it once to capture the region's inputs, then
time ``CompiledRegion.launch`` under each candidate config (the autotuner's space, plus a wider
grid with ``--extra``) with ``triton.testing.do_bench`` (median). Prints one line per config and
the config the default (heuristic) mode picks; writes ``configs.csv`` to ``$OUT`` (or ``--out``).
"""
from __future__ import annotations

import argparse
import csv
import os

import torch
from triton.testing import do_bench

import flashlight  # noqa: F401 — registers the backend
from flashlight.examples import VARIANTS
from flashlight.runtime import op as rt
from flashlight.tune import Config, candidates, head_block

EXTRA = [Config(bm, bn, w, s) for bm, bn in [(64, 32), (128, 32), (64, 64), (128, 64), (64, 128), (128, 128)]
         for w in (4, 8) for s in (2, 3, 4)]


def parse_config(text: str) -> Config:
    """``128x64w4s3`` -> Config(128, 64, 4, 3); ``128x64w8s2r128`` caps registers at 128."""
    bm, rest = text.split("x")
    bn, rest = rest.split("w")
    w, st = rest.split("s")
    st, _, reg = st.partition("r")
    return Config(int(bm), int(bn), int(w), int(st), int(reg) if reg else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="vanilla,sliding_window,document_mask")
    p.add_argument("--b", type=int, default=4)
    p.add_argument("--h", type=int, default=16)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--extra", action="store_true", help="also time a wider config grid")
    p.add_argument("--configs", help="only these configs, e.g. 128x128w4s3,64x64w4s3")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = p.parse_args()
    out_dir = os.environ.get("OUT", args.out)
    os.makedirs(out_dir, exist_ok=True)
    captured: dict[str, list] = {}
    run_all = rt.CompiledRegion.run_all

    def recording(self, inputs, *args, **kwargs):
        captured[self.key] = inputs
        return run_all(self, inputs, *args, **kwargs)
    rt.CompiledRegion.run_all = recording     # this script's own probe: record the region inputs
    rows = []
    for name in args.variants.split(","):
        mod = VARIANTS[name]
        inputs = mod.make_inputs(args.b, args.h, args.n, args.n, args.d, torch.bfloat16, "cuda")
        captured.clear()
        torch.compile(mod.attention, backend="flashlight", fullgraph=True)(*inputs)
        for key, leaves in captured.items():
            c = rt.REGISTRY[key]
            r = c.region
            chosen = c.config(leaves)
            space = candidates(max(head_block(r.DK), head_block(r.DV)), len(r.dots))
            space += [x for x in EXTRA if args.extra and x not in space]
            if args.configs:
                space = [parse_config(x) for x in args.configs.split(",")]
                space += [chosen] if chosen not in space else []
            for cfg in space:
                try:
                    ms = do_bench(lambda: c.launch(leaves, cfg, stats=False), warmup=10, rep=50, return_mode="median")
                except Exception as e:  # noqa: BLE001 — out of shared memory etc.
                    ms, note = float("nan"), type(e).__name__
                else:
                    note = ""
                rows.append(dict(variant=name, d=args.d, n=args.n, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages, ms=ms,
                                 chosen=cfg == chosen, note=note))
                print(f"{name:16s} d={args.d} {cfg} {ms:8.4f} ms{'  <- default' if cfg == chosen else ''} {note}",
                      flush=True)
    with open(os.path.join(out_dir, "configs.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for name in args.variants.split(","):
        best = min((x for x in rows if x["variant"] == name), key=lambda x: x["ms"] if x["ms"] == x["ms"] else 1e9)
        tuned = next(x for x in rows if x["variant"] == name and x["chosen"])
        print(f"{name:16s} default {tuned['ms']:.4f} ms, best {best['ms']:.4f} ms "
              f"({best['BLOCK_M']}x{best['BLOCK_N']} w{best['num_warps']} s{best['num_stages']})")


if __name__ == "__main__":
    main()
