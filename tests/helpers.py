"""Helpers shared by the test files: compile, run, and check that a program really fused."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import torch

import flashlight
from flashlight.runtime.op import REGISTRY
from flashlight.testing import reference, rel_error, score_sized_nodes, to64


def causal_gqa(q, k, v):
    """Causal attention whose K/V heads are shared by groups of query heads (``repeat_interleave``)."""
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax((q @ k.mT * q.shape[-1] ** -0.5).masked_fill(mask, float("-inf")), -1) @ v


def check_fused(fn, *args, tol=1e-3, regions=1, score_numel=None):
    """Compile ``fn`` with flashlight, compare with float64 eager, and assert that it fused:
    explain() lists the regions, each kernel launched, and no score-sized tensor is computed by
    the graph Inductor receives. Returns (output, report)."""
    report = flashlight.explain(fn, *args)
    assert len(report.regions) == regions, str(report)
    before = {r.key: REGISTRY[r.key].launches for r in report.regions}
    out = torch.compile(fn, backend="flashlight")(*args)
    err = rel_error(out, reference(fn, *args))
    assert err < tol, f"rel error {err:.3e}\n{report}"
    for r in report.regions:
        assert REGISTRY[r.key].launches > before[r.key], f"{r.kernel} never launched"
    if score_numel is None:
        r = report.regions[0]
        score_numel = math.prod(r.shapes["batch"]) * r.shapes["M"] * r.shapes["N"]
    for g in report.graphs:
        assert not score_sized_nodes(g, score_numel), score_sized_nodes(g, score_numel)
    return out, report


def grads(fn, inputs, fp64: bool):
    """Gradients of sum(out * w), for a fixed random w, w.r.t. every floating input of ``fn``
    (computed in float64 when ``fp64``: the oracle)."""
    cast = to64 if fp64 else (lambda x: x)
    leaves = [cast(x).detach().requires_grad_() if x.is_floating_point() else x for x in inputs]
    out = fn(*leaves)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    return torch.autograd.grad((out * w).sum(), [x for x in leaves if x.requires_grad])


def check_grads(fn, inputs, tol=1e-3, generated=True, ref_fn=None):
    """``fn`` compiled with flashlight has the gradients of float64 eager (of ``ref_fn`` when
    given), input by input; with ``generated``, every region that ran used its generated
    backward kernel (its launch counter moved), else none did."""
    before = {k: (c.launches, c.bwd_launches) for k, c in REGISTRY.items()}
    got = grads(torch.compile(fn, backend="flashlight"), inputs, fp64=False)
    ref = grads(ref_fn or fn, inputs, fp64=True)
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        err = rel_error(a, b)
        assert err < tol, f"gradient {i}: rel error {err:.3e}"
    ran = {k: c for k, c in REGISTRY.items() if c.launches > before.get(k, (0, 0))[0]}
    assert ran, "no fused region ran"
    for k, c in ran.items():
        assert (c.bwd_launches > before.get(k, (0, 0))[1]) == generated, c.bwd_reason


def compile_offline(*argv: str) -> str:
    """Run ``python *argv`` from the repository root in a process of its own, without Triton's
    interpreter (this process has it on, and kernels jitted under it cannot compile for sm_90),
    and return its stdout; fails the test, with its stderr, if it fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).parents[1], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout
