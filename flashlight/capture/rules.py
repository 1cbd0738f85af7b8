"""ATen op rules for symbolic evaluation: one row per op in ``RULES`` (see symbolic.py for the
signature). Views compose index maps, pointwise ops combine broadcast operands, index generators
become index arithmetic, reductions over the key dim and contractions register themselves."""
from __future__ import annotations

import itertools
import math
import operator
import os
import string
from typing import Callable

import torch
import torch.fx as fx

from ..ir import Expr, call, coerce, const, free_vars, refs, walk
from ..ir.expr import is_const
from ..ir.philox import LEVELS
from ..ir.region import KTH_MAX
from .scans import cumsum, key_triangle, triangle_product
from .symbolic import RULES, Builder, Sym, Unsupported, align, carries_grad, kind_of, meta, moved, static_shape, \
    written_after

aten = torch.ops.aten
Idx = tuple


# ---------------------------------------------------------------------------------------------
# Rule helpers
# ---------------------------------------------------------------------------------------------
def out_shape(node) -> tuple[int, ...]:
    return static_shape(meta(node))


def pointwise(b: Builder, node: fx.Node, fn: Callable[..., Expr], *operands) -> Sym:
    syms = [b.sym(x) for x in operands]
    shape, kind = out_shape(node), kind_of(meta(node).dtype)

    def f(idx):
        return coerce(fn(*(s(align(idx, shape, s.shape)) for s in syms)), kind)
    return Sym(shape, kind, f)


def unary(op: str):
    return lambda b, node, x, *_, **__: pointwise(b, node, lambda a: call(op, a), x)


def binary(op: str):
    return lambda b, node, x, y, *_, **__: pointwise(b, node, lambda a, c: call(op, a, c), x, y)


def view(b: Builder, node: fx.Node, x, remap: Callable[[Idx], Idx]) -> Sym:
    s = b.sym(x)
    return Sym(out_shape(node), s.kind, lambda idx: s(remap(idx)))


def _add(b, node, x, y, alpha=1):
    return pointwise(b, node, lambda a, c: call("add", a, c if alpha == 1 else call("mul", c, const(alpha))), x, y)


def _sub(b, node, x, y, alpha=1):
    return pointwise(b, node, lambda a, c: call("sub", a, c if alpha == 1 else call("mul", c, const(alpha))), x, y)


def _rsub(b, node, x, y, alpha=1):
    return _sub(b, node, y, x, alpha)


def _div(b, node, x, y, rounding_mode=None):
    if rounding_mode is None:
        return pointwise(b, node, lambda a, c: call("div", a, c), x, y)
    if rounding_mode == "floor":
        return pointwise(b, node, lambda a, c: call("floordiv", a, c) if kind_of(meta(node).dtype) == "i"
                         else call("floor", call("div", a, c)), x, y)
    return None


def _where(b, node, c, x, y):
    return pointwise(b, node, lambda cc, a, d: call("where", coerce(cc, "b"), a, d), c, x, y)


def _masked_fill(b, node, x, mask, value):
    return pointwise(b, node, lambda a, mm, v: call("where", coerce(mm, "b"), v, a), x, mask, value)


def _clamp(b, node, x, lo=None, hi=None):
    def f(a, *bounds):
        it = iter(bounds)
        if lo is not None: a = call("maximum", a, next(it))
        if hi is not None: a = call("minimum", a, next(it))
        return a
    return pointwise(b, node, f, x, *(v for v in (lo, hi) if v is not None))


def _nan_to_num(b, node, x, nan=0.0, posinf=None, neginf=None):
    """NaN to ``nan``, ±inf to ``posinf`` / ``neginf`` (default: the dtype's largest finite
    values): the DIFF Transformer's reference code applies it to its scores."""
    dtype = meta(node).dtype
    if not dtype.is_floating_point:
        return _identity(b, node, x)
    fi = torch.finfo(dtype)
    lo, hi = (fi.min if neginf is None else neginf), (fi.max if posinf is None else posinf)
    def f(a):
        clamped = call("minimum", call("maximum", a, const(float(lo))), const(float(hi)))
        return call("where", call("ne", a, a), const(float(nan)), clamped)      # a != a: NaN
    return pointwise(b, node, f, x)


def _pow(b, node, x, y):
    if isinstance(y, (int, float)) and float(y).is_integer() and 1 <= y <= 4:
        def f(a, _):
            r = a
            for _ in range(int(y) - 1):
                r = call("mul", r, a)
            return r
        return pointwise(b, node, f, x, y)
    if isinstance(x, (int, float)) and x > 0:   # base ** t = exp2(t * log2(base)): ALiBi slopes
        return pointwise(b, node, lambda _, e: call("exp2", call("mul", coerce(e, "f"), const(math.log2(x)))), x, y)
    return pointwise(b, node, lambda a, e: call("pow", a, e), x, y)


def _cast(b, node, x, *_, **__):
    """A cast only changes the kind: the kernel computes in fp32 whatever the dtype. But a float
    narrowed to a smaller float (``q.to(torch.bfloat16)``, the casts autocast makes before a
    product) and read as a product operand, along a head dim, is loaded as computed outside the
    kernel when it is computed from loads alone: the product then runs on the narrow type, as
    eager's does, where loading the wide tensor makes the kernel's products fp32 (on an fp32
    tensor core path, or no tensor cores at all)."""
    kind, s = kind_of(meta(node).dtype), b.sym(x)
    if not _narrows(meta(x), meta(node)):
        return Sym(out_shape(node), kind, lambda idx: coerce(s(idx), kind))
    leaf = b.leaf(node)

    def fn(idx):
        spans = set().union(*(free_vars(i) for i in idx))
        saved = b.snapshot()
        e = s(idx)
        if spans & {"dk", "dv"} and not {"m", "n"} <= spans and not refs(e, "dot") | refs(e, "red"):
            b.restore(saved)      # the wide tensor's loads are not the kernel's
            return leaf(idx)
        return coerce(e, kind)
    return Sym(out_shape(node), kind, fn)


def _narrows(src: torch.Tensor, dst: torch.Tensor) -> bool:
    return src.is_floating_point() and dst.is_floating_point() and dst.itemsize < src.itemsize


def _identity(b, node, x, *_, **__):
    return view(b, node, x, lambda idx: idx)


def _dropout(b, node, x, p, train):
    """Training dropout: keep where a 16-bit Philox draw is at least p * 65536, scaled by
    1 / (1 - p). The draw is ``rand16(seed, row, col)`` at the element's row (linear index over
    all dims but the last) and column (the last, the key axis), so the kernel spends one Philox
    call per 8 keys (``ir/philox.py``). p is quantised to 1/65536: the keep probability is
    1 - round(p * 65536) / 65536 (|error| <= 2**-17; FlashAttention-2 quantises to 8 bits); the
    scale stays eager's 1 / (1 - p). The seed is a 0-d input drawn per call (``runtime/rng.py``)."""
    if not train or p == 0:
        return _identity(b, node, x)
    threshold = round(p * LEVELS)
    if not 0 < threshold < LEVELS:
        return b.decline(node, f"dropout with p={p} (keep probability quantised to 1/{LEVELS} is 0 or 1)")
    s, seed = b.sym(x), b.sym(_seed_node(node))
    shape = out_shape(node)
    strides = [math.prod(shape[d + 1:-1]) for d in range(len(shape) - 1)]

    def fn(idx):
        row = const(0)
        for i, st in zip(idx[:-1], strides):
            row = row + i * st
        col = idx[-1] if idx else const(0)
        keep = call("ge", call("rand16", seed(()), row, col), const(threshold))
        return call("where", keep, call("mul", coerce(s(idx), "f"), const(1.0 / (1.0 - p))), const(0.0))
    return Sym(shape, "f", fn)


def _seed_node(node: fx.Node) -> fx.Node:
    """The ``flashlight::seed`` call in front of ``node``: one per dropout, so regions that read
    the same dropped-out tensor draw the same mask (dead code if no region is fused). It takes
    an empty tensor on the device: under ``torch.utils.checkpoint`` Inductor wraps random ops in
    ``run_and_save_rng_state``, which finds the device (whose generator state it saves for the
    recompute) in a tensor argument."""
    from ..runtime import rng  # noqa: F401 — registers the op
    if "flashlight_seed" not in node.meta:
        with node.graph.inserting_before(node):
            device = meta(node).device
            anchor = node.graph.call_function(torch.ops.aten.empty.memory_format, ([0],), {"device": device})
            anchor.meta["val"] = torch.empty(0, device="meta")
            seed = node.graph.call_function(torch.ops.flashlight.seed.default, (anchor,))
        seed.meta["val"] = torch.empty((), dtype=torch.int64, device="meta")
        node.meta["flashlight_seed"] = seed
    return node.meta["flashlight_seed"]


# -- views ------------------------------------------------------------------------------------
def _norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _permute(b, node, x, dims):
    rank = len(dims)
    inv = [0] * rank
    for out_pos, in_pos in enumerate(dims):
        inv[_norm_dim(in_pos, rank)] = out_pos
    return view(b, node, x, lambda idx: tuple(idx[inv[i]] for i in range(rank)))


def _transpose(b, node, x, d0, d1):
    rank = len(out_shape(node))
    d0, d1 = _norm_dim(d0, rank), _norm_dim(d1, rank)
    perm = list(range(rank))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permute(b, node, x, perm)


def _t(b, node, x):
    return _transpose(b, node, x, 0, 1) if len(out_shape(node)) == 2 else _identity(b, node, x)


def _mT(b, node, x):
    return _transpose(b, node, x, -2, -1)


def _unsqueeze(b, node, x, d):
    d = _norm_dim(d, len(out_shape(node)))
    return view(b, node, x, lambda idx: idx[:d] + idx[d + 1:])


def _squeeze(b, node, x, dims=None):
    in_shape = b.sym(x).shape
    dims = range(len(in_shape)) if dims is None else ([dims] if isinstance(dims, int) else dims)
    drop = {_norm_dim(d, len(in_shape)) for d in dims if in_shape[_norm_dim(d, len(in_shape))] == 1}

    def remap(idx):
        it = iter(idx)
        return tuple(const(0) if i in drop else next(it) for i in range(len(in_shape)))
    return view(b, node, x, remap)


def _expand(b, node, x, *_, **__):
    s = b.sym(x)
    shape = out_shape(node)
    return Sym(shape, s.kind, lambda idx: s(align(idx, shape, s.shape)))


def _slice(b, node, x, dim=0, start=None, end=None, step=1):
    in_shape = b.sym(x).shape
    dim = _norm_dim(dim, len(in_shape))
    start = 0 if start is None else (start + in_shape[dim] if start < 0 else start)
    return view(b, node, x, lambda idx: idx[:dim] + (idx[dim] * step + start,) + idx[dim + 1:])


def _select(b, node, x, dim, index):
    in_shape = b.sym(x).shape
    dim = _norm_dim(dim, len(in_shape))
    index = index + in_shape[dim] if index < 0 else index
    return view(b, node, x, lambda idx: idx[:dim] + (const(index),) + idx[dim:])


def relinearize(idx: Idx, src: tuple[int, ...], dst: tuple[int, ...], node=None) -> Idx:
    """The index into ``dst`` of element ``idx`` of ``src`` at the same row-major position (a
    reshape): group dims whose products match, linearise each group of ``src`` dims and unflatten
    it into the group's ``dst`` dims."""
    srcs = [i for i, s in enumerate(src) if s != 1]
    dsts = [i for i, s in enumerate(dst) if s != 1]
    groups, gd, gs = [], [], []
    pd = ps = 1
    while dsts or srcs:
        if pd <= ps and dsts:
            gd.append(dsts.pop(0)); pd *= dst[gd[-1]]
        else:
            gs.append(srcs.pop(0)); ps *= src[gs[-1]]
        if pd == ps:
            groups.append((gd, gs)); gd, gs, pd, ps = [], [], 1, 1
    if gd or gs:
        raise Unsupported(f"reshape {src} -> {dst}", node)
    res = [const(0)] * len(dst)
    for g_dst, g_src in groups:
        lin, stride = const(0), 1
        for o in reversed(g_src):
            lin = idx[o] * stride + lin
            stride *= src[o]
        inner = stride
        for t, i in enumerate(g_dst):
            inner //= dst[i]
            e = lin // inner
            res[i] = e if t == 0 else e % dst[i]
    return tuple(res)


def _reshape(b, node, x, *_, **__):
    """General reshape as index arithmetic (``relinearize``)."""
    in_shape, shape = b.sym(x).shape, out_shape(node)
    relinearize(tuple(const(0) for _ in shape), shape, in_shape, node)     # unsupported: raise now
    return view(b, node, x, lambda idx: relinearize(idx, shape, in_shape, node))


def _item(b, node, parent, i):
    """``parent[i]`` of an op returning several tensors (``ITEMS``)."""
    rule = ITEMS.get(getattr(parent.target, "overloadpacket", None)) if isinstance(parent, fx.Node) else None
    return rule(b, node, parent, i) if rule else None


def _values(b, node, parent, i):
    """``torch.max(x, dim).values`` (``min``): the amax (amin) over the keys, where ``backward_support``
    treats it as the shift it is (softpick's reference code spells its max this way). Their
    indices stay leaves."""
    if i != 0 or parent.target._overloadname != "dim":
        return None
    x, dim, *rest = parent.args
    keepdim = rest[0] if rest else parent.kwargs.get("keepdim", False)
    return (_amax if parent.target.overloadpacket == aten.max else _amin)(b, node, x, dim, keepdim)


def _ranked(b, node, body: Expr, r: int, size: int) -> Expr:
    """The ``r``-th largest of ``body`` over ``size`` key positions (1 <= r <= size): a ``kth``
    reduction of rank r, or minus the (size + 1 - r)-th largest of -body (the same value counted
    from the smallest: ``kthvalue``, ``largest=False``, sorts read near their end), whichever
    keeps fewer candidates."""
    if r <= size + 1 - r and r <= KTH_MAX:
        return b.add_reduction("kth", body, size=size, rank=r)
    if size + 1 - r <= KTH_MAX:
        return call("neg", b.add_reduction("kth", call("neg", body), size=size, rank=size + 1 - r))
    raise Unsupported(f"the {r}-th largest of {size}: a kernel keeps at most {KTH_MAX} values per row, "
                      "counted from either end", node)


def _sort_order(parent: fx.Node) -> tuple[bool | None, int]:
    """The order of a ``topk`` or ``sort`` node's values — True descending, False ascending, None
    unsorted — and the dim it sorts (``sort.stable`` takes both as keywords)."""
    arg = lambda i, name, default: parent.args[i] if len(parent.args) > i else parent.kwargs.get(name, default)  # noqa: E731
    if parent.target.overloadpacket == aten.topk:
        return (arg(3, "largest", True) if arg(4, "sorted", True) else None), arg(2, "dim", -1)
    if parent.target._overloadname == "stable":
        return parent.kwargs.get("descending", False), parent.kwargs.get("dim", -1)
    return arg(2, "descending", False), arg(1, "dim", -1)


def _order_stats(b, node, x, dim, rank: Callable[[int], int]) -> Sym | None:
    """Sorted values of x over the keys read at constant positions c: entry c is the
    ``rank(c)``-th largest (``_ranked``); read elsewhere, the values are loaded (computed outside
    the region)."""
    s = b.sym(x)
    if _norm_dim(dim, len(s.shape)) != len(s.shape) - 1 or s.shape[-1] != b.N:
        return None

    def fn(idx):
        if idx[-1].op != "const" or any("n" in free_vars(e) for e in idx[:-1]):
            return b.leaf(node)(idx)    # the values as a whole: computed outside, loaded
        return _ranked(b, node, s(idx[:-1] + (b.n,)), rank(int(idx[-1].args[0])), b.N)
    return Sym(out_shape(node), "f", fn)


def _topk_values(b, node, parent, i):
    """``topk(x, k).values`` over the keys: entry c of a row is the (c + 1)-th largest value
    (the (c + 1)-th smallest with ``largest=False``), read at constant positions — top-k
    attention's threshold ``[..., -1:]``. Its indices stay leaves."""
    if i != 0:
        return None
    x, k, *_ = parent.args
    largest, dim = _sort_order(parent)
    if largest is None or not isinstance(k, int):
        return None     # (unsorted values: no entry is a rank; a symbolic k: no fixed candidates)
    return _order_stats(b, node, x, dim, lambda c: c + 1 if largest else b.N - c)


def _sort_values(b, node, parent, i):
    """``sort(x).values`` over the keys (``stable`` or not: the values are the same), read at
    constant positions: entry c is the (c + 1)-th largest descending, the (c + 1)-th smallest
    ascending. Its indices stay leaves."""
    if i != 0:
        return None
    descending, dim = _sort_order(parent)
    return _order_stats(b, node, parent.args[0], dim, lambda c: c + 1 if descending else b.N - c)


def _kthvalue_values(b, node, parent, i):
    """``kthvalue(x, k).values`` over the keys: the k-th smallest, the (N + 1 - k)-th largest, a
    reduction as ``amax`` is."""
    if i != 0:
        return None
    x, k, *rest = parent.args
    dim = rest[0] if rest else parent.kwargs.get("dim", -1)
    keepdim = rest[1] if len(rest) > 1 else parent.kwargs.get("keepdim", False)
    if not isinstance(k, int) or not 1 <= k <= b.N:
        return None
    return _reduce_last(b, node, x, dim, keepdim, lambda bb, body, size: _ranked(bb, node, body, size + 1 - k, size))


def _sorted_end(b, node, x, dims, keepdim: bool, largest: bool) -> Sym | None:
    """The max (``largest``) or min over the last dim of values sorted along it (``topk``'s,
    ``sort``'s): their first or last entry (``topk(k).values.amin(-1)`` is the k-th largest)."""
    if not (isinstance(x, fx.Node) and x.target is operator.getitem and x.args[1] == 0 and
            isinstance(x.args[0], fx.Node) and getattr(x.args[0].target, "overloadpacket", None) in (aten.topk, aten.sort)):
        return None
    (descending, sorted_dim), s = _sort_order(x.args[0]), b.sym(x)
    dims = [dims] if isinstance(dims, int) else list(dims)
    last = len(s.shape) - 1
    if descending is None or len(dims) != 1 or _norm_dim(dims[0], len(s.shape)) != last or \
            _norm_dim(sorted_dim, len(s.shape)) != last:
        return None
    pos = const(0 if largest == descending else s.shape[-1] - 1)
    return Sym(out_shape(node), "f", lambda idx: s((idx[:-1] if keepdim else idx) + (pos,)))


def _split_item(b, node, parent, i):
    """``split``/``chunk(x, ...)[i]``: a slice of x (DiffAttn's half-heads)."""
    x, size, *rest = parent.args
    dim = rest[0] if rest else parent.kwargs.get("dim", 0)
    sx = b.sym(x)
    dim = _norm_dim(dim, len(sx.shape))
    n = sx.shape[dim]
    if parent.target.overloadpacket == aten.chunk:
        size = -(-n // size)
    sizes = list(size) if isinstance(size, (list, tuple)) else [size] * (-(-n // size))
    start = sum(sizes[:i])
    return Sym(out_shape(node), sx.kind, lambda idx: sx(idx[:dim] + (idx[dim] + start,) + idx[dim + 1:]))


def _repeat_interleave(b, node, x, repeats, dim=None, output_size=None):
    if not isinstance(repeats, int) or dim is None:
        return None
    dim = _norm_dim(dim, len(out_shape(node)))
    return view(b, node, x, lambda idx: idx[:dim] + (idx[dim] // repeats,) + idx[dim + 1:])


def _repeat(b, node, x, repeats):
    in_shape = b.sym(x).shape
    shape = out_shape(node)
    lead = len(shape) - len(in_shape)
    return view(b, node, x, lambda idx: tuple(idx[lead + i] % s for i, s in enumerate(in_shape)))


def _index(b, node, x, indices):
    """Advanced indexing with integer tensors at adjacent dims: a gather, read in the kernel at
    the computed position (learned relative-position tables indexed by a bucket of q - kv)."""
    sx = b.sym(x)
    pos = [i for i, t in enumerate(indices) if t is not None]
    if not pos or pos != list(range(pos[0], pos[-1] + 1)):
        return None
    isyms = [b.sym(indices[i]) for i in pos]
    if any(s.kind != "i" for s in isyms):
        return None       # boolean-mask indexing changes the shape with the data
    shape = out_shape(node)
    nb = len(shape) - (len(sx.shape) - len(pos))
    bshape = shape[pos[0]:pos[0] + nb]

    def fn(idx):
        mid = idx[pos[0]:pos[0] + nb]
        vals = []
        for s, p in zip(isyms, pos):
            v = s(align(mid, bshape, s.shape))
            vals.append(call("where", call("lt", v, const(0)), call("add", v, const(sx.shape[p])), v))
        return sx(idx[:pos[0]] + tuple(vals) + idx[pos[0] + nb:])
    return Sym(shape, sx.kind, fn)


def _gather(b, node, x, dim, index, sparse_grad=False):
    """``torch.gather(x, dim, index)``: x read at ``index`` along ``dim`` (DeBERTa's
    content-to-position scores: a query-by-2k product gathered at clamped relative positions, so
    the kernel reads the small product instead of a query-by-key tensor built outside)."""
    sx, si = b.sym(x), b.sym(index)
    if si.kind != "i":
        return None
    shape = out_shape(node)
    dim = _norm_dim(dim, len(shape))
    return Sym(shape, sx.kind, lambda idx: sx(idx[:dim] + (si(idx),) + idx[dim + 1:]))


def _detach_inplace(b, node, x):
    """``x.detach_()`` of a value no gradient reaches (``torch.tensor([2])`` traced: a constant
    detached in place) is x; one that carries a gradient stays a leaf: eager stops it there."""
    return None if carries_grad(x) else _identity(b, node, x)


def _index_select(b, node, x, dim, index):
    """``x.index_select(dim, index)``: x read at ``index[i]`` along ``dim`` (a constant index
    list picks sorted values' entries: top-k's threshold)."""
    sx, si = b.sym(x), b.sym(index)
    if si.kind != "i" or len(si.shape) != 1:
        return None
    dim = _norm_dim(dim, len(sx.shape))
    return Sym(out_shape(node), sx.kind, lambda idx: sx(idx[:dim] + (si((idx[dim],)),) + idx[dim + 1:]))


# -- index generators -------------------------------------------------------------------------
def _arange(b, node, *args, **kwargs):
    nums = [a for a in args if isinstance(a, (int, float))]
    start, step = (0, 1) if len(nums) == 1 else (nums[0], nums[2] if len(nums) > 2 else 1)
    kind = kind_of(meta(node).dtype)
    return Sym(out_shape(node), kind, lambda idx: coerce(idx[0] * step + start, kind))


def _fill(value_of: Callable):
    def rule(b, node, *args, **kwargs):
        value = value_of(args, kwargs)
        if not isinstance(value, (bool, int, float)):
            return None
        kind = kind_of(meta(node).dtype)
        e = coerce(const(value), kind)
        return Sym(out_shape(node), kind, lambda idx: e)
    return rule


def _flip(b, node, x, dims):
    shape = out_shape(node)
    flipped = {_norm_dim(d, len(shape)) for d in dims}
    return view(b, node, x, lambda idx: tuple(call("sub", const(shape[d] - 1), i) if d in flipped else i
                                              for d, i in enumerate(idx)))


def _log_sigmoid(b, node, x):       # log(sigmoid(a)) = min(a, 0) - log1p(exp(-|a|)), without overflow
    return pointwise(b, node, lambda a: call("sub", call("minimum", a, const(0.0)),
                                             call("log1p", call("exp", call("neg", call("abs", a))))), x)


def _softplus(b, node, x, beta=1, threshold=20):     # torch's: linear where beta * a > threshold
    def f(a):
        ba = a if beta == 1 else call("mul", a, const(float(beta)))
        soft = call("log1p", call("exp", ba))
        return call("where", call("gt", ba, const(float(threshold))), a,
                    soft if beta == 1 else call("div", soft, const(float(beta))))
    return pointwise(b, node, f, x)


def _tri(keep: Callable[[Expr, Expr, int], Expr]):
    def rule(b, node, x, diagonal=0):
        s = b.sym(x)
        zero = coerce(const(0), s.kind)
        return Sym(s.shape, s.kind, lambda idx: call("where", keep(idx[-2], idx[-1], diagonal), s(idx), zero))
    return rule


# -- reductions over the key dim, and the two contractions ------------------------------------
def _reduce_last(b: Builder, node, x, dims, keepdim: bool, combine: Callable[[Builder, Expr, int], Expr]) -> Sym | None:
    s = b.sym(x)
    dims = [dims] if isinstance(dims, int) else list(dims)
    if len(dims) != 1 or _norm_dim(dims[0], len(s.shape)) != len(s.shape) - 1:
        return b.decline(node, f"{node.target} over dims {dims}: only reductions over the key (last) dim fuse")
    if s.shape[-1] not in (b.N, b.N + 1):
        return None      # a reduction over some other last dim (a head dim): not over the keys (+ a sink)
    leaf = b.leaf(node)

    def fn(idx):
        head = idx[:-1] if keepdim else idx
        if s.shape[-1] in (b.DK, b.DV) and not _reads_scores(b, s, head + (b.n,)):
            return leaf(idx)     # over a head dim as long as the keys (QK-norm's at N == D): computed outside
        if any("n" in free_vars(i) for i in head):
            raise Unsupported("reduction over N read at a varying key position", node)
        return combine(b, s(head + (b.n,)), s.shape[-1])
    return Sym(out_shape(node), "f", fn)


def _reads_scores(b: Builder, s: Sym, idx: Idx) -> bool:
    """Whether ``s`` at ``idx`` reads a score product (a trial: what it adds to ``b`` is undone)."""
    saved = b.snapshot()
    try:
        return bool(refs(s(idx), "dot"))
    except Unsupported:
        return False
    finally:
        b.restore(saved)


def _softmax_parts(b: Builder, body: Expr, size: int) -> tuple[Expr, Expr, Expr]:
    """Row max m, exp(x - m) and its row sum l of a softmax over ``size`` key positions."""
    mx = b.add_reduction("max", body, size=size)
    e = call("exp", call("sub", body, mx))
    return mx, e, b.add_reduction("sum", e, size=size)


def _softmax_keys(b: Builder, node, s: Sym, dim: int, idx: Idx) -> int | None:
    """Where a softmax over ``dim`` of ``s``, read at ``idx``, reduces over the keys: the dim's
    position, when the reader indexes it with the key (the last dim of [.., M, N] scores, the one
    before of [.., N, M] ones: ``softmax(k @ q^T, -2)``) or at a constant (a sink column, one
    key's weight). None when it indexes it with a batch axis (a softmax over the heads of a [H]
    gate): computed outside the kernel. Raises where it indexes it with another axis of the tile
    (a softmax over the queries: slot attention) or the keys index another dim too."""
    d = _norm_dim(dim, len(s.shape))
    at = free_vars(idx[d])
    if "n" not in at and (at or s.shape[d] not in (b.N, b.N + 1)):
        tile = at & {"m", "dk", "dv"}
        if tile:
            raise Unsupported(f"softmax over dim {dim}, read along {'the queries' if 'm' in tile else 'a head dim'} "
                              "there: only a softmax over the keys fuses", node)
        return None
    if any("n" in free_vars(i) for i in idx[:d] + idx[d + 1:]):
        raise Unsupported(f"softmax over dim {dim} read where the keys are another dim: only a softmax over the keys "
                          "fuses", node)
    return d


def _softmax_like(log: bool):
    """softmax, or log_softmax, over any dim the reader indexes with the keys (``_softmax_keys``)."""
    def rule(b, node, x, dim, *_, **__):
        s, leaf = b.sym(x), b.leaf(node)

        def fn(idx):
            d = _softmax_keys(b, node, s, dim, idx)
            if d is None:
                return leaf(idx)
            mx, _, l = _softmax_parts(b, s(idx[:d] + (b.n,) + idx[d + 1:]), s.shape[d])
            if log:
                return call("sub", s(idx), call("add", call("log", l), mx))
            # at the tile's key n this is the e of the sum; elsewhere (a sink column) its own value
            return call("div_safe", call("exp", call("sub", s(idx), mx)), l)    # a fully masked row gives 0, not NaN
        return Sym(out_shape(node), "f", fn)
    return rule


def _amax(b, node, x, dims=(), keepdim=False):
    return _sorted_end(b, node, x, dims, keepdim, largest=True) or \
        _reduce_last(b, node, x, dims, keepdim, lambda bb, body, size: bb.add_reduction("max", body, size=size))


def _amin(b, node, x, dims=(), keepdim=False):     # min_n x = -max_n(-x)
    return _sorted_end(b, node, x, dims, keepdim, largest=False) or \
        _reduce_last(b, node, x, dims, keepdim,
                     lambda bb, body, size: call("neg", bb.add_reduction("max", call("neg", body), size=size)))


def _sum_dv(b: Builder, node, x, scale: float) -> Sym:
    """A sum over the output's head dim in the epilogue (capture/epilogue.py checked: the last
    dim, keepdim): a row value of the output tile."""
    s = b.sym(x)
    return Sym(out_shape(node), "f", lambda idx: call("mul", call("sum_dv", s(idx[:-1] + (b.dv,))), const(scale)))


UNROLL = 64     # most terms a sum over small dims other than the key axis is unrolled into


def _over_keys(b: Builder, x, dims) -> bool:
    """A reduction over the key axis: the last dim alone, N long (N + 1 with a sink column)."""
    shape = out_shape(x)
    dims = [dims] if isinstance(dims, int) else list(dims)
    return len(dims) == 1 and _norm_dim(dims[0], len(shape)) == len(shape) - 1 and shape[-1] in (b.N, b.N + 1)


def _unrolled_sum(b: Builder, node, x, dims, keepdim: bool, scale: float) -> Sym | None:
    """A sum over small dims that are not the key axis (IPA's point and xyz dims of squared
    distances), unrolled into the scalar expression: exact, and no score-sized tensor."""
    s = b.sym(x)
    rank = len(s.shape)
    dims = sorted({_norm_dim(d, rank) for d in ([dims] if isinstance(dims, int) else dims)})
    sizes = [s.shape[d] for d in dims]
    if math.prod(sizes) > UNROLL:
        return b.decline(node, f"sum over dims {dims} of sizes {sizes}: neither the key axis nor small")

    def fn(idx):
        kept = [i for d, i in enumerate(idx) if not (keepdim and d in dims)]
        total = None
        for point in itertools.product(*(range(n) for n in sizes)):
            at, rest, fixed = [], iter(kept), dict(zip(dims, point))
            for d in range(rank):
                at.append(const(fixed[d]) if d in fixed else next(rest))
            term = s(tuple(at))
            total = term if total is None else call("add", total, term)
        total = coerce(total, "f")
        return total if scale == 1.0 else call("mul", total, const(scale))
    return Sym(out_shape(node), "f", fn)


def _sum(b, node, x, dims=None, keepdim=False, *_, **__):
    if dims is None:
        return None
    if node in b.epilogue:
        return _sum_dv(b, node, x, 1.0)
    if not _over_keys(b, x, dims):
        return _unrolled_sum(b, node, x, dims, keepdim, 1.0)
    return _reduce_last(b, node, x, dims, keepdim, lambda bb, body, size: bb.add_reduction("sum", body, size=size))


def _mean(b, node, x, dims=None, keepdim=False, *_, **__):
    if dims is None:
        return None
    if node in b.epilogue:
        return _sum_dv(b, node, x, 1.0 / b.DV)
    if not _over_keys(b, x, dims):
        shape = out_shape(x)
        count = math.prod(shape[_norm_dim(d, len(shape))] for d in ([dims] if isinstance(dims, int) else dims))
        return _unrolled_sum(b, node, x, dims, keepdim, 1.0 / count)
    return _reduce_last(b, node, x, dims, keepdim, lambda bb, body, size: call(
        "div", bb.add_reduction("sum", body, size=size), const(float(size))))


def _logsumexp(b, node, x, dims, keepdim=False):
    def combine(bb, body, size):
        mx, _, l = _softmax_parts(bb, body, size)
        return call("add", call("log", l), mx)
    return _reduce_last(b, node, x, dims, keepdim, combine)


def _cat(b, node, tensors, dim=0):
    """``torch.cat``. Empty operands drop out (Llama 3's ``hstack([zeros((L, start_pos)), mask])``
    at start_pos 0). Scores with one column appended after the N keys are an attention sink's
    logit (gpt-oss): read at the key index it is ``cat_n(score, column)``, so a softmax over it
    spans N + 1 positions; read at position N it is the column. Other operands that need no
    score tile (masks and biases built from indices or loads) are read piecewise along the dim,
    each at its own clamped index; anything else stays a leaf."""
    shape = out_shape(node)
    dim = _norm_dim(dim, len(shape))
    tensors = [t for t in tensors if len(out_shape(t)) != len(shape) or out_shape(t)[dim] != 0]
    if len(tensors) == 1:
        return _identity(b, node, tensors[0])
    if dim == len(shape) - 1 and len(tensors) == 2 and out_shape(tensors[0])[-1] == b.N and \
            out_shape(tensors[1])[-1] == 1:
        return _sink_column(b, node, *tensors)
    syms = [b.sym(t) for t in tensors]
    if any(len(x.shape) != len(shape) for x in syms):
        return None         # a legacy 1-D empty tensor beside others: not worth a rule
    kind, leaf = kind_of(meta(node).dtype), b.leaf(node)
    starts = list(itertools.accumulate([0] + [x.shape[dim] for x in syms]))

    def fn(idx):
        i = idx[dim]
        parts = [coerce(x(idx[:dim] + (call("minimum", call("maximum", call("sub", i, const(lo)), const(0)),
                                            const(x.shape[dim] - 1)),) + idx[dim + 1:]), kind)
                 for x, lo in zip(syms, starts)]
        if any(refs(e, "dot") or refs(e, "red") for e in parts):
            b.decline(node, "torch.cat of scores fuses only as one column appended after the N keys")
            return leaf(idx)
        out = parts[-1]
        for e, hi in zip(reversed(parts[:-1]), reversed(starts[1:-1])):
            out = call("where", call("lt", i, const(hi)), e, out)
        return out
    return Sym(shape, kind, fn)


def _sink_column(b, node, scores, col):
    sa, se = b.sym(scores), b.sym(col)
    kind, leaf = kind_of(meta(node).dtype), b.leaf(node)

    def fn(idx):
        column = coerce(se(idx[:-1] + (const(0),)), kind)
        if idx[-1] == b.n:
            return call("cat_n", coerce(sa(idx), kind), column)
        if is_const(idx[-1], b.N):
            return column
        return leaf(idx)
    return Sym(out_shape(node), kind, fn)


def _stack_h(b, node, tensors):
    """``torch.hstack``: cat along dim 1 (dim 0 of 1-D tensors)."""
    return _cat(b, node, tensors, 1 if len(out_shape(node)) > 1 else 0)


def _embedding(b, node, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """``F.embedding(idx, table)``: ``table[idx]`` (T5's relative-position bias). A padding row
    (no gradient in eager) or gradients scaled by frequency decline."""
    if padding_idx not in (None, -1) or scale_grad_by_freq:
        return None
    return _index(b, node, weight, [indices])


def _extremum(op: str):
    """``torch.max(a, b)`` / ``torch.min(a, b)`` (the ``other`` overloads: OPT clamps its scores
    with it); the reducing overloads stay leaves."""
    binary_rule = binary(op)
    return lambda b, node, *args, **kw: binary_rule(b, node, *args, **kw) \
        if node.target._overloadname == "other" else None


def contraction(b: Builder, node: fx.Node, sx: Sym, sy: Sym, order: tuple[int, ...] | None = None,
                x: fx.Node | None = None, y: fx.Node | None = None,
                wrap_x: Callable[[Sym], Sym] = lambda s: s, wrap: Callable[[Sym], Sym] = lambda s: s) -> Sym | None:
    """``x @ y`` with matmul broadcasting. At a score tile (.., m, n) it is a dot of the region;
    at an output tile (.., m, dv) with a score-like left operand it is a reduction over N;
    anywhere else it is a leaf computed outside the kernel. ``order``: which of the node's dims
    holds each dim of the (batch..., rows, cols) product (an einsum with permuted output letters).
    ``x``, ``y``: the operands' nodes, whose computed Q, K or V operand may load as a leaf
    (``computed_operand``); ``sx`` is ``wrap_x(b.sym(x))``, ``sy`` is ``wrap(b.sym(y))``."""
    if len(sx.shape) < 2 or len(sy.shape) < 2:
        return None
    own = out_shape(node)
    order = order or tuple(range(len(own)))
    shape = tuple(own[o] for o in order)
    leaf = b.leaf(node)
    bshape = shape[:-2]

    def fn(idx):
        ax = align(idx[:-2], bshape, sx.shape[:-2])
        ay = align(idx[:-2], bshape, sy.shape[:-2])
        K = sx.shape[-1]
        scanned = triangle_product(b, sx, sy, ax, ay) if b.is_tile(idx, b.m, b.n) and shape[-2:] == (b.M, b.N) else None
        if scanned is not None:
            return scanned
        for rows, cols in ((b.m, b.n), (b.n, b.m)):     # q @ k^T, or k @ q^T (the scores transposed)
            if not (b.is_tile(idx, rows, cols) and shape[-2:] == (b.size(rows), b.size(cols)) and K == (b.DK or K)):
                continue
            b.DK = K
            if rows is b.m:     # each operand: (node, sym, its index at the tile, wrap)
                q_op, k_op = (x, sx, ax + (b.m, b.dk), wrap_x), (y, sy, ay + (b.dk, b.n), wrap)
            else:
                q_op, k_op = (y, sy, ay + (b.dk, b.m), wrap), (x, sx, ax + (b.n, b.dk), wrap_x)
            trained = b.grad_mode and carries_grad(node)
            q = computed_operand(b, *q_op, ("m", "dk")) if trained else q_op[1](q_op[2])
            return b.add_dot(q, computed_operand(b, *k_op, ("n",)))
        if b.is_tile(idx, b.m, b.dv) and shape[-2:] == (b.M, b.DV) and K == b.N and not key_triangle(b, sy, ay):
            body = sx(ax + (b.m, b.n))
            if refs(body, "dot"):
                return b.add_reduction("dot", body, computed_operand(b, y, sy, ay + (b.n, b.dv), wrap, ("n",)))
        return leaf(permute_back(idx, order))
    return Sym(own, "f", lambda idx: fn(tuple(idx[o] for o in order)))


def permute_back(idx: Idx, order: tuple[int, ...]) -> Idx:
    """The node's index of element ``idx`` of its (batch..., rows, cols) order."""
    res = [None] * len(idx)
    for i, o in enumerate(order):
        res[o] = idx[i]
    return tuple(res)


def computed_operand(b: Builder, y: fx.Node | None, sy: Sym, idx: Idx, wrap: Callable[[Sym], Sym],
                     along: tuple[str, ...]) -> Expr:
    """A Q, K or V operand at ``idx``: ``sy``'s expression, unless that reads two or more floating
    tensors indexed ``along`` all of the given axes (``("n",)`` for K and V, ``("m", "dk")`` for
    Q): RoPE's ``k * cos + rotate_half(k) * sin``, QK-norm's ``k / k.norm()`` (for K); not a
    gather through a page table, whose index is an integer load. Such an operand is loaded from
    the node that computes it instead, computed once outside the kernel, as eager computes it.
    - K and V: in the kernel every query block would compute their tiles again, and the Gluon
      forward needs K and V read as rows.
    - Q (the caller asks only in training): the forward computes a Q tile once, but the dK/dV
      kernel computes every Q tile again for each key block, and its dQ kernel keeps the
      operand's tiles live across its loop for the chain rule (RoPE at D=128 on an H100: 4.4
      and 4.0 ms against causal's 1.2 and 0.7, registers spilled); as a load, the backward is
      the plain one and Inductor differentiates the rotation. A per-row factor (``q * g[m]``,
      ``q / q.norm()``) costs the kernels one row vector per tile and stays.
    ``FLASHLIGHT_KV_LEAVES=0`` keeps them all in the kernel."""
    saved = b.snapshot()
    e = sy(idx)
    loads = {x for x in walk(e) if x.op == "load" and x.kind == "f" and
             all(any(a in free_vars(i) for i in x.args[1]) for a in along)}
    if y is None or len(loads) < 2 or os.environ.get("FLASHLIGHT_KV_LEAVES", "1") == "0":
        return e
    chain, src = [], y
    # stop at a copy (repeat_interleave, clone, a reshape's) of a tensor written later: load the copy
    while (x := moved(src)) is not None and not written_after(x, src):
        chain.append(src)
        src = x
    if src.op != "call_function" or meta(src) is None or not meta(src).is_floating_point():
        return e
    b.restore(saved)        # the trial's leaves are not the kernel's
    for n in chain:
        b.syms.pop(n, None)
    b.syms[src] = b.leaf(src)
    return wrap(b.sym(y))(idx)


def _matmul(b, node, x, y):
    return contraction(b, node, b.sym(x), b.sym(y), x=x, y=y)


def _baddbmm(b, node, inp, x, y, beta=1, alpha=1):
    """``beta * inp + alpha * (x @ y)``: BLOOM's scores, its ALiBi bias as ``inp``. A score
    tile adds the bias to the region's dot; elsewhere the node is computed outside the kernel."""
    prod = contraction(b, node, b.sym(x), b.sym(y), x=x, y=y)
    if prod is None:
        return None
    si, shape, kind = b.sym(inp), out_shape(node), kind_of(meta(node).dtype)

    def f(idx):
        p = prod(idx)
        if p.op == "red":
            raise Unsupported("baddbmm as the P @ V product", node)
        if p.op != "dot":
            return p            # the node itself, loaded
        scaled = p if alpha == 1 else call("mul", p, const(alpha))
        if beta == 0:       # the input is ignored, NaN and inf included (torch.empty buffers: Megatron)
            return coerce(scaled, kind)
        bias = si(align(idx, shape, si.shape))
        return coerce(call("add", bias if beta == 1 else call("mul", bias, const(beta)), scaled), kind)
    return Sym(shape, kind, f)


def expand_ellipsis(equation: str, ranks: list[int]) -> str:
    """``equation`` with each ``...`` written as letters it does not use, right-aligned as
    einsum broadcasts them (``... i d, ... j d -> ... i j`` on 4-D and 3-D operands:
    ``ABid,Bjd->ABij``); unchanged where it has none or cannot be expanded (einsum_letters
    then declines it)."""
    eq = equation.replace(" ", "")
    if "..." not in eq or "->" not in eq:
        return eq
    lhs, out = eq.split("->")
    ops = lhs.split(",")
    counts = [r - (len(o) - 3) if "..." in o else 0 for o, r in zip(ops, ranks)]
    if len(ops) != len(ranks) or any(c < 0 for c in counts):
        return eq
    letters = [ch for ch in string.ascii_uppercase + string.ascii_lowercase if ch not in eq][:max(counts)]
    fill = lambda o, c: o.replace("...", "".join(letters[len(letters) - c:]))     # noqa: E731
    return ",".join(fill(o, c) for o, c in zip(ops, counts)) + "->" + fill(out, len(letters))


def einsum_letters(equation: str) -> tuple[str, str, str, str, tuple[int, ...]] | None:
    """(a, c, contracted, rows + cols order, ``order``) of a two-operand einsum with one
    contracted letter: the product in (batch..., rows, cols) order, which the output may permute.
    The rows letter is ``a``'s last output letter that ``c`` lacks, the cols letter ``c``'s last
    that ``a`` lacks (each operand's own order, so the scores' and P @ V's einsums agree however
    the output permutes them); other output letters are batch letters, which an operand that
    lacks them broadcasts over: MQA's ``bhsd,btd->bhst`` (K and V shared by the heads),
    DeepSeek-V3's absorbed MLA ``bshc,btc->bsht`` (rows are the heads, as FlashMLA's decode
    kernel has them). None for anything else: a letter repeated in an operand (a diagonal), two
    contracted letters, a letter summed out of one operand."""
    if "..." in equation or "->" not in equation:
        return None
    lhs, out = equation.replace(" ", "").split("->")
    if lhs.count(",") != 1:
        return None
    a, c = lhs.split(",")
    if len(set(a)) != len(a) or len(set(c)) != len(c) or len(set(out)) != len(out):
        return None
    contracted = [ch for ch in a if ch in c and ch not in out]
    rows = [ch for ch in a if ch in out and ch not in c]
    cols = [ch for ch in c if ch in out and ch not in a]
    if len(contracted) != 1 or not rows or not cols or any(ch not in a + c for ch in out) or \
            any(ch not in out + contracted[0] for ch in a + c):
        return None
    natural = "".join(ch for ch in out if ch not in (rows[-1], cols[-1])) + rows[-1] + cols[-1]
    return a, c, contracted[0], natural, tuple(out.index(ch) for ch in natural)


def _einsum(b, node, equation, operands):
    """Two-operand einsum with one contracted letter, normalised to a batched matmul."""
    if len(operands) != 2 or any(meta(x) is None for x in operands):
        return None
    letters = einsum_letters(expand_ellipsis(equation, [meta(x).dim() for x in operands]))
    if letters is None:
        return None
    a, c, kk, natural, order = letters
    sa, sc = b.sym(operands[0]), b.sym(operands[1])
    batch, mm, nn = natural[:-2], natural[-2], natural[-1]

    def norm(s: Sym, letters: str, pair: str) -> Sym:
        # view the operand as (batch..., pair[0], pair[1]): batch letters it lacks, and letters
        # where it has size 1, broadcast (the operand's own sizes, not the other's)
        full = batch + pair
        if any(ch not in full for ch in letters):
            raise Unsupported(f"einsum {equation}: a letter is summed out", node)
        own = dict(zip(letters, s.shape))
        return Sym(tuple(own.get(ch, 1) for ch in full), s.kind,
                   lambda idx: s(tuple(idx[full.index(ch)] for ch in letters)))

    return contraction(b, node, norm(sa, a, mm + kk), norm(sc, c, kk + nn), order, *operands,
                       wrap_x=lambda s: norm(s, a, mm + kk), wrap=lambda s: norm(s, c, kk + nn))


# In-place updates of scores (gpt-oss: ``QK *= sm_scale; QK += mask``): the out-of-place op, when
# the updated tensor is a fresh intermediate that nothing reads after the update.
INPLACE = {aten.add_: aten.add, aten.sub_: aten.sub, aten.mul_: aten.mul, aten.div_: aten.div,
           aten.masked_fill_: aten.masked_fill, aten.fill_: aten.fill, aten.triu_: aten.triu, aten.tril_: aten.tril}
ALIASING = {aten.view, aten.reshape, aten._unsafe_view, aten.permute, aten.transpose, aten.t, aten.mT,
            aten.unsqueeze, aten.squeeze, aten.expand, aten.expand_as, aten.slice, aten.select,
            aten.alias, aten.detach, aten.contiguous, aten.to, aten.type_as}


def _private(x, node: fx.Node) -> bool:
    """``x`` owns its memory or is a view of a tensor that does (not an input; in-place chains
    and views are followed to their base: ``torch.zeros(n, n).float().fill_(-inf)``, where
    ``.float()`` of a float tensor is the tensor itself) and no node after ``node`` reads it or
    anything on the way to its base."""
    if not isinstance(x, fx.Node) or x.op != "call_function":
        return False
    p = getattr(x.target, "overloadpacket", None)
    if p not in RULES or (p in ALIASING or p in INPLACE) and not _private(x.args[0], node):
        return False
    position = {n: i for i, n in enumerate(node.graph.nodes)}
    return all(position[u] <= position[node] for u in x.users)


def _inplace(op):
    def rule(b, node, x, *args, **kwargs):
        if not _private(x, node):
            return b.decline(node, f"{node.target} updates a tensor that is an input, a view, or read later")
        return RULES[op](b, node, x, *args, **kwargs)
    return rule


def _bool_only(rule):
    return lambda b, node, *args, **kw: rule(b, node, *args, **kw) if meta(node).dtype == torch.bool else None


RULES.update({
    # arithmetic
    aten.add: _add, aten.sub: _sub, aten.rsub: _rsub, aten.mul: binary("mul"), aten.div: _div,
    aten.true_divide: binary("div"), aten.floor_divide: binary("floordiv"),
    aten.remainder: binary("mod"), aten.maximum: binary("maximum"), aten.minimum: binary("minimum"),
    aten.max: _extremum("maximum"), aten.min: _extremum("minimum"),
    aten.pow: _pow, aten.clamp: _clamp, aten.clamp_min: lambda b, n, x, lo: _clamp(b, n, x, lo),
    aten.clamp_max: lambda b, n, x, hi: _clamp(b, n, x, None, hi),
    aten.neg: unary("neg"), aten.abs: unary("abs"), aten.sign: unary("sign"),
    aten.exp: unary("exp"), aten.exp2: unary("exp2"), aten.log: unary("log"), aten.log2: unary("log2"),
    aten.log1p: unary("log1p"), aten.expm1: unary("expm1"), aten.sqrt: unary("sqrt"),
    aten.rsqrt: unary("rsqrt"), aten.reciprocal: unary("reciprocal"), aten.tanh: unary("tanh"),
    aten.sigmoid: unary("sigmoid"), aten.relu: unary("relu"), aten.erf: unary("erf"),
    aten.log_sigmoid: _log_sigmoid, aten.softplus: _softplus,
    aten.sin: unary("sin"), aten.cos: unary("cos"), aten.floor: unary("floor"),
    aten.ceil: unary("ceil"), aten.round: unary("round"), aten.nan_to_num: _nan_to_num,
    aten.square: lambda b, n, x: pointwise(b, n, lambda a: call("mul", a, a), x),
    # float classes (softpick's ``where(x.isfinite(), ...)`` drops the masked scores)
    aten.isfinite: lambda b, n, x: pointwise(b, n, lambda a: call("lt", call("abs", a), const(math.inf)), x),
    aten.isinf: lambda b, n, x: pointwise(b, n, lambda a: call("eq", call("abs", a), const(math.inf)), x),
    aten.isposinf: lambda b, n, x: pointwise(b, n, lambda a: call("eq", a, const(math.inf)), x),
    aten.isneginf: lambda b, n, x: pointwise(b, n, lambda a: call("eq", a, const(-math.inf)), x),
    aten.isnan: lambda b, n, x: pointwise(b, n, lambda a: call("ne", a, a), x),
    # comparisons and logic
    aten.eq: binary("eq"), aten.ne: binary("ne"), aten.lt: binary("lt"), aten.le: binary("le"),
    aten.gt: binary("gt"), aten.ge: binary("ge"),
    aten.logical_and: binary("and"), aten.logical_or: binary("or"), aten.logical_xor: binary("xor"),
    aten.logical_not: unary("not"), aten.bitwise_not: _bool_only(unary("not")),
    aten.bitwise_and: _bool_only(binary("and")), aten.bitwise_or: _bool_only(binary("or")),
    aten.bitwise_xor: _bool_only(binary("xor")), aten.__and__: _bool_only(binary("and")),
    aten.__or__: _bool_only(binary("or")), aten.__xor__: _bool_only(binary("xor")),
    aten.where: _where, aten.masked_fill: _masked_fill,
    # casts and no-ops
    aten.to: _cast, aten._to_copy: _cast, aten.type_as: _cast, aten.clone: _identity,
    aten.contiguous: _identity, aten.alias: _identity, aten.detach: _identity,
    aten.lift_fresh_copy: _identity, aten.detach_: _detach_inplace,
    aten.dropout: _dropout,
    # views
    aten.permute: _permute, aten.transpose: _transpose, aten.t: _t, aten.mT: _mT,
    aten.unsqueeze: _unsqueeze, aten.squeeze: _squeeze, aten.expand: _expand,
    aten.expand_as: _expand, aten.view: _reshape, aten.reshape: _reshape, aten._unsafe_view: _reshape,
    aten.flatten: _reshape, aten.unflatten: _reshape,
    aten.slice: _slice, aten.select: _select, aten.cat: _cat, aten.repeat_interleave: _repeat_interleave,
    aten.repeat: _repeat, aten.index: _index, aten.hstack: _stack_h, aten.embedding: _embedding,
    aten.gather: _gather, aten.index_select: _index_select, aten.flip: _flip,
    # index generators
    aten.arange: _arange,
    aten.ones: _fill(lambda a, k: 1), aten.zeros: _fill(lambda a, k: 0),
    aten.full: _fill(lambda a, k: a[1]), aten.ones_like: _fill(lambda a, k: 1),
    aten.zeros_like: _fill(lambda a, k: 0), aten.full_like: _fill(lambda a, k: a[1]),
    aten.scalar_tensor: _fill(lambda a, k: a[0]),
    aten.new_full: _fill(lambda a, k: a[2]), aten.new_ones: _fill(lambda a, k: 1),
    aten.new_zeros: _fill(lambda a, k: 0), aten.fill: _fill(lambda a, k: a[1]),
    aten.tril: _tri(lambda i, j, d: call("le", call("sub", j, i), const(d))),
    aten.triu: _tri(lambda i, j, d: call("ge", call("sub", j, i), const(d))),
    # reductions over the key dim
    aten.softmax: _softmax_like(False), aten._softmax: _softmax_like(False), aten._safe_softmax: _softmax_like(False),
    aten.log_softmax: _softmax_like(True), aten._log_softmax: _softmax_like(True),
    aten.amax: _amax, aten.amin: _amin, aten.sum: _sum, aten.mean: _mean, aten.logsumexp: _logsumexp,
    aten.cumsum: cumsum,
    # contractions
    aten.matmul: _matmul, aten.bmm: _matmul, aten.mm: _matmul, aten.einsum: _einsum, aten.baddbmm: _baddbmm,
})
# ops returning several tensors: op -> rule for item i
ITEMS = {aten.split: _split_item, aten.chunk: _split_item, aten.split_with_sizes: _split_item,
         aten.max: _values, aten.min: _values, aten.topk: _topk_values, aten.sort: _sort_values,
         aten.kthvalue: _kthvalue_values}
RULES[operator.getitem] = _item
RULES.update({inplace: _inplace(op) for inplace, op in INPLACE.items()})
