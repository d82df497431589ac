"""cg.doctor on the CPU: each construct at its file and line; nothing on clean workloads."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys

import pytest
import torch
from doctor_cases import constructs

import cudagraphs as cg
from cudagraphs.tools.workloads import mlp_256, transformer

CASES = [
    ("item", "host-sync"),
    ("tolist", "host-sync"),
    ("numpy", "host-sync"),
    ("printing", "host-sync"),
    ("branch", "host-sync"),
    ("synchronize", "sync-call"),
    ("nonzero", "dynamic-shape"),
    ("boolean_mask", "dynamic-shape"),
    ("masked_select", "dynamic-shape"),
    ("unique", "dynamic-shape"),
    ("repeat_interleave", "dynamic-shape"),
    ("cpu_constant", "cpu-tensor"),
    ("mutates_input", "input-mutation"),
    ("returns_input", "output-aliases-input"),
    ("reads_global", "closure-tensor"),
    ("custom_generator", "generator"),
    ("autocast_cached", "autocast-cache"),
    ("optimizer_step", "optimizer"),
    ("grad_scaler_step", "grad-scaler"),
    ("counter", "control-flow"),
]


def marked_line(kind: str, function: object) -> int:
    target = function.__call__ if not inspect.isfunction(function) else function
    lines, start = inspect.getsourcelines(target if inspect.isfunction(target) else type(function))
    for offset, line in enumerate(lines):
        if line.rstrip().endswith(f"# {kind}"):
            return start + offset
    raise AssertionError(f"no '# {kind}' marker in {function}")


@pytest.mark.parametrize("name, kind", CASES)
def test_each_construct_is_reported_at_its_line(
    name: str, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    fn = getattr(constructs, name)
    x = (
        torch.randn(4, 4)
        if name in ("optimizer_step", "grad_scaler_step", "autocast_cached")
        else torch.randn(4)
    )
    report = cg.doctor(fn, x)
    found = [f for f in report.findings if f.kind == kind]
    assert found, f"{kind} not reported for {name}: {report}"
    assert found[0].filename.endswith("constructs.py")
    assert found[0].lineno == marked_line(kind, fn), str(report)
    assert found[0].fix
    if kind not in ("input-mutation", "output-aliases-input", "closure-tensor", "autocast-cache"):
        assert report.blocking


def test_a_printing_function_is_reported_and_prints_once_per_doctor_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = cg.doctor(constructs.printing, torch.randn(4))
    assert any(f.kind == "host-sync" for f in report.findings)
    # The doctor runs the function twice, eagerly (its documented behaviour: on clones of the
    # inputs, then on fresh random values), and no more.
    assert capsys.readouterr().out.count("x = tensor(") == 2


@pytest.mark.parametrize(
    "make, shape",
    [(mlp_256, (128, 256)), (transformer, (2, 16, 256))],
)
def test_clean_workloads_have_no_findings(make: object, shape: tuple[int, ...]) -> None:
    model = make().eval()  # type: ignore[operator]
    with torch.no_grad():
        report = cg.doctor(model, torch.randn(*shape))
    assert not report.findings, str(report)
    assert not report.blocking


def test_a_transformer_layer_is_clean() -> None:
    layer = torch.nn.TransformerEncoderLayer(64, 4, batch_first=True).eval()
    with torch.no_grad():
        report = cg.doctor(layer, torch.randn(2, 8, 64))
    assert not report.findings, str(report)


def test_the_usual_full_capture_pattern_is_clean() -> None:
    model = mlp_256().eval()
    y = torch.empty(128, 16)

    def step(x: torch.Tensor) -> torch.Tensor:
        return y.copy_(model(x))  # the usual pattern writes into a pre-allocated output

    report = cg.doctor(step, torch.randn(128, 256))
    # y is a pre-allocated buffer outside the inputs: its write is reported (a warning), as
    # every replay repeats it, and nothing worse.
    assert not report.blocking, str(report)
    kinds = {f.kind for f in report.findings}
    assert kinds and kinds <= {"state-write", "closure-tensor"}, str(report)
    assert all(f.severity == "warning" for f in report.findings)


def test_doctor_restores_state_and_does_not_touch_inputs() -> None:
    bn = torch.nn.BatchNorm1d(4).train()
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    x = torch.randn(8, 4)
    x_before = x.clone()
    rng = torch.get_rng_state()
    cg.doctor(bn, x)
    for k, v in bn.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(x, x_before)
    assert torch.equal(torch.get_rng_state(), rng)
    # Patched functions are restored too.
    assert torch.cuda.synchronize.__module__ == "torch.cuda"


def test_report_renders_as_text_and_table_and_data() -> None:
    report = cg.doctor(constructs.item, torch.randn(4))
    text = str(report)
    assert "host-sync" in text and "constructs.py" in text and "fix:" in text
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(report)
    assert "host-sync" in console.export_text()
    assert report.as_dicts()[0]["kind"] == "host-sync"
    assert str(cg.doctor(lambda t: t * 2, torch.randn(2))).endswith("no findings")


@pytest.mark.slow
def test_cli_doctor_exit_codes(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "target.py"
    path.write_text(
        "import torch\n"
        "def bad(x):\n"
        "    return x * x.sum().item()\n"
        "def good(x):\n"
        "    return x * 2\n"
        "def make_bad():\n"
        "    return bad, (torch.randn(4),)\n"
        "def make_good():\n"
        "    return good, (torch.randn(4),), {}\n"
    )
    run = lambda target: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "cudagraphs", "doctor", f"{path}:{target}"],
        capture_output=True,
        text=True,
    )
    bad = run("make_bad")
    assert bad.returncode == 1, bad.stderr
    assert "host-sync" in bad.stdout and "target.py:3" in bad.stdout
    good = run("make_good")
    assert good.returncode == 0, good.stderr
    assert "no findings" in good.stdout
    missing = run("nothing")
    assert missing.returncode == 2 and "nothing" in missing.stderr


def test_the_doctors_watches_leave_other_threads_untouched() -> None:
    import threading

    import torch

    import cudagraphs as cg

    seen: list[object] = []
    started, release = threading.Event(), threading.Event()

    def other_thread() -> None:
        started.set()
        release.wait(10)
        # While the doctor runs in the main thread, this thread's calls reach torch itself:
        # not observed (no finding), and a capture question gets the true answer.
        try:
            torch.cuda.synchronize()
            seen.append("synchronized")
        except (AssertionError, RuntimeError):  # torch's own answer without CUDA
            seen.append("torch answered")
        if torch.cuda.is_available():
            seen.append(torch.cuda.is_current_stream_capturing())

    def fn(x: torch.Tensor) -> torch.Tensor:
        release.set()
        worker.join(10)
        return x * 2

    worker = threading.Thread(target=other_thread)
    worker.start()
    started.wait(10)
    report = cg.doctor(fn, torch.randn(4))
    assert [f.kind for f in report.findings] == []  # the other thread's sync is not fn's
    expected = ["synchronized", False] if torch.cuda.is_available() else ["torch answered"]
    assert seen == expected


COUNTER = (
    "import torch\n"
    "class Counter(torch.nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.fc = torch.nn.Linear(4, 4)\n"
    "        self.calls = 0\n"
    "    def forward(self, x):\n"
    "        self.calls += 1\n"
    "        return self.fc(x)\n"
    "def make():\n"
    "    return Counter(), (torch.randn(2, 4),)\n"
)


@pytest.mark.slow
def test_the_doctor_finds_a_plain_value_that_changes_at_the_line_that_writes_it(
    tmp_path: object,
) -> None:
    """A module whose forward counts its calls: the capture would refuse it (FrozenStateError),
    so the doctor reports it as blocking, at the line of ``self.calls += 1``, with the
    harmless_state fix; the CLI exits 1."""
    from pathlib import Path

    path = Path(str(tmp_path)) / "counter.py"
    path.write_text(COUNTER)
    done = subprocess.run(
        [sys.executable, "-m", "cudagraphs", "doctor", f"{path}:make"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "python-state" in done.stdout and "counter.py:8" in done.stdout
    assert "Counter.calls" in done.stdout and "harmless_state" in done.stdout


def test_the_doctor_leaves_the_user_s_plain_attributes_as_they_were() -> None:
    namespace: dict = {}
    exec(compile(COUNTER, "counter.py", "exec"), namespace)
    model, (x,) = namespace["make"]()
    model.calls = 7
    report = cg.doctor(model, x)
    assert report.blocking and any(f.kind == "python-state" for f in report.findings)
    assert model.calls == 7  # both runs' increments put back


def test_the_doctor_reports_a_draw_from_python_s_random_generator_and_puts_it_back() -> None:
    """A layer dropped with ``random.random()``: a capture would refuse it (every replay would
    repeat the recorded draw), so the doctor reports it as blocking, names the generator and
    the fix, and leaves the generator's state as it found it."""
    import random

    class LayerDrop(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x) if random.random() < 0.5 else x

    state = random.getstate()
    report = cg.doctor(LayerDrop(), torch.randn(4, 8))
    found = [f for f in report.findings if f.kind == "host-random"]
    assert report.blocking and len(found) == 1, report
    assert "draws from random" in found[0].message and "torch.rand" in found[0].fix
    assert random.getstate() == state


def test_a_batchnorm_in_eval_mode_writes_nothing_and_is_not_reported() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).eval()
    with torch.no_grad():
        model[1].running_mean.normal_()
    before = model[1].running_mean.clone()
    model(torch.randn(8, 4))
    assert torch.equal(model[1].running_mean, before)  # eager writes nothing in eval()
    assert not [f for f in cg.doctor(model, torch.randn(8, 4)).findings if "running" in f.message]
    # In train() the same module does update its statistics, and that is still reported (one
    # finding per line: the first write there, its step counter, names the module).
    found = cg.doctor(model.train(), torch.randn(8, 4)).findings
    assert [f for f in found if f.kind == "state-write" and "Sequential.1." in f.message]


def test_the_command_line_places_a_torch_module_s_finding_at_its_maker(tmp_path) -> None:
    # Inside a BatchNorm's own code no frame is the user's: doctor and auto both name the
    # line that built the model, and auto's findings are whole, not cut at a width.
    from pathlib import Path

    path = Path(str(tmp_path)) / "maker_target.py"
    path.write_text(
        "import torch\n"
        "\n"
        "def make():\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))\n"
        "    return model.train(), (torch.randn(8, 4),)\n"
    )

    def run(*command: str) -> str:
        return subprocess.run(
            [sys.executable, "-m", "cudagraphs", *command], capture_output=True, text=True
        ).stdout

    doctor_out = run("doctor", f"{path}:make")
    auto_out = run("auto", f"{path}:make", "--fresh")
    assert "maker_target.py:3" in doctor_out, doctor_out
    assert re.search(r"state-write at \S*maker_target\.py:3: ", auto_out), auto_out
    assert "<unknown>" not in doctor_out + auto_out
    line = next(x for x in auto_out.splitlines() if "state-write at" in x)
    assert line.rstrip().endswith("(warm-up's writes are put back by cudagraphs)"), line
