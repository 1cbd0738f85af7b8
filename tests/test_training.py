"""End to end: a small transformer block whose attention is plain PyTorch (causal, with ALiBi)
trains for 50 steps under torch.compile(backend="flashlight"), with the same losses as eager."""
import copy

import torch
import torch.nn as nn

import flashlight

from flashlight.examples import alibi


class Block(nn.Module):
    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        a = alibi.attention(q, k, v).transpose(1, 2).reshape(B, N, C)
        x = x + self.proj(a)
        return x + self.mlp(self.norm2(x))


def train(model, steps, data, target, compiled):
    model = copy.deepcopy(model)
    fwd = torch.compile(model, backend="flashlight") if compiled else model
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = (fwd(data) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_transformer_block_trains_like_eager():
    torch.manual_seed(0)
    model = Block()
    data, target = torch.randn(2, 24, 32), torch.randn(2, 24, 32)
    report = flashlight.explain(model, data)
    assert len(report.regions) == 1 and "bias" in report.regions[0].features, str(report)
    eager = train(model, 50, data, target, compiled=False)
    fused = train(model, 50, data, target, compiled=True)
    assert eager[-1] < 0.8 * eager[0]                  # it does learn
    for e, f in zip(eager, fused):
        assert abs(e - f) <= 2e-3 * abs(e), (e, f)


def test_a_compiled_optimizer_step_updates_its_state_once():
    """The whole step compiled, ``opt.step()`` included: Dynamo's graph of AdamW's step holds the
    parameters and the optimizer's state as attributes and updates them in place. The trace to
    ATen ran those updates for real before it failed (``step_t += 1``: each compiled step counted
    twice, the weights drifting from eager's with no warning); now they are traced as fake inputs
    (``backend.attrs_as_inputs``). Parameters and step counters after three steps, as eager's."""
    torch.manual_seed(0)
    model, data, target = Block(), torch.randn(2, 24, 32), torch.randn(2, 24, 32)
    runs = []
    for compiled in (False, True):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3, eps=1e-3)   # (eps: qkv's k bias has no gradient but noise)

        def step():
            opt.zero_grad()
            loss = (m(data) - target).square().mean()
            loss.backward()
            opt.step()
            return loss
        run = torch.compile(step, backend="flashlight") if compiled else step
        for _ in range(3):
            run()
        runs.append((m, opt))
    (eager, eager_opt), (fused, fused_opt) = runs
    for (name, p), q in zip(eager.named_parameters(), fused.parameters()):
        assert eager_opt.state[p]["step"].item() == fused_opt.state[q]["step"].item() == 3, name
        assert (p - q).norm() <= 1e-4 * p.norm(), name
