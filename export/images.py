"""Images in a bundle: the vision tower at one fixed image size, and an image prompt for the runners.

A vision-language bundle (Qwen3-VL-MoE) fixes its image size at export (`export --image-size HxW`,
multiples of patch x merge, within the processor's pixel bounds): its `vision` method is the tower for
that one grid (export/vision.py). Every image is first resized to exactly that size with Pillow's
bicubic filter, then goes through transformers' image processor, whose own resize then keeps the size,
so the pixels are the processor's for that resized image (the native runner repeats both steps in C++,
android_runner/src/image.cpp). The manifest's `graphs.vision` holds the size, the grid, the token ids
and the processor's parameters.

An image prompt is `<|vision_start|>` + one `<|image_pad|>` per merged patch + `<|vision_end|>` for each
image, then the text (the order `trace` records); toolkit/runtime/images.py is what the runners do with it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from toolkit.errors import SpecPrefetchError
from toolkit.runtime.images import ImagePrompt, rope_rows
from toolkit.traces.data import open_image

MAX_SIDE = 448  # the default size's cap: 196 image tokens at Qwen3-VL's 16-pixel patches


def default_image_size(processor) -> tuple[int, int]:
    """The largest square image size under MAX_SIDE the processor keeps as it is (vision_block checks it)."""
    unit = int(processor.patch_size) * int(processor.merge_size)
    hi = int((_pixels(processor)[1]) ** 0.5) // unit * unit
    side = max(min(MAX_SIDE // unit * unit, hi), unit)
    return side, side


def _pixels(processor) -> tuple[int, int]:
    size = getattr(processor, "size", None) or {}
    lo = size.get("shortest_edge", getattr(processor, "min_pixels", None))
    hi = size.get("longest_edge", getattr(processor, "max_pixels", None))
    return int(lo), int(hi)


def vision_block(spec, processor, size: tuple[int, int], *, given: bool = True) -> dict[str, Any]:
    """The manifest's `graphs.vision` for an image size (height, width), checked against the processor
    (`given`: the user's --image-size, else the default, named so in errors)."""
    h, w = (int(v) for v in size)
    patch, merge, temporal = int(processor.patch_size), int(processor.merge_size), int(processor.temporal_patch_size)
    unit = patch * merge
    lo, hi = _pixels(processor)
    opt = f"--image-size {h}x{w}" if given else f"--image-size (its default {h}x{w} for this processor)"
    if h <= 0 or w <= 0 or h % unit or w % unit:
        raise SpecPrefetchError(f"{opt}: height and width must be positive multiples of {unit} "
                                f"(patch {patch} x merge {merge})")
    if not lo <= h * w <= hi:
        raise SpecPrefetchError(f"{opt}: {h * w} pixels, outside the image processor's "
                                f"{lo}..{hi} (preprocessor_config.json)")
    for flag in ("do_rescale", "do_normalize", "do_convert_rgb"):  # the runners always do these steps
        if getattr(processor, flag, True) is False:
            raise SpecPrefetchError(f"preprocessor_config.json: {flag} is false; the runners' preprocessing always "
                                    "does this step (no bundle with images for such a processor)")
    cfg = spec.config
    gh, gw = h // patch, w // patch
    vc = cfg.vision_config
    return {"method": "vision", "image_size": [h, w], "grid_thw": [1, gh, gw], "tokens": gh * gw // merge ** 2,
            "deepstack_layers": len(getattr(vc, "deepstack_visual_indexes", None) or []),
            "image_token_id": int(cfg.image_token_id), "vision_start_token_id": int(cfg.vision_start_token_id),
            "vision_end_token_id": int(cfg.vision_end_token_id),
            "preprocess": {"resize": "bicubic", "patch_size": patch, "merge_size": merge,
                           "min_pixels": lo, "max_pixels": hi,
                           "temporal_patch_size": temporal, "rescale_factor": float(processor.rescale_factor),
                           "image_mean": [float(x) for x in processor.image_mean],
                           "image_std": [float(x) for x in processor.image_std]}}


def fixed_size_image(path: Path | str, block: dict[str, Any]):
    """An image (RGB, Pillow) resized to a bundle's size (bicubic): the first step of its preprocessing."""
    from PIL import Image

    img = open_image(path)
    h, w = block["image_size"]
    return img if img.size == (w, h) else img.resize((w, h), Image.Resampling.BICUBIC)


def write_fixed_size_ppm(path: Path | str, block: dict[str, Any], out: Path) -> Path:
    """The image at `path` resized to the bundle's size, written to `out` as a binary PPM: what a runner
    built without PNG and JPEG decoders takes. Its own preprocessing then finds the size already the bundle's
    (no resize), so its pixel_values are those of the original image (tests/test_device.py checks the tokens)."""
    fixed_size_image(path, block).save(out, format="PPM")
    return out


def fixed_size_pixels(path: Path | str, block: dict[str, Any], processor) -> tuple[torch.Tensor, list[int]]:
    """A bundle's vision input for an image: resized to the bundle's size (bicubic), then transformers'
    processor: (pixel_values [patches, C*T*P*P], grid_thw)."""
    img = fixed_size_image(path, block)
    h, w = block["image_size"]
    out = processor(images=[img], return_tensors="pt")
    grid = [int(v) for v in out["image_grid_thw"][0]]
    if grid != list(block["grid_thw"]):
        raise SpecPrefetchError(f"--image {path}: the processor made grid {grid} of a {w}x{h} image, the bundle's "
                                f"vision method takes {block['grid_thw']}")
    return out["pixel_values"].float(), grid


class BundleVision:
    """A bundle's images: every one resized to its fixed size, through its `vision` method."""

    def __init__(self, backend, block: dict[str, Any], processor, hidden: int | None = None):
        self.backend, self.block, self.processor = backend, block, processor
        self.merge = int(block["preprocess"]["merge_size"])
        self.ids = (int(block["vision_start_token_id"]), int(block["image_token_id"]),
                    int(block["vision_end_token_id"]))
        self.hidden = hidden  # the language model's width, checked by encode_images where given

    def pixels(self, path: Path) -> tuple[torch.Tensor, list[int]]:
        return fixed_size_pixels(path, self.block, self.processor)

    def encode(self, pix: torch.Tensor, grid: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        e, d = self.backend.call(self.block["method"], [pix])[:2]
        if d.dim() != 3 or d.shape[0] != int(self.block["deepstack_layers"]):  # the native runner uses the manifest's
            raise SpecPrefetchError(f"method {self.block['method']}: {d.shape[0] if d.dim() == 3 else '?'} DeepStack "
                                    f"features, the manifest says {self.block['deepstack_layers']}")
        return e.float(), d.float()


class ModelVision:
    """A model directory's images: the processor's own resize (each image its own grid, as `trace`
    feeds them), the model's tower run eagerly for that grid (export/vision.py: VisionGraph)."""

    def __init__(self, model, spec, processor):
        self.model, self.processor = model, processor
        cfg = spec.config
        self.merge = int(processor.merge_size)
        self.ids = (int(cfg.vision_start_token_id), int(cfg.image_token_id), int(cfg.vision_end_token_id))
        self.hidden = spec.geometry.hidden_size
        self.graphs: dict[tuple[int, ...], Any] = {}

    def pixels(self, path: Path) -> tuple[torch.Tensor, list[int]]:
        out = self.processor(images=[open_image(path)], return_tensors="pt")
        return out["pixel_values"].float(), [int(v) for v in out["image_grid_thw"][0]]

    def encode(self, pix: torch.Tensor, grid: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        from export.vision import VisionGraph

        key = tuple(grid)
        if key not in self.graphs:
            self.graphs[key] = VisionGraph(self.model, key).eval()
        with torch.no_grad():
            e, d = self.graphs[key](pix)
        return e.float(), d.float()


def encode_images(vision, images: list[Path]) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Each image through `vision` (BundleVision / ModelVision): (grid_thw, image_embeds [tokens, H],
    deepstack [taps, tokens, H]), the outputs' shapes checked against the grid."""
    out = []
    for path in images:
        pix, grid = vision.pixels(path)
        e, d = vision.encode(pix, grid)
        n = (grid[1] // vision.merge) * (grid[2] // vision.merge)
        hidden = getattr(vision, "hidden", None)
        if e.dim() != 2 or e.shape[0] != n or d.dim() != 3 or tuple(d.shape[1:]) != tuple(e.shape) or \
                (hidden is not None and e.shape[1] != hidden):
            raise SpecPrefetchError(f"--image {path}: the vision tower gave image_embeds {list(e.shape)} and "
                                    f"deepstack {list(d.shape)} for a grid of {n} image tokens"
                                    + (f" of width {hidden}" if hidden is not None else ""))
        out.append((grid, e, d))
    return out


def image_prompt(vision, encoded: list[tuple[list[int], torch.Tensor, torch.Tensor]],
                 text_ids: list[int]) -> ImagePrompt:
    """The encoded images (encode_images) laid out before the text (module doc)."""
    vs, pad, ve = vision.ids
    ids: list[int] = []
    starts, grids, embeds, deep = [], [], [], []
    for grid, e, d in encoded:
        gh, gw = grid[1] // vision.merge, grid[2] // vision.merge
        ids.append(vs)
        starts.append(len(ids))
        ids += [pad] * (gh * gw)
        ids.append(ve)
        grids.append((gh, gw))
        embeds.append(e)
        deep.append(d)
    ids += list(text_ids)
    rope, delta = rope_rows(ids, starts, grids)
    return ImagePrompt(ids, starts, embeds, deep, rope, delta)
