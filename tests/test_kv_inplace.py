"""The KV cache updated in place, attention over the filled positions only (issue 21, deliverable 5).

Layers without sliding windows or sinks use ExecuTorch's LLM custom ops, llama::update_cache and
llama::custom_sdpa (export/graphs.py, custom_kv_fits). The native runner registers its own kernels
for them (android_runner/src/custom_ops.cpp): here they run, through ExecuTorch's operator registry,
against the wheel's own ops on random inputs (start_pos 0, mid and max_seq - T; one position and a
chunk; grouped-query heads). The graphs that use them give the masked path's outputs, eagerly.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from toolkit.runtime.backend import load_custom_ops

REPO = Path(__file__).resolve().parents[1]

DRIVER = r"""
#include "custom_ops.cpp"
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/kernel/operator_registry.h>
#include <executorch/runtime/platform/runtime.h>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
using namespace executorch;
static std::vector<float> rd(const std::string& p, size_t n) {
  std::vector<float> v(n); std::ifstream f(p, std::ios::binary); f.read((char*)v.data(), n * 4); return v; }
static void wr(const std::string& p, const std::vector<float>& v) {
  std::ofstream f(p, std::ios::binary); f.write((const char*)v.data(), v.size() * 4); }
int main(int argc, char** argv) {
  runtime::runtime_init();
  spx::set_fallback_threads(argc > 8 ? atoi(argv[8]) : 1);  // the attention's threads (parallel.cpp's pool)
  const int T = atoi(argv[1]), Hq = atoi(argv[2]), Hkv = atoi(argv[3]), D = atoi(argv[4]), S = atoi(argv[5]);
  const int64_t start = atoll(argv[6]); const std::string d = argv[7];
  auto q = rd(d + "/q.bin", (size_t)T * Hq * D), kn = rd(d + "/knew.bin", (size_t)T * Hkv * D);
  auto vn = rd(d + "/vnew.bin", (size_t)T * Hkv * D), kc = rd(d + "/kcache.bin", (size_t)S * Hkv * D);
  auto vc = rd(d + "/vcache.bin", (size_t)S * Hkv * D);
  std::vector<float> out((size_t)T * Hq * D), dummy(1);
  auto tq = extension::from_blob(q.data(), {1, T, Hq, D}), tkn = extension::from_blob(kn.data(), {1, T, Hkv, D});
  auto tvn = extension::from_blob(vn.data(), {1, T, Hkv, D}), tkc = extension::from_blob(kc.data(), {1, S, Hkv, D});
  auto tvc = extension::from_blob(vc.data(), {1, S, Hkv, D}), to = extension::from_blob(out.data(), {1, T, Hq, D});
  auto td = extension::from_blob(dummy.data(), {1});
  auto upd = runtime::get_op_function_from_registry("llama::update_cache.out");
  auto sdpa = runtime::get_op_function_from_registry("llama::custom_sdpa.out");
  if (!upd.ok() || !sdpa.ok()) { std::fprintf(stderr, "not registered\n"); return 2; }
  runtime::KernelRuntimeContext ctx;
  for (int which = 0; which < 2; ++which) {
    runtime::EValue a[4] = {runtime::EValue(which ? *tvn : *tkn), runtime::EValue(which ? *tvc : *tkc),
                            runtime::EValue(start), runtime::EValue(*td)};
    runtime::EValue* s[4] = {&a[0], &a[1], &a[2], &a[3]};
    (*upd)(ctx, runtime::Span<runtime::EValue*>(s, 4));
  }
  runtime::EValue b[9] = {runtime::EValue(*tq), runtime::EValue(*tkc), runtime::EValue(*tvc), runtime::EValue(start),
                          runtime::EValue(), runtime::EValue(0.0), runtime::EValue(true), runtime::EValue(),
                          runtime::EValue(*to)};
  runtime::EValue* s2[9];
  for (int i = 0; i < 9; ++i) s2[i] = &b[i];
  (*sdpa)(ctx, runtime::Span<runtime::EValue*>(s2, 9));
  if (ctx.failure_state() != runtime::Error::Ok) { std::fprintf(stderr, "kernel failed\n"); return 3; }
  wr(d + "/out.bin", out); wr(d + "/kcache_out.bin", kc); wr(d + "/vcache_out.bin", vc);
  return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    """The runner's custom_ops.cpp compiled with a small driver that calls its kernels through
    ExecuTorch's operator registry (the registration the runner relies on), against the wheel."""
    cxx = shutil.which("g++")
    if cxx is None or not load_custom_ops():
        pytest.skip("needs g++ and the executorch wheel's custom ops")
    from executorch.extension.pybindings import portable_lib

    et = Path(portable_lib.__file__).resolve().parents[2]
    d = tmp_path_factory.mktemp("custom-ops")
    (d / "driver.cpp").write_text(DRIVER)
    exe = d / "driver"
    subprocess.run([cxx, "-std=c++17", "-O2", "-ffp-contract=off", "-DC10_USING_CUSTOM_GENERATED_MACROS",
                    "-DET_EVENT_TRACER_ENABLED",
                    f"-I{REPO / 'android_runner' / 'src'}", f"-I{et / 'include'}",
                    f"-I{et / 'include' / 'executorch' / 'runtime' / 'core' / 'portable_type' / 'c10'}",
                    str(d / "driver.cpp"), str(REPO / "android_runner" / "src" / "parallel.cpp"), "-o", str(exe),
                    "-pthread", f"-L{et / 'lib'}", "-lexecutorch",
                    f"-Wl,-rpath,{et / 'lib'}"], check=True, capture_output=True, timeout=300)
    return exe


# (T, query heads, KV heads, head dim, max_seq): one position, a chunk, GQA, plain multi-head, a head dim
# with a tail past the 16-wide dot product
SHAPES = [(1, 4, 2, 64, 64), (8, 4, 2, 64, 64), (8, 4, 4, 16, 40), (3, 2, 1, 20, 24)]


@pytest.mark.parametrize("shape", SHAPES)
def test_native_kernels_equal_the_wheels_ops(driver, shape, tmp_path):
    T, Hq, Hkv, D, S = shape
    rng = np.random.default_rng(T * 100 + D)
    for start in (0, S // 2 - 3, S - T):
        arrs = {n: rng.standard_normal(sh).astype(np.float32) for n, sh in
                [("q", (1, T, Hq, D)), ("knew", (1, T, Hkv, D)), ("vnew", (1, T, Hkv, D)),
                 ("kcache", (1, S, Hkv, D)), ("vcache", (1, S, Hkv, D))]}
        for n, a in arrs.items():
            a.tofile(tmp_path / f"{n}.bin")
        outs = []
        for threads in ("3", "1"):  # the attention rows over three threads, then one: the same bits
            r = subprocess.run([str(driver), str(T), str(Hq), str(Hkv), str(D), str(S), str(start), str(tmp_path),
                                threads], capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            outs.append((tmp_path / "out.bin").read_bytes())
        assert outs[0] == outs[1], (shape, start)
        kc, vc = torch.from_numpy(arrs["kcache"].copy()), torch.from_numpy(arrs["vcache"].copy())
        torch.ops.llama.update_cache(torch.from_numpy(arrs["knew"]), kc, start)
        torch.ops.llama.update_cache(torch.from_numpy(arrs["vnew"]), vc, start)
        ref = torch.ops.llama.custom_sdpa(torch.from_numpy(arrs["q"]), kc, vc, start, None, 0.0, True, None)
        got = np.fromfile(tmp_path / "out.bin", np.float32).reshape(ref.shape)
        assert np.array_equal(np.fromfile(tmp_path / "kcache_out.bin", np.float32).reshape(kc.shape), kc.numpy())
        assert np.array_equal(np.fromfile(tmp_path / "vcache_out.bin", np.float32).reshape(vc.shape), vc.numpy())
        assert np.abs(got - ref.numpy()).max() < 1e-5, (shape, start)
        # positions past start + T never reach the output: attention over the filled ones only
        assert not np.allclose(got, 0)


def test_custom_op_graphs_equal_the_masked_graphs(embedded):
    """The layer graphs that use the custom ops (eagerly, in plain torch with the same meaning)
    give the masked graphs' outputs, one position at a time and over a prefill chunk."""
    from export.graphs import StepModel
    from export.eager import TorchBackend
    from toolkit.models.loader import inspect_model_dir, load_dense_model

    spec = inspect_model_dir(embedded)
    dense = load_dense_model(spec)
    H = spec.geometry.hidden_size
    hs = torch.randn(1, 12, H, generator=torch.Generator().manual_seed(0))
    got = {}
    for custom in (False, True):
        steps = StepModel(spec, dense, max_seq=32)
        steps.prefill_chunks, steps.kv_custom_ops = (8,), custom
        be = TorchBackend(steps, "buffer")
        layer = spec.geometry.moe_layers[1]
        if custom:
            assert be.graphs[f"layer_{layer}"].custom_kv
            assert tuple(be.graphs[f"layer_{layer}"].k_cache.shape) == (1, 32, 2, 64)  # [1, S, heads, D]
        be.reset()
        one = [be.layer(layer, hs[:, p:p + 1], p) for p in range(12)]
        be.reset()
        chunk = be.layer_chunk(layer, hs[:, :8], 0)
        after = [be.layer(layer, hs[:, p:p + 1], p) for p in range(8, 12)]
        got[custom] = [t for o in one for t in o] + list(chunk) + [t for o in after for t in o]
    for a, b in zip(got[False], got[True]):
        assert torch.allclose(a, b, atol=1e-5)


def test_layers_with_windows_or_sinks_keep_the_masked_path(tiny_models):
    from export.graphs import StepModel, custom_kv_fits
    from toolkit.models.loader import inspect_model_dir, load_dense_model

    spec = inspect_model_dir(tiny_models["gpt_oss"])
    steps = StepModel(spec, load_dense_model(spec), max_seq=16)
    assert not any(custom_kv_fits(steps, i) for i in range(spec.geometry.num_layers))  # sinks
    spec = inspect_model_dir(tiny_models["deepseek_v2"])
    steps = StepModel(spec, load_dense_model(spec), max_seq=16)
    assert not any(custom_kv_fits(steps, i) for i in range(spec.geometry.num_layers))  # MLA: K and V differ
