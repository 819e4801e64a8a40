"""The atomic writers touch a sibling of OUT (OUT.old, OUT.partial, OUT.partial-PID-XXXXXXXX,
OUT.rejected) only if the toolkit made it (it holds the marker directory `.specprefetch-work`).

A user's own directory under one of those names survives byte for byte: the writer either proceeds
without touching it, or, where it needs that name, refuses with one line naming it. The marker
never ends up in a committed OUT.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from toolkit.artifacts import AtomicDirectory, atomic_directory, lock_path, partial_dir, rejected_dir
from toolkit.errors import SpecPrefetchError
from toolkit.traces.format import TraceWriter

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


# -- OUT.old ------------------------------------------------------------------------------------

def test_a_users_out_old_is_not_renamed_to_out(tmp_path):
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


def test_replacing_out_refuses_a_users_out_old_and_deletes_nothing(tmp_path):
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


def test_the_toolkits_own_out_old_is_still_recovered_and_cleaned(tmp_path, monkeypatch):
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


# -- OUT.partial and OUT.partial-PID-XXXXXXXX -------------------------------------------------

def test_a_non_resuming_writer_leaves_a_users_partial_dirs_alone(tmp_path):
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


def test_a_resuming_writer_refuses_a_users_partial(tmp_path):
    out = tmp_path / "t"
    before = _users(partial_dir(out))
    for overwrite in (False, True):
        with pytest.raises(SpecPrefetchError) as e:
            AtomicDirectory(out, overwrite=overwrite, resume=True, kind="trace")
        _one_line(e, partial_dir(out))
        assert _tree(partial_dir(out)) == before and _names(tmp_path) == ["t.partial"]


HEADER = {"model": {"path": "m"}, "data": {"files": []}, "settings": {"sequences": 8, "batch": 1}}


def test_trace_writer_refuses_a_users_partial_and_resumes_its_own(tmp_path):
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


# -- OUT.rejected -----------------------------------------------------------------------------

def test_a_users_out_rejected_is_never_removed(tmp_path):
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


def test_the_toolkits_own_out_rejected_is_replaced_and_cleaned(tmp_path):
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
