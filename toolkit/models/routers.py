"""Every MoE layer's router weights, read straight from the checkpoint (no model load).

Predictors and adapters need only the routers (E x H per layer: 0.8 MB per layer for a 30B model),
so training and evaluation never load the experts. Values are kept in float32.
"""
from __future__ import annotations

import dataclasses

import torch
from safetensors import safe_open

from toolkit.errors import SpecPrefetchError
from toolkit.models.checkpoint import TensorIndex
from toolkit.models.families import RoutingSpec, selection_scores
from toolkit.models.spec import ModelSpec


@dataclasses.dataclass
class RouterBank:
    """Routers of the MoE layers, indexed by MoE-layer position (0..L-1), not layer number."""
    weight: torch.Tensor                 # [L, E, H]
    bias: torch.Tensor | None            # [L, E] logit bias (GPT-OSS)
    score_bias: torch.Tensor | None      # [L, E] selection bias (DeepSeek-V3)
    spec: RoutingSpec
    moe_layers: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return self.weight.shape[0]

    def logits(self, hidden: torch.Tensor, li: int, extra: torch.Tensor | None = None) -> torch.Tensor:
        """Router logits of MoE layer `li` for hidden [B, H]; `extra` adds to W ([E, H])."""
        w = self.weight[li] if extra is None else self.weight[li] + extra
        out = hidden.float() @ w.t()
        if self.bias is not None:
            out = out + self.bias[li]
        return out

    def selection_scores(self, logits: torch.Tensor, li: int) -> torch.Tensor:
        sb = self.score_bias[li] if self.score_bias is not None else None
        return selection_scores(logits, self.spec, sb)

    def params(self) -> int:
        n = self.weight.numel()
        return n + (self.bias.numel() if self.bias is not None else 0)


def load_router_bank(spec: ModelSpec) -> RouterBank:
    index = TensorIndex(spec)
    handles: dict = {}

    def read(key: str) -> torch.Tensor | None:
        if key not in index.entries:
            return None
        path = index.entries[key][0]
        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt")
        return handles[path].get_tensor(key).float()

    ws, bs, sbs = [], [], []
    for layer in spec.geometry.moe_layers:
        keys = spec.family.router_keys(layer)
        w = read(keys["weight"])
        if w is None:
            raise SpecPrefetchError(f"{spec.path}: router weight {keys['weight']!r} not in the checkpoint")
        ws.append(w)
        bs.append(read(keys["bias"]) if "bias" in keys else None)
        sbs.append(read(keys["score_bias"]) if "score_bias" in keys else None)
    bias = torch.stack(bs) if all(b is not None for b in bs) else None
    score_bias = torch.stack(sbs) if all(b is not None for b in sbs) else None
    return RouterBank(torch.stack(ws), bias, score_bias, spec.geometry.routing, spec.geometry.moe_layers)
