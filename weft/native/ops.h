// The kernels of kernels.cpp and linear.cpp that decoder.cpp composes into a whole decoder stack.
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
                                  const at::Tensor& context_lens, double scale);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                         int64_t out_features, bool bf16_dot);

}  // namespace weft
