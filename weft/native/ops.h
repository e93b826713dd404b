// The kernels of kernels.cpp and linear.cpp that decoder.cpp composes into a whole decoder stack, and
// qdot.cpp's, that linear.cpp dispatches to.
// Each checks its inputs as the registered torch.ops.weft.* operator does.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>

namespace weft {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_normed_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& delta_weight,
                       const std::optional<at::Tensor>& next_weight, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor gelu_mul(const at::Tensor& gate_up);
void rope_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
           int64_t num_heads);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, double scale, int64_t window = 0,
                                  double softcap = 0.0, const std::optional<at::Tensor>& sinks = std::nullopt);
// A tensor that is empty where there is none (the stack's missing biases, norms and sinks) as an
// optional one.
inline std::optional<at::Tensor> nonempty(const at::Tensor& t) {
  return t.numel() == 0 ? std::nullopt : std::optional<at::Tensor>(t);
}
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
// Whether a KV cache of kv_cache's dtype may serve queries of q's: the same dtype, or a bfloat16,
// float16 or Q8_0 (uint8) cache beside float32 queries (`kv_cache_dtype`; widened to float32 as it
// is read).
inline bool cache_dtype_ok(const at::Tensor& q, const at::Tensor& kv_cache) {
  const auto c = kv_cache.scalar_type();
  return c == q.scalar_type() ||
         (q.scalar_type() == at::kFloat && (c == at::kBFloat16 || c == at::kHalf || c == at::kByte));
}

// A KV cache in Q8_0 blocks (`kv_cache_dtype="q8_0"`): llama.cpp's block_q8_0, 32 consecutive
// elements of a head as int8 times one float16 scale. Such a cache is a uint8 tensor [blocks,
// block_size, 2, KVH, D / 32 * 34]; its kernels address it in blocks, as the others in elements.
constexpr int64_t kQ8Elements = 32;
struct BlockQ8 {
  uint16_t d;  // float16 bits
  int8_t qs[kQ8Elements];
};
static_assert(sizeof(BlockQ8) == 34, "a Q8_0 block is 34 bytes");

// The elements one unit of a cache of type C holds: 32 for a Q8_0 block, else 1.
template <typename C>
constexpr int64_t kPerUnit = std::is_same_v<C, BlockQ8> ? kQ8Elements : 1;

// The units of a cache tensor that hold `elements` consecutive elements of a head (a Q8_0 cache's
// blocks), for strides in the cache's own units.
inline int64_t cache_units(const at::Tensor& kv_cache, int64_t elements) {
  return kv_cache.scalar_type() == at::kByte ? elements / kQ8Elements : elements;
}

// The last dimension of a cache tensor for heads of `head_dim` elements (a Q8_0 cache: bytes).
inline int64_t cache_row_size(const at::Tensor& kv_cache, int64_t head_dim) {
  const int64_t unit_bytes = kv_cache.scalar_type() == at::kByte ? sizeof(BlockQ8) : 1;
  return cache_units(kv_cache, head_dim) * unit_bytes;
}

inline float q8_scale(const BlockQ8& block) {
  return static_cast<float>(c10::Half(block.d, c10::Half::from_bits()));
}

// A Q8_0 block's element i as float32: its scale times its int8, as gguf's dequantization computes it.
inline float q8_value(const BlockQ8* row, int64_t i) { return q8_scale(row[i / 32]) * row[i / 32].qs[i % 32]; }

// n floats (a multiple of 32) as Q8_0 blocks, as llama.cpp's quantize_row_q8_0_ref rounds them: the
// scale is the block's largest magnitude / 127 (stored as float16), each element round(x / scale)
// (to nearest, halves away from zero) with the unrounded scale.
inline void quantize_q8_row(const float* x, BlockQ8* out, int64_t n) {
  for (int64_t b = 0; b < n / 32; ++b) {
    const float* v = x + 32 * b;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    out[b].d = c10::Half(d).x;
    for (int i = 0; i < 32; ++i) out[b].qs[i] = static_cast<int8_t>(std::round(v[i] * id));
  }
}
// qdot.cpp: x [M, K] float32 quantized as llama.cpp quantizes activations for k-quant weights
// (quantize_row_q8_K): per row int8 q[K], float32 d[K / 32] (each super-block's, repeated), int32
// sums[K / 16] of every 16 quants, [M, K + 4 K / 32 + 4 K / 16] int8.
at::Tensor quantize_q8k_rows(const at::Tensor& x);
void dot_linear(const at::Tensor& x, const at::Tensor& panels, const float* bias, at::Tensor& out);
void dot_linear_rows(const at::Tensor& x, at::TensorList panels, at::Tensor& out);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                         int64_t out_features, bool bf16_dot);

namespace file_dot {
// file_dot.cpp: out = x @ W.T, W's rows the parts' (the GGUF file's blocks) in order; and row e of x
// times matrix e, each matrix `parts_per_matrix` parts.
at::Tensor file_linear(const at::Tensor& x, at::TensorList parts, at::IntArrayRef kinds);
at::Tensor file_linear_rows(const at::Tensor& x, at::TensorList parts, at::IntArrayRef kinds,
                            int64_t parts_per_matrix);
}  // namespace file_dot

}  // namespace weft
