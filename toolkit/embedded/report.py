"""Quality report of a shipped model on its held-out text (text training never saw).

Held-out perplexity (teacher-forced, non-overlapping windows), routing health per layer (expert-load
entropy, share of experts used) over the same tokens, routing locality (how many experts a prompt
touches per layer, how soon a token's experts come back), and greedy continuations of fixed prompts.

    python -m toolkit.embedded.report [--model embedded|phone|DIR] [--windows N] [--json OUT]
        [--plot LOSS.png] [--usage-plot USAGE.png]
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from toolkit.artifacts import read_json, write_json_atomic
from toolkit.reporting import save_figure
import torch

from toolkit.models.loader import load_model, resolve_model_dir, shipped_model_name
from toolkit.traces.summary import routing_stats

HELDOUT = Path(__file__).resolve().parent / "heldout.jsonl"
PROMPTS = ["The Python interpreter", "abandon\n    v 1:", "The kernel's memory allocator",
           "A fool and his money", "To open a file for reading, use"]


@torch.no_grad()
def report(model: str | Path, windows: int = 200, seq_len: int = 512, samples: bool = True) -> dict:
    lm = load_model(model)
    texts = [json.loads(line)["text"] for line in HELDOUT.read_text().splitlines() if line.strip()]
    eos = lm.tokenizer.eos_token_id
    ids: list[int] = []
    for t in texts:
        ids += lm.tokenizer(t, add_special_tokens=False)["input_ids"] + [eos]
    tokens = torch.tensor(ids)
    E = lm.geometry.routing.num_experts
    load = np.zeros((len(lm.geometry.moe_layers), E), np.int64)
    batch_ids: dict[int, np.ndarray] = {}  # layer -> [B*T, k] of the current batch
    windows_ids: list[np.ndarray] = []  # per window [T, L, k]

    def hook(i):
        def f(mod, args, out):
            ids = out[2].reshape(-1, out[2].shape[-1]).numpy()
            load[i] += np.bincount(ids.reshape(-1), minlength=E)
            batch_ids[i] = ids
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
        per = np.stack([batch_ids[i] for i in range(len(lm.geometry.moe_layers))], 1)  # [B*T, L, k]
        windows_ids.extend(per.reshape(batch.shape[0], seq_len, *per.shape[1:]))
    for h in handles:
        h.remove()
    continuations = []
    for p in PROMPTS if samples else ():
        x = lm.tokenizer(p, return_tensors="pt")
        y = lm.model.generate(**x, max_new_tokens=40, do_sample=False, pad_token_id=eos)
        continuations.append({"prompt": p, "continuation": lm.tokenizer.decode(y[0, x["input_ids"].shape[1]:])})
    return {"model": str(lm.spec.path), "heldout_tokens_scored": count, "heldout_ppl": round(math.exp(nll / count), 3),
            "routing": routing_stats(load), "expert_load": load.tolist(),
            "locality": routing_locality(windows_ids, E), "samples": continuations}


def routing_locality(windows: list[np.ndarray], num_experts: int, spans: tuple[int, ...] = (32, 128, 512)) -> dict:
    """How local routing is in time, per MoE layer, over teacher-forced held-out windows ([T, L, k] each).

    - touched_frac[span]: the share of a layer's experts that a prompt of `span` tokens routes to at least
      once (mean over the windows' first `span` tokens): what a pool must hold for a prompt's working set.
    - overlap_prev: the share of a token's top-k that the previous token also chose (what LRU reuse sees).
    - reuse_distance_median / reuse_within_8: tokens since the same expert was last chosen at the same
      layer (over selections whose expert had been chosen before in the window), and the share of those
      back within 8 tokens.
    """
    L = windows[0].shape[1]
    out: dict = {"touched_frac": {}, "overlap_prev": [], "reuse_distance_median": [], "reuse_within_8": []}
    for span in spans:
        if span > windows[0].shape[0]:
            continue
        out["touched_frac"][str(span)] = [
            round(float(np.mean([len(np.unique(w[:span, li])) / num_experts for w in windows])), 4)
            for li in range(L)]
    for li in range(L):
        overlaps, dists = [], []
        for w in windows:
            sel = w[:, li]  # [T, k]
            T = sel.shape[0]
            member = np.zeros((T, num_experts), bool)
            member[np.arange(T)[:, None], sel] = True
            overlaps.append((member[1:] & member[:-1]).sum(1) / sel.shape[1])
            last = np.full(num_experts, -1)
            for t in range(T):
                prev = last[sel[t]]
                dists.extend((t - prev[prev >= 0]).tolist())
                last[sel[t]] = t
        d = np.asarray(dists)
        out["overlap_prev"].append(round(float(np.concatenate(overlaps).mean()), 4))
        out["reuse_distance_median"].append(float(np.median(d)) if len(d) else None)
        out["reuse_within_8"].append(round(float((d <= 8).mean()), 4) if len(d) else None)
    return out


def plot_usage(load: np.ndarray, path: Path, title: str) -> None:
    """Each layer's expert load as a share of a uniform share, experts sorted by load within the layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    share = load / load.sum(1, keepdims=True) * load.shape[1]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    im = a.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest")
    a.set_xlabel("expert")
    a.set_ylabel("MoE layer")
    a.set_title("load / uniform share")
    fig.colorbar(im, ax=a)
    for li, row in enumerate(np.sort(share, 1)[:, ::-1]):
        b.plot(row, color=plt.cm.viridis(li / max(1, len(share) - 1)), alpha=0.8, lw=1)
    b.axhline(1.0, color="k", lw=0.8, ls="--")
    b.set_xlabel("expert rank within its layer")
    b.set_ylabel("load / uniform share")
    b.set_title("sorted, one line per layer")
    fig.suptitle(title)
    save_figure(fig, path)


def plot_training(train_log: Path, path: Path, title: str = "embedded model training") -> None:
    """Training loss and held-out perplexity against tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = read_json(train_log, "training log")
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
    ax.set_title(title)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded", help="embedded, phone or a model directory")
    ap.add_argument("--windows", type=int, default=200)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="write the training curve PNG here")
    ap.add_argument("--usage-plot", type=Path, help="write the per-layer expert usage PNG here")
    a = ap.parse_args(argv)
    model_dir = resolve_model_dir(a.model)
    name = shipped_model_name(model_dir) or model_dir.name
    if a.plot:
        plot_training(model_dir / "train_log.json", a.plot, f"{name} model training")
    r = report(model_dir, a.windows)
    if a.usage_plot:
        plot_usage(np.asarray(r["expert_load"]), a.usage_plot, f"{name} model: expert usage on held-out text")
    print(f"held-out perplexity {r['heldout_ppl']} over {r['heldout_tokens_scored']:,} tokens")
    for row in r["routing"]:
        print(f"layer {row['layer']}: load entropy {row['load_entropy']:.3f}, "
              f"experts used {100 * row['experts_used']:.0f}%, max load {row['max_load_x_uniform']:.2f}x uniform")
    loc = r["locality"]
    for span, fr in loc["touched_frac"].items():
        print(f"a prompt of {span} tokens touches {100 * np.mean(fr):.0f}% of a layer's experts "
              f"(layers {100 * min(fr):.0f}-{100 * max(fr):.0f}%)")
    print(f"top-k shared with the previous token: {100 * np.mean(loc['overlap_prev']):.0f}%; "
          f"median reuse distance {np.median(loc['reuse_distance_median']):.0f} tokens, "
          f"{100 * np.mean(loc['reuse_within_8']):.0f}% back within 8 tokens")
    for s in r["samples"]:
        print(f"--- {s['prompt']!r} -> {s['continuation']!r}")
    if a.json:
        write_json_atomic(a.json, r)


if __name__ == "__main__":
    main()
