"""The shipped default model: loads through the HF path, is a trained model, routes without collapse."""
from __future__ import annotations

import json

import torch

from conftest import REPO
from toolkit.embedded.report import report
from toolkit.models.loader import inspect_model_dir, load_model


def test_shipped_files(embedded):
    names = {p.name for p in embedded.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "train_log.json"} <= names
    assert (embedded / "model.safetensors").stat().st_size < 40 * 2**20
    spec = inspect_model_dir(embedded)
    assert spec.family.name == "qwen3_moe" and spec.geometry.routing.num_experts == 32
    log = json.loads((embedded / "train_log.json").read_text())
    assert log["recipe"]["seed"] == 1234 and log["eval"][-1]["heldout_ppl"] < 8


def test_heldout_text_is_disjoint_from_training_documents():
    from toolkit.embedded.corpus import is_heldout

    rows = [json.loads(x) for x in (REPO / "toolkit/embedded/heldout.jsonl").read_text().splitlines()]
    assert len(rows) > 50
    assert all(is_heldout(r["id"], 0.01) for r in rows)


def test_quality_and_routing_health(embedded):
    r = report(embedded, windows=12)  # docs/embedded-model.md's figures use more; the bound is loose
    assert r["heldout_ppl"] < 10.0  # an untrained model of this vocabulary sits near 4096
    for row in r["routing"]:
        assert row["load_entropy"] > 0.75 and row["experts_used"] >= 0.75, row
    first = r["samples"][-1]
    assert "open" in first["continuation"]  # "To open a file for reading, use the :func:`open` ..."


def test_greedy_decoding_with_the_cache_matches_a_full_forward(embedded):
    """generate()'s cached greedy decode (what traces record) picks, at every step, the argmax of one
    uncached forward over the whole sequence: the KV cache changes nothing."""
    lm = load_model(embedded)
    x = lm.tokenizer("The kernel", return_tensors="pt")
    p = x["input_ids"].shape[1]
    a = lm.model.generate(**x, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert a.shape[1] == p + 16
    with torch.no_grad():
        logits = lm.model(input_ids=a, use_cache=False).logits
    assert logits[0, p - 1:-1].argmax(-1).tolist() == a[0, p:].tolist()
