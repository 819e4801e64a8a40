"""Reports: the routing summary of a trace (toolkit/traces/summary.py) and the export comparison
table and plot (export/report.py), on small inputs built here (no real exports)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import HELDOUT
from toolkit.traces.capture import TraceSettings, run_trace
from toolkit.traces.format import DECODE, TraceReader
from toolkit.traces.summary import expert_load, main as summary_main, routing_stats, summarize

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5_000


# -- routing summary ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_trace(tiny_models, tmp_path_factory) -> Path:
    s = TraceSettings(max_sequences=6, prompt_tokens=24, decode_tokens=5, heldout_frac=0.3, shard_tokens=60)
    return run_trace(tiny_models["qwen3_moe"], [HELDOUT], tmp_path_factory.mktemp("sum") / "t", s, progress=False)


def test_expert_load_counts_every_selection(tiny_trace):
    r = TraceReader(tiny_trace)
    k, L, E = 2, len(r.moe_layers), r.num_experts
    assert (L, E) == (3, 8)
    for split in ("train", "heldout"):
        t = r.manifest["tokens"][split]
        load = expert_load(r, split)
        assert load.shape == (L, E)
        assert (load.sum(1) == t["total"] * k).all()  # every token picks k experts in every layer
        dec = expert_load(r, split, decode_only=True)
        assert (dec.sum(1) == t["decode"] * k).all() and (dec <= load).all()
    # the same counts as a bincount over the whole split at once
    a = r.load("train", ("expert_ids", "kind"))
    for li in range(L):
        np.testing.assert_array_equal(expert_load(r, "train")[li],
                                      np.bincount(a["expert_ids"][:, li].ravel(), minlength=E))
        np.testing.assert_array_equal(expert_load(r, "train", decode_only=True)[li],
                                      np.bincount(a["expert_ids"][a["kind"] == DECODE][:, li].ravel(), minlength=E))


def test_routing_stats_by_hand():
    load = np.array([[5, 5, 5, 5],    # uniform
                     [20, 0, 0, 0],   # collapsed onto one expert
                     [6, 6, 0, 0],    # two of four
                     [0, 0, 0, 0]])   # nothing routed
    rows = routing_stats(load)
    assert [r["layer"] for r in rows] == [0, 1, 2, 3]
    assert [r["selections"] for r in rows] == [20, 20, 12, 0]
    assert [r["load_entropy"] for r in rows] == [1.0, 0.0, 0.5, 0.0]  # ln 2 / ln 4 = 0.5
    assert [r["experts_used"] for r in rows] == [1.0, 0.25, 0.5, 0.0]
    assert [r["max_load_x_uniform"] for r in rows] == [1.0, 4.0, 2.0, 0.0]
    skew = routing_stats(np.array([[3, 1]]))[0]
    p = np.array([0.75, 0.25])
    assert skew["load_entropy"] == pytest.approx(float(-(p * np.log(p)).sum() / math.log(2)), abs=1e-4)


def test_summarize_writes_stats_and_plot(tiny_trace, tmp_path, capsys):
    r = TraceReader(tiny_trace)
    rows = summarize(tiny_trace, "train", tmp_path / "out")
    assert [x["layer"] for x in rows] == [1, 2, 3]  # the model's MoE layer numbers (layer 0 is dense)
    total = r.manifest["tokens"]["train"]["total"]
    for x in rows:
        assert x["selections"] == total * 2
        assert 0.0 <= x["load_entropy"] <= 1.0 and 0.0 < x["experts_used"] <= 1.0
        assert 1.0 <= x["max_load_x_uniform"] <= 8.0
    # a random tiny model spreads its routing: far from collapsed
    assert min(x["load_entropy"] for x in rows) > 0.5
    assert json.loads((tmp_path / "out" / "routing_stats.json").read_text()) == rows
    assert _is_png(tmp_path / "out" / "expert_load.png")
    table = capsys.readouterr().out
    assert "routing of qwen3_moe" in table and str(total * 2) in table


def test_summary_command_line_default_output(tiny_trace, capsys):
    summary_main([str(tiny_trace), "--split", "heldout"])
    out = tiny_trace.parent / (tiny_trace.name + "-summary")
    rows = json.loads((out / "routing_stats.json").read_text())
    assert [x["selections"] for x in rows] == [TraceReader(tiny_trace).manifest["tokens"]["heldout"]["total"] * 2] * 3
    assert _is_png(out / "expert_load.png")
    assert "(heldout)" in capsys.readouterr().out


# -- export comparison report ------------------------------------------------------------------

def _parity(diff: float, topk: float, nxt: float) -> dict:
    return {"max_abs_logit_diff": diff, "median_logit_diff": diff / 10, "topk_agreement": topk,
            "next_token_agreement": nxt, "positions": 40, "reference": "pytorch fp32"}


@pytest.fixture
def export_result() -> dict:
    """Shaped like export.report.run's result: one accepted bundle, one refused, one QNN with the
    same-QDQ CPU comparison."""
    return {"model": "embedded", "adapter": None, "max_seq": 256, "experts": "fp16", "rows": [
        {"target": "executorch", "quant": "fp32", "status": "accepted",
         "timings_s": {"total_s": 12.5}, "graph_bytes": 3 * 2**19, "store_bytes": 30 * 2**20,
         "bundle_bytes": 32 * 2**20, "parity": _parity(0.0123, 1.0, 1.0)},
        {"target": "executorch", "quant": "w8", "status": "refused by parity", "reason": "top-k agreement 0.71",
         "parity": _parity(2.5, 0.71, 0.8)},
        {"target": "qnn", "quant": "a16w8", "status": "accepted", "timings_s": {"total_s": 80.0},
         "graph_bytes": 2**20, "store_bytes": 30 * 2**20, "bundle_bytes": 31 * 2**20,
         "parity": {**_parity(0.5, 0.9512, 0.975),
                    "htp_vs_cpu_same_qdq": _parity(0.01, 0.99999, 1.0)}},
    ]}


def test_export_markdown_table(export_result):
    from export.report import markdown

    md = markdown(export_result)
    lines = md.splitlines()
    assert lines[0] == "# Export: embedded (KV 256 tokens, experts fp16)"
    rows = [x for x in lines if x.startswith("| executorch") or x.startswith("| qnn")]
    assert rows == [
        "| executorch | fp32 | accepted | 1.50 | 32.00 | 12.5 | 0.0123 | 0.00123 | 1.0000 | 1.0000 | pytorch fp32 |",
        "| executorch | w8 | refused by parity | - | - | - | 2.5 | 0.25 | 0.7100 | 0.8000 | pytorch fp32 |",
        "| qnn | a16w8 | accepted | 1.00 | 31.00 | 80.0 | 0.5 | 0.05 | 0.9512 | 0.9750 | pytorch fp32 |",
    ]
    # every table row has as many cells as its header
    header = lines[2]
    assert all(r.count("|") == header.count("|") for r in rows)
    # the HTP-vs-CPU table lists only the row that has that comparison
    i = lines.index("| dense | max logit diff | median | top-k agree | next-token agree |")
    assert lines[i + 2:] == ["| a16w8 | 0.01 | 0.001 | 1.0000 | 1.0000 |"]


def test_export_markdown_without_htp_rows(export_result):
    from export.report import markdown

    export_result["rows"] = export_result["rows"][:2]
    md = markdown(export_result)
    assert "HTP simulator" not in md and md.count("\n| executorch") == 2


def test_export_plot_and_report_files(export_result, tmp_path):
    from export.report import markdown, plot
    from toolkit.reporting import write_report

    plot(export_result, tmp_path / "p.png")
    assert _is_png(tmp_path / "p.png")
    md, png = write_report(export_result, tmp_path / "r.json", markdown, plot)
    assert json.loads((tmp_path / "r.json").read_text()) == export_result
    assert md.read_text() == markdown(export_result) and _is_png(png)


def test_export_report_command_writes_its_files(export_result, tmp_path, monkeypatch):
    """The click entry point, with the (minutes-long) exports replaced by the hand-made result."""
    import export.report as rep

    seen = {}

    def fake_run(model, adapter, configs, max_seq, experts):
        seen.update(model=model, configs=configs, max_seq=max_seq, experts=experts)
        return export_result

    monkeypatch.setattr(rep, "run", fake_run)
    out = tmp_path / "export.json"
    r = CliRunner().invoke(rep.main, ["--configs", "executorch:fp32, qnn:a16w8", "--max-seq", "128",
                                      "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert seen == {"model": "embedded", "configs": ["executorch:fp32", "qnn:a16w8"], "max_seq": 128,
                    "experts": "fp16"}
    assert json.loads(out.read_text())["rows"][0]["status"] == "accepted"
    assert out.with_suffix(".md").read_text() in r.output and _is_png(out.with_suffix(".png"))
