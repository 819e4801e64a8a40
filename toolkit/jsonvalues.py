"""Checks of values read from JSON files (manifests, adapter.json, trace manifests, run state): JSON's
`true` arrives as a Python bool, which is an int to isinstance, and a number may be NaN or infinite."""
from __future__ import annotations

import math
from typing import Any


def is_int(v: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
