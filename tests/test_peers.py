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
