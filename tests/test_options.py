"""Options are declared once: the dataclass's Literal types give the choices, the keyword
TypedDict matches the dataclass, and a value outside the choices is refused with them listed."""

from __future__ import annotations

import dataclasses
import typing

import pytest

import cudagraphs as cg
from cudagraphs.options import OptionKwargs, Options


def test_the_keyword_typing_has_the_dataclass_names_and_literal_types() -> None:
    fields = typing.get_type_hints(Options)
    keywords = typing.get_type_hints(OptionKwargs)
    assert list(keywords) == [f.name for f in dataclasses.fields(Options)]
    literal = {n: h for n, h in fields.items() if typing.get_origin(h) is typing.Literal}
    assert literal and all(keywords[n] == h for n, h in literal.items())


@pytest.mark.parametrize("name", ["outputs", "fallback", "guard", "on_stale", "segments"])
def test_a_value_outside_a_literal_is_refused_listing_its_choices(name: str) -> None:
    choices = typing.get_args(typing.get_type_hints(Options)[name])
    with pytest.raises(cg.ConfigError) as error:
        Options(**{name: "nonsense"})
    assert all(repr(c) in str(error.value) for c in choices)
    for choice in choices:
        assert getattr(Options(**{name: choice}), name) == choice


def test_the_graph_docstring_refers_to_the_one_table_instead_of_copying_it() -> None:
    graph_doc = cg.graph.__doc__ or ""
    assert "Options" in graph_doc and "side_effects:" not in graph_doc
    assert all(f"{f.name}:" in (Options.__doc__ or "") for f in dataclasses.fields(Options))
