"""The one group quantiser: symmetric, one scale per group of `GROUP` inputs along the last axis.

The expert store's int4 matrices (toolkit/runtime/expert_store.py) and the GPU tier's resident int4
draft experts (toolkit/runtime/gpu.py) come from `group_quantize` with fp16 scales, so the GPU draft's
int4 weights are exactly the values an int4 store holds: the scale is rounded to fp16 first and the
weights are quantised with exactly that value, and it is never subnormal or zero (an all-zero group
gets the smallest normal fp16 and codes 0), so a reader that keeps only the fp16 scale reconstructs
the same weights. The self-draft's fake quantisation (toolkit/predictors/draft.py, int4 experts and
optionally int8 dense matrices) keeps nothing on disk and uses float32 scales (`scale_dtype`), clamped
at 1e-8 only, so small int8 groups keep their resolution. (The store's int8 is per row, not grouped:
expert_store.py.)
"""
from __future__ import annotations

import torch

from toolkit.models.expert_layout import GROUP

FP16_MIN_NORMAL = 6.104e-5


def group_quantize(w: torch.Tensor, bits: int = 4, group: int = GROUP,
                   scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., n] -> (codes int8 [..., n rounded up to whole groups] in [-2^(bits-1), 2^(bits-1) - 1],
    scales [..., groups] in `scale_dtype`: fp16 (stored) or fp32 (fake quantisation)); the padding
    columns are zero codes."""
    qmax = 2 ** (bits - 1) - 1
    n = w.shape[-1]
    g = torch.nn.functional.pad(w.float(), (0, (-n) % group)).reshape(*w.shape[:-1], -1, group)
    if scale_dtype == torch.float16:
        scale = (g.abs().amax(-1) / qmax).clamp_min(FP16_MIN_NORMAL).to(torch.float16)
    elif scale_dtype == torch.float32:
        scale = g.abs().amax(-1).clamp_min(1e-8) / qmax
    else:
        raise ValueError(f"scale_dtype: float16 or float32, not {scale_dtype}")
    q = torch.clamp(torch.round(g / scale.float()[..., None]), -qmax - 1, qmax).to(torch.int8)
    return q.reshape(*w.shape[:-1], -1), scale


def group_dequantize(q: torch.Tensor, scale: torch.Tensor, n: int, group: int = GROUP) -> torch.Tensor:
    """The float32 weights [..., n] that codes [..., n padded] and their scales stand for."""
    g = q.float().reshape(*q.shape[:-1], -1, group) * scale.float()[..., None]
    return g.reshape(*q.shape[:-1], -1)[..., :n]
