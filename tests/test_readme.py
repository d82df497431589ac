"""README examples that must run as written, on any machine; figures, report citations and file
names in the docs and docstrings that must match the tree."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from script_modules import load_script

import cudagraphs as cg

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_tour_runs_as_written_without_cuda() -> None:
    start = README.index('device = torch.device("cuda" if torch.cuda.is_available()')
    block = README[start : README.index("```", start)]
    scope: dict = {"torch": torch, "cg": cg}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudaGraphsWarning)
        exec(compile(block, "README.md", "exec"), scope)
    assert scope["rows"].shape == (37, 256) and scope["b"].stats.hits[(64,)] == 1
    assert type(scope["fused"].fn).__name__ == "OptimizedModule"
    if not torch.cuda.is_available():
        assert scope["best"].report.chosen == "eager" and "no CUDA" in scope["best"].report.reason
    assert isinstance(scope["step"], cg.TrainStep)


def test_the_buckets_guide_example_runs_without_cuda() -> None:
    guide = (Path(__file__).resolve().parents[1] / "docs" / "guide" / "buckets.md").read_text()
    start = guide.index('device = "cuda" if torch.cuda.is_available()')
    block = guide[start : guide.index("```", start)].split("\n# Two symbols")[0]
    scope: dict = {"torch": torch, "cg": cg}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudaGraphsWarning)
        exec(compile(block, "buckets.md", "exec"), scope)
    assert scope["y"].shape == (37, 256)
    assert scope["g"].stats.hits[(64,)] == 1


def test_the_figure_tables_match_the_gpu_report() -> None:
    figures = load_script("readme-figures")
    root = Path(__file__).resolve().parents[1]
    report = (root / "reports" / "gpu.md").read_text()
    for page in (root / "README.md", root / "docs" / "performance.md"):
        text = page.read_text()
        assert "<!-- figures:" in text
        assert figures.render(text, report) == text, f"{page.name}: run scripts/readme-figures"


def test_a_figure_that_drifts_from_its_report_is_caught() -> None:
    figures = load_script("readme-figures")
    report = (Path(__file__).resolve().parents[1] / "reports" / "gpu.md").read_text()
    start = README.index("<!-- figures:headline -->")
    row = README.index("| MLP 256-256-16", start)
    drifted = README.replace(README[row : README.index("\n", row)], "| MLP 256-256-16 | 1 | 2 |")
    assert figures.render(drifted, report) != drifted


def test_a_decoding_row_names_the_tree_its_section_names() -> None:
    """A decoding headline from a run on another tree than the report's says which tree."""
    figures = load_script("readme-figures")
    report = (
        "### benchmarks/decode.py at a configured cache length (src tree abc1234)\n\n"
        "Hardware: an H200; cache length 4096, greedy.\n\n**batch 16**\n\n"
        "| mode | tokens/s |\n|---|---|\n| reduce-overhead loop | 100.0 |\n"
        "| cg compile | 300.0 |\n"
    )
    row = figures.decode_headline(report)
    assert "a cache of 4096 positions, batch 16" in row
    assert "300.0 tokens/s, 3.00x a reduce-overhead decode loop (100.0 tokens/s)" in row
    assert row.endswith("| `reports/gpu.md` (src tree abc1234) |")
    # The card its section's Hardware line names goes into the row too.
    on_a_card = report.replace("Hardware: an H200", "Hardware: NVIDIA H100 80GB HBM3")
    assert figures.decode_headline(on_a_card).endswith("(src tree abc1234, H100) |")


def test_every_headline_figure_names_its_card() -> None:
    start = README.index("<!-- figures:headline -->")
    rows = [
        line
        for line in README[start : README.index("<!-- /figures:headline -->")].splitlines()
        if line.startswith("| ") and not line.startswith(("| what", "|---"))
    ]
    assert rows
    for row in rows:
        assert re.search(r"\(src tree \w+, H[12]00\) \|$", row), row


_FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s?(µs|ms|MiB|GiB|tokens/s)\b")
_SOURCE = re.compile(r"(?:reports|benchmarks/results)/[\w./-]+\.(?:md|json)")


def _contains(text: str, number: str) -> bool:
    """``number`` as a whole number in ``text`` (12.3 is not in 112.3 or 12.34)."""
    return re.search(rf"(?<![\d.]){re.escape(number)}(?![\d])", text) is not None


def _sections(text: str, root: Path) -> list[tuple[str, str, str]]:
    """Each section of a page outside code blocks: (title, its text, the text of the reports
    it names)."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    found = []
    for section in re.split(r"\n(?=#{1,4} )", text):
        sources = [root / s for s in set(_SOURCE.findall(section))]
        reported = "".join(p.read_text() for p in sources if p.exists())
        found.append(
            (section.strip().splitlines()[0][:60] if section.strip() else "", section, reported)
        )
    return found


def _untraced(text: str, root: Path) -> list[str]:
    """Absolute figures (µs, ms, MiB, GiB, tokens/s) of each section that do not appear in a
    report the section names; ratios are checked by :func:`_untraced_ratios`."""
    found = []
    for title, section, reported in _sections(text, root):
        for value, unit in _FIGURE.findall(section):
            as_bytes = str(round(float(value) * (1 << 20 if unit == "MiB" else 1 << 30)))
            if not _contains(reported, value) and not (
                unit in ("MiB", "GiB") and _contains(reported, as_bytes)
            ):
                found.append(f"{title}: {value} {unit}")
    return found


def _found_on_pages(
    check: Callable[[str, Path], list[str]], pages: list[Path] | None = None
) -> list[str]:
    """What ``check`` finds on each page (by default the README, the design and the docs)."""
    root = Path(__file__).resolve().parents[1]
    if pages is None:
        pages = [root / "README.md", root / "DESIGN.md", *sorted((root / "docs").rglob("*.md"))]
    return [f"{p.name}: {item}" for p in pages for item in check(p.read_text(), root)]


def test_every_absolute_figure_in_the_readme_and_docs_traces_to_a_report() -> None:
    assert _found_on_pages(_untraced) == []


def test_a_figure_without_its_report_is_caught() -> None:
    root = Path(__file__).resolve().parents[1]
    assert _untraced("## Speed\n\nA call takes 987.6 µs (`reports/gpu.md`).\n", root)
    # A figure the report does hold: the first "N.N µs" in it.
    held = re.search(r"\d+\.\d+ µs", (root / "reports" / "gpu.md").read_text())
    assert held is not None
    assert _untraced(f"## Speed\n\nA call takes {held.group()}.\n", root)  # no report named
    assert not _untraced(f"## Speed\n\nA call takes {held.group()} (`reports/gpu.md`).\n", root)


_RATIO = re.compile(r"(?<![\w.])(\d+\.\d+)(?:\s?[-\u2013/]\s?(\d+\.\d+))?\s?[x\u00d7](?!\w)")
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")


def _is_ratio_of(ratio: str, numbers: list[float]) -> bool:
    """``ratio`` (as written, with its decimals) is ``a / b`` for two of ``numbers``."""
    digits = len(ratio.split(".")[1])
    value = float(ratio)
    return any(b and round(a / b, digits) == value for a in numbers for b in numbers if a != b)


def _untraced_ratios(text: str, root: Path) -> list[str]:
    """Ratios (``1.04x``) that neither appear in a report their section names nor are the
    quotient of two other numbers of their paragraph or table (which the figure test traces)."""
    found = []
    for title, section, reported in _sections(text, root):
        for block in re.split(r"\n\s*\n", section):
            numbers = [float(n) for n in _NUMBER.findall(_RATIO.sub(" ", block))]
            for match in _RATIO.finditer(block):
                for ratio in filter(None, match.groups()):
                    if re.search(rf"(?<![\d.]){re.escape(ratio)}\s?[x\u00d7]", reported):
                        continue
                    if not _is_ratio_of(ratio, numbers):
                        found.append(f"{title}: {ratio}x")
    return found


def test_every_ratio_in_the_readme_and_docs_traces_to_its_figures() -> None:
    assert _found_on_pages(_untraced_ratios) == []


def test_a_ratio_without_its_figures_is_caught() -> None:
    root = Path(__file__).resolve().parents[1]
    assert _untraced_ratios("## Speed\n\nIt is 7.77x eager.\n", root)
    assert not _untraced_ratios("## Speed\n\n150.0 against 100.0 µs: 1.50x.\n", root)
    table = "## Speed\n\n| a | b | a / b |\n|---|---|---|\n| 3.0 | 2.0 | 1.5x |\n"
    assert not _untraced_ratios(table, root)
    assert _untraced_ratios(table.replace("1.5x", "1.6x"), root)


# A citation of a report's part: (`reports/gpu.md`, "Decoding on src tree 1f38e61"); the part
# is a heading of that report or a bold label in it (**Address guards**).
_CITATION = re.compile(
    r"`{1,2}((?:\.\./)*(?:reports|benchmarks/results)/[\w./-]+\.md)`{1,2}\s*,\s*\"([^\"]+)\""
)
_PART = re.compile(r"^#{1,6} (.*)$|\*\*([^*]+)\*\*", re.MULTILINE)


def _dangling_citations(text: str, root: Path) -> list[str]:
    """The ``(report, "part")`` citations of ``text`` whose report has no such heading or
    bold label (white space folded: a citation may wrap)."""
    found = []
    for path, part in _CITATION.findall(re.sub(r"\s+", " ", text)):
        report = root / re.sub(r"^(\.\./)+", "", path)
        parts = (
            [re.sub(r"\s+", " ", h) for pair in _PART.findall(report.read_text()) for h in pair]
            if report.exists()
            else []
        )
        if not any(part in p for p in parts if p):
            found.append(f"{path}: {part!r}")
    return found


def _written_pages(root: Path) -> list[Path]:
    """The prose and code a reader meets: the README, the design, the docs, the reports, and
    the sources, scripts, benchmarks, examples and tests (their docstrings and comments)."""
    return [
        root / "README.md",
        root / "DESIGN.md",
        root / "setup.py",
        *sorted((root / "docs").rglob("*.md")),
        *sorted((root / "reports").glob("*.md")),
        *sorted((root / "src").rglob("*.py")),
        *sorted((root / "src").rglob("*.cpp")),
        *sorted((root / "benchmarks").glob("*.py")),
        *sorted((root / "examples").glob("*.py")),
        *sorted((root / "tests").glob("*.py")),
    ]


def test_every_report_part_a_page_cites_is_in_that_report() -> None:
    root = Path(__file__).resolve().parents[1]
    assert _found_on_pages(_dangling_citations, _written_pages(root)) == []


def test_a_citation_of_a_part_the_report_lacks_is_caught() -> None:
    root = Path(__file__).resolve().parents[1]
    heading = re.search(r"^## (.+)$", (root / "reports" / "gpu.md").read_text(), re.MULTILINE)
    assert heading is not None
    cited = f'(`reports/gpu.md`,\n"{heading.group(1)}")'
    assert not _dangling_citations(cited, root)
    assert _dangling_citations(cited.replace(heading.group(1), "Decoding on an abacus"), root)
    nowhere = "reports/nowhere.md"  # not written out as a citation: this file is checked too
    assert _dangling_citations(f'(`{nowhere}`, "Tests")', root)


_PACKAGES = "core|control|shapes|training|diagnose|integrations|serve|tools"
# A module, benchmark, test, example or script named in prose or a docstring:
# ``core/guards.py``, ``src/cudagraphs/decoding/matvec.py``, ``benchmarks/decode.py``.
_FILE_NAMED = re.compile(
    rf"(?<![\w/.-])((?:src/)?(?:cudagraphs/)?(?:{_PACKAGES})/\w+\.(?:py|cpp)"
    r"|(?:benchmarks|tests|examples|scripts)/[\w-]+(?:\.py)?)\b"
)


def _missing_files(text: str, root: Path) -> list[str]:
    """The files ``text`` names that the tree lacks (``NAME`` is a placeholder)."""
    missing = []
    for named in sorted(set(_FILE_NAMED.findall(text))):
        if "NAME" in named:
            continue
        places = [root / named, root / "src" / named, root / "src" / "cudagraphs" / named]
        if not any(p.exists() or p.with_suffix(".py").exists() for p in places):
            missing.append(named)
    return missing


def test_every_file_the_docs_and_docstrings_name_exists() -> None:
    root = Path(__file__).resolve().parents[1]
    assert _found_on_pages(_missing_files, _written_pages(root)) == []


def test_a_module_that_was_renamed_is_caught() -> None:
    root = Path(__file__).resolve().parents[1]
    # Names that were renamed, not written out whole: this file is among the pages checked.
    for gone in ("addresses", "read_values"):
        assert _missing_files(f"the fallbacks (see cudagraphs/core/{gone}.py)", root)
        assert _missing_files(f"(``core/{gone}.py``)", root)
    assert not _missing_files("(``core/python_values.py``, ``benchmarks/decode.py``)", root)


def test_the_readme_command_lists_the_slow_checks_it_leaves_out() -> None:
    # Under pytest-xdist (the README's command runs two workers) the workers deselect the slow
    # checks; the summary must still count and list them, as a serial run does.
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
         "tests/test_cli.py::test_bad_arguments_are_refused_with_usage",
         "tests/test_cli.py::test_demo_on_gpu_prints_the_table"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    summary = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 0, run.stdout[-2000:]
    assert "1 deselected" in summary, run.stdout[-2000:]
    assert "DESELECTED [1] tests/test_cli.py" in run.stdout
    assert "python -m pytest -q -m slow" in run.stdout


def test_the_gpu_report_and_the_design_are_short_enough_to_read_through() -> None:
    # The current report holds the current tree and the figures the README cites; earlier
    # runs are in reports/archive/ unchanged.
    assert len((ROOT / "reports" / "gpu.md").read_text().splitlines()) <= 400
    assert len((ROOT / "DESIGN.md").read_text().splitlines()) <= 300


def test_the_gpu_report_keeps_the_comparison_with_the_piecewise_peer() -> None:
    report = (ROOT / "reports" / "gpu.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| piecewise-cuda-graphs |")]
    assert rows and "| cudagraphs segments |" in report


def test_no_page_or_message_says_to_install_the_package_from_pypi() -> None:
    # cudagraphs is installed from a clone: `pip install cudagraphs[serve]` finds nothing.
    from cudagraphs.errors import install_extra

    wrong = re.compile(r"pip install '?cudagraphs\[")
    pages = [p for p in _written_pages(ROOT) if p.name != "test_readme.py"]
    found = [p.name for p in pages if wrong.search(p.read_text())]
    assert found == []
    assert install_extra("serve") == (
        "pip install -e '.[serve]' from a clone of cudagraphs (it is not on PyPI)"
    )
    assert "pip install -e '.[docs]' && mkdocs serve" in README
