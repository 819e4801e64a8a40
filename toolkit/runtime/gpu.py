"""The GPU tier: Specter's scenario on one GPU. Experts live in pinned host memory, a bounded pool of
fixed slots lives in GPU memory, and copies run on their own CUDA stream while the GPU computes.

The same ExpertPool, WindowScheduler, PrefetchPlanner, predictors and RunStats as the CPU runner
(toolkit/runtime/runner.py) decide what is copied when; only the IO backend differs:

    host tier     every expert blob of the expert store, read once into one pinned buffer
    GPU pool      `capacity` slots of one blob each, one allocation of exactly that size per pool
                  size (`slot_arena_bytes`); the decode graphs read it at a fixed address, so the
                  engine keeps the arenas of its last two pool sizes (`slot_arenas_held_bytes`)
    copy stream   host -> GPU copies in the scheduler's issue order (demand copies first in line);
                  a copy into a slot waits (an event) for the last kernel that read the slot
    compute       the model's own modules (transformers), dense weights resident on the GPU; each
                  MoE block's routed experts are replaced by `PooledExperts`, which asks the
                  scheduler for the layer's experts and computes them from the slots. A use of a
                  slot whose copy is still in flight makes the compute stream wait on the copy's
                  event (a stall, timed with CUDA events), never the host.

Output is the unmodified model's: the router is the model's own, and the experts are computed with
transformers' eager expert loop (the same ops, in ascending expert order) on the store's fp16 blobs.

Policies: any PREDICTOR+EVICTION of the CPU runner decodes one token per step (on-demand+lru is the
Mixtral-offloading-style baseline, oracle+belady the bound). `draft` is Specter's: an INT4 self-draft
(routed experts int4, resident on the GPU; router, attention and embeddings shared with the target)
proposes K tokens; the experts it routes to, counted per layer, are the prefetch set of the target's
verification pass, which checks all K in one batched pass (greedy speculative decoding); the draft's
compute is in every time figure and its memory in `draft_bytes`.

A run is phases over one explicit per-sequence state, `GpuSequence` (its tokens, KV caches, slot IO,
pool, scheduler, planner, recorded routing and counters): `prefill`, then `decode_one` per token, or
for the draft `prefill_draft` and `speculative_round`s, whose accept rule is draft.py's `greedy_accept`
(the one `speculative_generate` uses). transformers calls the pooled experts with the hidden states and
routing only, so each forward pass binds its sequence to them for the pass (`GpuEngine._forward`); the
static decoder is handed the sequence's expert function directly. `record` is the CPU runner's.

Where CUDA is absent the same code runs on the CPU (copies synchronous, events host clocks), which is
how CI checks the output.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from typing import TYPE_CHECKING, Any, Sequence

import torch

from toolkit.errors import SpecPrefetchError
from toolkit.jsonvalues import is_int
from toolkit.models.quant import group_quantize
from toolkit.predictors.draft import SpecStats, greedy_accept
from toolkit.runtime.expert_store import ExpertStore
from toolkit.runtime.cuda_driver import driver
from toolkit.runtime.gpu_kernels import dequant, int4_gemv
from toolkit.runtime.native_io import NativeCopyIO
from toolkit.runtime.native_sched import library as native_library, open_native_scheduler
from toolkit.runtime.planner import PrefetchPlanner, RoutingState
from toolkit.runtime.pool import ExpertPool, Key
from toolkit.runtime.policy import GPU_AUTO_BUDGET, HOSTS, LAUNCHES, PLAN_ROWS
from toolkit.runtime.profiles import check_budget_kib
from toolkit.runtime.runner import RunConfig, Runner, open_pool_and_scheduler
from toolkit.runtime.scheduler import WindowScheduler, resident_first
from toolkit.runtime.stats import DecodeAccount, RunStats

if TYPE_CHECKING:
    from adapters.reuse import ReuseTable

MiB = 2**20


# -- clocks and events: CUDA events on a GPU, host clocks on the CPU ------------------------------
class _HostEvent:
    def __init__(self):
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: "_HostEvent") -> float:
        return (other.t - self.t) * 1e3


class Device:
    """The device's streams and events (CUDA), or their host stand-ins (CPU)."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise SpecPrefetchError(f"--device {device}: CUDA is not available on this machine")
        # the CUDA device's index (cuda: the current one), so per-copy stream lookups need no device lookup
        self.index = (self.device.index if self.device.index is not None else torch.cuda.current_device()) \
            if self.cuda else None
        if self.cuda and self.device.index is not None and self.device.index >= torch.cuda.device_count():
            raise SpecPrefetchError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        # prefetches queue on one stream in the scheduler's order; demand copies go on their own
        # high-priority stream, so a miss never waits behind queued prefetches
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.demand_stream = torch.cuda.Stream(self.device, priority=-1) if self.cuda else None
        # a folding planner's rows (gpu_graph.DevicePlan): their own stream, high priority so they land before
        # the host plans, made here once (streams come from a small shared set: made per plan, one could be the
        # copy stream), their graphs captured on it (not on the segments' capture stream)
        self.rows_stream = torch.cuda.Stream(self.device, priority=-1) if self.cuda else None

    def event(self, stream=None):
        if not self.cuda:
            return _HostEvent()
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream or torch.cuda.current_stream(self.device))
        return e

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def scope(self):
        """This device as the current CUDA device (cuda:N): graph capture and replay, Triton launches
        and the default streams act on the current device. A no-op on the CPU."""
        return torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext()


def launch_fallback(dev: Device) -> str | None:
    """Why the GPU tier takes torch's calls on `dev` (the CUDA driver's do not load, or cannot be used there), or
    None: the driver's calls (`launch=driver`) are the default where they can be made, and on the CPU (none made)."""
    if not dev.cuda:
        return None
    try:
        with dev.scope():
            torch.cuda.current_stream(dev.device).synchronize()   # (torch's context for the device, made current)
            driver(dev.device)
    except SpecPrefetchError as e:
        return str(e)
    try:   # the copy IO under the driver's calls is the native library's (native_io.py)
        native_library()
    except SpecPrefetchError as e:
        return no_copy_io(e)
    return None


def no_copy_io(e: SpecPrefetchError) -> str:
    """launch_fallback's one line for a native library that cannot be built: the build's first line and, for a
    failed compile, the compiler's last."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    why = lines[0].removeprefix("host=native: ").rstrip(":") + (f": {lines[-1]}" if len(lines) > 1 else "")
    return f"launch=driver: the native copy IO cannot be built: {why}"


# -- the host tier and the GPU pool ----------------------------------------------------------------
class HostExperts:
    """Every expert blob of the store in one (pinned) host buffer, each checked against its CRC."""

    def __init__(self, store: ExpertStore, dev: Device, progress=None):
        self.store = store
        L, E, n = store.num_layers, store.num_experts, store.blob_size
        try:
            self.buf = torch.empty((L * E, n), dtype=torch.uint8, pin_memory=dev.cuda)
        except (RuntimeError, MemoryError) as e:
            raise SpecPrefetchError(f"{store.path}: cannot hold its {L * E * n / MiB:.0f} MiB of experts in pinned "
                                    f"host memory ({type(e).__name__}: {str(e).splitlines()[0]})") from None
        store._live()   # read through the store's own descriptor, never the path (which may now name another file)
        view = self.buf.numpy()
        for li in range(L):
            for e in range(E):
                ent = store.entry(li, e)
                row = memoryview(view[li * E + e])
                got = 0
                while got < n:   # preadv may return short
                    k = os.preadv(store.fd, [row[got:]], ent.offset + got)
                    if k <= 0:
                        raise SpecPrefetchError(f"{store.path}: expert ({li}, {e}) lies past the end of the file")
                    got += k
                store.check(li, e, row)
            if progress:
                progress(li + 1, L)
        self.E = E
        self.rows = list(self.buf)   # one view per blob, made once: indexing costs host time per copy

    def blob(self, key: Key) -> torch.Tensor:
        return self.rows[key[0] * self.E + key[1]]

    @property
    def nbytes(self) -> int:
        return self.buf.numel()


def alloc_slots(capacity: int, blob: int, dev: Device) -> torch.Tensor:
    try:   # zeroed: a graph's warm-up may read a slot nothing was copied into yet
        return torch.zeros((capacity, blob), dtype=torch.uint8, device=dev.device)
    except (RuntimeError, MemoryError) as e:   # torch.OutOfMemoryError is a RuntimeError
        raise SpecPrefetchError(f"--pool-mib: {capacity} slots of {blob / MiB:.2f} MiB do not fit "
                                f"in {dev.device}'s free memory ({str(e).splitlines()[0]})") from None


class CudaCopyIO:
    """The scheduler's IOBackend for the GPU through torch's calls (`launch=torch`; on the CPU, synchronous
    copies): `submit` copies a blob into a free slot on the copy stream; `wait` makes the compute stream wait
    for it (timed: that is the stall). Under the CUDA driver's calls (`launch=driver`, the default) the same
    operations are native_io.NativeCopyIO's, made by the native library."""

    orders_reuse = True   # a copy into a slot waits for the slot's old copy itself (release)
    drv = None            # (torch's calls: GraphRunner launches through torch too)

    def __init__(self, host: HostExperts, capacity: int, dev: Device, slots: torch.Tensor | None = None):
        """`slots`: the pool's allocation of exactly `capacity` slots to reuse (the graphs read it at a
        fixed address); none: one is allocated. The allocation is the budget."""
        self.host, self.dev = host, dev
        self.slots = slots if slots is not None else alloc_slots(capacity, host.store.blob_size, dev)
        if self.slots.shape[0] != capacity:
            raise SpecPrefetchError(f"internal: {self.slots.shape[0]} slots allocated for a pool of {capacity}")
        self.views = list(self.slots)   # one view per slot, made once (as HostExperts.rows)
        self.free = list(range(capacity - 1, -1, -1))
        self.where: dict[Key, int] = {}
        self.done: dict[Key, Any] = {}           # key -> the copy's completion event
        self.last_use: list[tuple] = [()] * capacity   # per slot: the events a copy into it waits for
        # set by gpu_graph.GraphRunner.decode from its host sync to the release: every kernel enqueued
        # before the sync has run, and none enqueued since reads a slot evicted meanwhile (the replay reads
        # this layer's experts, pinned until the release), so a copy into such a slot waits for no kernel
        self.fenced = False
        self.stalls: list[tuple[Any, Any]] = []  # (before, after) the compute stream's waits
        self.copies: list[tuple[Any, Any]] = []  # (start, end) of every copy
        self.copied_bytes = 0

    def mark(self) -> tuple[int, int]:
        """Where decode starts: the figures count copies and stalls from here."""
        return len(self.copies), len(self.stalls)

    def submit(self, key: Key, *, demand: bool) -> None:
        idx = self.free.pop()
        self.where[key] = idx
        src, dst = self.host.blob(key), self.views[idx]
        if self.dev.cuda:
            cs = self.dev.demand_stream if demand else self.dev.copy_stream
            for last in self.last_use[idx]:   # the kernels that read the slot's old expert (and its copy)
                if not last.query():
                    cs.wait_event(last)
            t0 = self.dev.event(cs)
            # the copy on `cs`, made current for it alone (not `with torch.cuda.stream(cs)`, whose context looks
            # the device up and checks it at every copy: host time on the pooled decode's path)
            prev = torch.cuda.current_stream(self.dev.index)
            torch.cuda.set_stream(cs)
            try:
                dst.copy_(src, non_blocking=True)
            finally:
                torch.cuda.set_stream(prev)
            t1 = self.dev.event(cs)
        else:
            t0 = self.dev.event()
            dst.copy_(src)
            t1 = self.dev.event()
        self.copies.append((t0, t1))
        self.done[key] = t1
        self.copied_bytes += src.numel()

    def landed(self, key: Key) -> bool:
        ev = self.done.get(key)
        return ev is None or ev.query()

    def wait(self, key: Key) -> None:
        ev = self.done.get(key)
        if ev is None or not self.dev.cuda:
            return
        before = self.dev.event()
        torch.cuda.current_stream(self.dev.device).wait_event(ev)
        self.stalls.append((before, self.dev.event()))

    def take(self, key: Key) -> torch.Tensor:
        ev = self.done.get(key)
        if ev is not None and self.dev.cuda:  # ordered after the copy, whether or not it was waited for
            torch.cuda.current_stream(self.dev.device).wait_event(ev)
        return self.views[self.where[key]]

    def release(self, key: Key) -> None:
        idx = self.where.pop(key)
        copied = self.done.pop(key, None)
        if self.dev.cuda:
            # a copy into the slot waits for the kernels that read its old expert (none while fenced) and
            # for the old expert's own copy, which may still be in flight on the other stream (a demand
            # copy where a prefetch was): this IO orders a slot's reuse itself (orders_reuse), so the
            # scheduler need not wait for that copy before the eviction
            self.last_use[idx] = (() if self.fenced else (self.dev.event(),)) + (() if copied is None else (copied,))
        self.free.append(idx)

    def slot_numbers(self, keys: Sequence[Key], out) -> None:
        """out[i] = the slot of keys[i] (each has one)."""
        out[:len(keys)] = [self.where[key] for key in keys]

    def close(self) -> None:
        pass

    def stall_ms(self, since: int = 0) -> float:
        return sum(a.elapsed_time(b) for a, b in self.stalls[since:])

    def copy_ms(self, since: int = 0) -> float:
        return sum(a.elapsed_time(b) for a, b in self.copies[since:])


# -- the experts: pooled (target) and int4 resident (draft) --------------------------------------
def _check_experts(experts: torch.nn.Module, where: str) -> None:
    for name in ("gate_up_proj", "down_proj", "act_fn"):
        if not hasattr(experts, name):
            raise SpecPrefetchError(f"--device cuda: {where} has no {name}: the GPU tier runs families whose "
                                    "experts are transformers' fused gate_up_proj / down_proj (qwen3_moe, mixtral, "
                                    "olmoe, deepseek)")
    if getattr(experts, "gate_up_proj_bias", None) is not None or getattr(experts, "has_bias", False):
        raise SpecPrefetchError(f"--device cuda: {where} has expert biases (gpt_oss): not supported on the GPU tier")


def _eager_combine(hidden: torch.Tensor, ids: list[list[int]], weights: torch.Tensor, contrib) -> torch.Tensor:
    """transformers' eager expert loop: per expert hit, in ascending order, its tokens' outputs
    weighted and index_add_-ed into zeros. `contrib(e, rows)` gives the expert's unweighted output."""
    out = torch.zeros_like(hidden)
    routes = _routes(ids)
    for e, (tok, kpos) in _index_tensors(routes, hidden.device).items():
        y = contrib(e, hidden[tok]) * weights[tok, kpos, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def _routes(ids: list[list[int]]) -> dict[int, tuple[list[int], list[int]]]:
    """expert -> (top-k positions, token rows) in torch.where order over the [k, T] mask, experts ascending."""
    pairs: dict[int, list[tuple[int, int]]] = {}
    for t, row in enumerate(ids):
        for kp, e in enumerate(row):
            pairs.setdefault(e, []).append((kp, t))
    return {e: ([kp for kp, _ in sorted(p)], [t for _, t in sorted(p)]) for e, p in sorted(pairs.items())}


_ARANGE: dict[str, torch.Tensor] = {}


def _arange(device) -> torch.Tensor:
    key = str(device)
    if key not in _ARANGE:
        _ARANGE[key] = torch.arange(256, device=device)
    return _ARANGE[key]


def _index_tensors(routes, device) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """expert -> (token rows, top-k positions) as device tensors, from one host -> device copy (or
    slices, for one token: no copy at all)."""
    flat: list[int] = []
    for kpos, rows in routes.values():
        flat += rows + kpos
    if all(len(r) == 1 and r[0] == 0 for _, r in routes.values()):  # one token: plain slices
        ar = _arange(device)
        return {e: (ar[0:1], ar[kp[0]:kp[0] + 1]) for e, (kp, _) in routes.items()}
    t = torch.tensor(flat, device=device)
    out, i = {}, 0
    for e, (_kpos, rows) in routes.items():
        n = len(rows)
        out[e] = (t[i:i + n], t[i + n:i + 2 * n])
        i += 2 * n
    return out


class ExpertMath:
    """One expert's FFN from a [2I, H] gate_up and a [H, I] down matrix, as transformers computes it."""

    def __init__(self, act_fn):
        self.act_fn = act_fn

    def __call__(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        gate, up = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)
        return torch.nn.functional.linear(self.act_fn(gate) * up, down)


class Int4Experts(torch.nn.Module):
    """The draft's routed experts: int4 (symmetric, one fp16 scale per 32 inputs), resident on the
    device (toolkit.models.quant's quantiser with fp16 scales, exactly the int4 store's values). Stored
    stacked per matrix, [E, rows, packed bytes] and [E, rows, groups], so the device path gathers the routed experts by
    index: `fused` computes them with the grouped int4 GEMV (Triton on CUDA) inside the draft's graph;
    `forward` is the eager loop (prefill, and the modules path)."""

    def __init__(self, experts: torch.nn.Module, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.act = ExpertMath(experts.act_fn)
        self.dtype = dtype
        gu = [self._pack(w) for w in experts.gate_up_proj.detach()]
        dn = [self._pack(w) for w in experts.down_proj.detach()]
        self.gu_q = torch.stack([q for q, _, _ in gu]).to(device)
        self.gu_s = torch.stack([s for _, s, _ in gu]).to(device)
        self.dn_q = torch.stack([q for q, _, _ in dn]).to(device)
        self.dn_s = torch.stack([s for _, s, _ in dn]).to(device)
        self.n_gu, self.n_dn = gu[0][2], dn[0][2]     # inputs of each matrix: H and I

    @staticmethod
    def _pack(w: torch.Tensor):
        """[O, n] -> codes + 8 packed two per byte (low nibble first) [O, groups * 16], fp16 scales
        [O, groups], n: the layout the fused kernel reads (toolkit/runtime/gpu_kernels.py)."""
        q, scale = group_quantize(w, 4)
        u = (q + 8).to(torch.uint8)
        return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous(), scale, w.shape[-1]

    def _unpack(self, packed) -> torch.Tensor:
        q, scale, n = packed
        return dequant(q, scale, n, torch.float16).to(self.dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gu_q, self.gu_s, self.dn_q, self.dn_s))

    def forward(self, hidden, top_k_index, top_k_weights):
        ids = top_k_index.tolist()
        return _eager_combine(hidden, ids, top_k_weights, lambda e, x: self.act(
            x, self._unpack((self.gu_q[e], self.gu_s[e], self.n_gu)),
            self._unpack((self.dn_q[e], self.dn_s[e], self.n_dn))))

    def fused(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """One token, on the device, no host sync: x [1, H] -> the weighted sum of its k experts [1, H]."""
        ids = top_k_index[0]
        gu = int4_gemv(self.gu_q, self.gu_s, ids, x, self.n_gu)            # [k, 2I] fp32
        gate, up = gu.to(self.dtype).chunk(2, dim=-1)
        h = self.act.act_fn(gate) * up                                      # [k, I]
        y = int4_gemv(self.dn_q, self.dn_s, ids, h, self.n_dn)             # [k, H] fp32
        return (y * top_k_weights[0, :, None].float()).sum(0, keepdim=True).to(x.dtype)


class PooledExperts(torch.nn.Module):
    """Stands where a MoE block's routed experts were (no weights). transformers' MoE block calls it with
    the hidden states and the router's choices only, so the sequence it computes for is bound to it for
    one forward pass (`GpuEngine._forward`): then the target's experts come from that sequence's pool
    through its scheduler, or, in a draft pass, from the int4 draft (its routing counted into the
    sequence's draft tally during a speculative round). Unbound, it refuses to run."""

    def __init__(self, li: int, engine: "GpuEngine", draft: Int4Experts | None):
        super().__init__()
        self.li, self.engine = li, engine
        self.draft = draft
        self.seq: GpuSequence | None = None   # bound for one forward pass
        self.drafting = False

    def forward(self, hidden, top_k_index, top_k_weights):
        s = self.seq
        if s is None:
            raise SpecPrefetchError("internal: the GPU tier's pooled experts ran outside one of its forward passes")
        if self.drafting:
            if s.draft_counts is not None:
                s.count_draft(self.li, top_k_index.tolist())
            return self.draft(hidden, top_k_index, top_k_weights)
        return self.engine.moe(s, self.li, hidden, top_k_index, top_k_weights)


# -- one sequence's state -------------------------------------------------------------------------
@dataclasses.dataclass
class GpuGeneration:
    tokens: list[int]
    routing: list[torch.Tensor]           # per position [L, k]
    stats: RunStats
    extra: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, **self.stats.to_json(), **self.extra}


@dataclasses.dataclass(eq=False)
class GpuSequence:
    """One sequence's decoding state, the one argument of the engine's phases (`prefill`,
    `prefill_draft`, `decode_one`, `speculative_round`): its tokens and positions, its KV caches, the
    IO, pool, scheduler and planner its experts stream through, the routing it recorded, its counters
    and clocks. `GpuEngine.sequence` makes one; nothing of it lives on the engine."""
    ids: list[int]                   # the prompt, then every committed token
    n_prompt: int
    max_new: int
    eos: frozenset[int]
    L: int                           # MoE layers (a step is pos * L + layer)
    io: CudaCopyIO | NativeCopyIO    # the slot arena and the copies into it
    pool: ExpertPool
    sched: WindowScheduler
    planner: PrefetchPlanner | None  # a host predictor's, one token per step; None: on-demand or the draft
    state: RoutingState              # the routing so far, as the predictors read it
    runner: Any                      # the static-cache decoder (gpu_graph.GraphRunner, its KV caches) or None
    cache: Any                       # the target's DynamicCache: the prefill's, and every pass's with `modules`
    account: DecodeAccount
    dcache: Any = None               # the draft's DynamicCache (`modules`; the static path's is the runner's)
    dlen: int = 0                    # positions of the draft's cache that hold committed tokens
    tokens: list[int] = dataclasses.field(default_factory=list)   # the new tokens committed
    times: list[Any] = dataclasses.field(default_factory=list)    # an event per committed token
    t0: Any = None                   # the event just before the prefill
    marks: tuple[int, int] = (0, 0)  # (copies, stalls) at the first token: decode figures count from there
    pos: int = 0                     # the first position of the pass running now (its routing is recorded there)
    routing: dict[int, list[list[int]]] = dataclasses.field(default_factory=dict)   # position -> per-layer top-k
    resident: bool = False           # every expert preloaded: decode on the device alone (decode_resident)
    device_plan: Any = None          # the planner's rows computed on the device (gpu_graph.DevicePlan) or None
    draft_counts: list[list[float]] | None = None   # during a speculative round: the draft's routing [L][E]
    draft_dirty: set[int] = dataclasses.field(default_factory=set)   # layers counted since the last plan
    spec: SpecStats = dataclasses.field(default_factory=SpecStats)  # speculative rounds, proposed, accepted
    phases: dict[str, list[Any]] = dataclasses.field(default_factory=lambda: {"draft": [], "verify": []})

    @property
    def end(self) -> int:
        """The first step the run never reaches."""
        return (self.n_prompt + self.max_new - 1) * self.L

    @property
    def done(self) -> bool:
        """The last token asked for, or EOS, is committed."""
        return bool(self.tokens) and (len(self.tokens) >= self.max_new or self.tokens[-1] in self.eos)

    def commit(self, new: Sequence[int], now) -> None:
        """Append `new` (one event, `now`, for all of them), stopping after EOS or the last token asked for."""
        for t in new:
            self.tokens.append(t)
            self.ids.append(t)
            self.times.append(now)
            if t in self.eos or len(self.tokens) >= self.max_new:
                break

    def record_routing(self, li: int, ids: list[list[int]]) -> None:
        """MoE layer li's top-k for the rows of the pass running now (positions pos, pos + 1, ...)."""
        for t, row in enumerate(ids):
            self.routing.setdefault(self.pos + t, [None] * self.L)[li] = row

    def count_draft(self, li: int, rows: list[list[int]]) -> None:
        """The draft routed these rows of MoE layer li: counted for the verification pass's prefetches."""
        for row in rows:
            for e in row:
                self.draft_counts[li][e] += 1.0
        self.draft_dirty.add(li)

    def plan_draft(self, verify_pos: int) -> None:
        """The draft's routing so far becomes the verification pass's prefetch window: per MoE layer,
        expert counts over the draft's tokens, deadline the layer's step in the verification pass."""
        if not self.draft_dirty:
            return
        now = self.sched.step
        window = []
        for li in sorted(self.draft_dirty):
            target = verify_pos * self.L + li
            if target > now:
                window.append((target, torch.tensor(self.draft_counts[li])))
        self.draft_dirty = set()
        self.sched.plan(now, window)


# -- the engine ------------------------------------------------------------------------------------
class GpuEngine:
    """The model on one device with its routed experts streamed from host memory through the pool."""

    def __init__(self, lm, store: ExpertStore, cfg: RunConfig, *, device: str = "cuda",
                 predictors: dict[str, Any] | None = None, reuse: ReuseTable | None = None,
                 with_draft: bool = False, progress=None, decode: str | None = None,
                 experts: str | None = None, verify: str = "exact", compile: str | None = None,
                 attention: str | None = None, router: str | None = None):
        """
        Args:
            lm: a LoadedModel on the CPU (toolkit.models.loader.load_model); its routed experts are
                dropped and everything else moves to `device`.
            store: the model's fp16 expert store (the host tier is read from it).
            cfg: policy and pool budget (the CPU runner's RunConfig).
            predictors: name -> predictor (registry) for the policy's predictor.
            reuse: the adapter's reuse table (adapters/reuse.py), for the `reuse` eviction.
            with_draft: build the int4 draft even if cfg's policy is not the draft (to switch to it later).
            decode: how decode steps run after the prefill: "graph" (the static-cache decoder replayed as
                CUDA graphs, toolkit/runtime/gpu_graph.py; the default on CUDA), "static" (the same
                functions run eagerly; the default on the CPU) or "modules" (transformers' own modules
                and DynamicCache every step). Families the static decoder does not cover use "modules".
            experts: how the static decoder computes the routed experts from the slots: "fused" (a
                grouped fp16 GEMV reading each expert where it lies, gpu_kernels.slot_gemv: Triton on
                CUDA; the default with `graph` on an fp16 model) or "eager" (the slots gathered, then
                transformers' eager expert loop: bitwise transformers' expert arithmetic; the default
                otherwise).
            attention: how the static decoder's one-position steps compute attention: "fused" (the q/k
                norms, rotary embedding, cache write and attention over the cache in one kernel per
                layer, two over a cache of more than 512 positions, gpu_attention.decode_attention; the
                q/k/v GEMV with the input norm and the expert combine before it, gpu_kernels.norm_gemv:
                Triton on CUDA; fp16 models whose geometry the kernels cover) or "sdpa" (the model's
                norms and rotary embedding, then torch's scaled_dot_product_attention over the static
                cache). Default: "fused" with `graph` where the kernels cover the model (an fp16 model, Triton
                present), else "sdpa". A pass over more than one position (a
                batched verification) takes "sdpa" either way; the prefill is transformers' modules.
            router: how the static decoder's one-position steps route a MoE layer: "fused" (the residual
                add, post-attention norm, router GEMV, softmax, top-k and its normalisation in one kernel,
                written into the runner's buffers, the all-resident token's slot selection too:
                gpu_router.route, Triton on CUDA; fp16 models) or
                "model" (the model's norm and router module). Default: as for `attention`. A
                router over 128 KiB (Qwen3-30B's) is two kernels; over 1,024 experts "model" (asked for, "fused" is
                refused). Rows
                of more than one position take "model" either way.
            verify: how the draft policy's target checks a round's proposals: "exact" (every row
                through the target's own one-token decode step: with the static decoder its segments
                layer-major over the rows, GraphRunner.verify_rows, each MoE layer's experts acquired
                once for all rows; with the modules one step per position up to the first
                disagreement. Every committed token is computed as every other policy computes it,
                so the draft never changes the output) or "batched" (one pass over all k + 1 rows,
                Specter's: less target compute, but a k + 1-row GEMM rounds differently from a
                one-row GEMV, so a near-tie between the two best tokens can resolve the other way:
                tokens equal the model's only up to that).
            compile: the static decoder's pieces (each segment, the all-resident token, the draft's
                step) each whole through torch.compile with this backend ("inductor": fused Triton
                kernels on a GPU, the routers' top-k and one-row GEMV decomposed; "aot_eager": the same
                tracing without code generation, for tests), captured in the graphs as before; None:
                eager. Fused kernels round like transformers' only up to reduction order: tokens are
                checked as always (docs/gpu-tier.md).
        """
        if store.dtype != "fp16":
            raise SpecPrefetchError(f"{store.path}: the GPU tier computes from fp16 experts; this store is "
                                    f"{store.dtype} (build one with `specprefetch store MODEL --dtype fp16`)")
        self.dev = Device(device)
        spec = lm.spec
        g = spec.geometry
        self.spec, self.tokenizer = spec, lm.tokenizer
        self.L, self.k, self.E = len(g.moe_layers), g.routing.top_k, g.routing.num_experts
        if (store.num_layers, store.num_experts) != (self.L, self.E):
            raise SpecPrefetchError(f"{store.path}: {store.num_layers} x {store.num_experts} experts, the model "
                                    f"has {self.L} x {self.E}")
        roles = [s.role for s in store.sections]
        secs = {s.role: s for s in store.sections}
        if roles != ["gate", "up", "down"]:
            raise SpecPrefetchError(f"{store.path}: expert sections {roles}; the GPU tier needs gate, up, down")
        self.gate_up_span = (secs["gate"].offset // 2, (secs["gate"].nbytes + secs["up"].nbytes) // 2,
                             (secs["gate"].shape[0] * 2, secs["gate"].shape[1]))
        self.contiguous = secs["gate"].offset + secs["gate"].nbytes == secs["up"].offset
        self.up_span = (secs["up"].offset // 2, secs["up"].nbytes // 2, secs["up"].shape)
        self.gate_span = (secs["gate"].offset // 2, secs["gate"].nbytes // 2, secs["gate"].shape)
        self.down_span = (secs["down"].offset // 2, secs["down"].nbytes // 2, secs["down"].shape)
        self.store = store
        self.model = lm.model.eval()
        self.dtype = next(self.model.parameters()).dtype
        self.math = None
        self.drafts: list[Int4Experts | None] = []
        self.pooled: list[PooledExperts] = []        # transformers calls these inside each MoE block
        wants_draft = with_draft or cfg.policy.predictor == "draft"
        for li, layer in enumerate(g.moe_layers):
            block = spec.family.moe_block(self.model, layer)
            _check_experts(block.experts, f"{spec.path} layer {layer}")
            self.math = self.math or ExpertMath(block.experts.act_fn)
            d = Int4Experts(block.experts, self.dev.device, self.dtype) if wants_draft else None
            self.drafts.append(d)
            self.pooled.append(PooledExperts(li, self, d))
            block.experts = self.pooled[-1]              # the routed experts leave the model here
        self.model.to(self.dev.device)
        self.host = HostExperts(store, self.dev, progress)
        self.predictors = dict(predictors or {})
        self.reuse = reuse
        self.cfg = cfg
        # prefetch copies issued per layer step at most (the scheduler's queue depth here: a prefetch counts
        # until the next step); None: the pool's free slots (capacity - k, so a layer's demand copies always
        # find a slot); `configure(copy_depth=N)`
        self.copy_depth: int | None = None
        self.host_sched = "python"   # whose scheduler and pool decide (configure(host=...))
        self.plan_rows = "device"    # where a folding planner's rows are computed (configure(plan=...))
        # whose calls launch the per-layer work on CUDA (configure(launch=...)): the driver's where it loads (else
        # torch's, named in every run's figures: `launch`)
        self.launch_fallback = launch_fallback(self.dev)   # (why torch's calls, where they are)
        self.launch = "torch" if self.launch_fallback else "driver"
        from toolkit.runtime import gpu_graph

        if decode not in (None, "graph", "static", "modules"):
            raise SpecPrefetchError(f"decode {decode!r}: expected graph, static or modules")
        why = gpu_graph.supported(spec)
        if decode in ("graph", "static") and why is not None:
            raise SpecPrefetchError(f"--decode {decode}: {why}")
        if decode == "graph" and not self.dev.cuda:
            raise SpecPrefetchError("--decode graph: CUDA graphs need a CUDA device")
        self.decode = decode or ("modules" if why is not None else "graph" if self.dev.cuda else "static")
        if experts not in (None, "eager", "fused"):
            raise SpecPrefetchError(f"experts {experts!r}: expected eager or fused")
        if experts is not None and self.decode == "modules":
            raise SpecPrefetchError(f"--experts {experts}: only the static decoder (--decode graph or static) "
                                    "computes experts from the slots")
        if experts == "fused" and self.dtype not in (torch.float16, torch.float32):
            raise SpecPrefetchError(f"--experts fused: reads the fp16 store's weights as they are, which a "
                                    f"{str(self.dtype).removeprefix('torch.')} model does not compute with "
                                    "(use --experts eager)")
        self.experts = experts or ("fused" if self.decode == "graph" and self.dtype == torch.float16 else "eager")
        self.attention, self.router = self._fused_choices(attention, router)
        if verify not in ("exact", "batched"):
            raise SpecPrefetchError(f"verify {verify!r}: expected exact or batched")
        self.verify = verify
        if compile not in (None, "inductor", "aot_eager"):
            raise SpecPrefetchError(f"compile {compile!r}: expected inductor or aot_eager")
        if compile is not None and self.decode == "modules":
            raise SpecPrefetchError("--compile: compiles the static decoder's step (--decode graph or static)")
        self.compile = compile
        self._runners: dict[int, Any] = {}   # pool capacity -> GraphRunner (its own slot arena)
        self.configure()

    def _kernel_choice(self, option: str, value: str | None, other: str, why) -> str:
        """`--attention` / `--router`: "fused" or `other`; unset, "fused" with `graph` where the kernels cover
        the model, else `other` (on the CPU, `static`, the kernels' torch references would only be slower); an
        explicit "fused" refused in one line where they do not (`why()` says why); "modules" (transformers'
        own) under the modules path, where there is no choice."""
        if value not in (None, "fused", other):
            raise SpecPrefetchError(f"{option} {value!r}: expected fused or {other}")
        if self.decode == "modules":
            if value is not None:
                raise SpecPrefetchError(f"--{option} {value}: only the static decoder (--decode graph or static) "
                                        f"has a choice of {option}")
            return "modules"
        if value is None:   # (measured: docs/benchmarks.md section 32)
            return "fused" if self.decode == "graph" and why() is None else other
        if value == other:
            return other
        reason = why()
        if reason is not None:
            raise SpecPrefetchError(f"--{option} fused: {reason} (use --{option} {other})")
        return "fused"

    def _fused_choices(self, attention: str | None, router: str | None) -> tuple[str, str]:
        from toolkit.runtime.gpu_attention import attention_usable
        from toolkit.runtime.gpu_kernels import triton
        from toolkit.runtime.gpu_router import router_usable

        g = self.spec.geometry   # (the modules read only where the static decoder runs: families it covers)
        # on CUDA the kernels are Triton's (elsewhere their torch references run, as CI checks them)
        no_triton = "Triton is not installed" if self.dev.cuda and triton is None else None
        a = self._kernel_choice("attention", attention, "sdpa", lambda: no_triton or attention_usable(
            [layer.self_attn for layer in self.model.model.layers], self.dtype,
            [layer.input_layernorm for layer in self.model.model.layers]))
        r = self._kernel_choice("router", router, "model", lambda: no_triton or router_usable(
            [self.model.model.layers[i].post_attention_layernorm for i in g.moe_layers],
            [self.spec.family.moe_block(self.model, i).gate for i in g.moe_layers], self.dtype))
        return a, r

    # -- configuration ---------------------------------------------------------------------
    def configure(self, *, copy_depth: int | None | str = "keep", host: str = "keep", plan: str = "keep",
                  launch: str = "keep", **changes) -> None:
        """The next sequences' RunConfig with `changes`; `copy_depth`: the scheduler's queue depth here,
        prefetch copies issued per layer step at most (a prefetch counts until the next step; None: the
        pool's free slots, capacity - k, also the cap of any larger value; "keep": unchanged); `host`: whose
        scheduler and pool decide, "python" (toolkit/runtime/scheduler.py) or "native" (the native runner's,
        toolkit/runtime/native_sched.py: the same decisions off Python; "keep": unchanged); `plan`: where the
        static decoder computes a folding planner's rows, "device" (gpu_graph.DevicePlan, on a stream of its
        own beside the next segment), "inline" (the same on the compute stream, waited for by the layer's sync)
        or "host" (the router's input read back, PrefetchPlanner.plan folds it: the same decisions on the CPU,
        on a GPU up to rounding at near-ties; "keep": unchanged); `launch`: on CUDA, whose calls launch the
        pooled decode's graphs, copies and events, "driver" (the CUDA driver's, through ctypes:
        toolkit/runtime/cuda_driver.py) or "torch" (torch's API: the same work, more host time; "keep":
        unchanged)."""
        cfg = dataclasses.replace(self.cfg, **changes)
        if copy_depth != "keep" and copy_depth is not None and (not is_int(copy_depth) or copy_depth < 1):
            raise SpecPrefetchError(f"--queue-depth {copy_depth!r}: prefetch copies a step, an integer >= 1")
        if host not in ("keep", *HOSTS):
            raise SpecPrefetchError(f"host {host!r}: choose from {', '.join(HOSTS)}")
        if plan not in ("keep", *PLAN_ROWS):
            raise SpecPrefetchError(f"plan {plan!r}: choose from {', '.join(PLAN_ROWS)}")
        if launch not in ("keep", *LAUNCHES):
            raise SpecPrefetchError(f"launch {launch!r}: choose from {', '.join(LAUNCHES)}")
        if host == "native":
            native_library()   # built (or its build refused) now, not inside a sequence
        if launch == "driver" and self.launch_fallback:   # (probed once, when the engine was made)
            raise SpecPrefetchError(f"{self.launch_fallback} (launch=torch takes torch's calls)")
        if cfg.read_budget_kib == "auto":
            raise SpecPrefetchError(GPU_AUTO_BUDGET)
        check_budget_kib(cfg.read_budget_kib, self.store.blob_size, "--read-budget-kib")
        p = cfg.policy.predictor
        if p not in ("on-demand", "draft") and p not in self.predictors:
            raise SpecPrefetchError(f"--policy {cfg.policy.name}: predictor {p!r} is not available on the GPU tier "
                                    f"(available: on-demand, draft, {', '.join(self.predictors) or '-'})")
        if cfg.policy.eviction == "reuse" and self.reuse is None:
            raise SpecPrefetchError(f"--policy {cfg.policy.name}: the reuse eviction needs the adapter's reuse "
                                    "table (the engine was built without one: pass --adapter)")
        if not 1 <= cfg.window <= self.L:  # as the CPU runner: the planner reads one token ahead at most
            raise SpecPrefetchError(f"--window {cfg.window}: must be 1..{self.L} (the MoE layers of one token)")
        cap = cfg.budget_bytes // self.store.blob_size
        if cap < self.k:
            raise SpecPrefetchError(f"--pool-mib {cfg.pool_mib:g}: holds {cap} expert slots of "
                                    f"{self.store.blob_size / MiB:.2f} MiB; one layer needs {self.k}")
        if p == "draft" and self.drafts[0] is None:
            raise SpecPrefetchError("--policy draft: the engine was built without the int4 draft")
        self.cfg = cfg
        if copy_depth != "keep":
            self.copy_depth = copy_depth
        if host != "keep":
            self.host_sched = host
        if plan != "keep":
            self.plan_rows = plan
        if launch != "keep":
            self.launch = launch

    def _driver(self):
        """The CUDA driver's calls for a run (launch=driver on CUDA), or None: torch's calls (or the CPU's)."""
        return driver(self.dev.device) if self.dev.cuda and self.launch == "driver" else None

    @property
    def capacity(self) -> int:
        return min(self.cfg.budget_bytes // self.store.blob_size, self.L * self.E)

    @property
    def draft_bytes(self) -> int:
        return sum(d.nbytes() for d in self.drafts if d is not None)

    @property
    def dense_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    # -- the pooled MoE layer ------------------------------------------------------------------
    def _weights(self, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = slot.view(torch.float16)
        if self.contiguous:
            off, n, shape = self.gate_up_span
            gate_up = w[off:off + n].view(shape)
        else:
            g0, gn, gs = self.gate_span
            u0, un, us = self.up_span
            gate_up = torch.cat([w[g0:g0 + gn].view(gs), w[u0:u0 + un].view(us)])
        d0, dn, ds = self.down_span
        down = w[d0:d0 + dn].view(ds)
        if self.dtype != torch.float16:
            gate_up, down = gate_up.to(self.dtype), down.to(self.dtype)
        return gate_up, down

    def moe(self, s: GpuSequence, li: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor):
        """MoE layer li's routed output for `hidden` [T, H] in sequence `s`: experts acquired in chunks
        that fit the pool, resident ones first, computed with transformers' eager loop (ascending expert
        order)."""
        T = top_k_index.shape[0]
        plans = T == 1 and s.planner is not None
        # the host needs the routing (and a planner the layer's input): one sync per MoE layer
        idx_h, x_h = self._to_host(top_k_index, hidden.detach() if plans else None)
        ids = idx_h.tolist()
        step = s.pos * self.L + li
        s.record_routing(li, ids)
        if plans:
            s.state.record(li, x_h, ids[0])
        sched = s.sched
        routes = _routes(ids)
        keys = [(li, e) for e in routes]
        # resident experts first, then the misses (Specter's verification order); chunks that fit
        order = resident_first(keys, sched.pool.slots)
        index = _index_tensors(routes, hidden.device)
        contrib: dict[int, torch.Tensor] = {}
        first = True
        while order:
            # what fits: slots neither pinned nor holding a copy issued this very step
            n = max(1, self.capacity - sched.in_flight())
            part, order = order[:n], order[n:]
            sched.acquire(step, part)
            if first and T == 1 and s.planner is not None:
                s.planner.plan(sched, li, step, s.state, None, s.end)
            first = False
            for key in part:
                tok, kpos = index[key[1]]
                gate_up, down = self._weights(sched.data(key))
                contrib[key[1]] = self.math(hidden[tok], gate_up, down) * top_k_weights[tok, kpos, None]
            sched.release(step, part)
        out = torch.zeros_like(hidden)
        for e in sorted(contrib):   # transformers' order: ascending expert index
            out.index_add_(0, index[e][0], contrib[e].to(out.dtype))
        return out

    def _to_host(self, *tensors):
        """The tensors (None passes through) on the host: non-blocking copies into pinned memory and one
        wait for them on a GPU, so reading several costs one sync."""
        if not self.dev.cuda:
            return tensors
        out = []
        for t in tensors:
            if t is not None:
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                t = h
            out.append(t)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.dev.device))
        ev.synchronize()
        return out

    # -- decoding: a sequence through its phases -------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *, recorded: GpuGeneration | None = None,
                 k: int = 8, preload: bool = False, resident_graph: bool = False, images=None) -> GpuGeneration:
        """Greedy decoding of up to `max_new_tokens` tokens (stopping after EOS), with the engine's
        device as the current CUDA device throughout (cuda:N): `prefill`, then `decode_one` per token,
        or, for the draft policy, the draft's own prefill and `speculative_round`s.

        Args:
            recorded: an earlier run of this prompt: the oracle's and Belady's future.
            k: draft tokens per round (the draft policy).
            preload: copy every expert into the pool before decoding (needs a pool of all experts):
                the all-resident upper bound, decoded as every policy decodes (one host sync per MoE layer).
            resident_graph: with `preload`, decode on the device alone (one graph per token, no host
                sync per layer): the model's own device-bound cost, the bound of the sync-per-layer design.
        """
        if images is not None:  # the CPU runner's `record` passes its images argument through
            raise SpecPrefetchError("the GPU tier runs text prompts (images: the CPU engines)")
        with self.dev.scope():
            s = self.sequence(prompt_ids, max_new_tokens, recorded=recorded, k=k, preload=preload,
                              resident_graph=resident_graph)
            self.prefill(s)
            speculative = self.cfg.policy.predictor == "draft"
            if speculative and not s.done:
                self.prefill_draft(s)
            while not s.done:
                if speculative:
                    self.speculative_round(s, k)
                else:
                    self.decode_one(s)
            return self._finish(s, k)

    def sequence(self, prompt_ids: Sequence[int], max_new_tokens: int, *, recorded: GpuGeneration | None = None,
                 k: int = 8, preload: bool = False, resident_graph: bool = False) -> GpuSequence:
        """A new sequence of this prompt under the engine's configuration: its caches (the static
        decoder's sized for rounds of `k` draft tokens), slot IO, pool, scheduler and planner; with
        `preload`, every expert copied into the pool first, and with `resident_graph` too, decode
        without the host in the loop (GraphRunner.decode_resident: one graph per token, the slots
        looked up on the device; the static decoder and the on-demand policy only). The phases below
        run it, inside `generate` (its device scope, no autograd)."""
        from transformers import DynamicCache

        cfg = self.cfg
        if not prompt_ids:
            raise SpecPrefetchError("the prompt is empty")
        if max_new_tokens < 1:
            raise SpecPrefetchError(f"--max-new-tokens {max_new_tokens}: must be >= 1")
        if cfg.policy.needs_future and recorded is None:
            raise SpecPrefetchError(f"--policy {cfg.policy.name}: needs a recorded first pass (run() does it)")
        if resident_graph and (not preload or self.decode == "modules" or cfg.policy.predictor != "on-demand"):
            raise SpecPrefetchError("resident_graph: needs preload, the static decoder and the on-demand policy")
        L = self.L
        runner = self._graph_runner(len(prompt_ids) + max_new_tokens + k + 1) if self.decode != "modules" else None
        slots = runner.slots if runner is not None else alloc_slots(self.capacity, self.store.blob_size, self.dev)
        drv = self._driver()   # under the driver's calls the copies, waits and events are the native library's
        io = (NativeCopyIO(self.host, self.capacity, self.dev, slots, drv) if drv is not None
              else CudaCopyIO(self.host, self.capacity, self.dev, slots=slots))
        source = self.predictors.get(cfg.policy.predictor)
        future = recorded.routing if recorded is not None else None
        planner = None
        if source is not None and cfg.policy.predictor != "draft":
            # the reuse eviction reads the adapter's next-visit heads where it has them (--no-next-visit: not)
            planner = PrefetchPlanner(source, num_layers=L, window=cfg.window, routing=self.spec.geometry.routing,
                                      score_bias=None, next_visits=cfg.visits_read(getattr(source, "next_visits", 0)))
        state = RoutingState(L, self.spec.geometry.hidden_size, self.k)
        state.future = future
        prefetch = planner is not None or cfg.policy.predictor == "draft"
        # copies queue on a stream: the queue depth is the pool, not a flash queue (at most capacity - k
        # issued a step, so a layer's demand copies always find a slot; fewer with `copy_depth`). The pool's
        # capacity is its budget's (budget // blob bytes, as on the CPU); the arena has min(that, L * E)
        # slots (`capacity`): a pool holds one slot per expert at most, so it never needs a slot the
        # arena lacks
        depth = max(1, self.capacity - self.k)
        gcfg = dataclasses.replace(cfg, queue_depth=depth if self.copy_depth is None else min(depth, self.copy_depth))
        if self.host_sched == "native":
            pool, sched = open_native_scheduler(gcfg, slot_bytes=self.store.blob_size, num_layers=L,
                                                num_experts=self.E, top_k=self.k, io=io, future=future,
                                                prefetch=prefetch, reuse=self.reuse)
        else:
            pool, sched = open_pool_and_scheduler(gcfg, slot_bytes=self.store.blob_size, num_layers=L, top_k=self.k,
                                                  io=io, future=future, prefetch=prefetch, reuse=self.reuse)
        if preload:
            if self.capacity < self.L * self.E:
                raise SpecPrefetchError("preload: the pool must hold every expert")
            for li in range(self.L):
                for e in range(self.E):
                    pool.preload((li, e))
                    io.submit((li, e), demand=True)
            self.dev.sync()
            if resident_graph:   # the slot table, and its graph captured before the prefill (untimed)
                runner.load_slot_map(io.where)
                runner.ensure_resident()
        # plain DynamicCaches keep every position: a config-built one keeps only the last window - 1 on
        # sliding-window layers, which the static cache cannot be loaded from and `crop` cannot roll back
        # (the model's mask applies the window either way)
        return GpuSequence(ids=list(prompt_ids), n_prompt=len(prompt_ids), max_new=max_new_tokens,
                           eos=frozenset(self._eos()), L=L, io=io, pool=pool, sched=sched, planner=planner,
                           state=state, runner=runner, cache=DynamicCache(), account=DecodeAccount(),
                           resident=resident_graph,
                           device_plan=(runner.device_plan(planner, inline=self.plan_rows == "inline")
                                        if runner is not None and self.plan_rows != "host" else None))

    def prefill(self, s: GpuSequence) -> None:
        """The prompt in one pass through transformers' modules (its experts in chunks that fit the
        pool) into the target's cache, copied into the static decoder's; commits the first token.
        The decode figures count from here."""
        dev = self.dev
        n = s.n_prompt
        if s.runner is not None:
            s.runner.check_open()    # before any copy into an arena another runner may hold now
        s.t0 = dev.event()
        s.pos = 0
        logits = self._forward(s, s.cache, s.ids[:n], 0)
        if s.runner is not None:
            s.runner.kv.load(s.cache, n)
        s.commit([int(logits[-1].argmax())], dev.event())
        s.account.start(s.sched, s.pool)
        s.marks = s.io.mark()       # decode figures only, as the scheduler's counts
        s.state.ids[0] = torch.tensor(s.routing[n - 1])   # the last prompt position's choices
        s.state.next_position()

    def prefill_draft(self, s: GpuSequence) -> None:
        """The draft's own prefill of the prompt into its KV cache (int4 experts, resident: nothing is
        copied, nothing counted)."""
        from transformers import DynamicCache

        if s.runner is not None:
            s.runner.check_open()
        dcache = DynamicCache()
        self._forward(s, dcache, s.ids[:s.n_prompt], 0, draft=True)
        s.dlen = s.n_prompt
        if s.runner is not None:
            s.runner.draft.kv.load(dcache, s.dlen)
        else:
            s.dcache = dcache

    def decode_one(self, s: GpuSequence) -> None:
        """One target token at the next position: the static decoder (one host sync per MoE layer on the compute
        stream and one for the token; a DevicePlan's rows waited for apart) or transformers' modules over the
        DynamicCache."""
        s.commit([self._step(s, s.ids[-1], len(s.ids) - 1)], self.dev.event())

    def _step(self, s: GpuSequence, token: int, pos: int) -> int:
        """The target's greedy token after `token` at `pos` (its K, V written there): the one-token
        decode step every policy's tokens come from."""
        s.pos = pos
        host_state = s.planner is not None and s.device_plan is None   # (a folding planner's rows: the device's)
        if host_state:
            s.state.pos = pos
        if s.resident:
            nxt = s.runner.decode_resident(s, token, pos)
        elif s.runner is not None:
            nxt = s.runner.decode(s, token, pos)
        else:
            nxt = int(self._forward(s, s.cache, [token], pos)[-1].argmax())
        if host_state:
            s.state.next_position()
        return nxt

    def speculative_round(self, s: GpuSequence, k: int) -> None:
        """One round of greedy speculative decoding: the draft proposes up to k tokens, its routing
        counted per MoE layer and planned as the verification's prefetches while it runs; the target
        verifies the last token and the proposals (`verify` exact: its one-token step for every row,
        layer-major through the static decoder's segments, or per position up to the first
        disagreement through the modules; batched: one pass of k + 1 rows, experts resident first, in
        chunks); the agreeing prefix and the target's own next token are committed
        (toolkit.predictors.draft.greedy_accept, the rule `speculative_generate` uses) and both KV
        caches are rolled back to them."""
        if s.runner is not None:
            s.runner.check_open()
        dev = self.dev
        n = len(s.ids)
        kk = min(k, s.max_new - len(s.tokens))
        s.draft_counts = [[0.0] * self.E for _ in range(self.L)]
        s.draft_dirty = set()
        d0 = dev.event()
        proposal = self._propose(s, kk, n - 1)
        d1 = dev.event()
        s.phases["draft"].append((d0, d1))
        if self.verify == "exact" and s.runner is not None:
            target = s.runner.verify_rows(s, [s.ids[-1], *proposal], n - 1)
        elif self.verify == "exact":
            target = self._verify_exact(s, proposal, n - 1)
        else:
            s.pos = n - 1
            target = self._verify(s, [s.ids[-1], *proposal], n - 1).argmax(-1).tolist()
        s.phases["verify"].append((d1, dev.event()))
        new = greedy_accept(proposal, target, s.spec)
        a = len(new) - 1                                   # proposals accepted
        s.dlen = n + min(a, len(proposal) - 1)             # the draft's cache: committed tokens it was fed
        if s.runner is None:
            if self.verify == "batched":
                s.cache.crop(-(len(proposal) - a))         # keep ids[:n + a] (exact stepped no further)
            s.dcache.crop(-(s.dcache.get_seq_length() - s.dlen))
        # (static caches: what lies past the committed positions is masked, then overwritten)
        s.draft_counts = None
        s.commit(new, dev.event())

    def _propose(self, s: GpuSequence, kk: int, verify_pos: int) -> list[int]:
        """The draft's kk proposals, fed first the committed tokens its cache lacks; after each, its
        routing so far plans the verification pass's copies."""
        if s.runner is not None:
            return self._draft_fast(s, kk, verify_pos)
        feed = s.ids[s.dlen:]
        proposal: list[int] = []
        for _ in range(kk):
            lg = self._forward(s, s.dcache, feed, s.dlen, draft=True)
            s.dlen += len(feed)
            proposal.append(int(lg[-1].argmax()))
            feed = [proposal[-1]]
            s.plan_draft(verify_pos)
        return proposal

    def _draft_fast(self, s: GpuSequence, kk: int, verify_pos: int) -> list[int]:
        """The draft's kk proposals through its graph: all steps enqueued at once; each step's routing
        is read back as it lands and plans the verification pass's copies (which overlap the steps
        still running). The plans fall where the modules path's do: once the fed tokens (one step
        each here, one pass there) are all counted, then after every proposal."""
        feed = s.ids[s.dlen:]
        d = s.runner.draft
        steps, evs = d.run(feed, s.dlen, kk)
        for j in range(steps):
            if self.dev.cuda:
                evs[j].synchronize()
            for li, row in enumerate(d.host_ids[j].tolist()):
                s.count_draft(li, [row])
            if j >= len(feed) - 1:
                s.plan_draft(verify_pos)
        proposal = d.host_tok[len(feed) - 1:steps].tolist()
        s.dlen += steps
        return proposal

    def _verify_exact(self, s: GpuSequence, proposal: list[int], pos: int) -> list[int]:
        """The target's greedy tokens after the last committed token (at `pos`) and each agreeing
        proposal, one decode step each, up to and including the first that disagrees: what
        `greedy_accept` reads (a + 1 tokens for a accepted proposals)."""
        target: list[int] = []
        for j, tok in enumerate([s.ids[-1], *proposal]):
            target.append(self._step(s, tok, pos + j))
            if j == len(proposal) or target[-1] != proposal[j]:
                break
        return target

    def _verify(self, s: GpuSequence, rows: list[int], pos: int) -> torch.Tensor:
        """The target's logits for `rows` at positions pos.. in one pass: the static decoder eagerly
        with the per-expert pooled loop, or transformers' modules."""
        if s.runner is not None:
            return s.runner.dec.forward_rows(torch.tensor(rows, device=self.dev.device), pos, s.runner.kv,
                                             functools.partial(self.moe, s))
        return self._forward(s, s.cache, rows, pos)

    def _forward(self, s: GpuSequence, cache, tokens: list[int], pos: int, *, draft: bool = False) -> torch.Tensor:
        """transformers' modules over `tokens` at positions pos.. into `cache`, the pooled experts
        bound to `s` for this pass (the int4 draft's experts with `draft`)."""
        ids = torch.tensor([tokens], device=self.dev.device)
        with self._bound(s, draft=draft):
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True,
                             position_ids=torch.arange(pos, pos + len(tokens), device=self.dev.device)[None])
        return out.logits[0].float()

    @contextlib.contextmanager
    def _bound(self, s: GpuSequence, *, draft: bool):
        """Every PooledExperts computes for `s` (the draft's experts with `draft`) until the block ends."""
        for m in self.pooled:
            m.seq, m.drafting = s, draft
        try:
            yield
        finally:
            for m in self.pooled:
                m.seq, m.drafting = None, False

    def _finish(self, s: GpuSequence, k: int) -> GpuGeneration:
        """The sequence's figures (decode tokens only) and routing."""
        cfg, io = self.cfg, s.io
        self.dev.sync()
        secs = [s.t0.elapsed_time(t) / 1e3 for t in s.times]
        stats = s.account.finish(cfg.policy.name, s.sched, s.pool, token_times=secs, ttft_s=secs[0])
        n_dec = max(len(s.tokens) - 1, 1)
        copies0, stalls0 = s.marks
        stall = io.stall_ms(stalls0)
        # the stall is the compute stream's waits on copies (CUDA events), not host time
        stats = dataclasses.replace(stats, stall_ms_per_token=round(stall / n_dec, 4))
        extra = {
            "device": str(self.dev.device), "decode": self.decode,
            "launch": ("driver" if io.drv is not None else "torch") if self.dev.cuda else None,   # (this run's calls)
            "pool_slots": self.capacity, "expert_bytes": self.store.blob_size,
            # the slot allocation this run read (its pool's capacity), and every arena the engine held
            "slot_arena_bytes": io.slots.numel(),
            "slot_arenas_held_bytes": self.arenas_bytes if s.runner is not None else io.slots.numel(),
            "pcie_bytes_per_token": round(stats.counts["bytes_read"] / n_dec),
            "copy_ms_per_token": round(io.copy_ms(copies0) / n_dec, 4),
            "draft_bytes": self.draft_bytes if cfg.policy.predictor == "draft" else 0,
            "dense_bytes": self.dense_bytes,
        }
        if cfg.policy.predictor == "draft":
            extra.update({
                "k": k, "rounds": s.spec.rounds, "acceptance": round(s.spec.acceptance, 4),
                "draft_ms_per_token": round(sum(a.elapsed_time(b) for a, b in s.phases["draft"]) / n_dec, 4),
                "verify_ms_per_token": round(sum(a.elapsed_time(b) for a, b in s.phases["verify"]) / n_dec, 4),
            })
        routing = [torch.tensor(s.routing[p]) for p in sorted(s.routing)]
        return GpuGeneration(s.tokens, routing, stats, extra)

    ARENAS = 2   # pool sizes whose slot arena and graphs are kept (the bench's all-resident bound and a pool)

    @property
    def arenas_bytes(self) -> int:
        """Device bytes of every slot arena the engine holds now."""
        return sum(r.slots.numel() for r in self._runners.values())

    def _graph_runner(self, positions: int):
        """The static-cache decoder over a slot arena of exactly this pool's capacity (the budget is
        physical). The graphs read the arena at a fixed address, so a runner (arena + graphs) is kept
        per pool size, the last ARENAS of them; a new pool size, or positions past a runner's static
        cache, builds (and captures) another."""
        from toolkit.runtime.gpu_graph import build_runner

        cap = self.capacity
        runner = self._runners.pop(cap, None)
        slots = None
        if runner is not None and runner.S < positions:    # the same arena, a longer static cache
            slots = runner.slots
            runner.close()
            runner = None
        if runner is None:
            while len(self._runners) >= self.ARENAS:         # free the oldest arena before allocating
                self._runners.pop(next(iter(self._runners))).close()
            if self.dev.cuda:
                torch.cuda.empty_cache()
            if slots is None:
                slots = alloc_slots(cap, self.store.blob_size, self.dev)
            S = max(128, -(-positions // 64) * 64)
            runner = build_runner(self, slots, S, graphs=self.decode == "graph")
            runner.ensure()
        self._runners[cap] = runner                          # most recently used last
        return runner

    def _eos(self) -> list[int]:
        from toolkit.models.loader import eos_token_ids

        return list(eos_token_ids(self.spec, self.tokenizer))

    # -- the recorded future: the CPU runner's `record` (a first on-demand pass; output does not
    # depend on the policy), and `run`, which also takes the draft's k and the preload
    record = Runner.record

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int, *, recorded: GpuGeneration | None = None,
            k: int = 8, preload: bool = False) -> GpuGeneration:
        """`generate` with the recorded first pass the policy needs (oracle, Belady) made first."""
        if self.cfg.policy.needs_future:
            recorded = recorded or self.record(prompt_ids, max_new_tokens)
        return self.generate(prompt_ids, max_new_tokens, recorded=recorded, k=k, preload=preload)


def h2d_bandwidth(dev: Device, mib: int = 256, reps: int = 5) -> float:
    """Pinned host -> device copy bandwidth in GB/s (the floor of every copy), timed with CUDA events."""
    src = torch.empty(mib * MiB, dtype=torch.uint8, pin_memory=dev.cuda)
    dst = torch.empty_like(src, device=dev.device)
    dst.copy_(src, non_blocking=True)
    dev.sync()
    a = dev.event()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    b = dev.event()
    dev.sync()
    return reps * src.numel() / (a.elapsed_time(b) / 1e3) / 1e9


def d2d_bandwidth(dev: Device, mib: int = 1024, reps: int = 5) -> float:
    """Device memory bandwidth in GB/s (bytes read + bytes written of a large device-to-device copy):
    the ceiling that bounds the all-resident TPOT (every token reads the dense weights and k experts
    per MoE layer)."""
    src = torch.empty(mib * MiB, dtype=torch.uint8, device=dev.device).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    dev.sync()
    a = dev.event()
    for _ in range(reps):
        dst.copy_(src)
    b = dev.event()
    dev.sync()
    return reps * 2 * src.numel() / (a.elapsed_time(b) / 1e3) / 1e9
