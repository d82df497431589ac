"""Names a package loads on first use: the front doors of packages whose modules import
optional or heavy libraries (rich, transformers, Triton) keep ``import cudagraphs`` light."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["first_use"]


def first_use(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``where`` maps each name to the module (of the
    package, relative) that defines it; the name is imported on first use and kept.

    Right, in a package's ``__init__``::

        __getattr__ = first_use(__name__, {"bench": "benchmarking"})

    Wrong: naming a module after a name it exports (``{"bench": "bench"}``): importing the
    module makes the package's attribute the module, not the function."""
    namespace = importlib.import_module(package).__dict__

    def load(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{where[name]}", package), name)
        namespace[name] = value
        return value

    return load
