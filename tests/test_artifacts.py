"""The artifact rule (toolkit/artifacts: claims, atomic directories and files, the destination lock,
the siblings of OUT) and the writers that follow it (export, adapters, tiny, reports): never replace
what is not ours, leave nothing behind on a full disk or an interrupt, refuse a second writer of the
same output, and show progress during export.

The atomic writers touch a sibling of OUT (OUT.old, OUT.partial, OUT.partial-PID-XXXXXXXX,
OUT.rejected) only if the toolkit made it (it holds the marker directory `.specprefetch-work`). A
user's own directory under one of those names survives byte for byte: the writer either proceeds
without touching it, or, where it needs that name, refuses with one line naming it. The marker never
ends up in a committed OUT.

Report files (every --json, --events, calibrate --out, and the .md/.png beside a report) follow the
same rule (toolkit.artifacts.claim_report), checked before any work: never an input of the command,
never inside another artifact, never another output of the same command; an existing one is replaced
only with --overwrite and only if it is a report of the same command (its "specprefetch_report"
marker; an events log by its header line). A FIFO or a character device (/dev/null) is written in
place, never renamed over.

Full disks are real (a small tmpfs, or RLIMIT_FSIZE in a subprocess), signals are real (SIGTERM
sent to a subprocess), concurrent writers are two real processes, and the reports are written by
real commands (click's CliRunner) from real tiny models, traces, adapters and stores. No test here
needs the shared bundle.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import HELDOUT
from toolkit.artifacts import (AtomicDirectory, artifact_kind, atomic_directory, atomic_output_file,
                               claim_output, lock_path, partial_dir, rejected_dir)
from toolkit.cli import main
from cli_helpers import cli, refused
from toolkit.errors import SpecPrefetchError, interrupted_message
from toolkit.traces.format import TraceWriter

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


WORK_MARK = ".specprefetch-work"  # toolkit.artifacts.WORK_MARK (a literal: these tests also run on older code)


class Refused(Exception):
    pass


def _tree(p: Path) -> dict[str, str]:
    """Every file under p (p itself if a file) with its content hash, and every directory."""
    if p.is_file():
        return {"": hashlib.sha256(p.read_bytes()).hexdigest()}
    return {str(f.relative_to(p)): hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else "dir"
            for f in sorted(p.rglob("*"))}


def _names(p: Path) -> list[str]:
    return sorted(x.name for x in p.iterdir())


def _old(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.txt").write_text("old")
    (out / "adapter.json").write_text('{"format": "specprefetch-adapter"}')  # what artifact_kind knows it by
    return out


def _users(d: Path, name: str = "thesis.tex") -> dict[str, str]:
    """A user's own directory `d` holding one file (and a subdirectory); returns its snapshot."""
    (d / "chapters").mkdir(parents=True)
    (d / name).write_bytes(b"\\documentclass{article} % years of work\n" + os.urandom(64))
    (d / "chapters" / "1.tex").write_text("intro\n")
    return _tree(d)


def _adapter(out: Path, tag: str = "old") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter.json").write_text(json.dumps({"format": "specprefetch-adapter", "tag": tag}))
    (out / "adapter.safetensors").write_text(tag)
    return out


def _one_line(e: pytest.ExceptionInfo, path: Path) -> None:
    msg = str(e.value)
    assert "\n" not in msg and msg == f"{path} exists and was not made by specprefetch; move it away", msg


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A real tmpfs of `size` at `path` (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _env(tmpdir: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), TMPDIR=str(tmpdir))
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


class TestClaims:
    """What an existing path is, and whether a writer may claim it; a refused claim creates nothing."""

    def test_artifact_kind_knows_each_artifact_by_its_own_marker(self, tmp_path, embedded):
        import torch

        from adapters.checkpoint import FORMAT as ADAPTER_FORMAT, save_adapter
        from adapters.lowrank import PrefetchAdapter
        from export.manifest import FORMAT as BUNDLE_FORMAT
        from toolkit.artifacts import ADAPTER_FORMAT as A, BUNDLE_FORMAT as B, STORE_MAGIC, TRACE_FORMAT as T
        from toolkit.models.loader import inspect_model_dir
        from toolkit.runtime.expert_store import MAGIC
        from toolkit.traces.format import FORMAT as TRACE_FORMAT

        assert (A, B, T, STORE_MAGIC) == (ADAPTER_FORMAT, BUNDLE_FORMAT, TRACE_FORMAT, MAGIC)
        from toolkit.artifacts.kinds import VISION_TOWER_NAME
        from toolkit.models.embedded_vl import NAME
        from toolkit.models.shipped import VL_DIR

        assert VISION_TOWER_NAME == NAME and artifact_kind(VL_DIR) == "vision tower"
        from toolkit.embedded.pictures import write_pairs

        assert artifact_kind(write_pairs(tmp_path / "pics", n=2).parent) == "pictures"
        (tmp_path / "pics" / "notes.txt").write_text("mine")  # anything else in it: not (only) pictures
        assert artifact_kind(tmp_path / "pics") is None
        spec = inspect_model_dir(embedded)
        g = spec.geometry
        torch.manual_seed(0)
        ad = PrefetchAdapter(num_layers=len(g.moe_layers), hidden_size=g.hidden_size,
                             num_experts=g.routing.num_experts, horizons=(1,), rank=2)
        assert artifact_kind(save_adapter(ad, tmp_path / "ad", spec, {})) == "adapter"  # a real one
        for name, fmt, kind in (("b", BUNDLE_FORMAT, "bundle"), ("t", TRACE_FORMAT, "trace")):
            (tmp_path / name).mkdir()
            (tmp_path / name / "manifest.json").write_text(json.dumps({"format": fmt}))
            assert artifact_kind(tmp_path / name) == kind
        (tmp_path / "s.spx").write_bytes(MAGIC + b"\0" * 56)
        assert artifact_kind(tmp_path / "s.spx") == "store"
        assert artifact_kind(embedded) == "model"
        (tmp_path / "r.json").write_text('{"rows": []}')
        (tmp_path / "r.png").write_bytes(b"\x89PNG")
        assert artifact_kind(tmp_path / "r.json") == artifact_kind(tmp_path / "r.png") == "report"
        (tmp_path / "empty").mkdir()
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "notes.txt").write_text("mine")
        (tmp_path / "other" / "manifest.json").write_text('{"format": "something-else"}')
        (tmp_path / "f.bin").write_bytes(b"SPX")
        (tmp_path / "link").symlink_to(tmp_path / "ad")
        for p in ("empty", "other", "f.bin", "link", "missing"):
            assert artifact_kind(tmp_path / p) is None, p
        assert artifact_kind(embedded / "config.json") is None  # a model's own JSON is not a report

    def test_claim_output_rule(self, tmp_path):
        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / "adapter.json").write_text('{"format": "specprefetch-adapter"}')
        (tmp_path / "theirs").mkdir()
        (tmp_path / "theirs" / "thesis.tex").write_text("years of work")
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text("{}")
        before = _tree(tmp_path)
        claim_output(tmp_path / "new" / "deeper", kind="adapter", overwrite=False)
        claim_output(tmp_path / "mine", kind="adapter", overwrite=True)
        with pytest.raises(SpecPrefetchError, match=r"^--out .*mine already exists; pass --overwrite to replace it$"):
            claim_output(tmp_path / "mine", kind="adapter", overwrite=False)
        with pytest.raises(SpecPrefetchError,
                           match="is a directory that is not a specprefetch artifact, not an adapter"):
            claim_output(tmp_path / "theirs", kind="adapter", overwrite=True)
        with pytest.raises(SpecPrefetchError, match="is a model checkpoint, not a bundle"):
            claim_output(tmp_path / "model", kind="bundle", overwrite=True)
        with pytest.raises(SpecPrefetchError, match="is an adapter, not a trace"):
            claim_output(tmp_path / "mine", kind="trace", overwrite=True)
        for out in (tmp_path / "model", tmp_path / "model" / "b", tmp_path):
            with pytest.raises(SpecPrefetchError, match="an input of this command"):
                claim_output(out, kind="bundle", overwrite=True, inputs=(tmp_path / "model", None))
        with pytest.raises(SpecPrefetchError, match="^--json .*already exists"):
            claim_output(tmp_path / "mine", kind="adapter", overwrite=False, option="--json")
        assert _tree(tmp_path) == before  # a claim creates nothing

    def test_existing_target_without_overwrite_is_refused_before_any_write(self, tmp_path):
        out = _old(tmp_path)
        with pytest.raises(SpecPrefetchError, match="already exists; pass --overwrite"):
            with atomic_directory(out, overwrite=False, kind="adapter"):
                pass
        assert _names(tmp_path) == ["out"]
        f = tmp_path / "file"
        f.write_text("x")
        with pytest.raises(SpecPrefetchError, match="is a file that is not a specprefetch artifact, not an adapter"):
            AtomicDirectory(f, overwrite=True, kind="adapter")
        assert f.read_text() == "x"

    def test_a_refused_directory_writer_creates_nothing(self, tmp_path):
        (tmp_path / "m").mkdir()
        (tmp_path / "m" / "config.json").write_text("{}")
        with pytest.raises(SpecPrefetchError, match="input"):
            with atomic_directory(tmp_path / "m" / "a" / "b", overwrite=False, kind="bundle", inputs=(tmp_path / "m",)):
                pass
        assert _names(tmp_path / "m") == ["config.json"]
        # a work directory left by a killed process (unique name, the toolkit's marker) is removed by the next
        # writer (one without the marker is left alone: TestPartialDirectories)
        (tmp_path / "out.partial-999999-deadbeef" / ".specprefetch-work").mkdir(parents=True)
        with atomic_directory(tmp_path / "out", overwrite=False, kind="bundle") as work:
            (work / "x").write_text("1")
        assert _names(tmp_path) == ["m", "out"]


class TestAtomicDirectory:
    """An output directory is assembled beside OUT and renamed in only when complete."""

    def test_success_replaces_and_cleans_up(self, tmp_path):
        out = _old(tmp_path)
        with atomic_directory(out, overwrite=True, kind="adapter") as work:
            # a non-resumable writer's work directory is unique to its process
            # holding only the toolkit's marker (an empty directory; see TestPartialDirectories)
            assert work.name.startswith("out.partial-") and [p.name for p in work.iterdir()] == [".specprefetch-work"]
            (work / "b.txt").write_text("new")
            assert (out / "a.txt").read_text() == "old"  # the old one stays until the new one is complete
        assert sorted(p.name for p in out.iterdir()) == ["b.txt"]
        assert _names(tmp_path) == ["out"]  # no .partial, no .old, no lock left

    def test_new_directory_and_parents(self, tmp_path):
        out = tmp_path / "x" / "y" / "out"
        with atomic_directory(out, overwrite=False, kind="adapter") as work:
            (work / "f").write_text("1")
        assert (out / "f").read_text() == "1" and _names(out.parent) == ["out"]

    @pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
    def test_interrupted_leaves_the_target_untouched(self, tmp_path, exc):
        out = _old(tmp_path)
        with pytest.raises(exc):
            with atomic_directory(out, overwrite=True, kind="adapter") as work:
                (work / "b.txt").write_text("half")
                raise exc()
        assert sorted(p.name for p in out.iterdir()) == ["a.txt", "adapter.json"] and (
            (out / "a.txt").read_text() == "old")
        assert _names(tmp_path) == ["out"]  # the work directory is removed

    def test_a_commit_interrupted_between_its_renames_is_recovered(self, tmp_path, monkeypatch):
        """The old OUT is moved aside first; if the process dies before the new one is renamed in,
        the next use puts the old, complete one back."""
        import os

        out = _old(tmp_path)
        d = AtomicDirectory(out, overwrite=True, kind="adapter")
        (d.work / "b.txt").write_text("new")
        real = os.rename

        def dies_on_second(src, dst):
            if str(src) == str(d.work):
                raise KeyboardInterrupt()
            real(src, dst)

        monkeypatch.setattr(os, "rename", dies_on_second)
        with pytest.raises(KeyboardInterrupt):
            d.commit()
        monkeypatch.setattr(os, "rename", real)
        assert not out.exists() and (tmp_path / "out.old" / "a.txt").exists()
        AtomicDirectory(out, overwrite=True, kind="adapter").discard()
        assert (out / "a.txt").read_text() == "old" and _names(tmp_path) == ["out"]


class TestAtomicOutputFile:
    """A single-file output is claimed, locked, written beside OUT and renamed in."""

    def test_atomic_output_file_claims_locks_and_renames(self, tmp_path):
        model = tmp_path / "model"
        model.mkdir()
        (model / "config.json").write_text("{}")
        (model / "model.safetensors").write_bytes(b"weights")
        with pytest.raises(SpecPrefetchError, match="already exists"):  # issue 13 item 2: store --out WEIGHTS
            with atomic_output_file(model / "model.safetensors", kind="store", overwrite=False):
                pass
        with pytest.raises(SpecPrefetchError, match="not an expert store"):
            with atomic_output_file(model / "model.safetensors", kind="store", overwrite=True):
                pass
        assert (model / "model.safetensors").read_bytes() == b"weights"
        with atomic_output_file(tmp_path / "s.spx", kind="store", overwrite=False) as tmp:
            assert lock_path(tmp_path / "s.spx").exists()
            tmp.write_bytes(b"SPXSTORE" + b"1")
        with atomic_output_file(tmp_path / "s.spx", kind="store", overwrite=True) as tmp:
            tmp.write_bytes(b"SPXSTORE" + b"2")
        assert (tmp_path / "s.spx").read_bytes() == b"SPXSTORE2" and _names(tmp_path) == ["model", "s.spx"]


HEADER = {"model": {"path": "m"}, "data": {"files": []}, "settings": {"sequences": 8, "batch": 1}}


class TestPartialDirectories:
    """OUT.partial and OUT.partial-PID-X are resumed or removed only if the toolkit made them."""

    def test_leftover_partial_is_replaced(self, tmp_path):
        out = tmp_path / "out"
        partial_dir(out).mkdir()
        (partial_dir(out) / "stale").write_text("x")
        with atomic_directory(out, overwrite=False, kind="adapter") as work:
            assert not (work / "stale").exists()
        assert not (out / "stale").exists()

    def test_resume_keeps_the_partial_on_failure_and_reuses_it(self, tmp_path):
        out = tmp_path / "out"
        with pytest.raises(KeyboardInterrupt):
            with atomic_directory(out, overwrite=False, resume=True, kind="adapter") as work:
                (work / "shard-0").write_text("done")
                raise KeyboardInterrupt()
        assert not out.exists() and (partial_dir(out) / "shard-0").exists()
        d = AtomicDirectory(out, overwrite=False, resume=True, kind="adapter")
        assert d.resumed and (d.work / "shard-0").read_text() == "done"
        (d.work / "shard-1").write_text("done")
        assert d.commit() == out
        assert sorted(p.name for p in out.iterdir()) == ["shard-0", "shard-1"] and _names(tmp_path) == ["out"]
        assert not AtomicDirectory(tmp_path / "fresh", overwrite=False, resume=True, kind="adapter").resumed

    def test_a_non_resuming_writer_leaves_a_users_partial_dirs_alone(self, tmp_path):
        """Was: every non-resuming writer removed OUT.partial and anything named OUT.partial-N-XXXXXXXX."""
        out = tmp_path / "bundle"
        p1, p2 = partial_dir(out), tmp_path / "bundle.partial-123-deadbeef"
        b1, b2 = _users(p1), _users(p2)
        for _ in range(2):  # a success, and a failure (which removes only its own work directory)
            with atomic_directory(out, overwrite=True, kind="adapter") as work:
                _adapter(work, "new")
            with pytest.raises(RuntimeError):
                with atomic_directory(out, overwrite=True, kind="adapter"):
                    raise RuntimeError()
        assert _tree(p1) == b1 and _tree(p2) == b2
        assert _names(tmp_path) == ["bundle", "bundle.partial", "bundle.partial-123-deadbeef"]
        # the toolkit's own (marked) leftovers are still cleaned up
        (p1 / WORK_MARK).mkdir()
        stale = tmp_path / "bundle.partial-456-cafebabe"
        (stale / WORK_MARK).mkdir(parents=True)
        with atomic_directory(out, overwrite=True, kind="adapter") as work:
            _adapter(work, "new")
        assert _names(tmp_path) == ["bundle", "bundle.partial-123-deadbeef"] and _tree(p2) == b2

    def test_a_resuming_writer_refuses_a_users_partial(self, tmp_path):
        out = tmp_path / "t"
        before = _users(partial_dir(out))
        for overwrite in (False, True):
            with pytest.raises(SpecPrefetchError) as e:
                AtomicDirectory(out, overwrite=overwrite, resume=True, kind="trace")
            _one_line(e, partial_dir(out))
            assert _tree(partial_dir(out)) == before and _names(tmp_path) == ["t.partial"]

    def test_trace_writer_refuses_a_users_partial_and_resumes_its_own(self, tmp_path):
        """Was: TraceWriter removed OUT.partial whenever it held no progress.json (a user's directory
        named t.partial was deleted). Now one without the marker is refused in one line, with or
        without --overwrite and with or without a progress file; the toolkit's own still resumes."""
        out = tmp_path / "t"
        before = _users(partial_dir(out))
        for overwrite in (False, True):
            with pytest.raises(SpecPrefetchError) as e:
                TraceWriter(out, HEADER, overwrite=overwrite)
            _one_line(e, partial_dir(out))
            assert _tree(partial_dir(out)) == before and _names(tmp_path) == ["t.partial"]
        # a progress file does not make it the toolkit's either
        (partial_dir(out) / "progress.json").write_text(json.dumps(
            {"header": HEADER, "shards": [], "next_seq": 3, "seq_split": {}}))
        before = _tree(partial_dir(out))
        with pytest.raises(SpecPrefetchError) as e:
            TraceWriter(out, HEADER)
        _one_line(e, partial_dir(out))
        assert _tree(partial_dir(out)) == before

        # the toolkit's own: made, interrupted, resumed
        out = tmp_path / "mine"
        with pytest.raises(KeyboardInterrupt):
            with TraceWriter(out, HEADER) as w:
                assert not w.resumed and (partial_dir(out) / WORK_MARK).is_dir()
                w.seq_split = {0: "train", 1: "heldout", 2: "train"}
                w.flush(3)
                raise KeyboardInterrupt()
        assert not out.exists() and (partial_dir(out) / "progress.json").is_file()
        with TraceWriter(out, HEADER) as w:
            assert w.resumed and w.next_seq == 3
            w.finish({})
        assert _names(out) == ["manifest.json", "shards"]  # no marker, no progress file in the trace
        assert _names(tmp_path) == ["mine", "t.partial"]
        # started afresh (other settings, --overwrite): emptied but still the toolkit's
        with pytest.raises(KeyboardInterrupt):
            with TraceWriter(out, HEADER, overwrite=True) as w:
                w.flush(2)
                (w.work / "stray").write_text("x")
                raise KeyboardInterrupt()
        other = dict(HEADER, data={"files": ["other"]})
        with TraceWriter(out, other, overwrite=True) as w:
            assert not w.resumed and _names(w.work) == [WORK_MARK, "shards"]
            w.finish({})


class TestOldSibling:
    """OUT.old is moved back or removed only if the toolkit made it."""

    def test_a_users_out_old_is_not_renamed_to_out(self, tmp_path):
        """Was: with OUT absent, any OUT.old directory was renamed to OUT (adapter.old/notes.txt became
        adapter/notes.txt). Now the writer proceeds and OUT.old stays as it was."""
        out, old = tmp_path / "adapter", tmp_path / "adapter.old"
        before = _users(old, "notes.txt")
        with atomic_directory(out, overwrite=False, kind="adapter") as work:
            _adapter(work, "new")
        assert _tree(old) == before
        assert _names(out) == ["adapter.json", "adapter.safetensors"]  # no marker in the committed OUT
        assert _names(tmp_path) == ["adapter", "adapter.old"]
        # a file or a symbolic link named OUT.old is left alone as well
        (tmp_path / "b.old").write_text("mine")
        (tmp_path / "c.old").symlink_to(old)
        for name in ("b", "c"):
            with atomic_directory(tmp_path / name, overwrite=False, kind="adapter") as work:
                _adapter(work, "new")
        assert (tmp_path / "b.old").read_text() == "mine" and (tmp_path / "c.old").resolve() == old
        assert _tree(old) == before

    def test_replacing_out_refuses_a_users_out_old_and_deletes_nothing(self, tmp_path):
        """Was: commit() removed OUT.old with rmtree, whatever it was (adapter.old/thesis.tex deleted
        by atomic_directory(adapter, overwrite=True, kind="adapter")). Now replacing OUT, which needs
        that name to move OUT aside, is refused in one line before anything is written."""
        out, old = _adapter(tmp_path / "adapter"), tmp_path / "adapter.old"
        before_out, before_old = _tree(out), _users(old)
        with pytest.raises(SpecPrefetchError) as e:
            with atomic_directory(out, overwrite=True, kind="adapter") as work:
                _adapter(work, "new")
        _one_line(e, old)
        assert _tree(old) == before_old and _tree(out) == before_out
        assert _names(tmp_path) == ["adapter", "adapter.old"]  # no work directory, no lock
        # the same at commit time (OUT.old appeared while the writer ran): refused, nothing lost
        old2 = tmp_path / "x.old"
        out2 = _adapter(tmp_path / "x")
        d = AtomicDirectory(out2, overwrite=True, kind="adapter")
        _adapter(d.work, "new")
        before_old2 = _users(old2)
        with pytest.raises(SpecPrefetchError) as e:
            d.commit()
        _one_line(e, old2)
        assert _tree(old2) == before_old2 and _tree(out2) == before_out and not lock_path(out2).exists()
        d.discard()
        # once it is moved away, the same write goes through
        os.rename(old, tmp_path / "thesis")
        with atomic_directory(out, overwrite=True, kind="adapter") as work:
            _adapter(work, "new")
        assert json.loads((out / "adapter.json").read_text())["tag"] == "new"
        assert _tree(tmp_path / "thesis") == before_old

    def test_the_toolkits_own_out_old_is_still_recovered_and_cleaned(self, tmp_path, monkeypatch):
        """A commit that dies between its renames leaves OUT.old marked as the toolkit's: the next
        writer moves it back (without the marker); one left after the second rename is removed."""
        out = _adapter(tmp_path / "adapter")
        before = _tree(out)
        d = AtomicDirectory(out, overwrite=True, kind="adapter")
        _adapter(d.work, "new")
        real = os.rename

        def dies_on_second(src, dst):
            if str(src) == str(d.work):
                raise KeyboardInterrupt()
            real(src, dst)

        monkeypatch.setattr(os, "rename", dies_on_second)
        with pytest.raises(KeyboardInterrupt):
            d.commit()
        monkeypatch.setattr(os, "rename", real)
        assert not out.exists() and (tmp_path / "adapter.old" / WORK_MARK).is_dir()
        d.discard()
        AtomicDirectory(out, overwrite=True, kind="adapter").discard()
        assert _tree(out) == before and _names(tmp_path) == ["adapter"]
        # the toolkit's OUT.old left beside a complete OUT (died after the second rename): removed
        (tmp_path / "adapter.old" / WORK_MARK).mkdir(parents=True)
        with atomic_directory(out, overwrite=True, kind="adapter") as work:
            _adapter(work, "new")
        assert _names(tmp_path) == ["adapter"] and _names(out) == ["adapter.json", "adapter.safetensors"]


class TestRejectedSibling:
    """A refused result is kept as OUT.rejected; a user's OUT.rejected is never removed."""

    def test_refused_result_is_kept_as_rejected_until_a_success(self, tmp_path):
        out = _old(tmp_path)
        with pytest.raises(Refused):
            with atomic_directory(out, overwrite=True, keep_on=(Refused,), kind="adapter") as work:
                (work / "report.json").write_text("{}")
                raise Refused()
        assert (rejected_dir(out) / "report.json").exists() and (out / "a.txt").read_text() == "old"
        assert _names(tmp_path) == ["out", "out.rejected"]
        with pytest.raises(RuntimeError):  # other failures still remove the work directory
            with atomic_directory(out, overwrite=True, keep_on=(Refused,), kind="adapter"):
                raise RuntimeError()
        assert _names(tmp_path) == ["out", "out.rejected"]
        with atomic_directory(out, overwrite=True, keep_on=(Refused,), kind="adapter") as work:
            (work / "good").write_text("1")
        assert _names(tmp_path) == ["out"] and (out / "good").exists()

    def test_a_users_out_rejected_is_never_removed(self, tmp_path):
        """Was: keep_as() (a refused result) and a later success removed OUT.rejected, whatever it was.
        Now a writer that may keep its result there refuses up front; others ignore it."""
        out, rej = _adapter(tmp_path / "bundle"), rejected_dir(tmp_path / "bundle")
        before_out, before_rej = _tree(out), _users(rej)
        ran = []
        with pytest.raises(SpecPrefetchError) as e:  # a success would have removed it
            with atomic_directory(out, overwrite=True, keep_on=(Refused,), kind="adapter") as work:
                ran.append(1)
        _one_line(e, rej)
        with pytest.raises(SpecPrefetchError) as e:  # a refused result would have replaced it
            with atomic_directory(out, overwrite=True, keep_on=(Refused,), kind="adapter") as work:
                raise Refused()
        _one_line(e, rej)
        assert not ran and _tree(rej) == before_rej and _tree(out) == before_out
        assert _names(tmp_path) == ["bundle", "bundle.rejected"]
        # a writer that keeps nothing there does not need the name: it proceeds and leaves it alone
        with atomic_directory(out, overwrite=True, kind="adapter") as work:
            _adapter(work, "new")
        assert _tree(rej) == before_rej
        # keep_as() onto a user's directory (one that appeared while the writer ran): refused, untouched
        d = AtomicDirectory(out, overwrite=True, kind="adapter")
        (d.work / "report.json").write_text("{}")
        with pytest.raises(SpecPrefetchError) as e:
            d.keep_as(rej)
        _one_line(e, rej)
        assert _tree(rej) == before_rej and _names(tmp_path) == ["bundle", "bundle.rejected"]

    def test_the_toolkits_own_out_rejected_is_replaced_and_cleaned(self, tmp_path):
        out = tmp_path / "bundle"
        with pytest.raises(Refused):
            with atomic_directory(out, overwrite=False, keep_on=(Refused,), kind="adapter") as work:
                (work / "report.json").write_text("1")
                raise Refused()
        with pytest.raises(Refused):
            with atomic_directory(out, overwrite=False, keep_on=(Refused,), kind="adapter") as work:
                (work / "report.json").write_text("2")
                raise Refused()
        assert (rejected_dir(out) / "report.json").read_text() == "2"
        with atomic_directory(out, overwrite=False, keep_on=(Refused,), kind="adapter") as work:
            _adapter(work, "new")
        assert _names(tmp_path) == ["bundle"] and _names(out) == ["adapter.json", "adapter.safetensors"]


class TestWritersRefuseNeverDestroy:
    """export, save_adapter and tiny refuse what is not theirs and leave it as it was."""

    def test_export_model_onto_itself_is_refused_and_the_model_untouched(self, tmp_path, embedded):
        from export.bundle import ExportConfig, export_bundle

        import shutil

        model = shutil.copytree(embedded, tmp_path / "model")
        before = _tree(model)
        r = CliRunner().invoke(main, ["export", str(model), "--out", str(model)])
        assert r.exit_code == 2 and "is an input of this command" in r.output and "Traceback" not in r.output
        for out, kw in ((model, {"overwrite": True}), (model / "bundle", {}), (tmp_path, {"overwrite": True})):
            with pytest.raises(SpecPrefetchError, match="an input of this command"):
                export_bundle(model, out, ExportConfig(progress=False), **kw)
        other = tmp_path / "photos"
        other.mkdir()
        (other / "cat.jpg").write_bytes(b"meow")
        with pytest.raises(SpecPrefetchError, match="already exists; pass --overwrite"):
            export_bundle(model, other, ExportConfig(progress=False))
        with pytest.raises(SpecPrefetchError, match="not a specprefetch artifact, not a bundle"):
            export_bundle(model, other, ExportConfig(progress=False), overwrite=True)
        calib = tmp_path / "calib.jsonl"
        calib.write_text('{"text": "hello"}\n')
        with pytest.raises(SpecPrefetchError, match="an input of this command"):
            export_bundle(model, calib, ExportConfig(progress=False, calibration=calib), overwrite=True)
        assert _tree(model) == before and (other / "cat.jpg").read_bytes() == b"meow"
        assert _names(tmp_path) == ["calib.jsonl", "model", "photos"]

    def test_save_adapter_refuses_what_is_not_an_adapter(self, tmp_path, embedded):
        import torch

        from adapters.checkpoint import load_adapter, save_adapter
        from adapters.lowrank import PrefetchAdapter
        from toolkit.models.loader import inspect_model_dir

        spec = inspect_model_dir(embedded)
        g = spec.geometry
        torch.manual_seed(0)
        ad = PrefetchAdapter(num_layers=len(g.moe_layers), hidden_size=g.hidden_size,
                             num_experts=g.routing.num_experts, horizons=(1,), rank=2)
        other = tmp_path / "results"
        other.mkdir()
        (other / "notes.md").write_text("keep me")
        with pytest.raises(SpecPrefetchError, match="already exists; pass --overwrite"):
            save_adapter(ad, other, spec, {})
        with pytest.raises(SpecPrefetchError, match="not an adapter"):
            save_adapter(ad, other, spec, {}, overwrite=True)
        with pytest.raises(SpecPrefetchError, match="an input of this command"):
            save_adapter(ad, spec.path, spec, {}, overwrite=True)  # the model it was trained for
        trace = tmp_path / "trace"
        trace.mkdir()
        with pytest.raises(SpecPrefetchError, match="an input of this command"):
            save_adapter(ad, trace / "ad", spec, {}, inputs=(trace,))
        save_adapter(ad, tmp_path / "ad", spec, {"n": 1})
        save_adapter(ad, tmp_path / "ad", spec, {"n": 2}, overwrite=True)  # an adapter: replaced
        assert load_adapter(tmp_path / "ad", spec)[1]["n"] == 2
        assert (other / "notes.md").read_text() == "keep me"
        assert _names(tmp_path) == ["ad", "results", "trace"]

    def test_build_tiny_replaces_only_a_model_and_leaves_no_stray_shard(self, tmp_path):
        from toolkit.models.tiny import build_tiny

        other = tmp_path / "work"
        other.mkdir()
        (other / "data.csv").write_text("1,2")
        with pytest.raises(SpecPrefetchError, match="already exists; pass --overwrite"):
            build_tiny("mixtral", other)
        with pytest.raises(SpecPrefetchError, match="not a model checkpoint"):
            build_tiny("mixtral", other, overwrite=True)
        assert _names(other) == ["data.csv"]
        m = build_tiny("mixtral", tmp_path / "m")
        (m / "model-00002-of-00002.safetensors").write_bytes(b"stale shard of another checkpoint")
        build_tiny("mixtral", m, seed=2, overwrite=True)
        assert "model-00002-of-00002.safetensors" not in _names(m) and (m / "config.json").exists()
        assert _names(tmp_path) == ["m", "work"]


_REPORT_SCRIPT = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    from toolkit.errors import SpecPrefetchError
    from toolkit.reporting import save_figure, write_report

    def plot(r, path):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
        fig, ax = plt.subplots(figsize=(8, 6))
        ax.imshow(np.random.default_rng(0).random((200, 200)))  # noise: a PNG of some 100 KB
        save_figure(fig, path)

    limit = int(sys.argv[2])
    if limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, write() fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        write_report({"rows": [1, 2, 3]}, Path(sys.argv[1]), lambda r: "| a |\\n|---|\\n| 1 |\\n", plot)
    except SpecPrefetchError as e:
        print("error:", e, file=sys.stderr)
        sys.exit(2)
""")


class TestReportsAllOrNothing:
    """A report's JSON, Markdown and PNG are written all or nothing."""

    def test_a_report_past_the_file_size_limit_leaves_none_of_its_files(self, tmp_path):
        """RLIMIT_FSIZE: the JSON and the Markdown fit, the PNG does not (EFBIG)."""
        script = tmp_path / "report.py"
        script.write_text(_REPORT_SCRIPT)
        out = tmp_path / "out"
        out.mkdir()
        r = subprocess.run([PY, str(script), str(out / "e.json"), "20000"], capture_output=True, text=True,
                           env=_env(tmp_path), timeout=120)
        assert r.returncode == 2, r.stderr
        assert f"file too large (over the file-size limit) while writing {out / 'e.png'}" in r.stderr
        assert "Traceback" not in r.stderr and _names(out) == []
        r = subprocess.run([PY, str(script), str(out / "e.json"), "0"], capture_output=True, text=True,
                           env=_env(tmp_path), timeout=120)
        assert r.returncode == 0, r.stderr
        assert _names(out) == ["e.json", "e.md", "e.png"]

    def test_a_report_on_a_full_disk_leaves_none_of_its_files_and_keeps_the_old_one(self, tmp_path):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np

        from toolkit.reporting import save_figure, write_report

        def plot(r, path):
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.imshow(np.random.default_rng(r["seed"]).random((120, 120)))
            save_figure(fig, path)

        with small_disk(tmp_path / "disk", "64k") as disk:
            with pytest.raises(SpecPrefetchError, match=rf"^disk full while writing {disk / 'e.png'}; no report"):
                write_report({"seed": 0}, disk / "e.json", lambda r: "| x |\n", plot)
            assert _names(disk) == []  # not e.json / e.md beside a failed png
            (disk / "e.json").write_text('{"old": 1}')
            (disk / "e.md").write_text("old")
            with pytest.raises(SpecPrefetchError, match="disk full"):
                write_report({"seed": 1}, disk / "e.json", lambda r: "| x |\n", plot)
            assert _names(disk) == ["e.json", "e.md"] and (disk / "e.md").read_text() == "old"
        (tmp_path / "d.json").mkdir()
        with pytest.raises(SpecPrefetchError, match="d.json: is a directory"):
            write_report({"seed": 0}, tmp_path / "d.json", lambda r: "", plot)


class TestExportOnAFullDisk:
    """export on a full disk is one line and leaves nothing."""

    @pytest.mark.parametrize("size", ["128k", "1m"])  # fails copying the tokenizer / writing the expert store
    def test_export_on_a_full_disk_leaves_nothing(self, tmp_path, embedded, monkeypatch, size):
        import tempfile

        from export.bundle import ExportConfig, export_bundle

        scratch = tmp_path / "tmp"
        scratch.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(scratch))
        with small_disk(tmp_path / "disk", size) as disk:
            with pytest.raises(SpecPrefetchError) as e:
                export_bundle(embedded, disk / "b", ExportConfig(max_seq=32, progress=False))
            msg = str(e.value)
            assert msg.startswith(f"disk full while writing {disk / 'b'}") and "\n" not in msg, msg
            assert ".partial" not in msg  # named as under OUT, not in the vanished work directory
            assert _names(disk) == []  # no OUT, no OUT.partial*, no lock
        assert _names(scratch) == []  # no scratch directory


# -- report outputs (toolkit.artifacts.claim_report) and special files, through the commands that write them --

FAMILY = "qwen3_moe"  # tiny: 4 layers, MoE layers 1..3, 8 experts, top-2
RUN = ["--policy", "on-demand+lru", "--prompt", "hi", "--max-new-tokens", "2", "--max-seq", "16"]
EVAL = ["--predictors", "next-gate,oracle"]
def ok(*args) -> str:
    code, out = cli(*args)
    assert code == 0, out
    return out


def snapshot(*roots: Path) -> dict[str, tuple]:
    """Every file under the roots: bytes (sha256), mtime and mode; a path that is not a regular
    file by its mode alone."""
    out = {}
    for root in roots:
        for p in sorted([root, *root.rglob("*")] if root.is_dir() else [root]):
            st = os.lstat(p)
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None
            out[str(p)] = (digest, st.st_mtime_ns if stat.S_ISREG(st.st_mode) else None, stat.S_IFMT(st.st_mode))
    return out


@pytest.fixture(scope="module")
def art(tiny_models, tmp_path_factory):
    """A private copy of the tiny model, another model, its fp16 store, a small trace, an adapter
    trained on it, and a directory marked as a bundle (only its path is used: refused before work)."""
    from adapters.train import TrainConfig, train_adapter
    from toolkit.models.loader import inspect_model_dir
    from toolkit.runtime.expert_store import build_store
    from toolkit.traces.capture import TraceSettings, run_trace

    d = tmp_path_factory.mktemp("outputs")
    old = os.environ.get("SPECPREFETCH_PROFILES")
    os.environ["SPECPREFETCH_PROFILES"] = str(d / "cache" / "profiles")
    try:
        m = Path(shutil.copytree(tiny_models[FAMILY], d / "model"))
        other = Path(shutil.copytree(tiny_models["olmoe"], d / "other"))
        store = build_store(inspect_model_dir(m), d / "experts.spx", "fp16", progress=False)
        trace = run_trace(m, [HELDOUT], d / "trace", TraceSettings(max_sequences=4, prompt_tokens=8, decode_tokens=3,
                                                                    heldout_frac=0.5, batch=4), progress=False)
        train_adapter(trace, d / "adapter", TrainConfig(steps=2, val_every=1, batch_size=8, rank=2), progress=False)
    finally:
        if old is None:
            os.environ.pop("SPECPREFETCH_PROFILES", None)
        else:
            os.environ["SPECPREFETCH_PROFILES"] = old
    bundle = d / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").write_text(json.dumps({"format": "specprefetch-bundle", "target": "executorch"}))
    return {"M": m, "O": other, "S": store, "T": trace, "A": d / "adapter", "B": bundle}


@pytest.fixture
def outputs_cache(tmp_path_factory, monkeypatch):
    """The caches of the report-output tests (and of the tests that take `art` elsewhere) live in a temporary
    directory."""
    monkeypatch.setenv("SPECPREFETCH_PROFILES", str(tmp_path_factory.getbasetemp() / "outputs-cache" / "profiles"))


def _run(a, *rest):
    return ["run", a["M"], "--store", a["S"], *RUN, *rest]


AT_INPUTS = {
    "run --json MODEL/config.json": (lambda a, t: _run(a, "--json", a["M"] / "config.json"),
                                     "input of this command"),
    "run --json MODEL/new.json": (lambda a, t: _run(a, "--json", a["M"] / "new.json"), "inside"),
    "run --json STORE": (lambda a, t: _run(a, "--json", a["S"]), "input of this command"),
    "run --json OTHER_MODEL/model.safetensors": (
        lambda a, t: _run(a, "--json", a["O"] / "model.safetensors"), "a model checkpoint"),
    "run --events ADAPTER/adapter.json": (
        lambda a, t: _run(a, "--json", t / "r.json", "--events", a["A"] / "adapter.json", "--overwrite"),
        "an adapter"),
    "run --events F --json F": (lambda a, t: _run(a, "--json", t / "f", "--events", t / "f"), "the same file"),
    "eval --json TRACE/manifest.json": (lambda a, t: ["eval", a["T"], "--json", a["T"] / "manifest.json"],
                                        "input of this command"),
    "eval --json ADAPTER/x.json (its .md, .png)": (lambda a, t: ["eval", a["T"], "--json", a["A"] / "x.json"],
                                                   "an adapter"),
    "simulate --json ADAPTER/adapter.json": (
        lambda a, t: ["simulate", a["T"], "--adapter", a["A"], "--policies", "on-demand+lru", "--json",
                      a["A"] / "adapter.json"], "input of this command"),
    "simulate --json STORE": (lambda a, t: ["simulate", a["T"], "--json", a["S"], "--overwrite"], "an expert store"),
    "eviction-bounds --json TRACE/manifest.json": (
        lambda a, t: ["eviction-bounds", a["T"], "--json", a["T"] / "manifest.json", "--overwrite"],
        "input of this command"),
    "bench cpu --json MODEL/config.json": (
        lambda a, t: ["bench", "cpu", a["M"], "--json", a["M"] / "config.json", "--overwrite"],
        "input of this command"),
    "bench reads --json STORE": (
        lambda a, t: ["bench", "reads", a["T"], "--store", a["S"], "--json", a["S"], "--overwrite"],
        "input of this command"),
    "bench gpu --json MODEL/config.json": (
        lambda a, t: ["bench", "gpu", a["M"], "--json", a["M"] / "config.json", "--overwrite"],
        "input of this command"),
    "bench llama.cpp --json BUNDLE/manifest.json": (
        lambda a, t: ["bench", "llama.cpp", a["B"], "--json", a["B"] / "manifest.json", "--overwrite"],
        "input of this command"),
    "runner bench --json BUNDLE/manifest.json": (
        lambda a, t: ["runner", "bench", a["B"], "--json", a["B"] / "manifest.json", "--overwrite"],
        "input of this command"),
    "device bench --json BUNDLE/manifest.json": (
        lambda a, t: ["device", "bench", a["B"], "--pool-mib", "1", "--prompt", "x", "--json",
                      a["B"] / "manifest.json", "--overwrite"], "input of this command"),
    "device list --json TRACE/manifest.json": (
        lambda a, t: ["device", "list", "--json", a["T"] / "manifest.json"], "a trace"),
    "calibrate --out TRACE/manifest.json": (
        lambda a, t: ["calibrate", a["M"], "--store", a["S"], "--out", a["T"] / "manifest.json", "--overwrite"],
        "a trace"),
}


@pytest.fixture
def null_device(tmp_path) -> Path:
    """A character device like /dev/null: made in tmp_path as root (so that a regression renames over
    this node, not over the machine's /dev/null), else /dev/null itself (which nobody else may replace)."""
    if os.geteuid() != 0:
        return Path("/dev/null")
    node = tmp_path / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except OSError as e:
        pytest.skip(f"cannot make a device node here ({e})")
    return node


def _read_fifo(path: Path, got: list) -> threading.Thread:
    def reader():
        with open(path, "rb") as f:
            got.append(f.read())
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    return t


def _release(path: Path, t: threading.Thread) -> None:
    t.join(timeout=60)
    if t.is_alive():  # the command never opened the FIFO: let the reader go
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(timeout=10)


@pytest.mark.usefixtures("outputs_cache")
class TestReportClaims:
    """A report output is never an input, inside another artifact or another output; an existing one is
    replaced only with --overwrite, by its own command."""

    @pytest.mark.parametrize("case", sorted(AT_INPUTS))
    def test_report_outputs_never_replace_an_input_or_another_artifact(self, case, art, tmp_path):
        args, what = AT_INPUTS[case]
        before = snapshot(*(art[k] for k in "MOSTAB"))
        refused(args(art, tmp_path), what)
        assert snapshot(*(art[k] for k in "MOSTAB")) == before
        assert not any(tmp_path.iterdir())  # and nothing else was written

    def test_an_existing_report_is_replaced_only_with_overwrite_and_only_by_its_own_command(self, art, tmp_path):
        r, ev, e = tmp_path / "r.json", tmp_path / "events.log", tmp_path / "e.json"
        ok(*_run(art, "--json", r, "--events", ev))
        assert json.loads(r.read_text())["specprefetch_report"] == "run"
        assert ev.read_text().startswith("# specprefetch-events ")
        before = snapshot(tmp_path)
        refused(_run(art, "--json", r), f"--json {r} already exists", "--overwrite")
        refused(_run(art, "--json", tmp_path / "r2.json", "--events", ev), f"--events {ev} already exists")
        refused(["eval", art["T"], "--json", r, "--overwrite"], "is a `run` report", "only an `eval` report")
        refused(_run(art, "--json", ev, "--overwrite"), "is an events log")
        refused(_run(art, "--json", tmp_path / "r3.json", "--events", r, "--overwrite"), "is a `run` report")
        assert snapshot(tmp_path) == before
        ok(*_run(art, "--json", r, "--events", ev, "--overwrite"))
        assert snapshot(tmp_path)[str(r)][1] != before[str(r)][1]  # replaced
        # a report with its .md and .png: replaced together, by its own command only
        ok("eval", art["T"], *EVAL, "--json", e)
        assert json.loads(e.read_text())["specprefetch_report"] == "eval"
        refused(["eval", art["T"], *EVAL, "--json", e], "already exists")
        ok("eval", art["T"], *EVAL, "--json", e, "--overwrite")
        assert {p.name for p in tmp_path.iterdir()} >= {"e.json", "e.md", "e.png"}
        before = snapshot(tmp_path)
        refused(["simulate", art["T"], "--policies", "on-demand+lru", "--json", e, "--overwrite"],
                "is an `eval` report")
        # a file of the user's, a .md without its report, a report named like its own table
        mine = tmp_path / "mine.json"
        mine.write_text('{"rows": [1, 2]}')
        (tmp_path / "x.md").write_text("my notes")
        before = snapshot(tmp_path)
        refused(_run(art, "--json", mine, "--overwrite"), "not a report written by specprefetch")
        refused(["eval", art["T"], "--json", tmp_path / "x.json"], "x.md exists without its report")
        refused(["eval", art["T"], "--json", tmp_path / "t.md"], "give the report a .json name")
        assert snapshot(tmp_path) == before


@pytest.mark.usefixtures("outputs_cache")
class TestSpecialFiles:
    """A FIFO or a character device is written in place and stays what it is; no atomic writer renames over one."""

    def test_special_files_are_written_in_place_and_stay_what_they_are(self, art, tmp_path, null_device):
        is_chr = lambda p: stat.S_ISCHR(os.stat(p).st_mode)  # noqa: E731
        # /dev/null (or its twin) for --json and --events at once, with no --overwrite
        out = ok(*_run(art, "--json", null_device, "--events", null_device))
        assert f"wrote {null_device}, {null_device}" in out and is_chr(null_device)
        ok("eval", art["T"], *EVAL, "--json", null_device)  # the JSON alone: no null.md / null.png beside it
        assert is_chr(null_device) and not null_device.with_suffix(".md").exists()
        assert not null_device.with_suffix(".png").exists()
        # a FIFO: its reader gets the report; it stays a FIFO
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        for args, kind in ((_run(art, "--json", fifo), "run"), (["eval", art["T"], *EVAL, "--json", fifo], "eval")):
            got: list[bytes] = []
            t = _read_fifo(fifo, got)
            code, text = cli(*args)
            _release(fifo, t)
            assert code == 0, text
            assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
            assert json.loads(got[0])["specprefetch_report"] == kind
        assert {p.name for p in tmp_path.iterdir()} == ({"fifo"} |
                                                       ({"null"} if null_device.parent == tmp_path else set()))
        # a socket (like a block device) is refused, and stays a socket
        s = socket.socket(socket.AF_UNIX)
        try:
            s.bind(str(tmp_path / "sock"))
            refused(_run(art, "--json", tmp_path / "sock"), "is a socket")
            assert stat.S_ISSOCK(os.lstat(tmp_path / "sock").st_mode)
        finally:
            s.close()

    def test_atomic_writers_never_rename_over_a_special_file(self, tmp_path):
        from toolkit.artifacts import write_json_atomic
        from toolkit.errors import SpecPrefetchError

        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        with pytest.raises(SpecPrefetchError, match="is a FIFO, not a regular file"):
            write_json_atomic(fifo, {"a": 1})
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and [p.name for p in tmp_path.iterdir()] == ["fifo"]


_WRITER_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from toolkit.artifacts import atomic_directory, atomic_output_file
    from toolkit.errors import install_signal_handlers, interrupted_message

    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "installed":
        install_signal_handlers()
        install_signal_handlers()  # idempotent
    try:
        if mode == "file":
            with atomic_output_file(out, kind="store", overwrite=False) as tmp:
                tmp.write_bytes(b"SPXSTORE" + b"x" * 100000)
                print("writing", flush=True)
                time.sleep(60)
        else:
            with atomic_directory(out, overwrite=False, kind="bundle") as work:
                (work / "graphs").mkdir()
                (work / "graphs" / "model.pte").write_bytes(b"x" * 100000)
                print("writing", flush=True)
                time.sleep(60)
    except KeyboardInterrupt as e:
        print(interrupted_message(e), file=sys.stderr)
        sys.exit(130)
    print("done")
""")


def _start(args, tmp_path, **kw):
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(tmp_path / "tmp"), **kw)


def _ours(tmpdir: Path) -> list[str]:
    """What export left in TMPDIR (torch keeps its own compile cache there: not ours)."""
    return [n for n in _names(tmpdir) if not n.startswith("torchinductor")]


def _cli(*args) -> list[str]:
    return [PY, "-m", "toolkit.cli", *args]


class TestInterrupts:
    """Ctrl-C and SIGTERM (an interrupt, by the handlers the CLI installs) leave nothing but a resumable OUT.partial,
    and say what was kept."""

    def test_interrupt_message_says_what_was_kept(self, tmp_path):
        with pytest.raises(KeyboardInterrupt) as e:
            with atomic_directory(tmp_path / "b", overwrite=False, kind="bundle"):
                raise KeyboardInterrupt()
        msg = interrupted_message(e.value)
        assert msg == f"interrupted: nothing was written to {tmp_path / 'b'} and no partial work was kept"
        with pytest.raises(KeyboardInterrupt) as e:
            with atomic_directory(tmp_path / "t", overwrite=False, resume=True, kind="trace"):
                raise KeyboardInterrupt()
        assert "was kept and the same command resumes it" in interrupted_message(e.value)
        assert _names(tmp_path) == ["t.partial"]
        with pytest.raises(KeyboardInterrupt) as e:
            with atomic_output_file(tmp_path / "s.spx", kind="store", overwrite=False) as tmp:
                tmp.write_bytes(b"x" * 1000)
                raise KeyboardInterrupt()
        assert "no partial file was kept" in interrupted_message(e.value)
        assert _names(tmp_path) == ["t.partial"]
        assert interrupted_message(KeyboardInterrupt()) == "interrupted: nothing was written under the output name"

    @pytest.mark.parametrize("mode", ["dir", "file", "installed"])
    def test_sigterm_mid_write_leaves_nothing(self, tmp_path, mode):
        (tmp_path / "tmp").mkdir()
        script = tmp_path / "writer.py"
        script.write_text(_WRITER_SCRIPT)
        out = tmp_path / "o" / ("s.spx" if mode == "file" else "b")
        p = _start([PY, str(script), mode, str(out)], tmp_path)
        assert p.stdout.readline().strip() == "writing"
        assert len(_names(out.parent)) == 2  # the work directory (or temporary file) and the lock
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        assert p.returncode == 130, err
        assert err.strip() == f"interrupted: nothing was written to {out} and no partial " + (
            "file was kept" if mode == "file" else "work was kept")
        assert not out.parent.exists() or _names(out.parent) == []

    @pytest.mark.slow
    def test_sigterm_during_export_leaves_nothing(self, tmp_path, embedded):
        (tmp_path / "tmp").mkdir()
        out = tmp_path / "o" / "b"
        p = _start(_cli("export", str(embedded), "--out", str(out), "--max-seq", "32"), tmp_path)
        deadline = time.time() + 300
        lines = []
        while time.time() < deadline:
            line = p.stderr.readline()
            lines.append(line)
            if "lowering" in line or not line:
                break
        assert any("lowering" in x for x in lines), "".join(lines)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
        assert p.returncode in (130, 128 + signal.SIGTERM), err  # the CLI's exit code for an interrupt
        assert "Traceback" not in err and "interrupted" in err
        assert not out.parent.exists()  # made for the bundle, so removed with it
        assert _names(tmp_path) == ["tmp"] and _ours(tmp_path / "tmp") == []  # no scratch directory

    def test_the_cli_installs_the_signal_handlers(self, tiny_models):
        from toolkit import errors

        assert cli("info", tiny_models[FAMILY])[0] == 0
        assert signal.getsignal(signal.SIGTERM) is errors._interrupt


class TestConcurrentWriters:
    """One writer per destination: a second process is refused, one process shares the lock."""

    def test_a_second_writer_of_the_same_out_is_refused(self, tmp_path):
        (tmp_path / "tmp").mkdir()
        script = tmp_path / "writer.py"
        script.write_text(_WRITER_SCRIPT)
        out = tmp_path / "b"
        p = _start([PY, str(script), "dir", str(out)], tmp_path)
        try:
            assert p.stdout.readline().strip() == "writing"
            q = subprocess.run([PY, "-c", textwrap.dedent(f"""
                import sys
                from toolkit.artifacts import atomic_directory
                from toolkit.errors import SpecPrefetchError
                try:
                    with atomic_directory({str(out)!r}, overwrite=False, kind="bundle"):
                        pass
                except SpecPrefetchError as e:
                    print("error:", e, file=sys.stderr)
                    sys.exit(2)
                """)], capture_output=True, text=True, env=_env(tmp_path / "tmp"), timeout=60)
            assert q.returncode == 2
            assert q.stderr.strip() == (f"error: --out {out}: another specprefetch process is writing {out}; "
                                        "wait for it to finish (or stop it) and run again")
            assert p.poll() is None and len([n for n in _names(tmp_path) if n.startswith("b.partial-")]) == 1
        finally:
            p.send_signal(signal.SIGTERM)
            p.communicate(timeout=30)
        assert _names(tmp_path) == ["tmp", "writer.py"]

    def test_the_lock_is_shared_within_a_process_and_removed_after(self, tmp_path):
        d = AtomicDirectory(tmp_path / "t", overwrite=False, resume=True, kind="trace")
        (d.work / "progress.json").write_text("{}")
        # the same process resuming while an earlier writer object is still alive (e.g. held by a traceback)
        d2 = AtomicDirectory(tmp_path / "t", overwrite=False, resume=True, kind="trace")
        assert d2.resumed and d2.work == partial_dir(tmp_path / "t")
        d.release()
        assert lock_path(tmp_path / "t").exists()
        d2.commit()
        assert _names(tmp_path) == ["t"]

    @pytest.mark.slow
    def test_two_exports_to_the_same_out(self, tmp_path):
        """The second is refused in one line while the first runs; the first completes, with progress
        lines for each graph's lowering and for parity."""
        from export.bundle import inspect_bundle
        from toolkit.models.tiny import build_tiny

        (tmp_path / "tmp").mkdir()
        model = build_tiny("mixtral", tmp_path / "m")
        out = tmp_path / "b"
        args = ["--max-seq", "32", "--parity-prompts", "2", "--prompt-tokens", "6", "--decode-tokens", "2"]
        first = _start(_cli("export", str(model), "--out", str(out), *args), tmp_path)
        deadline = time.time() + 300
        while not lock_path(out).exists() and time.time() < deadline and first.poll() is None:
            time.sleep(0.2)
        second = subprocess.run(_cli("export", str(model), "--out", str(out), *args),
                                capture_output=True, text=True, env=_env(tmp_path / "tmp"), timeout=300)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines()[-1] == (
            f"error: --out {out}: another specprefetch process is writing {out}; "
            "wait for it to finish (or stop it) and run again")
        _, err = first.communicate(timeout=600)
        assert first.returncode == 0, err
        assert inspect_bundle(out)["target"] == "executorch"
        for needle in (r"torch\.export 1/(\d+): embed", r"lowering 2/(\d+): layer_0 \(decomposing\)",
                       r"lowering (\d+)/\1: reset \(delegating\)", r"parity 1/2: reference", r"parity 2/2: bundle"):
            assert re.search(needle, err), needle
        assert _names(tmp_path) == ["b", "m", "tmp"] and _ours(tmp_path / "tmp") == []


def test_json_values_refuse_bools_and_non_finite_numbers():
    """toolkit/jsonvalues.py, the one check of integers and numbers read from outside: JSON's true is not
    an int, NaN and infinity are not numbers, and an int too large for a float is still a number (no
    OverflowError out of a loader)."""
    from toolkit.jsonvalues import is_int, is_number

    assert is_int(0) and is_int(-3) and is_int(10**400)
    assert not any(is_int(v) for v in (True, False, 1.0, "1", None))
    assert is_number(0) and is_number(2.5) and is_number(10**400) and is_number(-1e308)
    assert not any(is_number(v) for v in (True, float("nan"), float("inf"), float("-inf"), "1", None, [1]))
