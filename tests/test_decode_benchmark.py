"""benchmarks/decode.py on the CPU, as a smoke run of the script: every mode's row is complete
(tokens/s, steady-state ms per token from the clock, host time), and the modes agree on the
tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from script_modules import load_benchmark

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_decode_benchmark_reports_every_mode(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    markdown = tmp_path / "decode.md"
    modes = "eager loop,hf eager,cg,cg K=4,cg until-eos,cg eos-check"
    subprocess.run(
        [sys.executable, "benchmarks/decode.py", "--model", "llama-tiny", "--batches", "2",
         "--new", "9", "--reps", "1", "--modes", modes, "--no-isolate", "--dtype", "float32",
         "--json", str(out), "--markdown", str(markdown)],
        cwd=ROOT, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    rows = json.loads(out.read_text())["batches"]["2"]
    assert list(rows) == modes.split(",")
    for name, row in rows.items():
        assert row["tokens_per_s"] > 0 and row["host_ms_per_token"] > 0, name
        assert row["tokens_equal"], f"{name} decoded other tokens than the eager loop"
    # one launch per token: the intervals between launches give p50 and p99
    for name in ("eager loop", "hf eager", "cg"):
        assert 0 < rows[name]["token_ms_p50"] <= rows[name]["token_ms_p99"], name
    assert rows["cg K=4"]["token_ms_p50"] > 0  # 8 tokens in 2 launches: one interval
    assert rows["cg until-eos"]["token_ms_p50"] is None  # a request is one launch
    assert "one launch" in markdown.read_text()


@pytest.mark.slow
def test_a_single_request_on_the_batch_2_graph_decodes_the_same_tokens(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    modes = "eager loop,cg,cg from 2"
    subprocess.run(
        [sys.executable, "benchmarks/decode.py", "--model", "llama-tiny", "--batches", "1",
         "--new", "9", "--reps", "1", "--modes", modes, "--no-isolate", "--dtype", "float32",
         "--json", str(out)],
        cwd=ROOT, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    rows = json.loads(out.read_text())["batches"]["1"]
    assert list(rows) == modes.split(",")
    assert rows["cg from 2"]["tokens_equal"], "the padded batch-2 graph decoded other tokens"
    assert rows["cg from 2"]["tokens_per_s"] > 0
    launched = rows["cg from 2"]["replays"]
    assert launched and all("batch 2" in key for key in launched), launched
    assert all("batch 1" in key for key in rows["cg"]["replays"]), rows["cg"]["replays"]


def test_the_rung_memory_table_gives_the_ratio_and_the_request_mix() -> None:
    decode = load_benchmark("decode")
    mib = 1 << 20
    every = {"graph_bytes": 92 * mib, "graphs": 7, "setup_s": 1.5, "recaptures": 0,
             "requests": 64, "graphs_after": 7}  # fmt: skip
    largest = {"graph_bytes": 80 * mib, "graphs": 1, "setup_s": 0.5, "recaptures": 0}
    results = {"hardware": "H", "torch": "t", "transformers": "x", "model": "llama-2048",
               "dtype": "bfloat16", "max_batch": 64, "all rungs": every,
               "largest alone": largest, "ratio": 92 / 80}  # fmt: skip
    text = "\n".join(decode.rung_markdown(results))
    assert "| all 7 rungs | 92 | 1.50 | 0 |" in text
    assert "| the largest alone | 80 | 0.50 | 0 |" in text
    assert "1.15x" in text and "64 requests, 7 graphs after it" in text


@pytest.mark.slow
def test_the_decode_benchmark_runs_at_a_configured_cache_length(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    base = [sys.executable, "benchmarks/decode.py", "--model", "llama-tiny", "--batches", "2",
            "--new", "5", "--reps", "1", "--no-isolate", "--dtype", "float32", "--json", str(out)]  # fmt: skip
    modes = "eager loop,hf static,cg"
    subprocess.run(
        [*base, "--modes", modes, "--max-length", "96"],
        cwd=ROOT, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    results = json.loads(out.read_text())
    assert results["max_length"] == 96
    rows = results["batches"]["2"]
    assert list(rows) == modes.split(",")
    assert all(row["tokens_equal"] for row in rows.values())
    short = subprocess.run(
        [*base, "--modes", "eager loop", "--max-length", "16"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert short.returncode != 0 and "shorter than --prompt + --new" in short.stderr


@pytest.mark.slow
def test_the_decode_profile_counts_what_each_token_runs(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    subprocess.run(
        [sys.executable, "benchmarks/decode_profile.py", "--model", "llama-tiny", "--compile",
         "none", "--max-length", "32", "--prompt", "4", "--new", "8", "--dtype", "float32",
         "--sdpa", "math", "--json", str(out), "--markdown", str(tmp_path / "profile.md")],
        cwd=ROOT, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["tokens_per_s"] > 0 and result["kernels_per_token"] > 1
    assert result["sdpa"] == "math" and result["setup_s"] > 0
    assert "attention sdpa (kernel math)" in (tmp_path / "profile.md").read_text()
    costliest = result["costliest"]
    assert 1 <= len(costliest) <= 10
    spent = [k["us_per_token"] for k in costliest]
    assert spent == sorted(spent, reverse=True)  # the costliest first
    assert sum(k["share_of_busy"] for k in costliest) <= 1 + 1e-9
    assert "aten::mm" in {k["kernel"] for k in costliest}  # the projections, on the CPU
    every = result["kernels"]  # all of them, each with its class: the classes' sums add up
    top = [(k["kernel"], k["us_per_token"]) for k in costliest]
    assert [(k["kernel"], k["us_per_token"]) for k in every[: len(top)]] == top
    classify = load_benchmark("decode_profile").kernel_class
    assert all(k["class"] == classify(k["kernel"]) for k in every)
    for name, totals in result["classes"].items():
        mine = [k for k in every if k["class"] == name]
        assert sum(k["calls_per_token"] for k in mine) == pytest.approx(totals["kernels_per_token"])
        assert sum(k["us_per_token"] for k in mine) == pytest.approx(totals["us_per_token"])


@pytest.mark.slow
def test_the_compile_cost_benchmark_times_every_variant(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    subprocess.run(
        [sys.executable, "benchmarks/decode_compile_cost.py", "--model", "llama-tiny",
         "--batch", "2", "--max-length", "300", "--json", str(out)],
        cwd=ROOT, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == ["static", "length", "batch", "both", "sliced", "unbacked"]
    for which, row in runs.items():
        phases = (row["bytecode_tracing"], row["create_aot_dispatcher_function"])
        assert all(0 < t <= row["_compile.compile_inner"] for t in phases), which
        assert row["second_call_s"] < row["first_call_s"], which  # the second call is compiled
    assert all(runs[w]["graph_breaks"] == 0 for w in runs if w != "unbacked")
    # A backed batch makes batch 1 a trace of its own; an unbacked one does not, from torch
    # 2.13 on. Under 2.11 the attention's fake implementation asks whether the batch is 1,
    # which an unbacked size cannot answer: the graph breaks there (DESIGN.md).
    assert [runs[w]["traces_with_batch_1"] for w in ("batch", "both", "sliced")] == [2, 2, 2]
    unbacked = runs["unbacked"]
    if torch.__version__ >= "2.13":
        assert (unbacked["traces_with_batch_1"], unbacked["graph_breaks"]) == (1, 0)
    else:
        assert unbacked["graph_breaks"] > 0


def test_each_decoder_mode_builds_the_decoder_it_names() -> None:
    modes = load_benchmark("decode_modes")
    assert modes._compile_of("cg compile autotune") == "max-autotune-no-cudagraphs"
    assert modes._compile_of("cg compile K=4") is True
    assert modes._compile_of("cg K=16") is False
    assert "cg compile autotune" in modes.ALL_MODES


def test_the_startup_table_has_a_row_per_run_and_the_ratios() -> None:
    decode_startup = load_benchmark("decode_startup")
    mib = 1 << 20

    def row(setup: float, rungs: list[int], graphs: int, memory: int) -> dict[str, object]:
        return {"setup_s": setup, "compile_s": setup - 2, "capture_s": 1.0, "graphs": graphs,
                "batch_rungs": rungs, "length_rungs": [256, 512], "graph_bytes": memory * mib,
                "cache_bytes": 100 * mib}  # fmt: skip

    results = {"hardware": "H", "torch": "t", "model": "llama-2048", "dtype": "bfloat16",
               "batch": 16, "max_length": 512, "prompt": 32, "new": 128, "runs": {
                   "reduce-overhead cold": {"setup_s": 20.0},
                   "cudagraphs cold": row(30.0, [2, 4], 4, 45),
                   "cudagraphs warm": row(9.0, [2, 4], 4, 45),
                   "largest": row(8.0, [4], 1, 36),
                   "batch one": row(60.0, [1, 2, 4], 6, 50),
                   "batch one warm": row(10.0, [1, 2, 4], 6, 50)}}  # fmt: skip
    text = "\n".join(decode_startup.markdown(results))
    assert "| cudagraphs, cold, batch rungs [1, 2, 4] | 60.0 | 58.0 | 1.0 | 6 | 50 |" in text
    assert "| cudagraphs, cold, batch rungs [2, 4] | 30.0 | 28.0 | 1.0 | 4 | 45 |" in text
    assert "| the same, warm (second process) | 9.0 | 7.0 | 1.0 | 4 | 45 |" in text
    assert "reduce-overhead compile 3.00x" in text and "alone: 1.25x" in text
    assert "| the same, warm (second process) | 10.0 | 8.0 | 1.0 | 6 | 50 |" in text
    assert "Batch rungs [2, 4], cache-length rungs [256, 512]: cold set-up against one " in text
    assert "reduce-overhead compile 1.50x" in text
    # --without-largest: no row for it, and no memory ratio read off a row that is not there.
    del results["runs"]["largest"]
    text = "\n".join(decode_startup.markdown(results))
    assert "largest rung alone" not in text and "alone:" not in text
    assert "compile 1.50x; the KV cache (100 MiB) is allocated once" in text
    # --rows cudagraphs: the reduce-overhead row and the default rungs' two rows only.
    for key in ("batch one", "batch one warm"):
        del results["runs"][key]
    text = "\n".join(decode_startup.markdown(results))
    assert "batch rungs [1, 2, 4]" not in text and "compile 1.50x" in text


@pytest.mark.slow
def test_the_decode_profile_compares_fused_and_unfused_projections_in_one_run(
    tmp_path: Path,
) -> None:
    out, text = tmp_path / "profile.json", tmp_path / "profile.md"
    subprocess.run(
        [sys.executable, "benchmarks/decode_profile.py", "--model", "llama-tiny", "--compile",
         "none", "--max-length", "32", "--prompt", "4", "--new", "8", "--dtype", "float32",
         "--sdpa", "math", "--variants", "unfused,fused", "--json", str(out),
         "--markdown", str(text)],
        cwd=ROOT, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    unfused, fused = json.loads(out.read_text())
    assert (unfused["fuse"], fused["fuse"]) == (False, True)
    assert unfused["fused_groups"] == 0 and fused["fused_groups"] > 0 and not fused["unfused"]
    products = [r["classes"]["products"]["kernels_per_token"] for r in (unfused, fused)]
    assert products[1] < products[0]  # q/k/v and gate/up: one product each instead of 3 and 2
    page = text.read_text()
    assert "batch 1, unfused projections: roofline share" in page
    assert "batch 1, fused projections: roofline share" in page
    assert page.count("kernels per token ") >= 2
    # The prompt's prefill and a request's fixed work, taken out of the per-step count.
    assert all(0 < r["kernels_per_step"] < r["kernels_per_token"] for r in (unfused, fused))
    assert "per decode step" in page


def test_the_second_process_profile_lists_the_costliest_calls_first() -> None:
    """``fusion.py --profile-second``: where a second process's start goes, the functions on
    the stack longest first, each named by file, line and function, the outer ones included
    (what cProfile lost under Dynamo)."""
    import time

    fusion = load_benchmark("fusion")

    def slow() -> None:
        time.sleep(0.2)

    def fast() -> None:
        time.sleep(0.01)

    def both() -> None:
        slow()
        fast()

    sampler = fusion.StackSampler(interval_s=0.002)
    sampler.start()
    both()
    sampler.stop()
    rows = sampler.costliest(top=1000)  # every frame above both() ties with it
    spent = [row["seconds"] for row in rows]
    assert spent == sorted(spent, reverse=True) and len(sampler.costliest(top=3)) == 3
    names = [row["function"] for row in rows]
    slow_at = next(i for i, n in enumerate(names) if "(slow)" in n)
    both_at = next(i for i, n in enumerate(names) if "(both)" in n)
    fast_at = next((i for i, n in enumerate(names) if "(fast)" in n), len(names))
    assert both_at <= slow_at < fast_at
    assert 0.12 <= rows[slow_at]["seconds"] <= rows[both_at]["seconds"] <= sampler.seconds + 1e-3


def test_the_profile_s_gqa_attention_equals_the_library_s_grouped_one() -> None:
    """``decode_profile.py --attention gqa``: SDPA's own grouped path gives the grouped
    attention's answer for one token with a mask (and is transformers' otherwise)."""
    pytest.importorskip("transformers")
    from test_grouped_attention import Heads

    from cudagraphs.decoding.grouped_attention import grouped_sdpa_attention

    profile = load_benchmark("decode_profile")
    module = Heads(4)
    torch.manual_seed(2)
    query = torch.randn(2, 8, 1, 16)
    key, value = torch.randn(2, 2, 2, 21, 16).unbind(0)
    mask = torch.rand(2, 1, 1, 21) > 0.4
    mask[..., 0] = True
    ours, _ = profile.gqa_attention(module, query, key, value, mask, scaling=0.3)
    theirs, _ = grouped_sdpa_attention(module, query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(ours, theirs)
    prompt = torch.randn(2, 8, 5, 16)
    long_key, long_value = torch.randn(2, 2, 2, 5, 16).unbind(0)
    ours, _ = profile.gqa_attention(module, prompt, long_key, long_value, None)
    theirs, _ = grouped_sdpa_attention(module, prompt, long_key, long_value, None)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H200", 4.8e12),
        ("NVIDIA H100 80GB HBM3", 3.35e12),
        ("NVIDIA H100 NVL", 3.9e12),
        ("NVIDIA H100 PCIe", 2.0e12),
        # Not in the table: twice the memory clock (kHz) times the bus width in bytes; an A100
        # 80GB's driver figures give its published 2.039 TB/s.
        ("NVIDIA A100-SXM4-80GB", 2 * 1_593_000e3 * 5120 / 8),
    ],
)
def test_the_roofline_divides_by_the_gpu_s_own_peak_bandwidth(
    monkeypatch: pytest.MonkeyPatch, name: str, expected: float
) -> None:
    """The roofline's rate is the GPU's own, not an H200's on every GPU: an H100's share at the
    H200's figure would read 1.43 times too low."""
    from types import SimpleNamespace

    common = load_benchmark("common")
    props = SimpleNamespace(memory_clock_rate=1_593_000, memory_bus_width=5120)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: props)
    assert common.memory_bandwidth() == pytest.approx(expected)


def test_the_profile_counts_the_library_s_kernels_in_their_classes() -> None:
    """The one-row product and the one-token attention are the library's own Triton kernels:
    counted with the products and the attention, not with Inductor's kernels or "other"."""
    classify = load_benchmark("decode_profile").kernel_class
    assert classify("one_row_product") == "products"
    assert classify("attend") == "attention"
    assert classify("nvjet_sm90_tst_256x8_64x6_2x1_v_bz_TNT") == "products"
    assert classify("triton_poi_fused_2") == "fused (Inductor)"
    assert classify("triton_red_fused__to_copy_add_mean_mul_pow_rows_linear_rsqrt_8") == (
        "fused (Inductor)"
    )
