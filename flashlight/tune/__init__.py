"""Tune (DESIGN.md §6): launch configurations for the generated kernels.

By default a kernel launches with a heuristic config chosen from head dim, score tile count and
whether the mask reads data (measured on the H200: within a few percent of the best config for
most variants), so the first call costs one Triton compile — as FlexAttention does. With
``torch.compile(..., mode="max-autotune")`` (or ``FLASHLIGHT_AUTOTUNE=1``) the candidates are
timed once per shape bucket and the winner is kept in memory and on disk (``TuningCache``: keyed
by kernel source hash, shape bucket, GPU name and torch/triton versions); a tuned result on disk
is used in either mode, so a second process does not retune. The interpreter (CPU) gets small
blocks: it is slow per element.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton


@dataclass(frozen=True)
class Config:
    """A launch config. ``maxnreg`` caps registers per thread (None: ptxas decides). It was
    added to fit two 8-warp programs per multiprocessor (<= 128 registers), so that one's
    softmax would overlap the other's matrix products; offline sm_90 compiles show ptxas then
    serialises the wgmma (docs/notes.md, session 9), so no default or candidate uses it."""
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = None

    def as_kwargs(self) -> dict:
        kw = dict(BLOCK_M=self.BLOCK_M, BLOCK_N=self.BLOCK_N, num_warps=self.num_warps,
                  num_stages=self.num_stages)
        if self.maxnreg:
            kw["maxnreg"] = self.maxnreg
        return kw

    def __str__(self) -> str:
        return (f"{self.BLOCK_M}x{self.BLOCK_N}w{self.num_warps}s{self.num_stages}"
                + (f"r{self.maxnreg}" if self.maxnreg else ""))


def cdiv(a: int, b: int) -> int:
    """Host-side ceil division (``triton.cdiv`` is a JIT function: ~15 µs per host call)."""
    return -(-a // b)


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), in plain Python on the host path."""
    return 1 << max(0, n - 1).bit_length()


def head_block(d: int) -> int:
    return max(16, pow2(d))


INTERPRETER = Config(16, 16, 1, 1)      # Triton's CPU interpreter is slow per element: small tiles
# decoding (M <= 16): one block of 16 rows (tl.dot's minimum) holds every query
DECODE = [(64, 4, 3), (128, 4, 3), (64, 4, 4), (128, 8, 2)]


def heuristic(block_d: int, n_dots: int, sparse: bool, M: int | None = None) -> Config:
    """The launch config used without autotuning (the default, as FlexAttention does), from the
    H200 sweeps in docs/notes.md (session 2): at D<=64, 64x64 w4 s3 is within 1.1% of the best of
    the space on average over 7 variants (worst 4.6%). At D=128, 128x128 w8 s3 is best for dense
    attention, but masks that skip blocks (short live ranges: document, sliding window) lose up to
    2.4x with it, and 64x64 w4 s3 is within 3% of the best for every masked variant measured.
    Decoding (``M`` <= 16) takes the first decode config: 16 query rows, 64 keys per block."""
    if M is not None and M <= 16:
        return candidates(block_d, n_dots, M)[0]
    if block_d >= 256:
        return Config(64, 64, 4, 2)       # shared memory: K and V tiles of a 256-wide head
    if block_d >= 128 and not sparse:
        return Config(128, 64, 8, 3) if n_dots > 1 else Config(128, 128, 8, 3)
    return Config(64, 64, 4, 3)


# Configs by shared-memory footprint (BLOCK_M x BLOCK_N x stages), largest first: where a chosen
# config does not fit a kernel (OutOfResources at its first compile), the next smaller one runs.
LADDER = [Config(128, 128, 8, 3), Config(128, 128, 8, 2), Config(128, 64, 8, 3), Config(64, 64, 4, 3),
          Config(64, 64, 4, 2), Config(32, 64, 4, 2), Config(32, 32, 4, 1), Config(16, 16, 4, 1)]


def smaller(cfg: Config) -> Config | None:
    size = cfg.BLOCK_M * cfg.BLOCK_N * cfg.num_stages
    return next((c for c in LADDER if c.BLOCK_M * c.BLOCK_N * c.num_stages < size), None)


def candidates(block_d: int, n_dots: int = 1, M: int | None = None) -> list[Config]:
    """The autotuning space (``mode="max-autotune"``), pruned by head dim and score tile count;
    decode configs (BLOCK_M = 16) when ``M`` <= 16."""
    if M is not None and M <= 16:
        return [Config(16, bn, w, s) for bn, w, s in DECODE if not (block_d >= 256 and bn > 64)]
    configs = []
    for bm, bn, w, s in [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3),
                         (64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 4), (64, 32, 4, 3)]:
        if block_d >= 256 and bm * bn > 128 * 64:
            continue     # shared memory: the K/V tiles of a 256-wide head
        if n_dots > 2 and bn > 64:
            continue
        configs.append(Config(bm, bn, w, s))
    return configs


# The backward's two tile kernels, (BLOCK_M, BLOCK_N, warps, stages). dK/dV keeps dK and dV
# ([BLOCK_N, D] each) in registers across its query loop: wide key blocks, narrow query blocks
# (Triton's fused-attention tutorial: 32 x 128 on Hopper). dQ keeps dQ ([BLOCK_M, D]) across its
# key loop: the forward's shapes.
BACKWARD = {
    "dkdv": [(64, 128, 8, 3), (32, 128, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 4, 2),
             (32, 128, 4, 5), (32, 64, 4, 5), (32, 128, 8, 3), (64, 64, 4, 5), (16, 64, 4, 4)],
    "dq": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 4, 3), (64, 32, 4, 2), (128, 128, 8, 2),
           (128, 32, 4, 5), (64, 64, 4, 5), (64, 32, 4, 4)],
}
BACKWARD["sums"] = BACKWARD["dq"]   # the sums a later pass reads: a walk over the keys per query block, as dQ's


def backward_candidates(block_d: int, kernel: str) -> list[Config]:
    """The autotuning space of a backward kernel (``"dkdv"``, ``"dq"`` or ``"sums"``), pruned by head dim:
    a 128-wide head drops 128 x 128 tiles, a 256-wide one keeps tiles of at most 32 x 64 / 64 x 32."""
    limit = 32 * 64 if block_d >= 256 else 128 * 64 if block_d >= 128 else 128 * 128
    return [Config(*c) for c in BACKWARD[kernel] if c[0] * c[1] <= limit]


HEAVY_BODY = 8     # more floating loads than this in the score program: the backward's small tiles


def backward_heuristic(block_d: int, kernel: str, sparse: bool = False, n_dots: int = 1,
                       loaded_rows: bool = False, body_loads: int = 0, scans: bool = False) -> Config:
    """A backward kernel's default, from sweeps on the H200 (docs/notes.md, sessions 4, 7, 8;
    B=4 H=16 N=4096, ``benchmarks.backward_configs``) and an H100 (session 23).
    dK/dV at D <= 64 with one score tile: 64 x 64 w4 s3 (causal 0.671 ms against 0.771 at
    32 x 64; document mask 0.249 against 0.251). Several score tiles at D > 64 (DiffAttn):
    16 x 64 w4 s4 (3.37 ms against 3.58 at 32 x 64, H100; offline sm_90 compiles spill 180
    bytes at 32 x 64, none at 16 x 64). Otherwise, up to D = 128: 32 x 64 w4 s3, the
    fastest of 10 configs for causal and ALiBi at D = 128 (every config keeps [64, 128] fp32 dK
    and dV tiles per warpgroup; offline sm_90 compiles spill 84 bytes at 32 x 64, 616 at
    64 x 64), and for DiffAttn's two score tiles at D = 64 too (1.25 ms against 1.33 at 64 x 64,
    B=2). 8 warps over 64 keys, or 32 x 32 tiles, run 2-3x slower.
    dQ where the mask reads loaded values at the query position (``loaded_rows``: document ids,
    whose live key blocks per query block are a short run): 64 x 32 w4 s4 (document mask, H200
    at D=64: 0.134 ms against 0.163 at 64 x 64; H100 at D=128: 0.239 against 0.283 at
    128 x 64). Key padding (live up to a length) is not measured and keeps the rules below.
    Otherwise at D <= 64 the forward's 64 x 64 for several score tiles or a mask that skips
    blocks (short live ranges waste wide query blocks), and elsewhere the first candidate.
    A score program with more than ``HEAVY_BODY`` floating loads (``body_loads``: IPA's 26, its
    pair bias and 24 point coordinates; the next most in the examples is Evoformer's 2) keeps a
    per-key or per-query gradient sum and a row vector per load live in both tile kernels: dK/dV
    16 x 64 w4 s4 and dQ 64 x 32 w4 s2, what autotuning chose for IPA (H100, B=4 H=16 N=1024
    D=64, session 27: the training step 2.44 ms against 5.22 at 64 x 64 and 128 x 64; offline
    sm_90, dK/dV at 64 x 64 spills 4.4 KB per thread). Measured at D=64 only.
    Partial sums over the keys (``scans``: the dQ kernel also adds dK and dV per tile): 32 x 64
    w4 s2 at D <= 64, 32 x 32 at D = 128 — not measured on a GPU yet; the smallest tiles that
    offline sm_90 compiles of stick-breaking keep out of local memory (8 bytes and none spilled,
    against 2.5 KB at 64 x 64 and 0.9 KB for 32 x 64 at D = 128).
    The sums kernel (``codegen.backward.SumsWriter``) takes dQ's: not measured on a GPU yet."""
    kernel = "dq" if kernel == "sums" else kernel
    if scans and kernel == "dq" and block_d <= 128:
        return Config(32, 64, 4, 2) if block_d <= 64 else Config(32, 32, 4, 2)
    if body_loads > HEAVY_BODY and block_d <= 128:
        return Config(16, 64, 4, 4) if kernel == "dkdv" else Config(64, 32, 4, 2)
    if kernel == "dkdv" and block_d <= 128:
        if block_d > 64 and n_dots > 1:
            return Config(16, 64, 4, 4)
        return Config(64, 64, 4, 3) if block_d <= 64 and n_dots == 1 else Config(32, 64, 4, 3)
    if kernel == "dq" and loaded_rows and block_d <= 128:
        return Config(64, 32, 4, 4)
    if kernel == "dq" and (sparse or n_dots > 1) and block_d <= 64:
        return Config(64, 64, 4, 3)
    return backward_candidates(block_d, kernel)[0]


def fit_rows(cfg: Config, M: int) -> Config:
    """``cfg`` with at most the query rows there are: where M < BLOCK_M a backward tile computes
    masked rows (DeepSeek's absorbed MLA has 16 rows, its heads, per batch element: the dQ
    kernel's 128-row tiles at D=128 were 7/8 padding), so BLOCK_M shrinks to the power of two
    that holds M (16 at least, ``tl.dot``'s minimum) in at most 4 warps. Not measured yet."""
    if M >= cfg.BLOCK_M:
        return cfg
    return Config(max(16, pow2(M)), cfg.BLOCK_N, min(cfg.num_warps, 4), cfg.num_stages)


# The row-gradient kernel's GPU config: elementwise over [BLOCK_M, DV] tiles (BLOCK_N unused), in
# 8 warps: an epilogue's derivative keeps several tiles live (DiffAttn's RMSNorm: offline sm_90
# compiles at DV = 128 spill 20 KB per thread with 64 rows in 4 warps, none in 8). 32 rows: on the
# H200 at D=128 (B=4 H=16 N=4096, session 19) 0.079-0.080 ms against 64 rows' 0.089 (ALiBi,
# document mask); offline, 32 rows take 64-107 registers at DV = 128, no spills.
ROWS = Config(32, 16, 8, 1)


def bucket(*sizes: int) -> tuple[int, ...]:
    """Shapes within a power of two share a tuning result."""
    return tuple(pow2(s) for s in sizes)


TUNER = "tuner 2"      # in the disk key: results of an older tuner (v1: no agreement check) are not reused


class TuningCache:
    """Winning configs on disk, one JSON file per kernel; an unreadable file counts as empty."""

    def __init__(self, directory: Path, kernel: str):
        self.path = directory / f"{kernel}.tune.json"

    @staticmethod
    def key(bucket_: tuple[int, ...], device: str) -> str:
        return f"{device}|torch {torch.__version__}|triton {triton.__version__}|{TUNER}|{bucket_}"

    def load(self) -> dict[str, Config]:
        try:
            raw = json.loads(self.path.read_text())
            return {k: Config(**v) for k, v in raw.items()}
        except (OSError, ValueError, TypeError):
            return {}

    def store(self, key: str, cfg: Config) -> None:
        entries = self.load()
        entries[key] = cfg
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({k: asdict(v) for k, v in entries.items()}, f)
        os.replace(tmp, self.path)
