"""The native runner on QNN bundles: the dense graphs through ONNX Runtime's C API and the QNN
execution provider (the HTP simulator of the onnxruntime-qnn wheel here), the experts on the runner's
own CPU kernels, against the Python engine on the same bundle (docs/runner.md, "QNN bundles").

make test runs one policy on the fp16 and the a16w8 bundle, which the background build
(tests/prebuild.py) exports and builds their runner for; the slow tier every predictor on both, and the
refusals."""
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
NEW = 4
POOL = 2.0  # 16 of the 256 expert slots: eviction every token
PREDICTORS = ("on-demand", "next-gate", "fate", "previous-token", "oracle")


@pytest.fixture
def qnn_bundle(qnn_native) -> Path:
    """The shared fp16 QNN bundle (tests/conftest.py qnn_native: the background build's in make test)."""
    return qnn_native[0]


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
                        "--pool-mib", str(POOL), "--json", str(js), "--events", str(ev), "--read-budget-kib", "off",
                        *map(str, extra)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(js.read_text()), ev.read_text().splitlines()


def check_policy(runner, bundle, embedded, tmp_path, policy: str, unmodified: bool = True,
                 other_steps: float = 0.0, htp_embed: bool = False) -> dict:
    """The native runner against the Python engine on `bundle`: tokens (and, `unmodified`, the
    unmodified model's), HTP calls, and decisions per step up to their order, in all but a share
    `other_steps` of the steps; the counts equal, or off by at most two (a hit turned miss and the
    read it made) for each step whose decisions differ."""
    out, lines = native_qnn_run(runner, bundle, tmp_path, policy)
    s = open_session(bundle, RunConfig(policy=Policy.parse(policy), pool_mib=POOL, io="threads"),
                     predictors=[p for p in PREDICTORS if p != "on-demand"])
    log = EventLog()
    gens = [s.runner.run(ids, NEW, events=log) for ids in PROMPTS]
    assert out["backend"] == "onnxruntime-qnn"
    mine, ref = unordered_decisions(lines), unordered_decisions(log.lines)
    assert len(mine) == len(ref) > 100, policy
    differ = [i for i, (a, b) in enumerate(zip(mine, ref)) if a != b]
    assert len(differ) <= other_steps * len(ref), (policy, differ[:5], len(ref))
    from toolkit.runtime.expert_store import ExpertStore

    m = json.loads((bundle / "manifest.json").read_text())
    slot = ExpertStore(bundle / m["runtime"]["expert_store"]).slot_bytes  # bytes_read: in expert reads
    for g, r, ids in zip(gens, out["runs"], PROMPTS):
        assert r["tokens"] == g.tokens, policy
        if unmodified:
            assert g.tokens == reference_tokens(embedded, ids, NEW), policy
        for k in ("requests", "hits", "misses", "prefetch_issued", "bytes_read"):
            unit = slot if k == "bytes_read" else 1
            assert abs(r["counts"][k] - g.to_json()["counts"][k]) <= 2 * len(differ) * unit, (policy, k, len(differ))
        # the HTP's crossings: 8 layer graphs per prefill unit (a chunk or one position), the head
        # once; the embedding is a CPU lookup (`htp_embed`: a graph call a position)
        assert r["prefill_chunks"] == g.prefill_chunks, policy
        assert r["prefill_graph_calls"] == 8 * len(r["prefill_chunks"]) + 1 + (len(ids) if htp_embed else 0), r
        assert r["decode_graph_calls_per_token"] == 9.0 + htp_embed, r
    assert 8 in out["runs"][2]["prefill_chunks"]
    return out


def test_native_runs_a_qnn_bundle_as_the_python_engine(qnn_native, embedded, tmp_path):
    """One policy: tokens (the unmodified model's), counts and decisions of the Python
    engine on the same bundle; neither the experts nor the embedding cross to the HTP (9 graph calls a
    decode token: 8 layers and the head)."""
    check_policy(qnn_native[1], qnn_native[0], embedded, tmp_path, "next-gate+prediction")


def test_the_embedding_is_a_table_not_an_htp_graph(qnn_native, embedded, tmp_path):
    """A qnn bundle carries the token embedding as a float16 table (no embed graph, so no copy of it in
    HTP memory and no crossing a position); a table of the wrong shape is refused by both engines in
    one line naming it."""
    import hashlib
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from export.qnn_target import embedding_of
    from toolkit.models.loader import inspect_model_dir, load_dense_model

    bundle, runner = qnn_native
    m = json.loads((bundle / "manifest.json").read_text())
    assert "embed" not in m["graphs"]["files"] and m["graphs"]["embedding"]["file"] == "graphs/embedding.safetensors"
    # the Qwen3-MoE QNN export itself (test_export's per-family check runs Qwen3-MoE in make test-all only)
    p = json.loads((bundle / "parity.json").read_text())
    assert m["soc"] == "SM8750" and m["graphs"]["htp_arch"] == 79
    assert p["passed"] and p["max_rel_logit_diff"] < 0.05 and p["topk_agreement"] >= 0.95
    for name, rel in m["graphs"]["binaries"].items():
        assert (bundle / rel).stat().st_size > 1000, name
    from export.bundle import inspect_bundle
    graphs = {k: g for k, g in inspect_bundle(bundle)["graphs"].items() if g["compat"] != "cpu lookup"}
    assert graphs and all(g["compat"].split(":")[5] == "69" for g in graphs.values())   # compiled for SM8750
    table = load_file(str(bundle / "graphs" / "embedding.safetensors"))["weight"]
    want = load_dense_model(inspect_model_dir(embedded)).get_input_embeddings().weight.detach()
    assert table.dtype == torch.float16 and torch.equal(table, want.to(torch.float16))
    got = embedding_of(bundle, m).lookup(torch.tensor([[7, 4095]]))
    assert torch.equal(got, want[[7, 4095]].to(torch.float16).float().reshape(1, 2, -1))

    rel = "graphs/embedding.safetensors"
    b = tmp_path / "b"
    shutil.copytree(bundle, b)

    def table_file(tensors: dict | None = None, raw: bytes | None = None) -> subprocess.CompletedProcess:
        """The copy's table replaced (and resealed in its manifest); the native runner run on it."""
        if raw is None:
            save_file(tensors, str(b / rel))
        else:
            (b / rel).write_bytes(raw)
        m["files"][rel] = {"size": (b / rel).stat().st_size,
                           "sha256": hashlib.sha256((b / rel).read_bytes()).hexdigest()}
        (b / "manifest.json").write_text(json.dumps(m))
        return run(b)

    def run(where: Path) -> subprocess.CompletedProcess:
        return subprocess.run([*command(runner, "host"), str(where), "--prompt-ids", "7,4095,3", "--max-new-tokens",
                               "3", "--json", str(tmp_path / "run.json")], capture_output=True, text=True, timeout=300)

    def tokens() -> list[int]:
        return json.loads((tmp_path / "run.json").read_text())["runs"][0]["tokens"]

    assert run(bundle).returncode == 0
    want_tokens = tokens()
    # the weight after another tensor (a non-zero data offset): read from where the header says (a reader
    # that started at the data's first byte would embed shifted rows and decode other tokens)
    r = table_file({"a_first": torch.ones(3, dtype=torch.float16), "weight": table})
    assert r.returncode == 0 and tokens() == want_tokens, r.stderr
    assert embedding_of(b, m).lookup(torch.tensor([[7]])).equal(got[:, :1])
    # refused in one line naming the table: a row short, another dtype, another width, offsets past the end
    refusals = [({"weight": table[:-1].contiguous()}, None, "weight is F16 [4095, 256]; a float16 table [4096, 256]"),
                ({"weight": table.float()}, None, "weight is F32 [4096, 256]"),
                ({"weight": table[:, :128].contiguous()}, None, "weight is F16 [4096, 128]")]
    end = 2**64 - 8  # offsets whose sum with the header's length wraps around 64 bits
    header = json.dumps({"weight": {"dtype": "F16", "shape": [4096, 256], "data_offsets": [end - 4096 * 256 * 2, end]}})
    refusals.append((None, len(header).to_bytes(8, "little") + header.encode() + b"\0" * 16,
                     "do not hold 2097152 bytes inside the file's 16 bytes of data"))
    for tensors, raw, message in refusals:
        r = table_file(tensors, raw)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "embedding.safetensors" in r.stderr and message in r.stderr, (message, r.stderr)
    table_file({"weight": table[:-1].contiguous()})
    with pytest.raises(SpecPrefetchError, match=r"embedding.safetensors: weight is F16 \[4095, 256\]; a float16 table"):
        embedding_of(b, m)
    # a qnn manifest with neither the table nor an embed graph: refused by both
    del m["graphs"]["embedding"]
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SpecPrefetchError, match="neither an embed graph nor an embedding table"):
        embedding_of(b, m)
    r = subprocess.run([*command(runner, "host"), str(b), "--prompt-ids", "1,2"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and "neither an embed graph nor an embedding table" in r.stderr, r.stderr


@pytest.mark.slow  # compiles one graph for the HTP simulator
def test_a_bundle_with_an_embed_graph_runs_it_on_the_htp(qnn_native, embedded, tmp_path):
    """A qnn bundle that embeds with an `embed` graph (a qai-hub bundle's form, and a qnn bundle's
    before the table): both engines run that graph, one HTP call a position more, the same tokens,
    counts and decisions."""
    import hashlib
    import shutil

    from export.graphs import StepModel
    from export.qnn_target import compile_context, context_bin, export_onnx
    from toolkit.models.loader import inspect_model_dir, load_dense_model

    bundle, runner = qnn_native
    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    m = json.loads((b / "manifest.json").read_text())
    spec = inspect_model_dir(embedded)
    steps = StepModel(spec, load_dense_model(spec), max_seq=m["kv"]["max_seq"])
    (tmp_path / "onnx").mkdir()
    src = export_onnx(steps, {"embed": steps.graphs("io")["embed"]}, tmp_path / "onnx", lambda s: None)["embed"]
    ctx = b / "graphs" / "embed_ctx.onnx"
    compile_context(src, ctx, m["soc"], fp16=True)
    rel = "graphs/embedding.safetensors"
    (b / rel).unlink()
    del m["graphs"]["embedding"], m["files"][rel]
    m["graphs"]["files"]["embed"] = "graphs/embed_ctx.onnx"
    m["graphs"]["binaries"]["embed"] = f"graphs/{context_bin(ctx).name}"
    for p in (ctx, context_bin(ctx)):
        m["files"][str(p.relative_to(b))] = {"size": p.stat().st_size,
                                             "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
    (b / "manifest.json").write_text(json.dumps(m))
    out = check_policy(runner, b, embedded, tmp_path, "next-gate+prediction", htp_embed=True)
    assert out["runs"][0]["decode_graph_calls_per_token"] == 10.0


@pytest.mark.slow
@pytest.mark.parametrize("predictor", [p for p in PREDICTORS if p != "next-gate"])
def test_native_runs_a_qnn_bundle_every_predictor(predictor, qnn_native, embedded, tmp_path):
    check_policy(qnn_native[1], qnn_native[0], embedded, tmp_path, f"{predictor}+lru")


# the slow tier only (every predictor): the a16w8 export is ~45 s of CPU that make test's 6 minutes on two cores
# no longer fit beside the fp16 QNN bundle's (which make test keeps)
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["next-gate+prediction", "oracle+belady",
                                    *(f"{p}+lru" for p in PREDICTORS if p not in ("next-gate", "oracle"))])
def test_native_runs_an_a16w8_qnn_bundle_as_the_python_engine(policy, a16w8_native, embedded, tmp_path):
    """The integer bundle: the same tokens in both engines (its own, not the fp32 model's), the same
    decisions in all but 2% of the steps and the counts within two per differing step: its graphs' outputs are uint16
    steps, so equal router and prediction values are common, and the last-bit difference between the
    engines' CPU expert sums (added in different orders) can move one across a step and swap two
    tied experts' ranks (measured with 6 new tokens: 1 step of 241, one stale prefetch dropped for another)."""
    check_policy(a16w8_native[1], a16w8_native[0], embedded, tmp_path, policy, unmodified=False, other_steps=0.02)


@pytest.mark.slow
def test_the_executorch_runner_refuses_a_qnn_bundle(native_host, qnn_bundle):
    r = subprocess.run([*command(native_host[1], "host"), str(qnn_bundle), "--prompt-ids", "1,2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert "a qnn bundle, and this runner was built for executorch bundles" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_qnn_runner_names_a_missing_ep_library(qnn_native, tmp_path):
    env = {**os.environ, "SPX_QNN_EP_LIB": str(tmp_path / "nope.so")}
    r = subprocess.run([*command(qnn_native[1], "host"), str(qnn_native[0]), "--prompt-ids", "1,2"],
                       capture_output=True, text=True, timeout=300, env=env)
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
