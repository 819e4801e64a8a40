"""Pool, scheduler and simulator, on real files and models (the expert store: test_expert_store.py; the
runner: test_runner.py)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_helpers import cli_plain
from conftest import HELDOUT
from toolkit.errors import SpecPrefetchError
from toolkit.models.loader import inspect_model_dir
from toolkit.runtime.expert_store import build_store
from toolkit.runtime.pool import ExpertPool
from toolkit.runtime.scheduler import SchedulerConfig, WindowScheduler
from toolkit.simulate.flash import SimClock, SimFlash
from toolkit.runtime.profiles import SNAPDRAGON_8_ELITE, load_profile, save_profile


@pytest.fixture(scope="module")
def emb_store(embedded, tmp_path_factory) -> Path:
    return build_store(inspect_model_dir(embedded), tmp_path_factory.mktemp("s") / "e.spx", "fp16", progress=False)


# -- pool -------------------------------------------------------------------------------------

def test_pool_budget_and_capacity_error():
    with pytest.raises(SpecPrefetchError, match="holds 3 expert slots .* one layer needs 4"):
        ExpertPool(3 * 4096 + 100, 4096, min_slots=4)
    pool = ExpertPool(10 * 4096 + 4095, 4096, policy="lfu", min_slots=4)
    rng = random.Random(0)
    for now in range(500):
        key = (rng.randrange(4), rng.randrange(16))
        s = pool.get(key)
        if s is None:
            s = pool.reserve(key, now, prefetch=rng.random() < 0.5)
            s.ready = True
        pool.touch(s, now)
        assert pool.used_bytes <= pool.budget_bytes
    assert pool.peak_bytes == 10 * 4096 and pool.capacity == 10


def test_pool_budget_is_a_check_not_an_assert():
    """Under `python -O` an assert vanishes; the budget must hold even if capacity were miscounted."""
    pool = ExpertPool(4 * 4096, 4096, min_slots=2)
    pool.capacity += 1  # a bookkeeping bug
    for e in range(4):
        pool.reserve((0, e), e, prefetch=False).ready = True
    with pytest.raises(RuntimeError, match="pool over budget"):
        pool.reserve((0, 9), 9, prefetch=False)
    assert pool.used_bytes <= pool.budget_bytes


def _fill(pool, keys, now0=0):
    for n, k in enumerate(keys):
        s = pool.reserve(k, now0 + n, prefetch=False)
        s.ready = True
        pool.touch(s, now0 + n)


def test_eviction_policies_choose_the_right_victim():
    lru = ExpertPool(3 * 10, 10, policy="lru")
    _fill(lru, [(0, 0), (0, 1), (0, 2)])
    lru.touch(lru.get((0, 0)), 5)
    lru.reserve((0, 3), 6, prefetch=False)
    assert set(lru.slots) == {(0, 0), (0, 2), (0, 3)}  # (0, 1) was least recent

    lfu = ExpertPool(3 * 10, 10, policy="lfu")
    _fill(lfu, [(0, 0), (0, 1), (0, 2)])
    for t in (5, 6):
        lfu.touch(lfu.get((0, 2)), t)
        lfu.touch(lfu.get((0, 0)), t)
    lfu.reserve((0, 3), 7, prefetch=False)
    assert (0, 1) not in lfu.slots

    future = {(0, 0): 100, (0, 1): 10, (0, 2): 50}
    bel = ExpertPool(3 * 10, 10, policy="belady", next_use=lambda k, now: future.get(k, float("inf")))
    _fill(bel, [(0, 0), (0, 1), (0, 2)])
    bel.get((0, 1)).pins = 1  # pinned: never a victim even if farthest
    future[(0, 1)] = 1000
    bel.reserve((0, 3), 4, prefetch=False)
    assert (0, 0) not in bel.slots and (0, 1) in bel.slots


def _reference_victim(pool, now, protect):
    """Every policy's victim as the pool once found it, by scoring every evictable slot: the rule the C++
    runner mirrors, tie-breaks included."""
    cands = [s for s in pool.slots.values() if s.ready and s.pins == 0 and s.key not in protect]
    if not cands:
        return None
    if pool.policy == "lru":
        return min(cands, key=lambda s: (s.last_use, s.key)).key
    if pool.policy == "lfu":
        return min(cands, key=lambda s: (s.uses, s.last_use, s.key)).key
    if pool.policy == "reuse":
        return max(cands, key=lambda s: (pool.reuse.score(s.key, now, pool.predicted), -s.last_use, s.key)).key
    if pool.predicted is not None:
        def nxt(s):
            v = pool.predicted.get(s.key)
            return (float("inf") if v is None or v < now else v, -s.last_use, s.key)
        return max(cands, key=nxt).key
    return max(cands, key=lambda s: (pool.next_use(s.key, now), -s.last_use, s.key)).key


@pytest.mark.parametrize("policy,source", [("lru", None), ("lfu", None), ("prediction", "table"),
                                           ("prediction", "next_use"), ("belady", "next_use"), ("reuse", "table"),
                                           ("reuse", None)])
def test_victim_search_equals_the_full_scan(policy, source):
    """The pool's victim search (groups of slots by last use, walked oldest first, stopping early; the reuse
    rule's scores in one pass) picks exactly the slot the full scan of every evictable slot picks, over
    random reservations, uses (steps going back too), pins, loading slots, protected keys, predictions
    (stale ones too), never-used-again experts, ties of every kind and reuse histories with next visits."""
    from adapters.reuse import SCALE, ReuseTable
    from toolkit.runtime.reuse import ReuseHistory

    rng = random.Random(f"{policy}-{source}")
    L, E, cap = 3, 6, 7
    future: dict = {}
    nxt = lambda key, now: future.get(key, float("inf"))  # noqa: E731
    pool = ExpertPool(cap * 10, 10, policy=policy, min_slots=1, next_use=nxt)
    if source == "table":
        pool.predicted = {}
    if policy == "reuse":
        pool.reuse = ReuseHistory(ReuseTable(2, 8, (8 * SCALE, 2 * SCALE, 3 * SCALE, 1 * SCALE)), L)
    keys = [(li, e) for li in range(L) for e in range(E)]
    checked = 0
    for it in range(3000):
        now = it // 4 + rng.choice([0, 0, 0, -3])
        op = rng.random()
        if op < 0.35:
            key = rng.choice(keys)
            if key not in pool.slots:
                protect = set(rng.sample(keys, rng.randint(0, 3)))
                want = _reference_victim(pool, now, protect) if len(pool.slots) >= cap else None
                got = pool._victim(now, protect) if len(pool.slots) >= cap else None
                assert got == want, (it, policy, source)
                checked += want is not None
                slot = pool.reserve(key, now, prefetch=rng.random() < 0.5, protect=protect)
                if slot is not None:
                    slot.ready = rng.random() < 0.8
        elif op < 0.7 and pool.slots:
            slot = pool.slots[rng.choice(list(pool.slots))]
            pool.touch(slot, rng.choice([now, now, now - 1, -1]))   # ties, and a use older than the last
        elif op < 0.8 and pool.slots:
            slot = pool.slots[rng.choice(list(pool.slots))]
            slot.pins = rng.choice([0, 0, 1])
            slot.ready = slot.ready or rng.random() < 0.5
        elif op < 0.85 and pool.slots:
            key = rng.choice(list(pool.slots))
            if not pool.slots[key].pins:
                pool.evict(key)
        else:   # predictions: the scheduler's table, a next-use oracle, reuse histories and next visits
            key = rng.choice(keys)
            if pool.predicted is not None:
                pool.predicted[key] = now + rng.randint(-2, 3)
            future[key] = rng.choice([now + rng.randint(1, 4), float("inf")])
            if pool.reuse is not None:
                li = rng.randrange(L)
                pool.reuse.observe(now, [(li, e) for e in rng.sample(range(E), 2)])
                if rng.random() < 0.5:
                    pool.reuse.set_next_visits(li, now + rng.randint(1, L),
                                               [rng.sample(range(E), 2) for _ in range(rng.randint(1, 3))])
    assert checked > 200
    for s in pool.slots.values():   # the last-use groups hold exactly the pool's slots
        assert pool._by_use[s.last_use][s.key] is s
    assert sum(map(len, pool._by_use.values())) == len(pool.slots) and pool._uses == sorted(pool._by_use)


# -- scheduler on simulated flash ---------------------------------------------------------------

def _drive(pattern, predict, pool_slots=6, window=2):
    """Run a fixed expert-use pattern [(layer, [experts])...] through scheduler + SimFlash."""
    clock = SimClock()
    flash = SimFlash(SNAPDRAGON_8_ELITE, clock, 128 * 1024)
    holder = {}
    pool = ExpertPool(pool_slots * 128 * 1024, 128 * 1024, policy="prediction", min_slots=2,
                      next_use=lambda k, now: holder["s"].next_predicted_use(k, now))
    sched = WindowScheduler(pool, flash, SchedulerConfig(prefetch=predict), num_layers=4, top_k=2,
                            clock=lambda: clock.now)
    holder["s"] = sched
    stall = 0.0
    for step, (layer, experts) in enumerate(pattern):
        clock.now += 0.0005
        keys = [(layer, e) for e in experts]
        t0 = clock.now
        sched.acquire(step, keys)  # as the runner: acquire, plan the window, then wait for bytes
        if predict:
            win = []
            for h in range(1, window + 1):
                if step + h < len(pattern):
                    sc = torch.zeros(8)
                    sc[pattern[step + h][1]] = 1.0
                    win.append((step + h, sc))
            sched.plan(step, win)
        for k in keys:
            sched.data(k)
        stall += clock.now - t0
        clock.now += 0.0003
        sched.release(step, keys)
        assert pool.used_bytes <= pool.budget_bytes
    return sched.stats, stall


def test_prefetch_with_perfect_predictions_hides_reads():
    rng = random.Random(1)
    pattern = [(s % 4, rng.sample(range(8), 2)) for s in range(200)]
    demand, stall_d = _drive(pattern, predict=False)
    pre, stall_p = _drive(pattern, predict=True)
    assert demand.prefetch_issued == 0 and demand.misses + demand.hits == demand.requests == 400
    assert pre.hits > demand.hits and pre.prefetch_hits > 0
    assert stall_p < 0.5 * stall_d


# -- simulator ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sim_trace(embedded, tmp_path_factory) -> Path:
    from toolkit.traces.capture import TraceSettings, run_trace

    s = TraceSettings(max_sequences=24, prompt_tokens=64, decode_tokens=16, heldout_frac=0.35,
                      shard_tokens=2000, hidden_sample=0.3, batch=8)   # batched: the same experts, faster
    return run_trace(embedded, [HELDOUT], tmp_path_factory.mktemp("st") / "t", s, progress=False)


def test_simulator_takes_the_read_budget(sim_trace):
    """`simulate --read-budget-kib`: the simulator runs the same scheduler rule as the runners: past the
    budget prefetches are dropped as late (fewer issued, none without it); tokens are not simulated, so
    the counts are what it shows. Below one slot it is refused by name."""
    from toolkit.runtime.policy import Policy
    from toolkit.simulate.replay import run_simulation

    pol = [Policy("next-gate", "prediction")]
    got = {rb: run_simulation(sim_trace, policies=pol, profile=SNAPDRAGON_8_ELITE, pool_mib=4, window=2,
                              read_budget_kib=rb)["results"][0]["counts"] for rb in (None, 120, 601)}
    assert got[None]["dropped_late"] == 0
    # one slot a step: the window's prefetches alone exceed it (demand reads are not counted)
    assert got[120]["dropped_late"] > 0 and 0 < got[120]["prefetch_issued"] < got[None]["prefetch_issued"]
    assert got[601]["dropped_late"] <= got[120]["dropped_late"]   # a larger budget drops no more
    code, out = cli_plain("simulate", sim_trace, "--policies", "next-gate+prediction", "--pool-mib", "4",
                          "--read-budget-kib", "100", "--json", sim_trace.parent / "rb.json")
    assert code == 2 and "--read-budget-kib 100: below one expert slot" in out, out


def test_streaming_tokens_cost_their_part(sim_trace):
    """A profile's `streaming_token_ms` is charged on every decode token that reads anything and on no other:
    on-demand at a small pool (every token reads) is that much slower a token; with a pool of every expert
    (a token reads only experts it meets for the first time) less than that."""
    import dataclasses

    from toolkit.runtime.policy import Policy
    from toolkit.simulate.replay import run_simulation

    pol = [Policy("on-demand", "lru")]
    more = dataclasses.replace(SNAPDRAGON_8_ELITE, streaming_token_ms=5.0)

    def tpot(profile, pool):
        return run_simulation(sim_trace, policies=pol, profile=profile, pool_mib=pool, window=2)["results"][0]

    small, small5 = tpot(SNAPDRAGON_8_ELITE, 4), tpot(more, 4)
    assert small["mib_read_per_token"] > 0 and small5["tpot_ms"] - small["tpot_ms"] == pytest.approx(5.0, abs=0.01)
    # a pool of every expert: only a token meeting an expert for the first time reads (the pool starts empty),
    # so fewer than every token pay it
    full, full5 = tpot(SNAPDRAGON_8_ELITE, 1024), tpot(more, 1024)
    assert full["mib_read_per_token"] < small["mib_read_per_token"]
    assert 0 <= full5["tpot_ms"] - full["tpot_ms"] < 5.0 - 0.01


def test_read_budget_from_a_rate_and_a_step():
    """`--read-budget-kib auto`'s rule: KiB the flash delivers in one step, rounded down, at least a slot."""
    from toolkit.runtime.profiles import read_budget_kib, read_lanes

    assert read_budget_kib(100.0, 0.01, 120 * 1024) == {"kib": 1024, "raised": False, "read_mibs": 100.0,
                                                         "step_ms": 10.0}
    low = read_budget_kib(10.0, 0.001, 120 * 1024)   # 10 KiB a step, below a 120 KiB slot
    assert low["kib"] == 120 and low["raised"]
    assert read_budget_kib(1.0, 1.0, 1000)["kib"] == 1024   # a slot of 1000 B: its KiB rounded up
    assert [read_lanes(q) for q in (1, 4, 7, 63)] == [2, 5, 8, 8]


def test_simulator_derives_the_read_budget_from_the_profile(sim_trace, tmp_path):
    """`simulate --read-budget-kib auto`: the profile's flash rate for a slot at the runner's read lanes
    times the simulator's decode step, and the same counts as that number given by hand."""
    from toolkit.runtime.policy import Policy
    from toolkit.runtime.profiles import read_budget_kib, read_lanes
    from toolkit.simulate.replay import Geometry, decode_step_s, run_simulation

    pol = [Policy("next-gate", "prediction")]
    prof = SNAPDRAGON_8_ELITE
    auto = run_simulation(sim_trace, policies=pol, profile=prof, pool_mib=4, window=2, read_budget_kib="auto")
    geo = Geometry(**auto["geometry"])
    want = read_budget_kib(prof.bandwidth_mibs(geo.slot_bytes, read_lanes(4)), decode_step_s(prof, geo),
                           geo.slot_bytes)
    assert auto["read_budget_auto"] == {**want, "lanes": 5} and auto["read_budget_kib"] == want["kib"]
    # hand-computed: 1600-2300 MiB/s at 120 KiB and 5 lanes x a step of 0.06 ms + the layer's GEMVs
    assert want["kib"] >= 120
    hand = run_simulation(sim_trace, policies=pol, profile=prof, pool_mib=4, window=2, read_budget_kib=want["kib"])
    assert auto["results"][0]["counts"] == hand["results"][0]["counts"]
    code, out = cli_plain("simulate", sim_trace, "--policies", "next-gate+prediction", "--pool-mib", "4",
                          "--read-budget-kib", "auto", "--json", tmp_path / "auto.json")
    assert code == 0, out
    assert f"Read budget (auto): {want['read_mibs']} MiB/s" in out and f"= {want['kib']} KiB a step" in out
    code, out = cli_plain("run", "--read-budget-kib", "auto", "--device", "cuda", "--prompt", "x",
                          "--json", tmp_path / "r.json")
    assert code == 2 and "the GPU tier takes a number" in out and "bench gpu --variant read_budget_kib=auto" in out, out
    code, out = cli_plain("simulate", sim_trace, "--read-budget-kib", "lots", "--json", tmp_path / "x.json")
    assert code == 2 and "expected a whole number or auto or off" in out, out
    off = run_simulation(sim_trace, policies=pol, profile=prof, pool_mib=4, window=2)
    code, out = cli_plain("simulate", sim_trace, "--policies", "next-gate+prediction", "--pool-mib", "4",
                          "--read-budget-kib", "off", "--json", tmp_path / "off.json")
    assert code == 0, out
    assert json.loads((tmp_path / "off.json").read_text())["points"][0]["read_budget_kib"] is None
    assert off["read_budget_kib"] is None and off["results"][0]["counts"]["dropped_late"] == 0


def test_read_budget_meter_measures_each_step():
    """ReadBudgetMeter (`--read-budget-kib auto`): no budget before a step is measured; a step's compute time
    is the time since the last MoE step of the same span less the read waits in it, smoothed by 1/8; the first
    step measured after the span changes replaces the estimate (the span's change itself keeps the budget);
    the budget is the rate times it in whole KiB, at least one slot."""
    from toolkit.runtime.scheduler import ReadBudgetMeter

    gib = 2**30
    m = ReadBudgetMeter(gib, 8192)
    assert m.at(4, 0.0, 0.0) is None                            # nothing measured yet
    assert m.at(4, 0.010, 0.002) == int(gib * 0.008 / 1024) * 1024   # 10 ms less 2 ms waited
    assert m.step_s == pytest.approx(0.008)
    assert m.at(4, 0.020, 0.002) == int(gib * 0.00825 / 1024) * 1024  # 8 + (10 - 8) / 8 ms
    assert m.at(1, 0.021, 0.002) == int(gib * 0.00825 / 1024) * 1024  # another span: kept until measured
    assert m.at(1, 0.022, 0.0025) == int(gib * 0.0005 / 1024) * 1024  # its first step replaces it
    assert m.step_s == pytest.approx(0.0005)
    assert m.at(1, 0.0225, 0.0035) == int(gib * 0.0005 * 7 / 8 / 1024) * 1024  # waited longer: a step of 0
    slow = ReadBudgetMeter(1.0, 8192 + 1)                       # 1 B/s: one slot, rounded up to whole KiB
    slow.at(1, 0.0, 0.0)
    assert slow.at(1, 5.0, 0.0) == 9 * 1024


def test_runs_budget_kib():
    """A bench row's read budget from its runs' reports: a fixed one's KiB, auto's runs' lower median, none
    without one or where nothing was prefetched."""
    from android_runner.bench import runs_budget_kib

    auto = [{"read_budget": {"mode": "auto", "kib": k}} for k in (900, 1100, 1000, 1200)]
    assert runs_budget_kib(auto) == 1000
    assert runs_budget_kib([{"read_budget": {"mode": "fixed", "kib": 601}}] * 2) == 601
    assert runs_budget_kib([{"read_budget": {"mode": "off", "kib": None}}]) is None
    assert runs_budget_kib([{"read_budget": {"mode": "auto", "kib": None, "rate_from": "unused"}}, {}]) is None


def test_simulator_orders_policies(sim_trace, tiny_models):
    from toolkit.runtime.policy import Policy
    from toolkit.simulate.replay import run_simulation

    pols = [Policy("on-demand", "lru"), Policy("next-gate", "prediction"), Policy("oracle", "belady")]
    r = run_simulation(sim_trace, policies=pols, profile=SNAPDRAGON_8_ELITE, pool_mib=4, window=2)
    res = {x["policy"]: x for x in r["results"]}
    od, ng, orc = res["on-demand+lru"], res["next-gate+prediction"], res["oracle+belady"]
    assert orc["tpot_ms"] < od["tpot_ms"] and orc["hit_rate"] > od["hit_rate"]
    assert ng["hit_rate"] > od["hit_rate"]
    assert od["wasted_prefetch_mib"] == 0 and od["counts"]["prefetch_issued"] == 0
    assert od["counts"]["misses"] * 122880 == od["counts"]["bytes_read"]
    assert r["routing_from"]["replayed_onto_other_geometry"] is False
    # phone-scale geometry from another config, routing replayed from this trace
    cfg_dir = Path(tiny_models["qwen3_moe"]).parent / "geo"
    cfg_dir.mkdir(exist_ok=True)
    cfg = json.loads((Path(tiny_models["qwen3_moe"]) / "config.json").read_text())
    cfg.update(num_hidden_layers=16, mlp_only_layers=[], num_experts=64, num_experts_per_tok=4,
               hidden_size=256, moe_intermediate_size=256, num_attention_heads=4, head_dim=64)
    (cfg_dir / "config.json").write_text(json.dumps(cfg))
    g = run_simulation(sim_trace, policies=pols[:1] + [Policy("on-demand", "reuse")], profile=SNAPDRAGON_8_ELITE,
                       pool_mib=8, window=2, geometry=str(cfg_dir))
    assert g["routing_from"]["replayed_onto_other_geometry"] is True
    # the reuse table learned from the trace (with its frequency classes) replayed onto that geometry too
    assert 0 < g["results"][1]["counts"]["bytes_read"] <= g["results"][0]["counts"]["bytes_read"]
    assert g["geometry"]["num_layers"] == 16 and g["geometry"]["slot_bytes"] == 3 * 256 * 256 * 2
    m = g["routing_from"]["mapping"]
    # the tiny config keeps its 8 experts (num_local_experts): the trace's 32 fold onto them
    assert "floor(i x 8 / 16)" in m and "geometry expert e mod 8" in m and "scores by its whole table" in m
    assert g["pool_share_of_routed_experts"] == g["pool_share_of_experts"]


def test_simulator_projects_ttft(sim_trace):
    """--prompt-tokens: a prompt of the held-out prompts' positions end to end goes through a fresh pool
    layer by layer; every layer of a span reads the union of its experts once, so on demand the reads are
    exactly the union per layer (counted by hand here), prefetch overlaps some of them, and a faster
    prefill rate only shortens TTFT."""
    import dataclasses

    from toolkit.runtime.policy import Policy
    from toolkit.simulate.replay import _prompt_batch, prompt_rows, run_simulation
    from toolkit.traces.format import TraceReader

    pols = [Policy("on-demand", "lru"), Policy("oracle", "belady")]
    r = run_simulation(sim_trace, policies=pols, profile=SNAPDRAGON_8_ELITE, pool_mib=8, window=2, prompt_tokens=100)
    od, orc = r["results"]
    assert r["prefill"]["prompt_tokens"] == od["prompt_tokens"] == 100
    b, rows = _prompt_batch(TraceReader(sim_trace), "heldout", 100, SNAPDRAGON_8_ELITE)
    assert len(rows) == len(set(rows.tolist())) == 100 and bool((b.kind[rows] == 0).all())
    assert prompt_rows(b, 10).tolist() == rows[:10].tolist()    # a shorter prompt is a prefix of it
    # positions in order within each sequence, and a sequence's positions together
    seqs = b.seq[rows].tolist()
    assert all(b.pos[rows[i]] < b.pos[rows[i + 1]] for i in range(99) if seqs[i] == seqs[i + 1])
    assert len({q for i, q in enumerate(seqs) if i == 0 or seqs[i - 1] != q}) == len(set(seqs)) > 1
    union = sum(len(set(b.ids[rows, li].flatten().tolist())) for li in range(b.num_layers))
    assert od["prefill_mib_read"] == round(union * 122880 / 2**20, 1)
    assert 0 < orc["ttft_ms"] < od["ttft_ms"] and orc["prefill_stall_ms"] < od["prefill_stall_ms"]
    fast = dataclasses.replace(SNAPDRAGON_8_ELITE, prefill_gflops=10 * SNAPDRAGON_8_ELITE.prefill_gflops)
    f = run_simulation(sim_trace, policies=pols[:1], profile=fast, pool_mib=8, window=2, prompt_tokens=100)
    assert f["results"][0]["ttft_ms"] < od["ttft_ms"]
    assert f["results"][0]["prefill_mib_read"] == od["prefill_mib_read"]
    with pytest.raises(SpecPrefetchError, match="--prompt-tokens 100000: .* hold only"):
        run_simulation(sim_trace, policies=pols[:1], profile=SNAPDRAGON_8_ELITE, pool_mib=8, window=2,
                       prompt_tokens=100000)
    none = dataclasses.replace(SNAPDRAGON_8_ELITE, prefill_gflops=None)
    with pytest.raises(SpecPrefetchError, match="states no prefill compute rate"):
        run_simulation(sim_trace, policies=pols[:1], profile=none, pool_mib=8, window=2, prompt_tokens=100)


def test_prefill_projection_overlaps_reads_plans_across_spans_and_groups(sim_trace, monkeypatch):
    """The prefill replay as the runners do it: (1) an expert is computed as soon as its bytes land, so
    with compute far slower than a read only each layer's first read stalls (one read at queue depth 1
    per layer, exactly); (2) a span's last layers plan the next span's first ones, never past the
    prompt; (3) a pool smaller than a layer's union still reads each of the union's experts once; previous-token
    knows only the position before a span."""
    import dataclasses

    import toolkit.simulate.replay as R
    from toolkit.runtime.policy import Policy
    from toolkit.runtime.scheduler import WindowScheduler
    from toolkit.traces.format import TraceReader

    slow = dataclasses.replace(SNAPDRAGON_8_ELITE, prefill_gflops=0.01)
    b, rows = R._prompt_batch(TraceReader(sim_trace), "heldout", 100, slow)
    L = b.num_layers
    od = R.run_simulation(sim_trace, policies=[Policy("on-demand", "lru")], profile=slow, pool_mib=8, window=2,
                          prompt_tokens=100)["results"][0]
    one_read_ms = slow.read_s(122880, 1) * 1e3
    assert od["prefill_stall_ms"] == pytest.approx(L * one_read_ms, rel=1e-3)
    # previous-token in one span from position 0 knows no previous position (as the runners' span batch):
    # no prefetch, on-demand's TTFT
    pt = R.run_simulation(sim_trace, policies=[Policy("previous-token", "lru")], profile=slow, pool_mib=8, window=2,
                          prompt_tokens=100)["results"][0]
    assert pt["prefill_hit_rate"] == 0 and pt["ttft_ms"] == od["ttft_ms"]
    # (2) four spans of 25 positions; every target the oracle plans is a step of this prompt
    monkeypatch.setattr(R, "PREFILL_SPAN", 25)
    planned: list[tuple[int, int]] = []
    plan = WindowScheduler.plan

    def record(self, step, window):
        planned.extend((step, t) for t, _ in window)
        return plan(self, step, window)

    monkeypatch.setattr(WindowScheduler, "plan", record)
    R.run_simulation(sim_trace, policies=[Policy("oracle", "belady")], profile=SNAPDRAGON_8_ELITE, pool_mib=8,
                     window=2, prompt_tokens=100)
    spans = [p0 * L for p0 in range(0, 100, 25)]
    crossing = [(s, t) for s, t in planned if t - s > 2]          # past the last MoE layer: the next span
    assert crossing and all(t in (s + 1 + 24 * L, s + 2 + 24 * L) for s, t in crossing)
    assert all(t < 100 * L for _, t in planned)
    assert any(t - spans[-1] in (0, 1) for _, t in crossing)    # the last span's first layers are planned
    assert not any(s >= spans[-1] and t >= spans[-1] + L for s, t in crossing)  # nothing past the prompt
    monkeypatch.setattr(WindowScheduler, "plan", plan)
    # (3) 8 slots, a union of more than 8 experts per layer: groups, and still each expert read once
    small = R.run_simulation(sim_trace, policies=[Policy("on-demand", "lru")], profile=SNAPDRAGON_8_ELITE,
                             pool_mib=1, window=2, prompt_tokens=100)["results"][0]
    union = sum(len(set(b.ids[rows[p0:p0 + 25], li].flatten().tolist())) for p0 in range(0, 100, 25)
                for li in range(L))
    assert max(len(set(b.ids[rows[p0:p0 + 25], li].flatten().tolist())) for p0 in range(0, 100, 25)
               for li in range(L)) > 8
    assert small["prefill_mib_read"] == round(union * 122880 / 2**20, 1)


def test_replay_onto_three_times_the_layers_plans_every_layer(sim_trace, tiny_models, monkeypatch):
    """24 geometry layers over the trace's 8, window 2: every layer is planned for (a layer that repeats
    its trace layer twice over used to get no prediction at all)."""
    import toolkit.simulate.replay as R
    from toolkit.runtime.policy import Policy

    planned: set[int] = set()
    real = R.open_pool_and_scheduler

    def spy(*a, **kw):
        pool, sched = real(*a, **kw)
        plan = sched.plan

        def recording(step, window):
            planned.update(tgt % 24 for tgt, _ in window)
            return plan(step, window)

        sched.plan = recording
        return pool, sched

    monkeypatch.setattr(R, "open_pool_and_scheduler", spy)
    cfg_dir = Path(tiny_models["qwen3_moe"]).parent / "geo24"
    cfg_dir.mkdir(exist_ok=True)
    cfg = json.loads((Path(tiny_models["qwen3_moe"]) / "config.json").read_text())
    cfg.update(num_hidden_layers=24, mlp_only_layers=[], num_experts=32, num_experts_per_tok=4, hidden_size=256,
               moe_intermediate_size=256, num_attention_heads=4, head_dim=64)
    (cfg_dir / "config.json").write_text(json.dumps(cfg))
    R.run_simulation(sim_trace, policies=[Policy("next-gate", "prediction")], profile=SNAPDRAGON_8_ELITE,
                     pool_mib=8, window=2, geometry=str(cfg_dir), max_sequences=1)
    assert planned == set(range(24))


def test_replay_onto_more_layers_predicts_every_layer():
    """16 geometry layers over 8 trace layers: a layer that repeats its trace layer is planned from that
    trace layer's prediction made one trace layer earlier (the previous token's for trace layer 0)."""
    import torch

    from toolkit.simulate.replay import _copy_prediction, _trace_h

    layer_map = [li * 8 // 16 for li in range(16)]
    assert [_trace_h(li, 1, 16, layer_map, 8) for li in (0, 1, 15)] == [0, 1, 1]
    preds = {(2, 1): "h1 from trace layer 2", (7, 1): "cross-token from layer 7"}
    rows = torch.tensor([10, 11])
    assert _copy_prediction(preds, 3, 8, rows, 1) == ("h1 from trace layer 2", 11)
    assert _copy_prediction(preds, 0, 8, rows, 1) == ("cross-token from layer 7", 10)
    assert _copy_prediction(preds, 0, 8, rows, 0) == (None, None)


def test_profiles_load_and_reject(tmp_path):
    p = save_profile(SNAPDRAGON_8_ELITE, tmp_path / "x.json")
    assert load_profile(str(p)).bandwidth_mibs(512 * 1024, 1) == pytest.approx(1800.0)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SpecPrefetchError, match="not a valid device profile"):
        load_profile(str(tmp_path / "bad.json"))
    with pytest.raises(SpecPrefetchError, match="no such profile"):
        load_profile("no-such-device")


# -- simulate and calibrate from the command line ------------------------------------------------

def test_cli_simulate(sim_trace, tmp_path):
    from click.testing import CliRunner

    from toolkit.cli import main

    r = CliRunner().invoke(main, ["simulate", str(sim_trace), "--policies", "on-demand+lru,oracle+belady",
                                  "--pool-mib", "2,4", "--json", str(tmp_path / "s.json")])
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "s.json").read_text())
    assert len(s["points"]) == 2 and (tmp_path / "s.png").stat().st_size > 5000
    for bad, msg in (("2,nan", "'nan': must be a finite number"), ("4,x", "'x' is not a number")):
        r = CliRunner().invoke(main, ["simulate", str(sim_trace), "--pool-mib", bad,
                                      "--json", str(tmp_path / "b.json")])
        assert r.exit_code == 2 and msg in r.output and "Traceback" not in r.output


def test_cli_eviction_bounds(sim_trace, tmp_path):
    """Belady's rule knowing everything reads the fewest bytes (optimal on demand over a whole sequence;
    counted at decode positions, in practice): every rule that knows less reads at least as much here."""
    from click.testing import CliRunner

    from toolkit.cli import main

    r = CliRunner().invoke(main, ["eviction-bounds", str(sim_trace), "--pool-frac", "0.1,0.2", "--max-sequences", "3",
                                  "--json", str(tmp_path / "e.json")])
    assert r.exit_code == 0, r.output
    e = json.loads((tmp_path / "e.json").read_text())
    assert [p["slots"] for p in e["points"]] == [26, 51] and (tmp_path / "e.png").stat().st_size > 5000
    for p in e["points"]:
        rp = p["reads_per_token"]
        assert 0 < rp["belady"] == min(rp.values()), rp
        assert "reuse-freq" in rp and rp["reuse-freq"] <= rp["lru"] + 1, rp
        assert rp["belady-next-4-tokens"] <= rp["lru"] and "belady-next-2-tokens" in rp, rp
    r = CliRunner().invoke(main, ["eviction-bounds", str(sim_trace), "--pool-frac", "1.5",
                                  "--json", str(tmp_path / "b.json")])
    assert r.exit_code == 2 and "--pool-frac" in r.output and "1.5" in r.output and not (tmp_path / "b.json").exists()
    # the look-ahead rules: knowing n tokens (the current one counted) of a sequence of n positions is
    # knowing all of it (Belady's reads); of a longer one, less
    from adapters.reuse import learn_reuse_table
    from toolkit.simulate.bounds import HORIZONS, replay
    from toolkit.traces.format import DECODE

    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(2)]) for _ in range(40)])
    kinds = np.full(40, DECODE)
    t = learn_reuse_table([ids], 8)
    for rule in ("belady-next-token", "belady-next-2-tokens", "belady-next-4-tokens"):
        n = HORIZONS[rule]
        assert replay(ids[:n], kinds[:n], 4, rule, t) == replay(ids[:n], kinds[:n], 4, "belady", t)
    whole = [replay(ids, kinds, 4, r, t)[0] for r in ("belady-token", "belady-next-token", "belady-next-2-tokens",
                                                      "belady-next-4-tokens", "belady")]
    assert whole[0] > whole[1] > whole[2] >= whole[3] >= whole[4] and whole[2] > whole[4], whole


def test_draft_lookahead(sim_trace, tmp_path):
    """`eviction-bounds --draft-lookahead D`: the self-draft drafts D positions from each decode position on
    the held experts. A draft that tells the real routing makes the rule Belady's knowing as far (the
    horizons to the step); holding every expert the draft is the model itself (its predictions the
    trace's routing: the trace's decode tokens are the model's greedy ones, its cache the real positions
    only); holding a few it computes with exactly the family's choice among them, renormalised, and
    predicts with the routers' own choices still; its hooks leave with it; errors are one line."""
    from click.testing import CliRunner

    from adapters.reuse import learn_reuse_table
    from toolkit.cli import main
    from toolkit.models.families import expert_weights
    from toolkit.simulate.bounds import HORIZONS, DraftModel, LookaheadDraft, replay
    from toolkit.traces.format import DECODE, TraceReader, routing_sequences, trace_model_spec

    reader = TraceReader(sim_trace)
    (ids, kinds, toks), = routing_sequences(reader, "heldout", with_tokens=True)[:1]
    toks = toks.tolist()
    n_prompt = int((kinds != DECODE).sum())
    assert 0 < n_prompt < len(ids) and (kinds[n_prompt:] == DECODE).all()
    t = learn_reuse_table(routing_sequences(reader, "train"), 32)

    class Told:   # a draft that tells the real routing of the positions it is asked for
        def __init__(self, D):
            self.D, self.E = D, 32

        def predict(self, p, held):
            return {(q, li): set(ids[q, li].tolist()) for q in range(p, min(p + self.D, len(ids)))
                    for li in range(ids.shape[1])}

    for rule, D in (("belady-token", 1), ("belady-next-token", 2), ("belady-next-2-tokens", 3),
                    ("belady-next-4-tokens", 5)):
        assert HORIZONS[rule] == D
        for cap in (12, 40):
            assert replay(ids, kinds, cap, f"draft-lookahead-{D}", t, draft=Told(D)) == replay(ids, kinds, cap, rule, t)
    spec = trace_model_spec(reader, None)
    with DraftModel(spec) as m:
        L, E, k = m.L, m.E, m.k
        seen, logits = [], []   # the experts' (ids, weights) inputs and the routers' logits, call by call
        experts = [mod for mod in m.lm.model.modules() if type(mod).__name__.endswith("Experts")]
        assert len(experts) == L
        hooks = [e.register_forward_pre_hook(lambda mod, a: seen.append((a[1].clone(), a[2].clone())))
                 for e in experts]
        hooks += [m.lm.family.router(m.lm.model, layer).register_forward_hook(
            lambda mod, a, out: logits.append(out[0].detach().float().clone())) for layer in m.lm.geometry.moe_layers]
        d = LookaheadDraft(m, toks, 3)
        agree = total = 0
        for p in range(n_prompt, min(n_prompt + 6, len(ids) - 2)):
            got = d.predict(p, np.ones((L, E), bool))
            assert d.cache.get_seq_length() == p + 1 == d.done   # the real positions only, p the last
            assert sorted(got) == [(q, li) for q in range(p, p + 3) for li in range(L)]
            for (q, li), experts_q in got.items():
                agree += experts_q == set(ids[q, li].tolist())
                total += 1
        assert agree >= 0.95 * total, (agree, total)   # (batched tracing may break a near-tie otherwise)
        held = np.zeros((L, E), bool)
        held[:, :k - 2] = True                             # fewer than k held: those, renormalised
        held[1:, 7] = True
        held[2, :3 * k] = True                             # more: the top k among them
        held[0] = False                                    # none: the layer's own choice
        assert (held[1:].sum(1) != k).all()
        seen.clear()
        logits.clear()
        steps = []   # each model call's (input tokens, greedy output)
        hooks.append(m.lm.model.register_forward_hook(
            lambda mod, a, kw, out: steps.append((kw["input_ids"][0].tolist(), int(out.logits[0, -1].argmax()))),
            with_kwargs=True))
        # the sequence's next token changed: the draft goes on from its own token, not the sequence's
        toks2 = list(toks)
        toks2[n_prompt + 1] = (toks[n_prompt + 1] + 1) % m.lm.model.config.vocab_size
        got = LookaheadDraft(m, toks2, 2).predict(n_prompt, held)
        # the calls: the prompt's pass, the two drafted steps, the real step
        assert [x for x, _ in steps] == [toks[:n_prompt], [toks[n_prompt]], [steps[1][1]], [toks[n_prompt]]]
        assert steps[1][1] != toks2[n_prompt + 1]
        for i, ((e_ids, w), lg) in enumerate(zip(seen[L:], logits[L:])):
            li = i % L
            if li == 0 or i >= 2 * L:   # a layer holding none, and the real step: the router's own choice
                assert torch.equal(e_ids.reshape(-1).sort().values,
                                   lg.reshape(-1, E)[-1].topk(k).indices.sort().values), (i, e_ids)
                continue
            hk = np.flatnonzero(held[li])
            sc = lg.reshape(-1, E)[-1].softmax(-1)[hk]
            want = hk[sc.argsort(descending=True)[:k].numpy()]
            used = e_ids.reshape(-1)[w.reshape(-1) > 0]
            assert set(used.tolist()) == set(want.tolist()), (li, used, want)
            ww = expert_weights(lg.reshape(-1, E)[-1:], torch.from_numpy(want)[None], spec.geometry.routing)
            assert torch.allclose(w.reshape(-1)[w.reshape(-1) > 0].sort().values, ww[0].sort().values, atol=1e-5)
        assert any(not held[li][list(got[(n_prompt, li)])].all() for li in range(1, L))   # predictions: unrestricted
        for h in hooks:
            h.remove()
        n = len(m.hooks)
        assert n == L
    assert m.hooks == []                                   # removed on leaving
    with pytest.raises(SpecPrefetchError, match="needs the sequence's draft"):
        replay(ids, kinds, 24, "draft-lookahead-3", t, draft=Told(2))

    class Watch(Told):   # what the replay holds when it asks: the pool, full, the last layer's experts in it
        def predict(self, p, held):
            assert held.shape == (ids.shape[1], 32) and held.sum() == 24, held.sum()
            assert held[ids.shape[1] - 1, ids[p - 1, -1]].all()
            self.asked = getattr(self, "asked", 0) + 1
            return super().predict(p, held)

    w = Watch(2)
    assert replay(ids, kinds, 24, "draft-lookahead-2", t, draft=w) == replay(ids, kinds, 24, "belady-next-token", t)
    assert w.asked == (kinds == DECODE).sum()
    r = CliRunner().invoke(main, ["eviction-bounds", str(sim_trace), "--pool-frac", "0.2", "--max-sequences",
                                        "1", "--draft-lookahead", "0", "--json", str(tmp_path / "e.json")])
    assert r.exit_code == 2 and "--draft-lookahead" in r.output and not (tmp_path / "e.json").exists()
    for dev, msg in (("tpu", "expected cpu, cuda or cuda:N"), ("cuda:99", "cuda:99")):
        r = CliRunner().invoke(main, ["eviction-bounds", str(sim_trace), "--pool-frac", "0.2", "--draft-lookahead",
                                            "2", "--device", dev, "--json", str(tmp_path / "e.json")])
        assert r.exit_code == 2 and "--device" in r.output and msg in r.output, r.output
        assert "Traceback" not in r.output and not (tmp_path / "e.json").exists()
    r = CliRunner().invoke(main, ["eviction-bounds", str(sim_trace), "--pool-frac", "0.2", "--max-sequences", "1",
                                        "--draft-lookahead", "1,2", "--json", str(tmp_path / "e.json")])
    assert r.exit_code == 0, r.output
    e = json.loads((tmp_path / "e.json").read_text())
    assert e["draft_lookahead"] == [1, 2] and e["rules"][-2:] == ["draft-lookahead-1", "draft-lookahead-2"]
    rp = e["points"][0]["reads_per_token"]
    assert rp["belady"] <= rp["draft-lookahead-2"] and rp["draft-lookahead-1"] > 0, rp


def test_reuse_by_frequency_class():
    """Frequency classes (adapters/reuse.py): each layer's experts in quarters by their train-split routing
    count, a reuse table learned from each quarter's samples alone (a history a quarter never shows takes
    the whole table's entry), and ReuseHistory scores an expert with its quarter's table (both scores:
    history only and with a next-visit prediction): of two experts with the same history the one whose
    class is reused later is evicted; with the whole table for every class it decides as `reuse`; the
    table round-trips through JSON and a malformed one is a one-line error."""
    import dataclasses

    from adapters.reuse import (ReuseTable, frequency_classes, learn_class_reuse_table, learn_reuse_table,
                                learn_reuse_tables)
    from toolkit.runtime.reuse import ReuseHistory
    from toolkit.simulate.bounds import replay
    from toolkit.traces.format import DECODE

    # one layer of 8 experts, top-2: expert 0 every position, 1 every other, 2-7 in turn
    seq = np.array([[[0, 1 if p % 2 else 2 + (p // 2) % 6]] for p in range(64)]).reshape(64, 1, 2)
    counts = np.bincount(seq[:, 0].ravel(), minlength=8)[None]
    cls = frequency_classes(counts)
    assert cls[0, 0] == 0 and cls[0, 1] == 0 and sorted(cls[0].tolist()) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert frequency_classes(counts[:, :2]).tolist() == [[0, 1]]   # fewer experts than classes: one each
    base = learn_reuse_table([seq], 8)
    hot = learn_reuse_tables([seq], 8, cls)[1][0]
    assert hot.visits16[0b11111111] == 16                              # expert 0: reused at every visit
    assert hot.visits16[0b10101010] == base.visits16[0b10101010]      # never shown in its class: the prior
    assert learn_reuse_tables([seq], 8, np.ones_like(cls))[1][0] == base   # no samples: the prior
    with pytest.raises(SpecPrefetchError, match="no routing"):
        learn_reuse_table([seq[:0]], 8)
    learned = learn_class_reuse_table([seq], 8)
    assert learned.classes == tuple(map(tuple, cls.tolist())) and learned.class_visits16[0] == hot.visits16
    assert learned.whole() == base
    assert learn_class_reuse_table([seq], 8, classes=1) == base
    assert ReuseTable.from_json(learned.to_json(), "t", shape=(1, 8)) == learned
    for change, msg in (({"classes": [[0] * 7]}, "1 MoE layers x 7 experts"), ({"classes": [[0] * 7 + [4]]}, "0..3"),
                        ({"class_visits16": None}, "class_visits16"), ({"class_visits16": [[15] * 256] * 4},
                                                                       r"class_visits16\[0\]")):
        with pytest.raises(SpecPrefetchError, match=msg):
            ReuseTable.from_json({**learned.to_json(), **change}, "t", shape=(1, 8))
    with pytest.raises(SpecPrefetchError, match="1 MoE layers, not 2"):
        ReuseHistory(learned, 2)
    # onto a geometry of more layers and experts (simulate --geometry): each layer its trace layer's
    # classes, an expert the trace never routes to the coldest
    wide = learned.onto([0, 0, 0], 10)
    assert wide.classes == ((*learned.classes[0], 3, 3),) * 3
    assert ReuseHistory(wide, 3).tables[2][9] == wide.class_visits16[3]
    assert learned.onto([0], 4) == base and base.onto([0, 0], 10) is base   # fewer experts (folded): whole

    def table(v0: int) -> tuple[int, ...]:   # history 0 (not routed lately) reused after v0 visits
        v = list(base.visits16)
        v[0] = 16 * v0
        return tuple(v)

    cold_expert = int(np.nonzero(cls[0] == 3)[0][0])
    for hot_v, cold_v, victim in ((40, 1, 0), (1, 40, cold_expert)):   # the key tie-break would pick the cold one
        t = dataclasses.replace(base, classes=learned.classes,
                                class_visits16=(table(hot_v),) * 2 + (table(cold_v),) * 2)
        for nv in (False, True):   # history only; a next-visit prediction of neither (their histories one on)
            h = ReuseHistory(t, 1)
            if nv:
                h.set_next_visits(0, 2, [[5 if cold_expert != 5 else 6]])
                for e in (0, cold_expert):   # (x << 1): history 0 stays 0
                    assert h.score((0, e), 1, None) == (2 + 1) * 16 + (t.class_visits16[cls[0, e]][0] - 16)
            pool = ExpertPool(2, 1, policy="reuse", min_slots=1)
            pool.reuse, pool.predicted = h, None
            for e in (0, cold_expert):
                pool.reserve((0, e), 0, prefetch=False, protect=set()).ready = True
            assert pool.reuse.farthest(pool.by_layer, 1, None, set()) == (0, victim)
            assert max((0, cold_expert), key=lambda e: h.score((0, e), 1, None)) == victim
    # every class with the whole table: the same reads as `reuse`, on routing where the rules differ from LRU
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.choice(8, 2, replace=False, p=np.linspace(2, 0.2, 8) / 8.8) for _ in range(2)])
                    for _ in range(80)])
    kinds = np.full(80, DECODE)
    t = learn_reuse_table([ids], 8)
    two = learn_class_reuse_table([ids], 8)
    same = replay(ids, kinds, 5, "reuse-freq", dataclasses.replace(two, class_visits16=(t.visits16,) * 4))
    assert same == replay(ids, kinds, 5, "reuse", t) and same != replay(ids, kinds, 5, "lru", None)
    with pytest.raises(SpecPrefetchError, match="frequency classes"):
        replay(ids, kinds, 5, "reuse-freq", t)


def test_next_visit_heads_in_eval_eviction_bounds_and_the_simulator(sim_trace, embedded, tmp_path):
    """An adapter trained with --next-visits 2: its horizons L and 2L show in validation and eval;
    eviction-bounds adds next-visits-2 and adapter-next-visit (and refuses an adapter without the heads); the
    simulator's adapter+reuse reads them (other reads than with next_visit off)."""
    import dataclasses

    from adapters.train import TrainConfig, train_adapter
    from toolkit.predictors.evaluate import evaluate
    from toolkit.runtime.policy import Policy
    from toolkit.runtime.profiles import SNAPDRAGON_8_ELITE
    from toolkit.runtime.runner import RunConfig
    from toolkit.simulate.bounds import eviction_bounds
    from toolkit.simulate.replay import run_simulation

    cfg = TrainConfig(steps=40, val_every=20, batch_size=64, next_visits=2)
    r = train_adapter(sim_trace, tmp_path / "a", cfg, progress=False)
    L = 8
    assert {str(L), str(2 * L)} <= set(r["validation"]["adapter"]["recall_at_k"])
    ev = evaluate(sim_trace, predictors=["adapter", "previous-token"], adapter=tmp_path / "a", progress=False)
    rec = ev["predictors"]["adapter"]["recall_at_k"]
    assert ev["horizons"] == [1, 2, L, 2 * L] and 0 < rec[str(2 * L)] <= 1 and 0 < rec[str(L)] <= 1
    e = eviction_bounds(sim_trace, [0.2], max_sequences=3, adapter=tmp_path / "a")
    rp = e["points"][0]["reads_per_token"]
    assert e["rules"][-3:] == ["next-visits-2", "adapter-next-visit", "adapter-next-visit-freq"]
    assert rp["belady"] == min(rp.values()) and rp["next-visits-2"] > 0, rp   # (not monotone in N: section 24)
    assert rp["adapter-next-visit"] > 0 and rp["adapter-next-visit-freq"] > 0, rp
    train_adapter(sim_trace, tmp_path / "b", dataclasses.replace(cfg, next_visits=0), progress=False)
    with pytest.raises(SpecPrefetchError, match="no next-visit heads"):
        eviction_bounds(sim_trace, [0.2], max_sequences=1, adapter=tmp_path / "b")
    reads = {}
    for on, classes, visits in ((True, True, None), (False, True, None), ("whole", False, None), ("one", True, 1)):
        s = run_simulation(sim_trace, policies=[Policy("adapter", "reuse")], profile=SNAPDRAGON_8_ELITE,
                           pool_mib=8, window=2, adapter=tmp_path / "a", max_sequences=4, next_visit=on is not False,
                           reuse_classes=classes, next_visits=visits)
        reads[on] = s["results"][0]["counts"]["bytes_read"]
        assert s["next_visits"] == visits
    assert reads[True] != reads[False] and reads[True] != reads["whole"], reads   # the heads; the classes
    assert reads["one"] not in (reads[True], reads[False]), reads   # the first visit's heads only
    # every runner bench --variant key is a setting the simulator replays a row with (toolkit/bench/common.py)
    import inspect

    from toolkit.runtime.policy import VARIANT_KEYS
    assert set(VARIANT_KEYS) <= set(inspect.signature(run_simulation).parameters)
    # an adapter of another model of the same sizes: refused for its table too, as for its predictions
    import shutil
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "a", other)
    meta = json.loads((other / "adapter.json").read_text())
    meta["model"]["config_hash"] = "0" * len(meta["model"]["config_hash"])
    (other / "adapter.json").write_text(json.dumps(meta))
    with pytest.raises(SpecPrefetchError, match="trained for model config"):
        run_simulation(sim_trace, policies=[Policy("on-demand", "reuse")], profile=SNAPDRAGON_8_ELITE,
                       pool_mib=8, window=2, adapter=other, max_sequences=4)
    # the table alone reads the metadata: on-demand+reuse needs no weights (the adapter's predictions do)
    meta_only = tmp_path / "meta-only"
    meta_only.mkdir()
    shutil.copyfile(tmp_path / "a" / "adapter.json", meta_only / "adapter.json")
    s = run_simulation(sim_trace, policies=[Policy("on-demand", "reuse")], profile=SNAPDRAGON_8_ELITE,
                       pool_mib=8, window=2, adapter=meta_only, max_sequences=4)
    assert s["results"][0]["counts"]["bytes_read"] > 0
    from click.testing import CliRunner

    from toolkit.cli import main
    r = CliRunner().invoke(main, ["simulate", str(sim_trace), "--policies", "adapter+reuse", "--adapter",
                                  str(tmp_path / "a"), "--pool-mib", "8", "--max-sequences", "4", "--no-next-visit",
                                  "--json", str(tmp_path / "s.json")])
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["points"][0]["results"][0]["counts"]["bytes_read"] == reads[False]
    r = CliRunner().invoke(main, ["simulate", str(sim_trace), "--policies", "adapter+reuse", "--adapter",
                                  str(tmp_path / "a"), "--pool-mib", "8", "--max-sequences", "4", "--no-reuse-classes",
                                  "--json", str(tmp_path / "w.json")])
    assert r.exit_code == 0, r.output
    w = json.loads((tmp_path / "w.json").read_text())["points"][0]
    assert w["results"][0]["counts"]["bytes_read"] == reads["whole"] and w["reuse_classes"] is False
    # a model directory's session folds the heads into its layer graphs (rows 1, 2, L, 2L): the Python engine
    # hands them to the eviction (other evictions than with next_visit off), the tokens the model's
    from export.session import open_session, reference_tokens
    from toolkit.runtime.events import EventLog, decisions

    prompt = [591, 906, 531, 1274, 2295, 1062, 17, 402, 9, 1500]
    ref = reference_tokens(embedded, prompt, 6)
    evicts = {}
    for on in (True, False):
        sess = open_session(embedded, RunConfig(policy=Policy("adapter", "reuse"), pool_mib=2.0, io="threads",
                                                next_visit=on), adapter=tmp_path / "a", max_seq=64, progress=False)
        assert sess.runner.model.next_visits == 2
        assert all(hs == (1, 2, L, 2 * L) for hs in sess.runner.model.preds_horizons.values())
        log = EventLog()
        assert sess.runner.run(prompt, 6, events=log).tokens == ref
        evicts[on] = [ln for ln in decisions(log.lines) if "evict" in str(ln)]
    assert evicts[True] and evicts[True] != evicts[False]


def test_coactivation_order_keeps_co_routed_experts_adjacent():
    """`bench reads`' order: pairs that are always routed together end up next to each other, every
    layer's order is a permutation, and merging joins exactly the adjacent slots of a step."""
    from toolkit.bench.reads import coactivation_order, decode_misses, requests
    from toolkit.traces.format import DECODE

    rng = np.random.default_rng(0)
    pairs = [(0, 5), (1, 7), (2, 3), (4, 6)]
    ids = np.array([[pairs[rng.integers(4)], pairs[rng.integers(4)]] for _ in range(200)])  # [N, L=2, k=2]
    order = coactivation_order([ids], 8)
    for o in order:
        assert sorted(o) == list(range(8))
        at = {e: i for i, e in enumerate(o)}
        assert all(abs(at[a] - at[b]) == 1 for a, b in pairs), o
    pos = [np.argsort(np.asarray(o)) for o in order]
    steps = [(0, [0, 5]), (1, [1, 2])]
    assert requests(steps, [np.arange(8)] * 2, False) == [[(0, 0, 1), (0, 5, 1)], [(1, 1, 1), (1, 2, 1)]]
    assert requests(steps, [np.arange(8)] * 2, True) == [[(0, 0, 1), (0, 5, 1)], [(1, 1, 2)]]
    assert len(requests(steps, pos, True)[0]) == 1  # a co-routed pair: one request in the learnt order
    kinds = np.full(len(ids), DECODE)
    assert decode_misses(ids[:3], kinds[:3], None) == [(li, list(ids[p, li])) for p in range(3) for li in range(2)]
    # a pool holding every expert reads each at most once
    once = len(np.unique(ids[:, 0])) + len(np.unique(ids[:, 1]))
    assert sum(len(m) for _, m in decode_misses(ids, kinds, 16)) == once


def test_cli_bench_reads(sim_trace, emb_store, tiny_models, tmp_path):
    """`bench reads` on the embedded model's store: the same bytes in every layout, merging never adds a
    request, the co-activation order merges more than the store's on this routing, and a store of
    another model is refused by name."""
    from click.testing import CliRunner

    from toolkit.cli import main

    r = CliRunner().invoke(main, ["bench", "reads", str(sim_trace), "--store", str(emb_store), "--pool-frac", "0,0.2",
                                  "--max-sequences", "3", "--rounds", "1", "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert (tmp_path / "r.png").stat().st_size > 5000 and "coactivation-merged" in (tmp_path / "r.md").read_text()
    none, pooled = rep["points"]
    assert none["slots"] is None and pooled["slots"] == 51 and pooled["mib_per_token"] < none["mib_per_token"]
    for p in rep["points"]:
        v = p["layouts"]
        for x in v.values():  # the same experts read in every layout, merged or not
            assert x["experts_per_token"] == v["store"]["experts_per_token"] == v["store"]["requests_per_token"]
            assert x["ms_per_token"] > 0 and x["profile_ms_per_token"] > 0
            assert x["experts_per_token"] * rep["expert_read_kib"] == pytest.approx(p["mib_per_token"] * 1024)
        # no pool: every routed expert of every decode step (8 MoE layers x top-4); the pool keeps some
        assert (v["store"]["experts_per_token"] == 32) == (p["slots"] is None)
        assert v["coactivation-merged"]["requests_per_token"] <= v["store-merged"]["requests_per_token"]
        assert v["store-merged"]["requests_per_token"] <= v["store"]["requests_per_token"]
    assert none["layouts"]["store"]["requests_per_token"] == 8 * 4  # every routed expert: L x top-k
    nv = none["layouts"]
    assert nv["coactivation-merged"]["requests_per_token"] < nv["store-merged"]["requests_per_token"]
    other = build_store(inspect_model_dir(tiny_models["qwen3_moe"]), tmp_path / "o.spx", "fp16", progress=False)
    r = CliRunner().invoke(main, ["bench", "reads", str(sim_trace), "--store", str(other),
                                  "--json", str(tmp_path / "b.json")])
    assert r.exit_code == 2 and f"--store {other}:" in r.output and "not this model's store" in r.output, r.output
    assert not (tmp_path / "b.json").exists()


def test_simulate_table_prints_undefined_figures_as_na():
    from toolkit.simulate.report import markdown

    res = {"policy": "on-demand+lru", "predictor": "on-demand", "tpot_ms": None, "tpot_p95_ms": None,
           "stall_ms_per_token": 0.5, "hit_rate": None, "mib_read_per_token": 0.25, "wasted_prefetch_mib": 0.0}
    r = {"profile": "p", "routing_from": {"replayed_onto_other_geometry": False},
         "geometry": {"slot_bytes": 4096, "dtype": "fp16", "num_layers": 2, "num_experts": 8, "top_k": 2},
         "points": [{"pool_mib": 1.0, "pool_share_of_experts": 0.5, "window": 1, "results": [res]}]}
    row = markdown(r).splitlines()[-1]
    assert row.count("n/a") == 4 and "0.000" not in row, row


def test_calibrate_writes_a_profile(emb_store, tmp_path, sim_trace):
    from toolkit.simulate.calibrate import calibrate
    from toolkit.runtime.policy import Policy
    from toolkit.simulate.replay import run_simulation

    prof, path = calibrate("embedded", store=emb_store, reads=16, tokens=6, out=tmp_path / "tm.json",
                           progress=False)
    p = load_profile(str(path))
    assert p.name == "this-machine" and p.expert_ms > 0 and p.dense_ms_per_layer >= 0
    assert set(p.flash_bw) == {1, 2, 4, 8} and all(v > 0 for t in p.flash_bw.values() for v in t.values())
    r = run_simulation(sim_trace, policies=[Policy("on-demand", "lru")], profile=p, pool_mib=4, window=2)
    assert r["results"][0]["tpot_ms"] > 0


def test_planner_graph_heads_missing_for_a_layer_plan_nothing():
    """An adapter trained without cross-token pairs has no heads for the last layer: its layer graph
    returns no preds, and the planner plans nothing there instead of failing."""
    from toolkit.models.families import RoutingSpec
    from toolkit.runtime.planner import GRAPH, PrefetchPlanner, RoutingState

    clock = SimClock()
    flash = SimFlash(SNAPDRAGON_8_ELITE, clock, 4096)
    pool = ExpertPool(16 * 4096, 4096, policy="lru", min_slots=2)
    sched = WindowScheduler(pool, flash, SchedulerConfig(), num_layers=2, top_k=2, clock=lambda: clock.now)
    routing = RoutingSpec(num_experts=8, top_k=2)
    planner = PrefetchPlanner(GRAPH, num_layers=2, window=2, routing=routing, score_bias=None,
                              preds_horizons={0: (1,)})  # layer 1 has no heads
    state = RoutingState(2, 4, 2)
    preds = torch.full((1, 8), -5.0)
    preds[0, 3] = 5.0
    planner.plan(sched, 0, 0, state, preds)
    assert sched.stats.prefetch_issued >= 1 and (1, 3) in pool.slots  # layer 0 predicts layer 1's expert 3
    issued = sched.stats.prefetch_issued
    planner.plan(sched, 1, 1, state, None)  # no preds rows for layer 1: nothing planned, no error
    assert sched.stats.prefetch_issued == issued
    # and nothing is planned past the last step the run reaches
    other = torch.full((1, 8), -5.0)
    other[0, 5] = 5.0
    planner.plan(sched, 0, 2, state, other, end=3)
    assert sched.stats.prefetch_issued == issued and (1, 5) not in pool.slots
    planner.plan(sched, 0, 2, state, other)
    assert (1, 5) in pool.slots


def test_prefill_geometry_charges_the_lm_head_once(embedded):
    """The prefill projection's dense FLOPs: every decoder layer's non-expert weights without the embedding
    table and, for an untied head, without the head either (it runs once, for the last position)."""
    from toolkit.models.info import model_info
    from toolkit.models.loader import inspect_model_dir
    from toolkit.simulate.replay import Geometry

    repo = Path(__file__).resolve().parents[1]
    for model, tied in ((embedded, True), (repo / "toolkit/simulate/geometries/qwen3-30b-a3b", False)):
        spec = inspect_model_dir(model, config_only_ok=True)
        g, d = spec.geometry, model_info(spec)
        geo = Geometry.from_model(model, "fp16")
        embed = g.vocab_size * g.hidden_size
        assert geo.head_params == embed and geo.head_flops() == 2.0 * embed
        assert geo.prefill_layer_params == (d["non_expert_params"] - embed * (1 if tied else 2)) // len(g.moe_layers)
        dense, experts = geo.prefill_flops(10)
        assert dense == 2.0 * geo.prefill_layer_params * 10
        assert experts == 2.0 * geo.expert_bytes / 2 * 10 * g.routing.top_k


# 0.3333333432674408: float32(2 / 6), a threshold on a float32 boundary (confidences in float64 would differ)
@pytest.mark.parametrize("candidates,threshold", [(None, 0.0), (2, 0.0), (6, 0.2), (None, 0.3333333432674408)])
def test_planner_oracle_window_equals_the_scored_one(candidates, threshold):
    """The oracle's window goes to the scheduler as ranked candidates (plan_ranked), without its [W, E]
    scores: the decisions, the printed confidences included, are those of the scores normalised and
    ranked (a subclass of Oracle takes that generic path), up to the end of the recorded future, where
    the generic path decides."""
    from toolkit.models.families import RoutingSpec
    from toolkit.predictors.base import Oracle
    from toolkit.runtime.events import EventLog
    from toolkit.runtime.planner import PrefetchPlanner, RoutingState

    class ScoredOracle(Oracle):
        pass

    L, E, k, W, N = 4, 12, 3, 3, 9
    gen = torch.Generator().manual_seed(7)
    future = [torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(L)]) for _ in range(N)]
    future[2][1, 1] = future[2][1, 0]  # repeated ids in a recorded row: the generic path decides those
    future[5][3, 2] = future[5][3, 0]
    logs = []
    for source in (Oracle(E), ScoredOracle(E)):
        events = EventLog()
        pool = ExpertPool(7 * 4096, 4096, policy="prediction", min_slots=k, next_use=lambda key, now: float("inf"))
        sched = WindowScheduler(pool, SimFlash(SNAPDRAGON_8_ELITE, SimClock(), 4096),
                                SchedulerConfig(candidates=candidates, candidate_threshold=threshold, queue_depth=3),
                                num_layers=L, top_k=k, events=events, clock=lambda: 0.0)
        planner = PrefetchPlanner(source, num_layers=L, window=W, routing=RoutingSpec(num_experts=E, top_k=k),
                                  score_bias=None)
        state = RoutingState(L, 4, k)
        state.future = future
        for p in range(N + 1):   # one position past the recorded future
            state.pos = p
            for li in range(L):
                step = p * L + li
                events.at(step, p, li)
                keys = [(li, int(e)) for e in (future[p][li] if p < N else future[0][li])]
                sched.acquire(step, keys)
                planner.plan(sched, li, step, state, None)
                for key in keys:
                    sched.data(key)
                sched.release(step, keys)
        logs.append((events.lines, sched.stats))
    assert logs[0] == logs[1]
    assert logs[0][1].prefetch_issued > 0 and logs[0][1].prefetch_hits > 0 and pool.evictions > 0
