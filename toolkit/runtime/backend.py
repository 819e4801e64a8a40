"""The interface between the decode loop and whatever runs the model's step graphs.

A `Backend` runs named graphs (`embed`, `layer_N`, `expert`, `head`; export/graphs.py says what
each takes and returns): eager PyTorch modules, an ExecuTorch program, ONNX Runtime on the CPU, or
QNN context binaries on the HTP. Graphs either keep their KV cache as mutable buffers ("buffer"
mode, ExecuTorch) or take it as inputs and return the new token's key/value ("io" mode, ONNX/QNN),
in which case the host keeps the cache in a `HostKV`. The runner (toolkit/runtime/runner.py) talks
to every backend through `call`, `layer` and `reset` only; the backends themselves live with their
export targets (export/), so the runtime imports none of them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from torch import nn

# io mode (QNN): the mask is a graph input, and QDQ calibration sizes the score+mask range from it;
# -1e4 would cost uint16 scores a 0.15 step. -100 still gives masked positions weight e^-100 (the
# host zeroes the cache before each sequence, so masked keys are zeros, not stale keys).
IO_MASK_VALUE = -100.0


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """One KV tensor pair of a layer: shapes [1, heads, max_seq, dim] of the two cached tensors."""
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]


def host_mask(pos: int, max_seq: int, window: int = 0, value: float = IO_MASK_VALUE) -> torch.Tensor:
    """The additive attention mask [1, 1, 1, S] the host passes to an io-mode layer graph."""
    j = torch.arange(max_seq)
    allowed = j <= pos
    if window:
        allowed &= j > pos - window
    return torch.where(allowed, 0.0, value).float().view(1, 1, 1, -1)


class HostKV:
    """The KV cache of io-mode graphs, held by the host: builds each layer's cache inputs and
    writes the returned key/value of the current token at its position."""

    def __init__(self, cache_specs: Sequence[CacheSpec], windows: Sequence[int], max_seq: int):
        self.specs, self.windows, self.max_seq = list(cache_specs), list(windows), max_seq
        self.reset()

    def reset(self) -> None:
        self.k = [torch.zeros(cs.k_shape) for cs in self.specs]
        self.v = [torch.zeros(cs.v_shape) for cs in self.specs]

    def inputs(self, layer: int, pos: int) -> tuple[torch.Tensor, ...]:
        onehot = nn.functional.one_hot(torch.tensor([pos]), self.max_seq).float()
        return onehot, host_mask(pos, self.max_seq, self.windows[layer]), self.k[layer], self.v[layer]

    def write(self, layer: int, pos: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        self.k[layer][:, :, pos] = k_new[:, :, 0]
        self.v[layer][:, :, pos] = v_new[:, :, 0]


class Backend:
    """Runs named graphs. Subclasses implement `call(name, inputs) -> list of tensors` and, for
    buffer-mode graphs, `reset()`; io-mode backends get a HostKV from `steps_info`
    ({"cache_specs", "windows", "max_seq"})."""
    kv_mode = "buffer"
    label = "backend"

    def __init__(self, steps_info: dict[str, Any]):
        self.info = steps_info
        self.kv = HostKV(steps_info["cache_specs"], steps_info["windows"], steps_info["max_seq"]) \
            if self.kv_mode == "io" else None

    @property
    def max_seq(self) -> int | None:
        return self.info.get("max_seq")

    def call(self, name: str, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError

    def reset(self) -> None:
        """Forget every cached position (a new sequence starts at position 0)."""
        if self.kv is not None:
            self.kv.reset()

    def layer(self, layer: int, h: torch.Tensor, pos: int) -> list[torch.Tensor]:
        """Decoder layer `layer` at position `pos`: [h] for a dense layer, [h_res, x, logits(,
        preds)] for a MoE layer (the KV outputs of io-mode graphs are consumed here)."""
        if self.kv_mode == "buffer":
            return self.call(f"layer_{layer}", [h, torch.tensor([pos], dtype=torch.long)])
        outs = self.call(f"layer_{layer}", [h, *self.kv.inputs(layer, pos)])
        self.kv.write(layer, pos, outs[-2], outs[-1])
        return outs[:-2]
