"""The Specter-style draft predictor: a quantized copy of the model runs ahead, and the experts it
routes to are the prefetch predictions for the target's verification pass.

The draft shares the router, attention and shared weights with the target (optionally int8) and
holds its routed experts in int4 (symmetric, one scale per group of 32 along the input axis), so
it is much cheaper to keep resident while routing almost like the target. `speculative_generate`
is greedy speculative decoding with it: the draft proposes K tokens, the target verifies them in one
pass, and the output is exactly the target's greedy output (the accept rule, `greedy_accept`, is the one
the GPU tier's speculative rounds use too: toolkit/runtime/gpu.py). On a trace, `DraftPredictor` runs the
draft teacher-forced over each held-out sequence: under greedy speculative decoding the accepted
tokens are the target's, so the draft's routing at (position, layer) is its prediction for the
target's routing there. It also reports the acceptance rate (draft's greedy next token == target's).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Sequence

import torch

from toolkit.errors import SpecPrefetchError
from toolkit.models.expert_layout import GROUP
from toolkit.models.families import selection_scores
from toolkit.models.loader import LoadedModel
from toolkit.models.quant import group_dequantize, group_quantize
from toolkit.predictors.base import Predictor
from toolkit.traces.batches import RoutingBatch

def fake_quant(w: torch.Tensor, bits: int, group: int = GROUP) -> torch.Tensor:
    """Symmetric per-group quantise-dequantise along the last axis (int4: [-8, 7], int8: [-128, 127]),
    with float32 scales (toolkit.models.quant)."""
    q, scale = group_quantize(w, bits, group, scale_dtype=torch.float32)
    return group_dequantize(q, scale, w.shape[-1], group).to(w.dtype)


def make_draft(lm: LoadedModel, *, expert_bits: int = 4, dense_bits: int | None = None) -> torch.nn.Module:
    """A copy of the model with routed experts quantized to `expert_bits` and, if `dense_bits`,
    every other matrix (attention, shared experts, embeddings) too. Routers stay exact."""
    draft = copy.deepcopy(lm.model)
    routers = {id(lm.family.router(draft, layer)) for layer in lm.geometry.moe_layers}
    experts = {id(lm.family.moe_block(draft, layer).experts) for layer in lm.geometry.moe_layers}
    with torch.no_grad():
        for mod in draft.modules():
            if id(mod) in routers:
                continue
            bits = expert_bits if id(mod) in experts else dense_bits
            if bits is None:
                continue
            for name, p in mod.named_parameters(recurse=False):
                if p.ndim >= 2 and not name.endswith("bias"):
                    p.copy_(fake_quant(p, bits))
    draft.eval()
    return draft


@dataclasses.dataclass
class SpecStats:
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def greedy_accept(proposal: Sequence[int], target: Sequence[int], stats: SpecStats | None = None) -> list[int]:
    """Greedy speculative decoding's verification rule, the one every implementation here uses
    (`speculative_generate`, the GPU tier's rounds): `target[i]` is the target's greedy token after the
    committed tokens and proposal[:i] (len(proposal) + 1 of them, from one pass over the last committed
    token and the proposal). The longest prefix of the proposal that agrees is accepted, then the
    target's own next token: returns the tokens to commit (accepted + 1), which are exactly the target's
    greedy tokens, and counts the round into `stats`."""
    a = 0
    while a < len(proposal) and proposal[a] == target[a]:
        a += 1
    if stats is not None:
        stats.rounds += 1
        stats.proposed += len(proposal)
        stats.accepted += a
    return [*proposal[:a], target[a]]


@torch.no_grad()
def speculative_generate(target: torch.nn.Module, draft: torch.nn.Module, input_ids: torch.Tensor,
                         max_new_tokens: int, k: int = 8, eos_token_id: int | None = None
                         ) -> tuple[list[int], SpecStats]:
    """Greedy speculative decoding (batch 1). Returns the new tokens (identical to the target's
    greedy decode) and acceptance statistics. Reference implementation: each round re-runs both
    models over the whole sequence, which keeps it exact for every family's cache type."""
    seq = input_ids[0].tolist()
    start = len(seq)
    stats = SpecStats()
    while len(seq) - start < max_new_tokens:
        proposal: list[int] = []
        ctx = list(seq)
        for _ in range(min(k, max_new_tokens - (len(seq) - start))):
            nxt = int(draft(input_ids=torch.tensor([ctx], device=input_ids.device)).logits[0, -1].argmax())
            proposal.append(nxt)
            ctx.append(nxt)
        logits = target(input_ids=torch.tensor([seq + proposal], device=input_ids.device)).logits[0]
        new = greedy_accept(proposal, logits[len(seq) - 1:].argmax(-1).tolist(), stats)
        for t in new:
            seq.append(t)
            if (eos_token_id is not None and t == eos_token_id) or len(seq) - start >= max_new_tokens:
                return seq[start:], stats
    return seq[start:], stats


class DraftPredictor(Predictor):
    """Scores from the draft's own routing at the target step, computed teacher-forced."""
    name = "draft"

    def __init__(self, lm: LoadedModel, reader, *, expert_bits: int = 4, dense_bits: int | None = None):
        from toolkit.traces.capture import RouterRecorder, build_inputs, make_prompts, TraceSettings
        from toolkit.traces.data import read_records

        self.lm = lm
        self.draft = make_draft(lm, expert_bits=expert_bits, dense_bits=dense_bits)
        self.expert_bits, self.dense_bits = expert_bits, dense_bits
        self.bank_spec = lm.geometry.routing
        self.moe_layers = list(lm.geometry.moe_layers)
        settings = reader.manifest["settings"]
        # fields a trace made by an older toolkit lacks (batch) keep their defaults
        s = TraceSettings(**{f.name: settings[f.name] for f in dataclasses.fields(TraceSettings)
                             if f.name in settings})
        prompts = None
        if lm.family.is_vision_language:  # images must go through the vision tower again
            recs = read_records([d["path"] for d in reader.manifest["data"]], allow_images=True)
            prompts = {p.seq: p for p in make_prompts(recs, lm.tokenizer, s)}
        self.scores_by_seq: dict[int, torch.Tensor] = {}  # seq -> [T, L, E] selection scores
        self.accepted = self.proposed = 0
        draft_lm = dataclasses.replace(lm, model=self.draft)
        rec = RouterRecorder(draft_lm)
        try:
            for a in reader.iter_shards("heldout"):
                for q in sorted(set(a["seq"].tolist())):
                    rows = a["seq"] == q
                    tokens = a["token_id"][rows].tolist()
                    kind = a["kind"][rows]
                    rec.reset()
                    if prompts is not None:
                        if q not in prompts:
                            raise SpecPrefetchError(f"draft: sequence {q} of the trace is not in its data files "
                                                    "any more (they changed since the trace was made)")
                        p = prompts[q]
                        inputs, _ = build_inputs(draft_lm, p)
                        n_prompt = inputs["input_ids"].shape[1]
                        if inputs["input_ids"][0].tolist() != tokens[:n_prompt]:
                            raise SpecPrefetchError(f"draft: sequence {q} does not match its data file")
                        ids = torch.tensor([tokens], device=lm.input_device)
                        mm = torch.zeros_like(ids)
                        mm[0, :n_prompt] = inputs["mm_token_type_ids"][0]
                        out = self.draft(**dict(inputs, input_ids=ids, attention_mask=torch.ones_like(ids),
                                                mm_token_type_ids=mm))
                    else:
                        out = self.draft(input_ids=torch.tensor([tokens], device=lm.input_device))
                    t = rec.stacked()
                    sb = [lm.family.router_params(self.draft, layer)[2] for layer in self.moe_layers]
                    sc = torch.stack([selection_scores(t["logits"][:, li], self.bank_spec,
                                                       sb[li].detach().float().cpu() if sb[li] is not None else None)
                                      for li in range(len(self.moe_layers))], 1)
                    self.scores_by_seq[q] = sc
                    pred = out.logits[0].argmax(-1).cpu()
                    dec = torch.from_numpy(kind == 1)
                    nxt = torch.tensor(tokens[1:] + [-1])
                    m = dec.clone()
                    m[-1] = False
                    self.accepted += int((pred[m] == nxt[m]).sum())
                    self.proposed += int(m.sum())
        finally:
            rec.close()

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def params(self) -> int:
        return 0  # shares the model's weights; its cost is bytes, reported separately

    def scores(self, b: RoutingBatch, i: int, h: int) -> torch.Tensor:
        L = b.num_layers
        tok_off, layer = divmod(i + h, L)
        out = torch.zeros(len(b), self.bank_spec.num_experts)
        for r in range(len(b)):
            sc = self.scores_by_seq.get(int(b.seq[r]))
            pos = int(b.pos[r]) + tok_off
            if sc is not None and pos < sc.shape[0]:
                out[r] = sc[pos, layer]
        return out.to(b.device)


class SequenceDraft(Predictor):
    """The draft predictor in the runner: the int4-expert draft run teacher-forced over one prompt
    and its committed tokens (under greedy speculative decoding the accepted tokens are the
    target's), so its routing at every (position, layer) is known ahead, as it is K tokens ahead of
    verification. Its own compute is not charged to the run (the report says so): this measures
    what its predictions are worth to the pool, not what running it costs (issue: the GPU tier)."""
    name = "draft"
    note = "draft routing precomputed teacher-forced; the draft's own compute is not charged"
    routes_ahead = True

    def __init__(self, lm: LoadedModel, *, expert_bits: int = 4):
        self.lm = lm
        self.draft = make_draft(lm, expert_bits=expert_bits)
        self.scores_by_pos: torch.Tensor | None = None  # [T, L, E]

    def prepare(self, tokens: list[int]) -> None:
        """Route the draft over the whole sequence (prompt + committed tokens)."""
        from toolkit.traces.capture import RouterRecorder

        lm = dataclasses.replace(self.lm, model=self.draft)
        rec = RouterRecorder(lm)
        try:
            with torch.no_grad():
                self.draft(input_ids=torch.tensor([tokens], device=self.lm.input_device))
            t = rec.stacked()
        finally:
            rec.close()
        spec = self.lm.geometry.routing
        L = len(self.lm.geometry.moe_layers)
        sb = [self.lm.family.router_params(self.draft, layer)[2] for layer in self.lm.geometry.moe_layers]
        self.scores_by_pos = torch.stack([selection_scores(t["logits"][:, li], spec,
                                                           sb[li].detach().float().cpu() if sb[li] is not None
                                                           else None)
                                          for li in range(L)], 1)

    def scores(self, b: RoutingBatch, i: int, h: int) -> torch.Tensor:
        L = b.num_layers
        pos = int(b.pos[0]) + (i + h) // L
        if self.scores_by_pos is None or pos >= self.scores_by_pos.shape[0]:
            return torch.zeros(1, self.lm.geometry.routing.num_experts, device=b.device)
        return self.scores_by_pos[pos, (i + h) % L].unsqueeze(0).to(b.device)
