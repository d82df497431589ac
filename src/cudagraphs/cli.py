"""Command line: ``python -m cudagraphs demo``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cudagraphs",
        description="CUDA graphs in PyTorch, safe, fast and easy.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="run the brief's workloads eagerly and graphed, check and time them"
    )
    demo.add_argument(
        "--calls", type=int, default=100, help="calls per timing window (default 100)"
    )
    demo.add_argument("--windows", type=int, default=5, help="timing windows (default 5)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.calls < 1 or args.windows < 1:
            parser.error("--calls and --windows must be at least 1")
        from .demo import run_demo

        return run_demo(calls=args.calls, windows=args.windows)
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse refuses first
    return 2


if __name__ == "__main__":
    sys.exit(main())
