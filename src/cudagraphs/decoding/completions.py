"""One request's answer as it is made: its tokens as they come, from a thread or from asyncio,
and how it ended.

The engine's worker appends tokens and ends the completion; any number of readers wait on it.
A thread iterates (``for token in completion``) or waits for the whole answer
(:meth:`Completion.result`); a coroutine iterates (``async for token in completion``) or awaits
:meth:`Completion.wait`. An async iteration left before the end (a client that disconnected:
the server's generator is closed) cancels the request, and its slot is freed at the next step.

Right::

    completion = engine.submit(prompt, max_new_tokens=64)
    async for token in completion:          # each token once, in order, as it is decoded
        ...
    completion.finish_reason                # "length", "stop" (an end-of-sequence id), ...

Wrong: polling ``completion.tokens`` in a loop: it busy-waits the event loop; iterate instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Literal

from ..errors import RequestCancelled

__all__ = ["Completion", "FinishReason", "cancelled"]

FinishReason = Literal["length", "stop", "cancelled", "error"]


class Completion:
    """The tokens of one request (prompt excluded) and how it ended; see the module doc."""

    def __init__(self, request_id: int, prompt: list[int], max_new_tokens: int):
        self.id = request_id
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.tokens: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.error: BaseException | None = None
        self.submitted = time.perf_counter()
        self.token_times: list[float] = []  # perf_counter time of each token's arrival
        self.cancel_requested = False
        self._changed = threading.Condition()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        """Stop decoding this request: its slot is freed at the next step, and readers see
        :class:`~cudagraphs.RequestCancelled`. Nothing happens once it has ended."""
        self.cancel_requested = True

    # -- written by the engine's worker ------------------------------------------------------

    def add(self, tokens: list[int]) -> None:
        now = time.perf_counter()
        with self._changed:
            self.tokens.extend(tokens)
            self.token_times.extend([now] * len(tokens))
            self._changed.notify_all()
        self._wake()

    def end(self, reason: FinishReason, error: BaseException | None = None) -> None:
        with self._changed:
            if self.finish_reason is not None:
                return
            self.finish_reason, self.error = reason, error
            self._changed.notify_all()
        self._wake()

    def _wake(self) -> None:
        for loop, event in list(self._waiters):
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the reader's loop has closed
                self._waiters.discard((loop, event))

    # -- readers -----------------------------------------------------------------------------

    def _outcome(self) -> list[int]:
        if self.error is not None:
            raise self.error
        return list(self.tokens)

    def result(self, timeout: float | None = None) -> list[int]:
        """Every new token, once the request has ended; raises the request's error (a
        refused, cancelled or failed request), or ``TimeoutError`` after ``timeout`` seconds."""
        with self._changed:
            if not self._changed.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"request {self.id} had not ended after {timeout} s")
        return self._outcome()

    def __iter__(self) -> Iterator[int]:
        seen = 0
        while True:
            with self._changed:
                self._changed.wait_for(lambda seen=seen: len(self.tokens) > seen or self.done)
                new, done = self.tokens[seen:], self.done
            seen += len(new)
            yield from new
            if done and seen == len(self.tokens):
                self._outcome()
                return

    async def wait(self) -> list[int]:
        """Every new token, once the request has ended (as :meth:`result`, awaited). A
        waiter cancelled before the end (a client gone) cancels the request."""
        tokens = self.__aiter__()
        async with contextlib.aclosing(tokens):
            async for _ in tokens:
                pass
        return self._outcome()

    async def __aiter__(self) -> AsyncIterator[int]:
        event = asyncio.Event()
        waiter = (asyncio.get_running_loop(), event)
        self._waiters.add(waiter)
        seen = 0
        try:
            while True:
                with self._changed:
                    new, done = self.tokens[seen:], self.done
                seen += len(new)
                for token in new:
                    yield token
                if done and seen == len(self.tokens):
                    self._outcome()
                    return
                await event.wait()
                event.clear()
        finally:
            self._waiters.discard(waiter)
            if not self.done:  # the reader left before the end: nobody wants the rest
                self.cancel()

    def __repr__(self) -> str:
        state = self.finish_reason or "running"
        return f"<cudagraphs Completion {self.id} {state} tokens={len(self.tokens)}>"


def cancelled(request_id: int) -> RequestCancelled:
    """The error a cancelled request's readers see."""
    return RequestCancelled(f"request {request_id} was cancelled before it ended")
