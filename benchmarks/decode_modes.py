"""The modes of ``benchmarks/decode.py`` (and ``decode_profile.py``): how each mode's request
function is built, the clock that marks its launches on the GPU's timeline, and the timing
helpers the runs share."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # the CPU: a smoke run of the script itself

# The Decoder's compile= for the coordinate-descent modes (here and in decode_profile.py).
COORDINATE_DESCENT = {"coordinate_descent_tuning": True}
ALL_MODES = (
    "hf eager", "hf static", "eager loop", "reduce-overhead loop",
    "cg", "cg K=16", "cg compile", "cg compile K=4", "cg compile K=16", "cg compile autotune",
    "cg compile coordinate-descent", "cg from 2", "cg compile from 2",
    "cg until-eos", "cg compile until-eos", "cg eos-check", "cg compile eos-check",
    "cg compile unsaved", "cg compile expanded", "cg compile unfused",
)  # fmt: skip


class TokenClock:
    """Marks on the GPU's timeline after each decode launch (CUDA events, so no sync), for the
    time per token in steady state: the interval between two marks over the tokens the later
    launch made. The prefill and the first launch are not in it. Modes that make all tokens in
    one launch have no intervals."""

    def __init__(self) -> None:
        self.on = False
        self.marks: list[tuple[Any, int]] = []

    def tick(self, tokens: int) -> None:
        if not self.on:
            return
        if CUDA:
            mark: Any = torch.cuda.Event(enable_timing=True)
            mark.record()
        else:
            mark = time.perf_counter()
        self.marks.append((mark, tokens))

    def per_token_ms(self) -> list[float]:
        """After the GPU finished: one figure per token of every launch but the first."""
        out: list[float] = []
        for (start, _), (end, tokens) in zip(self.marks, self.marks[1:]):
            ms = start.elapsed_time(end) if CUDA else 1e3 * (end - start)
            out += [ms / tokens] * tokens
        self.marks = []
        return out


class Ticking:
    """A Decoder's graph that marks the clock after each launch (everything else passes
    through)."""

    def __init__(self, graphed: Any, clock: TokenClock, tokens: int):
        self._graphed, self._clock, self._tokens = graphed, clock, tokens

    def __call__(self, *args: Any) -> Any:
        out = self._graphed(*args)
        self._clock.tick(self._tokens)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._graphed, name)


class Loop:
    """A decode loop over a transformers StaticCache, eager or through torch.compile."""

    def __init__(
        self, model: Any, batch: int, length: int, compile_mode: str | None, clock: TokenClock
    ):
        from transformers import StaticCache

        from cudagraphs.decoding.kv_cache import cache_keyword

        self.model, self.compiled, self.clock = model, compile_mode is not None, clock
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        # `cache` in newer transformers, `past_key_values` before: decided once, not per step
        self.keyword = keyword = cache_keyword(model)

        def step(token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
            logits = model(
                input_ids=token, **{keyword: self.cache}, cache_position=position, use_cache=True
            ).logits
            return logits[:, -1].argmax(-1, keepdim=True)

        # dynamic=False: each batch size gets kernels of its own, as in transformers' compiled
        # generate, rather than shape-generic ones after the second size.
        self.step = torch.compile(step, mode=compile_mode, dynamic=False) if compile_mode else step

    def __call__(self, prompt: torch.Tensor, new: int) -> torch.Tensor:
        self.cache.reset()
        length = prompt.shape[1]
        positions = torch.arange(length, device=prompt.device)
        logits = self.model(prompt, **{self.keyword: self.cache}, cache_position=positions).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens = [prompt, token]
        # As a user writes it: one position tensor on the device, a copy of it handed to each
        # step (the compiled step's graph keeps its inputs), advanced in place.
        position = torch.tensor([length], device=prompt.device)
        for _ in range(new - 1):
            if self.compiled:
                torch.compiler.cudagraph_mark_step_begin()
            token = self.step(token, position.clone()).clone()
            position += 1
            self.clock.tick(1)
            tokens.append(token)
        return torch.cat(tokens, dim=1)


def _compile_of(mode: str) -> bool | str | dict[str, bool]:
    """The Decoder's ``compile=`` argument for a ``cg ...`` mode name."""
    if "coordinate-descent" in mode:
        return dict(COORDINATE_DESCENT)
    if "autotune" in mode:
        return "max-autotune-no-cudagraphs"
    return "compile" in mode


def make_mode(
    name: str, model: Any, batch: int, length: int, clock: TokenClock, configured: bool = False
) -> Callable[[torch.Tensor, int], Any]:
    """One mode's request function, with a static cache of ``length`` tokens (``configured``:
    the length was asked for with --max-length, which transformers' generate is then given)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from cudagraphs.decoding.decoder import Decoder

    class Tick(StoppingCriteria):  # called once per generated token; stops nothing
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            clock.tick(1)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def hf(**extra: Any) -> Callable[[torch.Tensor, int], Any]:
        return lambda prompt, new: model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
            min_new_tokens=new, do_sample=False, pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([Tick()]), **extra,
        )  # fmt: skip

    if name == "hf eager":
        return hf()
    if name == "hf static":
        if not configured:
            return hf(cache_implementation="static")
        from transformers import GenerationConfig

        if not hasattr(GenerationConfig(), "max_cache_len"):
            raise SystemExit(
                "hf static with --max-length needs a transformers whose GenerationConfig has "
                "max_cache_len; leave the mode out, or upgrade transformers"
            )
        return hf(cache_implementation="static", max_cache_len=length)
    if name in ("eager loop", "reduce-overhead loop"):
        return Loop(model, batch, length, "reduce-overhead" if "reduce" in name else None, clock)
    steps = int(name.split("K=")[1]) if "K=" in name else 1
    # eos-check: the host reads the finished flags after every token, which waits for the GPU
    # each time; the id past the vocabulary is never emitted, so no request ends early.
    eos_check = "eos-check" in name
    # The batch rungs a user gets by default (for max_batch=batch), as a user would write it.
    sizes = [2, 4] if name.endswith("from 2") and batch == 1 else None
    decoder = Decoder(
        model, max_batch=max(sizes or [batch]), max_length=length, batch_sizes=sizes,
        steps_per_graph=steps,
        compile=_compile_of(name), check_every=1 if eos_check else 1 << 30,
        until_eos="until-eos" in name, save_compile="unsaved" not in name,
        grouped_attention="expanded" not in name, fuse="unfused" not in name,
    )  # fmt: skip
    for key, graphed in list(decoder.graphs.items()):
        decoder.graphs[key] = Ticking(graphed, clock, steps)
    eos = model.config.vocab_size if eos_check else None

    def run(prompt: torch.Tensor, new: int) -> Any:
        return decoder.generate(prompt, max_new_tokens=new, eos_token_id=eos)

    run.decoder = decoder  # type: ignore[attr-defined]  # its replays per rung, for the row
    return run


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def reserved() -> int:
    return torch.cuda.memory_reserved() if CUDA else 0


def allocated() -> int:
    """Bytes held by live tensors: with ``reserved()``, tells memory a mode holds from blocks
    the caching allocator keeps after their tensors are gone (a weight copied and freed)."""
    return torch.cuda.memory_allocated() if CUDA else 0


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """``fn()``, its wall seconds to the end of the GPU's work, and the host's own seconds (until
    ``fn`` returned, its launches queued): where the host's time is well below the wall time,
    the GPU sets the pace and nothing on the host side can make the mode faster."""
    sync()
    start = time.perf_counter()
    out = fn()
    host = time.perf_counter() - start
    sync()
    return out, time.perf_counter() - start, host


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank), or None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]
