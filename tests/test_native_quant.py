"""Quantised dense programs natively (issue 21, deliverable 2): an 8da4w (and 8da8w) ExecuTorch bundle
runs in the native runner with every policy, and every policy at every pool gives the tokens of the
same bundle with every expert resident (the promise for a quantised bundle; its tokens need not be
the fp32 checkpoint's). The check `runner bench` reports (`tokens_match_resident`) is
android_runner.bench.token_check, tested here on real runs too."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from android_runner.bench import is_quantised, token_check

MiB = 2**20
N_NEW = 8


def test_token_check_names_the_first_difference():
    ref = [[5, 6, 7, 8], [9, 10]]
    same = {"runs": [{"tokens": [5, 6, 7, 8]}, {"tokens": [9, 10]}]}
    assert token_check([same, same], ref) == {"match": True, "runs": 4, "mismatches": []}
    off = {"runs": [{"tokens": [5, 6, 1, 8]}, {"tokens": [9]}]}  # a changed token, then one stopped early
    got = token_check([same, off], ref)
    assert got["match"] is False and got["runs"] == 4
    assert got["mismatches"] == [{"prompt": 0, "at": 2, "got": 4, "want": 4},
                                 {"prompt": 1, "at": 1, "got": 1, "want": 2}]
    assert token_check([{"runs": [{"tokens": [5, 6, 7, 8]}]}], ref)["match"] is False  # a prompt missing


def test_which_bundles_are_quantised():
    assert not is_quantised({"quantization": {"dense": "fp32", "experts": "fp16"}})
    assert is_quantised({"quantization": {"dense": "8da4w", "experts": "fp16"}})
    assert is_quantised({"quantization": {"dense": "fp32", "experts": "int4"}})
    assert is_quantised({"quantization": {"dense": "8da8w", "experts": "int8"}})
    from toolkit.peers.sidebyside import is_quantised as sbs_quantised  # the side by side uses the same rule
    for q in ({"dense": "fp32", "experts": "fp16"}, {"dense": "8da4w", "experts": "int4"}, {"dense": "w8"}):
        assert sbs_quantised({"quantization": q}) == is_quantised({"quantization": q})


def _export(model: Path, out: Path, quant: str, experts: str) -> Path:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(["specprefetch", "export", str(model), "--target", "executorch", "--quant", quant,
                        "--experts", experts, "--max-seq", "48", "--out", str(out)],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.mark.slow  # an export (~30 s) and the native runner's build for the bundle (minutes when not cached)
@pytest.mark.parametrize("quant,experts", [("8da4w", "int4"), ("8da8w", "int8")])
def test_quantised_bundle_every_policy_and_pool_gives_the_resident_tokens(tmp_path, quant, experts):
    from android_runner.build import build, run_native
    from toolkit.models.tiny import build_tiny
    from toolkit.runtime.expert_store import ExpertStore

    model = build_tiny("qwen3_moe", tmp_path / "model", seed=3)
    bundle = _export(model, tmp_path / "bundle", quant, experts)
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["quantization"]["dense"] == quant and m["quantization"]["experts"] == experts and is_quantised(m)
    st = ExpertStore(bundle / m["runtime"]["expert_store"])
    k, slots = int(m["routing"]["top_k"]), st.num_layers * st.num_experts
    all_mib = slots * st.slot_bytes / MiB + 0.01
    graph = m["predictor"]["kind"] if m["predictor"].get("preds_rows") else "next-gate"
    prompts = [[11, 42, 7, 300, 5, 9, 77, 12, 64, 3], [200, 17, 33, 4, 81, 150, 6, 2]]
    runner = build(bundle, "host", log=lambda s: None)

    resident = run_native(bundle, prompts, max_new_tokens=N_NEW, policy="on-demand+lru", pool_mib=all_mib,
                          extra=["--preload"], runner=runner)
    ref = [r["tokens"] for r in resident["runs"]]
    assert all(1 <= len(t) <= N_NEW for t in ref)  # (the runner stops at an EOS, as generate does)
    pools = [k * st.slot_bytes / MiB, max(k + 1, slots // 3) * st.slot_bytes / MiB]  # one layer's top-k; a third
    results, reads = [], {}
    for pool in pools:
        for policy in ("on-demand+lru", f"{graph}+prediction", "oracle+belady"):
            res = run_native(bundle, prompts, max_new_tokens=N_NEW, policy=policy, pool_mib=pool, cold=True,
                             runner=runner)
            results.append(res)
            got = [r["tokens"] for r in res["runs"]]
            assert got == ref, (quant, policy, pool, got, ref)
            reads[(policy, pool)] = sum(r["mib_read"] for r in res["runs"])
    # the small pool really streamed: experts were read during the run, more than the oracle needs
    assert reads[("on-demand+lru", pools[0])] > 0
    assert reads[("oracle+belady", pools[0])] <= reads[("on-demand+lru", pools[0])] + 1e-9
    chk = token_check(results, ref)
    assert chk == {"match": True, "runs": len(results) * len(prompts), "mismatches": []}
