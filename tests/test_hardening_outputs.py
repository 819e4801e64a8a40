"""Report outputs (every --json, --events, calibrate --out, and the .md/.png beside a report) follow
the --out rule, checked before any work: never an input of the command, never inside another
artifact, never another output of the same command; an existing one is replaced only with
--overwrite and only if it is a report of the same command (its "specprefetch_report" marker; an
events log by its header line). A FIFO or a character device (/dev/null) is written in place, never
renamed over. Also: `tiny --set` is checked as every command checks a model directory, `info`
refuses an all-dense config, and pool sizes and bench options are checked up front.

Real models, traces, adapters and stores (tiny ones), real commands (click's CliRunner)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import stat
import threading
from pathlib import Path

import pytest

from conftest import HELDOUT
from test_hardening_cli import cli, refused  # the same CLI runner and one-line-refusal check

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


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECPREFETCH_PROFILES", str(tmp_path_factory.getbasetemp() / "outputs-cache" / "profiles"))


# -- 2. never an input, never inside another artifact, never another output: before any work ----------

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


@pytest.mark.parametrize("case", sorted(AT_INPUTS))
def test_report_outputs_never_replace_an_input_or_another_artifact(case, art, tmp_path):
    args, what = AT_INPUTS[case]
    before = snapshot(*(art[k] for k in "MOSTAB"))
    refused(args(art, tmp_path), what)
    assert snapshot(*(art[k] for k in "MOSTAB")) == before
    assert not any(tmp_path.iterdir())  # and nothing else was written


# -- an existing report: --overwrite, and only a report of the same command -----------------------------

def test_an_existing_report_is_replaced_only_with_overwrite_and_only_by_its_own_command(art, tmp_path):
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
    refused(["simulate", art["T"], "--policies", "on-demand+lru", "--json", e, "--overwrite"], "is an `eval` report")
    # a file of the user's, a .md without its report, a report named like its own table
    mine = tmp_path / "mine.json"
    mine.write_text('{"rows": [1, 2]}')
    (tmp_path / "x.md").write_text("my notes")
    before = snapshot(tmp_path)
    refused(_run(art, "--json", mine, "--overwrite"), "not a report written by specprefetch")
    refused(["eval", art["T"], "--json", tmp_path / "x.json"], "x.md exists without its report")
    refused(["eval", art["T"], "--json", tmp_path / "t.md"], "give the report a .json name")
    assert snapshot(tmp_path) == before


# -- 3. special files: written in place, never renamed over ----------------------------------------------

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


def test_special_files_are_written_in_place_and_stay_what_they_are(art, tmp_path, null_device):
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
    assert {p.name for p in tmp_path.iterdir()} == {"fifo"} | ({"null"} if null_device.parent == tmp_path else set())
    # a socket (like a block device) is refused, and stays a socket
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(tmp_path / "sock"))
        refused(_run(art, "--json", tmp_path / "sock"), "is a socket")
        assert stat.S_ISSOCK(os.lstat(tmp_path / "sock").st_mode)
    finally:
        s.close()


def test_atomic_writers_never_rename_over_a_special_file(tmp_path):
    from toolkit.artifacts import write_json_atomic
    from toolkit.errors import SpecPrefetchError

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(SpecPrefetchError, match="is a FIFO, not a regular file"):
        write_json_atomic(fifo, {"a": 1})
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and [p.name for p in tmp_path.iterdir()] == ["fifo"]


# -- 11. tiny --set: the checks of every other command, before anything is written -------------------

TINY_SETS = [("hidden_size=-64", "hidden_size is -64; it must be at least 1"),
             ("vocab_size=1e9", "refuses it"),
             ("vocab_size=1000000000", "vocab_size is 1000000000; it must be a whole number"),
             ("rope_parameters=null", "transformers cannot build the model"),
             ("num_experts_per_tok=100", "top-k 100 does not fit 8 experts"),
             ("num_hidden_layers=0", "num_hidden_layers is 0"),
             ("moe_intermediate_size=0", "the experts' intermediate size is 0"),
             ("mlp_only_layers=[0,1,2,3]", "describes no MoE layer")]


@pytest.mark.parametrize("setting,what", TINY_SETS, ids=[s for s, _ in TINY_SETS])
def test_tiny_set_is_checked_like_every_other_command(setting, what, tmp_path):
    line = refused(["tiny", FAMILY, "--out", tmp_path / "m", "--set", setting], "--set", what)
    assert str(tmp_path) not in line  # names the setting, not a temporary config
    assert not any(tmp_path.iterdir())


# -- 14. info on an all-dense config; pool sizes and bench options up front ----------------------------

def test_info_refuses_a_config_with_no_moe_layer(art, tmp_path):
    m = Path(shutil.copytree(art["M"], tmp_path / "dense"))
    cfg = json.loads((m / "config.json").read_text())
    cfg["mlp_only_layers"] = [0, 1, 2, 3]
    (m / "config.json").write_text(json.dumps(cfg))
    refused(["info", m], "describes no MoE layer", "holds routed-expert weights in layers [1, 2, 3]")
    only = tmp_path / "config-only"
    only.mkdir()
    shutil.copy(m / "config.json", only / "config.json")
    refused(["info", only], "describes no MoE layer", "not a Mixture-of-Experts model")


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


@pytest.mark.parametrize("n", range(len(UP_FRONT)))
def test_pool_sizes_and_bench_options_are_checked_up_front(n, art, tmp_path):
    args, option, what = UP_FRONT[n]
    args = args(art)
    if "--json" not in args:
        args += ["--json", tmp_path / "r.json"]
    refused(args, option, what)
    assert not any(tmp_path.iterdir())


def test_calibrate_out_is_claimed_before_measuring(art, tmp_path):
    mine = tmp_path / "profile.json"
    mine.write_text('{"mine": true}')
    before = snapshot(tmp_path)
    refused(["calibrate", art["M"], "--store", art["S"], "--out", mine], "not a report written by specprefetch")
    assert snapshot(tmp_path) == before
