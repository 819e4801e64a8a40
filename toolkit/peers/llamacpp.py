"""llama.cpp as the peer: the engine a user would otherwise pick to run the same MoE checkpoint.

- `build(abi)`: llama.cpp as vendored by the llama-cpp-python sdist (pinned below), built with
  CMake + Ninja into a cache dir; "host" (GGML_NATIVE=ON: the build a user makes for their own machine) or "arm64"
  (cross-built with Debian's aarch64-linux-gnu g++, -march=armv8.2-a+dotprod+fp16, statically
  linked, checked under qemu-aarch64).
- `convert(model_dir, out)`: the vendored convert_hf_to_gguf.py with the vendored gguf-py (the
  converter puts vendor/llama.cpp/gguf-py first on sys.path itself), in a subprocess, with its
  BPE pre-tokenizer check patched at run time for our custom tokenizers.
- `run(...)`: llama-completion, greedy, exactly n_new tokens, through `memlimit.run_limited`
  (same memory limit including page cache, cold cache, same I/O accounting as our runner);
  ``readaround=False`` runs it with fault read-around off on its model mapping (`readaround_shim`).
- `bench(...)`: llama.cpp's own llama-bench (pp<N> and tg<N> tokens/s) on the same GGUF.
- `tool_path(name)`: any of the built tools (`BINARIES`), e.g. ``tool_path("test-backend-ops")``,
  llama.cpp's per-op test and benchmark (``test-backend-ops perf -o MUL_MAT``).

One patch is applied to the unpacked sources: common/log.cpp drains its asynchronous log at exit
(`_patch_log_flush`); upstream can lose the end of stdout/stderr under CPU contention.

Cache: ``$SPECPREFETCH_PROFILES/../peers`` (default ~/.cache/specprefetch/peers): sdist/, src/,
build-host/, build-arm64/ and their logs.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from toolkit.artifacts import read_json
from toolkit.errors import SpecPrefetchError
from toolkit.peers.memlimit import run_limited

# llama-cpp-python 0.3.36 vendors ggml-org/llama.cpp@0c1e57098 (its CHANGELOG), which is llama.cpp
# release b11312. The sdist has no git metadata (llama.cpp's CMake would report build 0, commit
# "unknown"), so both are passed in and `--version` prints "version: 11312 (0c1e57098)".
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_COMMIT = "0c1e57098"
LLAMA_CPP_BUILD = 11312
CLI = "llama-completion"  # prompt in, text out (this llama.cpp's llama-cli is the chat client; tools/cli)
BINARIES = ("llama-completion", "llama-bench", "llama-quantize", "test-backend-ops")
ARM64_ARCH = "armv8.2-a+dotprod+fp16"   # Snapdragon 8 Elite (Oryon, Armv8.7+) runs all of it
QEMU = ("qemu-aarch64", "-L", "/usr/aarch64-linux-gnu")
REPO = Path(__file__).resolve().parents[2]
TOOLCHAIN = REPO / "android_runner" / "cmake" / "aarch64-linux-gnu.cmake"

Log = Callable[[str], None]


def peers_dir() -> Path:
    """Beside the runner cache and the device profiles (moves with SPECPREFETCH_PROFILES)."""
    from toolkit.runtime.profiles import profile_dir

    # resolved: a cache reached through a symlink is the same cache (CMake's build directory records its
    # source path, so another spelling of it would rebuild everything)
    return (profile_dir().parent / "peers").resolve()


# the GGUF type that matches a bundle's expert precision: llama.cpp's nearest class of the same bytes per
# weight (int8 = blocks of 32 with an fp16 scale ~ Q8_0; int4 = blocks of 32 with an fp16 scale ~ Q4_0)
GGUF_TYPE_FOR_EXPERTS = {"fp16": "f16", "int8": "q8_0", "int4": "q4_0"}
# The segfault once documented here ("with CPU weight repacking on, b11312 crashes in its first decode of
# the widened phone-class model's Q4_0 GGUF") is in ggml's AMX kernels (ggml_backend_amx_mul_mat, gdb
# backtrace), which a GGML_NATIVE build compiles in on a CPU with AMX (this VM's Xeon) and which take the
# Q4_0 weights through the same "extra buffer types" switch as repacking. The host build therefore leaves
# AMX out (`NO_AMX_FLAGS`; a phone has no AMX either) and keeps CPU repacking (the AVX2 / AVX-512
# interleaved Q4_0 and Q8_0 kernels: llama.cpp's fastest CPU path). No newer llama.cpp is reachable from
# a package registry (llama-cpp-python 0.3.36, which vendors b11312, is PyPI's newest). REPACK_CRASH
# names GGUF types still run with --no-repack: none.
REPACK_CRASH: str | None = None
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# how each GGUF type is made from the checkpoint: f16 by convert_hf_to_gguf; the quantised types by
# llama-quantize from that f16 (llama.cpp's own quantiser); the cache file name carries the recipe
GGUF_RECIPE = {"f16": "f16", "q8_0": "q8_0-quantize", "q4_0": "q4_0"}


def cached_gguf(source: Path, label: str, gguf_dir: Path | None = None, *, gguf_type: str = "f16",
                bins: Path | None = None, log: Log = print) -> Path:
    """The GGUF of a checkpoint, converted once: cached per checkpoint content (its config and weight
    files' sizes and mtimes) and type under gguf_dir (default peers_dir()/gguf).

    f16 comes from convert_hf_to_gguf; q8_0 and q4_0 are llama-quantize's Q8_0 / Q4_0 of that f16 file
    (`bins`: a host build's bin directory, as `build("host")` returns)."""
    if gguf_type not in ("f16", "q8_0", "q4_0"):
        raise SpecPrefetchError(f"GGUF type {gguf_type!r}: f16, q8_0 or q4_0")
    h = hashlib.sha256()
    for p in sorted(Path(source).iterdir()):
        if p.suffix in (".json", ".safetensors") and p.is_file():
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    out = (Path(gguf_dir) if gguf_dir else peers_dir() / "gguf") / \
        f"{label}-{h.hexdigest()[:12]}-{GGUF_RECIPE[gguf_type]}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        if gguf_type != "f16":
            f16 = cached_gguf(source, label, gguf_dir, gguf_type="f16", log=log)
            quantize(bins if bins is not None else build("host", log=log), f16, out, gguf_type.upper(), log=log)
        else:
            convert(Path(source), out, outtype=gguf_type, log=log)
    return out


def quantize(bins: Path, src: Path, out: Path, qtype: str, *, log: Log = print) -> Path:
    """llama-quantize SRC OUT QTYPE (one thread per core), written to a temp file then renamed."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    logfile = out.with_name(f"{out.name}.quantize.log")
    log(f"llama.cpp: quantizing {src.name} to {qtype}")
    try:
        r = subprocess.run([str(Path(bins) / "llama-quantize"), str(src), str(tmp), qtype, str(os.cpu_count() or 1)],
                           capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
        logfile.write_text(r.stdout + r.stderr)
        if r.returncode != 0 or not tmp.exists():
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise SpecPrefetchError(f"llama-quantize {qtype} failed on {src}: {tail[:200]} (log: {logfile})")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _venv_tool(name: str) -> str:
    """cmake / ninja: the virtual environment's own, as the runner's build finds them."""
    from android_runner.build import _tool

    return _tool(name, f"pip install {name} (a project dependency: make setup)")


def source_dir(*, log: Log = print) -> Path:
    """vendor/llama.cpp of the pinned llama-cpp-python sdist (downloaded and unpacked once)."""
    root = peers_dir()
    sdist = root / "sdist"
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    tarball = sdist / f"{name}.tar.gz"
    if not tarball.exists():
        sdist.mkdir(parents=True, exist_ok=True)
        log(f"llama.cpp: downloading the llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist")
        with tempfile.TemporaryDirectory(dir=sdist) as tmp:
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                                "--no-binary", ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
                                "-d", tmp], capture_output=True, text=True, check=False)
            got = Path(tmp) / tarball.name
            if r.returncode != 0 or not got.exists():
                (sdist / "download.log").write_text(r.stdout + r.stderr)
                raise SpecPrefetchError(f"pip download llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} "
                                        f"failed; log: {sdist / 'download.log'}")
            got.rename(tarball)
    src = root / "src" / name
    llama = src / "vendor" / "llama.cpp"
    if not (src / ".unpacked").exists():
        log(f"llama.cpp: unpacking {tarball.name}")
        (root / "src").mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root / "src") as tmp:
            with tarfile.open(tarball) as tf:
                tf.extractall(tmp, filter="data")
            if src.exists():
                shutil.rmtree(src)
            (Path(tmp) / name).rename(src)
        (src / ".unpacked").touch()
    if not (llama / "CMakeLists.txt").exists():
        raise SpecPrefetchError(f"{llama} has no CMakeLists.txt (corrupt unpack? remove {src})")
    _patch_log_flush(llama)
    return llama


_LOG_PATCH = "// specprefetch: drain the async log at exit (the generated text and perf lines)"
_LOG_ANCHOR = "        log = new common_log;\n        // Set default to auto-detect colors\n" \
              "        log->set_colors(tty_can_use_colors());\n"


def _patch_log_flush(llama: Path) -> None:
    """The one change to llama.cpp's sources (in the unpacked copy of the cache, idempotent):
    common/log.cpp leaks its logger singleton on purpose and never drains the queue its worker
    thread writes from, so when that thread lags (seen here on a busy 2-core machine) the process
    exits with the tail of stdout/stderr lost: generated text cut short, perf lines missing.
    An atexit handler pausing the logger (which drains the queue and joins the thread) fixes that;
    nothing on the compute path changes."""
    f = llama / "common" / "log.cpp"
    text = f.read_text()
    if _LOG_PATCH in text:
        return
    if _LOG_ANCHOR not in text:
        raise SpecPrefetchError(f"{f}: the logger setup changed; update _patch_log_flush for this llama.cpp")
    text = text.replace(_LOG_ANCHOR, _LOG_ANCHOR + f"        {_LOG_PATCH}\n"
                        "        std::atexit([] { log->pause(); });\n", 1)
    tmp = f.with_suffix(".cpp.tmp")
    tmp.write_text(text)
    tmp.replace(f)


def _cmake_args(abi: str, llama: Path, build_dir: Path) -> list[str]:
    args = ["-S", str(llama), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={_venv_tool('ninja')}", "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=ON",  # for test-backend-ops
            "-DLLAMA_BUILD_SERVER=OFF", f"-DLLAMA_BUILD_COMMIT={LLAMA_CPP_COMMIT}",
            f"-DLLAMA_BUILD_NUMBER={LLAMA_CPP_BUILD}"]
    if abi == "host":
        if platform.machine().lower() in ("x86_64", "amd64"):  # see REPACK_CRASH
            args += [f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}"]
        return args + ["-DGGML_NATIVE=ON"]
    if abi == "arm64":
        if not shutil.which("aarch64-linux-gnu-g++"):
            raise SpecPrefetchError("aarch64-linux-gnu-g++ not found (apt-get install g++-aarch64-linux-gnu)")
        # static: one file to push to a phone (runs on Android's kernel without glibc installed)
        return args + [f"-DCMAKE_TOOLCHAIN_FILE={TOOLCHAIN}", "-DGGML_NATIVE=OFF",
                       f"-DGGML_CPU_ARM_ARCH={ARM64_ARCH}", "-DBUILD_SHARED_LIBS=OFF",
                       "-DGGML_STATIC=ON", "-DCMAKE_EXE_LINKER_FLAGS=-static", "-DGGML_OPENMP=ON"]
    raise SpecPrefetchError(f"unknown abi {abi!r} (expected 'host' or 'arm64')")


def build(abi: str = "host", *, log: Log = print, force: bool = False, jobs: int | None = None,
          nice: int = 10) -> Path:
    """Build `BINARIES` (llama-completion, llama-bench, llama-quantize, test-backend-ops) for `abi`;
    returns the bin directory.

    A finished build (stamp file matching version and flags) is reused unless `force`. The full
    configure/build log goes to ``peers/build-<abi>.log``; a failure raises a one-line
    SpecPrefetchError naming it. Builds run under `nice` (shared machines).
    """
    llama = source_dir(log=log)
    root = peers_dir()
    build_dir = root / f"build-{abi}"
    bin_dir = build_dir / "bin"
    args = _cmake_args(abi, llama, build_dir)
    stamp = build_dir / ".specprefetch-stamp.json"
    want = {"llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "commit": LLAMA_CPP_COMMIT,
            "build": LLAMA_CPP_BUILD, "patches": [_LOG_PATCH], "abi": abi, "cmake_args": args,
            "targets": list(BINARIES)}
    if (not force and stamp.exists() and all((bin_dir / b).exists() for b in BINARIES)
            and json.loads(stamp.read_text()).get("want") == want):
        return bin_dir
    if force and build_dir.exists():
        shutil.rmtree(build_dir)
    stamp.unlink(missing_ok=True)
    build_dir.mkdir(parents=True, exist_ok=True)
    logfile = root / f"build-{abi}.log"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    prefix = ["nice", "-n", str(nice)] if nice and shutil.which("nice") else []
    t0 = time.monotonic()
    with open(logfile, "w") as lf:
        for stage, cmd in (("configure", [_venv_tool("cmake"), *args]),
                           ("build", [_venv_tool("cmake"), "--build", str(build_dir),
                                      "-j", str(jobs or os.cpu_count() or 2),
                                      "--target", *BINARIES])):
            log(f"llama.cpp {abi}: {stage}" + (" (a few minutes)" if stage == "build" else ""))
            lf.write(f"$ {' '.join(cmd)}\n")
            lf.flush()
            r = subprocess.run(prefix + cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, check=False)
            if r.returncode != 0:
                raise SpecPrefetchError(f"llama.cpp {abi} {stage} failed (exit {r.returncode}); "
                                        f"log: {logfile}")
    missing = [b for b in BINARIES if not (bin_dir / b).exists()]
    if missing:
        raise SpecPrefetchError(f"llama.cpp {abi} build made no {', '.join(missing)} in {bin_dir}; "
                                f"log: {logfile}")
    if abi == "arm64":
        log("llama.cpp arm64: checking it starts under qemu-aarch64")
        check_arm64(bin_dir)
    secs = time.monotonic() - t0
    stamp.write_text(json.dumps({"want": want, "build_s": round(secs, 1)}, indent=1))
    log(f"llama.cpp {abi}: built in {secs / 60:.1f} min -> {bin_dir}")
    return bin_dir


def check_arm64(bin_dir: Path) -> str:
    """Run the arm64 llama-completion --version under qemu-aarch64; returns its version line."""
    if not shutil.which(QEMU[0]):
        raise SpecPrefetchError("qemu-aarch64 not found (apt-get install qemu-user) to check the arm64 build")
    r = subprocess.run([*QEMU, str(Path(bin_dir) / CLI), "--version"], capture_output=True,
                       text=True, timeout=120, check=False)
    out = (r.stdout + r.stderr).strip()
    if r.returncode != 0 or "version" not in out:
        raise SpecPrefetchError(f"arm64 {CLI} did not start under qemu-aarch64 "
                                f"(exit {r.returncode}): {out.splitlines()[-1] if out else 'no output'}")
    return next(l for l in out.splitlines() if "version" in l)


def tool_path(name: str, abi: str = "host", *, log: Log = print) -> Path:
    """The path of one built llama.cpp tool (building it first if needed): one of `BINARIES`, e.g.
    ``tool_path("test-backend-ops")`` (ggml's per-op checks and ``perf`` micro-benchmarks) or
    ``tool_path("llama-bench")``. A host tool runs as is; an arm64 one under `QEMU`."""
    if name not in BINARIES:
        raise SpecPrefetchError(f"llama.cpp tool {name!r}: the peer build makes {', '.join(BINARIES)}")
    path = build(abi, log=log) / name
    if not path.exists():
        raise SpecPrefetchError(f"{path} not found after the llama.cpp {abi} build (log: "
                                f"{peers_dir() / f'build-{abi}.log'})")
    return path


# ------------------------------------------------------------------------- read-around off (shim)

READAROUND_ENV = "SPECPREFETCH_MADV_RANDOM"  # "<st_dev>:<st_ino>" of the file whose mappings get MADV_RANDOM
READAROUND_MARK = "specprefetch-readaround-off: madvise(MADV_RANDOM)"
_SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
/* specprefetch: fault read-around off on the mappings of one file (docs/benchmarks.md section 8).
   mmap and mmap64 are wrapped; a mapping of the file named by SPECPREFETCH_MADV_RANDOM
   ("<st_dev>:<st_ino>") gets madvise(MADV_RANDOM) right after it is made, and one line on stderr. */
static void advise(void *p, size_t n, int fd) {
    const char *want = getenv("SPECPREFETCH_MADV_RANDOM");
    struct stat st;
    unsigned long long dev, ino;
    if (p == MAP_FAILED || fd < 0 || !want || sscanf(want, "%llu:%llu", &dev, &ino) != 2) return;
    if (fstat(fd, &st) != 0 || (unsigned long long)st.st_dev != dev || (unsigned long long)st.st_ino != ino) return;
    int rc = madvise(p, n, MADV_RANDOM);
    fprintf(stderr, "%s on %zu bytes: %s\n", "MARK", n, rc == 0 ? "ok" : "failed");
}
void *mmap(void *a, size_t n, int prot, int flags, int fd, off_t off) {
    static void *(*real)(void *, size_t, int, int, int, off_t);
    if (!real) real = (void *(*)(void *, size_t, int, int, int, off_t))dlsym(RTLD_NEXT, "mmap");
    void *p = real(a, n, prot, flags, fd, off);
    advise(p, n, fd);
    return p;
}
void *mmap64(void *a, size_t n, int prot, int flags, int fd, off_t off) {
    static void *(*real)(void *, size_t, int, int, int, off_t);
    if (!real) real = (void *(*)(void *, size_t, int, int, int, off_t))dlsym(RTLD_NEXT, "mmap64");
    void *p = real(a, n, prot, flags, fd, off);
    advise(p, n, fd);
    return p;
}
""".replace('"MARK"', json.dumps(READAROUND_MARK))


def readaround_shim(*, log: Log = print) -> Path:
    """The LD_PRELOAD shim that turns fault read-around off on llama.cpp's model mapping: mmap wrapped,
    madvise(MADV_RANDOM) on the mapping of the file named in $SPECPREFETCH_MADV_RANDOM, nothing else
    changed (llama.cpp's own posix_fadvise(SEQUENTIAL) and MAP_POPULATE stay). Without it each page
    fault reads up to read_ahead_kb around the page (8 MiB on this VM). Built once with the host C
    compiler into peers_dir() (keyed by its source); host builds only (the arm64 build is static)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise SpecPrefetchError("no C compiler (cc/gcc) to build the read-around shim (apt-get install gcc)")
    digest = hashlib.sha256(_SHIM_C.encode()).hexdigest()[:12]
    out = peers_dir() / f"readaround-off-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".c")
    src.write_text(_SHIM_C)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    log("llama.cpp: building the read-around-off shim")
    r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(src), "-ldl"], capture_output=True,
                       text=True, check=False)
    if r.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise SpecPrefetchError(f"building {src} failed: {tail[:200]}")
    tmp.replace(out)
    return out


# ---------------------------------------------------------------------------------- llama-bench

def bench(binary_dir: Path, gguf: Path, *, threads: int, prompt_tokens: Sequence[int] = (128, 512),
          gen_tokens: int = 32, repetitions: int = 3, repack: bool = True, timeout: float | None = 1800,
          abi: str = "host") -> list[dict]:
    """llama.cpp's own llama-bench on `gguf`: pp<N> for each prompt length and tg<gen_tokens>, `threads`
    threads, `repetitions` runs each (its default warm-up first), default mmap load, CPU repacking as
    `repack`. Returns one dict per test: test ("pp128", "tg32", ...), n_prompt, n_gen, threads,
    tokens_per_s (llama-bench's mean), stddev, ms_per_token (1000 / tokens_per_s), repack."""
    exe = Path(binary_dir) / "llama-bench"
    if not exe.exists():
        raise SpecPrefetchError(f"{exe} not found (build it with toolkit.peers.llamacpp.build)")
    if not Path(gguf).exists():
        raise SpecPrefetchError(f"{gguf} not found")
    argv = [str(exe), "-m", str(gguf), "-p", ",".join(str(int(p)) for p in prompt_tokens), "-n", str(gen_tokens),
            "-t", str(threads), "-r", str(repetitions), "--repack", "1" if repack else "0", "-o", "json"]
    if abi == "arm64":
        argv = [*QEMU, *argv]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SpecPrefetchError(f"llama-bench on {gguf}: no result in {timeout:.0f} s (killed)") from None
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise SpecPrefetchError(f"llama-bench failed on {gguf} (exit {r.returncode}): {tail[:200]}")
    try:
        got = json.loads(r.stdout[r.stdout.index("["):])
    except ValueError as e:
        raise SpecPrefetchError(f"llama-bench on {gguf}: no JSON in its output ({e})") from None
    out = []
    for t in got:
        n_p, n_g = int(t.get("n_prompt", 0)), int(t.get("n_gen", 0))
        ts = float(t["avg_ts"])
        out.append({"test": f"pp{n_p}" if n_g == 0 else f"tg{n_g}" if n_p == 0 else f"pp{n_p}+tg{n_g}",
                    "n_prompt": n_p, "n_gen": n_g, "threads": int(t.get("n_threads", threads)),
                    "tokens_per_s": round(ts, 3), "stddev": round(float(t.get("stddev_ts", 0.0)), 3),
                    "ms_per_token": round(1000.0 / ts, 4) if ts > 0 else None, "repack": repack,
                    "type": t.get("model_type"), "cpu": t.get("cpu_info")})
    return out


# ---------------------------------------------------------------------------------- conversion

def _pre_tokenizer(model_dir: Path) -> str:
    """The llama.cpp pre-tokenizer matching tokenizer.json's (for tokenizers the converter's hash
    table does not know): ByteLevel with use_regex -> GPT-2's regex ("gpt-2"); the Qwen2 Split
    regex -> "qwen2"."""
    tj = Path(model_dir) / "tokenizer.json"
    tok = read_json(tj, "tokenizer")
    if not isinstance(tok, dict):
        raise SpecPrefetchError(f"{tj}: the tokenizer is not a JSON object")
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    split = [s for s in steps if s.get("type") == "Split"]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    if not split and byte_level and byte_level[0].get("use_regex", True) \
            and not byte_level[0].get("add_prefix_space", False):
        return "gpt-2"
    if split and byte_level and not byte_level[0].get("use_regex", True):
        rx = split[0].get("pattern", {}).get("Regex", "")
        if rx.startswith("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|"):
            return "qwen2"
    raise SpecPrefetchError(f"{tj}: pre-tokenizer {json.dumps(pre)[:120]} matches no llama.cpp "
                            "pre-tokenizer this wrapper knows (gpt-2, qwen2)")


_CONVERT_WRAPPER = r'''
import logging, runpy, sys
llama, pre = sys.argv[1], sys.argv[2]
sys.argv = [llama + "/convert_hf_to_gguf.py"] + sys.argv[3:]
sys.path.insert(0, llama)
sys.path.insert(1, llama + "/gguf-py")
import conversion.base as base
_orig = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        logging.getLogger("specprefetch").warning("unknown BPE pre-tokenizer hash: using %r", pre)
        return pre
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def convert(model_dir: Path, out: Path, outtype: str = "f16", *, log: Log = print) -> Path:
    """Convert a transformers checkpoint to GGUF with the vendored convert_hf_to_gguf.py.

    Runs in a subprocess of the venv's python with the vendored gguf-py; an unknown BPE
    pre-tokenizer hash (our custom tokenizers) falls back to the one tokenizer.json describes
    (`_pre_tokenizer`) through a wrapper that patches ``TextModel.get_vocab_base_pre`` in memory
    (the vendored file is not edited). Writes ``out`` atomically (temp file, then rename).
    """
    model_dir, out = Path(model_dir), Path(out)
    if not (model_dir / "config.json").exists():
        raise SpecPrefetchError(f"{model_dir}: no config.json (not a transformers checkpoint)")
    cfg = read_json(model_dir / "config.json", "model config")
    if not isinstance(cfg, dict):
        raise SpecPrefetchError(f"{model_dir / 'config.json'}: not a JSON object")
    cfg = cfg.get("text_config", cfg)
    if cfg.get("model_type") in ("qwen3_moe", "qwen2_moe") and (
            cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1):
        raise SpecPrefetchError(f"{model_dir}: llama.cpp's {cfg['model_type']} has MoE in every layer; this "
                                f"checkpoint has dense layers (mlp_only_layers={cfg.get('mlp_only_layers')}, "
                                f"decoder_sparse_step={cfg.get('decoder_sparse_step', 1)})")
    llama = source_dir(log=log)
    pre = _pre_tokenizer(model_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    logfile = out.with_name(f"{out.name}.convert.log")
    log(f"llama.cpp: converting {model_dir} to {outtype} GGUF")
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as w:
        w.write(_CONVERT_WRAPPER)
    try:
        r = subprocess.run([sys.executable, w.name, str(llama), pre, str(model_dir),
                            "--outfile", str(tmp), "--outtype", outtype],
                           capture_output=True, text=True, check=False,
                           env=dict(os.environ, PYTHONUNBUFFERED="1"))
        logfile.write_text(r.stdout + r.stderr)
        if r.returncode != 0 or not tmp.exists():
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise SpecPrefetchError(f"convert_hf_to_gguf failed on {model_dir}: {tail[:200]} "
                                    f"(log: {logfile})")
        tmp.replace(out)
    finally:
        os.unlink(w.name)
        tmp.unlink(missing_ok=True)
    return out


# ------------------------------------------------------------------------------------ running

_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_metadata(path: Path, keys: Sequence[str]) -> dict:
    """Read some metadata values from a GGUF file's header (strings, scalars, arrays of them)."""
    want, found = set(keys), {}
    with open(path, "rb") as f:
        def rd(fmt: str):
            fmt = "<" + fmt
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def rstr() -> str:
            return f.read(rd("Q")).decode("utf-8", "surrogateescape")

        def value(t: int, keep: bool):
            if t == 8:
                return rstr()
            if t == 9:
                et, n = rd("I"), rd("Q")
                if not keep and et in _GGUF_SCALARS:
                    f.seek(n * struct.calcsize("<" + _GGUF_SCALARS[et]), 1)
                    return None
                return [value(et, keep) for _ in range(n)]
            return rd(_GGUF_SCALARS[t])

        if f.read(4) != b"GGUF":
            raise SpecPrefetchError(f"{path}: not a GGUF file")
        version, _n_tensors, n_kv = rd("I"), rd("Q"), rd("Q")
        if version < 2:
            raise SpecPrefetchError(f"{path}: GGUF version {version} is too old")
        for _ in range(n_kv):
            key, t = rstr(), rd("I")
            v = value(t, key in want)
            if key in want:
                found[key] = v
                if len(found) == len(want):
                    break
    return found


def _byte_decoder() -> dict[str, int]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def detokenize(gguf: Path, ids: Sequence[int]) -> bytes:
    """Bytes of token ids from the GGUF's byte-level BPE vocab (control tokens as their text)."""
    md = gguf_metadata(gguf, ["tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"])
    if md.get("tokenizer.ggml.model") != "gpt2":
        raise SpecPrefetchError(f"{gguf}: token-id prompts need a byte-level BPE (gpt2) vocab, "
                                f"not {md.get('tokenizer.ggml.model')!r}")
    toks, types, dec = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"], _byte_decoder()
    out = bytearray()
    for i in ids:
        if types[i] in (3, 4):  # CONTROL, USER_DEFINED: stored as plain text
            out += toks[i].encode("utf-8", "surrogateescape")
        else:
            out += bytes(dec[c] for c in toks[i])
    return bytes(out)


_PERF = {
    "load_ms": re.compile(r"load time =\s*([\d.]+) ms"),
    "prompt_eval": re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens"),
    "eval": re.compile(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs"),
    "sampling_ms": re.compile(r"sampling time =\s*([\d.]+) ms"),
    "total_ms": re.compile(r"total time =\s*([\d.]+) ms"),
}


def parse_perf(stderr: str) -> dict:
    """llama.cpp's common_perf_print lines (the last of each) as numbers; missing ones are None."""
    got: dict = {}
    for k, rx in _PERF.items():
        m = rx.findall(stderr)
        last = m[-1] if m else None
        if k in ("prompt_eval", "eval"):
            got[f"{k}_ms"] = float(last[0]) if last else None
            got[f"{k}_n"] = int(last[1]) if last else None
        else:
            got[k] = float(last) if last else None
    return got


def _prompt_ids(stderr: str) -> list[int] | None:
    """Prompt token ids from --verbose-prompt's "  id -> 'piece'" lines."""
    m = re.search(r"number of tokens in prompt = (\d+)\n", stderr)
    if not m:
        return None
    n, ids = int(m.group(1)), []
    for line in stderr[m.end():].splitlines():
        t = re.match(r"(?:\d+\.\d+\.\d+\.\d+ [A-Z] )?\s*(\d+) -> '", line)  # optional log prefix
        if t:
            ids.append(int(t.group(1)))
            if len(ids) == n:
                return ids
    return ids


def run(binary_dir: Path, gguf: Path, prompt: str | list[int], n_new: int, *,
        limit_bytes: int | None = None, threads: int | None = None, abi: str = "host",
        mmap: bool = True, load_mode: str | None = None, warmup: bool = False, cold: bool = True,
        ctx_size: int | None = None, timeout: float | None = None, repack: bool = True,
        readaround: bool = True) -> dict:
    """Generate exactly `n_new` tokens greedily with llama-completion, measured by run_limited.

    Greedy: ``--temp 0 --top-k 1 --seed 0``; ``--ignore-eos`` (EOG tokens get -inf logit bias, so
    compare with a reference that suppresses EOS too); ``-no-cnv`` (no chat template); prompt
    passed verbatim (``--no-escape``, via a file). A token-id prompt is turned into its bytes with
    the GGUF vocab and must re-tokenize to the same ids (checked with ``--verbose-prompt``; a
    mismatch raises). `mmap` picks ``--load-mode mmap`` (weights paged in from the file on demand,
    page cache charged to the limit) or ``none`` (read into anonymous memory at load);
    `load_mode` passes another of this llama.cpp's modes (e.g. "dio": direct I/O) instead.
    ``repack=False`` passes ``--no-repack`` (see REPACK_CRASH). ``readaround=False`` (host only, with
    mmap) preloads `readaround_shim`: MADV_RANDOM on the model's mapping, so a page fault reads that page
    only; the result's ``readaround_off`` says whether the shim reported doing it (a run where it did not
    raises).
    ``--no-warmup`` by default: llama.cpp's warmup decode would touch (and,
    with mmap, read) the weights before the timed prefill.

    Times, from llama.cpp's own perf counters (llama_context, measured around llama_decode up to
    the synchronize that makes its logits available):
    - ``ttft_ms`` = "prompt eval time": the one decode of the whole prompt, i.e. from the start of
      prefill to the first token's logits, page faults of an mmapped model included; model load,
      tokenization and the (greedy, ~µs) sampling of the first token excluded. None for a 1-token
      prompt (llama.cpp counts a 1-token batch as "eval").
    - ``tpot_ms`` = "eval time" / "eval runs": the mean time of one single-token decode. There are
      n_new - 1 of them (the last sampled token is never decoded), so it matches
      (t_last - t_first) / (N - 1) of toolkit/runtime/stats.py except that per-token sampling
      (``sampling_ms`` in total, reported) and console output are not included.
    ``tokens`` is the generated text (stdout; llama-completion prints pieces, not ids).
    ``mib_read``/``peak_rss_bytes`` come from memlimit (the whole process, model load included).
    """
    binary_dir, gguf = Path(binary_dir), Path(gguf)
    exe = binary_dir / CLI
    if not exe.exists():
        raise SpecPrefetchError(f"{exe} not found (build it with toolkit.peers.llamacpp.build)")
    if not gguf.exists():
        raise SpecPrefetchError(f"{gguf} not found")
    if n_new < 1:
        raise SpecPrefetchError(f"n_new must be >= 1 (got {n_new})")
    want_ids = list(prompt) if not isinstance(prompt, str) else None
    data = detokenize(gguf, want_ids) if want_ids is not None else prompt.encode()
    threads = threads or os.cpu_count() or 1
    if ctx_size is None:  # byte-level BPE: tokens <= bytes (+1 for a BOS)
        n_prompt_max = len(want_ids) if want_ids is not None else len(data)
        ctx_size = -(-(n_prompt_max + 1 + n_new + 8) // 256) * 256
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as pf:
        pf.write(data + b"\n")  # -f drops one trailing newline
    argv = [str(exe), "-m", str(gguf), "-f", pf.name, "--no-escape", "-n", str(n_new),
            "--ignore-eos", "-no-cnv", "--temp", "0", "--top-k", "1", "--seed", "0",
            "-t", str(threads), "-tb", str(threads), "-c", str(ctx_size),
            "-b", str(max(ctx_size, 512)), "--no-display-prompt", "--verbose-prompt"]
    if not warmup:
        argv.append("--no-warmup")
    if not repack:  # llama.cpp's CPU weight repacking (Q4_0 -> interleaved blocks) off
        argv.append("--no-repack")
    argv += ["--load-mode", load_mode or ("mmap" if mmap else "none")]
    if abi == "arm64":
        argv = [*QEMU, *argv]
    elif abi != "host":
        raise SpecPrefetchError(f"unknown abi {abi!r} (expected 'host' or 'arm64')")
    env = None
    if not readaround:
        if abi != "host" or not mmap or load_mode not in (None, "mmap"):
            raise SpecPrefetchError("readaround=False: only for a host build loading the model with mmap")
        st = gguf.stat()
        env = dict(os.environ, LD_PRELOAD=str(readaround_shim()), **{READAROUND_ENV: f"{st.st_dev}:{st.st_ino}"})
    try:
        r = run_limited(argv, limit_bytes=limit_bytes, files=[gguf, exe], timeout=timeout, cold=cold, env=env)
    finally:
        os.unlink(pf.name)
    advised = READAROUND_MARK in r.stderr if not readaround else None
    if advised is False and r.returncode == 0:
        raise SpecPrefetchError(f"readaround=False: the shim did not report advising {gguf}'s mapping "
                                "(llama.cpp mapped it some other way?)")
    perf = parse_perf(r.stderr)
    got_ids = _prompt_ids(r.stderr)
    if want_ids is not None and got_ids is not None and got_ids != want_ids:
        at = next((i for i, (a, b) in enumerate(zip(got_ids, want_ids)) if a != b),
                  min(len(got_ids), len(want_ids)))
        raise SpecPrefetchError(f"llama.cpp tokenized the {len(want_ids)}-token prompt into {len(got_ids)} "
                                f"tokens (first difference at {at}): not the same prompt; pass ids that "
                                "are the tokenization of a text (a cut of a longer text's ids may not be)")
    text = r.stdout.removesuffix("\n\n")  # llama-completion prints "\n\n" after the text
    n_eval = perf["eval_n"]
    tpot = perf["eval_ms"] / n_eval if perf["eval_ms"] is not None and n_eval and n_new > 1 else None
    ttft = perf["prompt_eval_ms"] if perf["prompt_eval_n"] and perf["prompt_eval_n"] > 1 else None
    return {
        "tpot_ms": tpot,
        "ttft_ms": ttft,
        "prompt_tokens": len(got_ids) if got_ids is not None else perf["prompt_eval_n"],
        "new_tokens": (1 if n_new == 1 else n_eval + 1) if n_eval is not None and r.returncode == 0 else None,
        "tokens": text,
        "prompt_ids": got_ids,
        "mib_read": r.read_bytes / 2**20,
        "peak_rss_bytes": r.peak_rss_bytes,
        "cgroup_max_usage_bytes": r.cgroup_max_usage_bytes,
        "limit_bytes": limit_bytes,
        "cache_drop": r.cache_drop,
        "oom_kills": r.oom_kills,
        "timed_out": r.timed_out,
        "wall_s": r.wall_s,
        "returncode": r.returncode,
        "readaround_off": advised,
        "load_ms": perf["load_ms"],
        "sampling_ms": perf["sampling_ms"],
        "eval_runs": n_eval,
        "argv": argv,
        "stderr_tail": "\n".join(r.stderr.strip().splitlines()[-25:]),
    }


def agreeing_prefix(reference_ids: Sequence[int], text: str, tokenizer) -> int:
    """How many leading reference tokens (e.g. transformers' greedy ids) llama.cpp's generated
    `text` reproduces: the largest k with decode(reference_ids[:k]) a prefix of `text`."""
    k = 0
    for k in range(len(reference_ids), -1, -1):
        if text.startswith(tokenizer.decode(list(reference_ids[:k]), skip_special_tokens=False)):
            return k
    return k
