"""The native runner's CRC-32 (android_runner/src/crc32.h), which checks every expert read: its
hardware paths (x86-64's PCLMULQDQ folding on the host, aarch64's CRC32 instructions in a static
build under qemu-aarch64) and its table code equal zlib's, whole, from any offset and chained, at
every length around their block sizes (8, 16 and 64 bytes) and at an expert's size; the dispatch
takes the hardware path where the CPU has it."""
from __future__ import annotations

import platform
import random
import shutil
import subprocess
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "android_runner" / "src"
CHECK = REPO / "android_runner" / "tests" / "check_crc32.cpp"


def _expected_host_impl() -> str:
    """What the dispatch must choose on this machine, from the kernel's CPU flags (x86-64 `flags`,
    aarch64 `Features`)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo to tell which CRC path this CPU has")
    flags: set[str] = set()
    for line in text.splitlines():
        if line.split(":", 1)[0].strip() in ("flags", "Features"):
            flags |= set(line.split(":", 1)[1].split())
    machine = platform.machine()
    if machine in ("x86_64", "AMD64"):
        return "pclmul" if "pclmulqdq" in flags else "portable"
    if machine in ("aarch64", "arm64"):
        return "armv8-crc" if "crc32" in flags else "portable"
    return "portable"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[Path]:
    """Random files of every length 0..200, lengths around the 64-byte folding step, and an expert's
    size (864 KiB, the phone-class model's int4 slot) plus a few bytes."""
    d = tmp_path_factory.mktemp("crc")
    rng = random.Random(0)
    sizes = [*range(201), *(64 * m + r for m in (3, 4, 5, 16) for r in (-1, 0, 1, 15, 16, 17, 47, 48, 63)),
             884736, 884736 + 13]
    out = []
    for n in sizes:
        p = d / f"f{n}"
        p.write_bytes(rng.randbytes(n))
        out.append(p)
    return out


def _build(cxx: str, out: Path, *extra: str) -> None:
    r = subprocess.run([cxx, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{SRC}", *extra, str(CHECK),
                        str(SRC / "crc32.cpp"), "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, f"{cxx} check_crc32:\n{r.stderr}"


def _check(cmd: list[str], files: list[Path]) -> str:
    r = subprocess.run([*cmd, *map(str, files)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    impl, *lines = r.stdout.splitlines()
    assert len(lines) == len(files)
    for p, line in zip(files, lines):
        data = p.read_bytes()
        crc, portable, chained, n = map(int, line.split())
        want = zlib.crc32(data)
        assert (crc, portable, chained) == (want, want, want), (p.name, impl, line)
        assert n == len(data) * 7 // 13
    return impl


def test_host(files, tmp_path):
    if not shutil.which("g++"):
        pytest.skip("g++ not on PATH")
    exe = tmp_path / "check_crc32"
    _build("g++", exe)
    impl = _check([str(exe)], files)
    # the hardware path whenever the CPU has it: a dispatch that fell back would pass the sums above
    assert impl == _expected_host_impl()


def test_aarch64_under_qemu(files, tmp_path):
    cross, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if not (cross and qemu):
        pytest.skip("aarch64-linux-gnu-g++ and qemu-aarch64 are needed for the aarch64 build")
    exe = tmp_path / "check_crc32_a64"
    _build(cross, exe, "-static")
    assert _check([qemu, "-cpu", "max", str(exe)], files) == "armv8-crc"
