"""At B=4 H=16 N=4096 causal D=128: gradients under forced configs (autograd path, vs float64) and
the sweep's direct-launch path (vs the first config), to locate bwd_sweep's disagreement."""
import os
import torch
import flashlight
from flashlight.examples import VARIANTS
from flashlight.runtime import op as rt
from flashlight.runtime.op import REGISTRY
from flashlight.tune import Config, head_block, rows_config
torch._dynamo.config.cache_size_limit = 256
dev = "cpu" if os.environ.get("DRY") else "cuda"
B, H, N, D = (1, 1, 64, 32) if dev == "cpu" else (4, 16, 4096, 128)
CFG = {"dkdv": [Config(32, 64, 4, 3), Config(32, 128, 4, 3)], "dq": [Config(128, 64, 8, 3), Config(64, 64, 4, 3)]}
if dev == "cpu":
    CFG = {"dkdv": [Config(16, 16, 1, 1), Config(16, 32, 1, 1)], "dq": [Config(16, 16, 1, 1), Config(32, 16, 1, 1)]}
mod = VARIANTS["causal"]
torch.manual_seed(0)
base = mod.make_inputs(B, H, N, N, D, torch.float32 if dev == "cpu" else torch.bfloat16, dev)
ins = [x.detach().clone().requires_grad_() for x in base]
ref_in = [x.detach().double().requires_grad_() for x in base]
out = mod.attention(*ref_in)
dout = torch.randn_like(out)
refs = torch.autograd.grad(out, ref_in, dout)
del out
fn = torch.compile(mod.attention, backend="flashlight", dynamic=False)
cap = {}
orig = rt.CompiledRegion.backward
def rec(self, inputs, rowstats, o, grad, block_stats=None):
    cap["a"] = (self, inputs, rowstats, o, grad)
    return orig(self, inputs, rowstats, o, grad, block_stats)
rt.CompiledRegion.backward = rec
gs0 = torch.autograd.grad(fn(*ins), ins, dout.to(ins[0].dtype))
rt.CompiledRegion.backward = orig
c, inputs, rowstats, o, g = cap["a"]
print("default", [f"{((x.double() - r).norm() / r.norm()).item():.1e}" for x, r in zip(gs0, refs)], dict(c.tuned), flush=True)
k = c.backward_kernels()
for kern, cfgs in CFG.items():
    for cfg in cfgs:
        saved = dict(c.tuned)
        c.tuned[c.tuning_key(kern)] = cfg
        gs = torch.autograd.grad(fn(*ins), ins, dout.to(ins[0].dtype))
        c.tuned = saved
        auto = [f"{((x.double() - r).norm() / r.norm()).item():.1e}" for x, r in zip(gs, refs)]
        bufs = k.buffers(inputs)
        drows = k.launch_rows(inputs, rowstats, o, g, bufs, rows_config(head_block(c.region.DV)) if dev == "cuda" else Config(16, 16, 1, 1))
        (k.launch_dkdv if kern == "dkdv" else k.launch_dq)(inputs, rowstats, drows, bufs, {}, cfg)
        direct = {i: f"{((bufs[i].double() - refs[i]).norm() / refs[i].norm()).item():.1e}" for i in k.plan.written(kern)}
        print(kern, cfg, "autograd dq dk dv err", auto, "direct", direct, flush=True)
