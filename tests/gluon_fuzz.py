"""Random programs (``flashlight.fuzz``'s grammar) at sizes the Gluon kernels take — whole blocks,
head dims 64 and 128, fp16 — with every region that has Gluon kernels run twice: its emulated
Gluon forward, dK/dV and dQ kernels (tests/gluon_emulator.py) against its Triton kernels on the
same inputs, row statistics and output gradient (Triton's interpreter and NaN-filled buffers
are set here unless the environment says otherwise):

    python tests/gluon_fuzz.py --count 40 --seed 1

(tests/test_gluon_emulated.py runs a few of these.)"""
from __future__ import annotations

import argparse
import os
import random
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")      # the Triton kernels it compares with, on the CPU
os.environ.setdefault("FLASHLIGHT_POISON", "1")     # buffers start NaN: an unwritten element fails

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import gluon_emulator as emu  # noqa: E402
from flashlight.codegen.gluon import gluon_support  # noqa: E402
from flashlight.codegen.gluon_backward import tiles_support  # noqa: E402
from flashlight.fuzz import Program, make_program  # noqa: E402
from flashlight.ir.region import rowstat_columns  # noqa: E402
from flashlight.runtime import gluon as rg  # noqa: E402
from flashlight.runtime import op as rt  # noqa: E402
from flashlight.testing import rel_error  # noqa: E402

TOL = 1e-3


def gluon_program(seed: int, i: int) -> Program:
    """Program ``i`` of ``seed``: the fuzz grammar's draws, at Gluon sizes, in fp16."""
    sizes = random.Random(seed * 7_919 + i)
    n = [128, 256, 384]
    d = sizes.choice([64, 128])
    rng = random.Random(seed * 1_000_003 + i)
    torch.manual_seed(seed * 1_000_003 + i)
    p = make_program(rng, dict(B=sizes.choice([1, 2]), H=sizes.choice([1, 2, 4]), M=sizes.choice(n),
                               N=sizes.choice(n), D=d, Dv=sizes.choice([d, 64])), stops=False, scans=False)
    p.args = tuple(x.half() if x.is_floating_point() and x.dim() > 0 else x for x in p.args)
    return p


def scaled_error(got: torch.Tensor, want: torch.Tensor, scale: float) -> float:
    """||got - want|| relative to ``want``'s norm, floored at 1e-2 of ``scale``: gradients that are
    analytically 0 (a per-row bias under a softmax) are fp32 noise in both kernels."""
    if torch.isnan(got).any():
        return float("inf")
    return (got.double() - want.double()).norm().item() / max(want.double().norm().item(), 1e-2 * scale, 1e-30)


def check(p: Program) -> tuple[bool, str]:
    """Run the program once (Triton kernels) recording each region's inputs, then compare each
    region's Gluon kernels with its Triton ones. Returns (ok, message)."""
    seen = emu.traced_regions(p.fn, *p.args)
    notes, ok = [], True
    for key, xs in seen.items():
        c = rt.REGISTRY[key]
        if gluon_support(c.region) or not rg.usable(c.region, xs):
            notes.append(f"no gluon: {gluon_support(c.region) or 'layout'}")
            continue
        out_t, stats_t = c.run(xs)
        out, stats = emu.forward(c, xs)
        err = rel_error(out, out_t)
        cols, _ = rowstat_columns(c.region)
        serr = max(rel_error(stats[..., j], stats_t[..., j]) for j in cols[:2])
        ok &= err < TOL and serr < 1e-5 and torch.equal(torch.isfinite(stats), torch.isfinite(stats_t))
        notes.append(f"fwd {err:.1e} stats {serr:.1e}")
        if tiles_support(c.region) or c.backward_kernels() is None:
            continue
        dout = torch.randn(out_t.shape, generator=torch.Generator().manual_seed(0)).to(out_t.dtype)
        want = c.backward(xs, stats_t, out_t, dout)
        try:
            got = emu.tile_gradients(c, xs, out_t, stats_t, dout)
        except emu.NotUsable as e:
            notes.append(str(e))
            continue
        pairs = [(g, w) for g, w, x in zip(got, want, xs) if x.is_floating_point()]
        scale = max(w.double().norm().item() for _, w in pairs)
        gerr = max(scaled_error(g, w, scale) for g, w in pairs)
        ok &= gerr < TOL
        notes.append(f"grads {gerr:.1e}")
    return ok, "; ".join(notes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    bad = ran = 0
    for i in range(args.count):
        p = gluon_program(args.seed, i)
        try:
            ok, msg = check(p)
        except Exception as e:  # noqa: BLE001 — a crash is a failure to report
            ok, msg = False, f"crash: {type(e).__name__}: {e}"
        ran += "fwd" in msg
        if not ok:
            bad += 1
            print(f"MISMATCH #{i}: {p.desc}: {msg}", flush=True)
        else:
            print(f"#{i}: {msg}", flush=True)
    print(f"gluon fuzz: {args.count} programs, {ran} with Gluon kernels, {bad} mismatches (seed {args.seed})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
