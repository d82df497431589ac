"""[compat] The one doorway to PyTorch's private names.

Everything here is a name PyTorch does not promise to keep. Each is used only through this
module (``tests/test_layers.py`` fails on a private torch name anywhere else), each has a
fallback or a clear error when a PyTorch release drops it, and each says what it is for.
Tested on torch 2.11 (GPU machine) and 2.11, 2.13 and the newest (CI); none older is claimed.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import sys
import types
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "forget_compiled_frames",
    "OPS_DISPATCH_MODE",
    "allocating_in_pool",
    "aot_compiler",
    "begin_allocate_to_pool",
    "clear_cublas_workspaces",
    "clear_dynamic_marks",
    "compile_cache",
    "compile_modes",
    "current_stream_handle",
    "current_stream_reader",
    "declare_amp_scaling",
    "end_allocate_to_pool",
    "foreach_add",
    "foreach_copy",
    "global_state_guard",
    "graph_exec",
    "graph_free_compile_modes",
    "inductor_compile",
    "guarded_storage",
    "guarded_tensor",
    "kill_storage",
    "module_state_inputs",
    "new_graph",
    "op_argument_defaults",
    "op_argument_names",
    "op_name",
    "op_returns_alias",
    "op_schema_arguments",
    "release_pool",
    "routes_allocations_to_pools",
    "share_module_state",
    "sleep_cycles",
    "storage_use_count",
    "tensor_address_reader",
    "tensors_at_addresses",
    "torch_function_enabled",
    "version",
]

_C: Any = torch._C


def version(value: Any) -> int:
    """A tensor's version counter: bumped by every in-place write (how writes by compiled
    kernels, which no dispatch mode sees, are noticed)."""
    return value._version


# --- the global modes a recording freezes (guards.py) ------------------------------------------


class _PythonStateGuard:
    """The same check in Python, where PyTorch's C guard is missing."""

    def __init__(self) -> None:
        self.state = self._now()

    @staticmethod
    def _now() -> tuple[Any, ...]:
        matmul = torch.backends.cuda.matmul
        return (
            torch.is_grad_enabled(),
            torch.get_default_dtype(),
            torch.are_deterministic_algorithms_enabled(),
            _tf32_matmuls(),
            matmul.allow_fp16_reduced_precision_reduction,
            matmul.allow_bf16_reduced_precision_reduction,
            *((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cuda", "cpu")),
        )

    def check(self) -> bool:
        return self._now() == self.state


def _tf32_matmuls() -> Any:
    try:
        return torch.backends.cuda.matmul.allow_tf32
    except RuntimeError:  # legacy and per-operation flags mixed: compare the precisions
        return tuple(getter(*args) for _, getter, args in float32_precisions())


def global_state_guard() -> Any:
    """An object whose ``check()`` is True while grad mode, autocast (every device type),
    TF32 and reduced-precision settings, the default dtype and determinism are as now: the
    guard torch.compile checks before running compiled code, one C call."""
    guards = getattr(getattr(_C, "_dynamo", None), "guards", None)
    make = getattr(guards, "GlobalStateGuard", None)
    return make() if make is not None else _PythonStateGuard()


#: A setting a recording depends on: (words for a message, getter, the getter's arguments).
Setting = tuple[str, Any, tuple[Any, ...]]


def backend_settings() -> list[Setting]:
    """Settings that choose a recording's kernels or their precision but that PyTorch's
    global-state guard does not cover, each read by a getter without arguments (cheap from C):
    TF32 in cuDNN, cuDNN on and deterministic, fp16 accumulation in cuBLAS; those this
    PyTorch has. The TF32 getter raises where the legacy and the per-operation flags were
    mixed; :func:`float32_precisions` then reads them one by one."""
    found: list[Setting] = []
    for words, name in (
        ("TF32 in cuDNN", "_get_cudnn_allow_tf32"),
        ("cuDNN enabled", "_get_cudnn_enabled"),
        ("cuDNN deterministic", "_get_cudnn_deterministic"),
        ("fp16 accumulation in cuBLAS matmuls", "_get_cublas_allow_fp16_accumulation"),
    ):
        getter = getattr(_C, name, None)
        if getter is not None:
            found.append((words, getter, ()))
    return found


def float32_precisions() -> list[Setting]:
    """The float32 precisions that decide TF32 in cuDNN's convolutions and recurrent layers
    and in cuBLAS's matmuls, with the levels they inherit from (empty where this PyTorch has
    no per-operation flags)."""
    precision = getattr(_C, "_get_fp32_precision_getter", None)
    if precision is None:
        return []
    return [
        (f"float32 precision ({backend}, {op})", precision, (backend, op))
        for backend, op in (
            ("cuda", "conv"),
            ("cuda", "rnn"),
            ("cuda", "matmul"),
            ("cuda", "all"),
            ("generic", "all"),
        )
    ]


def torch_function_enabled() -> bool:
    """Whether ``__torch_function__`` overrides are on (``DisableTorchFunction`` turns it off)."""
    check = getattr(_C, "_is_torch_function_enabled", None)
    return bool(check()) if check is not None else True


# --- guarded outputs (replay.py) -------------------------------------------------------------


def guarded_storage(data_ptr: int, device: torch.device, nbytes: int) -> Any:
    """A storage that aliases ``nbytes`` at ``data_ptr`` without owning them: what a guarded
    output is built on, so that marking it dead refuses every later read."""
    return _C._construct_storage_from_data_pointer(data_ptr, device, nbytes)


def guarded_tensor(meta: dict[str, Any], storage: Any) -> torch.Tensor:
    """A tensor of ``meta``'s size, strides, offset and dtype on ``storage``."""
    return _C._construct_CUDA_Tensor_From_Storage_And_Metadata(meta, storage)


def kill_storage(storage: Any, message: str) -> None:
    """Make every later data access through ``storage`` (and its views) raise ``message``."""
    _C._set_storage_data_ptr_access_error_msg(storage._cdata, message)


def storage_use_count(storage: Any) -> int:
    """How many owners ``storage`` has (the storage object itself and every tensor on it):
    above 1 while any output tensor or view built on it is alive somewhere."""
    return _C._storage_Use_Count(storage._cdata)


def foreach_copy(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i, as one multi-tensor kernel where PyTorch has it."""
    copy = getattr(torch, "_foreach_copy_", None)
    if copy is not None:
        copy(list(dst), list(src))
        return
    for d, s in zip(dst, src):
        d.copy_(s)


def foreach_add(tensors: Sequence[torch.Tensor], amount: int) -> None:
    """``tensor.add_(amount)`` for each of ``tensors`` in one multi-tensor operation (one
    kernel where compiled)."""
    torch._foreach_add_(list(tensors), amount)


def new_graph(*, keep: bool = False) -> torch.cuda.CUDAGraph:
    """A CUDA graph; ``keep``: its template stays after instantiation (launch.py edits
    nodes of the instantiated graph, found through the template)."""
    return torch.cuda.CUDAGraph(keep_graph=True) if keep else torch.cuda.CUDAGraph()


def graph_exec(graph: torch.cuda.CUDAGraph) -> int:
    """The instantiated graph's handle, instantiating a kept graph not yet replayed."""
    try:
        handle = graph.raw_cuda_graph_exec()
    except RuntimeError:
        handle = 0
    if not handle:
        graph.instantiate()
        handle = graph.raw_cuda_graph_exec()
    return handle


def share_module_state(view: torch.nn.Module, module: torch.nn.Module) -> None:
    """Make ``view`` hold the very parameter, buffer and child dicts of ``module`` (the
    graphed stand-in of training/graphed_module.py): one state, seen through both."""
    for name in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
        object.__setattr__(view, name, getattr(module, name))


# --- capture (capture.py, active_capture.py) -------------------------------------------------


def clear_cublas_workspaces() -> None:
    """Free cuBLAS's per-stream workspaces, so that a capture allocates its own in its pool."""
    _C._cuda_clearCublasWorkspaces()


def begin_allocate_to_pool(device_index: int, pool: Any) -> None:
    """Route every allocation on ``device_index`` to ``pool`` (and take a reference on it)."""
    _C._cuda_beginAllocateToPool(device_index, pool)


def end_allocate_to_pool(device_index: int, pool: Any) -> None:
    _C._cuda_endAllocateToPool(device_index, pool)


def release_pool(device_index: int, pool: Any) -> None:
    _C._cuda_releasePool(device_index, pool)


@contextlib.contextmanager
def allocating_in_pool(device_index: int, pool: Any) -> Iterator[None]:
    """Serve the allocations made in the block from ``pool`` (between two recordings that share
    it: the buffers a gap's outputs are kept in live as long as the graphs)."""
    _C._cuda_beginAllocateToPool(device_index, pool)
    try:
        yield
    finally:
        _C._cuda_endAllocateToPool(device_index, pool)
        _C._cuda_releasePool(device_index, pool)


def routes_allocations_to_pools() -> bool:
    """Whether this PyTorch can route allocations to a graph's pool mid-capture (2.8+)."""
    return hasattr(_C, "_cuda_beginAllocateToPool")


# --- the address check (guards.py) ---------------------------------------------------------


def tensor_address_reader() -> int | None:
    """The address of PyTorch's exported ``PyObject* -> data pointer`` function (made for
    Inductor's C++ wrapper), for the compiled address check; ``None`` where not exported."""
    guards = getattr(getattr(_C, "_dynamo", None), "guards", None)
    reader = getattr(guards, "_torchinductor_pyobject_tensor_data_ptr", None)
    return reader if isinstance(reader, int) else None


def current_stream_reader() -> int | None:
    """The address of PyTorch's exported C function ``aoti_torch_get_current_cuda_stream(int32
    device, void** stream)`` (made for Inductor's AOT C wrapper; returns 0 on success), for the
    graph launch in one C call (launch.py); ``None`` where the library or the name is missing."""
    import ctypes
    import os

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cuda.so")
    if not os.path.exists(path):
        return None
    try:
        library = ctypes.CDLL(path)  # already loaded by torch: the same library
        return ctypes.cast(library.aoti_torch_get_current_cuda_stream, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def current_stream_handle(device: int | None) -> functools.partial[int] | None:
    """A no-argument call returning the current CUDA stream's handle on ``device`` (default: the
    current device) as an int, cheap enough for every replay; ``None`` without CUDA or the
    private reader. The device is the partial's one argument."""
    read = getattr(_C, "_cuda_getCurrentRawStream", None)
    if read is None or not torch.cuda.is_available():
        return None
    return functools.partial(read, torch.cuda.current_device() if device is None else device)


def tensors_at_addresses(
    tensors: Sequence[torch.Tensor], ptrs: Sequence[int]
) -> Callable[[], bool] | None:
    """A one-call check that each tensor is at its address (cudagraph trees' helper, CUDA
    builds); ``None`` where missing."""
    equal = getattr(_C, "_tensors_data_ptrs_at_indices_equal", None)
    if equal is None:
        return None
    return functools.partial(equal, list(tensors), list(ptrs), list(range(len(tensors))))


# --- ops as the dispatcher sees them (writes.py, diagnose/watches.py) ---------------------


def op_name(func: Any) -> str:
    """The schema name of an aten op (``aten::add_``)."""
    return func._schema.name


def op_schema_arguments(func: Any) -> list[Any]:
    """An op's schema arguments (each with ``name`` and ``alias_info``)."""
    return list(func._schema.arguments)


def op_argument_names(func: Any) -> list[str]:
    """The names of an op's arguments, in order."""
    return [a.name for a in func._schema.arguments]


def op_argument_defaults(func: Any) -> dict[str, Any]:
    """The default values of an op's arguments that have one."""
    return {a.name: a.default_value for a in func._schema.arguments if a.has_default_value()}


def op_returns_alias(func: Any) -> bool:
    """Whether an op returns a view or alias of an argument."""
    return any(r.alias_info is not None for r in func._schema.returns)


def _dispatch_mode_base() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


#: The base class of a mode that sees every aten op (PyTorch's TorchDispatchMode).
OPS_DISPATCH_MODE: type = _dispatch_mode_base()


# --- optimizers (training/optimizers.py) -------------------------------------------------------


def declare_amp_scaling(optimizer: torch.optim.Optimizer) -> None:
    """What ``__init__`` sets for ``fused=True``: GradScaler then hands ``grad_scale`` and
    ``found_inf`` to ``step()`` instead of syncing on ``found_inf``."""
    optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]
    if hasattr(optimizer, "_need_device_dtype_check_for_fused"):
        optimizer._need_device_dtype_check_for_fused = True  # type: ignore[attr-defined]


# --- torch.compile and timing (integrations, tools) -------------------------------------------


def mark_dynamic(tensor: torch.Tensor, dim: int, high: int | None = None) -> None:
    """Tell ``torch.compile`` that dimension ``dim`` of ``tensor`` varies between calls, so one
    trace with a symbolic size serves them all (a size of 1 is still traced apart).

    ``high``: the size is at most that (and at least 2), which the trace then knows without a
    check of its own in the graph. A size below 2 is marked without the bound."""
    if high is None or tensor.shape[dim] < 2:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)
    else:
        torch._dynamo.mark_dynamic(tensor, dim, min=2, max=high)


def aot_compiler(
    fn: Callable[..., Any],
    settings: dict[str, Any],
    dynamic: bool | None,
    *,
    keyed: Collection[str] | None = None,
) -> Any:
    """``torch.compile(fn, fullgraph=True).aot_compile`` (or ``None``): a compile that another
    process loads with no trace; unwritable guards (globals, identities) left to the caller.
    ``keyed``: the importable names (:func:`qualified_name`) the caller keys the compile by;
    a trace that would drop an identity guard on something reached from its arguments that is
    not one of them raises instead (``None``: the caller keys by config and sources)."""
    mode, options = settings["mode"], settings["options"]
    opts = {**(torch._inductor.list_mode_options(mode) if mode else {}), **(options or {})}
    keep = _portable if keyed is None else functools.partial(_portable_keyed, keyed=set(keyed))
    with torch._dynamo.config.patch(enable_aot_compile=True):
        compiled = torch.compile(
            fn, fullgraph=True, dynamic=dynamic, options={**opts, "guard_filter_fn": keep}
        )
    return getattr(compiled, "aot_compile", None)


def with_builtins_in_globals(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` over a globals dict of its own that also holds the builtins under their names:
    torch 2.11's ``aot_compile`` asks that every global its generated code loads (``type``,
    for a transformers output) be found in the traced function's globals."""
    namespace = {**vars(builtins), **fn.__globals__}  # type: ignore[attr-defined]
    code = fn.__code__  # type: ignore[attr-defined]
    return types.FunctionType(
        code,
        namespace,
        fn.__name__,
        fn.__defaults__,
        fn.__closure__,  # type: ignore[attr-defined]
    )


def saved_entry_globals(
    entry: Any, fn: Callable[..., Any]
) -> dict[str, list[str] | dict[str, str]]:
    """What another process must hand back to load an ``aot_compile`` entry
    (``load_compiled_function(f_globals=...)``), by name: the modules its code reaches through
    globals the trace made up (``___module_collections_<id>_c0``, names that hold an object id
    of this process), and the builtins it loads as globals (``type``)."""
    artifacts = getattr(entry, "_artifacts", None)
    refs = getattr(getattr(artifacts, "runtime_env", None), "external_refs", None) or ()
    names = getattr(fn, "__globals__", {})
    modules = {
        ref: names[ref].__name__
        for ref in refs
        if ref.startswith("___module_") and isinstance(names.get(ref), types.ModuleType)
    }
    return {"modules": modules, "builtins": sorted(r for r in refs if hasattr(builtins, r))}


def _portable(entries: Sequence[Any]) -> list[bool]:
    bad = {"DICT_VERSION", "NN_MODULE", "ID_MATCH", "FUNCTION_MATCH", "CLASS_MATCH",
           "MODULE_MATCH", "CLOSURE_MATCH", "WEAKREF_ALIVE"}  # fmt: skip
    return [not (e.is_global or {e.guard_type, *e.derived_guard_types} & bad) for e in entries]


def _portable_keyed(entries: Sequence[Any], keyed: set[str]) -> list[bool]:
    keep = _portable(entries)
    for entry, kept in zip(entries, keep):
        if kept or entry.is_global:
            continue
        value = entry.value if entry.has_value else None
        if isinstance(value, types.CodeType):  # a function's code: its source file is hashed
            continue
        name = qualified_name(value) if entry.has_value else ""
        # A function of a keyed class (``Config.__getattribute__``) is that class's source.
        if not name or (name not in keyed and name.rsplit(".", 1)[0] not in keyed):
            raise RuntimeError(
                f"the guard {entry.guard_type} on {entry.name} cannot be saved: it checks the "
                "identity of an object the saved file's key does not name"
            )
    return keep


def qualified_name(value: Any) -> str:
    """``module.qualname`` of a class, function or builtin another process finds by that name
    ("" for anything else: an instance, a lambda, a function defined inside another)."""
    if isinstance(value, types.MethodType):
        owner = qualified_name(type(value.__self__))
        return f"{owner}.{value.__func__.__name__}" if owner else ""
    module = getattr(value, "__module__", None)
    name = getattr(value, "__qualname__", None)
    if not isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        return ""
    if not module or not name or "<" in name:
        return ""
    return f"{module}.{name}"


def clear_dynamic_marks(tensors: Sequence[Any]) -> None:
    """Undo :func:`mark_dynamic` on each tensor of ``tensors`` (the attributes it sets)."""
    for t in (t for t in tensors if isinstance(t, torch.Tensor)):
        for name in [n for n in vars(t) if n.startswith(("_dynamo_", "_has_dynamo", "_spec"))]:
            delattr(t, name)


def compile_modes() -> tuple[str, ...]:
    """The mode names ``torch.compile(mode=...)`` takes in this torch."""
    import torch._inductor

    return tuple(torch._inductor.list_mode_options())


def compile_cache() -> tuple[str, str]:
    """Inductor's on-disk cache folder, and a hash of Inductor's settings (as it keys it)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir(), inductor_config.get_hash().hex()


def sleep_cycles(cycles: int) -> None:
    """Keep the GPU busy spinning for about ``cycles`` clock cycles (a timing aid)."""
    torch.cuda._sleep(cycles)


# --- torch.compile pieces (integrations/dynamo.py) ---------------------------------------------


def graph_free_compile_modes() -> tuple[str, ...]:
    """The ``torch.compile`` modes that leave CUDA graphs to the caller (no Inductor
    ``triton.cudagraphs``): the ones a graph of this library may be laid over."""
    import torch._inductor

    modes = torch._inductor.list_mode_options()
    return tuple(name for name, settings in modes.items() if not settings.get("triton.cudagraphs"))


def inductor_compile(gm: Any, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """Inductor's compile of one Dynamo graph (what ``backend="inductor"`` does), with
    Inductor's own CUDA graphs off; the result takes the inputs as positional arguments, as
    Dynamo calls a backend's result."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, list(example_inputs), config_patches={"triton.cudagraphs": False})


def module_state_inputs(gm: Any, n: int) -> set[int]:
    """Positions of a Dynamo graph's inputs that are module parameters or buffers (Dynamo
    inlines modules and passes their state as inputs; its graph-argument metadata names where
    each came from). Empty where the metadata is missing: callers also treat every
    ``nn.Parameter`` as module state."""
    found: set[int] = set()
    try:
        placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    except AttributeError:
        return found
    for i, node in enumerate(placeholders[:n]):
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = getattr(source, "name", "")
        name = name() if callable(name) else str(name)  # a method in older versions
        if "_parameters[" in name or "_buffers[" in name:
            found.add(i)
    return found


# --- address guards (guards.py) --------------------------------------------------------------


#: The slot in which a ``DTensor`` (FSDP2's and tensor parallelism's parameters) holds its
#: shard on this rank: a plain tensor, which is what kernels, and so a graph, read by address.
_SHARD_SLOT = "_local_tensor"


def tensor_shard(t: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """``(slot, shard)`` for a ``DTensor``: the slot's name and the local tensor it holds now;
    ``None`` for any other tensor. A DTensor has no address of its own (``data_ptr()`` is 0),
    and ``module.to(...)`` swaps its shard under the same object."""
    # Not imported: no DTensor exists (and importing it here would cost every guard).
    module = sys.modules.get("torch.distributed.tensor")
    if module is None or not isinstance(t, module.DTensor):
        return None
    shard = getattr(t, _SHARD_SLOT, None)
    return (_SHARD_SLOT, shard) if isinstance(shard, torch.Tensor) else None


def module_slot_dicts(module: torch.nn.Module) -> list[tuple[str, dict[str, Any]]]:
    """``(name, mapping)`` for the parameter, buffer and child dicts ``nn.Module`` keeps in
    ``module`` and each submodule, empty ones too (a ``register_buffer`` after a capture lands
    in one), read, never written."""
    found = []
    for prefix, sub in module.named_modules():
        base = f"{type(module).__name__}{'.' + prefix if prefix else ''}"
        found += [(base, mapping) for mapping in (sub._parameters, sub._buffers, sub._modules)]
    return found


#: The hook dicts of an ``nn.Module`` whose entries run around its forward, and around its
#: backward: a hook added to or removed from one after a capture changes what eager computes.
_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_hooks")
_BACKWARD_HOOKS = ("_backward_pre_hooks", "_backward_hooks")


def module_hook_dicts(
    module: torch.nn.Module, backward: bool = False, recurse: bool = True
) -> list[tuple[str, dict[Any, Any]]]:
    """``(name, hooks)`` for each forward hook dict of ``module`` and (``recurse``) its
    submodules, and backward hook dict with ``backward``, empty ones too (a hook registered
    later lands in one), read, never written."""
    kinds = _FORWARD_HOOKS + (_BACKWARD_HOOKS if backward else ())
    found = []
    for prefix, sub in module.named_modules() if recurse else [("", module)]:
        base = f"{type(module).__name__}{'.' + prefix if prefix else ''}"
        for attribute in kinds:
            hooks = sub.__dict__.get(attribute)
            if isinstance(hooks, dict):
                found.append((f"{base}'s {attribute.strip('_').replace('_', ' ')}", hooks))
    return found


def global_hook_dicts(backward: bool = False) -> list[tuple[str, dict[Any, Any]]]:
    """``(name, hooks)`` for the hooks ``torch.nn.modules.module.register_module_forward_hook``
    and its kin run around every module's forward (and backward, with ``backward``)."""
    from torch.nn.modules import module as module_code

    kinds = _FORWARD_HOOKS + (_BACKWARD_HOOKS if backward else ())
    found = []
    for attribute in (f"_global{kind}" for kind in kinds):
        hooks = getattr(module_code, attribute, None)
        if isinstance(hooks, dict):
            found.append((attribute.strip("_").replace("_", " "), hooks))
    return found


def forget_compiled_frames(codes: Iterable[types.CodeType]) -> None:
    """Drop what ``torch.compile`` cached for these code objects, so that their next call
    traces again. Why: some releases' Dynamo guards do not cover a value a frame reads from a
    module's class (``type(model).scale``), and would run the old trace after it changed."""
    reset = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    reset = getattr(reset, "reset_code", None)
    if reset is None:  # not this release's private name: drop every trace instead
        torch._dynamo.reset_code_caches()
        return
    for code in codes:
        reset(code)
