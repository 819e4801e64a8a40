"""Shared fixtures: tiny real checkpoints of every family, built once per test session."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from toolkit.models.loader import embedded_model_dir
from toolkit.models.tiny import TINY_FAMILIES, build_tiny

REPO = Path(__file__).resolve().parent.parent
HELDOUT = REPO / "toolkit" / "embedded" / "heldout.jsonl"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {f: build_tiny(f, root / f, seed=1) for f in TINY_FAMILIES}


@pytest.fixture(scope="session")
def embedded() -> Path:
    return embedded_model_dir()


@pytest.fixture(scope="session")
def vl_data(tmp_path_factory) -> Path:
    """A JSONL of image+text pairs with real PNG files."""
    from PIL import Image

    d = tmp_path_factory.mktemp("vl")
    rng = np.random.default_rng(0)
    for name, (h, w) in {"a.png": (64, 48), "b.png": (40, 64)}.items():
        Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(d / name)
    rows = [{"text": "A photo of a red kite over a hill.", "image": "a.png"},
            {"text": "Describe the chart.", "image": "b.png"},
            {"text": "Plain text without an image, about the kernel."}]
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d / "pairs.jsonl"


@pytest.fixture(scope="session")
def embedded_bundles(tmp_path_factory, embedded) -> dict[str, Path]:
    """The embedded model exported to an fp32 ExecuTorch bundle and an fp16 QNN bundle (SM8750,
    HTP simulator), next-gate heads, 64-position KV cache: shared by the export and runner tests."""
    from export.bundle import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("bundles")

    class Bundles(dict):
        """Each target exported on first use (the QNN one, ~1 minute, only by tests that need it)."""

        def __missing__(self, target: str) -> Path:
            export_bundle(embedded, root / target, ExportConfig(target=target, max_seq=64, progress=False))
            self[target] = root / target
            return self[target]

    return Bundles()


@pytest.fixture(scope="session")
def native_host(embedded_bundles, tmp_path_factory):
    """(bundle, runner build directory): the host runner generated for the shared fp32 ExecuTorch
    bundle, without the C++ tokenizer (a few minutes to build, in make test-all's tests only), built
    once into this session's own runner cache, where `run --engine native` and `device push` find it."""
    import os

    from android_runner.build import build

    bundle = embedded_bundles["executorch"]
    old = os.environ.get("SPECPREFETCH_PROFILES")
    os.environ["SPECPREFETCH_PROFILES"] = str(tmp_path_factory.mktemp("runner-cache") / "profiles")
    try:
        yield bundle, build(bundle, "host", log=lambda s: None, tokenizer=False)
    finally:
        if old is None:
            os.environ.pop("SPECPREFETCH_PROFILES", None)
        else:
            os.environ["SPECPREFETCH_PROFILES"] = old
