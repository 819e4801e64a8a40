"""The session's shared embedded bundles and their host runners, built in a second process.

`make test` runs on a 2-core machine and the shared ExecuTorch bundle (every layer lowered to XNNPACK,
decode and prefill methods) plus its native host runner are about two minutes of one core. conftest.py
starts this script as soon as the tests are collected and runs the tests that need neither first, so
the lowering and the compiling overlap the tests that need neither; the fixtures wait for the stage
they need and fail with its log if that stage failed. The stages, in order: "bundle" (the ExecuTorch
bundle), "native" (its host runner), "qnn" (the embedded model's fp16 QNN bundle, HTP simulator, and
its host runner through ONNX Runtime, whose compile reuses the first runner's objects through ccache;
ONNX Runtime's headers are fetched, where the user's cache lacks them, while the rest builds), "a16w8"
(the same model's a16w8 QNN bundle, which runs on the "qnn" stage's runner).
Run by hand: `python tests/prebuild.py OUT_BUNDLE [--no-bundle] [--native] [--qnn QNN_OUT [--a16w8 A16W8_OUT]]
[--status FILE]`
with SPECPREFETCH_PROFILES naming the runner cache the builds go into.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# the export's settings for the shared bundle (conftest.py's in-process exports import them)
MAX_SEQ = 64


def export_shared(out: Path) -> Path:
    from export.bundle import ExportConfig, export_bundle
    from toolkit.models.loader import embedded_model_dir

    export_bundle(embedded_model_dir(), out, ExportConfig(target="executorch", max_seq=MAX_SEQ, progress=False))
    return out


# the shared QNN bundle: a 32-position cache (one prefill chunk size, 8), one short parity prompt
QNN_EXPORT = dict(target="qnn", max_seq=32, progress=False, parity_prompts=1, prompt_tokens=6, decode_tokens=3)


# the shared a16w8 QNN bundle (QDQ: uint16 activations, uint8 weights): calibrated on 2 prompts of 10
# tokens (so the 8-position prefill chunk has samples), its parity bounds relaxed: on this small model
# 8-bit weights move the logits past the fp32 bounds (docs/export.md: 0.58 of free-running tokens
# match); its tests compare the two engines on it, not the quantization
A16W8_EXPORT = dict(target="qnn", quant="a16w8", max_seq=32, progress=False, parity_prompts=1, prompt_tokens=10,
                    decode_tokens=2, calibration_prompts=2,
                    tolerance={"max_rel_logit_diff": 1.0, "max_median_logit_diff": 5.0, "min_topk_agreement": 0.5,
                               "min_next_token_agreement": 0.5, "min_free_token_match": 0.0})


def export_qnn(out: Path, settings: dict = QNN_EXPORT) -> Path:
    from export.bundle import ExportConfig, export_bundle
    from toolkit.models.loader import embedded_model_dir

    export_bundle(embedded_model_dir(), out, ExportConfig(**settings))
    return out


def build_host(bundle: Path) -> Path:
    """Into the runner cache SPECPREFETCH_PROFILES names (a second call finds it there)."""
    from android_runner.build import build

    return build(bundle, "host", log=lambda s: None, tokenizer=False)


def build_qnn_host(bundle: Path, profiles: Path) -> Path:
    """A qnn bundle's host runner into the runner cache of `profiles`, with the user's ONNX Runtime
    headers (user_ort_headers; SPX_ORT_INCLUDE when set), the environment left as it was."""
    import os

    saved = {k: os.environ.get(k) for k in ("SPECPREFETCH_PROFILES", "SPX_ORT_INCLUDE")}
    os.environ["SPX_ORT_INCLUDE"] = saved["SPX_ORT_INCLUDE"] or str(user_ort_headers())
    os.environ["SPECPREFETCH_PROFILES"] = str(profiles)
    try:
        return build_host(bundle)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def user_ort_headers() -> Path:
    """ONNX Runtime's C API headers from the user's runner cache (fetched there once, not once per
    test session's cache), or SPX_ORT_INCLUDE."""
    import os

    from android_runner.build import ort_headers

    if os.environ.get("SPX_ORT_INCLUDE"):
        return ort_headers(lambda s: None)
    # the user's runner cache, named without touching the environment (a thread of the prebuild calls
    # this while the main thread builds into the session's cache): conftest.py records it in
    # SPX_TEST_USER_RUNNERS before any fixture moves SPECPREFETCH_PROFILES
    user = os.environ.get("SPX_TEST_USER_RUNNERS")
    cache = Path(user) if user else Path.home() / ".cache" / "specprefetch" / "runners"
    return ort_headers(lambda s: None, cache=cache)


def _write(status: Path | None, st: dict) -> None:
    import json
    import os

    if status is not None:
        tmp = status.with_suffix(".tmp")
        tmp.write_text(json.dumps(st))
        os.replace(tmp, status)


def main(argv: list[str]) -> int:
    """OUT [--no-bundle] [--native] [--qnn QNN_OUT [--a16w8 A16W8_OUT]] [--status FILE]: FILE gets
    {"bundle", "native", "qnn", "a16w8", "error", "errors"} (each stage's outcome: true, false, or null
    while it runs; "errors" each failed stage's error, "error" the first), rewritten whole after each
    stage. "native" needs "bundle",
    "a16w8" needs "qnn" (its runner); "qnn" needs neither and is tried whatever they did. Exit status 1
    when a stage failed."""
    import os
    import threading
    import traceback

    out = Path(argv[0])
    status = Path(argv[argv.index("--status") + 1]) if "--status" in argv else None
    qnn_out = Path(argv[argv.index("--qnn") + 1]) if "--qnn" in argv else None
    # the a16w8 bundle: exported after the fp16 one; its runner is the fp16 bundle's (the same model)
    a16w8_out = Path(argv[argv.index("--a16w8") + 1]) if "--a16w8" in argv and qnn_out else None
    native = "--native" in argv[1:]
    et = "--no-bundle" not in argv
    stages = ((["bundle"] if et else []) + (["native"] if native else []) + (["qnn"] if qnn_out else [])
              + (["a16w8"] if a16w8_out else []))
    st = {"bundle": None if et else False, "native": None if native else False, "qnn": None if qnn_out else False,
          "a16w8": None if a16w8_out else False, "error": None, "errors": {}}
    _write(status, st)
    # a network wait, not a core: a thread fetches the headers while the ExecuTorch stages build (it
    # touches no environment variable); a run that fails before the qnn stage joins it still lets it
    # finish (up to 120 s, below), so apt-get cleans up its temporary files
    headers: dict = {}

    def fetch() -> None:
        try:
            headers["path"] = user_ort_headers()
        except BaseException as e:  # reported by the qnn stage
            headers["error"] = e

    fetcher = threading.Thread(target=fetch, daemon=True) if qnn_out and not os.environ.get("SPX_ORT_INCLUDE") \
        else None
    if fetcher is not None:
        fetcher.start()
    failed = False
    try:
        for stage in stages:
            need = {"native": "bundle", "a16w8": "qnn"}.get(stage)
            if need is not None and st[need] is False:  # the stage it needs failed: that error stands for it
                st[stage] = False
                st["errors"][stage] = st["errors"].get(need, f"the {need} stage failed")
                _write(status, st)
                continue
            try:
                if stage == "bundle":
                    export_shared(out)
                elif stage == "native":
                    build_host(out)
                elif stage == "a16w8":
                    export_qnn(a16w8_out, A16W8_EXPORT)
                else:
                    export_qnn(qnn_out)
                    if fetcher is not None:
                        fetcher.join()
                        if "error" in headers:
                            raise headers["error"]
                        os.environ["SPX_ORT_INCLUDE"] = str(headers["path"])
                    build_host(qnn_out)
            except Exception as e:  # the waiting tests report it; the next independent stage goes on
                failed = True
                st[stage] = False
                st["errors"][stage] = f"{type(e).__name__}: {e}"[:2000]
                st["error"] = st["error"] or f"{stage}: {st['errors'][stage]}"
                traceback.print_exc()
            else:
                st[stage] = True
                print(f"{stage} ready", flush=True)
            _write(status, st)
    except BaseException:  # interrupted: whatever had not finished failed
        for k in stages:
            if st[k] is None:
                st[k] = False
        st["error"] = st["error"] or "interrupted"
        raise
    finally:
        _write(status, st)
        if fetcher is not None:  # an apt-get under way is let finish (its temporary files cleaned)
            fetcher.join(timeout=120)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
