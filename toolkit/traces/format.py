"""The routing-trace format: versioned safetensors shards plus manifest.json (docs/trace-format.md).

A trace directory is written as DIR.partial and renamed to DIR only when complete, so DIR never
holds a half-written trace. Each shard is written atomically and recorded, with its sha256, in
DIR.partial/progress.json; an interrupted run resumes from the last recorded shard. The reader
checks the manifest's structure on open, and streams one shard at a time, checking each shard's
checksum, dtypes, shapes and id ranges before handing it out. `trace_model_spec` is the one way a
reader finds the trace's model: the recorded absolute path (or --model), checked by config hash.
"""
from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from safetensors.numpy import load_file, save_file

from toolkit import __version__
from toolkit.artifacts import (AtomicDirectory, atomic_write_with, os_error, partial_dir, read_json, sha256_file,
                               write_json_atomic)
from toolkit.errors import SpecPrefetchError, note_interrupt
from toolkit.jsonvalues import is_int
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


def _remove_tree(p: Path) -> None:
    if p.is_symlink() or p.is_file():
        p.unlink()
    elif p.is_dir():
        shutil.rmtree(p)


def _resume_key(header: dict[str, Any]) -> Any:
    """What must match for a run to resume another's progress: everything but how prompts were
    batched (`settings.batch`), which changes speed, not what is recorded. (Where the layers were
    placed, `settings.placement`, must match: accelerate's offload hooks may round a decode step
    differently in the last place.)"""
    if not isinstance(header, dict):
        return header
    settings = header.get("settings")
    if isinstance(settings, dict):
        header = dict(header, settings={k: v for k, v in settings.items() if k != "batch"})
    return header


def _read_progress(work: Path) -> dict[str, Any] | None:
    """TRACE.partial/progress.json, or None when there is none; a malformed one is an error."""
    progress = work / "progress.json"
    if not progress.is_file():
        return None
    hint = f"delete {work} (or pass --overwrite) to start again"
    try:
        state = read_json(progress, "trace progress file")
    except SpecPrefetchError as e:
        raise SpecPrefetchError(f"{e}; {hint}") from None
    except (ValueError, RecursionError) as e:  # past JSON's syntax: a 5000-digit number, deep nesting
        raise SpecPrefetchError(f"trace progress file {progress} is not valid JSON ({e}); {hint}") from None
    if not isinstance(state, dict):
        raise SpecPrefetchError(f"{progress}: malformed trace progress file; {hint}")
    return state


def _check_progress(state: dict[str, Any], work: Path) -> None:
    counts = ("prefill_tokens", "decode_tokens", "image_tokens")
    ok = (isinstance(state.get("shards"), list)
          and all(isinstance(s, dict) and all(check(s.get(k)) for k, check, _ in _SHARD)
                  and all(is_int(s.get(k)) for k in counts) for s in state["shards"])
          and is_int(state.get("next_seq")) and isinstance(state.get("seq_split"), dict)
          and all(v in SPLITS for v in state["seq_split"].values()))
    if ok:
        try:
            seqs = [int(k) for k in state["seq_split"]]
        except ValueError:
            ok = False
    if ok:  # the run resumes at next_seq: it must lie in the run, after every sequence already traced
        settings = state.get("header", {}).get("settings") if isinstance(state.get("header"), dict) else None
        total = settings.get("sequences") if isinstance(settings, dict) else None
        ok = (0 <= state["next_seq"] and (not is_int(total) or state["next_seq"] <= total)
              and all(0 <= k < state["next_seq"] for k in seqs))
    if not ok:
        raise SpecPrefetchError(f"{work / 'progress.json'}: malformed trace progress file; delete {work} "
                                "(or pass --overwrite) to start again")


class TraceWriter:
    """Writes shards into OUT.partial; `finish()` writes manifest.json and renames it to OUT.

    Use it as a context manager: on an exception (Ctrl-C and SIGTERM included) OUT is untouched,
    OUT.partial is kept for the next run to resume, and the lock on OUT is given up.

    `inputs` (the data files and the model directory) may not be OUT, inside it or contain it;
    an existing OUT is replaced only with `overwrite`, and only if it is a trace. An interrupted
    run's OUT.partial is resumed when its settings match `header` (all but `settings.batch`); one
    made with other settings, or unreadable, is an error, or with `overwrite` started afresh.
    """

    def __init__(self, out: Path, header: dict[str, Any], *, resume: bool = True, overwrite: bool = False,
                 inputs: tuple[Path, ...] = ()):
        self.out = Path(out)
        self.header = header
        # always OUT.partial (resume=True), so that whatever this run finishes can be resumed
        self.dir = AtomicDirectory(self.out, overwrite=overwrite, resume=True, kind="trace", inputs=tuple(inputs))
        self.work = self.dir.work
        self.shards: list[dict[str, Any]] = []
        self.next_seq = 0
        self.seq_split: dict[int, str] = {}
        try:
            state = self._resumable(resume, overwrite) if self.dir.resumed else None
            if state is None:  # start afresh (we hold the lock on OUT: nobody else writes here)
                # empties OUT.partial, which AtomicDirectory made or found marked as the toolkit's own
                # (one without the marker was refused there, untouched)
                self.dir.restart()
                (self.work / "shards").mkdir()
            else:
                self.shards = state["shards"]  # each checked against its sha256 by _resumable
                self.next_seq = int(state["next_seq"])
                self.seq_split = {int(k): v for k, v in state["seq_split"].items()}
        except BaseException:
            self.dir.release()
            raise
        self.buffers = {s: ShardBuffer() for s in SPLITS}
        self.resumed = self.next_seq > 0

    def _resumable(self, resume: bool, overwrite: bool) -> dict[str, Any] | None:
        """The interrupted run's progress to resume, or None to start afresh."""
        if not resume:
            return None
        try:
            state = _read_progress(self.work)
            if state is None:  # interrupted before its first shard: nothing to resume
                return None
            if _resume_key(state.get("header")) != _resume_key(self.header):
                raise SpecPrefetchError(
                    f"{self.work} holds an interrupted trace made with other settings or data; "
                    "delete it (or pass --overwrite) to start again")
            _check_progress(state, self.work)
            for s in state["shards"]:
                f = self.work / s["file"]
                if not f.is_file() or sha256_file(f) != s["sha256"]:
                    raise SpecPrefetchError(f"{f}: shard of the interrupted run is missing or corrupt; "
                                            f"delete {self.work} (or pass --overwrite) to start again")
        except SpecPrefetchError:
            if overwrite:  # --overwrite: whatever is there is replaced
                return None
            raise
        return state

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, et, e, tb) -> None:
        self.dir.release()  # idempotent; finish() has released it already on success
        if e is None:
            return
        if isinstance(e, KeyboardInterrupt):
            note_interrupt(e, f"nothing was written to {self.out}; {self.work} holds the finished shards "
                              f"({self.next_seq} sequences) and the same command resumes from there")
        elif isinstance(e, OSError):
            raise os_error(e, self.work) from e

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


def _int_list(v: Any) -> bool:
    return isinstance(v, list) and all(is_int(x) for x in v)


def _split_tokens(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(v.get(s), dict) and is_int(v[s].get("total"))
                                       for s in SPLITS)


# (dotted key, check, what it must be) for every manifest field a reader uses
_MANIFEST: list[tuple[str, Any, str]] = [
    ("model", lambda v: isinstance(v, dict), "an object"),
    ("model.config_hash", lambda v: isinstance(v, str), "a string"),
    ("model.moe_layers", lambda v: _int_list(v) and len(v) > 0, "a non-empty list of integers"),
    ("model.num_experts", lambda v: is_int(v) and v > 0, "a positive integer"),
    ("model.top_k", lambda v: is_int(v) and v > 0, "a positive integer"),
    ("model.hidden_size", lambda v: is_int(v) and v > 0, "a positive integer"),
    ("shards", lambda v: isinstance(v, list), "a list"),
    ("split", lambda v: isinstance(v, dict) and all(_int_list(v.get(s)) and all(0 <= x < 2**31 for x in v[s])
                                                    for s in SPLITS),
     "an object with train and heldout lists of sequence numbers"),
    ("settings", lambda v: isinstance(v, dict), "an object"),
    ("tokens", _split_tokens, "an object with train and heldout token counts"),
]

_SHARD: list[tuple[str, Any, str]] = [
    ("file", lambda v: (isinstance(v, str) and v != "" and not Path(v).is_absolute()
                        and ".." not in Path(v).parts), "a path inside the trace directory"),
    ("split", lambda v: v in SPLITS, f"one of {', '.join(SPLITS)}"),
    ("tokens", lambda v: is_int(v) and v > 0, "a positive integer"),
    ("bytes", lambda v: is_int(v) and v >= 0, "a byte count"),
    ("sha256", lambda v: isinstance(v, str), "a string"),
]


def check_manifest(m: Any, file: Path) -> None:
    """Refuse a manifest.json that is not what TraceWriter writes, naming the file and the field."""
    if not isinstance(m, dict):
        raise SpecPrefetchError(f"{file}: not a specprefetch trace manifest (not a JSON object)")
    if m.get("format") != FORMAT:
        raise SpecPrefetchError(f"{file}: not a specprefetch trace (format {m.get('format')!r})")
    if m.get("version") != VERSION:
        raise SpecPrefetchError(f"{file}: trace format version {m.get('version')} "
                                f"is not supported by this toolkit (reads version {VERSION})")
    for key, ok, what in _MANIFEST:
        parent, _, name = key.rpartition(".")
        d = m[parent] if parent else m
        if name not in d:
            raise SpecPrefetchError(f"{file}: missing key {key!r}")
        if not ok(d[name]):
            raise SpecPrefetchError(f"{file}: malformed trace manifest: {key!r} must be {what}")
    if m["model"]["top_k"] > m["model"]["num_experts"]:
        raise SpecPrefetchError(f"{file}: malformed trace manifest: top_k {m['model']['top_k']} exceeds "
                                f"num_experts {m['model']['num_experts']}")
    for n, s in enumerate(m["shards"]):
        if not isinstance(s, dict):
            raise SpecPrefetchError(f"{file}: malformed trace manifest: shards[{n}] must be an object")
        for key, ok, what in _SHARD:
            if not ok(s.get(key)):
                raise SpecPrefetchError(f"{file}: malformed trace manifest: shards[{n}].{key} must be {what}")
        if "hidden_tokens" in s and not (is_int(s["hidden_tokens"]) and s["hidden_tokens"] >= 0):
            raise SpecPrefetchError(f"{file}: malformed trace manifest: shards[{n}].hidden_tokens must be "
                                    "a token count")


class TraceReader:
    """Validated, streaming access to a trace directory.

    Opening checks the manifest's structure and that every listed shard is there with its recorded
    size; reading a shard checks its SHA-256, every field's dtype and shape and that ids are in
    range, so whatever a reader hands out is safe to index with.
    """

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.is_dir():
            hint = ""
            if partial_dir(self.path).exists():
                hint = f" ({partial_dir(self.path)} holds an unfinished run: re-run trace to resume it)"
            raise SpecPrefetchError(f"trace directory not found: {self.path}{hint}")
        mf = manifest_path(self.path)
        if mf.exists() and not mf.is_file():
            raise SpecPrefetchError(f"{mf}: not a file")
        try:
            m = read_json(mf, "trace manifest")
        except (ValueError, RecursionError) as e:  # past JSON's syntax: a 5000-digit number, deep nesting
            raise SpecPrefetchError(f"trace manifest {mf} is not valid JSON ({e})") from None
        check_manifest(m, mf)
        self.manifest = m
        self.model = m["model"]
        self.heldout_seqs = frozenset(m["split"]["heldout"])
        self.train_seqs = frozenset(m["split"]["train"])
        for s in m["shards"]:
            f = self.path / s["file"]
            if not f.is_file():
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

    def sequences(self, split: str) -> list[int]:
        """The sequence numbers of a split."""
        if split not in SPLITS:
            raise SpecPrefetchError(f"unknown split {split!r}; expected one of {SPLITS}")
        return list(self.manifest["split"][split])

    def model_dir(self) -> Path:
        """The model directory this trace was recorded from, as recorded (an absolute path).

        A trace made before paths were recorded resolved holds a relative path, which names a
        different directory from every other working directory: that is an error asking for --model,
        as is a recorded directory that is no longer there."""
        recorded = self.model.get("path")
        where = f"trace {self.path} (model config {self.model['config_hash']})"
        if not isinstance(recorded, str) or not recorded:
            raise SpecPrefetchError(f"{where} records no model directory; pass --model DIR")
        p = Path(recorded)
        if not p.is_absolute():
            raise SpecPrefetchError(f"{where} records its model as the relative path {recorded!r}, which "
                                    "depends on the directory it was traced from; pass --model DIR")
        if not p.is_dir():
            raise SpecPrefetchError(f"{where} was recorded from model {p}, which is no longer there; "
                                    "pass --model DIR (the same model)")
        return p

    def check_model(self, spec: ModelSpec, option: str = "--model") -> None:
        """Refuse a model other than the one this trace was recorded from (by config hash)."""
        want = self.model["config_hash"]
        if spec.config_hash != want:
            raise SpecPrefetchError(
                f"{option} {spec.path} has model config {spec.config_hash}, but trace {self.path} was "
                f"recorded from {self.model.get('path')} with config {want}: a trace fits only the model "
                "it was recorded from")

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
        except Exception as e:  # safetensors and numpy raise several types for a malformed file
            raise SpecPrefetchError(f"{f}: unreadable shard ({e})") from None
        self._check_shard(f, shard, arrays)
        return arrays

    def _check_shard(self, f: Path, shard: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        n = shard["tokens"]
        L = len(self.moe_layers)
        E = self.num_experts
        expect = {"token_id": (n,), "seq": (n,), "pos": (n,), "kind": (n,),
                  "expert_ids": (n, L, self.top_k), "expert_weights": (n, L, self.top_k)}
        if "router_probs" in arrays:
            expect["router_probs"] = (n, L, E)
        if "router_top_ids" in arrays or "router_top_probs" in arrays:
            m = arrays["router_top_ids"].shape[-1] if "router_top_ids" in arrays else -1
            expect["router_top_ids"] = expect["router_top_probs"] = (n, L, m)
        if "hidden" in arrays or "hidden_rows" in arrays:
            rows = len(arrays["hidden_rows"]) if "hidden_rows" in arrays else -1
            expect["hidden_rows"] = (rows,)
            expect["hidden"] = (rows, L, self.hidden_size)
        for k, shape in expect.items():
            if k not in arrays or tuple(arrays[k].shape) != shape:
                got = tuple(arrays[k].shape) if k in arrays else "missing"
                raise SpecPrefetchError(f"{f}: field {k} has shape {got}, expected {shape}")
        for k, a in arrays.items():
            want = FIELDS.get(k)
            ok = want is not None and (a.dtype == want or (k in ("expert_ids", "router_top_ids")
                                                             and a.dtype == np.int32))
            if not ok:
                raise SpecPrefetchError(f"{f}: field {k} has dtype {a.dtype}"
                                        + (f", expected {np.dtype(want)}" if want is not None else
                                           " (not a trace field)"))

        def in_range(k: str, lo: int, hi: int) -> None:
            a = arrays[k]
            if a.size and (int(a.min()) < lo or int(a.max()) >= hi):
                raise SpecPrefetchError(f"{f}: field {k} holds values outside [{lo}, {hi})")

        in_range("expert_ids", 0, E)
        in_range("kind", 0, 3)
        in_range("pos", 0, 2**31 - 1)
        if "router_top_ids" in arrays:
            in_range("router_top_ids", 0, E)
        if "hidden_rows" in arrays:
            in_range("hidden_rows", 0, n)
        seqs = self.heldout_seqs if shard["split"] == "heldout" else self.train_seqs
        if n and not np.isin(arrays["seq"], np.fromiter(seqs, np.int64, len(seqs))).all():
            raise SpecPrefetchError(f"{f}: field seq names sequences outside the manifest's "
                                    f"{shard['split']} split")

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
                if f not in a:
                    raise SpecPrefetchError(f"trace {self.path}: its shards hold no field {f!r}")
                parts[f].append(a[f])
        return {f: (np.concatenate(v) if v else np.zeros((0,), FIELDS[f])) for f, v in parts.items()}


def routing_sequences(reader: TraceReader, split: str, *, with_kind: bool = False, with_tokens: bool = False) -> list:
    """Each sequence's routed expert ids [positions, L, k] of a split, positions in order, sequences by
    id; with `with_kind`, (ids, kind [positions]) pairs; with `with_tokens` too, (ids, kind, token ids
    [positions]) triples."""
    extra = (("kind",) if with_kind or with_tokens else ()) + (("token_id",) if with_tokens else ())
    a = reader.load(split, ("seq", "pos", "expert_ids", *extra))
    if not len(a["seq"]):
        return []
    order = np.lexsort((a["pos"], a["seq"]))
    seq, ids = a["seq"][order], a["expert_ids"][order].astype(np.int64)
    cuts = np.flatnonzero(np.diff(seq)) + 1
    if not extra:
        return list(np.split(ids, cuts))
    return list(zip(np.split(ids, cuts), *(np.split(a[f][order], cuts) for f in extra)))


def trace_model_spec(reader: TraceReader, model: str | Path | None) -> ModelSpec:
    """The model a trace was made from (`model`, or the directory the trace records), with its
    path resolved; a model with another config hash than the trace's is an error.

    Every reader of a trace that needs the model (train, eval, simulate) goes through this."""
    spec = inspect_model_dir(model if model is not None else reader.model_dir())
    spec = dataclasses.replace(spec, path=spec.path.resolve())
    if model is None and spec.config_hash != reader.model["config_hash"]:
        raise SpecPrefetchError(
            f"trace {reader.path} was recorded from model {spec.path} with config "
            f"{reader.model['config_hash']}, but that directory now holds config {spec.config_hash} "
            "(the model changed since); pass --model DIR (the model the trace was recorded from)")
    reader.check_model(spec)
    return spec
