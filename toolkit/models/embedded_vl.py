"""`embedded-vl`, the embedded vision-language demo model: a Qwen3-VL-MoE whose language model is the
embedded text model, frozen, with a small vision tower trained on a CPU on generated pictures
(toolkit/embedded/vl.py trains and evaluates it; docs/embedded-model.md has its figures).

The language model is not retrained, so on text `embedded-vl` is the embedded model, logit for logit
(tested), with that model's experts and routing; the image tokens route through the same experts. What
ships is small (toolkit/embedded/vl_tower/): the tower's weights (vision.safetensors), its recipe and training
record (vl.json) and the processor's settings (preprocessor_config.json). The full checkpoint, an ordinary
Hugging Face directory, is assembled from those and the embedded model's weights on first use into the
cache (`model_dir`: ~/.cache/specprefetch/models), so every command takes `embedded-vl` as a model name.
"""
from __future__ import annotations

import dataclasses
import hashlib
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from toolkit.artifacts import atomic_directory, build_once, profile_dir, read_json, sha256_file
from toolkit.errors import SpecPrefetchError
from toolkit.models.shipped import EMBEDDED_DIR, TOKENIZER_FILES, VL_DIR

NAME = "embedded-vl"
ASSEMBLY_FORMAT = 1  # raise when assemble() lays the checkpoint out differently: a new cache entry
VISION_FILE = "vision.safetensors"
RECORD_FILE = "vl.json"
PROCESSOR_FILE = "preprocessor_config.json"
# the embedded tokenizer's reserved ids (toolkit/embedded/train.py: RESERVED)
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 3, 4, 5, 6
QUESTION = " This picture shows"  # what the model answers after a picture: " a red disc."


@dataclasses.dataclass
class Recipe:
    seed: int = 1234
    side: int = 96               # pictures side x side: (side / 32)^2 image tokens
    steps: int = 1500
    batch_size: int = 32
    lr: float = 2e-3
    warmup: int = 20
    min_lr_frac: float = 0.1
    vision_depth: int = 2
    vision_hidden: int = 128
    vision_heads: int = 4
    deepstack_layers: tuple[int, ...] = (1,)
    eval_pictures: int = 240     # held out: another seed's pictures
    eval_seed: int = 99



def text_config(lm: dict[str, Any]) -> dict[str, Any]:
    """The VL text config of the embedded model's config.json: the same sizes, M-RoPE sections that reduce to
    its 1-D rotary on text positions (interleaved over head_dim / 2)."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "moe_intermediate_size", "norm_topk_prob",
            "num_experts_per_tok", "decoder_sparse_step", "mlp_only_layers", "max_position_embeddings",
            "attention_bias")
    half = int(lm["head_dim"]) // 2
    t, hw = half - 2 * (half * 5 // 16), half * 5 // 16  # Qwen3-VL's 24:20:20 split of 64, scaled
    return {**{k: lm[k] for k in keys}, "num_experts": lm["num_local_experts"],
            "rope_parameters": {"rope_type": "default", "rope_theta": lm["rope_parameters"]["rope_theta"],
                                "mrope_section": [t, hw, hw], "mrope_interleaved": True},
            "eos_token_id": lm["eos_token_id"], "bos_token_id": lm["bos_token_id"], "pad_token_id": lm["pad_token_id"]}


def vl_config(recipe: Recipe, lm_dir: Path | None = None):
    import transformers as T

    lm = read_json((lm_dir or EMBEDDED_DIR) / "config.json", "model config")
    vision = dict(depth=recipe.vision_depth, hidden_size=recipe.vision_hidden,
                  intermediate_size=2 * recipe.vision_hidden, num_heads=recipe.vision_heads,
                  out_hidden_size=lm["hidden_size"], patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                  deepstack_visual_indexes=list(recipe.deepstack_layers), num_position_embeddings=64)
    return T.Qwen3VLMoeConfig(text_config=text_config(lm), vision_config=vision, image_token_id=IMAGE_PAD,
                              video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
                              vision_end_token_id=VISION_END, eos_token_id=lm["eos_token_id"],
                              pad_token_id=lm["pad_token_id"], tie_word_embeddings=lm.get("tie_word_embeddings", False))


def processor_config(recipe: Recipe) -> dict[str, Any]:
    """preprocessor_config.json: Qwen3-VL's processor at 16-pixel patches, pictures of at most side x side."""
    return {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "merge_size": 2,
            "temporal_patch_size": 2, "min_pixels": 32 * 32, "max_pixels": recipe.side * recipe.side,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_resize": True, "do_rescale": True,
            "do_normalize": True, "do_convert_rgb": True}


def make_processor(recipe: Recipe):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    c = processor_config(recipe)
    return Qwen2VLImageProcessorPil(patch_size=c["patch_size"], temporal_patch_size=c["temporal_patch_size"],
                                    merge_size=c["merge_size"], min_pixels=c["min_pixels"],
                                    max_pixels=c["max_pixels"], image_mean=c["image_mean"], image_std=c["image_std"])


def build_model(recipe: Recipe, lm_dir: Path | None = None, vision: dict[str, torch.Tensor] | None = None):
    """The VL model in float32: the embedded language model's weights, and `vision` (visual.* tensors)
    or a fresh tower."""
    import transformers as T

    lm_dir = lm_dir or EMBEDDED_DIR
    torch.manual_seed(recipe.seed)
    vl = T.Qwen3VLMoeForConditionalGeneration(vl_config(recipe, lm_dir))
    lm = T.AutoModelForCausalLM.from_pretrained(str(lm_dir), dtype=torch.float32)
    state = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
             for k, v in lm.state_dict().items()}
    if vision is not None:
        state.update({"model." + k: v.float() for k, v in vision.items()})
    missing, unexpected = vl.load_state_dict(state, strict=False)
    left = [k for k in missing if vision is not None or ".visual." not in k]
    if left or unexpected:
        raise SpecPrefetchError(f"{NAME}: the weights do not fit the model (missing {left[:3]}, unexpected "
                                f"{unexpected[:3]})")
    return vl.eval()


def prompt_ids(recipe: Recipe, tok) -> list[int]:
    """An image block (the picture's tokens) then QUESTION: what the model answers with caption()."""
    n = (recipe.side // 32) ** 2
    return [VISION_START, *[IMAGE_PAD] * n, VISION_END, *tok(QUESTION, add_special_tokens=False)["input_ids"]]



def shipped_recipe(src: Path = VL_DIR) -> tuple[Recipe, dict[str, Any]]:
    """The shipped tower's recipe and its whole record (vl.json)."""
    record = read_json(src / RECORD_FILE, f"{NAME} record")
    try:
        r = dict(record["recipe"])
        r["deepstack_layers"] = tuple(r["deepstack_layers"])
        return Recipe(**r), record
    except (KeyError, TypeError) as e:
        raise SpecPrefetchError(f"{src / RECORD_FILE}: not a {NAME} record ({type(e).__name__}: {e})") from None


def assemble(out: Path, src: Path = VL_DIR, *, overwrite: bool = False) -> Path:
    """Write the full checkpoint of `embedded-vl` to `out`: the VL config, the embedded model's weights and
    the shipped tower in float16, the tokenizer and the processor's settings. Refused where the embedded
    model's weights are not the ones the tower was trained with."""
    from safetensors.torch import load_file

    recipe, record = shipped_recipe(src)
    lm_dir = EMBEDDED_DIR
    want = record["language_model"]["weights_sha256"]
    if _file_hash(lm_dir / "model.safetensors") != want:  # hashed once per process (assembled_path hashed it)
        raise SpecPrefetchError(f"{src / RECORD_FILE}: its vision tower was trained with the embedded model of "
                                f"sha256 {want[:12]}..., not the one in {lm_dir}: train it again "
                                "(python -m toolkit.embedded.vl train)")
    with atomic_directory(out, overwrite=overwrite, kind="model", inputs=(lm_dir, src),
                          option=f"the {NAME} model cache") as work:
        model = build_model(recipe, lm_dir, load_file(str(src / VISION_FILE)))  # once the output is claimed
        model.to(torch.float16).save_pretrained(work)
        for name in TOKENIZER_FILES:
            shutil.copy(lm_dir / name, work / name)
        shutil.copy(src / PROCESSOR_FILE, work / PROCESSOR_FILE)
    return Path(out)


def cache_dir() -> Path:
    """Where assembled checkpoints of `embedded-vl` lie (one per version of its inputs)."""
    return profile_dir().parent / "models"


def is_assembled(path: Path) -> bool:
    """Whether `path` (resolved) is an assembled `embedded-vl` checkpoint in the cache."""
    return path.parent == cache_dir().resolve() and path.name.startswith(NAME + "-")


def model_dir(*, progress: bool = False) -> Path:
    """The assembled checkpoint of `embedded-vl` in the cache, made on first use (keyed by what it is made
    of: assembled_path; a second process waits for the first)."""
    path = assembled_path()
    if progress and not path.is_dir():
        print(f"assembling {NAME} into {path}", file=sys.stderr, flush=True)
    build_once(path, lambda: assemble(path), done=lambda p: (p / "config.json").is_file(), progress=progress)
    return path


_FILE_HASHES: dict[tuple[str, int, int], str] = {}


def _file_hash(f: Path) -> str:
    """sha256_file, once per process for a file unchanged since (a command resolves the name more than
    once: its inputs' check, then the run; the embedded weights are 37 MB)."""
    st = f.stat()
    key = (str(f), st.st_mtime_ns, st.st_size)
    if key not in _FILE_HASHES:
        _FILE_HASHES[key] = sha256_file(f)
    return _FILE_HASHES[key]


def assembled_path() -> Path:
    """Where the assembled checkpoint lies in the cache: named by a hash of the shipped files, the embedded
    model's weights, config and tokenizer, the config this module writes, its layout and transformers'
    version."""
    import transformers

    h = hashlib.sha256()
    for f in (VL_DIR / VISION_FILE, VL_DIR / RECORD_FILE, VL_DIR / PROCESSOR_FILE,
              EMBEDDED_DIR / "model.safetensors", EMBEDDED_DIR / "config.json",
              *(EMBEDDED_DIR / n for n in TOKENIZER_FILES)):
        if not f.is_file():
            raise SpecPrefetchError(f"{f}: missing (a shipped file of {NAME})")
        h.update(f.name.encode() + b"\0" + _file_hash(f).encode())
    # and what the checkpoint is made with besides those files: the config this module writes, its
    # layout (ASSEMBLY_FORMAT) and transformers' saving
    h.update(vl_config(shipped_recipe()[0]).to_json_string().encode())
    h.update(f"{ASSEMBLY_FORMAT}\0{transformers.__version__}".encode())
    return cache_dir() / f"{NAME}-{h.hexdigest()[:16]}"
