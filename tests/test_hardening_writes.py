"""Issue 13, the writers: never replace what is not ours, leave nothing behind on a full disk or an
interrupt, refuse a second writer of the same output, and show progress during export.

Full disks are real (a small tmpfs, or RLIMIT_FSIZE in a subprocess), signals are real (SIGTERM
sent to a subprocess), and concurrent writers are two real processes.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from toolkit.artifacts import (AtomicDirectory, artifact_kind, atomic_directory, atomic_output_file,
                               claim_output, lock_path, partial_dir)
from toolkit.errors import SpecPrefetchError, interrupted_message

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def _tree(p: Path) -> dict[str, str]:
    """Every file under p with its content hash (and every directory): to show nothing changed."""
    out = {}
    for f in sorted(p.rglob("*")):
        rel = str(f.relative_to(p))
        out[rel] = hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else "dir"
    return out


def _names(p: Path) -> list[str]:
    return sorted(x.name for x in p.iterdir())


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


# -- what an existing path is -------------------------------------------------------------------

def test_artifact_kind_knows_each_artifact_by_its_own_marker(tmp_path, embedded):
    import torch

    from adapters.checkpoint import FORMAT as ADAPTER_FORMAT, save_adapter
    from adapters.lowrank import PrefetchAdapter
    from export.manifest import FORMAT as BUNDLE_FORMAT
    from toolkit.artifacts import ADAPTER_FORMAT as A, BUNDLE_FORMAT as B, STORE_MAGIC, TRACE_FORMAT as T
    from toolkit.models.loader import inspect_model_dir
    from toolkit.runtime.expert_store import MAGIC
    from toolkit.traces.format import FORMAT as TRACE_FORMAT

    assert (A, B, T, STORE_MAGIC) == (ADAPTER_FORMAT, BUNDLE_FORMAT, TRACE_FORMAT, MAGIC)
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


def test_claim_output_rule(tmp_path):
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
    with pytest.raises(SpecPrefetchError, match="is a directory that is not a specprefetch artifact, not an adapter"):
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


def test_a_refused_directory_writer_creates_nothing(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(SpecPrefetchError, match="input"):
        with atomic_directory(tmp_path / "m" / "a" / "b", overwrite=False, kind="bundle", inputs=(tmp_path / "m",)):
            pass
    assert _names(tmp_path / "m") == ["config.json"]
    # a work directory left by a killed process (unique name, the toolkit's marker) is removed by the next
    # writer (one without the marker is left alone: tests/test_hardening_siblings.py)
    (tmp_path / "out.partial-999999-deadbeef" / ".specprefetch-work").mkdir(parents=True)
    with atomic_directory(tmp_path / "out", overwrite=False, kind="bundle") as work:
        (work / "x").write_text("1")
    assert _names(tmp_path) == ["m", "out"]


def test_interrupt_message_says_what_was_kept(tmp_path):
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


def test_atomic_output_file_claims_locks_and_renames(tmp_path):
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


# -- export, adapters, tiny: refuse, never destroy --------------------------------------------

def test_export_model_onto_itself_is_refused_and_the_model_untouched(tmp_path, embedded):
    from export.bundle import ExportConfig, export_bundle
    from toolkit.cli import main

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


def test_save_adapter_refuses_what_is_not_an_adapter(tmp_path, embedded):
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


def test_build_tiny_replaces_only_a_model_and_leaves_no_stray_shard(tmp_path):
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


# -- reports: all or nothing ----------------------------------------------------------------

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


def test_a_report_past_the_file_size_limit_leaves_none_of_its_files(tmp_path):
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


def test_a_report_on_a_full_disk_leaves_none_of_its_files_and_keeps_the_old_one(tmp_path):
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


# -- export on a full disk: one line, nothing left -------------------------------------------

@pytest.mark.parametrize("size", ["128k", "1m"])  # fails copying the tokenizer / writing the expert store
def test_export_on_a_full_disk_leaves_nothing(tmp_path, embedded, monkeypatch, size):
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


# -- signals: SIGTERM cleans up like Ctrl-C --------------------------------------------------

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


@pytest.mark.parametrize("mode", ["dir", "file", "installed"])
def test_sigterm_mid_write_leaves_nothing(tmp_path, mode):
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


# -- concurrency: one writer per destination -----------------------------------------------------

def test_a_second_writer_of_the_same_out_is_refused(tmp_path):
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


def test_the_lock_is_shared_within_a_process_and_removed_after(tmp_path):
    d = AtomicDirectory(tmp_path / "t", overwrite=False, resume=True, kind="trace")
    (d.work / "progress.json").write_text("{}")
    # the same process resuming while an earlier writer object is still alive (e.g. held by a traceback)
    d2 = AtomicDirectory(tmp_path / "t", overwrite=False, resume=True, kind="trace")
    assert d2.resumed and d2.work == partial_dir(tmp_path / "t")
    d.release()
    assert lock_path(tmp_path / "t").exists()
    d2.commit()
    assert _names(tmp_path) == ["t"]


# -- real exports (slow): SIGTERM, two at once, progress --------------------------------------

def _ours(tmpdir: Path) -> list[str]:
    """What export left in TMPDIR (torch keeps its own compile cache there: not ours)."""
    return [n for n in _names(tmpdir) if not n.startswith("torchinductor")]


def _cli(*args) -> list[str]:
    return [PY, "-m", "toolkit.cli", *args]


@pytest.mark.slow
def test_sigterm_during_export_leaves_nothing(tmp_path, embedded):
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


@pytest.mark.slow
def test_two_exports_to_the_same_out(tmp_path):
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
    for needle in ("torch.export 1/6: embed", "lowering 2/6: layer_0 (decomposing)",
                   "lowering 6/6: reset (delegating)", "parity 1/2: reference", "parity 2/2: bundle"):
        assert needle in err, needle
    assert _names(tmp_path) == ["b", "m", "tmp"] and _ours(tmp_path / "tmp") == []
