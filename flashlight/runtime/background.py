"""Kernels that compile in the background while another one serves.

The Gluon forward takes about twice the Triton kernel's compile time (2-4 s on the H200's host);
both compute the same outputs and row statistics. So the first call runs the Triton kernel (its
compile is that call's critical path), then submits the Gluon kernel's generation and compile
here; the Triton kernel serves every call until that is done, and the Gluon kernel takes over
from the next call (a tiered JIT: a quick kernel first, the best one when it is ready). Triton's
compiler spends most of its time outside the GIL (MLIR, LLVM, ptxas), so the caller's own
compiles and launches go on meanwhile: offline, a Gluon compile on a second thread slowed a
Triton compile beside it from 0.66 to 0.87 s on the 2-core CPU machine, hence "after, not beside".

``FLASHLIGHT_BACKGROUND=0`` compiles at the first launch instead, blocking it: every call then
runs the same kernel (bitwise-reproducible from the first call). ``wait()`` (``flashlight.wait``)
blocks until every submitted compile has finished: benchmarks time the steady state after it.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

_POOL: ThreadPoolExecutor | None = None
_PENDING: list[Future] = []
_LOCK = threading.Lock()


def enabled() -> bool:
    """``FLASHLIGHT_BACKGROUND`` (read per launch: tests switch it)."""
    return os.environ.get("FLASHLIGHT_BACKGROUND", "1") != "0"


def submit(fn, device: torch.device, *args) -> Future:
    """Run ``fn(*args)`` on a compile thread with ``device`` current (Triton compiles for the
    current device's target)."""
    global _POOL

    def task():
        if device.type != "cuda":
            return fn(*args)
        with torch.cuda.device(device):
            return fn(*args)
    with _LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="flashlight-compile")
        future = _POOL.submit(task)
        _PENDING.append(future)
    return future


def wait() -> None:
    """Block until every background compile submitted so far is done (its errors are the
    launch's to report: a failed compile leaves the other kernel serving)."""
    with _LOCK:
        pending = list(_PENDING)
    for future in pending:
        future.exception()
    with _LOCK:
        _PENDING[:] = [f for f in _PENDING if not f.done()]


@dataclass
class Tier:
    """A faster kernel that takes over from a region's default one once it is compiled (the
    Gluon forward over the Triton forward, the Gluon dK/dV over the Triton dK/dV). The default
    kernel is always there; the tier never fails a call: a compile or first-launch error leaves
    the default kernel serving for good (``FLASHLIGHT_STRICT=1`` raises instead)."""
    kernel: object = None           # the compiled kernel; None: not yet; False: none, or it failed
    future: Future | None = None    # its background compile (``submit_after``)
    launched: bool = False          # it launched once: later errors are real errors

    def launch(self, compile_now, run) -> bool:
        """``run(kernel)`` if the kernel is ready; False where the default kernel serves this
        call instead. ``compile_now()`` makes the kernel when compiles block
        (``FLASHLIGHT_BACKGROUND=0``); by default it comes from the background compile, and its
        error, if any, is raised here, at the first launch after it."""
        try:
            if self.kernel is None:
                if enabled():
                    if self.future is None or not self.future.done():
                        return False
                    self.kernel = self.future.result() or False
                else:
                    self.kernel = compile_now() or False
            if not self.kernel:
                return False
            run(self.kernel)
        except Exception:  # noqa: BLE001 — a compiler error or resources: the default kernel serves
            if self.launched or os.environ.get("FLASHLIGHT_STRICT") == "1":
                raise
            self.kernel = False
            return False
        self.launched = True
        return True

    def submit_after(self, compile_for, device: torch.device, *args) -> None:
        """Called right after the default kernel's launch (whose compile is the first call's
        critical path): ``compile_for(*args)`` on a compile thread, once, returning the kernel
        compiled for that launch's specialisation."""
        if self.kernel is None and self.future is None and enabled():
            self.future = submit(compile_for, device, *args)
