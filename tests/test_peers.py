"""Peers: memlimit (cgroup v1 memory limit incl. page cache, cold cache, read/RSS accounting) and
llama.cpp (build, convert, greedy runs; slow)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from toolkit.errors import SpecPrefetchError
from toolkit.peers import llamacpp, memlimit
from toolkit.peers.memlimit import run_limited

MiB = 2**20
CGROUP_WHY = memlimit.unavailable_reason()
needs_cgroup = pytest.mark.skipif(CGROUP_WHY is not None, reason=f"no memory limit here: {CGROUP_WHY}")
PY = sys.executable


def _our_cgroups() -> list[str]:
    d = memlimit.memory_cgroup_dir()
    mine = f"specprefetch-{os.getpid()}-"
    return sorted(p.name for p in d.iterdir() if p.name.startswith(mine)) if d else []


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("memlimit") / "data.bin"
    p.write_bytes(os.urandom(16 * MiB))
    try:
        os.close(os.open(p, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip(f"O_DIRECT not supported on {p.parent}")
    return p


DIRECT_READ = ("import mmap, os, sys\n"
               "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)\n"
               "buf = mmap.mmap(-1, 16 << 20)\n"
               "assert os.readv(fd, [buf]) == 16 << 20\n")
BUFFERED_READ = "import sys; assert len(open(sys.argv[1], 'rb').read()) == 16 << 20"


@needs_cgroup
def test_limit_is_enforced_and_cgroup_removed():
    alloc = "b = bytearray({n} << 20)\nb[::4096] = b'x' * len(b[::4096])\nprint('done')"
    big = run_limited([PY, "-c", alloc.format(n=300)], limit_bytes=100 * MiB, cold=False)
    assert big.returncode != 0 and "done" not in big.stdout  # OOM-killed inside the cgroup
    assert big.oom_kills is None or big.oom_kills >= 1
    assert big.cgroup_max_usage_bytes is not None and big.cgroup_max_usage_bytes <= 100 * MiB
    small = run_limited([PY, "-c", alloc.format(n=20)], limit_bytes=100 * MiB, cold=False)
    assert small.ok and small.stdout.strip() == "done", small.stderr
    assert 20 * MiB <= small.peak_rss_bytes < 100 * MiB
    assert 20 * MiB <= small.cgroup_max_usage_bytes <= 100 * MiB
    assert small.limit_bytes == 100 * MiB and small.cgroup and not Path(small.cgroup).exists()
    assert _our_cgroups() == []


@needs_cgroup
def test_read_bytes_counts_cold_reads_of_the_process_tree(data_file):
    cold = run_limited([PY, "-c", BUFFERED_READ, str(data_file)], limit_bytes=None, files=[data_file])
    assert cold.ok, cold.stderr
    assert cold.cache_drop in ("drop_caches", "fadvise(1 files)")
    assert cold.read_bytes >= 16 * MiB
    warm = run_limited([PY, "-c", BUFFERED_READ, str(data_file)], limit_bytes=None, cold=False)
    assert warm.ok and warm.cache_drop == "none (warm)"
    assert warm.read_bytes < 4 * MiB  # all from page cache
    direct = run_limited([PY, "-c", DIRECT_READ, str(data_file)], limit_bytes=64 * MiB, cold=False)
    assert direct.ok, direct.stderr
    assert direct.read_bytes >= 16 * MiB  # O_DIRECT bypasses the (warm) cache and is counted
    # a grandchild's reads are counted once it is reaped
    tree = ("import subprocess, sys\n"
            f"subprocess.run([sys.executable, '-c', {DIRECT_READ!r}, sys.argv[1]], check=True)\n")
    nested = run_limited([PY, "-c", tree, str(data_file)], limit_bytes=None, cold=False)
    assert nested.ok, nested.stderr
    assert nested.read_bytes >= 16 * MiB
    assert _our_cgroups() == []


@needs_cgroup
def test_timeout_kills_and_cleans_up():
    r = run_limited([PY, "-c", "import time; time.sleep(30)"], limit_bytes=50 * MiB, timeout=1, cold=False)
    assert r.timed_out and r.returncode != 0 and r.wall_s < 10
    assert _our_cgroups() == []


def test_no_cgroup_means_a_clear_error(monkeypatch):
    monkeypatch.setattr(memlimit, "memory_cgroup_dir", lambda: None)
    with pytest.raises(SpecPrefetchError, match="cgroup v1"):
        run_limited([PY, "-c", "pass"], limit_bytes=100 * MiB, cold=False)
    r = run_limited([PY, "-c", "print(1)"], limit_bytes=None, cold=False)  # no limit: no cgroup needed
    assert r.ok and r.cgroup is None and r.cgroup_max_usage_bytes is None and r.stdout.strip() == "1"


def test_perf_parsing_and_pre_tokenizer(embedded):
    stderr = """common_perf_print:    sampling time =       1.23 ms
common_perf_print:        load time =      50.00 ms
common_perf_print: prompt eval time =      12.50 ms /    25 tokens (    0.50 ms per token,  2000.00 tokens per second)
common_perf_print:        eval time =      30.00 ms /    15 runs   (    2.00 ms per token,   500.00 tokens per second)
common_perf_print:       total time =     100.00 ms /    40 tokens
"""
    p = llamacpp.parse_perf(stderr)
    assert p["prompt_eval_ms"] == 12.5 and p["prompt_eval_n"] == 25
    assert p["eval_ms"] == 30.0 and p["eval_n"] == 15 and p["sampling_ms"] == 1.23
    assert llamacpp._prompt_ids("number of tokens in prompt = 2\n    10 -> 'a'\n   198 -> '\n'\n") == [10, 198]
    assert llamacpp._prompt_ids("0.00.038.087 I main: number of tokens in prompt = 2\n"
                                "0.00.038.088 I     46 -> 'H'\n0.00.038.089 I    198 -> '\n'\n'\n") == [46, 198]
    assert llamacpp._pre_tokenizer(embedded) == "gpt-2"  # ByteLevel(use_regex) = GPT-2's regex


def _gguf_bytes(kv: dict) -> bytes:
    import struct

    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<Q", len(b)) + b

    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv))
    for k, v in kv.items():
        out += s(k)
        if isinstance(v, str):
            out += struct.pack("<I", 8) + s(v)
        elif isinstance(v, list) and isinstance(v[0], str):
            out += struct.pack("<IIQ", 9, 8, len(v)) + b"".join(s(x) for x in v)
        elif isinstance(v, list):
            out += struct.pack("<IIQ", 9, 5, len(v)) + struct.pack(f"<{len(v)}i", *v)
        else:
            out += struct.pack("<Ii", 5, v)
    return out


def test_gguf_vocab_detokenize(tmp_path):
    g = tmp_path / "v.gguf"
    g.write_bytes(_gguf_bytes({"general.architecture": "qwen3moe", "some.count": 7,
                               "tokenizer.ggml.model": "gpt2",
                               "tokenizer.ggml.tokens": ["<|endoftext|>", "Hello", "Ġworld", "Ċ", "Ã©"],
                               "tokenizer.ggml.token_type": [3, 1, 1, 1, 1]}))
    md = llamacpp.gguf_metadata(g, ["some.count", "tokenizer.ggml.model"])
    assert md == {"some.count": 7, "tokenizer.ggml.model": "gpt2"}
    assert llamacpp.detokenize(g, [1, 2, 3, 4, 0]) == "Hello world\né<|endoftext|>".encode()


def test_convert_refuses_dense_layers_llamacpp_lacks(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "mlp_only_layers": [0]}))
    with pytest.raises(SpecPrefetchError, match="dense layers"):
        llamacpp.convert(tmp_path, tmp_path / "out.gguf")


# ------------------------------------------------------------------------- slow: real llama.cpp

@pytest.fixture(scope="module")
def llama_bins() -> Path:
    return llamacpp.build("host")


@pytest.fixture(scope="module")
def embedded_gguf(tmp_path_factory, embedded) -> Path:
    return llamacpp.convert(embedded, tmp_path_factory.mktemp("gguf") / "embedded-f16.gguf")


def _prompts(tokenizer, n: int) -> list[list[int]]:
    heldout = Path(__file__).parent.parent / "toolkit" / "embedded" / "heldout.jsonl"
    rows = [json.loads(line) for line in heldout.read_text().splitlines()]
    # ids of a text (not a cut of a longer text's ids, which need not re-tokenize to themselves)
    return [tokenizer(r["text"][:200])["input_ids"] for r in rows[:n]]


@pytest.mark.slow
@needs_cgroup
def test_llamacpp_matches_transformers_and_thrashes_under_a_limit(llama_bins, embedded_gguf, embedded):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded)
    model = AutoModelForCausalLM.from_pretrained(embedded, dtype=torch.float32).eval()
    n_new, agree = 8, []
    for ids in _prompts(tok, 3):
        with torch.no_grad():  # min_new_tokens masks EOS like llama.cpp's --ignore-eos
            ref = model.generate(torch.tensor([ids]), max_new_tokens=n_new, min_new_tokens=n_new,
                                 do_sample=False)[0, len(ids):].tolist()
        r = llamacpp.run(llama_bins, embedded_gguf, ids, n_new, cold=False)
        assert r["returncode"] == 0, r["stderr_tail"]
        assert r["prompt_ids"] == ids and r["new_tokens"] == n_new
        agree.append(llamacpp.agreeing_prefix(ref, r["tokens"], tok))
    assert min(agree) >= 4, agree  # f16 GGUF vs fp32 transformers: same model, same greedy start

    ids = _prompts(tok, 1)[0]
    free = llamacpp.run(llama_bins, embedded_gguf, ids, 32)
    assert free["returncode"] == 0 and free["tpot_ms"] > 0 and free["ttft_ms"] > 0
    assert free["mib_read"] * MiB >= 0.9 * embedded_gguf.stat().st_size  # cold: the model was read
    # half the model fits beside what llama.cpp needs besides the model
    overhead = max(free["cgroup_max_usage_bytes"] - embedded_gguf.stat().st_size, 0)
    limit = overhead + embedded_gguf.stat().st_size // 2
    tight = llamacpp.run(llama_bins, embedded_gguf, ids, 32, limit_bytes=limit)
    assert tight["returncode"] == 0, tight["stderr_tail"]
    assert tight["tokens"] == free["tokens"]
    assert tight["cgroup_max_usage_bytes"] <= limit
    assert tight["mib_read"] > 1.5 * free["mib_read"], (tight["mib_read"], free["mib_read"])


@pytest.mark.slow
def test_llamacpp_arm64_starts_under_qemu():
    bins = llamacpp.build("arm64")
    assert "version" in llamacpp.check_arm64(bins)


# ------------------------------------------------------------------------- side by side (issue 11)

def _fake_model(tmp_path: Path):
    from toolkit.peers import sidebyside as sbs

    m = sbs._Model(label="fake", desc="fake", bundle=tmp_path, source=tmp_path, manifest={}, tokenizer=None,
                   texts=["a", "b"], ids=[[1, 2], [3, 4]], model_bytes=1000 * MiB, slot_bytes=MiB, experts=400,
                   top_k=4, graph="adapter", footprint_bytes=100 * MiB)
    return m


def test_sidebyside_interleaves_skips_and_assembles_rows(tmp_path, monkeypatch):
    from toolkit.peers import sidebyside as sbs

    calls = []

    def fake_llama(bins, m, i, n_new, limit, threads, timeout):
        calls.append(("llama.cpp", limit, i))
        if limit is not None and limit <= 500 * MiB:  # thrashes: times out at 50%
            return {"status": "timeout", "wall_s": timeout}
        return {"status": "ok", "tpot_ms": 10.0 + i, "ttft_ms": 50.0, "mib_read": 1000.0, "peak_rss_bytes": 900 * MiB,
                "tokens_match": True, "tokens_agree": 8, "wall_s": 1.0}

    def fake_native(m, i, n_new, policy, pool, limit, threads, timeout):
        calls.append((policy, limit, i))
        assert limit is None or (pool * MiB + m.footprint_bytes < limit), (pool, limit)
        if limit is not None and limit <= 250 * MiB and policy.startswith("on-demand"):
            return {"status": "oom", "peak_rss_bytes": limit, "wall_s": 0.5}
        return {"status": "ok", "tpot_ms": 2.0 + i, "ttft_ms": 20.0, "mib_read": 100.0, "peak_rss_bytes": 300 * MiB,
                "tokens_match": True, "tokens_agree": 8, "runner_mib_read": 80.0, "hit_rate": 0.9,
                "stall_ms_per_token": 0.1, "direct_io": True, "wall_s": 1.0}

    monkeypatch.setattr(sbs, "_run_llama", fake_llama)
    monkeypatch.setattr(sbs, "_run_native", fake_native)
    m = _fake_model(tmp_path)
    limits = (1.0, 0.5, 0.25, None)
    rows = sbs._measure([m], tmp_path, limits=limits, rounds=2, new_tokens=8, threads=1, timeout_s=60,
                        pool_margin=sbs.default_margin, timings={}, log=lambda s: None)
    engines = ["llama.cpp", "native:on-demand+lru", "native:adapter+prediction"]
    assert [(r["memory_limit_frac"], r["engine"]) for r in rows] == [(f, e) for f in limits for e in engines]
    # interleaved: the first two runs at 100% are ABC then CBA
    assert [c[0] for c in calls[:6]] == ["llama.cpp", "on-demand+lru", "adapter+prediction",
                                         "adapter+prediction", "on-demand+lru", "llama.cpp"]
    by = {(r["memory_limit_frac"], r["engine"]): r for r in rows}
    ok = by[(1.0, "llama.cpp")]
    assert ok["status"] == "ok" and ok["tpot_ms"] == 10.5 and ok["runs_ok"] == ok["runs"] == 4
    assert ok["model_bytes"] == 1000 * MiB and ok["memory_limit_bytes"] == 1000 * MiB and ok["pool_mib"] is None
    nat = by[(1.0, "native:adapter+prediction")]
    assert nat["tpot_ms"] == 2.5 and nat["tokens_match"] is True and nat["hit_rate"] == 0.9
    assert 0 < nat["pool_mib"] < 900
    # a timeout is run once, then not again at that limit, nor at smaller limits; no limit still runs
    assert by[(0.5, "llama.cpp")]["status"] == "timeout" and by[(0.5, "llama.cpp")]["runs_ok"] == 0
    assert sum(1 for c in calls if c[0] == "llama.cpp" and c[1] == 500 * MiB) == 1
    assert by[(0.25, "llama.cpp")]["status"] == "timeout" and "not run" in by[(0.25, "llama.cpp")]["skipped"]
    assert not [c for c in calls if c[0] == "llama.cpp" and c[1] == 250 * MiB]
    assert by[(None, "llama.cpp")]["status"] == "ok" and by[(None, "native:on-demand+lru")]["pool_mib"] == 400
    assert by[(0.25, "native:on-demand+lru")]["status"] == "oom"
    assert by[(0.25, "native:adapter+prediction")]["status"] == "ok"

    result = {"rows": rows, "machine": {"cpu": "x"}, "notes": ["a note"],
              "protocol": {"prompts": 2, "prompt_tokens": 2, "new_tokens": 8, "rounds": 2, "threads": 1}}
    md = sbs.markdown(result)
    assert "| 50% | 500.0 | llama.cpp | - | - |" in md and "timeout (not run)" in md
    assert "| 100% | 1000.0 | native:adapter+prediction |" in md and "| 4.20 |" in md  # 10.5 / 2.5
    assert "100.0 (80.0)" in md and "- a note" in md
    mdp, png = sbs.write(result, tmp_path / "out" / "sbs.json")
    assert json.loads((tmp_path / "out" / "sbs.json").read_text())["rows"] == rows
    assert mdp.read_text() == md and png.stat().st_size > 10_000


def test_sidebyside_pool_sizing():
    from toolkit.peers.sidebyside import pool_for

    margin = lambda limit: 10 * MiB
    assert pool_for(None, 100 * MiB, 400.0, 2.0, margin) == (400.0, None)
    assert pool_for(300 * MiB, 100 * MiB, 400.0, 2.0, margin) == (190.0, None)
    assert pool_for(900 * MiB, 100 * MiB, 400.0, 2.0, margin) == (400.0, None)  # capped at every expert
    pool, note = pool_for(105 * MiB, 100 * MiB, 400.0, 2.0, margin)
    assert pool == 2.0 and "smallest pool" in note


@pytest.mark.slow
@needs_cgroup
def test_sidebyside_on_the_embedded_bundle(embedded_bundles, tmp_path):
    from toolkit.peers import sidebyside as sbs

    bundle = embedded_bundles["executorch"]
    r = sbs.run([bundle], limits=(1.0,), prompts=1, prompt_tokens=24, new_tokens=8, rounds=1,
                gguf_dir=tmp_path, timeout_s=300, log=lambda s: None)
    rows = r["rows"]
    graph = json.loads((bundle / "manifest.json").read_text())["predictor"]["kind"]
    assert [x["engine"] for x in rows] == ["llama.cpp", "native:on-demand+lru", f"native:{graph}+prediction"]
    gguf = Path(r["models"][0]["gguf"])
    for x in rows:
        assert x["model"] == "embedded" and x["model_bytes"] == gguf.stat().st_size
        assert x["memory_limit_frac"] == 1.0 and x["memory_limit_bytes"] == gguf.stat().st_size
        assert x["status"] == "ok", x
        assert x["tokens_match"] is True, x
        assert x["tpot_ms"] > 0 and x["ttft_ms"] > 0 and x["mib_read"] > 0
        assert 0 < x["cgroup_max_usage_bytes"] <= x["memory_limit_bytes"]  # the limit held
    native = rows[1:]
    for x in native:  # (llama.cpp's RSS counts shared library pages charged elsewhere: it may exceed it)
        assert 0 < x["peak_rss_bytes"] <= x["memory_limit_bytes"], x
        assert x["pool_mib"] > 0 and x["direct_io"] is True and x["runner_mib_read"] > 0
    assert r["machine"]["cores"] and r["models"][0]["native_footprint"]["footprint_bytes"] > 0
    md = sbs.markdown(r)
    assert "| 100% |" in md and "llama.cpp" in md


def test_sidebyside_keeps_the_rows_measured_before_an_error(tmp_path, monkeypatch):
    """_measure appends each limit's rows as it finishes them, so an error mid-way leaves those rows
    with the caller (run() reports them as a partial result)."""
    from toolkit.peers import sidebyside as sbs

    def fake_llama(bins, m, i, n_new, limit, threads, timeout):
        if limit is not None and limit <= 500 * MiB:
            raise RuntimeError("disk vanished")
        return {"status": "ok", "tpot_ms": 10.0, "ttft_ms": 50.0, "mib_read": 1000.0, "peak_rss_bytes": 900 * MiB,
                "tokens_match": True, "tokens_agree": 8, "wall_s": 1.0}

    def fake_native(m, i, n_new, policy, pool, limit, threads, timeout):
        return {"status": "ok", "tpot_ms": 2.0, "ttft_ms": 20.0, "mib_read": 100.0, "peak_rss_bytes": 300 * MiB,
                "tokens_match": True, "tokens_agree": 8, "runner_mib_read": 80.0, "hit_rate": 0.9,
                "stall_ms_per_token": 0.1, "direct_io": True, "wall_s": 1.0}

    monkeypatch.setattr(sbs, "_run_llama", fake_llama)
    monkeypatch.setattr(sbs, "_run_native", fake_native)
    rows: list = []
    with pytest.raises(RuntimeError, match="disk vanished"):
        sbs._measure([_fake_model(tmp_path)], tmp_path, limits=(1.0, 0.5), rounds=1, new_tokens=8, threads=1,
                     timeout_s=60, pool_margin=sbs.default_margin, timings={}, log=lambda s: None, rows=rows)
    assert {r["memory_limit_frac"] for r in rows} == {1.0} and len(rows) == 3
