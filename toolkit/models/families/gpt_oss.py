"""GPT-OSS (gpt-oss-20b, gpt-oss-120b).

Router: a Linear with bias; top-k on the raw logits, then softmax over the k values. The MoE
block's router attribute is `router`. Experts carry biases and are fused per layer on disk:
`mlp.experts.gate_up_proj` [E, H, 2I] with gate and up interleaved along the last axis (even
columns gate, odd columns up), `gate_up_proj_bias` [E, 2I], `down_proj` [E, I, H] and
`down_proj_bias` [E, H]. The released checkpoints store experts as MXFP4 `*_blocks`/`*_scales`;
those must be dequantised (transformers does it on load) before the expert store can read them.
"""
import torch

from toolkit.models.families.base import ExpertSource, Family, LocalExpertsConfig, RoutingSpec, grouped_attention


class GptOss(LocalExpertsConfig, Family):
    name = "gpt_oss"
    model_types = ("gpt_oss",)
    description = "GPT-OSS 20B / 120B"
    router_attr = "router"
    expert_has_bias = True

    def routing(self, tc):
        return RoutingSpec(num_experts=self.num_experts(tc), top_k=int(tc.num_experts_per_tok),
                           topk_before_softmax=True)

    def expert_forward(self, mats, x, tc):
        """GPT-OSS's clamped, biased GLU: (up + 1) * gate * sigmoid(1.702 * gate)."""
        limit = float(getattr(tc, "swiglu_limit", 7.0))
        gate = (x @ mats["gate"].t() + mats["bias_gate"]).clamp(max=limit)
        up = (x @ mats["up"].t() + mats["bias_up"]).clamp(-limit, limit)
        glu = gate * torch.sigmoid(gate * 1.702)
        return ((up + 1) * glu) @ mats["down"].t() + mats["bias_down"]

    def sliding_windows(self, tc, num_layers):
        """Layers of type "sliding_attention" see the last `sliding_window` positions."""
        types = getattr(tc, "layer_types", None) or ["full_attention"] * num_layers
        sw = getattr(tc, "sliding_window", None)
        return [int(sw) if t == "sliding_attention" else 0 for t in types]

    def export_patches(self):
        return (("transformers.models.gpt_oss.modeling_gpt_oss", "eager_attention_forward", exportable_attention),)

    def expert_sources(self, geo):
        p = self.layer_prefix + ".mlp.experts"
        return (ExpertSource("gate", p + ".gate_up_proj", fused=True, transpose=True, rows=(0, 0), stride2=True),
                ExpertSource("up", p + ".gate_up_proj", fused=True, transpose=True, rows=(1, 0), stride2=True),
                ExpertSource("down", p + ".down_proj", fused=True, transpose=True),
                ExpertSource("bias_gate", p + ".gate_up_proj_bias", fused=True, rows=(0, 0), stride2=True),
                ExpertSource("bias_up", p + ".gate_up_proj_bias", fused=True, rows=(1, 0), stride2=True),
                ExpertSource("bias_down", p + ".down_proj_bias", fused=True))


def exportable_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """GPT-OSS eager attention with sinks as grouped attention (no repeat_kv), without the explicit max
    subtraction before the softmax (softmax is shift-invariant; XNNPACK rejects the 4-D amax)."""
    return grouped_attention(module, query, key, value, attention_mask, scaling, dropout, sinks=module.sinks)
