"""The model cut into the graphs a phone runs for one decode step, as plain PyTorch modules.

A MoE model cannot ship as one graph: its experts are chosen per token and must stream from
flash, so the phone runs a fixed sequence of small graphs and does the routing itself:

    embed(token) -> h
    for each decoder layer l:
        dense layer: h = layer_l(h, pos)                                  (attention + MLP)
        MoE layer:   h_res, x, logits, preds = layer_l(h, pos)            (attention, norm,
                     ids, w = select(logits)     (host, family rule)       router, shared experts,
                     h = h_res + sum_j w_j * expert(x, weights of ids_j)   adapter heads)
    logits = head(h)

`expert` takes the expert's weights as inputs, so one graph serves every expert of every layer and
no expert weight is inside a compiled program: they come from the expert store through the pool.
`preds` are the prefetch adapter's router predictions for the next steps (the window), folded into
one matrix per (layer, horizon), so the scheduler's inputs come out of the same graph.

The layer graphs wrap the model's own transformers modules (attention, norms, MLPs), so every
family's attention variant (GQA, q/k norms, DeepSeek's MLA with its compressed cache, GPT-OSS sinks
and sliding windows) is the model's code, not a copy. The KV cache comes in two forms:
- "buffer" (ExecuTorch): the cache is a mutable buffer of the graph, written in place at `input_pos`
  and attended over with a mask built from `input_pos`.
- "io" (ONNX / QNN, where graphs hold no state): the past cache and the additive mask are inputs,
  the current token's key/value are merged in by a one-hot mask (no scatter) and returned as
  outputs, which the host writes into its cache.
Rotary tables are precomputed for every position with the model's own rotary module and selected
per step (index in "buffer" mode, a one-hot matmul in "io" mode), so no family's rotary code runs
on the phone.
"""
from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch
from torch import nn

from toolkit.errors import SpecPrefetchError
from toolkit.models.families import Family, family_by_name
from toolkit.models.spec import ModelSpec
from toolkit.runtime.backend import CacheSpec, host_mask, parse_prefill_name, prefill_name

KvMode = Literal["buffer", "io"]
MASK_VALUE = -1e4  # additive mask in buffer mode (ExecuTorch) for positions a query may not see


def text_model(model: nn.Module) -> nn.Module:
    """The language model inside a CausalLM / ImageTextToText model (has layers, norm, rotary)."""
    inner = model.model
    return getattr(inner, "language_model", inner)


@contextlib.contextmanager
def exportable_family(family: Family | str):
    """Swap a family's non-exportable helpers for exact equivalents while tracing or running the
    step graphs (the family's `export_patches`: DeepSeek-V2's complex rotary, GPT-OSS's 4-D amax).
    `family` is a Family or its name."""
    fam = family_by_name(family) if isinstance(family, str) else family
    patches = fam.export_patches()
    if not patches:
        yield
        return
    import importlib

    saved = []
    try:
        for mod_name, attr, repl in patches:
            m = importlib.import_module(mod_name)
            saved.append((m, attr, getattr(m, attr)))
            setattr(m, attr, repl)
        yield
    finally:
        for m, attr, orig in reversed(saved):
            setattr(m, attr, orig)


class _StepCache:
    """Stands in for transformers' Cache inside one layer's attention for one step."""

    def __init__(self, owner: "LayerGraph", input_pos, onehot, k_past, v_past):
        self.o, self.pos, self.onehot, self.k_past, self.v_past = owner, input_pos, onehot, k_past, v_past
        self.new: tuple[torch.Tensor, torch.Tensor] | None = None
        self.start = None  # custom_kv: the first position, an int (a SymInt while exporting)

    def update(self, k, v, layer_idx=None, *args, **kwargs):
        if self.o.custom_kv:  # llama::update_cache: the cache is [1, S, heads, D], written in place
            kt, vt = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
            if torch.compiler.is_exporting():
                torch.ops.llama.update_cache(kt, self.o.k_cache, self.start)
                torch.ops.llama.update_cache(vt, self.o.v_cache, self.start)
            else:  # run eagerly (the export's reference): the same update in plain torch
                self.o.k_cache[:, self.start:self.start + kt.shape[1]] = kt
                self.o.v_cache[:, self.start:self.start + vt.shape[1]] = vt
            return self.o.k_cache, self.o.v_cache
        if self.o.kv_mode == "buffer":
            self.o.k_cache.index_copy_(2, self.pos, k)
            self.o.v_cache.index_copy_(2, self.pos, v)
            return self.o.k_cache, self.o.v_cache
        self.new = (k, v)
        if self.onehot.shape[0] == 1:  # one position: onehot [1, S]
            oh = self.onehot.view(1, 1, -1, 1)
            return self.k_past * (1 - oh) + k * oh, self.v_past * (1 - oh) + v * oh
        # a chunk of T positions: onehot [T, S] scatters k [.., T, D] into [.., S, D] as a matmul
        keep = (1 - self.onehot.sum(0)).view(1, 1, -1, 1)
        spread = self.onehot.t()
        return self.k_past * keep + spread @ k, self.v_past * keep + spread @ v


_CUSTOM_SDPA: list = []  # the start position of the custom-op attention call in progress (a stack)


def custom_ops_available() -> bool:
    """Whether ExecuTorch's LLM custom ops (llama::update_cache, llama::custom_sdpa) load into
    this process: their library (the executorch wheel's libcustom_ops_aot_lib.so) registers them
    with torch (to export them) and with ExecuTorch's runtime (to run programs holding them)."""
    from toolkit.runtime.backend import load_custom_ops

    return load_custom_ops()


def _sdpa_or(eager):
    """The attention function of a custom-op layer: llama::custom_sdpa over the filled positions
    0 .. start+T-1 of the [1, S, heads, D] cache, causal within the query rows; any other call
    goes to the family's own `eager`."""
    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if not _CUSTOM_SDPA:
            return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        start = _CUSTOM_SDPA[-1]
        q = query.transpose(1, 2).contiguous()                           # [1, T, Hq, D]
        if torch.compiler.is_exporting():
            return torch.ops.llama.custom_sdpa(q, key, value, start, None, 0.0, True, scaling), None
        # run eagerly (the export's reference): the same attention in plain torch
        T, n = q.shape[1], start + q.shape[1]
        k, v = key[:, :n].transpose(1, 2), value[:, :n].transpose(1, 2)  # [1, Hkv, n, D]
        rep = q.shape[2] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        allowed = torch.arange(n).view(1, -1) <= (start + torch.arange(T)).view(-1, 1)
        out = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=allowed, scale=scaling)
        return out.transpose(1, 2), None
    return attend


@contextlib.contextmanager
def _custom_attention(decoder, start):
    import sys

    mod = sys.modules[type(decoder.self_attn).__module__]
    eager = mod.eager_attention_forward
    mod.eager_attention_forward = _sdpa_or(eager)
    _CUSTOM_SDPA.append(start)
    try:
        yield
    finally:
        _CUSTOM_SDPA.pop()
        mod.eager_attention_forward = eager


def custom_kv_fits(steps: "StepModel", layer: int) -> bool:
    """Whether layer `layer` can use the custom ops: plain softmax attention over one K and one V of
    the same shape (GQA allowed), no sliding window, no attention sinks (GPT-OSS), no MLA."""
    import sys

    cs = steps.cache_specs[layer]
    attn = steps.layers[layer].self_attn
    return (not steps.windows[layer] and cs.k_shape == cs.v_shape and getattr(attn, "sinks", None) is None
            and hasattr(sys.modules[type(attn).__module__], "eager_attention_forward")
            and getattr(attn, "scaling", None) is not None)


class LayerGraph(nn.Module):
    """One decoder layer's dense work for one token, or (`chunk` T > 1) for T consecutive prompt
    positions at once (a prefill chunk).

    buffer mode: forward(hidden [1,T,H], input_pos int64 [T])   (T = 1: the decode graph)
    io mode:     forward(hidden [1,T,H], pos_onehot [T,S], mask [1,1,T,S], k_past, v_past)
    M-RoPE (Qwen3-VL) graphs take the positions' (t, h, w) rotary positions last: rope_pos int64 [3,T]
    (buffer mode), rope_onehot [3,T,S] (io mode: a one-hot row per axis and position).
    Outputs: dense layer -> (h,); MoE layer -> (h_res, x [T,H], router_logits [T,E][, preds]), preds
    being [P,E] for one position and [T,P,E] for a chunk; io mode appends (k_new, v_new), the T
    positions' keys and values ([.., T, D]) for the host to write into its cache.
    A buffer-mode chunk graph has the same cache buffers (names and shapes) as the layer's decode
    graph, so in one ExecuTorch program both write and read the same KV cache.
    """

    def __init__(self, steps: "StepModel", layer: int, kv_mode: KvMode, chunk: int = 1):
        super().__init__()
        self.family, self.layer, self.kv_mode, self.chunk = steps.spec.family, layer, kv_mode, chunk
        self.decoder = steps.layers[layer]
        self.is_moe = layer in steps.spec.geometry.moe_layers
        self.max_seq = steps.max_seq
        self.window = steps.windows[layer]
        for n, t in enumerate(steps.rope_tables):
            self.register_buffer(f"rope_{n}", t.clone(), persistent=False)
        self.n_rope = len(steps.rope_tables)
        self.rope_is_pair = steps.rope_is_pair
        # M-RoPE (Qwen3-VL): a graph takes each position's (t, h, w) rotary positions apart from its cache
        # slot, last (buffer mode: rope_pos [3, T]; io mode: rope_onehot [3, T, S], a one-hot row per axis);
        # every rotary channel comes from its axis' row of the 1-D tables
        self.mrope = steps.mrope_axes is not None
        if self.mrope:
            self.register_buffer("rope_axes", steps.mrope_axes.clone(), persistent=False)
            # io mode: each axis' channels as a 0/1 mask, so the three rows combine by multiply-add (exact:
            # every channel takes one row times 1 plus two rows times 0), ops an HTP graph has
            self.register_buffer("rope_axis_masks", torch.stack([(steps.mrope_axes == a).float() for a in range(3)]),
                                 persistent=False)
        cs = steps.cache_specs[layer]
        self.cache_spec = cs
        # ExecuTorch's LLM custom ops: the cache updated in place, attention over filled positions
        self.custom_kv = kv_mode == "buffer" and steps.kv_custom_ops and custom_kv_fits(steps, layer)
        if kv_mode == "buffer":  # unique names: every layer's cache is its own mutable buffer
            k_shape, v_shape = cs.k_shape, cs.v_shape
            if self.custom_kv:  # [1, S, heads, D], the ops' layout
                k_shape, v_shape = (1, k_shape[2], k_shape[1], k_shape[3]), (1, v_shape[2], v_shape[1], v_shape[3])
            self.register_buffer(f"k_cache_{layer}", torch.zeros(k_shape), persistent=False)
            self.register_buffer(f"v_cache_{layer}", torch.zeros(v_shape), persistent=False)
            self.register_buffer("positions", torch.arange(self.max_seq), persistent=False)
        if self.is_moe:
            li = steps.spec.geometry.moe_layers.index(layer)
            w, b, _ = steps.spec.family.router_params(steps.model, layer)
            self.router_w = nn.Parameter(w.detach().float().clone(), requires_grad=False)
            self.router_b = None if b is None else nn.Parameter(b.detach().float().clone(), requires_grad=False)
            self.block = steps.spec.family.moe_block(steps.model, layer)
            self.shared = getattr(self.block, "shared_experts", None)
            heads = steps.adapter_heads.get(li)
            self.pred_w = None if heads is None else nn.Parameter(heads[0], requires_grad=False)
            self.pred_b = None if heads is None else nn.Parameter(heads[1], requires_grad=False)

    @property
    def k_cache(self):
        return getattr(self, f"k_cache_{self.layer}")

    @property
    def v_cache(self):
        return getattr(self, f"v_cache_{self.layer}")

    def _rope(self, input_pos, onehot, rope_pos=None, rope_onehot=None):
        tabs = [getattr(self, f"rope_{n}") for n in range(self.n_rope)]
        if rope_pos is not None:  # [3, T]: a row per axis, each channel from its own axis (exact: a select)
            ax = self.rope_axes
            rows = []
            for t in tabs:
                r0, r1, r2 = (t.index_select(1, rope_pos[a]) for a in range(3))
                rows.append(torch.where(ax == 0, r0, torch.where(ax == 1, r1, r2)))
        elif self.kv_mode == "buffer":
            rows = [t.index_select(1, input_pos) for t in tabs]
        elif rope_onehot is not None:  # [3, T, S]: each axis' rows by a matmul, each channel from its own axis
            m = self.rope_axis_masks
            rows = []
            for t in tabs:
                flat = t.reshape(t.shape[1], -1)
                r = [(rope_onehot[a] @ flat).reshape(1, rope_onehot.shape[1], *t.shape[2:]) for a in range(3)]
                rows.append(r[0] * m[0] + r[1] * m[1] + r[2] * m[2])
        else:  # [T, S] @ [S, D] on the flattened table: a matmul, no gather
            rows = [(onehot @ t.reshape(t.shape[1], -1)).reshape(1, onehot.shape[0], *t.shape[2:]) for t in tabs]
        return tuple(rows) if self.rope_is_pair else rows[0]

    def _mask(self, input_pos):
        q = input_pos.view(-1, 1)  # [T, 1] query positions against [S] cache positions
        allowed = self.positions.view(1, -1) <= q
        if self.window:
            allowed = allowed & (self.positions.view(1, -1) > q - self.window)
        zero = torch.zeros((), dtype=torch.float32)
        return torch.where(allowed, zero, torch.full((), MASK_VALUE)).view(1, 1, q.shape[0], -1)

    def forward(self, hidden, *args):
        start = None
        rope_pos = rope_onehot = None
        if self.kv_mode == "buffer":
            (input_pos, rope_pos) = args if self.mrope else (args[0], None)
            onehot = k_past = v_past = None
            if self.custom_kv:
                start = input_pos[0].item()
                if torch.compiler.is_exporting():  # a size-like SymInt: the ops' start_pos
                    torch._check_is_size(start)
                    torch._check(start + self.chunk <= self.max_seq)
                mask = None
            else:
                mask = self._mask(input_pos)
        else:
            onehot, mask, k_past, v_past = args[:4]
            rope_onehot = args[4] if self.mrope else None
            input_pos = None
        cache = _StepCache(self, input_pos, onehot, k_past, v_past)
        cache.start = start
        dec = self.decoder
        residual = hidden
        a = dec.input_layernorm(hidden)
        with _custom_attention(dec, start) if self.custom_kv else contextlib.nullcontext():
            rope = self._rope(input_pos, onehot, rope_pos, rope_onehot)
            a, _ = dec.self_attn(hidden_states=a, position_embeddings=rope,
                                 attention_mask=mask, past_key_values=cache)
        h = residual + a
        x = dec.post_attention_layernorm(h)
        if not self.is_moe:
            outs = (h + dec.mlp(x),)
        else:
            x2 = x.reshape(self.chunk, -1)
            logits = nn.functional.linear(x2, self.router_w, self.router_b)
            h_res = h + self.shared(x) if self.shared is not None else h
            outs = (h_res, x2, logits)
            if self.pred_w is not None:
                preds = x2 @ self.pred_w.t() + self.pred_b
                E = logits.shape[-1]
                outs += (preds.reshape(-1, E) if self.chunk == 1 else preds.reshape(self.chunk, -1, E),)
        if self.kv_mode == "io":
            outs += cache.new
        return outs


class EmbedGraph(nn.Module):
    """forward(token int64 [1, 1]) -> hidden [1, 1, H]."""

    def __init__(self, steps: "StepModel"):
        super().__init__()
        self.embed = steps.model.get_input_embeddings()

    def forward(self, token):
        return self.embed(token)


class HeadGraph(nn.Module):
    """forward(hidden [1, 1, H]) -> logits [1, V] (final norm and LM head)."""

    def __init__(self, steps: "StepModel"):
        super().__init__()
        self.norm = text_model(steps.model).norm
        self.lm_head = steps.model.get_output_embeddings()

    def forward(self, hidden):
        return self.lm_head(self.norm(hidden)).reshape(1, -1)


class ExpertGraph(nn.Module):
    """forward(x [1, H], *matrices) -> the routed expert's output [1, H] (unweighted).

    The matrices are inputs in the canonical store order (gate, up, down[, biases]), so the graph
    holds no expert weights."""

    def __init__(self, steps: "StepModel"):
        super().__init__()
        self.family = steps.spec.family
        self.tc = steps.spec.family.text_config(steps.spec.config)
        self.roles = [m.role for m in steps.spec.family.expert_matrices(steps.spec.geometry)]

    def forward(self, x, *mats):
        return self.family.expert_forward(dict(zip(self.roles, mats)), x, self.tc)


class StepModel:
    """The model's decode-step graphs (see the module doc). Built from the dense model: routed
    experts are never loaded.

    Args:
        spec / model: the model directory and its dense transformers model (load_dense_model).
        max_seq: KV cache length (prompt + generated tokens).
        adapter_heads: MoE-layer index -> (matrix [P*E, H], bias [P*E]) of the predictions the
            layer graph returns (see `adapter_heads`).
    """

    def __init__(self, spec: ModelSpec, model: nn.Module, *, max_seq: int,
                 adapter_heads: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None):
        self.spec, self.model, self.max_seq = spec, model, max_seq
        self.adapter_heads = adapter_heads or {}
        # prefill chunk sizes T of the buffer-mode graphs (prefill_T_layer_N); the ExecuTorch export
        # sets them (export/executorch_target.py: prefill_chunk_sizes), other graphs have none
        self.prefill_chunks: tuple[int, ...] = ()
        # buffer-mode layers that fit them use ExecuTorch's LLM custom ops for the KV cache and
        # attention (custom_kv_fits); the ExecuTorch export turns it on where the ops load
        self.kv_custom_ops = False
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation("eager")  # plain ops every exporter takes
        tm = text_model(model)
        self.layers = tm.layers
        # which layers see a sliding-window mask, as each family's model builds its masks
        self.windows = spec.family.sliding_windows(spec.family.text_config(spec.config), len(self.layers))
        # a vision-language bundle's vision tower at its one image grid (export/vision.py: VisionGraph):
        # the `vision` method, set by the export when the bundle takes images
        self.vision: nn.Module | None = None
        self.rope_tables, self.rope_is_pair = self._rope_tables(tm)
        # M-RoPE: the axis (0 t, 1 h, 2 w) each rotary channel takes its position from; None: 1-D
        self.mrope_axes = spec.family.mrope_axes(tm)
        self.cache_specs = self._probe_caches()

    def _rope_tables(self, tm) -> tuple[list[torch.Tensor], bool]:
        pos = self.spec.family.rope_positions(torch.arange(self.max_seq).view(1, -1))
        dummy = torch.zeros(1, self.max_seq, 1)
        with torch.no_grad():
            out = tm.rotary_emb(dummy, pos)
        if isinstance(out, tuple):
            return [t.float().contiguous() for t in out], True
        if out.is_complex():  # complex freqs_cis (DeepSeek-V2) -> (cos, sin) pairs for its export patch
            return [torch.view_as_real(out).float().contiguous()], False
        return [out.float().contiguous()], False

    def _probe_caches(self) -> list[CacheSpec]:
        """Run each layer's attention once with a recording cache to learn its cached shapes
        (K/V heads and widths differ: GQA, MLA latents)."""
        specs = []
        H = int(self.spec.family.text_config(self.spec.config).hidden_size)
        for layer in range(len(self.layers)):
            seen = {}

            class Probe:
                def update(self, k, v, *a, **kw):
                    seen["k"], seen["v"] = k.shape, v.shape
                    return k, v

            attn = self.layers[layer].self_attn
            rope = [t[:, :1] for t in self.rope_tables]
            with torch.no_grad(), exportable_family(self.spec.family):
                attn(hidden_states=torch.zeros(1, 1, H),
                     position_embeddings=tuple(rope) if self.rope_is_pair else rope[0],
                     attention_mask=torch.zeros(1, 1, 1, 1), past_key_values=Probe())
            if "k" not in seen:
                raise SpecPrefetchError(f"layer {layer}: attention never wrote its cache; cannot export it")
            k, v = seen["k"], seen["v"]
            specs.append(CacheSpec((1, k[1], self.max_seq, k[3]), (1, v[1], self.max_seq, v[3])))
        return specs

    # -- graphs -------------------------------------------------------------------------
    def graphs(self, kv_mode: KvMode) -> dict[str, nn.Module]:
        """Method name -> module: embed, layer_0..layer_{N-1}, expert, head, and in buffer mode
        prefill_T_layer_N for every chunk size T of `prefill_chunks`."""
        out: dict[str, nn.Module] = {"embed": EmbedGraph(self)}
        for layer in range(len(self.layers)):
            out[f"layer_{layer}"] = LayerGraph(self, layer, kv_mode)
        for T in self.chunks(kv_mode):
            for layer in range(len(self.layers)):
                g = LayerGraph(self, layer, kv_mode, chunk=T)
                dec = out[f"layer_{layer}"]
                if kv_mode == "buffer":  # one cache, run eagerly too (io mode: the host's)
                    for name in (f"k_cache_{layer}", f"v_cache_{layer}"):
                        g.register_buffer(name, getattr(dec, name), persistent=False)
                out[prefill_name(T, layer)] = g
        out["expert"] = ExpertGraph(self)
        out["head"] = HeadGraph(self)
        if self.vision is not None:
            out["vision"] = self.vision
        for m in out.values():
            m.eval()
        return out

    def chunks(self, kv_mode: KvMode) -> tuple[int, ...]:
        """The prefill chunk sizes of the graphs (`prefill_chunks`, set by the export target)."""
        return tuple(self.prefill_chunks)

    def example_inputs(self, name: str, kv_mode: KvMode) -> tuple[torch.Tensor, ...]:
        g = self.spec.geometry
        H = g.hidden_size
        chunk = parse_prefill_name(name)
        T = chunk[0] if chunk is not None else 1
        # M-RoPE layers take the (t, h, w) rotary positions last: [3, T] (buffer mode), one-hot [3, T, S] (io)
        rope = (torch.arange(T, dtype=torch.long).expand(3, -1).contiguous(),) \
            if self.mrope_axes is not None and kv_mode == "buffer" else ()
        if chunk is not None and kv_mode == "buffer":
            return (torch.randn(1, T, H), torch.arange(T, dtype=torch.long), *rope)
        if name == "embed":
            return (torch.zeros(1, 1, dtype=torch.long),)
        if name == "head":
            return (torch.randn(1, 1, H),)
        if name == "vision":
            return (torch.randn(*self.vision.input_shape),)
        if name == "expert":
            return (torch.randn(1, H),) + tuple(torch.randn(m.shape) * 0.05
                                                for m in self.spec.family.expert_matrices(g))
        T, layer = chunk if chunk is not None else (1, int(name.split("_")[1]))
        if kv_mode == "buffer":
            return (torch.randn(1, 1, H), torch.tensor([0], dtype=torch.long), *rope)
        cs = self.cache_specs[layer]
        S = self.max_seq
        onehot = nn.functional.one_hot(torch.arange(T), S).float()
        rope = (onehot.expand(3, -1, -1).contiguous(),) if self.mrope_axes is not None else ()
        return (torch.randn(1, T, H), onehot, host_mask(0, S, self.windows[layer], chunk=T), torch.zeros(cs.k_shape),
                torch.zeros(cs.v_shape), *rope)

    def names(self, kv_mode: KvMode = "io") -> list[str]:
        n = len(self.layers)
        return (["embed"] + [f"layer_{i}" for i in range(n)]
                + [prefill_name(T, i) for T in self.chunks(kv_mode) for i in range(n)] + ["expert", "head"]
                + (["vision"] if self.vision is not None else []))


def adapter_heads(adapter, bank, horizons: tuple[int, ...]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Fold the prefetch adapter into one prediction matrix per MoE layer: rows (h, e) hold the
    effective router W_{i+h} + B A of each horizon h (and the target router's bias), so the layer
    graph's `preds` output is every window step's router logits in one matmul."""
    out = {}
    E = bank.weight.shape[1]
    for i in range(bank.num_layers):
        mats, biases = [], []
        for h in horizons:
            if (i, h) not in adapter.pair_index:
                continue
            p = adapter.pair_index[(i, h)]
            j = adapter.target_layer(i, h)
            mats.append(bank.weight[j] + adapter.B[p].detach() @ adapter.A[p].detach())
            biases.append(bank.bias[j] if bank.bias is not None else torch.zeros(E))
        if mats:
            out[i] = (torch.cat(mats).float().contiguous(), torch.cat(biases).float().contiguous())
    return out


def describe(steps: StepModel, kv_mode: KvMode) -> dict[str, Any]:
    """The signature of every graph: input and output names with shapes and dtypes."""
    g = steps.spec.geometry
    H, E = g.hidden_size, g.routing.num_experts
    sig: dict[str, Any] = {}
    for name in steps.names(kv_mode):
        ins = steps.example_inputs(name, kv_mode)
        sig[name] = {"inputs": [[list(t.shape), str(t.dtype).replace("torch.", "")] for t in ins]}
    for T in (1, *steps.chunks(kv_mode)):
        for layer in range(len(steps.layers)):
            outs = [[1, T, H]]
            if layer in g.moe_layers:
                outs += [[T, H], [T, E]]
                heads = steps.adapter_heads.get(g.moe_layers.index(layer))
                if heads is not None:
                    P = heads[0].shape[0] // E
                    outs.append([P, E] if T == 1 else [T, P, E])
            if kv_mode == "io":
                cs = steps.cache_specs[layer]
                outs += [[*cs.k_shape[:2], T, cs.k_shape[3]], [*cs.v_shape[:2], T, cs.v_shape[3]]]
            sig[f"layer_{layer}" if T == 1 else prefill_name(T, layer)]["outputs"] = [[o, "float32"] for o in outs]
    sig["embed"]["outputs"] = [[[1, 1, H], "float32"]]
    sig["expert"]["outputs"] = [[[1, H], "float32"]]
    sig["head"]["outputs"] = [[[1, g.vocab_size], "float32"]]
    if steps.vision is not None:
        v = steps.vision
        sig["vision"]["outputs"] = [[[v.num_tokens, v.out_hidden], "float32"],
                                    [[len(v.deepstack_indexes), v.num_tokens, v.out_hidden], "float32"]]
    return sig
