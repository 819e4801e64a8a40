"""Routing statistics of a trace: is routing spread over the experts or collapsed onto a few?

Per MoE layer: the normalised entropy of the expert load (1.0 = every expert chosen equally
often, 0 = one expert takes everything), the share of experts used at all, and the load of the
busiest expert relative to a uniform share. Printed as a table, written as JSON and a PNG plot.

    python -m toolkit.traces.summary TRACE_DIR [--split heldout] [--out DIR]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from toolkit.artifacts import os_error, write_json_atomic
from toolkit.errors import SpecPrefetchError
from toolkit.reporting import save_figure

from toolkit.traces.format import DECODE, TraceReader


def expert_load(reader: TraceReader, split: str, decode_only: bool = False) -> np.ndarray:
    """[L, E] count of selections per layer and expert, streamed shard by shard."""
    load = np.zeros((len(reader.moe_layers), reader.num_experts), np.int64)
    for a in reader.iter_shards(split):
        ids = a["expert_ids"]
        add_expert_load(load, ids[a["kind"] == DECODE] if decode_only else ids)
    return load


def add_expert_load(load: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Adds the selections of `ids` ([positions, L, k] expert ids) to `load` ([L, E]); returns it."""
    ids = np.asarray(ids)
    for li in range(ids.shape[1]):
        load[li] += np.bincount(ids[:, li].reshape(-1).astype(np.int64), minlength=load.shape[1])
    return load


def routing_stats(load: np.ndarray) -> list[dict]:
    rows = []
    e = load.shape[1]
    for li, counts in enumerate(load):
        total = counts.sum()
        p = counts / max(1, total)
        nz = p[p > 0]
        entropy = float(-(nz * np.log(nz)).sum() / np.log(e)) if total else 0.0
        rows.append({"layer": li, "selections": int(total), "load_entropy": round(entropy, 4),
                     "experts_used": round(float((counts > 0).mean()), 4),
                     "max_load_x_uniform": round(float(p.max() * e), 3) if total else 0.0})
    return rows


def summarize(trace: Path, split: str = "train", out: Path | None = None) -> list[dict]:
    from rich.console import Console
    from rich.table import Table

    reader = TraceReader(trace)
    load = expert_load(reader, split)
    rows = routing_stats(load)
    for r, layer in zip(rows, reader.moe_layers):
        r["layer"] = layer
    t = Table(title=f"routing of {reader.model['family']} over {trace} ({split})")
    for col in ("layer", "selections", "load entropy", "experts used", "max load / uniform"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["layer"]), str(r["selections"]), f"{r['load_entropy']:.3f}",
                  f"{100 * r['experts_used']:.0f}%", f"{r['max_load_x_uniform']:.2f}")
    Console().print(t)
    if out is not None:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise os_error(e, out) from None
        write_json_atomic(out / "routing_stats.json", rows)
        plot_load(load, reader.moe_layers, out / "expert_load.png",
                  f"expert load per layer ({reader.model['family']}, {split})")
    return rows


def plot_load(load: np.ndarray, layers: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    share = load / np.maximum(1, load.sum(1, keepdims=True)) * load.shape[1]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(layers) + 1.5))
    im = ax.imshow(share, aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(layers)), [str(x) for x in layers])
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="load / uniform share")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--split", default="train", choices=("train", "heldout"))
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    try:
        summarize(a.trace, a.split, a.out or a.trace.parent / (a.trace.name + "-summary"))
    except SpecPrefetchError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
