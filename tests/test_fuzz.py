"""A small budget of random attention programs (see flashlight/fuzz.py) in every CI run; the long
run is ``TRITON_INTERPRET=1 python -m flashlight.fuzz --count 1000 --seed N``."""
import random

import pytest
import torch

from flashlight.fuzz import check, make_program


@pytest.mark.parametrize("i", range(24))
def test_random_program_matches_fp64(i):
    rng = random.Random(4242 + i)
    torch.manual_seed(4242 + i)
    p = make_program(rng)
    ok, _, msg = check(p)
    assert ok, f"{p.desc}: {msg}"
