"""Inductor's DiffAttn training step: CUDA kernel time by kernel (torch.profiler), B=4 N=4096."""
import sys
import torch
from torch.profiler import ProfilerActivity, profile
from flashlight.examples import diff_attention as diff
torch._dynamo.config.cache_size_limit = 64
D = int(sys.argv[1]); H = 2048 // D
xs = [x.requires_grad_() if x.is_floating_point() else x for x in diff.make_inputs(4, H, 4096, 4096, D, torch.bfloat16, "cuda")]
fn = torch.compile(diff.attention)
def step():
    out = fn(*xs)
    torch.autograd.grad(out, [x for x in xs if x.requires_grad], torch.ones_like(out))
for _ in range(3): step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(5): step()
    torch.cuda.synchronize()
tot = {}
for e in prof.key_averages():
    if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0):
        tot[e.key] = getattr(e, "self_device_time_total", 0) / 5
s = sum(tot.values())
print(f"D={D} H={H} inductor step kernels {s:.0f} us")
for k, v in sorted(tot.items(), key=lambda kv: -kv[1])[:10]:
    print(f"  {v:9.1f} us  {k[:110]}")
