"""A client of ``examples/serve_llm.py``: several requests at once, each streamed as
server-sent events and printed as its tokens arrive, then the server's health and metrics.

    python examples/llm_client.py --port 8000 --requests 4 --max-tokens 24

With no server listening there, it says so and talks to the same app in this process instead
(``httpx.ASGITransport``). Needs the serve extra (FastAPI, httpx) and transformers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))


async def stream_one(client: httpx.AsyncClient, k: int, prompt: list[int], max_tokens: int) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start, tokens = time.perf_counter(), []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            print(f"request {k}: HTTP {response.status_code} {await response.aread()!r}")
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                print(f"request {k}: {event['error']['message']}")
                return
            choice = event["choices"][0]
            tokens += choice["token_ids"]
            if choice["finish_reason"] is not None:
                took = time.perf_counter() - start
                print(f"request {k}: {len(tokens)} tokens in {took:.2f} s "
                      f"({choice['finish_reason']}): {tokens}")  # fmt: skip


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    rng = random.Random(0)
    base = f"http://{args.host}:{args.port}"
    transport = None
    try:
        async with httpx.AsyncClient(base_url=base, timeout=5) as probe:
            await probe.get("/healthz")
    except httpx.ConnectError:
        import serve_llm

        print(f"no server at {base}; talking to examples/serve_llm.py's app in this process")
        transport = httpx.ASGITransport(app=serve_llm.make())
    async with httpx.AsyncClient(base_url=base, timeout=120, transport=transport) as client:
        prompts = [[rng.randrange(1, 1000) for _ in range(rng.randrange(4, 32))]
                   for _ in range(args.requests)]  # fmt: skip
        await asyncio.gather(
            *(stream_one(client, k, p, args.max_tokens) for k, p in enumerate(prompts))
        )
        print((await client.get("/healthz")).json())
        metrics = (await client.get("/metrics")).text
        print("\n".join(line for line in metrics.splitlines() if not line.startswith("#")))


if __name__ == "__main__":
    asyncio.run(main())
