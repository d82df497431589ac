"""The one-row Triton products (``decoding/matvec.py``) on the CPU: where they do not apply
the product is the model's own operations', a direct call says why and what to use, a fused
model asked for them answers as before, and the kernels themselves under Triton's interpreter
give what the model's operations give."""

from __future__ import annotations

import textwrap
import warnings
from typing import Any

import pytest
import torch
from torch.nn import functional as F
from triton_interpreter import LOOPS_OVER_ARGUMENTS, needs_triton, run_under_interpreter

from cudagraphs.decoding.fused_projections import fuse_projections, rows_linear
from cudagraphs.decoding.matvec import applies, linear, matvec


def test_it_does_not_apply_off_the_gpu_and_the_product_is_f_linear_s() -> None:
    torch.manual_seed(0)
    x, w, b = torch.randn(1, 64).bfloat16(), torch.randn(32, 64).bfloat16(), torch.randn(32)
    assert not applies(x, w)
    torch.testing.assert_close(linear(x, w, b.bfloat16()), F.linear(x, w, b.bfloat16()))
    weights = [torch.randn(8, 64), torch.randn(8, 64)]
    torch.testing.assert_close(
        rows_linear(x.float(), weights, [], True),
        torch.cat([F.linear(x.float(), t) for t in weights], -1),
    )


def test_a_direct_call_where_it_does_not_apply_says_what_to_use() -> None:
    with pytest.raises(ValueError, match=r"one row of half or bfloat16.*use F\.linear"):
        matvec(torch.randn(4, 64), torch.randn(32, 64))


def test_fuse_projections_refuses_a_matvec_that_is_not_a_bool() -> None:
    from cudagraphs import ConfigError

    with pytest.raises(ConfigError, match="matvec"):
        fuse_projections(torch.nn.Linear(4, 4), matvec="yes")  # type: ignore[arg-type]


def test_matvec_also_routes_the_output_and_down_projections_without_copying_them() -> None:
    """``fuse_projections(matvec=True)``: the output and down projections, one product each,
    go through the same operator (the one-row kernel on a GPU), their weights left where they
    are; the model answers as before, and unfusing gives the modules back."""
    import copy

    from cudagraphs.decoding.fused_projections import FusedLinear, unfuse_projections
    from cudagraphs.tools.workloads import random_llama

    model = random_llama("llama-tiny")
    plain = copy.deepcopy(model)
    layer = model.model.layers[0]
    where = layer.self_attn.o_proj.weight.data_ptr(), layer.mlp.down_proj.weight.data_ptr()
    report = fuse_projections(model, matvec=True)
    layers = len(model.model.layers)
    assert len(report.fused) == 2 * layers and not report.refused
    assert report.gated == [
        f"model.layers.{i}.mlp: SiLU(gate) * up into down_proj" for i in range(layers)
    ]
    assert "MLPs with SiLU(gate) * up in the down product" in str(report)
    assert sorted(report.one_row) == sorted(
        [f"model.layers.{i}.self_attn: o_proj" for i in range(layers)]
        + [f"model.layers.{i}.mlp: down_proj" for i in range(layers)]
    )
    assert "single projections on the one-row kernel" in str(report)
    assert type(layer.self_attn.o_proj) is FusedLinear and type(layer.mlp.down_proj) is FusedLinear
    assert (
        layer.self_attn.o_proj.weight.data_ptr(),
        layer.mlp.down_proj.weight.data_ptr(),
    ) == where
    ids = torch.randint(0, 512, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    again = fuse_projections(model, matvec=True)  # an earlier call's, reported as such
    assert len(again.one_row) == 2 * layers and len(again.fused) == 2 * layers
    assert len(again.gated) == layers
    assert not fuse_projections(model).one_row  # without matvec the singles are not looked at
    mlp_class = type(layer.mlp)
    assert unfuse_projections(model) == 7 * layers
    assert type(layer.mlp.down_proj) is torch.nn.Linear
    assert type(layer.mlp) is mlp_class.__mro__[1] and "_ungated_class" not in vars(layer.mlp)


def test_the_gated_down_product_is_the_mlp_s_own_where_the_kernel_does_not_apply() -> None:
    """``gated_linear`` off the GPU: the MLP's three operations, bias included; a gated MLP
    whose activation or projections were changed since runs its class's own forward."""
    from cudagraphs.decoding.fused_projections import gated_linear
    from cudagraphs.tools.workloads import random_llama

    torch.manual_seed(2)
    gate_up, w, b = torch.randn(1, 1, 96), torch.randn(40, 48), torch.randn(40)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(gated_linear(gate_up, w, b), F.linear(F.silu(gate) * up, w, b))
    model = random_llama("llama-tiny")
    fuse_projections(model, matvec=True)
    mlp, x = model.model.layers[0].mlp, torch.randn(1, 1, 64)
    with torch.no_grad():
        before = mlp(x)
        mlp.act_fn = torch.nn.GELU()  # no longer SiLU: the model's own forward, with GELU
        changed = mlp(x)
    expected = F.linear(
        F.gelu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight),
        mlp.down_proj.weight,
    )
    torch.testing.assert_close(changed, expected)
    assert not torch.allclose(before, changed)


def test_a_decoder_routes_every_product_and_a_user_s_earlier_fusion_keeps_its_own() -> None:
    """``Decoder(fuse=True)`` routes the output and down projections too and puts SiLU(gate) *
    up inside the down product; a model the user fused with ``fuse_projections(model)`` first
    keeps its single projections and MLPs as they were (cuBLAS's products on a GPU)."""
    pytest.importorskip("transformers")
    from cudagraphs.decoding.decoder import Decoder
    from cudagraphs.decoding.fused_projections import FusedLinear
    from cudagraphs.tools.workloads import random_llama

    routed = random_llama("llama-tiny")
    with warnings.catch_warnings():  # without CUDA the Decoder says it runs eagerly
        warnings.simplefilter("ignore")
        Decoder(routed, max_batch=1, max_length=24)
    layer = routed.model.layers[0]
    assert type(layer.self_attn.o_proj) is FusedLinear
    assert type(layer.mlp.down_proj) is FusedLinear and "_ungated_class" in vars(layer.mlp)

    mine = random_llama("llama-tiny")
    mlp_class = type(mine.model.layers[0].mlp)
    fuse_projections(mine)
    report = fuse_projections(mine, matvec=True)  # as the Decoder calls it
    assert len(report.fused) == 2 * len(mine.model.layers)
    assert not report.one_row and not report.gated
    for layer in mine.model.layers:
        assert type(layer.self_attn.o_proj) is torch.nn.Linear
        assert type(layer.mlp.down_proj) is torch.nn.Linear and type(layer.mlp) is mlp_class
        assert not layer.self_attn.q_proj._fused_group.matvec


def test_a_routed_single_projection_keeps_nothing_a_compile_would_guard_on() -> None:
    """A single projection's product is its output: nothing of the call is kept on the module
    (a kept input would be a new tensor for the compiler to guard on at every step, and each
    call would trace again). One trace serves calls on fresh inputs."""
    from torch._dynamo.testing import CompileCounter

    from cudagraphs.tools.workloads import random_llama

    model = random_llama("llama-tiny")
    fuse_projections(model, matvec=True)
    plain = random_llama("llama-tiny")
    plain.load_state_dict(model.state_dict())
    counter = CompileCounter()
    torch._dynamo.reset()
    step = torch.compile(model, backend=counter, dynamic=False)
    with torch.no_grad():
        for seed in (1, 2, 3):
            ids = torch.randint(0, 512, (1, 5), generator=torch.Generator().manual_seed(seed))
            torch.testing.assert_close(step(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    assert counter.frame_count == 1, counter.frame_count


def test_a_batch_of_rows_runs_the_model_s_own_operations_in_the_compiler_s_view() -> None:
    """The output and down projections and the gated MLP go through the library's operators
    for one row only: a compiled step of a batch (dynamic) holds the model's own products and
    activation, which the compiler fuses and plans, and one trace serves every batch size; a
    batch of 1 is its own trace, with the operators."""
    from cudagraphs.tools.workloads import random_llama

    model = random_llama("llama-tiny")
    fuse_projections(model, matvec=True)
    plain = random_llama("llama-tiny")
    plain.load_state_dict(model.state_dict())
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        graphs.append(gm)
        return gm.forward

    def operators(gm: torch.fx.GraphModule) -> dict[str, int]:
        names = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        return {op: sum(op in name for name in names) for op in ("gated_linear", "rows_linear")}

    torch._dynamo.reset()
    step = torch.compile(model, backend=keep, dynamic=True)
    with torch.no_grad():
        for rows in (2, 3, 4, 1):
            ids = torch.randint(0, 512, (rows, 1), generator=torch.Generator().manual_seed(rows))
            torch.testing.assert_close(step(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    layers = len(model.model.layers)
    assert len(graphs) == 2, len(graphs)  # batches 2 to 4, then batch 1
    assert operators(graphs[0]) == {"gated_linear": 0, "rows_linear": 2 * layers}
    assert operators(graphs[1]) == {"gated_linear": layers, "rows_linear": 3 * layers}


@pytest.mark.slow
def test_a_compiled_decoder_of_a_model_on_the_one_row_kernel_gives_generate_s_tokens(
    fresh_compile_cache: object,
) -> None:
    """Every projection of the model routed through the operator (the fused groups and the
    single ones): the compiled one-shape step traces the single groups too and decodes as
    ``generate`` does (on the CPU the operator's product is ``F.linear``'s)."""
    import copy

    pytest.importorskip("transformers")
    from llama_decode import reference_tokens, tiny_llama

    from cudagraphs.decoding.decoder import Decoder

    model, _ = tiny_llama("cpu")
    reference = copy.deepcopy(model)
    assert fuse_projections(model, matvec=True).one_row
    torch._dynamo.reset()
    decoder = Decoder(model, max_batch=1, max_length=40, batch_sizes=[1], compile=True)
    torch.manual_seed(12)
    prompt = torch.randint(0, 512, (1, 6))
    got = decoder.generate(prompt, max_new_tokens=10, eos_token_id=None)
    assert torch.equal(got[:, prompt.shape[1] :], reference_tokens(reference, prompt, 10))


INTERPRETED = textwrap.dedent(
    """
    import torch
    from torch.nn import functional as F
    from cudagraphs.decoding import matvec as mv

    torch.manual_seed(0)
    dtype = torch.float16  # the interpreter multiplies bfloat16 blocks wrongly
    for n, k in ((40, 96), (64, 600)):  # a last block of rows and of inputs half full
        w = (torch.randn(n, k) / k**0.5).to(dtype)
        x = torch.randn(1, 1, k).to(dtype)
        assert mv.applies(x, w)
        error = (mv.matvec(x, w).float() - F.linear(x.float(), w.float())).abs().max().item()
        assert error <= 4e-3, ("matvec", n, k, error)
        gate_up = torch.randn(1, 1, 2 * k).to(dtype)
        assert mv.applies_gated(gate_up, w) and not mv.applies(gate_up, w)
        gate, up = gate_up.chunk(2, dim=-1)
        expected = F.linear(F.silu(gate) * up, w)  # the model's roundings, in float16
        error = (mv.gated_matvec(gate_up, w).float() - expected.float()).abs().max().item()
        assert error <= 4e-3 * expected.abs().max().item(), ("gated", n, k, error)
    print("ok")
    """
)


@needs_triton
def test_the_one_row_kernels_equal_the_model_s_operations_under_the_interpreter() -> None:
    run_under_interpreter(LOOPS_OVER_ARGUMENTS + "\nsys.path.insert(0, 'src')\n" + INTERPRETED)


def test_programmatic_dependent_launch_is_on_for_hopper_gpus_unless_turned_off(
    monkeypatch: pytest.MonkeyPatch, pdl_decided_afresh: Any
) -> None:
    """On by default where the GPU has it (compute capability 9 and later), off with
    ``CUDAGRAPHS_PDL=0``, never on the CPU nor on an older GPU."""
    from cudagraphs.decoding import matvec as mv

    capability = {"value": (9, 0)}
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda device=None: capability["value"]
    )
    monkeypatch.delenv(mv.PDL_VARIABLE, raising=False)
    gpu = torch.device("cuda", 0)
    fresh = pdl_decided_afresh

    fresh()
    assert mv.pdl(gpu) and not mv.pdl(torch.device("cpu"))
    capability["value"] = (8, 0)
    fresh()
    assert not mv.pdl(gpu)
    capability["value"] = (10, 0)
    fresh()
    assert mv.pdl(gpu)
    monkeypatch.setenv(mv.PDL_VARIABLE, "0")
    fresh()
    assert not mv.pdl_requested() and not mv.pdl(gpu)
    monkeypatch.setenv(mv.PDL_VARIABLE, "1")
    fresh()
    assert mv.pdl(gpu)
