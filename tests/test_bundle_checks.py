"""Bundle checks (export/manifest.py's validate_bundle, export/session.py's open, the native runner's
Bundle::open): what a bundle's program and store must be before either engine runs them.

- A program that is not what the export wrote is refused in one line naming it, by both engines and
  `inspect`: with the manifest unmodified its sha256 is checked even under --no-verify-hashes; with
  the manifest rewritten to match (a crafted program whose operator index passes ExecuTorch's
  flatbuffer verification and then crashes it), the Python side tries it in a child process first
  and the native runner turns the crash inside ExecuTorch into its refusal line.
- A store of other weights with the same config and size, put into a bundle, is refused on every
  open (Python and native) by the store identity the manifest records, hashes skipped or resealed;
  the manifest records its source model resolved.
- NaN or inf out of a graph or an expert is an error naming the step, in the Python engine as in
  the native runner (`store` refusing NaN weights is in tests/test_expert_store.py).
- `inspect` refuses a manifest whose runtime values lie outside the ranges the native runner also
  enforces, and a manifest.json or a listed file that is not inside the bundle (a symbolic link), in
  one line naming it.

Real files throughout: the session's embedded ExecuTorch bundle and its host runner (the shared
bundle: this module runs late), tiny models.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from cli_helpers import cli_plain as cli, one_error
from cli_helpers import refused as _refused
from toolkit.errors import SpecPrefetchError
from toolkit.models.loader import inspect_model_dir
from toolkit.runtime.expert_store import ENTRY, HEADER, ExpertStore, build_store, seal_header
from toolkit.runtime.policy import Policy
from toolkit.runtime.runner import RunConfig

PTE = "graphs/model.pte"


def refused(args, *fragments) -> str:
    """`cli_helpers.refused` over `cli_plain` (the command's exit code decides)."""
    return _refused(args, *fragments, run=cli)


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """This module's store, hash and program caches live in a temporary directory."""
    monkeypatch.setenv("SPECPREFETCH_PROFILES", str(tmp_path_factory.getbasetemp() / "hb-cache" / "profiles"))


@pytest.fixture(scope="module")
def bundle(embedded_bundles) -> Path:
    return embedded_bundles["executorch"]


def copy_bundle(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def reseal(b: Path, *rels: str) -> None:
    """Rewrite the manifest's size and sha256 of `rels` to match the files: what an attacker does."""
    m = json.loads((b / "manifest.json").read_text())
    for rel in rels:
        p = b / rel
        m["files"][rel] = {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
    (b / "manifest.json").write_text(json.dumps(m))


def native(native_host, b: Path, *args) -> subprocess.CompletedProcess:
    from android_runner.build import command

    return subprocess.run([*command(native_host[1], "host"), str(b), "--prompt-ids", "1,2,3", "--max-new-tokens", "3",
                           *args], capture_output=True, text=True, timeout=300)


def native_refused(r: subprocess.CompletedProcess, *names: str) -> str:
    """Exit 1 with exactly one refusal line naming `names` (negative: killed by a signal)."""
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("specprefetch-runner: error:")]
    assert r.returncode == 1 and len(errors) == 1, (r.returncode, r.stderr[-2000:])
    for n in names:
        assert n in errors[0], errors[0]
    return errors[0]


def kernel_call_op_indices(buf: bytes) -> list[tuple[str, int, int]]:
    """(method, its operator count, byte offset of a KernelCall's op_index) for every kernel call
    that stores its op_index, walking the program's flatbuffer (executorch/schema/program.fbs:
    Program.execution_plan = field 1; ExecutionPlan.name 0, chains 5, operators 6; Chain.instructions
    2; Instruction.instr_args_type 0, instr_args 1, KernelCall = 1; KernelCall.op_index 0)."""
    from flatbuffers import encode
    from flatbuffers import number_types as N
    from flatbuffers.table import Table

    root = Table(buf, encode.Get(N.UOffsetTFlags.packer_type, buf, 0))

    def tables(t: Table, slot: int) -> list[Table]:
        o = t.Offset(4 + 2 * slot)
        if not o:
            return []
        start = t.Vector(o)
        return [Table(buf, t.Indirect(start + 4 * i)) for i in range(t.VectorLen(o))]

    out = []
    for plan in tables(root, 1):
        name = plan.String(plan.Pos + plan.Offset(4)).decode()
        n_ops = plan.VectorLen(plan.Offset(4 + 2 * 6))
        for chain in tables(plan, 5):
            for ins in tables(chain, 2):
                o = ins.Offset(4)
                if not o or ins.Get(N.Uint8Flags, ins.Pos + o) != 1:
                    continue
                kc = Table(buf, 0)
                ins.Union(kc, ins.Offset(6))
                if kc.Offset(4):
                    out.append((name, n_ops, kc.Pos + kc.Offset(4)))
    return out


def crafted_program(src: Path, dst: Path) -> None:
    """`src` with layer_0's first stored KernelCall.op_index past its operators: the flatbuffer
    still verifies (it is an int like any other), and ExecuTorch 1.5 then runs a kernel pointer
    from past the end of its table (SIGSEGV), the crash a bit flip there gives."""
    buf = bytearray(src.read_bytes())
    _, n_ops, at = next(x for x in kernel_call_op_indices(bytes(buf)) if x[0] == "layer_0")
    struct.pack_into("<i", buf, at, n_ops + 1000)
    dst.write_bytes(buf)


def reseal_store(path: Path, *, source_file_sha: str | None = None, blob_edit=None) -> None:
    """Edit a store in place and make every checksum agree again (entry, index and header CRCs):
    `source_file_sha` replaces the first source shard's sha256 in the metadata (and the digest
    over them), as a store built from other weights with the same config and size has it;
    `blob_edit(blob: bytearray)` edits every blob."""
    from toolkit.runtime.fingerprint import _digest

    raw = bytearray(path.read_bytes())
    f = HEADER.unpack_from(raw)
    L, E, meta_len, index_offset = f[3], f[4], f[10], f[11]
    n = L * E
    meta_at = index_offset + ENTRY.size * n
    if source_file_sha is not None:
        meta = json.loads(raw[meta_at:meta_at + meta_len])
        meta["source"]["files"][0]["sha256"] = source_file_sha
        meta["source"]["digest"] = _digest(meta["source"]["files"])
        text = json.dumps(meta).encode()
        assert len(text) == meta_len
        raw[meta_at:meta_at + meta_len] = text
    if blob_edit is not None:
        for i in range(n):
            at = index_offset + ENTRY.size * i
            layer, expert, off, size, crc, res = ENTRY.unpack_from(raw, at)
            blob = bytearray(raw[off:off + size])
            blob_edit(blob)
            raw[off:off + size] = blob
            ENTRY.pack_into(raw, at, layer, expert, off, size, zlib.crc32(blob), res)
    struct.pack_into("<I", raw, 64, zlib.crc32(bytes(raw[index_offset:meta_at + meta_len])))
    seal_header(raw)
    path.write_bytes(raw)


def _bundle_copy(src: Path, dst: Path) -> Path:
    """A hard-linked copy of a shared bundle whose manifest.json is its own file (edited below)."""
    shutil.copytree(src, dst, copy_function=os.link)
    (dst / "manifest.json").unlink()
    shutil.copyfile(src / "manifest.json", dst / "manifest.json")
    return dst


def _set(path: str, value):
    def edit(m):
        *keys, last = path.split(".")
        for k in keys:
            m = m[k]
        m[last] = value
    return edit


INSPECT_EDITS = [
    ("runtime.pool_mib", -5, "runtime.pool_mib is -5"),
    ("runtime.pool_mib", 0, "runtime.pool_mib is 0"),
    ("runtime.pool_mib", "8", "runtime.pool_mib is '8'"),
    ("runtime.scheduler.window", 0, "runtime.scheduler.window is 0"),
    ("runtime.scheduler.window", 99, "runtime.scheduler.window is 99"),
    ("runtime.scheduler.queue_depth", -1, "runtime.scheduler.queue_depth is -1"),
    ("runtime.scheduler.min_confidence", 1.5, "runtime.scheduler.min_confidence is 1.5"),
    ("runtime.scheduler.prefetch", "yes", "runtime.scheduler.prefetch is 'yes'"),
    ("kv.max_seq", 0, "kv.max_seq is 0"),
    ("target", "tpu", "target 'tpu' is not a target this toolkit knows"),
    ("target", None, "target None is not a target"),
    ("runtime", [], "field 'runtime' must be a JSON object"),
]


@pytest.fixture(scope="module")
def tiny(tiny_models, tmp_path_factory) -> dict:
    """The tiny qwen3_moe checkpoint and its fp16 store."""
    base = tiny_models["qwen3_moe"]
    store = tmp_path_factory.mktemp("hb-store") / "s.spx"
    build_store(inspect_model_dir(base), store, "fp16", progress=False)
    return {"model": base, "store": store}


class TestDamagedProgram:
    """A program that is not what the export wrote is refused by both engines and inspect."""

    def test_a_damaged_program_is_refused_even_with_hashes_skipped(self, bundle, native_host, tmp_path):
        """(a) The manifest unmodified, one bit of the program's flatbuffer flipped (size kept): the
        native runner under --no-verify-hashes (what `device bench` passes) still hashes the program,
        the Python engine always does; each refuses in one line naming graphs/model.pte."""
        b = copy_bundle(bundle, tmp_path / "b")
        p = b / PTE
        raw = bytearray(p.read_bytes())
        program_size = struct.unpack_from("<I", raw, 16)[0]  # the extended header: the flatbuffer's length
        raw[program_size * 3 // 4] ^= 0x08
        p.write_bytes(raw)
        native_refused(native(native_host, b, "--no-verify-hashes"), PTE, "sha256 mismatch")
        native_refused(native(native_host, b), PTE, "sha256 mismatch")
        one_error(*cli("run", b, "--prompt", "hello", "--max-new-tokens", "2", "--json", tmp_path / "r.json"),
                  PTE, "sha256 mismatch")
        one_error(*cli("inspect", b), PTE, "sha256 mismatch")

    def test_a_crafted_program_with_a_resealed_manifest_crashes_nothing(self, bundle, native_host, tmp_path):
        """(b) The manifest rewritten to the crafted program's hash: `inspect` and the Python engine try
        it in a child process (whose crash is their one-line error naming the program: before, inspect
        called it valid and `run` died of SIGSEGV); the native runner's crash inside ExecuTorch is its
        refusal line, exit 1 (before: exit 139, no line)."""
        b = copy_bundle(bundle, tmp_path / "b")
        crafted_program(bundle / PTE, b / PTE)
        reseal(b, PTE)
        err = one_error(*cli("inspect", b), str(b / PTE), "ExecuTorch crashed (SIGSEGV)", "layer_0")
        assert "separate process" in err
        from export.session import open_session

        with pytest.raises(SpecPrefetchError,
                           match=r"model\.pte: ExecuTorch crashed \(SIGSEGV\) running method layer_0"):
            open_session(b, RunConfig(policy=Policy("on-demand", "lru")))
        err = native_refused(native(native_host, b), str(b.resolve() / PTE), "ExecuTorch crashed (SIGSEGV)",
                             "running method 'layer_0'")
        assert "not what the export wrote" in err
        # the good program is still known good (no child process) and runs
        code, out = cli("inspect", bundle)
        assert code == 0, out


class TestSwappedStore:
    """The bundle's store is the one it was exported with, by the identity its manifest records."""

    def test_a_store_of_other_weights_is_refused_hashes_skipped_or_resealed(self, bundle, native_host, tmp_path):
        """A store built from other weights with the same config and size (its source record differs)
        in the bundle's place: refused by the Python engine (which never hashes the store), by the
        native runner under --no-verify-hashes, and by both with the manifest resealed, naming the
        store and the cause. Before, the Python engine and the native runner ran it."""
        from export.session import open_session

        b = copy_bundle(bundle, tmp_path / "b")
        reseal_store(b / "experts.spx", source_file_sha="ab" * 32)
        ExpertStore(b / "experts.spx")  # a valid store in itself
        cfg = RunConfig(policy=Policy("on-demand", "lru"))
        with pytest.raises(SpecPrefetchError, match=r"experts\.spx: expert store built from other weights"):
            open_session(b, cfg)
        native_refused(native(native_host, b, "--no-verify-hashes"), "experts.spx", "built from other weights")
        reseal(b, "experts.spx")  # the manifest's file hashes rewritten to match
        one_error(*cli("inspect", b), "experts.spx", "built from other weights")
        with pytest.raises(SpecPrefetchError, match="built from other weights"):
            open_session(b, cfg)
        native_refused(native(native_host, b), "experts.spx", "built from other weights")
        # the same source record, other blob bytes with their CRCs right: the index is not the exported one
        b2 = copy_bundle(bundle, tmp_path / "b2")
        reseal_store(b2 / "experts.spx", blob_edit=lambda blob: blob.__setitem__(slice(0, 2), b"\x00\x3c"))
        reseal(b2, "experts.spx")
        with pytest.raises(SpecPrefetchError, match=r"experts\.spx: the expert store's index is not the one"):
            open_session(b2, cfg)
        native_refused(native(native_host, b2, "--no-verify-hashes"), "experts.spx", "not the expert store the bundle")

    def test_a_bundle_records_its_store_identity_and_resolved_source(self, bundle):
        m = json.loads((bundle / "manifest.json").read_text())
        st = ExpertStore(bundle / "experts.spx")
        assert m["runtime"]["expert_store_source"] == st.meta["source"]["digest"]
        assert m["runtime"]["expert_store_index_sha256"] == st.index_sha256
        assert Path(m["model"]["source"]).is_absolute()


class TestSourceModel:
    """The bundle's source model: recorded resolved, and why it is not used when it is not."""

    def test_check_names_why_the_source_model_is_missing(self, bundle, tmp_path):
        """--check on a bundle whose recorded source is not here names that source (a relative one
        recorded by an older export included), not only "not on this machine"."""
        from export.session import open_session

        b = copy_bundle(bundle, tmp_path / "b")
        m = json.loads((b / "manifest.json").read_text())
        m["model"]["source"] = "models/elsewhere"
        (b / "manifest.json").write_text(json.dumps(m))
        s = open_session(b, RunConfig(policy=Policy("on-demand", "lru")))
        assert s.source_model is None and (
            "exported from models/elsewhere, which is not on this machine" in s.source_problem)
        s2 = open_session(bundle, RunConfig(policy=Policy("on-demand", "lru")))
        assert s2.source_model is not None and s2.source_problem is None

    @pytest.mark.slow  # one export of a tiny model
    def test_export_records_the_source_resolved(self, tiny_models, tmp_path, monkeypatch):
        from export.bundle import ExportConfig, export_bundle

        shutil.copytree(tiny_models["qwen3_moe"], tmp_path / "m")
        monkeypatch.chdir(tmp_path)
        m = export_bundle(Path("m"), tmp_path / "b", ExportConfig(max_seq=24, parity_prompts=1, prompt_tokens=10,
                                                                 decode_tokens=4, progress=False))
        assert m["model"]["source"] == str((tmp_path / "m").resolve())


class TestNonFiniteValues:
    """NaN or inf out of a graph or an expert is an error naming the step, in both engines."""

    def test_python_engine_refuses_a_nan_store(self, tiny, tmp_path):
        """Every expert's first fp16 weight NaN, all checksums right: before, the run decoded NaN logits
        into token 0 / EOS and exited 0; now the expert computed from it is named."""
        from export.session import open_session

        s = tmp_path / "nan.spx"
        shutil.copy(tiny["store"], s)
        reseal_store(s, blob_edit=lambda blob: blob.__setitem__(slice(0, 2), b"\x00\x7e"))  # fp16 NaN
        sess = open_session(tiny["model"], RunConfig(policy=Policy("on-demand", "lru"), io="threads"), store=s,
                            progress=False)
        with pytest.raises(SpecPrefetchError, match=r"nan\.spx: expert \(\d+, \d+\) gave non-finite output"):
            sess.runner.generate([5, 9, 14], 4)

    def test_python_engine_refuses_a_nan_rms_norm_eps(self, tiny, tmp_path):
        from export.session import open_session

        m = tmp_path / "m"
        shutil.copytree(tiny["model"], m)
        cfg = json.loads((m / "config.json").read_text())
        cfg["rms_norm_eps"] = float("nan")
        (m / "config.json").write_text(json.dumps(cfg))  # NaN, as Python's json writes it
        spec = inspect_model_dir(m)
        st = build_store(spec, tmp_path / "s.spx", "fp16", progress=False)
        sess = open_session(m, RunConfig(policy=Policy("on-demand", "lru"), io="threads"), store=st, progress=False,
                            max_seq=16)
        with pytest.raises(SpecPrefetchError,
                           match=r"embed|layer_0 gave non-finite values \(NaN or inf\) at position 0"):
            sess.runner.generate([5, 9, 14], 4)
        code, out = cli("run", m, "--store", st, "--policy", "on-demand+lru", "--prompt", "hello",
                        "--max-new-tokens", "2", "--max-seq", "16", "--no-check", "--json", tmp_path / "r.json")
        one_error(code, out, "non-finite")
        assert not (tmp_path / "r.json").exists()

    def test_native_runner_refuses_a_nan_store(self, bundle, native_host, tmp_path):
        """The native runner refused NaN before (the layer output after the experts); it still does,
        with the store resealed into the manifest (identity included) so the run reaches it."""
        b = copy_bundle(bundle, tmp_path / "b")
        reseal_store(b / "experts.spx", blob_edit=lambda blob: blob.__setitem__(slice(0, 2), b"\x00\x7e"))
        m = json.loads((b / "manifest.json").read_text())
        m["runtime"]["expert_store_index_sha256"] = ExpertStore(b / "experts.spx").index_sha256
        (b / "manifest.json").write_text(json.dumps(m))
        native_refused(native(native_host, b, "--no-verify-hashes", "--policy", "on-demand+lru"), "not finite")


class TestManifestRanges:
    """`inspect` refuses runtime values outside the ranges the native runner also enforces."""

    @pytest.mark.parametrize("path,value,what", INSPECT_EDITS, ids=[f"{p}={v!r}" for p, v, _ in INSPECT_EDITS])
    def test_inspect_refuses_out_of_range_manifest_values(self, path, value, what, embedded_bundles, tmp_path):
        b = _bundle_copy(embedded_bundles["executorch"], tmp_path / "b")
        m = json.loads((b / "manifest.json").read_text())
        _set(path, value)(m)
        (b / "manifest.json").write_text(json.dumps(m))
        refused(["inspect", b], str(b / "manifest.json"), what)


class TestRunnerBenchVariant:
    """`runner bench --variant window=N` past the bundle's MoE layers is refused in one line before any run
    (nothing written), as the native runner would refuse it minutes into the bench."""

    def test_a_window_past_the_bundles_layers_is_refused_first(self, embedded_bundles, tmp_path):
        out = tmp_path / "r.json"
        refused(["runner", "bench", embedded_bundles["executorch"], "--variant", "window=9", "--json", out],
                "--variant window=9", "window must be 1..8")
        assert not out.exists() and not any(tmp_path.iterdir())

    def test_reuse_classes_off_needs_a_table_with_classes(self, embedded_bundles, tmp_path):
        """--variant reuse_classes=off on a bundle without a reuse table, or with one without classes."""
        out = tmp_path / "r.json"
        refused(["runner", "bench", embedded_bundles["executorch"], "--variant", "reuse_classes=off", "--json", out],
                "--variant reuse_classes=off", "the bundle has no reuse table")
        import numpy as np

        from adapters.reuse import learn_reuse_table

        b = _bundle_copy(embedded_bundles["executorch"], tmp_path / "b")
        m = json.loads((b / "manifest.json").read_text())
        m["predictor"]["reuse"] = learn_reuse_table([np.arange(40 * 8 * 4).reshape(40, 8, 4) % 32], 32).to_json()
        (b / "manifest.json").write_text(json.dumps(m))
        refused(["runner", "bench", b, "--variant", "reuse_classes=off", "--json", out],
                "--variant reuse_classes=off", "no frequency classes")
        assert not out.exists()


class TestFilesInsideTheBundle:
    """`inspect` refuses a manifest.json or a listed file that resolves outside the bundle."""

    def test_inspect_refuses_a_manifest_or_file_outside_the_bundle(self, embedded_bundles, tmp_path):
        src = embedded_bundles["executorch"]
        b = _bundle_copy(src, tmp_path / "b")
        assert cli("inspect", b)[0] == 0
        outside = tmp_path / "elsewhere.json"
        shutil.copyfile(b / "manifest.json", outside)
        (b / "manifest.json").unlink()
        (b / "manifest.json").symlink_to(outside)
        refused(["inspect", b], str(b / "manifest.json"), "symbolic link")
        (b / "manifest.json").unlink()
        shutil.copyfile(outside, b / "manifest.json")
        (b / "parity.md").unlink()
        (b / "parity.md").symlink_to(src / "parity.md")  # the same bytes, but outside this bundle
        refused(["inspect", b], "parity.md", "resolves outside the bundle")
