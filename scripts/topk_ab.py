"""A/B of top-k's merge (session 33): ``kernel.kth_inserts`` (the most values entering a block's rows
that are inserted one by one; above it the block goes through ``tl.topk``) at -1 (tl.topk only: the
session 32 kernel), a quarter, half and all of the candidates, same process. Causal top-k on random
scores (few values enter once rows have settled) and with a rising bias along the keys (every later
key beats the candidates: the tl.topk branch throughout). Forward only: the backward reads the
stored threshold. B=4 H=16 N=4096 bf16; prints ms and the error against fp32 eager."""
import torch
import triton.testing

import flashlight
from flashlight.codegen import kernel
from flashlight.testing import rel_error

torch._dynamo.config.cache_size_limit = 64


def program(k, rising):
    def attention(q, key, v):
        s = q @ key.mT * q.shape[-1] ** -0.5
        N = s.shape[-1]
        if rising:
            s = s + torch.arange(N, device=q.device, dtype=s.dtype) * (4.0 / N)
        causal = torch.ones(s.shape[-2], N, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~causal, float("-inf"))
        kth = s.topk(k, dim=-1).values[..., -1:]
        return torch.softmax(s.masked_fill(s < kth, float("-inf")), -1) @ v
    return attention


default = kernel.kth_inserts
rows = []
for D in (64, 128):
    q, key, v = (torch.randn(4, 16, 4096, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for k in (16, 64):
        for rising in (False, True):
            fn = program(k, rising)
            ref = fn(*(x.float() for x in (q, key, v)))
            kp = 1 << (k - 1).bit_length()
            times = {}
            for name, limit in (("topk", -1), ("q", kp // 4), ("h", kp // 2), ("all", kp)):
                kernel.kth_inserts = lambda red, limit=limit: limit
                torch.compiler.reset()
                f = torch.compile(fn, backend="flashlight")
                err = rel_error(f(q, key, v).float(), ref)
                flashlight.wait()
                times[name] = (triton.testing.do_bench(lambda: f(q, key, v), warmup=25, rep=200, return_mode="median"), err)
            rows.append((D, k, rising, times))
            print(D, k, rising, {n: f"{t:.3f} ({e:.0e})" for n, (t, e) in times.items()}, flush=True)
kernel.kth_inserts = default
print(f"{'D':>4} {'k':>3} {'rising':>6} {'topk ms':>8} {'k/4 ms':>7} {'k/2 ms':>7} {'k ms':>7} {'x topk (k/2)':>12} {'max err':>8}")
for D, k, rising, t in rows:
    print(f"{D:>4} {k:>3} {str(rising):>6} {t['topk'][0]:>8.3f} {t['q'][0]:>7.3f} {t['h'][0]:>7.3f} {t['all'][0]:>7.3f} "
          f"{t['topk'][0] / t['h'][0]:>12.2f} {max(e for _, e in t.values()):>8.0e}")
