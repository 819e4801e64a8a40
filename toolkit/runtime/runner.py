"""The reference runner: one decode loop over a model's step graphs, experts through the pool.

This is the loop the phone runs and the C++ runner ports (android_runner/), in the style of
gpt-fast's `generate.py` and ExecuTorch's `TextTokenGenerator`. Per position (the prompt is fed one
token at a time through the same graphs; its last step gives the first token):

    h = embed(token)
    for each decoder layer:
        dense layer:  h = layer(h, pos)
        MoE layer i:  h_res, x, logits[, preds] = layer(h, pos)      step s = pos * L + i
                      w, ids = select(logits)            the family's rule, on the host
                      acquire(s, ids)                    hits pinned; misses read on demand, first
                      plan(s + 1 .. s + W)               prefetches from preds / a host predictor
                      y = sum_j w_j * expert(x, slot(ids_j))  waiting for bytes still in flight
                      release(s, ids); h = h_res + y
    token = argmax(head(h))

Where the graphs have prefill methods (`prefill_T_layer_N`), the prompt goes through them in chunks,
greedily by the largest chunk that fits (`chunk_plan`), and consecutive chunks run as one span of up
to PREFILL_SPAN positions, layer by layer (`Runner._chunk`: every chunk of the span through layer N,
then the span's MoE layer as one step, p0 * L + i, its experts' union acquired in groups that fit the
pool and each expert read once and computed once for all the span's tokens routed to it);
`RunConfig.prefill_chunk` caps the chunk size or turns chunks off. Within a MoE
layer, experts whose bytes have landed are computed first, the others as their reads land
(`WindowScheduler.compute_order`), summed in top-k order.

The backend (toolkit/runtime/backend.py) may be eager PyTorch, an ExecuTorch program, ONNX Runtime
or QNN context binaries; the experts always come from the expert store through the bounded pool and
the windowed scheduler, and nothing else holds an expert. Output is the same for every policy and
budget by construction: the policy decides only what is read when, never what is computed.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from toolkit.errors import SpecPrefetchError
from toolkit.jsonvalues import is_int
from toolkit.models.families import RoutingSpec, expert_weights, select_experts
from toolkit.predictors.base import Predictor
from toolkit.runtime.backend import Backend, chunk_plan, prefill_spans
from toolkit.runtime.events import EventLog
from toolkit.runtime.expert_store import ExpertStore
from toolkit.runtime.experts import ExpertExecutor
from toolkit.metrics import median_low
from toolkit.runtime.io import ThreadReader, ProcessReader, measure_reads
from toolkit.runtime.planner import ChunkState, PrefetchPlanner, RoutingState
from toolkit.runtime.policy import Policy
from toolkit.runtime.pool import ExpertPool
from toolkit.runtime.profiles import DeviceProfile, check_budget_kib
from toolkit.runtime.reuse import ReuseHistory
from toolkit.runtime.scheduler import ReadBudgetMeter, SchedulerConfig, WindowScheduler
from toolkit.runtime.stats import DecodeAccount, RunStats


if TYPE_CHECKING:
    from adapters.reuse import ReuseTable
    from toolkit.runtime.images import ImagePrompt

REUSE_MISSING = ("eviction 'reuse' needs the adapter's reuse table, which this adapter or bundle lacks: "
                 "train the adapter with this version (specprefetch train) and export again")
PREFILL_PROGRESS_TOKENS = 64  # prompts longer than this show a prefill progress bar (Runner.progress)


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the loop needs to know of a model (from a checkpoint or a bundle's manifest)."""
    num_layers: int                      # decoder layers
    moe_layers: tuple[int, ...]          # which of them are MoE layers
    routing: RoutingSpec
    hidden_size: int
    expert_roles: tuple[str, ...]        # the expert graph's matrix order
    eos_token_ids: tuple[int, ...] = ()  # decoding stops after any of these
    score_bias: torch.Tensor | None = None            # [L, E] DeepSeek-V3 selection bias
    preds_horizons: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # MoE layer -> rows
    max_seq: int | None = None           # KV cache length of the graphs
    label: str = ""                      # the model directory or bundle, for reports
    text_config: Any = None              # hidden_act / swiglu_limit: the int8 / int4 experts' activation
    reuse: ReuseTable | None = None      # the adapter's reuse table (the `reuse` eviction)
    next_visits: int = 0                 # preds rows of horizons L, 2L, ...: the adapter's next-visit heads

    @property
    def L(self) -> int:
        return len(self.moe_layers)


# --read-rate-mibs at most (the native runner's limit alike): 1 PB/s keeps rate x step x steps within int64
MAX_READ_RATE_MIBS = 1e9


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """How a run streams its experts. Change it through `Runner.configure`, not by mutation."""
    policy: Policy = Policy("adapter", "prediction")
    pool_mib: float = 8.0
    window: int = 2
    queue_depth: int = 4
    min_confidence: float = 0.02
    candidate_threshold: float = 0.0
    step_budget_kib: int | None = None
    # KiB the flash delivers per step (None: no deadline check; "auto": measured in the run, ReadBudgetMeter:
    # the flash's rate, read_rate_mibs or probed at start-up, times the steps' measured compute time)
    read_budget_kib: int | str | None = None
    read_rate_mibs: float | None = None
    flash_profile: DeviceProfile | None = None   # pace real reads to this device (emulated flash)
    io: str = "process"                          # reader process (default) or reader threads
    verify: bool = True                          # CRC every blob read
    prefill_chunk: int | None = None             # largest prefill chunk (None: the graphs' largest; 0: off)
    next_visit: bool = True                      # reuse: read the adapter's next-visit heads where there are any
    next_visits: int | None = None               # at most this many of them (None: all the adapter has)
    reuse_classes: bool = True                   # reuse: score by the table's frequency classes where it has them

    def visits_read(self, heads: int) -> int:
        """How many of an adapter's `heads` next-visit heads the reuse eviction reads under this config."""
        if not self.next_visit or self.policy.eviction != "reuse":
            return 0
        return heads if self.next_visits is None else min(heads, self.next_visits)

    def __post_init__(self):
        if self.next_visits is not None and not (is_int(self.next_visits) and self.next_visits >= 0):
            raise SpecPrefetchError(f"--next-visits {self.next_visits}: a whole number >= 0")
        if not (self.pool_mib > 0 and self.pool_mib < float("inf")):
            raise SpecPrefetchError(f"--pool-mib {self.pool_mib}: must be a positive number")
        if self.window < 1:
            raise SpecPrefetchError(f"--window {self.window}: must be >= 1")
        if self.queue_depth < 1:
            raise SpecPrefetchError(f"--queue-depth {self.queue_depth}: must be >= 1")
        if self.io not in ("process", "threads"):
            raise SpecPrefetchError(f"--io {self.io!r}: choose process or threads")
        if self.prefill_chunk is not None and self.prefill_chunk < 0:
            raise SpecPrefetchError(f"--prefill-chunk {self.prefill_chunk}: a chunk size or off")
        if isinstance(self.read_budget_kib, str) and self.read_budget_kib != "auto":
            raise SpecPrefetchError(f"--read-budget-kib {self.read_budget_kib}: KiB a step, auto, or None (off)")
        if self.read_rate_mibs is not None and (self.read_budget_kib != "auto"
                                                or not 0 < self.read_rate_mibs <= MAX_READ_RATE_MIBS):
            raise SpecPrefetchError(f"--read-rate-mibs {self.read_rate_mibs}: a rate above 0 and at most "
                                    f"{MAX_READ_RATE_MIBS:g} MiB/s, only with --read-budget-kib auto (the rate the "
                                    "budget multiplies)")

    @property
    def budget_bytes(self) -> int:
        return int(self.pool_mib * 2**20)


@dataclasses.dataclass
class Generation:
    """One prompt's result: the committed tokens, the routing of every position ([L, k] each),
    and the run's figures."""
    tokens: list[int]
    routing: list[torch.Tensor]
    stats: RunStats
    direct_io: bool
    events: EventLog | None = None
    logits: torch.Tensor | None = None   # [positions, V] with keep_logits
    fed: list[int] | None = None         # every token fed (prompt + committed, but the last)
    prefill_chunks: list[int] | None = None  # how the prompt was fed: chunk sizes, 1 = one position
    read_budget: dict[str, Any] | None = None  # the read budget it ran with (ReadBudget.report)

    def to_json(self) -> dict[str, Any]:
        n = sum(self.prefill_chunks or [])
        tps = round(n / (self.stats.ttft_ms / 1e3), 2) if n and self.stats.ttft_ms > 0 else None
        return {"tokens": self.tokens, **self.stats.to_json(), "direct_io": self.direct_io,
                "prefill_tokens_per_s": tps, "prefill_chunks": self.prefill_chunks, "read_budget": self.read_budget}


class Runner:
    def __init__(self, backend: Backend, store: ExpertStore, model: ModelInfo, cfg: RunConfig,
                 predictors: dict[str, Predictor | str] | None = None):
        """
        Args:
            backend: runs the model's step graphs.
            store: the expert store (must match the model's MoE layers and experts).
            model: the model's shape and routing rule.
            cfg: policy, budget and scheduler settings.
            predictors: predictor name -> a registry Predictor or GRAPH (the layer graphs' preds
                rows); the policy's predictor must be here unless it is on-demand.
        """
        if (store.num_layers, store.num_experts) != (model.L, model.routing.num_experts):
            raise SpecPrefetchError(f"{store.path}: {store.num_layers} layers x {store.num_experts} experts, the "
                                    f"model has {model.L} x {model.routing.num_experts}")
        self.backend, self.store, self.model = backend, store, model
        self.predictors = dict(predictors or {})
        self.experts = ExpertExecutor(backend, store, model.expert_roles, tc=model.text_config)
        self.cfg = cfg
        self.progress = False  # a progress bar on stderr for prefills of long prompts (the CLI sets it)
        self.images: "ImagePrompt | None" = None  # the image prompt of the sequence being generated
        self.probes: dict[tuple[int, bool], dict[str, Any]] = {}  # read_probe's, by (lanes, verify)
        self.configure()

    def configure(self, **changes) -> None:
        """Change the policy, pool budget or scheduler settings (RunConfig's fields) for later runs."""
        cfg = dataclasses.replace(self.cfg, **changes)
        p = cfg.policy.predictor
        if p != "on-demand" and p not in self.predictors:
            have = ", ".join(["on-demand", *self.predictors]) or "on-demand"
            raise SpecPrefetchError(f"--policy {cfg.policy.name}: predictor {p!r} is not available for "
                                    f"{self.model.label or 'this model'} (available: {have})")
        if cfg.policy.eviction == "reuse" and self.model.reuse is None:
            raise SpecPrefetchError(f"--policy {cfg.policy.name}: {REUSE_MISSING} ({self.model.label})")
        if cfg.window > self.model.L:
            raise SpecPrefetchError(f"--window {cfg.window}: must be 1..{self.model.L} (the MoE layers of one token)")
        capacity = cfg.budget_bytes // self.store.slot_bytes
        if capacity < self.model.routing.top_k:
            k = self.model.routing.top_k
            raise SpecPrefetchError(
                f"--pool-mib {cfg.pool_mib:g}: holds {capacity} expert slots of {self.store.slot_bytes / 2**10:.0f} "
                f"KiB, but one layer needs {k} at once; use at least {k * self.store.slot_bytes / 2**20:.2f}")
        have = self.backend.prefill_chunks
        if cfg.prefill_chunk and cfg.prefill_chunk not in have:
            sizes = ", ".join(map(str, have)) if have else "none: the bundle predates prefill chunks"
            raise SpecPrefetchError(f"--prefill-chunk {cfg.prefill_chunk}: the graphs' prefill chunk sizes are "
                                    f"{sizes}; give one of them or off")
        for opt, kib in (("--step-budget-kib", cfg.step_budget_kib), ("--read-budget-kib", cfg.read_budget_kib)):
            check_budget_kib(kib, self.store.slot_bytes, opt)
        self.cfg = cfg

    # -- one prompt --------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *,
                 recorded: "Generation | None" = None, events: EventLog | None = None,
                 force_ids: torch.Tensor | None = None, keep_logits: bool = False,
                 images: "ImagePrompt | None" = None) -> Generation:
        """Greedy decoding of up to `max_new_tokens` tokens (stopping after EOS).

        Args:
            recorded: an earlier run of this prompt (`record`): its routing is the future the oracle
                and Belady read, its tokens what the draft routes over (output does not depend on
                the policy, so they are this run's own).
            events: an EventLog to record every decision into.
            force_ids: [positions, L, k] expert ids every MoE layer computes with (weighted by this
                model's own router logits) instead of its own choice, which is still recorded: the
                export's parity check measures numerical error without router near-tie cascades.
            keep_logits: keep every position's logits (prompt positions included).
            images: an image prompt (toolkit/runtime/images.py: ImagePrompt, its `ids` are `prompt_ids`): its
                image rows' embeddings, DeepStack features and M-RoPE positions.
        """
        m, cfg = self.model, self.cfg
        if not prompt_ids:
            raise SpecPrefetchError("the prompt is empty")
        if max_new_tokens < 1:
            raise SpecPrefetchError(f"--max-new-tokens {max_new_tokens}: must be >= 1")
        if m.max_seq is not None and len(prompt_ids) + max_new_tokens - 1 > m.max_seq:
            raise SpecPrefetchError(f"prompt ({len(prompt_ids)} tokens) + --max-new-tokens {max_new_tokens} exceeds "
                                    f"the graphs' KV cache of {m.max_seq} positions")
        L, k = m.L, m.routing.top_k
        source = self.predictors.get(cfg.policy.predictor)
        ahead = getattr(source, "routes_ahead", False)   # source: a Predictor, GRAPH or None
        if (cfg.policy.needs_future or ahead) and recorded is None:
            raise SpecPrefetchError(f"--policy {cfg.policy.name}: needs a recorded first pass (Runner.run does it)")
        if ahead:  # the draft routes over the whole sequence ahead of time
            source.prepare(list(prompt_ids) + recorded.tokens)
        planner = PrefetchPlanner(source, num_layers=L, window=cfg.window, routing=m.routing,
                                  score_bias=m.score_bias, preds_horizons=m.preds_horizons,
                                  next_visits=cfg.visits_read(m.next_visits))
        state = RoutingState(L, m.hidden_size, k)
        state.future = recorded.routing if recorded is not None else None
        io = self._open_io()
        try:
            units = chunk_plan(len(prompt_ids), self.chunk_sizes())
            spans = prefill_spans(units)
            pool, sched = open_pool_and_scheduler(cfg, slot_bytes=self.store.slot_bytes, num_layers=L, top_k=k,
                                                  io=io, future=state.future, prefetch=planner.active, events=events,
                                                  units=spans, reuse=m.reuse)
            if events is not None:
                events.header(policy=cfg.policy.name, budget_bytes=cfg.budget_bytes, slot_bytes=self.store.slot_bytes,
                              capacity=pool.capacity, window=cfg.window, queue_depth=cfg.queue_depth,
                              min_confidence=cfg.min_confidence, layers=L, top_k=k,
                              read_budget="off" if cfg.read_budget_kib is None else cfg.read_budget_kib)
                events.sequence(prompt_tokens=len(prompt_ids))
            if images is not None and list(images.ids) != list(prompt_ids):
                raise SpecPrefetchError("the image prompt's tokens are not the prompt's")
            self.images = images
            budget = ReadBudget(cfg, sched, planner.active, self.read_probe, events)
            g = self._loop(list(prompt_ids), max_new_tokens, sched, pool, planner, state, events, io,
                           force_ids, keep_logits, units, spans, budget)
            g.read_budget = budget.report()
            return g
        finally:
            io.close()

    def chunk_sizes(self) -> tuple[int, ...]:
        """The prefill chunk sizes this run uses (none with --prefill-chunk off or old graphs)."""
        have, cap = self.backend.prefill_chunks, self.cfg.prefill_chunk
        if cap == 0:
            return ()
        return tuple(T for T in have if cap is None or T <= cap)

    def read_probe(self, lanes: int) -> dict[str, Any]:
        """The flash's rate for --read-budget-kib auto, measured once per lane count and checking, as the
        native runner's probe: `probe_reads` slot reads of distinct experts spread evenly over the store, at
        the run's lanes (fewer in flight where the pool holds fewer slots, as the runner's scratch slots), each
        blob's CRC-32 checked (unless the run checks none); no probed page is left in the page cache. The
        first call returns `fresh: True` (what the report's probe_* keys describe)."""
        st = self.store
        E = self.model.routing.num_experts
        total = self.model.L * E
        flight = min(lanes, self.cfg.budget_bytes // st.slot_bytes, total)
        key = (flight, self.cfg.verify)   # the same reads in flight and checking: the same measurement
        if key in self.probes:
            return {**self.probes[key], "fresh": False}
        n = probe_reads(total, st.slot_bytes)
        at = {e.offset: e for e in (st.entries[(j * total // n) // E, (j * total // n) % E] for j in range(n))}
        why = " (read by --read-budget-kib auto's probe of the flash's rate)"
        check = (lambda off, view: st.check(at[off].layer, at[off].expert, view)) if self.cfg.verify else None
        t = time.perf_counter()
        try:
            mibs, _ = measure_reads(st.path, list(at), st.slot_bytes, flight, n, store=st, in_order=True, check=check)
        except SpecPrefetchError as e:
            raise SpecPrefetchError(str(e) + why) from None
        finally:
            with contextlib.suppress(OSError):   # (never in place of the probe's own error)
                st.drop_cache()
        self.probes[key] = {"read_mibs": mibs, "probe_reads": n, "probe_lanes": flight,
                            "probe_ms": (time.perf_counter() - t) * 1e3, "probe_bytes": n * st.slot_bytes}
        return {**self.probes[key], "fresh": True}

    def _open_io(self):
        cfg = self.cfg
        slots = min(cfg.budget_bytes // self.store.slot_bytes, self.model.L * self.model.routing.num_experts)
        if cfg.io == "process":
            return ProcessReader(self.store, slots=slots, workers=reader_workers(cfg), profile=cfg.flash_profile,
                                 verify=cfg.verify)
        return ThreadReader(self.store, workers=reader_workers(cfg), profile=cfg.flash_profile, verify=cfg.verify)

    def _loop(self, seq: list[int], max_new: int, sched: WindowScheduler, pool: ExpertPool,
              planner: PrefetchPlanner, state: RoutingState, events: EventLog | None, io,
              force_ids: torch.Tensor | None, keep_logits: bool, units: list[int],
              spans: list[int], budget: "ReadBudget") -> Generation:
        m, backend = self.model, self.backend
        L = m.L
        moe_index = {layer: li for li, layer in enumerate(m.moe_layers)}
        n_prompt = len(seq)
        end = (n_prompt + max_new - 1) * L  # the first step the run never reaches
        backend.reset()
        media = self.images
        if media is not None:
            backend.set_rope(media.rope, media.delta)
        routing: list[torch.Tensor] = []
        logits_all: list[torch.Tensor] = []
        tokens: list[int] = []
        times: list[float] = []
        account = DecodeAccount()
        bar = None
        if self.progress and n_prompt > PREFILL_PROGRESS_TOKENS:
            from tqdm import tqdm

            bar = tqdm(total=n_prompt, desc="prefill", unit="tok", leave=False, mininterval=0.5)
        graphs = str(getattr(backend, "path", "") or m.label or "the model")  # what non-finite output names
        t0 = time.perf_counter()
        pos = 0
        starts = list(itertools.accumulate([0, *spans]))  # each prompt span's first position
        unit_at = {p: T for p, T in zip(starts, spans)}
        while True:
            T = unit_at.get(pos, 1)
            if T > 1:  # a prefill span: positions pos .. pos + T - 1, layer by layer
                nxt_T = unit_at.get(pos + T, 1)
                hs = self._chunk(seq, pos, T, nxt_T, sched, pool, planner, state, events, force_ids, end, graphs,
                                 moe_index, routing, budget)
                last = pos + T - 1
                for t in range(T):
                    state.next_position()
                    if keep_logits or pos + t >= n_prompt - 1:
                        out = backend.call("head", [hs[:, t:t + 1]])[0].reshape(-1).float()
                        _finite([out], graphs, "head", pos + t)
                        if keep_logits:
                            logits_all.append(out)
                if bar is not None:
                    bar.update(T)
                    if last == n_prompt - 1:
                        bar.close()
                if last < n_prompt - 1:
                    pos += T
                    continue
                pos = last
                nxt = int(out.argmax())
                tokens.append(nxt)
                times.append(time.perf_counter())
                if events is not None:
                    events.token(len(tokens) - 1, pos + 1, nxt, (times[-1] - t0) * 1e3)
                account.start(sched, pool)
                if len(tokens) >= max_new or nxt in m.eos_token_ids:
                    break
                seq.append(nxt)
                pos += 1
                continue
            h = backend.call("embed", [torch.tensor([[seq[pos]]], dtype=torch.long)])[0]
            _finite([h], graphs, "embed", pos)
            if media is not None:
                h = media.embed(h, pos)
            for layer in range(m.num_layers):
                outs = backend.layer(layer, h, pos)
                _finite(outs, graphs, f"layer_{layer}", pos)
                if layer not in moe_index:
                    h = outs[0] if media is None else media.add_deepstack(outs[0], pos, layer)
                    continue
                li = moe_index[layer]
                step = pos * L + li
                h_res, x, logits = outs[0], outs[1], outs[2]
                preds = outs[3] if len(outs) > 3 else None
                sb = m.score_bias[li] if m.score_bias is not None else None
                w, ids = select_experts(logits.reshape(1, -1), m.routing, sb)
                state.record(li, x, ids[0])
                if force_ids is not None:
                    ids = force_ids[pos, li].view(1, -1).long()
                    w = expert_weights(logits.reshape(1, -1), ids, m.routing)
                keys = [(li, int(e)) for e in ids[0]]
                if events is not None:
                    events.at(step, pos, li)
                budget.step(step, 1, decode=bool(tokens))
                sched.acquire(step, keys)          # demand reads go out first
                planner.plan(sched, li, step, state, preds, end)
                # compute while loading: resident experts first, each missing one as its read lands;
                # summed in top-k order afterwards (the result does not depend on the order)
                e_outs: dict[int, torch.Tensor] = {}
                for j in sched.compute_order(keys):
                    key = keys[j]
                    e_out = self.experts.expert(x, sched.data(key))
                    if not bool(torch.isfinite(e_out).all()):  # x is finite: the expert's weights are not
                        raise SpecPrefetchError(f"{self.store.path}: expert {key} gave non-finite output (NaN or "
                                                f"inf) at position {pos}: its weights in the store are damaged")
                    e_outs[j] = e_out
                y = torch.zeros_like(x)
                for j in range(len(keys)):
                    y = y + w[0, j] * e_outs[j]
                sched.release(step, keys)
                h = h_res + y.view_as(h_res)
                if media is not None:
                    h = media.add_deepstack(h, pos, layer)
            routing.append(state.ids[0].clone())
            state.next_position()
            if keep_logits or pos >= n_prompt - 1:
                out = backend.call("head", [h])[0].reshape(-1).float()
                _finite([out], graphs, "head", pos)
                if keep_logits:
                    logits_all.append(out)
            if bar is not None and pos < n_prompt:
                bar.update(1)
                if pos == n_prompt - 1:
                    bar.close()
            if pos < n_prompt - 1:  # still the prompt: its next token is given
                pos += 1
                continue
            nxt = int(out.argmax())
            tokens.append(nxt)
            times.append(time.perf_counter())
            if events is not None:
                events.token(len(tokens) - 1, pos + 1, nxt, (times[-1] - t0) * 1e3)
            if len(tokens) == 1:  # decode figures are counted from here
                account.start(sched, pool)
            if len(tokens) >= max_new or nxt in m.eos_token_ids:
                break
            seq.append(nxt)
            pos += 1
        stats = account.finish(self.cfg.policy.name, sched, pool, token_times=times, ttft_s=times[0] - t0)
        if events is not None:
            events.end(tokens=len(tokens), t_ms=(time.perf_counter() - t0) * 1e3)
        return Generation(tokens, routing, stats, direct_io=bool(getattr(io, "direct", False)), events=events,
                          logits=torch.stack(logits_all) if keep_logits else None, fed=seq, prefill_chunks=units)

    def _chunk(self, seq, p0: int, T: int, T_next: int, sched: WindowScheduler, pool: ExpertPool,
               planner: PrefetchPlanner, state: RoutingState, events: EventLog | None,
               force_ids: torch.Tensor | None, end: int, graphs: str, moe_index: dict[int, int],
               routing: list[torch.Tensor], budget: "ReadBudget") -> torch.Tensor:
        """Prompt positions p0 .. p0+T-1 (a span: its chunks `chunk_plan(T)`, run in order through
        each layer's prefill_T' methods before the next layer) through every layer; returns their
        hidden states [1, T, H] and appends their routing.

        At MoE layer i (step p0 * L + i) the span's routed experts (the union over its tokens)
        are acquired in groups of at most the pool's capacity, resident ones first, then the
        others, each part by ascending expert id; each expert is decoded once and computed for
        every token routed to it; a token's output sums its experts in its own top-k order, as one
        position does. The window is planned after the last group's acquire (its demand reads
        first); earlier groups release without issuing prefetches, so no prefetch takes a slot a
        later group of the same step needs."""
        m, backend = self.model, self.backend
        L, k = m.L, m.routing.top_k
        toks = torch.tensor([seq[p0:p0 + T]], dtype=torch.long)
        h = torch.cat([backend.call("embed", [toks[:, t:t + 1]])[0] for t in range(T)], dim=1)
        _finite([h], graphs, "embed", p0)
        media = self.images
        if media is not None:
            h = media.embed(h, p0)
        chunk = ChunkState(T, L, m.hidden_size, k, before=state.ids)
        ids_all = torch.zeros(T, L, k, dtype=torch.long)
        parts = chunk_plan(T, self.chunk_sizes())
        offs = list(itertools.accumulate([0, *parts]))
        for layer in range(m.num_layers):
            # the span's chunks in order: each one's attention sees the KV the earlier ones wrote
            per = []
            for o, Tp in zip(offs, parts):
                r = backend.layer_chunk(layer, h[:, o:o + Tp], p0 + o)
                _finite(r, graphs, f"prefill_{Tp}_layer_{layer}", p0 + o)
                per.append(r)
            outs = per[0] if len(per) == 1 else [
                torch.cat([r[i].reshape(1, Tp, -1) for r, Tp in zip(per, parts)], dim=1) if i == 0 else
                torch.cat([r[i].reshape(Tp, -1) for r, Tp in zip(per, parts)]) for i in range(len(per[0]))]
            if layer not in moe_index:
                h = outs[0] if media is None else media.add_deepstack(outs[0], p0, layer)
                continue
            li = moe_index[layer]
            step = p0 * L + li
            h_res, x, logits = outs[0], outs[1].reshape(T, -1), outs[2].reshape(T, -1)
            preds = outs[3] if len(outs) > 3 else None
            sb = m.score_bias[li] if m.score_bias is not None else None
            w, ids = select_experts(logits, m.routing, sb)
            chunk.record(li, x, ids)
            ids_all[:, li] = ids
            state.record(li, x[T - 1:T], ids[T - 1])  # the last position's, for the next unit's predictors
            if force_ids is not None:
                ids = force_ids[p0:p0 + T, li].long()
                w = expert_weights(logits, ids, m.routing)
            if events is not None:
                events.at(step, p0, li)
            users: dict[int, list[tuple[int, int]]] = {}
            for t in range(T):
                for j, e in enumerate(ids[t].tolist()):
                    users.setdefault(e, []).append((t, j))
            order = sorted(users, key=lambda e: (pool.get((li, e)) is None, e))
            budget.step(step, T, decode=False)
            G = pool.capacity
            groups = [order[a:a + G] for a in range(0, len(order), G)]
            e_out: dict[tuple[int, int], torch.Tensor] = {}
            for gi, grp in enumerate(groups):
                keys = [(li, e) for e in grp]
                sched.acquire(step, keys)
                last = gi == len(groups) - 1
                if last:
                    planner.plan_chunk(sched, li, step, (T, T_next), chunk, state, preds, end)
                for i in sched.compute_order(keys):
                    key = keys[i]
                    blob = sched.data(key)
                    # per token, exactly as the one-position path computes it (fp16: the expert graph on
                    # the blob's matrices, decoded once; int8 / int4: the integer-dot reference)
                    fp16 = self.experts.fp16
                    mats = self.experts.matrices(blob) if fp16 else self.experts.integer_matrices(blob)
                    for t, j in users[key[1]]:
                        out = backend.call("expert", [x[t:t + 1], *mats])[0] if fp16 \
                            else self.experts.expert(x[t:t + 1], blob, mats=mats)
                        if not bool(torch.isfinite(out).all()):
                            raise SpecPrefetchError(f"{self.store.path}: expert {key} gave non-finite output (NaN or "
                                                    f"inf) at position {p0 + t}: its weights in the store are damaged")
                        e_out[(t, j)] = out
                sched.release(step, keys, pump=last)
            rows = []
            for t in range(T):
                y = torch.zeros_like(x[t:t + 1])
                for j in range(k):
                    y = y + w[t, j] * e_out[(t, j)]
                rows.append(y)
            h = h_res + torch.cat(rows).view_as(h_res)
            if media is not None:
                h = media.add_deepstack(h, p0, layer)
        routing.extend(ids_all[t].clone() for t in range(T))
        return h

    # -- the recorded future -------------------------------------------------------------
    def record(self, prompt_ids: Sequence[int], max_new_tokens: int, *,
               images: "ImagePrompt | None" = None) -> Generation:
        """A first, on-demand pass whose routing is the future the oracle and Belady read (and whose
        tokens the draft routes over): output does not depend on the policy, so this is exact."""
        cfg = self.cfg
        self.configure(policy=Policy("on-demand", "lru"))
        try:
            return self.generate(prompt_ids, max_new_tokens, images=images)
        finally:
            self.cfg = cfg

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int, *, events: EventLog | None = None,
            recorded: Generation | None = None, images: "ImagePrompt | None" = None) -> Generation:
        """`generate` with whatever the policy needs recorded first (oracle, Belady, draft)."""
        source = self.predictors.get(self.cfg.policy.predictor)
        if self.cfg.policy.needs_future or getattr(source, "routes_ahead", False):
            rec = recorded or self.record(prompt_ids, max_new_tokens, images=images)
            return self.generate(prompt_ids, max_new_tokens, recorded=rec, events=events, images=images)
        return self.generate(prompt_ids, max_new_tokens, events=events, images=images)


class ReadBudget:
    """A run's read budget: fixed, none, or measured in the run (`auto`: a ReadBudgetMeter fed at every MoE
    step, which sets the scheduler's budget as it goes; the flash's rate from `probe(lanes)` unless the
    configuration gives it). `report()`: the report's read_budget (the native runner's, the same keys)."""

    def __init__(self, cfg: RunConfig, sched: WindowScheduler, prefetch: bool, probe, events: EventLog | None):
        self.sched, self.events, self.meter, self.kib, self.step_ms = sched, events, None, [], []
        self.info: dict[str, Any] = {"mode": "off", "kib": None}
        lanes = min(reader_workers(cfg), 64)   # the reader's lanes (as the native runner's, at most 64)
        if cfg.read_budget_kib == "auto" and not prefetch:  # nothing prefetched: nothing to budget
            self.info = {"mode": "auto", "kib": None, "read_mibs": None, "rate_from": "unused"}
        elif cfg.read_budget_kib == "auto":
            slot = sched.pool.slot_bytes
            if cfg.read_rate_mibs:
                rate = {"read_mibs": cfg.read_rate_mibs, "rate_from": "given"}
            elif cfg.flash_profile is not None:   # reads paced to a device's flash: its rate, not this disk's,
                # at the queue depth the pacing charges (the reader process: one transfer at a time)
                qd = 1 if cfg.io == "process" else cfg.queue_depth
                rate = {"read_mibs": cfg.flash_profile.bandwidth_mibs(slot, qd), "rate_from": "profile"}
            else:
                p = probe(lanes)   # probed for this run, or by an earlier one of this runner ("cached")
                rate = {**p, "rate_from": "probe"} if p["fresh"] else {"read_mibs": p["read_mibs"],
                                                                        "rate_from": "cached"}
            self.info = {"mode": "auto", "kib": None, "read_mibs": rate["read_mibs"], "rate_from": rate["rate_from"],
                         **{k: rate[k] for k in ("probe_reads", "probe_lanes", "probe_ms", "probe_bytes")
                            if k in rate}}
            self.meter = ReadBudgetMeter(rate["read_mibs"] * 2**20, slot)
        elif cfg.read_budget_kib:
            self.info = {"mode": "fixed", "kib": cfg.read_budget_kib}

    def step(self, step: int, span: int, *, decode: bool) -> None:
        """Before MoE step `step` of a span of `span` positions acquires its experts (auto only)."""
        if self.meter is None:
            return
        b = self.meter.at(span, time.perf_counter(), self.sched.stats.wait_s)
        if b != self.sched.cfg.read_budget_bytes:
            self.sched.set_read_budget(step, b)
            if self.events is not None:
                self.events.budget(step, None if b is None else b // 1024)
        if decode and b is not None:
            self.kib.append(b // 1024)
            self.step_ms.append(self.meter.step_s * 1e3)

    def report(self) -> dict[str, Any]:
        if self.info["mode"] != "auto" or self.info["rate_from"] == "unused":
            return dict(self.info)
        return {**self.info, "kib": median_low(self.kib), "step_ms": median_low(self.step_ms), "steps": len(self.kib)}


def reader_workers(cfg: RunConfig) -> int:
    """The reader's lanes: the reader process's queue depth + 1 (the native runner's without --lanes), reader
    threads' the queue depth."""
    return cfg.queue_depth + 1 if cfg.io == "process" else cfg.queue_depth


def probe_reads(total: int, slot_bytes: int) -> int:
    """How many slot reads the read-rate probe makes (both engines: android_runner/src/runner.cpp): 64 MiB's
    worth, at least 16 and at most 64, and at most every expert once."""
    return min(total, min(64, max(16, -(-(64 << 20) // slot_bytes))))


def _finite(outs: Sequence[torch.Tensor], graphs: str, step: str, pos: int) -> None:
    """NaN or inf out of a graph would decode as some token (often EOS) and end the run "cleanly":
    refused in one line naming the graphs and the step, as the native runner refuses them."""
    for t in outs:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise SpecPrefetchError(f"{graphs}: {step} gave non-finite values (NaN or inf) at position {pos}: "
                                    "damaged weights or config (e.g. rms_norm_eps), or a damaged program")


def scheduler_inputs(cfg: RunConfig, *, prefetch: bool, reuse: ReuseTable | None,
                     future: list[torch.Tensor] | None) -> tuple[SchedulerConfig, ReuseTable | None]:
    """A run's scheduler settings and the reuse table its eviction reads (with its frequency classes or the whole
    table, as the run says; None unless it evicts by reuse), for both schedulers (this one and
    toolkit/runtime/native_sched.py); Belady's eviction needs the run's recorded routing, `reuse` the adapter's
    table."""
    ev = cfg.policy.eviction
    if ev == "belady" and future is None:
        raise SpecPrefetchError("belady eviction needs the run's recorded routing (its future)")
    if ev == "reuse" and reuse is None:
        raise SpecPrefetchError(REUSE_MISSING)
    fixed = cfg.read_budget_kib if cfg.read_budget_kib != "auto" else None  # auto: ReadBudget sets it as it goes
    scfg = SchedulerConfig(queue_depth=cfg.queue_depth, min_confidence=cfg.min_confidence,
                           candidate_threshold=cfg.candidate_threshold, prefetch=prefetch,
                           step_budget_bytes=cfg.step_budget_kib * 1024 if cfg.step_budget_kib else None,
                           read_budget_bytes=fixed * 1024 if fixed else None)
    table = (reuse if cfg.reuse_classes else reuse.whole()) if ev == "reuse" else None
    return scfg, table


def open_pool_and_scheduler(cfg: RunConfig, *, slot_bytes: int, num_layers: int, top_k: int, io,
                            future: list[torch.Tensor] | None, prefetch: bool, events: EventLog | None = None,
                            clock=time.perf_counter, units: Sequence[int] = (),
                            reuse: ReuseTable | None = None) -> tuple[ExpertPool, WindowScheduler]:
    """A fresh pool and scheduler for one sequence, the same for the runner and the simulator.
    `units`: how the prompt's steps go (its spans, `prefill_spans`), for Belady's step numbering;
    `reuse`: the table the reuse eviction reads (the adapter's, adapters/reuse.py)."""
    ev = cfg.policy.eviction
    scfg, table = scheduler_inputs(cfg, prefetch=prefetch, reuse=reuse, future=future)
    never = lambda key, now: float("inf")  # noqa: E731 - "prediction" reads the scheduler's table instead
    pool = ExpertPool(cfg.budget_bytes, slot_bytes, policy=ev, min_slots=top_k,
                      next_use=belady_next_use(future, num_layers, units) if ev == "belady" else never)
    sched = WindowScheduler(pool, io, scfg, num_layers=num_layers, top_k=top_k, events=events, clock=clock,
                            reuse=ReuseHistory(table, num_layers) if table is not None else None)
    if ev == "prediction":
        pool.next_use = sched.next_predicted_use
    return pool, sched


def belady_next_use(future: list[torch.Tensor], L: int, units: Sequence[int] = ()):
    """next_use(key, now) -> the step of the key's next real use (inf if none): Belady's rule.
    `future` holds every position's routing [L, k]; `units`: the prompt's spans (a span's
    positions all use their experts at its step, p0 * L + layer)."""
    first = {}
    p0 = 0
    for T in units:
        for t in range(T):
            first[p0 + t] = p0
        p0 += T
    uses: dict[tuple[int, int], list[int]] = {}
    for pos, ids in enumerate(future):
        for li in range(L):
            for e in ids[li].tolist():
                steps = uses.setdefault((li, e), [])
                st = first.get(pos, pos) * L + li
                if not steps or steps[-1] != st:
                    steps.append(st)

    def next_use(key, now):
        steps = uses.get(key, [])
        j = bisect.bisect_right(steps, now)
        return steps[j] if j < len(steps) else float("inf")
    return next_use


def write_events(path: Path, log: EventLog) -> None:
    """A run's event log (every prompt's lines) into one file, atomically."""
    from toolkit.artifacts import atomic_write_text

    atomic_write_text(path, "\n".join(log.lines) + "\n")
