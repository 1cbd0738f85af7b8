"""Random attention programs from a small grammar, compiled with flashlight and checked against
float64 eager. ``python -m flashlight.fuzz --count 2000 --seed 0`` (set TRITON_INTERPRET=1 on a
machine without a GPU so the generated kernels themselves run).

Each program draws: shapes (primes included), layout (BHSD or BSHD), where the scale goes, GQA
and its spelling (K and V of one head left to the products' broadcasting among them), a mask
(none, causal, window, prefix, document ids, key padding, a boolean tensor) and its fill value
(-inf, -1e9, finfo.min), a bias of a random broadcast shape, a softcap,
the softmax spelling (a hand-written one's shift as ``max(...).values``, or changed: softmax_1's
clamp and +1, an epsilon, softpick), the scores less a cumulative sum over the keys (prefix,
flipped, or a product with a triangle of ones), a second softmax map over the same V combined with the first (DiffAttn's
difference with a learned λ, or a mean), an epilogue (a head-merging reshape, an RMSNorm, a
sigmoid gate), and a learned per-head sink logit concatenated to the scores (gpt-oss); or the map
spelled with ``F.scaled_dot_product_attention``, its bias and mask as ``attn_mask``; q, k and v
as slices of one packed projection; positions on q and k (rotary embeddings, or learned tables
added to them); the products as matmuls or einsums (with or without ``...``), and a second
score product over its own dims added (decoupled RoPE), and the probabilities thresholded or
log1p'd and renormalised, the hand-written softmax's shift detached. The program is plain
PyTorch, built from closures.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import math
import random
import sys
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from .examples.rope import rotate_half


@dataclass
class Program:
    desc: str
    fn: object
    args: tuple
    grads: bool = False
    notes: list = field(default_factory=list)
    oracle: object = None       # the float64 reference's program, when it must differ from ``fn``


KTH_SPELLINGS = {      # a row's k-th largest score, as models write it
    "topk": lambda s, k: s.topk(k, dim=-1).values[..., -1:],
    "kthvalue": lambda s, k: s.kthvalue(s.shape[-1] + 1 - k, -1, keepdim=True).values,
    "sort": lambda s, k: s.sort(-1, descending=True).values[..., k - 1:k],
    "amin": lambda s, k: s.topk(k, dim=-1).values.amin(-1, keepdim=True),
}


def make_program(rng: random.Random, sizes: dict | None = None, stops: bool = True, scans: bool = True,
                 top_k: bool = True) -> Program:
    """A random program. ``sizes`` overrides the drawn sizes (``B``, ``H``, ``M``, ``N``, ``D``,
    ``Dv``; drawn all the same, so a seed keeps the rest of its program): the Gluon fuzz asks for
    whole blocks and head dims 64 / 128. ``stops=False``: no stopped gradient (``detach()``, a
    ``no_grad`` term), which only the capture sees (the Gluon fuzz compares kernels); ``scans=False``:
    no cumulative sum over the keys and no renormalised probabilities (no Gluon kernel computes
    a scan or a second pass); ``top_k=False``: no top-k threshold (drawn all the same; the
    interpreter's sorts are slow, so CI's fixed seeds leave it to ``tests/test_topk.py``)."""
    B, H = rng.choice([1, 2]), rng.choice([1, 2, 4])
    M = rng.choice([1, 2, 5, 13, 16, 31, 37, 64, 70])
    N = rng.choice([M, M, 3, 17, 29, 48, 61, 83])
    D = rng.choice([8, 16, 24, 32, 48, 80])   # 48, 80: QK^T in power-of-two pieces
    Dv = rng.choice([D, D, 16])
    if sizes:
        B, H, M, N, D, Dv = (sizes.get(k, x) for k, x in zip("B H M N D Dv".split(), (B, H, M, N, D, Dv)))
    gqa = rng.choice(["none", "none", "expand", "repeat_interleave"]) if H > 1 else "none"
    Hkv = 1 if gqa != "none" else H
    bshd = rng.random() < 0.3
    scale_at = rng.choice(["scores_mul", "scores_div", "q", "none"])
    mask = rng.choice(["none", "causal", "window", "prefix", "doc", "padding", "tensor"])
    fill = rng.choice([float("-inf"), float("-inf"), -1e9, torch.finfo(torch.float32).min])
    bias = rng.choice(["none", "none", "head_col", "full", "row", "alibi"])
    softcap = rng.random() < 0.2
    spelling = rng.choice(["torch", "F_fp32", "method", "hand"])
    window, prefix = rng.randint(1, 20), rng.randint(0, 20)
    epilogue = rng.choice(["none", "none", "none", "merge_heads", "rmsnorm", "gate"])

    def rand(*shape):
        return torch.randn(*shape)

    q = rand(B, M, H, D).transpose(1, 2) if bshd else rand(B, H, M, D)
    k = rand(B, N, Hkv, D).transpose(1, 2) if bshd else rand(B, Hkv, N, D)
    v = rand(B, N, Hkv, Dv).transpose(1, 2) if bshd else rand(B, Hkv, N, Dv)
    extra = {}
    if mask == "doc":
        extra["ids"] = torch.sort(torch.randint(0, rng.randint(1, 5), (B, max(M, N))), dim=-1).values
    if mask == "padding":
        lengths = [rng.randint(0, N) for _ in range(B)]
        extra["valid"] = torch.arange(N)[None, :] < torch.tensor(lengths)[:, None]
    if mask == "tensor":
        extra["keep"] = torch.rand(M, N) > 0.3
    if bias == "head_col":
        extra["bias"] = rand(H, 1, N)
    elif bias == "full":
        extra["bias"] = rand(B, 1, M, N)
    elif bias == "row":
        extra["bias"] = rand(M, 1)
    if epilogue == "rmsnorm":
        extra["norm_w"] = 1 + 0.1 * rand(Dv)
    elif epilogue == "gate":
        extra["gate"] = rand(B, H, M, Dv)
    names = list(extra)

    def scores(a, b):                       # a @ b^T in the drawn spelling
        if contract == "einsum":
            return torch.einsum("bhmd,bhnd->bhmn", a, b)
        if contract == "ellipsis":
            return torch.einsum("... m d, ... n d -> ... m n", a, b)
        return a @ b.transpose(-2, -1)

    def apply(p, v):                        # p @ v in the drawn spelling
        if contract == "einsum":
            return torch.einsum("bhmn,bhnd->bhmd", p, v)
        if contract == "ellipsis":
            return torch.einsum("... m n, ... n d -> ... m d", p, v)
        return p @ v

    def program(q, k, v, *xs, oracle=False):
        ex = dict(zip(names, xs))
        if stop in ("k", "v"):              # a stopped gradient: no gradient reaches it
            k, v = (k.detach(), v) if stop == "k" else (k, v.detach())
        if position == "rope":              # rotary embeddings on q and k (at the K/V heads: Llama's order)
            q, k = (x * ex["cos"][:n] + rotate_half(x) * ex["sin"][:n] for x, n in ((q, M), (k, N)))
        elif position == "table":           # learned absolute positions added to q and k
            q, k = q + ex["pos_q"], k + ex["pos_k"]
        if kv_broadcast:                    # K and V of one head, broadcast by the products
            pass
        elif gqa == "expand":
            k = k[:, :, None].expand(B, Hkv, H, N, D).reshape(B, H, N, D)
            v = v[:, :, None].expand(B, Hkv, H, N, Dv).reshape(B, H, N, Dv)
        elif gqa == "repeat_interleave":
            k, v = k.repeat_interleave(H, dim=1), v.repeat_interleave(H, dim=1)
        if norm != "none":                  # QK-norm: operands that divide by a loaded norm
            q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
            if norm == "qkv":
                v = v / v.norm(dim=-1, keepdim=True)
        scale = D ** -0.5
        if scale_at == "q":
            q = q * scale
        s = scores(q, k)
        if "qr" in ex:                      # a second product over its own dims (decoupled RoPE)
            s = s + scores(ex["qr"], ex["kr"]) * 0.3
        if scale_at == "scores_mul":
            s = s * scale
        elif scale_at == "scores_div":
            s = s / math.sqrt(D)
        if softcap:
            s = 20.0 * torch.tanh(s / 20.0)
        if nan_scores:                      # the DIFF Transformer's nan_to_num of the scores
            s = torch.nan_to_num(s)
        if stop == "scores":                # half the scores' gradient stopped
            s = 0.5 * (s + s.detach())
        elif stop == "no_grad":             # a score-sized term computed without gradient
            with torch.no_grad():
                term = torch.tanh(scores(q, k) * 0.1)
            s = s + term
        qi = torch.arange(M)[:, None]
        ki = torch.arange(N)[None, :]
        bias_t = None
        if bias == "alibi":
            slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1) / H)
            bias_t = (slopes[:, None, None] * (ki - qi)).to(s.dtype)     # fp16 programs stay fp16
        elif bias != "none":
            bias_t = ex["bias"]
        if bias_t is not None and not sdpa:
            s = s + bias_t
        keep = {
            "none": None,
            "causal": torch.ones(M, N, dtype=torch.bool).tril(),
            "window": (ki <= qi) & (qi - ki < window),
            "prefix": (ki < prefix) | (ki <= qi),
            "doc": (ex["ids"][:, None, :M, None] == ex["ids"][:, None, None, :N]) if "ids" in ex else None,
            "padding": ex["valid"][:, None, None, :] if "valid" in ex else None,
            "tensor": ex.get("keep"),
        }[mask]
        if scan != "none":      # minus sums over the keys before / after each key (a scan), 0 where masked
            g = torch.sigmoid(s) * 0.1
            g = g if keep is None else g.masked_fill(~keep, 0.0)
            s = s - (g.cumsum(-1) if scan == "prefix" else g.flip(-1).cumsum(-1).flip(-1) if scan == "suffix"
                     else g @ torch.ones(N, N, dtype=g.dtype).tril(-1))
        if sdpa:        # the same map through F.scaled_dot_product_attention: bias and mask as attn_mask
            # a float mask is added to the scores: a finite fill (-1e9) would cancel them in fp32
            # (eager's own fp32 result is 1e-1 off float64 there), so it masks with -inf
            attn_mask = keep if bias_t is None else bias_t if keep is None else \
                torch.where(keep, bias_t, float("-inf"))
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                               scale=scale if scale_at in ("scores_mul", "scores_div") else 1.0)
            if oracle and second != "none":
                o = o.nan_to_num(0.0)
        else:
            if keep is not None:
                s = s.masked_fill(~keep, fill) if rng_fill_style else torch.where(keep, s, fill)
            if k_top:                       # each row's top-k scores alone: a pass keeps the k-th largest
                s = s.masked_fill(s < KTH_SPELLINGS[k_spelling](s, min(k_top, N)), fill)
            if sink:                        # one more column per row, dropped after the softmax
                s = torch.cat([s, ex["sinks"].view(1, H, 1, 1).expand(B, H, M, 1)], dim=-1)
            if spelling == "torch":
                p = torch.softmax(s, dim=-1)
            elif spelling == "F_fp32":
                p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
            elif spelling == "method":
                p = s.softmax(-1)
            else:       # the shift as drawn (``shift``): softmax_1, an epsilon and softpick change the map
                m = torch.max(s, -1, keepdim=True).values if shift == "max_values" else s.amax(-1, keepdim=True)
                m = m.clamp(min=0) if shift == "softmax_one" else m
                m = m.detach() if detach_shift else m       # as many codebases stabilise it
                e = torch.exp(s - m)
                if shift == "softpick":
                    e = e - torch.exp(-m)
                    p = F.relu(e) / (torch.where(s.isfinite(), e.abs(), 0).sum(-1, keepdim=True) + 1e-8)
                else:
                    p = e / (e.sum(-1, keepdim=True) + {"softmax_one": torch.exp(-m), "eps": 0.3}.get(shift, 0.0))
            if sink:
                p = p[..., :N]
            if post != "none":              # the probabilities changed and renormalised: a later pass reads l
                w = {"relu": lambda: F.relu(p - 0.3 / N), "hard": lambda: torch.where(p > 0.3 / N, p, 0.0),
                     "log1p": lambda: torch.log1p(p)}[post]()
                p = w / w.sum(-1, keepdim=True).clamp_min(1e-6)
            if oracle and second != "none":
                p = p.nan_to_num(0.0)       # a fully masked row of this map adds 0, not NaN
            o = apply(p, v)
        if second != "none":                # a second, causal map at another temperature, same V
            s2 = scores(q, k) * (0.5 * D ** -0.5)
            p2 = torch.softmax(s2.masked_fill(ki > qi, float("-inf")), dim=-1)
            if combined:                    # the maps mixed before the product (the DIFF Transformer's code)
                o = apply((p - ex["lam"] * p2) if second == "difference" else 0.5 * (p + p2), v)
            else:
                o = o - ex["lam"] * apply(p2, v) if second == "difference" else 0.5 * (o + apply(p2, v))
        if epilogue == "merge_heads":       # [B, M, H * Dv], a permuted store
            return o.transpose(1, 2).reshape(B, M, H * Dv)
        if epilogue == "rmsnorm":           # a dv-sum in the epilogue
            return o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * ex["norm_w"]
        if epilogue == "gate":
            return o * torch.sigmoid(ex["gate"])
        return o

    rng_fill_style = rng.random() < 0.5
    grads = rng.random() < 0.15
    second = rng.choice(["none"] * 6 + ["difference", "mean"])     # drawn last: earlier seeds keep their programs
    if second == "difference":
        extra["lam"] = torch.tensor(rng.uniform(0.2, 0.8))
        names.append("lam")
    sink = rng.random() < 0.15      # drawn after everything else, for the same reason
    if sink:
        extra["sinks"] = rand(H)
        names.append("sinks")
    stop = rng.choice(["none"] * 8 + ["k", "v", "scores", "no_grad"])    # drawn last, likewise
    stop = stop if stops else "none"
    # SDPA's spelling of the same map (drawn last, likewise): where it can say the program
    sdpa = rng.random() < 0.25 and not softcap and not sink and stop not in ("scores", "no_grad")
    grads = grads or stop != "none"
    # the whole program under torch.utils.checkpoint (drawn last, likewise): its body fuses apart
    checkpointed = rng.random() < 0.15
    # or only q's (exact) scaling by 1 under a checkpoint, the attention between checkpoints
    around = not checkpointed and rng.random() < 0.15
    norm = rng.choice(["none"] * 8 + ["qk", "qkv"])      # drawn last, likewise
    # q, k and v as slices of one packed projection [B, M, (H·D | Hkv·D | Hkv·Dv)] (drawn last, likewise)
    packed = M == N and rng.random() < 0.15
    # the two maps mixed before their product with v; nan_to_num of the scores (drawn last, likewise)
    combined = second != "none" and not sdpa and rng.random() < 0.5
    nan_scores = rng.random() < 0.1
    # positions on q and k (drawn last, likewise): the operands are computed from several tiles
    position = rng.choice(["none"] * 6 + ["rope", "table"])
    if position == "rope":
        angles = torch.arange(max(M, N))[:, None] * 10000.0 ** -(torch.arange(0, D, 2) / D)
        angles = torch.cat([angles, angles], -1)
        extra["cos"], extra["sin"] = angles.cos(), angles.sin()
    elif position == "table":
        extra["pos_q"], extra["pos_k"] = 0.5 * rand(M, D), 0.5 * rand(N, D)
    names += [n for n in ("cos", "sin", "pos_q", "pos_k") if n in extra]
    # the products as einsums, with or without ellipses; K and V of one head left to the products'
    # broadcasting; a second score product over its own dims, added (drawn last, likewise)
    contract = rng.choice(["matmul"] * 4 + ["einsum", "ellipsis"])
    kv_broadcast = Hkv == 1 and H > 1 and not sdpa and rng.random() < 0.4
    if not sdpa and not sizes and rng.random() < 0.15:      # not where the caller fixed the head dims
        R = rng.choice([4, 8, 12])
        extra["qr"], extra["kr"] = rand(B, H, M, R), rand(B, H if not kv_broadcast else 1, N, R)
        names += ["qr", "kr"]
    # the hand-written softmax's shift (drawn last, likewise): torch.max(...).values, softmax_1's
    # clamped shift and +1, an epsilon in the denominator (the shift takes a gradient), softpick
    shift = rng.choice(["amax"] * 4 + ["max_values", "softmax_one", "eps", "softpick"]) if spelling == "hand" else "amax"
    # the scores less a cumulative sum over the keys: prefix, suffix (flipped), or a product with
    # tril(ones) (drawn last, likewise)
    scan = rng.choice(["none"] * 6 + ["prefix", "suffix", "triangle"])
    scan = scan if scans and not sdpa else "none"
    # the probabilities thresholded (relu(p - t), or where(p > t, p, 0)) or log1p'd, then
    # renormalised: a pass over the keys reads the softmax's sum (drawn last, likewise)
    post = rng.choice(["none"] * 6 + ["relu", "hard", "log1p"])
    post = post if scans and not sdpa else "none"
    # the hand-written softmax's shift detached (drawn last, likewise): it takes no gradient
    detach_shift = spelling == "hand" and rng.random() < 0.3
    # top-k attention's threshold, s.topk(k).values[..., -1:] (drawn last, likewise)
    k_top = rng.choice([0] * 7 + [3, 8, 20])
    k_top = k_top if scans and top_k and not sdpa else 0
    # the threshold's spelling (drawn last, likewise)
    k_spelling = rng.choice(["topk"] * 3 + sorted(set(KTH_SPELLINGS) - {"topk"}))
    desc = (f"B={B} H={H} Hkv={Hkv} M={M} N={N} D={D} Dv={Dv} gqa={gqa} bshd={bshd} scale={scale_at} "
            f"mask={mask} fill={fill} bias={bias} softcap={softcap} softmax={spelling} "
            f"window={window} prefix={prefix} epilogue={epilogue} second={second} sink={sink} stop={stop} "
            f"sdpa={sdpa} checkpointed={checkpointed} around={around} norm={norm} packed={packed} "
            f"combined={combined} nan_scores={nan_scores} position={position} contract={contract} "
            f"kv_broadcast={kv_broadcast} rotary_part={'qr' in extra} shift={shift} scan={scan} post={post} "
            f"detach_shift={detach_shift} top_k={k_top}" + (f" via {k_spelling}" if k_top else ""))
    fn = (lambda *xs: torch.utils.checkpoint.checkpoint(program, *xs, use_reentrant=False)) if checkpointed else \
        (lambda q, *xs: program(torch.utils.checkpoint.checkpoint(torch.mul, q, 1.0, use_reentrant=False), *xs)) \
        if around else program
    if not packed:
        return Program(desc, fn, (q, k, v, *extra.values()), grads=grads, oracle=lambda *xs: program(*xs, oracle=True))
    widths, heads = (H * D, Hkv * D, Hkv * Dv), ((H, D), (Hkv, D), (Hkv, Dv))

    def unpack(qkv):
        return [x.unflatten(-1, hd).transpose(1, 2) for x, hd in zip(qkv.split(widths, -1), heads)]
    return Program(desc, lambda qkv, *xs: fn(*unpack(qkv), *xs), (rand(B, M, sum(widths)), *extra.values()),
                   grads=grads, oracle=lambda qkv, *xs: program(*unpack(qkv), *xs, oracle=True))


def reference(p: Program) -> torch.Tensor:
    out = (p.oracle or p.fn)(*(x.double() if x.is_floating_point() else x for x in p.args))
    return torch.nan_to_num(out, nan=0.0)


def check(p: Program, tol: float = 1e-3) -> tuple[bool, bool, str]:
    """(ok, fused, message)."""
    import flashlight
    from flashlight.testing import rel_error
    torch.compiler.reset()
    report = flashlight.explain(p.fn, *p.args)
    torch.compiler.reset()
    out = torch.compile(p.fn, backend="flashlight")(*p.args)
    ref = reference(p)
    # rows where every key is masked by a finite fill: eager and flashlight both average; with
    # -inf, the reference's NaN is 0, as a fused region gives, and an unfused program is eager's
    # own NaN there (seed 3202 #62)
    err = rel_error(out if report.regions else out.nan_to_num(0.0), ref)
    msg = f"err={err:.2e}"
    ok = err < tol
    if ok and p.grads:
        leaves = [x.detach().requires_grad_() if x.is_floating_point() else x for x in p.args]
        g = torch.autograd.grad(torch.compile(p.fn, backend="flashlight")(*leaves).sum(),
                                [x for x in leaves if x.requires_grad], allow_unused=True, materialize_grads=True)
        leaves64 = [x.detach().double().requires_grad_() if x.is_floating_point() else x for x in p.args]
        g64 = torch.autograd.grad((p.oracle or p.fn)(*leaves64).nan_to_num(0).sum(),
                                  [x for x in leaves64 if x.requires_grad], allow_unused=True, materialize_grads=True)
        pairs = list(zip(g, g64))       # an unused input's gradient is zeros on both sides
        if any(b.isnan().any() for _, b in pairs):
            return ok, bool(report.regions), msg + " grad skipped (eager NaN: a fully masked row)"
        # relative to the gradients' scale: some are analytically 0 (a per-row bias under softmax,
        # q and k of a row with one live key: dS = P (dP - D) cancels exactly). Their fp32 value is
        # rounding of that cancellation, ~1e-6 of the scale (seed 12 #746, seed 16 #490), so the
        # floor is 1e-2 of the scale: an absolute error up to 1e-5 of the largest gradient passes.
        scale = max((b.double().norm().item() for _, b in pairs), default=1.0) or 1.0
        gerr = max(((a.double() - b).norm().item() / max(b.norm().item(), 1e-2 * scale) for a, b in pairs),
                   default=0.0)
        msg += f" grad_err={gerr:.2e}"
        ok = gerr < tol
    return ok, bool(report.regions), msg


def check_autocast(p: Program, inside: bool) -> tuple[bool, bool, str]:
    """(ok, fused, message) of ``p`` under a bfloat16 autocast on its device, entered around the
    compiled call or (``inside``) within the compiled function: the compiled output has eager's
    dtype, and its error against float64 is at most twice eager's under the same autocast (bf16
    rounding; the kernel keeps the scores in float32), or 4e-3 (a bf16 ulp, which Triton's
    interpreter reaches by truncating its bf16 stores)."""
    import flashlight
    from flashlight.testing import rel_error
    ref = reference(p)
    autocast = functools.partial(torch.autocast, p.args[0].device.type, torch.bfloat16)

    def fn(*xs):
        with autocast():
            return p.fn(*xs)
    fn = fn if inside else p.fn
    with contextlib.nullcontext() if inside else autocast():
        torch.compiler.reset()
        report = flashlight.explain(fn, *p.args)
        torch.compiler.reset()
        out = torch.compile(fn, backend="flashlight")(*p.args)
        try:
            want = fn(*p.args)
        except RuntimeError as e:       # eager's own failure (a float32 fill beyond bfloat16's range)
            return True, bool(report.regions), f"eager fails: {e}"
    err, floor = rel_error(out.double().nan_to_num(0), ref), rel_error(want.double().nan_to_num(0), ref)
    ok = out.dtype == want.dtype and err <= max(2 * floor, 4e-3)
    return ok, bool(report.regions), f"{out.dtype} against {want.dtype}, err={err:.2e} (eager {floor:.2e})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--autocast", action="store_true", help="run each program under a bfloat16 autocast")
    ap.add_argument("--splits", type=int, default=None,
                    help="run every forward that can split its keys as that many split-KV splits (runtime.decode)")
    args = ap.parse_args(argv)
    if args.splits:
        from .runtime import decode
        decode.FORCE_SPLITS = args.splits
    warnings.filterwarnings("ignore", category=RuntimeWarning)   # the interpreter's numpy overflow chatter
    bad, fused = 0, 0
    for i in range(args.count):
        rng = random.Random(args.seed * 1_000_003 + i)
        torch.manual_seed(args.seed * 1_000_003 + i)
        p = make_program(rng)
        try:
            ok, f, msg = check_autocast(p, inside=i % 2 == 1) if args.autocast else check(p)
        except Exception as e:  # noqa: BLE001 — a crash is a failure to report, not to hide
            ok, f, msg = False, False, f"crash: {type(e).__name__}: {e}"
        fused += f
        if not ok:
            bad += 1
            print(f"MISMATCH #{i}: {p.desc}: {msg}", flush=True)
        if (i + 1) % 50 == 0:
            print(f"{i + 1} programs, {bad} mismatches, {fused} fused", flush=True)
    print(f"fuzz: {args.count} programs, {bad} mismatches, {fused} fused (seed {args.seed})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
