"""Quality report of the embedded model on its held-out text (text training never saw).

Held-out perplexity (teacher-forced, non-overlapping windows), routing health per layer (expert-load
entropy, share of experts used) over the same tokens, and greedy continuations of fixed prompts.

    python -m toolkit.embedded.report [--model DIR] [--windows N] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from toolkit.reporting import save_figure
import torch

from toolkit.models.loader import embedded_model_dir, load_model
from toolkit.traces.summary import routing_stats

HELDOUT = Path(__file__).resolve().parent / "heldout.jsonl"
PROMPTS = ["The Python interpreter", "abandon\n    v 1:", "The kernel's memory allocator",
           "A fool and his money", "To open a file for reading, use"]


@torch.no_grad()
def report(model: str | Path, windows: int = 200, seq_len: int = 512) -> dict:
    lm = load_model(model)
    texts = [json.loads(line)["text"] for line in HELDOUT.read_text().splitlines() if line.strip()]
    eos = lm.tokenizer.eos_token_id
    ids: list[int] = []
    for t in texts:
        ids += lm.tokenizer(t, add_special_tokens=False)["input_ids"] + [eos]
    tokens = torch.tensor(ids)
    E = lm.geometry.routing.num_experts
    load = np.zeros((len(lm.geometry.moe_layers), E), np.int64)

    def hook(i):
        def f(mod, args, out):
            load[i] += np.bincount(out[2].reshape(-1).numpy(), minlength=E)
        return f

    handles = [lm.family.router(lm.model, layer).register_forward_hook(hook(i))
               for i, layer in enumerate(lm.geometry.moe_layers)]
    nll, count = 0.0, 0
    n_win = min(windows, (len(tokens) - 1) // (seq_len + 1))
    for w in range(0, n_win, 8):
        batch = torch.stack([tokens[i * (seq_len + 1):(i + 1) * (seq_len + 1)]
                             for i in range(w, min(n_win, w + 8))])
        logits = lm.model(input_ids=batch[:, :-1]).logits.float()
        nll += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 batch[:, 1:].reshape(-1), reduction="sum").item()
        count += batch[:, 1:].numel()
    for h in handles:
        h.remove()
    samples = []
    for p in PROMPTS:
        x = lm.tokenizer(p, return_tensors="pt")
        y = lm.model.generate(**x, max_new_tokens=40, do_sample=False, pad_token_id=eos)
        samples.append({"prompt": p, "continuation": lm.tokenizer.decode(y[0, x["input_ids"].shape[1]:])})
    return {"heldout_tokens_scored": count, "heldout_ppl": round(math.exp(nll / count), 3),
            "routing": routing_stats(load), "samples": samples}


def plot_training(train_log: Path, path: Path) -> None:
    """Training loss and held-out perplexity against tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = json.loads(train_log.read_text())
    per_step = log["recipe"]["batch_size"] * log["recipe"]["seq_len"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([c["step"] * per_step / 1e6 for c in log["curve"]], [c["loss"] for c in log["curve"]],
            label="train loss (LM)")
    ax.plot([e["step"] * per_step / 1e6 for e in log["eval"]], [e["heldout_loss"] for e in log["eval"]],
            "o-", label="held-out loss")
    ax.set_xlabel("tokens seen (M)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(1.5, 5)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("embedded model training")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(embedded_model_dir()))
    ap.add_argument("--windows", type=int, default=200)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="write the training curve PNG here")
    a = ap.parse_args(argv)
    if a.plot:
        plot_training(Path(a.model) / "train_log.json", a.plot)
    r = report(a.model, a.windows)
    print(f"held-out perplexity {r['heldout_ppl']} over {r['heldout_tokens_scored']:,} tokens")
    for row in r["routing"]:
        print(f"layer {row['layer']}: load entropy {row['load_entropy']:.3f}, "
              f"experts used {100 * row['experts_used']:.0f}%, max load {row['max_load_x_uniform']:.2f}x uniform")
    for s in r["samples"]:
        print(f"--- {s['prompt']!r} -> {s['continuation']!r}")
    if a.json:
        a.json.write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
