"""Reference evaluator: run a region's IR with plain torch ops, materialising the score tensor.

This is the region's semantics written without any kernel: the CPU path of the fused op when the
Triton interpreter is off, the oracle that separates capture bugs from codegen bugs in tests, and
(through torch autograd) the backward until generated backward kernels exist. It computes in
float32, or float64 when any floating input is float64 (so gradcheck works).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from . import philox
from .expr import Expr, walk
from .region import Region, rowstat_columns

OPS: dict[str, Callable] = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "div_safe": lambda a, b: torch.where(b == 0, torch.zeros_like(a / b), a / torch.where(b == 0, 1, b)),
    "idiv": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "imod": torch.remainder,
    "floordiv": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "mod": torch.remainder,
    "maximum": torch.maximum, "minimum": torch.minimum, "pow": torch.pow,
    "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
    "and": torch.logical_and, "or": torch.logical_or, "xor": torch.logical_xor, "not": torch.logical_not,
    "neg": torch.neg, "abs": torch.abs, "sign": torch.sign,
    "exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log2": torch.log2, "log1p": torch.log1p,
    "expm1": torch.expm1, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal,
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu, "erf": torch.erf,
    "sin": torch.sin, "cos": torch.cos, "floor": torch.floor, "ceil": torch.ceil, "round": torch.round,
    "where": torch.where,
    "stop": torch.Tensor.detach,
    "rand16": philox.rand16,
}


def compute_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


class _Context:
    """Evaluates expressions over one index space, e.g. (*batch, M, N) for score bodies."""

    def __init__(self, ev: "Evaluator", dims: dict[str, int]):
        self.ev, self.memo = ev, {}
        self.shape = tuple(dims.values())
        names = list(dims)
        for pos, name in enumerate(names):
            view = [1] * len(names)
            view[pos] = -1
            self.memo[Expr("var", (name,), "i")] = torch.arange(dims[name], device=ev.device).view(view)

    def __call__(self, e: Expr) -> torch.Tensor:
        for x in walk(e):
            if x not in self.memo:
                self.memo[x] = self._node(x)
        return self.memo[e]

    def _node(self, x: Expr) -> torch.Tensor:
        ev = self.ev
        if x.op == "const":
            dtype = {"b": torch.bool, "i": torch.int64, "f": ev.dtype}[x.kind]
            return torch.tensor(x.args[0], dtype=dtype, device=ev.device)
        if x.op == "load":
            t = ev.inputs[x.args[0]]
            t = t.to(ev.dtype) if t.is_floating_point() else t
            return t[tuple(self.memo[i] for i in x.args[1])] if x.args[1] else t
        if x.op == "dot":
            return ev.dot(x.args[0])
        if x.op == "red":
            return ev.red_value(x.args[0], self)
        if x.op == "scan":
            return ev.scans[x.args[0]]
        if x.op == "to_f":
            return self.memo[x.args[0]].to(ev.dtype)
        if x.op == "to_i":
            return self.memo[x.args[0]].to(torch.int64)
        if x.op == "to_b":
            return self.memo[x.args[0]] != 0
        if x.op == "sum_dv":        # only in the output context, where dv is the last dim
            return ev.full(self.memo[x.args[0]], self).sum(-1, keepdim=True)
        return OPS[x.op](*(self.memo[a] for a in x.args))


class Evaluator:
    def __init__(self, region: Region, inputs: Sequence[torch.Tensor]):
        self.region, self.inputs = region, list(inputs)
        self.device = inputs[0].device
        self.dtype = compute_dtype(inputs)
        bdims = dict(zip(region.batch_vars, region.batch))
        self.ctx_q = _Context(self, {**bdims, "m": region.M, "dk": region.DK})
        self.ctx_k = _Context(self, {**bdims, "n": region.N, "dk": region.DK})
        self.ctx_s = _Context(self, {**bdims, "m": region.M, "n": region.N})
        self.ctx_v = _Context(self, {**bdims, "n": region.N, "dv": region.DV})
        self.ctx_o = _Context(self, {**bdims, "m": region.M, "dv": region.DV})
        self.dots: dict[int, torch.Tensor] = {}
        self.reds: list[torch.Tensor] = []
        self.scans: dict[int, torch.Tensor] = {}    # a scan's partial sums, (*batch, M, N)

    def full(self, t: torch.Tensor, ctx: _Context) -> torch.Tensor:
        return t.to(self.dtype).expand(ctx.shape)

    def dot(self, i: int) -> torch.Tensor:
        if i not in self.dots:
            d = self.region.dots[i]
            q, k = self.full(self.ctx_q(d.q), self.ctx_q), self.full(self.ctx_k(d.k), self.ctx_k)
            self.dots[i] = q @ k.transpose(-1, -2)
        return self.dots[i]

    def red_value(self, j: int, ctx: _Context) -> torch.Tensor:
        r = self.reds[j]
        if ctx is self.ctx_s and self.region.reductions[j].kind == "max":
            r = torch.where(torch.isneginf(r), torch.zeros_like(r), r)  # exp(-inf - 0) = 0, not NaN
        return r

    def run(self) -> torch.Tensor:
        return self.run_all()[0]

    def run_all(self) -> list[torch.Tensor]:
        """The output and the extra row outputs (each (*batch, M))."""
        for j, r in enumerate(self.region.reductions):
            body = self.full(self.ctx_s(r.body), self.ctx_s)
            if r.scan:
                self.scans[j] = partial_sums(body, r.scan)
            if r.kind == "max":
                val = body.amax(-1, keepdim=True)
            elif r.kind == "sum":
                val = body.sum(-1, keepdim=True)
            elif r.kind == "kth":       # fewer keys than the rank: -inf (a kernel's candidates start there)
                val = body.topk(r.rank, -1).values[..., -1:] if r.rank <= body.shape[-1] else \
                    torch.full_like(body[..., :1], -math.inf)
            else:
                val = body @ self.full(self.ctx_v(r.v), self.ctx_v)
            if r.extra is not None:      # one more element (a sink column)
                extra = self.ctx_s(r.extra).to(self.dtype).expand(val.shape)
                val = torch.maximum(val, extra) if r.kind == "max" else val + extra
            self.reds.append(val)
        out = self.full(self.ctx_o(self.region.out), self.ctx_o)
        if self.region.out_index is not None:     # a permuted / reshaped store
            idx = tuple(self.ctx_o(i).expand(self.ctx_o.shape) for i in self.region.out_index)
            out = out.new_zeros(self.region.out_shape).index_put(idx, out)
        rows = [self.full(self.ctx_o(x.expr), self.ctx_o)[..., 0] for x in self.region.rows]
        return [out, *rows]


def partial_sums(body: torch.Tensor, direction: str) -> torch.Tensor:
    """The sums of ``body`` over the keys before each key ("prefix") or after it ("suffix"),
    the key itself excluded."""
    zero = torch.zeros_like(body[..., :1])
    if direction == "prefix":
        return torch.cat([zero, body[..., :-1].cumsum(-1)], -1)
    return torch.cat([body[..., 1:].flip(-1).cumsum(-1).flip(-1), zero], -1)


def evaluate(region: Region, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Run ``region`` on ``inputs``; returns its result (*batch, M, DV, or ``out_shape``) in the
    compute dtype."""
    return Evaluator(region, inputs).run()


def evaluate_with_rowstats(region: Region, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``evaluate``, and the fp32 row statistics the forward kernel saves (``rowstat_columns``)."""
    ev = Evaluator(region, inputs)
    out = ev.run()
    cols, _ = rowstat_columns(region)
    stats = [torch.where(torch.isneginf(x), 0.0, x) if r.kind == "max" else x
             for x, r, c in zip(ev.reds, region.reductions, cols) if c is not None]
    return out, torch.cat([x.float() for x in stats], -1)


def evaluate_all(region: Region, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Like ``evaluate``, followed by the region's extra row outputs, each (*batch, M)."""
    return Evaluator(region, inputs).run_all()
