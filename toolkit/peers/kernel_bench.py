"""Per-expert micro-benchmark of the native expert kernels against llama.cpp's ggml kernels.

    python -m toolkit.peers.kernel_bench [--out runs/kernel-bench/kernels.json] [--overwrite]
        [--hidden 256] [--ffn 2048] [--batch 64] [--threads 1,2] [--llama-bin DIR] [--min-seconds 0.3]

Builds android_runner/tests/bench_kernels.cpp (with the kernels, as the kernel tests do) and runs it
at the phone bench shape: int4 and int8 experts (gate, up [FFN, H], down [H, FFN]), the previous
float32 kernels against the integer-dot ones (forward, forward_many over 8 experts, forward_batch over
T tokens), per thread count. llama.cpp's side is its own `test-backend-ops perf` (the CPU backend,
MUL_MAT with Q4_0 / Q8_0 weights and f32 activations, which ggml quantises to Q8_0 itself) on the
same three matrices from a --test-file; an expert is gate + up + down. test-backend-ops sets the CPU
backend to hardware_concurrency() / 2 threads, so the driver pins that number with a one-function
LD_PRELOAD shim (get_nprocs() = 2 x the threads wanted). Without a test-backend-ops (--llama-bin, else
the llama.cpp peer build), the llama.cpp rows are left out and the report says so.

Writes OUT (JSON), OUT.md (the table) and OUT.png (the plot); an existing report is replaced only with
--overwrite. --raw-out FILE measures only and writes the result as JSON (no matplotlib needed: for a
quiet machine without the project's environment); --from-raw FILE reports such a result.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

from toolkit.errors import SpecPrefetchError

REPO = Path(__file__).resolve().parents[2]  # toolkit/peers/ -> the repository
SRC = REPO / "android_runner" / "src"
BENCH = REPO / "android_runner" / "tests" / "bench_kernels.cpp"
GGML_OP_MUL_MAT, GGML_Q4_0, GGML_Q8_0, GGML_F32 = 29, 2, 8, 0  # ggml.h enums of the pinned llama.cpp
QK = 32
BLOCK_BYTES = {GGML_Q4_0: 18, GGML_Q8_0: 34}


def build_bench(out_dir: Path) -> Path:
    """bench_kernels compiled with the kernels and parallel.cpp (-O2, no FMA contraction)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise SpecPrefetchError("kernel bench: no C++ compiler (g++) on PATH")
    out_dir.mkdir(parents=True, exist_ok=True)
    exe = out_dir / "bench_kernels"
    srcs = sorted(SRC.glob("kernels*.cpp")) + [SRC / "parallel.cpp"]
    cmd = [cxx, "-std=c++17", "-O2", "-ffp-contract=off", "-pthread", f"-I{SRC}", str(BENCH), *map(str, srcs),
           "-o", str(exe)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SpecPrefetchError(f"kernel bench: building bench_kernels failed:\n{p.stderr[-4000:]}")
    return exe


def run_native(exe: Path, h: int, i: int, batch: int, threads: list[int], min_s: float) -> list[dict]:
    """Two passes: walking 32 experts (weights from memory, as a decode step over a layer) and one
    expert over and over (cache-resident, as llama.cpp's test-backend-ops times a matrix)."""
    rows = []
    for weights, extra in (("memory", ["--experts", "32", "--many", "8"]),
                           ("cache", ["--experts", "1", "--many", "1"])):
        cmd = [str(exe), "--hidden", str(h), "--ffn", str(i), "--batch", str(batch), "--threads",
               ",".join(map(str, threads)), "--min-seconds", str(min_s), *extra]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if p.returncode != 0:
            raise SpecPrefetchError(f"kernel bench: bench_kernels failed ({p.returncode}): {p.stderr.strip()}")
        for ln in p.stdout.splitlines():
            if ln.startswith("{"):
                r = json.loads(ln)
                if weights == "cache" and r["kernel"] == "many":
                    continue  # one expert: not a layer's worth
                rows.append({**r, "weights": weights})
    return rows


def find_test_backend_ops(given: str | None) -> Path | None:
    if given:
        p = Path(given)
        p = p / "test-backend-ops" if p.is_dir() else p
        if not p.is_file():
            raise SpecPrefetchError(f"--llama-bin {given}: no test-backend-ops there")
        return p
    try:
        from toolkit.peers.llamacpp import peers_dir  # this package's own module

        for sub in ("build-host/bin", "build-host/tests"):
            cand = peers_dir() / sub / "test-backend-ops"
            if cand.is_file():
                return cand
    except Exception:  # the peer module may be absent or changed: the native rows still stand
        return None
    return None


def _nprocs_shim(out_dir: Path) -> Path:
    """A shared object whose get_nprocs() returns $SPX_NPROCS: test-backend-ops' thread count is half of it."""
    so = out_dir / "nprocs_shim.so"
    c = out_dir / "nprocs_shim.c"
    c.write_text('#include <stdlib.h>\nint get_nprocs(void) { const char* v = getenv("SPX_NPROCS"); '
                 'return v ? atoi(v) : 2; }\nint get_nprocs_conf(void) { return get_nprocs(); }\n')
    cc = shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise SpecPrefetchError("kernel bench: no C compiler for the llama.cpp thread shim")
    p = subprocess.run([cc, "-shared", "-fPIC", "-O2", str(c), "-o", str(so)], capture_output=True, text=True)
    if p.returncode != 0:
        raise SpecPrefetchError(f"kernel bench: building the thread shim failed: {p.stderr}")
    return so


def _case_line(wtype: int, k: int, n: int, t: int) -> str:
    """One test-backend-ops --test-file line: MUL_MAT of weights [k, n] (ggml order) by f32 [k, t]."""
    bb = BLOCK_BYTES[wtype]
    a_nb = [bb, k // QK * bb, k // QK * bb * n, k // QK * bb * n]
    b_nb = [4, 4 * k, 4 * k * t, 4 * k * t]
    return " ".join(map(str, [GGML_OP_MUL_MAT, GGML_F32, n, t, 1, 1, 0, 2,
                              wtype, k, n, 1, 1, *a_nb, GGML_F32, k, t, 1, 1, *b_nb, "-"]))


def run_llama(tbo: Path, out_dir: Path, h: int, i: int, batch: int, threads: list[int]) -> list[dict]:
    if h % QK or i % QK:
        raise SpecPrefetchError(f"kernel bench: llama.cpp's Q4_0 / Q8_0 need sizes divisible by {QK}")
    shim = _nprocs_shim(out_dir)
    rows = []
    for dtype, wt in (("int4", GGML_Q4_0), ("int8", GGML_Q8_0)):
        for t in (1, batch):
            f = out_dir / f"cases-{dtype}-{t}.txt"
            f.write_text(_case_line(wt, h, i, t) + "\n" + _case_line(wt, i, h, t) + "\n")
            for th in threads:
                env = dict(os.environ, LD_PRELOAD=str(shim), SPX_NPROCS=str(2 * th))
                env["LD_LIBRARY_PATH"] = f"{tbo.parent}:{env.get('LD_LIBRARY_PATH', '')}"
                p = subprocess.run([str(tbo), "perf", "-b", "CPU", "--test-file", str(f)], capture_output=True,
                                   text=True, timeout=1800, env=env)
                us = [float(m) for m in re.findall(r"([0-9.]+) us/run", p.stdout)]
                if p.returncode != 0 or len(us) != 2:
                    raise SpecPrefetchError(f"kernel bench: test-backend-ops failed ({p.returncode}):\n"
                                            f"{(p.stdout + p.stderr)[-3000:]}")
                per_expert = 2 * us[0] + us[1]  # gate and up (the same shape), then down
                rows.append({"dtype": dtype, "isa": "ggml", "kernel": "llama.cpp" if t == 1 else "llama.cpp batch",
                             "threads": th, "H": h, "I": i, "tokens": t, "weights": "cache",
                             "us_per_expert_token": round(per_expert / t, 3),
                             "gmacs": round(3 * h * i / (per_expert / t) / 1e3, 2)})
    return rows


def markdown(r: dict) -> str:
    lines = [f"# Expert kernels: per-expert time (H {r['hidden']}, FFN {r['ffn']})", "",
             f"Machine: {r['machine']}. Native ISA: {r['isa']}. Batch rows: T = {r['batch']} tokens "
             "(time per expert per token).", "",
             "Weights: `memory` walks 32 experts (a decode layer's worth, weights from RAM); `cache` repeats one "
             "expert (cache-resident), as test-backend-ops does.", "",
             "| dtype | kernel | weights | threads | tokens | us / expert-token | GMAC/s |",
             "|---|---|---|---:|---:|---:|---:|"]
    for x in r["rows"]:
        lines.append(f"| {x['dtype']} | {x['kernel']} | {x.get('weights', '')} | {x['threads']} | {x['tokens']} | "
                     f"{x['us_per_expert_token']:.1f} | {x['gmacs']:.2f} |")
    if r.get("llama_note"):
        lines += ["", r["llama_note"]]
    return "\n".join(lines) + "\n"


def plot(r: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from toolkit.reporting import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=False)
    for ax, dtype in zip(axes, ("int4", "int8")):
        rows = [x for x in r["rows"] if x["dtype"] == dtype]
        labels = [f"{x['kernel']} ({x.get('weights', '')}, {x['threads']}t)" for x in rows]
        ax.bar(range(len(rows)), [x["us_per_expert_token"] for x in rows],
               color=["tab:gray" if x["kernel"] == "float" else "tab:orange" if "llama" in x["kernel"] else "tab:blue"
                      for x in rows])
        ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=55, ha="right")
        ax.set_ylabel("us per expert (per token for batches)")
        ax.set_title(f"{dtype} experts, H {r['hidden']} x FFN {r['ffn']}")
    save_figure(fig, png)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kernel_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/kernel-bench/kernels.json")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--llama-bin", default=None, help="test-backend-ops (or its directory)")
    ap.add_argument("--no-llama", action="store_true", help="native rows only")
    ap.add_argument("--min-seconds", type=float, default=0.3)
    ap.add_argument("--raw-out", default=None, help="measure only: write the result JSON here")
    ap.add_argument("--from-raw", default=None, help="report a result written by --raw-out")
    a = ap.parse_args(argv)
    try:
        threads = [int(t) for t in a.threads.split(",")]
        if not threads or min(threads) < 1:
            raise ValueError
    except ValueError:
        print(f"kernel_bench: error: --threads {a.threads!r}: a comma-separated list of positive integers",
              file=sys.stderr)
        return 2
    out = Path(a.raw_out or a.out)
    kind = "kernel_bench --raw-out" if a.raw_out else "kernel_bench"
    try:
        from toolkit.artifacts import REPORT_KEY, REPORT_SIBLINGS, claim_report, write_json_atomic

        if a.from_raw and Path(a.from_raw).resolve() == out.resolve():
            raise SpecPrefetchError(f"--out {out}: is the --from-raw input")
        # before any work: never an input, replaced only with --overwrite and only if it is this command's
        claim_report(out, kind=kind, overwrite=a.overwrite, inputs=[Path(a.from_raw)] if a.from_raw else [],
                     option="--raw-out" if a.raw_out else "--out", siblings=() if a.raw_out else REPORT_SIBLINGS)
        if a.from_raw:
            try:
                result = json.loads(Path(a.from_raw).read_text())
                result["rows"]
                result.pop(REPORT_KEY, None)
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise SpecPrefetchError(f"--from-raw {a.from_raw}: not a kernel bench result ({e})") from None
            from toolkit.reporting import write_report

            md, png = write_report(result, out, markdown, plot)
            print(markdown(result))
            print(f"wrote {out}, {md}, {png}")
            return 0
        work = REPO / "build" / "kernel-bench"
        exe = build_bench(work)
        rows = run_native(exe, a.hidden, a.ffn, a.batch, threads, a.min_seconds)
        note = ""
        tbo = None if a.no_llama else find_test_backend_ops(a.llama_bin)
        if tbo is None:
            note = ("llama.cpp: no test-backend-ops found (build the llama.cpp peer with LLAMA_BUILD_TESTS=ON or "
                    "pass --llama-bin): native rows only.")
        else:
            rows += run_llama(tbo, work, a.hidden, a.ffn, a.batch, threads)
            note = (f"llama.cpp: {tbo} (`test-backend-ops perf`, CPU backend, MUL_MAT Q4_0 / Q8_0 x f32; an expert = "
                    "gate + up + down, the GLU not counted).")
        order = {"float": 0, "forward": 1, "many": 2, "llama.cpp": 3, "batch": 4, "llama.cpp batch": 5}
        rows.sort(key=lambda x: (x["dtype"], order.get(x["kernel"], 9), x.get("weights", ""), x["threads"]))
        cpu = platform.processor() or platform.machine()
        try:
            cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                       if ln.startswith("model name"))
        except (OSError, StopIteration):
            pass
        result = {"hidden": a.hidden, "ffn": a.ffn, "batch": a.batch, "threads": threads,
                  "isa": next((x["isa"] for x in rows if x["isa"] != "ggml"), "?"),
                  "machine": f"{cpu}, {os.cpu_count()} CPUs", "rows": rows, "llama_note": note}
        if a.raw_out:
            out.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(out, {REPORT_KEY: kind, **result})
            print(markdown(result))
            return 0
        from toolkit.reporting import write_report

        md, png = write_report(result, out, markdown, plot)
    except SpecPrefetchError as e:
        print(f"kernel_bench: error: {e}", file=sys.stderr)
        return 1
    print(markdown(result))
    print(f"wrote {out}, {md}, {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
