"""Export: step graphs, ExecuTorch and QNN bundles with parity, inspect, and the qai-hub boundary."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from export.bundle import ExportConfig, export_bundle, inspect_bundle
from export.graphs import StepModel
from export.eager import TorchBackend, run_model, run_sequence
from toolkit.cli import main
from toolkit.errors import SpecPrefetchError
from toolkit.models.loader import inspect_model_dir, load_dense_model, load_model
from toolkit.models.routers import load_router_bank
from toolkit.models.tiny import TINY_FAMILIES
from toolkit.runtime.expert_store import ExpertStore, build_store

FAST = dict(max_seq=24, parity_prompts=2, prompt_tokens=10, decode_tokens=6, progress=False)


def _cfg(**kw) -> ExportConfig:
    return ExportConfig(**{**FAST, **kw})


# -- the step graphs are the model --------------------------------------------------------

@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("kv_mode", ["buffer", "io"])
def test_step_graphs_match_transformers(family, kv_mode, tiny_models, tmp_path):
    """Embed / layer / expert / head graphs driven by the host loop give the model's logits and
    routing at every position (both KV-cache forms), experts read from the store."""
    spec = inspect_model_dir(tiny_models[family])
    build_store(spec, tmp_path / "e.spx", "fp16", progress=False)
    ref = load_model(spec.path)
    toks = list(range(10, 80, 3))  # 24 tokens: past GPT-OSS's sliding window below
    with torch.no_grad():
        hf = ref.model(input_ids=torch.tensor([toks])).logits[0].float()
    steps = StepModel(spec, load_dense_model(spec), max_seq=32)
    if family == "gpt_oss":
        steps.windows = [8 if w else 0 for w in steps.windows]  # exercise the sliding mask
        ref.model.config.sliding_window = 8
        for layer in ref.model.model.layers:
            if layer.self_attn.sliding_window:
                layer.self_attn.sliding_window = 8
        with torch.no_grad():
            hf = ref.model(input_ids=torch.tensor([toks])).logits[0].float()
    store = ExpertStore(tmp_path / "e.spx", spec)
    rec = run_sequence(TorchBackend(steps, kv_mode), toks, store=store,
                       model=run_model(spec, store, load_router_bank(spec).score_bias))
    assert (rec.logits - hf).abs().max() < 1e-4
    assert torch.equal(rec.next_tokens, hf.argmax(-1))


def test_rejects_short_max_seq(tiny_models, tmp_path):
    with pytest.raises(SpecPrefetchError, match="--max-seq 8 is shorter"):
        export_bundle(tiny_models["mixtral"], tmp_path / "b", _cfg(max_seq=8))


def test_rejects_a_window_past_one_tokens_moe_layers(tiny_models, tmp_path):
    """The tiny Mixtral has 2 MoE layers: a window of 3 would leave a bundle no runner can run."""
    with pytest.raises(SpecPrefetchError, match="--window 3: this model has 2 MoE layers"):
        export_bundle(tiny_models["mixtral"], tmp_path / "b", _cfg(window=3))
    assert not (tmp_path / "b").exists()


def test_rejects_quant_of_other_target(tiny_models, tmp_path):
    with pytest.raises(SpecPrefetchError, match="--quant 'a16w8' is not offered by --target executorch"):
        export_bundle(tiny_models["mixtral"], tmp_path / "b", _cfg(quant="a16w8"))
    assert not (tmp_path / "b").exists()


# -- ExecuTorch ---------------------------------------------------------------------------

# every family in make test-all (GPT-OSS's, about 30 s in make test's time: the ExecuTorch lowering of the
# masked attention path, sinks and sliding windows, and of expert biases); make test lowers the embedded
# model's fp32 bundle (tests/prebuild.py: Qwen3-MoE, the LLM custom ops) and GPT-OSS's QNN bundle below, and
# GPT-OSS's step graphs and sinks are checked eagerly (test_step_graphs_match_transformers above, test_prefill,
# test_attention)
@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_executorch_bundle_every_family(family, tiny_models, tmp_path):
    out = tmp_path / "bundle"
    m = export_bundle(tiny_models[family], out, _cfg(target="executorch"))
    p = json.loads((out / "parity.json").read_text())
    assert p["passed"] and p["max_abs_logit_diff"] < 1e-3 and p["topk_agreement"] == 1.0
    assert p["next_token_agreement"] == 1.0 and p["positions"] == 2 * 16
    vision = {"vision"} if family == "qwen3_vl_moe" else set()  # a vision-language model's tower (docs/export.md)
    assert set(m["graphs"]["methods"]) == {"embed", "head", "expert", "reset", *vision,
                                           *(f"layer_{i}" for i in range(m["model"]["num_layers"]))}
    assert ("vision" in m["graphs"]) == bool(vision) and m["kv"]["rope"] == ("mrope" if vision else "1d")
    s = inspect_bundle(out)
    assert s["family"] == family and set(s["graphs"]) == set(m["graphs"]["signatures"])
    assert not list(out.parent.glob("bundle.partial*")) and not list(out.parent.glob(".bundle.lock"))


@pytest.mark.slow  # make demo exports the embedded model with 8da8w
@pytest.mark.parametrize("quant", ["8da8w", "8da4w"])
def test_executorch_quantized_bundle(quant, tiny_models, tmp_path):
    m = export_bundle(tiny_models["qwen3_moe"], tmp_path / "b", _cfg(target="executorch", quant=quant))
    assert m["quantization"]["dense"] == quant and m["parity"]["passed"]
    fp32 = export_bundle(tiny_models["qwen3_moe"], tmp_path / "f", _cfg(target="executorch"))
    assert m["files"]["graphs/model.pte"]["size"] < fp32["files"]["graphs/model.pte"]["size"]


@pytest.mark.slow
def test_weight_only_int8_is_refused_by_parity(tiny_models, tmp_path):
    """torchao weight-only int8 lowered to XNNPACK computes garbage silently; parity must refuse."""
    out = tmp_path / "b"
    with pytest.raises(SpecPrefetchError, match="parity failed, bundle refused") as e:
        export_bundle(tiny_models["qwen3_moe"], out, _cfg(target="executorch", quant="w8"))
    assert not out.exists()
    rejected = tmp_path / "b.rejected"
    p = json.loads((rejected / "parity.json").read_text())
    assert not p["passed"] and p["max_abs_logit_diff"] > 1.0
    assert str(rejected) in str(e.value)


@pytest.mark.slow  # make test: the runner's bundle runs reset the program between sequences too
def test_executorch_program_state_does_not_leak_between_sequences(tiny_models, tmp_path):
    """One loaded program serves sequence after sequence: `reset` runs, earlier KV state never
    reaches a later sequence, and a rerun gives identical logits."""
    from export.manifest import open_bundle

    out = tmp_path / "b"
    export_bundle(tiny_models["qwen3_moe"], out, _cfg(target="executorch"))
    m, be = open_bundle(out)
    assert "reset" in m["graphs"]["methods"]
    spec = inspect_model_dir(tiny_models["qwen3_moe"])
    store = ExpertStore(out / "experts.spx")
    kw = dict(model=run_model(spec, store), store=store)
    a = run_sequence(be, [5, 9, 200, 31, 77], **kw)
    run_sequence(be, [600, 601, 602, 603, 604, 605, 606], **kw)
    b = run_sequence(be, [5, 9, 200, 31, 77], **kw)
    assert torch.equal(a.logits, b.logits)


@pytest.mark.slow  # ~20 s; the native runner's tests run a bundle's graph heads in make test
def test_adapter_heads_in_the_graph(tiny_models, tmp_path):
    """With --adapter, each MoE layer graph's `preds` output is the adapter's predicted router
    logits for every horizon of the window, computed on the phone in the same graph."""
    from adapters.checkpoint import save_adapter
    from adapters.lowrank import PrefetchAdapter
    from export.manifest import open_bundle

    spec = inspect_model_dir(tiny_models["qwen3_moe"])
    g = spec.geometry
    ad = PrefetchAdapter(num_layers=len(g.moe_layers), hidden_size=g.hidden_size,
                         num_experts=g.routing.num_experts, horizons=(1, 2), rank=4, seed=3)
    with torch.no_grad():
        ad.B.normal_(0, 0.5)
    save_adapter(ad, tmp_path / "ad", spec, {})
    out = tmp_path / "b"
    m = export_bundle(spec.path, out, _cfg(target="executorch"), adapter=tmp_path / "ad")
    assert m["predictor"]["kind"] == "adapter" and (out / "adapter" / "adapter.safetensors").exists()
    assert m["predictor"]["preds_rows"][str(g.moe_layers[-1])] == [1, 2]  # cross-token targets too
    _, be = open_bundle(out)
    bank = load_router_bank(spec)
    be.reset()
    h = be.call("embed", [torch.tensor([[42]])])[0]
    for layer in range(g.num_layers):
        outs = be.layer(layer, h, 0)
        h = outs[0]
        if layer in g.moe_layers:
            li = g.moe_layers.index(layer)
            want = torch.cat([ad.logits(bank, outs[1], li, hz) for hz in (1, 2)])
            assert (outs[3] - want).abs().max() < 1e-4
    assert not torch.equal(want, torch.cat([bank.logits(outs[1], (li + hz) % len(g.moe_layers)) for hz in (1, 2)]))


# -- QNN ------------------------------------------------------------------------------------

# gpt_oss (expert biases) in make test; the rest in make test-all (time budget). Qwen3-MoE's QNN export
# stays in make test through the embedded model's QNN bundle (conftest's qnn_native, a qwen3_moe)
@pytest.mark.parametrize("family", [f if f == "gpt_oss" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in TINY_FAMILIES])
def test_qnn_bundle_every_family(family, tiny_models, tmp_path):
    """fp16 context binaries for SM8750, compiled offline and run on the x86 HTP simulator."""
    out = tmp_path / "bundle"
    m = export_bundle(tiny_models[family], out, _cfg(target="qnn"))
    assert m["soc"] == "SM8750" and m["graphs"]["htp_arch"] == 79
    p = json.loads((out / "parity.json").read_text())
    assert p["passed"] and p["max_rel_logit_diff"] < 0.05 and p["topk_agreement"] >= 0.95
    s = inspect_bundle(out)
    assert s["graphs"].pop("embed")["compat"] == "cpu lookup"  # the embedding table, not an HTP graph
    assert all(g["compat"].split(":")[5] == "69" for g in s["graphs"].values())  # 69 = SM8750
    for name, rel in m["graphs"]["binaries"].items():
        assert (out / rel).stat().st_size > 1000, name


def test_square_to_mul_rewrites_pow2(tmp_path):
    """The HTP's fp16 Pow is wrong for some inputs; every x**2 goes to the HTP as x*x."""
    import onnx
    import onnxruntime as ort

    from export.qnn_target import square_to_mul

    class Norm(torch.nn.Module):
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) + x.pow(3)

    x = torch.randn(1, 8)
    torch.onnx.export(Norm(), (x,), str(tmp_path / "n.onnx"), input_names=["x"], dynamo=False, opset_version=17)
    assert square_to_mul(tmp_path / "n.onnx") == 1
    ops = [n.op_type for n in onnx.load(str(tmp_path / "n.onnx")).graph.node]
    assert ops.count("Pow") == 1  # the cube stays
    got = ort.InferenceSession(str(tmp_path / "n.onnx"),
                               providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    assert abs(got - Norm()(x).numpy()).max() < 1e-5


@pytest.mark.slow  # ~10 s
def test_qnn_qdq_bundle_and_other_soc(tiny_models, tmp_path):
    # a random tiny model's logits are near-uniform (scale ~0.7), so 8-bit weights flip greedy
    # argmaxes on near-ties far more often than on a trained model (the embedded model keeps 0.98,
    # docs/export.md): the token bounds are relaxed here, the numeric and routing bounds are not
    tol = {"min_next_token_agreement": 0.7, "min_free_token_match": 0.0}
    m = export_bundle(tiny_models["qwen3_moe"], tmp_path / "b",
                      _cfg(target="qnn", quant="a16w8", soc="SM8650", calibration_prompts=3, tolerance=tol))
    assert m["parity"]["passed"] and m["soc"] == "SM8650"
    p = json.loads((tmp_path / "b" / "parity.json").read_text())
    assert p["max_rel_logit_diff"] < 0.15 and p["topk_agreement"] >= 0.85
    assert p["vs_onnx_cpu"]["topk_agreement"] >= 0.9  # HTP vs the same QDQ graphs on the CPU
    assert p["vs_onnx_cpu"]["max_rel_logit_diff"] < p["max_rel_logit_diff"]
    s = inspect_bundle(tmp_path / "b")
    assert s["graphs"].pop("embed")["compat"] == "cpu lookup"
    assert all(g["compat"].split(":")[5] == "57" for g in s["graphs"].values())  # 57 = SM8650


def test_qnn_unknown_soc_and_executorch_path_errors(tiny_models, tmp_path, monkeypatch):
    with pytest.raises(SpecPrefetchError, match="--soc 'SM1234': choose from SM8750"):
        export_bundle(tiny_models["mixtral"], tmp_path / "b", _cfg(target="qnn", soc="SM1234"))
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    with pytest.raises(SpecPrefetchError, match="QAIRT.*QNN_SDK_ROOT"):
        export_bundle(tiny_models["mixtral"], tmp_path / "b", _cfg(target="qnn", qnn_path="executorch"))
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob("b.partial*"))


# -- the embedded model, both targets, and inspect on real bundles -----------------------------

# the embedded model's QNN bundle (~1 minute to export) is in make test-all; make test exports a QNN
# bundle of the tiny GPT-OSS (test_qnn_bundle_every_family; every family in make test-all) and uses the
# embedded model's (conftest's qnn_native, test_native_qnn)
@pytest.mark.parametrize("target", ["executorch", pytest.param("qnn", marks=pytest.mark.slow)])
def test_embedded_bundle(target, embedded_bundles):
    b = embedded_bundles[target]
    m = json.loads((b / "manifest.json").read_text())
    p = json.loads((b / "parity.json").read_text())
    assert p["passed"] and p["positions"] == 3 * 20 and p["next_token_agreement"] >= 0.95
    assert m["model"]["family"] == "qwen3_moe" and m["model"]["num_experts"] == 32
    assert m["kv"]["max_seq"] == 64 and m["predictor"]["kind"] == "next-gate"
    assert m["runtime"]["expert_bytes_total"] == 8 * 32 * ExpertStore(b / "experts.spx").slot_bytes
    # experts are only in the store: no graph holds 8 x 32 experts' weights
    graph_bytes = sum(f["size"] for k, f in m["files"].items() if k.startswith("graphs/"))
    assert graph_bytes < m["runtime"]["expert_bytes_total"]
    assert inspect_bundle(b)["parity"]["passed"]


def _copy(b: Path, tmp_path: Path) -> Path:
    c = tmp_path / b.name
    shutil.copytree(b, c)
    return c


@pytest.mark.parametrize("target", ["executorch", pytest.param("qnn", marks=pytest.mark.slow)])
def test_inspect_names_tampered_and_truncated_files(target, embedded_bundles, tmp_path):
    b = embedded_bundles[target]
    m = json.loads((b / "manifest.json").read_text())
    graph = m["graphs"]["file"] if target == "executorch" else next(iter(m["graphs"]["binaries"].values()))
    c = _copy(b, tmp_path / "flip")
    data = bytearray((c / graph).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (c / graph).write_bytes(bytes(data))
    with pytest.raises(SpecPrefetchError, match=f"{graph}: sha256 mismatch"):
        inspect_bundle(c)
    c = _copy(b, tmp_path / "trunc")
    with open(c / "experts.spx", "r+b") as f:
        f.truncate(4096)
    with pytest.raises(SpecPrefetchError, match="experts.spx: 4096 bytes, the manifest says"):
        inspect_bundle(c)
    c = _copy(b, tmp_path / "extra")
    (c / "graphs" / "evil.bin").write_bytes(b"x")
    with pytest.raises(SpecPrefetchError, match="files not in the manifest: graphs/evil.bin"):
        inspect_bundle(c)
    c = _copy(b, tmp_path / "ver")
    mm = json.loads((c / "manifest.json").read_text())
    mm["version"] = 99
    (c / "manifest.json").write_text(json.dumps(mm))
    with pytest.raises(SpecPrefetchError, match="bundle version 99"):
        inspect_bundle(c)


def test_inspect_catches_signature_mismatch_behind_valid_hashes(embedded_bundles, tmp_path):
    """A manifest whose hashes were recomputed but whose signature lies is still caught by loading
    the program and comparing every method's inputs and outputs."""

    c = _copy(embedded_bundles["executorch"], tmp_path)
    mm = json.loads((c / "manifest.json").read_text())
    mm["graphs"]["signatures"]["head"]["outputs"] = [[[1, 999], "float32"]]
    (c / "manifest.json").write_text(json.dumps(mm))
    with pytest.raises(SpecPrefetchError, match="method head has inputs"):
        inspect_bundle(c)


def _rehash(c: Path, edit) -> None:
    """Edit the manifest, then fix every file hash, as an attacker or a careless script would."""
    from toolkit.artifacts import sha256_file

    mm = json.loads((c / "manifest.json").read_text())
    edit(mm)
    for rel in mm.get("files", {}) if isinstance(mm.get("files"), dict) else {}:
        if (c / rel).is_file():
            mm["files"][rel] = {"size": (c / rel).stat().st_size, "sha256": sha256_file(c / rel)}
    (c / "manifest.json").write_text(json.dumps(mm))


def test_inspect_checks_the_manifest_itself(embedded_bundles, tmp_path):
    b = embedded_bundles["executorch"]
    outside = tmp_path / "outside.pte"
    shutil.copy(b / "graphs" / "model.pte", outside)
    cases = [
        (lambda mm: mm["routing"].__setitem__("top_k", 2), "routing.top_k is 2, .*config.json says 4"),
        (lambda mm: mm["model"].__setitem__("config_hash", "0" * 16), "model config hash 0000000000000000"),
        (lambda mm: mm["graphs"].__setitem__("file", "../outside.pte"), "'../outside.pte' is not a path inside"),
        (lambda mm: mm["graphs"].__setitem__("file", str(outside)), "is not a path inside the bundle"),
        (lambda mm: mm["runtime"].__setitem__("expert_store", "model/config.json"),
         "model/config.json: not an expert store"),
        (lambda mm: mm["parity"].__setitem__("next_token_agreement", 0.5), "parity summary does not match"),
        (lambda mm: mm.__setitem__("files", ["x"]), "'files' must map paths"),
        (lambda mm: mm.pop("predictor"), "missing field 'predictor'"),
        (lambda mm: mm["kv"].__setitem__("layers", []), "kv.layers lists 0 layers"),
    ]
    for n, (edit, msg) in enumerate(cases):
        c = _copy(b, tmp_path / f"c{n}")
        _rehash(c, edit)
        with pytest.raises(SpecPrefetchError, match=msg):
            inspect_bundle(c)


@pytest.mark.slow  # ~18 s: a whole export that fails at parity (make test-all)
def test_failed_export_keeps_the_old_bundle_and_leaves_nothing(tiny_models, tmp_path):
    out = tmp_path / "b"
    export_bundle(tiny_models["mixtral"], out, _cfg(target="qnn"))
    before = (out / "manifest.json").read_bytes()
    bad = tmp_path / "short.jsonl"
    bad.write_text('{"text": "too short"}\n')
    with pytest.raises(SpecPrefetchError, match="short.jsonl: only 0 records"):
        export_bundle(tiny_models["mixtral"], out, _cfg(target="qnn", calibration=bad), overwrite=True)
    assert (out / "manifest.json").read_bytes() == before and inspect_bundle(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "short.jsonl"]
    m = export_bundle(tiny_models["mixtral"], out, _cfg(target="executorch"), overwrite=True)  # replaces it
    assert m["target"] == "executorch" and inspect_bundle(out)["target"] == "executorch"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "short.jsonl"]
    with pytest.raises(SpecPrefetchError, match="--window 0"):
        export_bundle(tiny_models["mixtral"], out, _cfg(window=0), overwrite=True)


def test_cli_export_and_inspect(tiny_models, tmp_path):
    r = CliRunner().invoke(main, ["export", str(tiny_models["olmoe"]), "--target", "qnn", "--max-seq", "24",
                                  "--parity-prompts", "2", "--prompt-tokens", "8", "--decode-tokens", "4",
                                  "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    assert "Parity: qnn-htp-simulator SM8750" in r.output and "**passed**" in r.output
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "b")])
    assert r.exit_code == 0 and "valid qnn bundle for SM8750" in r.output, r.output
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "b"), "--json"])
    assert json.loads(r.output)["family"] == "olmoe"
    (tmp_path / "b" / "experts.spx").write_bytes(b"")
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "b")])
    assert r.exit_code == 2 and "experts.spx: 0 bytes" in r.output
    r = CliRunner().invoke(main, ["export", str(tiny_models["olmoe"]), "--tolerance", "bogus=1",
                                  "--out", str(tmp_path / "c")])
    assert r.exit_code == 2 and "unknown key(s) ['bogus']" in r.output


# -- Qualcomm AI Hub: errors within seconds, and the job flow against a local double ---------------

def _ini(path: Path, api_url: str) -> Path:
    path.write_text(f"[api]\napi_token = not-a-real-token\napi_url = {api_url}\nweb_url = {api_url}\n")
    return path


def test_qaihub_without_token_fails_at_once(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("QAIHUB_CLIENT_INI", raising=False)
    t0 = time.monotonic()
    with pytest.raises(SpecPrefetchError,
                       match="no Qualcomm AI Hub API token .*client.ini not found.*qai-hub configure"):
        export_bundle(tiny_models["mixtral"], tmp_path / "b", _cfg(target="qai-hub"))
    assert time.monotonic() - t0 < 5


def test_qaihub_without_network_fails_within_timeout(tiny_models, tmp_path, monkeypatch):
    """A configured token but no reachable service: our own deadline, not the client's ~46 s."""
    monkeypatch.setenv("QAIHUB_CLIENT_INI", str(_ini(tmp_path / "c.ini", "https://workbench.aihub.qualcomm.com")))
    t0 = time.monotonic()
    with pytest.raises(SpecPrefetchError, match="unreachable|did not answer"):
        export_bundle(tiny_models["mixtral"], tmp_path / "b", _cfg(target="qai-hub", hub_timeout_s=3))
    assert time.monotonic() - t0 < 10
    # a host that accepts TCP but never speaks HTTP: the real client, bounded by our deadline
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    monkeypatch.setenv("QAIHUB_CLIENT_INI", str(_ini(tmp_path / "d.ini", f"http://127.0.0.1:{port}")))
    t0 = time.monotonic()
    try:
        with pytest.raises(SpecPrefetchError, match="did not answer within 3 s|refused the request"):
            export_bundle(tiny_models["mixtral"], tmp_path / "b", _cfg(target="qai-hub", hub_timeout_s=3))
    finally:
        srv.close()
    assert time.monotonic() - t0 < 12


class _LocalHub:
    """Stands in for the qai_hub module behind the network: compile jobs compile locally with
    onnxruntime-qnn into the precompiled_qnn_onnx layout AI Hub returns (a directory with the
    EPContext model and its binary); profile jobs return an execution summary."""

    def __init__(self, root: Path):
        self.root, self.compiled, self.profiled = root, [], []

    def get_devices(self, name=None):
        return [f"device:{name}"] if name == "Snapdragon 8 Elite QRD" else []

    def submit_compile_job(self, model, device, name, options, retry):
        from export.qnn_target import compile_context

        assert "--target_runtime precompiled_qnn_onnx" in options and retry is False
        hub = self

        class Job:
            job_id = f"j{len(hub.compiled)}"

            def wait(self, timeout=None):
                assert timeout == 3600.0
                return type("S", (), {"success": True, "message": ""})()

            def download_target_model(self, dest):
                d = Path(dest)
                d.mkdir(parents=True)
                compile_context(Path(model), d / "model.onnx", "SM8750", fp16=True)
                return str(d)

            def get_target_model(self):
                return self.job_id
        self.compiled.append(name)
        return Job()

    def submit_profile_job(self, model, device, name, retry):
        self.profiled.append(model)
        return type("P", (), {"job_id": "p" + model,
                              "download_profile": lambda self: {"execution_summary": {
                                  "estimated_inference_time": 123, "estimated_inference_peak_memory": 4096}}})()


def test_qaihub_job_flow_with_local_service(tiny_models, tmp_path, monkeypatch):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    monkeypatch.setenv("QAIHUB_CLIENT_INI", str(_ini(tmp_path / "c.ini", f"http://127.0.0.1:{srv.getsockname()[1]}")))
    hub = _LocalHub(tmp_path)
    try:
        m = export_bundle(tiny_models["mixtral"], tmp_path / "b", _cfg(target="qai-hub", hub_client=hub))
    finally:
        srv.close()
    assert len(hub.compiled) == len(m["graphs"]["files"]) == len(hub.profiled)
    assert m["target"] == "qai-hub" and m["parity"]["passed"]
    prof = json.loads((tmp_path / "b" / "graphs" / "hub_profile.json").read_text())
    assert prof["head"]["estimated_inference_time_us"] == 123
    assert inspect_bundle(tmp_path / "b")["target"] == "qai-hub"


def test_export_help_names_targets():
    r = subprocess.run([sys.executable, "-m", "toolkit.cli", "export", "--help"], capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0 and "executorch|qnn|qai-hub" in r.stdout


def test_qaihub_unpack_zip_and_refuse_escaping_binary(tmp_path):
    """AI Hub downloads come as a directory or a zip; a model whose EPContext node points outside
    the download is refused, never copied from the host."""
    import zipfile

    import onnx

    from export.qaihub_target import _unpack
    from export.qnn_target import compile_context, context_bin

    class M(torch.nn.Module):
        def forward(self, x):
            return x * 2 + 1

    torch.onnx.export(M(), (torch.randn(1, 8),), str(tmp_path / "m.onnx"), input_names=["x"], dynamo=False,
                      opset_version=17)
    d = tmp_path / "dl"
    d.mkdir()
    compile_context(tmp_path / "m.onnx", d / "model.onnx", "SM8750", fp16=True)
    z = tmp_path / "dl.zip"
    with zipfile.ZipFile(z, "w") as f:
        for p in d.iterdir():
            f.write(p, f"job/{p.name}")
    dest = tmp_path / "graphs"
    dest.mkdir()
    got = _unpack(z, dest, "head")
    assert got == dest / "head_ctx.onnx" and context_bin(got).read_bytes() == context_bin(d / "model.onnx").read_bytes()
    node = next(n for n in onnx.load(str(got)).graph.node if n.op_type == "EPContext")
    assert next(a.s for a in node.attribute if a.name == "ep_cache_context") == b"head_ctx_qnn.bin"
    evil = onnx.load(str(d / "model.onnx"))
    for n in evil.graph.node:
        for a in n.attribute:
            if a.name == "ep_cache_context":
                a.s = b"../../etc/passwd"
    onnx.save(evil, str(d / "model.onnx"))
    with pytest.raises(SpecPrefetchError, match="outside the download"):
        _unpack(d, dest, "embed")
