"""Train the prefetch adapter on routing traces (`specprefetch train`).

Loss: KL(real router distribution at step (i, h) || predicted), weighted per horizon (default 2 for
h = 1, 1 otherwise), optionally plus a top-k ranking term (the negative log-probability the
prediction gives the real top-k experts). Backbone, routers and experts stay frozen: only the
adapter's A and B train. Batches stream from the trace's train split (ShardStream), so traces larger
than memory train fine; 5% of the train sequences are set aside for validation, early stopping keeps
the best validation state, and the held-out split stays untouched for `eval`.
"""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from adapters.checkpoint import save_adapter
from adapters.lowrank import PrefetchAdapter
from adapters.reuse import CLASSES as REUSE_CLASSES
from adapters.reuse import MAX_CLASSES, MAX_NEXT_VISITS, NEXT_VISITS, learn_class_reuse_table
from toolkit.errors import SpecPrefetchError
from toolkit.jsonvalues import is_int, is_number
from toolkit.metrics import recall, topk_hits
from toolkit.models.families import router_distribution
from toolkit.models.routers import RouterBank, load_router_bank
from toolkit.artifacts import claim_output
from toolkit.traces.batches import RoutingBatch, ShardStream, check_device, validation_batches
from toolkit.traces.format import TraceReader, routing_sequences, trace_model_spec


@dataclasses.dataclass
class TrainConfig:
    rank: int = 64
    horizons: tuple[int, ...] = (1, 2)
    cross_token: bool = True
    # heads for each layer's next N visits (horizons L, 2L, ...), for the reuse eviction; None: NEXT_VISITS
    # (3) with cross_token, else 0
    next_visits: int | None = None
    horizon_weights: dict[int, float] | None = None  # default: 2.0 for h=1, 1.0 otherwise
    # the next-visit heads' loss weight (horizons L, 2L, ..., where not also one of `horizons`)
    next_visit_weight: float = 1.0
    topk_weight: float = 0.0
    steps: int = 3000
    batch_size: int = 512
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup: int = 50
    val_every: int = 100
    patience: int = 6
    seed: int = 0
    device: str = "cpu"
    max_memory_mb: int = 512
    # the reuse table's frequency classes per layer (adapters/reuse.py; 1: one table for every expert)
    reuse_classes: int = REUSE_CLASSES

    def __post_init__(self):
        if self.next_visits is None:  # the default, crossing the token boundary as cross_token does
            self.next_visits = NEXT_VISITS if self.cross_token else 0

    def validate(self) -> None:
        """One-line errors naming the option, before any work."""
        def shown(v: Any) -> Any:   # a value that is not a number at all, shown as what it is ('0.1' (str))
            return v if is_number(v) or isinstance(v, float) else f"{v!r} ({type(v).__name__})"

        def bad(option: str, value: Any, what: str) -> SpecPrefetchError:
            return SpecPrefetchError(f"{option} {value}: {what}")

        for option, value in (("--rank", self.rank), ("--steps", self.steps), ("--batch-size", self.batch_size),
                              ("--val-every", self.val_every), ("--patience", self.patience),
                              ("--max-memory-mb", self.max_memory_mb), ("warmup", self.warmup),
                              ("--reuse-classes", self.reuse_classes)):
            if not is_int(value) or value < 1:
                raise bad(option, value, "must be a whole number >= 1")
        if not self.horizons or any(not is_int(h) or not 1 <= h <= 4 for h in self.horizons):
            raise bad("--horizons", ",".join(map(str, self.horizons)) or "''", "each horizon must lie in 1..4")
        if self.reuse_classes > MAX_CLASSES:
            raise bad("--reuse-classes", self.reuse_classes, f"must lie in 1..{MAX_CLASSES}")
        if not (is_number(self.lr) and self.lr > 0):
            raise bad("--lr", shown(self.lr), "must be a finite number > 0")
        if not (is_number(self.weight_decay) and self.weight_decay >= 0):
            raise bad("weight_decay", shown(self.weight_decay), "must be a finite number >= 0")
        if not (is_number(self.topk_weight) and self.topk_weight >= 0):
            raise bad("--topk-weight", shown(self.topk_weight), "must be a finite number >= 0")
        w = self.next_visit_weight
        if not (is_number(w) and w >= 0):
            raise bad("--next-visit-weight", shown(w), "must be a finite number >= 0")
        if not (is_int(self.next_visits) and 0 <= self.next_visits <= MAX_NEXT_VISITS):
            raise bad("--next-visits", shown(self.next_visits), f"must be a whole number in 0..{MAX_NEXT_VISITS}")
        if not self.next_visits and w != 1.0:
            raise bad("--next-visit-weight", w, "this adapter has no next-visit heads")
        for h, w in (self.horizon_weights or {}).items():
            if not is_int(h) or h not in self.horizons:
                raise bad("--horizon-weights", f"{shown(h)}:{shown(w)}", f"horizon {shown(h)} is not one of --horizons "
                          f"{','.join(map(str, self.horizons))}")
            if not (is_number(w) and w >= 0):
                raise bad("--horizon-weights", f"{shown(h)}:{shown(w)}", "weights must be finite numbers >= 0")
        if self.next_visits and not self.cross_token:
            raise SpecPrefetchError(f"--next-visits {self.next_visits}: the next visit is the next token's: it needs "
                                    "--cross-token")
        if sum(self.weight(h) for h in self.horizons) <= 0:
            raise bad("--horizon-weights", self.horizon_weights, "at least one weight must be > 0")
        check_device(self.device)

    def weight(self, h: int) -> float:
        if self.horizon_weights and h in self.horizon_weights:
            return float(self.horizon_weights[h])
        return 2.0 if h == 1 else 1.0

    def pair_weight(self, h: int, num_layers: int) -> float:
        """A pair's loss weight: its horizon's, or the next-visit heads' for a horizon jL (num_layers) that is
        not one of the window's horizons. Validation (early stopping) weighs pairs alike."""
        if h % num_layers == 0 and h // num_layers <= self.next_visits and h not in self.horizons:
            return float(self.next_visit_weight)
        return self.weight(h)


def pair_targets(adapter: PrefetchAdapter, b: RoutingBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Targets of every pair: probs [B, P, E], ids [B, P, k], valid [B, P]."""
    probs, ids, valid = [], [], []
    for i, h in adapter.pairs:
        probs.append(b.target_probs(i, h))
        t_ids, ok = b.target_ids(i, h)
        ids.append(t_ids)
        valid.append(ok)
    return torch.stack(probs, 1), torch.stack(ids, 1), torch.stack(valid, 1)


def pair_loss(adapter: PrefetchAdapter, bank: RouterBank, b: RoutingBatch, cfg: TrainConfig,
              weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted loss, per-pair mean KL [P]) of a batch."""
    logits = adapter.all_logits(bank, b.hidden)                       # [B, P, E]
    B, P, E = logits.shape
    q = router_distribution(logits.reshape(-1, E), bank.spec).reshape(B, P, E)
    logq = q.clamp_min(1e-12).log()
    t, ids, valid = pair_targets(adapter, b)
    t = t / t.sum(-1, keepdim=True).clamp_min(1e-12)
    kl = (t * (t.clamp_min(1e-12).log() - logq)).sum(-1)               # [B, P]
    v = valid.float()
    per_pair = (kl * v).sum(0) / v.sum(0).clamp_min(1)
    loss = (per_pair * weights).sum() / weights.sum()
    if cfg.topk_weight > 0:
        nll = -logq.gather(-1, ids).mean(-1)                          # [B, P]
        loss = loss + cfg.topk_weight * ((nll * v).sum(0) / v.sum(0).clamp_min(1) * weights).sum() / weights.sum()
    return loss, per_pair.detach()


@torch.no_grad()
def validate(adapter: PrefetchAdapter, bank: RouterBank, val: list[RoutingBatch], cfg: TrainConfig,
             weights: torch.Tensor) -> dict[str, Any]:
    k = bank.spec.top_k
    loss_sum, n = 0.0, 0
    hits = {h: [0.0, 0] for h in adapter.all_horizons}
    for b in val:
        b = b.to(cfg.device)
        loss, _ = pair_loss(adapter, bank, b, cfg, weights)
        loss_sum += float(loss) * len(b)
        n += len(b)
        logits = adapter.all_logits(bank, b.hidden)
        _, ids, valid = pair_targets(adapter, b)
        for p, (i, h) in enumerate(adapter.pairs):
            s = bank.selection_scores(logits[:, p], adapter.target_layer(i, h))
            ok = valid[:, p]
            if ok.any():
                hits[h][0] += topk_hits(s[ok], ids[ok, p], k)
                hits[h][1] += int(ok.sum())
    return {"loss": loss_sum / max(1, n),
            "recall_at_k": {str(h): recall(v[0], v[1], k) for h, v in hits.items()}}


def bank_to(bank: RouterBank, device: str) -> RouterBank:
    """The routers with every tensor on `device`."""
    move = lambda t: t.to(device) if t is not None else None  # noqa: E731
    return dataclasses.replace(bank, weight=move(bank.weight), bias=move(bank.bias),
                               score_bias=move(bank.score_bias))


def train_adapter(trace: Path, out: Path, cfg: TrainConfig, *, model: str | Path | None = None,
                  overwrite: bool = False, progress: bool = True) -> dict[str, Any]:
    """Train an adapter on the trace's train split and write it to `out` (an existing `out` only
    with `overwrite`, and only if it is an adapter). The model is the trace's (its recorded absolute
    path) or `model`, checked against the trace's config hash; runs on `cfg.device`."""
    cfg.validate()
    reader = TraceReader(trace)
    spec = trace_model_spec(reader, model)
    L = len(spec.geometry.moe_layers)
    if cfg.next_visits and cfg.next_visit_weight != 1.0 and all(j * L in cfg.horizons
                                                                 for j in range(1, cfg.next_visits + 1)):
        raise SpecPrefetchError(f"--next-visit-weight {cfg.next_visit_weight:g}: this model's next visits (horizons "
                                f"{L}..{cfg.next_visits * L}) are all among --horizons; weigh them with "
                                f"--horizon-weights " + ",".join(f"{j * L}:W" for j in range(1, cfg.next_visits + 1)))
    inputs = (Path(trace).resolve(), spec.path)
    claim_output(out, kind="adapter", overwrite=overwrite, inputs=inputs)  # before the training, not after
    if not reader.shards("train"):
        raise SpecPrefetchError(f"trace {trace} has no train split to learn from")
    if not any(s.get("hidden_tokens", 1) for s in reader.shards("train")):
        raise SpecPrefetchError(f"trace {trace} stores no router inputs (hidden states)")
    n_train = len(reader.sequences("train"))
    if n_train < 2:
        raise SpecPrefetchError(f"trace {trace} has {n_train} train sequence{'s' if n_train != 1 else ''}: train "
                                "sets 5% of them (at least one) aside for validation and needs at least 2; "
                                "trace more sequences")
    torch.manual_seed(cfg.seed)
    bank = bank_to(load_router_bank(spec), cfg.device)
    g = spec.geometry
    adapter = PrefetchAdapter(num_layers=len(g.moe_layers), hidden_size=g.hidden_size,
                              num_experts=g.routing.num_experts, horizons=cfg.horizons, rank=cfg.rank,
                              cross_token=cfg.cross_token, next_visits=cfg.next_visits,
                              seed=cfg.seed).to(cfg.device)
    weights = torch.tensor([cfg.pair_weight(h, adapter.num_layers) for _, h in adapter.pairs], device=cfg.device)
    val = [b.to(cfg.device) for b in validation_batches(reader, ahead=adapter.tokens_ahead,
                                                        max_bytes=cfg.max_memory_mb * 2**20)]
    if not val:
        raise SpecPrefetchError(f"trace {trace}: its validation sequences (5% of the {n_train} train "
                                "sequences, at least one) store no router inputs; trace more sequences")
    stream = ShardStream(reader, "train", batch_size=cfg.batch_size, seed=cfg.seed,
                         max_bytes=cfg.max_memory_mb * 2**20, ahead=adapter.tokens_ahead)
    opt = torch.optim.AdamW(adapter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    start = validate(adapter, bank, val, cfg, weights)  # B = 0: the next-gate baseline
    best = {"step": 0, **start}
    best_state = {k: v.detach().clone() for k, v in adapter.state_dict().items()}
    curve = [{"step": 0, **start}]
    bad = 0
    t0 = time.time()
    bar = tqdm(total=cfg.steps, desc="train adapter", unit="step", disable=not progress)
    step = 0
    for b in stream:
        if step >= cfg.steps:
            break
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for grp in opt.param_groups:
            grp["lr"] = lr
        loss, _ = pair_loss(adapter, bank, b.to(cfg.device), cfg, weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        bar.update(1)
        if step % cfg.val_every == 0 or step == cfg.steps:
            v = validate(adapter, bank, val, cfg, weights)
            curve.append({"step": step, "train_loss": round(float(loss.detach()), 5), **v})
            bar.set_postfix(val_loss=f"{v['loss']:.4f}", recall=v["recall_at_k"])
            if v["loss"] < best["loss"] - 1e-5:
                best = {"step": step, **v}
                best_state = {k: t.detach().clone() for k, t in adapter.state_dict().items()}
                bad = 0
            else:
                bad += 1
                if bad >= cfg.patience:
                    break
    bar.close()
    adapter.load_state_dict(best_state)
    from toolkit.models.info import model_info

    model_params = model_info(spec)["total_params"]
    result = {
        "training": {**{k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()},
                     "steps_run": step, "best_step": best["step"], "seconds": round(time.time() - t0, 1),
                     "stream_peak_bytes": stream.peak_bytes, "epochs": stream.epochs},
        "trace": {"path": str(Path(trace).resolve()), "train_tokens": reader.manifest["tokens"]["train"]["total"]},
        "validation": {"next_gate": start, "adapter": {k: best[k] for k in ("loss", "recall_at_k")},
                       "curve": curve},
        "model_params": model_params,
        "share_of_model": adapter.params() / model_params,
    }
    result["reuse"] = learn_class_reuse_table(routing_sequences(reader, "train"), g.routing.num_experts,
                                              classes=cfg.reuse_classes, where=f"trace {trace}").to_json()
    adapter.to("cpu")
    save_adapter(adapter, out, spec, result, overwrite=overwrite, inputs=inputs)
    return {"params": adapter.params(), **result}
