"""What checking the plain Python values a capture read costs per call.

For each workload, a graph is captured (``cg.graph``, or one decode step of a ``Decoder``), and
the guard's watch over the values the recorded code read (``core/python_values.py``) is timed
alone: values guarded, ns per call of the check, ns per value. The whole guard's check (the
address check and the modes as well) and a whole call of the graph are timed beside it, so the
share of the value check in a call can be read off. Host time only: the check runs before the
launch.

    python benchmarks/guard_values.py [--json PATH] [--markdown PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import cudagraphs as cg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks' shared helpers
from common import per_call_ns

from cudagraphs.core.python_values import ValueWatch
from cudagraphs.tools.workloads import MODELS


def gpt2(device: str) -> tuple[Any, tuple[Any, ...]]:
    """HF GPT-2, 6 layers, width 384, 64 tokens (random weights)."""
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(n_layer=6, n_embd=384, n_head=6, vocab_size=50257, n_positions=128)
    model = GPT2Model(config).to(device).eval()

    def forward(ids: torch.Tensor) -> torch.Tensor:  # the hidden states, as a user graphs it
        return model(input_ids=ids, use_cache=False).last_hidden_state

    return forward, (torch.randint(0, 50257, (1, 64), device=device),)


def workloads(device: str) -> dict[str, Callable[[], tuple[Any, tuple[Any, ...]]]]:
    made: dict[str, Callable[[], tuple[Any, tuple[Any, ...]]]] = {}
    for name in ("deep_mlp", "transformer"):
        build, shape = MODELS[name]
        made[name] = lambda build=build, shape=shape: (
            build().to(device).eval(),
            (torch.randn(*shape, device=device),),
        )
    made["hf gpt2"] = lambda: gpt2(device)
    return made


def decoder_step(device: str) -> Any:
    """One captured decode step (batch 1) of a Decoder over a small Llama (random weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from cudagraphs.decoding.decoder import Decoder

    config = LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(device, torch.bfloat16).eval()
    decoder = Decoder(model, max_batch=1, max_length=256)
    return next(iter(decoder.graphs.values()))


def row(name: str, graph: Any, call: Callable[[], Any] | None) -> dict[str, Any]:
    values = list(getattr(graph, "read_values", []))
    watch = ValueWatch(values)
    guard = graph.guard
    watch_ns = per_call_ns(watch.stale)
    out = {
        "values": len(values),
        "names": [label for label, *_ in values][:12],
        "value_check_ns": watch_ns,
        "ns_per_value": watch_ns / len(values) if values else None,
        "guard_check_ns": per_call_ns(guard.check) if guard is not None else 0.0,
        "call_us": per_call_ns(call, calls=2000) / 1e3 if call is not None else None,
    }
    print(name, {k: v for k, v in out.items() if k != "names"}, flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("guard_values.py needs CUDA: a graph captures only there")
        return 0
    device = "cuda"
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    rows: dict[str, Any] = {}
    with torch.no_grad():
        for name, make in workloads(device).items():
            model, example = make()
            graph = cg.graph(model, *example)

            def call(graph: Any = graph, example: tuple[Any, ...] = example) -> Any:
                out = graph(*example)
                torch.cuda.synchronize()
                return out

            rows[name] = row(name, graph, call)
        rows["decoder step"] = row("decoder step", decoder_step(device), None)
    results["rows"] = rows
    lines = [
        f"Hardware: {results['gpu']}, torch {results['torch']}; host time per call "
        "(median of 7 repeats).",
        "",
        "| workload | values guarded | value check ns | ns per value | whole guard ns | call µs |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        per = f"{r['ns_per_value']:.0f}" if r["ns_per_value"] else "-"
        call = f"{r['call_us']:.1f}" if r["call_us"] else "-"
        lines.append(
            f"| {name} | {r['values']} | {r['value_check_ns']:.0f} | {per} | "
            f"{r['guard_check_ns']:.0f} | {call} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
