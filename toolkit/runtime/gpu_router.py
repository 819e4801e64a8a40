"""A MoE layer's router for one decode position in one GPU kernel (two for a large router).

Given the residual stream h and the attention block's output a (after its output projection):

    h'     = h + a                                    (the residual add, rounded to the model's dtype)
    post   = w_norm * rms_norm(h')                    (the post-attention RMS norm, as transformers rounds it)
    logits = W_router post                            (float32 sums, rounded to the dtype as F.linear rounds)
    top-k of softmax(logits) in float32, the lower expert first among equal values; divided by their sum
    where the model normalises them (Qwen3's norm_topk_prob, always for Mixtral); cast to the scores' dtype

The compiled step ran this as five device operations a layer (the add, norm and router GEMV fused by inductor,
three softmax / sort kernels, the normalisation), plus the copies of the results into the runner's buffers;
`route` is one (`specprefetch::route`, Triton on CUDA): one program (for a router of at most 128 KiB, below)
reads h, a, the norm's weight and the router's [E, H] matrix, writes the layer's router input, scores and
expert indices into the buffers it is given and returns h'. The top-k is taken over the logits (the softmax is
monotonic, so the same experts in the same order) by k rounds of a maximum, ties to the lower index as
`gpu_graph.topk_by_sort`. One program does it all for a router of at most 128 KiB (32 x 1024 and Mixtral's 8 x
4096 in fp16); a larger one (Qwen3-30B's 128 x 2048) is two kernels: the logits over programs of
ROUTER_BLOCK_E experts (each recomputing the row's norm), then one program's top-k. With every expert resident
(the whole-token graph, `gpu_graph.GraphRunner.decode_resident`) it also writes the layer's slot selection, as
the host writes it elsewhere: the chosen experts' slots in ascending expert order (`slot_of[expert]`), then
their positions in the top-k order (`specprefetch::route_resident`), where a sort, a lookup and two copies ran
as a kernel of their own. The references (`route_torch`,
`select_slots_torch`) are the operators' body off CUDA and the tests' oracle; the kernel differs from it in
summation order and in the GPU's approximate reciprocal square root and exponential.
"""
from __future__ import annotations

import torch

from toolkit.runtime.gpu_kernels import _device, is_weighted_rms_norm, pdl, pdl_args, rms_norm_torch, triton

if triton is not None:
    import triton.language as tl

    from toolkit.runtime.gpu_kernels import _rms_apply


# a router matrix of up to MAX_ROUTER_KIB is read by one program (one kernel); a larger one (Qwen3-30B's 512 KiB)
# by programs of ROUTER_BLOCK_E experts each, and a second kernel takes the top-k, whose one program holds every
# expert's logit: at most MAX_EXPERTS
MAX_ROUTER_KIB, ROUTER_BLOCK_E, MAX_EXPERTS = 128, 8, 1024
# a program whose router rows and hidden row (padded to powers of two) hold at most ROUTER_TILE elements takes
# the row in one block, every load issued at once; a wider one loops over blocks of the row
ROUTER_TILE, ROUTER_WARPS = 32768, 8
# the two-kernel path's logits programs (Triton's default 4 warps): at most 16,384 in one block (8 x 2048, measured:
# docs/benchmarks.md section 33; wider rows are untested in one block, so they loop)
ROUTER_LOGITS_TILE = 16384


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def one_kernel(nbytes: int) -> bool:
    """Whether a router of nbytes of weights is one kernel (else two: the module's docstring)."""
    return nbytes <= MAX_ROUTER_KIB * 1024


def one_block(E: int, H: int, nbytes: int, tile: int | None = None) -> bool:
    """Whether its programs take the hidden row in one block: the rows a program holds (every expert in the
    one-kernel path, padded to a power of two of at least 16; ROUTER_BLOCK_E in the two-kernel path) times the
    row padded to a power of two, at most `tile` elements (default ROUTER_TILE, in the two-kernel path
    ROUTER_LOGITS_TILE)."""
    if tile is None:
        tile = ROUTER_TILE if one_kernel(nbytes) else ROUTER_LOGITS_TILE
    return (max(16, _pow2(E)) if one_kernel(nbytes) else ROUTER_BLOCK_E) * _pow2(H) <= tile


def router_usable(norms, gates, dtype: torch.dtype) -> str | None:
    """None where the kernel covers these MoE layers' post-attention norms and routers, else why not."""
    if dtype != torch.float16:   # (as gpu_attention.attention_usable)
        return f"the fused router computes in fp16, not {str(dtype).removeprefix('torch.')}"
    for norm, gate in zip(norms, gates):
        if not is_weighted_rms_norm(norm):
            return f"{type(norm).__name__} is not an RMS norm with a weight"
        w = getattr(gate, "weight", None)
        if w is None or w.dim() != 2 or w.dtype != dtype or getattr(gate, "bias", None) is not None:
            return f"{type(gate).__name__} is not a bias-free linear router in the model's dtype"
        if w.shape[0] > MAX_EXPERTS:
            return f"{w.shape[0]} experts: the fused router's top-k takes at most {MAX_EXPERTS}"
    return None


def route_torch(h, a, norm_w, eps: float, gate_w, norm_topk: bool, post, scores, idx) -> torch.Tensor:
    """The reference: h, a [1, H]; norm_w [H]; gate_w [E, H]; writes post [1, H], scores [1, k] (their dtype),
    idx [1, k] (long); returns h + a."""
    k = idx.shape[-1]
    hn = (h + a).view(1, -1)
    p = rms_norm_torch(hn, norm_w, eps)
    logits = (p.float() @ gate_w.float().t()).to(hn.dtype).float()        # [1, E]
    probs = torch.softmax(logits, dim=-1)
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
    top = probs.gather(1, order)
    if norm_topk:
        top = top / top.sum(-1, keepdim=True)
    post.copy_(p.view_as(post))
    scores.copy_(top.to(scores.dtype))
    idx.copy_(order)
    return hn.view_as(h)


def select_slots_torch(idx, slot_of, sel) -> None:
    """The resident selection (the reference): idx [1, k] in top-k order, slot_of [E] -> sel [2k]: the
    experts' slots in ascending expert order, then those experts' positions in idx."""
    k = idx.shape[-1]
    srt, order = idx.view(-1).sort()
    sel[:k].copy_(slot_of.index_select(0, srt))
    sel[k:].copy_(order)


if triton is not None:
    @triton.jit
    def _add_norm_logits(h_ptr, a_ptr, nw_ptr, gw_ptr, hout_ptr, post_ptr, e, me, write, H, eps,
                         BLOCK_H: tl.constexpr, ONE: tl.constexpr, PDL: tl.constexpr):
        """The residual add and post-attention norm (written out where `write`), and the logits of experts e
        (masked by me), rounded to the dtype as F.linear rounds: both router paths' first part. ONE: the row
        in one block (BLOCK_H >= H), every load issued before the first reduction, so the program waits on
        memory once (a loop over blocks waits once a block: the router's latency, docs/benchmarks.md). PDL: in
        the one-block path the constant weights are read before waiting for the kernel before, the loop path
        waits first (gpu_kernels.PDL)."""
        dt = h_ptr.dtype.element_ty
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        if ONE:
            c = tl.arange(0, BLOCK_H)
            mc = c < H
            w = tl.load(gw_ptr + e[:, None] * H + c[None, :], mask=me[:, None] & mc[None, :], other=0.0)
            nw = tl.load(nw_ptr + c, mask=mc, other=0.0).to(tl.float32)
            if PDL:
                tl.extra.cuda.gdc_wait()
            x = (tl.load(h_ptr + c, mask=mc, other=0.0) + tl.load(a_ptr + c, mask=mc, other=0.0)).to(dt)
            tl.store(hout_ptr + c, x, mask=mc & write)
            xf = x.to(tl.float32)
            r = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
            p = _rms_apply(xf, r, nw, h_ptr)
            tl.store(post_ptr + c, p.to(dt), mask=mc & write)
            lg = tl.sum(w.to(tl.float32) * p[None, :], axis=1)
        else:
            if PDL:
                tl.extra.cuda.gdc_wait()
            ss = tl.zeros([BLOCK_H], dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):                      # the residual add, and its sum of squares
                c = h0 + tl.arange(0, BLOCK_H)
                mc = c < H
                x = (tl.load(h_ptr + c, mask=mc, other=0.0) + tl.load(a_ptr + c, mask=mc, other=0.0)).to(dt)
                tl.store(hout_ptr + c, x, mask=mc & write)
                xf = x.to(tl.float32)
                ss += xf * xf
            r = tl.math.rsqrt(tl.sum(ss, axis=0) / H + eps)
            lg = tl.zeros(e.shape, dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):                      # the norm, and the router's rows against it
                c = h0 + tl.arange(0, BLOCK_H)
                mc = c < H
                x = (tl.load(h_ptr + c, mask=mc, other=0.0) + tl.load(a_ptr + c, mask=mc, other=0.0)).to(dt)
                nwc = tl.load(nw_ptr + c, mask=mc, other=0.0).to(tl.float32)
                p = _rms_apply(x.to(tl.float32), r, nwc, h_ptr)
                tl.store(post_ptr + c, p.to(dt), mask=mc & write)
                w = tl.load(gw_ptr + e[:, None] * H + c[None, :], mask=me[:, None] & mc[None, :], other=0.0)
                lg += tl.sum(w.to(tl.float32) * p[None, :], axis=1)
        return lg.to(dt).to(tl.float32)

    @triton.jit
    def _route_kernel(h_ptr, a_ptr, nw_ptr, gw_ptr, hout_ptr, post_ptr, sc_ptr, idx_ptr, slot_ptr, sel_ptr, H, E, eps,
                      K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, BLOCK_H: tl.constexpr,
                      NORM_TOPK: tl.constexpr, SLOTS: tl.constexpr, ONE: tl.constexpr, PDL: tl.constexpr):
        e = tl.arange(0, EP)
        me = e < E
        lg = _add_norm_logits(h_ptr, a_ptr, nw_ptr, gw_ptr, hout_ptr, post_ptr, e, me, tl.program_id(0) == 0, H,
                              eps, BLOCK_H, ONE, PDL)   # (one program: it writes them)
        _topk_store(tl.where(me, lg, float("-inf")), e, me, sc_ptr, idx_ptr, slot_ptr, sel_ptr, K, KP, EP,
                    NORM_TOPK, SLOTS)

    @triton.jit
    def _topk_store(lg, e, me, sc_ptr, idx_ptr, slot_ptr, sel_ptr, K: tl.constexpr, KP: tl.constexpr,
                    EP: tl.constexpr, NORM_TOPK: tl.constexpr, SLOTS: tl.constexpr):
        """The softmax of the logits lg [EP] (-inf past the E real experts), its top-k and their normalisation
        -> scores, indices (and the resident selection)."""
        ex = tl.exp(lg - tl.max(lg, axis=0))
        den = tl.sum(ex, axis=0)
        kk = tl.arange(0, KP)
        top = tl.zeros([KP], dtype=tl.float32)
        at = tl.zeros([KP], dtype=tl.int32)
        free = me                                            # experts not yet chosen (real ones only)
        for t in tl.static_range(K):                         # k rounds of a maximum, the lower index on ties
            m = tl.max(tl.where(free, lg, float("-inf")), axis=0)
            hit = tl.min(tl.where(free & (lg == m), e, EP), axis=0)
            i = tl.where(hit < EP, hit, tl.min(tl.where(free, e, EP), axis=0))   # (NaN logits: the lowest unchosen)
            top = tl.where(kk == t, tl.sum(tl.where(e == i, ex, 0.0), axis=0) / den, top)
            at = tl.where(kk == t, i, at)
            free = free & (e != i)
        if NORM_TOPK:
            top = top / tl.sum(tl.where(kk < K, top, 0.0), axis=0)
        tl.store(sc_ptr + kk, top.to(sc_ptr.dtype.element_ty), mask=kk < K)
        tl.store(idx_ptr + kk, at.to(tl.int64), mask=kk < K)
        if SLOTS:   # the chosen experts in ascending order: each one's rank is how many chosen are lower
            ko = kk < K
            rank = tl.sum(((at[None, :] < at[:, None]) & ko[None, :]).to(tl.int32), axis=1)
            tl.store(sel_ptr + rank, tl.load(slot_ptr + at, mask=ko, other=0), mask=ko)
            tl.store(sel_ptr + K + rank, kk.to(tl.int64), mask=ko)

    @triton.jit
    def _route_logits_kernel(h_ptr, a_ptr, nw_ptr, gw_ptr, hout_ptr, post_ptr, lg_ptr, H, E, eps,
                             BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, ONE: tl.constexpr, PDL: tl.constexpr):
        """A large router's first kernel: each program the residual add and norm (program 0 writes them out)
        and the logits of BLOCK_E experts into lg (float32)."""
        pe = tl.program_id(0)
        e = pe * BLOCK_E + tl.arange(0, BLOCK_E)
        me = e < E
        lg = _add_norm_logits(h_ptr, a_ptr, nw_ptr, gw_ptr, hout_ptr, post_ptr, e, me, pe == 0, H, eps, BLOCK_H, ONE,
                              PDL)
        tl.store(lg_ptr + e, lg, mask=me)

    @triton.jit
    def _route_topk_kernel(lg_ptr, sc_ptr, idx_ptr, slot_ptr, sel_ptr, E, K: tl.constexpr, KP: tl.constexpr,
                           EP: tl.constexpr, NORM_TOPK: tl.constexpr, SLOTS: tl.constexpr, PDL: tl.constexpr):
        """A large router's second kernel: one program, the top-k of the logits the first wrote."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        e = tl.arange(0, EP)
        me = e < E
        _topk_store(tl.load(lg_ptr + e, mask=me, other=float("-inf")), e, me, sc_ptr, idx_ptr, slot_ptr, sel_ptr,
                    K, KP, EP, NORM_TOPK, SLOTS)


def route(h, a, norm_w, eps: float, gate_w, norm_topk: bool, post, scores, idx, slot_of=None, sel=None, *,
          use_triton: bool | None = None) -> torch.Tensor:
    """One position's router (module docstring): the Triton kernel where Triton and CUDA are present, else
    the reference; under torch.compile the custom operator `specprefetch::route` (one opaque call writing
    post, scores and idx in place), or `specprefetch::route_resident` given the layer's slot table slot_of [E]
    and its selection buffer sel [2k] (written too). `use_triton` forces a path (tests)."""
    args = (h, a, norm_w, eps, gate_w, norm_topk, post, scores, idx)
    if (slot_of is None) != (sel is None):
        raise ValueError("route: slot_of and sel come together")
    if slot_of is not None:
        args = (*args, slot_of, sel)
    if use_triton is None:
        if torch.compiler.is_compiling():   # as gpu_kernels.slot_gemv
            op = torch.ops.specprefetch.route if slot_of is None else torch.ops.specprefetch.route_resident
            return op(*args)
        return _impl(*args)
    return _route_triton(*args) if use_triton else _route_reference(*args)


def _route_reference(h, a, norm_w, eps, gate_w, norm_topk, post, scores, idx, slot_of=None, sel=None):
    out = route_torch(h, a, norm_w, eps, gate_w, norm_topk, post, scores, idx)
    if slot_of is not None:
        select_slots_torch(idx, slot_of, sel)
    return out


def _impl(*args) -> torch.Tensor:
    if triton is not None and args[0].is_cuda:
        return _route_triton(*args)
    return _route_reference(*args)


@torch.library.custom_op("specprefetch::route", mutates_args=("post", "scores", "idx"))
def _route_op(h: torch.Tensor, a: torch.Tensor, norm_w: torch.Tensor, eps: float, gate_w: torch.Tensor,
              norm_topk: bool, post: torch.Tensor, scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return _impl(h, a, norm_w, eps, gate_w, norm_topk, post, scores, idx)


@_route_op.register_fake
def _(h, a, norm_w, eps, gate_w, norm_topk, post, scores, idx):
    torch._check(h.numel() == a.numel() == post.numel() == gate_w.shape[1], lambda: "route: one row of the hidden size")
    torch._check(scores.numel() == idx.numel(), lambda: "route: scores and indices differ in k")
    return torch.empty_like(h)


@torch.library.custom_op("specprefetch::route_resident", mutates_args=("post", "scores", "idx", "sel"))
def _route_resident_op(h: torch.Tensor, a: torch.Tensor, norm_w: torch.Tensor, eps: float, gate_w: torch.Tensor,
                       norm_topk: bool, post: torch.Tensor, scores: torch.Tensor, idx: torch.Tensor,
                       slot_of: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    return _impl(h, a, norm_w, eps, gate_w, norm_topk, post, scores, idx, slot_of, sel)


@_route_resident_op.register_fake
def _(h, a, norm_w, eps, gate_w, norm_topk, post, scores, idx, slot_of, sel):
    torch._check(h.numel() == a.numel() == post.numel() == gate_w.shape[1], lambda: "route: one row of the hidden size")
    torch._check(scores.numel() == idx.numel() and sel.numel() == 2 * idx.numel(),
                 lambda: "route: scores, indices and the selection differ in k")
    return torch.empty_like(h)


def _route_triton(h, a, norm_w, eps: float, gate_w, norm_topk: bool, post, scores, idx, slot_of=None,
                  sel=None, *, tile: int | None = None, warps: int | None = None) -> torch.Tensor:
    """The kernels' launch; `tile` / `warps` override the one-block bound (ROUTER_TILE / ROUTER_LOGITS_TILE:
    one_block) / ROUTER_WARPS (the tiling sweep, tests; the warps are the one-kernel path's)."""
    E, H = gate_w.shape
    k = idx.numel()
    if h.numel() != H or a.numel() != H or post.numel() != H or scores.numel() != k:
        raise ValueError(f"route: one row of {H} (h {tuple(h.shape)}, a {tuple(a.shape)}, post {tuple(post.shape)}) "
                         f"and k = {k} scores ({tuple(scores.shape)})")
    if idx.dtype != torch.long or not (post.is_contiguous() and scores.is_contiguous() and idx.is_contiguous()):
        raise ValueError("route: contiguous outputs, long indices")
    if not 0 < k <= E:
        raise ValueError(f"route: top-{k} of {E} experts")
    slots = slot_of is not None
    if slots and (slot_of.numel() != E or sel.numel() != 2 * k or slot_of.dtype != torch.long
                  or sel.dtype != torch.long or not (slot_of.is_contiguous() and sel.is_contiguous())):
        raise ValueError(f"route: a contiguous long slot table of {E} and selection of {2 * k}")
    if E > MAX_EXPERTS:
        raise ValueError(f"route: {E} experts, at most {MAX_EXPERTS}")
    h, a, norm_w, gate_w = h.contiguous(), a.contiguous(), norm_w.contiguous(), gate_w.contiguous()
    out = torch.empty_like(h)
    KP, EP = triton.next_power_of_2(k), max(16, triton.next_power_of_2(E))
    sl, se = (slot_of, sel) if slots else (idx, idx)   # (unread without the selection)
    HP, on = triton.next_power_of_2(H), pdl(h)
    nbytes = gate_w.numel() * gate_w.element_size()
    one = one_block(E, H, nbytes, tile)
    with _device(h):   # Triton launches on the current device's current stream
        if one_kernel(nbytes):   # one program, one kernel
            _route_kernel[(1,)](h, a, norm_w, gate_w, out, post, scores, idx, sl, se, H, E, eps, K=k, KP=KP, EP=EP,
                                BLOCK_H=HP if one else max(32, min(256, 8192 // EP)), NORM_TOPK=norm_topk,
                                SLOTS=slots, ONE=one, num_warps=warps or ROUTER_WARPS, **pdl_args(on))
        else:   # the logits over programs of ROUTER_BLOCK_E experts (Triton's default warps), then the top-k
            lg = torch.empty(E, device=h.device, dtype=torch.float32)
            _route_logits_kernel[(triton.cdiv(E, ROUTER_BLOCK_E),)](h, a, norm_w, gate_w, out, post, lg, H, E, eps,
                                                                    BLOCK_E=ROUTER_BLOCK_E,
                                                                    BLOCK_H=HP if one else 256, ONE=one,
                                                                    **pdl_args(on))
            _route_topk_kernel[(1,)](lg, scores, idx, sl, se, E, K=k, KP=KP, EP=EP, NORM_TOPK=norm_topk, SLOTS=slots,
                                     **pdl_args(on))
    return out
