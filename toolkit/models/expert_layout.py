"""The byte layout of one expert blob: the single definition the expert store writes and reads and
`info` reports (docs/expert-store.md).

A blob holds an expert's matrices in the family's canonical order (gate, up, down, then biases),
each section starting at a multiple of 64 bytes. Per matrix [out, in]: fp16 weights; or int8 weights
plus one fp16 scale per output row; or int4 weights packed two per byte plus one fp16 scale per
group of 32 inputs (rows zero-padded to whole groups). Biases are fp16. On flash each blob occupies
a whole number of 4 KiB pages so it can be read with O_DIRECT in one request.

It lives with the models (not the runtime) because it depends only on a model's geometry, and the
runtime imports the models, never the other way round.
"""
from __future__ import annotations

import dataclasses
import math

from toolkit.errors import SpecPrefetchError
from toolkit.models.families import ModelGeometry, family_by_name

ALIGN = 4096        # every blob starts on, and is read in, whole 4 KiB pages
SECTION_ALIGN = 64  # every section inside a blob starts on a 64-byte boundary
GROUP = 32          # int4: inputs per fp16 scale
DTYPES = ("fp16", "int8", "int4")


def align(n: int, a: int = ALIGN) -> int:
    """n rounded up to a multiple of a."""
    return -(-n // a) * a


@dataclasses.dataclass(frozen=True)
class Section:
    """One array inside an expert blob: role, kind (weight / scale / bias), dtype, shape, offset."""
    role: str
    kind: str
    dtype: str       # "f16", "i8", "u8" (packed int4)
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def blob_sections(matrices: list[tuple[str, tuple[int, ...]]], dtype: str) -> tuple[list[Section], int]:
    """The byte layout of one expert blob: sections in order, each 64-byte aligned, and the blob's
    size in bytes (the last section padded too)."""
    out, off = [], 0

    def add(role, kind, dt, shape, itemsize):
        nonlocal off
        n = math.prod(shape) * itemsize
        out.append(Section(role, kind, dt, tuple(shape), off, n))
        off = align(off + n, SECTION_ALIGN)

    for role, shape in matrices:
        if len(shape) == 1:
            add(role, "bias", "f16", shape, 2)
            continue
        o, i = shape
        if dtype == "fp16":
            add(role, "weight", "f16", (o, i), 2)
        elif dtype == "int8":
            add(role, "weight", "i8", (o, i), 1)
            add(role, "scale", "f16", (o,), 2)
        elif dtype == "int4":  # rows padded with zeros to whole groups of 32
            ip = align(i, GROUP)
            add(role, "weight", "u8", (o, ip // 2), 1)
            add(role, "scale", "f16", (o, ip // GROUP), 2)
        else:
            raise SpecPrefetchError(f"unknown store dtype {dtype!r}; choose fp16, int8 or int4")
    return out, off


def expert_matrices(geo: ModelGeometry) -> list[tuple[str, tuple[int, ...]]]:
    """(role, [out, in] or [out]) of one routed expert, in blob order (the family's canonical order)."""
    return [(m.role, m.shape) for m in family_by_name(geo.family).expert_matrices(geo)]


def expert_layout(geo: ModelGeometry, dtype: str) -> tuple[list[Section], int]:
    """The blob layout of one routed expert of this model in `dtype`: (sections, blob bytes)."""
    return blob_sections(expert_matrices(geo), dtype)


def blob_bytes(geo: ModelGeometry, dtype: str) -> int:
    """Bytes of one expert blob (what the store's index records as its size)."""
    return expert_layout(geo, dtype)[1]


def slot_bytes(geo: ModelGeometry, dtype: str) -> int:
    """Bytes one expert occupies on flash and in the pool: the blob rounded up to 4 KiB."""
    return align(blob_bytes(geo, dtype), ALIGN)
