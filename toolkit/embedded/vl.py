"""Train and evaluate the vision tower of `embedded-vl` (toolkit/models/embedded_vl.py), the language model
frozen, on generated pictures (toolkit/embedded/pictures.py: a disc, square, ring or cross of one of six
colours), on a CPU (about 9 minutes on two cores at the default 1,500 steps)::

    python -m toolkit.embedded.vl train --out build/vl [--steps 1500]
    python -m toolkit.embedded.vl eval          # the assembled model's held-out accuracy
    python -m toolkit.embedded.vl path          # assemble it (once) and print its directory

Copy build/vl's three files over toolkit/embedded/vl_tower/ to ship a new tower.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from toolkit.artifacts import atomic_directory, sha256_file
from toolkit.embedded.pictures import COLOURS, SHAPES, caption, picture
from toolkit.errors import SpecPrefetchError
from toolkit.models.embedded_vl import (IMAGE_PAD, NAME, PROCESSOR_FILE, RECORD_FILE, VISION_FILE, Recipe,
                                        build_model, make_processor, model_dir, processor_config, prompt_ids,
                                        shipped_recipe)
from toolkit.models.shipped import EMBEDDED_DIR, VL_DIR


def _batch(rng, recipe: Recipe, tok, proc, prefix: list[int]):
    from PIL import Image

    ims, ids, labels = [], [], []
    for _ in range(recipe.batch_size):
        img, c, s = picture(rng, recipe.side, recipe.side)
        ims.append(Image.fromarray(img))
        target = tok(caption(c, s), add_special_tokens=False)["input_ids"] + [tok.eos_token_id or 0]
        ids.append(prefix + target)
        labels.append([-100] * len(prefix) + target)
    n = max(map(len, ids))
    mask = torch.tensor([[1] * len(x) + [0] * (n - len(x)) for x in ids])
    ids_t = torch.tensor([x + [0] * (n - len(x)) for x in ids])
    lab = torch.tensor([x + [-100] * (n - len(x)) for x in labels])
    pv = proc(images=ims, return_tensors="pt")
    return dict(input_ids=ids_t, attention_mask=mask, labels=lab, pixel_values=pv["pixel_values"],
                image_grid_thw=pv["image_grid_thw"], mm_token_type_ids=(ids_t == IMAGE_PAD).long())


@torch.no_grad()
def evaluate(model, recipe: Recipe, tok, n: int | None = None, seed: int | None = None) -> dict[str, Any]:
    """Greedy answers to QUESTION on `n` held-out pictures: the share whose answer starts with the caption
    (both words right), the colour right, the shape right, and a confusion count of the misses."""
    from PIL import Image

    proc, prefix = make_processor(recipe), prompt_ids(recipe, tok)
    rng = np.random.default_rng(recipe.eval_seed if seed is None else seed)
    n = recipe.eval_pictures if n is None else n
    both = colour_ok = shape_ok = 0
    misses: dict[str, int] = {}
    ids = torch.tensor([prefix])
    for _ in range(n):
        img, c, s = picture(rng, recipe.side, recipe.side)
        pv = proc(images=[Image.fromarray(img)], return_tensors="pt")
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             mm_token_type_ids=(ids == IMAGE_PAD).long(),
                             pixel_values=pv["pixel_values"].to(model.dtype), image_grid_thw=pv["image_grid_thw"],
                             max_new_tokens=8, do_sample=False)
        said = tok.decode(out[0, len(prefix):], skip_special_tokens=True)
        words = said.strip().rstrip(".").split()
        colour_ok += c in words
        shape_ok += s in words
        if said.startswith(caption(c, s)):
            both += 1
        else:
            key = f"{c} {s} -> {' '.join(words[:3])}"
            misses[key] = misses.get(key, 0) + 1
    top = dict(sorted(misses.items(), key=lambda kv: -kv[1])[:10])
    return {"pictures": n, "seed": recipe.eval_seed if seed is None else seed, "accuracy": round(both / n, 4),
            "colour_accuracy": round(colour_ok / n, 4), "shape_accuracy": round(shape_ok / n, 4),
            "chance": round(1 / (len(COLOURS) * len(SHAPES)), 4), "most_common_misses": top}


def train(out: Path, recipe: Recipe, *, overwrite: bool = False, progress: bool = True) -> Path:
    """Train the tower (the language model frozen) and write OUT/vision.safetensors, vl.json and
    preprocessor_config.json."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    lm_dir = EMBEDDED_DIR
    tok = AutoTokenizer.from_pretrained(str(lm_dir), local_files_only=True)
    model = build_model(recipe, lm_dir)
    for name, p in model.named_parameters():
        p.requires_grad_(".visual." in name)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    proc, prefix = make_processor(recipe), prompt_ids(recipe, tok)
    rng = np.random.default_rng(recipe.seed)
    losses, t0 = [], time.perf_counter()
    model.train()
    with atomic_directory(out, overwrite=overwrite, kind="vision tower", inputs=(lm_dir, VL_DIR)) as work:
        for step in range(recipe.steps):
            warm = min(1.0, (step + 1) / recipe.warmup)
            cos = recipe.min_lr_frac + (1 - recipe.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * step / recipe.steps))
            for g in opt.param_groups:
                g["lr"] = recipe.lr * warm * cos
            loss = model(**_batch(rng, recipe, tok, proc, prefix)).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(round(loss.item(), 4))
            if progress and (step % 50 == 0 or step == recipe.steps - 1):
                print(f"step {step + 1}/{recipe.steps}  loss {losses[-1]:.3f}  {time.perf_counter() - t0:.0f} s",
                      flush=True)
        seconds = time.perf_counter() - t0
        model.eval()
        vision = {k[len("model."):]: v.detach().to(torch.float16).contiguous()
                  for k, v in model.state_dict().items() if k.startswith("model.visual.")}
        # evaluated as shipped: the tower rounded to float16
        shipped = build_model(recipe, lm_dir, vision)
        result = evaluate(shipped, recipe, tok)
        if progress:
            print(f"held-out accuracy {result['accuracy']} (colour {result['colour_accuracy']}, shape "
                  f"{result['shape_accuracy']}; chance {result['chance']})")
        save_file(vision, str(work / VISION_FILE))
        (work / PROCESSOR_FILE).write_text(json.dumps(processor_config(recipe), indent=1) + "\n")
        record = {"name": NAME, "recipe": dataclasses.asdict(recipe),
                  "language_model": {"path": "toolkit/embedded/model",
                                     "weights_sha256": sha256_file(lm_dir / "model.safetensors"), "frozen": True},
                  "vision_parameters": sum(v.numel() for v in vision.values()),
                  "train": {"seconds": round(seconds, 1), "threads": torch.get_num_threads(),
                            "loss_first": losses[0], "loss_last_50_mean": round(float(np.mean(losses[-50:])), 4),
                            "loss": losses[:: max(1, len(losses) // 100)]},
                  "eval": result}
        (work / RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return Path(out)



def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m toolkit.embedded.vl", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train the vision tower (the language model frozen)")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--steps", type=int, default=Recipe.steps)
    t.add_argument("--side", type=int, default=Recipe.side)
    t.add_argument("--overwrite", action="store_true")
    e = sub.add_parser("eval", help="the held-out accuracy of the assembled model")
    e.add_argument("--pictures", type=int, default=Recipe.eval_pictures)
    sub.add_parser("path", help="assemble the checkpoint (once) and print its directory")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "train":
            if a.steps < 1:
                ap.error(f"--steps {a.steps}: at least 1")
            if a.side < 32 or a.side % 32:
                ap.error(f"--side {a.side}: a multiple of 32, at least 32")
            print(f"wrote {train(a.out, Recipe(steps=a.steps, side=a.side), overwrite=a.overwrite)}")
        elif a.cmd == "eval" and a.pictures < 1:
            ap.error(f"--pictures {a.pictures}: at least 1")
        elif a.cmd == "path":
            print(model_dir(progress=True))
        else:
            from transformers import AutoTokenizer
            import transformers as T

            d = model_dir(progress=True)
            model = T.Qwen3VLMoeForConditionalGeneration.from_pretrained(str(d), dtype=torch.float32).eval()
            print(json.dumps(evaluate(model, shipped_recipe()[0], AutoTokenizer.from_pretrained(str(d)),
                                      n=a.pictures), indent=1))
    except SpecPrefetchError as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
