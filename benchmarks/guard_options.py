"""Two ways to guard the Python values a graph's code read, side by side: ours (the names the
code loads, computed reads, closures and host getters, checked in one C call) and Dynamo's
(what a ``torch.compile`` trace read, checked by its C++ guard tree).

Two measurements:

* **What each sees.** For each case of ``tests/reads_cases.py`` (a value read under a name built
  at run time, a key held in an attribute, a helper's closure, long and nested lists, host
  settings), the model is run through ``torch.compile`` with a backend that runs the traced
  graph as it is (no Inductor), the value is changed, and the next call is compared with
  eager. A guard that missed the change gives the traced answer. Ours is tested on the same
  cases by ``tests/test_reads_seen.py`` (CPU stand-in) and ``tests/test_reads_seen_cuda.py``.
* **What each costs per call.** Dynamo's guard check (``guard_manager.check`` of the cache
  entry, called with the frame's locals) and our whole guard check on the same models, with
  the number of checks each holds. Host time only. Ours: with CUDA, ``cg.graph(...).guard``;
  without, the same guard built as a capture builds it, from the reads of one eager call
  (``Reader``, ``read_values``: the capture's own run reads what an eager run reads).

    python benchmarks/guard_options.py [--json PATH] [--markdown PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import per_call_ns
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def as_traced(gm: torch.fx.GraphModule, example: Any) -> Callable[..., Any]:
    """A ``torch.compile`` backend that runs the traced graph unchanged: only Dynamo's guards
    stand between a change and the traced answer."""
    return gm.forward


def call(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def dynamo_sees() -> dict[str, str]:
    """case -> "eager's answer", "traced answer" or the error Dynamo raised."""
    import reads_cases

    cases: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module], None]]] = {
        name: (make, change) for name, (make, change, _) in reads_cases.SEEN.items()
    }
    made: dict[str, Any] = {}

    def defined() -> nn.Module:
        model, setter = reads_cases.defined_in_a_function()
        made["setter"] = setter
        return model

    cases["closure of the function that defined the forward"] = (
        defined, lambda model: made["setter"](3.0)
    )  # fmt: skip
    cases["torch.get_num_threads() in a branch"] = (
        reads_cases.ThreadsBranch,
        lambda model: torch.set_num_threads(1 if torch.get_num_threads() > 1 else 2),
    )
    cases["torch.backends.mkldnn.enabled in a branch"] = (
        reads_cases.MkldnnBranch,
        lambda model: setattr(torch.backends.mkldnn, "enabled", not torch.backends.mkldnn.enabled),
    )
    cases["torch.backends.cuda.flash_sdp_enabled() in a branch"] = (
        reads_cases.SdpBranch,
        lambda model: torch.backends.cuda.enable_flash_sdp(
            not torch.backends.cuda.flash_sdp_enabled()
        ),
    )
    seen: dict[str, str] = {}
    threads, mkldnn = torch.get_num_threads(), torch.backends.mkldnn.enabled
    flash = torch.backends.cuda.flash_sdp_enabled()
    for name, (make, change) in cases.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = make()
        compiled = torch.compile(call, backend=as_traced)
        x = torch.randn(4, 8)
        try:
            with torch.no_grad():
                compiled(model, x)
                change(model)
                expected, got = model(x), compiled(model, x)
            seen[name] = "eager's answer" if torch.allclose(got, expected) else "traced answer"
        except Exception as error:  # a refusal is an answer too: say which
            seen[name] = f"{type(error).__name__}"
        finally:
            reads_cases.SET_SCALE_FACTOR(2.0)
            torch.set_num_threads(threads)
            torch.backends.mkldnn.enabled = mkldnn
            torch.backends.cuda.enable_flash_sdp(flash)
        print(f"{name}: {seen[name]}", flush=True)
    return seen


def models(device: str) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    from transformers import GPT2Config, GPT2Model, LlamaConfig, LlamaForCausalLM

    from cudagraphs.tools.workloads import MODELS

    found: dict[str, tuple[nn.Module, torch.Tensor]] = {}
    for name in ("mlp_256", "transformer"):
        build, shape = MODELS[name]
        found[name] = (build().to(device).eval(), torch.randn(*shape, device=device))
    llama = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128,
    )  # fmt: skip
    gpt2 = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    ids = torch.randint(0, 128, (1, 16), device=device)
    found["transformers Llama, 2 layers"] = (LlamaForCausalLM(llama).to(device).eval(), ids)
    found["transformers GPT-2, 2 layers"] = (GPT2Model(gpt2).to(device).eval(), ids)
    return found


def dynamo_guard(model: nn.Module, x: torch.Tensor) -> tuple[Callable[[], Any], int]:
    """Dynamo's guard check of ``call(model, x)`` after one traced call, and its guard count."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    compiled = torch.compile(call, backend=as_traced)
    compiled(model, x)
    entries = _debug_get_cache_entry_list(call.__code__)
    manager = entries[0].guard_manager
    frame = {"model": model, "x": x}
    assert manager.check(frame), "Dynamo's guard fails on the call it was made for"
    count = sum(
        1 for line in str(manager).splitlines() if "+- " in line and "GuardManager" not in line
    )
    return (lambda: manager.check(frame)), count


def ours(model: nn.Module, x: torch.Tensor) -> Any:
    """Our guard over ``model(x)`` without a GPU: the values one eager call read (as the
    capture's recording run reads them), the module tree, in the one C check."""
    from cudagraphs.core import AddressGuard, PythonSnapshot, Reader, ValueWatch, read_values

    def fn(t: torch.Tensor) -> Any:
        return model(t)

    plain = PythonSnapshot(fn, [], ())
    with Reader(of=fn) as reader:
        fn(x)
    plain.take()
    values = read_values(reader, plain.runs[-1], (), plain.objects)
    return AddressGuard(fn, (), watches=[ValueWatch(values)] if values else [])


def checks(guard: Any) -> int:
    """What our one check compares: addresses, modes, module slots and hooks, rebound names,
    each module's class and torch modules' settings, and every value a watch holds."""
    values = sum(len(w) for w in guard.watches if hasattr(w, "__len__"))
    return guard.count - len(guard.watches) + values + len(guard.classes) + len(guard.settings)


def costs(device: str) -> dict[str, Any]:
    import cudagraphs as cg

    rows: dict[str, Any] = {}
    torch.set_grad_enabled(False)  # Dynamo's global-state guard compares the grad mode
    for name, (model, x) in models(device).items():
        check, count = dynamo_guard(model, x)
        row: dict[str, Any] = {"dynamo_guards": count, "dynamo_ns": per_call_ns(check)}
        guard = ours(model, x) if device == "cpu" else cg.graph(lambda t, m=model: m(t), x).guard
        row["ours_checks"] = checks(guard)
        row["ours_ns"] = per_call_ns(guard.check)
        rows[name] = row
        print(name, row, flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results: dict[str, Any] = {
        "host": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "seen": dynamo_sees(),
        "costs": costs(device),  # under no_grad, as an inference server calls
    }
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    text = "\n".join(markdown(results))
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


def markdown(results: dict[str, Any]) -> list[str]:
    where = results["gpu"] or "no GPU"
    lines = [
        f"Hardware: {where}; host {results['host']}, Python {results['python']}, torch "
        f"{results['torch']}.",
        "",
        "| case | Dynamo's guards (traced as is) after the change |",
        "|---|---|",
        *(f"| {case} | {seen} |" for case, seen in results["seen"].items()),
        "",
        "| model | Dynamo's guards | Dynamo's check ns | our checks | our check ns |",
        "|---|---|---|---|---|",
    ]
    for name, row in results["costs"].items():
        ours = (
            f"{row['ours_checks']} | {row['ours_ns']:.0f}"
            if "ours_ns" in row
            else "- | - (needs CUDA)"
        )
        lines.append(f"| {name} | {row['dynamo_guards']} | {row['dynamo_ns']:.0f} | {ours} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
