"""A torch.compile(mode="reduce-overhead") Llama decode loop in a fresh process, with or without
cudagraphs imported and a guarded graph alive. Prints one JSON line: tokens, tokens/s, the number
of graphs Dynamo compiled, and whether a cudagraphs guard was alive.

    python tests/compile_decode.py with|without [hidden layers tokens]
"""

from __future__ import annotations

import json
import sys
import time

import torch
from llama_decode import tiny_llama


def main() -> None:
    mode = sys.argv[1]
    hidden, layers, new_tokens = (int(a) for a in (sys.argv[2:5] or (256, 4, 64)))
    keep = None
    if mode == "with":
        import cudagraphs as cg

        block = torch.nn.Linear(16, 16).cuda().eval()
        with torch.no_grad():
            keep = cg.graph(block, torch.randn(4, 16, device="cuda"))  # holds an address guard
        assert keep.guard is not None
    from torch._dynamo.utils import counters
    from transformers import StaticCache

    from cudagraphs.decoding.kv_cache import cache_keyword

    model, config = tiny_llama("cuda", hidden=hidden, layers=layers)
    prompt = torch.randint(
        0, 512, (1, 8), device="cuda", generator=torch.Generator("cuda").manual_seed(0)
    )
    cache = StaticCache(config=config, max_cache_len=8 + new_tokens + 8)
    forward = torch.compile(model.forward, mode="reduce-overhead")
    tokens = []
    keyword = cache_keyword(model)  # `cache` in newer transformers
    with torch.no_grad():
        logits = model(prompt, **{keyword: cache}, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        position = torch.tensor([8], device="cuda")
        start = None
        for step in range(new_tokens):
            if step == 8:  # compiled and recorded by now: time the rest
                torch.cuda.synchronize()
                start = time.perf_counter()
            out = forward(input_ids=token, **{keyword: cache}, cache_position=position)
            token = out.logits[:, -1:].argmax(-1).clone()
            position += 1
            tokens.append(int(token.item()))
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    print(
        json.dumps(
            {
                "tokens": tokens,
                "tok_s": (new_tokens - 8) / elapsed,
                "frames": counters["stats"]["unique_graphs"],
                "guard_alive": keep is not None and keep.guard is not None,
            }
        )
    )


if __name__ == "__main__":
    main()
