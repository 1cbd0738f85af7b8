"""Every private torch import Flashlight uses, in one place (torch 2.11 … 2.13).

If a torch release moves one of these, this is the only file to fix.
"""
from __future__ import annotations


def compile_fx(gm, example_inputs):
    """Inductor's entry point, used for everything outside the fused regions."""
    from torch._inductor.compile_fx import compile_fx as _compile_fx
    return _compile_fx(gm, example_inputs)


def make_fx_pre_dispatch(fn, args):
    """Trace ``fn`` to ATen ops above autograd, on fresh fake tensors, keeping node metadata
    (stack traces) of the graph being interpreted."""
    from torch._guards import tracing
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.traceback import preserve_node_meta
    # Outside Dynamo's tracing context, make_fx makes its own fake mode with static shapes;
    # inside it, it would borrow Dynamo's symbolic one and add guards Dynamo cannot express.
    with tracing(None), preserve_node_meta():
        return make_fx(fn, tracing_mode="fake", pre_dispatch=True)(*args)


def is_symbolic(x) -> bool:
    import torch
    if isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool):
        return True
    if isinstance(x, torch.Tensor):
        from torch.fx.experimental.symbolic_shapes import free_symbols
        return bool(free_symbols(x))
    return False


def concrete(x):
    """A SymInt/SymFloat example input as the value Dynamo traced with (its hint)."""
    import torch
    if isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool):
        hint = getattr(x.node, "hint", None)     # SymNode.hint: private, stable across 2.11-2.13
        return x if hint is None else hint
    return x


def register_backend(name: str, fn) -> None:
    """Make ``torch.compile(backend=name)`` find ``fn`` (the entry point does this when installed)."""
    from torch._dynamo import list_backends, register_backend as _register
    if name not in list_backends(exclude_tags=()):
        _register(compiler_fn=fn, name=name)


def sets_grad_mode(node) -> bool:
    """A Dynamo graph node that switches grad mode (``torch.enable_grad()`` inside the program)."""
    import torch
    return node.op == "call_function" and node.target is torch._C._set_grad_enabled
