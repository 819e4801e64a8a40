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


class _Prebuild:
    """The background build of tests/prebuild.py, started after collection when a selected test needs
    the shared bundle and waited for by the fixtures below. Under pytest-xdist (`make test` runs two
    workers) the first worker to get here starts it in the run's shared temporary directory and
    every worker waits for its status file, so it is built once per run."""

    def __init__(self, config, native: bool):
        import os
        import subprocess
        import sys

        self.worker = hasattr(config, "workerinput")
        base = config._tmp_path_factory.getbasetemp()
        root = (base.parent if self.worker else base) / "shared"
        self.bundle = root / "bundles" / "executorch"
        self.profiles = root / "runner-cache" / "profiles"
        self.status = root / "status.json"
        self.log = root / "prebuild.log"
        self.native = native
        self.proc = None
        root.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(root / "started", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # another worker builds it
        env = {**os.environ, "SPECPREFETCH_PROFILES": str(self.profiles), "OMP_NUM_THREADS": "1"}
        args = [sys.executable, str(REPO / "tests" / "prebuild.py"), str(self.bundle), "--status", str(self.status)]
        if native:
            args.append("--native")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def wait(self) -> None:
        import time

        while not self.status.exists():
            if self.proc is not None and self.proc.poll() is not None and not self.status.exists():
                break  # died without a status (killed)
            time.sleep(0.2)
        st = json.loads(self.status.read_text()) if self.status.exists() else {"ok": False, "error": "killed"}
        if not st["ok"]:
            tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
            pytest.fail(f"the shared bundle's background build failed ({st['error']}; {self.log}):\n{tail}",
                        pytrace=False)
        if self.native and not st.get("native"):
            pytest.fail(f"the shared bundle's background build has no host runner ({self.log})", pytrace=False)

    def stop(self, interrupted: bool) -> None:
        if self.proc is None:
            return
        if interrupted and self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()  # other workers may still wait for it: never killed on a normal finish


_SHARED = ("embedded_bundles", "native_host")
_prebuild: _Prebuild | None = None


def _needs(item, name: str) -> bool:
    return name in getattr(item, "fixturenames", ())


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Modules that need the shared bundle run last (in their own order), so the background build has
    the rest of the suite's time to finish."""
    late = {item.module.__name__ for item in items if any(_needs(item, n) for n in _SHARED)}
    items.sort(key=lambda item: item.module.__name__ in late)  # stable: file order within each group


def pytest_collection_finish(session):
    global _prebuild
    items = session.items
    if hasattr(session.config, "workerinput"):
        import torch

        torch.set_num_threads(1)  # one worker per core
    if any(_needs(i, "embedded_bundles") for i in items) and not session.config.option.collectonly:
        # every worker collects every test: the build includes the runner if any selected test needs it
        _prebuild = _Prebuild(session.config, native=any(_needs(i, "native_host") for i in items))


def pytest_sessionfinish(session, exitstatus):
    if _prebuild is not None:
        _prebuild.stop(interrupted=exitstatus == pytest.ExitCode.INTERRUPTED)


@pytest.fixture(scope="session")
def embedded_bundles(tmp_path_factory, embedded) -> dict[str, Path]:
    """The embedded model exported to an fp32 ExecuTorch bundle and an fp16 QNN bundle (SM8750,
    HTP simulator), next-gate heads, 64-position KV cache: shared by the export and runner tests.
    The ExecuTorch one comes from the background build (tests/prebuild.py) when one was started."""
    from export.bundle import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("bundles")

    class Bundles(dict):
        """Each target exported on first use (the QNN one, ~1 minute, only by tests that need it)."""

        def __missing__(self, target: str) -> Path:
            if target == "executorch" and _prebuild is not None:
                _prebuild.wait()
                self[target] = _prebuild.bundle
                return self[target]
            export_bundle(embedded, root / target, ExportConfig(target=target, max_seq=64, progress=False))
            self[target] = root / target
            return self[target]

    return Bundles()


@pytest.fixture(scope="session")
def native_host(embedded_bundles, tmp_path_factory):
    """(bundle, runner build directory): the host runner generated for the shared fp32 ExecuTorch
    bundle, without the C++ tokenizer (a few minutes to build, in make test-all's tests only), built
    once into this session's own runner cache, where `run --engine native` and `device push` find it
    (by the background build when one was started: this call then finds it in the cache)."""
    import os

    from android_runner.build import build

    bundle = embedded_bundles["executorch"]
    old = os.environ.get("SPECPREFETCH_PROFILES")
    native = _prebuild is not None and _prebuild.native
    profiles = _prebuild.profiles if native else tmp_path_factory.mktemp("runner-cache") / "profiles"
    os.environ["SPECPREFETCH_PROFILES"] = str(profiles)
    try:
        yield bundle, build(bundle, "host", log=lambda s: None, tokenizer=False)
    finally:
        if old is None:
            os.environ.pop("SPECPREFETCH_PROFILES", None)
        else:
            os.environ["SPECPREFETCH_PROFILES"] = old
