"""Adapter checkpoints (adapters/checkpoint.py): a malformed adapter.json is one clear error, from the
loader and from the CLI."""
from __future__ import annotations

import json
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
from toolkit.traces.capture import TraceSettings, run_trace


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


class TestMalformedAdapterJson:
    """A malformed adapter.json is one line naming the file and the field."""

    @pytest.mark.parametrize("edit", MALFORMED)
    def test_malformed_adapter_json_is_a_clear_error(self, tiny_adapter, tiny_models, tmp_path, edit):
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

    def test_adapter_json_that_is_not_json(self, tiny_adapter, tmp_path):
        _, adapter = tiny_adapter
        bad = tmp_path / "bad"
        shutil.copytree(adapter, bad)
        (bad / "adapter.json").write_text('{"format": "specprefetch-adapter",')
        with pytest.raises(SpecPrefetchError, match="adapter.json is not valid JSON"):
            load_adapter(bad)

    @pytest.mark.parametrize("edit", ["-model", "rank=\"64\"", "model.num_experts=8.5", "not json",
                                      "not an object", "-horizons"])
    def test_cli_reports_a_malformed_adapter_in_one_line(self, tiny_adapter, tmp_path, edit):
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

    def test_read_adapter_meta_validates(self, tiny_adapter, tmp_path):
        from adapters.checkpoint import read_adapter_meta

        _, adapter = tiny_adapter
        assert read_adapter_meta(adapter)["rank"] == 4
        bad = tmp_path / "bad"
        shutil.copytree(adapter, bad)
        (bad / "adapter.json").write_text("[]")
        with pytest.raises(SpecPrefetchError, match="adapter.json: malformed adapter config: not a JSON object"):
            read_adapter_meta(bad)
