"""`specprefetch eval`: every predictor on the held-out decode tokens of a trace.

Per predictor and horizon h: recall@k, recall and precision within a candidate budget M (default
2k), per-layer recall@k curves, and the predictor's parameter count. Results go to JSON
(`{"k": K, "budget": M, "predictors": {NAME: {"recall_at_k": {"1": x, ...}, "params": n, ...}}}`),
a Markdown table and a PNG plot. A metric with nothing to measure (within-token recall at a horizon
past the model's MoE layers, a layer no token reaches) is null in the JSON and n/a in the table.
Metric definitions: toolkit/metrics.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from toolkit.reporting import save_figure, write_report
from toolkit.errors import SpecPrefetchError
from toolkit.metrics import precision, recall, topk_hits
from toolkit.models.routers import load_router_bank
from toolkit.predictors.base import Predictor
from toolkit.predictors.registry import EVAL_PREDICTORS, build_predictor
from toolkit.traces.batches import iter_batches
from toolkit.traces.format import DECODE, IMAGE, TraceReader

ALL = EVAL_PREDICTORS


def frequency_counts(reader: TraceReader) -> torch.Tensor:
    from toolkit.traces.summary import expert_load

    return torch.from_numpy(expert_load(reader, "train"))


def build_predictors(names: list[str], reader: TraceReader, spec, adapter_path: Path | None,
                     draft_bits: int = 4) -> tuple[dict[str, Predictor], dict[str, Any]]:
    """The named predictors (through the registry), and notes on the adapter and the draft."""
    import functools

    bank = functools.cache(lambda: load_router_bank(spec))
    notes: dict[str, Any] = {}

    def adapter():
        from adapters.checkpoint import load_adapter

        ad, meta = load_adapter(adapter_path, spec)
        notes["adapter"] = {"path": str(adapter_path), "rank": meta["rank"],
                            "horizons": meta["horizons"], "share_of_model": meta.get("share_of_model")}
        return ad

    def draft():
        from toolkit.models.loader import load_model
        from toolkit.predictors.draft import DraftPredictor

        d = DraftPredictor(load_model(spec.path), reader, expert_bits=draft_bits)
        notes["draft"] = {"expert_bits": draft_bits, "acceptance_rate": round(d.acceptance, 4),
                          "acceptance_tokens": d.proposed}
        return d

    out: dict[str, Predictor] = {}
    for n in names:
        if n == "on-demand":
            raise SpecPrefetchError("--predictors: on-demand predicts nothing; choose from "
                                    + ", ".join(EVAL_PREDICTORS))
        out[n] = build_predictor(n, num_experts=spec.geometry.routing.num_experts, bank=bank,
                                 adapter=adapter if adapter_path is not None else None,
                                 counts=lambda: frequency_counts(reader), draft=draft, option="--predictors")
    return out, notes


def evaluate(trace: Path, *, predictors: list[str], adapter: Path | None = None,
             model: str | Path | None = None, horizons: tuple[int, ...] | None = None,
             budget: int | None = None, draft_bits: int = 4, progress: bool = True) -> dict[str, Any]:
    from toolkit.traces.format import trace_model_spec

    reader = TraceReader(trace)
    spec = trace_model_spec(reader, model)
    k = spec.geometry.routing.top_k
    E = spec.geometry.routing.num_experts
    M = budget or min(E, 2 * k)
    if not k <= M <= E:
        raise SpecPrefetchError(f"--budget {M}: must be between k={k} and E={E}")
    if not reader.shards("heldout"):
        raise SpecPrefetchError(f"trace {trace} has no held-out split (trace with --heldout-frac > 0)")
    L = len(reader.moe_layers)
    visit_hs: set[int] = set()   # the next-visit heads' horizons (L, 2L, ...): every source layer has them
    meta = None
    if adapter is not None:
        from adapters.checkpoint import meta_next_visits, read_adapter_meta

        meta = read_adapter_meta(Path(adapter))
        visit_hs = {j * L for j in range(1, meta_next_visits(meta, Path(adapter) / "adapter.json") + 1)}
    if horizons is None:   # the adapter's (with next-visit heads, theirs too: L, 2L, ..., each layer's next visits)
        horizons = (1, 2) if meta is None else tuple(sorted(set(meta["horizons"]) | visit_hs))
    beyond = [h for h in horizons if h >= 2 * L and h not in visit_hs]
    if beyond:   # past the next token only a next-visit head predicts (the others would be scored on nothing)
        heads = ", ".join(map(str, sorted(visit_hs))) or "none"
        raise SpecPrefetchError(f"--horizons {','.join(map(str, horizons))}: horizon {beyond[0]} lies past the next "
                                f"token; there only the adapter's next-visit heads' horizons ({heads}) are scored")
    preds, notes = build_predictors(predictors, reader, spec, adapter, draft_bits)
    batches, image_batches = [], []
    # held-out decode tokens; and, for a vision-language trace, its image tokens (prompt positions, each
    # of whose hidden states the trace sampled), measured apart
    for b in iter_batches(reader, "heldout", with_probs=False, ahead=max(1, max(horizons) // L)):
        for kind, out in ((DECODE, batches), (IMAGE, image_batches)):
            sel = b.select(b.kind == kind)
            if len(sel):
                out.append(sel)
    if not batches:
        raise SpecPrefetchError(f"trace {trace}: no held-out decode tokens (trace with --decode-tokens > 0)")

    def accumulate(bs, what: str) -> dict:
        # acc[name][h] = arrays over source layer i: hits@k, hits@M, rows
        acc = {n: {h: np.zeros((3, L)) for h in horizons} for n in preds}
        for b in tqdm(bs, desc=f"eval ({what})", unit="shard", disable=not progress):
            for h in horizons:
                for i in range(L):
                    if i + h >= 2 * L and h not in visit_hs:   # past the next token: the visits' heads only
                        continue
                    ids, ok = b.target_ids(i, h)
                    if not ok.any():
                        continue
                    for n, p in preds.items():
                        s = p.scores(b, i, h)[ok]
                        acc[n][h][0, i] += topk_hits(s, ids[ok], k)
                        acc[n][h][1, i] += topk_hits(s, ids[ok], M)
                        acc[n][h][2, i] += int(ok.sum())
        return acc

    acc = accumulate(batches, "decode tokens")
    acc_img = accumulate(image_batches, "image tokens") if image_batches else None
    result: dict[str, Any] = {"k": k, "budget": M, "trace": str(Path(trace).resolve()),
                              "model": {"family": spec.family.name, "config_hash": spec.config_hash,
                                        "path": str(spec.path)},
                              "decode_tokens": int(sum(len(b) for b in batches)),
                              "image_tokens": int(sum(len(b) for b in image_batches)),
                              "horizons": list(horizons), "predictors": {}}
    for n, p in preds.items():
        r: dict[str, Any] = {"recall_at_k": {}, "recall_at_k_within_token": {}, "recall_at_budget": {},
                             "precision_at_budget": {}, "per_layer_recall_at_k": {}, "params": p.params()}
        for h in horizons:
            hk, hm, rows = acc[n][h]
            tot = rows.sum()
            r["recall_at_k"][str(h)] = recall(hk.sum(), tot, k)
            r["recall_at_budget"][str(h)] = recall(hm.sum(), tot, k)
            r["precision_at_budget"][str(h)] = precision(hm.sum(), tot, M)
            same = slice(0, max(0, L - h))  # source layers whose target is in the same token (none when h >= L)
            r["recall_at_k_within_token"][str(h)] = recall(hk[same].sum(), rows[same].sum(), k)
            r["per_layer_recall_at_k"][str(h)] = [recall(a, c, k) for a, c in zip(hk, rows)]
        if acc_img is not None:  # the same figures on the image tokens
            r["image_tokens"] = {"recall_at_k": {}, "recall_at_budget": {}}
            for h in horizons:
                hk, hm, rows = acc_img[n][h]
                r["image_tokens"]["recall_at_k"][str(h)] = recall(hk.sum(), rows.sum(), k)
                r["image_tokens"]["recall_at_budget"][str(h)] = recall(hm.sum(), rows.sum(), k)
        r.update(notes.get(n, {}))
        result["predictors"][n] = r
    return result


def cell(v: float | None) -> str:
    """A metric for the table: n/a where it is undefined."""
    return "n/a" if v is None else f"{v:.3f}"


def markdown(result: dict[str, Any]) -> str:
    hs = result["horizons"]
    k, M = result["k"], result["budget"]
    head = ("| predictor | params | " + " | ".join(f"recall@{k} h={h}" for h in hs) + " | "
            + " | ".join(f"within-token recall@{k} h={h}" for h in hs) + " | "
            + " | ".join(f"recall@{M} h={h}" for h in hs) + " | "
            + " | ".join(f"precision@{M} h={h}" for h in hs) + " |")
    lines = [f"Held-out decode tokens: {result['decode_tokens']} ({result['model']['family']}, "
             f"top-{k}, budget M={M}).", "", head, "|" + "---|" * (2 + 4 * len(hs))]
    for n, r in result["predictors"].items():
        cells = [n, f"{r['params']:,}"]
        cells += [cell(r["recall_at_k"][str(h)]) for h in hs]
        cells += [cell(r["recall_at_k_within_token"][str(h)]) for h in hs]
        cells += [cell(r["recall_at_budget"][str(h)]) for h in hs]
        cells += [cell(r["precision_at_budget"][str(h)]) for h in hs]
        lines.append("| " + " | ".join(cells) + " |")
    if result.get("image_tokens"):
        lines += ["", f"Held-out image tokens (prompt positions of images, apart from the text): "
                      f"{result['image_tokens']}.", "",
                  "| predictor | " + " | ".join(f"recall@{k} h={h}" for h in hs) + " | "
                  + " | ".join(f"recall@{M} h={h}" for h in hs) + " |", "|" + "---|" * (1 + 2 * len(hs))]
        for n, r in result["predictors"].items():
            im = r["image_tokens"]
            lines.append("| " + " | ".join([n] + [cell(im["recall_at_k"][str(h)]) for h in hs]
                                            + [cell(im["recall_at_budget"][str(h)]) for h in hs]) + " |")
    if "draft" in result["predictors"]:
        d = result["predictors"]["draft"]
        lines += ["", f"Draft: int{d['expert_bits']} experts, acceptance rate {d['acceptance_rate']:.3f} "
                      f"over {d['acceptance_tokens']} decode tokens."]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hs = result["horizons"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for n, r in result["predictors"].items():
        nan = float("nan")  # an undefined point is left out of the line
        # the horizons evenly spaced (1, 2 and the next visit's L are not a scale)
        axes[0].plot(range(len(hs)), [nan if r["recall_at_k"][str(h)] is None else r["recall_at_k"][str(h)]
                                      for h in hs], "o-", label=n)
        per_layer = [nan if v is None else v for v in r["per_layer_recall_at_k"][str(hs[0])]]
        axes[1].plot(range(len(per_layer)), per_layer, "o-", label=n)
    axes[0].set_xlabel("horizon h (MoE layers ahead)")
    axes[0].set_ylabel(f"recall@{result['k']}")
    axes[0].set_xticks(range(len(hs)), [str(h) for h in hs])
    axes[1].set_xlabel("source MoE layer i")
    axes[1].set_ylabel(f"recall@{result['k']} at h={hs[0]}")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 1.02)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"prefetch predictors, held-out decode tokens ({result['model']['family']})")
    save_figure(fig, path)


def write_reports(result: dict[str, Any], json_path: Path) -> tuple[Path, Path]:
    return write_report(result, json_path, markdown, plot)


