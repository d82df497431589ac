"""The tables and the plot of ``benchmarks/decode.py``'s results: one row per mode and batch,
the rung-memory table, and tokens/s against batch size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import at_bandwidth


def token_ms(row: dict[str, Any]) -> str:
    p50, p99 = row.get("token_ms_p50"), row.get("token_ms_p99")
    return "one launch" if p50 is None or p99 is None else f"{p50:.2f} / {p99:.2f}"


def markdown(results: dict[str, Any]) -> list[str]:
    lines = [
        f"Hardware: {results['hardware']}, torch {results['torch']}, transformers "
        f"{results['transformers']}; {results['model']} ({results['parameters'] / 1e9:.2f} B "
        f"parameters, {results['dtype']}), prompt {results['prompt']}, {results['new']} new "
        f"tokens, cache length {results.get('max_length', results['prompt'] + results['new'])}, "
        f"greedy; medians of {results['reps']} interleaved runs"
        + (
            f"; roofline{rate}."
            if (rate := at_bandwidth(results.get("memory_bandwidth", 0)))
            else "."
        ),
        "",
    ]
    for batch, modes in results["batches"].items():
        lines += [
            f"**batch {batch}**",
            "",
            "| mode | tokens/s | ms/token p50 / p99 | ms/token (median run / worst run) "
            "| host ms/token | set-up s (build) "
            f"| memory growth MiB (live) | roofline share | tokens equal {next(iter(modes))} |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in modes.items():
            agreement = "yes" if r["tokens_equal"] else f"{100 * r['token_agreement']:.1f}%"
            lines.append(
                f"| {name} | {r['tokens_per_s']:.1f} | {token_ms(r)} | "
                f"{r['ms_per_token_median']:.2f} / "
                f"{r['ms_per_token_worst']:.2f} | {r.get('host_ms_per_token', float('nan')):.2f} | "
                f"{r['setup_s']:.1f} ({r.get('build_s', 0.0):.1f}) | "
                f"{r['memory_growth_mib']:.0f} ({r.get('live_growth_mib', float('nan')):.0f}) | "
                f"{100 * r['roofline_share']:.1f}% | "
                f"{agreement} |"
            )
        lines.append("")
    return lines


def rung_markdown(results: dict[str, Any]) -> list[str]:
    """The rung-memory run: graph memory of all batch rungs against the largest alone."""
    every, largest = results["all rungs"], results["largest alone"]
    mib = 1 << 20
    return [
        f"Hardware: {results['hardware']}, torch {results['torch']}, transformers "
        f"{results['transformers']}; {results['model']} ({results['dtype']}), batch rungs up to "
        f"{results['max_batch']}, each measurement in a fresh process.",
        "",
        "| graphs | graph memory MiB (growth of memory_reserved) | set-up s | recaptures |",
        "|---|---|---|---|",
        f"| all {every['graphs']} rungs | {every['graph_bytes'] / mib:.0f} | "
        f"{every['setup_s']:.2f} | {every['recaptures']} |",
        f"| the largest alone | {largest['graph_bytes'] / mib:.0f} | "
        f"{largest['setup_s']:.2f} | {largest['recaptures']} |",
        "",
        f"All rungs against the largest alone: {results['ratio']:.2f}x. A request mix of every "
        f"batch size 1..{results['max_batch']}: {every.get('requests', 0)} requests, "
        f"{every.get('graphs_after', every['graphs'])} graphs after it (as many as before: no "
        "capture after set-up).",
        "",
    ]


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [int(b) for b in results["batches"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in next(iter(results["batches"].values())):
        ax.plot(
            batches,
            [results["batches"][str(b)][name]["tokens_per_s"] for b in batches],
            "o-",
            label=name,
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="batch",
        ylabel="tokens/s",
        title=f"{results['model']} {results['dtype']} decode",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
