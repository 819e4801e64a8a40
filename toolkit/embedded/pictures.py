"""Synthetic picture/caption pairs for vision-language traces and benches: a disc of one of six colours on
a dark noisy field, at a random size, captioned with its colour (so the image and the text agree).

    python -m toolkit.embedded.pictures OUT [--n 80] [--seed 0]

writes OUT/p0.png ... and OUT/pairs.jsonl (`{"text": ..., "image": "p0.png"}` lines, the format `trace
--data` reads). Refuses an OUT that exists (nothing is replaced).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40),
           "purple": (150, 40, 170), "orange": (240, 140, 20)}


def write_pairs(out: Path, n: int = 80, seed: int = 0, sides: tuple[int, int] = (40, 96)) -> Path:
    """Write n pairs into the new directory `out`; returns its pairs.jsonl."""
    from PIL import Image

    from toolkit.artifacts import atomic_directory

    from toolkit.errors import SpecPrefetchError

    if Path(out).exists() or Path(out).is_symlink():
        raise SpecPrefetchError(f"{out} already exists: name a new directory (nothing is replaced)")
    rng = np.random.default_rng(seed)
    names = list(COLOURS)
    with atomic_directory(Path(out), overwrite=False, kind="pictures", option="OUT") as work:
        rows = []
        for i in range(n):
            h, w = (int(v) for v in rng.integers(sides[0], sides[1] + 1, size=2))
            img = (rng.random((h, w, 3)) * 80).astype(np.uint8)
            c = names[int(rng.integers(len(names)))]
            y, x = np.mgrid[0:h, 0:w]
            img[(y - h / 2) ** 2 + (x - w / 2) ** 2 < (min(h, w) / 3) ** 2] = COLOURS[c]
            Image.fromarray(img).save(work / f"p{i}.png")
            rows.append({"text": f"A {c} disc on a dark field, picture {i}; the disc is {c}.", "image": f"p{i}.png"})
        (work / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Path(out) / "pairs.jsonl"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m toolkit.embedded.pictures", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--n", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    from toolkit.errors import SpecPrefetchError

    if a.n < 1:
        ap.error(f"--n {a.n}: at least 1")
    try:
        print(f"wrote {write_pairs(a.out, a.n, a.seed)}")
    except SpecPrefetchError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
