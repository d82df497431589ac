"""GPU tests carry the `cuda` marker: skipped without a GPU, refused to skip under gpu-check.

The ``stand_in`` fixture runs the captured call path on the CPU: warm-up and capture are replaced
by a recording that logs the aten operations the function runs, and whose ``replay()`` runs those
operations again on the same tensors without calling the function. A Python value, a branch or a
global read at capture is then frozen as in a CUDA graph, so the guards' CPU tests can fail.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import optree
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import cudagraphs as cg
from cudagraphs.core import capture as capture_module
from cudagraphs.core import compat
from cudagraphs.core.signature import NAMESPACE
from cudagraphs.core.writes import WriteRecorder


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    if os.environ.get("CUDAGRAPHS_REQUIRE_CUDA"):
        raise pytest.UsageError(
            "CUDAGRAPHS_REQUIRE_CUDA is set but torch.cuda.is_available() is False: the GPU "
            "suite would skip instead of run"
        )
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# The README's command deselects the slow checks (-m 'not slow' in pyproject's addopts). Under
# pytest-xdist the workers deselect and the summary would not mention them: each worker sends
# the ids back (xdist's workeroutput) and the controller counts and lists them.
_DESELECTED_BY_WORKERS: set[str] = set()


def pytest_deselected(items: list[pytest.Item]) -> None:
    if items and hasattr(items[0].config, "workeroutput"):
        sent = items[0].config.workeroutput.setdefault("deselected", [])
        sent.extend(item.nodeid for item in items)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    _DESELECTED_BY_WORKERS.update(getattr(node, "workeroutput", {}).get("deselected", ()))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    ids = sorted(_DESELECTED_BY_WORKERS)
    if not ids:
        return
    # Entries of the summary line's count; plugins read each entry's __dict__, as of a report.
    terminalreporter.stats.setdefault("deselected", []).extend(
        types.SimpleNamespace(nodeid=nodeid) for nodeid in ids
    )
    per_file: dict[str, int] = {}
    for nodeid in ids:
        per_file[nodeid.split("::")[0]] = per_file.get(nodeid.split("::")[0], 0) + 1
    terminalreporter.write_sep("=", f"{len(ids)} deselected")
    terminalreporter.write_line(
        f"-m {config.option.markexpr!r} leaves these out; the slow checks run with: "
        "python -m pytest -q -m slow"
    )
    for path, count in per_file.items():
        terminalreporter.write_line(f"DESELECTED [{count}] {path}")


class _OpLog(TorchDispatchMode):
    """Every aten operation a recording run makes, with the very tensors it took and gave."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # As the library's WriteRecorder: without it Dynamo refuses to compile under the mode
        # and runs the function eagerly from then on, so a compiled function recorded here
        # would silently stop being compiled. Its kernels (aten, under the stand-in's
        # backend) still run under the mode, and are logged.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class ReplayingGraph:
    """Replays the logged operations on the same tensors, without running the function: what
    the recording run made (intermediates, outputs) is refilled in place, as a graph refills
    its pool, and every Python value the run read stays what it was then."""

    def __init__(self, ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]]):
        self.ops = ops
        self.replays = 0

    def replay(self) -> None:
        # The logged operations are below autograd already (a backward's too): rerun as data.
        with torch.no_grad():
            for func, args, kwargs, recorded in self.ops:
                fresh = func(*args, **kwargs)
                for old, new in zip(_tensors(recorded), _tensors(fresh)):
                    if old is not new:
                        old.copy_(new)
        self.replays += 1

    def pool(self) -> tuple[int, int]:
        return (0, 0)


class StandInOutput(torch.Tensor):
    """A guarded output on the CPU. PyTorch marks a storage dead only in its CUDA builds, so
    the stand-in gives each output (and every view taken of it) the mark of the storage it was
    built on, and refuses any use once the library marked that storage dead, with the message
    the library gave: what a CUDA build does to a stale output."""

    _mark: list[str | None]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        leaves = optree.tree_leaves((args, kwargs))
        marks = [t._mark for t in leaves if isinstance(t, StandInOutput)]
        for mark in marks:
            if mark[0] is not None:
                raise RuntimeError(mark[0])
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if not marks:
            return out
        with torch._C.DisableTorchFunctionSubclass():
            memory = {
                t.untyped_storage().data_ptr() for t in leaves if isinstance(t, StandInOutput)
            }
        return optree.tree_map(lambda o: _marked(o, marks[0], memory), out)


def _marked(value: Any, mark: list[str | None], memory: set[int]) -> Any:
    """A tensor result that shares an output's memory (a view) carries its mark."""
    if not isinstance(value, torch.Tensor) or isinstance(value, StandInOutput):
        return value
    with torch._C.DisableTorchFunctionSubclass():
        if value.untyped_storage().data_ptr() not in memory:
            return value
    view = value.as_subclass(StandInOutput)
    view._mark = mark
    return view


_MARKS: dict[int, list[str | None]] = {}


def _guarded_tensor(meta: dict[str, Any], storage: Any) -> torch.Tensor:
    plain = torch.empty(0, dtype=meta["dtype"]).set_(
        storage, meta["storage_offset"], meta["size"], meta["stride"]
    )
    out = plain.as_subclass(StandInOutput)
    out._mark = _MARKS.setdefault(id(storage), [None])
    return out


def _kill_storage(storage: Any, message: str) -> None:
    _MARKS.pop(id(storage), [None])[0] = message


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


class _NoStream:
    device = None

    def wait_stream(self, other: Any) -> None:
        pass


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The captured call path on the CPU; a replay reruns the operations the capture logged,
    never the Python function, so whatever Python read at capture stays frozen, as in a
    graph."""

    def capture(fn: Any, args: Any, kwargs: Any, *_: Any, **__: Any) -> capture_module.Recording:
        # A real capture records kernels without running them: state the function writes
        # outside its inputs is left as it was (only the input buffers' versions move).
        inputs = [x for x in optree.tree_leaves((args, kwargs), namespace=NAMESPACE)]
        recorder = WriteRecorder(exclude=[x for x in inputs if isinstance(x, torch.Tensor)])
        log = _OpLog()
        with recorder, log:
            output = fn(*args, **kwargs)
        recorder.restore()
        return capture_module.Recording(ReplayingGraph(log.ops), output, 0.0, 0)  # type: ignore[arg-type]

    def warm_up(
        fn: Any,
        args: Any,
        kwargs: Any,
        n: int,
        stream: Any,
        *,
        checked: Any = None,
        after_each: Any = None,
    ) -> float:
        with checked() if checked is not None else contextlib.nullcontext():
            for _ in range(n):
                fn(*args, **kwargs)
                if after_each is not None:
                    after_each()
        return 0.0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # torch.compile saves and restores the CUDA generator around each trace once CUDA is
    # "available": a CPU build has none, so the stand-in's is an empty state.
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *_: torch.empty(0, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *_: None)
    # compile=True: Dynamo traces and guards as on a GPU, and its graphs run as aten operations
    # (the aot_eager backend), which the recording logs and a replay reruns; Inductor's CPU
    # kernels would run outside the log.
    real_compile = torch.compile

    def compile_to_aten(
        fn: Any = None, *, mode: Any = None, options: Any = None, **rest: Any
    ) -> Any:
        if torch.version.cuda is not None:
            # A CUDA build without a GPU (CI's newest and floor runs): once CUDA reports
            # available, Dynamo asks the driver for its current stream. The CPU build runs it.
            pytest.skip("compile=True on the stand-in needs a CPU build of torch")
        rest.pop("backend", None)
        return real_compile(fn, backend="aot_eager", **rest)

    monkeypatch.setattr(torch, "compile", compile_to_aten)
    _replace_everywhere(monkeypatch, "graphable", lambda t: True)
    monkeypatch.setattr(cg.Pool, "handle", property(lambda self: (0, 0)))
    monkeypatch.setattr(torch.cuda, "device", lambda _: contextlib.nullcontext())
    _replace_everywhere(monkeypatch, "default_stream", lambda _: _NoStream())
    _replace_everywhere(monkeypatch, "warm_up", warm_up)
    monkeypatch.setattr(torch.cuda, "stream", lambda _: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *_: _NoStream())
    _replace_everywhere(monkeypatch, "capture_call", capture)
    monkeypatch.setattr(compat, "guarded_tensor", _guarded_tensor)
    monkeypatch.setattr(compat, "kill_storage", _kill_storage)
    # No streams here to keep in order (and on a CUDA build without a GPU the real reader would
    # ask the driver for the current device).
    monkeypatch.setattr(compat, "current_stream_handle", lambda device: None)
    yield
    gc.collect()  # graphs of the test mark their outputs dead while the stand-in is in place


def _replace_everywhere(monkeypatch: pytest.MonkeyPatch, name: str, fake: Any) -> None:
    """Replace a function of the core's capture module, and every binding of it that another
    module of the library imported by name (the training layer takes ``warm_up`` from the
    core's front door)."""
    real = getattr(capture_module, name)
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("cudagraphs") and getattr(module, name, None) is real:
            monkeypatch.setattr(module, name, fake)


@pytest.fixture(autouse=True)
def cuda_left_usable(request: pytest.FixtureRequest) -> Any:
    """After each GPU test: CUDA still takes work. A capture left open on any stream (in the
    global mode every later CUDA call then fails) stops the run here, naming the test, instead
    of failing every test after it for a reason that is not theirs."""
    yield
    if "cuda" not in request.keywords or not torch.cuda.is_available():
        return
    try:
        (torch.ones(1, device="cuda") + 1).sum().item()
    except Exception as error:  # any failure here means the process is broken
        pytest.exit(
            f"{request.node.nodeid} left CUDA unusable ({type(error).__name__}: "
            f"{str(error).splitlines()[0]}); the tests after it could not run",
            returncode=1,
        )


@pytest.fixture
def fresh_compile_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    """An empty folder for the decode steps a ``Decoder`` saves (``saved_compile.py``), for
    this test: what it compiles is not loaded from an earlier test or run. Inductor's own
    cache stays shared (a trace still happens; only its kernels may be found)."""
    from cudagraphs.core import compat

    real = compat.compile_cache
    monkeypatch.setattr(compat, "compile_cache", lambda: (str(tmp_path), real()[1]))
    return tmp_path


@pytest.fixture
def pdl_decided_afresh() -> Iterator[Any]:
    """A function that makes ``decoding/matvec.py`` decide again whether kernels use
    programmatic dependent launch (it decides once per process, from ``CUDAGRAPHS_PDL`` and the
    device): call it after changing either. The decision is forgotten again after the test."""
    from cudagraphs.decoding import matvec

    def afresh() -> None:
        matvec.pdl_requested.cache_clear()
        matvec.pdl.cache_clear()

    afresh()
    yield afresh
    afresh()


@pytest.fixture
def gloo_group() -> Iterator[None]:
    """A gloo process group of one rank on the CPU (a free loopback port), destroyed after."""
    import torch.distributed as dist
    from ports import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
