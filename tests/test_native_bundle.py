"""The native runner's file-reading half (android_runner/src: bundle, expert store, reader,
safetensors, sha256, crc32), driven through android_runner/tests/check_bundle.cpp (the one the session's
host runner build installs; NATIVE_SANITIZE=1: built here with ASan + UBSan): a good ExecuTorch bundle
passes with every expert read and CRC-checked, and every kind of damage is refused with one line naming
the file (exit 1, no crash)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from toolkit.runtime.expert_store import ExpertStore

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "android_runner" / "src"
SOURCES = ["bundle.cpp", "expert_store.cpp", "reader.cpp", "safetensors.cpp", "sha256.cpp", "crc32.cpp"]
SANITIZE = os.environ.get("NATIVE_SANITIZE") == "1"
# the session's host runner build (which installs check_bundle): named, so the background build makes it
pytestmark = [] if SANITIZE else [pytest.mark.usefixtures("native_host")]


@pytest.fixture(scope="module")
def tool(request, tmp_path_factory) -> Path:
    """check_bundle: the one the session's host runner build installs (its bin/, built with the runner by
    the background build). NATIVE_SANITIZE=1 compiles it here with AddressSanitizer and UBSan instead
    (objects built two at a time; any report fails the refusal tests)."""
    if not SANITIZE:
        _, build = request.getfixturevalue("native_host")
        return build / "bin" / "check_bundle"
    if shutil.which("g++") is None or not Path("/usr/include/nlohmann/json.hpp").is_file():
        pytest.skip("needs g++ and nlohmann/json (apt-get install g++ nlohmann-json3-dev)")
    out = tmp_path_factory.mktemp("native")
    units = [SRC / s for s in SOURCES] + [REPO / "android_runner" / "tests" / "check_bundle.cpp"]
    flags = ["-std=c++17", "-O1", "-g", "-pthread", "-Wall", "-Wextra", f"-I{SRC}", "-fsanitize=address,undefined",
             "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]

    def compile_one(src: Path) -> Path:
        obj = out / (src.stem + ".o")
        r = subprocess.run(["g++", *flags, "-c", str(src), "-o", str(obj)], capture_output=True, text=True)
        assert r.returncode == 0, f"g++ {src.name}:\n{r.stderr}"
        return obj

    with ThreadPoolExecutor(2) as ex:
        objs = list(ex.map(compile_one, units))
    exe = out / "check_bundle"
    r = subprocess.run(["g++", *flags, *map(str, objs), "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return exe


@pytest.fixture(scope="module")
def bundle(embedded_bundles) -> Path:
    return embedded_bundles["executorch"]


def run(tool: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([str(tool), *map(str, args)], capture_output=True, text=True, timeout=120)


def ok(tool: Path, *args) -> dict:
    r = run(tool, *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def refused(tool: Path, *args, names: tuple[str, ...] = ()) -> str:
    """The run ended with exit 1 and one line 'check_bundle: error: ...' naming `names`."""
    r = run(tool, *args)
    err = r.stderr
    assert r.returncode == 1, f"rc {r.returncode} (negative: killed by a signal)\n{err}"
    assert "terminate called" not in err and "internal error" not in err
    assert "Sanitizer" not in err and "runtime error" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("check_bundle: error: "), err
    assert r.stdout == ""
    for n in names:
        assert n in err, err
    return err


def copy_bundle(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "bundle"
    shutil.copytree(src, dst, symlinks=True)
    return dst


def manifest(b: Path) -> dict:
    return json.loads((b / "manifest.json").read_text())


def write_manifest(b: Path, m: dict) -> None:
    (b / "manifest.json").write_text(json.dumps(m, indent=1))


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        x = f.read(1)
        f.seek(offset)
        f.write(bytes([x[0] ^ 0x5A]))


def rehash(b: Path, rel: str) -> None:
    """Make the manifest agree with the (modified) file `rel` again."""
    m = manifest(b)
    p = b / rel
    m["files"][rel] = {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
    write_manifest(b, m)


# -- a good bundle -------------------------------------------------------------------------

def test_good_bundle_passes_and_every_expert_is_checked(tool, bundle):
    d = ok(tool, bundle)
    m = manifest(bundle)
    store = ExpertStore(bundle / m["runtime"]["expert_store"])
    L, E = len(m["model"]["moe_layers"]), m["model"]["num_experts"]
    assert d["experts_checked"] == L * E == store.num_layers * store.num_experts
    assert d["bytes_read"] == L * E * store.slot_bytes
    # a prefetch queued behind demand reads on one lane is cancelled before the disk; landed / gone ones are not
    c = d["cancel"]
    assert (c["queued"], c["landed"], c["again"], c["wait_after"]) == (True, False, False, False)
    assert c["cancelled"] == 1 and c["reads"] == c["demand_reads"] == 7
    assert d["bundle"] == str(bundle.resolve()) and d["target"] == "executorch" and d["verified_hashes"] is True
    for k in ("family", "model_type", "hidden_size", "vocab_size", "top_k"):
        assert d[k] == m["model"][k], k
    assert (d["layers"], d["moe_layers"], d["experts"]) == (m["model"]["num_layers"], m["model"]["moe_layers"], E)
    assert (d["dtype"], d["blob_size"], d["slot_bytes"]) == (store.dtype, store.blob_size, store.slot_bytes)
    assert d["dtype"] == m["quantization"]["experts"]
    assert d["eos_token_ids"] == m["eos_token_ids"]
    assert (d["max_seq"], d["kv_mode"]) == (m["kv"]["max_seq"], m["kv"]["mode"]) and d["max_seq"] == 64
    assert d["pool_mib"] == m["runtime"]["pool_mib"] and d["predictor"] == m["predictor"]["kind"]
    assert d["horizons"] == m["predictor"]["horizons"]
    sched = m["runtime"]["scheduler"]
    assert (d["scheduler"]["window"], d["scheduler"]["queue_depth"]) == (sched["window"], sched["queue_depth"])
    assert d["scheduler"]["min_confidence"] == sched["min_confidence"]
    assert d["scheduler"]["candidate_threshold"] == sched["candidate_threshold"]
    assert d["scheduler"]["step_budget_bytes"] == (sched["step_budget_bytes"]
                                                   if sched["step_budget_bytes"] is not None else -1)
    # preds_rows: the manifest keys layer numbers, the runner MoE positions
    moe = m["model"]["moe_layers"]
    assert d["preds_rows"] == {str(moe.index(int(k))): v for k, v in m["predictor"]["preds_rows"].items()}
    assert d["routing"]["score_func"] == m["routing"]["score_func"]
    assert d["routing"]["norm_topk_prob"] == m["routing"]["norm_topk_prob"]
    assert d["routing"]["n_group"] == (m["routing"]["n_group"] or 0)
    assert d["methods"] == m["graphs"]["methods"]
    assert d["program"] == str((bundle / m["graphs"]["file"]).resolve())
    assert d["store"] == str((bundle / m["runtime"]["expert_store"]).resolve())
    assert d["tokenizer"] == str((bundle / "model" / "tokenizer.json").resolve())
    assert d["hidden_act"] == json.loads((bundle / m["model"]["config"]).read_text()).get("hidden_act", "silu")
    assert d["host_tensors"]["router_weight"] == [L, E, m["model"]["hidden_size"]]
    assert isinstance(d["direct"], bool) and d["io_note"]
    assert d["direct_reads"] == (L * E if d["direct"] else 0)


def test_buffered_reads_and_no_verify(tool, bundle):
    d = ok(tool, bundle, "--no-verify", "--buffered")
    assert d["direct"] is False and "buffered" in d["io_note"] and d["direct_reads"] == 0
    assert d["experts_checked"] == d["layers"] * d["experts"] and d["verified_hashes"] is False


def test_sha256_and_crc32_agree_with_python(tool, bundle, tmp_path):
    """C++ sha256 (streamed and whole-file) and CRC-32 equal hashlib's and zlib's: the bundle's
    files, and lengths around the 64-byte block and 1 MiB read boundaries."""
    rng = __import__("random").Random(0)
    paths = [bundle / rel for rel in manifest(bundle)["files"]]
    for n in (0, 1, 55, 56, 63, 64, 65, 119, 120, 1000, (1 << 20) - 1, (1 << 20) + 3):
        p = tmp_path / f"f{n}"
        p.write_bytes(bytes(rng.getrandbits(8) for _ in range(min(n, 4096))) * (n // 4096) +
                      bytes(rng.getrandbits(8) for _ in range(n % 4096)))
        paths.append(p)
    d = ok(tool, "--digest", *paths)
    for p in paths:
        data = p.read_bytes()
        got = d[str(p)]
        assert got["size"] == len(data), p
        assert got["sha256"] == hashlib.sha256(data).hexdigest(), p
        assert got["crc32"] == zlib.crc32(data), p


# -- refusals ------------------------------------------------------------------------------

def test_tampered_file_content(tool, bundle, tmp_path):
    b = copy_bundle(bundle, tmp_path)
    flip(b / "parity.md", 10)  # same size, other bytes
    refused(tool, b, names=("manifest.json", "sha256 mismatch", "parity.md"))
    # without hashes only the store goes unhashed: every other file (the program too) still is
    refused(tool, b, "--no-verify", names=("manifest.json", "sha256 mismatch", "parity.md"))


def test_tampered_manifest_hash(tool, bundle, tmp_path):
    b = copy_bundle(bundle, tmp_path)
    m = manifest(b)
    m["files"]["model/config.json"]["sha256"] = "0" * 64
    write_manifest(b, m)
    refused(tool, b, names=("manifest.json", "sha256 mismatch", "model/config.json"))


def test_manifest_version_2(tool, bundle, tmp_path):
    b = copy_bundle(bundle, tmp_path)
    m = manifest(b)
    m["version"] = 2
    write_manifest(b, m)
    refused(tool, b, names=("manifest.json", "version 2"))


def test_the_candidate_threshold_under_its_old_name(tool, bundle, tmp_path):
    """A bundle exported before the rename calls runtime.scheduler.candidate_threshold `floor`: both
    engines' readers take it (a value out of [0, 1] is refused under that name)."""
    from export.manifest import scheduler_defaults, validate_bundle

    b = copy_bundle(bundle, tmp_path)
    m = manifest(b)
    m["runtime"]["scheduler"].pop("candidate_threshold")
    m["runtime"]["scheduler"]["floor"] = 0.25
    write_manifest(b, m)
    assert ok(tool, b)["scheduler"]["candidate_threshold"] == 0.25
    assert scheduler_defaults(manifest(b))["candidate_threshold"] == 0.25
    m["runtime"]["scheduler"]["floor"] = 1.5
    write_manifest(b, m)
    refused(tool, b, names=("runtime.scheduler.floor",))
    with pytest.raises(Exception, match="runtime.scheduler.floor"):
        validate_bundle(b, hash_store=False)


@pytest.mark.parametrize("edit, names", [
    (lambda m: m["model"].__setitem__("num_layers", "8"), ("model.num_layers", "integer")),
    (lambda m: m["model"].__setitem__("top_k", 1000), ("model.top_k",)),
    (lambda m: m["model"].__setitem__("moe_layers", [3, 2]), ("model.moe_layers",)),
    (lambda m: m["runtime"].__setitem__("pool_mib", -1), ("runtime.pool_mib",)),
    (lambda m: m["runtime"]["scheduler"].__setitem__("window", 0), ("runtime.scheduler.window",)),
    (lambda m: m["runtime"]["scheduler"].__setitem__("min_confidence", 1.5), ("runtime.scheduler.min_confidence",)),
    (lambda m: m["runtime"]["scheduler"].__setitem__("candidate_threshold", -0.1),
     ("runtime.scheduler.candidate_threshold",)),
    (lambda m: m["predictor"]["preds_rows"].__setitem__("99", [1]), ("predictor.preds_rows",)),
    (lambda m: m.pop("kv"), ("'kv'",)),
    (lambda m: m["files"].__setitem__("x", []), ("files['x']",)),
    (lambda m: m.__setitem__("format", "other"), ("format",)),
], ids=["type", "top_k", "moe_layers", "pool_mib", "window", "min_confidence", "threshold", "preds_rows", "missing",
        "files_entry", "format"])
def test_malformed_manifest_values(tool, bundle, tmp_path, edit, names):
    b = copy_bundle(bundle, tmp_path)
    m = manifest(b)
    edit(m)
    write_manifest(b, m)
    refused(tool, b, names=("manifest.json", *names))


def test_manifest_not_json(tool, bundle, tmp_path):
    b = copy_bundle(bundle, tmp_path)
    (b / "manifest.json").write_text('{"format": "specprefetch-bundle", "version": 1,\n\n "x": [1, 2')
    refused(tool, b, names=("manifest.json", "not valid JSON"))


def test_manifest_symlink(tool, bundle, tmp_path):
    b = copy_bundle(bundle, tmp_path)
    (b / "manifest.json").rename(tmp_path / "real.json")
    (b / "manifest.json").symlink_to(tmp_path / "real.json")
    refused(tool, b, names=("manifest.json", "symlink"))


def test_files_entry_outside_the_bundle(tool, bundle, tmp_path):
    b = copy_bundle(bundle, tmp_path)
    (tmp_path / "outside.txt").write_text("secret")
    m = manifest(b)
    m["files"]["../outside.txt"] = {"size": 6, "sha256": hashlib.sha256(b"secret").hexdigest()}
    write_manifest(b, m)
    refused(tool, b, names=("manifest.json", "../outside.txt", "not a path inside the bundle"))
    m["files"].pop("../outside.txt")
    m["files"]["/etc/hostname"] = {"size": 1, "sha256": "0" * 64}
    write_manifest(b, m)
    refused(tool, b, names=("manifest.json", "/etc/hostname", "not a path inside the bundle"))


def test_symlinked_file_resolving_outside(tool, bundle, tmp_path):
    b = copy_bundle(bundle, tmp_path)
    shutil.move(b / "parity.md", tmp_path / "parity.md")
    (b / "parity.md").symlink_to(tmp_path / "parity.md")  # same bytes, but outside
    refused(tool, b, names=("manifest.json", "parity.md", "resolves outside the bundle"))


def test_missing_file(tool, bundle, tmp_path):
    b = copy_bundle(bundle, tmp_path)
    (b / "host.safetensors").unlink()
    refused(tool, b, names=("manifest.json", "host.safetensors", "missing"))


def test_flipped_byte_in_store_index(tool, bundle, tmp_path):
    b = copy_bundle(bundle, tmp_path)
    flip(b / "experts.spx", 128 + 32 * 3 + 24)  # expert (0, 3)'s CRC field
    refused(tool, b, names=("sha256 mismatch", "experts.spx"))
    # unhashed, the store's identity (the sha256 of its header, index and metadata) still is checked
    refused(tool, b, "--no-verify", names=("experts.spx", "not the expert store the bundle was exported with"))
    raw = (b / "experts.spx").read_bytes()  # with the identity rewritten too, the store's own index CRC catches it
    L, E, meta_len = struct.unpack_from("<II", raw, 16) + struct.unpack_from("<I", raw, 44)
    m = manifest(b)
    m["runtime"]["expert_store_index_sha256"] = hashlib.sha256(raw[:128 + 32 * L * E + meta_len]).hexdigest()
    write_manifest(b, m)
    refused(tool, b, "--no-verify", names=("experts.spx", "index is corrupt (checksum mismatch)"))


def test_flipped_byte_in_blob(tool, bundle, tmp_path):
    b = copy_bundle(bundle, tmp_path)
    e = ExpertStore(b / "experts.spx").entry(5, 17)
    flip(b / "experts.spx", e.offset + 1234)
    refused(tool, b, names=("sha256 mismatch", "experts.spx"))
    refused(tool, b, "--no-verify", names=("experts.spx", "expert (5, 17) failed its checksum (corrupt blob)"))
    refused(tool, b, "--no-verify", "--buffered", names=("expert (5, 17) failed its checksum",))


def test_truncated_program(tool, bundle, tmp_path):
    b = copy_bundle(bundle, tmp_path)
    p = b / "graphs" / "model.pte"
    os.truncate(p, p.stat().st_size - 100)
    refused(tool, b, "--no-verify", names=("manifest.json", "graphs/model.pte", "truncated"))


def test_truncated_store(tool, bundle, tmp_path):
    b = copy_bundle(bundle, tmp_path)
    p = b / "experts.spx"
    os.truncate(p, p.stat().st_size - 4096)
    refused(tool, b, "--no-verify", names=("manifest.json", "experts.spx", "bytes, the manifest says"))
    rehash(b, "experts.spx")  # a manifest that agrees: the store's own checks catch it
    refused(tool, b, names=("experts.spx", "lies outside the file"))
    os.truncate(p, 100)
    rehash(b, "experts.spx")
    refused(tool, b, names=("experts.spx", "truncated expert store (no header)"))


def test_bad_host_tensors(tool, bundle, tmp_path):
    b = copy_bundle(bundle, tmp_path)
    p = b / "host.safetensors"
    orig = p.read_bytes()
    hlen = struct.unpack_from("<Q", orig, 0)[0]
    p.write_bytes(struct.pack("<Q", 1 << 40) + orig[8:])  # header length past the file
    rehash(b, "host.safetensors")
    refused(tool, b, names=("host.safetensors", "header length"))
    head = orig[8:8 + hlen].replace(b'"F32"', b'"F16"', 1)  # same length, another dtype
    p.write_bytes(orig[:8] + head + orig[8 + hlen:])
    rehash(b, "host.safetensors")
    refused(tool, b, names=("host.safetensors", "only F32"))


def with_target(bundle: Path, tmp_path: Path, target: str) -> Path:
    """A copy of `bundle` whose manifest names `target` (its graphs still an ExecuTorch program)."""
    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    m = json.loads((b / "manifest.json").read_text())
    m["target"] = target
    (b / "manifest.json").write_text(json.dumps(m))
    return b


def test_a_manifest_naming_another_target_is_refused(tool, embedded_bundles, tmp_path):
    b = with_target(embedded_bundles["executorch"], tmp_path, "tflite")
    err = refused(tool, b, names=("manifest.json", "'tflite'"))
    assert "runs executorch, qnn and qai-hub bundles" in err


def test_a_qnn_manifest_with_a_program_is_refused(tool, embedded_bundles, tmp_path):
    """A qnn bundle's graphs are EPContext models (graphs.files and .binaries), not a program."""
    refused(tool, with_target(embedded_bundles["executorch"], tmp_path, "qnn"), names=("manifest.json", "graphs."))


def test_not_a_bundle(tool, tmp_path):
    refused(tool, tmp_path, names=("manifest.json", "missing"))
    refused(tool, tmp_path / "nope", names=("nope",))
