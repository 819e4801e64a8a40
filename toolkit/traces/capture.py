"""Capture routing traces: run a model over text (and images) in prefill and greedy decode, and
record per token and MoE layer what its router saw and chose.

A forward hook on each MoE layer's router module (transformers 5 routers return
`(logits, top-k weights, top-k ids)`) records the router input, the selected ids and weights exactly
as the model applied them, and the router's probability vector. Nothing about the model's
computation changes: hooks only read.
"""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from toolkit.errors import SpecPrefetchError
from toolkit.models.families import router_distribution
from toolkit.models.loader import LoadedModel, load_model
from toolkit.traces.data import Record, file_sha256, read_records
from toolkit.traces.format import DECODE, IMAGE, PREFILL, TraceWriter

FULL_PROBS_MAX_EXPERTS = 256
DEFAULT_TOP_M = 64


@dataclasses.dataclass(frozen=True)
class TraceSettings:
    prompt_tokens: int = 256       # tokens per prompt (text is cut into prompts this long)
    decode_tokens: int = 32        # greedy decode steps recorded after each prompt
    max_sequences: int | None = None
    probs_top_m: int | None = None  # None: full vector up to 256 experts, else top-64
    hidden_sample: float = 1.0     # share of prefill tokens whose router input is kept
    heldout_frac: float = 0.1
    seed: int = 0
    shard_tokens: int = 16384
    device: str = "cpu"
    dtype: str = "float32"

    def validate(self) -> None:
        if self.prompt_tokens < 1:
            raise SpecPrefetchError("--prompt-tokens must be at least 1")
        if self.decode_tokens < 0:
            raise SpecPrefetchError("--decode-tokens must be >= 0")
        if not 0.0 <= self.hidden_sample <= 1.0:
            raise SpecPrefetchError("--hidden-sample must be between 0 and 1")
        if not 0.0 <= self.heldout_frac < 1.0:
            raise SpecPrefetchError("--heldout-frac must be in [0, 1)")
        if self.shard_tokens < 1:
            raise SpecPrefetchError("--shard-tokens must be at least 1")


@dataclasses.dataclass
class Prompt:
    seq: int
    key: str
    ids: list[int]
    image: Path | None
    split: str


def is_heldout(key: str, frac: float, seed: int) -> bool:
    h = int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big")
    return (h % 1_000_000) < frac * 1_000_000


def make_prompts(records: list[Record], tokenizer, s: TraceSettings) -> list[Prompt]:
    prompts: list[Prompt] = []
    for r in records:
        ids = tokenizer(r.text, add_special_tokens=False)["input_ids"]
        chunks = [ids[i:i + s.prompt_tokens] for i in range(0, len(ids), s.prompt_tokens)]
        chunks = [c for c in chunks if len(c) >= min(8, s.prompt_tokens)] or [ids[: s.prompt_tokens]]
        for ci, c in enumerate(chunks):
            if not c:
                continue
            key = f"{Path(r.source).name}:{r.index}:{ci}"
            split = "heldout" if is_heldout(key, s.heldout_frac, s.seed) else "train"
            prompts.append(Prompt(len(prompts), key, c, r.image if ci == 0 else None, split))
            if s.max_sequences and len(prompts) >= s.max_sequences:
                return prompts
    return prompts


class RouterRecorder:
    """Forward hooks on every MoE router; collects one sequence's records at a time."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.layers = list(lm.geometry.moe_layers)
        self.hidden_size = lm.geometry.hidden_size
        self.calls: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in self.layers]
        self.handles = [lm.family.router(lm.model, layer).register_forward_hook(self._hook(i))
                        for i, layer in enumerate(self.layers)]

    def _hook(self, i: int):
        def hook(module, args, output):
            if not (isinstance(output, tuple) and len(output) >= 3):
                raise SpecPrefetchError(f"router of MoE layer {self.layers[i]} returned "
                                        f"{type(output).__name__}; expected (logits, weights, ids)")
            hidden = args[0].detach().reshape(-1, self.hidden_size)
            logits, weights, ids = (t.detach() for t in output[:3])
            self.calls[i].append((hidden.to("cpu", torch.float32), logits.to("cpu", torch.float32),
                                  weights.to("cpu", torch.float32), ids.to("cpu")))
        return hook

    def reset(self) -> None:
        self.calls = [[] for _ in self.layers]

    def stacked(self) -> dict[str, torch.Tensor]:
        """[T, L, ...] tensors over every forward call since the last reset."""
        per_layer = [[torch.cat(parts) for parts in zip(*calls)] for calls in self.calls]
        lengths = {p[0].shape[0] for p in per_layer}
        if len(lengths) != 1:
            raise SpecPrefetchError(f"MoE layers saw different token counts {sorted(lengths)}")
        names = ("hidden", "logits", "weights", "ids")
        return {n: torch.stack([p[j] for p in per_layer], dim=1) for j, n in enumerate(names)}

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def build_inputs(lm: LoadedModel, p: Prompt) -> tuple[dict[str, Any], np.ndarray]:
    """Model inputs for one prompt, and the per-position kind (PREFILL or IMAGE)."""
    ids = list(p.ids)
    kinds = [PREFILL] * len(ids)
    extra: dict[str, Any] = {}
    if p.image is not None:
        from PIL import Image

        cfg = lm.spec.config
        try:
            img = Image.open(p.image).convert("RGB")
        except OSError as e:
            raise SpecPrefetchError(f"image {p.image}: cannot be read ({e})") from None
        pix = lm.image_processor(images=[img], return_tensors="pt")
        grid = pix["image_grid_thw"]
        merge = int(getattr(lm.image_processor, "merge_size", 2))
        n_img = int(grid.prod()) // (merge * merge)
        vis = [cfg.vision_start_token_id] + [cfg.image_token_id] * n_img + [cfg.vision_end_token_id]
        ids = vis + ids
        kinds = [PREFILL] + [IMAGE] * n_img + [PREFILL] + kinds
        extra = {"pixel_values": pix["pixel_values"].to(lm.input_device, lm.model.dtype),
                 "image_grid_thw": grid.to(lm.input_device),
                 # 1 marks image positions, so M-RoPE gives them 2-D positions
                 "mm_token_type_ids": torch.tensor([[int(k == IMAGE) for k in kinds]], device=lm.input_device)}
    x = torch.tensor([ids], device=lm.input_device)
    return {"input_ids": x, "attention_mask": torch.ones_like(x), **extra}, np.asarray(kinds, np.uint8)


@torch.no_grad()
def trace_sequence(lm: LoadedModel, rec: RouterRecorder, p: Prompt, s: TraceSettings,
                   top_m: int | None) -> tuple[dict[str, np.ndarray], int]:
    inputs, kinds = build_inputs(lm, p)
    rec.reset()
    n_prompt = inputs["input_ids"].shape[1]
    eos = lm.tokenizer.eos_token_id
    if s.decode_tokens > 0:
        out = lm.model.generate(**inputs, do_sample=False, max_new_tokens=s.decode_tokens + 1,
                                pad_token_id=eos if eos is not None else 0)
        full = out[0].tolist()
    else:
        lm.model(**inputs)
        full = inputs["input_ids"][0].tolist()
    t = rec.stacked()
    n = t["ids"].shape[0]
    n_decode = n - n_prompt
    if n_decode < 0 or n > len(full):
        raise SpecPrefetchError(f"sequence {p.key}: recorded {n} tokens for a {n_prompt}-token prompt")
    spec = lm.geometry.routing
    kind = np.concatenate([kinds, np.full(n_decode, DECODE, np.uint8)])
    arrays = {
        "token_id": np.asarray(full[:n], np.int32),
        "seq": np.full(n, p.seq, np.int32),
        "pos": np.arange(n, dtype=np.int32),
        "kind": kind,
        "expert_ids": t["ids"].numpy().astype(np.int16 if spec.num_experts < 32768 else np.int32),
        "expert_weights": t["weights"].numpy().astype(np.float16),
    }
    probs = router_distribution(t["logits"], spec)  # [T, L, E]
    if top_m is None:
        arrays["router_probs"] = probs.numpy().astype(np.float16)
    else:
        v, i = torch.topk(probs, top_m, dim=-1)
        arrays["router_top_ids"] = i.numpy().astype(np.int16)
        arrays["router_top_probs"] = v.numpy().astype(np.float16)
    keep = kind == DECODE
    if s.hidden_sample >= 1.0:
        keep = np.ones(n, bool)
    elif s.hidden_sample > 0:
        rng = np.random.default_rng([s.seed, p.seq])
        keep |= rng.random(n) < s.hidden_sample
    rows = np.nonzero(keep)[0].astype(np.int32)
    arrays["hidden_rows"] = rows
    arrays["hidden"] = t["hidden"][torch.from_numpy(rows).long()].numpy().astype(np.float16)
    return arrays, n


def run_trace(model: str | Path, data: list[Path], out: Path, s: TraceSettings, *,
              overwrite: bool = False, progress: bool = True) -> Path:
    """Trace `model` over `data` into `out`; resumes an interrupted run with the same settings."""
    s.validate()
    lm = load_model(model, device=s.device, dtype=s.dtype)
    records = read_records([Path(d) for d in data], allow_images=lm.family.is_vision_language)
    prompts = make_prompts(records, lm.tokenizer, s)
    spec = lm.geometry.routing
    top_m = s.probs_top_m
    if top_m is None and spec.num_experts > FULL_PROBS_MAX_EXPERTS:
        top_m = DEFAULT_TOP_M
    if top_m is not None and not 1 <= top_m <= spec.num_experts:
        raise SpecPrefetchError(f"--probs-top-m {top_m}: must be between 1 and {spec.num_experts}")
    if top_m == spec.num_experts:
        top_m = None
    geo = lm.geometry
    header = {
        "model": {"path": str(lm.spec.path), "model_id": lm.spec.model_id, "family": geo.family,
                  "model_type": geo.model_type, "config_hash": lm.spec.config_hash,
                  "num_layers": geo.num_layers, "moe_layers": list(geo.moe_layers),
                  "num_experts": spec.num_experts, "top_k": spec.top_k,
                  "hidden_size": geo.hidden_size, "routing": dataclasses.asdict(spec)},
        "data": [{"path": str(Path(d).resolve()), "sha256": file_sha256(Path(d))} for d in data],
        "settings": dataclasses.asdict(s) | {"probs": "full" if top_m is None else f"top-{top_m}",
                                             "sequences": len(prompts)},
    }
    writer = TraceWriter(out, header, overwrite=overwrite)
    rec = RouterRecorder(lm)
    todo = prompts[writer.next_seq:]
    bar = tqdm(total=len(prompts), initial=writer.next_seq, unit="seq", desc="trace",
               disable=not progress)
    try:
        for p in todo:
            arrays, n = trace_sequence(lm, rec, p, s, top_m)
            writer.add_sequence(p.seq, p.split, arrays, n)
            bar.update(1)
            if writer.buffered_tokens() >= s.shard_tokens:
                writer.flush(p.seq + 1)
        writer.flush(len(prompts))
    finally:
        rec.close()
        bar.close()
    return writer.finish({})
