"""`--target executorch`: the step graphs as one ExecuTorch program (graphs/model.pte), XNNPACK-lowered.

Every graph of export.graphs is one method of the program: embed, layer_0..layer_{N-1}, expert, head,
plus `reset`, which zeroes every layer's KV cache (call it before a new sequence). KV caches are
mutable buffers with a unique name per layer, planned with share_mutable_buffers so they persist
across calls. Quantization of the dense graphs' Linear layers uses torchao before export:

    fp32    no quantization
    8da8w   int8 dynamic activations, int8 per-channel weights
    8da4w   int8 dynamic activations, int4 weights in groups of 32 (smaller groups where a layer's
            input width is not a multiple of 32)
    w8, w4  weight-only int8 / int4: offered because users ask for them, but XNNPACK lowering of
            torchao's weight-only layout gives wrong results with executorch 1.5.1; parity refuses
            such bundles (tested)

Routers and the adapter's prediction heads stay fp32 (expert choice is sensitive to them); the expert
graph takes its (dequantized) weights as inputs, so its precision is the expert store's.
The reference for parity is the same PyTorch graphs, quantized the same way, run eagerly.
"""
from __future__ import annotations

import contextlib
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from export.target import Target, bundle_file
from toolkit.errors import SpecPrefetchError
from toolkit.runtime.backend import Backend

PROGRAM = "model.pte"


class ResetGraph(nn.Module):
    """forward(x) zeroes every layer's cache (the same buffer names as the layer methods, so the
    program shares them) and returns x."""

    def __init__(self, layers: dict[str, nn.Module]):
        super().__init__()
        self.names = []
        for g in layers.values():
            for name, buf in g.named_buffers(recurse=False):
                if "_cache_" in name:
                    self.register_buffer(name, torch.zeros_like(buf), persistent=False)
                    self.names.append(name)

    def forward(self, x):
        for n in self.names:
            getattr(self, n).zero_()
        return x + 0


def _group_size(in_features: int) -> int | None:
    for gs in (32, 16, 8):
        if in_features % gs == 0:
            return gs
    return None


def quantize_graphs(graphs: dict[str, nn.Module], quant: str) -> int:
    """Quantize the Linear layers of the dense graphs in place; returns how many were quantized."""
    if quant == "fp32":
        return 0
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup

    def config(in_features: int):
        if quant in ("8da8w", "w8"):
            g = PerAxis(0)
            dt = torch.int8
        else:
            gs = _group_size(in_features)
            g = PerGroup(gs) if gs else PerAxis(0)
            dt = torch.int4
        if quant.startswith("8da"):
            return Int8DynamicActivationIntxWeightConfig(weight_dtype=dt, weight_granularity=g)
        return IntxWeightOnlyConfig(weight_dtype=dt, granularity=g)

    n = 0
    seen: set[int] = set()
    for name, g in graphs.items():
        if name in ("expert", "embed"):
            continue
        linears = [(fqn, m) for fqn, m in g.named_modules() if isinstance(m, nn.Linear) and id(m) not in seen]
        for fqn, m in linears:
            seen.add(id(m))
            quantize_(m, config(m.in_features), filter_fn=lambda mod, _fqn: isinstance(mod, nn.Linear))
            n += 1
    return n


def logged_partitioners(partitioner, names: list[str], log) -> dict[str, list]:
    """One partitioner per method that reports each method's lowering through `log` (its
    decomposition, then its delegation), delegating everything to `partitioner`."""
    from executorch.exir.backend.partitioner import Partitioner

    n = len(names)

    class Logged(Partitioner):
        def __init__(self, inner, name: str, i: int):
            super().__init__(inner.spec)
            self.inner, self.name, self.i = inner, name, i

        def __getattr__(self, attr):  # anything else the exir passes ask of the partitioner
            inner = self.__dict__.get("inner")
            if inner is None:
                raise AttributeError(attr)
            return getattr(inner, attr)

        def transform_for_pre_decomposition(self, ep):
            log(f"lowering {self.i}/{n}: {self.name} (decomposing)")
            return self.inner.transform_for_pre_decomposition(ep)

        def ops_to_not_decompose(self, ep):
            return self.inner.ops_to_not_decompose(ep)

        def partition(self, ep):
            log(f"lowering {self.i}/{n}: {self.name} (delegating)")
            return self.inner.partition(ep)

    return {name: [Logged(partitioner, name, i + 1)] for i, name in enumerate(names)}


def lower_program(steps, cfg, quant: str, out_dir: Path, log, *, partitioner=None, label: str | None = None):
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass

    from export.graphs import exportable_family
    from export.pipeline import Built, TorchBackend, steps_info

    graphs = steps.graphs("buffer")
    nq = quantize_graphs(graphs, quant)
    if nq:
        log(f"torchao {quant}: {nq} Linear layers quantized")
    reference = TorchBackend(steps, "buffer", graphs=graphs)  # the same (quantized) modules, eagerly
    layers = {n: g for n, g in graphs.items() if n.startswith("layer_")}
    modules = {**graphs, "reset": ResetGraph(layers)}
    examples = {n: steps.example_inputs(n, "buffer") for n in graphs}
    examples["reset"] = (torch.zeros(1),)
    t0 = time.perf_counter()
    eps = {}
    with torch.no_grad(), exportable_family(steps.spec.family), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, (name, mod) in enumerate(modules.items()):
            log(f"torch.export {i + 1}/{len(modules)}: {name}")
            try:
                eps[name] = torch.export.export(mod, examples[name], strict=False)
            except Exception as e:
                raise SpecPrefetchError(f"graph {name}: torch.export failed ({type(e).__name__}: {str(e)[:300]})") from None
    t_export = time.perf_counter() - t0
    if partitioner is None:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        partitioner = XnnpackPartitioner()
    t0 = time.perf_counter()
    backend = label or "xnnpack"
    log(f"lowering {len(eps)} methods ({backend})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            edge = to_edge_transform_and_lower(eps, partitioner=logged_partitioners(partitioner, list(eps), log),
                                               compile_config=EdgeCompileConfig(_check_ir_validity=False))
            log(f"ExecuTorch program: planning memory and serializing {len(eps)} methods")
            prog = edge.to_executorch(ExecutorchBackendConfig(
                memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=True),
                emit_mutable_buffer_names=True))
    except Exception as e:
        raise SpecPrefetchError(f"ExecuTorch lowering failed ({type(e).__name__}: {str(e)[:400]})") from None
    t_lower = time.perf_counter() - t0
    path = out_dir / PROGRAM
    path.write_bytes(prog.buffer)
    log(f"wrote graphs/{PROGRAM}: {path.stat().st_size / 2**20:.1f} MiB, lowered in {t_lower:.0f} s")
    info = steps_info(steps)
    return Built(
        graphs={"format": "executorch", "file": f"graphs/{PROGRAM}", "backend": "xnnpack" if label is None else label,
                "methods": sorted(modules), "export_s": round(t_export, 2), "lower_s": round(t_lower, 2)},
        reference=reference, reference_label=f"pytorch ({quant}, eager)",
        backend_label=label or "executorch-xnnpack", kv_mode="buffer", soc=None,
        expert_precision="fp32 (weights dequantized from the store)",
        make_backend=lambda: ExecuTorchBackend(path, info))


_LOADED = False  # whether this process has loaded an ExecuTorch program
# what XNNPACK's CPU probe prints (through ExecuTorch's native log, on fd 2) on the first method
# load of a process on a machine without the ARM identification files: not the user's business
_NATIVE_NOISE = ("[cpuinfo_utils.cpp:",)


@contextlib.contextmanager
def _filtered_native_stderr():
    """Run native code with fd 2 sent to a temporary file, then pass on every line of it but the
    known noise (_NATIVE_NOISE)."""
    import sys
    import tempfile

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    with tempfile.TemporaryFile() as cap:
        try:
            os.dup2(cap.fileno(), 2)
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            cap.seek(0)
            text = cap.read().decode("utf-8", errors="replace")
            kept = [line for line in text.splitlines(keepends=True) if not line.startswith(_NATIVE_NOISE)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def set_threads(n: int, *, strict: bool = True) -> int:
    """ExecuTorch's thread pool size in this process (XNNPACK and the optimized kernels); returns the
    size in effect. Only before the first program loads: a loaded method keeps the pool it was
    initialised with, and replacing that pool would leave it pointing at freed memory. After that,
    a different size is an error (strict) or left as it is."""
    from executorch.extension.pybindings import portable_lib

    have = portable_lib._threadpool_get_thread_count()
    if have == n:
        return n
    if _LOADED:
        if strict:
            raise SpecPrefetchError(f"--threads {n}: this process already runs ExecuTorch programs with {have} "
                                    "threads; the pool size can only be set before the first program loads")
        return have
    portable_lib._unsafe_reset_threadpool(n)
    return n


def load_program(path: Path):
    from executorch.runtime import Runtime

    if not Path(path).is_file():
        raise SpecPrefetchError(f"{path}: ExecuTorch program missing")
    global _LOADED
    _LOADED = True
    try:
        return Runtime.get().load_program(Path(path))
    except RuntimeError as e:
        raise SpecPrefetchError(f"{path}: ExecuTorch could not load the program ({e}): truncated or corrupt?") from None


class ExecuTorchBackend(Backend):
    """Runs the bundle's program with the ExecuTorch runtime (its Python bindings)."""
    label = "executorch"
    kv_mode = "buffer"

    def __init__(self, path: Path, info: dict[str, Any]):
        super().__init__(info)
        self.path = Path(path)
        self.program = load_program(self.path)
        self.methods: dict[str, Any] = {}

    def _method(self, name):
        if name not in self.methods:
            with _filtered_native_stderr():
                self.methods[name] = self.program.load_method(name)
        return self.methods[name]

    def call(self, name, inputs):
        try:
            return list(self._method(name).execute([t.contiguous() for t in inputs]))
        except (RuntimeError, ValueError, TypeError) as e:
            raise SpecPrefetchError(f"{self.path}: method {name} failed ({e})") from None

    def reset(self):
        self.call("reset", [torch.zeros(1)])


_DTYPES = {4: "int64", 6: "float32", 3: "int32", 5: "float16"}


class ExecuTorchTarget(Target):
    """`--target executorch`: one XNNPACK-lowered program, graphs/model.pte."""
    NAME = "executorch"
    DEFAULT_QUANT = "fp32"
    QUANTS = ("fp32", "8da8w", "8da4w", "w8", "w4")
    NEEDS_CALIBRATION: dict[str, bool] = {}

    def preflight(self, cfg, quant: str) -> None:
        try:
            import executorch.exir  # noqa: F401
            from executorch.runtime import Runtime  # noqa: F401
        except ImportError as e:
            raise SpecPrefetchError(f"--target executorch needs executorch ({e}); run `make setup`") from None
        if quant != "fp32":
            try:
                import torchao  # noqa: F401
            except ImportError as e:
                raise SpecPrefetchError(f"--quant {quant} needs torchao ({e}); run `make setup`") from None

    def build(self, steps, cfg, quant: str, out_dir: Path, *, calib, run_kw, log, scratch: Path | None = None):
        return lower_program(steps, cfg, quant, out_dir, log)

    def check_graphs(self, path: Path, m: dict) -> dict[str, Any]:
        """The program loads, has exactly the manifest's methods, and each method's input/output
        shapes and dtypes are the manifest's signature."""
        p = bundle_file(path, m["files"], m["graphs"]["file"], "program")
        prog = load_program(p)
        have = set(prog.method_names)
        want = set(m["graphs"]["methods"])
        if have != want:
            raise SpecPrefetchError(f"{p}: methods {sorted(have)}, the manifest lists {sorted(want)}")
        if set(m["graphs"]["signatures"]) | {"reset"} != want:
            raise SpecPrefetchError(f"{path / 'manifest.json'}: signatures for {sorted(m['graphs']['signatures'])}, "
                                    f"methods {sorted(want)}")
        out = {}
        for name, sig in m["graphs"]["signatures"].items():
            meta = prog.metadata(name)
            ins = [[list(meta.input_tensor_meta(i).sizes()), _DTYPES.get(meta.input_tensor_meta(i).dtype(), "?")]
                   for i in range(meta.num_inputs())]
            outs = [[list(meta.output_tensor_meta(i).sizes()), _DTYPES.get(meta.output_tensor_meta(i).dtype(), "?")]
                    for i in range(meta.num_outputs())]
            if ins != sig["inputs"] or outs != sig["outputs"]:
                raise SpecPrefetchError(f"{p}: method {name} has inputs {ins} / outputs {outs}; the manifest's "
                                        f"signature is {sig['inputs']} / {sig['outputs']}")
            out[name] = {"inputs": len(ins), "outputs": len(outs)}
        return out

    def open_backend(self, path: Path, m: dict) -> ExecuTorchBackend:
        return ExecuTorchBackend(path / m["graphs"]["file"], {})
