"""`runner build` (android_runner/build.py): its output directory and its stamp.

- `runner build --out DIR` writes only into a new or empty directory or a runner build of its own
  (never an input); another configuration there needs --overwrite.
- `runner build` never reuses a binary whose bytes are not the ones its stamp recorded.

Real files: the session's embedded ExecuTorch bundle and its host runner (the shared bundle: this
module runs late).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cli_helpers import cli_plain as cli, one_error
from toolkit.errors import SpecPrefetchError


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """This module's store, hash and program caches live in a temporary directory."""
    monkeypatch.setenv("SPECPREFETCH_PROFILES", str(tmp_path_factory.getbasetemp() / "hb-cache" / "profiles"))


@pytest.fixture(scope="module")
def bundle(embedded_bundles) -> Path:
    return embedded_bundles["executorch"]


def runner_copy(native_host, dst: Path) -> Path:
    """What a runner build directory needs to be reused: its marker, stamp, configuration, bin/."""
    out = native_host[1]
    dst.mkdir()
    for name in ("build.json", ".stamp", ".configured", "spx_config.h", "run.sh"):
        shutil.copy2(out / name, dst / name)
    shutil.copytree(out / "bin", dst / "bin")
    return dst


class Building(Exception):
    """Raised by the log callback when build() starts building instead of reusing."""


def _no_build(msg: str) -> None:
    if msg.startswith("building the native runner"):
        raise Building(msg)


class TestRunnerBuildOutput:
    """runner build --out writes only into a new or empty directory or a runner build of its own."""

    def test_runner_build_never_writes_into_a_directory_that_is_not_a_runner_build(self, bundle, tmp_path):
        from android_runner.build import build

        proj = tmp_path / "myproject"
        for d in ("include", "build", "bin"):
            (proj / d).mkdir(parents=True)
            (proj / d / "keep.txt").write_text(d)
        (proj / "run.sh").write_text("echo mine\n")
        with pytest.raises(SpecPrefetchError, match="is a directory that is not a runner build"):
            build(bundle, "host", proj, log=lambda s: None)
        assert sorted(p.name for p in proj.iterdir()) == ["bin", "build", "include", "run.sh"]
        assert all((proj / d / "keep.txt").read_text() == d for d in ("include", "build", "bin"))
        assert (proj / "run.sh").read_text() == "echo mine\n"
        with pytest.raises(SpecPrefetchError, match="is inside .*an input of this command"):
            build(bundle, "host", bundle / "runner", log=lambda s: None)
        code, out = cli("runner", "build", bundle, "--out", proj)
        one_error(code, out, str(proj), "not a runner build")
        assert (proj / "include" / "keep.txt").is_file() and (proj / "build" / "keep.txt").is_file()

    def test_runner_build_needs_overwrite_for_another_configuration(self, native_host, tmp_path):
        from android_runner.build import build

        bundle = native_host[0]
        out = runner_copy(native_host, tmp_path / "r")
        (out / ".configured").write_text("0123456789abcdef")  # a build of another bundle config / toolchain
        (out / ".stamp").write_text("{}")
        with pytest.raises(SpecPrefetchError, match="another configuration.*--overwrite"):
            build(bundle, "host", out, log=_no_build)
        with pytest.raises(SpecPrefetchError, match="forced rebuild.*--overwrite"):
            build(bundle, "host", runner_copy(native_host, tmp_path / "r2"), force=True, log=_no_build)
        with pytest.raises(Building):  # with overwrite it is rebuilt (stopped here, before CMake)
            build(bundle, "host", out, overwrite=True, log=_no_build)


class TestRunnerBuildStamp:
    """A runner build is reused only while its files have the bytes its stamp recorded."""

    def test_a_damaged_runner_binary_is_rebuilt_not_reused(self, native_host, tmp_path):
        from android_runner.build import build

        bundle = native_host[0]
        out = runner_copy(native_host, tmp_path / "r")
        assert build(bundle, "host", out, log=_no_build) == out  # intact: reused
        exe = out / "bin" / "specprefetch-runner"
        raw = bytearray(exe.read_bytes())
        raw[len(raw) // 2] ^= 0x01  # one bit, size and mtime aside
        exe.write_bytes(raw)
        with pytest.raises(Building):
            build(bundle, "host", out, log=_no_build)
