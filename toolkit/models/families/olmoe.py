"""OLMoE (allenai OLMoE-1B-7B).

Router: softmax over E, top-k, renormalised only if `norm_topk_prob` (off in the released model).
Every layer is MoE; experts on disk are per-expert gate/up/down Linears.
"""
from toolkit.models.families.base import Family, RoutingSpec


class Olmoe(Family):
    name = "olmoe"
    model_types = ("olmoe",)
    description = "OLMoE-1B-7B"

    def moe_intermediate_size(self, tc):
        return int(tc.intermediate_size)

    def routing(self, tc):
        return RoutingSpec(num_experts=self.num_experts(tc), top_k=int(tc.num_experts_per_tok),
                           norm_topk_prob=bool(tc.norm_topk_prob))
