"""One decode position's whole attention block but the projections, in one GPU kernel (two over a long cache).

For a token at position `pos`, given its fused q/k/v projection row (the layer's one GEMV, `_FusedQKV`):

    q_h  = rope(norm_q(q_h))              for each query head h  (norm_q: the Qwen3 per-head RMS norm,
    k_g  = rope(norm_k(k_g)), v_g          for each K/V head g     or none: Mixtral)
    cache_k[g, pos], cache_v[g, pos] = k_g, v_g
    o_h  = softmax(q_h . cache_k[g(h), j] * scale  for visible j) . cache_v[g(h), j]

where query head h reads K/V head g(h) = h // groups (transformers' repeat_kv layout) and key j is visible
iff j <= pos and, with a sliding window W, pos - j < W. The compiled step ran this as six device
operations a layer (the q/k norms, rotary and cache writes fused by inductor, the K/V copy of the new
position, two kernels preparing cuDNN's SDPA, its workspace memset and the SDPA itself, plus the mask
built for every token); `decode_attention` is one or two (`specprefetch::decode_attention`, Triton on CUDA):
one program per K/V head computes its new K and V, writes them into the cache, and runs its query heads
over the visible keys as rows of one tile, with an online softmax over blocks of 64 positions, the new
position's key and value taken from registers rather than read back. A static cache of at most 2 x CHUNK
positions is that one kernel; a longer one is split (flash-decoding, `split_cache`): a program per K/V
head and about CHUNK positions (each computes the head's K and queries; the first chunk's writes the
cache and starts from the new position), each writing its part's running maximum, denominator and
unnormalised output (float32), and a second kernel (one program a K/V head) rescales and sums the parts,
so a long context's time is spread over its chunks' SMs rather than growing on as many SMs as there are
K/V heads. The split follows the cache's size (fixed when a runner is built), not the position reached.

Rounding: the q/k norms and the rotary embedding round where transformers' eager fp16 ops round (the
norm's result rounded, then times its weight; each rotary product and their sum rounded once), with the
norm's reciprocal square root and the exponential the GPU's approximate ones (as torch's and inductor's
CUDA kernels use); the scores, softmax and value sums in float32 with one rounding of the output, where
SDPA's kernels round the scores or probabilities to fp16 on the way. The reference
(`decode_attention_torch`, the operator's body off CUDA and the tests' oracle) computes that in torch
ops; the kernel differs from it in summation order, those approximate functions, and rounding a block's
unnormalised probabilities to fp16 for the value product (as flash attention kernels do).
"""
from __future__ import annotations

import torch

from toolkit.runtime.gpu_kernels import _device, is_weighted_rms_norm, pdl, pdl_args, rms_norm_torch, triton

if triton is not None:
    import triton.language as tl

    from toolkit.runtime.gpu_kernels import _rms_apply

BLOCK_S = 64   # positions per step of a program's loop over the cache
CHUNK = 256    # a cache of more than 2 x CHUNK positions is split over programs of about CHUNK (split_cache)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on rows of x: x cos + rotate_half(x) sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def decode_attention_torch(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, heads: int,
                           scale: float, eps: float, window: int) -> torch.Tensor:
    """The reference. qkv [1, (heads + 2 kv heads) x D]; q_norm / k_norm [D] or None; cos, sin [D] (this
    position's rotary tables, the model's dtype); k_cache, v_cache [1, kv heads, S, D] (written at pos);
    pos [1] long (a device tensor); window 0: none. -> [1, heads x D] in qkv's dtype."""
    _, nkv, S, D = k_cache.shape
    row = qkv.view(-1, D)
    q, k = row[:heads], row[heads:heads + nkv]                                  # [heads, D], [kv heads, D]
    if q_norm is not None:
        q, k = rms_norm_torch(q, q_norm, eps), rms_norm_torch(k, k_norm, eps)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    v = row[heads + nkv:heads + 2 * nkv]
    k_cache[0].index_copy_(1, pos, k[:, None].to(k_cache.dtype))
    v_cache[0].index_copy_(1, pos, v[:, None].to(v_cache.dtype))
    j = torch.arange(S, device=qkv.device)
    p = pos.view(())
    ok = j <= p
    if window:
        ok = ok & (p - j < window)
    qg = q.view(nkv, heads // nkv, D).float()                                   # a K/V head's query heads
    s = torch.einsum("gqd,gsd->gqs", qg, k_cache[0].float()) * scale
    probs = torch.softmax(s.masked_fill(~ok, float("-inf")), dim=-1)
    o = torch.einsum("gqs,gsd->gqd", probs, v_cache[0].float())
    return o.to(qkv.dtype).reshape(1, heads * D)


if triton is not None:
    @triton.jit
    def _rms_rope(row_ptr, w_ptr, cos, sin, rows, d, dp, sign, eps, D: tl.constexpr, NORM: tl.constexpr):
        """Rows of a projection ([R] row offsets, [D] columns) -> rope(norm(x)) in float32, rounded where
        the eager fp16 ops round."""
        dt = row_ptr.dtype.element_ty
        x = tl.load(row_ptr + rows[:, None] + d[None, :]).to(tl.float32)
        xp = tl.load(row_ptr + rows[:, None] + dp[None, :]).to(tl.float32)     # rotate_half's source column
        if NORM:
            r = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
            w = tl.load(w_ptr + d).to(tl.float32)
            wp = tl.load(w_ptr + dp).to(tl.float32)
            x = _rms_apply(x, r[:, None], w[None, :], row_ptr)
            xp = _rms_apply(xp, r[:, None], wp[None, :], row_ptr)
        a = (x * cos[None, :]).to(dt).to(tl.float32)
        b = (sign[None, :] * xp * sin[None, :]).to(dt).to(tl.float32)
        return (a + b).to(dt)

    @triton.jit
    def _attend_block(q, kb, vb, ok, m, den, acc, scale):
        """One block of keys and values [BLOCK_S, D] (`ok`: the visible ones) into a K/V head's online softmax
        (running maximum m, denominator den, unnormalised output acc) -> (m, den, acc)."""
        s = tl.dot(q, tl.trans(kb)) * scale                                                      # [GP, BS]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        return m_new, den * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb).to(tl.float32)

    @triton.jit
    def _decode_attention_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, pos_ptr, out_ptr,
                                 pm_ptr, pl_ptr, pacc_ptr, S, scale, eps, window,
                                 chunk, splits, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                                 NQ: tl.constexpr, NKV: tl.constexpr, QK_NORM: tl.constexpr, BLOCK_S: tl.constexpr,
                                 SPLIT: tl.constexpr, PDL: tl.constexpr):
        g = tl.program_id(0)                                  # this program's K/V head
        c = tl.program_id(1)                                  # and its chunk of the cache (SPLIT: of `splits`)
        dt = qkv_ptr.dtype.element_ty
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        # ahead of the wait (gpu_kernels.PDL), what no fused kernel of this step writes: the position and its
        # rotary tables (a copy's or plain kernels', finished before any later kernel starts), the K/V head's
        # cache at the earlier positions (the steps before's) and, unsplit, its first block of them; the
        # q/k/v row after
        pos = tl.load(pos_ptr)
        d = tl.arange(0, D)
        dp = (d + D // 2) % D
        sign = tl.where(d < D // 2, -1.0, 1.0)
        cos = tl.load(cos_ptr + d).to(tl.float32)
        sin = tl.load(sin_ptr + d).to(tl.float32)
        base = g.to(tl.int64) * S * D
        lo = tl.maximum(tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0), c * chunk)
        end = tl.minimum(tl.minimum(pos, S), (c + 1) * chunk)
        if not SPLIT:
            j = lo + tl.arange(0, BLOCK_S)
            ok0 = j < end
            kb0 = tl.load(k_ptr + base + j[:, None] * D + d[None, :], mask=ok0[:, None], other=0.0)
            vb0 = tl.load(v_ptr + base + j[:, None] * D + d[None, :], mask=ok0[:, None], other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
        one = tl.zeros([1], dtype=tl.int32)
        k = _rms_rope(qkv_ptr, kw_ptr, cos, sin, (NQ + g) * D + one, d, dp, sign, eps, D, QK_NORM)   # [1, D]
        v = tl.load(qkv_ptr + (NQ + NKV + g) * D + one[:, None] + d[None, :])                     # [1, D]
        first = c == 0                                        # the chunk that writes the new K/V and starts from it
        tl.store(k_ptr + base + pos * D + d[None, :] + one[:, None], k, mask=(pos < S) & first)   # (none past
        tl.store(v_ptr + base + pos * D + d[None, :] + one[:, None], v, mask=(pos < S) & first)   # the cache)
        # the K/V head's query heads as the rows of a tile (padded to GP >= 16 rows for tl.dot)
        r = tl.arange(0, GP)
        live = r < G
        rr = tl.where(live, r, 0)
        q = _rms_rope(qkv_ptr, qw_ptr, cos, sin, (g * G + rr) * D, d, dp, sign, eps, D, QK_NORM)     # [GP, D]
        # the new position first, from registers: the first chunk's online softmax starts from it (the others
        # from nothing: an empty part weighs nothing in the sum)
        kf = k.to(tl.float32)
        m = tl.where(first, tl.sum(q.to(tl.float32) * kf, axis=1) * scale, float("-inf"))           # [GP]
        den = tl.zeros([GP], dtype=tl.float32) + tl.where(first, 1.0, 0.0)
        acc = tl.zeros([GP, D], dtype=tl.float32) + tl.where(first, v.to(dt).to(tl.float32), 0.0)
        start = lo
        if not SPLIT:   # the block read ahead (all masked where there is none: m is finite, it adds nothing)
            m, den, acc = _attend_block(q, kb0, vb0, ok0, m, den, acc, scale)
            start = lo + BLOCK_S
        for j0 in range(start, end, BLOCK_S):                # the earlier visible positions (of this chunk)
            j = j0 + tl.arange(0, BLOCK_S)
            ok = j < end
            kb = tl.load(k_ptr + base + j[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)   # [BS, D]
            vb = tl.load(v_ptr + base + j[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
            m, den, acc = _attend_block(q, kb, vb, ok, m, den, acc, scale)
        # (the first term's weight was exp(s_new - m), carried in acc and den from the start)
        if not SPLIT:
            tl.store(out_ptr + (g * G + rr[:, None]) * D + d[None, :], (acc / den[:, None]).to(dt),
                     mask=live[:, None])
        else:   # this part's maximum, denominator and unnormalised output (real rows), for _decode_combine_kernel
            at = (g * splits + c) * G + rr
            tl.store(pm_ptr + at, m, mask=live)
            tl.store(pl_ptr + at, den, mask=live)
            tl.store(pacc_ptr + at[:, None] * D + d[None, :], acc, mask=live[:, None])

    @triton.jit
    def _decode_combine_kernel(pm_ptr, pl_ptr, pacc_ptr, out_ptr, splits, G: tl.constexpr, GP: tl.constexpr,
                               D: tl.constexpr, PDL: tl.constexpr):
        """A K/V head's parts, rescaled to their common maximum and summed -> its query heads' outputs."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        g = tl.program_id(0)
        r = tl.arange(0, GP)
        live = r < G
        rr = tl.where(live, r, 0)
        d = tl.arange(0, D)
        mx = tl.full([GP], float("-inf"), dtype=tl.float32)
        for c in range(splits):
            mx = tl.maximum(mx, tl.load(pm_ptr + (g * splits + c) * G + rr))
        den = tl.zeros([GP], dtype=tl.float32)
        acc = tl.zeros([GP, D], dtype=tl.float32)
        for c in range(splits):   # (the first part always holds the new position: mx is finite)
            at = (g * splits + c) * G + rr
            w = tl.exp(tl.load(pm_ptr + at) - mx)
            den += tl.load(pl_ptr + at) * w
            acc += tl.load(pacc_ptr + at[:, None] * D + d[None, :]) * w[:, None]
        tl.store(out_ptr + (g * G + rr[:, None]) * D + d[None, :], (acc / den[:, None]).to(out_ptr.dtype.element_ty),
                 mask=live[:, None])


def _check(qkv, cos, sin, k_cache, v_cache, pos, heads: int) -> None:
    _, nkv, S, D = k_cache.shape
    torch._check(qkv.numel() == (heads + 2 * nkv) * D, lambda: "decode_attention: qkv is not q, k and v of one row")
    torch._check(heads % nkv == 0, lambda: "decode_attention: the query heads are not a multiple of the K/V heads")
    torch._check(v_cache.shape == k_cache.shape, lambda: "decode_attention: K and V caches differ in shape")
    torch._check(cos.numel() == D and sin.numel() == D, lambda: "decode_attention: cos/sin are not one position's")
    torch._check(pos.numel() == 1, lambda: "decode_attention: one position")


def decode_attention(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, heads: int, scale: float, eps: float,
                     window: int = 0, *, use_triton: bool | None = None) -> torch.Tensor:
    """One position's attention (module docstring): the Triton kernel where Triton and CUDA are present,
    else the reference; under torch.compile the custom operator `specprefetch::decode_attention` (one
    opaque call that writes the caches in place). `use_triton` forces a path (tests)."""
    args = (qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, heads, scale, eps, window)
    if use_triton is None:
        if torch.compiler.is_compiling():   # as gpu_kernels.slot_gemv
            return torch.ops.specprefetch.decode_attention(*args)
        return _impl(*args)
    return _decode_attention_triton(*args) if use_triton else decode_attention_torch(*args)


def _impl(*args) -> torch.Tensor:
    if triton is not None and args[0].is_cuda:
        return _decode_attention_triton(*args)
    return decode_attention_torch(*args)


@torch.library.custom_op("specprefetch::decode_attention", mutates_args=("k_cache", "v_cache"))
def _decode_attention_op(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                         cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         pos: torch.Tensor, heads: int, scale: float, eps: float, window: int) -> torch.Tensor:
    return _impl(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, heads, scale, eps, window)


@_decode_attention_op.register_fake
def _(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, heads, scale, eps, window):
    _check(qkv, cos, sin, k_cache, v_cache, pos, heads)
    return qkv.new_empty(1, heads * k_cache.shape[-1])


def qkv_fusable(projs) -> bool:
    """Whether a layer's q, k and v projections can be one GEMV (gpu_graph._FusedQKV): one dtype, and a
    bias on all or none."""
    return len({p.weight.dtype for p in projs}) == 1 and len({p.bias is None for p in projs}) == 1


def attention_usable(attns, dtype: torch.dtype, norms=()) -> str | None:
    """None where the kernel covers these attention modules (transformers' Qwen3-MoE / Mixtral: q/k/v
    projections the static decoder fuses into one, Qwen3's q/k norms or none) and the layers' input norms
    (RMS norms with a weight, which the q/k/v GEMV applies: gpu_kernels.norm_gemv), else why not."""
    if dtype != torch.float16:   # (bf16 would need its own checks: Triton's CPU interpreter truncates bf16)
        return f"the fused attention computes in fp16, not {str(dtype).removeprefix('torch.')}"
    for norm in norms:
        if not is_weighted_rms_norm(norm):
            return f"the input norm {type(norm).__name__} is not an RMS norm with a weight"
    for sa in attns:
        projs = [getattr(sa, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        D = getattr(sa, "head_dim", None)
        if None in projs or D is None:
            return f"{type(sa).__name__} has no q/k/v projections and head dimension"
        if not qkv_fusable(projs):
            return "the q/k/v projections differ in dtype or bias (they are not one GEMV)"
        if D < 16 or D & (D - 1):
            return f"the fused attention needs a power-of-two head dimension of at least 16, not {D}"
        heads, kv = projs[0].out_features // D, projs[1].out_features // D
        if heads % kv:
            return f"{heads} query heads are not a multiple of {kv} K/V heads"
        if hasattr(sa, "q_norm") != hasattr(sa, "k_norm"):
            return "a q norm without a k norm (or the reverse)"
    return None


def _decode_attention_triton(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, heads: int, scale: float,
                             eps: float, window: int, chunk: int | None = None) -> torch.Tensor:
    """The kernel(s); `chunk`: the split's target positions a program (default CHUNK; split_cache; tests split
    small caches with it)."""
    _, nkv, S, D = k_cache.shape
    _check(qkv, cos, sin, k_cache, v_cache, pos, heads)
    if qkv.dtype != torch.float16 or D < 16 or D & (D - 1):
        raise ValueError(f"decode_attention: fp16 and a power-of-two head dimension of at least 16, not "
                         f"{str(qkv.dtype).removeprefix('torch.')} and {D}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("decode_attention: the K/V caches must be contiguous")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("decode_attention: both q and k norms or neither")
    groups = heads // nkv
    out = torch.empty(1, heads * D, device=qkv.device, dtype=qkv.dtype)
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    norm = q_norm is not None
    qw, kw = (q_norm.contiguous(), k_norm.contiguous()) if norm else (qkv, qkv)   # (unread without norms)
    GP = max(16, triton.next_power_of_2(groups))
    chunk, splits = split_cache(S, chunk or CHUNK)
    if splits > 1:   # the parts' maxima, denominators and unnormalised outputs (float32, the real rows)
        pm = torch.empty(nkv * splits * groups, device=qkv.device, dtype=torch.float32)
        pl, pacc = torch.empty_like(pm), torch.empty(nkv * splits * groups, D, device=qkv.device, dtype=torch.float32)
    else:
        pm = pl = pacc = out   # (unwritten)
    on = pdl(qkv)
    with _device(qkv):   # Triton launches on the current device's current stream
        _decode_attention_kernel[(nkv, splits)](qkv, qw, kw, cos, sin, k_cache, v_cache, pos, out, pm, pl, pacc, S,
                                                scale, eps, window, chunk, splits, G=groups, GP=GP, D=D, NQ=heads,
                                                NKV=nkv, QK_NORM=norm, BLOCK_S=BLOCK_S, SPLIT=splits > 1,
                                                **pdl_args(on))
        if splits > 1:
            _decode_combine_kernel[(nkv,)](pm, pl, pacc, out, splits, G=groups, GP=GP, D=D, **pdl_args(on))
    return out


def split_cache(S: int, chunk: int = CHUNK) -> tuple[int, int]:
    """A static cache of S positions -> (positions a program, programs a K/V head): one program up to twice
    `chunk` (a second kernel and a scratch round trip would cost more than the shorter scan saves), else about
    `chunk` each, the parts balanced and whole blocks of BLOCK_S."""
    if S <= 2 * chunk:
        return S, 1
    splits = -(-S // chunk)
    per = -(-S // splits)                      # balanced, then rounded up to whole blocks
    per = -(-per // BLOCK_S) * BLOCK_S
    return per, -(-S // per)
