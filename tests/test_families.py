"""Every family: load a tiny real checkpoint, reproduce its router, read its experts from disk."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from toolkit.errors import SpecPrefetchError
from toolkit.models.checkpoint import ExpertReader
from toolkit.models.families import FAMILIES, family_for, select_experts
from toolkit.models.loader import inspect_model_dir, load_model
from toolkit.models.tiny import TINY_FAMILIES

EXPECTED = {  # family -> (moe layers, dense layers, experts, top-k, shared)
    "qwen3_moe": ((1, 2, 3), (0,), 8, 2, 0),
    "qwen3_vl_moe": ((0, 1, 2), (), 8, 2, 0),
    "deepseek_v2": ((1, 2), (0,), 8, 2, 1),
    "deepseek_v3": ((1, 2), (0,), 8, 2, 1),
    "mixtral": ((0, 1), (), 8, 2, 0),
    "olmoe": ((0, 1), (), 8, 2, 0),
    "gpt_oss": ((0, 1), (), 8, 2, 0),
}


def test_every_family_has_a_tiny_config():
    assert sorted(f.name for f in FAMILIES) == sorted(TINY_FAMILIES)


@pytest.mark.parametrize("fam", TINY_FAMILIES)
def test_geometry(tiny_models, fam):
    spec = inspect_model_dir(tiny_models[fam])
    g = spec.geometry
    moe, dense, e, k, shared = EXPECTED[fam]
    assert spec.family.name == fam
    assert (g.moe_layers, g.dense_layers, g.routing.num_experts, g.routing.top_k,
            g.n_shared_experts) == (moe, dense, e, k, shared)


@pytest.mark.parametrize("fam", TINY_FAMILIES)
def test_select_experts_reproduces_the_model_router(tiny_models, fam):
    lm = load_model(tiny_models[fam])
    torch.manual_seed(0)
    for layer in lm.geometry.moe_layers:
        router = lm.family.router(lm.model, layer)
        h = torch.randn(64, lm.geometry.hidden_size)
        logits, weights, ids = router(h)
        _, _, bias = lm.family.router_params(lm.model, layer)
        w2, ids2 = select_experts(logits, lm.geometry.routing, bias)
        dense_ref = torch.zeros(64, 8).scatter(1, ids.long(), weights.float())
        dense_ours = torch.zeros(64, 8).scatter(1, ids2, w2)
        assert torch.equal(ids.sort(-1).values.long(), ids2.sort(-1).values)
        assert torch.allclose(dense_ref, dense_ours, atol=1e-6)


@pytest.mark.parametrize("fam", TINY_FAMILIES)
def test_expert_reader_matches_the_loaded_model(tiny_models, fam):
    """Experts sliced from the safetensors files compute what the model's expert module does."""
    lm = load_model(tiny_models[fam])
    reader = ExpertReader(lm.spec)
    tc = lm.family.text_config(lm.spec.config)
    torch.manual_seed(0)
    for layer in lm.geometry.moe_layers:
        experts = lm.family.moe_block(lm.model, layer).experts
        for e in (0, 3, 7):
            mats = {k: v.float() for k, v in reader.read_expert(layer, e).items()}
            x = torch.randn(5, lm.geometry.hidden_size)
            ref = experts(x, torch.full((5, 1), e), torch.ones(5, 1))
            got = lm.family.expert_forward(mats, x, tc)
            assert torch.allclose(ref, got, atol=1e-5), (fam, layer, e)


def test_expert_reader_rejects_bad_indices(tiny_models):
    reader = ExpertReader(inspect_model_dir(tiny_models["qwen3_moe"]))
    with pytest.raises(SpecPrefetchError, match="layer 0 is not a MoE layer"):
        reader.read_expert(0, 0)
    with pytest.raises(SpecPrefetchError, match="expert 8 out of range"):
        reader.read_expert(1, 8)


def test_unknown_family_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SpecPrefetchError) as e:
        inspect_model_dir(tmp_path)
    msg = str(e.value)
    assert "'llama' is not a supported MoE family" in msg
    for f in TINY_FAMILIES:
        assert f in msg
    assert str(tmp_path / "config.json") in msg
    with pytest.raises(SpecPrefetchError, match="not a supported"):
        family_for(None)


def test_missing_and_bad_directories(tmp_path):
    with pytest.raises(SpecPrefetchError, match="model directory not found"):
        inspect_model_dir(tmp_path / "nope")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SpecPrefetchError, match="not a directory"):
        inspect_model_dir(f)
    with pytest.raises(SpecPrefetchError, match="no config.json"):
        inspect_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpecPrefetchError, match="config.json is not valid JSON"):
        inspect_model_dir(tmp_path)


def test_incomplete_config_is_named(tiny_models, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_models["mixtral"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_experts_per_tok"] = 99
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecPrefetchError, match="top-k 99 does not fit 8 experts"):
        inspect_model_dir(d)


def test_pickle_checkpoints_are_refused(tiny_models, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(tiny_models["olmoe"] / "config.json", d)
    torch.save({"w": torch.zeros(1)}, d / "pytorch_model.bin")
    with pytest.raises(SpecPrefetchError, match="pickle checkpoints found .*pytorch_model.bin.* refused"):
        inspect_model_dir(d)


def test_missing_shard_of_an_index_is_named(tiny_models, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_models["olmoe"], d)
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(SpecPrefetchError, match="model-00002-of-00002.safetensors"):
        inspect_model_dir(d)


def test_truncated_weights_fail_clearly(tiny_models, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_models["olmoe"], d)
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[:5000])
    with pytest.raises(SpecPrefetchError, match="truncated safetensors|loading the weights failed"):
        load_model(d)


@pytest.mark.parametrize("fam", TINY_FAMILIES)
def test_router_bank_from_checkpoint_matches_model(tiny_models, fam):
    from toolkit.models.routers import load_router_bank

    lm = load_model(tiny_models[fam])
    bank = load_router_bank(lm.spec)
    torch.manual_seed(0)
    for li, layer in enumerate(lm.geometry.moe_layers):
        h = torch.randn(16, lm.geometry.hidden_size)
        logits, _, ids = lm.family.router(lm.model, layer)(h)
        assert torch.allclose(bank.logits(h, li), logits.float(), atol=1e-5)
        top = bank.selection_scores(bank.logits(h, li), li).topk(2, -1).indices
        assert torch.equal(top.sort(-1).values, ids.long().sort(-1).values)


def test_grouped_selection_matches_deepseek_v3_router_at_scale():
    """DeepSeek-V3's router at its real width (256 experts, 8 groups, top-4 groups, top-8, a
    selection bias): float32 rounding of the group step must not reorder the selected experts."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from toolkit.models.families import RoutingSpec, select_experts

    cfg = DeepseekV3Config(n_routed_experts=256, n_group=8, topk_group=4, num_experts_per_tok=8, hidden_size=32,
                           routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(256, 32, generator=g) * 0.3)
        router.e_score_correction_bias.copy_(torch.randn(256, generator=g) * 0.05)
        logits, w_ref, ids_ref = router(torch.randn(2000, 32, generator=g))
    spec = RoutingSpec(num_experts=256, top_k=8, score_func="sigmoid", n_group=8, topk_group=4, group_score="top2sum",
                       score_bias=True, routed_scaling_factor=2.5, norm_topk_prob=True)
    w, ids = select_experts(logits, spec, router.e_score_correction_bias)
    same = (ids.sort(-1).values == ids_ref.sort(-1).values).all(-1)
    assert bool(same.all()), f"{int((~same).sum())} of 2000 tokens select other experts"
    order = ids_ref.argsort(-1)
    torch.testing.assert_close(w.gather(-1, ids.argsort(-1)), w_ref.gather(-1, order), rtol=1e-5, atol=1e-6)
