"""The launches of a Decoder's compiled decode step on a CUDA device, read without one.

Inductor writes a compiled step's code per device: which work shares a Triton kernel, and
which products and operators are called in between. This script runs a ``Decoder(compile=...)``
(or, ``--variants engine``, an ``Engine(compile=True)``: its step of rows at their own lengths)
on the CPU and, for every graph Inductor compiles there, has Inductor write the same graph's code
for a CUDA device too (an H100/H200-class device: 132 SMs, compute capability 9.0), which it
reads and never runs. It counts, per decode step (a token for each row), the Triton kernels
that code launches and the operators it calls (cuBLAS products, the attention operator, the
fused-projection product), and lists one layer's launches in order.

Needs a CUDA build of torch with Triton (what pip installs on Linux), no GPU; the CPU build of
torch cannot write CUDA code. What it cannot see: how many kernels a library call launches
(cuBLAS may split a one-row product into a partial product and a reduction), any time, and
rewrites made before Inductor's code generation that depend on the device (the graph is traced
on the CPU: under ``coordinate_descent_tuning`` a GPU's one-row products become reductions,
the CPU's stay products).
``benchmarks/decode_profile.py`` counts the kernels a GPU runs.

The attention of one token is the library's one-kernel operator on a GPU; on the CPU a stand-in
operator of the same signature takes its place, opaque to Inductor as the real one is.

    python benchmarks/step_kernels.py --model llama-2048 --variants default,no-combo,cublas
    python benchmarks/step_kernels.py --model llama-2048 --batch 16 --variants default,engine
"""

from __future__ import annotations

import os

# Neither Inductor's graph cache nor AOTAutograd's: a graph loaded from either (an earlier run's,
# on disk) is written for no device here. Set before torch is imported: torch reads its config
# per thread, and an engine compiles its steps on its own worker thread, which a patch made on
# this one would not reach.
os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"

import argparse
import contextlib
import copy
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from common import RESULTS, write
from rich.console import Console
from torch.utils._python_dispatch import TorchDispatchMode

#: ``--variants``: the Decoder's ``compile=`` argument of each ("cublas": the default, on a
#: model the user fused with ``fuse_projections(model)`` first, which keeps cuBLAS's products
#: where the Decoder's own fusion sends every one-row product to the Triton kernel).
VARIANTS: dict[str, Any] = {
    "default": True,
    "no-combo": {"combo_kernels": False},
    "cublas": True,
    # An engine's step (``Engine(compile=True)``): rows at their own lengths, each writing
    # its own cache position through an index, on one batch and cache-length rung.
    "engine": True,
    # The same step uncompiled (the engine's default): the operations it dispatches, each one
    # kernel on a GPU, counted on the CPU as they run (views, which launch nothing, left out).
    "engine-eager": False,
}

#: What Inductor reads of the device it writes code for (an H100/H200-class GPU).
SMS, CAPABILITY = 132, (9, 0)
ATTENTION = "cudagraphs_bench::one_token_attention"


@torch.library.custom_op(ATTENTION, mutates_args=())
def one_token_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """The CPU stand-in for ``decode_attention``: the same inputs, opaque to Inductor."""
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=True
    )


@one_token_attention.register_fake
def _(query, key, value, mask, scale):  # type: ignore[no-untyped-def]
    return torch.empty_like(query)


class _Properties:
    """``torch.cuda.get_device_properties`` of the device the code is written for."""

    multi_processor_count = SMS
    major, minor = CAPABILITY
    name = "probe (H100/H200-class)"
    warp_size = 32
    max_threads_per_multi_processor = 2048
    regs_per_multiprocessor = 65536
    total_memory = 80 << 30
    L2_cache_size = 50 << 20
    shared_memory_per_block_optin = 232448
    gcnArchName = ""


@contextlib.contextmanager
def _a_cuda_device_for_codegen() -> Iterator[None]:
    """While Inductor writes code for ``cuda:0``: the device queries it makes answered, and
    Triton's compile of the result refused (the code is read, not run)."""
    import torch._inductor.codegen.triton as triton_codegen
    import torch._inductor.scheduler as scheduler
    import torch.utils._triton as triton_utils
    from torch._inductor.runtime import hints

    properties = hints.DeviceProperties(
        type="cuda", index=0, multi_processor_count=SMS, cc=90, major=CAPABILITY[0],
        regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
        max_threads_per_block=1024, warp_size=32,
    )  # fmt: skip
    replaced: list[tuple[Any, str, Any]] = [
        (torch.cuda, "is_available", lambda: True),
        (torch.cuda, "device_count", lambda: 1),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "get_device_capability", lambda *a, **k: CAPABILITY),
        (torch.cuda, "get_device_properties", lambda *a, **k: _Properties()),
        (torch.cuda, "get_device_name", lambda *a, **k: _Properties.name),
        (torch.cuda, "get_rng_state", lambda *a, **k: torch.zeros(16, dtype=torch.uint8)),
        (torch.cuda, "set_rng_state", lambda *a, **k: None),
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch.cuda, "_exchange_device", lambda index: -1),
        (torch.cuda, "_maybe_exchange_device", lambda index: -1),
        (scheduler, "has_triton", lambda: True),
        (hints.DeviceProperties, "create", classmethod(lambda cls, device: properties)),
        (triton_utils, "triton_backend", lambda: "cuda"),
        (triton_utils, "triton_hash_with_backend", lambda: "step-kernels"),
        (triton_codegen, "triton_hash_with_backend", lambda: "step-kernels"),
    ]
    before = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in replaced]
    for owner, name, value in replaced:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in before:
            setattr(owner, name, value)


def _on_cuda(value: Any) -> Any:
    if isinstance(value, torch.device) and value.type == "cpu":
        return torch.device("cuda", 0)
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cuda(v) for v in value)
    if isinstance(value, dict):
        return {k: _on_cuda(v) for k, v in value.items()}
    return value


def _cuda_code(
    compile_graph: Callable[..., Any], gm: Any, inputs: Any, to_check: Any, kwargs: Any
) -> str | None:
    """The wrapper code Inductor writes for ``gm`` (an AOT graph traced on the CPU) on a CUDA
    device: the graph re-traced with every device and input moved there, under fake tensors."""
    from torch._guards import detect_fake_mode
    from torch._inductor.graph import GraphLowering
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    moved = copy.deepcopy(gm)
    for node in moved.graph.nodes:
        node.args, node.kwargs = _on_cuda(node.args), _on_cuda(node.kwargs)
    moved.recompile()
    fake = detect_fake_mode(inputs) or FakeTensorMode()
    with fake:
        cuda_inputs = [
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda:0")
            if isinstance(t, torch.Tensor)
            else t
            for t in inputs
        ]
        traced = make_fx(moved)(*cuda_inputs)
    written: list[str] = []
    saved = GraphLowering.save_output_code
    GraphLowering.save_output_code = staticmethod(written.append)  # type: ignore[assignment]
    try:
        with _a_cuda_device_for_codegen(), torch._inductor.config.patch(fx_graph_cache=False):
            compile_graph(traced, cuda_inputs, to_check, **kwargs)
    except Exception:  # Triton cannot compile for a device that is not there: expected
        pass
    finally:
        GraphLowering.save_output_code = saved  # type: ignore[assignment]
    return written[0] if written else None


@contextlib.contextmanager
def cuda_code_of_every_compile(codes: list[str]) -> Iterator[None]:
    """Within: every graph Inductor compiles for the CPU is also written for a CUDA device, its
    wrapper code appended to ``codes``."""
    import torch._inductor.compile_fx as compile_fx

    original = compile_fx.fx_codegen_and_compile

    def both(gm: Any, inputs: Any, to_check: Any, **kwargs: Any) -> Any:
        code = _cuda_code(original, gm, inputs, to_check, kwargs)
        if code is not None:
            codes.append(code)
        return original(gm, inputs, to_check, **kwargs)

    compile_fx.fx_codegen_and_compile = both
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):
            yield
    finally:
        compile_fx.fx_codegen_and_compile = original


_LAUNCH = re.compile(
    r"^\s*(?:\w+ = )?(triton_\w+)\.run\(|^\s*(?:\w+ = )?((?:extern_kernels|torch\.ops)\.[\w.]+)\("
)


def launches(code: str) -> list[str]:
    """The kernels and operator calls of a wrapper's ``call``, in order: a Triton kernel by its
    name, an operator by its qualified name."""
    body = code[code.index("def call(") :]
    found = []
    for line in body.splitlines():
        match = _LAUNCH.match(line)
        if match:
            found.append(match.group(1) or match.group(2))
    return found


_SOURCE = re.compile(r"async_compile\.triton\('(\w+)', '''(.*?)'''", re.S)


def dependent_launches(code: str) -> dict[str, list[str]]:
    """The Triton kernels of a wrapper compiled for programmatic dependent launch
    (``launched``), and those of them whose source never waits for the kernel before it
    (``gdc_wait``): ``without_wait``. A kernel launched that way must wait before it ends, or
    one launched after it may read what the kernel before it is still writing."""
    sources = dict(_SOURCE.findall(code))
    launched = [name for name, source in sources.items() if "'launch_pdl': True" in source]
    without = [name for name in launched if "gdc_wait" not in sources[name]]
    return {"launched": launched, "without_wait": without}


def _kind(name: str) -> str:
    if name.startswith("triton_"):
        return {"poi": "pointwise", "red": "reduction", "per": "reduction"}.get(
            name.split("_")[1], name.split("_")[1]
        )
    return name.removeprefix("torch.ops.").removeprefix("extern_kernels.").removesuffix(".default")


class _Operations(TorchDispatchMode):
    """The operations dispatched inside it, in order, as ``aten.mm`` or ``ns.custom_op``:
    one kernel each on a GPU, roughly. Views, detaches and Python numbers made tensors
    launch nothing and are left out."""

    _NO_KERNEL = frozenset({"scalar_tensor", "lift_fresh", "detach", "alias", "_unsafe_view"})

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not func.is_view and func.overloadpacket.__name__ not in self._NO_KERNEL:
            self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _eager_engine_step(model: Any, args: argparse.Namespace) -> list[str]:
    """The operations of one uncompiled engine step of every slot, on one batch and cache rung."""
    from cudagraphs.decoding import Engine
    from cudagraphs.decoding.slot_steps import slot_step

    with Engine(
        model, max_batch=args.batch, max_length=args.max_length, batch_sizes=[args.batch],
        cache_lengths=[args.max_length],
    ) as engine:  # fmt: skip
        step = slot_step(
            model, engine.cache_arg, engine.cache, engine.state, args.batch, args.max_length,
            "greedy",
        )  # fmt: skip
        with _Operations() as operations:
            step()
    return operations.names


def _engine_steps(model: Any, args: argparse.Namespace) -> None:
    """An ``Engine(compile=True)`` of one batch rung and one cache-length rung, every slot
    decoding two tokens: its step and its prompt chunks are compiled (in its set-up)."""
    from cudagraphs.decoding import Engine

    if args.batch < 2:
        raise SystemExit("--variants engine: an engine's compiled steps start at batch 2")
    with Engine(
        model, max_batch=args.batch, max_length=args.max_length, batch_sizes=[args.batch],
        cache_lengths=[args.max_length], compile=True,
    ) as engine:  # fmt: skip
        generator = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, model.config.vocab_size, (args.batch, 8), generator=generator)
        done = [engine.submit(p.tolist(), max_new_tokens=2, eos_token_id=None) for p in prompts]
        for completion in done:
            completion.result()


def step_launches(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    from cudagraphs.decoding import grouped_attention
    from cudagraphs.decoding.decoder import Decoder
    from cudagraphs.tools.workloads import random_llama

    model = random_llama(args.model, "cpu", getattr(torch, args.dtype))
    if variant == "cublas":
        from cudagraphs.decoding.fused_projections import fuse_projections

        fuse_projections(model)
    layers = model.config.num_hidden_layers
    codes: list[str] = []
    torch._dynamo.reset()
    applies, attention = grouped_attention.applies, grouped_attention.decode_attention
    # The one-token attention a GPU step calls, stood in for on the CPU (see the module doc).
    grouped_attention.applies = lambda q, k, v, mask: q.shape[2] == 1  # type: ignore[assignment]
    grouped_attention.decode_attention = one_token_attention  # type: ignore[assignment]
    eager: list[str] = []
    try:
        with cuda_code_of_every_compile(codes), torch.no_grad():
            if variant == "engine-eager":
                eager = _eager_engine_step(model, args)
            elif variant == "engine":
                _engine_steps(model, args)
            else:
                decoder = Decoder(
                    model, max_batch=args.batch, max_length=args.max_length,
                    batch_sizes=[args.batch], compile=VARIANTS[variant], save_compile=False,
                )  # fmt: skip
                prompt = torch.randint(0, model.config.vocab_size, (args.batch, 8))
                decoder.generate(prompt, max_new_tokens=2, eos_token_id=None)
    finally:
        grouped_attention.applies, grouped_attention.decode_attention = applies, attention
    steps = [code for code in codes if ATTENTION.replace("::", ".") in code]
    if eager:
        step, dependent = eager, {"launched": [], "without_wait": []}
    elif steps:
        step, dependent = launches(steps[-1]), dependent_launches(steps[-1])
    else:
        raise SystemExit(
            f"{variant}: no compiled step was written for a CUDA device ({len(codes)} graphs "
            "compiled): this torch's Inductor differs from what this script expects"
        )
    attention_calls = [i for i, name in enumerate(step) if ATTENTION.split("::")[1] in name]
    first, second = attention_calls[0], attention_calls[1]
    kinds: dict[str, int] = {}
    for name in step:
        kinds[_kind(name)] = kinds.get(_kind(name), 0) + 1
    return {
        "variant": variant,
        "compile_argument": repr(VARIANTS[variant]),
        "dependent_kernels": len(dependent["launched"]),
        "dependent_without_wait": dependent["without_wait"],
        "launches_per_step": len(step),
        "layers": layers,
        "launches_per_layer": second - first,
        "by_kind": kinds,
        "one_layer": [_kind(name) for name in step[first + 1 : second + 1]],
    }


def markdown(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    lines = [
        f"{args.model}, {args.dtype}, batch {args.batch}, cache {args.max_length}; torch "
        f"{torch.__version__}, code written for a CUDA device (compute capability 9.0), read "
        "on the CPU. A library call counts once (cuBLAS may launch two kernels for it).",
        "",
        "| variant | launches per step | per layer | one layer, from its attention on |",
        "|---|---|---|---|",
    ]
    if any(r["variant"] == "engine-eager" for r in runs):
        lines[1:1] = [
            "engine-eager: the uncompiled step's operations as they were dispatched on the CPU, "
            "views left out (one kernel each on a GPU, roughly)."
        ]
    for r in runs:
        lines.append(
            f"| {r['variant']} | {r['launches_per_step']} | {r['launches_per_layer']} | "
            f"{', '.join(r['one_layer'])} |"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="llama-2048")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--max-length", type=int, default=168)
    p.add_argument("--variants", default="default,no-combo")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    args = p.parse_args()
    variants = args.variants.split(",")
    if any(v not in VARIANTS for v in variants):
        p.error(f"--variants {args.variants}: expected some of {', '.join(VARIANTS)}")
    if torch.version.cuda is None:
        raise SystemExit(
            f"torch {torch.__version__} is a CPU build, which cannot write CUDA code: install "
            "pip's default torch (a CUDA build, which runs on a machine without a GPU)"
        )
    warnings.filterwarnings("ignore")
    runs = [step_launches(args, v) for v in variants]
    text = "\n".join(markdown(runs, args))
    console = Console()
    console.print(text)
    args.json = args.json or RESULTS / f"step-kernels-{args.model}-b{args.batch}.json"
    write(runs, text + "\n", args, console)


if __name__ == "__main__":
    main()
