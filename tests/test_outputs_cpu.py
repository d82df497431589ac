"""Guarded outputs under the CPU stand-in: an output read after the next replay raises, and a
call from another thread while an output is held is answered eagerly, never by a replay that
would overwrite what the first thread reads."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import cudagraphs as cg


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))


def test_an_output_and_its_views_read_after_the_next_call_raise(stand_in: None) -> None:
    model = _model()
    x1, x2 = torch.randn(4, 8), torch.randn(4, 8)
    with torch.no_grad():
        g = cg.graph(model, torch.randn(4, 8))  # the default policy: guarded
        a = g(x1)
        view = a[1:]
        torch.testing.assert_close(a, model(x1))  # valid until the next call
        b = g(x2)
        torch.testing.assert_close(b, model(x2))
        for stale in (lambda: a.sum(), lambda: view + 1, lambda: a.clone()):
            with pytest.raises(RuntimeError, match="StaleOutputError"):
                stale()
        kept = g(x1).clone()  # the fix the message gives: clone before the next call
        g(x2)
        torch.testing.assert_close(kept, model(x1))


def test_a_call_from_another_thread_while_an_output_is_held_is_answered_eagerly(
    stand_in: None,
) -> None:
    model = _model()
    x1, x2 = torch.randn(4, 8), torch.randn(4, 8)
    with torch.no_grad():
        g = cg.graph(model, torch.randn(4, 8))
        held = g(x1)  # alive while the other thread calls
        expected_held, expected_other = model(x1), model(x2)
    answers: list[Any] = []

    def other() -> None:
        with torch.no_grad():
            answers.append(g(x2))

    with pytest.warns(cg.CudaGraphsWarning, match="second thread"):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    torch.testing.assert_close(answers[0], expected_other)
    assert g.stats.eager_calls == 1  # answered by running the model, not by a replay
    torch.testing.assert_close(held, expected_held)  # what the first thread holds is intact
    del held
    with torch.no_grad():
        again = g(x2)  # nothing held now: a replay, handed out as a copy
    torch.testing.assert_close(again, expected_other)
    assert g.stats.eager_calls == 1 and g.stats.replays >= 2
