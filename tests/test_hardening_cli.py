"""Issue 13, the CLI's side: one-line errors (never a traceback) for bad options, bad inputs and OS
errors; `info` and `inspect` refuse what is not valid; truncated safetensors are named; undefined
metrics print n/a; `run` has one JSON shape and prints the generated text; interrupts say what is
true; library noise is silenced. Real files and real commands (click's CliRunner, or a subprocess
where a fresh process matters)."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import HELDOUT
from toolkit.cli import main
from toolkit.cli_errors import os_error_line

FAMILY = "qwen3_moe"  # tiny: 4 layers, MoE layers 1..3, 8 experts, top-2
EXE = Path(sys.executable).parent / "specprefetch"


def cli(*args) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise AssertionError(f"traceback: {r.exception!r}\n{r.output}")
    return r.exit_code, r.output


def refused(args, *fragments) -> str:
    """The command exits 2 with one `error: ...` line holding every fragment, and no traceback."""
    code, out = cli(*args)
    lines = [ln for ln in out.replace("\r", "\n").splitlines() if ln.startswith("error: ")]
    assert code == 2, out
    assert len(lines) == 1 and "Traceback" not in out, out
    for f in fragments:
        assert str(f) in lines[0], (f, lines[0])
    return lines[0]


@pytest.fixture()
def model(tiny_models, tmp_path) -> Path:
    """A private copy of the tiny model (tests damage it)."""
    return Path(shutil.copytree(tiny_models[FAMILY], tmp_path / "model"))


@pytest.fixture(scope="module")
def store(tiny_models, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hcli") / "experts.spx"
    assert cli("store", tiny_models[FAMILY], "--out", out)[0] == 0
    return out


# -- options are checked at the CLI boundary: one line, exit 2, before any work ---------------------

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


@pytest.mark.parametrize("args,option,what", BAD_OPTIONS,
                         ids=[f"{a[0]}{n}{o}" for n, (a, o, _) in enumerate(BAD_OPTIONS)])
def test_bad_options_are_one_line_errors(args, option, what, tmp_path):
    names = {"J": tmp_path / "x.json", "D": HELDOUT}  # D: a real data file, so the option at fault is the one named
    args = [str(names.get(a, tmp_path / a)) if a in ("M", "T", "D", "A", "O", "B", "J") else a for a in args]
    if args[0] == "run":
        args += ["--prompt", "x", "--json", str(tmp_path / "r.json")]
    refused(args, option, what)
    assert not any(tmp_path.iterdir())  # nothing was written


def test_output_paths_of_the_wrong_kind_are_refused(tiny_models, tmp_path):
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


def test_non_utf8_prompt_and_data_are_one_line_errors(tiny_models, tmp_path):
    m = tiny_models[FAMILY]
    # a prompt of bytes that are not UTF-8 reaches Python as lone surrogates (os.fsdecode)
    refused(["run", m, "--prompt", os.fsdecode(b"caf\xe9"), "--json", tmp_path / "r.json"],
            "--prompt", "not valid UTF-8")
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    refused(["trace", m, "--data", bad, "--out", tmp_path / "t"], "--data", str(bad), "not UTF-8", "byte 28")
    refused(["export", m, "--calibration", bad, "--out", tmp_path / "b"], "--calibration", "not UTF-8")
    refused(["trace", m, "--data", tmp_path, "--out", tmp_path / "t"], "--data", "is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latin1.jsonl"]


def test_os_errors_name_the_path(tmp_path):
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


# -- truncated or corrupt safetensors: named by every command that opens the model ------------------

def _truncate(model: Path, how: str) -> Path:
    f = model / "model.safetensors"
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    if how == "half":
        f.write_bytes(data[: len(data) // 2])
    elif how == "one-byte-short":
        f.write_bytes(data[:-1])
    elif how == "header-only":
        f.write_bytes(data[: 8 + n])
    elif how == "no-header":
        f.write_bytes(data[:5])
    elif how == "bad-offsets":  # a tensor's byte range that does not match its shape
        head = json.loads(data[8:8 + n])
        name = next(k for k in head if k != "__metadata__")
        head[name]["data_offsets"][1] += 2
        raw = json.dumps(head, separators=(",", ":")).encode().ljust(n)
        assert len(raw) == n
        f.write_bytes(data[:8] + raw + data[8 + n:])
    return f


SHARD_COMMANDS = {
    "info": lambda m, t: ["info", m],
    "store": lambda m, t: ["store", m, "--out", t / "s.spx"],
    "export": lambda m, t: ["export", m, "--out", t / "b"],
    "run": lambda m, t: ["run", m, "--policy", "on-demand+lru", "--prompt", "x", "--json", t / "r.json"],
    "trace": lambda m, t: ["trace", m, "--data", HELDOUT, "--out", t / "tr"],
}


@pytest.mark.parametrize("command", sorted(SHARD_COMMANDS))
def test_a_truncated_shard_is_named_by_every_command(command, model, tmp_path):
    f = _truncate(model, "half")
    line = refused(SHARD_COMMANDS[command](model, tmp_path), str(f), "truncated safetensors file")
    assert "its header describes" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # nothing written, no leftovers


@pytest.mark.parametrize("how,what", [("one-byte-short", "truncated"), ("header-only", "truncated"),
                                      ("no-header", "truncated"), ("bad-offsets", "corrupt safetensors header")])
def test_damaged_shards_are_named(how, what, model):
    f = _truncate(model, how)
    refused(["info", model], str(f), what)


def test_a_sharded_index_is_checked_shard_by_shard(model):
    """An index naming a tensor its shard does not hold, or a shard outside the model, is named."""
    weights = model / "model.safetensors"
    shard = model / "model-00001-of-00001.safetensors"
    weights.rename(shard)
    head_len = int.from_bytes(shard.read_bytes()[:8], "little")
    names = [k for k in json.loads(shard.read_bytes()[8:8 + head_len]) if k != "__metadata__"]
    index = model / "model.safetensors.index.json"
    wm = {k: shard.name for k in names}
    index.write_text(json.dumps({"weight_map": {**wm, "ghost.weight": shard.name}}))
    refused(["info", model], str(index), "'ghost.weight' is not in its shard")
    index.write_text(json.dumps({"weight_map": {**wm, names[0]: "../elsewhere.safetensors"}}))
    refused(["info", model], str(index), "is not a file inside")
    index.write_text(json.dumps({"weight_map": wm}))
    assert cli("info", model)[0] == 0
    shard.write_bytes(shard.read_bytes()[:-3])
    refused(["info", model], str(shard), "truncated")


# -- info: a config that does not describe the model ------------------------------------------------

@pytest.mark.parametrize("family,key", [("qwen3_moe", "num_local_experts"), ("qwen3_moe", "moe_intermediate_size"),
                                        ("qwen3_moe", "hidden_size"), ("qwen3_moe", "num_experts_per_tok"),
                                        ("mixtral", "intermediate_size"), ("deepseek_v3", "n_routed_experts"),
                                        ("olmoe", "num_experts"), ("qwen3_vl_moe", "text_config.num_hidden_layers"),
                                        ("gpt_oss", "vocab_size")])
def test_info_refuses_a_config_missing_a_size(family, key, tiny_models, tmp_path):
    cfg = json.loads((tiny_models[family] / "config.json").read_text())
    parent, _, leaf = key.rpartition(".")
    (cfg[parent] if parent else cfg).pop(leaf)
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # config only: sizes would come from the config
    refused(["info", tmp_path], str(tmp_path / "config.json"), f"missing required key '{key}'")


@pytest.mark.parametrize("edit,what", [({"num_local_experts": 16}, "describes expert tensor"),
                                       ({"moe_intermediate_size": 40}, "does not describe the checkpoint's experts"),
                                       ({"hidden_size": 0}, "hidden_size is 0")])
def test_info_refuses_a_config_that_does_not_match_the_weights(edit, what, model):
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, **edit}))
    refused(["info", model], str(model / "config.json"), what)


# -- inspect: a bundle is valid only with sane runtime values and its manifest inside it ------------

def _bundle_copy(src: Path, dst: Path) -> Path:
    """A hard-linked copy of a shared bundle whose manifest.json is its own file (edited below)."""
    shutil.copytree(src, dst, copy_function=os.link)
    (dst / "manifest.json").unlink()
    shutil.copyfile(src / "manifest.json", dst / "manifest.json")
    return dst


def _set(path: str, value):
    def edit(m):
        *keys, last = path.split(".")
        for k in keys:
            m = m[k]
        m[last] = value
    return edit


INSPECT_EDITS = [
    ("runtime.pool_mib", -5, "runtime.pool_mib is -5"),
    ("runtime.pool_mib", 0, "runtime.pool_mib is 0"),
    ("runtime.pool_mib", "8", "runtime.pool_mib is '8'"),
    ("runtime.scheduler.window", 0, "runtime.scheduler.window is 0"),
    ("runtime.scheduler.window", 99, "runtime.scheduler.window is 99"),
    ("runtime.scheduler.queue_depth", -1, "runtime.scheduler.queue_depth is -1"),
    ("runtime.scheduler.min_confidence", 1.5, "runtime.scheduler.min_confidence is 1.5"),
    ("runtime.scheduler.prefetch", "yes", "runtime.scheduler.prefetch is 'yes'"),
    ("kv.max_seq", 0, "kv.max_seq is 0"),
    ("target", "tpu", "target 'tpu' is not a target this toolkit knows"),
    ("target", None, "target None is not a target"),
    ("runtime", [], "field 'runtime' must be a JSON object"),
]


@pytest.mark.parametrize("path,value,what", INSPECT_EDITS, ids=[f"{p}={v!r}" for p, v, _ in INSPECT_EDITS])
def test_inspect_refuses_out_of_range_manifest_values(path, value, what, embedded_bundles, tmp_path):
    b = _bundle_copy(embedded_bundles["executorch"], tmp_path / "b")
    m = json.loads((b / "manifest.json").read_text())
    _set(path, value)(m)
    (b / "manifest.json").write_text(json.dumps(m))
    refused(["inspect", b], str(b / "manifest.json"), what)


def test_inspect_refuses_a_manifest_or_file_outside_the_bundle(embedded_bundles, tmp_path):
    src = embedded_bundles["executorch"]
    b = _bundle_copy(src, tmp_path / "b")
    assert cli("inspect", b)[0] == 0
    outside = tmp_path / "elsewhere.json"
    shutil.copyfile(b / "manifest.json", outside)
    (b / "manifest.json").unlink()
    (b / "manifest.json").symlink_to(outside)
    refused(["inspect", b], str(b / "manifest.json"), "symbolic link")
    (b / "manifest.json").unlink()
    shutil.copyfile(outside, b / "manifest.json")
    (b / "parity.md").unlink()
    (b / "parity.md").symlink_to(src / "parity.md")  # the same bytes, but outside this bundle
    refused(["inspect", b], "parity.md", "resolves outside the bundle")


# -- run: one JSON shape, the generated text, a prefill progress bar --------------------------------

def test_run_json_has_one_shape_and_the_text_is_printed(tiny_models, store, tmp_path):
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
        assert set(d) == {"specprefetch_report", "policy", "runs", "peak_rss_bytes"} and d["policy"] == "on-demand+lru"
        assert d["specprefetch_report"] == "run"  # the marker --overwrite knows a run report by
        assert [x["prompt"] for x in d["runs"]] == prompts
        for x in d["runs"]:
            assert x["text"] == tok.decode(x["tokens"], skip_special_tokens=False) and len(x["tokens"]) >= 1
            assert f"{json.dumps(x['prompt'])} -> {json.dumps(x['text'], ensure_ascii=False)}" in r.stdout
        # a progress bar on stderr for the prefill of a prompt over 64 tokens only
        assert ("prefill" in r.stderr) == (len(prompts) == 2), r.stderr


# -- undefined metrics print n/a --------------------------------------------------------------------

def test_undefined_metrics_are_na_not_zero(tmp_path):
    """Within-token recall at h=2 on a model with 2 MoE layers has nothing to measure: every h=2
    target is in the next token. It is null / n/a, even for the oracle; h=1 is measured."""
    m, tr, ev = tmp_path / "m", tmp_path / "tr", tmp_path / "e.json"
    assert cli("tiny", FAMILY, "--out", m, "--set", "num_hidden_layers=3")[0] == 0  # MoE layers 1, 2
    code, out = cli("trace", m, "--data", HELDOUT, "--out", tr, "--max-sequences", "4", "--prompt-tokens", "6",
                    "--decode-tokens", "3", "--heldout-frac", "0.5")
    assert code == 0, out
    code, out = cli("eval", tr, "--predictors", "next-gate,oracle", "--horizons", "1,2", "--json", ev)
    assert code == 0, out
    j = json.loads(ev.read_text())
    for name in ("next-gate", "oracle"):
        p = j["predictors"][name]
        assert p["recall_at_k_within_token"]["2"] is None and p["recall_at_k_within_token"]["1"] is not None
        assert p["recall_at_k"]["2"] is not None
    assert j["predictors"]["oracle"]["recall_at_k_within_token"]["1"] == 1.0
    rows = [ln for ln in ev.with_suffix(".md").read_text().splitlines() if ln.startswith(("| next-gate", "| oracle"))]
    assert len(rows) == 2 and all(r.split(" | ")[5] == "n/a" for r in rows), rows  # within-token h=2
    assert "0.000" not in "".join(r.split(" | ")[5] for r in rows)


def test_simulate_table_prints_undefined_figures_as_na():
    from toolkit.simulate.report import markdown

    res = {"policy": "on-demand+lru", "predictor": "on-demand", "tpot_ms": None, "tpot_p95_ms": None,
           "stall_ms_per_token": 0.5, "hit_rate": None, "mib_read_per_token": 0.25, "wasted_prefetch_mib": 0.0}
    r = {"profile": "p", "routing_from": {"replayed_onto_other_geometry": False},
         "geometry": {"slot_bytes": 4096, "dtype": "fp16", "num_layers": 2, "num_experts": 8, "top_k": 2},
         "points": [{"pool_mib": 1.0, "pool_share_of_experts": 0.5, "window": 1, "results": [res]}]}
    row = markdown(r).splitlines()[-1]
    assert row.count("n/a") == 4 and "0.000" not in row, row


# -- --overwrite on the commands that write, passed through -----------------------------------------

def test_overwrite_is_required_and_passed_through(tiny_models, tmp_path):
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
    for cmd in ("train", "export", "store", "tiny", "trace", "eval", "simulate", "eviction-bounds", "run", "bench cpu",
                "bench gpu", "bench llama.cpp", "calibrate",
                "runner bench", "runner build", "device bench", "device list"):  # every command that writes
        assert "--overwrite" in CliRunner().invoke(main, [*cmd.split(), "--help"]).output, cmd


def test_window_means_one_unit_everywhere():
    for cmd in ("run", "simulate", "bench cpu", "bench gpu", "export"):
        text = " ".join(CliRunner().invoke(main, [*cmd.split(), "--help"]).output.split())
        assert "MoE layers planned ahead" in text and "steps ahead" not in text, cmd


def test_the_cli_installs_the_signal_handlers(tiny_models):
    from toolkit import errors

    assert cli("info", tiny_models[FAMILY])[0] == 0
    assert signal.getsignal(signal.SIGTERM) is errors._interrupt


# -- in a fresh process: what an interrupt says, and what a newcomer sees on stderr -----------------

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


@pytest.mark.slow
def test_sigterm_says_what_each_command_keeps(tiny_models, tmp_path):
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


@pytest.mark.slow
def test_no_library_noise_on_stderr(tiny_models, store, embedded_bundles, tmp_path):
    """torchao's "Failed to load ... .so", torch's pytree deprecation notes and ExecuTorch's
    cpuinfo probing are not the user's business; progress bars and our own lines are."""
    runs = [["run", tiny_models[FAMILY], "--store", store, "--policy", "on-demand+lru", "--prompt", "The kernel",
             "--max-new-tokens", "3", "--json", tmp_path / "a.json"],
            ["run", embedded_bundles["executorch"], "--policy", "next-gate+prediction", "--prompt", "The kernel",
             "--max-new-tokens", "3", "--no-check", "--json", tmp_path / "b.json"]]
    for args in runs:
        r = subprocess.run([str(EXE), *map(str, args)], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        for noise in ("Failed to load", "_pytree", "cpuinfo", "threadpool.cpp", "Warning", "deprecated"):
            assert noise not in r.stderr, (noise, r.stderr)
        assert " -> " in r.stdout and "TPOT" in r.stdout
