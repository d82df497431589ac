"""``cg.while_loop`` and ``cg.cond``: a loop or a branch decided on the device, inside a graph.

Inside a function captured by :func:`cudagraphs.graph`, each becomes one CUDA conditional node
(see ``conditional``): the loop's body and the branches are recorded once, into the node, and a
replay runs them as often as the device-side condition says, with no host round-trip. Outside
a capture (eager calls, the library's warm-up, a machine without CUDA) they are a plain Python
loop and branch with the same results, so the code stays testable anywhere.

Right::

    def decode(tokens, done):
        def more(tokens, done):                 # a 0-dim bool tensor on the device
            return ~done.all()
        def step(tokens, done):                 # same structure, shapes and dtypes back
            nxt = model(tokens)
            return nxt, done | (nxt == eos)
        return cg.while_loop(more, step, (tokens, done), max_iterations=128)

    g = cg.graph(decode, tokens, done)          # one launch decodes until every row is done

Wrong: ``while bool(done.all()): ...`` inside a captured function: the host reads a device
value, which a graph cannot do (and the capture fails with a host-sync error).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from ..core import NAMESPACE, RandomDraws
from ..errors import ConfigError, InputMismatchError, RandomInLoopError, explain
from ..options import check_positive_int
from . import conditional

__all__ = ["cond", "while_loop"]


def while_loop(
    cond_fn: Callable[..., torch.Tensor],
    body_fn: Callable[..., Any],
    state: Sequence[Any],
    *,
    max_iterations: int,
) -> tuple[Any, ...]:
    """Run ``state = body_fn(*state)`` while ``cond_fn(*state)`` is true, at most
    ``max_iterations`` times; return the final state (a tuple).

    ``cond_fn`` returns a 0-dim ``torch.bool`` tensor; ``body_fn`` returns a state of the same
    structure, with tensors of the same shapes, dtypes and devices. Inside a ``cg.graph``
    capture the loop is one WHILE node: its body is recorded once and its memory reused on
    every iteration. The state tensors returned are the loop's own buffers (the inputs are not
    written).

    The body is recorded once, so random numbers drawn inside it would repeat on every
    iteration of one replay: a body (or a ``cg.cond`` branch inside it) that draws is refused
    at capture with :class:`~cudagraphs.errors.RandomInLoopError`. Right::

        noise = torch.randn(steps, *x.shape, device="cuda")       # drawn before the loop
        def body(x, i):                                            # i: a 0-dim device tensor
            return x + noise.index_select(0, i.view(1))[0], i + 1  # (noise[i] reads i on the host)

    Wrong::

        def body(x, i):
            return x + torch.randn_like(x), i + 1                  # RandomInLoopError
    """
    check_positive_int("max_iterations", max_iterations, "a loop on the device needs a bound")
    state = tuple(state)
    if not _capturing(state):
        for _ in range(max_iterations):
            if not bool(_flag(cond_fn(*state), "cond_fn", state)):
                break
            state = _same_state(body_fn(*state), state, "body_fn")
        return state
    device = _device(state, "state")
    buffers = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in state)
    count = torch.zeros((), dtype=torch.int32, device=device)
    node = conditional.Condition(device, "while")
    node.set_loop(_flag(cond_fn(*buffers), "cond_fn", buffers), count, max_iterations, node.outer)
    with node.body() as stream:
        with RandomDraws() as draws:
            new = _same_state(body_fn(*buffers), buffers, "body_fn")
        _refuse_draws(draws, "body_fn", max_iterations)
        for mine, theirs in zip(buffers, new):
            if isinstance(mine, torch.Tensor) and mine is not theirs:
                mine.copy_(theirs)
        node.set_loop(_flag(cond_fn(*buffers), "cond_fn", buffers), count, max_iterations, stream)
    return buffers


def cond(
    pred: torch.Tensor,
    true_fn: Callable[..., Any],
    false_fn: Callable[..., Any],
    operands: Sequence[Any] = (),
) -> Any:
    """``true_fn(*operands)`` if ``pred`` else ``false_fn(*operands)``, decided on the device.

    ``pred`` is a 0-dim ``torch.bool`` tensor. Inside a ``cg.graph`` capture both branches are
    recorded (two IF nodes) and a replay runs the one ``pred`` selects; they must return the
    same structure with tensors of the same shapes and dtypes. Outside a capture it is an
    ordinary ``if`` (which reads ``pred`` on the host).
    """
    operands = tuple(operands)
    _flag(pred, "pred", operands)
    if not _capturing((pred, *operands)):
        return true_fn(*operands) if bool(pred) else false_fn(*operands)
    device = pred.device
    taken = conditional.Condition(device, "if")
    taken.set_branch(pred, False, taken.outer)
    with taken.body():
        out = true_fn(*operands)
    leaves, spec = optree.tree_flatten(out, namespace=NAMESPACE)
    other = conditional.Condition(device, "if")
    other.set_branch(pred, True, other.outer)
    with other.body():
        theirs, their_spec = optree.tree_flatten(false_fn(*operands), namespace=NAMESPACE)
        if their_spec != spec:
            raise ConfigError(
                explain(
                    f"cg.cond: false_fn returns {their_spec}, true_fn {spec}",
                    "on the device both branches write the same output buffers",
                    "return the same structure from both branches",
                )
            )
        for i, (mine, value) in enumerate(zip(leaves, theirs)):
            if isinstance(mine, torch.Tensor):
                _same_tensor(value, mine, f"output {i} of false_fn", "true_fn's")
                mine.copy_(value)
    return out


def _refuse_draws(draws: RandomDraws, what: str, iterations: int) -> None:
    if not draws.found:
        return
    op, where = draws.found[0]
    raise RandomInLoopError(
        explain(
            f"cg.while_loop: {what} draws random numbers ({op} at {where})",
            "the body is recorded once and every iteration of a replay runs that recording, "
            "so each iteration would add the same noise (each replay draws new numbers, but "
            "not each iteration)",
            f"draw the noise for all {iterations} iterations before the loop (for example "
            f"noise = torch.randn({iterations}, *x.shape, device=x.device)) and pass it in "
            "the loop state with an iteration counter i (a device tensor) to pick its slice: "
            "noise.index_select(0, i.view(1))[0]",
        )
    )


def _capturing(values: Sequence[Any]) -> bool:
    """Inside a capture (on the device the tensors are on), or a plain Python call? The eager
    path also readies the device path, so a later capture finds it prepared."""
    tensors = [
        x for x in optree.tree_leaves(values, namespace=NAMESPACE) if isinstance(x, torch.Tensor)
    ]
    cuda = [x for x in tensors if x.is_cuda]
    if not cuda:
        return False
    if torch.cuda.is_current_stream_capturing():
        return True
    if conditional.available() is None:
        conditional.prepare(cuda[0].device)
    return False


def _device(state: Sequence[Any], name: str) -> torch.device:
    devices = {x.device for x in state if isinstance(x, torch.Tensor)}
    if len(devices) != 1:
        raise InputMismatchError(
            explain(
                f"cg.while_loop: the {name} tensors are on {sorted(map(str, devices)) or 'no device'}",
                "a loop on the device keeps its whole state on one GPU",
                "move every state tensor to the graph's device",
            )
        )
    return devices.pop()


def _flag(value: Any, name: str, state: Sequence[Any]) -> torch.Tensor:
    """``value`` if it is a 0-dim bool tensor on the state's device; else the reason."""
    devices = {x.device for x in state if isinstance(x, torch.Tensor)}
    ok = (
        isinstance(value, torch.Tensor)
        and value.dim() == 0
        and value.dtype == torch.bool
        and (not devices or value.device in devices)
    )
    if not ok:
        got = (
            f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        raise InputMismatchError(
            explain(
                f"cg.while_loop / cg.cond: {name} gave {got}",
                "the condition is read on the device by a one-byte test: a 0-dim torch.bool "
                "tensor on the same device as the state",
                "return e.g. (x > 0).all() or done.any().logical_not(), not a Python bool",
            )
        )
    return value


def _same_state(new: Any, old: tuple[Any, ...], name: str) -> tuple[Any, ...]:
    new = tuple(new) if isinstance(new, (tuple, list)) else (new,)
    if len(new) != len(old):
        raise InputMismatchError(
            explain(
                f"cg.while_loop: {name} returned {len(new)} values for a state of {len(old)}",
                "each iteration feeds the body's result back in as the next state",
                "return the whole state, in the same order",
            )
        )
    for i, (value, before) in enumerate(zip(new, old)):
        if isinstance(before, torch.Tensor):
            _same_tensor(value, before, f"state[{i}] from {name}", "the state's")
    return new


def _same_tensor(value: Any, like: torch.Tensor, what: str, whose: str) -> None:
    if not (
        isinstance(value, torch.Tensor)
        and value.shape == like.shape
        and value.dtype == like.dtype
        and value.device == like.device
    ):
        got = (
            f"{value.dtype} {tuple(value.shape)} on {value.device}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        raise InputMismatchError(
            explain(
                f"cg.while_loop / cg.cond: {what} is {got}, {whose} is {like.dtype} "
                f"{tuple(like.shape)} on {like.device}",
                "on the device the result is written into fixed buffers of that layout",
                "keep shapes, dtypes and devices the same from one iteration (or branch) to "
                "the next",
            )
        )
