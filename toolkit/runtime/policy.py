"""A run's policy: a predictor and an eviction rule, written PREDICTOR+EVICTION (one parser)."""
from __future__ import annotations

import dataclasses

from toolkit.errors import SpecPrefetchError
from toolkit.predictors.registry import check_name
from toolkit.runtime.pool import EVICTION_POLICIES


@dataclasses.dataclass(frozen=True)
class Policy:
    predictor: str            # a predictor name (toolkit/predictors/registry.py), or "on-demand"
    eviction: str = "lru"     # lru, lfu, prediction, belady, reuse

    @property
    def name(self) -> str:
        return f"{self.predictor}+{self.eviction}"

    @property
    def needs_future(self) -> bool:
        """The oracle predictor and Belady eviction read the run's real future routing."""
        return self.predictor == "oracle" or self.eviction == "belady"

    @staticmethod
    def parse(text: str, option: str = "--policy") -> "Policy":
        pred, _, ev = text.strip().partition("+")
        check_name(pred, option)
        ev = ev or "lru"
        if ev not in EVICTION_POLICIES:
            raise SpecPrefetchError(f"{option}: unknown eviction {ev!r} in {text.strip()!r}; choose from "
                                    f"{', '.join(EVICTION_POLICIES)}")
        return Policy(pred, ev)


def parse_policies(text: str, option: str = "--policies") -> list[Policy]:
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise SpecPrefetchError(f"{option} {text!r}: expected PREDICTOR+EVICTION[,...]")
    return [Policy.parse(t, option) for t in items]
