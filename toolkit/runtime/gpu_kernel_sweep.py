"""The GPU tier's fused kernels timed one by one under their tilings, at the shapes of one decoder layer of
a model (default: the 1.2 B GPU model's, hidden 1024, 16 / 4 heads of 64, 32 experts of FFN 1536, top-4):

    python -m toolkit.runtime.gpu_kernel_sweep --json sweep.json [--hidden 1024 --experts 32 --ffn 1536 ...]

- the router (`gpu_router`): the row in one block (every load at once) against the loop over blocks, with the
  resident selection (the one-kernel router at 4, 8 and 16 warps); and a router of Qwen3-30B's size (128 x 2048,
  top-8: two kernels);
- the slot GEMV (`gpu_kernels.slot_gemv`) as the experts' gate / up (SiLU(gate) x up out: `glu`, launched
  `late`) and down projections (k experts, `pre`) and as the attention's output projection (one matrix, `pre`),
  over BLOCK_O / BLOCK_N / warps / stages, and each at its default tiling as launched before those options (the
  down projection `gated`);
- the q/k/v GEMV with the expert combine and input norm (`gpu_kernels.norm_gemv`) over BLOCK_O / warps;
- each at its default tiling without programmatic dependent launch too (`gpu_kernels.PDL`), where the GPU has it.

Each row is one CUDA graph of calls, each call reading a different copy of its weights (at least 160 MB of them,
well past the L2 cache, as a decode token reads each layer's weights once), replayed: microseconds a call and
its weight bytes a second. The table is printed and written with the rows (JSON) and a plot (each kernel's
fastest tiling against its default) beside `--json` (an existing report replaced only with `--overwrite`; bad
options refused in one line before any work). Needs CUDA and Triton.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from toolkit.runtime import gpu_kernels as K
from toolkit.runtime import gpu_router as R

MIN_BYTES = 160e6   # each graph's weights: past the L2 cache (50 MB on an H100)
ANY_TILE = 2 ** 30   # a router tile every row fits: the row in one block whatever its size (register spills and all)


def _time(calls, reps: int) -> float:
    """Microseconds a call: the calls (closures) captured in one CUDA graph, replayed reps times (run once
    before the capture, compiling the kernel)."""
    def run():
        for c in calls:
            c()
    return K.graph_ms(run, reps, warm=1) * 1e3 / len(calls)


TRITON_WARPS, TRITON_STAGES = 4, 3   # Triton's launch defaults on NVIDIA GPUs (a tiling's None)


def _distinct(tilings, default: tuple) -> list[tuple]:
    """The tilings but those equal to the default's own configuration, written out (`default`: the module's
    tiling and, for the slot GEMV, Triton's NVIDIA launch defaults); the all-None row stays."""
    return [t for t in tilings if all(v is None for v in t) or t != default]


def _cuda_pdl() -> bool:
    """Whether the kernels launch with programmatic dependent launch on the current CUDA device."""
    return K.pdl_on("cuda")


def _copies(nbytes: int) -> int:
    return max(8, math.ceil(MIN_BYTES / nbytes))


def router_rows(H: int, E: int, k: int, reps: int, *, tiles=(None, 1), warps=(4, 8, 16)) -> list[dict]:
    """The router with the resident selection at [E, H], top-k: each tile (None: the default bound, gpu_router's
    one_block; 1: the loop over blocks, or where the default loops already the row in one block) and warp count
    (the one-kernel path's)."""
    n = _copies(E * H * 2)
    gw = torch.randn(n, E, H, device="cuda", dtype=torch.float16) * 0.05
    h, a = (torch.randn(1, H, device="cuda", dtype=torch.float16) for _ in range(2))
    nw = torch.ones(H, device="cuda", dtype=torch.float16)
    post = torch.empty(1, H, device="cuda", dtype=torch.float16)
    sc, idx = torch.empty(1, k, device="cuda", dtype=torch.float16), torch.empty(1, k, device="cuda", dtype=torch.long)
    slot_of, sel = torch.arange(E, device="cuda"), torch.empty(2 * k, device="cuda", dtype=torch.long)
    rows, nbytes = [], E * H * 2
    if not R.one_block(E, H, nbytes):   # (the default loops already: the alternative is the row in one block)
        tiles = tuple(ANY_TILE if t == 1 else t for t in tiles)
    for tile in tiles:
        one = R.one_block(E, H, nbytes, tile)
        for w in (warps if R.one_kernel(nbytes) else (None,)):
            calls = [lambda i=i: R._route_triton(h, a, nw, 1e-6, gw[i], True, post, sc, idx, slot_of, sel,
                                                 tile=tile, warps=w) for i in range(n)]
            us = _time(calls, reps)
            default = tile is None and w in (None, R.ROUTER_WARPS)
            rows.append({"kernel": "router", "shape": f"{E}x{H} top-{k}", "default": default,
                         "tiling": ("one block" if one else "loops") + (f", {w} warps" if w else ""),
                         "us": round(us, 2), "gbps": round(E * H * 2 / us / 1e3)})
    return rows


def slot_rows(O: int, N: int, k: int, name: str, reps: int, tilings, *, gated: bool = False, glu: bool = False,
              pre: bool = False, late: bool = False, tag: str = "") -> list[dict]:
    """k matrices [O, N] of a slot arena launched as slot_gemv's options say (gated: x is [k, 2N], SiLU(gate) x
    up taken as loaded; glu: SiLU(gate) x up of the output's halves out; pre / late: the launch under PDL), each
    tiling (BLOCK_O, BLOCK_N, warps, stages; None: the default; where `pre` holds the rows whole, BLOCK_N
    unused). x has k rows where `gated` or `pre` (a down projection's input, as the engine passes it), else one.
    `tag`: added to the shape (rows of another launch of the same matrices)."""
    n = _copies(k * O * N * 2)
    arena = torch.randn(n * k, O, N, device="cuda", dtype=torch.float16) * 0.02
    x = torch.randn(k if gated or pre else 1, 2 * N if gated else N, device="cuda", dtype=torch.float16)
    sels = [torch.arange(i * k, (i + 1) * k, device="cuda") for i in range(n)]
    shape = f"{k} x [{O}, {N}]" + "".join(f" {t}" for t, on in (("gated", gated), ("glu", glu), ("pre", pre),
                                                                  ("late", late)) if on) + tag
    rows = []
    whole = pre and K.slot_pre_whole(N)
    warps = (K.slot_pre_warps(K.SLOT_BLOCK_O * (1 << (N - 1).bit_length())) if whole else None) or TRITON_WARPS
    default = (K.SLOT_BLOCK_O, None if whole else K.SLOT_BLOCK_N, warps, TRITON_STAGES)
    for bo, bn, nw, ns in _distinct(whole_rows(tilings, N, pre), default):
        calls = [lambda s=s: K._slot_gemv_triton(arena, s, x, bo, bn, nw, gated=gated, glu=glu, pre=pre, late=late,
                                                 num_stages=ns) for s in sels]
        us = _time(calls, reps)
        rows.append({"kernel": name, "shape": shape, "default": (bo, bn, nw, ns) == (None,) * 4,
                     "tiling": "/".join("-" if v is None else str(v) for v in (bo, bn, nw, ns)),
                     "us": round(us, 2), "gbps": round(k * O * N * 2 / us / 1e3)})
    return rows


def whole_rows(tilings, N: int, pre: bool) -> list[tuple]:
    """The slot GEMV's tilings with BLOCK_N dropped (None) where `pre` holds a program's rows of N whole
    (gpu_kernels.slot_pre_whole: BLOCK_N unused), each tiling once."""
    if not pre:
        return list(tilings)
    return list(dict.fromkeys((bo, None if K.slot_pre_whole(N, bo) else bn, w, st) for bo, bn, w, st in tilings))


def norm_rows(H: int, O: int, k: int, reps: int, tilings) -> list[dict]:
    """norm_gemv at [O, H] with k expert outputs combined (BLOCK_O, warps; None: the default)."""
    n = _copies(O * H * 2)
    w = torch.randn(n, O, H, device="cuda", dtype=torch.float16) * 0.02
    h = torch.randn(1, H, device="cuda", dtype=torch.float16)
    ys = torch.randn(k, H, device="cuda", dtype=torch.float16)
    sc = torch.rand(1, k, device="cuda", dtype=torch.float16)
    perm = torch.arange(k, device="cuda")
    nw = torch.ones(H, device="cuda", dtype=torch.float16)
    rows = []
    for bo, nwarps in _distinct(tilings, (K.NORM_BLOCK_O, K.NORM_WARPS)):
        calls = [lambda i=i: K._norm_gemv_triton(h, ys, sc, perm, nw, 1e-6, w[i], block_o=bo, warps=nwarps)
                 for i in range(n)]
        us = _time(calls, reps)
        rows.append({"kernel": "norm_gemv (q/k/v)", "shape": f"[{O}, {H}], combine of {k}",
                     "default": (bo, nwarps) == (None, None),
                     "tiling": "/".join("-" if v is None else str(v) for v in (bo, nwarps)),
                     "us": round(us, 2), "gbps": round(O * H * 2 / us / 1e3)})
    return rows


SLOT_TILINGS = [(None, None, None, None)] + [(bo, bn, w, s) for bo in (2, 4, 8, 16) for bn in (512, 1024)
                                             for w in (4, 8) for s in (1, 3)]
NORM_TILINGS = [(None, None)] + [(bo, w) for bo in (2, 4, 8, 16) for w in (4, 8)]


def sweep(hidden: int, heads: int, kv_heads: int, head_dim: int, experts: int, ffn: int, k: int, reps: int,
          quick: bool = False) -> list[dict]:
    """Every kernel under its tilings (with programmatic dependent launch where the GPU has it: K.PDL), then
    each at its default tiling launched plainly (the rows marked ", PDL off")."""
    slot = SLOT_TILINGS[:3] if quick else SLOT_TILINGS
    norm = NORM_TILINGS[:3] if quick else NORM_TILINGS
    O = (heads + 2 * kv_heads) * head_dim

    def kernels(slot, norm, tiles, warps):
        rows = router_rows(hidden, experts, k, reps, tiles=tiles, warps=warps)
        if not quick:
            rows += router_rows(2048, 128, 8, reps, tiles=tiles, warps=warps)   # Qwen3-30B's router: two kernels
        # as the engine launches them (gpu_graph.FusedExpertMath, _gemv)
        rows += slot_rows(2 * ffn, hidden, k, "experts' gate / up", reps, slot, glu=True, late=True)
        rows += slot_rows(hidden, ffn, k, "experts' down", reps, slot, pre=True)
        rows += slot_rows(hidden, heads * head_dim, 1, "o_proj", reps, slot, pre=True)
        return rows + norm_rows(hidden, O, k, reps, norm)

    rows = kernels(slot, norm, (None, 1), (4, 8, 16))
    # the launches before glu / pre / late (docs/benchmarks.md section 33's), at the default tiling: gate / up's
    # 2F outputs and the down projection's SiLU on load, o_proj reading after its wait
    was = " (section 33's launch)"
    rows += slot_rows(2 * ffn, hidden, k, "experts' gate / up", reps, SLOT_TILINGS[:1], tag=was)
    rows += slot_rows(hidden, ffn, k, "experts' down", reps, SLOT_TILINGS[:1], gated=True, tag=was)
    rows += slot_rows(hidden, heads * head_dim, 1, "o_proj", reps, SLOT_TILINGS[:1], tag=was)
    if not _cuda_pdl():   # (no PDL here: every row is plain already)
        return rows
    prev, K.PDL = K.PDL, False
    try:
        plain = kernels(SLOT_TILINGS[:1], NORM_TILINGS[:1], (None,), (R.ROUTER_WARPS,))
    finally:
        K.PDL = prev
    for r in plain:
        r["tiling"] += ", PDL off"
        r["default"] = False
    return rows + plain


def _best(rows: list[dict]) -> dict:
    best = {}
    for r in rows:
        key = (r["kernel"], r["shape"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    return best


def markdown(result: dict) -> str:
    best = _best(result["rows"])
    pdl = result.get("launch_pdl")
    note = ("" if pdl is None else "; programmatic dependent launch but where a row says PDL off" if pdl
            else "; plain launches")
    out = [f"Kernel tilings on {result['device']} (us a call, weight GB/s{note})", "",
           "| kernel | shape | tiling | us | GB/s |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        tags = [t for t, on in (("default", r.get("default")), ("best", best[(r["kernel"], r["shape"])] is r)) if on]
        mark = f" ({', '.join(tags)})" if tags else ""
        out.append(f"| {r['kernel']} | {r['shape']} | {r['tiling']}{mark} | {r['us']:.2f} | {r['gbps']} |")
    return "\n".join(out) + "\n"


def plot(result: dict, path) -> None:
    from toolkit.reporting import figure, save_figure

    best = _best(result["rows"])
    default = {(r["kernel"], r["shape"]): r for r in result["rows"] if r["default"]}
    keys = list(best)
    fig, ax = figure((7, 0.5 + 0.45 * len(keys)))
    ys = range(len(keys))
    ax.barh([y + 0.2 for y in ys], [default[k]["us"] if k in default else 0 for k in keys], height=0.4,
            label="the default tiling")
    ax.barh([y - 0.2 for y in ys], [best[k]["us"] for k in keys], height=0.4, label="the fastest tiling")
    ax.set_yticks(list(ys), [f"{k[0]}\n{k[1]}" for k in keys], fontsize=7)
    ax.set_xlabel("us a call")
    ax.set_title(f"Fused kernels' tilings, {result['device']}")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m toolkit.runtime.gpu_kernel_sweep", description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="the defaults and two tilings of each kernel only")
    p.add_argument("--json", type=Path, required=True,
                   help="the rows (JSON), with the table (.md) and plot (.png) beside it; replaced only with "
                        "--overwrite")
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    from toolkit.errors import SpecPrefetchError

    try:
        for name in ("hidden", "heads", "kv_heads", "head_dim", "experts", "ffn", "top_k", "reps"):
            if getattr(a, name) < 1:
                raise SpecPrefetchError(f"--{name.replace('_', '-')} {getattr(a, name)}: must be at least 1")
        if a.top_k > a.experts or a.experts > R.MAX_EXPERTS:
            raise SpecPrefetchError(f"--top-k {a.top_k} of --experts {a.experts}: the router takes k of at most "
                                    f"{R.MAX_EXPERTS} experts, k <= experts")
        if a.heads % a.kv_heads:
            raise SpecPrefetchError(f"--heads {a.heads}: not a multiple of --kv-heads {a.kv_heads}")
        from toolkit.artifacts import claim_report
        from toolkit.reporting import write_report

        claim = claim_report(a.json, kind="gpu_kernel_sweep", overwrite=a.overwrite)   # (before any work)
        if K.triton is None or not torch.cuda.is_available():
            raise SpecPrefetchError("the sweep needs CUDA and Triton")
        K.check_pdl_setting()
        rows = sweep(a.hidden, a.heads, a.kv_heads, a.head_dim, a.experts, a.ffn, a.top_k, a.reps, a.quick)
        args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
        result = {"device": torch.cuda.get_device_name(), "launch_pdl": _cuda_pdl(),
                  "args": args, "rows": rows}
        write_report(result, a.json, markdown, plot)
        print(markdown(result))
        print("wrote " + ", ".join(str(f) for f in claim.files()))
    except SpecPrefetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        from toolkit.artifacts import release_report_claims

        release_report_claims()   # (main may run in-process: its claims end with it; nothing else holds one then)
    return 0


if __name__ == "__main__":
    sys.exit(main())
