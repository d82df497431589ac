"""The OpenAI-style HTTP front of an LLM engine (``cudagraphs.serve.completions_app``), through
FastAPI's test client: ids in and out equal ``model.generate``'s, streaming as server-sent
events, text with a tokenizer, refusals with their status codes, metrics and health."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from fastapi.testclient import TestClient
from test_engine import prompts, reference

from cudagraphs.decoding import Engine
from cudagraphs.serve import completions_app

pytestmark = pytest.mark.filterwarnings("ignore::cudagraphs.CudaGraphsWarning")


class Letters:
    """A tokenizer of lowercase letters: id 1 + (letter - 'a'), for the text path."""

    def encode(self, text: str) -> list[int]:
        return [1 + ord(c) - ord("a") for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + (i - 1) % 26) for i in ids)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, Engine, TestClient]]:
    from test_engine import tiny_llama

    model, _ = tiny_llama("cpu", hidden=64, layers=2)
    model.set_attn_implementation("sdpa")
    engine = Engine(model, max_batch=4, max_length=64, prefill_chunk=8, max_queue=8)
    with TestClient(completions_app(engine, tokenizer=Letters(), model_name="tiny")) as client:
        yield model, engine, client
    engine.close(drain=False)


def events(response: Any) -> list[Any]:
    lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def test_ids_in_ids_out_equal_generate(served) -> None:
    model, _, client = served
    prompt = prompts(20, [7])[0]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop_token_ids": []}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    choice = answer["choices"][0]
    assert choice["token_ids"] == reference(model, prompt, 12)
    assert choice["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": 7, "completion_tokens": 12, "total_tokens": 19}
    assert answer["model"] == "tiny" and answer["object"] == "text_completion"


def test_a_stream_sends_each_token_as_an_event_then_done(served) -> None:
    model, _, client = served
    prompt = prompts(21, [5])[0]
    body = {"prompt": prompt, "max_tokens": 9, "temperature": 0, "stop_token_ids": [],
            "stream": True}  # fmt: skip
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = events(response)
    streamed = [t for chunk in chunks[:-1] for t in chunk["choices"][0]["token_ids"]]
    assert streamed == reference(model, prompt, 9)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 9 + ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 9


def test_text_in_and_out_with_a_tokenizer(served) -> None:
    model, _, client = served
    body = {"prompt": "hello", "max_tokens": 6, "temperature": 0, "stop_token_ids": [],
            "stream": True}  # fmt: skip
    with client.stream("POST", "/v1/completions", json=body) as response:
        chunks = events(response)
    expected = reference(model, Letters().encode("hello"), 6)
    assert "".join(c["choices"][0]["text"] for c in chunks) == Letters().decode(expected)
    body["stream"] = False
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == (
        Letters().decode(expected)
    )


def test_seeded_sampling_over_http_repeats(served) -> None:
    _, _, client = served
    body = {"prompt": [3, 4, 5], "max_tokens": 8, "temperature": 0.9, "top_p": 0.9,
            "top_k": 30, "seed": 11, "stop_token_ids": []}  # fmt: skip
    first = client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    again = client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    assert first == again and len(first) == 8


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"prompt": [1, 600], "max_tokens": 4}, 400, "outside the vocabulary"),
        ({"prompt": list(range(1, 60)), "max_tokens": 10}, 400, "cache positions"),
        ({"prompt": [], "max_tokens": 4}, 400, "prompt is empty"),
        ({"prompt": [1, 2], "max_tokens": 0}, 422, "max_tokens"),
        ({"prompt": [1.5, 2], "max_tokens": 3}, 422, "prompt"),
        ({"max_tokens": 3}, 422, "prompt"),
    ],
)
def test_a_bad_request_gets_its_status_and_reason(served, body, status, says) -> None:
    _, _, client = served
    response = client.post("/v1/completions", json=body)
    assert response.status_code == status
    assert says in response.json()["error"]["message"]


def test_a_full_queue_answers_429_with_retry_after(served, monkeypatch) -> None:
    from cudagraphs import Overloaded

    _, engine, client = served

    def full(*args: Any, **kwargs: Any) -> Any:
        raise Overloaded("engine 'engine' has 8 requests waiting, its max_queue", 2.0)

    monkeypatch.setattr(engine, "submit", full)
    response = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "2"


def test_metrics_and_health(served) -> None:
    _, _, client = served
    client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3, "temperature": 0})
    text = client.get("/metrics").text
    for name in ("queue_depth", "occupancy_ratio", "tokens_per_second",
                 "time_to_first_token_seconds", "inter_token_latency_seconds"):  # fmt: skip
        assert f"cudagraphs_engine_{name}" in text
    health = client.get("/healthz")
    assert health.status_code == 200
    assert health.json()["graphs"] is False
    assert "no CUDA" in health.json()["why_eager"]
