"""`info`: geometry and expert bytes, checked against numbers worked out by hand."""
from __future__ import annotations

import json
import shutil

from click.testing import CliRunner

from toolkit.cli import main
from toolkit.models.info import expert_bytes, info


def a64(n: int) -> int:
    return -(-n // 64) * 64


def test_embedded_model_bytes(embedded):
    d = info(str(embedded))
    h, i = 256, 80
    assert d["family"] == "qwen3_moe"
    assert (d["layers"], d["experts_per_layer"], d["top_k"]) == (8, 32, 4)
    assert d["moe_layers"] == list(range(8)) and d["dense_layers"] == []
    assert d["bytes_per_expert"]["fp16"] == 3 * h * i * 2 == 122_880
    # int8: one byte a weight plus an fp16 scale per output row; every section starts on 64 bytes
    # (gate/up scales: 160 B padded to 192)
    assert d["bytes_per_expert"]["int8"] == 3 * h * i + a64(i * 2) * 2 + a64(h * 2) == 62_336
    # int4: half a byte a weight plus an fp16 scale per 32 inputs per row
    # (the down matrix's 80 inputs are padded to 96: three whole groups)
    assert d["bytes_per_expert"]["int4"] == 2 * i * h // 2 + h * 96 // 2 + (2 * i * (h // 32) + h * 3) * 2
    assert d["bytes_per_expert_4k_aligned"]["fp16"] == 122_880
    assert d["total_expert_bytes"]["fp16"] == 256 * 122_880
    assert d["expert_params"] == 8 * 32 * 3 * h * i
    assert d["total_params"] == 18_420_992
    assert d["non_expert_params"] == 18_420_992 - 8 * 32 * 3 * h * i
    assert d["non_expert_bytes"]["checkpoint"] == d["non_expert_params"] * 2  # stored as fp16


def test_shared_experts_and_dense_layers(tiny_models):
    d = info(str(tiny_models["deepseek_v3"]))
    assert d["shared_experts"] == 1 and d["dense_layers"] == [0] and d["moe_layers"] == [1, 2]
    assert "sigmoid + selection bias" in d["score_function"]
    assert d["group_limited"] == "2 of 4 groups (top2sum)"


def test_gpt_oss_biases_count(tiny_models):
    d = info(str(tiny_models["gpt_oss"]))
    h, i = 64, 48
    assert d["params_per_expert"] == 3 * h * i + 2 * i + h
    # sections start on 64 bytes: the two 96-byte biases are padded to 128
    assert d["bytes_per_expert"]["fp16"] == 3 * h * i * 2 + 2 * a64(i * 2) + a64(h * 2) == 18_816


def test_config_only_directory(tiny_models, tmp_path):
    """A config.json without weights (e.g. a 30B model's config) still gives the geometry."""
    shutil.copy(tiny_models["qwen3_moe"] / "config.json", tmp_path / "config.json")
    d = info(str(tmp_path))
    full = info(str(tiny_models["qwen3_moe"]))
    assert d["total_expert_bytes"] == full["total_expert_bytes"]
    assert d["total_params"] == full["total_params"]
    assert d["checkpoint_bytes"] is None


def test_cli_info_json_and_text(embedded, tiny_models):
    r = CliRunner().invoke(main, ["info", str(tiny_models["mixtral"]), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["family"] == "mixtral"
    r = CliRunner().invoke(main, ["info", "embedded"])
    assert r.exit_code == 0
    assert "32 per MoE layer, top-4" in r.output and "122,880 B each" in r.output


def test_cli_errors_are_one_line(tmp_path):
    r = CliRunner().invoke(main, ["info", str(tmp_path / "missing")])
    assert r.exit_code == 2
    assert r.output.strip() == f"error: model directory not found: {tmp_path / 'missing'}"


def test_quant_bytes_monotone(tiny_models):
    from toolkit.models.loader import inspect_model_dir

    g = inspect_model_dir(tiny_models["olmoe"]).geometry
    assert expert_bytes(g, "int4") < expert_bytes(g, "int8") < expert_bytes(g, "fp16")
