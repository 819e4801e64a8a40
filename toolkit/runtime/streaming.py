"""The Python streaming runtime (`specprefetch run`): the real model, experts only from the store.

The model's dense part (embeddings, attention, norms, routers, head) runs in transformers as usual;
each MoE layer's `experts` module is replaced by `StreamingExperts`, which owns no weights: for the
experts the router picked it asks the scheduler for pool slots (hits, prefetches still in flight,
or on-demand O_DIRECT reads), computes each expert from its slot's blob, and releases the slots.
At every MoE layer the predictor's window is planned first, so reads for the next steps overlap
this layer's expert compute and the next layer's attention. The experts are dropped from the
loaded model before the first token, so all experts are never in memory while it runs.

Output equality is by construction: the expert computation mirrors transformers' eager experts
(same ops, same expert order), so tokens equal the unmodified model's whatever the policy.
"""
from __future__ import annotations

import bisect
import dataclasses
import gc
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from toolkit.errors import SpecPrefetchError
from toolkit.metrics import hit_rate, tpot_ms
from toolkit.models.loader import LoadedModel, load_dense_model, load_model
from toolkit.traces.batches import RoutingBatch
from toolkit.runtime.expert_store import ExpertStore, build_store, dequantize
from toolkit.runtime.io import DirectReader, ProcessReader
from toolkit.runtime.pool import ExpertPool
from toolkit.runtime.scheduler import SchedulerConfig, WindowScheduler

RUN_PREDICTORS = ("on-demand", "next-gate", "fate", "previous-token", "frequency", "adapter", "draft", "oracle")


class RuntimeDraft:
    """The Specter-style draft in the runtime: an int4-expert copy of the model run teacher-forced
    over the prompt and the reference tokens (under greedy speculative decoding the accepted
    tokens are the target's), so its routing at each (token, layer) is known ahead, as it would be
    K tokens ahead of verification. Its own compute is not charged to the run (the report says
    so): this measures what its predictions are worth to the pool, not the cost of running it."""
    name = "draft"

    def __init__(self, lm: LoadedModel, L: int):
        from toolkit.predictors.draft import make_draft

        self.draft = make_draft(lm)
        self.lm, self.L = lm, L
        self.scores_by_tok: list[torch.Tensor] = []

    def prepare(self, prompt_ids: list[int], ref_tokens: list[int]) -> None:
        from toolkit.models.families import selection_scores
        from toolkit.traces.capture import RouterRecorder

        lm = dataclasses.replace(self.lm, model=self.draft)
        rec = RouterRecorder(lm)
        try:
            with torch.no_grad():
                self.draft(input_ids=torch.tensor([prompt_ids + ref_tokens]))
            t = rec.stacked()
        finally:
            rec.close()
        spec = self.lm.geometry.routing
        sc = torch.stack([selection_scores(t["logits"][:, li], spec, self._bias(li)) for li in range(self.L)], 1)
        p = len(prompt_ids)
        # forward call 0 (prefill) ends at position p-1; decode call n consumes position p-1+n
        self.scores_by_tok = [sc[p - 1 + n] for n in range(sc.shape[0] - p + 1)]

    def _bias(self, li):
        sb = self.lm.family.router_params(self.draft, self.lm.geometry.moe_layers[li])[2]
        return sb.detach().float() if sb is not None else None

    def scores(self, b, i, h):
        tok = int(b.pos[0]) + (i + h) // self.L
        if tok >= len(self.scores_by_tok):
            return torch.zeros(1, self.lm.geometry.routing.num_experts)
        return self.scores_by_tok[tok][(i + h) % self.L].unsqueeze(0)


@dataclasses.dataclass
class RunConfig:
    predictor: str = "adapter"
    eviction: str = "lru"
    pool_mib: float = 8.0
    window: int = 2
    queue_depth: int = 4
    min_confidence: float = 0.02
    floor: float = 0.0
    step_budget_kib: int | None = None
    flash_profile: str | None = None
    adapter: Path | None = None
    frequency_trace: Path | None = None   # the frequency predictor's counts come from this trace
    verify: bool = True
    io: str = "process"   # "process": reader process (default); "threads": reader threads in-process

    @property
    def policy(self) -> str:
        return f"{self.predictor}+{self.eviction}"


class StreamingExperts(nn.Module):
    """Stands in for a MoE layer's experts; computes from pool slots."""

    def __init__(self, runtime: "StreamingRuntime", li: int, act, gpt_oss: bool):
        super().__init__()
        self.rt, self.li, self.act, self.gpt_oss = runtime, li, act, gpt_oss

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.rt.moe_layer(self, hidden_states, top_k_index, top_k_weights)


class StreamingRuntime:
    def __init__(self, lm: LoadedModel, store: ExpertStore, cfg: RunConfig):
        self.lm, self.store, self.cfg = lm, store, cfg
        g = lm.geometry
        self.L, self.k, self.E = len(g.moe_layers), g.routing.top_k, g.routing.num_experts
        self.budget = int(cfg.pool_mib * 2**20)
        gpt_oss = lm.family.name == "gpt_oss"
        tc = lm.family.text_config(lm.spec.config)
        from transformers.activations import ACT2FN
        act = ACT2FN[getattr(tc, "hidden_act", "silu")]
        for li, layer in enumerate(g.moe_layers):
            block = lm.family.moe_block(lm.model, layer)
            block.experts = StreamingExperts(self, li, act, gpt_oss)  # the expert weights go
        gc.collect()
        self.profile = None
        if cfg.flash_profile:
            from toolkit.runtime.profiles import load_profile
            self.profile = load_profile(cfg.flash_profile)
        self.predictor = self._predictor()
        secs = {s.role: s for s in store.sections}
        self.fp16_sections = (secs.get("gate"), secs.get("up"), secs.get("down"))
        if store.dtype == "fp16" and not gpt_oss:
            g, u = self.fp16_sections[:2]
            assert g.offset + g.nbytes == u.offset, "fp16 gate and up sections must be adjacent"
        self.reference: list[torch.Tensor] | None = None  # per forward call: ids [T, L, k]
        self.reference_tokens: list[int] | None = None

    def _predictor(self):
        from toolkit.models.routers import load_router_bank
        from toolkit.predictors.base import FateStyle, NextGate, Oracle, PreviousToken

        p = self.cfg.predictor
        if p not in RUN_PREDICTORS:
            raise SpecPrefetchError(f"--policy predictor {p!r}: choose from {', '.join(RUN_PREDICTORS)}")
        if p == "on-demand":
            return None
        bank = load_router_bank(self.lm.spec)
        if p == "next-gate":
            return NextGate(bank)
        if p == "fate":
            return FateStyle(bank)
        if p == "previous-token":
            return PreviousToken(self.E)
        if p == "oracle":
            return Oracle(self.E)
        if p == "frequency":
            from toolkit.predictors.base import Frequency
            from toolkit.predictors.evaluate import frequency_counts
            from toolkit.traces.format import TraceReader

            if self.cfg.frequency_trace is None:
                raise SpecPrefetchError("the frequency policy needs --frequency-trace TRACE (its counts)")
            return Frequency(frequency_counts(TraceReader(self.cfg.frequency_trace)))
        if p == "draft":  # built from an unmodified copy: this model's experts are streamed
            if getattr(self, "_draft", None) is None:
                self._draft = RuntimeDraft(load_model(self.lm.spec.path), self.L)
            return self._draft
        from adapters.checkpoint import load_adapter
        from toolkit.predictors.base import AdapterPredictor

        if self.cfg.adapter is None:
            raise SpecPrefetchError("the adapter policy needs --adapter DIR")
        adapter, _ = load_adapter(self.cfg.adapter, self.lm.spec)
        return AdapterPredictor(adapter, bank)

    # -- per generation state ------------------------------------------------------------
    def set_reference(self, tokens: list[int], routing: list[torch.Tensor]) -> None:
        """The unmodified model's greedy tokens and routing for the next prompt: the oracle's and
        Belady's future, and the tokens the draft runs over."""
        self.reference_tokens, self.reference = tokens, routing

    def _start(self) -> None:
        cfg = self.cfg
        self.pool = ExpertPool(self.budget, self.store.slot_bytes, policy=cfg.eviction, min_slots=self.k,
                               next_use=self._next_use)
        scfg = SchedulerConfig(window=cfg.window, queue_depth=cfg.queue_depth, min_confidence=cfg.min_confidence,
                               floor=cfg.floor,
                               step_budget_bytes=cfg.step_budget_kib * 1024 if cfg.step_budget_kib else None,
                               prefetch=self.predictor is not None)
        self.sched = WindowScheduler(self.pool, self.io, scfg, num_layers=self.L, top_k=self.k)
        self._prepare_linear()
        self.tok = 0
        self.stall_s = 0.0
        self.hidden_buf = torch.zeros(1, self.L, self.lm.geometry.hidden_size)
        self.ids_buf = torch.zeros(1, self.L, self.k, dtype=torch.long)
        self.prev_ids = torch.zeros(1, self.L, self.k, dtype=torch.long)
        if self.reference is not None:
            self.future: dict[tuple[int, int], list[int]] = {}
            for tok, ids in enumerate(self.reference):
                for li in range(self.L):
                    for e in torch.unique(ids[:, li]).tolist():
                        self.future.setdefault((li, e), []).append(tok * self.L + li)
        if cfg.io == "process":
            slots = min(self.pool.capacity, self.L * self.E)  # never more slots than experts exist
            self.io = ProcessReader(self.store, slots=slots, workers=cfg.queue_depth + 1,
                                    profile=self.profile, verify=cfg.verify)
            self.pool.on_evict = self.io.release
        elif cfg.io == "threads":
            self.io = DirectReader(self.store, workers=cfg.queue_depth, profile=self.profile, verify=cfg.verify)
        else:
            raise SpecPrefetchError(f"--io {cfg.io!r}: choose process or threads")
        self.sched.io = self.io  # the reader comes last, so nothing before it can leak a process

    def _next_use(self, key, now):
        if self.cfg.eviction == "belady":
            if self.reference is None:
                raise SpecPrefetchError("belady eviction needs a reference pass (it is the oracle bound)")
            steps = self.future.get(key, [])
            j = bisect.bisect_right(steps, now)
            return steps[j] if j < len(steps) else float("inf")
        return self.sched.next_predicted_use(key, now)

    def _context(self) -> RoutingBatch:
        tok = self.tok
        ids, next_ids, has_next = self.ids_buf, torch.zeros_like(self.ids_buf), torch.tensor([False])
        if self.cfg.predictor == "oracle":  # only the oracle may see the future
            ref = self.reference
            ids = ref[tok][-1:] if tok < len(ref) else ids
            if tok + 1 < len(ref):
                next_ids, has_next = ref[tok + 1][-1:], torch.tensor([True])
        return RoutingBatch(hidden=self.hidden_buf, ids=ids, next_ids=next_ids, prev_ids=self.prev_ids,
                            has_next=has_next, has_prev=torch.tensor([tok > 0]), probs=None,
                            next_probs=None, seq=torch.tensor([0]), pos=torch.tensor([tok]),
                            kind=torch.tensor([1]))

    def _prepare_linear(self) -> None:
        """Fold linear predictors (next-gate, FATE, adapter) into one [W*E, H] matrix per source
        layer, so a whole window is one matmul on the hot path."""
        self.linear = None
        p = self.predictor
        if p is None or not hasattr(p, "effective_router"):
            return
        bank = p.bank
        if bank.score_bias is not None or (bank.spec.n_group or 0) > 1 or bank.spec.topk_before_softmax:
            return  # selection needs the family rule per target: use the general path
        W, E = self.cfg.window, self.E
        self.linear = []
        for i in range(self.L):
            mats, srcs, biases = [], [], []
            for h in range(1, W + 1):
                m, src = p.effective_router(i, h)
                mats.append(m)
                srcs.append(src)
                biases.append(bank.bias[(i + h) % self.L] if bank.bias is not None else torch.zeros(E))
            self.linear.append((torch.cat(mats).contiguous(), srcs, torch.cat(biases)))

    def _plan(self, li: int, step: int) -> None:
        W = self.cfg.window
        targets = [step + h for h in range(1, W + 1)]
        if self.linear is not None:
            mat, srcs, bias = self.linear[li]
            x = self.hidden_buf[0, srcs[0]]
            logits = (mat @ x + bias).view(W, self.E)
            spec = self.predictor.bank.spec
            probs = logits.sigmoid() if spec.score_func == "sigmoid" else logits.softmax(-1)
            self.sched.plan_probs(step, targets, probs)
            return
        b = self._context()
        self.sched.plan(step, [(t, self.predictor.scores(b, li, h)[0]) for h, t in enumerate(targets, 1)])

    def moe_layer(self, mod: StreamingExperts, hidden, top_k_index, top_k_weights):
        li = mod.li
        step = self.tok * self.L + li
        self.hidden_buf[0, li] = hidden[-1].detach().float()
        self.ids_buf[0, li] = top_k_index[-1].long()
        final = torch.zeros_like(hidden)
        hit = sorted(torch.unique(top_k_index).tolist())
        keys = [(li, e) for e in hit]
        groups = [keys] if len(keys) <= self.pool.capacity else [[k] for k in keys]
        planned = self.predictor is None
        for grp in groups:
            t0 = time.perf_counter()
            waiting = self.sched.acquire(step, grp)  # demand reads go out first
            stall = time.perf_counter() - t0
            if not planned:  # then prefetch for the next steps; this layer's experts are pinned
                self._plan(li, step)
                planned = True
            t0 = time.perf_counter()
            for key in waiting:
                self.sched.wait_ready(key)
            stall += time.perf_counter() - t0
            if self.tok > 0:  # decode tokens only: prefill's reads count in TTFT
                self.stall_s += stall
            for key in grp:
                self._compute(mod, key, hidden, top_k_index, top_k_weights, final)
            self.sched.release(step, grp)
        if li == self.L - 1:
            self.prev_ids = self.ids_buf.clone()
            self.tok += 1
        return final

    def _weights(self, slot) -> dict[str, torch.Tensor]:
        """The expert's float32 matrices from its blob; fp16 stores convert in torch, with gate and
        up (adjacent sections) converted as one [2I, H] matrix."""
        if self.store.dtype != "fp16" or self.lm.family.name == "gpt_oss":
            return dequantize(memoryview(slot.buffer)[: self.store.blob_size], self.store.sections,
                              self.store.shapes)
        raw = torch.frombuffer(slot.buffer, dtype=torch.float16, count=self.store.blob_size // 2)
        g, u, d = self.fp16_sections
        gate_up = raw[g.offset // 2:(u.offset + u.nbytes) // 2].view(2 * g.shape[0], g.shape[1]).float()
        down = raw[d.offset // 2:(d.offset + d.nbytes) // 2].view(d.shape).float()
        return {"gate_up": gate_up, "down": down}

    def _compute(self, mod, key, hidden, top_k_index, top_k_weights, final) -> None:
        slot = self.pool.get(key)
        w = self._weights(slot)
        e = key[1]
        # the same ops, in the same order, as transformers' eager experts
        mask = (top_k_index == e).t()                      # [k, T] like expert_mask[e]
        top_k_pos, token_idx = torch.where(mask)
        x = hidden[token_idx]
        if mod.gpt_oss:
            out = self.lm.family.expert_forward(w, x.float(), None).to(hidden.dtype)
        else:
            gate_up = (w["gate_up"] if "gate_up" in w else torch.cat([w["gate"], w["up"]], 0)).to(hidden.dtype)
            gate, up = nn.functional.linear(x, gate_up).chunk(2, dim=-1)
            out = nn.functional.linear(mod.act(gate) * up, w["down"].to(hidden.dtype))
        out = out * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, out.to(final.dtype))

    # -- generation ----------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        from transformers import DynamicCache

        if isinstance(self.predictor, RuntimeDraft):
            if self.reference_tokens is None:
                raise SpecPrefetchError("the draft policy needs the reference pass (run it through `run`)")
            self.predictor.prepare(prompt_ids, self.reference_tokens)
        eos = self.lm.tokenizer.eos_token_id
        self.io = None
        try:
            self._start()
            cache = DynamicCache(config=self.lm.model.config)
            t0 = time.perf_counter()
            out = self.lm.model(input_ids=torch.tensor([prompt_ids]), past_key_values=cache, use_cache=True)
            nxt = int(out.logits[0, -1].argmax())
            times = [time.perf_counter()]
            tokens = [nxt]
            prefill = dataclasses.replace(self.sched.stats)  # decode figures are deltas from here
            while len(tokens) < max_new_tokens and nxt != eos:
                out = self.lm.model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
                nxt = int(out.logits[0, -1].argmax())
                tokens.append(nxt)
                times.append(time.perf_counter())
        finally:
            if self.io is not None:
                self.io.close()
        total = self.sched.stats
        st = type(total)(**{f.name: getattr(total, f.name) - getattr(prefill, f.name)
                            for f in dataclasses.fields(total)})
        decode_tokens = max(1, len(tokens) - 1)
        iv = np.diff(times) * 1e3 if len(times) > 1 else np.zeros(1)
        return {
            "policy": self.cfg.policy, "tokens": tokens,
            "ttft_ms": round((times[0] - t0) * 1e3, 3),
            "tpot_ms": round(tpot_ms(times), 3),
            "tpot_p50_ms": round(float(np.percentile(iv, 50)), 3),
            "tpot_p95_ms": round(float(np.percentile(iv, 95)), 3),
            "stall_ms_per_token": round(self.stall_s / decode_tokens * 1e3, 3),
            "hit_rate": round(hit_rate(st.hits, st.requests), 4),
            "late_rate": round(hit_rate(st.late, st.requests), 4),
            "mib_read": round(total.bytes_read / 2**20, 3),
            "mib_read_per_token": round(st.bytes_read / 2**20 / decode_tokens, 4),
            "wasted_prefetch_mib": round((self.pool.wasted_prefetches + sum(
                1 for s in self.pool.slots.values() if s.prefetched)) * self.pool.slot_bytes / 2**20, 3),
            "peak_pool_bytes": self.pool.peak_bytes, "budget_bytes": self.budget,
            "direct_io": self.io.direct, "emulated_flash": self.cfg.flash_profile,
            **({"note": "draft routing precomputed teacher-forced; the draft's own compute is not charged"}
               if isinstance(self.predictor, RuntimeDraft) else {}),
            "decode_tokens": decode_tokens,
            "counts": dataclasses.asdict(st),
            "prefill_counts": dataclasses.asdict(prefill),
        }


def default_store_path(lm: LoadedModel, dtype: str) -> Path:
    from toolkit.runtime.profiles import profile_dir

    return profile_dir().parent / "stores" / f"{lm.spec.config_hash}-{dtype}.spx"


def reference_generate(lm: LoadedModel, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens of the unmodified model, and its routing per forward call ([T, L, k])."""
    from toolkit.traces.capture import RouterRecorder

    rec = RouterRecorder(lm)
    try:
        eos = lm.tokenizer.eos_token_id
        out = lm.model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new_tokens,
                                pad_token_id=eos if eos is not None else 0)
        per_layer = rec.calls  # [L][calls] of (hidden, logits, weights, ids)
        n_calls = len(per_layer[0])
        routing = [torch.stack([per_layer[li][c][3].long() for li in range(len(per_layer))], 1)
                   for c in range(n_calls)]
    finally:
        rec.close()
    return out[0, len(prompt_ids):].tolist(), routing


def open_runtime(model: str | Path, cfg: RunConfig, *, store: Path | None = None, dtype: str = "fp16",
                 progress: bool = True) -> tuple[StreamingRuntime, LoadedModel]:
    """(runtime, an unmodified copy of the model for the reference pass)."""
    ref = load_model(model)
    path = store or default_store_path(ref, dtype)
    if not Path(path).exists():
        build_store(ref.spec, Path(path), dtype, progress=progress)
    st = ExpertStore(path, ref.spec)
    dense = dataclasses.replace(ref, model=load_dense_model(ref.spec))  # experts never loaded
    rt = StreamingRuntime(dense, st, cfg)
    return rt, ref
