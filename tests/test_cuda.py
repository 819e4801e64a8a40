"""The workstation GPU path: every command that takes --device (trace, train), run on CUDA, and the
pipeline trace -> train -> eval -> simulate on artifacts made there.

Each test builds its own tiny model and data under tmp_path, so the file runs alone on a GPU machine
(`pytest tests/test_cuda.py`). Without CUDA the GPU tests are skipped, saying so, and the one test
that runs instead checks that asking for CUDA there is a one-line error.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from adapters.checkpoint import read_adapter_meta
from toolkit.cli import main
from toolkit.models.tiny import build_tiny
from toolkit.traces.capture import TraceSettings, run_trace
from toolkit.traces.format import DECODE, TraceReader

CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA GPU: the workstation path (run on a GPU machine)")
REPO = Path(__file__).resolve().parent.parent


def cli(*args) -> str:
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == 0, r.output + (repr(r.exception) if r.exception else "")
    return r.output


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    """A tiny Qwen3-MoE and 24 texts of many lengths (so batches need padding)."""
    d = tmp_path_factory.mktemp("cuda")
    lines = (REPO / "toolkit" / "embedded" / "heldout.jsonl").read_text().splitlines()[:24]
    texts = [json.loads(x)["text"] for x in lines]
    data = d / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t[: 60 + 29 * (i % 9)]}) + "\n" for i, t in enumerate(texts)))
    return {"dir": d, "model": build_tiny("qwen3_moe", d / "model", seed=1), "data": data}


TRACE_ARGS = ("--max-sequences", 24, "--prompt-tokens", 32, "--decode-tokens", 6, "--heldout-frac", 0.25,
              "--shard-tokens", 200)


def _load(trace: Path, split: str) -> dict[str, np.ndarray]:
    return TraceReader(trace).load(split, ("seq", "pos", "kind", "token_id", "expert_ids", "router_probs"))


@CUDA
def test_trace_on_cuda_records_what_the_cpu_records(setup):
    """`trace --device cuda` batches prompts (16 by default) and records the CPU's routing."""
    d = setup["dir"]
    cli("trace", setup["model"], "--data", setup["data"], "--out", d / "cpu", *TRACE_ARGS)
    cli("trace", setup["model"], "--data", setup["data"], "--out", d / "gpu", "--device", "cuda", *TRACE_ARGS)
    run_trace(setup["model"], [setup["data"]], d / "gpu1", TraceSettings(
        max_sequences=24, prompt_tokens=32, decode_tokens=6, heldout_frac=0.25, shard_tokens=200, device="cuda:0",
        batch=1), progress=False)
    assert TraceReader(d / "gpu").manifest["settings"]["batch"] == 16
    assert TraceReader(d / "gpu1").manifest["settings"]["batch"] == 1
    for split in ("train", "heldout"):
        cpu, gpu, gpu1 = _load(d / "cpu", split), _load(d / "gpu", split), _load(d / "gpu1", split)
        for other in (gpu, gpu1):
            np.testing.assert_array_equal(cpu["seq"], other["seq"])
            np.testing.assert_array_equal(cpu["kind"], other["kind"])
            # another device's float32 sums may flip a near-tie: nearly every token and expert agrees
            assert (cpu["token_id"] == other["token_id"]).mean() > 0.99
            assert (np.sort(cpu["expert_ids"], -1) == np.sort(other["expert_ids"], -1)).mean() > 0.99
            np.testing.assert_allclose(cpu["router_probs"].astype(np.float32),
                                       other["router_probs"].astype(np.float32), atol=5e-3)
        np.testing.assert_array_equal(gpu["token_id"], gpu1["token_id"])  # batched = one at a time, on the GPU


@CUDA
def test_trace_on_cuda_in_bfloat16_and_across_gpus(setup):
    d = setup["dir"]
    cli("trace", setup["model"], "--data", setup["data"], "--out", d / "bf16", "--device", "cuda",
        "--dtype", "bfloat16", *TRACE_ARGS)
    a = _load(d / "bf16", "train")
    assert (a["kind"] == DECODE).sum() == 6 * len(TraceReader(d / "bf16").manifest["split"]["train"])
    assert np.isfinite(a["router_probs"].astype(np.float32)).all()
    cli("trace", setup["model"], "--data", setup["data"], "--out", d / "auto", "--device", "auto", *TRACE_ARGS)
    assert TraceReader(d / "auto").manifest["split"] == TraceReader(d / "bf16").manifest["split"]


@CUDA
def test_trace_split_over_gpu_and_host_records_the_unsplit_routing(setup):
    """`--device auto --max-memory 0=...,cpu=...`: a GPU budget for part of the weights, the other
    layers in host memory (accelerate computes them on the GPU, copying their weights in for each
    pass): the routing and tokens are the one-GPU trace's; probabilities and router inputs to fp16's
    rounding."""
    from toolkit.models.loader import load_model

    d = setup["dir"]
    # a GPU budget for 80% of the fp16 weights: accelerate keeps room on the GPU for the largest offloaded
    # layer, so this puts a few modules on the GPU and the rest in host memory
    gpu = 2 * sum(p.numel() for p in load_model(setup["model"]).model.parameters()) * 4 // 5
    cli("trace", setup["model"], "--data", setup["data"], "--out", d / "one", "--device", "cuda", "--dtype",
        "float16", *TRACE_ARGS)
    cli("trace", setup["model"], "--data", setup["data"], "--out", d / "split", "--device", "auto", "--dtype",
        "float16", "--max-memory", f"0={gpu // 1024}KiB,cpu=64GiB", *TRACE_ARGS)
    placed = TraceReader(d / "split").manifest["settings"]["placement"]
    assert {"0", "cpu"} <= set(placed.values()), placed
    for split in ("train", "heldout"):
        a = TraceReader(d / "one").load(split, ("token_id", "expert_ids", "router_probs", "hidden"))
        b = TraceReader(d / "split").load(split, ("token_id", "expert_ids", "router_probs", "hidden"))
        np.testing.assert_array_equal(a["expert_ids"], b["expert_ids"])
        np.testing.assert_array_equal(a["token_id"], b["token_id"])
        for k in ("router_probs", "hidden"):   # fp16: the offload hooks' decode steps may round differently
            np.testing.assert_allclose(a[k].astype(np.float32), b[k].astype(np.float32), atol=2e-2, err_msg=k)


@CUDA
def test_trace_of_images_on_cuda(tmp_path):
    """A vision-language model: image tensors go to the GPU with the prompt (one prompt at a time)."""
    from PIL import Image

    model = build_tiny("qwen3_vl_moe", tmp_path / "vl", seed=1)
    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((64, 48, 3)) * 255).astype("uint8")).save(tmp_path / "a.png")
    rows = [{"text": "A photo of a red kite over a hill.", "image": "a.png"}, {"text": "Plain text, no image."}]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cli("trace", model, "--data", tmp_path / "pairs.jsonl", "--out", tmp_path / "t", "--device", "cuda",
        "--prompt-tokens", 32, "--decode-tokens", 3, "--heldout-frac", 0)
    m = TraceReader(tmp_path / "t").manifest
    assert m["tokens"]["train"]["image"] > 0 and m["settings"]["batch"] == 1


@CUDA
def test_train_on_cuda(setup):
    """`train --device cuda` (pair_targets stacked a CPU mask with CUDA tensors): the adapter trains
    on the GPU, is written on the CPU, and learns what the CPU-trained one learns."""
    d = setup["dir"]
    trace = d / "train-trace"
    cli("trace", setup["model"], "--data", setup["data"], "--out", trace, *TRACE_ARGS)
    args = ("--steps", 40, "--val-every", 10, "--rank", 4, "--batch-size", 64, "--topk-weight", 0.5)
    cli("train", trace, "--out", d / "a-cpu", *args)
    cli("train", trace, "--out", d / "a-gpu", "--device", "cuda", *args)
    cpu, gpu = read_adapter_meta(d / "a-cpu"), read_adapter_meta(d / "a-gpu")
    assert gpu["training"]["device"] == "cuda"
    for h in ("1", "2"):
        assert abs(cpu["validation"]["adapter"]["recall_at_k"][h]
                   - gpu["validation"]["adapter"]["recall_at_k"][h]) < 0.05
    assert gpu["validation"]["adapter"]["loss"] <= gpu["validation"]["next_gate"]["loss"] + 1e-6
    assert abs(cpu["validation"]["adapter"]["loss"] - gpu["validation"]["adapter"]["loss"]) < 0.05


@CUDA
def test_trace_train_eval_simulate_on_cuda(setup):
    """The GPU pipeline end to end: trace and train on the GPU, then eval and simulate on them."""
    d = setup["dir"]
    trace, adapter = d / "p-trace", d / "p-adapter"
    cli("trace", setup["model"], "--data", setup["data"], "--out", trace, "--device", "cuda", *TRACE_ARGS)
    cli("train", trace, "--out", adapter, "--device", "cuda", "--steps", 30, "--val-every", 10, "--rank", 4,
        "--batch-size", 64)
    cli("eval", trace, "--adapter", adapter, "--predictors", "next-gate,adapter,frequency,oracle",
        "--json", d / "eval.json")
    e = json.loads((d / "eval.json").read_text())
    assert e["predictors"]["oracle"]["recall_at_k"]["1"] == 1.0
    assert 0 < e["predictors"]["adapter"]["recall_at_k"]["1"] <= 1.0
    cli("simulate", trace, "--adapter", adapter, "--policies", "on-demand+lru,adapter+prediction",
        "--json", d / "sim.json")
    s = json.loads((d / "sim.json").read_text())
    assert {r["predictor"] for p in s["points"] for r in p["results"]} == {"on-demand", "adapter"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the GPU tests above run instead")
def test_cuda_asked_for_without_a_gpu_is_a_one_line_error(tmp_path):
    model = build_tiny("qwen3_moe", tmp_path / "model", seed=1)
    for args in (("trace", model, "--data", REPO / "toolkit" / "embedded" / "heldout.jsonl", "--out",
                  tmp_path / "t", "--device", "cuda"),
                 ("trace", model, "--data", REPO / "toolkit" / "embedded" / "heldout.jsonl", "--out",
                  tmp_path / "t", "--device", "auto"),
                 ("train", tmp_path / "no-trace-needed", "--out", tmp_path / "t", "--device", "cuda")):
        r = CliRunner().invoke(main, [str(a) for a in args])
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        assert "CUDA" in r.output, r.output
        assert not (tmp_path / "t").exists()
