"""The shipped phone-class model (`phone`): OLMoE's routing geometry (16 MoE layers x 64 experts, top-8),
trained here; it loads by its short name, routes without collapse, and goes through trace, train, export
and both engines with transformers' tokens."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import HELDOUT
from toolkit.cli import main
from toolkit.embedded.report import report, routing_locality
from toolkit.models.loader import inspect_model_dir, phone_model_dir, resolve_model_dir, shipped_model_name


@pytest.fixture(scope="module")
def phone() -> Path:
    return phone_model_dir()


def test_shipped_files_and_short_name(phone):
    assert resolve_model_dir("phone") == phone and shipped_model_name(phone) == "phone"
    assert shipped_model_name(resolve_model_dir("embedded")) == "embedded" and shipped_model_name(HELDOUT) is None
    names = {p.name for p in phone.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "train_log.json"} <= names
    assert (phone / "model.safetensors").stat().st_size < 64 * 2**20
    # the embedded model's tokenizer: one vocabulary for both shipped models
    assert (phone / "tokenizer.json").read_bytes() == (resolve_model_dir("embedded") / "tokenizer.json").read_bytes()
    spec = inspect_model_dir("phone")
    g = spec.geometry
    assert spec.family.name == "qwen3_moe" and len(g.moe_layers) == 16 and g.num_layers == 16
    assert g.routing.num_experts == 64 and g.routing.top_k == 8 and g.hidden_size == 256
    log = json.loads((phone / "train_log.json").read_text())
    assert log["recipe"]["seed"] == 1234 and log["recipe"]["router_aux_loss_coef"] > 0
    assert log["eval"][-1]["heldout_ppl"] < 9 and log["device"].startswith("cuda")
    r = CliRunner().invoke(main, ["info", "phone", "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["experts_per_layer"] == 64 and info["top_k"] == 8 and info["moe_intermediate_size"] == 32


def test_quality_and_routing_health(phone):
    r = report(phone, windows=2, samples=False)  # docs/embedded-model.md's figures use every held-out window
    assert r["heldout_ppl"] < 11.0  # an untrained model of this vocabulary sits near 4096
    for row in r["routing"]:
        assert row["load_entropy"] > 0.75 and row["experts_used"] >= 0.75, row
    loc = r["locality"]
    # a 512-token prompt touches most of a layer's 64 experts; consecutive tokens share some but not all
    assert all(0.5 < f <= 1.0 for f in loc["touched_frac"]["512"])
    assert all(0.05 < o < 0.9 for o in loc["overlap_prev"])


def test_routing_locality_counts():
    """Hand-made routing: 2 windows x 4 tokens x 1 layer x top-2 of 4 experts."""
    import numpy as np

    w = np.array([[[0, 1]], [[1, 2]], [[0, 1]], [[3, 2]]])  # [T=4, L=1, k=2]
    loc = routing_locality([w, w], 4, spans=(2, 4))
    assert loc["touched_frac"] == {"2": [0.75], "4": [1.0]}
    assert loc["overlap_prev"] == [round((1 / 2 + 1 / 2 + 0) / 3, 4)]
    # reuses: t1 e1 (1), t2 e0 (2), t2 e1 (1), t3 e2 (2) -> median 1.5, all within 8
    assert loc["reuse_distance_median"] == [1.5] and loc["reuse_within_8"] == [1.0]


def _cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    r = subprocess.run([str(Path(sys.executable).parent / "specprefetch"), *args], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"{args[0]}: {r.stderr[-2000:]}"
    return r


@pytest.fixture(scope="module")
def phone_adapter(tmp_path_factory) -> tuple[Path, Path]:
    """phone -> trace (4 prompts) -> adapter (30 steps): (trace, adapter)."""
    root = tmp_path_factory.mktemp("phone")
    _cli("trace", "phone", "--data", str(HELDOUT), "--out", str(root / "trace"), "--max-sequences", "4",
         "--prompt-tokens", "24", "--decode-tokens", "8", "--heldout-frac", "0.5")
    _cli("train", str(root / "trace"), "--out", str(root / "adapter"), "--steps", "30", "--rank", "16")
    return root / "trace", root / "adapter"


@pytest.mark.slow  # ~25 s: the shipped model's trace, adapter and both engines (make test-all)
def test_trace_train_and_run(phone_adapter, tmp_path):
    """The reference runner on the model itself (eager graphs, the fp16 store), a pool of 1 MiB (21 of its
    1024 experts), the adapter's prefetches: transformers' tokens."""
    trace, adapter = phone_adapter
    m = json.loads((trace / "manifest.json").read_text())
    assert m["model"]["num_experts"] == 64 and m["model"]["top_k"] == 8 and len(m["model"]["moe_layers"]) == 16
    js = tmp_path / "run.json"
    _cli("run", "phone", "--adapter", str(adapter), "--policy", "adapter+prediction", "--pool-mib", "1",
         "--prompt", "The kernel's memory allocator", "--max-new-tokens", "6", "--check", "--json", str(js))
    run = json.loads(js.read_text())["runs"][0]
    assert run["matches_unmodified_model"] is True and len(run["tokens"]) == 6
    assert run["counts"]["prefetch_issued"] > 0


@pytest.fixture(scope="module")
def phone_bundle(phone_adapter) -> Path:
    """The adapter's ExecuTorch bundle (fp32 program, int4 experts): several minutes to export on 2 cores."""
    out = phone_adapter[1].parent / "bundle"
    _cli("export", "phone", "--adapter", str(phone_adapter[1]), "--target", "executorch", "--experts", "int4",
         "--max-seq", "48", "--out", str(out), timeout=1800)
    return out


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_bundle_both_engines(phone_bundle, tmp_path):
    m = json.loads((phone_bundle / "manifest.json").read_text())
    assert m["model"]["num_experts"] == 64 and m["model"]["top_k"] == 8 and m["model"]["num_layers"] == 16
    assert json.loads((phone_bundle / "parity.json").read_text())["passed"]
    tokens = {}
    for engine in ("python", "native"):
        js = tmp_path / f"{engine}.json"
        _cli("run", str(phone_bundle), "--engine", engine, "--policy", "adapter+prediction", "--pool-mib", "1",
             "--prompt", "The kernel's memory allocator", "--max-new-tokens", "6", "--check", "--json", str(js),
             timeout=1800)
        run = json.loads(js.read_text())["runs"][0]
        assert run["matches_unmodified_model"] is True and len(run["tokens"]) == 6, engine
        tokens[engine] = run["tokens"]
    assert tokens["python"] == tokens["native"]
