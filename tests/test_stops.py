"""Stopped values computed from the region's own scores (``capture.regions.stopped_copies``): a
row max ``detach()``ed to stabilise a hand-written softmax (as many research codebases write it),
a temperature computed under ``torch.no_grad()`` from the first softmax's entropy. Before, the
region loaded them, and Inductor computed them from a score-sized product; now they fuse as
``stop`` expressions (the value, no gradient), a max read only through them is ``stopped``
(rewrite ``stopped-maxima``: it takes no gradient, and the sums it shifts run online), and the
gradients are eager's, detach included."""
import pytest
import torch

import flashlight
from flashlight.ir import Input, Reduction, Region, call, load, red, var
from flashlight.rewrite import stopped_maxima
from helpers import check_grads


def _scores(q, k):
    return q @ k.mT * q.shape[-1] ** -0.5


def detached_max(q, k, v):
    s = _scores(q, k)
    s = s - s.amax(-1, keepdim=True).detach()
    e = s.exp()
    return (e / e.sum(-1, keepdim=True)) @ v


def detached_max_values(q, k, v):
    s = _scores(q, k)
    e = (s - s.max(dim=-1, keepdim=True)[0].detach()).exp()
    return (e / e.sum(-1, keepdim=True)) @ v


def epsilon_softmax(q, k, v):
    """The epsilon makes the output depend on the max: detached, it takes no gradient (eager's)."""
    s = _scores(q, k)
    e = (s - s.amax(-1, keepdim=True).detach()).exp()
    return (e / (e.sum(-1, keepdim=True) + 0.5)) @ v


def detached_min(q, k, v):
    s = _scores(q, k)
    return torch.softmax(s - s.amin(-1, keepdim=True).detach(), -1) @ v


def detached_logsumexp(q, k, v):
    s = _scores(q, k)
    return torch.exp(s - torch.logsumexp(s, -1, keepdim=True).detach()) @ v


def no_grad_temperature(q, k, v):
    """Veličković et al.'s adaptive temperature as its reference code computes it: the entropy
    and the polynomial under no_grad. Three passes in one kernel."""
    s = _scores(q, k)
    with torch.no_grad():
        p = torch.softmax(s, -1)
        h = -(p * torch.log(p + 1e-9)).sum(-1, keepdim=True)
        beta = torch.where(h > 0.5, torch.clamp(-0.037 * h**4 + 0.481 * h**3 - 2.3 * h**2 + 4.917 * h - 1.791,
                                                min=1.0), 1.0)
    return torch.softmax(s * beta, -1) @ v


PROGRAMS = {f.__name__: f for f in (detached_max, detached_max_values, epsilon_softmax, detached_min,
                                    detached_logsumexp, no_grad_temperature)}
PASSES = {"detached_max": 1, "detached_max_values": 1, "epsilon_softmax": 1, "detached_min": 2,
          "detached_logsumexp": 2, "no_grad_temperature": 3}


@pytest.mark.parametrize("name", PROGRAMS)
def test_stopped_copies_of_the_scores_fuse_and_train(name):
    """One region, no product left to Inductor, the passes the program needs (a detached max is
    the online softmax's own), no gradient at the argmax, and every gradient as float64 eager's
    at a ragged shape (37 queries, 29 keys)."""
    fn = PROGRAMS[name]
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(1, 2, L, 16, generator=g) for L in (37, 29, 29)]
    report = flashlight.explain(fn, *[x.clone().requires_grad_() for x in xs])
    assert len(report.regions) == 1 and not report.fallbacks, report
    assert not any("matmul" in gr.code for gr in report.graphs)
    r = report.regions[0]
    passes = next((int(f.split("-")[0]) for f in r.features if f.endswith("-pass")), 1)
    assert passes == PASSES[name] and "shift-gradient" not in r.features and "stop-gradient" in r.features, r.features
    assert r.backward.startswith("generated"), r.backward
    check_grads(fn, xs)


def test_a_detached_max_is_stopped_in_the_ir():
    xs = [torch.randn(1, 2, 21, 16).requires_grad_() for _ in range(3)]
    ir = flashlight.explain(detached_max, *xs).regions[0].ir
    assert "max_n" in ir and " stopped" in ir and "stop(" not in ir, ir


def _region(reductions, out) -> Region:
    return Region((1,), 4, 4, 1, 1, [Input("s", (1, 4, 4), torch.float32)], [], reductions, out, torch.float32)


def test_stopped_maxima_lifts_only_maxima_read_through_stops_alone():
    """A max read only inside stops is stopped and the stops of it alone go; one also read
    directly keeps its gradient (and the stops stay where they are)."""
    s = load(0, (var("b0"), var("m"), var("n")), "f")
    stopped = _region([Reduction("max", s), Reduction("sum", call("exp", s - call("stop", red(0))))],
                      call("div", red(1), red(1) + 1.0))
    new = stopped_maxima(stopped)
    assert new.reductions[0].stopped and new.reductions[1].body == call("exp", s - red(0))
    mixed = _region(stopped.reductions, call("add", red(1), red(0)))
    assert stopped_maxima(mixed) is None
    kept = _region([Reduction("max", s), Reduction("sum", call("exp", s - call("stop", red(0) * s)))], red(1))
    new = stopped_maxima(kept)      # stop(m * s) also stops s: it stays
    assert new.reductions[0].stopped and "stop" in str(new.reductions[1].body)
