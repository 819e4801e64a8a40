"""What knowledge of the future buys an eviction: reads per decode token on a trace's routing.

Every position of each held-out sequence goes through a bounded pool one MoE layer at a time (a step
is one layer of one position; misses read on demand, no prefetch), with these evictions:

- `lru`, and `reuse` (toolkit/runtime/reuse.py: histories and the table learned from the train split);
- `reuse-freq`: `reuse` with one table per frequency class of experts (each layer's experts in quarters
  by how often the train split routes to them, a table learned from each quarter's samples, a history
  a quarter never shows taking `reuse`'s entry: adapters/reuse.py), so a hot expert and a cold one
  with the same recent history are told apart (what `train` learns by default);
- Belady's rule knowing the real routing only so far ahead: `belady-token` (the rest of the current
  token), `belady-next-token` (and all of the next token), `belady-next-2-tokens` and
  `belady-next-4-tokens` (and the next 2 or 4 tokens: what a look-ahead of several tokens, a draft's,
  could know at best), and `belady` (everything); beyond what it knows, each variant scores by the
  reuse rule.

`belady` is what the oracle policy's eviction knows, and its reads are the fewest any on-demand
eviction can have (Belady's rule is optimal; counted at decode positions only, that holds in
practice, not as a theorem). The partial ones are estimates, not bounds: what exact knowledge of
the current token's later layers, or also of the next one, two or four tokens', buys with the reuse
rule beyond it (a better rule past the horizon could read less; an engine cannot know later tokens' routing
exactly, only predict it, or draft those tokens and read the draft's routing). What they say is how
much of the oracle's advantage lies in knowledge of tokens after the next one, which only a predictor
of the longer future (as the reuse table is) can recover in part.

More rules know each MoE layer's *next visits* only (the next tokens' routing at that layer, as seen
from the layer's latest visit), and past it score by the reuse rule with the history one unused visit
on: `next-visit` knows it exactly (a ceiling), `adapter-next-visit` predicts it with the adapter's
next-visit heads (`train --next-visits N`): an expert among the heads' largest scores at that layer
(toolkit/runtime/reuse.py, `next_visit_size`: 2k, at most the layer's share of the pool) counts as
used at the first of the layer's next N visits that predicts it, else the reuse rule scores it with the
history N unused visits on (a visit whose router input the trace did not store falls back to the reuse
rule); `adapter-next-visit-freq` the same with `reuse-freq`'s tables (as the runners do with an adapter
trained with the default `--reuse-classes 4`, its tables learned here from the same train split). The
adapter rules need `--adapter`, trained with those heads; with N > 1, `next-visits-N` is their exact
ceiling (the real routing of the next N visits as the sets).

`draft-lookahead-D` (`--draft-lookahead D,...`) knows what a self-draft tells: at each decode position
the model drafts D positions from there (the current one and D - 1 more tokens, greedily from the real
prefix) with every MoE layer computing only the experts the pool holds at that moment (the family's
selection among them; fewer than k held: those; none: the layer's own choice), so the draft reads
nothing, and each drafted layer's own router top-k (unrestricted) is taken as that layer's
use at that position; Belady's rule on those predictions, the reuse rule past them (at the prompt's
positions the real routing, as `belady-*` of the same horizon knows it). It is what a
draft that costs no memory (the pool's own experts) could buy an eviction; the draft's compute, D model
steps a token, is not counted. Its model runs in float32 on `--device` (the CPU by default; `--model`,
default the trace's), text traces only.

Reads are counted at decode positions, the prompt's positions filling the pool first one position a
step (the runners prefill in spans, one step per span and layer, and `simulate` replays decode
tokens only: these figures compare with each other, not with theirs). Rules are on demand (no
window predictions: `reuse` is history only). No timing: bytes only (`reads x slot bytes`).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from adapters.reuse import SCALE, learn_class_reuse_table
from toolkit.errors import SpecPrefetchError
from toolkit.runtime.pool import ExpertPool
from toolkit.runtime.reuse import ReuseHistory, next_visit_experts, next_visit_size
from toolkit.runtime.runner import belady_next_use
from toolkit.traces.format import DECODE, IMAGE, TraceReader, routing_sequences, trace_model_spec

# Belady's rule knowing the real routing this many tokens ahead (the current token counts as 1); None: all
HORIZONS = {"belady-token": 1, "belady-next-token": 2, "belady-next-2-tokens": 3, "belady-next-4-tokens": 5,
            "belady": None}
RULES = ("lru", "reuse", "reuse-freq", *HORIZONS, "next-visit")
EXACT_VISITS = "next-visits-"   # + N: the exact sets of the next N visits (an adapter with N > 1 heads)
DRAFT_RULE = "draft-lookahead-"   # + D: the self-draft's look-ahead (LookaheadDraft)
ADAPTER_RULE = "adapter-next-visit"
ADAPTER_RULES = (ADAPTER_RULE, "adapter-next-visit-freq")
CLASS_RULES = ("reuse-freq", "adapter-next-visit-freq")   # read the frequency-class table


def exact_next_sets(ids: np.ndarray, visits: int = 1) -> dict[tuple[int, int], list[set[int]]]:
    """The real next `visits` visits (as many as the sequence has) of every (position, layer) of one sequence
    [positions, L, k]: the `next-visit` rule (one), `next-visits-N` (N)."""
    N, L = ids.shape[0], ids.shape[1]
    return {(p, li): [set(ids[q, li].tolist()) for q in range(p + 1, min(N, p + 1 + visits))]
            for p in range(N - 1) for li in range(L)}


def replay(ids: np.ndarray, kinds: np.ndarray, capacity: int, rule: str, table,
           true_next: Callable[[tuple[int, int], int], float] | None = None,
           reads_out: list | None = None,
           next_sets: dict[tuple[int, int], set[int]] | None = None,
           draft: "LookaheadDraft | None" = None) -> tuple[int, int]:
    """(reads at decode positions, decode positions) of one sequence [positions, L, k] under `rule`.
    `true_next`: the sequence's real next use (belady_next_use of it; built here if not given);
    `reads_out`: gets (layer, [experts read]) of every decode step that reads (`bench reads`);
    `next_sets`: the next-visit sets for ADAPTER_RULES (the adapter's) and `next-visit`, `next-visits-N` (the
    real ones; built here for `next-visit` if not given): {(position, layer): the experts layer `layer`
    routes to at position + 1, + 2, ..., as predicted at `position`}; `table`: the reuse table (with
    frequency classes for CLASS_RULES); `draft`: the sequence's LookaheadDraft for `draft-lookahead-D`."""
    N, L, k = ids.shape
    drafted = rule.startswith(DRAFT_RULE)
    if true_next is None and (rule.startswith("belady") or drafted):
        true_next = belady_next_use(list(ids), L)
    if rule in CLASS_RULES and (table is None or table.classes is None):
        raise SpecPrefetchError(f"eviction rule {rule!r} needs a reuse table with frequency classes")
    if rule not in CLASS_RULES and table is not None:
        table = table.whole()   # the other rules score by the whole table
    hist = ReuseHistory(table, L) if rule != "lru" and rule != "belady" else None  # the rules that read it
    # the adapter's ranked lists cut as the runners cut them (at most 2k: E does not bind); exact sets whole
    cut = next_visit_size(k, 2 * k, capacity, L) if rule in ADAPTER_RULES else None
    exact_visits = rule.startswith(EXACT_VISITS)
    if rule == "next-visit" and next_sets is None:
        next_sets = exact_next_sets(ids)
    elif (rule in ADAPTER_RULES or exact_visits) and next_sets is None:
        raise SpecPrefetchError(f"eviction rule {rule!r} needs the next visits' sets")
    elif rule not in ("next-visit", *ADAPTER_RULES) and not exact_visits:
        next_sets = None  # the other rules know no next visit

    if drafted and (draft is None or rule != f"{DRAFT_RULE}{draft.D}"):
        raise SpecPrefetchError(f"eviction rule {rule!r} needs the sequence's draft of that look-ahead")
    horizon = draft.D if drafted else HORIZONS.get(rule)
    known: dict[tuple[int, int], set[int]] = {}   # the draft's: (position, layer) -> experts

    def drafted_next(key, now) -> float:
        li, e = key
        p = now // L
        for q in range(p, p + horizon):
            t = q * L + li
            if t > now and e in known.get((q, li), ()):
                return t
        return float("inf")

    def next_use(key, now) -> float:
        """A step (in sixteenths) for the pool's belady rule: exact (the draft's rule: as drafted, at decode
        positions) as far as the rule knows, else the reuse rule's estimate past that point."""
        t = drafted_next(key, now) if drafted and kinds[now // L] == DECODE else true_next(key, now)
        lim = None if horizon is None else (now // L + horizon) * L
        if t != float("inf") and (lim is None or t < lim):
            return float(t * SCALE)
        if lim is None:
            return float("inf")
        # not used before `lim`: its layer's first visit from there on, plus the table's estimate for
        # the history those unused visits leave
        v0 = now + ((key[0] - now % L) % L or L)
        v = v0
        while v < lim:
            v += L
        h = (hist.hist[key[0]].get(key[1], 0) << ((v - v0) // L)) & hist.mask
        return float(v * SCALE + L * (table.visits16[h] - SCALE))

    if rule == "lru":
        pool = ExpertPool(capacity, 1, policy="lru", min_slots=k)
    elif rule in ("reuse", "reuse-freq", "next-visit", *ADAPTER_RULES) or exact_visits:
        # (the next-visit rules: the runners' ReuseHistory.set_next_visits after the step's acquire, below)
        pool = ExpertPool(capacity, 1, policy="reuse", min_slots=k)
        pool.reuse, pool.predicted = hist, None
    elif rule in RULES or drafted:
        pool = ExpertPool(capacity, 1, policy="belady", min_slots=k, next_use=next_use)
    else:
        raise SpecPrefetchError(f"eviction rule {rule!r}: choose from {', '.join((*RULES, *ADAPTER_RULES))} "
                                f"or {DRAFT_RULE}D")
    reads = decode = 0
    for p in range(N):
        if drafted and kinds[p] == DECODE:   # the draft from here, on the experts the pool holds now
            held = np.zeros((L, draft.E), bool)
            for key in pool.slots:
                held[key] = True
            known = draft.predict(p, held)
        for li in range(L):
            now = p * L + li
            keys = [(li, int(e)) for e in ids[p, li]]
            if hist is not None:
                hist.observe(now, keys)
            missed = []
            for key in keys:
                s = pool.get(key)
                if s is None:
                    s = pool.reserve(key, now, prefetch=False, protect=set(keys))
                    s.ready = True
                    missed.append(key[1])
                s.pins += 1
            if next_sets is not None and (p, li) in next_sets:  # after the step's acquire, as the runners
                hist.set_next_visits(li, now + L, [s if cut is None else s[:cut] for s in next_sets[(p, li)]])
            if kinds[p] == DECODE:
                reads += len(missed)
                if reads_out is not None and missed:
                    reads_out.append((li, missed))
            for key in keys:
                s = pool.get(key)
                s.pins -= 1
                pool.touch(s, now)
        decode += int(kinds[p] == DECODE)
    return reads, decode


def adapter_next_sets(reader: TraceReader, adapter: Path, seq_ids: list[int], spec,
                      bank) -> tuple[int, list[dict[tuple[int, int], list[list[int]]]]]:
    """(N, the adapter's next-visit heads; per held-out sequence (in `seq_ids`' order): {(position, layer):
    for each of the layer's next N visits (positions + 1, ..., + N) the 2k experts its head scores highest,
    highest first (replay keeps next_visit_size of them)}, at every position whose router input the trace
    stored). `spec`, `bank`: the trace's model (trace_model_spec) and its routers."""
    import torch

    from adapters.checkpoint import load_adapter

    ad, _ = load_adapter(Path(adapter), spec)
    if not ad.next_visit:
        raise SpecPrefetchError(f"--adapter {adapter}: it has no next-visit heads (train it with --next-visits N)")
    L, M = ad.num_layers, min(ad.num_experts, 2 * reader.top_k)
    where = {q: n for n, q in enumerate(seq_ids)}
    out: list[dict[tuple[int, int], list[list[int]]]] = [{} for _ in seq_ids]
    with torch.no_grad():
        for a in reader.iter_hidden("heldout"):
            keep = np.array([int(q) in where for q in a["seq"]], bool)
            if not keep.any():
                continue
            x = torch.from_numpy(a["hidden"][keep].astype(np.float32))          # [M, L, H]
            seq, pos = a["seq"][keep], a["pos"][keep]
            for li in range(L):  # ranked by raw logit, the lower id first among equals (as the runners)
                tops = [next_visit_experts(ad.logits(bank, x[:, li], li, j * L), M).numpy()     # [rows, 2k]
                        for j in range(1, ad.next_visits + 1)]
                for r in range(len(seq)):
                    out[where[int(seq[r])]][(int(pos[r]), li)] = [t[r].tolist() for t in tops]
    return ad.next_visits, out


class DraftModel:
    """The model (float32, on `device`) with a hook on every MoE router: records each call's own top-k,
    and, while `held` is set ([L, E] bools), replaces the router's choice by the family's selection among
    the held experts (their scores and weights by the family's rule; fewer than k held: those, the other
    entries at weight 0; a group-limited router's groups are its own choice, held experts of other groups
    filling in where its groups hold fewer than k; a layer holding none keeps its own choice). A context
    manager: its hooks are removed on leaving."""

    def __init__(self, spec, device: str = "cpu", bank=None):
        """`device`: cpu, cuda or cuda:N (checked by the caller); `bank`: the model's routers
        (load_router_bank; loaded here if not given)."""
        import torch

        from toolkit.models.families import expert_weights
        from toolkit.models.loader import load_model
        from toolkit.models.routers import load_router_bank

        self.device = device
        self.lm = load_model(spec.path, device=device, dtype="float32")
        self.lm.model.eval()
        bank = bank or load_router_bank(spec)   # (its score bias, if any, on the host: the hook selects there)
        self.threads: int | None = None
        layers = list(self.lm.geometry.moe_layers)
        self.L, self.k = len(layers), spec.geometry.routing.top_k
        self.E = spec.geometry.routing.num_experts
        self.held: np.ndarray | None = None
        self.rec: list[list] = [[] for _ in layers]

        def hook(li: int):
            def h(module, args, out):
                logits, w, ids = out[:3]
                self.rec[li].append(ids.detach().reshape(-1, self.k).clone())
                if self.held is None or not self.held[li].any():
                    return None
                lg = logits.detach().reshape(-1, self.E).float().cpu()
                sc = bank.selection_scores(lg, li).masked_fill(~torch.from_numpy(self.held[li]), float("-inf"))
                top = sc.topk(self.k, -1)
                ww = torch.zeros(top.indices.shape)
                for r in range(len(lg)):   # the family's weights over the held experts chosen (fewer than k: those)
                    ok = top.values[r] > float("-inf")
                    ww[r, ok] = expert_weights(lg[r:r + 1], top.indices[r:r + 1, ok], bank.spec)[0]
                return (logits, ww.to(w.device, w.dtype).reshape(w.shape),
                        top.indices.to(ids.device, ids.dtype).reshape(ids.shape), *out[3:])
            return h

        self.hooks = [self.lm.family.router(self.lm.model, layer).register_forward_hook(hook(i))
                      for i, layer in enumerate(layers)]

    def forward(self, cache, tokens: list[int], pos: int, held: np.ndarray | None = None):
        """(the greedy next token, each position's own top-k per MoE layer [T, L, k]) of `tokens` at
        positions pos.. into `cache`, computing with the `held` experts only where given."""
        import torch

        self.held, self.rec = held, [[] for _ in range(self.L)]
        try:
            with torch.no_grad():
                dev = self.device
                out = self.lm.model(input_ids=torch.tensor([tokens], device=dev), past_key_values=cache,
                                    use_cache=True, position_ids=torch.arange(pos, pos + len(tokens), device=dev)[None])
        finally:
            self.held = None
        return int(out.logits[0, -1].argmax()), torch.stack([torch.cat(r) for r in self.rec], 1).cpu()

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        if self.threads is not None:
            import torch

            torch.set_num_threads(self.threads)
            self.threads = None

    def __enter__(self) -> "DraftModel":
        """One compute thread while inside (one-token steps of a small model: threads cost more than they
        give), the process's again on leaving."""
        import torch

        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LookaheadDraft:
    """One sequence's self-draft for `draft-lookahead-D`: its real positions in the model's KV cache, and
    at each decode position p the D positions p.. drafted on the held experts (the cache rolled back
    after), then position p itself."""

    def __init__(self, model: DraftModel, tokens: list[int], D: int):
        from transformers import DynamicCache

        self.model, self.tokens, self.D, self.E = model, tokens, D, model.E
        self.cache = DynamicCache()
        self.done = 0   # positions in the cache

    def predict(self, p: int, held: np.ndarray) -> dict[tuple[int, int], set[int]]:
        """{(position, layer): the layer's own top-k there} for positions p .. p + D - 1, drafted from
        the real positions before p on the `held` experts ([L, E] bools)."""
        m = self.model
        if self.done < p:   # the prompt (and any position not drafted from) in one pass
            m.forward(self.cache, self.tokens[self.done:p], self.done)
            self.done = p
        out: dict[tuple[int, int], set[int]] = {}
        tok = self.tokens[p]
        for j in range(self.D):
            tok, ids = m.forward(self.cache, [tok], p + j, held)
            out.update({(p + j, li): set(ids[0, li].tolist()) for li in range(m.L)})
        self.cache.crop(p - self.cache.get_seq_length())   # the drafted positions off (crop(p) is deprecated)
        m.forward(self.cache, [self.tokens[p]], p)
        self.done = p + 1
        return out


def eviction_bounds(trace: Path, pool_fracs: list[float], *, max_sequences: int | None = None,
                    adapter: Path | None = None, model: str | Path | None = None,
                    draft_lookahead: Sequence[int] = (), device: str = "cpu",
                    progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The report: reads per decode token of every rule at every pool; `draft_lookahead`: the look-aheads
    D of the `draft-lookahead-D` rules (the model's self-draft, above), whose model runs on `device`."""
    for frac in pool_fracs:
        if not 0 < frac <= 1:
            raise SpecPrefetchError(f"--pool-frac {frac}: a share of the experts in (0, 1]")
    if draft_lookahead:   # before any work (click's IntList refuses 0 on the command line: the API's check)
        from toolkit.traces.batches import check_device

        if min(draft_lookahead) < 1:
            raise SpecPrefetchError(f"--draft-lookahead {min(draft_lookahead)}: positions drafted, at least 1")
        check_device(device)
    reader = TraceReader(trace)
    rows = routing_sequences(reader, "heldout", with_kind=True, with_tokens=bool(draft_lookahead))[:max_sequences]
    seqs = [(r[0], r[1]) for r in rows]
    tokens = [r[2].tolist() for r in rows] if draft_lookahead else []
    if draft_lookahead and any((kinds == IMAGE).any() for _, kinds in seqs):
        raise SpecPrefetchError(f"--draft-lookahead: trace {trace}'s held-out sequences hold image positions; "
                                "the draft replays text prompts only")
    if not seqs:
        raise SpecPrefetchError(f"trace {trace}: no held-out sequences to replay")
    train = routing_sequences(reader, "train")
    if not train:
        raise SpecPrefetchError(f"trace {trace}: no train split to learn the reuse table from")
    if not any((kinds == DECODE).any() for _, kinds in seqs):
        raise SpecPrefetchError(f"trace {trace}: no held-out decode positions to count reads at (traced with "
                                "--decode-tokens 0?)")
    L, E = len(reader.moe_layers), reader.num_experts
    # the reuse table with reuse-freq's one per frequency class, from one pass over the train split
    # (replay scores by the whole table where the rule takes no classes)
    by_class = learn_class_reuse_table(train, E, where=f"trace {trace}")
    nexts = [belady_next_use(list(ids), L) for ids, _ in seqs]  # each sequence's real next uses, once
    exact = {"next-visit": [exact_next_sets(ids) for ids, _ in seqs]}   # and its real next visits
    rules = RULES
    sets: list = [None] * len(seqs)
    lookaheads = sorted(set(draft_lookahead))
    spec = bank = None
    if adapter is not None or lookaheads:   # the trace's model and its routers, once
        from toolkit.models.routers import load_router_bank

        spec = trace_model_spec(reader, model)
        bank = load_router_bank(spec)
    if adapter is not None:  # routing_sequences orders sequences by id
        seq_ids = sorted({int(q) for q in reader.load("heldout", ("seq",))["seq"]})[:len(seqs)]
        progress("the adapter's next-visit predictions")
        visits, sets = adapter_next_sets(reader, adapter, seq_ids, spec, bank)
        if not any(sets):
            raise SpecPrefetchError(f"trace {trace}: its held-out sequences store no router inputs, which the "
                                    "adapter's next-visit heads read")
        if visits > 1:   # their exact ceiling
            exact[f"{EXACT_VISITS}{visits}"] = [exact_next_sets(ids, visits) for ids, _ in seqs]
        rules = (*RULES, *(r for r in exact if r != "next-visit"), *ADAPTER_RULES)
    draft_model = contextlib.nullcontext()
    if lookaheads:
        progress("the draft's model")
        draft_model = DraftModel(spec, device, bank)
        rules = (*rules, *(f"{DRAFT_RULE}{d}" for d in lookaheads))
    with draft_model:
        points = [_point(frac, rules, reader, seqs, nexts, sets, exact, tokens, by_class, draft_model, progress)
                  for frac in pool_fracs]
    return {"trace": str(Path(trace).resolve()), "sequences": len(seqs), "layers": L, "experts": E,
            "top_k": reader.top_k, "rules": list(rules), "points": points,
            "adapter": str(Path(adapter).resolve()) if adapter is not None else None,
            "draft_lookahead": lookaheads}


def _point(frac: float, rules, reader: TraceReader, seqs, nexts, sets, exact, tokens, by_class, draft_model,
           progress) -> dict[str, Any]:
    """One pool's row of the report: every rule's reads per decode token over the sequences."""
    L, E = len(reader.moe_layers), reader.num_experts
    cap = max(reader.top_k, int(round(frac * L * E)))
    row = {"pool_frac": frac, "slots": cap, "reads_per_token": {}}
    for rule in rules:
        progress(f"pool {cap} slots: {rule}")
        r = d = 0
        for i, ((ids, kinds), nu, ns) in enumerate(zip(seqs, nexts, sets)):
            dr = None
            if rule.startswith(DRAFT_RULE):
                dr = LookaheadDraft(draft_model, tokens[i], int(rule.removeprefix(DRAFT_RULE)))
            a, b = replay(ids, kinds, cap, rule, by_class, nu, draft=dr,
                          next_sets=ns if rule in ADAPTER_RULES else exact[rule][i] if rule in exact else None)
            r, d = r + a, d + b
        row["reads_per_token"][rule] = round(r / max(d, 1), 3)
    rp = row["reads_per_token"]
    gap = rp["lru"] - rp["belady"]
    row["share_of_lru_belady_gap"] = {x: round((rp["lru"] - rp[x]) / gap, 3) if gap > 0 else None
                                      for x in rules if x not in ("lru", "belady")}
    return row


def markdown(r: dict[str, Any]) -> str:
    if not r["points"]:
        return "No pools replayed."
    lines = [f"Reads per decode token, on demand, {r['sequences']} held-out sequences ({r['layers']} MoE layers x "
             f"{r['experts']} experts, top-{r['top_k']}):", "",
             "| pool (experts) | " + " | ".join(r["rules"]) + " |",
             "|---|" + "---|" * len(r["rules"])]
    for p in r["points"]:
        lines.append(f"| {p['pool_frac']:.0%} ({p['slots']}) | " +
                     " | ".join(f"{p['reads_per_token'][x]:.1f}" for x in r["rules"]) + " |")
    lines += ["", "Share of the LRU-Belady gap each rule closes:", "",
              "| pool (experts) | " + " | ".join(r["points"][0]["share_of_lru_belady_gap"]) + " |",
              "|---|" + "---|" * len(r["points"][0]["share_of_lru_belady_gap"])]
    for p in r["points"]:
        lines.append(f"| {p['pool_frac']:.0%} ({p['slots']}) | " +
                     " | ".join(str(v) for v in p["share_of_lru_belady_gap"].values()) + " |")
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from toolkit.reporting import save_figure

    fig, ax = plt.subplots(figsize=(max(7.0, 0.6 * len(r["rules"])), 4.5))
    x = np.arange(len(r["rules"]))
    w = 0.8 / max(len(r["points"]), 1)
    for i, p in enumerate(r["points"]):
        ax.bar(x + i * w, [p["reads_per_token"][q] for q in r["rules"]], w, label=f"pool {p['pool_frac']:.0%}")
    ax.set_xticks(x + w * (len(r["points"]) - 1) / 2, r["rules"], rotation=45, ha="right")
    ax.set_ylabel("expert reads per decode token")
    ax.set_title("Eviction knowledge vs reads (on demand)")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
