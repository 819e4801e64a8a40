"""`embedded-vl`, the shipped vision-language demo model (toolkit/models/embedded_vl.py, trained by
toolkit/embedded/vl.py): assembled from the embedded model and the shipped tower, it is the embedded model
on text, names what the generated pictures show, and is a model name every command takes."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from toolkit.errors import SpecPrefetchError
from toolkit.models import embedded_vl as evl
from toolkit.models.shipped import EMBEDDED_DIR, VL_DIR


@pytest.fixture(scope="module")
def assembled(tmp_path_factory) -> Path:
    return evl.assemble(tmp_path_factory.mktemp("evl") / "embedded-vl")


def _load(path: Path):
    import transformers as T

    return T.Qwen3VLMoeForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()


def test_on_text_it_is_the_embedded_model(assembled):
    """The language model is frozen: the same logits, bit for bit, on a text prompt."""
    import transformers as T

    lm = T.AutoModelForCausalLM.from_pretrained(str(EMBEDDED_DIR), dtype=torch.float32).eval()
    ids = torch.tensor([[431, 1544, 2310, 358, 2994, 1827, 10, 20, 30, 856, 290]])
    with torch.no_grad():
        assert torch.equal(lm(ids).logits, _load(assembled)(input_ids=ids).logits)
    cfg = json.loads((assembled / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_vl_moe" and (assembled / "preprocessor_config.json").is_file()


def test_it_names_the_pictures_and_an_untrained_tower_does_not(assembled):
    """Held-out pictures (another seed than the record's): the shipped tower names shape and colour well above
    chance; the same model with a fresh tower does not (so the check can fail)."""
    from transformers import AutoTokenizer

    from toolkit.embedded.vl import evaluate

    recipe, record = evl.shipped_recipe()
    tok = AutoTokenizer.from_pretrained(str(assembled))
    got = evaluate(_load(assembled), recipe, tok, n=24, seed=7)
    assert got["accuracy"] >= 0.6, got
    assert record["eval"]["accuracy"] >= 0.6 and record["eval"]["pictures"] >= 100
    fresh = evaluate(evl.build_model(recipe), recipe, tok, n=24, seed=7)
    assert fresh["accuracy"] <= 0.2, fresh


def test_a_model_name_assembled_once_into_the_cache(tmp_path, monkeypatch):
    from toolkit.models.loader import inspect_model_dir, resolve_model_dir, shipped_model_name

    monkeypatch.setenv("SPECPREFETCH_PROFILES", str(tmp_path / "cache" / "profiles"))
    d = resolve_model_dir("embedded-vl")
    assert d.parent == tmp_path / "cache" / "models" and (d / "model.safetensors").is_file()
    assert shipped_model_name(d) == "embedded-vl" and shipped_model_name(EMBEDDED_DIR) == "embedded"
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_dir("embedded-vl") == d and (d / "model.safetensors").stat().st_mtime_ns == stamp
    spec = inspect_model_dir(d)
    assert spec.family.is_vision_language and spec.geometry.routing.num_experts == 32


def test_assembly_refuses_another_language_model(tmp_path):
    src = tmp_path / "vl"
    shutil.copytree(VL_DIR, src)
    rec = json.loads((src / evl.RECORD_FILE).read_text())
    rec["language_model"]["weights_sha256"] = "0" * 64
    (src / evl.RECORD_FILE).write_text(json.dumps(rec))
    with pytest.raises(SpecPrefetchError, match=r"vl\.json: its vision tower was trained with the embedded model "
                                                r"of sha256 000000000000"):
        evl.assemble(tmp_path / "out", src)
    assert not (tmp_path / "out").exists()


def test_training_writes_the_shipped_files(tmp_path):
    """Two steps of the recipe (the shipped one took 1,500): the three files, the record, and no replacing."""
    from toolkit.embedded.vl import train

    recipe = evl.Recipe(steps=2, batch_size=4, eval_pictures=2, side=64)
    out = train(tmp_path / "vl", recipe, progress=False)
    assert sorted(p.name for p in out.iterdir()) == sorted([evl.VISION_FILE, evl.RECORD_FILE, evl.PROCESSOR_FILE])
    rec = json.loads((out / evl.RECORD_FILE).read_text())
    assert rec["recipe"]["steps"] == 2 and len(rec["train"]["loss"]) == 2 and rec["eval"]["pictures"] == 2
    assert rec["language_model"]["frozen"] is True and np.isfinite(rec["train"]["loss_first"])
    with pytest.raises(SpecPrefetchError, match="exists"):
        train(tmp_path / "vl", recipe, progress=False)


def test_the_cache_entry_follows_what_the_checkpoint_is_made_of(monkeypatch):
    """A change to the config this module writes, or to its layout, names a new cache entry: an old
    checkpoint is never reused for a new recipe of the same shipped files."""
    first = evl.assembled_path()
    assert evl.assembled_path() == first
    monkeypatch.setattr(evl, "ASSEMBLY_FORMAT", evl.ASSEMBLY_FORMAT + 1)
    assert evl.assembled_path() != first
    monkeypatch.undo()
    real = evl.vl_config

    def other(recipe, lm_dir=None):
        c = real(recipe, lm_dir)
        c.vision_config.num_position_embeddings += 1
        return c
    monkeypatch.setattr(evl, "vl_config", other)
    assert evl.assembled_path() != first


@pytest.mark.parametrize("argv, says", [(["eval", "--pictures", "0"], "--pictures 0"),
                                        (["train", "--out", "x", "--steps", "0"], "--steps 0"),
                                        (["train", "--out", "x", "--side", "100"], "--side 100")])
def test_the_training_commands_refuse_bad_numbers(argv, says, capsys):
    from toolkit.embedded.vl import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err.splitlines()[-1], err
