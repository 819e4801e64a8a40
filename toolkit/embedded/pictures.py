"""Synthetic pictures with captions, for the vision-language demo model and for image traces and benches:
one shape (a disc, a square, a ring or a cross) of one of six colours on a dark noisy field, at a random
place and size, captioned with what it shows (so the image and the text agree).

    python -m toolkit.embedded.pictures OUT [--n 80] [--seed 0] [--side N] [--overwrite]

writes OUT/p0.png ... and OUT/pairs.jsonl (`{"text": ..., "image": "p0.png"}` lines, the format `trace
--data` reads). Refuses an OUT that exists unless --overwrite (and then only a directory of pictures).
`picture` and `caption` are what the demo model (toolkit/embedded/vl.py) is trained and evaluated on.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40),
           "purple": (150, 40, 170), "orange": (240, 140, 20)}
SHAPES = ("disc", "square", "ring", "cross")


def caption(colour: str, shape: str) -> str:
    """The answer to the demo model's question (toolkit.models.embedded_vl.QUESTION) about a picture of a
    `colour` `shape`: what it is trained to say (" a red disc.", " an orange ring.")."""
    return f" {'an' if colour[0] in 'aeiou' else 'a'} {colour} {shape}."


def shape_mask(shape: str, h: int, w: int, cy: float, cx: float, r: float) -> np.ndarray:
    """[h, w] bool: the pixels of `shape` of radius r (half its width) centred at (cy, cx)."""
    y, x = np.mgrid[0:h, 0:w]
    dy, dx = np.abs(y - cy), np.abs(x - cx)
    d2 = dy ** 2 + dx ** 2
    if shape == "disc":
        return d2 < r * r
    if shape == "square":
        return (dy < 0.85 * r) & (dx < 0.85 * r)
    if shape == "ring":
        return (d2 < r * r) & (d2 > (0.55 * r) ** 2)
    if shape == "cross":
        return ((dy < 0.3 * r) & (dx < r)) | ((dx < 0.3 * r) & (dy < r))
    raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")


def picture(rng: np.random.Generator, h: int, w: int) -> tuple[np.ndarray, str, str]:
    """(RGB [h, w, 3] uint8, colour, shape): a random shape of a random colour on a dark noisy field, its
    radius 20-40% of the shorter side, wholly inside the picture."""
    img = (rng.random((h, w, 3)) * 80).astype(np.uint8)
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    r = float(rng.uniform(0.2, 0.4)) * min(h, w)
    cy, cx = float(rng.uniform(r, h - r)), float(rng.uniform(r, w - r))
    img[shape_mask(shape, h, w, cy, cx, r)] = COLOURS[colour]
    return img, colour, shape


def write_pairs(out: Path, n: int = 80, seed: int = 0, sides: tuple[int, int] = (40, 96), *,
                overwrite: bool = False) -> Path:
    """Write n pairs into the directory `out` (pictures of random sizes within `sides`), new unless
    `overwrite`; returns its pairs.jsonl."""
    from PIL import Image

    from toolkit.artifacts import atomic_directory
    from toolkit.errors import SpecPrefetchError
    from toolkit.models.embedded_vl import QUESTION

    if not overwrite and (Path(out).exists() or Path(out).is_symlink()):
        raise SpecPrefetchError(f"{out} already exists: name a new directory, or --overwrite")
    rng = np.random.default_rng(seed)
    with atomic_directory(Path(out), overwrite=overwrite, kind="pictures", option="OUT") as work:
        rows = []
        for i in range(n):
            h, w = (int(v) for v in rng.integers(sides[0], sides[1] + 1, size=2))
            img, c, s = picture(rng, h, w)
            Image.fromarray(img).save(work / f"p{i}.png")
            rows.append({"text": f"{QUESTION.strip()}{caption(c, s)} The {s} is {c}.", "image": f"p{i}.png"})
        (work / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Path(out) / "pairs.jsonl"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m toolkit.embedded.pictures", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--n", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--side", type=int, default=None, help="every picture N x N (default: random sizes, 40..96)")
    ap.add_argument("--overwrite", action="store_true", help="replace OUT (a directory of pictures)")
    a = ap.parse_args(argv)
    from toolkit.errors import SpecPrefetchError

    if a.n < 1:
        ap.error(f"--n {a.n}: at least 1")
    if a.side is not None and not 8 <= a.side <= 4096:
        ap.error(f"--side {a.side}: 8..4096")
    sides = (40, 96) if a.side is None else (a.side, a.side)
    try:
        print(f"wrote {write_pairs(a.out, a.n, a.seed, sides, overwrite=a.overwrite)}")
    except SpecPrefetchError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
