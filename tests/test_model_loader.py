"""The model loader (toolkit/models/loader.py: inspect_model_dir and its safetensors checks), through the
commands that open a model: a truncated or damaged shard, or a sharded index that does not match its
shards, is named in one line by every command; `info` refuses a config that misses a size, does not
describe the weights or has no MoE layer; `tiny --set` is checked as every command checks a model
directory, before anything is written.

Real files and real commands (click's CliRunner); tiny models, private copies where a test damages
one. No test here needs the shared bundle."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import HELDOUT
from test_cli import FAMILY, cli, refused  # the CLI runner that fails on a traceback, the one-line-refusal check


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """The store and hash caches of this module live in a temporary directory."""
    monkeypatch.setenv("SPECPREFETCH_PROFILES", str(tmp_path_factory.getbasetemp() / "loader-cache" / "profiles"))


@pytest.fixture()
def model(tiny_models, tmp_path) -> Path:
    """A private copy of the tiny model (tests damage it)."""
    return Path(shutil.copytree(tiny_models[FAMILY], tmp_path / "model"))


@pytest.fixture(scope="module")
def art(tiny_models) -> dict:
    """The tiny model, under "M" as in tests/test_artifacts.py's `art` (the test that takes it copies it)."""
    return {"M": tiny_models[FAMILY]}


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


TINY_SETS = [("hidden_size=-64", "hidden_size is -64; it must be at least 1"),
             ("vocab_size=1e9", "refuses it"),
             ("vocab_size=1000000000", "vocab_size is 1000000000; it must be a whole number"),
             ("rope_parameters=null", "transformers cannot build the model"),
             ("num_experts_per_tok=100", "top-k 100 does not fit 8 experts"),
             ("num_hidden_layers=0", "num_hidden_layers is 0"),
             ("moe_intermediate_size=0", "the experts' intermediate size is 0"),
             ("mlp_only_layers=[0,1,2,3]", "describes no MoE layer")]


class TestShards:
    """A truncated or damaged safetensors shard, or a sharded index that does not match its shards, is named."""

    @pytest.mark.parametrize("command", sorted(SHARD_COMMANDS))
    def test_a_truncated_shard_is_named_by_every_command(self, command, model, tmp_path):
        f = _truncate(model, "half")
        line = refused(SHARD_COMMANDS[command](model, tmp_path), str(f), "truncated safetensors file")
        assert "its header describes" in line
        assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # nothing written, no leftovers

    @pytest.mark.parametrize("how,what", [("one-byte-short", "truncated"), ("header-only", "truncated"),
                                          ("no-header", "truncated"), ("bad-offsets", "corrupt safetensors header")])
    def test_damaged_shards_are_named(self, how, what, model):
        f = _truncate(model, how)
        refused(["info", model], str(f), what)

    def test_a_sharded_index_is_checked_shard_by_shard(self, model):
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


class TestConfigChecks:
    """`info` refuses a config that misses a size, does not describe the weights or has no MoE layer."""

    @pytest.mark.parametrize("family,key", [("qwen3_moe", "num_local_experts"), ("qwen3_moe", "moe_intermediate_size"),
                                            ("qwen3_moe", "hidden_size"), ("qwen3_moe", "num_experts_per_tok"),
                                            ("mixtral", "intermediate_size"), ("deepseek_v3", "n_routed_experts"),
                                            ("olmoe", "num_experts"), ("qwen3_vl_moe", "text_config.num_hidden_layers"),
                                            ("gpt_oss", "vocab_size")])
    def test_info_refuses_a_config_missing_a_size(self, family, key, tiny_models, tmp_path):
        cfg = json.loads((tiny_models[family] / "config.json").read_text())
        parent, _, leaf = key.rpartition(".")
        (cfg[parent] if parent else cfg).pop(leaf)
        (tmp_path / "config.json").write_text(json.dumps(cfg))  # config only: sizes would come from the config
        refused(["info", tmp_path], str(tmp_path / "config.json"), f"missing required key '{key}'")

    @pytest.mark.parametrize("edit,what", [({"num_local_experts": 16}, "describes expert tensor"),
                                           ({"moe_intermediate_size": 40},
                                            "does not describe the checkpoint's experts"),
                                           ({"hidden_size": 0}, "hidden_size is 0")])
    def test_info_refuses_a_config_that_does_not_match_the_weights(self, edit, what, model):
        cfg = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**cfg, **edit}))
        refused(["info", model], str(model / "config.json"), what)

    def test_info_refuses_a_config_with_no_moe_layer(self, art, tmp_path):
        m = Path(shutil.copytree(art["M"], tmp_path / "dense"))
        cfg = json.loads((m / "config.json").read_text())
        cfg["mlp_only_layers"] = [0, 1, 2, 3]
        (m / "config.json").write_text(json.dumps(cfg))
        refused(["info", m], "describes no MoE layer", "holds routed-expert weights in layers [1, 2, 3]")
        only = tmp_path / "config-only"
        only.mkdir()
        shutil.copy(m / "config.json", only / "config.json")
        refused(["info", only], "describes no MoE layer", "not a Mixture-of-Experts model")


class TestTinySet:
    """`tiny --set` is checked as every command checks a model directory, before anything is written."""

    @pytest.mark.parametrize("setting,what", TINY_SETS, ids=[s for s, _ in TINY_SETS])
    def test_tiny_set_is_checked_like_every_other_command(self, setting, what, tmp_path):
        line = refused(["tiny", FAMILY, "--out", tmp_path / "m", "--set", setting], "--set", what)
        assert str(tmp_path) not in line  # names the setting, not a temporary config
        assert not any(tmp_path.iterdir())


@pytest.mark.slow  # builds a random VLM (~5 s); the refusals below are in make test
def test_tiny_set_reaches_a_vision_language_models_sub_configs(tmp_path):
    """`tiny qwen3_vl_moe --set text_config.X=...`: a larger random VLM."""
    from toolkit.models.loader import inspect_model_dir

    m = tmp_path / "vl"
    assert cli("tiny", "qwen3_vl_moe", "--out", m, "--set", "text_config.num_local_experts=16",
               "--set", "text_config.hidden_size=96", "--set", "vision_config.out_hidden_size=96")[0] == 0
    g = inspect_model_dir(m).geometry
    assert (g.routing.num_experts, g.hidden_size) == (16, 96)


def test_tiny_set_refuses_bad_sub_config_settings(tmp_path):
    """The tower's output width must be the language model's (its features replace token embeddings): refused
    by name otherwise, before anything is written; an unknown sub-config or attribute is named."""
    for setting, what in (("text_config.hidden_size=96", "vision_config.out_hidden_size is 64, the language model's "
                                                         "hidden_size 96"),
                          ("nope.x=1", "has no sub-config 'nope'"), ("text_config.nope=1", "has no such attribute")):
        refused(["tiny", "qwen3_vl_moe", "--out", tmp_path / "x", "--set", setting], "--set", what)
        assert not (tmp_path / "x").exists()
