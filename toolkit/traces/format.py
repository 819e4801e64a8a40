"""The routing-trace format: versioned safetensors shards plus manifest.json (docs/trace-format.md).

A trace directory is written as DIR.partial and renamed to DIR only when complete, so DIR never
holds a half-written trace. Each shard is written atomically and recorded, with its sha256, in
DIR.partial/progress.json; an interrupted run resumes from the last recorded shard. The reader
streams one shard at a time and checks each shard's checksum and shapes before handing it out.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from toolkit import __version__
from toolkit.artifacts import (AtomicDirectory, atomic_write_with, partial_dir, read_json, sha256_file,
                               write_json_atomic)
from toolkit.errors import SpecPrefetchError
from toolkit.models.loader import ModelSpec, inspect_model_dir

FORMAT = "specprefetch-trace"
VERSION = 1
SPLITS = ("train", "heldout")

# Token kinds in the `kind` field.
PREFILL, DECODE, IMAGE = 0, 1, 2

# Every per-token field, and its dtype. Shapes: N tokens, L MoE layers, k top-k, E experts,
# m kept router probabilities, H hidden size, M tokens with a stored hidden state.
FIELDS = {
    "token_id": np.int32,        # [N]
    "seq": np.int32,             # [N] global sequence index
    "pos": np.int32,             # [N] position inside its sequence
    "kind": np.uint8,            # [N] PREFILL, DECODE or IMAGE
    "expert_ids": np.int16,      # [N, L, k] selected experts, by descending score
    "expert_weights": np.float16,  # [N, L, k] their routing weights as the model applied them
    "router_probs": np.float16,  # [N, L, E] full distribution ...
    "router_top_ids": np.int16,  # [N, L, m] ... or its top-m ids
    "router_top_probs": np.float16,  # [N, L, m] and values, for large E
    "hidden_rows": np.int32,     # [M] rows of this shard whose router input is stored
    "hidden": np.float16,        # [M, L, H] router input (the adapter's training input)
}


def manifest_path(d: Path) -> Path:
    return d / "manifest.json"


@dataclasses.dataclass
class ShardBuffer:
    """Rows accumulated in memory until the next shard flush."""
    rows: dict[str, list[np.ndarray]] = dataclasses.field(default_factory=dict)
    tokens: int = 0

    def add(self, **arrays: np.ndarray) -> None:
        for k, v in arrays.items():
            self.rows.setdefault(k, []).append(v)

    def take(self) -> dict[str, np.ndarray]:
        out = {k: np.concatenate(v).astype(FIELDS[k], copy=False) for k, v in self.rows.items()}
        self.rows, self.tokens = {}, 0
        return out


class TraceWriter:
    """Writes shards into OUT.partial; `finish()` writes manifest.json and renames to OUT."""

    def __init__(self, out: Path, header: dict[str, Any], *, resume: bool = True, overwrite: bool = False):
        self.out = Path(out)
        self.work = partial_dir(self.out)
        self.header = header
        progress = self.work / "progress.json"
        # OUT.partial, kept when it holds an interrupted run's progress (resumed), else made afresh
        self.dir = AtomicDirectory(self.out, overwrite=overwrite, resume=resume and progress.exists())
        self.shards: list[dict[str, Any]] = []
        self.next_seq = 0
        self.seq_split: dict[int, str] = {}
        if self.dir.resumed:
            state = read_json(progress, "trace progress file")
            if state.get("header") != header:
                raise SpecPrefetchError(
                    f"{self.work} holds an interrupted trace made with other settings or data; "
                    "delete it (or pass --overwrite) to start again")
            self.shards = state["shards"]
            for s in self.shards:
                if not (self.work / s["file"]).exists() or sha256_file(self.work / s["file"]) != s["sha256"]:
                    raise SpecPrefetchError(f"{self.work / s['file']}: shard of the interrupted run is "
                                            f"missing or corrupt; delete {self.work} to start again")
            self.next_seq = int(state["next_seq"])
            self.seq_split = {int(k): v for k, v in state["seq_split"].items()}
        else:
            (self.work / "shards").mkdir(parents=True)
        self.buffers = {s: ShardBuffer() for s in SPLITS}
        self.resumed = self.next_seq > 0

    def add_sequence(self, seq: int, split: str, arrays: dict[str, np.ndarray], n_tokens: int) -> None:
        self.seq_split[seq] = split
        buf = self.buffers[split]
        if "hidden_rows" in arrays:  # rows are local to the sequence: shift to the buffer's rows
            arrays = dict(arrays, hidden_rows=arrays["hidden_rows"] + buf.tokens)
        buf.add(**arrays)
        buf.tokens += n_tokens

    def buffered_tokens(self) -> int:
        return sum(b.tokens for b in self.buffers.values())

    def flush(self, next_seq: int) -> None:
        """Write every non-empty buffer as a shard, then record progress up to `next_seq`."""
        for split, buf in self.buffers.items():
            if buf.tokens == 0:
                continue
            n = buf.tokens
            arrays = buf.take()
            idx = sum(1 for s in self.shards if s["split"] == split)
            name = f"shards/{split}-{idx:05d}.safetensors"
            meta = {"format": FORMAT, "version": str(VERSION), "split": split, "tokens": str(n)}
            atomic_write_with(self.work / name, lambda p: save_file(arrays, str(p), metadata=meta))
            self.shards.append({"file": name, "split": split, "tokens": n,
                                "seq_range": [int(arrays["seq"].min()), int(arrays["seq"].max())],
                                "prefill_tokens": int((arrays["kind"] == PREFILL).sum()),
                                "decode_tokens": int((arrays["kind"] == DECODE).sum()),
                                "image_tokens": int((arrays["kind"] == IMAGE).sum()),
                                "hidden_tokens": int(len(arrays.get("hidden_rows", []))),
                                "bytes": (self.work / name).stat().st_size,
                                "sha256": sha256_file(self.work / name)})
        self.next_seq = next_seq
        write_json_atomic(self.work / "progress.json",
                          {"header": self.header, "shards": self.shards, "next_seq": next_seq,
                           "seq_split": {str(k): v for k, v in self.seq_split.items()}})

    def finish(self, extra: dict[str, Any]) -> Path:
        tokens = {s: {"total": 0, "prefill": 0, "decode": 0, "image": 0} for s in SPLITS}
        for sh in self.shards:
            t = tokens[sh["split"]]
            t["total"] += sh["tokens"]
            for kind in ("prefill", "decode", "image"):
                t[kind] += sh[f"{kind}_tokens"]
        manifest = {
            "format": FORMAT, "version": VERSION, "toolkit_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **self.header,
            "split": {s: sorted(k for k, v in self.seq_split.items() if v == s) for s in SPLITS},
            "tokens": tokens,
            "shards": self.shards,
            **extra,
        }
        write_json_atomic(manifest_path(self.work), manifest)
        self.dir.commit()
        # only now: until the rename, progress.json lets a rerun finish instead of starting over
        (self.out / "progress.json").unlink(missing_ok=True)
        return self.out


class TraceReader:
    """Validated, streaming access to a trace directory."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.is_dir():
            hint = ""
            if partial_dir(self.path).exists():
                hint = f" ({partial_dir(self.path)} holds an unfinished run: re-run trace to resume it)"
            raise SpecPrefetchError(f"trace directory not found: {self.path}{hint}")
        m = read_json(manifest_path(self.path), "trace manifest")
        if m.get("format") != FORMAT:
            raise SpecPrefetchError(f"{manifest_path(self.path)}: not a specprefetch trace (format "
                                    f"{m.get('format')!r})")
        if m.get("version") != VERSION:
            raise SpecPrefetchError(f"{manifest_path(self.path)}: trace format version {m.get('version')} "
                                    f"is not supported by this toolkit (reads version {VERSION})")
        for key in ("model", "shards", "split", "settings"):
            if key not in m:
                raise SpecPrefetchError(f"{manifest_path(self.path)}: missing key {key!r}")
        self.manifest = m
        self.model = m["model"]
        for s in m["shards"]:
            f = self.path / s["file"]
            if not f.exists():
                raise SpecPrefetchError(f"{f}: shard listed in the manifest is missing")
            if f.stat().st_size != s["bytes"]:
                raise SpecPrefetchError(f"{f}: shard is {f.stat().st_size} bytes, manifest says "
                                        f"{s['bytes']} (truncated or replaced)")

    @property
    def moe_layers(self) -> list[int]:
        return self.model["moe_layers"]

    @property
    def num_experts(self) -> int:
        return self.model["num_experts"]

    @property
    def top_k(self) -> int:
        return self.model["top_k"]

    @property
    def hidden_size(self) -> int:
        return self.model["hidden_size"]

    def shards(self, split: str) -> list[dict[str, Any]]:
        if split not in SPLITS:
            raise SpecPrefetchError(f"unknown split {split!r}; expected one of {SPLITS}")
        return [s for s in self.manifest["shards"] if s["split"] == split]

    def read_shard(self, shard: dict[str, Any], *, verify: bool = True) -> dict[str, np.ndarray]:
        f = self.path / shard["file"]
        if verify and sha256_file(f) != shard["sha256"]:
            raise SpecPrefetchError(f"{f}: checksum mismatch (the shard is corrupt or was modified)")
        try:
            arrays = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise SpecPrefetchError(f"{f}: unreadable shard ({e})") from None
        n = shard["tokens"]
        L = len(self.moe_layers)
        expect = {"token_id": (n,), "seq": (n,), "pos": (n,), "kind": (n,),
                  "expert_ids": (n, L, self.top_k), "expert_weights": (n, L, self.top_k)}
        if "router_probs" in arrays:
            expect["router_probs"] = (n, L, self.num_experts)
        for k, shape in expect.items():
            if k not in arrays or tuple(arrays[k].shape) != shape:
                got = tuple(arrays[k].shape) if k in arrays else "missing"
                raise SpecPrefetchError(f"{f}: field {k} has shape {got}, expected {shape}")
        if "hidden" in arrays and tuple(arrays["hidden"].shape[1:]) != (L, self.hidden_size):
            raise SpecPrefetchError(f"{f}: field hidden has shape {arrays['hidden'].shape}, "
                                    f"expected [M, {L}, {self.hidden_size}]")
        return arrays

    def iter_shards(self, split: str, *, verify: bool = True) -> Iterator[dict[str, np.ndarray]]:
        """One shard's arrays at a time: memory stays bounded by the shard size."""
        for s in self.shards(split):
            yield self.read_shard(s, verify=verify)

    def iter_hidden(self, split: str, *, decode_only: bool = False) -> Iterator[dict[str, np.ndarray]]:
        """Per shard, only the tokens whose hidden state is stored, aligned row for row:
        hidden [M, L, H], router_probs / expert_ids [M, L, ...], kind, seq, pos [M]."""
        for a in self.iter_shards(split):
            rows = a.get("hidden_rows")
            if rows is None or len(rows) == 0:
                continue
            out = {"hidden": a["hidden"]}
            for k in ("router_probs", "router_top_ids", "router_top_probs", "expert_ids",
                      "expert_weights", "kind", "seq", "pos", "token_id"):
                if k in a:
                    out[k] = a[k][rows]
            if decode_only:
                keep = out["kind"] == DECODE
                out = {k: v[keep] for k, v in out.items()}
            yield out

    def load(self, split: str, fields: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Concatenate some per-token fields over a split (for small traces and tests)."""
        parts: dict[str, list[np.ndarray]] = {f: [] for f in fields}
        for a in self.iter_shards(split):
            for f in fields:
                parts[f].append(a[f])
        return {f: (np.concatenate(v) if v else np.zeros((0,), FIELDS[f])) for f, v in parts.items()}


def trace_model_spec(reader: TraceReader, model: str | Path | None) -> ModelSpec:
    """The model a trace was made from; a different model is an error."""

    spec = inspect_model_dir(model or reader.model["path"])
    if spec.config_hash != reader.model["config_hash"]:
        raise SpecPrefetchError(f"trace {reader.path} was recorded from model config "
                                f"{reader.model['config_hash']}, but {spec.path} has {spec.config_hash}")
    return spec
