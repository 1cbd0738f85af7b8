"""The region IR: one fused attention program.

Shape legend (all sizes are those seen at capture time)::

    batch   the score tensor's leading dims (e.g. (B, H)), index vars b0, b1, ...
    M       query length (var m)        N   key length (var n)
    DK      contraction (head) dim (dk) DV  value / output head dim (dv)

A region computes, for every (b..., m)::

    dots        qk_i[b, m, n] = sum_dk Q_i[b, m, dk] * K_i[b, n, dk]
    reductions  r_j[b, m] = reduce_n body_j[b, m, n]          (max / sum)
                r_j[b, m, dv] = sum_n body_j[b, m, n] * V_j[b, n, dv]   (kind "dot")
                a max / sum may have a row ``extra``: one more element, max(r_j, extra_j) /
                r_j + extra_j (an attention sink: a logit column appended after the N keys)
    out         out[b, m, dv] = out_expr(r..., loads)
    rows        row_i[b, m] = row_expr_i(r..., loads)     (extra outputs: logsumexp, row max, ...)

where every ``body_j`` may read the dots, loads, index vars and earlier reductions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from typing import Callable

from .expr import Expr, fmt, free_vars, refs, walk

RED_KINDS = ("max", "sum", "dot")


@dataclass(frozen=True)
class Input:
    """A tensor the kernel loads. ``name`` is the FX node it came from (for explain)."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Dot:
    q: Expr     # over (b..., m, dk)
    k: Expr     # over (b..., n, dk)


@dataclass(frozen=True)
class Reduction:
    kind: str               # "max" | "sum" | "dot"
    body: Expr              # over (b..., m, n)
    v: Expr | None = None   # over (b..., n, dv), for kind "dot"
    online: int | None = None   # index of the max reduction it is rescaled by (rewrite stage)
    extra: Expr | None = None   # over (b..., m): one more element of a max / sum (a sink column)
    base2: bool = False         # a max in log2 units (rewrite "base-2"): its sums rescale by exp2

    def __post_init__(self):
        assert self.kind in RED_KINDS
        assert (self.v is not None) == (self.kind == "dot")
        assert self.extra is None or self.kind != "dot"
        assert not self.base2 or self.kind == "max"

    def reads(self) -> frozenset[int]:
        """The reductions this one reads (in its body or its extra element)."""
        return refs(self.body, "red") | (refs(self.extra, "red") if self.extra is not None else frozenset())


@dataclass(frozen=True)
class Row:
    """An extra output over (b..., m) computed from the reductions, e.g. the logsumexp
    ``red0 + log(red1)`` that a program returns next to the attention output."""
    expr: Expr
    dtype: torch.dtype


@dataclass
class Region:
    batch: tuple[int, ...]
    M: int
    N: int
    DK: int
    DV: int
    inputs: list[Input]
    dots: list[Dot]
    reductions: list[Reduction]
    out: Expr                       # over (b..., m, dv)
    out_dtype: torch.dtype
    source: str = ""                # the user's source line(s), for explain()
    features: set[str] = field(default_factory=set)
    rows: list[Row] = field(default_factory=list)
    # The epilogue may end in permutes / reshapes of the (b..., m, dv) tile (Evoformer's output
    # transposed back to [B, S, R, H, C]): the output tensor's shape, and where tile element
    # (b..., m, dv) is stored in it. None: the tile's own layout.
    out_shape: tuple[int, ...] | None = None
    out_index: tuple[Expr, ...] | None = None

    @property
    def result_shape(self) -> tuple[int, ...]:
        return self.out_shape if self.out_shape is not None else (*self.batch, self.M, self.DV)

    @property
    def batch_vars(self) -> tuple[str, ...]:
        return tuple(f"b{i}" for i in range(len(self.batch)))

    def exprs(self) -> list[Expr]:
        """The output, the row outputs, and the reductions' bodies and extra elements."""
        reds = [x for red in self.reductions for x in (red.body, red.extra) if x is not None]
        return [self.out, *(row.expr for row in self.rows), *reds]

    def passes(self) -> list[list[int]]:
        """Group reductions into passes over N (see rewrite.assign_passes)."""
        level: list[int] = []
        for j, r in enumerate(self.reductions):
            deps = r.reads()
            lv = 0
            for d in deps:
                lv = max(lv, level[d] if r.online == d else level[d] + 1)
            level.append(lv)
        return [[j for j, lv in enumerate(level) if lv == p] for p in range(max(level, default=-1) + 1)]

    def __str__(self) -> str:
        return self.describe(sizes=True)

    def describe(self, sizes: bool) -> str:
        """The IR as text; without ``sizes`` it is the same for every sequence length, so the
        kernel source (and Triton's compiled kernel) is shared across lengths."""
        head = f"batch={self.batch} M={self.M} N={self.N} DK={self.DK} DV={self.DV}" if sizes else \
            f"batch rank {len(self.batch)}, DK={self.DK} DV={self.DV}"
        lines = [f"region {head}"]
        for i, x in enumerate(self.inputs):
            shape = tuple(x.shape) if sizes else f"rank {len(x.shape)}"
            lines.append(f"  in{i}: {x.name} {shape} {x.dtype}")
        for i, d in enumerate(self.dots):
            lines.append(f"  dot{i}: q={fmt(d.q)}  k={fmt(d.k)}")
        for j, r in enumerate(self.reductions):
            extra = f" v={fmt(r.v)}" if r.v is not None else ""
            on = f" online(red{r.online})" if r.online is not None else ""
            on += " base2" if r.base2 else ""
            extra += f" extra={fmt(r.extra)}" if r.extra is not None else ""
            lines.append(f"  red{j} = {r.kind}_n {fmt(r.body)}{extra}{on}")
        lines.append(f"  out = {fmt(self.out)} {self.out_dtype}")
        if self.out_index is not None:
            shape = self.out_shape if sizes else f"rank {len(self.out_shape)}"
            lines.append(f"  store [{', '.join(fmt(i) for i in self.out_index)}] of {shape}")
        lines += [f"  row{i} = {fmt(x.expr)} {x.dtype}" for i, x in enumerate(self.rows)]
        return "\n".join(lines)


def from_output(region: Region) -> dict[int, int]:
    """P @ V products the backward recomputes from the stored output instead of saving them:
    {j: k} when the output is exactly ``red_j / red_k`` (a product over a sum, no epilogue, no
    row outputs), so red_j = out * red_k — FA2's D = rowsum(dO * O) reads O the same way. Saves
    a [*batch, M, DV] fp32 tensor per call (twice a bf16 output) and its write and read."""
    o = region.out
    if region.rows or o.op not in ("div", "div_safe") or any(a.op != "red" for a in o.args):
        return {}
    j, k = (a.args[0] for a in o.args)
    kinds = (region.reductions[j].kind, region.reductions[k].kind)
    return {j: k} if kinds == ("dot", "sum") else {}


def body_loads(region: Region) -> int:
    """Distinct floating loads in the reductions' bodies, the score program's (a bias, a table,
    IPA's 24 point coordinates), not the dots' operands: what each tile recomputes and, in
    training, what keeps a gradient sum and a row vector live per load."""
    return len({x for r in region.reductions for x in walk(r.body) if x.op == "load" and x.kind == "f"})


def _same(ds: list[float]) -> float | None:
    return ds[0] if all(d == ds[0] for d in ds) else None


# How an expression changes when the shift m of a group of sums G grows: the sums scale by some
# c > 0 (c = exp(m_old - m_new), exp2 in base 2) and m moves by -log c (in its own units). An
# expression either scales, e -> c^d e (degree d), or moves, e -> e + a ln c (a move a);
# invariant is degree 0, which is move 0 too. Each DEGREE row: op -> degrees of the arguments ->
# degree (None: not homogeneous).
DEGREE: dict[str, Callable[[list[float]], float | None]] = {
    "mul": lambda d: d[0] + d[1],
    "div": lambda d: d[0] - d[1],
    "div_safe": lambda d: d[0] - d[1],      # b == 0 iff c b == 0 (c > 0)
    "add": _same, "sub": _same, "maximum": _same, "minimum": _same,
    "neg": lambda d: d[0], "to_f": lambda d: d[0],
    "relu": lambda d: d[0], "abs": lambda d: d[0],      # c > 0: relu(c x) = c relu(x), |c x| = c |x|
    "where": lambda d: _same(d[1:]) if d[0] == 0 else None,
}
LN2 = math.log(2.0)


def _const(e: Expr) -> float | None:
    return float(e.args[0]) if e.op == "const" and e.kind == "f" else None


# Each MOVES row: (node, [(kind, value) of the arguments: kind "mul" (a degree) or "add" (a move)])
# -> (kind, value), or None to leave the node to DEGREE: exp of a move scales (softmax's
# exp(s - m)), log of a scaled value moves (a logsumexp's log l), moves add.
def _moved(ch: tuple) -> float | None:
    return ch[1] if ch[0] == "add" or ch[1] == 0 else None


def _scaled(ch: tuple) -> float | None:
    return ch[1] if ch[0] == "mul" else None


def _moves_sum(x: Expr, ch: list) -> tuple | None:
    if not any(c[0] == "add" for c in ch) or any(_moved(c) is None for c in ch):
        return None
    a = [_moved(c) for c in ch]
    return "add", a[0] + a[1] if x.op == "add" else a[0] - a[1] if x.op == "sub" else -a[0]


def _moves_scaled(x: Expr, ch: list) -> tuple | None:
    """A move times (or over) a constant."""
    k = [_const(a) for a in x.args]
    for i in (0, 1) if x.op == "mul" else (0,):
        if ch[i][0] == "add" and k[1 - i] is not None:
            return "add", ch[i][1] * k[1 - i] if x.op == "mul" else ch[i][1] / k[1 - i]
    return None


MOVES: dict[str, Callable[[Expr, list], tuple | None]] = {
    "exp": lambda x, ch: None if _moved(ch[0]) is None else ("mul", _moved(ch[0])),
    "exp2": lambda x, ch: None if _moved(ch[0]) is None else ("mul", _moved(ch[0]) * LN2),
    "log": lambda x, ch: None if _scaled(ch[0]) is None else ("add", _scaled(ch[0])),
    "log2": lambda x, ch: None if _scaled(ch[0]) is None else ("add", _scaled(ch[0]) / LN2),
    "add": _moves_sum, "sub": _moves_sum, "neg": _moves_sum,
    "mul": _moves_scaled, "div": _moves_scaled,
}


def degree(e: Expr, group: set[int], shift: int | None = None, base2: bool = False) -> float | None:
    """The degree of ``e`` in the sums ``group``: 0 where it is invariant (a move of 0 too),
    None where it neither scales nor stays. ``shift``: the max of the group, which moves by
    -ln c (-log2 c in ``base2`` units). Ops without a row are of degree 0 when their arguments
    are (sigmoid(a/l))."""
    memo: dict[Expr, tuple | None] = {}
    for x in walk(e):
        if x.op == "red":
            j = x.args[0]
            memo[x] = ("mul", 1.0) if j in group else ("add", -1 / LN2 if base2 else -1.0) if j == shift \
                else ("mul", 0.0)
            continue
        ch = [memo[a] for a in x.args if isinstance(a, Expr)] if x.op != "load" else []
        if any(c is None for c in ch):
            memo[x] = None
            continue
        found = MOVES[x.op](x, ch) if x.op in MOVES else None
        if found is None:
            ds = [_scaled(c) if c[1] else 0.0 for c in ch]
            if any(d is None for d in ds):
                memo[x] = None
                continue
            d = DEGREE[x.op](ds) if x.op in DEGREE else 0.0 if all(d == 0 for d in ds) else None
            found = None if d is None else ("mul", d)
        memo[x] = None if found is None else (found[0], round(found[1], 9))
    ch = memo[e]
    return None if ch is None else ch[1] if ch[0] == "mul" or ch[1] == 0 else None


def output_exprs(region: Region) -> list[Expr]:
    """What the program returns: the output, then the extra row outputs (a logsumexp)."""
    return [region.out, *(row.expr for row in region.rows)]


def shift_gradients(region: Region) -> list[int]:
    """The running maxima the output is not invariant to, which therefore take a gradient: a
    max m shifts the sums it rescales (``online``), which scale as exp(-m); where the outputs are
    homogeneous of degree 0 in them and in its own exp(y - m) terms, and reads m nowhere else,
    dL/dm = 0 and the backward treats m as a constant. Otherwise (a softmax with an epsilon in
    its denominator: p = e / (sum e + eps), softpick's) dL/dm = dL/dm|direct - sum_k <dL/dr_k, r_k> over the sums r_k it shifts, and it
    reaches the score at the row's argmax, which the forward saves (``rowstat_columns``)."""
    found = []
    for j, r in enumerate(region.reductions):
        if r.kind != "max":
            continue
        group = {k for k, o in enumerate(region.reductions) if o.online == j}
        if any(degree(e, group, shift=j, base2=r.base2) != 0 for e in output_exprs(region)):
            found.append(j)
    return found


def rowstat_columns(region: Region) -> tuple[list[int | None], int]:
    """Layout of the fp32 statistics the forward saves for the backward, [*batch, M, W]: each
    reduction's final value from its first column (one for max and sum, DV for a P @ V product;
    None for a product recomputed from the output, ``from_output``); a max is stored as the
    shift the bodies used (-inf -> 0); then the argmax of every max in ``shift_gradients``
    (``argmax_columns``). Returns (first columns, W)."""
    cols, w, skip = [], 0, from_output(region)
    for j, rd in enumerate(region.reductions):
        cols.append(None if j in skip else w)
        w += 0 if j in skip else region.DV if rd.kind == "dot" else 1
    return cols, w + len(shift_gradients(region))


def argmax_columns(region: Region) -> dict[int, int]:
    """The column of each ``shift_gradients`` max's argmax (a key index in fp32, exact below
    2^24; -1 where no key exceeds the max's extra element or every key is masked), after the
    reductions' columns."""
    grads = shift_gradients(region)
    w = rowstat_columns(region)[1] - len(grads)
    return {j: w + i for i, j in enumerate(grads)}


class VerifyError(AssertionError):
    pass


def verify(region: Region) -> Region:
    """Check scoping: each expression uses only the index vars and leaves of its context."""
    b = set(region.batch_vars)

    def check(e: Expr, allowed: set[str], what: str, max_red: int, dots: bool):
        extra = free_vars(e) - allowed
        if extra:
            raise VerifyError(f"{what} uses index vars {sorted(extra)}: {fmt(e)}")
        for x in walk(e):
            if x.op == "load" and not 0 <= x.args[0] < len(region.inputs):
                raise VerifyError(f"{what} loads unknown input {x.args[0]}")
            if x.op == "load" and len(x.args[1]) != len(region.inputs[x.args[0]].shape):
                raise VerifyError(f"{what} indexes in{x.args[0]} with the wrong rank: {fmt(x)}")
            if x.op == "red" and not x.args[0] < max_red:
                raise VerifyError(f"{what} reads red{x.args[0]} before it is computed")
            if x.op == "dot" and (not dots or x.args[0] >= len(region.dots)):
                raise VerifyError(f"{what} reads {fmt(x)} outside the score context")
            if x.op == "sum_dv" and what != "out":
                raise VerifyError(f"{what} sums over dv outside the output tile: {fmt(x)}")

    for i, d in enumerate(region.dots):
        check(d.q, b | {"m", "dk"}, f"dot{i}.q", 0, False)
        check(d.k, b | {"n", "dk"}, f"dot{i}.k", 0, False)
    for j, r in enumerate(region.reductions):
        check(r.body, b | {"m", "n"}, f"red{j}.body", j, True)
        if r.v is not None:
            check(r.v, b | {"n", "dv"}, f"red{j}.v", 0, False)
        if r.extra is not None:
            check(r.extra, b | {"m"}, f"red{j}.extra", j, False)
        if r.online is not None and region.reductions[r.online].kind != "max":
            raise VerifyError(f"red{j} is rescaled by red{r.online}, which is not a max")
    check(region.out, b | {"m", "dv"}, "out", len(region.reductions), False)
    if region.out_index is not None:
        if len(region.out_index) != len(region.out_shape):
            raise VerifyError(f"store index of rank {len(region.out_index)} into {region.out_shape}")
        for d, i in enumerate(region.out_index):
            check(i, b | {"m", "dv"}, f"store index {d}", 0, False)
    for i, x in enumerate(region.rows):
        check(x.expr, b | {"m"}, f"row{i}", len(region.reductions), False)
        if any(region.reductions[j].kind == "dot" for j in refs(x.expr, "red")):
            raise VerifyError(f"row{i} reads a P @ V product, which is not a row value")
    return region
