// exp and silu for vectors and scalars, shared by the kernels that take a softmax or a sigmoid
// (kernels.cpp, prefill_attention.cpp, linear.cpp), and a row's RMS norm.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace weft::vmath {

// exp(x) for x <= 0 (the softmax, the sigmoid): Cephes' range reduction and polynomial, within 2
// ulp of std::exp. exp16 below is the same computation on 16 lanes; GCC did not vectorize the
// loops over this scalar form.
__attribute__((always_inline)) inline float exp_approx(float x) {
  x = std::max(x, -87.f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

#if defined(__AVX512F__)
// exp_approx on 16 lanes, step for step.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i pow2n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(pow2n));
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// The same on 8 lanes (AVX2 machines), step for step.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n));
}
#endif

// dst = row / rms(row) * weight for one row of `hidden` values (rms_norm and add_rms_norm_ of
// kernels.cpp, and the norm that writes bfloat16 pairs of linear.cpp).
template <typename T>
inline void rms_norm_row(const T* row, const T* wp, T* dst, int64_t hidden, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < hidden; ++i) sum += static_cast<float>(row[i]) * static_cast<float>(row[i]);
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) {
    // as the reference implementations: normalise in float32, round to the storage dtype, scale
    const float normed = static_cast<float>(static_cast<T>(static_cast<float>(row[i]) * inv));
    dst[i] = static_cast<T>(normed * static_cast<float>(wp[i]));
  }
}

// x * sigmoid(z), with sigmoid from exp(-|z|) so that exp never overflows: silu(x) = x * sigmoid(x),
// and gelu with tanh (Gemma's GeGLU), 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3),
// which is x * sigmoid(2u). The 16- and 8-lane versions step for step the same (silu_mul, gelu_mul,
// and the fused gate|up projection of linear.cpp).
constexpr float kGeluA = 1.5957691216057308f;              // 2 sqrt(2/pi)
constexpr float kGeluB = 1.5957691216057308f * 0.044715f;  // 2 sqrt(2/pi) 0.044715

inline float x_sigmoid(float x, float z) {
  const float e = exp_approx(-std::fabs(z));
  return x * (z >= 0.f ? 1.f : e) / (1.f + e);
}
inline float silu(float x) { return x_sigmoid(x, x); }
inline float gelu_tanh(float x) { return x_sigmoid(x, x * (kGeluA + kGeluB * x * x)); }

#if defined(__AVX512F__)
inline __m512 x_sigmoid16(__m512 x, __m512 z) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(z)));
  const __mmask16 negative = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 numerator = _mm512_mask_mul_ps(x, negative, x, e);
  return _mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}
inline __m512 silu16(__m512 x) { return x_sigmoid16(x, x); }
inline __m512 gelu16(__m512 x) {
  return x_sigmoid16(x, _mm512_mul_ps(x, _mm512_fmadd_ps(_mm512_mul_ps(x, x), _mm512_set1_ps(kGeluB),
                                                         _mm512_set1_ps(kGeluA))));
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
inline __m256 x_sigmoid8(__m256 x, __m256 z) {
  const __m256 e = exp8(_mm256_or_ps(z, _mm256_set1_ps(-0.f)));  // exp(-|z|)
  const __m256 negative = _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 numerator = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), negative);
  return _mm256_div_ps(numerator, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}
inline __m256 silu8(__m256 x) { return x_sigmoid8(x, x); }
inline __m256 gelu8(__m256 x) {
  return x_sigmoid8(x, _mm256_mul_ps(x, _mm256_fmadd_ps(_mm256_mul_ps(x, x), _mm256_set1_ps(kGeluB),
                                                        _mm256_set1_ps(kGeluA))));
}
#endif

}  // namespace weft::vmath
