"""The ``torch.compile`` backend: a flat list of named passes over each Dynamo graph.

    to_aten        make_fx(pre_dispatch=True): ATen ops above autograd, user spellings normalised
                   (SDPA calls decomposed: capture/sdpa.py; score products joined: capture/products.py)
    capture        find attention regions and build their IR          (capture/)
    verify         scoping checks                                     (ir/)
    rewrite        reduction algebra to a fixed point                 (rewrite/)
    codegen        Triton source, written to the kernel cache         (codegen/, runtime/)
    replace        swap each region for a flashlight::region call; dead code goes
    inductor       everything else compiles as usual

``FLASHLIGHT_DEBUG=1`` prints the IR after each pass and the path of each generated kernel.
An unexpected error while fusing compiles the graph without fusion (explain() says why);
``FLASHLIGHT_STRICT=1`` raises it instead (the tests set it).
"""
from __future__ import annotations

import functools
import operator
import os
import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from . import _compat
from .capture import Fallback, Match, Unsupported, autocast, products, sdpa, carries_grad, find_regions, mark_gradients, source_line
from .capture.symbolic import CARRIES
from .codegen import CodegenError
from .ir import Region, VerifyError, verify
from .rewrite import rewrite


@dataclass
class GraphReport:
    """What one backend call did: the fused regions (with their compiled kernels) and fallbacks."""
    regions: list = field(default_factory=list)        # runtime.op.CompiledRegion
    sources: list[str] = field(default_factory=list)   # each region's source line here (an entry may be shared)
    fallbacks: list[Fallback] = field(default_factory=list)
    graph: fx.GraphModule | None = None                # what Inductor receives
    seconds: dict[str, float] = field(default_factory=dict)    # "trace", "lower", "inductor": where the compile went


_LISTENERS: list[list[GraphReport]] = []   # explain() collects reports here


def _debug(stage: str, payload) -> None:
    if os.environ.get("FLASHLIGHT_DEBUG") == "1":
        print(f"[flashlight] after {stage}:\n{payload}\n")


def lower(region: Region, max_autotune: bool = False):
    """verify -> rewrite -> verify -> codegen; returns the CompiledRegion."""
    from .runtime.op import compile_region
    region = verify(region)
    _debug("capture", region)
    region = rewrite(region, debug=lambda name, r: _debug(f"rewrite[{name}]", r))
    compiled = compile_region(region)
    compiled.max_autotune |= max_autotune
    _debug("codegen", f"{compiled.name} -> {compiled.path}")
    return compiled


def replace(graph: fx.Graph, match: Match, key: str, autograd: bool = True) -> dict[fx.Node, fx.Node]:
    """``flashlight::region`` (output and row statistics, differentiable) where the graph may be
    differentiated; ``flashlight::region_infer`` (the output alone) where it cannot be. Returns
    the replaced nodes' replacements (a later region may load one of them)."""
    if match.rows:
        return replace_with_rows(graph, match, key, autograd)
    with graph.inserting_before(match.root):
        if autograd:
            call = graph.call_function(torch.ops.flashlight.region.default, (key, list(match.leaves)))
            out = graph.call_function(operator.getitem, (call, 0))      # [1]: row statistics for autograd
        else:
            out = graph.call_function(torch.ops.flashlight.region_infer.default, (key, list(match.leaves)))
    out.meta.update(match.root.meta)
    match.root.replace_all_uses_with(out)
    return {match.root: out}


def detached(graph: fx.Graph, match: Match) -> list[fx.Node]:
    """The leaves of a region no gradient reaches, in a graph that may be differentiated, those
    that carry one detached (views, no copies): no gradient flows through the region, and its
    ops get no input that requires one (``region_infer`` has no autograd)."""
    leaves = []
    with graph.inserting_before(match.root):
        for x in match.leaves:
            if carries_grad(x):
                d = graph.call_function(aten.detach.default, (x,))
                d.meta.update(x.meta)
                d.meta[CARRIES] = False
                x = d
            leaves.append(x)
    return leaves


def replace_with_rows(graph: fx.Graph, match: Match, key: str, autograd: bool = True) -> dict[fx.Node, fx.Node]:
    """One call returns the output and the extra row outputs (each (*batch, M), viewed back to
    the shape the program had, e.g. keepdim's trailing 1): ``flashlight::region_rows`` (and the
    row statistics, for autograd) where the graph may be differentiated, else
    ``flashlight::region_rows_infer`` (no statistics stored)."""
    op = torch.ops.flashlight.region_rows.default if autograd else torch.ops.flashlight.region_rows_infer.default
    with graph.inserting_before(match.root):
        call = graph.call_function(op, (key, list(match.leaves)))
        outs = [graph.call_function(operator.getitem, (call, i)) for i in range(len(match.rows) + 1)]
        views = [graph.call_function(torch.ops.aten.view.default, (o, list(n.meta["val"].shape)))
                 for o, n in zip(outs[1:], match.rows)]
    for node, new in zip([match.root, *match.rows], [outs[0], *views]):
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
    _toposort(graph)      # a row output (logsumexp) may be used before the root in node order
    return dict(zip([match.root, *match.rows], [outs[0], *views]))


def _toposort(graph: fx.Graph) -> None:
    """Move nodes after their inputs, otherwise keeping the order they had."""
    order, done = [], set()
    for node in graph.nodes:
        stack = [(node, False)]
        while stack:
            n, ready = stack.pop()
            if n in done:
                continue
            if ready:
                done.add(n)
                order.append(n)
                continue
            stack.append((n, True))
            stack.extend((i, False) for i in reversed(n.all_input_nodes) if i not in done)
    for prev, n in zip(order, order[1:]):
        prev.append(n)


def needs_autograd(gm: fx.GraphModule, example_inputs) -> bool:
    """Whether the graph may be differentiated. Dynamo guards on grad mode and on each input's
    requires_grad, so a graph compiled without either is never run with them."""
    if any(_compat.sets_grad_mode(n) for n in gm.graph.nodes):
        return True     # the graph switches grad mode itself (enable_grad inside no_grad)
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs) or \
        any(p.requires_grad for p in gm.parameters())


def copied(gm: fx.GraphModule) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    """A copy of ``gm``'s graph to rewrite for tracing, and the map from its nodes to the copy's
    (the passes below return ``fx.GraphModule(gm, graph)``, leaving ``gm`` as Dynamo gave it)."""
    graph, env = fx.Graph(), {}
    graph.output(graph.graph_copy(gm.graph, env))
    return graph, env


def _attr(gm: fx.GraphModule, target: str):
    return functools.reduce(getattr, target.split("."), gm)


def attrs_as_inputs(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """A copy of ``gm`` whose tensors held as attributes (``get_attr``: an optimizer step's
    parameters and state, which Dynamo does not pass as inputs) are its last inputs, and those
    tensors, so that the trace makes them fake like the inputs. Read as attributes they would
    run for real while tracing, and an in-place update (AdamW's ``step_t += 1``) would change
    them: a compiled step counted twice."""
    held = {n: _attr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    held = {n: t for n, t in held.items() if isinstance(t, torch.Tensor)}
    if not held:
        return gm, []
    graph, env = copied(gm)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):     # after the inputs, in order
        inputs = [graph.placeholder(f"flashlight_attr{i}") for i in range(len(held))]
    for n, p in zip(held, inputs):
        env[n].replace_all_uses_with(p)
        graph.erase_node(env[n])
    return fx.GraphModule(gm, graph), list(held.values())


def inputs_as_attrs(aten_gm: fx.GraphModule, tensors: list[torch.Tensor]) -> None:
    """Undo ``attrs_as_inputs`` in the traced graph: its last ``len(tensors)`` inputs read the
    tensors as attributes again."""
    if not tensors:
        return
    graph = aten_gm.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder"][-len(tensors):]
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for i, (p, t) in enumerate(zip(inputs, tensors)):
        setattr(aten_gm, f"flashlight_attr{i}", t)
        with graph.inserting_before(first):
            node = graph.get_attr(f"flashlight_attr{i}")
        node.meta.update(p.meta)
        p.replace_all_uses_with(node)
        graph.erase_node(p)
    aten_gm.recompile()


def autocast_dtypes_pinned(gm: fx.GraphModule, example_inputs) -> fx.GraphModule | None:
    """A copy of ``gm`` with the casts ``autocast.pins`` finds written in (``.to(dtype)`` after a
    result, before a product's inputs), so the pre-dispatch trace sees autocast's dtypes; None
    where the graph runs under no autocast or needs none."""
    if not autocast.ambient() and not any(_compat.autocast_switch(n) for n in gm.graph.nodes):
        return None
    after, before = autocast.pins(gm, example_inputs)
    if not after and not before:
        return None
    graph, env = copied(gm)
    for n, dtype in after.items():
        with graph.inserting_after(env[n]):
            cast = graph.call_method("to", (env[n], dtype))
        env[n].replace_all_uses_with(cast, delete_user_cb=lambda u: u is not cast)
    for n, (dtype, inputs) in before.items():
        for x in inputs:
            with graph.inserting_before(env[n]):
                env[n].replace_input_with(env[x], graph.call_method("to", (env[x], dtype)))
    return fx.GraphModule(gm, graph)


def inference_mode_as_no_grad(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose ``torch.inference_mode()`` blocks are ``torch.no_grad()`` ones, for
    tracing: the ATen trace keeps ``_set_grad_enabled`` calls but drops inference mode's, and
    ``mark_gradients`` reads grad mode from them (a block left unmarked would be fused into a
    differentiated region: its inputs got gradients eager does not give). The gradients are
    eager's; only inference tensors' restrictions (no later use in autograd) are not kept."""
    if not any(_compat.inference_mode_switch(n) for n in gm.graph.nodes):
        return gm
    graph, _ = copied(gm)
    enabled, before = torch.is_grad_enabled(), {}      # a rewritten enter -> grad mode before it
    for n in list(graph.nodes):
        enabled = grad_after(n, enabled, before)
        if _compat.inference_mode_switch(n) and (n in before or n.args and n.args[0] in before):
            with graph.inserting_before(n):
                graph.call_function(_compat.set_grad_enabled_fn(), (enabled,))
    for n in reversed(list(graph.nodes)):     # the exits first: they read the enters
        if _compat.inference_mode_switch(n) and not n.users:
            graph.erase_node(n)
    return fx.GraphModule(gm, graph)


def grad_after(n: fx.Node, enabled: bool, before: dict) -> bool:
    """Grad mode after the Dynamo graph node ``n`` runs with grad mode ``enabled``: a
    ``set_grad_enabled`` call sets it, ``inference_mode(True)`` turns it off and its own exit
    (not an inner ``inference_mode(False)``'s) restores it; ``before``: such an enter -> the
    mode before it, filled here."""
    switch = _compat.inference_mode_switch(n)
    if _compat.sets_grad_mode(n):
        return bool(n.args[0])
    if switch == "enter" and n.args and n.args[0] is True:
        before[n] = enabled
        return False
    if switch == "exit" and n.args and n.args[0] in before:
        return before[n.args[0]]
    return enabled


def data_as_detach(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with every ``x.data`` read as ``x.detach()``, for tracing: ``.data`` bypasses the
    dispatcher, so the ATen trace would freeze its result as a constant (a fake tensor at run
    time). The values and gradients are the same (no gradient flows through either); only
    ``.data``'s separate version counter is not kept."""
    if not any(_compat.data_attr(n) for n in gm.graph.nodes):
        return gm
    graph, _ = copied(gm)
    for n in list(graph.nodes):
        if _compat.data_attr(n):
            with graph.inserting_before(n):
                n.replace_all_uses_with(graph.call_method("detach", (n.args[0],)))
            graph.erase_node(n)
    return fx.GraphModule(gm, graph)


# Tensor arithmetic that takes a 0-d tensor where it took a Python number, with the same result
# dtype when the other operand has dims (a 0-d operand does not take part in type promotion).
SCALAR_ARITHMETIC = {operator.mul, operator.truediv, operator.add, operator.sub, torch.mul, torch.div, torch.add,
                     torch.sub}


def items_as_tensors(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with each ``t.item()`` whose value only scales, shifts or divides tensors (directly,
    or through arithmetic with Python numbers: ``s * (1.0 / t.item())``) read as the 0-d tensor
    ``t`` itself, detached (a number carries no gradient), in float32 if floating (the precision
    the Python number had in the arithmetic). Dynamo lifts a Python float argument that changed
    between calls (automatic dynamic: a temperature, a scale) to a 0-d tensor read with
    ``.item()``, which a trace on fake tensors cannot follow: the region then reads ``t`` (a
    scalar load) and the value may change at every call without a recompile."""
    def value(x):
        return x.meta.get("example_value") if isinstance(x, fx.Node) else None

    def scalar_only(n: fx.Node, scalars: set) -> bool:
        """Every use of the scalar ``n`` is arithmetic with a number (itself such a scalar,
        collected in ``scalars``) or with a tensor that has dims."""
        scalars.add(n)
        for user in n.users:
            if user.op != "call_function" or user.target not in SCALAR_ARITHMETIC or user.kwargs or len(user.args) != 2:
                return False
            (other,) = [a for a in user.args if a is not n] or [n]
            if isinstance(other, (int, float)) or other in scalars:
                if user not in scalars and not scalar_only(user, scalars):
                    return False
            elif not (isinstance(value(other), torch.Tensor) and value(other).dim() > 0):
                return False
        return True

    def rewritable(n: fx.Node) -> bool:
        t = value(n.args[0]) if n.args else None
        return (n.op == "call_method" and n.target == "item" and isinstance(t, torch.Tensor) and t.dim() == 0
                and scalar_only(n, set()))
    items = [n for n in gm.graph.nodes if rewritable(n)]
    if not items:
        return gm
    graph, env = copied(gm)
    for n in items:
        item, t = env[n], env[n.args[0]]
        with graph.inserting_before(item):
            scalar = graph.call_method("detach", (t,))         # a Python number carries no gradient
            if value(n.args[0]).is_floating_point():
                scalar = graph.call_method("float", (scalar,))
        item.replace_all_uses_with(scalar)
        graph.erase_node(item)
    return fx.GraphModule(gm, graph)


def to_aten(gm: fx.GraphModule, example_inputs) -> fx.GraphModule:
    """The pre-dispatch ATen graph of ``gm`` on fake copies of ``example_inputs`` and of the
    tensors it holds (``attrs_as_inputs``), which it reads as attributes again."""
    lifted, held = attrs_as_inputs(gm)
    aten_gm = _compat.make_fx_pre_dispatch(fx.Interpreter(lifted).run, [*example_inputs, *held])
    inputs_as_attrs(aten_gm, held)
    return aten_gm


def trace(gm: fx.GraphModule, example_inputs,
          keep_sdpa: frozenset[str] = frozenset()) -> tuple[fx.GraphModule, list[str]]:
    """The ATen graph of ``gm`` (pre-dispatch, on fake copies of ``example_inputs``), and the
    SDPA calls decomposed into their program there (``capture.sdpa``; those named in
    ``keep_sdpa`` stay SDPA). Grad mode is restored afterwards whatever the trace did (the
    graph's own switches run while it traces); a graph whose trace froze a value into a
    constant without data is refused (``Unsupported``)."""
    with torch.set_grad_enabled(torch.is_grad_enabled()):
        traceable = items_as_tensors(data_as_detach(inference_mode_as_no_grad(gm)))
        try:
            try:
                aten_gm = to_aten(traceable, example_inputs)
            except RuntimeError:        # (a program well-typed only under autocast: pin its dtypes)
                pinned = autocast_dtypes_pinned(traceable, example_inputs)
                if pinned is None:
                    raise
                aten_gm = to_aten(pinned, example_inputs)
        except Exception as e:
            if _compat.data_dependent(e):
                raise Unsupported("a value read with .item() (a Python number argument that changed between "
                                  "calls is lifted to a tensor) feeds an operation the trace cannot follow") from e
            raise
    for n in aten_gm.graph.nodes:
        if n.op == "get_attr" and _compat.is_fake(getattr(aten_gm, n.target, None)):
            raise Unsupported(f"the trace froze a computed value into a constant ({n.target}): "
                              "an operation outside the dispatcher")
    autocast.make_explicit(aten_gm.graph, autocast.ambient())
    rewritten = sdpa.decompose(aten_gm, keep_sdpa)
    products.weights_first(aten_gm)
    products.join(aten_gm)
    return aten_gm, rewritten


def fuse(gm: fx.GraphModule, example_inputs, max_autotune: bool = False,
         keep_sdpa: frozenset[str] = frozenset()) -> tuple[fx.GraphModule, GraphReport]:
    """Trace ``gm`` on concrete ``example_inputs`` and swap every fusable region for the op. A
    graph the ATen trace would not reproduce (``_compat.untraceable``: a ``torch.func``
    transform, a tensor hook, a user ``autograd.Function``...) is left whole to Inductor. An
    SDPA call traced as its program (``capture.sdpa``) that does not fuse whole is traced again
    as SDPA (``keep_sdpa``), its reasons kept."""
    report, t0 = GraphReport(), time.perf_counter()
    checkpoints = [n for n in gm.graph.nodes if _compat.is_checkpoint(n)]
    for n in gm.graph.nodes:
        why = "" if n in checkpoints else _compat.untraceable(n)
        if why:
            report.fallbacks.append(Fallback(n.name, getattr(n.target, "__name__", str(n.target)),
                                             f"{why} inside the compiled graph: the graph is compiled by Inductor, "
                                             "unfused", source_line(n)))
            report.graph = gm
            return gm, report
    autograd = needs_autograd(gm, example_inputs)
    if checkpoints and not autograd:      # nothing to recompute: the bodies are plain calls
        return fuse(inlined(gm, checkpoints), example_inputs, max_autotune, keep_sdpa)
    if checkpoints:
        return fuse_checkpointed(gm, example_inputs, checkpoints, max_autotune, report)
    try:
        aten_gm, rewritten = trace(gm, example_inputs, keep_sdpa)
    except Unsupported as e:
        report.fallbacks.append(Fallback("graph", "-", f"{e}: compiled by Inductor, unfused", ""))
        report.graph = gm
        return gm, report
    for n in sdpa.sdpa_calls(aten_gm.graph):       # the calls left to SDPA's kernels, and why
        why = "its program did not fuse (the reasons above): SDPA's own kernels serve it" if n.name in keep_sdpa \
            else sdpa.why_kept(n)
        report.fallbacks.append(Fallback(n.name, sdpa.OP, why, source_line(n)))
    # values the program computes and never uses (a row max left over from an edit) would
    # otherwise become row outputs of a region: its backward would be the reference VJP
    aten_gm.graph.eliminate_dead_code()     # mutations and random draws are impure: they stay
    if autograd:
        mark_gradients(aten_gm.graph, example_inputs)
    matches, fallbacks = find_regions(aten_gm.graph)
    report.seconds["trace"] = time.perf_counter() - t0
    report.seconds["lower"] = 0.0
    report.fallbacks += fallbacks
    fused: set[fx.Node] = set()     # nodes a region computes (in-place updates among them)
    renamed: dict[fx.Node, fx.Node] = {}    # an earlier region's outputs: what a later one loads
    traced = {n.name for n in aten_gm.graph.nodes}
    for m in matches:
        m.leaves = [renamed.get(x, x) for x in m.leaves]
        differentiated = autograd and any(carries_grad(x) for x in [m.root, *m.rows])
        if autograd and not differentiated:
            m.leaves = detached(aten_gm.graph, m)
        t0 = time.perf_counter()
        try:
            compiled = lower(m.region, max_autotune)
        except (Unsupported, CodegenError, VerifyError) as e:
            report.fallbacks.append(Fallback(m.root.name, str(m.root.target), str(e), source_line(m.root)))
            continue
        finally:
            report.seconds["lower"] += time.perf_counter() - t0
        renamed |= replace(aten_gm.graph, m, compiled.key, differentiated)
        report.regions.append(compiled)
        report.sources.append(m.region.source)
        fused |= m.inner
    if rewritten and report.regions:
        # an SDPA call traced as its program that left unfused math behind goes back to SDPA
        aten_gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() and n not in fused)
        unfused = {node.meta[sdpa.TAG] for node in aten_gm.graph.nodes if sdpa.TAG in node.meta
                   and node.target not in VIEWS    # views of q, k, v may feed a region, whose op takes the root's meta
                   and getattr(node.target, "namespace", "") != "flashlight"}
    else:
        unfused = set(rewritten)
    if unfused:
        again, retried = fuse(gm, example_inputs, max_autotune, keep_sdpa | unfused)
        # this attempt's reasons first (why the decomposed SDPA did not fuse), each reason once
        seen, merged = set(), []
        for f in report.fallbacks + retried.fallbacks:
            if (f.op, f.reason, f.source) not in seen:
                seen.add((f.op, f.reason, f.source))
                merged.append(f)
        retried.fallbacks = merged
        return again, retried
    if not report.regions:
        report.graph = gm
        return gm, report
    # an in-place update the region captured only wrote a private intermediate: dead like the rest
    aten_gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() and n not in fused)
    # a candidate that failed where a region computes its node (layers stacked without a
    # projection: the first layer's output seen as the next one's scores) is no fallback
    gone = traced - {n.name for n in aten_gm.graph.nodes}
    report.fallbacks = [f for f in report.fallbacks if f.node not in gone]
    aten_gm.recompile()
    _debug("replace", aten_gm.code)
    report.graph = aten_gm
    return aten_gm, report


def fuse_checkpointed(gm: fx.GraphModule, example_inputs, checkpoints: list[fx.Node], max_autotune: bool,
                      report: GraphReport) -> tuple[fx.GraphModule, GraphReport]:
    """A graph calling ``torch.utils.checkpoint``: each checkpointed body is fused on its own
    (``fuse``, on the arguments it gets in this compile) and takes its body's place, the
    checkpoint op kept; Inductor then recomputes the body in the backward, its regions' kernels
    included (a region saves only its output and row statistics anyway). The ATen trace cannot
    follow the checkpoint op, so the attention between the checkpoints is fused piece by piece:
    each run of nodes between two checkpoints that may hold one becomes a submodule
    (``segmented``), fused like a body. A body or piece whose fusion fails stays as it was."""
    out, pieces, unfused = segmented(gm, checkpoints)
    report.fallbacks += unfused
    checkpoints = [n for n in out.graph.nodes if _compat.is_checkpoint(n)]
    inputs = _compat.subgraph_inputs(out, example_inputs, set(checkpoints) | set(pieces))
    modes = modes_at(out, set(checkpoints) | set(pieces))
    for n in checkpoints + pieces:
        name = n.args[0].target if n in checkpoints else n.target
        args = [materialised(x, intermediate=n in pieces) for x in inputs[n]]
        grad, casts = modes[n]
        try:
            with torch.set_grad_enabled(grad), autocast.entered(casts):
                fused, inner = fuse(getattr(out, name), args, max_autotune)
        except Exception as e:  # noqa: BLE001 — the rest of the graph still fuses; explain() says why
            if os.environ.get("FLASHLIGHT_STRICT") == "1":
                raise
            report.fallbacks.append(Fallback(name, "-", f"internal error, compiled without fusion: "
                                             f"{type(e).__name__}: {e}", source_line(n)))
            continue
        report.regions += inner.regions
        report.sources += inner.sources
        report.fallbacks += inner.fallbacks
        for phase, seconds in inner.seconds.items():
            report.seconds[phase] = report.seconds.get(phase, 0.0) + seconds
        if inner.regions:
            setattr(out, name, fused)
    report.graph = out
    return out, report


def modes_at(gm: fx.GraphModule, nodes: set[fx.Node]) -> dict[fx.Node, tuple[bool, dict]]:
    """The grad mode and the autocast (by device type, None where turned off) each of ``nodes``
    runs under, from the compile's own and the switches before it in ``gm``: a checkpointed
    body is fused under them, as the graph runs it."""
    grad, casts, grads_before, casts_before, at = torch.is_grad_enabled(), autocast.ambient(), {}, {}, {}
    for n in gm.graph.nodes:
        if n in nodes:
            at[n] = (grad, casts)
        grad, casts = grad_after(n, grad, grads_before), autocast.after(n, casts, casts_before)
    return at


def segmented(gm: fx.GraphModule, checkpoints: list[fx.Node]) -> tuple[fx.GraphModule, list[fx.Node], list[Fallback]]:
    """A copy of ``gm`` in which each run of nodes between two checkpoint ops (in graph order)
    that may hold an attention (``_may_hold_attention``) is moved into a submodule, called where
    the run ended: the order of every call stays the graph's (RNG draws among them), and the
    checkpoint ops, their bodies and the items of their results stay in the outer graph.
    Returns the copy, its ``call_module`` nodes of the runs, and a fallback for each softmax
    between products or SDPA call left outside them: one that a checkpoint op splits, and every
    one where the graph switches grad mode, inference mode or autocast (a piece would be fused
    under the modes of the compile, not the ones it runs under)."""
    graph, env = copied(gm)
    out = fx.GraphModule(gm, graph)
    attention = [n for n in graph.nodes if _named(n, SDPA_NAMES) or _named(n, SOFTMAXES) and _between_products(n)]
    runs, why = [], "a checkpoint op splits this attention: only what lies between two checkpoints fuses"
    if any(_compat.switches_mode(n) for n in gm.graph.nodes):
        why = "between checkpoints in a graph that switches grad mode, inference mode or autocast: only " \
              "checkpointed bodies fuse there"
    else:
        ckpts = {env[n] for n in checkpoints}
        outer = {n for c in ckpts for n in [c, c.args[0], *c.users]}
        run: list[fx.Node] = []
        for n in graph.nodes:
            if n in ckpts or n.op == "output":
                runs.append(run)
                run = []
            elif n.op not in ("placeholder", "get_attr") and n not in outer:
                run.append(n)
        runs = [r for r in runs if _may_hold_attention(r)]
    inside = {n for r in runs for n in r}
    unfused = [Fallback(n.name, getattr(n.target, "__name__", str(n.target)), why, source_line(n))
               for n in attention if n not in inside]
    pieces = [_extract(out, r, f"_flashlight_piece{i}") for i, r in enumerate(runs)]
    out.recompile()
    return out, pieces, unfused


def _extract(gm: fx.GraphModule, run: list[fx.Node], name: str) -> fx.Node:
    """Move the nodes ``run`` (in graph order) of ``gm`` into a submodule ``name`` taking the
    values they read from outside and returning the ones read outside (a tuple), and call it
    after the last of them."""
    inside = set(run)
    reads = list(dict.fromkeys(x for n in run for x in n.all_input_nodes if x not in inside))
    results = [n for n in run if any(u not in inside for u in n.users)]
    sub, env = fx.Graph(), {}
    for x in reads:
        env[x] = sub.placeholder(x.name)
        env[x].meta.update(x.meta)
    for n in run:
        env[n] = sub.node_copy(n, env.__getitem__)
    sub.output(tuple(env[n] for n in results))
    gm.add_submodule(name, fx.GraphModule(gm, sub))
    with gm.graph.inserting_after(run[-1]):
        call = gm.graph.call_module(name, tuple(reads))
    with gm.graph.inserting_after(call):
        for i, n in reversed(list(enumerate(results))):
            item = gm.graph.call_function(operator.getitem, (call, i))
            item.meta.update(n.meta)
            n.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
    for n in reversed(run):
        gm.graph.erase_node(n)
    return call


def inlined(gm: fx.GraphModule, checkpoints: list[fx.Node]) -> fx.GraphModule:
    """``gm`` with each checkpoint op replaced by a call of its body: a graph that is never
    differentiated recomputes nothing, and the whole graph then traces and fuses, attention
    outside the checkpoints included (Inductor itself refuses an RNG op, SDPA among them, in a
    checkpointed body even then: "does not support RNG ops in recompute regions")."""
    graph, env = copied(gm)
    out = fx.GraphModule(gm, graph)
    for n in checkpoints:
        name, c = n.args[0].target, env[n]
        body = getattr(gm, name)
        nested = [m for m in body.graph.nodes if _compat.is_checkpoint(m)]
        if nested:
            setattr(out, name, inlined(body, nested))
        with out.graph.inserting_before(c):
            call = out.graph.call_module(name, tuple(c.args[1:]))
        call.meta.update(c.meta)
        c.replace_all_uses_with(call)
        out.graph.erase_node(c)
        if not env[n.args[0]].users:        # the body's get_attr (nothing else is removed)
            out.graph.erase_node(env[n.args[0]])
    out.recompile()
    return out


SOFTMAXES = ("softmax", "log_softmax")
SDPA_NAMES = ("scaled_dot_product_attention",)
PRODUCTS = ("matmul", "bmm", "baddbmm", "einsum")


def _named(node: fx.Node, names: tuple[str, ...]) -> bool:
    """A Dynamo graph's call of a function or method of one of these names."""
    if node.op not in ("call_function", "call_method"):
        return False
    return (node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")) in names


def _may_hold_attention(nodes: list[fx.Node]) -> bool:
    """Dynamo graph nodes holding an SDPA call or two products (``q @ k^T`` and ``P @ V``,
    whatever the softmax's spelling)."""
    return any(_named(n, SDPA_NAMES) for n in nodes) or sum(_named(n, PRODUCTS) for n in nodes) >= 2


def _between_products(node: fx.Node, depth: int = 8) -> bool:
    """An attention's softmax: a product among the last few producers of its input and among
    the first few users of its output (not a classifier head's log_softmax)."""
    def near(step) -> bool:
        frontier = [node]
        for _ in range(depth):
            frontier = [x for n in frontier for x in step(n)]
            if any(_named(n, PRODUCTS) for n in frontier):
                return True
        return False
    return near(lambda n: n.all_input_nodes) and near(lambda n: n.users)


def materialised(x, intermediate: bool = False):
    """A tensor with the layout, dtype, device and requires_grad of the fake ``x`` (others as
    they are), uninitialised: what ``fuse`` traces with (its own fake copies are made from it).
    ``intermediate``: one that requires grad is not a leaf (a piece of a graph may update it in
    place, as the whole graph may its intermediates)."""
    if not isinstance(x, torch.Tensor):
        return x
    t = torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device=x.device)
    t.requires_grad_(x.requires_grad)
    return t.clone().as_strided(t.shape, t.stride()) if intermediate and x.requires_grad else t


aten = torch.ops.aten
# ATen ops that move no data: what remains of a graph around its regions when the user's function
# is just attention (layout changes of q, k, v and of the output).
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
         aten.permute.default, aten.expand.default, aten.t.default, aten.unsqueeze.default,
         aten.squeeze.dim, aten.squeeze.default, aten.slice.Tensor, aten.select.int,
         aten.alias.default, aten.detach.default, operator.getitem}


def runs_as_is(gm: fx.GraphModule) -> bool:
    """Nothing left for Inductor: only flashlight regions, views and the empty tensors that
    anchor dropout seeds to a device (``capture.rules``). Such a graph runs as the FX module
    itself — Inductor would add seconds of compile at the first call and its wrapper's cost to
    every call (~50 µs on the H200, docs/notes.md); the op's registered autograd serves
    training."""
    return all(n.op in ("placeholder", "output") or
               (n.op == "call_function" and (n.target in VIEWS or n.target == aten.empty.memory_format
                                             or getattr(n.target, "namespace", "") == "flashlight"))
               for n in gm.graph.nodes)


def direct_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """An FX graph that runs as is calls the ops' Python implementations itself — the inference
    op's function, and for the differentiable op an ``autograd.Function`` with the same saved
    tensors and backward: the dispatcher has nothing to add there (no tracing follows), and each
    call saves its cost."""
    from .runtime.op import region_direct, region_rows_direct, region_train_direct
    direct = {torch.ops.flashlight.region_infer.default: region_direct,
              torch.ops.flashlight.region_rows_infer.default: region_rows_direct,
              torch.ops.flashlight.region.default: region_train_direct}
    changed = False
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in direct:
            n.target, changed = direct[n.target], True
    if changed:
        gm.recompile()
    return gm


def _compile(gm: fx.GraphModule, example_inputs, max_autotune: bool = False, patches: dict | None = None):
    try:
        fused, report = fuse(gm, example_inputs, max_autotune)
    except Exception as e:  # noqa: BLE001 — never break a program eager runs; say why in explain()
        if os.environ.get("FLASHLIGHT_STRICT") == "1":
            raise
        reason = f"internal error, compiled without fusion: {type(e).__name__}: {e}"
        fused, report = gm, GraphReport(fallbacks=[Fallback("graph", "-", reason, "")], graph=gm)
    for sink in _LISTENERS:
        sink.append(report)
    if report.regions and runs_as_is(fused) and not graphed(example_inputs, patches):
        return direct_calls(fused).forward    # the graph's code itself: no nn.Module call (hook checks)
    t0 = time.perf_counter()
    compiled = _compat.compile_fx(fused, list(example_inputs), patches)
    report.seconds["inductor"] = time.perf_counter() - t0
    return compiled


def graphed(example_inputs, patches: dict | None) -> bool:
    """Will Inductor's CUDA graph trees replay this graph: CUDA graphs asked for
    (``triton.cudagraphs``: "reduce-overhead", "max-autotune") and CUDA inputs?"""
    return bool((patches or {}).get("triton.cudagraphs")) and \
        any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)


class PerShape:
    """A Dynamo graph with symbolic sizes (``dynamic=True``, or automatic dynamic shapes after a
    second sequence length): fused and compiled once per concrete input shape, at first call.
    The generated kernels do not depend on lengths, so Triton compiles each only once."""

    def __init__(self, gm: fx.GraphModule, max_autotune: bool, patches: dict):
        self.gm, self.max_autotune, self.patches, self.compiled = gm, max_autotune, patches, {}

    def __call__(self, *args):
        key = tuple((tuple(a.shape), a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else a
                    for a in args)
        if key not in self.compiled:
            self.compiled[key] = _compile(self.gm, args, self.max_autotune, self.patches)
        return self.compiled[key](*args)


def wants_autotune(patches: dict) -> bool:
    """Inductor's ``max_autotune`` among the compile's options (``_compat.mode_options``: any
    max-autotune mode, or ``options={"max_autotune": True}``) or ``FLASHLIGHT_AUTOTUNE=1``: time
    the launch configs of each kernel (cached on disk)."""
    return bool(patches.get("max_autotune") or os.environ.get("FLASHLIGHT_AUTOTUNE") == "1")


def flashlight_backend(gm: fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
    """``torch.compile(fn, backend="flashlight")``: fuse attention regions, Inductor for the rest,
    with the Inductor options ``mode`` and ``options`` ask for. Under CUDA graphs
    (``mode="reduce-overhead"`` or ``"max-autotune"``) a graph of regions alone goes to Inductor
    too, whose CUDA graph trees then replay the regions' launches with the rest."""
    patches = _compat.mode_options(mode, options)
    tune = wants_autotune(patches)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if any(_compat.is_symbolic(n.meta.get("example_value")) for n in placeholders):
        # probe on the example (hint) values: a graph with nothing to fuse keeps Inductor's
        # single dynamic-shape compile instead of one compile per shape (explain() gets the
        # probe's reasons); a probe that fails falls back the same way
        try:
            _, probe = fuse(gm, [_compat.concrete(x) for x in example_inputs])
        except Exception as e:  # noqa: BLE001 — never break a program eager runs
            if os.environ.get("FLASHLIGHT_STRICT") == "1":
                raise
            probe = GraphReport(fallbacks=[Fallback("graph", "-", f"internal error, compiled without fusion: "
                                                    f"{type(e).__name__}: {e}", "")], graph=gm)
        if probe.regions:
            return PerShape(gm, tune, patches)
        for sink in _LISTENERS:
            sink.append(probe)
        return _compat.compile_fx(gm, list(example_inputs), patches)
    return _compile(gm, example_inputs, tune, patches)
