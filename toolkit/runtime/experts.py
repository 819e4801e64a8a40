"""The expert executor: a MoE layer's routed experts computed from pool slots.

Each expert's blob (fp16, int8 or int4, docs/expert-store.md) is decoded to float32 matrices in
the expert graph's input order and run through the backend's `expert` graph, which holds no
weights; the outputs are combined with the router's weights in top-k order, exactly as the export's
parity run does. The executor keeps nothing between calls: the pool is the only expert memory.
"""
from __future__ import annotations

from typing import Sequence

import torch

from toolkit.runtime.backend import Backend
from toolkit.runtime.expert_store import ExpertStore, dequantize


class ExpertExecutor:
    def __init__(self, backend: Backend, store: ExpertStore, roles: Sequence[str]):
        """
        Args:
            backend: runs the `expert` graph (x [1, H], *matrices) -> [1, H].
            store: the expert store (its blob layout).
            roles: the expert graph's matrix order (the family's expert_matrices roles).
        """
        self.backend, self.store, self.roles = backend, store, list(roles)
        # fp16 blobs hold every section as plain f16 arrays: slice them straight out of the slot
        self.fp16 = all(s.dtype == "f16" for s in store.sections)
        self.plain = [(s.role, s.offset // 2, s.nbytes // 2, s.shape) for s in store.sections]

    def matrices(self, blob) -> list[torch.Tensor]:
        """float32 matrices [out, in] (and biases) of one expert from its slot's bytes."""
        if self.fp16:  # one view of the whole blob, each section converted once
            raw = torch.frombuffer(blob, dtype=torch.float16, count=self.store.blob_size // 2)
            got = {role: raw[off:off + n].view(shape).float() for role, off, n, shape in self.plain}
        else:
            got = dequantize(memoryview(blob)[: self.store.blob_size], self.store.sections, self.store.shapes)
        return [got[r] for r in self.roles]

    def expert(self, x: torch.Tensor, blob) -> torch.Tensor:
        """One expert's (unweighted) output [1, H] for x [1, H]."""
        return self.backend.call("expert", [x, *self.matrices(blob)])[0]
