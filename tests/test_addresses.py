"""The address check the guard runs before every replay: compiled loop and its fallbacks agree,
and every way of moving a tensor to new memory is seen. Addresses are device-independent, so
CPU tensors exercise the same code."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cudagraphs.core import guards
from cudagraphs.core.guards import AddressCheck
from cudagraphs.core.signature import CLASS_OF


def _tensors(n: int = 6) -> list[torch.Tensor]:
    return [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(n)]


@pytest.fixture(params=["native", "fallback"])
def make(request):
    native = request.param == "native"
    if native and guards.compiled_module() is None:
        pytest.skip(f"no compiled check here: {guards._failure}")
    return lambda tensors: AddressCheck(tensors, native=native)


def test_compiled_loop_is_built_at_install_where_a_compiler_exists():
    # CI installs with g++ and Python.h present; a silent fallback would hide a slow guard.
    assert guards.compiled_module() is not None, guards._failure
    assert AddressCheck(_tensors()).backend == "compiled"


def test_nothing_to_check_always_passes():
    check = AddressCheck([])
    assert check() and check.moved() == [] and check.backend == ""


def test_unchanged_tensors_pass(make):
    check = make(_tensors())
    assert check() and check.moved() == []


def _no_grad_set(t: torch.Tensor, source: torch.Tensor) -> None:
    with torch.no_grad():
        t.set_(source)


@pytest.mark.parametrize(
    "move",
    [
        lambda t: setattr(t, "data", torch.randn(4, 4)),
        lambda t: _no_grad_set(t, torch.randn(4, 4)),
        lambda t: torch.utils.swap_tensors(t, torch.nn.Parameter(torch.randn(4, 4))),
        lambda t: t.data.resize_(64, 64),
        lambda t: t.untyped_storage().resize_(0),
    ],
    ids=["data=", "set_", "swap_tensors", "resize_", "storage freed"],
)
def test_every_kind_of_move_is_seen(make, move):
    tensors = _tensors()
    check = make(tensors)
    move(tensors[3])
    assert not check()
    assert check.moved() == [3]


def test_in_place_updates_keep_the_check_passing(make):
    tensors = _tensors()
    check = make(tensors)
    with torch.no_grad():
        tensors[0].copy_(torch.randn(4, 4))
        tensors[1].mul_(2)
    assert check()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 30), data=st.data())
def test_moved_is_exactly_the_moved_set(n, data):
    tensors = _tensors(n)
    checks = [AddressCheck(tensors), AddressCheck(tensors, native=False)]
    chosen = data.draw(st.sets(st.integers(0, n - 1)))
    for i in chosen:
        tensors[i].data = torch.randn(4, 4)
    for check in checks:
        assert check() is (not chosen)
        assert check.moved() == sorted(chosen)


def test_compiled_loop_rejects_bad_arguments():
    module = guards.compiled_module()
    if module is None:
        pytest.skip(f"no compiled check here: {guards._failure}")
    assert module.same(("not a tensor",), bytes(8)) is False
    # A tensor without storage makes PyTorch's reader throw; the loop must answer, not crash.
    assert module.same((torch.randn(4, 4).to_sparse(),), bytes(8)) is False
    with pytest.raises(ValueError, match="one 8-byte address per tensor"):
        module.same((torch.randn(2),), b"")
    with pytest.raises(TypeError, match="same"):
        module.same([torch.randn(2)], bytes(8))


def _backend_in_fresh_process(**env: str) -> str:
    code = (
        "import torch; from cudagraphs.core.guards import AddressCheck; "
        "print(AddressCheck([torch.zeros(1)]).backend)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip()


@pytest.mark.slow
@pytest.mark.parametrize(
    "code",
    [
        "import os; os.environ['CUDAGRAPHS_NO_COMPILE'] = '1'",
        "import sys; sys.modules['cudagraphs.core._before_replay'] = None",  # not built at install
    ],
    ids=["opted out", "not built"],
)
def test_falls_back_without_the_compiled_loop(code):
    program = (
        f"{code}; import torch; from cudagraphs.core.guards import AddressCheck; "
        "print(AddressCheck([torch.zeros(1)]).backend)"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True
    )
    has_helper = hasattr(torch._C, "_tensors_data_ptrs_at_indices_equal")  # CUDA builds only
    assert result.stdout.strip() == ("torch helper" if has_helper else "python loop")


@pytest.mark.slow
def test_a_library_planted_in_a_shared_folder_is_never_loaded(tmp_path):
    # Where an earlier version cached its runtime-built module: a predictable name in the
    # world-writable temporary folder (and the cache variable it honoured). Plant both.
    shared = tmp_path / "tmp" / f"cudagraphs-{os.getuid()}"
    shared.mkdir(parents=True)
    planted = [shared / f"_cudagraphs_addresses_{'0' * 12}.so", tmp_path / "cache" / "x.so"]
    planted[1].parent.mkdir()
    for path in planted:
        path.write_bytes(b"not a library: loading this would run another user's code")
    home = tmp_path / "home"
    home.mkdir(mode=0o500)  # read-only home: the old code fell back to the shared folder
    program = (
        "import sys, torch\n"
        "seen = []\n"
        "sys.addaudithook(lambda event, args: seen.append(repr(args)))\n"
        "from cudagraphs.core.guards import AddressCheck, compiled_module\n"
        "check = AddressCheck([torch.zeros(1)])\n"
        "module = compiled_module()\n"
        "print(check.backend, getattr(module, '__file__', None))\n"
        f"print(any({str(tmp_path)!r} in s for s in seen))\n"
    )
    env = {
        **os.environ,
        "HOME": str(home),
        "TMPDIR": str(tmp_path / "tmp"),
        "CUDAGRAPHS_CACHE_DIR": str(planted[1].parent),
    }
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=env, check=True
    )
    backend_line, touched = result.stdout.strip().splitlines()
    backend, _, where = backend_line.partition(" ")
    assert touched == "False", "a planted path was opened or imported"
    if backend == "compiled":  # from the installed package, nowhere else
        assert where.startswith(os.path.dirname(guards.__file__)), where


@pytest.mark.parametrize("native", [True, False])
def test_one_check_covers_modes_entries_and_addresses(native: bool) -> None:
    # The guard's whole check in one call (compiled where built, else Python): the same answers.
    if native and guards.compiled_module() is None:
        pytest.skip(f"no compiled check here: {guards._failure}")
    tensors = [torch.randn(3), torch.randn(2)]
    module = torch.nn.Linear(2, 2).eval()
    slots = {"weight": tensors[0]}
    check = guards.AddressCheck(tensors, native=native).with_modes(
        [module], [module.training], [(slots, (tensors[0],))]
    )
    assert check() is True
    module.train()
    assert check() is False
    module.eval()
    assert check() is True
    slots["weight"] = torch.randn(3)  # another object in the entry (module.to(), buf = t)
    assert check() is False
    slots["weight"] = tensors[0]
    assert check() is True
    del slots["weight"]  # an entry removed: look closer
    assert check() is False
    slots["weight"] = tensors[0]
    tensors[1].data = torch.randn(2)  # new memory
    assert check() is False


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "python"])
def test_one_check_also_holds_the_plain_values_a_recording_read(native: bool) -> None:
    if native and guards.compiled_module() is None:
        pytest.skip(f"no compiled check here: {guards._failure}")
    tensors = [torch.randn(3)]
    namespace = {"scale": 0.5, "flag": True}
    check = guards.AddressCheck(tensors, native=native).with_modes(
        [], [], [], [(namespace, "scale", 0.5), (namespace, "flag", True)]
    )
    assert check() is True
    namespace["scale"] = 2.0
    assert check() is False
    namespace["scale"] = 0.5  # an equal object of the same type: the same value
    assert check() is True
    namespace["flag"] = 1  # equal, but another type: not the value the recording read
    assert check() is False
    del namespace["flag"]
    assert check() is False
    namespace["flag"] = True
    tensors[0].data = torch.randn(3)  # the values hold, an address moved
    assert check() is False


def test_compiled_unchanged_rejects_bad_arguments() -> None:
    module = guards.compiled_module()
    if module is None:
        pytest.skip(f"no compiled check here: {guards._failure}")
    with pytest.raises(TypeError, match="unchanged"):
        module.unchanged((), b"", (), (), b"")
    with pytest.raises(ValueError, match="one recorded mode per owner"):
        module.unchanged((), b"", (object(),), (), ())
    with pytest.raises(TypeError, match="pairs or dicts expected"):
        module.unchanged((), b"", (), (), (({}, 2),))
    with pytest.raises(TypeError, match="values"):
        module.unchanged((), b"", (), (), (), [({}, "k", 1)])
    # An owner without a `training` attribute: not an error, just "look closer".
    assert module.unchanged((), b"", (object(),), (True,), ()) is False


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "python"])
def test_one_check_holds_class_values_absent_names_and_list_items(native: bool) -> None:
    """The entry shapes of a value watch beyond ``(dict, key, value)``: a class's attribute
    lookup through its bases, a name absent from an instance's dict, a list's items. The C
    check and its Python form give the same answers."""
    if native and guards.compiled_module() is None:
        pytest.skip(f"no compiled check here: {guards._failure}")

    class Base:
        scale = 1.0

    class Child(Base):
        pass

    instance = Child()
    mix = [1.0, 2.0]
    holder = {"mix": mix}
    check = guards.AddressCheck([torch.randn(2)], native=native).with_modes(
        [], [], [],
        [(Child, "scale", 1.0), (instance.__dict__, "scale"), (holder, "mix", mix, (1.0, 2.0))],
    )  # fmt: skip
    assert check() is True
    Base.scale = 2.0  # the base's value: what the lookup through Child finds
    assert check() is False
    Base.scale = 1.0
    assert check() is True
    Child.scale = 1.0  # an equal value of the same type on the child: the same value
    assert check() is True
    Child.scale = 3.0
    assert check() is False
    del Child.scale
    assert check() is True
    instance.scale = 1.0  # shadows the class's value on the instance
    assert check() is False
    del instance.scale
    assert check() is True
    mix[0] = 5.0  # in place: the same list, other items
    assert check() is False
    mix[0] = 1.0
    assert check() is True
    mix.append(3.0)
    assert check() is False
    mix.pop()
    holder["mix"] = [1.0, 2.0]  # an equal but new list: not the list the recording read
    assert check() is False


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "python"])
def test_one_check_holds_an_object_s_class(native: bool) -> None:
    """``(obj, CLASS_OF, cls)``: the object's class is still that very class. Swapping it
    (``obj.__class__ = Other``) gives the object other methods while every class value the
    other entries hold stays as it was."""
    if native and guards.compiled_module() is None:
        pytest.skip(f"no compiled check here: {guards._failure}")

    class Model:
        def squash(self) -> int:
            return 1

    class Equal(Model):
        def __eq__(self, other: object) -> bool:  # equal to anything: identity still decides
            return True

        __hash__ = object.__hash__

    obj = Model()
    check = guards.AddressCheck([torch.randn(2)], native=native).with_modes(
        [], [], [], [(obj, CLASS_OF, Model), (Model, "squash", Model.__dict__["squash"])]
    )
    assert check() is True
    obj.__class__ = Equal  # Model's own lookup is unchanged: only the class entry sees it
    assert check() is False
    obj.__class__ = Model
    assert check() is True


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "python"])
def test_one_check_holds_empty_dicts_empty_and_full_ones_as_they_were(native: bool) -> None:
    """A dict recorded empty (most hook and slot dicts of a model) is checked for staying
    empty, one with entries for holding those very objects; both forms give the same answers."""
    if native and guards.compiled_module() is None:
        pytest.skip(f"no compiled check here: {guards._failure}")
    hooks: dict[int, object] = {}
    slots = {"weight": torch.randn(2)}
    check = guards.AddressCheck([torch.randn(2)], native=native).with_modes(
        [], [], [(hooks, ()), (slots, tuple(slots.values()))]
    )
    assert check() is True
    hooks[0] = print  # a hook registered after the capture
    assert check() is False
    del hooks[0]
    assert check() is True
    slots["bias"] = torch.randn(2)  # a slot added
    assert check() is False


def test_class_names_finds_a_name_in_decorated_nested_and_inherited_methods() -> None:
    """Which modules' train/eval mode the guard checks: those whose code loads ``training``,
    through a decorator's wrapper, in a nested function, or in a base class below nn.Module."""
    import functools

    from cudagraphs.core.frames import class_names

    def decorated(f):  # type: ignore[no-untyped-def]
        @functools.wraps(f)
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            return f(*args, **kwargs)

        return wrapper

    class Wrapped(torch.nn.Module):
        @decorated
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if self.training else -x

    class Nested(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            def inner() -> bool:
                return self.training

            return x * inner()

    class Child(Nested):
        pass

    assert "training" in class_names(Wrapped) and "training" in class_names(Child)
    assert {"training", "p"} <= class_names(torch.nn.Dropout)
    assert "training" not in class_names(torch.nn.Linear)  # nn.Module's own train() not counted


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "python"])
def test_one_check_holds_a_closure_cell_s_contents(native: bool) -> None:
    """``(cell, "cell_contents", value[, items])``: a closure variable still holds its value
    (a list: those items), in the C check and its Python form alike."""
    if native and guards.compiled_module() is None:
        pytest.skip(f"no compiled check here: {guards._failure}")
    gain, items = 2.0, [1.0, torch.ones(2)]

    def reads() -> tuple[float, list[Any]]:
        return gain, items

    gain_cell, items_cell = reads.__closure__ or ()
    check = guards.AddressCheck([torch.randn(2)], native=native).with_modes(
        [], [], [],
        [(gain_cell, "cell_contents", 2.0), (items_cell, "cell_contents", items, tuple(items))],
    )  # fmt: skip
    assert check() is True
    gain = 5.0
    assert check() is False
    gain = 2.0
    assert check() is True
    items[1] = torch.ones(2)  # an equal new tensor: not the one read
    assert check() is False
