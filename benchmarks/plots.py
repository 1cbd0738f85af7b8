"""PNG plots of a results CSV: per suite, Flashlight's speed-up bars per variant and TFLOP/s
against sequence length.

    python -m benchmarks.plots benchmarks/results/h200-2026-12-03     # re-plot a results dir

Needs matplotlib (Agg); without it ``plot_all`` says so and returns no files.
"""
from __future__ import annotations

import os
import sys

from .report import num, ratio, read_csv

# the speed-up panels of each suite: Flashlight against these (x = other ms / Flashlight ms)
BASELINES = {
    "flex": ["flex", "sdpa", "inductor"],
    "sparsity": ["flex", "flex_mask"],
    "beyond": ["inductor", "eager"],
    "training": ["flex", "inductor"],
    "decode": ["flex", "sdpa", "inductor"],
}
LINES = {"flashlight": "C3", "flex": "C0", "sdpa_cudnn": "C2", "sdpa_flash": "C8", "sdpa_efficient": "C9",
         "inductor": "C1", "eager": "C7"}      # backend -> colour, the same in every panel
LABEL = {"flex": "FlexAttention", "flex_mask": "Flex + create_block_mask", "sdpa": "best SDPA",
         "inductor": "torch.compile", "eager": "eager"}


def speedup(row: dict, baseline: str) -> float | None:
    return num(row.get("flashlight_vs_sdpa")) if baseline == "sdpa" else ratio(row, baseline)


def shape_label(r: dict) -> str:
    return f"B{r['B']} N{r['N']} D{r['D']}"


def speedup_bars(plt, rows: list[dict], suite: str, path: str) -> bool:
    baselines = [b for b in BASELINES[suite] if any(speedup(r, b) is not None for r in rows)]
    if not baselines:
        return False
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    shapes = list(dict.fromkeys(shape_label(r) for r in rows))
    width_in = min(18.0, max(6.0, 1.2 * len(variants) * len(shapes) ** 0.5))
    fig, axes = plt.subplots(len(baselines), 1, figsize=(width_in, 3.2 * len(baselines)), squeeze=False)
    width = 0.8 / len(shapes)
    for ax, base in zip(axes[:, 0], baselines):
        for j, shape in enumerate(shapes):
            xs, ys = [], []
            for i, v in enumerate(variants):
                r = next((r for r in rows if r["variant"] == v and shape_label(r) == shape), None)
                s = speedup(r, base) if r is not None else None
                if s is not None:
                    xs.append(i + (j - (len(shapes) - 1) / 2) * width)
                    ys.append(s)
            ax.bar(xs, ys, width, label=shape)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(variants)), variants, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(f"x vs {LABEL.get(base, base)}")
        ax.set_title(f"{suite}: Flashlight speed-up over {LABEL.get(base, base)} (> 1: faster)", fontsize=9)
        ax.legend(fontsize=7, ncol=min(len(shapes), 3))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def tflops_vs_n(plt, rows: list[dict], suite: str, path: str) -> bool:
    from matplotlib.lines import Line2D
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    dims = sorted({int(r["D"]) for r in rows})
    style = {d: ls for d, ls in zip(dims, ["--", "-", ":", "-."])}
    cols = min(4, len(variants))
    nrows = -(-len(variants) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 2.9 * nrows + 0.6), squeeze=False)
    used = set()
    for ax, v in zip(axes.flat, variants):
        mine = [r for r in rows if r["variant"] == v]
        for d in dims:
            for b, colour in LINES.items():
                pts = sorted((int(r["N"]), num(r.get(f"{b}_tflops"))) for r in mine if int(r["D"]) == d)
                pts = [(n, t) for n, t in pts if t is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=colour, ls=style[d])
                    used.add(b)
        ax.set_xscale("log", base=2)
        ax.set_title(v, fontsize=9)
        ax.set_xlabel("sequence length N", fontsize=8)
        ax.set_ylabel("TFLOP/s", fontsize=8)
    for ax in list(axes.flat)[len(variants):]:
        ax.set_visible(False)
    if not used:
        plt.close(fig)
        return False
    handles = [Line2D([], [], color=c, marker="o", label=b) for b, c in LINES.items() if b in used]
    handles += [Line2D([], [], color="k", ls=style[d], label=f"D={d}") for d in dims]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(f"{suite}: TFLOP/s of unmasked work", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_all(rows: list[dict], out: str) -> list[str]:
    """Write ``speedup_<suite>.png`` and ``tflops_<suite>.png`` for every suite in ``rows``."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return []
    written = []
    for suite in BASELINES:
        mine = [r for r in rows if r["suite"] == suite]
        if not mine:
            continue
        for name, fn in (("speedup", speedup_bars), ("tflops", tflops_vs_n)):
            path = os.path.join(out, f"{name}_{suite}.png")
            if fn(plt, mine, suite, path):
                written.append(path)
    return written


def main(argv=None) -> int:
    out = (argv or sys.argv[1:] or [None])[0]
    if out is None:
        print("usage: python -m benchmarks.plots RESULTS_DIR", file=sys.stderr)
        return 2
    for p in plot_all(read_csv(os.path.join(out, "results.csv")), out):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
