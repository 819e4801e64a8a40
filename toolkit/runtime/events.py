"""The decision log (`run --events FILE`): every scheduler and pool decision, one line each.

This is the contract between the Python reference runner and any other implementation (the C++
runner): for the same bundle, prompt, policy and budget (a read budget that is off or a number: one
measured in the run follows the steps' compute time), two runs write the same lines, apart from
the fields named `t_ms` (timings) and `conf` (probabilities, whose last printed digit another
backend may round differently), which `decisions()` strips before comparing. docs/runtime.md
documents every line; in short:

    # specprefetch-events 1 policy=adapter+prediction budget_bytes=... slot_bytes=... ...
    seq 0 prompt_tokens=6
    step 13 pos=1 layer=5                    a MoE layer starts (step = pos * L + layer)
    13 hit 5:17 prefetched=1                 resident when needed (first use of a prefetch)
    13 miss 5:3                              read on demand
    13 evict 2:9 for=5:3 prefetched_unused=0 the victim, and the expert that needed its slot
    13 prefetch 6:30 target=14 conf=0.8125   a read issued for a predicted step
    13 drop 7:1 reason=low_confidence target=15   (reasons: stale, low_confidence, no_slot, late)
    14 ready 6:30                            a prefetch is logically complete (the step after it was issued)
    14 budget kib=1081                       the read budget measured in the run changed (--read-budget-kib auto)
    token 1 pos=6 id=1234 t_ms=12.345        a committed token
    end tokens=8 t_ms=...

Keys print as layer:expert (MoE layer position, expert id). Booleans print as 0/1.
"""
from __future__ import annotations

import re
from toolkit.runtime.pool import Key

VERSION = 1


def _fmt(v) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, tuple):
        return f"{v[0]}:{v[1]}"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


class EventLog:
    """Collects decision lines; `step` is set by the runner before each MoE layer's decisions."""

    def __init__(self):
        self.lines: list[str] = []
        self.step = 0
        self.sequences = 0  # prompts logged so far: each gets the next `seq N`

    def _add(self, line: str) -> None:
        self.lines.append(line)

    def header(self, **fields) -> None:
        self._add(f"# specprefetch-events {VERSION} " + " ".join(f"{k}={_fmt(v)}" for k, v in fields.items()))

    def sequence(self, **fields) -> None:
        self._add(f"seq {self.sequences} " + " ".join(f"{k}={_fmt(v)}" for k, v in fields.items()))
        self.sequences += 1

    def at(self, step: int, pos: int, layer: int) -> None:
        self.step = step
        self._add(f"step {step} pos={pos} layer={layer}")

    def emit(self, kind: str, key: Key, **fields) -> None:
        extra = "".join(f" {k}={_fmt(v)}" for k, v in fields.items() if v is not None)
        self._add(f"{self.step} {kind} {key[0]}:{key[1]}{extra}")

    def token(self, n: int, pos: int, token_id: int, t_ms: float) -> None:
        self._add(f"token {n} pos={pos} id={token_id} t_ms={t_ms:.3f}")

    def budget(self, step: int, kib: int | None) -> None:
        """The read budget measured in the run changed at `step` (None: none): `STEP budget kib=K` (-1: none)."""
        self._add(f"{step} budget kib={-1 if kib is None else kib}")

    def end(self, **fields) -> None:
        self._add("end " + " ".join(f"{k}={_fmt(v)}" for k, v in fields.items()))


_NOT_COMPARED = re.compile(r" (t_ms|conf)=[^ ]*")


def decisions(lines: list[str]) -> list[str]:
    """The lines without their timing and confidence fields: what two runs must agree on. (A
    confidence is a probability printed for reading; another backend or implementation may round
    its last digit differently. The decision it led to is on the same line and is compared.)"""
    return [_NOT_COMPARED.sub("", ln) for ln in lines]
