"""`specprefetch device list | push | bench`: a bundle and its native runner on a phone over adb
(docs/device.md).

    list    every attached device: serial, state, SoC, ABI, RAM, free space under
            /data/local/tmp, CPU clusters, whether /data is mounted with inlinecrypt
    push    the runner built for the device's ABI and the bundle to
            /data/local/tmp/specprefetch/<bundle hash>/, sending only files whose sha256 differs,
            then checking every file's sha256 on the device
    bench   policies interleaved on the phone, cold cache, pinned to the big cores, with a
            thermal and memory cool-down gate between runs; every run's JSON pulled back; a
            report (table, PNG, JSON) in the shape of `bench cpu` here. Everything the runner
            would refuse (and the report's path) is checked here first, before any push; one
            bench at a time holds the phone (a lock directory on it), and each keeps its runs'
            files in a directory of its own there
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from toolkit.device.adb import Adb, DeviceLost, choose, devices, q
from toolkit.artifacts import sha256_file
from toolkit.errors import SpecPrefetchError
from toolkit.jsonvalues import is_int, is_number

ROOT = "/data/local/tmp/specprefetch"
# the device ABI -> the runner build that starts there (x86_64: an emulator, or the stand-in on
# this machine, which runs the host build)
RUNNER_ABI = {"arm64-v8a": "arm64", "x86_64": "host"}
# a qnn / qai-hub bundle's runner (ONNX Runtime with the QNN execution provider): on a phone an
# Android (NDK) build with the user's ONNX Runtime and QNN libraries beside it (docs/runner.md)
ORT_RUNNER_ABI = {"arm64-v8a": "android", "x86_64": "host"}
RUNNER_FILES = ("run.sh", "bin/specprefetch-runner", "bin/check_bundle")
# one bench at a time on a phone: a directory made with mkdir (atomic), holding token, owner,
# started and heartbeat (docs/device.md, "One bench at a time")
LOCK = f"{ROOT}/bench.lock"
RUNNER_MAX_THREADS = 256  # the native runner's own limit for --threads
EVICTIONS = ("lru", "lfu", "prediction", "belady", "reuse")  # the native runner's eviction policies

_FACTS = r"""
echo @props; getprop ro.soc.model; getprop ro.soc.manufacturer; getprop ro.product.model; getprop ro.product.cpu.abi
echo @meminfo; cat /proc/meminfo
echo @df; df -k /data/local/tmp
echo @mounts; cat /proc/mounts
echo @cpus; for c in /sys/devices/system/cpu/cpu[0-9]*; do
  echo "${c##*/} $(cat $c/cpufreq/cpuinfo_max_freq 2>/dev/null) $(cat $c/cpufreq/related_cpus 2>/dev/null)"; done
echo @id; id -u
"""

_SNAPSHOT = r"""
echo @thermal; for z in /sys/class/thermal/thermal_zone*; do
  echo "$(cat $z/type 2>/dev/null) $(cat $z/temp 2>/dev/null)"; done
echo @meminfo; cat /proc/meminfo
echo @freq; for c in /sys/devices/system/cpu/cpu[0-9]*; do
  echo "@cpu ${c##*/}"; cat $c/cpufreq/stats/time_in_state 2>/dev/null; done
"""


def _sections(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        if line.startswith("@") and " " not in line.strip():
            cur = line.strip()[1:]
            out[cur] = []
        elif cur is not None:
            out[cur].append(line)
    return out


def _meminfo(lines: list[str]) -> dict[str, int]:
    out = {}
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
            out[parts[0][:-1]] = int(parts[1]) * 1024
    return out


def _cpu_list(text: str) -> list[int]:
    cpus = []
    for tok in text.replace(",", " ").split():
        if "-" in tok:
            a, b = tok.split("-", 1)
            cpus += list(range(int(a), int(b) + 1))
        elif tok.isdigit():
            cpus.append(int(tok))
    return cpus


def facts(adb: Adb) -> dict[str, Any]:
    """What `device list` shows of one ready device (one shell round trip)."""
    s = _sections(adb.text(_FACTS))
    props = (s.get("props", []) + [""] * 4)[:4]
    mem = _meminfo(s.get("meminfo", []))
    free = None
    for line in s.get("df", [])[1:]:
        parts = line.split()
        if len(parts) >= 4 and parts[3].isdigit():
            free = int(parts[3]) * 1024
    data = [ln.split() for ln in s.get("mounts", []) if len(ln.split()) >= 4 and ln.split()[1] == "/data"]
    clusters: dict[tuple[int, ...], int] = {}
    for line in s.get("cpus", []):
        parts = line.split()
        if len(parts) >= 3 and parts[1].isdigit():
            clusters[tuple(_cpu_list(" ".join(parts[2:])))] = int(parts[1])
    return {"serial": adb.serial, "state": "device", "soc": props[0] or None, "soc_manufacturer": props[1] or None,
            "model": props[2] or None, "abi": props[3] or None, "ram_bytes": mem.get("MemTotal"),
            "mem_available_bytes": mem.get("MemAvailable"), "free_bytes_data_local_tmp": free,
            "data_fs": data[0][2] if data else None,
            "inlinecrypt": ("inlinecrypt" in data[0][3].split(",")) if data else None,
            "clusters": [{"cpus": list(c), "max_khz": f} for c, f in sorted(clusters.items(), key=lambda x: x[1])],
            "root": (s.get("id") or [""])[0].strip() == "0",
            "sm8750": props[0] == "SM8750"}


def list_devices() -> list[dict[str, Any]]:
    out = []
    for d in devices():
        if d.state != "device":
            out.append({"serial": d.serial, "state": d.state, **{k: d.attrs[k] for k in ("model",) if k in d.attrs}})
            continue
        try:
            out.append(facts(Adb(d.serial)))
        except SpecPrefetchError as e:  # one device that does not answer does not hide the others
            out.append({"serial": d.serial, "state": "lost" if isinstance(e, DeviceLost) else "not answering",
                        "error": str(e)})
    return out


# ---------------------------------------------------------------------------------------- push

def bundle_hash(bundle: Path) -> str:
    """The bundle's identity on the device: its manifest (which lists every file's sha256)."""
    return hashlib.sha256((Path(bundle) / "manifest.json").read_bytes()).hexdigest()[:16]


def _local_files(bundle: Path, runner: Path) -> dict[str, Path]:
    """remote path (relative to the bundle's device directory) -> local file."""
    files = {f"bundle/{p.relative_to(bundle)}": p for p in sorted(Path(bundle).rglob("*")) if p.is_file()}
    for rel in RUNNER_FILES:
        files[f"runner/{rel}"] = runner / rel
    for p in sorted((runner / "lib").glob("*")) if (runner / "lib").is_dir() else []:
        files[f"runner/lib/{p.name}"] = p
    return files


def _remote_hashes(adb: Adb, base: str, rels: Sequence[str], sizes: dict[str, int] | None = None) -> dict[str, str]:
    out: dict[str, str] = {}
    for i in range(0, len(rels), 64):  # keep each command line short
        chunk = rels[i:i + 64]
        # time for the phone to hash what is there: 2 minutes, plus a slow 20 MB/s for the bytes
        nbytes = sum((sizes or {}).get(x, 0) for x in chunk)
        r = adb.shell(f"cd {q(base)} 2>/dev/null && sha256sum {' '.join(q(x) for x in chunk)} 2>/dev/null",
                      check=False, timeout=120 + nbytes / 20e6)
        for line in r.stdout.decode(errors="replace").splitlines():
            parts = line.split(None, 1)
            if len(parts) == 2 and len(parts[0]) == 64:
                out[parts[1].strip().lstrip("*")] = parts[0]
    return out


def push(bundle: Path, serial: str | None = None, *, peer: str | None = None,
         log: Callable[[str], None] = print, beat: Callable[[], None] | None = None) -> dict[str, Any]:
    """The bundle and its runner (and with peer="llama.cpp", llama-bench and the model as GGUF) on
    the device, checked; returns where they are and what was sent. `beat` (a bench's lock
    heartbeat) is called before each file is sent and before the final check."""
    from android_runner.build import build
    from export.manifest import validate_bundle

    from android_runner.build import backend_of

    bundle = Path(bundle)
    manifest, _ = validate_bundle(bundle, hash_store=False)
    adb = choose(serial)
    f = facts(adb)
    # a qnn bundle's phone runner is the Android build with the user's ONNX Runtime and QNN libraries
    # (SPX_QNN_LIBS), which `build` names in one line when they are missing
    abi = (ORT_RUNNER_ABI if backend_of(manifest) == "ort" else RUNNER_ABI).get(f["abi"] or "")
    if abi is None:
        raise SpecPrefetchError(f"device {adb.serial}: ABI {f['abi']}; the runner is built for arm64-v8a "
                                "(and x86_64 for the stand-in)")
    runner = build(bundle, abi, log=log)
    base = f"{ROOT}/{bundle_hash(bundle)}"
    files = _local_files(bundle, runner)
    if peer is not None:
        files.update(_peer_files(bundle, manifest, abi, log))
    listed = {f"bundle/{k}": v["sha256"] for k, v in manifest.get("files", {}).items()
              if isinstance(v, dict) and "sha256" in v}
    log(f"hashing {len(files)} files here")
    want = {rel: listed.get(rel) or sha256_file(p) for rel, p in files.items()}
    sizes = {rel: p.stat().st_size for rel, p in files.items()}
    have = _remote_hashes(adb, base, list(files), sizes)
    send = [rel for rel in files if have.get(rel) != want[rel]]
    nbytes = sum(files[rel].stat().st_size for rel in send)
    free = f["free_bytes_data_local_tmp"]
    if free is not None and nbytes > free:
        raise SpecPrefetchError(f"device {adb.serial}: {nbytes / 2**20:.1f} MiB to send, {free / 2**20:.1f} MiB free "
                                f"under /data/local/tmp: no space left")
    log(f"{adb.serial}: sending {len(send)} of {len(files)} files ({nbytes / 2**20:.1f} MiB) to {base}")
    dirs = sorted({str(Path(base, rel).parent) for rel in send})
    if dirs:
        adb.shell("mkdir -p " + " ".join(q(d) for d in dirs))
    for rel in send:
        if beat is not None:
            beat()
        adb.push(files[rel], f"{base}/{rel}")
    if beat is not None:
        beat()
    adb.shell(f"chmod 755 {q(base)}/runner/run.sh {q(base)}/runner/bin/* {q(base)}/runner/lib/* "
              f"{q(base)}/peer/llama-bench {q(base)}/peer/*.so* 2>/dev/null; true", check=False)
    got = _remote_hashes(adb, base, list(files), sizes)
    bad = [rel for rel in files if got.get(rel) != want[rel]]
    for rel in bad:  # the device holds what was sent, but that is not what the manifest lists
        if rel in listed and got.get(rel) == sha256_file(files[rel]):
            raise SpecPrefetchError(f"{files[rel]}: its sha256 is not the one {bundle / 'manifest.json'} lists "
                                    "(a damaged bundle: `specprefetch inspect` it, or export it again)")
    if bad:
        raise SpecPrefetchError(f"device {adb.serial}: {len(bad)} files differ after the push (first: {bad[0]}); "
                                "push again")
    log(f"{adb.serial}: every file checked (sha256) at {base}")
    return {"serial": adb.serial, "remote": base, "runner_abi": abi, "files": len(files), "sent": len(send),
            "bytes_sent": nbytes, "device": f}


def _peer_files(bundle: Path, manifest: dict, abi: str, log: Callable[[str], None]) -> dict[str, Path]:
    """llama-bench built for the device (arm64: static; the stand-in's x86_64: this machine's build
    with its shared libraries) and the bundle's source model converted to GGUF f16 (cached)."""
    from toolkit.peers import llamacpp

    from export.session import bundle_source

    found = bundle_source(Path(bundle), manifest)   # the weights the bundle's store was built from
    src = found.model
    if src is None:
        raise SpecPrefetchError(f"--peer llama.cpp: {found.problem} "
                                "(llama.cpp converts the bundle's source model to GGUF)")
    from toolkit.peers.sidebyside import model_label

    bin_dir = llamacpp.build("arm64" if abi in ("arm64", "android") else "host", log=log)  # static: runs on Android
    gguf = llamacpp.cached_gguf(src, model_label(src, set()), log=log)  # the side by side's GGUF of it, too
    files = {"peer/llama-bench": bin_dir / "llama-bench", "peer/model.gguf": gguf}
    for so in sorted(bin_dir.glob("*.so*")):  # a shared-library build (host) needs its libraries beside it
        files[f"peer/{so.name}"] = so
    return files


def _timed(adb: Adb, run_dir: str, cmd: str, timeout_s: float) -> Any:
    """`cmd` on the device in a shell that records its pid (in this bench's own `run_dir`) and then
    becomes the command, so that a run past `timeout_s`, or one whose bench is interrupted here, is
    killed there (not left running into the next run)."""
    pidfile = f"{run_dir}/run.pid"
    wrapped = f"mkdir -p {q(run_dir)} && sh -c {q(f'echo $$ > {q(pidfile)}; exec {cmd}')}"
    kill = f"kill -9 $(cat {q(pidfile)}) 2>/dev/null; true"
    try:
        return adb.shell(wrapped, timeout=timeout_s, check=False)
    except DeviceLost:
        raise
    except KeyboardInterrupt:  # Ctrl-C / SIGTERM here: the run on the phone goes too
        try:
            adb.shell(kill, check=False, timeout=20)
        except (SpecPrefetchError, KeyboardInterrupt):
            pass
        raise
    except SpecPrefetchError:
        adb.shell(kill, check=False, timeout=60)
        raise SpecPrefetchError(f"a run on {adb.serial} took more than {timeout_s:.0f} s and was killed "
                                "(--run-timeout)") from None


def _llama_bench(adb: Adb, base: str, run_dir: str, mask: str | None, n_prompt: int, n_gen: int, threads: int,
                 timeout_s: float) -> dict[str, Any]:
    """One llama-bench run on the device (prompt processing of n_prompt tokens, then n_gen generated
    tokens; llama-bench's own synthetic tokens), its JSON parsed: TTFT ~ the prompt's processing,
    TPOT = generation time / n_gen."""
    cmd = ((f"taskset {mask} " if mask else "")
           + f"env LD_LIBRARY_PATH={q(base)}/peer $SPX_EMULATOR {q(base)}/peer/llama-bench "
           f"-m {q(base)}/peer/model.gguf -p {n_prompt} -n {n_gen} -t {threads} -r 1 --no-warmup -o json")
    t0 = time.monotonic()
    r = _timed(adb, run_dir, cmd, timeout_s)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        err = r.stderr.decode(errors="replace").strip().splitlines()
        return {"error": True, "exit_code": r.returncode, "stderr": "\n".join(err[-20:])}
    try:
        tests = json.loads(r.stdout.decode(errors="replace"))
        pp = next(t for t in tests if t["n_prompt"] > 0 and t["n_gen"] == 0)
        tg = next(t for t in tests if t["n_gen"] > 0 and t["n_prompt"] == 0)
    except (ValueError, StopIteration, KeyError, TypeError):
        return {"error": True, "exit_code": 0, "stderr": "llama-bench printed no usable JSON: "
                + r.stdout.decode(errors="replace")[-300:]}
    return {"ttft_ms": round(pp["avg_ns"] / 1e6, 4), "tpot_ms": round(tg["avg_ns"] / 1e6 / n_gen, 4),
            "prompt_tokens_per_s": pp["avg_ts"], "tokens_per_s": tg["avg_ts"], "model_size": pp.get("model_size"),
            "llama_build": pp.get("build_number"), "wall_s": round(wall, 3)}


# ------------------------------------------------------------------------- bench: the phone's lock

def _hostname() -> str:
    return socket.gethostname() or "localhost"


def _alive(pid: int) -> bool:
    """Whether process `pid` of this machine exists."""
    if pid == os.getpid():
        return True
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:  # it exists, as another user's
        return True
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    return True


@dataclasses.dataclass
class PhoneLock:
    """The phone held by one `device bench` (LOCK on the device). `beat` records that the owner is
    alive, and fails when the lock is no longer this bench's; `release` removes it if it is still ours."""
    adb: Adb
    token: str
    path: str = LOCK

    def _ours(self) -> str:
        return f"[ \"$(cat {q(self.path)}/token 2>/dev/null)\" = {q(self.token)} ]"

    def beat(self) -> None:
        r = self.adb.shell(f"{self._ours()} && date +%s > {q(self.path)}/heartbeat && echo @ours", check=False,
                           timeout=60)
        if "@ours" not in r.stdout.decode(errors="replace"):
            raise SpecPrefetchError(f"device {self.adb.serial}: this bench's lock {self.path} was removed or taken "
                                    "by another bench; its results stop here")

    def release(self) -> None:
        try:
            self.adb.shell(f"if {self._ours()}; then rm -rf {q(self.path)}; fi", check=False, timeout=30)
        except (SpecPrefetchError, KeyboardInterrupt):
            pass  # a lost device (or a second Ctrl-C): the lock is stale now, and the next bench takes it over


def _lock_state(out: str) -> dict[str, Any]:
    s = _sections(out)
    first = lambda k: next((ln.strip() for ln in s.get(k, []) if ln.strip()), "")  # noqa: E731
    num = lambda k: int(first(k)) if first(k).isdigit() else None  # noqa: E731
    try:
        owner = json.loads(first("owner")) if first("owner") else None
    except ValueError:
        owner = None
    return {"token": first("token"), "owner": owner if isinstance(owner, dict) else None,
            "started": num("started"), "heartbeat": num("heartbeat"), "mtime": num("mtime"), "now": num("now")}


def _stale(held: dict[str, Any]) -> str | None:
    """Why a held lock is stale (its owner is gone), or None while its owner may be alive. Times are
    the phone's own clock (`date +%s` there), so the clocks of the hosts do not matter."""
    now, owner = held["now"], held["owner"]
    if owner is None:  # a lock being made (mkdir, then its files) or left half made
        age = now - held["mtime"] if now is not None and held["mtime"] is not None else None
        return f"it has no owner and is {age} s old" if age is not None and age > 120 else None
    pid, host = owner.get("pid"), owner.get("host")
    if host == _hostname() and is_int(pid) and not _alive(pid):
        return f"its owner, process {pid} on {host}, is gone"
    beat = held["heartbeat"] or held["started"] or held["mtime"]
    limit = owner.get("stale_after_s")
    if now is not None and beat is not None and is_number(limit) and now - beat > limit:
        return f"its owner (process {pid} on {host}) has given no sign of life for {now - beat} s"
    return None


def lock_phone(adb: Adb, *, stale_after_s: float, what: str, log: Callable[[str], None] = print) -> PhoneLock:
    """Hold the phone for one bench: mkdir LOCK (atomic on the device), with its owner (pid, host,
    what it runs, how long it may go without a heartbeat). A lock whose owner is gone (a process of
    this host that no longer exists, or no heartbeat for longer than its owner said) is taken over;
    a live one is a one-line refusal naming its owner."""
    token = secrets.token_hex(8)
    owner = json.dumps({"pid": os.getpid(), "host": _hostname(), "what": what, "stale_after_s": round(stale_after_s)},
                       separators=(",", ":"))
    L = q(LOCK)
    take = (f"mkdir -p {q(ROOT)} && if mkdir {L} 2>/dev/null; then printf '%s\\n' {q(token)} > {L}/token && "
            f"printf '%s\\n' {q(owner)} > {L}/owner && date +%s > {L}/started && date +%s > {L}/heartbeat && "
            f"echo @acquired; else echo @held; echo @token; cat {L}/token; echo @owner; cat {L}/owner; "
            f"echo @started; cat {L}/started; echo @heartbeat; cat {L}/heartbeat; echo @mtime; stat -c %Y {L}; "
            f"echo @now; date +%s; fi 2>/dev/null")
    for _ in range(3):
        out = adb.text(take, timeout=60)
        if "@acquired" in out.splitlines():
            lock = PhoneLock(adb, token)
            lock.beat()  # reads our own token back: the lock is ours
            return lock
        held = _lock_state(out)
        why = _stale(held)
        if why is None:
            o = held["owner"] or {}
            since = (f", started {held['now'] - held['started']} s ago"
                     if held["now"] is not None and held["started"] is not None else "")
            who = (f"another `device bench` (process {o.get('pid')} on {o.get('host')}{since}: {o.get('what')})"
                   if o else "another `device bench` (it is starting)")
            raise SpecPrefetchError(f"device {adb.serial} is busy: {who} holds {LOCK}; wait for it to finish "
                                    f"(if it is gone: adb -s {adb.serial} shell rm -r {LOCK})")
        # take it over: only if it is still the lock judged stale, by a rename (atomic) out of the way
        gone = f"{LOCK}.stale-{token}"
        adb.shell(f"[ \"$(cat {L}/token 2>/dev/null)\" = {q(held['token'])} ] && mv {L} {q(gone)} && "
                  f"rm -rf {q(gone)}; true", check=False, timeout=60)
        log(f"{adb.serial}: took over a stale bench lock ({why})")
    raise SpecPrefetchError(f"device {adb.serial} is busy: {LOCK} keeps being taken; try again")


# ---------------------------------------------------------------------------- bench: host-side checks

def check_report_out(json_out: Path, inputs: Sequence[Path] = ()) -> None:
    """The report (OUT, OUT.md, OUT.png) can be written at `json_out`: checked before any work, so
    that a bench does not fail only after its whole run (toolkit.reporting.write_report writes the
    three beside each other, under temporary names first). Nothing is left behind."""
    out = Path(json_out)
    if out.exists() and not out.is_file() and not out.is_dir():  # a FIFO or a device (/dev/null): written in place
        return
    for f in (out, out.with_suffix(".md"), out.with_suffix(".png")):
        if f.is_dir():
            raise SpecPrefetchError(f"--json {out}: {f} is a directory; the report (OUT, OUT.md, OUT.png) needs "
                                    "file names there")
    o = out.resolve()
    for inp in inputs:
        i = Path(inp).resolve()
        if o == i or o.is_relative_to(i):
            raise SpecPrefetchError(f"--json {out} is inside {inp}, which is an input of this command; write "
                                    "elsewhere")
    parent = next(p for p in (out.absolute().parent, *out.absolute().parents) if p.exists() or p == p.parent)
    if not parent.is_dir():
        raise SpecPrefetchError(f"--json {out}: {parent} is a file, not a directory, so the report cannot be written")
    try:  # a file made and removed where the report's temporary files will go (or its first existing parent)
        fd, probe = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".probe", dir=parent)
    except OSError as e:
        reason = (e.strerror or type(e).__name__).lower()
        raise SpecPrefetchError(f"--json {out}: cannot write in {parent} ({reason})") from None
    os.close(fd)
    os.unlink(probe)


def native_predictors(bundle: Path, manifest: dict[str, Any]) -> list[str]:
    """The predictors the native runner offers for this bundle (android_runner/src/runner.cpp,
    Runner::predictors): on-demand, previous-token and oracle; the bundle's graph predictor when it
    has prediction heads; next-gate and fate when its host file holds the routers."""
    out = ["on-demand", "previous-token", "oracle"]
    pred = manifest.get("predictor") or {}
    if pred.get("preds_rows") and pred.get("kind"):
        out.append(pred["kind"])
    host = manifest.get("host_file")
    if host:
        from safetensors import safe_open

        try:
            with safe_open(str(Path(bundle) / host), framework="numpy") as f:
                routers = "router_weight" in f.keys()
        except Exception as e:  # noqa: BLE001 - the runner refuses such a file too
            raise SpecPrefetchError(f"{Path(bundle) / host}: not a readable safetensors file ({e})") from None
        if routers:
            out += [p for p in ("next-gate", "fate") if p not in out]
    return out


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".ppm")
# the runner builds with no PNG or JPEG decoder (no libpng or libjpeg-turbo for their targets here): device
# bench pushes them each image as a PPM at the bundle's size, resized on the host (export/images.py)
PPM_ONLY_RUNNERS = ("arm64",)


def check_bench(bundle: Path, *, policies: Sequence[str], pool_mib: float, prompts: Sequence[str],
                max_new_tokens: int, threads: int, json_out: Path, peer: str | None,
                images: Sequence[Path] = ()) -> tuple[dict, list[list[int]]]:
    """Everything the native runner on the phone would refuse, and the report's path, checked here
    before any push: (the bundle's manifest, the prompts' token ids). The manifest gives top-k, the
    KV cache (kv.max_seq) and the predictors; the store its slot size; the bundle's tokenizer the
    prompts' lengths; `images` (before every prompt): the bundle takes them, each a PNG, JPEG or PPM within
    the size cap, and their tokens count in the KV cache."""
    from transformers import AutoTokenizer

    from export.manifest import validate_bundle
    from toolkit.runtime.expert_store import ExpertStore

    if peer not in (None, "llama.cpp"):
        raise SpecPrefetchError(f"--peer {peer}: the peer is llama.cpp")
    bundle = Path(bundle)
    m, _ = validate_bundle(bundle, hash_store=False)
    check_report_out(json_out, [bundle])
    if not policies:
        raise SpecPrefetchError("--policies: give at least one PREDICTOR+EVICTION")
    if not is_int(threads) or not 1 <= threads <= RUNNER_MAX_THREADS:
        raise SpecPrefetchError(f"--threads {threads}: the runner takes 1..{RUNNER_MAX_THREADS}")
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise SpecPrefetchError(f"--max-new-tokens {max_new_tokens}: must be >= 1")
    have = native_predictors(bundle, m)
    for name in policies:
        pred, _, evict = str(name).partition("+")
        if pred not in have:
            raise SpecPrefetchError(f"--policies {name}: predictor '{pred}' is not available in the native runner "
                                    f"for {bundle} (available: {', '.join(have)})")
        if (evict or "lru") not in EVICTIONS:
            raise SpecPrefetchError(f"--policies {name}: unknown eviction '{evict}'; the native runner has "
                                    f"{', '.join(EVICTIONS)}")
        if evict == "reuse" and m["predictor"].get("reuse") is None:
            raise SpecPrefetchError(f"--policies {name}: {bundle / 'manifest.json'} has no reuse table "
                                    "(predictor.reuse): train the adapter with this version and export again")
    k = int(m["routing"]["top_k"])
    slot = ExpertStore(bundle / m["runtime"]["expert_store"]).slot_bytes
    if not (isinstance(pool_mib, (int, float)) and 0 < pool_mib < 1e12):
        raise SpecPrefetchError(f"--pool-mib {pool_mib}: must be a positive number")
    capacity = int(pool_mib * 2**20) // slot
    if capacity < k:
        raise SpecPrefetchError(f"--pool-mib {pool_mib:g}: holds {capacity} expert slots of {slot / 2**10:.0f} KiB, "
                                f"but one layer needs {k} at once; use at least {k * slot / 2**20:.2f}")
    if not prompts:
        raise SpecPrefetchError("--prompt: give at least one")
    image_tokens = 0
    if images:
        from toolkit.traces.data import open_image

        vision = m["graphs"].get("vision")
        if vision is None or peer:
            raise SpecPrefetchError(f"--image: {bundle} takes no images (a text-only bundle)" if vision is None else
                                    "--image: llama.cpp (--peer) runs text prompts; bench image prompts without it")
        for img in images:
            open_image(img)  # readable, PNG, JPEG or PPM, within the pixel cap: what the runner on the phone takes
        image_tokens = len(images) * (int(vision["tokens"]) + 2)
    tok = AutoTokenizer.from_pretrained(str(bundle / Path(m["model"]["config"]).parent), local_files_only=True)
    ids = [list(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    max_seq = int(m["kv"]["max_seq"])
    for i, (p, x) in enumerate(zip(prompts, ids)):
        which = (f"--prompt {json.dumps(p, ensure_ascii=False)[:60]}"
                 + (f" (prompt {i + 1})" if len(prompts) > 1 else ""))
        if not x:
            raise SpecPrefetchError(f"{which}: no tokens (an empty prompt); give some text")
        if image_tokens + len(x) + max_new_tokens - 1 > max_seq:
            room = max_seq - image_tokens - len(x) + 1
            raise SpecPrefetchError(f"{which}: " + (f"{image_tokens} image tokens + " if image_tokens else "") +
                                    f"{len(x)} tokens + --max-new-tokens {max_new_tokens} exceeds the "
                                    f"bundle's KV cache of {max_seq} positions (kv.max_seq in "
                                    f"{bundle / 'manifest.json'})" + (f"; at most --max-new-tokens {room} for it"
                                                                      if room >= 1 else "; shorten the prompt"))
    return m, ids


# ---------------------------------------------------------------------------------------- bench

def snapshot(adb: Adb) -> dict[str, Any]:
    """Temperatures (°C, per thermal zone), meminfo (bytes) and cpufreq time_in_state (10 ms units)."""
    s = _sections(adb.text(_SNAPSHOT, timeout=60))
    temps = {}
    for line in s.get("thermal", []):
        parts = line.rsplit(None, 1)
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            v = int(parts[1])
            temps[parts[0]] = v / 1000 if abs(v) > 200 else float(v)  # millidegrees on most kernels
    freq: dict[str, dict[str, int]] = {}
    cur = None
    for line in s.get("freq", []):
        if line.startswith("@cpu "):
            cur = line.split()[1]
            freq[cur] = {}
        elif cur is not None and len(line.split()) == 2:
            k, v = line.split()
            if k.isdigit() and v.isdigit():
                freq[cur][k] = int(v)
    return {"t": time.time(), "temps_c": temps, "meminfo": _meminfo(s.get("meminfo", [])), "time_in_state": freq}


def _hot(temps: dict[str, float]) -> float | None:
    cpu = [v for k, v in temps.items() if any(s in k.lower() for s in ("cpu", "soc", "skin", "tsens"))]
    vals = cpu or list(temps.values())
    return max(vals) if vals else None


def cool_down(adb: Adb, *, max_temp_c: float, min_available: int, timeout_s: float,
              poll_s: float = 2.0) -> dict[str, Any]:
    """Wait until the hottest CPU/SoC zone is at most max_temp_c and MemAvailable is at least
    min_available, or timeout_s passed (recorded, not an error)."""
    t0 = time.monotonic()
    while True:
        s = snapshot(adb)
        hot, avail = _hot(s["temps_c"]), s["meminfo"].get("MemAvailable")
        ok = (hot is None or hot <= max_temp_c) and (avail is None or avail >= min_available)
        waited = time.monotonic() - t0
        if ok or waited >= timeout_s:
            return {"waited_s": round(waited, 2), "timed_out": not ok, "temp_c": hot, "mem_available": avail}
        time.sleep(poll_s)


def _big_cores(f: dict[str, Any]) -> list[int]:
    if not f["clusters"]:
        return []
    top = max(c["max_khz"] for c in f["clusters"])
    return sorted(cpu for c in f["clusters"] if c["max_khz"] == top for cpu in c["cpus"])


def _stats(xs: list[float]) -> dict[str, float | None]:
    """Median, p5 and p95 of the defined values (toolkit.metrics: the benches' one median and percentile)."""
    from toolkit.metrics import median, percentile

    return {"median": median(xs), "p5": percentile(xs, 5), "p95": percentile(xs, 95)}


def bench(bundle: Path, *, serial: str | None, policies: Sequence[str], pool_mib: float, prompts: Sequence[str],
          max_new_tokens: int, repeats: int, json_out: Path, fixed_performance: bool = False, threads: int = 1,
          cooldown_timeout_s: float = 120.0, max_temp_c: float | None = None, peer: str | None = None,
          run_timeout_s: float = 900.0, images: Sequence[Path] = (),
          log: Callable[[str], None] = print) -> dict[str, Any]:
    """Policies interleaved on the phone; returns the report (also written: JSON, .md, .png). `images`
    go before every prompt (pushed into the bench's own directory on the phone).

    Checked here before anything reaches the phone (check_bench): the bundle, the report's path,
    the policies, --pool-mib against top-k, --threads, and every prompt's tokens against the KV
    cache. Then the phone is held (lock_phone: a second bench on it is refused, or takes over a
    stale lock) for the push and every run; each bench keeps its runs' files in its own directory
    there (runs/<invocation>/ beside the bundle).

    Whatever stops the bench after the push (a device lost mid-run, a run past run_timeout_s, an
    interrupt) keeps what was measured (status "partial", the reason recorded): an interrupt
    (Ctrl-C, SIGTERM) is then raised again as the KeyboardInterrupt it was (the CLI exits 130 /
    143), with a note naming the partial report; anything else is an error. A run that fails (a
    runner crash: exit code, stderr) is recorded and the bench goes on; failures make the command
    fail at the end, after the report is written."""
    from android_runner.build import backend_of, check_phone_build

    bundle = Path(bundle)
    m, ids = check_bench(bundle, policies=policies, pool_mib=pool_mib, prompts=prompts,
                         max_new_tokens=max_new_tokens, threads=threads, json_out=json_out, peer=peer,
                         images=images)
    adb = choose(serial)
    abi = facts(adb)["abi"]
    if backend_of(m) == "ort" and ORT_RUNNER_ABI.get(abi or "") == "android":
        check_phone_build(m)  # the user's QNN libraries and the NDK, before the phone is taken
    with tempfile.TemporaryDirectory(prefix="spx-images-") as tmp:
        pushed = list(images)
        if images and RUNNER_ABI.get(abi or "") in PPM_ONLY_RUNNERS:  # no PNG or JPEG decoder on the phone
            from export.images import write_fixed_size_ppm

            pushed = [write_fixed_size_ppm(x, m["graphs"]["vision"], Path(tmp) / f"image-{i}.ppm")
                      for i, x in enumerate(images)]
            log(f"the runner for {abi} has no PNG or JPEG decoder: each image goes as a PPM at the bundle's size, "
                "resized here (TTFT leaves out decoding and that resize)")
        lock = lock_phone(adb, stale_after_s=run_timeout_s + cooldown_timeout_s + 600,
                          what=f"{bundle.name}: {', '.join(policies)}", log=log)
        try:
            return _bench_held(lock, bundle, ids, policies=policies, pool_mib=pool_mib, prompts=prompts,
                               max_new_tokens=max_new_tokens, repeats=repeats, json_out=Path(json_out),
                               fixed_performance=fixed_performance, threads=threads,
                               cooldown_timeout_s=cooldown_timeout_s, max_temp_c=max_temp_c, peer=peer,
                               run_timeout_s=run_timeout_s, images=images, pushed_images=pushed, log=log)
        finally:
            lock.release()


def _bench_held(lock: PhoneLock, bundle: Path, ids: list[list[int]], *, policies: Sequence[str], pool_mib: float,
                prompts: Sequence[str], max_new_tokens: int, repeats: int, json_out: Path, fixed_performance: bool,
                threads: int, cooldown_timeout_s: float, max_temp_c: float | None, peer: str | None,
                run_timeout_s: float, log: Callable[[str], None], images: Sequence[Path] = (),
                pushed_images: Sequence[Path] | None = None) -> dict[str, Any]:
    """bench, on the phone `lock` holds. `pushed_images`: what goes to the phone for `images` (the files
    themselves, the default, or PPMs made of them for a runner without PNG and JPEG decoders)."""
    pushed_images = list(images if pushed_images is None else pushed_images)
    pushed = push(bundle, lock.adb.serial, peer=peer, log=log, beat=lock.beat)
    adb, f, base = Adb(pushed["serial"]), pushed["device"], pushed["remote"]
    invocation = (f"{time.strftime('%Y%m%d-%H%M%S')}-{re.sub(r'[^A-Za-z0-9._-]', '_', _hostname())[:40]}-"
                  f"{os.getpid()}-{lock.token[:6]}")
    run_dir = f"{base}/runs/{invocation}"  # this bench's own: its runs' JSON and run.pid
    big = _big_cores(f)
    mask = format(sum(1 << c for c in big), "x") if big else None
    configs = [{"name": p, "policy": p, "performance": False} for p in policies]
    if peer:  # llama.cpp as one more configuration, interleaved with the policies
        configs.append({"name": "llama.cpp", "policy": None, "performance": False, "peer": True})
    notes = []
    if fixed_performance:
        if f["root"]:
            configs += [{"name": f"{p}@performance", "policy": p, "performance": True} for p in policies]
        else:
            notes.append("fixed-performance mode needs root (cpufreq governors): not run")
    report: dict[str, Any] = {
        "bundle": str(bundle), "remote": base, "device": f, "policies": list(policies), "pool_mib": pool_mib,
        "peer": peer,
        "prompts": list(prompts), "max_new_tokens": max_new_tokens, "repeats": repeats, "threads": threads,
        "pinned_cpus": big,
        "cache": ("drop_caches (root), then the runner's posix_fadvise(DONTNEED) of its store" if f["root"] else
                  "the runner's posix_fadvise(DONTNEED) of its store (not root: llama.cpp's GGUF is not evicted)"),
        "configs": [c["name"] for c in configs], "runs": [], "failures": [], "notes": notes, "status": "complete",
        "reason": None, "remote_runs": run_dir, "images": [str(x) for x in images],
        "images_pushed_as": (None if not images else "the files" if list(pushed_images) == list(images) else
                             "PPMs at the bundle's image size, resized on the host (no PNG or JPEG decoder in "
                             "this phone's runner): TTFT leaves out decoding and that resize")}
    # the images in this bench's own directory on the phone, named by position (any local name is safe); kept
    # there with the runs' JSON, as their inputs
    remote_images = [f"{run_dir}/image-{i}{Path(x).suffix.lower() if Path(x).suffix.lower() in IMAGE_SUFFIXES else ''}"
                     for i, x in enumerate(pushed_images)]
    limit, min_avail = 0.0, 0
    governors: dict[str, str] = {}

    def prepare() -> None:
        nonlocal limit, min_avail
        adb.shell(f"mkdir -p {q(run_dir)}")
        for local, remote in zip(pushed_images, remote_images):
            adb.push(Path(local), remote)
        start = snapshot(adb)
        limit = max_temp_c if max_temp_c is not None else ((_hot(start["temps_c"]) or 40.0) + 3.0)
        min_avail = int(0.9 * (start["meminfo"].get("MemAvailable") or 0))
        report["cooldown"] = {"max_temp_c": limit, "min_mem_available": min_avail, "timeout_s": cooldown_timeout_s}
        if any(c["performance"] for c in configs):  # what to put back after each performance run
            for line in adb.text("for g in /sys/devices/system/cpu/cpufreq/policy*/scaling_governor; do "
                                 "echo \"$g $(cat $g)\"; done").splitlines():
                if len(line.split()) == 2:
                    governors[line.split()[0]] = line.split()[1]
            report["governors"] = governors

    def restore_governors() -> None:
        for g, v in governors.items():
            adb.shell(f"echo {q(v)} > {q(g)}", check=False)

    def one(cfg: dict, p: int, rep: int, warm: bool = False) -> None:
        lock.beat()  # still this bench's phone (and a sign of life for a bench that finds the lock)
        gate = cool_down(adb, max_temp_c=limit, min_available=min_avail, timeout_s=cooldown_timeout_s)
        if f["root"]:
            adb.shell("sync; echo 3 > /proc/sys/vm/drop_caches", check=False)
        if cfg["performance"]:
            for g in governors:
                adb.shell(f"echo performance > {q(g)}", check=False)
        try:
            _one(cfg, p, rep, warm, gate)
        finally:
            if cfg["performance"]:
                restore_governors()

    def _one(cfg: dict, p: int, rep: int, warm: bool, gate: dict) -> None:
        before = snapshot(adb)
        if cfg.get("peer"):
            res = _llama_bench(adb, base, run_dir, mask, len(ids[p]), max_new_tokens, threads, run_timeout_s)
            after = snapshot(adb)
            if warm and res.get("error"):  # as the runner's warm-up: the timed runs would fail the same way
                report["failures"].append({"config": cfg["name"], "prompt": p, "repeat": rep,
                                           "exit_code": res["exit_code"], "stderr": res["stderr"], "warm_up": True})
                raise SpecPrefetchError(f"the llama.cpp warm-up failed (llama-bench exit {res['exit_code']})")
            if warm:
                return
            if res.get("error"):
                report["failures"].append({"config": cfg["name"], "prompt": p, "repeat": rep,
                                           "exit_code": res["exit_code"], "stderr": res["stderr"]})
                log(f"  llama.cpp prompt {p}: llama-bench failed ({res['exit_code']})")
                return
            report["runs"].append({"config": "llama.cpp", "policy": "llama.cpp", "performance": False, "prompt": p,
                                   "repeat": rep, "tokens": None, **res, "cooldown": gate, "before": before,
                                   "after": after})
            log(f"  llama.cpp prompt {p} #{rep + 1}: TPOT {res['tpot_ms']} ms (llama-bench)")
            return
        remote_json = f"{run_dir}/{cfg['name'].replace('+', '_').replace('@', '_')}-{p}-{rep}.json"
        # push checked every file's sha256 on the device: no hashing here (it would read the whole
        # bundle through the page cache on the pinned cores just before the timed run)
        cmd = ((f"taskset {mask} " if mask else "")
               + f"sh {q(base)}/runner/run.sh {q(base)}/bundle --prompt-ids {','.join(map(str, ids[p]))} "
               f"--max-new-tokens {max_new_tokens} --policy {q(cfg['policy'])} --pool-mib {pool_mib!r} "
               f"--threads {threads} --json {q(remote_json)} --no-verify-hashes --cold"
               + "".join(f" --image {q(x)}" for x in remote_images))
        t0 = time.monotonic()
        r = _timed(adb, run_dir, cmd, run_timeout_s)
        wall = time.monotonic() - t0
        after = snapshot(adb)
        if cfg["performance"]:
            adb.shell("for g in /sys/devices/system/cpu/cpufreq/policy*/scaling_governor; do echo schedutil > $g; "
                      "done", check=False)
        if warm and r.returncode != 0:  # every timed run would fail as the warm-up did: stop, the reason kept
            err = r.stderr.decode(errors="replace").strip().splitlines()
            report["failures"].append({"config": cfg["name"], "prompt": p, "repeat": rep, "exit_code": r.returncode,
                                       "stderr": "\n".join(err[-20:]), "warm_up": True})
            raise SpecPrefetchError(f"the warm-up run failed (exit {r.returncode}: {err[-1] if err else 'no output'})")
        if warm:
            return
        if r.returncode != 0:
            err = r.stderr.decode(errors="replace").strip().splitlines()
            report["failures"].append({"config": cfg["name"], "prompt": p, "repeat": rep, "exit_code": r.returncode,
                                       "stderr": "\n".join(err[-20:])})
            log(f"  {cfg['name']} prompt {p}: runner exited {r.returncode}: {err[-1] if err else ''}")
            return
        try:
            with tempfile.TemporaryDirectory() as tmp:
                adb.pull(remote_json, Path(tmp) / "run.json")
                res = json.loads((Path(tmp) / "run.json").read_text())
                res["runs"][0]
        except DeviceLost:
            raise
        except (SpecPrefetchError, ValueError, KeyError, IndexError, TypeError) as e:
            report["failures"].append({"config": cfg["name"], "prompt": p, "repeat": rep, "exit_code": 0,
                                       "stderr": f"no usable result JSON: {e}"})
            return
        for run in res["runs"]:
            row = {"config": cfg["name"], "policy": res["policy"], "performance": cfg["performance"], "prompt": p,
                   "repeat": rep, **{k: v for k, v in run.items() if k not in ("routing", "source")},
                   **{k: res[k] for k in ("peak_rss_bytes", "load_ms", "kernel_isa", "direct_io", "io_note",
                                          "crc32_impl", "threads", "backend") if k in res},
                   "wall_s": round(wall, 3), "cooldown": gate, "before": before, "after": after}
            report["runs"].append(row)
            log(f"  {cfg['name']} prompt {p} #{rep + 1}: TPOT {run['tpot_ms']} ms, stall "
                f"{run['stall_ms_per_token']} ms/token, hit rate {run['hit_rate']:.3f}")

    interrupt: KeyboardInterrupt | None = None
    try:
        prepare()
        log(f"warm-up on {adb.serial}" + (f", pinned to CPUs {big}" if big else ""))
        one(configs[0], 0, -1, warm=True)
        if peer:
            one(next(c for c in configs if c.get("peer")), 0, -1, warm=True)
        for rep in range(repeats):
            order = configs if rep % 2 == 0 else configs[::-1]  # ABAB..., then in reverse
            for p in range(len(ids)):
                for cfg in order:
                    one(cfg, p, rep)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (toolkit.errors.install_signal_handlers)
        interrupt = e
        signame = e.args[0] if e.args and isinstance(e.args[0], str) else "SIGINT"
        report["status"], report["reason"] = "partial", f"interrupted ({signame})"
    except Exception as e:  # whatever stopped it, what was measured is kept
        report["status"] = "partial"
        report["reason"] = str(e) if isinstance(e, SpecPrefetchError) else f"{type(e).__name__}: {e}"
    finalize(report)
    from toolkit.errors import note_interrupt

    if interrupt is not None:  # the partial report, then the interrupt again (the CLI exits 128 + the signal)
        try:
            write(report, json_out)
        except SpecPrefetchError as e:
            note_interrupt(interrupt, f"the partial report could not be written ({e})")
        else:
            note_interrupt(interrupt, f"the partial report ({len(report['runs'])} runs, status partial) was "
                                      f"written to {json_out} (and its .md, .png)")
        raise interrupt
    write(report, json_out)
    if report["status"] != "complete":
        raise SpecPrefetchError(f"{report['reason']}: partial results ({len(report['runs'])} runs) in {json_out}")
    if report["failures"]:
        fl = report["failures"][0]
        last = (fl["stderr"].strip().splitlines() or [""])[-1]
        raise SpecPrefetchError(f"{len(report['failures'])} of {len(report['failures']) + len(report['runs'])} runs "
                                f"failed (first: {fl['config']}, exit {fl['exit_code']}: {last}); "
                                f"details in {json_out}")
    return report


def finalize(report: dict[str, Any]) -> None:
    """Per-configuration summary (median, p5, p95) and whether greedy tokens agree everywhere."""
    summary = {}
    for name in report["configs"]:
        rows = [r for r in report["runs"] if r["config"] == name]
        summary[name] = {"runs": len(rows), "tpot_ms": _stats([r.get("tpot_ms") for r in rows]),
                         "ttft_ms": _stats([r.get("ttft_ms") for r in rows]),
                         "stall_ms_per_token": _stats([r.get("stall_ms_per_token") for r in rows]),
                         "hit_rate": _stats([r.get("hit_rate") for r in rows]),
                         "mib_read_per_token": _stats([r.get("mib_read_per_token") for r in rows]),
                         "peak_rss_bytes": max((r["peak_rss_bytes"] for r in rows if r.get("peak_rss_bytes")),
                                               default=None)}
    report["summary"] = summary
    by_prompt: dict[int, set] = {}
    for r in report["runs"]:
        if r.get("tokens") is not None:  # the runner's greedy tokens (llama-bench generates its own)
            by_prompt.setdefault(r["prompt"], set()).add(tuple(r["tokens"]))
    report["tokens_identical"] = all(len(v) == 1 for v in by_prompt.values()) if by_prompt else None
    base = summary.get(report["configs"][0], {}).get("tpot_ms", {}).get("median") if report["configs"] else None
    for _name, s in summary.items():
        med = s["tpot_ms"]["median"]
        s["first_over_this"] = round(base / med, 3) if base and med else None


def markdown(r: dict[str, Any]) -> str:
    d = r["device"]
    lines = [f"# device bench: {Path(r['bundle']).name} on {d.get('model')} ({d.get('soc')}, {d['serial']})", "",
             f"pool {r['pool_mib']} MiB, {len(r['prompts'])} prompts x {r['repeats']} repeats, "
             f"{r['max_new_tokens']} new tokens, pinned to CPUs {r['pinned_cpus']}, cache: {r['cache']}, "
             f"status: {r['status']}" + (f" ({r['reason']})" if r["reason"] else ""), "",
             "| configuration | runs | TPOT median ms | p5 | p95 | TTFT median ms | stall ms/token | hit rate | "
             "MiB/token | peak RSS MiB | first / this |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in r["summary"].items():
        rss = s["peak_rss_bytes"]
        lines.append(f"| {name} | {s['runs']} | {s['tpot_ms']['median']} | {s['tpot_ms']['p5']} | "
                     f"{s['tpot_ms']['p95']} | {s['ttft_ms']['median']} | {s['stall_ms_per_token']['median']} | "
                     f"{s['hit_rate']['median']} | {s['mib_read_per_token']['median']} | "
                     f"{round(rss / 2**20, 1) if rss else None} | {s['first_over_this']} |")
    lines += ["", f"greedy tokens identical across configurations: {r['tokens_identical']}"]
    for fl in r["failures"]:
        last = (fl["stderr"].strip().splitlines() or [""])[-1]
        lines.append(f"- runner failure: {fl['config']} prompt {fl['prompt']}: exit {fl['exit_code']}: {last}")
    for n in r["notes"]:
        lines.append(f"- {n}")
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: Path) -> None:
    from toolkit.reporting import figure, save_figure

    names = [n for n in r["configs"] if r["summary"][n]["runs"]]
    fig, ax = figure((1.6 + 1.3 * max(1, len(names)), 3.6))
    data = [[x["tpot_ms"] for x in r["runs"] if x["config"] == n and x["tpot_ms"] is not None] for n in names]
    if data:
        ax.boxplot(data, showfliers=True)
        ax.set_xticks(range(1, len(names) + 1), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("TPOT (ms)")
    ax.set_title(f"{r['device'].get('soc')}: pool {r['pool_mib']} MiB")
    save_figure(fig, path)


def write(r: dict[str, Any], json_path: Path) -> tuple[Path, Path]:
    """json_path, and its .md (the table) and .png (the plot) beside it (toolkit.reporting.write_report)."""
    from toolkit.reporting import write_report

    return write_report(r, json_path, markdown, plot)


def _size(n: int | None) -> str:
    """Bytes for `device list`: GiB, MiB below 1 GiB (a full disk is "0 MiB"), "?" when not known."""
    if n is None:
        return "?"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def states_table(rows: list[dict[str, Any]]) -> str:
    """`device list` as text."""
    if not rows:
        return "no device attached (adb devices lists none)"
    out = []
    for d in rows:
        if d["state"] != "device":
            out.append(f"{d['serial']}  {d['state']}" + (f"  ({d['error']})" if d.get("error") else ""))
            continue
        cl = ", ".join(f"{len(c['cpus'])}x{c['max_khz'] / 1e6:.2f} GHz" for c in d["clusters"]) or "unknown"
        ram, free = _size(d["ram_bytes"]), _size(d["free_bytes_data_local_tmp"])
        out.append(f"{d['serial']}  device  {d['model']}  SoC {d['soc']}{'' if d['sm8750'] else ' (not SM8750)'}  "
                   f"{d['abi']}  RAM {ram}  free {free} under /data/local/tmp  CPUs {cl}  "
                   f"/data {d['data_fs']} inlinecrypt={d['inlinecrypt']}" + ("  root" if d["root"] else ""))
    return "\n".join(out)


__all__ = ["bench", "facts", "list_devices", "push", "states_table"]
