"""The native runner's command line (android_runner/src/main.cpp): its options and input files are
checked before the run, each refusal one line naming the option.

- The `--routing` file must be a regular file of bounded size: a FIFO, /dev/zero or a directory is
  refused by name before it is read (it used to block for ever, or read /dev/zero until memory ran
  out). (`specprefetch trace --data` follows the same rule: tests/test_trace.py.)
- An invalid UTF-8 `--prompt` is a refusal naming --prompt, exit 1 (it was an internal error, exit 3).
- `--json` / `--events` are checked before the run (they used to fail only after the whole run):
  a directory, a missing directory, a device, the two options naming one file, an option given
  twice, or one of the bundle's own files is refused with one line naming the option.
- `--min-confidence` and `--candidate-threshold` are probabilities in [0, 1], as the Python side takes them.

Every binary run here is under a 4 GiB address-space limit and a timeout, so a regression reading
/dev/zero or a FIFO fails the test instead of the machine. Every test runs the session's host runner
(the shared bundle: this module runs late).
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
from pathlib import Path

import pytest

from android_runner.build import command

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


@pytest.fixture
def linked_bundle(native_host, tmp_path):
    """A copy of the shared bundle made of hard links: an output replacing one of its files (by
    rename) leaves the shared bundle as it was, even if the check regressed."""
    src, dst = native_host[0], tmp_path / "bundle"
    shutil.copytree(src, dst, copy_function=os.link)
    return dst


class TestRoutingFile:
    """The --routing file must be a regular file of at most 256 MiB."""

    @pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory"])
    def test_a_routing_file_that_is_no_regular_file_is_refused(self, native_host, fifo, tmp_path, kind):
        path = {"fifo": fifo, "dev-zero": Path("/dev/zero"), "directory": tmp_path}[kind]
        r = run_bin(native_host, "--prompt-ids", "1,2,3", "--policy", "oracle+lru", "--routing", path,
                    "--no-verify-hashes", timeout=60)
        refused_before_the_run(r, f"--routing {path}", "not a regular file")

    def test_a_routing_file_larger_than_the_bound_is_refused(self, native_host, tmp_path):
        big = tmp_path / "big.json"
        with open(big, "wb") as f:
            f.truncate((256 << 20) + 1)  # sparse: no disk used
        r = run_bin(native_host, "--prompt-ids", "1,2,3", "--policy", "oracle+lru", "--routing", big,
                    "--no-verify-hashes")
        refused_before_the_run(r, f"--routing {big}", "256 MiB")


class TestInvalidUtf8Prompt:
    """A --prompt that is not well-formed UTF-8 is a refusal, exit 1."""

    @pytest.mark.parametrize("text", [b"\xff\xfe", b"caf\xc3", b"ok \xed\xa0\x80 surrogate", b"\xc0\xaf overlong",
                                      b"\xf4\x90\x80\x80 past U+10FFFF"])
    def test_an_invalid_utf8_prompt_is_a_refusal(self, native_host, text):
        r = run_bin(native_host, "--prompt", text, "--no-verify-hashes")
        refused_before_the_run(r, "--prompt", "not valid UTF-8")


class TestOutputsCheckedBeforeTheRun:
    """--json and --events are checked before the run, each refusal naming the option."""

    def test_outputs_of_a_good_run_are_written(self, native_host, tmp_path):
        js, ev = tmp_path / "out" / "run.json", tmp_path / "out" / "events.log"
        js.parent.mkdir()
        r = run_bin(native_host, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--min-confidence", "1",
                    "--candidate-threshold", "0", "--json", js, "--events", ev, "--no-verify-hashes")
        assert r.returncode == 0, r.stderr
        assert json.loads(js.read_text())["runs"][0]["decode_tokens"] == 1
        assert ev.read_text().startswith("# specprefetch-events") and "min_confidence=1.000" in ev.read_text()
        assert sorted(p.name for p in js.parent.iterdir()) == ["events.log", "run.json"]  # no temp file left

    @pytest.mark.parametrize("case", ["json-directory", "events-directory", "missing-directory", "parent-is-a-file",
                                      "fifo", "same-file", "same-file-spelled-twice", "json-twice", "events-twice"])
    def test_bad_outputs_are_refused_before_the_run(self, native_host, tmp_path, monkeypatch, case):
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
    def test_an_output_over_one_of_the_bundles_files_is_refused(self, native_host, linked_bundle, option, name):
        target = linked_bundle / name
        before = target.stat()
        r = run_bin(native_host, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", option, target, "--no-verify-hashes",
                    bundle=linked_bundle)
        refused_before_the_run(r, f"{option} {target}", f"is the bundle's file '{name}'")
        after = target.stat()
        assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)

    def test_an_output_over_the_routing_file_is_refused(self, native_host, tmp_path):
        routing = tmp_path / "routing.json"
        routing.write_text(json.dumps({"routing": [[[0, 1, 2, 3]]]}))
        r = run_bin(native_host, "--prompt-ids", "1,2,3", "--policy", "oracle+lru", "--routing", routing,
                    "--json", routing, "--no-verify-hashes")
        refused_before_the_run(r, f"--json {routing}", "the same file as --routing")


class TestProbabilityOptions:
    """--min-confidence and --candidate-threshold are probabilities in [0, 1]."""

    @pytest.mark.parametrize("option, value", [("--min-confidence", "2"), ("--min-confidence", "-1"),
                                               ("--min-confidence", "1.0000001"), ("--candidate-threshold", "5"),
                                               ("--candidate-threshold", "-0.5")])
    def test_probability_options_out_of_range_are_refused(self, native_host, option, value):
        r = run_bin(native_host, "--prompt-ids", "1,2,3", option, value, "--no-verify-hashes")
        refused_before_the_run(r, f"{option} {value}: must be a probability in [0, 1]")
