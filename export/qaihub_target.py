"""`--target qai-hub`: the same ONNX step graphs as `--target qnn`, compiled (and profiled) by
Qualcomm AI Hub on a real Snapdragon 8 Elite device.

Each graph is submitted as a compile job with `--target_runtime precompiled_qnn_onnx`, which yields
the same EPContext-model-plus-context-binary format the qnn target writes, so the downloaded graphs
run here on the HTP simulator for the parity check, exactly as a qnn bundle does. With profiling on,
a profile job per graph runs on the device and its execution summary goes into the bundle
(graphs/hub_profile.json) and the parity report.

AI Hub needs an API token (`qai-hub configure --api_token TOKEN`, which writes
~/.qai_hub/client.ini; or QAIHUB_CLIENT_INI naming such a file) and network access to
workbench.aihub.qualcomm.com. Both are checked first, each within --hub-timeout seconds: the
client's own retry loop (six retries with backoff, ~46 s when the host is unreachable) is turned
off, so a missing token or network is a clear error within seconds.
"""
from __future__ import annotations

import configparser
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import zipfile
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

from export import qnn_target
from export.target import Target
from toolkit.errors import SpecPrefetchError

DEFAULT_API_URL = "https://workbench.aihub.qualcomm.com"
TOKEN_HELP = ("get a token at https://workbench.aihub.qualcomm.com (Account -> Settings -> API token), then run "
              "`qai-hub configure --api_token TOKEN` (writes ~/.qai_hub/client.ini) or point "
              "QAIHUB_CLIENT_INI at such a file")


def client_config_path() -> Path:
    env = os.environ.get("QAIHUB_CLIENT_INI")
    return Path(env) if env else Path.home() / ".qai_hub" / "client.ini"


def read_client_config() -> dict[str, str]:
    """The [api] section of the client config, validated like the client does, with our message."""
    path = client_config_path()
    if not path.is_file():
        raise SpecPrefetchError(f"--target qai-hub: no Qualcomm AI Hub API token ({path} not found): {TOKEN_HELP}")
    cp = configparser.ConfigParser()
    try:
        cp.read(path)
        api = dict(cp["api"])
    except (configparser.Error, KeyError) as e:
        raise SpecPrefetchError(f"{path}: not a qai-hub client config ({e}): {TOKEN_HELP}") from None
    if not api.get("api_token"):
        raise SpecPrefetchError(f"{path}: no api_token in its [api] section: {TOKEN_HELP}")
    for key in ("api_url", "web_url"):
        if not api.get(key):
            raise SpecPrefetchError(f"{path}: [api] {key} is missing (the client needs it; "
                                    f"use {DEFAULT_API_URL})")
    return api


def _deadline(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """Run fn in a daemon thread; give up (clear error) after `timeout` seconds. A daemon thread,
    so a client call stuck on the network never holds the process open after the error."""
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e

    th = threading.Thread(target=run, daemon=True, name="qai-hub-call")
    th.start()
    th.join(timeout)
    if th.is_alive():
        raise SpecPrefetchError(f"Qualcomm AI Hub: {what} did not answer within {timeout:g} s "
                                "(--hub-timeout); check the network")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _hub():
    try:
        import qai_hub as hub
        import qai_hub.util.session as session
    except ImportError as e:
        raise SpecPrefetchError(f"--target qai-hub needs the qai-hub package ({e}); run `make setup`") from None
    session.MAX_RETRIES = 0  # fail fast: our own deadline decides, not the client's backoff loop
    return hub


def _unpack(downloaded: Path, dest: Path, name: str) -> Path:
    """A downloaded precompiled_qnn_onnx model (directory, zip or .onnx) -> dest/NAME_ctx.onnx and
    its context binary beside it, renamed the way the qnn target names them."""
    src = Path(downloaded)
    tmp = Path(tempfile.mkdtemp(prefix="specprefetch-hub-"))
    try:
        if src.is_file() and zipfile.is_zipfile(src):
            with zipfile.ZipFile(src) as z:
                z.extractall(tmp)
            src = tmp
        onnx_files = [src] if src.suffix == ".onnx" else sorted(src.rglob("*.onnx"))
        if len(onnx_files) != 1:
            raise SpecPrefetchError(f"AI Hub job for {name}: expected one .onnx in the download, got "
                                    f"{[p.name for p in onnx_files]}")
        import onnx
        model = onnx.load(str(onnx_files[0]), load_external_data=False)
        ctx_nodes = [n for n in model.graph.node if n.op_type == "EPContext"]
        if not ctx_nodes:
            raise SpecPrefetchError(f"AI Hub job for {name}: the download is not a precompiled QNN ONNX model")
        dst = dest / f"{name}_ctx.onnx"
        binary = qnn_target.context_bin(dst)
        rels = set()
        for node in ctx_nodes:
            attrs = {a.name: a for a in node.attribute}
            embed = attrs.get("embed_mode")
            if embed is not None and embed.i == 0:
                rel = attrs["ep_cache_context"].s.decode(errors="replace")
                if Path(rel).is_absolute() or ".." in Path(rel).parts:
                    raise SpecPrefetchError(f"AI Hub job for {name}: the model points its context binary "
                                            f"outside the download ({rel!r}); refused")
                rels.add(rel)
                attrs["ep_cache_context"].s = binary.name.encode()
        if len(rels) > 1:
            raise SpecPrefetchError(f"AI Hub job for {name}: {len(rels)} context binaries in one model; "
                                    "this bundle format holds one per graph")
        for rel in rels:
            shutil.copy2(onnx_files[0].parent / rel, binary)
        onnx.save(model, str(dst))
        return dst
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class QaiHubTarget(Target):
    """`--target qai-hub`: the qnn target's ONNX graphs compiled (and profiled) by Qualcomm AI Hub.
    Its bundles hold the same EPContext graphs as a qnn bundle, so they are checked and run the same way."""
    NAME = "qai-hub"
    DEFAULT_QUANT = "fp16"
    QUANTS = qnn_target.QUANTS
    NEEDS_CALIBRATION = qnn_target.NEEDS_CALIBRATION

    def preflight(self, cfg, quant: str, hub=None) -> Any:
        """Token, network and device, each checked within cfg.hub_timeout_s. Returns the device.
        (`cfg.hub_client` replaces the qai_hub module: tests put a local double behind the network.)"""
        qnn_target.soc_info(cfg.soc)
        api = read_client_config()
        url = urlparse(api["api_url"])
        host = url.hostname or "workbench.aihub.qualcomm.com"
        port = url.port or (80 if url.scheme == "http" else 443)
        t = cfg.hub_timeout_s

        def reach():
            with socket.create_connection((host, port), timeout=t):
                return True

        try:
            _deadline(reach, t, f"a connection to {host}:{port}")
        except OSError as e:
            raise SpecPrefetchError(f"Qualcomm AI Hub is unreachable ({host}:{port}: {e}); --target qai-hub needs "
                                    "network access (use --target qnn to compile locally)") from None
        hub = hub or cfg.hub_client or _hub()

        def devices():
            return hub.get_devices(name=cfg.hub_device)

        try:
            found = _deadline(devices, t, "the device list")
        except SpecPrefetchError:
            raise
        except Exception as e:  # hub.UserError (bad token), hub.InternalError (connection)
            raise SpecPrefetchError("Qualcomm AI Hub refused the request "
                                    f"({type(e).__name__}: {str(e)[:300]})") from None
        if not found:
            raise SpecPrefetchError(f"--hub-device {cfg.hub_device!r}: no such device on Qualcomm AI Hub")
        return found[0]

    def build(self, steps, cfg, quant: str, out_dir: Path, *, calib, run_kw, log, scratch: Path, hub=None):
        from export.eager import TorchBackend, steps_info
        from export.target import Built

        hub = hub or cfg.hub_client or _hub()
        device = self.preflight(cfg, quant, hub=hub)
        graphs = steps.graphs("io")
        reference = TorchBackend(steps, "io", graphs=graphs)
        # QDQ models are submitted as they are: AI Hub compiles the quantization as given
        src = qnn_target.onnx_sources(steps, graphs, quant, scratch, calib=calib, run_kw=run_kw,
                                      reference=reference, log=log)
        options = "--target_runtime precompiled_qnn_onnx"
        if quant == "fp16":
            options += " --quantize_full_type float16"
        jobs, files, profiles = {}, {}, {}
        t0 = time.perf_counter()
        try:
            for name, p in src.items():
                jobs[name] = _deadline(lambda p=p, name=name: hub.submit_compile_job(
                    model=str(p), device=device, name=f"specprefetch-{steps.spec.geometry.family}-{name}",
                    options=options, retry=False), cfg.hub_timeout_s, f"submitting the compile job for {name}")
                log(f"AI Hub compile job {name}: {getattr(jobs[name], 'job_id', '?')}")
            for name, job in jobs.items():
                status = job.wait(timeout=cfg.hub_job_timeout_s)
                if not status.success:
                    raise SpecPrefetchError(f"AI Hub compile job for {name} failed: {status.message}")
                got = job.download_target_model(str(scratch / f"{name}_hub"))
                files[name] = _unpack(Path(got), out_dir, name)
            t_compile = time.perf_counter() - t0
            if cfg.hub_profile:
                pjobs = {name: hub.submit_profile_job(model=jobs[name].get_target_model(), device=device,
                                                      name=f"specprefetch-profile-{name}", retry=False)
                         for name in jobs}
                for name, pj in pjobs.items():  # a failed profile is reported, not fatal: the binaries are good
                    try:
                        prof = pj.download_profile()
                    except Exception as e:  # noqa: BLE001 - any client error
                        profiles[name] = {"job_id": getattr(pj, "job_id", None),
                                          "error": f"{type(e).__name__}: {e}"[:300]}
                        continue
                    summ = prof.get("execution_summary", {}) if isinstance(prof, dict) else {}
                    profiles[name] = {"job_id": getattr(pj, "job_id", None),
                                      "estimated_inference_time_us": summ.get("estimated_inference_time"),
                                      "peak_memory_bytes": summ.get("estimated_inference_peak_memory")}
                    if not summ:
                        profiles[name]["error"] = "the profile job returned no execution summary (failed?)"
                (out_dir / "hub_profile.json").write_text(json.dumps(profiles, indent=1))
        except SpecPrefetchError:
            raise
        except Exception as e:
            raise SpecPrefetchError(f"Qualcomm AI Hub: {type(e).__name__}: {str(e)[:300]}") from None
        info = steps_info(steps)
        soc = cfg.soc.upper()
        return Built(
            graphs={"format": "qnn-context-binary", "path": "qai-hub", "soc": soc,
                    "htp_arch": qnn_target.soc_info(soc)[1], "device": cfg.hub_device,
                    "files": {n: str(p.relative_to(out_dir.parent)) for n, p in files.items()},
                    "binaries": {n: str(qnn_target.context_bin(p).relative_to(out_dir.parent))
                                 for n, p in files.items()},
                    "jobs": {n: getattr(j, "job_id", None) for n, j in jobs.items()},
                    "compile_s": round(t_compile, 2)},
            reference=reference, reference_label="pytorch (fp32)",
            backend_label=f"qai-hub {cfg.hub_device} binaries on the qnn-htp-simulator", kv_mode="io", soc=soc,
            expert_precision=quant, make_backend=lambda: qnn_target.QnnBackend(files, info),
            extra=lambda refs, gots, kw: {"vs_device_profile": profiles} if profiles else {})

    def check_graphs(self, path: Path, m: dict) -> dict[str, Any]:
        return qnn_target.QnnTarget().check_graphs(path, m)

    def open_backend(self, path: Path, m: dict) -> qnn_target.QnnBackend:
        return qnn_target.QnnTarget().open_backend(path, m)
