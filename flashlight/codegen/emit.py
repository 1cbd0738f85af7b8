"""Expression emission: region IR -> Triton expressions, with CSE and loop-invariant hoisting."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..ir import Expr, call, const, free_vars, refs, var, walk
from ..ir.expr import JUMPS


class CodegenError(Exception):
    pass


def _cast_f(x: str) -> str:
    return f"{x}.to(tl.float32)"


# One row per IR op: a format string over the operand names. Float-only ops get fp32 operands.
TRITON: dict[str, str] = {
    "add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}", "div": "{0} / {1}",
    "div_safe": "tl.where({1} == 0, 0.0, {0} / tl.where({1} == 0, 1.0, {1}))",
    "idiv": "{0} // {1}", "imod": "{0} % {1}",
    "floordiv": "fl_floordiv({0}, {1})", "mod": "fl_mod({0}, {1})",
    "maximum": "tl.maximum({0}, {1})", "minimum": "tl.minimum({0}, {1})",
    "pow": "tl.exp2({1} * tl.log2({0}))",
    "eq": "{0} == {1}", "ne": "{0} != {1}", "lt": "{0} < {1}", "le": "{0} <= {1}",
    "gt": "{0} > {1}", "ge": "{0} >= {1}",
    "and": "{0} & {1}", "or": "{0} | {1}", "xor": "{0} ^ {1}", "not": "{0} == 0",
    "neg": "-{0}", "abs": "tl.abs({0})", "sign": "tl.where({0} > 0, 1, 0) - tl.where({0} < 0, 1, 0)",
    "exp": "tl.exp({0})", "exp2": "tl.exp2({0})", "log": "tl.log({0})", "log2": "tl.log2({0})",
    "log1p": "fl_log1p({0})", "expm1": "tl.exp({0}) - 1.0", "sqrt": "tl.sqrt({0})",
    "rsqrt": "tl.rsqrt({0})", "reciprocal": "1.0 / {0}",
    "tanh": "2.0 * tl.sigmoid(2.0 * {0}) - 1.0",   # tanh(x) = 2 sigmoid(2x) - 1
    "sigmoid": "tl.sigmoid({0})", "relu": "tl.maximum({0}, 0)", "erf": "tl.erf({0})",
    "sin": "tl.sin({0})", "cos": "tl.cos({0})", "floor": "tl.floor({0})", "ceil": "tl.ceil({0})",
    "where": "tl.where({0}, {1}, {2})",
    "to_f": "{0}.to(tl.float32)", "to_i": "{0}.to(tl.int64)", "to_b": "{0} != 0",
    "stop": "{0}",
    # the output tile holds whole rows of dv (BLOCK_DV >= DV): a row sum, padding columns masked
    "sum_dv": "tl.sum(tl.where(mask_dv[None, :], {0} + tl.zeros([BLOCK_M, BLOCK_DV], tl.float32), 0.0), 1, keep_dims=True)",
    "rand16": "fl_rand16({0}, {1}, {2})",     # any index tiles; CTX_S's key axis: fl_rand16_block
}
FLOAT_OPERANDS = {"div", "div_safe", "pow", "exp", "exp2", "log", "log2", "log1p", "expm1", "sqrt",
                  "rsqrt", "reciprocal", "tanh", "sigmoid", "erf", "sin", "cos", "sum_dv"}

HELPERS = '''
@triton.jit
def fl_floordiv(a, b):
    # Python floor division for integers of any sign (Triton's // truncates)
    q = a // b
    return q - tl.where((a % b != 0) & ((a < 0) != (b < 0)), 1, 0)


@triton.jit
def fl_mod(a, b):
    # Python remainder: takes the sign of the divisor
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
'''

# Dropout's draws (ir/philox.py has the definition and its torch twin); only kernels that call
# them carry them (``prelude``).
RAND16_HELPERS = '''
@triton.jit
def fl_philox16(seed, group, row):
    # Philox-4x32-10 keyed by the seed at counter (group lo, group hi, row lo, row hi): 4 uint32
    # words = the 8 16-bit draws of 8 consecutive keys of a row
    return tl.philox(seed, group.to(tl.uint32), (group >> 32).to(tl.uint32),
                     row.to(tl.uint32), (row >> 32).to(tl.uint32))


@triton.jit
def fl_rand16(seed, row, col):
    # rand16 at any (row, col) tiles: one Philox call per element, lane col % 8 of its 128 bits
    row, col = tl.broadcast(row.to(tl.int64), col.to(tl.int64))
    r0, r1, r2, r3 = fl_philox16(seed, col // 8, row)
    lane = col % 8
    w = tl.where(lane < 4, tl.where(lane < 2, r0, r1), tl.where(lane < 6, r2, r3))
    return tl.where(lane % 2 == 0, w & 0xFFFF, w >> 16).to(tl.int32)


@triton.jit
def fl_rand16_block(seed, row, start_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # rand16(seed, row, n) on a [BLOCK_M, BLOCK_N] score tile whose keys are
    # start_n + arange(BLOCK_N), start_n % 8 == 0: one Philox call per 8 keys, BLOCK_N // 8 per row
    group = (start_n // 8 + tl.arange(0, BLOCK_N // 8)).to(tl.int64)
    group, row = tl.broadcast(tl.broadcast_to(group[None, :], [BLOCK_M, BLOCK_N // 8]), row.to(tl.int64))
    r0, r1, r2, r3 = fl_philox16(seed, group, row)
    w = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))     # word k of group g at 4 g + k
    return tl.interleave(w & 0xFFFF, w >> 16).to(tl.int32)              # low half first: lane j at 8 g + j
'''


LOG1P_HELPER = '''

@triton.jit
def fl_log1p(x):
    # log(1 + x), accurate where 1 + x rounds (softplus of a score of -20: log(1 + 2e-9)):
    # log(u) * x / (u - 1) for u = 1 + x as rounded; x where u is 1, u where it is inf
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.where(u == float("inf"), u, tl.log(u) * (x / (u - 1.0))))
'''


def helpers_for(source: str) -> str:
    """The helpers a kernel's ``source`` calls, besides ``HELPERS``: only those, so a kernel's
    source (and Triton's cache key) changes only with what it uses."""
    return (RAND16_HELPERS if "fl_rand16" in source else "") + (LOG1P_HELPER if "fl_log1p(" in source else "")


def prelude(source: str) -> str:
    """The header of a kernel module: imports and the helpers ``source`` calls."""
    helpers = HELPERS + helpers_for(source)
    return f"import triton\nimport triton.language as tl\n{helpers}\n\n"


def reciprocal_ok(x: Expr) -> bool:
    """May ``div(a, c)`` for a constant c run as ``a * (1 / c)``? Exactly so for a power of two;
    within an ulp otherwise, which is fine for scores (they are rounded anyway) but not for index
    arithmetic spelled in floats: floor(41 * fl32(1/41)) = 0."""
    c = x.args[1].args[0] if x.args[1].op == "const" else None
    if not isinstance(c, (int, float)) or isinstance(c, bool) or c == 0 or not math.isfinite(c):
        return False
    if abs(1.0 / c) > 3.4028234663852886e38:
        return False
    return math.frexp(abs(c))[0] == 0.5 or bool(refs(x.args[0], "dot"))


def const_str(e: Expr) -> str:
    v = e.args[0]
    if isinstance(v, float) and math.isinf(v):
        return 'float("-inf")' if v < 0 else 'float("inf")'
    if isinstance(v, float) and math.isnan(v):
        return 'float("nan")'
    return repr(v)


# an index var that reads as the first key of the score tile's block (``Ctx.key_start``)
KEY_START = "n0"


def _position(e: Expr) -> tuple[str, int] | None:
    """(``m`` or ``n``, c) where ``e`` is that index plus an integer constant c (queries placed
    at the end of the keys: ``m + N - M``; absolute positions: ``n + P``), else None."""
    if e.op == "var":
        return (e.args[0], 0) if e.args[0] in ("m", "n") else None
    if e.op in ("add", "sub") and e.kind == "i":
        x, c = e.args if e.args[1].op == "const" else e.args[::-1] if e.op == "add" else (None, None)
        inner = _position(x) if x is not None and c.op == "const" else None
        if inner is not None:
            return inner[0], inner[1] + (c.args[0] if e.op == "add" else -c.args[0])
    return None


def _difference(e: Expr) -> tuple[Expr, Expr] | None:
    """(a, b) where ``e`` is a query and a key position subtracted in floats, ``to_f(a) -
    to_f(b)`` or ``to_f(a - b)``, each position one index plus a constant (``_position``);
    else None."""
    if e.op == "sub" and all(x.op == "to_f" for x in e.args):
        a, b = (x.args[0] for x in e.args)
    elif e.op == "to_f" and e.args[0].op == "sub":
        a, b = e.args[0].args
    else:
        return None
    pa, pb = _position(a), _position(b)
    return (a, b) if pa is not None and pb is not None and {pa[0], pb[0]} == {"m", "n"} else None


def _relative(e: Expr) -> Expr | None:
    """``(a - b) * c`` (ALiBi's ``slope * (n - m)``) as ``(a - r) * c - (b - r) * c``, where ``c``
    does not vary over the tile and r is the key block's first position: n0 (``KEY_START``)
    plus the key position's constant, so that the key's term is ``(n - n0) * c`` and a shared
    offset (absolute positions ``n + P``, ``m + P``) cancels in integers; else None."""
    if e.op != "mul" or e.kind != "f":
        return None
    for d, c in (e.args, e.args[::-1]):
        ab = _difference(d)
        if ab is not None and all(v.startswith("b") for v in free_vars(c)) \
                and not (refs(c, "dot") or refs(c, "red") or refs(c, "tile")):
            key = next(p for p in map(_position, ab) if p[0] == "n")
            ref = var(KEY_START) if key[1] == 0 else call("add", var(KEY_START), const(key[1]))
            a, b = (call("mul", call("to_f", call("sub", x, ref)), c) for x in ab)
            return call("sub", a, b)
    return None


def _terms(e: Expr, sign: int = 1) -> list[tuple[int, Expr]]:
    """``e``'s additive chain as signed terms: ``a + b - c`` is [(1, a), (1, b), (-1, c)]."""
    if e.op == "add" and e.kind == "f":
        return _terms(e.args[0], sign) + _terms(e.args[1], sign)
    if e.op == "sub" and e.kind == "f":
        return _terms(e.args[0], sign) + _terms(e.args[1], -sign)
    return [(sign, e)]


def _total(terms: list[tuple[int, Expr]], base: Expr | None = None) -> Expr:
    """``base`` plus the signed ``terms`` (their sum where ``base`` is None)."""
    out = base
    for sign, t in terms:
        out = (t if sign > 0 else call("neg", t)) if out is None else call("add" if sign > 0 else "sub", out, t)
    return out


def _per_row(e: Expr) -> bool:
    """Is ``e`` one value per score row: free of the key index and of the scores (it may read
    the query index, n0, batch indices, loads along those and the row reductions)?"""
    return "n" not in free_vars(e) and not (refs(e, "dot") or refs(e, "tile"))


def _query_term(e: Expr) -> bool:
    """Is ``e`` the query's term of a split relative position (``_relative``): per row, and
    bounded by the distance to the key block times the factor? A per-row term of any size (a
    bias that is -1e30 on padded rows) stays with the scores: moved, it would no longer absorb
    them as eager's sum does, and the row would not come out uniform as eager's does."""
    return KEY_START in free_vars(e) and _per_row(e)


def row_terms(e: Expr) -> tuple[Expr, list[tuple[int, Expr]]] | None:
    """(t, rows) with ``e`` == t + rows' sum, ``rows`` the query terms of split relative
    positions in e's additive chain (``_query_term``), looking through a mask that fills with
    -inf (t keeps the mask); None where e has no such term or nothing else. A row max of e
    is the row max of t plus the rows' sum, and ``e - x`` for a per-row x is ``t - (x - rows)``:
    one subtraction per score for the row's terms and its shift together."""
    if e.op == "where":
        cond, a, b = e.args
        for i, fill in ((1, b), (2, a)):
            if fill.op == "const" and fill.args[0] == float("-inf") and e.args[i].kind == "f":
                split = row_terms(e.args[i])
                if split is not None:
                    return call("where", *(split[0] if k == i else x for k, x in enumerate(e.args))), split[1]
        return None
    terms = _terms(e)
    rows = [(sign, t) for sign, t in terms if _query_term(t)]
    rest = [(sign, t) for sign, t in terms if not _query_term(t)]
    return (_total(rest), rows) if rows and rest else None


def _shift(e: Expr) -> Expr | None:
    """``e`` - x for a per-row x (a softmax's shift) as ``t - (x - rows)`` (``row_terms``)."""
    if e.op != "sub" or e.kind != "f" or not _per_row(e.args[1]) or _per_row(e.args[0]):
        return None
    split = row_terms(e.args[0])
    if split is None:
        return None
    t, rows = split
    return call("sub", t, _total([(-sign, r) for sign, r in rows], base=e.args[1]))


def _smooth(e: Expr, fn) -> Expr:
    """``e`` with ``fn``'s replacements (top-down, each node's result kept) in its float
    arithmetic, but not below an op that jumps (``ir.expr.JUMPS``: ``floor(slope * (n - m))``,
    a comparison of a distance) nor in loads' indices: there eager's rounding must be kept bit
    for bit."""
    memo: dict[Expr, Expr] = {}

    def go(x: Expr) -> Expr:
        if x in memo:
            return memo[x]
        if x.kind != "f" or x.op in JUMPS or x.op in ("load", "var", "const", "dot", "red", "tile", "rand16"):
            out = x
        else:
            out = fn(x)
            if out is None:
                args = tuple(go(a) if isinstance(a, Expr) and a.kind == "f" else a for a in x.args)
                out = x if args == x.args else Expr(x.op, args, x.kind)
        memo[x] = out
        return out
    return go(e)


def jump_reads(exprs) -> frozenset[int]:
    """The reductions that ``exprs`` read below an op that jumps (``ir.expr.JUMPS``, or any
    other op with an integer or bool result): ``s >= s.amax(-1)`` compares the row max itself."""
    found: set[int] = set()
    for e in exprs:
        for x in walk(e):
            if x.op in JUMPS or (x.kind != "f" and x.op not in ("var", "const", "load", "rand16")):
                found |= refs(x, "red")
    return frozenset(found)


def max_terms(e: Expr) -> tuple[Expr, Expr | None]:
    """A row max's body as (t, r): the row max of ``e`` is the row max of ``t`` plus ``r``
    (``row_terms``; r None where e has no such term). The shifted scores then read ``t``, as
    ``score_terms`` writes them. Only for a max used as a shift, which may round differently
    from eager's; one that the region compares (``jump_reads``) is emitted as written, under
    ``plain``."""
    split = row_terms(relative_positions(e))
    return (e, None) if split is None else (split[0], _total(split[1]))


def plain(ctx: "Ctx") -> "Ctx":
    """``ctx`` with its expressions emitted as written (no ``score_terms``): a pass whose max
    the region compares with its scores (``s >= s.amax(-1)``) computes both the same way."""
    return dataclasses.replace(ctx, terms=False)


def score_terms(e: Expr) -> Expr:
    """A score-tile expression with its relative-position terms split per axis
    (``relative_positions``) and the per-row terms of each shifted score joined to the shift
    (``_shift``)."""
    return _smooth(relative_positions(e), _shift)


def relative_positions(e: Expr) -> Expr:
    """``e`` with each linear relative-position term of the score tile split per axis
    (``_relative``). ``slope * (n - m)`` costs three ops per score (the subtraction, the
    multiply and the add into the score); split, each term is a vector along one axis of the
    tile (``(n - n0) * c`` along the keys, ``(m - n0) * c`` along the queries): the key's term
    fuses into the score's multiply-add and the query's joins the row's shift (``_shift``).
    The cost this removes: session 18's flex suite (H200) ran ALiBi's D=128 forward 25 %
    slower than causal's at the same blocks (0.68 against 0.55 ms at B=4 N=4096). Rounding:
    each term is rounded at the size of ``(index - n0) * c``, which near the diagonal (where
    the weights are) is the size of eager's ``(n - m) * c``, rounded once."""
    return _smooth(e, _relative)


@dataclass
class Ctx:
    """An index space: how each index var reads as a Triton tile, and its bounds mask."""
    name: str
    vars: dict[str, str]            # var -> Triton expression (broadcast shape)
    masks: dict[str, str]           # var -> bounds mask of the same shape
    # the score tile [BLOCK_M, BLOCK_N] only: the first key of the block (n = key_start +
    # arange(BLOCK_N) along axis 1, a multiple of BLOCK_N), for dropout's grouped draws and
    # the relative-position terms (``score_terms``)
    key_start: str | None = None
    # var -> (first index of the tile, its width): where a tensor descriptor reads the tile
    blocks: dict[str, tuple[str, str]] = field(default_factory=dict)
    # score tiles: rewrite expressions by ``score_terms`` (the Gluon tile kernels do not: there
    # it added register spills, see GCTX_ST)
    terms: bool = True

    def mask(self, *dims: str) -> str:
        """The bounds mask of ``dims`` in this context ('' when none has one)."""
        return " & ".join(self.masks[v] for v in dims if v in self.masks)


# the extent of each tile var: a tensor descriptor's bounds (reads past them are zeros)
EXTENT = {"m": "M", "n": "N", "dk": "DK", "dv": "DV"}


@dataclass
class Block:
    """A list of lines with a CSE table; ``parent`` receives hoisted loop invariants."""
    lines: list[str] = field(default_factory=list)
    names: dict = field(default_factory=dict)
    parent: "Block | None" = None


class Emitter:
    def __init__(self):
        self.red_names: dict[int, str] = {}  # red j -> Triton name valid at this point
        self.dot_names: dict[int, str] = {}  # dot i -> name of this pass's score tile
        self.loop_reds: set[int] = set()     # reductions being accumulated by the current loop
        self.scan_names: dict[int, str] = {}  # scan j -> its partial sums on this key block's tile
        self.counter = 0
        # input -> its dims a tensor descriptor strides over (``descriptor_load``): the launch
        # turns the kernel's TMA constexpr on only when those tensors' layouts allow it
        self.tma: dict[int, set[int]] = {}

    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def variant(self, e: Expr) -> bool:
        """Must this expression be computed inside the N loop?"""
        fv = free_vars(e)
        return "n" in fv or KEY_START in fv or bool(refs(e, "dot")) or bool(refs(e, "red") & self.loop_reds)

    def home(self, e: Expr, block: Block) -> Block:
        """Loop invariants are hoisted into the enclosing block."""
        return block.parent if block.parent is not None and not self.variant(e) else block

    def emit(self, e: Expr, ctx: Ctx, block: Block) -> str:
        if ctx.key_start is not None and ctx.terms:
            e = score_terms(e)
        for x in walk(e):
            self._emit_one(x, ctx, block)
        return self._lookup(e, ctx, block)

    def emit_reloaded(self, e: Expr, ctx: Ctx, block: Block) -> str:
        """``emit``, loading again the loads ``e`` reads inside the loop rather than reusing the
        tiles loaded for the score: a value used in the recomputed score and long after it (a
        query's coordinate in IPA's dK/dV kernel: [1, BLOCK_M] in the MMA layout, 16 registers
        a thread each) is then dead in between, and the second load reads lines the first one
        just brought in (offline, IPA's dK/dV spills 6.6 -> 4.4 KB; the reload alone not timed)."""
        def again(key) -> bool:       # a load inside the loop, or its conversion
            x = key[-1]
            x = x.args[0] if isinstance(x, Expr) and x.op in ("to_f", "to_i") else x
            return isinstance(x, Expr) and x.op == "load" and self.variant(x)
        hidden = []
        b = block
        while b is not None:
            keys = [k for k in b.names if again(k)]
            hidden.append((b, {k: b.names.pop(k) for k in keys}))
            b = b.parent
        try:
            return self.emit(e, ctx, block)
        finally:
            for b, names in hidden:
                b.names.update(names)

    def _key(self, x: Expr, ctx: Ctx):
        inner = {v for v in free_vars(x) if not v.startswith("b")}
        return (ctx.name if inner or refs(x, "dot") or refs(x, "red") else None, x)

    def _lookup(self, x: Expr, ctx: Ctx, block: Block) -> str:
        key = self._key(x, ctx)
        b = block
        while b is not None:
            if key in b.names:
                return b.names[key]
            b = b.parent
        raise KeyError(x)

    def _emit_one(self, x: Expr, ctx: Ctx, block: Block):
        key = self._key(x, ctx)
        b = block
        while b is not None:
            if key in b.names:
                return
            b = b.parent
        target = self.home(x, block)
        code = self._code(x, ctx, target)
        if x.op in ("var", "const", "red", "dot", "tile", "scan") or (x.op == "load" and x.kind != "f"):
            target.names[key] = code
            return
        name = self.fresh("t")
        target.lines.append(f"{name} = {code}")
        target.names[key] = name

    def _arg(self, a: Expr, ctx: Ctx, block: Block, as_float: bool) -> str:
        s = self._lookup(a, ctx, block)
        if a.op == "const":
            return f"({s})" if not as_float or a.kind == "f" else f"{float(a.args[0])!r}"
        return _cast_f(s) if as_float and a.kind != "f" else s

    def _code(self, x: Expr, ctx: Ctx, block: Block) -> str:
        if x.op == "var":
            name = x.args[0]
            if name in ctx.vars:
                return ctx.vars[name]
            if name == KEY_START and ctx.key_start is not None:
                return ctx.key_start
            if name.startswith("b"):
                return name
            raise CodegenError(f"index var {name} has no meaning in the {ctx.name} context")
        if x.op == "const":
            return const_str(x)
        if x.op == "red":
            return self.red_names[x.args[0]]
        if x.op == "dot":
            return self.dot_names[x.args[0]]
        if x.op == "scan":
            if x.args[0] not in self.scan_names:
                raise CodegenError("this kernel does not compute partial sums over the keys (scans)")
            return self.scan_names[x.args[0]]
        if x.op == "tile":
            return x.args[0]
        if x.op == "load":
            raw = self.load(x, ctx, block)
            return _cast_f(raw) if x.kind == "f" else raw
        if x.op == "rand16":
            return self.rand16(x, ctx, block)
        if x.op not in TRITON:
            raise CodegenError(f"no Triton lowering for op {x.op}")
        as_float = x.op in FLOAT_OPERANDS
        args = [self._arg(a, ctx, block, as_float) for a in x.args]
        if x.op == "div" and reciprocal_ok(x):
            # a multiply by the reciprocal: an fp32 division is a multi-instruction sequence per
            # element, and scores / sqrt(d) divides every score
            return f"({args[0]} * {1.0 / x.args[1].args[0]!r})"
        return "(" + TRITON[x.op].format(*args) + ")"

    def rand16(self, x: Expr, ctx: Ctx, block: Block) -> str:
        """Dropout's draw. On the score tile, where the column is the key itself and the row does
        not depend on it, one Philox call serves 8 keys (``fl_rand16_block``); anywhere else
        each element runs its own (``fl_rand16``): the same numbers, 8x the work."""
        seed, row, col = (f"tl.full([1, 1], {a.args[0]}, tl.int64)" if a.op == "const"
                          else self._lookup(a, ctx, block) for a in x.args)
        if ctx.key_start is not None and x.args[2] == var("n") and "n" not in free_vars(x.args[1]):
            if ctx.name == "st":      # the transposed score tile: draw [M, N], then transpose
                return f"tl.trans(fl_rand16_block({seed}, tl.trans({row}), {ctx.key_start}, BLOCK_M, BLOCK_N))"
            return f"fl_rand16_block({seed}, {row}, {ctx.key_start}, BLOCK_M, BLOCK_N)"
        return TRITON["rand16"].format(seed, row, col)

    def load(self, x: Expr, ctx: Ctx, block: Block, bulk: bool = False) -> str:
        """The raw (un-cast) load of ``x``, emitted once per context. ``bulk``: a tl.dot operand,
        which inside a loop also gets a tensor-descriptor form (``descriptor_load``)."""
        key = ("raw", ctx.name, x)
        b = block
        while b is not None:
            if key in b.names:
                return b.names[key]
            b = b.parent
        block = self.home(x, block)
        ptr, mask = self.address(x, ctx, block, "in")
        mask = f", mask={mask}, other=0" if mask else ""
        name = self.fresh("ld")
        desc = self.descriptor_load(x, ctx, block) if bulk and block.parent is not None else None
        if desc:
            block.lines += ["if TMA:", f"    {name} = {desc}", "else:", f"    {name} = tl.load({ptr}{mask})"]
        else:
            block.lines.append(f"{name} = tl.load({ptr}{mask})")
        block.names[key] = name
        return name

    def descriptor_load(self, x: Expr, ctx: Ctx, block: Block) -> str | None:
        """A tile load through a tensor descriptor (Hopper's bulk tensor copy: straight into
        shared memory, no pointer tile, out-of-bounds reads zero like the masked load), when the
        tile's two axes index two dims of the input as bare vars, the second of them its last
        dim, and every other index is the same for the whole program (batch indices): the
        descriptor is made once per program over those two dims, at the batch indices' offset.
        None where that does not hold. The launch sets TMA only when the input's last stride
        is 1 and its other strides and address are 16-byte aligned (``runtime.descriptors``)."""
        i, idx = x.args
        rows = next((v for v, e in ctx.vars.items() if e.endswith("[:, None]")), None)
        cols = next((v for v, e in ctx.vars.items() if e.endswith("[None, :]")), None)
        dims = {ie.args[0]: d for d, ie in enumerate(idx) if ie.op == "var" and ie.args[0] in (rows, cols)}
        last = len(idx) - 1
        if len(dims) != 2 or last not in dims.values() or not all(v in ctx.blocks for v in dims):
            return None
        inner = next(v for v, d in dims.items() if d == last)
        outer = cols if inner == rows else rows
        if any(free_vars(ie) - {v for v in free_vars(ie) if v.startswith("b")} or self.variant(ie)
               for d, ie in enumerate(idx) if d not in dims.values()):
            return None     # (a batch index that changes along the loop: the dK/dV kernel's group loop)
        if any(not ctx.blocks[v][0].isdigit() and not self.variant(var(v)) for v in dims):
            return None     # a moving coordinate must be the loop's own (start_n / start_m)
        root = block
        while root.parent is not None:
            root = root.parent
        (o_start, o_width), (i_start, i_width) = ctx.blocks[outer], ctx.blocks[inner]
        key = ("desc", i, outer, inner, dims[outer], o_width, i_width,
               tuple(ie for d, ie in enumerate(idx) if d not in dims.values()))
        desc = root.names.get(key)
        if desc is None:
            terms = []
            for d, ie in enumerate(idx):
                if d in dims.values() or (ie.op == "const" and ie.args[0] == 0):
                    continue
                terms.append(f"{self.emit(ie, ctx, root)} * in{i}_s{d}")
            desc = root.names[key] = self.fresh("desc")
            root.lines += ["if TMA:",
                           f"    {desc} = tl.make_tensor_descriptor({' + '.join([f'in{i}_ptr'] + terms)}, "
                           f"[{EXTENT[outer]}, {EXTENT[inner]}], [in{i}_s{dims[outer]}, 1], [{o_width}, {i_width}])"]
            self.tma.setdefault(i, set()).add(dims[outer])
        return f"{desc}.load([{o_start}, {i_start}])" + (".T" if outer == cols else "")

    def address(self, x: Expr, ctx: Ctx, block: Block, base: str) -> tuple[str, str]:
        """Pointer tile and bounds mask ('' when none) of load ``x`` in the tensor ``{base}{i}``
        (``in``: the input; the backward's ``g``: its fp32 gradient buffer)."""
        i, idx = x.args
        for ie in idx:
            self.emit(ie, ctx, block)
        terms = []
        for d, ie in enumerate(idx):
            if ie.op == "const" and ie.args[0] == 0:
                continue
            terms.append(f"{self._lookup(ie, ctx, block)} * {base}{i}_s{d}")
        used = set().union(*(free_vars(ie) for ie in idx)) if idx else set()
        masks = [ctx.masks[v] for v in sorted(used) if v in ctx.masks]
        return " + ".join([f"{base}{i}_ptr"] + terms), " & ".join(masks)
