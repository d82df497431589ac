"""cg.Batcher over a real bucketed CUDA graph: many threads, requests of random sizes, every
answer equal to the model on that request alone and owned by the caller (not graph memory)."""

from __future__ import annotations

import random
import threading

import pytest
import torch

import cudagraphs as cg

pytestmark = pytest.mark.cuda


def test_threads_through_a_bucketed_graph_get_their_own_rows() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8))
    model = model.cuda().eval()
    example = torch.randn(32, 64, device="cuda")
    with torch.no_grad():
        graph = cg.graph(model, example, buckets={"B": cg.powers_of_two(32)})
    requests = [torch.randn(random.Random(i).randint(1, 6), 64, device="cuda") for i in range(400)]
    answers: dict[int, torch.Tensor] = {}
    with cg.Batcher(graph, example[:1], max_wait_ms=1.0) as batcher:

        def client(k: int) -> None:
            for i in range(k, len(requests), 8):
                answers[i] = batcher.run(requests[i], timeout=30)

        workers = [threading.Thread(target=client, args=(k,)) for k in range(8)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
    assert sorted(answers) == list(range(len(requests)))
    pool = graph.pool
    with torch.no_grad():
        for i, x in enumerate(requests):
            torch.testing.assert_close(answers[i], model(x), rtol=1e-5, atol=1e-5)
            assert answers[i]._base is None  # and its values survived 400 later replays
    metrics = batcher.metrics()
    assert metrics.requests == len(requests) and metrics.errors == {}
    assert metrics.batches < len(requests), "requests should have been batched together"
    assert pool is not None and sum(graph.stats.hits.values()) == metrics.batches


def test_requests_on_the_host_are_answered_on_the_host() -> None:
    """request_device="cpu": requests arrive as CPU tensors (as a server parses them), the
    worker moves each batch to the GPU once and the output back once."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    model = model.cuda().eval()
    example = torch.randn(16, 32, device="cuda")
    with torch.no_grad():
        graph = cg.graph(model, example, buckets={"B": cg.powers_of_two(16)})
    requests = [torch.randn(random.Random(i).randint(1, 5), 32) for i in range(100)]
    with cg.Batcher(graph, example[:1], max_wait_ms=1.0, request_device="cpu") as batcher:
        futures = [batcher.submit(x) for x in requests]
        answers = [f.result(30) for f in futures]
        with pytest.raises(cg.InputMismatchError, match=r"expected torch\.float32 on cpu"):
            batcher.submit(requests[0].cuda())
    with torch.no_grad():
        for x, answer in zip(requests, answers):
            assert answer.device.type == "cpu"
            torch.testing.assert_close(answer, model(x.cuda()).cpu(), rtol=1e-5, atol=1e-5)
    assert batcher.metrics().batches < len(requests)
