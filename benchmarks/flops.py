"""FLOPs of the useful (unmasked) work of an attention call.

A (query, key) pair is *unmasked* when the program does not replace its score with -inf. Forward
FLOPs of one attention map are ``2 * D_qk + 2 * D_v`` per unmasked pair (the ``q·k`` dot and the
``p·v`` product, a multiply and an add each), i.e. ``4 * D`` when ``D_qk = D_v = D``:

    fwd      = flops_per_pair * maps * pairs          (maps = batch * heads, pairs per map)
    fwd+bwd  = 3.5 * fwd                              (backward = 2.5 * forward: FlashAttention's count)

Pairs are counted exactly by evaluating the variant's mask predicate (FlexAttention's
``mask_mod`` signature) on the device, ``CHUNK`` elements at a time: never an N x N tensor.
"""
from __future__ import annotations

import torch

CHUNK = 1 << 24          # mask elements evaluated at once
BWD_FACTOR = 2.5         # backward FLOPs / forward FLOPs (dS, dP, dQ, dK, dV: five matmuls of two)


def unmasked_pairs(mask_mod, B: int, M: int, N: int, device="cpu", batch_dependent: bool = False) -> int:
    """Number of (b, q, kv) triples with ``mask_mod(b, 0, q, kv)`` true, summed over the batch.

    Args:
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool tensor``, broadcasting over index tensors;
            None means every pair is kept.
        batch_dependent: the mask reads per-batch data (document ids); otherwise batch 0 is
            counted once and multiplied by B.
    """
    if mask_mod is None:
        return B * M * N
    kv = torch.arange(N, device=device)[None, :]
    rows = max(1, CHUNK // max(N, 1))
    total = 0
    for b in range(B if batch_dependent else 1):
        bb = torch.tensor(b, device=device)
        h = torch.tensor(0, device=device)
        for s in range(0, M, rows):
            q = torch.arange(s, min(s + rows, M), device=device)[:, None]
            total += int(mask_mod(bb, h, q, kv).expand(q.shape[0], N).sum())
    return total if batch_dependent else total * B


def forward_flops(pairs_per_head: int, heads: int, flops_per_pair: float) -> float:
    """FLOPs of one forward call: ``flops_per_pair`` (e.g. ``4 * D``) for each unmasked pair of
    each head (``pairs_per_head`` already sums over the batch)."""
    return float(flops_per_pair) * heads * pairs_per_head


def total_flops(fwd: float, mode: str) -> float:
    return fwd * (1.0 + BWD_FACTOR) if mode == "fwd+bwd" else fwd


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12
