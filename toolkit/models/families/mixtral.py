"""Mixtral (8x7B, 8x22B).

Router: softmax over E, top-k, renormalised. Every layer is MoE; the MoE block is the decoder
layer's `mlp` in transformers 5 but `block_sparse_moe` in the checkpoint, with per-expert
`w1` (gate), `w3` (up) and `w2` (down) Linears.
"""
from toolkit.models.families.base import ExpertSource, Family, LocalExpertsConfig, RoutingSpec


class Mixtral(LocalExpertsConfig, Family):
    name = "mixtral"
    model_types = ("mixtral",)
    description = "Mixtral 8x7B / 8x22B"
    key_renames = ((".block_sparse_moe.", ".mlp."),)

    def routing(self, tc):
        return RoutingSpec(num_experts=self.num_experts(tc), top_k=int(tc.num_experts_per_tok),
                           norm_topk_prob=True)

    def sliding_windows(self, tc, num_layers):
        """Every layer sees the last `sliding_window` positions when the config sets one."""
        sw = getattr(tc, "sliding_window", None)
        return [int(sw)] * num_layers if sw else [0] * num_layers

    def router_keys(self, layer):
        p = self.layer_prefix.format(layer=layer) + ".block_sparse_moe.gate"
        return {"weight": p + ".weight"}

    def expert_sources(self, geo):
        p = self.layer_prefix + ".block_sparse_moe.experts.{expert}"
        return (ExpertSource("gate", p + ".w1.weight"), ExpertSource("up", p + ".w3.weight"),
                ExpertSource("down", p + ".w2.weight"))
