"""Inference server: requests of any batch size 1..64 served by 7 captured graphs in one pool.

An inference server. Batches are padded up to the nearest captured size (powers of two),
replayed, and sliced back; above 64 the batch is split into chunks of 64. Every size is checked
against eager here. Runs on a GPU; on a CPU-only machine the same padding and slicing run eagerly.

    python examples/server_buckets.py
"""

import random

import torch
from torch import nn

import cudagraphs as cg

device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 10)).to(device).eval()

with torch.no_grad():
    serve = cg.graph(
        model,
        torch.randn(64, 256, device=device),
        buckets=cg.Buckets({"B": cg.powers_of_two(64)}, overflow="chunk"),
    )
    if isinstance(serve, cg.Bucketed):
        serve.report()  # capture seconds and MiB per bucket, pool total

    rng = random.Random(0)
    for _ in range(20):
        batch = torch.randn(rng.randint(1, 100), 256, device=device)
        logits = serve(batch)
        assert logits.shape == (batch.shape[0], 10)
        torch.testing.assert_close(logits, model(batch), rtol=1e-4, atol=1e-4)
    print("20 requests of random sizes served; hits per bucket:", serve.stats.hits)
    print(
        f"padding waste {serve.stats.padding_waste:.1%}, overflows chunked: {serve.stats.overflows}"
    )
