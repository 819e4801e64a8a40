"""The native runner's C++ tokenizer (ExecuTorch's HFTokenizer, built from the pytorch-tokenizers
sdist) against Hugging Face's tokenizers on the bundle's tokenizer.json: the same ids and the same
text for a few hundred strings (words, digits, whitespace runs, accents, CJK, emoji, special
tokens written in the text), and text in / text out through the runner and the CLI. Building the
tokenizer library takes a few minutes, so this module is in `make test-all`."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from android_runner.build import build, command, has_tokenizer

pytestmark = pytest.mark.slow

PIECES = ["the", " expert", "'s", " café", " naïve", "Straße", " 東京", "の", " 😀", "🚀🚀", " 3.14", "2026",
          " 1234567", "  ", "   ", "\n", "\n\n", "\t", " \n ", "!", "?!", "...", "—", " (x)", "<|im_start|>",
          "<|im_end|>", "<|endoftext|>", "user", " ÅÉÎ", "ñ", " Привет", "мир", " العربية", "\u200b", "don't",
          " I'm", " we've"]


def corpus(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = ["", " ", "a", "Hello, world!"] + [p for p in PIECES]
    while len(out) < n:
        out.append("".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12))))
    return [s for s in out if s]


@pytest.fixture(scope="module")
def native(embedded_bundles, tmp_path_factory):
    bundle = embedded_bundles["executorch"]
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECPREFETCH_PROFILES", str(tmp_path_factory.mktemp("cache") / "profiles"))
    out = build(bundle, "host", log=lambda s: None, tokenizer=True)
    yield bundle, out
    mp.undo()


def test_same_ids_and_text_as_hugging_face(native):
    bundle, out = native
    path = bundle / "model" / "tokenizer.json"
    hf = Tokenizer.from_file(str(path))
    texts = corpus()
    r = subprocess.run([str(out / "bin" / "check_tokenizer"), str(path)], input="\n".join(json.dumps(t) for t in texts),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(got) == len(texts)
    for t, g in zip(texts, got):
        ids = hf.encode(t, add_special_tokens=False).ids
        assert g["ids"] == ids, t
        assert g["text"] == hf.decode(ids, skip_special_tokens=False), t


def test_text_in_and_out_through_the_runner_and_the_cli(native, tmp_path):
    bundle, out = native
    assert has_tokenizer(out)
    hf = Tokenizer.from_file(str(bundle / "model" / "tokenizer.json"))
    text = "The kernel's memory<|im_end|> 東京"
    js = tmp_path / "r.json"
    r = subprocess.run([*command(out, "host"), str(bundle), "--prompt", text, "--max-new-tokens", "6",
                        "--json", str(js)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(js.read_text())
    run = res["runs"][0]
    assert res["tokenizer"].startswith("HFTokenizer") and run["prompt"] == text
    assert run["prompt_ids"] == hf.encode(text, add_special_tokens=False).ids
    assert run["text"] == hf.decode(run["tokens"], skip_special_tokens=False) and len(run["tokens"]) == 6
    # the CLI gives the runner text when it has a tokenizer, and checks against transformers
    cli = tmp_path / "cli.json"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run(["specprefetch", "run", str(bundle), "--engine", "native", "--policy", "next-gate+prediction",
                        "--prompt", text,
                        "--max-new-tokens", "6", "--check", "--json", str(cli)], capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    c = json.loads(cli.read_text())["runs"][0]
    assert c["matches_unmodified_model"] is True and c["text"] == run["text"] and "warning" not in r.stderr


def test_an_unsupported_tokenizer_is_refused_for_text_and_skipped_for_ids(native, tmp_path):
    """HFTokenizer would skip a decoder it does not know and decode wrongly: the runner refuses it
    for --prompt (naming the file and the part) and runs --prompt-ids without text output."""
    import shutil

    bundle, out = native
    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    tj = b / "model" / "tokenizer.json"
    t = json.loads(tj.read_text())
    t["decoder"] = {"type": "Sequence", "decoders": [t["decoder"], {"type": "Strip", "content": " ", "start": 1,
                                                                    "stop": 0}]}
    tj.write_text(json.dumps(t))
    # the manifest lists the tokenizer's hash: re-hash it as an export would
    m = json.loads((b / "manifest.json").read_text())
    import hashlib

    for name, f in m["files"].items():
        p = b / name
        if p.is_file():
            f["sha256"], f["size"] = hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_size
    (b / "manifest.json").write_text(json.dumps(m))
    r = subprocess.run([*command(out, "host"), str(b), "--prompt", "hello", "--max-new-tokens", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "decoder 'Strip' is not supported" in r.stderr and "tokenizer.json" in r.stderr
    js = tmp_path / "ids.json"
    r = subprocess.run([*command(out, "host"), str(b), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--json",
                        str(js)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(js.read_text())
    assert res["tokenizer"] is None and "Strip" in res["tokenizer_note"] and "text" not in res["runs"][0]
