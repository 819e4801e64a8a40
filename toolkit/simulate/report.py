"""Sweeps of the simulator over pool size and window, as JSON, a Markdown table and plots."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from toolkit.reporting import save_figure, write_report
from toolkit.runtime.profiles import DeviceProfile
from toolkit.runtime.policy import Policy
from toolkit.simulate.replay import run_simulation

COLUMNS = ("tpot_ms", "tpot_p95_ms", "stall_ms_per_token", "hit_rate", "mib_read_per_token", "wasted_prefetch_mib")


def sweep(trace: Path, *, policies: list[Policy], profile: DeviceProfile, pools: list[float],
          windows: list[int], **kw: Any) -> dict[str, Any]:
    points = []
    for pool in pools:
        for w in windows:
            points.append(run_simulation(trace, policies=policies, profile=profile, pool_mib=pool, window=w, **kw))
    first = points[0]
    return {"profile": profile.name, "geometry": first["geometry"], "routing_from": first["routing_from"],
            "store_dtype": first["store_dtype"], "queue_depth": first["queue_depth"], "points": points}


def _defined(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def fmt(v: Any, spec: str = ".3f") -> str:
    """A figure for the table; an undefined one (null in the JSON: TPOT of sequences of one decode
    token, a rate with nothing to count) prints as n/a, never as 0."""
    return format(v, spec) if _defined(v) else "n/a"


def markdown(r: dict[str, Any]) -> str:
    g = r["geometry"]
    lines = [f"Profile `{r['profile']}`; expert slot {g['slot_bytes'] / 1024:.0f} KiB ({g['dtype']}), "
             f"{g['num_layers']} MoE layers x {g['num_experts']} experts, top-{g['top_k']}."]
    if r["routing_from"]["replayed_onto_other_geometry"]:
        lines.append(f"Routing replayed from {r['routing_from']['model']} onto the geometry of {g['source']}"
                     f" (top-{g['top_k']} kept from the trace).")
        if r["routing_from"].get("mapping"):
            lines.append(f"Mapping: {r['routing_from']['mapping']}.")
    budget = next((p["read_budget_auto"] for p in r["points"] if p.get("read_budget_auto")), None)
    if budget:
        lines.append(f"Read budget (auto): {budget['read_mibs']} MiB/s of slot reads at {budget['lanes']} lanes x "
                     f"{budget['step_ms']} ms a decode step = {budget['kib']} KiB a step"
                     + (" (raised to one slot)" if budget["raised"] else "") + ".")
    elif any(p.get("read_budget_kib") for p in r["points"]):
        lines.append(f"Read budget: {r['points'][0]['read_budget_kib']} KiB a step.")
    prefill = next((p["prefill"] for p in r["points"] if p.get("prefill")), None)
    if prefill:
        lines.append(f"TTFT: a {prefill['prompt_tokens']}-position prompt ({prefill['routing']}) from an empty pool, "
                     f"spans of {prefill['span']} positions, compute at {prefill['prefill_gflops']:g} GFLOP/s.")
    extra = " TTFT ms | prefill tok/s | prefill MiB read |" if prefill else ""
    lines += ["", "| pool MiB | pool share | window | policy | TPOT ms | p95 ms | stall ms/token | hit rate | "
                  "MiB read/token | wasted prefetch MiB | vs on-demand |" + extra,
              "|" + "---|" * (11 + (3 if prefill else 0))]
    for p in r["points"]:
        base = next((x["tpot_ms"] for x in p["results"] if x["predictor"] == "on-demand"), None)
        for x in p["results"]:
            t = x["tpot_ms"]
            ratio = f"{base / t:.3f}x" if _defined(base) and _defined(t) and t else "n/a"
            row = (f"| {p['pool_mib']:g} | {100 * p['pool_share_of_experts']:.0f}% | {p['window']} | "
                   f"{x['policy']} | {fmt(x['tpot_ms'])} | {fmt(x['tpot_p95_ms'])} | "
                   f"{fmt(x['stall_ms_per_token'])} | {fmt(x['hit_rate'])} | {fmt(x['mib_read_per_token'])} | "
                   f"{fmt(x['wasted_prefetch_mib'], '.1f')} | {ratio} |")
            if prefill:
                row += (f" {fmt(x.get('ttft_ms'), '.1f')} | {fmt(x.get('prefill_tokens_per_s'), '.1f')} | "
                        f"{fmt(x.get('prefill_mib_read'), '.1f')} |")
            lines.append(row)
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows = sorted({p["window"] for p in r["points"]})
    fig, axes = plt.subplots(1, len(windows), figsize=(5.5 * len(windows), 4), squeeze=False)
    for ax, w in zip(axes[0], windows):
        pts = sorted((p for p in r["points"] if p["window"] == w), key=lambda p: p["pool_mib"])
        for name in [x["policy"] for x in pts[0]["results"]]:
            xs = [p["pool_mib"] for p in pts]
            ys = [next(x["tpot_ms"] for x in p["results"] if x["policy"] == name) for p in pts]
            ys = [y if _defined(y) else float("nan") for y in ys]  # an undefined point is left out
            ax.plot(xs, ys, "o-", label=name)
        ax.set_xlabel("pool budget (MiB)")
        ax.set_ylabel("simulated TPOT (ms)")
        ax.set_title(f"window {w}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"TPOT vs pool size ({r['profile']})")
    save_figure(fig, path)


def write_sweep(r: dict[str, Any], json_path: Path) -> tuple[Path, Path]:
    return write_report(r, json_path, markdown, plot)
