"""The embedded model's training text: real prose and code documentation from Debian packages.

Nothing here touches a model hub. The text comes from five Debian packages, fetched with
``apt-get download`` (the only network the toolkit's build uses is the package registry) and
unpacked with ``dpkg-deb -x``. Each package's licence is recorded in ``SOURCES`` and copied into
the corpus manifest, so the shipped model's provenance is auditable.

Documents are split into train and held-out by a hash of their id, so the split is the same on
every machine and never depends on file order.

Run::

    python -m toolkit.embedded.corpus --out build/corpus          # fetches the .debs itself
    python -m toolkit.embedded.corpus --debs DIR --out build/corpus
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

from toolkit.artifacts import atomic_directory, atomic_write_text, write_json_atomic


@dataclasses.dataclass(frozen=True)
class Source:
    package: str
    licence: str
    what: str


SOURCES: tuple[Source, ...] = (
    Source("dict-gcide", "GPL-3+", "Collaborative International Dictionary of English 0.48"),
    Source("dict-wn", "WordNet 3.0 licence (permissive, notice required)", "WordNet 3.0 dictionary"),
    Source("python3.11-doc", "PSF-2.0", "Python 3.11 documentation (reST sources)"),
    Source("linux-doc-6.1", "GPL-2", "Linux 6.1 kernel documentation (reST sources)"),
    Source("fortunes", "BSD-4-clause / public domain (see package copyright)", "fortune cookies"),
)

DOC_CHARS = 6000  # dictionary streams are cut into documents of about this many characters


def fetch_debs(dest: Path) -> None:
    """Download the source packages with apt-get (needs the Debian package registry)."""
    dest.mkdir(parents=True, exist_ok=True)
    names = [s.package for s in SOURCES]
    try:
        subprocess.run(["apt-get", "download", *names], cwd=dest, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    except FileNotFoundError as e:
        raise SystemExit("corpus: apt-get not found; download these .deb files by hand into "
                         f"{dest}: {' '.join(names)}") from e
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"corpus: 'apt-get download {' '.join(names)}' failed "
                         f"(run 'apt-get update' first?):\n{e.stderr}") from e


def unpack(debs: Path, root: Path) -> dict[str, str]:
    """Unpack every wanted .deb under root/<package>; return package -> .deb file name."""
    found = {}
    for s in SOURCES:
        matches = sorted(debs.glob(f"{s.package}_*.deb"))
        if not matches:
            raise SystemExit(f"corpus: no {s.package}_*.deb in {debs}")
        target = root / s.package
        if not target.exists():
            with atomic_directory(target, overwrite=False, kind="unpacked", inputs=(debs,)) as partial:
                subprocess.run(["dpkg-deb", "-x", str(matches[-1]), str(partial)], check=True)
        found[s.package] = matches[-1].name
    return found


def _chunks(text: str, size: int) -> Iterator[str]:
    """Cut a long stream at blank lines into pieces of roughly `size` characters."""
    buf: list[str] = []
    n = 0
    for para in re.split(r"\n\s*\n", text):
        buf.append(para)
        n += len(para)
        if n >= size:
            yield "\n\n".join(buf)
            buf, n = [], 0
    if buf:
        yield "\n\n".join(buf)


def iter_documents(root: Path) -> Iterator[tuple[str, str, str]]:
    """Yield (package, document id, text) for every document of the unpacked packages."""
    for pkg, name in (("dict-gcide", "gcide"), ("dict-wn", "wn")):
        raw = gzip.decompress((root / pkg / "usr/share/dictd" / f"{name}.dict.dz").read_bytes())
        text = raw.decode("utf-8", errors="replace")
        for i, chunk in enumerate(_chunks(text, DOC_CHARS)):
            yield pkg, f"{name}:{i}", chunk
    for pkg in ("python3.11-doc", "linux-doc-6.1"):
        for path in sorted((root / pkg).rglob("_sources/**/*.rst.txt")):
            rel = path.relative_to(root / pkg).as_posix()
            yield pkg, rel, path.read_text(encoding="utf-8", errors="replace")
    fdir = root / "fortunes/usr/share/games/fortunes"
    for path in sorted(fdir.iterdir()):
        if path.suffix or path.is_dir():
            continue
        u8 = path.with_suffix(".u8")
        text = (u8 if u8.exists() else path).read_text(encoding="utf-8", errors="replace")
        for i, chunk in enumerate(_chunks(text.replace("\n%\n", "\n\n"), DOC_CHARS)):
            yield "fortunes", f"fortunes/{path.name}:{i}", chunk


def is_heldout(doc_id: str, frac: float) -> bool:
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big")
    return (h % 1_000_000) < frac * 1_000_000


def build_corpus(debs: Path, out: Path, heldout_frac: float = 0.01) -> dict:
    """Write out/train.jsonl, out/heldout.jsonl and out/manifest.json; return the manifest."""
    root = out / "unpacked"
    debnames = unpack(debs, root)
    lines: dict[str, list[str]] = {"train": [], "heldout": []}
    chars = {"train": 0, "heldout": 0}
    per_source: dict[str, int] = {}
    for pkg, doc_id, text in iter_documents(root):
        text = text.strip()
        if len(text) < 64:
            continue
        split = "heldout" if is_heldout(doc_id, heldout_frac) else "train"
        lines[split].append(json.dumps({"source": pkg, "id": doc_id, "text": text}))
        chars[split] += len(text)
        per_source[pkg] = per_source.get(pkg, 0) + len(text)
    for split, rows in lines.items():
        atomic_write_text(out / f"{split}.jsonl", "\n".join(rows) + "\n")
    manifest = {
        "format": "specprefetch-corpus/1",
        "heldout_frac": heldout_frac,
        "documents": {k: len(v) for k, v in lines.items()},
        "chars": chars,
        "chars_per_source": per_source,
        "sources": [dataclasses.asdict(s) | {"deb": debnames[s.package]} for s in SOURCES],
    }
    write_json_atomic(out / "manifest.json", manifest)
    return manifest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--debs", type=Path, help="folder with the .deb files (default: download them)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--heldout-frac", type=float, default=0.01)
    a = ap.parse_args(argv)
    debs = a.debs or a.out / "debs"
    if a.debs is None:
        fetch_debs(debs)
    m = build_corpus(debs, a.out, a.heldout_frac)
    json.dump({k: m[k] for k in ("documents", "chars")}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
