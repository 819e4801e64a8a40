"""Routing traces (toolkit/traces: capture, format, batches, data, summary): what is recorded is what the
model did, and the format survives abuse. Splits are checked at trace time, resolved model paths are
checked by config hash on every use, prompts batched on a GPU get the same routing, options and
`--data` files (regular files of bounded size) are checked before any work, train checks a trace and
its own options before training, train and the predictors keep to the batch's device, and trace files
fail cleanly however they are damaged. The CUDA runs themselves are in tests/test_cuda.py. No test
here needs the shared bundle."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.numpy import save_file

from adapters.checkpoint import read_adapter_meta
from adapters.lowrank import PrefetchAdapter
from adapters.train import TrainConfig, bank_to, pair_loss, pair_targets, train_adapter
from conftest import HELDOUT, REPO
from toolkit.artifacts import lock_path, partial_dir, sha256_file
from toolkit.cli import main
from toolkit.errors import SpecPrefetchError
from toolkit.models.families import select_experts
from toolkit.models.loader import inspect_model_dir, load_model
from toolkit.models.routers import load_router_bank
from toolkit.models.tiny import TINY_FAMILIES, build_tiny
from toolkit.predictors.base import AdapterPredictor, FateStyle, Frequency, NextGate, Oracle, PreviousToken
from toolkit.predictors.evaluate import evaluate
from toolkit.runtime.policy import parse_policies
from toolkit.runtime.profiles import load_profile
from toolkit.simulate.replay import run_simulation
from toolkit.traces import capture
from toolkit.traces.batches import RoutingBatch, batch_from_shard, iter_batches, validation_batches
from toolkit.traces.capture import TraceSettings, make_prompts, run_trace
from toolkit.traces.data import read_records
from toolkit.traces.format import DECODE, IMAGE, PREFILL, TraceReader, trace_model_spec


# heldout_frac 0: 4 prompts x 0.25 would hold out none, which trace refuses (TestSplit)
SMALL = TraceSettings(max_sequences=4, prompt_tokens=24, decode_tokens=6, heldout_frac=0.0,
                      shard_tokens=50)


FAM = "qwen3_moe"


# 8 prompts x 0.25 holds out 3 of them
SET = TraceSettings(max_sequences=8, prompt_tokens=24, decode_tokens=4, heldout_frac=0.25, shard_tokens=60)


TRAIN = dict(steps=4, val_every=2, batch_size=16, rank=2)


def cli(*args) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


def refused(r, *needles: str) -> str:
    """A one-line error (exit 2), no traceback, naming each of `needles`."""
    out = r.output
    assert r.exit_code == 2, out + repr(r.exception)
    assert "Traceback" not in out and isinstance(r.exception, SystemExit), out
    for n in needles:
        assert n in out, out
    return out


@pytest.fixture(scope="module")
def embedded_trace(embedded, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tr") / "emb"
    s = TraceSettings(max_sequences=6, prompt_tokens=48, decode_tokens=12, heldout_frac=0.3,
                      shard_tokens=100)
    return run_trace(embedded, [HELDOUT], out, s, progress=False)


@pytest.fixture(scope="module")
def work(tiny_models, tmp_path_factory) -> Path:
    """DIR/model (a copy of the tiny model) and DIR/trace made from it."""
    d = tmp_path_factory.mktemp("hard-traces")
    shutil.copytree(tiny_models[FAM], d / "model")
    run_trace(d / "model", [HELDOUT], d / "trace", TraceSettings(**{**SET.__dict__, "batch": 8}), progress=False)
    return d


def _tokenizer(model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _seed_where(model: Path, n: int, frac: float, held: int) -> int:
    """A --seed for which the first `n` prompts (24 tokens) x `frac` hold out exactly `held`."""
    recs = read_records([HELDOUT], allow_images=False)
    tok = _tokenizer(model)
    for seed in range(500):
        ps = make_prompts(recs, tok, TraceSettings(max_sequences=n, prompt_tokens=24, heldout_frac=frac, seed=seed))
        if sum(p.split == "heldout" for p in ps) == held:
            return seed
    raise AssertionError("no such seed")


class TestRecordedRouting:
    """What a trace records is what the model did, read back shard by shard."""

    def test_manifest_describes_the_run(self, embedded_trace, embedded):
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

    def test_recorded_routing_is_the_models_own(self, embedded_trace, embedded):
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

    def test_reader_streams_shard_by_shard(self, embedded_trace):
        r = TraceReader(embedded_trace)
        shards = list(r.iter_shards("train"))
        assert len(shards) == len(r.shards("train")) >= 2
        assert sum(len(s["token_id"]) for s in shards) == r.manifest["tokens"]["train"]["total"]
        dec = list(r.iter_hidden("heldout", decode_only=True))
        assert sum(len(d["hidden"]) for d in dec) == r.manifest["tokens"]["heldout"]["decode"]
        assert all((d["kind"] == DECODE).all() for d in dec)
        assert dec[0]["hidden"].dtype == np.float16 and dec[0]["hidden"].shape[1:] == (8, 256)


class TestEveryFamily:
    """Every text family traces; the vision-language family records its image tokens."""

    @pytest.mark.parametrize("fam", [f for f in TINY_FAMILIES if f != "qwen3_vl_moe"])
    def test_every_text_family_traces(self, tiny_models, fam, tmp_path):
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

    def test_vl_family_traces_images(self, tiny_models, vl_data, tmp_path):
        s = TraceSettings(prompt_tokens=32, decode_tokens=4, heldout_frac=0.0)
        r = TraceReader(run_trace(tiny_models["qwen3_vl_moe"], [vl_data], tmp_path / "t", s, progress=False))
        a = r.load("train", ("seq", "kind"))
        img = [(a["kind"][a["seq"] == q] == IMAGE).sum() for q in range(3)]
        # 64x48 and 40x64 images at patch 16, merge 2, clamped to 32..64 px: a few merged tokens each
        assert img[0] > 0 and img[1] > 0 and img[2] == 0
        assert r.manifest["tokens"]["train"]["image"] == sum(img)


class TestRecordingSettings:
    """Top-m probabilities and hidden-state subsampling record what they say."""

    def test_top_m_probabilities(self, tiny_models, tmp_path):
        s = TraceSettings(max_sequences=2, prompt_tokens=16, decode_tokens=2, probs_top_m=3, heldout_frac=0)
        r = TraceReader(run_trace(tiny_models["mixtral"], [HELDOUT], tmp_path / "t", s, progress=False))
        a = next(r.iter_shards("train"))
        assert "router_probs" not in a and a["router_top_ids"].shape[-1] == 3
        assert (np.diff(a["router_top_probs"].astype(np.float32), axis=-1) <= 0).all()
        assert r.manifest["settings"]["probs"] == "top-3"

    def test_hidden_subsampling_keeps_decode(self, tiny_models, tmp_path):
        s = TraceSettings(max_sequences=3, prompt_tokens=32, decode_tokens=5, hidden_sample=0.0, heldout_frac=0)
        r = TraceReader(run_trace(tiny_models["olmoe"], [HELDOUT], tmp_path / "t", s, progress=False))
        h = list(r.iter_hidden("train"))
        assert sum(len(x["hidden"]) for x in h) == 15 and all((x["kind"] == DECODE).all() for x in h)


class TestSplit:
    """The held-out split follows the prompt, and is checked when the trace is made."""

    def test_split_follows_the_prompt_not_the_run(self, embedded, tmp_path):
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

    def test_empty_heldout_split_is_refused_at_trace_time(self, tiny_models, tmp_path):
        model = tiny_models[FAM]
        seed = _seed_where(model, 8, 0.1, 0)
        out = tmp_path / "t"
        r = cli("trace", model, "--data", HELDOUT, "--out", out, "--max-sequences", 8, "--prompt-tokens", 24,
                "--decode-tokens", 2, "--heldout-frac", 0.1, "--seed", seed)
        refused(r, "8 sequences x --heldout-frac 0.1 holds out 0:", "--heldout-frac 0")
        assert not out.exists() and not partial_dir(out).exists() and not lock_path(out).exists()
        # --heldout-frac 0 asks for no held-out split: that is fine
        r = cli("trace", model, "--data", HELDOUT, "--out", out, "--max-sequences", 8, "--prompt-tokens", 24,
                "--decode-tokens", 0, "--heldout-frac", 0, "--seed", seed)
        assert r.exit_code == 0, r.output
        assert TraceReader(out).manifest["split"]["heldout"] == []

    def test_split_holding_out_everything_is_refused(self, tiny_models, tmp_path):
        model = tiny_models[FAM]
        seed = _seed_where(model, 2, 0.6, 2)
        r = cli("trace", model, "--data", HELDOUT, "--out", tmp_path / "t", "--max-sequences", 2,
                "--prompt-tokens", 24, "--decode-tokens", 2, "--heldout-frac", 0.6, "--seed", seed)
        refused(r, "2 sequences x --heldout-frac 0.6 holds out all 2:", "no sequence to learn from")
        assert not (tmp_path / "t").exists()


class TestTraceOptions:
    """trace's options are checked before any work."""

    def test_max_sequences_zero_is_not_no_limit(self, tiny_models, work, tmp_path):
        r = cli("trace", tiny_models[FAM], "--data", HELDOUT, "--out", tmp_path / "t", "--max-sequences", 0)
        refused(r, "--max-sequences")
        assert not (tmp_path / "t").exists()
        with pytest.raises(SpecPrefetchError, match=r"--max-sequences 0: must be at least 1"):
            TraceSettings(max_sequences=0).validate()
        with pytest.raises(SpecPrefetchError, match=r"--max-sequences 0: must be at least 1"):
            run_simulation(work / "trace", policies=parse_policies("on-demand+lru"),
                           profile=load_profile("snapdragon-8-elite"), pool_mib=8, window=2, max_sequences=0)

    def test_trace_device_and_batch_options_are_checked(self, tiny_models, tmp_path):
        out = tmp_path / "t"
        refused(cli("trace", tiny_models[FAM], "--data", HELDOUT, "--out", out, "--device", "gpu"),
                "--device 'gpu': expected cpu, cuda, cuda:N or auto")
        r = cli("trace", tiny_models[FAM], "--data", HELDOUT, "--out", out, "--device", "cuda:64")
        refused(r, "--device cuda:64")
        assert not out.exists() and not partial_dir(out).exists()
        with pytest.raises(SpecPrefetchError, match="--batch 0: must be at least 1"):
            TraceSettings(batch=0).validate()
        assert TraceSettings().prompts_per_batch() == 1
        assert TraceSettings(device="cuda").prompts_per_batch() == 16


class TestSplitAcrossMemories:
    """`--device auto --max-memory`: a model larger than the memory it is given is spread by accelerate
    (the layers fill the budgets in order, the rest is offloaded), and records the same routing. Decode
    steps through the offload hooks were seen to differ from the plain model's in the last place
    (1 ulp of fp32 logits on the CPU with disk offload): the router inputs are compared to a tolerance."""

    def test_a_forced_split_records_the_unsplit_routing(self, tiny_models, tmp_path, monkeypatch):
        from toolkit.models.loader import LoadedModel

        closed = []
        real_close = LoadedModel.close
        monkeypatch.setattr(LoadedModel, "close", lambda self: (closed.append(self.scratch is not None),
                                                                real_close(self)))
        model = tiny_models[FAM]
        weights = 4 * sum(p.numel() for p in load_model(model).model.parameters())   # bytes in float32
        s = dataclasses.replace(SMALL, max_sequences=4)
        whole = run_trace(model, [HELDOUT], tmp_path / "whole", s, progress=False)
        # host memory for about two thirds of the weights: the first layers on the CPU, the rest on disk
        cut = dataclasses.replace(s, device="auto", max_memory=f"cpu={weights * 2 // 3 // 1024}KiB")
        # a scratch folder left by a process no longer alive is swept; --out's parents need not exist yet
        (tmp_path / "new" / ".specprefetch-offload-999999999-x").mkdir(parents=True)
        split = run_trace(model, [HELDOUT], tmp_path / "new" / "sub" / "split", cut, progress=False)
        assert closed[-1] is True   # the run removed its own folder (close() with a scratch folder)
        placed = TraceReader(split).manifest["settings"]["placement"]
        assert {"cpu", "disk"} <= set(placed.values()), placed
        assert TraceReader(whole).manifest["settings"]["placement"] is None
        assert not list(tmp_path.rglob(".specprefetch-offload-*"))   # its own and the stale one: gone
        fields = ("kind", "token_id", "expert_ids", "expert_weights", "router_probs", "hidden")
        a, b = TraceReader(whole).load("train", fields), TraceReader(split).load("train", fields)
        for k in ("kind", "token_id", "expert_ids"):   # the routing and the greedy tokens: equal
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        prefill = a["kind"] == PREFILL   # the prompt's pass: bit for bit (one forward, the same weights)
        for k in ("expert_weights", "router_probs", "hidden"):
            np.testing.assert_array_equal(a[k][prefill], b[k][prefill], err_msg=k)
            # decode steps through accelerate's hooks may round differently in the last place
            np.testing.assert_allclose(a[k].astype(np.float32), b[k].astype(np.float32), atol=1e-3, err_msg=k)

    def test_tied_embeddings_stay_together(self, embedded):
        """The embedded model's LM head shares the input embeddings: split over host memory and disk,
        both land on one device and the logits are the unsplit model's."""
        from toolkit.models.loader import parse_max_memory

        whole = load_model(embedded)
        n = 4 * sum(p.numel() for p in whole.model.parameters())
        cut = load_model(embedded, device="auto", max_memory=parse_max_memory(f"cpu={n // 2 // 1024}KiB"))
        try:
            assert set(cut.placement.values()) == {"cpu", "disk"}
            assert cut.placement.get("lm_head", "?") == cut.placement.get("model.embed_tokens", "!")
            x = torch.tensor([[5, 6, 7, 8, 9, 10]])
            with torch.no_grad():
                # the same weights; a matmul may round differently in the last place (it did under a loaded
                # machine: 6e-6), while a head that lost its tie to the embeddings is off by whole units
                torch.testing.assert_close(cut.model(x).logits, whole.model(x).logits, rtol=0, atol=1e-4)
        finally:
            cut.close()

    def test_where_the_layers_compute_sets_the_batch(self, monkeypatch):
        """--max-memory with no GPU budget computes on the host: one prompt a pass, as on the CPU."""
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        assert TraceSettings(device="auto", max_memory="cpu=1GiB").prompts_per_batch() == 1
        assert TraceSettings(device="auto", max_memory="0=1GiB,cpu=1GiB").prompts_per_batch() == 16
        assert TraceSettings(device="auto").prompts_per_batch() == 16

    def test_budgets_are_checked_before_any_work(self, tiny_models, tmp_path):
        out = tmp_path / "t"
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for bad, says in (("cpu", "expected DEVICE=SIZE pairs"), ("cpu=lots", "size 'lots'"),
                          ("cpu=infGB", "size 'infGB'"), ("npu=1GiB", "'npu' is not a GPU index or cpu"),
                          ("cpu=1GiB,disk=1GiB", "disk takes no budget"), ("cpu=1GiB,cpu=2GiB", "given twice"),
                          (f"{gpus}=1GiB", f"GPU {gpus} does not exist here")):
            refused(cli("trace", tiny_models[FAM], "--data", HELDOUT, "--out", out, "--device", "auto",
                        "--max-memory", bad), f"--max-memory {bad!r}: ", says)
        refused(cli("trace", tiny_models[FAM], "--data", HELDOUT, "--out", out, "--max-memory", "cpu=1GiB"),
                "--max-memory needs --device auto (not --device cpu)")
        assert not out.exists() and not partial_dir(out).exists()


class TestBadData:
    """Unusable --data is one line naming the file (and the line)."""

    def test_images_rejected_for_text_models(self, tiny_models, vl_data, tmp_path):
        with pytest.raises(SpecPrefetchError, match=r"pairs.jsonl:1: has an \"image\" but the model is not"):
            run_trace(tiny_models["olmoe"], [vl_data], tmp_path / "t", SMALL, progress=False)

    def test_bad_data_is_named(self, tiny_models, tmp_path):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"text": "ok"}\n{"txt": "no"}\n')
        with pytest.raises(SpecPrefetchError, match=r"bad.jsonl:2: each line must be an object"):
            run_trace(tiny_models["olmoe"], [bad], tmp_path / "t", SMALL, progress=False)
        with pytest.raises(SpecPrefetchError, match="--data .*missing.txt: file not found"):
            run_trace(tiny_models["olmoe"], [tmp_path / "missing.txt"], tmp_path / "t", SMALL, progress=False)
        assert not (tmp_path / "t").exists()

    def test_data_without_any_text_is_refused(self, tiny_models, tmp_path):
        data = tmp_path / "empty.jsonl"
        data.write_text('{"text": ""}\n{"text": ""}\n')
        with pytest.raises(SpecPrefetchError, match="--data: no text to trace"):
            run_trace(tiny_models[FAM], [data], tmp_path / "t", SET, progress=False)
        assert not (tmp_path / "t").exists()

    def test_data_files_fail_with_file_and_line(self, tmp_path):
        bad = tmp_path / "bad.jsonl"
        bad.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
        with pytest.raises(SpecPrefetchError, match=r"bad.jsonl:2: not UTF-8 text"):
            read_records([bad], allow_images=False)
        bad.write_text('{"text": "a", "image": 5}\n')
        with pytest.raises(SpecPrefetchError, match=r"bad.jsonl:1: \"image\" must be a file name"):
            read_records([bad], allow_images=True)
        bad.write_text('{"text": "a", "image": "."}\n')
        with pytest.raises(SpecPrefetchError, match=r"bad.jsonl:1: image '.' not found"):
            read_records([bad], allow_images=True)


def _limits():
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


@pytest.fixture
def fifo(tmp_path):
    """A FIFO nobody writes to: opening it to read blocks for ever. Named as a data file would be."""
    p = tmp_path / "input.jsonl"
    os.mkfifo(p)
    return p


def _trace_in_a_child(data: str) -> subprocess.CompletedProcess:
    """read_records and run_trace's first check on `data`, in a child under the memory limit."""
    code = ("import sys; from toolkit.errors import SpecPrefetchError; from toolkit.traces.data import read_records, "
            "file_sha256\nfor f in (lambda: read_records([sys.argv[1]], allow_images=False), "
            "lambda: file_sha256(sys.argv[1])):\n    try:\n        f()\n    except SpecPrefetchError as e:\n"
            "        print(e)\n")
    return subprocess.run([sys.executable, "-c", code, data], capture_output=True, text=True, timeout=60,
                          preexec_fn=_limits, cwd=REPO)


class TestDataMustBeRegularFiles:
    """A FIFO or /dev/zero as --data (or as an image) is refused before it is read."""

    @pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
    def test_trace_data_that_is_no_regular_file_is_refused(self, fifo, kind):
        path = str(fifo) if kind == "fifo" else "/dev/zero"
        r = _trace_in_a_child(path)
        lines = r.stdout.splitlines()
        assert r.returncode == 0 and len(lines) == 2, r.stderr
        for ln in lines:
            assert ln.startswith(f"--data {path}: is a ") and ln.endswith(", not a regular file"), lines

    def test_trace_data_checks_before_the_model_loads(self, fifo, tmp_path):
        """run_trace refuses a FIFO before anything else: before the model (here a path that does not
        exist) is looked at, and before the output is claimed."""
        from toolkit.traces.capture import TraceSettings, run_trace

        with pytest.raises(SpecPrefetchError, match=f"--data {fifo}: is a FIFO, not a regular file"):
            run_trace(tmp_path / "no-model", [fifo], tmp_path / "t", TraceSettings(), progress=False)
        assert not (tmp_path / "t").exists()

    def test_trace_data_images_must_be_regular_files(self, fifo, tmp_path):
        from toolkit.traces.data import read_records

        rows = tmp_path / "pairs.jsonl"
        rows.write_text(json.dumps({"text": "a picture", "image": fifo.name}) + "\n")
        with pytest.raises(SpecPrefetchError,
                           match=r"pairs.jsonl:1: image .*input.jsonl: is a FIFO, not a regular file"):
            read_records([rows], allow_images=True)

    @pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
    def test_cli_trace_refuses_data_that_is_no_regular_file(self, fifo, kind):
        path = str(fifo) if kind == "fifo" else "/dev/zero"
        exe = Path(sys.executable).parent / "specprefetch"
        r = subprocess.run([str(exe), "trace", "embedded", "--data", path, "--out", str(fifo.parent / "t")],
                           capture_output=True, text=True, timeout=60, preexec_fn=_limits, cwd=REPO)
        assert r.returncode == 2, r.stderr
        assert path in r.stderr and "not a regular file" in r.stderr and "Traceback" not in r.stderr, r.stderr


def _trace_of_a_copy(work: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the model and of its trace, the trace recording the copy."""
    model, trace = tmp_path / "model", tmp_path / "trace"
    shutil.copytree(work / "model", model)
    shutil.copytree(work / "trace", trace)
    m = json.loads((trace / "manifest.json").read_text())
    m["model"]["path"] = str(model.resolve())
    (trace / "manifest.json").write_text(json.dumps(m))
    return model, trace


class TestRecordedModel:
    """The trace's model: recorded resolved, checked by config hash on every use."""

    @pytest.mark.slow  # ~5 s
    def test_trace_records_absolute_paths_and_is_used_from_any_directory(self, tiny_models, tmp_path, monkeypatch):
        """A trace made with a relative model path is trained, evaluated and simulated from another
        directory that holds a different model under the same relative name (same config: the trap)."""
        here, there = tmp_path / "here", tmp_path / "there"
        here.mkdir()
        there.mkdir()
        shutil.copytree(tiny_models[FAM], here / "model")
        build_tiny(FAM, there / "model", seed=7)  # same config (and hash), other weights
        assert inspect_model_dir(there / "model").config_hash == inspect_model_dir(here / "model").config_hash
        shutil.copy(HELDOUT, here / "data.jsonl")
        monkeypatch.chdir(here)
        r = cli("trace", "model", "--data", "data.jsonl", "--out", "trace", "--max-sequences", 8,
                "--prompt-tokens", 24, "--decode-tokens", 4, "--heldout-frac", 0.25)
        assert r.exit_code == 0, r.output
        m = TraceReader(here / "trace").manifest
        assert m["model"]["path"] == str((here / "model").resolve())
        assert m["data"][0]["path"] == str((here / "data.jsonl").resolve())
        monkeypatch.chdir(there)
        r = cli("train", "../here/trace", "--out", "adapter", "--steps", 4, "--val-every", 2, "--rank", 2,
                "--batch-size", 16)
        assert r.exit_code == 0, r.output
        assert read_adapter_meta(there / "adapter")["model"]["path"] == str((here / "model").resolve())
        r = cli("eval", "../here/trace", "--adapter", "adapter", "--predictors", "next-gate,adapter,oracle",
                "--json", "e.json")
        assert r.exit_code == 0, r.output
        assert json.loads((there / "e.json").read_text())["model"]["path"] == str((here / "model").resolve())
        r = cli("simulate", "../here/trace", "--policies", "on-demand+lru,next-gate+prediction", "--json", "s.json")
        assert r.exit_code == 0, r.output
        assert json.loads((there / "s.json").read_text())["routing_from"]["model"] == str((here / "model").resolve())

    def test_a_model_of_another_config_is_refused_on_use(self, work, tiny_models):
        other = tiny_models["olmoe"]
        trace = work / "trace"
        msg = r"--model .* has model config [0-9a-f]+, but trace .* was recorded from .* with config"
        with pytest.raises(SpecPrefetchError, match=msg):
            train_adapter(trace, work / "never", TrainConfig(**TRAIN), model=other, progress=False)
        assert not (work / "never").exists()
        with pytest.raises(SpecPrefetchError, match=msg):
            evaluate(trace, predictors=["next-gate"], model=other, progress=False)
        with pytest.raises(SpecPrefetchError, match=msg):
            run_simulation(trace, policies=parse_policies("on-demand+lru"), profile=load_profile("snapdragon-8-elite"),
                           pool_mib=8, window=2, model=str(other))
        r = cli("train", trace, "--out", work / "never", "--model", other, "--steps", 2)
        refused(r, "has model config", "a trace fits only the model it was recorded from")

    def test_a_recorded_model_that_changed_or_moved_is_refused(self, work, tmp_path):
        model, trace = _trace_of_a_copy(work, tmp_path)
        cfg = json.loads((model / "config.json").read_text())
        cfg["rope_theta"] = float(cfg.get("rope_theta", 10000.0)) * 2
        (model / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(SpecPrefetchError, match=r"now holds config .*the model changed since"):
            train_adapter(trace, tmp_path / "a", TrainConfig(**TRAIN), progress=False)
        model.rename(tmp_path / "moved")
        with pytest.raises(SpecPrefetchError, match=r"was recorded from model .*model, which is no longer there; "
                                                    r"pass --model DIR"):
            train_adapter(trace, tmp_path / "a", TrainConfig(**TRAIN), progress=False)
        # --model names the same model wherever it is now: accepted, by config hash, and resolved
        spec = trace_model_spec(TraceReader(trace), work / "model")
        assert spec.path == (work / "model").resolve()

    def test_a_relative_model_path_of_an_older_trace_is_refused(self, work, tmp_path, monkeypatch):
        copy = tmp_path / "trace"
        shutil.copytree(work / "trace", copy)
        m = json.loads((copy / "manifest.json").read_text())
        m["model"]["path"] = "model"
        (copy / "manifest.json").write_text(json.dumps(m))
        monkeypatch.chdir(work)  # where "model" would even name the right directory
        with pytest.raises(SpecPrefetchError, match=r"records its model as the relative path 'model'.*pass --model"):
            train_adapter(copy, tmp_path / "a", TrainConfig(**TRAIN), progress=False)
        r = cli("eval", copy, "--predictors", "oracle", "--json", tmp_path / "e.json")
        refused(r, "relative path")
        # with --model it is used
        train_adapter(copy, tmp_path / "a", TrainConfig(**TRAIN), model=work / "model", progress=False)


FIELDS = ("seq", "pos", "kind", "token_id", "expert_ids", "expert_weights", "router_probs", "hidden_rows",
          "hidden")


def _same_trace(a: Path, b: Path) -> None:
    ra, rb = TraceReader(a), TraceReader(b)
    assert ra.manifest["split"] == rb.manifest["split"] and ra.manifest["tokens"] == rb.manifest["tokens"]
    assert [s["tokens"] for s in ra.manifest["shards"]] == [s["tokens"] for s in rb.manifest["shards"]]
    for split in ("train", "heldout"):
        x, y = ra.load(split, FIELDS), rb.load(split, FIELDS)
        for f in ("seq", "pos", "kind", "token_id", "expert_ids", "hidden_rows"):
            np.testing.assert_array_equal(x[f], y[f], err_msg=f)
        for f in ("expert_weights", "router_probs", "hidden"):
            np.testing.assert_allclose(x[f].astype(np.float32), y[f].astype(np.float32), atol=2e-3, err_msg=f)


@pytest.fixture(scope="module")
def varied(tmp_path_factory) -> Path:
    """Texts of many lengths: prompts from 8 to 40 tokens, so batches need padding."""
    texts = [json.loads(line)["text"] for line in HELDOUT.read_text().splitlines()[:7]]
    out = tmp_path_factory.mktemp("varied") / "varied.jsonl"
    out.write_text("".join(json.dumps({"text": t[: 40 + 37 * i]}) + "\n" for i, t in enumerate(texts)))
    return out


class TestBatchedTracing:
    """Batched tracing records what tracing one prompt at a time records."""

    @pytest.mark.parametrize("fam", [FAM] + [pytest.param(f, marks=pytest.mark.slow) for f in TINY_FAMILIES
                                              if f not in (FAM, "qwen3_vl_moe")])
    @pytest.mark.parametrize("decode", [3, pytest.param(0, marks=pytest.mark.slow)])
    def test_batched_trace_records_the_same_routing(self, tiny_models, varied, tmp_path, fam, decode):
        """Prompts of different lengths, left-padded for greedy decode and right-padded for prefill
        alone: the same tokens and experts for every token, probabilities within fp16 rounding; half the
        router inputs sampled, the same rows either way."""
        s = TraceSettings(max_sequences=5, prompt_tokens=40, decode_tokens=decode, heldout_frac=0.3, shard_tokens=70,
                          hidden_sample=0.5)
        one = run_trace(tiny_models[fam], [varied], tmp_path / "one", s, progress=False)
        lens = {len(p.ids) for p in make_prompts(read_records([varied], allow_images=False),
                                                 _tokenizer(tiny_models[fam]), s)}
        assert len(lens) >= 4, lens
        many = run_trace(tiny_models[fam], [varied], tmp_path / "many",
                         TraceSettings(**{**s.__dict__, "batch": 3}), progress=False)
        assert TraceReader(many).manifest["settings"]["batch"] == 3
        assert TraceReader(one).manifest["settings"]["batch"] == 1  # the CPU default
        _same_trace(one, many)

    @pytest.mark.slow
    def test_batched_trace_stops_each_sequence_at_its_own_eos(self, work, tmp_path):
        """A sequence that emits end-of-sequence stops there, as it does alone, while the others of its
        batch decode on."""
        model = tmp_path / "model"
        shutil.copytree(work / "model", model)
        s = TraceSettings(max_sequences=6, prompt_tokens=24, decode_tokens=6, heldout_frac=0.0, shard_tokens=1000)
        a = TraceReader(run_trace(model, [HELDOUT], tmp_path / "ref", s, progress=False)).load(
            "train", ("seq", "kind", "token_id"))
        gen0 = a["token_id"][(a["seq"] == 0) & (a["kind"] == DECODE)]
        eos = int(gen0[2])  # sequence 0 generated this third: make it the end-of-sequence token
        g = json.loads((model / "generation_config.json").read_text())
        g["eos_token_id"] = eos
        (model / "generation_config.json").write_text(json.dumps(g))
        one = run_trace(model, [HELDOUT], tmp_path / "one", s, progress=False)
        many = run_trace(model, [HELDOUT], tmp_path / "many", TraceSettings(**{**s.__dict__, "batch": 4}),
                         progress=False)
        _same_trace(one, many)
        b = TraceReader(many).load("train", ("seq", "kind"))
        decode = [int(((b["seq"] == q) & (b["kind"] == DECODE)).sum()) for q in range(6)]
        assert decode[0] == list(gen0).index(eos) <= 2  # stopped at its end-of-sequence token
        assert max(decode) == 6, decode  # the others of its batch went on


class TestTraceOutput:
    """trace --out: an existing trace needs --overwrite, an input is never replaced, a full disk is named."""

    def test_existing_output_needs_overwrite(self, embedded_trace, embedded):
        with pytest.raises(SpecPrefetchError, match="already exists; pass --overwrite"):
            run_trace(embedded, [HELDOUT], embedded_trace, SMALL, progress=False)

    def test_trace_refuses_its_inputs_and_other_artifacts_as_out(self, work, tmp_path):
        data = tmp_path / "data.jsonl"
        shutil.copy(HELDOUT, data)
        model = tmp_path / "model"
        shutil.copytree(work / "model", model)
        before = sorted(p.name for p in model.iterdir())
        for out in (model, model / "trace"):
            r = cli("trace", model, "--data", data, "--out", out, "--overwrite", "--max-sequences", 8,
                    "--prompt-tokens", 24, "--heldout-frac", 0.25)
            refused(r, "input of this command")
        with pytest.raises(SpecPrefetchError, match="is an input of this command"):
            run_trace(model, [data], data, SET, overwrite=True, progress=False)
        assert sorted(p.name for p in model.iterdir()) == before and data.read_bytes() == HELDOUT.read_bytes()

    @pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root (CI runs as root)")
    def test_disk_full_is_a_clear_error(self, tiny_models, tmp_path):
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


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "toolkit.cli", *args]


class TestInterruptAndResume:
    """An interrupted trace keeps OUT.partial and resumes it only when that is sound."""

    @pytest.mark.slow
    def test_ctrl_c_keeps_no_half_output_and_resumes(self, tiny_models, tmp_path):
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

    def test_resume_refuses_other_settings(self, tiny_models, tmp_path):
        out = tmp_path / "t"
        (partial_dir(out) / ".specprefetch-work").mkdir(parents=True)  # an interrupted run's, as the toolkit marks it
        (partial_dir(out) / "progress.json").write_text(json.dumps({"header": {"other": 1}}))
        with pytest.raises(SpecPrefetchError, match="interrupted trace made with other settings"):
            run_trace(tiny_models["olmoe"], [HELDOUT], out, SMALL, progress=False)

    def test_interrupted_trace_resumes_with_another_batch(self, work, tmp_path, monkeypatch):
        """Ctrl-C (or SIGTERM) mid-trace keeps OUT.partial, gives up the lock and says so; the rerun
        may batch differently and still resumes, and equals an uninterrupted trace."""
        out = tmp_path / "t"
        calls = {"n": 0}
        real = capture.trace_batch

        def interrupt_on_the_third(*a, **k):
            calls["n"] += 1
            if calls["n"] == 3:
                raise KeyboardInterrupt
            return real(*a, **k)

        monkeypatch.setattr(capture, "trace_batch", interrupt_on_the_third)
        with pytest.raises(KeyboardInterrupt) as e:
            run_trace(work / "model", [HELDOUT], out, TraceSettings(**{**SET.__dict__, "batch": 2}), progress=False)
        assert not out.exists() and partial_dir(out).is_dir() and not lock_path(out).exists()
        assert any("the same command resumes" in n for n in e.value.__notes__)
        done = json.loads((partial_dir(out) / "progress.json").read_text())["next_seq"]
        assert 0 < done <= 4
        monkeypatch.setattr(capture, "trace_batch", real)
        run_trace(work / "model", [HELDOUT], out, TraceSettings(**{**SET.__dict__, "batch": 3}), progress=False)
        assert not partial_dir(out).exists()
        _same_trace(out, work / "trace")

    def test_a_damaged_progress_file_is_named_and_overwrite_starts_afresh(self, work, tmp_path):
        out = tmp_path / "t"
        (partial_dir(out) / ".specprefetch-work").mkdir(parents=True)  # an interrupted run's, as the toolkit marks it
        for text in ("[1, 2]", "{", json.dumps({"header": None, "shards": "x"})):
            (partial_dir(out) / "progress.json").write_text(text)
            with pytest.raises(SpecPrefetchError, match=r"t\.partial.*\(or pass --overwrite\) to start again"):
                run_trace(work / "model", [HELDOUT], out, SET, progress=False)
            assert not lock_path(out).exists()
        run_trace(work / "model", [HELDOUT], out, TraceSettings(**{**SET.__dict__, "batch": 8}), overwrite=True,
                  progress=False)
        _same_trace(out, work / "trace")


def _first_shard(trace: Path, tmp_path: Path) -> tuple[Path, Path]:
    copy = tmp_path / "copy"
    shutil.copytree(trace, copy)
    return copy, copy / TraceReader(copy).shards("train")[0]["file"]


class TestDamagedTraceFiles:
    """A corrupt or truncated shard and a bad manifest are named on open or read."""

    def test_corrupt_shard_is_named(self, embedded_trace, tmp_path):
        copy, shard = _first_shard(embedded_trace, tmp_path)
        data = bytearray(shard.read_bytes())
        data[-10] ^= 0xFF
        shard.write_bytes(bytes(data))
        with pytest.raises(SpecPrefetchError, match=f"{shard}: checksum mismatch"):
            list(TraceReader(copy).iter_shards("train"))

    def test_truncated_shard_is_named(self, embedded_trace, tmp_path):
        copy, shard = _first_shard(embedded_trace, tmp_path)
        shard.write_bytes(shard.read_bytes()[:1000])
        with pytest.raises(SpecPrefetchError, match=f"{shard}: shard is 1000 bytes"):
            TraceReader(copy)

    def test_manifest_problems_are_named(self, embedded_trace, tmp_path):
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


def _consume(trace: Path) -> None:
    """Everything train, eval and simulate read from a trace."""
    r = TraceReader(trace)
    for split in ("train", "heldout"):
        for b in iter_batches(r, split):
            assert isinstance(b, RoutingBatch)
    validation_batches(r)
    r.model_dir()


def _mutations(m: dict, rng: np.random.Generator, n: int):
    """Random edits of a manifest: a value replaced by another type, a key dropped, a list emptied."""
    junk = [None, -1, 0, 10**12, 1.5, "x", "../../etc/passwd", [], {}, [1, "a"], True, float("nan")]
    paths = []

    def walk(o, path):
        paths.append(path)
        if isinstance(o, dict):
            for k, v in o.items():
                walk(v, path + (k,))
        elif isinstance(o, list):
            for i, v in enumerate(o[:3]):
                walk(v, path + (i,))

    walk(m, ())
    paths = paths[1:]
    for _ in range(n):
        path = paths[rng.integers(len(paths))]
        c = json.loads(json.dumps(m))
        parent = c
        for k in path[:-1]:
            parent = parent[k]
        if rng.random() < 0.2 and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = junk[rng.integers(len(junk))]
        yield path, c


class TestFuzzedTraceFiles:
    """Random damage to a trace's manifest and shards is a one-line error."""

    @pytest.mark.parametrize("cases", [160, pytest.param(2000, marks=pytest.mark.slow)])
    def test_fuzzed_manifests_fail_cleanly(self, work, tmp_path, cases):
        copy = tmp_path / "t"
        shutil.copytree(work / "trace", copy)
        mf = copy / "manifest.json"
        good = json.loads(mf.read_text())
        rng = np.random.default_rng(cases)
        clean = 0
        for path, m in _mutations(good, rng, cases):
            mf.write_text(json.dumps(m))
            try:
                _consume(copy)
                clean += 1
            except SpecPrefetchError as e:
                assert "\n" not in str(e), (path, e)
        assert clean < cases  # (many fields are descriptive: changing them is harmless)
        for text in ("", "[]", "null", "{", '{"format": "specprefetch-trace", "version": 1}', "\xff\xfe"):
            mf.write_text(text, encoding="latin-1")
            with pytest.raises(SpecPrefetchError):
                _consume(copy)
        mf.unlink()
        mf.mkdir()
        with pytest.raises(SpecPrefetchError, match="manifest.json: not a file"):
            TraceReader(copy)

    def test_fuzzed_shards_fail_cleanly_even_with_matching_checksums(self, work, tmp_path):
        """Shards rewritten with wrong dtypes, shapes and out-of-range ids, the manifest's size and sha256
        updated to match (a checksum proves integrity, not sense): each is a one-line error."""
        copy = tmp_path / "t"
        shutil.copytree(work / "trace", copy)
        mf = copy / "manifest.json"
        good = json.loads(mf.read_text())
        entry = good["shards"][0]
        shard = copy / entry["file"]
        from safetensors.numpy import load_file

        arrays = load_file(str(shard))
        E = good["model"]["num_experts"]
        cases = {
            "expert_ids out of range": {"expert_ids": arrays["expert_ids"] + E},
            "negative expert_ids": {"expert_ids": arrays["expert_ids"] - E},
            "expert_ids as float": {"expert_ids": arrays["expert_ids"].astype(np.float32)},
            "hidden_rows out of range": {"hidden_rows": arrays["hidden_rows"] + 10**6},
            "hidden without rows": {"hidden_rows": None},
            "short token_id": {"token_id": arrays["token_id"][:-1]},
            "kind out of range": {"kind": arrays["kind"] + 7},
            "seq of the other split": {"seq": arrays["seq"] + 1000},
            "a stray field": {"stray": np.zeros(3, np.float32)},
            "router_probs of another width": {"router_probs": arrays["router_probs"][..., :-1]},
        }
        for _name, change in cases.items():
            a = {k: v for k, v in {**arrays, **change}.items() if v is not None}
            save_file(a, str(shard))
            m = json.loads(json.dumps(good))
            m["shards"][0].update(bytes=shard.stat().st_size, sha256=sha256_file(shard))
            mf.write_text(json.dumps(m))
            with pytest.raises(SpecPrefetchError, match=str(shard)):
                _consume(copy)
        shard.write_bytes(np.random.default_rng(0).bytes(512))
        m = json.loads(json.dumps(good))
        m["shards"][0].update(bytes=512, sha256=sha256_file(shard))
        mf.write_text(json.dumps(m))
        with pytest.raises(SpecPrefetchError, match="unreadable shard"):
            _consume(copy)

    @pytest.mark.parametrize("cases", [120, pytest.param(2000, marks=pytest.mark.slow)])
    def test_random_shard_bytes_fail_cleanly(self, work, tmp_path, cases):
        """Random byte edits, insertions and cuts of a real shard, its size and checksum updated in the
        manifest: every reader either gets sound arrays or a one-line error naming the shard."""
        copy = tmp_path / "t"
        shutil.copytree(work / "trace", copy)
        mf = copy / "manifest.json"
        good = json.loads(mf.read_text())
        shard = copy / good["shards"][0]["file"]
        data = shard.read_bytes()
        head = int.from_bytes(data[:8], "little") + 8  # the safetensors JSON header, then the tensors
        rng = np.random.default_rng(cases)
        ok = 0
        for _ in range(cases):
            b = bytearray(data)
            op = rng.integers(4)
            at = int(rng.integers(head + 64)) if rng.random() < 0.7 else int(rng.integers(len(b)))
            if op == 0:
                b[at] = int(rng.integers(256))
            elif op == 1:
                b[at:at + 8] = rng.bytes(8)
            elif op == 2:
                del b[at:]
            else:
                b[at:at] = rng.bytes(int(rng.integers(1, 16)))
            shard.write_bytes(bytes(b))
            m = json.loads(json.dumps(good))
            m["shards"][0].update(bytes=len(b), sha256=sha256_file(shard))
            mf.write_text(json.dumps(m))
            try:
                _consume(copy)
                ok += 1
            except SpecPrefetchError as e:
                assert str(shard) in str(e) and "\n" not in str(e), e
        assert ok < cases


class TestTrainOnATrace:
    """train checks its options, its output and the trace's usable rows before training."""

    @pytest.mark.parametrize("bad, match", [
        ({"warmup": 0}, "warmup 0: must be a whole number >= 1"),
        ({"batch_size": 0}, "--batch-size 0: must be a whole number >= 1"),
        ({"val_every": 0}, "--val-every 0: must be a whole number >= 1"),
        ({"lr": float("nan")}, "--lr nan: must be a finite number > 0"),
        ({"lr": "0.1"}, "--lr '0.1' (str): must be a finite number > 0"),   # (a caller's string: no traceback)
        ({"topk_weight": True}, "--topk-weight True (bool): must be a finite number >= 0"),
        ({"horizon_weights": {1: "x"}}, "--horizon-weights 1:'x' (str): weights must be finite numbers >= 0"),
        ({"horizon_weights": {"1": 1.0}}, "--horizon-weights '1' (str):1.0: horizon '1' (str) is not one of"),
        ({"horizons": ("1", 2)}, "--horizons 1,2: each horizon must lie in 1..4"),
        ({"horizons": (1, 5)}, "--horizons 1,5: each horizon must lie in 1..4"),
        ({"horizon_weights": {3: 1.0}}, "horizon 3 is not one of --horizons 1,2"),
        ({"horizon_weights": {1: 0.0, 2: 0.0}}, "at least one weight must be > 0"),
        ({"device": "gpu"}, "--device 'gpu': expected cpu, cuda, cuda:N"),
        ({"cross_token": False, "next_visits": 1}, "--next-visits 1: the next visit is the next token's"),
        ({"next_visits": 5}, "--next-visits 5: must be a whole number in 0..4"),
        ({"reuse_classes": 0}, "--reuse-classes 0: must be a whole number >= 1"),
        ({"reuse_classes": 65}, "--reuse-classes 65: must lie in 1..64"),
    ])
    def test_train_options_are_checked_first(self, work, tmp_path, bad, match):
        with pytest.raises(SpecPrefetchError, match=re.escape(match)):
            train_adapter(work / "trace", tmp_path / "a", TrainConfig(**{**TRAIN, **bad}), progress=False)
        assert not (tmp_path / "a").exists()

    def test_train_claims_its_output_before_training(self, work, tmp_path):
        """Refusals come before training (steps=10**9 would otherwise run for ever)."""
        cfg = TrainConfig(**{**TRAIN, "steps": 10**9})
        stray = tmp_path / "stray"
        stray.mkdir()
        (stray / "notes.txt").write_text("mine")
        with pytest.raises(SpecPrefetchError, match="already exists; pass --overwrite"):
            train_adapter(work / "trace", stray, cfg, progress=False)
        with pytest.raises(SpecPrefetchError, match="not an adapter"):
            train_adapter(work / "trace", stray, cfg, overwrite=True, progress=False)
        assert (stray / "notes.txt").read_text() == "mine"
        with pytest.raises(SpecPrefetchError, match="input of this command"):
            train_adapter(work / "trace", work / "trace" / "adapter", cfg, overwrite=True, progress=False)
        with pytest.raises(SpecPrefetchError, match="input of this command|is a model"):
            train_adapter(work / "trace", work / "model", cfg, overwrite=True, progress=False)
        assert TraceReader(work / "trace") and inspect_model_dir(work / "model")
        # an adapter is replaced only with overwrite
        a = tmp_path / "a"
        train_adapter(work / "trace", a, TrainConfig(**TRAIN), progress=False)
        with pytest.raises(SpecPrefetchError, match="already exists"):
            train_adapter(work / "trace", a, cfg, progress=False)
        train_adapter(work / "trace", a, TrainConfig(**{**TRAIN, "rank": 3}), overwrite=True, progress=False)
        assert read_adapter_meta(a)["rank"] == 3

    def test_train_without_usable_rows_stops_instead_of_spinning(self, work, tmp_path):
        """Router inputs stored only for the validation sequences: training used to loop for ever."""
        from safetensors.numpy import load_file

        from toolkit.traces.batches import validation_seqs

        copy = tmp_path / "t"
        shutil.copytree(work / "trace", copy)
        r = TraceReader(copy)
        val = validation_seqs(r)
        m = json.loads((copy / "manifest.json").read_text())
        for entry in m["shards"]:
            if entry["split"] != "train":
                continue
            f = copy / entry["file"]
            a = load_file(str(f))
            keep = np.isin(a["seq"][a["hidden_rows"]], list(val))
            a["hidden_rows"], a["hidden"] = a["hidden_rows"][keep], a["hidden"][keep]
            save_file(a, str(f))
            entry.update(bytes=f.stat().st_size, sha256=sha256_file(f), hidden_tokens=int(keep.sum()))
        (copy / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(SpecPrefetchError, match="no train token outside the validation sequences"):
            train_adapter(copy, tmp_path / "a", TrainConfig(**TRAIN), progress=False)
        assert not (tmp_path / "a").exists()


class TestDeviceDiscipline:
    """Train and every predictor keep their tensors on the batch's device."""

    def test_train_and_predictors_keep_to_the_batchs_device(self, work):
        """`train --device cuda` stacked a CPU mask with CUDA tensors (pair_targets). On the meta device
        any tensor made on the CPU instead of the batch's device fails the same way, so this runs here."""
        r = TraceReader(work / "trace")
        spec = trace_model_spec(r, None)
        b = batch_from_shard(r.read_shard(r.shards("train")[0]), r.num_experts).to("meta")
        bank = bank_to(load_router_bank(spec), "meta")
        adapter = PrefetchAdapter(num_layers=len(r.moe_layers), hidden_size=r.hidden_size, num_experts=r.num_experts,
                                  rank=2).to("meta")
        probs, ids, valid = pair_targets(adapter, b)
        assert probs.device.type == ids.device.type == valid.device.type == "meta"
        loss, per_pair = pair_loss(adapter, bank, b, TrainConfig(topk_weight=0.5), torch.ones(len(adapter.pairs),
                                                                                              device="meta"))
        assert loss.device.type == "meta"
        preds = [NextGate(bank), FateStyle(bank), PreviousToken(r.num_experts), Oracle(r.num_experts),
                 Frequency(torch.ones(len(r.moe_layers), r.num_experts)), AdapterPredictor(adapter, bank)]
        for p in preds:
            for h in (1, 2):
                assert p.scores(b, len(r.moe_layers) - 1, h).device.type == "meta", p.name
        assert b.select(torch.arange(len(b))).device.type == "meta"


class TestSummary:
    """python -m toolkit.traces.summary prints its errors as one line."""

    def test_trace_summary_errors_are_one_line(self, tmp_path, capsys):
        from toolkit.traces.summary import main as summary_main

        with pytest.raises(SystemExit) as e:
            summary_main([str(tmp_path / "missing")])
        assert e.value.code == 2
        assert capsys.readouterr().err.strip() == f"error: trace directory not found: {tmp_path / 'missing'}"


class TestContinuation:
    """A record's `continuation_ids` is decoded teacher-forced after its text instead of greedily (what
    the simulator uses to trace the tokens a quantised bundle wrote), and a replay can take another
    engine's routing of those positions."""

    def test_the_greedy_tokens_forced_give_the_greedy_trace(self, tiny_models, tmp_path):
        text = "the expert store streams each layer from flash"
        settings = TraceSettings(prompt_tokens=64, decode_tokens=6, heldout_frac=0.0)
        (tmp_path / "a.jsonl").write_text(json.dumps({"text": text}) + "\n")
        run_trace(tiny_models[FAM], [tmp_path / "a.jsonl"], tmp_path / "greedy", settings, progress=False)
        fields = ("token_id", "expert_ids", "kind", "hidden", "pos")
        a = TraceReader(tmp_path / "greedy").load("train", fields)
        decode = a["token_id"][a["kind"] == DECODE].tolist()
        assert len(decode) == 6
        # the greedy tokens fed (and one more, which a trace of 6 decode steps never feeds)
        (tmp_path / "b.jsonl").write_text(json.dumps({"text": text, "continuation_ids": decode + [3]}) + "\n")
        run_trace(tiny_models[FAM], [tmp_path / "b.jsonl"], tmp_path / "forced", settings, progress=False)
        b = TraceReader(tmp_path / "forced").load("train", fields)
        for f in ("token_id", "expert_ids", "kind", "pos"):
            assert np.array_equal(a[f], b[f]), f
        assert np.abs(a["hidden"].astype(np.float32) - b["hidden"].astype(np.float32)).max() < 1e-2
        # other tokens: fed as given (not the model's choice), so the routing follows them
        other = [(t + 7) % 100 + 5 for t in decode]
        (tmp_path / "c.jsonl").write_text(json.dumps({"text": text, "continuation_ids": other}) + "\n")
        run_trace(tiny_models[FAM], [tmp_path / "c.jsonl"], tmp_path / "other", settings, progress=False)
        c = TraceReader(tmp_path / "other").load("train", fields)
        assert c["token_id"][c["kind"] == DECODE].tolist() == other[:-1]   # the last one is never fed
        assert not np.array_equal(a["expert_ids"][:len(c["expert_ids"])], c["expert_ids"])

    def test_bad_continuations_are_named(self, tiny_models, tmp_path):
        bad = tmp_path / "bad.jsonl"
        for value in ("[1, -2]", '"12"', "[]", "[1.5]", "[true]"):
            bad.write_text('{"text": "a"}\n{"text": "b", "continuation_ids": %s}\n' % value)
            with pytest.raises(SpecPrefetchError, match=r"bad.jsonl:2: \"continuation_ids\" must be a non-empty list"):
                read_records([bad], allow_images=False)
        bad.write_text(json.dumps({"text": "one two three four five six", "continuation_ids": [5]}) + "\n")
        with pytest.raises(SpecPrefetchError, match=r"bad.jsonl:1: \"continuation_ids\" follows the whole text"):
            run_trace(tiny_models[FAM], [bad], tmp_path / "t", TraceSettings(prompt_tokens=2, heldout_frac=0.0),
                      progress=False)
        bad.write_text(json.dumps({"text": "one two", "continuation_ids": [5, 10 ** 9]}) + "\n")
        with pytest.raises(SpecPrefetchError, match=r"continuation_ids 1000000000 is outside the model's vocabulary"):
            run_trace(tiny_models[FAM], [bad], tmp_path / "t2", TraceSettings(prompt_tokens=64, heldout_frac=0.0),
                      progress=False)

    def test_a_replay_takes_the_routing_it_is_given(self, work):
        """Its own routing given back changes nothing; every position routed to the same experts leaves
        on-demand nothing to read after the first token; a position missing is refused in one line."""
        trace = work / "trace"
        reader = TraceReader(trace)
        a = reader.load("train", ("seq", "expert_ids"))
        own = {int(q): a["expert_ids"][a["seq"] == q].astype(np.int64) for q in np.unique(a["seq"])}
        kw = dict(policies=parse_policies("on-demand+lru,oracle+belady"), profile=load_profile("snapdragon-8-elite"),
                  pool_mib=64, window=2, split="train")
        base = run_simulation(trace, **kw)
        same = run_simulation(trace, **kw, routing=own)
        assert same["routing_from"]["replaced"] and not base["routing_from"]["replaced"]
        assert [r["mib_read_per_token"] for r in same["results"]] == [r["mib_read_per_token"] for r in base["results"]]
        fixed = {q: np.broadcast_to(r[:1, :, :], r.shape).copy() for q, r in own.items()}
        one = run_simulation(trace, **kw, routing=fixed)
        for r in one["results"]:
            assert r["mib_read_per_token"] < 0.25 * base["results"][0]["mib_read_per_token"], r["policy"]
        q = min(own)
        for r in (own[q][:3], np.concatenate([own[q], own[q][:1]])):   # too few positions, one too many
            with pytest.raises(SpecPrefetchError, match=rf"sequence {q} replays positions 0..\d+, but the routing "
                                                        rf"given for it covers {len(r)}: not the same tokens"):
                run_simulation(trace, **kw, routing={**own, q: r})

    def test_a_replay_can_start_from_the_pool_the_prefill_left(self, work):
        """With `prefill_chunks`, each sequence's prompt positions go through the pool first, as a
        runner's prefill feeds them: a decode that reuses the prompt's experts then reads nothing (the
        pool holds them all), where from an empty pool it reads each of them once more."""
        trace = work / "trace"
        a = TraceReader(trace).load("train", ("seq", "expert_ids", "kind"))
        routing = {}
        for q in np.unique(a["seq"]):
            r = a["expert_ids"][a["seq"] == q].astype(np.int64)
            n = int((a["kind"][a["seq"] == q] != DECODE).sum())
            r[n:] = r[np.arange(len(r) - n) % n]   # decode position n + t routes as prompt position t % n
            routing[int(q)] = r
        kw = dict(policies=parse_policies("on-demand+lru,oracle+belady"), profile=load_profile("snapdragon-8-elite"),
                  pool_mib=512, window=2, split="train", routing=routing)
        cold = run_simulation(trace, **kw)
        warm = run_simulation(trace, **kw, prefill_chunks=(8, 4))
        assert warm["routing_from"]["pool_warmed_by_prefill"] and not cold["routing_from"]["pool_warmed_by_prefill"]
        for c, w in zip(cold["results"], warm["results"]):
            assert c["mib_read_per_token"] > 0 and w["mib_read_per_token"] == 0, (c, w)
        one = run_simulation(trace, **kw, prefill_chunks=())   # one position at a time: the same pool
        assert [r["mib_read_per_token"] for r in one["results"]] == [0, 0]
        # the trace's own routing through a pool that holds every expert, counted by hand: warm, each
        # decode row is a token and reads the experts no earlier position used; cold, the first decode
        # row's experts are the pool's start and the rows after it are the tokens
        own = {int(q): a["expert_ids"][a["seq"] == q].astype(np.int64) for q in np.unique(a["seq"])}
        warm, cold = (run_simulation(trace, **{**kw, "routing": own, "policies": parse_policies("on-demand+lru")},
                                     **extra)
                      for extra in ({"prefill_chunks": (8, 4)}, {}))
        slot = warm["geometry"]["slot_bytes"]
        reads = {"warm": 0, "cold": 0}
        tokens = {"warm": 0, "cold": 0}
        for q, r in own.items():
            n = int((a["kind"][a["seq"] == q] != DECODE).sum())
            keys = lambda rows: {(li, int(e)) for t in rows for li, row in enumerate(r[t]) for e in row}  # noqa: E731
            reads["warm"] += len(keys(range(n, len(r))) - keys(range(n)))
            reads["cold"] += len(keys(range(n + 1, len(r))) - keys([n]))
            tokens["warm"] += len(r) - n
            tokens["cold"] += len(r) - n - 1
        for name, res in (("warm", warm), ("cold", cold)):
            got = res["results"][0]
            assert got["tokens"] == tokens[name], name
            assert got["mib_read_per_token"] == round(reads[name] * slot / 2**20 / tokens[name], 4), name
        assert reads["warm"] != reads["cold"]

    def test_a_warm_replay_numbers_beladys_steps_as_the_runner(self, work, monkeypatch):
        """From a prefilled pool, Belady's future counts a prompt span's positions at the span's step, as
        the runners' (`belady_next_use(units=...)`): the replay hands the pool its prompt spans."""
        from toolkit.runtime.backend import chunk_plan, prefill_spans
        from toolkit.simulate import replay

        trace = work / "trace"
        a = TraceReader(trace).load("train", ("seq", "expert_ids", "kind"))
        own = {int(q): a["expert_ids"][a["seq"] == q].astype(np.int64) for q in np.unique(a["seq"])}
        seen = []
        real = replay.open_pool_and_scheduler
        monkeypatch.setattr(replay, "open_pool_and_scheduler",
                            lambda *x, **kw: seen.append(kw["units"]) or real(*x, **kw))
        kw = dict(policies=parse_policies("oracle+belady"), profile=load_profile("snapdragon-8-elite"), pool_mib=1,
                  window=2, split="train", routing=own)
        run_simulation(trace, **kw, prefill_chunks=(8, 4))
        want = sorted(prefill_spans(chunk_plan(int((a["kind"][a["seq"] == q] != DECODE).sum()), (8, 4)))
                      for q in own)
        assert sorted(list(u) for u in seen) == [list(w) for w in want] and all(sum(u) > 0 for u in seen)
        seen.clear()
        run_simulation(trace, **kw)   # from an empty pool: no prompt, no spans
        assert seen and all(tuple(u) == () for u in seen)
