"""A small budget of random attention programs (see flashlight/fuzz.py) in every CI run; the long
run is ``TRITON_INTERPRET=1 python -m flashlight.fuzz --count 1000 --seed N``."""
import random

import pytest
import torch

from flashlight.fuzz import check, check_autocast, make_program


@pytest.mark.parametrize("i", range(24))
def test_random_program_matches_fp64(i):
    rng = random.Random(4242 + i)
    torch.manual_seed(4242 + i)
    p = make_program(rng, top_k=False)      # (top-k: tests/test_topk.py; the long runs draw it)
    ok, _, msg = check(p)
    assert ok, f"{p.desc}: {msg}"


@pytest.mark.parametrize("i", range(6))
def test_random_program_under_autocast_matches_eager_autocast(i):
    """The same programs under a bfloat16 autocast (``fuzz --autocast``), entered around the
    compiled call or inside the compiled function: eager's dtype, and no more error against
    float64 than eager's own under autocast."""
    rng = random.Random(5151 + i)
    torch.manual_seed(5151 + i)
    p = make_program(rng, top_k=False)
    ok, _, msg = check_autocast(p, inside=i % 2 == 1)
    assert ok, f"{p.desc}: {msg}"
