"""The export's parity check: a bundle's graphs against the eager reference (export/eager.py).

Parity runs the reference and the bundle over the same tokens, so one early difference cannot
cascade, and compares logits, router top-k ids and greedy next tokens at every position
(`compare`), against bounds per quantization (`Tolerance`, `check`); `free_running` measures how far
the bundle's own greedy continuation follows the reference's.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from export.eager import Record
from toolkit.errors import SpecPrefetchError


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """A bundle is refused when any figure is past its bound.

    The gated logit and top-k figures come from the bundle run with the reference's expert choice
    forced (see `run_sequence`): in reduced precision a router near-tie can flip one expert, which
    moves the logits of that and later positions far more than rounding does, so flips are counted
    on their own (top-k agreement) and the logit bounds measure the graphs' numerical error.
    The free-running run (the bundle decoding greedily from each prompt on its own) bounds how far
    its greedy continuation follows the reference's before the first different token.
    """
    max_abs_logit_diff: float             # worst position, absolute
    max_rel_logit_diff: float             # worst position, relative to the largest |reference logit|
    max_median_logit_diff: float          # median position, absolute
    min_topk_agreement: float             # share of (position, MoE layer) choosing the same expert set
    min_next_token_agreement: float       # share of positions with the same greedy next token
    min_free_token_match: float           # free-running: share of decoded tokens before the first difference

    @staticmethod
    def for_quant(quant: str, experts: str = "fp16") -> "Tolerance":
        """The bounds for dense graphs of `quant` with an expert store of `experts`. int8 / int4
        experts are computed on int8-quantised activations by both engines (the native kernels'
        integer dot products, docs/runner.md), which turns rounding-level differences into ~0.03 logit
        differences: an fp32 bundle with such a store gets the fp16 bounds."""
        inf = float("inf")
        if quant == "fp32" and experts in ("int8", "int4"):
            quant = "fp16"
        if quant == "fp32":
            return Tolerance(1e-3, 1e-4, 1e-4, 0.995, 1.0, 0.9)
        if quant == "fp16":
            return Tolerance(inf, 0.02, 0.1, 0.95, 0.95, 0.5)
        # quantized graphs are compared with the PyTorch graphs quantized the same way (executorch),
        # or with the fp32 graphs (qnn QDQ, whose same-quantization CPU run is reported beside)
        return Tolerance(inf, 0.15, 0.5, 0.85, 0.85, 0.3)

    def with_overrides(self, overrides: dict[str, float]) -> "Tolerance":
        bad = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if bad:
            raise SpecPrefetchError(f"--tolerance: unknown key(s) {sorted(bad)}; known: "
                                    f"{[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **overrides)


def compare(ref: list[Record], got: list[Record]) -> dict[str, float]:
    """Parity figures over every position of every sequence."""
    per_pos, agree_sets, overlap, agree_tok, n_pos, n_route = [], 0, 0.0, 0, 0, 0
    for r, g in zip(ref, got):
        per_pos.append((r.logits - g.logits.float()).abs().amax(-1))
        n_pos += r.logits.shape[0]
        agree_tok += int((r.next_tokens == g.next_tokens).sum())
        if r.ids.numel():
            rs, gs = r.ids.sort(-1).values, g.ids.sort(-1).values
            agree_sets += int((rs == gs).all(-1).sum())
            n_route += rs.shape[0] * rs.shape[1]
            k = rs.shape[-1]
            hits = (r.ids.unsqueeze(-1) == g.ids.unsqueeze(-2)).any(-1).sum(-1).float() / k
            overlap += float(hits.sum())
    d = torch.cat(per_pos)
    d = torch.where(torch.isfinite(d), d, torch.full_like(d, float("inf")))
    scale = max(float(r.logits.abs().max()) for r in ref)
    return {
        "positions": n_pos,
        "max_abs_logit_diff": float(d.max()),
        "max_rel_logit_diff": float(d.max()) / max(scale, 1e-9),
        "median_logit_diff": float(d.median()),
        "p95_logit_diff": float(d.quantile(0.95)) if torch.isfinite(d).all() else float("inf"),
        "topk_agreement": agree_sets / max(n_route, 1),
        "topk_overlap": overlap / max(n_route, 1),
        "next_token_agreement": agree_tok / max(n_pos, 1),
    }


def check(figures: dict[str, float], tol: Tolerance) -> list[str]:
    """The figures past tolerance, as messages (empty: parity holds)."""
    bad = []
    for fig, bound, label in (("max_abs_logit_diff", tol.max_abs_logit_diff, "max |logit diff|"),
                              ("max_rel_logit_diff", tol.max_rel_logit_diff, "max |logit diff| / max |logit|"),
                              ("median_logit_diff", tol.max_median_logit_diff, "median |logit diff|")):
        v = figures[fig]
        if not np.isfinite(v) or v > bound:
            bad.append(f"{label} {v:.4g} > {bound:g}")
    if figures["topk_agreement"] < tol.min_topk_agreement:
        bad.append(f"router top-k agreement {figures['topk_agreement']:.4f} < {tol.min_topk_agreement:g}")
    if figures["next_token_agreement"] < tol.min_next_token_agreement:
        bad.append(f"next-token agreement {figures['next_token_agreement']:.4f} < {tol.min_next_token_agreement:g}")
    free = figures.get("free_running", {}).get("token_match")
    if free is not None and free < tol.min_free_token_match:
        bad.append(f"free-running greedy token match {free:.4f} < {tol.min_free_token_match:g}")
    return bad


def free_running(refs: list[Record], frees: list[Record], prompt_lens: list[int]) -> dict[str, Any]:
    """How far each free-running greedy continuation follows the reference's: the mean share of
    decoded tokens before the first different one, and how many continuations are identical."""
    shares, identical = [], 0
    for r, f, n in zip(refs, frees, prompt_lens):
        a, b = r.tokens[n:], f.tokens[n:]
        same = 0
        for x, y in zip(a, b):
            if x != y:
                break
            same += 1
        shares.append(same / max(len(a), 1))
        identical += int(a == b)
    return {"token_match": sum(shares) / max(len(shares), 1), "identical": identical}



