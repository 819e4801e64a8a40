"""The expert store: one file of 4 KiB-aligned expert blobs plus a binary index (docs/expert-store.md).

Experts live here, on flash, in the layout a kernel consumes directly: fp16, int8 (one fp16 scale
per output row) or int4 (two values per byte, one fp16 scale per group of 32 inputs). Every blob
starts on a 4 KiB boundary so it can be read with O_DIRECT into an aligned buffer in one request.
The header and index are little-endian fixed-size records so the C++ runner reads them without a
JSON parser; a JSON block after the index carries the model metadata, including the sha256 of
every weight shard the store was built from (toolkit/runtime/fingerprint.py): a store opened for a
model whose weights differ is refused. Every byte that is read is covered by a checksum: the
header by its own CRC-32, the index and metadata by another (stored in the header), each blob by
its CRC-32 in the index. The file is written to a temporary name and renamed into place; an open
store holds its file descriptor for its lifetime and never opens the path again, so a store file
replaced on disk meanwhile does not affect it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import struct
import zlib
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from toolkit.errors import SpecPrefetchError
from toolkit.models.checkpoint import ExpertReader
# the blob layout has one definition, shared with `info` (re-exported here for the store's readers)
from toolkit.models.expert_layout import ALIGN, GROUP, SECTION_ALIGN, Section, align, blob_sections  # noqa: F401
from toolkit.models.loader import ModelSpec
from toolkit.models.quant import FP16_MIN_NORMAL, group_quantize
from toolkit.runtime.fingerprint import valid_record, weights_fingerprint, weights_mismatch

MAGIC = b"SPXSTORE"
VERSION = 2  # 2: a CRC-32 over the header, and the source weights' sha256 in the metadata
DTYPES = {"fp16": 0, "int8": 1, "int4": 2}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# magic, version, dtype, L, E, H, I, group, flags, align, meta_len, index_offset, data_offset,
# index+metadata CRC, reserved (zero), header CRC (of the 124 bytes before it)
HEADER = struct.Struct("<8sIIIIIIIIIIQQI56sI")  # 128 bytes
HEADER_CRC_AT = 124
ENTRY = struct.Struct("<IIQQII")                 # 32 bytes
assert HEADER.size == 128 and ENTRY.size == 32
MAX_DIM = 1 << 16       # layers, experts (as the C++ reader)
MAX_META = 64 << 20     # metadata bytes
MAX_BLOB = 1 << 31
REBUILD = "rebuild it with `specprefetch store MODEL --out {path} --overwrite` (or re-export the bundle that holds it)"


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
    q, scale = group_quantize(w, 4)
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
        return align(self.size, ALIGN)


def seal_header(raw: bytearray) -> None:
    """Set the header CRC (bytes 124..128) of a store's first 128 bytes to match bytes 0..124."""
    struct.pack_into("<I", raw, HEADER_CRC_AT, zlib.crc32(bytes(raw[:HEADER_CRC_AT])))


def check_shards(spec: ModelSpec) -> None:
    """Every weight shard holds the bytes its safetensors header promises (a truncated download
    is named here, not as an error deep inside the reader)."""
    from toolkit.models.checkpoint import read_header

    for f in spec.weight_files:
        head = read_header(f)
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
            end = max((int(m["data_offsets"][1]) for m in head.values()), default=0)
            size = Path(f).stat().st_size
        except (OSError, KeyError, TypeError, ValueError, IndexError, struct.error) as e:
            raise SpecPrefetchError(f"{f}: unreadable safetensors file ({e})") from None
        if size < 8 + n + end:
            raise SpecPrefetchError(f"{f}: truncated safetensors file ({size} bytes, its header describes "
                                    f"{8 + n + end})")


def build_store(spec: ModelSpec, out: Path, dtype: str = "fp16", progress: bool = True, *,
                overwrite: bool = False, option: str = "--out") -> Path:
    """Write the expert store of a checkpoint: every routed expert, one at a time (bounded memory).

    The store records the sha256 of every weight shard it was read from, so it is only ever opened
    for these weights. An existing `out` is replaced only with `overwrite` and only if it is an
    expert store; `out` may not be (inside) the model directory or one of its shards. `option`
    names `out` in errors."""
    from toolkit.artifacts import atomic_output_file

    if dtype not in DTYPES:
        raise SpecPrefetchError(f"--dtype {dtype!r}: choose fp16, int8 or int4")
    out = Path(out)
    inputs = (*spec.weight_files, spec.path)
    with atomic_output_file(out, kind="store", overwrite=overwrite, inputs=inputs, option=option) as tmp:
        check_shards(spec)
        source = weights_fingerprint(spec, progress=progress)
        _write_store(spec, Path(tmp), dtype, source, progress)
        why = weights_mismatch(source, spec)  # cached hashes unless a shard changed meanwhile
        if why is not None:
            raise SpecPrefetchError(f"{spec.path}: the weights changed while the store was built ({why}); "
                                    "run again")
    return out


def _write_store(spec: ModelSpec, path: Path, dtype: str, source: dict, progress: bool) -> None:
    reader = ExpertReader(spec)
    g = spec.geometry
    mats = [(m.role, m.shape) for m in spec.family.expert_matrices(g)]
    sections, blob_size = blob_sections(mats, dtype)
    L, E = len(g.moe_layers), g.routing.num_experts
    meta = {"family": g.family, "config_hash": spec.config_hash, "model_path": str(spec.path),
            "source": source,
            "matrices": [{"role": r, "shape": list(sh)} for r, sh in mats],
            "moe_layers": list(g.moe_layers), "dtype": dtype, "group_size": GROUP if dtype == "int4" else 0,
            "blob_size": blob_size, "sections": [dataclasses.asdict(s) for s in sections]}
    meta_bytes = json.dumps(meta).encode()
    index_offset = HEADER.size
    data_offset = align(index_offset + ENTRY.size * L * E + len(meta_bytes), ALIGN)
    stride = align(blob_size, ALIGN)
    entries = []
    with open(path, "wb") as f:
        f.truncate(data_offset + stride * L * E)
        bar = tqdm(total=L * E, desc=f"expert store ({dtype})", unit="expert", disable=not progress)
        try:  # closed on any error too: an error line never shares the bar's line
            for li, layer in enumerate(g.moe_layers):
                for e in range(E):
                    try:
                        mats_t = reader.read_expert(layer, e)
                    except SpecPrefetchError:
                        raise
                    except Exception as err:  # safetensors' own errors on a damaged shard
                        raise SpecPrefetchError(f"{spec.path}: cannot read expert {e} of layer {layer} from the "
                                                f"checkpoint ({err})") from None
                    blob = bytearray(blob_size)
                    si = 0
                    for role, _ in mats:
                        if not bool(torch.isfinite(mats_t[role]).all()):  # NaN weights would decode as EOS
                            raise SpecPrefetchError(f"{_source_tensor(reader, role, layer, e)} holds NaN or infinite "
                                                    "values (damaged weights); no store written")
                        arrays = ([mats_t[role].float().to(torch.float16).numpy()] if mats_t[role].ndim == 1
                                  else quantize(mats_t[role], dtype))
                        for a in arrays:
                            if a.dtype == np.float16 and not np.isfinite(a).all():
                                raise SpecPrefetchError(f"{_source_tensor(reader, role, layer, e)} holds values past "
                                                        f"fp16's range (|w| > 65504): they cannot be stored in {dtype}")
                            s = sections[si]
                            blob[s.offset:s.offset + s.nbytes] = np.ascontiguousarray(a).tobytes()
                            si += 1
                    off = data_offset + stride * (li * E + e)
                    f.seek(off)
                    f.write(blob)
                    entries.append(IndexEntry(li, e, off, blob_size, zlib.crc32(blob)))
                    bar.update(1)
        finally:
            bar.close()
        index = b"".join(ENTRY.pack(x.layer, x.expert, x.offset, x.size, x.crc32, 0) for x in entries)
        head = bytearray(HEADER.pack(MAGIC, VERSION, DTYPES[dtype], L, E, g.hidden_size, g.moe_intermediate_size,
                                     GROUP if dtype == "int4" else 0, int(g.expert_has_bias), ALIGN,
                                     len(meta_bytes), index_offset, data_offset, zlib.crc32(index + meta_bytes),
                                     b"\0" * 56, 0))
        seal_header(head)
        f.seek(0)
        f.write(bytes(head) + index + meta_bytes)


def _source_tensor(reader: ExpertReader, role: str, layer: int, expert: int) -> str:
    """The checkpoint file and tensor an expert's matrix (or bias) `role` was read from, for errors."""
    for src in reader.sources:
        if src.role == role:
            name = reader.key(src, layer, expert)
            entry = reader.index.entries.get(name)
            where = f"{entry[0]}: tensor" if entry else "tensor"
            return f"{where} {name!r} ({role} of expert {expert}, layer {layer})"
    return f"{reader.spec.path}: {role} of expert {expert}, layer {layer}"


def _whole(v) -> int:
    """A JSON integer (not a bool, not a float that happens to be whole)."""
    if type(v) is not int:
        raise TypeError(f"{v!r} is not an integer")
    return v


def _pread_exact(fd: int, n: int, off: int, path: Path, what: str) -> bytes:
    try:
        data = os.pread(fd, n, off)
    except OSError as e:
        raise SpecPrefetchError(f"{path}: read of the expert store failed ({e.strerror or e})") from None
    while len(data) < n:  # pread may return less than asked on some filesystems
        try:
            more = os.pread(fd, n - len(data), off + len(data))
        except OSError as e:
            raise SpecPrefetchError(f"{path}: read of the expert store failed ({e.strerror or e})") from None
        if not more:
            raise SpecPrefetchError(f"{path}: truncated expert store ({what})")
        data += more
    return data


class ExpertStore:
    """Validated read access to a store file.

    The file is opened once, here, and the descriptor held until `close()` (or garbage collection):
    every read, and every reader's O_DIRECT descriptor (`open_direct`), is of this same file, so a
    store replaced or deleted on disk meanwhile does not affect an open store.

    Args:
        path: the store file.
        spec: the model it is opened for: its config hash must match, and when the spec has weight
            files (a model directory, not a bundle's config), their sha256 must be the ones the
            store was built from.
    """

    fd = -1

    def __init__(self, path: Path | str, spec: ModelSpec | None = None):
        self.path = Path(path)
        try:
            # O_NONBLOCK: a FIFO at the path must not hang the open (it is refused below)
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            raise SpecPrefetchError(f"expert store not found: {self.path}") from None
        except OSError as e:
            raise SpecPrefetchError(f"{self.path}: cannot open the expert store ({e.strerror or e})") from None
        self.fd = fd
        try:
            self._open(spec)
        except BaseException:
            self.close()
            raise

    def _open(self, spec: ModelSpec | None) -> None:
        p = self.path
        st = os.fstat(self.fd)
        if not stat.S_ISREG(st.st_mode):
            raise SpecPrefetchError(f"{p}: not an expert store (not a regular file)")
        size = self.file_size = st.st_size
        if size < HEADER.size:
            raise SpecPrefetchError(f"{p}: truncated expert store (no header)")
        raw = _pread_exact(self.fd, HEADER.size, 0, p, "no header")
        (magic, version, dt, L, E, H, I, group, flags, alignment, meta_len, index_offset, data_offset,
         index_crc, reserved, head_crc) = HEADER.unpack(raw)
        if magic != MAGIC:
            raise SpecPrefetchError(f"{p}: not an expert store (bad magic {magic!r})")
        if version != VERSION:
            hint = (f" (stores are now tied to the weights they were built from): {REBUILD.format(path=p)}"
                    if version < VERSION else ": update specprefetch")
            raise SpecPrefetchError(f"{p}: expert store format version {version}, this toolkit reads {VERSION}{hint}")
        if zlib.crc32(raw[:HEADER_CRC_AT]) != head_crc:
            raise SpecPrefetchError(f"{p}: expert store header is corrupt (checksum mismatch)")
        if any(reserved):
            raise SpecPrefetchError(f"{p}: reserved header bytes are not zero (corrupt header)")
        self.dtype = DTYPE_NAMES.get(dt)
        if self.dtype is None:
            raise SpecPrefetchError(f"{p}: unknown dtype code {dt}")
        if alignment != ALIGN:
            raise SpecPrefetchError(f"{p}: alignment {alignment}, this toolkit reads {ALIGN}")
        if not (1 <= L <= MAX_DIM and 1 <= E <= MAX_DIM and 1 <= H <= 1 << 20 and 1 <= I <= 1 << 24):
            raise SpecPrefetchError(f"{p}: header claims {L} layers x {E} experts, hidden {H}, intermediate {I} "
                                    "(corrupt header)")
        if group != (GROUP if self.dtype == "int4" else 0) or flags not in (0, 1):
            raise SpecPrefetchError(f"{p}: group size {group} / flags {flags} do not fit dtype {self.dtype} "
                                    "(corrupt header)")
        if not 2 <= meta_len <= MAX_META:
            raise SpecPrefetchError(f"{p}: metadata length {meta_len} (corrupt header)")
        body_len = ENTRY.size * L * E + meta_len
        if index_offset < HEADER.size or index_offset + body_len > size:
            raise SpecPrefetchError(f"{p}: index (offset {index_offset}, {body_len} bytes) lies outside the file "
                                    f"({size} bytes): truncated?")
        if data_offset % ALIGN or data_offset < index_offset + body_len or data_offset > size:
            raise SpecPrefetchError(f"{p}: data offset {data_offset} is not a 4096-aligned offset after the "
                                    "index, inside the file (corrupt header)")
        body = _pread_exact(self.fd, body_len, index_offset, p, "index")
        if zlib.crc32(body) != index_crc:
            raise SpecPrefetchError(f"{p}: expert store index is corrupt (checksum mismatch)")
        # what a bundle's manifest records of its store (runtime.expert_store_index_sha256): the
        # header, every blob's CRC-32 and the metadata (the source weights) under one cheap hash
        self.index_sha256 = hashlib.sha256(raw + body).hexdigest()
        self.num_layers, self.num_experts, self.hidden_size, self.intermediate_size = L, E, H, I
        self.alignment, self.data_offset, self.has_bias = alignment, data_offset, bool(flags & 1)
        self.meta = self._metadata(body[ENTRY.size * L * E:], L, group)
        blob_size = self.blob_size
        self.slot_bytes = align(blob_size, ALIGN)
        self.entries: dict[tuple[int, int], IndexEntry] = {}
        for n in range(L * E):
            layer, expert, off, sz, crc, _ = ENTRY.unpack_from(body, n * ENTRY.size)
            if layer >= L or expert >= E or (layer, expert) in self.entries or sz != blob_size:
                raise SpecPrefetchError(f"{p}: index entry {n} is invalid (layer {layer}, expert "
                                        f"{expert}, size {sz}; expected < {L}, < {E}, unique, {blob_size} B)")
            if off % ALIGN or off < data_offset or off + self.slot_bytes > size:
                raise SpecPrefetchError(f"{p}: expert ({layer}, {expert}) lies outside the file "
                                        f"(offset {off}, size {sz}, file {size} bytes): truncated?")
            self.entries[(layer, expert)] = IndexEntry(layer, expert, off, sz, crc)
        offs = sorted(e.offset for e in self.entries.values())
        for a, b in zip(offs, offs[1:]):
            if b - a < self.slot_bytes:
                raise SpecPrefetchError(f"{p}: two experts' slots overlap at offset {b} (corrupt index)")
        if spec is not None:
            self.check_model(spec)

    def _metadata(self, raw: bytes, L: int, group: int) -> dict:
        """The metadata JSON, checked against the header and against the blob layout it implies."""
        p = self.path
        try:
            meta = json.loads(raw)
            if not isinstance(meta, dict):
                raise TypeError("not a JSON object")
            for k in ("family", "config_hash", "model_path", "dtype"):
                if not isinstance(meta[k], str):
                    raise TypeError(f"{k} is not a string")
            mats = [(m["role"], tuple(_whole(d) for d in m["shape"])) for m in meta["matrices"]]
            if not mats or any(not isinstance(r, str) or len(sh) not in (1, 2) or min(sh) < 1 or max(sh) > 1 << 24
                               for r, sh in mats):
                raise ValueError("matrices must be [out, in] or [out] of positive sizes")
            layers = meta["moe_layers"]
            if (not isinstance(layers, list) or any(type(x) is not int or x < 0 for x in layers)
                    or layers != sorted(set(layers))):
                raise ValueError("moe_layers must be increasing layer numbers")
            sections = [Section(**{**s, "shape": tuple(s["shape"])}) for s in meta["sections"]]
            blob_size = meta["blob_size"]
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError) as e:
            raise SpecPrefetchError(f"{p}: expert store metadata unreadable ({e})") from None
        if meta["dtype"] != self.dtype or meta.get("group_size") != group:
            raise SpecPrefetchError(f"{p}: metadata dtype {meta['dtype']!r} / group size {meta.get('group_size')!r} "
                                    f"differ from the header's {self.dtype} / {group} (corrupt store)")
        if len(layers) != L:
            raise SpecPrefetchError(f"{p}: metadata lists {len(layers)} MoE layers, the header {L} (corrupt store)")
        want, want_size = blob_sections(mats, self.dtype)
        if sections != want or blob_size != want_size or not 1 <= blob_size <= MAX_BLOB:
            raise SpecPrefetchError(f"{p}: metadata's blob layout does not match its matrices in {self.dtype} "
                                    "(corrupt store)")
        if any(len(sh) == 1 for _, sh in mats) != self.has_bias:
            raise SpecPrefetchError(f"{p}: header flags and metadata disagree about expert biases (corrupt store)")
        if not valid_record(meta.get("source")):
            raise SpecPrefetchError(f"{p}: metadata.source (the weights the store was built from) is missing or "
                                    "malformed (corrupt store)")
        # the layout as computed (equal to the file's; 48.0 equals 48 but is no slice index)
        self.sections, self.blob_size = want, want_size
        self.shapes = dict(mats)
        return meta

    def check_model(self, spec: ModelSpec) -> None:
        """Refuse a store built from another model: another config, or (when `spec` has weight files)
        other weights with the same config, e.g. a fine-tune."""
        if self.meta["config_hash"] != spec.config_hash:
            raise SpecPrefetchError(f"{self.path}: store was built from model config {self.meta['config_hash']}, "
                                    f"not {spec.config_hash} ({spec.path})")
        g = spec.geometry  # what the store describes is what this config implies (the hash alone is a claim)
        have = (self.meta["moe_layers"], self.num_experts, self.hidden_size, self.shapes)
        want = (list(g.moe_layers), g.routing.num_experts, g.hidden_size,
                {m.role: tuple(m.shape) for m in spec.family.expert_matrices(g)})
        if have != want or self.intermediate_size != g.moe_intermediate_size or self.has_bias != g.expert_has_bias:
            raise SpecPrefetchError(f"{self.path}: the store's geometry (MoE layers {have[0]}, {have[1]} experts, "
                                    f"hidden {have[2]}, matrices {have[3]}) is not model {spec.path}'s (MoE layers "
                                    f"{want[0]}, {want[1]} experts, hidden {want[2]}, matrices {want[3]}): "
                                    "corrupt store")
        if spec.weight_files:
            why = weights_mismatch(self.meta["source"], spec)
            if why is not None:
                raise SpecPrefetchError(
                    f"{self.path}: expert store was built from other weights than {spec.path} ({why}; it was built "
                    f"from {self.meta['model_path']}): rebuild it with `specprefetch store {spec.path} --out "
                    f"{self.path} --overwrite`, or build one elsewhere")

    # -- access -----------------------------------------------------------------------------
    def drop_cache(self) -> None:
        """Give this store's pages in the page cache back (what a buffered read left; O_DIRECT leaves none)."""
        self._live()
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def open_direct(self) -> tuple[int, bool]:
        """(fd, direct): a new descriptor of this store's file (never the path, which may now name
        another file): O_DIRECT where the filesystem allows it, else buffered. The caller closes it."""
        self._live()
        flag = getattr(os, "O_DIRECT", 0)
        if flag:
            mine = os.fstat(self.fd)
            for p in (f"/proc/self/fd/{self.fd}", str(self.path)):
                try:
                    fd = os.open(p, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
                except OSError:
                    continue
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                    return fd, True
                os.close(fd)
        return os.dup(self.fd), False

    def _live(self) -> None:
        if self.fd < 0:
            raise SpecPrefetchError(f"{self.path}: the expert store was closed")

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __enter__(self) -> "ExpertStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
        """A buffered read of one blob from the held descriptor (tools and tests; the runtime uses
        io.ThreadReader / ProcessReader)."""
        e = self.entry(layer, expert)
        self._live()
        blob = _pread_exact(self.fd, e.size, e.offset, self.path, f"short read of expert ({layer}, {expert})")
        if verify:
            self.check(layer, expert, blob)
        return blob

    def weights(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        return dequantize(self.read(layer, expert), self.sections, self.shapes)
