"""Tune (DESIGN.md §6): launch configurations for the generated kernels.

A typed config space pruned by head dim; on CUDA the candidates are timed once per shape bucket
and the winner is kept in memory and on disk (``TuningCache``: keyed by kernel source hash, shape
bucket, GPU name and torch/triton versions), so a second process does not retune. The
interpreter (CPU) gets small blocks: it is slow per element.
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
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int = 4
    num_stages: int = 2

    def as_kwargs(self) -> dict:
        return dict(BLOCK_M=self.BLOCK_M, BLOCK_N=self.BLOCK_N, num_warps=self.num_warps,
                    num_stages=self.num_stages)


def head_block(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def candidates(M: int, N: int, block_d: int, on_gpu: bool, n_dots: int = 1) -> list[Config]:
    if not on_gpu:
        return [Config(16, 16, 1, 1)]
    if M <= 16:    # decoding: one block of 16 rows (tl.dot's minimum) holds every query
        return [Config(16, bn, w, s) for bn, w, s in [(64, 4, 3), (128, 4, 3), (64, 4, 4), (128, 8, 2)]
                if not (block_d >= 256 and bn > 64)]
    configs = []
    for bm, bn, w, s in [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3),
                         (64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 4)]:
        if block_d >= 256 and bm * bn > 128 * 64:
            continue     # shared memory: the K/V tiles of a 256-wide head
        if n_dots > 2 and bn > 64:
            continue
        configs.append(Config(bm, bn, w, s))
    return configs


def bucket(*sizes: int) -> tuple[int, ...]:
    """Shapes within a power of two share a tuning result."""
    return tuple(triton.next_power_of_2(max(1, s)) for s in sizes)


class TuningCache:
    """Winning configs on disk, one JSON file per kernel; an unreadable file counts as empty."""

    def __init__(self, directory: Path, kernel: str):
        self.path = directory / f"{kernel}.tune.json"

    @staticmethod
    def key(bucket_: tuple[int, ...], device: str) -> str:
        return f"{device}|torch {torch.__version__}|triton {triton.__version__}|{bucket_}"

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
