"""Routing batches from traces: what every predictor and the adapter trainer look at.

A `RoutingBatch` holds the tokens of one shard whose router inputs were stored, with their own,
previous and next tokens' routing (and, built with `ahead` > 1, the routing of the tokens after the
next, up to `ahead` tokens on), so a target "MoE layer i + h" that runs past the last layer becomes
"layer (i + h) mod L of the token (i + h) // L on" (the token-boundary horizons, and the next-visit
heads' horizons L, 2L, ...). `ShardStream` feeds
training with a bounded number of shards in memory at a time.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np
import torch

from toolkit.errors import SpecPrefetchError
from toolkit.traces.format import DECODE, TraceReader


def check_device(device: str, *, option: str = "--device", allow_auto: bool = False) -> str:
    """`device` if torch can use it here: cpu, cuda, cuda:N (and auto where allowed); else a
    one-line error naming the option."""
    import re

    kinds = "cpu, cuda, cuda:N" + (" or auto" if allow_auto else "")
    if device == "auto" and allow_auto:
        if not torch.cuda.is_available():
            raise SpecPrefetchError(f"{option} auto needs CUDA GPUs; none are visible (use {option} cpu)")
        return device
    m = re.fullmatch(r"cpu|cuda(?::(\d+))?", device)
    if not m:
        raise SpecPrefetchError(f"{option} {device!r}: expected {kinds}")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SpecPrefetchError(f"{option} {device}: CUDA is not available on this machine")
        if m.group(1) is not None and int(m.group(1)) >= torch.cuda.device_count():
            raise SpecPrefetchError(f"{option} {device}: this machine has {torch.cuda.device_count()} "
                                    "CUDA device(s), numbered from 0")
    return device


@dataclasses.dataclass
class RoutingBatch:
    hidden: torch.Tensor        # [B, L, H] router inputs of this token
    ids: torch.Tensor           # [B, L, k] this token's selected experts
    next_ids: torch.Tensor      # [B, L, k] next token's (valid where has_next)
    prev_ids: torch.Tensor      # [B, L, k] previous token's (valid where has_prev)
    has_next: torch.Tensor      # [B] bool
    has_prev: torch.Tensor      # [B] bool
    probs: torch.Tensor | None       # [B, L, E] this token's router distribution
    next_probs: torch.Tensor | None  # [B, L, E]
    seq: torch.Tensor           # [B]
    pos: torch.Tensor           # [B]
    kind: torch.Tensor          # [B]
    # built with ahead A > 1: the tokens 2..A on (later_ids[:, d - 2] is token d's, valid where has_later[:, d - 2])
    later_ids: torch.Tensor | None = None     # [B, A - 1, L, k]
    has_later: torch.Tensor | None = None     # [B, A - 1] bool
    later_probs: torch.Tensor | None = None   # [B, A - 1, L, E]

    @property
    def num_layers(self) -> int:
        return self.ids.shape[1]

    def __len__(self) -> int:
        return self.ids.shape[0]

    @property
    def device(self) -> torch.device:
        return self.ids.device

    def _later(self, d: int) -> int:
        """The index of token d on (d >= 2) in the later_* tensors; a batch built with fewer is an error."""
        have = 1 + (self.later_ids.shape[1] if self.later_ids is not None else 0)
        if d > have:
            raise ValueError(f"a target {d} tokens on: this batch was built with ahead={have}")
        return d - 2

    def target_ids(self, i: int, h: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Real ids of the step h MoE layers after layer i: ([B, k], valid [B]), on the batch's device."""
        d, j = divmod(i + h, self.num_layers)   # d tokens on, its MoE layer j
        if d == 0:
            return self.ids[:, j], torch.ones(len(self), dtype=torch.bool, device=self.ids.device)
        if d == 1:
            return self.next_ids[:, j], self.has_next
        n = self._later(d)
        return self.later_ids[:, n, j], self.has_later[:, n]

    def target_probs(self, i: int, h: int) -> torch.Tensor:
        d, j = divmod(i + h, self.num_layers)
        if d == 0:
            return self.probs[:, j]
        return self.next_probs[:, j] if d == 1 else self.later_probs[:, self._later(d), j]

    def select(self, mask: torch.Tensor) -> "RoutingBatch":
        mask = mask.to(self.ids.device)
        return RoutingBatch(**{f.name: (getattr(self, f.name)[mask] if getattr(self, f.name) is not None else None)
                               for f in dataclasses.fields(self)})

    def to(self, device: str | torch.device) -> "RoutingBatch":
        """Every tensor on `device` (the batch itself when it is there already)."""
        if self.ids.device == torch.device(device):
            return self
        return RoutingBatch(**{f.name: (getattr(self, f.name).to(device) if getattr(self, f.name) is not None
                                        else None) for f in dataclasses.fields(self)})


def _dense_probs(a: dict[str, np.ndarray], num_experts: int) -> np.ndarray | None:
    if "router_probs" in a:
        return a["router_probs"]
    if "router_top_ids" in a:
        out = np.zeros(a["router_top_ids"].shape[:2] + (num_experts,), np.float32)
        np.put_along_axis(out, a["router_top_ids"].astype(np.int64), a["router_top_probs"].astype(np.float32), -1)
        return out
    return None


def batch_from_shard(a: dict[str, np.ndarray], num_experts: int, *, decode_only: bool = False,
                     with_probs: bool = True, ahead: int = 1) -> RoutingBatch | None:
    """The shard's tokens whose router input was stored, with the routing of the tokens up to `ahead` on
    (the next's always; later ones for heads that predict them: PrefetchAdapter.tokens_ahead)."""
    rows = a.get("hidden_rows")
    if rows is None or len(rows) == 0:
        return None
    n = len(a["seq"])
    seq = a["seq"]

    def on(d: int) -> tuple[np.ndarray, np.ndarray]:  # the rows d tokens on, and whether they are of that sequence
        r = np.minimum(rows + d, n - 1)
        return r, (rows + d < n) & (seq[r] == seq[rows])

    nxt, has_next = on(1)
    prv = np.maximum(rows - 1, 0)
    has_prev = (rows >= 1) & (seq[prv] == seq[rows])
    probs = _dense_probs(a, num_experts) if with_probs else None
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x))  # noqa: E731
    later = [on(d) for d in range(2, ahead + 1)]
    if later:
        lr = np.stack([r for r, _ in later], 1)    # [B, ahead - 1]
        extra = {"later_ids": t(a["expert_ids"][lr].astype(np.int64)),
                 "has_later": t(np.stack([ok for _, ok in later], 1)),
                 "later_probs": t(probs[lr].astype(np.float32)) if probs is not None else None}
    else:
        extra = {}
    b = RoutingBatch(
        hidden=t(a["hidden"].astype(np.float32)),
        ids=t(a["expert_ids"][rows].astype(np.int64)),
        next_ids=t(a["expert_ids"][nxt].astype(np.int64)),
        prev_ids=t(a["expert_ids"][prv].astype(np.int64)),
        has_next=t(has_next), has_prev=t(has_prev),
        probs=t(probs[rows].astype(np.float32)) if probs is not None else None,
        next_probs=t(probs[nxt].astype(np.float32)) if probs is not None else None,
        seq=t(seq[rows].astype(np.int64)), pos=t(a["pos"][rows].astype(np.int64)),
        kind=t(a["kind"][rows].astype(np.int64)), **extra,
    )
    if decode_only:
        b = b.select(b.kind == DECODE)
    return b if len(b) else None


def iter_batches(reader: TraceReader, split: str, *, decode_only: bool = False,
                 with_probs: bool = True, ahead: int = 1) -> Iterator[RoutingBatch]:
    """One batch per shard, in trace order (evaluation)."""
    for a in reader.iter_shards(split):
        b = batch_from_shard(a, reader.num_experts, decode_only=decode_only, with_probs=with_probs, ahead=ahead)
        if b is not None:
            yield b


def validation_seqs(reader: TraceReader, share: float = 0.05) -> set[int]:
    """Train-split sequences set aside for early stopping (the held-out split stays untouched):
    the `share` of them (at least one) with the smallest hash, so the choice is stable."""
    train = reader.manifest["split"]["train"]
    if len(train) < 2:
        return set()
    ranked = sorted(train, key=lambda q: (q * 2654435761) % 2**32)
    return set(ranked[: max(1, int(len(train) * share))])


def in_set(seq: torch.Tensor, seqs: set[int]) -> torch.Tensor:
    return torch.tensor([int(q) in seqs for q in seq.tolist()], dtype=torch.bool, device=seq.device)


class ShardStream:
    """Endless shuffled mini-batches over a split, never holding more than `max_bytes` of shards.

    Shards are visited in a seeded random order; `buffer` shards at a time (as many as fit in
    `max_bytes`, at least one) are pooled and shuffled, so memory stays bounded however large the
    trace is. `peak_bytes` records the most ever held, for tests and logs.
    """

    def __init__(self, reader: TraceReader, split: str, *, batch_size: int, seed: int,
                 max_bytes: int = 512 * 2**20, keep: str = "train", ahead: int = 1):
        self.reader, self.split, self.batch_size, self.ahead = reader, split, batch_size, ahead
        self.rng = np.random.default_rng(seed)
        self.max_bytes, self.keep = max_bytes, keep
        self.shards = reader.shards(split)
        self.peak_bytes = 0
        self.epochs = 0
        self.val = validation_seqs(reader)

    def _load(self, shard) -> RoutingBatch | None:
        b = batch_from_shard(self.reader.read_shard(shard), self.reader.num_experts, ahead=self.ahead)
        if b is None:
            return None
        val = in_set(b.seq, self.val)
        return b.select(~val if self.keep == "train" else val)

    @staticmethod
    def nbytes(b: RoutingBatch) -> int:
        return sum(getattr(b, f.name).numel() * getattr(b, f.name).element_size()
                   for f in dataclasses.fields(b) if getattr(b, f.name) is not None)

    def __iter__(self) -> Iterator[RoutingBatch]:
        while True:
            order = self.rng.permutation(len(self.shards))
            i = 0
            rows = 0
            while i < len(order):
                pool: list[RoutingBatch] = []
                held = 0
                while i < len(order):
                    b = self._load(self.shards[order[i]])
                    i += 1
                    if b is None or len(b) == 0:
                        continue
                    pool.append(b)
                    held += self.nbytes(b)
                    if held >= self.max_bytes / 2:  # the concatenation below doubles it briefly
                        break
                if not pool:
                    continue
                rows += sum(len(p) for p in pool)
                merged = pool[0] if len(pool) == 1 else RoutingBatch(**{
                    f.name: (torch.cat([getattr(p, f.name) for p in pool])
                             if getattr(pool[0], f.name) is not None else None)
                    for f in dataclasses.fields(RoutingBatch)})
                self.peak_bytes = max(self.peak_bytes, held * (2 if len(pool) > 1 else 1))
                del pool
                perm = torch.from_numpy(self.rng.permutation(len(merged)))
                for s in range(0, len(merged) - self.batch_size + 1, self.batch_size):
                    yield merged.select(perm[s:s + self.batch_size])
                if len(merged) < self.batch_size:
                    yield merged
            if rows == 0:  # a whole pass found nothing: another would not either
                raise SpecPrefetchError(
                    f"trace {self.reader.path}: no {self.split} token outside the validation sequences has "
                    "its router input stored; trace more sequences, or with --decode-tokens > 0 or "
                    "--hidden-sample > 0")
            self.epochs += 1


def validation_batches(reader: TraceReader, max_rows: int = 50_000, ahead: int = 1,
                       max_bytes: int | None = None) -> list[RoutingBatch]:
    """The validation sequences of the train split: at most `max_rows` tokens, and past the first batch at most
    `max_bytes` (ShardStream.nbytes: the tokens' routing ahead, `ahead` tokens of it, counts)."""
    out, rows, held = [], 0, 0
    val = validation_seqs(reader)
    for a in reader.iter_shards("train"):
        b = batch_from_shard(a, reader.num_experts, ahead=ahead)
        if b is not None:
            b = b.select(in_set(b.seq, val))
            if len(b):
                if out and max_bytes is not None and held + ShardStream.nbytes(b) > max_bytes:
                    break
                out.append(b)
                rows += len(b)
                held += ShardStream.nbytes(b)
                if rows >= max_rows:
                    break
    return out
