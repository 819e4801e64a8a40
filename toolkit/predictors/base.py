"""The predictor interface and the training-free predictors.

A predictor looks at the state at MoE layer i of token t (a `RoutingBatch` row: router inputs up to
layer i, this and earlier tokens' routing) and scores the experts of a future step: MoE layer i + h,
which is layer (i + h) mod L of the token (i + h) // L on when i + h runs past the last layer. Higher score = more
likely. `window(batch, i, W)` gives the scored sets of the next W steps, which is what the
scheduler consumes. Rankings of router-based predictors go through the family's own selection rule
(`RouterBank.selection_scores`), so bias and group limits apply.
"""
from __future__ import annotations

import torch

from toolkit.models.routers import RouterBank
from toolkit.traces.batches import RoutingBatch


class Predictor:
    """What a predictor can do is declared here, never probed: the runtime reads these flags.

    linear: `effective_router(i, h)` gives a matrix whose product with one layer's router input is the
        scores' logits, so a whole window folds into one matmul (toolkit.runtime.planner).
    routes_ahead: `prepare(tokens)` must run over the whole sequence before its scores are read (the
        draft), so the run needs a recorded first pass.
    reads_future: its scores are the recorded routing itself (the oracle).
    next_visits: how many of a layer's next visits `next_visit_logits(x, i, j)` predicts (j = 1..that):
        MoE layer i's routing j tokens on, from layer i's router input (the adapter's next-visit heads),
        which the reuse eviction reads; 0: none.
    """
    name: str = "predictor"
    linear: bool = False
    routes_ahead: bool = False
    reads_future: bool = False
    next_visits: int = 0

    def next_visit_logits(self, x: torch.Tensor, i: int, j: int = 1) -> torch.Tensor:
        """Logits [B, E] of MoE layer i j tokens on, from layer i's router input x [B, H]."""
        raise NotImplementedError

    def params(self) -> int:
        """Parameters this predictor adds on top of the model (0 for training-free ones)."""
        return 0

    def scores(self, b: RoutingBatch, i: int, h: int) -> torch.Tensor:
        """Scores [B, E] for the step h MoE layers after layer i."""
        raise NotImplementedError

    def window(self, b: RoutingBatch, i: int, w: int) -> list[tuple[int, int, torch.Tensor]]:
        """[(token offset, MoE layer index, scores [B, E])] for the next w steps after layer i."""
        L = b.num_layers
        return [((i + h) // L, (i + h) % L, self.scores(b, i, h)) for h in range(1, w + 1)]


class NextGate(Predictor):
    """Layer i+h's router applied unchanged to layer i's router input (training-free baseline;
    Mixtral-offloading, AdapMoE, on-phone Qwen3 runtimes)."""
    name = "next-gate"
    linear = True

    def __init__(self, bank: RouterBank):
        self.bank = bank

    def effective_router(self, i: int, h: int) -> tuple[torch.Tensor, int]:
        """(matrix [E, H], source layer): logits = x_source @ matrix.T (+ bias). Linear predictors
        expose this so the runtime can fold a whole window into one matmul."""
        return self.bank.weight[(i + h) % self.bank.num_layers], i

    def scores(self, b, i, h):
        j = (i + h) % b.num_layers
        return self.bank.selection_scores(self.bank.logits(b.hidden[:, i], j), j)


class FateStyle(Predictor):
    """FATE-style cross-layer gate: layer i+h's router applied to the *previous* layer's router
    input (i - 1), a prediction available one layer earlier. At the first layer there is no
    previous layer and it falls back to layer i's input."""
    name = "fate"
    linear = True

    def __init__(self, bank: RouterBank):
        self.bank = bank

    def effective_router(self, i: int, h: int) -> tuple[torch.Tensor, int]:
        return self.bank.weight[(i + h) % self.bank.num_layers], max(0, i - 1)

    def scores(self, b, i, h):
        j = (i + h) % b.num_layers
        src = b.hidden[:, max(0, i - 1)]
        return self.bank.selection_scores(self.bank.logits(src, j), j)


class Frequency(Predictor):
    """Per-layer expert frequency over the training split: the same ranking for every token."""
    name = "frequency"

    def __init__(self, counts: torch.Tensor):
        self.freq = counts.float() / counts.sum(-1, keepdim=True).clamp_min(1)  # [L, E]

    def params(self) -> int:
        return self.freq.numel()

    def scores(self, b, i, h):
        j = (i + h) % b.num_layers
        return self.freq[j].to(b.device).expand(len(b), -1)


class PreviousToken(Predictor):
    """Previous-token reuse: the experts the most recent token used at the target layer.

    For a same-token target (layer j of token t) that is token t-1's layer j; for a later token's
    target (layer j of token t+1, t+2, ...) it is token t's own layer j, already known by then. Only the k
    reused experts score, by their router rank (k..1, over k) less a tie-break by ascending id
    (0.5 / E of a rank, as the oracle's), so every engine queues them in one order; the rest are 0."""
    name = "previous-token"

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def scores(self, b, i, h):
        L = b.num_layers
        j = i + h
        if j < L:
            ids, ok = b.prev_ids[:, j], b.has_prev
        else:   # a later token's layer: this token's own (the latest known)
            ids, ok = b.ids[:, j % L], torch.ones(len(b), dtype=torch.bool, device=b.device)
        E, k = self.num_experts, ids.shape[-1]
        rank = torch.arange(k, 0, -1, dtype=torch.float32, device=b.device).expand(len(b), -1)
        s = torch.zeros(len(b), E, device=b.device).scatter_(1, ids, rank)
        tie = torch.arange(E, dtype=torch.float32, device=b.device) * torch.tensor(0.5 / E, dtype=torch.float32)
        s = torch.where(s > 0, (s - tie) / k, s)
        s[~ok] = 0.0
        return s


class Oracle(Predictor):
    """The trace's real future: the upper bound of every predictor."""
    name = "oracle"
    reads_future = True

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def scores(self, b, i, h):
        ids, _ = b.target_ids(i, h)
        s = torch.zeros(len(b), self.num_experts, device=b.device)
        k = ids.shape[1]
        # descending by rank so the oracle's order is the router's order
        s.scatter_(1, ids, torch.arange(k, 0, -1, dtype=torch.float32, device=b.device).expand(len(b), -1))
        return s


class AdapterPredictor(Predictor):
    """The trained low-rank prefetch adapter (adapters/)."""
    name = "adapter"
    linear = True

    def __init__(self, adapter, bank: RouterBank):
        self.adapter, self.bank = adapter, bank

    def params(self) -> int:
        return self.adapter.params()

    @property
    def next_visits(self) -> int:
        return int(getattr(self.adapter, "next_visits", 0))

    @torch.no_grad()
    def next_visit_logits(self, x: torch.Tensor, i: int, j: int = 1) -> torch.Tensor:
        return self.adapter.logits(self.bank, x, i, j * self.bank.num_layers)

    @torch.no_grad()
    def effective_router(self, i: int, h: int) -> tuple[torch.Tensor, int]:
        j = (i + h) % self.bank.num_layers
        if (i, h) not in self.adapter.pair_index:
            return self.bank.weight[j], i
        p = self.adapter.pair_index[(i, h)]
        return self.bank.weight[j] + self.adapter.B[p] @ self.adapter.A[p], i

    @torch.no_grad()
    def scores(self, b, i, h):
        if (i, h) not in self.adapter.pair_index:  # outside the trained horizons: next-gate
            return NextGate(self.bank).scores(b, i, h)
        j = self.adapter.target_layer(i, h)
        return self.bank.selection_scores(self.adapter.logits(self.bank, b.hidden[:, i], i, h), j)
