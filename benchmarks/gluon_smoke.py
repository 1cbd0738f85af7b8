"""A quick check of the Gluon kernels on the GPU before a longer run (run it with a timeout: a
wrong barrier phase hangs): causal and full attention, the document mask and GQA at D=128,
causal at D=64: the Gluon forward and the backward kernels named by ``--kernels`` (dkdv, dq) forced on and
compiled at their first launch; outputs and gradients against float64, and the gradients against
the Triton tile kernels'. Exits non-zero on a mismatch or a fallback. One kernel per run tells
which one hangs:

    timeout -k 10 150 python -m benchmarks.gluon_smoke --kernels dkdv
    timeout -k 10 150 python -m benchmarks.gluon_smoke --kernels dq
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

KERNELS = ("dkdv", "dq")
os.environ.update(FLASHLIGHT_GLUON="all", FLASHLIGHT_BACKGROUND="0", FLASHLIGHT_STRICT="1")

import flashlight  # noqa: E402,F401 — registers the backend
from flashlight.examples import VARIANTS  # noqa: E402
from flashlight.runtime.op import REGISTRY  # noqa: E402
from flashlight.testing import rel_error, to64  # noqa: E402


def grads_of(fn, inputs, dout=None):
    """``fn``'s output and the gradients of the floating inputs (under the environment as it is
    now: the tile kernels' choice is read per launch); ``dout`` defaults to a random tensor."""
    leaves = [x.detach().requires_grad_() if x.is_floating_point() else x for x in inputs]
    out = fn(*leaves)
    dout = torch.randn_like(out) if dout is None else dout
    grads = torch.autograd.grad(out, [x for x in leaves if x.is_floating_point()], dout)
    torch.cuda.synchronize()
    return out, grads, dout


def check(name: str, d: int, kernels: list[str], n: int = 1024) -> bool:
    """Outputs and gradients against float64 (bf16 tolerances), and the gradients against the
    Triton tile kernels' on the same row statistics (tighter: both round P and dS to bf16 alike;
    an error confined to masked blocks or one warpgroup's rows shows here first)."""
    mod = VARIANTS[name]
    torch.manual_seed(0)
    inputs = [x.cuda() for x in mod.make_inputs(B=2, H=4, M=n, D=d, dtype=torch.bfloat16)]
    REGISTRY.clear()
    fn = torch.compile(mod.attention, backend="flashlight", dynamic=False)
    out, grads, dout = grads_of(fn, inputs)
    (c,) = REGISTRY.values()
    ran = {"fwd": c.gfwd.launched, **{x: c.bwd_kernel.tier(x).launched for x in kernels}}
    ref_in = [to64(x).detach().requires_grad_() if x.is_floating_point() else x for x in inputs]
    ref = mod.attention(*ref_in)
    refs = torch.autograd.grad(ref, [x for x in ref_in if x.is_floating_point()], to64(dout))
    errs = [rel_error(out, ref)] + [rel_error(g, r) for g, r in zip(grads, refs)]
    for x in kernels:
        os.environ[f"FLASHLIGHT_GLUON_{x.upper()}"] = "0"
    _, triton, _ = grads_of(fn, inputs, dout)
    for x in kernels:
        os.environ[f"FLASHLIGHT_GLUON_{x.upper()}"] = "all"
    vs_triton = max(rel_error(g, t.double()) for g, t in zip(grads, triton))
    ok = all(ran.values()) and errs[0] < 2e-2 and max(errs[1:]) < 5e-2 and vs_triton < 2e-2
    print(f"{name} D={d} N={n}: gluon ran {ran}, rel err out {errs[0]:.1e} grads "
          f"{' '.join(f'{e:.1e}' for e in errs[1:])} vs triton {vs_triton:.1e} {'ok' if ok else 'FAILED'}", flush=True)
    return ok


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", default="dkdv,dq", help="the Gluon backward kernels to force on: dkdv, dq")
    chosen = [x for x in p.parse_args().kernels.split(",") if x]
    for x in KERNELS:
        os.environ[f"FLASHLIGHT_GLUON_{x.upper()}"] = "all" if x in chosen else "0"
    cases = [("causal", 128), ("vanilla", 128), ("document_mask", 128), ("gqa", 128), ("causal", 64)]
    results = [check(name, d, chosen) for name, d in cases]
    sys.exit(0 if all(results) else 1)
