"""DeepSeek-V2 (the language model of DeepSeek-VL2) and DeepSeek-V3.

V2 router: softmax, top-k ("greedy") or group-limited top-k ("group_limited_greedy": best
`topk_group` of `n_group` groups by their max score), weights scaled by `routed_scaling_factor`
and, in transformers 5, not renormalised. V3 router: sigmoid scores plus a per-expert selection
bias (`e_score_correction_bias`), groups scored by the sum of their top-2, selected weights
renormalised (`norm_topk_prob`) and scaled. Both: `n_shared_experts` always-on shared experts and
the first `first_k_dense_replace` layers dense. Experts on disk: per-expert gate/up/down Linears.
"""
import torch

from toolkit.models.families.base import Family, RoutingSpec


class _DeepSeekBase(Family):
    def num_experts(self, tc):
        return int(tc.n_routed_experts)

    def moe_layers(self, tc):
        first = int(getattr(tc, "first_k_dense_replace", 0) or 0)
        freq = int(getattr(tc, "moe_layer_freq", 1) or 1)
        return tuple(i for i in range(tc.num_hidden_layers) if i >= first and i % freq == 0)

    def shared_experts(self, tc):
        n = int(getattr(tc, "n_shared_experts", 0) or 0)
        return n, n * int(tc.moe_intermediate_size)


class DeepSeekV2(_DeepSeekBase):
    name = "deepseek_v2"
    model_types = ("deepseek_v2",)
    description = "DeepSeek-V2 / V2-Lite (the language model of DeepSeek-VL2)"

    def routing(self, tc):
        grouped = getattr(tc, "topk_method", "greedy") == "group_limited_greedy"
        return RoutingSpec(num_experts=self.num_experts(tc), top_k=int(tc.num_experts_per_tok),
                           norm_topk_prob=False,
                           routed_scaling_factor=float(getattr(tc, "routed_scaling_factor", 1.0) or 1.0),
                           n_group=int(tc.n_group) if grouped else None,
                           topk_group=int(tc.topk_group) if grouped else None, group_score="max")

    def export_patches(self):
        return super().export_patches() + (
            ("transformers.models.deepseek_v2.modeling_deepseek_v2", "apply_rotary_emb", real_rotary_emb),)


class DeepSeekV3(_DeepSeekBase):
    name = "deepseek_v3"
    model_types = ("deepseek_v3",)
    description = "DeepSeek-V3 / R1 (sigmoid router with selection bias, group-limited top-k)"

    def routing(self, tc):
        return RoutingSpec(num_experts=self.num_experts(tc), top_k=int(tc.num_experts_per_tok),
                           score_func="sigmoid", norm_topk_prob=bool(tc.norm_topk_prob),
                           routed_scaling_factor=float(tc.routed_scaling_factor),
                           n_group=int(tc.n_group or 1), topk_group=int(tc.topk_group or 1),
                           group_score="top2sum", score_bias=True)


def real_rotary_emb(xq, xk, freqs):
    """DeepSeek-V2's complex rotary product in real arithmetic (exporters do not take complex
    tensors). `freqs` [B, T, D/2, 2] holds (cos, sin) of the complex `freqs_cis` (the step graphs
    precompute its rotary table with torch.view_as_real)."""
    def rot(x):
        xs = x.float().reshape(*x.shape[:-1], -1, 2)
        a, b = xs[..., 0], xs[..., 1]
        c, s = freqs[..., 0].unsqueeze(1), freqs[..., 1].unsqueeze(1)
        return torch.stack((a * c - b * s, a * s + b * c), -1).flatten(3).type_as(x)
    return rot(xq), rot(xk)
