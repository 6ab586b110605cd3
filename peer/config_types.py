"""The type check every config dataclass of the peer runs first (``__post_init__``): a
field annotated ``float``, ``int`` or ``bool`` holds one, so that a wrong value is named
when the config is made, not met as a bare ``TypeError`` from a comparison (``'>' not
supported between instances of 'str' and 'int'``: an outside tester) or later, deep in a
running peer."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

__all__ = ["check_field_types"]


def check_field_types(config: Any) -> None:
    """Raise ``ValueError`` naming the first field of ``config`` (a dataclass whose
    annotations are strings, ``from __future__ import annotations``) annotated ``float``,
    ``int`` or ``bool`` that holds another type (a bool is no number here)."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.type == "bool":
            ok, what = isinstance(value, bool), "True or False"
        elif field.type == "int":
            ok, what = (
                isinstance(value, numbers.Integral) and not isinstance(value, bool),
                "an integer",
            )
        elif field.type == "float":
            ok, what = isinstance(value, numbers.Real) and not isinstance(value, bool), "a number"
        else:
            continue
        if not ok:
            raise ValueError(f"{type(config).__name__}.{field.name} must be {what}, got {value!r}")
