"""Backward tile-kernel config sweep (dK/dV and dQ timed alone), with a gradient check per config."""
import os, sys, time
import torch
from triton.testing import do_bench
import flashlight
from flashlight.examples import VARIANTS
from flashlight.runtime import op as rt
from flashlight.tune import Config, head_block, rows_config
torch._dynamo.config.cache_size_limit = 64
C = lambda s: [Config(*map(int, x.split(","))) for x in s.split()]
SPACE = {
    (128, "dkdv"): C("32,64,4,3 16,64,4,3 32,64,8,3 64,64,8,3 64,128,8,3 32,64,4,2 32,128,8,3 16,64,4,4 32,64,4,4 16,128,4,3"),
    (128, "dq"): C("128,64,8,3 128,64,8,2 64,64,4,3 128,32,8,3 64,64,8,3 128,128,8,2 64,32,4,3"),
    (64, "dkdv"): C("32,64,4,3 64,64,4,3 64,128,8,3 32,128,4,3 64,64,8,3 64,128,4,3 64,64,4,4 32,64,4,4 64,64,4,2"),
    (64, "dq"): C("64,64,4,3 128,64,8,3 128,64,4,3 64,32,4,3 128,32,4,3 64,64,4,4 128,128,8,2"),
}
if os.environ.get("DRY"):
    SPACE = {k: [Config(16, 16, 1, 1), Config(16, 32, 1, 1), Config(32, 32, 1, 1), Config(32, 16, 1, 1)] for k in SPACE}
    do_bench = lambda f, **kw: (f(), 0.0)[1]
rows = []
CASES = [(int(d), tuple(v.split("+"))) for d, v in (x.split(":") for x in os.environ.get("CASES", "128:causal+alibi,64:causal+document_mask").split(","))]
if os.environ.get("ONLY"):
    SPACE = {(64, "dkdv"): C("32,64,4,3 64,64,4,3 32,64,4,3 64,64,4,3"), (64, "dq"): C("64,64,4,3")}
for D, names in CASES:
    for name in names:
        t0 = time.time()
        mod = VARIANTS[name]
        torch.manual_seed(0)
        ins = [x.requires_grad_() if x.is_floating_point() else x for x in (mod.make_inputs(1, 2, 64, 64, D, torch.float32, "cpu") if os.environ.get("DRY") else mod.make_inputs(4, 16, 4096, 4096, D, torch.bfloat16, "cuda"))]
        fn = torch.compile(mod.attention, backend="flashlight", dynamic=False)
        cap = {}
        orig = rt.CompiledRegion.backward
        def rec(self, inputs, rowstats, out, grad, block_stats=None):
            cap["a"] = (self, inputs, rowstats, out, grad)
            return orig(self, inputs, rowstats, out, grad, block_stats)
        rt.CompiledRegion.backward = rec
        out = fn(*ins)
        out.backward(torch.randn_like(out))
        rt.CompiledRegion.backward = orig
        c, inputs, rowstats, o, g = cap["a"]
        k = c.backward_kernels()
        bufs = k.buffers(inputs)
        drows = k.launch_rows(inputs, rowstats, o, g, bufs, rows_config(head_block(c.region.DV)))
        for kern, launch in (("dkdv", k.launch_dkdv), ("dq", k.launch_dq)):
            ref = None
            for cfg in SPACE[D, kern]:
                b = k.buffers(inputs)
                try:
                    launch(inputs, rowstats, drows, b, {}, cfg)
                    res = torch.cat([b[i].float().flatten() for i in k.plan.written(kern)])
                    ref = res if ref is None else ref
                    err = ((res - ref).norm() / ref.norm()).item()
                    t = do_bench(lambda: launch(inputs, rowstats, drows, b, {}, cfg), warmup=10, rep=40, return_mode="median")
                except Exception as e:
                    t, err = float("nan"), f"{type(e).__name__}"
                rows.append((D, name, kern, f"{cfg.BLOCK_M}x{cfg.BLOCK_N}w{cfg.num_warps}s{cfg.num_stages}", t, err))
                print(*rows[-1], flush=True)
        print(name, D, "took", round(time.time() - t0), "s", flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "bwd_sweep.csv"), "w") as f:
    f.write("d,variant,kernel,config,ms,err_vs_first\n")
    for r in rows:
        f.write(",".join(map(str, r)) + "\n")
