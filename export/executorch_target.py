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
from toolkit.runtime.backend import Backend, load_custom_ops, parse_prefill_name

PROGRAM = "model.pte"
# prefill chunk sizes: a prompt goes through prefill_T_layer_N methods greedily by the largest T that
# fits, the tail by smaller ones and single positions. 8 is where a chunk starts to pay (the layer
# graph's fixed per-call cost and an expert's read shared by several tokens), 32 where XNNPACK's
# GEMMs and the union of a chunk's experts (~all of a layer's at top-8 of 64) stop gaining much per
# token, 128 halves the calls again for long prompts; each size costs one method per layer (the
# weights are stored once: XNNPACK's named data is shared by every method).
PREFILL_CHUNKS = (8, 32, 128)


def prefill_chunk_sizes(max_seq: int) -> tuple[int, ...]:
    """The chunk sizes a program with a KV cache of `max_seq` positions gets: those up to a quarter
    of the cache (prompts are mostly well under the cache; each size costs one lowered method per
    layer, about 2x the export time of the decode graphs for two sizes)."""
    return tuple(T for T in PREFILL_CHUNKS if T <= max_seq // 4)


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
        if name in ("expert", "embed", "vision"):  # the vision tower stays fp32 (docs/export.md "Images")
            continue
        linears = [(fqn, m) for fqn, m in g.named_modules() if isinstance(m, nn.Linear) and id(m) not in seen]
        for _, m in linears:
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
    from export.eager import TorchBackend, steps_info
    from export.target import Built

    steps.prefill_chunks = prefill_chunk_sizes(steps.max_seq)
    steps.kv_custom_ops = load_custom_ops()  # the layers they fit: KV cache in place, attention over filled positions
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
            if parse_prefill_name(name) is not None and parse_prefill_name(name)[0] not in steps.prefill_chunks:
                continue  # a chunk size given up below
            try:
                eps[name] = torch.export.export(mod, examples[name], strict=False)
            except Exception as e:
                chunk = parse_prefill_name(name)
                if chunk is None:
                    raise SpecPrefetchError(f"graph {name}: torch.export failed ({type(e).__name__}: "
                                            f"{str(e)[:300]})") from None
                # a family whose attention cannot run T positions at once: prompts go one at a time
                log(f"prefill chunks dropped ({name}: {type(e).__name__}: {str(e)[:200]})")
                steps.prefill_chunks = ()
                for n in [n for n in eps if parse_prefill_name(n) is not None]:
                    del eps[n]
    for name in [n for n in graphs if parse_prefill_name(n) is not None and n not in eps]:
        del graphs[name]  # the reference runs what the program holds
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
    from toolkit.artifacts import sha256_file

    mark_program_checked(sha256_file(path))  # the export's own program: a bundle of it need not be tried
    log(f"wrote graphs/{PROGRAM}: {path.stat().st_size / 2**20:.1f} MiB, lowered in {t_lower:.0f} s")
    info = steps_info(steps)
    return Built(
        graphs={"format": "executorch", "file": f"graphs/{PROGRAM}", "backend": "xnnpack" if label is None else label,
                "methods": sorted(eps), "prefill_chunks": list(steps.prefill_chunks), "export_s": round(t_export, 2),
                "lower_s": round(t_lower, 2)},
        reference=reference, reference_label=f"pytorch ({quant}, eager)",
        backend_label=label or "executorch-xnnpack", kv_mode="buffer", soc=None,
        expert_precision="fp32 (weights dequantized from the store)",
        make_backend=lambda: ExecuTorchBackend(path, info))


def layer_graph_ms(model: str | Path, max_seq: int, *, custom_ops: bool, positions=(63,), calls: int = 300,
                   scratch: Path | None = None) -> dict[int, float]:
    """The time of one MoE layer graph (the model's second MoE layer, XNNPACK, this process's
    thread pool) for one decode position, lowered alone with a KV cache of `max_seq` positions,
    with the LLM custom ops (custom_ops) or the masked path: {position: ms per call}. A benchmark:

        python -c "from export.executorch_target import layer_graph_ms as f, set_threads; set_threads(1);
        [print(S, c, f('embedded', S, custom_ops=c, positions=(63, S - 1)))
         for S in (128, 1024) for c in (False, True)]"
    """
    import tempfile

    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass

    from export.graphs import StepModel, exportable_family
    from toolkit.models.loader import embedded_model_dir, inspect_model_dir, load_dense_model

    spec = inspect_model_dir(embedded_model_dir() if str(model) == "embedded" else model)
    steps = StepModel(spec, load_dense_model(spec), max_seq=max_seq)
    steps.kv_custom_ops = custom_ops and load_custom_ops()
    name = f"layer_{spec.geometry.moe_layers[min(1, len(spec.geometry.moe_layers) - 1)]}"
    g = steps.graphs("buffer")[name]
    with torch.no_grad(), exportable_family(spec.family), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(g, steps.example_inputs(name, "buffer"), strict=False)
        prog = to_edge_transform_and_lower({"layer": ep}, partitioner={"layer": [XnnpackPartitioner()]},
                                           compile_config=EdgeCompileConfig(_check_ir_validity=False)).to_executorch(
            ExecutorchBackendConfig(memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=True),
                                    emit_mutable_buffer_names=True))
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        path = Path(tmp) / "layer.pte"
        path.write_bytes(prog.buffer)
        method = load_program(path).load_method("layer")
        h = torch.randn(1, 1, spec.geometry.hidden_size)
        out = {}
        for pos in positions:
            p = torch.tensor([pos])
            for _ in range(20):
                method.execute([h, p])
            t0 = time.perf_counter()
            for _ in range(calls):
                method.execute([h, p])
            out[pos] = round((time.perf_counter() - t0) / calls * 1e3, 4)
    return out


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
    load_custom_ops()  # kernels of llama::update_cache / custom_sdpa, which layer methods may call
    global _LOADED
    _LOADED = True
    try:
        return Runtime.get().load_program(Path(path))
    except RuntimeError as e:
        raise SpecPrefetchError(f"{path}: ExecuTorch could not load the program ({e}): truncated or corrupt?") from None


# -- a program from a bundle is tried in a child process first ---------------------------------
#
# ExecuTorch verifies a program's flatbuffer (Verification.InternalConsistency) but not what it
# means: an operator index, a value index or a memory-plan offset one bit off passes and then
# crashes the process that runs it (found by flipping bits of a real model.pte). A bundle's program
# is checked against the manifest's sha256 on every open, so only a program whose manifest was
# rewritten to match can get here; such a program is loaded, and every method run once on zeros,
# in a child process before this process touches it: a crash there is a one-line error naming the
# program. A program that passed is remembered by sha256 (and the ExecuTorch version), in this
# process and in ~/.cache/specprefetch/programs-checked.json, and one the export wrote is recorded
# as it is written, so a bundle's program costs the child process at most once per machine.

PROBE_TIMEOUT_S = 900.0
CHECKED_NAME = "programs-checked.json"
MAX_CHECKED = 256
_CHECKED: set[str] = set()
_REFUSED: dict[str, str] = {}  # this process's refusals, by the same key (not tried twice)
_PROBE = r"""
import sys
stage = "loading the program"
try:
    import torch  # before the extension (it resolves libtorch); executorch.exir is never imported
    from executorch.extension.pybindings import _C

    _C._unsafe_reset_threadpool(1)
    import glob, os  # the LLM custom ops' kernels (llama::update_cache, custom_sdpa), if any
    for lib in glob.glob(os.path.join(os.path.dirname(os.path.dirname(_C.__file__)), "llm", "custom_ops",
                                      "libcustom_ops_aot_lib.*"))[:1]:
        torch.ops.load_library(lib)
    # ExecuTorch's ScalarType codes (c10's order)
    dtypes = {0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.long, 5: torch.float16,
              6: torch.float32, 7: torch.float64, 11: torch.bool, 15: torch.bfloat16}
    print("stage " + stage, flush=True)
    prog = _C._load_program(sys.argv[1], program_verification=_C.Verification.InternalConsistency)
    for name in sorted(prog.get_method_name(i) for i in range(prog.num_methods())):
        stage = f"loading method {name}"
        print("stage " + stage, flush=True)
        method = prog.load_method(name)
        meta = prog.method_meta(name)
        ins = []
        for i in range(meta.num_inputs()):
            t = meta.input_tensor_meta(i)
            if int(t.dtype()) not in dtypes:
                print(f"probe-error method {name} input {i}: dtype code {int(t.dtype())} has no zero input here",
                      flush=True)
                sys.exit(4)
            ins.append(torch.zeros([int(d) for d in t.sizes()], dtype=dtypes[int(t.dtype())]))
        stage = f"running method {name}"
        print("stage " + stage, flush=True)
        method(ins)
except BaseException as e:
    print("error " + stage + ": " + " ".join(f"{type(e).__name__}: {e}".split())[:300], flush=True)
    sys.exit(3)
"""


def _checked_key(sha256: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        et = version("executorch")
    except PackageNotFoundError:
        et = "?"
    return f"executorch-{et}:{sha256}"


def _checked_file() -> Path:
    from toolkit.runtime.profiles import profile_dir

    return profile_dir().parent / CHECKED_NAME


def _load_checked() -> list[str]:
    import json

    try:
        data = json.loads(_checked_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    got = data.get("programs") if isinstance(data, dict) else None
    return [k for k in got if isinstance(k, str)] if isinstance(got, list) else []


def mark_program_checked(sha256: str) -> None:
    """Remember that the program of this sha256 loads and runs (best effort on disk)."""
    from toolkit.artifacts import write_json_atomic

    key = _checked_key(sha256)
    _CHECKED.add(key)
    keys = [k for k in _load_checked() if k != key] + [key]
    path = _checked_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"programs": keys[-MAX_CHECKED:]})
    except (OSError, SpecPrefetchError):
        pass


def check_program(path: Path, sha256: str, *, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Refuse (one line naming `path`) a program that ExecuTorch cannot load, or that crashes it,
    trying it in a child process: loaded with the flatbuffer verification, every method loaded and
    run once on zero inputs of its signature's shapes. `sha256` is the program's verified hash;
    a program of that hash already tried (or written by the export) is not tried again."""
    key = _checked_key(sha256)
    if key in _CHECKED:
        return
    if key in _REFUSED:
        raise SpecPrefetchError(_REFUSED[key].replace("\0", str(path)))
    if key in _load_checked():
        _CHECKED.add(key)
        return
    try:
        _probe(path, timeout)
    except SpecPrefetchError as e:
        _REFUSED[key] = str(e).replace(str(path), "\0")
        raise
    mark_program_checked(sha256)


def _probe(path: Path, timeout: float) -> None:
    import signal
    import subprocess
    import sys

    try:
        r = subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SpecPrefetchError(f"{path}: ExecuTorch did not finish loading and running the program in "
                                f"{timeout:.0f} s (tried in a separate process): a damaged or crafted "
                                "program?") from None
    except OSError as e:
        raise SpecPrefetchError(f"{path}: cannot start a process to try the program ({e.strerror or e})") from None
    lines = r.stdout.splitlines()
    stage = next((ln[6:] for ln in reversed(lines) if ln.startswith("stage ")), "starting")
    if r.returncode == 0:
        return
    error = next((ln[6:] for ln in reversed(lines) if ln.startswith("error ")), None)
    log = [ln.strip() for ln in r.stderr.splitlines() if ln.startswith("[") and not ln.startswith(_NATIVE_NOISE)]
    said = f"; ExecuTorch said {log[-1][:160]!r}" if log else ""
    if r.returncode < 0:
        try:
            name = signal.Signals(-r.returncode).name
        except ValueError:
            name = f"signal {-r.returncode}"
        raise SpecPrefetchError(f"{path}: ExecuTorch crashed ({name}) {stage} (tried in a separate process{said}): "
                                "a damaged or crafted program, not what the export wrote")
    probe = next((ln[12:] for ln in reversed(lines) if ln.startswith("probe-error ")), None)
    if probe is not None:  # the check itself cannot try this program: not the program's fault
        raise SpecPrefetchError(f"{path}: the program check cannot try it ({probe}); this toolkit's exports "
                                "never have such an input")
    if error is not None:
        raise SpecPrefetchError(f"{path}: ExecuTorch refused the program, {error}: truncated or corrupt?")
    tail = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
    raise SpecPrefetchError(f"{path}: trying the program in a separate process failed {stage} ({tail[:200]})")


def _program(path: Path, m: dict) -> Path:
    """The bundle's program, tried in a child process first (check_program) unless known good."""
    rel = m["graphs"]["file"]
    p = bundle_file(path, m["files"], rel, "program")
    check_program(p, m["files"][rel]["sha256"])
    return p


class ExecuTorchBackend(Backend):
    """Runs the bundle's program with the ExecuTorch runtime (its Python bindings)."""
    label = "executorch"
    kv_mode = "buffer"

    def __init__(self, path: Path, info: dict[str, Any]):
        super().__init__(info)
        self.path = Path(path)
        self.program = load_program(self.path)
        self.methods: dict[str, Any] = {}

    def method_names(self):
        return tuple(self.program.method_names)

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
        super().reset()
        self.call("reset", [torch.zeros(1)])


_DTYPES = {4: "int64", 6: "float32", 3: "int32", 5: "float16"}


class ExecuTorchTarget(Target):
    """`--target executorch`: one XNNPACK-lowered program, graphs/model.pte."""
    NAME = "executorch"
    DEFAULT_QUANT = "fp32"
    VISION_PRECISION = "fp32"  # the tower is not quantised (quantize below)
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
        p = _program(path, m)
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
        return ExecuTorchBackend(_program(path, m), {"mrope": m["kv"].get("rope") == "mrope"})
