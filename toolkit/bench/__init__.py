"""The benches: configurations measured side by side in one run, each the same four stages:
run (interleaved rounds, tokens checked before any time is quoted) -> table -> plot -> write.

The benches (`specprefetch ...`) and where each lives (with its engine):

    bench cpu MODEL        toolkit/bench/policies.py     the Python runner's policies, the simulator beside them
    bench gpu MODEL        toolkit/runtime/gpu_bench.py  the GPU tier's policies (docs/gpu-tier.md)
    bench llama.cpp B...   toolkit/peers/sidebyside.py   llama.cpp and the native runner under memory limits
    bench reads TRACES     toolkit/bench/reads.py        O_DIRECT reads of a store in three layouts (co-activation)
    runner bench BUNDLE    android_runner/bench.py       the native runner, all experts resident and streaming
    device bench BUNDLE    toolkit/device/phone.py       policies on a phone over adb

What they share:

- `toolkit.bench.common`: the bench prompts (`bench_prompts`), torch's compute threads
  (`torch_threads`), the simulator replaying the same prompts (`simulate_same_prompts`) and the
  per-key median over runs (`medians`);
- `toolkit.metrics.median` / `toolkit.metrics.percentile`: the one median and the one percentile of
  every report (numpy's, None values skipped, rounded to 4 places unless asked otherwise);
- `toolkit.reporting`: the one report writer, `write_report(result, R.json, markdown, plot)`: JSON,
  the Markdown table and the PNG plot beside it, all or nothing, by the command's report claim; plots
  are drawn on `figure()` and written by `save_figure`.

The median, the percentile and the writer are root modules (toolkit/metrics.py, toolkit/reporting.py)
rather than modules of this package so that every package may use them without an import cycle:
this package imports toolkit.runtime, toolkit.simulate and export, whose benches (the GPU tier's)
use them too.

Nothing heavy is imported here: `toolkit.bench.policies` loads torch and the runner.
"""
