"""What every benchmark script shares: its command line, the CUDA check, writing results."""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

RESULTS = Path(__file__).parent / "results"


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


def cuda_or_explain(script: str, console: Console) -> bool:
    """True on a CUDA machine; otherwise say why nothing is measured (and exit 0 after)."""
    if torch.cuda.is_available():
        return True
    console.print(f"{script} measures CUDA graphs and needs a CUDA GPU; none is available.")
    return False


def write(results: Any, markdown: str, args: argparse.Namespace, console: Console) -> None:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2, default=str))
    if args.markdown:
        args.markdown.write_text(markdown)
    console.print(f"wrote {args.json}")
