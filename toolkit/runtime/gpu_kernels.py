"""The GPU tier's grouped expert GEMVs: one launch computes a matrix of each of the k experts a token
routes to, reading the weights where they lie, with fp32 accumulation.

- The draft's int4 kernel reads the packed int4 weights (two per byte, low nibble first, value =
  nibble - 8) and their fp16 scales (one per 32 inputs) directly: the weights are never expanded to
  fp16 in memory.

      y[j, o] = sum_n  (q[ids[j], o, n] - 8) * scale[ids[j], o, n // 32] * x[j or 0, n]

- The target's fp16 kernel reads one matrix of each expert straight from the pool's slot arena by slot
  number (a device tensor, so a CUDA graph replays it for whatever slots the host wrote): no gathered
  copy of the weights, so each expert byte is read once per token, as the HBM floor counts.

      y[j, o] = fp16( sum_n  W[slots[j]][o, n] * x[j or 0, n] )

  and for a SiLU expert's gate and up rows (`glu`, W [2F, N]): fp16(SiLU(g) x u) with g = y[j, o] and
  u = y[j, F + o], each rounded to fp16 first.

- The fused attention's q/k/v GEMV (`norm_gemv`) takes the layer's input RMS norm and, after a MoE layer,
  that layer's k weighted expert outputs summed into the residual stream, as its prologue; the same kernel is
  one position's final norm and LM head (gpu_graph.StaticDecoder.head_one).

On CUDA they are Triton kernels (one program per expert and block of output rows); elsewhere, and as
the reference in the tests, the same arithmetic in torch ops (`int4_gemv_torch`, `slot_gemv_torch`,
`norm_gemv_torch`). All are registered as torch custom operators (`torch.ops.specprefetch.slot_gemv` /
`int4_gemv` / `norm_gemv`), so
torch.compile traces a whole decode step through them (an opaque call in the compiled graph, inductor
fusing the element-wise work around it) without a graph break.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

from toolkit.models.expert_layout import GROUP

try:   # Triton ships with torch's CUDA wheels; the CPU build here has none
    import triton
    import triton.language as tl
except ImportError:   # pragma: no cover - depends on the install
    triton = None


def dequant(q: torch.Tensor, scale: torch.Tensor, n: int, dtype=torch.float32) -> torch.Tensor:
    """[..., O, P] packed bytes and [..., O, 2P / 32] scales -> [..., O, n] weights."""
    lo, hi = (q & 0xF), (q >> 4)
    v = torch.stack((lo, hi), -1).reshape(*q.shape[:-1], -1).to(torch.float32) - 8
    w = (v.reshape(*v.shape[:-1], -1, GROUP) * scale.float()[..., None]).reshape(*v.shape[:-1], -1)
    return w[..., :n].to(dtype)


def int4_gemv_torch(q, scale, ids, x, n: int) -> torch.Tensor:
    """q [E, O, P] uint8, scale [E, O, G] fp16, ids [k] long, x [1 or k, n] -> y [k, O] float32."""
    w = dequant(q.index_select(0, ids), scale.index_select(0, ids), n)     # [k, O, n]
    xs = x.float().expand(ids.numel(), n)
    return torch.bmm(w, xs[..., None])[..., 0]


if triton is not None:
    @triton.jit
    def _int4_gemv_kernel(q_ptr, s_ptr, ids_ptr, x_ptr, y_ptr, O, P, G, n, x_stride,
                          BLOCK_O: tl.constexpr, BLOCK_P: tl.constexpr):
        j = tl.program_id(0)
        po = tl.program_id(1)
        e = tl.load(ids_ptr + j).to(tl.int64)
        offs_o = po * BLOCK_O + tl.arange(0, BLOCK_O)
        mo = offs_o < O
        acc = tl.zeros([BLOCK_O], dtype=tl.float32)
        qbase = q_ptr + e * O * P
        sbase = s_ptr + e * O * G
        xbase = x_ptr + j * x_stride
        for p0 in range(0, P, BLOCK_P):
            offs_p = p0 + tl.arange(0, BLOCK_P)
            mp = offs_p < P
            m2 = mo[:, None] & mp[None, :]
            qv = tl.load(qbase + offs_o[:, None] * P + offs_p[None, :], mask=m2, other=136)
            lo = (qv & 0xF).to(tl.float32) - 8.0
            hi = (qv >> 4).to(tl.float32) - 8.0
            sv = tl.load(sbase + offs_o[:, None] * G + (offs_p[None, :] // 16), mask=m2, other=0.0).to(tl.float32)
            xe = tl.load(xbase + 2 * offs_p, mask=mp & (2 * offs_p < n), other=0.0).to(tl.float32)
            xo = tl.load(xbase + 2 * offs_p + 1, mask=mp & (2 * offs_p + 1 < n), other=0.0).to(tl.float32)
            acc += tl.sum((lo * xe[None, :] + hi * xo[None, :]) * sv, axis=1)
        tl.store(y_ptr + j * O + offs_o, acc, mask=mo)


# Programmatic dependent launch (Hopper and later NVIDIA GPUs): the fused kernels (the slot GEMV, norm_gemv, the
# router and the attention) are launched so that the next kernel's programs may start while the one before
# finishes: each kernel signals (griddepcontrol.launch_dependents) at its start, or after its own wait where it is
# launched `late` (the experts' gate / up), and waits for the kernel before it (griddepcontrol.wait), in every
# program, before it reads anything that kernel may have written or writes anything, so the launch gap between
# two kernels and the reads that need nothing of the kernels before overlap them: norm_gemv's and the router's
# constant weights (in their one-block paths), the slot GEMV's slot and rows where launched `pre` (the output
# projection; the experts' down projection, after a `late` gate / up), the attention's position, rotary tables
# and earlier cache positions. As each kernel lets the next start at its own start, a chain of them can be in
# flight at once: what a kernel reads before its wait must not be written by any kernel that may still run.
# Nothing writes a model's weights while it decodes (code that did, in place, would need a plain launch or a sync
# in between); the position, the rotary tables and a segment's slots are written by copies or plain kernels,
# which have exited before any later kernel starts (visibility through their exit, not a wait: what a plain
# launch's ordering gives); a decode step ends in plain kernels (the token's argmax, the position's increment),
# so the next step's kernels start after this step's cache writes; and a `late` kernel starts its successors
# only once every kernel before it has finished. SPECPREFETCH_PDL=0 launches them plainly, 1 (the default) as
# above (docs/gpu-tier.md).
def pdl_setting(value: str | None) -> bool | None:
    """SPECPREFETCH_PDL's value -> on (unset or 1), off (0), or None for anything else (check_pdl_setting)."""
    return {"1": True, "0": False}.get("1" if value is None else value.strip())


_PDL_ENV = os.environ.get("SPECPREFETCH_PDL")
PDL: bool | None = pdl_setting(_PDL_ENV)


@functools.cache
def _sm90(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def check_pdl_setting() -> None:
    """An SPECPREFETCH_PDL other than 0 or 1 refused in one line: by `run --device cuda`, `bench gpu` and the
    kernel sweep before anything loads, and by pdl() at a fused kernel's launch."""
    if PDL is None:
        from toolkit.errors import SpecPrefetchError

        raise SpecPrefetchError(f"SPECPREFETCH_PDL={_PDL_ENV!r}: 0 (plain launches) or 1 (the default)")


def pdl(t: torch.Tensor) -> bool:
    """Whether the kernels launched for t's device use programmatic dependent launch (PDL, above)."""
    if not t.is_cuda:
        return False
    check_pdl_setting()
    return PDL and _sm90(t.device.index)   # (a CUDA tensor's device has its index)


def pdl_on(device) -> bool:
    """pdl() for a device rather than a tensor (reports, the sweep)."""
    return pdl(torch.empty(0, device=device))


def launch_opts(on: bool) -> dict:
    """The Triton launch options for a kernel launched with PDL where `on` (pdl())."""
    return {"launch_pdl": True} if on else {}


def pdl_args(on: bool) -> dict:
    """A fused kernel's PDL constexpr and its launch options, together (every launch passes both)."""
    return {"PDL": on, **launch_opts(on)}


def is_weighted_rms_norm(norm) -> bool:
    """Whether a norm module is an RMS norm with a weight (transformers' Qwen3 / Mixtral), as the fused
    kernels apply it (rms_norm_torch)."""
    return hasattr(norm, "variance_epsilon") and getattr(norm, "weight", None) is not None


def _device(t: torch.Tensor):
    """t's CUDA device as the current one (Triton launches there); nothing for CPU tensors (Triton's
    interpreter, TRITON_INTERPRET=1, runs the kernels on them: how the tests check them without a GPU)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def rms_norm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' (Qwen3 / Mixtral) RMS norm of each row of x in x's dtype: float32 statistics, the
    normalised row rounded to the dtype, then times the weight (the fused kernels' reference)."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """[k, 2N] gate | up -> SiLU(gate) x up [k, N], in float32, rounded once to x's dtype (as inductor's
    fused element-wise kernel computes `act(gate) * up`): the down projection's input of a SiLU expert."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def slot_gemv_torch(w: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """w [C, O, N] (a view of the slot arena), slots [k] long, x [1 or k, N] -> y [k, O] in x's dtype: the
    weights read as they are (fp16) and x as given, fp32 products and sums, one rounding at the end.
    `gated`: x is [k, 2N], gate and up, and the input is silu_mul(x)."""
    if gated:
        x = silu_mul(x)
    ws = w.index_select(0, slots)                                      # [k, O, N]
    xs = x.expand(slots.numel(), x.shape[-1])
    return torch.bmm(ws.float(), xs.float()[..., None])[..., 0].to(x.dtype)


if triton is not None:
    @triton.jit
    def _gemv_input(xbase, offs_n, mn, N, GATED: tl.constexpr):
        """The GEMV's input at offs_n in float32; GATED: SiLU(gate) x up of the [2N] row, rounded to its dtype
        once (silu_mul)."""
        if GATED:
            g = tl.load(xbase + offs_n, mask=mn, other=0.0).to(tl.float32)
            u = tl.load(xbase + N + offs_n, mask=mn, other=0.0).to(tl.float32)
            return (g / (1.0 + tl.exp(-g)) * u).to(xbase.dtype.element_ty).to(tl.float32)
        return tl.load(xbase + offs_n, mask=mn, other=0.0).to(tl.float32)

    @triton.jit
    def _slot_gemv_kernel(w_ptr, slots_ptr, x_ptr, y_ptr, O, N, slot_stride, row_stride, x_stride,
                          BLOCK_O: tl.constexpr, BLOCK_N: tl.constexpr, GATED: tl.constexpr, GLU: tl.constexpr,
                          PRE: tl.constexpr, LATE: tl.constexpr, PDL: tl.constexpr):
        j = tl.program_id(0)
        po = tl.program_id(1)
        offs_o = po * BLOCK_O + tl.arange(0, BLOCK_O)
        mo = offs_o < O
        xbase = x_ptr + j * x_stride
        if PDL:
            if not LATE:
                tl.extra.cuda.gdc_launch_dependents()
        if PRE:   # the slot and the program's whole rows (BLOCK_N >= N) read before the wait, the input after
            s = tl.load(slots_ptr + j).to(tl.int64)
            offs_n = tl.arange(0, BLOCK_N)
            mn = offs_n < N
            wv = tl.load(w_ptr + s * slot_stride + offs_o[:, None] * row_stride + offs_n[None, :],
                         mask=mo[:, None] & mn[None, :], other=0.0)
            if PDL:
                tl.extra.cuda.gdc_wait()
                if LATE:
                    tl.extra.cuda.gdc_launch_dependents()
            acc = tl.sum(wv.to(tl.float32) * _gemv_input(xbase, offs_n, mn, N, GATED)[None, :], axis=1)
        else:     # (the slots and the input may be the kernel before's: nothing read ahead of the wait)
            if PDL:
                tl.extra.cuda.gdc_wait()
                if LATE:   # after the wait: the next kernel starts only once this one's inputs are all written
                    tl.extra.cuda.gdc_launch_dependents()
            s = tl.load(slots_ptr + j).to(tl.int64)
            wbase = w_ptr + s * slot_stride
            acc = tl.zeros([BLOCK_O], dtype=tl.float32)
            up = tl.zeros([BLOCK_O], dtype=tl.float32)
            for n0 in range(0, N, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                mn = offs_n < N
                m2 = mo[:, None] & mn[None, :]
                xv = _gemv_input(xbase, offs_n, mn, N, GATED)[None, :]
                wv = tl.load(wbase + offs_o[:, None] * row_stride + offs_n[None, :], mask=m2, other=0.0)
                acc += tl.sum(wv.to(tl.float32) * xv, axis=1)
                if GLU:   # the same rows of the up half (O rows on)
                    wu = tl.load(wbase + (O + offs_o[:, None]) * row_stride + offs_n[None, :], mask=m2, other=0.0)
                    up += tl.sum(wu.to(tl.float32) * xv, axis=1)
            if GLU:   # SiLU(gate) x up, each rounded to the dtype first and the product once (silu_mul)
                g = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
                acc = g / (1.0 + tl.exp(-g)) * up.to(y_ptr.dtype.element_ty).to(tl.float32)
        tl.store(y_ptr + j * O + offs_o, acc.to(y_ptr.dtype.element_ty), mask=mo)


# the best of ten tilings on an H100 at both expert sizes (docs/benchmarks.md), and in section 33's sweep for the
# experts' gate / up (2/1024 was faster for a one-slot [1024, 1024] output projection alone, untimed in the token)
SLOT_BLOCK_O, SLOT_BLOCK_N = 4, 512
# `pre`'s bound: a program holds its BLOCK_O rows whole in registers, BLOCK_O x N (N to a power of two) at most
# SLOT_PRE_ELEMS (4 x 2,048 fp16: 32 a thread at the 8 warps slot_pre_warps gives it); wider rows take the
# loop, reading after the wait
SLOT_PRE_ELEMS = 8192


def slot_pre_warps(tile: int) -> int | None:
    """`pre`'s warps for a whole tile of `tile` elements: 8 above 4,096 (4 x 2,048 spilled registers at 4 warps in
    ptxas for sm_90), else Triton's default."""
    return 8 if tile > 4096 else None


def slot_pre_whole(N: int, block_o: int | None = None) -> bool:
    """Whether `pre` holds a program's rows of N inputs whole (else the loop, reading after the wait)."""
    return (block_o or SLOT_BLOCK_O) * (1 << (N - 1).bit_length()) <= SLOT_PRE_ELEMS


def slot_gemv(w: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, *, gated: bool = False, glu: bool = False,
              pre: bool = False, late: bool = False, use_triton: bool | None = None) -> torch.Tensor:
    """The fused kernel where Triton and CUDA are present, else the torch reference (under torch.compile
    the custom operator `specprefetch::slot_gemv`, traced as one call; eagerly its body). w is a [C, O, N] view
    of the fp16 slot arena whose rows are contiguous (stride(2) == 1). `gated`: x is [k, 2N] (an
    expert's gate and up outputs) and the kernel takes silu_mul(x) as it loads it (the down projection
    of a SiLU expert, no separate element-wise kernel). `glu`: w holds a SiLU expert's gate rows then its up
    rows (O = 2F) and the kernel returns silu_mul of its [k, O] product, [k, F] (each program computes the
    same rows of both halves), so the down projection's kernel reads F inputs, not 2F.

    Under programmatic dependent launch (pdl()): `pre` lets each program read its slot and its rows of the
    matrix, whole, before it waits for the kernel before (up to SLOT_PRE_ELEMS; the loop over the rows
    otherwise): only
    where neither was written by a kernel that may still run, i.e. the weights are the model's (constant while
    it decodes) and the slots constant (a one-slot projection) or written before a `late` kernel ahead of this
    one; `late` signals the next kernel's launch only after this one's wait, so every kernel after it starts
    once everything before this one has finished (the experts' gate / up kernel, so that the down projection
    may read the slots the router wrote ahead of its wait). `late` changes the launch only; `pre`'s whole rows
    are one reduction rather than the loop's blocks, so its results may differ from the loop's in the last bit
    (the same with or without PDL).
    `use_triton` forces a path (tests)."""
    if glu and (gated or pre):
        raise ValueError("slot_gemv: glu takes neither gated nor pre")
    if use_triton is None:
        if torch.compiler.is_compiling():   # the operator for torch.compile; eagerly its body, without
            return torch.ops.specprefetch.slot_gemv(w, slots, x, gated, glu, pre, late)   # the dispatcher's cost
        return _slot_gemv_impl(w, slots, x, gated, glu, pre, late)
    if use_triton:
        return _slot_gemv_triton(w, slots, x, gated=gated, glu=glu, pre=pre, late=late)
    return slot_gemv_ref(w, slots, x, gated, glu)


def slot_gemv_ref(w: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, gated: bool = False,
                  glu: bool = False) -> torch.Tensor:
    """slot_gemv's reference, glu included: silu_mul of the [k, 2F] product."""
    _check_glu(w, gated, glu, pre=False)
    y = slot_gemv_torch(w, slots, x, gated)
    return silu_mul(y) if glu else y


def _slot_gemv_impl(w: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, gated: bool, glu: bool, pre: bool,
                    late: bool) -> torch.Tensor:
    _check_glu(w, gated, glu, pre)
    if triton is not None and w.is_cuda:
        return _slot_gemv_triton(w, slots, x, gated=gated, glu=glu, pre=pre, late=late)
    return slot_gemv_ref(w, slots, x, gated, glu)


@torch.library.custom_op("specprefetch::slot_gemv", mutates_args=())
def _slot_gemv_op(w: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, gated: bool, glu: bool, pre: bool,
                  late: bool) -> torch.Tensor:
    return _slot_gemv_impl(w, slots, x, gated, glu, pre, late)


def _check_glu(w, gated: bool, glu: bool, pre: bool) -> None:
    torch._check(not glu or (w.shape[1] % 2 == 0 and not gated and not pre),
                 lambda: "slot_gemv: glu needs gate and up rows (an even O) and neither gated nor pre")


@_slot_gemv_op.register_fake
def _(w, slots, x, gated, glu, pre, late):
    _check_glu(w, gated, glu, pre)
    torch._check(x.shape[-1] == w.shape[2] * (2 if gated else 1),
                 lambda: "slot_gemv: x's width is not the matrix's input")
    torch._check(x.shape[0] == 1 or x.shape[0] == slots.shape[0], lambda: "slot_gemv: x has neither 1 nor k rows")
    return x.new_empty(slots.shape[0], w.shape[1] // 2 if glu else w.shape[1])


def _slot_gemv_triton(w: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, block_o: int | None = None,
                      block_n: int | None = None, num_warps: int | None = None, *, gated: bool = False,
                      glu: bool = False, pre: bool = False, late: bool = False,
                      num_stages: int | None = None) -> torch.Tensor:
    C, O, N = w.shape
    if w.dtype != torch.float16 or w.stride(2) != 1:
        raise ValueError("slot_gemv: w must be an fp16 view with contiguous rows")
    if x.shape[-1] != N * (2 if gated else 1) or x.shape[0] not in (1, slots.numel()):
        raise ValueError(f"slot_gemv: x {tuple(x.shape)} for {slots.numel()} experts of [{O}, {N}]"
                         + (" (gated: 2N inputs)" if gated else ""))
    if glu and (gated or pre or O % 2):
        raise ValueError(f"slot_gemv: glu needs gate and up rows (an even O, {O}) and neither gated nor pre")
    k = slots.numel()
    slots, x = slots.contiguous(), x.contiguous()
    if glu:
        O //= 2
    y = torch.empty(k, O, device=w.device, dtype=x.dtype)
    pre = pre and slot_pre_whole(N, block_o)
    bo, bn = block_o or SLOT_BLOCK_O, triton.next_power_of_2(N) if pre else block_n or SLOT_BLOCK_N
    if pre and num_warps is None:
        num_warps = slot_pre_warps(bo * bn)
    grid = (k, triton.cdiv(O, bo))
    extra = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    on = pdl(w)
    with _device(w):   # Triton launches on the current device's current stream
        _slot_gemv_kernel[grid](w, slots, x, y, O, N, w.stride(0), w.stride(1), 0 if x.shape[0] == 1 else x.stride(0),
                                BLOCK_O=bo, BLOCK_N=bn, GATED=gated, GLU=glu, PRE=pre, LATE=late, **extra,
                                **pdl_args(on))
    return y


def expert_sum(ys, scores, perm) -> torch.Tensor:
    """A MoE layer's k routed outputs ys [k, H] (ascending expert order) weighted by scores[0, perm[j]] and
    summed -> [1, H] in ys's dtype: each weighted output rounded to the dtype, their sum rounded once (as
    FusedExpertMath, the segments' `combine` and norm_gemv's prologue all sum them)."""
    w = scores.reshape(1, -1).index_select(1, perm)
    return (ys * w[0, :, None]).to(ys.dtype).sum(0, keepdim=True)


def norm_gemv_torch(h, ys, scores, perm, nw, eps: float, w) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: h [1, H] (the residual stream); ys [k, H], the routed experts' outputs of the MoE layer
    before (k = 0: none), weighted by scores[0, perm[j]] (as FusedExpertMath combines them: each weighted
    output rounded to the dtype, their sum rounded once, added to h); then the RMS norm (weight nw) and the
    GEMV with w [O, H] (fp32 products and sums, rounded once) -> (h', y [1, O])."""
    hn = h.reshape(1, -1)
    if ys.shape[0]:
        hn = hn + expert_sum(ys, scores, perm).to(hn.dtype)
    else:
        hn = hn.clone()   # (a custom operator's output may not alias its input)
    x = rms_norm_torch(hn, nw, eps)
    return hn.view_as(h), (x.float() @ w.float().t()).to(w.dtype)


if triton is not None:
    @triton.jit
    def _rms_apply(xf, r, w, ref_ptr):
        """transformers' RMS norm's rounding (rms_norm_torch): the row xf (float32) times its reciprocal RMS r,
        rounded to the model's dtype (ref_ptr's), times the weight w (float32), rounded again -> float32. The
        fused kernels' one formula for it (norm_gemv, the router, the attention's q/k norms; r and w broadcast
        as the caller needs)."""
        dt = ref_ptr.dtype.element_ty
        return (w * (xf * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)

    @triton.jit
    def _combined(h_ptr, y_ptr, sc_ptr, perm_ptr, c, mc, H, K: tl.constexpr):
        """h [c] plus the k weighted expert outputs (norm_gemv_torch's rounding), in h's dtype."""
        dt = h_ptr.dtype.element_ty
        x = tl.load(h_ptr + c, mask=mc, other=0.0)
        if K > 0:
            s = tl.zeros(c.shape, dtype=tl.float32)
            for j in tl.static_range(K):
                wj = tl.load(sc_ptr + tl.load(perm_ptr + j)).to(tl.float32)
                yj = tl.load(y_ptr + j * H + c, mask=mc, other=0.0).to(tl.float32)
                s += (yj * wj).to(dt).to(tl.float32)
            x = (x.to(tl.float32) + s.to(dt).to(tl.float32)).to(dt)
        return x

    @triton.jit
    def _norm_gemv_kernel(h_ptr, y_ptr, sc_ptr, perm_ptr, nw_ptr, w_ptr, hout_ptr, out_ptr, H, O, eps,
                          K: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_N: tl.constexpr, ONE: tl.constexpr,
                          PDL: tl.constexpr):
        po = tl.program_id(0)
        offs_o = po * BLOCK_O + tl.arange(0, BLOCK_O)
        mo = offs_o < O
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        if ONE:   # the row in one block: combined and normalised once, in registers
            c = tl.arange(0, BLOCK_N)
            mc = c < H
            # the weights first (constant: read while the kernel before finishes, under PDL), then the row
            wv = tl.load(w_ptr + offs_o[:, None] * H + c[None, :], mask=mo[:, None] & mc[None, :], other=0.0)
            nwv = tl.load(nw_ptr + c, mask=mc, other=0.0).to(tl.float32)
            if PDL:
                tl.extra.cuda.gdc_wait()
            x = _combined(h_ptr, y_ptr, sc_ptr, perm_ptr, c, mc, H, K)
            tl.store(hout_ptr + c, x, mask=mc & (po == 0))
            xf = x.to(tl.float32)
            r = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
            xn = _rms_apply(xf, r, nwv, h_ptr)
            acc = tl.sum(wv.to(tl.float32) * xn[None, :], axis=1)
        else:     # the combined row twice: its sum of squares (program 0 writes it), then the rows' products
            if PDL:
                tl.extra.cuda.gdc_wait()
            ss = tl.zeros([BLOCK_N], dtype=tl.float32)
            for n0 in range(0, H, BLOCK_N):
                c = n0 + tl.arange(0, BLOCK_N)
                mc = c < H
                x = _combined(h_ptr, y_ptr, sc_ptr, perm_ptr, c, mc, H, K)
                tl.store(hout_ptr + c, x, mask=mc & (po == 0))
                xf = x.to(tl.float32)
                ss += xf * xf
            r = tl.math.rsqrt(tl.sum(ss, axis=0) / H + eps)
            acc = tl.zeros([BLOCK_O], dtype=tl.float32)
            for n0 in range(0, H, BLOCK_N):                # the norm as transformers rounds it, and the rows
                c = n0 + tl.arange(0, BLOCK_N)
                mc = c < H
                x = _combined(h_ptr, y_ptr, sc_ptr, perm_ptr, c, mc, H, K)
                nwc = tl.load(nw_ptr + c, mask=mc, other=0.0).to(tl.float32)
                xn = _rms_apply(x.to(tl.float32), r, nwc, h_ptr)
                wv = tl.load(w_ptr + offs_o[:, None] * H + c[None, :], mask=mo[:, None] & mc[None, :], other=0.0)
                acc += tl.sum(wv.to(tl.float32) * xn[None, :], axis=1)
        tl.store(out_ptr + offs_o, acc.to(out_ptr.dtype.element_ty), mask=mo)


def norm_gemv(h, ys, scores, perm, nw, eps: float, w, *, use_triton: bool | None = None):
    """A decoder layer's input for one position, in one kernel (Triton on CUDA, else the reference; under
    torch.compile the custom operator `specprefetch::norm_gemv`): the MoE layer before's expert outputs
    combined into the residual stream, the input RMS norm, and the first GEMV over it (the fused attention's
    q/k/v projection; or the final norm and the LM head: gpu_graph.StaticDecoder.head_one) -> (h', y [1, O]).
    ys [0, H] (and empty scores / perm): no combine, the norm and GEMV only. Each program recomputes the
    combined row and its norm from the k + 1 rows (read from the L2: (k + 1) x H x 2 bytes a program, once up
    to NORM_ONE_BLOCK inputs, twice above) instead of a kernel of its own writing it out. `use_triton` forces
    a path (tests)."""
    args = (h, ys, scores, perm, nw, eps, w)
    if use_triton is None:
        if torch.compiler.is_compiling():   # as slot_gemv
            return torch.ops.specprefetch.norm_gemv(*args)
        return _norm_gemv_impl(*args)
    return _norm_gemv_triton(*args) if use_triton else norm_gemv_torch(*args)


def _norm_gemv_impl(*args):
    if triton is not None and args[0].is_cuda:
        return _norm_gemv_triton(*args)
    return norm_gemv_torch(*args)


@torch.library.custom_op("specprefetch::norm_gemv", mutates_args=())
def _norm_gemv_op(h: torch.Tensor, ys: torch.Tensor, scores: torch.Tensor, perm: torch.Tensor, nw: torch.Tensor,
                  eps: float, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm_gemv_impl(h, ys, scores, perm, nw, eps, w)


@_norm_gemv_op.register_fake
def _(h, ys, scores, perm, nw, eps, w):
    torch._check(h.numel() == w.shape[1] and (ys.shape[0] == 0 or ys.shape[1] == w.shape[1]),
                 lambda: "norm_gemv: one row of the matrix's input")
    return torch.empty_like(h), h.new_empty(1, w.shape[0], dtype=w.dtype)


# a program's rows: more than the slot GEMV's 4 (SLOT_BLOCK_O), since each program also reads the combine's
# k + 1 rows (from the L2); hidden sizes up to NORM_ONE_BLOCK are held whole in registers (one read of those
# rows), larger ones read them twice (the sum of squares, then the rows' products). Swept on an H100 (docs/benchmarks.md
# section 33): 16 rows / 4 warps were faster alone but not in the token, so these stay.
NORM_BLOCK_O, NORM_ONE_BLOCK, NORM_WARPS = 8, 1024, 8


def _norm_gemv_triton(h, ys, scores, perm, nw, eps: float, w, *, block_o: int | None = None,
                      warps: int | None = None):
    """The kernel's launch; `block_o` / `warps` override NORM_BLOCK_O / NORM_WARPS (the tiling sweep)."""
    O, H = w.shape
    k = ys.shape[0]
    if w.dtype != torch.float16 or h.dtype != w.dtype or h.numel() != H or nw.numel() != H:
        raise ValueError(f"norm_gemv: an fp16 row of {H} and [{O}, {H}] fp16 matrix (h {tuple(h.shape)} "
                         f"{str(h.dtype).removeprefix('torch.')}, w {str(w.dtype).removeprefix('torch.')})")
    if k and (tuple(ys.shape) != (k, H) or perm.numel() != k or ys.dtype != h.dtype):
        raise ValueError(f"norm_gemv: {k} expert outputs of {H} ({tuple(ys.shape)}) and as many positions "
                         f"({perm.numel()})")
    h, ys, scores, perm, nw, w = (t.contiguous() for t in (h, ys, scores, perm, nw, w))
    hout, y = torch.empty_like(h), torch.empty(1, O, device=w.device, dtype=w.dtype)
    with _device(w):   # Triton launches on the current device's current stream
        bo, on = block_o or NORM_BLOCK_O, pdl(w)
        _norm_gemv_kernel[(triton.cdiv(O, bo),)](
            h, ys if k else h, scores if k else h, perm if k else h, nw, w, hout, y, H, O, eps, K=k,
            BLOCK_O=bo, BLOCK_N=min(NORM_ONE_BLOCK, triton.next_power_of_2(H)), ONE=H <= NORM_ONE_BLOCK,
            num_warps=warps or NORM_WARPS, **pdl_args(on))
    return hout, y


def int4_gemv(q, scale, ids, x, n: int, *, use_triton: bool | None = None) -> torch.Tensor:
    """The fused kernel where Triton and CUDA are present, else the torch reference (the custom
    operator `specprefetch::int4_gemv`); `use_triton` forces a path (tests)."""
    if use_triton is None:
        if torch.compiler.is_compiling():   # as slot_gemv
            return torch.ops.specprefetch.int4_gemv(q, scale, ids, x, n)
        return _int4_gemv_impl(q, scale, ids, x, n)
    return _int4_gemv_triton(q, scale, ids, x, n) if use_triton else int4_gemv_torch(q, scale, ids, x, n)


def _int4_gemv_impl(q, scale, ids, x, n: int) -> torch.Tensor:
    if triton is not None and q.is_cuda:
        return _int4_gemv_triton(q, scale, ids, x, n)
    return int4_gemv_torch(q, scale, ids, x, n)


@torch.library.custom_op("specprefetch::int4_gemv", mutates_args=())
def _int4_gemv_op(q: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
    return _int4_gemv_impl(q, scale, ids, x, n)


@_int4_gemv_op.register_fake
def _(q, scale, ids, x, n):
    torch._check(x.shape[-1] == n, lambda: "int4_gemv: x's width is not the matrix's input")
    return x.new_empty(ids.shape[0], q.shape[1], dtype=torch.float32)


def _int4_gemv_triton(q, scale, ids, x, n: int) -> torch.Tensor:
    E, O, P = q.shape
    k = ids.numel()
    x = x.contiguous()
    y = torch.empty(k, O, device=q.device, dtype=torch.float32)
    BLOCK_O, BLOCK_P = 32, 128
    grid = (k, triton.cdiv(O, BLOCK_O))
    with _device(q):   # Triton launches on the current device's current stream
        _int4_gemv_kernel[grid](q, scale, ids, x, y, O, P, scale.shape[-1], n, 0 if x.shape[0] == 1 else x.stride(0),
                                BLOCK_O=BLOCK_O, BLOCK_P=BLOCK_P)
    return y


def graph_ms(fn, reps: int, warm: int = 3) -> float:
    """Milliseconds a call of fn (CUDA work) captured in a CUDA graph and replayed `reps` times: fn runs `warm`
    times first on a side stream (compiling kernels, warming the allocator), as graph capture wants."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / reps


def bench(shapes=((1024, 1536), (1024, 6144)), k: int = 4, slots: int = 40, reps: int = 50,
          sels: int = 8, blocks=((None, None, None),)) -> list[dict]:
    """One MoE layer's k experts for one token (gate/up, SiLU, down) as CUDA graphs, the slot GEMV
    against the gather + F.linear path it replaced: microseconds per layer and the expert bytes read per
    second (docs/benchmarks.md section 9). Each graph runs `sels` different random selections of k of
    the `slots` experts in turn (all `slots` experts, hundreds of MiB, far beyond the L2 cache), so the
    bytes come from device memory. `blocks`: the slot GEMV's tilings (BLOCK_O, BLOCK_N, warps) to try,
    each a row of its own (path "fused O/N/W"; None values: the default's, path "fused"); gate / up with
    SiLU(gate) x up out (`glu`, `late`) and the down projection `pre` (its BLOCK_N unused where the rows are
    whole), as FusedExpertMath runs them. Needs CUDA and Triton."""
    import torch.nn.functional as F

    if triton is None or not torch.cuda.is_available():
        raise RuntimeError("the kernel bench needs CUDA and Triton")
    out = []
    for H, inter in shapes:
        blob = 3 * H * inter
        arena = torch.randn(slots, blob, device="cuda", dtype=torch.float16) * 0.02
        gu = arena[:, :2 * inter * H].view(slots, 2 * inter, H)
        dn = arena[:, 2 * inter * H:].view(slots, H, inter)
        order = torch.cat([torch.randperm(slots, device="cuda") for _ in range(-(-sels * k // slots))])
        picks = [order[i * k:(i + 1) * k] for i in range(sels)]     # every slot read, none twice in a row
        x = torch.randn(1, H, device="cuda", dtype=torch.float16)

        def fused(bo=None, bn=None, nw=None):   # as FusedExpertMath runs it: SiLU x up out of the gate/up kernel
            for sel in picks:
                act = _slot_gemv_triton(gu, sel, x, bo, bn, nw, glu=True, late=True)
                _slot_gemv_triton(dn, sel, act, bo, bn, nw, pre=True)

        def eager():
            for sel in picks:
                g, d = gu.index_select(0, sel), dn.index_select(0, sel)
                for j in range(k):
                    a, b = F.linear(x, g[j]).chunk(2, -1)
                    F.linear(F.silu(a) * b, d[j])

        def label(blk):
            if blk == (None, None, None):
                return "fused"
            return "fused " + "/".join("-" if v is None else str(v) for v in blk)

        runs = [(label(blk), functools.partial(fused, *blk)) for blk in blocks]
        for name, fn in runs + [("eager", eager)]:
            ms = graph_ms(fn, reps) / sels
            out.append({"hidden": H, "moe_intermediate": inter, "k": k, "path": name,
                        "us_per_layer": round(ms * 1e3, 1), "expert_gbps": round(k * blob * 2 / ms / 1e6)})
    return out


if __name__ == "__main__":   # python -m toolkit.runtime.gpu_kernels [O/N/W ...]: the kernel bench
    import sys

    blocks = [tuple(int(v) if v != "-" else None for v in a.split("/")) for a in sys.argv[1:]] or [(None,) * 3]
    for row in bench(blocks=blocks):
        print(f"H {row['hidden']} I {row['moe_intermediate']}: {row['path']} {row['us_per_layer']} us per layer "
              f"(k={row['k']}), {row['expert_gbps']} GB/s of expert bytes")
