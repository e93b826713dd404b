// The kernels of kernels.cpp and linear.cpp that decoder.cpp composes into a whole decoder stack, and
// qdot.cpp's, that linear.cpp dispatches to.
// Each checks its inputs as the registered torch.ops.weft.* operator does.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace weft {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
void rope_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
           int64_t num_heads);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, double scale, int64_t window = 0);
// qdot.cpp: whether `panels` are dot panels (int8, panels.h) of K input features, and out = x @ W.T
// (+ bias) through them, x quantized to int8.
bool is_dot_panels(const at::Tensor& panels, int64_t k);
// An attention's sinks (gpt-oss): float32 [heads] on the CPU, or nullptr where there are none; `op`
// names the caller in the error.
inline const float* attention_sinks(const std::optional<at::Tensor>& sinks, int64_t heads, const char* op) {
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                  sinks->numel() == heads,
              op, ": sinks must be float32 [H] on the CPU");
  return sinks->data_ptr<float>();
}
// Whether a KV cache of kv_cache's dtype may serve queries of q's: the same dtype, or a bfloat16 or
// float16 cache beside float32 queries (`kv_cache_dtype`; widened to float32 as it is read).
inline bool cache_dtype_ok(const at::Tensor& q, const at::Tensor& kv_cache) {
  const auto c = kv_cache.scalar_type();
  return c == q.scalar_type() || (q.scalar_type() == at::kFloat && (c == at::kBFloat16 || c == at::kHalf));
}
void dot_linear(const at::Tensor& x, const at::Tensor& panels, const float* bias, at::Tensor& out);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                         int64_t out_features, bool bf16_dot);

}  // namespace weft
