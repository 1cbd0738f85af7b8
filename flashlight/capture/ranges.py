"""Integer ranges of a region's index arithmetic, read off the FX graph with eager's dtypes: the
kernel must compute what eager does (``check_integer_ranges``, called by ``regions.build``).

The kernel computes index arithmetic in int32 (``tl.arange``, program ids) and integer loads
without eager's wrap-around; eager computes each op in its result's dtype. They agree while no
value leaves either range; the block-sparsity analysis (``sparsity.IntervalWriter``) assumes the
same. So a region is refused where a static range shows:

- an integer op whose values leave its own dtype: eager wraps it (a uint8 ``pad - 1`` is 255
  where pad is 0; int32 or uint8 positions times a large factor), the kernel does not;
- an op computed from positions and constants alone (no loads) whose values leave int32: eager's
  int64 positions never wrap (a hash of positions), the kernel's int32 ones do.

Ranges: ``arange`` from its arguments, constants as themselves, loads of 8- and 16-bit integers
and booleans over their dtype, loads of int32 and int64 tensors (document ids, positions)
unknown: values the program chose, taken as moderate, as eager's own arithmetic on them assumes.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .epilogue import packet
from .symbolic import Unsupported, meta

aten = torch.ops.aten
INT32 = (-(2 ** 31), 2 ** 31 - 1)
NARROW = (torch.uint8, torch.int8, torch.int16)
Range = tuple[int, int] | None      # None: unknown


def _span(values) -> Range:
    values = list(values)
    return min(values), max(values)


def _mul(a, b):
    return _span(x * y for x in a for y in b)


def _floordiv(a, b):
    return (a[0] // b[0], a[1] // b[0]) if b[0] == b[1] and b[0] > 0 else None


def _remainder(a, b):
    return (0, b[0] - 1) if b[0] == b[1] and b[0] > 0 else None


def _abs(a):
    return (0 if a[0] <= 0 <= a[1] else min(abs(a[0]), abs(a[1]))), max(abs(a[0]), abs(a[1]))


# op -> its range from its operands' ranges (each known)
ARITHMETIC = {
    aten.add: lambda a, b: (a[0] + b[0], a[1] + b[1]),
    aten.sub: lambda a, b: (a[0] - b[1], a[1] - b[0]),
    aten.rsub: lambda a, b: (b[0] - a[1], b[1] - a[0]),
    aten.mul: _mul,
    aten.neg: lambda a: (-a[1], -a[0]),
    aten.abs: _abs,
    aten.floor_divide: _floordiv,
    aten.remainder: _remainder,
    aten.minimum: lambda a, b: (min(a[0], b[0]), min(a[1], b[1])),
    aten.maximum: lambda a, b: (max(a[0], b[0]), max(a[1], b[1])),
}
UNARY = {aten.neg, aten.abs}
SAME = {aten.view, aten.reshape, aten._unsafe_view, aten.permute, aten.transpose, aten.t, aten.unsqueeze,
        aten.squeeze, aten.expand, aten.expand_as, aten.slice, aten.select, aten.alias, aten.detach,
        aten.contiguous, aten.clone, aten.to, aten._to_copy, aten.type_as, aten.lift_fresh_copy}


def _arange(node: fx.Node) -> Range:
    ints = [a for a in node.args if isinstance(a, int) and not isinstance(a, bool)]
    start, end, step = (0, ints[0], 1) if len(ints) == 1 else (*ints[:2], ints[2] if len(ints) > 2 else 1)
    if step == 0 or not ints:
        return None
    last = start + (max(0, -(-(end - start) // step)) - 1) * step
    return _span((start, last)) if (end - start) * step > 0 else (0, 0)


class Ranges:
    """Ranges and purity (computed from positions and constants alone) of a region's nodes."""

    def __init__(self, leaves: set[fx.Node]):
        self.leaves, self.range, self.pure = leaves, {}, {}

    def of(self, x) -> tuple[Range, bool]:
        if isinstance(x, bool):
            return (int(x), int(x)), True
        if isinstance(x, int):
            return (x, x), True
        if not isinstance(x, fx.Node):
            return None, True
        if x not in self.range:
            self.range[x], self.pure[x] = self._of(x)
        return self.range[x], self.pure[x]

    def _of(self, node: fx.Node) -> tuple[Range, bool]:
        t = meta(node)
        dtype = getattr(t, "dtype", None)
        if dtype is None or dtype.is_floating_point or dtype.is_complex:
            return None, False
        if node in self.leaves or node.op != "call_function":
            return ((0, 1) if dtype == torch.bool else
                    (int(torch.iinfo(dtype).min), int(torch.iinfo(dtype).max)) if dtype in NARROW else None), False
        if dtype == torch.bool:
            return (0, 1), all(self.of(a)[1] for a in node.all_input_nodes)
        op = packet(node)
        operands = [a for a in node.args if isinstance(a, (fx.Node, int)) and not isinstance(a, bool)]
        if op == aten.arange:
            return _arange(node), True
        if op in SAME or node.target is operator.getitem:
            return self.of(node.args[0])
        if op == aten.where:
            (ra, pa), (rb, pb) = self.of(node.args[1]), self.of(node.args[2])
            return (None if ra is None or rb is None else _span((*ra, *rb))), pa and pb and self.of(node.args[0])[1]
        if op in ARITHMETIC:
            arity = 1 if op in UNARY else 2
            parts = [self.of(a) for a in operands[:arity]]
            pure = all(p for _, p in parts)
            if len(parts) != arity or any(r is None for r, _ in parts):     # (a float or bool operand)
                return None, pure
            return ARITHMETIC[op](*(r for r, _ in parts)), pure
        return None, False


def check_integer_ranges(inner: set[fx.Node], leaves: list[fx.Node], contraction: fx.Node) -> None:
    """Raise ``Unsupported`` where the region's integer arithmetic is not eager's (module doc)."""
    ranges = Ranges(set(leaves))
    for node in [n for n in contraction.graph.nodes if n in inner]:
        r, pure = ranges.of(node)
        dtype = getattr(meta(node), "dtype", None)
        if r is None or dtype is None or dtype == torch.bool or dtype.is_floating_point:
            continue
        info = torch.iinfo(dtype)
        name = str(dtype).replace("torch.", "")
        if r[0] < info.min or r[1] > info.max:
            raise Unsupported(f"{node.name} ({name}) reaches {r[1] if r[1] > info.max else r[0]}, beyond its dtype's "
                              "range: eager wraps around there and the kernel does not", node)
        if pure and (r[0] < INT32[0] or r[1] > INT32[1]):
            raise Unsupported(f"{node.name} reaches {r[1] if r[1] > INT32[1] else r[0]}, beyond the int32 range the "
                              f"kernel computes index arithmetic in (eager: {name}, which does not wrap there)", node)
