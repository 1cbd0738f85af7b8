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
                a sum may be a ``scan``: the bodies of its pass read its partial sums over the
                keys before (prefix) or after (suffix) each key, ``scan(j)`` (stick-breaking)
                r_j[b, m] = the ``rank``-th largest of body_j[b, m, :]     (kind "kth": top-k
                attention's threshold, ``topk(s, k).values[..., -1:]``; duplicates count)
    out         out[b, m, dv] = out_expr(r..., loads)
    rows        row_i[b, m] = row_expr_i(r..., loads)     (extra outputs: logsumexp, row max, ...)

where every ``body_j`` may read the dots, loads, index vars and earlier reductions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .expr import Expr, fmt, free_vars, refs, walk
from .scaling import shift_gradients

RED_KINDS = ("max", "sum", "dot", "kth")
KTH_MAX = 128       # the largest rank a kernel keeps candidates for (a power of two; narrower key blocks are widened)
SCANS = (None, "prefix", "suffix")      # a suffix scan's pass runs its key blocks last to first


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
    scan: str | None = None     # a sum whose partial sums the bodies read: "prefix" or "suffix"
    stopped: bool = False       # a max read only through detach(): no gradient (rewrite "stopped-maxima")
    rank: int = 0               # kind "kth": which largest value (1: the max)

    def __post_init__(self):
        assert self.kind in RED_KINDS
        assert (self.v is not None) == (self.kind == "dot")
        assert self.extra is None or self.kind != "dot"
        assert not self.base2 or self.kind == "max"
        assert not self.stopped or self.kind == "max"
        assert (self.kind == "kth") == (self.rank >= 1) and (self.kind != "kth" or (
            self.extra is None and self.online is None and self.rank <= KTH_MAX))
        assert self.scan in SCANS and (self.scan is None or (self.kind == "sum" and self.extra is None
                                                             and self.online is None))

    @property
    def additive(self) -> bool:
        """A sum or a P @ V product: its body's terms add up over the keys (what the rewrites
        factor, split and rescale, and what takes a row gradient); not a max or a k-th largest."""
        return self.kind in ("sum", "dot")

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
        """Group reductions into passes over N (see rewrite.assign_passes). A body that reads a
        scan's partial sums runs in the scan's pass or a later one, which computes them again
        (``codegen.kernel.recomputed_scans``)."""
        level: list[int] = []
        for j, r in enumerate(self.reductions):
            lv = 0
            for d in r.reads():
                lv = max(lv, level[d] if r.online == d else level[d] + 1)
            for d in refs(r.body, "scan"):
                lv = max(lv, level[d])
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
            on += f" scan={r.scan}" if r.scan else ""
            on += " stopped" if r.stopped else ""
            on += f" rank={r.rank}" if r.kind == "kth" else ""
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


def every_pass(region: Region) -> list[int]:
    """Every reduction, pass by pass: what the backward's tiles reverse, and whose dead predicate
    its block scans test (a tile where every reduction gets its identity contributes nothing)."""
    return [j for p in region.passes() for j in p]


def rowstat_columns(region: Region) -> tuple[list[int | None], int]:
    """Layout of the fp32 statistics the forward saves for the backward, [*batch, M, W]: each
    reduction's final value from its first column (one for max and sum, DV for a P @ V product;
    None for a product recomputed from the output, ``from_output``); a max is stored as the
    shift the bodies used (-inf -> 0); then the argmax of every max in ``shift_gradients``
    (``argmax_columns``). Returns (first columns, W)."""
    cols, w = _reduction_columns(region)
    return cols, w + len(shift_gradients(region))


def _reduction_columns(region: Region) -> tuple[list[int | None], int]:
    """The reductions' first columns and their width (``rowstat_columns`` without the argmaxes)."""
    cols, w, skip = [], 0, from_output(region)
    for j, rd in enumerate(region.reductions):
        cols.append(None if j in skip else w)
        w += 0 if j in skip else region.DV if rd.kind == "dot" else 1
    return cols, w


def argmax_columns(region: Region) -> dict[int, int]:
    """The column of each ``shift_gradients`` max's argmax (a key index in fp32, exact below
    2^24; -1 where no key exceeds the max's extra element or every key is masked), after the
    reductions' columns."""
    w = _reduction_columns(region)[1]
    return {j: w + i for i, j in enumerate(shift_gradients(region))}


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
            if x.op == "scan" and (not dots or not x.args[0] < max_red or not region.reductions[x.args[0]].scan):
                raise VerifyError(f"{what} reads {fmt(x)}, not an earlier scan, or outside the score context")
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
