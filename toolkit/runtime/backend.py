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
import re
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from toolkit.errors import SpecPrefetchError

# io mode (QNN): the mask is a graph input, and QDQ calibration sizes the score+mask range from it;
# -1e4 would cost uint16 scores a 0.15 step. -100 still gives masked positions weight e^-100 (the
# host zeroes the cache before each sequence, so masked keys are zeros, not stale keys).
IO_MASK_VALUE = -100.0


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """One KV tensor pair of a layer: shapes [1, heads, max_seq, dim] of the two cached tensors."""
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]


def host_mask(pos: int, max_seq: int, window: int = 0, value: float = IO_MASK_VALUE, chunk: int = 1) -> torch.Tensor:
    """The additive attention mask [1, 1, T, S] the host passes to an io-mode layer graph for the
    `chunk` = T positions pos .. pos+T-1 (one row per query position)."""
    j = torch.arange(max_seq).view(1, -1)
    q = torch.arange(pos, pos + chunk).view(-1, 1)
    allowed = j <= q
    if window:
        allowed &= j > q - window
    return torch.where(allowed, 0.0, value).float().view(1, 1, chunk, -1)


def prefill_name(chunk: int, layer: int) -> str:
    """The method of decoder layer `layer` over a prefill chunk of `chunk` positions."""
    return f"prefill_{chunk}_layer_{layer}"


def parse_prefill_name(name: str) -> tuple[int, int] | None:
    """(chunk, layer) of a prefill method's name; None for any other name."""
    m = re.fullmatch(r"prefill_(\d+)_layer_(\d+)", name)
    return (int(m[1]), int(m[2])) if m else None


def prefill_chunks_of(names: Iterable[str]) -> tuple[int, ...]:
    """The chunk sizes T > 1 for which `names` (a program's methods) hold every decoder layer's
    prefill method, ascending; () for a bundle exported before prefill chunks existed."""
    names = list(names)
    layers = {int(n[6:]) for n in names if re.fullmatch(r"layer_\d+", n)}
    by: dict[int, set[int]] = {}
    for n in names:
        p = parse_prefill_name(n)
        if p is not None:
            by.setdefault(p[0], set()).add(p[1])
    return tuple(sorted(T for T, ls in by.items() if T > 1 and layers and ls == layers))


def chunk_plan(n: int, chunks: Sequence[int]) -> list[int]:
    """How a prompt of n positions is fed: greedily the largest chunk that fits in what is left,
    the tail by smaller chunks and single positions (1). `chunks`: the sizes available."""
    out, left = [], n
    for T in sorted((c for c in chunks if c > 1), reverse=True):
        while left >= T:
            out.append(T)
            left -= T
    return out + [1] * left


# Positions per prefill span: consecutive chunks run layer by layer as one span (every chunk of the
# span through layer N, then layer N's experts for all of the span's tokens), so a MoE layer's
# experts are read and computed once per span rather than once per chunk; llama.cpp's default
# micro-batch. The span's router inputs ([span, L, H] floats) are what bounds it.
PREFILL_SPAN = 512


def prefill_spans(units: Sequence[int], cap: int = PREFILL_SPAN) -> list[int]:
    """The prompt's spans from its `chunk_plan` units: consecutive chunks merged while the span
    stays within `cap` positions (a single chunk larger than `cap` is a span of its own), single
    positions (1) as they are. Each MoE layer of a span is one
    step (p0 * L + layer); `chunk_plan(span, chunks)` gives back the span's chunks, in order."""
    out: list[int] = []
    run = 0
    for T in units:
        if T > 1 and (run == 0 or run + T <= cap):
            run += T
            continue
        if run:
            out.append(run)
            run = 0
        if T > 1:
            run = T
        else:
            out.append(1)
    if run:
        out.append(run)
    return out


_CUSTOM_OPS: list[bool] = []


def load_custom_ops() -> bool:
    """Load ExecuTorch's LLM custom ops (llama::update_cache, llama::custom_sdpa) once per process
    from the executorch wheel's libcustom_ops_aot_lib.so: a program whose layers use them needs
    their kernels registered before it loads. False where there is no such library."""
    if not _CUSTOM_OPS:
        ok = False
        try:
            import torch as _torch
            from pathlib import Path

            from executorch.extension.pybindings import portable_lib  # the runtime the library links

            try:  # the library with the ops' meta functions (what torch.export traces them with)
                from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401
            except Exception:  # noqa: BLE001 - e.g. a torch without inductor: the bare library below
                pass
            if not (hasattr(_torch.ops.llama, "custom_sdpa") and hasattr(_torch.ops.llama, "update_cache")):
                ext = Path(portable_lib.__file__).resolve().parents[1]  # executorch/extension
                libs = sorted((ext / "llm" / "custom_ops").glob("libcustom_ops_aot_lib.*"))
                if libs:
                    _torch.ops.load_library(str(libs[0]))
            ok = hasattr(_torch.ops.llama, "custom_sdpa") and hasattr(_torch.ops.llama, "update_cache")
        except (ImportError, OSError, RuntimeError, AttributeError):
            ok = False
        _CUSTOM_OPS.append(ok)
    return _CUSTOM_OPS[0]


class HostKV:
    """The KV cache of io-mode graphs, held by the host: builds each layer's cache inputs and
    writes the returned key/value of the current token at its position."""

    def __init__(self, cache_specs: Sequence[CacheSpec], windows: Sequence[int], max_seq: int):
        self.specs, self.windows, self.max_seq = list(cache_specs), list(windows), max_seq
        self.reset()

    def reset(self) -> None:
        self.k = [torch.zeros(cs.k_shape) for cs in self.specs]
        self.v = [torch.zeros(cs.v_shape) for cs in self.specs]

    def inputs(self, layer: int, pos: int, chunk: int = 1) -> tuple[torch.Tensor, ...]:
        """(pos_onehot [T, S], mask [1, 1, T, S], k_past, v_past) for positions pos .. pos+T-1."""
        onehot = nn.functional.one_hot(torch.arange(pos, pos + chunk), self.max_seq).float()
        return onehot, host_mask(pos, self.max_seq, self.windows[layer], chunk=chunk), self.k[layer], self.v[layer]

    def write(self, layer: int, pos: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """The T positions' keys and values ([.., T, D]) into the cache at pos .. pos+T-1."""
        T = k_new.shape[2]
        self.k[layer][:, :, pos:pos + T] = k_new
        self.v[layer][:, :, pos:pos + T] = v_new


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
        # M-RoPE graphs (info["mrope"]): each layer call also takes, last, the rotary positions [3, T] of
        # its positions (io mode: as one-hot rows [3, T, S]): the sequence's own rows (`set_rope`: an
        # image's tokens have 2-D ones) for the prompt, the cache position plus the sequence's offset after it
        self.mrope = bool(steps_info.get("mrope"))
        self.rope_rows: torch.Tensor | None = None
        self.rope_delta = 0

    def set_rope(self, rows: torch.Tensor | None, delta: int = 0) -> None:
        """This sequence's rotary positions: `rows` [3, n] for positions 0..n-1, pos + `delta` on every
        axis after them (None, 0: the cache position itself, as for text). `reset` forgets them."""
        self.rope_rows, self.rope_delta = rows, int(delta)

    def rope_pos(self, pos: int, T: int) -> torch.Tensor:
        """The rotary positions [3, T] of cache positions pos .. pos+T-1."""
        idx = torch.arange(pos, pos + T, dtype=torch.long)
        rows = self.rope_rows
        if rows is None:
            return idx.expand(3, -1).contiguous()
        n = rows.shape[1]
        return torch.where(idx < n, rows[:, idx.clamp(max=n - 1)], idx + self.rope_delta).contiguous()

    def _rope_inputs(self, pos: int, T: int) -> tuple[torch.Tensor, ...]:
        """An M-RoPE layer call's last input: rope_pos [3, T] (buffer mode) or rope_onehot [3, T, S] (io
        mode); () for 1-D rotary graphs."""
        if not self.mrope:
            return ()
        rp = self.rope_pos(pos, T)
        if self.kv_mode == "buffer":
            return (rp,)
        S = self.kv.max_seq
        if int(rp.min()) < 0 or int(rp.max()) >= S:
            raise SpecPrefetchError(f"rotary positions {int(rp.min())}..{int(rp.max())} of cache positions {pos}.."
                                    f"{pos + T - 1}: outside 0..{S - 1}, the rope_onehot width (kv.max_seq)")
        return (nn.functional.one_hot(rp, S).float(),)

    @property
    def max_seq(self) -> int | None:
        return self.info.get("max_seq")

    def call(self, name: str, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError

    def reset(self) -> None:
        """Forget every cached position (a new sequence starts at position 0)."""
        if self.kv is not None:
            self.kv.reset()
        self.rope_rows, self.rope_delta = None, 0

    def method_names(self) -> tuple[str, ...]:
        """The graphs this backend runs (an eager backend's `graphs`, else none known)."""
        return tuple(getattr(self, "graphs", None) or ())

    @property
    def prefill_chunks(self) -> tuple[int, ...]:
        """Prefill chunk sizes T this backend has graphs for (`prefill_T_layer_N`)."""
        if not hasattr(self, "_chunks"):
            self._chunks = prefill_chunks_of(self.method_names())
        return self._chunks

    def layer_chunk(self, layer: int, h: torch.Tensor, pos: int) -> list[torch.Tensor]:
        """Decoder layer `layer` over T = h.shape[1] positions pos .. pos+T-1 (a prefill chunk;
        T in `prefill_chunks`): [h [1,T,H]] or [h_res [1,T,H], x [T,H], logits [T,E](, preds
        [T,P,E])]. The chunk writes the same KV cache as `layer` does one position at a time."""
        T = int(h.shape[1])
        if self.kv_mode == "buffer":
            return self.call(prefill_name(T, layer), [h, torch.arange(pos, pos + T, dtype=torch.long),
                                                      *self._rope_inputs(pos, T)])
        outs = self.call(prefill_name(T, layer), [h, *self.kv.inputs(layer, pos, T), *self._rope_inputs(pos, T)])
        self.kv.write(layer, pos, outs[-2], outs[-1])
        return outs[:-2]

    def layer(self, layer: int, h: torch.Tensor, pos: int) -> list[torch.Tensor]:
        """Decoder layer `layer` at position `pos`: [h] for a dense layer, [h_res, x, logits(,
        preds)] for a MoE layer (the KV outputs of io-mode graphs are consumed here)."""
        if self.kv_mode == "buffer":
            return self.call(f"layer_{layer}", [h, torch.tensor([pos], dtype=torch.long), *self._rope_inputs(pos, 1)])
        outs = self.call(f"layer_{layer}", [h, *self.kv.inputs(layer, pos), *self._rope_inputs(pos, 1)])
        self.kv.write(layer, pos, outs[-2], outs[-1])
        return outs[:-2]
