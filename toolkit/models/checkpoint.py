"""Read a checkpoint's safetensors directly: tensor shapes from headers, and one expert at a time.

The expert store (and anything that must never hold all experts in memory) reads experts through
`ExpertReader`, which slices exactly one expert out of per-expert or fused tensors using the
family's `expert_sources` and returns canonical [out, in] matrices. Shapes come from the
safetensors headers alone, so `info` works on a 30B checkpoint without loading it.
"""
from __future__ import annotations

import functools
import json
import math
import os
import stat
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from toolkit.errors import SpecPrefetchError
from toolkit.jsonvalues import is_int
from toolkit.models.families import ExpertSource
from toolkit.models.spec import ModelSpec

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
# every dtype the safetensors format defines, in bits per element (sub-byte types pack elements)
DTYPE_BITS = {**{k: 8 * v for k, v in DTYPE_BYTES.items()}, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
              "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def _header_key(path: Path) -> tuple:
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):  # a directory, or a FIFO that would hang the read
        raise SpecPrefetchError(f"{path}: not a regular file (a safetensors file must be one)")
    return (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ino)


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file (name -> dtype, shape, offsets), validated.

    Every entry must be a tensor of a known dtype whose byte range matches its shape and lies inside
    the data section, and the file must be as long as its header says: a truncated download, an
    unfinished copy or a corrupt header is a one-line error naming the shard, here, not deep inside
    a reader. Results are cached per (file, size, mtime), so checking every shard on each open is
    cheap."""
    try:
        key = _header_key(path)
    except OSError as e:
        raise SpecPrefetchError(f"{path}: cannot read this safetensors file ({e.strerror or e})") from None
    return dict(_read_header(key, Path(path)))


@functools.lru_cache(maxsize=256)
def _read_header(key: tuple, path: Path) -> dict:
    size = key[1]
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise SpecPrefetchError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 1024 * 1024:
                raise SpecPrefetchError(f"{path}: implausible safetensors header size {n}")
            if 8 + n > size:
                raise SpecPrefetchError(f"{path}: truncated safetensors file ({size} bytes, its header alone "
                                        f"needs {8 + n})")
            head = json.loads(f.read(n))
    except OSError as e:
        raise SpecPrefetchError(f"{path}: cannot read this safetensors file ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, a 5000-digit number, deep nesting
        raise SpecPrefetchError(f"{path}: corrupt safetensors header ({type(e).__name__}: {e})") from None
    if not isinstance(head, dict):
        raise SpecPrefetchError(f"{path}: corrupt safetensors header (not a JSON object)")
    notes = head.pop("__metadata__", {})
    if not isinstance(notes, dict) or not all(isinstance(v, str) for v in notes.values()):
        raise SpecPrefetchError(f"{path}: corrupt safetensors header (__metadata__ must map names to strings)")
    end = 0
    spans = []
    for name, meta in head.items():
        try:
            dtype, shape, (b, e) = meta["dtype"], meta["shape"], meta["data_offsets"]
            ok = (isinstance(dtype, str) and isinstance(shape, list)
                  and all(is_int(d) and d >= 0 for d in shape)
                  and all(is_int(x) for x in (b, e)) and 0 <= b <= e)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise SpecPrefetchError(f"{path}: corrupt safetensors header (tensor {name!r}: {meta!r:.80})")
        if dtype not in DTYPE_BITS:
            raise SpecPrefetchError(f"{path}: corrupt safetensors header (tensor {name!r} has unknown dtype "
                                    f"{dtype[:20]!r})")
        bits = DTYPE_BITS[dtype] * math.prod(shape)
        if e - b != bits / 8:
            raise SpecPrefetchError(f"{path}: corrupt safetensors header (tensor {name!r} spans {e - b} bytes, "
                                    f"its {dtype} shape {shape} needs {bits / 8:g})")
        end = max(end, e)
        spans.append((b, e, name))
    if size < 8 + n + end:
        raise SpecPrefetchError(f"{path}: truncated safetensors file ({size} bytes, its header describes "
                                f"{8 + n + end})")
    # as the safetensors library requires (it refuses the file otherwise): the tensors cover the data
    # section exactly, without gaps, overlaps or trailing bytes
    at = 0
    for b, e, name in sorted(spans):
        if b != at:
            raise SpecPrefetchError(f"{path}: corrupt safetensors header (tensor {name!r} starts at byte {b} of "
                                    f"the data, {'overlapping the one before' if b < at else 'leaving a gap'})")
        at = e
    if size != 8 + n + end:
        raise SpecPrefetchError(f"{path}: corrupt safetensors file ({size} bytes, its header describes "
                                f"{8 + n + end}: {size - 8 - n - end} bytes after the last tensor)")
    return head


def open_safetensors(path: Path):
    """safe_open of a shard whose header read_header has checked; the library's own refusal (it may
    know a rule read_header does not) is a one-line error naming the file."""
    read_header(path)
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, ...
        raise SpecPrefetchError(f"{path}: unreadable safetensors file ({' '.join(str(e).split())[:200]})") from None


class TensorIndex:
    """Every tensor of a checkpoint: name -> (file, dtype, shape), from headers only."""

    def __init__(self, spec: ModelSpec):
        self.entries: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
        for f in spec.weight_files:
            for name, meta in read_header(f).items():
                self.entries[name] = (f, meta["dtype"], tuple(meta["shape"]))

    def nbytes(self, name: str) -> int:
        _, dtype, shape = self.entries[name]
        n = DTYPE_BYTES.get(dtype, 2)
        for s in shape:
            n *= s
        return n


def expert_keys(spec: ModelSpec, layer: int) -> set[str]:
    """Every checkpoint key that holds (part of) a routed expert of this layer."""
    keys = set()
    for src in spec.family.expert_sources(spec.geometry):
        if src.fused:
            keys.add(src.key.format(layer=layer, expert=0))
        else:
            keys.update(src.key.format(layer=layer, expert=e)
                        for e in range(spec.geometry.routing.num_experts))
    return keys


class ExpertReader:
    """Slices one routed expert out of a checkpoint, in canonical orientation."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.geo = spec.geometry
        self.sources: tuple[ExpertSource, ...] = spec.family.expert_sources(self.geo)
        self.index = TensorIndex(spec)
        self._canonical = {m.role: m.shape for m in spec.family.expert_matrices(self.geo) if len(m.shape) == 2}
        self._handles: dict[Path, object] = {}
        probe = self.key(self.sources[0], self.geo.moe_layers[0], 0) if self.geo.moe_layers else None
        if probe is not None and probe not in self.index.entries:
            quantized = [k for k in self.index.entries if k.endswith(("_blocks", "_scales"))]
            hint = (" The experts are stored quantized (MXFP4 *_blocks/*_scales); dequantise the "
                    "checkpoint to bf16 first." if quantized else "")
            raise SpecPrefetchError(f"{spec.path}: expected expert tensor {probe!r} for family "
                                    f"{spec.family.name} is not in the checkpoint.{hint}")

    @staticmethod
    def key(src: ExpertSource, layer: int, expert: int) -> str:
        return src.key.format(layer=layer, expert=expert)

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = open_safetensors(path)
        return self._handles[path]

    def _orient(self, name: str, t: torch.Tensor, src: ExpertSource) -> torch.Tensor:
        """Return the stored matrix as canonical [out, in], whichever way the file holds it.

        Converters disagree on orientation (transformers 5 may save fused Qwen3-VL experts either
        way), so the shape decides; only a square matrix falls back to the family's declared layout.
        """
        out_dim, in_dim = self._canonical[src.role]
        if src.rows is not None or src.stride2:
            out_dim *= 2  # a fused gate_up tensor holds both halves
        if out_dim == in_dim:
            return t.t() if src.transpose else t
        if tuple(t.shape) == (out_dim, in_dim):
            return t
        if tuple(t.shape) == (in_dim, out_dim):
            return t.t()
        raise SpecPrefetchError(f"{self.spec.path}: tensor {name} has shape {tuple(t.shape)}, expected "
                                f"{(out_dim, in_dim)} or its transpose for a {src.role} matrix")

    def read_expert(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """{role: tensor} of one expert; only that expert's bytes are read from disk."""
        if layer not in self.geo.moe_layers:
            raise SpecPrefetchError(f"layer {layer} is not a MoE layer of {self.spec.path}")
        if not 0 <= expert < self.geo.routing.num_experts:
            raise SpecPrefetchError(f"expert {expert} out of range 0..{self.geo.routing.num_experts - 1}")
        out = {}
        for src in self.sources:
            name = self.key(src, layer, expert)
            if name not in self.index.entries:
                raise SpecPrefetchError(f"{self.spec.path}: expert tensor {name!r} is not in the checkpoint")
            path = self.index.entries[name][0]
            try:
                sl = self._handle(path).get_slice(name)
                t = sl[expert] if src.fused else sl[:]
            except SpecPrefetchError:
                raise
            except Exception as e:  # noqa: BLE001 - the library's errors (a fused tensor with too few experts)
                raise SpecPrefetchError(f"{path}: cannot read expert {expert} of layer {layer} from tensor "
                                        f"{name!r} ({' '.join(str(e).split())[:200]})") from None
            if t.ndim == 2:
                t = self._orient(name, t, src)
            if src.stride2:
                t = t[src.rows[0]::2]
            elif src.rows is not None:
                t = t[src.rows[0]:src.rows[1]]
            out[src.role] = t.contiguous()
        return out
