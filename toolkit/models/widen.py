"""`specprefetch widen`: a checkpoint whose routed experts are wider but compute exactly what the
source's compute (docs/widen.md).

Every supported family's routed expert is a gated MLP: unit j of its intermediate axis reaches the
output only through column j of the down projection (SwiGLU: down(act(gate x) * up x); GPT-OSS:
down((clamp(up x) + 1) * glu(clamp(gate x))) + bias_down). Widening from I to N units appends N - I
units whose down-projection columns are zero, while their gate/up rows are ordinary values (normal,
with the std of the source matrix's own rows, seeded by the seed and the tensor's name); their
gate/up biases (GPT-OSS) are zero. Each added unit contributes exactly 0, so the widened model's
outputs equal the source's up to fp32 summation order. The source's values are kept bit for bit:
gate/up gain rows, down gains columns after the old ones, so the int8 per-row and int4 32-input
blocks of the original units are the same blocks (the zero columns pad the last one as the store's
own zero padding would).

Where the checkpoint keeps experts (per-expert Linears, or tensors fused over experts, gate and up
halves concatenated or interleaved, stored [out, in] or [in, out]) comes from the family's
`expert_sources`, the same description the expert store reads experts through; each stored tensor
is read as the store's ExpertReader would, widened in canonical [out, in] form, and written back in
the source's own layout. Everything else is copied byte for byte, except what transformers' own
model of the new config sizes from the routed width: DeepSeek sizes its shared experts
`n_shared_experts * moe_intermediate_size`, so they are widened the same exact way.

Memory: one tensor (one expert of a fused tensor) at a time. Non-expert tensors are copied in
chunks of their bytes; output shards are written with their header first, then each tensor as it
is produced, so a checkpoint of any size is never held in RAM. The output is assembled in a work
directory and renamed into place when complete (toolkit.artifacts.atomic_directory), then read back
through the toolkit's own ExpertReader: every expert holds the source's in its first I units.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from toolkit.artifacts import artifact_kind, atomic_directory, claim_output, write_json_atomic
from toolkit.errors import SpecPrefetchError
from toolkit.models.checkpoint import DTYPE_BYTES, ExpertReader, TensorIndex, read_header
from toolkit.models.families import ExpertSource, ModelGeometry
from toolkit.models.loader import PICKLE_SUFFIXES, SIZE_KEYS, SIZE_LIMITS, _Reads, build_on_meta, inspect_model_dir
from toolkit.models.spec import ModelSpec

OPTION = "--moe-intermediate-size"
WIDENED_KEY = "specprefetch_widened_from"  # config.json: where a widened checkpoint came from
SHARD_BYTES = 2 << 30                      # output shards of at most 2 GiB (one larger tensor: a shard alone)
CHUNK = 16 << 20                           # bytes copied at a time
VERIFY_MAPPED = 256 << 20                  # expert bytes read back through one pair of readers (memory maps)
# families whose routed experts are gated MLPs (the activation each applies): a unit with a zero
# down-projection column adds exactly 0 to the expert's output
GATED = {"qwen3_moe": "SwiGLU", "qwen3_vl_moe": "SwiGLU", "deepseek_v2": "SwiGLU", "deepseek_v3": "SwiGLU",
         "mixtral": "SwiGLU", "olmoe": "SwiGLU", "gpt_oss": "clamped GLU with biases"}
GATED_ROLES = {"gate", "up", "down"}
BIAS_ROLES = {"bias_gate", "bias_up", "bias_down"}
_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# files of a model directory that are not copied: the weights (written anew), config.json (rewritten),
# indexes of weights, and pickles (never read)
_SKIP_SUFFIXES = (".safetensors", ".index.json", *PICKLE_SUFFIXES)
MARKER = "widened.json"  # written last into a widened checkpoint; --overwrite checks it


class _Tensor:
    """One tensor of the output: name, safetensors dtype, shape, and a producer of its bytes."""

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], produce: Callable[[], Iterator[Any]]):
        self.name, self.dtype, self.shape, self.produce = name, dtype, tuple(shape), produce
        if dtype not in DTYPE_BYTES:
            raise SpecPrefetchError(f"tensor {name!r}: dtype {dtype} is not one widen copies "
                                    f"({', '.join(sorted(DTYPE_BYTES))})")
        self.nbytes = math.prod(self.shape) * DTYPE_BYTES[dtype]


def _as_bytes(t: torch.Tensor):
    """The raw bytes of a tensor (no copy for a contiguous one), for writing."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().data


_EXPONENT = {torch.float16: (torch.int16, 0x7C00), torch.bfloat16: (torch.int16, 0x7F80),
             torch.float32: (torch.int32, 0x7F800000), torch.float64: (torch.int64, 0x7FF0000000000000)}


def _finite(t: torch.Tensor) -> bool:
    """Whether every value is finite: no value has an exponent of all ones (a cheaper test than
    torch.isfinite on half-precision tensors)."""
    as_int, mask = _EXPONENT[t.dtype]
    return not bool(((t.contiguous().view(as_int) & mask) == mask).any())


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch on one thread: widening is elementwise work on one expert at a time, which gains
    nothing from more threads and loses much to their synchronisation on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _seed(seed: int, *parts: Any) -> int:
    h = hashlib.sha256(":".join(str(p) for p in (seed, *parts)).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def _drawn_rows(piece: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    """`rows` ordinary rows for a gate/up matrix `piece` [I, in]: normal with the std of piece's own
    values, cut at 4 std and at the dtype's range, in piece's dtype; finite whatever the source."""
    x = piece.float()
    std = float(x.std(correction=0)) if x.numel() > 1 else 0.0
    if not math.isfinite(std):
        std = 0.0
    g = torch.Generator().manual_seed(seed)
    out = torch.randn((rows, piece.shape[1]), generator=g) * std
    lim = min(4 * std, float(torch.finfo(piece.dtype).max))
    return out.clamp_(-lim, lim).to(piece.dtype)


def _grow(piece: torch.Tensor, old: tuple[int, ...], new: tuple[int, ...], seed: int) -> torch.Tensor:
    """A canonical expert matrix grown from shape `old` to `new`: added rows of a weight drawn
    (gate/up), added columns zero (down), added entries of a bias zero."""
    if tuple(piece.shape) != tuple(old):
        raise SpecPrefetchError(f"internal: expert piece of shape {tuple(piece.shape)}, expected {old}")
    if len(old) == 1:
        return torch.cat([piece, piece.new_zeros(new[0] - old[0])]) if new[0] > old[0] else piece
    if new[0] > old[0]:
        piece = torch.cat([piece, _drawn_rows(piece, new[0] - old[0], seed)])
    if new[1] > old[1]:
        piece = torch.cat([piece, piece.new_zeros(piece.shape[0], new[1] - old[1])], dim=1)
    return piece


def _param_transposed(canon: tuple[tuple[int, int], tuple[int, int]],
                      params: tuple[tuple[int, ...] | None, tuple[int, ...] | None]) -> bool | None:
    """Whether transformers' parameter for a fused expert tensor is laid out [in, out] per expert,
    told by its shape in the source's or the widened model (one of them is not square); None when
    the parameter is not known (per-expert Linears are [out, in] and never transposed)."""
    for (o, i), p in zip(canon, params):
        if p is None or len(p) != 3 or o == i:
            continue
        if tuple(p[1:]) == (o, i):
            return False
        if tuple(p[1:]) == (i, o):
            return True
    return None


class _ExpertTensor:
    """How one stored tensor holding (parts of) routed experts is widened: its sources in the old
    and the new geometry (gate and up share a fused tensor), and whether it is stored [in, out]."""

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], fused: bool,
                 pairs: list[tuple[ExpertSource, ExpertSource]], ctx: "_Widening",
                 params: tuple[tuple[int, ...] | None, tuple[int, ...] | None] = (None, None)):
        self.name, self.dtype, self.fused, self.pairs, self.ctx = name, dtype, fused, pairs, ctx
        one = shape[1:] if fused else shape
        self.transposed = False
        if len(one) == 2:  # the orientation the expert store's reader sees in it
            probe = torch.empty(one, device="meta")
            self.transposed = ctx.reader._orient(name, probe, pairs[0][0]) is not probe
        elif len(one) != 1:
            raise SpecPrefetchError(f"{ctx.spec.path}: expert tensor {name!r} has shape {list(shape)}, "
                                    "not a matrix or a vector per expert")
        new_rows = self._rows(ctx.new_mats, old=False)
        if len(one) == 2:
            in_new = ctx.new_mats[pairs[0][1].role][1]
            new_one = (in_new, new_rows) if self.transposed else (new_rows, in_new)
            if new_one[0] == new_one[1]:
                # a square matrix: the store's reader takes the family's declared layout, transformers
                # the layout of its own parameter (it transposes only a shape that differs from it)
                canon = ((self._rows(ctx.old_mats, old=True), ctx.old_mats[pairs[0][0].role][1]),
                         (new_rows, in_new))
                model = _param_transposed(canon, params)
                if self.transposed != pairs[0][1].transpose or (model is not None and model != self.transposed):
                    raise SpecPrefetchError(
                        f"{OPTION} {ctx.n}: would make {ctx.spec.family.name}'s expert tensor {name!r} square "
                        f"({list(new_one)}), whose orientation readers would take from their own defaults, "
                        "not from its shape; choose another width")
        else:
            new_one = (new_rows,)
        self.shape = ((shape[0],) if fused else ()) + tuple(new_one)

    def _rows(self, mats, old: bool) -> int:
        srcs = [p[0] if old else p[1] for p in self.pairs]
        if any(s.rows is not None or s.stride2 for s in srcs):
            return sum(mats[s.role][0] for s in srcs)
        return mats[srcs[0].role][0]

    def widen(self, t: torch.Tensor, expert: int) -> torch.Tensor:
        """One expert's stored matrix (or vector), widened, in the same stored layout."""
        ctx = self.ctx
        c = t.t() if self.transposed else t
        new_parts = []
        for old_src, new_src in self.pairs:
            if old_src.stride2:
                piece = c[old_src.rows[0]::2]
            elif old_src.rows is not None:
                piece = c[old_src.rows[0]:old_src.rows[1]]
            else:
                piece = c
            grown = _grow(piece, ctx.old_mats[old_src.role], ctx.new_mats[new_src.role],
                          _seed(ctx.seed, self.name, expert, old_src.role))
            new_parts.append((new_src, grown))
        if len(new_parts) == 1 and new_parts[0][0].rows is None and not new_parts[0][0].stride2:
            out = new_parts[0][1]
        else:
            rows = sum(p.shape[0] for _, p in new_parts)
            out = c.new_empty((rows, *new_parts[0][1].shape[1:]))
            for src, p in new_parts:
                if src.stride2:
                    out[src.rows[0]::2] = p
                else:
                    out[src.rows[0]:src.rows[1]] = p
        if not _finite(out):
            raise SpecPrefetchError(f"{ctx.spec.path}: expert tensor {self.name!r} (expert {expert}) holds "
                                    "non-finite values; widen writes finite weights only")
        return out.t() if self.transposed else out

    def produce(self) -> Iterator[Any]:
        if self.fused:
            for e in range(self.shape[0]):
                yield _as_bytes(self.widen(self.ctx.read(self.name, e), e))
        else:
            yield _as_bytes(self.widen(self.ctx.read(self.name), self.ctx.expert_of[self.name]))


class _Widening:
    """Everything one run needs: the source, the widths, and a reader of its tensors."""

    def __init__(self, spec: ModelSpec, new_spec: ModelSpec, n: int, seed: int):
        self.spec, self.new_spec, self.n, self.seed = spec, new_spec, n, seed
        self.index = TensorIndex(spec)
        self.reader = ExpertReader(spec)
        fam = spec.family
        self.old_mats = {m.role: m.shape for m in fam.expert_matrices(spec.geometry)}
        self.new_mats = {m.role: m.shape for m in fam.expert_matrices(new_spec.geometry)}
        self.expert_of: dict[str, int] = {}
        # each shard's header and where its data starts, read once (read_header copies a header per call)
        self.heads = {f: read_header(f) for f in spec.weight_files}
        self.starts = {f: _data_start(f) for f in spec.weight_files}

    def span(self, name: str) -> tuple[Path, int, int]:
        """(shard, first byte in the file, byte count) of a source tensor."""
        path = self.index.entries[name][0]
        begin, end = self.heads[path][name]["data_offsets"]
        return path, self.starts[path] + begin, end - begin

    def read(self, name: str, expert: int | None = None) -> torch.Tensor:
        """A source tensor (or, of a tensor fused over experts, one expert's slice) read with plain
        file reads: nothing stays mapped, so memory holds only what is being widened."""
        _, dtype, shape = self.index.entries[name]
        path, start, _ = self.span(name)
        one = shape if expert is None else shape[1:]
        size = math.prod(one) * DTYPE_BYTES[dtype]
        at = start + (0 if expert is None else expert * size)
        buf = bytearray(size)
        try:
            with open(path, "rb") as f:
                f.seek(at)
                got = f.readinto(buf)
        except OSError as e:
            raise SpecPrefetchError(f"{path}: cannot read tensor {name!r} ({e.strerror or e})") from None
        if got != size:
            raise SpecPrefetchError(f"{path}: truncated safetensors file (tensor {name!r}; changed while widening?)")
        return torch.frombuffer(buf, dtype=_TORCH_DTYPES[dtype]).reshape(one)


def _raw_copy(path: Path, start: int, n: int) -> Callable[[], Iterator[bytes]]:
    def produce():
        with open(path, "rb") as f:
            f.seek(start)
            left = n
            while left:
                block = f.read(min(CHUNK, left))
                if not block:
                    raise SpecPrefetchError(f"{path}: truncated safetensors file (changed while widening?)")
                left -= len(block)
                yield block
    return produce


def _data_start(path: Path) -> int:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return 8 + n


def _width_key(spec: ModelSpec) -> tuple[dict, str]:
    """(the config dict that holds the routed experts' width, its key): the key the family reads,
    as config.json spells it (a nested text_config for VL families)."""
    fam, config = spec.family, spec.config
    tc = fam.text_config(config)
    raw = spec.config_dict if tc is config else spec.config_dict.get("text_config")
    rec = _Reads(tc)
    fam.moe_intermediate_size(rec)
    read = [k for k in rec.seen if k in SIZE_KEYS]
    amap = dict(getattr(type(tc), "attribute_map", {}) or {})
    if isinstance(raw, dict) and len(read) == 1:
        for name in (read[0], amap.get(read[0]), *(a for a, b in amap.items() if b == read[0])):
            if name and name in raw:
                return raw, name
    raise SpecPrefetchError(f"{spec.path / 'config.json'}: cannot tell which key holds the routed experts' "
                            f"width for family {fam.name}")


def widened_config(spec: ModelSpec, n: int, seed: int) -> dict:
    """The source's config.json with the routed width set to `n` and the source recorded."""
    cfg = copy.deepcopy(spec.config_dict)
    _, key = _width_key(spec)
    holder = cfg if spec.family.text_config(spec.config) is spec.config else cfg["text_config"]
    holder[key] = n
    cfg[WIDENED_KEY] = {"path": str(spec.path.resolve()), "config_hash": spec.config_hash,
                        "family": spec.family.name, "moe_intermediate_size": spec.geometry.moe_intermediate_size,
                        "width_key": key, "seed": seed}
    return cfg


def check_source(model: str | Path, n: int) -> ModelSpec:
    """The source checkpoint, checked for widening to `n` (one-line errors naming the file or option)."""
    from toolkit.models.info import model_info

    if type(n) is not int or n < 1:
        raise SpecPrefetchError(f"{OPTION} {n!r}: must be a whole number of at least 1")
    spec = inspect_model_dir(model)  # a non-checkpoint, an unknown family: refused as `info` refuses them
    fam, geo = spec.family, spec.geometry
    roles = {s.role for s in fam.expert_sources(geo)}
    if fam.name not in GATED or not GATED_ROLES <= roles or not roles <= GATED_ROLES | BIAS_ROLES:
        raise SpecPrefetchError(f"{spec.path / 'config.json'}: family {fam.name}'s routed experts are not gated "
                                "MLPs that widen can grow exactly; supported: " + ", ".join(sorted(GATED)))
    if not geo.moe_layers:
        raise SpecPrefetchError(f"{spec.path / 'config.json'}: describes no MoE layer (all {geo.num_layers} layers "
                                "are dense): there are no routed experts to widen")
    old = geo.moe_intermediate_size
    if n <= old:
        raise SpecPrefetchError(f"{OPTION} {n}: not larger than the routed experts' width today ({old} in "
                                f"{spec.path / 'config.json'}); widen only adds units")
    if n > SIZE_LIMITS["moe_intermediate_size"]:
        raise SpecPrefetchError(f"{OPTION} {n}: at most {SIZE_LIMITS['moe_intermediate_size']}")
    _width_key(spec)
    model_info(spec)  # the checkpoint's experts are the ones config.json describes (names and sizes)
    return spec


def _claim(out: Path, overwrite: bool, inputs: tuple) -> None:
    """The overwrite rule of every writer, and one more: --overwrite replaces a model checkpoint
    only if widen wrote it (its config.json records its source)."""
    claim_output(out, kind="model", overwrite=overwrite, inputs=inputs)
    if artifact_kind(out) == "model":
        try:
            cfg = json.loads((out / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            cfg = None
        if not (isinstance(cfg, dict) and WIDENED_KEY in cfg):
            raise SpecPrefetchError(f"--out {out} is a model checkpoint that widen did not write (its config.json "
                                    f"has no {WIDENED_KEY}): --overwrite replaces only a widened checkpoint; "
                                    "choose another path")
        try:
            mark = json.loads((out / MARKER).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            mark = None
        if not (isinstance(mark, dict) and mark.get("files") == _marked_files(out)):
            raise SpecPrefetchError(f"--out {out} is a model checkpoint whose weights are not as widen wrote them "
                                    f"(no {MARKER}, or its files and sizes differ: re-saved or edited since): "
                                    "--overwrite replaces only an untouched widened checkpoint; choose another path")


def _marked_files(d: Path) -> dict[str, int]:
    """config.json and the weight files of a checkpoint directory, with their sizes."""
    return {p.name: p.stat().st_size for p in sorted(d.iterdir())
            if p.is_file() and (p.name == "config.json" or p.name.endswith((".safetensors", ".index.json")))}


def _new_geometry_ok(old: ModelGeometry, new: ModelGeometry, n: int, path: Path) -> None:
    import dataclasses

    want = dataclasses.replace(old, moe_intermediate_size=n, shared_intermediate_size=new.shared_intermediate_size)
    if new != want or new.moe_intermediate_size != n:
        raise SpecPrefetchError(f"{path}: the widened config does not describe the same model with experts {n} "
                                "wide (internal)")


def _shapes(net: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    d = {k: tuple(p.shape) for k, p in net.named_parameters()}
    d.update({k: tuple(b.shape) for k, b in net.named_buffers()})
    return d


def _module_name(fam, key: str) -> str:
    """The model's name of a checkpoint tensor (the renames transformers applies on loading)."""
    for a, b in fam.key_renames:
        key = key.replace(a, b)
    return key


def _plan(w: _Widening) -> tuple[list[_Tensor], dict[str, int]]:
    """Every output tensor in source order, and counts of what is widened."""
    spec, new_spec = w.spec, w.new_spec
    fam, geo, new_geo = spec.family, spec.geometry, new_spec.geometry
    old_srcs, new_srcs = fam.expert_sources(geo), fam.expert_sources(new_geo)
    if [(s.role, s.key, s.fused) for s in old_srcs] != [(s.role, s.key, s.fused) for s in new_srcs]:
        raise SpecPrefetchError(f"internal: family {fam.name}'s expert tensors change names when widened")
    experts: dict[str, tuple[bool, list]] = {}
    for layer in geo.moe_layers:
        for a, b in zip(old_srcs, new_srcs):
            for e in ([0] if a.fused else range(geo.routing.num_experts)):
                key = a.key.format(layer=layer, expert=e)
                experts.setdefault(key, (a.fused, []))[1].append((a, b))
                if not a.fused:
                    w.expert_of[key] = e
    # what transformers sizes from the new width outside the routed experts (DeepSeek's shared experts)
    old_shapes, new_shapes = _shapes(build_on_meta(spec)), _shapes(build_on_meta(new_spec))
    s_old, s_new = geo.shared_intermediate_size, new_geo.shared_intermediate_size
    files = {f: i for i, f in enumerate(spec.weight_files)}
    order = sorted(w.index.entries, key=lambda k: (files[w.span(k)[0]], w.span(k)[1]))
    out, counts = [], {"expert_tensors": 0, "shared_tensors": 0, "copied_tensors": 0}
    for key in order:
        path, dtype, shape = w.index.entries[key]
        if key in experts:
            if dtype not in _TORCH_DTYPES:
                raise SpecPrefetchError(f"{path}: expert tensor {key!r} is {dtype}; widen reads floating-point "
                                        "experts (dequantise the checkpoint first)")
            fused, pairs = experts[key]
            module = _module_name(fam, key)
            t = _ExpertTensor(key, dtype, shape, fused, pairs, w, (old_shapes.get(module), new_shapes.get(module)))
            out.append(_Tensor(key, dtype, t.shape, t.produce))
            counts["expert_tensors"] += 1
            continue
        was, now = old_shapes.get(_module_name(fam, key)), new_shapes.get(_module_name(fam, key))
        if was is None or now is None or was == now:
            out.append(_Tensor(key, dtype, shape, _raw_copy(*w.span(key))))
            counts["copied_tensors"] += 1
            continue
        grows = [i for i, (x, y) in enumerate(zip(was, now)) if x != y]
        if (tuple(shape) != was or not geo.n_shared_experts or len(was) != len(now) or len(grows) != 1 or len(was) > 2
                or (was[grows[0]], now[grows[0]]) != (s_old, s_new) or dtype not in _TORCH_DTYPES):
            raise SpecPrefetchError(f"{spec.path}: widening the experts would change tensor {key!r} from "
                                    f"{list(was)} to {list(now)}, which is neither a routed nor a shared expert; "
                                    f"family {fam.name} cannot be widened")
        out.append(_Tensor(key, dtype, now, _shared_producer(w, key, was, now)))
        counts["shared_tensors"] += 1
    return out, counts


def _shared_producer(w: _Widening, key: str, was: tuple, now: tuple) -> Callable[[], Iterator[Any]]:
    """A shared expert's matrix grown the same exact way: rows of gate/up drawn, columns of down
    zero, bias entries zero."""
    def produce():
        t = w.read(key)
        g = _grow(t, was, now, _seed(w.seed, key, "shared"))
        if not _finite(g):
            raise SpecPrefetchError(f"{w.spec.path}: tensor {key!r} holds non-finite values; widen writes "
                                    "finite weights only")
        yield _as_bytes(g)
    return produce


def _write_shard(path: Path, tensors: list[_Tensor], bar) -> None:
    """One safetensors file, streamed: the header (every offset is known from the shapes), then
    each tensor's bytes as they are produced. Tensors of larger elements first, so every tensor's
    offset is a multiple of its element size."""
    order = sorted(tensors, key=lambda t: -DTYPE_BYTES[t.dtype])  # stable: source order within a size
    head: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for t in order:
        head[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in order:
            n = 0
            for chunk in t.produce():
                f.write(chunk)
                n += len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
            if n != t.nbytes:
                raise SpecPrefetchError(f"internal: tensor {t.name!r} produced {n} bytes, expected {t.nbytes}")
            bar.update(n)
        f.flush()
        os.fsync(f.fileno())


def _shards(tensors: list[_Tensor], limit: int) -> list[list[_Tensor]]:
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _copy_other_files(src: Path, dst: Path) -> list[str]:
    """Tokenizer, generation config, processor configs, licence...: every regular file at the top of
    the source directory but its weights, weight indexes, config.json, pickles and hidden files."""
    copied = []
    for p in sorted(src.iterdir()):
        if (p.name.startswith(".") or p.name == "config.json" or p.name.endswith(_SKIP_SUFFIXES)
                or not p.is_file()):
            continue
        shutil.copyfile(p, dst / p.name)  # follows a symbolic link (a Hugging Face cache snapshot)
        with open(dst / p.name, "rb") as f:  # on disk before the directory is renamed into place
            os.fsync(f.fileno())
        copied.append(p.name)
    return copied


def _verify(spec: ModelSpec, new_spec: ModelSpec, progress: bool) -> None:
    """Read every expert of both checkpoints through the toolkit's ExpertReader (what the expert
    store reads): the widened one holds the source's values in its first I units and zero down
    columns after them (finiteness was checked as each tensor was written)."""
    from tqdm import tqdm

    geo = spec.geometry
    i = geo.moe_intermediate_size
    bar = tqdm(total=len(geo.moe_layers) * geo.routing.num_experts, desc="widen: check", unit="expert",
               disable=not progress)
    mapped = VERIFY_MAPPED
    for layer in geo.moe_layers:
        for e in range(geo.routing.num_experts):
            if mapped >= VERIFY_MAPPED:  # fresh readers: their memory maps close with the old ones,
                old_r, new_r = ExpertReader(spec), ExpertReader(new_spec)  # so read pages are not kept
                mapped = 0
            a, b = old_r.read_expert(layer, e), new_r.read_expert(layer, e)
            mapped += sum(t.numel() * t.element_size() for d in (a, b) for t in d.values())
            ok = True
            for role, t in a.items():
                if role == "down":
                    ok = ok and torch.equal(b[role][:, :i], t) and not b[role][:, i:].any()
                elif role == "bias_down":
                    ok = ok and torch.equal(b[role], t)
                else:
                    ok = ok and torch.equal(b[role][:i], t)
            if not ok:
                raise SpecPrefetchError(f"{new_spec.path}: expert {e} of layer {layer} does not read back as the "
                                        "source's expert with added units (internal)")
            bar.update(1)
    bar.close()


def widen_checkpoint(source: str | Path, out: str | Path, moe_intermediate_size: int, *, overwrite: bool = False,
                     seed: int = 0, progress: bool = True, shard_bytes: int = SHARD_BYTES,
                     verify: bool = True) -> dict[str, Any]:
    """Write to `out` a checkpoint of the source's family whose routed experts are
    `moe_intermediate_size` wide and compute what the source's compute (see the module doc).

    `source` is a checkpoint directory or `embedded`. An existing `out` is replaced only with
    `overwrite`, and only if widen wrote it; it may not be, hold or lie inside the source. Output
    shards hold at most `shard_bytes` (a larger single tensor gets a shard of its own). With
    `verify`, every expert is read back and compared with the source's. Returns a summary."""
    with _one_thread():
        return _widen(source, Path(out), moe_intermediate_size, overwrite, seed, progress, shard_bytes, verify)


def _widen(source, out: Path, n: int, overwrite: bool, seed: int, progress: bool, shard_bytes: int,
           verify: bool) -> dict[str, Any]:
    from tqdm import tqdm

    from toolkit.models.info import expert_bytes, model_info

    spec = check_source(source, n)
    inputs = (spec.path, *spec.weight_files)
    _claim(out, overwrite, inputs)
    geo = spec.geometry
    with atomic_directory(out, overwrite=overwrite, kind="model", inputs=inputs) as work:
        write_json_atomic(work / "config.json", widened_config(spec, n, seed))
        new_spec = inspect_model_dir(work, config_only_ok=True)  # transformers reads the new config
        _new_geometry_ok(geo, new_spec.geometry, n, work / "config.json")
        w = _Widening(spec, new_spec, n, seed)
        tensors, counts = _plan(w)
        shards = _shards(tensors, shard_bytes)
        names = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
        total = sum(t.nbytes for t in tensors)
        bar = tqdm(total=total, desc=f"widen to {n}", unit="B", unit_scale=True, unit_divisor=1024,
                   disable=not progress)
        for name, shard in zip(names, shards):
            _write_shard(work / name, shard, bar)
        bar.close()
        if len(shards) > 1:
            write_json_atomic(work / "model.safetensors.index.json",
                              {"metadata": {"total_size": total},
                               "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard}})
        copied = _copy_other_files(spec.path, work)
        # the marker --overwrite trusts: this directory's config and weight files as widen wrote them (a
        # fine-tune saved from a widened model keeps the config key, but not these files and sizes)
        write_json_atomic(work / MARKER, {"format": "specprefetch-widened", "files": _marked_files(work)})
        written = inspect_model_dir(work)
        model_info(written)  # the new experts are the ones the new config.json describes
        if verify:
            _verify(spec, written, progress)
    return {"source": str(spec.path.resolve()), "out": str(out), "family": spec.family.name,
            "config_hash": {"source": spec.config_hash, "widened": written.config_hash},
            "moe_intermediate_size": {"from": geo.moe_intermediate_size, "to": n},
            "experts": len(geo.moe_layers) * geo.routing.num_experts,
            "bytes_per_expert_fp16": {"from": expert_bytes(geo, "fp16"), "to": expert_bytes(written.geometry, "fp16")},
            "shards": names, "bytes": total, "seed": seed, "copied_files": copied, **counts}
