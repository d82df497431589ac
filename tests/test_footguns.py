"""The silent traps of CUDA graphs, one test each, in the manner of tinygrad's test_jit_footguns.

Each test pins cudagraphs' behaviour on a trap that makes hand-rolled graphs (and other graph
wrappers) return plausible wrong answers: it is caught, with a clear error or the correct result.
GPU variants carry the `cuda` marker and run in scripts/gpu-check; CPU variants run where the
trap exists without a GPU (signatures are checked by the pass-through too).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import cudagraphs as cg

cuda = pytest.mark.cuda
cpu_quiet = pytest.mark.filterwarnings("ignore::cudagraphs.CudaGraphsWarning")


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------- frozen Python values


@cpu_quiet
def test_frozen_python_constant_is_refused_when_changed() -> None:
    g = cg.graph(lambda x, scale: x * scale, torch.randn(4, device=device()), 2.0)
    x = torch.randn(4, device=device())
    torch.testing.assert_close(g(x, 2.0), x * 2)
    with pytest.raises(cg.InputMismatchError, match=r"args\[1\] is 3.0 .* captured with 2.0"):
        g(x, 3.0)


@cpu_quiet
def test_frozen_branch_on_a_python_flag_argument_is_refused() -> None:
    def fn(x: torch.Tensor, training: bool) -> torch.Tensor:
        return x * 2 if training else x

    g = cg.graph(fn, torch.randn(4, device=device()), True)
    with pytest.raises(cg.InputMismatchError, match=r"args\[1\] is False"):
        g(torch.randn(4, device=device()), False)


MODE = "double"


def by_global_mode(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if MODE == "double" else x * 3


@cuda
def test_frozen_branch_on_a_global_flag_recaptures(caplog: pytest.LogCaptureFixture) -> None:
    global MODE
    g = cg.graph(by_global_mode, torch.randn(4, device="cuda"))
    x = torch.randn(4, device="cuda")
    torch.testing.assert_close(g(x), x * 2)
    MODE = "triple"
    try:
        with caplog.at_level(logging.WARNING, logger="cudagraphs"):
            torch.testing.assert_close(g(x), x * 3)
        assert "global 'MODE' was rebound" in caplog.text
    finally:
        MODE = "double"


@cuda
def test_frozen_branch_on_a_tensor_value_fails_capture_with_the_line() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x

    with pytest.raises(cg.CaptureError) as info:
        cg.graph(fn, torch.randn(4, device="cuda"))
    assert info.value.kind == "host-sync"
    assert any(
        f.kind == "host-sync" and f.filename.endswith("test_footguns.py")
        for f in info.value.findings
    )


def test_frozen_branch_on_a_tensor_value_is_reported_by_the_doctor_on_cpu() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x

    report = cg.doctor(fn, torch.randn(4))
    assert report.blocking and any(f.kind == "host-sync" for f in report.findings)


# ---------------------------------------------------------------- containers and outputs


@cpu_quiet
def test_list_input_is_a_pytree_and_its_length_is_checked() -> None:
    g = cg.graph(lambda xs: sum(xs), [torch.randn(3, device=device()) for _ in range(3)])
    xs = [torch.randn(3, device=device()) for _ in range(3)]
    torch.testing.assert_close(g(xs), xs[0] + xs[1] + xs[2])
    with pytest.raises(cg.InputMismatchError, match=r"missing args\[0\]\[2\]"):
        g(xs[:2])


@cuda
def test_output_kept_in_a_list_across_calls_raises_instead_of_changing() -> None:
    g = cg.graph(lambda x: x + 1, torch.randn(3, device="cuda"))
    kept = [g(torch.full((3,), float(i), device="cuda")) for i in range(3)]
    torch.testing.assert_close(kept[-1], torch.full((3,), 3.0, device="cuda"))
    with pytest.raises(RuntimeError, match="StaleOutputError"):
        kept[0].tolist()
    cloned = cg.graph(lambda x: x + 1, torch.randn(3, device="cuda"), outputs="clone")
    kept = [cloned(torch.full((3,), float(i), device="cuda")) for i in range(3)]
    assert [k[0].item() for k in kept] == [1.0, 2.0, 3.0]


@cuda
def test_output_aliasing_an_input_is_correct_then_stale() -> None:
    g = cg.graph(lambda x: x, torch.randn(3, device="cuda"))
    x = torch.randn(3, device="cuda")
    out = g(x)
    torch.testing.assert_close(out, x)
    g(torch.randn(3, device="cuda"))
    with pytest.raises(RuntimeError, match="StaleOutputError"):
        out.sum()


@cpu_quiet
def test_mutated_input_matches_eager() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x + 1

    g = cg.graph(fn, torch.randn(4, device=device()))
    x = torch.randn(4, device=device())
    expected = x * 2
    torch.testing.assert_close(g(x), expected + 1)
    torch.testing.assert_close(x, expected)


# ---------------------------------------------------------------- addresses that move


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).cuda().eval()


@cuda
def test_parameter_swapped_via_data_recaptures() -> None:
    model = mlp()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(2, 8, device="cuda"))
        model[0].weight.data = torch.randn(8, 8, device="cuda")
        x = torch.randn(2, 8, device="cuda")
        torch.testing.assert_close(g(x), model(x))
    assert g.stats.recaptures == 1


@cuda
def test_parameter_swapped_via_data_raises_when_asked() -> None:
    model = mlp()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(2, 8, device="cuda"), on_stale="raise")
        model[2].bias.data = torch.zeros(4, device="cuda")
        with pytest.raises(cg.StaleGraphError, match=r"2\.bias now lives at new memory"):
            g(torch.randn(2, 8, device="cuda"))


@cuda
@pytest.mark.parametrize("how", ["set_", "storage resize"])
def test_parameter_moved_in_place_recaptures(how: str) -> None:
    # The Python object stays the same (no registration hook, no Module._apply): only the
    # address comparison before the replay can see these, and it must see them in its fast path.
    model = mlp()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(2, 8, device="cuda"))
        assert g.stats.guard_check == "compiled"
        weight = model[0].weight
        keep = weight.detach().clone()
        if how == "set_":
            weight.set_(torch.randn(8, 8, device="cuda"))
        else:
            weight.untyped_storage().resize_(0)  # frees the block, as FSDP does between uses
            blocker = torch.empty_like(keep)  # takes the freed block: the graph's old address
            blocker.fill_(float("nan"))
            weight.untyped_storage().resize_(keep.nbytes)
            weight.copy_(keep * 3)
        x = torch.randn(2, 8, device="cuda")
        torch.testing.assert_close(g(x), model(x))
    assert g.stats.recaptures == 1


@cuda
def test_model_to_recaptures() -> None:
    model = mlp()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(2, 8, device="cuda"))
        # Keep the old GPU memory alive (as any other reference would), so the round trip
        # lands the parameters at new addresses while the graph's old ones still hold data.
        old = [p.detach() for p in model.parameters()]
        model.cpu()
        model.cuda()
        model[0].weight.add_(1.0)
        x = torch.randn(2, 8, device="cuda")
        torch.testing.assert_close(g(x), model(x))
    assert g.stats.recaptures == 1
    del old


@cuda
def test_reassigned_buffer_recaptures() -> None:
    bn = nn.BatchNorm1d(8).cuda().eval()
    with torch.no_grad():
        g = cg.graph(bn, torch.randn(4, 8, device="cuda"))
        bn.running_mean = torch.randn(8, device="cuda")
        x = torch.randn(4, 8, device="cuda")
        torch.testing.assert_close(g(x), bn(x))
    assert g.stats.recaptures == 1


@cuda
def test_buffers_replaced_by_module_to_recapture() -> None:
    # Module._apply puts new buffer objects straight into _buffers; the old ones stay alive
    # here, so a graph that kept reading them would silently use stale statistics.
    bn = nn.BatchNorm1d(8).cuda().eval()
    with torch.no_grad():
        g = cg.graph(bn, torch.randn(4, 8, device="cuda"))
        old = bn.running_mean
        bn.cpu()
        bn.cuda()
        bn.running_mean.add_(5.0)
        x = torch.randn(4, 8, device="cuda")
        torch.testing.assert_close(g(x), bn(x))
    assert g.stats.recaptures == 1
    del old


@cuda
def test_load_state_dict_keeps_the_graph_and_its_results_correct() -> None:
    model = mlp()
    other = mlp()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(2, 8, device="cuda"))
        model.load_state_dict(other.state_dict())
        x = torch.randn(2, 8, device="cuda")
        torch.testing.assert_close(g(x), other(x))
    assert g.stats.recaptures == 0


SHIFT = torch.zeros(4)


def shifted(x: torch.Tensor) -> torch.Tensor:
    return x + SHIFT


@cuda
def test_rebound_closure_tensor_recaptures() -> None:
    global SHIFT
    SHIFT = torch.zeros(4, device="cuda")
    g = cg.graph(shifted, torch.randn(4, device="cuda"))
    SHIFT = torch.ones(4, device="cuda")
    x = torch.randn(4, device="cuda")
    torch.testing.assert_close(g(x), x + 1)
    assert g.stats.recaptures == 1


@cuda
def test_train_eval_switch_recaptures() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).cuda().eval()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(64, 8, device="cuda"))
        model.train()
        out = g(torch.randn(64, 8, device="cuda"))
    assert (out == 0).float().mean().item() > 0.3  # dropout is active now
    assert g.stats.recaptures == 1


# ---------------------------------------------------------------- randomness and training


@cuda
def test_dropout_and_multinomial_draw_new_numbers_on_every_replay() -> None:
    def fn(x: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return nn.functional.dropout(x, 0.5), torch.multinomial(probs, 16, replacement=True)

    g = cg.graph(
        fn, torch.ones(1024, device="cuda"), torch.ones(8, 100, device="cuda"), outputs="clone"
    )
    ones, probs = torch.ones(1024, device="cuda"), torch.ones(8, 100, device="cuda")
    (m1, s1), (m2, s2) = g(ones, probs), g(ones, probs)
    assert not torch.equal(m1, m2) and not torch.equal(s1, s2)


@cuda
def test_grad_scaler_step_is_refused_at_capture_with_the_reason() -> None:
    model = nn.Linear(8, 8).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=False)
        return loss.detach()

    with pytest.raises(cg.CaptureError) as info:
        cg.graph(step, torch.randn(4, 8, device="cuda"))
    assert any(f.kind == "grad-scaler" for f in info.value.findings), str(info.value)


def test_grad_scaler_step_is_reported_by_the_doctor_on_cpu() -> None:
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def step(x: torch.Tensor) -> torch.Tensor:
        scaler.scale(model(x).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        return x

    report = cg.doctor(step, torch.randn(4, 8))
    assert any(f.kind == "grad-scaler" for f in report.findings)


@cuda
def test_verify_catches_code_that_behaves_differently_while_captured() -> None:
    # Some code paths check whether a capture is running and skip work then (libraries do
    # this for validation or caching); the graph then silently omits that work.
    def fn(x: torch.Tensor) -> torch.Tensor:
        if not torch.cuda.is_current_stream_capturing():
            x = x * 2
        return x + 1

    with pytest.raises(
        cg.VerificationError, match=r"out differs from eager on fresh random inputs"
    ):
        cg.graph(fn, torch.randn(4, device="cuda"), verify=True)


@cuda
def test_verify_passes_a_clean_model_and_compares_random_outputs_by_shape() -> None:
    model = mlp()
    with torch.no_grad():
        cg.graph(model, torch.randn(2, 8, device="cuda"), verify=True)
    drop = nn.Dropout(0.5).cuda().train()
    cg.graph(drop, torch.randn(64, device="cuda"), verify=True)  # random: shapes only
