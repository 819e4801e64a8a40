"""`specprefetch device list -> push -> bench` end to end through the real adb client and a private
adb server, against the stand-in phone (the toolkit/device/standin/ package), and every failure a user meets.

In make test the stand-in reports ABI x86_64, so the device gets this machine's runner build (the
session's, conftest.native_host) and runs fast; make test-all runs the same flow with an arm64-v8a
stand-in, which gets the cross-built arm64 runner and runs it under qemu-aarch64."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from export.session import reference_tokens
from toolkit.device.phone import LOCK, ROOT, bench, bundle_hash, list_devices, push, states_table
from toolkit.device.standin import StandIn, adb_server
from toolkit.errors import SpecPrefetchError

pytestmark = pytest.mark.skipif(shutil.which("adb") is None, reason="adb is not installed (apt-get install adb)")

PROMPT = "The kernel's memory allocator"
NEW = 5
POLICIES = "on-demand+lru,next-gate+prediction"


@pytest.fixture(scope="module")
def server():
    with adb_server() as s:
        mp = pytest.MonkeyPatch()
        mp.setenv("ANDROID_ADB_SERVER_PORT", str(s.port))  # the toolkit's adb calls reach this server
        mp.delenv("ANDROID_SERIAL", raising=False)
        yield s
        mp.undo()


@pytest.fixture
def phones(server, tmp_path):
    started: list[StandIn] = []

    def make(abi: str = "x86_64", state: str | None = "device", **kw) -> StandIn:
        p = StandIn(root=tmp_path / f"phone{len(started)}", props={"ro.product.cpu.abi": abi}, **kw)
        p.start()
        started.append(p)
        if state is not None:
            server.connect(p.serial, state=state)
        return p

    yield make
    for p in started:
        server.adb("disconnect", p.serial, check=False)
        p.stop()


def cli(*args, timeout=900):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(["specprefetch", "device", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def one_line_error(r, text):
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr and text in r.stderr, r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.startswith("error")]) == 1, r.stderr


def reference(bundle: Path) -> list[int]:
    m = json.loads((bundle / "manifest.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(bundle / Path(m["model"]["config"]).parent), local_files_only=True)
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    return reference_tokens(Path(m["model"]["source"]), ids, NEW)


def flow(bundle: Path, phone: StandIn, tmp_path: Path, repeats: int = 2) -> dict:
    r = cli("list", "--json", tmp_path / "list.json")
    assert r.returncode == 0, r.stderr
    (d,) = [x for x in json.loads((tmp_path / "list.json").read_text())["devices"] if x["serial"] == phone.serial]
    assert d["state"] == "device" and d["soc"] == "SM8750" and d["sm8750"] and d["inlinecrypt"] is True
    assert [c["max_khz"] for c in d["clusters"]] == [3532800, 4320000] and d["ram_bytes"] > 10 * 2**30
    assert d["free_bytes_data_local_tmp"] > 0 and phone.serial in r.stdout and "SM8750" in r.stdout

    r = cli("push", bundle, "--serial", phone.serial)
    assert r.returncode == 0, r.stderr
    remote = r.stdout.split(": ", 1)[1].split(" (")[0]
    host = phone.host_path(remote)
    assert (host / "bundle" / "manifest.json").read_bytes() == (bundle / "manifest.json").read_bytes()
    assert (host / "runner" / "run.sh").is_file() and (host / "runner" / "bin" / "specprefetch-runner").is_file()
    # a second push sends nothing; a changed file on the device is sent again
    r = cli("push", bundle, "--serial", phone.serial)
    assert r.returncode == 0 and "(0 of" in r.stdout, r.stdout + r.stderr
    (host / "bundle" / "manifest.json").write_text("{}")
    r = cli("push", bundle, "--serial", phone.serial)
    assert r.returncode == 0 and "(1 of" in r.stdout, r.stdout + r.stderr

    out = tmp_path / "phone.json"
    r = cli("bench", bundle, "--serial", phone.serial, "--policies", POLICIES, "--pool-mib", "2.0",
            "--prompt", PROMPT, "--max-new-tokens", NEW, "--repeats", repeats, "--cooldown-timeout", "5",
            "--json", out)
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["status"] == "complete" and rep["failures"] == []
    assert rep["configs"] == POLICIES.split(",") and len(rep["runs"]) == 2 * repeats
    assert [x["config"] for x in rep["runs"][:4]] == ["on-demand+lru", "next-gate+prediction",
                                                      "next-gate+prediction", "on-demand+lru"][:2 * repeats]
    ref = reference(bundle)
    assert rep["tokens_identical"] is True and all(x["tokens"] == ref for x in rep["runs"])
    assert rep["pinned_cpus"] == [6, 7] and "posix_fadvise" in rep["cache"] and "drop_caches" not in rep["cache"]
    for x in rep["runs"]:
        assert x["tpot_ms"] > 0 and x["before"]["temps_c"] and x["after"]["meminfo"]["MemAvailable"] > 0
        assert x["before"]["time_in_state"] and x["cooldown"]["timed_out"] is False
    s = rep["summary"]
    assert s["on-demand+lru"]["runs"] == repeats and s["next-gate+prediction"]["hit_rate"]["median"] > \
        s["on-demand+lru"]["hit_rate"]["median"]
    assert out.with_suffix(".md").is_file() and out.with_suffix(".png").stat().st_size > 1000
    # every run's JSON was written on the device, in this bench's own directory, and pulled
    runs = phone.host_path(rep["remote_runs"])
    assert runs.parent == host / "runs" and len(list(runs.glob("*.json"))) == 2 * repeats + 1  # and the warm-up's
    return rep


@pytest.mark.slow  # ~30 s: the whole list -> push -> bench flow (make test-all); the failure paths stay in make test
def test_list_push_bench_on_the_standin(native_host, phones, tmp_path):
    bundle, _ = native_host  # the x86_64 stand-in gets this build (the session's runner cache)
    flow(bundle, phones(), tmp_path)


def test_no_device_several_devices_and_unauthorized(native_host, phones, server):
    bundle, _ = native_host
    one_line_error(cli("push", bundle), "no device attached")  # through the CLI: one line, no traceback
    a, b = phones(), phones()  # the rest in-process (the same code under the CLI)
    with pytest.raises(SpecPrefetchError, match="several devices attached"):
        push(bundle, None, log=lambda s: None)
    with pytest.raises(SpecPrefetchError, match="no such device"):
        push(bundle, "127.0.0.1:1", log=lambda s: None)
    server.adb("disconnect", a.serial, check=False)
    server.adb("disconnect", b.serial, check=False)
    c = phones(state="unauthorized", faults={"unauthorized": True})
    with pytest.raises(SpecPrefetchError, match="unauthorized: unlock the phone"):
        push(bundle, c.serial, log=lambda s: None)
    assert {d["serial"]: d["state"] for d in list_devices()}[c.serial] == "unauthorized"


def test_image_prompts_need_a_bundle_that_takes_images(native_host, tmp_path):
    """`device bench --image` on a text-only bundle is refused in one line before any phone is chosen."""
    import numpy as np
    from PIL import Image

    bundle, _ = native_host
    img = tmp_path / "a.png"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(img)
    with pytest.raises(SpecPrefetchError, match=r"^--image: .* takes no images \(a text-only bundle\)$"):
        bench(bundle, serial="none", policies=["on-demand+lru"], pool_mib=2.0, prompts=[PROMPT], max_new_tokens=4,
              repeats=1, json_out=tmp_path / "r.json", images=[img], log=lambda s: None)
    assert not (tmp_path / "r.json").exists()


def test_full_disk_is_refused_before_sending(native_host, phones):
    bundle, _ = native_host
    p = phones(faults={"full_disk": True})
    with pytest.raises(SpecPrefetchError, match="no space left"):
        push(bundle, p.serial, log=lambda s: None)


def test_device_list_shows_a_full_disk_as_0(phones):
    p = phones(faults={"full_disk": True})
    (d,) = [x for x in list_devices() if x["serial"] == p.serial]
    assert d["free_bytes_data_local_tmp"] == 0
    line = next(ln for ln in states_table([d]).splitlines() if ln.startswith(p.serial))
    assert "free 0 MiB under /data/local/tmp" in line and "?" not in line, line


def _bench(bundle, p, out, policies, **kw):
    return bench(bundle, serial=p.serial, policies=policies, pool_mib=2.0, prompts=[PROMPT], max_new_tokens=3,
                 repeats=1, json_out=out, cooldown_timeout_s=2, log=lambda s: None, **kw)


def test_runner_failure_is_recorded_and_the_bench_goes_on(native_host, phones, tmp_path):
    """The runner crashes on the phone in one run (its launcher there replaced by one that fails,
    after the first run, and put back once the failure is logged): recorded, and the runs after it
    are measured. (What the runner would refuse up front is refused before the push:
    tests/test_device_bench.py.)"""
    bundle, _ = native_host
    p = phones()
    launcher = p.host_path(f"{ROOT}/{bundle_hash(bundle)}/runner/run.sh")
    kept: list[str] = []

    def log(line: str) -> None:
        if line.startswith("  on-demand+lru prompt 0 #1"):
            kept.append(launcher.read_text())
            launcher.write_text('echo "specprefetch-runner: crashed (a test)" >&2\nexit 1\n')
        elif "runner exited" in line:
            launcher.write_text(kept[0])

    with pytest.raises(SpecPrefetchError, match=r"1 of 4 runs failed \(first: next-gate\+prediction, exit 1: "
                                                r"specprefetch-runner: crashed"):
        bench(bundle, serial=p.serial, policies=POLICIES.split(","), pool_mib=2.0, prompts=[PROMPT],
              max_new_tokens=3, repeats=2, json_out=tmp_path / "crash.json", cooldown_timeout_s=2, log=log)
    rep = json.loads((tmp_path / "crash.json").read_text())
    (f,) = rep["failures"]
    assert f["config"] == "next-gate+prediction" and f["exit_code"] == 1 and "crashed" in f["stderr"]
    assert [x["config"] for x in rep["runs"]] == ["on-demand+lru", "next-gate+prediction", "on-demand+lru"]
    assert rep["status"] == "complete"


def test_device_lost_mid_bench_keeps_partial_results(native_host, phones, tmp_path):
    bundle, _ = native_host
    p = phones()
    # the link drops as the second configuration's run starts; the first run's results are kept
    p.set_faults(disconnect_after_s=0.0, disconnect_match="--policy next-gate+prediction")
    out = tmp_path / "lost.json"
    with pytest.raises(SpecPrefetchError, match=r"lost during .*partial results \(1 runs\)"):
        _bench(bundle, p, out, POLICIES.split(","))
    rep = json.loads(out.read_text())
    assert rep["status"] == "partial" and "lost" in rep["reason"] and len(rep["runs"]) == 1


@pytest.mark.slow
def test_list_push_bench_with_the_arm64_runner_under_qemu(native_host, phones, tmp_path):
    if not shutil.which("qemu-aarch64") or not shutil.which("aarch64-linux-gnu-g++"):
        pytest.skip("qemu-user / g++-aarch64-linux-gnu not installed (make setup installs them)")
    bundle, _ = native_host
    rep = flow(bundle, phones(abi="arm64-v8a"), tmp_path, repeats=1)
    # the best ISA the emulated CPU offers (qemu's default CPU has dotprod and i8mm)
    assert all(x["kernel_isa"] in ("neon", "neon_dotprod", "neon_i8mm") for x in rep["runs"])
    assert all(x["crc32_impl"] == "armv8-crc" for x in rep["runs"])


@pytest.mark.slow  # an ExecuTorch export of the tiny VL model (~40 s), then the flow with an image
def test_bench_image_prompts_on_the_standin(vl_bundle, phones, tmp_path):
    """`device bench --image`: the image goes to the bench's own directory on the phone, every run decodes it
    there and gives transformers' tokens for the same pixels."""
    import numpy as np
    from PIL import Image

    from export.images import BundleVision
    from toolkit.models.loader import load_image_processor

    img = tmp_path / "a picture.png"  # a space in the name: the phone gets its own
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (50, 70, 3), dtype=np.uint8)).save(img)
    phone = phones()
    out = tmp_path / "phone.json"
    r = cli("bench", vl_bundle, "--serial", phone.serial, "--policies", POLICIES, "--pool-mib", "0.06",
            "--prompt", PROMPT, "--image", img, "--max-new-tokens", NEW, "--repeats", 1, "--cooldown-timeout", "5",
            "--json", out)
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["status"] == "complete" and rep["failures"] == [] and rep["images"] == [str(img)]
    m = json.loads((vl_bundle / "manifest.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(vl_bundle / "model"), local_files_only=True)
    v = m["graphs"]["vision"]
    ids = [v["vision_start_token_id"], *[v["image_token_id"]] * v["tokens"], v["vision_end_token_id"],
           *tok(PROMPT, add_special_tokens=False)["input_ids"]]
    vision = BundleVision(None, v, load_image_processor(vl_bundle / "model"))
    ref = reference_tokens(Path(m["model"]["source"]), ids, NEW, images=[img], vision=vision)
    assert all(x["tokens"] == ref for x in rep["runs"]) and len(rep["runs"]) == 2
    assert len(list(phone.host_path(rep["remote_runs"]).glob("image-0.png"))) == 1
    assert rep["images_pushed_as"] == "the files"
    # an arm64 phone's runner is a cross build without PNG and JPEG decoders: the image goes as a PPM at the
    # bundle's size, resized here, and the runner (under qemu) gives the same tokens
    if not shutil.which("qemu-aarch64") or not shutil.which("aarch64-linux-gnu-g++"):
        pytest.skip("qemu-user / g++-aarch64-linux-gnu not installed (make setup installs them)")
    arm = phones(abi="arm64-v8a")
    rep = bench(vl_bundle, serial=arm.serial, policies=["on-demand+lru"], pool_mib=0.06, prompts=[PROMPT],
                max_new_tokens=NEW, repeats=1, json_out=tmp_path / "arm.json", images=[img], log=lambda s: None)
    assert rep["status"] == "complete" and rep["failures"] == [] and rep["images"] == [str(img)]
    assert rep["images_pushed_as"].startswith("PPMs at the bundle's image size")
    assert all(x["tokens"] == ref for x in rep["runs"]) and len(rep["runs"]) == 1
    (pushed,) = arm.host_path(rep["remote_runs"]).glob("image-0.*")
    assert pushed.suffix == ".ppm" and pushed.read_bytes().startswith(b"P6")


@pytest.mark.slow
def test_bench_with_llama_cpp_beside(native_host, phones, tmp_path):
    """`device bench --peer llama.cpp`: llama-bench (built here, the model converted to GGUF) pushed
    and run interleaved with the runner; its figures in the same report."""
    bundle, _ = native_host
    p = phones()
    out = tmp_path / "peer.json"
    rep = bench(bundle, serial=p.serial, policies=["on-demand+lru"], pool_mib=2.0, prompts=[PROMPT], max_new_tokens=4,
                repeats=2, json_out=out, cooldown_timeout_s=2, peer="llama.cpp", log=lambda s: None)
    assert rep["failures"] == [] and rep["configs"] == ["on-demand+lru", "llama.cpp"]
    peer = [x for x in rep["runs"] if x["config"] == "llama.cpp"]
    assert len(peer) == 2 and all(x["tpot_ms"] > 0 and x["ttft_ms"] > 0 for x in peer)
    gguf = p.host_path(rep["remote"]) / "peer" / "model.gguf"
    assert peer[0]["model_size"] > 0.9 * gguf.stat().st_size - 2**20
    assert [x["config"] for x in rep["runs"]] == ["on-demand+lru", "llama.cpp", "llama.cpp", "on-demand+lru"]
    assert rep["summary"]["llama.cpp"]["runs"] == 2 and rep["tokens_identical"] is True


def test_a_store_that_does_not_match_its_manifest_is_named(native_host, phones, tmp_path):
    """Opening a bundle to run it skips hashing the store; push checks it on the device and names a
    local store whose bytes are not the manifest's (instead of re-sending it forever)."""
    bundle, _ = native_host
    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    with open(b / "experts.spx", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    p = phones()
    with pytest.raises(SpecPrefetchError, match="experts.spx: its sha256 is not the one"):
        push(b, p.serial, log=lambda s: None)


@pytest.fixture
def qnn_env(qnn_native, monkeypatch):
    """The CLI finds qnn_native's runner in its cache (the same headers: the same configuration)."""
    from prebuild import user_ort_headers

    monkeypatch.setenv("SPX_ORT_INCLUDE", str(user_ort_headers()))
    monkeypatch.setenv("SPECPREFETCH_PROFILES", str(qnn_native[1].parent.parent / "profiles"))
    return qnn_native


@pytest.mark.slow  # ~40 s: the HTP simulator runs every graph call
def test_list_push_bench_a_qnn_bundle_on_the_standin(qnn_env, phones, tmp_path):
    """A qnn bundle through the same flow: its ONNX Runtime runner (the host build, with its lib/)
    pushed and checked, the bench's runs on the HTP (the simulator here) with the unmodified model's
    tokens, and each run's backend and HTP calls in the report."""
    bundle, runner = qnn_env
    p = phones()
    rep = flow(bundle, p, tmp_path, repeats=1)
    remote = p.host_path(rep["remote"])
    assert (remote / "runner" / "lib" / "libonnxruntime.so.1").read_bytes()[:4] == b"\x7fELF"
    for x in rep["runs"]:
        assert x["backend"] == "onnxruntime-qnn" and x["decode_graph_calls_per_token"] == 9.0, x
        assert x["prefill_graph_calls"] == 8 * len(x["prefill_chunks"]) + 1, x


def test_a_qnn_bundle_for_a_phone_needs_the_users_libraries(qnn_env, phones, monkeypatch, tmp_path):
    """An arm64-v8a phone gets a qnn bundle's Android build, which needs the user's ONNX Runtime and QNN
    libraries: without them, one line naming SPX_QNN_LIBS, nothing sent, and a bench refused before it
    takes the phone."""
    monkeypatch.delenv("SPX_QNN_LIBS", raising=False)
    p = phones(abi="arm64-v8a")
    with pytest.raises(SpecPrefetchError, match="set SPX_QNN_LIBS to a directory holding libonnxruntime.so"):
        push(qnn_env[0], p.serial, log=lambda s: None)
    assert not p.host_path(ROOT).exists() or not any(p.host_path(ROOT).rglob("manifest.json"))
    import toolkit.device.phone as phone

    def taken(*a, **kw):
        raise AssertionError("the phone was taken before the build's requirements were checked")

    monkeypatch.setattr(phone, "lock_phone", taken)
    with pytest.raises(SpecPrefetchError, match="set SPX_QNN_LIBS"):  # bench: before the phone is taken
        _bench(qnn_env[0], p, tmp_path / "b.json", ["on-demand+lru"])
    assert not p.host_path(LOCK).exists() and not (tmp_path / "b.json").exists()
