"""`specprefetch info`: a model's MoE geometry and what its experts cost in bytes.

Sizes come from config.json and the safetensors headers; no weights are loaded, so this is instant
on a 30B checkpoint. Expert sizes are the expert store's blob sizes, computed by the store's own
layout (toolkit/models/expert_layout.py, docs/expert-store.md): int8 with one fp16 scale per output
row, int4 packed two per byte with one fp16 scale per group of 32 weights along the input axis (rows
zero-padded to whole groups), biases (GPT-OSS) fp16, every section 64-byte aligned; the 4K-aligned
size is the expert's slot on flash and in the pool.
"""
from __future__ import annotations

import math
from typing import Any

from toolkit.models.checkpoint import DTYPE_BYTES, TensorIndex, expert_keys
from toolkit.models.expert_layout import ALIGN, DTYPES, blob_bytes
from toolkit.models.expert_layout import align as _align
from toolkit.models.families import ModelGeometry
from toolkit.models.loader import inspect_model_dir
from toolkit.errors import SpecPrefetchError
from toolkit.models.spec import ModelSpec

PAGE = ALIGN


def expert_bytes(geo: ModelGeometry, dtype: str) -> int:
    """Bytes of one routed expert's blob in the expert store in `dtype` (fp16, bf16 = fp16 sizes,
    int8 or int4): weights, scales and biases with the store's section alignment."""
    if dtype == "bf16":
        dtype = "fp16"
    if dtype not in DTYPES:
        raise ValueError(f"unknown expert dtype {dtype!r}")
    return blob_bytes(geo, dtype)


def aligned(n: int, page: int = PAGE) -> int:
    """n rounded up to whole pages: an expert's slot on flash and in the pool."""
    return _align(n, page)


def require_moe_layers(spec: ModelSpec, index: TensorIndex | None = None) -> None:
    """A config whose every layer is dense is not a model this toolkit runs (no expert to stream,
    predict or prefetch): one line saying so, naming the routed-expert weights the checkpoint holds
    if it holds any (then the config does not describe its weights)."""
    geo = spec.geometry
    if geo.moe_layers:
        return
    cfg = spec.path / "config.json"
    held: list[int] = []
    if spec.weight_files:
        index = index or TensorIndex(spec)
        for layer in range(geo.num_layers):
            try:
                keys = expert_keys(spec, layer)
            except Exception:  # noqa: BLE001 - a family that cannot name a dense layer's experts
                keys = set()
            if any(k in index.entries for k in keys) or any(
                    k.startswith((f"model.layers.{layer}.", f"model.language_model.layers.{layer}."))
                    and ".experts." in k for k in index.entries):
                held.append(layer)
    what = f"{cfg}: describes no MoE layer (all {geo.num_layers} layers are dense)"
    if held:
        raise SpecPrefetchError(f"{what}, but the checkpoint holds routed-expert weights in layers "
                                f"{held[:8]}{' ...' if len(held) > 8 else ''}: the config does not describe "
                                "these weights")
    raise SpecPrefetchError(f"{what}: not a Mixture-of-Experts model, so there are no experts to stream or "
                            "prefetch")


def model_info(spec: ModelSpec) -> dict[str, Any]:
    geo = spec.geometry
    r = geo.routing
    require_moe_layers(spec)
    if spec.weight_files:
        index = TensorIndex(spec)
        total_params = total_bytes = 0
        for _name, (_, dtype, shape) in index.entries.items():
            n = math.prod(shape)
            total_params += n
            total_bytes += n * DTYPE_BYTES.get(dtype, 2)
        stored_non_expert: int | None = total_bytes - _expert_ckpt_bytes(spec, index)
        _check_experts_match(spec, index)
    else:
        total_params, total_bytes, stored_non_expert = _meta_param_count(spec), None, None
    n_moe = len(geo.moe_layers)
    n_experts = n_moe * r.num_experts
    expert_params = geo.expert_params() * n_experts
    per_expert = {d: expert_bytes(geo, d) for d in ("fp16", "int8", "int4")}
    non_expert_params = total_params - expert_params
    return {
        "path": str(spec.path),
        "family": spec.family.name,
        "model_type": geo.model_type,
        "config_hash": spec.config_hash,
        "vision_language": spec.family.is_vision_language,
        "layers": geo.num_layers,
        "moe_layers": list(geo.moe_layers),
        "dense_layers": list(geo.dense_layers),
        "hidden_size": geo.hidden_size,
        "moe_intermediate_size": geo.moe_intermediate_size,
        "experts_per_layer": r.num_experts,
        "top_k": r.top_k,
        "score_function": ("top-k logits then softmax" if r.topk_before_softmax else r.score_func)
                          + (" + selection bias" if r.score_bias else ""),
        "group_limited": (f"{r.topk_group} of {r.n_group} groups ({r.group_score})"
                          if r.n_group and r.topk_group and r.n_group > 1 else None),
        "norm_topk_prob": r.norm_topk_prob,
        "routed_scaling_factor": r.routed_scaling_factor,
        "shared_experts": geo.n_shared_experts,
        "shared_intermediate_size": geo.shared_intermediate_size,
        "routed_experts_total": n_experts,
        "params_per_expert": geo.expert_params(),
        "bytes_per_expert": per_expert,
        "bytes_per_expert_4k_aligned": {d: aligned(b) for d, b in per_expert.items()},
        "total_expert_bytes": {d: b * n_experts for d, b in per_expert.items()},
        "total_params": total_params,
        "expert_params": expert_params,
        "non_expert_params": non_expert_params,
        "non_expert_bytes": {"fp16": non_expert_params * 2, "checkpoint": stored_non_expert},
        "active_expert_bytes_per_token": {d: b * r.top_k * n_moe for d, b in per_expert.items()},
        "checkpoint_bytes": total_bytes,
    }


def _meta_param_count(spec: ModelSpec) -> int:
    """Parameters of the model built on the meta device: exact, allocates nothing."""
    from toolkit.models.loader import build_on_meta

    net = build_on_meta(spec)   # a config transformers cannot build is a one-line error
    # parameters() counts tied embeddings once, as save_pretrained stores them
    return sum(p.numel() for p in net.parameters())


def _check_experts_match(spec: ModelSpec, index: TensorIndex) -> None:
    """The checkpoint's expert tensors are the ones config.json describes (names and sizes): a
    config that does not describe the weights would report nonsense (negative non-expert bytes)."""
    geo = spec.geometry
    cfg = spec.path / "config.json"
    keys = sorted(set().union(*(expert_keys(spec, layer) for layer in geo.moe_layers)))
    missing = [k for k in keys if k not in index.entries]
    if missing:
        quantized = any(k.endswith(("_blocks", "_scales")) for k in index.entries)
        hint = (" (the experts are stored quantized, MXFP4 *_blocks/*_scales: dequantise the checkpoint to "
                "bf16 first)" if quantized else "")
        raise SpecPrefetchError(f"{cfg} describes expert tensor {missing[0]!r}, which is not in the checkpoint"
                                f"{hint}")
    have = sum(math.prod(index.entries[k][2]) for k in keys)
    want = geo.expert_params() * len(geo.moe_layers) * geo.routing.num_experts
    if have != want:
        raise SpecPrefetchError(f"{cfg} does not describe the checkpoint's experts: its sizes give {want:,} "
                                f"expert parameters, the safetensors hold {have:,}")


def _expert_ckpt_bytes(spec: ModelSpec, index: TensorIndex) -> int:
    keys = set().union(*(expert_keys(spec, layer) for layer in spec.geometry.moe_layers))
    return sum(index.nbytes(k) for k in keys if k in index.entries)


def info(model: str) -> dict[str, Any]:
    return model_info(inspect_model_dir(model, config_only_ok=True))


def mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def render(d: dict[str, Any]) -> str:
    """A human summary for the terminal."""
    rows = [
        ("model", d["path"]),
        ("family", f"{d['family']} (config hash {d['config_hash']})"),
        ("layers", f"{d['layers']} ({len(d['moe_layers'])} MoE, {len(d['dense_layers'])} dense"
                   + (f": {d['dense_layers']}" if d["dense_layers"] else "") + ")"),
        ("experts", f"{d['experts_per_layer']} per MoE layer, top-{d['top_k']}, "
                    f"{d['routed_experts_total']} routed in all"),
        ("router", d["score_function"] + (f", group-limited {d['group_limited']}" if d["group_limited"] else "")
                   + (", renormalised" if d["norm_topk_prob"] else "")
                   + (f", scaled x{d['routed_scaling_factor']}" if d["routed_scaling_factor"] != 1.0 else "")),
        ("shared experts", str(d["shared_experts"])),
        ("params", f"{d['total_params']:,} total, {d['expert_params']:,} in routed experts "
                   f"({100 * d['expert_params'] / max(1, d['total_params']):.1f}%)"),
    ]
    for dt in ("fp16", "int8", "int4"):
        rows.append((f"expert {dt}", f"{d['bytes_per_expert'][dt]:,} B each "
                                     f"({d['bytes_per_expert_4k_aligned'][dt]:,} B 4K-aligned), "
                                     f"{mib(d['total_expert_bytes'][dt])} all, "
                                     f"{mib(d['active_expert_bytes_per_token'][dt])} active per token"))
    stored = d["non_expert_bytes"]["checkpoint"]
    rows.append(("non-expert", f"{mib(d['non_expert_bytes']['fp16'])} fp16"
                               + (f" ({mib(stored)} as stored)" if stored is not None else
                                  " (config only: no weights in the directory)")))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
