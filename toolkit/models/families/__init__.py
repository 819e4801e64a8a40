"""The registry of supported MoE families: config `model_type` -> Family."""
from __future__ import annotations

from toolkit.errors import SpecPrefetchError
from toolkit.models.families.base import (ExpertMatrix, ExpertSource, Family, ModelGeometry,
                                          RoutingSpec, expert_weights, router_distribution, select_experts,
                                          selection_scores)
from toolkit.models.families.deepseek import DeepSeekV2, DeepSeekV3
from toolkit.models.families.gpt_oss import GptOss
from toolkit.models.families.mixtral import Mixtral
from toolkit.models.families.olmoe import Olmoe
from toolkit.models.families.qwen3_moe import Qwen3Moe
from toolkit.models.families.qwen3_vl_moe import Qwen3VLMoe

FAMILIES: tuple[Family, ...] = (Qwen3Moe(), Qwen3VLMoe(), DeepSeekV2(), DeepSeekV3(), Mixtral(),
                                Olmoe(), GptOss())
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def supported() -> str:
    return ", ".join(f"{f.name} ({f.description})" for f in FAMILIES)


def family_for(model_type: str | None, where: str = "config.json") -> Family:
    """The family of a config's model_type; an unknown type is an error listing the supported ones."""
    fam = _BY_TYPE.get(model_type or "")
    if fam is None:
        raise SpecPrefetchError(f"{where}: model_type {model_type!r} is not a supported MoE family. "
                                f"Supported: {supported()}")
    return fam


def family_by_name(name: str) -> Family:
    for f in FAMILIES:
        if f.name == name:
            return f
    raise SpecPrefetchError(f"unknown family {name!r}; supported: {supported()}")


__all__ = ["FAMILIES", "Family", "RoutingSpec", "ModelGeometry", "ExpertMatrix", "ExpertSource",
           "family_for", "family_by_name", "supported", "router_distribution", "select_experts", "expert_weights",
           "selection_scores"]
