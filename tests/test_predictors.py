"""Predictors, the adapter and evaluation (an undefined metric is null, n/a in the tables, never 0): real
traces of real (tiny and embedded) models."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from adapters.checkpoint import load_adapter
from adapters.lowrank import PrefetchAdapter
from adapters.train import TrainConfig, train_adapter
from conftest import HELDOUT
from test_cli import FAMILY, cli  # the tiny family; the CLI runner that fails on a traceback
from toolkit.errors import SpecPrefetchError
from toolkit.metrics import precision, recall, topk_hits, tpot_ms
from toolkit.models.loader import inspect_model_dir, load_model
from toolkit.models.routers import load_router_bank
from toolkit.models.tiny import TINY_FAMILIES
from toolkit.predictors.base import AdapterPredictor, NextGate
from toolkit.traces.batches import ShardStream, _dense_probs, batch_from_shard, iter_batches
from toolkit.predictors.draft import fake_quant, make_draft, speculative_generate
from toolkit.predictors.evaluate import ALL, evaluate, write_reports
from toolkit.traces.capture import TraceSettings, run_trace
from toolkit.traces.format import TraceReader


@pytest.fixture(scope="module")
def emb_trace(embedded, tmp_path_factory) -> Path:
    # batch 8: a batched trace records the unbatched one's tokens, experts and sampled rows (weights and
    # router inputs within fp16 rounding; tests/test_trace.py::TestBatchedTracing) in a sixth of the CPU time
    s = TraceSettings(max_sequences=60, prompt_tokens=128, decode_tokens=16, heldout_frac=0.2,
                      shard_tokens=1500, hidden_sample=0.5, batch=8)
    return run_trace(embedded, [HELDOUT], tmp_path_factory.mktemp("p") / "t", s, progress=False)


@pytest.fixture(scope="module")
def emb_adapter(emb_trace, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("a") / "adapter"
    r = train_adapter(emb_trace, out, TrainConfig(steps=250, val_every=50, batch_size=256), progress=False)
    return out, r


def test_metrics_by_hand():
    """The accumulators eval and train report from: hits over rows, None where nothing was measured."""
    real = torch.tensor([[0, 1], [2, 3]])
    scores = torch.tensor([[5.0, 1.0, 4.0, 0.0], [0.0, 1.0, 3.0, 2.0]])  # top-2: {0,2}, {2,3}
    assert topk_hits(scores, real, 2) == 1 + 2
    assert recall(topk_hits(scores, real, 2), 2, 2) == pytest.approx(0.75)
    assert topk_hits(scores, real, 3) == 2 + 2  # {0,2,1}, {2,3,1}
    assert recall(topk_hits(scores, real, 3), 2, 2) == 1.0
    assert precision(topk_hits(scores, real, 3), 2, 3) == pytest.approx(0.6667)
    assert recall(0, 0, 2) is None and precision(0, 0, 3) is None  # undefined, not 0
    assert tpot_ms([0.0, 0.1, 0.3]) == pytest.approx(150.0)


def test_cross_token_targets_come_from_the_next_token(emb_trace):
    r = TraceReader(emb_trace)
    a = next(r.iter_shards("train"))
    b = batch_from_shard(a, r.num_experts)
    rows = a["hidden_rows"]
    ids, ok = b.target_ids(7, 2)  # layer 7 + 2 = layer 1 of the next token
    j = np.nonzero(ok.numpy())[0][0]
    assert torch.equal(ids[j], torch.from_numpy(a["expert_ids"][rows[j] + 1, 1].astype(np.int64)))
    same, ok2 = b.target_ids(2, 1)
    assert ok2.all() and torch.equal(same, b.ids[:, 3])
    last = a["seq"][rows] != a["seq"][np.minimum(rows + 1, len(a["seq"]) - 1)]
    assert not ok[torch.from_numpy(last)].any()  # a sequence's last token has no next token


def test_targets_several_tokens_on_come_from_those_tokens(emb_trace):
    """Built with ahead=3, a batch's targets 2 and 3 tokens on (the next-visit heads' horizons 2L, 3L and the
    window's past them) are those tokens' routing, valid only where the sequence (and the shard) has them;
    a batch built with less refuses such a target."""
    r = TraceReader(emb_trace)
    a = next(r.iter_shards("train"))
    b = batch_from_shard(a, r.num_experts, ahead=3)
    rows, n, L = a["hidden_rows"], len(a["seq"]), b.num_layers
    assert b.later_ids.shape[1] == 2 and b.later_probs.shape[1] == 2
    for d in (2, 3):
        for i, layer in ((0, 0), (5, 5), (6, 2)):          # (source layer, target layer): horizon dL + layer - i
            ids, ok = b.target_ids(i, d * L + layer - i)
            probs = b.target_probs(i, d * L + layer - i)
            there = (rows + d < n) & (a["seq"][np.minimum(rows + d, n - 1)] == a["seq"][rows])
            assert torch.equal(ok, torch.from_numpy(there)) and there.any() and not there.all()
            j = np.nonzero(there)[0]
            assert torch.equal(ids[j], torch.from_numpy(a["expert_ids"][rows[j] + d, layer].astype(np.int64)))
            want = torch.from_numpy(_dense_probs(a, r.num_experts)[rows[j] + d, layer].astype(np.float32))
            assert torch.equal(probs[j], want)
    with pytest.raises(ValueError, match="ahead=1"):
        batch_from_shard(a, r.num_experts).target_ids(0, 2 * L)


def test_untrained_adapter_is_next_gate(embedded, emb_trace):
    spec = inspect_model_dir(embedded)
    bank = load_router_bank(spec)
    ad = PrefetchAdapter(num_layers=8, hidden_size=256, num_experts=32, rank=16)
    b = next(iter_batches(TraceReader(emb_trace), "heldout"))
    for i, h in [(0, 1), (3, 2), (7, 1), (6, 2)]:
        assert torch.allclose(AdapterPredictor(ad, bank).scores(b, i, h), NextGate(bank).scores(b, i, h))
    assert ad.params() == len(ad.pairs) * 16 * (256 + 32)
    assert len(ad.pairs) == 16  # 8 layers x 2 horizons, crossing the token boundary


def test_adapter_training_beats_next_gate(emb_adapter, emb_trace):
    path, r = emb_adapter
    v = r["validation"]
    for h in ("1", "2"):
        assert v["adapter"]["recall_at_k"][h] > v["next_gate"]["recall_at_k"][h] + 0.02
    res = evaluate(emb_trace, predictors=["next-gate", "adapter", "oracle"], adapter=path, progress=False)
    p = res["predictors"]
    for h in ("1", "2"):
        assert p["adapter"]["recall_at_k"][h] > p["next-gate"]["recall_at_k"][h]
        assert p["oracle"]["recall_at_k"][h] == 1.0
    # 8 MoE layers x (2 window horizons + the next 3 visits) pairs of rank 64 over H=256, E=32
    assert p["adapter"]["params"] == 40 * 64 * (256 + 32) == 737_280 and p["next-gate"]["params"] == 0
    assert 0.037 < r["share_of_model"] < 0.043
    # the next-visit heads (horizons L = 8, 16, 24) beat the layer's own router on its own input (next-gate
    # there), the farther visits predicted less well than the next
    rec = {h: (p["adapter"]["recall_at_k"][h], p["next-gate"]["recall_at_k"][h]) for h in ("8", "16", "24")}
    assert all(a > g for a, g in rec.values()) and rec["8"][0] > rec["24"][0], rec


def test_training_is_reproducible(emb_trace, tmp_path):
    cfg = TrainConfig(steps=30, val_every=10, batch_size=128, seed=3, rank=8)
    train_adapter(emb_trace, tmp_path / "a", cfg, progress=False)
    train_adapter(emb_trace, tmp_path / "b", cfg, progress=False)
    a = (tmp_path / "a" / "adapter.safetensors").read_bytes()
    assert a == (tmp_path / "b" / "adapter.safetensors").read_bytes()
    # the seed is what fixes the run: another seed trains other weights
    train_adapter(emb_trace, tmp_path / "c", dataclasses.replace(cfg, seed=4), progress=False)
    assert a != (tmp_path / "c" / "adapter.safetensors").read_bytes()


def test_streaming_holds_less_than_the_trace(emb_trace, tmp_path):
    """Training with a memory cap below the trace size: the stream never holds more than the cap."""
    r = TraceReader(emb_trace)
    total = sum(s["bytes"] for s in r.shards("train"))
    cap_mb = 1
    assert total > 3 * cap_mb * 2**20
    out = train_adapter(emb_trace, tmp_path / "a", TrainConfig(steps=60, val_every=20, batch_size=64,
                        rank=8, max_memory_mb=cap_mb), progress=False)
    # the validation set is bounded too (past its first shard's batch)
    from toolkit.traces.batches import validation_batches
    every = validation_batches(r, ahead=3)
    assert len(every) > 1 and len(validation_batches(r, ahead=3, max_bytes=1)) == 1
    two = ShardStream.nbytes(every[0]) + ShardStream.nbytes(every[1])
    assert len(validation_batches(r, ahead=3, max_bytes=two)) == 2       # the bound's edge, both sides
    assert len(validation_batches(r, ahead=3, max_bytes=two - 1)) == 1
    # a shard's batch holds the routing of the tokens its heads predict (three on: the default next visits),
    # more than the shard's file: the bound is the cap plus two of the largest such batches
    ahead = ShardStream(r, "train", batch_size=64, seed=0, ahead=3)
    biggest = max(ShardStream.nbytes(b) for b in map(ahead._load, r.shards("train")) if b is not None)
    assert 0 < out["training"]["stream_peak_bytes"] <= cap_mb * 2**20 + 2 * biggest
    stream = ShardStream(r, "train", batch_size=64, seed=0, max_bytes=cap_mb * 2**20)
    seen = set()
    for _, b in zip(range(400), stream):
        seen.update(b.seq.tolist())
    assert stream.epochs >= 1  # went through every shard
    from toolkit.traces.batches import validation_seqs

    val = validation_seqs(r)
    assert val and seen == set(r.manifest["split"]["train"]) - val


def test_adapter_checkpoint_validation(emb_adapter, tiny_models, tmp_path):
    path, _ = emb_adapter
    ad, meta = load_adapter(path, inspect_model_dir("embedded"))
    assert meta["rank"] == 64 and meta["horizons"] == [1, 2] and ad.params() == meta["params"]
    with pytest.raises(SpecPrefetchError, match="trained for model config .* not .*"):
        load_adapter(path, inspect_model_dir(tiny_models["qwen3_moe"]))
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    w = bad / "adapter.safetensors"
    data = bytearray(w.read_bytes())
    data[-5] ^= 1
    w.write_bytes(bytes(data))
    with pytest.raises(SpecPrefetchError, match="adapter.safetensors: checksum mismatch"):
        load_adapter(bad)
    with pytest.raises(SpecPrefetchError, match="adapter directory not found"):
        load_adapter(tmp_path / "none")
    assert not list(path.parent.glob("*.partial"))


def test_eval_report_files(emb_adapter, emb_trace, tmp_path):
    path, _ = emb_adapter
    res = evaluate(emb_trace, predictors=list(ALL), adapter=path, progress=False)
    md, png = write_reports(res, tmp_path / "e.json")
    j = json.loads((tmp_path / "e.json").read_text())
    assert j["k"] == 4 and set(j["predictors"]) == set(ALL)
    for _name, p in j["predictors"].items():
        assert set(p["recall_at_k"]) == {"1", "2", "8", "16", "24"} and isinstance(p["params"], int)
        assert all(0.0 <= x <= 1.0 for x in p["recall_at_k"].values())
        assert len(p["per_layer_recall_at_k"]["1"]) == 8
    assert j["predictors"]["draft"]["acceptance_rate"] > 0.5
    assert "| adapter |" in md.read_text() and png.stat().st_size > 10_000


def test_undefined_metrics_are_na_not_zero(tmp_path):
    """Within-token recall at h=2 on a model with 2 MoE layers has nothing to measure: every h=2
    target is in the next token. It is null / n/a, even for the oracle; h=1 is measured."""
    m, tr, ev = tmp_path / "m", tmp_path / "tr", tmp_path / "e.json"
    assert cli("tiny", FAMILY, "--out", m, "--set", "num_hidden_layers=3")[0] == 0  # MoE layers 1, 2
    code, out = cli("trace", m, "--data", HELDOUT, "--out", tr, "--max-sequences", "4", "--prompt-tokens", "6",
                    "--decode-tokens", "3", "--heldout-frac", "0.5")
    assert code == 0, out
    code, out = cli("eval", tr, "--predictors", "next-gate,oracle", "--horizons", "1,2", "--json", ev)
    assert code == 0, out
    j = json.loads(ev.read_text())
    for name in ("next-gate", "oracle"):
        p = j["predictors"][name]
        assert p["recall_at_k_within_token"]["2"] is None and p["recall_at_k_within_token"]["1"] is not None
        assert p["recall_at_k"]["2"] is not None
    assert j["predictors"]["oracle"]["recall_at_k_within_token"]["1"] == 1.0
    rows = [ln for ln in ev.with_suffix(".md").read_text().splitlines() if ln.startswith(("| next-gate", "| oracle"))]
    assert len(rows) == 2 and all(r.split(" | ")[5] == "n/a" for r in rows), rows  # within-token h=2
    assert "0.000" not in "".join(r.split(" | ")[5] for r in rows)


def test_fake_quant_int4_levels():
    w = torch.randn(4, 64)
    q = fake_quant(w, 4)
    for row in q.reshape(-1, 32):
        assert len(torch.unique(row)) <= 16
    assert (q - w).abs().max() < w.abs().max() / 7 + 1e-6
    small = torch.randn(4, 64) * 1e-4     # int8 dense matrices of small weights keep their resolution
    amax = small.reshape(-1, 32).abs().amax(-1, keepdim=True)
    err = (fake_quant(small, 8) - small).reshape(-1, 32).abs()
    assert (err <= amax / 127 / 2 * 1.0001).all()


def test_speculative_decoding_keeps_the_output(embedded):
    lm = load_model(embedded)
    draft = make_draft(lm)
    x = lm.tokenizer("To open a file for reading, use", return_tensors="pt")["input_ids"]
    ref = lm.model.generate(x, max_new_tokens=24, do_sample=False, pad_token_id=0)[0, x.shape[1]:].tolist()
    for k in (1, 4, 8):
        toks, st = speculative_generate(lm.model, draft, x, 24, k=k, eos_token_id=0)
        assert toks == ref
        assert 0.3 < st.acceptance <= 1.0


@pytest.mark.parametrize("fam", TINY_FAMILIES)
def test_all_predictors_on_every_family(tiny_models, vl_data, fam, tmp_path):
    data = [vl_data] if fam == "qwen3_vl_moe" else [HELDOUT]
    s = TraceSettings(max_sequences=12, prompt_tokens=24, decode_tokens=6, heldout_frac=0.5, shard_tokens=60)
    trace = run_trace(tiny_models[fam], data, tmp_path / "t", s, progress=False)
    train_adapter(trace, tmp_path / "a", TrainConfig(steps=20, val_every=10, batch_size=32, rank=4,
                                                     horizons=(1, 2, 3)), progress=False)
    res = evaluate(trace, predictors=list(ALL), adapter=tmp_path / "a", progress=False)
    p = res["predictors"]
    L = len(TraceReader(trace).moe_layers)
    hs = sorted({1, 2, 3, L, 2 * L, 3 * L})   # and the next visits' (train's default: three)
    assert res["horizons"] == hs
    assert all(p["oracle"]["recall_at_k"][str(h)] == 1.0 for h in hs)
    for name in ALL:
        assert all(0.0 <= v <= 1.0 for v in p[name]["recall_at_k"].values()), name
    assert p["draft"]["acceptance_tokens"] > 0
    # int4 experts of a random tiny model still mostly route like the target
    assert p["draft"]["recall_at_k"]["1"] > p["frequency"]["recall_at_k"]["1"]


@pytest.mark.parametrize("fam", [f for f in TINY_FAMILIES if f != "qwen3_vl_moe"])
def test_speculative_decoding_every_text_family(tiny_models, fam):
    lm = load_model(tiny_models[fam])
    draft = make_draft(lm, dense_bits=8)
    x = torch.tensor([[11, 200, 37, 905, 14]])
    ref = lm.model.generate(x, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    toks, _ = speculative_generate(lm.model, draft, x, 12, k=4)
    assert toks == ref[: len(toks)] and len(toks) == 12


def test_predictors_declare_what_the_runtime_reads():
    """The runtime reads capabilities from these flags, never by probing: each flag holds for its class
    (a linear predictor has the matrix to fold, one that routes ahead has `prepare`, the oracle reads the
    future), and no class has the method without the flag."""
    from toolkit.predictors import base, draft

    classes = [c for m in (base, draft) for c in vars(m).values()
               if isinstance(c, type) and issubclass(c, base.Predictor) and c is not base.Predictor]
    assert len(classes) >= 7
    for c in classes:
        assert c.linear == callable(getattr(c, "effective_router", None)), c
        assert c.routes_ahead == callable(getattr(c, "prepare", None)), c
    assert [c.name for c in classes if c.reads_future] == ["oracle"]
