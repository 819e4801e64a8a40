"""Shared fixtures: tiny real checkpoints of every family, built once per test session."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from toolkit.models.loader import embedded_model_dir
from toolkit.models.tiny import TINY_FAMILIES, build_tiny

from prebuild import A16W8_EXPORT, MAX_SEQ, QNN_EXPORT  # tests/prebuild.py: the shared bundles' settings

REPO = Path(__file__).resolve().parent.parent

# the user's runner cache, before any fixture points SPECPREFETCH_PROFILES at a session's: ONNX Runtime's
# headers are fetched there once (tests/prebuild.py user_ort_headers), not once per test session
if "SPX_TEST_USER_RUNNERS" not in os.environ:
    from android_runner.build import runners_dir as _runners_dir

    os.environ["SPX_TEST_USER_RUNNERS"] = str(_runners_dir())
HELDOUT = REPO / "toolkit" / "embedded" / "heldout.jsonl"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {f: build_tiny(f, root / f, seed=1) for f in TINY_FAMILIES}


@pytest.fixture(scope="session")
def cuda_standin(tmp_path_factory):
    """A stand-in for the CUDA driver's library, loaded (tests/cuda_standin.py); skips without a C++ compiler."""
    import cuda_standin as standin   # (tests/cuda_standin.py)
    from toolkit.runtime.native_sched import _compiler, has_compiler

    if not has_compiler():
        pytest.skip("no C++ compiler")
    return standin.load(standin.build(tmp_path_factory.mktemp("libcuda"), _compiler()[0]))


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
def vl_bundle(tiny_models, tmp_path_factory) -> Path:
    """The tiny Qwen3-VL-MoE as an ExecuTorch bundle that takes 64x64 images (an export, ~40 s: slow tests)."""
    from export.bundle import ExportConfig, export_bundle

    out = tmp_path_factory.mktemp("vlb") / "bundle"
    export_bundle(tiny_models["qwen3_vl_moe"], out, ExportConfig(target="executorch", max_seq=64, image_size=(64, 64),
                                                                 parity_prompts=1, progress=False))
    return out


@pytest.fixture(scope="session")
def vl_qnn_bundle(tiny_models, tmp_path_factory) -> Path:
    """The tiny Qwen3-VL-MoE as a QNN bundle (fp16 context binaries for the HTP simulator) that takes
    64x64 images (~11 s: slow tests)."""
    from export.bundle import ExportConfig, export_bundle

    out = tmp_path_factory.mktemp("vlq") / "bundle"
    export_bundle(tiny_models["qwen3_vl_moe"], out, ExportConfig(target="qnn", max_seq=64, image_size=(64, 64),
                                                                 parity_prompts=1, progress=False))
    return out


class _Prebuild:
    """The background build of tests/prebuild.py, started after collection when a selected test needs
    the shared bundle and waited for by the fixtures below. Under pytest-xdist (`make test` runs two
    workers) the first worker to get here starts it in the run's shared temporary directory (its pid
    in `started`) and every worker waits for the stage it needs in the status file, so it is built
    once per run; a build that died without a word fails the waiting tests at once, and a failure is
    remembered (one wait per stage, not one per test)."""

    def __init__(self, config, executorch: bool, native: bool, qnn: bool, a16w8: bool = False):
        import os
        import subprocess
        import sys

        self.worker = hasattr(config, "workerinput")
        base = config._tmp_path_factory.getbasetemp()
        root = (base.parent if self.worker else base) / "shared"
        self.bundle = root / "bundles" / "executorch"
        self.qnn_bundle = root / "bundles" / "qnn"
        self.a16w8_bundle = root / "bundles" / "qnn-a16w8"
        self.profiles = root / "runner-cache" / "profiles"
        self.status = root / "status.json"
        self.log = root / "prebuild.log"
        self.started = root / "started"
        self.native, self.qnn, self.a16w8 = native, qnn, qnn and a16w8
        self.proc = None
        self.failed: dict[str, str] = {}
        root.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.started, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return  # another worker builds it
        try:
            # one torch thread, a compile job per core: the build is the run's critical path and the
            # tests yield to it (see _yield_to_the_prebuild); the cores the waiting workers leave idle
            # compile the runners
            env = {**os.environ, "SPECPREFETCH_PROFILES": str(self.profiles), "OMP_NUM_THREADS": "1",
                   "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
            args = [sys.executable, str(REPO / "tests" / "prebuild.py"), str(self.bundle), "--status", str(self.status)]
            if not executorch:
                args.append("--no-bundle")
            if native:
                args.append("--native")
            if qnn:
                args += ["--qnn", str(self.qnn_bundle)]
            if self.a16w8:
                args += ["--a16w8", str(self.a16w8_bundle)]
            with open(self.log, "wb") as log:
                self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
            os.write(fd, str(self.proc.pid).encode())
        except Exception as e:  # no build: say so to every waiter (the tests that need it fail with this)
            if self.proc is not None:
                self.proc.kill()
                self.proc.wait()
            err = f"the background build did not start ({type(e).__name__}: {e})"
            tmp = self.status.with_suffix(".start.tmp")
            tmp.write_text(json.dumps({"bundle": False, "native": False, "qnn": False, "a16w8": False, "error": err}))
            os.replace(tmp, self.status)
            self.failed = {"bundle": err, "native": err, "qnn": err, "a16w8": err}
        finally:
            os.close(fd)

    def _alive(self) -> bool:
        import time

        if self.proc is not None:
            return self.proc.poll() is None
        try:
            text = self.started.read_text()
            pid = int(text or "0")
        except (OSError, ValueError):
            return True  # the owner is still writing it
        if pid <= 0:  # no pid yet: the owner is writing it, unless it died before it could
            try:
                return time.time() - self.started.stat().st_mtime < 10.0
            except OSError:
                return False
        try:  # a builder killed under a busy owner stays a zombie until the owner reaps it
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state not in ("Z", "X")

    def _state(self) -> dict:
        try:
            return json.loads(self.status.read_text())
        except (OSError, ValueError):
            return {}

    def wait(self, stage: str) -> None:
        """Until `stage` ("bundle", "native", "qnn" or "a16w8") has finished; fails the test if it failed."""
        import time

        if stage in self.failed:
            pytest.fail(self.failed[stage], pytrace=False)
        dead_since = None
        while True:
            st = self._state()
            if st.get(stage) is not None:
                break
            if self._alive():
                dead_since = None
            elif dead_since is None:
                dead_since = time.monotonic()
            elif time.monotonic() - dead_since > 2.0:  # its last status write has had time to land
                st = {**self._state()}
                if st.get(stage) is None:
                    st = {stage: False, "error": "the build process died without a status (killed?)"}
                break
            time.sleep(0.2)
        if not st.get(stage):
            tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
            err = (st.get("errors") or {}).get(stage) or st.get("error")
            self.failed[stage] = (f"the shared bundle's background build failed at its {stage} stage "
                                  f"({err}; {self.log}):\n{tail}")
            pytest.fail(self.failed[stage], pytrace=False)

    def stop(self, interrupted: bool) -> None:
        if self.proc is None:
            return
        if interrupted and self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()  # other workers may still wait for it: never killed on a normal finish


_SHARED = ("embedded_bundles", "native_host", "qnn_native", "a16w8_native")
_prebuild: _Prebuild | None = None


def _needs(item, name: str) -> bool:
    return name in getattr(item, "fixturenames", ())


def _qnn_only(item) -> bool:
    """A test of the embedded QNN bundle alone (it exports that one itself, in-process)."""
    cs = getattr(item, "callspec", None)
    return cs is not None and cs.params.get("target") == "qnn" and not _needs(item, "native_host")


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
    needs_et = any(_needs(i, "embedded_bundles") and not _qnn_only(i) for i in items)
    needs_a16w8 = any(_needs(i, "a16w8_native") for i in items)
    needs_qnn = needs_a16w8 or any(_needs(i, "qnn_native") for i in items)
    if (needs_et or needs_qnn) and not session.config.option.collectonly:
        # every worker collects every test: the build includes the runners if any selected test needs them
        _prebuild = _Prebuild(session.config, executorch=needs_et, native=any(_needs(i, "native_host") for i in items),
                              qnn=needs_qnn, a16w8=needs_a16w8)
        _yield_to_the_prebuild()


def _yield_to_the_prebuild() -> None:
    """The background build is the run's critical path (the tests that need it wait for it): this test
    process (every thread it has now, and what it starts later) lowers its priority below the build's,
    which was started before (its priority stays; it runs one torch thread and a compile job per core),
    so the build gets the cores it asks for first and the tests share what is left."""
    import os

    try:  # Linux's priority is per thread: every thread this process has (later ones inherit it)
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + 5))
        except OSError:  # not allowed here, or the thread ended: the run is only slower
            pass


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
                _prebuild.wait("bundle")
                self[target] = _prebuild.bundle
                return self[target]
            export_bundle(embedded, root / target, ExportConfig(target=target, max_seq=MAX_SEQ, progress=False))
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
    if native:
        _prebuild.wait("native")
    profiles = _prebuild.profiles if native else tmp_path_factory.mktemp("runner-cache") / "profiles"
    os.environ["SPECPREFETCH_PROFILES"] = str(profiles)
    try:
        yield bundle, build(bundle, "host", log=lambda s: None, tokenizer=False)
    finally:
        if old is None:
            os.environ.pop("SPECPREFETCH_PROFILES", None)
        else:
            os.environ["SPECPREFETCH_PROFILES"] = old


@pytest.fixture(scope="session")
def qnn_native(embedded, tmp_path_factory) -> tuple[Path, Path]:
    """(bundle, runner build directory): the embedded model's fp16 QNN bundle (SM8750, HTP simulator,
    next-gate heads, a 32-position cache: one prefill chunk size, 8; tests/prebuild.py QNN_EXPORT)
    and its host runner (ONNX Runtime backend, no C++ tokenizer), from the background build when one
    was started, else exported and built here (the runner cache: the runner's parent's parent /
    profiles). ONNX Runtime's headers come from the user's runner cache (fetched there once)."""
    from export.bundle import ExportConfig, export_bundle
    from prebuild import build_qnn_host

    if _prebuild is not None and _prebuild.qnn:
        _prebuild.wait("qnn")
        bundle, profiles = _prebuild.qnn_bundle, _prebuild.profiles
    else:
        bundle = tmp_path_factory.mktemp("qnn") / "bundle"
        export_bundle(embedded, bundle, ExportConfig(**QNN_EXPORT))
        profiles = tmp_path_factory.mktemp("runner-cache") / "profiles"
    return bundle, build_qnn_host(bundle, profiles)


@pytest.fixture(scope="session")
def a16w8_native(qnn_native, tmp_path_factory) -> tuple[Path, Path]:
    """(bundle, runner build directory): the embedded model's a16w8 QNN bundle (tests/prebuild.py
    A16W8_EXPORT) and its runner, which is qnn_native's (the same model and configuration); from the
    background build when one was started, else exported here."""
    from export.bundle import ExportConfig, export_bundle
    from prebuild import build_qnn_host

    if _prebuild is not None and _prebuild.a16w8:
        _prebuild.wait("a16w8")
        bundle = _prebuild.a16w8_bundle
    else:
        bundle = tmp_path_factory.mktemp("qnn-a16w8") / "bundle"
        export_bundle(embedded_model_dir(), bundle, ExportConfig(**A16W8_EXPORT))
    runner = build_qnn_host(bundle, qnn_native[1].parent.parent / "profiles")
    assert runner == qnn_native[1], (runner, qnn_native[1])  # one runner for both bundles
    return bundle, runner
