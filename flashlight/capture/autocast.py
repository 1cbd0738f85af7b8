"""``torch.autocast`` made explicit in the ATen graph: the casts it makes become graph nodes.

The pre-dispatch trace records each op as the program wrote it: an autocast block is a pair of
``_enter_autocast`` / ``_exit_autocast`` calls around ops on their original dtypes, and an
autocast entered outside the compiled function leaves no trace at all; autocast itself acts
below, at dispatch. A region built from those ops would compute eager's program without
autocast: a float32 output where eager gives bfloat16, float32 products where eager multiplies
bfloat16 operands. So, before the regions are found, every op that runs under autocast is run
once more on the trace's fake values under the same autocast, and where its result has another
dtype than an input, that input is cast to it by an explicit ``_to_copy`` node. That one rule
covers autocast's three policies as they stand on the tracing machine's PyTorch, without a table
of ops: products cast their operands down to the autocast dtype, softmax and the other float32
ops cast their input up, the promoting ops cast to the widest input; where autocast leaves an op
alone, the cast is the type promotion the op does anyway. Each node's fake value is updated, so
later ops (and the region builder, which reads dtypes there) see autocast's dtypes. A graph
without autocast is left untouched.
"""
from __future__ import annotations

import contextlib
import math
import operator

import torch
import torch.fx as fx

from .. import _compat
from .symbolic import moved

aten = torch.ops.aten
CASTS = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other,
         aten.type_as.default, aten.view.dtype}


def ambient() -> dict[str, torch.dtype]:
    """The autocast this compile runs under (entered outside the compiled function, which Dynamo
    guards on), by device type."""
    return {d: torch.get_autocast_dtype(d) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)}


def make_explicit(graph: fx.Graph, outside: dict[str, torch.dtype]) -> bool:
    """Insert the casts autocast makes into ``graph`` (module docstring); ``outside``: the
    autocast in effect when the graph runs (``ambient``). Returns whether any was inserted."""
    if not outside and not any(_compat.autocast_switch(n) for n in graph.nodes):
        return False
    fake = next((n.meta["val"] for n in graph.nodes if _compat.is_fake(n.meta.get("val"))), None)
    if fake is None:
        return False
    state, before, changed = dict(outside), {}, False
    # a cast moved up a chain of moves reads the chain's start where the program read its end:
    # another value after an in-place write between them, and under the product's grad mode
    # where the moves ran under no_grad
    movable = not any(_compat.sets_grad_mode(n) or _mutates(n) for n in graph.nodes)
    with fake.fake_mode, _off(outside):
        for n in list(graph.nodes):
            if _compat.autocast_switch(n):
                state = after(n, state, before)
            elif n.op == "call_function" and (_compat.is_aten_op(n.target)
                                              or n.target is operator.getitem):
                changed |= _rerun(graph, n, state, movable)
    return changed


def pins(gm: fx.GraphModule, example_inputs) -> tuple[dict, dict]:
    """Where Dynamo's graph ``gm`` is well-typed only under autocast, for a pre-dispatch trace
    that records ops on their own dtypes and so cannot follow it: HF's ``softmax(s,
    dtype=float32).to(q.dtype) @ v`` whose v is a projection autocast narrows, a bf16 q times a
    float32 k. Each floating op under autocast runs on fake values under autocast, then again
    without it on the same inputs. Returns ``after`` (node -> dtype: without autocast its result
    has another dtype, so cast it to autocast's: the projection) and ``before`` (node -> (dtype,
    inputs): it fails without autocast, so cast those floating inputs: the mixed product).
    ``make_explicit`` adds the casts inside the ops afterwards, as for any graph."""
    after, before = {}, {}

    class Run(fx.Interpreter):
        def run_node(self, n):
            val = super().run_node(n)
            casts = ambient()
            if n.op not in ("call_function", "call_method", "call_module") or _compat.autocast_switch(n) or \
                    not casts or not isinstance(val, torch.Tensor) or not val.is_floating_point():
                return val
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            args, kwargs = fx.node.map_aggregate((args, kwargs), lambda x: x.clone() if isinstance(x, torch.Tensor) else x)
            try:
                with _off(casts):
                    plain = getattr(self, n.op)(n.target, args, kwargs)
            except Exception:   # noqa: BLE001 — well-typed only under autocast: cast its inputs
                before[n] = (val.dtype, [x for x in n.all_input_nodes if isinstance(self.env[x], torch.Tensor)
                                         and self.env[x].is_floating_point() and self.env[x].dtype != val.dtype])
                return val
            if isinstance(plain, torch.Tensor) and plain.dtype != val.dtype:
                after[n] = val.dtype
            return val

    _compat.run_on_fakes(Run(gm), example_inputs)
    return after, before


def _mutates(n: fx.Node) -> bool:
    return _compat.mutates(n.target)


def after(n: fx.Node, state: dict, before: dict) -> dict:
    """The autocast (by device type, None where turned off) after node ``n`` runs under
    ``state``: an enter sets its device's, its exit restores the state before that enter
    (``before``: enter -> state, filled here)."""
    switch = _compat.autocast_switch(n)
    if switch == "enter":
        device, dtype, enabled = n.args[:3]
        before[n] = state
        return {**state, device: dtype if enabled else None}
    if switch == "exit" and n.args and n.args[0] in before:
        return before[n.args[0]]
    return state


def _rerun(graph: fx.Graph, n: fx.Node, state: dict, movable: bool) -> bool:
    """Run ``n`` again on its inputs' fake values under ``state``'s autocast, casting its float
    inputs to its result's dtype where they differ (``_cast``; at the start of their moves where
    ``movable``); ``n.meta["val"]`` takes the new value."""
    args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda x: x.meta.get("val"))
    if n.target is operator.getitem or n.target in CASTS or _mutates(n):
        with contextlib.suppress(Exception):       # the value as it stands, on the new inputs
            n.meta["val"] = n.target(*args, **kwargs)
        return False
    tensors = [x for x in n.all_input_nodes if isinstance(x.meta.get("val"), torch.Tensor)]
    device = next((x.meta["val"].device.type for x in tensors), None)
    dtype = state.get(device)
    try:
        with torch.autocast(device, dtype) if dtype is not None else contextlib.nullcontext():
            val = n.target(*args, **kwargs)
    except Exception:   # noqa: BLE001 — an op fake values cannot run (data-dependent): left as traced
        return False
    n.meta["val"] = val
    if dtype is None or not isinstance(val, torch.Tensor) or not val.is_floating_point():
        return False
    changed = False
    for x in tensors:
        if x.meta["val"].is_floating_point() and x.meta["val"].dtype != val.dtype:
            with graph.inserting_before(n):
                n.replace_input_with(x, _cast(graph, x, val.dtype, movable))
            changed = True
    return changed


def _cast(graph: fx.Graph, x: fx.Node, dtype: torch.dtype, movable: bool = True) -> fx.Node:
    """``x`` cast to ``dtype`` by a new node at the insertion point. The cast goes to the start
    of the moves that made ``x`` (transposes, views, GQA's expansion of k), each moving no more
    elements than the tensor it reads, and they are replayed on its result: cast as they come,
    ``k.transpose(-1, -2)`` would become a narrow copy in the transposed layout, and an
    expanded k a copy per query head, where the kernel reads k's own layout through index
    arithmetic. Not ``movable`` (the graph writes in place or switches grad mode): cast as it
    comes."""
    chain = [x]
    while movable and (x := moved(chain[-1])) is not None and _size(x) <= _size(chain[-1]) < math.inf:
        chain.append(x)
    base = chain.pop()
    out = graph.call_function(aten._to_copy.default, (base,), {"dtype": dtype})
    out.meta.update(base.meta)
    out.meta["val"] = base.meta["val"].to(dtype)
    for move in reversed(chain):
        args = (out, *move.args[1:])
        new = graph.call_function(move.target, args, move.kwargs)
        new.meta.update(move.meta)
        vals, kwargs = fx.node.map_arg((args, move.kwargs), lambda a: a.meta.get("val"))
        new.meta["val"] = move.target(*vals, **kwargs)
        out = new
    return out


def _size(n: fx.Node) -> float:
    """The number of elements of ``n``'s value (infinite where unknown or symbolic)."""
    try:
        return int(n.meta["val"].numel())
    except Exception:   # noqa: BLE001 — no value, or a symbolic size: moves no cast past it
        return math.inf


@contextlib.contextmanager
def entered(casts: dict[str, torch.dtype | None]):
    """Autocast as ``casts`` says, by device type (None: turned off)."""
    with contextlib.ExitStack() as stack:
        for device, dtype in casts.items():
            stack.enter_context(torch.autocast(device, dtype, enabled=dtype is not None))
        yield


@contextlib.contextmanager
def _off(casts: dict[str, torch.dtype]):
    """Autocast off for each device type of ``casts`` (the one entered outside, while the ops
    run again under their own states; all of them, for an op's run without autocast)."""
    with contextlib.ExitStack() as stack:
        for device in casts:
            stack.enter_context(torch.autocast(device, enabled=False))
        yield
