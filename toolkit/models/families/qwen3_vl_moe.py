"""Qwen3-VL-MoE (e.g. Qwen3-VL-30B-A3B): the language model's routers; images go through the
vision tower when tracing.

Router: softmax over E, top-k, always renormalised. Config nests the language model under
`text_config`; modules live under `model.language_model`. Experts on disk are fused per layer:
`mlp.experts.gate_up_proj` [E, H, 2I] (gate rows first, then up) and `mlp.experts.down_proj`
[E, I, H], both stored [in, out].
"""
from toolkit.models.families.base import ExpertSource, RoutingSpec
from toolkit.models.families.qwen3_moe import Qwen3Moe


class Qwen3VLMoe(Qwen3Moe):
    name = "qwen3_vl_moe"
    model_types = ("qwen3_vl_moe",)
    description = "Qwen3-VL-MoE (Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B)"
    is_vision_language = True
    layer_prefix = "model.language_model.layers.{layer}"

    def text_config(self, config):
        return config.text_config

    def decoder_layers(self, model):
        return model.model.language_model.layers

    def sliding_windows(self, tc, num_layers):
        """Full attention: its text model builds causal masks only, whatever `sliding_window` says."""
        return [0] * num_layers

    def rope_positions(self, positions):
        """M-RoPE takes three position axes (time, height, width); for text tokens they agree."""
        return positions.expand(3, *positions.shape)

    def mrope_axes(self, text_model):
        """Interleaved M-RoPE: the rotary module's own recomposition, applied to frequencies that hold
        their axis number, gives each channel's axis."""
        import torch

        rot = text_model.rotary_emb
        half = int(rot.inv_freq.shape[0])
        axis = torch.arange(3, dtype=torch.float32).view(3, 1, 1, 1).expand(3, 1, 1, half).clone()
        return rot.recomposition_frequencies(axis).reshape(-1).round().long()

    def routing(self, tc):
        return RoutingSpec(num_experts=self.num_experts(tc), top_k=int(tc.num_experts_per_tok),
                           norm_topk_prob=True)

    def expert_sources(self, geo):
        i = geo.moe_intermediate_size
        p = self.layer_prefix + ".mlp.experts"
        return (ExpertSource("gate", p + ".gate_up_proj", fused=True, transpose=True, rows=(0, i)),
                ExpertSource("up", p + ".gate_up_proj", fused=True, transpose=True, rows=(i, 2 * i)),
                ExpertSource("down", p + ".down_proj", fused=True, transpose=True))
