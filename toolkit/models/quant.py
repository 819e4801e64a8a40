"""The one group quantiser: symmetric, one fp16 scale per group of `GROUP` inputs along the last axis.

The expert store's int4 matrices (toolkit/runtime/expert_store.py), the self-draft's fake-quantised
experts (toolkit/predictors/draft.py) and the GPU tier's resident int4 draft experts
(toolkit/runtime/gpu.py) all come from `group_quantize`, so a draft's weights are exactly the values the
store would hold. The scale is rounded to fp16 first and the weights are quantised with exactly that
value, and it is never subnormal or zero (an all-zero group gets the smallest normal fp16 and codes 0),
so a reader that keeps only the fp16 scale reconstructs the same weights.
"""
from __future__ import annotations

import torch

from toolkit.models.expert_layout import GROUP

FP16_MIN_NORMAL = 6.104e-5


def group_quantize(w: torch.Tensor, bits: int = 4, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., n] -> (codes int8 [..., n rounded up to whole groups] in [-2^(bits-1), 2^(bits-1) - 1],
    scales fp16 [..., groups]); the padding columns are zero codes."""
    qmax = 2 ** (bits - 1) - 1
    n = w.shape[-1]
    g = torch.nn.functional.pad(w.float(), (0, (-n) % group)).reshape(*w.shape[:-1], -1, group)
    scale = (g.abs().amax(-1) / qmax).clamp_min(FP16_MIN_NORMAL).to(torch.float16)
    q = torch.clamp(torch.round(g / scale.float()[..., None]), -qmax - 1, qmax).to(torch.int8)
    return q.reshape(*w.shape[:-1], -1), scale


def group_dequantize(q: torch.Tensor, scale: torch.Tensor, n: int, group: int = GROUP) -> torch.Tensor:
    """The float32 weights [..., n] that codes [..., n padded] and their fp16 scales stand for."""
    g = q.float().reshape(*q.shape[:-1], -1, group) * scale.float()[..., None]
    return g.reshape(*q.shape[:-1], -1)[..., :n]
