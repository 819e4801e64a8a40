"""Hardening of the native runner's command line and of the trace's inputs.

- Input files (`--routing` of the binary, `--data` of `specprefetch trace`) must be regular files
  of bounded size: a FIFO, /dev/zero or a directory is refused by name before it is read (it used
  to block for ever, or read /dev/zero until memory ran out).
- An invalid UTF-8 `--prompt` is a refusal naming --prompt, exit 1 (it was an internal error, exit 3).
- `--json` / `--events` are checked before the run (they used to fail only after the whole run):
  a directory, a missing directory, a device, the two options naming one file, an option given
  twice, or one of the bundle's own files is refused with one line naming the option.
- `--min-confidence` and `--floor` are probabilities in [0, 1], as the Python side takes them.

Every binary run here is under a 4 GiB address-space limit and a timeout, so a regression reading
/dev/zero or a FIFO fails the test instead of the machine.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from android_runner.build import command
from conftest import REPO
from toolkit.errors import SpecPrefetchError

ERR = "specprefetch-runner: error: "


def _limits():
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def run_bin(native, *args, bundle=None, timeout=120):
    b, out = native
    argv = [a if isinstance(a, bytes) else str(a) for a in args]
    return subprocess.run([*command(out, "host"), str(bundle or b), *argv], capture_output=True, timeout=timeout,
                          preexec_fn=_limits)


def one_error(r, *parts):
    """The run refused with exit 1 and one `error:` line holding every part; nothing else went wrong."""
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 1, err
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert len(lines) == 1 and lines[0].startswith(ERR), err
    for p in parts:
        assert str(p) in lines[0], err
    assert "internal error" not in err and "terminate" not in err
    return lines[0]


def refused_before_the_run(r, *parts):
    one_error(r, *parts)
    assert b"TTFT" not in r.stderr, r.stderr  # each prompt's summary line: no prompt ran


@pytest.fixture
def fifo(tmp_path):
    """A FIFO nobody writes to: opening it to read blocks for ever. Named as a data file would be."""
    p = tmp_path / "input.jsonl"
    os.mkfifo(p)
    return p


# --- 8: input files must be regular files of bounded size -------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory"])
def test_a_routing_file_that_is_no_regular_file_is_refused(native_host, fifo, tmp_path, kind):
    path = {"fifo": fifo, "dev-zero": Path("/dev/zero"), "directory": tmp_path}[kind]
    r = run_bin(native_host, "--prompt-ids", "1,2,3", "--policy", "oracle+lru", "--routing", path,
                "--no-verify-hashes", timeout=60)
    refused_before_the_run(r, f"--routing {path}", "not a regular file")


def test_a_routing_file_larger_than_the_bound_is_refused(native_host, tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate((256 << 20) + 1)  # sparse: no disk used
    r = run_bin(native_host, "--prompt-ids", "1,2,3", "--policy", "oracle+lru", "--routing", big, "--no-verify-hashes")
    refused_before_the_run(r, f"--routing {big}", "256 MiB")


def _trace_in_a_child(data: str) -> subprocess.CompletedProcess:
    """read_records and run_trace's first check on `data`, in a child under the memory limit."""
    code = ("import sys; from toolkit.errors import SpecPrefetchError; from toolkit.traces.data import read_records, "
            "file_sha256\nfor f in (lambda: read_records([sys.argv[1]], allow_images=False), "
            "lambda: file_sha256(sys.argv[1])):\n    try:\n        f()\n    except SpecPrefetchError as e:\n"
            "        print(e)\n")
    return subprocess.run([sys.executable, "-c", code, data], capture_output=True, text=True, timeout=60,
                          preexec_fn=_limits, cwd=REPO)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_trace_data_that_is_no_regular_file_is_refused(fifo, kind):
    path = str(fifo) if kind == "fifo" else "/dev/zero"
    r = _trace_in_a_child(path)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2, r.stderr
    for ln in lines:
        assert ln.startswith(f"--data {path}: is a ") and ln.endswith(", not a regular file"), lines


def test_trace_data_checks_before_the_model_loads(fifo, tmp_path):
    """run_trace refuses a FIFO before anything else: before the model (here a path that does not
    exist) is looked at, and before the output is claimed."""
    from toolkit.traces.capture import TraceSettings, run_trace

    with pytest.raises(SpecPrefetchError, match=f"--data {fifo}: is a FIFO, not a regular file"):
        run_trace(tmp_path / "no-model", [fifo], tmp_path / "t", TraceSettings(), progress=False)
    assert not (tmp_path / "t").exists()


def test_trace_data_images_must_be_regular_files(fifo, tmp_path):
    from toolkit.traces.data import read_records

    rows = tmp_path / "pairs.jsonl"
    rows.write_text(json.dumps({"text": "a picture", "image": fifo.name}) + "\n")
    with pytest.raises(SpecPrefetchError, match=r"pairs.jsonl:1: image .*input.jsonl: is a FIFO, not a regular file"):
        read_records([rows], allow_images=True)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_cli_trace_refuses_data_that_is_no_regular_file(fifo, kind):
    path = str(fifo) if kind == "fifo" else "/dev/zero"
    exe = Path(sys.executable).parent / "specprefetch"
    r = subprocess.run([str(exe), "trace", "embedded", "--data", path, "--out", str(fifo.parent / "t")],
                       capture_output=True, text=True, timeout=60, preexec_fn=_limits, cwd=REPO)
    assert r.returncode == 2, r.stderr
    assert path in r.stderr and "not a regular file" in r.stderr and "Traceback" not in r.stderr, r.stderr


# --- 9: an invalid UTF-8 prompt ----------------------------------------------------------------------

@pytest.mark.parametrize("text", [b"\xff\xfe", b"caf\xc3", b"ok \xed\xa0\x80 surrogate", b"\xc0\xaf overlong",
                                  b"\xf4\x90\x80\x80 past U+10FFFF"])
def test_an_invalid_utf8_prompt_is_a_refusal(native_host, text):
    r = run_bin(native_host, "--prompt", text, "--no-verify-hashes")
    refused_before_the_run(r, "--prompt", "not valid UTF-8")


# --- 12: the outputs checked before the run ------------------------------------------------------

@pytest.fixture
def linked_bundle(native_host, tmp_path):
    """A copy of the shared bundle made of hard links: an output replacing one of its files (by
    rename) leaves the shared bundle as it was, even if the check regressed."""
    src, dst = native_host[0], tmp_path / "bundle"
    shutil.copytree(src, dst, copy_function=os.link)
    return dst


def test_outputs_of_a_good_run_are_written(native_host, tmp_path):
    js, ev = tmp_path / "out" / "run.json", tmp_path / "out" / "events.log"
    js.parent.mkdir()
    r = run_bin(native_host, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--min-confidence", "1",
                "--floor", "0", "--json", js, "--events", ev, "--no-verify-hashes")
    assert r.returncode == 0, r.stderr
    assert json.loads(js.read_text())["runs"][0]["decode_tokens"] == 1
    assert ev.read_text().startswith("# specprefetch-events") and "min_confidence=1.000" in ev.read_text()
    assert sorted(p.name for p in js.parent.iterdir()) == ["events.log", "run.json"]  # no temp file left


@pytest.mark.parametrize("case", ["json-directory", "events-directory", "missing-directory", "parent-is-a-file",
                                  "fifo", "same-file", "same-file-spelled-twice", "json-twice", "events-twice"])
def test_bad_outputs_are_refused_before_the_run(native_host, tmp_path, monkeypatch, case):
    """(A FIFO stands for every file that is not a regular one: not /dev/null, which a regressed check
    would replace, for the whole machine.)"""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("x")
    os.mkfifo(tmp_path / "pipe")
    f = tmp_path / "run.json"
    args, parts = {
        "json-directory": (["--json", tmp_path], ["--json", "is a directory"]),
        "events-directory": (["--events", tmp_path], ["--events", "is a directory"]),
        "missing-directory": (["--json", tmp_path / "no" / "r.json"], ["--json", "does not exist"]),
        "parent-is-a-file": (["--events", tmp_path / "a.txt" / "e.log"], ["--events", "is not a directory"]),
        "fifo": (["--json", tmp_path / "pipe"], [f"--json {tmp_path / 'pipe'}", "is a FIFO, not a regular file"]),
        "same-file": (["--events", f, "--json", f], ["--events", "the same file as --json"]),
        "same-file-spelled-twice": (["--json", f, "--events", "./run.json"], ["--events ./run.json",
                                                                             "the same file as --json"]),
        "json-twice": (["--json", f, "--json", tmp_path / "b.json"], ["--json: given twice"]),
        "events-twice": (["--events", f, "--events", f], ["--events: given twice"]),
    }[case]
    r = run_bin(native_host, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", *args, "--no-verify-hashes")
    refused_before_the_run(r, *parts)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "pipe"]  # nothing written
    assert (tmp_path / "pipe").is_fifo()


@pytest.mark.parametrize("option, name", [("--json", "manifest.json"), ("--events", "graphs/model.pte"),
                                          ("--json", "experts.spx")])
def test_an_output_over_one_of_the_bundles_files_is_refused(native_host, linked_bundle, option, name):
    target = linked_bundle / name
    before = target.stat()
    r = run_bin(native_host, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", option, target, "--no-verify-hashes",
                bundle=linked_bundle)
    refused_before_the_run(r, f"{option} {target}", f"is the bundle's file '{name}'")
    after = target.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)


def test_an_output_over_the_routing_file_is_refused(native_host, tmp_path):
    routing = tmp_path / "routing.json"
    routing.write_text(json.dumps({"routing": [[[0, 1, 2, 3]]]}))
    r = run_bin(native_host, "--prompt-ids", "1,2,3", "--policy", "oracle+lru", "--routing", routing,
                "--json", routing, "--no-verify-hashes")
    refused_before_the_run(r, f"--json {routing}", "the same file as --routing")


# --- 14: probabilities in [0, 1] ---------------------------------------------------------------------

@pytest.mark.parametrize("option, value", [("--min-confidence", "2"), ("--min-confidence", "-1"),
                                           ("--min-confidence", "1.0000001"), ("--floor", "5"), ("--floor", "-0.5")])
def test_probability_options_out_of_range_are_refused(native_host, option, value):
    r = run_bin(native_host, "--prompt-ids", "1,2,3", option, value, "--no-verify-hashes")
    refused_before_the_run(r, f"{option} {value}: must be a probability in [0, 1]")
