"""Gradients under forced backward configs against a float64 reference (GPU correctness probe)."""
import os, sys
import torch
import flashlight
from flashlight.examples import VARIANTS
from flashlight.runtime.op import REGISTRY
from flashlight.tune import Config
torch._dynamo.config.cache_size_limit = 256
dev = "cpu" if os.environ.get("DRY") else "cuda"
C = lambda s: [Config(*map(int, x.split(","))) for x in s.split()]
DKDV = C(os.environ.get("DKDV", "32,64,4,3 32,128,4,3 32,128,4,1 64,128,8,3 64,128,8,1 64,64,4,3"))
DQ = C(os.environ.get("DQ", "128,64,8,3 64,64,4,3 64,64,4,1 128,64,8,1 128,128,8,2"))
B, H, N = map(int, os.environ.get("SHAPE", "1,2,1024").split(","))
tag = os.environ.get("TAG", "new")
for name, D in [(v.split(":")[0], int(v.split(":")[1])) for v in os.environ.get("CASES", "causal:128,causal:64,vanilla:128").split(",")]:
    mod = VARIANTS[name]
    torch.manual_seed(0)
    base = mod.make_inputs(B, H, N, N, D, torch.float32 if dev == "cpu" else torch.bfloat16, dev)
    ins = [x.detach().clone().requires_grad_() if x.is_floating_point() else x for x in base]
    ref_in = [x.detach().double().requires_grad_() if x.is_floating_point() else x for x in base]
    out = mod.attention(*ref_in)
    dout = torch.randn_like(out)
    refs = torch.autograd.grad(out, [x for x in ref_in if x.requires_grad], dout)
    fn = torch.compile(mod.attention, backend="flashlight", dynamic=False)
    leaves = [x for x in ins if x.requires_grad]
    torch.autograd.grad(fn(*ins), leaves, dout.to(ins[0].dtype))
    (c,) = [c for c in REGISTRY.values() if c.bwd_launches and c.region.DK == D and c.region.N == N]
    for kern, space in (("dkdv", DKDV), ("dq", DQ)):
        for cfg in space:
            saved = dict(c.tuned)
            c.tuned[c.tuning_key(kern)] = cfg
            try:
                gs = torch.autograd.grad(fn(*ins), leaves, dout.to(ins[0].dtype))
                errs = [((g.double() - r).norm() / r.norm()).item() for g, r in zip(gs, refs)]
                msg = " ".join(f"{e:.1e}" for e in errs)
            except Exception as e:
                msg = f"{type(e).__name__}: {str(e)[:80]}"
            c.tuned = saved
            print(f"{tag} {name} D={D} N={N} {kern} {cfg.BLOCK_M}x{cfg.BLOCK_N}w{cfg.num_warps}s{cfg.num_stages}: dq dk dv err {msg}", flush=True)
    REGISTRY.clear()
