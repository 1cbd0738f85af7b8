"""Attention variants written in plain PyTorch, one small module each.

Every module has ``attention(*inputs)`` and ``make_inputs(B, H, M, N, D, dtype, device)``.
"""
from importlib import import_module

# FlexAttention can express these ...
FLEX_NAMES = ["vanilla", "causal", "sliding_window", "prefix_lm", "document_mask", "alibi", "softcap",
              "gqa", "cross_attention", "key_padding", "sdpa_document"]
# ... and these it cannot (several softmaxes, post-softmax ops, epilogues, no softmax at all,
# a sink column concatenated to the scores, squared distances between 3-D points, the heads
# merged into the output's rows by the kernel's store, rotary embeddings applied to q and k, a
# rectified softmax whose output depends on its max shift, stick-breaking's sums over the keys
# after each key, probabilities dropped below a threshold and renormalised, each row's top-k
# scores alone).
BEYOND_NAMES = ["diff_attention", "diff_transformer", "gated", "hand_softmax", "relu_attention",
                "sigmoid_attention", "evoformer", "relative_position", "sinks", "sinks_sliding_window", "ipa",
                "post_softmax", "merged_heads", "rope", "softpick", "stick_breaking", "threshold", "top_k"]
# ... and decoding (few queries against a long KV cache: split-KV kernels).
DECODE_NAMES = ["decode_gqa", "paged_decode"]
NAMES = FLEX_NAMES + BEYOND_NAMES + DECODE_NAMES


def load(name: str):
    return import_module(f"{__name__}.{name}")


VARIANTS = {name: load(name) for name in NAMES}
