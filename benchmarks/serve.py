"""HTTP serving under load: eager per request, eager behind the batcher, graphs behind the batcher.

Each mode is the app of ``examples/serve_http.py`` (a BERT-style encoder, random weights),
served by ``python -m cudagraphs serve`` in a process of its own on 127.0.0.1. Clients are httpx
async tasks spread over ``--client-processes`` processes (so the clients are not what limits):
at each load level, that many clients each send requests (1..4 rows of 16 token ids) back to
back for ``--seconds``. Every response is kept and checked afterwards against the encoder run
here on the same rows. Reported per mode and load: requests/s, rows/s, latency p50
and p99, errors; the batcher's own time per request (from its /metrics); a plot of latency
against throughput. ``--soak`` then runs the graph server at one load for that many seconds,
sampling its ``memory_reserved()`` and errors.

    python benchmarks/serve.py [--loads 1,4,16,64,128] [--seconds 5] [--soak 300]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import random
import socket
import statistics
import subprocess
import sys
import tempfile
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

    def wrong(self, ids: torch.Tensor, got: torch.Tensor) -> int:
        """How many rows of ``got`` differ from the encoder on ``ids`` (checked 32 at a time)."""
        bad = 0
        with torch.no_grad():
            for start in range(0, len(ids), serve_http.MAX_BATCH):
                rows = slice(start, start + serve_http.MAX_BATCH)
                want = self.embed(ids[rows].to(self.device)).cpu()
                close = torch.isclose(got[rows], want, rtol=1e-3, atol=1e-3).all(dim=1)
                bad += int((~close).sum())
        return bad


async def _clients(url: str, clients: int, seconds: float, seed: int) -> dict[str, Any]:
    """``clients`` httpx tasks sending requests back to back for ``seconds``; the answers are
    kept (not checked here: checking would slow the clients down) and checked afterwards."""
    latencies: list[float] = []
    ids_sent: list[list[int]] = []
    answers: list[list[float]] = []
    errors = 0
    rng = random.Random(seed)
    stop = time.perf_counter() + seconds

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal errors
        while time.perf_counter() < stop:
            ids = [[rng.randrange(serve_http.VOCAB) for _ in range(serve_http.SEQUENCE)]
                   for _ in range(rng.randint(1, 4))]  # fmt: skip
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
            ids_sent.extend(ids)
            answers.extend(response.json()["embeddings"])

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=30, limits=limits) as http:
        began = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        elapsed = time.perf_counter() - began
    return {"latencies": latencies, "elapsed": elapsed, "errors": errors,
            "ids": ids_sent, "answers": answers}  # fmt: skip


def client_process(url: str, clients: int, seconds: float, seed: int, out: str) -> dict[str, Any]:
    """One load-generating process (several run at once, so the clients are not the limit);
    its answers go to ``out`` for the parent to check."""
    result = asyncio.run(_clients(url, clients, seconds, seed))
    ids, answers = result.pop("ids"), result.pop("answers")
    torch.save({"ids": torch.tensor(ids, dtype=torch.long).reshape(-1, serve_http.SEQUENCE),
                "answers": torch.tensor(answers).reshape(len(ids), -1)}, out)  # fmt: skip
    return result


def load(
    pool: Any, workers: int, url: str, clients: int, seconds: float, reference: Reference
) -> dict[str, Any]:
    """``clients`` concurrent clients spread over the pool's ``workers`` processes for
    ``seconds``; every answer is then checked against the encoder run here."""
    processes = min(clients, workers)
    shares = [clients // processes + (i < clients % processes) for i in range(processes)]
    with tempfile.TemporaryDirectory() as folder:
        outs = [f"{folder}/{i}.pt" for i in range(processes)]
        futures = [
            pool.submit(client_process, url, n, seconds, 1000 * clients + i, out)
            for i, (n, out) in enumerate(zip(shares, outs))
        ]
        parts = [f.result(seconds + 120) for f in futures]
        wrong = rows = 0
        for out in outs:
            kept = torch.load(out)
            rows += len(kept["ids"])
            wrong += reference.wrong(kept["ids"], kept["answers"])
    ordered = sorted(x for part in parts for x in part["latencies"])
    elapsed = max(part["elapsed"] for part in parts)
    return {
        "clients": clients,
        "requests": len(ordered),
        "requests_per_s": len(ordered) / elapsed,
        "rows_per_s": rows / elapsed,
        "p50_ms": 1e3 * statistics.median(ordered) if ordered else 0.0,
        "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        if ordered
        else 0.0,
        "errors": sum(part["errors"] for part in parts),
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


def soak(
    pool: Any, workers: int, seconds: float, clients: int, reference: Reference
) -> dict[str, Any]:
    process, url = start(MODES["graphs+batcher"])
    samples, total = [], {"requests": 0, "errors": 0, "wrong": 0}
    try:
        end = time.time() + seconds
        while time.time() < end:
            step = load(
                pool, workers, url, clients, min(5.0, max(0.5, end - time.time())), reference
            )
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
    p.add_argument(
        "--client-processes", type=int, default=8, help="processes the clients are spread over"
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
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.client_processes, mp_context=spawn) as pool:
        for mode in args.modes.split(","):
            process, url = start(MODES[mode])
            try:
                levels = [
                    load(pool, args.client_processes, url, int(c), args.seconds, reference)
                    for c in args.loads.split(",")
                ]
                overhead = batcher_overhead_us(url)
            finally:
                process.terminate()
                process.wait(30)
            results["modes"][mode] = {"levels": levels, "batcher_overhead_us_per_request": overhead}
            print(mode, json.dumps(levels), flush=True)
        if args.soak:
            results["soak"] = soak(pool, args.client_processes, args.soak, 64, reference)
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
        f"Hardware: {results['hardware']}, torch {results['torch']}; 12-layer BERT-style encoder (random "
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
    at = {m: next((r for r in v["levels"] if r["clients"] == 64), None) for m, v in modes.items()}
    graphs = at.get("graphs+batcher")
    if graphs is not None:
        for other in ("eager", "eager+batcher"):
            if at.get(other):
                lines.append(
                    f"\nAt 64 clients, graphs+batcher against {other}: "
                    f"{graphs['requests_per_s'] / at[other]['requests_per_s']:.2f}x the requests/s, "
                    f"p99 {graphs['p99_ms']:.1f} against {at[other]['p99_ms']:.1f} ms."
                )
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
