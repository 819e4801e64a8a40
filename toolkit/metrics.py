"""The one definition of each metric the toolkit reports (eval, simulate, bench and runner alike).

recall@k      |predicted top-k ∩ real top-k| / k                   (SpecPrefetch)
recall@M      |predicted top-M ∩ real top-k| / k  for a candidate budget M >= k
precision@M   |predicted top-M ∩ real top-k| / M
hit rate      pool hits / expert requests
prefetch precision   prefetched slots used / prefetches issued
prefetch recall      loads a prefetch supplied / all loads (prefetch hits + demand misses)
TPOT          (t_last - t_first) / (N - 1) over committed tokens; TTFT separately
median, percentile   over the defined values (None skipped), numpy's linear interpolation
"""
from __future__ import annotations

import numpy as np
import torch


def overlap(pred_ids: torch.Tensor, real_ids: torch.Tensor) -> torch.Tensor:
    """Per row, how many of `real_ids` [T, k] appear in `pred_ids` [T, m]."""
    return (pred_ids.unsqueeze(-1) == real_ids.unsqueeze(-2)).any(-2).sum(-1)


def topk_overlap(scores: torch.Tensor, real_ids: torch.Tensor, m: int) -> torch.Tensor:
    """Overlap of the top-m of `scores` [T, E] with the real top-k ids [T, k]; per row."""
    return overlap(torch.topk(scores, m, dim=-1).indices, real_ids.long())


def share(hits: float, total: float) -> float | None:
    """hits / total rounded to 4 places; None (JSON null, printed n/a) where nothing was measured,
    e.g. within-token recall at a horizon past the model's last MoE layer: undefined, not 0."""
    return round(float(hits / total), 4) if total > 0 else None


def topk_hits(scores: torch.Tensor, real_ids: torch.Tensor, m: int) -> int:
    """How many of the real top-k ids [T, k] fall in the top-m of `scores` [T, E], over all rows: the
    numerator every recall@k, recall@M and precision@M is accumulated from (eval and train alike)."""
    return int(topk_overlap(scores, real_ids, m).sum())


def recall(hits: float, rows: float, k: int) -> float | None:
    """recall@k (or @M): accumulated `topk_hits` over `rows` token rows of k real experts each."""
    return share(hits, rows * k)


def precision(hits: float, rows: float, m: int) -> float | None:
    """precision@M: accumulated `topk_hits` at budget M over `rows` rows of M candidates each."""
    return share(hits, rows * m)


def rate(count: int, requests: int) -> float:
    """A count per expert request (hit rate, late rate); 0 when nothing was requested."""
    return count / requests if requests else 0.0


def prefetch_precision(prefetch_hits: int, issued: int) -> float:
    return prefetch_hits / issued if issued else 0.0


def prefetch_recall(prefetch_hits: int, misses: int) -> float:
    loads = prefetch_hits + misses
    return prefetch_hits / loads if loads else 0.0


def tpot_ms(token_times_s: list[float] | np.ndarray) -> float:
    """Time per output token: (last - first) / (N - 1), in milliseconds."""
    t = np.asarray(token_times_s, dtype=np.float64)
    if len(t) < 2:
        return float("nan")
    return float((t[-1] - t[0]) / (len(t) - 1) * 1e3)


def _defined(values) -> list[float]:
    return [v for v in values if v is not None]


def median(values, ndigits: int | None = 4) -> float | None:
    """The median of the defined values (numpy's: the mean of the two middle ones for an even count),
    rounded to `ndigits` places (None: not rounded); None when no value is defined (a run that stopped
    at EOS after one token has no TPOT). The one median every bench report uses."""
    vals = _defined(values)
    if not vals:
        return None
    v = float(np.median(vals))
    return v if ndigits is None else round(v, ndigits)


def median_low(values):
    """The middle one of the defined values, the lower of the two middle ones for an even count (a value
    that occurred, e.g. a whole number of KiB; the native runner's lower_median); None when none is defined."""
    vals = sorted(_defined(values))
    return vals[(len(vals) - 1) // 2] if vals else None


def percentile(values, q: float, ndigits: int | None = 4) -> float | None:
    """The q-th percentile (0..100) of the defined values by numpy's default linear interpolation,
    rounded to `ndigits` places (None: not rounded); None when no value is defined. The one percentile
    every bench report uses (p5, p95)."""
    vals = _defined(values)
    if not vals:
        return None
    v = float(np.percentile(vals, q))
    return v if ndigits is None else round(v, ndigits)
