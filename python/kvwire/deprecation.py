"""Former names that still work, with a warning: one module ``__getattr__`` for every
namespace that renamed or moved something (the API rule in docs/api.md: a renamed name
keeps working for one release and raises a ``DeprecationWarning`` naming its successor).

Why one place: four modules had grown their own copy of the same hook, each with its
own wording; users filtering warnings by message need one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

# name -> (the object the former name now gives, what to use instead), or None: not a former name
Lookup = Callable[[str], "tuple[Any, str] | None"]


def former_names(module: str, lookup: Lookup) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``module`` that serves the former names ``lookup``
    knows, each with a ``DeprecationWarning``, and raises ``AttributeError`` for the rest."""

    def __getattr__(name: str) -> Any:
        moved = lookup(name)
        if moved is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} is deprecated and will be removed in the next release: use {moved[1]}",
                      DeprecationWarning, stacklevel=2)
        return moved[0]

    return __getattr__
