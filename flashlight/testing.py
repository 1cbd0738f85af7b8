"""Shared test oracles and input factories: float64 eager references and relative errors."""
from __future__ import annotations

import operator

import torch


def to64(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def reference(fn, *args, **kwargs) -> torch.Tensor:
    """``fn`` evaluated eagerly in float64. Rows whose every key is masked come out NaN in eager;
    Flashlight defines them as 0 (like FlexAttention), so the oracle does too."""
    out = fn(*(to64(a) for a in args), **{k: to64(v) for k, v in kwargs.items()})
    return torch.nan_to_num(out, nan=0.0)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere in ``out`` counts as infinite error."""
    out, ref = out.double().cpu(), ref.double().cpu()
    if torch.isnan(out).any():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _fused_op(target) -> bool:
    """A flashlight op, or the Python function a graph without autograd calls instead."""
    return "flashlight" in str(target) or getattr(target, "__module__", "").startswith("flashlight")


def score_sized_nodes(gm: torch.fx.GraphModule, numel: int) -> list[str]:
    """Nodes of a graph handed to Inductor that produce a tensor at least ``numel`` large."""
    bad = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if _fused_op(n.target) or any(_fused_op(a.target) for a in n.all_input_nodes if n.target is operator.getitem):
            continue      # the fused op's own outputs (they can be as large as a tiny score tensor)
        if n.op == "call_function" and isinstance(val, torch.Tensor) and val.numel() >= numel:
            bad.append(f"{n.name} = {n.target}{tuple(val.shape)}")
    return bad
