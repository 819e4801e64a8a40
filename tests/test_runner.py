"""The reference runner: one decode loop over step graphs, experts through the pool, on real models,
real stores, real O_DIRECT reads and real bundles. Tokens are checked against transformers' own
`generate`; the event log is held to being deterministic; `run` on a model and on a bundle prints none
of the libraries' noise on stderr."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from conftest import HELDOUT
import test_cli
from test_cli import EXE, FAMILY
from export.session import open_session, reference_tokens
from toolkit.cli import main
from toolkit.errors import SpecPrefetchError
from toolkit.models.loader import inspect_model_dir
from toolkit.models.tiny import TINY_FAMILIES, build_tiny
from toolkit.predictors.registry import PREDICTORS
from toolkit.runtime.events import EventLog, decisions
from toolkit.runtime.expert_store import build_store
from toolkit.runtime.policy import Policy, parse_policies
from toolkit.runtime.pool import EVICTION_POLICIES
from toolkit.runtime.runner import RunConfig

PROMPT = "The kernel's memory allocator"

store = test_cli.store  # the fixture (a tiny model's store, built by the CLI), re-exported


@pytest.fixture(scope="module")
def emb_store(embedded, tmp_path_factory) -> Path:
    return build_store(inspect_model_dir(embedded), tmp_path_factory.mktemp("s") / "e.spx", "fp16", progress=False)


@pytest.fixture(scope="module")
def emb_trace_adapter(embedded, tmp_path_factory):
    from adapters.train import TrainConfig, train_adapter
    from toolkit.traces.capture import TraceSettings, run_trace

    t = run_trace(embedded, [HELDOUT], tmp_path_factory.mktemp("rt") / "t",
                  TraceSettings(max_sequences=30, prompt_tokens=64, decode_tokens=8, heldout_frac=0.2,
                                hidden_sample=0.5, batch=8), progress=False)   # batched: the same experts, faster
    ad = tmp_path_factory.mktemp("ad") / "a"
    train_adapter(t, ad, TrainConfig(steps=60, val_every=20, batch_size=128, rank=16), progress=False)
    return t, ad


@pytest.fixture(scope="module")
def emb_session(embedded, emb_store, emb_trace_adapter):
    trace, ad = emb_trace_adapter
    return open_session(embedded, RunConfig(policy=Policy("on-demand", "lru"), pool_mib=1.0),
                        predictors=list(PREDICTORS), adapter=ad, store=emb_store, frequency_trace=trace,
                        max_seq=64, progress=False)


def _matrix(pools: tuple[float, float], full: bool) -> list[tuple[str, str, float]]:
    """Every predictor x eviction; at both pools (full) or alternating between them."""
    out = []
    n = 0
    for pred in PREDICTORS:
        for ev in EVICTION_POLICIES:
            for pool in (pools if full else (pools[n % 2],)):
                out.append((pred, ev, pool))
            n += 1
    return out


def _check_policies(session, ids: list[int], ref: list[int], matrix, new_tokens: int) -> None:
    rec = session.runner.record(ids, new_tokens)
    assert rec.tokens == ref
    for pred, ev, pool in matrix:
        session.runner.configure(policy=Policy(pred, ev), pool_mib=pool)
        g = session.runner.run(ids, new_tokens, recorded=rec)
        assert g.tokens == ref, (pred, ev, pool)
        st = g.stats
        assert 0 < st.peak_pool_bytes <= st.budget_bytes == int(pool * 2**20), (pred, ev, pool)
        assert 0.0 <= st.hit_rate <= 1.0 and 0.0 <= st.prefetch_recall <= 1.0 and st.mib_read > 0
        if pred == "on-demand":
            assert st.counts["prefetch_issued"] == 0 and st.prefetch_recall == 0.0
        if pred == "oracle" and ev == "belady" and pool >= 2.0:  # 0.5 MiB holds just one layer's top-4
            assert st.hit_rate >= 0.9


# ~20 s; test_bundle_runs_give_the_unmodified_models_tokens and the native tests keep the guarantee in make test
@pytest.mark.slow
def test_every_policy_gives_the_unmodified_models_tokens(emb_session):
    ids = emb_session.encode(PROMPT)
    ref = reference_tokens(emb_session.source_model, ids, 10)
    _check_policies(emb_session, ids, ref, _matrix((0.5, 2.0), full=False), 10)


@pytest.mark.slow
def test_every_policy_at_two_pools_model_directory(emb_session):
    ids = emb_session.encode(PROMPT)
    ref = reference_tokens(emb_session.source_model, ids, 16)
    _check_policies(emb_session, ids, ref, _matrix((0.5, 2.0), full=True), 16)


def test_the_runner_never_holds_the_experts(emb_session):
    backend = emb_session.runner.backend
    params = [(n, p) for g in backend.graphs.values() for n, p in g.named_parameters()]
    assert not [n for n, _ in params if ".experts." in n]
    assert not [n for n, p in params if p.is_meta]
    unique = {p.data_ptr(): p.numel() for _, p in params}  # graphs share modules (embeddings, norms)
    assert sum(unique.values()) < 3_200_000  # 18.4M with the experts (the adapter's folded heads: about 0.33M)


def test_the_oracle_bounds_the_baseline(emb_session):
    ids = emb_session.encode(PROMPT)
    rec = emb_session.runner.record(ids, 12)
    stats = {}
    for pol in ("on-demand+lru", "next-gate+prediction", "oracle+belady"):
        emb_session.runner.configure(policy=Policy.parse(pol), pool_mib=1.0)
        stats[pol] = emb_session.runner.run(ids, 12, recorded=rec).stats
    assert stats["on-demand+lru"].counts["misses"] > stats["oracle+belady"].counts["misses"]
    assert stats["on-demand+lru"].hit_rate < stats["next-gate+prediction"].hit_rate < 1.0
    assert stats["oracle+belady"].prefetch_recall > 0.9
    assert stats["next-gate+prediction"].mib_read_per_token > 0


def test_event_logs_are_deterministic_and_tell_policies_apart(emb_session):
    """Decisions never depend on read timing: the reader process, reader threads, and reads paced
    to a phone's flash all give the same log (timings aside)."""
    from toolkit.runtime.profiles import SNAPDRAGON_8_ELITE

    ids = emb_session.encode(PROMPT)
    logs = {}
    for pol, io, flash in (("adapter+prediction", "process", None), ("adapter+prediction", "threads", None),
                           ("adapter+prediction", "process", SNAPDRAGON_8_ELITE), ("next-gate+lru", "process", None)):
        emb_session.runner.configure(policy=Policy.parse(pol), pool_mib=0.75, io=io, flash_profile=flash)
        ev = EventLog()
        emb_session.runner.run(ids, 8, events=ev)
        logs.setdefault(pol, []).append(ev.lines)
    emb_session.runner.configure(io="process", flash_profile=None)
    a, b, c = logs["adapter+prediction"]
    assert decisions(a) == decisions(b) == decisions(c)
    assert a != c  # the timings did differ
    assert decisions(a) != decisions(logs["next-gate+lru"][0])
    kinds = {ln.split()[1] for ln in a if ln[0].isdigit()}
    assert {"hit", "miss", "prefetch", "ready", "evict"} <= kinds
    assert a[0].startswith("# specprefetch-events 1 policy=adapter+prediction")
    # every eviction names its victim and the expert that needed the slot
    ev_lines = [ln for ln in a if " evict " in ln]
    assert ev_lines and all(" for=" in ln for ln in ev_lines)
    # tokens are logged in order
    toks = [ln for ln in a if ln.startswith("token ")]
    assert [int(t.split()[1]) for t in toks] == list(range(len(toks))) and len(toks) == 8


@pytest.mark.parametrize("fam", TINY_FAMILIES)
def test_every_family_matches_transformers(tiny_models, tmp_path, fam):
    spec = inspect_model_dir(tiny_models[fam])
    store = build_store(spec, tmp_path / "s.spx", "fp16", progress=False)
    s = open_session(tiny_models[fam], RunConfig(policy=Policy("next-gate", "prediction"), pool_mib=0.15),
                     predictors=["next-gate", "oracle"], store=store, max_seq=32, progress=False)
    prompt = [11, 200, 37, 905, 14, 77]
    ref = reference_tokens(tiny_models[fam], prompt, 10)
    assert s.runner.run(prompt, 10).tokens == ref
    s.runner.configure(policy=Policy("oracle", "belady"))
    assert s.runner.run(prompt, 10).tokens == ref


def test_gpt_oss_uses_the_configs_swiglu_limit(tmp_path):
    """The runtime once clamped GPT-OSS experts at 7.0 whatever the config said. The runner follows
    the config (as OpenAI's reference code does; transformers 5.17 hard-codes 7.0, so with another
    limit `--check` against transformers reports a difference: docs/families.md)."""
    p = build_tiny("gpt_oss", tmp_path / "g", seed=3)
    cfg = json.loads((p / "config.json").read_text())
    cfg["swiglu_limit"] = 0.3
    (p / "config.json").write_text(json.dumps(cfg))
    spec = inspect_model_dir(p)
    tc = spec.family.text_config(spec.config)
    store = build_store(spec, tmp_path / "s.spx", "fp16", progress=False)
    s = open_session(p, RunConfig(policy=Policy("on-demand", "lru"), pool_mib=0.15), store=store, max_seq=32,
                     progress=False)
    st = s.runner.store
    x = torch.randn(1, spec.geometry.hidden_size) * 4
    got = s.runner.experts.expert(x, st.read(0, 1))
    mats = st.weights(0, 1)
    assert torch.allclose(got, spec.family.expert_forward(mats, x, tc), atol=1e-6)
    assert not torch.allclose(got, spec.family.expert_forward(mats, x, None), atol=1e-3)  # the 7.0 clamp
    # and it reaches the output: the 0.3-limit model decodes other tokens than the 7.0 one would
    prompt = [5, 17, 300, 42, 8]
    limited = s.runner.run(prompt, 8).tokens
    s.runner.backend.graphs["expert"].tc = None
    assert s.runner.run(prompt, 8).tokens != limited


def test_int4_store_is_policy_invariant(embedded, tmp_path):
    store = build_store(inspect_model_dir(embedded), tmp_path / "q.spx", "int4", progress=False)
    s = open_session(embedded, RunConfig(policy=Policy("on-demand", "lru"), pool_mib=64),
                     predictors=["next-gate", "previous-token"], store=store, max_seq=32, progress=False)
    ids = s.encode("To open a file")
    resident = s.runner.run(ids, 10).tokens
    for pred, pool in [("next-gate", 0.5), ("previous-token", 1.5)]:
        s.runner.configure(policy=Policy(pred, "lru"), pool_mib=pool)
        assert s.runner.run(ids, 10).tokens == resident


def test_configure_is_checked(emb_session):
    r = emb_session.runner
    with pytest.raises(SpecPrefetchError, match="holds 3 expert slots of 120 KiB, but one layer needs 4"):
        r.configure(pool_mib=0.4)
    with pytest.raises(SpecPrefetchError, match="--pool-mib nan"):
        r.configure(pool_mib=float("nan"))
    with pytest.raises(SpecPrefetchError, match="--window 0"):
        r.configure(window=0)
    with pytest.raises(SpecPrefetchError, match="unknown predictor 'psychic'"):
        parse_policies("on-demand+lru,psychic+lru")
    with pytest.raises(SpecPrefetchError, match="unknown eviction 'fifo'"):
        Policy.parse("next-gate+fifo")
    before = r.cfg
    with pytest.raises(SpecPrefetchError):
        r.configure(pool_mib=0.01)
    assert r.cfg == before


# -- the CLI -------------------------------------------------------------------------------------

def test_cli_run_model_with_events_and_rss(emb_store, emb_trace_adapter, tmp_path):
    _, ad = emb_trace_adapter
    out, ev = tmp_path / "r.json", tmp_path / "e.log"
    args = ["run", "embedded", "--store", str(emb_store), "--adapter", str(ad), "--policy", "adapter+prediction",
            "--pool-mib", "1", "--prompt", "The kernel", "--prompt", "To open a file", "--max-new-tokens", "6",
            "--max-seq", "32", "--read-budget-kib", "off", "--json", str(out), "--events", str(ev)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["policy"] == "adapter+prediction" and len(d["runs"]) == 2
    for run in d["runs"]:
        for key in ("tokens", "ttft_ms", "tpot_ms", "tpot_p50_ms", "tpot_p95_ms", "stall_ms_per_token", "hit_rate",
                    "mib_read", "peak_pool_bytes", "budget_bytes", "prefetch_precision", "prefetch_recall",
                    "wasted_prefetch_mib", "evictions", "direct_io"):
            assert key in run, key
        assert run["matches_unmodified_model"] is True  # --check is on by default for the embedded model
        assert run["peak_pool_bytes"] <= run["budget_bytes"] == 2**20
    assert d["peak_rss_bytes"] > 50 * 2**20  # VmHWM of a process holding torch (measured before --check)
    lines = ev.read_text().splitlines()
    assert [ln.split()[1] for ln in lines if ln.startswith("seq ")] == ["0", "1"]
    # the same command again: the same decisions
    ev2 = tmp_path / "e2.log"
    r = CliRunner().invoke(main, args[:-1] + [str(ev2), "--overwrite"])  # the same --json: a report of run
    assert r.exit_code == 0, r.output
    assert decisions(lines) == decisions(ev2.read_text().splitlines())


@pytest.mark.parametrize("args,message", [
    (["--pool-mib", "nan"], "'nan': must be a finite number"),
    (["--pool-mib", "inf"], "'inf': must be a finite number"),
    (["--pool-mib", "abc"], "'abc' is not a number"),
    (["--pool-mib", ""], "is not a number"),
    (["--window", "0"], "--window"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--policy", "psychic+lru"], "unknown predictor 'psychic'"),
    (["--store", "missing.spx"], "--store missing.spx: no such expert store"),
    (["--pool-mib", "0.2", "--policy", "on-demand+lru"], "use at least"),
])
def test_cli_run_refuses_bad_options_in_one_line(args, message, tmp_path):
    r = CliRunner().invoke(main, ["run", "embedded", "--prompt", "x", "--json", str(tmp_path / "x.json"), *args])
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_no_library_noise_on_stderr(tiny_models, store, embedded_bundles, tmp_path):
    """torchao's "Failed to load ... .so", torch's pytree deprecation notes and ExecuTorch's
    cpuinfo probing are not the user's business; progress bars and our own lines are."""
    runs = [["run", tiny_models[FAMILY], "--store", store, "--policy", "on-demand+lru", "--prompt", "The kernel",
             "--max-new-tokens", "3", "--json", tmp_path / "a.json"],
            ["run", embedded_bundles["executorch"], "--policy", "next-gate+prediction", "--prompt", "The kernel",
             "--max-new-tokens", "3", "--no-check", "--json", tmp_path / "b.json"]]
    for args in runs:
        r = subprocess.run([str(EXE), *map(str, args)], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        for noise in ("Failed to load", "_pytree", "cpuinfo", "threadpool.cpp", "Warning", "deprecated"):
            assert noise not in r.stderr, (noise, r.stderr)
        assert " -> " in r.stdout and "TPOT" in r.stdout


# -- bundles: the same loop over ExecuTorch and QNN graphs ----------------------------------------

BUNDLE_PREDICTORS = ("on-demand", "next-gate", "fate", "previous-token", "oracle")  # next-gate: the graphs' heads


# the QNN bundle on the HTP simulator (~30 s) is in make test-all; make demo runs it too
@pytest.mark.parametrize("target", ["executorch", pytest.param("qnn", marks=pytest.mark.slow)])
def test_bundle_runs_give_the_unmodified_models_tokens(target, embedded_bundles, embedded):
    s = open_session(embedded_bundles[target], RunConfig(policy=Policy("on-demand", "lru"), pool_mib=1.0),
                     predictors=list(BUNDLE_PREDICTORS), progress=False)
    assert s.kind == "bundle" and s.is_embedded and s.default_pool_mib > 0
    assert s.runner.predictors["next-gate"] == "graph"  # the layer graphs' preds rows, as on the phone
    ids = s.encode(PROMPT)
    ref = reference_tokens(embedded, ids, 10)
    every = 2 if target == "executorch" else 5  # the HTP simulator is slow: fewer runs in make test
    # reuse needs the adapter's table, which this bundle (next-gate heads) lacks: tests/test_native_runner.py
    # and tests/test_reuse.py give it one; the other four cycle against the predictors (4 and 5 are coprime)
    evictions = [ev for ev in EVICTION_POLICIES if ev != "reuse"]
    matrix = [(p, ev, (0.5, 2.0)[n % 2]) for n, (p, ev) in
              enumerate((p, ev) for p in BUNDLE_PREDICTORS for ev in evictions) if n % every == 0]
    matrix.append(("oracle", "belady", 2.0))
    _check_policies(s, ids, ref, matrix, 10)
    with pytest.raises(SpecPrefetchError, match="drop --adapter / --store"):
        open_session(embedded_bundles[target], RunConfig(), store=Path("x.spx"))
    with pytest.raises(SpecPrefetchError, match="adapter policy needs the adapter's heads"):
        open_session(embedded_bundles[target], RunConfig(policy=Policy("adapter", "lru")))


def test_bundle_and_model_directory_make_the_same_decisions(embedded_bundles, embedded, emb_store):
    """The event log is the contract: the eager graphs and the ExecuTorch program, same policy and
    budget, decide the same reads. Next-gate comes from the program's own preds rows on the bundle
    and from the host's folded router matrices on the model directory: the same math, two paths."""
    logs = []
    for src, kw in ((embedded_bundles["executorch"], {}), (embedded, {"store": emb_store, "max_seq": 64})):
        s = open_session(src, RunConfig(policy=Policy("next-gate", "prediction"), pool_mib=0.75),
                         predictors=["next-gate"], progress=False, **kw)
        ev = EventLog()
        s.runner.run(s.encode(PROMPT), 8, events=ev)
        logs.append(decisions(ev.lines))
    assert logs[0] == logs[1]


@pytest.mark.parametrize("target", ["executorch", pytest.param("qnn", marks=pytest.mark.slow)])
def test_cli_run_bundle(target, embedded_bundles, tmp_path):
    out, ev = tmp_path / "r.json", tmp_path / "e.log"
    r = CliRunner().invoke(main, ["run", str(embedded_bundles[target]), "--policy", "next-gate+prediction",
                                  "--prompt", PROMPT, "--max-new-tokens", "6", "--json", str(out),
                                  "--events", str(ev)])
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["policy"] == "next-gate+prediction" and len(d["runs"]) == 1  # one shape for one prompt or several
    d = d["runs"][0]
    assert d["matches_unmodified_model"] is True and d["source"] == str(embedded_bundles[target])
    m = json.loads((embedded_bundles[target] / "manifest.json").read_text())
    assert d["budget_bytes"] == int(m["runtime"]["pool_mib"] * 2**20)  # the bundle's own default
    assert ev.read_text().startswith("# specprefetch-events 1 policy=next-gate+prediction")
    r = CliRunner().invoke(main, ["run", str(embedded_bundles[target]), "--policy", "draft+lru", "--prompt", "x",
                                  "--json", str(tmp_path / "d.json")])
    assert r.exit_code == 2 and "draft predictor needs the model directory" in r.output


@pytest.mark.slow
@pytest.mark.parametrize("target", ["executorch", "qnn"])
def test_bundle_with_adapter_every_policy_at_two_pools(target, embedded, emb_trace_adapter, tmp_path):
    from export.bundle import ExportConfig, export_bundle

    trace, ad = emb_trace_adapter
    b = tmp_path / target
    export_bundle(embedded, b, ExportConfig(target=target, max_seq=64, progress=False), adapter=ad)
    names = [p for p in PREDICTORS if p != "draft"]  # the draft needs the model's weights
    s = open_session(b, RunConfig(policy=Policy("on-demand", "lru"), pool_mib=1.0), predictors=names,
                     frequency_trace=trace, progress=False)
    assert s.runner.predictors["adapter"] == "graph"
    ids = s.encode(PROMPT)
    ref = reference_tokens(embedded, ids, 16)
    _check_policies(s, ids, ref, [(p, ev, pool) for p, ev, pool in _matrix((0.5, 2.0), full=True) if p != "draft"],
                    16)


@pytest.mark.slow  # ~11 s; `make bench` runs this command at full size
def test_cli_bench_side_by_side(emb_store, emb_trace_adapter, tmp_path):
    _, ad = emb_trace_adapter
    out = tmp_path / "b.json"
    r = CliRunner().invoke(main, ["bench", "cpu", "embedded", "--adapter", str(ad), "--store", str(emb_store),
                                  "--policies", "on-demand+lru,adapter+prediction,oracle+belady", "--pool-mib", "1",
                                  "--prompts", "1", "--new-tokens", "5", "--rounds", "1", "--no-simulate",
                                  "--json", str(out)])
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["checked_against_unmodified_model"] is True and d["direct_io"] is True
    pols = d["points"][0]["policies"]
    assert set(pols) == {"on-demand+lru", "adapter+prediction", "oracle+belady"}
    assert all(v["runs"] == 1 and v["tpot_ms"] > 0 for v in pols.values())
    assert pols["oracle+belady"]["hit_rate"] > pols["on-demand+lru"]["hit_rate"]
    assert pols["on-demand+lru"]["prefetch_recall"] == 0.0
    md = out.with_suffix(".md").read_text()
    assert "| 1 | adapter+prediction |" in md and out.with_suffix(".png").stat().st_size > 5000
    for bad, msg in (("1,x", "'x' is not a number"), ("nan", "'nan': must be a finite number")):
        r = CliRunner().invoke(main, ["bench", "cpu", "--pool-mib", bad, "--json", str(tmp_path / "x.json")])
        assert r.exit_code == 2 and msg in r.output and "Traceback" not in r.output
