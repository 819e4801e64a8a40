"""The prefetch adapter: for each MoE layer i and horizon h, a rank-r correction of the router of
the MoE layer h steps later, applied to layer i's router input (SpecPrefetch, Kong et al.).

    logits_{i,h}(x) = x · (W_gate[j] + B_{i,h} A_{i,h})^T (+ router bias),  j = i + h

When j runs past the last MoE layer (and cross-token is on), the target is MoE layer j - L of the
*next* token: the current token's last layers predict the next token's first layers, so the
prefetch window crosses the token boundary. B starts at zero, so an untrained adapter is exactly
the next-gate baseline; only A and B train, the routers stay frozen.

With `next_visits` N, every layer i also gets the pairs (i, jL), j = 1..N: the same MoE layer of the
next N tokens, the layer's next N visits. Those heads are not for the prefetch window (W steps ahead, a
few layers) but for eviction: which of a layer's resident experts each of its next visits will route to
(toolkit/runtime/reuse.py; toolkit/simulate/bounds.py, `adapter-next-visit`).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from adapters.reuse import MAX_NEXT_VISITS
from toolkit.models.routers import RouterBank


class PrefetchAdapter(nn.Module):
    def __init__(self, *, num_layers: int, hidden_size: int, num_experts: int,
                 horizons: tuple[int, ...] = (1, 2), rank: int = 64, cross_token: bool = True,
                 next_visits: int = 0, seed: int = 0):
        super().__init__()
        if rank < 1:
            raise ValueError("rank must be >= 1")
        if not horizons or min(horizons) < 1 or max(horizons) > 4:
            raise ValueError(f"horizons must lie in 1..4, got {horizons}")
        self.num_layers, self.hidden_size, self.num_experts = num_layers, hidden_size, num_experts
        if not 0 <= next_visits <= MAX_NEXT_VISITS:
            raise ValueError(f"next_visits must lie in 0..{MAX_NEXT_VISITS}, got {next_visits}")
        if next_visits and not cross_token:
            raise ValueError("the next visits' heads cross the token boundary: they need cross_token")
        self.horizons, self.rank, self.cross_token = tuple(sorted(set(horizons))), rank, cross_token
        self.next_visits = next_visits
        # the next visits' horizons (L, 2L, ...), and all of them with the window's
        self.visit_horizons = tuple(j * num_layers for j in range(1, next_visits + 1))
        self.all_horizons = tuple(sorted(set(self.horizons) | set(self.visit_horizons)))
        self.pairs = [(i, h) for i in range(num_layers) for h in self.all_horizons
                      if h in self.visit_horizons or i + h < num_layers or (cross_token and i + h < 2 * num_layers)]
        self.pair_index = {p: n for n, p in enumerate(self.pairs)}
        g = torch.Generator().manual_seed(seed)
        P = len(self.pairs)
        self.A = nn.Parameter(torch.randn(P, rank, hidden_size, generator=g) / math.sqrt(hidden_size))  # [P, r, H]
        self.B = nn.Parameter(torch.zeros(P, num_experts, rank))  # [P, E, r]
        # source and target MoE layer of every pair; buffers, so .to(device) moves them along
        # (not persistent: they follow from the shape, and checkpoints hold only A and B)
        self.register_buffer("src", torch.tensor([i for i, _ in self.pairs], dtype=torch.long), persistent=False)
        self.register_buffer("tgt", torch.tensor([self.target_layer(i, h) for i, h in self.pairs],
                                                 dtype=torch.long), persistent=False)

    @property
    def next_visit(self) -> bool:
        """Whether it has next-visit heads at all."""
        return self.next_visits > 0

    @property
    def tokens_ahead(self) -> int:
        """How many tokens on its farthest target lies (a RoutingBatch's `ahead` for its targets; at least 1)."""
        return max(1, max((i + h) // self.num_layers for i, h in self.pairs))

    def target_layer(self, i: int, h: int) -> int:
        return (i + h) % self.num_layers

    def params(self) -> int:
        return self.A.numel() + self.B.numel()

    def logits(self, bank: RouterBank, hidden: torch.Tensor, i: int, h: int) -> torch.Tensor:
        """Predicted router logits [B, E] of the step (i, h) from layer i's router input [B, H]."""
        p = self.pair_index[(i, h)]
        x = hidden.float()
        base = bank.logits(x, self.target_layer(i, h))
        return base + (x @ self.A[p].t()) @ self.B[p].t()

    def all_logits(self, bank: RouterBank, hidden: torch.Tensor) -> torch.Tensor:
        """Every pair at once: hidden [B, L, H] -> logits [B, P, E] (the training hot path)."""
        if hidden.device != self.A.device or bank.weight.device != self.A.device:
            raise ValueError(f"adapter on {self.A.device}, router input on {hidden.device}, routers on "
                             f"{bank.weight.device}: move them to one device")
        x = hidden.float()[:, self.src]                                   # [B, P, H]
        base = torch.einsum("bph,peh->bpe", x, bank.weight[self.tgt])     # [B, P, E]
        if bank.bias is not None:
            base = base + bank.bias[self.tgt]
        low = torch.einsum("bph,prh->bpr", x, self.A)                # [B, P, r]
        return base + torch.einsum("bpr,per->bpe", low, self.B)
