"""The native expert kernels (android_runner/src/kernels*.cpp) against the toolkit's Python reference.

Blobs are built with the toolkit's own layout and quantisation code (the same packing build_store
does). The reference for fp16 blobs is `dequantize` + the family's `expert_forward` in float32; for
int8 / int4 blobs it is toolkit/runtime/experts.py's integer path (activations quantised per block of
32, exact block sums, float32 scaling in block order), which every integer kernel must match BITWISE
per matrix. Each available ISA runs the blobs through the check_kernels tool
(android_runner/tests/check_kernels.cpp): portable, AVX2, AVX-VNNI and AVX512-VNNI natively (where
the CPU has them), NEON, NEON dotprod and NEON i8mm in a static aarch64 build under qemu-aarch64 -cpu
max when the cross compiler and qemu exist.
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
from toolkit.runtime.experts import integer_matrices, qmatmul, quantize_act, quantized_expert

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "android_runner" / "src"
CHECK = REPO / "android_runner" / "tests" / "check_kernels.cpp"
BENCH = REPO / "android_runner" / "tests" / "bench_kernels.cpp"
KERNEL_SOURCES = sorted(SRC.glob("kernels*.cpp")) + [SRC / "parallel.cpp"]
FP16_MIN_NORMAL = float(np.float16(6.104e-5))  # 2**-14
HOST_ISAS = ("portable", "avx2", "avx_vnni", "avx512_vnni")
ARM_ISAS = ("neon", "neon_dotprod", "neon_i8mm")
ISAS = HOST_ISAS + ARM_ISAS
INT_ISAS = ISAS + ("a64_portable",)  # the aarch64 build's portable kernels
# the float-path tests: the VNNI / dotprod / i8mm ISAs share avx2's / neon's float kernels, and their
# integer kernels are checked bitwise against portable (test_isas_agree_bitwise) and the reference
FLOAT_ISAS = ("portable", "avx2", "neon")


def _host_has(flag: str) -> bool:
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return flag in flags.split()


# `make test` runs the integer checks on a representative ISA of each kind: host portable, the best x86 SIMD
# path this CPU has (AVX-VNNI, else AVX2: so a CPU without AVX-VNNI still runs an x86 SIMD check of them),
# arm dotprod and its portable build (but for the batch test's exceptions said there); every other ISA's run of
# them is marked slow (`make test-all`); the other
# ISAs' `forward` (one token, one thread) is still held bit for bit to portable's by test_isas_agree_bitwise
FAST_INT_ISAS = ("portable", "avx_vnni" if _host_has("avx_vnni") else "avx2", "neon_dotprod", "a64_portable")


def _isas(isas):
    return [pytest.param(i, marks=() if i in FAST_INT_ISAS else pytest.mark.slow) for i in isas]


def _flags(cxx: str, *extra: str) -> list[str]:
    return [cxx, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-ffp-contract=off", "-pthread", f"-I{SRC}",
            *extra]


def _compile_cmd(cxx: str, out: Path, *extra: str, main: Path = CHECK) -> list[str]:
    return [*_flags(cxx, *extra), str(main), *map(str, KERNEL_SOURCES), "-o", str(out)]


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, list[str] | str]:
    """{"host": command prefix, "bench": command prefix, "aarch64": command prefix or a skip reason}.
    The host's kernel sources compile once (check_kernels and bench_kernels link the same objects),
    beside the aarch64 build."""
    if not shutil.which("g++"):
        pytest.skip("g++ not on PATH")
    d = tmp_path_factory.mktemp("kernels")
    (d / "obj").mkdir()

    def start(cmd: list[str], cwd: Path | None = None) -> subprocess.Popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)

    def done(name: str, p: subprocess.Popen) -> None:
        log, _ = p.communicate()
        assert p.returncode == 0, f"{name} build of check_kernels failed:\n{log}"

    # the kernel objects in obj/ (g++ -c names each after its source)
    jobs = {"host": start([*_flags("g++"), "-c", *map(str, KERNEL_SOURCES)], cwd=d / "obj")}
    cross, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    out: dict[str, list[str] | str] = {}
    if cross and qemu:
        jobs["aarch64"] = start(_compile_cmd(cross, d / "check_kernels_a64", "-static"))
    else:
        out["aarch64"] = "aarch64-linux-gnu-g++ and qemu-aarch64 are needed for the NEON kernels"
    done("host", jobs.pop("host"))
    objs = [str(d / "obj" / (s.stem + ".o")) for s in KERNEL_SOURCES]
    links = {name: start([*_flags("g++"), str(main), *objs, "-o", str(d / exe)])
             for name, exe, main in (("host", "check_kernels", CHECK), ("bench", "bench_kernels", BENCH))}
    for name, p in {**links, **jobs}.items():
        done(name, p)
    out["host"] = [str(d / "check_kernels")]
    out["bench"] = [str(d / "bench_kernels")]
    if "aarch64" in jobs:
        out["aarch64"] = [qemu, "-cpu", "max", str(d / "check_kernels_a64")]
    return out


def _host_has_avx2() -> bool:
    return all(_host_has(f) for f in ("avx2", "fma", "f16c"))


def runner(builds, isa: str) -> tuple[list[str], str]:
    """(the command prefix that runs check_kernels for `isa`, the ISA name it takes), or a skip."""
    if isa in ARM_ISAS or isa == "a64_portable":
        if isinstance(builds["aarch64"], str):
            pytest.skip(builds["aarch64"])
        return builds["aarch64"], "portable" if isa == "a64_portable" else isa
    if isa != "portable" and not _host_has_avx2():
        pytest.skip("this CPU has no AVX2+FMA+F16C")
    return builds["host"], isa


# -- building cases ------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    layout: dict
    blobs: bytes
    x: np.ndarray          # [count, H] float32
    ref: np.ndarray        # [count, H] float32
    sections: list
    shapes: dict
    slack: np.ndarray | None = None  # int8 / int4: [count, H] what two GLU quantisation flips may change


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
        big = (pick >= 0.10) & (pick < 0.12)
        w[big] = 65504.0 * np.sign(rng.standard_normal(big.sum()))
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
    refs, slacks = [], []
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
        tc = tc_for(family, hidden_act, limit)
        x1 = torch.from_numpy(xs[n][None])
        with torch.no_grad():
            if dtype == "fp16":
                y = fam.expert_forward(w, x1, tc)[0]
            else:  # the integer path: bitwise per matrix, the GLU's exp / erf / tanh aside
                y = quantized_expert(bytes(blob), sections, shapes, "gpt_oss" if family == "gpt_oss" else family,
                                     tc, x1)[0]
                m = integer_matrices(bytes(blob), sections, shapes)
                from toolkit.runtime.experts import glu
                h = glu("gpt_oss" if family == "gpt_oss" else family, tc, qmatmul(x1, *m["gate"]),
                        qmatmul(x1, *m["up"]), m)
                # the GLU rounds differently natively: an element of h may quantise one step off
                slacks.append(2.0 * w["down"].abs().amax(1).numpy() * float(quantize_act(h)[1].max()))
        refs.append(y.float().numpy())
    layout = {"sections": [{**dataclasses.asdict(s), "shape": list(s.shape)} for s in sections],
              "matrices": [{"role": r, "shape": list(sh)} for r, sh in mats],
              "family": family, "hidden_act": hidden_act, "swiglu_limit": limit, "count": count, "stride": stride}
    return Case(layout, bytes(blobs), xs, np.stack(refs), sections, shapes, np.stack(slacks) if slacks else None)


def run_kernels(cmd: list[str], isa: str, case: Case, tmp: Path, layout: dict | None = None,
                blobs: bytes | None = None) -> subprocess.CompletedProcess:
    (tmp / "layout.json").write_text(json.dumps(layout if layout is not None else case.layout))
    (tmp / "blobs.bin").write_bytes(case.blobs if blobs is None else blobs)
    (tmp / "x.bin").write_bytes(case.x.tobytes())
    return subprocess.run([*cmd, isa, str(tmp / "layout.json"), str(tmp / "blobs.bin"), str(tmp / "x.bin"),
                           str(tmp / "y.bin")], capture_output=True, text=True, timeout=60)


def kernel_output(cmd, isa, case, tmp, **kw) -> np.ndarray:
    p = run_kernels(cmd, isa, case, tmp, **kw)
    if p.returncode == 2 and "not available" in p.stderr:
        pytest.skip(f"{isa}: not on this CPU")
    assert p.returncode == 0, p.stderr
    return np.fromfile(tmp / "y.bin", dtype=np.float32).reshape(case.x.shape)


def assert_matches(y: np.ndarray, ref: np.ndarray, what: str, slack: np.ndarray | None = None) -> None:
    """rtol 1e-4 and atol 1e-5 of each output vector's scale (float32 sums in a different order); for
    the integer path also `slack` (a GLU value quantised one step off, twice, at most)."""
    assert np.isfinite(ref).all(), f"{what}: the reference itself is not finite"
    for n in range(ref.shape[0]):
        scale = float(np.abs(ref[n]).max()) or 1.0
        bound = 1e-5 * scale + (slack[n] if slack is not None else 0.0) + 1e-4 * np.abs(ref[n])
        err = np.abs(y[n].astype(np.float64) - ref[n])
        bad = ~(err <= bound)
        assert not bad.any(), (f"{what}, blob {n}: {int(bad.sum())} of {bad.size} outputs off, worst at "
                               f"{int(np.argmax(err - bound))}: got {y[n][bad][:4]}, want {ref[n][bad][:4]}")


# -- tests -----------------------------------------------------------------------------------------

SHAPES = [(37, 53), (64, 96), (256, 80), (6, 3), (40, 19)]


@pytest.mark.parametrize("isa", FLOAT_ISAS)
@pytest.mark.parametrize("values", ["normal", "adversarial"])
@pytest.mark.parametrize("family", ["default", pytest.param("gpt_oss", marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", ["fp16", "int8", "int4"])
def test_forward_matches_reference(builds, tmp_path, isa, dtype, family, values):
    cmd, name = runner(builds, isa)
    for h, i in SHAPES:
        case = make_case(dtype, family, h, i, values)
        y = kernel_output(cmd, name, case, tmp_path)
        assert_matches(y, case.ref, f"{isa} {dtype} {family} {values} H={h} I={i}", case.slack)


@pytest.mark.parametrize("isa", FLOAT_ISAS)
@pytest.mark.parametrize("act", ["silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new"])
def test_activations(builds, tmp_path, isa, act):
    cmd, name = runner(builds, isa)
    for dtype in ("fp16", "int4"):
        case = make_case(dtype, "default", 37, 53, "normal", hidden_act=act)
        assert_matches(kernel_output(cmd, name, case, tmp_path), case.ref, f"{isa} {dtype} {act}", case.slack)


@pytest.mark.parametrize("isa", FLOAT_ISAS)
def test_gpt_oss_limit_is_applied(builds, tmp_path, isa):
    """A non-default swiglu_limit, with gate and up values beyond it (so the clamps matter)."""
    cmd, isa = runner(builds, isa)
    case = make_case("int8", "gpt_oss", 64, 96, "normal", limit=2.5)
    w = dequantize(case.blobs[:case.layout["stride"]], case.sections, case.shapes)
    x = torch.from_numpy(case.x[0])
    assert ((x @ w["gate"].t() + w["bias_gate"]) > 2.5).any()
    assert ((x @ w["up"].t() + w["bias_up"]) < -2.5).any()
    assert_matches(kernel_output(cmd, isa, case, tmp_path), case.ref, f"{isa} limit 2.5", case.slack)
    # the same blobs under the default limit give other outputs: the limit reaches the kernel
    other = make_case("int8", "gpt_oss", 64, 96, "normal", limit=2.5).layout | {"swiglu_limit": 7.0}
    y7 = kernel_output(cmd, isa, case, tmp_path, layout=other)
    assert not np.allclose(y7, case.ref, rtol=1e-3, atol=1e-3 * np.abs(case.ref).max())


@pytest.mark.parametrize("isa", FLOAT_ISAS)
def test_swapped_nibbles_are_caught(builds, tmp_path, isa):
    """The comparison can fail: an int4 blob with its nibble order swapped gives other outputs."""
    cmd, isa = runner(builds, isa)
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
        assert_matches(y, case.ref, "swapped", case.slack)


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


def test_kernel_microbench_runs(builds):
    """bench_kernels (make bench-kernels' native half) at a tiny shape: every kernel row, sane numbers."""
    p = subprocess.run([*builds["bench"], "--hidden", "64", "--ffn", "96", "--experts", "2", "--many", "2", "--batch",
                        "3", "--threads", "1,2", "--min-seconds", "0.001"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(ln) for ln in p.stdout.splitlines()]
    got = {(r["dtype"], r["kernel"], r["threads"]) for r in rows}
    for dt in ("int4", "int8"):
        assert (dt, "float", 1) in got
        for k in ("forward", "many", "batch"):
            assert {(dt, k, 1), (dt, k, 2)} <= got
    assert all(r["us_per_expert_token"] > 0 and r["H"] == 64 and r["I"] == 96 for r in rows)
    bad = subprocess.run([*builds["bench"], "--experts", "1", "--many", "2"], capture_output=True, text=True)
    assert bad.returncode == 64 and "--many" in bad.stderr


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


# -- the integer path: bitwise ------------------------------------------------------------------

QSHAPES = [(37, 53), (1, 40), (256, 80), (6, 3), (33, 65)]  # group tails, 1 row, odd sizes


def _matvec_inputs(rng: np.random.Generator, count: int, n: int) -> np.ndarray:
    """Rows of x for one matrix: normal, one all-zero, huge values, tiny (subnormal-scale) blocks,
    one with an inf and one with a NaN (both must give NaN outputs, natively and in the reference)."""
    x = rng.standard_normal((count, n)).astype(np.float32)
    x[0, ::5] *= 1e4
    if count > 1:
        x[1] = 0.0
    if count > 2:
        x[2] *= 3e36
    if count > 3:
        x[3] *= 1e-40
    if count > 4:
        x[4, n // 2] = np.inf
    if count > 5:
        x[5, 0] = np.nan
    return x


@pytest.mark.parametrize("isa", _isas(INT_ISAS))
@pytest.mark.parametrize("values", ["normal", "adversarial"])
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_matvec_bitwise_matches_reference(builds, tmp_path, isa, dtype, values):
    """Each matrix of a blob: the kernel's W q(x) equals the torch reference bit for bit (including
    int8 -128 / 127 and int4 -8 / 7 weights, zero / tiny / huge / inf / NaN activation blocks)."""
    cmd, name = runner(builds, isa)
    rng = np.random.default_rng(7)
    for h, i in QSHAPES:
        case = make_case(dtype, "default", h, i, values, count=6)
        for role, (o, n) in (("gate", (i, h)), ("down", (h, i))):
            x = _matvec_inputs(rng, 6, n)
            (tmp_path / "layout.json").write_text(json.dumps(case.layout))
            (tmp_path / "blobs.bin").write_bytes(case.blobs)
            (tmp_path / "x.bin").write_bytes(x.tobytes())
            p = subprocess.run([*cmd, "--matvec", role, name, str(tmp_path / "layout.json"),
                                str(tmp_path / "blobs.bin"),
                                str(tmp_path / "x.bin"), str(tmp_path / "y.bin")], capture_output=True, text=True,
                               timeout=60)
            if p.returncode == 2:
                pytest.skip(f"{isa}: not on this CPU")
            assert p.returncode == 0, p.stderr
            y = np.fromfile(tmp_path / "y.bin", dtype=np.float32).reshape(6, o)
            stride = case.layout["stride"]
            for b in range(6):
                m = integer_matrices(case.blobs[b * stride:(b + 1) * stride], case.sections, case.shapes)
                with torch.no_grad():
                    ref = qmatmul(torch.from_numpy(x[b][None]), *m[role])[0].numpy()
                np.testing.assert_array_equal(y[b], ref, err_msg=f"{isa} {dtype} {values} {role} H={h} I={i} row {b}")
            assert np.isnan(y[4]).all() and np.isnan(y[5]).all()
            assert (y[1] == 0).all()


def _raw(cmd, name, case, tmp, *opts, x=None, blobs=None) -> np.ndarray:
    (tmp / "layout.json").write_text(json.dumps(case.layout))
    (tmp / "blobs.bin").write_bytes(case.blobs if blobs is None else blobs)
    xs = case.x if x is None else x
    (tmp / "x.bin").write_bytes(xs.tobytes())
    p = subprocess.run([*cmd, *opts, name, str(tmp / "layout.json"), str(tmp / "blobs.bin"), str(tmp / "x.bin"),
                        str(tmp / "y.bin")], capture_output=True, text=True, timeout=120)
    if p.returncode == 2:
        pytest.skip(f"{name}: not on this CPU")
    assert p.returncode == 0, p.stderr
    return np.fromfile(tmp / "y.bin", dtype=np.float32).reshape(xs.shape)


# make test: both dtypes of the default layout and int8 of GPT-OSS's (its biases and clamps: the float epilogue
# each ISA has its own of); int4 GPT-OSS in make test-all
@pytest.mark.parametrize("dtype,family", [("int8", "default"), ("int4", "default"), ("int8", "gpt_oss"),
                                          pytest.param("int4", "gpt_oss", marks=pytest.mark.slow)])
def test_isas_agree_bitwise(builds, tmp_path, dtype, family):
    """Every ISA of a build gives the portable kernels' expert outputs bit for bit."""
    for target, isas in (("host", HOST_ISAS), ("aarch64", ("portable",) + ARM_ISAS)):
        if isinstance(builds[target], str):
            continue
        for h, i in QSHAPES:
            case = make_case(dtype, family, h, i, "adversarial")
            want = _raw(builds[target], "portable", case, tmp_path)
            for isa in isas[1:]:
                p = subprocess.run([*builds[target], "--mode", "forward", isa, "/dev/null", "/dev/null", "/dev/null",
                                    "/dev/null"], capture_output=True, text=True, timeout=60)
                if p.returncode == 2:  # not on this CPU
                    continue
                got = _raw(builds[target], isa, case, tmp_path)
                np.testing.assert_array_equal(got, want, err_msg=f"{target} {isa} {dtype} {family} H={h} I={i}")


# the aarch64 batches run under qemu (about 6 s each): make test keeps neon_dotprod's int4 (the int8 one and
# the portable aarch64 build's in make test-all; their matvec and forward checks stay in make test)
@pytest.mark.parametrize("dtype,isa", [
    pytest.param(d, i, marks=pytest.mark.slow) if i == "a64_portable" or (i, d) == ("neon_dotprod", "int8")
    else pytest.param(d, i, marks=() if i in FAST_INT_ISAS else pytest.mark.slow)
    for d in ("int8", "int4") for i in INT_ISAS])
def test_batch_many_and_threads_bitwise(builds, tmp_path, isa, dtype):
    """forward_batch row r == forward on row r; forward_many output i == forward of blob i; with 1, 2
    and 3 threads alike (token counts 2, 6, 9 cover the 4-token tiles and their tails; 9 rows make x86's
    int4 tiles unpack once per batch, also at the buffer's limit of 128 blocks, H = 4096, and past it, H =
    4100, where they unpack per token group again)."""
    cmd, name = runner(builds, isa)
    for h, i, count in ((37, 53, 9), (64, 96, 6), (33, 65, 2), (4096, 40, 9), (4100, 36, 9)):
        case = make_case(dtype, "gpt_oss" if count == 6 else "default", h, i, "normal", count=count)
        stride = case.layout["stride"]
        blob0 = case.blobs[:stride] * count
        single = _raw(cmd, name, case, tmp_path, blobs=blob0)              # forward(blob 0, x[t])
        x0 = np.repeat(case.x[:1], count, axis=0)
        each = _raw(cmd, name, case, tmp_path, x=x0)                         # forward(blob i, x[0])
        for threads in ("2", "3"):  # the references above ran with 1
            t = ("--threads", threads)
            np.testing.assert_array_equal(_raw(cmd, name, case, tmp_path, *t, "--mode", "batch"), single,
                                          err_msg=f"{isa} {dtype} batch threads={threads} H={h} I={i}")
            np.testing.assert_array_equal(_raw(cmd, name, case, tmp_path, *t, "--mode", "many", x=x0), each,
                                          err_msg=f"{isa} {dtype} many threads={threads} H={h} I={i}")
            np.testing.assert_array_equal(_raw(cmd, name, case, tmp_path, *t, blobs=blob0), single,
                                          err_msg=f"{isa} {dtype} forward threads={threads} H={h} I={i}")


def _quantize_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """Rows of n floats whose blocks are each of a different kind: normal, all zero, signed zeros, tiny
    (d subnormal and 1 / d infinite: the block quantises to zeros), small (d subnormal, 1 / d finite),
    huge (near the float range), an inf, NaNs (the standard one, and negative, payload-carrying and
    signalling ones), exact ties (amax 127, values k + 0.5, which round half to even), values at +-127
    after scaling, and a random mix of all of them."""
    k = -(-n // 32)
    rows = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    rows.append(np.zeros(n, np.float32))
    rows.append(np.where(rng.random(n) < 0.5, -0.0, 0.0).astype(np.float32))
    rows.append((rng.standard_normal(n) * 1e-40).astype(np.float32))
    rows.append((rng.standard_normal(n) * 4e-37).astype(np.float32))
    rows.append((rng.standard_normal(n) * 5e37).astype(np.float32))
    odd_nans = np.array([0xFFC00000, 0x7FC12345, 0xFFA00001, 0x7F800001], np.uint32).view(np.float32)
    nans = rows[0].copy()
    nans[::32] = np.resize(odd_nans, len(nans[::32]))
    ties = np.tile(np.arange(-15.5, 16.5, 1.0, dtype=np.float32), k)[:n].copy()
    ties[::32] = 127.0
    rows.append(ties)
    rows.append(np.tile(np.array([127.0, -127.0, 126.5, -126.5], np.float32), k * 8)[:n].copy())
    mixed = rows[0].copy()
    for b in range(k):
        kind = b % 6
        sl = slice(b * 32, min(n, b * 32 + 32))
        if kind == 1:
            mixed[sl] = 0.0
        elif kind == 2:
            mixed[sl] *= 1e-40
        elif kind == 3:
            mixed[sl.start] = np.inf
        elif kind == 4:
            mixed[sl.start] = np.nan
        elif kind == 5:
            mixed[sl] = ties[sl]
    rows.append(mixed)
    rows.append(nans)
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("isa", _isas(INT_ISAS))
def test_quantize_matches_reference(builds, tmp_path, isa):
    """Each ISA's activation quantisation (the vectorised AVX2 / NEON code and the portable one) gives its
    build's portable code's bytes exactly (d's NaN bits included), and the Python reference's q and d and
    sx = sum(q), in column and in int4 order, for rows with and without a partial last block."""
    cmd, name = runner(builds, isa)
    rng = np.random.default_rng(3)
    perm = np.concatenate([np.arange(0, 32, 2), np.arange(1, 32, 2)])  # stored position j holds column perm[j]
    for n in (37, 64, 256, 2053):
        x = _quantize_rows(rng, n)
        (tmp_path / "x.bin").write_bytes(x.tobytes())
        p = subprocess.run([*cmd, "--quantize", name, str(n), str(tmp_path / "x.bin"), str(tmp_path / "q.bin")],
                           capture_output=True, text=True, timeout=60)
        if p.returncode == 2:
            pytest.skip(f"{isa}: not on this CPU")
        assert p.returncode == 0, p.stderr
        p = subprocess.run([*cmd, "--quantize", "portable", str(n), str(tmp_path / "x.bin"), str(tmp_path / "p.bin")],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        assert (tmp_path / "q.bin").read_bytes() == (tmp_path / "p.bin").read_bytes(), f"{isa} n={n}: not portable's"
        k = -(-n // 32)
        rec = np.dtype([("q", np.int8, (k, 32)), ("qp", np.int8, (k, 32)), ("d", np.float32, k), ("sx", np.int32, k)])
        got = np.fromfile(tmp_path / "q.bin", dtype=rec)
        assert got.shape == (len(x),)
        q, d = quantize_act(torch.from_numpy(x))
        q, d = q.numpy().astype(np.int8), d.numpy()
        for r in range(len(x)):
            what = f"{isa} n={n} row {r}"
            np.testing.assert_array_equal(got["q"][r], q[r], err_msg=what)
            np.testing.assert_array_equal(got["qp"][r], q[r][:, perm], err_msg=what)
            np.testing.assert_array_equal(got["d"][r], d[r], err_msg=what)  # NaN == NaN here; -0 != +0 is not asked
            np.testing.assert_array_equal(got["sx"][r], q[r].astype(np.int32).sum(-1), err_msg=what)


def _silu_inputs(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, 1e-30, 88.72, 88.7228, 89.0, 100.0,
                        -87.33, -88.72, -89.0, -103.97, -104.0, -150.0, 1e30, -1e30, 0.5, -0.5], np.float32)
    odd_nans = np.array([0xFFC00000, 0x7FC12345, 0xFFA00001, 0x7F800001], np.uint32).view(np.float32)
    g = np.concatenate([special, odd_nans, np.linspace(-120, 120, 20011, dtype=np.float32),
                        (rng.standard_normal(4099) * 4).astype(np.float32),
                        np.array([np.inf, -np.inf, 0.0, 3.0, -3.0, np.nan, 2.0, -2.0], np.float32)])
    u = np.concatenate([np.ones(len(special) + len(odd_nans) + 20011, np.float32),
                        rng.standard_normal(4099).astype(np.float32),  # odd lengths: vector tails
                        np.array([0.0, 0.0, np.inf, np.inf, -np.inf, 1.0, np.nan, odd_nans[1]], np.float32)])
    return g, u


@pytest.mark.parametrize("isa", _isas(INT_ISAS))
def test_silu_is_one_function_everywhere(builds, tmp_path, isa):
    """silu(g) * u from every ISA (vectorised AVX2 / NEON and the portable code) is its build's portable
    code's bit for bit (NaN payloads and signs included), and within 2e-7 relative (a few ulp) of
    float64's silu(g) * u wherever that is a normal float and exp(g) is too (g > -87.3; below, the result's
    magnitude is under 1e-36 and goes through a subnormal exp). (Across builds only the NaNs an invalid
    operation makes differ: x86's is negative, ARM's default NaN positive.)"""
    cmd, name = runner(builds, isa)
    g, u = _silu_inputs(np.random.default_rng(5))
    (tmp_path / "g.bin").write_bytes(g.tobytes())
    (tmp_path / "u.bin").write_bytes(u.tobytes())

    def silu(prefix, isa_name, out):
        p = subprocess.run([*prefix, "--silu", isa_name, str(tmp_path / "g.bin"), str(tmp_path / "u.bin"),
                            str(tmp_path / out)], capture_output=True, text=True, timeout=60)
        if p.returncode == 2:
            pytest.skip(f"{isa}: not on this CPU")
        assert p.returncode == 0, p.stderr
        return np.fromfile(tmp_path / out, dtype=np.float32)

    want = silu(cmd, "portable", "want.bin")
    got = silu(cmd, name, "got.bin")
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=isa)
    g64 = g.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        exact = g64 / (1.0 + np.exp(-g64)) * u.astype(np.float64)
    normal = np.isfinite(exact) & (np.abs(exact) >= np.finfo(np.float32).tiny) & (g > -87.3)
    assert normal.sum() > 20000
    np.testing.assert_allclose(got[normal], exact[normal], rtol=2e-7, atol=0)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(exact.astype(np.float32)))
    inf = ~normal & ~np.isnan(exact) & np.isinf(exact)
    np.testing.assert_array_equal(got[inf], exact[inf].astype(np.float32))
