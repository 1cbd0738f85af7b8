"""Attention sinks written with ``torch.cat`` (gpt-oss): the appended logit column joins the
softmax's max and sum as a row-level extra element, never P @ V, and never widens the key loop."""
import pytest
import torch

from flashlight.examples import sinks, sinks_sliding_window
from helpers import check_fused, check_grads

B, H, M, N, D = 1, 2, 37, 70, 16


def _masked(keep):
    """A sink program whose scores are masked with ``keep(i, j)`` before the concatenation."""
    def attention(q, k, v, s_h):
        Bq, Hq, Mq, _ = q.shape
        i, j = torch.arange(Mq)[:, None], torch.arange(k.shape[-2])[None, :]
        s = (q @ k.mT * 0.25).masked_fill(~keep(i, j), float("-inf"))
        col = s_h.view(1, -1, 1, 1).expand(Bq, Hq, Mq, 1)
        return torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :N] @ v
    return attention


PROGRAMS = {
    "reshape_expand": sinks.attention,
    "causal_sliding": sinks_sliding_window.attention,
    "causal": _masked(lambda i, j: j <= i),
    # rows 0..9 see no key at all: the sink alone keeps their denominator positive (output 0)
    "fully_masked_rows": _masked(lambda i, j: j < i - 9),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_sink_fuses_and_matches_fp64(name):
    inputs = sinks.make_inputs(B=B, H=H, M=M, N=N, D=D)
    _, report = check_fused(PROGRAMS[name], *inputs)
    r = report.regions[0]
    assert "sink" in r.features and "online-softmax" in r.features
    assert "cat_n" not in r.ir and r.ir.count("extra=") == 2      # the max and the sum, not P @ V


def test_fully_masked_rows_are_zero_not_nan():
    inputs = sinks.make_inputs(B=B, H=H, M=M, N=N, D=D)
    out = torch.compile(PROGRAMS["fully_masked_rows"], backend="flashlight")(*inputs)
    assert torch.isfinite(out).all() and out[:, :, :10].abs().max() == 0


def test_sink_logit_read_back_is_the_column():
    """softmax(cat)[..., -1] is the sink's probability: the column at position N, with no P @ V."""
    def attention(q, k, v, s_h):
        s = torch.cat([q @ k.mT * 0.25, s_h.view(1, -1, 1, 1).expand(B, H, M, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)
        return p[..., :-1] @ v * (1 - p[..., -1:])
    check_fused(attention, *sinks.make_inputs(B=B, H=H, M=M, N=N, D=D))


@pytest.mark.parametrize("mod", [sinks, sinks_sliding_window], ids=lambda m: m.__name__.rsplit(".")[-1])
def test_sink_gradients(mod):
    check_grads(mod.attention, mod.make_inputs(B=1, H=2, M=21, N=30, D=16))


def test_other_concatenations_stay_unfused_leaves():
    """A cat along the head dim (rotary embeddings' rotate_half) is computed outside the kernel."""
    def attention(q, k, v):
        half = q.shape[-1] // 2
        rot = torch.cat([-q[..., half:], q[..., :half]], dim=-1)
        return torch.softmax((q + rot) @ k.mT * 0.25, -1) @ v
    q, k, v = (torch.randn(B, H, M, D), torch.randn(B, H, N, D), torch.randn(B, H, N, D))
    _, report = check_fused(attention, q, k, v)
    assert "sink" not in report.regions[0].features
