"""A run's policy: a predictor and an eviction rule, written PREDICTOR+EVICTION (one parser)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

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


# a row of a policy with other scheduler settings (runner bench --variant, bench gpu --variant):
# "<policy> scheduler=<key=value,...>"
VARIANT_TAG = " scheduler="
# what --variant may set, with each value's parser and check (the runners' option of the same name)
VARIANT_KEYS: dict[str, tuple[Callable[[str], Any], Callable[[Any], bool], str]] = {
    "window": (int, lambda v: v >= 1, "an integer >= 1"),
    "queue_depth": (int, lambda v: v >= 1, "an integer >= 1"),
    "candidate_threshold": (float, lambda v: 0 <= v <= 1, "a probability in [0, 1]"),
    "min_confidence": (float, lambda v: 0 <= v <= 1, "a probability in [0, 1]"),
    # off: the reuse eviction with the whole table only, not its frequency classes (run --no-reuse-classes;
    # on is every run's default: no variant)
    "reuse_classes": (lambda s: False if s == "off" else None, lambda v: True,   # (None: refused as unparsed)
                      "off (on is every run's default: no variant)"),
    # the reuse eviction reading at most this many of the adapter's next-visit heads (run --next-visits)
    "next_visits": (int, lambda v: v >= 0, "an integer >= 0"),
}
# the GPU tier's too: its read budget (KiB its copies deliver per layer step, at least one expert; run
# --read-budget-kib; `auto`: the bench measures it, the pinned-copy rate times a layer's resident step);
# there queue_depth is the prefetch copies issued per layer step
# and whose scheduler and pool decide (`host`: the Python one, or the native runner's through
# toolkit/runtime/native_sched.py: the same decisions off Python), the one key every policy takes;
# and where a folding planner's rows are computed (`plan`: on the device, on a stream of their own beside the
# next segment, the default; `inline`: on the device, on the compute stream before the layer's sync, as before;
# or `host`: the router's input read back and folded on the host: the same decisions on the CPU, on a GPU up
# to rounding at near-ties)
HOSTS = ("python", "native")
PLAN_ROWS = ("device", "inline", "host")
LAUNCHES = ("driver", "torch")   # whose calls launch the GPU tier's per-layer work (GpuEngine.configure)
# `run --device cuda --read-budget-kib auto`, refused: the GPU tier's budget is a number
GPU_AUTO_BUDGET = ("--read-budget-kib auto: the GPU tier takes a number (KiB a layer step); "
                   "`bench gpu --variant read_budget_kib=auto` measures this GPU's and prints it")
GPU_VARIANT_KEYS = {**VARIANT_KEYS, "read_budget_kib": (lambda s: s if s == "auto" else int(s),
                                                        lambda v: v == "auto" or v >= 1, "an integer >= 1 or auto"),
                    "host": (lambda s: s if s == "native" else None, lambda v: True,
                             "native (python is every row's own: no variant)"),
                    "plan": (lambda s: s if s in PLAN_ROWS[1:] else None, lambda v: True,
                             "host or inline (device is every row's own: no variant)"),
                    "launch": (lambda s: s if s == "torch" else None, lambda v: True,
                               "torch (driver is every row's own: no variant)")}


def parse_variant(spec: str, keys: dict = VARIANT_KEYS) -> dict[str, Any]:
    """`queue_depth=2,window=1` -> {"queue_depth": 2, "window": 1} (--variant); one line naming the option
    where a key or value is not one of `keys`'."""
    out: dict[str, Any] = {}
    for part in spec.split(","):
        key, eq, val = (x.strip() for x in part.partition("="))
        if key not in keys or not eq:
            raise SpecPrefetchError(f"--variant {spec}: '{part}' is not KEY=VALUE with KEY one of "
                                    f"{', '.join(keys)}")
        if key in out:
            raise SpecPrefetchError(f"--variant {spec}: {key} is given twice")
        conv, ok, what = keys[key]
        try:
            v = conv(val)
        except ValueError:
            v = None
        if v is None or not ok(v):
            raise SpecPrefetchError(f"--variant {spec}: {key} must be {what} (got '{val}')")
        out[key] = v
    return out


def variant_label(knobs: dict[str, Any]) -> str:
    """The canonical text of a variant's settings (sorted keys), as its rows are named."""
    return ",".join(f"{k}={'off' if knobs[k] is False else knobs[k]}" for k in sorted(knobs))


def parse_variants(specs: Iterable[str], keys: dict = VARIANT_KEYS) -> dict[str, dict[str, Any]]:
    """{label: settings} of every --variant (parse_variant), in order; two with the same settings refused."""
    knobs: dict[str, dict[str, Any]] = {}
    for spec in specs:
        v = parse_variant(spec, keys)
        if variant_label(v) in knobs:
            raise SpecPrefetchError(f"--variant {spec}: the same settings as another --variant")
        knobs[variant_label(v)] = v
    return knobs
