"""What the benches share in their run stage: the prompts, torch's compute threads, the simulator
replaying the same prompts, the per-key median over runs (toolkit/bench/__init__.py lists the benches)."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from toolkit.metrics import median


def bench_prompts(n: int, tokens: int, tokenizer) -> list[str]:
    """The first `tokens` tokens of the first n held-out documents of the embedded corpus."""
    from toolkit.embedded.report import HELDOUT

    out = []
    for line in HELDOUT.read_text().splitlines()[:: max(1, 100 // n)]:
        ids = tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"][:tokens]
        out.append(tokenizer.decode(ids))
        if len(out) == n:
            break
    return out


def torch_threads(n: int) -> None:
    """torch's compute threads for a measurement (the rest of the cores serve I/O), and a short
    switch interval so I/O threads publish completions promptly."""
    import torch

    torch.set_num_threads(max(1, n))
    sys.setswitchinterval(0.0002)


def medians(runs: Sequence[dict[str, Any]], keys: Iterable[str]) -> dict[str, float | None]:
    """Per key, the median (toolkit.metrics.median) of that figure over the runs (RunStats-like dicts)."""
    return {k: median([r[k] for r in runs]) for k in keys}


def simulate_same_prompts(model, texts, adapter, policies, pools, new_tokens, window, store,
                          profile=None, dtype: str = "fp16", queue_depth: int = 4,
                          runs: list[dict[str, Any]] | None = None,
                          prefill_chunks: Sequence[int] | None = None,
                          variants: dict[str, tuple[Any, dict[str, Any]]] | None = None,
                          settings: dict[str, Any] | None = None,
                          row_settings: Sequence[dict[str, dict[str, Any]]] | None = None,
                          calib_settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Trace the bench prompts and replay them under a device profile: `profile`, or this machine's
    calibrated for the reference runner; `window` and `queue_depth` the measured runs' scheduler's.
    `runs`, if given, one per prompt: a measured engine's `tokens` (new) and `routing` (per position,
    L * k expert ids): the trace then feeds those tokens (teacher-forced, so its router inputs are of
    the text the engine wrote) and the replay takes that engine's routing instead of `model`'s (a
    quantised bundle routes some tokens differently from the model it came from); with `prefill_chunks`
    too (the measured engine's prompt chunks), each replay starts from the pool its prefill left.
    `settings`: the measured runs' other scheduler settings (run_simulation's min_confidence,
    candidate_threshold, step_budget_kib: a bundle's, export.manifest.scheduler_defaults) for every replay.
    `variants`: more rows, label -> (a policy, scheduler settings laid over `window`, `queue_depth` and
    `settings` for it: runner bench --variant). `row_settings`: per pool, row label -> settings of that row's
    own runs (runner bench: the read budget each row's runs measured), laid over the rest; `calib_settings`:
    those of the runs the flash rate is fitted to (their replay's)."""
    from toolkit.runtime.policy import parse_policies
    from toolkit.simulate.calibrate import calibrate, fit_flash_rate
    from toolkit.simulate.replay import run_simulation
    from toolkit.traces.capture import TraceSettings, run_trace
    from toolkit.traces.format import TraceReader

    base = {k: v for k, v in (settings or {}).items()
            if k in ("min_confidence", "candidate_threshold", "step_budget_kib")}
    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "prompts.jsonl"
        data.write_text("".join(json.dumps({"text": t, **({"continuation_ids": list(r["tokens"])} if runs else {})})
                                + "\n" for t, r in zip(texts, runs or [{}] * len(texts))))
        trace = run_trace(model, [data], Path(d) / "trace",
                          TraceSettings(prompt_tokens=10_000, decode_tokens=new_tokens - 1, heldout_frac=0.0),
                          progress=False)
        routing = None
        warm_chunks = prefill_chunks if runs else None   # a prefilled pool needs the runs' own routing
        if runs:
            k = TraceReader(trace).top_k
            routing = {q: np.asarray(r["routing"], np.int64).reshape(len(r["routing"]), -1, k)
                       for q, r in enumerate(runs)}
        prof = profile or calibrate(model, store=store, out=Path(d) / "this-machine.json", progress=False)[0]

        def replay(pols, p, pool_mib: float, **kw) -> list[dict[str, Any]]:   # these prompts, these runs' settings
            return run_simulation(trace, policies=pols, profile=p, pool_mib=pool_mib, split="train", model=model,
                                  dtype=dtype, routing=routing, prefill_chunks=warm_chunks,
                                  **{"window": window, "queue_depth": queue_depth, **base, **kw})["results"]

        def oracle_tpot_ms(p) -> float:  # the calibration's perfect-prefetch run, replayed: its pool, these prompts
            pool = p.measured.get("oracle_pool_mib", p.measured["tiny_pool_mib"])
            return replay(parse_policies("oracle+belady"), p, pool, **(calib_settings or {}))[0]["tpot_ms"]

        pm = prof.measured or {}
        # only a profile calibrated on these very prompts (runner bench's calibrate_native records them): the
        # replay must be of the run the rate came from
        if pm.get("flash_rate_from") == "runner" and "tiny_pool_mib" in pm and "prompts" in pm:
            prof = fit_flash_rate(prof, oracle_tpot_ms)
        out = {"profile": prof.to_json(), "points": [],
               "routing": "the measured runs' (their tokens teacher-forced through the model)" if runs
               else "the model's own greedy decode of the prompts",
               "pool_at_first_token": "as the measured runs' prefill left it" if warm_chunks is not None
               else "empty"}
        for i, pool in enumerate(pools):
            own = row_settings[i] if row_settings else {}
            groups: dict[tuple, list] = {}   # policies replayed together: those with the same settings of their own
            for q in policies:
                groups.setdefault(tuple(sorted(own.get(q.name, {}).items())), []).append(q)
            rows = [(x["policy"], x) for kv, qs in groups.items()
                    for x in replay(qs, prof, pool, adapter=adapter, **dict(kv))]
            rows += [(label, replay([pol], prof, pool, adapter=adapter, **{**kv, **own.get(label, {})})[0])
                     for label, (pol, kv) in (variants or {}).items()]
            out["points"].append({"pool_mib": pool, "policies": {name: {
                k: x[k] for k in ("tpot_ms", "stall_ms_per_token", "hit_rate", "mib_read_per_token")}
                for name, x in rows}})
    return out
