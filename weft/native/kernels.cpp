// weft's CPU kernels: the small operations of a decoder layer fused into single loops, decode
// attention that reads the paged KV cache in place, and the grammar bitmask applied in place.
// Registered as torch.ops.weft.*; the Python side (weft/native/__init__.py) compiles this file on
// first use and falls back to plain torch operations when it cannot. Every kernel computes in float32 whatever the storage dtype.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vmath.h"

namespace {

// Every check runs before any memory is touched; messages are plain literals (nothing formatted).
inline bool on_cpu(std::initializer_list<at::Tensor> tensors) {
  for (const auto& t : tensors) {
    if (!t.device().is_cpu()) return false;
  }
  return true;
}


using weft::vmath::exp_approx;
using weft::vmath::silu;
#if defined(__AVX512F__)
using weft::vmath::exp16;
using weft::vmath::gelu16;
using weft::vmath::silu16;
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
using weft::vmath::exp8;
using weft::vmath::gelu8;
using weft::vmath::silu8;

inline float reduce_add8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

inline float reduce_max8(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#define WEFT_AVX2 1
#endif

template <typename T>
inline float dot(const T* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += static_cast<float>(a[i]) * b[i];
  return sum;
}

// out[t] = x[t] / rms(x[t]) * weight, per row of a [T, H] tensor (rows may be strided).
template <typename T>
void rms_norm_kernel(const T* xp, int64_t row_stride, const T* wp, T* op, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) weft::vmath::rms_norm_row(xp + t * row_stride, wp, op + t * hidden, hidden, eps);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(on_cpu({x, weight}), "rms_norm: x and weight must be CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [T, H] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be [H] of x's dtype");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "weft_rms_norm", [&] {
    rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), weight.data_ptr<scalar_t>(),
                              out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// x[t] += delta[t] in place, then out[t] = rms_norm(x[t]): the residual add and the next norm in one
// pass over each row (what x.add_(delta) followed by rms_norm computes).
template <typename T>
void add_rms_norm_kernel(T* xp, const T* dp, const T* wp, T* op, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = xp + t * hidden;
      const T* delta = dp + t * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) row[i] = static_cast<T>(static_cast<float>(row[i]) + static_cast<float>(delta[i]));
      weft::vmath::rms_norm_row(row, wp, op + t * hidden, hidden, eps);
    }
  });
}

at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  TORCH_CHECK(on_cpu({x, delta, weight}), "add_rms_norm_: x, delta and weight must be CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && delta.sizes() == x.sizes() && delta.is_contiguous() &&
                  delta.scalar_type() == x.scalar_type(),
              "add_rms_norm_: x and delta must be contiguous [T, H] of one dtype");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "add_rms_norm_: weight must be [H] of x's dtype");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "weft_add_rms_norm_", [&] {
    add_rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                                  out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// A branch's output normalised and added to the residual stream (Gemma's and OLMo 2's layers):
// x[t] += rms_norm(delta[t]) * w_delta in place, then, with w_next, out[t] = rms_norm(x[t]) * w_next,
// the next branch's input: in one pass over each row what rms_norm, x.add_ and rms_norm compute.
template <typename T>
void add_normed_kernel(T* xp, const T* dp, const T* wd, const T* wn, T* op, int64_t rows, int64_t hidden,
                       float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<T> normed(hidden);
    for (int64_t t = begin; t < end; ++t) {
      T* row = xp + t * hidden;
      weft::vmath::rms_norm_row(dp + t * hidden, wd, normed.data(), hidden, eps);
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) row[i] = static_cast<T>(static_cast<float>(row[i]) + static_cast<float>(normed[i]));
      if (wn != nullptr) weft::vmath::rms_norm_row(row, wn, op + t * hidden, hidden, eps);
    }
  });
}

at::Tensor add_normed_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& delta_weight,
                       const std::optional<at::Tensor>& next_weight, double eps) {
  TORCH_CHECK(on_cpu({x, delta, delta_weight}), "add_normed_: x, delta and the weights must be CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && delta.sizes() == x.sizes() && delta.is_contiguous() &&
                  delta.scalar_type() == x.scalar_type(),
              "add_normed_: x and delta must be contiguous [T, H] of one dtype");
  for (const auto* w : {&delta_weight, next_weight ? &*next_weight : &delta_weight}) {
    TORCH_CHECK(w->dim() == 1 && w->is_contiguous() && w->size(0) == x.size(1) && w->scalar_type() == x.scalar_type() &&
                    w->device().is_cpu(),
                "add_normed_: the weights must be [H] of x's dtype");
  }
  auto out = next_weight ? at::empty({x.size(0), x.size(1)}, x.options()) : x;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "weft_add_normed_", [&] {
    add_normed_kernel<scalar_t>(x.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), delta_weight.data_ptr<scalar_t>(),
                                next_weight ? next_weight->data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>(),
                                x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// out[t] = silu(gate[t]) * up[t], where a row of the fused projection is [gate | up] ([T, 2I]).
void silu_mul_row(const float* gate, const float* up, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(silu16(_mm512_loadu_ps(gate + i)), _mm512_loadu_ps(up + i)));
  }
#elif defined(WEFT_AVX2)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) dst[i] = silu(gate[i]) * up[i];
}

// A gated unit's activation times its up half, row by row: out [T, I] from gate_up [T, 2I] (gate | up).
template <typename RowFn>
at::Tensor glu_rows(const at::Tensor& gate_up, const char* name, RowFn row_fn) {
  TORCH_CHECK(on_cpu({gate_up}), name, ": gate_up must be a CPU tensor");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0 &&
                  gate_up.scalar_type() == at::kFloat,
              name, ": gate_up must be float32 [T, 2 * I] with contiguous rows");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = at::empty({rows, inter}, gate_up.options());
  const float* xp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(inter, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) row_fn(xp + t * stride, xp + t * stride + inter, op + t * inter, inter);
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) { return glu_rows(gate_up, "silu_mul", silu_mul_row); }

// out[t] = gelu_tanh(gate[t]) * up[t] (GeGLU: Gemma's MLP), as silu_mul.
void gelu_mul_row(const float* gate, const float* up, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(gelu16(_mm512_loadu_ps(gate + i)), _mm512_loadu_ps(up + i)));
  }
#elif defined(WEFT_AVX2)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(gelu8(_mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) dst[i] = weft::vmath::gelu_tanh(gate[i]) * up[i];
}

at::Tensor gelu_mul(const at::Tensor& gate_up) { return glu_rows(gate_up, "gelu_mul", gelu_mul_row); }

// Rotary embedding in place, half-split layout, on the first `num_heads` heads of x [T, heads, D]
// (a view into the fused q/k/v output). cos/sin: float32 tables [max_positions, D/2].
template <typename T>
void rope_kernel(T* xp, int64_t tokens, int64_t t_stride, int64_t h_stride, int64_t num_heads, int64_t half,
                 const int64_t* pos, const float* cp, const float* sp) {
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * half;
      const float* s = sp + pos[t] * half;
      for (int64_t h = 0; h < num_heads; ++h) {
        T* x1 = xp + t * t_stride + h * h_stride;
        T* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          // cos and sin rounded to the storage dtype first, as the reference does
          const float ci = static_cast<float>(static_cast<T>(c[i]));
          const float si = static_cast<float>(static_cast<T>(s[i]));
          const float a = static_cast<float>(x1[i]), b = static_cast<float>(x2[i]);
          x1[i] = static_cast<T>(a * ci - b * si);
          x2[i] = static_cast<T>(b * ci + a * si);
        }
      }
    }
  });
}

void rope_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
           int64_t num_heads) {
  TORCH_CHECK(on_cpu({x, positions, cos, sin}), "rope_: every tensor must be on the CPU");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rope_: x must be [T, heads, D] with contiguous heads and an even D");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == x.size(2) / 2,
              "rope_: cos and sin must be contiguous float32 tables [P, D / 2]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.dim() == 1 &&
                  positions.size(0) == x.size(0),
              "rope_: positions must be [T] int64");
  TORCH_CHECK(num_heads >= 0 && num_heads <= x.size(1), "rope_: num_heads exceeds the heads of x");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rope_: a position is outside the cos/sin tables");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "weft_rope", [&] {
    rope_kernel<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.stride(0), x.stride(1), num_heads, x.size(2) / 2,
                          positions.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>());
  });
}

constexpr int64_t kMaxSplits = 4;  // ranges of a sequence's context at most (`split_blocks`)

// One query token per sequence against its cached keys and values, read in place from the paged
// cache [num_blocks, block_size, 2, KVH, D] through the block table [B, max_blocks]. q: [B, H, D].
//
// A work item is a range of one sequence's blocks, all heads at once, so that the cache is read
// front to back in a single pass (each block is one contiguous stretch of memory). Within a range,
// each chunk of blocks (`attend_chunk`) updates a running softmax (max m, sum l, weighted values acc
// per head); the ranges of a sequence are merged at the end, in order. A sequence's ranges depend
// on its own context length alone (`split_blocks`: 1, 2 or 4 of at least 4 blocks), never
// on what else the step holds or how many threads run it, so that a row's result depends on its
// own query and context alone (batch invariance: speculative decoding's verifying rows, computed
// beside drafts, are then the very numbers decoding computes without them).
struct DecodeShape {
  int64_t num_heads, head_dim, block_size, num_kv_heads, group, max_blocks, token_stride, block_stride;
  int64_t q_seq_stride, q_head_stride, num_splits;
  int64_t window;  // keys a query sees, itself included (a sliding-window layer); 0: all of them
  const float* sinks;  // [H] each head's attention sink (gpt-oss): a logit in the softmax with no value; or null
  float softcap;       // scores become softcap * tanh(score / softcap) (Gemma 2); 0: as they are
  bool prefetch;  // ask for each next block ahead of its use (the step's cache exceeds 16 MB)
};

// The KV cache's element types: float32, or bfloat16 / float16 beside float32 queries
// (`kv_cache_dtype`). Keys and values are widened to float32 as they are read.
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // a bfloat16 is a float32's upper half
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
// Elements i .. i + 15 of a cache row (i a multiple of 16; a Q8_0 row's scaled by their block's scale).
template <typename C>
inline __m512 load16_at(const C* row, int64_t i) { return load16(row + i); }
inline __m512 load16_at(const weft::BlockQ8* row, int64_t i) {
  const weft::BlockQ8& block = row[i / 32];
  const __m512i ints = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block.qs + i % 32)));
  const __m512 scale = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<int16_t>(block.d)));  // broadcast, widened
  return _mm512_mul_ps(scale, _mm512_cvtepi32_ps(ints));
}
#endif
#if defined(WEFT_AVX2) && defined(__F16C__)
#define WEFT_AVX2_CACHE 1  // the cache's vector paths on AVX2 (a float16 cache's vcvtph2ps is F16C's)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// Elements i .. i + 7 of a cache row (i a multiple of 8; a Q8_0 row's scaled by their block's scale).
template <typename C>
inline __m256 load8_at(const C* row, int64_t i) { return load8(row + i); }
inline __m256 load8_at(const weft::BlockQ8* row, int64_t i) {
  const weft::BlockQ8& block = row[i / 32];
  const __m256i ints = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block.qs + i % 32)));
  const __m256 scale = _mm256_cvtph_ps(_mm_set1_epi16(static_cast<int16_t>(block.d)));  // broadcast, widened
  return _mm256_mul_ps(scale, _mm256_cvtepi32_ps(ints));
}
#endif

// Element i of a cache row as float32.
template <typename C>
inline float value_at(const C* row, int64_t i) { return static_cast<float>(row[i]); }
inline float value_at(const weft::BlockQ8* row, int64_t i) { return weft::q8_value(row, i); }

struct Partial {  // running softmax of one work item: [H], [H], [H, D]
  float* m;
  float* l;
  float* acc;
};

// The tokens of a score tile of `heads` query heads in `lanes` accumulators (`dot_heads`): a power of
// two, so that whole tiles fill a block of 16 tokens (3 heads x 4 tokens leave 4 of 16 lanes idle).
constexpr int tile_tokens(int lanes, int heads) {
  int tokens = 1;
  while (2 * tokens * heads <= lanes) tokens *= 2;
  return tokens;
}

#if defined(__AVX512F__)
// One level of a 16 x 16 transpose-and-add: lanes of `a` and `b` in the halves (of width `kHalf`
// lanes) that `mask` selects are added to the neighbouring half, so that each result lane holds a
// partial sum of a or of b. Four levels turn 16 vectors into one vector of their 16 sums.
template <int kHalf>
inline __m512 fold(__m512 a, __m512 b) {
  constexpr __mmask16 mask = kHalf == 8 ? 0xFF00 : kHalf == 4 ? 0xF0F0 : kHalf == 2 ? 0xCCCC : 0xAAAA;
  const __m512 kept = _mm512_mask_blend_ps(mask, a, b);
  __m512 moved = _mm512_mask_blend_ps(mask, b, a);
  if constexpr (kHalf == 8) moved = _mm512_shuffle_f32x4(moved, moved, 0x4E);  // swap 256-bit halves
  if constexpr (kHalf == 4) moved = _mm512_shuffle_f32x4(moved, moved, 0xB1);  // swap 128-bit lanes
  if constexpr (kHalf == 2) moved = _mm512_permute_ps(moved, 0x4E);             // swap 64-bit pairs
  if constexpr (kHalf == 1) moved = _mm512_permute_ps(moved, 0xB1);             // swap neighbours
  return _mm512_add_ps(kept, moved);
}

// The 16 sums of 16 accumulators, acc[i]'s in lane i: one transpose-and-add (four levels of `fold`)
// instead of 16 horizontal sums, each accumulator's lanes added in the same order wherever it sits.
inline __m512 sums16(const __m512 (&acc)[16]) {
  __m512 c[8], e[4], f[2];
  for (int i = 0; i < 8; ++i) c[i] = fold<8>(acc[2 * i], acc[2 * i + 1]);
  for (int i = 0; i < 4; ++i) e[i] = fold<4>(c[2 * i], c[2 * i + 1]);
  for (int i = 0; i < 2; ++i) f[i] = fold<2>(e[2 * i], e[2 * i + 1]);
  const __m512 sums = fold<1>(f[0], f[1]);  // acc[i]'s sum in lane bitreverse(i)
  const __m512i bit_reversed = _mm512_setr_epi32(0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
  return _mm512_permutexvar_ps(bit_reversed, sums);
}

// scores[t] = q . k_t for 16 consecutive tokens (keys `token_stride` floats apart): 16 vector
// accumulators, then `sums16`.
template <int64_t kD, typename C>
inline void dot16(const C* keys, int64_t token_stride, const float* query, float* scores) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t d = 0; d < kD; d += 16) {
    const __m512 q = _mm512_loadu_ps(query + d);
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_fmadd_ps(load16_at(keys + t * token_stride, d), q, acc[t]);
  }
  _mm512_storeu_ps(scores, sums16(acc));
}

// The query heads a tile of `add_weighted_values_heads` takes at once: 4, 3 or 2 of a KV head's
// `group`, as many as keep their value sums in 16 registers of a head of kD; 1 (each head on its
// own) otherwise.
template <int64_t kD>
constexpr int heads_per_tile(int64_t group) {
  if (kD <= 0 || kD % 16 != 0) return 1;
  for (const int heads : {4, 3, 2}) {
    if (group % heads == 0 && heads * kD / 16 <= 16) return heads;
  }
  return 1;
}

// scores[h * chunk + t] = q_h . k_t for kHeads query heads (queries kD floats apart) and the
// tile_tokens(16, kHeads) consecutive tokens from `keys`: each key vector is read and widened once
// for all the heads of the tile (a half-precision cache's conversion was a quarter of the work when
// each of a group's 4 heads widened it again), and each dot reduced in the order `dot16` reduces it.
template <int64_t kD, int kHeads, typename C>
inline void dot_heads(const C* keys, int64_t token_stride, const float* queries, float* scores, int64_t chunk) {
  constexpr int kTokens = tile_tokens(16, kHeads);
  __m512 acc[16];  // acc[h * kTokens + t], and zeros beyond kHeads * kTokens
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < kD; d += 16) {
    for (int t = 0; t < kTokens; ++t) {
      const __m512 k = load16_at(keys + t * token_stride, d);
      for (int h = 0; h < kHeads; ++h) {
        acc[h * kTokens + t] = _mm512_fmadd_ps(k, _mm512_loadu_ps(queries + h * kD + d), acc[h * kTokens + t]);
      }
    }
  }
  alignas(64) float sums[16];  // sums[h * kTokens + t]
  _mm512_store_ps(sums, sums16(acc));
  for (int h = 0; h < kHeads; ++h) {
    for (int t = 0; t < kTokens; ++t) scores[h * chunk + t] = sums[h * kTokens + t];
  }
}

// acc_h[0..kD) += p_h[t] * v_t for kHeads query heads (sums kD floats apart, weights `chunk`
// apart) over a block's tokens: each value vector widened once for the tile's heads, every head's
// sums in the order `add_weighted_values` adds them.
template <int64_t kD, int kHeads, typename C>
inline void add_weighted_values_heads(const C* values, int64_t num_tokens, int64_t token_stride, const float* p,
                                      int64_t chunk, float* acc_out) {
  constexpr int kVecs = kD / 16;
  __m512 sums[kHeads * kVecs];
  for (int i = 0; i < kHeads * kVecs; ++i) sums[i] = _mm512_loadu_ps(acc_out + 16 * i);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int j = 0; j < kVecs; ++j) {
      const __m512 v = load16_at(values + t * token_stride, 16 * j);
      for (int h = 0; h < kHeads; ++h) {
        sums[h * kVecs + j] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * chunk + t]), v, sums[h * kVecs + j]);
      }
    }
  }
  for (int i = 0; i < kHeads * kVecs; ++i) _mm512_storeu_ps(acc_out + 16 * i, sums[i]);
}
#endif

#if defined(__AVX512F__)
// The lanes of a 16-wide vector that hold the next `remaining` elements (all 16 if there are more).
inline __mmask16 first_lanes(int64_t remaining) {
  return remaining >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << remaining) - 1);
}
#endif

// The largest of n > 0 scores.
inline float max_of(const float* scores, int64_t n) {
#if defined(__AVX512F__)
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 mask = first_lanes(n - t);
    best = _mm512_mask_max_ps(best, mask, best, _mm512_maskz_loadu_ps(mask, scores + t));
  }
  return _mm512_reduce_max_ps(best);
#else
  float best = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#if defined(WEFT_AVX2)
  __m256 lanes = _mm256_set1_ps(best);
  for (; t + 8 <= n; t += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(scores + t));
  best = reduce_max8(lanes);
#endif
  for (; t < n; ++t) best = std::max(best, scores[t]);
  return best;
#endif
}

// scores[t] = exp(scores[t] - max) for the n scores of a block; returns their sum.
inline float exp_shifted(float* scores, int64_t n, float max) {
#if defined(__AVX512F__)
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 mask = first_lanes(n - t);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, scores + t), _mm512_set1_ps(max)));
    _mm512_mask_storeu_ps(scores + t, mask, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mask, e));
  }
  return _mm512_reduce_add_ps(total);
#else
  float sum = 0.f;
  int64_t t = 0;
#if defined(WEFT_AVX2)
  __m256 total = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), _mm256_set1_ps(max)));
    _mm256_storeu_ps(scores + t, e);
    total = _mm256_add_ps(total, e);
  }
  sum = reduce_add8(total);
#endif
  for (; t < n; ++t) {
    scores[t] = exp_approx(scores[t] - max);
    sum += scores[t];
  }
  return sum;
#endif
}

// Whether C is one of the cache types that are widened as they are read (as opposed to the queries'
// own type): half precision, or Q8_0 blocks.
template <typename C>
constexpr bool kWidenedCache =
    std::is_same_v<C, c10::BFloat16> || std::is_same_v<C, c10::Half> || std::is_same_v<C, weft::BlockQ8>;
// Whether the vector loops read a cache of type C (float32 or a widened one).
template <typename C>
constexpr bool kVectorCache = std::is_same_v<C, float> || kWidenedCache<C>;

#if defined(WEFT_AVX2_CACHE)
// The 8 sums of 8 accumulators, acc[i]'s in lane i: one transpose-and-add (three levels of hadd and
// a lane swap) instead of 8 horizontal sums.
inline __m256 sums8(const __m256 (&acc)[8]) {
  const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);  // per 128-bit lane
  const __m256 low = _mm256_permute2f128_ps(h0123, h4567, 0x20), high = _mm256_permute2f128_ps(h0123, h4567, 0x31);
  return _mm256_add_ps(low, high);
}

// scores[t] = q . k_t for 8 consecutive tokens (keys `token_stride` elements apart, kD a multiple
// of 8): 8 vector accumulators, then `sums8`.
template <int64_t kD, typename C>
inline void dot8(const C* keys, int64_t token_stride, const float* query, float* scores) {
  __m256 acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t d = 0; d < kD; d += 8) {
    const __m256 q = _mm256_loadu_ps(query + d);
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(load8_at(keys + t * token_stride, d), q, acc[t]);
  }
  _mm256_storeu_ps(scores, sums8(acc));
}

// `dot_heads` of AVX-512 in 8 lanes: kHeads query heads and tile_tokens(8, kHeads) tokens, each
// dot reduced in the order `dot8` reduces it.
template <int64_t kD, int kHeads, typename C>
inline void dot_heads(const C* keys, int64_t token_stride, const float* queries, float* scores, int64_t chunk) {
  constexpr int kTokens = tile_tokens(8, kHeads);
  __m256 acc[8];  // acc[h * kTokens + t], and zeros beyond kHeads * kTokens
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < kD; d += 8) {
    for (int t = 0; t < kTokens; ++t) {
      const __m256 k = load8_at(keys + t * token_stride, d);
      for (int h = 0; h < kHeads; ++h) {
        acc[h * kTokens + t] = _mm256_fmadd_ps(k, _mm256_loadu_ps(queries + h * kD + d), acc[h * kTokens + t]);
      }
    }
  }
  alignas(32) float sums[8];  // sums[h * kTokens + t]
  _mm256_store_ps(sums, sums8(acc));
  for (int h = 0; h < kHeads; ++h) {
    for (int t = 0; t < kTokens; ++t) scores[h * chunk + t] = sums[h * kTokens + t];
  }
}
#endif

#if defined(__AVX512F__)
constexpr int64_t kScoreLanes = 16;  // the dots of one tile of `dot_heads`
#elif defined(WEFT_AVX2_CACHE)
constexpr int64_t kScoreLanes = 8;
#endif

// The query heads a tile of `dot_heads` takes at once: 4, 3 or 2 of a KV head's `group`, or 1.
inline int score_heads_per_tile(int64_t group) {
  return group % 4 == 0 ? 4 : group % 3 == 0 ? 3 : group % 2 == 0 ? 2 : 1;
}

// q . k for one key of D <= 256 elements, a half-precision or Q8_0 one widened first: the float32
// loop's sums in its order, so that such a cache computes what a float32 cache of its values does.
template <typename C>
inline float dot_widened(const C* key, const float* query, int64_t D) {
  if constexpr (kWidenedCache<C>) {
    float row[256];
    for (int64_t i = 0; i < D; ++i) row[i] = value_at(key, i);
    return dot(row, query, D);
  } else {
    return dot(key, query, D);
  }
}

// scores[t] = q . k_t for the tokens of a block (keys of the cache's type C).
template <typename C, int64_t kHeadDim>
inline void block_scores(const C* keys, int64_t num_tokens, int64_t token_stride, int64_t D, const float* query,
                         float* scores) {
  int64_t t = 0;
#if defined(__AVX512F__)
  if constexpr (kVectorCache<C> && kHeadDim > 0 && kHeadDim % 16 == 0) {
    for (; t + 16 <= num_tokens; t += 16) dot16<kHeadDim>(keys + t * token_stride, token_stride, query, scores + t);
  }
#elif defined(WEFT_AVX2_CACHE)
  if constexpr (kVectorCache<C> && kHeadDim > 0 && kHeadDim % 8 == 0) {
    for (; t + 8 <= num_tokens; t += 8) dot8<kHeadDim>(keys + t * token_stride, token_stride, query, scores + t);
  }
#endif
  for (; t < num_tokens; ++t) scores[t] = dot_widened(keys + t * token_stride, query, D);
}

// acc[0..D) += p[t] * v_t over a block's tokens (values `token_stride` elements apart). kHeadDim > 0:
// the head size as a compile-time constant (the accumulator in registers).
template <typename C, int64_t kHeadDim>
inline void add_weighted_values(const C* values, int64_t num_tokens, int64_t token_stride, int64_t head_dim,
                                const float* p, float* acc_out) {
  const int64_t D = kHeadDim > 0 ? kHeadDim : head_dim;
#if defined(__AVX512F__)
  if constexpr (kVectorCache<C> && kHeadDim > 0 && kHeadDim % 16 == 0) {  // sums in registers
    constexpr int kVecs = kHeadDim / 16;
    __m512 sums[kVecs];
    for (int j = 0; j < kVecs; ++j) sums[j] = _mm512_loadu_ps(acc_out + 16 * j);
    for (int64_t t = 0; t < num_tokens; ++t) {
      const __m512 weight = _mm512_set1_ps(p[t]);
      for (int j = 0; j < kVecs; ++j) sums[j] = _mm512_fmadd_ps(weight, load16_at(values + t * token_stride, 16 * j), sums[j]);
    }
    for (int j = 0; j < kVecs; ++j) _mm512_storeu_ps(acc_out + 16 * j, sums[j]);
    return;
  }
#elif defined(WEFT_AVX2_CACHE)
  if constexpr (kVectorCache<C> && kHeadDim > 0 && kHeadDim % 8 == 0 &&
                kHeadDim <= 128) {  // sums in registers
    constexpr int kVecs = kHeadDim / 8;
    __m256 sums[kVecs];
    for (int j = 0; j < kVecs; ++j) sums[j] = _mm256_loadu_ps(acc_out + 8 * j);
    for (int64_t t = 0; t < num_tokens; ++t) {
      const __m256 weight = _mm256_set1_ps(p[t]);
      for (int j = 0; j < kVecs; ++j) sums[j] = _mm256_fmadd_ps(weight, load8_at(values + t * token_stride, 8 * j), sums[j]);
    }
    for (int j = 0; j < kVecs; ++j) _mm256_storeu_ps(acc_out + 8 * j, sums[j]);
    return;
  }
#endif
  float acc[kHeadDim > 0 ? kHeadDim : 256];
#pragma omp simd
  for (int64_t i = 0; i < D; ++i) acc[i] = acc_out[i];
  for (int64_t t = 0; t < num_tokens; ++t) {
    const C* v = values + t * token_stride;
    const float weight = p[t];
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) acc[i] += weight * value_at(v, i);
  }
#pragma omp simd
  for (int64_t i = 0; i < D; ++i) acc_out[i] = acc[i];
}

#if defined(__AVX512F__) || defined(WEFT_AVX2_CACHE)
// group_scores for a tile of kHeads heads: whole tiles of tile_tokens(kScoreLanes, kHeads) tokens,
// the rest head by head.
template <int kHeads, int64_t kD, typename C>
inline void tiled_scores(const C* keys, int64_t num_tokens, int64_t token_stride, const float* queries, int64_t group,
                         float* scores, int64_t chunk) {
  constexpr int64_t kTokens = tile_tokens(kScoreLanes, kHeads);
  const int64_t whole = num_tokens / kTokens * kTokens;
  for (int64_t h = 0; h < group; h += kHeads) {
    for (int64_t t = 0; t < whole; t += kTokens) {
      dot_heads<kD, kHeads>(keys + t * token_stride, token_stride, queries + h * kD, scores + h * chunk + t, chunk);
    }
  }
  for (int64_t h = 0; h < group && whole < num_tokens; ++h) {
    block_scores<C, kD>(keys + whole * token_stride, num_tokens - whole, token_stride, kD, queries + h * kD,
                        scores + h * chunk + whole);
  }
}
#endif

#if defined(__AVX512F__)
// group_values for a tile of kHeads heads: the group's heads kHeads at a time.
template <int kHeads, int64_t kD, typename C>
inline void tiled_values(const C* values, int64_t num_tokens, int64_t token_stride, const float* p, int64_t chunk,
                         int64_t group, float* acc) {
  for (int64_t h = 0; h < group; h += kHeads) {
    add_weighted_values_heads<kD, kHeads>(values, num_tokens, token_stride, p + h * chunk, chunk, acc + h * kD);
  }
}
#endif

// fn(std::integral_constant<int, heads>{}) where `heads` is a tile's (4, 3 or 2); false for 1 (no tile).
template <typename Fn>
inline bool with_tile_heads(int heads, Fn&& fn) {
  if (heads == 4) fn(std::integral_constant<int, 4>{});
  if (heads == 3) fn(std::integral_constant<int, 3>{});
  if (heads == 2) fn(std::integral_constant<int, 2>{});
  return heads >= 2 && heads <= 4;
}

// block_scores for the `group` query heads of one KV head (queries D apart, score rows `chunk`
// apart): in tiles of several heads (`score_heads_per_tile`) where the head size is a whole number of
// vectors.
template <typename C, int64_t kHeadDim>
inline void group_scores(const C* keys, int64_t num_tokens, int64_t token_stride, int64_t D, const float* queries,
                         int64_t group, float* scores, int64_t chunk) {
#if defined(__AVX512F__) || defined(WEFT_AVX2_CACHE)
  if constexpr (kVectorCache<C> && kHeadDim > 0 && kHeadDim % kScoreLanes == 0) {
    const auto tiles = [&](auto heads) {
      tiled_scores<decltype(heads)::value, kHeadDim>(keys, num_tokens, token_stride, queries, group, scores, chunk);
    };
    if (with_tile_heads(score_heads_per_tile(group), tiles)) return;
  }
#endif
  for (int64_t h = 0; h < group; ++h) {
    block_scores<C, kHeadDim>(keys, num_tokens, token_stride, D, queries + h * D, scores + h * chunk);
  }
}

// add_weighted_values for the `group` query heads of one KV head (weights `chunk` apart, sums D
// apart), in tiles of several heads as `group_scores`.
template <typename C, int64_t kHeadDim>
inline void group_values(const C* values, int64_t num_tokens, int64_t token_stride, int64_t D, const float* p,
                         int64_t chunk, int64_t group, float* acc) {
#if defined(__AVX512F__)
  if constexpr (kVectorCache<C> && kHeadDim > 0 && kHeadDim % 16 == 0) {
    const auto tiles = [&](auto heads) {
      tiled_values<decltype(heads)::value, kHeadDim>(values, num_tokens, token_stride, p, chunk, group, acc);
    };
    if (with_tile_heads(heads_per_tile<kHeadDim>(group), tiles)) return;
  }
#endif
  for (int64_t h = 0; h < group; ++h) {
    add_weighted_values<C, kHeadDim>(values, num_tokens, token_stride, D, p + h * chunk, acc + h * D);
  }
}

// One KV head's rows of a block (keys or values, `token_stride` units apart) as float32 rows D apart
// in `out`.
template <typename C, int64_t kHeadDim>
inline void widen_rows(const C* rows, int64_t num_tokens, int64_t token_stride, int64_t D, float* out) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const C* row = rows + t * token_stride;
    float* dst = out + t * D;
    int64_t i = 0;
#if defined(__AVX512F__)
    if constexpr (kHeadDim > 0 && kHeadDim % 16 == 0) {
      for (; i < kHeadDim; i += 16) _mm512_storeu_ps(dst + i, load16_at(row, i));
    }
#elif defined(WEFT_AVX2_CACHE)
    if constexpr (kHeadDim > 0 && kHeadDim % 8 == 0) {
      for (; i < kHeadDim; i += 8) _mm256_storeu_ps(dst + i, load8_at(row, i));
    }
#endif
    for (; i < D; ++i) dst[i] = value_at(row, i);
  }
}

// Calls each(rows, token_stride) with one KV head's rows of a block for the query heads of its
// group to read: in place, or those of a Q8_0 cache widened once into `wide` ([block_size, D]). (A
// Q8_0 row costs a sign extension, a conversion and a scaling per 8 elements, which 4 query heads
// repeating took 2x the time at 4k tokens; a half one's single vcvtph2ps or shift is left in place,
// and so is a Q8_0 row that tiles of 4 heads widen once for all 4: 0.31 against 0.44 ms at 4k.)
template <typename C, int64_t kHeadDim, typename Each>
inline void for_kv_head(const C* rows, int64_t num_tokens, int64_t token_stride, int64_t D, int64_t group, float* wide,
                        Each&& each) {
  if constexpr (std::is_same_v<C, weft::BlockQ8>) {
#if defined(__AVX512F__)
    if (heads_per_tile<kHeadDim>(group) == 4) return each(rows, token_stride);
#endif
    widen_rows<C, kHeadDim>(rows, num_tokens, token_stride, D, wide);
    each(static_cast<const float*>(wide), D);
  } else {
    each(rows, token_stride);
  }
}

// Asks for part `part` of `parts` of the next block of the cache, ahead of its use: blocks are
// scattered in memory, so the hardware prefetcher cannot run ahead across them on its own, and
// asking for a whole block at once would stall on the CPU's few outstanding-miss slots.
template <typename T>
inline void prefetch_part(const T* block, int64_t elements, int64_t part, int64_t parts) {
  if (block == nullptr) return;
  const char* p = reinterpret_cast<const char*>(block);
  const int64_t bytes = elements * static_cast<int64_t>(sizeof(T)), lines = (bytes + 63) / 64;
  for (int64_t line = part * lines / parts; line < (part + 1) * lines / parts; ++line) __builtin_prefetch(p + line * 64, 0, 2);
}

// The tokens of a chunk: as many whole blocks as keep the chunk's keys and values (about 256 KB) in
// L2 between its two passes, at least one block and at most 512 tokens.
template <typename T>
inline int64_t chunk_tokens(const DecodeShape& sh) {
  const int64_t token_bytes = sh.token_stride * static_cast<int64_t>(sizeof(T));
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(262144 / token_bytes, 512) / sh.block_size);
  return blocks * sh.block_size;
}

// One chunk of a work item's tokens [begin, end) (block by block from `begin`), every head, in two
// passes over its blocks, each block read front to back as one stretch of memory: the scores of
// every token for every head (scores [H, chunk]), then per head one update of the running softmax
// (m, l, acc) for the whole chunk, then the values weighted by the scores. One max, one sum and one
// rescale per head and chunk, not per block of 16 tokens: at the bundled model's size (6 heads of
// 32, 150 tokens) that bookkeeping was most of the time.
template <typename C, int64_t kHeadDim>
void attend_chunk(const C* cache, const int64_t* blocks, int64_t begin, int64_t end, int64_t range_end,
                  const float* queries, const DecodeShape& sh, int64_t chunk, float* scores, float* wide, Partial part) {
  const int64_t D = kHeadDim > 0 ? kHeadDim : sh.head_dim, bs = sh.block_size, n = end - begin;
  const int64_t head_units = D / weft::kPerUnit<C>;  // a head's row in the cache's units
  for (int64_t t0 = begin, stop = 0; t0 < end; t0 = stop) {  // pass 1: scores
    stop = std::min(end, (t0 / bs + 1) * bs);  // the rest of t0's block (a window starts mid-block)
    const C* block = cache + blocks[t0 / bs] * sh.block_stride + (t0 % bs) * sh.token_stride;
    const C* next = stop < range_end ? cache + blocks[t0 / bs + 1] * sh.block_stride : nullptr;
    const int64_t num_tokens = stop - t0;
    for (int64_t kvh = 0; kvh < sh.num_kv_heads; ++kvh) {
      for_kv_head<C, kHeadDim>(block + kvh * head_units, num_tokens, sh.token_stride, D, sh.group, wide,
                               [&](const auto* keys, int64_t stride) {
        using R = std::remove_cv_t<std::remove_pointer_t<decltype(keys)>>;
        for (int64_t h = kvh * sh.group; h < (kvh + 1) * sh.group && sh.prefetch; ++h) {
          prefetch_part(next, sh.block_stride, h, sh.num_heads);
        }
        const int64_t h0 = kvh * sh.group;
        group_scores<R, kHeadDim>(keys, num_tokens, stride, D, queries + h0 * D, sh.group,
                                  scores + h0 * chunk + (t0 - begin), chunk);
      });
    }
  }
  for (int64_t h = 0; h < sh.num_heads; ++h) {  // the running softmax, once per head
    float* p = scores + h * chunk;
    if (sh.softcap > 0.f) {
      for (int64_t i = 0; i < n; ++i) p[i] = sh.softcap * std::tanh(p[i] / sh.softcap);
    }
    const float new_max = std::max(part.m[h], max_of(p, n));
    const float rescale = exp_approx(part.m[h] - new_max);
    const float sum = exp_shifted(p, n, new_max);
    part.m[h] = new_max;
    part.l[h] = part.l[h] * rescale + sum;
    float* acc = part.acc + h * D;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) acc[i] *= rescale;
  }
  for (int64_t t0 = begin, stop = 0; t0 < end; t0 = stop) {  // pass 2: values (the chunk is still in L2)
    stop = std::min(end, (t0 / bs + 1) * bs);
    const C* block = cache + blocks[t0 / bs] * sh.block_stride + (t0 % bs) * sh.token_stride;
    const int64_t num_tokens = stop - t0;
    for (int64_t kvh = 0; kvh < sh.num_kv_heads; ++kvh) {
      const C* rows = block + (sh.num_kv_heads + kvh) * head_units;
      for_kv_head<C, kHeadDim>(rows, num_tokens, sh.token_stride, D, sh.group, wide,
                               [&](const auto* values, int64_t stride) {
        using R = std::remove_cv_t<std::remove_pointer_t<decltype(values)>>;
        const int64_t h0 = kvh * sh.group;
        group_values<R, kHeadDim>(values, num_tokens, stride, D, scores + h0 * chunk + (t0 - begin), chunk, sh.group,
                                  part.acc + h0 * D);
      });
    }
  }
}

template <typename C, int64_t kHeadDim>
void attend_range(const C* cache, const int64_t* blocks, int64_t begin, int64_t end, const float* queries,
                  const DecodeShape& sh, std::vector<float>& scores, Partial part) {
  const int64_t chunk = chunk_tokens<C>(sh);
  // the chunk's scores [H, chunk], then (a Q8_0 cache) a block's rows of one KV head widened to
  // float32 [block_size, D] (`for_kv_head`)
  const int64_t wide = std::is_same_v<C, weft::BlockQ8> ? sh.block_size * sh.head_dim : 0;
  const int64_t size = sh.num_heads * chunk + wide;
  if (static_cast<int64_t>(scores.size()) < size) scores.resize(size);
  for (int64_t first = begin; first < end; first += chunk) {
    attend_chunk<C, kHeadDim>(cache, blocks, first, std::min(end, first + chunk), end, queries, sh, chunk,
                              scores.data(), scores.data() + sh.num_heads * chunk, part);
  }
}

// The ranges of a sequence of `num_blocks` blocks, a function of its length alone: the largest power
// of two up to kMaxSplits that leaves each at least 4 blocks (so that 2 or 4 threads share them evenly).
inline int64_t num_ranges(int64_t num_blocks) {
  int64_t splits = 1;
  while (2 * splits <= kMaxSplits && 2 * splits * 4 <= num_blocks) splits *= 2;
  return splits;
}

// The blocks of each of those ranges, of equal length but the last.
inline int64_t split_blocks(int64_t num_blocks) {
  const int64_t splits = num_ranges(num_blocks);
  return (num_blocks + splits - 1) / splits;
}

// The first key a decode query at position len - 1 sees: 0, or the start of its window.
inline int64_t window_start(int64_t len, const DecodeShape& sh) {
  return sh.window > 0 ? std::max<int64_t>(0, len - sh.window) : 0;
}

template <typename T, typename C>
void decode_range(const T* qp, const C* cache, const int64_t* blocks, int64_t len, int64_t b, int64_t split,
                  const DecodeShape& sh, float scale, std::vector<float>& queries, std::vector<float>& scores,
                  Partial part) {
  const int64_t D = sh.head_dim, start = window_start(len, sh), first_block = start / sh.block_size;
  const int64_t num_blocks = (len + sh.block_size - 1) / sh.block_size - first_block;
  const int64_t per_split = split_blocks(num_blocks);
  const int64_t first = first_block + split * per_split;
  const int64_t last = std::min(first_block + num_blocks, first + per_split);
  for (int64_t h = 0; h < sh.num_heads; ++h) {
    const T* src = qp + b * sh.q_seq_stride + h * sh.q_head_stride;
    for (int64_t i = 0; i < D; ++i) queries[h * D + i] = static_cast<float>(src[i]) * scale;
    part.m[h] = -std::numeric_limits<float>::infinity();
    part.l[h] = 0.f;
  }
  std::fill(part.acc, part.acc + sh.num_heads * D, 0.f);
  if (first >= last) return;  // an empty range
  const int64_t begin = std::max(start, first * sh.block_size), end = std::min(len, last * sh.block_size);
  if (D == 32) {
    attend_range<C, 32>(cache, blocks, begin, end, queries.data(), sh, scores, part);
  } else if (D == 64) {
    attend_range<C, 64>(cache, blocks, begin, end, queries.data(), sh, scores, part);
  } else if (D == 128) {
    attend_range<C, 128>(cache, blocks, begin, end, queries.data(), sh, scores, part);
  } else {
    attend_range<C, 0>(cache, blocks, begin, end, queries.data(), sh, scores, part);
  }
}

// out[b, h] = sum over splits of acc * exp(m - M) / (sum of l * exp(m - M) + exp(sink - M)), M the
// largest m (and sink), where the head has an attention sink.
template <typename T>
void merge_splits(const std::vector<float>& m, const std::vector<float>& l, const std::vector<float>& acc,
                  int64_t num_seqs, const DecodeShape& sh, T* op) {
  const int64_t H = sh.num_heads, D = sh.head_dim, S = sh.num_splits;
  at::parallel_for(0, num_seqs, 8, [&](int64_t first, int64_t last) {
    std::vector<float> out(D);
    for (int64_t b = first; b < last; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        float max = sh.sinks == nullptr ? -std::numeric_limits<float>::infinity() : sh.sinks[h], total = 0.f;
        for (int64_t s = 0; s < S; ++s) max = std::max(max, m[(b * S + s) * H + h]);
        if (sh.sinks != nullptr) total = std::exp(sh.sinks[h] - max);
        std::fill(out.begin(), out.end(), 0.f);
        for (int64_t s = 0; s < S; ++s) {
          const int64_t row = (b * S + s) * H + h;
          if (l[row] == 0.f) continue;  // an empty range
          const float weight = std::exp(m[row] - max);
          total += l[row] * weight;
          for (int64_t i = 0; i < D; ++i) out[i] += acc[row * D + i] * weight;
        }
        T* dst = op + (b * H + h) * D;
        for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<T>(out[i] / total);
      }
    }
  });
}

template <typename T, typename C>
void decode_kernel(const T* qp, const C* cache, const int64_t* table, const int64_t* lens, int64_t num_seqs,
                   DecodeShape sh, float scale, T* op) {
  int64_t most_blocks = 0;  // the most blocks a query reads: their ranges are the most any sequence has
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t blocks = (lens[b] + sh.block_size - 1) / sh.block_size - window_start(lens[b], sh) / sh.block_size;
    most_blocks = std::max(most_blocks, blocks);
  }
  sh.num_splits = num_ranges(most_blocks);
  const int64_t H = sh.num_heads, D = sh.head_dim, items = num_seqs * sh.num_splits;
  std::vector<float> m(items * H), l(items * H), acc(items * H * D);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(H * D), scores(sh.block_size);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / sh.num_splits, split = item % sh.num_splits;
      Partial part{&m[item * H], &l[item * H], &acc[item * H * D]};
      decode_range(qp, cache, table + b * sh.max_blocks, lens[b], b, split, sh, scale, queries, scores, part);
    }
  });
  merge_splits(m, l, acc, num_seqs, sh, op);
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, double scale, int64_t window,
                                  const std::optional<at::Tensor>& sinks, double softcap) {
  TORCH_CHECK(on_cpu({q, kv_cache, block_table, context_lens}),
              "paged_decode_attention: every tensor must be on the CPU");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_decode_attention: q must be [B, H, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && weft::cache_dtype_ok(q, kv_cache),
              "paged_decode_attention: kv_cache must be contiguous [blocks, block_size, 2, KVH, D] of q's dtype, "
              "or bfloat16, float16 or Q8_0 (uint8) beside float32 q");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous() && block_table.dim() == 2 &&
                  block_table.size(0) == q.size(0),
              "paged_decode_attention: block_table must be contiguous [B, max_blocks] int64");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                  context_lens.size(0) == q.size(0),
              "paged_decode_attention: context_lens must be [B] int64");
  DecodeShape sh{};
  sh.num_heads = q.size(1);
  sh.head_dim = q.size(2);
  sh.block_size = kv_cache.size(1);
  sh.num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(sh.num_kv_heads > 0 && sh.block_size > 0 && sh.head_dim > 0 && kv_cache.size(2) == 2,
              "paged_decode_attention: kv_cache has an empty dimension");
  const bool q8 = kv_cache.scalar_type() == at::kByte;
  TORCH_CHECK(!q8 || sh.head_dim % weft::kQ8Elements == 0,
              "paged_decode_attention: a Q8_0 cache needs head_dim a multiple of 32");
  TORCH_CHECK(kv_cache.size(4) == weft::cache_row_size(kv_cache, sh.head_dim) && sh.num_heads % sh.num_kv_heads == 0,
              "paged_decode_attention: q and kv_cache disagree on head_dim or head counts");
  TORCH_CHECK(sh.head_dim <= 256, "paged_decode_attention: head_dim above 256 is not supported");
  sh.group = sh.num_heads / sh.num_kv_heads;
  sh.max_blocks = block_table.size(1);
  sh.token_stride = 2 * sh.num_kv_heads * weft::cache_units(kv_cache, sh.head_dim);  // in the cache's units
  sh.block_stride = sh.block_size * sh.token_stride;
  sh.q_seq_stride = q.stride(0);
  sh.q_head_stride = q.stride(1);
  TORCH_CHECK(window >= 0, "paged_decode_attention: window must be >= 0 (0: no window)");
  sh.window = window;
  TORCH_CHECK(softcap >= 0, "paged_decode_attention: softcap must be >= 0 (0: none)");
  sh.softcap = static_cast<float>(softcap);
  sh.sinks = weft::attention_sinks(sinks, sh.num_heads, "paged_decode_attention");
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    const int64_t* table = block_table.data_ptr<int64_t>();
    TORCH_CHECK(lens[b] > 0 && lens[b] <= sh.max_blocks * sh.block_size,
                "paged_decode_attention: a context length exceeds the block table");
    for (int64_t i = 0; i < (lens[b] + sh.block_size - 1) / sh.block_size; ++i) {
      const int64_t block = table[b * sh.max_blocks + i];
      TORCH_CHECK(block >= 0 && block < kv_cache.size(0), "paged_decode_attention: a block id is outside the cache");
    }
  }
  // Software prefetch pays where the step's keys and values come from memory (5-10% at 25-270 MB)
  // and costs where they are in cache (10-25% at the bundled model's 0.2-12 MB): the bytes decide.
  int64_t tokens = 0;
  for (int64_t b = 0; b < q.size(0); ++b) tokens += lens[b] - window_start(lens[b], sh);
  const int64_t token_bytes = kv_cache[0].nbytes() / sh.block_size;
  sh.prefetch = tokens * token_bytes > (int64_t{16} << 20);
  auto out = at::empty({q.size(0), sh.num_heads, sh.head_dim}, q.options());
  const int64_t* table = block_table.data_ptr<int64_t>();
  const auto s = static_cast<float>(scale);
  if (kv_cache.scalar_type() == at::kBFloat16 && q.scalar_type() == at::kFloat) {
    decode_kernel(q.data_ptr<float>(), kv_cache.data_ptr<c10::BFloat16>(), table, lens, q.size(0), sh, s, out.data_ptr<float>());
  } else if (kv_cache.scalar_type() == at::kHalf && q.scalar_type() == at::kFloat) {
    decode_kernel(q.data_ptr<float>(), kv_cache.data_ptr<c10::Half>(), table, lens, q.size(0), sh, s, out.data_ptr<float>());
  } else if (q8) {
    const auto* cache = reinterpret_cast<const weft::BlockQ8*>(kv_cache.data_ptr<uint8_t>());
    decode_kernel(q.data_ptr<float>(), cache, table, lens, q.size(0), sh, s, out.data_ptr<float>());
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "weft_paged_decode_attention", [&] {
      decode_kernel(q.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>(), table, lens, q.size(0), sh, s,
                    out.data_ptr<scalar_t>());
    });
  }
  return out;
}

// Grammar mask in place: logits[rows[r], v] = -inf where bit v of bitmask[r] is 0 (bit v is bit
// v % 32 of int32 word v / 32; tokens past the mask's words are disallowed too). rows: [R] int64,
// or empty when row r of the mask is row r of the logits. Words that allow all or none of their 32
// tokens take a shortcut.
void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(on_cpu({logits, bitmask, rows}), "apply_token_bitmask_: every tensor must be on the CPU");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "apply_token_bitmask_: logits must be float32 [B, V] with contiguous rows");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous(),
              "apply_token_bitmask_: bitmask must be a contiguous int32 [R, W]");
  const int64_t num_rows = bitmask.size(0), num_words = bitmask.size(1), vocab = logits.size(1);
  const bool all_rows = rows.numel() == 0;
  TORCH_CHECK(all_rows ? num_rows == logits.size(0)
                       : (rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() &&
                          rows.numel() == num_rows),
              "apply_token_bitmask_: rows must be [R] int64 (or empty with one mask row per logits row)");
  const int64_t* row_idx = all_rows ? nullptr : rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t row = all_rows ? r : row_idx[r];
    TORCH_CHECK(row >= 0 && row < logits.size(0), "apply_token_bitmask_: row index out of range");
  }
  const int32_t* words = bitmask.data_ptr<int32_t>();
  float* lp = logits.data_ptr<float>();
  const float minus_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* out = lp + (all_rows ? r : row_idx[r]) * logits.stride(0);
      const int32_t* mask = words + r * num_words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t bits = w < num_words ? static_cast<uint32_t>(mask[w]) : 0u;
        if (bits == 0xFFFFFFFFu) continue;
        const int64_t count = std::min<int64_t>(32, vocab - w * 32);
        if (bits == 0u) {  // the common case deep in a grammar: nothing allowed
          std::fill(out + w * 32, out + w * 32 + count, minus_inf);
          continue;
        }
        for (int64_t j = 0; j < count; ++j) {
          if (!((bits >> j) & 1u)) out[w * 32 + j] = minus_inf;
        }
      }
    }
  });
}

// Insert (v, j) into a row's sorted top list (value descending, then index ascending) of `count`
// entries out of `num_top`; an entry must beat the last one strictly once the list is full.
inline void keep_top(float v, int64_t j, float* kept, int64_t* kept_ids, int64_t& count, int64_t num_top) {
  if (count == num_top && !(v > kept[num_top - 1])) return;
  int64_t pos = count < num_top ? count++ : num_top - 1;
  while (pos > 0 && v > kept[pos - 1]) {
    kept[pos] = kept[pos - 1];
    kept_ids[pos] = kept_ids[pos - 1];
    --pos;
  }
  kept[pos] = v;
  kept_ids[pos] = j;
}

// The num_top largest values of each row of x ([R, V] float32), ordered by value then by the
// smaller index (NaN counts as -inf): one pass over each row keeping a small sorted list, where a
// value must beat the list's last entry strictly to enter (an equal one has a larger index).
std::tuple<at::Tensor, at::Tensor> top_by_value_then_index(const at::Tensor& x, int64_t num_top) {
  TORCH_CHECK(on_cpu({x}), "top_by_value_then_index: x must be a CPU tensor");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "top_by_value_then_index: x must be float32 [R, V] with contiguous rows");
  TORCH_CHECK(num_top >= 0 && num_top <= x.size(1), "top_by_value_then_index: num_top must be in [0, V]");
  const int64_t rows = x.size(0), vocab = x.size(1), stride = x.stride(0);
  auto ids = at::empty({rows, num_top}, x.options().dtype(at::kLong));
  auto values = at::empty({rows, num_top}, x.options());
  const float* xp = x.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* vp = values.data_ptr<float>();
  const float minus_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * stride;
      float* kept = vp + r * num_top;
      int64_t* kept_ids = ip + r * num_top;
      int64_t count = 0;
      for (int64_t j = 0; j < vocab && num_top > 0; ++j) {
        keep_top(std::isnan(row[j]) ? minus_inf : row[j], j, kept, kept_ids, count, num_top);
      }
    }
  });
  return {ids, values};
}

// 1 + the number of entries of each row of x ([R, V] float32) strictly greater than x[r, ids[r]].
at::Tensor rank_of(const at::Tensor& x, const at::Tensor& ids) {
  TORCH_CHECK(on_cpu({x, ids}), "rank_of: x and ids must be CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "rank_of: x must be float32 [R, V] with contiguous rows");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.size(0) == x.size(0),
              "rank_of: ids must be [R] int64");
  const int64_t rows = x.size(0), vocab = x.size(1), stride = x.stride(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(ip[r] >= 0 && ip[r] < vocab, "rank_of: an id is outside the row");
  }
  auto ranks = at::empty({rows}, ids.options());
  int64_t* rp = ranks.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * stride;
      const float chosen = row[ip[r]];
      int64_t above = 0;
      for (int64_t j = 0; j < vocab; ++j) above += row[j] > chosen;
      rp[r] = above + 1;
    }
  });
  return ranks;
}

// Row r's log-normalizer: max + log(sum(exp(x - max))) as (max, log-sum), or NaN for a row with a
// NaN; an all -inf row gives -inf - -inf = NaN values, as torch.log_softmax does.
struct LogNormalizer {
  float max;
  float log_sum;
};

// The row's largest value, or NaN when it holds a NaN.
float row_max_or_nan(const float* row, int64_t vocab) {
  float max = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 vmax_acc = _mm512_set1_ps(max);
  __mmask16 unordered = 0;
  for (; j + 16 <= vocab; j += 16) {
    const __m512 v = _mm512_loadu_ps(row + j);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax_acc = _mm512_max_ps(vmax_acc, v);
  }
  max = _mm512_reduce_max_ps(vmax_acc);
  nan = unordered != 0;
#elif defined(WEFT_AVX2)
  __m256 vmax_acc = _mm256_set1_ps(max), unordered = _mm256_setzero_ps();
  for (; j + 8 <= vocab; j += 8) {
    const __m256 v = _mm256_loadu_ps(row + j);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vmax_acc = _mm256_max_ps(vmax_acc, v);
  }
  max = reduce_max8(vmax_acc);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; j < vocab; ++j) {
    nan |= std::isnan(row[j]);
    max = std::max(max, row[j]);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : max;
}

// The first index of `value` in the row (which holds it), compared 16 or 8 at a time.
int64_t first_index_of(const float* row, int64_t vocab, float value) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(value);
  for (; j + 16 <= vocab; j += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), target, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(hit);
  }
#elif defined(WEFT_AVX2)
  const __m256 target = _mm256_set1_ps(value);
  for (; j + 8 <= vocab; j += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), target, _CMP_EQ_OQ));
    if (hit) return j + __builtin_ctz(hit);
  }
#endif
  for (; j < vocab; ++j) {
    if (row[j] == value) return j;
  }
  return 0;  // not reached: the row holds `value`
}

// torch.max(x, dim=-1) for x [B, V] float32 with contiguous rows: each row's largest value and its
// first index (a row with a NaN: NaN and the first NaN's index), in two vector passes over the row
// instead of torch's scalar loop that tracks an index per element (110 against 7 us a row of 128k).
std::tuple<at::Tensor, at::Tensor> row_max(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                  x.size(1) > 0,
              "row_max: x must be a CPU float32 [B, V] (V > 0) with contiguous rows");
  const int64_t rows = x.size(0), vocab = x.size(1), stride = x.stride(0);
  auto values = at::empty({rows}, x.options());
  auto ids = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * stride;
      const float max = row_max_or_nan(row, vocab);
      int64_t id = 0;
      if (std::isnan(max)) {
        while (!std::isnan(row[id])) ++id;
      } else {
        id = first_index_of(row, vocab, max);
      }
      ip[r] = id;
      vp[r] = row[id];
    }
  });
  return {values, ids};
}

LogNormalizer log_normalizer(const float* row, int64_t vocab) {
  const float max = row_max_or_nan(row, vocab);
  if (std::isnan(max)) return {max, 0.f};
  float sum = 0.f;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 vmax = _mm512_set1_ps(max);
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= vocab; j += 16) acc = _mm512_add_ps(acc, exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), vmax)));
  sum = _mm512_reduce_add_ps(acc);
#elif defined(WEFT_AVX2)
  const __m256 vmax = _mm256_set1_ps(max);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= vocab; j += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), vmax)));
  sum = reduce_add8(acc);
#endif
  for (; j < vocab; ++j) sum += exp_approx(row[j] - max);
  return {max, std::log(sum)};
}

// One row of row_logprobs: lp[j] = x[j] - shift - log_sum (the log-softmax's own arithmetic, or
// x[j] - norm), computed twice per entry, never stored: the rank of ids[r] and the top list.
void row_logprobs_one(const float* row, int64_t vocab, int64_t chosen_id, float shift, float log_sum,
                      int64_t num_top, float* values, int64_t* ids, int64_t* rank) {
  const auto lp_of = [&](float x) { return (x - shift) - log_sum; };
  const float chosen = lp_of(row[chosen_id]);
  const float minus_inf = -std::numeric_limits<float>::infinity();
  float* kept = values + 1;
  int64_t* kept_ids = ids + 1;
  int64_t count = 0, above = 0, j = 0;
  // Offer token `token`'s logprob to the top list (a NaN ranked as -inf).
  const auto keep = [&](float lp, int64_t token) {
    if (num_top > 0) keep_top(std::isnan(lp) ? minus_inf : lp, token, kept, kept_ids, count, num_top);
  };
  // Once the list is full, what a logprob must beat to enter it (nothing enters an empty top-0 list).
  const auto bar = [&]() { return num_top > 0 ? kept[num_top - 1] : std::numeric_limits<float>::infinity(); };
#if defined(__AVX512F__)
  const __m512 vshift = _mm512_set1_ps(shift), vlog_sum = _mm512_set1_ps(log_sum), vchosen = _mm512_set1_ps(chosen);
  for (; j + 16 <= vocab; j += 16) {
    const __m512 lp = _mm512_sub_ps(_mm512_sub_ps(_mm512_loadu_ps(row + j), vshift), vlog_sum);
    above += __builtin_popcount(_mm512_cmp_ps_mask(lp, vchosen, _CMP_GT_OQ));
    if (count == num_top && !_mm512_cmp_ps_mask(lp, _mm512_set1_ps(bar()), _CMP_GT_OQ)) continue;
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, lp);
    for (int lane = 0; lane < 16; ++lane) keep(lanes[lane], j + lane);
  }
#elif defined(WEFT_AVX2)
  const __m256 vshift = _mm256_set1_ps(shift), vlog_sum = _mm256_set1_ps(log_sum), vchosen = _mm256_set1_ps(chosen);
  for (; j + 8 <= vocab; j += 8) {
    const __m256 lp = _mm256_sub_ps(_mm256_sub_ps(_mm256_loadu_ps(row + j), vshift), vlog_sum);
    above += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(lp, vchosen, _CMP_GT_OQ)));
    if (count == num_top && !_mm256_movemask_ps(_mm256_cmp_ps(lp, _mm256_set1_ps(bar()), _CMP_GT_OQ))) continue;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, lp);
    for (int lane = 0; lane < 8; ++lane) keep(lanes[lane], j + lane);
  }
#endif
  for (; j < vocab; ++j) {
    const float lp = lp_of(row[j]);
    above += lp > chosen;
    keep(lp, j);
  }
  for (int64_t i = 0; i < count; ++i) kept[i] = lp_of(row[kept_ids[i]]);  // a NaN ranked as -inf stays NaN
  values[0] = chosen;
  ids[0] = chosen_id;
  *rank = above + 1;
}

// The logprobs a request asks for, from logits without materializing their log-softmax: for each
// row of x ([R, V] float32) and its token ids[r], (ids [R, k+1], logprobs [R, k+1], ranks [R]) with
// column 0 the token itself and columns 1.. the k most likely tokens (by logprob, then by id; NaN
// counts as -inf), rank = 1 + the number of strictly higher logprobs. Logprobs are x's log-softmax,
// or x - norm[r] where norm ([R]) is given and norm[r] is not NaN. TorchKernels.row_logprobs in
// tensor operations.
std::tuple<at::Tensor, at::Tensor, at::Tensor> row_logprobs(const at::Tensor& x, const at::Tensor& ids,
                                                            int64_t num_top, const at::Tensor& norm) {
  TORCH_CHECK(on_cpu({x, ids, norm}), "row_logprobs: every tensor must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "row_logprobs: x must be float32 [R, V] with contiguous rows");
  const int64_t rows = x.size(0), vocab = x.size(1), stride = x.stride(0);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.size(0) == rows,
              "row_logprobs: ids must be [R] int64");
  TORCH_CHECK(num_top >= 0 && num_top <= vocab, "row_logprobs: num_top must be in [0, V]");
  const bool given = norm.numel() > 0;
  TORCH_CHECK(!given || (norm.scalar_type() == at::kFloat && norm.dim() == 1 && norm.is_contiguous() &&
                         norm.size(0) == rows),
              "row_logprobs: norm must be float32 [R] (or empty)");
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < vocab, "row_logprobs: an id is outside the row");
  auto out_ids = at::empty({rows, num_top + 1}, ids.options());
  auto out_values = at::empty({rows, num_top + 1}, x.options());
  auto ranks = at::empty({rows}, ids.options());
  const float* xp = x.data_ptr<float>();
  const float* np = given ? norm.data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * stride;
      const bool own = !given || std::isnan(np[r]);  // NaN: this row's own log-softmax
      const LogNormalizer n = own ? log_normalizer(row, vocab) : LogNormalizer{np[r], 0.f};
      row_logprobs_one(row, vocab, ip[r], n.max, n.log_sum, num_top, out_values.data_ptr<float>() + r * (num_top + 1),
                       out_ids.data_ptr<int64_t>() + r * (num_top + 1), ranks.data_ptr<int64_t>() + r);
    }
  });
  return {out_ids, out_values, ranks};
}

// ---- The mass a grammar allowed ----------------------------------------------------------------

// Below this (max over allowed - max over all), the allowed sum is taken again relative to its own
// largest term: exp clamps at -87, and an allowed sum under e^-50 would carry that clamp's error.
constexpr float kOwnShiftBelow = -50.f;

struct TwoMaxima {
  float all;      // NaN if the row holds one
  float allowed;  // -inf if nothing is allowed
};

// One pass: the row's largest logit, and its largest among the tokens whose masked logit is > -inf.
TwoMaxima two_maxima(const float* x, const float* masked, int64_t vocab) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  float all = minus_inf, allowed = minus_inf;
  bool nan = false;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 vninf = _mm512_set1_ps(minus_inf);
  __m512 vall = vninf, vallowed = vninf;
  __mmask16 unordered = 0;
  for (; j + 16 <= vocab; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vall = _mm512_max_ps(vall, v);
    const __mmask16 ok = _mm512_cmp_ps_mask(_mm512_loadu_ps(masked + j), vninf, _CMP_GT_OQ);
    vallowed = _mm512_mask_max_ps(vallowed, ok, vallowed, v);
  }
  all = _mm512_reduce_max_ps(vall);
  allowed = _mm512_reduce_max_ps(vallowed);
  nan = unordered != 0;
#elif defined(WEFT_AVX2)
  const __m256 vninf = _mm256_set1_ps(minus_inf);
  __m256 vall = vninf, vallowed = vninf, unordered = _mm256_setzero_ps();
  for (; j + 8 <= vocab; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vall = _mm256_max_ps(vall, v);
    const __m256 ok = _mm256_cmp_ps(_mm256_loadu_ps(masked + j), vninf, _CMP_GT_OQ);
    vallowed = _mm256_max_ps(vallowed, _mm256_blendv_ps(vninf, v, ok));
  }
  all = reduce_max8(vall);
  allowed = reduce_max8(vallowed);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; j < vocab; ++j) {
    nan |= std::isnan(x[j]);
    all = std::max(all, x[j]);
    if (masked[j] > minus_inf) allowed = std::max(allowed, x[j]);
  }
  return {nan ? std::numeric_limits<float>::quiet_NaN() : all, allowed};
}

// sum_j exp(x[j] - shift) over every token (into *all, if not null) and over the allowed ones.
void shifted_sums(const float* x, const float* masked, int64_t vocab, float shift, float* all, float* allowed) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  float sum_all = 0.f, sum_allowed = 0.f;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 vshift = _mm512_set1_ps(shift), vninf = _mm512_set1_ps(minus_inf);
  __m512 acc_all = _mm512_setzero_ps(), acc_allowed = _mm512_setzero_ps();
  for (; j + 16 <= vocab; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + j), vshift));
    acc_all = _mm512_add_ps(acc_all, e);
    const __mmask16 ok = _mm512_cmp_ps_mask(_mm512_loadu_ps(masked + j), vninf, _CMP_GT_OQ);
    acc_allowed = _mm512_mask_add_ps(acc_allowed, ok, acc_allowed, e);
  }
  sum_all = _mm512_reduce_add_ps(acc_all);
  sum_allowed = _mm512_reduce_add_ps(acc_allowed);
#elif defined(WEFT_AVX2)
  const __m256 vshift = _mm256_set1_ps(shift), vninf = _mm256_set1_ps(minus_inf);
  __m256 acc_all = _mm256_setzero_ps(), acc_allowed = _mm256_setzero_ps();
  for (; j + 8 <= vocab; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), vshift));
    acc_all = _mm256_add_ps(acc_all, e);
    const __m256 ok = _mm256_cmp_ps(_mm256_loadu_ps(masked + j), vninf, _CMP_GT_OQ);
    acc_allowed = _mm256_add_ps(acc_allowed, _mm256_and_ps(e, ok));
  }
  sum_all = reduce_add8(acc_all);
  sum_allowed = reduce_add8(acc_allowed);
#endif
  double rest_all = 0., rest_allowed = 0.;  // the scalar build sums a whole row here: in double
  for (; j < vocab; ++j) {
    const float e = exp_approx(x[j] - shift);
    rest_all += e;
    if (masked[j] > minus_inf) rest_allowed += e;
  }
  if (all != nullptr) *all = static_cast<float>(sum_all + rest_all);
  *allowed = static_cast<float>(sum_allowed + rest_allowed);
}

// log(sum over allowed of softmax(x)): -inf if nothing is allowed, NaN if x holds a NaN.
float logmass_one(const float* x, const float* masked, int64_t vocab) {
  const TwoMaxima m = two_maxima(x, masked, vocab);
  if (std::isnan(m.all)) return m.all;
  if (m.allowed == -std::numeric_limits<float>::infinity()) return m.allowed;  // nothing allowed
  float sum_all = 0.f, sum_allowed = 0.f;
  shifted_sums(x, masked, vocab, m.all, &sum_all, &sum_allowed);
  if (m.allowed - m.all >= kOwnShiftBelow) return std::log(sum_allowed) - std::log(sum_all);
  shifted_sums(x, masked, vocab, m.allowed, nullptr, &sum_allowed);  // rare: a third pass
  return (m.allowed - m.all) + std::log(sum_allowed) - std::log(sum_all);
}

// [R] float32: for each row r of raw ([R, V] float32), the log of the probability mass softmax(raw[r])
// puts on the tokens a grammar allowed, those whose logit in masked[rows[r]] ([B, V] float32, the
// logits after the mask; rows [R] int64, or empty for rows r) is above -inf. Two passes over the row
// (three where the allowed mass is under e^-50). TorchKernels.constraint_logmass in tensor operations.
at::Tensor constraint_logmass(const at::Tensor& raw, const at::Tensor& masked, const at::Tensor& rows) {
  TORCH_CHECK(on_cpu({raw, masked, rows}), "constraint_logmass: every tensor must be on the CPU");
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kFloat && raw.stride(1) == 1,
              "constraint_logmass: raw must be float32 [R, V] with contiguous rows");
  TORCH_CHECK(masked.dim() == 2 && masked.scalar_type() == at::kFloat && masked.stride(1) == 1 &&
                  masked.size(1) == raw.size(1),
              "constraint_logmass: masked must be float32 [B, V] with contiguous rows");
  const int64_t num_rows = raw.size(0), vocab = raw.size(1);
  const bool indexed = rows.numel() > 0;
  TORCH_CHECK(indexed ? (rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous() &&
                         rows.size(0) == num_rows)
                      : masked.size(0) == num_rows,
              "constraint_logmass: rows must be [R] int64 (or empty, with masked [R, V])");
  const int64_t* rp = indexed ? rows.data_ptr<int64_t>() : nullptr;
  for (int64_t r = 0; indexed && r < num_rows; ++r)
    TORCH_CHECK(rp[r] >= 0 && rp[r] < masked.size(0), "constraint_logmass: a row index is outside masked");
  auto out = at::empty({num_rows}, raw.options());
  const float* xp = raw.data_ptr<float>();
  const float* mp = masked.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t m = indexed ? rp[r] : r;
      op[r] = logmass_one(xp + r * raw.stride(0), mp + m * masked.stride(0), vocab);
    }
  });
  return out;
}

// ---- Gumbel-max sampling keyed by (seed, position, token id) ----------------------------------
// The same noise as ops.keyed_uniform (splitmix64 over the key, 23 bits, strictly inside (0, 1)),
// bit for bit; the Gumbel transform -log(-log(u)) uses Cephes' logf (within 1-2 ulp of torch.log).

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t kMix2 = 0x94D049BB133111EBull;
constexpr uint64_t kSeedMul = 0x2545F4914F6CDD1Dull;
constexpr uint64_t kPosMul = 0x5851F42D4C957F2Dull;
constexpr int kUniformBits = 23;
// No Gumbel draw exceeds -log(-log(1 - 2^-24)) = 16.64 or falls below -log(-log(2^-24)) = -2.81,
// so a token whose logit is more than 16.64 + 2.81 (+ a margin) below the row's largest can never
// win: the largest logit alone reaches at least max - 2.81. Such tokens skip the hash and the logs.
constexpr float kGumbelSpan = 19.5f;

inline float keyed_uniform_one(uint64_t key, int64_t token) {
  uint64_t z = key + static_cast<uint64_t>(token + 1) * kGolden;
  z = (z ^ (z >> 30)) * kMix1;
  z = (z ^ (z >> 27)) * kMix2;
  z = z ^ (z >> 31);
  return (static_cast<float>(z >> (64 - kUniformBits)) + 0.5f) * (1.0f / (1 << kUniformBits));
}

// The polynomial of Cephes' logf after its first coefficient (7.0376836292e-2), shared by the
// scalar log and its 16- and 8-lane forms, which must agree bit for bit (seeded sampling).
constexpr float kLogPoly[] = {-1.1514610310e-1f, 1.1676998740e-1f, -1.2420140846e-1f, 1.4249322787e-1f,
                              -1.6668057665e-1f, 2.0000714765e-1f, -2.4999993993e-1f, 3.3333331174e-1f};

// log(x) for positive normal x: Cephes' logf, step for step as log16 below (explicit fma).
inline float log_approx(float x) {
  int e;
  float m = std::frexp(x, &e);  // [0.5, 1)
  if (m < 0.707106781186547524f) {
    e -= 1;
    m = m + m - 1.0f;
  } else {
    m = m - 1.0f;
  }
  const float z = m * m;
  float y = 7.0376836292e-2f;
  for (const float c : kLogPoly) {
    y = std::fma(y, m, c);
  }
  y = y * m * z;
  const float ef = static_cast<float>(e);
  y = std::fma(ef, -2.12194440e-4f, y);
  y = std::fma(z, -0.5f, y);
  return std::fma(ef, 0.693359375f, m + y);
}

inline float gumbel_one(uint64_t key, int64_t token) {
  return -log_approx(-log_approx(keyed_uniform_one(key, token)));
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
inline __m512 log16(__m512 x) {
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_p5_1, _MM_MANT_SIGN_src);  // [0.5, 1)
  __m512 e = _mm512_add_ps(_mm512_getexp_ps(x), _mm512_set1_ps(1.f));
  const __mmask16 small = _mm512_cmp_ps_mask(m, _mm512_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
  e = _mm512_mask_sub_ps(e, small, e, _mm512_set1_ps(1.f));
  m = _mm512_mask_add_ps(_mm512_sub_ps(m, _mm512_set1_ps(1.f)), small, _mm512_sub_ps(_mm512_add_ps(m, m), _mm512_set1_ps(1.f)),
                         _mm512_setzero_ps());
  const __m512 z = _mm512_mul_ps(m, m);
  __m512 y = _mm512_set1_ps(7.0376836292e-2f);
  for (const float c : kLogPoly) {
    y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(c));
  }
  y = _mm512_mul_ps(_mm512_mul_ps(y, m), z);
  y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
  y = _mm512_fmadd_ps(z, _mm512_set1_ps(-0.5f), y);
  return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), _mm512_add_ps(m, y));
}

// keyed_uniform_one for tokens first .. first + 7.
inline __m256 keyed_uniform8(uint64_t key, int64_t first) {
  const __m512i tokens = _mm512_add_epi64(_mm512_set1_epi64(first + 1), _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0));
  __m512i z = _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(key)),
                               _mm512_mullo_epi64(tokens, _mm512_set1_epi64(static_cast<int64_t>(kGolden))));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64(static_cast<int64_t>(kMix1)));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64(static_cast<int64_t>(kMix2)));
  z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
  const __m256 bits = _mm512_cvtepi64_ps(_mm512_srli_epi64(z, 64 - kUniformBits));
  return _mm256_mul_ps(_mm256_add_ps(bits, _mm256_set1_ps(0.5f)), _mm256_set1_ps(1.0f / (1 << kUniformBits)));
}

inline __m512 gumbel16(uint64_t key, int64_t first) {
  const __m512 u = _mm512_insertf32x8(_mm512_castps256_ps512(keyed_uniform8(key, first)), keyed_uniform8(key, first + 8), 1);
  const __m512 minus = _mm512_set1_ps(-0.f);
  return _mm512_xor_ps(log16(_mm512_xor_ps(log16(u), minus)), minus);
}
#endif

#if defined(WEFT_AVX2)
// 64-bit products of 64-bit lanes, from 32-bit multiplies (AVX2 has no 64-bit one).
inline __m256i mullo64(__m256i a, __m256i b) {
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b),
                                         _mm256_mul_epu32(a, _mm256_srli_epi64(b, 32)));
  return _mm256_add_epi64(_mm256_mul_epu32(a, b), _mm256_slli_epi64(cross, 32));
}

// keyed_uniform_one's top bits (z >> (64 - kUniformBits)) for tokens first .. first + 3.
inline __m256i uniform_bits4(uint64_t key, int64_t first) {
  const __m256i tokens = _mm256_add_epi64(_mm256_set1_epi64x(first + 1), _mm256_set_epi64x(3, 2, 1, 0));
  __m256i z = _mm256_add_epi64(_mm256_set1_epi64x(static_cast<int64_t>(key)),
                               mullo64(tokens, _mm256_set1_epi64x(static_cast<int64_t>(kGolden))));
  z = mullo64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), _mm256_set1_epi64x(static_cast<int64_t>(kMix1)));
  z = mullo64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), _mm256_set1_epi64x(static_cast<int64_t>(kMix2)));
  z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
  return _mm256_srli_epi64(z, 64 - kUniformBits);
}

// keyed_uniform_one for tokens first .. first + 7 (the bits fit the low 32 of each 64-bit lane).
inline __m256 keyed_uniform8(uint64_t key, int64_t first) {
  const __m256i low_halves = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256i a = _mm256_permutevar8x32_epi32(uniform_bits4(key, first), low_halves);
  const __m256i b = _mm256_permutevar8x32_epi32(uniform_bits4(key, first + 4), low_halves);
  const __m256 bits = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(a, b, 0x20));
  return _mm256_mul_ps(_mm256_add_ps(bits, _mm256_set1_ps(0.5f)), _mm256_set1_ps(1.0f / (1 << kUniformBits)));
}

// log_approx on 8 lanes, step for step (frexp from the float's bits: positive normal inputs only).
inline __m256 log8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256 one = _mm256_set1_ps(1.f);
  __m256 m = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f000000)));  // [0.5, 1)
  __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(126)));
  const __m256 small = _mm256_cmp_ps(m, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
  e = _mm256_sub_ps(e, _mm256_and_ps(small, one));
  m = _mm256_blendv_ps(_mm256_sub_ps(m, one), _mm256_sub_ps(_mm256_add_ps(m, m), one), small);
  const __m256 z = _mm256_mul_ps(m, m);
  __m256 y = _mm256_set1_ps(7.0376836292e-2f);
  for (const float c : kLogPoly) {
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(c));
  }
  y = _mm256_mul_ps(_mm256_mul_ps(y, m), z);
  y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
  y = _mm256_fmadd_ps(z, _mm256_set1_ps(-0.5f), y);
  return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), _mm256_add_ps(m, y));
}

inline __m256 gumbel8(uint64_t key, int64_t first) {
  const __m256 minus = _mm256_set1_ps(-0.f);
  return _mm256_xor_ps(log8(_mm256_xor_ps(log8(keyed_uniform8(key, first)), minus)), minus);
}
#endif

// argmax over the row of logit + Gumbel noise (first index on ties), skipping hopeless tokens.
int64_t gumbel_argmax_row(const float* row, int64_t vocab, uint64_t key) {
  float max = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#if defined(WEFT_AVX2)
  __m256 lanes = _mm256_set1_ps(max);
  for (; j + 8 <= vocab; j += 8) lanes = _mm256_max_ps(_mm256_loadu_ps(row + j), lanes);  // a NaN keeps `lanes`
  max = reduce_max8(lanes);
#endif
  for (; j < vocab; ++j) max = std::max(max, row[j]);  // NaN is skipped
  const float floor = max - kGumbelSpan;
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_id = 0;
  j = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  const __m512 vfloor = _mm512_set1_ps(floor);
  for (; j + 16 <= vocab; j += 16) {
    const __m512 x = _mm512_loadu_ps(row + j);
    const __mmask16 live = _mm512_cmp_ps_mask(x, vfloor, _CMP_GE_OQ);
    if (!live) continue;
    const __m512 value = _mm512_mask_add_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), live, x, gumbel16(key, j));
    const float top = _mm512_reduce_max_ps(value);
    if (top > best) {
      best = top;
      best_id = j + __builtin_ctz(_mm512_cmp_ps_mask(value, _mm512_set1_ps(top), _CMP_EQ_OQ));
    }
  }
#elif defined(WEFT_AVX2)
  const __m256 vfloor = _mm256_set1_ps(floor), minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (; j + 8 <= vocab; j += 8) {
    const __m256 x = _mm256_loadu_ps(row + j);
    const __m256 live = _mm256_cmp_ps(x, vfloor, _CMP_GE_OQ);
    if (!_mm256_movemask_ps(live)) continue;
    const __m256 value = _mm256_blendv_ps(minus_inf, _mm256_add_ps(x, gumbel8(key, j)), live);
    const float top = reduce_max8(value);
    if (top > best) {
      best = top;
      best_id = j + __builtin_ctz(_mm256_movemask_ps(_mm256_cmp_ps(value, _mm256_set1_ps(top), _CMP_EQ_OQ)));
    }
  }
#endif
  for (; j < vocab; ++j) {
    if (!(row[j] >= floor)) continue;
    const float value = row[j] + gumbel_one(key, j);
    if (value > best) {
      best = value;
      best_id = j;
    }
  }
  return best_id;
}

// One token per row of logits ([B, V] float32) by the Gumbel-max trick with noise keyed by (seeds[b],
// positions[b], token id): ops.gumbel_sample in one pass, without the [B, V] noise tensors.
at::Tensor gumbel_argmax(const at::Tensor& logits, const at::Tensor& seeds, const at::Tensor& positions) {
  TORCH_CHECK(on_cpu({logits, seeds, positions}), "gumbel_argmax: every tensor must be on the CPU");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "gumbel_argmax: logits must be float32 [B, V] with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  for (const auto* t : {&seeds, &positions}) {
    TORCH_CHECK(t->dim() == 1 && t->scalar_type() == at::kLong && t->is_contiguous() && t->size(0) == rows,
                "gumbel_argmax: seeds and positions must be [B] int64");
  }
  auto out = at::empty({rows}, seeds.options());
  const float* xp = logits.data_ptr<float>();
  const int64_t* sp = seeds.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint64_t key = static_cast<uint64_t>(sp[r]) * kSeedMul + static_cast<uint64_t>(pp[r]) * kPosMul;
      op[r] = gumbel_argmax_row(xp + r * stride, vocab, key);
    }
  });
  return out;
}

// ---- Nucleus (top-p) filtering -----------------------------------------------------------------
// Token j stays iff the probability mass of the tokens strictly more likely than it is below top_p
// (a tie at the cut stays whole; the most likely token always stays). Without sorting the row:
// e = exp(x - max) is bucketed by its float bits (monotone for positive floats), the bucket where
// the mass crosses top_p * sum(e) is found from the top, and only that bucket's values are sorted.

constexpr int kMassBucketShift = 19;  // e in [0, 1]: bits >> 19 < 2048 buckets, 16 per octave
constexpr int kMassBuckets = (0x3F800000 >> kMassBucketShift) + 1;

inline int mass_bucket(float e) { return static_cast<int>(__builtin_bit_cast(uint32_t, e) >> kMassBucketShift); }

// The smallest e a token may have and stay, for one row of e (all >= 0) whose kept mass is `target`.
float smallest_kept(const std::vector<float>& e, double target) {
  // Four interleaved histograms: neighbouring tokens often share a bucket, and one histogram would
  // make each addition wait for the previous one.
  std::vector<double> lanes(4 * kMassBuckets, 0.0);
  const size_t n = e.size();
  size_t j = 0;
  for (; j + 4 <= n; j += 4) {
    for (size_t k = 0; k < 4; ++k) lanes[k * kMassBuckets + mass_bucket(e[j + k])] += e[j + k];
  }
  for (; j < n; ++j) lanes[mass_bucket(e[j])] += e[j];
  std::vector<double> mass(kMassBuckets);
  for (int b = 0; b < kMassBuckets; ++b) {
    mass[b] = (lanes[b] + lanes[kMassBuckets + b]) + (lanes[2 * kMassBuckets + b] + lanes[3 * kMassBuckets + b]);
  }
  double above = 0.0;  // the mass of every bucket above the current one
  int crossing = kMassBuckets - 1;
  for (; crossing >= 0 && above + mass[crossing] < target; --crossing) above += mass[crossing];
  if (crossing < 0) return 0.f;  // rounding left the whole row under the target: keep everything
  std::vector<float> members;
  for (const float v : e) {
    if (mass_bucket(v) == crossing) members.push_back(v);
  }
  std::sort(members.begin(), members.end(), std::greater<float>());
  float kept = members.front();  // above < target: the bucket's largest value stays
  for (size_t i = 0; i < members.size();) {
    size_t end = i;
    double group = 0.0;
    for (; end < members.size() && members[end] == members[i]; ++end) group += members[end];
    if (above >= target) break;
    kept = members[i];
    above += group;
    i = end;
  }
  return kept;
}

// e[j] = exp(x[j] - max) (0 for a -inf logit); returns their sum.
double masses(const float* x, int64_t vocab, float max, float* e) {
  double total = 0.0;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 vmax = _mm512_set1_ps(max), minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512d acc_lo = _mm512_setzero_pd(), acc_hi = _mm512_setzero_pd();
  for (; j + 16 <= vocab; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    const __m512 m = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, minus_inf, _CMP_GT_OQ), exp16(_mm512_sub_ps(v, vmax)));
    _mm512_storeu_ps(e + j, m);
    acc_lo = _mm512_add_pd(acc_lo, _mm512_cvtps_pd(_mm512_castps512_ps256(m)));
    acc_hi = _mm512_add_pd(acc_hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(m), 1))));
  }
  total = _mm512_reduce_add_pd(_mm512_add_pd(acc_lo, acc_hi));
#elif defined(WEFT_AVX2)
  const __m256 vmax = _mm256_set1_ps(max), minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256d acc_lo = _mm256_setzero_pd(), acc_hi = _mm256_setzero_pd();
  for (; j + 8 <= vocab; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    const __m256 m = _mm256_and_ps(_mm256_cmp_ps(v, minus_inf, _CMP_GT_OQ), exp8(_mm256_sub_ps(v, vmax)));
    _mm256_storeu_ps(e + j, m);
    acc_lo = _mm256_add_pd(acc_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(m)));
    acc_hi = _mm256_add_pd(acc_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(m, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(acc_lo, acc_hi));
  total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
  for (; j < vocab; ++j) {
    e[j] = x[j] > -std::numeric_limits<float>::infinity() ? exp_approx(x[j] - max) : 0.f;
    total += e[j];
  }
  return total;
}

// logits ([B, V] float32) with every token that top-p removes set to -inf; rows with top_p >= 1
// are copied as they are. A new tensor; the input is not modified.
at::Tensor top_p_filter(const at::Tensor& logits, const at::Tensor& top_p) {
  TORCH_CHECK(on_cpu({logits, top_p}), "top_p_filter: every tensor must be on the CPU");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "top_p_filter: logits must be float32 [B, V] with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(top_p.dim() == 1 && top_p.scalar_type() == at::kFloat && top_p.is_contiguous() && top_p.size(0) == rows,
              "top_p_filter: top_p must be [B] float32");
  auto out = at::empty({rows, vocab}, logits.options());
  const float* xp = logits.data_ptr<float>();
  const float* tp = top_p.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float minus_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e(vocab);
    for (int64_t r = begin; r < end; ++r) {
      const float* x = xp + r * stride;
      float* o = op + r * vocab;
      if (!(tp[r] < 1.f)) {
        std::copy(x, x + vocab, o);
        continue;
      }
      const float max = row_max_or_nan(x, vocab);
      if (!(max > minus_inf)) {  // a NaN stays for the sampler to report; nothing is finite
        std::copy(x, x + vocab, o);
        continue;
      }
      const double total = masses(x, vocab, max, e.data());
      const float cut = smallest_kept(e, static_cast<double>(tp[r]) * total);
      for (int64_t j = 0; j < vocab; ++j) o[j] = e[j] >= cut ? x[j] : minus_inf;
    }
  });
  return out;
}

}  // namespace

namespace weft {  // for decoder.cpp (ops.h)

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return ::rms_norm(x, weight, eps); }
at::Tensor add_normed_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& delta_weight,
                       const std::optional<at::Tensor>& next_weight, double eps) {
  return ::add_normed_(x, delta, delta_weight, next_weight, eps);
}
at::Tensor silu_mul(const at::Tensor& gate_up) { return ::silu_mul(gate_up); }
at::Tensor gelu_mul(const at::Tensor& gate_up) { return ::gelu_mul(gate_up); }
void rope_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
           int64_t num_heads) {
  ::rope_(x, positions, cos, sin, num_heads);
}
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, double scale, int64_t window, double softcap,
                                  const std::optional<at::Tensor>& sinks) {
  return ::paged_decode_attention(q, kv_cache, block_table, context_lens, scale, window, sinks, softcap);
}

}  // namespace weft

TORCH_LIBRARY(weft, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("add_normed_(Tensor(a!) x, Tensor delta, Tensor delta_weight, Tensor? next_weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin, int num_heads) -> ()");
  m.def(
      "paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_table, Tensor context_lens, float scale, "
      "int window=0, Tensor? sinks=None, float softcap=0.0) -> Tensor");
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
  m.def("top_by_value_then_index(Tensor x, int num_top) -> (Tensor, Tensor)");
  m.def("rank_of(Tensor x, Tensor ids) -> Tensor");
  m.def("row_logprobs(Tensor x, Tensor ids, int num_top, Tensor norm) -> (Tensor, Tensor, Tensor)");
  m.def("gumbel_argmax(Tensor logits, Tensor seeds, Tensor positions) -> Tensor");
  m.def("row_max(Tensor x) -> (Tensor, Tensor)");
  m.def("top_p_filter(Tensor logits, Tensor top_p) -> Tensor");
  m.def("constraint_logmass(Tensor raw, Tensor masked, Tensor rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(weft, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("add_normed_", &add_normed_);
  m.impl("silu_mul", &silu_mul);
  m.impl("gelu_mul", &gelu_mul);
  m.impl("rope_", &rope_);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("apply_token_bitmask_", &apply_token_bitmask_);
  m.impl("top_by_value_then_index", &top_by_value_then_index);
  m.impl("rank_of", &rank_of);
  m.impl("row_logprobs", &row_logprobs);
  m.impl("gumbel_argmax", &gumbel_argmax);
  m.impl("row_max", &row_max);
  m.impl("top_p_filter", &top_p_filter);
  m.impl("constraint_logmass", &constraint_logmass);
}
