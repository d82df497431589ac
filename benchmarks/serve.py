"""HTTP serving under load: eager per request, eager behind the batcher, graphs behind the batcher.

Each mode is the app of ``examples/serve_http.py`` (a BERT-style encoder, random weights),
served by ``python -m cudagraphs serve`` in a process of its own on 127.0.0.1. Clients are httpx
async tasks in this process: at each load level, that many clients each send requests (1..4
rows of 16 token ids) back to back for ``--seconds``. Every response is checked against the
encoder run here on the same rows. Reported per mode and load: requests/s, rows/s, latency p50
and p99, errors; the batcher's own time per request (from its /metrics); a plot of latency
against throughput. ``--soak`` then runs the graph server at one load for that many seconds,
sampling its ``memory_reserved()`` and errors.

    python benchmarks/serve.py [--loads 1,4,16,64,128] [--seconds 5] [--soak 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import serve_http  # noqa: E402

MODES = {"eager": "make_eager", "eager+batcher": "make_eager_batched", "graphs+batcher": "make"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(maker: str) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    target = f"{ROOT / 'examples' / 'serve_http.py'}:{maker}"
    process = subprocess.Popen(
        [sys.executable, "-m", "cudagraphs", "serve", target, "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the {maker} server did not start")


class Reference:
    """The encoder run here, on the same device, to check every response."""

    def __init__(self) -> None:
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.embed, _ = serve_http.encoder(self.device)

    def wrong(self, ids: list[list[int]], got: list[list[float]]) -> bool:
        with torch.no_grad():
            want = self.embed(torch.tensor(ids, device=self.device)).cpu()
        return not torch.allclose(torch.tensor(got), want, rtol=1e-3, atol=1e-3)


async def load(url: str, clients: int, seconds: float, reference: Reference) -> dict[str, Any]:
    latencies: list[float] = []
    rows = errors = wrong = 0
    stop = time.perf_counter() + seconds
    rng = random.Random(clients)

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal rows, errors, wrong
        while time.perf_counter() < stop:
            ids = [[rng.randrange(1000) for _ in range(16)] for _ in range(rng.randint(1, 4))]
            began = time.perf_counter()
            try:
                response = await http.post(f"{url}/embed", json={"input_ids": ids})
            except httpx.HTTPError:
                errors += 1
                continue
            latencies.append(time.perf_counter() - began)
            if response.status_code != 200:
                errors += 1
                continue
            rows += len(ids)
            wrong += reference.wrong(ids, response.json()["embeddings"])

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=30, limits=limits) as http:
        began = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        elapsed = time.perf_counter() - began
    ordered = sorted(latencies)
    return {
        "clients": clients,
        "requests": len(latencies),
        "requests_per_s": len(latencies) / elapsed,
        "rows_per_s": rows / elapsed,
        "p50_ms": 1e3 * statistics.median(ordered) if ordered else 0.0,
        "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        if ordered
        else 0.0,
        "errors": errors,
        "wrong": wrong,
    }


def batcher_overhead_us(url: str) -> float | None:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for line in text.splitlines():
        if (
            line.startswith("cudagraphs_batcher_overhead_seconds_per_request")
            and 'batcher="embed"' in line
        ):
            return 1e6 * float(line.rsplit(" ", 1)[1])
    return None


def soak(seconds: float, clients: int, reference: Reference) -> dict[str, Any]:
    process, url = start(MODES["graphs+batcher"])
    samples, total = [], {"requests": 0, "errors": 0, "wrong": 0}
    try:
        end = time.time() + seconds
        while time.time() < end:
            step = asyncio.run(load(url, clients, min(5.0, max(0.5, end - time.time())), reference))
            total["requests"] += step["requests"]
            total["errors"] += step["errors"]
            total["wrong"] += step["wrong"]
            samples.append(httpx.get(f"{url}/healthz", timeout=10).json()["memory_reserved_bytes"])
    finally:
        process.terminate()
        process.wait(30)
    return {
        "seconds": seconds,
        "clients": clients,
        "memory_reserved_mib": [s / 2**20 for s in samples],
        **total,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--loads", default="1,4,16,64,128", help="concurrent clients per level")
    p.add_argument("--seconds", type=float, default=5.0, help="per load level")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument(
        "--soak", type=float, default=0.0, help="seconds of soak at 64 clients (0: none)"
    )
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "serve.json")
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args()
    reference = Reference()
    results: dict[str, Any] = {
        "hardware": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
        "torch": torch.__version__, "seconds_per_level": args.seconds, "modes": {},
    }  # fmt: skip
    for mode in args.modes.split(","):
        process, url = start(MODES[mode])
        try:
            levels = [
                asyncio.run(load(url, int(c), args.seconds, reference))
                for c in args.loads.split(",")
            ]
            overhead = batcher_overhead_us(url)
        finally:
            process.terminate()
            process.wait(30)
        results["modes"][mode] = {"levels": levels, "batcher_overhead_us_per_request": overhead}
        print(mode, json.dumps(levels), flush=True)
    if args.soak:
        results["soak"] = soak(args.soak, 64, reference)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    lines = markdown(results)
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")
    if args.plot:
        plot(results, args.plot)


def markdown(results: dict[str, Any]) -> list[str]:
    modes = results["modes"]
    lines = [
        f"Hardware: {results['hardware']}, torch {results['torch']}; BERT-style encoder (random "
        f"weights), 1-4 rows of 16 tokens per request, {results['seconds_per_level']} s per level; "
        "every response checked against the encoder run directly.",
        "",
        "| clients | "
        + " | ".join(f"{m} req/s (p50 / p99 ms)" for m in modes)
        + " | errors / wrong |",
        "|---|" + "---|" * (len(modes) + 1),
    ]
    for i, level in enumerate(next(iter(modes.values()))["levels"]):
        cells = []
        bad = []
        for m in modes.values():
            row = m["levels"][i]
            cells.append(f"{row['requests_per_s']:.0f} ({row['p50_ms']:.1f} / {row['p99_ms']:.1f})")
            bad.append(f"{row['errors']}/{row['wrong']}")
        lines.append(f"| {level['clients']} | " + " | ".join(cells) + f" | {', '.join(bad)} |")
    for mode, m in modes.items():
        if m["batcher_overhead_us_per_request"] is not None:
            lines.append(
                f"\n{mode}: the batcher's own work {m['batcher_overhead_us_per_request']:.0f} µs per request."
            )
    if "soak" in results:
        s = results["soak"]
        mib = s["memory_reserved_mib"]
        lines.append(
            f"\nSoak: {s['seconds']:.0f} s at {s['clients']} clients, {s['errors']} errors, {s['wrong']} wrong; "
            f"memory_reserved {min(mib):.0f}-{max(mib):.0f} MiB over {len(mib)} samples."
        )
    return lines


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, m in results["modes"].items():
        xs = [r["requests_per_s"] for r in m["levels"]]
        ax.plot(xs, [r["p99_ms"] for r in m["levels"]], "o-", label=f"{mode} p99")
        ax.plot(xs, [r["p50_ms"] for r in m["levels"]], "o--", label=f"{mode} p50", alpha=0.6)
    ax.set(xlabel="requests/s", ylabel="latency ms", yscale="log", title="HTTP serving under load")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
