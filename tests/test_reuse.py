"""The reuse eviction (toolkit/runtime/reuse.py): the learned table, the histories, the victim it picks,
and the simulator's rows for it."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from toolkit.errors import SpecPrefetchError
from toolkit.runtime.pool import ExpertPool
from adapters.reuse import SCALE, ReuseTable, learn_reuse_table
from toolkit.runtime.reuse import ReuseHistory


def test_table_by_hand():
    # one layer, two experts, top-1: expert 0 at positions 0, 2, 3; expert 1 at position 1
    ids = np.array([0, 1, 0, 0]).reshape(4, 1, 1)
    t = learn_reuse_table([ids], 2, bits=2, cap=4)
    # (history after a position, visits until the next use): expert 0: (01, 2) (10, 1) (01, 1), expert 1:
    # (00, 1); the rest have no later use and fewer than cap = 4 positions after them: not samples.
    # 11 is never seen: the mean of the histories with two uses, none, so of all: 5 / 4
    assert t.visits16 == (16, 24, 16, 20)
    assert ReuseTable.from_json(t.to_json(), "x", shape=(1, 8)) == t


def test_unseen_histories_take_the_mean_of_their_popcount():
    ids = np.array([0] * 12).reshape(12, 1, 1)  # expert 0 always, expert 1 never
    t = learn_reuse_table([ids], 2, bits=3, cap=4)
    # expert 1's first 8 positions have 4 or more after them and no use: cap; expert 0 is reused next visit,
    # up to its last position (no later use, no 4 positions after it: not a sample, not counted as cap)
    assert t.visits16[0] == 16 * 4 and t.visits16[0b111] == t.visits16[0b001] == t.visits16[0b011] == 16
    ids2 = np.array([0, 1] * 8).reshape(16, 1, 1)  # alternating: 01 / 10 are reused in 2
    t2 = learn_reuse_table([ids2], 2, bits=2, cap=4)
    assert t2.visits16[0b01] == 32 and t2.visits16[0b10] == 16
    # 00 is seen once (expert 1 at position 0, reused next); 11 never: the mean of all 29 samples
    assert t2.visits16[0b00] == 16 and t2.visits16[0b11] == round(16 * (14 * 2 + 14 + 1) / 29)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(bits=0), "'bits'"),
    (lambda d: d.update(scale=10), "'scale'"),
    (lambda d: d["visits16"].pop(), "'visits16'"),
    (lambda d: d["visits16"].__setitem__(0, 3), "'visits16'"),
    (lambda d: d["visits16"].__setitem__(0, True), "'visits16'"),
])
def test_malformed_tables_are_one_line_errors(change, message):
    d = learn_reuse_table([np.array([0, 1, 0, 0]).reshape(4, 1, 1)], 2, bits=2, cap=4).to_json()
    change(d)
    with pytest.raises(SpecPrefetchError, match=f"manifest.json: malformed reuse table: {message}"):
        ReuseTable.from_json(d, "manifest.json", shape=(1, 8))


def _table(bits=2):
    # a history of 11 is reused at the next visit, 01 in 2, 10 in 3, 00 in 8
    return ReuseTable(bits, 8, (8 * SCALE, 2 * SCALE, 3 * SCALE, 1 * SCALE))


def test_history_shifts_once_per_step_and_scores_in_sixteenths():
    h = ReuseHistory(_table(), num_layers=4)
    h.observe(1, [(1, 5)])
    h.observe(1, [(1, 6)])          # a second group of the same step: no second shift
    assert h.hist[1] == {5: 1, 6: 1}
    h.observe(5, [(1, 5)])          # the next visit of layer 1: 6 shifts to 10, 5 to 11
    assert h.hist[1] == {5: 3, 6: 2}
    h.observe(9, [(1, 7)])
    h.observe(13, [(1, 7)])         # 5: 11 -> 10 -> 00 (dropped)
    assert h.hist[1] == {7: 3}
    # now = 14 (layer 2): layer 3 comes next (step 15), layer 1 at 17, layer 2 at 18
    assert h.score((3, 0), 14, None) == 15 * SCALE + 4 * (8 - 1) * SCALE
    assert h.score((1, 7), 14, None) == 17 * SCALE
    assert h.score((2, 0), 14, None) == 18 * SCALE + 4 * 7 * SCALE
    # inside the window the prediction wins; a stale one does not count
    assert h.score((3, 0), 14, {(3, 0): 15}) == 15 * SCALE
    assert h.score((3, 0), 14, {(3, 0): 10}) == h.score((3, 0), 14, None)


def _pool(policy, predicted=None):
    pool = ExpertPool(3 * 10, 10, policy=policy)
    pool.reuse, pool.predicted = ReuseHistory(_table(), num_layers=4), predicted
    for step, key in enumerate([(0, 0), (1, 0), (2, 0)]):  # layers 0, 1, 2 of one token, one expert each
        pool.reuse.observe(step, [key])
        s = pool.reserve(key, step, prefetch=False)
        s.ready = True
        pool.touch(s, step)
    return pool


def test_the_pool_evicts_the_farthest_predicted_reuse():
    # step 3 (layer 3) needs a slot. Every history is 01 (reused in 2 visits): (0, 0) next at step 4 + 4,
    # (1, 0) at 5 + 4, (2, 0) at 6 + 4 (in sixteenths: 128, 144, 160). LRU evicts (0, 0), whose layer
    # comes next; reuse evicts (2, 0), whose layer comes last
    victims = {}
    for name, policy, pred in (("lru", "lru", None), ("reuse", "reuse", {}), ("predicted", "reuse", {(2, 0): 6})):
        pool = _pool(policy, pred)
        pool.reserve((3, 0), 3, prefetch=False)
        victims[name] = ({(0, 0), (1, 0), (2, 0)} - set(pool.slots)).pop()
    # with (2, 0) predicted for step 6 by the window (96), (1, 0) is the farthest
    assert victims == {"lru": (0, 0), "reuse": (2, 0), "predicted": (1, 0)}
    # a prediction for this very step that the step did not acquire was wrong: the history decides
    pool = _pool("reuse", {(2, 0): 3})
    pool.reserve((3, 0), 3, prefetch=False)
    assert (2, 0) not in pool.slots


def test_simulator_reuse_reads_less_than_lru(tmp_path):
    """On routing with hot experts the reuse eviction reads fewer bytes than LRU in the simulator, with
    the table learned from the trace's train split."""
    from toolkit.runtime.policy import Policy
    from toolkit.runtime.profiles import SNAPDRAGON_8_ELITE
    from toolkit.runtime.runner import RunConfig
    import torch

    from toolkit.simulate.replay import Geometry, simulate_policy
    from toolkit.traces.batches import RoutingBatch

    rng = np.random.default_rng(1)
    L, E, k, T = 4, 16, 2, 60
    p = np.linspace(4.0, 0.1, E)
    p /= p.sum()

    def seq():
        return np.stack([np.stack([rng.choice(E, k, replace=False, p=p) for _ in range(L)]) for _ in range(T)])
    table = learn_reuse_table([seq() for _ in range(8)], E)
    ids = torch.from_numpy(np.concatenate([seq() for _ in range(3)])).long()
    n = len(ids)
    b = RoutingBatch(hidden=torch.zeros(n, L, 1), ids=ids, next_ids=ids, prev_ids=ids,
                     has_next=torch.zeros(n, dtype=torch.bool), has_prev=torch.zeros(n, dtype=torch.bool),
                     probs=None, next_probs=None, seq=torch.arange(n) // T, pos=torch.arange(n) % T,
                     kind=torch.ones(n, dtype=torch.long))
    geo = Geometry(source="test", num_layers=L, num_experts=E, top_k=k, slot_bytes=4096, expert_bytes=4096,
                   dense_bytes_per_layer=0, dtype="int4")
    res = {ev: simulate_policy([b], None, geo, SNAPDRAGON_8_ELITE,
                               RunConfig(policy=Policy("on-demand", ev), pool_mib=12 * 4096 / 2**20), list(range(L)),
                               reuse=table)
           for ev in ("lru", "reuse", "belady")}
    read = {ev: r["counts"]["bytes_read"] for ev, r in res.items()}
    assert read["belady"] < read["reuse"] < read["lru"], read


def test_unseen_histories_fall_back_by_popcount():
    ids = np.array([0, 0, 1] * 12).reshape(36, 1, 1)  # expert 0 at two positions of three, expert 1 at the third
    t = learn_reuse_table([ids], 2, bits=4, cap=4)
    # four-visit histories seen: 0001 0011 0110 1101 1011 (expert 0), 0000 0001 0010 0100 1001 (expert 1);
    # 0101, 1010 and 1100 never are: they take the mean of the two-use ones seen, 0111 and 1110 the three-use
    assert t.visits16[0b0101] == t.visits16[0b1010] == t.visits16[0b1100]
    assert t.visits16[0b0111] == t.visits16[0b1110] != t.visits16[0b0101]
    assert t.visits16[0b0011] != t.visits16[0b0110]  # seen histories keep their own means


def _sched(policy):
    import torch  # noqa: F401  (the scheduler's scores are tensors)

    from toolkit.runtime.profiles import SNAPDRAGON_8_ELITE
    from toolkit.runtime.scheduler import SchedulerConfig, WindowScheduler
    from toolkit.simulate.flash import SimClock, SimFlash

    clock = SimClock()
    pool = ExpertPool(2 * 4096, 4096, policy=policy, min_slots=1, next_use=lambda k, now: float("inf"))
    # 01 (routed at the latest visit only): reused at the next visit
    table = ReuseTable(2, 8, (8 * SCALE, 1 * SCALE, 3 * SCALE, 1 * SCALE))
    reuse = ReuseHistory(table, num_layers=4) if policy == "reuse" else None
    sched = WindowScheduler(pool, SimFlash(SNAPDRAGON_8_ELITE, clock, 4096), SchedulerConfig(),
                            num_layers=4, top_k=1, clock=lambda: clock.now, reuse=reuse)
    if policy == "prediction":
        pool.next_use = sched.next_predicted_use
    for step, key in ((0, (0, 0)), (1, (1, 0))):  # both routed at their layer's visit: history 01
        sched.acquire(step, [key])
        sched.data(key)
        sched.release(step, [key], pump=False)
    return sched


def test_a_prefetch_keeps_an_expert_its_history_says_is_needed_first():
    import torch

    # at step 1 the pool (2 slots) is full; a prefetch of (1, 1) for step 5 would evict (1, 0), which the
    # history (01: reused at the next visit) puts at step 5 too: the reuse rule keeps it and drops the
    # prefetch; `prediction`, which knows only the window, evicts it
    got = {}
    for policy in ("reuse", "prediction"):
        sched = _sched(policy)
        sched.plan(1, [(5, torch.tensor([0.0, 1.0]))])
        got[policy] = (sched.stats.prefetch_issued, sched.stats.dropped_no_slot)
    assert got == {"reuse": (0, 1), "prediction": (1, 0)}


def test_next_visit_prediction_scores_by_hand():
    """A layer's predicted next visit decides while it is for that visit: a predicted expert is used
    then, any other one visit later (by its history shifted once); a stale prediction is ignored."""
    t = ReuseTable(bits=2, cap=8, visits16=(16 * 8, 16 * 2, 16 * 3, 16 * 1))
    L = 4
    h = ReuseHistory(t, L)
    h.observe(1, [(1, 0)])                  # layer 1 at step 1 routes to expert 0: history 01
    plain = h.score((1, 0), 2, None)
    assert plain == 5 * SCALE + L * (t.visits16[0b01] - SCALE)   # next visit at step 5, table[01]
    h.set_next_visits(1, 5, [[0, 3]])
    assert h.score((1, 0), 2, None) == 5 * SCALE                  # predicted: used at step 5
    assert h.score((1, 2), 2, None) == 9 * SCALE + L * (t.visits16[0] - SCALE)      # not: history 00 one on
    assert h.score((1, 0), 2, {(1, 0): 3}) == 3 * SCALE           # the window's prediction comes first
    h.set_next_visits(1, 1, [[2]])          # for a visit already past: stale, the history decides
    assert h.score((1, 2), 2, None) == 5 * SCALE + L * (t.visits16[0] - SCALE)


def test_next_visits_score_by_the_first_visit_that_predicts_them():
    """With a layer's next N visits predicted, an expert counts as used at the first of them whose set
    holds it (a set of a later visit too), and one in none by its history N visits on; the pool's
    search (`farthest`) ranks as `score` does."""
    from toolkit.runtime.pool import ExpertPool

    t = ReuseTable(bits=3, cap=8, visits16=tuple(16 * v for v in (8, 2, 3, 1, 5, 6, 7, 4)))
    L = 4
    h = ReuseHistory(t, L)
    h.observe(1, [(1, 0), (1, 1)])          # histories 001
    h.observe(5, [(1, 0)])                  # expert 0: 011, expert 1: 010
    h.set_next_visits(1, 9, [[3], [1], [2, 1]])
    assert h.score((1, 3), 6, None) == 9 * SCALE                   # the next visit's set
    assert h.score((1, 1), 6, None) == 13 * SCALE                  # the second visit's (and the third's)
    assert h.score((1, 2), 6, None) == 17 * SCALE                  # the third visit's
    # in none: the history three unused visits on (011 << 3, masked to three bits: 000)
    assert h.score((1, 0), 6, None) == 21 * SCALE + L * (t.visits16[0] - SCALE)
    h.set_next_visits(1, 9, [[3]])          # one visit: the history one on (011 << 1 = 110)
    assert h.score((1, 0), 6, None) == 13 * SCALE + L * (t.visits16[0b110] - SCALE)
    h.set_next_visits(1, 9, [[3], [1], [2, 1]])
    pool = ExpertPool(4, 1, policy="reuse", min_slots=1)
    pool.reuse, pool.predicted = h, None
    for e in range(4):
        pool.reserve((1, e), 6, prefetch=False).ready = True
    want = max(range(4), key=lambda e: h.score((1, e), 6, None))
    assert want == 0 and h.farthest(pool.by_layer, 6, None, set()) == (1, 0)
    h.set_next_visits(1, 9, [[3], [0, 1], [2]])   # expert 0 now in the second visit's set: 2 the farthest
    assert h.farthest(pool.by_layer, 6, None, set()) == (1, 2)


def test_adapter_next_visit_heads_train_save_and_load(tmp_path):
    """--next-visits N adds pairs (i, L), ..., (i, NL) per layer; the checkpoint records them and loads them
    back (an older checkpoint's next_visit: true as one); without cross-token they are refused."""
    import torch

    from adapters.lowrank import PrefetchAdapter

    ad = PrefetchAdapter(num_layers=3, hidden_size=4, num_experts=5, horizons=(1, 2), rank=2, next_visits=1)
    assert ad.all_horizons == (1, 2, 3) and [p for p in ad.pairs if p[1] == 3] == [(0, 3), (1, 3), (2, 3)]
    assert ad.target_layer(1, 3) == 1 and ad.horizons == (1, 2) and ad.tokens_ahead == 1
    two = PrefetchAdapter(num_layers=3, hidden_size=4, num_experts=5, horizons=(1, 2), rank=2, next_visits=2)
    assert two.all_horizons == (1, 2, 3, 6) and [p for p in two.pairs if p[1] == 6] == [(0, 6), (1, 6), (2, 6)]
    assert two.target_layer(2, 6) == 2 and two.tokens_ahead == 2 and two.visit_horizons == (3, 6)
    with pytest.raises(ValueError, match="cross_token"):
        PrefetchAdapter(num_layers=3, hidden_size=4, num_experts=5, cross_token=False, next_visits=1)
    with pytest.raises(ValueError, match="0..4"):
        PrefetchAdapter(num_layers=3, hidden_size=4, num_experts=5, next_visits=5)
    from adapters.train import TrainConfig
    assert TrainConfig().next_visits == 3 and TrainConfig(cross_token=False).next_visits == 0  # the default
    TrainConfig(cross_token=False).validate()
    for bad in (5, -1, True, 1.5):
        with pytest.raises(SpecPrefetchError, match="--next-visits"):
            TrainConfig(next_visits=bad).validate()
    from adapters.checkpoint import _pairs
    assert _pairs(3, [1, 2], True, 1) == len(ad.pairs) == _pairs(3, [1, 2], True, 0) + 3
    assert _pairs(3, [1, 2], True, 2) == len(two.pairs) == len(ad.pairs) + 3
    assert torch.equal(ad.tgt[ad.pair_index[(2, 3)]], torch.tensor(2))


def test_next_visit_weight_weighs_the_heads(tiny_models, tmp_path, monkeypatch):
    """--next-visit-weight is the heads' loss weight, in training and in the validation loss early
    stopping reads; a horizon L that is also a window horizon keeps the window's weight; the adapter
    records it; asked for without heads, the CLI refuses it in one line."""
    import adapters.train as T
    from click.testing import CliRunner

    from adapters.checkpoint import load_adapter
    from conftest import HELDOUT
    from toolkit.cli import main
    from toolkit.models.loader import inspect_model_dir
    from toolkit.traces.capture import TraceSettings, run_trace

    cfg = T.TrainConfig(horizons=(1, 2), next_visit_weight=0.25)
    assert (cfg.pair_weight(1, 3), cfg.pair_weight(2, 3), cfg.pair_weight(3, 3)) == (2.0, 1.0, 0.25)
    assert T.TrainConfig(horizons=(1, 2, 3), next_visit_weight=0.25).pair_weight(3, 3) == 1.0   # a window horizon
    two = T.TrainConfig(horizons=(1, 2, 3), next_visits=2, next_visit_weight=0.25)
    assert (two.pair_weight(3, 3), two.pair_weight(6, 3)) == (1.0, 0.25)   # the second visit's: the heads' weight
    for bad in ({"next_visit_weight": float("nan")}, {"next_visit_weight": -1.0}, {"next_visit_weight": True},
                {"next_visits": 0, "next_visit_weight": 0.5}, {"cross_token": False, "next_visit_weight": 2.0}):
        with pytest.raises(SpecPrefetchError, match="--next-visit-weight"):
            T.TrainConfig(**bad).validate()
    T.TrainConfig(cross_token=False).validate()          # without heads, the default weight is fine
    s = TraceSettings(max_sequences=8, prompt_tokens=24, decode_tokens=4, heldout_frac=0.25, shard_tokens=200)
    trace = run_trace(tiny_models["qwen3_moe"], [HELDOUT], tmp_path / "t", s, progress=False)
    spec = inspect_model_dir(tiny_models["qwen3_moe"])
    seen = []
    real = T.pair_loss
    monkeypatch.setattr(T, "pair_loss", lambda adapter, bank, b, c, weights: (
        seen.append((adapter.pairs, weights.tolist())), real(adapter, bank, b, c, weights))[1])
    for w in (0.0, 0.5):
        seen.clear()
        out = tmp_path / f"a{w}"
        T.train_adapter(trace, out, T.TrainConfig(steps=3, val_every=3, batch_size=32, rank=4, next_visit_weight=w),
                        progress=False)
        ad, meta = load_adapter(out, spec)
        L = ad.num_layers
        assert meta["training"]["next_visit_weight"] == w
        cls = meta["reuse"]["classes"]   # the reuse table's frequency classes, 4 by default
        assert meta["training"]["reuse_classes"] == 4 and len(meta["reuse"]["class_visits16"]) == 4
        assert len(cls) == L and all(sorted(r) == sorted(np.arange(len(r)) * 4 // len(r)) for r in cls), cls
        assert len(seen) > 3                                      # training steps and validation batches
        visit_hs = {L, 2 * L, 3 * L}   # the next visits' heads (train's default: three) weigh w
        assert L >= 3   # (so no window horizon, 1 or 2, is one of them)
        for pairs, weights in seen:
            assert [x for (i, h), x in zip(pairs, weights) if h in visit_hs] == [w] * 3 * L
            assert [x for (i, h), x in zip(pairs, weights) if h not in visit_hs] == [
                2.0 if h == 1 else 1.0 for i, h in pairs if h not in visit_hs]
    for extra in (["--next-visits", "0", "--next-visit-weight", "0.5"],
                  ["--no-cross-token", "--next-visit-weight", "1"]):
        r = CliRunner().invoke(main, ["train", str(trace), "--out", str(tmp_path / "x"), *extra])
        assert r.exit_code != 0 and "--next-visit-weight" in r.output and "no next-visit heads" in r.output, extra
        assert not (tmp_path / "x").exists()
    L = len(spec.geometry.moe_layers)
    assert L <= 4    # the tiny model's next visit can be a window horizon: then --horizon-weights weighs it
    r = CliRunner().invoke(main, ["train", str(trace), "--out", str(tmp_path / "x"), "--horizons",
                                  ",".join(map(str, range(1, L + 1))), "--next-visits", "1", "--next-visit-weight",
                                  "0.5"])
    assert r.exit_code != 0 and f"--horizon-weights {L}:W" in r.output, r.output
    assert not (tmp_path / "x").exists()
    r = CliRunner().invoke(main, ["train", str(trace), "--out", str(tmp_path / "y"), "--next-visits", "0",
                                  "--steps", "2", "--val-every", "2", "--batch-size", "32", "--rank", "4",
                                  "--reuse-classes", "1"])
    assert r.exit_code == 0 and (tmp_path / "y" / "adapter.json").exists(), r.output   # no heads: trains
    t = json.loads((tmp_path / "y" / "adapter.json").read_text())["reuse"]
    assert "classes" not in t and t["visits16"] == meta["reuse"]["visits16"]   # one table: the whole one
    r = CliRunner().invoke(main, ["train", str(trace), "--out", str(tmp_path / "z"), "--reuse-classes", "0"])
    assert r.exit_code == 2 and "--reuse-classes" in r.output and not (tmp_path / "z").exists()


@pytest.mark.parametrize("classes", [False, True])
def test_the_pools_search_is_the_scores_max_on_random_pools(classes):
    """The reuse search (ReuseHistory.farthest over the pool's slots by layer, its per-layer terms hoisted) picks
    max (score, -last_use, key) over the evictable slots, `score` the rule by hand, on random pools: histories,
    frequency classes, next-visit predictions for the layer's next visit, stale ones and ones of no visits, the
    window's predictions for later, this and earlier steps, pinned, loading and protected slots, ties."""
    rng = random.Random(7 + classes)
    L, E, bits = 6, 16, 4
    for trial in range(150):
        vis = tuple(rng.choice((16, 24, 40, 64, 64, 100)) for _ in range(1 << bits))   # (repeats: ties)
        t = ReuseTable(bits=bits, cap=8, visits16=vis)
        if classes:
            t = ReuseTable(bits=bits, cap=8, visits16=vis,
                           classes=tuple(tuple(rng.randrange(3) for _ in range(E)) for _ in range(L)),
                           class_visits16=tuple(tuple(rng.choice((16, 40, 64, 100)) for _ in range(1 << bits))
                                                for _ in range(3)))
        pool = ExpertPool(40 * 4096, 4096, policy="reuse")
        pool.reuse = h = ReuseHistory(t, L)
        now = rng.randint(50, 500)
        keys = rng.sample([(li, e) for li in range(L) for e in range(E)], rng.randint(1, 40))
        for k in keys:
            s = pool.reserve(k, now, prefetch=False)
            pool.touch(s, rng.randint(now - 6, now - 1))   # (last uses repeat: ties of score and last use)
            s.ready, s.pins = rng.random() < 0.9, int(rng.random() < 0.1)
        for li in range(L):
            h.hist[li] = {e: rng.randrange(1, 1 << bits) for e in range(E) if rng.random() < 0.5}
            v0 = now + ((li - now % L) % L or L)
            r = rng.random()
            if r < 0.6:
                h.set_next_visits(li, v0, [rng.sample(range(E), rng.randint(1, 5)) for _ in range(rng.randint(1, 3))])
            elif r < 0.7:
                h.set_next_visits(li, v0 - L, [rng.sample(range(E), 3)])   # stale: for a visit already past
            elif r < 0.8:
                h.set_next_visits(li, v0, [])                               # of no visits: as none
        pool.predicted = {k: now + rng.randint(-2, 2 * L) for k in rng.sample(keys, len(keys) // 3)}
        protect = set(rng.sample(keys, min(3, len(keys))))
        for _ in range(2):   # the second search after the first's victim is gone (the pump's next reservation)
            cands = [(h.score(s.key, now, pool.predicted), -s.last_use, s.key) for s in pool.slots.values()
                     if s.ready and not s.pins and s.key not in protect]
            want = max(cands)[2] if cands else None
            assert pool._victim(now, protect) == want, trial
            if want is None:
                break
            pool.evict(want)
