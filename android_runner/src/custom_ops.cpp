// The runner's own kernels for ExecuTorch's LLM custom ops, registered under their names and
// schemas, which the layer graphs of layers without sliding windows or sinks use (export/graphs.py:
// the KV cache updated in place, attention over the filled positions only):
//
//   llama::update_cache.out(Tensor value, Tensor(a!) cache, SymInt start_pos, *, Tensor(b!) out) -> Tensor(b!)
//   llama::custom_sdpa.out(Tensor query, Tensor key, Tensor value, SymInt start_pos, Tensor? attn_mask=None,
//                          float drpout_p=0.0, bool is_causal=False, float? scale=None, *, Tensor(a!) out) -> Tensor(a!)
//
// The executorch wheel's own kernels live in libcustom_ops_aot_lib.so, which links libtorch and the
// Python bindings: a phone runner cannot load it. These are plain float32 loops with the same
// meaning (tests/test_kv_inplace.py runs both on random inputs): caches are [B, S, heads, D];
// update_cache writes value [B, T, heads, D] at positions start_pos .. start_pos+T-1; custom_sdpa
// attends query row t (position start_pos + t) over key/value positions 0 .. start_pos + t
// (is_causal) or 0 .. start_pos + T - 1, grouped-query heads sharing a KV head, softmax in float32.
// The attention rows run in parallel on the kernels' pool (parallel.h). attn_mask and dropout are not
// supported (the export never passes them): such a call fails the method, as an unsupported input does.
#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <optional>
#include <vector>

#include "parallel.h"

namespace spx {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

// float32, 4-D and laid out contiguously in the default dim order: both kernels index raw pointers as
// [B, S, heads, D], so a strided tensor from some other export is refused, never read in the wrong place
bool float4d(const Tensor& t) {
  if (t.scalar_type() != ScalarType::Float || t.dim() != 4) return false;
  int64_t expect = 1;
  for (int i = 3; i >= 0; --i) {
    if (t.size(i) != 1 && static_cast<int64_t>(t.strides()[i]) != expect) return false;
    expect *= t.size(i);
  }
  return true;
}

// sum of a[d] * b[d]: four 4-lane partial sums (GCC / clang vector types: SSE2 or NEON, no FMA), then
// the lanes and the scalar tail in a fixed order
float dot(const float* a, const float* b, int64_t n) {
  typedef float v4 __attribute__((vector_size(16)));
  v4 acc[4] = {{0, 0, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 0}};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16)
    for (int k = 0; k < 4; ++k) {
      v4 x, y;
      std::memcpy(&x, a + d + 4 * k, sizeof x);
      std::memcpy(&y, b + d + 4 * k, sizeof y);
      acc[k] = acc[k] + x * y;
    }
  const v4 t = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  float sum = (t[0] + t[1]) + (t[2] + t[3]);
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

Tensor& update_cache_out(KernelRuntimeContext& ctx, const Tensor& value, Tensor& cache, const int64_t start_pos,
                         Tensor& out) {
  if (!float4d(value) || !float4d(cache) || value.size(0) != cache.size(0) || value.size(2) != cache.size(2) ||
      value.size(3) != cache.size(3) || start_pos < 0 || start_pos + value.size(1) > cache.size(1)) {
    ctx.fail(Error::InvalidArgument);
    return out;
  }
  const int64_t B = value.size(0), T = value.size(1), S = cache.size(1);
  const size_t row = static_cast<size_t>(value.size(2) * value.size(3));  // one position: heads x D
  const float* src = value.const_data_ptr<float>();
  float* dst = cache.mutable_data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    std::memcpy(dst + (static_cast<size_t>(b * S + start_pos)) * row, src + static_cast<size_t>(b * T) * row,
                static_cast<size_t>(T) * row * sizeof(float));
  return out;
}

Tensor& custom_sdpa_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                        const int64_t start_pos, const std::optional<Tensor>& attn_mask, const double dropout_p,
                        const bool is_causal, const std::optional<double> scale, Tensor& out) {
  if (!float4d(q) || !float4d(k) || !float4d(v) || !float4d(out) || attn_mask.has_value() ||
      dropout_p != 0.0 || q.size(0) != k.size(0) || k.size(0) != v.size(0) || k.size(1) != v.size(1) ||
      k.size(2) != v.size(2) || q.size(3) != k.size(3) || k.size(2) == 0 || q.size(2) % k.size(2) != 0 ||
      start_pos < 0 || start_pos + q.size(1) > k.size(1)) {
    ctx.fail(Error::InvalidArgument);
    return out;
  }
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t S = k.size(1), Hkv = k.size(2), Dv = v.size(3), group = Hq / Hkv;
  const executorch::aten::SizesType sizes[4] = {static_cast<executorch::aten::SizesType>(B),
                                                static_cast<executorch::aten::SizesType>(T),
                                                static_cast<executorch::aten::SizesType>(Hq),
                                                static_cast<executorch::aten::SizesType>(Dv)};
  if (executorch::runtime::resize_tensor(out, {sizes, 4}) != Error::Ok) {
    ctx.fail(Error::InvalidArgument);
    return out;
  }
  const float sc = scale.has_value() ? static_cast<float>(*scale) : 1.0f / std::sqrt(static_cast<float>(D));
  const float* Q = q.const_data_ptr<float>();
  const float* K = k.const_data_ptr<float>();
  const float* V = v.const_data_ptr<float>();
  float* O = out.mutable_data_ptr<float>();
  // tasks: the (batch, query row, head) rows in contiguous runs, about four runs per thread (causal
  // rows differ in length); each output row is computed by one task in a fixed order, so the result
  // does not depend on the thread count (parallel.h: ExecuTorch's pool, between the graph's other
  // kernels). Each run has its own slice of the score buffer, a buffer of the calling thread kept
  // between calls (grown here, before the workers start; a failed allocation fails the op).
  const int64_t rows = B * T * Hq;
  if (rows == 0) return out;
  const int64_t runs = std::min<int64_t>(rows, static_cast<int64_t>(parallel_threads()) * 4);
  const int64_t per = (rows + runs - 1) / runs;
  const int64_t keys = start_pos + T;  // the most keys a row attends
  thread_local std::vector<float> score_buf;
  try {
    if (score_buf.size() < static_cast<size_t>(runs * keys)) score_buf.resize(static_cast<size_t>(runs * keys));
  } catch (const std::bad_alloc&) {
    ctx.fail(Error::MemoryAllocationFailed);
    return out;
  }
  float* const scores = score_buf.data();
  parallel_for(static_cast<size_t>(runs), [&](size_t run) {
    float* p = scores + static_cast<int64_t>(run) * keys;
    const int64_t r1 = std::min(rows, (static_cast<int64_t>(run) + 1) * per);
    for (int64_t row = static_cast<int64_t>(run) * per; row < r1; ++row) {
      const int64_t h = row % Hq, bt = row / Hq;
      const int64_t b = bt / T, t = bt % T;
      const int64_t n = is_causal ? start_pos + t + 1 : start_pos + T;  // keys attended: 0 .. n-1
      const int64_t hk = h / group;
      const float* qr = Q + ((b * T + t) * Hq + h) * D;
      float mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        const float* kr = K + ((b * S + j) * Hkv + hk) * D;
        p[j] = dot(qr, kr, D) * sc;
        mx = std::max(mx, p[j]);
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        p[j] = std::exp(p[j] - mx);
        sum += p[j];
      }
      float* orow = O + ((b * T + t) * Hq + h) * Dv;
      std::fill(orow, orow + Dv, 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const float* vr = V + ((b * S + j) * Hkv + hk) * Dv;
        const float w = p[j] / sum;
        for (int64_t d = 0; d < Dv; ++d) orow[d] += w * vr[d];
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace spx

EXECUTORCH_LIBRARY(llama, "update_cache.out", spx::update_cache_out);
EXECUTORCH_LIBRARY(llama, "custom_sdpa.out", spx::custom_sdpa_out);
