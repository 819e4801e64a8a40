"""The expert store: one file of 4 KiB-aligned expert blobs plus a binary index (docs/expert-store.md).

Experts live here, on flash, in the layout a kernel consumes directly: fp16, int8 (one fp16 scale
per output row) or int4 (two values per byte, one fp16 scale per group of 32 inputs). Every blob
starts on a 4 KiB boundary so it can be read with O_DIRECT into an aligned buffer in one request.
The header and index are little-endian fixed-size records so the C++ runner reads them without a
JSON parser; a JSON block after the index carries the model metadata. Each blob has a CRC-32;
the index has one too. The file is written to a temporary name and renamed into place.
"""
from __future__ import annotations

import dataclasses
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from toolkit.artifacts import atomic_path
from toolkit.errors import SpecPrefetchError
from toolkit.models.checkpoint import ExpertReader
# the blob layout has one definition, shared with `info` (re-exported here for the store's readers)
from toolkit.models.expert_layout import ALIGN, GROUP, SECTION_ALIGN, Section, align, blob_sections  # noqa: F401
from toolkit.models.loader import ModelSpec

MAGIC = b"SPXSTORE"
VERSION = 1
FP16_MIN_NORMAL = 6.104e-5
DTYPES = {"fp16": 0, "int8": 1, "int4": 2}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
HEADER = struct.Struct("<8sIIIIIIIIIIQQI60s")  # 128 bytes
ENTRY = struct.Struct("<IIQQII")                 # 32 bytes
assert HEADER.size == 128 and ENTRY.size == 32


def _align(n: int, a: int) -> int:
    return align(n, a)


def quantize(w: torch.Tensor, dtype: str) -> list[np.ndarray]:
    """Arrays to store for one matrix [out, in], in section order."""
    w = w.float()
    if dtype == "fp16":
        return [w.to(torch.float16).numpy()]
    if dtype == "int8":
        # the scale is stored as fp16: quantise with exactly that value, never a subnormal or zero
        scale = (w.abs().amax(1) / 127).clamp_min(FP16_MIN_NORMAL).to(torch.float16).float()
        q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
        return [q.numpy(), scale.to(torch.float16).numpy()]
    o, i = w.shape
    ip = _align(i, GROUP)
    w = torch.nn.functional.pad(w, (0, ip - i))
    g = w.reshape(o, ip // GROUP, GROUP)
    scale = (g.abs().amax(-1) / 7).clamp_min(FP16_MIN_NORMAL).to(torch.float16)
    q = torch.clamp(torch.round(g / scale.float()[..., None]), -8, 7).to(torch.int8).reshape(o, ip)
    u = (q.numpy().astype(np.int16) & 0xF).astype(np.uint8)
    packed = (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)
    return [packed, scale.numpy()]


def dequantize(blob: memoryview | bytes | np.ndarray, sections: list[Section],
               shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    """{role: float32 tensor} of one expert from its blob bytes (what the compute consumes).
    `shapes` gives the true [out, in] of int4 matrices whose rows were padded to whole groups."""
    buf = np.frombuffer(blob, dtype=np.uint8)
    arrays: dict[tuple[str, str], np.ndarray] = {}
    for s in sections:
        raw = buf[s.offset:s.offset + s.nbytes]
        dt = {"f16": np.float16, "i8": np.int8, "u8": np.uint8}[s.dtype]
        arrays[(s.role, s.kind)] = raw.view(dt).reshape(s.shape)
    out = {}
    for (role, kind), a in arrays.items():
        if kind == "bias":
            out[role] = torch.from_numpy(a.astype(np.float32))
        elif kind == "weight":
            if a.dtype == np.float16:
                out[role] = torch.from_numpy(a.astype(np.float32))
            elif a.dtype == np.int8:
                out[role] = torch.from_numpy(a.astype(np.float32) * arrays[(role, "scale")].astype(np.float32)[:, None])
            else:
                lo = (a & 0xF).astype(np.int8)
                hi = (a >> 4).astype(np.int8)
                lo = np.where(lo > 7, lo - 16, lo)
                hi = np.where(hi > 7, hi - 16, hi)
                q = np.empty((a.shape[0], a.shape[1] * 2), np.float32)
                q[:, 0::2], q[:, 1::2] = lo, hi
                sc = arrays[(role, "scale")].astype(np.float32)
                full = (q.reshape(q.shape[0], -1, GROUP) * sc[..., None]).reshape(q.shape)
                cols = shapes[role][1] if shapes and role in shapes else full.shape[1]
                out[role] = torch.from_numpy(np.ascontiguousarray(full[:, :cols]))
    return out


@dataclasses.dataclass(frozen=True)
class IndexEntry:
    layer: int      # MoE layer position (0..L-1)
    expert: int
    offset: int     # bytes from the start of the file, a multiple of 4096
    size: int       # payload bytes (the blob; the slot on flash is rounded up to 4096)
    crc32: int

    @property
    def read_size(self) -> int:
        return _align(self.size, ALIGN)


def build_store(spec: ModelSpec, out: Path, dtype: str = "fp16", progress: bool = True) -> Path:
    """Write the expert store of a checkpoint: every routed expert, one at a time (bounded memory)."""
    if dtype not in DTYPES:
        raise SpecPrefetchError(f"--dtype {dtype!r}: choose fp16, int8 or int4")
    out = Path(out)
    reader = ExpertReader(spec)
    g = spec.geometry
    mats = [(m.role, m.shape) for m in spec.family.expert_matrices(g)]
    sections, blob_size = blob_sections(mats, dtype)
    L, E = len(g.moe_layers), g.routing.num_experts
    meta = {"family": g.family, "config_hash": spec.config_hash, "model_path": str(spec.path),
            "matrices": [{"role": r, "shape": list(sh)} for r, sh in mats],
            "moe_layers": list(g.moe_layers), "dtype": dtype, "group_size": GROUP if dtype == "int4" else 0,
            "blob_size": blob_size, "sections": [dataclasses.asdict(s) for s in sections]}
    meta_bytes = json.dumps(meta).encode()
    index_offset = HEADER.size
    data_offset = _align(index_offset + ENTRY.size * L * E + len(meta_bytes), ALIGN)
    stride = _align(blob_size, ALIGN)
    entries = []
    with atomic_path(out) as tmp:
        with open(tmp, "wb") as f:
            f.truncate(data_offset + stride * L * E)
            bar = tqdm(total=L * E, desc=f"expert store ({dtype})", unit="expert", disable=not progress)
            for li, layer in enumerate(g.moe_layers):
                for e in range(E):
                    mats_t = reader.read_expert(layer, e)
                    blob = bytearray(blob_size)
                    si = 0
                    for role, _ in mats:
                        arrays = ([mats_t[role].float().to(torch.float16).numpy()] if mats_t[role].ndim == 1
                                  else quantize(mats_t[role], dtype))
                        for a in arrays:
                            s = sections[si]
                            blob[s.offset:s.offset + s.nbytes] = np.ascontiguousarray(a).tobytes()
                            si += 1
                    off = data_offset + stride * (li * E + e)
                    f.seek(off)
                    f.write(blob)
                    entries.append(IndexEntry(li, e, off, blob_size, zlib.crc32(blob)))
                    bar.update(1)
            bar.close()
            index = b"".join(ENTRY.pack(x.layer, x.expert, x.offset, x.size, x.crc32, 0) for x in entries)
            head = HEADER.pack(MAGIC, VERSION, DTYPES[dtype], L, E, g.hidden_size, g.moe_intermediate_size,
                               GROUP if dtype == "int4" else 0, int(g.expert_has_bias), ALIGN, len(meta_bytes),
                               index_offset, data_offset, zlib.crc32(index + meta_bytes), b"\0" * 60)
            f.seek(0)
            f.write(head + index + meta_bytes)
    return out


class ExpertStore:
    """Validated read access to a store file. Reads go through `os.pread` (or O_DIRECT, see io.py)."""

    def __init__(self, path: Path | str, spec: ModelSpec | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise SpecPrefetchError(f"expert store not found: {self.path}")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw = f.read(HEADER.size)
            if len(raw) < HEADER.size:
                raise SpecPrefetchError(f"{self.path}: truncated expert store (no header)")
            (magic, version, dt, L, E, H, I, group, flags, align, meta_len, index_offset, data_offset,
             index_crc, _) = HEADER.unpack(raw)
            if magic != MAGIC:
                raise SpecPrefetchError(f"{self.path}: not an expert store (bad magic {magic!r})")
            if version != VERSION:
                raise SpecPrefetchError(f"{self.path}: expert store version {version}, this toolkit reads {VERSION}")
            f.seek(index_offset)
            body = f.read(ENTRY.size * L * E + meta_len)
        if len(body) != ENTRY.size * L * E + meta_len or zlib.crc32(body) != index_crc:
            raise SpecPrefetchError(f"{self.path}: expert store index is corrupt (checksum mismatch)")
        self.dtype = DTYPE_NAMES.get(dt)
        if self.dtype is None:
            raise SpecPrefetchError(f"{self.path}: unknown dtype code {dt}")
        self.num_layers, self.num_experts, self.hidden_size, self.intermediate_size = L, E, H, I
        self.alignment, self.data_offset = align, data_offset
        if align != ALIGN:
            raise SpecPrefetchError(f"{self.path}: alignment {align}, this toolkit reads {ALIGN}")
        try:
            self.meta = json.loads(body[ENTRY.size * L * E:])
            blob_size = int(self.meta["blob_size"])
        except (ValueError, KeyError, TypeError) as e:
            raise SpecPrefetchError(f"{self.path}: expert store metadata unreadable ({e})") from None
        self.entries: dict[tuple[int, int], IndexEntry] = {}
        for n in range(L * E):
            layer, expert, off, sz, crc, _ = ENTRY.unpack_from(body, n * ENTRY.size)
            if layer >= L or expert >= E or (layer, expert) in self.entries or sz != blob_size:
                raise SpecPrefetchError(f"{self.path}: index entry {n} is invalid (layer {layer}, expert "
                                        f"{expert}, size {sz}; expected < {L}, < {E}, unique, {blob_size} B)")
            if off % ALIGN or off < data_offset or off + _align(sz, ALIGN) > size:
                raise SpecPrefetchError(f"{self.path}: expert ({layer}, {expert}) lies outside the file "
                                        f"(offset {off}, size {sz}, file {size} bytes): truncated?")
            self.entries[(layer, expert)] = IndexEntry(layer, expert, off, sz, crc)
        self.sections = [Section(**{**s, "shape": tuple(s["shape"])}) for s in self.meta["sections"]]
        self.shapes = {m["role"]: tuple(m["shape"]) for m in self.meta["matrices"]}
        self.blob_size = self.meta["blob_size"]
        self.slot_bytes = _align(self.blob_size, ALIGN)
        if spec is not None and self.meta["config_hash"] != spec.config_hash:
            raise SpecPrefetchError(f"{self.path}: store was built from model config {self.meta['config_hash']}, "
                                    f"not {spec.config_hash} ({spec.path})")

    def entry(self, layer: int, expert: int) -> IndexEntry:
        try:
            return self.entries[(layer, expert)]
        except KeyError:
            raise SpecPrefetchError(f"{self.path}: no expert ({layer}, {expert})") from None

    def check(self, layer: int, expert: int, blob: bytes | memoryview) -> None:
        e = self.entry(layer, expert)
        if zlib.crc32(blob[: e.size]) != e.crc32:
            raise SpecPrefetchError(f"{self.path}: expert ({layer}, {expert}) failed its checksum (corrupt blob)")

    def read(self, layer: int, expert: int, *, verify: bool = True) -> bytes:
        """A buffered read of one blob (tools and tests; the runtime uses io.DirectReader)."""
        e = self.entry(layer, expert)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            blob = os.pread(fd, e.size, e.offset)
        finally:
            os.close(fd)
        if verify:
            self.check(layer, expert, blob)
        return blob

    def weights(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        return dequantize(self.read(layer, expert), self.sections, self.shapes)
