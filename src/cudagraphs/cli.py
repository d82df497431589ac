"""Command line: ``python -m cudagraphs demo`` and ``python -m cudagraphs doctor FILE.py:FUNC``."""

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
    doctor = commands.add_parser(
        "doctor",
        help="list what in a function would break capture or corrupt a graph",
        description="FILE.py:FUNC names a function that takes no arguments and returns "
        "(callable, args) or (callable, args, kwargs); the callable is examined on those inputs. "
        "Exit code 1 when a finding breaks capture or would make replays wrong.",
    )
    doctor.add_argument("target", metavar="FILE.py:FUNC")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return _doctor(parser, args.target)
    if args.command == "demo":
        if args.calls < 1 or args.windows < 1:
            parser.error("--calls and --windows must be at least 1")
        from .demo import run_demo

        return run_demo(calls=args.calls, windows=args.windows)
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse refuses first
    return 2


def _doctor(parser: argparse.ArgumentParser, target: str) -> int:
    import importlib.util
    from pathlib import Path

    from rich.console import Console

    from .doctor import doctor

    path, _, name = target.rpartition(":")
    if not path or not name:
        parser.error(f"target must be FILE.py:FUNC, got {target!r}")
    if not Path(path).is_file():
        parser.error(f"{path}: no such file")
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(Path(path).resolve().parent))
    spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        parser.error(f"{path} has no function {name!r}")
    made = factory()
    if not isinstance(made, tuple) or len(made) not in (2, 3) or not callable(made[0]):
        parser.error(f"{name}() must return (callable, args) or (callable, args, kwargs)")
    fn, fn_args = made[0], tuple(made[1])
    fn_kwargs = dict(made[2]) if len(made) == 3 else {}
    report = doctor(fn, *fn_args, **fn_kwargs)
    console = Console()
    if report.findings:
        console.print(report)
    else:
        console.print(str(report))
    return 1 if report.blocking else 0


if __name__ == "__main__":
    sys.exit(main())
