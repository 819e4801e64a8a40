"""The native expert kernels (android_runner/src/kernels*.cpp) against the toolkit's Python reference.

Blobs are built with the toolkit's own layout and quantisation code (the same packing build_store
does); the reference is `dequantize` + the family's `expert_forward` in float32. Each available ISA
runs the blobs through android_runner/tests/check_kernels: portable and (when the CPU has it) AVX2
natively, NEON in a static aarch64 build under qemu-aarch64 when the cross compiler and qemu exist.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import subprocess
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from toolkit.models.expert_layout import ALIGN, align, blob_sections
from toolkit.models.families import family_by_name
from toolkit.runtime.expert_store import dequantize, quantize

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "android_runner" / "src"
CHECK = REPO / "android_runner" / "tests" / "check_kernels.cpp"
KERNEL_SOURCES = sorted(SRC.glob("kernels*.cpp"))
FP16_MIN_NORMAL = float(np.float16(6.104e-5))  # 2**-14
ISAS = ("portable", "avx2", "neon")


def _compile_cmd(cxx: str, out: Path, *extra: str) -> list[str]:
    return [cxx, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{SRC}", *extra, str(CHECK),
            *map(str, KERNEL_SOURCES), "-o", str(out)]


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, list[str] | str]:
    """{"host": command prefix, "aarch64": command prefix or a skip reason}. Both compiles run at once."""
    if not shutil.which("g++"):
        pytest.skip("g++ not on PATH")
    d = tmp_path_factory.mktemp("kernels")
    jobs = {"host": subprocess.Popen(_compile_cmd("g++", d / "check_kernels"), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)}
    cross, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    out: dict[str, list[str] | str] = {}
    if cross and qemu:
        jobs["aarch64"] = subprocess.Popen(_compile_cmd(cross, d / "check_kernels_a64", "-static"),
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    else:
        out["aarch64"] = "aarch64-linux-gnu-g++ and qemu-aarch64 are needed for the NEON kernels"
    for name, p in jobs.items():
        log, _ = p.communicate()
        assert p.returncode == 0, f"{name} build of check_kernels failed:\n{log}"
    out["host"] = [str(d / "check_kernels")]
    if "aarch64" in jobs:
        out["aarch64"] = [qemu, str(d / "check_kernels_a64")]
    return out


def _host_has_avx2() -> bool:
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return all(f in flags.split() for f in ("avx2", "fma", "f16c"))


def runner(builds, isa: str) -> list[str]:
    """The command prefix that runs check_kernels for `isa`, or a skip."""
    if isa == "neon":
        if isinstance(builds["aarch64"], str):
            pytest.skip(builds["aarch64"])
        return builds["aarch64"]
    if isa == "avx2" and not _host_has_avx2():
        pytest.skip("this CPU has no AVX2+FMA+F16C")
    return builds["host"]


# -- building cases ------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    layout: dict
    blobs: bytes
    x: np.ndarray          # [count, H] float32
    ref: np.ndarray        # [count, H] float32
    sections: list
    shapes: dict


def _expert_mats(family: str, h: int, i: int) -> list[tuple[str, tuple[int, ...]]]:
    mats = [("gate", (i, h)), ("up", (i, h)), ("down", (h, i))]
    if family == "gpt_oss":
        mats += [("bias_gate", (i,)), ("bias_up", (i,)), ("bias_down", (h,))]
    return mats


def _adversarial_arrays(rng: np.random.Generator, shape: tuple[int, int], dtype: str) -> list[np.ndarray]:
    """Raw stored arrays with extreme values the quantiser never writes but the format allows:
    fp16 maxima, subnormals and zeros; int8 -128/127 and whole zero rows; int4 -8 and 7 in every
    row, garbage in the padding nibbles; scales of exactly the fp16 min normal, zero and large."""
    o, i = shape
    if dtype == "fp16":
        w = rng.standard_normal(shape).astype(np.float32)
        pick = rng.random(shape)
        w[pick < 0.05] = 0.0
        w[(pick >= 0.05) & (pick < 0.08)] = 6e-8 * np.sign(rng.standard_normal(((pick >= 0.05) & (pick < 0.08)).sum()))
        w[(pick >= 0.08) & (pick < 0.10)] = FP16_MIN_NORMAL
        w[(pick >= 0.10) & (pick < 0.12)] = 65504.0 * np.sign(rng.standard_normal(((pick >= 0.10) & (pick < 0.12)).sum()))
        w[0] = 0.0
        return [w.astype(np.float16)]
    scales = np.array([FP16_MIN_NORMAL, 0.0, 1.0, 100.0, 0.013, 3.5e3], np.float32)
    if dtype == "int8":
        q = rng.integers(-128, 128, shape).astype(np.int8)
        q[:, 0], q[:, -1] = -128, 127
        q[min(1, o - 1)] = 0
        sc = rng.choice(scales, o).astype(np.float16)
        sc[0] = FP16_MIN_NORMAL
        return [q, sc]
    ip = align(i, 32)
    q = rng.integers(-8, 8, (o, ip)).astype(np.int8)
    q[:, 0], q[:, i - 1] = -8, 7
    if i > 2:
        q[:, 1] = 7
    q[min(1, o - 1), :i] = 0
    u = (q.astype(np.int16) & 0xF).astype(np.uint8)   # columns >= i keep random nibbles (padding)
    packed = (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)
    sc = rng.choice(scales, (o, ip // 32)).astype(np.float16)
    sc[0, 0] = FP16_MIN_NORMAL
    return [packed, sc]


def _pack(sections, mats, arrays_by_role, blob_size) -> bytearray:
    """Arrays written into a blob at their section offsets, as build_store does."""
    blob = bytearray(blob_size)
    si = 0
    for role, _ in mats:
        for a in arrays_by_role[role]:
            s = sections[si]
            raw = np.ascontiguousarray(a).tobytes()
            assert len(raw) == s.nbytes, (role, s)
            blob[s.offset:s.offset + s.nbytes] = raw
            si += 1
    return blob


def tc_for(family: str, hidden_act: str, limit: float):
    return types.SimpleNamespace(hidden_act=hidden_act, swiglu_limit=limit)


@functools.lru_cache(maxsize=None)
def make_case(dtype: str, family: str, h: int, i: int, values: str, hidden_act: str = "silu",
              limit: float = 7.0, count: int = 3, seed: int = 0) -> Case:
    rng = np.random.default_rng([seed, h, i, len(values), ord(dtype[-1]), len(family), len(hidden_act)])
    mats = _expert_mats(family, h, i)
    sections, blob_size = blob_sections(mats, dtype)
    stride = align(blob_size, ALIGN)
    fam = family_by_name("gpt_oss" if family == "gpt_oss" else "qwen3_moe")
    shapes = dict(mats)
    blobs = bytearray(stride * count)
    xs = rng.standard_normal((count, h)).astype(np.float32)
    if values == "adversarial":
        xs[:, ::7] *= 50.0
        xs[:, 3::11] = 0.0
    refs = []
    # GPT-OSS: weights large enough that the clamps at +-limit engage
    wscale = 0.5 if family == "gpt_oss" else 0.15
    for n in range(count):
        arrays = {}
        for role, shape in mats:
            if len(shape) == 1:
                arrays[role] = [(rng.standard_normal(shape) * 2.0).astype(np.float16)]
            elif values == "adversarial":
                arrays[role] = _adversarial_arrays(rng, shape, dtype)
            else:
                arrays[role] = quantize(torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * wscale), dtype)
        blob = _pack(sections, mats, arrays, blob_size)
        blobs[n * stride:n * stride + blob_size] = blob
        w = dequantize(bytes(blob), sections, shapes)
        with torch.no_grad():
            y = fam.expert_forward(w, torch.from_numpy(xs[n][None]), tc_for(family, hidden_act, limit))[0]
        refs.append(y.float().numpy())
    layout = {"sections": [{**dataclasses.asdict(s), "shape": list(s.shape)} for s in sections],
              "matrices": [{"role": r, "shape": list(sh)} for r, sh in mats],
              "family": family, "hidden_act": hidden_act, "swiglu_limit": limit, "count": count, "stride": stride}
    return Case(layout, bytes(blobs), xs, np.stack(refs), sections, shapes)


def run_kernels(cmd: list[str], isa: str, case: Case, tmp: Path, layout: dict | None = None,
                blobs: bytes | None = None) -> subprocess.CompletedProcess:
    (tmp / "layout.json").write_text(json.dumps(layout if layout is not None else case.layout))
    (tmp / "blobs.bin").write_bytes(case.blobs if blobs is None else blobs)
    (tmp / "x.bin").write_bytes(case.x.tobytes())
    return subprocess.run([*cmd, isa, str(tmp / "layout.json"), str(tmp / "blobs.bin"), str(tmp / "x.bin"),
                           str(tmp / "y.bin")], capture_output=True, text=True, timeout=60)


def kernel_output(cmd, isa, case, tmp, **kw) -> np.ndarray:
    p = run_kernels(cmd, isa, case, tmp, **kw)
    assert p.returncode == 0, p.stderr
    return np.fromfile(tmp / "y.bin", dtype=np.float32).reshape(case.x.shape)


def assert_matches(y: np.ndarray, ref: np.ndarray, what: str) -> None:
    """rtol 1e-4 and atol 1e-5 of each output vector's scale (float32 sums in a different order)."""
    assert np.isfinite(ref).all(), f"{what}: the reference itself is not finite"
    for n in range(ref.shape[0]):
        scale = float(np.abs(ref[n]).max()) or 1.0
        np.testing.assert_allclose(y[n], ref[n], rtol=1e-4, atol=1e-5 * scale, err_msg=f"{what}, blob {n}")


# -- tests -----------------------------------------------------------------------------------------

SHAPES = [(37, 53), (64, 96), (256, 80), (6, 3), (40, 19)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("values", ["normal", "adversarial"])
@pytest.mark.parametrize("family", ["default", "gpt_oss"])
@pytest.mark.parametrize("dtype", ["fp16", "int8", "int4"])
def test_forward_matches_reference(builds, tmp_path, isa, dtype, family, values):
    cmd = runner(builds, isa)
    for h, i in SHAPES:
        case = make_case(dtype, family, h, i, values)
        y = kernel_output(cmd, isa, case, tmp_path)
        assert_matches(y, case.ref, f"{isa} {dtype} {family} {values} H={h} I={i}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("act", ["silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new"])
def test_activations(builds, tmp_path, isa, act):
    cmd = runner(builds, isa)
    for dtype in ("fp16", "int4"):
        case = make_case(dtype, "default", 37, 53, "normal", hidden_act=act)
        assert_matches(kernel_output(cmd, isa, case, tmp_path), case.ref, f"{isa} {dtype} {act}")


@pytest.mark.parametrize("isa", ISAS)
def test_gpt_oss_limit_is_applied(builds, tmp_path, isa):
    """A non-default swiglu_limit, with gate and up values beyond it (so the clamps matter)."""
    cmd = runner(builds, isa)
    case = make_case("int8", "gpt_oss", 64, 96, "normal", limit=2.5)
    w = dequantize(case.blobs[:case.layout["stride"]], case.sections, case.shapes)
    x = torch.from_numpy(case.x[0])
    assert ((x @ w["gate"].t() + w["bias_gate"]) > 2.5).any()
    assert ((x @ w["up"].t() + w["bias_up"]) < -2.5).any()
    assert_matches(kernel_output(cmd, isa, case, tmp_path), case.ref, f"{isa} limit 2.5")
    # the same blobs under the default limit give other outputs: the limit reaches the kernel
    other = make_case("int8", "gpt_oss", 64, 96, "normal", limit=2.5).layout | {"swiglu_limit": 7.0}
    y7 = kernel_output(cmd, isa, case, tmp_path, layout=other)
    assert not np.allclose(y7, case.ref, rtol=1e-3, atol=1e-3 * np.abs(case.ref).max())


@pytest.mark.parametrize("isa", ISAS)
def test_swapped_nibbles_are_caught(builds, tmp_path, isa):
    """The comparison can fail: an int4 blob with its nibble order swapped gives other outputs."""
    cmd = runner(builds, isa)
    case = make_case("int4", "default", 64, 96, "normal")
    blobs = bytearray(case.blobs)
    for n in range(case.layout["count"]):
        for s in case.sections:
            if s.kind == "weight":
                lo = n * case.layout["stride"] + s.offset
                a = np.frombuffer(bytes(blobs[lo:lo + s.nbytes]), np.uint8)
                blobs[lo:lo + s.nbytes] = ((a >> 4) | (a << 4)).astype(np.uint8).tobytes()
    y = kernel_output(cmd, isa, case, tmp_path, blobs=bytes(blobs))
    with pytest.raises(AssertionError):
        assert_matches(y, case.ref, "swapped")


def test_refusals(builds, tmp_path):
    cmd = builds["host"]
    case = make_case("fp16", "default", 6, 3, "normal")
    lay = case.layout

    def refused(layout, needle):
        p = run_kernels(cmd, "portable", case, tmp_path, layout=layout)
        assert p.returncode == 1 and needle in p.stderr, (p.returncode, p.stderr)

    refused(lay | {"hidden_act": "relu"}, "'relu'")
    refused(lay | {"sections": [s for s in lay["sections"] if s["role"] != "down"],
                   "matrices": [m for m in lay["matrices"] if m["role"] != "down"]}, "'down'")
    refused(lay | {"sections": [s for s in lay["sections"] if s["role"] != "down"]}, "'down'")
    refused(lay | {"matrices": [m if m["role"] != "down" else {"role": "down", "shape": [6, 4]}
                                for m in lay["matrices"]]}, "down")
    refused(lay | {"family": "gpt_oss"}, "bias_gate")  # GPT-OSS needs biases
    int4 = make_case("int4", "default", 40, 19, "normal").layout
    refused(int4 | {"sections": [s for s in int4["sections"] if not (s["role"] == "up" and s["kind"] == "scale")]},
            "scale")
    # an ISA this build/CPU cannot run: exit status 2
    other = "neon" if Path("/proc/cpuinfo").exists() and _host_has_avx2() else None
    if other:
        p = run_kernels(cmd, other, case, tmp_path)
        assert p.returncode == 2 and "not available" in p.stderr


def test_bench_runs(builds, tmp_path):
    case = make_case("int4", "default", 64, 96, "normal")
    run_kernels(builds["host"], "portable", case, tmp_path)
    p = subprocess.run([*builds["host"], "--bench", "--iters", "20", "all", str(tmp_path / "layout.json"),
                        str(tmp_path / "blobs.bin"), str(tmp_path / "x.bin")], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert "bench isa=portable dtype=int4" in p.stdout and "hot_ns=" in p.stdout


@pytest.mark.parametrize("target", ["host", "aarch64"])
def test_portable_half_conversion_is_exact(builds, tmp_path, target):
    """The portable fp16 -> fp32 conversion, bit for bit, for all 65536 halves (NaN payloads too)."""
    if isinstance(builds[target], str):
        pytest.skip(builds[target])
    p = subprocess.run([*builds[target], "--f16-table", str(tmp_path / "t.bin")], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    got = np.fromfile(tmp_path / "t.bin", dtype=np.uint32)
    want = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
    nan = np.isnan(want.view(np.float32))
    np.testing.assert_array_equal(got[~nan], want[~nan])
    # NaNs: numpy may quiet them; the kernels keep sign and payload (quiet bit aside)
    np.testing.assert_array_equal(got[nan] & ~np.uint32(0x00400000), want[nan] & ~np.uint32(0x00400000))
    assert np.isnan(got[nan].view(np.float32)).all()
