import os

# The generated Triton kernels run on CPU tensors through Triton's interpreter. This must be set
# before any kernel module is imported (Triton picks the interpreter at @jit time).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("FLASHLIGHT_STRICT", "1")      # internal errors fail tests, not fall back
os.environ.setdefault("FLASHLIGHT_POISON", "1")      # kernel outputs start as NaN (runtime/buffers.py)

import pytest  # noqa: E402
import torch  # noqa: E402

import flashlight  # noqa: E402,F401


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch.manual_seed(0)
    torch.compiler.reset()
    yield
