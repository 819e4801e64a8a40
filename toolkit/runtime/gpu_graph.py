"""Device-bound decode for the GPU tier: the dense part of every decoder layer over a static KV cache,
replayed as CUDA graphs, with the routed experts computed from the pool's slots inside the graphs.

transformers' eager modules at batch 1 cost about 2 ms of host time per layer (kernel launches); an
expert copy over PCIe takes 0.17 ms for a 9 MiB expert. With the host that slow every copy is hidden
and no prefetching policy can win. This module takes the host out of the per-kernel path:

    segment 0      embedding, decoder layers up to the first MoE layer's router
    segment s      the routed experts of MoE layer s-1 (read from the pool's slots) + its residual
                   (summed inside the next layer's q/k/v kernel with the fused attention and experts),
                   then the decoder layers up to MoE layer s's router
    segment L      the last MoE layer's experts, the remaining layers, the final norm, the LM head and
                   the greedy argmax (the next token stays on the device); with the fused attention the
                   final norm and the LM head are one kernel where it fits (`fused_head`),
                   which also sums the last MoE layer's experts where no layer follows it
                   (StaticDecoder.head_one)

Each segment is one CUDA graph replay. Between two replays the host reads the router's top-k (and, when a
planner runs that does not fold, the router's input) through non-blocking copies into pinned memory and one
wait on them: the one host sync per MoE layer on the compute stream (plus one per token for the next token). A
folding planner's rows are computed on the device by a graph of their own (DevicePlan), on a GPU on a stream of
their own, which the host waits for a second time only when it plans, after it has enqueued the next segment.
With the routing read, the host asks the scheduler for the experts (acquire: demand
copies on their own stream), writes the slot numbers into a device buffer, makes the compute stream wait on the
copies of those slots (CUDA events: the stall) and replays the next segment, then plans the prefetches; where
every expert of the layer is already in the pool, the acquire's bookkeeping comes after the replay too
(read_resident, then the replay, then acquire). The graphs compute the k routed experts from the slots by those
numbers, one of two ways
(`GpuEngine(experts=...)`): `fused` (the default with `graph` on an fp16 model) reads each expert's matrices
where they lie with a grouped fp16 GEMV (gpu_kernels.slot_gemv), each expert byte read once, as the HBM floor
counts; `eager` gathers the k experts' weights (a copy: read, written, read again) and runs transformers'
eager expert loop on them (the same F.linear calls, ascending expert order, index_add_), bitwise transformers'
expert arithmetic.

With every expert resident (the bench's upper bound) the host has nothing to decide: `decode_resident`
looks each router's slots up on the device and runs the whole token as one graph, with one host sync
per token. Attention runs over a static cache of
`S` positions with an additive mask (positions beyond the token masked), which rounds differently
from transformers' dynamic-cache attention in fp16: tokens are still checked against transformers'.

The draft (Specter's int4 self-draft) runs a whole decode step as one graph with no host sync at all:
its int4 experts are all resident, gathered by the router's choices on the device and computed by a
fused dequantising grouped GEMV (toolkit/runtime/gpu_kernels.py, Triton on CUDA). Its routing goes
back to the host once per step, asynchronously, for the verification pass's prefetches.

With `GpuEngine(compile=...)` each piece a graph replays (a segment, the all-resident token, the draft's
step) goes through torch.compile whole (`compiled`): the expert GEMVs are custom operators, so inductor
fuses the element-wise work and the buffer copies around them, and the routers' top-k and one-row GEMV
are decomposed for inductor (`topk_by_sort`, `row_times_narrow`). Compiled or not, a layer's q/k/v
projections are one GEMV (`_FusedQKV`), a one-position attention reads the static cache in place (the
query heads of a K/V head as its rows), and a SiLU expert's activation is computed inside the gate / up
kernel (inside the down projection's where gate and up are not adjacent). With `GpuEngine(attention="fused",
router="fused")` (the default with `graph`) a one-position step's attention block and each MoE layer's
router are a kernel or two each (toolkit/runtime/gpu_attention.py, gpu_router.py: two over a long cache or
for a large router): the q/k/v projection one kernel with the input norm and the MoE layer before's expert
combine (gpu_kernels.norm_gemv), the output projection the slot GEMV's kernel over a one-slot pool (`_gemv`).
docs/gpu-tier.md has the figures.

Where CUDA is absent (CI) the same functions run eagerly on the CPU: `decode="static"`.
"""
from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

import torch
import torch.nn.functional as F

from toolkit.errors import SpecPrefetchError
from toolkit.runtime.reuse import next_visit_experts
from toolkit.runtime.scheduler import resident_first, stable_topk

SUPPORTED = ("qwen3_moe", "mixtral")
# torch.compile takes a function's own recompile limit (torch 2.13; not 2.11)
PER_FUNCTION_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters


def supported(spec) -> str | None:
    """None when the fast path can run this model, else why not."""
    fam = spec.geometry.family
    if fam not in SUPPORTED:
        return f"family {fam}: the static-cache decoder covers {', '.join(SUPPORTED)}"
    return None


def topk_by_sort(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """aten.topk for a router's row (a few dozen experts) as a stable descending sort and its first k:
    inductor compiles the sort into one Triton kernel of the step, where its top-k is a library call of
    two kernels (a selection and a sort) per MoE layer. The same values in the same order; among equal
    values the lower index first. Other shapes (smallest, or rows past 1024): NotImplemented (inductor's
    own handling)."""
    if not largest or x.shape[dim] > 1024:
        return NotImplemented
    return stable_topk(x, k, dim)


def row_times_narrow(a: torch.Tensor, b: torch.Tensor):
    """aten.mm of one row [1, K] by a narrow half-precision matrix [K, N <= 128] (a router's: one column
    per expert) as products summed in float32 and rounded once, as cuBLAS' GEMV accumulates: inductor
    fuses it with the norm before it and the softmax after, where cuBLAS took a launch of its own for
    a few KiB of weights. Other shapes: NotImplemented (`_inductor` then uses inductor's own)."""
    if a.shape[0] != 1 or b.shape[1] > 128 or a.dtype not in (torch.float16, torch.bfloat16) or b.dtype != a.dtype:
        return NotImplemented
    return (a.float().t() * b.float()).sum(0, keepdim=True).to(a.dtype)


def _inductor(gm, example_inputs):
    """torch.compile's inductor backend with the routers' top-k and their one-row GEMV decomposed
    (topk_by_sort, row_times_narrow; where they decline, inductor's own decompositions of those ops)."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    table = dict(select_decomp_table())
    for op, mine in ((torch.ops.aten.topk.default, topk_by_sort), (torch.ops.aten.mm.default, row_times_narrow)):
        table[op] = functools.partial(_first_of, mine, table.get(op))
    return compile_fx(gm, example_inputs, decompositions=table)


def _first_of(mine, theirs, *args, **kwargs):
    out = mine(*args, **kwargs)
    return theirs(*args, **kwargs) if out is NotImplemented and theirs is not None else out


def compiled(fns, backend: str, n_layers: int):
    """`fns` through torch.compile (`backend`: "inductor" on a GPU, with the routers' top-k and one-row
    GEMV decomposed (`_inductor`), fuses the norms, rotary embedding, casts, residual adds and buffer
    copies into a few Triton kernels; the projections stay cuBLAS' but under the fused attention), shapes
    static but for the sizes the caller marks dynamic, each function whole (fullgraph: a graph break inside
    the captured step is an error, not a silent eager fallback). A segment's index is a constant of its
    trace, so every segment, and every runner's static cache length, is its own compiled entry: each
    function's recompile limit (its own; dynamo's global per-function one untouched) holds
    16 x (n_layers + 1) of them, and past it the call fails (fullgraph) instead of running eagerly
    without a word."""
    import torch._dynamo.config as dcfg

    limit = 16 * (n_layers + 1)
    backend = _inductor if backend == "inductor" else backend
    # dynamo's cap on all compiles of one function in the process (every runner's pieces share these
    # functions' code), 256 by default: raised where 16 caches' entries need more (a cap, not a behaviour)
    dcfg.accumulated_recompile_limit = max(dcfg.accumulated_recompile_limit, limit)
    if PER_FUNCTION_LIMIT:
        return tuple(torch.compile(f, backend=backend, dynamic=False, fullgraph=True, recompile_limit=limit)
                     for f in fns)
    # torch before 2.13 (its compile takes no per-function limit): dynamo's per-function limit is set to
    # this one for the duration of each call (a compile happens inside a call), so others keep theirs
    return tuple(_with_limit(torch.compile(f, backend=backend, dynamic=False, fullgraph=True), limit) for f in fns)


def _with_limit(fn, limit: int):
    import torch._dynamo.config as dcfg

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with dcfg.patch(recompile_limit=limit):
            return fn(*args, **kwargs)
    return call


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    if n == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


class StaticKV:
    """One sequence's K and V for every decoder layer at fixed addresses: [1, kv heads, S, head dim]."""

    def __init__(self, n_layers: int, kv_heads: int, S: int, head_dim: int, device, dtype):
        self.k = [torch.zeros(1, kv_heads, S, head_dim, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]

    def load(self, cache, n: int) -> None:
        """Positions 0..n-1 from a transformers DynamicCache (the prefill's). It must hold every
        position: a cache built from a sliding-window config keeps only the last window - 1 on its
        sliding layers, so the engine prefills into a plain (full) DynamicCache; the static mask
        applies the window."""
        if len(cache.layers) != len(self.k):
            raise SpecPrefetchError(f"internal: the prefill cache has {len(cache.layers)} layers, the static cache "
                                    f"{len(self.k)}")
        for i, layer in enumerate(cache.layers):
            have = layer.keys.shape[2]
            if have != n:
                raise SpecPrefetchError(f"internal: layer {i} of the prefill cache holds {have} positions, not the "
                                        f"prompt's {n} (a sliding-window cache?): the static path needs a full cache")
            self.k[i][:, :, :n].copy_(layer.keys)
            self.v[i][:, :, :n].copy_(layer.values)


class _FusedQKV:
    """A layer's q, k and v projections as one [q + k + v, H] weight (and bias), the modules'
    parameters rebound as row views of it (no second copy): one GEMV where there were three, compiled
    or not. Kept on the attention module, so every runner built over that model shares it (a new runner
    makes it again if something rebound the modules' weights since: `live`; runners already built keep
    reading this one, so the engine's model must not be given other weights while the engine lives, as
    its expert pool and store already assume)."""

    def __init__(self, projs):
        self.sizes = [p.out_features for p in projs]
        self.weight = torch.cat([p.weight.detach() for p in projs])
        self.bias = None if projs[0].bias is None else torch.cat([p.bias.detach() for p in projs])
        for p, w in zip(projs, self.weight.split(self.sizes)):
            p.weight.data = w
        if self.bias is not None:
            for p, b in zip(projs, self.bias.split(self.sizes)):
                p.bias.data = b
        self._ptrs = self._now(projs)

    @staticmethod
    def _now(projs):
        return [(p.weight.data_ptr(), None if p.bias is None else p.bias.data_ptr()) for p in projs]

    def live(self, sa) -> bool:
        """Still the modules' own weights (nothing rebound them since, e.g. a dtype or device change)."""
        return self._now((sa.q_proj, sa.k_proj, sa.v_proj)) == self._ptrs


def _fused_qkv(sa) -> _FusedQKV | None:
    projs = (sa.q_proj, sa.k_proj, sa.v_proj)
    have = getattr(sa, "_specprefetch_qkv", None)
    if have is not None and have.live(sa):
        return have
    from toolkit.runtime.gpu_attention import qkv_fusable

    if not qkv_fusable(projs):
        sa._specprefetch_qkv = None     # (a stale one would keep a copy of the weights alive)
        return None
    sa._specprefetch_qkv = _FusedQKV(projs)
    return sa._specprefetch_qkv


FUSED_HEAD_ROWS = 65536   # StaticDecoder.fused_head's vocabulary bound


def combine(h: torch.Tensor, pending) -> torch.Tensor:
    """h plus a MoE layer's routed outputs handed over unsummed (StaticDecoder.attend's `pending`), as
    FusedExpertMath sums them; h itself where there are none."""
    if pending is None:
        return h
    from toolkit.runtime.gpu_kernels import expert_sum

    return h + expert_sum(*pending).view(1, 1, -1).to(h.dtype)


class StaticDecoder:
    """The model's own modules (norms, projections, rotary embedding, router, LM head) applied over a
    static KV cache; the expert math is supplied per use (pool slots for the target, int4 for the draft)."""

    def __init__(self, eng):
        self.eng = eng
        self.dev = eng.dev
        model = eng.model
        self.inner = model.model
        self.lm_head = model.lm_head
        self.layers = list(self.inner.layers)
        g = eng.spec.geometry
        self.moe_at = {layer: li for li, layer in enumerate(g.moe_layers)}
        self.blocks = {layer: eng.spec.family.moe_block(model, layer) for layer in g.moe_layers}
        sa = self.layers[0].self_attn
        self.head_dim = sa.head_dim
        self.kv_heads = sa.k_proj.out_features // sa.head_dim
        self.groups = sa.num_key_value_groups
        self.qk_norm = hasattr(sa, "q_norm")
        self.rope = sys.modules[type(sa).__module__].apply_rotary_pos_emb
        cfg = model.config
        use_sw = g.family == "mixtral" or bool(getattr(cfg, "use_sliding_window", False))
        self.window = getattr(cfg, "sliding_window", None) if use_sw else None
        self.H = g.hidden_size
        self.dtype = eng.dtype
        self.S = 0
        self.qkv = [_fused_qkv(layer.self_attn) for layer in self.layers]
        self.heads = sa.q_proj.out_features // self.head_dim
        # one position's attention in one kernel a layer, two over a long cache (gpu_attention;
        # GpuEngine(attention="fused")), where every layer's q/k/v is one projection
        self.fused_attention = eng.attention == "fused"
        if self.fused_attention and any(f is None for f in self.qkv):   # (gpu_attention.attention_usable said yes)
            raise SpecPrefetchError("internal: the fused attention was chosen for q/k/v projections that are not "
                                    "one GEMV")
        # (_gemv's one slot)
        self.slot0 = torch.zeros(1, dtype=torch.long, device=eng.dev.device) if self.fused_attention else None
        # the fused attention's q/k/v GEMV also takes the layer's input norm (gpu_kernels.norm_gemv), and the
        # routed experts of the MoE layer before where the runner hands them over (`pending`); none: empty
        self.no_combine = ((torch.zeros(0, self.H, device=eng.dev.device, dtype=self.dtype),
                            torch.zeros(0, device=eng.dev.device, dtype=self.dtype),
                            torch.zeros(0, dtype=torch.long, device=eng.dev.device))
                           if self.fused_attention else None)
        # one position's residual add, post-attention norm and router in one kernel a MoE layer, two for a large
        # router (gpu_router;
        # GpuEngine(router="fused")); whether each router divides its top-k by their sum (Mixtral's always do)
        self.fused_router = eng.router == "fused"
        self.norm_topk = {i: bool(getattr(self.blocks[i].gate, "norm_topk_prob", True)) for i in self.blocks}
        # one position's final norm and LM head (and the last MoE layer's routed outputs, handed over) in one
        # norm_gemv, with the fused attention, where the head is a plain fp16 matrix after a weighted RMS norm,
        # its row held in one block (the weights read ahead of the PDL wait) and the vocabulary at most
        # FUSED_HEAD_ROWS (each program re-reads the combine's k + 1 rows from the L2; untimed, the bench
        # model's vocabulary is 4,096: a guess)
        from toolkit.runtime.gpu_kernels import NORM_ONE_BLOCK, is_weighted_rms_norm

        head = self.lm_head
        self.fused_head = (self.fused_attention and is_weighted_rms_norm(self.inner.norm)
                           and getattr(head, "bias", None) is None and head.weight.dtype == torch.float16
                           and head.weight.is_contiguous() and self.H <= NORM_ONE_BLOCK
                           and head.weight.shape[0] <= FUSED_HEAD_ROWS)

    # -- the dense pieces ------------------------------------------------------------------
    def mask(self, positions: torch.Tensor, S: int) -> torch.Tensor:
        """Additive [1, 1, T, S]: key j is visible to the row at position p iff j <= p (and p - j < window)."""
        ar = torch.arange(S, device=positions.device)
        ok = ar[None, :] <= positions[:, None]
        if self.window:
            ok = ok & (positions[:, None] - ar[None, :] < self.window)
        zero = torch.zeros((), device=positions.device, dtype=self.dtype)
        return torch.where(ok, zero, torch.finfo(self.dtype).min)[None, None]

    def attend(self, i: int, h: torch.Tensor, positions: torch.Tensor, kv: StaticKV, mask, cos_sin,
               pending=None) -> tuple[torch.Tensor, torch.Tensor]:
        """h [1, T, H] -> (self-attention(h) after the output projection, the residual not added; h): the new
        K, V written at `positions` first. `pending`: the MoE layer before's routed outputs (ys [k, H], its
        scores [1, k], their positions perm [k]; FusedExpertMath.parts), added into h first (the h returned)."""
        layer = self.layers[i]
        sa = layer.self_attn
        T = h.shape[1]
        fused = self.qkv[i]
        if T == 1 and self.fused_attention:   # norms, rotary, cache write and attention in one kernel
            from toolkit.runtime.gpu_attention import decode_attention
            from toolkit.runtime.gpu_kernels import norm_gemv

            cos, sin = cos_sin
            # (the weights detached: the custom operators have no gradient, and the step needs none)
            qn, kn = (sa.q_norm.weight.detach(), sa.k_norm.weight.detach()) if self.qk_norm else (None, None)
            eps = sa.q_norm.variance_epsilon if self.qk_norm else 0.0
            ln = layer.input_layernorm
            if fused.bias is None:   # the expert combine, the input norm and the q/k/v GEMV in one kernel
                h, qkv = norm_gemv(h, *(pending or self.no_combine), ln.weight.detach(), ln.variance_epsilon,
                                   fused.weight)   # (_FusedQKV's weight is built from detached ones)
            else:
                h = combine(h, pending)
                qkv = self._gemv(ln(h), fused.weight, fused.bias)
            o = decode_attention(qkv, qn, kn, cos.view(-1), sin.view(-1), kv.k[i], kv.v[i], positions, self.heads,
                                 sa.scaling, eps, self.window or 0)
            return self._gemv(o, sa.o_proj.weight.detach(), sa.o_proj.bias).view(1, 1, -1), h
        h = combine(h, pending)
        x = layer.input_layernorm(h)
        shape = (1, T, -1, self.head_dim)
        if fused is not None:   # one GEMV for the three projections
            q, k, v = F.linear(x, fused.weight, fused.bias).split(fused.sizes, dim=-1)
        else:
            q, k, v = sa.q_proj(x), sa.k_proj(x), sa.v_proj(x)
        q, k, v = q.view(shape), k.view(shape), v.view(shape).transpose(1, 2)
        if self.qk_norm:
            q, k = sa.q_norm(q), sa.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = cos_sin
        q, k = self.rope(q, k, cos, sin)
        kv.k[i].index_copy_(2, positions, k.to(kv.k[i].dtype))
        kv.v[i].index_copy_(2, positions, v.to(kv.v[i].dtype))
        if self._folds(T):
            # one position: the query heads sharing a K/V head are that head's rows ([1, kv heads, groups,
            # d]; head h reads K/V head h // groups, as repeat_kv lays them out), so the cache is read
            # where it lies instead of expanded into a copy per query head
            qg = q.reshape(1, self.kv_heads, self.groups, self.head_dim)
            o = F.scaled_dot_product_attention(qg, kv.k[i], kv.v[i], attn_mask=mask, scale=sa.scaling)
            o = o.reshape(1, 1, -1)
        else:
            K, V = _repeat_kv(kv.k[i], self.groups), _repeat_kv(kv.v[i], self.groups)
            o = F.scaled_dot_product_attention(q, K, V, attn_mask=mask, scale=sa.scaling)
            o = o.transpose(1, 2).reshape(1, T, -1)
        return sa.o_proj(o), h

    def _gemv(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """One row through the fused attention's output projection (and a q/k/v projection with a bias, which
        norm_gemv does not take) -> [1, O]: on CUDA with Triton the slot
        GEMV's kernel over the weight as a pool of one slot (gpu_kernels.slot_gemv; the resident profile
        had cuBLAS's GEMV at about 4 us for these few MiB, most of it fixed cost); F.linear with a bias, a
        non-contiguous weight, or elsewhere (the slot GEMV's torch reference would copy the weight)."""
        from toolkit.runtime.gpu_kernels import triton

        x = x.reshape(1, -1)
        if b is not None or not w.is_contiguous() or triton is None or not w.is_cuda:
            return F.linear(x, w, b)
        from toolkit.runtime.gpu_kernels import slot_gemv

        # (`pre`: the one slot and the weight are constants, read while the kernel before finishes under PDL)
        return slot_gemv(w.view(1, *w.shape), self.slot0, x, pre=True)

    def _folds(self, T: int) -> bool:
        """Whether attention over T positions runs a K/V head's query heads as its rows (the K/V fold,
        attention), which the one-position mask is made for (prelude)."""
        return T == 1 and self.groups > 1

    def prelude(self, positions: torch.Tensor, h: torch.Tensor):
        cs = self.inner.rotary_emb(h, positions[None])
        if positions.numel() == 1 and self.fused_attention:   # (the kernel masks by the position itself)
            return None, cs
        mask = self.mask(positions, self.S)
        if self._folds(positions.numel()):
            # one position's attention runs a K/V head's query heads as its rows (attention): the mask gets
            # those rows for real (a broadcast over the query rows is a zero stride some fused attention
            # kernels mishandle; a broadcast over heads, as before, stays)
            mask = mask.expand(1, 1, self.groups, mask.shape[-1]).contiguous()
        return mask, cs

    def route(self, i: int, h: torch.Tensor):
        """MoE layer i's input (post-attention norm, [T, H]), top-k weights and indices (the model's router)."""
        post = self.layers[i].post_attention_layernorm(h).view(-1, self.H)
        _, scores, idx = self.blocks[i].gate(post)
        return post, scores, idx

    def layer(self, i: int, h: torch.Tensor, positions: torch.Tensor, kv: "StaticKV", mask, cos_sin, out=None,
              slots=None, pending=None):
        """Decoder layer i: attention, then the router of a MoE layer -> (h, post, scores, idx), or the
        whole of a dense layer -> (h,). `out`: a MoE layer's (post, scores, idx) buffers, which its
        results are written into (and returned as). `slots`: the layer's (slot table [E], selection [2k])
        with every expert resident: the selection is written too (the chosen experts' slots in ascending
        expert order, then their top-k positions), by the fused router or here. `pending`: as attend's."""
        a, h = self.attend(i, h, positions, kv, mask, cos_sin, pending)
        if i not in self.moe_at:
            return (self.dense_mlp(i, h + a),)
        if out is not None and h.shape[1] == 1 and self.fused_router:
            from toolkit.runtime.gpu_router import route as fused_route

            norm, gate = self.layers[i].post_attention_layernorm, self.blocks[i].gate
            h = fused_route(h, a, norm.weight.detach(), norm.variance_epsilon, gate.weight.detach(), self.norm_topk[i],
                            *out, *(slots or ()))
            return (h, *out)
        h = h + a
        routed = self.route(i, h)
        if out is None:
            return (h, *routed)
        for buf, x in zip(out, routed):
            buf.copy_(x)
        if slots is not None:
            from toolkit.runtime.gpu_router import select_slots_torch

            select_slots_torch(out[2], *slots)
        return (h, *out)

    def dense_mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        layer = self.layers[i]
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.inner.norm(h))

    def head_one(self, h: torch.Tensor, pending=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One position's (h [1, 1, H]) logits [1, 1, V] and h with `pending` (attend's) added: in one kernel
        (gpu_kernels.norm_gemv: the combine, the final norm and the head's GEMV) where `fused_head`, else
        combine, then head."""
        if not self.fused_head:
            h = combine(h, pending)
            return self.head(h), h
        from toolkit.runtime.gpu_kernels import norm_gemv

        norm = self.inner.norm
        h, logits = norm_gemv(h, *(pending or self.no_combine), norm.weight.detach(), norm.variance_epsilon,
                              self.lm_head.weight.detach())
        return logits.view(1, 1, -1), h

    # -- a whole pass of T rows, eagerly (verification, and every step on the CPU) ------------
    def forward_rows(self, tokens: torch.Tensor, pos: int, kv: StaticKV, experts) -> torch.Tensor:
        """tokens [T] at positions pos..pos+T-1 -> logits [T, V] (float); `experts(li, post, idx, scores)`
        gives MoE layer li's routed output [T, H]."""
        T = tokens.numel()
        positions = torch.arange(pos, pos + T, device=tokens.device)
        h = self.inner.embed_tokens(tokens[None])
        mask, cs = self.prelude(positions, h)
        for i in range(len(self.layers)):
            h, *routed = self.layer(i, h, positions, kv, mask, cs)
            if routed:
                post, scores, idx = routed
                h = h + experts(self.moe_at[i], post, idx, scores).view(1, T, self.H).to(h.dtype)
        return self.head(h)[0].float()


class PooledExpertMath:
    """transformers' eager expert loop for one token over k experts whose weights are gathered from the
    pool's slots by slot number (a device tensor), in ascending expert order: bitwise transformers'.
    The gather (index_select) copies the k experts' weights per MoE layer per token: device-memory
    traffic beyond the one read of each expert that the HBM floor counts."""

    def __init__(self, eng, slots: torch.Tensor):
        self.eng, self.k = eng, eng.k
        w = slots.view(torch.float16)
        C = w.shape[0]
        if eng.contiguous:
            off, n, shape = eng.gate_up_span
            self.gu = (w[:, off:off + n].view(C, *shape),)
        else:
            g0, gn, gs = eng.gate_span
            u0, un, us = eng.up_span
            self.gu = (w[:, g0:g0 + gn].view(C, *gs), w[:, u0:u0 + un].view(C, *us))
        d0, dn, ds = eng.down_span
        self.dn = w[:, d0:d0 + dn].view(C, *ds)
        self.act = eng.math.act_fn
        self.dtype = eng.dtype

    def __call__(self, x: torch.Tensor, scores: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        """x [1, H]; scores [1, k] in top-k order; sel [2k]: slot numbers (ascending expert) then the
        top-k positions of those experts."""
        k = self.k
        slots, perm = sel[:k], sel[k:]
        parts = [t.index_select(0, slots) for t in self.gu]
        gu = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        dn = self.dn.index_select(0, slots)
        if self.dtype != torch.float16:
            gu, dn = gu.to(self.dtype), dn.to(self.dtype)
        w = scores.index_select(1, perm)
        out = torch.zeros_like(x)
        zero = torch.zeros(1, dtype=torch.long, device=x.device)
        for j in range(k):
            gate, up = F.linear(x, gu[j]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, dn[j]) * w[:, j, None]
            out.index_add_(0, zero, y.to(out.dtype))
        return out


class FusedExpertMath(PooledExpertMath):
    """The same expert math with each expert's matrices read straight from its slot by the grouped fp16
    GEMV (gpu_kernels.slot_gemv, Triton on CUDA): no gathered copy, so each routed expert byte is read
    once per token (the HBM floor's count), and two GEMV launches per MoE layer for the k experts
    (three where gate and up are not adjacent in the blob).
    Accumulation order differs from cuBLAS' (fp32 either way, each projection's output rounded to the
    model's dtype once, as F.linear rounds; the k weighted outputs summed in one reduction), so results
    can differ from transformers' in the last bit: tokens are checked as before. With a SiLU expert (both
    families here) SiLU(gate) x up (in float32 from the two rounded outputs, rounded once to the model's
    dtype, as inductor's fused kernel would) is computed by the gate / up kernel itself where gate and up
    are adjacent in the blob (each program the same rows of both, `glu`), else by the down projection's
    kernel as it loads the gate/up output."""

    def __init__(self, eng, slots: torch.Tensor):
        super().__init__(eng, slots)
        self.silu = getattr(eng.model.config, "hidden_act", None) in ("silu", "swish")

    def parts(self, x: torch.Tensor, scores: torch.Tensor, sel: torch.Tensor):
        """The k experts' outputs unsummed: (y [k, H] in ascending expert order, scores, their top-k positions
        perm [k]), which `combine` (or the next layer's fused q/k/v GEMV, gpu_kernels.norm_gemv) sums."""
        from toolkit.runtime.gpu_kernels import slot_gemv, slot_pre_whole

        k = self.k
        slots, perm = sel[:k], sel[k:]
        if self.silu and len(self.gu) == 1:   # gate and up adjacent: SiLU(gate) x up out of their kernel, [k, F]
            # (launched `late` where the down projection holds its rows whole, so its programs read the slots
            # and those rows ahead of their wait under PDL: gpu_kernels.slot_gemv; it loops, reading after, else)
            act = slot_gemv(self.gu[0], slots, x, glu=True, late=slot_pre_whole(self.dn.shape[2]))
            return slot_gemv(self.dn, slots, act, pre=True), scores, perm    # [k, H]
        parts = [slot_gemv(t, slots, x) for t in self.gu]
        gu = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if self.silu:   # SiLU(gate) x up taken by the down projection's kernel as it loads gu
            y = slot_gemv(self.dn, slots, gu, gated=True)                     # [k, H]
        else:
            gate, up = gu.chunk(2, dim=-1)
            y = slot_gemv(self.dn, slots, self.act(gate) * up)               # [k, H]
        return y, scores, perm   # (the slot GEMV returns x's dtype)

    def __call__(self, x: torch.Tensor, scores: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        from toolkit.runtime.gpu_kernels import expert_sum

        return expert_sum(*self.parts(x, scores, sel))                       # [1, H]


EXPERT_MATH = {"eager": PooledExpertMath, "fused": FusedExpertMath}


def _ascending(li: int, row: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """A router's top-k `row` of MoE layer li: its positions in ascending expert order, and those keys."""
    order = sorted(range(len(row)), key=row.__getitem__)
    return order, [(li, row[p]) for p in order]


class DevicePlan:
    """A folding planner's rows on the device (PrefetchPlanner.device_fold): after MoE layer li's router, its
    window rows' probabilities sorted descending with their experts and its next-visit rows' experts by
    descending logit, from the router's input (and the fold's matrices), copied into pinned memory for
    `plan_sorted`. The host then plans from small sorted lists instead of computing the fold,
    its softmax and its sorts (about 0.1 ms a MoE layer of host time on the bench's model, the pooled decode's
    bottleneck). One graph per MoE layer on a GPU (eager on the CPU), its own, so policies that do not plan
    replay nothing more; the same arithmetic as the host's fold on the CPU (the same decisions, bit for bit).

    On a GPU the rows' graph runs on a stream of its own (Device.rows_stream, high priority; its graphs
    captured there), after the layer's router (an event on the compute stream it waits for) and beside the
    next segment: the layer's sync waits for the routing alone, and the host waits for the rows (an event of
    theirs: a second wait a MoE layer, `waits`) only when it plans, after it has enqueued the next segment.
    The rows' graph reads its source layer's router input (the layer's, or the one before it: FATE's), which
    only the next token's segment rewrites, after the host has read the rows; a new sequence's fold is loaded
    after any rows' work still queued (an interrupted sequence's), and a DevicePlan is dropped only after it."""

    def __init__(self, runner: "GraphRunner", fold):
        layers, W, visit_rows = fold
        eng = runner.eng
        dev = eng.dev.device
        self.runner, self.W, self.visit_rows = runner, W, visit_rows
        # (a device index: a list would be copied to the device at every call, which a graph cannot capture)
        self.visit_idx = torch.tensor(visit_rows, dtype=torch.long, device=dev)
        self.layers = [(torch.empty(mat.shape, device=dev), src, torch.empty(bias.shape, device=dev))
                       for mat, src, bias in layers]
        L, E, V, pin = eng.L, eng.E, len(visit_rows), eng.dev.cuda
        # a GPU's rows stream, each layer's events (the router reached on the compute stream; the rows landed
        # in pinned memory)
        self.side, self.index = eng.dev.rows_stream, eng.dev.index
        self.reached = [torch.cuda.Event() for _ in range(L)] if pin else None
        self.done = [torch.cuda.Event() for _ in range(L)] if pin else None
        self.waits = 0   # the host's waits on `done`
        self.apart = pin   # the rows on their own stream (False: in line, on the compute stream: plan=inline)
        self.load(fold)
        self.conf = torch.zeros(L, W, E, device=dev)
        self.ids = torch.zeros(L, W + V, E, dtype=torch.long, device=dev)   # the window's, then the visits'
        self.host_conf = torch.zeros(L, W, E, pin_memory=pin)
        self.host_ids = torch.zeros(L, W + V, E, dtype=torch.long, pin_memory=pin)
        self.host_conf_np, self.host_ids_np = self.host_conf.numpy(), self.host_ids.numpy()
        self.graphs: list[Any] | None = None
        # launch=driver (the runner's decode call's: runner.drv): events of its own, each layer's graph executable
        # and copy addresses
        self._exec: list[int] = []
        self._dev_events: tuple[list, list] | None = None
        self.copies = [[(hc[li].data_ptr(), dc[li].data_ptr(), dc[li].nbytes)
                        for hc, dc in ((self.host_conf, self.conf), (self.host_ids, self.ids))] for li in range(L)]

    def load(self, fold) -> None:
        """A sequence's fold (its planner's; the same shape) into the buffers the graphs read (on the compute
        stream, after any rows' work still queued)."""
        self.settle(wait=False)
        for (mat, _, bias), (m, _, b) in zip(self.layers, fold[0]):
            mat.copy_(m)
            bias.copy_(b)

    def _compute(self, li: int) -> None:
        mat, src, bias = self.layers[li]
        x = self.runner.post[src].reshape(-1).float()
        logits = (mat @ x + bias).view(-1, self.conf.shape[-1])
        W = self.W
        v, i = stable_topk(logits[:W].softmax(-1), logits.shape[-1])
        self.conf[li].copy_(v)
        self.ids[li, :W].copy_(i)
        if self.visit_rows:
            self.ids[li, W:].copy_(next_visit_experts(logits.index_select(0, self.visit_idx), logits.shape[-1]))

    def settle(self, *, wait: bool) -> None:
        """On a GPU, the compute stream after the rows' stream (`wait`: the host too, before buffers go)."""
        if self.side is not None:
            if wait:   # (the whole device: launch=driver's copies into the pinned buffers, inline ones on the
                torch.cuda.synchronize(self.index)   # compute stream too, are not tracked by torch's host allocator)
            else:
                torch.cuda.current_stream(self.index).wait_stream(self.side)

    def _capture(self) -> None:
        """One graph per layer, warmed up and captured on the rows' stream (the segments' graphs are captured on
        another: their work, cuBLAS's workspaces included, is not shared with these, which run beside them)."""
        dev = self.runner.eng.dev.device
        L, side = len(self.layers), self.side
        with torch.cuda.device(dev):
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for li in range(L):
                    self._compute(li)
            torch.cuda.current_stream(dev).wait_stream(side)
            graphs, pool = [], None
            for li in range(L):   # (one memory pool for the layers' graphs, as the segments')
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=side):
                    self._compute(li)
                pool = g.pool()
                graphs.append(g)
            torch.cuda.synchronize(dev)
        self.graphs = graphs
        self._exec = [g.raw_cuda_graph_exec() for g in graphs]

    def enqueue(self, li: int) -> None:
        """Layer li's rows computed after its router (enqueued after its segment) and their copies into pinned
        memory: on a GPU on the side stream, which waits for the compute stream up to here (the router), the
        layer's event recorded after the copies; on the CPU in line."""
        drv = self._driver()
        if drv is not None:
            self._enqueue_driver(drv, li)
            return
        if not self.apart:
            self._run(li)
            return
        main = torch.cuda.current_stream(self.index)
        self.reached[li].record(main)
        self.side.wait_event(self.reached[li])
        torch.cuda.set_stream(self.side)
        try:
            self._run(li)
            self.done[li].record(self.side)
        finally:
            torch.cuda.set_stream(main)

    def _driver(self):
        """The driver's calls where this decode call makes them (launch=driver) and the rows are graphs; else None."""
        return self.runner.drv if self._exec else None

    def _enqueue_driver(self, drv, li: int) -> None:
        """`enqueue` through the driver's calls (launch=driver): the same work on the same streams."""
        cs = self.runner.cs
        if self._dev_events is None:   # (the layers' reached and done events, made once)
            self._dev_events = tuple([drv.event(timing=False) for _ in self.layers] for _ in range(2))
        reached, done = self._dev_events
        st = cs
        if self.apart:
            st = self.side.cuda_stream
            reached[li].record(cs)
            drv.wait(st, reached[li])
        drv.launch(self._exec[li], st)
        for dst, src, n in self.copies[li]:
            drv.copy(dst, src, n, st)
        if self.apart:
            done[li].record(st)

    def _run(self, li: int) -> None:
        """Layer li's rows and their copies into pinned memory, on the current stream."""
        if self.graphs is not None:
            self.graphs[li].replay()
        else:
            self._compute(li)
        self.host_conf[li].copy_(self.conf[li], non_blocking=True)
        self.host_ids[li].copy_(self.ids[li], non_blocking=True)

    def rows(self, li: int, m: int, n: int) -> tuple[list[list[float]], list[list[int]], list[list[int]]]:
        """Layer li's (window confidences, their experts: the first m of each; each next visit's experts: the
        first n), as lists (PrefetchPlanner.sorted_widths), once they have landed (on a GPU the host waits for
        the layer's event)."""
        if self.apart:
            (self.done if self._driver() is None else self._dev_events[1])[li].synchronize()
            self.waits += 1
        W, ids = self.W, self.host_ids_np[li]
        return self.host_conf_np[li, :, :m].tolist(), ids[:W, :m].tolist(), ids[W:, :n].tolist()


class GraphRunner:
    """The target's one-token decode step as L + 1 segments (CUDA graphs on a GPU, eager on the CPU),
    and the draft's whole step as one graph."""

    PLANS = 4   # DevicePlan layouts kept (a bench alternates a few: window, heads on and off)

    def __init__(self, eng, slots: torch.Tensor, S: int, *, graphs: bool):
        self.eng = eng
        self.dec = StaticDecoder(eng)
        self.dec.S = S
        self.S = S
        dev = eng.dev.device
        self.graphs = graphs
        dec = self.dec
        n_layers = len(dec.layers)
        self.kv = StaticKV(n_layers, dec.kv_heads, S, dec.head_dim, dev, eng.dtype)
        self.slots = slots                  # this pool's slot arena: exactly its capacity
        self.math = EXPERT_MATH[eng.experts](eng, slots)
        # a segment hands its MoE layer's expert outputs to the next layer's fused q/k/v GEMV unsummed
        self.fold_combine = dec.fused_attention and isinstance(self.math, FusedExpertMath)
        L, k, H = eng.L, eng.k, dec.H
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.h = torch.zeros(1, 1, H, device=dev, dtype=eng.dtype)
        self.post = torch.zeros(L, 1, H, device=dev, dtype=eng.dtype)
        self.idx = torch.zeros(L, 1, k, dtype=torch.long, device=dev)
        first = min(dec.moe_at)
        _, sc, _ = dec.route(first, torch.zeros(1, 1, H, device=dev, dtype=eng.dtype))   # the router's weights' dtype
        self.scores = torch.zeros(L, *sc.shape, device=dev, dtype=sc.dtype)
        self.sel = torch.zeros(L, 2 * k, dtype=torch.long, device=dev)
        self.sel[:, k:] = torch.arange(k, device=dev)
        pin = eng.dev.cuda
        self.stage = [torch.zeros(2 * k, dtype=torch.long, pin_memory=pin) for _ in range(L)]
        self.stage_np = [t.numpy() for t in self.stage]   # the host writes the slot numbers through these
        # what the host reads back: non-blocking copies into pinned memory, then one wait (host_wait)
        self.host_idx = torch.zeros(L, 1, k, dtype=torch.long, pin_memory=pin)
        self.host_post = torch.zeros(L, 1, H, dtype=eng.dtype, pin_memory=pin)
        self.host_tok = torch.zeros(1, dtype=torch.long, pin_memory=pin)
        self.host_idx_np = self.host_idx.numpy()   # (read through numpy: no tensor made per read)
        self.host_waits = 0                 # waits of the host on the compute stream in decode()
        # launch=driver (GpuEngine.configure): the driver's calls (cuda_driver.Driver) and the compute stream's
        # handle, set per decode call from the sequence's IO (`_begin`); none: torch's calls
        self.drv: Any = None
        self.cs = 0
        self._exec: list[int] = []          # each segment graph's executable (the driver launches it)
        self._sync_ev: Any = None           # host_wait's event (launch=driver)
        # a layer's copies between the host and the device (`_copy`): its routing and router input back, its slot
        # numbers out; (destination, source, and for the driver their per-layer addresses and bytes)
        self._xfer = {name: (dst, src, [d.data_ptr() for d in dst], [x.data_ptr() for x in src], src[0].nbytes)
                      for name, dst, src in (("idx", self.host_idx, self.idx), ("post", self.host_post, self.post),
                                             ("sel", self.sel, self.stage))}
        # which decoder layers each segment runs
        moe = list(eng.spec.geometry.moe_layers)
        bounds = [-1, *moe, n_layers - 1]
        self.seg_layers = [list(range(bounds[s] + 1, bounds[s + 1] + 1)) for s in range(L + 1)]
        self._g: list[Any] | None = None
        self._plans: dict[tuple, DevicePlan] = {}   # a folding planner's rows on the device, per layout
        # every expert resident (the pool's upper bound): the device looks the slots up itself, so a
        # whole token is one graph with no host sync per layer (decode_resident)
        self.slot_of = torch.zeros(L, eng.E, dtype=torch.long, device=dev)
        self._resident_g: Any = None
        self._resident_exec = 0
        self.closed = False
        # the draft
        self.draft = None
        if eng.drafts and eng.drafts[0] is not None:
            self.draft = _DraftStep(self)
        # the step's functions: eager, or each whole through torch.compile (GpuEngine(compile=...)): a
        # segment, the resident token (every segment in one compiled graph) and the draft's step
        self._seg, self._token = self._segment, self._resident_token
        if eng.compile:
            # the arena's slot count is a dynamic size of the traces, so runners of other pool sizes
            # reuse the compiled code instead of compiling again
            for t in (*self.math.gu, self.math.dn):
                if t.shape[0] > 1:   # (dynamo specialises a size of 1 whatever is marked)
                    torch._dynamo.mark_dynamic(t, 0)
            fns = (self._segment, self._resident_token) + ((self.draft._step,) if self.draft else ())
            self._seg, self._token, *rest = compiled(fns, eng.compile, n_layers)
            if self.draft is not None:
                self.draft.step = rest[0]

    # -- the target's segments -------------------------------------------------------------
    def segment(self, s: int) -> None:
        """Segment s on the device (eager, or its compiled code; one graph replay once captured)."""
        self.check_open()
        self._seg(s)

    def check_open(self) -> None:
        """Refuse in one line once closed (a sequence can hold a runner the engine has since replaced: a
        longer cache, or an arena evicted for another pool size)."""
        if self.closed:
            raise SpecPrefetchError("internal: a closed graph runner was used (the engine replaced its arena or "
                                    "cache since the sequence started)")

    def _segment(self, s: int, resident: bool = False, pre=None):
        """Segment s: the routed experts of MoE layer s - 1 (none for s = 0) and the decoder layers up to
        MoE layer s's router, reading and writing the runner's buffers. `resident`: every expert is in the
        pool, and the slots of each router's choices are looked up on the device (slot_of) instead of
        written by the host. `pre`: the position's mask and rotary tables from an earlier segment of the
        same token (returned on the resident path)."""
        dec, L = self.dec, self.eng.L
        h = self.h
        pending = None
        if s == 0:
            h = dec.inner.embed_tokens(self.tok[None])
        elif self.fold_combine and (self.seg_layers[s] or (s == L and dec.fused_head)):
            # summed into h by the next layer's q/k/v GEMV (attend), or by the head's (head_one)
            pending = self.math.parts(self.post[s - 1], self.scores[s - 1], self.sel[s - 1])
        else:
            li = s - 1
            h = h + self.math(self.post[li], self.scores[li], self.sel[li]).view(1, 1, -1).to(h.dtype)
        mask, cs = pre if pre is not None else dec.prelude(self.pos, h)
        for i in self.seg_layers[s]:
            li = dec.moe_at.get(i)
            out = None if li is None else (self.post[li], self.scores[li], self.idx[li])
            # resident: the host's choice in decode() made on the device (ascending expert, then their top-k
            # positions), from the slot table
            slots = (self.slot_of[li], self.sel[li]) if resident and li is not None else None
            h, *_ = dec.layer(i, h, self.pos, self.kv, mask, cs, out=out, slots=slots,   # (into the buffers)
                              pending=pending)
            pending = None
        if s == L:
            logits, h = dec.head_one(h, pending)
            self.tok.copy_(logits[0, -1].argmax(-1, keepdim=True))
        self.h.copy_(h)
        return (mask, cs) if resident else None    # (a segment's graph need not write them out)

    def _resident_token(self) -> None:
        """A whole token with every expert resident: every segment, slots looked up on the device."""
        pre = None
        for s in range(self.eng.L + 1):
            pre = self._segment(s, resident=True, pre=pre)

    def _capture(self) -> None:
        L = self.eng.L
        dev = self.eng.dev.device
        # graphs, their capture stream and Triton's launches belong to the current device: make it
        # the engine's (cuda:N), then warm up off the default stream (cuBLAS handles, allocator) and
        # capture one graph per segment
        with torch.cuda.device(dev):
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):
                    for s in range(L + 1):
                        self._seg(s)
                    if self.draft is not None:
                        self.draft.step()
            torch.cuda.current_stream(dev).wait_stream(side)
            graphs, pool = [], None
            for s in range(L + 1):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self._seg(s)
                pool = g.pool()
                graphs.append(g)
            if self.draft is not None:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.draft.step()
                self.draft.graph = g
            self._g = graphs
            self._exec = [g.raw_cuda_graph_exec() for g in graphs]
            torch.cuda.synchronize(dev)

    def _capture_resident(self) -> None:
        """The whole token (every segment, slots looked up on the device) as one graph."""
        dev = self.eng.dev.device
        with torch.cuda.device(dev):
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                self._token()
            torch.cuda.current_stream(dev).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self._token()
            torch.cuda.synchronize(dev)
        self._resident_g, self._resident_exec = g, g.raw_cuda_graph_exec()

    def ensure_resident(self) -> None:
        """The resident token's graph, captured once per runner (GpuEngine.sequence does it before the
        prefill: its warm-up writes K/V at the stale position, which the prefill's cache then replaces)."""
        self.check_open()
        if self.graphs and self._resident_g is None:
            self._capture_resident()

    def load_slot_map(self, where: dict) -> None:
        """The slot of every expert, from the IO's map, for decode_resident (every expert must be there)."""
        self.check_open()
        L, E = self.eng.L, self.eng.E
        table = torch.tensor([[where[(li, e)] for e in range(E)] for li in range(L)], dtype=torch.long)
        self.slot_of.copy_(table)

    def decode_resident(self, seq, token: int, pos: int) -> int:
        """One target token with every expert resident: one graph replay (segments on the CPU) and one
        host sync for the token and the routing, which is recorded; the pool and scheduler are not
        consulted (nothing can miss). The device-bound upper bound of every policy."""
        L = self.eng.L
        self._begin(seq)
        self.ensure_resident()
        self.set_position(token, pos)
        if self._resident_g is not None:
            if self.drv is not None:
                self.drv.launch(self._resident_exec, self.cs)
            else:
                self._resident_g.replay()
        else:
            self._token()
        self.host_idx.copy_(self.idx, non_blocking=True)
        self.host_tok.copy_(self.tok, non_blocking=True)
        self.host_wait()
        rows = self.host_idx[:, 0].tolist()
        for li in range(L):
            seq.record_routing(li, [rows[li]])
        return int(self.host_tok[0])

    def close(self) -> None:
        """Drop the graphs and the device buffers (the slot arena included) now, not at the next GC."""
        self.closed = True
        # the buffers go after every copy still queued into them (the rows' stream's, and launch=driver's, which
        # torch's host allocator does not track)
        self.eng.dev.sync()
        self._g = self._resident_g = None
        self._exec, self._resident_exec, self._sync_ev, self.drv = [], 0, None, None
        self._plans = {}
        # the compiled wrappers hold bound methods (a cycle through the runner): drop them so the buffers
        # go now, not at the next cyclic collection
        self._seg = self._token = None
        if self.draft is not None:
            self.draft.graph = None
            self.draft.step = None
            self.draft.kv = None
            self.draft = None
        self.slots = self.math = self.kv = None

    def device_plan(self, planner, *, inline: bool = False) -> DevicePlan | None:
        """The planner's rows on the device for a new sequence (its fold loaded into the DevicePlan of that
        layout, made and captured the first time; `inline`: on the compute stream, before the layer's sync, as
        `plan=inline` measures); None where there is no planner or it does not fold."""
        self.check_open()
        fold = planner.device_fold() if planner is not None else None
        if fold is None:
            return None
        layers, W, visit_rows = fold
        key = (W, tuple(visit_rows), tuple((tuple(m.shape), src) for m, src, _ in layers))
        dp = self._plans.pop(key, None)
        if dp is None:
            while len(self._plans) >= self.PLANS:   # the oldest layout's buffers and graphs go first
                self._plans.pop(next(iter(self._plans))).settle(wait=True)
            dp = DevicePlan(self, fold)
            if self.graphs:
                dp._capture()
        else:
            dp.load(fold)
        dp.apart = dp.side is not None and not inline
        self._plans[key] = dp   # most recently used last
        return dp

    def ensure(self) -> None:
        self.check_open()
        if self.graphs and self._g is None:
            self._capture()

    def _begin(self, seq) -> None:
        """A decode call's launches: through the driver where the sequence's IO has it (launch=driver), on
        the current stream (the IO's waits and events too), else through torch."""
        self.check_open()
        self.drv = seq.io.drv
        if self.drv is not None:
            # the stream torch enqueues this call's other work on (the fills, the copies of the verification's rows)
            self.cs = seq.io.compute = (torch.cuda.current_stream(self.eng.dev.index).cuda_stream
                                        if self.eng.dev.cuda else 0)   # (the CPU: a stand-in driver's tests)
            if self._sync_ev is None:
                self._sync_ev = self.drv.event(timing=False)

    def run_segment(self, s: int) -> None:
        if self._g is not None:
            if self.drv is not None:
                self.drv.launch(self._exec[s], self.cs)
            else:
                self._g[s].replay()
        else:
            self._seg(s)    # (decode and verify_rows checked the runner is open once)

    def set_position(self, token: int, pos: int) -> None:
        self.tok.fill_(token)
        self.pos.fill_(pos)

    def _copy(self, name: str, li: int) -> None:
        """Layer li's copy `name` (idx, post: into pinned host memory; sel: its slot numbers from the pinned stage),
        non-blocking on the compute stream."""
        dst, src, dst_ptr, src_ptr, nbytes = self._xfer[name]
        if self.drv is not None:
            self.drv.copy(dst_ptr[li], src_ptr[li], nbytes, self.cs)
        else:
            dst[li].copy_(src[li], non_blocking=True)

    def host_wait(self) -> None:
        """The host waits for the compute stream up to here (the copies into pinned memory enqueued
        before it have landed): the one sync of a MoE layer (or of the token)."""
        if self.drv is not None:
            self._sync_ev.record(self.cs)
            self._sync_ev.synchronize()
        elif self.eng.dev.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.eng.dev.device))
            ev.synchronize()
        self.host_waits += 1

    def read_routing(self, li: int, with_input: bool, plan: DevicePlan | None = None) -> list[int]:
        """MoE layer li's top-k (and its router input into host_post[li] when `with_input`): copied
        non-blocking into pinned memory, then one wait. With `plan`, the planner's rows are enqueued after the
        router too (on a GPU on their own stream, not waited for here: DevicePlan.rows waits)."""
        if plan is not None:
            plan.enqueue(li)
        self._copy("idx", li)
        if with_input:
            self._copy("post", li)
        self.host_wait()
        return self.host_idx_np[li, 0].tolist()

    def decode(self, seq, token: int, pos: int) -> int:
        """One target token at `pos` of `seq` (gpu.GpuSequence: its scheduler, IO, planner and routing
        record): L + 1 host syncs on the compute stream (the routers, the token; with a DevicePlan on a GPU, L
        more on its rows, at the planning), the pool's experts."""
        self._begin(seq)
        L, k = self.eng.L, self.eng.k
        sched, io = seq.sched, seq.io
        planner, dplan = seq.planner, seq.device_plan
        host_plan = planner is not None and dplan is None   # (a folding planner's rows come from the device)
        if dplan is not None:
            m, n = planner.sorted_widths(sched)
        self.set_position(token, pos)
        self.run_segment(0)
        for li in range(L):
            row = self.read_routing(li, host_plan, dplan)   # one sync per MoE layer
            step = pos * L + li
            seq.record_routing(li, [row])
            if host_plan:
                seq.state.record(li, self.host_post[li], row)
            order, keys = _ascending(li, row)
            # The sync above ran every kernel enqueued so far on the compute stream (the rows' stream, which
            # may still run, reads no slot), the last readers of every slot the pool can
            # evict before the release (the next replay reads this layer's experts, pinned until then): a
            # copy into a slot evicted from here to the release waits for no kernel (CudaCopyIO.fenced),
            # only for the slot's old copy
            io.fenced = True
            try:
                # every expert of the layer already in the pool: their reads (data: the compute stream after a
                # copy still landing) and the replay come before the acquire's bookkeeping, which then evicts and
                # copies nothing, so the device does not wait for it (a layer with a miss pays read_resident's
                # refusal too, a membership check beside its demand copy)
                hits = sched.read_resident(keys)
                if not hits:
                    sched.acquire_read(step, keys)   # (data: orders the compute stream after each slot's copy)
                st = self.stage_np[li]
                io.slot_numbers(keys, st)
                st[k:] = order
                self._copy("sel", li)
                self.run_segment(li + 1)
                if hits:
                    sched.acquire(step, keys)
                # the window's planning (its evictions and copies) while the device runs the replay: the
                # same decisions in the same order (acquire, plan, release), the host's planning off the
                # device's path
                if dplan is not None:
                    planner.plan_sorted(sched, li, step, *dplan.rows(li, m, n), seq.end)
                elif planner is not None:
                    planner.plan(sched, li, step, seq.state, None, seq.end)
            finally:
                io.fenced = False
            sched.release(step, keys)         # after the replay that reads the slots was enqueued
        self.host_tok.copy_(self.tok, non_blocking=True)
        self.host_wait()
        return int(self.host_tok[0])


    def verify_rows(self, seq, tokens: list[int], pos: int) -> list[int]:
        """The target's greedy token after each of `tokens` at positions pos, pos + 1, ...: every row
        through the one-token step's own segments (graphs), so each result is bitwise what `decode`
        computes there, but layer-major: segment s runs for every row before segment s + 1, so a MoE
        layer's experts are acquired for all rows together (one host sync per MoE layer for all of
        them) and, where they fit the pool together, each is copied once for the pass, as a one-pass
        verification copies them (where they do not, a row's experts at a time). Per row the graph's
        state (its hidden state, position, router outputs) is swapped in and out."""
        self._begin(seq)
        L, k = self.eng.L, self.eng.k
        sched, io = seq.sched, seq.io
        pooled = sched.pool.slots
        R = len(tokens)
        dev = self.eng.dev.device
        h = torch.zeros(R, *self.h.shape, device=dev, dtype=self.h.dtype)
        post = torch.zeros(R, *self.post.shape[1:], device=dev, dtype=self.post.dtype)
        scores = torch.zeros(R, *self.scores.shape[1:], device=dev, dtype=self.scores.dtype)
        idx = torch.zeros(R, *self.idx.shape[1:], dtype=torch.long, device=dev)
        toks = torch.zeros(R, dtype=torch.long, device=dev)
        host_idx = torch.zeros(R, *self.idx.shape[1:], dtype=torch.long, pin_memory=self.eng.dev.cuda)
        # each row's slot numbers in a pinned row of their own: a copy from pinned memory reads it when
        # the stream gets there, after the host has moved on to the next rows (one shared buffer, as
        # decode's per-layer one, would hand an earlier row a later row's slots); the sync of the next
        # MoE layer covers every copy of this one before the rows are written again
        stage = torch.zeros(R, 2 * k, dtype=torch.long, pin_memory=self.eng.dev.cuda)
        stage_np = stage.numpy()
        for j in range(R):              # segment 0: each row's embedding up to the first router
            self.set_position(tokens[j], pos + j)
            self.run_segment(0)
            h[j].copy_(self.h)
            post[j].copy_(self.post[0])
            idx[j].copy_(self.idx[0])
            scores[j].copy_(self.scores[0])
        seq.pos = pos
        for li in range(L):
            host_idx.copy_(idx, non_blocking=True)
            self.host_wait()                                       # one sync per MoE layer, all rows
            rows = host_idx[:, 0].tolist()
            seq.record_routing(li, rows)
            step = pos * L + li
            keys_of = [_ascending(li, row) for row in rows]
            union = list(dict.fromkeys(key for _, keys in keys_of for key in keys))
            cap = self.eng.capacity - sched.in_flight()   # >= k: copies in flight are capped at capacity - k
            if len(union) <= cap:   # the layer's experts for every row at once, resident ones first
                sched.acquire(step, resident_first(union, pooled))
            for j, (order, keys) in enumerate(keys_of):
                if len(union) > cap:   # more than fit: a row's experts at a time
                    sched.acquire_read(step, keys)
                else:
                    for key in keys:
                        sched.data(key)
                io.slot_numbers(keys, stage_np[j])
                stage_np[j, k:] = order
                self.sel[li].copy_(stage[j], non_blocking=True)
                self.pos.fill_(pos + j)
                self.h.copy_(h[j])
                self.post[li].copy_(post[j])
                self.scores[li].copy_(scores[j])
                self.run_segment(li + 1)
                h[j].copy_(self.h)
                if li + 1 < L:
                    post[j].copy_(self.post[li + 1])
                    idx[j].copy_(self.idx[li + 1])
                    scores[j].copy_(self.scores[li + 1])
                else:
                    toks[j].copy_(self.tok[0])
                if len(union) > cap:   # no prefetch issued before the layer's last row (it could take
                    sched.release(step, keys, pump=j == R - 1)   # a slot a later row needs)
            if len(union) <= cap:
                sched.release(step, union)
        host = torch.zeros(R, dtype=torch.long, pin_memory=self.eng.dev.cuda)
        host.copy_(toks, non_blocking=True)
        self.host_wait()
        return host.tolist()


class _DraftStep:
    """The int4 draft's decode step over its own static cache: one graph, no host sync. The token and
    position advance on the device, so K replays chain; each step's routing lands in `ids`."""

    def __init__(self, gr: GraphRunner):
        eng = gr.eng
        dec = gr.dec
        dev = eng.dev.device
        self.gr, self.dec = gr, dec
        self.kv = StaticKV(len(dec.layers), dec.kv_heads, gr.S, dec.head_dim, dev, eng.dtype)
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.ids = torch.zeros(eng.L, eng.k, dtype=torch.long, device=dev)
        # each MoE layer's router input and scores for the fused router (its indices go straight into `ids`)
        self.post = torch.zeros_like(gr.post) if dec.fused_router else None
        self.scores = torch.zeros_like(gr.scores) if dec.fused_router else None
        self.graph = None
        pin = eng.dev.cuda
        self.host_ids = torch.zeros(0, eng.L, eng.k, dtype=torch.long, pin_memory=pin)
        self.host_tok = torch.zeros(0, dtype=torch.long, pin_memory=pin)
        self.step = self._step      # or its compiled code (GraphRunner)

    def _step(self) -> None:
        dec, eng = self.dec, self.gr.eng
        h = dec.inner.embed_tokens(self.tok[None])
        mask, cs = dec.prelude(self.pos, h)
        for i in range(len(dec.layers)):
            li = dec.moe_at.get(i)
            # the fused router writes into the buffers (its indices straight into ids); the model's returns them
            out = None if li is None or not dec.fused_router else (self.post[li], self.scores[li], self.ids[li:li + 1])
            h, *routed = dec.layer(i, h, self.pos, self.kv, mask, cs, out=out)
            if routed:
                post, scores, idx = routed
                if out is None:
                    self.ids[li].copy_(idx[0])
                h = h + eng.drafts[li].fused(post, idx, scores).view(1, 1, -1).to(h.dtype)
        self.tok.copy_(dec.head(h)[0, -1].argmax(-1, keepdim=True))
        self.pos.add_(1)

    def run(self, feed: list[int], start: int, n_out: int):
        """Feed tokens at start.. and then n_out - 1 of its own: returns (proposals [n_out], per-step
        routing events) where each event is (cuda event or None, step index); the routing of step j
        is host_ids[j] once its event has completed."""
        eng = self.gr.eng
        steps = len(feed) + n_out - 1
        if self.host_ids.shape[0] < steps:
            self.host_ids = torch.zeros(steps, eng.L, eng.k, dtype=torch.long, pin_memory=eng.dev.cuda)
            self.host_tok = torch.zeros(steps, dtype=torch.long, pin_memory=eng.dev.cuda)
        evs = []
        self.pos.fill_(start)
        for j in range(steps):
            if j < len(feed):
                self.tok.fill_(feed[j])
            if self.graph is not None:
                self.graph.replay()
            else:
                self.step()
            self.host_ids[j].copy_(self.ids, non_blocking=True)
            self.host_tok[j].copy_(self.tok[0], non_blocking=True)
            evs.append(eng.dev.event())
        return steps, evs


def build_runner(eng, slots: torch.Tensor, S: int, graphs: bool) -> GraphRunner:
    why = supported(eng.spec)
    if why is not None:
        raise SpecPrefetchError(f"--decode static: {why}")
    return GraphRunner(eng, slots, S, graphs=graphs)
