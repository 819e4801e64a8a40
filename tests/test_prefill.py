"""Prefill in chunks (issue 21, deliverable 3): the ExecuTorch export's prefill_T_layer_N methods,
the chunk plan, and both engines feeding a prompt chunk by chunk.

The chunk graphs give the decode graph's outputs and write the same KV cache; a prompt fed in
chunks gives the tokens of the one-position path and of transformers' generate; the native runner
and the Python reference make the same decisions line for line with chunks on (and off), with a
pool too small for a chunk's experts (their union is acquired in groups); --prefill-chunk picks or
refuses a size; a bundle without prefill methods runs one position at a time.
"""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from android_runner.build import command
from export.session import open_session, reference_tokens
from toolkit.runtime.backend import PREFILL_SPAN, chunk_plan, prefill_chunks_of, prefill_spans
from toolkit.runtime.events import EventLog, decisions
from toolkit.runtime.policy import Policy
from toolkit.runtime.runner import RunConfig

# 21 positions: two chunks of 8, then 5 single positions (the session bundle's chunk size is 8)
PROMPT = [591, 906, 531, 1274, 2295, 1062, 17, 402, 9, 1500, 33, 44, 55, 66, 77, 88, 99, 111, 222, 333, 444]
SHORT = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # one chunk, then one position
NEW = 6
POOL = 2.0  # 16 of the 256 expert slots: a chunk of 8 routes to more than that at some layers


def test_chunk_plan_is_greedy_largest_first():
    assert chunk_plan(21, (8,)) == [8, 8, 1, 1, 1, 1, 1]
    assert chunk_plan(100, (8, 32, 128)) == [32, 32, 32, 1, 1, 1, 1]
    assert chunk_plan(45, (32, 8)) == [32, 8, 1, 1, 1, 1, 1]
    assert chunk_plan(7, (8,)) == [1] * 7 and chunk_plan(3, ()) == [1, 1, 1]


@pytest.mark.parametrize("n", [0, 1, 7, 8, 21, 100, 555, 700, 1200, 2047])
def test_spans_merge_consecutive_chunks_and_split_back_into_them(n):
    sizes = (8, 32, 128)
    units = chunk_plan(n, sizes)
    spans = prefill_spans(units)
    assert sum(spans) == n and all(T <= PREFILL_SPAN for T in spans)
    back = [T for s in spans for T in (chunk_plan(s, sizes) if s > 1 else [1])]
    assert back == units  # a span's chunks are the plan's, in order
    assert spans.count(1) == units.count(1)  # single positions stay single
    assert all(s > 1 for s in spans[:len(spans) - units.count(1)])
    if n >= 2 * PREFILL_SPAN:
        assert spans[0] == spans[1] == PREFILL_SPAN  # full spans of four 128-chunks
    assert prefill_spans([8, 8, 1, 1]) == [16, 1, 1] and prefill_spans([8, 8, 8], cap=16) == [16, 8]


def test_usable_chunk_sizes_have_every_layer():
    names = ["embed", "layer_0", "layer_1", "prefill_8_layer_0", "prefill_8_layer_1", "prefill_32_layer_0", "head"]
    assert prefill_chunks_of(names) == (8,)  # 32 lacks layer 1: not a usable size
    assert prefill_chunks_of(["embed", "layer_0", "head"]) == ()


def _chunk_vs_positions(model_dir: Path, max_seq: int = 32, kv_mode: str = "buffer"):
    """prefill_8_layer_N over 8 positions = layer_N one position at a time (rounding), and the
    positions after the chunk, fed one at a time, see the keys and values the chunk wrote; every
    layer (dense and MoE, sliding-window or not). kv_mode "io": the QNN graphs' form (the host's
    cache, the chunk's one-hot [T, S] and mask [1, 1, T, S] as inputs)."""
    from export.graphs import StepModel
    from export.eager import TorchBackend
    from toolkit.models.loader import inspect_model_dir, load_dense_model

    spec = inspect_model_dir(model_dir)
    steps = StepModel(spec, load_dense_model(spec), max_seq=max_seq)
    steps.prefill_chunks = (8,)
    steps.windows = [min(w, 4) if w else 0 for w in steps.windows]  # sliding windows inside the 11 positions
    be = TorchBackend(steps, kv_mode)
    assert be.prefill_chunks == (8,)
    H = spec.geometry.hidden_size
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(1, 11, H, generator=g)
    for layer in range(spec.geometry.num_layers):
        be.reset()
        one = [be.layer(layer, hs[:, p:p + 1], p) for p in range(11)]
        be.reset()
        chunk = be.layer_chunk(layer, hs[:, :8], 0)
        after = [be.layer(layer, hs[:, p:p + 1], p) for p in range(8, 11)]
        assert tuple(chunk[0].shape) == (1, 8, H) and len(chunk) == len(one[0])
        if layer in spec.geometry.moe_layers:
            assert tuple(chunk[1].shape) == (8, H) and tuple(chunk[2].shape) == (8, spec.geometry.routing.num_experts)
        for j in range(len(chunk)):
            ref = torch.cat([o[j].reshape(1, -1) for o in one[:8]])
            assert torch.allclose(chunk[j].reshape(8, -1), ref, atol=1e-5), (layer, j)
        for a, b in zip(after, one[8:]):
            for x, y in zip(a, b):
                assert torch.allclose(x, y, atol=1e-5), layer


@pytest.mark.parametrize("kv_mode", ["buffer", "io"])
def test_chunk_graphs_equal_the_decode_graphs_and_share_the_cache(embedded, kv_mode):
    _chunk_vs_positions(embedded, kv_mode=kv_mode)


# GPT-OSS: attention sinks and sliding windows (narrowed to 4 positions); DeepSeek: MLA's caches
@pytest.mark.parametrize("kv_mode", ["buffer", "io"])
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_vl_moe", "deepseek_v2", "deepseek_v3", "mixtral", "olmoe"])
def test_chunk_graphs_of_every_family(family, tiny_models, kv_mode):
    _chunk_vs_positions(tiny_models[family], kv_mode=kv_mode)


@pytest.fixture(scope="module")
def reference(embedded_bundles):
    return open_session(embedded_bundles["executorch"], RunConfig(policy=Policy("on-demand", "lru"), io="threads"),
                        predictors=["next-gate", "fate", "previous-token", "oracle"])


def test_the_bundle_lists_its_prefill_methods(embedded_bundles, reference):
    m = json.loads((embedded_bundles["executorch"] / "manifest.json").read_text())
    assert m["graphs"]["prefill_chunks"] == [8]  # max_seq 64: the sizes up to a quarter of the cache
    assert {f"prefill_8_layer_{i}" for i in range(8)} <= set(m["graphs"]["methods"])
    sig = m["graphs"]["signatures"]["prefill_8_layer_1"]
    assert sig["inputs"] == [[[1, 8, 256], "float32"], [[8], "int64"]]
    assert sig["outputs"][:3] == [[[1, 8, 256], "float32"], [[8, 256], "float32"], [[8, 32], "float32"]]
    assert reference.runner.backend.prefill_chunks == (8,)


def test_chunked_prompt_gives_the_one_position_tokens(reference, embedded):
    r = reference.runner
    ref = reference_tokens(embedded, PROMPT, NEW)
    got = {}
    for chunk in (None, 0):
        r.configure(policy=Policy.parse("next-gate+prediction"), pool_mib=POOL, prefill_chunk=chunk)
        log = EventLog()
        g = r.run(PROMPT, NEW, events=log)
        got[chunk] = (g, log.lines)
    (on, on_lines), (off, _) = got[None], got[0]
    assert on.tokens == off.tokens == ref
    assert on.prefill_chunks == [8, 8, 1, 1, 1, 1, 1] and off.prefill_chunks == [1] * len(PROMPT)
    assert [t.tolist() for t in on.routing] == [t.tolist() for t in off.routing]  # the same experts chosen
    js = on.to_json()
    assert js["prefill_tokens_per_s"] == pytest.approx(len(PROMPT) / (js["ttft_ms"] / 1e3), rel=0.02)
    # the two chunks run as one span, layer by layer: its MoE layer is one step, numbered by its first
    # position: steps 0..7, then the next position's 16 * 8 + 0 ..
    steps = [ln for ln in on_lines if ln.startswith("step ")]
    assert steps[:9] == [f"step {i} pos=0 layer={i}" for i in range(8)] + ["step 128 pos=16 layer=0"]
    assert len(steps) == 8 + (len(PROMPT) - 16 + NEW - 1) * 8
    # some chunk layer routes to more experts than the pool holds: acquired in groups, each used once
    per_step: dict[str, list[str]] = {}
    for ln in on_lines:
        m = re.match(r"(\d+) (hit|miss) (\d+:\d+)", ln)
        if m:
            per_step.setdefault(m[1], []).append(m[3])
    cap = int(re.search(r"capacity=(\d+)", on_lines[0])[1])
    assert max(len(v) for v in per_step.values()) > cap
    assert all(len(v) == len(set(v)) for v in per_step.values())


def test_a_prefill_chunk_the_graphs_lack_is_refused(reference):
    from toolkit.errors import SpecPrefetchError

    with pytest.raises(SpecPrefetchError, match=r"--prefill-chunk 32: the graphs' prefill chunk sizes are 8"):
        reference.runner.configure(prefill_chunk=32)


def _native(native, tmp_path, policy, *extra):
    bundle, out = native
    js, ev = tmp_path / "n.json", tmp_path / "n.log"
    args = [a for ids in (PROMPT, SHORT) for a in ("--prompt-ids", ",".join(map(str, ids)))]
    r = subprocess.run([*command(out, "host"), str(bundle), *args, "--max-new-tokens", str(NEW), "--policy", policy,
                        "--pool-mib", str(POOL), "--json", str(js), "--events", str(ev), "--read-budget-kib", "off",
                        *extra],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(js.read_text()), ev.read_text().splitlines()


# make test: two policies with the default chunks and one unchunked; make test-all: two more chunked
POLICIES = {None: ("next-gate+prediction", "oracle+belady"), "off": ("next-gate+lfu",),
            "more": ("fate+lru", "previous-token+lru")}


@pytest.mark.parametrize("chunk", [None, "off", pytest.param("more", marks=pytest.mark.slow)])
def test_native_chunks_decide_as_the_reference(native_host, reference, tmp_path, chunk):
    r = reference.runner
    for policy in POLICIES[chunk]:
        out, lines = _native(native_host, tmp_path, policy, *(["--prefill-chunk", chunk] if chunk == "off" else []))
        r.configure(policy=Policy.parse(policy), pool_mib=POOL, prefill_chunk=0 if chunk == "off" else None)
        log = EventLog()
        gens = [r.run(ids, NEW, events=log) for ids in (PROMPT, SHORT)]
        for ids, g, run in zip((PROMPT, SHORT), gens, out["runs"]):
            assert run["tokens"] == g.tokens, policy
            assert run["prefill_chunks"] == g.prefill_chunks, policy
            # the prompt's tokens over the native TTFT, as the Python engine defines it (above)
            assert run["prefill_tokens_per_s"] == pytest.approx(len(ids) / (run["ttft_ms"] / 1e3), rel=0.02)
            assert sum(run["prefill_chunks"]) == len(ids)  # the units cover the prompt
            for k in ("requests", "hits", "misses", "prefetch_issued", "dropped_stale", "bytes_read"):
                assert run["counts"][k] == g.to_json()["counts"][k], (policy, k)
        assert decisions(lines) == decisions(log.lines), policy
    want = [[8, 8, 1, 1, 1, 1, 1], [8, 1]] if chunk != "off" else [[1] * len(PROMPT), [1] * len(SHORT)]
    assert [run["prefill_chunks"] for run in out["runs"]] == want


def test_native_refuses_a_chunk_size_the_bundle_lacks(native_host):
    bundle, out = native_host
    r = subprocess.run([*command(out, "host"), str(bundle), "--prompt-ids", "1,2,3", "--prefill-chunk", "16"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == ("specprefetch-runner: error: --prefill-chunk 16: the bundle's prefill "
                                                 "chunk sizes are 8; give one of them or off")


@pytest.mark.slow
def test_a_bundle_without_prefill_methods_runs_one_position_at_a_time(embedded, native_host, tmp_path, monkeypatch):
    """A bundle exported before prefill chunks (no prefill_T methods): both engines feed the prompt
    one position at a time by default, with the tokens and decisions of the chunked bundle's
    --prefill-chunk off."""
    import export.executorch_target as et
    from export.bundle import ExportConfig, export_bundle

    monkeypatch.setattr(et, "PREFILL_CHUNKS", ())
    old = tmp_path / "old"
    export_bundle(embedded, old, ExportConfig(target="executorch", max_seq=64, progress=False))
    m = json.loads((old / "manifest.json").read_text())
    assert m["graphs"]["prefill_chunks"] == [] and not any(n.startswith("prefill_") for n in m["graphs"]["methods"])
    s = open_session(old, RunConfig(policy=Policy.parse("next-gate+prediction"), pool_mib=POOL, io="threads"),
                     predictors=["next-gate"])
    log = EventLog()
    g = s.runner.run(PROMPT, NEW, events=log)
    assert g.prefill_chunks == [1] * len(PROMPT) and g.tokens == reference_tokens(embedded, PROMPT, NEW)
    _, out = native_host
    js, ev = tmp_path / "o.json", tmp_path / "o.log"
    subprocess.run([*command(out, "host"), str(old), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens",
                    str(NEW), "--policy", "next-gate+prediction", "--pool-mib", str(POOL), "--json", str(js),
                    "--events", str(ev), "--read-budget-kib", "off"], check=True, capture_output=True, timeout=300)
    run = json.loads(js.read_text())["runs"][0]
    assert run["tokens"] == g.tokens and run["prefill_chunks"] == [1] * len(PROMPT)
    assert decisions(ev.read_text().splitlines()) == decisions(log.lines)


def test_compute_while_loading_takes_landed_experts_first():
    """A decode MoE layer computes the experts whose bytes are in memory first, then each missing
    one as soon as its read lands (waiting, when none has, for the first): the per-expert order."""
    from toolkit.runtime.pool import ExpertPool
    from toolkit.runtime.scheduler import SchedulerConfig, WindowScheduler

    class IO:
        def __init__(self):
            self.done, self.waited = set(), []

        def submit(self, key, *, demand):
            pass

        def landed(self, key):
            return key in self.done

        def wait(self, key):
            self.waited.append(key)
            self.done.add(key)

        def take(self, key):
            return bytes(8)

        def release(self, key):
            pass

    io = IO()
    pool = ExpertPool(8 * 4096, 4096, min_slots=4)
    sched = WindowScheduler(pool, io, SchedulerConfig(prefetch=False), num_layers=2, top_k=4)
    keys = [(0, 5), (0, 1), (0, 7), (0, 3)]
    sched.acquire(0, keys)
    io.done.add((0, 7))
    order = []
    for i in sched.compute_order(keys):
        order.append(i)
        sched.data(keys[i])
        if len(order) == 1:
            io.done.add((0, 3))  # lands while the first expert computes
    assert order == [2, 3, 0, 1]
    assert io.waited == [(0, 5), (0, 1)]  # only the ones that had not landed were waited for


def test_cli_prefill_chunk_option(embedded_bundles, tmp_path):
    from click.testing import CliRunner

    from toolkit.cli import main

    b = str(embedded_bundles["executorch"])
    prompt = "one two three four five six seven eight nine ten"
    r = CliRunner().invoke(main, ["run", b, "--policy", "next-gate+prediction", "--prompt", prompt,
                                  "--max-new-tokens", "2", "--prefill-chunk", "x", "--json", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and "--prefill-chunk x: a chunk size (a positive integer) or off" in r.output
    runs = {}
    for chunk in ("8", "off"):
        out = tmp_path / f"{chunk}.json"
        r = CliRunner().invoke(main, ["run", b, "--policy", "next-gate+prediction", "--prompt", prompt,
                                      "--max-new-tokens", "2", "--prefill-chunk", chunk, "--json", str(out)])
        assert r.exit_code == 0, r.output
        runs[chunk] = json.loads(out.read_text())["runs"][0]
    assert runs["8"]["prefill_chunks"][0] == 8 and set(runs["off"]["prefill_chunks"]) == {1}
    assert runs["8"]["tokens"] == runs["off"]["tokens"] and runs["8"]["prefill_tokens_per_s"] > 0


def test_chunk_state_keeps_the_previous_position_and_the_oracle_plans_only_a_recorded_future():
    """Host predictors see, for a chunk's first token, the position before the chunk (not the chunk's own
    last token, which the runner records into RoutingState first); the oracle without a recorded future
    plans nothing for the chunk's layers that have not run yet (their choices are still unknown)."""
    from types import SimpleNamespace

    from toolkit.runtime.planner import ChunkState, PrefetchPlanner, RoutingState

    st = RoutingState(2, 4, 2)
    st.ids[0] = torch.tensor([[1, 2], [3, 4]])  # the position before the chunk
    st.pos = 5
    ch = ChunkState(3, 2, 4, 2, before=st.ids)
    ids0 = torch.tensor([[5, 6], [7, 8], [9, 10]])
    ch.record(0, torch.zeros(3, 4), ids0)
    st.record(0, torch.zeros(1, 4), ids0[-1])  # as Runner._chunk does before planning
    b = ch.batch(st)
    assert b.prev_ids[0].tolist() == [[1, 2], [3, 4]]
    assert b.prev_ids[1, 0].tolist() == [5, 6] and b.prev_ids[2, 0].tolist() == [7, 8]
    assert b.pos.tolist() == [5, 6, 7]

    got = []
    sched = SimpleNamespace(plan=lambda step, window: got.append(window), plan_probs=lambda *a: got.append(None))
    routing = SimpleNamespace(num_experts=16, n_group=None, topk_before_softmax=False, score_func="softmax")
    pl = PrefetchPlanner(SimpleNamespace(name="oracle", reads_future=True), num_layers=2, window=1, routing=routing,
                         score_bias=None)
    st.future = None
    pl.plan_chunk(sched, 0, 5 * 2 + 0, (3, 1), ch, st, None, end=10**6)
    (window,) = got
    (target, row), = window
    assert target == 11 and not bool((row > 0).any())  # layer 1 has not run: nothing, never expert 0
    st.future = [torch.tensor([[0, 1], [12, 13]])] * 8  # a recorded future: layer 1 routes to 12, 13
    got.clear()
    pl.plan_chunk(sched, 0, 5 * 2 + 0, (3, 1), ch, st, None, end=10**6)
    (target, row), = got[0]
    assert target == 11 and set(torch.nonzero(row > 0).flatten().tolist()) == {12, 13}
