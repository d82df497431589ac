"""Fusion and graphs side by side on third-party models: eager, reduce-overhead, ``cg.graph``,
``cg.graph(compile=True)``, ``cg.backend`` and ``cg.auto``'s choice.

Each model runs in a fresh process (compile caches and Dynamo's state do not carry over), fp32
with TF32 off, random weights, ``torch.no_grad()``. Every mode is built the way its
documentation says, its output compared with eager on a fresh input (fp32 tolerance: rtol and
atol 1e-4 after Inductor's reordering), then all modes are timed side by side in one run
(``cudagraphs.tools.timing``: interleaved windows, latency = a synchronize after each call).

    python benchmarks/fusion.py [--models vit_tiny,...,gru] [--modes eager,reduce-overhead,...]
                                [--windows 5] [--window-ms 0] [--json F] [--markdown F]

Baselines as a user writes them: ``torch.compile(model, mode="reduce-overhead")``;
``cg.graph(model, x)``; ``cg.graph(model, x, compile=True)``;
``torch.compile(model, backend=cg.backend)``; ``cg.auto(model, x)`` (its decision time is
reported, cold: a fresh saved-decision folder and Inductor cache, built before the other
rows; then a second process reuses both and reports the seconds until its first answer, and a
third, for scale, times reduce-overhead's start with the same Inductor cache).
The MLP's decision is marked ``@cg.eager`` (as the segments example does); the MoE model uses
transformers' default experts, which read their routing counts on the host.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from third_party_models import MODELS, args_modes, build, fresh_like

MODES = ("eager", "reduce-overhead", "cg.graph", "cg.graph compile=True", "cg.backend", "cg.auto")


def second_process(name: str, profile: bool = False) -> dict[str, Any]:
    """A new process that finds the first one's saved decision: seconds until the chosen way
    has answered its first call (the saved-decision folder and Inductor's cache on disk are
    the first process's). ``profile``: also where that start's seconds go (:class:`StackSampler`)."""
    import torch

    import cudagraphs as cg

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from torch._dynamo.utils import counters

    model, x = build(name)
    sampler = StackSampler() if profile else None
    with torch.no_grad():
        start = time.perf_counter()
        if sampler is not None:
            sampler.start()
        chosen = cg.auto(model, *x)
        decided = time.perf_counter() - start
        chosen(*fresh_like(x))
        torch.cuda.synchronize()
        ready = time.perf_counter() - start
        if sampler is not None:
            sampler.stop()
    result = {
        "ready_s": ready, "auto_returned_s": decided, "from_disk": chosen.report.from_disk,
        "chosen": chosen.report.chosen,
        "graphs_traced": counters["stats"]["unique_graphs"],  # 0: the compile came from disk
    }  # fmt: skip
    if sampler is not None:
        result["profile"] = sampler.costliest()
    return result


class StackSampler:
    """Where a start's seconds go: the main thread's stack, sampled every ``interval_s`` by a
    second thread; each function's seconds are the samples it was on the stack for (inclusive).
    cProfile is no use here: Dynamo's frame hook runs compiled frames without its events, so
    the functions above a compiled call lose their time."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.counts: Counter[str] = Counter()
        self.samples = 0
        self.target = threading.main_thread().ident
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.began = time.perf_counter()
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        self.seconds = time.perf_counter() - self.began

    def _run(self) -> None:
        while not self.done.wait(self.interval_s):
            frame = sys._current_frames().get(self.target)
            seen = set()
            while frame is not None:
                code = frame.f_code
                seen.add(f"{Path(code.co_filename).name}:{code.co_firstlineno}({code.co_name})")
                frame = frame.f_back
            self.counts.update(seen)
            self.samples += 1

    def costliest(self, top: int = 60) -> list[dict[str, Any]]:
        """The functions on the stack longest, the longest first, in seconds of the start."""
        per_sample = self.seconds / max(1, self.samples)
        return [
            {"function": function, "seconds": round(count * per_sample, 3)}
            for function, count in self.counts.most_common(top)
        ]


def second_process_reduce_overhead(name: str) -> dict[str, Any]:
    """The same start for reduce-overhead, for scale: a new process (its own imports, Dynamo's
    trace) with the first process's Inductor cache, seconds until its first three calls have
    answered (its warm-up and recording)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, x = build(name)
    with torch.no_grad():
        start = time.perf_counter()
        compiled = torch.compile(model, mode="reduce-overhead")
        for _ in range(3):
            compiled(*fresh_like(x))
        torch.cuda.synchronize()
    return {"reduce_overhead_ready_s": time.perf_counter() - start}


def calls_per_window(modes: dict[str, Any], inputs: list[Any], window_ms: float) -> int:
    """Calls per timing window, so that the fastest mode's window lasts about ``window_ms``
    (at least 20 calls): a window of a few milliseconds is at the mercy of one hiccup of the
    host."""
    import time

    import torch

    fastest = float("inf")
    for call in modes.values():
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(10):
            call(inputs[i % len(inputs)])
        torch.cuda.synchronize()
        fastest = min(fastest, (time.perf_counter() - start) / 10)
    return max(20, min(1000, int(window_ms / 1e3 / fastest)))


def child(name: str, windows: int, only: list[str], window_ms: float = 0.0) -> dict[str, Any]:
    import torch

    import cudagraphs as cg
    from cudagraphs.tools.timing import measure_side_by_side

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, x = build(name)

    def fresh() -> tuple[Any, ...]:
        return fresh_like(x)

    def first(out: Any) -> torch.Tensor:
        for field in ("last_hidden_state", "logits"):
            if hasattr(out, field):
                return getattr(out, field)
        return out

    calls: dict[str, Any] = {}
    rows: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        builders = {
            # cg.auto first, so that its decision is cold: no compile cached by another row.
            "cg.auto": lambda: cg.auto(model, *x),
            "eager": lambda: model,
            "reduce-overhead": lambda: torch.compile(model, mode="reduce-overhead"),
            "cg.graph": lambda: cg.graph(model, *x),
            "cg.graph compile=True": lambda: cg.graph(model, *x, compile=True),
            "cg.backend": lambda: torch.compile(model, backend=cg.backend),
        }
        for mode, make in builders.items():
            if mode not in only:
                continue
            start = time.perf_counter()
            try:
                call = make()
                for _ in range(4):  # compiles, warms up, captures
                    call(*fresh())
                torch.cuda.synchronize()
                built = time.perf_counter() - start
                probe = fresh()
                got, expected = first(call(*probe)).clone(), first(model(*probe))
                same = torch.allclose(got, expected, rtol=1e-4, atol=1e-4)
                err = (got - expected).abs().max().item()
                rows[mode] = {"build_s": built, "verified": bool(same), "max_error": err}
                if mode == "cg.auto":
                    rows[mode]["choice"] = call.report.chosen
                    rows[mode]["decision_s"] = call.report.decision_s
                    rows[mode]["candidates"] = [vars(c) for c in call.report.candidates]
                calls[mode] = call
            except Exception as error:  # a mode that fails is a row saying why
                rows[mode] = {"error": f"{type(error).__name__}: {str(error)[:160]}"}
        modes = args_modes(calls)
        inputs = [fresh() for _ in range(4)]
        calls_each = calls_per_window(modes, inputs, window_ms) if window_ms else 20
        timed = measure_side_by_side(modes, inputs, calls=calls_each, windows=windows)
    for mode, timing in timed.items():
        rows[mode]["us"] = timing.latency_us
        rows[mode]["throughput_us"] = timing.throughput_us  # calls back to back
    return {"model": name, "rows": rows, "gpu": torch.cuda.get_device_name(),
            "windows": windows, "calls_per_window": calls_each}  # fmt: skip


def markdown(results: list[dict[str, Any]]) -> str:
    """The table; a ``src tree`` column where results carry one (runs joined from several)."""
    trees = int(any("src_tree" in r for r in results))
    lines = [
        "fp32, TF32 off, random weights, `torch.no_grad()`; µs per call with a synchronize "
        "after each (median of interleaved windows, all modes of a model in one run); "
        "verified = output equal to eager on a fresh input (rtol = atol = 1e-4); "
        "Python's bytecode cache kept between processes, as an installed package has it; "
        "auto decision: cold, in the first process; second process: a new process reusing the "
        "saved decision and Inductor's on-disk cache, seconds until its first answer (in brackets: "
        "reduce-overhead's first three calls in a new process of its own with that cache, for "
        "scale).",
        "",
        "| model | "
        + " | ".join(MODES)
        + " | auto chose | auto decision s | second process s |"
        + (" src tree |" if trees else ""),
        "|---|" + "---|" * (len(MODES) + 3 + trees),
    ]
    details = []
    for result in results:
        rows = result["rows"]
        cells = []
        for mode in MODES:
            row = rows.get(mode, {})
            if "error" in row:
                cells.append(f"failed: {row['error'][:60]}")
            elif "us" in row:
                cells.append(f"{row['us']:.1f}" + (" ✓" if row["verified"] else " (NOT verified)"))
            else:
                cells.append("-")
        auto = rows.get("cg.auto", {})
        second = result.get("second", {})
        ready = f"{second['ready_s']:.1f}" if "ready_s" in second else "-"
        if "ready_s" in second and not second.get("from_disk"):
            ready += " (decided again)"
        if second.get("reduce_overhead_ready_s") is not None:
            ready += f" (reduce-overhead: {second['reduce_overhead_ready_s']:.1f})"
        lines.append(
            f"| {MODELS[result['model']]} | "
            + " | ".join(cells)
            + f" | {auto.get('choice', '-')} | {auto.get('decision_s', float('nan')):.1f}"
            + f" | {ready} |"
            + (f" {result.get('src_tree', '-')} |" if trees else "")
        )
        for c in auto.get("candidates", []):
            us = f"{c['us']:.1f} µs" if c.get("us") is not None else "not timed"
            state = "verified" if c["verified"] else f"rejected: {c['rejected']}"
            details.append(
                f"- {result['model']}, {c['name']}: {us}, {state}, built in {c['build_s']:.1f} s"
            )
    if details:
        lines += ["", "cg.auto's candidates, as its report gives them (timed in its own run):", ""]
        lines += details
    return "\n".join(lines) + "\n"


def fill_bytecode_cache(folder: str) -> None:
    """Every process starts with Python's compiled bytecode, as in an installed environment
    (pip writes it at install). Where the environment keeps none (``PYTHONDONTWRITEBYTECODE``
    over a read-only site-packages), each new process would compile thousands of torch's and
    transformers' modules from source, seconds that no user's second process pays: fill a
    cache folder for this run's processes first."""
    import importlib.util

    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = folder
    packages = ["torch", "transformers", "timm", "torchvision", "sympy", "cudagraphs"]
    found = [importlib.util.find_spec(p) for p in packages]
    roots = [str(Path(s.origin).parent) for s in found if s is not None and s.origin]
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j", "0", *roots],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument(
        "--window-ms", type=float, default=0.0,
        help="size each timing window to last this long for the fastest mode (0: 20 calls)",
    )  # fmt: skip
    parser.add_argument("--modes", default=",".join(MODES), help="a subset of the rows")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument(
        "--profile-second", action="store_true",
        help="profile the second process's start (a stack sampler; its seconds then include the "
        "profiler's own cost): its costliest calls go in the JSON",
    )  # fmt: skip
    parser.add_argument("--_second", help=argparse.SUPPRESS)
    parser.add_argument("--_second_ro", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        print(json.dumps(child(args._child, args.windows, args.modes.split(","), args.window_ms)))
        return 0
    if args._second:
        print(json.dumps(second_process(args._second, args.profile_second)))
        return 0
    if args._second_ro:
        print(json.dumps(second_process_reduce_overhead(args._second_ro)))
        return 0
    results = []
    bytecode = tempfile.TemporaryDirectory()
    fill_bytecode_cache(bytecode.name)
    for name in args.models.split(","):
        # A fresh saved-decision folder and Inductor cache per model: cg.auto decides cold,
        # and the second process finds what the first one left on disk.
        with tempfile.TemporaryDirectory() as saved, tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, CUDAGRAPHS_SAVED_STEPS_DIR=saved, TORCHINDUCTOR_CACHE_DIR=cache)
            command = [sys.executable, __file__, "--windows", str(args.windows)]
            command += ["--window-ms", str(args.window_ms)]
            done = subprocess.run(
                [*command, "--_child", name, "--modes", args.modes],
                capture_output=True, text=True, env=env,
            )  # fmt: skip
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                results.append({"model": name, "rows": {"eager": {"error": "the run crashed"}}})
                continue
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            if "cg.auto" in args.modes.split(","):
                again = subprocess.run(
                    [*command, "--_second", name, *(["--profile-second"] * args.profile_second)],
                    capture_output=True,
                    text=True,
                    env=env,
                )
                if again.returncode == 0:
                    results[-1]["second"] = json.loads(again.stdout.strip().splitlines()[-1])
                else:
                    results[-1]["second"] = {"error": again.stderr[-300:]}
                if "reduce-overhead" in args.modes.split(","):  # it can fail (the MoE model)
                    alone = subprocess.run(
                        [*command, "--_second_ro", name], capture_output=True, text=True, env=env
                    )
                    if alone.returncode == 0:
                        results[-1]["second"].update(
                            json.loads(alone.stdout.strip().splitlines()[-1])
                        )
        print(markdown(results[-1:]), flush=True)
        write(results, args.json, args.markdown)  # after each model: a run cut short keeps them
    print(markdown(results))
    return 0


def write(results: list[dict[str, Any]], json_path: str | None, markdown_path: str | None) -> None:
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(results, handle, indent=2)
    if markdown_path:
        with open(markdown_path, "w") as handle:
            handle.write(markdown(results))


if __name__ == "__main__":
    sys.exit(main())
