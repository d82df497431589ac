"""An OpenAI-style HTTP front for an LLM :class:`~cudagraphs.decoding.Engine`: FastAPI, in the
``serve`` extra (``pip install -e '.[serve]'`` from a clone), started by uvicorn or by
``python -m cudagraphs serve FILE.py:MAKE``.

- ``POST /v1/completions``: ``prompt`` as token ids (or text, where a tokenizer is given),
  ``max_tokens``, ``temperature`` (0: greedy), ``top_p``, ``top_k``, ``seed``,
  ``stop_token_ids`` (default: the model's end-of-sequence ids), ``stream``. The answer
  carries the new ids (``token_ids``) and, with a tokenizer, their text. With ``stream`` it is
  server-sent events, one per token, then ``data: [DONE]``. A client that goes away cancels
  its request; its slot is freed at the next step.
- ``GET /metrics``: the engine's counters as Prometheus text (queue depth, occupancy,
  tokens/s, time to first token and inter-token latency at p50 and p99).
- ``GET /healthz``: whether the engine runs, and whether on graphs or eagerly (and why).

Errors are JSON ``{"error": {"message", "type"}}``: 400 for a request the engine cannot serve
(``BadRequestError``), 422 for a body that is not the declared JSON, 429 with ``Retry-After``
when the queue is full, 503 once the engine is closed, 500 for a failed step.

Right::

    app = completions_app(engine, tokenizer=tokenizer, model_name="tiny-llama")
    uvicorn.run(app, port=8000)

Wrong: one ``Decoder.generate`` per HTTP request: requests take turns, each a batch of one.
"""

# No ``from __future__ import annotations``: FastAPI reads the request model from the handler's
# annotation, which must be the class itself (it is defined inside completions_app).
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ..errors import BadRequestError, BatcherClosed, CudaGraphsError, Overloaded

if TYPE_CHECKING:
    from ..decoding import Completion, Engine

__all__ = ["completions_app"]


def completions_app(engine: "Engine", tokenizer: Any = None, model_name: str = "model") -> Any:
    """The FastAPI app serving ``engine`` (see the module doc). ``tokenizer``: anything with
    ``encode(text) -> ids`` and ``decode(ids) -> text`` (a transformers tokenizer), for text
    prompts and text answers; without one, ids in and ids out."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from pydantic import BaseModel, Field

    class CompletionRequest(BaseModel):
        model: str | None = None
        prompt: list[int] | str
        max_tokens: int = Field(16, ge=1)
        temperature: float = Field(1.0, ge=0)
        top_p: float = Field(1.0, gt=0, le=1)
        top_k: int | None = Field(None, ge=1)
        seed: int | None = Field(None, ge=0)
        stop_token_ids: list[int] | None = None
        stream: bool = False

    app = FastAPI(title=f"cudagraphs engine: {model_name}")

    def error(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> Any:
        body = {"error": {"message": message, "type": kind}}
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> Any:
        return error(422, "invalid_request_error", str(exc.errors()))

    def submit(body: CompletionRequest) -> "Completion":
        prompt = body.prompt
        if isinstance(prompt, str):
            if tokenizer is None:
                raise BadRequestError(
                    "prompt is text, and this server has no tokenizer: send token ids "
                    "(a list of ints), or start the server with a tokenizer"
                )
            prompt = list(tokenizer.encode(prompt))
        sample = body.temperature > 0
        return engine.submit(
            prompt,
            max_new_tokens=body.max_tokens,
            do_sample=sample,
            temperature=body.temperature if sample else 1.0,
            top_k=body.top_k if sample else None,
            top_p=body.top_p if sample and body.top_p < 1 else None,
            seed=body.seed,
            eos_token_id=-1 if body.stop_token_ids is None else body.stop_token_ids,
        )

    def refused(exc: CudaGraphsError) -> Any:
        if isinstance(exc, BadRequestError):
            return error(400, "invalid_request_error", str(exc))
        if isinstance(exc, Overloaded):
            retry = str(max(1, round(exc.retry_after_s)))
            return error(429, "overloaded", str(exc), headers={"Retry-After": retry})
        if isinstance(exc, BatcherClosed):
            return error(503, "unavailable", str(exc))
        return error(500, "server_error", str(exc))

    def text_of(ids: list[int]) -> str:
        return tokenizer.decode(ids) if tokenizer is not None else ""

    def answer(completion: "Completion", created: int) -> dict[str, Any]:
        new = len(completion.tokens)
        return {
            "id": f"cmpl-{completion.id}",
            "object": "text_completion",
            "created": created,
            "model": model_name,
            "choices": [
                {
                    "index": 0,
                    "text": text_of(completion.tokens),
                    "token_ids": list(completion.tokens),
                    "finish_reason": completion.finish_reason,
                }
            ],
            "usage": {
                "prompt_tokens": len(completion.prompt),
                "completion_tokens": new,
                "total_tokens": len(completion.prompt) + new,
            },
        }

    async def events(completion: "Completion", created: int) -> AsyncIterator[str]:
        sent_text = ""
        tokens = completion.__aiter__()
        try:
            async with contextlib.aclosing(tokens):  # closed with the response: cancels
                async for token in tokens:
                    text = text_of(completion.tokens) if tokenizer is not None else ""
                    piece, sent_text = text[len(sent_text) :], text
                    chunk = {
                        "id": f"cmpl-{completion.id}",
                        "object": "text_completion",
                        "created": created,
                        "model": model_name,
                        "choices": [
                            {"index": 0, "text": piece, "token_ids": [token], "finish_reason": None}
                        ],
                    }
                    yield f"data: {json.dumps(chunk)}\n\n"
            last = answer(completion, created)
            last["choices"][0].update(text="", token_ids=[])
            yield f"data: {json.dumps(last)}\n\n"
        except CudaGraphsError as exc:  # a failed step or a closed engine, mid-stream
            yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'server_error'}})}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        created = int(time.time())
        try:
            completion = submit(body)
        except CudaGraphsError as exc:
            return refused(exc)
        if body.stream:
            return StreamingResponse(events(completion, created), media_type="text/event-stream")
        try:
            await completion.wait()
        except CudaGraphsError as exc:
            return refused(exc)
        return answer(completion, created)

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(engine.prometheus(), media_type="text/plain; version=0.0.4")

    @app.get("/healthz")
    async def healthz() -> Any:
        health = engine.health()
        return JSONResponse(health, status_code=200 if health["status"] == "ok" else 503)

    return app
