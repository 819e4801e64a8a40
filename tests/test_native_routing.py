"""The native runner's expert selection (android_runner/src/routing.cpp) against the reference
(toolkit.models.families.select_experts) for every kind of router: plain softmax, softmax with
top-k renormalised, sigmoid with a selection bias and group-limited top-k (DeepSeek-V3), group max
(DeepSeek-V2), and top-k before softmax (GPT-OSS). The same experts in the same order, and the
same weights to float32 rounding."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from toolkit.models.families import RoutingSpec, select_experts

SRC = Path(__file__).resolve().parent.parent / "android_runner"
N = 1000

SPECS = {
    "qwen3-moe": RoutingSpec(num_experts=128, top_k=8, norm_topk_prob=True),
    "mixtral": RoutingSpec(num_experts=8, top_k=2, norm_topk_prob=True),
    "olmoe": RoutingSpec(num_experts=64, top_k=8),
    "deepseek-v3": RoutingSpec(num_experts=256, top_k=8, score_func="sigmoid", n_group=8, topk_group=4,
                               group_score="top2sum", score_bias=True, routed_scaling_factor=2.5,
                               norm_topk_prob=True),
    "deepseek-v2": RoutingSpec(num_experts=64, top_k=6, n_group=8, topk_group=3, group_score="max",
                               routed_scaling_factor=1.5),
    "gpt-oss": RoutingSpec(num_experts=32, top_k=4, topk_before_softmax=True),
}


@pytest.fixture(scope="module")
def check_routing(tmp_path_factory) -> Path:
    if not shutil.which("g++"):
        pytest.skip("g++ not installed (make setup installs it)")
    exe = tmp_path_factory.mktemp("routing") / "check_routing"
    subprocess.run(["g++", "-std=c++17", "-O2", "-I", str(SRC / "src"), str(SRC / "tests" / "check_routing.cpp"),
                    str(SRC / "src" / "routing.cpp"), "-o", str(exe)], check=True)
    return exe


@pytest.mark.parametrize("name", list(SPECS))
def test_selection_matches_the_reference(check_routing, tmp_path, name):
    spec = SPECS[name]
    E, k = spec.num_experts, spec.top_k
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(N, E, generator=g) * 2.0).float()
    bias = (torch.randn(E, generator=g) * 0.05).float()
    logits.numpy().tofile(tmp_path / "logits.bin")
    bias.numpy().tofile(tmp_path / "bias.bin")
    subprocess.run([str(check_routing), str(E), str(k), spec.score_func, str(spec.n_group or 0),
                    str(spec.topk_group or 0), spec.group_score, str(int(spec.score_bias)),
                    str(int(spec.topk_before_softmax)), str(int(spec.norm_topk_prob)),
                    repr(spec.routed_scaling_factor), str(N), str(tmp_path / "logits.bin"),
                    str(tmp_path / "bias.bin"), str(tmp_path / "out.bin")], check=True)
    raw = np.fromfile(tmp_path / "out.bin", dtype=np.int32).reshape(N, 2 * k)
    ids, w = raw[:, :k], raw[:, k:].copy().view(np.float32)
    ref_w, ref_ids = select_experts(logits, spec, bias if spec.score_bias else None)
    assert (ids == ref_ids.numpy()).all(), f"{(ids != ref_ids.numpy()).any(1).sum()} of {N} rows differ"
    np.testing.assert_allclose(w, ref_w.numpy(), rtol=1e-5, atol=1e-7)
