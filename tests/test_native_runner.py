"""The native C++ runner (android_runner/) against the Python reference runner and transformers.

One host build of the runner for the shared fp32 ExecuTorch bundle (next-gate heads in the layer
graphs, routers in host.safetensors); every predictor the bundle serves with the prediction eviction
and next-gate with Belady's at a pool (make test-all: every predictor x every eviction policy, a second
pool and prompt): the same tokens as the reference runner and
as transformers' generate, the same event
log line for line (timings and printed confidences aside), the same decode counts, and a peak pool
within the budget. Then refusals (tampered bundle, corrupt store, bad options, a runner generated
for another bundle): one line naming the file or option, exit 1, no crash. The arm64 build under
qemu-aarch64 is in `make test-all`.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from android_runner.build import build, command, config_header
from export.session import open_session, reference_tokens
from toolkit.runtime.events import EventLog, decisions
from toolkit.runtime.policy import Policy
from toolkit.runtime.runner import RunConfig

from cli_helpers import cli

PROMPTS = [[591, 906, 531, 1274, 2295, 1062], [17, 402, 9, 1500]]
NEW = 8
PREDICTORS = ("on-demand", "next-gate", "fate", "previous-token", "oracle")
EVICTIONS = ("lru", "lfu", "prediction", "belady")
POOLS = (2.0, 3.5)  # 16 and 29 of the 256 expert slots: eviction every token


@pytest.fixture(scope="module")
def native(native_host) -> tuple[Path, Path]:
    """(bundle, runner build directory): conftest's session-wide host runner for the fp32 bundle."""
    return native_host


def run_native(native, *args, check=True):
    """The runner on the bundle; without a read budget unless `args` give one (its default, auto, follows the
    measured compute time: decisions the reference's, with none, can be compared with)."""
    bundle, out = native
    budget = () if "--read-budget-kib" in args else ("--read-budget-kib", "off")
    r = subprocess.run([*command(out, "host"), str(bundle), *budget, *map(str, args)], capture_output=True,
                       text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def reference(embedded_bundles):
    """The Python reference runner on the same bundle (reader threads, as the native lanes)."""
    return open_session(embedded_bundles["executorch"], RunConfig(policy=Policy("on-demand", "lru"), io="threads"),
                        predictors=list(PREDICTORS[1:]))


def native_run(native, tmp_path, policy, pool, prompts=PROMPTS, *extra):
    js, ev = tmp_path / f"{policy}-{pool}.json", tmp_path / f"{policy}-{pool}.log"
    args = [a for ids in prompts for a in ("--prompt-ids", ",".join(map(str, ids)))]
    run_native(native, *args, "--max-new-tokens", NEW, "--policy", policy, "--pool-mib", pool,
               "--json", js, "--events", ev, *extra)
    return json.loads(js.read_text()), ev.read_text().splitlines()


def test_config_header_names_the_bundle(embedded_bundles):
    m = json.loads((embedded_bundles["executorch"] / "manifest.json").read_text())
    h = config_header(m)
    assert f'#define SPX_CONFIG_HASH "{m["model"]["config_hash"]}"' in h
    assert "#define SPX_NUM_EXPERTS 32" in h and "#define SPX_TOP_K 4" in h


@pytest.mark.parametrize("pool", [POOLS[0], pytest.param(POOLS[1], marks=pytest.mark.slow)])
def test_same_tokens_decisions_and_counts_as_the_reference(native, reference, embedded, tmp_path, pool):
    prompts = PROMPTS if pool != POOLS[0] else PROMPTS[:1]  # make test: one prompt; test-all's second pool: both
    refs = [reference_tokens(embedded, ids, NEW) for ids in prompts]
    budget = int(pool * 2**20)
    # make test: every predictor with the prediction eviction and Belady's (6 pairs; LRU end to end in
    # test_reuse_eviction_decides_as_the_reference[next-gate], LFU in test_prefill's unchunked next-gate+lfu,
    # both in test_native_scheduler's cases); test-all: all 20
    pairs = [(p, e) for p in PREDICTORS for e in EVICTIONS]
    if pool == POOLS[0]:
        pairs = [(p, "prediction") for p in PREDICTORS] + [("next-gate", "belady")]
    for pred, ev in pairs:
        policy = f"{pred}+{ev}"
        out, lines = native_run(native, tmp_path, policy, pool, prompts)
        reference.runner.configure(policy=Policy.parse(policy), pool_mib=pool)
        log = EventLog()
        gens = [reference.runner.run(ids, NEW, events=log) for ids in prompts]
        assert out["policy"] == policy
        for g, r, ref in zip(gens, out["runs"], refs):
            assert r["tokens"] == g.tokens == ref, policy
            assert 0 < r["peak_pool_bytes"] <= budget == r["budget_bytes"], policy
            py = g.to_json()
            # every decision count agrees; `late` and `wait_s` are timing, not decisions
            for k in ("requests", "hits", "prefetch_hits", "misses", "prefetch_issued", "dropped_stale",
                      "dropped_low_conf", "dropped_no_slot", "dropped_late", "bytes_read"):
                assert r["counts"][k] == py["counts"][k], (policy, k)
            for k in ("hit_rate", "prefetch_precision", "prefetch_recall", "evictions", "mib_read",
                      "decode_tokens", "wasted_prefetch_mib", "peak_pool_bytes"):
                assert r[k] == py[k], (policy, k)
            assert set(py) <= set(r) | {"tokens"}  # the same keys as `specprefetch run`, and more
            assert len(r["stall_ms"]) == len(r["bytes_read"]) == r["decode_tokens"]
            assert sum(r["bytes_read"]) == r["counts"]["bytes_read"]
        assert decisions(lines) == decisions(log.lines), policy
        if pred == "on-demand":
            assert all(r["counts"]["prefetch_issued"] == 0 for r in out["runs"])


def _reuse_table():
    """A reuse table learned from skewed synthetic routing (8 layers x 32 experts, top-4): some experts
    hot, so histories differ in what they predict; with frequency classes, as `train` learns it."""
    import numpy as np

    from adapters.reuse import learn_class_reuse_table

    rng = np.random.default_rng(0)
    p = np.linspace(3.0, 0.2, 32)
    p /= p.sum()
    seqs = [np.stack([np.stack([rng.choice(32, 4, replace=False, p=p) for _ in range(8)]) for _ in range(40)])
            for _ in range(6)]
    return learn_class_reuse_table(seqs, 32)


def _with_reuse(src: Path, b: Path, table: dict) -> Path:
    shutil.copytree(src, b)
    m = json.loads((b / "manifest.json").read_text())
    m["predictor"]["reuse"] = table
    (b / "manifest.json").write_text(json.dumps(m))
    return b


@pytest.fixture(scope="module")
def reuse_bundle(native, tmp_path_factory) -> Path:
    """The shared bundle with a reuse table (frequency classes included) in its manifest (as an export
    with an adapter writes it)."""
    return _with_reuse(native[0], tmp_path_factory.mktemp("reuse") / "bundle", _reuse_table().to_json())


@pytest.mark.parametrize("preds", [("next-gate",), pytest.param(("on-demand", "previous-token", "oracle"),
                                                                  marks=pytest.mark.slow)])
def test_reuse_eviction_decides_as_the_reference(native, reuse_bundle, embedded, tmp_path, preds):
    """The reuse eviction (histories and the learned table, with its frequency classes and without them)
    makes the same decisions in both engines, and they are not LRU's; the classes change them, and
    --no-reuse-classes (RunConfig.reuse_classes) on the table with them decides as the table without."""
    pool = POOLS[0]
    ref = reference_tokens(embedded, PROMPTS[0], NEW)
    whole = _with_reuse(reuse_bundle, tmp_path / "whole", _reuse_table().whole().to_json())
    names = [p for p in preds if p != "on-demand"]
    sessions = {b: open_session(b, RunConfig(policy=Policy("on-demand", "lru"), io="threads"), predictors=names)
                for b in (reuse_bundle, whole)}
    for pred in preds:
        lines_of = {}
        for b, ev, classes in ((reuse_bundle, "reuse", True), (reuse_bundle, "lru", True), (whole, "reuse", True),
                               (reuse_bundle, "reuse", False)):
            policy = f"{pred}+{ev}"
            out, lines = native_run((b, native[1]), tmp_path, policy, pool, PROMPTS[:1],
                                    *(() if classes else ("--no-reuse-classes",)))
            session = sessions[b]
            session.runner.configure(policy=Policy.parse(policy), pool_mib=pool, reuse_classes=classes)
            log = EventLog()
            g = session.runner.run(PROMPTS[0], NEW, events=log)
            assert out["runs"][0]["tokens"] == g.tokens == ref, policy
            assert decisions(lines) == decisions(log.lines), (policy, b)
            assert out["runs"][0]["counts"]["bytes_read"] == g.to_json()["counts"]["bytes_read"], policy
            lines_of[ev if b == reuse_bundle and classes else "whole" if classes else "off"] = lines
        evicts = {ev: [ln for ln in decisions(lines_of[ev]) if "evict" in str(ln)] for ev in lines_of}
        assert evicts["reuse"] and evicts["reuse"] != evicts["lru"], pred
        assert evicts["whole"] and evicts["whole"] != evicts["reuse"], pred
        assert decisions(lines_of["off"]) == decisions(lines_of["whole"]), pred


@pytest.fixture(scope="module", params=[1, 2], ids=["one-visit", "two-visits"])
def next_visit_bundle(reuse_bundle, tmp_path_factory, request) -> Path:
    """The reuse bundle with its preds rows (the next-gate heads of horizons 1 and 2) declared as (1, L),
    the second read as each layer's next-visit row (an older bundle's predictor.next_visit: true), or as
    (L, 2L), both read as its next two visits' rows (predictor.next_visits 2; then no window row).
    Wrong as a predictor, but both engines must make the same decisions from it, and other decisions
    than without it."""
    b = tmp_path_factory.mktemp("next-visit") / "bundle"
    shutil.copytree(reuse_bundle, b)
    m = json.loads((b / "manifest.json").read_text())
    L = len(m["model"]["moe_layers"])
    pred = m["predictor"]
    pred.pop("next_visits", None)
    if request.param == 1:
        pred["preds_rows"] = {k: [1, L] for k in pred["preds_rows"]}
        pred["next_visit"] = True
    else:
        pred["preds_rows"] = {k: [L, 2 * L] for k in pred["preds_rows"]}
        pred["next_visits"] = 2
    (b / "manifest.json").write_text(json.dumps(m))
    return b


def test_next_visit_eviction_decides_as_the_reference(native, next_visit_bundle, embedded, tmp_path):
    """The reuse eviction reading each layer's next-visit row makes the same decisions in both engines
    (and other evictions than with --no-next-visit); the tokens stay the model's. The 19-token prompt
    goes in prefill chunks of 8 (the chunk path's last-row prediction) and the rest one by one."""
    pool, policy = POOLS[0], "next-gate+reuse"
    prompt = PROMPTS[0] * 3 + [17]
    ref = reference_tokens(embedded, prompt, NEW)
    heads = json.loads((next_visit_bundle / "manifest.json").read_text())["predictor"].get("next_visits", 1)
    # (name, pool, RunConfig's, the native runner's): all the heads, none, and (two heads) the first only; and
    # (two heads) a pool of 64 slots, 8 a layer, where the sets are 2k (at 16 slots they are the layer's 2)
    configs = [("all", pool, {}, ()), ("off", pool, {"next_visit": False}, ("--no-next-visit",))] + \
        ([("one", pool, {"next_visits": 1}, ("--next-visits", "1")), ("wide", 8.0, {}, ())] if heads == 2 else [])
    evicts = {}
    for name, pool, py, args in configs:
        session = open_session(next_visit_bundle, RunConfig(policy=Policy.parse(policy), io="threads",
                                                            pool_mib=pool, **py))
        (tmp_path / name).mkdir()
        out, lines = native_run((next_visit_bundle, native[1]), tmp_path / name, policy, pool, [prompt], *args)
        log = EventLog()
        g = session.runner.run(prompt, NEW, events=log)
        assert out["runs"][0]["tokens"] == g.tokens == ref
        assert decisions(lines) == decisions(log.lines), name
        evicts[name] = [ln for ln in decisions(lines) if "evict" in str(ln)]
    assert evicts["all"] and evicts["all"] != evicts["off"]
    assert heads == 1 or (evicts["one"] not in (evicts["all"], evicts["off"]) and evicts["wide"])


@pytest.mark.slow
def test_an_exported_next_visit_adapter_decides_alike_in_both_engines(native, embedded, tmp_path):
    """A real export: an adapter trained with --next-visits 2 gives a bundle whose preds rows hold horizons
    L and 2L (predictor.next_visits); both engines make the same decisions with it, other ones than without."""
    from adapters.train import TrainConfig, train_adapter
    from conftest import HELDOUT
    from export.bundle import ExportConfig, export_bundle
    from toolkit.traces.capture import TraceSettings, run_trace

    trace = run_trace(embedded, [HELDOUT], tmp_path / "t", TraceSettings(
        max_sequences=8, prompt_tokens=32, decode_tokens=8, heldout_frac=0.25, hidden_sample=0.5), progress=False)
    train_adapter(trace, tmp_path / "a", TrainConfig(steps=30, val_every=10, batch_size=64, next_visits=2),
                  progress=False)
    b = tmp_path / "bundle"
    m = export_bundle(embedded, b, ExportConfig(target="executorch", max_seq=64, progress=False),
                      adapter=tmp_path / "a")
    L = len(m["model"]["moe_layers"])
    assert m["predictor"]["next_visits"] == 2 and m["predictor"]["horizons"] == [1, 2]
    assert all(hs == [1, 2, L, 2 * L] for hs in m["predictor"]["preds_rows"].values())
    pool, policy, prompt = POOLS[0], "adapter+reuse", PROMPTS[0] * 3 + [17]
    evicts = {}
    for on in (True, False):
        session = open_session(b, RunConfig(policy=Policy.parse(policy), io="threads", pool_mib=pool,
                                            next_visit=on))
        (tmp_path / str(on)).mkdir()
        out, lines = native_run((b, native[1]), tmp_path / str(on), policy, pool, [prompt],
                                *(() if on else ("--no-next-visit",)))
        log = EventLog()
        g = session.runner.run(prompt, NEW, events=log)
        assert out["runs"][0]["tokens"] == g.tokens
        assert decisions(lines) == decisions(log.lines), on
        evicts[on] = [ln for ln in decisions(lines) if "evict" in str(ln)]
    assert evicts[True] and evicts[True] != evicts[False]


def test_next_visit_rows_must_hold_horizon_L(native, next_visit_bundle, tmp_path):
    """predictor.next_visit(s) with a layer whose preds rows lack one of its visits' horizons (L, or 2L with
    two visits) is refused by both engines, naming the horizon."""
    b = tmp_path / "bundle"
    shutil.copytree(next_visit_bundle, b)
    m = json.loads((b / "manifest.json").read_text())
    L = len(m["model"]["moe_layers"])
    two = m["predictor"].get("next_visits") == 2
    first = next(iter(m["predictor"]["preds_rows"]))
    m["predictor"]["preds_rows"][first] = [L] if two else [1, 2]   # two visits: the second's row missing
    (b / "manifest.json").write_text(json.dumps(m))
    missing = f"lacks horizon {2 * L if two else L} "
    r = run_native((b, native[1]), "--prompt-ids", "1,2,3", "--max-new-tokens", 2, check=False)
    assert r.returncode != 0 and "predictor.next_visit" in r.stderr and missing in r.stderr, r.stderr
    from export.manifest import validate_bundle
    from toolkit.errors import SpecPrefetchError

    with pytest.raises(SpecPrefetchError, match=missing):
        validate_bundle(b, hash_store=False)


def test_reuse_eviction_without_a_table_is_an_error(native, embedded_bundles):
    r = run_native(native, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--policy", "on-demand+reuse",
                   check=False)
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("specprefetch-runner: error:")]
    assert r.returncode == 1 and len(err) == 1 and "reuse table" in err[0] and "manifest.json" in err[0], r.stderr
    from toolkit.errors import SpecPrefetchError
    with pytest.raises(SpecPrefetchError, match="reuse table"):
        open_session(embedded_bundles["executorch"], RunConfig(policy=Policy("on-demand", "reuse"), io="threads"))


@pytest.mark.parametrize("change,native_msg,py_msg", [
    (lambda t: t.update(visits16=t["visits16"][:-1]), "predictor.reuse.visits16", "visits16"),
    (lambda t: t["classes"][0].pop(), r"predictor.reuse.classes[0] must hold a class per expert", "experts"),
    (lambda t: t["classes"].pop(), "a list per MoE layer", "MoE layers"),
    (lambda t: t["classes"][1].__setitem__(0, 4), r"predictor.reuse.classes[1][0]", "class ids"),
    (lambda t: t.pop("class_visits16"), "come together", "class_visits16"),
    (lambda t: t["class_visits16"][2].pop(), r"predictor.reuse.class_visits16[2]", r"class_visits16\[2\]"),
], ids=["visits16", "classes-experts", "classes-layers", "class-id", "no-class-tables", "class-table"])
def test_a_malformed_reuse_table_is_refused(native, tmp_path, change, native_msg, py_msg):
    t = _reuse_table().to_json()
    change(t)
    b = _with_reuse(native[0], tmp_path / "b", t)
    r = subprocess.run([*command(native[1], "host"), str(b), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"],
                       capture_output=True, text=True, timeout=300)
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("specprefetch-runner: error:")]
    assert r.returncode == 1 and len(err) == 1 and native_msg in err[0] and "manifest.json" in err[0], r.stderr
    from toolkit.errors import SpecPrefetchError
    with pytest.raises(SpecPrefetchError, match=r"manifest.json: predictor.reuse: malformed reuse table: .*" + py_msg):
        open_session(b, RunConfig(policy=Policy("on-demand", "lru"), io="threads"))


def test_both_engines_run_a_bundle_with_its_exported_scheduler_settings(native, tmp_path):
    """`run BUNDLE` takes the window, queue depth, confidence thresholds and step budget the bundle was
    exported with in the Python engine as the native runner does; an option given overrides them in
    both, a default value given explicitly too."""
    from toolkit.runtime.expert_store import ExpertStore

    b = tmp_path / "b"
    shutil.copytree(native[0], b)
    m = json.loads((b / "manifest.json").read_text())
    slot = ExpertStore(b / m["runtime"]["expert_store"]).slot_bytes
    m["runtime"]["scheduler"].update(window=3, queue_depth=2, min_confidence=0.05, candidate_threshold=0.01,
                                     step_budget_bytes=2 * slot)  # two prefetches a step at most
    (b / "manifest.json").write_text(json.dumps(m))
    headers = {}
    for extra in ([], ["--window", "1", "--queue-depth", "5", "--min-confidence", "0.02"]):
        for engine in ("python", "native"):
            ev = tmp_path / f"{engine}-{len(extra)}.log"
            # in this process (the CLI's own path; a subprocess would pay torch's and ExecuTorch's imports)
            code, out = cli("run", b, "--engine", engine, "--policy", "next-gate+prediction", "--pool-mib", "2",
                            "--prompt", "The kernel's memory", "--max-new-tokens", "3", "--no-check",
                            "--read-budget-kib", "off", "--events", ev, "--json", ev.with_suffix(".json"), *extra)
            assert code == 0, out
            lines = ev.read_text().splitlines()
            headers[engine, len(extra)] = lines[0]
            headers[engine, len(extra), "decisions"] = decisions(lines)
    for n, want in ((0, " window=3 queue_depth=2 min_confidence=0.050 "),
                    (6, " window=1 queue_depth=5 min_confidence=0.020 ")):
        assert want in headers["python", n] and want in headers["native", n], (headers["python", n],
                                                                                headers["native", n])
        assert headers["python", n, "decisions"] == headers["native", n, "decisions"]
    # the step budget (not in the header) holds in both: at most two prefetches a step
    for n in (0, 6):
        per_step: dict[str, int] = {}
        for ln in headers["python", n, "decisions"]:  # "<step> prefetch <layer>:<expert> ..."
            parts = ln.split()
            if len(parts) > 1 and parts[1] == "prefetch":
                per_step[parts[0]] = per_step.get(parts[0], 0) + 1
        assert per_step and max(per_step.values()) <= 2, per_step


def test_read_budget_decides_as_the_reference(native, reference, embedded, tmp_path):
    """With a read budget of one expert slot a step, both engines drop the same prefetches as late (those
    that could not land by their deadline behind the prefetches already asked for; demand reads are not
    counted), issue the rest alike, and keep the unmodified model's tokens; without it nothing is
    dropped as late."""
    slot_kib = reference.runner.store.slot_bytes // 1024
    ref = reference_tokens(embedded, PROMPTS[0], NEW)
    policy = "next-gate+prediction"
    got = {}
    for rb in (None, slot_kib):
        extra = () if rb is None else ("--read-budget-kib", rb)
        (tmp_path / str(rb)).mkdir()
        out, lines = native_run(native, tmp_path / str(rb), policy, POOLS[0], PROMPTS[:1], *extra)
        reference.runner.configure(policy=Policy.parse(policy), pool_mib=POOLS[0], read_budget_kib=rb)
        try:
            log = EventLog()
            g = reference.runner.run(PROMPTS[0], NEW, events=log)
        finally:
            reference.runner.configure(read_budget_kib=None)  # the module's runner, shared by later tests
        r = out["runs"][0]
        assert r["tokens"] == g.tokens == ref
        assert decisions(lines) == decisions(log.lines)
        assert r["counts"]["dropped_late"] == g.to_json()["counts"]["dropped_late"]
        got[rb] = r["counts"]
    assert got[None]["dropped_late"] == 0
    budgeted = got[slot_kib]
    assert budgeted["dropped_late"] > 0 and budgeted["prefetch_issued"] > 0
    assert budgeted["prefetch_issued"] < got[None]["prefetch_issued"]
    refused = run_native(native, "--prompt-ids", "1,2", "--read-budget-kib", max(1, slot_kib - 1), check=False)
    assert refused.returncode != 0 and "--read-budget-kib" in refused.stderr
    assert "below one expert slot" in refused.stderr


def test_read_budget_measured_in_the_run(native, reference, embedded, tmp_path):
    """--read-budget-kib auto, the runner's default: both engines probe the flash's rate at start-up (or take
    --read-rate-mibs) and report the budget of the decode steps: that rate times their measured compute time, in
    whole KiB, at least one slot. At 0.001 MiB/s every measured step's budget is one slot, so both engines decide
    alike (no budget at the first step, one slot after) and drop prefetches as late; at 10^6 MiB/s none is
    dropped; the unmodified model's tokens every time. A policy that prefetches nothing probes nothing; a second
    prompt takes the first's probe ("cached"); the Python engine paced to a device's flash takes its rate."""
    from toolkit.errors import SpecPrefetchError
    from toolkit.runtime.profiles import SNAPDRAGON_8_ELITE
    from toolkit.runtime.runner import probe_reads

    ref = reference_tokens(embedded, PROMPTS[0], NEW)
    slot = reference.runner.store.slot_bytes
    slot_kib = -(-slot // 1024)
    policy = "next-gate+prediction"
    out, _ = native_run(native, tmp_path, policy, POOLS[0], PROMPTS[:1])   # the helper's: off
    assert out["runs"][0]["read_budget"] == {"mode": "off", "kib": None}
    bundle, build_dir = native
    js = tmp_path / "default.json"   # no option: the runner's default; two prompts, one probe
    subprocess.run([*command(build_dir, "host"), str(bundle), "--prompt-ids", ",".join(map(str, PROMPTS[0])),
                    "--prompt-ids", ",".join(map(str, PROMPTS[1])), "--max-new-tokens", str(NEW), "--policy", policy,
                    "--pool-mib", str(POOLS[0]), "--json", str(js)], check=True, capture_output=True, timeout=300)
    r, second = json.loads(js.read_text())["runs"]
    rb = probed = r["read_budget"]
    assert rb["mode"] == "auto" and rb["rate_from"] == "probe" and rb["read_mibs"] > 0 and rb["probe_ms"] > 0
    assert rb["probe_reads"] == probe_reads(8 * 32, slot) and rb["probe_lanes"] == 5
    assert rb["probe_bytes"] == rb["probe_reads"] * slot
    assert second["read_budget"]["rate_from"] == "cached" and second["read_budget"]["read_mibs"] == rb["read_mibs"]
    assert not any(k.startswith("probe_") for k in second["read_budget"])   # its reads were the first run's
    assert rb["steps"] == (len(r["tokens"]) - 1) * 8 and rb["step_ms"] > 0 and r["tokens"] == ref
    want = max(slot_kib, int(rb["read_mibs"] * 2**20 * rb["step_ms"] / 1e3 / 1024))
    assert abs(rb["kib"] - want) <= 1, (rb, want)   # the lower medians of the steps' budgets and times
    counts = {}
    for rate in ("0.001", "1000000"):
        out, lines = native_run(native, tmp_path, policy, POOLS[0], PROMPTS[:1], "--read-budget-kib", "auto",
                                "--read-rate-mibs", rate)
        reference.runner.configure(policy=Policy.parse(policy), pool_mib=POOLS[0], read_budget_kib="auto",
                                   read_rate_mibs=float(rate))
        try:
            log = EventLog()
            g = reference.runner.run(PROMPTS[0], NEW, events=log)
        finally:
            reference.runner.configure(read_budget_kib=None, read_rate_mibs=None)
        r = out["runs"][0]
        assert r["tokens"] == g.tokens == ref
        for rb in (r["read_budget"], g.read_budget):
            assert rb["mode"] == "auto" and rb["rate_from"] == "given" and rb["read_mibs"] == float(rate)
            assert "probe_reads" not in rb and rb["steps"] == (len(r["tokens"]) - 1) * 8
        if rate == "0.001":   # one slot at every measured step: decisions independent of the times
            assert r["read_budget"]["kib"] == g.read_budget["kib"] == slot_kib
            assert decisions(lines) == decisions(log.lines)
            assert lines[0].endswith(" read_budget=auto") and log.lines[0].endswith(" read_budget=auto")
            # the budget's one change (none, then one slot from the second MoE step on), logged alike
            assert [ln for ln in lines if " budget " in ln] == [f"1 budget kib={slot_kib}"]
        counts[rate] = r["counts"]
    assert counts["0.001"]["dropped_late"] > 0 == counts["1000000"]["dropped_late"]
    # the Python engine probes as the runner does (its reads, its lanes)
    reference.runner.configure(read_budget_kib="auto")
    try:
        g = reference.runner.run(PROMPTS[0], 3)
    finally:
        reference.runner.configure(read_budget_kib=None)
    py = g.read_budget
    assert py["rate_from"] in ("probe", "cached") and py["read_mibs"] > 0 and py["kib"] >= slot_kib
    if py["rate_from"] == "probe":   # (the module's runner may have probed in an earlier test)
        # the same reads; at the module runner's lanes: reader threads, one a queue slot (the runner's: one more)
        assert py["probe_reads"] == probed["probe_reads"]
        assert py["probe_lanes"] == reference.runner.cfg.queue_depth == probed["probe_lanes"] - 1
    # reads paced to a phone's flash: the budget takes the profile's rate at the pacing's queue depth
    reference.runner.configure(read_budget_kib="auto", flash_profile=SNAPDRAGON_8_ELITE)
    try:
        g = reference.runner.run(PROMPTS[0], 3)
    finally:
        reference.runner.configure(read_budget_kib=None, flash_profile=None)
    qd = reference.runner.cfg.queue_depth   # the threads reader's (the module's runner reads with threads)
    assert g.read_budget["rate_from"] == "profile"
    assert g.read_budget["read_mibs"] == SNAPDRAGON_8_ELITE.bandwidth_mibs(slot, qd)
    # on demand: nothing prefetched, nothing probed
    out, _ = native_run(native, tmp_path, "on-demand+lru", POOLS[0], PROMPTS[:1], "--read-budget-kib", "auto")
    assert out["runs"][0]["read_budget"] == {"mode": "auto", "kib": None, "read_mibs": None, "rate_from": "unused"}
    r = run_native(native, "--prompt-ids", "1,2", "--read-rate-mibs", "5", "--read-budget-kib", "off", check=False)
    assert r.returncode == 1 and "--read-rate-mibs: only with --read-budget-kib auto" in r.stderr
    for args, msg in ((("--read-rate-mibs", "2e9"), "--read-rate-mibs 2e9: MiB/s above 0 and at most 1e9"),
                      (("--read-rate-mibs", "-1"), "--read-rate-mibs -1: MiB/s above 0"),
                      (("--read-budget-kib", "lots"), "--read-budget-kib 'lots': KiB a step (a whole number), auto")):
        r = run_native(native, "--prompt-ids", "1,2", *args, check=False)
        assert r.returncode == 1 and msg in r.stderr.strip().splitlines()[-1], r.stderr
    for bad in ({"read_rate_mibs": float("inf")}, {"read_rate_mibs": 5.0, "read_budget_kib": None},
                {"read_budget_kib": "off"}):
        with pytest.raises(SpecPrefetchError, match="--read-(rate-mibs|budget-kib)"):
            RunConfig(**{"read_budget_kib": "auto", **bad})


def test_policies_differ_and_the_oracle_bounds_them(native, tmp_path):
    got = {p: native_run(native, tmp_path, p, POOLS[0])[0]["runs"][0]
           for p in ("on-demand+lru", "next-gate+prediction", "oracle+belady")}
    assert got["oracle+belady"]["counts"]["misses"] == 0
    assert got["oracle+belady"]["counts"]["bytes_read"] < got["on-demand+lru"]["counts"]["bytes_read"]
    assert got["next-gate+prediction"]["hit_rate"] > got["on-demand+lru"]["hit_rate"]


def test_report_fields(native, tmp_path):
    out, _ = native_run(native, tmp_path, "next-gate+prediction", POOLS[1], prompts=PROMPTS[:1])
    assert out["engine"] == "native" and out["kernel_isa"] in ("avx2", "avx_vnni", "avx512_vnni", "portable")
    assert out["peak_rss_bytes"] > out["arena_bytes"] > 0
    assert out["load_ms"] > 0 and isinstance(out["direct_io"], bool) and isinstance(out["io_note"], str)
    assert out["crc32_impl"] in ("pclmul", "armv8-crc", "portable")  # tests/test_native_crc32.py: which, and its sums
    r = out["runs"][0]
    assert r["ttft_ms"] >= r["prefill_ms"] > 0 and r["first_token_ms"] == pytest.approx(r["ttft_ms"], abs=1e-2)
    assert len(r["routing"]) == len(PROMPTS[0]) + NEW - 1 and len(r["routing"][0]) == 8 * 4


def test_routing_file_drives_the_oracle(native, tmp_path):
    """An oracle fed the recorded routing (--routing, what a device driver supplies) decides as the
    oracle that records its own first pass."""
    own, own_lines = native_run(native, tmp_path, "oracle+belady", POOLS[0], prompts=PROMPTS[:1])
    routing = tmp_path / "routing.json"
    routing.write_text(json.dumps({"routing": [[[r[i * 4:(i + 1) * 4] for i in range(8)]
                                                for r in own["runs"][0]["routing"]]]}))
    ev = tmp_path / "fed.log"
    run_native(native, "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-new-tokens", NEW, "--policy",
               "oracle+belady", "--pool-mib", POOLS[0], "--routing", routing, "--events", ev,
               "--json", tmp_path / "fed.json")
    assert decisions(ev.read_text().splitlines()) == decisions(own_lines)


def test_cli_run_engine_native(embedded_bundles, native, tmp_path):
    """`run --engine native --check` through the CLI (in this process: the command's code, the runner a
    subprocess of it; test_pool_auto runs the `specprefetch` entry point itself)."""
    js = tmp_path / "run.json"
    code, text = cli("run", embedded_bundles["executorch"], "--engine", "native", "--policy", "next-gate+prediction",
                     "--pool-mib", "3", "--prompt", "The kernel's memory", "--max-new-tokens", "6", "--check",
                     "--json", js)
    assert code == 0, text
    out = json.loads(js.read_text())
    assert out["engine"] == "native-host" and len(out["runs"]) == 1  # the shape of `specprefetch run`
    out = out["runs"][0]
    assert out["matches_unmodified_model"] is True and out["engine"] == "native-host"
    assert len(out["tokens"]) == 6 and "TPOT" in text


def test_cli_run_no_reuse_classes(native, reuse_bundle, tmp_path):
    """`run --no-reuse-classes` through the CLI, both engines: the bundle's table with its frequency classes
    decides as the same table without them, and other than with them."""
    whole = _with_reuse(reuse_bundle, tmp_path / "whole", _reuse_table().whole().to_json())
    got = {}
    for engine in ("native", "python"):
        for name, b, flag in (("classes", reuse_bundle, ()), ("off", reuse_bundle, ("--no-reuse-classes",)),
                              ("whole", whole, ())):
            ev, js = tmp_path / f"{engine}-{name}.log", tmp_path / f"{engine}-{name}.json"
            code, text = cli("run", b, "--engine", engine, "--policy", "next-gate+reuse", "--pool-mib", POOLS[0],
                             "--prompt", "The kernel's memory", "--max-new-tokens", NEW, "--no-check", *flag,
                             "--read-budget-kib", "off", "--events", ev, "--json", js)
            assert code == 0, text
            got[engine, name] = decisions(ev.read_text().splitlines())
        assert got[engine, "off"] == got[engine, "whole"] != got[engine, "classes"], engine
    assert got["native", "classes"] == got["python", "classes"] and got["native", "off"] == got["python", "off"]


def _corrupt(bundle: Path, tmp_path: Path, how: str) -> Path:
    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    if how == "manifest":
        m = json.loads((b / "manifest.json").read_text())
        m["runtime"]["pool_mib"] = 2.5
        m["files"]["graphs/model.pte"]["sha256"] = "0" * 64
        (b / "manifest.json").write_text(json.dumps(m))
    elif how == "blob":
        from toolkit.runtime.expert_store import ExpertStore

        entries = ExpertStore(b / "experts.spx").entries.values()
        with open(b / "experts.spx", "r+b") as f:  # one byte in every blob: whichever is read first
            for e in entries:
                f.seek(e.offset + 7)
                byte = f.read(1)
                f.seek(e.offset + 7)
                f.write(bytes([byte[0] ^ 0xFF]))
    elif how == "program":
        p = b / "graphs" / "model.pte"
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    return b


@pytest.mark.parametrize("how, extra, message", [
    ("manifest", [], "sha256"),
    ("program", [], "model.pte"),
    ("blob", ["--no-verify-hashes", "--policy", "on-demand+lru"], "checksum"),
])
def test_damaged_bundles_are_refused(native, tmp_path, how, extra, message):
    b = _corrupt(native[0], tmp_path, how)
    r = subprocess.run([*command(native[1], "host"), str(b), "--prompt-ids", "1,2,3", "--max-new-tokens", "4",
                        "--pool-mib", "8", *extra], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, (r.returncode, r.stderr)
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("specprefetch-runner: error:")]
    assert len(err) == 1 and message in err[0] and str(b) in err[0], r.stderr


@pytest.mark.parametrize("args, message", [
    (["--pool-mib", "0.1"], "--pool-mib"),
    (["--pool-mib", "nan"], "--pool-mib"),
    (["--policy", "adapter+lru"], "predictor 'adapter' is not available"),
    (["--policy", "next-gate+mru"], "unknown eviction"),
    (["--window", "0"], "--window"),
    (["--window", "9", "--policy", "oracle+lru"], "--window 9: must be 1..8"),
    (["--max-new-tokens", "4294967297"], "too large"),
    (["--max-new-tokens", "200"], "KV cache"),
    (["--prompt-ids", "99999"], "outside the vocabulary"),
    (["--routing", "/nonexistent.json", "--policy", "oracle+lru"], "/nonexistent.json"),
    (["--bogus"], "unknown option --bogus"),
    (["--prompt-ids", "1,2,"], "trailing comma"),
    (["--threads", "-1"], "--threads -1: must be >= 0"),
    (["--prompt", "some text"], "built without a tokenizer"),  # this module's runner takes ids only
])
def test_bad_options_are_one_line_errors(native, args, message):
    base = ["--prompt-ids", "1,2,3"] if "--prompt-ids" not in args else []
    r = run_native(native, *base, *args, check=False)
    assert r.returncode == 1, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and errors[0].startswith("specprefetch-runner: error: ") and message in errors[0], r.stderr
    assert "terminate" not in r.stderr


def test_a_runner_refuses_a_bundle_it_was_not_generated_for(native, tmp_path):
    b = tmp_path / "other"
    shutil.copytree(native[0], b)
    m = json.loads((b / "manifest.json").read_text())
    m["model"]["config_hash"] = "0123456789abcdef"
    (b / "manifest.json").write_text(json.dumps(m))
    r = subprocess.run([*command(native[1], "host"), str(b), "--prompt-ids", "1,2", "--no-verify-hashes"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "generated for another bundle" in r.stderr, r.stderr


def test_a_bundle_of_another_target_is_refused_by_the_build(native, tmp_path):
    from toolkit.errors import SpecPrefetchError

    b = tmp_path / "tflite"  # a target no runner runs (qnn bundles: tests/test_native_qnn.py)
    shutil.copytree(native[0], b)
    m = json.loads((b / "manifest.json").read_text())
    m["target"] = "tflite"
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SpecPrefetchError, match="a tflite bundle; the native runner runs executorch, qnn and qai-hub"):
        build(b, "host", tmp_path / "q")
    assert not (tmp_path / "q").exists()


def test_android_build_without_the_ndk_names_what_is_missing(native, monkeypatch, tmp_path):
    from toolkit.errors import SpecPrefetchError

    monkeypatch.delenv("ANDROID_NDK", raising=False)
    monkeypatch.delenv("ANDROID_NDK_HOME", raising=False)
    with pytest.raises(SpecPrefetchError, match="ANDROID_NDK"):
        build(native[0], "android", tmp_path / "a")


def test_a_build_is_reused_until_its_sources_change(native):
    bundle, out = native
    stamp = (out / ".stamp").read_text()
    t = (out / "bin" / "specprefetch-runner").stat().st_mtime_ns
    assert build(bundle, "host", out, log=lambda s: None) == out
    assert (out / "bin" / "specprefetch-runner").stat().st_mtime_ns == t and (out / ".stamp").read_text() == stamp


@pytest.mark.slow
def test_arm64_build_under_qemu_gives_the_same_tokens_and_decisions(native, tmp_path):
    """The cross-built arm64 runner, started as on a phone (its own loader and libraries beside it),
    under qemu-aarch64: NEON kernels, the same tokens and decisions as the host build."""
    if not shutil.which("qemu-aarch64") or not shutil.which("aarch64-linux-gnu-g++"):
        pytest.skip("qemu-user / g++-aarch64-linux-gnu not installed (make setup installs them)")
    bundle, host_out = native
    out = build(bundle, "arm64", tmp_path / "arm64", log=lambda s: None)  # with its C++ tokenizer
    assert (out / "run.sh").is_file() and (out / "lib" / "ld-linux-aarch64.so.1").is_file()
    text = "The kernel's memory, in 2 words"
    ids = Tokenizer.from_file(str(bundle / "model" / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    host, host_lines = native_run(native, tmp_path, "next-gate+prediction", POOLS[0], prompts=[ids])
    js, ev = tmp_path / "arm.json", tmp_path / "arm.log"
    r = subprocess.run([*command(out, "arm64"), str(bundle), "--prompt", text,
                        "--max-new-tokens", str(NEW), "--policy", "next-gate+prediction", "--pool-mib",
                        str(POOLS[0]), "--json", str(js), "--events", str(ev)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    arm = json.loads(js.read_text())
    assert arm["kernel_isa"].startswith("neon") and arm["runs"][0]["prompt_ids"] == ids
    assert arm["crc32_impl"] == "armv8-crc"  # every read checked with the CRC32 instructions
    assert arm["runs"][0]["tokens"] == host["runs"][0]["tokens"]
    assert decisions(ev.read_text().splitlines()) == decisions(host_lines)


def test_a_routing_file_of_another_run_is_refused(native, tmp_path):
    f = tmp_path / "short.json"
    f.write_text(json.dumps({"routing": [[[[0, 1, 2, 3]] * 8]]}))  # one position; the prompt alone feeds 3
    r = run_native(native, "--prompt-ids", "1,2,3", "--policy", "oracle+lru", "--routing", f, check=False)
    assert r.returncode == 1 and "has 1 positions of routing; a run of it feeds 3..34" in r.stderr, r.stderr


def test_a_corrupt_prefetched_blob_is_refused(native, tmp_path):
    """Only prefetched experts are corrupt (every MoE layer but the first; the oracle, fed a clean
    run's routing, prefetches them before their use): the run stops with the checksum error instead
    of computing with bad bytes, however early the read finished."""
    from toolkit.runtime.expert_store import ExpertStore

    clean, _ = native_run(native, tmp_path, "oracle+lru", POOLS[0], prompts=PROMPTS[:1])
    routing = tmp_path / "routing.json"
    routing.write_text(json.dumps({"routing": [clean["runs"][0]["routing"]]}))
    b = tmp_path / "b"
    shutil.copytree(native[0], b)
    st = ExpertStore(b / "experts.spx")
    with open(b / "experts.spx", "r+b") as f:
        for (layer, _), e in st.entries.items():
            if layer > 0:
                f.seek(e.offset + 11)
                byte = f.read(1)
                f.seek(e.offset + 11)
                f.write(bytes([byte[0] ^ 0xFF]))
    r = subprocess.run([*command(native[1], "host"), str(b), "--prompt-ids", ",".join(map(str, PROMPTS[0])),
                        "--max-new-tokens", str(NEW), "--policy", "oracle+lru", "--pool-mib", str(POOLS[0]),
                        "--routing", str(routing), "--no-verify-hashes", "--read-budget-kib", "off"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "failed its checksum" in r.stderr and "(a prefetched read)" in r.stderr, r.stderr


@pytest.mark.slow
def test_experts_too_large_for_the_default_pool_run(tiny_models, tmp_path):
    """Two experts of a layer's top-2 fill more than the runner's initial 8 MiB pool: the runner, which
    once refused such a bundle in its constructor whatever --pool-mib said, runs it at the pool it is
    given, with the Python engine's tokens."""
    from export.bundle import ExportConfig, export_bundle
    from toolkit.models.widen import widen_checkpoint
    from toolkit.runtime.expert_store import ExpertStore

    wide = tmp_path / "wide"
    widen_checkpoint(tiny_models["qwen3_moe"], wide, 12288, progress=False)
    b = tmp_path / "bundle"
    export_bundle(wide, b, ExportConfig(target="executorch", max_seq=32, progress=False))
    st = ExpertStore(b / "experts.spx")
    k = json.loads((b / "manifest.json").read_text())["routing"]["top_k"]
    assert k * st.slot_bytes > 8 * 2**20
    pool = k * st.slot_bytes / 2**20 + 0.01
    out = build(b, "host")
    r = run_native((b, out), "--prompt-ids", "1,2,3", "--max-new-tokens", 4, "--pool-mib", pool, "--json",
                   tmp_path / "run.json")
    session = open_session(b, RunConfig(policy=Policy("on-demand", "lru"), io="threads", pool_mib=pool))
    assert json.loads((tmp_path / "run.json").read_text())["runs"][0]["tokens"] == \
        session.runner.run([1, 2, 3], 4).tokens, r.stderr
