"""Attention variants written in plain PyTorch, one small module each.

Every module has ``attention(*inputs)`` and ``make_inputs(B, H, M, N, D, dtype, device)``.
"""
from importlib import import_module

NAMES = ["vanilla", "causal", "sliding_window", "prefix_lm", "document_mask", "alibi", "softcap",
         "gqa", "cross_attention", "key_padding"]


def load(name: str):
    return import_module(f"{__name__}.{name}")


VARIANTS = {name: load(name) for name in NAMES}
