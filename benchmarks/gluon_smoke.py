"""A quick check of the Gluon kernels on the GPU before a longer run (run it with a timeout: a
wrong barrier phase hangs): causal and full attention at D=128 and D=64, the Gluon forward and
the backward kernels named by ``--kernels`` (dkdv, dq) forced on and compiled at their first
launch, outputs and gradients against float64. Exits non-zero on a mismatch or a fallback. One
kernel per run tells which one hangs:

    timeout 60 python -m benchmarks.gluon_smoke --kernels dkdv
    timeout 60 python -m benchmarks.gluon_smoke --kernels dq
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


def check(name: str, d: int, kernels: list[str], n: int = 1024) -> bool:
    mod = VARIANTS[name]
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    REGISTRY.clear()
    out = torch.compile(mod.attention, backend="flashlight", dynamic=False)(q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    ref_in = [to64(x).detach().requires_grad_() for x in (q, k, v)]
    ref = mod.attention(*ref_in)
    refs = torch.autograd.grad(ref, ref_in, to64(dout))
    errs = [rel_error(out, ref)] + [rel_error(g, r) for g, r in zip(grads, refs)]
    (c,) = REGISTRY.values()
    ran = {"fwd": c.gfwd.launched, **{x: c.bwd_kernel.tier(x).launched for x in kernels}}
    ok = all(ran.values()) and errs[0] < 2e-2 and max(errs[1:]) < 5e-2
    print(f"{name} D={d} N={n}: gluon ran {ran}, rel err out {errs[0]:.1e} dq/dk/dv "
          f"{' '.join(f'{e:.1e}' for e in errs[1:])} {'ok' if ok else 'FAILED'}", flush=True)
    return ok


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", default="dkdv,dq", help="the Gluon backward kernels to force on: dkdv, dq")
    chosen = [x for x in p.parse_args().kernels.split(",") if x]
    for x in KERNELS:
        os.environ[f"FLASHLIGHT_GLUON_{x.upper()}"] = "all" if x in chosen else "0"
    results = [check(name, d, chosen) for d in (128, 64) for name in ("causal", "vanilla")]
    sys.exit(0 if all(results) else 1)
