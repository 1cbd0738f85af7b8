"""What each suite measures: the programs (plain PyTorch, with their FlexAttention and SDPA
spellings where those exist) and the cases (program, shape, mode, backends) of every suite.

    cases(suite, size) -> list[Case]          size: "full" | "quick" | "tiny"

Suites (the issue that asked for each in brackets):

    flex       the eight FlexAttention variants at three (B, N), D 64/128, H 16         [#6]
    sparsity   causal / sliding / prefix-LM / document at N 4096, 16384; Flex timed with
               its block mask cached and with create_block_mask inside the call; the
               document mask spelled with SDPA, against torch.compile's SDPA call   [#4]
    beyond     what Flex cannot express: DiffAttn and Evoformer at upstream shapes, the
               other example variants at one shape; vs torch.compile and eager         [#3]
    training   forward + backward, B=4 H=16 N=4096                                      [#5]
    decode     one query token against a KV cache, GQA 32/8 heads, D=128               [#8]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from flashlight.examples import VARIANTS

from . import decode
from . import flex_equivalents as fe

SUITES = ("flex", "sparsity", "beyond", "training", "decode")
BACKENDS = ("flashlight", "flex", "flex_mask", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient",
            "inductor", "eager", "flashlight_b", "flashlight_cg", "flex_cg")
FLASHLIGHTS = ("flashlight", "flashlight_b", "flashlight_cg")     # the backends that compile with Flashlight


@dataclass(frozen=True)
class Program:
    """One attention program and the facts a benchmark needs about it.

    Args:
        fn: the plain-PyTorch program, ``fn(*inputs)``.
        make: ``make(B, H, M, N, D, dtype, device, **extra) -> inputs``.
        flex: ``flex(inputs) -> (q, k, v, score_mod, mask_mod, kwargs, out_transform)``, or None
            when FlexAttention cannot express the program.
        sdpa: ``sdpa(inputs) -> zero-argument call`` computing the same values (None for
            inputs SDPA cannot take), or None.
        batch_dependent: the mask reads per-batch data (its block mask is built per batch).
        pair_flops: FLOPs per unmasked (q, k) pair and head as a function of D (``4 D``: one
            ``q·k`` and one ``p·v`` dot of D multiply-adds each).
        maps: attention maps per (batch, head): Evoformer runs one per MSA row S.
        unbatched: indices of inputs without a leading batch dim (not sliced for the reference).
        head_sliceable: heads are independent and every 4-D input is [B, H, ., .], so the fp32
            reference may run on the first few heads only.
        mask: the kept-pair predicate of a program Flex cannot express (for its FLOP count).
    """
    fn: Callable
    make: Callable
    flex: Callable | None = None
    sdpa: Callable | None = None
    batch_dependent: bool = False
    pair_flops: Callable[[int], float] = lambda D: 4 * D
    maps: Callable[[dict], int] = lambda extra: 1
    unbatched: tuple[int, ...] = ()
    head_sliceable: bool = False
    mask: Callable | None = None

    def mask_mod(self, inputs):
        """The predicate of kept (q, kv) pairs (FlexAttention's ``mask_mod``), None if all are."""
        return self.flex(inputs)[4] if self.flex is not None else self.mask


def _sdpa_plain(inputs):
    q, k, v = inputs
    return lambda: F.scaled_dot_product_attention(q, k, v)


def _sdpa_causal(inputs):
    q, k, v = inputs
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _sdpa_gqa(inputs):
    q, k, v = inputs
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _example(name: str, sdpa=None, head_sliceable=True, **kw) -> Program:
    mod = VARIANTS[name]
    flex = fe.FLEX.get(name)
    return Program(fn=mod.attention, make=mod.make_inputs, flex=flex, sdpa=sdpa,
                   batch_dependent=name in fe.BATCH_DEPENDENT, head_sliceable=head_sliceable, **kw)


PROGRAMS: dict[str, Program] = {
    "vanilla": _example("vanilla", sdpa=_sdpa_plain),
    "causal": _example("causal", sdpa=_sdpa_causal),
    "sliding_window": _example("sliding_window"),
    "prefix_lm": _example("prefix_lm"),
    "document_mask": _example("document_mask"),
    "sdpa_document": _example("sdpa_document"),       # the same mask built for F.scaled_dot_product_attention
    "alibi": _example("alibi", head_sliceable=False),        # slopes depend on H
    "softcap": _example("softcap"),
    "gqa": _example("gqa", sdpa=_sdpa_gqa, head_sliceable=False),
    # two softmax maps over half-width heads sharing V: 2 (2 D/2) + 2 (2 D) = 6 D per pair
    # (its output merges the heads, [B, M, H * Dv]: the reference runs all heads; input 4 is the
    # norm weight, not batched)
    "diff_attention": _example("diff_attention", pair_flops=lambda D: 6 * D, head_sliceable=False, unbatched=(4,)),
    # the same model as the reference code writes it: (w1 - λ w2) @ v, causal (half the pairs)
    "diff_transformer": _example("diff_transformer", pair_flops=lambda D: 6 * D, head_sliceable=False,
                                 unbatched=(4,), mask=lambda b, h, m, n: n <= m),
    "evoformer": Program(fn=VARIANTS["evoformer"].attention, make=VARIANTS["evoformer"].make_inputs,
                         maps=lambda extra: extra["S"]),
    "gated": _example("gated"),
    "hand_softmax": _example("hand_softmax"),
    "relu_attention": _example("relu_attention"),
    "sigmoid_attention": _example("sigmoid_attention"),
    "relative_position": _example("relative_position", unbatched=(3,), head_sliceable=False),
    "rope": _example("rope", unbatched=(3, 4)),       # cos and sin tables: [N, D]
    # causal; the program's FLOPs (the kernel computes q @ k^T once per pass: two)
    "threshold": _example("threshold", mask=lambda b, h, m, n: n <= m),
    "top_k": _example("top_k", mask=lambda b, h, m, n: n <= m),      # the program's causal FLOPs, as threshold's
    "decode_causal": Program(fn=decode.causal, make=decode.make_inputs, flex=decode.flex_causal,
                             sdpa=lambda xs: decode.sdpa_call("decode_causal", xs)),
    "decode_alibi": Program(fn=decode.alibi, make=decode.make_inputs, flex=decode.flex_alibi,
                            sdpa=lambda xs: decode.sdpa_call("decode_alibi", xs)),
    "decode_threshold": Program(fn=decode.threshold, make=decode.make_inputs),
    "decode_softpick": Program(fn=decode.softpick, make=decode.make_inputs),
    "decode_top_k": Program(fn=decode.top_k, make=decode.make_inputs),
}


@dataclass(frozen=True)
class Case:
    """One row of results: a program at one shape, in one mode, on a list of backends."""
    suite: str
    variant: str             # display name ("sliding_256")
    program: str             # key of PROGRAMS
    B: int
    H: int
    M: int
    N: int
    D: int
    mode: str = "fwd"        # "fwd" or "fwd+bwd"
    extra: tuple = ()        # make() keyword arguments, as sorted (name, value) pairs
    backends: tuple[str, ...] = field(default=BACKENDS)

    @property
    def key(self) -> tuple:
        """Identity of the measurement (suite excluded): suites sharing a case share the row."""
        return (self.variant, self.program, self.mode, self.B, self.H, self.M, self.N, self.D, self.extra)

    @property
    def shape(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.extra)
        return f"B={self.B} H={self.H} M={self.M} N={self.N} D={self.D}{extra}"


# ------------------------------------------------------------------------------ the suites
FLEX_VARIANTS = [  # display name, program, make() extras
    ("full", "vanilla", ()), ("causal", "causal", ()), ("sliding_256", "sliding_window", ()),
    ("prefix_lm_256", "prefix_lm", ()), ("document_12", "document_mask", ()), ("alibi", "alibi", ()),
    ("softcap_30", "softcap", ()), ("gqa_8", "gqa", (("group", 8),)),
]
SPARSITY_VARIANTS = ["causal", "sliding_256", "prefix_lm_256", "document_12"]
# the document mask as models spell it (SDPA with a mask built in the program): what torch.compile
# gives today (Inductor builds the mask, SDPA reads it) against the fused program and Flex
SDPA_VARIANTS = [("document_12_sdpa", "sdpa_document", ())]
OTHER_BEYOND = [(n, n, ()) for n in ["gated", "hand_softmax", "relu_attention", "sigmoid_attention",
                                      "relative_position", "rope", "threshold", "top_k"]] + [("rope_gqa_4", "rope", (("group", 4),))]
TRAINING_VARIANTS = [("causal", "causal", ()), ("alibi", "alibi", ()), ("document_12", "document_mask", ()),
                     ("diff_attention", "diff_attention", ()), ("diff_transformer", "diff_transformer", ()),
                     ("gqa_4", "gqa", (("group", 4),)),     # K/V heads shared: the dK/dV group loop
                     ("rope", "rope", ()),
                     ("rope_gqa_4", "rope", (("group", 4),))]     # Llama: RoPE, then K/V repeated
DECODE_VARIANTS = [("decode_causal", "decode_causal"), ("decode_alibi", "decode_alibi"),
                   ("decode_threshold", "decode_threshold"), ("decode_softpick", "decode_softpick"),   # two passes
                   ("decode_top_k", "decode_top_k")]

FLEX_BACKENDS = ("flashlight", "flex", "flex_mask", "sdpa_cudnn", "sdpa_flash", "inductor")
SPARSITY_BACKENDS = ("flashlight", "flex", "flex_mask")
SDPA_BACKENDS = ("flashlight", "flex", "inductor")
BEYOND_BACKENDS = ("flashlight", "inductor", "eager")
TRAINING_BACKENDS = ("flashlight", "flex", "sdpa_cudnn", "sdpa_flash", "inductor", "eager")
DECODE_BACKENDS = ("flashlight", "flex", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "inductor", "eager")

DIFF_MODEL_DIM = 2048    # DiffAttn: H = model dim / D (D = width of q, k, v per head: two halves)


@dataclass(frozen=True)
class Sizes:
    bn: list                 # (B, N) pairs, M = N
    dims: list               # head dims
    heads: int = 16
    sparsity_bn: list = None
    evo_b: list = None       # Evoformer batches, with evo_s rows of evo_r residues and 4 heads
    evo_s: int = 256
    evo_r: int = 256
    evo_c: list = None
    other_bn: list = None    # the other "beyond" variants
    other_dims: list = None
    train_bn: list = None
    train_dims: list = None
    decode_b: int = 8
    decode_h: int = 32
    decode_kv_heads: int = 8
    decode_n: list = None
    decode_d: int = 128
    diff_dim: int = DIFF_MODEL_DIM


SIZE_TABLE = {
    "full": Sizes(bn=[(16, 1024), (4, 4096), (1, 16384)], dims=[64, 128],
                  sparsity_bn=[(4, 4096), (1, 16384)], evo_b=[1, 8, 32], evo_c=[64, 128],
                  other_bn=[(4, 4096)], other_dims=[64, 128], train_bn=[(4, 4096)], train_dims=[64, 128],
                  decode_n=[4096, 32768]),
    "quick": Sizes(bn=[(4, 4096)], dims=[64, 128], sparsity_bn=[(4, 4096)], evo_b=[8], evo_c=[64, 128],
                   other_bn=[(4, 4096)], other_dims=[64], train_bn=[(4, 4096)], train_dims=[64],
                   decode_n=[4096, 32768]),
    # CPU plumbing through Triton's interpreter: lengths not a multiple of the block size
    "tiny": Sizes(bn=[(2, 40)], dims=[32], heads=2, sparsity_bn=[(2, 40)], evo_b=[1], evo_s=2, evo_r=24,
                  evo_c=[16], other_bn=[(2, 40)], other_dims=[32], train_bn=[(2, 40)], train_dims=[32],
                  decode_b=2, decode_h=4, decode_kv_heads=2, decode_n=[72], decode_d=32, diff_dim=64),
}


def _grid(suite, variants, bn, dims, H, backends, mode="fwd"):
    return [Case(suite, name, prog, B, H, N, N, D, mode, extra, backends)
            for (B, N) in bn for D in dims for (name, prog, extra) in variants]


def cases(suite: str, size: str = "full") -> list[Case]:
    s = SIZE_TABLE[size]
    if suite == "flex":
        return _grid("flex", FLEX_VARIANTS, s.bn, s.dims, s.heads, FLEX_BACKENDS)
    if suite == "sparsity":
        chosen = [v for v in FLEX_VARIANTS if v[0] in SPARSITY_VARIANTS]
        return (_grid("sparsity", chosen, s.sparsity_bn, s.dims, s.heads, SPARSITY_BACKENDS)
                + _grid("sparsity", SDPA_VARIANTS, s.sparsity_bn, s.dims, s.heads, SDPA_BACKENDS))
    if suite == "beyond":
        diff = [Case("beyond", name, name, B, max(1, s.diff_dim // D), N, N, D, backends=BEYOND_BACKENDS)
                for (B, N) in s.bn for D in s.dims for name in ("diff_attention", "diff_transformer")]
        evo = [Case("beyond", "evoformer", "evoformer", B, 4 if size != "tiny" else 2, s.evo_r, s.evo_r, C,
                    extra=(("S", s.evo_s),), backends=BEYOND_BACKENDS) for B in s.evo_b for C in s.evo_c]
        others = _grid("beyond", OTHER_BEYOND, s.other_bn, s.other_dims, s.heads, BEYOND_BACKENDS)
        return diff + evo + others
    if suite == "training":
        return _grid("training", TRAINING_VARIANTS, s.train_bn, s.train_dims, s.heads, TRAINING_BACKENDS,
                     mode="fwd+bwd")
    if suite == "decode":
        return [Case("decode", name, prog, s.decode_b, s.decode_h, 1, N, s.decode_d,
                     extra=(("kv_heads", s.decode_kv_heads),), backends=DECODE_BACKENDS)
                for N in s.decode_n for (name, prog) in DECODE_VARIANTS]
    raise KeyError(f"unknown suite {suite!r}; known: {', '.join(SUITES)}")


def make_inputs(case: Case, dtype: torch.dtype, device: str):
    prog = PROGRAMS[case.program]
    return prog.make(case.B, case.H, M=case.M, N=case.N, D=case.D, dtype=dtype, device=device,
                     **dict(case.extra))
