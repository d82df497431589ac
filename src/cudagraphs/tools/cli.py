"""Command line: ``cudagraphs demo | bench FILE.py:FUNC | doctor FILE.py:FUNC | serve FILE.py:MAKE``
(also ``python -m cudagraphs ...``).

Exit codes: 0 done (doctor: no blocking finding), 1 doctor found a blocking finding, 2 a usage
mistake (one line and the subcommand's usage), 3 the user's own code raised (one line naming
the user's frame; ``--traceback`` prints the whole traceback).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import install_extra

__all__ = ["main"]


USER_CODE_RAISED = 3


class UserCodeRaised(Exception):
    """The user's file, maker or function raised: reported in one line, exit code 3."""

    def __init__(self, what: str, error: BaseException):
        super().__init__(what)
        self.what, self.error = what, error


def _prog() -> str:
    """The name the command was invoked by: the console script's, or ``python -m cudagraphs``."""
    invoked = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    if not invoked or invoked in ("__main__.py", "-c") or invoked.endswith(".py"):
        return "python -m cudagraphs"
    return invoked


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line: the top-level parser and each command's own (for its usage errors)."""
    parser = argparse.ArgumentParser(
        prog=_prog(),
        description="CUDA graphs in PyTorch, safe, fast and easy.",
        epilog="exit codes: 0 done, 1 doctor found a blocking finding, 2 usage mistake, "
        "3 your code raised (--traceback for the whole traceback)",
    )
    parser.add_argument("--version", action="version", version=f"cudagraphs {_version()}")
    parser.add_argument(
        "--traceback",
        action="store_true",
        help="when your code raises, print the whole traceback instead of one line",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    return parser, {
        name: add(commands)
        for name, add in (("demo", _add_demo), ("doctor", _add_doctor), ("bench", _add_bench),
                          ("serve", _add_serve), ("auto", _add_auto))
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser, commands = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(commands["serve"], args)
        if args.command == "doctor":
            return _doctor(commands["doctor"], args.target)
        if args.command == "bench":
            return _bench(commands["bench"], args)
        if args.command == "auto":
            return _auto(commands["auto"], args)
    except UserCodeRaised as raised:
        return _report_user_error(raised, full=args.traceback)
    if args.command == "demo":
        if args.calls < 1 or args.windows < 1:
            commands["demo"].error("--calls and --windows must be at least 1")
        from .demo import run_demo

        return run_demo(_console(), calls=args.calls, windows=args.windows)
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse refuses first
    return 2


def _add_demo(commands: Any) -> argparse.ArgumentParser:
    command = commands.add_parser(
        "demo",
        help="run small launch-bound workloads eagerly and graphed, check and time them",
        description="An MLP, a transformer, a training step and an RL rollout, each checked "
        "against eager and timed side by side; without CUDA it shows what still works.",
    )
    command.add_argument(
        "--calls", type=int, default=30, help="calls per timing window (default 30)"
    )
    command.add_argument("--windows", type=int, default=3, help="timing windows (default 3)")
    return command


def _add_doctor(commands: Any) -> argparse.ArgumentParser:
    command = commands.add_parser(
        "doctor",
        help="list what in a function would break capture or corrupt a graph",
        description="FILE.py:FUNC names a function that takes no arguments and returns "
        "(callable, args) or (callable, args, kwargs); the callable is examined on those inputs. "
        "Exit code 1 when a finding breaks capture or would make replays wrong, 3 when your "
        "code raised.",
    )
    command.add_argument("target", metavar="FILE.py:FUNC")
    _traceback_option(command)
    return command


def _add_auto(commands: Any) -> argparse.ArgumentParser:
    from .choosing import CANDIDATES  # the list the help names is the one auto tries

    command = commands.add_parser(
        "auto",
        help="try the ways of graphing a function, verify each, print the table and the choice",
        description="FILE.py:FUNC names a function that takes no arguments and returns "
        f"(callable, args) or (callable, args, kwargs). Each way that applies "
        f"({', '.join(CANDIDATES)}) is built, compared with eager and timed; the decision is "
        "saved for the next process. Exit code 3 when your code raised.",
    )
    command.add_argument("target", metavar="FILE.py:FUNC")
    command.add_argument("--json", action="store_true", help="print the report as JSON")
    command.add_argument(
        "--fresh", action="store_true", help="decide again instead of using a saved decision"
    )
    _traceback_option(command)
    return command


def _auto(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ..diagnose import findings_located_at
    from .choosing import auto

    fn, fn_args, fn_kwargs = _load_target(parser, args.target)
    try:
        with findings_located_at(*_maker_location(args.target)):
            chosen = auto(fn, *fn_args, reuse=not args.fresh, **fn_kwargs)
    except Exception as error:
        raise UserCodeRaised(f"trying {args.target}", error) from error
    print(chosen.report.to_json() if args.json else chosen.report)
    return 0


def _add_bench(commands: Any) -> argparse.ArgumentParser:
    command = commands.add_parser(
        "bench",
        help="time a function eagerly, compiled and graphed, side by side",
        description="FILE.py:FUNC names a function that takes no arguments and returns "
        "(callable, args) or (callable, args, kwargs). Every mode is checked against eager, "
        "then timed side by side; prints a table, optionally writes JSON and a PNG chart.",
    )
    command.add_argument("target", metavar="FILE.py:FUNC")
    _traceback_option(command)
    command.add_argument(
        "--modes",
        default=None,
        help="comma-separated subset of: eager,compile,reduce-overhead,cudagraphs,"
        "cudagraphs+compile (default: all)",
    )
    command.add_argument(
        "--compile-mode",
        default="max-autotune-no-cudagraphs",
        help="torch.compile mode for the compiled modes (default max-autotune-no-cudagraphs)",
    )
    command.add_argument("--calls", type=int, default=50, help="calls per window (default 50)")
    command.add_argument("--windows", type=int, default=5, help="timing windows (default 5)")
    command.add_argument(
        "--no-check", action="store_true", help="do not compare outputs with eager"
    )
    command.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    command.add_argument("--plot", type=Path, default=None, help="write a PNG chart here")
    return command


def _add_serve(commands: Any) -> argparse.ArgumentParser:
    command = commands.add_parser(
        "serve",
        help="serve the HTTP app that FILE.py:MAKE builds, with uvicorn",
        description="FILE.py:MAKE names a function that takes no arguments and returns an ASGI "
        "app (a FastAPI app, say examples/serve_http.py:make). Needs the serve extra: "
        f"{install_extra('serve')}.",
    )
    command.add_argument("target", metavar="FILE.py:MAKE")
    command.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    command.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    return command


def _bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:

    from .benchmarking import MODES, bench

    modes = None
    if args.modes is not None:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        unknown = [m for m in modes if m not in MODES]
        if unknown or not modes:
            parser.error(
                f"--modes: unknown {unknown or args.modes!r}; choose from {','.join(MODES)}"
            )
    if args.calls < 1 or args.windows < 1:
        parser.error("--calls and --windows must be at least 1")
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        parser.error(f"--plot writes a PNG; give a path ending in .png, got {str(args.plot)!r}")
    fn, fn_args, fn_kwargs = _load_target(parser, args.target)
    try:
        report = bench(
            fn,
            *fn_args,
            modes=modes,
            compile_mode=args.compile_mode,
            calls=args.calls,
            windows=args.windows,
            check=not args.no_check,
            name=args.target,
            **fn_kwargs,
        )
    except Exception as error:
        raise UserCodeRaised(f"benchmarking {args.target}", error) from error
    console = _console()
    console.print(report)
    if report.profile is not None:
        console.print(report.profile)
    if args.json is not None:
        console.print(f"wrote {report.to_json(args.json)}")
    if args.plot is not None:
        console.print(f"wrote {report.plot(args.plot)}")
    return 0


def _call_maker(parser: argparse.ArgumentParser, target: str) -> tuple[Any, str]:
    """Import FILE.py and call its FUNC(); what it made and FUNC's name. Every mistake is one
    line through ``parser.error`` (exit code 2, the subcommand's usage, no traceback)."""
    import importlib.util
    import inspect

    path, _, name = target.rpartition(":")
    if not path or not name:
        parser.error(f"target must be FILE.py:FUNC, got {target!r}")
    if not path.endswith(".py"):
        parser.error(f"{path}: not a .py file; give the Python file that defines {name}")
    if not Path(path).is_file():
        parser.error(f"{path}: no such file")
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered like an import: libraries that resolve names through sys.modules (pydantic,
    # for a FastAPI body model's annotations; dataclasses; pickle) then find the module.
    sys.modules[spec.name] = module
    sys.path.insert(0, str(Path(path).resolve().parent))
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        raise UserCodeRaised(f"{path}:{error.lineno}: syntax error: {error.msg}", error) from error
    except Exception as error:
        raise UserCodeRaised(f"importing {path}", error) from error
    factory = getattr(module, name, None)
    if not callable(factory):
        parser.error(f"{path} has no function {name!r}")
    required = [
        p.name
        for p in inspect.signature(factory).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if required:
        parser.error(
            f"{name}({', '.join(required)}) takes arguments, so it is the function itself, not a "
            f"maker; add `def make(): return {name}, (example inputs...)` to {path} and pass "
            f"{path}:make"
        )
    try:
        made = factory()
    except Exception as error:
        raise UserCodeRaised(f"{name}()", error) from error
    return made, name


def _load_target(parser: argparse.ArgumentParser, target: str) -> tuple[Any, tuple, dict]:
    """FUNC() of FILE.py:FUNC as ``(callable, args, kwargs)``; mistakes as in ``_call_maker``."""
    made, name = _call_maker(parser, target)
    if isinstance(made, tuple) and len(made) in (2, 3) and callable(made[0]):
        return made[0], tuple(made[1]), dict(made[2]) if len(made) == 3 else {}
    got = (
        f"a tuple of {len(made)} ({', '.join(type(m).__name__ for m in made)})"
        if isinstance(made, tuple)
        else f"a {type(made).__name__}"
    )
    parser.error(
        f"{name}() must return (callable, args) or (callable, args, kwargs), got {got}; a maker "
        f"builds the inputs, e.g. `def make(): return model, (torch.randn(8, 16),)`; if {name} "
        f"is itself the function to run, add `def make(): return {name}, ()`"
    )
    raise AssertionError("unreachable")  # parser.error exits


def _serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError:
        parser.error(f"uvicorn is not installed; {install_extra('serve')}")
    app, name = _call_maker(parser, args.target)
    if isinstance(app, tuple) or not callable(app):
        parser.error(
            f"{name}() must return an ASGI app (e.g. a FastAPI app), got a {type(app).__name__}; "
            f"for timing a function use `python -m cudagraphs bench` instead"
        )
    if not 0 < args.port < 65536:
        parser.error(f"--port must be 1..65535, got {args.port}")
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


def _maker_location(target: str) -> tuple[str, int]:
    """``(file, line)`` of FUNC's ``def`` in FILE.py:FUNC (the maker that built the model)."""
    import inspect

    path, _, name = target.rpartition(":")
    module = sys.modules.get(Path(path).stem)
    factory = getattr(module, name, None)
    try:
        return str(Path(path)), inspect.getsourcelines(factory)[1]  # type: ignore[arg-type]
    except (OSError, TypeError):
        return str(Path(path)), 0


def _traceback_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--traceback",
        action="store_true",
        default=argparse.SUPPRESS,  # the top-level flag's value stands unless given here
        help="when your code raises, print the whole traceback instead of one line",
    )


def _console() -> Any:
    """A console that never cuts a table: piped or redirected output gets a wide page (rich
    would otherwise assume 80 columns and truncate column names)."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, 200))


def _report_user_error(raised: UserCodeRaised, *, full: bool) -> int:
    """One line: what was running, the error, and the user's frame; or the whole traceback."""
    import traceback

    from ..core import user_location

    error = raised.error
    if full:
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    else:
        where = user_location(error)
        at = f" at {where}" if where else ""
        print(
            f"error: {raised.what} raised {_one_line(error)}{at} (--traceback for the whole "
            "traceback)",
            file=sys.stderr,
        )
    return USER_CODE_RAISED


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cudagraphs")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _doctor(parser: argparse.ArgumentParser, target: str) -> int:

    from ..diagnose import doctor, findings_located_at

    fn, fn_args, fn_kwargs = _load_target(parser, target)
    try:
        # A finding inside a torch module's own code (a BatchNorm's statistics) has no frame
        # of the user's: it is the maker's, which built the module.
        with findings_located_at(*_maker_location(target)):
            report = doctor(fn, *fn_args, **fn_kwargs)
    except Exception as error:
        raise UserCodeRaised(f"examining {target}", error) from error
    console = _console()
    if report.findings:
        console.print(report)
    else:
        console.print(str(report))
    return 1 if report.blocking else 0


if __name__ == "__main__":
    sys.exit(main())
