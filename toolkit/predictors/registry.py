"""The one registry of predictors: `eval` and the runner build every predictor by name from here.

Each entry needs some of: the routers (`bank`), the trained adapter, expert counts from a trace
(`counts`), or a draft model (`draft`). Callers pass what they have as zero-argument callables, so
nothing is loaded that the chosen predictor does not use, and a missing piece is a one-line error
naming the option that supplies it.
"""
from __future__ import annotations

from typing import Any, Callable

from toolkit.errors import SpecPrefetchError
from toolkit.predictors.base import (AdapterPredictor, FateStyle, Frequency, NextGate, Oracle, Predictor,
                                     PreviousToken)

PREDICTORS: dict[str, str] = {
    "on-demand": "no prediction: every expert is read when its layer's router picks it (the baseline)",
    "next-gate": "layer l+h's router on layer l's router input (training-free)",
    "fate": "layer l+h's router on layer l-1's router input (FATE-style)",
    "previous-token": "the experts the most recent token used at the target layer",
    "frequency": "each layer's most used experts over a trace's train split",
    "adapter": "the trained low-rank prefetch adapter (adapters/)",
    "draft": "the routing of an int4-expert draft of the model (Specter-style)",
    "oracle": "the real future routing (recorded): the upper bound",
}
EVAL_PREDICTORS = tuple(n for n in PREDICTORS if n != "on-demand")


def _need(piece: Callable[[], Any] | None, name: str, hint: str) -> Any:
    if piece is None:
        raise SpecPrefetchError(f"the {name} predictor needs {hint}")
    return piece()


def check_name(name: str, option: str = "--policy") -> None:
    if name not in PREDICTORS:
        raise SpecPrefetchError(f"{option}: unknown predictor {name!r}; choose from {', '.join(PREDICTORS)}")


def build_predictor(name: str, *, num_experts: int, bank: Callable[[], Any] | None = None,
                    adapter: Callable[[], Any] | None = None, counts: Callable[[], Any] | None = None,
                    draft: Callable[[], Predictor] | None = None, option: str = "--policy") -> Predictor | None:
    """The predictor `name` (None for on-demand).

    Args:
        num_experts: experts per MoE layer.
        bank: -> RouterBank (next-gate, fate, adapter).
        adapter: -> PrefetchAdapter (adapter).
        counts: -> expert counts [L, E] (frequency).
        draft: -> a draft predictor (draft).
    """
    check_name(name, option)
    if name == "on-demand":
        return None
    if name == "next-gate":
        return NextGate(_need(bank, name, "the model's routers"))
    if name == "fate":
        return FateStyle(_need(bank, name, "the model's routers"))
    if name == "previous-token":
        return PreviousToken(num_experts)
    if name == "oracle":
        return Oracle(num_experts)
    if name == "frequency":
        return Frequency(_need(counts, name, "expert counts (--frequency-trace TRACE)"))
    if name == "adapter":
        return AdapterPredictor(_need(adapter, name, "--adapter DIR"), _need(bank, name, "the model's routers"))
    return _need(draft, name, "the model directory (its int4 draft is built from the weights)")
