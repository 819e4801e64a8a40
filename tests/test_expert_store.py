"""The expert store (toolkit/runtime/expert_store.py, its cache and fingerprints): it reads back the
checkpoint's experts (exactly in fp16, within the quantization's error in int8 and int4, for every
family); a damaged one (a blob, the index, a truncated file, the magic, the version, another model's
config) is refused by both readers; a store is tied to the weights it was built from (a fine-tune
with the same config is refused, and gets its own cached store); every header field is covered by a
checksum; `--store` must name an existing store and `--dtype` is never silently ignored beside it; an
open store keeps reading its own file when the path is replaced; `build_store` refuses to overwrite
what is not a store (or is an input) and names a truncated or non-finite source; and the native
runner's open reads the same format. Real files throughout: a tiny checkpoint, its fine-tune re-saved
with one expert changed, stores built from both (and from every tiny family and the embedded model).
No test here needs the shared bundle (tests/test_bundle_checks.py has the bundle's store checks)."""
from __future__ import annotations

import os
import random
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from export.session import open_session, reference_tokens
from cli_helpers import cli_plain as cli, one_error
from toolkit.errors import SpecPrefetchError
from toolkit.models.checkpoint import ExpertReader
from toolkit.models.loader import inspect_model_dir
from toolkit.models.tiny import TINY_FAMILIES
from toolkit.runtime.expert_store import ALIGN, HEADER, VERSION, ExpertStore, build_store, seal_header
from toolkit.runtime.fingerprint import file_sha256, weights_fingerprint
from toolkit.runtime.policy import Policy
from toolkit.runtime.runner import RunConfig

REPO = Path(__file__).resolve().parent.parent
EXPERT_KEY = "model.layers.1.mlp.experts.3.gate_proj.weight"


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """The store cache and the hash cache of this module live in a temporary directory."""
    root = tmp_path_factory.getbasetemp() / "store-cache"
    monkeypatch.setenv("SPECPREFETCH_PROFILES", str(root / "profiles"))
    return root


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """A tiny qwen3_moe checkpoint ("base", the session's) and its fine-tune ("ft"): the same files,
    config, shard size and safetensors header, one expert matrix changed."""
    root = tmp_path_factory.mktemp("hs-models")
    base = tiny_models["qwen3_moe"]
    ft = root / "ft"
    shutil.copytree(base, ft)
    shard = ft / "model.safetensors"
    tensors = load_file(str(shard))
    tensors[EXPERT_KEY] = tensors[EXPERT_KEY] + 0.5 * torch.randn_like(tensors[EXPERT_KEY])
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert shard.stat().st_size == (base / "model.safetensors").stat().st_size
    with open(shard, "rb") as a, open(base / "model.safetensors", "rb") as b:  # identical headers
        n = struct.unpack("<Q", a.read(8))[0]
        assert a.read(n) == b.read(8 + n)[8:]
    return {"base": base, "ft": ft}


@pytest.fixture(scope="module")
def base_store(models, tmp_path_factory) -> Path:
    return build_store(inspect_model_dir(models["base"]), tmp_path_factory.mktemp("hs-s") / "base.spx", "fp16",
                       progress=False)


@pytest.fixture(scope="module")
def tiny(models, base_store) -> dict:
    """The tiny qwen3_moe checkpoint and its fp16 store (as tests/test_bundle_checks.py's `tiny`)."""
    return {"model": models["base"], "store": base_store}


@pytest.fixture(scope="module")
def emb_store(embedded, tmp_path_factory) -> Path:
    """The embedded model's fp16 store."""
    return build_store(inspect_model_dir(embedded), tmp_path_factory.mktemp("s") / "e.spx", "fp16", progress=False)


class TestReadBack:
    """A store reads back the checkpoint's experts: exactly in fp16, within the quantization's error in int8
    and int4, for every family."""

    @pytest.mark.parametrize("dtype,tol", [("fp16", 0.0), ("int8", 0.01), ("int4", 0.15)])
    def test_store_round_trip(self, tiny_models, tmp_path, dtype, tol):
        spec = inspect_model_dir(tiny_models["qwen3_moe"])
        st = ExpertStore(build_store(spec, tmp_path / "s.spx", dtype, progress=False), spec)
        ref = ExpertReader(spec)
        assert st.dtype == dtype and len(st.entries) == 3 * 8
        for (li, e), entry in st.entries.items():
            assert entry.offset % ALIGN == 0
            w = st.weights(li, e)
            r = ref.read_expert(spec.geometry.moe_layers[li], e)
            for role in ("gate", "up", "down"):
                err = (w[role] - r[role].float()).abs().max() / r[role].float().abs().max()
                assert err <= tol + 1e-7, (dtype, role, float(err))

    @pytest.mark.parametrize("fam", TINY_FAMILIES)
    def test_store_every_family(self, tiny_models, tmp_path, fam):
        spec = inspect_model_dir(tiny_models[fam])
        st = ExpertStore(build_store(spec, tmp_path / "s.spx", "fp16", progress=False), spec)
        ref = ExpertReader(spec)
        li = len(spec.geometry.moe_layers) - 1
        w = st.weights(li, 5)
        for role, t in ref.read_expert(spec.geometry.moe_layers[li], 5).items():
            assert torch.equal(w[role], t.float()), role

    def test_int8_keeps_tiny_rows(self):
        from toolkit.runtime.expert_store import blob_sections, dequantize, quantize

        w = torch.randn(4, 64) * torch.tensor([1.0, 1e-3, 5e-6, 0.0])[:, None]
        secs, size = blob_sections([("gate", (4, 64))], "int8")
        blob = bytearray(size)
        for s, a in zip(secs, quantize(w, "int8")):
            blob[s.offset:s.offset + s.nbytes] = a.tobytes()
        got = dequantize(bytes(blob), secs)["gate"]
        for row in range(3):
            assert (got[row] - w[row]).abs().max() <= w[row].abs().max() / 127 + 6.2e-5
        assert torch.equal(got[3], torch.zeros(64))


class TestTiedToTheWeights:
    """A store is tied to the weights it was built from, checked cheaply on every open."""

    def test_finetune_with_the_same_config_is_refused(self, models, base_store):
        base, ft = inspect_model_dir(models["base"]), inspect_model_dir(models["ft"])
        assert base.config_hash == ft.config_hash
        ExpertStore(base_store, base)  # its own model: fine
        with pytest.raises(SpecPrefetchError) as e:
            ExpertStore(base_store, ft)
        msg = str(e.value)
        assert "\n" not in msg and str(base_store) in msg and str(ft.path) in msg
        assert "built from other weights" in msg and "model.safetensors has other contents" in msg

    def test_run_with_another_models_store_is_an_error(self, models, base_store, tmp_path):
        code, out = cli("run", models["ft"], "--store", base_store, "--policy", "on-demand+lru", "--prompt", "hello",
                        "--max-new-tokens", "2", "--max-seq", "16", "--json", tmp_path / "r.json")
        assert code == 2 and out.startswith("error: ") and out.count("\n") == 1, out
        assert "built from other weights" in out and "Traceback" not in out
        assert not (tmp_path / "r.json").exists()

    def test_bundle_check_model_must_be_the_stores_source(self, models):
        """`run --check` on a bundle compares with its source model only if that model's weights are
        the ones the bundle's store was built from (a fine-tune in its place is not used)."""
        from export.session import Session

        rec = weights_fingerprint(inspect_model_dir(models["base"]))
        same = Session(None, None, None, "bundle", "b", models["base"], source_weights=rec)
        other = Session(None, None, None, "bundle", "b", models["ft"], source_weights=rec)
        assert same.source_model == models["base"] and other.source_model is None

    def test_weights_changed_in_place_with_mtime_restored_are_detected(self, models, tmp_path):
        """The hash cache is keyed by ctime too: rewriting a shard in place and putting its size and
        mtime back (as `cp -p` or `touch -r` would) is still noticed."""
        m = tmp_path / "m"
        shutil.copytree(models["base"], m)
        spec = inspect_model_dir(m)
        store = build_store(spec, tmp_path / "s.spx", "int8", progress=False)
        ExpertStore(store, spec)
        shard = m / "model.safetensors"
        st = shard.stat()
        data = bytearray(shard.read_bytes())
        data[-3] ^= 0x40
        with open(shard, "r+b") as f:
            f.write(data)
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert (shard.stat().st_size, shard.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
        with pytest.raises(SpecPrefetchError, match="built from other weights"):
            ExpertStore(store, spec)

    def test_hash_cache_makes_repeated_opens_cheap(self, models, base_store, monkeypatch):
        """Once hashed, an unchanged shard is not read again: opening the store costs a stat."""
        import toolkit.runtime.fingerprint as fp

        spec = inspect_model_dir(models["base"])
        file_sha256(spec.weight_files[0])
        file_hashes = []
        real = fp.hashlib.sha256
        monkeypatch.setattr(fp.hashlib, "sha256", lambda *a: (file_hashes.append(1) if not a else None) or real(*a))
        ExpertStore(base_store, spec)
        assert file_hashes == []


class TestStoreCache:
    """The default store cache: keyed by the weights, and one build of a store at a time."""

    def test_default_cache_is_keyed_by_the_weights(self, models):
        from export.session import cached_store, default_store_path

        base, ft = inspect_model_dir(models["base"]), inspect_model_dir(models["ft"])
        pb, pf = default_store_path(base, "int4"), default_store_path(ft, "int4")
        assert pb != pf and pb.parent == pf.parent
        sb = cached_store(base, "int4", progress=False)
        sf = cached_store(ft, "int4", progress=False)  # not the base model's cached store
        assert sb.path == pb and sf.path == pf and pf.is_file()
        assert sf.meta["source"]["digest"] == weights_fingerprint(ft)["digest"] != sb.meta["source"]["digest"]
        li = inspect_model_dir(models["ft"]).geometry.moe_layers.index(1)
        assert not torch.equal(sb.weights(li, 3)["gate"], sf.weights(li, 3)["gate"])
        assert torch.equal(sb.weights(li, 4)["gate"], sf.weights(li, 4)["gate"])
        assert cached_store(ft, "int4", progress=False).path == pf  # reused, not rebuilt
        assert sorted(p.name for p in pf.parent.iterdir()) == sorted([pb.name, pf.name])  # no leftovers

    def test_cache_build_in_another_process_is_waited_for(self, models, tmp_path):
        """A second `run` while another process builds the same cached store waits for it, instead of
        failing with "another process is writing" or building it twice."""
        import sys
        import time

        from export.session import cached_store, default_store_path
        from toolkit.artifacts import lock_path

        spec = inspect_model_dir(models["base"])
        path = default_store_path(spec, "int8")
        path.parent.mkdir(parents=True, exist_ok=True)
        holder = subprocess.Popen(
            [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
             "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(1.0)", str(lock_path(path))],
            stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "locked"
            t0 = time.perf_counter()
            st = cached_store(spec, "int8", progress=False)
            assert time.perf_counter() - t0 > 0.3 and st.path == path and st.dtype == "int8"
        finally:
            holder.kill()
            holder.wait()


class TestStoreOption:
    """`--store` names an existing store, and a `--dtype` beside it must be its dtype."""

    def test_dtype_beside_store_is_checked_not_ignored(self, models, base_store):
        from export.session import open_session
        from toolkit.runtime.policy import Policy
        from toolkit.runtime.runner import RunConfig

        cfg = RunConfig(policy=Policy("on-demand", "lru"), pool_mib=1.0)
        with pytest.raises(SpecPrefetchError,
                           match=r"--dtype int4: --store .*base.spx holds fp16 experts; drop --dtype"):
            open_session(models["base"], cfg, store=base_store, dtype="int4", max_seq=16, progress=False)
        s = open_session(models["base"], cfg, store=base_store, dtype="fp16", max_seq=16, progress=False)
        assert s.runner.store.dtype == "fp16"

    def test_missing_store_is_an_error_and_nothing_is_built(self, models, tmp_path):
        missing = tmp_path / "missing.spx"
        code, out = cli("run", models["base"], "--store", missing, "--policy", "on-demand+lru", "--prompt", "hi",
                        "--max-new-tokens", "2", "--json", tmp_path / "r.json")
        assert code == 2 and "--store" in out and "no such expert store" in out and "Traceback" not in out
        code, out = cli("calibrate", models["base"], "--store", missing, "--out", tmp_path / "p.json")
        assert code == 2 and "no such expert store" in out
        assert sorted(os.listdir(tmp_path)) == []


class TestHeaderChecks:
    """Every header field is under a checksum and agrees with the metadata."""

    def test_every_header_byte_is_covered(self, base_store, tmp_path):
        raw = base_store.read_bytes()
        bad = tmp_path / "b.spx"
        for i in range(HEADER.size):
            for bit in (0, 7):
                b = bytearray(raw)
                b[i] ^= 1 << bit
                bad.write_bytes(b)
                with pytest.raises(SpecPrefetchError) as e:
                    ExpertStore(bad)
                assert str(bad) in str(e.value) and "\n" not in str(e.value)
        b = bytearray(raw)
        b[12] = 2  # fp16 -> int4: the case
        bad.write_bytes(b)
        with pytest.raises(SpecPrefetchError, match="header is corrupt"):
            ExpertStore(bad)

    def test_a_consistent_but_wrong_dtype_header_is_refused(self, base_store, tmp_path):
        """A faulty writer (the header CRC agrees): the metadata still disagrees with the header."""
        b = bytearray(base_store.read_bytes())
        struct.pack_into("<I", b, 12, 2)  # int4, group size (offset 32) stays 0
        seal_header(b)
        (tmp_path / "w.spx").write_bytes(b)
        with pytest.raises(SpecPrefetchError, match="group size 0 / flags 0 do not fit dtype int4"):
            ExpertStore(tmp_path / "w.spx")
        struct.pack_into("<I", b, 12, 1)  # int8
        seal_header(b)
        (tmp_path / "w.spx").write_bytes(b)
        with pytest.raises(SpecPrefetchError, match="metadata dtype 'fp16' .* differ from the header's int8"):
            ExpertStore(tmp_path / "w.spx")

    def test_old_format_is_refused_with_a_rebuild_hint(self, base_store, tmp_path):
        b = bytearray(base_store.read_bytes())
        struct.pack_into("<I", b, 8, 1)
        seal_header(b)
        (tmp_path / "old.spx").write_bytes(b)
        with pytest.raises(SpecPrefetchError, match=rf"format version 1, this toolkit reads {VERSION} "
                                                    r".*rebuild it with `specprefetch store"):
            ExpertStore(tmp_path / "old.spx")

    def test_random_mutations_are_clean_errors(self, base_store, tmp_path):
        """A few hundred random mutations of a real store's header, index and metadata (and
        truncations): each opens cleanly or is a one-line SpecPrefetchError, never another exception."""
        raw = base_store.read_bytes()
        data_offset = struct.unpack_from("<Q", raw, 56)[0]
        rng = random.Random(13)
        bad = tmp_path / "f.spx"
        for n in range(300):
            b = bytearray(raw)
            kind = n % 4
            if kind == 0:
                for _ in range(rng.randint(1, 8)):
                    b[rng.randrange(data_offset)] = rng.randrange(256)
            elif kind == 1:  # a faulty writer: mutate, then make both CRCs agree
                b[rng.randrange(HEADER.size, data_offset)] = rng.randrange(256)
                L, E = struct.unpack_from("<II", b, 16)
                (meta_len,) = struct.unpack_from("<I", b, 44)
                body = bytes(b[128:128 + 32 * L * E + meta_len])
                struct.pack_into("<I", b, 64, zlib.crc32(body))
                seal_header(b)
            elif kind == 2:
                b = b[:rng.randrange(len(b))]
            else:
                b = bytearray(rng.randbytes(rng.randrange(1, 600)))
                if rng.random() < 0.5:
                    b[:8] = b"SPXSTORE"
            bad.write_bytes(b)
            try:
                ExpertStore(bad).close()
            except SpecPrefetchError as e:
                assert "\n" not in str(e)


class TestDamageRefused:
    """A damaged store (a blob, the index, a truncated file, the magic, the version) is refused by name, by
    both readers."""

    def test_store_rejects_damage(self, emb_store, tiny_models, tmp_path):
        bad = tmp_path / "bad.spx"
        shutil.copy(emb_store, bad)
        st = ExpertStore(bad)
        e = st.entry(2, 3)
        with open(bad, "r+b") as f:
            f.seek(e.offset + 100)
            f.write(b"\xff\xfe")
        with pytest.raises(SpecPrefetchError, match=r"expert \(2, 3\) failed its checksum"):
            ExpertStore(bad).read(2, 3)
        with pytest.raises(SpecPrefetchError, match="built from model config"):
            ExpertStore(emb_store, inspect_model_dir(tiny_models["olmoe"]))
        trunc = tmp_path / "t.spx"
        trunc.write_bytes(emb_store.read_bytes()[: emb_store.stat().st_size // 2])
        with pytest.raises(SpecPrefetchError, match=f"{trunc}: expert .* lies outside the file"):
            ExpertStore(trunc)
        magic = tmp_path / "m.spx"
        magic.write_bytes(b"NOTASTORE" + emb_store.read_bytes()[9:4096])
        with pytest.raises(SpecPrefetchError, match="bad magic"):
            ExpertStore(magic)
        ver = tmp_path / "v.spx"
        raw = bytearray(emb_store.read_bytes()[:8192])
        struct.pack_into("<I", raw, 8, 7)
        ver.write_bytes(bytes(raw))
        with pytest.raises(SpecPrefetchError, match="version 7"):
            ExpertStore(ver)
        idx = tmp_path / "i.spx"
        raw = bytearray(emb_store.read_bytes())
        raw[200] ^= 1
        idx.write_bytes(bytes(raw))
        with pytest.raises(SpecPrefetchError, match="index is corrupt"):
            ExpertStore(idx)

    def test_store_index_entries_are_validated(self, emb_store, tmp_path):
        from toolkit.runtime.expert_store import ENTRY, HEADER

        raw = bytearray(emb_store.read_bytes())
        fields = list(ENTRY.unpack_from(raw, HEADER.size))
        fields[3] += 4096  # a blob size that disagrees with the metadata
        ENTRY.pack_into(raw, HEADER.size, *fields)
        import zlib
        head = list(HEADER.unpack_from(raw, 0))
        L, E, meta_len = head[3], head[4], head[10]
        body = bytes(raw[HEADER.size:HEADER.size + ENTRY.size * L * E + meta_len])
        head[13] = zlib.crc32(body)  # a faulty writer, not random corruption: the CRC matches
        HEADER.pack_into(raw, 0, *head)
        from toolkit.runtime.expert_store import seal_header
        seal_header(raw)  # and so does the header's own CRC
        bad = tmp_path / "b.spx"
        bad.write_bytes(bytes(raw))
        with pytest.raises(SpecPrefetchError, match="index entry 0 is invalid"):
            ExpertStore(bad)

    def test_corrupt_blob_is_refused_by_both_readers(self, embedded, emb_store, tmp_path):
        import shutil

        from toolkit.runtime.expert_store import ExpertStore

        bad = tmp_path / "bad.spx"
        shutil.copy(emb_store, bad)
        s = open_session(embedded, RunConfig(policy=Policy("on-demand", "lru"), pool_mib=1.0), store=bad, max_seq=32,
                         progress=False)
        ids = s.encode("The kernel")
        ref = reference_tokens(embedded, ids, 6)
        for io in ("process", "threads"):
            s.runner.configure(io=io)
            assert s.runner.run(ids, 6).tokens == ref
        for entry in ExpertStore(bad).entries.values():
            with open(bad, "r+b") as f:
                f.seek(entry.offset + 10)
                f.write(b"\x00\x01\x02")
        for io in ("process", "threads"):
            s.runner.configure(io=io)
            with pytest.raises(SpecPrefetchError, match=r"expert \(\d+, \d+\) failed its checksum"):
                s.runner.run(ids, 6)


class TestOpenStoreKeepsItsFile:
    """An open store keeps reading its own file when the path is replaced."""

    @pytest.mark.parametrize("io", ["process", "threads"])
    def test_store_replaced_mid_run_keeps_reading_its_own_file(self, models, tmp_path, io):
        from export.session import open_session
        from toolkit.runtime.policy import Policy
        from toolkit.runtime.runner import RunConfig

        spec = inspect_model_dir(models["base"])
        path = build_store(spec, tmp_path / "s.spx", "fp16", progress=False)
        other = build_store(spec, tmp_path / "o.spx", "int8", progress=False)  # another layout: other offsets
        cfg = RunConfig(policy=Policy("on-demand", "lru"), pool_mib=0.05, io=io)
        s = open_session(models["base"], cfg, store=path, max_seq=24, progress=False)
        first = s.runner.run([5, 9, 13, 2], 6).tokens
        blob = s.runner.store.read(1, 3)
        os.replace(other, path)  # a store rebuilt (int8) under the same name mid-run
        assert s.runner.run([5, 9, 13, 2], 6).tokens == first
        assert s.runner.store.read(1, 3) == blob
        path.unlink()
        assert s.runner.run([5, 9, 13, 2], 6).tokens == first


class TestBuildStoreOutput:
    """build_store's output: never an input or a file that is not a store; nothing left on an interrupt."""

    def test_build_store_refuses_to_overwrite(self, models, base_store, tmp_path):
        spec = inspect_model_dir(models["base"])
        shard = spec.weight_files[0]
        before = file_sha256(shard)
        with pytest.raises(SpecPrefetchError, match="is an input of this command"):
            build_store(spec, shard, "fp16", progress=False, overwrite=True)
        with pytest.raises(SpecPrefetchError, match="is inside .* which is an input"):
            build_store(spec, models["base"] / "experts.spx", "fp16", progress=False)
        assert file_sha256(shard) == before
        notes = tmp_path / "notes.txt"
        notes.write_text("mine")
        with pytest.raises(SpecPrefetchError, match="already exists; pass --overwrite"):
            build_store(spec, notes, "fp16", progress=False)
        with pytest.raises(SpecPrefetchError, match="not an expert store|not a store|--overwrite replaces only"):
            build_store(spec, notes, "fp16", progress=False, overwrite=True)
        assert notes.read_text() == "mine"
        out = tmp_path / "s.spx"
        shutil.copy(base_store, out)
        with pytest.raises(SpecPrefetchError, match="already exists; pass --overwrite"):
            build_store(spec, out, "int8", progress=False)
        build_store(spec, out, "int8", progress=False, overwrite=True)
        assert ExpertStore(out, spec).dtype == "int8"
        assert sorted(os.listdir(tmp_path)) == ["notes.txt", "s.spx"]

    def test_interrupted_build_leaves_nothing(self, models, tmp_path, monkeypatch):
        import toolkit.runtime.expert_store as es

        spec = inspect_model_dir(models["base"])
        calls = []

        def interrupt(w, dtype):
            calls.append(1)
            if len(calls) == 20:
                raise KeyboardInterrupt
            return real(w, dtype)

        real = es.quantize
        monkeypatch.setattr(es, "quantize", interrupt)
        with pytest.raises(KeyboardInterrupt):
            build_store(spec, tmp_path / "s.spx", "int4", progress=False)
        assert os.listdir(tmp_path) == []


class TestSourceWeightsChecked:
    """build_store names a truncated shard or a NaN tensor of its source."""

    def test_truncated_checkpoint_is_named(self, models, tmp_path):
        m = tmp_path / "m"
        shutil.copytree(models["base"], m)
        shard = m / "model.safetensors"
        os.truncate(shard, shard.stat().st_size - 1000)
        with pytest.raises(SpecPrefetchError, match=r"model.safetensors: truncated safetensors file"):
            build_store(inspect_model_dir(m), tmp_path / "s.spx", "fp16", progress=False)
        assert not (tmp_path / "s.spx").exists()

    def test_store_refuses_nan_weights_naming_the_tensor(self, tiny, tmp_path):
        m = tmp_path / "m"
        shutil.copytree(tiny["model"], m)
        key = "model.layers.1.mlp.experts.3.up_proj.weight"
        t = load_file(str(m / "model.safetensors"))
        t[key][2, 5] = float("nan")
        save_file(t, str(m / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(SpecPrefetchError, match=rf"model\.safetensors: tensor '{key}' .*holds NaN"):
            build_store(inspect_model_dir(m), tmp_path / "s.spx", "fp16", progress=False)
        assert not (tmp_path / "s.spx").exists()
        one_error(*cli("store", m, "--out", tmp_path / "s2.spx"), key, "NaN")


class TestNativeOpen:
    """The native runner's ExpertStore::open reads the same format and refuses alike."""

    @pytest.mark.slow
    def test_native_store_open_checks_the_header(self, models, base_store, tmp_path):
        """The C++ ExpertStore::open: a good store opens with its dtype; a flipped dtype byte, a
        version-1 store and a resealed wrong dtype are one-line refusals."""
        if shutil.which("g++") is None or not Path("/usr/include/nlohmann/json.hpp").is_file():
            pytest.skip("needs g++ and nlohmann/json")
        src = REPO / "android_runner" / "src"
        drv = tmp_path / "open_store.cpp"
        drv.write_text('#include <cstdio>\n#include "expert_store.h"\n'
                       'int main(int, char** v) { try { auto s = spx::ExpertStore::open(v[1]);\n'
                       '  std::printf("%s %d %d %s\\n", s->dtype.c_str(), s->num_layers, s->num_experts, '
                       's->source_digest.c_str()); return 0; }\n'
                       '  catch (const std::exception& e) { std::fprintf(stderr, "error: %s\\n", e.what()); '
                       'return 1; } }\n')
        exe = tmp_path / "open_store"
        r = subprocess.run(["g++", "-std=c++17", "-O1", f"-I{src}", str(drv), str(src / "expert_store.cpp"),
                            str(src / "crc32.cpp"), "-o", str(exe)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        st = ExpertStore(base_store)
        r = subprocess.run([str(exe), str(base_store)], capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.split() == ["fp16", str(st.num_layers), str(st.num_experts),
                                                          st.meta["source"]["digest"]], r.stderr
        raw = base_store.read_bytes()
        cases = []
        b = bytearray(raw)
        b[12] = 2
        cases.append((b, "header is corrupt (checksum mismatch)"))
        b = bytearray(raw)
        struct.pack_into("<I", b, 8, 1)
        seal_header(b)
        cases.append((b, "format version 1, this runner reads 2: re-export the bundle"))
        b = bytearray(raw)
        struct.pack_into("<I", b, 12, 1)  # int8, CRC resealed: the metadata disagrees
        seal_header(b)
        cases.append((b, "metadata.dtype 'fp16' differs from the header's int8"))
        for data, msg in cases:
            p = tmp_path / "bad.spx"
            p.write_bytes(data)
            r = subprocess.run([str(exe), str(p)], capture_output=True, text=True)
            assert r.returncode == 1 and msg in r.stderr and r.stderr.count("\n") == 1, r.stderr
            with pytest.raises(SpecPrefetchError):
                ExpertStore(p)
