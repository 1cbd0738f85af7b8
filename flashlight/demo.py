"""``python -m flashlight.demo``: compile every example variant, check it against float64 eager,
and print a table. On a machine without a GPU the generated kernels run under Triton's
interpreter at a small size."""
from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--n", type=int, default=None, help="sequence length")
    ap.add_argument("--d", type=int, default=None, help="head dim")
    args = ap.parse_args(argv)

    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton reads TRITON_INTERPRET when it is imported, which importing flashlight already
        # did: start again with it set so the generated kernels run on the CPU.
        env = dict(os.environ, TRITON_INTERPRET="1")
        os.execvpe(sys.executable, [sys.executable, "-m", "flashlight.demo", *(argv or sys.argv[1:])], env)
    import flashlight
    from flashlight.examples import VARIANTS
    from flashlight.testing import reference, rel_error

    gpu = device == "cuda"
    n, d = args.n or (2048 if gpu else 64), args.d or (64 if gpu else 32)
    shape = dict(B=2 if gpu else 1, H=8 if gpu else 2, M=n, D=d)
    dtype = torch.bfloat16 if gpu else torch.float32
    print(f"flashlight demo on {device}: B={shape['B']} H={shape['H']} N={n} D={d} {dtype}"
          + (" (Triton interpreter)" if os.environ.get("TRITON_INTERPRET") == "1" else ""))
    print(f"{'variant':16s} {'fused':5s} {'rel.err':>9s} {'eager ms':>9s} {'fused ms':>9s}  features")
    for name, mod in VARIANTS.items():
        torch.manual_seed(0)
        inputs = mod.make_inputs(**shape, dtype=dtype, device=device)
        report = flashlight.explain(mod.attention, *inputs)
        fast = torch.compile(mod.attention, backend="flashlight")
        out = fast(*inputs)
        ref = reference(mod.attention, *(x.cpu() for x in inputs)) if not gpu else \
            reference(mod.attention, *inputs)
        err = rel_error(out, ref)
        t_eager, t_fast = _time(mod.attention, inputs, gpu), _time(fast, inputs, gpu)
        feats = ", ".join(report.regions[0].features) if report.regions else \
            (report.fallbacks[0].reason if report.fallbacks else "")
        print(f"{name:16s} {'yes' if report.regions else 'NO':5s} {err:9.2e} {t_eager:9.2f} {t_fast:9.2f}  {feats}")


def _time(fn, inputs, gpu: bool) -> float:
    if gpu:
        from triton.testing import do_bench
        return do_bench(lambda: fn(*inputs), return_mode="median")
    fn(*inputs)
    t = time.perf_counter()
    fn(*inputs)
    return (time.perf_counter() - t) * 1e3


if __name__ == "__main__":
    main()
