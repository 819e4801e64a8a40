"""Export every target / precision of one model side by side: sizes, parity figures, export times.

    python -m export.report --model embedded --adapter ADAPTER --json docs/img/export.json

Each configuration is a real `export_bundle` into a scratch directory; a configuration whose
parity fails is reported as refused (that is the parity gate working, e.g. weight-only int8 on
XNNPACK). Writes JSON, a Markdown table and a PNG beside it.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import click

from toolkit.artifacts import read_json
from toolkit.errors import SpecPrefetchError
from toolkit.reporting import save_figure, write_report

CONFIGS = ("executorch:fp32", "executorch:8da8w", "executorch:8da4w", "executorch:w8",
           "qnn:fp16", "qnn:a16w8", "qnn:a8w8")


def run(model: str, adapter: Path | None, configs: list[str], max_seq: int, experts: str) -> dict[str, Any]:
    from export.bundle import ExportConfig, export_bundle

    rows = []
    root = Path(tempfile.mkdtemp(prefix="specprefetch-export-report-"))
    try:
        for c in configs:
            target, _, quant = c.partition(":")
            out = root / c.replace(":", "-")
            cfg = ExportConfig(target=target, quant=quant or None, max_seq=max_seq, experts=experts)
            row: dict[str, Any] = {"target": target, "quant": quant}
            try:
                m = export_bundle(model, out, cfg, adapter=adapter)
                parity = read_json(out / "parity.json", "parity report")
                files = m["files"]
                row.update(status="accepted", timings_s=m["timings_s"],
                           graph_bytes=sum(f["size"] for k, f in files.items() if k.startswith("graphs/")),
                           store_bytes=files["experts.spx"]["size"],
                           bundle_bytes=sum(f["size"] for f in files.values()))
            except SpecPrefetchError as e:
                rej = out.with_name(out.name + ".rejected") / "parity.json"
                if not rej.exists():
                    raise
                parity = read_json(rej, "parity report")
                row.update(status="refused by parity", reason=str(e).split(": ", 1)[-1][:200])
            row["parity"] = {k: parity[k] for k in ("max_abs_logit_diff", "median_logit_diff", "topk_agreement",
                                                    "next_token_agreement", "positions", "reference")}
            if parity.get("free_running"):
                row["parity"]["free_running"] = parity["free_running"]
            if parity.get("vs_onnx_cpu"):
                row["parity"]["htp_vs_cpu_same_qdq"] = parity["vs_onnx_cpu"]
            rows.append(row)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"model": str(model), "adapter": str(adapter) if adapter else None, "max_seq": max_seq,
            "experts": experts, "rows": rows}


def markdown(r: dict[str, Any]) -> str:
    lines = [f"# Export: {r['model']} (KV {r['max_seq']} tokens, experts {r['experts']})", "",
             ("| target | dense | status | graphs MiB | bundle MiB | export s | max logit diff | median | "
              "top-k agree | next-token agree | reference |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        p = row["parity"]
        mib = (lambda k: f"{row[k] / 2**20:.2f}" if k in row else "-")
        t = row.get("timings_s", {}).get("total_s", "-")
        lines.append(f"| {row['target']} | {row['quant']} | {row['status']} | {mib('graph_bytes')} | "
                     f"{mib('bundle_bytes')} | {t} | {p['max_abs_logit_diff']:.3g} | {p['median_logit_diff']:.3g} | "
                     f"{p['topk_agreement']:.4f} | {p['next_token_agreement']:.4f} | {p['reference']} |")
    same = [row for row in r["rows"] if "htp_vs_cpu_same_qdq" in row["parity"]]
    if same:
        lines += ["", "QDQ graphs on the HTP simulator vs the same QDQ graphs on onnxruntime's CPU provider:", "",
                  "| dense | max logit diff | median | top-k agree | next-token agree |", "|---|---|---|---|---|"]
        for row in same:
            q = row["parity"]["htp_vs_cpu_same_qdq"]
            lines.append(f"| {row['quant']} | {q['max_abs_logit_diff']:.3g} | {q['median_logit_diff']:.3g} | "
                         f"{q['topk_agreement']:.4f} | {q['next_token_agreement']:.4f} |")
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = r["rows"]
    labels = [f"{x['target']}\n{x['quant']}" for x in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    graphs = [x.get("graph_bytes", 0) / 2**20 for x in rows]
    store = [x.get("store_bytes", 0) / 2**20 for x in rows]
    a.bar(labels, graphs, label="dense graphs")
    a.bar(labels, store, bottom=graphs, label="expert store")
    a.set_ylabel("MiB")
    a.set_title("bundle size (a refused bundle is not written: no bar)")
    a.legend()
    b.bar(labels, [x["parity"]["topk_agreement"] for x in rows], label="router top-k agreement", alpha=0.7)
    b.plot(labels, [x["parity"]["next_token_agreement"] for x in rows], "ko-", label="next-token agreement")
    b.set_ylim(0, 1.05)
    b.set_title("parity vs the PyTorch reference")
    b.legend(loc="lower left")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8)
    save_figure(fig, png)


@click.command()
@click.option("--model", default="embedded", show_default=True)
@click.option("--adapter", type=click.Path(path_type=Path), default=None)
@click.option("--configs", default=",".join(CONFIGS), show_default=True, help="TARGET:QUANT,...")
@click.option("--max-seq", default=256, show_default=True)
@click.option("--experts", default="fp16", show_default=True)
@click.option("--json", "json_out", required=True, type=click.Path(path_type=Path))
def main(model, adapter, configs, max_seq, experts, json_out) -> None:
    r = run(model, adapter, [c.strip() for c in configs.split(",")], max_seq, experts)
    md, png = write_report(r, json_out, markdown, plot)
    click.echo(md.read_text())
    click.echo(f"wrote {json_out}, {md}, {png}")


if __name__ == "__main__":
    main()
