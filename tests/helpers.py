"""Helpers shared by the test files: compile, run, and check that a program really fused."""
from __future__ import annotations

import math

import torch

import flashlight
from flashlight.runtime.op import REGISTRY
from flashlight.testing import reference, rel_error, score_sized_nodes


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
