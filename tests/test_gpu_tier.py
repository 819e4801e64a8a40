"""The GPU tier (toolkit/runtime/gpu.py): experts in (pinned) host memory, a bounded pool of slots on the
device, copies on their own stream. Its output must be transformers' greedy output for every policy and
pool. On a machine without CUDA the same code runs on the CPU; the CUDA variants run where a GPU is."""
from __future__ import annotations

import ctypes
import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from toolkit.errors import SpecPrefetchError
from toolkit.models.loader import inspect_model_dir, load_model
from toolkit.models.routers import load_router_bank
from toolkit.predictors.registry import build_predictor
from toolkit.runtime.expert_store import ExpertStore, build_store
from toolkit.runtime.gpu import CudaCopyIO, GpuEngine, Int4Experts
from toolkit.runtime.gpu_graph import DevicePlan, GraphRunner, StaticDecoder
from toolkit.runtime.native_sched import NO_COMPILER, has_compiler
from toolkit.runtime.policy import Policy
from toolkit.runtime.runner import RunConfig

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
NATIVE = pytest.mark.skipif(not has_compiler(), reason="no C++ compiler to build the native scheduler")
POLICIES = ["on-demand+lru", "next-gate+prediction", "oracle+belady", "draft+prediction", "draft+lru"]


@pytest.fixture(autouse=True)
def one_thread():
    """torch's intra-op threads spin against each other on a busy 2-core machine (index_add_ takes tens
    of ms instead of microseconds): these tiny models run on one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def stores(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-stores")
    out = {}
    for fam in ("qwen3_moe", "mixtral"):
        spec = inspect_model_dir(tiny_models[fam])
        out[fam] = build_store(spec, root / f"{fam}.spx", "fp16", progress=False)
    return out


def _reference(model_dir, prompt, n, device, dtype):
    """transformers' greedy tokens, its experts rounded to the store's fp16 (the weights the tier has)."""
    lm = load_model(model_dir, device=device, dtype=dtype)
    spec = lm.spec
    with torch.no_grad():
        for layer in spec.geometry.moe_layers:
            for p in spec.family.moe_block(lm.model, layer).experts.parameters():
                p.copy_(p.half().to(p.dtype))
    lm.model.config._experts_implementation = "eager"
    out = lm.model.generate(torch.tensor([prompt], device=device), do_sample=False, max_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _pool_mib(eng, frac):
    slots = max(eng.k, int(frac * eng.L * eng.E))
    return slots * eng.store.blob_size / 2**20 + 1e-9


def _engine(model_dir, store, policy, frac, device, dtype="float32", **kw):
    """One engine (int4 draft included; `kw`: GpuEngine's options); `configure` switches policy and pool
    between runs."""
    spec = inspect_model_dir(model_dir)
    st = ExpertStore(store, spec)
    E = spec.geometry.routing.num_experts
    bank = load_router_bank(spec)
    preds = {n: build_predictor(n, num_experts=E, bank=lambda: bank) for n in ("next-gate", "oracle")}
    eng = GpuEngine(load_model(model_dir, dtype=dtype), st, RunConfig(policy=Policy.parse(policy), pool_mib=64.0),
                    device=device, predictors=preds, with_draft=True, **kw)
    eng.configure(pool_mib=_pool_mib(eng, frac))
    return eng


def _batched(eng, prompt, n):
    """A run with the draft's one-pass verification, whose passes the static decoder and the modules
    path make alike (the exact verifications differ in order: layer-major against token steps)."""
    eng.verify = "batched"
    try:
        return eng.run(prompt, n, k=3)
    finally:
        eng.verify = "exact"


@pytest.mark.parametrize("fam", ["qwen3_moe", "mixtral"])
def test_tokens_match_transformers_cpu(tiny_models, stores, fam):
    """Every policy at a small and a half pool decodes transformers' tokens; the pool never holds more
    slots than its budget, and a small pool really copies (a test that could pass with everything
    resident would prove nothing)."""
    prompt = list(range(5, 17))
    want = _reference(tiny_models[fam], prompt, 16, "cpu", "float32")
    eng = _engine(tiny_models[fam], stores[fam], POLICIES[0], 0.1, "cpu")
    for policy in POLICIES:
        for frac in (0.1, 0.5):
            eng.configure(policy=Policy.parse(policy), pool_mib=_pool_mib(eng, frac))
            g = eng.run(prompt, 16, k=3)
            assert g.tokens == want, (fam, policy, frac)
            j = g.to_json()
            assert j["peak_pool_bytes"] <= j["budget_bytes"]
            assert all(m.seq is None for m in eng.pooled)   # a sequence is bound for a pass, no longer
            assert j["pcie_bytes_per_token"] > 0
            if policy.startswith("draft"):
                assert 0.0 <= j["acceptance"] <= 1.0 and j["rounds"] >= 1 and j["draft_bytes"] > 0
    # json-serialisable
    json.dumps(g.to_json())


def test_reuse_eviction_keeps_the_tokens_and_changes_the_copies(tiny_models, stores):
    """The reuse eviction (a learned approximation of Belady's rule, toolkit/runtime/reuse.py) on the GPU
    tier: a table learned from the model's own routing, the predictor's window beside it; tokens stay
    transformers', and at a small pool the copies differ from the prediction rule's (the rule acts).
    Without a table the policy is refused in one line."""
    import numpy as np

    from adapters.reuse import learn_reuse_table

    fam = "qwen3_moe"
    prompt = list(range(5, 17))
    want = _reference(tiny_models[fam], prompt, 16, "cpu", "float32")
    eng = _engine(tiny_models[fam], stores[fam], POLICIES[0], 0.1, "cpu")
    with pytest.raises(SpecPrefetchError, match="reuse table"):
        eng.configure(policy=Policy.parse("next-gate+reuse"))
    seen = [torch.stack(eng.record(list(range(20 + 7 * i, 34 + 7 * i)), 24).routing).numpy() for i in range(3)]
    eng.reuse = learn_reuse_table([np.asarray(x) for x in seen], eng.E)
    copied = {}
    for policy in ("next-gate+prediction", "next-gate+reuse", "draft+reuse"):
        for frac in (0.1, 0.25, 0.5):
            eng.configure(policy=Policy.parse(policy), pool_mib=_pool_mib(eng, frac))
            g = eng.run(prompt, 16, k=3)
            assert g.tokens == want, (policy, frac)
            j = g.to_json()
            assert j["peak_pool_bytes"] <= j["budget_bytes"]
            copied[policy, frac] = (j["pcie_bytes_per_token"], j["hit_rate"])
    assert copied["next-gate+reuse", 0.25] != copied["next-gate+prediction", 0.25]


def test_rejected_drafts_still_give_the_models_tokens(tiny_models, stores, monkeypatch):
    """A draft whose experts are perturbed proposes wrong tokens: the verification pass rejects them
    and crops both KV caches, and the output is still transformers'."""
    prompt = list(range(5, 17))
    want = _reference(tiny_models["mixtral"], prompt, 16, "cpu", "float32")
    real = Int4Experts._unpack

    def noisy(self, packed):
        w = real(self, packed)
        return w + 0.5 * torch.randn(w.shape, generator=torch.Generator().manual_seed(w.numel())).to(w.dtype)

    monkeypatch.setattr(Int4Experts, "_unpack", noisy)
    real_fused = Int4Experts.fused

    def noisy_fused(self, x, idx, w):   # the device path (static decoder) is perturbed alike
        y = real_fused(self, x, idx, w)
        return y + 0.5 * torch.randn(y.shape, generator=torch.Generator().manual_seed(int(idx.sum()))).to(y.dtype)

    monkeypatch.setattr(Int4Experts, "fused", noisy_fused)
    eng = _engine(tiny_models["mixtral"], stores["mixtral"], "draft+prediction", 0.25, "cpu")
    g = eng.run(prompt, 16, k=4)
    assert g.tokens == want
    assert g.extra["acceptance"] < 0.9 and g.extra["rounds"] > 16 / 5   # rejections happened


def test_phases_over_one_sequence_state(tiny_models, stores, monkeypatch):
    """`generate` is a loop over the phases: driving them by hand over one GpuSequence gives its tokens,
    routing and counts; the engine keeps no per-sequence state, and the pooled experts refuse to run
    unbound. The draft's rounds commit through draft.py's accept rule, once per round."""
    from toolkit.predictors import draft as draft_mod
    from toolkit.runtime import gpu

    prompt = list(range(5, 17))
    for decode in ("static", "modules"):
        spec = inspect_model_dir(tiny_models["mixtral"])
        eng = GpuEngine(load_model(tiny_models["mixtral"], dtype="float32"), ExpertStore(stores["mixtral"], spec),
                        RunConfig(policy=Policy.parse("draft+prediction"), pool_mib=64.0), device="cpu",
                        decode=decode)
        eng.configure(pool_mib=_pool_mib(eng, 0.25))
        calls = []
        real = draft_mod.greedy_accept

        def counted(proposal, target, stats=None, _real=real):
            calls.append(len(proposal))
            return _real(proposal, target, stats)
        monkeypatch.setattr(gpu, "greedy_accept", counted)
        want = eng.run(prompt, 12, k=3)
        assert len(calls) == want.extra["rounds"] and max(calls) == 3
        monkeypatch.undo()
        assert not hasattr(eng, "run_state") and all(m.seq is None for m in eng.pooled)
        for policy in ("on-demand+lru", "draft+prediction"):
            eng.configure(policy=Policy.parse(policy))
            want = eng.generate(prompt, 12, k=3)
            with torch.no_grad(), eng.dev.scope():
                s = eng.sequence(prompt, 12, k=3)
                eng.prefill(s)
                assert s.tokens == want.tokens[:1] and len(s.ids) == len(prompt) + 1 and not s.done
                if policy.startswith("draft"):
                    eng.prefill_draft(s)
                while not s.done:
                    n = len(s.tokens)
                    if policy.startswith("draft"):
                        eng.speculative_round(s, 3)
                        assert 1 <= len(s.tokens) - n <= 4
                    else:
                        eng.decode_one(s)
                        assert len(s.tokens) == n + 1
            assert s.tokens == want.tokens and s.ids == prompt + want.tokens, (decode, policy)
            assert [s.routing[p] for p in sorted(s.routing)] == [r.tolist() for r in want.routing]
            assert s.sched.stats.requests > 0
        # a budget past every expert: the pool's capacity is its budget's, the arena holds every expert,
        # and a pool never holds more (one slot per expert), so it never needs a slot the arena lacks
        eng.configure(policy=Policy.parse("on-demand+lru"), pool_mib=_pool_mib(eng, 2.0))
        with torch.no_grad(), eng.dev.scope():
            s = eng.sequence(prompt, 6, preload=True)
            eng.prefill(s)
            while not s.done:
                eng.decode_one(s)
        assert s.pool.capacity >= 2 * eng.L * eng.E and s.io.slots.shape[0] == eng.capacity == eng.L * eng.E
        with pytest.raises(SpecPrefetchError, match=f"--window {eng.L + 1}: must be 1..{eng.L}"):
            eng.configure(window=eng.L + 1)
        assert len(s.pool.slots) == eng.L * eng.E and s.pool.evictions == 0
        block = spec.family.moe_block(eng.model, spec.geometry.moe_layers[0])
        with pytest.raises(SpecPrefetchError, match="outside one of its forward passes"):
            block.experts(torch.zeros(1, spec.geometry.hidden_size), torch.zeros(1, eng.k, dtype=torch.long),
                          torch.ones(1, eng.k))


def test_exact_verification_commits_the_one_token_steps_tokens(tiny_models, stores, monkeypatch):
    """The draft's exact verification (the default) commits what the target's one-token decode step
    computes: with the static decoder every row through that step's own segments, layer-major
    (GraphRunner.verify_rows), with transformers' modules one step per position up to the first
    disagreement. Its tokens and per-position routing are the on-demand policy's, whatever a
    k + 1-row pass would compute. Here the batched pass is made to compute differently (every row's
    best token knocked out, as a k + 1-row GEMM can round a near-tie the other way): the batched
    verification's tokens change, the exact one's do not."""
    prompt = list(range(5, 17))
    real = GpuEngine._verify

    def runner_up(self, s, rows, pos):
        lg = real(self, s, rows, pos).clone()
        lg[torch.arange(lg.shape[0]), lg.argmax(-1)] = float("-inf")
        return lg

    for decode in ("static", "modules"):
        spec = inspect_model_dir(tiny_models["mixtral"])
        eng = GpuEngine(load_model(tiny_models["mixtral"], dtype="float32"), ExpertStore(stores["mixtral"], spec),
                        RunConfig(policy=Policy.parse("on-demand+lru"), pool_mib=64.0), device="cpu",
                        decode=decode, with_draft=True)
        assert eng.verify == "exact"
        eng.configure(pool_mib=_pool_mib(eng, 0.25))
        want = eng.run(prompt, 12)
        eng.configure(policy=Policy.parse("draft+prediction"))
        steps, passes = [], []
        step = GpuEngine._step
        monkeypatch.setattr(GpuEngine, "_step", lambda self, s, t, p: steps.append(p) or step(self, s, t, p))
        rows = GraphRunner.verify_rows
        monkeypatch.setattr(GraphRunner, "verify_rows",
                            lambda self, s, t, p: passes.append(len(t)) or rows(self, s, t, p))
        g = eng.run(prompt, 12, k=3)
        assert g.tokens == want.tokens, decode
        n = len(want.routing)   # rows past the last committed token are recorded too
        assert [r.tolist() for r in g.routing[:n]] == [r.tolist() for r in want.routing]
        assert 0 < g.extra["acceptance"] < 1     # rounds that stopped early and rounds that did not
        if decode == "modules":
            # a + 1 target steps a round (the last round's may pass the last token asked for): no more
            assert len(want.tokens) - 1 <= len(steps) <= len(want.tokens) - 1 + g.extra["rounds"]
            assert len(g.routing) <= n + 1 and not passes
        else:   # one layer-major pass a round over the last token and its proposals
            assert len(passes) == g.extra["rounds"] and max(passes) == 4 and not steps
        monkeypatch.setattr(GpuEngine, "_verify", runner_up)
        assert eng.run(prompt, 12, k=3).tokens == want.tokens      # exact never reads the batched pass
        eng.verify = "batched"
        assert eng.run(prompt, 12, k=3).tokens[1:] != want.tokens[1:]   # batched does (the first is the prefill's)
        monkeypatch.undo()
    with pytest.raises(SpecPrefetchError, match="verify 'rows': expected exact or batched"):
        GpuEngine(load_model(tiny_models["mixtral"], dtype="float32"), ExpertStore(stores["mixtral"], spec),
                  RunConfig(policy=Policy.parse("on-demand+lru"), pool_mib=64.0), device="cpu", verify="rows")


def test_greedy_accept_is_the_one_verification_rule():
    """The longest agreeing prefix, then the target's own token; the round counted."""
    from toolkit.predictors.draft import SpecStats, greedy_accept

    st = SpecStats()
    assert greedy_accept([4, 5, 6], [4, 5, 6, 7], st) == [4, 5, 6, 7]      # all accepted, the bonus token
    assert greedy_accept([4, 5, 6], [4, 9, 6, 7], st) == [4, 9]            # one accepted, the target's fix
    assert greedy_accept([4, 5, 6], [1, 5, 6, 7], st) == [1]               # none accepted
    assert greedy_accept([], [3]) == [3]                                    # no proposal: plain greedy
    assert (st.rounds, st.proposed, st.accepted) == (3, 9, 4)


def test_draft_is_int4_and_its_bytes_are_charged(tiny_models, stores):
    eng = _engine(tiny_models["qwen3_moe"], stores["qwen3_moe"], "draft+prediction", 0.5, "cpu")
    d = eng.drafts[0]
    assert isinstance(d, Int4Experts)
    spec = inspect_model_dir(tiny_models["qwen3_moe"])
    g = spec.geometry
    fp16 = g.routing.num_experts * 3 * g.hidden_size * g.moe_intermediate_size * 2
    assert d.nbytes() < 0.35 * fp16       # 4 bits and a scale per 32 weights: about 0.28 of fp16
    w = torch.randn(6, 70) * 0.02                       # a partial last group
    packed = d._pack(w)
    from toolkit.models.quant import group_dequantize, group_quantize
    from toolkit.runtime.gpu_kernels import dequant

    q, scale = group_quantize(w, 4)                      # the int4 store's codes and fp16 scales
    assert torch.equal(packed[1], scale)
    assert torch.equal(dequant(packed[0], packed[1], 70), group_dequantize(q, scale, 70))  # the nibbles decode to them
    assert torch.equal(packed[0][:, 0] & 0xF, (q[:, 0] + 8).to(torch.uint8))               # low nibble first


def test_pool_budget_and_store_refusals(tiny_models, stores, tmp_path):
    spec = inspect_model_dir(tiny_models["qwen3_moe"])
    st = ExpertStore(stores["qwen3_moe"], spec)
    with pytest.raises(SpecPrefetchError, match="pool-mib"):
        GpuEngine(load_model(tiny_models["qwen3_moe"]), st, RunConfig(policy=Policy("on-demand", "lru"),
                  pool_mib=st.blob_size / 2**20), device="cpu")
    int4 = build_store(spec, tmp_path / "int4.spx", "int4", progress=False)
    with pytest.raises(SpecPrefetchError, match="fp16"):
        GpuEngine(load_model(tiny_models["qwen3_moe"]), ExpertStore(int4, spec), RunConfig(pool_mib=1.0), device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(SpecPrefetchError, match="CUDA is not available"):
            GpuEngine(load_model(tiny_models["qwen3_moe"]), st, RunConfig(pool_mib=1.0), device="cuda")


def test_gpu_bench_report(tiny_models, stores, tmp_path, monkeypatch):
    """The bench end to end on the CPU: every row, the ratios, and the three report files. With --variant
    each predicting policy (not on-demand, the draft or the oracle) runs again with those scheduler settings,
    a row of its own, and the settings reach the scheduler (a threshold of 1 queues nothing, a read budget
    of one slot drops prefetches as late, one prefetch copy a step issues fewer); bad settings are refused
    before the model loads."""
    from toolkit.models import loader
    from toolkit.runtime.gpu_bench import run_gpu_bench, write
    from toolkit.runtime.policy import parse_policies

    from toolkit.runtime.gpu import GpuEngine

    pols = parse_policies("on-demand+lru,next-gate+prediction,draft+prediction,oracle+belady")
    slot_kib = -(-ExpertStore(stores["qwen3_moe"]).blob_size // 1024)
    budget = f"read_budget_kib={slot_kib + 1}"   # one slot a step (+1 KiB: told apart from auto raised to one)
    configured: list = []   # (policy, read budget) of every run the bench configured
    configure = GpuEngine.configure

    def record(self, **kw):
        if "policy" in kw:
            configured.append((kw["policy"].name, kw.get("read_budget_kib")))
        return configure(self, **kw)

    monkeypatch.setattr(GpuEngine, "configure", record)
    r = run_gpu_bench(tiny_models["qwen3_moe"], store=stores["qwen3_moe"], adapter=None, policies=pols,
                      fractions=[0.5], prompts=1, prompt_tokens=8, new_tokens=6, repeats=1, ks=(2, 3), device="cpu",
                      variants=("candidate_threshold=1", budget, "queue_depth=1", "read_budget_kib=auto"),
                      log=lambda s: None)
    rows = {x["policy"]: x for x in r["rows"]}
    tag = "next-gate+prediction scheduler="
    assert r["launch_pdl"] is False   # (the CPU: no programmatic dependent launch)
    assert r["tokens_match_transformers"] and list(rows) == [
        "on-demand+lru", "next-gate+prediction", "draft+prediction", "oracle+belady", tag + "candidate_threshold=1.0",
        tag + budget, tag + "queue_depth=1", tag + "read_budget_kib=auto"]
    # auto: the copy rate times a layer's share of the synced resident step, at least one slot
    a = r["read_budget_auto"]
    assert a["copy_gbps"] > 0 and a["step_ms"] > 0 and a["kib"] >= slot_kib
    made = a["copy_gbps"] * 1e9 * a["step_ms"] / 1e3 / 1024   # (from the rounded figures)
    assert a["kib"] == slot_kib if a["raised"] else abs(a["kib"] - made) <= 0.01 * made + 1
    assert rows[tag + "read_budget_kib=auto"]["read_budget_auto_kib"] == a["kib"]
    # auto's budget reached the engine as a number, for the auto variant's runs only (as many as the
    # fixed variant's); on-demand, the draft and the oracle ran without a budget
    assert a["kib"] != slot_kib + 1
    assert {b for p, b in configured if p != "next-gate+prediction"} == {None}
    ng = [b for p, b in configured if p == "next-gate+prediction"]
    assert set(ng) == {None, slot_kib + 1, a["kib"]} and ng.count(a["kib"]) == ng.count(slot_kib + 1) > 0
    # half the experts fit: on-demand copies (decode only) and the oracle with Belady copies no more
    assert rows["on-demand+lru"]["pcie_mib_per_token"] > 0
    assert rows["oracle+belady"]["pcie_mib_per_token"] <= rows["on-demand+lru"]["pcie_mib_per_token"]
    assert rows["oracle+belady"]["hit_rate"] >= rows["on-demand+lru"]["hit_rate"]
    assert rows["draft+prediction"]["k"] in (2, 3) and set(r["draft_k"]["0.5"]["profile_tpot_ms"]) == {2, 3}
    # the variants: their settings reached the scheduler (decisions do not depend on timing)
    plain = rows["next-gate+prediction"]
    assert plain["prefetches_per_token"] > 0 and plain["dropped_late_per_token"] == 0 and "scheduler" not in plain
    assert rows[tag + "candidate_threshold=1.0"]["prefetches_per_token"] == 0
    assert rows[tag + "candidate_threshold=1.0"]["scheduler"] == {"candidate_threshold": 1.0}
    late = rows[tag + budget]
    assert late["dropped_late_per_token"] > 0 and late["prefetches_per_token"] < plain["prefetches_per_token"]
    assert 0 < rows[tag + "queue_depth=1"]["prefetches_per_token"] < plain["prefetches_per_token"]
    # the all-resident bound both ways: the device alone (the static decoder) and synced per layer
    assert r["resident_device_alone"] and r["resident_runs"] == r["resident_synced_runs"] == 1
    assert r["resident_tpot_ms"] > 0 and r["resident_synced_tpot_ms"] > 0 and r["experts"] == "eager"
    md, png = write(r, tmp_path / "gpu.json")
    assert "draft+prediction" in md.read_text() and tag + "queue_depth=1" in md.read_text() and png.stat().st_size > 0
    assert f"read_budget_kib=auto: {a['kib']} KiB" in md.read_text()
    assert "without a host sync per layer (eager)" in md.read_text()   # static: no graph
    # refused before the model loads
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    for bad, msg in [(("window=99",), "past the model's"), (("speed=2",), "not KEY=VALUE"),
                     (("queue_depth=2", "queue_depth=2"), "same settings"),
                     ((f"read_budget_kib={slot_kib - 1}",), "below one expert slot"),
                     (("read_budget_kib=fast",), "an integer >= 1 or auto"),
                     (("reuse_classes=off",), "no predicting \\+reuse policy whose reuse table has frequency")]:
        with pytest.raises(SpecPrefetchError, match="^--variant .*" + msg):
            run_gpu_bench(tiny_models["qwen3_moe"], store=stores["qwen3_moe"], adapter=None, policies=pols,
                          fractions=[0.5], device="cpu", variants=bad, log=lambda s: None)
    with pytest.raises(SpecPrefetchError, match="no policy predicts"):
        run_gpu_bench(tiny_models["qwen3_moe"], store=stores["qwen3_moe"], adapter=None, policies=pols[:1],
                      fractions=[0.5], device="cpu", variants=("window=1",), log=lambda s: None)


def test_profile_of_a_resident_token(tiny_models, stores):
    """`profile_resident` counts a decode token's ops as the difference of a short and a long resident
    run: on the CPU the static decoder's host ops (the resident path), a whole number of each per token
    (every decode token runs the same ops), more than one per MoE layer, and too few new tokens refused."""
    from toolkit.models.loader import load_model
    from toolkit.runtime.expert_store import ExpertStore
    from toolkit.runtime.gpu import GpuEngine
    from toolkit.runtime.gpu_bench import profile_resident
    from toolkit.runtime.policy import Policy
    from toolkit.runtime.runner import RunConfig

    lm = load_model(tiny_models["qwen3_moe"])
    st = ExpertStore(stores["qwen3_moe"])
    all_mib = st.num_layers * st.num_experts * st.blob_size / 2**20 + 1e-6
    eng = GpuEngine(lm, st, RunConfig(policy=Policy("on-demand", "lru"), pool_mib=all_mib), device="cpu")
    r = profile_resident(eng, [5, 6, 7, 8], 8, short=3)
    assert r["what"] == "host ops" and r["tokens"] == 5
    # (the ops' time is a difference of two timed runs: no sign asserted, a busy machine can make it negative)
    assert r["ops_per_token"] > st.num_layers and math.isfinite(r["device_ms_per_token"])
    assert all(float(x["per_token"]).is_integer() for x in r["top"]), r["top"]
    with pytest.raises(SpecPrefetchError, match="more than 3 new tokens"):
        profile_resident(eng, [5, 6, 7, 8], 3, short=3)


@pytest.fixture(scope="module")
def tiny_adapter(tiny_models, tmp_path_factory):
    """An adapter (next-visit heads and reuse table included: train's defaults) of the tiny Qwen3-MoE."""
    from adapters.train import TrainConfig, train_adapter
    from conftest import HELDOUT
    from toolkit.traces.capture import TraceSettings, run_trace

    root = tmp_path_factory.mktemp("gpu-adapter")
    s = TraceSettings(max_sequences=8, prompt_tokens=24, decode_tokens=4, heldout_frac=0.25, shard_tokens=200)
    trace = run_trace(tiny_models["qwen3_moe"], [HELDOUT], root / "t", s, progress=False)
    train_adapter(trace, root / "a", TrainConfig(steps=5, val_every=5, batch_size=32, rank=4), progress=False)
    return root / "a"


def test_reuse_table_comes_from_the_models_adapter(tiny_models, stores, tiny_adapter, tmp_path):
    """The GPU tier's reuse table is the adapter's, checked against the model like the adapter (an
    adapter of another model, one without a table, or none at all: one line, before any loading); the
    bench runs `+reuse` policies with it and their tokens are transformers'."""
    import shutil

    from toolkit.runtime.gpu_bench import gpu_reuse_table, run_gpu_bench
    from toolkit.runtime.policy import parse_policies

    ad = tiny_adapter
    qwen, mixtral = inspect_model_dir(tiny_models["qwen3_moe"]), inspect_model_dir(tiny_models["mixtral"])
    assert gpu_reuse_table(qwen, ["lru", "prediction"], None) is None   # no policy needs it
    table = gpu_reuse_table(qwen, ["reuse"], ad)
    assert table is not None and len(table.visits16) == 1 << table.bits
    with pytest.raises(SpecPrefetchError, match="pass --adapter"):
        gpu_reuse_table(qwen, ["reuse"], None)
    with pytest.raises(SpecPrefetchError, match="trained for model config"):
        gpu_reuse_table(mixtral, ["reuse"], ad)
    old = tmp_path / "old"
    shutil.copytree(ad, old)
    meta = json.loads((old / "adapter.json").read_text())
    del meta["reuse"]
    (old / "adapter.json").write_text(json.dumps(meta))
    with pytest.raises(SpecPrefetchError, match=r"old/adapter.json: no reuse table"):
        gpu_reuse_table(qwen, ["reuse"], old)
    with pytest.raises(SpecPrefetchError, match="pass --adapter"):   # refused before the reference runs
        run_gpu_bench(tiny_models["qwen3_moe"], store=stores["qwen3_moe"], adapter=None,
                      policies=parse_policies("on-demand+reuse"), fractions=[0.5], device="cpu", log=lambda s: None)
    with pytest.raises(SpecPrefetchError, match="--variant reuse_classes=off: no predicting"):
        run_gpu_bench(tiny_models["qwen3_moe"], store=stores["qwen3_moe"], adapter=ad,
                      policies=parse_policies("on-demand+reuse,adapter+prediction"), fractions=[0.5], device="cpu",
                      variants=("reuse_classes=off",), log=lambda s: None)
    configured = []
    configure = GpuEngine.configure

    def record(self, **kw):
        configured.append((kw.get("policy"), kw.get("reuse_classes")))
        return configure(self, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GpuEngine, "configure", record)
        r = run_gpu_bench(tiny_models["qwen3_moe"], store=stores["qwen3_moe"], adapter=ad,
                          policies=parse_policies("on-demand+lru,on-demand+reuse,adapter+reuse,adapter+prediction"),
                          fractions=[0.25], prompts=1, prompt_tokens=8, new_tokens=6, repeats=1, ks=(2,),
                          device="cpu", variants=("reuse_classes=off",), log=lambda s: None)
    # the adapter has next-visit heads (train's default): adapter+reuse also runs without them; its reuse table
    # has frequency classes (train's default too): reuse_classes=off runs the predicting +reuse policy again with
    # the whole table (adapter+prediction takes no such row), and the setting reached the engine
    assert table.classes is not None
    assert r["tokens_match_transformers"] and {x["policy"] for x in r["rows"]} == {
        "on-demand+lru", "on-demand+reuse", "adapter+reuse", "adapter+prediction", "adapter+reuse next-visit=off",
        "adapter+reuse scheduler=reuse_classes=off"}
    assert {p.name for p, c in configured if c is False} == {"adapter+reuse"}


def test_gpu_engine_takes_no_reuse_classes(tiny_models, stores, tiny_adapter, monkeypatch, tmp_path):
    """`run --device cuda --no-reuse-classes` reaches gpu_engine, and gpu_engine the engine's RunConfig."""
    from click.testing import CliRunner

    import toolkit.engines as engines
    from toolkit.cli import main

    seen = []
    init = GpuEngine.__init__
    monkeypatch.setattr(GpuEngine, "__init__", lambda self, lm, st, cfg, **kw: (seen.append(cfg.reuse_classes),
                                                                                init(self, lm, st, cfg, **kw))[1])
    for flag in (True, False):
        engines.gpu_engine(tiny_models["qwen3_moe"], device="cpu", policy="adapter+reuse", adapter=tiny_adapter,
                           store_path=stores["qwen3_moe"], dtype=None, pool_mib=8.0, window=2, min_confidence=0.02,
                           draft_k=4, reuse_classes=flag)
    assert seen == [True, False]
    asked = []

    def stop(model, **kw):
        asked.append(kw["reuse_classes"])
        raise SpecPrefetchError("stopped here")

    monkeypatch.setattr(engines, "gpu_engine", stop)
    for extra in ((), ("--no-reuse-classes",)):
        r = CliRunner().invoke(main, ["run", str(tiny_models["qwen3_moe"]), "--device", "cuda", "--policy",
                                      "adapter+reuse", "--adapter", str(tiny_adapter), "--prompt", "x", *extra,
                                      "--json", str(tmp_path / f"r{len(extra)}.json")])
        assert "stopped here" in r.output, r.output
    assert asked == [True, False]
    # --attention / --router: through to the engine with --device cuda, refused on the CPU engines
    kernels = []
    monkeypatch.setattr(engines, "gpu_engine", lambda model, **kw: (kernels.append((kw["attention"], kw["router"])),
                                                                    stop(model, **kw))[1])
    for extra, want in (((), (None, None)), (("--attention", "sdpa", "--router", "model"), ("sdpa", "model"))):
        r = CliRunner().invoke(main, ["run", str(tiny_models["qwen3_moe"]), "--device", "cuda", "--prompt", "x",
                                      *extra, "--json", str(tmp_path / "k.json")])
        assert "stopped here" in r.output and kernels[-1] == want, r.output
    for opt, v in (("--router", "model"), ("--attention", "sdpa")):
        r = CliRunner().invoke(main, ["run", str(tiny_models["qwen3_moe"]), "--prompt", "x", opt, v,
                                      "--json", str(tmp_path / "c.json")])
        assert r.exit_code != 0 and f"{opt}: only with --device cuda" in r.output, r.output
        assert not (tmp_path / "c.json").exists()
    monkeypatch.undo()   # (the real gpu_engine: the options reach GpuEngine)
    got = []
    init = GpuEngine.__init__
    monkeypatch.setattr(GpuEngine, "__init__", lambda self, lm, st, cfg, **kw: (got.append((kw["attention"],
                                                                                            kw["router"])),
                                                                                init(self, lm, st, cfg, **kw))[1])
    engines.gpu_engine(tiny_models["qwen3_moe"], device="cpu", policy="on-demand+lru", adapter=None,
                       store_path=stores["qwen3_moe"], dtype=None, pool_mib=8.0, window=2, min_confidence=0.02,
                       draft_k=4, attention="sdpa", router="model")
    assert got == [("sdpa", "model")]


def test_reuse_eviction_reads_the_adapters_next_visit_heads(tiny_models, stores, tiny_adapter, monkeypatch):
    """adapter+reuse on the GPU tier hands the reuse history each MoE layer's predicted next visits after
    every decode layer: of each of the adapter's heads of horizons L, 2L, 3L (train's default: three) on that
    layer's router input the largest logits, for the step L later; RunConfig.next_visits reads fewer;
    --no-next-visit (RunConfig.next_visit) and the prediction eviction hand none; the tokens are the same
    either way."""
    from toolkit.runtime import reuse as reuse_mod
    from toolkit.runtime.gpu_bench import gpu_predictors, gpu_reuse_table

    ad = tiny_adapter
    spec = inspect_model_dir(tiny_models["qwen3_moe"])
    preds = gpu_predictors(spec, {"adapter"}, ad)
    assert preds["adapter"].next_visits == 3
    # the tiny adapter's heads barely trained (they start as the layer's router): later visits' heads made
    # different, so a set handed for the wrong visit shows
    lowrank, L0 = preds["adapter"].adapter, len(spec.geometry.moe_layers)
    g = torch.Generator().manual_seed(0)
    for (_, h), p in lowrank.pair_index.items():
        if h in (2 * L0, 3 * L0):
            lowrank.B.data[p] = torch.randn(lowrank.B.shape[1:], generator=g) * 3
    eng = GpuEngine(load_model(tiny_models["qwen3_moe"], dtype="float32"), ExpertStore(stores["qwen3_moe"], spec),
                    RunConfig(policy=Policy.parse("adapter+reuse"), pool_mib=64.0), device="cpu", predictors=preds,
                    reuse=gpu_reuse_table(spec, ["reuse"], ad))
    eng.configure(pool_mib=_pool_mib(eng, 0.25))
    calls = []
    real = reuse_mod.ReuseHistory.set_next_visits
    monkeypatch.setattr(reuse_mod.ReuseHistory, "set_next_visits",
                        lambda self, li, target, sets: (calls.append((li, target, [list(e) for e in sets])),
                                                        real(self, li, target, sets))[1])
    inputs = []   # each decode layer's router input (the heads read it; their rows are computed on the device)
    real_read = GraphRunner.read_routing

    def read_routing(self, li, with_input, plan=None):
        assert plan is not None and not with_input   # the folded heads on the device: no router input to the host
        row = real_read(self, li, with_input, plan)
        inputs.append((li, self.post[li].reshape(-1).float().clone()))
        return row
    monkeypatch.setattr(GraphRunner, "read_routing", read_routing)
    prompt = list(range(5, 17))
    g = eng.run(prompt, 6)
    L, k = eng.L, eng.k
    assert len(calls) == L * (len(g.tokens) - 1) == len(inputs)
    ad_pred = preds["adapter"]
    # the 2k largest, at most the layer's share of the pool (here less than 2k: the share binds)
    n_set = reuse_mod.next_visit_size(k, eng.E, eng.capacity, L)
    assert n_set == max(1, eng.capacity // L) < 2 * k
    for (li, _, sets), (li2, x) in zip(calls, inputs):
        assert li == li2 and len(sets) == 3   # three visits: the adapter's heads
        for j, experts in enumerate(sets, 1):
            # the n_set largest of visit j's head's logits (computed folded with the window, in one matmul:
            # rounding may differ in the last bit, so the set is checked against a margin)
            logits = ad_pred.next_visit_logits(x[None], li, j)[0]
            assert len(set(experts)) == n_set
            rest = [e for e in range(eng.E) if e not in experts]
            assert logits[experts].min() >= logits[rest].max() - 1e-4, (li, j, experts)
    assert sum(sets[0] != sets[1] or sets[1] != sets[2] for _, _, sets in calls) > len(calls) // 2
    # decode position p = len(prompt) + j, layer li: step p * L + li, its next visit L steps later
    assert [t for _, t, _ in calls] == [(len(prompt) + j) * L + li + L for j in range(len(g.tokens) - 1)
                                        for li in range(L)]
    calls.clear()
    eng.configure(next_visits=1)   # the first visit's head only
    assert eng.run(prompt, 6).tokens == g.tokens
    assert calls and all(len(sets) == 1 for _, _, sets in calls)
    eng.configure(next_visits=None)
    for changes in ({"next_visit": False}, {"policy": Policy.parse("adapter+prediction")}):
        calls.clear()
        eng.configure(**changes)
        assert eng.run(prompt, 6).tokens == g.tokens
        assert calls == [], changes


def test_planner_rows_from_the_device_decide_as_the_hosts_fold(tiny_models, stores, tiny_adapter, monkeypatch):
    """A folding planner's rows computed on the device (gpu_graph.DevicePlan: the window's sorted probabilities
    and the next-visit heads' sorted experts, copied back after the router) plan exactly as the host's fold does
    (PrefetchPlanner.plan on the router input read back instead): the same tokens, copies, prefetches, drops
    and evictions for the adapter with the reuse eviction and three, one or no next-visit heads, windows of one,
    two and every MoE layer (the first visit's row a window row too), the prediction eviction, next-gate, and the
    native scheduler, at pools that evict (on the CPU the device is the host: the same arithmetic, so equal
    decisions)."""
    from toolkit.runtime import planner as planner_mod
    from toolkit.runtime.gpu_bench import gpu_predictors, gpu_reuse_table

    spec = inspect_model_dir(tiny_models["qwen3_moe"])
    preds = gpu_predictors(spec, {"adapter", "next-gate"}, tiny_adapter)
    lowrank = preds["adapter"].adapter
    g = torch.Generator().manual_seed(1)
    for p in lowrank.pair_index.values():   # heads unlike one another, so a row taken for another shows
        lowrank.B.data[p] = torch.randn(lowrank.B.shape[1:], generator=g) * 3
    eng = GpuEngine(load_model(tiny_models["qwen3_moe"], dtype="float32"), ExpertStore(stores["qwen3_moe"], spec),
                    RunConfig(policy=Policy.parse("adapter+reuse"), pool_mib=64.0), device="cpu", predictors=preds,
                    reuse=gpu_reuse_table(spec, ["reuse"], tiny_adapter))
    sorted_calls = []
    real_sorted = planner_mod.PrefetchPlanner.plan_sorted
    monkeypatch.setattr(planner_mod.PrefetchPlanner, "plan_sorted",
                        lambda self, *a, **kw: (sorted_calls.append(a[1]), real_sorted(self, *a, **kw))[1])
    prompt = list(range(5, 17))
    cases = [dict(policy=Policy.parse("adapter+reuse")), dict(policy=Policy.parse("adapter+reuse"), window=1),
             # a window of every MoE layer: the first visit's horizon L is a window row too
             dict(policy=Policy.parse("adapter+reuse"), window=eng.L),
             dict(policy=Policy.parse("adapter+reuse"), next_visits=1),
             dict(policy=Policy.parse("adapter+reuse"), next_visit=False),
             dict(policy=Policy.parse("adapter+prediction")), dict(policy=Policy.parse("next-gate+prediction"))]
    if has_compiler():   # the native scheduler takes the rows through its plan_ranked
        cases.append(dict(policy=Policy.parse("adapter+reuse"), host="native"))
    for frac, changes in itertools.product((0.2, 0.45), cases):
        eng.configure(pool_mib=_pool_mib(eng, frac),
                      **{**dict(window=2, next_visits=None, next_visit=True, host="python"), **changes})
        got = []
        for on_device in (True, False):
            sorted_calls.clear()
            # plan="host": the host's fold, from the router's input read back (PrefetchPlanner.plan)
            eng.configure(plan="device" if on_device else "host")
            r = eng.run(prompt, 16)
            assert bool(sorted_calls) == on_device, changes
            j = r.to_json()
            got.append((r.tokens, {k: v for k, v in r.stats.counts.items() if k != "wait_s"}, j["evictions"],
                        j["wasted_prefetch_mib"], j["pcie_bytes_per_token"]))
        assert got[0] == got[1], (frac, changes)
        assert got[0][1]["prefetch_issued"] > 0 and got[0][2] > 0, (frac, changes)   # it planned; the pool evicted
    with pytest.raises(SpecPrefetchError, match="plan 'gpu': choose from device, inline, host"):
        eng.configure(plan="gpu")


@CUDA
@pytest.mark.parametrize("policy", POLICIES)
def test_tokens_match_transformers_cuda(tiny_models, stores, policy):
    prompt = list(range(5, 17))
    want = _reference(tiny_models["qwen3_moe"], prompt, 16, "cuda", "float16")
    eng = _engine(tiny_models["qwen3_moe"], stores["qwen3_moe"], policy, 0.1, "cuda", dtype="float16")
    for frac in (0.1, 0.5):
        eng.configure(pool_mib=_pool_mib(eng, frac))
        g = eng.run(prompt, 16, k=3)
        assert g.tokens == want, (policy, frac)
        assert g.to_json()["device"].startswith("cuda")


@CUDA
def test_cli_run_and_bench_on_cuda(tiny_models, stores, tmp_path):
    """`run --device cuda` and `bench gpu` end to end through the CLI."""
    from click.testing import CliRunner

    from toolkit.cli import main

    model = str(tiny_models["qwen3_moe"])
    r = CliRunner().invoke(main, ["run", model, "--device", "cuda", "--store", str(stores["qwen3_moe"]),
                                  "--policy", "draft+prediction", "--pool-mib", "0.1", "--prompt", "The kernel",
                                  "--max-new-tokens", "8", "--check", "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    j = json.loads((tmp_path / "r.json").read_text())
    assert j["runs"][0]["matches_unmodified_model"] is True and j["runs"][0]["device"].startswith("cuda")
    r = CliRunner().invoke(main, ["bench", "gpu", model, "--device", "cuda", "--store", str(stores["qwen3_moe"]),
                                  "--pool-fractions", "0.5", "--prompts", "1", "--new-tokens", "6", "--rounds", "1",
                                  "--prompt-tokens", "8", "--draft-k", "2,3", "--json", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "b.json").read_text())["tokens_match_transformers"] is True


@CUDA
def test_stream_order_on_cuda_with_a_lagging_compute_stream(tiny_models, stores, monkeypatch):
    """The compute stream lags far behind the host (a spin before every expert): slots are evicted and
    refilled while kernels that read them are still queued. Events must order it: same tokens."""
    from toolkit.runtime import gpu

    prompt = list(range(5, 17))
    want = _reference(tiny_models["qwen3_moe"], prompt, 12, "cuda", "float16")
    real = gpu.ExpertMath.__call__

    def slow(self, x, gate_up, down):
        torch.cuda._sleep(2_000_000)   # ~1 ms of GPU time before each expert
        return real(self, x, gate_up, down)

    monkeypatch.setattr(gpu.ExpertMath, "__call__", slow)
    for policy in ("on-demand+lru", "next-gate+prediction", "draft+prediction"):
        eng = _engine(tiny_models["qwen3_moe"], stores["qwen3_moe"], policy, 0.1, "cuda", dtype="float16")
        assert eng.run(prompt, 12, k=3).tokens == want, policy


@CUDA
def test_exact_verification_on_cuda_with_a_lagging_compute_stream(tiny_models, stores, monkeypatch):
    """The graph path's layer-major verification with the compute stream far behind the host (a spin
    before every segment): each row's slot numbers must still reach the graph that reads them (one
    pinned staging row per row: a shared one would hand an earlier row a later row's slots). The
    draft's tokens are the on-demand policy's."""
    prompt = list(range(5, 17))
    real = GraphRunner.run_segment

    def slow(self, s):
        torch.cuda._sleep(2_000_000)   # ~1 ms of GPU time before each segment
        return real(self, s)

    eng = _engine(tiny_models["qwen3_moe"], stores["qwen3_moe"], "on-demand+lru", 0.25, "cuda", dtype="float16")
    assert eng.decode == "graph" and eng.verify == "exact"
    want = eng.run(prompt, 12, k=3)
    monkeypatch.setattr(GraphRunner, "run_segment", slow)
    passes = []
    rows = GraphRunner.verify_rows
    monkeypatch.setattr(GraphRunner, "verify_rows", lambda self, s, t, p: passes.append(len(t)) or rows(self, s, t, p))
    eng.configure(policy=Policy.parse("draft+prediction"))
    g = eng.run(prompt, 12, k=3)
    assert g.tokens == want.tokens and max(passes) == 4
    n = len(want.routing)   # each row's experts its own (a later row's slots would route it on differently)
    assert [r.tolist() for r in g.routing[:n]] == [r.tolist() for r in want.routing]


def test_cli_device_is_validated(tiny_models, tmp_path):
    from click.testing import CliRunner

    from toolkit.cli import main

    r = CliRunner().invoke(main, ["run", str(tiny_models["qwen3_moe"]), "--device", "gpu0", "--prompt", "x",
                                  "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 2 and "expected cpu, cuda or cuda:N" in r.output
    if not torch.cuda.is_available():
        r = CliRunner().invoke(main, ["run", str(tiny_models["qwen3_moe"]), "--device", "cuda", "--policy", "on-demand",
                                      "--prompt", "x", "--json", str(tmp_path / "r.json")])
        assert r.exit_code == 2 and "CUDA is not available" in r.output


def test_cli_run_on_cuda_takes_no_next_visit(tiny_models, tmp_path, monkeypatch):
    """`run --device cuda --no-next-visit` reaches the GPU engine as next_visit=False (the GPU tier reads
    the heads); options the GPU tier ignores are still refused."""
    from click.testing import CliRunner

    from toolkit import engines
    from toolkit.cli import main

    seen = {}

    def fake(model, **kw):
        seen.update(kw)
        raise SpecPrefetchError("stop here")
    monkeypatch.setattr(engines, "gpu_engine", fake)
    base = ["run", str(tiny_models["qwen3_moe"]), "--device", "cuda", "--prompt", "x",
            "--json", str(tmp_path / "r.json")]
    for extra, want in (([], True), (["--no-next-visit"], False)):
        r = CliRunner().invoke(main, base + extra + ["--overwrite"])
        assert "stop here" in r.output and seen["next_visit"] is want, r.output
    assert seen["read_budget_kib"] is None and seen["copy_depth"] is None
    # the read budget and the queue depth (prefetch copies a step) reach the GPU tier
    r = CliRunner().invoke(main, base + ["--read-budget-kib", "64", "--queue-depth", "3", "--overwrite"])
    assert "stop here" in r.output and (seen["read_budget_kib"], seen["copy_depth"]) == (64, 3), r.output
    r = CliRunner().invoke(main, base + ["--threads", "2", "--overwrite"])
    assert r.exit_code != 0 and "--threads do not apply to the GPU tier" in r.output


def test_gpu_engine_takes_the_read_budget_and_copy_depth(tiny_models, stores):
    """`run --device cuda`'s engine (engines.gpu_engine, here on the CPU) with a pool of half the experts:
    a read budget of one slot a step drops prefetches as late and issues fewer; one prefetch copy a step
    issues fewer; a budget below one slot is refused."""
    from toolkit.engines import gpu_engine

    st = ExpertStore(stores["qwen3_moe"])
    half = st.num_layers * st.num_experts * st.blob_size / 2 / 2**20 + 1e-6
    slot_kib = -(-st.blob_size // 1024)

    def run(**kw):
        eng = gpu_engine(tiny_models["qwen3_moe"], device="cpu", policy="next-gate+prediction", adapter=None,
                         store_path=stores["qwen3_moe"], dtype=None, pool_mib=half, window=2, min_confidence=0.02,
                         draft_k=4, **kw)
        runs, _, _ = eng.generate(["x"], [list(range(5, 17))], 8, None)
        return runs[0]["counts"]

    free = run()
    assert free["prefetch_issued"] > 0 and free["dropped_late"] == 0
    late = run(read_budget_kib=slot_kib)
    assert late["dropped_late"] > 0 and late["prefetch_issued"] < free["prefetch_issued"]
    assert 0 < run(copy_depth=1)["prefetch_issued"] < free["prefetch_issued"]
    with pytest.raises(SpecPrefetchError, match=r"^--read-budget-kib \d+: below one expert slot"):
        run(read_budget_kib=slot_kib - 1)
    for bad in (0, True, 1.5):   # (True is an int to isinstance)
        with pytest.raises(SpecPrefetchError, match=rf"^--queue-depth {bad!r}: prefetch copies a step"):
            run(copy_depth=bad)


# -- the static-cache decoder (toolkit/runtime/gpu_graph.py) ---------------------------------------
@pytest.mark.parametrize("fam", ["qwen3_moe", "mixtral"])
def test_static_decoder_equals_the_models_forward(tiny_models, stores, fam):
    """The static-cache pass (own mask, rotary, KV writes at positions) gives the model's own logits,
    for a prefix and then rows appended at later positions (what verification does)."""
    from toolkit.runtime.gpu_graph import StaticKV

    eng = _engine(tiny_models[fam], stores[fam], "on-demand+lru", 1.0, "cpu")
    assert eng.decode == "static"
    eng.configure(pool_mib=_pool_mib(eng, 1.0))
    runner = eng._graph_runner(64)
    dec = runner.dec
    full = eng.model.model.embed_tokens.weight   # dtype probe
    ids = list(range(3, 23))

    def dense_experts(li, post, idx, scores):   # the model's own weights through the store's blobs
        return _ref_moe(eng, li, post, idx, scores)

    kv = StaticKV(len(dec.layers), dec.kv_heads, runner.S, dec.head_dim, "cpu", full.dtype)
    a = dec.forward_rows(torch.tensor(ids[:12]), 0, kv, dense_experts)
    b = dec.forward_rows(torch.tensor(ids[12:]), 12, kv, dense_experts)
    want = _model_logits(tiny_models[fam], ids)
    got = torch.cat([a, b])
    assert torch.allclose(got, want, atol=2e-4, rtol=1e-4), (got - want).abs().max()
    # one row at a time (the decode step's shape: the query heads of a K/V head read the cache in place)
    kv1 = StaticKV(len(dec.layers), dec.kv_heads, runner.S, dec.head_dim, "cpu", full.dtype)
    dec.forward_rows(torch.tensor(ids[:12]), 0, kv1, dense_experts)
    ones = torch.cat([dec.forward_rows(torch.tensor([t]), 12 + j, kv1, dense_experts) for j, t in enumerate(ids[12:])])
    assert torch.allclose(ones, want[12:], atol=2e-4, rtol=1e-4), (ones - want[12:]).abs().max()
    if dec.groups > 1:   # that one position's mask has the fold's query rows for real (no zero stride)
        m, _ = dec.prelude(torch.tensor([12]), torch.zeros(1, 1, dec.H))
        assert m.shape == (1, 1, dec.groups, runner.S) and m.is_contiguous()
    # a sequence whose runner the engine replaced (here: closed by hand) is refused before its prefill
    # copies anything into the arena
    seq = eng.sequence(ids[:6], 4)
    seq.runner.close()
    copies = seq.io.mark()
    with pytest.raises(SpecPrefetchError, match="closed graph runner"):
        eng.prefill(seq)
    assert seq.io.mark() == copies
    runner = eng._graph_runner(64)
    # a closed runner refuses in one line, at every way in
    runner.close()
    for call in (lambda: runner.segment(0), runner.ensure, runner.ensure_resident,
                 lambda: runner.decode(None, 1, 0), lambda: runner.decode_resident(None, 1, 0),
                 lambda: runner.verify_rows(None, [1], 0)):
        with pytest.raises(SpecPrefetchError, match="closed graph runner"):
            call()
    # a wrong position (the rows' keys written one place off) is not the model's output: the check bites
    kv2 = StaticKV(len(dec.layers), dec.kv_heads, runner.S, dec.head_dim, "cpu", full.dtype)
    dec.forward_rows(torch.tensor(ids[:12]), 0, kv2, dense_experts)
    c = dec.forward_rows(torch.tensor(ids[12:]), 13, kv2, dense_experts)
    assert not torch.allclose(c, want[12:], atol=1e-3)


def _ref_moe(eng, li, post, idx, scores):
    """MoE layer li from the store's fp16 blobs (the host tier), transformers' eager loop."""
    from toolkit.runtime.gpu import _eager_combine

    def contrib(e, x):
        gate_up, down = eng._weights(eng.host.blob((li, e)))
        return eng.math(x, gate_up, down)
    return _eager_combine(post, idx.tolist(), scores, contrib)


def _model_logits(model_dir, ids):
    lm = load_model(model_dir, dtype="float32")
    spec = lm.spec
    with torch.no_grad():
        for layer in spec.geometry.moe_layers:
            for p in spec.family.moe_block(lm.model, layer).experts.parameters():
                p.copy_(p.half().float())
        lm.model.config._experts_implementation = "eager"
        return lm.model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("fam", ["qwen3_moe", "mixtral"])
def test_decode_modes_give_the_same_tokens_and_counts(tiny_models, stores, fam):
    """The static decoder and transformers' modules decode the same tokens with the same copies: the
    pool and scheduler see the same requests in the same order."""
    prompt = list(range(5, 17))
    eng = _engine(tiny_models[fam], stores[fam], "next-gate+prediction", 0.25, "cpu")
    spec = inspect_model_dir(tiny_models[fam])
    st = ExpertStore(stores[fam], spec)
    bank = load_router_bank(spec)
    preds = {n: build_predictor(n, num_experts=spec.geometry.routing.num_experts, bank=lambda: bank)
             for n in ("next-gate", "oracle")}
    ref = GpuEngine(load_model(tiny_models[fam], dtype="float32"), st,
                    RunConfig(policy=Policy.parse("next-gate+prediction"), pool_mib=64.0), device="cpu",
                    predictors=preds, with_draft=True, decode="modules")
    for policy in ("on-demand+lru", "next-gate+prediction", "oracle+belady", "draft+prediction", "draft+lru"):
        for e in (eng, ref):
            e.configure(policy=Policy.parse(policy), pool_mib=_pool_mib(e, 0.25))
        a, b = eng.run(prompt, 14, k=3), ref.run(prompt, 14, k=3)
        assert a.extra["decode"] == "static" and b.extra["decode"] == "modules"
        assert a.tokens == b.tokens, policy
        if policy.startswith("draft"):   # exact verification: layer-major static, token steps modules
            a, b = _batched(eng, prompt, 14), _batched(ref, prompt, 14)
            assert a.tokens == b.tokens, policy
        assert a.stats.counts == b.stats.counts, policy
        assert a.stats.counts["bytes_read"] > 0, policy
        assert [r.tolist() for r in a.routing] == [r.tolist() for r in b.routing]
        if policy.startswith("draft"):
            assert a.extra["acceptance"] == b.extra["acceptance"] and a.extra["rounds"] == b.extra["rounds"]


def test_decode_option_is_validated(tiny_models, stores):
    spec = inspect_model_dir(tiny_models["olmoe"])
    st = build_store(spec, stores["qwen3_moe"].parent / "olmoe.spx", "fp16", progress=False)
    with pytest.raises(SpecPrefetchError, match="static-cache decoder covers"):
        GpuEngine(load_model(tiny_models["olmoe"]), ExpertStore(st, spec),
                  RunConfig(policy=Policy("on-demand", "lru"), pool_mib=1.0), device="cpu", decode="static")
    eng = GpuEngine(load_model(tiny_models["olmoe"]), ExpertStore(st, spec),
                    RunConfig(policy=Policy("on-demand", "lru"), pool_mib=1.0), device="cpu")
    assert eng.decode == "modules"      # families it does not cover keep transformers' modules
    assert (eng.attention, eng.router) == ("modules", "modules")
    for fam in ("deepseek_v2", "qwen3_vl_moe"):   # (modules the fused kernels' checks must not be reached for)
        spec = inspect_model_dir(tiny_models[fam])
        st = build_store(spec, stores["qwen3_moe"].parent / f"{fam}.spx", "fp16", progress=False)
        eng = GpuEngine(load_model(tiny_models[fam]), ExpertStore(st, spec),
                        RunConfig(policy=Policy("on-demand", "lru"), pool_mib=1.0), device="cpu")
        assert (eng.decode, eng.attention, eng.router) == ("modules", "modules", "modules"), fam
    if not torch.cuda.is_available():
        spec = inspect_model_dir(tiny_models["qwen3_moe"])
        with pytest.raises(SpecPrefetchError, match="CUDA graphs need"):
            GpuEngine(load_model(tiny_models["qwen3_moe"]), ExpertStore(stores["qwen3_moe"], spec),
                      RunConfig(policy=Policy("on-demand", "lru"), pool_mib=1.0), device="cpu", decode="graph")


def test_int4_fused_path_equals_the_eager_draft(tiny_models, stores):
    """The draft's device path (grouped int4 GEMV reference) computes what its eager loop computes."""
    from toolkit.runtime.gpu_kernels import dequant, int4_gemv_torch

    eng = _engine(tiny_models["qwen3_moe"], stores["qwen3_moe"], "draft+prediction", 0.5, "cpu")
    d = eng.drafts[1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, d.n_gu, generator=g)
    idx = torch.tensor([[5, 2]])
    w = torch.tensor([[0.7, 0.3]])
    assert torch.allclose(d.fused(x, idx, w), d(x, idx, w), atol=1e-4)
    # the GEMV against a dense matmul of the dequantized weights, per-expert inputs too
    xs = torch.randn(2, d.n_gu, generator=g)
    y = int4_gemv_torch(d.gu_q, d.gu_s, idx[0], xs, d.n_gu)
    for j, e in enumerate(idx[0].tolist()):
        wj = dequant(d.gu_q[e], d.gu_s[e], d.n_gu)
        assert torch.allclose(y[j], wj @ xs[j], atol=1e-4)


@CUDA
def test_triton_int4_kernel_matches_the_reference():
    from toolkit.runtime import gpu_kernels as K

    if K.triton is None:
        pytest.skip("no triton")
    g = torch.Generator(device="cuda").manual_seed(1)
    for E, O, n in ((8, 96, 64), (16, 3072, 1024), (4, 1000, 1536), (4, 70, 40)):
        P = (-(-n // 32) * 32) // 2
        q = torch.randint(0, 256, (E, O, P), dtype=torch.uint8, device="cuda", generator=g)
        s = torch.rand(E, O, 2 * P // 32, device="cuda", generator=g).half()
        ids = torch.randperm(E, device="cuda", generator=g)[:4]
        for rows in (1, 4):
            x = torch.randn(rows, n, device="cuda", generator=g).half()
            want = K.int4_gemv_torch(q, s, ids, x, n)
            got = K.int4_gemv(q, s, ids, x, n, use_triton=True)
            err = ((got - want).norm() / want.norm()).item()
            assert err < 1e-4, (E, O, n, rows, err)


TIMING = ("late", "wait_s")   # scheduler counts that depend on when a copy lands, not on what is copied


@CUDA
@pytest.mark.parametrize("fam", ["qwen3_moe", "mixtral"])
def test_graph_decode_equals_eager_static_on_cuda(tiny_models, stores, fam):
    """CUDA graphs replay what the eager static decoder computes: same tokens, same copies, every policy
    (the graphs' experts by the fused slot kernel, the eager decoder's by transformers' loop; both with the
    model's attention and router, which graph's default replaces with the fused kernels where they cover it)."""
    prompt = list(range(5, 17))
    want = _reference(tiny_models[fam], prompt, 16, "cuda", "float16")
    eng = _engine(tiny_models[fam], stores[fam], "on-demand+lru", 0.1, "cuda", dtype="float16", attention="sdpa",
                  router="model")
    spec = inspect_model_dir(tiny_models[fam])
    bank = load_router_bank(spec)
    preds = {n: build_predictor(n, num_experts=spec.geometry.routing.num_experts, bank=lambda: bank)
             for n in ("next-gate", "oracle")}
    ref = GpuEngine(load_model(tiny_models[fam], dtype="float16"), ExpertStore(stores[fam], spec),
                    RunConfig(policy=Policy.parse("on-demand+lru"), pool_mib=64.0), device="cuda", predictors=preds,
                    with_draft=True, decode="static")
    assert eng.decode == "graph" and ref.decode == "static"
    for policy in POLICIES:
        for frac in (0.1, 0.5):
            for e in (eng, ref):
                e.configure(policy=Policy.parse(policy), pool_mib=_pool_mib(e, frac))
            g, s = eng.run(prompt, 16, k=3), ref.run(prompt, 16, k=3)
            assert g.tokens == want == s.tokens, (fam, policy, frac)
            assert g.extra["decode"] == "graph"
            logical = lambda c: {k: v for k, v in c.items() if k not in TIMING}  # noqa: E731
            assert logical(g.stats.counts) == logical(s.stats.counts), (fam, policy, frac)
            assert g.stats.counts["bytes_read"] > 0
    # every expert resident, decoded as one graph per token (slots looked up on the device)
    eng.configure(policy=Policy.parse("on-demand+lru"), pool_mib=_pool_mib(eng, 1.0))
    assert eng.experts == "fused"
    for resident_graph in (False, True):
        assert eng.generate(prompt, 16, preload=True, resident_graph=resident_graph).tokens == want, resident_graph


# -- sliding-window models, cuda:N, the slot arena, the host reads, the report -------------------------
@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    """A tiny Mixtral whose sliding window (8) is shorter than the prompt (12): the prefill's
    config-built cache would keep only the last 7 positions of each layer."""
    from toolkit.models.tiny import build_tiny

    root = tmp_path_factory.mktemp("sliding")
    d = build_tiny("mixtral", root / "mixtral-sw8", seed=1, overrides={"sliding_window": 8})
    return d, build_store(inspect_model_dir(d), root / "mixtral-sw8.spx", "fp16", progress=False)


def test_sliding_window_static_decode(sliding, tiny_models):
    """The static path prefills into a full cache and windows in its mask: transformers' tokens, and the
    modules path's tokens and copies, for every policy; the window changes the tokens (the branch bites)."""
    d, store = sliding
    prompt = list(range(5, 17))
    want = _reference(d, prompt, 16, "cpu", "float32")
    assert want != _reference(tiny_models["mixtral"], prompt, 16, "cpu", "float32")   # same weights, no window
    eng = _engine(d, store, "on-demand+lru", 0.25, "cpu")
    spec = inspect_model_dir(d)
    bank = load_router_bank(spec)
    preds = {n: build_predictor(n, num_experts=spec.geometry.routing.num_experts, bank=lambda: bank)
             for n in ("next-gate", "oracle")}
    ref = GpuEngine(load_model(d, dtype="float32"), ExpertStore(store, spec),
                    RunConfig(policy=Policy.parse("on-demand+lru"), pool_mib=64.0), device="cpu", predictors=preds,
                    with_draft=True, decode="modules")
    assert eng.decode == "static"
    for policy in POLICIES:
        for e in (eng, ref):
            e.configure(policy=Policy.parse(policy), pool_mib=_pool_mib(e, 0.25))
        a, b = eng.run(prompt, 16, k=3), ref.run(prompt, 16, k=3)
        assert a.tokens == want == b.tokens, policy
        if policy.startswith("draft"):   # exact verification: layer-major static, token steps modules
            a, b = _batched(eng, prompt, 16), _batched(ref, prompt, 16)
            assert a.tokens == want == b.tokens, policy
        assert a.stats.counts == b.stats.counts, policy
    runner = next(iter(eng._runners.values()))
    assert runner.dec.window == 8
    m = runner.dec.mask(torch.tensor([11]), 16)[0, 0, 0]
    assert (m[4:12] == 0).all() and (m[:4] < 0).all() and (m[12:] < 0).all()   # keys 4..11 of position 11


@CUDA
@pytest.mark.parametrize("kernels", [("sdpa", "model"), ("fused", "fused")])
@pytest.mark.parametrize("fam", ["qwen3_moe", "mixtral", "mixtral-sw8"])
def test_compiled_step_on_cuda(tiny_models, stores, sliding, fam, kernels):
    """The static decoder's step through inductor on a GPU (its Triton kernels captured in the CUDA graphs),
    both families, a Mixtral whose sliding window is shorter than the prompt included, with the model's
    attention and router and with the fused ones: a pooled predictor's, the draft's and the
    device-resident token's tokens are transformers'."""
    d, store = sliding if fam == "mixtral-sw8" else (tiny_models[fam], stores[fam])
    prompt = list(range(5, 17))
    want = _reference(d, prompt, 12, "cuda", "float16")
    spec = inspect_model_dir(d)
    bank = load_router_bank(spec)
    preds = {"next-gate": build_predictor("next-gate", num_experts=spec.geometry.routing.num_experts,
                                          bank=lambda: bank)}
    eng = GpuEngine(load_model(d, dtype="float16"), ExpertStore(store, spec),
                    RunConfig(policy=Policy.parse("next-gate+prediction"), pool_mib=64.0), device="cuda",
                    predictors=preds, with_draft=True, compile="inductor", attention=kernels[0], router=kernels[1])
    assert eng.decode == "graph" and eng.compile == "inductor" and (eng.attention, eng.router) == kernels
    eng.configure(pool_mib=_pool_mib(eng, 0.25))
    assert eng.run(prompt, 12).tokens == want
    eng.configure(policy=Policy.parse("draft+prediction"))
    assert eng.run(prompt, 12, k=3).tokens == want
    eng.configure(policy=Policy.parse("on-demand+lru"), pool_mib=_pool_mib(eng, 1.0))
    assert eng.generate(prompt, 12, preload=True, resident_graph=True).tokens == want


def test_static_cache_refuses_a_truncated_prefill_cache(sliding):
    """A config-built (sliding-window) cache is refused with a clear error, not a shape error."""
    from transformers import DynamicCache

    d, store = sliding
    eng = _engine(d, store, "on-demand+lru", 0.5, "cpu")
    runner = eng._graph_runner(64)
    lm = load_model(d, dtype="float32")   # the unmodified model: the same K/V shapes
    cache = DynamicCache(config=lm.model.config)
    with torch.no_grad():
        lm.model(input_ids=torch.tensor([list(range(5, 17))]), past_key_values=cache, use_cache=True)
    with pytest.raises(SpecPrefetchError, match="full cache"):
        runner.kv.load(cache, 12)


def test_slot_arena_is_the_pools_own(tiny_models, stores):
    """Every run reads a slot allocation of exactly its pool (a small pool after the whole-model pool
    does not keep the large arena); the engine keeps the last two pool sizes' arenas, no more."""
    prompt = list(range(5, 17))
    for decode in ("static", "modules"):
        spec = inspect_model_dir(tiny_models["qwen3_moe"])
        eng = GpuEngine(load_model(tiny_models["qwen3_moe"], dtype="float32"), ExpertStore(stores["qwen3_moe"], spec),
                        RunConfig(policy=Policy.parse("on-demand+lru"), pool_mib=64.0), device="cpu", decode=decode)
        blob = eng.store.blob_size
        held, arenas = [], []
        for frac in (1.0, 0.1, 0.25, 0.1):
            eng.configure(pool_mib=_pool_mib(eng, frac))
            j = eng.run(prompt, 6).to_json()
            assert j["slot_arena_bytes"] == j["pool_slots"] * blob <= j["budget_bytes"], (decode, frac)
            held.append(j["slot_arenas_held_bytes"])
            arenas.append(j["slot_arena_bytes"])
        L, E = eng.L, eng.E
        small, mid = max(eng.k, int(0.1 * L * E)), max(eng.k, int(0.25 * L * E))
        assert arenas == [L * E * blob, small * blob, mid * blob, small * blob]
        if decode == "static":
            assert held == [L * E * blob, (L * E + small) * blob, (small + mid) * blob, (small + mid) * blob]
            assert sorted(eng._runners) == sorted({small, mid})
        else:   # one allocation per run, freed with it
            assert held == arenas


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_graph_decode_reads_the_device_once_per_layer(tiny_models, stores, monkeypatch, device):
    """Decode reads the router's choices (and, with a folding planner, its rows computed on the device:
    DevicePlan, one graph per MoE layer on a GPU) through staged copies and one wait per MoE layer, plus one
    for the token: no other read of the decoder's device buffers (.cpu(), .item(), .tolist(), .numpy() would
    each be a blocking sync on a GPU)."""
    prompt = list(range(5, 17))
    dtype = "float16" if device == "cuda" else "float32"
    eng = _engine(tiny_models["qwen3_moe"], stores["qwen3_moe"], "next-gate+prediction", 0.25, device, dtype=dtype)
    runner = eng._graph_runner(len(prompt) + 10 + 8 + 1)
    eng.run(prompt, 2)   # (the runner's DevicePlan for next-gate's fold, made by the first sequence, kept after)
    (dp,) = runner._plans.values()
    assert (dp.graphs is not None) == (device == "cuda")
    owned = {t.untyped_storage().data_ptr() for t in (runner.idx, runner.post, runner.tok, runner.h, runner.sel,
                                                       dp.conf, dp.ids)}
    for name in ("cpu", "item", "tolist", "numpy"):
        real = getattr(torch.Tensor, name)

        def guard(self, *a, _real=real, _name=name, **kw):
            if self.untyped_storage().data_ptr() in owned:
                raise AssertionError(f"{_name}() on the decoder's device buffer: a second host sync")
            return _real(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, guard)
    runner.host_waits = dp.waits = 0
    g = eng.run(prompt, 10)
    monkeypatch.undo()
    assert eng._graph_runner(len(prompt) + 10 + 8 + 1) is runner
    assert runner.host_waits == (eng.L + 1) * (len(g.tokens) - 1)
    # on a GPU the rows come on their own stream: one wait on their event per MoE layer, when planning
    assert dp.waits == (eng.L * (len(g.tokens) - 1) if device == "cuda" else 0)
    assert (dp.side is not None) == (device == "cuda") and dp.side is eng.dev.rows_stream
    # plan="inline": the same rows on the compute stream, waited for by the layer's sync alone; the same run.
    # Each layer's rows are computed on the rows' stream (on a GPU), else on the compute stream, and read the same
    # On a GPU each rows' computation and each segment start after a spin on their own streams (about 0.5 ms):
    # the rows land late, and the router they read too, so a missing wait (the host's on the rows' event, the
    # rows' stream's on the router's) would read stale rows, and the two runs would differ
    where, read = [], []
    real_run, real_rows = DevicePlan._run, DevicePlan.rows
    cuda = device == "cuda"
    cur = (lambda: torch.cuda.current_stream(dp.index)) if cuda else (lambda: None)
    spin = (lambda: torch.cuda._sleep(1_000_000)) if cuda else (lambda: None)
    monkeypatch.setattr(DevicePlan, "_run", lambda self, li: (where.append(cur()), spin(), real_run(self, li))[2])
    if cuda:   # launch=driver: the rows' graph launched after the same spin, on the stream the driver is given
        from toolkit.runtime.cuda_driver import Driver
        real_launch = Driver.launch

        def spun_launch(self, exe, stream):
            if exe in dp._exec:
                where.append(stream)
                with torch.cuda.stream(torch.cuda.ExternalStream(stream) if stream else torch.cuda.default_stream()):
                    spin()
            return real_launch(self, exe, stream)
        monkeypatch.setattr(Driver, "launch", spun_launch)
    monkeypatch.setattr(DevicePlan, "rows", lambda self, *a: (read.append(real_rows(self, *a)), read[-1])[1])
    monkeypatch.setattr(GraphRunner, "run_segment", lambda self, n, _real=GraphRunner.run_segment: (spin(),
                                                                                                    _real(self, n))[1])
    runs = []
    # (on a GPU with torch's calls and the driver's: launch=driver enqueues the rows through _enqueue_driver)
    for launch, plan in itertools.product(("torch", "driver") if cuda else ("torch",), ("device", "inline")):
        eng.configure(plan=plan, launch=launch)
        where.clear(), read.clear()
        runner.host_waits = dp.waits = 0
        r = eng.run(prompt, 10)
        runs.append((r.tokens, r.stats.counts["prefetch_issued"], r.to_json()["evictions"], list(read)))
        assert runner.host_waits == (eng.L + 1) * (len(r.tokens) - 1)
        apart = device == "cuda" and plan == "device"
        assert dp.apart == apart and dp.waits == (len(read) if apart else 0) and read
        handle = (lambda w: getattr(w, "cuda_stream", w))   # (the driver is given stream handles)
        assert all(handle(w) == handle(dp.side if apart else cur()) for w in where) and len(where) == len(read)
    monkeypatch.undo()
    assert all(r == runs[0] for r in runs) and runs[0][0] == g.tokens


def test_graph_decode_plans_behind_the_replay(tiny_models, stores, monkeypatch):
    """Decode plans a MoE layer's prefetches after it has enqueued the replay that computes that layer's
    experts (the host's planning overlaps the device), after reading each of them (data: the compute stream
    ordered after a copy still landing), and where they were all in the pool after their acquire too (else the
    acquire comes before the replay), the copy IO fenced from the layer's sync through
    its acquire and planning (a slot evicted then waits for no kernel) and not at the release (whose
    evictions may take this layer's own slots, which the replay reads); the decisions are those of the CPU
    runner's order (acquire, plan, release), as test_decode_modes_give_the_same_tokens_and_counts checks
    against the eager modules path."""
    from toolkit.runtime import planner as planner_mod
    from toolkit.runtime.scheduler import WindowScheduler

    prompt = list(range(5, 17))
    eng = _engine(tiny_models["qwen3_moe"], stores["qwen3_moe"], "next-gate+prediction", 0.25, "cpu")
    log = []
    real_seg, real_plan = GraphRunner.run_segment, planner_mod.PrefetchPlanner.plan_sorted
    real_release = WindowScheduler.release
    monkeypatch.setattr(GraphRunner, "run_segment", lambda self, s: (log.append(("segment", s)), real_seg(self, s))[1])

    real_acquire, real_data = WindowScheduler.acquire, WindowScheduler.data

    def data(self, key):
        log.append(("data", key))
        return real_data(self, key)

    def plan(self, sched, li, step, *a, **kw):
        log.append(("plan", li, sched.io.fenced))
        return real_plan(self, sched, li, step, *a, **kw)

    def acquire(self, step, keys):
        log.append(("acquire", self.io.fenced))
        return real_acquire(self, step, keys)

    def release(self, step, keys, **kw):
        log.append(("release", self.io.fenced))
        return real_release(self, step, keys, **kw)
    # (next-gate folds: its rows come from the device, planned by plan_sorted; plan itself is not called)
    monkeypatch.setattr(planner_mod.PrefetchPlanner, "plan_sorted", plan)
    monkeypatch.setattr(planner_mod.PrefetchPlanner, "plan", None)
    monkeypatch.setattr(WindowScheduler, "acquire", acquire)
    monkeypatch.setattr(WindowScheduler, "release", release)
    monkeypatch.setattr(WindowScheduler, "data", data)
    g = eng.run(prompt, 6)
    monkeypatch.undo()
    plans = [i for i, e in enumerate(log) if e[0] == "plan"]
    assert len(plans) == eng.L * (len(g.tokens) - 1)
    after = 0   # layers whose experts were all in the pool: acquired after their replay was enqueued
    for i in plans:
        li = log[i][1]
        seg = max(x for x in range(i) if log[x][0] == "segment")
        assert log[seg] == ("segment", li + 1), log[seg:i + 1]   # the layer's replay enqueued first
        # after the layer's experts were read, each (data: the compute stream ordered after a copy still landing)
        assert [e[0] for e in log[seg - eng.k:seg]] == ["data"] * eng.k, log[seg - eng.k - 1:seg + 1]
        assert {e[1][0] for e in log[seg - eng.k:seg]} == {li}
        assert all(e[0] == "acquire" for e in log[seg + 1:i]), log[seg:i + 1]   # (its all-hit acquire after it)
        after += seg + 1 < i
        assert log[i][2], "not fenced while planning"
        j = max(x for x in range(i) if log[x][0] == "acquire")
        assert log[j][1], "not fenced from the sync: the layer's acquire"
    assert not any(e[0] == "release" and e[1] for e in log), "the fence outlived the planning"
    assert 0 < after < len(plans), after   # both orders ran: all hits, and a miss acquired before the replay


def test_copy_io_orders_a_slots_reuse_itself(monkeypatch):
    """CudaCopyIO's stream ordering, with a stand-in CUDA device (events and streams that record): a copy
    into a slot waits for every incomplete event of the slot's last use: the evicted key's own copy (it
    may still be in flight on the other stream, which is why the scheduler need not wait for it:
    orders_reuse) and, unless fenced (GraphRunner.decode between its sync and the release, when every
    reader of such a slot has run), an event recorded at the eviction."""
    from toolkit.runtime import gpu

    class Event:
        def __init__(self, name, done=False):
            self.name, self.done = name, done

        def query(self):
            return self.done

    class Stream:
        def __init__(self):
            self.waits = []

        def wait_event(self, ev):
            self.waits.append(ev.name)

    class Dev:
        cuda = True
        device = "cuda:0"
        index = 0

        def __init__(self):
            self.demand_stream, self.copy_stream, self.n = Stream(), Stream(), 0

        def event(self, stream=None):
            self.n += 1
            return Event(f"e{self.n}")

    class Host:
        def blob(self, key):
            return torch.full((4,), float(key[1]))

    current = ["compute"]   # the current stream: each copy is issued with its stream current, then restored
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "set_stream", current.append)
    dev = Dev()
    io = gpu.CudaCopyIO(Host(), 1, dev, slots=torch.zeros(1, 4))
    assert io.orders_reuse
    io.submit((0, 1), demand=False)               # a prefetch in flight: its end event is "e2"
    assert io.last_use[0] == () and dev.copy_stream.waits == []
    io.fenced = True
    io.release((0, 1))                              # evicted while fenced: its copy only
    assert [e.name for e in io.last_use[0]] == ["e2"]
    io.submit((0, 2), demand=True)                  # a demand copy into the slot (the other stream) waits for it
    assert dev.demand_stream.waits == ["e2"] and dev.copy_stream.waits == []
    io.fenced = False
    io.release((0, 2))                              # not fenced: an event now, and the slot's copy ("e4")
    assert [e.name for e in io.last_use[0]] == ["e5", "e4"]
    io.last_use[0][1].done = True                   # that copy landed: not waited for
    io.submit((0, 3), demand=False)
    assert dev.copy_stream.waits == ["e5"] and torch.equal(io.views[io.where[(0, 3)]], torch.full((4,), 3.0))
    assert current[1:] == [dev.copy_stream, "compute", dev.demand_stream, "compute", dev.copy_stream, "compute"]
    io.host.blob = lambda key: torch.zeros(5)   # a copy that fails: the current stream is restored all the same
    io.release((0, 3))
    with pytest.raises(RuntimeError):
        io.submit((0, 4), demand=False)
    assert current[-2:] == [dev.copy_stream, "compute"]


def _timed_originals():
    from toolkit.runtime.scheduler import WindowScheduler
    return (GraphRunner.decode, GraphRunner.host_wait, GraphRunner.run_segment, GraphRunner.read_routing,
            GpuEngine.generate, WindowScheduler.acquire)


def test_host_timing_counts_the_per_layer_calls(tiny_models, stores, tiny_adapter, tmp_path, capsys, request,
                                                monkeypatch):
    """`python -m toolkit.runtime.host_timing` (the GPU bench with the host's per-layer calls timed): the
    bench runs and writes its report, and every timed call is counted where it runs: one routing read and
    one plan per MoE layer of each decoded token (a folding planner's from the device's rows: plan_sorted),
    the eviction's victims, the copies (through the native copy IO apart: the stand-in driver's)."""
    from toolkit.runtime import cuda_driver, host_timing

    originals = _timed_originals()
    with host_timing.installed() as (secs, calls, tl):
        assert _timed_originals()[0] is not originals[0]
        eng = _engine(tiny_models["qwen3_moe"], stores["qwen3_moe"], "next-gate+prediction", 0.25, "cpu")
        if has_compiler():   # the native copy IO's copies (the stand-in driver's), labelled apart
            drv = cuda_driver.Driver(request.getfixturevalue("cuda_standin"))
            with monkeypatch.context() as m:
                m.setattr(GpuEngine, "_driver", lambda self: drv)
                gn = eng.run(list(range(5, 17)), 6)
            assert calls["submit_native"] >= gn.stats.counts["prefetch_issued"] + gn.stats.counts["misses"] > 0
            assert not calls["submit"]
            calls.clear()
            secs.clear()
            tl.kinds.clear()
        g = eng.run(list(range(5, 17)), 6)
    assert calls["read_routing"] == eng.L * (len(g.tokens) - 1) == calls["plan_sorted"] and not calls["plan"]
    # the timeline: each decoded token of the run (the first comes from the prefill), each of its MoE layers'
    # syncs followed by a segment's launch, and each token after the first its boundary's
    (label, c), = tl.kinds.items()
    assert label == f"next-gate+prediction, {eng.cfg.pool_mib:g} MiB", label
    eng.configure(copy_depth=3, plan="inline", window=1, launch="torch")   # (settings apart from the defaults)
    assert tl.label(eng) == (f"next-gate+prediction, {eng.cfg.pool_mib:g} MiB, window=1, queue_depth=3, "
                             "plan=inline, launch=torch")
    assert c["tokens"] == len(g.tokens) - 1 and c["idles"] == eng.L * c["tokens"] and c["edges"] == c["tokens"] - 1
    assert calls["acquire"] == calls["release"] > calls["read_routing"]   # the prefill's steps too
    assert calls["submit"] >= g.stats.counts["prefetch_issued"] + g.stats.counts["misses"] > 0   # (decode counted)
    assert calls["victim"] > 0 and calls["plan_ranked"] == calls["plan_sorted"]   # (it ranks through plan_ranked)
    assert _timed_originals() == originals   # restored
    out = tmp_path / "b.json"
    host_timing.main([tiny_models["qwen3_moe"].as_posix(), "--store", stores["qwen3_moe"].as_posix(), "--adapter",
                      tiny_adapter.as_posix(), "--device", "cpu", "--policies", "adapter+reuse", "--fractions", "0.25",
                      "--prompts", "1", "--prompt-tokens", "8", "--new-tokens", "4", "--repeats", "1", "--json",
                      out.as_posix()])
    assert json.loads(out.read_text())["rows"][0]["policy"] == "adapter+reuse"
    printed = capsys.readouterr().out.splitlines()
    lines = {ln.split()[0]: ln.split() for ln in printed if "us a call" in ln}
    assert {"acquire", "release", "plan_sorted", "plan_ranked", "victim", "read_routing", "submit"} <= set(lines)
    assert all(int(v[1]) > 0 and float(v[3]) > 0 for v in lines.values()), lines
    tokens = [ln for ln in printed if "us a layer" in ln]
    assert any(ln.startswith("adapter+reuse, ") and "(resident)" not in ln for ln in tokens), tokens
    assert any(ln.startswith("on-demand+lru, ") and ln.split(":")[0].endswith("(resident)") for ln in tokens), tokens
    assert any(ln.startswith("adapter+reuse, ") and "next_visit=False" in ln for ln in tokens), tokens
    assert _timed_originals() == originals


def test_host_timing_timeline_accounting():
    """Timeline.token on made-up marks: the syncs' waits, each gap from a sync to the next launch call (the
    first launch of a token with no sync before it counts nothing), and the token boundary of the same
    sequence (not of another); report() skips labels without tokens."""
    from toolkit.runtime.host_timing import Timeline

    tl = Timeline()
    tl.marks = [("launch", 0.0), ("wait", 1.0), ("waited", 3.0), ("launch", 3.5), ("wait", 4.0), ("waited", 4.25),
                ("launch", 5.0), ("wait", 6.0), ("waited", 7.0)]
    tl.token("a", 1, 0.0, 7.5)
    c = tl.kinds["a"]
    assert (c["tokens"], c["wall"], c["wait"], c["idle"], c["idles"], c["edges"]) == (1, 7.5, 3.25, 1.25, 2, 0)
    tl.marks = [("launch", 8.0), ("wait", 9.0), ("waited", 9.5)]
    tl.token("a", 1, 7.8, 9.6)   # the same sequence: its first launch is 1.0 after the last token's last sync
    assert (c["edge"], c["edges"], c["idles"]) == (1.0, 1, 2)
    tl.marks = [("launch", 10.0), ("wait", 11.0), ("waited", 12.0)]
    tl.token("b", 2, 9.9, 12.1)  # another sequence: no boundary
    assert tl.kinds["b"]["edges"] == 0 and tl.kinds["b"]["idles"] == 0
    tl.kinds["empty"]    # (a label read but never filled)
    lines = tl.report().splitlines()
    assert len(lines) == 2 and lines[0].startswith("a: 2 tokens") and "625000.0 us a layer" in lines[0], lines


@CUDA
@pytest.mark.parametrize("lagging", ["compute", "copy"])
def test_graph_decode_plans_behind_a_lagging_stream(tiny_models, stores, monkeypatch, lagging):
    """The graph decode with planning policies while one stream is far behind the host (a spin of ~1 ms
    on it): `compute`, at the start of every segment (captured into its graph), so planning runs while
    replays are queued and its copies into evicted slots wait for no kernel (fenced); `copy`, before each
    prefetch, so slots are evicted while their copies are in flight (the scheduler does not wait for them)
    and a demand copy on the other stream may take the slot, ordered by the old copy's event alone. The
    same tokens either way."""
    from toolkit.runtime import gpu

    prompt = list(range(5, 17))
    want = _reference(tiny_models["qwen3_moe"], prompt, 12, "cuda", "float16")
    if lagging == "compute":
        real_seg = GraphRunner._segment

        def seg(self, s, *a, **kw):
            torch.cuda._sleep(2_000_000)
            return real_seg(self, s, *a, **kw)
        monkeypatch.setattr(GraphRunner, "_segment", seg)
    else:
        from toolkit.runtime.native_io import NativeCopyIO

        for io in (gpu.CudaCopyIO, NativeCopyIO):   # (torch's calls, the driver's)
            def submit(self, key, *, demand, _real=io.submit):
                if not demand:
                    with torch.cuda.stream(self.dev.copy_stream):
                        torch.cuda._sleep(2_000_000)
                return _real(self, key, demand=demand)
            monkeypatch.setattr(io, "submit", submit)
    eng = _engine(tiny_models["qwen3_moe"], stores["qwen3_moe"], "next-gate+prediction", 0.1, "cuda", dtype="float16")
    for policy in ("next-gate+prediction", "oracle+belady"):
        eng.configure(policy=Policy.parse(policy))
        assert eng.run(prompt, 12).tokens == want, policy


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_second_cuda_device(tiny_models, stores):
    """cuda:N with N > 0: graphs, copies and the int4 kernel run on that device, not the current one."""
    prompt = list(range(5, 17))
    n = torch.cuda.device_count() - 1
    want = _reference(tiny_models["qwen3_moe"], prompt, 12, "cuda:0", "float16")
    assert torch.cuda.current_device() == 0
    eng = _engine(tiny_models["qwen3_moe"], stores["qwen3_moe"], "draft+prediction", 0.25, f"cuda:{n}", dtype="float16")
    assert eng.decode == "graph"
    for policy in ("on-demand+lru", "next-gate+prediction", "draft+prediction"):
        eng.configure(policy=Policy.parse(policy))
        g = eng.run(prompt, 12, k=3)
        assert g.tokens == want, policy
        assert g.extra["device"] == f"cuda:{n}"
    assert torch.cuda.current_device() == 0


def test_hbm_floor_counts_one_embedding_row(tiny_models, stores):
    from toolkit.runtime.gpu_bench import token_read_bytes

    eng = _engine(tiny_models["qwen3_moe"], stores["qwen3_moe"], "on-demand+lru", 0.5, "cpu")
    emb = eng.model.get_input_embeddings().weight
    head = eng.model.get_output_embeddings().weight
    V, H = emb.shape
    es = emb.element_size()
    table = 0 if head.data_ptr() == emb.data_ptr() else V * H * es
    assert token_read_bytes(eng) == eng.dense_bytes - table + H * es + eng.L * eng.k * eng.store.blob_size
    assert token_read_bytes(eng) < eng.dense_bytes + eng.L * eng.k * eng.store.blob_size


def test_markdown_flags_differing_tokens(tiny_models, stores):
    from toolkit.runtime.gpu_bench import markdown, run_gpu_bench
    from toolkit.runtime.policy import parse_policies

    r = run_gpu_bench(tiny_models["qwen3_moe"], store=stores["qwen3_moe"], adapter=None,
                      policies=parse_policies("on-demand+lru"), fractions=[0.25], prompts=1, prompt_tokens=8,
                      new_tokens=4, repeats=1, ks=(2,), device="cpu", decode="modules", log=lambda s: None)
    assert r["decode"] == "modules" and r["rows"][0]["slot_arena_mib"] <= r["rows"][0]["pool_mib"]
    assert "TOKENS DIFFER" not in markdown(r)
    bad = dict(r, tokens_match_transformers=False, mismatches=["on-demand+lru pool 1 MiB prompt 0"])
    first = markdown(bad).splitlines()[0]
    assert "TOKENS DIFFER" in first and "1 run(s)" in first and "diagnosis only" in first


def test_cli_bench_cuda_options_pass_through(tiny_models, stores, tmp_path, monkeypatch):
    """`bench gpu --decode D --experts X --report-mismatches --variant V` reaches run_gpu_bench; --decode and
    --variant are validated (a bad variant in one line, before anything is claimed), and none of them exists
    in `bench cpu`."""
    from click.testing import CliRunner

    from toolkit.cli import main
    from toolkit.runtime import gpu_bench

    seen = {}

    def fake(model, **kw):
        seen.update(kw)
        return {"fake": True}

    monkeypatch.setattr(gpu_bench, "run_gpu_bench", fake)
    monkeypatch.setattr(gpu_bench, "write", lambda r, out: None)
    monkeypatch.setattr(gpu_bench, "markdown", lambda r: "table")
    model = str(tiny_models["qwen3_moe"])
    base = ["bench", "gpu", model, "--store", str(stores["qwen3_moe"]), "--json", str(tmp_path / "b.json")]
    r = CliRunner().invoke(main, base + ["--decode", "static", "--experts", "fused", "--report-mismatches",
                                         "--profile-resident", "--compile", "aot_eager", "--attention", "sdpa"])
    assert r.exit_code == 0, r.output
    assert seen["decode"] == "static" and seen["experts"] == "fused" and seen["strict"] is False
    assert seen["attention"] == "sdpa" and seen["router"] is None
    assert seen["profile"] is True and seen["compile"] == "aot_eager"
    seen.clear()
    r = CliRunner().invoke(main, base + ["--overwrite"])
    assert r.exit_code == 0, r.output
    assert seen["decode"] is None and seen["experts"] is None and seen["strict"] is True and not seen["profile"]
    assert seen["attention"] is None and seen["router"] is None
    assert seen["compile"] is None and seen["variants"] == ()
    r = CliRunner().invoke(main, base + ["--variant", "window=1", "--variant", "read_budget_kib=64,queue_depth=2",
                                         "--overwrite"])
    assert r.exit_code == 0 and seen["variants"] == ("window=1", "read_budget_kib=64,queue_depth=2"), r.output
    # a bad --variant: one line naming it, refused before the report is claimed: --json names a file that is
    # no report (claim would refuse it, even with --overwrite), yet the error is the variant's, and the file stays
    seen.clear()
    other = tmp_path / "v.json"
    other.write_text("not a report")
    r = CliRunner().invoke(main, ["bench", "gpu", model, "--variant", "pace=2", "--json", str(other), "--overwrite"])
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert r.exit_code != 0 and len(lines) == 1 and lines[0].startswith("error: --variant pace=2"), r.output
    assert not seen and other.read_text() == "not a report"
    r = CliRunner().invoke(main, ["bench", "gpu", model, "--variant", "window=1", "--json", str(other), "--overwrite"])
    assert r.exit_code != 0 and "--variant" not in r.output and not seen, r.output   # claim's refusal, then
    r = CliRunner().invoke(main, base + ["--decode", "fast", "--overwrite"])
    assert r.exit_code == 2 and "fast" in r.output
    for extra in (["--decode", "graph"], ["--experts", "fused"], ["--report-mismatches"], ["--profile-resident"],
                  ["--compile", "inductor"], ["--variant", "window=1"], ["--attention", "fused"],
                  ["--router", "fused"]):
        r = CliRunner().invoke(main, ["bench", "cpu", model, "--json", str(tmp_path / "c.json"), *extra])
        assert r.exit_code == 2 and "No such option" in r.output and extra[0] in r.output, r.output


# -- the fused expert GEMV and the device-resident decode --------------------------------------------
@pytest.mark.parametrize("fam", ["qwen3_moe", "mixtral"])
def test_fused_experts_and_the_device_resident_decode(tiny_models, stores, fam, monkeypatch):
    """The fused expert path (slots read in place: its torch reference on the CPU) decodes the eager
    path's tokens with the same copies; with every expert resident, the device-only decode (slots
    looked up on the device, one host wait per token) gives the same tokens and routing as the
    host-synced one."""
    prompt = list(range(5, 17))
    spec = inspect_model_dir(tiny_models[fam])
    bank = load_router_bank(spec)
    E = spec.geometry.routing.num_experts
    preds = {"next-gate": build_predictor("next-gate", num_experts=E, bank=lambda: bank)}
    fused = GpuEngine(load_model(tiny_models[fam], dtype="float32"), ExpertStore(stores[fam], spec),
                      RunConfig(policy=Policy.parse("on-demand+lru"), pool_mib=64.0), device="cpu",
                      predictors=preds, experts="fused")
    eager = _engine(tiny_models[fam], stores[fam], "on-demand+lru", 0.25, "cpu")
    assert (fused.experts, eager.experts) == ("fused", "eager")
    for policy in ("on-demand+lru", "next-gate+prediction"):
        for e in (fused, eager):
            e.configure(policy=Policy.parse(policy), pool_mib=_pool_mib(e, 0.25))
        a, b = fused.run(prompt, 14), eager.run(prompt, 14)
        assert a.tokens == b.tokens, policy
        assert a.stats.counts == b.stats.counts and a.stats.counts["bytes_read"] > 0, policy
    fused.configure(policy=Policy.parse("on-demand+lru"), pool_mib=_pool_mib(fused, 1.0))
    # slots handed out in a shuffled order, so the device's slot table is not the identity
    import random

    from toolkit.runtime.gpu import CudaCopyIO
    real_init = CudaCopyIO.__init__

    def shuffled(self, *a, **kw):
        real_init(self, *a, **kw)
        random.Random(3).shuffle(self.free)
    monkeypatch.setattr(CudaCopyIO, "__init__", shuffled)
    synced = fused.generate(prompt, 14, preload=True)
    runner = fused._graph_runner(len(prompt) + 14 + 8 + 1)
    runner.host_waits = 0
    alone = fused.generate(prompt, 14, preload=True, resident_graph=True)
    assert alone.tokens == synced.tokens == b.tokens
    assert [r.tolist() for r in alone.routing] == [r.tolist() for r in synced.routing]
    assert runner.host_waits == len(alone.tokens) - 1            # one per decoded token, none per layer
    L, E = fused.L, fused.E
    table = runner.slot_of.tolist()
    assert sorted(s for row in table for s in row) == list(range(L * E))
    assert table != [list(range(li * E, (li + 1) * E)) for li in range(L)]   # shuffled: a real lookup
    assert alone.stats.counts["bytes_read"] == 0 and alone.stats.counts["requests"] == 0   # no pool, no copies
    with pytest.raises(SpecPrefetchError, match="needs preload"):
        fused.generate(prompt, 4, resident_graph=True)
    fused.configure(policy=Policy.parse("next-gate+prediction"))
    with pytest.raises(SpecPrefetchError, match="on-demand policy"):
        fused.generate(prompt, 4, preload=True, resident_graph=True)


@pytest.mark.parametrize("fam,experts", [("qwen3_moe", "fused"),
                                         pytest.param("qwen3_moe", "eager", marks=pytest.mark.slow),
                                         pytest.param("mixtral", "fused", marks=pytest.mark.slow)])
def test_compiled_step_decodes_as_the_eager_one(tiny_models, stores, fam, experts):
    """`compile`: the static decoder's pieces (each segment, the resident token, the draft's step) go
    through torch.compile whole (here its tracing without code generation, aot_eager: the graph capture,
    functionalised buffer and cache writes, the custom GEMV operators and the dynamic arena size of the
    inductor path, on the CPU), with either expert math, and decode what the eager step decodes: tokens
    and routing for a pooled policy, the draft and the device-resident token; one graph per piece, none
    again for another pool size, and no entry fell back to eager. The option is validated."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    prompt = list(range(5, 17))
    spec = inspect_model_dir(tiny_models[fam])
    st = ExpertStore(stores[fam], spec)
    bank = load_router_bank(spec)
    preds = {"next-gate": build_predictor("next-gate", num_experts=spec.geometry.routing.num_experts,
                                          bank=lambda: bank)}
    torch._dynamo.reset()
    counters.clear()
    engines = {c: GpuEngine(load_model(tiny_models[fam], dtype="float32"), st,
                            RunConfig(policy=Policy.parse("next-gate+prediction"), pool_mib=64.0), device="cpu",
                            predictors=preds, with_draft=True, compile=c, experts=experts)
               for c in (None, "aot_eager")}
    out, graphs = {}, 0
    for c, e in engines.items():
        e.configure(pool_mib=_pool_mib(e, 0.25))
        a = e.generate(prompt, 10)
        e.configure(policy=Policy.parse("draft+prediction"))
        d = e.generate(prompt, 10, k=3)
        e.configure(policy=Policy.parse("on-demand+lru"), pool_mib=_pool_mib(e, 1.0))
        r = e.generate(prompt, 10, preload=True, resident_graph=True)
        graphs = counters["stats"]["unique_graphs"]
        e.configure(policy=Policy.parse("next-gate+prediction"), pool_mib=_pool_mib(e, 0.5))
        b = e.generate(prompt, 10)       # another pool size: another arena, the same compiled code
        out[c] = [(g.tokens, [x.tolist() for x in g.routing]) for g in (a, d, r, b)]
    assert out["aot_eager"] == out[None]
    # each segment, the resident token and the draft's step: one graph each, whatever the arena's size
    L = engines["aot_eager"].L
    assert counters["stats"]["unique_graphs"] == graphs == L + 3, dict(counters["stats"])
    # every graph dynamo captured went through the backend (fullgraph: a break or a recompile limit hit
    # would have raised, not run eagerly)
    assert counters["aot_autograd"]["total"] == counters["aot_autograd"]["ok"] == L + 3, dict(counters)
    import torch._dynamo.config as dcfg
    assert dcfg.recompile_limit == 8   # dynamo's global limit untouched (each compiled function has its own)
    with pytest.raises(SpecPrefetchError, match="expected inductor or aot_eager"):
        GpuEngine(load_model(tiny_models[fam]), st, RunConfig(policy=Policy("on-demand", "lru"),
                  pool_mib=1.0), device="cpu", compile="tvm")
    with pytest.raises(SpecPrefetchError, match="--decode graph or static"):
        GpuEngine(load_model(tiny_models[fam]), st, RunConfig(policy=Policy("on-demand", "lru"),
                  pool_mib=1.0), device="cpu", decode="modules", compile="inductor")


def test_the_compiled_steps_rewrites(tiny_models, stores):
    """What the compiled step changes besides fusing: the routers' top-k as a stable sort (the same values
    and order; an exact tie to the lower index; other shapes left to inductor), their one-row GEMV as fp32
    products rounded once (only one row by a narrow half-precision matrix), and each layer's q, k and v
    projections as one weight the modules' parameters are views of (the same values, no second copy,
    shared by every runner of the engine)."""
    from toolkit.runtime.gpu_graph import row_times_narrow, topk_by_sort

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 32, generator=g)
    assert all(torch.equal(a, b) for a, b in zip(topk_by_sort(x, 4), torch.topk(x, 4)))
    assert topk_by_sort(torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]]), 2)[1].tolist() == [[1, 2]]
    assert topk_by_sort(x, 4, largest=False) is NotImplemented
    assert topk_by_sort(torch.randn(1, 2048), 4) is NotImplemented
    a, b = torch.randn(1, 64, generator=g).half(), torch.randn(64, 32, generator=g).half()
    got = row_times_narrow(a, b)
    assert got.dtype == torch.float16 and got.shape == (1, 32)
    exact = a.double() @ b.double()
    assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -10 + 2 ** -24).all()   # within an fp16 rounding
    for bad in ((torch.randn(2, 64).half(), b), (a, torch.randn(64, 256).half()), (a.float(), b.float())):
        assert row_times_narrow(*bad) is NotImplemented
    # the fused q/k/v weight
    spec = inspect_model_dir(tiny_models["qwen3_moe"])
    eng = GpuEngine(load_model(tiny_models["qwen3_moe"], dtype="float32"), ExpertStore(stores["qwen3_moe"], spec),
                    RunConfig(policy=Policy.parse("on-demand+lru"), pool_mib=64.0), device="cpu")
    sa = eng.model.model.layers[0].self_attn
    before = [p.weight.detach().clone() for p in (sa.q_proj, sa.k_proj, sa.v_proj)]
    dec = StaticDecoder(eng)
    fused = dec.qkv[0]
    assert torch.equal(fused.weight, torch.cat(before))
    assert all(torch.equal(p.weight, w) for p, w in zip((sa.q_proj, sa.k_proj, sa.v_proj), before))
    assert sa.q_proj.weight.data_ptr() == fused.weight.data_ptr()          # views, not copies
    assert sa.k_proj.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
    assert StaticDecoder(eng).qkv[0] is fused                              # made once per model
    sa.k_proj.weight.data = sa.k_proj.weight.detach().clone()              # rebound since: made again
    assert StaticDecoder(eng).qkv[0] is not fused


def test_the_decompositions_fall_back_to_inductors_own():
    """Where topk_by_sort or row_times_narrow declines, `_inductor`'s table entry hands the call to what
    inductor's own table had for the op (and keeps the op where it had nothing)."""
    from toolkit.runtime.gpu_graph import _first_of, row_times_narrow, topk_by_sort

    seen = []

    def theirs(*a, **k):
        seen.append(tuple(a[0].shape))
        return "theirs"
    b = torch.randn(64, 32).half()
    assert torch.is_tensor(_first_of(row_times_narrow, theirs, torch.randn(1, 64).half(), b)) and seen == []
    assert _first_of(row_times_narrow, theirs, torch.randn(2, 64).half(), b) == "theirs" and seen == [(2, 64)]
    assert _first_of(topk_by_sort, None, torch.randn(1, 32), 4, largest=False) is NotImplemented


def test_the_custom_operators():
    """The GEMVs' custom operators pass torch's operator checks (schema, fake tensors, dispatch: what
    torch.compile relies on) with one or k input rows, gated or not; their fake implementations refuse a
    wrong input width at trace time."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import toolkit.runtime.gpu_kernels  # noqa: F401  (registers the operators)

    g = torch.Generator().manual_seed(4)
    w = torch.randn(6, 12, 16, generator=g).half()
    slots = torch.tensor([4, 1, 3])
    for dt in (torch.float16, torch.float32):
        for rows in (1, 3):
            for gated, glu, pre, late in ((False, False, False, False), (True, False, True, False),
                                          (False, True, False, True), (False, False, True, True)):
                x = torch.randn(rows, 32 if gated else 16, generator=g).to(dt)
                torch.library.opcheck(torch.ops.specprefetch.slot_gemv, (w, slots, x, gated, glu, pre, late))
            assert torch.ops.specprefetch.slot_gemv(w, slots, x, False, True, False, True).shape == (3, 6)
    q = torch.randint(0, 256, (5, 8, 16), dtype=torch.uint8, generator=g)
    sc = torch.rand(5, 8, 1, generator=g).half()
    torch.library.opcheck(torch.ops.specprefetch.int4_gemv, (q, sc, torch.tensor([2, 0]), torch.randn(1, 32), 32))
    with FakeTensorMode() as mode, pytest.raises(Exception, match="width"):
        fw, fs, fx = mode.from_tensor(w), mode.from_tensor(slots), mode.from_tensor(torch.randn(1, 17).half())
        torch.ops.specprefetch.slot_gemv(fw, fs, fx, False, False, False, False)


@pytest.mark.slow   # inductor's CPU code generation: about 30 s on a cold cache (make test-all)
def test_the_inductor_backend_decompositions(monkeypatch):
    """The inductor backend (on the CPU here: C++ instead of Triton) compiles a router's GEMV, softmax
    and top-k through topk_by_sort and row_times_narrow and gives what the eager router gives; where the
    mm decomposition declines (two rows) inductor's own decomposition of mm takes the call."""
    import torch._inductor.decomposition as idec

    from toolkit.runtime import gpu_graph

    g = torch.Generator().manual_seed(4)
    calls = {"topk": 0, "mm": 0}

    def counted(name, fn):
        def f(*a, **k):
            out = fn(*a, **k)
            calls[name] += out is not NotImplemented
            return out
        return f
    monkeypatch.setattr(gpu_graph, "topk_by_sort", counted("topk", gpu_graph.topk_by_sort))
    monkeypatch.setattr(gpu_graph, "row_times_narrow", counted("mm", gpu_graph.row_times_narrow))

    def router(x, weight):
        p = torch.nn.functional.linear(x, weight).float().softmax(-1)
        v, i = torch.topk(p, 4)
        return v / v.sum(-1, keepdim=True), i

    torch._dynamo.reset()
    f = torch.compile(router, backend=gpu_graph._inductor, fullgraph=True, dynamic=False)
    x, weight = torch.randn(1, 64, generator=g).half(), torch.randn(32, 64, generator=g).half()
    (v, i), (ev, ei) = f(x, weight), router(x, weight)
    assert torch.equal(i, ei) and torch.allclose(v, ev, atol=1e-3)
    assert calls == {"topk": 1, "mm": 1}
    # two rows: the mm declines and goes to inductor's own decomposition of mm (recorded here)
    theirs = []
    real = idec.select_decomp_table

    def table():
        t = dict(real())
        own = t[torch.ops.aten.mm.default]
        t[torch.ops.aten.mm.default] = lambda *a, **k: (theirs.append(tuple(a[0].shape)), own(*a, **k))[1]
        return t
    monkeypatch.setattr(idec, "select_decomp_table", table)
    x2 = torch.randn(2, 64, generator=g).half()
    (v, i), (ev, ei) = f(x2, weight), router(x2, weight)
    assert torch.equal(i, ei) and torch.allclose(v, ev, atol=1e-3)
    assert calls == {"topk": 2, "mm": 1} and theirs == [(2, 64)]   # the top-k still a sort; the mm not a row
    torch._dynamo.reset()


@pytest.mark.parametrize("per_function", [True, False])
def test_compiled_functions_fail_loudly(per_function, monkeypatch):
    """`gpu_graph.compiled`: a graph break inside a compiled step, or more compiled entries than its
    recompile limit (16 caches of n_layers + 1 entries), raises instead of running eagerly; with
    torch.compile's own per-function limit (torch 2.13) and without it (torch 2.11: dynamo's limit set
    around each call), dynamo's global limit unchanged either way."""
    import torch._dynamo
    import torch._dynamo.config as dcfg
    from torch._dynamo.exc import FailOnRecompileLimitHit

    from toolkit.runtime import gpu_graph
    from toolkit.runtime.gpu_graph import compiled

    if per_function and not gpu_graph.PER_FUNCTION_LIMIT:
        pytest.skip(f"torch {torch.__version__}: torch.compile takes no recompile_limit")
    monkeypatch.setattr(gpu_graph, "PER_FUNCTION_LIMIT", per_function)
    before = dcfg.recompile_limit

    def breaks(x):
        torch._dynamo.graph_break()
        return x + 1

    def layer(x, i: int):
        return x * i

    torch._dynamo.reset()
    (f,) = compiled((breaks,), "aot_eager", 0)
    with pytest.raises(Exception, match="graph_break|graph break"):
        f(torch.ones(2))
    (g,) = compiled((layer,), "aot_eager", 0)          # 16 entries: one "layer" x 16 caches
    for i in range(16):
        assert g(torch.ones(2), i).tolist() == [float(i)] * 2
    with pytest.raises(FailOnRecompileLimitHit):
        g(torch.ones(2), 16)
    assert dcfg.recompile_limit == before
    torch._dynamo.reset()


def test_experts_option_is_validated(tiny_models, stores):
    spec = inspect_model_dir(tiny_models["qwen3_moe"])
    for decode, experts, msg in (("static", "tiled", "expected eager or fused"),
                                 ("modules", "fused", "only the static decoder")):
        with pytest.raises(SpecPrefetchError, match=msg):
            GpuEngine(load_model(tiny_models["qwen3_moe"]), ExpertStore(stores["qwen3_moe"], spec),
                      RunConfig(policy=Policy("on-demand", "lru"), pool_mib=1.0), device="cpu", decode=decode,
                      experts=experts)


def _triton_device() -> str:
    """Where Triton's kernels run here: "cuda", or "cpu" through Triton's interpreter (TRITON_INTERPRET=1
    set before triton is imported, where Triton is installed); else the test is skipped."""
    import os

    from toolkit.runtime import gpu_kernels as K

    if K.triton is None:
        pytest.skip("no triton")
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and Triton's interpreter is off")
    return "cpu"


def test_triton_slot_kernel_matches_the_reference(monkeypatch):
    """The fp16 slot GEMV (Triton) against its torch reference: on CUDA, or through Triton's interpreter
    on the CPU (TRITON_INTERPRET=1 set before triton is imported) where Triton is installed."""
    from toolkit.runtime import gpu_kernels as K

    dev = _triton_device()
    cuda = dev == "cuda"
    g = torch.Generator(device=dev).manual_seed(2)
    shapes = ((6, 96, 64), (8, 3072, 1024), (5, 1024, 1536), (4, 70, 40)) if cuda else ((6, 36, 24), (5, 17, 300))
    for C, O, N in shapes:
        pad = 7                                   # the matrix sits inside each slot at an offset
        arena = torch.randn(C, pad + O * N + 3, device=dev, generator=g).half()
        w = arena[:, pad:pad + O * N].view(C, O, N)
        slots = torch.randperm(C, device=dev, generator=g)[:4]
        for rows in (1, 4):
            x = torch.randn(rows, N, device=dev, generator=g).half()
            want = K.slot_gemv_torch(w, slots, x)
            got = K.slot_gemv(w, slots, x, use_triton=True)
            assert got.dtype == want.dtype == x.dtype and got.shape == (4, O)
            got, want = got.float(), want.float()
            err = ((got - want).norm() / want.norm()).item()
            assert err < 2e-3, (C, O, N, rows, err)
        # gated: the input is SiLU(gate) x up of a [1 or 4, 2N] gate|up, computed by the kernel as it loads
        for rows in (1, 4):
            x = torch.randn(rows, 2 * N, device=dev, generator=g).half()
            want = K.slot_gemv_torch(w, slots, K.silu_mul(x))
            got = K.slot_gemv(w, slots, x, gated=True, use_triton=True)
            assert got.shape == (4, O)
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert err < 2e-3, (C, O, N, rows, "gated", err)
        with pytest.raises(ValueError, match="gated"):
            K.slot_gemv(w, slots, x[:, :N], gated=True, use_triton=True)
        # pre / late (the launch under PDL: the rows read ahead of the wait, the next launch after it): late
        # changes nothing, bitwise; pre's whole rows are one reduction (within rounding of the loop's), with one
        # or k input rows, gated or not
        for rows, gated in ((1, False), (4, False), (4, True)):
            x = torch.randn(rows, 2 * N if gated else N, device=dev, generator=g).half()
            base = K.slot_gemv(w, slots, x, gated=gated, use_triton=True)
            for pre, late in ((True, False), (False, True), (True, True)):
                got = K.slot_gemv(w, slots, x, gated=gated, pre=pre, late=late, use_triton=True)
                err = ((got.float() - base.float()).norm() / base.float().norm()).item()
                assert err < 1e-3 and (pre or torch.equal(got, base)), (C, O, N, rows, gated, pre, late, err)
        # glu: gate rows then up rows, SiLU(gate) x up out of the one kernel, bitwise the two kernels' it
        # replaces (the plain GEMV, then the gated one's SiLU on load, here through an identity matrix, whose
        # sums are exact)
        if O % 2 == 0:
            eye = torch.eye(O // 2, device=dev).half()[None]
            for rows in (1, 4):
                x = torch.randn(rows, N, device=dev, generator=g).half()
                two = K.slot_gemv(eye, torch.zeros_like(slots), K.slot_gemv(w, slots, x, use_triton=True),
                                  gated=True, use_triton=True)
                got = K.slot_gemv(w, slots, x, glu=True, late=True, use_triton=True)
                assert got.shape == (4, O // 2) and torch.equal(got, two), (C, O, N, rows, "glu")
                want = K.slot_gemv_ref(w, slots, x, glu=True)
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                assert err < 2e-3, (C, O, N, rows, "glu", err)
        with pytest.raises(ValueError, match="glu"):
            K.slot_gemv(w, slots, x, glu=True, pre=True, use_triton=True)
    # the launches' flags: pre holds the rows whole (BLOCK_N N's power of two) up to the bound, loops past it
    # (PRE off, the slot read after the wait); late and glu as asked
    seen = []
    monkeypatch.setattr(K, "_slot_gemv_kernel", _KernelSpy(K._slot_gemv_kernel, seen))
    w = torch.randn(3, 6, 40, device=dev, generator=g).half()
    x = torch.randn(1, 40, device=dev, generator=g).half()
    slots = torch.tensor([2, 0], device=dev)
    K.slot_gemv(w, slots, x, pre=True, use_triton=True)
    K.slot_gemv(w, slots, x, glu=True, late=True, use_triton=True)
    wide = torch.randn(2, 4, K.SLOT_PRE_ELEMS // K.SLOT_BLOCK_O + 1, device=dev, generator=g).half()
    K.slot_gemv(wide, slots[1:], torch.randn(1, wide.shape[2], device=dev, generator=g).half(), pre=True,
                use_triton=True)
    flags = [{f: kw[f] for f in ("PRE", "LATE", "GLU", "BLOCK_N")} for _, kw in seen]
    assert flags == [{"PRE": True, "LATE": False, "GLU": False, "BLOCK_N": 64},
                     {"PRE": False, "LATE": True, "GLU": True, "BLOCK_N": K.SLOT_BLOCK_N},
                     {"PRE": False, "LATE": False, "GLU": False, "BLOCK_N": K.SLOT_BLOCK_N}], flags
    assert [grid for grid, _ in seen] == [(2, 2), (2, 1), (1, 1)]


def test_the_fused_head_is_the_models_head(tiny_models, stores):
    """StaticDecoder.head_one: the last MoE layer's routed outputs handed over, the final norm and the LM head in
    one norm_gemv (its torch reference here; the kernel on a GPU) -> h bitwise the combine's and logits within an
    fp16 step of the model's head; without fused_head, exactly combine then head; never with the model's
    attention."""
    from toolkit.runtime.gpu_graph import combine

    spec = inspect_model_dir(tiny_models["qwen3_moe"])
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(8)
    for attention in ("fused", "sdpa"):
        eng = GpuEngine(load_model(tiny_models["qwen3_moe"], dtype="float16"), ExpertStore(stores["qwen3_moe"], spec),
                        RunConfig(policy=Policy.parse("on-demand+lru"), pool_mib=64.0), device=dev,
                        attention=attention)
        dec = eng._graph_runner(32).dec
        assert dec.fused_head == (attention == "fused")
        H, k = dec.H, eng.k
        h = torch.randn(1, 1, H, generator=g).half().to(dev)
        pending = (torch.randn(k, H, generator=g).half().to(dev), torch.rand(1, k, generator=g).half().to(dev),
                   torch.randperm(k, generator=g).to(dev))
        with torch.no_grad():
            want_h = combine(h, pending)
            want = dec.head(want_h)
            for p in (pending, None):
                logits, h2 = dec.head_one(h, p)
                ref = want if p is not None else dec.head(h)
                assert torch.equal(h2.view(1, 1, H), want_h if p is not None else h)
                assert logits.shape == ref.shape and _fp16_steps(logits, ref) <= 1, (attention, p is None)
            if dec.fused_head:
                dec.fused_head = False
                logits, h2 = dec.head_one(h, pending)
                assert torch.equal(logits, want) and torch.equal(h2, want_h)


def _fp16_steps(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many fp16 values apart two fp16 tensors are at most (their bits as ordered integers)."""
    def ordered(t):
        i = t.contiguous().view(torch.int16).int()
        return torch.where(i < 0, -32768 - i, i)
    return int((ordered(a) - ordered(b)).abs().max())


def _attention_case(dev, g, heads, nkv, D, S, pos, norm):
    """Random inputs of gpu_attention.decode_attention at one position (fp16): qkv, norms, this position's
    rotary tables (transformers' default rope), caches."""
    h = lambda *shape: torch.randn(*shape, device=dev, generator=g).half()   # noqa: E731
    qkv = h(1, (heads + 2 * nkv) * D)
    qn, kn = ((1 + 0.1 * h(D)).half(), (1 + 0.1 * h(D)).half()) if norm else (None, None)
    ang = pos / 10000 ** (torch.arange(0, D, 2, device=dev).float() / D)
    ang = torch.cat([ang, ang])
    return qkv, qn, kn, ang.cos().half(), ang.sin().half(), h(1, nkv, S, D), h(1, nkv, S, D)


def _traced(op: str):
    """A torch.compile backend: aot_eager, after checking that dynamo's graph calls specprefetch::`op`
    (the custom operator traced, not run eagerly around the trace)."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm, example_inputs):
        calls = [n for n in gm.graph.nodes if n.op == "call_function" and f"specprefetch.{op}" in str(n.target)]
        assert len(calls) == 1, [str(n.target) for n in gm.graph.nodes]
        return aot_eager(gm, example_inputs)
    return backend


def test_triton_decode_attention_matches_the_reference():
    """One position's attention kernel (Triton) against its torch reference: on CUDA, or through Triton's
    interpreter on the CPU. Query heads per K/V head 1, 2, 4 and 8, with and without the Qwen3 q/k norms, a
    sliding window, position 0, positions in the first block, across blocks and at the cache's end, the
    cache in one program a K/V head and split over programs (the new position in the first chunk, windows
    starting in a later one, empty chunks past the position) with the combining kernel: the caches written
    as the reference writes them (the new position only: its V bitwise, its K within an fp16 step through
    the interpreter and fp16's rounding on a GPU), the output within fp16's rounding."""
    from toolkit.runtime import gpu_attention as A

    dev = _triton_device()
    cuda = dev == "cuda"
    g = torch.Generator(device=dev).manual_seed(4)
    # (heads, K/V heads, D, cache, position, window, q/k norms, positions a program: None the default, CHUNK;
    # smaller ones split these small caches over programs and the combining kernel)
    cases = [(16, 4, 64, 40, 17, 0, True, None), (8, 8, 32, 20, 0, 0, False, None),
             (8, 2, 64, 300, 150, 0, True, None), (4, 1, 16, 70, 69, 5, False, None),
             (32, 4, 128, 130, 129, 0, True, None), (16, 2, 64, 200, 199, 100, True, None),
             (16, 2, 64, 200, 64, 100, True, None), (8, 2, 64, 600, 599, 0, True, None),
             (8, 2, 64, 300, 150, 0, True, 64), (8, 2, 64, 300, 10, 0, False, 64),
             (8, 2, 64, 300, 0, 0, True, 64), (16, 2, 64, 200, 199, 100, True, 64),
             (4, 1, 16, 200, 130, 70, False, 64), (4, 1, 16, 200, 150, 0, True, 96),
             (8, 8, 32, 192, 191, 0, False, 64)]
    if cuda:
        cases += [(32, 4, 128, 4096, 3000, 0, True, None), (16, 4, 64, 256, 255, 0, True, None),
                  (32, 4, 128, 4096, 4095, 1000, True, None)]
    for heads, nkv, D, S, pos, window, norm, chunk in cases:
        qkv, qn, kn, cos, sin, kc, vc = _attention_case(dev, g, heads, nkv, D, S, pos, norm)
        kc2, vc2 = kc.clone(), vc.clone()
        p = torch.tensor([pos], device=dev)
        args = (qkv, qn, kn, cos, sin)
        want = A.decode_attention(*args, kc, vc, p, heads, D ** -0.5, 1e-6, window, use_triton=False)
        if chunk is None:
            got = A.decode_attention(*args, kc2, vc2, p, heads, D ** -0.5, 1e-6, window, use_triton=True)
        else:
            got = A._decode_attention_triton(*args, kc2, vc2, p, heads, D ** -0.5, 1e-6, window, chunk=chunk)
        assert got.shape == want.shape == (1, heads * D) and got.dtype == torch.float16
        # the new position's K as the reference's (through the interpreter within an fp16 step; on a GPU, whose
        # reciprocal square root is approximate, within fp16's rounding: the rotary's sum of two products can
        # cancel, and a step in either becomes several in the sum), its V and every other row exactly as they were
        assert torch.equal(vc2, vc), (heads, nkv, D, S, pos)
        kn_, kr_ = kc2[:, :, pos], kc[:, :, pos]
        if cuda:
            assert (kn_.float() - kr_.float()).abs().max().item() <= 2e-3 * max(1.0, kr_.abs().max().item()), \
                (heads, nkv, D, S, pos)
        else:
            assert _fp16_steps(kn_, kr_) <= 1, (heads, nkv, D, S, pos)
        kc2[:, :, pos] = kc[:, :, pos]
        assert torch.equal(kc2, kc)
        err = (got.float() - want.float()).abs().max().item()
        assert err <= 2e-3 * max(1.0, want.abs().max().item()), (heads, nkv, D, S, pos, window, chunk, err)
    # a position past the cache (the runner never decodes one: its cache is sized first) writes nothing, split or not
    for pos, window, chunk in ((70, 0, None), (90, 0, None), (75, 10, None), (200, 0, 16), (75, 30, 16)):
        qkv, qn, kn, cos, sin, kc, vc = _attention_case(dev, g, 4, 1, 16, 70, pos, False)
        k0, v0 = kc.clone(), vc.clone()
        out = A._decode_attention_triton(qkv, None, None, cos, sin, kc, vc, torch.tensor([pos], device=dev), 4, 0.25,
                                         0.0, window, chunk=chunk)
        assert torch.equal(kc, k0) and torch.equal(vc, v0) and out.isfinite().all(), pos
    assert A.split_cache(70, 16) == (64, 2) and A.split_cache(512) == (512, 1) and A.split_cache(600) == (256, 3)
    # a wrong window is not within that tolerance: the check bites
    heads, nkv, D, S, pos = 4, 1, 16, 70, 69
    qkv, qn, kn, cos, sin, kc, vc = _attention_case(dev, g, heads, nkv, D, S, pos, False)
    p = torch.tensor([pos], device=dev)
    a = A.decode_attention(qkv, None, None, cos, sin, kc.clone(), vc.clone(), p, heads, 0.25, 0.0, 5, use_triton=True)
    b = A.decode_attention(qkv, None, None, cos, sin, kc.clone(), vc.clone(), p, heads, 0.25, 0.0, 6, use_triton=False)
    assert (a.float() - b.float()).abs().max().item() > 1e-2
    with pytest.raises(ValueError, match="power-of-two head dimension"):
        qkv, qn, kn, cos, sin, kc, vc = _attention_case(dev, g, 4, 2, 24, 8, 3, False)
        A.decode_attention(qkv, None, None, cos, sin, kc, vc, p, 4, 0.2, 0.0, 0, use_triton=True)


@pytest.mark.parametrize("fam", ["qwen3_moe", "mixtral", "mixtral-sw8"])
def test_fused_attention_is_the_models_attention(tiny_models, stores, sliding, fam):
    """The fused attention's reference (the operator's body off CUDA) inside the static decoder of an
    fp16 model against the model's own norms, rotary and SDPA: one position at a time after a prefill,
    the cache rows it writes and the logits within fp16's rounding; traced through
    torch.compile (aot_eager) the operator writes the caches in place the same way."""
    from toolkit.runtime.gpu_graph import StaticKV

    d, store = sliding if fam == "mixtral-sw8" else (tiny_models[fam], stores[fam])
    spec = inspect_model_dir(d)
    engines = {a: GpuEngine(load_model(d, dtype="float16"), ExpertStore(store, spec),
                            RunConfig(policy=Policy.parse("on-demand+lru"), pool_mib=64.0), device="cpu",
                            attention=a) for a in ("fused", "sdpa")}
    assert engines["fused"].attention == "fused" and engines["sdpa"].attention == "sdpa"
    assert GpuEngine(load_model(d, dtype="float16"), ExpertStore(store, spec),
                     RunConfig(policy=Policy.parse("on-demand+lru"), pool_mib=64.0), device="cpu").attention == "sdpa"
    ids = list(range(3, 23))
    out, caches = {}, {}
    for a, eng in engines.items():
        eng.configure(pool_mib=_pool_mib(eng, 1.0))
        dec = eng._graph_runner(32).dec
        assert dec.fused_attention == (a == "fused")
        assert (dec.prelude(torch.tensor([12]), torch.zeros(1, 1, dec.H).half())[0] is None) == (a == "fused")
        kv = StaticKV(len(dec.layers), dec.kv_heads, dec.S, dec.head_dim, "cpu", torch.float16)

        def experts(li, post, idx, scores, eng=eng):
            return _ref_moe(eng, li, post, idx, scores)
        dec.forward_rows(torch.tensor(ids[:12]), 0, kv, experts)
        out[a] = torch.cat([dec.forward_rows(torch.tensor([t]), 12 + j, kv, experts) for j, t in enumerate(ids[12:])])
        caches[a] = kv
    # the decoded positions' K/V rows: the first layer's within an fp16 rounding (the same projection on the CPU,
    # the rotary's products rounded alike), later layers' inputs carry the attention's own rounding too
    f, m = caches["fused"], caches["sdpa"]
    for i in range(len(f.k)):
        for a, b in ((f.k[i], m.k[i]), (f.v[i], m.v[i])):
            a, b = a[0, :, 12:20].float(), b[0, :, 12:20].float()
            assert b.abs().max() > 0.1 and torch.allclose(a, b, atol=(1 if i else 0.05) * 2e-2), i
    err = (out["fused"] - out["sdpa"]).abs().max().item()
    assert err < 2e-2 * out["sdpa"].abs().max().item(), err
    # through torch.compile: the operator in the trace, the caches written in place
    from toolkit.runtime.gpu_attention import decode_attention

    dec = engines["fused"]._graph_runner(32).dec
    sa = dec.layers[0].self_attn
    heads, nkv, D = dec.heads, dec.kv_heads, dec.head_dim
    g = torch.Generator().manual_seed(1)
    qkv, qn, kn, cos, sin, kc, vc = _attention_case("cpu", g, heads, nkv, D, 32, 9, dec.qk_norm)
    pos = torch.tensor([9])
    before, kc2, vc2 = kc.clone(), kc.clone(), vc.clone()
    want = decode_attention(qkv, qn, kn, cos, sin, kc, vc, pos, heads, sa.scaling, 1e-6, dec.window or 0)
    step = torch.compile(lambda *a: decode_attention(*a), backend=_traced("decode_attention"), fullgraph=True)
    got = step(qkv, qn, kn, cos, sin, kc2, vc2, pos, heads, sa.scaling, 1e-6, dec.window or 0)
    assert torch.equal(got, want) and torch.equal(kc2, kc) and torch.equal(vc2, vc)
    assert not torch.equal(kc[0, :, 9], before[0, :, 9]) and torch.equal(kc[0, :, 10:], before[0, :, 10:])


def test_triton_norm_gemv_matches_the_reference():
    """The fused attention's first kernel (Triton: CUDA or the interpreter) against its torch reference: the
    MoE layer before's weighted expert outputs summed into the residual (bitwise), the input RMS norm and the
    q/k/v GEMV (within fp16's rounding): k = 0 (no combine), 2, 4 and 8, hidden sizes within one block, not a
    power of two, and over two blocks; the reference itself is the eager combine + norm + linear."""
    from toolkit.runtime import gpu_kernels as K
    from toolkit.runtime.gpu_graph import combine

    dev = _triton_device()
    g = torch.Generator(device=dev).manual_seed(6)
    r = lambda *shape: torch.randn(*shape, device=dev, generator=g)   # noqa: E731
    for H, O, k, sdt in ((64, 48, 0, torch.float16), (1024, 1536, 4, torch.float16), (100, 30, 2, torch.float32),
                         (2112, 40, 8, torch.float16)):
        h, ys = r(1, 1, H).half(), r(k, H).half()
        sc = r(1, k).softmax(-1).to(sdt) if k else torch.zeros(0, device=dev, dtype=sdt)
        perm = torch.randperm(k, device=dev, generator=g)
        nw, w = (1 + 0.1 * r(H)).half(), (0.05 * r(O, H)).half()
        (h0, y0), (h1, y1) = (K.norm_gemv(h, ys, sc, perm, nw, 1e-6, w, use_triton=u) for u in (False, True))
        assert h0.shape == h1.shape == h.shape and y0.shape == y1.shape == (1, O)
        assert torch.equal(h0, h1) and _fp16_steps(y0, y1) <= 1, (H, O, k)
        want_h = combine(h, (ys, sc, perm) if k else None)   # the eager pieces it replaces
        assert torch.equal(h0, want_h)
        x = K.rms_norm_torch(want_h.view(1, -1), nw, 1e-6)   # (the slot GEMV's arithmetic: fp32 sums, one rounding)
        slot0 = torch.zeros(1, dtype=torch.long, device=dev)
        assert torch.equal(y0, K.slot_gemv(w[None], slot0, x, use_triton=False))
        if k:
            assert not torch.equal(h0, h)
        # traced by torch.compile as one call of the operator (whose output never aliases h, with k = 0 too)
        fn = torch.compile(lambda *a: K.norm_gemv(*a), backend=_traced("norm_gemv"), fullgraph=True)
        h2, y2 = fn(h, ys, sc, perm, nw, 1e-6, w)
        assert torch.equal(h2, h0 if dev == "cpu" else h1) and h2.data_ptr() != h.data_ptr()
    with pytest.raises(ValueError, match="2 expert outputs of 64"):
        z = torch.zeros(1, 64, device=dev).half()
        K.norm_gemv(z, torch.zeros(2, 64, device=dev).half(), torch.zeros(1, 2, device=dev).half(),
                    torch.zeros(3, dtype=torch.long, device=dev), z[0], 1e-6, torch.zeros(8, 64, device=dev).half(),
                    use_triton=True)


@pytest.mark.parametrize("one", [True, False], ids=["one-block", "loops"])
def test_triton_router_matches_the_reference(one, monkeypatch):
    """One position's router kernel (Triton: CUDA or the interpreter) against its torch reference: the
    residual and the router input bitwise, the same experts in the same order, the scores within a
    float32 rounding; Qwen3's fp16 scores with and without the normalisation, Mixtral's float32 ones,
    k = E, and a tie between two experts' logits (the lower index first, as topk_by_sort); routers over
    128 KiB (Qwen3-30B's 128 x 2048, and 300 experts) through the two-kernel path. Every case with the row in
    one block (the default for these sizes) and through the loop over blocks (both bounds 1), each launch's
    path checked."""
    from toolkit.runtime import gpu_router as R

    if not one:
        monkeypatch.setattr(R, "ROUTER_TILE", 1)
        monkeypatch.setattr(R, "ROUTER_LOGITS_TILE", 1)
    dev = _triton_device()
    g = torch.Generator(device=dev).manual_seed(5)
    r = lambda *shape: torch.randn(*shape, device=dev, generator=g)   # noqa: E731
    launched, logits = [], []   # the two-kernel path's top-k launches; the logits' kernels' launches (their path)
    monkeypatch.setattr(R, "_route_topk_kernel", _KernelSpy(R._route_topk_kernel, launched))
    monkeypatch.setattr(R, "_route_kernel", _KernelSpy(R._route_kernel, logits))
    monkeypatch.setattr(R, "_route_logits_kernel", _KernelSpy(R._route_logits_kernel, logits))
    _router_cases(R, dev, g, r, launched)
    assert logits and {kw["ONE"] for _, kw in logits} == {one}, logits
    # every launch's PDL flag as launched (the kernels wait only where they were launched with PDL)
    assert all(kw["PDL"] == ("launch_pdl" in kw) == R.pdl(torch.zeros(1, device=dev))
               for _, kw in logits + launched), logits + launched
    if not one:   # an explicit tile over the bounds (the sweep's, where a default loops): the row in one block,
        logits.clear()   # the same routing as the reference, through both router paths
        for E, H, kernels in ((32, 64, 1), (300, 256, 2)):   # (one kernel; two: over 128 KiB)
            h, a, nw, gw = r(1, H).half(), r(1, H).half(), (1 + 0.1 * r(H)).half(), (0.1 * r(E, H)).half()
            got, before = [], len(launched)
            for use in (False, True):
                post, sc, idx = torch.zeros(1, H, device=dev).half(), torch.zeros(1, 4, device=dev).half(), \
                    torch.full((1, 4), -1, device=dev, dtype=torch.long)
                out = (R._route_triton(h, a, nw, 1e-6, gw, True, post, sc, idx, tile=2 ** 30) if use
                       else R._route_reference(h, a, nw, 1e-6, gw, True, post, sc, idx))
                got.append((out, post, idx, sc))
            assert len(launched) - before == kernels - 1, (E, H)   # (the top-k kernel: the two-kernel path's)
            assert torch.equal(got[0][0], got[1][0]) and _fp16_steps(got[0][1], got[1][1]) <= 1, (E, H)
            assert torch.equal(got[0][2], got[1][2]), (E, H, got[0][2], got[1][2])
            assert torch.allclose(got[0][3].float(), got[1][3].float(), rtol=2e-3, atol=1e-6), (E, H)
        assert len(logits) == 2 and all(kw["ONE"] for _, kw in logits), logits
        assert all(kw["PDL"] == ("launch_pdl" in kw) == R.pdl(torch.zeros(1, device=dev))
                   for _, kw in logits + launched), logits + launched


class _KernelSpy:
    """A Triton kernel whose launches are recorded in `seen` as (grid, the launch's keyword arguments)."""

    def __init__(self, kernel, seen: list):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.seen.append((grid, kw))
            return self.kernel[grid](*args, **kw)
        return launch


def _router_cases(R, dev, g, r, launched):
    for H, E, k, norm, sdt, tie in ((64, 8, 2, True, torch.float16, False), (1024, 32, 4, True, torch.float16, True),
                                    (1024, 32, 4, False, torch.float16, False), (100, 60, 8, True, torch.float32, True),
                                    (64, 8, 8, True, torch.float32, False), (64, 8, 3, True, torch.float16, False),
                                    (100, 60, 6, False, torch.float32, True),    # (k = 3, 6: padded lanes)
                                    (2048, 128, 8, True, torch.float16, True),   # over 128 KiB: two kernels
                                    (256, 300, 6, False, torch.float32, False)):
        h, a = r(1, H).half(), r(1, H).half()
        nw, gw = (1 + 0.1 * r(H)).half(), (0.1 * r(E, H)).half()
        if tie:   # experts 5 and 2 share a row aligned with the router input: equal logits, high enough to be
            gw[2] = 0.05 * (h + a).float().sign()[0].half()   # chosen; the lower index ranks first
            gw[5] = gw[2]
        slot_of = torch.randperm(3 * E, device=dev, generator=g)[:E]   # (the resident selection: any slot numbers)
        outs, sels = [], []
        before = len(launched)
        for use in (False, True):
            for slots in (False, True):
                post = torch.zeros(1, H, device=dev).half()
                sc, idx = torch.zeros(1, k, device=dev, dtype=sdt), torch.full((1, k), -1, device=dev, dtype=torch.long)
                sel = torch.full((2 * k,), -1, device=dev, dtype=torch.long)
                got = R.route(h, a, nw, 1e-6, gw, norm, post, sc, idx, *((slot_of, sel) if slots else ()),
                              use_triton=use)
                if slots:
                    sels.append(sel)
                    assert torch.equal(got, outs[-1][0]) and torch.equal(idx, outs[-1][3])   # (the same routing)
                else:
                    outs.append((got, post, sc, idx))
        (h0, p0, s0, i0), (h1, p1, s1, i1) = outs
        # (routers over 128 KiB through the two kernels: the top-k kernel launched for both Triton calls)
        assert len(launched) - before == (2 if E * H * 2 > R.MAX_ROUTER_KIB * 1024 else 0), (H, E)
        assert torch.equal(h0, h1) and torch.equal(h0, h + a) and _fp16_steps(p0, p1) <= 1, (H, E, k)
        assert torch.equal(i0, i1) and sorted(set(i0[0].tolist())) == sorted(i0[0].tolist()), (H, E, k, i0, i1)
        chosen = i1[0].tolist()   # the selection: the chosen experts' slots in ascending expert order, then where
        asc = sorted(chosen)      # each of those experts stands in the top-k order
        want = [slot_of[e].item() for e in asc] + [chosen.index(e) for e in asc]
        assert sels[0].tolist() == sels[1].tolist() == want, (H, E, k, sels, want)
        assert s1.dtype == sdt and torch.allclose(s0.float(), s1.float(), rtol=2e-3, atol=1e-6), (H, E, k, s0, s1)
        if norm:
            assert abs(s1.float().sum().item() - 1) < 5e-3
        if tie:
            got = i1[0].tolist()
            assert got[:2] == [2, 5], got
    # NaN logits (a NaN in the residual): k distinct experts, all real ones (torch's top-k would not overrun either)
    h = r(1, 64).half()
    h[0, 3] = float("nan")
    for E, k in ((8, 2), (8, 8), (20, 4)):
        sc, idx = torch.zeros(1, k, device=dev).half(), torch.full((1, k), -1, device=dev, dtype=torch.long)
        R.route(h, h, (1 + 0 * r(64)).half(), 1e-6, r(E, 64).half(), True, torch.zeros(1, 64, device=dev).half(),
                sc, idx, use_triton=True)
        got = idx[0].tolist()
        assert len(set(got)) == k and all(0 <= i < E for i in got), (E, k, got)
    z = torch.zeros(1, 64, device=dev).half()
    with pytest.raises(ValueError, match="top-9 of 8"):
        R.route(z, z, z[0], 1e-6, torch.zeros(8, 64, device=dev).half(), True, z.clone(), torch.zeros(1, 9, device=dev),
                torch.zeros(1, 9, dtype=torch.long, device=dev), use_triton=True)
    one = (z, z, z[0], 1e-6, torch.zeros(8, 64, device=dev).half(), True, z.clone(), torch.zeros(1, 2, device=dev),
           torch.zeros(1, 2, dtype=torch.long, device=dev))
    with pytest.raises(ValueError, match="slot table of 8 and selection of 4"):
        R.route(*one, torch.zeros(8, dtype=torch.long, device=dev), torch.zeros(3, dtype=torch.long, device=dev),
                use_triton=True)
    with pytest.raises(ValueError, match="come together"):
        R.route(*one, torch.zeros(8, dtype=torch.long, device=dev), use_triton=True)
    many = (z, z, z[0], 1e-6, torch.zeros(1025, 64, device=dev).half(), True, z.clone(), torch.zeros(1, 2, device=dev),
            torch.zeros(1, 2, dtype=torch.long, device=dev))
    with pytest.raises(ValueError, match="1025 experts, at most 1024"):
        R.route(*many, use_triton=True)


@pytest.mark.parametrize("fam", ["qwen3_moe", "mixtral"])
def test_fused_router_is_the_models_router(tiny_models, stores, fam):
    """The fused router's reference (the operator's body off CUDA) in the runner's segments of an fp16
    model against the model's post-attention norm and router module: per MoE layer the same router
    input, experts and scores in the runner's buffers, the same residual; the engine's tokens equal
    with either; traced through torch.compile (aot_eager) the buffers are written in place."""
    d, store = tiny_models[fam], stores[fam]
    spec = inspect_model_dir(d)
    engines = {r: GpuEngine(load_model(d, dtype="float16"), ExpertStore(store, spec),
                            RunConfig(policy=Policy.parse("on-demand+lru"), pool_mib=64.0), device="cpu", router=r,
                            with_draft=True)
               for r in ("fused", "model")}
    assert [e.router for e in engines.values()] == ["fused", "model"]
    prompt = list(range(5, 17))
    for policy in ("on-demand+lru", "draft+prediction"):   # (the draft's step routes into its own buffers)
        runs = {}
        for r, eng in engines.items():
            eng.configure(policy=Policy.parse(policy), pool_mib=_pool_mib(eng, 0.5))
            runs[r] = eng.run(prompt, 10, k=3)
            assert eng._graph_runner(32).dec.fused_router == (r == "fused")
        assert runs["fused"].tokens == runs["model"].tokens, policy
        assert [x.tolist() for x in runs["fused"].routing] == [x.tolist() for x in runs["model"].routing], policy
        assert runs["fused"].stats.counts == runs["model"].stats.counts, policy
    # one segment's buffers, from the same state: equal, and really written (they start as NaN / -1)
    bufs = {}
    for r, eng in engines.items():
        gr = eng._graph_runner(32)
        gr.tok.fill_(7)
        gr.pos.fill_(3)
        gr.post.fill_(float("nan"))
        gr.scores.fill_(float("nan"))
        gr.idx.fill_(-1)
        gr.segment(0)
        bufs[r] = (gr.h.clone(), gr.post[0].clone(), gr.scores[0].clone(), gr.idx[0].clone())
    (h0, p0, s0, i0), (h1, p1, s1, i1) = bufs["fused"], bufs["model"]
    assert torch.equal(h0, h1) and torch.equal(p0, p1) and torch.equal(i0, i1) and (i0 >= 0).all()
    assert torch.allclose(s0.float(), s1.float(), rtol=2e-3, atol=1e-6) and not s0.isnan().any()
    from toolkit.runtime.gpu_router import route

    dec = engines["fused"]._graph_runner(32).dec
    i = min(dec.moe_at)
    norm, gate = dec.layers[i].post_attention_layernorm, dec.blocks[i].gate
    g = torch.Generator().manual_seed(2)
    h, a = torch.randn(1, 1, dec.H, generator=g).half(), torch.randn(1, 1, dec.H, generator=g).half()
    outs = []
    for fn in (route, torch.compile(lambda *x: route(*x), backend=_traced("route"), fullgraph=True)):
        post, sc, idx = torch.zeros(1, dec.H).half(), torch.zeros_like(s0), torch.full_like(i0, -1)
        with torch.no_grad():   # (as the engine runs it: the weights are parameters)
            outs.append((fn(h, a, norm.weight, norm.variance_epsilon, gate.weight, dec.norm_topk[i], post, sc, idx),
                         post, sc, idx))
    for x, y in zip(*outs):
        assert torch.equal(x, y)
    assert (outs[1][3] >= 0).all() and outs[1][1].abs().sum() > 0
    # the resident token's variant (specprefetch::route_resident) writes the slot selection as well, traced too
    slot_of = torch.arange(dec.eng.E).flip(0) + 100
    sels = []
    for fn in (route, torch.compile(lambda *x: route(*x), backend=_traced("route_resident"), fullgraph=True)):
        post, sc, idx = torch.zeros(1, dec.H).half(), torch.zeros_like(s0), torch.full_like(i0, -1)
        sel = torch.full((2 * i0.numel(),), -1, dtype=torch.long)
        with torch.no_grad():
            fn(h, a, norm.weight, norm.variance_epsilon, gate.weight, dec.norm_topk[i], post, sc, idx, slot_of, sel)
        assert torch.equal(idx, outs[0][3])
        sels.append(sel)
    chosen = outs[0][3][0].tolist()
    asc = sorted(chosen)
    want = [100 + dec.eng.E - 1 - e for e in asc] + [chosen.index(e) for e in asc]
    assert sels[0].tolist() == sels[1].tolist() == want


@pytest.mark.parametrize("fam", ["qwen3_moe", "mixtral", "mixtral-sw8"])
def test_fused_kernels_decode_as_the_model_path(tiny_models, stores, sliding, fam, monkeypatch):
    """The Triton kernels themselves (CUDA, or the interpreter on the CPU) inside the runner's decode of an
    fp16 model: the fused attention and router give the tokens and routing the static decoder gives with
    the model's norms, SDPA and router (the window applied where the model has one); each kernel ran
    (on the CPU exactly once per layer, or MoE layer, and decoded token; on CUDA its calls are the
    graphs' captures), and not at all on the model's path."""
    from toolkit.runtime import gpu_attention as A
    from toolkit.runtime import gpu_router as R

    from toolkit.runtime import gpu_kernels as K

    dev = _triton_device()
    cuda = dev == "cuda"
    calls = {"attention": 0, "route": 0, "norm_gemv": 0, "combined": 0}

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            if name == "norm_gemv" and args[1].shape[0]:   # the MoE layer before's outputs handed over
                calls["combined"] += 1
            return fn(*args)
        return call
    # (the CPU's tensors through Triton too)
    launches = {"combine": [], "topk": []}   # the second kernels' launches
    monkeypatch.setattr(A, "_impl", counted("attention", A._decode_attention_triton))
    # the runner's 128-position cache split into 8 programs of 16 positions a K/V head (the decoded positions
    # reach the second), and the router's two-kernel path: each kernel's second kernel counted
    monkeypatch.setattr(A, "CHUNK", 8)
    monkeypatch.setattr(A, "BLOCK_S", 16)
    monkeypatch.setattr(A, "_decode_combine_kernel", _KernelSpy(A._decode_combine_kernel, launches["combine"]))
    monkeypatch.setattr(R, "MAX_ROUTER_KIB", 0)
    monkeypatch.setattr(R, "_route_topk_kernel", _KernelSpy(R._route_topk_kernel, launches["topk"]))
    monkeypatch.setattr(R, "_impl", counted("route", R._route_triton))
    monkeypatch.setattr(K, "_norm_gemv_impl", counted("norm_gemv", K._norm_gemv_triton))
    # the slot GEMVs through Triton too, each launch's options recorded (the experts' and the output projection's)
    slot_launches = []
    monkeypatch.setattr(K, "_slot_gemv_kernel", _KernelSpy(K._slot_gemv_kernel, slot_launches))
    monkeypatch.setattr(K, "_slot_gemv_impl", lambda w, slots, x, gated, glu, pre, late: K._slot_gemv_triton(
        w, slots, x, gated=gated, glu=glu, pre=pre, late=late))
    d, store = sliding if fam == "mixtral-sw8" else (tiny_models[fam], stores[fam])
    spec = inspect_model_dir(d)
    runs = {}
    for a, r in (("fused", "fused"), ("sdpa", "model")):
        # (the fused expert math: its outputs handed to the next layer's q/k/v GEMV unsummed)
        eng = GpuEngine(load_model(d, dtype="float16"), ExpertStore(store, spec),
                        RunConfig(policy=Policy.parse("on-demand+lru"), pool_mib=64.0), device=dev, attention=a,
                        router=r, experts="fused")
        eng.configure(pool_mib=_pool_mib(eng, 0.5))
        del slot_launches[:]
        runs[a] = eng.run(list(range(5, 17)), 16)
        # the experts: gate / up with SiLU(gate) x up out, launched late, then the down projection's rows read
        # ahead (pre), where gate and up are adjacent; else gate and up, then the gated down; the fused
        # attention's output projection (one slot) pre, on CUDA (elsewhere F.linear: gpu_graph's _gemv)
        kinds = {(grid[0] == 1, kw["GLU"], kw["PRE"], kw["LATE"], kw["GATED"]) for grid, kw in slot_launches}
        experts = ({(False, True, False, True, False), (False, False, True, False, False)} if eng.contiguous else
                   {(False, False, False, False, False), (False, False, False, False, True)})
        o_proj = {(True, False, True, False, False)} if a == "fused" and cuda else set()
        assert kinds == experts | o_proj, (fam, a, kinds)
        gr = eng._graph_runner(32)
        dec = gr.dec
        assert (dec.fused_attention, dec.fused_router, gr.fold_combine) == (a == "fused", r == "fused", a == "fused")
        assert A.split_cache(gr.S, A.CHUNK) == (16, 8)
        if a == "fused":   # 15 decoded tokens (the first comes from the prefill), eagerly or captured once
            if not cuda:
                n = len(runs[a].tokens) - 1
                # (a segment after the first with layers: its first takes the MoE layer before's outputs; the
                # last segment has none where the last layer is a MoE layer, and the head's norm_gemv takes them:
                # one norm_gemv a layer and one for the head, StaticDecoder.head_one)
                # (every MoE layer's outputs handed over: each tiny family ends in a MoE layer)
                assert dec.fused_head and not gr.seg_layers[-1]
                assert calls == {"attention": n * len(dec.layers), "route": n * len(dec.moe_at),
                                 "norm_gemv": n * (len(dec.layers) + 1), "combined": n * len(dec.moe_at)}, calls
                got = {name: len(seen) for name, seen in launches.items()}
                assert got == {"combine": calls["attention"], "topk": calls["route"]}, got
            assert min(len(seen) for seen in launches.values()) > 0
            assert min(calls.values()) > 0
            seen = dict(calls)
        else:
            assert calls == seen   # (the model's path calls neither)
    assert runs["fused"].tokens == runs["sdpa"].tokens
    assert [x.tolist() for x in runs["fused"].routing] == [x.tolist() for x in runs["sdpa"].routing]
    # every expert resident, the whole token in one graph (on the CPU its eager function): the router kernel
    # writes the slot selection too (route_resident)
    before = calls["route"]
    eng.configure(pool_mib=_pool_mib(eng, 1.0))
    want = eng.generate(list(range(5, 17)), 12, preload=True, resident_graph=True)
    assert calls["route"] == before   # (the model's path)
    fused = GpuEngine(load_model(d, dtype="float16"), ExpertStore(store, spec),
                      RunConfig(policy=Policy.parse("on-demand+lru"), pool_mib=64.0), device=dev, attention="fused",
                      router="fused", experts="fused")
    fused.configure(pool_mib=_pool_mib(fused, 1.0))
    got = fused.generate(list(range(5, 17)), 12, preload=True, resident_graph=True)
    assert calls["route"] > before
    if not cuda:
        assert calls["route"] - before == (len(got.tokens) - 1) * len(dec.moe_at)
    assert got.tokens == want.tokens == runs["sdpa"].tokens[:12]


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_fused_step_decodes_as_the_eager_one(tiny_models, stores, backend):
    """The fused attention, router and q/k/v kernel (their operators' torch bodies on the CPU) through
    torch.compile (aot_eager: the custom operators traced, their mutations functionalised; inductor, slow:
    its CPU code too, the mutations of the runner's buffer views reinplaced): a pooled policy's and the
    all-resident token's tokens and routing are the uncompiled fused step's and the model path's, with no
    graph break (fullgraph)."""
    import torch._dynamo

    d, store = tiny_models["qwen3_moe"], stores["qwen3_moe"]
    spec = inspect_model_dir(d)
    bank = load_router_bank(spec)
    preds = {"next-gate": build_predictor("next-gate", num_experts=spec.geometry.routing.num_experts,
                                          bank=lambda: bank)}
    torch._dynamo.reset()
    prompt, out = list(range(5, 17)), {}
    for name, c, a in (("eager", None, "fused"), ("traced", backend, "fused"), ("model", None, "sdpa")):
        e = GpuEngine(load_model(d, dtype="float16"), ExpertStore(store, spec),
                      RunConfig(policy=Policy.parse("next-gate+prediction"), pool_mib=64.0), device="cpu",
                      predictors=preds, compile=c, attention=a, router="fused" if a == "fused" else "model",
                      experts="fused")
        e.configure(pool_mib=_pool_mib(e, 0.25))
        g1 = e.generate(prompt, 10)
        e.configure(policy=Policy.parse("on-demand+lru"), pool_mib=_pool_mib(e, 1.0))
        g2 = e.generate(prompt, 10, preload=True, resident_graph=True)
        assert e._graph_runner(32).fold_combine == (a == "fused")
        out[name] = [(g.tokens, [x.tolist() for x in g.routing]) for g in (g1, g2)]
    assert out["traced"] == out["eager"] == out["model"]


@pytest.mark.parametrize("fam,experts", [("qwen3_moe", "eager"), ("mixtral", "eager"), ("qwen3_moe", "fused"),
                                         ("mixtral", "fused")])
def test_fused_step_decodes_as_the_model_step_on_the_cpu(tiny_models, stores, fam, experts):
    """The fused attention and router (their torch references on the CPU) through every way the runner
    decodes: pooled segments, the draft's step and its exact verification, the all-resident token: the
    tokens, routing and copies of the model's norms, SDPA and router; with the fused expert math, whose
    outputs the next layer's q/k/v GEMV sums (gpu_kernels.norm_gemv), as well as the eager one."""
    d, store = tiny_models[fam], stores[fam]
    spec = inspect_model_dir(d)
    bank = load_router_bank(spec)
    preds = {"next-gate": build_predictor("next-gate", num_experts=spec.geometry.routing.num_experts,
                                          bank=lambda: bank)}
    engines = {a: GpuEngine(load_model(d, dtype="float16"), ExpertStore(store, spec),
                            RunConfig(policy=Policy.parse("on-demand+lru"), pool_mib=64.0), device="cpu",
                            predictors=preds, with_draft=True, attention=a, router=r, experts=experts)
               for a, r in (("fused", "fused"), ("sdpa", "model"))}
    prompt = list(range(5, 17))
    for policy, frac in (("on-demand+lru", 0.5), ("next-gate+prediction", 0.25), ("draft+prediction", 0.5)):
        runs = {}
        for a, eng in engines.items():
            eng.configure(policy=Policy.parse(policy), pool_mib=_pool_mib(eng, frac))
            runs[a] = eng.run(prompt, 12, k=3)
        assert runs["fused"].tokens == runs["sdpa"].tokens, policy
        assert [x.tolist() for x in runs["fused"].routing] == [x.tolist() for x in runs["sdpa"].routing], policy
        assert runs["fused"].stats.counts == runs["sdpa"].stats.counts, policy
    res = {}
    for a, eng in engines.items():
        eng.configure(policy=Policy.parse("on-demand+lru"), pool_mib=_pool_mib(eng, 1.0))
        res[a] = eng.generate(prompt, 12, preload=True, resident_graph=True)
        gr = eng._graph_runner(32)
        assert (gr.dec.fused_attention, gr.dec.fused_router) == (a == "fused", a == "fused")
        assert gr.fold_combine == (a == "fused" and experts == "fused")
    assert res["fused"].tokens == res["sdpa"].tokens == runs["sdpa"].tokens


def test_fused_kernels_refuse_what_they_do_not_cover():
    """attention_usable / router_usable: the geometry, dtype and router size the kernels cover."""
    from torch import nn

    from toolkit.runtime.gpu_attention import attention_usable
    from toolkit.runtime.gpu_router import router_usable

    class Attn(nn.Module):
        def __init__(self, heads, kv, D, bias=(False, False, False), norm=(True, True)):
            super().__init__()
            self.head_dim = D
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(64, n * D, bias=b).half()
                                                     for n, b in zip((heads, kv, kv), bias))
            if norm[0]:
                self.q_norm = nn.Identity()
            if norm[1]:
                self.k_norm = nn.Identity()

    fp16 = torch.float16
    assert attention_usable([Attn(8, 2, 16)], fp16) is None
    assert "has no q/k/v projections" in attention_usable([nn.Linear(4, 4)], fp16)
    for attn, dtype, msg in ((Attn(8, 2, 16), torch.float32, "fp16, not float32"),
                             (Attn(8, 2, 24), fp16, "power-of-two head dimension of at least 16, not 24"),
                             (Attn(8, 2, 8), fp16, "at least 16, not 8"),
                             (Attn(6, 4, 16), fp16, "6 query heads are not a multiple of 4"),
                             (Attn(8, 2, 16, bias=(True, False, False)), fp16, "differ in dtype or bias"),
                             (Attn(8, 2, 16, norm=(True, False)), fp16, "a q norm without a k norm")):
        assert msg in attention_usable([attn], dtype)

    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(64).half())
            self.variance_epsilon = 1e-6

    def gate(E, H):
        return nn.Linear(H, E, bias=False).half()
    assert router_usable([Norm()], [gate(32, 1024)], fp16) is None
    assert router_usable([Norm()], [gate(8, 4096)], fp16) is None                      # Mixtral's: 64 KiB
    assert router_usable([Norm()], [gate(128, 2048)], fp16) is None                   # Qwen3-30B's: two kernels
    assert "2048 experts: the fused router's top-k takes at most 1024" in router_usable([Norm()], [gate(2048, 64)],
                                                                                        fp16)
    assert "not an RMS norm" in router_usable([nn.LayerNorm(64)], [gate(8, 64)], fp16)
    assert "bias-free linear router" in router_usable([Norm()], [nn.Linear(64, 8).half()], fp16)
    assert "fp16, not float32" in router_usable([Norm()], [gate(8, 64)], torch.float32)
    assert attention_usable([Attn(8, 2, 16)], fp16, [Norm()]) is None   # the input norms (the q/k/v GEMV's)
    assert "input norm LayerNorm is not an RMS norm" in attention_usable([Attn(8, 2, 16)], fp16, [nn.LayerNorm(64)])


def test_attention_option_is_validated(tiny_models, stores):
    spec = inspect_model_dir(tiny_models["qwen3_moe"])

    def engine(dtype="float32", **kw):
        return GpuEngine(load_model(tiny_models["qwen3_moe"], dtype=dtype), ExpertStore(stores["qwen3_moe"], spec),
                         RunConfig(policy=Policy("on-demand", "lru"), pool_mib=1.0), device="cpu", **kw)
    for kw, msg in (({"attention": "flash"}, "attention 'flash': expected fused or sdpa"),
                    ({"attention": "fused", "decode": "modules"}, "only the static decoder"),
                    ({"attention": "fused"}, "--attention fused: the fused attention computes in fp16, not float32"),
                    ({"router": "flash"}, "router 'flash': expected fused or model"),
                    ({"router": "model", "decode": "modules"}, "only the static decoder"),
                    ({"router": "fused"}, "--router fused: the fused router computes in fp16, not float32")):
        with pytest.raises(SpecPrefetchError, match=msg):
            engine(**kw)
    for e in (engine(), engine("float16")):   # CPU: static, the model's modules
        assert (e.attention, e.router) == ("sdpa", "model")
    assert (engine(decode="modules").attention, engine(decode="modules").router) == ("modules", "modules")
    e = engine("float16", attention="fused", router="fused")
    assert (e.attention, e.router) == ("fused", "fused")
    # unset with `graph` (a GPU): fused where the kernels cover the model, else the other quietly; an explicit
    # fused refused in one line, the other kept
    from types import SimpleNamespace

    choose = GpuEngine._kernel_choice
    graph, static = SimpleNamespace(decode="graph"), SimpleNamespace(decode="static")
    assert choose(graph, "attention", None, "sdpa", lambda: None) == "fused"
    assert choose(graph, "attention", None, "sdpa", lambda: "a bf16 model") == "sdpa"
    assert choose(static, "router", None, "model", lambda: None) == "model"
    assert choose(graph, "router", "model", "model", lambda: None) == "model"
    with pytest.raises(SpecPrefetchError, match="--router fused: a bf16 model"):
        choose(graph, "router", "fused", "model", lambda: "a bf16 model")


def test_a_mismatch_names_its_first_token_and_how_near_a_tie_it_was():
    """The bench's mismatch lines say where the tokens first leave transformers' and transformers' top-2
    logit gap there (a near-tie or a bug); equal tokens say nothing."""
    from toolkit.runtime.gpu_bench import first_difference

    assert first_difference([1, 2, 3], [1, 2, 3], [0.5, 0.5, 0.5]) == ""
    assert first_difference([1, 5, 3], [1, 2, 3], [0.5, 0.0021, 0.5]) == \
        " (first at new token 1, transformers' top-2 logit gap there 0.0021)"
    assert first_difference([1, 2], [1, 2, 3], [0.5, 0.5, 0.25]) == \
        " (first at new token 2, transformers' top-2 logit gap there 0.25)"
    assert first_difference([1, 2, 3], [1, 2], [0.5, 0.5]) == " (longer: 3 tokens, transformers' 2)"


@NATIVE
@pytest.mark.parametrize("decode,device", [("static", "cpu"), ("modules", "cpu"),
                                           pytest.param("graph", "cuda", marks=CUDA)])
def test_native_host_scheduler_decides_as_the_python_one(tiny_models, stores, tiny_adapter, decode, device,
                                                         monkeypatch):
    """`configure(host="native")`: the native runner's scheduler and pool (toolkit/runtime/native_sched.py) in the
    GPU tier's loop give the Python scheduler's tokens, counts, copies and evictions for every kind of policy
    (on-demand, a host predictor, the adapter with the reuse eviction and its next-visit heads, the oracle with
    Belady's rule, the draft), under the static decoder (the graph decode's loop, eager) and transformers'
    modules, and on CUDA under the graph decode (fp16, the copies on their streams), at a pool small enough to
    evict."""
    from toolkit.runtime.gpu_bench import gpu_predictors, gpu_reuse_table

    opened = _count_native_schedulers(monkeypatch)
    spec = inspect_model_dir(tiny_models["qwen3_moe"])
    names = ["on-demand+lru", "next-gate+prediction", "adapter+reuse", "oracle+belady", "draft+lru"]
    pols = [Policy.parse(n) for n in names]
    dtype = "float16" if device == "cuda" else "float32"
    eng = GpuEngine(load_model(tiny_models["qwen3_moe"], dtype=dtype), ExpertStore(stores["qwen3_moe"], spec),
                    RunConfig(policy=pols[0], pool_mib=64.0), device=device, decode=decode, with_draft=True,
                    predictors=gpu_predictors(spec, [p.predictor for p in pols], tiny_adapter),
                    reuse=gpu_reuse_table(spec, ["reuse"], tiny_adapter))
    prompt = list(range(5, 17))
    for pol in pols:
        got = {}
        for host in ("python", "native"):
            eng.configure(policy=pol, pool_mib=_pool_mib(eng, 0.2), host=host)
            before = len(opened)
            g = eng.run(prompt, 10, k=3)
            assert (len(opened) > before) == (host == "native"), (pol.name, host)   # that scheduler decided
            j = g.to_json()
            # (wait_s is timing; so is `late` on CUDA, where a hit waits only if its copy has not landed yet)
            got[host] = (g.tokens, g.stats.counts["bytes_read"], j["pcie_bytes_per_token"],
                         {k: v for k, v in g.stats.counts.items() if k not in ("wait_s", "late")},
                         j["evictions"], j["wasted_prefetch_mib"], j["peak_pool_bytes"], j["mib_read"])
        assert got["python"] == got["native"], pol.name
        assert got["python"][4] > 0, pol.name   # the pool evicted
    eng.configure(host="python")
    with pytest.raises(SpecPrefetchError, match="host 'c': choose from python, native"):
        eng.configure(host="c")


@NATIVE
@pytest.mark.parametrize("instant", [True, False], ids=["landed", "in-flight"])
def test_native_copy_io_decodes_as_the_python_one(tiny_models, stores, tiny_adapter, cuda_standin, instant,
                                                  monkeypatch):
    """native_io.NativeCopyIO (the copy IO under the driver's calls: android_runner/src/cuda_copy_io.cpp) on the CPU,
    through the stand-in driver (tests/cuda_standin.py: its copies real memcpys, its events completing at once
    or only when the test lands them), under both schedulers (the native one calls it with no crossing into
    Python): transformers' tokens, and the Python IO's counts, copies and evictions for every kind of policy, the
    static decoder's graph loop (the slot numbers from the IO, the verification's rows too) and transformers'
    modules (the slots' bytes read through the scheduler); every slot holds its expert's bytes; each copy is one
    memcpy; the copy and stall figures read its events, which come from a pool; copies still in flight are waited
    for (stalls), landed ones not."""
    from toolkit.runtime import cuda_driver, native_io
    from toolkit.runtime.gpu_bench import gpu_predictors, gpu_reuse_table

    so = cuda_standin
    so.standin_instant(int(instant))
    monkeypatch.setattr(GpuEngine, "_driver", lambda self: cuda_driver.Driver(so))
    if not instant:   # the "device" has run everything once the run reads its figures
        real_ms = native_io.NativeCopyIO._ms
        monkeypatch.setattr(native_io.NativeCopyIO, "_ms",
                            lambda self, *a: (so.standin_land_all(), real_ms(self, *a))[1])
    ios = []
    io_init = native_io.NativeCopyIO.__init__
    monkeypatch.setattr(native_io.NativeCopyIO, "__init__",
                        lambda self, *a, **kw: (ios.append(self), io_init(self, *a, **kw))[1])
    spec = inspect_model_dir(tiny_models["qwen3_moe"])
    names = ["on-demand+lru", "adapter+reuse", "oracle+belady", "draft+lru"]
    pols = [Policy.parse(n) for n in names]
    prompt = list(range(5, 17))
    want = _reference(tiny_models["qwen3_moe"], prompt, 10, "cpu", "float32")
    try:
        for decode in ("static", "modules"):
            eng = GpuEngine(load_model(tiny_models["qwen3_moe"], dtype="float32"),
                            ExpertStore(stores["qwen3_moe"], spec), RunConfig(policy=pols[0], pool_mib=64.0),
                            device="cpu", decode=decode, with_draft=True,
                            predictors=gpu_predictors(spec, [p.predictor for p in pols], tiny_adapter),
                            reuse=gpu_reuse_table(spec, ["reuse"], tiny_adapter))
            for pol in pols if decode == "static" else pols[1:2]:
                got = {}
                for host in ("python", "native"):
                    for io in ("python", "native"):
                        eng.configure(policy=pol, pool_mib=_pool_mib(eng, 0.2), host=host)
                        if io == "python":
                            with monkeypatch.context() as m:
                                m.setattr(GpuEngine, "_driver", lambda self: None)
                                g = eng.run(prompt, 10, k=3)
                            j = g.to_json()
                            assert j["copy_ms_per_token"] >= 0 and j["stall_ms_per_token"] == 0
                        else:
                            before, waits = len(ios), so.standin_waits()
                            so.standin_count_size(ctypes.c_size_t(eng.store.blob_size))
                            g = eng.run(prompt, 10, k=3)
                            j = g.to_json()
                            assert len(ios) > before, (decode, pol.name, host)   # that IO copied
                            nio = ios[-1]
                            # (the record pass's IO too, where the policy has one: the oracle)
                            assert so.standin_sized_copies() == sum(x.mark()[0] for x in ios[before:]) > 0
                            assert nio.copied_bytes == nio.mark()[0] * eng.store.blob_size
                            # events that complete go back to the pool (in flight, those the graph loop's syncs
                            # land); a pair recycled before it was read would be timed across other records: the
                            # stand-in's clock gives every copy and stall 0.5 ms exactly
                            ncopy, nstall = nio.mark()
                            if instant:   # (with no pool: two events a copy)
                                assert nio.events_made < ncopy / 2, (nio.events_made, ncopy)
                            assert (nio.copy_ms(), nio.stall_ms()) == (0.5 * ncopy, 0.5 * nstall)
                            where = nio.where
                            assert where and all(torch.equal(nio.views[i][:eng.store.blob_size], eng.host.blob(key))
                                                 for key, i in where.items()), (decode, pol.name, host)
                            # landed copies are not waited for; in flight, the reads wait (timed as stalls)
                            assert (so.standin_waits() > waits) == (not instant), (decode, pol.name, host)
                            assert (j["stall_ms_per_token"] > 0) == (not instant), (decode, pol.name, host)
                            assert j["copy_ms_per_token"] > 0
                        assert g.tokens == want, (decode, pol.name, host, io)
                        counts = {k: v for k, v in g.stats.counts.items() if k not in ("wait_s", "late")}
                        got[host, io] = (counts, j["pcie_bytes_per_token"], j["evictions"], j["wasted_prefetch_mib"])
                assert len(set(map(repr, got.values()))) == 1, (decode, pol.name, got)
                assert got["python", "python"][2] > 0, pol.name   # the pool evicted
    finally:
        so.standin_instant(0)


@CUDA
def test_driver_launch_decodes_as_torchs_calls_on_cuda(tiny_models, stores, tiny_adapter, monkeypatch):
    """`configure(launch="driver")` (the default: the per-layer path's graph launches, copies and events through
    the CUDA driver, toolkit/runtime/cuda_driver.py) decodes transformers' tokens with torch's calls' decisions
    (`launch="torch"`) for every kind of policy, the device plan's rows and the draft's verification included:
    the same counts, copies and evictions; the segments' graphs are launched by the driver (torch's replay runs
    only for the draft's own step), and the copies, waits and their events are the native copy IO's
    (native_io.NativeCopyIO), whose events come from a pool."""
    from toolkit.runtime.gpu_bench import gpu_predictors, gpu_reuse_table
    from toolkit.runtime.native_io import NativeCopyIO

    replays, ios = [], []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda g: (replays.append(g), replay(g))[1])
    for cls in (CudaCopyIO, NativeCopyIO):
        monkeypatch.setattr(cls, "__init__", lambda self, *a, _init=cls.__init__, **kw: (
            ios.append(self), _init(self, *a, **kw))[1])
    spec = inspect_model_dir(tiny_models["qwen3_moe"])
    names = ["on-demand+lru", "adapter+reuse", "oracle+belady", "draft+lru"]
    pols = [Policy.parse(n) for n in names]
    eng = GpuEngine(load_model(tiny_models["qwen3_moe"], dtype="float16"), ExpertStore(stores["qwen3_moe"], spec),
                    RunConfig(policy=pols[0], pool_mib=64.0), device="cuda", decode="graph", with_draft=True,
                    predictors=gpu_predictors(spec, [p.predictor for p in pols], tiny_adapter),
                    reuse=gpu_reuse_table(spec, ["reuse"], tiny_adapter))
    if eng.launch_fallback:
        pytest.skip(f"the driver's calls do not load here: {eng.launch_fallback}")
    prompt = list(range(5, 17))
    want = _reference(tiny_models["qwen3_moe"], prompt, 10, "cuda", "float16")
    for pol in pols:
        got = {}
        for launch in ("torch", "driver"):
            eng.configure(policy=pol, pool_mib=_pool_mib(eng, 0.2), launch=launch)
            replays.clear()
            g = eng.run(prompt, 10, k=3)
            j = g.to_json()
            assert g.tokens == want and j["launch"] == launch, (pol.name, launch)
            # under the driver torch replays the draft's own step alone, never a segment
            draft = eng._runners[eng.capacity].draft.graph
            assert all(r is draft for r in replays) == (launch == "driver"), (pol.name, launch)
            assert bool(replays) == (launch == "torch" or pol.predictor == "draft"), (pol.name, launch)
            # the copies, waits and events: the native library's (native_io.py) under the driver's calls
            io = ios[-1]
            assert isinstance(io, NativeCopyIO) == (launch == "driver"), (pol.name, launch)
            if launch == "driver":
                assert io.mark()[0] > 0 and io.events_made < io.mark()[0], (pol.name, io.events_made, io.mark())
            else:
                assert io.copies and all(isinstance(e, torch.cuda.Event) for pair in io.copies + io.stalls
                                         for e in pair)
            assert j["copy_ms_per_token"] > 0, (pol.name, launch)
            got[launch] = ({k: v for k, v in g.stats.counts.items() if k not in ("wait_s", "late")},
                           j["pcie_bytes_per_token"], j["evictions"], j["wasted_prefetch_mib"])
        assert got["torch"] == got["driver"], pol.name
        assert got["torch"][2] > 0, pol.name   # the pool evicted
    for launch in ("torch", "driver"):   # the resident graph, one launch a token
        eng.configure(policy=pols[0], pool_mib=_pool_mib(eng, 1.0), launch=launch)
        replays.clear()
        assert eng.generate(prompt, 10, preload=True, resident_graph=True).tokens == want, launch
        assert bool(replays) == (launch == "torch"), launch
    with pytest.raises(SpecPrefetchError, match="launch 'cuda': choose from driver, torch"):
        eng.configure(launch="cuda")
    # where the driver's calls do not load, the engine takes torch's, says why, and refuses the driver's
    from toolkit.runtime import gpu

    def absent(device):
        raise SpecPrefetchError("launch=driver: cannot load the CUDA driver (a test)")
    with monkeypatch.context() as m:
        m.setattr(gpu, "driver", absent)
        eng2 = GpuEngine(load_model(tiny_models["qwen3_moe"], dtype="float16"),
                         ExpertStore(stores["qwen3_moe"], spec), RunConfig(policy=pols[0], pool_mib=64.0),
                         device="cuda", decode="graph")
        assert (eng2.launch, eng2.launch_fallback) == ("torch", "launch=driver: cannot load the CUDA driver (a test)")
        replays.clear()
        g = eng2.run(prompt, 10)
        assert g.tokens == want and g.to_json()["launch"] == "torch" and replays
        with pytest.raises(SpecPrefetchError, match="cannot load the CUDA driver"):
            eng2.configure(launch="driver")
    # the driver there, but no native library to build (the copy IO's): torch's calls too, and why in one line
    monkeypatch.setattr(gpu, "native_library", lambda: (_ for _ in ()).throw(SpecPrefetchError(NO_COMPILER)))
    eng3 = GpuEngine(load_model(tiny_models["qwen3_moe"], dtype="float16"), ExpertStore(stores["qwen3_moe"], spec),
                     RunConfig(policy=pols[0], pool_mib=64.0), device="cuda", decode="graph")
    assert (eng3.launch, eng3.launch_fallback) == ("torch", "launch=driver: the native copy IO cannot be built: "
                                                            + NO_COMPILER.removeprefix("host=native: "))


def test_launch_is_a_setting_and_a_bench_variant(tiny_models, stores, monkeypatch):
    """`launch` on the CPU (no CUDA calls to make: both settings decode alike), refused when unknown; `bench gpu
    --variant launch=torch` gives every policy a row of its own, refused for its default."""
    from toolkit.runtime.gpu_bench import run_gpu_bench
    from toolkit.runtime.policy import VARIANT_TAG, parse_policies

    eng = _engine(tiny_models["qwen3_moe"], stores["qwen3_moe"], "on-demand+lru", 0.25, "cpu")
    with pytest.raises(SpecPrefetchError, match="launch 'cuda': choose from driver, torch"):
        eng.configure(launch="cuda")
    assert eng.launch == "driver" and eng.launch_fallback is None
    seen = []   # (policy, launch) of every configured run: each row gets its own calls
    configure = GpuEngine.configure
    monkeypatch.setattr(GpuEngine, "configure", lambda self, **kw: (
        seen.append((kw["policy"].name, kw["launch"])) if "launch" in kw else None, configure(self, **kw))[1])
    r = run_gpu_bench(tiny_models["qwen3_moe"], store=stores["qwen3_moe"], adapter=None,
                      policies=parse_policies("on-demand+lru,oracle+belady"), fractions=[0.2], prompts=1,
                      prompt_tokens=8, new_tokens=4, repeats=1, ks=(2,), device="cpu", variants=("launch=torch",),
                      log=lambda s: None)
    rows = {x["policy"]: x for x in r["rows"]}
    assert r["tokens_match_transformers"] and set(rows) >= {
        "on-demand+lru", f"on-demand+lru{VARIANT_TAG}launch=torch", "oracle+belady",
        f"oracle+belady{VARIANT_TAG}launch=torch"}, set(rows)
    assert {"torch", "driver"} == {c for _, c in seen} and {p for p, c in seen if c == "torch"} == {
        "on-demand+lru", "oracle+belady"}
    assert r["launch"] is None and r["launch_fallback"] is None   # (the CPU makes no CUDA calls)
    _bench_refuses(tiny_models, stores, "on-demand+lru", "launch=driver", "driver is every row's own")
    # the report's header names the calls: the driver's, or torch's and why (nothing on the CPU)
    from toolkit.runtime import gpu
    from toolkit.runtime.gpu_bench import markdown

    r = json.loads((Path(__file__).resolve().parents[1] / "docs/img/gpu-bench-h100-driver-1.json").read_text())
    assert "calls" not in markdown(r).split("\n\n")[0]
    assert ", compiled (inductor), the driver's calls, the draft's" in markdown({**r, "launch": "driver"})
    why = "launch=driver: cannot load the CUDA driver (a test)"
    assert f"torch's calls ({why})," in markdown({**r, "launch": "torch", "launch_fallback": why})
    # where every row takes torch's calls already, a launch=torch variant is refused before anything loads
    monkeypatch.setattr(gpu, "launch_fallback", lambda dev: why)
    _bench_refuses(tiny_models, stores, "next-gate+prediction", "window=1,launch=torch",
                   r"^--variant launch=torch,window=1: every row takes torch's calls on this machine already")


def _count_native_schedulers(monkeypatch) -> list:
    """A list that grows by one for every native scheduler opened from now on."""
    from toolkit.runtime import native_sched

    opened, init = [], native_sched.NativeScheduler.__init__

    def counted(self, **kw):
        opened.append(kw["policy"])
        init(self, **kw)

    monkeypatch.setattr(native_sched.NativeScheduler, "__init__", counted)
    return opened


def _bench_refuses(tiny_models, stores, policies: str, variant: str, match: str) -> None:
    """`bench gpu` with `policies` and `--variant variant` refuses before any run, in one line matching `match`."""
    from toolkit.runtime.gpu_bench import run_gpu_bench
    from toolkit.runtime.policy import parse_policies

    with pytest.raises(SpecPrefetchError, match=match):
        run_gpu_bench(tiny_models["qwen3_moe"], store=stores["qwen3_moe"], adapter=None,
                      policies=parse_policies(policies), fractions=[0.2], device="cpu",
                      variants=(variant,), log=lambda s: None)


def test_gpu_bench_plans_on_the_host_as_a_variant(tiny_models, stores, monkeypatch):
    """`bench gpu --variant plan=host`: each predicting policy also runs with its rows folded on the host (the
    router's input read back: PrefetchPlanner.plan) beside the default rows computed on the device, in the same
    rounds, with the same copies and hits; on-demand and the oracle, which fold nothing, get no such row."""
    from toolkit.runtime import planner as planner_mod
    from toolkit.runtime.gpu_bench import run_gpu_bench
    from toolkit.runtime.policy import VARIANT_TAG, parse_policies

    hosts, device = [], []
    real, real_sorted = planner_mod.PrefetchPlanner.plan, planner_mod.PrefetchPlanner.plan_sorted
    monkeypatch.setattr(planner_mod.PrefetchPlanner, "plan",
                        lambda self, *a, **kw: (hosts.append(self.source), real(self, *a, **kw))[1])
    monkeypatch.setattr(planner_mod.PrefetchPlanner, "plan_sorted",
                        lambda self, *a, **kw: (device.append(self.source), real_sorted(self, *a, **kw))[1])
    r = run_gpu_bench(tiny_models["qwen3_moe"], store=stores["qwen3_moe"], adapter=None,
                      policies=parse_policies("on-demand+lru,next-gate+prediction,oracle+belady"), fractions=[0.2],
                      prompts=1, prompt_tokens=8, new_tokens=6, repeats=1, ks=(2,), device="cpu",
                      variants=("plan=host", "plan=inline"), log=lambda s: None)
    rows = {x["policy"]: x for x in r["rows"]}
    assert r["tokens_match_transformers"] and len(rows) == 5, list(rows)
    dev = rows["next-gate+prediction"]
    for v in ("host", "inline"):
        x = rows[f"next-gate+prediction{VARIANT_TAG}plan={v}"]
        assert (dev["hit_rate"], dev["pcie_mib_per_token"]) == (x["hit_rate"], x["pcie_mib_per_token"]), v
    assert any(getattr(s, "name", None) == "next-gate" for s in hosts)   # the variant's rows planned on the host
    assert any(getattr(s, "name", None) == "next-gate" for s in device)  # and the default rows from the device
    _bench_refuses(tiny_models, stores, "previous-token+prediction", "plan=inline",
                   r"no policy's predictor folds its rows \(plan=inline")
    _bench_refuses(tiny_models, stores, "next-gate+prediction", "plan=device", "device is every row's own")


@NATIVE
def test_gpu_bench_runs_every_policy_on_the_native_host(tiny_models, stores, monkeypatch):
    """`bench gpu --variant host=native`: every policy (on-demand and the oracle too, which take no other setting)
    gets a row with the native runner's scheduler in the same rounds, its copies and hits the Python row's."""
    from toolkit.runtime.gpu_bench import run_gpu_bench
    from toolkit.runtime.policy import VARIANT_TAG, parse_policies

    opened = _count_native_schedulers(monkeypatch)
    r = run_gpu_bench(tiny_models["qwen3_moe"], store=stores["qwen3_moe"], adapter=None,
                      policies=parse_policies("on-demand+lru,next-gate+prediction,oracle+belady"), fractions=[0.2],
                      prompts=1, prompt_tokens=8, new_tokens=6, repeats=1, ks=(2,), device="cpu",
                      variants=("host=native",), log=lambda s: None)
    rows = {x["policy"]: x for x in r["rows"]}
    assert r["tokens_match_transformers"] and len(rows) == 6
    assert set(opened) == {"lru", "prediction", "belady"}   # each policy's variant row ran on the native host
    for name in ("on-demand+lru", "next-gate+prediction", "oracle+belady"):
        py, nat = rows[name], rows[f"{name}{VARIANT_TAG}host=native"]
        assert (py["hit_rate"], py["pcie_mib_per_token"]) == (nat["hit_rate"], nat["pcie_mib_per_token"]), name
    _bench_refuses(tiny_models, stores, "on-demand+lru", "host=rust", "host must be native")
    _bench_refuses(tiny_models, stores, "on-demand+lru", "host=python", "python is every row's own")


def test_pdl_only_on_cuda_and_where_not_turned_off(monkeypatch):
    """Programmatic dependent launch (gpu_kernels.PDL): never for CPU tensors (the interpreter's path), and
    not on a GPU when SPECPREFETCH_PDL=0 turned it off; a value of neither 0 nor 1 refused in one line (at a
    launch; `run --device cuda` and `bench gpu` before anything loads: below); the launch options follow."""
    from toolkit.runtime import gpu_kernels as K

    assert K.pdl(torch.zeros(1)) is False
    assert K.launch_opts(False) == {} and K.launch_opts(True) == {"launch_pdl": True}
    assert [K.pdl_setting(v) for v in (None, "1", " 0 ", "0", "off", "true", "")] == [True, True, False, False,
                                                                                      None, None, None]
    monkeypatch.setattr(K, "PDL", None)   # (an SPECPREFETCH_PDL of neither: refused where it would apply)
    assert K.pdl(torch.zeros(1)) is False
    with pytest.raises(SpecPrefetchError, match="SPECPREFETCH_PDL=.*0 .plain launches. or 1"):
        K.check_pdl_setting()
    if torch.cuda.is_available():
        with pytest.raises(SpecPrefetchError, match="SPECPREFETCH_PDL=.*0 .plain launches. or 1"):
            K.pdl(torch.zeros(1, device="cuda"))
        monkeypatch.setattr(K, "PDL", False)
        assert K.pdl(torch.zeros(1, device="cuda")) is False
        monkeypatch.setattr(K, "PDL", True)
        hopper = torch.version.hip is None and torch.cuda.get_device_capability()[0] >= 9
        assert K.pdl(torch.zeros(1, device="cuda")) == hopper


def test_a_bad_pdl_setting_is_refused_before_anything_loads(monkeypatch, tmp_path):
    """`run --device cuda` (engines.gpu_engine) and `bench gpu` (run_gpu_bench) refuse an SPECPREFETCH_PDL of
    neither 0 nor 1 in one line before the model is read (the model loaders fail the test if reached; the CUDA
    device stood in for, so this runs without a GPU)."""
    from toolkit import engines
    from toolkit.models import loader
    from toolkit.runtime import gpu, gpu_kernels as K
    from toolkit.runtime.gpu_bench import run_gpu_bench
    from toolkit.runtime.policy import parse_policies

    def reached(*a, **kw):
        raise AssertionError("the model was read before the setting was checked")

    monkeypatch.setattr(K, "PDL", None)
    monkeypatch.setattr(K, "_PDL_ENV", "yes")
    monkeypatch.setattr(loader, "inspect_model_dir", reached)
    monkeypatch.setattr(loader, "load_model", reached)
    monkeypatch.setattr(gpu, "Device", lambda device: None)
    with pytest.raises(SpecPrefetchError, match="^SPECPREFETCH_PDL='yes': 0 .plain launches. or 1 .the default.$"):
        engines.gpu_engine(tmp_path, device="cuda", policy="on-demand+lru", adapter=None, store_path=None, dtype=None,
                           pool_mib=None, window=2, min_confidence=0.0, draft_k=2)
    with pytest.raises(SpecPrefetchError, match="^SPECPREFETCH_PDL='yes'"):
        run_gpu_bench(tmp_path, store=None, adapter=None, policies=parse_policies("on-demand+lru"), fractions=[0.5],
                      device="cuda")
    monkeypatch.setattr(K, "PDL", True)   # (the same calls get past the check: to the model, here the stub)
    with pytest.raises(AssertionError, match="the model was read"):
        run_gpu_bench(tmp_path, store=None, adapter=None, policies=parse_policies("on-demand+lru"), fractions=[0.5],
                      device="cuda")


def test_router_one_block_bounds():
    """gpu_router.one_block: a one-kernel router (at most MAX_ROUTER_KIB) in one block up to ROUTER_TILE
    elements (its experts padded to a power of two of at least 16, times the padded row), the two-kernel path's
    programs (ROUTER_BLOCK_E experts) up to ROUTER_LOGITS_TILE (8 x 2048 in one block, 8 x 4096 loops); an
    explicit tile overrides either bound."""
    from toolkit.runtime import gpu_router as R

    assert R.one_block(32, 1024, 2 ** 16) and not R.one_block(64, 1024, 2 ** 17)
    assert R.one_block(8, 1000, 16000) and R.one_block(20, 1000, 40000)      # (padded: 16 x 1024, 32 x 1024)
    assert not R.one_block(40, 1000, 80000)                                    # (64 x 1024)
    assert not R.one_block(8, 4096, 2 ** 16)           # (the experts padded to 16: 16 x 4096; unpadded 8 x 4096 fits)
    assert not R.one_block(24, 1025, 24 * 1025 * 2)    # (32 x 2048; unpadded 24 x 1025 = 24,600 fits)
    assert R.one_block(128, 2048, 2 ** 19) and not R.one_block(128, 4096, 2 ** 20)
    assert R.one_block(128, 4096, 2 ** 20, 2 ** 15) and not R.one_block(32, 1024, 2 ** 16, 2 ** 14)
    assert R.one_kernel(128 * 1024) and not R.one_kernel(128 * 1024 + 1)


def test_kernel_sweep_report_and_refusal(tmp_path, capsys, monkeypatch):
    """python -m toolkit.runtime.gpu_kernel_sweep: each kernel's default and fastest tiling marked in its table
    (by shape), a plot written; bad options, an existing file that is no sweep report and (without CUDA) the
    machine refused in one line before any work, nothing written."""
    from toolkit.runtime import gpu_kernel_sweep as S

    rows = [{"kernel": "router", "shape": "32x1024 top-4", "tiling": "one block, 8 warps", "default": True,
             "us": 4.5, "gbps": 15},
            {"kernel": "router", "shape": "32x1024 top-4", "tiling": "loops, 8 warps", "default": False,
             "us": 6.9, "gbps": 10},
            {"kernel": "o_proj", "shape": "1 x [1024, 1024]", "tiling": "-/-/-/-", "default": True, "us": 3.2,
             "gbps": 664},
            {"kernel": "o_proj", "shape": "1 x [1024, 1024]", "tiling": "2/1024/4/1", "default": False, "us": 2.4,
             "gbps": 874}]
    md = S.markdown({"device": "test", "rows": rows})
    assert "| one block, 8 warps (default, best) | 4.50 |" in md and "| 2/1024/4/1 (best) | 2.40 |" in md
    assert "| loops, 8 warps | 6.90 |" in md and "| -/-/-/- (default) | 3.20 |" in md
    S.plot({"device": "test", "rows": rows}, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0   # (its bars: not read back)
    # a tiling that resolves to the default's own configuration is not timed twice
    assert S._distinct([(None,) * 4, (4, 512, 4, 3), (2, 512, 4, 3)], (4, 512, 4, 3)) == [(None,) * 4, (2, 512, 4, 3)]
    # where `pre` holds a program's rows whole, BLOCK_N is unused: such tilings timed once, labelled without it
    # (4 x 2,048 whole; 16 x 2,048 past the bound, looping in blocks)
    tl = [(None,) * 4, (4, 1024, 4, 3), (4, 512, 4, 3), (16, 512, 4, 3)]
    assert S.whole_rows(tl, 1536, True) == [(None,) * 4, (4, None, 4, 3), (16, 512, 4, 3)]
    assert S.whole_rows(tl, 1536, False) == tl and S.whole_rows(tl, 4096, True)[1:] == tl[1:]
    # (and (4, None, 4, 3) is then the default's own configuration: slot_rows drops it)
    assert S._distinct(S.whole_rows(tl, 1536, True), (4, None, 4, 3)) == [(None,) * 4, (16, 512, 4, 3)]
    # bad input and an existing file: one line, exit status 2, nothing written or replaced
    out, other = tmp_path / "s.json", tmp_path / "other.json"
    other.write_text("{}")
    for argv, msg in ((["--reps", "0"], "--reps 0: must be at least 1"),
                      (["--top-k", "40"], "--top-k 40 of --experts 32"),
                      (["--heads", "16", "--kv-heads", "3"], "--heads 16: not a multiple of --kv-heads 3"),
                      (["--json", str(other)], "other.json")):
        assert S.main(["--json", str(out), *argv]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err
    assert not out.exists() and other.read_text() == "{}"
    if not torch.cuda.is_available():
        assert S.main(["--json", str(out)]) == 2
        err = capsys.readouterr().err
        assert "needs CUDA and Triton" in err and err.count("\n") == 1 and not out.exists()
    # the report to /dev/null: the JSON in place, no .md or .png (the table printed from the rows), and the
    # "wrote" line names what was written (the sweep itself stood in for: no GPU needed)
    monkeypatch.setattr(S, "sweep", lambda *a, **kw: rows)
    monkeypatch.setattr(S, "_cuda_pdl", lambda: True)
    monkeypatch.setattr(S.K, "triton", S.K.triton or object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a test GPU")
    assert S.main(["--json", "/dev/null"]) == 0
    printed = capsys.readouterr().out
    assert "| 2/1024/4/1 (best) | 2.40 |" in printed and "programmatic dependent launch" in printed
    assert printed.rstrip().endswith("wrote /dev/null"), printed
    assert S.main(["--json", str(out)]) == 0 and out.with_suffix(".md").exists() and out.with_suffix(".png").exists()
    assert json.loads(out.read_text())["launch_pdl"] is True and f"wrote {out}, " in capsys.readouterr().out
    from toolkit.artifacts.reports import report_claim

    assert report_claim(out) is None   # (its claims end with the in-process main)
    # a bad SPECPREFETCH_PDL: refused in one line before the sweep's work, nothing written
    monkeypatch.setattr(S.K, "PDL", None)
    monkeypatch.setattr(S.K, "_PDL_ENV", "yes")
    monkeypatch.setattr(S, "sweep", lambda *a, **kw: pytest.fail("swept before the setting was checked"))
    fresh = tmp_path / "fresh.json"
    assert S.main(["--json", str(fresh)]) == 2 and not fresh.exists()
    err = capsys.readouterr().err
    assert "SPECPREFETCH_PDL='yes'" in err and err.count("\n") == 1, err
