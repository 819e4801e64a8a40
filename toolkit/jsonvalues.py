"""Checks of values that come from outside (JSON files: manifests, adapter.json, trace manifests, device
profiles, run state, e.g.; safetensors headers; options built in code): JSON's `true` arrives as a Python
bool, which is an int to isinstance, and a number may be NaN, infinite, or an int too large for a float."""
from __future__ import annotations

import math
from typing import Any


def is_int(v: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A finite int or float that is not a bool (an int of any size: math.isfinite would overflow)."""
    return is_int(v) or (isinstance(v, float) and math.isfinite(v))
