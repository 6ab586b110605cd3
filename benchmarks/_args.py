"""Argument types for the benchmark scripts: a bad number is a usage error, not a traceback
minutes into a run (or a JSON line of nonsense)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def at_least(least: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``least``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(
                f"expected an integer of at least {least}, got {value}"
            )
        return value

    return parse


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected finite seconds above 0, got {text!r}")
    return value
