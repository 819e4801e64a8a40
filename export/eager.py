"""The eager backend: the step graphs of `export.graphs` as PyTorch modules, and the one driver of
any backend over a token sequence.

`TorchBackend` is the reference every bundle is checked against (and what `run MODEL_DIR` uses).
`run_sequence` drives any backend through the reference runner (toolkit/runtime/runner.py), the one
decode loop, teacher-forced and recording every position's logits, router ids and greedy next token
(a `Record`); export/parity.py compares two records.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from torch import nn

from export.graphs import exportable_family
from toolkit.runtime.backend import Backend
from toolkit.runtime.policy import Policy
from toolkit.runtime.runner import ModelInfo, RunConfig, Runner


class TorchBackend(Backend):
    """The reference: the step graphs as eager PyTorch modules."""
    label = "pytorch"

    def __init__(self, steps, kv_mode: str = "buffer", graphs: dict[str, nn.Module] | None = None):
        self.kv_mode = kv_mode
        super().__init__(steps_info(steps))
        self.family_ctx = lambda: exportable_family(steps.spec.family)
        self.graphs = graphs or steps.graphs(kv_mode)

    def call(self, name, inputs):
        with torch.no_grad(), self.family_ctx():
            out = self.graphs[name](*inputs)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def reset(self):
        super().reset()
        for _name, g in self.graphs.items():
            for b, t in g.named_buffers():
                if "_cache_" in b:
                    t.zero_()


def steps_info(steps) -> dict[str, Any]:
    """What a backend needs to know of the model, without the model (also read from manifests)."""
    return {"cache_specs": steps.cache_specs, "windows": steps.windows, "max_seq": steps.max_seq,
            "mrope": steps.mrope_axes is not None}


@dataclasses.dataclass
class Record:
    """Per position of one sequence: logits [T, V], router ids [T, L, k], greedy next token [T],
    and the tokens fed."""
    logits: torch.Tensor
    ids: torch.Tensor
    next_tokens: torch.Tensor
    tokens: list[int]


def run_model(spec, store, score_bias: torch.Tensor | None = None, eos: int | None = None,
              max_seq: int | None = None) -> ModelInfo:
    """The runner's view of a model being exported (for `run_sequence`)."""
    g = spec.geometry
    return ModelInfo(num_layers=g.num_layers, moe_layers=tuple(g.moe_layers), routing=g.routing,
                     hidden_size=g.hidden_size, expert_roles=tuple(m.role for m in spec.family.expert_matrices(g)),
                     eos_token_ids=(eos,) if eos is not None else (), score_bias=score_bias, max_seq=max_seq,
                     label=str(spec.path), text_config=spec.family.text_config(spec.config))


PARITY_POOL_MIB = 2048.0  # parity's pool: every expert of a small model, a bounded share of a large one


def run_sequence(backend: Backend, tokens: Sequence[int], *, model: ModelInfo, store, extend: int = 0,
                 eos: int | Sequence[int] | None = None, force_ids: torch.Tensor | None = None) -> Record:
    """Feed `tokens` one per step (teacher-forced) through the graphs with the reference runner
    (toolkit/runtime/runner.py: experts from the store through the pool, on demand), recording
    every position's logits; then, with `extend`, keep going greedily for that many more positions
    (stopping after EOS).

    `force_ids` [T, L, k] (a reference's routing) makes every MoE layer compute with those experts
    (weighted by this backend's own router logits) while the record keeps the experts this
    backend's router chose: numerical error is then measured without the cascade of a router
    near-tie flipping, and the flips themselves are counted by comparing the chosen ids."""
    all_bytes = store.slot_bytes * model.L * model.routing.num_experts
    pool_mib = max(min(all_bytes, PARITY_POOL_MIB * 2**20), model.routing.top_k * store.slot_bytes) / 2**20
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    m = dataclasses.replace(model, eos_token_ids=eos_ids, max_seq=None)
    # reader threads: no fork from a process that holds ONNX Runtime / ExecuTorch / QNN threads
    runner = Runner(backend, store, m, RunConfig(policy=Policy("on-demand", "lru"), pool_mib=pool_mib, io="threads"))
    gen = runner.generate(list(tokens), extend + 1, force_ids=force_ids, keep_logits=True)
    lg = gen.logits
    return Record(lg, torch.stack(gen.routing), lg.argmax(-1), gen.fed)
