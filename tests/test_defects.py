"""Regression tests for fixed defects: calibrate's miss cost and flash reads, malformed adapter.json."""
from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from adapters.checkpoint import load_adapter
from adapters.train import TrainConfig, train_adapter
from conftest import HELDOUT
from toolkit.cli import main
from toolkit.errors import SpecPrefetchError
from toolkit.models.loader import inspect_model_dir
from toolkit.simulate import calibrate as cal
from toolkit.traces.capture import TraceSettings, run_trace

MiB = 2**20
PAGE = 4096


# -- calibrate: the runtime miss cost ---------------------------------------------------------

def test_miss_cost_counts_stall_and_misses_over_the_same_decode_tokens():
    """8 tokens = 1 from prefill + 7 decode steps; stall (per decode token) and misses (decode-only
    counts) both cover those 7 steps: 7 x 2 ms of stall over 14 misses is 1 ms a miss."""
    run = {"tokens": list(range(8)), "decode_tokens": 7, "stall_ms_per_token": 2.0, "counts": {"misses": 14}}
    assert cal.runtime_miss_ms(run) == pytest.approx(1.0)
    # without the runtime's decode_tokens, the decode steps are the tokens after the first
    del run["decode_tokens"]
    assert cal.runtime_miss_ms(run) == pytest.approx(1.0)
    assert cal.runtime_miss_ms({"tokens": [1, 2], "stall_ms_per_token": 0.0, "counts": {"misses": 0}}) == 0.0


# -- calibrate: flash reads --------------------------------------------------------------------

def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def small_file(tmp_path) -> Path:
    f = tmp_path / "store.bin"
    f.write_bytes(os.urandom(3 * PAGE))
    return f


def test_reads_clamp_to_the_file_and_count_what_they_read(small_file, monkeypatch):
    """1 MiB reads of a 12 KiB file on a simulated 100 MiB/s device: no request past the end, and
    the bandwidth is the bytes actually read over the time taken (100 MiB/s), not 1 MiB a read."""
    clock = [0.0]
    calls: list[tuple[int, int, int]] = []
    real = os.preadv

    def preadv(fd, bufs, off):
        got = real(fd, bufs, off)
        calls.append((off, sum(len(b) for b in bufs), got))
        clock[0] += got / (100 * MiB)
        return got

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(cal.time, "perf_counter", lambda: clock[0])
    bw, lat = cal.measure_reads(small_file, [0, PAGE, 2 * PAGE], MiB, qd=1, n=12)
    assert len(calls) == 12
    assert all(off + asked <= 3 * PAGE and got == asked for off, asked, got in calls), calls
    assert bw == pytest.approx(100.0)
    assert lat == pytest.approx(sum(c[2] for c in calls) / 12 / (100 * MiB))


def test_reads_past_the_end_are_refused(small_file):
    with pytest.raises(SpecPrefetchError, match=r"store.bin: .*offset 16384 .*past the end"):
        cal.measure_reads(small_file, [0, 4 * PAGE], PAGE, qd=1, n=4)


def test_measure_reads_closes_its_file_when_a_read_fails(small_file, monkeypatch):
    def eio(fd, bufs, off):
        raise OSError(errno.EIO, "Input/output error")

    before = _open_fds()
    monkeypatch.setattr(os, "preadv", eio)
    for qd in (1, 4):
        with pytest.raises(SpecPrefetchError,
                           match=r"store.bin: read of 4096 bytes at offset \d+ failed.*Input/output"):
            cal.measure_reads(small_file, [0, PAGE], PAGE, qd=qd, n=8)
        assert _open_fds() == before
    monkeypatch.undo()
    with pytest.raises(SpecPrefetchError, match="no offsets"):
        cal.measure_reads(small_file, [], PAGE, qd=1, n=4)
    assert _open_fds() == before


@pytest.mark.parametrize("data_offset,file_end,size,count", [
    (PAGE, PAGE + 12 * PAGE, 12 * PAGE, 1),          # a store smaller than 1 MiB: one read of all of it
    (2 * PAGE, 2 * PAGE + 5 * MiB, MiB, 5),          # an exact fit: the last MiB is read too
    (2 * PAGE, 2 * PAGE + 5 * MiB + 3 * PAGE, MiB, 5),
])
def test_big_reads_stay_inside_the_store(data_offset, file_end, size, count):
    got, offsets = cal.big_reads(data_offset, file_end)
    assert (got, len(offsets)) == (size, count)
    assert got % PAGE == 0 and all(o % PAGE == 0 and data_offset <= o and o + got <= file_end for o in offsets)


# -- malformed adapter.json --------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_adapter(tiny_models, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("defects")
    s = TraceSettings(max_sequences=8, prompt_tokens=24, decode_tokens=4, heldout_frac=0.25, shard_tokens=200)
    trace = run_trace(tiny_models["qwen3_moe"], [HELDOUT], root / "t", s, progress=False)
    train_adapter(trace, root / "a", TrainConfig(steps=5, val_every=5, batch_size=32, rank=4), progress=False)
    return trace, root / "a"


def _edit(meta: dict, what: str):
    if what == "not an object":
        return [1, 2]
    if what.startswith("-"):
        keys = what[1:].split(".")
        d = meta
        for k in keys[:-1]:
            d = d[k]
        del d[keys[-1]]
        return meta
    key, _, value = what.partition("=")
    keys = key.split(".")
    d = meta
    for k in keys[:-1]:
        d = d[k]
    d[keys[-1]] = json.loads(value)
    return meta


MALFORMED = {  # edit -> what the message must say
    "not an object": "not a JSON object",
    "-model": "'model'",
    "-model.config_hash": "'model.config_hash'",
    "-horizons": "'horizons'",
    "-rank": "'rank'",
    "model=\"qwen\"": "'model'",
    "rank=\"64\"": "'rank'",
    "rank=0": "'rank'",
    "horizons=2": "'horizons'",
    "horizons=[9]": "'horizons'",
    "cross_token=\"yes\"": "'cross_token'",
    "model.num_experts=8.5": "'model.num_experts'",
    "model.moe_layers=[\"a\"]": "'model.moe_layers'",
}


@pytest.mark.parametrize("edit", MALFORMED)
def test_malformed_adapter_json_is_a_clear_error(tiny_adapter, tiny_models, tmp_path, edit):
    _, adapter = tiny_adapter
    bad = tmp_path / "bad"
    shutil.copytree(adapter, bad)
    meta = json.loads((bad / "adapter.json").read_text())
    (bad / "adapter.json").write_text(json.dumps(_edit(meta, edit)))
    for spec in (None, inspect_model_dir(tiny_models["qwen3_moe"])):
        with pytest.raises(SpecPrefetchError) as e:
            load_adapter(bad, spec)
        msg = str(e.value)
        assert str(bad / "adapter.json") in msg and MALFORMED[edit] in msg and "\n" not in msg, msg


def test_adapter_json_that_is_not_json(tiny_adapter, tmp_path):
    _, adapter = tiny_adapter
    bad = tmp_path / "bad"
    shutil.copytree(adapter, bad)
    (bad / "adapter.json").write_text('{"format": "specprefetch-adapter",')
    with pytest.raises(SpecPrefetchError, match="adapter.json is not valid JSON"):
        load_adapter(bad)


@pytest.mark.parametrize("edit", ["-model", "rank=\"64\"", "model.num_experts=8.5", "not json",
                                  "not an object", "-horizons"])
def test_cli_reports_a_malformed_adapter_in_one_line(tiny_adapter, tmp_path, edit):
    trace, adapter = tiny_adapter
    bad = tmp_path / "bad"
    shutil.copytree(adapter, bad)
    f = bad / "adapter.json"
    if edit == "not json":
        f.write_text("{")
    else:
        f.write_text(json.dumps(_edit(json.loads(f.read_text()), edit)))
    r = CliRunner().invoke(main, ["eval", str(trace), "--adapter", str(bad), "--predictors", "next-gate,adapter",
                                  "--json", str(tmp_path / "e.json")])
    assert r.exit_code == 2, r.output
    assert isinstance(r.exception, SystemExit)  # not an uncaught KeyError / TypeError
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(f) in lines[0], r.output
    assert "Traceback" not in r.output and not (tmp_path / "e.json").exists()


def test_read_adapter_meta_validates(tiny_adapter, tmp_path):
    from adapters.checkpoint import read_adapter_meta

    _, adapter = tiny_adapter
    assert read_adapter_meta(adapter)["rank"] == 4
    bad = tmp_path / "bad"
    shutil.copytree(adapter, bad)
    (bad / "adapter.json").write_text("[]")
    with pytest.raises(SpecPrefetchError, match="adapter.json: malformed adapter config: not a JSON object"):
        read_adapter_meta(bad)
