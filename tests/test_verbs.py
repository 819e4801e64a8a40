"""The pipeline verbs through the CLI (click's CliRunner) on a tiny model: trace -> train -> eval,
and store."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from adapters.checkpoint import load_adapter
from conftest import HELDOUT
from toolkit.cli import main
from toolkit.models.checkpoint import ExpertReader
from toolkit.models.loader import inspect_model_dir
from toolkit.predictors.evaluate import ALL
from toolkit.runtime.expert_store import ALIGN, ExpertStore
from toolkit.traces.format import TraceReader

FAMILY = "qwen3_moe"  # tiny: MoE layers 1..3, 8 experts, top-2, hidden 64, expert intermediate 48


def invoke(*args: str):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == 0, r.output + (repr(r.exception) if r.exception else "")
    return r


@pytest.fixture(scope="module")
def trace(tiny_models, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("verbs") / "trace"
    r = invoke("trace", tiny_models[FAMILY], "--data", HELDOUT, "--out", out, "--max-sequences", "16",
               "--prompt-tokens", "24", "--decode-tokens", "6", "--heldout-frac", "0.25", "--shard-tokens", "120")
    assert f"wrote {out}" in r.output
    return out


@pytest.fixture(scope="module")
def adapter(trace) -> Path:
    out = trace.parent / "adapter"
    r = invoke("train", trace, "--out", out, "--steps", "20", "--val-every", "10", "--rank", "4",
               "--batch-size", "32")
    assert f"wrote {out}" in r.output and "validation recall@k h=1" in r.output
    return out


def test_train_writes_an_adapter_that_loads(adapter, trace, tiny_models):
    spec = inspect_model_dir(tiny_models[FAMILY])
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter.json", "adapter.safetensors"]
    assert not list(adapter.parent.glob(adapter.name + ".partial*"))   # no work directory of any process
    ad, meta = load_adapter(adapter, spec)
    assert meta["model"]["config_hash"] == spec.config_hash == TraceReader(trace).manifest["model"]["config_hash"]
    assert (meta["rank"], meta["horizons"], meta["cross_token"], meta["next_visits"]) == (4, [1, 2], True, 3)
    # 3 MoE layers x (2 horizons + the next 3 visits, horizons 3, 6, 9), crossing into the next tokens
    assert len(ad.pairs) == 15 and ad.params() == meta["params"] == 15 * 4 * (64 + 8)
    assert {h for _, h in ad.pairs} == {1, 2, 3, 6, 9}
    assert 0 < meta["training"]["steps_run"] <= 20 and meta["training"]["best_step"] in (10, 20)
    t = load_file(str(adapter / "adapter.safetensors"))
    assert torch.equal(ad.A.data, t["A"]) and torch.equal(ad.B.data, t["B"])
    assert ad.B.abs().sum() > 0  # trained: B starts at zero
    for h in ("1", "2"):
        assert 0.0 <= meta["validation"]["adapter"]["recall_at_k"][h] <= 1.0


def test_an_older_adapters_next_visit_is_read_as_one_visit(adapter, tiny_models, tmp_path):
    """An adapter.json written before `next_visits` ('next_visit': true / false) loads as one / no visit; a
    malformed value of either key, or more visits than its weights hold, is refused naming the file."""
    import shutil

    from toolkit.errors import SpecPrefetchError

    from safetensors.torch import save_file

    from toolkit.artifacts import sha256_file

    spec = inspect_model_dir(tiny_models[FAMILY])
    old = tmp_path / "old"
    shutil.copytree(adapter, old)
    full, meta = load_adapter(adapter, spec)
    # an older adapter: the window's heads and the next visit's (horizons up to L = 3), as it was written
    keep = [n for n, (_, h) in enumerate(full.pairs) if h <= 3]
    save_file({"A": full.A.data[keep].contiguous(), "B": full.B.data[keep].contiguous()},
              str(old / "adapter.safetensors"))
    meta = {**meta, "weights_sha256": sha256_file(old / "adapter.safetensors")}
    del meta["next_visits"]

    def with_(**kv):
        (old / "adapter.json").write_text(json.dumps({**meta, **kv}))
        return old

    ad, _ = load_adapter(with_(next_visit=True), spec)
    assert ad.next_visits == 1 and len(ad.pairs) == 9
    ad, _ = load_adapter(with_(next_visits=None, next_visit=True), spec)   # null: as absent
    assert ad.next_visits == 1
    for none in (False, None):   # no heads (null: as absent): 6 pairs, the weights hold 9
        with pytest.raises(SpecPrefetchError, match="tensor shapes"):
            load_adapter(with_(next_visit=none), spec)
    for bad, key in (({"next_visit": 1}, "'next_visit'"), ({"next_visits": 5}, "'next_visits'"),
                     ({"next_visits": True}, "'next_visits'"),
                     ({"next_visits": 1, "cross_token": False}, "cross_token")):
        with pytest.raises(SpecPrefetchError, match=f"adapter.json: malformed adapter config: .*{key}"):
            load_adapter(with_(**bad), spec)
    with pytest.raises(SpecPrefetchError, match="tensor shapes"):          # two visits: 12 pairs
        load_adapter(with_(next_visits=2), spec)
    ad1, _ = load_adapter(with_(next_visit=True), spec)   # the heads it has are the trained adapter's
    assert torch.equal(ad1.A.data[ad1.pair_index[(2, 3)]], full.A.data[full.pair_index[(2, 3)]])


def test_eval_writes_json_markdown_and_plot(adapter, trace, tmp_path):
    out = tmp_path / "eval.json"
    r = invoke("eval", trace, "--adapter", adapter, "--json", out)
    md, png = out.with_suffix(".md"), out.with_suffix(".png")
    assert f"wrote {out}, {md}, {png}" in r.output
    j = json.loads(out.read_text())
    assert set(j["predictors"]) == set(ALL) and j["horizons"] == [1, 2, 3, 6, 9] and j["k"] == 2
    assert j["decode_tokens"] == TraceReader(trace).manifest["tokens"]["heldout"]["decode"] > 0
    for name, p in j["predictors"].items():
        for key in ("recall_at_k", "recall_at_k_within_token"):
            assert set(p[key]) == {"1", "2", "3", "6", "9"}  # 3, 6, 9: the next visits, never within the token
            assert all(0.0 <= v <= 1.0 for h, v in p[key].items()
                       if key == "recall_at_k" or h in ("1", "2")), (name, key, p[key])
        assert [p["recall_at_k_within_token"][h] for h in ("3", "6", "9")] == [None] * 3
        assert all(0.0 <= v <= 1.0 for v in p["per_layer_recall_at_k"]["1"])
        assert len(p["per_layer_recall_at_k"]["1"]) == 3
    assert all(v == 1.0 for v in j["predictors"]["oracle"]["recall_at_k"].values())
    assert all(v == 1.0 for v in j["predictors"]["oracle"]["per_layer_recall_at_k"]["1"])
    assert j["predictors"]["adapter"]["params"] == 15 * 4 * (64 + 8)  # with the next-visit heads
    table = md.read_text()
    assert table in r.output
    for name in ALL:
        assert f"| {name} |" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000


def test_eval_subset_and_unknown_predictor(trace, tmp_path):
    out = tmp_path / "e.json"
    invoke("eval", trace, "--predictors", "next-gate,oracle", "--horizons", "1", "--json", out)
    j = json.loads(out.read_text())
    assert set(j["predictors"]) == {"next-gate", "oracle"} and j["horizons"] == [1]
    r = CliRunner().invoke(main, ["eval", str(trace), "--predictors", "nope", "--json", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and r.output.startswith("error: --predictors: unknown predictor 'nope'")


@pytest.mark.parametrize("dtype", ["fp16", "int8", "int4"])
def test_store_writes_a_valid_store_of_the_checkpoints_experts(tiny_models, tmp_path, dtype):
    model = tiny_models[FAMILY]
    spec = inspect_model_dir(model)
    g = spec.geometry
    out = tmp_path / f"experts-{dtype}.spx"
    r = invoke("store", model, "--out", out, "--dtype", dtype)
    assert f"wrote {out}: 24 experts" in r.output and f"({dtype})" in r.output
    st = ExpertStore(out, spec)  # validates magic, version, index checksum, every entry's bounds
    assert (st.dtype, st.num_layers, st.num_experts, st.hidden_size, st.intermediate_size) == \
        (dtype, 3, 8, 64, 48)
    assert sorted(st.entries) == [(li, e) for li in range(3) for e in range(8)]
    assert all(e.offset % ALIGN == 0 and e.offset >= st.data_offset for e in st.entries.values())
    assert out.stat().st_size == st.data_offset + 24 * st.slot_bytes
    reader = ExpertReader(spec)
    for li, e in ((0, 0), (2, 5)):
        got = st.weights(li, e)  # CRC-checked read, dequantised
        ref = reader.read_expert(g.moe_layers[li], e)
        assert set(got) == set(ref)
        for role, w in ref.items():
            w = w.float()
            assert got[role].shape == w.shape, role
            if dtype == "fp16":
                assert torch.equal(got[role], w.half().float()), role  # exactly fp16 rounding
                assert torch.allclose(got[role], w, rtol=2**-11, atol=1e-7), role
            else:
                # within half a quantisation step: the row's (int8) or 32-group's (int4) max / levels
                if dtype == "int8":
                    step = w.abs().amax(1, keepdim=True) / 127
                else:
                    pad = (-w.shape[1]) % 32
                    gm = torch.nn.functional.pad(w, (0, pad)).reshape(w.shape[0], -1, 32).abs().amax(-1)
                    step = gm.repeat_interleave(32, 1)[:, : w.shape[1]] / 7
                err = (got[role] - w).abs()
                assert (err <= step / 2 * 1.01 + 1e-6).all(), (role, float(err.max()))
                assert float(err.max()) > 0  # really quantised
    blob = st.read(2, 5)
    assert len(blob) == st.blob_size and np.frombuffer(blob, np.uint8).any()


def test_frequency_trace_of_another_model_is_refused(trace, tiny_models, tmp_path):
    """`run --frequency-trace` counts experts of the model the trace was recorded from: another
    model's trace is a one-line error, not silently wrong prefetching."""
    other = next(f for f in tiny_models if f != FAMILY and f != "qwen3_vl_moe")
    r = CliRunner().invoke(main, ["run", str(tiny_models[other]), "--policy", "frequency+lru", "--frequency-trace",
                                  str(trace), "--prompt", "hello", "--max-new-tokens", "2", "--no-check",
                                  "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 2, r.output
    assert "--frequency-trace" in r.output and "config" in r.output and "Traceback" not in r.output
