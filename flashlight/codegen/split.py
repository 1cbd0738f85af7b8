"""Split-KV forward for decoding (few queries, many keys): two generated kernels.

``split``: one program per (M block, batch index, split). Each split runs the forward kernel's
loop over its own range of key blocks and stores the *raw* reduction states — running maxima,
sums and P @ V accumulators, the sums taken under the split's own max — to an fp32 scratch
``ws[split, batch, m, column]``. ``combine``: one program per (M block, batch index) merges the
splits and runs the epilogue (row statistics for the backward, output and row outputs) exactly
as the one-kernel forward does::

    m   = max_s m_s                                    (every max reduction)
    r   = sum_s r_s * exp(m_s - m)                     (sums and P @ V rescaled by their max)
    r   = sum_s r_s                                    (sums without a max)

which is the flash-attention recurrence applied once more, across splits instead of key blocks.
A max whose argmax the backward reads (``shift_gradients``) keeps the argmax of the first split
holding the merged max (splits in key order, keys within a split first to last: the first key
of the maximum, as the one-kernel forward keeps).

Several passes over N (a softmax's sum read by a later pass: thresholded and renormalised
probabilities, softpick): a split and a combine kernel per pass, launched in turn. Pass p's split
kernel reads the earlier passes' final values, which their combine kernels stored in the
workspace's last row block ``ws[SPLITS, batch, m, column]``, and walks its keys for pass p's
reductions alone; the last pass's combine loads them too and runs the epilogue (a P @ V product
of an earlier pass, stored DV wide, is read there only).

A k-th largest (top-k attention's threshold): each split stores its ``kth_width`` candidates
(the largest values of its keys) and the combine merges the splits' by ``tl.topk``; the largest
values of the whole row are among the union of each split's largest.

Partial sums over the keys (scans): each split computes them from 0 over its own keys; the keys
of the other splits (after it, for a suffix scan) add the row constant C_s = sum of their
totals. Where every sum reading the partial sums scales as exp(d S) (``ir.scaling.scan_degree``:
stick-breaking's exp(log z + S) @ v, d = 1), the combine multiplies split s's state by
exp(d C_s), C_s carried across the splits in the scan's order; d C_s <= 0 (the scan's body has a
known sign: log(1 - beta) <= 0), so the factor cannot overflow::

    r   = sum_s r_s * exp(d C_s)                       (sums reading a scan)
"""
from __future__ import annotations

from dataclasses import replace

from ..ir import Region, Row, const, free_vars, refs, substitute, var, verify, walk
from ..ir.scaling import scan_degree, shift_gradients
from ..sparsity import nonneg, nonpos
from .emit import prelude
from .kernel import NEG_INF, KernelWriter, kth_value, kth_width

SPLIT_ARGS = ["ws_ptr", "SPLITS", "BLOCKS_PER_SPLIT"]


def splittable(region: Region) -> bool:
    """The output in the tile's own layout (a permuted store's index is not rewritten by
    ``pack_heads`` and the runtime views the output as (*batch, M, DV)); partial sums over the
    keys only in one pass, and where each split's sums reading them are merged by a factor
    (``scan_factors``)."""
    scans = any(rd.scan for rd in region.reductions)
    return region.out_index is None and scan_factors(region) is not None and \
        not (scans and len(region.passes()) > 1)


def scan_factors(region: Region) -> dict[int, tuple[int, float]] | None:
    """For each reduction reading a scan's partial sums, (the scan, d): the split's state times
    exp(d C_s) is its part of the whole (module doc). None where some reader is a max or has an
    extra element (a sink, added in one split), reads two scans or no degree, or where d C_s
    could be positive (the scan's body has no known sign)."""
    found = {}
    for j, rd in enumerate(region.reductions):
        scans = refs(rd.body, "scan")
        if not scans:
            continue
        if rd.kind == "max" or rd.extra is not None or len(scans) > 1:
            return None
        p = next(iter(scans))
        d, x = scan_degree(rd.body, p), region.reductions[p].body
        if d is None or not ((d >= 0 and nonpos(x)) or (d <= 0 and nonneg(x))):
            return None
        found[j] = (p, d)
    return found


def pack_heads(region: Region, max_m: int) -> tuple[Region, int] | None:
    """Grouped-query decoding: the G query heads sharing a K/V head become G * M rows of one
    program, so K/V tiles are loaded once per group instead of once per query head.

    The last batch var h must reach K and V only as ``h // G`` (or not at all: G = H); then with h' the K/V head and
    m' the packed row, h = h' * G + m' // M and m = m' % M everywhere else (the output
    (.., H, M, DV) viewed as (.., H / G, G * M, DV) is the packed output). Returns the packed
    region and G, or None."""
    if not region.batch:
        return None
    hv = var(region.batch_vars[-1])
    kv = [d.k for d in region.dots] + [r.v for r in region.reductions if r.v is not None]
    groups = {x.args[1].args[0] for e in kv for x in walk(e)
              if x.op == "idiv" and x.args[0] == hv and x.args[1].op == "const"}
    if not groups and not any(hv.args[0] in free_vars(e) for e in kv):
        groups = {region.batch[-1]}        # one K/V head for all query heads (MQA)
    if len(groups) != 1:
        return None
    G = groups.pop()
    if G < 2 or region.batch[-1] % G or G * region.M > max_m:
        return None
    marker = var("kv_head")
    to_kv = lambda e: substitute(e, lambda x: marker if x.op == "idiv" and x.args == (hv, const(G)) else None)  # noqa: E731
    if any(hv.args[0] in free_vars(to_kv(e)) for e in kv):
        return None                      # K or V also read at the query head itself
    kv_of = lambda e: substitute(to_kv(e), lambda x: hv if x == marker else None)  # noqa: E731
    M = region.M
    new_h, new_m = hv * G + var("m") // M, var("m") % M
    rows = lambda e: substitute(e, lambda x: new_h if x == hv else new_m if x == var("m") else None)  # noqa: E731
    packed = replace(
        region, batch=region.batch[:-1] + (region.batch[-1] // G,), M=G * M,
        dots=[replace(d, q=rows(d.q), k=kv_of(d.k)) for d in region.dots],
        reductions=[replace(r, body=rows(r.body), v=kv_of(r.v) if r.v is not None else None,
                            extra=rows(r.extra) if r.extra is not None else None)     # a sink, per query head
                    for r in region.reductions],
        out=rows(region.out), rows=[Row(rows(x.expr), x.dtype) for x in region.rows])
    return verify(packed), G


def scalar_columns(red) -> int:
    """A reduction's state columns besides DV-wide ones: 1 for a max or sum, the candidates of a
    k-th largest (a split's; the final value takes the first), none for P @ V (DV)."""
    return 0 if red.kind == "dot" else kth_width(red) if red.kind == "kth" else 1


def columns(region: Region) -> tuple[list[str], dict[int, str], str]:
    """Scratch column of each reduction's state, of each saved argmax (``argmax_columns``'
    maxima), and the row width, as Triton expressions over the DV constexpr."""
    cols, scalars, dots = [], 0, 0
    for red in region.reductions:
        cols.append(f"{scalars} + {dots} * DV")
        scalars, dots = scalars + scalar_columns(red), dots + (red.kind == "dot")
    at = {j: f"{scalars + i} + {dots} * DV" for i, j in enumerate(shift_gradients(region))}
    return cols, at, f"{scalars + len(at)} + {dots} * DV"


def width(region: Region) -> int:
    """The workspace row's width in elements (``columns``' at this DV)."""
    return sum(scalar_columns(red) + (red.kind == "dot") * region.DV for red in region.reductions) + \
        len(shift_gradients(region))


def _ws_row(split: str) -> str:
    """Offset of row (split, batch, offs_m) in the scratch; NUM_B = number of batch programs."""
    return f"(({split} * NUM_B + pid_b) * M + offs_m[:, None]) * WS_C"


FINAL = _ws_row("SPLITS")      # the earlier passes' final values: the workspace's last row block


class SplitWriter(KernelWriter):
    """Pass ``p`` of the forward kernel restricted to one split of the key blocks, storing raw
    states. Its loads stay pointer loads: the combine kernel takes the same argument list and
    has none to make (a TMA constexpr would be the split's alone)."""
    split_dv = False
    bulk_loads = False

    def __init__(self, region: Region, name: str, p: int, allow_tf32: bool = False, interpret: bool = False):
        super().__init__(region, name, allow_tf32, interpret)
        passes = region.passes()
        self.members, self.earlier = passes[p], [j for members in passes[:p] for j in members]
        self.last = p == len(passes) - 1

    def signature(self) -> list[str]:
        args = super().signature()
        at = args.index("DK: tl.constexpr")
        return args[:at] + SPLIT_ARGS + args[at:]

    def bounds(self, blk: str) -> str:
        return f"tl.minimum(tl.maximum({blk}, split_lo), split_hi)"

    def once(self, val: str) -> str:
        """A sink element joins a sum in split 0 only (every split's max includes it: max is
        idempotent, and the combine rescales split 0's sum like any other)."""
        return f"tl.where(pid_s == 0, {val}, 0.0)"

    def prologue(self) -> None:
        KernelWriter.prologue(self)
        self.outer.lines += ["NUM_B = tl.num_programs(1)", f"WS_C = {columns(self.r)[2]}"]

    def load_earlier(self, epilogue: bool = False) -> None:
        """The earlier passes' final values (a max as the shift its bodies used), under the
        names the bodies read; with ``epilogue`` also what only the epilogue reads: P @ V
        products and the saved argmaxes."""
        cols, at, _ = columns(self.r)
        for j in self.earlier:
            if self.r.reductions[j].kind == "dot":
                if epilogue:
                    self.outer.lines.append(f"r{j} = tl.load(ws_ptr + {FINAL} + {cols[j]} + offs_dv[None, :], "
                                            f"mask=mask_m[:, None] & mask_dv[None, :], other=0.0)")
                continue
            self.outer.lines.append(f"r{j} = tl.load(ws_ptr + {FINAL} + {cols[j]}, mask=mask_m[:, None], other=0.0)")
            self.em.red_names[j] = f"r{j}"
            if epilogue and j in at:
                self.outer.lines.append(f"r{j}_at = tl.load(ws_ptr + {FINAL} + {at[j]}, mask=mask_m[:, None], "
                                        f"other=-1.0).to(tl.int32)")

    def passes(self) -> None:
        self.load_earlier()
        self.outer.lines.append(f"# reductions {self.members} over this split's keys")
        self.write_pass(self.members)

    def split_range(self) -> None:
        self.outer.lines += [
            "pid_s = tl.program_id(2)",
            "split_lo = pid_s * BLOCKS_PER_SPLIT",
            "split_hi = tl.minimum(split_lo + BLOCKS_PER_SPLIT, tl.cdiv(N, BLOCK_N))",
        ]

    def epilogue(self) -> None:
        self.outer.lines.append("# raw states of this split; the combine kernel merges them")
        self.store_states(self.members, _ws_row("pid_s"), lambda j: f"r{j}", candidates=True)

    def store_states(self, js: list[int], row: str, name, candidates: bool = False) -> None:
        """Store reductions ``js`` (``name(j)``: the value's name) and their argmaxes at ``row``;
        with ``candidates``, a k-th largest's candidates instead of its value."""
        cols, at, _ = columns(self.r)
        for j in js:
            if candidates and self.r.reductions[j].kind == "kth":
                self.outer.lines.append(f"tl.store(ws_ptr + {row} + {cols[j]} + tl.arange(0, {kth_width(self.r.reductions[j])})"
                                        f"[None, :], r{j}_c, mask=mask_m[:, None])")
            elif self.r.reductions[j].kind == "dot":
                self.outer.lines.append(f"tl.store(ws_ptr + {row} + {cols[j]} + offs_dv[None, :], {name(j)}, "
                                        f"mask=mask_m[:, None] & mask_dv[None, :])")
            else:
                self.outer.lines.append(f"tl.store(ws_ptr + {row} + {cols[j]}, {name(j)}, mask=mask_m[:, None])")
            if j in at:
                self.outer.lines.append(f"tl.store(ws_ptr + {row} + {at[j]}, r{j}_at.to(tl.float32), mask=mask_m[:, None])")


class CombineWriter(SplitWriter):
    """Merges the splits' states of its pass; stores the final values for the later passes, or
    (the last pass) runs the region's epilogue."""

    def passes(self) -> None:
        r, lines = self.r, self.outer.lines
        cols, at, _ = columns(r)
        row = _ws_row("s")
        self.load_earlier(epilogue=self.last)
        maxes = [j for j in self.members if r.reductions[j].kind == "max"]
        kths = [j for j in self.members if r.reductions[j].kind == "kth"]
        others = [j for j in self.members if r.reductions[j].kind not in ("max", "kth")]
        lines += [f"r{j} = tl.full([BLOCK_M, 1], {NEG_INF}, tl.float32)" for j in maxes]
        lines += [f"r{j}_at = tl.full([BLOCK_M, 1], -1, tl.int32)" for j in maxes if j in at]
        lines += ["for s in range(0, SPLITS):"] if maxes else []
        for j in maxes:
            lines.append(f"    m{j} = tl.load(ws_ptr + {row} + {cols[j]}, mask=mask_m[:, None], other={NEG_INF})")
            if j in at:     # the first split holding the max: splits walk the keys in order
                lines.append(f"    r{j}_at = tl.where(m{j} > r{j}, tl.load(ws_ptr + {row} + {at[j]}, "
                             f"mask=mask_m[:, None], other=-1.0).to(tl.int32), r{j}_at)")
            lines.append(f"    r{j} = tl.maximum(r{j}, m{j})")
        lines += [f"r{j}_safe = tl.where(r{j} == {NEG_INF}, 0.0, r{j})" for j in maxes]
        for j in kths:      # the candidates of every split, merged by tl.topk
            kp = kth_width(r.reductions[j])
            lines += [f"r{j}_c = tl.full([BLOCK_M, {kp}], {NEG_INF}, tl.float32)", "for s in range(0, SPLITS):",
                      f"    c{j} = tl.load(ws_ptr + {row} + {cols[j]} + tl.arange(0, {kp})[None, :], mask=mask_m[:, None], "
                      f"other={NEG_INF})",
                      f"    r{j}_c = tl.topk(tl.reshape(tl.join(r{j}_c, c{j}), [BLOCK_M, {2 * kp}]), {kp}, dim=1)"]
            lines += kth_value(j, r.reductions[j])
        for j in self.members:     # what store_rowstats reads (as after a pass)
            self.em.red_names[j] = f"r{j}_safe" if r.reductions[j].kind == "max" else f"r{j}"
        for j in others:
            w = "BLOCK_DV" if r.reductions[j].kind == "dot" else "1"
            lines.append(f"r{j} = tl.zeros([BLOCK_M, {w}], tl.float32)")
        factors = scan_factors(r)
        scans = sorted({p for p, _ in factors.values()})
        if scans:       # the splits in the scan's order: C_s sums the totals of the splits passed
            suffix = r.reductions[scans[0]].scan == "suffix"
            lines += [f"cs{p} = tl.zeros([BLOCK_M, 1], tl.float32)  # red{p}'s total over the splits passed"
                      for p in scans]
            lines += ["for i in range(0, SPLITS):", f"    s = {'SPLITS - 1 - i' if suffix else 'i'}"]
        elif others:
            lines.append("for s in range(0, SPLITS):")
        online = sorted({r.reductions[j].online for j in others} - {None})
        lines += [f"    alpha{j} = {'tl.exp2' if r.reductions[j].base2 else 'tl.exp'}(tl.load(ws_ptr + {row} + {cols[j]}, mask=mask_m[:, None], "
                  f"other={NEG_INF}) - r{j}_safe)  # split max -> final max" for j in online]
        for j in others:
            red = r.reductions[j]
            ptr, mask = f"ws_ptr + {row} + {cols[j]}", "mask_m[:, None]"
            if red.kind == "dot":
                ptr, mask = ptr + " + offs_dv[None, :]", mask + " & mask_dv[None, :]"
            scale = f" * alpha{red.online}" if red.online is not None else ""
            if j in factors:
                p, d = factors[j]
                scale += f" * tl.exp({d!r} * cs{p})"
            lines.append(f"    r{j} += tl.load({ptr}, mask={mask}, other=0.0){scale}")
        lines += [f"    cs{p} += tl.load(ws_ptr + {row} + {cols[p]}, mask=mask_m[:, None], other=0.0)" for p in scans]

    def epilogue(self) -> None:
        if self.last:
            KernelWriter.epilogue(self)
        else:
            self.outer.lines.append("# final values of this pass, for the later passes")
            self.store_states(self.members, FINAL, lambda j: self.em.red_names[j])


def generate_split(region: Region, name: str, allow_tf32: bool = False,
                   interpret: bool = False) -> tuple[str, list[list]]:
    """Source of ``{name}_split{p}`` and ``{name}_combine{p}`` for each pass p (a pair of the
    same arguments) and each pair's block statistics."""
    kernels, stats = [], []
    for p in range(len(region.passes())):
        split = SplitWriter(region, f"{name}_split{p}", p, allow_tf32, interpret)
        split.prologue()
        split.split_range()
        split.passes()
        split.epilogue()
        combine = CombineWriter(region, f"{name}_combine{p}", p, allow_tf32, interpret)
        combine.stats = split.stats          # same signature: the runtime passes one argument list
        combine.prologue()
        combine.passes()
        combine.epilogue()
        kernels += [split.assemble(), combine.assemble()]
        stats.append(split.stats)
    source = "\n\n".join(kernels)
    return prelude(source) + source, stats
