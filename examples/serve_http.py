"""An HTTP inference server: FastAPI + uvicorn, models behind cg.Batcher over bucketed graphs.

Two models with random weights from configs (no download): a 12-layer BERT-style text encoder
(transformers; ``POST /embed``, token ids in, one embedding per row out) and, where torchvision
is installed, a ResNet-18 image classifier (``POST /classify``, 32x32 RGB images in, 10 class
logits per image out). Concurrent requests are batched, padded into the graph's batch rung,
replayed once and split back. Requests are parsed and checked on the host and handed to the
batchers as CPU tensors: each batch moves to the GPU and back once, in the batcher's worker, so
the event loop never waits on the GPU. JSON in and out; a bad request gets a 4xx with the reason
(422 for a body that is not the declared JSON, 400 for one the model cannot take, 503 when the
queue is full); ``GET /metrics`` (Prometheus text), ``GET /healthz``.

    python -m cudagraphs serve examples/serve_http.py:make --port 8000
    curl -s localhost:8000/embed -H 'content-type: application/json' \\
         -d '{"input_ids": [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]}'

Needs the serve extra (``pip install -e '.[serve]'`` from a clone: FastAPI, uvicorn) and transformers.
On a CPU-only machine the graphs are the eager pass-through; everything else is the same.
"""

from __future__ import annotations

import asyncio
import warnings
from contextlib import asynccontextmanager
from typing import Annotated, Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, Field

import cudagraphs as cg

SEQUENCE = 16  # tokens per row of /embed
VOCAB = 1000
MAX_BATCH = 32
IMAGE = 32  # pixels per side of /classify
MAX_BODY_BYTES = 8 * 2**20  # a full batch of images as JSON is about 2 MB


class EmbedRequest(BaseModel):
    input_ids: Annotated[list[list[int]], Field(min_length=1, max_length=MAX_BATCH)]


Pixel = Annotated[float, Field(allow_inf_nan=False)]


class ClassifyRequest(BaseModel):
    images: Annotated[list[list[list[list[Pixel]]]], Field(min_length=1, max_length=MAX_BATCH)]


def encoder(device: str) -> tuple[Any, torch.Tensor]:
    from transformers import BertConfig, BertModel

    # Twelve layers as in BERT-base, narrower (256 wide): the launches of a real encoder, and
    # answers small enough that JSON does not dominate.
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=12, num_attention_heads=4,
        intermediate_size=1024, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = BertModel(config).to(device).eval()

    def embed(input_ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids).last_hidden_state[:, 0]  # the [CLS] row

    return embed, torch.randint(0, VOCAB, (MAX_BATCH, SEQUENCE), device=device)


def classifier(device: str) -> tuple[Any, torch.Tensor] | None:
    try:
        from torchvision.models import resnet18
    except ImportError:
        return None
    torch.manual_seed(0)
    model = resnet18(num_classes=10).to(device).eval()
    return model, torch.randn(MAX_BATCH, 3, IMAGE, IMAGE, device=device)


def make() -> FastAPI:
    """The app: one batcher per model, each over a graph with one rung per power of two."""
    return build("graphs+batcher")


def make_eager_batched() -> FastAPI:
    """The same app with the batcher over the eager models (for comparison)."""
    return build("eager+batcher")


def make_eager() -> FastAPI:
    """The same app calling the eager models once per request, no batcher (for comparison)."""
    return build("eager")


class _Direct:
    """Per-request eager calls behind the batcher's interface (``await runner(x)``)."""

    def __init__(self, fn: Any, name: str, device: str):
        self.fn, self.name, self.device = fn, name, device

    async def __call__(self, x: torch.Tensor) -> Any:
        def call() -> Any:
            with torch.no_grad():
                return self.fn(x.to(self.device)).cpu()

        return await asyncio.to_thread(call)

    def prometheus(self) -> str:
        return ""

    def close(self) -> None:
        pass


def build(mode: str) -> FastAPI:
    """``mode``: ``"graphs+batcher"``, ``"eager+batcher"`` or ``"eager"``."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    warnings.filterwarnings("ignore", category=cg.CudaGraphsWarning)  # CPU: eager, said once
    batchers: dict[str, Any] = {}
    with torch.inference_mode():
        for name, made in (("embed", encoder(device)), ("classify", classifier(device))):
            if made is None:
                continue
            fn, example = made
            if mode == "eager":
                batchers[name] = _Direct(fn, name, device)
                continue
            if mode == "graphs+batcher":
                buckets = {"B": cg.powers_of_two(MAX_BATCH)}
                fn = cg.graph(fn, example, buckets=buckets, outputs="alias")
            batchers[name] = cg.Batcher(
                fn, example[:1], max_batch=MAX_BATCH, max_wait_ms=2.0, max_queue=256, name=name,
                request_device="cpu",
            )  # fmt: skip

    # What runs, not what was asked for: graphs need CUDA, and without it they run eagerly.
    running = mode if device == "cuda" else mode.replace("graphs+", "eager+") + " (no CUDA)"

    @asynccontextmanager
    async def lifespan(_: FastAPI):  # type: ignore[no-untyped-def]
        yield
        for batcher in batchers.values():  # answer what is queued, then stop
            batcher.close()

    app = FastAPI(title="cudagraphs serving example", lifespan=lifespan)

    @app.middleware("http")
    async def limit_body(request: Request, call_next: Any) -> Any:
        # A huge body is refused before it is read or parsed: 413 with the limit.
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > MAX_BODY_BYTES):
            detail = f"request body over {MAX_BODY_BYTES} bytes; send at most {MAX_BATCH} rows"
            return JSONResponse({"detail": detail}, status_code=413)
        return await call_next(request)

    async def run(name: str, x: torch.Tensor) -> Any:
        with torch.inference_mode():
            return (await batchers[name](x)).tolist()

    @app.post("/embed")
    async def embed(body: EmbedRequest) -> dict[str, Any]:
        ids = torch.tensor(body.input_ids) if _rectangular(body.input_ids) else None
        if ids is None or ids.dim() != 2:
            raise _BadRequest("input_ids must be a list of rows of equal length")
        if int(ids.min()) < 0 or int(ids.max()) >= VOCAB:
            raise _BadRequest(f"token ids must be in 0..{VOCAB - 1}")
        return {"embeddings": await run("embed", ids)}

    if "classify" in batchers:

        @app.post("/classify")
        async def classify(body: ClassifyRequest) -> dict[str, Any]:
            images = torch.tensor(body.images) if _rectangular(body.images) else None
            if images is None or images.dim() != 4:
                raise _BadRequest("images must be a list of [3][32][32] arrays")
            return {"logits": await run("classify", images)}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> str:
        return "".join(b.prometheus() for b in batchers.values())

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        reserved = torch.cuda.memory_reserved() if device == "cuda" else 0
        return {"ok": True, "device": device, "mode": running, "models": sorted(batchers),
                "memory_reserved_bytes": reserved}  # fmt: skip

    statuses = {
        _BadRequest: 400, cg.InputMismatchError: 400, RecursionError: 400,
        cg.Overloaded: 503, cg.BatcherClosed: 503, cg.DeadlineExceeded: 504,
    }  # fmt: skip

    async def refuse(_: Request, error: Exception) -> JSONResponse:
        status = next(code for kind, code in statuses.items() if isinstance(error, kind))
        detail = "request nested too deeply" if isinstance(error, RecursionError) else str(error)
        headers = {"Retry-After": "1"} if status == 503 else None
        return JSONResponse({"detail": detail}, status_code=status, headers=headers)

    for kind in statuses:
        app.add_exception_handler(kind, refuse)

    async def invalid(_: Request, error: Exception) -> JSONResponse:
        # FastAPI's own handler echoes the offending input, and a NaN in it cannot be written
        # as JSON (a 500 instead of the 422): say where and what, without the value.
        errors = error.errors() if isinstance(error, RequestValidationError) else []
        detail = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", "")} for e in errors]
        return JSONResponse({"detail": detail}, status_code=422)

    app.add_exception_handler(RequestValidationError, invalid)
    app.state.batchers = batchers
    return app


class _BadRequest(ValueError):
    """A body of the declared JSON types that the model still cannot take."""


def _rectangular(value: Any) -> bool:
    """Whether nested lists have equal lengths at every level (torch.tensor needs it)."""
    if not isinstance(value, list):
        return True
    if not value:
        return False
    inner = [len(v) if isinstance(v, list) else -1 for v in value]
    return len(set(inner)) == 1 and all(_rectangular(v) for v in value)


if __name__ == "__main__":
    # Started through the command line, which runs uvicorn on the app `make()` builds:
    print(
        "This file defines the app; start the server with\n"
        "    python -m cudagraphs serve examples/serve_http.py:make --port 8000\n"
        "then: curl -s localhost:8000/healthz (the module docstring lists the endpoints)."
    )
