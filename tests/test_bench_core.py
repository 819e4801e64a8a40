"""The benches' shared core: the one median and percentile (toolkit.metrics), the per-key medians and
the report writer every bench uses, and the `bench` group's three sub-commands with the report kinds
they claim (docs/benchmarks.md)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from toolkit.cli import main
from toolkit.metrics import median, percentile


def test_median_and_percentile_are_numpys_over_the_defined_values():
    xs = [3.0, None, 1.0, 10.0, 2.0]
    vals = [3.0, 1.0, 10.0, 2.0]
    assert median(xs) == round(float(np.median(vals)), 4) == 2.5
    for q in (0, 5, 50, 95, 100):  # numpy's default (linear) interpolation
        assert percentile(xs, q) == round(float(np.percentile(vals, q)), 4)
    assert percentile(xs, 50) == median(xs)
    assert median([]) is None and median([None]) is None and percentile([None, None], 95) is None
    assert median([1 / 3, 2 / 3, 1.0]) == 0.6667 and median([1 / 3], ndigits=None) == 1 / 3
    assert percentile([1.0, 2.0], 95, ndigits=None) == pytest.approx(1.95)
    assert median(x for x in (4, 1, 7)) == 4.0  # any iterable, a generator too


def test_medians_per_key_and_the_phone_summary():
    from toolkit.bench.common import medians
    from toolkit.device.phone import _stats

    runs = [{"tpot_ms": 1.0, "hit_rate": 0.5}, {"tpot_ms": 3.0, "hit_rate": None}, {"tpot_ms": 2.0, "hit_rate": 0.7}]
    assert medians(runs, ("tpot_ms", "hit_rate")) == {"tpot_ms": 2.0, "hit_rate": 0.6}
    xs = [5.0, 1.0, None, 2.0, 4.0, 3.0]
    assert _stats(xs) == {"median": 3.0, "p5": percentile(xs, 5), "p95": percentile(xs, 95)}
    assert _stats([None]) == {"median": None, "p5": None, "p95": None}


def test_every_bench_writes_its_report_through_write_report(tmp_path, monkeypatch):
    """JSON, table and plot beside it, from each bench's own `write` (one writer: toolkit.reporting)."""
    import toolkit.reporting as reporting
    from toolkit.bench import policies
    from toolkit.device import phone

    seen = []
    real = reporting.write_report

    def spy(result, path, markdown, plot):
        seen.append((markdown, plot))
        return real(result, path, markdown, plot)

    monkeypatch.setattr(reporting, "write_report", spy)  # phone.write imports it when called
    monkeypatch.setattr(policies, "write_report", spy)
    r = {"model": "m", "flash_profile": None, "direct_io": True, "rounds": 1, "prompts": ["a"], "new_tokens": 3,
         "window": 2, "threads": 1, "points": [{"pool_mib": 1.0, "policies": {"on-demand+lru": {
             "tpot_ms": 2.0, "tpot_p95_ms": 2.5, "stall_ms_per_token": 0.5, "hit_rate": 0.5,
             "mib_read_per_token": 0.1}}}]}
    md, png = policies.write(r, tmp_path / "cpu.json")
    assert json.loads((tmp_path / "cpu.json").read_text())["points"] == r["points"]
    assert "| 1 | on-demand+lru | 2.00 |" in md.read_text() and png.stat().st_size > 1000
    p = {"bundle": "b", "device": {"model": "x", "soc": "SM8750", "serial": "s"}, "pool_mib": 1.0, "prompts": ["a"],
         "repeats": 1, "max_new_tokens": 3, "pinned_cpus": [], "cache": "c", "status": "complete", "reason": None,
         "configs": ["on-demand+lru"], "failures": [], "notes": [],
         "runs": [{"config": "on-demand+lru", "tpot_ms": 1.0, "prompt": 0, "tokens": [1]}]}
    phone.finalize(p)
    md, png = phone.write(p, tmp_path / "phone.json")
    assert "| on-demand+lru | 1 | 1.0 |" in md.read_text() and png.stat().st_size > 1000
    assert [m for m, _ in seen] == [policies.markdown, phone.markdown]


def test_the_benches_import_the_one_writer_and_median():
    """No bench keeps a writer or a median of its own: each takes toolkit.reporting's write_report and
    toolkit.metrics' median (imported at module level, or inside its write)."""
    import inspect

    import android_runner.bench as native_bench
    import toolkit.metrics as metrics
    import toolkit.reporting as reporting
    from toolkit.bench import policies
    from toolkit.device import phone
    from toolkit.peers import sidebyside
    from toolkit.runtime import gpu_bench

    assert policies.write_report is reporting.write_report
    for mod in (policies, phone, sidebyside, gpu_bench, native_bench):
        src = inspect.getsource(mod)
        assert "write_report" in inspect.getsource(mod.write), mod.__name__
        assert "statistics.median" not in src and "np.median" not in src and "np.percentile" not in src, mod.__name__
        if hasattr(mod, "median"):
            assert mod.median is metrics.median, mod.__name__


def test_bench_is_a_group_of_three_sub_commands():
    r = CliRunner().invoke(main, ["bench"])
    assert "bench [OPTIONS] COMMAND [ARGS]..." in r.output, r.output
    for sub in ("cpu", "gpu", "llama.cpp"):
        assert f"\n  {sub} " in r.output, r.output
    options = {sub: {o for p in main.commands["bench"].commands[sub].params for o in p.opts}
               for sub in ("cpu", "gpu", "llama.cpp")}
    assert {"--pool-mib", "--no-simulate", "--flash-profile", "--frequency-trace"} <= options["cpu"]
    assert {"--device", "--pool-fractions", "--draft-k", "--decode", "--report-mismatches"} <= options["gpu"]
    assert {"--limits", "--threads", "--timeout", "--llama-repack", "--no-llama-bench"} <= options["llama.cpp"]
    only = {"cpu": {"--pool-mib", "--no-simulate", "--flash-profile", "--frequency-trace"},
            "gpu": {"--pool-fractions", "--draft-k", "--decode", "--report-mismatches", "--device"},
            "llama.cpp": {"--limits", "--threads", "--timeout", "--llama-repack", "--no-readaround-off",
                          "--no-llama-bench"}}
    for sub, mine in only.items():  # an option of one mode is in that sub-command only
        for other in options:
            if other != sub:
                assert not mine & options[other], (sub, other, mine & options[other])


@pytest.mark.parametrize("sub, kind", [("cpu", "bench"), ("gpu", "bench --device cuda"),
                                       ("llama.cpp", "bench --peer llama.cpp")])
def test_a_report_of_the_old_bench_modes_is_still_this_sub_commands(sub, kind, tmp_path):
    """The kinds claimed are the modes' old names: an earlier report of the same mode is this command's
    (replaced only with --overwrite), another mode's is refused even with --overwrite."""
    args = ["bench", sub, str(tmp_path / "missing-bundle")] if sub == "llama.cpp" else ["bench", sub]
    mine, other = tmp_path / "mine.json", tmp_path / "other.json"
    mine.write_text(json.dumps({"specprefetch_report": kind}))
    other.write_text(json.dumps({"specprefetch_report": "bench --device cuda" if kind == "bench" else "bench"}))
    r = CliRunner().invoke(main, [*args, "--json", str(mine)])
    assert r.exit_code == 2 and "already exists; pass --overwrite" in r.output, r.output
    r = CliRunner().invoke(main, [*args, "--json", str(other), "--overwrite"])
    assert r.exit_code == 2 and f"replaces only a `{kind}` report" in r.output, r.output
