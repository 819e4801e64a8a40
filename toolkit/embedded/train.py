"""Train the embedded default model: a small Qwen3-MoE on Debian-package text, from scratch.

The result is an ordinary Hugging Face checkpoint (config.json, model.safetensors, tokenizer), so the
toolkit loads it through exactly the path it uses for real checkpoints. Everything that decides the
result is here or in the corpus recipe (toolkit/embedded/corpus.py): seed, data, tokenizer,
architecture, optimiser, schedule. The loss curve and the held-out perplexity are written beside the
weights (train_log.json) and summarised in docs/embedded-model.md.

Run (GPU recommended; the same script runs on CPU, slowly)::

    python -m toolkit.embedded.corpus --out build/corpus
    python -m toolkit.embedded.train --corpus build/corpus --out build/embedded --steps 2500
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import lzma
import math
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from toolkit.artifacts import AtomicDirectory

EOS = "<|endoftext|>"
# Special tokens a vision-language tiny model needs; reserved now so the vocabulary never shifts.
RESERVED = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]


@dataclasses.dataclass
class Recipe:
    seed: int = 1234
    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    num_experts: int = 32
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 80
    router_aux_loss_coef: float = 0.01
    seq_len: int = 512
    batch_size: int = 64
    steps: int = 2500
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 200
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_every: int = 250
    eval_batches: int = 16


def read_jsonl_texts(path: Path) -> Iterator[str]:
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)["text"]


def corpus_file(corpus: Path, split: str) -> Path:
    for name in (f"{split}.jsonl", f"{split}.jsonl.xz"):
        if (corpus / name).exists():
            return corpus / name
    raise SystemExit(f"train: no {split}.jsonl(.xz) in {corpus}; build it with toolkit.embedded.corpus")


def train_tokenizer(texts: Iterator[str], vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2 style pre-tokenisation), deterministic for a fixed corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, *RESERVED],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_hf_tokenizer(tok, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
                                   bos_token=None, unk_token=None)
    fast.save_pretrained(out)


def encode(tok, texts: list[str]) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for i in range(0, len(texts), 256):
        for enc in tok.encode_batch(texts[i:i + 256]):
            ids.extend(enc.ids)
            ids.append(eos)
    return np.asarray(ids, dtype=np.uint16)


def build_config(r: Recipe, eos_id: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=r.vocab_size, hidden_size=r.hidden_size, intermediate_size=4 * r.hidden_size,
        num_hidden_layers=r.num_hidden_layers, num_attention_heads=r.num_attention_heads,
        num_key_value_heads=r.num_key_value_heads, head_dim=r.head_dim,
        num_experts=r.num_experts, num_experts_per_tok=r.num_experts_per_tok,
        moe_intermediate_size=r.moe_intermediate_size, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4 * r.seq_len,
        tie_word_embeddings=True, router_aux_loss_coef=r.router_aux_loss_coef,
        output_router_logits=False, eos_token_id=eos_id, bos_token_id=eos_id, pad_token_id=eos_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def lr_at(step: int, r: Recipe) -> float:
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    frac = (step - r.warmup) / max(1, r.steps - r.warmup)
    return r.lr * (1 - (1 - r.min_lr_frac) * frac)


def batches(tokens: np.ndarray, r: Recipe, gen: np.random.Generator) -> Iterator[torch.Tensor]:
    n = len(tokens) - r.seq_len - 1
    while True:
        starts = gen.integers(0, n, size=r.batch_size)
        yield torch.from_numpy(np.stack([tokens[s:s + r.seq_len + 1] for s in starts]).astype(np.int64))


@torch.no_grad()
def evaluate(model, tokens: np.ndarray, r: Recipe, device, amp) -> float:
    """Mean next-token loss over fixed, non-overlapping windows of the held-out tokens."""
    model.eval()
    L = r.seq_len + 1
    windows = [tokens[i:i + L] for i in range(0, len(tokens) - L, L)][: r.eval_batches * 16]
    total, count = 0.0, 0
    for i in range(0, len(windows), 16):
        x = torch.from_numpy(np.stack(windows[i:i + 16]).astype(np.int64)).to(device)
        with amp():
            out = model(input_ids=x[:, :-1])
        logits = out.logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 x[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    model.train()
    return total / max(1, count)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, help="reuse this tokenizer.json instead of training one")
    ap.add_argument("--max-shard-size", default="50GB",
                    help="split model.safetensors into shards of this size (e.g. 12MB to copy it in pieces)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                    help="cap --steps so training takes about this long: the rate is measured over "
                         "steps 10-30, inside the warm-up, where the schedule does not depend on the "
                         "step count yet; the steps actually run are recorded in train_log.json")
    for f in dataclasses.fields(Recipe):
        if f.type in ("int", "float"):
            ap.add_argument("--" + f.name.replace("_", "-"), type=eval(f.type), default=f.default)
    a = ap.parse_args(argv)
    if a.time_budget is not None and not (a.time_budget > 0 and a.warmup >= 30):
        ap.error("--time-budget: a positive number of seconds, with --warmup of at least 30 (the rate is "
                 "measured over steps 10-30, which must lie inside the warm-up)")
    r = Recipe(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Recipe) if hasattr(a, f.name)})

    out: Path = a.out
    # a work directory beside OUT, renamed to OUT when complete; an existing model directory is
    # replaced (this script rebuilds the embedded model), anything else is refused; any failure or
    # interrupt removes the work directory
    staging = AtomicDirectory(out, overwrite=True, kind="model", inputs=(a.corpus,))  # --tokenizer is read first
    try:
        _train(a, r, out, staging.work)
        staging.commit()
    except BaseException:
        staging.discard()
        raise
    print(f"saved {out}", flush=True)


def _train(a, r: Recipe, out: Path, work: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(r.seed)
    gen = np.random.default_rng(r.seed)

    t0 = time.time()
    train_texts = list(read_jsonl_texts(corpus_file(a.corpus, "train")))
    held_texts = list(read_jsonl_texts(corpus_file(a.corpus, "heldout")))
    tok = Tokenizer.from_file(str(a.tokenizer)) if a.tokenizer else train_tokenizer(iter(train_texts), r.vocab_size)
    save_hf_tokenizer(tok, work)
    train_tokens = encode(tok, train_texts)
    held_tokens = encode(tok, held_texts)
    print(f"tokens: train {len(train_tokens):,} held-out {len(held_tokens):,} "
          f"({time.time() - t0:.0f}s)", flush=True)

    config = build_config(r, tok.token_to_id(EOS))
    config._experts_implementation = "grouped_mm"
    device = torch.device(a.device)
    model = Qwen3MoeForCausalLM(config).to(device)
    model.config.output_router_logits = True
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params:,}", flush=True)

    use_bf16 = device.type == "cuda"
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": r.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=r.lr, betas=r.betas, fused=use_bf16)
    log = {"recipe": dataclasses.asdict(r), "parameters": n_params,
           "train_tokens": int(len(train_tokens)), "heldout_tokens": int(len(held_tokens)),
           "device": str(device), "torch": torch.__version__, "curve": [], "eval": []}
    it = batches(train_tokens, r, gen)
    model.train()
    t1 = time.time()
    t_probe = None
    step = 0
    while step < r.steps:
        if a.time_budget is not None and step == 10:
            t_probe = time.time()
        if a.time_budget is not None and step == 30 and t_probe is not None:
            # the learning rate only depends on r.steps after the warm-up, so capping here keeps the
            # schedule exactly that of a run started with --steps equal to the cap
            per_step = (time.time() - t_probe) / 20
            cap = max(r.warmup + 1, int(a.time_budget / (per_step * 1.06)))  # ~6% for the evaluations
            if cap < r.steps:
                print(f"time budget {a.time_budget:.0f}s at {per_step * 1000:.0f} ms/step: "
                      f"steps {r.steps} -> {cap}", flush=True)
                r.steps = cap
                log["recipe"]["steps"] = cap
            log["probe_ms_per_step"] = round(per_step * 1000, 1)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, r)
        x = next(it).to(device, non_blocking=True)
        with amp():
            # transformers shifts the labels itself
            outp = model(input_ids=x, labels=x)
        loss = outp.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), r.grad_clip)
        opt.step()
        if step % 25 == 0 or step == r.steps - 1:
            lm = float(loss.detach()) - r.router_aux_loss_coef * float(outp.aux_loss.detach())
            log["curve"].append({"step": step, "loss": round(lm, 4), "aux": round(float(outp.aux_loss.detach()), 4),
                                 "lr": lr_at(step, r), "seconds": round(time.time() - t1, 1)})
            print(f"step {step} loss {lm:.3f} aux {float(outp.aux_loss.detach()):.3f} "
                  f"{time.time() - t1:.0f}s", flush=True)
        if (step + 1) % r.eval_every == 0 or step == r.steps - 1:
            held = evaluate(model, held_tokens, r, device, amp)
            log["eval"].append({"step": step + 1, "heldout_loss": round(held, 4),
                                "heldout_ppl": round(math.exp(held), 3)})
            print(f"eval step {step + 1}: held-out ppl {math.exp(held):.2f}", flush=True)
        step += 1
    log["train_seconds"] = round(time.time() - t1, 1)
    model.config.output_router_logits = False
    model.config._experts_implementation = None
    model.to(torch.bfloat16 if use_bf16 else torch.float32).to("cpu").to(torch.float16)
    model.save_pretrained(work, max_shard_size=a.max_shard_size)
    (work / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"trained in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
