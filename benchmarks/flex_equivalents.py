"""FlexAttention spellings of the ten ``flashlight.examples`` variants, for benchmarking.

    FLEX[name](inputs) -> (q, k, v, score_mod | None, mask_mod | None, kwargs, out_transform)

``inputs`` is the tuple returned by ``VARIANTS[name].make_inputs(...)``; ``q, k, v`` are BHSD;
``out_transform`` maps flex's output to the layout ``VARIANTS[name].attention`` returns.

    bm = make_block_mask(name, inputs)      # BlockMask, or None for unmasked variants
    out = run_flex(name, inputs, bm)        # same values as VARIANTS[name].attention(*inputs)

Only public torch APIs (``torch.nn.attention.flex_attention``) are used; nothing here touches
CUDA at import time.
"""
from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from flashlight.examples import prefix_lm as _prefix_lm
from flashlight.examples import sliding_window as _sliding_window
from flashlight.examples import softcap as _softcap

# Compiled once; each distinct score_mod / mask_mod still traces its own graph on first use.
flex = torch.compile(flex_attention, dynamic=False)

WINDOW = _sliding_window.WINDOW
PREFIX = _prefix_lm.PREFIX
CAP = _softcap.CAP


def _identity(out):
    return out


# ---------------------------------------------------------------------------------- mask mods
def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window_mask(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < WINDOW)


def prefix_lm_mask(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIX) | (kv_idx <= q_idx)


def document_mask_mod(doc_ids):
    def mask(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (kv_idx <= q_idx)
    return mask


def key_padding_mask_mod(key_valid):
    def mask(b, h, q_idx, kv_idx):
        return key_valid[b, kv_idx]
    return mask


# --------------------------------------------------------------------------------- score mods
def softcap_score(score, b, h, q_idx, kv_idx):
    return CAP * torch.tanh(score / CAP)


_SLOPES: dict = {}


def alibi_slopes(H: int, device) -> torch.Tensor:
    """2 ** (-8 (h + 1) / H), float32, cached per (H, device) so timed calls allocate nothing."""
    key = (H, str(device))
    if key not in _SLOPES:
        _SLOPES[key] = 2.0 ** (-8.0 * torch.arange(1, H + 1, device=device, dtype=torch.float32) / H)
    return _SLOPES[key]


def alibi_score_mod(slopes):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return score_mod


# ------------------------------------------------------------------------------ per variant
def _vanilla(inputs):
    q, k, v = inputs
    return q, k, v, None, None, {}, _identity


def _causal(inputs):
    q, k, v = inputs
    return q, k, v, None, causal_mask, {}, _identity


def _sliding_window(inputs):
    q, k, v = inputs
    return q, k, v, None, sliding_window_mask, {}, _identity


def _prefix_lm(inputs):
    q, k, v = inputs
    return q, k, v, None, prefix_lm_mask, {}, _identity


def _document_mask(inputs):
    q, k, v, doc_ids = inputs
    return q, k, v, None, document_mask_mod(doc_ids), {}, _identity


def _alibi(inputs):
    q, k, v = inputs
    return q, k, v, alibi_score_mod(alibi_slopes(q.shape[1], q.device)), causal_mask, {}, _identity


def _softcap_fn(inputs):
    q, k, v = inputs
    return q, k, v, softcap_score, None, {}, _identity


def _gqa(inputs):
    q, k, v = inputs
    return q, k, v, None, None, {"enable_gqa": True}, _identity


def _cross_attention(inputs):
    # attention() takes BSHD ([B, S, H, D]) and returns einsum "bhmd", i.e. BHSD [B, H, M, D],
    # which is already flex's output layout: transpose the inputs only.
    q, k, v = inputs
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, {}, _identity


def _key_padding(inputs):
    q, k, v, key_valid = inputs
    return q, k, v, None, key_padding_mask_mod(key_valid), {}, _identity


FLEX = {
    "vanilla": _vanilla,
    "causal": _causal,
    "sliding_window": _sliding_window,
    "prefix_lm": _prefix_lm,
    "document_mask": _document_mask,
    "sdpa_document": _document_mask,        # the same mask, spelled with SDPA
    "alibi": _alibi,
    "softcap": _softcap_fn,
    "gqa": _gqa,
    "cross_attention": _cross_attention,
    "key_padding": _key_padding,
}

# Masks that read per-batch data (block mask built with B=batch); all others use B=H=None.
BATCH_DEPENDENT = {"document_mask", "key_padding", "sdpa_document"}


def make_block_mask(name: str, inputs):
    """The BlockMask for ``name`` on these inputs, or None when the variant has no mask."""
    q, k, _v, _score_mod, mask_mod, _kw, _out = FLEX[name](inputs)
    if mask_mod is None:
        return None
    B = q.shape[0] if name in BATCH_DEPENDENT else None
    return create_block_mask(mask_mod, B=B, H=None, Q_LEN=q.shape[-2], KV_LEN=k.shape[-2],
                             device=q.device)


def run_flex(name: str, inputs, block_mask=None, fn=None):
    """Compiled flex_attention for ``name``; ``block_mask`` from ``make_block_mask``.
    ``fn`` overrides the flex callable (e.g. eager ``flex_attention`` for CPU checks)."""
    q, k, v, score_mod, _mask_mod, kwargs, out_transform = FLEX[name](inputs)
    out = (fn or flex)(q, k, v, score_mod=score_mod, block_mask=block_mask, **kwargs)
    return out_transform(out)


def flex_call(name: str, *inputs, fn=None):
    """One-shot convenience: build the block mask and run flex on ``attention``'s inputs."""
    return run_flex(name, inputs, make_block_mask(name, inputs), fn=fn)
