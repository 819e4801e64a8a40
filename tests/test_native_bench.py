"""`specprefetch runner bench` end to end on the shared embedded bundle, small (one prompt, a few
tokens, one round): the report's shape and that its figures are real measurements (slow)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.simulate.calibrate import FLASH_BOUND

pytestmark = pytest.mark.slow


def test_runner_bench_reports_every_part(embedded_bundles, tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SPECPREFETCH_PROFILES": str(tmp_path / "cache" / "profiles")}
    out = tmp_path / "native.json"
    asked = ["The kernel's memory allocator", "To open a file for reading, use"]
    r = subprocess.run(["specprefetch", "runner", "bench", str(embedded_bundles["executorch"]), "--prompt", asked[0],
                        "--prompt", asked[1],
                        "--new-tokens", "6", "--rounds", "1", "--pool-frac", "0.13", "--ablation",
                        "--variant", "queue_depth=1,candidate_threshold=0.2", "--read-budget-kib", "1024",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=1800, env=env)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["threads"] == 1 and res["prompts"] == asked  # --prompt: these texts, not held-out ones
    rs = res["resident"]
    assert rs["python_tpot_ms"] > 0 and rs["native_tpot_ms"] > 0 and rs["floor_ms"] > 0
    # the same work, the same thread settings: the native runner is the faster engine
    assert rs["python_tpot_ms"] > rs["native_first_use_tpot_ms"] and rs["python_over_native"] > 1
    (point,) = res["points"]
    pols = point["policies"]
    # a fixed read budget for every streaming row (the runs' decisions then independent of timing, so the
    # simulator's replays below are exact; `auto`, the default, in test_read_budget_measured_in_the_run and
    # test_runtime's test_runs_budget_kib); the predictor also runs without it
    assert res["read_budget_kib"] == 1024
    budget = "next-gate+prediction read-budget=off"
    variant = "next-gate+prediction scheduler=candidate_threshold=0.2,queue_depth=1"
    assert set(pols) == {"on-demand+lru", "previous-token+lru", "next-gate+prediction", "oracle+belady",
                         "oracle+lru", "oracle+prediction", "next-gate+belady", "on-demand+belady", budget, variant}
    # --variant: the predictor with other scheduler settings, run and simulated with them; the simulator
    # replays the runner's decisions, so its bytes are the variant's own, not the bundle's settings'
    sp = next(x["policies"] for x in res["simulated"]["points"])
    assert pols[variant]["tokens_match_resident"]
    assert point["predictor_over_variant"] == {variant.split("=", 1)[1]: round(
        pols["next-gate+prediction"]["tpot_ms"] / pols[variant]["tpot_ms"], 3)}
    mib = {n: pols[n]["mib_read_per_token"] for n in ("next-gate+prediction", variant)}
    assert mib[variant] != mib["next-gate+prediction"]
    for a, b in ((variant, "next-gate+prediction"), ("next-gate+prediction", variant)):
        assert abs(sp[a]["mib_read_per_token"] - mib[a]) < abs(sp[a]["mib_read_per_token"] - mib[b]), (a, sp, mib)
    assert point["no_read_budget_over_predictor"] == round(pols[budget]["tpot_ms"] /
                                                           pols["next-gate+prediction"]["tpot_ms"], 3)
    assert pols[budget]["tokens_match_resident"] and pols[budget]["read_budget_kib"] is None
    for name in ("next-gate+prediction", "previous-token+lru", "oracle+belady", "on-demand+lru", variant):
        assert pols[name]["read_budget_kib"] == 1024, name
    assert "read budget 1024 KiB a step" in Path(str(out).replace(".json", ".md")).read_text()
    assert res["ablation"] is True
    assert point["predictor_eviction_over_belady"] == round(pols["next-gate+prediction"]["tpot_ms"] /
                                                            pols["next-gate+belady"]["tpot_ms"], 3)
    # reading on demand only, Belady's eviction (it knows the future) reads no more than LRU
    assert pols["on-demand+belady"]["mib_read_per_token"] <= pols["on-demand+lru"]["mib_read_per_token"]
    assert "eviction ablation" in Path(str(out).replace(".json", ".md")).read_text()
    assert point["temporal_over_predictor"] == round(pols["previous-token+lru"]["tpot_ms"] /
                                                     pols["next-gate+prediction"]["tpot_ms"], 3)
    # real reads: on-demand reads something at 13% of the experts; the oracle's bound holds on reads
    assert pols["on-demand+lru"]["mib_read_per_token"] > 0
    assert pols["oracle+belady"]["mib_read_per_token"] <= pols["on-demand+lru"]["mib_read_per_token"]
    for name, v in pols.items():  # every row simulated, the read-budget=off row too
        assert v["sim_over_measured"] > 0 and v["simulated_tpot_ms"] > 0, name
    prof = res["simulated"]["profile"]
    # the flash rate: the runner's own (its flash-bound calibration run, then fitted) or the burst table's
    src = prof["measured"]["flash_rate_from"]
    assert src == "burst" or src.startswith("runner"), src
    pm = prof["measured"]
    assert (src == "burst") == (pm["oracle_stall_ms_per_token"] < FLASH_BOUND * pm["oracle_tpot_ms"])
    assert Path(str(out).replace(".json", ".md")).is_file() and Path(str(out).replace(".json", ".png")).is_file()
    assert prof["measured"]["prompts"] == 2 and prof["dense_ms_per_layer"] > 0
    # the simulator's flash rate came from the bench's own oracle + Belady runs at its (one) pool: the profile
    # records their budget, that row says it is the calibration's, the others are predictions
    cal = res["simulated"]["calibrated_on"]
    assert cal == {"policy": "oracle+belady", "slots": point["slots"], "pool_mib": round(point["pool_mib"], 3),
                   "flash_rate_from": src, "row_fitted": src != "burst"}
    assert abs(pm["oracle_pool_mib"] - point["slots"] * res["slot_bytes"] / 2**20) < 1e-3
    # (the embedded model: 33 slots at 13%, against half a token's 16: the bench's own runs were used)
    assert pm["oracle_runs"] == 2 and pm["oracle_pool_mib"] > pm["tiny_pool_mib"]
    fitted_rows = [n for n, v in pols.items() if v.get("simulator_calibration")]
    assert fitted_rows == ([] if src == "burst" else ["oracle+belady"])
    assert ("(calibration)" in Path(str(out).replace(".json", ".md")).read_text()) == (src != "burst")
    assert "a streaming token" in Path(str(out).replace(".json", ".md")).read_text()
