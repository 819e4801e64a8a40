"""Fuzz every loader of a file the user hands the toolkit: random bytes, and random mutations of real
artifacts (expert stores, adapters, bundles, model directories, trace manifests and resume files).

Each case mutates a real artifact, built once per module from the tiny models of tests/conftest.py
(the bundle is the session's shared ExecuTorch export), then runs everything the commands read from
it. The case passes when the loader accepts it (many mutations are harmless: a byte of padding, a
descriptive field) or refuses it with a one-line SpecPrefetchError that names the file; through the
CLI, exit 0 or exit 2 with one `error:` line. Any other exception fails the case.

Mutations: bit flips, byte overwrites, runs of random bytes, truncation, extension, insertion,
deletion, duplication, random bytes of random length; JSON-aware edits of JSON files (a value of
another type, a key deleted, huge / negative / non-finite numbers, 5000-digit integers, deeply nested
junk, wrong and unencodable strings, lists emptied or grown); and "faulty writers" that keep the
checksums right (a store re-sealed after its header, index or metadata was edited; an adapter or a
bundle file whose recorded sha256 was updated), so the checks behind the checksums are reached.

Report outputs: every command's --json / --events / calibrate --out pointed (with and without
--overwrite) at a file of an input or of another artifact, or at a new file inside one, must be
refused before any work with every byte and mtime left as it was.

Traces: tests/test_trace.py fuzzes the manifest's fields and the shards' bytes and
fields (checksums matching); this module adds the manifest's raw bytes and the value kinds that fuzz
does not use, the model the manifest points to, and TRACE.partial/progress.json (resume).

Reproduce: every case has its own RNG, seeded by (seed, target, case number). A failure prints
them; `SPECPREFETCH_FUZZ_SEED=S SPECPREFETCH_FUZZ_CASE=N pytest tests/test_fuzz_loaders.py -k TARGET`
runs that one case again (the default seed is fixed, so runs are repeatable).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import struct
import traceback
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from adapters.checkpoint import load_adapter, read_adapter_meta
from adapters.train import TrainConfig, train_adapter
from conftest import HELDOUT
from export.manifest import validate_bundle
from test_trace import _consume as consume_trace_files
from toolkit.cli import main
from toolkit.errors import SpecPrefetchError
from toolkit.models import checkpoint as ckpt
from toolkit.models.info import model_info
from toolkit.models.loader import build_on_meta, eos_token_ids, inspect_model_dir, load_dense_model
from toolkit.models.routers import load_router_bank
from toolkit.runtime.expert_store import ALIGN, ENTRY, HEADER, ExpertStore, build_store, seal_header
from toolkit.runtime.fingerprint import _digest
from toolkit.traces.capture import TraceSettings, run_trace
from toolkit.traces.format import TraceReader, TraceWriter, trace_model_spec

SEED = int(os.environ.get("SPECPREFETCH_FUZZ_SEED", "13"))
ONLY = os.environ.get("SPECPREFETCH_FUZZ_CASE")  # run one case number of each fuzz (reproduce a failure)
VERBOSE = bool(os.environ.get("SPECPREFETCH_FUZZ_VERBOSE"))  # print every case and its error (with -s)
FAM = "qwen3_moe"      # tiny: MoE layers 1..3, 8 experts, top-2, hidden 64
BIAS_FAM = "gpt_oss"   # experts with biases (the store's bias sections)


# -- the harness -------------------------------------------------------------------------------------

@dataclasses.dataclass
class Outcome:
    ok: int = 0
    refused: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)


def case_numbers(cases: int) -> range | list[int]:
    return [int(ONLY)] if ONLY is not None else range(cases)


def case_rng(target: str, n: int) -> random.Random:
    return random.Random(f"{SEED}/{target}/{n}")  # str seeds are stable across runs and processes


@contextlib.contextmanager
def bounded_memory(extra: int = 3 << 30) -> Iterator[None]:
    """While fuzzing, an allocation past the current size + `extra` fails (a MemoryError, which the
    fuzz reports) instead of taking the machine's memory: a loader that trusts a size in a file
    must not allocate what the file claims."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        cap = vm + extra
        if hard != resource.RLIM_INFINITY:
            cap = min(cap, hard)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except (ImportError, OSError, ValueError):
        yield
        return
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


class Hung(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """A case that blocks (a loader opening a FIFO, a loop that never ends) fails instead of hanging."""
    def alarm(signum, frame):  # noqa: ARG001
        raise Hung(f"no result after {seconds:g} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_fuzz(target: str, cases: int, mutate: Callable[[random.Random, int], str],
             consume: Callable[[int], None], restore: Callable[[], None], names: tuple[str, ...]) -> Outcome:
    """Case n: mutate(rng, n) edits the artifact in place and says how; consume(n) reads it as the
    commands do; restore() puts the real artifact back. A SpecPrefetchError must be one line naming
    one of `names`; so must an OSError (the CLI prints it as `error: PATH: ...`, see
    tests/test_cli.py::TestOsErrors::test_os_errors_name_the_path). Any other exception is a failure (all
    are collected, then reported together)."""
    out = Outcome()
    for n in case_numbers(cases):
        rng = case_rng(target, n)
        what = "?"
        try:
            what = mutate(rng, n)
            ckpt._read_header.cache_clear()  # a rewrite within one mtime tick must not hit the cache
            with bounded_memory(), deadline(30):
                consume(n)
            out.ok += 1
            if VERBOSE:
                print(f"{target} {n}: {what}\n    -> accepted")
        except (SpecPrefetchError, OSError) as e:
            out.refused += 1
            msg = str(e) if isinstance(e, SpecPrefetchError) else f"{e.filename}: {e.strerror}"
            if VERBOSE:
                print(f"{target} {n}: {what}\n    -> {msg[:200]}")
            if "\n" in msg or not any(s in msg for s in names):
                out.failures.append(f"{target} case {n} (seed {SEED}, {what}): {type(e).__name__} that is not "
                                    f"one line naming {names[0]}: {msg!r}")
        except Exception as e:  # noqa: BLE001 - what the fuzz is looking for
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
            out.failures.append(f"{target} case {n} (seed {SEED}, {what}): {type(e).__name__}: "
                                f"{str(e)[:300]}\n{tb}")
        finally:
            restore()
    return out


def check(out: Outcome, target: str, cases: int) -> None:
    print(f"{target}: {out.ok} cases accepted, {out.refused} refused, {len(out.failures)} failed")
    for f in out.failures:
        print(f.splitlines()[0])
    if out.failures:
        head = "\n\n".join(out.failures[:6])
        pytest.fail(f"{len(out.failures)} of {cases} {target} cases failed (reproduce one with "
                    f"SPECPREFETCH_FUZZ_SEED={SEED} SPECPREFETCH_FUZZ_CASE=N):\n\n{head}", pytrace=False)
    if ONLY is None:
        assert out.refused > 0, f"{target}: no mutation was refused: the fuzz reaches nothing"


# -- mutations ---------------------------------------------------------------------------------------

INTERESTING_BYTES = (0x00, 0x01, 0x7F, 0x80, 0xFF, 0x20, 0x22, 0x5B, 0x7B, 0x30)


def mutate_bytes(data: bytes, rng: random.Random, hot: int = 0) -> tuple[bytes, str]:
    """One random byte-level edit of `data`; positions fall in the first `hot` bytes (a header)
    about two times in three."""
    b = bytearray(data)

    def at(end_ok: bool = False) -> int:
        n = len(b) + (1 if end_ok else 0)
        if n <= 0:
            return 0
        if hot and rng.random() < 0.67:
            return rng.randrange(min(hot, n))
        return rng.randrange(n)

    op = rng.choice(["flip", "flip", "byte", "run", "truncate", "extend", "insert", "delete", "dup",
                     "zero", "random"])
    if op == "flip" and b:
        k = rng.randint(1, 8)
        for _ in range(k):
            i = at()
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b), f"{k} bit flips"
    if op == "byte" and b:
        i = at()
        b[i] = rng.choice(INTERESTING_BYTES) if rng.random() < 0.5 else rng.randrange(256)
        return bytes(b), f"byte {i} overwritten"
    if op == "run" and b:
        i = at()
        k = rng.randint(2, 64)
        b[i:i + k] = rng.randbytes(min(k, len(b) - i))
        return bytes(b), f"{k} random bytes at {i}"
    if op == "truncate":
        i = at()
        return bytes(b[:i]), f"truncated to {i} bytes"
    if op == "extend":
        k = rng.choice([1, 7, 4096, rng.randint(1, 20000)])
        return bytes(b) + rng.randbytes(k), f"extended by {k} bytes"
    if op == "insert":
        i = at(True)
        k = rng.randint(1, 32)
        b[i:i] = rng.randbytes(k)
        return bytes(b), f"{k} bytes inserted at {i}"
    if op == "delete" and b:
        i = at()
        k = rng.randint(1, 64)
        del b[i:i + k]
        return bytes(b), f"{k} bytes deleted at {i}"
    if op == "dup" and b:
        i = at()
        k = rng.randint(1, 256)
        b[i:i] = b[i:i + k]
        return bytes(b), f"{k} bytes duplicated at {i}"
    if op == "zero" and b:
        i = at()
        k = rng.randint(1, 256)
        b[i:i + k] = bytes(min(k, len(b) - i))
        return bytes(b), f"{k} bytes zeroed at {i}"
    k = rng.choice([0, 1, 8, 9, rng.randint(0, 2 * len(b) + 16)])
    return rng.randbytes(k), f"replaced by {k} random bytes"


SENTINEL = "\x00FUZZ-RAW\x00"
# raw JSON text a value is replaced with: what json.dumps never writes, but a file may hold
RAW = ("1" * 5000, "-" + "9" * 4400, "1e999", "-1e999", "NaN", "-Infinity", "[" * 50000 + "]" * 50000,
       '{"a":' * 30000 + "1" + "}" * 30000, '"\\ud800"', '"\\udcff\\u0000"', "1.0", "0.5", "-0",
       "123456789012345678901234567890", "1e-400")
JUNK = (None, True, False, 0, 1, -1, 2, 7, -7, 255, 4096, 2**31 - 1, 2**31, -2**31, 2**32, 2**53 + 1,
        2**63, -2**63, 2**64, 10**30, -10**30, 0.5, -0.0, 1.5, 1e308, -1e308, float("nan"), float("inf"),
        float("-inf"), "", "x", "0", "8", "true", "null", "fp16", "int4", "../../../etc/passwd",
        "/etc/passwd", "/", ".", "..", "a/../../b", "é∂ƒ", "\u0000", "x" * 5000, [], {}, [None], [1, "a"],
        [[[[[]]]]], {"a": {"b": [1, {"c": None}]}}, [0] * 1000, list(range(-3, 3)), {"": ""})


def _nodes(o: Any, path: tuple = ()) -> Iterator[tuple]:
    yield path
    if isinstance(o, dict):
        for k, v in o.items():
            yield from _nodes(v, path + (k,))
    elif isinstance(o, list):
        for i, v in enumerate(o):
            yield from _nodes(v, path + (i,))


def _get(o: Any, path: tuple) -> Any:
    for k in path:
        o = o[k]
    return o


def _tweak(v: Any, rng: random.Random) -> Any:
    """A value near `v`, of its own type where it has one."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return rng.choice([-v, v + 1, v - 1, v * 1000, v * 2**32, 0, -1, 2**63 - v, v + 0.5, float(v)])
    if isinstance(v, float):
        return rng.choice([-v, v * 1e6, 0.0, float("nan"), float("inf"), math.nextafter(v, math.inf),
                           int(v) if math.isfinite(v) else 0])
    if isinstance(v, str):
        return rng.choice(["", v + "x", v[:-1], v.upper(), "../" + v, "/" + v, v * 50, v + "\u0000",
                           v.replace("/", "/../")])
    if isinstance(v, list):
        w = list(v)
        op = rng.randrange(5)
        if op == 0:
            return []
        if op == 1 and w:
            return w + w
        if op == 2 and w:
            del w[rng.randrange(len(w))]
            return w
        if op == 3:
            return w[::-1]
        return w + [rng.choice(JUNK)]
    if isinstance(v, dict):
        w = dict(v)
        if w and rng.random() < 0.5:
            del w[rng.choice(list(w))]
        else:
            w["fuzz"] = rng.choice(JUNK)
        return w
    return rng.choice(JUNK)


def mutate_json(obj: Any, rng: random.Random, edits: int | None = None) -> tuple[str, str]:
    """JSON text of `obj` after 1-4 random edits, and a description of them."""
    o = copy.deepcopy(obj)
    raw: list[str] = []
    done = []
    for _ in range(edits or rng.choice([1, 1, 1, 2, 3, 4])):
        paths = list(_nodes(o))
        path = rng.choice(paths)
        op = rng.choice(["junk", "junk", "tweak", "tweak", "delete", "raw", "swap", "root"])
        if not path or op == "root":
            if rng.random() < 0.5 or not isinstance(o, (dict, list)):
                o = rng.choice(JUNK)
                done.append("document replaced")
                continue
            path = rng.choice(paths[1:] or [()])
            if not path:
                continue
        parent, key = _get(o, path[:-1]), path[-1]
        if op == "delete":
            del parent[key]
        elif op == "junk":
            parent[key] = copy.deepcopy(rng.choice(JUNK))
        elif op == "tweak":
            parent[key] = _tweak(parent[key], rng)
        elif op == "raw":
            raw.append(rng.choice(RAW))
            parent[key] = SENTINEL + str(len(raw) - 1)
        else:  # another node's value, of another field: a realistic type confusion
            other = rng.choice(paths)
            if other[:len(path)] == path:  # not a value inside this one
                continue
            parent[key] = copy.deepcopy(_get(o, other))
        done.append(f"{op} at {'.'.join(map(str, path))[:60]}")
    text = json.dumps(o)
    for i, r in enumerate(raw):
        text = text.replace(json.dumps(SENTINEL + str(i)), r)
    return text, "; ".join(done) or "no edit"


def mutate_json_file(path: Path, original: bytes, rng: random.Random) -> str:
    """A JSON file rewritten: JSON-aware edits three times in four, else byte edits of its text."""
    if rng.random() < 0.75:
        text, what = mutate_json(json.loads(original), rng)
        path.write_bytes(text.encode("utf-8", "surrogatepass"))
        return f"{path.name}: {what}"
    data, what = mutate_bytes(original, rng)
    path.write_bytes(data)
    return f"{path.name}: {what}"


def replace_path(path: Path, rng: random.Random) -> str:
    """The file is gone, or something else stands at its name."""
    kind = rng.choice(["missing", "directory", "empty", "symlink loop", "dangling symlink", "fifo"])
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    if kind == "directory":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "symlink loop":
        path.symlink_to(path.name)
    elif kind == "dangling symlink":
        path.symlink_to(path.parent / "no-such-file")
    elif kind == "fifo":
        os.mkfifo(path)
    return f"{path.name}: {kind}"


class Snapshot:
    """The bytes of some files of an artifact, put back after each case."""

    def __init__(self, root: Path, rels: list[str]):
        self.root = root
        self.files = {rel: (root / rel).read_bytes() for rel in rels}
        self.touched: set[str] = set()

    def path(self, rel: str) -> Path:
        self.touched.add(rel)
        return self.root / rel

    def restore(self) -> None:
        for rel in self.touched:
            p = self.root / rel
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()
            p.write_bytes(self.files[rel])
        self.touched.clear()


# -- artifacts, built once per module ------------------------------------------------------------------

@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """The weights-hash cache (and store cache) of this module live in a temporary directory."""
    monkeypatch.setenv("SPECPREFETCH_PROFILES", str(tmp_path_factory.getbasetemp() / "fuzz-cache" / "profiles"))


@pytest.fixture(scope="module")
def art(tiny_models, tmp_path_factory) -> dict[str, Any]:
    """A trace of the tiny model, an adapter trained on it, an int4 store of it and an fp16 store of a
    model whose experts have biases (pristine copies: each fuzz works on its own copy)."""
    d = tmp_path_factory.mktemp("fuzz-art")
    old = os.environ.get("SPECPREFETCH_PROFILES")
    os.environ["SPECPREFETCH_PROFILES"] = str(d / "cache" / "profiles")
    try:
        model = tiny_models[FAM]
        run_trace(model, [HELDOUT], d / "trace", TraceSettings(max_sequences=8, prompt_tokens=24, decode_tokens=4,
                                                              heldout_frac=0.25, shard_tokens=60, batch=8),
                  progress=False)
        train_adapter(d / "trace", d / "adapter", TrainConfig(steps=4, val_every=2, batch_size=16, rank=2),
                      progress=False)
        build_store(inspect_model_dir(model), d / "int4.spx", "int4", progress=False)
        build_store(inspect_model_dir(tiny_models[BIAS_FAM]), d / "bias.spx", "fp16", progress=False)
    finally:
        if old is None:
            os.environ.pop("SPECPREFETCH_PROFILES", None)
        else:
            os.environ["SPECPREFETCH_PROFILES"] = old
    return {"dir": d, "model": model, "bias_model": tiny_models[BIAS_FAM], "trace": d / "trace",
            "adapter": d / "adapter", "int4": d / "int4.spx", "bias": d / "bias.spx"}


def cli(*args) -> tuple[int, str, BaseException | None]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output, r.exception


def cli_clean(code: int, output: str, exc: BaseException | None, what: str) -> None:
    """Exit 0, or exit 2 with exactly one `error:` line and no traceback."""
    if code == 0:
        return
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    if code != 2 or len(errors) != 1 or "Traceback" in output or not isinstance(exc, SystemExit):
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:]) if exc else ""
        raise AssertionError(f"CLI not clean ({what}): exit {code}, output {output[-800:]!r}\n{tb}")


# -- expert stores -------------------------------------------------------------------------------------

@dataclasses.dataclass
class StoreParts:
    """A store file taken apart: header fields, index entries, metadata, blobs."""
    fields: list
    entries: list[list[int]]
    meta: bytes
    blobs: list[bytes]

    @classmethod
    def parse(cls, raw: bytes) -> "StoreParts":
        f = list(HEADER.unpack_from(raw, 0))
        L, E, meta_len, index_offset = f[3], f[4], f[10], f[11]
        entries = [list(ENTRY.unpack_from(raw, index_offset + i * ENTRY.size)) for i in range(L * E)]
        meta = raw[index_offset + ENTRY.size * L * E:index_offset + ENTRY.size * L * E + meta_len]
        blobs = [raw[e[2]:e[2] + e[3]] for e in entries]
        return cls(f, entries, meta, blobs)

    def layout(self) -> None:
        """Offsets and lengths as the writer computes them, for this metadata and these blobs."""
        f = self.fields
        f[10], f[11] = len(self.meta), HEADER.size
        f[12] = -(-(HEADER.size + ENTRY.size * len(self.entries) + len(self.meta)) // ALIGN) * ALIGN
        stride = -(-max(len(b) for b in self.blobs) // ALIGN) * ALIGN
        for i, e in enumerate(self.entries):
            e[2] = f[12] + stride * i

    def assemble(self) -> bytes:
        """The file, its index CRC and header CRC computed as the reader computes them (over what
        the header says the index and metadata are), whatever the fields hold: a faulty writer."""
        mask = lambda v, bits: int(v) & ((1 << bits) - 1)  # noqa: E731
        index = b"".join(ENTRY.pack(*(mask(v, b) for v, b in zip(e, (32, 32, 64, 64, 32, 32))))
                         for e in self.entries)
        f = self.fields
        end = max([mask(f[12], 64), HEADER.size + len(index) + len(self.meta)]
                  + [mask(e[2], 64) + -(-len(b) // ALIGN) * ALIGN for e, b in zip(self.entries, self.blobs)])
        if end > 1 << 28:  # a faulty offset: the file stays of sane size (the reader sees it truncated)
            end = HEADER.size + len(index) + len(self.meta) + sum(len(b) for b in self.blobs) + ALIGN
        out = bytearray(end)
        out[HEADER.size:HEADER.size + len(index)] = index
        out[HEADER.size + len(index):HEADER.size + len(index) + len(self.meta)] = self.meta
        for e, b in zip(self.entries, self.blobs):
            off = mask(e[2], 64)
            if off + len(b) <= end and off >= HEADER.size + len(index) + len(self.meta):
                out[off:off + len(b)] = b
        vals = [f[0]] + [mask(v, 32) for v in f[1:11]] + [mask(f[11], 64), mask(f[12], 64), 0, f[14], 0]
        out[:HEADER.size] = HEADER.pack(*vals)
        L, E, meta_len, io = vals[3], vals[4], vals[10], vals[11]
        body_end = io + ENTRY.size * L * E + meta_len
        if body_end <= len(out):
            struct.pack_into("<I", out, 64, zlib.crc32(bytes(out[io:body_end])))
        seal_header(out)
        return bytes(out)


HEADER_FIELDS = ("magic", "version", "dtype", "layers", "experts", "hidden", "intermediate", "group", "flags",
                 "align", "meta_len", "index_offset", "data_offset")
U32 = (0, 1, 2, 3, 7, 8, 31, 32, 33, 64, 4095, 4096, 4097, 65535, 65536, 65537, 2**20, 2**24 + 1, 2**31,
       2**32 - 1)


def mutate_store(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    parts = StoreParts.parse(raw)
    kind = rng.choice(["meta", "meta", "meta", "header", "header", "entry", "entry", "blob", "source",
                       "bytes", "consistent-meta"])
    if kind == "bytes":
        data, what = mutate_bytes(raw, rng, hot=parts.fields[12])
        return data, f"raw bytes: {what}"
    meta = json.loads(parts.meta)
    what = kind
    if kind in ("meta", "consistent-meta"):
        text, what = mutate_json(meta, rng)
        parts.meta = text.encode("utf-8", "surrogatepass")
        if kind == "consistent-meta":  # the layout recomputed from the (edited) matrices, blobs resized
            try:
                from toolkit.models.expert_layout import blob_sections

                m = json.loads(parts.meta)
                sections, size = blob_sections([(x["role"], tuple(x["shape"])) for x in m["matrices"]], m["dtype"])
                if size > 1 << 22:
                    raise ValueError("too large a blob for a test")
                m["sections"], m["blob_size"] = [dataclasses.asdict(s) for s in sections], size
                parts.meta = json.dumps(m).encode()
                parts.blobs = [(b + bytes(size))[:size] for b in parts.blobs]
                for e, b in zip(parts.entries, parts.blobs):
                    e[3], e[4] = size, zlib.crc32(b)
                what += " (layout recomputed)"
            except Exception:  # noqa: BLE001 - an edit the layout cannot follow: plain metadata edit
                pass
        parts.layout()
    elif kind == "source":  # the weights record edited, its digest recomputed: the weights check decides
        text, what = mutate_json(meta["source"], rng, edits=1)
        try:
            new = json.loads(text)
            new["digest"] = _digest(new["files"])
            text = json.dumps(new)
        except Exception:  # noqa: BLE001 - no digest to recompute: the edited text as it is
            pass
        hole = json.dumps(dict(meta, source=SENTINEL))
        parts.meta = hole.replace(json.dumps(SENTINEL), text).encode("utf-8", "surrogatepass")
        parts.layout()
    elif kind == "header":
        for _ in range(rng.choice([1, 1, 2])):
            i = rng.randrange(1, 13)
            v = parts.fields[i]
            parts.fields[i] = rng.choice([rng.choice(U32), v + 1, v - 1, v * 2, v + ALIGN, v - ALIGN, 0,
                                          rng.getrandbits(32 if i < 11 else 64)])
            what = f"header {HEADER_FIELDS[i]} {v} -> {parts.fields[i]}"
    elif kind == "entry":
        i = rng.randrange(len(parts.entries))
        op = rng.choice(["field", "field", "swap", "dup"])
        if op == "field":
            j = rng.randrange(6)
            v = parts.entries[i][j]
            parts.entries[i][j] = rng.choice([rng.choice(U32), v + 1, v - 1, v + ALIGN, v - ALIGN, 0, 2**63])
            what = f"entry {i} field {j}: {v} -> {parts.entries[i][j]}"
        elif op == "swap":
            k = rng.randrange(len(parts.entries))
            parts.entries[i][:2], parts.entries[k][:2] = parts.entries[k][:2], parts.entries[i][:2]
            what = f"entries {i} and {k} swap their (layer, expert)"
        else:
            k = rng.randrange(len(parts.entries))
            parts.entries[k] = list(parts.entries[i])
            what = f"entry {k} duplicates entry {i}"
    else:  # blob bytes: with the entry's CRC updated (the values are read as they are) or not
        i = rng.randrange(len(parts.blobs))
        b, w = mutate_bytes(parts.blobs[i], rng)
        b = (b + bytes(len(parts.blobs[i])))[:len(parts.blobs[i])]
        parts.blobs[i] = b
        fix = rng.random() < 0.5
        if fix:
            parts.entries[i][4] = zlib.crc32(b)
        what = f"blob {i}: {w}, CRC {'updated' if fix else 'stale'}"
    return parts.assemble(), what


def consume_store(path: Path, spec) -> None:
    """What run / bench / export read: open for the model, every expert read and dequantised."""
    with ExpertStore(path, spec) as st:
        for layer, expert in st.entries:
            st.weights(layer, expert)


@pytest.mark.parametrize("cases", [60, pytest.param(1500, marks=pytest.mark.slow)])
def test_fuzzed_expert_stores(art, tmp_path, cases):
    specs = {"int4": inspect_model_dir(art["model"]), "bias": inspect_model_dir(art["bias_model"])}
    raws = {k: art[k].read_bytes() for k in specs}
    path = tmp_path / "s.spx"

    def mutate(rng, n):
        which = "int4" if n % 2 else "bias"
        data, what = mutate_store(raws[which], rng)
        path.write_bytes(data)
        return f"{which} store, {what}"

    out = run_fuzz("store", cases, mutate, lambda n: consume_store(path, specs["int4" if n % 2 else "bias"]),
                   lambda: path.unlink(missing_ok=True), (str(path),))
    check(out, "store", cases)


def test_store_paths_that_are_not_store_files(art, tmp_path):
    spec = inspect_model_dir(art["model"])
    for n in range(12):
        p = tmp_path / f"s{n}.spx"
        shutil.copyfile(art["int4"], p)
        what = replace_path(p, case_rng("store-path", n))
        with pytest.raises(SpecPrefetchError, match=str(p)):
            consume_store(p, spec)
        assert what


# -- adapters ------------------------------------------------------------------------------------------

def consume_adapter(path: Path, spec, bank) -> None:
    """What eval, simulate, run and export read: the config, the weights for this model, and one
    forward pass of every pair through the model's routers."""
    read_adapter_meta(path)
    ad, _ = load_adapter(path, spec)
    with torch.no_grad():
        ad.all_logits(bank, torch.zeros(2, len(spec.geometry.moe_layers), spec.geometry.hidden_size))


def mutate_adapter_weights(snap: Snapshot, good: dict[str, torch.Tensor], meta: dict, rng: random.Random) -> str:
    """adapter.safetensors edited; its sha256 in adapter.json updated (mostly) so the tensors are read."""
    w = snap.path("adapter.safetensors")
    kind = rng.choice(["bytes", "bytes", "tensors", "tensors"])
    if kind == "bytes":
        hot = 8 + int.from_bytes(snap.files["adapter.safetensors"][:8], "little")
        data, what = mutate_bytes(snap.files["adapter.safetensors"], rng, hot=hot)
        w.write_bytes(data)
    else:
        t = dict(good)
        name = rng.choice(["A", "B", "C"])
        op = rng.choice(["dtype", "shape", "drop", "nan", "extra", "scalar", "transpose"])
        base = t.get(name, torch.zeros(3))
        if op == "dtype":
            t[name] = base.to(rng.choice([torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int64,
                                          torch.bool]))
        elif op == "shape":
            dims = list(base.shape)
            i = rng.randrange(len(dims))
            dims[i] = max(0, dims[i] + rng.choice([-1, 1, 5]))
            t[name] = torch.zeros(dims)
        elif op == "drop":
            t.pop(name, None)
        elif op == "nan":
            t[name] = torch.full_like(base, float("nan"))
        elif op == "extra":
            t["stray"] = torch.zeros(2, 2)
        elif op == "scalar":
            t[name] = torch.tensor(1.0)
        else:
            t[name] = base.transpose(0, -1).contiguous()
        save_file(t, str(w))
        what = f"tensors: {op} {name}"
    if rng.random() < 0.85:
        m = dict(meta, weights_sha256=hashlib.sha256(w.read_bytes()).hexdigest())
        snap.path("adapter.json").write_text(json.dumps(m))
        what += ", sha256 updated"
    return f"adapter.safetensors: {what}"


@pytest.mark.parametrize("cases", [60, pytest.param(1500, marks=pytest.mark.slow)])
def test_fuzzed_adapters(art, tmp_path, cases):
    a = tmp_path / "adapter"
    shutil.copytree(art["adapter"], a)
    spec = inspect_model_dir(art["model"])
    bank = load_router_bank(spec)
    snap = Snapshot(a, ["adapter.json", "adapter.safetensors"])
    meta = json.loads(snap.files["adapter.json"])
    good = load_file(str(a / "adapter.safetensors"))

    def mutate(rng, n):
        r = rng.random()
        if r < 0.55:
            return mutate_json_file(snap.path("adapter.json"), snap.files["adapter.json"], rng)
        if r < 0.95:
            return mutate_adapter_weights(snap, good, meta, rng)
        return replace_path(snap.path(rng.choice(["adapter.json", "adapter.safetensors"])), rng)

    out = run_fuzz("adapter", cases, mutate, lambda n: consume_adapter(a, spec, bank), snap.restore, (str(a),))
    check(out, "adapter", cases)


def test_adapter_shapes_are_checked_before_anything_is_allocated(art, tmp_path):
    """Regression (found writing the adapter fuzz): adapter.json's sizes built the adapter's tensors before
    they were compared with the file's, so `hidden_size: 10**12` tried to allocate 48 TB (a RuntimeError),
    and the sizes of another model than the one it is loaded for (the config hash matching) reached the
    forward pass."""
    a = tmp_path / "adapter"
    spec = inspect_model_dir(art["model"])
    for key, value in (("hidden_size", 10**12), ("num_experts", 2**40), ("hidden_size", 65), ("num_experts", 9)):
        shutil.rmtree(a, ignore_errors=True)
        shutil.copytree(art["adapter"], a)
        m = json.loads((a / "adapter.json").read_text())
        m["model"][key] = value
        (a / "adapter.json").write_text(json.dumps(m))
        with bounded_memory(), pytest.raises(SpecPrefetchError, match=str(a)):
            load_adapter(a, spec)
    m = json.loads((art["adapter"] / "adapter.json").read_text())
    m["rank"] = 10**9
    (a / "adapter.json").write_text(json.dumps(m))
    with bounded_memory(), pytest.raises(SpecPrefetchError, match="tensor shapes"):
        load_adapter(a, None)


# -- bundles ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bundle(embedded_bundles, tmp_path_factory) -> Path:
    b = tmp_path_factory.mktemp("fuzz-bundle") / "b"
    shutil.copytree(embedded_bundles["executorch"], b)
    return b


@pytest.fixture
def cheap_hashes(bundle, monkeypatch):
    """validate_bundle hashes every file on each call: the files a case did not touch keep their hash
    (the graphs and the expert store are 45 MB: rehashing them made every case cost 60 ms)."""
    import export.manifest as manifest
    from toolkit.artifacts import sha256_file

    known = {str(p): sha256_file(p) for p in (bundle / "graphs" / "model.pte", bundle / "experts.spx")}
    dirty: set[str] = set()

    def fast(p):
        return known[str(p)] if str(p) in known and str(p) not in dirty else sha256_file(p)

    monkeypatch.setattr(manifest, "sha256_file", fast)
    return dirty


BUNDLE_JSON = ("manifest.json", "model/config.json", "parity.json", "model/generation_config.json",
               "model/tokenizer_config.json")


@pytest.mark.parametrize("cases", [30, pytest.param(1500, marks=pytest.mark.slow)])
def test_fuzzed_bundles(bundle, cheap_hashes, cases):
    """The manifest edited (most cases); or another file edited and the manifest's size and sha256 of it
    updated, so the checks behind the hashes are reached (the model config, parity report, expert store);
    or a file replaced, removed or added. Every 30th case (make test's 30: its first) or 10th (make
    test-all's) is run through `specprefetch inspect` instead, which loads the graphs (seconds each)."""
    mf = bundle / "manifest.json"
    snap = Snapshot(bundle, list(BUNDLE_JSON))
    manifest = json.loads(snap.files["manifest.json"])
    store = bundle / "experts.spx"
    store_raw = store.read_bytes()
    store_spec = inspect_model_dir(bundle / "model", config_only_ok=True)
    extra: list[Path] = []

    def rehash(rel: str) -> None:
        p = bundle / rel
        m = json.loads(snap.files["manifest.json"])
        m["files"][rel] = {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        snap.path("manifest.json").write_text(json.dumps(m))

    def mutate(rng, n):
        r = rng.random()
        if r < 0.6:
            return mutate_json_file(snap.path("manifest.json"), snap.files["manifest.json"], rng)
        if r < 0.85:
            rel = rng.choice(BUNDLE_JSON[1:])
            what = mutate_json_file(snap.path(rel), snap.files[rel], rng)
            rehash(rel)
            return what + ", rehashed"
        if r < 0.9:  # the expert store
            data, what = mutate_store(store_raw, rng)
            cheap_hashes.add(str(store))
            store.write_bytes(data)
            rehash("experts.spx")
            return f"experts.spx: {what}, rehashed"
        kind = rng.choice(["stray file", "listed file replaced", "manifest replaced"])
        if kind == "stray file":
            p = bundle / rng.choice(["stray.bin", "graphs/extra.pte", "model/x.json"])
            p.write_bytes(b"x")
            extra.append(p)
            return kind
        if kind == "manifest replaced":
            return replace_path(snap.path("manifest.json"), rng)
        return replace_path(snap.path(rng.choice(BUNDLE_JSON[1:])), rng)

    def restore():
        snap.restore()
        for p in extra:
            p.unlink(missing_ok=True)
        extra.clear()
        if str(store) in cheap_hashes:
            store.write_bytes(store_raw)
            cheap_hashes.discard(str(store))

    from export.bundle import inspect_bundle

    def consume(n):
        if n % every == 0:
            cli_clean(*cli("inspect", bundle), what=f"inspect, case {n}")
            return
        validate_bundle(bundle)
        inspect_bundle(bundle, load_graphs=False)

    every = 30 if cases <= 60 else 10  # make test (30 cases): one inspect
    out = run_fuzz("bundle", cases, mutate, consume, restore, (str(bundle),))
    check(out, "bundle", cases)
    assert json.loads(mf.read_text()) == manifest
    ExpertStore(store, store_spec).close()  # put back whole


# -- model directories: config.json and safetensors shards --------------------------------------------------

def consume_model(path: Path, n: int) -> None:
    """What info, store and run read of a model directory: the config and every shard's header, the
    geometry checked against the weights; every 4th case the expert and dense tensors too."""
    spec = inspect_model_dir(path)
    model_info(spec)
    eos_token_ids(spec, type("Tok", (), {"eos_token_id": 0})())
    if n % 4 == 0:
        ckpt_reader = ckpt.ExpertReader(spec)
        for layer in spec.geometry.moe_layers[:2]:
            ckpt_reader.read_expert(layer, 0)
        load_dense_model(spec)


def mutate_safetensors(p: Path, original: bytes, rng: random.Random) -> str:
    """A shard's header edited as JSON (rewritten with its new length: the data stays where the
    offsets say), or its bytes edited."""
    n = int.from_bytes(original[:8], "little")
    if rng.random() < 0.6:
        head = json.loads(original[8:8 + n])
        text, what = mutate_json(head, rng)
        h = text.encode("utf-8", "surrogatepass")
        if rng.random() < 0.8:
            h += b" " * (-len(h) % 8)
        p.write_bytes(len(h).to_bytes(8, "little") + h + original[8 + n:])
        return f"{p.name} header: {what}"
    data, what = mutate_bytes(original, rng, hot=8 + n)
    p.write_bytes(data)
    return f"{p.name}: {what}"


@pytest.mark.parametrize("cases", [60, pytest.param(1500, marks=pytest.mark.slow)])
def test_fuzzed_model_directories(art, tmp_path, cases):
    """config.json, generation_config.json, the safetensors shard and (in a second copy, split in two
    shards) model.safetensors.index.json. Every 10th case also runs `specprefetch info`."""
    one = tmp_path / "model"
    shutil.copytree(art["model"], one)
    two = tmp_path / "sharded"
    shutil.copytree(art["model"], two)
    tensors = load_file(str(two / "model.safetensors"))
    (two / "model.safetensors").unlink()
    keys = sorted(tensors)
    half = {k: ("a.safetensors" if i % 2 else "b.safetensors") for i, k in enumerate(keys)}
    for shard in ("a.safetensors", "b.safetensors"):
        save_file({k: tensors[k] for k in keys if half[k] == shard}, str(two / shard), metadata={"format": "pt"})
    (two / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": half}))
    inspect_model_dir(two)
    bare = tmp_path / "bare"  # config.json alone: `info` on a checkpoint not on disk
    bare.mkdir()
    shutil.copyfile(one / "config.json", bare / "config.json")
    snaps = {one: Snapshot(one, ["config.json", "generation_config.json", "model.safetensors"]),
             two: Snapshot(two, ["config.json", "model.safetensors.index.json", "a.safetensors", "b.safetensors"]),
             bare: Snapshot(bare, ["config.json"])}
    where = {}

    def mutate(rng, n):
        d = two if n % 3 == 0 else bare if n % 3 == 1 and n % 2 else one
        where[n] = d
        snap = snaps[d]
        rel = rng.choice(list(snap.files))
        if rng.random() < 0.05:
            return f"{d.name}/" + replace_path(snap.path(rel), rng)
        if rel.endswith(".safetensors"):
            return f"{d.name}/" + mutate_safetensors(snap.path(rel), snap.files[rel], rng)
        return f"{d.name}/" + mutate_json_file(snap.path(rel), snap.files[rel], rng)

    def consume(n):
        if where[n] == bare:  # what info does (its parameter count builds the model on the meta device)
            build_on_meta(inspect_model_dir(bare, config_only_ok=True))  # see test_info_of_an_unbuildable_config
        if n % 10 == 0:
            cli_clean(*cli("info", where[n]), what=f"info, case {n}")
        elif where[n] == bare:
            model_info(inspect_model_dir(bare, config_only_ok=True))
        else:
            consume_model(where[n], n)

    def restore():
        for s in snaps.values():
            s.restore()

    out = run_fuzz("model", cases, mutate, consume, restore, (str(one), str(two), str(bare)))
    check(out, "model", cases)


def test_info_of_an_unbuildable_config_is_one_line(art, tmp_path):
    """Found by the fuzz: `info` on a config.json alone whose hidden_act is not an activation (or whose
    head_dim overflows, ...) is a KeyError traceback from transformers. The weights' path
    (load_dense_model, via build_on_meta) is a one-line error."""
    d = tmp_path / "bare"
    d.mkdir()
    cfg = json.loads((art["model"] / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, hidden_act="no-such-activation")))
    with pytest.raises(SpecPrefetchError, match="transformers cannot build"):
        build_on_meta(inspect_model_dir(d, config_only_ok=True))
    cli_clean(*cli("info", d), what="info of a config transformers cannot build")


# -- traces: the manifest's bytes and values, its model, and the resume file -----------------------------

def consume_trace(path: Path, n: int) -> None:
    consume_trace_files(path)  # every shard, batch and validation batch, as train / eval / simulate
    if n % 3 == 0:
        trace_model_spec(TraceReader(path), None)


@pytest.mark.parametrize("cases", [60, pytest.param(1500, marks=pytest.mark.slow)])
def test_fuzzed_trace_manifests(art, tmp_path, cases):
    """Raw byte edits of manifest.json and value kinds tests/test_trace.py does not try
    (5000-digit integers, deep nesting, unencodable strings, tweaks of each value), the model path
    pointed elsewhere; shards with stale checksums. Every 10th case runs `specprefetch simulate`."""
    t = tmp_path / "trace"
    shutil.copytree(art["trace"], t)
    m = json.loads((t / "manifest.json").read_text())
    shard = m["shards"][0]["file"]
    snap = Snapshot(t, ["manifest.json", shard])
    elsewhere = {"a file": str(t / "manifest.json"), "a directory that is not a model": str(tmp_path),
                 "another model": str(art["bias_model"]), "a bundle of nothing": "/"}

    def mutate(rng, n):
        r = rng.random()
        if r < 0.8:
            return mutate_json_file(snap.path("manifest.json"), snap.files["manifest.json"], rng)
        if r < 0.9:
            name, p = rng.choice(sorted(elsewhere.items()))
            snap.path("manifest.json").write_text(json.dumps(dict(m, model=dict(m["model"], path=p))))
            return f"model.path: {name}"
        if r < 0.97:
            data, what = mutate_bytes(snap.files[shard], rng)
            snap.path(shard).write_bytes(data)
            return f"shard, checksum stale: {what}"
        return replace_path(snap.path(rng.choice(["manifest.json", shard])), rng)

    def consume(n):
        if n % 10 == 0:
            cli_clean(*cli("simulate", t, "--policies", "on-demand+lru", "--pool-mib", "1", "--json",
                           tmp_path / "s.json"), what=f"simulate, case {n}")
        else:
            consume_trace(t, n)

    out = run_fuzz("trace", cases, mutate, consume, snap.restore, (str(t), "model"))
    check(out, "trace", cases)


@pytest.mark.parametrize("cases", [60, pytest.param(800, marks=pytest.mark.slow)])
def test_fuzzed_trace_resume_files(art, tmp_path, cases):
    """TRACE.partial/progress.json (what a resumed `trace` reads) edited: the writer resumes from it
    or refuses it with one line; it never resumes from a position outside the run."""
    out_dir = tmp_path / "t"
    work = tmp_path / "t.partial"
    shutil.copytree(art["trace"], work)
    (work / ".specprefetch-work").mkdir()  # an interrupted run's OUT.partial, as the toolkit marks it
    m = json.loads((work / "manifest.json").read_text())
    (work / "manifest.json").unlink()
    header = {k: m[k] for k in ("model", "data", "settings")}
    state = {"header": header, "shards": m["shards"][:2], "next_seq": 2,
             "seq_split": {str(s): sp for sp in ("train", "heldout") for s in m["split"][sp] if s < 2}}
    (work / "progress.json").write_text(json.dumps(state))
    snap = Snapshot(work, ["progress.json"])

    def mutate(rng, n):
        if rng.random() < 0.3:  # anywhere (an edit of the header is a run with other settings: refused)
            return mutate_json_file(snap.path("progress.json"), snap.files["progress.json"], rng)
        text, what = mutate_json({k: v for k, v in state.items() if k != "header"}, rng)
        text = text.encode("utf-8", "surrogatepass")
        body = json.dumps({"header": header}).encode()[:-1]  # the header kept, the edited rest after it
        rest = text[1:] if text.startswith(b"{") and text != b"{}" else None
        snap.path("progress.json").write_bytes(body + b", " + rest if rest else text)
        return f"progress.json: {what}"

    def consume(n):
        with TraceWriter(out_dir, header) as w:
            total = header["settings"]["sequences"]
            assert 0 <= w.next_seq <= total, f"resumes at sequence {w.next_seq} of {total}"
            assert all(0 <= s < w.next_seq for s in w.seq_split), f"sequences {sorted(w.seq_split)} traced, " \
                                                                  f"resumes at {w.next_seq}"

    def restore():
        snap.restore()
        assert all((work / s["file"]).is_file() for s in state["shards"])  # a resume never deletes them

    result = run_fuzz("progress", cases, mutate, consume, restore, (str(work),))
    check(result, "progress", cases)


def test_random_files_where_every_artifact_is_expected(art, tmp_path):
    """Random bytes of random length (and random JSON) as each artifact's main file."""
    spec = inspect_model_dir(art["model"])
    for n in case_numbers(40):
        rng = case_rng("random-files", n)
        blob = rng.randbytes(rng.choice([0, 1, 8, 64, 4096, rng.randrange(1 << 16)]))
        if n % 2:
            blob = json.dumps(rng.choice(JUNK)).encode()
        d = tmp_path / f"c{n}"
        d.mkdir()
        (d / "adapter.json").write_bytes(blob)
        (d / "manifest.json").write_bytes(blob)
        (d / "config.json").write_bytes(blob)
        (d / "store.spx").write_bytes(blob)
        (d / "model.safetensors").write_bytes(blob)
        for fn in (lambda: read_adapter_meta(d), lambda: TraceReader(d), lambda: ExpertStore(d / "store.spx", spec),
                   lambda: inspect_model_dir(d)):
            try:
                fn()
            except SpecPrefetchError as e:
                assert "\n" not in str(e) and str(d) in str(e), f"random-files case {n} (seed {SEED}): {e}"
            except Exception as e:  # noqa: BLE001
                pytest.fail(f"random-files case {n} (seed {SEED}): {type(e).__name__}: {e}")
        with pytest.raises(SpecPrefetchError, match=str(d)):
            validate_bundle(d)


# -- regressions: each a case the fuzz found, kept as it was found ----------------------------------------

HUGE_INT = "1" * 5000                      # past Python's 4300-digit limit: json.loads raises ValueError
DEEP = "[" * 100000 + "]" * 100000         # past the recursion limit: json.loads raises RecursionError


@pytest.mark.parametrize("raw", [HUGE_INT, DEEP], ids=["5000-digit integer", "deep nesting"])
def test_json_past_the_parsers_limits_is_one_line(art, tmp_path, bundle, raw):
    """Every JSON reader let json.loads' ValueError (a 5000-digit number) or RecursionError (nesting)
    through as a traceback: adapter case 68, model case 24, progress case 62, bundle case 51, model
    case 90 (`info`, exit 1 with no message)."""
    spec = inspect_model_dir(art["model"])

    def planted(original: bytes, key: str) -> bytes:  # the value of `key` replaced by the raw text
        m = json.loads(original)
        m[key] = SENTINEL
        return json.dumps(m).replace(json.dumps(SENTINEL), raw).encode()

    a = tmp_path / "adapter"
    shutil.copytree(art["adapter"], a)
    (a / "adapter.json").write_bytes(planted((a / "adapter.json").read_bytes(), "rank"))
    with pytest.raises(SpecPrefetchError, match="adapter.json"):
        load_adapter(a, spec)
    t = tmp_path / "trace"
    shutil.copytree(art["trace"], t)
    good = (t / "manifest.json").read_bytes()
    (t / "manifest.json").write_bytes(planted(good, "split"))
    with pytest.raises(SpecPrefetchError, match="manifest.json"):
        TraceReader(t)
    work = tmp_path / "t.partial"
    (work / ".specprefetch-work").mkdir(parents=True)
    (work / "progress.json").write_bytes(planted(json.dumps({"header": {}}).encode(), "next_seq"))
    with pytest.raises(SpecPrefetchError, match="progress.json"):
        TraceWriter(tmp_path / "t", {})
    m = tmp_path / "model"
    shutil.copytree(art["model"], m)
    (m / "config.json").write_bytes(planted((art["model"] / "config.json").read_bytes(), "rope_theta"))
    with pytest.raises(SpecPrefetchError, match="config.json"):
        inspect_model_dir(m)
    cli_clean(*cli("info", m), what="info")
    shutil.copyfile(art["model"] / "config.json", m / "config.json")
    (m / "model.safetensors.index.json").write_text('{"weight_map": ' + raw + "}")
    with pytest.raises(SpecPrefetchError, match="index.json"):
        inspect_model_dir(m)
    (m / "model.safetensors.index.json").unlink()
    n = int.from_bytes((m / "model.safetensors").read_bytes()[:8], "little")
    data = (m / "model.safetensors").read_bytes()
    head = planted(data[8:8 + n], "__metadata__")
    (m / "model.safetensors").write_bytes(len(head).to_bytes(8, "little") + head + data[8 + n:])
    with pytest.raises(SpecPrefetchError, match="model.safetensors"):
        inspect_model_dir(m)
    b = tmp_path / "bundle"
    shutil.copytree(bundle, b)
    (b / "manifest.json").write_bytes(planted((b / "manifest.json").read_bytes(), "kv"))
    cli_clean(*cli("inspect", b), what="inspect")
    with pytest.raises(SpecPrefetchError, match="manifest.json"):
        validate_bundle(b)


@pytest.mark.parametrize("name", ["adapter/adapter.json", "adapter/adapter.safetensors", "model/config.json",
                                  "model/model.safetensors", "model/model.safetensors.index.json"])
def test_a_fifo_where_a_file_is_read_is_refused_not_waited_on(art, tmp_path, name):
    """adapter case 61 and model case 29 hung for ever: a FIFO (named pipe) at adapter.json or at a
    shard's name was opened for reading, which waits for a writer."""
    shutil.copytree(art["adapter"], tmp_path / "adapter")
    shutil.copytree(art["model"], tmp_path / "model")
    p = tmp_path / name
    p.unlink(missing_ok=True)
    os.mkfifo(p)
    with deadline(20), pytest.raises(SpecPrefetchError, match=str(p)):
        if name.startswith("adapter"):
            load_adapter(tmp_path / "adapter", inspect_model_dir(art["model"]))
        else:
            inspect_model_dir(tmp_path / "model")


def test_a_safetensors_file_the_library_refuses_is_refused_on_open(art, tmp_path):
    """model cases 444, 468, 512, 932: a shard with bytes after its last tensor, a tensor of a dtype
    safetensors does not know, or a gap left by a deleted tensor passed read_header, and safetensors'
    own SafetensorError came later, from `store` or `run`, as a traceback. Now the header check refuses
    what the library refuses, and the library's errors are named too."""
    m = tmp_path / "model"
    shutil.copytree(art["model"], m)
    shard = m / "model.safetensors"
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    head = json.loads(data[8:8 + n])

    def write(h: dict, tail: bytes = b"") -> None:
        raw = json.dumps(h).encode()
        shard.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:] + tail)
        ckpt._read_header.cache_clear()

    write(head, b"\0")
    with pytest.raises(SpecPrefetchError, match="1 bytes after the last tensor"):
        inspect_model_dir(m)
    name = next(k for k in head if k != "__metadata__")
    write(dict(head, **{name: dict(head[name], dtype="F1")}))
    with pytest.raises(SpecPrefetchError, match="unknown dtype 'F1'"):
        inspect_model_dir(m)
    first = min((k for k in head if k != "__metadata__"), key=lambda k: head[k]["data_offsets"][0])
    write({k: v for k, v in head.items() if k != first})
    with pytest.raises(SpecPrefetchError, match="leaving a gap"):
        inspect_model_dir(m)
    write(dict(head, __metadata__=[1]))
    with pytest.raises(SpecPrefetchError, match="__metadata__"):
        inspect_model_dir(m)
    write(head)
    spec = inspect_model_dir(m)
    load_dense_model(spec)  # the real file is fine


@pytest.mark.parametrize("edit, what", [
    ({"num_hidden_layers": 2**40}, "num_hidden_layers is 1099511627776; it must be a whole number"),
    ({"moe_intermediate_size": 2**30}, "moe_intermediate_size is 1073741824; it must be a whole number (at most"),
    ({"model_type": ["qwen3_moe"]}, "model_type must be a string"),
])
def test_config_values_the_geometry_cannot_use_are_refused(art, tmp_path, edit, what):
    """bundle case 723 hung (the geometry counted 2**40 layers, in `inspect` and in every command that
    opens the model); model case 951 was a TypeError (an unhashable model_type)."""
    m = tmp_path / "model"
    shutil.copytree(art["model"], m)
    cfg = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps({**cfg, **edit}))
    with deadline(20), pytest.raises(SpecPrefetchError, match=re.escape(what)):
        inspect_model_dir(m)


@pytest.mark.parametrize("edit, what", [
    ({"num_attention_heads": 0}, "transformers cannot build the model"),       # model case 352
    ({"hidden_act": "x" * 50}, "transformers cannot build the model"),         # model case 1176
    ({"head_dim": 80}, "the checkpoint's tensors do not fit the model"),       # model case 1404
])
def test_load_dense_model_names_a_config_that_does_not_fit(art, tmp_path, edit, what):
    m = tmp_path / "model"
    shutil.copytree(art["model"], m)
    cfg = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(SpecPrefetchError, match=what):
        load_dense_model(inspect_model_dir(m))


@pytest.mark.parametrize("eos", ["a/../../b", [2, "x"], {"a": 1}, True, -1])
def test_a_bad_eos_token_id_is_named(art, tmp_path, eos):
    """model case 41: generation_config.json's eos_token_id 'a/../../b' was int()-ed: a ValueError."""
    m = tmp_path / "model"
    shutil.copytree(art["model"], m)
    (m / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    with pytest.raises(SpecPrefetchError, match="generation_config.json: eos_token_id must be a token id"):
        eos_token_ids(inspect_model_dir(m), None)


def test_store_metadata_of_floats_or_another_models_geometry_is_refused(art, tmp_path):
    """store case 266: a faulty writer's metadata with whole floats (shape 64.0, nbytes 6144.0) passed
    the layout check (6144.0 == 6144) and every read failed (TypeError: slice indices); store case
    1222: an infinite size was an OverflowError. And a store whose matrices are not the model's, its
    layout consistent and its config hash right, opened for that model."""
    spec = inspect_model_dir(art["bias_model"])
    parts = StoreParts.parse(art["bias"].read_bytes())
    meta = json.loads(parts.meta)
    p = tmp_path / "s.spx"
    for value, what in ((64.0, "64.0 is not an integer"), (float("inf"), "inf is not an integer")):
        m = copy.deepcopy(meta)
        m["matrices"][0]["shape"][1] = value
        parts.meta = json.dumps(m).encode()
        parts.layout()
        p.write_bytes(parts.assemble())
        with pytest.raises(SpecPrefetchError, match=what):
            consume_store(p, spec)
    from toolkit.models.expert_layout import blob_sections

    m = copy.deepcopy(meta)
    for x in m["matrices"]:  # every expert narrower, the layout recomputed: a consistent store of another model
        x["shape"] = [d // 2 if d == 48 else d for d in x["shape"]]
    sections, size = blob_sections([(x["role"], tuple(x["shape"])) for x in m["matrices"]], m["dtype"])
    m["sections"], m["blob_size"] = [dataclasses.asdict(s) for s in sections], size
    parts.meta = json.dumps(m).encode()
    parts.blobs = [b[:size] for b in parts.blobs]
    for e, b in zip(parts.entries, parts.blobs):
        e[3], e[4] = size, zlib.crc32(b)
    parts.layout()
    p.write_bytes(parts.assemble())
    ExpertStore(p).close()  # a sound store in itself
    with pytest.raises(SpecPrefetchError, match="the store's geometry .* is not model"):
        ExpertStore(p, spec)


def test_a_resume_file_pointing_outside_the_run_is_refused(art, tmp_path):
    """progress case (slow tier): next_seq -2 resumed the trace at prompts[-2:], tracing the last two
    sequences again after the recorded shards."""
    work = tmp_path / "t.partial"
    (work / ".specprefetch-work").mkdir(parents=True)  # an interrupted run's OUT.partial, as the toolkit marks it
    header = {"settings": {"sequences": 8}}
    for state in ({"next_seq": -2, "seq_split": {}}, {"next_seq": 9, "seq_split": {}},
                  {"next_seq": 2, "seq_split": {"5": "train"}}):
        (work / "progress.json").write_text(json.dumps({"header": header, "shards": [], **state}))
        with pytest.raises(SpecPrefetchError, match="malformed trace progress file"):
            TraceWriter(tmp_path / "t", header)
    (work / "progress.json").write_text(json.dumps({"header": header, "shards": [], "next_seq": 2,
                                                    "seq_split": {"0": "train", "1": "heldout"}}))
    with TraceWriter(tmp_path / "t", header) as w:
        assert w.next_seq == 2


def test_trace_sequence_numbers_past_int64_are_refused(art, tmp_path):
    """trace case 462 (slow tier): a 30-digit sequence number in the manifest's split was an
    OverflowError where the shards' sequences are checked against it."""
    t = tmp_path / "trace"
    shutil.copytree(art["trace"], t)
    m = json.loads((t / "manifest.json").read_text())
    m["split"]["train"][1] = 10**30
    (t / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SpecPrefetchError, match="'split' must be"):
        TraceReader(t)


def test_bundle_files_in_a_symlink_loop_are_named(bundle, tmp_path):
    """bundle cases 374, 631: a listed file that is a symbolic link to itself was a RuntimeError
    ("Symlink loop") from Path.resolve."""
    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    (b / "parity.json").unlink()
    (b / "parity.json").symlink_to("parity.json")
    with pytest.raises(SpecPrefetchError, match="parity.json: cannot resolve it"):
        validate_bundle(b)
    cli_clean(*cli("inspect", b), what="inspect")


@pytest.mark.parametrize("key, value", [("quantization", {}), ("quantization", {"dense": 1}), ("parity", [0]),
                                        ("parity", "x")])
def test_inspect_of_a_manifest_with_odd_summary_fields_is_one_line(bundle, tmp_path, key, value):
    """Found beside the fuzz (its inspect cases): `inspect` printed the summary with
    m["quantization"]["dense"] and parity.get(...) after validation, so a manifest with
    `quantization: {}` or `parity: [0]` was a KeyError / AttributeError traceback."""
    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    m = json.loads((b / "manifest.json").read_text())
    m[key] = value
    (b / "manifest.json").write_text(json.dumps(m))
    code, out, exc = cli("inspect", b)
    cli_clean(code, out, exc, what="inspect")
    assert code == 2 and key in out, out


# -- report outputs pointed at inputs and other artifacts -------------------------------------------------

def _tree_state(*roots: Path) -> dict[str, tuple]:
    """Every file under the roots: (sha256, mtime_ns, file type), so that a rename, a rewrite or a
    touch shows."""
    import stat as st_

    out = {}
    for root in roots:
        for p in sorted([root, *root.rglob("*")] if root.is_dir() else [root]):
            s = os.lstat(p)
            reg = st_.S_ISREG(s.st_mode)
            out[str(p)] = (hashlib.sha256(p.read_bytes()).hexdigest() if reg else None,
                           s.st_mtime_ns if reg else None, st_.S_IFMT(s.st_mode))
    return out


@pytest.mark.parametrize("cases", [40, pytest.param(400, marks=pytest.mark.slow)])
def test_report_outputs_pointed_at_inputs_and_artifacts_change_nothing(art, bundle, tmp_path, cases):
    """Each case points one report output of one command (--json, --events, calibrate --out; with or
    without --overwrite) at a file of an input or of another artifact (the model's weights and
    config, the trace's manifest and shards, the adapter, a store, the bundle's files) or at a new
    file inside one of them: refused in one line before any work, every byte and mtime as it was."""
    d = tmp_path / "artifacts"
    model = Path(shutil.copytree(art["model"], d / "model"))  # private: the session's model stays safe
    trace = Path(shutil.copytree(art["trace"], d / "trace"))
    adapter = Path(shutil.copytree(art["adapter"], d / "adapter"))
    store = Path(shutil.copy(art["int4"], d / "int4.spx"))
    roots = (model, trace, adapter, store, bundle)
    files = [p for r in roots for p in ([r, *r.rglob("*")] if r.is_dir() else [r]) if p.is_file()]
    dirs = [r for r in roots if r.is_dir()] + [bundle / "model", trace / "shards"]
    targets = files + [x / "new-report.json" for x in dirs]
    run = ["--policy", "on-demand+lru", "--prompt", "x", "--max-new-tokens", "2"]
    commands = {
        "run": lambda t: ["run", model, "--store", store, *run, "--json", t],
        "run a bundle": lambda t: ["run", bundle, *run, "--json", t],
        "run --events": lambda t: ["run", model, "--store", store, *run, "--json", tmp_path / "ok.json",
                                   "--events", t],
        "eval": lambda t: ["eval", trace, "--adapter", adapter, "--json", t],
        "simulate": lambda t: ["simulate", trace, "--adapter", adapter, "--json", t],
        "eviction-bounds": lambda t: ["eviction-bounds", trace, "--max-sequences", "1", "--json", t],
        "bench cpu": lambda t: ["bench", "cpu", model, "--store", store, "--json", t],
        "bench gpu": lambda t: ["bench", "gpu", model, "--store", store, "--json", t],
        "bench llama.cpp": lambda t: ["bench", "llama.cpp", bundle, "--json", t],
        "runner bench": lambda t: ["runner", "bench", bundle, "--json", t],
        "device bench": lambda t: ["device", "bench", bundle, "--pool-mib", "1", "--prompt", "x", "--json", t],
        "device list": lambda t: ["device", "list", "--json", t],
        "calibrate": lambda t: ["calibrate", model, "--store", store, "--out", t],
    }
    before = _tree_state(*roots)
    failures = []
    for n in case_numbers(cases):
        rng = case_rng("report-outputs", n)
        name = rng.choice(sorted(commands))
        target = rng.choice(targets)
        args = commands[name](target) + (["--overwrite"] if rng.random() < 0.5 else [])
        what = f"{name} -> {target.relative_to(tmp_path) if target.is_relative_to(tmp_path) else target}"
        was = _tree_state(target) if target.exists() else None
        code, output, exc = cli(*args)
        try:
            cli_clean(code, output, exc, what)
        except AssertionError as e:
            failures.append(f"case {n} ({what}): {e}")
            continue
        now = _tree_state(target) if target.exists() or target.is_symlink() else None
        if code != 2 or now != was:
            failures.append(f"case {n} ({what}): exit {code}, {'changed' if now != was else 'unchanged'}: "
                            f"{output.strip().splitlines()[-1:] if output.strip() else ''}")
        elif VERBOSE:
            print(f"report-outputs {n}: {what}\n    -> {output.strip()[:200]}")
    assert not (tmp_path / "ok.json").exists()
    assert _tree_state(*roots) == before, "an artifact changed"
    assert not failures, f"{len(failures)} of {cases} cases (seed {SEED}):\n" + "\n".join(failures[:8])
