"""One definition of the expert blob layout: `info` and the expert store agree byte for byte."""
from __future__ import annotations

import pytest

from toolkit.models.expert_layout import ALIGN, expert_layout
from toolkit.models.info import model_info
from toolkit.models.loader import inspect_model_dir
from toolkit.models.tiny import TINY_FAMILIES
from toolkit.runtime.expert_store import ExpertStore, build_store

DTYPES = ("fp16", "int8", "int4")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_info_bytes_are_the_store_blob(family, tiny_models, tmp_path):
    spec = inspect_model_dir(tiny_models[family])
    d = model_info(spec)
    n_experts = len(spec.geometry.moe_layers) * spec.geometry.routing.num_experts
    for dtype in DTYPES:
        store = ExpertStore(build_store(spec, tmp_path / f"{dtype}.spx", dtype, progress=False), spec)
        assert d["bytes_per_expert"][dtype] == store.blob_size, dtype
        assert d["bytes_per_expert_4k_aligned"][dtype] == store.slot_bytes, dtype
        assert d["total_expert_bytes"][dtype] == store.blob_size * n_experts, dtype
        assert {e.size for e in store.entries.values()} == {store.blob_size}
        # the blob really is that long: its last section ends inside it, the next slot starts after it
        last = max(store.sections, key=lambda s: s.offset)
        assert last.offset + last.nbytes <= store.blob_size < last.offset + last.nbytes + 64
        offsets = sorted(e.offset for e in store.entries.values())
        assert {b - a for a, b in zip(offsets, offsets[1:])} == {store.slot_bytes}
        # and the store wrote exactly the layout `info` computes, section by section
        sections, size = expert_layout(spec.geometry, dtype)
        assert size == store.blob_size and store.sections == sections
        assert store.meta["blob_size"] == size
        assert store.slot_bytes % ALIGN == 0


def test_section_alignment_is_counted(embedded):
    """The embedded model's int8 scales (80 fp16 = 160 B) are padded to 64-byte sections in the
    store, so an expert is 64 B more than its raw weights and scales: info says so too."""
    spec = inspect_model_dir(embedded)
    h, i = 256, 80
    raw = 3 * h * i + (i + i + h) * 2
    assert model_info(spec)["bytes_per_expert"]["int8"] == raw + 2 * (192 - 160) == 62_336
