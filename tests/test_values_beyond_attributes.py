"""Values a recording read from somewhere other than the instance's own attributes: the
class (a class-level default, a method), a base class, and the items of a list. Each change
after the capture must give eager's answer through one new capture, never the recorded one.
On the CPU the stand-in (conftest.py) replays the logged operations without running the
function, so a value the guard missed would give the old answer here as in a graph."""

from __future__ import annotations

import pytest
import torch
from value_cases import BEYOND_ATTRIBUTES, DefaultedChild

import cudagraphs as cg


@pytest.mark.parametrize("case", list(BEYOND_ATTRIBUTES))
def test_a_value_read_beyond_the_instance_changed_after_capture_gives_eager_s_answer(
    stand_in: None, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = DefaultedChild()
    g = cg.graph(model, torch.randn(4, 8), outputs="clone")
    x = torch.randn(4, 8)
    torch.testing.assert_close(g(x), model(x))
    fresh = torch.randn(4, 8)
    recorded = model(fresh)  # what a replay that missed the change would give
    change, name = BEYOND_ATTRIBUTES[case]
    change(model, monkeypatch)
    expected = model(fresh)
    assert not torch.allclose(expected, recorded)  # the change matters to the answer
    torch.testing.assert_close(g(fresh), expected)
    assert g.stats.recaptures == 1
    assert any(name in notice for notice in g.stats.notices)
    again = torch.randn(4, 8)
    torch.testing.assert_close(g(again), model(again))
    assert g.stats.recaptures == 1  # the new value is the recorded one now
