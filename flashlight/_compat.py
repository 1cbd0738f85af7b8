"""Every private torch import Flashlight uses, in one place (torch 2.11 … 2.13), and the Triton
internals the launch path relies on (Triton 3.6: ``FastLaunch``, ``with_scratch``).

If a torch or Triton release moves one of these, this is the only file to fix.
"""
from __future__ import annotations


def compile_fx(gm, example_inputs, config_patches: dict | None = None):
    """Inductor's entry point, used for everything outside the fused regions, with Inductor
    config changes (``mode_options``)."""
    from torch._inductor.compile_fx import compile_fx as _compile_fx
    return _compile_fx(gm, example_inputs, config_patches=config_patches or None)


def mode_options(mode: str | None, options: dict | None) -> dict:
    """The Inductor config changes ``torch.compile(mode=..., options=...)`` asks for
    (``torch._inductor.list_mode_options``: "reduce-overhead" turns on CUDA graphs), as
    Inductor itself would apply them; an option Inductor does not know raises its error
    (``torch._inductor.config.get_config_copy`` lists them)."""
    from torch._inductor import config, list_mode_options
    known = config.get_config_copy()
    for key in options or {}:
        if key not in known:
            raise RuntimeError(f"Unexpected optimization option {key}: not one of torch._inductor.config's")
    return {**(list_mode_options(mode) if mode and mode != "default" else {}), **(options or {})}


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


def dynamo_compile_seconds() -> dict[str, float]:
    """Seconds this process spent in each of Dynamo's timed compile phases so far, summed over
    calls (``torch._dynamo.utils.compilation_time_metrics``: private, present in 2.11-2.13, filled
    by ``dynamo_timed``: ``_compile.compile_inner``, ``OutputGraph.call_user_compiler``,
    ``build_guards``, ``compile_fx_inner``...); empty if it moved. ``benchmarks.first_call`` reads it
    (cProfile's cumulative times read 0 there on the device's Python 3.12)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
        return {k: float(sum(v)) for k, v in compilation_time_metrics.items()}
    except Exception:  # noqa: BLE001 — a benchmark column, never an error
        return {}


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


def is_aten_op(target) -> bool:
    """An ATen operator overload (``torch._ops.OpOverload``: private, stable across 2.11-2.13),
    not a Python callable such as a grad-mode or autocast switch."""
    from torch._ops import OpOverload
    return isinstance(target, OpOverload)


def mutates(target) -> bool:
    """An ATen op that writes one of its arguments (its schema is mutable: ``mul_``, ``copy_``)."""
    return is_aten_op(target) and target._schema.is_mutable


def first_argument_alias(target) -> str:
    """How an ATen op's result relates to its first argument, from its schema (``OpOverload._schema``:
    private, stable across 2.11-2.13): ``"write"`` (an in-place op: ``fill_``, ``mul_``),
    ``"view"`` (the result aliases it: ``slice``, ``view``, ``transpose``) or ``""``."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments:
        return ""
    info = schema.arguments[0].alias_info
    return "" if info is None else "write" if info.is_write else "view"


def switches_mode(node) -> bool:
    """A Dynamo graph node that enters or leaves grad mode, inference mode or autocast: what a
    graph cut in pieces would lose for the pieces after it."""
    return sets_grad_mode(node) or bool(inference_mode_switch(node)) or bool(autocast_switch(node))


def autocast_switch(node) -> str:
    """``"enter"`` / ``"exit"`` for the nodes Dynamo records for ``torch.autocast()`` inside a
    program, which the pre-dispatch trace keeps (``torch.amp.autocast_mode._enter_autocast(device,
    dtype, enabled, cache)`` / ``_exit_autocast``: private, present in 2.11-2.13), else ``""``."""
    import torch.amp.autocast_mode as am
    if node.op != "call_function":
        return ""
    if node.target is getattr(am, "_enter_autocast", None):
        return "enter"
    return "exit" if node.target is getattr(am, "_exit_autocast", None) else ""


def inference_mode_switch(node) -> str:
    """``"enter"`` / ``"exit"`` for the nodes Dynamo records for ``torch.inference_mode()`` inside a
    program (``torch.autograd.grad_mode._enter_inference_mode`` / ``_exit_inference_mode``:
    private, present in 2.11-2.13), else ``""``."""
    import torch.autograd.grad_mode as gm
    if node.op != "call_function":
        return ""
    if node.target is getattr(gm, "_enter_inference_mode", None):
        return "enter"
    return "exit" if node.target is getattr(gm, "_exit_inference_mode", None) else ""


def set_grad_enabled_fn():
    """The function Dynamo graphs call to switch grad mode (``torch._C._set_grad_enabled``)."""
    import torch
    return torch._C._set_grad_enabled


def data_attr(node) -> bool:
    """A Dynamo graph node reading ``x.data`` (``torch._C._autograd._get_data_attr``: private,
    present in 2.11-2.13). Outside the dispatcher, so an ATen trace would freeze its result."""
    import torch
    return node.op == "call_function" and node.target is getattr(torch._C._autograd, "_get_data_attr", None)


def untraceable(node) -> str:
    """Why an ATen trace of a Dynamo graph holding ``node`` would not compute what the graph
    does, or "". A ``torch.func`` transform traced inline (``torch._C._functorch`` /
    ``torch._functorch`` functions: the trace cannot read its wrapped tensors, and a trace
    failing halfway leaves functorch's nesting raised); a higher-order op
    (``torch._ops.HigherOrderOperator``: a tensor hook, a user ``autograd.Function``...), whose
    backward or side effect the trace drops, running its forward body alone. Activation
    checkpointing is one too; the backend fuses its bodies apart (``is_checkpoint``)."""
    from torch._ops import HigherOrderOperator
    if node.op != "call_function":
        return ""
    if isinstance(node.target, HigherOrderOperator):
        return f"the higher-order op {node.target.name()}"
    module = getattr(node.target, "__module__", None) or ""
    return "a torch.func transform" if module.startswith(("torch._functorch", "torch._C._functorch")) else ""


def is_checkpoint(node) -> bool:
    """A ``torch.utils.checkpoint`` call in a Dynamo graph: the higher-order op
    ``tag_activation_checkpoint(body, *args, ...)``, whose body is a submodule of the graph
    (``get_attr``; ``torch._higher_order_ops.wrap``, private)."""
    from torch._higher_order_ops.wrap import tag_activation_checkpoint
    return node.op == "call_function" and node.target is tag_activation_checkpoint


def subgraph_inputs(gm, example_inputs, nodes) -> dict:
    """The arguments each higher-order op (``op(body, *args)``) or submodule call in ``nodes``
    receives when ``gm`` runs on ``example_inputs``, as fake tensors of concrete shape (a fresh
    ``torch._subclasses.FakeTensorMode``, private; each body runs in place of its op). Dynamo's
    own example values may have symbolic sizes; these have the sizes of this compile."""
    import torch.fx as fx
    seen = {}

    class Run(fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if self.current in nodes:
                seen[self.current] = args[1:]
                return args[0](*args[1:])
            return super().call_function(target, args, kwargs)

        def call_module(self, target, args, kwargs):
            if self.current in nodes:
                seen[self.current] = args
            return super().call_module(target, args, kwargs)

        def run_node(self, n):
            self.current = n
            return super().run_node(n)

    run_on_fakes(Run(gm), example_inputs)
    return seen


def run_on_fakes(interpreter, example_inputs):
    """``interpreter.run`` on fake copies of ``example_inputs`` of concrete shape, and of the
    tensors its graph holds, in a fresh ``torch._subclasses.FakeTensorMode`` (private); grad
    mode is restored afterwards."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode, held = FakeTensorMode(allow_non_fake_inputs=True), interpreter.fetch_attr

    def fetch_attr(target):     # tensors the graph holds go fake too: its in-place ops must not write them
        x = held(target)
        return mode.from_tensor(x) if isinstance(x, torch.Tensor) else x
    interpreter.fetch_attr = fetch_attr
    with mode, torch.set_grad_enabled(torch.is_grad_enabled()):
        fakes = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else concrete(x) for x in example_inputs]
        return interpreter.run(*fakes)


def data_dependent(e: BaseException) -> bool:
    """A fake-tensor trace stopped at a value it cannot know (``.item()``, a data-dependent
    shape: ``torch._subclasses.fake_tensor.DataDependentOutputException`` and
    ``torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode``, private)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    return isinstance(e, DataDependentOutputException | GuardOnDataDependentSymNode)


def trace_on_fakes(fn, fakes):
    """The pre-dispatch ATen graph of ``fn`` on fake tensors of an existing trace (a node's
    ``meta["val"]``), in their own fake mode; its nodes carry fake values of that mode too."""
    from torch._guards import tracing
    from torch.fx.experimental.proxy_tensor import make_fx
    mode = next(x.fake_mode for x in fakes if is_fake(x))
    with tracing(None), mode:
        return make_fx(fn, tracing_mode="real", pre_dispatch=True)(*fakes)


def graph_breaks() -> dict[str, int]:
    """Dynamo's graph-break reasons counted so far in this process, by reason
    (``torch._dynamo.utils.counters``, private)."""
    from torch._dynamo.utils import counters
    return dict(counters["graph_break"])


def traced_constant(node) -> bool:
    """A tensor the traced program created from literals (``torch.tensor([-1])``, the list of
    ``x[..., [-1]]``), which make_fx holds as ``_tensor_constant<i>`` (its naming, private): the
    same values at every call, unlike the parameters and buffers a graph may hold."""
    return node.op == "get_attr" and node.target.startswith("_tensor_constant")


def is_fake(x) -> bool:
    """A FakeTensor (``torch._subclasses.fake_tensor``): a traced value without data."""
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(x, FakeTensor)


def sets_grad_mode(node) -> bool:
    """A Dynamo graph node that switches grad mode (``torch.enable_grad()`` inside the program)."""
    return node.op == "call_function" and node.target is set_grad_enabled_fn()


class FastLaunch:
    """A ``@triton.jit`` function launched as ``k[grid](*args, **meta)``, like the function
    itself, minus ``JITFunction.run``'s per-call work — binding and specialising ~40 arguments,
    the cache key, device, stream and hook lookups. On the device tool's H200 host
    (benchmarks.overhead, docs/notes.md session 4) it saved 20-31 µs of host time per launch:
    a one-launch sliding-window call's launch layer went from 61 to 29 µs, a decode step's two
    launches from 151 to 110 µs (its kernels take 48 µs).

    The first launch of each (constexprs, argument key) goes through Triton, which compiles or
    finds the kernel and returns its ``CompiledKernel``; later launches with the same key call
    that kernel's launcher (``CompiledKernel.run``, Triton 3.x's launcher signature). The key
    holds every scalar argument's value and every tensor's dtype and address modulo 16: a
    superset of what Triton specialises on (ints equal to 1 or divisible by 16, 16-byte pointer
    alignment, pointer dtypes) plus the current device, so the kernel reused is always the one
    Triton would pick. A launch with a tensor where the first had a scalar, or leaving out a
    constexpr that has a default, is not cached. With a launch hook installed (profilers such as
    proton), every launch goes through Triton. The fast path skips what ``run`` re-checks on
    every call and flashlight never changes: ``pre_run_hooks``, changed globals of the kernel,
    ``knobs.runtime.debug``.

    Host tensor descriptors among the keyword arguments (the Gluon kernels' Q, K, V, dO tiles:
    new objects every call) key by everything they hold but the address (its alignment
    instead, ``_descriptor_key``), and are passed to the launcher on every call (it encodes
    each into a TMA descriptor then, as ``run`` does)."""

    def __init__(self, fn, current=None):
        self.fn = fn
        self.kernels: dict = {}
        self.parts = None       # (tensor arguments, scalar arguments) getters, from the first launch
        self.descriptors = ()   # keyword arguments that are host tensor descriptors (first launch)
        self.runtime = None     # triton.knobs.runtime (its launch hooks)
        self.current = current  # (get_current_device, get_current_stream); default Triton's driver's

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launch(grid, args, meta)

    def launch(self, grid, args, meta):
        if self.parts is None:
            from triton import knobs
            from triton.runtime.driver import driver
            self.parts, self.runtime = _parts(args), knobs.runtime
            self.descriptors = tuple(name for name, value in meta.items() if _is_descriptor(value))
            self.current = self.current or (driver.active.get_current_device, driver.active.get_current_stream)
            prebuild_launcher(self.fn, args, meta)
        tensors, scalars = self.parts
        device = self.current[0]()      # Triton's caches are per device: so is a loaded kernel
        values = scalars(args)
        kinds = tuple(map(type, values))    # 1, True and 1.0 hash alike; Triton types them apart
        try:
            items = tuple(meta.items()) if not self.descriptors else \
                tuple((k, _descriptor_key(v) if k in self.descriptors else v) for k, v in meta.items())
            key = (device, items, values, kinds, tuple([(t.dtype, t.data_ptr() & 15) for t in tensors(args)]))
            hit = self.kernels.get(key)
        except (AttributeError, TypeError):     # not the argument kinds of the first launch: Triton decides
            return self.fn[grid](*args, **meta)
        if hit is None or _hooked(self.runtime.launch_enter_hook) or _hooked(self.runtime.launch_exit_hook):
            kernel = self.fn[grid](*args, **meta)
            names = self.fn.arg_names[len(args):]
            if (hasattr(kernel, "packed_metadata")          # a CompiledKernel (None when only warming up)
                    and all(n in meta for n in names) and not any(issubclass(k, _tensor()) for k in kinds)):
                self.kernels[key] = (kernel, names if self.descriptors else [meta[n] for n in names])
            return kernel
        kernel, constexprs = hit
        if self.descriptors:        # this call's descriptors (and constexprs), in signature order
            constexprs = [meta[n] for n in constexprs]
        kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, self.current[1](device),
                   kernel.function, kernel.packed_metadata, None, None, None, *args, *constexprs)
        return kernel


def _is_descriptor(x) -> bool:
    """A host tensor descriptor (Triton's and Gluon's ``TensorDescriptor``: a base tensor, its
    shape and strides, a block shape)."""
    return all(hasattr(x, a) for a in ("base", "shape", "strides", "block_shape"))


class _Same:
    """Keys an object by identity, holding it (so its id cannot be reused while the key lives):
    a shared-memory layout, unhashable (a frozen dataclass with a list field) and cached by
    whoever makes descriptors, so the same object comes back every call."""
    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return isinstance(other, _Same) and other.obj is self.obj


def _descriptor_key(d) -> tuple:
    """What a descriptor argument specialises a launch on, and more: the base's dtype and address
    alignment, shape, strides, block shape, layout (by identity: an equal layout made anew only
    misses) and padding; never the address, which the launcher reads every call."""
    base = d.base
    return (type(d), base.dtype, base.data_ptr() & 15, tuple(d.shape), tuple(d.strides), tuple(d.block_shape),
            _Same(getattr(d, "layout", None)), getattr(d, "padding", None))


def launcher_source(fn, backend, binder, args, meta) -> str | None:
    """The C source of the launcher Triton 3.6 builds with gcc for ``fn`` compiled for this
    launch (``CudaLauncher``: one per kernel signature, 0.16-0.33 s each on the CPU machine,
    docs/notes.md session 11), from the launch's arguments alone — what ``JITFunction.run`` binds,
    specialises and packs before it compiles; None for kernels with tensor-descriptor arguments
    (their launcher also needs the compiled kernel's metadata)."""
    from triton.backends.nvidia.driver import make_launcher
    from triton.compiler import ASTSource
    bound, specialization, options = binder(*args, **meta)
    _, signature, constexprs, attrs = fn._pack_args(backend, meta, bound, specialization, options)
    src = ASTSource(fn, signature, constexprs, attrs)
    if any(str(t).startswith("tensordesc") for t in src.signature.values()):
        return None
    return make_launcher(src.constants, src.signature, None)


def prebuild_launcher(fn, args, meta) -> None:
    """Build the launcher of ``fn``'s first launch on a thread while Triton compiles the kernel:
    Triton finds it in its cache (keyed by the C source) instead of running gcc after the
    compile, so a cold first call pays max(compile, gcc) rather than the sum. Only a cache
    prefill: any failure leaves Triton to build it as usual (``FLASHLIGHT_PREBUILD=0`` skips it)."""
    import os
    import threading
    if os.environ.get("FLASHLIGHT_PREBUILD") == "0" or not hasattr(fn, "device_caches"):
        return
    try:
        from triton.runtime.driver import driver
        _, _, _, backend, binder = fn.device_caches[driver.active.get_current_device()]
        source = launcher_source(fn, backend, binder, args, meta)
    except Exception:  # noqa: BLE001 — Triton's internals moved: Triton builds it itself
        return
    if source is not None:
        threading.Thread(target=_build_launcher, args=(source,), daemon=True, name="flashlight-launcher").start()


def _build_launcher(source: str) -> None:
    try:
        from triton.backends.nvidia.driver import include_dirs, libraries, library_dirs
        from triton.runtime.build import compile_module_from_src
        compile_module_from_src(src=source, name="__triton_launcher", library_dirs=library_dirs(),
                                include_dirs=include_dirs, libraries=libraries)
    except Exception:  # noqa: BLE001 — a cache prefill: Triton builds it at the launch
        pass


def _parts(args) -> tuple:
    """Getters of the tensor and of the scalar arguments (by position: a kernel's signature fixes
    which is which), each returning a tuple — C-level ``itemgetter`` s, since the launch key is
    built on every call (a generator over 40 arguments cost ~19 µs)."""
    import operator

    import torch

    def getter(pos):
        if len(pos) > 1:
            return operator.itemgetter(*pos)
        return (lambda a: (a[pos[0]],)) if pos else (lambda a: ())
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    others = set(range(len(args))) - set(tensors)
    return getter(tensors), getter(sorted(others))


def _tensor():
    import torch
    return torch.Tensor


def _hooked(hook) -> bool:
    """Is a launch hook installed? (Triton 3.6 keeps an always-present, possibly empty HookChain.)"""
    return hook is not None and bool(getattr(hook, "calls", True))


def with_scratch(device, launch):
    """``launch()`` with a Triton allocator (``torch.empty`` on ``device``) for the global
    scratch that kernels making tensor descriptors on the device ask for at launch; the
    caller's allocator, if any, is restored afterwards, so other Triton kernels are untouched.
    Triton 3.6 keeps it in a ContextVar (``triton.runtime._allocation._allocator``): private,
    hence here."""
    from triton.runtime import _allocation
    token = _allocation._allocator.set(_scratch_allocator(device))
    try:
        return launch()
    finally:
        _allocation._allocator.reset(token)


def _scratch_allocator(device):
    import torch
    alloc = _SCRATCH.get(device)
    if alloc is None:
        alloc = _SCRATCH[device] = lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device)
    return alloc


_SCRATCH: dict = {}


def warm(kernel, grid, args, meta) -> None:
    """Compile ``kernel`` (a ``FastLaunch`` or a ``@triton.jit`` function) for the launch
    ``kernel[grid](*args, **meta)`` without launching it, its launcher prebuilt beside the
    compile: the work of a background compile thread (``runtime.background``). The launch
    itself then finds both in Triton's caches. The compiled kernel's module is loaded here too
    (``CompiledKernel._init_handles``, Triton-private; Triton would load it at the first
    launch): that launch may come inside a CUDA graph capture (``mode="reduce-overhead"``), where
    the CUDA driver refuses ``cuModuleLoadData`` on the capturing thread, not on this one
    (Inductor's CUDA graph trees capture in thread-local mode)."""
    fn = kernel.fn if isinstance(kernel, FastLaunch) else kernel
    prebuild_launcher(fn, args, meta)
    compiled = fn.warmup(*args, grid=grid, **meta)
    if getattr(compiled, "module", False) is None:      # a CompiledKernel not loaded yet
        compiled._init_handles()


def fast_launch(fn, interpret: bool):
    """``FastLaunch(fn)`` for a compiled kernel; ``fn`` itself under Triton's interpreter
    (``interpret``) or with ``FLASHLIGHT_FAST_LAUNCH=0``."""
    import os
    return fn if interpret or os.environ.get("FLASHLIGHT_FAST_LAUNCH") == "0" else FastLaunch(fn)
