"""On a GPU: HF's eager attention under a cuda bf16 autocast entered inside the forward (the
trace pins autocast's dtypes, backend.autocast_dtypes_pinned), and slot attention's P @ V with
the weights second: fused, output and gradients against float64 next to eager's own error."""
import copy

import torch
import torch.nn.functional as F

import flashlight
from flashlight.testing import rel_error


class HFBlock(torch.nn.Module):
    def __init__(self, d=1024, h=16):
        super().__init__()
        self.h = h
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d, bias=False) for _ in range(4))

    @torch.autocast("cuda", torch.bfloat16)
    def forward(self, x):
        q, k, v = (p(x).unflatten(-1, (self.h, -1)).transpose(1, 2) for p in (self.q, self.k, self.v))
        mask = torch.full((x.shape[1], x.shape[1]), torch.finfo(x.dtype).min, device=x.device, dtype=x.dtype).triu(1)
        w = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5 + mask
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o(torch.matmul(w, v).transpose(1, 2).flatten(-2))


def main():
    torch.manual_seed(0)
    model = HFBlock().cuda()
    x = torch.randn(2, 1000, 1024, device="cuda")
    report = flashlight.explain(model, x)
    print(report)
    model64 = copy.deepcopy(model).double()
    ref = model64(x.double())
    ref.float().sum().backward()
    out = torch.compile(model, backend="flashlight")(x)
    eager = copy.deepcopy(model)
    want = eager(x)
    out.float().sum().backward()
    want.float().sum().backward()
    print(f"HF block: fused {len(report.regions)}, dtype {out.dtype}/{want.dtype}, "
          f"out err {rel_error(out, ref):.2e} (eager {rel_error(want, ref):.2e})")
    for (name, p), e, r in zip(model.named_parameters(), eager.parameters(), model64.parameters()):
        print(f"  grad {name}: {rel_error(p.grad, r.grad):.2e} (eager {rel_error(e.grad, r.grad):.2e})")


if __name__ == "__main__":
    main()
