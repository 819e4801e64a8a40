"""What every MoE family must tell the toolkit, and the routing maths they share.

A family module (one per architecture, beside this file) subclasses `Family` and fills in only what
is specific to it: which config keys hold the expert counts, where each decoder layer keeps its
router and experts, how the router turns logits into a top-k selection, and how expert weights are
laid out in the safetensors files. Everything else in the toolkit is family-agnostic and talks to a
model only through this interface.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Literal

import torch
from torch import nn

ScoreFunc = Literal["softmax", "sigmoid"]


@dataclasses.dataclass(frozen=True)
class RoutingSpec:
    """How a family's router picks experts; enough to re-apply the selection to other scores.

    Attributes:
        num_experts: routed experts per MoE layer (E).
        top_k: experts chosen per token (k).
        score_func: "softmax" or "sigmoid" applied to router logits.
        topk_before_softmax: GPT-OSS picks top-k on logits, then softmaxes the k values.
        norm_topk_prob: renormalise the k selected weights to sum to 1.
        routed_scaling_factor: multiplies the selected weights (DeepSeek).
        n_group / topk_group: group-limited top-k (DeepSeek): keep the best `topk_group` of `n_group`
            expert groups, then pick top-k inside them. None when not used.
        group_score: how a group is scored: "max" (DeepSeek-V2) or "top2sum" (DeepSeek-V3).
        score_bias: a per-expert bias added to the scores for selection only (DeepSeek-V3).
    """
    num_experts: int
    top_k: int
    score_func: ScoreFunc = "softmax"
    topk_before_softmax: bool = False
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int | None = None
    topk_group: int | None = None
    group_score: Literal["max", "top2sum"] = "max"
    score_bias: bool = False


@dataclasses.dataclass(frozen=True)
class ExpertMatrix:
    """One weight matrix of an expert, in the canonical orientation the runtime uses.

    `role` is gate / up / down (or gate_up for fused GPT-OSS-style, bias_* for biases); `shape` is
    [out, in] for weights and [out] for biases.
    """
    role: str
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ExpertSource:
    """Where one canonical expert matrix lives in the checkpoint.

    key: safetensors key, with {layer} and, for per-expert layouts, {expert} placeholders.
    fused: True when the tensor holds all experts, expert index on axis 0.
    transpose: the stored matrix is [in, out] and must be transposed to canonical [out, in].
    rows: (start, stop) rows of the canonical matrix to take (gate and up halves of a fused
        gate_up tensor), or None for all; `stride2` takes every second row from `start` instead
        (GPT-OSS interleaves gate and up).
    """
    role: str
    key: str
    fused: bool = False
    transpose: bool = False
    rows: tuple[int, int] | None = None
    stride2: bool = False


@dataclasses.dataclass(frozen=True)
class ModelGeometry:
    """Sizes the toolkit needs about a model, read from its config through its family."""
    family: str
    model_type: str
    num_layers: int
    moe_layers: tuple[int, ...]
    hidden_size: int
    vocab_size: int
    moe_intermediate_size: int
    routing: RoutingSpec
    n_shared_experts: int = 0
    shared_intermediate_size: int = 0
    expert_has_bias: bool = False

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.moe_layers)

    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up, down, plus biases if any)."""
        h, i = self.hidden_size, self.moe_intermediate_size
        n = 3 * h * i
        if self.expert_has_bias:
            n += 2 * i + h
        return n


def grouped_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, sinks=None, **kwargs):
    """transformers' eager attention for grouped-query heads, without `repeat_kv`.

    query [B, Hq, T, D] attends key/value [B, Hkv, S, D] where query head h uses key/value head
    h // (Hq / Hkv), as repeat_kv arranges them. Instead of copying the cache Hq / Hkv times (every
    step, for the whole cache length), the query's heads are folded into rows of their group:
    [B, Hkv, G*T, D] @ [B, Hkv, D, S]. The same products and softmax; only the batching of the
    matrix products differs. `sinks` [Hq] (GPT-OSS): a per-head logit column joined to the softmax
    and dropped after it. Returns (output [B, T, Hq, Dv], probabilities [B, Hq, T, S])."""
    b, hq, t, d = query.shape
    hkv, s_len = key.shape[1], key.shape[2]
    g = hq // hkv
    w = torch.matmul(query.reshape(b, hkv, g * t, d), key.transpose(2, 3)) * scaling
    w = w.reshape(b, hkv, g, t, s_len)
    if attention_mask is not None:
        m = attention_mask[..., :s_len]
        w = w + (m.unsqueeze(2) if m.shape[1] == 1 else m.reshape(b, hkv, g, t, s_len))
    if sinks is not None:  # no explicit max subtraction: softmax is shift-invariant (XNNPACK rejects a 4-D amax)
        col = sinks.reshape(1, hkv, g, 1, 1).expand(b, hkv, g, t, 1).to(w.dtype)
        p = torch.softmax(torch.cat([w, col], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(w, dim=-1, dtype=torch.float32)
    p = torch.nn.functional.dropout(p.to(query.dtype), p=dropout, training=module.training)
    out = torch.matmul(p.reshape(b, hkv, g * t, s_len).to(value.dtype), value)
    return out.reshape(b, hq, t, value.shape[-1]).transpose(1, 2).contiguous(), p.reshape(b, hq, t, s_len)


class Family:
    """Base class of a model family. Subclasses set the class attributes and override hooks."""

    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    description: ClassVar[str]
    is_vision_language: ClassVar[bool] = False
    router_attr: ClassVar[str] = "gate"  # attribute of the MoE block that holds the router
    moe_block_attr: ClassVar[str] = "mlp"  # attribute of the decoder layer that holds the MoE block

    # -- config ---------------------------------------------------------------------------
    def text_config(self, config: Any) -> Any:
        """The config that describes the language model (VL families nest it)."""
        return config

    def num_experts(self, tc: Any) -> int:
        return int(tc.num_experts)

    def moe_layers(self, tc: Any) -> tuple[int, ...]:
        return tuple(range(tc.num_hidden_layers))

    def moe_intermediate_size(self, tc: Any) -> int:
        return int(tc.moe_intermediate_size)

    def routing(self, tc: Any) -> RoutingSpec:
        raise NotImplementedError

    def shared_experts(self, tc: Any) -> tuple[int, int]:
        """(number of shared experts, intermediate size of the shared block)."""
        return 0, 0

    def geometry(self, config: Any) -> ModelGeometry:
        tc = self.text_config(config)
        n_shared, shared_i = self.shared_experts(tc)
        return ModelGeometry(
            family=self.name, model_type=config.model_type, num_layers=int(tc.num_hidden_layers),
            moe_layers=self.moe_layers(tc), hidden_size=int(tc.hidden_size),
            vocab_size=int(tc.vocab_size), moe_intermediate_size=self.moe_intermediate_size(tc),
            routing=self.routing(tc), n_shared_experts=n_shared, shared_intermediate_size=shared_i,
            expert_has_bias=self.expert_has_bias)

    expert_has_bias: ClassVar[bool] = False

    # -- modules --------------------------------------------------------------------------
    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return model.model.layers

    def moe_block(self, model: nn.Module, layer: int) -> nn.Module:
        return getattr(self.decoder_layers(model)[layer], self.moe_block_attr)

    def router(self, model: nn.Module, layer: int) -> nn.Module:
        """The router module of a MoE layer: called with the router input, returns
        (logits [T, E], top-k weights [T, k], top-k ids [T, k]) in transformers 5."""
        return getattr(self.moe_block(model, layer), self.router_attr)

    def router_params(self, model: nn.Module,
                      layer: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(weight [E, H], logit bias [E] or None, selection score bias [E] or None)."""
        r = self.router(model, layer)
        return r.weight, getattr(r, "bias", None), getattr(r, "e_score_correction_bias", None)

    def expert_forward(self, mats: dict[str, torch.Tensor], x: torch.Tensor, tc: Any) -> torch.Tensor:
        """One routed expert applied to x [T, H] from its canonical matrices (unweighted).

        The default is the SwiGLU-style MLP every supported family but GPT-OSS uses:
        down(act(gate(x)) * up(x)).
        """
        from transformers.activations import ACT2FN

        act = ACT2FN[getattr(tc, "hidden_act", "silu")]
        return (act(x @ mats["gate"].t()) * (x @ mats["up"].t())) @ mats["down"].t()

    # -- step graphs (export) -------------------------------------------------------------
    def sliding_windows(self, tc: Any, num_layers: int) -> list[int]:
        """Per decoder layer, the sliding-window length of its attention mask (0: full causal),
        as the family's transformers model builds its masks. The default: full attention."""
        return [0] * num_layers

    def rope_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The position ids the rotary module takes for text tokens at `positions` [1, S]."""
        return positions

    def mrope_axes(self, text_model) -> torch.Tensor | None:
        """Multimodal rotary positions: for each rotary channel [head_dim], the position axis it reads
        (0 time, 1 height, 2 width), so a step graph can take three position rows per token; None for
        1-D rotary (the default)."""
        return None

    def export_patches(self) -> tuple[tuple[str, str, Callable[..., Any]], ...]:
        """(module, attribute, replacement) of helpers in the family's transformers code swapped
        for an equivalent while the step graphs are traced or run (export.graphs.exportable_family):
        helpers exporters cannot trace, and eager attention, whose `repeat_kv` would copy the whole
        KV cache to every query head on every decode step (grouped_attention). The default: the
        attention of the family's transformers module."""
        return tuple((f"transformers.models.{t}.modeling_{t}", "eager_attention_forward", grouped_attention)
                     for t in self.model_types[:1])

    # -- checkpoint layout ----------------------------------------------------------------
    # (checkpoint substring, module substring) renames transformers applies when loading
    key_renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    layer_prefix: ClassVar[str] = "model.layers.{layer}"

    def router_keys(self, layer: int) -> dict[str, str]:
        """Checkpoint keys of a MoE layer's router: weight [E, H], optional bias [E] and
        selection bias [E]; keys missing from a checkpoint are simply absent."""
        p = self.layer_prefix.format(layer=layer) + f".{self.moe_block_attr}.{self.router_attr}"
        return {"weight": p + ".weight", "bias": p + ".bias",
                "score_bias": p + ".e_score_correction_bias"}

    def expert_sources(self, geo: ModelGeometry) -> tuple[ExpertSource, ...]:
        """The default: per-expert gate/up/down Linear weights (Qwen3-MoE, OLMoE, DeepSeek)."""
        p = self.layer_prefix + ".mlp.experts.{expert}"
        return (ExpertSource("gate", p + ".gate_proj.weight"),
                ExpertSource("up", p + ".up_proj.weight"),
                ExpertSource("down", p + ".down_proj.weight"))

    def expert_matrices(self, geo: ModelGeometry) -> tuple[ExpertMatrix, ...]:
        h, i = geo.hidden_size, geo.moe_intermediate_size
        mats = [ExpertMatrix("gate", (i, h)), ExpertMatrix("up", (i, h)), ExpertMatrix("down", (h, i))]
        if geo.expert_has_bias:
            mats += [ExpertMatrix("bias_gate", (i,)), ExpertMatrix("bias_up", (i,)),
                     ExpertMatrix("bias_down", (h,))]
        return tuple(mats)


class LocalExpertsConfig:
    """Mixin for configs that name E `num_local_experts` and the expert FFN `intermediate_size`
    (Mixtral, GPT-OSS)."""

    def num_experts(self, tc: Any) -> int:
        return int(tc.num_local_experts)

    def moe_intermediate_size(self, tc: Any) -> int:
        return int(tc.intermediate_size)


# -- routing maths, shared by tracing checks, predictors and adapters -------------------------

def router_distribution(logits: torch.Tensor, spec: RoutingSpec) -> torch.Tensor:
    """The router's probability vector over experts, [.., E], summing to 1.

    Softmax routers (and GPT-OSS, whose top-k softmax is a renormalised slice of it): softmax of
    the logits. Sigmoid routers: the sigmoid scores normalised to sum 1 (the selection bias is left
    out: it steers load balance, not the token's preference).
    """
    logits = logits.float()
    if spec.score_func == "sigmoid":
        s = logits.sigmoid()
        return s / s.sum(-1, keepdim=True).clamp_min(1e-20)
    return logits.softmax(-1)


def selection_scores(logits: torch.Tensor, spec: RoutingSpec,
                     score_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Scores [T, E] whose descending order is the family's selection order.

    The top-k of these scores is exactly the router's top-k (bias and group limits applied);
    beyond k the order continues by the selection score, with experts of the selected groups first.
    Predictors rank candidates with this, so every predictor and every budget uses the model's
    own selection rule.
    """
    logits = logits.float()
    if spec.topk_before_softmax:
        return logits
    scores = logits.sigmoid() if spec.score_func == "sigmoid" else logits.softmax(-1)
    choice = scores + score_bias.float() if (spec.score_bias and score_bias is not None) else scores
    if spec.n_group and spec.topk_group and spec.n_group > 1:
        t, e = choice.shape[0], choice.shape[-1]
        grouped = choice.view(t, spec.n_group, e // spec.n_group)
        if spec.group_score == "top2sum":
            gscore = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            gscore = grouped.max(-1).values
        gidx = torch.topk(gscore, spec.topk_group, dim=-1).indices
        gmask = torch.zeros_like(gscore).scatter_(1, gidx, 1.0)
        emask = gmask.unsqueeze(-1).expand_as(grouped).reshape(t, e)
        # selected groups first (scores are O(1)); the selected keep their exact scores, so their
        # top-k is the router's (an offset added to them would round float32 scores into ties)
        choice = choice - (1 - emask) * 1e4
    return choice


def select_experts(logits: torch.Tensor, spec: RoutingSpec,
                   score_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply a family's top-k selection to router logits [T, E].

    Returns (weights [T, k] float32, ids [T, k] int64), ids sorted by descending selection score.
    This reproduces the routers of transformers 5 for every supported family (tests check it), so
    a predictor's corrected logits go through exactly the model's own selection rule.
    """
    logits = logits.float()
    _, ids = torch.topk(selection_scores(logits, spec, score_bias), spec.top_k, dim=-1)
    return expert_weights(logits, ids, spec), ids


def expert_weights(logits: torch.Tensor, ids: torch.Tensor, spec: RoutingSpec) -> torch.Tensor:
    """The family's combination weights [T, k] of the experts `ids` [T, k] given router logits."""
    logits = logits.float()
    if spec.topk_before_softmax:
        return logits.gather(-1, ids).softmax(-1)
    scores = logits.sigmoid() if spec.score_func == "sigmoid" else logits.softmax(-1)
    weights = scores.gather(-1, ids)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * spec.routed_scaling_factor
