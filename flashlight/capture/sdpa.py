"""``scaled_dot_product_attention`` calls whose mask the program builds, decomposed into the
softmax program they compute, so that the region capture fuses the mask into the attention.

SDPA's own kernels (FlashAttention, cuDNN) are the fastest for plain and causal attention, so a
call without a mask, or with a mask passed in ready-made, stays SDPA. A mask computed inside the
compiled function (document ids compared, a window, padding from lengths) is what SDPA must
materialise N x N and read back; generated from its expression it costs a few integer ops per
score and skips the blocks it masks out, as FlexAttention's ``mask_mod`` does, in the spelling
models already use. The rewrite works on the ATen graph (``aten.scaled_dot_product_attention``),
so it also reaches the SDPA call inside ``nn.MultiheadAttention`` and the ``nn.Transformer``
layers, which Dynamo keeps as one call. A call whose decomposition does not fuse whole is traced
again as SDPA (``backend.fuse``), so the rewrite never replaces SDPA by unfused math.

The program is SDPA's math reference: ``softmax(q @ k^T * scale + mask) @ v``, a boolean mask
filling -inf where it is false, ``is_causal`` the top-left triangle, ``enable_gqa`` each key and
value head shared by ``Hq / Hkv`` consecutive query heads. A row with every key masked comes out
0, as SDPA's math backend gives since torch 2.5 and as the kernels give.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.fx as fx

from .. import _compat

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")      # then keyword-only: scale, enable_gqa
# ops that only re-view or re-type a mask: a mask reached through them from a graph input was
# built outside the compiled function (SDPA reads it as well as a kernel would)
VIEWS = {aten.view, aten.reshape, aten._unsafe_view, aten.expand, aten.transpose, aten.permute, aten.unsqueeze,
         aten.squeeze, aten.slice, aten.select, aten.alias, aten.detach, aten.t, aten._to_copy, aten.to,
         aten.contiguous, aten.clone}
TAG = "flashlight_sdpa"         # node meta: the SDPA call a decomposed node computes part of
OP = "scaled_dot_product_attention"     # the op of a Fallback for a call left to SDPA (explain lists them apart)


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


def sdpa_calls(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is SDPA]


def _built_outside(mask: fx.Node) -> bool:
    """Is ``mask`` a graph input (a parameter, a buffer) seen through views and casts alone?"""
    while mask.op == "call_function" and getattr(mask.target, "overloadpacket", None) in VIEWS:
        mask = mask.args[0]
    return mask.op in ("placeholder", "get_attr")


def why_kept(n: fx.Node) -> str:
    """Why the SDPA call ``n`` stays SDPA ("" where it is decomposed)."""
    a = arguments(n)
    mask, dropout = a.get("attn_mask"), a.get("dropout_p", 0.0)
    if not isinstance(mask, fx.Node):
        return "no mask built in the program: SDPA's own kernels (FlashAttention, cuDNN) serve it"
    if _built_outside(mask):
        return ("its mask is passed in built: SDPA's own kernels read it (build it inside the compiled function "
                "to fuse it)")
    if not (isinstance(dropout, (int, float)) and dropout == 0):
        return "dropout_p is not 0: SDPA's own kernels serve it"
    return ""


def decompose(gm: fx.GraphModule, keep: frozenset[str]) -> list[str]:
    """Replace, in place, every SDPA call of ``gm`` not named in ``keep`` and not kept by
    ``why_kept`` by the ATen graph of ``sdpa_math`` traced on its arguments' fake values (each
    inlined node tagged ``TAG`` with the call's name, and given its stack trace); returns the
    names of the calls replaced."""
    done = []
    for n in sdpa_calls(gm.graph):
        if n.name in keep or why_kept(n):
            continue
        a = arguments(n)
        tensors = [a[k] for k in ("query", "key", "value", "attn_mask")]       # the mask is a node (why_kept)
        static = {k: a[k] for k in ("is_causal", "scale", "enable_gqa") if k in a}
        sub = _compat.trace_on_fakes(functools.partial(sdpa_math, **static), [x.meta["val"] for x in tensors])
        env = dict(zip([p for p in sub.graph.nodes if p.op == "placeholder"], tensors))
        with gm.graph.inserting_before(n):
            out = gm.graph.graph_copy(sub.graph, env)
        for new in env.values():
            if new not in tensors:
                new.meta[TAG] = n.name
                new.meta.setdefault("stack_trace", n.meta.get("stack_trace"))
        n.replace_all_uses_with(out)
        done.append(n.name)
        gm.graph.erase_node(n)
    if done:
        gm.recompile()
    return done
