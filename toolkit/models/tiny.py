"""Tiny random checkpoints of every supported family, for tests and for trying the toolkit.

Each is a real transformers model of that architecture (2-4 layers, hidden 64, 8 experts), saved as
an ordinary model directory with the embedded model's tokenizer, so it goes through exactly the
loading, tracing and export paths of a real checkpoint. `specprefetch tiny FAMILY --out DIR` writes one.
The directory is assembled beside DIR and renamed into place when complete; an existing DIR is
replaced (as a whole: no stray shard of the old checkpoint is left) only with overwrite=True and
only if it is a model directory (it holds config.json); anything else is refused and left alone.

A config changed by `overrides` (`--set`) is checked before any weight is made, by the checks every
other command makes on a model directory (`inspect_model_dir`, as `info` does: sizes, top-k against
the experts, at least one MoE layer, transformers able to build it on the meta device), and against
this machine's memory: a config they refuse is a one-line error, and nothing is written.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from toolkit.artifacts import atomic_directory, claim_output
from toolkit.errors import SpecPrefetchError
from toolkit.models.loader import embedded_model_dir
from toolkit.models.shipped import TOKENIZER_FILES

VOCAB = 4096
EOS = 0


def _configs() -> dict:
    import transformers as T

    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4,
                  eos_token_id=EOS, bos_token_id=EOS, pad_token_id=EOS, max_position_embeddings=512)
    return {
        "qwen3_moe": lambda: T.Qwen3MoeConfig(
            **common, intermediate_size=96, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
            mlp_only_layers=[0]),
        "qwen3_vl_moe": lambda: T.Qwen3VLMoeConfig(
            text_config=dict(**common, intermediate_size=96, num_hidden_layers=3,
                             num_key_value_heads=2, head_dim=16, num_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=48,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                               out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                               temporal_patch_size=2, deepstack_visual_indexes=[1],
                               num_position_embeddings=64),
            image_token_id=5, video_token_id=6, vision_start_token_id=3, vision_end_token_id=4,
            eos_token_id=EOS, pad_token_id=EOS),
        "deepseek_v2": lambda: T.DeepseekV2Config(
            **common, intermediate_size=96, num_hidden_layers=3, num_key_value_heads=4,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=1,
            first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, topk_method="group_limited_greedy", n_group=4,
            topk_group=2, routed_scaling_factor=1.0),
        "deepseek_v3": lambda: T.DeepseekV3Config(
            **common, intermediate_size=96, num_hidden_layers=3, num_key_value_heads=4,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=1,
            first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, n_group=4, topk_group=2, norm_topk_prob=True,
            routed_scaling_factor=2.5),
        "mixtral": lambda: T.MixtralConfig(
            **common, intermediate_size=48, num_hidden_layers=2, num_key_value_heads=2,
            num_local_experts=8, num_experts_per_tok=2),
        "olmoe": lambda: T.OlmoeConfig(
            **common, intermediate_size=48, num_hidden_layers=2, num_key_value_heads=4,
            num_experts=8, num_experts_per_tok=2),
        "gpt_oss": lambda: T.GptOssConfig(
            **common, intermediate_size=48, num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
            num_local_experts=8, num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"], sliding_window=64,
            rope_parameters={"rope_type": "default", "rope_theta": 150000.0}),
    }


TINY_FAMILIES = ("qwen3_moe", "qwen3_vl_moe", "deepseek_v2", "deepseek_v3", "mixtral", "olmoe", "gpt_oss")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__


def _available_memory() -> int | None:
    """Bytes of memory available now (MemAvailable), else the machine's physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def _build(family: str, config) -> torch.nn.Module:
    import transformers as T

    if family == "qwen3_vl_moe":
        return T.Qwen3VLMoeForConditionalGeneration(config)
    return T.AutoModelForCausalLM.from_config(config)


def check_config(family: str, config, overrides: dict) -> None:
    """The config `--set` made, checked as every command checks a model directory before anything
    is built (see the module doc); a one-line SpecPrefetchError naming the --set values otherwise."""
    from toolkit.models.info import require_moe_layers
    from toolkit.models.loader import build_on_meta, inspect_model_dir

    sets = " ".join(f"{k}={json.dumps(v)[:40]}" for k, v in overrides.items())
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "config.json"
        try:
            config.save_pretrained(d)
        except Exception as e:  # noqa: BLE001 - transformers validates the config as it writes it
            raise SpecPrefetchError(f"--set {sets}: transformers cannot write this {family} config "
                                    f"({_one_line(e)})") from None
        try:
            spec = inspect_model_dir(d, config_only_ok=True)
            require_moe_layers(spec)
            params = sum(p.numel() for p in build_on_meta(spec).parameters())
        except SpecPrefetchError as e:
            msg = str(e).replace(f"{cfg}: describes", "the config describes").replace(str(cfg), "the config")
            raise SpecPrefetchError(f"--set {sets}: {msg.replace(d, 'the model')}") from None
    try:  # the config as set (transformers may repair a value when it reads the file back)
        with torch.device("meta"):
            _build(family, config)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a config it cannot build
        raise SpecPrefetchError(f"--set {sets}: transformers cannot build the model this config describes "
                                f"({type(e).__name__}: {_one_line(e)})") from None
    need, have = params * 4, _available_memory()  # random weights are made in float32 before the fp16 copy
    if have is not None and need > have // 2:
        raise SpecPrefetchError(f"--set {sets}: a model of {params:,} parameters needs {need / 2**30:.1f} GiB to "
                                f"build, more than half this machine's available memory ({have / 2**30:.1f} GiB)")


def build_tiny(family: str, out: Path | str, *, seed: int = 0, overrides: dict | None = None,
               overwrite: bool = False) -> Path:
    """Write a tiny random checkpoint of `family` to `out` and return the path. `overrides` set
    config attributes (e.g. a larger hidden_size, more experts, mlp_only_layers=[]). An existing
    `out` is refused unless `overwrite`, and then replaced only if it is a model directory."""
    makers = _configs()
    if family not in makers:
        raise SpecPrefetchError(f"no tiny config for {family!r}; choose from {', '.join(TINY_FAMILIES)}")
    out = Path(out)
    claim_output(out, kind="model", overwrite=overwrite, inputs=(embedded_model_dir(),))
    config = makers[family]()
    for key, value in (overrides or {}).items():
        owner, attr = config, key
        for part in key.split(".")[:-1]:  # a nested config: text_config.num_experts=32, vision_config.depth=4
            owner = getattr(owner, part, None)
            if owner is None or not hasattr(owner, "to_dict"):
                raise SpecPrefetchError(f"--set {key}: {type(config).__name__} has no sub-config {part!r}")
        attr = key.split(".")[-1]
        if not hasattr(owner, attr):
            raise SpecPrefetchError(f"--set {key}: {type(owner).__name__} has no such attribute")
        try:
            setattr(owner, attr, value)
        except Exception as e:  # noqa: BLE001 - transformers' strict configs raise their own types
            raise SpecPrefetchError(f"--set {key}={json.dumps(value)[:60]}: {type(owner).__name__} refuses it "
                                    f"({_one_line(e)})") from None
    if overrides:
        check_config(family, config, overrides)
    torch.manual_seed(seed)
    model = _build(family, config)
    with torch.no_grad():  # untrained routers of zeros would route every token alike
        for name, p in model.named_parameters():
            if name.endswith((".gate.weight", ".router.weight")) and torch.count_nonzero(p) == 0:
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.05, 0.05)
    model.eval()
    with atomic_directory(out, overwrite=overwrite, kind="model", inputs=(embedded_model_dir(),)) as work:
        model.to(torch.float16).save_pretrained(work)  # stored in half precision, like real checkpoints
        for name in TOKENIZER_FILES:
            shutil.copy(embedded_model_dir() / name, work / name)
        if family == "qwen3_vl_moe":
            pre = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "merge_size": 2,
                   "temporal_patch_size": 2, "min_pixels": 32 * 32, "max_pixels": 64 * 64,
                   "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                   "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True}
            (work / "preprocessor_config.json").write_text(json.dumps(pre, indent=1))
    return out
