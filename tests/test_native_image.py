"""The native runner's image path (android_runner/src/image.cpp) against transformers'
Qwen2VLImageProcessorPil, the processor the toolkit uses (toolkit/models/loader.py), on
`Image.open(p).convert("RGB")`, driven through android_runner/tests/check_image.cpp built with g++.

- Parity: 49 generated files (noise and smooth gradients; PNG RGB, RGBA, L, LA, P, 1-bit, 16-bit grey,
  an animated PNG, and hand-written 16-bit RGB/RGBA/LA, 2-bit grey, short palettes, tRNS and Adam7-interlaced
  ones; JPEG at several qualities, 4:2:0 / 4:2:2 / 4:4:4, progressive and grey; binary PPM, Pillow's and
  hand-written with comments and every whitespace byte), under the tiny model's processor
  (patch 16, 32*32..64*64 pixels) and a larger one (256*256..512*512). The decoded RGB equals Pillow's
  and pixel_values are bit-identical (float32), the grid equal. The sizes reach every smart_resize
  branch (max, min, neither), Python's ties-to-even rounding (80 / 32 = 2.5), an unchanged size (a
  copy), a skipped pass, and both pass orders of Pillow 13's bicubic resize; a test says so.
- The bicubic resize alone against Pillow's Image.resize for random sizes and the pass-order boundary.
- The comparison can fail: image.cpp with std::round for nearbyint, and with Pillow 12's pass order,
  compiled here, each differs from the reference on some case.
- Refusals, one line naming the file, exit 1: truncated and corrupt PNG and JPEG, not an image, an
  empty and a missing file, a 20000x20000 PNG header and a 9000x9000 JPEG header (refused from the
  header, under a 256 MiB address-space limit), a CMYK JPEG, an aspect ratio over 200; the PPMs the runner
  does not take (plain, grey, maxval other than 255, truncated, odd headers), which open_image refuses alike.
- A PPM made on the host at a bundle's size (what device bench pushes to a runner without decoders) gives
  the original image's pixel_values.
NATIVE_SANITIZE=1 builds check_image with AddressSanitizer and UBSan."""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import PIL
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "android_runner" / "src"
CHECK = REPO / "android_runner" / "tests" / "check_image.cpp"
SANITIZE = os.environ.get("NATIVE_SANITIZE") == "1"
PATCH, TEMPORAL, MERGE = 16, 2, 2
FACTOR = PATCH * MERGE
CONFIGS = {"tiny": (32 * 32, 64 * 64), "large": (256 * 256, 512 * 512)}  # (min_pixels, max_pixels)
MEAN = STD = (0.5, 0.5, 0.5)
# Pillow 13 resamples columns first where the height shrinks much more than the width
# (python-pillow/Pillow#9549); the port follows it, so older Pillows differ there
PILLOW_13 = int(PIL.__version__.split(".")[0]) >= 13


def _flags() -> list[str]:
    flags = ["-std=c++17", "-O2", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror", f"-I{SRC}"]
    if SANITIZE:
        flags += ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
    return flags


def _compile(src: Path, obj: Path, flags: list[str]) -> Path:
    r = subprocess.run(["g++", *flags, "-c", str(src), "-o", str(obj)], capture_output=True, text=True)
    assert r.returncode == 0, f"g++ {src.name}:\n{r.stderr}"
    return obj


def _link(objs: list[Path], exe: Path, flags: list[str]) -> Path:
    r = subprocess.run(["g++", *flags, *map(str, objs), "-lpng", "-ljpeg", "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return exe


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    """check_image.o and image.o, compiled two at a time; check_image linked from them."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not installed (make setup installs it)")
    if not (Path("/usr/include/png.h").is_file() and Path("/usr/include/jpeglib.h").is_file()):
        pytest.skip("needs libpng's and libjpeg's headers (apt-get install libpng-dev libjpeg62-turbo-dev)")
    d = tmp_path_factory.mktemp("check_image")
    flags = _flags()
    with ThreadPoolExecutor(2) as ex:
        objs = list(ex.map(lambda s: _compile(s, d / (s.stem + ".o"), flags), [CHECK, SRC / "image.cpp"]))
    _link(objs, d / "check_image", flags)
    return d


@pytest.fixture(scope="module")
def tool(build) -> Path:
    return build / "check_image"


@pytest.fixture(scope="module")
def processors():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return {name: Qwen2VLImageProcessorPil(patch_size=PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE,
                                           min_pixels=lo, max_pixels=hi, image_mean=list(MEAN), image_std=list(STD))
            for name, (lo, hi) in CONFIGS.items()}


def run(tool: Path, *args, limit_as: int | None = None) -> subprocess.CompletedProcess:
    def cap():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))

    return subprocess.run([str(tool), *map(str, args)], capture_output=True, text=True, timeout=60,
                          preexec_fn=cap if limit_as else None)


def config_args(name: str) -> list[str]:
    lo, hi = CONFIGS[name]
    return ["--patch", str(PATCH), "--temporal", str(TEMPORAL), "--merge", str(MERGE), "--min-pixels", str(lo),
            "--max-pixels", str(hi), "--mean", ",".join(map(str, MEAN)), "--std", ",".join(map(str, STD))]


def native(tool: Path, path: Path, name: str, out: Path) -> tuple[list[int], list[int], np.ndarray, np.ndarray]:
    """(grid, resized [h, w], pixel_values [N, 1536], decoded [h, w, 3]) from check_image."""
    r = run(tool, path, *config_args(name), "--out", out / "pv.bin", "--decoded-out", out / "dec.bin")
    assert r.returncode == 0, r.stderr
    f = r.stdout.split()
    assert f[0] == "grid" and f[4] == "resized" and f[7] == "decoded", r.stdout
    grid, resized, (h, w) = list(map(int, f[1:4])), list(map(int, f[5:7])), map(int, f[8:10])
    pv = np.fromfile(out / "pv.bin", dtype=np.float32).reshape(-1, 3 * TEMPORAL * PATCH * PATCH)
    return grid, resized, pv, np.fromfile(out / "dec.bin", dtype=np.uint8).reshape(h, w, 3)


# ---------------------------------------------------------------------------------------------- images

def noise(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def gradient(h: int, w: int, seed: int) -> np.ndarray:
    """Smooth ramps and a sine, with a little noise: what JPEG's upsampling and the resize see in photos."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    rng = np.random.default_rng(seed)
    a = np.stack([x * 255 / max(w - 1, 1), y * 255 / max(h - 1, 1), 128 + 100 * np.sin(x / 7 + y / 5)], -1)
    return np.clip(a + rng.normal(0, 6, a.shape), 0, 255).astype(np.uint8)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _scanlines(s: np.ndarray, depth: int) -> bytes:
    """Rows of samples [h, w*channels] as filter-0 scanlines."""
    out = []
    for r in s:
        if depth == 16:
            b = r.astype(">u2").tobytes()
        elif depth == 8:
            b = r.astype(np.uint8).tobytes()
        else:
            per = 8 // depth
            g = np.concatenate([r, np.zeros((-len(r)) % per, dtype=r.dtype)]).reshape(-1, per).astype(np.int64)
            b = bytes((g << (8 - depth * (np.arange(per) + 1))).sum(1).astype(np.uint8))
        out.append(b"\x00" + b)
    return b"".join(out)


ADAM7 = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)]


def write_png(path: Path, samples: np.ndarray, color_type: int, depth: int, *, plte=None, trns: bytes | None = None,
              interlace: bool = False) -> Path:
    """A PNG written by hand, for what Pillow does not write: samples [h, w, channels] as stored."""
    h, w, c = samples.shape
    if interlace:
        raw = b"".join(_scanlines(samples[y0::dy, x0::dx].reshape(-1, len(range(x0, w, dx)) * c), depth)
                       for x0, y0, dx, dy in ADAM7 if y0 < h and x0 < w)
    else:
        raw = _scanlines(samples.reshape(h, w * c), depth)
    ihdr = struct.pack(">IIBBBBB", w, h, depth, color_type, 0, 0, int(interlace))
    data = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr)
    if plte is not None:
        data += _chunk(b"PLTE", np.asarray(plte, dtype=np.uint8).tobytes())
    if trns is not None:
        data += _chunk(b"tRNS", trns)
    path.write_bytes(data + _chunk(b"IDAT", zlib.compress(raw)) + _chunk(b"IEND", b""))
    return path


def _save(a: np.ndarray | Image.Image, path: Path, **kw) -> Path:
    (a if isinstance(a, Image.Image) else Image.fromarray(a)).save(path, **kw)
    return path


def _png_cases() -> dict:
    """name -> a function of the directory writing the file."""
    c = {}
    # sizes: (h, w) and what they exercise (tiny config / large config)
    for h, w in [(50, 70),     # neither branch / min
                 (80, 48),     # ties-to-even: 80 / 32 = 2.5 -> 64 (std::round: 96, then the max branch)
                 (336, 400),   # ties-to-even in the large config: 10.5, 12.5
                 (64, 64),     # unchanged (tiny): a copy
                 (320, 384),   # unchanged (large)
                 (64, 50),     # rows only (tiny)
                 (50, 64),     # columns only (tiny)
                 (10, 12),     # min branch, upscaled
                 (300, 200),   # max branch (tiny)
                 (1000, 700),  # max branch (large), 2.3x down
                 (700, 60),    # tiny: height shrinks far more than width: columns first
                 (1, 1), (1, 200), (200, 1), (3, 500), (37, 53)]:
        c[f"png-noise-{h}x{w}"] = lambda d, h=h, w=w: _save(noise(h, w, h * 1000 + w), d / f"noise-{h}x{w}.png")
    for h, w in [(120, 90), (333, 517)]:
        c[f"png-gradient-{h}x{w}"] = lambda d, h=h, w=w: _save(gradient(h, w, h + w), d / f"grad-{h}x{w}.png")
    rng = np.random.default_rng(7)
    rgba = np.concatenate([noise(60, 40, 1), rng.integers(0, 256, (60, 40, 1), dtype=np.uint8)], -1)
    c["png-rgba"] = lambda d: _save(Image.fromarray(rgba, "RGBA"), d / "rgba.png")
    c["png-l"] = lambda d: _save(Image.fromarray(gradient(45, 77, 2)[..., 0], "L"), d / "l.png")
    la = np.stack([gradient(40, 60, 3)[..., 1], noise(40, 60, 3)[..., 0]], -1)
    c["png-la"] = lambda d: _save(Image.fromarray(la, "LA"), d / "la.png")
    c["png-p"] = lambda d: _save(Image.fromarray(gradient(70, 50, 4)).quantize(64), d / "p.png")
    c["png-1bit"] = lambda d: _save(Image.fromarray(noise(50, 50, 5)[..., 0] > 128), d / "bit.png")
    i16 = rng.integers(0, 1000, (40, 30)).astype(np.uint16)  # PIL's I;16 -> RGB clips at 255
    c["png-gray16"] = lambda d: _save(Image.fromarray(i16), d / "gray16.png")
    c["png-rgb16"] = lambda d: write_png(d / "rgb16.png", rng.integers(0, 65536, (33, 47, 3)), 2, 16)
    c["png-rgba16"] = lambda d: write_png(d / "rgba16.png", rng.integers(0, 65536, (20, 30, 4)), 6, 16)
    # only the IDAT chunk's checksum wrong: Pillow's own PNG reader skips it, so it is an image
    c["png-idat-crc-only"] = lambda d: _flip_idat_crc(_save(noise(30, 40, 9), d / "crc-src.png"), d / "crc.png")
    c["png-la16"] = lambda d: write_png(d / "la16.png", rng.integers(0, 65536, (26, 18, 2)), 4, 16)
    c["png-gray2"] = lambda d: write_png(d / "gray2.png", rng.integers(0, 4, (25, 35, 1)), 0, 2)
    # 4-bit indices, a palette of 5: an index past it is black in Pillow
    c["png-p4-short-palette"] = lambda d: write_png(d / "p4.png", rng.integers(0, 16, (30, 20, 1)), 3, 4,
                                                    plte=rng.integers(0, 256, (5, 3)))
    c["png-p8-trns"] = lambda d: write_png(d / "p8t.png", rng.integers(0, 256, (24, 40, 1)), 3, 8,
                                           plte=rng.integers(0, 256, (256, 3)), trns=bytes(range(0, 256, 2)))
    c["png-rgb-trns"] = lambda d: write_png(d / "rgbt.png", noise(30, 30, 8), 2, 8, trns=struct.pack(">HHH", 1, 2, 3))
    # an animated PNG whose IDAT image is not a frame: Pillow's frame 0, and libpng's image, is the IDAT one
    c["png-apng"] = lambda d: _save(Image.fromarray(noise(40, 30, 10)), d / "anim.png", save_all=True,
                                    append_images=[Image.fromarray(noise(40, 30, 11))], default_image=True)
    c["png-interlaced-rgb"] = lambda d: write_png(d / "adam7.png", gradient(41, 37, 9), 2, 8, interlace=True)
    c["png-interlaced-gray4"] = lambda d: write_png(d / "adam7g4.png", rng.integers(0, 16, (19, 23, 1)), 0, 4,
                                                    interlace=True)
    return c


def _jpeg_cases() -> dict:
    c = {}
    for name, (h, w), kw in [("q95-420", (120, 90), dict(quality=95)),
                             ("q50-420", (333, 517), dict(quality=50)),
                             ("q90-444", (64, 80), dict(quality=90, subsampling=0)),
                             ("q75-422", (75, 101), dict(quality=75, subsampling=1)),
                             ("progressive", (90, 130), dict(quality=85, progressive=True)),
                             ("odd-7x9", (7, 9), dict(quality=90)),
                             ("q90-1000x700", (1000, 700), dict(quality=90))]:
        c[f"jpeg-{name}"] = lambda d, n=name, h=h, w=w, kw=kw: _save(gradient(h, w, h * w), d / f"{n}.jpg", **kw)
    c["jpeg-noise-q95"] = lambda d: _save(noise(80, 48, 11), d / "noise.jpg", quality=95)
    c["jpeg-noise-q50"] = lambda d: _save(noise(300, 200, 12), d / "noise50.jpg", quality=50)
    c["jpeg-gray"] = lambda d: _save(Image.fromarray(gradient(45, 77, 13)[..., 2], "L"), d / "gray.jpg", quality=80)
    return c


def write_ppm(path: Path, rgb: np.ndarray, header: bytes | None = None) -> Path:
    """A binary PPM (P6) by hand: `header` as given (comments, odd whitespace), else the plain one."""
    h, w, _ = rgb.shape
    path.write_bytes((header if header is not None else b"P6\n%d %d\n255\n" % (w, h)) + rgb.astype(np.uint8).tobytes())
    return path


def _ppm_cases() -> dict:
    """PPM (P6, maxval 255): the runner's built-in format, what `device bench` pushes to a cross build."""
    c = {"ppm-noise-50x70": lambda d: _save(noise(50, 70, 21), d / "noise.ppm"),  # Pillow's own writer
         "ppm-gradient-333x517": lambda d: _save(gradient(333, 517, 22), d / "grad.ppm"),
         "ppm-1x1": lambda d: write_ppm(d / "one.ppm", noise(1, 1, 23))}
    # comments between the tokens (ended by CR or LF), tabs, CR LF, vertical tab and form feed as whitespace
    c["ppm-comments"] = lambda d: write_ppm(d / "comments.ppm", noise(19, 23, 24),
                                            b"P6 # made by hand\r23\t#w\n\x0b19\r\n# maxval next\n\x0c255\t")
    return c


CASES = {**_png_cases(), **_jpeg_cases(), **_ppm_cases()}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("images")
    return {name: make(d) for name, make in CASES.items()}


def smart_resize_paths(h: int, w: int, lo: int, hi: int) -> set[str]:
    """Which of smart_resize's and the resize's paths an (h, w) image takes (the Python, annotated)."""
    import math

    tags = set()
    hb, wb = round(h / FACTOR) * FACTOR, round(w / FACTOR) * FACTOR
    if any((v / FACTOR) % 1 == 0.5 for v in (h, w)):
        tags.add("tie")
    if hb * wb > hi:
        beta = math.sqrt(h * w / hi)
        hb = max(FACTOR, math.floor(h / beta / FACTOR) * FACTOR)
        wb = max(FACTOR, math.floor(w / beta / FACTOR) * FACTOR)
        tags.add("max")
    elif hb * wb < lo:
        beta = math.sqrt(lo / (h * w))
        hb, wb = math.ceil(h * beta / FACTOR) * FACTOR, math.ceil(w * beta / FACTOR) * FACTOR
        tags.add("min")
    else:
        tags.add("neither")
    if (hb, wb) == (h, w):
        tags.add("unchanged")
    elif hb == h or wb == w:
        tags.add("one pass")
    elif h > hb and (h - hb) > (w - wb) * 2:
        tags.add("columns first")
    else:
        tags.add("rows first")
    return tags


def test_cases_cover_every_path(images):
    seen = set()
    for p in images.values():
        w, h = Image.open(p).size
        for lo, hi in CONFIGS.values():
            seen |= smart_resize_paths(h, w, lo, hi)
    need = {"tie", "max", "min", "neither", "unchanged", "one pass", "columns first", "rows first"}
    assert need <= seen, f"no case takes {need - seen}"


@pytest.mark.skipif(not PILLOW_13, reason=f"Pillow {PIL.__version__}: the port follows Pillow 13's pass order")
@pytest.mark.filterwarnings("ignore:Palette images with Transparency")  # png-p8-trns: Pillow's advice, not an error
@pytest.mark.parametrize("case", list(CASES))
def test_pixel_values_bit_identical(tool, processors, images, tmp_path, case):
    p = images[case]
    ref_rgb = np.array(Image.open(p).convert("RGB"))
    for name, proc in processors.items():
        grid, resized, pv, dec = native(tool, p, name, tmp_path)
        assert np.array_equal(dec, ref_rgb), f"{case}: decoded pixels differ from Pillow's in " \
                                             f"{int((dec != ref_rgb).any(-1).sum())} of {dec.shape[0] * dec.shape[1]}"
        ref = proc(images=[Image.open(p).convert("RGB")], return_tensors="np")
        assert grid == ref["image_grid_thw"][0].tolist(), f"{case} ({name}): grid {grid}"
        assert resized == [grid[1] * PATCH, grid[2] * PATCH]
        want = ref["pixel_values"]
        assert want.dtype == np.float32 and pv.shape == want.shape, f"{case} ({name}): {pv.shape} vs {want.shape}"
        diff = pv.view(np.uint32) != want.view(np.uint32)
        assert not diff.any(), f"{case} ({name}): {int(diff.sum())} of {diff.size} values differ, " \
                               f"max |d| {float(np.abs(pv - want).max())}"


@pytest.mark.skipif(not PILLOW_13, reason=f"Pillow {PIL.__version__}: the port follows Pillow 13's pass order")
@pytest.mark.parametrize("case", ["png-noise-50x70", "png-noise-1x1", "png-rgba", "jpeg-q75-422", "jpeg-q90-1000x700",
                                  "ppm-gradient-333x517"])
def test_a_bundles_fixed_size_bit_identical(tool, processors, images, tmp_path, case):
    """A bundle's preprocessing (export/images.py: the image resized to the bundle's size, then the processor)
    and the runner's (ImagePreprocess::fixed_height/width) give the same pixel_values, bit for bit."""
    from export.images import fixed_size_pixels

    for (h, w), name in (((64, 64), "tiny"), ((32, 64), "tiny"), ((512, 384), "large")):
        lo, hi = CONFIGS[name]
        block = {"image_size": [h, w], "grid_thw": [1, h // PATCH, w // PATCH]}
        want, grid = fixed_size_pixels(images[case], block, processors[name])
        r = run(tool, images[case], *config_args(name), "--fixed", f"{h},{w}", "--out", tmp_path / "pv.bin")
        assert r.returncode == 0, r.stderr
        assert r.stdout.split()[1:4] == [str(g) for g in grid] and r.stdout.split()[5:7] == [str(h), str(w)]
        pv = np.fromfile(tmp_path / "pv.bin", dtype=np.float32).reshape(want.shape)
        assert np.array_equal(pv.view(np.uint32), want.numpy().view(np.uint32)), f"{case} at {h}x{w}"


@pytest.mark.skipif(not PILLOW_13, reason=f"Pillow {PIL.__version__}: the port follows Pillow 13's pass order")
def test_bicubic_resize_matches_pillow(tool, tmp_path):
    """resize_bicubic alone against Image.resize(BICUBIC): random sizes up and down, and both sides of
    Pillow 13's pass-order rule ((h - H) against 2 (w - W), equal and one off)."""
    rng = np.random.default_rng(3)
    pairs = [tuple(map(int, rng.integers(1, 260, 4))) for _ in range(60)]
    pairs += [(200, 150, 200 - (2 * d + e), 150 - d) for d in (1, 9, 40) for e in (-1, 0, 1)]
    pairs += [(1, 1, 32, 32), (1, 200, 32, 480), (500, 20, 50, 10), (20, 500, 10, 50)]
    sources: dict[tuple[int, int], Path] = {}
    bad = []
    for h, w, H, W in pairs:
        if (h, w) not in sources:
            sources[(h, w)] = _save(noise(h, w, h * 7 + w), tmp_path / f"src-{h}x{w}.png")
        r = run(tool, sources[(h, w)], "--resize", f"{W},{H}", "--resized-out", tmp_path / "r.bin")
        assert r.returncode == 0 and r.stdout.split() == ["resized", str(H), str(W)], r.stderr
        mine = np.fromfile(tmp_path / "r.bin", dtype=np.uint8).reshape(H, W, 3)
        if not np.array_equal(mine, np.array(Image.open(sources[(h, w)]).resize((W, H), Image.BICUBIC))):
            bad.append((h, w, H, W))
    assert not bad, f"{len(bad)} of {len(pairs)} resizes differ from Pillow's: {bad[:5]}"


@pytest.mark.skipif(not PILLOW_13, reason=f"Pillow {PIL.__version__}: the port follows Pillow 13's pass order")
# each mutation rebuilds the tool (about 5 s): make test runs the pass order's, make test-all both
@pytest.mark.parametrize("mutation,old,new", [
    pytest.param("std::round for Python's round", "std::nearbyint", "std::round", marks=pytest.mark.slow),
    ("Pillow 12's pass order", "const bool columns_first =", "const bool columns_first = false &&"),
])
def test_a_wrong_port_fails(build, processors, images, tmp_path, mutation, old, new):
    """The comparison is strict enough to see a one-token mistake: image.cpp with `old` replaced,
    compiled against the same check_image.o, differs from the reference on some case."""
    src = (SRC / "image.cpp").read_text()
    assert old in src, f"image.cpp no longer holds {old!r}: update this mutation"
    mutant = tmp_path / "image.cpp"
    mutant.write_text(src.replace(old, new))
    flags = [f for f in _flags() if f != "-Werror"]
    exe = _link([build / "check_image.o", _compile(mutant, tmp_path / "image.o", flags)], tmp_path / "mutant", flags)
    differs = []
    for case in ("png-noise-80x48", "png-noise-336x400", "png-noise-700x60", "jpeg-q50-420"):
        for name, proc in processors.items():
            grid, _, pv, _ = native(exe, images[case], name, tmp_path)
            ref = proc(images=[Image.open(images[case]).convert("RGB")], return_tensors="np")
            if grid != ref["image_grid_thw"][0].tolist() or not np.array_equal(pv, ref["pixel_values"]):
                differs.append(f"{case} ({name})")
    assert differs, f"a port with {mutation} passes every comparison"


# ---------------------------------------------------------------------------------------------- refusals

def _write(dst: Path, data: bytes) -> Path:
    dst.write_bytes(data)
    return dst


def _truncated(src: Path, dst: Path, frac: float) -> Path:
    b = src.read_bytes()
    dst.write_bytes(b[:int(len(b) * frac)])
    return dst


def _flip_idat(src: Path, dst: Path) -> Path:
    b = bytearray(src.read_bytes())
    b[b.index(b"IDAT") + 40] ^= 0x55
    dst.write_bytes(bytes(b))
    return dst


def _flip_idat_crc(src: Path, dst: Path) -> Path:
    """The IDAT chunk's 4 CRC bytes changed, nothing else."""
    b = bytearray(src.read_bytes())
    i = b.index(b"IDAT")
    n = struct.unpack(">I", b[i - 4:i])[0]
    b[i + 4 + n] ^= 0xFF  # the first CRC byte after the type and the n data bytes
    dst.write_bytes(bytes(b))
    return dst


def _png_header(dst: Path, w: int, h: int, depth: int = 8, color_type: int = 2) -> Path:
    """A PNG whose IHDR says w x h, with a few bytes of image data: a decoder that allocates first dies."""
    ihdr = _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, depth, color_type, 0, 0, 0))
    dst.write_bytes(b"\x89PNG\r\n\x1a\n" + ihdr + _chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + _chunk(b"IEND", b""))
    return dst


def _jpeg_header(dst: Path, w: int, h: int) -> Path:
    """A real small JPEG with its SOF0 saying w x h."""
    _save(gradient(16, 16, 0), dst, quality=90)
    b = bytearray(dst.read_bytes())
    i = b.index(b"\xff\xc0")
    b[i + 5:i + 9] = struct.pack(">HH", h, w)
    dst.write_bytes(bytes(b))
    return dst


REFUSALS = {  # name: (make(dir) -> path, what the message says, Pillow / the processor refuses it too)
    "truncated-png": (lambda d: _truncated(_save(noise(60, 60, 1), d / "a.png"), d / "t.png", 0.6),
                      "truncated or corrupt PNG", True),
    "png-bad-idat-crc": (lambda d: _flip_idat(_save(noise(60, 60, 2), d / "b.png"), d / "c.png"),
                         "truncated or corrupt PNG", True),
    "truncated-jpeg": (lambda d: _truncated(_save(gradient(200, 150, 3), d / "a.jpg", quality=90), d / "t.jpg", 0.6),
                       "truncated JPEG (the data ends early)", True),
    "jpeg-cut-in-header": (lambda d: _truncated(_save(gradient(64, 64, 4), d / "b.jpg"), d / "h.jpg", 0.05),
                           "JPEG", True),
    "text-file": (lambda d: _write(d / "notes.png", b"not an image at all\n"), "not a PNG, JPEG or PPM image", True),
    "empty-file": (lambda d: _write(d / "empty.jpg", b""), "not a PNG, JPEG or PPM image", True),
    "missing-file": (lambda d: d / "nowhere.png", "cannot open", True),
    "png-20000x20000": (lambda d: _png_header(d / "huge.png", 20000, 20000), "over 64 megapixels", True),
    # 36 megapixels (under the pixel cap) of 16-bit RGBA: 288 MB of samples, over the byte cap
    "png-rgba16-6000x6000": (lambda d: _png_header(d / "deep.png", 6000, 6000, 16, 6), "MiB decoded are refused",
                             None),
    "jpeg-9000x9000": (lambda d: _jpeg_header(d / "huge.jpg", 9000, 9000), "over 64 megapixels", None),
    "cmyk-jpeg": (lambda d: _save(Image.new("CMYK", (16, 16), (10, 20, 30, 40)), d / "cmyk.jpg"),
                  "4 components", False),
    "aspect-201": (lambda d: _save(noise(1, 201, 5), d / "wide.png"), "aspect ratio 201", True),
    # PPM: only binary RGB (P6) at maxval 255; Pillow takes the rest, the runner refuses it by name
    "ppm-plain-p3": (lambda d: _write(d / "plain.ppm", b"P3\n1 1\n255\n1 2 3\n"), "plain PPM (P3)", False),
    "pgm-p5": (lambda d: _save(Image.fromarray(noise(8, 8, 6)[..., 0], "L"), d / "grey.pgm"), "PGM", False),
    "ppm-maxval-65535": (lambda d: _write(d / "deep.ppm", b"P6 2 2 65535\n" + bytes(24)), "maxval 65535", False),
    "ppm-maxval-100": (lambda d: _write(d / "m100.ppm", b"P6 2 2 100\n" + bytes(12)), "maxval 100", False),
    "ppm-truncated": (lambda d: _truncated(write_ppm(d / "a.ppm", noise(40, 40, 7)), d / "t.ppm", 0.6),
                      "truncated PPM (the pixels end early)", True),
    "ppm-header-ends": (lambda d: _write(d / "h.ppm", b"P6\n40 40\n"), "the header ends before its maxval", True),
    "ppm-comment-in-token": (lambda d: _write(d / "c.ppm", b"P6\n4#x\n0 40\n255\n" + bytes(4800)),
                             "a comment inside its width", None),
    # refused before the 192 MB raster is allocated (the 256 MiB address-space limit of the runs)
    "ppm-short-8000x8000": (lambda d: _write(d / "short.ppm", b"P6 8000 8000 255\n" + bytes(64)),
                            "truncated PPM (the pixels end early)", None),
    "ppm-no-space": (lambda d: _write(d / "n.ppm", b"P6#c\n2 2 255\n" + bytes(12)), "not a PNG, JPEG or PPM image",
                     None),
    "ppm-sign": (lambda d: _write(d / "s.ppm", b"P6 +2 2 255\n" + bytes(12)), "not a number", None),
    "ppm-20000x20000": (lambda d: _write(d / "huge.ppm", b"P6 20000 20000 255\n" + bytes(64)), "over 64 megapixels",
                        None),
    "ppm-11-digits": (lambda d: _write(d / "long.ppm", b"P6 99999999999 1 255\n"), "up to 10 digits", True),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusal_is_one_line_naming_the_file(tool, processors, tmp_path, case):
    make, says, python_refuses = REFUSALS[case]
    p = make(tmp_path)
    # a decoder that allocated the 1.2 GB of a 20000x20000 image before refusing it fails this limit
    r = run(tool, p, *config_args("tiny"), "--out", tmp_path / "pv.bin", limit_as=None if SANITIZE else 256 << 20)
    assert r.returncode == 1, f"exit {r.returncode}: {r.stderr}"
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("check_image: error: "), r.stderr
    assert str(p) in r.stderr and says in r.stderr, r.stderr
    assert not (tmp_path / "pv.bin").exists()
    if python_refuses is not None:
        try:
            processors["tiny"](images=[Image.open(p).convert("RGB")], return_tensors="np")
            refused = False
        except Exception:  # noqa: BLE001 - Pillow and transformers raise many types
            refused = True
        assert refused == python_refuses, f"the Python path {'refuses' if refused else 'accepts'} {case}"


@pytest.mark.parametrize("case", [c for c in REFUSALS if c.startswith(("ppm", "pgm"))] + list(_ppm_cases()))
def test_the_toolkit_takes_the_ppms_the_runner_takes(images, tmp_path, case):
    """toolkit.traces.data.open_image (run, trace, bench, device bench) refuses a Netpbm file exactly where
    the native runner does, for the same reason."""
    from toolkit.errors import SpecPrefetchError
    from toolkit.traces.data import open_image

    if case in REFUSALS:
        make, says, _ = REFUSALS[case]
        p = make(tmp_path)
        with pytest.raises(SpecPrefetchError, match="^--image " + str(p).replace(".", r"\.")) as e:
            open_image(p)
        # the raster's end is Pillow's to find ("image file is truncated"), the header's is ppm_problem's
        says = {"ppm-truncated": "truncated", "ppm-short-8000x8000": "truncated",
                "ppm-20000x20000": "64 megapixels"}.get(case, says)
        assert says in str(e.value) and "\n" not in str(e.value)
    else:
        assert np.array_equal(np.array(open_image(images[case])), np.array(Image.open(images[case]).convert("RGB")))


@pytest.mark.skipif(not PILLOW_13, reason=f"Pillow {PIL.__version__}: the port follows Pillow 13's pass order")
@pytest.mark.parametrize("case", ["png-noise-50x70", "png-rgba", "jpeg-q90-1000x700", "png-noise-1x1"])
def test_a_ppm_made_on_the_host_gives_the_originals_pixels(tool, processors, images, tmp_path, case):
    """What `device bench` pushes to a runner without PNG and JPEG decoders (export/images.py:
    write_fixed_size_ppm): the image resized to the bundle's size as a PPM. The runner's preprocessing of it
    equals the bundle's preprocessing of the original, bit for bit."""
    from export.images import fixed_size_pixels, write_fixed_size_ppm

    for (h, w), name in (((64, 64), "tiny"), ((32, 64), "tiny"), ((512, 384), "large")):
        block = {"image_size": [h, w], "grid_thw": [1, h // PATCH, w // PATCH]}
        want, grid = fixed_size_pixels(images[case], block, processors[name])
        ppm = write_fixed_size_ppm(images[case], block, tmp_path / f"{case}-{h}x{w}.ppm")
        assert ppm.read_bytes().startswith(b"P6") and Image.open(ppm).size == (w, h)
        r = run(tool, ppm, *config_args(name), "--fixed", f"{h},{w}", "--out", tmp_path / "pv.bin")
        assert r.returncode == 0, r.stderr
        assert r.stdout.split()[1:4] == [str(g) for g in grid]
        pv = np.fromfile(tmp_path / "pv.bin", dtype=np.float32).reshape(want.shape)
        assert np.array_equal(pv.view(np.uint32), want.numpy().view(np.uint32)), f"{case} at {h}x{w}"
