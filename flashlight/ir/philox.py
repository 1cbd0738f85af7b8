"""The dropout draw ``rand16(seed, row, col)`` written with torch integer ops, bit for bit with
the kernel's ``fl_rand16`` / ``fl_rand16_block`` (``codegen/emit.py``).

One Philox-4x32-10 evaluation yields 128 random bits; the dropout mask uses them for 8
consecutive keys of a row, 16 bits each (FlashAttention-2 does the same with 8 bits), so a
[BLOCK_M, BLOCK_N] score tile costs BLOCK_M * BLOCK_N / 8 Philox calls instead of one per score.

    rand16(seed, row, col) = bits [16 h, 16 h + 16) of word w of
        Philox-4x32-10(key = (seed lo, seed hi), counter = (g lo, g hi, row lo, row hi))
    with g = col // 8 (the group of 8 keys), lane j = col % 8, w = j // 2, h = j % 2

``row`` is the linear index of the dropped-out tensor over all dims but the last, ``col`` the
index along the last (the key axis), both non-negative int64: the pair (row, col // 8) is the
element's group of 8 and no two groups share a counter. With row = 0 the counter is that of
Triton's ``tl.randint4x(seed, col // 8)`` (offset lo, offset hi, 0, 0). 32-bit arithmetic is
emulated in int64 here, so it runs on any device and dtype-free of torch's uint32 support.
"""
from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
LANES = 8                    # 16-bit draws per Philox call: 4 words of 32 bits
LEVELS = 1 << 16             # a draw is uniform over [0, LEVELS)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of a * b for 32-bit a, b: a * b = u * 2**16 + t with the
    halves of b, each product < 2**48, so nothing overflows int64."""
    t, u = a * (b & 0xFFFF), a * (b >> 16)
    s = ((u & 0xFFFF) << 16) + t                 # a * b = (u >> 16) * 2**32 + s, s < 2**49
    return (u >> 16) + (s >> 32), s & M32


def philox(seed: torch.Tensor, counter: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Philox-4x32-10 keyed by the 64-bit ``seed`` at a counter of four 32-bit words (int64
    tensors in [0, 2**32), broadcast together): four 32-bit words, as Triton's ``tl.philox``."""
    seed = seed.to(torch.int64)
    k0, k1 = seed & M32, (seed >> 32) & M32
    c0, c1, c2, c3 = torch.broadcast_tensors(*counter)
    for _ in range(ROUNDS):
        hi_b, lo_b = _mulhilo(ROUND_B, c2)
        hi_a, lo_a = _mulhilo(ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + KEY_A) & M32, (k1 + KEY_B) & M32
    return c0, c1, c2, c3


def rand16(seed: torch.Tensor, row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """Uniform int64 in [0, 65536) per element of ``row`` and ``col`` broadcast together (see
    the module docstring). Each element runs its own Philox call here; the kernel runs one per
    group of 8 keys and spreads its bits."""
    row, col = torch.broadcast_tensors(torch.as_tensor(row).to(torch.int64), torch.as_tensor(col).to(torch.int64))
    group, lane = col // LANES, col % LANES
    words = philox(seed, (group & M32, (group >> 32) & M32, row & M32, (row >> 32) & M32))
    word = torch.stack(words, -1).gather(-1, (lane // 2).unsqueeze(-1)).squeeze(-1)
    return (word >> (16 * (lane % 2))) & (LEVELS - 1)
