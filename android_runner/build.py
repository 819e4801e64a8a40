"""Generate, build and run the native runner for a bundle (`specprefetch runner build`, `run --engine native`).

The C++ sources (android_runner/src) are one CMake project; `build` writes a config header for
the bundle (spx_config.h: family, geometry, expert precision, the model's config hash, which the
runner checks at start) and builds it with CMake + Ninja, three ways:

    host     this machine, against the executorch wheel's CMake package
    arm64    Linux aarch64 with Debian's cross compiler, against the libraries of the executorch
             manylinux aarch64 wheel (downloaded once by pip); shipped with its loader and shared
             libraries beside it, so it starts from `adb shell` on a phone without the NDK
    android  the Android NDK's toolchain (ANDROID_NDK) against an ExecuTorch built for arm64-v8a
             (EXECUTORCH_ANDROID_PREFIX), as ExecuTorch documents

A qnn or qai-hub bundle's runner runs its EPContext graphs through ONNX Runtime's C API with
Qualcomm's QNN execution provider instead of ExecuTorch (backend_ort.cpp): against the onnxruntime
and onnxruntime-qnn wheels here (the HTP simulator), against the user's ONNX Runtime and QNN
runtime libraries for a phone (SPX_QNN_LIBS, `qnn_libraries`). ONNX Runtime's C API headers come
from Debian's libonnxruntime-dev package (`ort_headers`), or SPX_ORT_INCLUDE.

The runner reads text with the bundle's tokenizer.json through the Hugging Face tokenizer of
ExecuTorch's LLM runners (meta-pytorch/tokenizers, from the pytorch-tokenizers sdist on PyPI,
which vendors RE2, Abseil and PCRE2): built once per ABI (a few minutes) into the runners cache
and linked in. `tokenizer=False` builds a runner that takes token ids only.

A build is reused while its sources, config and toolchain are unchanged and every file it
installed (bin/, lib/, run.sh) still has the sha256 recorded when it was built (the stamp in the
output, .stamp); a damaged or replaced binary is rebuilt, never reused or pushed.

The output directory is the runner cache's own (one per family, config, expert dtype and ABI:
reused and rebuilt incrementally) or `out`. Like every writer's (toolkit/artifacts/), `out` is
written only if it is new, empty, or a runner build (its build.json marks it: format
specprefetch-runner); a directory that is not is refused and never written into; a runner build of
another configuration (another bundle's config, ABI, toolchain) or a `force` rebuild of it is
replaced only with `overwrite`. A build of the same configuration (an interrupted one, or one whose
sources changed) goes on incrementally. `out` may not be, hold or lie inside the bundle or these
sources.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable, Sequence

from toolkit.artifacts import read_json
from toolkit.errors import SpecPrefetchError

SRC = Path(__file__).resolve().parent
ABIS = ("host", "arm64", "android")
BINARY = "specprefetch-runner"
RUNNER_FORMAT = "specprefetch-runner"  # build.json's "format": what marks a runner build directory
AARCH64_SYSROOT = Path("/usr/aarch64-linux-gnu")
# what a glibc program needs on a phone that has none: the loader and the C/C++ runtime
AARCH64_RUNTIME = ("ld-linux-aarch64.so.1", "libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1",
                   "libpthread.so.0", "libdl.so.2", "librt.so.1")


# the C++ tokenizer's source: the pytorch-tokenizers sdist (the only release on PyPI with one)
TOKENIZERS_VERSION = "1.0.1"
TOKENIZERS_SDIST = ("https://files.pythonhosted.org/packages/0c/a7/d07ebde1011d704e4ab5c8fcb46fc71cb72fdf2c393f85"
                    "202f7dfb8fd669/pytorch_tokenizers-1.0.1.tar.gz")
TOKENIZERS_SHA256 = "19938c0efd5348fb0589610094c1c6bf6e055b20889f6250068d2b552a0b137b"


def runners_dir() -> Path:
    from toolkit.runtime.profiles import profile_dir

    return profile_dir().parent / "runners"


def _tool(name: str, hint: str) -> str:
    # the virtual environment's own (cmake and ninja are project dependencies) before the system's
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if not found:
        raise SpecPrefetchError(f"{name} not found: {hint}")
    return found


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on `path`.lock (beside it) for the duration: one build or download of a cache
    entry or output directory at a time, across processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def config_header(manifest: dict[str, Any]) -> str:
    """spx_config.h for a bundle: what the runner is generated for (checked against the bundle at start)."""
    mo = manifest["model"]
    experts = (manifest.get("quantization") or {}).get("experts", "fp16")
    routing = manifest["routing"]
    lines = [
        "// Generated by `specprefetch runner build` for one bundle: do not edit.",
        "#pragma once",
        f'#define SPX_FAMILY "{mo["family"]}"',
        f'#define SPX_CONFIG_HASH "{mo["config_hash"]}"',
        f"#define SPX_NUM_LAYERS {int(mo['num_layers'])}",
        f"#define SPX_MOE_LAYERS {len(mo['moe_layers'])}",
        f"#define SPX_HIDDEN {int(mo['hidden_size'])}",
        f"#define SPX_NUM_EXPERTS {int(routing['num_experts'])}",
        f"#define SPX_TOP_K {int(routing['top_k'])}",
        f'#define SPX_EXPERT_DTYPE "{experts}"',
        f'#define SPX_SCORE_FUNC "{routing.get("score_func", "softmax")}"',
    ]
    return "\n".join(lines) + "\n"


def _digest(paths: Sequence[Path], extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    for p in sorted(paths):
        h.update(str(p.relative_to(SRC)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _sources() -> list[Path]:
    out = [SRC / "CMakeLists.txt", SRC / "build.py", SRC / "tokenizers" / "CMakeLists.txt"]
    for sub in ("src", "tests", "cmake", "tokenizers"):
        out += [p for p in (SRC / sub).rglob("*") if p.is_file() and p.suffix in (".cpp", ".h", ".cmake")]
    return out


def _package_version(pkg: Path) -> str:
    """The ExecuTorch package's full version (its CMake version file), or for ONNX Runtime the
    library's (or the user's library directory's) names, sizes and times: part of a build's stamp."""
    if pkg.is_file():
        files = [pkg]
    else:
        found = sorted(pkg.rglob("executorch-config-version.cmake"))
        if found:
            return found[0].read_text()
        files = sorted(pkg.glob("*.so*"))
    return "|".join(f"{f.name}:{f.stat().st_size}:{int(f.stat().st_mtime)}" for f in files)


def executorch_host_package() -> Path:
    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        raise SpecPrefetchError("the executorch package is not installed (make setup installs it)")
    return Path(list(spec.submodule_search_locations)[0])


def executorch_aarch64_package(log: Callable[[str], None]) -> Path:
    """The executorch manylinux aarch64 wheel's files (lib, include, share), downloaded once by pip."""
    version = importlib.metadata.version("executorch")
    root = runners_dir() / f"executorch-{version}-aarch64"
    with _locked(root):
        return _aarch64_package(root, version, log)


def _aarch64_package(root: Path, version: str, log: Callable[[str], None]) -> Path:
    pkg = root / "executorch"
    if (pkg / "share" / "cmake" / "executorch-config.cmake").is_file():
        return pkg
    log(f"downloading the executorch {version} manylinux aarch64 wheel (pip download, once)")
    runners_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=runners_dir()) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
               "--platform", "manylinux_2_28_aarch64", "--python-version", "3.12", f"executorch=={version}",
               "-d", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("executorch-*.whl"))
        if r.returncode != 0 or not wheels:
            raise SpecPrefetchError(f"pip download of the executorch aarch64 wheel failed: "
                                    f"{(r.stderr or r.stdout).strip().splitlines()[-1:] or ['no wheel']}")
        stage = Path(tmp) / "stage"
        with zipfile.ZipFile(wheels[0]) as z:
            for n in z.namelist():
                if n.startswith(("executorch/lib/", "executorch/include/", "executorch/share/")):
                    z.extract(n, stage)
        if root.exists():
            shutil.rmtree(root)
        os.replace(stage, root)
    return pkg


def _check_arm64_toolchain() -> None:
    missing = [n for n in ("aarch64-linux-gnu-g++",) if not shutil.which(n)]
    if missing or not (AARCH64_SYSROOT / "lib" / "ld-linux-aarch64.so.1").exists():
        raise SpecPrefetchError("--abi arm64 needs Debian's cross compiler: apt-get install g++-aarch64-linux-gnu "
                                "(make setup installs it)")


def _android_ndk(qnn: bool = False) -> Path:
    ndk = os.environ.get("ANDROID_NDK") or os.environ.get("ANDROID_NDK_HOME")
    if not ndk or not (Path(ndk) / "build" / "cmake" / "android.toolchain.cmake").is_file():
        raise SpecPrefetchError("--abi android needs the Android NDK: set ANDROID_NDK to an NDK (r26 or newer) "
                                "holding build/cmake/android.toolchain.cmake" + (
                                    " (a qnn bundle's phone runner is built only with it)" if qnn else
                                    "; without it use --abi arm64, which starts from adb shell") + " (docs/runner.md)")
    return Path(ndk)


def _executorch_android_prefix() -> Path:
    prefix = os.environ.get("EXECUTORCH_ANDROID_PREFIX")
    if not prefix or not list(Path(prefix).rglob("executorch-config.cmake")):
        raise SpecPrefetchError("--abi android needs ExecuTorch built for arm64-v8a: set EXECUTORCH_ANDROID_PREFIX "
                                "to its install prefix (docs/runner.md shows the build)")
    return Path(prefix)


# -- the ONNX Runtime backend (qnn and qai-hub bundles) --------------------------------------

ORT_TARGETS = ("qnn", "qai-hub")
ORT_MIN_API = 22  # RegisterExecutionProviderLibrary, GetEpDevices, SessionOptionsAppendExecutionProvider_V2
# what a phone build ships beside the runner (SPX_QNN_LIBS): ONNX Runtime, its QNN execution provider,
# the QNN HTP backend and system library, and the HTP's stub / skel for the bundle's architecture
QNN_PHONE_LIBS = ("libonnxruntime.so", "libonnxruntime_providers_qnn.so", "libQnnHtp.so", "libQnnSystem.so",
                  "libQnnHtpPrepare.so")
DEBIAN_ARCHIVE = "http://deb.debian.org/debian"


def backend_of(manifest: dict[str, Any]) -> str:
    """"executorch" or "ort": what the runner for this bundle runs its graphs with."""
    return "ort" if manifest.get("target") in ORT_TARGETS else "executorch"


def ort_headers(log: Callable[[str], None], cache: Path | None = None) -> Path:
    """A directory holding onnxruntime_c_api.h (API >= ORT_MIN_API): SPX_ORT_INCLUDE, else Debian's
    libonnxruntime-dev (from the archive's sid / experimental suites, fetched once with apt-get into
    the runner cache, the system's apt configuration untouched). The C API is versioned and
    backward compatible: these headers serve the wheel's and a phone's newer ONNX Runtime alike.
    `cache`: the runner cache to fetch into (default: runners_dir())."""
    env = os.environ.get("SPX_ORT_INCLUDE")
    if env:
        if not (Path(env) / "onnxruntime_c_api.h").is_file():
            raise SpecPrefetchError(f"SPX_ORT_INCLUDE {env}: no onnxruntime_c_api.h there")
        api = _ort_api_version(Path(env) / "onnxruntime_c_api.h")
        if api < ORT_MIN_API:
            raise SpecPrefetchError(f"SPX_ORT_INCLUDE {env}: ONNX Runtime C API {api}; the QNN plugin needs "
                                    f"{ORT_MIN_API} or newer")
        return Path(env)
    root = (cache or runners_dir()) / "onnxruntime-headers"
    with _locked(root):
        inc = root / "include" / "onnxruntime"
        if (inc / "onnxruntime_c_api.h").is_file():
            return inc
        return _fetch_ort_headers(root, log)


def _fetch_ort_headers(root: Path, log: Callable[[str], None]) -> Path:
    hint = ("set SPX_ORT_INCLUDE to a directory holding onnxruntime_c_api.h (the headers/ folder of the "
            "onnxruntime-android package, or include/ of an ONNX Runtime release; docs/runner.md)")
    apt = shutil.which("apt-get")
    keyring = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
    if not apt or not keyring.is_file():
        raise SpecPrefetchError("ONNX Runtime's C API headers: no Debian apt-get here to fetch libonnxruntime-dev; "
                                + hint)
    log("fetching ONNX Runtime's C API headers (Debian's libonnxruntime-dev, once)")
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        w = Path(tmp)
        for d in ("lists/partial", "cache/archives/partial"):
            (w / d).mkdir(parents=True)
        (w / "sources.list").write_text("".join(f"deb [signed-by={keyring}] {DEBIAN_ARCHIVE} {suite} main\n"
                                                for suite in ("sid", "experimental")))
        opts = ["-o", f"Dir::Etc::SourceList={w / 'sources.list'}", "-o", "Dir::Etc::SourceParts=/dev/null",
                "-o", f"Dir::State::Lists={w / 'lists'}", "-o", f"Dir::Cache={w / 'cache'}",
                "-o", "Dir::State::status=/dev/null", "-o", "APT::Sandbox::User=root"]

        def apt_run(cmd: list[str], what: str) -> str:
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=w)
            if r.returncode != 0:
                tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
                raise SpecPrefetchError(f"ONNX Runtime's C API headers: {what} failed ({tail[0][:200]}); {hint}")
            return r.stdout

        apt_run([apt, *opts, "-qq", "update"], "apt-get update of Debian's sid / experimental lists")
        madison = apt_run([shutil.which("apt-cache") or "apt-cache", *opts, "madison", "libonnxruntime-dev"],
                          "apt-cache madison libonnxruntime-dev")
        versions = sorted({ln.split("|")[1].strip() for ln in madison.splitlines() if ln.count("|") >= 2},
                          key=_debian_version_key)
        if not versions:
            raise SpecPrefetchError("ONNX Runtime's C API headers: Debian lists no libonnxruntime-dev (no network?); "
                                    + hint)
        apt_run([apt, *opts, "-qq", "download", f"libonnxruntime-dev={versions[-1]}"], "apt-get download")
        deb = next(w.glob("libonnxruntime-dev_*.deb"), None)
        if deb is None:
            raise SpecPrefetchError(f"ONNX Runtime's C API headers: apt-get download wrote no package; {hint}")
        apt_run(["dpkg-deb", "-x", str(deb), str(w / "x")], "dpkg-deb -x")
        src = w / "x" / "usr" / "include" / "onnxruntime"
        api = _ort_api_version(src / "onnxruntime_c_api.h")
        if api < ORT_MIN_API:
            raise SpecPrefetchError(f"ONNX Runtime's C API headers: Debian's libonnxruntime-dev {versions[-1]} is API "
                                    f"{api}, the QNN plugin needs {ORT_MIN_API}; {hint}")
        stage = w / "stage" / "include"
        stage.mkdir(parents=True)
        shutil.copytree(src, stage / "onnxruntime")
        (w / "stage" / "version.txt").write_text(f"libonnxruntime-dev {versions[-1]} (ORT_API_VERSION {api})\n")
        if root.exists():
            shutil.rmtree(root)
        os.replace(w / "stage", root)
    return root / "include" / "onnxruntime"


def _debian_version_key(v: str) -> list:
    import re

    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", v)]


def _ort_api_version(header: Path) -> int:
    for ln in header.read_text(errors="replace").splitlines():
        if ln.startswith("#define ORT_API_VERSION"):
            return int(ln.split()[2])
    return 0


def ort_host_libraries() -> tuple[Path, Path]:
    """(libonnxruntime.so, libonnxruntime_providers_qnn.so) of the onnxruntime and onnxruntime-qnn wheels."""
    found = []
    for pkg, pattern in (("onnxruntime", "capi/libonnxruntime.so*"),
                         ("onnxruntime_qnn", "libonnxruntime_providers_qnn.so")):
        spec = importlib.util.find_spec(pkg)
        libs = sorted(Path(list(spec.submodule_search_locations)[0]).glob(pattern)) \
            if spec is not None and spec.submodule_search_locations else []
        if not libs:
            raise SpecPrefetchError(f"a qnn bundle's host runner needs the {pkg.replace('_', '-')} wheel's "
                                    f"{pattern.split('/')[-1]} (make setup installs it)")
        found.append(libs[-1])
    return found[0], found[1]


def qnn_libraries(htp_arch: int) -> Path:
    """SPX_QNN_LIBS: the user's ONNX Runtime and QNN runtime libraries for the phone (docs/runner.md),
    every one a qnn runner build for --abi android / arm64 ships beside itself."""
    d = os.environ.get("SPX_QNN_LIBS")
    need = [*QNN_PHONE_LIBS, f"libQnnHtpV{htp_arch}Stub.so", f"libQnnHtpV{htp_arch}Skel.so"]
    if not d:
        raise SpecPrefetchError("a qnn bundle's runner for a phone needs ONNX Runtime and Qualcomm's QNN runtime "
                                f"libraries: set SPX_QNN_LIBS to a directory holding {', '.join(need)} "
                                "(docs/runner.md says where each comes from)")
    missing = [n for n in need if not (Path(d) / n).is_file()]
    if missing:
        raise SpecPrefetchError(f"SPX_QNN_LIBS {d}: missing {', '.join(missing)} "
                                "(docs/runner.md says where each comes from)")
    return Path(d)


def tokenizers_source(log: Callable[[str], None]) -> Path:
    """The unpacked pytorch-tokenizers sdist (downloaded once from PyPI and checked against its sha256)."""
    import tarfile
    import urllib.request

    root = runners_dir() / f"pytorch-tokenizers-{TOKENIZERS_VERSION}"
    src = root / f"pytorch_tokenizers-{TOKENIZERS_VERSION}"
    if (src / "src" / "hf_tokenizer.cpp").is_file():
        return src
    log(f"downloading the pytorch-tokenizers {TOKENIZERS_VERSION} sdist from PyPI (the C++ tokenizer, once)")
    runners_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=runners_dir()) as tmp:
        sdist = Path(tmp) / "sdist.tar.gz"
        try:
            with urllib.request.urlopen(TOKENIZERS_SDIST, timeout=120) as r, open(sdist, "wb") as f:
                shutil.copyfileobj(r, f)
        except OSError as e:
            raise SpecPrefetchError(f"download of the pytorch-tokenizers sdist failed ({e}): build with "
                                    "tokenizer=False (`runner build --no-tokenizer`) to take token ids only") from None
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
        if digest != TOKENIZERS_SHA256:
            raise SpecPrefetchError(f"{TOKENIZERS_SDIST}: sha256 {digest}, expected {TOKENIZERS_SHA256}")
        stage = Path(tmp) / "stage"
        with tarfile.open(sdist) as t:
            if hasattr(tarfile, "data_filter"):
                t.extractall(stage, filter="data")
            else:  # Python < 3.11.4: refuse members that would land outside the stage
                for m in t.getmembers():
                    if m.name.startswith(("/", "..")) or ".." in Path(m.name).parts or m.issym() or m.islnk():
                        raise SpecPrefetchError(f"{TOKENIZERS_SDIST}: unsafe member {m.name}")
                t.extractall(stage)
        if root.exists():
            shutil.rmtree(root)
        os.replace(stage, root)
    return src


def tokenizers_dir(abi: str, toolchain: Sequence[str], compiler_id: Sequence[str]) -> Path:
    """Where the tokenizer library for this ABI and toolchain is (or will be) built."""
    project = SRC / "tokenizers"
    key = hashlib.sha256("|".join([abi, *toolchain, *compiler_id, TOKENIZERS_VERSION,
                                   (project / "CMakeLists.txt").read_text()]).encode()).hexdigest()[:12]
    return runners_dir() / f"tokenizers-{TOKENIZERS_VERSION}-{abi}-{key}"


def tokenizers_library(abi: str, toolchain: Sequence[str], compiler_id: Sequence[str],
                       log: Callable[[str], None]) -> Path:
    """Build (once per ABI and toolchain) the tokenizer library: lib/libspx_tokenizers.a, one archive
    of HFTokenizer and everything it links (RE2, Abseil, PCRE2), plus include.txt and version.txt."""
    out = tokenizers_dir(abi, toolchain, compiler_id)
    with _locked(out):
        return _build_tokenizers(out, abi, toolchain, log)


def _build_tokenizers(out: Path, abi: str, toolchain: Sequence[str], log: Callable[[str], None]) -> Path:
    lib = out / "lib" / "libspx_tokenizers.a"
    if lib.is_file() and (out / ".stamp").is_file():
        return out
    project = SRC / "tokenizers"
    with _locked(runners_dir() / f"pytorch-tokenizers-{TOKENIZERS_VERSION}"):
        src = tokenizers_source(log)
    cmake = _tool("cmake", "pip install cmake (a project dependency: make setup)")
    ninja = _tool("ninja", "pip install ninja (a project dependency: make setup)")
    shutil.rmtree(out, ignore_errors=True)
    (out / "lib").mkdir(parents=True)
    build_dir, logf = out / "build", out / "build.log"
    log(f"building the C++ tokenizer (pytorch-tokenizers {TOKENIZERS_VERSION}, {abi}; a few minutes, once)")
    steps = [[cmake, "-S", str(project), "-B", str(build_dir), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
              f"-DTOKENIZERS_SRC={src}", "-DCMAKE_BUILD_TYPE=Release", *toolchain],
             [cmake, "--build", str(build_dir), "--target", "link_closure"]]
    with open(logf, "w") as f:
        for cmd in steps:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
                tail = logf.read_text().strip().splitlines()[-1:]
                raise SpecPrefetchError(f"the C++ tokenizer build ({abi}) failed: {tail[0] if tail else ''} "
                                        f"(full log: {logf})")
    # every archive the link of link_closure needed was built (the rest of Abseil is excluded from
    # all): merged into one, so the runner's link does not depend on their order
    cache = (build_dir / "CMakeCache.txt").read_text()
    ar = next((ln.split("=", 1)[1] for ln in cache.splitlines() if ln.startswith("CMAKE_AR:")), "ar")
    # MRI scripts have no quoting: CMake's own relative names (no spaces), run from the build tree
    archives = sorted(str(a.relative_to(build_dir)) for a in build_dir.rglob("*.a"))
    script = "\n".join(["CREATE libspx_tokenizers.a", *(f"ADDLIB {a}" for a in archives), "SAVE", "END"]) + "\n"
    r = subprocess.run([ar, "-M"], input=script, capture_output=True, text=True, cwd=build_dir)
    if r.returncode != 0 or not (build_dir / "libspx_tokenizers.a").is_file():
        raise SpecPrefetchError(f"merging the tokenizer archives with {ar} failed: {r.stderr.strip()[-200:]}")
    os.replace(build_dir / "libspx_tokenizers.a", lib)
    (out / "include.txt").write_text("\n".join(str(src / d) for d in (
        "include", "third-party/json/single_include", "third-party/re2", "third-party/abseil-cpp")) + "\n")
    (out / "version.txt").write_text(TOKENIZERS_VERSION + "\n")
    shutil.rmtree(build_dir)  # objects are in the archive; the build tree is ~100 MB
    (out / ".stamp").write_text(out.name)
    return out


def default_out(manifest: dict[str, Any], abi: str) -> Path:
    mo = manifest["model"]
    experts = (manifest.get("quantization") or {}).get("experts", "fp16")
    suffix = "-qnn" if backend_of(manifest) == "ort" else ""
    return runners_dir() / f"{mo['family']}-{mo['config_hash']}-{experts}-{abi}{suffix}"


def runner_dir_kind(out: Path) -> str:
    """"absent", "empty", "runner" (a runner build: build.json of format specprefetch-runner; an
    older build's build.json with its abi, or its .configured and spx_config.h) or "foreign"
    (anything else: never written into)."""
    if not (out.exists() or out.is_symlink()):
        return "absent"
    if out.is_symlink() or not out.is_dir():
        return "foreign"
    try:
        if not any(out.iterdir()):
            return "empty"
        if not (out / "build.json").exists():  # an older build stopped before writing it
            return "runner" if (out / ".configured").is_file() and (out / "spx_config.h").is_file() else "foreign"
        info = json.loads((out / "build.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "foreign"
    if isinstance(info, dict) and (info.get("format") == RUNNER_FORMAT
                                   or ("format" not in info and info.get("abi") in ABIS)):
        return "runner"
    return "foreign"


def _in_cache(out: Path) -> bool:
    try:
        return out.resolve().is_relative_to(runners_dir().resolve())
    except OSError:
        return False


def _claim(out: Path, bundle: Path | str) -> None:
    """Refuse an `out` that is, holds or lies inside the bundle or these sources, or that is not a
    new or empty directory or a runner build (nothing is created or changed here)."""
    from toolkit.artifacts import check_inputs

    check_inputs(out, (bundle, SRC), "--out")
    if runner_dir_kind(out) == "foreign":
        what = "is not a directory" if out.exists() and not out.is_dir() else \
            "is a directory that is not a runner build (no build.json of a specprefetch runner)"
        raise SpecPrefetchError(f"--out {out} {what}: a runner build is written only into a new or empty "
                                "directory or one of its own; choose another path")


def build(bundle: Path | str, abi: str = "host", out: Path | str | None = None, *, force: bool = False,
          tokenizer: bool | None = None, overwrite: bool = False,
          log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> Path:
    """Build (or reuse) the runner for `bundle`; returns its output directory (bin/, lib/, spx_config.h).

    `tokenizer`: build the C++ tokenizer in (text in and out) or not (token ids only); None keeps
    what the existing build has, else builds it in. `out` (default: the runner cache's directory
    for this bundle) follows the module's rules: a directory that is not a runner build is
    refused; `overwrite` is needed to replace a runner build of another configuration (or to
    `force` a rebuild of one outside the cache)."""
    from export.manifest import read_manifest, validate_bundle

    if abi not in ABIS:
        raise SpecPrefetchError(f"--abi {abi!r}: choose from {', '.join(ABIS)}")
    _, head = read_manifest(bundle)
    target = head.get("target") if isinstance(head, dict) else None
    if target not in ("executorch", *ORT_TARGETS):
        raise SpecPrefetchError(f"{bundle}: a {target} bundle; the native runner runs executorch, qnn and "
                                "qai-hub bundles")
    graphs = head.get("graphs") if isinstance(head.get("graphs"), dict) else {}
    if target in ORT_TARGETS and graphs.get("format") == "executorch":
        raise SpecPrefetchError(f"{bundle}: a qnn bundle of --qnn-path executorch (an ExecuTorch program with "
                                "ExecuTorch's QNN delegate), which the native runner does not link: run it with "
                                "`specprefetch run`, or export with the default --qnn-path ort")
    if target in ORT_TARGETS and abi == "arm64":
        raise SpecPrefetchError(f"{bundle}: a {target} bundle's phone runner is an --abi android build (a glibc "
                                "arm64 runner can load neither Android's ONNX Runtime nor reach the HTP; "
                                "docs/runner.md, QNN bundles)")
    if out is not None:  # the output's rules first, before any hashing or building
        _claim(Path(out), bundle)
    manifest, _ = validate_bundle(bundle, hash_store=False)
    cache = out is None or _in_cache(Path(out))
    out = Path(out) if out is not None else default_out(manifest, abi)
    cmake = _tool("cmake", "pip install cmake (a project dependency: make setup)")
    ninja = _tool("ninja", "pip install ninja (a project dependency: make setup)")
    header = config_header(manifest)
    toolchain: list[str] = []
    backend_args: list[str] = []  # the ONNX Runtime backend's CMake settings (not the tokenizer's)
    ort = backend_of(manifest) == "ort"
    if ort and abi != "host":  # the user's libraries first: without them nothing else matters
        qnn_libraries(int(manifest["graphs"].get("htp_arch", 79)))
    if abi == "arm64":
        _check_arm64_toolchain()
        toolchain = [f"-DCMAKE_TOOLCHAIN_FILE={SRC / 'cmake' / 'aarch64-linux-gnu.cmake'}"]
    elif abi == "android":
        ndk = _android_ndk(qnn=ort)
        toolchain = [f"-DCMAKE_TOOLCHAIN_FILE={ndk / 'build' / 'cmake' / 'android.toolchain.cmake'}",
                     "-DANDROID_ABI=arm64-v8a", "-DANDROID_PLATFORM=android-29"]
    if ort:  # ONNX Runtime + QNN: the wheels' here, the user's for a phone; the headers from Debian
        pkg = ort_host_libraries()[0] if abi == "host" else qnn_libraries(int(manifest["graphs"].get("htp_arch", 79)))
        backend_args = ["-DSPX_BACKEND=ort", f"-DSPX_ORT_INCLUDE={ort_headers(log)}"]
        if abi == "host":
            lib, ep = ort_host_libraries()
            backend_args += [f"-DSPX_ORT_LIBRARY={lib}", f"-DSPX_QNN_EP_DEFAULT={ep}"]
        else:
            backend_args += [f"-DSPX_ORT_LIBRARY={pkg / 'libonnxruntime.so'}"]
    elif abi == "host":
        pkg = executorch_host_package()
    elif abi == "arm64":
        pkg = executorch_aarch64_package(log)
    else:
        pkg = _executorch_android_prefix()
    compiler = {"arm64": "aarch64-linux-gnu-g++", "host": os.environ.get("CXX", "c++")}.get(abi)
    cc = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()[:1] \
        if compiler and shutil.which(compiler) else []
    with _locked(out):
        return _build(bundle, abi, out, force, tokenizer, header, pkg, toolchain, cc, cmake, ninja, log,
                      cache=cache, overwrite=overwrite, backend_args=backend_args)


def check_phone_build(manifest: dict) -> None:
    """What an --abi android build of this bundle's runner needs from the user, checked without
    building (a qnn bundle: SPX_QNN_LIBS, then the NDK; an executorch bundle: the NDK and
    ExecuTorch's Android build): one line naming what is missing."""
    if backend_of(manifest) == "ort":
        qnn_libraries(int(manifest["graphs"].get("htp_arch", 79)))
        _android_ndk(qnn=True)
    else:
        _android_ndk()
        _executorch_android_prefix()


def installed_files(out: Path) -> dict[str, str]:
    """{relative path: sha256} of what a build installed for running: bin/*, lib/* and run.sh."""
    from toolkit.artifacts import sha256_file

    files = [out / "run.sh"] if (out / "run.sh").is_file() else []
    for sub in ("bin", "lib"):
        if (out / sub).is_dir():
            files += sorted(p for p in (out / sub).rglob("*") if p.is_file() or p.is_symlink())
    return {str(p.relative_to(out)): sha256_file(p) for p in files}


def _stamp_holds(out: Path, stamp: str) -> bool:
    """Whether `out`'s .stamp is `stamp` and every installed file still has its recorded sha256
    (none missing, none added): a damaged binary is never reused."""
    try:
        rec = json.loads((out / ".stamp").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # absent, or an older build's plain stamp: rebuilt (incrementally)
        return False
    if not isinstance(rec, dict) or rec.get("stamp") != stamp or not isinstance(rec.get("files"), dict):
        return False
    if not (out / "bin" / BINARY).is_file():
        return False
    try:
        return installed_files(out) == rec["files"]
    except (OSError, SpecPrefetchError):
        return False


def _build(bundle, abi, out: Path, force: bool, tokenizer: bool | None, header: str, pkg: Path,
           toolchain: list[str], cc: list[str], cmake: str, ninja: str, log: Callable[[str], None], *,
           cache: bool = True, overwrite: bool = False, backend_args: Sequence[str] = ()) -> Path:
    info_path = out / "build.json"
    kind = runner_dir_kind(out)  # again under the lock
    if kind == "foreign":
        raise SpecPrefetchError(f"--out {out} is not a runner build directory; choose another path")
    if tokenizer is None:
        try:
            tokenizer = bool(json.loads(info_path.read_text())["tokenizer"])
        except (OSError, ValueError, KeyError, TypeError):
            tokenizer = True
    tok_dir = tokenizers_dir(abi, toolchain, cc) if tokenizer else None
    # what CMake caches at configure time (the package, its version, the compiler and toolchain)
    configured = hashlib.sha256("|".join([header, abi, str(pkg), _package_version(pkg), *cc, *toolchain,
                                          *backend_args, str(tok_dir)]).encode()).hexdigest()[:16]
    stamp = configured + "-" + _digest(_sources(), "")
    if not force and kind == "runner" and _stamp_holds(out, stamp):
        return out
    was = (out / ".configured").read_text() if (out / ".configured").is_file() else ""
    if kind == "runner" and not cache and not overwrite and (force or was != configured):
        what = "a forced rebuild replaces it" if force else \
            "it holds a runner build of another configuration (bundle config, ABI, toolchain or tokenizer)"
        raise SpecPrefetchError(f"--out {out}: {what}; pass --overwrite to replace it")
    if tok_dir is not None:  # built (once) only when the runner itself must be
        tokenizers_library(abi, toolchain, cc, log)
    out.mkdir(parents=True, exist_ok=True)
    marker = {"format": RUNNER_FORMAT, "abi": abi, "tokenizer": tok_dir is not None,
              "tokenizers_version": TOKENIZERS_VERSION if tok_dir else None}
    info_path.write_text(json.dumps(marker) + "\n")  # first: an interrupted build is still ours
    # a new configuration starts from scratch; a failed or changed build of the same one goes on
    # incrementally (.configured outlives a failed build, .stamp does not)
    if force or was != configured:
        shutil.rmtree(out / "build", ignore_errors=True)
        shutil.rmtree(out / "include", ignore_errors=True)
    (out / ".stamp").unlink(missing_ok=True)
    (out / ".configured").write_text(configured)
    (out / "spx_config.h").write_text(header)
    inc = out / "include"
    src = Path("/usr/include/nlohmann")
    if not (src / "json.hpp").is_file():
        raise SpecPrefetchError("nlohmann/json.hpp not found: apt-get install nlohmann-json3-dev (make setup does)")
    shutil.copytree(src, inc / "nlohmann", dirs_exist_ok=True)  # header-only: the same copy serves a cross build
    build_dir = out / "build"
    logf = out / "build.log"
    configure = [cmake, "-S", str(SRC), "-B", str(build_dir), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
                 f"-DSPX_CONFIG_DIR={out}", f"-DSPX_JSON_INCLUDE={inc}", f"-DCMAKE_PREFIX_PATH={pkg}",
                 f"-DCMAKE_INSTALL_PREFIX={out}", "-DCMAKE_BUILD_TYPE=Release", f"-DSPX_TOKENIZERS_DIR={tok_dir or ''}",
                 *toolchain, *backend_args, *_compiler_cache()]
    log(f"building the native runner ({abi}) for {bundle} in {out}")
    with open(logf, "w") as f:
        for cmd in (configure, [cmake, "--build", str(build_dir)], [cmake, "--install", str(build_dir)]):
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_compiler_cache_env(out))
            if r.returncode != 0:
                tail = logf.read_text().strip().splitlines()[-1:]
                raise SpecPrefetchError(f"native runner build ({abi}) failed: {tail[0] if tail else ''} "
                                        f"(full log: {logf})")
    if backend_args:  # the ONNX Runtime backend
        _ship_ort(pkg, out, abi)
    elif abi == "arm64":
        _ship_arm64(pkg, out)
    else:  # the same entry point everywhere (device push and bench start run.sh)
        _launcher(out, f'exec "$D/bin/{BINARY}" "$@"')
    info_path.write_text(json.dumps(marker) + "\n")
    (out / ".stamp").write_text(json.dumps({"stamp": stamp, "files": installed_files(out)}) + "\n")
    return out


def _compiler_cache() -> list[str]:
    """ccache as the compiler launcher where it is installed (make setup installs it; SPX_CCACHE=0
    turns it off): the runner's sources other than main.cpp do not depend on the bundle, so a second
    bundle's build (another model, or an ONNX Runtime runner beside an ExecuTorch one) compiles only
    what differs. Always set, empty when off, so a configured build directory follows the change."""
    on = os.environ.get("SPX_CCACHE", "1") != "0" and shutil.which("ccache")
    return [f"-DCMAKE_CXX_COMPILER_LAUNCHER={'ccache' if on else ''}"]


def _compiler_cache_env(out: Path) -> dict[str, str]:
    """The build's own paths (its spx_config.h and include/ in `out`) rewritten relative to its
    build directory `out`/build, the sources' left absolute, so two builds compile a shared source
    with the same command; the build directory itself not hashed."""
    return {**os.environ, "CCACHE_BASEDIR": str(out.resolve().parent), "CCACHE_NOHASHDIR": "1"}


def _ship_arm64(pkg: Path, out: Path) -> None:
    """Put beside the binary what it needs to start from `adb shell`: the ExecuTorch libraries, the
    glibc loader and the C/C++ runtime (a phone has none of these), and a launcher script."""
    lib = out / "lib"
    lib.mkdir(exist_ok=True)
    for so in (pkg / "lib").glob("*.so*"):
        if "openvino" in so.name or "qnn" in so.name:  # delegates this runner never loads
            continue
        shutil.copy2(so, lib / so.name)
    for name in AARCH64_RUNTIME:
        src = AARCH64_SYSROOT / "lib" / name
        if src.exists():
            shutil.copy2(src.resolve(), lib / name)
    # SPX_EMULATOR: empty on a phone; `qemu-aarch64` where the device stand-in runs it on x86-64
    _launcher(out, f'exec $SPX_EMULATOR "$D/lib/ld-linux-aarch64.so.1" --library-path "$D/lib" "$D/bin/{BINARY}" "$@"',
              "start the runner with its own loader and libraries (docs/runner.md)")


def _ship_ort(pkg: Path, out: Path, abi: str) -> None:  # abi: host or android
    """A qnn bundle's runner: libonnxruntime.so.1 in lib/ (a link to the wheel's here); for a phone
    (--abi android), every library of SPX_QNN_LIBS copied into lib/, and run.sh pointing the QNN libraries at them
    (LD_LIBRARY_PATH for the HTP backend's own loads, ADSP_LIBRARY_PATH for the skel the DSP loads)."""
    lib = out / "lib"
    if lib.is_symlink() or lib.is_file():
        lib.unlink()
    elif lib.exists():
        shutil.rmtree(lib)
    lib.mkdir()
    if abi == "host":
        (lib / "libonnxruntime.so.1").symlink_to(pkg)
        _launcher(out, f'exec "$D/bin/{BINARY}" "$@"')
        return
    for so in sorted(pkg.glob("*.so")):
        shutil.copy2(so, lib / so.name)
    os.symlink("libonnxruntime.so", lib / "libonnxruntime.so.1")
    # the DSP's search path is ';'-separated: the skel beside the runner first, then the system's
    env = ('export LD_LIBRARY_PATH="$D/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" '
           'ADSP_LIBRARY_PATH="$D/lib;${ADSP_LIBRARY_PATH:-/vendor/dsp/cdsp;/vendor/lib/rfsa/adsp;/system/lib/rfsa/adsp;/dsp}"')
    _launcher(out, f'{env}\nexec "$D/bin/{BINARY}" "$@"',
              "start the runner with the QNN libraries beside it (docs/runner.md)")


def _launcher(out: Path, line: str, what: str = "start the runner (docs/runner.md)") -> None:
    """run.sh beside bin/: how `adb shell` (and device bench, as `sh run.sh ...`) starts the runner."""
    launcher = out / "run.sh"
    launcher.write_text(f'#!/system/bin/sh\n# {what}\nD=$(cd "$(dirname "$0")" && pwd)\n{line}\n')
    launcher.chmod(0o755)


def command(out: Path, abi: str) -> list[str]:
    """The argv prefix that starts the built runner here (the arm64 build under qemu-aarch64 on x86-64)."""
    binary = out / "bin" / BINARY
    if abi == "host":
        return [str(binary)]
    if abi == "android":
        raise SpecPrefetchError("an --abi android runner runs on the phone (adb push it; docs/runner.md), not here")
    loader = [str(out / "lib" / "ld-linux-aarch64.so.1"), "--library-path", str(out / "lib"), str(binary)]
    if platform.machine() in ("aarch64", "arm64"):
        return loader
    return [_tool("qemu-aarch64", "apt-get install qemu-user (make setup installs it)"), *loader]


def has_tokenizer(out: Path) -> bool:
    """Whether the runner built in `out` reads text (its C++ tokenizer built in)."""
    try:
        return bool(json.loads((Path(out) / "build.json").read_text())["tokenizer"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def run_native(bundle: Path | str, prompts: Sequence[str | Sequence[int]], *, abi: str = "host",
               max_new_tokens: int = 32,
               policy: str | None = None, pool_mib: float | None = None, window: int | None = None,
               queue_depth: int | None = None, min_confidence: float | None = None, threads: int | None = None,
               step_budget_kib: int | None = None, read_budget_kib: int | None = None,
               events: Path | None = None, routing: Path | None = None,
               cold: bool = False, isa: str | None = None, extra: Sequence[str] = (), timeout: float | None = None,
               runner: Path | None = None,
               log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> dict[str, Any]:
    """Run the native runner on `bundle` and return its JSON (building the runner first if needed).
    A prompt is text (the runner's tokenizer encodes it) or token ids. `runner`: a build of it
    already made (build's result), so repeated runs do not re-check the bundle and the sources."""
    out = Path(runner) if runner is not None else build(bundle, abi, log=log)
    args = [str(bundle)]
    for p in prompts:
        args += ["--prompt", p] if isinstance(p, str) else ["--prompt-ids", ",".join(str(int(i)) for i in p)]
    args += ["--max-new-tokens", str(max_new_tokens)]
    opts = {"--policy": policy, "--pool-mib": pool_mib, "--window": window, "--queue-depth": queue_depth,
            "--min-confidence": min_confidence, "--step-budget-kib": step_budget_kib,
            "--read-budget-kib": read_budget_kib, "--events": events,
            "--routing": routing, "--isa": isa, "--threads": threads}
    for k, v in opts.items():
        if v is not None:
            args += [k, repr(v) if isinstance(v, float) else str(v)]
    if cold:
        args.append("--cold")
    args += list(extra)
    with tempfile.TemporaryDirectory() as tmp:
        js = Path(tmp) / "run.json"
        try:
            r = subprocess.run([*command(out, abi), *args, "--json", str(js)], capture_output=True, text=True,
                               timeout=timeout)
        except subprocess.TimeoutExpired:
            raise SpecPrefetchError(f"native runner: no result in {timeout:.0f} s (killed)") from None
        if r.returncode != 0:
            lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
            msg = lines[-1] if lines else f"exit code {r.returncode}"
            if r.returncode < 0 or r.returncode >= 128:  # killed by a signal (directly, or under the launcher)
                import signal

                sig = -r.returncode if r.returncode < 0 else r.returncode - 128
                try:
                    name = signal.Signals(sig).name
                except ValueError:
                    name = f"signal {sig}"
                raise SpecPrefetchError(f"native runner crashed ({name}) on {bundle}"
                                        + (f": {msg}" if lines else "") + " (a bug, or a damaged bundle: "
                                        f"`specprefetch inspect {bundle}`)")
            raise SpecPrefetchError(msg.removeprefix("specprefetch-runner: error: ")
                                    if r.returncode == 1 else f"native runner failed ({r.returncode}): {msg}")
        return read_json(js, "native runner result")
