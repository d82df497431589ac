"""Guards checked in the part a guard broken partway would miss (``scripts/break-guards``'s
partial breaks): a shape wrong only after its first dimension, a plain argument equal but of
another type, the second of two outputs read after the next call, calls from threads in the
default output mode, a list item past the first changed at capture, a mid-sized NumPy array,
a harmless name that is only part of another, the lazy form's warm-up calls, a buffer given
new memory, a later child module or a second module switched to training, and the second of
two closure or global tensors rebound. On the CPU stand-in (conftest.py), which replays like a graph."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import cudagraphs as cg


def test_a_shape_wrong_only_after_its_first_dimension_is_refused(stand_in: None) -> None:
    g = cg.graph(lambda x: x * 2, torch.randn(4, 8))
    g(torch.randn(4, 8))
    with pytest.raises(cg.InputMismatchError, match=r"shape \(4, 6\)"):
        g(torch.randn(4, 6))
    with pytest.raises(cg.InputMismatchError, match=r"shape \(4, 8, 1\)"):
        g(torch.randn(4, 8, 1))


def test_a_plain_argument_equal_but_of_another_type_is_refused(stand_in: None) -> None:
    # 2 == 2.0 == True, but a branch on isinstance, or an index, tells them apart: the graph
    # froze the int.
    g = cg.graph(lambda x, k: x * k, torch.randn(4, 8), 2)
    x = torch.randn(4, 8)
    torch.testing.assert_close(g(x, 2), x * 2)
    for other in (2.0, True):
        with pytest.raises(cg.InputMismatchError):
            g(x, other)


def test_every_output_of_a_call_is_stale_after_the_next_one(stand_in: None) -> None:
    g = cg.graph(lambda x: (x * 2, x + 1, x - 1), torch.randn(4, 8))
    first = g(torch.randn(4, 8))
    g(torch.randn(4, 8))
    for output in first:
        with pytest.raises(RuntimeError, match="StaleOutputError"):
            output.sum()


def test_threads_in_the_default_output_mode_each_get_their_own_answer(stand_in: None) -> None:
    # The library's lock, not the caller's: without it two replays interleave over one set
    # of static buffers and a thread reads another call's answer.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).requires_grad_(False)
    g = cg.graph(model, torch.randn(16, 64))
    g(torch.randn(16, 64))
    wrong: list[int] = []
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        try:
            for _ in range(60):
                x = torch.randn(16, 64, generator=generator)
                if not torch.allclose(g(x), model(x), atol=1e-5):
                    wrong.append(seed)
        except BaseException as error:  # reported below
            errors.append(error)

    with pytest.warns(cg.CudaGraphsWarning, match="second thread"):
        workers = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    assert not errors, errors[:2]
    assert not wrong


class _Stepping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).requires_grad_(False)
        self.state = [0, 0, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state[2] += 1  # changed in place, past the first item
        return self.fc(x) * (1 + self.state[2] % 2)


def test_a_list_item_past_the_first_changed_in_place_at_capture_is_refused(
    stand_in: None,
) -> None:
    with pytest.raises(cg.FrozenStateError, match="state"):
        cg.graph(_Stepping(), torch.randn(4, 8))


def test_a_numpy_array_under_the_copy_limit_changed_in_place_is_seen(stand_in: None) -> None:
    np = pytest.importorskip("numpy")

    class Table(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8).requires_grad_(False)
            self.table = np.ones((16, 8))  # 1 KiB: compared by its memory before each replay

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * float(self.table[3, 2])

    model = Table()
    g = cg.graph(model, torch.randn(4, 8), outputs="clone")
    x = torch.randn(4, 8)
    recorded = g(x)
    model.table[3, 2] = 4.0
    assert not torch.allclose(model(x), recorded)
    torch.testing.assert_close(g(x), model(x))
    assert g.stats.recaptures == 1


class _TwoCounters(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).requires_grad_(False)
        self.calls, self.scale_calls = 0, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.scale_calls += 1
        return self.fc(x) * (1 + self.scale_calls % 2)


def test_a_harmless_name_covers_that_name_and_not_one_it_is_part_of(stand_in: None) -> None:
    with pytest.raises(cg.FrozenStateError, match="scale_calls") as info:
        cg.graph(_TwoCounters(), torch.randn(4, 8), harmless_state=("calls",))
    assert info.value.names == ["_TwoCounters.scale_calls"]


def test_the_lazy_form_checks_each_warm_up_call(stand_in: None) -> None:
    g = cg.graph(lambda x: x * 2, warmup=3)
    g(torch.randn(4, 8))  # the first call: its signature is the graph's
    with pytest.raises(cg.InputMismatchError, match=r"shape \(5, 8\)"):
        g(torch.randn(5, 8))  # still warming up: refused all the same


class _Scaled(nn.Module):
    """A linear layer times a buffer: the buffer is read by address, like a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).requires_grad_(False)
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


def test_a_buffer_given_new_memory_after_capture_is_seen(stand_in: None) -> None:
    # The module's buffer slot still holds the same tensor: only its address tells.
    torch.manual_seed(0)
    model = _Scaled()
    g = cg.graph(model, torch.randn(4, 8), outputs="clone")
    x = torch.randn(4, 8)
    torch.testing.assert_close(g(x), model(x))
    model.scale.data = torch.randn(8)
    torch.testing.assert_close(g(x), model(x))
    assert g.stats.recaptures == 1


def test_a_later_child_switched_to_training_after_capture_is_seen(stand_in: None) -> None:
    # Two BatchNorm layers: only the second is switched, so a guard that read the mode of
    # the first child only would replay the recorded eval-mode normalization.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.BatchNorm1d(8)
    ).requires_grad_(False)
    model.eval()
    g = cg.graph(model, torch.randn(4, 8), outputs="clone")
    x = torch.randn(4, 8)
    torch.testing.assert_close(g(x), model(x))
    model[3].train()
    got = g(x)
    torch.testing.assert_close(got, model(x))
    assert g.stats.recaptures == 1


def test_the_second_of_two_modules_switched_to_training_after_capture_is_seen(
    stand_in: None,
) -> None:
    # A function of two modules: both are roots of the guard, each with its own mode.
    torch.manual_seed(0)
    linear = nn.Linear(8, 8).requires_grad_(False)
    norm = nn.BatchNorm1d(8).requires_grad_(False).eval()
    g = cg.graph(lambda x: norm(linear(x)), torch.randn(4, 8), outputs="clone")
    x = torch.randn(4, 8)
    torch.testing.assert_close(g(x), norm(linear(x)))
    norm.train()
    torch.testing.assert_close(g(x), norm(linear(x)))
    assert g.stats.recaptures == 1


SCALE, SHIFT = torch.full((8,), 2.0), torch.full((8,), 0.5)


def _scaled_and_shifted(x: torch.Tensor) -> torch.Tensor:
    return x * SCALE + SHIFT


@pytest.mark.parametrize("name", ["SCALE", "SHIFT"])
def test_either_of_two_global_tensors_rebound_after_capture_is_seen(
    stand_in: None, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # Declared harmless, the names leave the value watch, but they are tensors read by
    # address: a rebinding is seen by the guard's rebound-name check, for each of them.
    g = cg.graph(
        _scaled_and_shifted, torch.randn(4, 8), outputs="clone", harmless_state=["SCALE", "SHIFT"]
    )
    x = torch.randn(4, 8)
    torch.testing.assert_close(g(x), _scaled_and_shifted(x))
    monkeypatch.setitem(globals(), name, torch.full((8,), -3.0))
    torch.testing.assert_close(g(x), _scaled_and_shifted(x))
    assert g.stats.recaptures == 1
