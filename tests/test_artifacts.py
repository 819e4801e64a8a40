"""The one atomic-directory helper behind every OUT.partial -> OUT (traces, adapters, bundles)."""
from __future__ import annotations

import pytest

from toolkit.artifacts import AtomicDirectory, atomic_directory, partial_dir, rejected_dir
from toolkit.errors import SpecPrefetchError


class Refused(Exception):
    pass


def _old(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.txt").write_text("old")
    (out / "adapter.json").write_text('{"format": "specprefetch-adapter"}')  # what artifact_kind knows it by
    return out


def _names(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir())


def test_success_replaces_and_cleans_up(tmp_path):
    out = _old(tmp_path)
    with atomic_directory(out, overwrite=True, kind="adapter") as work:
        # a non-resumable writer's work directory is unique to its process
        # holding only the toolkit's marker (an empty directory; see tests/test_hardening_siblings.py)
        assert work.name.startswith("out.partial-") and [p.name for p in work.iterdir()] == [".specprefetch-work"]
        (work / "b.txt").write_text("new")
        assert (out / "a.txt").read_text() == "old"  # the old one stays until the new one is complete
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]
    assert _names(tmp_path) == ["out"]  # no .partial, no .old, no lock left


def test_new_directory_and_parents(tmp_path):
    out = tmp_path / "x" / "y" / "out"
    with atomic_directory(out, overwrite=False, kind="adapter") as work:
        (work / "f").write_text("1")
    assert (out / "f").read_text() == "1" and _names(out.parent) == ["out"]


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_interrupted_leaves_the_target_untouched(tmp_path, exc):
    out = _old(tmp_path)
    with pytest.raises(exc):
        with atomic_directory(out, overwrite=True, kind="adapter") as work:
            (work / "b.txt").write_text("half")
            raise exc()
    assert sorted(p.name for p in out.iterdir()) == ["a.txt", "adapter.json"] and (out / "a.txt").read_text() == "old"
    assert _names(tmp_path) == ["out"]  # the work directory is removed


def test_leftover_partial_is_replaced(tmp_path):
    out = tmp_path / "out"
    partial_dir(out).mkdir()
    (partial_dir(out) / "stale").write_text("x")
    with atomic_directory(out, overwrite=False, kind="adapter") as work:
        assert not (work / "stale").exists()
    assert not (out / "stale").exists()


def test_refused_result_is_kept_as_rejected_until_a_success(tmp_path):
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


def test_resume_keeps_the_partial_on_failure_and_reuses_it(tmp_path):
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


def test_existing_target_without_overwrite_is_refused_before_any_write(tmp_path):
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


def test_a_commit_interrupted_between_its_renames_is_recovered(tmp_path, monkeypatch):
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
