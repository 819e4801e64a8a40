"""The expert executor: a MoE layer's routed experts computed from pool slots.

fp16 stores: each expert's blob is decoded to float32 matrices in the expert graph's input order and
run through the backend's `expert` graph, which holds no weights.

int8 and int4 stores: the expert is computed here, in torch, exactly as the native runner's integer
kernels do (android_runner/src/kernels.h): the input of each matrix (x for gate and up, the GLU
output for down) is quantised per block of 32 values to int8 with one float32 scale per block
(`quantize_act`), each block's dot product with the stored integers is computed exactly, and the
blocks are scaled and summed in float32 in block order (`qmatmul`). The integer products are exact
in float32 (32 products of at most 128 * 127 stay far below 2**24), and the scaling and block sums are
the same float32 operations in the same order, so a matrix's output is bitwise the native kernels';
only the GLU's exp / erf / tanh may round differently.

The executor computes one expert at a time; the runner (toolkit/runtime/runner.py) weights each output
by the router and sums them in top-k order, as the export's parity run does. The executor keeps nothing
between calls: the pool is the only expert memory.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np
import torch

from toolkit.errors import SpecPrefetchError
from toolkit.runtime.backend import Backend
from toolkit.runtime.expert_store import ExpertStore, dequantize

QBLOCK = 32  # activation quantisation block (= the int4 group)


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] float32 -> (q [..., K, 32] integer-valued float32, d [..., K] float32), K = ceil(n/32).

    Per block (zero-padded to 32): amax = max |x| (NaN if any is NaN), d = amax / 127, id = 1 / d; where
    d is finite and positive and id finite, q = clamp(round(x * id), -127, 127) (half to even), else 0.
    """
    x = x.float()
    n = x.shape[-1]
    k = -(-n // QBLOCK)
    xb = torch.nn.functional.pad(x, (0, k * QBLOCK - n)).reshape(*x.shape[:-1], k, QBLOCK)
    amax = xb.abs().amax(-1)
    amax = torch.where(torch.isnan(xb).any(-1), torch.full_like(amax, float("nan")), amax)
    d = amax / 127.0
    inv = 1.0 / d
    ok = (d > 0) & torch.isfinite(d) & torch.isfinite(inv)
    safe = torch.where(ok, inv, torch.zeros_like(inv))
    q = torch.clamp(torch.round(xb * safe[..., None]), -127, 127)
    q = torch.where(ok[..., None], q, torch.zeros_like(q))
    return q, d


def _block_sums(s: torch.Tensor) -> torch.Tensor:
    """s [..., K] -> [...]: acc = 0; acc = acc + s[..., k] for k in order (float32), as the kernels add."""
    acc = torch.zeros(s.shape[:-1], dtype=torch.float32)
    for k in range(s.shape[-1]):
        acc = acc + s[..., k]
    return acc


def qmatmul(x: torch.Tensor, qw: torch.Tensor, ws: torch.Tensor, int4: bool) -> torch.Tensor:
    """y [T, O] = W q(x) as the native integer kernels compute it.

    x [T, in]; qw [O, K, 32] the stored integers (float32, zero past `in`); ws: int4 [O, K] group
    scales, int8 [O] row scales (float32 values of the stored fp16)."""
    q, d = quantize_act(x)                                 # [T, K, 32], [T, K]
    sumi = torch.einsum("tkj,okj->tok", q, qw)             # exact: integers below 2**24
    if int4:
        return _block_sums(sumi * (ws[None] * d[:, None, :]))
    return _block_sums(sumi * d[:, None, :]) * ws[None]


def integer_matrices(blob, sections, shapes) -> dict[str, tuple[torch.Tensor, torch.Tensor, bool]]:
    """{role: (qw [O, K, 32], scales, int4)} of an int8 / int4 blob's matrices, and {role: bias} (float32)."""
    buf = np.frombuffer(blob, dtype=np.uint8)
    raw = {}
    for s in sections:
        dt = {"f16": np.float16, "i8": np.int8, "u8": np.uint8}[s.dtype]
        raw[(s.role, s.kind)] = buf[s.offset:s.offset + s.nbytes].view(dt).reshape(s.shape)
    out: dict[str, Any] = {}
    for (role, kind), a in raw.items():
        if kind == "bias":
            out[role] = torch.from_numpy(a.astype(np.float32))
        elif kind == "weight":
            sc = torch.from_numpy(raw[(role, "scale")].astype(np.float32))
            o, cols = shapes[role]
            k = -(-cols // QBLOCK)
            if a.dtype == np.int8:
                q = np.zeros((o, k * QBLOCK), np.float32)
                q[:, :cols] = a
                out[role] = (torch.from_numpy(q).view(o, k, QBLOCK), sc, False)
            else:
                lo = (a & 0xF).astype(np.int8)
                hi = (a >> 4).astype(np.int8)
                q = np.empty((o, a.shape[1] * 2), np.float32)
                q[:, 0::2] = np.where(lo > 7, lo - 16, lo)
                q[:, 1::2] = np.where(hi > 7, hi - 16, hi)
                q[:, cols:] = 0.0  # padding columns meet zero activations in the kernels
                out[role] = (torch.from_numpy(q).view(o, k, QBLOCK), sc, True)
    return out


def glu(family: str, tc: Any, g: torch.Tensor, u: torch.Tensor, mats: dict) -> torch.Tensor:
    """The GLU between up/gate and down: the native kernels' forms (SwiGLU-style act(g) * u, or
    GPT-OSS's clamped, biased (up + 1) * gate * sigmoid(1.702 * gate))."""
    if family == "gpt_oss":
        limit = float(getattr(tc, "swiglu_limit", 7.0))
        gate = (g + mats["bias_gate"]).clamp(max=limit)
        up = (u + mats["bias_up"]).clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * 1.702))
    from transformers.activations import ACT2FN

    return ACT2FN[getattr(tc, "hidden_act", "silu")](g) * u


def quantized_expert(blob, sections, shapes, family: str, tc: Any, x: torch.Tensor, mats: dict | None = None
                     ) -> torch.Tensor:
    """One int8 / int4 expert's (unweighted) output [T, H] for x [T, H], as the native kernels compute it.
    mats: the blob's integer_matrices, when the caller decoded them already (one decode per blob)."""
    m = integer_matrices(blob, sections, shapes) if mats is None else mats
    x = x.float().reshape(-1, x.shape[-1])
    g = qmatmul(x, *m["gate"])
    u = qmatmul(x, *m["up"])
    y = qmatmul(glu(family, tc, g, u, m), *m["down"])
    if family == "gpt_oss":
        y = y + m["bias_down"]
    return y


def _store_text_config(store: ExpertStore) -> Any:
    """hidden_act / swiglu_limit of the model the store was built from (its recorded config.json); a
    one-line error when that is not readable (the runner passes the model's own text config instead)."""
    try:
        cfg = json.loads((Path(store.meta["model_path"]) / "config.json").read_text())
        if cfg.get("model_type") == "qwen3_vl_moe":
            cfg = cfg.get("text_config") or cfg
        return SimpleNamespace(hidden_act=cfg.get("hidden_act", "silu"), swiglu_limit=cfg.get("swiglu_limit", 7.0))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SpecPrefetchError(f"{store.path}: int8 / int4 experts need the model's hidden_act, and the config "
                                f"the store records ({store.meta.get('model_path')}) cannot be read ({e}); "
                                "pass the model's text config") from None


class ExpertExecutor:
    def __init__(self, backend: Backend, store: ExpertStore, roles: Sequence[str], tc: Any = None):
        """
        Args:
            backend: runs the `expert` graph (x [1, H], *matrices) -> [1, H] (fp16 stores).
            store: the expert store (its blob layout).
            roles: the expert graph's matrix order (the family's expert_matrices roles).
            tc: the model's text config (hidden_act, swiglu_limit) for int8 / int4 stores; default:
                the config recorded by the store's metadata.
        """
        self.backend, self.store, self.roles = backend, store, list(roles)
        # fp16 blobs hold every section as plain f16 arrays: slice them straight out of the slot
        self.fp16 = all(s.dtype == "f16" for s in store.sections)
        self.f16_sections = [(s.role, s.offset // 2, s.nbytes // 2, s.shape) for s in store.sections]
        self.family = str(store.meta.get("family", ""))
        self.tc = tc if tc is not None or self.fp16 else _store_text_config(store)

    def matrices(self, blob) -> list[torch.Tensor]:
        """float32 matrices [out, in] (and biases) of one expert from its slot's bytes."""
        if self.fp16:  # one view of the whole blob, each section converted once
            raw = torch.frombuffer(blob, dtype=torch.float16, count=self.store.blob_size // 2)
            got = {role: raw[off:off + n].view(shape).float() for role, off, n, shape in self.f16_sections}
        else:
            got = dequantize(memoryview(blob)[: self.store.blob_size], self.store.sections, self.store.shapes)
        return [got[r] for r in self.roles]

    def integer_matrices(self, blob) -> dict:
        """An int8 / int4 blob decoded once, for several expert() calls on it (a prefill chunk's tokens)."""
        return integer_matrices(memoryview(blob)[: self.store.blob_size], self.store.sections, self.store.shapes)

    def expert(self, x: torch.Tensor, blob, mats: dict | None = None) -> torch.Tensor:
        """One expert's (unweighted) output [1, H] for x [1, H] (or [T, H] -> [T, H]); mats: the
        blob's integer_matrices (int8 / int4), if already decoded."""
        if self.fp16:
            return self.backend.call("expert", [x, *self.matrices(blob)])[0]
        with torch.no_grad():
            y = quantized_expert(memoryview(blob)[: self.store.blob_size], self.store.sections, self.store.shapes,
                                 self.family, self.tc, x, mats=mats)
        return y.reshape(x.shape).to(x.dtype)
