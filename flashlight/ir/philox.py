"""Triton's ``tl.rand(seed, offset)`` written with torch integer ops, bit for bit.

Dropout inside a fused kernel draws its keep mask from Philox-4x32-10 keyed by a per-call seed
at a counter equal to the element's linear index. The reference evaluator (the backward's VJP,
float64 runs) must draw the *same* mask; this reproduces Triton's ``randint`` (counter =
(offset low word, offset high word, 0, 0), key = (seed low word, seed high word)) and
``uint_to_uniform_float`` with 32-bit arithmetic emulated in int64, on any device.
"""
from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
SCALE = 4.6566127342e-10     # largest s with (2**31 - 1) * s < 1 in float32 (Triton's constant)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of a * b for 32-bit a, b, through 16-bit limbs (no overflow)."""
    al, ah = a & 0xFFFF, a >> 16
    bl, bh = b & 0xFFFF, b >> 16
    t = al * bl
    u = ah * bl + (t >> 16)
    v = al * bh + (u & 0xFFFF)
    return ah * bh + (u >> 16) + (v >> 16), ((v & 0xFFFF) << 16) | (t & 0xFFFF)


def rand(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in [0, 1): ``tl.rand(seed, offset)`` with an int64 offset."""
    offset = offset.to(torch.int64)
    seed = seed.to(torch.int64)
    c0, c1 = offset & M32, (offset >> 32) & M32
    c2 = c3 = torch.zeros_like(c0)
    k0, k1 = seed & M32, (seed >> 32) & M32
    for _ in range(ROUNDS):
        hi_b, lo_b = _mulhilo(ROUND_B, c2)
        hi_a, lo_a = _mulhilo(ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + KEY_A) & M32, (k1 + KEY_B) & M32
    x = torch.where(c0 >= 1 << 31, c0 - (1 << 32), c0)           # bitcast to int32
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.float32) * torch.tensor(SCALE, dtype=torch.float32, device=x.device)
