"""What a compiled decode step launches on a GPU, read from the code Inductor writes for a CUDA
device on a machine without one (``benchmarks/step_kernels.py``), and the Inductor options a
step is compiled with."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from script_modules import load_benchmark

from cudagraphs.decoding.compiled import STEP_OPTIONS, step_settings

ROOT = Path(__file__).resolve().parents[1]


def test_a_step_compiles_with_combo_kernels_and_pdl_unless_the_caller_says_otherwise(
    monkeypatch: pytest.MonkeyPatch, pdl_decided_afresh: Any
) -> None:
    from cudagraphs.decoding import matvec

    monkeypatch.delenv(matvec.PDL_VARIABLE, raising=False)
    pdl_decided_afresh()
    launch = {"triton.enable_pdl": True}
    assert step_settings(True) == {"mode": None, "options": {**STEP_OPTIONS, **launch}}
    assert STEP_OPTIONS["combo_kernels"] is True
    mine = step_settings({"combo_kernels": False, "coordinate_descent_tuning": True})
    assert mine["options"] == {"combo_kernels": False, "coordinate_descent_tuning": True, **launch}
    no_pdl = step_settings({"triton.enable_pdl": False})["options"]
    assert no_pdl["triton.enable_pdl"] is False
    # torch.compile takes a mode or options, never both: a mode goes as it is.
    assert step_settings("max-autotune-no-cudagraphs") == {
        "mode": "max-autotune-no-cudagraphs",
        "options": None,
    }
    # CUDAGRAPHS_PDL=0 turns it off for Inductor's kernels as for the library's.
    monkeypatch.setenv(matvec.PDL_VARIABLE, "0")
    pdl_decided_afresh()
    assert step_settings(True) == {"mode": None, "options": dict(STEP_OPTIONS)}


@pytest.mark.slow
@pytest.mark.skipif(
    torch.version.cuda is None or importlib.util.find_spec("triton") is None,
    reason="writing CUDA code takes a CUDA build of torch with Triton (no GPU needed)",
)
def test_a_layer_writes_its_cache_and_rotates_its_query_in_one_kernel(tmp_path: Path) -> None:
    """Per layer, the keys' rotary and cache write, the values' cache write and the query's
    rotary read the fused q/k/v product and nothing of each other: with combo kernels they are
    one launch between the product and the attention, three without. Every product is the
    library's operator (the one-row kernel on a GPU), the MLP's activation inside the down
    product; a model fused by the user beforehand keeps its own products and activation."""
    out = tmp_path / "kernels.json"
    subprocess.run(
        [sys.executable, "benchmarks/step_kernels.py", "--model", "llama-tiny", "--variants",
         "default,no-combo,cublas", "--json", str(out)],
        cwd=ROOT, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    default, plain, cublas = json.loads(out.read_text())
    for run in (default, plain):
        layer = run["one_layer"]
        assert layer[-1].endswith("one_token_attention") and "cudagraphs.rows_linear" in layer
        assert run["launches_per_layer"] == len(layer)
    between = [
        run["one_layer"][run["one_layer"].index("cudagraphs.rows_linear", 3) + 1 : -1]
        for run in (default, plain)
    ]
    assert between == [["pointwise"], ["pointwise"] * 3], between
    assert default["launches_per_layer"] == plain["launches_per_layer"] - 2
    assert default["launches_per_step"] < plain["launches_per_step"]
    # The o, gate/up, down and q/k/v products are the library's operator, and the MLP's
    # SiLU(gate) * up is inside the down product, not a kernel of its own.
    assert default["one_layer"] == [
        "cudagraphs.rows_linear", "reduction", "cudagraphs.rows_linear",
        "cudagraphs.gated_linear", "reduction", "cudagraphs.rows_linear", "pointwise",
        "cudagraphs_bench.one_token_attention",
    ]  # fmt: skip
    # fuse_projections(model) first: the fused groups stay, the rest is Inductor's as before.
    assert cublas["one_layer"].count("cudagraphs.rows_linear") == 2, cublas["one_layer"]
    assert "cudagraphs.gated_linear" not in cublas["one_layer"]
    assert cublas["launches_per_layer"] > default["launches_per_layer"]
    # Programmatic dependent launch: the step's Inductor kernels are compiled for it, and each
    # waits for the kernel before it (none may end without waiting).
    for run in (default, plain, cublas):
        assert run["dependent_kernels"] > 0
        assert run["dependent_without_wait"] == [], run["dependent_without_wait"]


@pytest.mark.slow
@pytest.mark.skipif(
    torch.version.cuda is None or importlib.util.find_spec("triton") is None,
    reason="writing CUDA code takes a CUDA build of torch with Triton (no GPU needed)",
)
def test_a_batch_of_rows_launches_what_a_user_s_fusion_and_an_engine_s_step_launch(
    tmp_path: Path,
) -> None:
    """At batch 2 the one-row kernel cannot apply: the Decoder's step launches what it
    launches on a model the user fused beforehand (cuBLAS's products, Inductor's fused
    activation), none of the one-row operators. A compiled engine step, whose rows sit at
    their own lengths and write the cache through an index, launches per layer what the
    Decoder's does: the write is in the kernel with the key's rotary, not a copy of the
    cache."""
    out = tmp_path / "kernels.json"
    subprocess.run(
        [sys.executable, "benchmarks/step_kernels.py", "--model", "llama-tiny", "--batch", "2",
         "--variants", "default,cublas,engine", "--json", str(out)],
        cwd=ROOT, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    default, cublas, engine = json.loads(out.read_text())
    assert default["one_layer"] == cublas["one_layer"], (default["one_layer"], cublas["one_layer"])
    assert engine["one_layer"] == default["one_layer"], (engine["one_layer"], default["one_layer"])
    assert engine["dependent_without_wait"] == []
    assert "cudagraphs.gated_linear" not in default["one_layer"]
    assert default["one_layer"].count("mm") == 2  # the output and down products
    assert default["dependent_kernels"] > 0 and default["dependent_without_wait"] == []


def test_a_kernel_compiled_for_dependent_launch_that_never_waits_is_named() -> None:
    """``step_kernels.dependent_launches`` reads the wrapper's kernel sources: one compiled
    with ``launch_pdl`` and no ``gdc_wait`` is named, one that waits is not, and one compiled
    without it is not counted."""
    step_kernels = load_benchmark("step_kernels")
    quotes = "'" * 3

    def kernel(name: str, launch_pdl: bool, body: str) -> str:
        return (
            f"{name} = async_compile.triton('{name}', {quotes}\n"
            f"@triton_heuristics.pointwise(triton_meta={{'launch_pdl': {launch_pdl}}})\n"
            f"@triton.jit\ndef {name}(in_ptr0, out_ptr0):\n{body}\n{quotes}, device_str='cuda')\n"
        )

    waits = "    tl.extra.cuda.gdc_wait()\n    tmp0 = tl.load(in_ptr0)"
    code = (
        kernel("triton_poi_fused_0", True, waits)
        + kernel("triton_poi_fused_1", True, "    tl.store(out_ptr0, 0.0)")
        + kernel("triton_poi_fused_2", False, "    tl.store(out_ptr0, 0.0)")
    )
    assert step_kernels.dependent_launches(code) == {
        "launched": ["triton_poi_fused_0", "triton_poi_fused_1"],
        "without_wait": ["triton_poi_fused_1"],
    }
