"""The HTTP serving example for real: uvicorn on a loopback port, httpx clients. Good requests
equal the model run directly, concurrent ones included; every bad body gets a 4xx with the
reason (hypothesis fuzzes the bodies); /metrics and /healthz answer; the CLI starts it."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ports import free_port

pytest.importorskip("transformers")
fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import serve_http  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::cudagraphs.CudaGraphsWarning")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    app = serve_http.make()
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    running = uvicorn.Server(config)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not running.started and time.time() < deadline:
        time.sleep(0.05)
    assert running.started, "uvicorn did not start"
    yield f"http://127.0.0.1:{port}"
    running.should_exit = True
    thread.join(10)


def direct_embeddings(ids: list[list[int]]) -> torch.Tensor:
    embed, _ = serve_http.encoder("cpu")  # the same seed: the server's weights
    with torch.inference_mode():
        return embed(torch.tensor(ids))


def test_health_and_metrics(server: str) -> None:
    health = httpx.get(f"{server}/healthz", timeout=10)
    assert health.status_code == 200 and "embed" in health.json()["models"]
    # The mode that runs: graphs only where there is CUDA.
    expected = "graphs+batcher" if torch.cuda.is_available() else "eager+batcher (no CUDA)"
    assert health.json()["mode"] == expected
    httpx.post(f"{server}/embed", json={"input_ids": [[1] * 16]}, timeout=10)
    metrics = httpx.get(f"{server}/metrics", timeout=10).text
    assert 'cudagraphs_batcher_requests_total{batcher="embed"}' in metrics


@pytest.mark.slow
def test_concurrent_requests_equal_the_model_run_directly(server: str) -> None:
    torch.manual_seed(5)
    bodies = [torch.randint(0, 1000, (n, 16)).tolist() for n in (1, 3, 2, 5, 1, 4, 2, 8) * 2]

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(
                *(client.post(f"{server}/embed", json={"input_ids": b}) for b in bodies)
            )

    responses = asyncio.run(main())
    for body, response in zip(bodies, responses):
        assert response.status_code == 200, response.text
        got = torch.tensor(response.json()["embeddings"])
        torch.testing.assert_close(got, direct_embeddings(body), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        ({"input_ids": [[1] * 15]}, 400, "shape"),
        ({"input_ids": [[1] * 16, [1] * 15]}, 400, "equal length"),
        ({"input_ids": [[1000] * 16]}, 400, "token ids must be in 0..999"),
        ({"input_ids": [[-1] * 16]}, 400, "token ids must be in 0..999"),
        ({"input_ids": [["a"] * 16]}, 422, "int"),
        ({"input_ids": [[1.5] * 16]}, 422, "int"),
        ({"input_ids": [[1] * 16] * 33}, 422, "at most 32"),
        ({"input_ids": []}, 422, "at least 1"),
        ({"tokens": [[1] * 16]}, 422, "input_ids"),
        ([1, 2, 3], 422, ""),
    ],
)
def test_bad_bodies_get_a_4xx_with_the_reason(server: str, body, status: int, reason: str) -> None:
    response = httpx.post(f"{server}/embed", json=body, timeout=10)
    assert response.status_code == status, response.text
    assert reason in response.text


def test_malformed_json_truncated_nan_and_deep_nesting(server: str) -> None:
    post = lambda content: httpx.post(  # noqa: E731
        f"{server}/embed", content=content, headers={"content-type": "application/json"}, timeout=10
    )
    assert post(b'{"input_ids": [[1, 2').status_code == 422  # truncated
    assert post(b'{"input_ids": [[NaN]]}').status_code == 422
    deep = b'{"input_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert 400 <= post(deep).status_code < 500
    huge = b'{"input_ids": [[' + b"1," * 5_000_000 + b"1]]}"  # 10 MB
    response = post(huge)
    assert response.status_code == 413 and "request body over" in response.text
    one_long_row = {"input_ids": [[1] * 100_000]}  # under the size limit, far from 16 tokens
    assert httpx.post(f"{server}/embed", json=one_long_row, timeout=10).status_code == 400


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=40,
)  # fmt: skip


@pytest.mark.slow
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=json_values | st.fixed_dictionaries({"input_ids": json_values}))
def test_fuzzed_bodies_never_get_a_server_error(server: str, body) -> None:
    response = httpx.post(f"{server}/embed", content=json.dumps(body), timeout=10,
                          headers={"content-type": "application/json"})  # fmt: skip
    assert response.status_code < 500, (body, response.text)
    if response.status_code == 200:
        got = torch.tensor(response.json()["embeddings"])
        assert got.shape[1] == 64 and all(math.isfinite(v) for v in got.flatten().tolist())


@pytest.mark.slow
def test_the_cli_serves_the_example(tmp_path: Path) -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "cudagraphs", "serve", str(ROOT / "examples" / "serve_http.py") + ":make",
         "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            pytest.fail("the server did not come up")
        body = {"input_ids": [[3] * 16]}
        assert (
            httpx.post(f"http://127.0.0.1:{port}/embed", json=body, timeout=10).status_code == 200
        )
    finally:
        process.terminate()
        process.wait(20)


@pytest.mark.slow
def test_the_cli_refuses_a_maker_that_returns_no_app(tmp_path: Path) -> None:
    target = tmp_path / "maker.py"
    target.write_text("def make():\n    return (lambda x: x), ()\n")
    done = subprocess.run(
        [sys.executable, "-m", "cudagraphs", "serve", f"{target}:make"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "must return an ASGI app" in done.stderr and "Traceback" not in done.stderr


def test_the_image_endpoint_with_a_stand_in_classifier(monkeypatch: pytest.MonkeyPatch) -> None:
    """/classify as it runs where torchvision is installed, with a small conv net standing in
    for ResNet-18 (torchvision is not installed everywhere the tests run)."""

    def small_classifier(device: str):
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(), torch.nn.Linear(4, 10),
        ).to(device).eval()  # fmt: skip
        return net, torch.randn(serve_http.MAX_BATCH, 3, 32, 32, device=device)

    monkeypatch.setattr(serve_http, "classifier", small_classifier)
    from fastapi.testclient import TestClient

    with TestClient(serve_http.make()) as client:
        images = torch.rand(2, 3, 32, 32)
        response = client.post("/classify", json={"images": images.tolist()})
        assert response.status_code == 200, response.text
        net, _ = small_classifier("cpu")
        with torch.no_grad():
            want = net(images)
        torch.testing.assert_close(
            torch.tensor(response.json()["logits"]), want, rtol=1e-4, atol=1e-4
        )
        assert (
            client.post("/classify", json={"images": images[:, :, :16].tolist()}).status_code == 400
        )
        nan = b'{"images": [[[[NaN]]]]}'
        bad = client.post("/classify", content=nan, headers={"content-type": "application/json"})
        assert bad.status_code == 422
        assert client.post("/classify", json={"images": [[[1.0, 2.0], [3.0]]]}).status_code in (
            400,
            422,
        )
