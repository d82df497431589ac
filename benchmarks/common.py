"""What every benchmark script shares: its command line, the CUDA check, writing results, runs
in fresh processes, and the weight-streaming roofline's two terms (the bytes a decode step reads,
the GPU's peak memory bandwidth)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).parent / "results"
# Published peak memory bandwidth, bytes/s, by a name torch gives the GPU (the first that is
# part of it); other GPUs: from the memory clock and bus width the driver reports.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12}


def parser(doc: str | None, name: str, *, calls: int, windows: int) -> argparse.ArgumentParser:
    """--calls, --windows, --json (default benchmarks/results/NAME.json) and --markdown."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--calls", type=int, default=calls, help=f"calls per timing window (default {calls})"
    )
    p.add_argument(
        "--windows", type=int, default=windows, help=f"timing windows (default {windows})"
    )
    p.add_argument("--json", type=Path, default=RESULTS / f"{name}.json")
    p.add_argument("--markdown", type=Path, default=None, help="also write the tables as markdown")
    return p


def environment(calls: int, windows: int) -> dict[str, Any]:
    """Where and how a benchmark ran, for the head of its JSON."""
    return {
        "hardware": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "calls_per_window": calls,
        "windows": windows,
    }


def environment_line(results: dict[str, Any], unit: str) -> str:
    """The first line of a benchmark's markdown: where it ran and how it was timed."""
    return (
        f"Hardware: {results['hardware']}, torch {results['torch']}, CUDA {results['cuda']}; "
        f"medians of {results['windows']} interleaved windows of {results['calls_per_window']} {unit}."
    )


def table(title: str, header: list[str], rows: list[list[str]]) -> tuple[Table, list[str]]:
    """The same rows as a rich table (the console) and as markdown lines (the reports)."""
    rich_table = Table(title=title)
    for i, h in enumerate(header):
        rich_table.add_column(h, justify="left" if i == 0 else "right")
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        rich_table.add_row(*row)
        md.append("| " + " | ".join(row) + " |")
    return rich_table, md


def names(parser: argparse.ArgumentParser, flag: str, value: str, choices: list[str]) -> list[str]:
    """A comma-separated option's names, or a parser error naming the unknown ones."""
    picked = [n for n in value.split(",") if n]
    unknown = [n for n in picked if n not in choices]
    if unknown:
        parser.error(f"{flag}: unknown {unknown}; choose from {choices}")
    return picked


def cuda_or_explain(script: str, console: Console) -> bool:
    """True on a CUDA machine; otherwise say why nothing is measured (and exit 0 after)."""
    if torch.cuda.is_available():
        return True
    console.print(f"{script} measures CUDA graphs and needs a CUDA GPU; none is available.")
    return False


def write_rows(
    results: Any, lines: list[str], what: str, args: argparse.Namespace, console: Console
) -> None:
    """:func:`write`, the markdown being a line of where it ran and ``what`` ran, then the
    table's ``lines``."""
    head = f"Hardware: {results['hardware']}, torch {results['torch']}; {what}."
    write(results, "\n".join([head, "", *lines]), args, console)


def write(results: Any, markdown: str, args: argparse.Namespace, console: Console) -> None:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2, default=str))
    if args.markdown:
        args.markdown.write_text(markdown)
    console.print(f"wrote {args.json}")


def fresh_process(argv: list[str], cache_dir: str, what: str) -> dict[str, Any]:
    """Run a benchmark script's child (``python ARGV``) in a fresh process whose on-disk compile
    cache is ``cache_dir``; the last line it prints is its JSON result."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"{what} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parent_or_child(
    p: argparse.ArgumentParser, child: Callable[[argparse.Namespace], dict[str, Any]]
) -> argparse.Namespace | None:
    """Parse a fresh-process benchmark's command line (``--json``, ``--markdown`` and the hidden
    ``--_child`` are added here). In a child (``--_child WHICH``, as :func:`fresh_process`
    starts it) print ``child(args)`` as its JSON result line and return ``None``; in the parent
    return the arguments."""
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("--_child", dest="which", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    if not args.which:
        return args
    with torch.no_grad():
        print(json.dumps(child(args)))
    return None


def memory_bandwidth() -> float:
    """The GPU's peak memory bandwidth in bytes/s (the roofline's rate): the published figure
    for the GPUs in ``PEAK_BANDWIDTH``, else twice the memory clock times the bus width (double
    data rate); NaN on the CPU, where no roofline share is given."""
    if not torch.cuda.is_available():
        return float("nan")
    name = torch.cuda.get_device_name()
    for part, peak in PEAK_BANDWIDTH.items():
        if part in name:
            return peak
    props = torch.cuda.get_device_properties()
    return 2 * props.memory_clock_rate * 1e3 * props.memory_bus_width / 8


def at_bandwidth(bandwidth: float) -> str:
    """`` at N TB/s`` naming the roofline's rate in a report, or ``""`` where there is none (NaN
    on the CPU)."""
    return f" at {bandwidth / 1e12:.2f} TB/s" if bandwidth > 0 else ""


def weight_bytes(model: Any) -> int:
    """Bytes a decode step streams: every weight but the input embedding (only rows gathered)."""
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed or tied)


def per_call_ns(fn: Callable[[], Any], calls: int = 20000, repeats: int = 7) -> float:
    """Median over ``repeats`` of the mean ns per call of ``fn`` in a tight loop (host time)."""
    import statistics
    import time

    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter_ns() - start) / calls)
    return statistics.median(times)
