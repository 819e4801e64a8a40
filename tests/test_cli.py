"""The CLI's own behaviour (toolkit/cli.py, cli_params.py, cli_errors.py): every command answers --help
and the console script is installed; a bad option value, an unknown option or command, an output path
of the wrong kind or text that is not UTF-8 is one line (`error: ...`, exit 2, never a traceback),
before any work; any OSError that reaches the CLI is one line naming the path; --overwrite and
--window mean the same on every command; `run` has one JSON shape and prints the generated text; a
SIGTERM exits 128 + the signal and says what the command kept.

Real files and real commands (click's CliRunner, or a subprocess where a fresh process matters). No
test here needs the shared bundle (the CLI's silence about library noise, which runs a bundle too, is
in tests/test_runner.py)."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import HELDOUT
import test_artifacts
from test_artifacts import _run, outputs_cache  # noqa: F401 - outputs_cache: a fixture
from toolkit.cli import main
from cli_helpers import cli, refused
from toolkit.cli_errors import os_error_line

COMMANDS = sorted(main.commands)
FAMILY = "qwen3_moe"  # tiny: 4 layers, MoE layers 1..3, 8 experts, top-2
EXE = Path(sys.executable).parent / "specprefetch"

art = test_artifacts.art  # the fixture (the artifacts the commands refuse), re-exported
@pytest.fixture(scope="module")
def store(tiny_models, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hcli") / "experts.spx"
    assert cli("store", tiny_models[FAMILY], "--out", out)[0] == 0
    return out


BAD_OPTIONS = [
    (["run", "M", "--pool-mib", "nan"], "--pool-mib", "finite"),
    (["run", "M", "--pool-mib", "inf"], "--pool-mib", "finite"),
    (["run", "M", "--pool-mib", "abc"], "--pool-mib", "not a number"),
    (["run", "M", "--pool-mib", ""], "--pool-mib", "not a number"),
    (["run", "M", "--pool-mib", "-5"], "--pool-mib", "above 0"),
    (["run", "M", "--window", "0"], "--window", ">=1"),
    (["run", "M", "--max-new-tokens", "0"], "--max-new-tokens", ">=1"),
    (["run", "M", "--queue-depth", "0"], "--queue-depth", ">=1"),
    (["simulate", "T", "--pool-mib", "nan", "--json", "J"], "--pool-mib", "finite"),
    (["simulate", "T", "--pool-mib", "", "--json", "J"], "--pool-mib", "comma-separated"),
    (["simulate", "T", "--window", "0", "--json", "J"], "--window", ">= 1"),
    (["simulate", "T", "--window", "1,x", "--json", "J"], "--window", "whole numbers"),
    (["train", "T", "--out", "A", "--val-every", "0"], "--val-every", ">=1"),
    (["train", "T", "--out", "A", "--batch-size", "0"], "--batch-size", ">=1"),
    (["train", "T", "--out", "A", "--steps", "0"], "--steps", ">=1"),
    (["train", "T", "--out", "A", "--rank", "-1"], "--rank", ">=1"),
    (["train", "T", "--out", "A", "--lr", "nan"], "--lr", "finite"),
    (["train", "T", "--out", "A", "--topk-weight", "-1"], "--topk-weight", ">= 0"),
    (["trace", "M", "--data", "D", "--out", "O", "--max-sequences", "0"], "--max-sequences", ">=1"),
    (["trace", "M", "--data", "D", "--out", "O", "--prompt-tokens", "0"], "--prompt-tokens", ">=1"),
    (["trace", "M", "--data", "D", "--out", "O", "--heldout-frac", "1"], "--heldout-frac", "<1"),
    (["trace", "M", "--data", "D", "--out", "O", "--shard-tokens", "0"], "--shard-tokens", ">=1"),
    (["eval", "T", "--budget", "0", "--json", "J"], "--budget", ">=1"),
    (["eval", "T", "--draft-bits", "1", "--json", "J"], "--draft-bits", "2<=x<=8"),
    (["export", "M", "--out", "B", "--pool-mib", "nan"], "--pool-mib", "finite"),
    (["export", "M", "--out", "B", "--window", "0"], "--window", "1<=x<=4"),
    (["export", "M", "--out", "B", "--max-seq", "1"], "--max-seq", ">=2"),
    (["export", "M", "--out", "B", "--hub-timeout", "inf"], "--hub-timeout", "finite"),
    (["calibrate", "M", "--reads", "0"], "--reads", ">=1"),
    (["device", "bench", "B", "--pool-mib", "nan", "--prompt", "x", "--json", "J"], "--pool-mib", "finite"),
    (["bogus"], "No such command", "--help"),
    (["run", "M", "--bogus"], "No such option", "--help"),
]


UP_FRONT = [
    (lambda a: _run(a, "--pool-mib", "1e300"), "--pool-mib", "too large"),
    (lambda a: ["simulate", a["T"], "--pool-mib", "4,1e300"], "--pool-mib", "too large"),
    (lambda a: ["device", "bench", a["B"], "--pool-mib", "1e300", "--prompt", "x"], "--pool-mib", "too large"),
    # each bench sub-command has only its own options
    (lambda a: ["bench", "cpu", a["M"], "--pool-fractions", "0.5"], "--pool-fractions", "No such option"),
    (lambda a: ["bench", "cpu", a["M"], "--draft-k", "2"], "--draft-k", "No such option"),
    (lambda a: ["bench", "cpu", a["M"], "--timeout", "5"], "--timeout", "No such option"),
    (lambda a: ["bench", "gpu", a["M"], "--pool-mib", "4"], "--pool-mib", "No such option"),
    (lambda a: ["bench", "llama.cpp", a["B"], "--adapter", a["A"]], "--adapter", "No such option"),
    (lambda a: ["bench", "cpu", a["M"], "--new-tokens", "2"], "--new-tokens 2", "at least 3"),
    (lambda a: ["bench", "gpu", a["M"], "--pool-fractions", "0.5,1.5"], "--pool-fractions", "fractions in (0, 1]"),
    (lambda a: ["bench", "gpu", a["M"], "--draft-k", "0"], "--draft-k", "draft lengths >= 1"),
    (lambda a: ["bench", "gpu", a["M"], "--device", "cpu"], "--device", "expected cuda or cuda:N"),
    (lambda a: ["bench", "llama.cpp", a["B"], "--limits", "5"], "--limits", "not a fraction in (0, 4]"),
    (lambda a: ["bench", "llama.cpp", a["B"], "--threads", "0"], "--threads", "comma-separated positive integers"),
    (lambda a: ["bench", "llama.cpp"], "BUNDLE", "Missing argument"),
    (lambda a: ["runner", "bench", a["B"], "--new-tokens", "2"], "--new-tokens", ">=3"),
]


def _start(args, tmp_path) -> subprocess.Popen:
    return subprocess.Popen([str(EXE), *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            cwd=tmp_path)


def _term_when(p: subprocess.Popen, marker: str, timeout: float = 300) -> str:
    """SIGTERM the process once `marker` shows on its stderr; returns all of its stderr."""
    import select

    fd, err, t0 = p.stderr.fileno(), b"", time.monotonic()
    while marker.encode() not in err:
        assert time.monotonic() - t0 < timeout, err.decode(errors="replace")
        if select.select([fd], [], [], 0.1)[0]:
            chunk = os.read(fd, 1 << 16)
            assert chunk or p.poll() is None, f"exited {p.poll()} before {marker!r}: {err.decode(errors='replace')}"
            err += chunk
    p.send_signal(signal.SIGTERM)
    _, rest = p.communicate(timeout=120)
    return (err + rest).decode(errors="replace")


class TestCommands:
    """Every command is there and answers --help; the console script is installed."""

    def test_commands_present(self):
        assert {"info", "trace", "tiny"} <= set(COMMANDS)

    @pytest.mark.parametrize("cmd", COMMANDS)
    def test_help(self, cmd):
        r = CliRunner().invoke(main, [cmd, "--help"])
        assert r.exit_code == 0 and "Usage:" in r.output

    def test_console_script(self):
        exe = Path(sys.executable).parent / "specprefetch"  # beside the venv's python
        assert exe.exists(), f"{exe} missing (pip install -e . installs it)"
        r = subprocess.run([exe, "--version"], capture_output=True, text=True)
        assert r.returncode == 0 and "specprefetch" in r.stdout

    def test_tiny_command(self, tmp_path):
        r = CliRunner().invoke(main, ["tiny", "olmoe", "--out", str(tmp_path / "m")])
        assert r.exit_code == 0, r.output
        assert (tmp_path / "m" / "model.safetensors").exists()
        r = CliRunner().invoke(main, ["tiny", "llama", "--out", str(tmp_path / "x")])
        assert r.exit_code == 2 and "no tiny config for 'llama'" in r.output


@pytest.mark.usefixtures("outputs_cache")
class TestOptionValues:
    """Option values are checked at the CLI boundary, up front: one line, exit 2, nothing written."""

    @pytest.mark.parametrize("args,option,what", BAD_OPTIONS,
                             ids=[f"{a[0]}{n}{o}" for n, (a, o, _) in enumerate(BAD_OPTIONS)])
    def test_bad_options_are_one_line_errors(self, args, option, what, tmp_path):
        names = {"J": tmp_path / "x.json", "D": HELDOUT}  # D: a real data file, so the option at fault is the one named
        args = [str(names.get(a, tmp_path / a)) if a in ("M", "T", "D", "A", "O", "B", "J") else a for a in args]
        if args[0] == "run":
            args += ["--prompt", "x", "--json", str(tmp_path / "r.json")]
        refused(args, option, what)
        assert not any(tmp_path.iterdir())  # nothing was written

    @pytest.mark.parametrize("n", range(len(UP_FRONT)))
    def test_pool_sizes_and_bench_options_are_checked_up_front(self, n, art, tmp_path):
        args, option, what = UP_FRONT[n]
        args = args(art)
        if "--json" not in args:
            args += ["--json", tmp_path / "r.json"]
        refused(args, option, what)
        assert not any(tmp_path.iterdir())


class TestPathsAndText:
    """An output path of the wrong kind, and text that is not UTF-8, are one-line errors."""

    def test_output_paths_of_the_wrong_kind_are_refused(self, tiny_models, tmp_path):
        m = tiny_models[FAMILY]
        a_file, a_dir = tmp_path / "file", tmp_path / "dir"
        a_file.write_text("x")
        a_dir.mkdir()
        prompt = ["--prompt", "x"]
        # a directory where a file is meant
        refused(["run", m, *prompt, "--json", a_dir], "--json", "is a directory")
        refused(["store", m, "--out", a_dir], "--out", "is a directory")
        refused(["eval", tmp_path, "--json", a_dir], "--json", "is a directory")
        # a file where a directory is meant
        for cmd in (["trace", m, "--data", HELDOUT], ["train", tmp_path], ["export", m], ["tiny", FAMILY]):
            refused([*cmd, "--out", a_file], "--out", "is a file")
        # a file standing where a parent directory should be
        refused(["run", m, *prompt, "--json", a_file / "r.json"], "--json", f"{a_file} is a file, not a directory")
        refused(["store", m, "--out", a_file / "sub" / "s.spx"], "--out", f"{a_file} is a file")
        refused(["trace", m, "--data", HELDOUT, "--out", a_file / "t"], "--out", f"{a_file} is a file")
        assert a_file.read_text() == "x" and not any(a_dir.iterdir())

    def test_non_utf8_prompt_and_data_are_one_line_errors(self, tiny_models, tmp_path):
        m = tiny_models[FAMILY]
        # a prompt of bytes that are not UTF-8 reaches Python as lone surrogates (os.fsdecode)
        refused(["run", m, "--prompt", os.fsdecode(b"caf\xe9"), "--json", tmp_path / "r.json"],
                "--prompt", "not valid UTF-8")
        bad = tmp_path / "latin1.jsonl"
        bad.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
        refused(["trace", m, "--data", bad, "--out", tmp_path / "t"], "--data", str(bad), "not UTF-8", "byte 28")
        refused(["export", m, "--calibration", bad, "--out", tmp_path / "b"], "--calibration", "not UTF-8")
        refused(["trace", m, "--data", tmp_path, "--out", tmp_path / "t"], "--data", "is a directory")
        refused(["runner", "bench", tmp_path, "--prompt", os.fsdecode(b"caf\xe9"), "--json", tmp_path / "r.json"],
                "--prompt", "not valid UTF-8")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["latin1.jsonl"]

    def test_runner_bench_variant_is_checked_first(self, tmp_path):
        """--variant: KEY=VALUE pairs of the scheduler settings it may change, refused in one line naming
        the option before the bundle is opened (here there is none)."""
        from toolkit.runtime.policy import parse_variant, variant_label

        assert parse_variant("queue_depth=2, window=1") == {"queue_depth": 2, "window": 1}
        assert variant_label(parse_variant("window=1,candidate_threshold=0.05")) == \
            "candidate_threshold=0.05,window=1"
        # thresholds that differ past six digits keep their own names
        assert variant_label(parse_variant("min_confidence=0.0200001")) != \
            variant_label(parse_variant("min_confidence=0.02"))
        assert parse_variant("reuse_classes=off") == {"reuse_classes": False}
        assert variant_label(parse_variant("reuse_classes=off,window=1")) == "reuse_classes=off,window=1"
        for bad, why in (("queue_depth=0", "must be an integer"), ("window=x", "must be an integer"),
                         ("reuse_classes=no", "must be off"), ("reuse_classes=on", "must be off"),
                         ("lanes=2", "is not KEY=VALUE"), ("queue_depth", "is not KEY=VALUE"),
                         ("candidate_threshold=1.5", "must be a probability"), ("window=1,window=2", "given twice")):
            refused(["runner", "bench", tmp_path / "none", "--variant", bad, "--json", tmp_path / "r.json"],
                    f"--variant {bad}", why)
        refused(["runner", "bench", tmp_path / "none", "--variant", "window=1,queue_depth=2", "--variant",
                 "queue_depth=2, window=1", "--json", tmp_path / "r.json"], "the same settings as another")
        assert not any(tmp_path.iterdir())

    def test_runner_bench_takes_prompts_or_texts_not_both(self, tmp_path):
        refused(["runner", "bench", tmp_path, "--prompts", "2", "--prompt", "x", "--json", tmp_path / "r.json"],
                "--prompts", "--prompt")
        assert not any(tmp_path.iterdir())


class TestOsErrors:
    """Any OSError that reaches the CLI is one line naming the path."""

    def test_os_errors_name_the_path(self, tmp_path):
        """The CLI's last line of defence: any OSError becomes `PATH: what`, from real system calls."""
        d, f = tmp_path / "d", tmp_path / "f"
        d.mkdir()
        f.write_text("x")
        cases = [(lambda: open(d, "w"), errno.EISDIR, "is a directory"),
                 (lambda: os.mkdir(f / "sub"), errno.ENOTDIR, "is not a directory"),
                 (lambda: open(tmp_path / "missing" / "x"), errno.ENOENT, "no such file"),
                 (lambda: os.mkdir(d), errno.EEXIST, "already exists"),
                 (lambda: os.rmdir(tmp_path), errno.ENOTEMPTY, "not empty")]
        for call, code, what in cases:
            with pytest.raises(OSError) as e:
                call()
            assert e.value.errno == code
            line = os_error_line(e.value)
            assert what in line and str(e.value.filename) in line and "\n" not in line
        full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "big.bin"))
        assert os_error_line(full) == f"{tmp_path / 'big.bin'}: no space left on device (disk full)"


class TestSharedOptions:
    """--overwrite on every command that writes, passed through; --window in one unit everywhere."""

    def test_overwrite_is_required_and_passed_through(self, tiny_models, tmp_path):
        m = tiny_models[FAMILY]
        out = tmp_path / "s.spx"
        assert cli("store", m, "--out", out)[0] == 0
        refused(["store", m, "--out", out], "--out", "already exists", "--overwrite")
        assert cli("store", m, "--out", out, "--overwrite")[0] == 0
        t = tmp_path / "t"
        assert cli("tiny", "olmoe", "--out", t)[0] == 0
        refused(["tiny", "olmoe", "--out", t], "already exists")
        assert cli("tiny", "olmoe", "--out", t, "--overwrite")[0] == 0
        refused(["export", m, "--out", m, "--overwrite"], "input of this command")  # never the source model
        refused(["store", m, "--out", m / "model.safetensors", "--overwrite"], "--out")
        for cmd in ("train", "export", "store", "tiny", "trace", "eval", "simulate", "eviction-bounds", "run",
                    "bench cpu", "bench gpu", "bench llama.cpp", "bench reads", "calibrate",
                    "runner bench", "runner build", "device bench", "device list"):  # every command that writes
            assert "--overwrite" in CliRunner().invoke(main, [*cmd.split(), "--help"]).output, cmd

    def test_window_means_one_unit_everywhere(self):
        for cmd in ("run", "simulate", "bench cpu", "bench gpu", "export"):
            text = " ".join(CliRunner().invoke(main, [*cmd.split(), "--help"]).output.split())
            assert "MoE layers planned ahead" in text and "steps ahead" not in text, cmd


class TestRunOutput:
    """`run` writes one JSON shape for one prompt or several, and prints the generated text."""

    def test_run_json_has_one_shape_and_the_text_is_printed(self, tiny_models, store, tmp_path):
        from transformers import AutoTokenizer

        m = tiny_models[FAMILY]
        tok = AutoTokenizer.from_pretrained(m)
        base = ["run", m, "--store", store, "--policy", "on-demand+lru", "--max-new-tokens", "3", "--max-seq", "160"]
        long_prompt = " ".join(["kernel"] * 80)
        for prompts in (["The kernel"], ["The kernel", long_prompt]):
            out = tmp_path / f"r{len(prompts)}.json"
            r = CliRunner().invoke(main, [str(a) for a in base] + [a for p in prompts for a in ("--prompt", p)]
                                   + ["--json", str(out)])
            assert r.exit_code == 0, r.output
            d = json.loads(out.read_text())
            assert set(d) == {"specprefetch_report", "policy", "runs", "peak_rss_bytes"} and \
                d["policy"] == "on-demand+lru"
            assert d["specprefetch_report"] == "run"  # the marker --overwrite knows a run report by
            assert [x["prompt"] for x in d["runs"]] == prompts
            for x in d["runs"]:
                assert x["text"] == tok.decode(x["tokens"], skip_special_tokens=False) and len(x["tokens"]) >= 1
                assert f"{json.dumps(x['prompt'])} -> {json.dumps(x['text'], ensure_ascii=False)}" in r.stdout
            # a progress bar on stderr for the prefill of a prompt over 64 tokens only
            assert ("prefill" in r.stderr) == (len(prompts) == 2), r.stderr


class TestInterrupts:
    """In a fresh process: SIGTERM exits 128 + the signal with one line saying what the command kept."""

    @pytest.mark.slow
    def test_sigterm_says_what_each_command_keeps(self, tiny_models, tmp_path):
        m = tiny_models[FAMILY]
        tr = tmp_path / "tr"
        p = _start(["trace", m, "--data", HELDOUT, "--out", tr, "--max-sequences", "400", "--prompt-tokens", "16",
                    "--decode-tokens", "4", "--shard-tokens", "64"], tmp_path)
        err = _term_when(p, "trace:  ")
        line = [ln for ln in err.replace("\r", "\n").splitlines() if ln.startswith("interrupted")]
        assert p.returncode == 128 + signal.SIGTERM and len(line) == 1 and "Traceback" not in err, err
        assert not tr.exists() and (tmp_path / "tr.partial").is_dir() and "resumes" in line[0], line
        # train keeps nothing, and says so
        small = tmp_path / "small"
        assert cli("trace", m, "--data", HELDOUT, "--out", small, "--max-sequences", "16", "--prompt-tokens", "16",
                   "--decode-tokens", "4", "--heldout-frac", "0.25")[0] == 0
        ad = tmp_path / "ad"
        p = _start(["train", small, "--out", ad, "--steps", "100000", "--val-every", "100000", "--batch-size", "8",
                    "--rank", "2"], tmp_path)
        err = _term_when(p, "train adapter:  ")
        line = [ln for ln in err.replace("\r", "\n").splitlines() if ln.startswith("interrupted")]
        assert p.returncode == 128 + signal.SIGTERM and len(line) == 1 and "Traceback" not in err, err
        assert "resume" not in line[0] and str(ad) in line[0], line
        assert [x.name for x in tmp_path.iterdir() if x.name.startswith(("ad", ".ad"))] == []  # nothing left
