"""The session's shared embedded bundle and its host runner, built in a second process.

`make test` runs on a 2-core machine and the shared ExecuTorch bundle (every layer lowered to XNNPACK,
decode and prefill methods) plus its native host runner are about two minutes of one core. conftest.py
starts this script as soon as the tests are collected and runs the tests that need neither first, so
the lowering and the compiling overlap the tests that need neither; the fixtures wait for the stage
they need (the bundle, or the bundle and the runner) and fail with its log if that stage failed.
Run by hand: `python tests/prebuild.py OUT_BUNDLE [--native] [--status FILE]`
with SPECPREFETCH_PROFILES naming the runner cache the build goes into.
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


def build_host(bundle: Path) -> Path:
    """Into the runner cache SPECPREFETCH_PROFILES names (a second call finds it there)."""
    from android_runner.build import build

    return build(bundle, "host", log=lambda s: None, tokenizer=False)


def _write(status: Path | None, st: dict) -> None:
    import json
    import os

    if status is not None:
        tmp = status.with_suffix(".tmp")
        tmp.write_text(json.dumps(st))
        os.replace(tmp, status)


def main(argv: list[str]) -> int:
    """OUT [--native] [--status FILE]: FILE gets {"bundle", "native", "error"} (each stage's outcome:
    true, false, or null while it runs), rewritten whole after each stage."""
    out = Path(argv[0])
    status = Path(argv[argv.index("--status") + 1]) if "--status" in argv else None
    native = "--native" in argv[1:]
    st = {"bundle": None, "native": None if native else False, "error": None}
    _write(status, st)
    stage = "bundle"
    try:
        export_shared(out)
        st["bundle"] = True
        _write(status, st)
        print("bundle ready", flush=True)
        if native:
            stage = "native"
            build_host(out)
            st["native"] = True
            print("host runner ready", flush=True)
    except BaseException as e:  # the waiting tests report it
        st[stage] = False
        if stage == "bundle" and native:
            st["native"] = False
        st["error"] = f"{type(e).__name__}: {e}"[:2000]
        raise
    finally:
        _write(status, st)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
