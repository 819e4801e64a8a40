"""Qwen3-MoE (e.g. Qwen3-30B-A3B, and the embedded default model).

Router: softmax over E, top-k, optional renormalisation (`norm_topk_prob`). Layers listed in
`mlp_only_layers`, or off the `decoder_sparse_step` grid, are dense. Experts on disk: one
gate/up/down Linear per expert (`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`).
"""
from toolkit.models.families.base import Family, RoutingSpec


class Qwen3Moe(Family):
    name = "qwen3_moe"
    model_types = ("qwen3_moe",)
    description = "Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B)"

    def moe_layers(self, tc):
        step = int(getattr(tc, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(tc, "mlp_only_layers", None) or [])
        return tuple(i for i in range(tc.num_hidden_layers)
                     if i not in dense and self.num_experts(tc) > 0 and (i + 1) % step == 0)

    def sliding_windows(self, tc, num_layers):
        """Every layer sees the last `sliding_window` positions when the config sets one."""
        sw = getattr(tc, "sliding_window", None)
        return [int(sw)] * num_layers if sw else [0] * num_layers

    def routing(self, tc):
        return RoutingSpec(num_experts=self.num_experts(tc), top_k=int(tc.num_experts_per_tok),
                           norm_topk_prob=bool(tc.norm_topk_prob))
