"""Functions with a step that cannot be recorded: segments against eager and the peers.

Workloads:

- ``mlp``: a 20-layer 256-wide Linear+GELU MLP, batch 8, with one host decision after layer 10
  (flip the sign of the hidden state if its mean is above a threshold: ``.item()``). Modes:
  eager; ``torch.compile(mode="reduce-overhead")`` (it splits at the ``.item()``);
  ``piecewise-cuda-graphs`` (installed from its wheel; the decision marked ``@no_graph``, static
  input and output buffers written by hand, as its README shows); ``cg.graph`` with the decision
  marked ``@cg.eager``; and the decision left unmarked under
  ``torch.compile(model, backend=cg.backend)``, where Dynamo splits at the ``.item()``. Two
  more rows take one check each out (``guard="capture"``, ``outputs="alias"``), to show what
  each costs in latency against the peer; they are measurements, not settings to use. Two rows
  replay the recording by hand: through its ``Segments`` (``copy_`` then ``replay()``), and
  graph by graph with the gap's function called directly, as the peer's sequence does. Checked
  against eager for both outcomes of the decision, then timed at threshold 0.
- ``resnet18``: torchvision's resnet18 (eval, fp32, batch 4 x 3 x 64 x 64), no graph break:
  eager, reduce-overhead, ``torch.compile(backend=cg.backend)`` and ``cg.graph``.
- ``moe``: a Mixtral-style causal LM (2 layers, fp32, random weights, the default experts
  implementation, whose grouped matmul reads its offsets on the host), batch 4 x 16. Modes:
  eager; ``cg.graph(..., eager=[MixtralSparseMoeBlock])`` (the MoE blocks run eagerly between
  three graphs); ``eager=[MixtralExperts]`` (only the experts eager: the router is recorded);
  and for reference the whole model in one graph with
  ``experts_implementation="batched_mm"``, which has no host read.

- ``moe-decode``: greedy decoding on that model, whole requests of 32 + 64 tokens at batch 4:
  ``model.generate`` (eager and with ``cache_implementation="static"``) against
  ``Decoder(model, eager=[MixtralSparseMoeBlock])`` and ``Decoder(model, eager=[MixtralExperts])``.

    python benchmarks/segments.py [--workloads mlp,moe] [--json PATH] [--markdown PATH]
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import common
import torch
from rich.console import Console

import cudagraphs as cg
from cudagraphs.tools.segment_workloads import DecisionMLP, flip_if_above
from cudagraphs.tools.timing import measure_side_by_side


def _timed(
    modes: dict[str, Any], inputs: list[Any], calls: int, windows: int,
    shape: list[int], segments: list[dict[str, Any]], errors: dict[str, float], note: str,
) -> dict[str, Any]:  # fmt: skip
    """Time the modes side by side; one workload's results."""
    timings = measure_side_by_side(modes, inputs, calls=calls, windows=windows)
    return {
        "shape": shape,
        "segments": segments,
        "max_abs_error_vs_eager": errors,
        "timings_us": {m: vars(t) for m, t in timings.items()},
        "note": note,
    }


def piecewise_peer(model: DecisionMLP, x: torch.Tensor) -> Any:
    """piecewise-cuda-graphs through its documented API: mark the decision ``@no_graph``,
    allocate static buffers, warm up on a side stream, capture into a sequence, replay."""
    try:
        from piecewise_cuda_graphs import CUDAGraphSequence, no_graph, piecewise_graph
    except ImportError:
        return None
    model.decide = no_graph(inspect.unwrap(flip_if_above))
    static_x = x.clone()
    static_out = torch.empty_like(model(x))

    def workload(src: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(model(src))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            workload(static_x, static_out)
    torch.cuda.current_stream().wait_stream(s)
    seq = CUDAGraphSequence()
    with piecewise_graph(seq):
        workload(static_x, static_out)

    def call(inp: torch.Tensor) -> torch.Tensor:
        static_x.copy_(inp)
        seq.replay()
        return static_out

    return call


@torch.no_grad()
def mlp(calls: int, windows: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DecisionMLP().cuda().eval()
    inputs = [torch.randn(8, 256, device="cuda") for _ in range(8)]
    peer_model = DecisionMLP().cuda().eval()
    peer_model.load_state_dict(model.state_dict())
    modes: dict[str, Any] = {"eager": model}
    modes["reduce-overhead"] = torch.compile(model, mode="reduce-overhead")
    peer = piecewise_peer(peer_model, inputs[0])
    if peer is not None:
        modes["piecewise-cuda-graphs"] = peer
    g = cg.graph(model, inputs[0])
    modes["cudagraphs segments"] = g
    # The same recording replayed by hand, as a hand-written graph would be: copy_ into the
    # input buffer, replay (no signature, address, mode or thread check; raw outputs).
    static_x, segments, static_out = g.inputs[0], g.graph, g.replayer.output

    def unchecked(x: torch.Tensor) -> torch.Tensor:
        static_x.copy_(x)
        segments.replay()
        return static_out

    modes["the same segments, unchecked replay"] = unchecked
    # Its graphs replayed one by one with the gap's function called directly, as the peer's
    # sequence does: what the Segments object and its gap's bookkeeping cost on top.
    pieces = [
        (lambda p=p: p.fn(*p.args, **p.kwargs)) if hasattr(p, "fn") else p.replay
        for p in g.replayer.recording.pieces
    ]

    copies = g.replayer.copies  # the first graph's copy-in node: off, the input is copy_'d

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        if copies is not None:
            copies.all_off()
        static_x.copy_(x)
        for piece in pieces:
            piece()
        return static_out

    modes["its graphs by hand, the gap called directly"] = by_hand
    # Where the checks' cost goes (not settings to use): the address guard checked only at
    # capture, and outputs handed out as the buffers themselves (no guarded hand-out).
    modes["segments, guard='capture' (cost of the address guard)"] = cg.graph(
        model, inputs[0], guard="capture"
    )
    modes["segments, outputs='alias' (cost of guarded outputs)"] = cg.graph(
        model, inputs[0], outputs="alias"
    )
    # The decision left unmarked: torch.compile splits at the .item(), each piece a cg.graph.
    plain = DecisionMLP().cuda().eval()
    plain.load_state_dict(model.state_dict())
    plain.decide = inspect.unwrap(flip_if_above)
    modes["torch.compile(backend=cg.backend)"] = torch.compile(plain, backend=cg.backend)
    twins: tuple[DecisionMLP, ...] = (peer_model, plain)
    # The same segments over Inductor's kernels (GELU fused into the matmul: half the kernels).
    fused = DecisionMLP().cuda().eval()
    fused.load_state_dict(model.state_dict())
    try:
        compiled = torch.compile(fused, mode="max-autotune-no-cudagraphs")
        modes["cudagraphs segments over torch.compile kernels"] = cg.graph(compiled, inputs[0])
        twins += (fused,)
    except Exception as error:
        print(f"segments over compiled kernels: {type(error).__name__}: {error}")
    errors: dict[str, float] = {}
    for threshold in (-1e9, 1e9, 0.0):  # always flip, never flip, then the natural decision
        model.threshold.fill_(threshold)
        for twin in twins:
            twin.threshold.fill_(threshold)
        for name, call in modes.items():
            for _ in range(3):  # reduce-overhead records on its second and third calls
                for x in inputs[:3]:
                    err = (call(x).clone() - model(x)).abs().max().item()
                    errors[name] = max(errors.get(name, 0.0), err)
    note = "20 Linear+GELU layers, the decision after layer 10, timed at threshold 0"
    return _timed(modes, inputs, calls, windows, [8, 256], g.segments, errors, note)


def _experts_class(model: Any) -> Any:
    """The class of the model's experts module (inside the MoE block), or None."""
    return next((type(m) for m in model.modules() if type(m).__name__.endswith("Experts")), None)


def _mixtral(implementation: str | None) -> Any:
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=4, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=256,
    )  # fmt: skip
    if implementation is not None:
        config._experts_implementation = implementation
    torch.manual_seed(1)
    return transformers.MixtralForCausalLM(config).cuda().eval()


@torch.no_grad()
def moe(calls: int, windows: int) -> dict[str, Any]:
    model = _mixtral(None)
    inputs = [torch.randint(0, 32000, (4, 16), device="cuda") for _ in range(4)]

    def forward(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits

    block = next(type(m) for m in model.modules() if "SparseMoe" in type(m).__name__)
    g = cg.graph(forward, inputs[0], eager=[block], modules=[model])
    modes: dict[str, Any] = {"eager": forward, f"cudagraphs segments (eager=[{block.__name__}])": g}
    experts = _experts_class(model)
    if experts is not None:  # a narrower gap: the router recorded, only the experts eager
        try:
            modes[f"cudagraphs segments (eager=[{experts.__name__}])"] = cg.graph(
                forward, inputs[0], eager=[experts], modules=[model]
            )
        except cg.CudaGraphsError as error:
            print(f"eager=[{experts.__name__}] could not be recorded: {str(error).splitlines()[0]}")
    errors = {name: max((call(x).clone() - forward(x)).abs().max().item() for x in inputs)
              for name, call in modes.items()}  # fmt: skip
    whole = _mixtral("batched_mm")
    whole.load_state_dict(model.state_dict())

    def forward_whole(ids: torch.Tensor) -> torch.Tensor:
        return whole(input_ids=ids, use_cache=False).logits

    try:
        whole_graph = cg.graph(forward_whole, inputs[0])
        errors["cudagraphs one graph (batched_mm)"] = max(
            (whole_graph(x) - forward(x)).abs().max().item() for x in inputs
        )
        modes["cudagraphs one graph (batched_mm)"] = whole_graph
        modes["eager (batched_mm)"] = forward_whole
    except cg.CaptureError as error:
        print(f"batched_mm could not be recorded whole: {str(error).splitlines()[0]}")
    half = _mixtral(None).to(torch.bfloat16)
    half.load_state_dict(model.state_dict())

    def forward_half(ids: torch.Tensor) -> torch.Tensor:
        return half(input_ids=ids, use_cache=False).logits

    try:  # bf16 takes the native grouped matmul: no host read
        whole_half = cg.graph(forward_half, inputs[0])
        errors["cudagraphs one graph (bf16)"] = max(
            (whole_half(x).float() - forward_half(x).float()).abs().max().item() for x in inputs
        )  # against bf16 eager
        modes["cudagraphs one graph (bf16)"] = whole_half
        modes["eager (bf16)"] = forward_half
    except cg.CaptureError as error:
        print(f"bf16 could not be recorded whole: {str(error).splitlines()[0]}")
    note = "Mixtral-style, 2 layers, hidden 1024, 8 experts top-2, fp32"
    return _timed(modes, inputs, calls, windows, [4, 16], g.segments, errors, note)


@torch.no_grad()
def resnet(calls: int, windows: int) -> dict[str, Any]:
    import torchvision

    torch.manual_seed(2)
    model = torchvision.models.resnet18().cuda().eval()
    inputs = [torch.randn(4, 3, 64, 64, device="cuda") for _ in range(4)]
    modes: dict[str, Any] = {
        "eager": model,
        "reduce-overhead": torch.compile(model, mode="reduce-overhead"),
        "torch.compile(backend=cg.backend)": torch.compile(model, backend=cg.backend),
        "cudagraphs cg.graph": cg.graph(model, inputs[0]),
    }
    errors: dict[str, float] = {}
    for name, call in modes.items():
        for _ in range(4):
            for x in inputs[:2]:
                err = (call(x).clone() - model(x)).abs().max().item()
                errors[name] = max(errors.get(name, 0.0), err)
    note = "torchvision resnet18, eval, fp32 (no graph break: one piece)"
    return _timed(modes, inputs, calls, windows, [4, 3, 64, 64], [{"kind": "graph"}], errors, note)


def _error(found: dict[str, Any], mode: str) -> str:
    error = found["max_abs_error_vs_eager"].get(mode)
    return "-" if error is None else f"{error:.1e}"


@torch.no_grad()
def moe_decode(calls: int, windows: int) -> dict[str, Any]:
    """Greedy decoding on the MoE model: whole requests of 32 + 64 tokens, batch 4."""
    import time

    from cudagraphs.decoding.decoder import Decoder

    model = _mixtral(None)
    block = next(type(m) for m in model.modules() if "SparseMoe" in type(m).__name__)
    prompt = torch.randint(0, 32000, (4, 32), device="cuda")
    new = 64
    decoder = Decoder(model, max_batch=4, max_length=32 + new, batch_sizes=[4], eager=[block])

    def hf(**extra: Any) -> Any:
        return model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
            min_new_tokens=new, do_sample=False, pad_token_id=0, **extra,
        )[:, 32:]  # fmt: skip

    runs = {
        "hf generate (eager)": hf,
        "hf generate (static cache)": lambda: hf(cache_implementation="static"),
        f"cudagraphs Decoder(eager=[{block.__name__}])": lambda: decoder.generate(
            prompt, max_new_tokens=new
        )[:, 32:],
    }
    experts = _experts_class(model)
    if experts is not None:  # the router recorded, only the experts eager
        try:
            narrow = Decoder(
                model, max_batch=4, max_length=32 + new, batch_sizes=[4], eager=[experts]
            )
            narrow.generate(prompt, max_new_tokens=new)
            runs[f"cudagraphs Decoder(eager=[{experts.__name__}])"] = lambda: narrow.generate(
                prompt, max_new_tokens=new
            )[:, 32:]
        except cg.CudaGraphsError as error:
            print(f"Decoder(eager=[{experts.__name__}]): {str(error).splitlines()[0]}")
    reference = hf()
    timings: dict[str, Any] = {}
    errors: dict[str, float] = {}
    for name, run in runs.items():
        out = run()  # a warm request (static generate compiles here)
        errors[name] = float((out != reference).sum().item())  # tokens that differ
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        timings[name] = {"latency_us": best * 1e6, "throughput_us": best * 1e6}
    return {
        "shape": [4, 32 + new],
        "segments": describe_decoder(decoder),
        "max_abs_error_vs_eager": errors,
        "timings_us": timings,
        "note": "greedy, whole requests (prefill + 64 tokens), best of 3; error column: tokens "
        "that differ from hf generate",
        "base": "hf generate (eager)",
    }


def describe_decoder(decoder: Any) -> list[dict[str, Any]]:
    graphed = next(iter(decoder.graphs.values()))
    return graphed.segments


WORKLOADS = {"mlp": mlp, "moe": moe, "resnet18": resnet, "moe-decode": moe_decode}


def main() -> int:
    p = common.parser(__doc__, "segments", calls=100, windows=5)
    p.add_argument("--workloads", default="mlp,moe,resnet18,moe-decode")
    args = p.parse_args()
    console = Console()
    if not common.cuda_or_explain("benchmarks/segments.py", console):
        return 0
    picked = common.names(p, "--workloads", args.workloads, list(WORKLOADS))
    results: dict[str, Any] = {**common.environment(args.calls, args.windows), "workloads": {}}
    md = [common.environment_line(results, "calls")]
    for name in picked:
        found = WORKLOADS[name](args.calls, args.windows)
        results["workloads"][name] = found
        timings = found["timings_us"]
        base = timings[found.get("base", "eager")]["latency_us"]
        rows = [
            [mode, f"{t['latency_us']:.1f}", f"{t['throughput_us']:.1f}",
             f"{base / t['latency_us']:.2f}x", _error(found, mode)]
            for mode, t in timings.items()
        ]  # fmt: skip
        title = f"{name} {found['shape']}: {found['note']}"
        rich_table, lines = common.table(
            title, ["mode", "latency µs", "throughput µs", "vs eager", "max |err|"], rows
        )
        console.print(rich_table)
        pieces = " | ".join(
            "graph" if r["kind"] == "graph" else f"eager {r['step']} ({r['location']})"
            for r in found["segments"]
        )
        md += ["", f"**{title}**", "", *lines, "", f"segments: {pieces}"]
    common.write(results, "\n".join(md) + "\n", args, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
