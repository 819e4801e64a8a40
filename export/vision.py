"""Qwen3-VL-MoE's vision tower at one fixed image grid, as a plain PyTorch module an exporter can lower.

transformers' tower (`Qwen3VLMoeVisionModel`) takes `grid_thw` at run time and derives from it, with
`.tolist()`, `repeat_interleave` and Python loops, the things that depend only on the grid: the learned
position embeddings resampled (bilinear, align_corners) to the grid, the 2-D rotary cos/sin of every
patch, and the attention segments. None of that can be in a static graph. `VisionGraph` computes it once,
at construction, with transformers' own helpers (`get_vision_interpolation_indices_and_weights`,
`get_vision_position_ids`, the tower's `pos_embed` and `rotary_pos_emb`), and keeps the results as
buffers. What is left for forward is static:

    pixel_values [N, C*T*P*P]  (Qwen2VLImageProcessorPil's rows for one image of this grid, N = gh*gw)
    -> patch embedding + the grid's position embeddings
    -> every block: norm1, qkv, rotary (transformers' apply_rotary_pos_emb_vision), full non-causal
       scaled_dot_product_attention over the N patches (one image is one segment), proj, norm2, mlp;
       after the blocks of `deepstack_visual_indexes`, that block's deepstack merger
    -> image_embeds [N/m^2, out_hidden] (the merger), deepstack [len(deepstack_visual_indexes), N/m^2, out_hidden]

image_embeds are what the model writes over the `<|image_pad|>` rows of the prompt's embeddings (in
order); deepstack[i] is what it adds to those rows after text decoder layer i.

**Fixed per graph:** the grid (1, gh, gw), so the number of patches N and of image tokens N/m^2 (m = the
spatial merge size, 2). One image, one frame: a graph per grid (or a few buckets), and the host resizes
the image to that grid's exact size so the processor keeps it. A wrong pixel_values shape is refused.

**Numerics against transformers** (float32): the same modules and the same order of operations except
- the patch embedding is the Conv3d's weight used as a Linear ([D, C*T*P*P], the Conv3d's own parameter
  viewed, not copied): a kernel-sized convolution with stride = kernel is that matmul; only the
  accumulation order differs;
- attention is one SDPA call over all N patches where transformers splits by `cu_seqlens` (one segment
  here, so the same maths) or runs flash-attention's varlen kernel;
- the position embeddings and rotary cos/sin are constants computed by transformers' code, so they are
  the model's values exactly (rotary in float32, as transformers computes it for every weight dtype).
tests/test_vision_graph.py checks image_embeds and every deepstack feature against the tower's own output
on the tiny checkpoint within 1e-6 (measured ~8e-8), and that torch.export takes the graph.
"""
from __future__ import annotations

import torch
from torch import nn

from toolkit.errors import SpecPrefetchError


def vision_tower(model: nn.Module) -> nn.Module:
    """The vision tower of a Qwen3-VL(-MoE) model: the ImageTextToText model's `model.visual`, the inner
    model's `visual`, or the tower itself."""
    for owner in (getattr(model, "model", None), model):
        visual = getattr(owner, "visual", None)
        if isinstance(visual, nn.Module):
            return visual
    if hasattr(model, "blocks") and hasattr(model, "merger") and hasattr(model, "patch_embed"):
        return model
    raise SpecPrefetchError(f"{type(model).__name__} has no vision tower (no .visual); is it a vision-language model?")


class VisionGraph(nn.Module):
    """forward(pixel_values [N, C*T*P*P]) -> (image_embeds [N/m^2, out_hidden],
    deepstack [len(deepstack_visual_indexes), N/m^2, out_hidden]) for the fixed grid `grid_thw` (see the
    module doc)."""

    def __init__(self, model: nn.Module, grid_thw: tuple[int, int, int]):
        super().__init__()
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import apply_rotary_pos_emb_vision
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

        visual = vision_tower(model)
        cfg = visual.config
        m = int(cfg.spatial_merge_size)
        t, gh, gw = (int(v) for v in grid_thw)
        if t != 1 or gh <= 0 or gw <= 0 or gh % m or gw % m:
            raise SpecPrefetchError(f"vision grid {tuple(grid_thw)}: expected (1, gh, gw) with gh and gw positive "
                                    f"multiples of the spatial merge size {m} (one image, one frame)")
        self.grid_thw = (t, gh, gw)
        self.merge = m
        self.num_patches = t * gh * gw
        proj = visual.patch_embed.proj
        self.patch_dim = proj.weight[0].numel()  # C * T * P * P
        self.input_shape = (self.num_patches, self.patch_dim)
        self.num_tokens = self.num_patches // (m * m)
        self.out_hidden = int(cfg.out_hidden_size)

        self.patch_proj = proj
        self.blocks = visual.blocks
        self.merger = visual.merger
        self.deepstack_mergers = visual.deepstack_merger_list
        self.deepstack_indexes = [int(i) for i in visual.deepstack_visual_indexes]
        self._rotary = apply_rotary_pos_emb_vision

        grid = torch.tensor([self.grid_thw], dtype=torch.long, device=proj.weight.device)
        dtype = proj.weight.dtype
        with torch.no_grad():  # what the tower's forward derives from grid_thw, by its own code
            idx, w = get_vision_interpolation_indices_and_weights(
                grid, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
                align_corners=visual.interpolation_align_corners, spatial_merge_size=m)
            pos = (visual.pos_embed(idx) * w[:, :, None]).sum(1).to(dtype)
            position_ids = get_vision_position_ids(grid, m)
            cos, sin = visual.rotary_pos_emb(pos, position_ids)
        self.register_buffer("pos_embeds", pos.contiguous(), persistent=False)  # [N, hidden]
        self.register_buffer("rope_cos", cos.contiguous(), persistent=False)    # [N, head_dim], float32
        self.register_buffer("rope_sin", sin.contiguous(), persistent=False)

    def _attention(self, attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = attn.qkv(x).reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)  # [N, heads, D]
        q, k = self._rotary(q, k, self.rope_cos, self.rope_sin)
        q, k, v = (s.transpose(0, 1).unsqueeze(0) for s in (q, k, v))  # [1, heads, N, D]
        out = nn.functional.scaled_dot_product_attention(q, k, v, scale=attn.scaling)  # full, non-causal
        return attn.proj(out.squeeze(0).transpose(0, 1).reshape(n, -1))

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if tuple(pixel_values.shape) != self.input_shape:
            raise SpecPrefetchError(f"vision graph for grid {self.grid_thw}: pixel_values has shape "
                                    f"{list(pixel_values.shape)}, expected {list(self.input_shape)}")
        w = self.patch_proj.weight
        x = nn.functional.linear(pixel_values.to(w.dtype), w.reshape(w.shape[0], -1), self.patch_proj.bias)
        x = x + self.pos_embeds
        feats = []
        for i, blk in enumerate(self.blocks):
            x = x + self._attention(blk.attn, blk.norm1(x))
            x = x + blk.mlp(blk.norm2(x))
            if i in self.deepstack_indexes:
                feats.append(self.deepstack_mergers[self.deepstack_indexes.index(i)](x))
        embeds = self.merger(x)
        deepstack = torch.stack(feats) if feats else embeds.new_zeros(0, self.num_tokens, self.out_hidden)
        return embeds, deepstack
