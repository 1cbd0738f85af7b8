"""Run the generated Gluon kernels on the CPU: what they compute, and their barrier protocol.

Gluon kernels need an sm_90 GPU (wgmma, TMA, mbarriers, warp specialisation) and Triton's
interpreter does not run them. This module runs their generated source through that interpreter
(its tensors and builtins: ``tl.load``, ``tl.where``, pointer arithmetic, ``program_id`` ...)
with the Gluon-only parts emulated:

* layouts are ignored (``convert_layout`` is the identity);
* shared memory is a NumPy array, NaN-filled (a read before a write shows);
* a TMA copy reads its descriptor's [rows, cols] block (zeros out of bounds) at issue, turns its
  destination NaN, and lands the data a moment later on a thread of its own before completing
  its barrier's transaction bytes — so reading a buffer without waiting for its barrier, or
  while the next copy into it is in flight, reads NaN (mostly: it is a race, as on the GPU);
* an async ``warpgroup_mma`` (fp32 product of bf16 / fp16 operands) reads its operands when a
  ``warpgroup_mma_wait`` retires it (groups retire in issue order), so a buffer released before
  that wait can be overwritten (NaN) under it; using its result before the wait fails;
* mbarriers count arrivals and transaction bytes per phase (``expect`` is one arrival plus its
  bytes, as ``mbarrier.arrive.expect_tx``); ``wait(bar, phase)`` blocks while the barrier's
  current phase has ``phase``'s parity;
* ``warp_specialize`` runs every partition in a thread of its own, so the loader and the compute
  partitions really wait on each other: a wrong phase or count hangs, which the emulator reports
  after ``TIMEOUT`` seconds instead of hanging the test;
* the acquire protocol is checked whatever the timing: every read of shared memory a TMA copy
  wrote must come from a partition that has waited for the barrier phase that copy completes,
  and no copy may be issued into memory an async wgmma still reads (``ProtocolError``).

What it cannot see: value races it does not happen to hit (the threads' interleaving is the
OS's), fences and thread barriers (no-ops here), reordering within a partition (each runs as one
thread), layouts, register pressure, shared-memory capacity, TMA descriptor limits, the
``multiple_of`` hints, and the GPU's rounding of fp32 -> bf16 (the interpreter truncates; the
tests use fp16). Private Triton imports (the interpreter's tensors) are confined to this test
module.
"""
from __future__ import annotations

import importlib.util
import inspect
import random
import re
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import numpy as np
import torch
import triton.language as real_tl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime import interpreter as interp

TIMEOUT = 60.0      # seconds a barrier wait may block before the emulator calls it a hang
COPY_DELAY = 2e-3   # a TMA copy lands up to this many seconds after its issue
ARRIVE_YIELD = 2e-4     # seconds a partition pauses after an arrive
_COND = threading.Condition()   # guards every barrier (the programs of a grid run one at a time)


class Hang(RuntimeError):
    """A partition waited on a barrier phase that never completed."""


class NotUsable(ValueError):
    """The runtime would not launch this Gluon kernel for these inputs (``tiles_usable``)."""


# -- values ----------------------------------------------------------------------------------------
def scalar(x) -> int:
    if isinstance(x, real_tl.tensor):
        return int(np.asarray(x.handle.data).reshape(-1)[0])
    if isinstance(x, real_tl.constexpr):
        return int(x.value)
    return int(x)


def to_f32(data: np.ndarray, dtype) -> np.ndarray:
    """Interpreter data of ``dtype`` as fp32 (bf16 is stored as uint16, as the interpreter does)."""
    if dtype == real_tl.bfloat16:
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32)


def block(data: np.ndarray, dtype) -> real_tl.tensor:
    """A block tensor of the interpreter holding ``data`` (already in ``dtype``'s storage type)."""
    data = np.ascontiguousarray(data)
    return real_tl.tensor(interp.TensorHandle(data, dtype), real_tl.block_type(dtype, list(data.shape)))


TL_DTYPES = {torch.bfloat16: real_tl.bfloat16, torch.float16: real_tl.float16, torch.float32: real_tl.float32}


# -- layouts and shared memory --------------------------------------------------------------------
class Layout:
    """Any Gluon layout: the emulator computes on whole tiles, so layouts carry no meaning."""

    def __init__(self, *args, **kwargs):
        pass

    @staticmethod
    def get_default_for(*args, **kwargs):
        return Layout()


class MBarrierLayout(Layout):
    pass


class Shared:
    """A shared-memory buffer (or a view of one: ``index``, ``slice``, ``permute``)."""

    def __init__(self, data: np.ndarray, dtype):
        self.data, self.dtype = data, dtype
        self.type = types.SimpleNamespace(shape=list(data.shape))
        self.shape = self.type.shape

    def index(self, i) -> Shared:
        return Shared(self.data[scalar(i)], self.dtype)

    def slice(self, start, length, dim: int = 0) -> Shared:
        idx = [slice(None)] * self.data.ndim
        start = scalar(start)
        idx[dim] = slice(start, start + scalar(length))
        return Shared(self.data[tuple(idx)], self.dtype)

    def permute(self, order) -> Shared:
        return Shared(self.data.transpose([scalar(o) for o in order]), self.dtype)

    def load(self, layout=None) -> real_tl.tensor:
        check_acquired(self)
        return block(self.data.copy(), self.dtype)

    def store(self, value: real_tl.tensor) -> None:
        assert value.dtype == self.dtype, (value.dtype, self.dtype)
        assert list(np.shape(value.handle.data)) == self.shape, (np.shape(value.handle.data), self.shape)
        with _COND:
            _COPIED[:] = [c for c in _COPIED if not overlap(c[:2], self.bounds())]
        self.data[...] = value.handle.data

    def operand(self) -> np.ndarray:
        check_acquired(self)
        return to_f32(self.data, self.dtype)

    def bounds(self) -> tuple[int, int]:
        """The bytes this view spans: [low, high) addresses."""
        lo = hi = self.data.__array_interface__["data"][0]
        for n, st in zip(self.data.shape, self.data.strides):
            lo, hi = lo + min(0, (n - 1) * st), hi + max(0, (n - 1) * st)
        return lo, hi + self.data.itemsize


# -- the acquire protocol, checked at every read of shared memory ----------------------------------
# A TMA copy's data may be read only by a partition that has waited for the barrier phase the copy
# completes (``_COPIED``: each copied range, its barrier and that phase; ``_SEEN``: the phases each
# partition has waited for), and a copy may not be issued into a range an async wgmma still reads
# (``_READING``). Both are checked when they happen, whatever the threads' timing.
_COPIED: list[tuple[int, int, object, int]] = []
_READING: dict[int, list[tuple[tuple[int, int], bool]]] = {}   # wgmma -> (span, acquired) per operand
_SEEN = threading.local()


class ProtocolError(RuntimeError):
    """Shared memory read before its copy was waited for, or overwritten while a wgmma reads it."""


def overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def seen() -> dict:
    """The barrier phases this partition has waited for, by barrier."""
    return _SEEN.__dict__.setdefault("phases", {})


UNWAITED = "a partition reads shared memory that a TMA copy writes without having waited for its barrier"


def check_acquired(s: Shared) -> None:
    span = s.bounds()
    with _COND:
        for lo, hi, b, phase in _COPIED:
            if overlap((lo, hi), span) and seen().get(id(b), 0) < phase:
                raise ProtocolError(f"{UNWAITED}'s phase {phase} (it has seen {seen().get(id(b), 0)})")


def acquired(span: tuple[int, int]) -> bool:
    """Has this partition waited for the copies into ``span``? (False if none was issued yet:
    a read that runs ahead of the loader.) Call with ``_COND`` held."""
    copies = [(b, phase) for lo, hi, b, phase in _COPIED if overlap((lo, hi), span)]
    return bool(copies) and all(seen().get(id(b), 0) >= phase for b, phase in copies)


class Barrier:
    """One mbarrier: ``count`` arrivals and the expected transaction bytes complete a phase."""

    def __init__(self):
        self.count = self.pending = None
        self.tx = self.phase = 0

    def arrive(self, count: int) -> None:
        assert self.count is not None, "arrive on an uninitialised barrier"
        self.pending -= count
        assert self.pending >= 0, "more arrivals than the barrier's count in one phase"
        self.complete_if_done()

    def complete_if_done(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count
            _COND.notify_all()


class Barriers:
    def __init__(self, n: int):
        self.items = [Barrier() for _ in range(n)]

    def index(self, i) -> Barriers:
        b = Barriers(0)
        b.items = [self.items[scalar(i)]]
        return b

    def one(self) -> Barrier:
        assert len(self.items) == 1, "a barrier operation on an array of barriers"
        return self.items[0]


def allocate_shared_memory(dtype, shape, layout, value=None):
    shape = [scalar(s) for s in shape]
    if isinstance(layout, MBarrierLayout):
        return Barriers(int(np.prod(shape)))
    storage = interp._get_np_dtype(dtype)
    if dtype.is_floating() and dtype != real_tl.bfloat16:
        data = np.full(shape, np.nan, dtype=storage)
    elif dtype == real_tl.bfloat16:
        data = np.full(shape, 0x7FC0, dtype=storage)      # bf16 NaN
    else:
        data = np.zeros(shape, dtype=storage)
    s = Shared(data, dtype)
    if value is not None:
        s.store(value)
    return s


# -- the Hopper builtins ---------------------------------------------------------------------------
class mbarrier:  # noqa: N801 — the generated code's module name
    MBarrierLayout = MBarrierLayout

    @staticmethod
    def init(bar: Barriers, count) -> None:
        b = bar.one()
        with _COND:
            b.count = b.pending = scalar(count)
            b.tx = b.phase = 0

    @staticmethod
    def expect(bar: Barriers, nbytes, pred=True) -> None:
        if not bool(pred):
            return
        b = bar.one()
        with _COND:
            b.tx += scalar(nbytes)
            b.arrive(1)

    @staticmethod
    def arrive(bar: Barriers, *, count=1, pred=True) -> None:
        if not bool(pred):
            return
        with _COND:
            bar.one().arrive(scalar(count))
        time.sleep(ARRIVE_YIELD)    # let a partition this arrival wakes run first (a released
        # buffer's next copy, issued before this partition goes on, shows a read after the release)

    @staticmethod
    def wait(bar: Barriers, phase, pred=True, deps=()) -> None:
        if not bool(pred):
            return
        b, parity = bar.one(), scalar(phase) & 1
        with _COND:
            if not _COND.wait_for(lambda: b.phase % 2 != parity, TIMEOUT):
                raise Hang(f"a wait for phase parity {parity} never completed (phases done: {b.phase}, "
                           f"arrivals pending: {b.pending}, bytes pending: {b.tx})")
            # the phase this wait observed: the last completed one of ``phase``'s parity
            done = b.phase if (b.phase - 1) % 2 == parity else b.phase - 1
            seen()[id(b)] = max(seen().get(id(b), 0), done)

    @staticmethod
    def invalidate(bar: Barriers) -> None:
        pass


class Descriptor:
    """A host TensorDescriptor as the kernel sees it: a [rows, cols] view, its block, its dtype."""

    def __init__(self, d: TensorDescriptor):
        self.view = d.base.as_strided(list(d.shape), list(d.strides))
        self.block_shape = list(d.block_shape)
        self.dtype = TL_DTYPES[d.base.dtype]
        self.layout = Layout()
        nbytes = int(np.prod(self.block_shape)) * d.base.element_size()
        self.block_type = types.SimpleNamespace(nbytes=nbytes, shape=self.block_shape)

    def storage(self, x: torch.Tensor) -> np.ndarray:
        x = x.detach().contiguous()
        return x.view(torch.int16).numpy().view(np.uint16) if x.dtype == torch.bfloat16 else x.numpy()

    def read(self, coord) -> np.ndarray:
        r, c = (scalar(x) for x in coord)
        out = np.zeros(self.block_shape, dtype=interp._get_np_dtype(self.dtype))
        rows, cols = self.view.shape
        r1, c1 = min(r + self.block_shape[0], rows), min(c + self.block_shape[1], cols)
        if r1 > r and c1 > c and r >= 0 and c >= 0:
            out[:r1 - r, :c1 - c] = self.storage(self.view[r:r1, c:c1])
        return out


_COPIES: list[threading.Thread] = []    # TMA copies in flight


def poison(s: Shared) -> None:
    s.data[...] = 0x7FC0 if s.dtype == real_tl.bfloat16 else np.nan


class tma:  # noqa: N801
    @staticmethod
    def async_copy_global_to_shared(desc: Descriptor, coord, barrier: Barriers, result: Shared, pred=True) -> None:
        """The destination turns NaN at issue and the data lands a moment later, on a thread of
        its own, just before the barrier's bytes complete: a partition that reads the buffer
        without waiting for the barrier, or still reads it when the next copy is issued into
        it, reads NaN."""
        if not bool(pred):
            return
        data, b = desc.read(coord), barrier.one()
        span = result.bounds()
        with _COND:
            under = [waited for reads in _READING.values() for r, waited in reads if overlap(r, span)]
            if under and not all(under):     # the wgmma never acquired what it reads: it ran ahead
                raise ProtocolError(f"{UNWAITED} (its wgmma still reads when the copy is issued)")
            if under:
                raise ProtocolError("a TMA copy is issued into shared memory an async wgmma still reads")
            _COPIED[:] = [c for c in _COPIED if not overlap(c[:2], span)]
            _COPIED.append((*span, b, b.phase + 1))     # the phase its bytes belong to
        poison(result)

        def land():
            time.sleep(random.uniform(0, COPY_DELAY))
            result.data[...] = data
            with _COND:
                b.tx -= desc.block_type.nbytes
                assert b.tx >= 0, "a copy completed more bytes than its barrier expected"
                b.complete_if_done()
        t = threading.Thread(target=land, daemon=True)
        _COPIES.append(t)
        t.start()

    @staticmethod
    def store_wait(pendings=0) -> None:
        pass


class InFlight:
    """An async ``warpgroup_mma``: its operands are read when a ``warpgroup_mma_wait`` retires it
    (groups retire in issue order), as the hardware may read shared memory until then — a
    buffer released or overwritten before the wait shows as NaN. Using it before its wait fails."""

    def __init__(self, a, b, acc, use_acc):
        self.a, self.b, self.acc, self.use_acc, self.value = a, b, acc, use_acc, None
        with _COND:
            _READING[id(self)] = [(x.bounds(), acquired(x.bounds())) for x in (a, b) if isinstance(x, Shared)]

    def retire(self) -> real_tl.tensor:
        if self.value is None:
            def operand(x):
                return x.operand() if isinstance(x, Shared) else to_f32(np.asarray(x.handle.data), x.dtype)
            out = np.matmul(operand(self.a), operand(self.b)).astype(np.float32)
            if bool(self.use_acc):
                acc = self.acc.retire() if isinstance(self.acc, InFlight) else self.acc
                out = out + np.asarray(acc.handle.data, dtype=np.float32)
            self.value = block(out, real_tl.float32)
            with _COND:
                _READING.pop(id(self), None)
        return self.value


_GROUPS = threading.local()     # each partition's async groups in flight, in issue order


def warpgroup_mma(a, b, acc, *, use_acc=True, precision=None, max_num_imprecise_acc=None, is_async=False):
    op = InFlight(a, b, acc, use_acc)
    if not is_async:
        return op.retire()
    _GROUPS.__dict__.setdefault("queue", []).append(op)
    return op


def warpgroup_mma_wait(num_outstanding=0, deps=None):
    queue = _GROUPS.__dict__.setdefault("queue", [])
    while len(queue) > scalar(num_outstanding):
        queue.pop(0).retire()
    out = []
    for d in tuple(deps or ()):
        if isinstance(d, InFlight):
            assert d.value is not None, "a warpgroup_mma result used before the wait that retires it"
            d = d.value
        out.append(d)
    return out[0] if len(out) == 1 else tuple(out)


def fence_async_shared(cluster=False) -> None:
    pass


# -- warp specialisation: a thread per partition ---------------------------------------------------
def warp_specialize(functions_and_args, worker_num_warps=None, worker_num_regs=None):
    errors: list[BaseException] = []

    def run(fn, args):
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 — re-raised by the launching thread
            errors.append(e)
            with _COND:
                _COND.notify_all()
    with _COND:     # a new program: its own buffers and barriers
        _COPIED.clear()
        _READING.clear()
    threads = [threading.Thread(target=run, args=(fn, tuple(args)), daemon=True) for fn, args in functions_and_args]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 2)
    while _COPIES:
        _COPIES.pop().join(TIMEOUT)
    if any(t.is_alive() for t in threads):
        raise Hang("a partition did not finish")
    # a partition that failed leaves the others waiting for it: its error is the cause
    causes = [e for e in errors if not (isinstance(e, Hang) or isinstance(e.__cause__, Hang))]
    if errors:
        raise (causes or errors)[0]


# -- the generated code's ``tl``: Triton's language (the interpreter's builtins) plus Gluon's extras
class _Language:
    """``tl`` of the emulated source: Gluon-only names here, everything else Triton's own,
    looked up at each use (the interpreter patches Triton's builtins for the duration of a launch)."""

    Layout = SliceLayout = BlockedLayout = NVMMADistributedLayout = DotOperandLayout = Layout
    NVMMASharedLayout = SwizzledSharedLayout = Layout
    allocate_shared_memory = staticmethod(allocate_shared_memory)
    warp_specialize = staticmethod(warp_specialize)

    @staticmethod
    def arange(start, end, layout=None):
        return real_tl.arange(start, end)

    @staticmethod
    def zeros(shape, dtype, layout=None):
        return real_tl.zeros(shape, dtype)

    @staticmethod
    def full(shape, value, dtype, layout=None):
        return real_tl.full(shape, value, dtype)

    @staticmethod
    def convert_layout(value, layout, assert_trivial=False):
        return value

    @staticmethod
    def to_tensor(x):
        return interp.interpreter_semantic.to_tensor(x)

    @staticmethod
    def thread_barrier():
        pass

    def __getattr__(self, name):
        return getattr(real_tl, name)


tl = _Language()
gluon = types.SimpleNamespace(jit=interp.InterpretedFunction)
_MODULE = "_flashlight_gluon_emulation"
sys.modules.setdefault(_MODULE, sys.modules[__name__])

HEADER = f"""import triton
import triton.language as _triton_language  # the interpreter patches the builtins it finds here
from {_MODULE} import gluon, tl, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait, fence_async_shared
"""
_IMPORTS = re.compile(r"^(from triton\.experimental[^\n]*\([^)]*\)\n|from triton\.experimental[^\n]*\n|"
                      r"from flashlight\.codegen import gluon_tl as tl\n|import triton\n)", re.M)


class Kernel:
    """A generated Gluon kernel, emulated: ``Kernel(fn)[grid](*args, **meta)`` as on the GPU."""

    def __init__(self, fn, edit=None):
        """``edit``: a function of the source text (the tests break a kernel on purpose)."""
        source = Path(inspect.getsourcefile(getattr(fn, "fn", fn))).read_text()
        source = edit(source) if edit else source
        name = getattr(fn, "__name__", None) or fn.fn.__name__
        source = HEADER + _IMPORTS.sub("", source)
        path = Path(tempfile.mkdtemp(prefix="gluon_emu_")) / f"{name}_emulated.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"{name}_emulated", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.fn, self.source = getattr(module, name), source
        for fn in list(vars(module).values()):      # the interpreter rewrites each function's AST at its first
            if isinstance(fn, interp.InterpretedFunction):      # call: here, not in the partitions'
                fn.rewrite()                                    # threads (CPython's ast is not thread-safe)

    def __getitem__(self, grid):
        def launch(*args, **meta):
            args = [Descriptor(a) if isinstance(a, TensorDescriptor) else a for a in args]
            meta = {k: Descriptor(v) if isinstance(v, TensorDescriptor) else v for k, v in meta.items()}
            return self.fn[tuple(grid)](*args, **meta)
        return launch


# -- running a region's Gluon kernels next to its Triton kernels ------------------------------------
def traced_regions(fn, *args) -> dict:
    """Compile and run ``fn(*args)`` with flashlight (no grad) and return each region's inputs
    as the op received them at its first call, by region key (``runtime.op.REGISTRY``)."""
    from flashlight.runtime import op as rt
    seen, run_all = {}, rt.CompiledRegion.run_all

    def recording(self, inputs, *a, **kw):
        seen.setdefault(self.key, [x.detach() for x in inputs])
        return run_all(self, inputs, *a, **kw)
    rt.REGISTRY.clear()
    torch.compiler.reset()
    rt.CompiledRegion.run_all = recording       # this tool's own probe: each region's inputs
    try:
        with torch.no_grad():
            torch.compile(fn, backend="flashlight", dynamic=False)(*args)
    finally:
        rt.CompiledRegion.run_all = run_all
    return seen


def forward(c, xs: list[torch.Tensor], edit=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and row statistics of region ``c``'s Gluon forward, emulated, on the op's inputs
    ``xs`` (launched as the runtime launches it: ``runtime.gluon.launch``); ``edit``: as ``Kernel``'s."""
    from flashlight.runtime import gluon as rg
    from flashlight.runtime import op as rt
    from flashlight.runtime.buffers import unwritten
    outs = c.new_outputs(xs[0])
    stats = unwritten(xs[0].new_empty(c.rowstats_shape, dtype=torch.float32))
    rg.launch(Kernel(rt.compile_gluon(c), edit), c.region, rt.kernel_args(c.region, c.stats, xs, outs, stats, {}), xs, True)
    return outs[0], stats


def tile_gradients(c, xs: list[torch.Tensor], out: torch.Tensor, stats: torch.Tensor, dout: torch.Tensor,
                   kernels=("dkdv", "dq"), edit=None) -> list[torch.Tensor | None]:
    """The gradients of region ``c``'s inputs from a backward whose ``kernels`` are the Gluon tile
    kernels, emulated (the others and the row kernel: Triton's), launched as the runtime launches
    them (``runtime.gluon.launch_tile``); ``NotUsable`` where the runtime would not launch one."""
    from flashlight.runtime import gluon as rg
    from flashlight.runtime.backward import compile_gluon_tile
    k = c.backward_kernels()
    r = k.region
    bufs = k.buffers(xs)
    drows = k.launch_rows(xs, stats, out, dout, bufs, c.rows_config(xs))
    for kernel, operands in (("dkdv", (r.dots[0].k, r.reductions[2].v)), ("dq", (r.dots[0].q, ))):
        if kernel in kernels:
            if not rg.tiles_usable(kernel, r, xs, drows[1], [bufs[e.args[0]] for e in operands], [stats, drows[0]]):
                raise NotUsable(f"the Gluon {kernel} kernel does not take these layouts or sizes")
            args = k.tile_args(kernel, xs, stats, drows, bufs, {})
            rg.launch_tile(kernel, Kernel(compile_gluon_tile(k, kernel), edit), r, k.plan, args, xs, drows[1])
        else:
            getattr(k, f"launch_{kernel}")(xs, stats, drows, bufs, {}, c.config(xs, kernel))
    return k.results(xs, bufs)
