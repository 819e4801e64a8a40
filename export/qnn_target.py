"""`--target qnn`: the step graphs as QNN context binaries for a Snapdragon SoC's Hexagon HTP.

Path (default, `--qnn-path ort`): each graph is exported to ONNX with static shapes (KV cache as
inputs, see export.graphs), quantized to QDQ with onnxruntime's QNN quantization config (a16w8:
uint16 activations, uint8 weights; a8w8) or left fp32 for the HTP to run in fp16 (`fp16`), then
compiled offline by onnxruntime-qnn's QNN execution provider into an EPContext model
(`NAME_ctx.onnx`) plus its context binary (`NAME_ctx_qnn.bin`) for the chosen SoC (SM8750 = Snapdragon
8 Elite, HTP v79, by default). Every node must land on the HTP: CPU fallback is disabled, so an
unsupported op is an error naming the graph. Parity runs the compiled binaries here, on the
x86 HTP simulator that onnxruntime-qnn ships (libQnnHtp.so), against the PyTorch graphs.

`--qnn-path executorch` lowers through ExecuTorch's Qualcomm partitioner instead; that needs a
QAIRT SDK (QNN_SDK_ROOT) of the version the installed executorch was built against.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from export.eager import run_sequence
from export.executorch_target import prefill_chunk_sizes
from export.target import Target, bundle_file
from toolkit.errors import SpecPrefetchError
from toolkit.runtime.backend import Backend, parse_prefill_name

QUANTS = ("fp16", "a16w8", "a8w8")
NEEDS_CALIBRATION = {"a16w8": True, "a8w8": True}
# SoC -> (marketing name, HTP arch, the SoC id QNN writes into ep_compatibility_info)
SOCS = {"SM8750": ("Snapdragon 8 Elite", 79, 69), "SM8650": ("Snapdragon 8 Gen 3", 75, 57),
        "SM8550": ("Snapdragon 8 Gen 2", 73, 43)}
QAIRT_FOR_EXECUTORCH = "2.37"

INPUT_NAMES = {"embed": ["token"], "head": ["hidden"],
               "layer": ["hidden", "pos_onehot", "mask", "k_past", "v_past"]}
# A vision-language bundle's vision tower (export/vision.py) runs on the HTP in fp16 whatever --quant says:
# calibration prompts are text, so a QDQ tower would have no samples to be calibrated on
FP16_GRAPHS = ("vision",)


def soc_info(soc: str) -> tuple[str, int, int]:
    key = soc.upper()
    if key not in SOCS:
        raise SpecPrefetchError(f"--soc {soc!r}: choose from {', '.join(SOCS)} "
                                f"({', '.join(f'{k} = {v[0]}' for k, v in SOCS.items())})")
    return SOCS[key]


def _ort_qnn():
    """Register onnxruntime-qnn's plugin execution provider once; returns (ort, its devices)."""
    try:
        import onnxruntime as ort
        import onnxruntime_qnn as oq
    except ImportError as e:
        raise SpecPrefetchError(f"--target qnn needs onnxruntime-qnn ({e}); run `make setup`") from None
    if not any(d.ep_name == oq.EP_NAME for d in ort.get_ep_devices()):
        ort.register_execution_provider_library(oq.EP_NAME, oq.get_library_path())
    devs = [d for d in ort.get_ep_devices() if d.ep_name == oq.EP_NAME]
    if not devs:
        raise SpecPrefetchError("onnxruntime-qnn registered no QNN device (HTP backend library missing?)")
    return ort, devs


def _session_options(provider: dict[str, Any], config: dict[str, Any] | None = None):
    ort, devs = _ort_qnn()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    for k, v in {"session.disable_cpu_ep_fallback": "1", **(config or {})}.items():
        so.add_session_config_entry(k, str(v))
    so.add_provider_for_devices(devs, {"backend_type": "htp", **{k: str(v) for k, v in provider.items()}})
    return so


def qnn_session(path: Path, provider: dict[str, Any] | None = None):
    """A session running a compiled EPContext model on the HTP backend (the x86 simulator here)."""
    ort, _ = _ort_qnn()
    try:
        return ort.InferenceSession(str(path), sess_options=_session_options(provider or {}))
    except Exception as e:  # onnxruntime raises its own types; name the file
        raise SpecPrefetchError(f"{path}: QNN could not load it ({str(e).strip()[:300]})") from None


def graph_io_names(name: str, steps) -> tuple[list[str], list[str]]:
    g = steps.spec.geometry
    if name == "expert":
        return ["x"] + [m.role for m in steps.spec.family.expert_matrices(g)], ["y"]
    if name == "embed":
        return INPUT_NAMES["embed"], ["hidden"]
    if name == "head":
        return INPUT_NAMES["head"], ["logits"]
    if name == "vision":
        return ["pixel_values"], ["image_embeds", "deepstack"]
    chunk = parse_prefill_name(name)  # prefill_T_layer_N: the same inputs and outputs over T positions
    layer = chunk[1] if chunk is not None else int(name.split("_")[1])
    outs = ["h"]
    if layer in g.moe_layers:
        outs += ["x", "router_logits"]
        if g.moe_layers.index(layer) in steps.adapter_heads:
            outs.append("preds")
    # M-RoPE layers (Qwen3-VL) take each position's (t, h, w) rotary positions last, one-hot [3, T, S]
    rope = ["rope_onehot"] if steps.mrope_axes is not None else []
    return INPUT_NAMES["layer"] + rope, outs + ["k_new", "v_new"]


def export_onnx(steps, graphs: dict[str, torch.nn.Module], out_dir: Path,
                log: Callable[[str], None]) -> dict[str, Path]:
    """Each graph to `out_dir/NAME.onnx` (static shapes, opset 17, TorchScript exporter)."""
    import warnings

    from export.graphs import exportable_family

    paths = {}
    for i, (name, mod) in enumerate(graphs.items()):
        log(f"ONNX export {i + 1}/{len(graphs)}: {name}")
        ins, outs = graph_io_names(name, steps)
        p = out_dir / f"{name}.onnx"
        try:
            with torch.no_grad(), exportable_family(steps.spec.family), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(mod, steps.example_inputs(name, "io"), str(p), input_names=ins,
                                  output_names=outs, opset_version=17, dynamo=False)
        except Exception as e:
            raise SpecPrefetchError(f"graph {name}: ONNX export failed ({type(e).__name__}: {str(e)[:300]})") from None
        paths[name] = fold_constants(p)
    log(f"ONNX: {len(paths)} graphs")
    return paths


def fold_constants(path: Path) -> Path:
    """onnxruntime's basic graph optimisations (constant folding of the exporter's shape
    arithmetic), so every Reshape / Expand has a constant shape, as the HTP requires."""
    import onnxruntime as ort

    out = path.with_name(path.stem + "_folded.onnx")
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.optimized_model_filepath = str(out)
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    square_to_mul(out)
    return out


def square_to_mul(path: Path) -> int:
    """Rewrite Pow(x, 2) as Mul(x, x) in place; returns how many. The HTP's fp16 Pow is wrong for
    some inputs (found on the simulator: one RMSNorm's x**2 off by 4 at |x| < 0.5, turning the
    norm's output into 3e4), and every RMSNorm the exporter writes squares with Pow."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    consts[n.output[0]] = numpy_helper.to_array(a.t)
    count = 0
    for n in model.graph.node:
        if n.op_type == "Pow" and n.input[1] in consts and consts[n.input[1]].size == 1 \
                and float(consts[n.input[1]].reshape(())) == 2.0:
            base = n.input[0]
            n.op_type = "Mul"
            del n.input[:]
            n.input.extend([base, base])
            count += 1
    if count:
        onnx.save(model, str(path))
    return count


class _Reader:
    """onnxruntime CalibrationDataReader over recorded graph inputs."""

    def __init__(self, names: list[str], samples: list[list[torch.Tensor]]):
        self.it = iter([{n: t.numpy() for n, t in zip(names, s)} for s in samples])

    def get_next(self):
        return next(self.it, None)


def quantize_qdq(paths: dict[str, Path], samples: dict[str, list[list[torch.Tensor]]], quant: str,
                 steps, out_dir: Path) -> dict[str, Path]:
    from onnxruntime.quantization import QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config, qnn_preprocess_model

    act = {"a16w8": QuantType.QUInt16, "a8w8": QuantType.QUInt8}[quant]
    out = {}
    for name, src in paths.items():
        if name in FP16_GRAPHS:
            out[name] = src
            continue
        if not samples.get(name):
            raise SpecPrefetchError(f"graph {name}: no calibration samples recorded")
        pre = out_dir / f"{name}_pre.onnx"
        if not qnn_preprocess_model(str(src), str(pre)):
            pre = src
        ins, _ = graph_io_names(name, steps)
        cfg = get_qnn_qdq_config(str(pre), _Reader(ins, samples[name]), activation_type=act,
                                 weight_type=QuantType.QUInt8)
        dst = out_dir / f"{name}_{quant}.onnx"
        quantize(str(pre), str(dst), cfg)
        out[name] = dst
    return out


def compile_context(src: Path, dst: Path, soc: str, fp16: bool) -> None:
    """Compile one ONNX graph into DST (_ctx.onnx) + DST_qnn.bin for `soc`, all nodes on the HTP."""
    ort, _ = _ort_qnn()
    provider = {"soc_model": soc.upper(), "enable_htp_prepare_only": 1}
    if fp16:
        provider["enable_htp_fp16_precision"] = 1
    try:
        mc = ort.ModelCompiler(_session_options(provider), str(src), embed_compiled_data_into_model=False,
                               flags=ort.OrtCompileApiFlags.ERROR_IF_NO_NODES_COMPILED)
        mc.compile_to_file(str(dst))
    except Exception as e:
        raise SpecPrefetchError(f"graph {src.stem}: QNN compile for {soc} failed ({str(e).strip()[:400]})") from None
    if not context_bin(dst).exists():
        raise SpecPrefetchError(f"graph {src.stem}: QNN compile wrote no context binary beside {dst}")


def context_bin(ctx: Path) -> Path:
    return ctx.with_name(ctx.name.replace(".onnx", "_qnn.bin"))


class RecordingBackend(Backend):
    """Wraps a backend and keeps graph call inputs as QDQ calibration samples: up to `limit` calls
    per dense graph, and for the expert graph up to `per_expert` calls of every distinct expert
    (told apart by a fingerprint of their weights: the runner decodes them afresh from the pool on
    every call), so every expert's weight range shapes the calibration, not just the first token's."""

    def __init__(self, inner, limit_per_graph: int = 256, per_expert: int = 2):
        self.inner, self.limit, self.per_expert = inner, limit_per_graph, per_expert
        self.samples: dict[str, list[list[torch.Tensor]]] = {}
        self.expert_seen: dict[tuple, int] = {}
        self.expert_weights: dict[tuple, list[torch.Tensor]] = {}
        self.kv_mode, self.kv = inner.kv_mode, inner.kv  # the inner backend's cache
        self.mrope, self.rope_rows, self.rope_delta = inner.mrope, None, 0  # M-RoPE inputs: Backend.layer's

    def call(self, name, inputs):
        lst = self.samples.setdefault(name, [])
        if name == "expert":
            w = inputs[1].reshape(-1)
            key = (tuple(inputs[1].shape), float(w[:64].double().sum()), float(w[-64:].double().sum()))
            if self.expert_seen.get(key, 0) < self.per_expert:
                self.expert_seen[key] = self.expert_seen.get(key, 0) + 1
                # weights kept once per expert, by reference (the runner decodes fresh tensors per call)
                mats = self.expert_weights.setdefault(key, list(inputs[1:]))
                lst.append([inputs[0].detach().clone(), *mats])
        elif len(lst) < self.limit:
            lst.append([t.detach().clone() for t in inputs])
        return self.inner.call(name, inputs)

    def reset(self):
        self.inner.reset()
        self.rope_rows, self.rope_delta = None, 0

    def method_names(self) -> tuple[str, ...]:
        return self.inner.method_names()  # the inner's prefill chunks too: their graphs get samples


EMBEDDING_FILE = "embedding.safetensors"


def write_embedding(steps, out_dir: Path) -> dict[str, Any]:
    """The token embedding as a float16 table [V, H] (`weight`) in out_dir/embedding.safetensors: a
    QNN bundle's runner looks a token's row up on the CPU rather than crossing to the HTP for it. An
    embedding graph would be one crossing a position (0.3-0.5 ms on a phone), and a graph per prefill
    chunk size would hold another copy of the table in HTP memory each (600 MiB at Qwen3-30B-A3B's
    151936 x 2048); on the CPU only the rows a prompt touches are read. float16 is what an fp16 bundle's
    graphs hold and take their inputs at, so there the layers see what an embed graph gave them; a QDQ
    bundle's layers quantize the rows at their input (an embed graph gave 8-bit weights' rows: export
    parity measures the difference). Returns the manifest entry."""
    from safetensors.torch import save_file

    w = steps.model.get_input_embeddings().weight.detach().to(torch.float16).contiguous()
    if not torch.isfinite(w).all():
        raise SpecPrefetchError("the token embedding does not fit float16 (values past 65504): no QNN bundle")
    save_file({"weight": w}, str(out_dir / EMBEDDING_FILE))
    return {"file": str((out_dir / EMBEDDING_FILE).relative_to(out_dir.parent)), "dtype": "float16",
            "shape": list(w.shape)}


class EmbeddingTable:
    """A bundle's embedding table (write_embedding), its rows read on demand."""

    def __init__(self, path: Path, shape: tuple[int, int] | None = None):
        from safetensors import safe_open

        try:
            self._f = safe_open(str(path), framework="numpy")
            self._w = self._f.get_slice("weight")
            got = tuple(self._w.get_shape())
            dtype = self._w.get_dtype()
        except Exception as e:  # safetensors raises its own types for a damaged file
            raise SpecPrefetchError(f"{path}: not a readable embedding table ({str(e)[:200]})") from None
        if dtype != "F16" or len(got) != 2 or (shape is not None and got != tuple(shape)):
            raise SpecPrefetchError(f"{path}: weight is {dtype} {list(got)}; a float16 table "
                                    f"{list(shape) if shape else '[vocab, hidden]'} expected")
        self.path, self.vocab = path, got[0]

    def lookup(self, token: torch.Tensor) -> torch.Tensor:
        """token int64 [1, T] -> hidden float32 [1, T, H]."""
        ids = [int(t) for t in token.reshape(-1)]
        if any(not 0 <= t < self.vocab for t in ids):
            raise SpecPrefetchError(f"{self.path}: token id outside 0..{self.vocab - 1}")
        rows = np.stack([self._w[t:t + 1][0] for t in ids])
        return torch.from_numpy(rows.astype(np.float32)).reshape(1, len(ids), -1)


class QnnBackend(Backend):
    """Runs a bundle's context binaries with onnxruntime-qnn (HTP; the simulator on x86).

    `cpu_expert`: when given, the `expert` graph is not loaded and every routed expert is computed
    on the CPU by it (float32, the family's expert function): how a bundle runs (`run`, both engines),
    since each CPU-HTP crossing costs ~0.3-0.5 ms on a phone and a decode token routes through
    dozens of experts. Export parity runs the expert graph on the HTP too (cpu_expert None)."""
    label = "qnn-htp"
    kv_mode = "io"

    def __init__(self, files: dict[str, Path], info: dict[str, Any], provider: dict[str, Any] | None = None,
                 cpu_expert: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
                 embedding: EmbeddingTable | None = None):
        super().__init__(info)
        self.cpu_expert = cpu_expert
        self.embedding = embedding  # the CPU's lookup of `embed` (a bundle without an embed graph)
        self.sessions = {n: self._session(p, provider) for n, p in files.items()
                         if not (cpu_expert is not None and n == "expert")}
        self.names = {n: [i.name for i in s.get_inputs()] for n, s in self.sessions.items()}

    def _session(self, path, provider):
        return qnn_session(path, provider)

    def method_names(self) -> tuple[str, ...]:
        return tuple(self.sessions)  # the prefill_T_layer_N graphs among them feed prompts in chunks

    def call(self, name, inputs):
        if name == "expert" and self.cpu_expert is not None:
            with torch.no_grad():
                return [self.cpu_expert(list(inputs))]
        if name == "embed" and self.embedding is not None:
            return [self.embedding.lookup(inputs[0])]
        feeds = {n: t.detach().numpy() for n, t in zip(self.names[name], inputs)}
        try:
            outs = self.sessions[name].run(None, feeds)
        except Exception as e:  # onnxruntime's own exception types
            raise SpecPrefetchError(f"graph {name}: {self.label} run failed ({str(e).strip()[:300]})") from None
        return [torch.from_numpy(np.asarray(o)) for o in outs]


class OrtCpuBackend(QnnBackend):
    """The same (QDQ) ONNX graphs on onnxruntime's CPU provider: the same-quantization reference."""
    label = "onnxruntime-cpu"

    def _session(self, path, provider):
        import onnxruntime as ort
        return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def onnx_sources(steps, graphs, quant: str, scratch: Path, *, calib, run_kw, reference, log) -> dict[str, Path]:
    """The graphs as ONNX files ready to compile: exported and folded, then for QDQ precisions
    quantized with calibration samples recorded from the reference run over `calib` prompts."""
    src = export_onnx(steps, graphs, scratch, log)
    if quant in NEEDS_CALIBRATION:
        rec = RecordingBackend(reference)
        for p in calib:
            run_sequence(rec, p, **run_kw)
        t0 = time.perf_counter()
        src = quantize_qdq(src, rec.samples, quant, steps, scratch)
        log(f"QDQ {quant}: calibrated on {len(calib)} prompts in {time.perf_counter() - t0:.1f} s")
    return src


def _build_executorch_qnn(steps, cfg, quant, out_dir, log):
    """ExecuTorch's Qualcomm partitioner (needs QAIRT at QNN_SDK_ROOT; checked in preflight)."""
    try:
        from executorch.backends.qualcomm.partition.qnn_partitioner import QnnPartitioner
        from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
        from executorch.backends.qualcomm.utils.utils import (generate_htp_compiler_spec,
                                                              generate_qnn_executorch_compiler_spec)
    except Exception as e:
        raise SpecPrefetchError(f"--qnn-path executorch: ExecuTorch's Qualcomm backend is not usable here "
                                f"({type(e).__name__}: {e}); it needs executorch built with QNN and QAIRT "
                                f"{QAIRT_FOR_EXECUTORCH} at QNN_SDK_ROOT") from None
    from export.executorch_target import lower_program

    if quant != "fp16":
        raise SpecPrefetchError(f"--qnn-path executorch --quant {quant}: this path offers fp16 only "
                                "(QDQ quantization goes through --qnn-path ort)")
    chip = getattr(QcomChipset, cfg.soc.upper())
    spec = generate_qnn_executorch_compiler_spec(soc_model=chip,
                                                 backend_options=generate_htp_compiler_spec(use_fp16=quant == "fp16"))
    return lower_program(steps, cfg, quant, out_dir, log, partitioner=QnnPartitioner(spec),
                         label=f"executorch-qnn {cfg.soc.upper()}")


class QnnTarget(Target):
    """`--target qnn`: QNN context binaries for a Snapdragon SoC's HTP, compiled here."""
    NAME = "qnn"
    DEFAULT_QUANT = "fp16"
    QUANTS = QUANTS                        # the module's constants (onnx_sources reads them too)
    NEEDS_CALIBRATION = NEEDS_CALIBRATION
    VISION_PRECISION = "fp16"  # FP16_GRAPHS; the executorch path is fp16 only

    def preflight(self, cfg, quant: str) -> None:
        soc_info(cfg.soc)
        if cfg.qnn_path == "executorch":
            sdk = os.environ.get("QNN_SDK_ROOT")
            if not sdk or not Path(sdk).is_dir():
                raise SpecPrefetchError(
                    "--qnn-path executorch lowers with ExecuTorch's Qualcomm backend, which needs the Qualcomm "
                    f"AI Runtime (QAIRT) SDK {QAIRT_FOR_EXECUTORCH}: install it and set QNN_SDK_ROOT to its "
                    "directory (and LD_LIBRARY_PATH to $QNN_SDK_ROOT/lib/x86_64-linux-clang). "
                    "Or use --qnn-path ort (onnxruntime-qnn, no SDK needed).")
            return
        if cfg.qnn_path != "ort":
            raise SpecPrefetchError(f"--qnn-path {cfg.qnn_path!r}: choose ort or executorch")
        _ort_qnn()

    def build(self, steps, cfg, quant: str, out_dir: Path, *, calib: list[list[int]], run_kw: dict, log,
              scratch: Path):
        from export.eager import TorchBackend, steps_info
        from export.parity import compare
        from export.target import Built

        if cfg.qnn_path == "executorch":
            return _build_executorch_qnn(steps, cfg, quant, out_dir, log)
        soc = cfg.soc.upper()
        # fixed-size prefill graphs (QNN has no dynamic shapes): T positions per HTP call; a QDQ graph
        # needs calibration samples, which only chunks no longer than the calibration prompts get
        steps.prefill_chunks = tuple(T for T in prefill_chunk_sizes(steps.max_seq)
                                     if quant not in NEEDS_CALIBRATION or T < cfg.prompt_tokens)
        if steps.prefill_chunks != prefill_chunk_sizes(steps.max_seq):
            log(f"QDQ {quant}: prefill chunks {list(steps.prefill_chunks)} (larger ones need calibration prompts "
                f"longer than --prompt-tokens {cfg.prompt_tokens})")
        graphs = steps.graphs("io")
        reference = TorchBackend(steps, "io", graphs=graphs)
        # the embedding is a CPU lookup (write_embedding), not an HTP graph
        embedding = write_embedding(steps, out_dir)
        table = EmbeddingTable(out_dir.parent / embedding["file"], tuple(embedding["shape"]))
        t0 = time.perf_counter()
        src = onnx_sources(steps, {n: g for n, g in graphs.items() if n != "embed"}, quant, scratch, calib=calib,
                           run_kw=run_kw, reference=reference, log=log)
        t_onnx = time.perf_counter() - t0
        files = {}
        t1 = time.perf_counter()
        from rich.progress import track
        for name, p in track(list(src.items()), description=f"QNN compile {soc}", disable=not cfg.progress):
            dst = out_dir / f"{name}_ctx.onnx"
            compile_context(p, dst, soc, fp16=(quant == "fp16" or name in FP16_GRAPHS))
            files[name] = dst
        t_compile = time.perf_counter() - t1
        info = steps_info(steps)

        def extra(refs, gots, kw):
            out = {"vs_onnx_cpu": None}
            if quant in NEEDS_CALIBRATION:  # the same QDQ graphs on the CPU: the same-quantization reference
                cpu = OrtCpuBackend(src, info, embedding=table)
                cpu_recs = [run_sequence(cpu, r.tokens, force_ids=r.ids, **kw) for r in refs]  # as `gots`
                out["vs_onnx_cpu"] = {k: round(v, 5) for k, v in compare(cpu_recs, gots).items()}
            return out

        rel = {n: str(p.relative_to(out_dir.parent)) for n, p in files.items()}
        return Built(
            graphs={"format": "qnn-context-binary", "path": "ort", "soc": soc, "htp_arch": soc_info(soc)[1],
                    "prefill_chunks": list(steps.prefill_chunks), "files": rel, "embedding": embedding,
                    "binaries": {n: str(context_bin(p).relative_to(out_dir.parent)) for n, p in files.items()},
                    "onnx_export_s": round(t_onnx, 2), "compile_s": round(t_compile, 2)},
            reference=reference, reference_label="pytorch (fp32)", backend_label=f"qnn-htp-simulator {soc}",
            kv_mode="io", soc=soc, expert_precision=quant,
            make_backend=lambda: QnnBackend(files, info, embedding=table), extra=extra)

    # -- inspect ---------------------------------------------------------------------------

    def check_graphs(self, path: Path, m: dict) -> dict[str, Any]:
        """Each compiled graph: an EPContext model whose binary exists, whose SoC is the manifest's,
        and whose inputs and outputs match the manifest's signatures; then QNN loads it."""
        import onnx

        g = m["graphs"]
        sigs = dict(g["signatures"])
        soc = m["soc"]
        want_id = SOCS.get(soc, (None, None, None))[2]
        emb = embedding_of(path, m)  # the CPU's lookup table stands for the embed graph
        if emb is not None:
            sigs.pop("embed", None)
        if set(g["files"]) != set(sigs):
            raise SpecPrefetchError(f"{path / 'manifest.json'}: graph files for {sorted(g['files'])}, "
                                    f"signatures for {sorted(sigs)}")
        out = {}
        for name, rel in g["files"].items():
            p = bundle_file(path, m["files"], rel, f"graph {name}")
            bundle_file(path, m["files"], g["binaries"][name], f"context binary of {name}")
            if context_bin(p) != path / g["binaries"][name]:
                raise SpecPrefetchError(f"{path / 'manifest.json'}: graph {name}'s binary is not beside its model")
            try:
                model = onnx.load(str(p), load_external_data=False)
            except Exception as e:
                raise SpecPrefetchError(f"{p}: not a readable ONNX model ({e})") from None
            ctx = [n for n in model.graph.node if n.op_type == "EPContext"]
            if not ctx:
                raise SpecPrefetchError(f"{p}: no EPContext node (not a compiled QNN graph)")
            meta = {q.key: q.value for q in model.metadata_props}
            compat = meta.get("ep_compatibility_info.QNNExecutionProvider", "")
            fields = compat.split(":")
            if want_id is not None and (len(fields) <= 5 or fields[5] != str(want_id)):
                got = fields[5] if len(fields) > 5 else "unknown (no ep_compatibility_info)"
                raise SpecPrefetchError(f"{p}: compiled for SoC id {got}, the manifest says {soc} (id {want_id})")
            for node in ctx:
                for a in node.attribute:
                    if a.name == "ep_cache_context" and a.s.decode(errors="replace") != context_bin(p).name:
                        raise SpecPrefetchError(f"{p}: its EPContext node points at {a.s[:80]!r}, "
                                                f"not {context_bin(p).name}")
            shapes_in = [[d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input]
            shapes_out = [[d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output]
            sig = sigs.get(name)
            if sig is None:
                raise SpecPrefetchError(f"{p}: graph {name!r} has no signature in the manifest")
            if shapes_in != [s for s, _ in sig["inputs"]] or shapes_out != [s for s, _ in sig["outputs"]]:
                raise SpecPrefetchError(f"{p}: inputs {shapes_in} / outputs {shapes_out} do not match the manifest's "
                                        f"signature {sig}")
            qnn_session(p)  # QNN parses the context binary (the simulator here, the HTP on a phone)
            out[name] = {"inputs": len(shapes_in), "outputs": len(shapes_out), "compat": compat,
                         "bytes": p.stat().st_size + context_bin(p).stat().st_size}
        if emb is not None:
            out["embed"] = {"inputs": 1, "outputs": 1, "compat": "cpu lookup", "bytes": emb.path.stat().st_size}
        return out

    def open_backend(self, path: Path, m: dict) -> QnnBackend:
        from toolkit.runtime.backend import CacheSpec

        info = {"cache_specs": [CacheSpec(tuple(x["k"]), tuple(x["v"])) for x in m["kv"]["layers"]],
                "windows": [x["window"] for x in m["kv"]["layers"]], "max_seq": m["kv"]["max_seq"],
                "mrope": m["kv"].get("rope") == "mrope"}
        return QnnBackend({n: path / rel for n, rel in m["graphs"]["files"].items()}, info,
                          cpu_expert=cpu_expert_of(path, m), embedding=embedding_of(path, m))


def embedding_of(path: Path, m: dict) -> EmbeddingTable | None:
    """Bundle `path`'s embedding table (graphs.embedding), checked against the model's vocabulary and
    hidden size; None for a bundle with an embed graph instead (exported before the lookup)."""
    e = m["graphs"].get("embedding")
    if e is None:  # absent or null (as the native runner reads it): the embed graph embeds
        if "embed" not in m["graphs"].get("files", {}):
            raise SpecPrefetchError(f"{path / 'manifest.json'}: graphs has neither an embed graph nor an embedding "
                                    "table (graphs.embedding)")
        return None
    if not isinstance(e, dict) or not isinstance(e.get("file"), str):
        raise SpecPrefetchError(f"{path / 'manifest.json'}: graphs.embedding must name its file")
    return EmbeddingTable(bundle_file(path, m["files"], e["file"], "the embedding table"),
                          (int(m["model"]["vocab_size"]), int(m["model"]["hidden_size"])))


def cpu_expert_of(path: Path, m: dict) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """The `expert` graph's function on the CPU for bundle `path`: (x [T, H], *matrices in the
    graph's order) -> [T, H], float32, from the family's expert function and the bundle's config."""
    from transformers import AutoConfig

    from toolkit.models.families import family_by_name

    fam = family_by_name(m["model"]["family"])
    cfg_dir = (path / m["model"]["config"]).parent
    try:
        config = AutoConfig.from_pretrained(str(cfg_dir), local_files_only=True)
    except Exception as e:  # transformers raises several types for an unreadable config
        raise SpecPrefetchError(f"{cfg_dir / 'config.json'}: not a readable model config ({str(e)[:200]})") from None
    tc = fam.text_config(config)
    roles = [x.role for x in fam.expert_matrices(fam.geometry(config))]

    def expert(inputs: list[torch.Tensor]) -> torch.Tensor:
        return fam.expert_forward(dict(zip(roles, inputs[1:])), inputs[0], tc)

    return expert
