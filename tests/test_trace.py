"""Routing traces: what is recorded is what the model did; the format survives abuse."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import HELDOUT, REPO
from toolkit.errors import SpecPrefetchError
from toolkit.models.families import select_experts
from toolkit.models.loader import load_model
from toolkit.models.tiny import TINY_FAMILIES
from toolkit.traces.capture import TraceSettings, make_prompts, run_trace
from toolkit.traces.data import read_records
from toolkit.traces.format import DECODE, IMAGE, PREFILL, TraceReader, partial_dir

# heldout_frac 0: 4 prompts x 0.25 would hold out none, which trace refuses (tests/test_hardening_traces.py)
SMALL = TraceSettings(max_sequences=4, prompt_tokens=24, decode_tokens=6, heldout_frac=0.0,
                      shard_tokens=50)


@pytest.fixture(scope="module")
def embedded_trace(embedded, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tr") / "emb"
    s = TraceSettings(max_sequences=6, prompt_tokens=48, decode_tokens=12, heldout_frac=0.3,
                      shard_tokens=100)
    return run_trace(embedded, [HELDOUT], out, s, progress=False)


def test_manifest_describes_the_run(embedded_trace, embedded):
    r = TraceReader(embedded_trace)
    m = r.manifest
    assert m["format"] == "specprefetch-trace" and m["version"] == 1
    assert m["model"]["family"] == "qwen3_moe" and m["model"]["num_experts"] == 32
    assert m["model"]["moe_layers"] == list(range(8))
    assert m["data"][0]["sha256"] == __import__("hashlib").sha256(HELDOUT.read_bytes()).hexdigest()
    assert sorted(m["split"]["train"] + m["split"]["heldout"]) == list(range(6))
    assert m["split"]["heldout"], "0.3 of 6 prompts should hold at least one out"
    for split in ("train", "heldout"):
        n_seq = len(m["split"][split])
        t = m["tokens"][split]
        assert t["prefill"] == 48 * n_seq and t["decode"] == 12 * n_seq
        assert t["total"] == t["prefill"] + t["decode"]
    assert len(m["shards"]) >= 3  # shard_tokens=100 forces several


def test_recorded_routing_is_the_models_own(embedded_trace, embedded):
    """Recorded ids equal the family's selection applied to the recorded router input, and the
    decode tokens equal an unhooked greedy generate()."""
    r = TraceReader(embedded_trace)
    lm = load_model(embedded)
    spec = lm.geometry.routing
    a = r.load("train", ("token_id", "seq", "pos", "kind", "expert_ids", "router_probs"))
    agree = total = 0
    for shard in r.iter_hidden("train"):
        for li, layer in enumerate(r.moe_layers):
            w, _, _ = lm.family.router_params(lm.model, layer)
            logits = torch.from_numpy(shard["hidden"][:, li].astype(np.float32)) @ w.detach().float().t()
            _, ids = select_experts(logits, spec)
            rec = torch.from_numpy(shard["expert_ids"][:, li].astype(np.int64))
            agree += (ids.sort(-1).values == rec.sort(-1).values).all(-1).sum().item()
            total += ids.shape[0]
    assert agree / total > 0.99  # fp16 storage of the hidden state may flip a near-tie
    # probabilities: a distribution whose top-k is the selection
    p = a["router_probs"].astype(np.float32)
    assert np.allclose(p.sum(-1), 1.0, atol=1e-2)
    topk = np.sort(np.argsort(-p, -1)[..., :4], -1)
    assert (topk == np.sort(a["expert_ids"], -1)).all(-1).mean() > 0.99
    # decode tokens are what plain greedy decoding produces
    seq0 = a["seq"] == a["seq"][0]
    ids = a["token_id"][seq0]
    kind = a["kind"][seq0]
    assert list(a["pos"][seq0]) == list(range(seq0.sum()))
    prompt = ids[kind == PREFILL]
    out = lm.model.generate(torch.tensor([prompt.tolist()]), do_sample=False, max_new_tokens=12,
                            pad_token_id=0)
    # decode row j consumes the j-th generated token
    assert out[0, len(prompt):].tolist() == ids[kind == DECODE].tolist()


def test_reader_streams_shard_by_shard(embedded_trace):
    r = TraceReader(embedded_trace)
    shards = list(r.iter_shards("train"))
    assert len(shards) == len(r.shards("train")) >= 2
    assert sum(len(s["token_id"]) for s in shards) == r.manifest["tokens"]["train"]["total"]
    dec = list(r.iter_hidden("heldout", decode_only=True))
    assert sum(len(d["hidden"]) for d in dec) == r.manifest["tokens"]["heldout"]["decode"]
    assert all((d["kind"] == DECODE).all() for d in dec)
    assert dec[0]["hidden"].dtype == np.float16 and dec[0]["hidden"].shape[1:] == (8, 256)


def test_split_follows_the_prompt_not_the_run(embedded, tmp_path):
    """A prompt's split depends on its file name, line and chunk and the seed only: not on where the
    data file lives, nor on the order or number of the other prompts; another seed splits otherwise."""
    lm = load_model(embedded)
    s = TraceSettings(heldout_frac=0.2)
    a = {p.key: p.split for p in make_prompts(read_records([HELDOUT], allow_images=False), lm.tokenizer, s)}
    copy = tmp_path / "elsewhere" / HELDOUT.name
    copy.parent.mkdir()
    shutil.copy(HELDOUT, copy)
    recs = read_records([copy], allow_images=False)[::-1][:40]
    b = {p.key: p.split for p in make_prompts(recs, lm.tokenizer, s)}
    assert len(b) >= 40 and b == {k: a[k] for k in b}
    c = {p.key: p.split for p in make_prompts(read_records([HELDOUT], allow_images=False), lm.tokenizer,
                                              TraceSettings(heldout_frac=0.2, seed=1))}
    assert c.keys() == a.keys() and c != a
    share = sum(v == "heldout" for v in a.values()) / len(a)
    assert 0.1 < share < 0.3


@pytest.mark.parametrize("fam", [f for f in TINY_FAMILIES if f != "qwen3_vl_moe"])
def test_every_text_family_traces(tiny_models, fam, tmp_path):
    out = run_trace(tiny_models[fam], [HELDOUT], tmp_path / "t", SMALL, progress=False)
    r = TraceReader(out)
    a = r.load("train", ("kind", "expert_ids", "expert_weights"))
    L = len(r.moe_layers)
    assert a["expert_ids"].shape[1:] == (L, 2)
    assert ((a["expert_ids"] >= 0) & (a["expert_ids"] < 8)).all()
    assert (a["expert_weights"] > 0).all()
    assert (a["kind"] == DECODE).sum() == 6 * len(r.manifest["split"]["train"])
    # routing is spread, not collapsed onto one expert
    assert len(np.unique(a["expert_ids"])) >= 6


def test_vl_family_traces_images(tiny_models, vl_data, tmp_path):
    s = TraceSettings(prompt_tokens=32, decode_tokens=4, heldout_frac=0.0)
    r = TraceReader(run_trace(tiny_models["qwen3_vl_moe"], [vl_data], tmp_path / "t", s, progress=False))
    a = r.load("train", ("seq", "kind"))
    img = [(a["kind"][a["seq"] == q] == IMAGE).sum() for q in range(3)]
    # 64x48 and 40x64 images at patch 16, merge 2, clamped to 32..64 px: a few merged tokens each
    assert img[0] > 0 and img[1] > 0 and img[2] == 0
    assert r.manifest["tokens"]["train"]["image"] == sum(img)


def test_images_rejected_for_text_models(tiny_models, vl_data, tmp_path):
    with pytest.raises(SpecPrefetchError, match=r"pairs.jsonl:1: has an \"image\" but the model is not"):
        run_trace(tiny_models["olmoe"], [vl_data], tmp_path / "t", SMALL, progress=False)


def test_bad_data_is_named(tiny_models, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(SpecPrefetchError, match=r"bad.jsonl:2: each line must be an object"):
        run_trace(tiny_models["olmoe"], [bad], tmp_path / "t", SMALL, progress=False)
    with pytest.raises(SpecPrefetchError, match="--data .*missing.txt: file not found"):
        run_trace(tiny_models["olmoe"], [tmp_path / "missing.txt"], tmp_path / "t", SMALL, progress=False)
    assert not (tmp_path / "t").exists()


def test_top_m_probabilities(tiny_models, tmp_path):
    s = TraceSettings(max_sequences=2, prompt_tokens=16, decode_tokens=2, probs_top_m=3, heldout_frac=0)
    r = TraceReader(run_trace(tiny_models["mixtral"], [HELDOUT], tmp_path / "t", s, progress=False))
    a = next(r.iter_shards("train"))
    assert "router_probs" not in a and a["router_top_ids"].shape[-1] == 3
    assert (np.diff(a["router_top_probs"].astype(np.float32), axis=-1) <= 0).all()
    assert r.manifest["settings"]["probs"] == "top-3"


def test_hidden_subsampling_keeps_decode(tiny_models, tmp_path):
    s = TraceSettings(max_sequences=3, prompt_tokens=32, decode_tokens=5, hidden_sample=0.0, heldout_frac=0)
    r = TraceReader(run_trace(tiny_models["olmoe"], [HELDOUT], tmp_path / "t", s, progress=False))
    h = list(r.iter_hidden("train"))
    assert sum(len(x["hidden"]) for x in h) == 15 and all((x["kind"] == DECODE).all() for x in h)


def _first_shard(trace: Path, tmp_path: Path) -> tuple[Path, Path]:
    copy = tmp_path / "copy"
    shutil.copytree(trace, copy)
    return copy, copy / TraceReader(copy).shards("train")[0]["file"]


def test_corrupt_shard_is_named(embedded_trace, tmp_path):
    copy, shard = _first_shard(embedded_trace, tmp_path)
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(SpecPrefetchError, match=f"{shard}: checksum mismatch"):
        list(TraceReader(copy).iter_shards("train"))


def test_truncated_shard_is_named(embedded_trace, tmp_path):
    copy, shard = _first_shard(embedded_trace, tmp_path)
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(SpecPrefetchError, match=f"{shard}: shard is 1000 bytes"):
        TraceReader(copy)


def test_manifest_problems_are_named(embedded_trace, tmp_path):
    copy, _ = _first_shard(embedded_trace, tmp_path)
    m = json.loads((copy / "manifest.json").read_text())
    m["version"] = 99
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SpecPrefetchError, match="format version 99 is not supported"):
        TraceReader(copy)
    (copy / "manifest.json").write_text("{")
    with pytest.raises(SpecPrefetchError, match="manifest.json is not valid JSON"):
        TraceReader(copy)
    with pytest.raises(SpecPrefetchError, match="trace directory not found"):
        TraceReader(tmp_path / "nothing")


def test_existing_output_needs_overwrite(embedded_trace, embedded):
    with pytest.raises(SpecPrefetchError, match="already exists; pass --overwrite"):
        run_trace(embedded, [HELDOUT], embedded_trace, SMALL, progress=False)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "toolkit.cli", *args]


@pytest.mark.slow
def test_ctrl_c_keeps_no_half_output_and_resumes(tiny_models, tmp_path):
    """SIGINT mid-trace: exit 130, no OUT, resumable OUT.partial; the resumed trace equals an
    uninterrupted one."""
    args = ["trace", str(tiny_models["qwen3_moe"]), "--data", str(HELDOUT), "--max-sequences", "240",
            "--prompt-tokens", "32", "--decode-tokens", "4", "--shard-tokens", "100"]
    out = tmp_path / "t"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen(_cli(*args, "--out", str(out)), cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    progress = partial_dir(out) / "progress.json"
    deadline = time.time() + 120
    while time.time() < deadline and not progress.exists() and p.poll() is None:
        time.sleep(0.05)
    assert progress.exists(), "the run never wrote a shard"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert "interrupted" in err
    assert not out.exists() and partial_dir(out).exists()
    done = json.loads(progress.read_text())["next_seq"]
    assert 0 < done < 240
    r = subprocess.run(_cli(*args, "--out", str(out)), cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert not partial_dir(out).exists()
    ref = run_trace(tiny_models["qwen3_moe"], [HELDOUT], tmp_path / "ref",
                    TraceSettings(max_sequences=240, prompt_tokens=32, decode_tokens=4, shard_tokens=100),
                    progress=False)
    for split in ("train", "heldout"):
        a = TraceReader(out).load(split, ("seq", "token_id", "expert_ids", "router_probs"))
        b = TraceReader(ref).load(split, ("seq", "token_id", "expert_ids", "router_probs"))
        np.testing.assert_array_equal(a["seq"], b["seq"])
        np.testing.assert_array_equal(a["token_id"], b["token_id"])
        # two processes may use different thread counts: sums can differ in the last fp16 bit
        assert (a["expert_ids"] == b["expert_ids"]).mean() > 0.999
        np.testing.assert_allclose(a["router_probs"].astype(np.float32), b["router_probs"].astype(np.float32),
                                   atol=2e-3)


def test_resume_refuses_other_settings(tiny_models, tmp_path):
    out = tmp_path / "t"
    (partial_dir(out) / ".specprefetch-work").mkdir(parents=True)  # an interrupted run's, as the toolkit marks it
    (partial_dir(out) / "progress.json").write_text(json.dumps({"header": {"other": 1}}))
    with pytest.raises(SpecPrefetchError, match="interrupted trace made with other settings"):
        run_trace(tiny_models["olmoe"], [HELDOUT], out, SMALL, progress=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root (CI runs as root)")
def test_disk_full_is_a_clear_error(tiny_models, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(mnt)], check=True)
    try:
        s = TraceSettings(max_sequences=20, prompt_tokens=64, decode_tokens=4, shard_tokens=64)
        with pytest.raises(SpecPrefetchError, match="disk full while writing .*free some space"):
            run_trace(tiny_models["qwen3_moe"], [HELDOUT], mnt / "t", s, progress=False)
        assert not (mnt / "t").exists()
        leftovers = [p.name for p in (partial_dir(mnt / "t") / "shards").iterdir()]
        assert not [n for n in leftovers if n.endswith(".tmp")], leftovers
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
