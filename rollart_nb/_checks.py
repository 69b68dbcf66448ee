"""Predicates the argument checks share (numpy numbers count; bools never do)."""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["is_number", "is_whole"]


def is_whole(value: Any) -> bool:
    """An integer (int or numpy integer), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite real number (int, float or numpy), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
