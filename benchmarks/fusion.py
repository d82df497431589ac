"""Fusion and graphs side by side on third-party models: eager, reduce-overhead, ``cg.graph``,
``cg.graph(compile=True)``, ``cg.backend`` and ``cg.auto``'s choice.

Each model runs in a fresh process (compile caches and Dynamo's state do not carry over), fp32
with TF32 off, random weights, ``torch.no_grad()``. Every mode is built the way its
documentation says, its output compared with eager on a fresh input (fp32 tolerance: rtol and
atol 1e-4 after Inductor's reordering), then all modes are timed side by side in one run
(``cudagraphs.tools.timing``: interleaved windows, latency = a synchronize after each call).

    python benchmarks/fusion.py [--models vit_tiny,efficientnet_b0,convnext_atto,resnet50,gpt2]
                                [--windows 5] [--json F] [--markdown F]

Baselines as a user writes them: ``torch.compile(model, mode="reduce-overhead")``;
``cg.graph(model, x)``; ``cg.graph(model, x, compile=True)``;
``torch.compile(model, backend=cg.backend)``; ``cg.auto(model, x)`` (its decision time is
reported, cold: a fresh saved-decision folder).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

MODELS = {
    "vit_tiny": "timm vit_tiny_patch16_224, batch 1",
    "efficientnet_b0": "timm efficientnet_b0, batch 1",
    "convnext_atto": "timm convnext_atto, batch 1",
    "resnet50": "timm resnet50, batch 1",
    "gpt2": "HF GPT-2, 6 layers, width 384, 64 tokens, batch 1",
}
MODES = ("eager", "reduce-overhead", "cg.graph", "cg.graph compile=True", "cg.backend", "cg.auto")


def build(name: str) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2Model

        config = GPT2Config(n_layer=6, n_embd=384, n_head=6, vocab_size=50257, use_cache=False)
        model = GPT2Model(config).cuda().eval()
        ids = torch.randint(0, 50257, (1, 64), device="cuda")
        return model, ids
    import timm

    timm_name = {"vit_tiny": "vit_tiny_patch16_224"}.get(name, name)
    model = timm.create_model(timm_name, pretrained=False).cuda().eval()
    return model, torch.randn(1, 3, 224, 224, device="cuda")


def child(name: str, windows: int) -> dict[str, Any]:
    import torch

    import cudagraphs as cg
    from cudagraphs.tools.timing import measure_side_by_side

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, x = build(name)
    fresh = (
        (lambda: torch.randint_like(x, 0, 50257))
        if name == "gpt2"
        else (lambda: torch.randn_like(x))
    )

    def first(out: Any) -> torch.Tensor:
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out

    calls: dict[str, Any] = {}
    rows: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        builders = {
            "eager": lambda: model,
            "reduce-overhead": lambda: torch.compile(model, mode="reduce-overhead"),
            "cg.graph": lambda: cg.graph(model, x),
            "cg.graph compile=True": lambda: cg.graph(model, x, compile=True),
            "cg.backend": lambda: torch.compile(model, backend=cg.backend),
            "cg.auto": lambda: cg.auto(model, x, reuse=False),
        }
        for mode, make in builders.items():
            start = time.perf_counter()
            try:
                call = make()
                for _ in range(4):  # compiles, warms up, captures
                    call(fresh())
                torch.cuda.synchronize()
                built = time.perf_counter() - start
                probe = fresh()
                got, expected = first(call(probe)).clone(), first(model(probe))
                same = torch.allclose(got, expected, rtol=1e-4, atol=1e-4)
                err = (got - expected).abs().max().item()
                rows[mode] = {"build_s": built, "verified": bool(same), "max_error": err}
                if mode == "cg.auto":
                    rows[mode]["choice"] = call.report.chosen
                    rows[mode]["decision_s"] = call.report.decision_s
                calls[mode] = call
            except Exception as error:  # a mode that fails is a row saying why
                rows[mode] = {"error": f"{type(error).__name__}: {str(error)[:160]}"}
        inputs = [fresh() for _ in range(4)]
        timed = measure_side_by_side(
            {mode: _one_argument(call) for mode, call in calls.items()},
            inputs,
            calls=20,
            windows=windows,
        )
    for mode, timing in timed.items():
        rows[mode]["us"] = timing.latency_us
    return {"model": name, "rows": rows, "gpu": torch.cuda.get_device_name()}


def _one_argument(call: Any) -> Any:
    return lambda a: call(a)


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "fp32, TF32 off, random weights, `torch.no_grad()`; µs per call with a synchronize "
        "after each (median of interleaved windows, all modes of a model in one run); "
        "verified = output equal to eager on a fresh input (rtol = atol = 1e-4).",
        "",
        "| model | " + " | ".join(MODES) + " | auto chose | auto decision s |",
        "|---|" + "---|" * (len(MODES) + 2),
    ]
    for result in results:
        rows = result["rows"]
        cells = []
        for mode in MODES:
            row = rows.get(mode, {})
            if "error" in row:
                cells.append(f"failed: {row['error'][:60]}")
            elif "us" in row:
                cells.append(f"{row['us']:.1f}" + ("" if row["verified"] else " (NOT verified)"))
            else:
                cells.append("-")
        auto = rows.get("cg.auto", {})
        lines.append(
            f"| {MODELS[result['model']]} | "
            + " | ".join(cells)
            + f" | {auto.get('choice', '-')} | {auto.get('decision_s', float('nan')):.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        print(json.dumps(child(args._child, args.windows)))
        return 0
    results = []
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as saved:  # cg.auto decides cold
            env = dict(os.environ, CUDAGRAPHS_SAVED_STEPS_DIR=saved)
            done = subprocess.run(
                [sys.executable, __file__, "--_child", name, "--windows", str(args.windows)],
                capture_output=True, text=True, env=env,
            )  # fmt: skip
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            results.append({"model": name, "rows": {"eager": {"error": "the run crashed"}}})
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(markdown(results[-1:]), flush=True)
    text = markdown(results)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
