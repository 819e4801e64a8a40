"""The native runner on QNN bundles: the dense graphs through ONNX Runtime's C API and the QNN
execution provider (the HTP simulator of the onnxruntime-qnn wheel here), the experts on the runner's
own CPU kernels, against the Python engine on the same bundle (docs/runner.md, "QNN bundles").

Slow tier: the bundle's export runs the HTP simulator (~1 minute) and its runner builds against ONNX
Runtime (~1 minute), which make test's time budget does not hold yet."""
from __future__ import annotations

import json
import os
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from android_runner.build import build, command, ort_headers, qnn_libraries
from export.session import open_session, reference_tokens
from toolkit.errors import SpecPrefetchError
from toolkit.runtime.events import EventLog, decisions
from toolkit.runtime.policy import Policy
from toolkit.runtime.runner import RunConfig

# the third is fed as an 8-position HTP prefill chunk and single positions (chunk_plan)
PROMPTS = [[591, 906, 531, 1274, 2295, 1062], [17, 402, 9, 1500], [591, 906, 531, 1274, 2295, 1062, 17, 402, 9, 1500,
                                                                   358, 205]]
NEW = 6
POOL = 2.0  # 16 of the 256 expert slots: eviction every token
PREDICTORS = ("on-demand", "next-gate", "fate", "previous-token", "oracle")


@pytest.fixture(scope="module")
def qnn_bundle(embedded, tmp_path_factory) -> Path:
    """The embedded model's fp16 QNN bundle (SM8750), next-gate heads, a 32-position cache (so one
    prefill chunk size, 8); one short parity prompt (the HTP simulator is slow: the export's own
    parity tests are in test_export)."""
    from export.bundle import ExportConfig, export_bundle

    out = tmp_path_factory.mktemp("qnn") / "bundle"
    export_bundle(embedded, out, ExportConfig(target="qnn", max_seq=32, progress=False, parity_prompts=1,
                                              prompt_tokens=6, decode_tokens=3))
    return out


@pytest.fixture(scope="module")
def qnn_native(qnn_bundle, tmp_path_factory) -> Path:
    """The host runner built for it (ONNX Runtime backend, no C++ tokenizer), in this module's cache;
    ONNX Runtime's headers from the user's runner cache (fetched there once, not per test session)."""
    saved = {k: os.environ.get(k) for k in ("SPECPREFETCH_PROFILES", "SPX_ORT_INCLUDE")}
    os.environ.pop("SPECPREFETCH_PROFILES", None)  # (another fixture may have moved it for this session)
    os.environ.setdefault("SPX_ORT_INCLUDE", str(ort_headers(lambda s: None)))
    os.environ["SPECPREFETCH_PROFILES"] = str(tmp_path_factory.mktemp("runner-cache") / "profiles")
    try:
        yield build(qnn_bundle, "host", log=lambda s: None, tokenizer=False)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def unordered_decisions(lines: list[str]) -> list[Counter]:
    """Each step's decisions as a multiset, without which eviction a prefetch was paired with: the
    HTP computes in fp16, so where two experts' router weights tie at that precision a last-bit
    difference in its input (the engines' CPU experts add in different orders) can swap their ranks,
    and with them the order in which a step records its hits and issues its reads, never what it
    reads, keeps or evicts."""
    steps: list[Counter] = []
    for ln in decisions(lines):
        if ln.startswith("step ") or not steps:
            steps.append(Counter())
        steps[-1][re.sub(r" for=\S+", "", ln)] += 1
    return steps


def native_qnn_run(runner: Path, bundle: Path, tmp_path: Path, policy: str, *extra) -> tuple[dict, list[str]]:
    js, ev = tmp_path / f"{policy}.json", tmp_path / f"{policy}.log"
    args = [a for ids in PROMPTS for a in ("--prompt-ids", ",".join(map(str, ids)))]
    r = subprocess.run([*command(runner, "host"), str(bundle), *args, "--max-new-tokens", str(NEW), "--policy", policy,
                        "--pool-mib", str(POOL), "--json", str(js), "--events", str(ev), *map(str, extra)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(js.read_text()), ev.read_text().splitlines()


def check_policy(qnn_native, qnn_bundle, embedded, tmp_path, policy: str) -> dict:
    out, lines = native_qnn_run(qnn_native, qnn_bundle, tmp_path, policy)
    s = open_session(qnn_bundle, RunConfig(policy=Policy.parse(policy), pool_mib=POOL, io="threads"),
                     predictors=[p for p in PREDICTORS if p != "on-demand"])
    log = EventLog()
    gens = [s.runner.run(ids, NEW, events=log) for ids in PROMPTS]
    assert out["backend"] == "onnxruntime-qnn"
    for g, r, ids in zip(gens, out["runs"], PROMPTS):
        assert r["tokens"] == g.tokens == reference_tokens(embedded, ids, NEW), policy
        for k in ("requests", "hits", "misses", "prefetch_issued", "bytes_read"):
            assert r["counts"][k] == g.to_json()["counts"][k], (policy, k)
        # the HTP's crossings: embed per prompt position, 8 layer graphs per prefill unit (a chunk or
        # one position), the head once
        assert r["prefill_chunks"] == g.prefill_chunks, policy
        assert r["prefill_graph_calls"] == len(ids) + 8 * len(r["prefill_chunks"]) + 1, r
        assert r["decode_graph_calls_per_token"] == 10.0, r
    assert 8 in out["runs"][2]["prefill_chunks"]
    assert unordered_decisions(lines) == unordered_decisions(log.lines), policy
    return out


@pytest.mark.slow
def test_native_runs_a_qnn_bundle_as_the_python_engine(qnn_native, qnn_bundle, embedded, tmp_path):
    """One policy: tokens (the unmodified model's), counts and decisions of the Python
    engine on the same bundle; the experts never cross to the HTP (10 graph calls a decode token)."""
    check_policy(qnn_native, qnn_bundle, embedded, tmp_path, "next-gate+prediction")


@pytest.mark.slow
@pytest.mark.parametrize("predictor", [p for p in PREDICTORS if p != "next-gate"])
def test_native_runs_a_qnn_bundle_every_predictor(predictor, qnn_native, qnn_bundle, embedded, tmp_path):
    check_policy(qnn_native, qnn_bundle, embedded, tmp_path, f"{predictor}+lru")


@pytest.mark.slow
def test_the_executorch_runner_refuses_a_qnn_bundle(native_host, qnn_bundle):
    r = subprocess.run([*command(native_host[1], "host"), str(qnn_bundle), "--prompt-ids", "1,2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert "a qnn bundle, and this runner was built for executorch bundles" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_qnn_runner_names_a_missing_ep_library(qnn_native, qnn_bundle, tmp_path):
    env = {**os.environ, "SPX_QNN_EP_LIB": str(tmp_path / "nope.so")}
    r = subprocess.run([*command(qnn_native, "host"), str(qnn_bundle), "--prompt-ids", "1,2"], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 1
    assert "nope.so: the QNN execution provider library is missing" in r.stderr, r.stderr


def test_a_phone_build_names_the_missing_qnn_libraries(tmp_path, monkeypatch):
    monkeypatch.delenv("SPX_QNN_LIBS", raising=False)
    with pytest.raises(SpecPrefetchError, match="set SPX_QNN_LIBS to a directory holding libonnxruntime.so"):
        qnn_libraries(79)
    d = tmp_path / "libs"
    d.mkdir()
    for n in ("libonnxruntime.so", "libQnnHtp.so"):
        (d / n).write_bytes(b"\x7fELF")
    monkeypatch.setenv("SPX_QNN_LIBS", str(d))
    with pytest.raises(SpecPrefetchError, match="missing libonnxruntime_providers_qnn.so, libQnnSystem.so, "
                                                "libQnnHtpPrepare.so, libQnnHtpV79Stub.so, libQnnHtpV79Skel.so"):
        qnn_libraries(79)
    for n in ("libonnxruntime_providers_qnn.so", "libQnnSystem.so", "libQnnHtpPrepare.so", "libQnnHtpV79Stub.so",
              "libQnnHtpV79Skel.so"):
        (d / n).write_bytes(b"\x7fELF")
    assert qnn_libraries(79) == d
    with pytest.raises(SpecPrefetchError, match="missing libQnnHtpV81Stub.so, libQnnHtpV81Skel.so"):
        qnn_libraries(81)  # the skel follows the bundle's HTP architecture


@pytest.mark.slow
def test_a_phone_build_of_a_qnn_bundle_needs_the_users_libraries(qnn_bundle, tmp_path, monkeypatch):
    monkeypatch.delenv("SPX_QNN_LIBS", raising=False)
    with pytest.raises(SpecPrefetchError, match="set SPX_QNN_LIBS"):  # before the NDK is looked for
        build(qnn_bundle, "android", tmp_path / "out")
    with pytest.raises(SpecPrefetchError, match="phone runner is an --abi android build"):
        build(qnn_bundle, "arm64", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_runner_bench_refuses_a_qnn_bundle(qnn_bundle):
    from android_runner.bench import run

    with pytest.raises(SpecPrefetchError, match="runner bench measures executorch bundles; a qnn bundle"):
        run(qnn_bundle)


def test_the_headers_come_from_spx_ort_include_when_set(tmp_path, monkeypatch):
    monkeypatch.setenv("SPX_ORT_INCLUDE", str(tmp_path))
    with pytest.raises(SpecPrefetchError, match="no onnxruntime_c_api.h there"):
        ort_headers(print)
    (tmp_path / "onnxruntime_c_api.h").write_text("#define ORT_API_VERSION 23\n")
    assert ort_headers(print) == tmp_path
