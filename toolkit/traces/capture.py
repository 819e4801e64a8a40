"""Capture routing traces: run a model over text (and images) in prefill and greedy decode, and
record per token and MoE layer what its router saw and chose.

A forward hook on each MoE layer's router module (transformers 5 routers return
`(logits, top-k weights, top-k ids)`) records the router input, the selected ids and weights exactly
as the model applied them, and the router's probability vector. Nothing about the model's
computation changes: hooks only read.

On a GPU several prompts go through each forward pass (`TraceSettings.batch`, default 16 there and
1 on the CPU), padded with an attention mask; what is recorded per prompt is what tracing it alone
records (docs/trace-format.md, "Batching prompts"). The options and the output are checked
before the model loads, the split before any prompt is traced; the manifest records the model and
the data as absolute paths.
"""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from toolkit.errors import SpecPrefetchError, interrupt_on_signals
from toolkit.models.families import router_distribution
from toolkit.artifacts import claim_output
from toolkit.models.loader import LoadedModel, load_model, parse_max_memory, resolve_model_dir
from toolkit.traces.batches import check_device
from toolkit.traces.data import Record, check_input, file_sha256, read_records
from toolkit.traces.format import DECODE, IMAGE, PREFILL, TraceWriter

FULL_PROBS_MAX_EXPERTS = 256
DEFAULT_TOP_M = 64
DEFAULT_GPU_BATCH = 16


@dataclasses.dataclass(frozen=True)
class TraceSettings:
    prompt_tokens: int = 256       # tokens per prompt (text is cut into prompts this long)
    decode_tokens: int = 32        # greedy decode steps recorded after each prompt
    max_sequences: int | None = None  # None: every prompt of the data; else at least 1
    probs_top_m: int | None = None  # None: full vector up to 256 experts, else top-64
    hidden_sample: float = 1.0     # share of prefill tokens whose router input is kept
    heldout_frac: float = 0.1
    seed: int = 0
    shard_tokens: int = 16384
    device: str = "cpu"
    dtype: str = "float32"
    batch: int | None = None       # prompts per forward pass; None: 1 on the CPU, 16 on a GPU
    max_memory: str | None = None  # --device auto's budgets, e.g. "0=40GiB,cpu=200GiB" (loader.parse_max_memory)

    def validate(self) -> None:
        if self.prompt_tokens < 1:
            raise SpecPrefetchError("--prompt-tokens must be at least 1")
        if self.decode_tokens < 0:
            raise SpecPrefetchError("--decode-tokens must be >= 0")
        if self.max_sequences is not None and self.max_sequences < 1:
            raise SpecPrefetchError(f"--max-sequences {self.max_sequences}: must be at least 1 "
                                    "(leave it out to trace every prompt of the data)")
        if not 0.0 <= self.hidden_sample <= 1.0:
            raise SpecPrefetchError("--hidden-sample must be between 0 and 1")
        if not 0.0 <= self.heldout_frac < 1.0:
            raise SpecPrefetchError("--heldout-frac must be in [0, 1)")
        if self.shard_tokens < 1:
            raise SpecPrefetchError("--shard-tokens must be at least 1")
        if self.batch is not None and self.batch < 1:
            raise SpecPrefetchError(f"--batch {self.batch}: must be at least 1")
        if self.max_memory is not None:
            if self.device != "auto":
                raise SpecPrefetchError(f"--max-memory needs --device auto (not --device {self.device})")
            parse_max_memory(self.max_memory)
        else:
            check_device(self.device, allow_auto=True)

    def memory_budgets(self) -> dict[int | str, int] | None:
        return parse_max_memory(self.max_memory) if self.max_memory is not None else None

    def prompts_per_batch(self) -> int:
        if self.batch is not None:
            return self.batch
        return 1 if self.computes_on_cpu() else DEFAULT_GPU_BATCH

    def computes_on_cpu(self) -> bool:
        """cpu; auto without a GPU; auto with --max-memory that gives no GPU a budget (all on the host)."""
        if self.device == "cpu":
            return True
        if self.device != "auto":
            return False
        if not torch.cuda.is_available():
            return True
        return self.max_memory is not None and not any(isinstance(k, int) for k in parse_max_memory(self.max_memory))


@dataclasses.dataclass
class Prompt:
    seq: int
    key: str
    ids: list[int]
    image: Path | None
    split: str
    continuation: list[int] | None = None   # decoded teacher-forced instead of greedily (the record's)


def is_heldout(key: str, frac: float, seed: int) -> bool:
    h = int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big")
    return (h % 1_000_000) < frac * 1_000_000


def make_prompts(records: list[Record], tokenizer, s: TraceSettings) -> list[Prompt]:
    prompts: list[Prompt] = []
    for r in records:
        ids = tokenizer(r.text, add_special_tokens=False)["input_ids"]
        chunks = [ids[i:i + s.prompt_tokens] for i in range(0, len(ids), s.prompt_tokens)]
        chunks = [c for c in chunks if len(c) >= min(8, s.prompt_tokens)] or [ids[: s.prompt_tokens]]
        if r.continuation is not None and len(ids) > s.prompt_tokens:
            raise SpecPrefetchError(f"{r.source}:{r.index}: \"continuation_ids\" follows the whole text, which is "
                                    f"{len(ids)} tokens, more than --prompt-tokens {s.prompt_tokens}")
        for ci, c in enumerate(chunks):
            if not c:
                continue
            key = f"{Path(r.source).name}:{r.index}:{ci}"
            split = "heldout" if is_heldout(key, s.heldout_frac, s.seed) else "train"
            prompts.append(Prompt(len(prompts), key, c, r.image if ci == 0 else None, split, r.continuation))
            if s.max_sequences is not None and len(prompts) >= s.max_sequences:
                return prompts
    return prompts


def check_split(prompts: list[Prompt], s: TraceSettings) -> None:
    """Refuse, before any model work, a split that leaves eval/simulate or train nothing: with
    --heldout-frac > 0, no held-out sequence; and no train sequence at all."""
    n = len(prompts)
    if n == 0:
        raise SpecPrefetchError("--data: no text to trace (every record is empty after tokenization)")
    held = sum(p.split == "heldout" for p in prompts)
    what = f"{n} sequence{'s' if n != 1 else ''} x --heldout-frac {s.heldout_frac:g}"
    more = ("trace more sequences (more --data, a larger --max-sequences or a smaller --prompt-tokens)")
    if s.heldout_frac > 0 and held == 0:
        raise SpecPrefetchError(f"{what} holds out 0: eval and simulate would have no held-out sequence; "
                                f"{more}, raise --heldout-frac, or pass --heldout-frac 0 for a trace "
                                "without a held-out split")
    if held == n:
        raise SpecPrefetchError(f"{what} holds out all {n}: train would have no sequence to learn from; "
                                f"{more} or lower --heldout-frac")


class RouterRecorder:
    """Forward hooks on every MoE router; collects the records of every forward call since the
    last reset (one sequence, or one batch of sequences, at a time)."""

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
            logits, weights, ids = (t.detach().reshape(-1, t.shape[-1]) for t in output[:3])
            # the router input is stored as float16 (the trace's dtype: the same rounding as later)
            self.calls[i].append((hidden.to("cpu", torch.float16), logits.to("cpu", torch.float32),
                                  weights.to("cpu", torch.float32), ids.to("cpu")))
        return hook

    def reset(self) -> None:
        self.calls = [[] for _ in self.layers]

    NAMES = ("hidden", "logits", "weights", "ids")

    def per_call(self) -> list[dict[str, torch.Tensor]]:
        """Per forward call since the last reset: [rows, L, ...] tensors."""
        counts = {len(c) for c in self.calls}
        if len(counts) != 1:
            raise SpecPrefetchError(f"MoE layers saw different numbers of forward calls {sorted(counts)}")
        out = []
        for call in zip(*self.calls):  # one tuple per layer
            rows = {part[0].shape[0] for part in call}
            if len(rows) != 1:
                raise SpecPrefetchError(f"MoE layers saw different token counts {sorted(rows)}")
            out.append({n: torch.stack([part[j] for part in call], dim=1) for j, n in enumerate(self.NAMES)})
        return out

    def stacked(self) -> dict[str, torch.Tensor]:
        """[T, L, ...] tensors over every forward call since the last reset."""
        per_layer = [[torch.cat(parts) for parts in zip(*calls)] for calls in self.calls]
        lengths = {p[0].shape[0] for p in per_layer}
        if len(lengths) != 1:
            raise SpecPrefetchError(f"MoE layers saw different token counts {sorted(lengths)}")
        return {n: torch.stack([p[j] for p in per_layer], dim=1) for j, n in enumerate(self.NAMES)}

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def build_inputs(lm: LoadedModel, p: Prompt) -> tuple[dict[str, Any], np.ndarray]:
    """Model inputs for one prompt, and the per-position kind (PREFILL or IMAGE)."""
    ids = list(p.ids)
    kinds = [PREFILL] * len(ids)
    extra: dict[str, Any] = {}
    if p.image is not None:
        from toolkit.traces.data import open_image

        cfg = lm.spec.config
        img = open_image(p.image, "image")  # what the runners take: PNG or JPEG, within the pixel cap
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


def _pad_id(lm: LoadedModel) -> int:
    eos = lm.tokenizer.eos_token_id
    return eos if eos is not None else 0


def _eos_ids(lm: LoadedModel) -> set[int]:
    """The tokens that end greedy generation (the generation config's, as generate() uses)."""
    e = getattr(getattr(lm.model, "generation_config", None), "eos_token_id", None)
    if e is None:
        return set()
    return {int(x) for x in e} if isinstance(e, (list, tuple)) else {int(e)}


def sequence_arrays(lm: LoadedModel, p: Prompt, s: TraceSettings, top_m: int | None, kinds: np.ndarray,
                    full: list[int], t: dict[str, torch.Tensor]) -> tuple[dict[str, np.ndarray], int]:
    """One sequence's shard rows from its recorded router calls `t` ([n, L, ...], prompt rows then
    one row per decode step) and `full`, the prompt followed by the generated tokens."""
    n_prompt = len(kinds)
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


@torch.no_grad()
def trace_sequence(lm: LoadedModel, rec: RouterRecorder, p: Prompt, s: TraceSettings,
                   top_m: int | None) -> tuple[dict[str, np.ndarray], int]:
    """One prompt alone: prefill, then greedy decode (stopping early at an end-of-sequence token), or,
    with a continuation, up to --decode-tokens of its tokens fed after the prompt in the same pass, its
    last one never (teacher-forced: decode row j consumes continuation[j], as greedy decode's consumes
    its j-th token and never the one it made last)."""
    inputs, kinds = build_inputs(lm, p)
    rec.reset()
    if p.continuation is not None and s.decode_tokens > 0:
        vocab = lm.model.get_input_embeddings().num_embeddings
        bad = [t for t in p.continuation if t >= vocab]
        if bad:
            raise SpecPrefetchError(f"sequence {p.key}: continuation_ids {bad[0]} is outside the model's "
                                    f"vocabulary ({vocab} tokens)")
        full = inputs["input_ids"][0].tolist() + list(p.continuation)
        # the last continuation token is not fed, as greedy decode never feeds the token it made last
        fed = torch.tensor([full[:len(kinds) + min(s.decode_tokens, len(p.continuation) - 1)]],
                           device=lm.input_device)
        extra = {"input_ids": fed, "attention_mask": torch.ones_like(fed)}
        if "mm_token_type_ids" in inputs:   # the continuation is text
            mm = inputs["mm_token_type_ids"]
            extra["mm_token_type_ids"] = torch.cat([mm, mm.new_zeros(1, fed.shape[1] - mm.shape[1])], 1)
        lm.model(**{**inputs, **extra})
    elif s.decode_tokens > 0:
        out = lm.model.generate(**inputs, do_sample=False, max_new_tokens=s.decode_tokens + 1,
                                pad_token_id=_pad_id(lm))
        full = out[0].tolist()
    else:
        lm.model(**inputs)
        full = inputs["input_ids"][0].tolist()
    return sequence_arrays(lm, p, s, top_m, kinds, full, rec.stacked())


@torch.no_grad()
def trace_batch(lm: LoadedModel, rec: RouterRecorder, prompts: list[Prompt], s: TraceSettings,
                top_m: int | None) -> list[tuple[dict[str, np.ndarray], int]]:
    """Several text prompts in one forward per step, recording what each would record alone.

    Prompts are padded to the longest with an attention mask: on the left for greedy decode
    (generate() derives positions from the mask, so each prompt keeps positions 0..n-1), on the
    right for prefill alone (causal attention never sees the padding after a token). Padding rows
    are dropped, and so are a sequence's decode steps after it produced an end-of-sequence token,
    where decoding it alone would have stopped."""
    if len(prompts) == 1 or any(p.image is not None or p.continuation is not None for p in prompts):
        return [trace_sequence(lm, rec, p, s, top_m) for p in prompts]
    B = len(prompts)
    lens = [len(p.ids) for p in prompts]
    T = max(lens)
    pad = _pad_id(lm)
    left = s.decode_tokens > 0
    ids = torch.full((B, T), pad, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    for b, p in enumerate(prompts):
        cols = slice(T - lens[b], T) if left else slice(0, lens[b])
        ids[b, cols] = torch.tensor(p.ids)
        mask[b, cols] = 1
    ids, mask = ids.to(lm.input_device), mask.to(lm.input_device)
    rec.reset()
    if left:
        out = lm.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                max_new_tokens=s.decode_tokens + 1, pad_token_id=pad)
        gen = out[:, T:].cpu()
    else:
        lm.model(input_ids=ids, attention_mask=mask)
        gen = torch.zeros((B, 0), dtype=torch.long)
    calls = rec.per_call()
    steps = len(calls) - 1  # decode forwards after the prefill
    if not calls or calls[0]["ids"].shape[0] != B * T or any(c["ids"].shape[0] != B for c in calls[1:]) \
            or (left and gen.shape[1] != steps + 1):
        raise SpecPrefetchError(f"batched trace of sequences {prompts[0].seq}..{prompts[-1].seq}: the routers "
                                "saw an unexpected number of tokens; trace with --batch 1")
    pre = {k: v.reshape(B, T, *v.shape[1:]) for k, v in calls[0].items()}
    dec = {k: torch.stack([c[k] for c in calls[1:]], 1) if steps else pre[k][:, :0] for k in pre}
    eos = _eos_ids(lm)
    results = []
    for b, p in enumerate(prompts):
        g = gen[b].tolist()
        stop = next((j for j, tok in enumerate(g) if tok in eos), steps)  # alone, it stops at EOS
        stop = min(stop, steps)
        cols = slice(T - lens[b], T) if left else slice(0, lens[b])
        t = {k: torch.cat([pre[k][b, cols], dec[k][b, :stop]]) for k in pre}
        kinds = np.full(lens[b], PREFILL, np.uint8)
        results.append(sequence_arrays(lm, p, s, top_m, kinds, list(p.ids) + g[:stop + 1], t))
    return results


def run_trace(model: str | Path, data: list[Path], out: Path, s: TraceSettings, *,
              overwrite: bool = False, progress: bool = True) -> Path:
    """Trace `model` over `data` into `out`; resumes an interrupted run with the same settings.

    The manifest records the model directory and the data files as absolute paths, so the trace
    is used the same way from any working directory."""
    s.validate()
    out = Path(out)
    data = [Path(d) for d in data]
    for d in data:  # each a regular file of bounded size (a FIFO or /dev/zero is refused), before any work
        check_input(d)
    inputs = tuple(d.resolve() for d in data) + (resolve_model_dir(model).resolve(),)
    claim_output(out, kind="trace", overwrite=overwrite, inputs=inputs)  # before the model loads
    lm = load_model(model, device=s.device, dtype=s.dtype, max_memory=s.memory_budgets(),
                    offload_dir=out.resolve().parent)
    try:
        return _trace(lm, data, out, s, inputs, overwrite, progress)
    finally:
        lm.close()  # the disk offload folder, if --max-memory made one


def _trace(lm: LoadedModel, data: list[Path], out: Path, s: TraceSettings, inputs, overwrite: bool,
           progress: bool) -> Path:
    model_path = lm.spec.path.resolve()
    records = read_records(data, allow_images=lm.family.is_vision_language)
    prompts = make_prompts(records, lm.tokenizer, s)
    check_split(prompts, s)
    spec = lm.geometry.routing
    top_m = s.probs_top_m
    if top_m is None and spec.num_experts > FULL_PROBS_MAX_EXPERTS:
        top_m = DEFAULT_TOP_M
    if top_m is not None and not 1 <= top_m <= spec.num_experts:
        raise SpecPrefetchError(f"--probs-top-m {top_m}: must be between 1 and {spec.num_experts}")
    if top_m == spec.num_experts:
        top_m = None
    # VL prompts carry images (and M-RoPE positions): they are traced one at a time
    per_batch = 1 if lm.family.is_vision_language else s.prompts_per_batch()
    geo = lm.geometry
    header = {
        "model": {"path": str(model_path), "model_id": lm.spec.model_id, "family": geo.family,
                  "model_type": geo.model_type, "config_hash": lm.spec.config_hash,
                  "num_layers": geo.num_layers, "moe_layers": list(geo.moe_layers),
                  "num_experts": spec.num_experts, "top_k": spec.top_k,
                  "hidden_size": geo.hidden_size, "routing": dataclasses.asdict(spec)},
        "data": [{"path": str(d.resolve()), "sha256": file_sha256(d)} for d in data],
        "settings": dataclasses.asdict(s) | {"batch": per_batch, "placement": lm.placement,
                                             "probs": "full" if top_m is None else f"top-{top_m}",
                                             "sequences": len(prompts)},
    }
    with interrupt_on_signals(), TraceWriter(out, header, overwrite=overwrite, inputs=inputs) as writer:
        rec = RouterRecorder(lm)
        todo = prompts[writer.next_seq:]
        bar = tqdm(total=len(prompts), initial=writer.next_seq, unit="seq", desc="trace",
                   disable=not progress)
        try:
            for start in range(0, len(todo), per_batch):
                group = todo[start:start + per_batch]
                try:
                    results = trace_batch(lm, rec, group, s, top_m)
                except torch.OutOfMemoryError:
                    raise SpecPrefetchError(f"--device {s.device}: out of memory tracing {len(group)} prompts "
                                            f"of up to {max(len(p.ids) for p in group)} tokens at once; pass "
                                            "a smaller --batch") from None
                for p, (arrays, n) in zip(group, results):
                    writer.add_sequence(p.seq, p.split, arrays, n)
                    bar.update(1)
                    if writer.buffered_tokens() >= s.shard_tokens:
                        writer.flush(p.seq + 1)
            writer.flush(len(prompts))
        finally:
            rec.close()
            bar.close()
        return writer.finish({})
