"""llama.cpp and the native runner side by side under the same memory limit (issues 11 and 21).

For each bundle (an ExecuTorch bundle whose manifest names its source checkpoint), the same
prompts (one set per prompt length), greedy, the same number of new tokens, the same compute
threads, through four engines per thread count:

- ``llama.cpp``: llama-completion on the source checkpoint in GGUF, default mmap loading. The GGUF
  is of the bundle's expert precision class, made by llama.cpp's own tools from the same checkpoint
  (f16: convert_hf_to_gguf; int8: llama-quantize Q8_0 of that f16; int4: llama-quantize Q4_0), and
  runs with llama.cpp's CPU weight repacking on (`toolkit.peers.llamacpp`, REPACK_CRASH);
- ``llama.cpp:read-around-off``: the same, with fault read-around off on its model mapping
  (madvise(MADV_RANDOM) through an LD_PRELOAD shim, `llamacpp.readaround_shim`): each page fault
  reads its page only, instead of up to read_ahead_kb around it;
- ``native:resident`` (no limit only): every expert read into the pool before the prompt (``--preload``),
  as llama.cpp reads its model at load: both TTFTs exclude the load (the warm comparison)
- ``native:on-demand+lru`` and ``native:<graph predictor>+prediction`` (``adapter`` for a bundle
  exported with an adapter): the native runner (android_runner) with O_DIRECT expert reads through
  a pool sized to fit the limit.

Every run is one process started through `memlimit.run_limited`: a cgroup v1 memory limit that
charges page cache, a cold page cache before each run (drop_caches as root), peak RSS and bytes
read from storage from GNU time's rusage of the process. Limits are fractions of ``model_bytes``,
the GGUF file's size (the same model in the format llama.cpp runs), plus no limit. With no limit,
llama.cpp's own ``llama-bench`` (pp<N> per prompt length and tg32, the same threads and GGUF, warm,
its own repetitions) is reported beside the cold runs.

The native pool: the runner's memory is its program (the dense ExecuTorch graphs, fp32 or 8da4w /
8da8w, packed by XNNPACK at load), the runtimes and the pool arena. Its footprint without the pool is
measured once per bundle (a run with the smallest pool, no limit, the most threads asked: peak RSS
less the arena); under a limit the pool is what is left, less a margin (`pool_margin`), capped at
every expert and floored at one layer's top-k slots (the least the runner runs with; the row says so
when the limit leaves less). With no limit the pool holds every expert.

Reference tokens: transformers' greedy `generate` on the source checkpoint in float32. The native
runner stops at an EOS, as `generate` does; llama.cpp runs with --ignore-eos, so its text is compared
with the decode of a reference that masks EOS (min_new_tokens). ``tokens_match`` is True when every
run of the row produced the reference's tokens. For a quantised bundle (dense 8da4w/8da8w, or int8 /
int4 experts) the native rows also say ``tokens_match_resident``: every run gave the tokens of the same
bundle with every expert resident (one --preload run per prompt at set-up), the runner's guarantee.

Rows: one per model x threads x limit x engine x prompt length; each says its engine, threads, mmap
mode, limit and prompt length, and the native rows carry native / llama.cpp TPOT and TTFT ratios
against both llama.cpp rows of the same threads, limit and prompt length.
"""
from __future__ import annotations

import gc
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.artifacts import read_json
from toolkit.errors import SpecPrefetchError
from toolkit.peers import llamacpp, memlimit
from toolkit.peers.memlimit import LimitedRun, run_limited
from toolkit.metrics import median
from toolkit.reporting import figure, save_figure, write_report

MiB = 2**20
LLAMA = "llama.cpp"
LLAMA_NORA = "llama.cpp:read-around-off"
LLAMAS = (LLAMA, LLAMA_NORA)
ON_DEMAND = "native:on-demand+lru"
# no limit only: every expert read into the pool before the prompt (--preload), as llama.cpp reads (and
# repacks) its model at load; both TTFTs then exclude the load, so this is the warm comparison
RESIDENT = "native:resident"
MMAP_MODE = {LLAMA: "mmap (default)", LLAMA_NORA: "mmap, read-around off (MADV_RANDOM)"}
NATIVE_MODE = "O_DIRECT into a pool"
LLAMA_BENCH_GEN = 32  # llama-bench's tg test
Log = Callable[[str], None]


@dataclass
class _Model:
    label: str
    desc: str
    bundle: Path
    source: Path
    manifest: dict
    tokenizer: Any
    texts: list[str]
    ids: list[list[int]]
    plen: list[int] = field(default_factory=list)               # the prompt length asked for, per prompt
    gguf: Path = Path()
    model_bytes: int = 0
    gguf_type: str = "f16"
    quantised: bool = False                                     # dense 8da*w or int8/int4 experts
    ref_eos: list[list[int]] = field(default_factory=list)     # generate, stopping at EOS (native)
    ref_noeos: list[list[int]] = field(default_factory=list)   # EOS masked (llama.cpp --ignore-eos)
    ref_resident: list[list[int]] = field(default_factory=list)  # the native runner, every expert resident
    runner: list[str] = field(default_factory=list)             # argv prefix of the native binary
    store: Path = Path()
    program: Path = Path()
    slot_bytes: int = 0
    experts: int = 0
    top_k: int = 0
    graph: str = "adapter"                                      # the program's predictor heads
    footprint_bytes: int = 0                                    # native, without the pool arena
    footprint: dict = field(default_factory=dict)

    def engines(self, readaround_off: bool = True) -> tuple[str, ...]:
        return (LLAMA, *((LLAMA_NORA,) if readaround_off else ()), RESIDENT, ON_DEMAND,
                f"native:{self.graph}+prediction")

    @property
    def all_mib(self) -> float:
        return self.experts * self.slot_bytes / MiB

    @property
    def min_mib(self) -> float:
        return self.top_k * self.slot_bytes / MiB

    def lengths(self) -> list[int]:
        return list(dict.fromkeys(self.plen)) if self.plen else [len(self.ids[0])]

    def length_of(self, i: int) -> int:
        return self.plen[i] if self.plen else len(self.ids[i])


# ------------------------------------------------------------------------------------ set-up

def trained_origin(source: Path) -> str | None:
    """Why a checkpoint's routing is a trained model's: it is a shipped model, or widened from one (None
    otherwise)."""
    from toolkit.models.loader import shipped_model_name

    name = shipped_model_name(source)
    if name:
        return f"the shipped {name} model (trained)"
    try:
        cfg = json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    w = cfg.get("specprefetch_widened_from") if isinstance(cfg, dict) else None
    if isinstance(w, dict) and isinstance(w.get("path"), str):
        origin = shipped_model_name(w["path"])
        if origin:
            return (f"widened from the shipped {origin} model (trained; the added expert units contribute "
                    "nothing, so its tokens and routing are the trained model's)")
    return None


def model_label(source: Path, taken: set[str]) -> str:
    from toolkit.models.loader import shipped_model_name

    shipped = shipped_model_name(source)
    if shipped:
        name = shipped
    else:
        name = source.name if source.name not in ("model", "") else source.parent.name
    base, n = name, 2
    while name in taken:
        name, n = f"{base}-{n}", n + 1
    taken.add(name)
    return name


def is_quantised(manifest: dict) -> bool:
    """A bundle whose dense program or experts are quantised (8da4w/8da8w/w8/w4 dense, int8/int4 experts):
    its promise is the tokens of the same bundle with every expert resident, not transformers' fp32 ones."""
    q = manifest.get("quantization") or {}
    return q.get("dense", "fp32") != "fp32" or q.get("experts") in ("int8", "int4")


def _open_model(bundle: Path, prompts: int, prompt_tokens: Sequence[int], new_tokens: int, taken: set[str]) -> _Model:
    from transformers import AutoTokenizer

    from export.manifest import validate_bundle
    from toolkit.bench.common import bench_prompts
    from toolkit.runtime.expert_store import ExpertStore

    bundle = Path(bundle)
    m, _ = validate_bundle(bundle, hash_store=False)
    if m.get("target") != "executorch":
        raise SpecPrefetchError(f"{bundle}: a {m.get('target')} bundle; the side-by-side runs executorch bundles")
    from export.session import bundle_source

    found = bundle_source(bundle, m)   # the very weights the bundle's store was built from, if here
    if found.model is None:
        raise SpecPrefetchError(f"{bundle}: {found.problem}; llama.cpp and the reference tokens need its source "
                                "checkpoint (manifest model.source)")
    source = found.model
    tok = AutoTokenizer.from_pretrained(str(bundle / Path(m["model"]["config"]).parent), local_files_only=True)
    texts, plen = [], []
    for n in prompt_tokens:
        got = bench_prompts(prompts, n, tok)
        texts += got
        plen += [n] * len(got)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    max_seq = (m.get("kv") or {}).get("max_seq")
    if max_seq and max(len(i) for i in ids) + new_tokens - 1 > max_seq:
        raise SpecPrefetchError(f"{bundle}: prompts of up to {max(len(i) for i in ids)} tokens + {new_tokens} new "
                                f"tokens do not fit its KV cache of {max_seq} positions (export with a larger "
                                "--max-seq or ask for fewer tokens)")
    store = bundle / m["runtime"]["expert_store"]
    st = ExpertStore(store)
    pred = m.get("predictor") or {}
    graph = pred.get("kind") if pred.get("preds_rows") else None
    if not graph:
        raise SpecPrefetchError(f"{bundle}: its program has no predictor heads (preds rows), so there is no "
                                "native:<predictor>+prediction engine to run")
    mo = m["model"]
    desc = (f"{mo['family']}, {mo['num_layers']} layers, hidden {mo['hidden_size']}, {mo['num_experts']} experts "
            f"top-{mo['top_k']}, expert {st.blob_size / MiB:.2f} MiB {st.dtype}")
    return _Model(label=model_label(source, taken), desc=desc, bundle=bundle, source=source, manifest=m, tokenizer=tok,
                  texts=texts, ids=ids, plen=plen, quantised=is_quantised(m), store=store,
                  program=bundle / m["graphs"]["file"], slot_bytes=st.slot_bytes,
                  experts=st.num_layers * st.num_experts, top_k=int(m["routing"]["top_k"]), graph=graph,
                  gguf_type=llamacpp.GGUF_TYPE_FOR_EXPERTS[st.dtype])


def _references(m: _Model, new_tokens: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(m.source), dtype=torch.float32).eval()
    eos = m.tokenizer.eos_token_id
    pad = eos if eos is not None else 0
    try:
        with torch.no_grad():
            for ids in m.ids:
                x = torch.tensor([ids])
                m.ref_eos.append(lm.generate(x, do_sample=False, max_new_tokens=new_tokens,
                                             pad_token_id=pad)[0, len(ids):].tolist())
                m.ref_noeos.append(lm.generate(x, do_sample=False, max_new_tokens=new_tokens,
                                               min_new_tokens=new_tokens, pad_token_id=pad)[0, len(ids):].tolist())
    finally:
        del lm
        gc.collect()


# ------------------------------------------------------------------------------------ one run

def _status(r: LimitedRun, what: str) -> str:
    if r.timed_out:
        return "timeout"
    if r.returncode == 0:
        return "ok"
    if (r.oom_kills or 0) > 0 or (r.limit_bytes is not None and r.returncode in (-9, 137)):
        return "oom"
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    return f"failed: {what} exit {r.returncode}: {(lines[-1] if lines else 'no output')[:160]}"


def llama_repack(mode: str, gguf_type: str, limit: int | None) -> bool:
    """Whether llama.cpp runs with CPU weight repacking. "auto": with no limit only. Repacking copies every
    repackable weight (Q4_0 / Q8_0: nearly the whole model) out of the mmapped file into anonymous memory
    (peak RSS about twice the GGUF), which a limit cannot page back to the file: under any limit below
    that, llama.cpp is OOM-killed at load, so there it runs as a user would, --no-repack (weights paged
    from the file). "on" / "off": always / never. Never for a type in REPACK_CRASH."""
    if mode not in ("auto", "on", "off"):
        raise SpecPrefetchError(f"llama.cpp repacking {mode!r}: auto, on or off")
    if llamacpp.REPACK_CRASH and gguf_type == llamacpp.REPACK_CRASH:
        return False
    return mode == "on" or (mode == "auto" and limit is None)


def _run_llama(bins: Path, m: _Model, i: int, n_new: int, limit: int | None, threads: int,
               timeout: float, readaround: bool = True, repack: str = "auto") -> dict:
    rp = llama_repack(repack, m.gguf_type, limit)
    try:
        r = llamacpp.run(bins, m.gguf, m.ids[i], n_new, limit_bytes=limit, threads=threads, cold=True,
                         timeout=timeout, repack=rp, readaround=readaround)
    except SpecPrefetchError as e:
        return {"status": f"failed: {e}"[:200]}
    if r["timed_out"]:
        status = "timeout"
    elif r["returncode"] == 0:
        status = "ok"
    elif (r["oom_kills"] or 0) > 0 or (limit is not None and r["returncode"] in (-9, 137)):
        status = "oom"
    else:
        tail = (r["stderr_tail"].strip().splitlines() or ["no output"])[-1]
        status = f"failed: llama.cpp exit {r['returncode']}: {tail[:160]}"
    if status == "ok" and (r["tpot_ms"] is None or r["new_tokens"] != n_new):
        status = f"failed: llama.cpp made {r['new_tokens']} of {n_new} tokens (perf lines missing?)"
    agree = llamacpp.agreeing_prefix(m.ref_noeos[i], r["tokens"], m.tokenizer) if status == "ok" else None
    return {"status": status, "tpot_ms": r["tpot_ms"], "ttft_ms": r["ttft_ms"], "mib_read": r["mib_read"],
            "peak_rss_bytes": r["peak_rss_bytes"], "cgroup_max_usage_bytes": r["cgroup_max_usage_bytes"],
            "load_ms": r["load_ms"], "wall_s": round(r["wall_s"], 2), "tokens_agree": agree,
            "tokens_match": agree == len(m.ref_noeos[i]) if agree is not None else None,
            "new_tokens": r["new_tokens"], "prompt_tokens": r["prompt_tokens"], "readaround_off": r["readaround_off"],
            "repack": rp}


def _native_argv(m: _Model, ids: Sequence[int], n_new: int, policy: str, pool_mib: float, threads: int,
                 json_out: Path) -> list[str]:
    return [*m.runner, str(m.bundle), "--prompt-ids", ",".join(str(int(t)) for t in ids),
            "--max-new-tokens", str(n_new), "--policy", policy, "--pool-mib", f"{pool_mib:.4f}",
            "--threads", str(threads), "--cold", "--no-verify-hashes", "--json", str(json_out)]


def _run_native(m: _Model, i: int, n_new: int, policy: str, pool_mib: float, limit: int | None, threads: int,
                timeout: float, preload: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        js = Path(tmp) / "run.json"
        argv = _native_argv(m, m.ids[i], n_new, policy, pool_mib, threads, js) + (["--preload"] if preload else [])
        r = run_limited(argv, limit_bytes=limit,
                        files=[m.store, m.program], timeout=timeout, cold=True)
        status = _status(r, "native runner")
        out = {"status": status, "mib_read": r.read_bytes / MiB, "peak_rss_bytes": r.peak_rss_bytes,
               "cgroup_max_usage_bytes": r.cgroup_max_usage_bytes, "wall_s": round(r.wall_s, 2)}
        if status != "ok":
            return out
        try:
            j = json.loads(js.read_text())
        except (OSError, ValueError) as e:
            out["status"] = f"failed: native runner wrote no JSON ({e})"
            return out
    run0 = j["runs"][0]
    ref = m.ref_eos[i]
    # the read budget's start-up probe of the flash (the runner's default, --read-budget-kib auto) is not the
    # run's reading: its bytes come off the process's block reads
    out["mib_read"] -= sum((x.get("read_budget") or {}).get("probe_bytes", 0) for x in j["runs"]) / MiB
    out.update({"tpot_ms": run0["tpot_ms"], "ttft_ms": run0["ttft_ms"], "load_ms": j.get("load_ms"),
                "tokens_match": run0["tokens"] == ref, "prompt_tokens": len(m.ids[i]),
                "tokens_match_resident": run0["tokens"] == m.ref_resident[i] if m.ref_resident else None,
                "tokens_agree": next((n for n, (a, b) in enumerate(zip(run0["tokens"], ref)) if a != b),
                                     min(len(run0["tokens"]), len(ref))),
                "new_tokens": len(run0["tokens"]), "runner_mib_read": run0["mib_read"],
                "runner_peak_rss_bytes": j.get("peak_rss_bytes"), "hit_rate": run0["hit_rate"],
                "stall_ms_per_token": run0["stall_ms_per_token"], "direct_io": j.get("direct_io"),
                "arena_bytes": j.get("arena_bytes")})
    if run0["tpot_ms"] is None:
        out["status"] = "failed: the native runner stopped at EOS after one token (no TPOT)"
    return out


def _resident_references(m: _Model, n_new: int, threads: int, timeout: float, log: Log) -> None:
    """A quantised bundle's own reference: the native runner with every expert resident (--preload, a pool
    of every expert, no limit), once per prompt."""
    m.ref_resident = []
    for _, ids in enumerate(m.ids):
        with tempfile.TemporaryDirectory() as tmp:
            js = Path(tmp) / "run.json"
            argv = _native_argv(m, ids, n_new, ON_DEMAND.split(":", 1)[1], m.all_mib + 0.01, threads, js)
            r = run_limited([*argv, "--preload"], limit_bytes=None, files=[m.store, m.program], timeout=timeout,
                            cold=False)
            if not r.ok:
                raise SpecPrefetchError(f"{m.bundle}: the native runner failed with every expert resident "
                                        f"({_status(r, 'native runner')})")
            m.ref_resident.append(read_json(js, "native runner result")["runs"][0]["tokens"])
    log(f"[{m.label}] resident reference: {len(m.ref_resident)} prompts, native with every expert preloaded")


def _measure_footprint(m: _Model, threads: int, timeout: float, log: Log) -> None:
    """The native runner's memory without its pool: one cold run with the smallest pool, no limit, the
    longest prompt."""
    longest = max(range(len(m.ids)), key=lambda i: len(m.ids[i]))
    with tempfile.TemporaryDirectory() as tmp:
        js = Path(tmp) / "run.json"
        r = run_limited(_native_argv(m, m.ids[longest], 4, ON_DEMAND.split(":", 1)[1], m.min_mib, threads, js),
                        limit_bytes=None, files=[m.store, m.program], timeout=timeout, cold=True)
        if not r.ok:
            raise SpecPrefetchError(f"{m.bundle}: the native runner failed measuring its footprint "
                                    f"({_status(r, 'native runner')})")
        arena = read_json(js, "native runner result").get("arena_bytes") or int(m.min_mib * MiB)
    m.footprint_bytes = max(r.peak_rss_bytes - arena, 0)
    m.footprint = {"peak_rss_bytes": r.peak_rss_bytes, "arena_bytes": arena,
                   "cgroup_max_usage_bytes": r.cgroup_max_usage_bytes, "footprint_bytes": m.footprint_bytes,
                   "program_bytes": m.program.stat().st_size}
    log(f"[{m.label}] native footprint without the pool: {m.footprint_bytes / MiB:.1f} MiB (peak RSS "
        f"{r.peak_rss_bytes / MiB:.1f} MiB with a {arena / MiB:.2f} MiB arena; cgroup peak "
        f"{(r.cgroup_max_usage_bytes or 0) / MiB:.1f} MiB; program {m.footprint['program_bytes'] / MiB:.1f} MiB)")


def pool_for(limit_bytes: int | None, footprint_bytes: int, all_mib: float, min_mib: float,
             margin: Callable[[int], int]) -> tuple[float, str | None]:
    """(pool MiB, note): what a limit leaves for the pool after the footprint and the margin,
    within [min_mib, all_mib]; no limit: every expert."""
    if limit_bytes is None:
        return all_mib, None
    left = (limit_bytes - footprint_bytes - margin(limit_bytes)) / MiB
    if left < min_mib:
        return min_mib, (f"the limit leaves {max(left, 0):.2f} MiB for the pool; ran with the smallest pool "
                         f"({min_mib:.2f} MiB: one layer's top-k slots)")
    return min(left, all_mib), None


def default_margin(limit_bytes: int) -> int:
    """Headroom under the limit for what the footprint run does not show (page tables, the kernel's
    per-cgroup memory, file pages of libraries touched later): 4 MiB + 3% of the limit."""
    return 4 * MiB + int(0.03 * limit_bytes)


# ------------------------------------------------------------------------------------ the run



def _row(m: _Model, engine: str, threads: int, frac: float | None, limit: int | None, plen: int,
         pool: float | None, runs: list[dict], note: str | None, skipped: str | None, total: int) -> dict:
    ok = [r for r in runs if r.get("status") == "ok"]
    bad = [r["status"] for r in runs if r.get("status") != "ok"]
    native = engine not in LLAMAS
    rss = median([r["peak_rss_bytes"] for r in ok], ndigits=None)
    row: dict[str, Any] = {
        "model": m.label, "model_bytes": m.model_bytes, "gguf_type": m.gguf_type, "engine": engine,
        "threads": threads, "mmap_mode": NATIVE_MODE if native else MMAP_MODE[engine],
        "memory_limit_frac": frac, "memory_limit_bytes": limit, "prompt_tokens": plen,
        "tpot_ms": median([r.get("tpot_ms") for r in ok]),
        "ttft_ms": median([r.get("ttft_ms") for r in ok]), "mib_read": median([r.get("mib_read") for r in ok]),
        "peak_rss_bytes": None if rss is None else int(rss),
        "pool_mib": round(pool, 3) if pool is not None else None,
        "tokens_match": all(r.get("tokens_match") for r in ok) if ok else None,
        "status": "ok" if ok and not bad and len(ok) == total else (bad[0] if bad else "timeout" if skipped else
                                                                     "failed: no run"),
        "runs_ok": len(ok), "runs": total,
        "peak_rss_max_bytes": max(r["peak_rss_bytes"] for r in ok) if ok else None,
        "cgroup_max_usage_bytes": max((r.get("cgroup_max_usage_bytes") or 0) for r in ok) if ok and limit else None,
        "load_ms": median([r.get("load_ms") for r in ok]),
        "wall_s": median([r.get("wall_s") for r in runs]),
        "tokens_agree_min": min((r["tokens_agree"] for r in ok if r.get("tokens_agree") is not None), default=None),
    }
    if native:
        row.update({"hit_rate": median([r.get("hit_rate") for r in ok]),
                    "stall_ms_per_token": median([r.get("stall_ms_per_token") for r in ok]),
                    "runner_mib_read": median([r.get("runner_mib_read") for r in ok]),
                    "direct_io": all(r.get("direct_io") for r in ok) if ok else None})
        if m.quantised:
            row["tokens_match_resident"] = all(r.get("tokens_match_resident") for r in ok) if ok else None
    else:
        rp = {r.get("repack") for r in runs if r.get("repack") is not None}
        row["repack"] = rp.pop() if len(rp) == 1 else None
        row["mmap_mode"] += ", repack" if row["repack"] else ", no repack" if row["repack"] is False else ""
        if engine == LLAMA_NORA:
            row["readaround_off"] = all(r.get("readaround_off") for r in ok) if ok else None
    if note:
        row["note"] = note
    if skipped:
        row["skipped"] = skipped
    return row


def add_ratios(rows: list[dict]) -> None:
    """native / llama.cpp TPOT and TTFT on each native row, against each llama.cpp row of the same model,
    threads, limit and prompt length (above 1: the native runner is slower)."""
    key = lambda r: (r["model"], r.get("threads"), r["memory_limit_frac"], r.get("prompt_tokens"))  # noqa: E731
    peers = {(key(r), r["engine"]): r for r in rows if r["engine"] in LLAMAS}
    for r in rows:
        if r["engine"] in LLAMAS:
            continue
        for eng, tag in ((LLAMA, "llama_cpp"), (LLAMA_NORA, "llama_cpp_readaround_off")):
            p = peers.get((key(r), eng))
            for metric in ("tpot", "ttft"):
                a, b = r.get(f"{metric}_ms"), (p or {}).get(f"{metric}_ms")
                r[f"native_over_{tag}_{metric}"] = round(a / b, 3) if a and b else None


def _frac_text(frac: float | None) -> str:
    return "no limit" if frac is None else f"{frac:.0%}"


def _ints(v: int | Sequence[int], what: str) -> list[int]:
    xs = [int(v)] if isinstance(v, int) else [int(x) for x in v]
    if not xs or min(xs) < 1:
        raise SpecPrefetchError(f"{what}: positive integers (got {v!r})")
    return list(dict.fromkeys(xs))


def run(bundles: list[Path], *, limits: Sequence[float | None] = (1.0, 0.5, 0.25, None), prompts: int = 2,
        prompt_tokens: int | Sequence[int] = (128, 512), new_tokens: int = 32, rounds: int = 2,
        threads: int | Sequence[int] = (1, 2), timeout_s: float = 600.0, gguf_dir: Path | None = None,
        readaround_off: bool = True, llama_bench: bool = True, repack: str = "auto",
        pool_margin: Callable[[int], int] = default_margin, log: Log = print) -> dict:
    """llama.cpp (default mmap, and with read-around off) and the native runner on each bundle's model under
    each memory limit (fractions of the GGUF's bytes; None: no limit), at each thread count, `prompts`
    prompts of each length in `prompt_tokens`. Per model, threads and limit, `rounds` rounds over the
    prompts, the engines interleaved (in reverse order every other run); one cold process per run. A run
    that times out (`timeout_s`) or is OOM-killed is a row with that status; an engine that timed out at a
    limit is not run at smaller limits of that model and thread count (its rows say so: status "timeout",
    `skipped`). With no limit among the limits and `llama_bench`, llama-bench at each thread count too.
    Returns {"rows": [...], "llama_bench": [...], "machine": {...}, "notes": [...], ...}."""
    from android_runner.build import build as build_runner
    from android_runner.build import command as runner_command

    if not bundles:
        raise SpecPrefetchError("no bundle to measure")
    if new_tokens < 2:
        raise SpecPrefetchError("new_tokens must be >= 2 (TPOT needs two tokens)")
    if any(f is not None and not 0 < f for f in limits):
        raise SpecPrefetchError(f"memory limits are positive fractions of the model's bytes (got {list(limits)})")
    lengths = _ints(prompt_tokens, "prompt_tokens")
    llama_repack(repack, "f16", None)  # a bad mode is an error before any work
    thread_counts = _ints(threads, "threads")
    why = memlimit.unavailable_reason()
    if why and any(f is not None for f in limits):
        raise SpecPrefetchError(f"cannot apply a memory limit here: {why}")
    t_start = time.monotonic()
    gguf_dir = Path(gguf_dir) if gguf_dir else llamacpp.peers_dir() / "gguf"
    machine = machine_facts(Path(bundles[0]))
    log("llama.cpp: host build")
    bins = llamacpp.build("host", log=log)
    if readaround_off:
        llamacpp.readaround_shim(log=log)
    taken: set[str] = set()
    models: list[_Model] = []
    timings: dict[str, float] = {}
    for b in bundles:
        t0 = time.monotonic()
        m = _open_model(Path(b), prompts, lengths, new_tokens, taken)
        m.gguf = llamacpp.cached_gguf(m.source, m.label, gguf_dir, gguf_type=m.gguf_type, bins=bins, log=log)
        m.model_bytes = m.gguf.stat().st_size
        log(f"[{m.label}] {m.desc}; GGUF {m.gguf_type} {m.model_bytes / MiB:.1f} MiB ({m.gguf})")
        log(f"[{m.label}] reference tokens: transformers greedy on {m.source} (float32)")
        _references(m, new_tokens)
        m.runner = runner_command(build_runner(m.bundle, "host", log=log), "host")
        if m.quantised:
            _resident_references(m, new_tokens, thread_counts[0], timeout_s, log)
        _measure_footprint(m, max(thread_counts), timeout_s, log)
        models.append(m)
        timings[f"setup {m.label} s"] = round(time.monotonic() - t0, 1)

    rows: list[dict] = []  # filled as measured: what was measured survives an early stop
    benches: list[dict] = []
    status, reason = "complete", None
    try:
        _measure(models, bins, limits=limits, rounds=rounds, new_tokens=new_tokens, threads=thread_counts,
                 timeout_s=timeout_s, pool_margin=pool_margin, timings=timings, log=log, rows=rows,
                 readaround_off=readaround_off, llama_repack_mode=repack)
        if llama_bench and None in limits:
            _llama_bench(models, bins, thread_counts, lengths, timeout_s, log, benches, timings, repack)
    except KeyboardInterrupt:
        status, reason = "partial", "interrupted"
    except Exception as e:  # noqa: BLE001 - kept in the report, then raised by the caller as one line
        status, reason = "partial", (str(e) if isinstance(e, SpecPrefetchError) else f"{type(e).__name__}: {e}")
    add_ratios(rows)
    notes = _notes(models, rows, new_tokens, timeout_s)
    machine["load_avg_end"] = list(os.getloadavg())
    timings["total s"] = round(time.monotonic() - t_start, 1)
    return {
        "rows": rows, "llama_bench": benches, "status": status, "reason": reason, "machine": machine, "notes": notes,
        "protocol": {"prompts": prompts, "prompt_tokens": lengths, "new_tokens": new_tokens, "rounds": rounds,
                     "threads": thread_counts, "limits": list(limits), "timeout_s": timeout_s,
                     "engines": [LLAMA, *([LLAMA_NORA] if readaround_off else []), RESIDENT, ON_DEMAND,
                                 "native:<predictor>+prediction"],
                     "model_bytes": "the GGUF file's size; its type matches the bundle's expert precision (fp16: "
                                    "f16 from convert_hf_to_gguf; int8: llama-quantize Q8_0 of that f16; int4: "
                                    "llama-quantize Q4_0 of it)",
                     "llama_cpp_repack": {"auto": "with no limit only (under a limit --no-repack: the repacked "
                                                  "weights are anonymous memory the size of the model)",
                                          "on": "always", "off": "never"}[repack]
                                         + (f"; never for {llamacpp.REPACK_CRASH}" if llamacpp.REPACK_CRASH else "")
                                         + "; host build without AMX",
                     "readaround_off": "LD_PRELOAD shim: madvise(MADV_RANDOM) on llama.cpp's model mapping",
                     "llama_bench": f"no limit: llama-bench -p {','.join(map(str, lengths))} -n {LLAMA_BENCH_GEN} "
                                    "-r 3, same threads and GGUF, default mmap, warm",
                     "cold": "drop_caches before every run (each run is one process)",
                     "memory": "cgroup v1 memory (+memsw) limit, page cache charged",
                     "native_pool": "limit - the runner's footprint without the pool - margin (default 4 MiB + "
                                    "3% of the limit), within [one layer's top-k slots, every expert]; no limit: "
                                    "every expert"},
        "models": [{"model": m.label, "description": m.desc, "bundle": str(m.bundle), "source": str(m.source),
                    "gguf": str(m.gguf), "gguf_type": m.gguf_type, "model_bytes": m.model_bytes,
                    "program_bytes": m.program.stat().st_size, "quantised": m.quantised,
                    "quantization": m.manifest.get("quantization"),
                    "store_bytes": m.store.stat().st_size, "experts": m.experts, "slot_bytes": m.slot_bytes,
                    "top_k_per_layer": m.top_k, "native_footprint": m.footprint, "prompts": m.texts,
                    "prompt_ids": m.ids, "prompt_lengths": m.plen} for m in models],
        "timings": timings,
    }


def _llama_bench(models: list[_Model], bins: Path, thread_counts: list[int], lengths: list[int], timeout_s: float,
                 log: Log, out: list[dict], timings: dict, repack: str = "auto") -> None:
    for m in models:
        t0 = time.monotonic()
        for t in thread_counts:
            log(f"[{m.label}] llama-bench, {t} thread(s): pp{', pp'.join(map(str, lengths))}, tg{LLAMA_BENCH_GEN}")
            for x in llamacpp.bench(bins, m.gguf, threads=t, prompt_tokens=lengths, gen_tokens=LLAMA_BENCH_GEN,
                                    repack=llama_repack(repack, m.gguf_type, None), timeout=max(timeout_s, 600)):
                out.append({"model": m.label, **x})
                log(f"  {x['test']}: {x['tokens_per_s']:.2f} tokens/s")
        timings[f"llama-bench {m.label} s"] = round(time.monotonic() - t0, 1)


def _measure(models: list[_Model], bins: Path, *, limits: Sequence[float | None], rounds: int, new_tokens: int,
             threads: int | Sequence[int], timeout_s: float, pool_margin: Callable[[int], int], timings: dict,
             log: Log, rows: list[dict] | None = None, readaround_off: bool = True,
             llama_repack_mode: str = "auto") -> list[dict]:
    """Every model x threads x limit x round x prompt, the engines interleaved; one row per model x threads x
    limit x engine x prompt length, appended to `rows` as each limit is done."""
    rows = [] if rows is None else rows
    thread_counts = _ints(threads, "threads")
    for m in models:
        t0 = time.monotonic()
        engines = m.engines(readaround_off)
        for t in thread_counts:
            timed_out_at: dict[str, float] = {}
            for frac in limits:
                limit = None if frac is None else int(frac * m.model_bytes)
                pool, pool_note = pool_for(limit, m.footprint_bytes, m.all_mib, m.min_mib, pool_margin)
                got: dict[str, list[tuple[int, dict]]] = {e: [] for e in engines}
                skipped = {e: f"not run: timed out at {timed_out_at[e]:.0%} of the model's bytes"
                           for e in engines if frac is not None and e in timed_out_at and timed_out_at[e] > frac}
                stopped: dict[str, str] = {}
                log(f"[{m.label}] {t} thread(s), limit {_frac_text(frac)}"
                    + (f" = {limit / MiB:.1f} MiB" if limit else "")
                    + f"; native pool {pool:.2f} MiB ({pool / m.all_mib:.0%} of the experts)")
                n = 0
                for rnd in range(rounds):
                    for i in range(len(m.ids)):
                        order = engines if n % 2 == 0 else engines[::-1]
                        n += 1
                        for e in order:
                            if e in skipped or e in stopped:
                                continue
                            if e in LLAMAS:
                                r = _run_llama(bins, m, i, new_tokens, limit, t, timeout_s, readaround=e == LLAMA,
                                               repack=llama_repack_mode)
                            elif e == RESIDENT:
                                if frac is not None:
                                    continue
                                r = _run_native(m, i, new_tokens, ON_DEMAND.split(":", 1)[1], m.all_mib + 0.01, limit,
                                                t, timeout_s, preload=True)
                            else:
                                r = _run_native(m, i, new_tokens, e.split(":", 1)[1], pool, limit, t, timeout_s)
                            got[e].append((i, r))
                            log(f"  round {rnd + 1}/{rounds} prompt {i + 1}/{len(m.ids)} ({len(m.ids[i])} tokens) {e}: "
                                f"{r['status']}"
                                + (f", TPOT {r['tpot_ms']:.2f} ms, TTFT {r['ttft_ms'] or 0:.1f} ms, read "
                                   f"{r['mib_read']:.1f} MiB, peak RSS {r['peak_rss_bytes'] / MiB:.1f} MiB, "
                                   f"tokens match {r['tokens_match']}" if r["status"] == "ok" else
                                   f" after {r.get('wall_s', 0):.0f} s"))
                            if r["status"] in ("timeout", "oom"):
                                stopped[e] = r["status"]  # the same run again would fail the same way
                                if r["status"] == "timeout" and frac is not None:
                                    timed_out_at[e] = frac
                for plen in m.lengths():
                    idx = [i for i in range(len(m.ids)) if m.length_of(i) == plen]
                    for e in engines:
                        if e == RESIDENT and frac is not None:
                            continue
                        runs = [r for i, r in got[e] if i in idx]
                        native = e not in LLAMAS
                        rpool = (m.all_mib + 0.01 if e == RESIDENT else pool) if native else None
                        rnote = ("every expert read into the pool before the prompt (--preload); bytes read "
                                 "include it" if e == RESIDENT else pool_note) if native else None
                        rows.append(_row(m, e, t, frac, limit, plen, rpool, runs, rnote, skipped.get(e),
                                         rounds * len(idx)))
        timings[f"measure {m.label} s"] = round(time.monotonic() - t0, 1)
    return rows


def _notes(models: list[_Model], rows: list[dict], new_tokens: int, timeout_s: float) -> list[str]:
    notes = [
        ("model_bytes is the GGUF file's size (f16, Q8_0 or Q4_0: the class of the bundle's expert precision, "
         "Q8_0 and Q4_0 made by llama-quantize from convert_hf_to_gguf's f16 of the same checkpoint); memory "
         "limits are fractions of it, for every engine."),
        ("Each run is one process from a cold page cache; mib_read and peak_rss_bytes come from GNU time's "
         "rusage of that process (all reads, model load and program included, less the native runner's start-up "
         "probe of the flash's rate for its read budget; RSS counts mapped file pages)."),
        ("TPOT: llama.cpp's eval time / eval runs (n-1 single-token decodes); the native runner's "
         "(t_last - t_first)/(n-1). TTFT: llama.cpp's prompt eval (one batched decode of the prompt, page "
         "faults included, model load excluded); the native runner's from the start of prefill to the first "
         "token (its own prefill, whatever the runner build does: position by position or in chunks)."),
        ("The native runner runs the bundle's dense program (XNNPACK; fp32, or 8da4w / 8da8w) and its experts at "
         "the store's precision; llama.cpp runs the GGUF of that class (all its tensors, the dense ones too, at "
         "that type). Native runs pass --no-verify-hashes (hashing the store would read it all through the "
         "page cache) and --cold."),
        ("llama.cpp:read-around-off is llama.cpp unchanged but for madvise(MADV_RANDOM) on its model mapping "
         "(an LD_PRELOAD shim wrapping mmap, which reports each mapping it advises; llama.cpp's own "
         "posix_fadvise(SEQUENTIAL) and MAP_POPULATE stay): a page fault then reads that page, not up to "
         "read_ahead_kb around it (machine.read_ahead_kb)."),
        ("Ratios native_over_llama_cpp_* are native / llama.cpp on the same model, threads, limit and prompt "
         "length: below 1 the native runner is faster."),
        f"Per-run timeout {timeout_s:.0f} s; an engine that timed out at a limit is not run at smaller ones "
        "(per thread count).",
        ("llama.cpp's CPU weight repacking (its interleaved Q4_0 / Q8_0 kernels, its fastest CPU path) is on with "
         "no limit and off (--no-repack) under a limit (each row's mmap mode says which): repacking copies the "
         "weights out of the mapping into anonymous memory (peak RSS about twice the GGUF), which no limit below "
         "that can page back to the file, so llama.cpp is OOM-killed at load; without it the weights are paged "
         "from the file, as a user short of memory would run it. Its host build leaves ggml's AMX kernels out "
         "(-mno-amx-*): with them this llama.cpp (b11312) segfaults in ggml_backend_amx_mul_mat on the widened "
         "phone-class model's Q4_0 GGUF; a phone has no AMX."
         + (f" {llamacpp.REPACK_CRASH} GGUFs never repack (REPACK_CRASH)." if llamacpp.REPACK_CRASH else "")),
        ("llama-bench (no limit only): its own pp<N> / tg32 tests on the same GGUF and threads, warm (its "
         "warm-up run, then 3 repetitions), beside the cold single runs of the table."),
    ]
    for m in models:
        origin = trained_origin(m.source)
        if origin:
            notes.append(f"{m.label}: {origin}")
        else:
            notes.append(f"{m.label}: not a shipped trained model nor widened from one; if its weights are random "
                         "(specprefetch tiny), its routing is not realistic (it follows random router weights, not "
                         "what the text means), so its hit rates, how much of it a pool or page cache must hold, and "
                         "the adapter's gain are not what a trained model would show; the adapter was trained on "
                         "this model's own traces.")
    return notes + pool_notes(rows)


def pool_notes(rows: list[dict]) -> list[str]:
    """The rows' pool notes, one line per model and note (the native engines share the pool)."""
    where: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        if r.get("note"):
            fr = where.setdefault((r["model"], r["note"].split(";")[0]), [])
            if _frac_text(r["memory_limit_frac"]) not in fr:
                fr.append(_frac_text(r["memory_limit_frac"]))
    return [f"{model}, native engines at {', '.join(fr)}: {note}; ran with the smallest pool (one layer's top-k "
            "slots), so the runner's own pages compete with the limit" for (model, note), fr in where.items()]


def machine_facts(path: Path) -> dict:
    import importlib.metadata as md

    facts: dict[str, Any] = {"host": platform.node(), "kernel": platform.release(), "cores": os.cpu_count(),
                             "load_avg_start": list(os.getloadavg())}
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
        facts["cpu"] = cpu
        facts["avx2"] = " avx2 " in Path("/proc/cpuinfo").read_text()
    except (OSError, StopIteration):
        pass
    try:
        mem = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
        facts["mem_gib"] = round(int(mem.split()[1]) / 2**20, 1)
    except (OSError, StopIteration):
        pass
    try:
        dev = os.stat(path).st_dev
        d = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
        ra = d / "queue" / "read_ahead_kb"
        if not ra.exists():
            ra = d.parent / "queue" / "read_ahead_kb"
        facts["disk"] = d.name
        facts["read_ahead_kb"] = int(ra.read_text())
    except (OSError, ValueError):
        pass
    for pkg in ("torch", "transformers", "executorch"):
        try:
            facts[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    facts["llama_cpp"] = f"b{llamacpp.LLAMA_CPP_BUILD} ({llamacpp.LLAMA_CPP_COMMIT}, from llama-cpp-python " \
                         f"{llamacpp.LLAMA_CPP_PYTHON_VERSION}; host build GGML_NATIVE=ON" + \
                         (f", {llamacpp.NO_AMX_FLAGS})" if platform.machine().lower() in ("x86_64", "amd64") else ")")
    facts["commit"] = _commit()
    return facts


def _commit() -> str | None:
    """HEAD's commit read from .git (files only; no git process)."""
    git = Path(__file__).resolve().parents[2] / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head[:12]
        ref = head[5:]
        p = git / ref
        if p.exists():
            return p.read_text().strip()[:12]
        for ln in (git / "packed-refs").read_text().splitlines():
            if ln.endswith(" " + ref):
                return ln.split()[0][:12]
    except OSError:
        pass
    return None


# ------------------------------------------------------------------------------------ report

def _fmt(v: float | None, f: str = ".2f") -> str:
    return "-" if v is None else format(v, f)


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _short(engine: str) -> str:
    return {LLAMA: "llama.cpp", LLAMA_NORA: "llama.cpp (read-around off)"}.get(engine, engine)


def markdown(result: dict) -> str:
    rows = result["rows"]
    p = result.get("protocol", {})
    lines = []
    if p:
        lens = p.get("prompt_tokens")
        lens = lens if isinstance(lens, list) else [lens]
        thr = p.get("threads")
        thr = thr if isinstance(thr, list) else [thr]
        lines += [(f"{p.get('prompts')} prompts of each of {', '.join(map(str, lens))} tokens x {p.get('new_tokens')} "
                   f"new tokens, greedy, {p.get('rounds')} rounds, engines interleaved, {', '.join(map(str, thr))} "
                   "compute thread(s); one cold process per run; medians. Limits: cgroup v1 memory including page "
                   "cache, as a share of the model's GGUF bytes. native / llama.cpp ratios below 1: native faster."),
                  ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        mr = [r for r in rows if r["model"] == model]
        lines += [f"### {model} ({mr[0]['model_bytes'] / MiB:.1f} MiB {mr[0].get('gguf_type', 'f16')} GGUF)", "",
                  ("| threads | limit | limit MiB | engine | mmap mode | prompt tokens | pool MiB | TPOT ms | "
                   "TTFT ms | MiB read (experts) | peak RSS MiB | hit rate | tokens match | status | "
                   "native / llama.cpp TPOT | native / llama.cpp TTFT | native / llama.cpp (RA off) TPOT | "
                   "native / llama.cpp (RA off) TTFT |"),
                  "|" + "---|" * 18]
        for r in mr:
            status = r["status"] if r["status"] == "ok" or not r.get("skipped") else f"{r['status']} (not run)"
            if r["status"] == "ok" and r.get("runs_ok") != r.get("runs"):
                status += f" ({r['runs_ok']}/{r['runs']})"
            match = "-" if r["tokens_match"] is None else "yes" if r["tokens_match"] else "no"
            if r.get("tokens_match_resident") is not None:
                match += f"; resident: {'yes' if r['tokens_match_resident'] else 'no'}"
            lines.append(
                f"| {r.get('threads', '-')} | {_frac_text(r['memory_limit_frac'])} | "
                f"{_fmt(r['memory_limit_bytes'] / MiB if r['memory_limit_bytes'] else None, '.1f')} "
                f"| {_short(r['engine'])} | {r.get('mmap_mode', '-')} | {r.get('prompt_tokens', '-')} | "
                f"{_fmt(r['pool_mib'], '.1f')} | {_fmt(r['tpot_ms'])} | {_fmt(r['ttft_ms'], '.1f')} "
                f"| {_fmt(r['mib_read'], '.1f')}"
                + (f" ({r['runner_mib_read']:.1f})" if r.get("runner_mib_read") is not None else "") + " | "
                f"{_fmt(r['peak_rss_bytes'] / MiB if r['peak_rss_bytes'] else None, '.1f')} | "
                f"{_fmt(r.get('hit_rate'), '.3f')} | {match} | {status} | "
                f"{_ratio(r.get('native_over_llama_cpp_tpot'))} | {_ratio(r.get('native_over_llama_cpp_ttft'))} | "
                f"{_ratio(r.get('native_over_llama_cpp_readaround_off_tpot'))} | "
                f"{_ratio(r.get('native_over_llama_cpp_readaround_off_ttft'))} |")
        lines.append("")
        lens = list(dict.fromkeys(r.get("prompt_tokens") for r in mr))
        if len(lens) > 1:
            lines += ["TTFT and TPOT by prompt length (ms):", "",
                      "| threads | limit | engine | " + " | ".join(f"TTFT {n}" for n in lens) + " | "
                      + " | ".join(f"TPOT {n}" for n in lens) + " |", "|" + "---|" * (3 + 2 * len(lens))]
            by = {(r.get("threads"), r["memory_limit_frac"], r["engine"], r.get("prompt_tokens")): r for r in mr}
            for key in dict.fromkeys((r.get("threads"), r["memory_limit_frac"], r["engine"]) for r in mr):
                got = [by.get((*key, n)) or {} for n in lens]
                lines.append(f"| {key[0]} | {_frac_text(key[1])} | {_short(key[2])} | "
                             + " | ".join(_fmt(g.get("ttft_ms"), ".1f") for g in got) + " | "
                             + " | ".join(_fmt(g.get("tpot_ms")) for g in got) + " |")
            lines.append("")
        lb = [b for b in result.get("llama_bench", []) if b["model"] == model]
        if lb:
            lines += ["No limit: llama.cpp's own llama-bench (warm, 3 repetitions) beside this run's cold single runs "
                      "(tokens/s; pp: prompt tokens / TTFT, tg: 1000 / TPOT):", "",
                      "| threads | test | llama-bench t/s | llama.cpp t/s | native:resident t/s | "
                      "native:on-demand t/s | native:prediction t/s |",
                      "|---|---|---|---|---|---|---|"]
            free = [r for r in mr if r["memory_limit_frac"] is None and r["status"] == "ok"]
            for b in lb:
                def ours(pred: Callable[[dict], bool]) -> str:
                    rr = [r for r in free if r.get("threads") == b["threads"] and pred(r)]
                    if b["n_gen"] == 0:
                        rr = [r for r in rr if r.get("prompt_tokens") == b["n_prompt"] and r.get("ttft_ms")]
                        return f"{b['n_prompt'] / (rr[0]['ttft_ms'] / 1000):.1f}" if rr else "-"
                    rr = sorted((r for r in rr if r.get("tpot_ms")), key=lambda r: r.get("prompt_tokens") or 0)
                    return f"{1000 / rr[0]['tpot_ms']:.1f}" if rr else "-"
                lines.append(f"| {b['threads']} | {b['test']} | {b['tokens_per_s']:.1f} ± {b['stddev']:.1f} | "
                             f"{ours(lambda r: r['engine'] == LLAMA)} | {ours(lambda r: r['engine'] == RESIDENT)} | "
                             f"{ours(lambda r: r['engine'] == ON_DEMAND)} | "
                             f"{ours(lambda r: r['engine'] not in (*LLAMAS, ON_DEMAND, RESIDENT))} |")
            lines.append("")
    if result.get("notes"):
        lines += ["Notes:", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    rows = result["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = figure((12, 4.2 * len(models)), len(models), 2, squeeze=False)
    none_x = 1.25
    for ax_row, model in zip(axes, models):
        mr = [r for r in rows if r["model"] == model]
        lens = sorted({r.get("prompt_tokens") or 0 for r in mr})
        for ax, metric, plen in ((ax_row[0], "tpot_ms", lens[0]), (ax_row[1], "ttft_ms", lens[-1])):
            pr = [r for r in mr if (r.get("prompt_tokens") or 0) == plen]
            series = list(dict.fromkeys((r["engine"], r.get("threads")) for r in pr))
            for k, (eng, thr) in enumerate(series):
                er = sorted((r for r in pr if (r["engine"], r.get("threads")) == (eng, thr)),
                            key=lambda r: none_x if r["memory_limit_frac"] is None else r["memory_limit_frac"])
                xs = [none_x if r["memory_limit_frac"] is None else r["memory_limit_frac"] for r in er]
                ys = [r[metric] if r["status"] == "ok" else None for r in er]
                line, = ax.plot([x for x, y in zip(xs, ys) if y], [y for y in ys if y], marker="o",
                                ls="-" if thr in (None, 1) else "--", label=f"{_short(eng)}, {thr} thr")
                for x, r in zip(xs, er):
                    if r["status"] != "ok":
                        ax.annotate(r["status"].split(":")[0], (x, 1), xycoords=("data", "axes fraction"),
                                    xytext=(0, -12 - 10 * k), textcoords="offset points", ha="center", fontsize=7,
                                    color=line.get_color())
            ax.set_yscale("log")
            ticks = sorted({none_x if r["memory_limit_frac"] is None else r["memory_limit_frac"] for r in pr})
            ax.set_xticks(ticks, ["no limit" if t == none_x else f"{t:.0%}" for t in ticks])
            ax.set_xlabel("memory limit (share of the GGUF's bytes)")
            ax.set_ylabel(f"{'TPOT' if metric == 'tpot_ms' else 'TTFT'} (ms, log)")
            ax.set_title(f"{model} ({mr[0]['model_bytes'] / MiB:.0f} MiB): "
                         f"{'TPOT' if metric == 'tpot_ms' else 'TTFT'}, {plen}-token prompts")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7, loc="best")
    save_figure(fig, path)


def write(result: dict, json_path: Path | str) -> tuple[Path, Path]:
    """json_path, and its .md (the table) and .png (the plot) beside it."""
    return write_report(result, json_path, markdown, plot)


# ------------------------------------------------------------------------------------ command line

def parse_limits(text: str) -> tuple[float | None, ...]:
    """--limits: comma-separated fractions of the GGUF's bytes in (0, 4], or none (no limit)."""
    fracs: list[float | None] = []
    for item in text.split(","):
        item = item.strip().lower()
        if item in ("none", "no", "inf"):
            fracs.append(None)
            continue
        try:
            v = float(item)
        except ValueError:
            raise SpecPrefetchError(f"--limits {text!r}: fractions like 0.5, or none") from None
        if not (0 < v <= 4):
            raise SpecPrefetchError(f"--limits {text!r}: {item} is not a fraction in (0, 4]")
        fracs.append(v)
    return tuple(fracs)


def parse_ints(text: str, option: str) -> list[int]:
    """--threads / --prompt-tokens: comma-separated positive integers."""
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        xs = []
    if not xs or min(xs) < 1:
        raise SpecPrefetchError(f"{option} {text!r}: comma-separated positive integers, e.g. 1,2")
    return xs
