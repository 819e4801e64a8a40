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


SMAPS_FLAGS = ("import mmap, os, sys\n"
               "f = open(sys.argv[1], 'rb')\n"
               "m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
               "name, flags, cur = os.path.realpath(sys.argv[1]), None, None\n"
               "for line in open('/proc/self/smaps'):\n"
               "    if line[:1] in '0123456789abcdef' and '-' in line.split()[0]:\n"
               "        cur = line.split()[-1] if len(line.split()) >= 6 else None\n"
               "    elif line.startswith('VmFlags:') and cur == name:\n"
               "        flags = line.split()[1:]\n"
               "print(' '.join(flags or []))\n")


def test_readaround_shim_advises_only_the_named_file(data_file, tmp_path, monkeypatch):
    """The read-around-off shim: a mapping of the named file (dev:ino) gets MADV_RANDOM (the kernel's
    VmFlags "rr": no fault read-around) and the shim says so on stderr; any other file is left alone."""
    monkeypatch.setenv("SPECPREFETCH_PROFILES", str(tmp_path / "profiles"))
    shim = llamacpp.readaround_shim(log=lambda s: None)
    assert shim.parent == llamacpp.peers_dir() and shim.exists()
    other = tmp_path / "other.bin"
    other.write_bytes(b"x" * (1 << 20))
    import subprocess

    def mapped(path: Path, named: Path) -> tuple[list[str], str]:
        st = named.stat()
        env = dict(os.environ, LD_PRELOAD=str(shim), **{llamacpp.READAROUND_ENV: f"{st.st_dev}:{st.st_ino}"})
        r = subprocess.run([PY, "-c", SMAPS_FLAGS, str(path)], capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.split(), r.stderr

    flags, err = mapped(data_file, data_file)
    assert "rr" in flags and llamacpp.READAROUND_MARK in err and "16777216 bytes: ok" in err
    flags, err = mapped(data_file, other)  # another file named: this mapping keeps its read-around
    assert flags and "rr" not in flags and llamacpp.READAROUND_MARK not in err
    assert llamacpp.readaround_shim(log=lambda s: None) == shim  # built once


def test_tool_path_names_the_tools_it_builds():
    assert "test-backend-ops" in llamacpp.BINARIES and "llama-bench" in llamacpp.BINARIES
    with pytest.raises(SpecPrefetchError, match="llama-server.*test-backend-ops|test-backend-ops"):
        llamacpp.tool_path("llama-server")


def test_gguf_recipes_name_the_quantiser():
    assert llamacpp.GGUF_TYPE_FOR_EXPERTS == {"fp16": "f16", "int8": "q8_0", "int4": "q4_0"}
    # Q8_0 and Q4_0 are llama-quantize's (of the f16 conversion); a convert_hf_to_gguf q8_0 is another file
    assert llamacpp.GGUF_RECIPE["q8_0"] != "q8_0" and llamacpp.GGUF_RECIPE["f16"] == "f16"
    args = llamacpp._cmake_args("host", Path("/src"), Path("/b"))
    assert "-DLLAMA_BUILD_TESTS=ON" in args
    import platform
    if platform.machine() == "x86_64":
        assert f"-DCMAKE_CXX_FLAGS={llamacpp.NO_AMX_FLAGS}" in args


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
def test_llama_bench_and_test_backend_ops(llama_bins, embedded_gguf):
    got = llamacpp.bench(llama_bins, embedded_gguf, threads=1, prompt_tokens=[16], gen_tokens=4, repetitions=1)
    assert [(b["test"], b["threads"], b["repack"]) for b in got] == [("pp16", 1, True), ("tg4", 1, True)]
    assert all(b["tokens_per_s"] > 0 and b["ms_per_token"] > 0 for b in got)
    tbo = llamacpp.tool_path("test-backend-ops", log=lambda s: None)
    import subprocess

    r = subprocess.run([str(tbo), "--help"], capture_output=True, text=True, timeout=60)
    assert "perf" in r.stdout + r.stderr


@pytest.mark.slow
def test_llamacpp_arm64_starts_under_qemu():
    bins = llamacpp.build("arm64")
    assert "version" in llamacpp.check_arm64(bins)


# ------------------------------------------------------------------------- side by side (issue 11)

def _fake_model(tmp_path: Path):
    from toolkit.peers import sidebyside as sbs

    m = sbs._Model(label="fake", desc="fake", bundle=tmp_path, source=tmp_path, manifest={}, tokenizer=None,
                   texts=["a", "b", "c", "d"], ids=[[1, 2], [3, 4], [5, 6, 7, 8], [9, 10, 11, 12]], plen=[2, 2, 4, 4],
                   model_bytes=1000 * MiB, slot_bytes=MiB, experts=400, top_k=4, graph="adapter",
                   footprint_bytes=100 * MiB, quantised=True, ref_resident=[[1], [2], [3], [4]])
    return m


def test_sidebyside_interleaves_skips_and_assembles_rows(tmp_path, monkeypatch):
    from toolkit.peers import sidebyside as sbs

    calls = []

    def fake_llama(bins, m, i, n_new, limit, threads, timeout, readaround=True, repack="auto"):
        eng = "llama.cpp" if readaround else "llama.cpp:read-around-off"
        assert repack == "auto"
        calls.append((eng, limit, i, threads))
        if readaround and limit is not None and limit <= 500 * MiB:  # thrashes: times out at 50%
            return {"status": "timeout", "wall_s": timeout}
        return {"status": "ok", "tpot_ms": (10.0 if readaround else 5.0) * threads + i, "ttft_ms": 50.0 * len(m.ids[i]),
                "mib_read": 1000.0, "peak_rss_bytes": 900 * MiB, "tokens_match": True, "tokens_agree": 8,
                "wall_s": 1.0, "readaround_off": None if readaround else True,
                "repack": sbs.llama_repack(repack, m.gguf_type, limit)}

    def fake_native(m, i, n_new, policy, pool, limit, threads, timeout, preload=False):
        calls.append(("resident" if preload else policy, limit, i, threads))
        assert not preload or (limit is None and pool >= m.all_mib), (preload, limit, pool)
        assert limit is None or (pool * MiB + m.footprint_bytes < limit), (pool, limit)
        if limit is not None and limit <= 250 * MiB and policy.startswith("on-demand"):
            return {"status": "oom", "peak_rss_bytes": limit, "wall_s": 0.5}
        return {"status": "ok", "tpot_ms": 2.0 + i, "ttft_ms": 20.0 * len(m.ids[i]), "mib_read": 100.0,
                "peak_rss_bytes": 300 * MiB, "tokens_match": False, "tokens_match_resident": i != 3, "tokens_agree": 8,
                "runner_mib_read": 80.0, "hit_rate": 0.9, "stall_ms_per_token": 0.1, "direct_io": True, "wall_s": 1.0}

    monkeypatch.setattr(sbs, "_run_llama", fake_llama)
    monkeypatch.setattr(sbs, "_run_native", fake_native)
    m = _fake_model(tmp_path)
    limits = (1.0, 0.5, 0.25, None)
    rows = sbs._measure([m], tmp_path, limits=limits, rounds=2, new_tokens=8, threads=(1, 2), timeout_s=60,
                        pool_margin=sbs.default_margin, timings={}, log=lambda s: None)
    sbs.add_ratios(rows)
    engines = ["llama.cpp", "llama.cpp:read-around-off", "native:resident", "native:on-demand+lru",
               "native:adapter+prediction"]
    # native:resident (every expert preloaded: the warm comparison) only where there is no limit
    assert [(r["threads"], r["memory_limit_frac"], r["prompt_tokens"], r["engine"]) for r in rows] == \
        [(t, f, n, e) for t in (1, 2) for f in limits for n in (2, 4) for e in engines
         if f is None or e != "native:resident"]
    assert not [c for c in calls if c[0] == "resident" and c[1] is not None]
    assert len([c for c in calls if c[0] == "resident"]) == 2 * 2 * len(m.ids)  # threads x rounds x prompts, no limit
    # interleaved: the first two runs at 100%, 1 thread, are ABCD then DCBA
    assert [c[0] for c in calls[:8]] == ["llama.cpp", "llama.cpp:read-around-off", "on-demand+lru",
                                         "adapter+prediction", "adapter+prediction", "on-demand+lru",
                                         "llama.cpp:read-around-off", "llama.cpp"]
    by = {(r["threads"], r["memory_limit_frac"], r["prompt_tokens"], r["engine"]): r for r in rows}
    ok = by[(1, 1.0, 2, "llama.cpp")]
    assert ok["status"] == "ok" and ok["tpot_ms"] == 10.5 and ok["runs_ok"] == ok["runs"] == 4  # prompts 0, 1 x 2
    assert ok["mmap_mode"] == "mmap (default), no repack" and ok["pool_mib"] is None and ok["repack"] is False
    assert by[(1, None, 2, "llama.cpp")]["mmap_mode"] == "mmap (default), repack"
    assert ok["model_bytes"] == 1000 * MiB and ok["memory_limit_bytes"] == 1000 * MiB
    nora = by[(2, 1.0, 4, "llama.cpp:read-around-off")]
    assert nora["tpot_ms"] == 12.5 and nora["ttft_ms"] == 200.0 and nora["readaround_off"] is True
    assert "read-around off" in nora["mmap_mode"]
    nat = by[(1, 1.0, 4, "native:adapter+prediction")]
    assert nat["tpot_ms"] == 4.5 and nat["ttft_ms"] == 80.0 and nat["hit_rate"] == 0.9 and 0 < nat["pool_mib"] < 900
    assert nat["mmap_mode"] == "O_DIRECT into a pool" and nat["tokens_match"] is False
    assert nat["tokens_match_resident"] is False  # prompt 3 did not give the resident tokens
    assert by[(1, 1.0, 2, "native:adapter+prediction")]["tokens_match_resident"] is True
    # ratios: native / each llama.cpp row of the same threads, limit and prompt length
    assert nat["native_over_llama_cpp_tpot"] == round(4.5 / 12.5, 3)
    assert nat["native_over_llama_cpp_readaround_off_tpot"] == round(4.5 / 7.5, 3)
    assert nat["native_over_llama_cpp_ttft"] == round(80 / 200, 3)
    assert "native_over_llama_cpp_tpot" not in ok
    # a timeout is run once, then not again at that limit, nor at smaller limits, per thread count
    assert by[(1, 0.5, 2, "llama.cpp")]["status"] == "timeout" and by[(1, 0.5, 2, "llama.cpp")]["runs_ok"] == 0
    assert by[(1, 0.5, 2, "native:adapter+prediction")]["native_over_llama_cpp_tpot"] is None
    assert by[(1, 0.5, 2, "native:adapter+prediction")]["native_over_llama_cpp_readaround_off_tpot"] is not None
    for t in (1, 2):
        assert sum(1 for c in calls if c[0] == "llama.cpp" and c[1] == 500 * MiB and c[3] == t) == 1
        assert not [c for c in calls if c[0] == "llama.cpp" and c[1] == 250 * MiB and c[3] == t]
        assert "not run" in by[(t, 0.25, 4, "llama.cpp")]["skipped"]
        assert by[(t, 0.25, 2, "llama.cpp:read-around-off")]["status"] == "ok"
    assert (by[(2, None, 2, "llama.cpp")]["status"] == "ok"
            and by[(2, None, 2, "native:on-demand+lru")]["pool_mib"] == 400)
    assert by[(1, 0.25, 2, "native:on-demand+lru")]["status"] == "oom"
    assert by[(1, 0.25, 2, "native:adapter+prediction")]["status"] == "ok"

    bench = [{"model": "fake", "test": "pp4", "n_prompt": 4, "n_gen": 0, "threads": 1, "tokens_per_s": 99.0,
              "stddev": 1.0}, {"model": "fake", "test": "tg32", "n_prompt": 0, "n_gen": 32, "threads": 1,
                               "tokens_per_s": 50.0, "stddev": 0.5}]
    result = {"rows": rows, "llama_bench": bench, "machine": {"cpu": "x"}, "notes": ["a note"],
              "protocol": {"prompts": 2, "prompt_tokens": [2, 4], "new_tokens": 8, "rounds": 2, "threads": [1, 2]}}
    md = sbs.markdown(result)
    assert "| 1 | 50% | 500.0 | llama.cpp | mmap (default) | 2 | - | - |" in md and "timeout (not run)" in md
    assert "| 1 | 100% | 1000.0 | llama.cpp | mmap (default), no repack | 2 |" in md
    assert "| 1 | 100% | 1000.0 | native:adapter+prediction | O_DIRECT into a pool | 4 |" in md
    assert "| 0.36 | 0.40 | 0.60 |" in md  # native / llama.cpp TPOT, TTFT, then against read-around off
    assert "100.0 (80.0)" in md and "- a note" in md and "no; resident: no" in md
    assert "| TTFT 2 | TTFT 4 | TPOT 2 | TPOT 4 |" in md
    assert "| 1 | 100% | llama.cpp (read-around off) | 100.0 | 200.0 | 5.50 | 7.50 |" in md
    # llama-bench beside ours: pp4 = 4 tokens / llama.cpp's 200 ms TTFT; tg = 1000 / the shortest prompt's TPOT
    assert "| 1 | pp4 | 99.0 ± 1.0 | 20.0 | 50.0 | 50.0 |" in md
    assert f"| 1 | tg32 | 50.0 ± 0.5 | {1000 / 10.5:.1f} | {1000 / 2.5:.1f} | {1000 / 2.5:.1f} |" in md
    mdp, png = sbs.write(result, tmp_path / "out" / "sbs.json")
    assert json.loads((tmp_path / "out" / "sbs.json").read_text())["rows"] == rows
    assert mdp.read_text() == md and png.stat().st_size > 10_000


def test_sidebyside_command_line_lists():
    from toolkit.peers import sidebyside as sbs

    # llama.cpp's repacking: with no limit only by default (its repacked copy is anonymous memory)
    assert sbs.llama_repack("auto", "q4_0", None) is True and sbs.llama_repack("auto", "q4_0", 10) is False
    assert sbs.llama_repack("on", "q8_0", 10) is True and sbs.llama_repack("off", "f16", None) is False
    with pytest.raises(SpecPrefetchError, match="repacking 'sometimes'"):
        sbs.llama_repack("sometimes", "f16", None)

    assert sbs.parse_limits("none,1,0.5,0.25") == (None, 1.0, 0.5, 0.25)
    assert sbs.parse_ints("1,2", "--threads") == [1, 2] and sbs.parse_ints("128,512", "--prompt-tokens") == [128, 512]
    for bad in ("0", "a,2", ""):
        with pytest.raises(SpecPrefetchError, match="--threads"):
            sbs.parse_ints(bad, "--threads")
    with pytest.raises(SpecPrefetchError, match="--limits"):
        sbs.parse_limits("half")
    with pytest.raises(SpecPrefetchError, match="prompt_tokens"):
        sbs._ints([128, 0], "prompt_tokens")


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
    r = sbs.run([bundle], limits=(1.0, None), prompts=1, prompt_tokens=[24], new_tokens=8, rounds=1, threads=[1],
                gguf_dir=tmp_path, timeout_s=300, log=lambda s: None)
    rows = r["rows"]
    graph = json.loads((bundle / "manifest.json").read_text())["predictor"]["kind"]
    engines = ["llama.cpp", "llama.cpp:read-around-off", "native:resident", "native:on-demand+lru",
               f"native:{graph}+prediction"]
    # native:resident (every expert preloaded) runs with no limit only
    assert [(x["memory_limit_frac"], x["engine"]) for x in rows] == [
        (f, e) for f in (1.0, None) for e in engines if f is None or e != "native:resident"]
    gguf = Path(r["models"][0]["gguf"])
    for x in rows:
        assert x["model"] == "embedded" and x["model_bytes"] == gguf.stat().st_size
        assert x["threads"] == 1 and x["prompt_tokens"] == 24
        assert x["status"] == "ok", x
        assert x["tokens_match"] is True, x
        assert x["tpot_ms"] > 0 and x["ttft_ms"] > 0 and x["mib_read"] > 0
    limited = [x for x in rows if x["memory_limit_frac"] == 1.0]
    for x in limited:
        assert x["memory_limit_bytes"] == gguf.stat().st_size
        assert 0 < x["cgroup_max_usage_bytes"] <= x["memory_limit_bytes"]  # the limit held
    for x in limited[2:]:  # (llama.cpp's RSS counts shared library pages charged elsewhere: it may exceed it)
        assert 0 < x["peak_rss_bytes"] <= x["memory_limit_bytes"], x
        assert x["pool_mib"] > 0 and x["direct_io"] is True and x["runner_mib_read"] > 0
        assert x["native_over_llama_cpp_tpot"] > 0 and x["native_over_llama_cpp_readaround_off_ttft"] > 0
    assert all(x["readaround_off"] is True for x in rows if x["engine"] == "llama.cpp:read-around-off")
    # llama-bench at no limit: pp24 and tg32 at one thread
    assert [(b["test"], b["threads"]) for b in r["llama_bench"]] == [("pp24", 1), ("tg32", 1)]
    assert all(b["tokens_per_s"] > 0 for b in r["llama_bench"])
    assert r["machine"]["cores"] and r["models"][0]["native_footprint"]["footprint_bytes"] > 0
    md = sbs.markdown(r)
    assert "| 1 | 100% |" in md and "llama.cpp (read-around off)" in md and "| 1 | tg32 |" in md


def test_sidebyside_keeps_the_rows_measured_before_an_error(tmp_path, monkeypatch):
    """_measure appends each limit's rows as it finishes them, so an error mid-way leaves those rows
    with the caller (run() reports them as a partial result)."""
    from toolkit.peers import sidebyside as sbs

    def fake_llama(bins, m, i, n_new, limit, threads, timeout, readaround=True, repack="auto"):
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
    assert {r["memory_limit_frac"] for r in rows} == {1.0} and len(rows) == 8  # 4 engines x 2 prompt lengths
