"""``F.scaled_dot_product_attention`` calls whose mask the program builds, traced as the softmax
program they compute, so that the region capture fuses the mask into the attention.

SDPA's own kernels (FlashAttention, cuDNN) are the fastest for plain and causal attention, so a
call without a mask, or with a mask passed in ready-made, stays SDPA. A mask computed inside the
compiled function (document ids compared, a window, padding from lengths) is what SDPA must
materialise N x N and read back; generated from its expression it costs a few integer ops per
score and skips the blocks it masks out, as FlexAttention's ``mask_mod`` does, in the spelling
models already use. A call whose rewritten program does not fuse goes back to SDPA
(``backend.fuse`` traces again without it), so the rewrite never replaces SDPA by unfused math.

The program is SDPA's math reference: ``softmax(q @ k^T * scale + mask) @ v``, a boolean mask
filling -inf where it is false, ``is_causal`` the top-left triangle, ``enable_gqa`` each key and
value head shared by ``Hq / Hkv`` consecutive query heads. A row with every key masked comes out 0,
as SDPA's math backend gives since torch 2.5 and as the kernels give.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

SDPA = torch.nn.functional.scaled_dot_product_attention
ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
# Dynamo graph ops that only re-view a mask: a mask reached through these from a graph input was
# built outside the compiled function (SDPA reads it as well as a kernel would)
VIEWS = {"getitem", "unsqueeze", "view", "reshape", "expand", "transpose", "permute", "contiguous", "to",
         "squeeze", "flatten", "expand_as", "bool"}


def sdpa_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA's result, spelled as the program the capture fuses (module doc); dropout excluded."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key, value = (x.unsqueeze(-3).expand(*x.shape[:-2], group, *x.shape[-2:]).flatten(-4, -3)
                      for x in (key, value))
    s = query @ key.transpose(-2, -1) * (1 / math.sqrt(query.shape[-1]) if scale is None else scale)
    if is_causal:
        q_idx = torch.arange(query.shape[-2], device=query.device)[:, None]
        kv_idx = torch.arange(key.shape[-2], device=query.device)[None, :]
        s = s.masked_fill(kv_idx > q_idx, float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    return torch.softmax(s, -1) @ value


def arguments(n: fx.Node) -> dict:
    """The call's arguments by name (positional or keyword)."""
    return {**dict(zip(ARGS, n.args)), **n.kwargs}


def _built_outside(mask: fx.Node) -> bool:
    """Is ``mask`` a graph input (or a parameter, a buffer) seen through views alone?"""
    while mask.op in ("call_function", "call_method") and (
            mask.op == "call_method" and mask.target in VIEWS or getattr(mask.target, "__name__", "") in VIEWS):
        mask = mask.args[0]
    return mask.op in ("placeholder", "get_attr")


def why_kept(n: fx.Node) -> str:
    """Why the SDPA call ``n`` stays SDPA ("" where its program is traced instead)."""
    a = arguments(n)
    mask, dropout = a.get("attn_mask"), a.get("dropout_p", 0.0)
    if not isinstance(mask, fx.Node):
        return "no mask built in the program: SDPA's own kernels (FlashAttention, cuDNN) serve it"
    if _built_outside(mask):
        return "its mask is passed in built: SDPA's own kernels read it (build it inside the compiled function to fuse it)"
    if not (isinstance(dropout, (int, float)) and dropout == 0):
        return "dropout_p is not 0: SDPA's own kernels serve it"
    return ""


def sdpa_calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is SDPA]


def as_math(gm: fx.GraphModule, keep: frozenset[str]) -> tuple[fx.GraphModule, list[str]]:
    """``gm`` with every SDPA call not in ``keep`` (node names) and not kept by ``why_kept``
    computing ``sdpa_math`` instead, and the names of those calls."""
    calls = [n for n in sdpa_calls(gm) if n.name not in keep and not why_kept(n)]
    if not calls:
        return gm, []
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    for n in calls:
        env[n].target = sdpa_math
    return fx.GraphModule(gm, graph), [env[n].name for n in calls]
