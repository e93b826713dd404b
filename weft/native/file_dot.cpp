// Quantized matrices multiplied in the GGUF file's own blocks (llama.cpp's layout, read in place from
// the file's mapping): y = x @ W.T with x quantized to int8 as qdot.cpp quantizes it (blocks of 256,
// llama.cpp's quantize_row_q8_K) and W's rows of Q4_K or Q6_K blocks as the file stores them. What
// lets a mixture of experts run from the file's pages, which the page cache shares with any other
// process reading the file, instead of from a second copy in dot panels (docs/architecture.md,
// "Experts from the file's pages").
//
// The numbers are the dot panels' bit for bit: each super-block's integer sums are exact whatever
// the order they are added in, and they meet float32 in the panels' own expressions, a vector of
// kLanes output rows where a panel has kLanes columns (`q4k_group`, `q6k_group`), so that a model
// computes the same tokens whichever layout holds its experts (tests/test_file_dot.py).
//
// What it costs: a row's scales are decoded and its sums reduced for every row, where a panel shares
// them over 32 columns; from the caches these products run at a quarter to a third of the panels'
// speed, from memory at one row (decode) at 0.6-0.7 of it (docs/benchmarks.md).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "tiles.h"

namespace weft::file_dot {

using tiles::kLanes;
using tiles::vecf;
typedef int32_t veci __attribute__((vector_size(4 * kLanes)));

constexpr int64_t kSuper = 256;  // features per super-block (Q4_K, Q6_K, and x's blocks)
enum Kind : int64_t { kQ4K = 0, kQ6K = 1 };
constexpr int64_t kBlockBytes[] = {144, 210};

// One row of x as the kernels read it: quantize_q8k_rows's int8 q[K] and scales d[K / 32] (each
// super-block's, repeated), and from them the sums of its quants over every 16 and every 32 features
// in int16 (|sum| <= 32 * 127), and with AVX-512 q in the order Q4_K's nibbles come in (`kQ4KOrder`).
struct XRow {
  const int8_t* q;
  const int8_t* q4k;  // q, each super-block's sub-blocks of 32 as 0, 2, 1, 3, 4, 6, 5, 7
  const float* d;
  const int16_t* sum16;
  const int16_t* sum32;
};

#if defined(__AVX512F__) && !defined(__AVX512BW__)
#error "file_dot.cpp's AVX-512 kernels need AVX512BW (byte products in 512 bits)"
#endif
#if defined(__AVX512BW__)
constexpr bool kWide = true;  // 512-bit byte products
#else
constexpr bool kWide = false;
#endif

// The rows of x [M, K] prepared (`XRow`), in one buffer.
struct Prepared {
  at::Tensor xq;  // quantize_q8k_rows(x)
  std::vector<int8_t> q4k;
  std::vector<int16_t> sums;
  std::vector<XRow> rows;

  Prepared(const at::Tensor& x) : xq(weft::quantize_q8k_rows(x)) {
    const int64_t m = x.size(0), k = x.size(1), bytes = xq.size(1);
    if (kWide) q4k.resize(m * k);
    sums.resize(m * (k / 16 + k / 32));
    for (int64_t r = 0; r < m; ++r) {
      const int8_t* row = xq.data_ptr<int8_t>() + r * bytes;
      const auto* sum = reinterpret_cast<const int32_t*>(row + k + 4 * (k / 32));
      int16_t* s16 = sums.data() + r * (k / 16 + k / 32);
      int16_t* s32 = s16 + k / 16;
      for (int64_t g = 0; g < k / 16; ++g) s16[g] = static_cast<int16_t>(sum[g]);
      for (int64_t g = 0; g < k / 32; ++g) s32[g] = static_cast<int16_t>(sum[2 * g] + sum[2 * g + 1]);
      const int8_t* order = row;
      if (kWide) {
        int8_t* dst = q4k.data() + r * k;
        for (int64_t sb = 0; sb < k / kSuper; ++sb)
          for (int s = 0; s < 8; ++s) std::memcpy(dst + sb * kSuper + 32 * s, row + sb * kSuper + 32 * kQ4KOrder[s], 32);
        order = dst;
      }
      rows.push_back({row, order, reinterpret_cast<const float*>(row + k), s16, s32});
    }
  }

  static constexpr int kQ4KOrder[8] = {0, 2, 1, 3, 4, 6, 5, 7};
};

#if defined(__AVX512BW__)
// 16 int32 lanes, each the sum of 4 products of unsigned w and signed x bytes.
inline __m512i dot4(__m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1));
#endif
}
inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }
// acc + vpmaddwd(a, b): one vpdpwssd with AVX512_VNNI
inline __m512i madd_add(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
#endif

#if defined(__AVX2__)
inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m256i dot4_256(__m256i w, __m256i x) { return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)); }
#endif

// ---- the sum of an int32 vector's lanes

#if defined(__AVX512BW__)
inline int32_t reduce(__m512i v) { return _mm512_reduce_add_epi32(v); }

// One level of a transpose-and-add (kernels.cpp's `fold`, in int32): lanes of `a` and `b` in the halves
// (of width kHalf lanes) that the mask selects are added to the neighbouring half.
template <int kHalf>
inline __m512i fold(__m512i a, __m512i b) {
  constexpr __mmask16 mask = kHalf == 8 ? 0xFF00 : kHalf == 4 ? 0xF0F0 : kHalf == 2 ? 0xCCCC : 0xAAAA;
  const __m512i kept = _mm512_mask_blend_epi32(mask, a, b);
  __m512i moved = _mm512_mask_blend_epi32(mask, b, a);
  if constexpr (kHalf == 8) moved = _mm512_shuffle_i32x4(moved, moved, 0x4E);
  if constexpr (kHalf == 4) moved = _mm512_shuffle_i32x4(moved, moved, 0xB1);
  if constexpr (kHalf == 2) moved = _mm512_shuffle_epi32(moved, _MM_PERM_BADC);
  if constexpr (kHalf == 1) moved = _mm512_shuffle_epi32(moved, _MM_PERM_CDAB);
  return _mm512_add_epi32(kept, moved);
}
#endif
#if defined(__AVX2__)
inline int32_t reduce(__m256i v) {
  const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i q = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, 0xB1)));
}
#endif

#if defined(__AVX2__)
inline int32_t sum4(__m128i v) {
  const __m128i q = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, 0xB1)));
}
#endif

// ---- Q4_K: d, dmin (float16), 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, then 128
// bytes of nibbles: bytes 32j .. 32j + 31 hold sub-block 2j in their low nibbles, 2j + 1 in their high.

struct Q4K {
  static constexpr int64_t kBytes = 144;

  // The 8 sub-blocks' 6-bit scales then their mins, a byte each (llama.cpp's get_scale_min_k4, as
  // its x86 code unpacks them four at a time).
  static void scales_mins(const uint8_t* s, uint32_t (&u)[4]) {
    uint32_t a[3];
    std::memcpy(a, s, 12);
    constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    u[0] = a[0] & k1;
    u[1] = (a[2] & k2) | (((a[0] >> 6) & k3) << 4);
    u[2] = a[1] & k1;
    u[3] = ((a[2] >> 4) & k2) | (((a[1] >> 6) & k3) << 4);
  }

#if defined(__AVX2__)
  // The 8 scales then the 8 mins, a byte each, as llama.cpp's utmp holds them: from the 12 bytes'
  // words a0, a1, a2, (a0 & k1, (a2 & k2) | ((a0 >> 2) & 0x30..), a1 & k1, ((a2 >> 4) & k2) | ((a1 >> 2)
  // & 0x30..)), in the vector unit.
  static __m128i scales_mins_vec(const uint8_t* s) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));  // (and 4 bytes of quants)
    const __m128i lows = _mm_srlv_epi32(_mm_shuffle_epi32(a, 0x98), _mm_setr_epi32(0, 0, 0, 4));  // a0 a2 a1 a2>>4
    const __m128i highs = _mm_srli_epi32(_mm_shuffle_epi32(a, 0x40), 2);  // (a0, a0, a0, a1) >> 2
    const __m128i k = _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f);
    return _mm_or_si128(_mm_and_si128(lows, k), _mm_and_si128(highs, _mm_setr_epi32(0, 0x30303030, 0, 0x30303030)));
  }
  // m_j * xsum_j of one row of x, in 4 lanes to be summed
  static __m128i mins(__m128i sm, const int16_t* xsum32) {
    return _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_srli_si128(sm, 8)), _mm_loadu_si128(reinterpret_cast<const __m128i*>(xsum32)));
  }
#endif

#if defined(__AVX512BW__)
  // A block's quants as bytes (sub-blocks 0 | 2, 1 | 3, 4 | 6, 5 | 7) and each sub-block's scale in
  // the 16-bit lanes of the same halves, for vpmaddwd; and the scales and mins as bytes.
  struct Unpacked {
    __m512i w[4], scale[4];
    __m128i sm;
  };

  static Unpacked unpack(const uint8_t* block) {
    Unpacked u;
    u.sm = scales_mins_vec(block + 4);
    const __m512i all = _mm512_broadcast_i32x4(u.sm);
    const __m512i mask = _mm512_set1_epi8(0x0F), v0 = load512(block + 16), v1 = load512(block + 80);
    u.w[0] = _mm512_and_si512(v0, mask);
    u.w[1] = _mm512_and_si512(_mm512_srli_epi16(v0, 4), mask);
    u.w[2] = _mm512_and_si512(v1, mask);
    u.w[3] = _mm512_and_si512(_mm512_srli_epi16(v1, 4), mask);
    for (int p = 0; p < 4; ++p) {
      const int a = 4 * (p / 2) + p % 2, b = a + 2;  // the low half's sub-block, the high half's
      const __m512i pick = _mm512_mask_blend_epi64(0xF0, _mm512_set1_epi16(static_cast<int16_t>(0xFF00 | a)),
                                                   _mm512_set1_epi16(static_cast<int16_t>(0xFF00 | b)));
      u.scale[p] = _mm512_shuffle_epi8(all, pick);  // (pshufb: 0xFF bytes read as 0)
    }
    return u;
  }

  // sum_j sc_j * dot_j of an unpacked block against one row of x, over 16 lanes (16-bit pair sums,
  // <= 2 * 15 * 127, times the scales in vpmaddwd), and sum_j m_j * xsum_j over 4 (`min`).
  static __m512i row(const Unpacked& u, const XRow& x, int64_t sb, __m128i& min) {
    const int8_t* xq = x.q4k + sb * kSuper;  // sub-blocks 0, 2, 1, 3, 4, 6, 5, 7
    __m512i t = _mm512_madd_epi16(_mm512_maddubs_epi16(u.w[0], load512(xq)), u.scale[0]);
    for (int p = 1; p < 4; ++p) t = madd_add(t, _mm512_maddubs_epi16(u.w[p], load512(xq + 64 * p)), u.scale[p]);
    min = mins(u.sm, x.sum32 + sb * 8);
    return t;
  }

  // Four (scaled, mins) vector pairs' sums at once: their vectors folded together (`fold`) where each
  // would take a horizontal sum of its own; into scaled[r * stride], mins[r * stride] for r < kCount.
  template <int kCount>
  static void sums4(__m512i t0, __m512i t1, __m512i t2, __m512i t3, __m128i m0, __m128i m1, __m128i m2, __m128i m3,
                    int32_t* scaled, int32_t* mins, int64_t stride) {
    const __m512i e = fold<4>(fold<8>(t0, t1), fold<8>(t2, t3));  // 128-bit quarters: 0, 2, 1, 3
    const __m512i ms = _mm512_inserti32x4(
        _mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(m0), m2, 1), m1, 2), m3, 3);
    const __m512i f = fold<2>(e, ms);
    const __m512i sums = fold<1>(f, f);  // quarter q: lane 0 the scaled sum, lane 2 the mins'
    constexpr int kQuarter[4] = {0, 2, 1, 3};
    const __m128i q[4] = {_mm512_castsi512_si128(sums), _mm512_extracti32x4_epi32(sums, 1),
                          _mm512_extracti32x4_epi32(sums, 2), _mm512_extracti32x4_epi32(sums, 3)};
    for (int r = 0; r < kCount; ++r) {
      scaled[r * stride] = _mm_cvtsi128_si32(q[kQuarter[r]]);
      mins[r * stride] = _mm_extract_epi32(q[kQuarter[r]], 2);
    }
  }

  static constexpr int kBlocksAtOnce = 4;  // one row of x: super-blocks whose sums are reduced together

  // A weight row's super-blocks sb .. sb + kCount - 1 against one row of x: their integer sums into
  // scaled[r * stride] and mins[r * stride].
  template <int kCount>
  static void blocks_ints(const uint8_t* row_blocks, const XRow& x, int64_t sb, int32_t* scaled, int32_t* mins,
                          int64_t stride) {
    const __m512i zero = _mm512_setzero_si512();
    const __m128i none = _mm_setzero_si128();
    __m128i m0 = none, m1 = none, m2 = none, m3 = none;
    const __m512i t0 = row(unpack(row_blocks + sb * kBytes), x, sb, m0);
    const __m512i t1 = kCount > 1 ? row(unpack(row_blocks + (sb + 1) * kBytes), x, sb + 1, m1) : zero;
    const __m512i t2 = kCount > 2 ? row(unpack(row_blocks + (sb + 2) * kBytes), x, sb + 2, m2) : zero;
    const __m512i t3 = kCount > 3 ? row(unpack(row_blocks + (sb + 3) * kBytes), x, sb + 3, m3) : zero;
    sums4<kCount>(t0, t1, t2, t3, m0, m1, m2, m3, scaled, mins, stride);
  }

  // One super-block against kRows (2 .. 4) rows of x, unpacked once: into scaled[i * stride], mins[i * stride].
  template <int kRows>
  static void rows_ints(const uint8_t* block, const XRow* x, int64_t sb, int32_t* scaled, int32_t* mins,
                        int64_t stride) {
    const Unpacked u = unpack(block);
    const __m512i zero = _mm512_setzero_si512();
    const __m128i none = _mm_setzero_si128();
    __m128i m0 = none, m1 = none, m2 = none, m3 = none;
    const __m512i t0 = row(u, x[0], sb, m0);
    const __m512i t1 = kRows > 1 ? row(u, x[1], sb, m1) : zero;
    const __m512i t2 = kRows > 2 ? row(u, x[2], sb, m2) : zero;
    const __m512i t3 = kRows > 3 ? row(u, x[3], sb, m3) : zero;
    sums4<kRows>(t0, t1, t2, t3, m0, m1, m2, m3, scaled, mins, stride);
  }
#elif defined(__AVX2__)
  // One weight row's super-block against one row of x: sum_j sc_j * dot_j over 8 lanes (each
  // sub-block's 16-bit pair sums times its scale in vpmaddwd), and sum_j m_j * xsum_j (`min`).
  static __m256i row(const uint8_t* block, const XRow& x, int64_t sb, int32_t& min) {
    const __m128i sm = scales_mins_vec(block + 4);
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));  // the 8 scales, int16
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const int8_t* xq = x.q + sb * kSuper;
    __m256i t = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i v = load256(block + 16 + 32 * j);
      const __m256i lo = _mm256_maddubs_epi16(_mm256_and_si256(v, mask), load256(xq + 64 * j));
      const __m256i hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), mask), load256(xq + 64 * j + 32));
      const __m256i sc_lo = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * 2 * j)));
      const __m256i sc_hi = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * (2 * j + 1))));
      t = _mm256_add_epi32(t, _mm256_add_epi32(_mm256_madd_epi16(lo, sc_lo), _mm256_madd_epi16(hi, sc_hi)));
    }
    min = sum4(mins(sm, x.sum32 + sb * 8));
    return t;
  }
#endif

#if defined(__AVX2__) && !defined(__AVX512BW__)
  static constexpr int kBlocksAtOnce = 1;
  // The super-block's integer sums of one weight row against one row of x: scaled = sum_j sc_j *
  // dot_j and min = sum_j m_j * xsum_j (what the dot panels' tiles sum in int32).
  template <int kCount>
  static void blocks_ints(const uint8_t* row_blocks, const XRow& x, int64_t sb, int32_t* scaled, int32_t* min,
                          int64_t) {
    *scaled = reduce(row(row_blocks + sb * kBytes, x, sb, *min));
  }
#elif !defined(__AVX2__)
  static constexpr int kBlocksAtOnce = 1;
  template <int kCount>
  static void blocks_ints(const uint8_t* row_blocks, const XRow& x, int64_t sb, int32_t* scaled, int32_t* min,
                          int64_t) {
    row_ints(row_blocks + sb * kBytes, x, sb, *scaled, *min);
  }
  static void row_ints(const uint8_t* block, const XRow& x, int64_t sb, int32_t& scaled, int32_t& min) {
    uint32_t u[4];
    scales_mins(block + 4, u);
    const auto* sm = reinterpret_cast<const uint8_t*>(u);  // scales, then mins
    const uint8_t* qs = block + 16;
    const int8_t* xq = x.q + sb * kSuper;
    scaled = min = 0;
    for (int j = 0; j < 4; ++j) {
      int32_t low = 0, high = 0;
      for (int l = 0; l < 32; ++l) {
        low += (qs[32 * j + l] & 0x0F) * xq[64 * j + l];
        high += (qs[32 * j + l] >> 4) * xq[64 * j + 32 + l];
      }
      scaled += sm[2 * j] * low + sm[2 * j + 1] * high;
    }
    for (int j = 0; j < 8; ++j) min += sm[8 + j] * x.sum32[sb * 8 + j];
  }
#endif

};

// ---- Q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16] (one per sub-block of 16),
// d (float16). In each half of 128 features (ql + 64 h, qh + 32 h), feature 32 k + l (k < 4, l < 32)
// has its low bits in ql[l + 32 (k % 2)] (low nibble for k < 2, high for k >= 2) and its high bits
// at bit 2 k of qh[l]; q = those 6 bits - 32.

struct Q6K {
  static constexpr int64_t kBytes = 210;
  static constexpr int kInts = kLanes == 16 ? 1 : 16;  // ints a super-block and row of x

#if defined(__AVX2__)
  // Half h's 6-bit quants (0..63) in 4 vectors of 32 features each, in order.
  static void unpack_half(const uint8_t* block, int h, __m256i* q) {
    const __m256i a = load256(block + 64 * h), b = load256(block + 64 * h + 32), hi = load256(block + 128 + 32 * h);
    const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    q[0] = _mm256_or_si256(_mm256_and_si256(a, low), _mm256_and_si256(_mm256_slli_epi16(hi, 4), top));
    q[1] = _mm256_or_si256(_mm256_and_si256(b, low), _mm256_and_si256(_mm256_slli_epi16(hi, 2), top));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low), _mm256_and_si256(hi, top));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), low), _mm256_and_si256(_mm256_srli_epi16(hi, 2), top));
  }
  // 32 * sum_s sc_s * xsum_s: the quants' offset of 32 through the activations' sums
  static int32_t bias(const uint8_t* block, const XRow& x, int64_t sb) {
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192)));
    const __m256i p = _mm256_madd_epi16(sc, load256(x.sum16 + sb * 16));
    return 32 * sum4(_mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1)));
  }
#endif

#if defined(__AVX512BW__)
  // One weight row's super-block against one row of x: sum_s sc_s * sum(q * x8) over 16 lanes, and
  // the bias to take off it.
  static __m512i row(const uint8_t* block, const XRow& x, int64_t sb, int32_t& bias_out) {
    const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192)));
    __m256i q[8];
    unpack_half(block, 0, q);
    unpack_half(block, 1, q + 4);
    const int8_t* xq = x.q + sb * kSuper;
    const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), four = _mm512_set1_epi32(4);
    __m512i t = _mm512_setzero_si512(), at = pick;
    for (int p = 0; p < 4; ++p) {  // features 64 p ..: sub-blocks 4 p .. 4 p + 3, 4 lanes each
      const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(q[2 * p]), q[2 * p + 1], 1);
      t = _mm512_add_epi32(t, _mm512_mullo_epi32(dot4(w, load512(xq + 64 * p)), _mm512_permutexvar_epi32(at, sc)));
      at = _mm512_add_epi32(at, four);
    }
    bias_out = bias(block, x, sb);
    return t;
  }
#elif defined(__AVX2__)
  // Each sub-block's sum((q - 32) * x8) into subs[16].
  static void row_subs(const uint8_t* block, const XRow& x, int64_t sb, int32_t* subs) {
    __m256i q[8];
    unpack_half(block, 0, q);
    unpack_half(block, 1, q + 4);
    const int8_t* xq = x.q + sb * kSuper;
    __m256i d[8];
    for (int p = 0; p < 8; ++p) d[p] = dot4_256(q[p], load256(xq + 32 * p));  // lanes 0-3: sub 2p, 4-7: 2p + 1
    alignas(32) int32_t lanes[8];
    for (int p = 0; p < 8; p += 2) {
      const __m256i h = _mm256_hadd_epi32(d[p], d[p + 1]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_hadd_epi32(h, h));
      subs[2 * p] = lanes[0];
      subs[2 * p + 1] = lanes[4];
      subs[2 * p + 2] = lanes[1];
      subs[2 * p + 3] = lanes[5];
    }
    for (int s = 0; s < 16; ++s) subs[s] -= 32 * x.sum16[sb * 16 + s];
  }
#else
  static void row_subs(const uint8_t* block, const XRow& x, int64_t sb, int32_t* subs) {
    uint8_t q[kSuper];
    for (int h = 0; h < 2; ++h) {
      const uint8_t *ql = block + 64 * h, *qh = block + 128 + 32 * h;
      for (int l = 0; l < 32; ++l) {
        q[128 * h + l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
        q[128 * h + l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
        q[128 * h + l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
        q[128 * h + l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
      }
    }
    const int8_t* xq = x.q + sb * kSuper;
    for (int s = 0; s < 16; ++s) {
      int32_t sum = 0;
      for (int l = 0; l < 16; ++l) sum += q[16 * s + l] * xq[16 * s + l];
      subs[s] = sum - 32 * x.sum16[sb * 16 + s];
    }
  }
#endif

  // kLanes == 16: sum_s sc_s * sum((q - 32) * x8) of one weight row's super-block against one row of
  // x, in out[0]; kLanes == 8: each sub-block's sum((q - 32) * x8), in out[s * kLanes].
  static void row_ints(const uint8_t* block, const XRow& x, int64_t sb, int32_t* out) {
#if defined(__AVX512BW__)
    int32_t b;
    const __m512i t = row(block, x, sb, b);
    out[0] = reduce(t) - b;
#else
    int32_t subs[16];
    row_subs(block, x, sb, subs);
    for (int s = 0; s < 16; ++s) out[s * kLanes] = subs[s];
#endif
  }

};

constexpr int kMaxRows = 4;  // rows of x per pass over a group of weight rows

// Rows of blocks one after another: rows[l] is row l's first block.
struct Rows {
  const uint8_t* first;
  int64_t stride;
  const uint8_t* operator[](int64_t l) const { return first + l * stride; }
};

// Each (row of x, super-block): a vector of the lanes' ints, `per` of them, and the lanes' scales.
struct LaneInts {
  std::vector<int32_t> ints;     // [kMaxRows][nsb][per][kLanes]
  std::vector<uint16_t> halves;  // [2][nsb][kLanes]: d, and dmin (Q4_K)
  std::vector<int32_t> scales;   // Q6_K with 8 lanes: [nsb][16][kLanes], each sub-block's scale
  int64_t nsb = -1, per = 0;

  void resize(int64_t super_blocks, int64_t ints_per) {
    nsb = super_blocks;
    per = ints_per;
    ints.assign(kMaxRows * nsb * per * kLanes, 0);
    halves.assign(2 * nsb * kLanes, 0);
    scales.assign(kLanes == 16 ? 0 : nsb * 16 * kLanes, 0);
  }
  int32_t* at(int i, int64_t sb, int l) { return &ints[((i * nsb + sb) * per) * kLanes + l]; }  // stride kLanes
  veci lanes(int i, int64_t sb, int64_t c) const {
    veci v;
    std::memcpy(&v, &ints[((i * nsb + sb) * per + c) * kLanes], sizeof(v));
    return v;
  }
  vecf half(int which, int64_t sb) const { return tiles::widen_halves(&halves[(which * nsb + sb) * kLanes]); }
  // Lanes [lanes, kLanes) (a part's short last group) to zero, for rows of x [0, rows).
  void clear_lanes(int lanes, int rows) {
    if (lanes == kLanes) return;
    const auto clear = [&](auto& values, int64_t vectors) {
      for (int64_t v = 0; v < vectors; ++v) std::fill_n(&values[v * kLanes + lanes], kLanes - lanes, 0);
    };
    clear(ints, rows * nsb * per);  // rows of x [0, rows): the first vectors
    clear(halves, 2 * nsb);
    clear(scales, static_cast<int64_t>(scales.size()) / kLanes);
  }
};

// This thread's LaneInts for a product of `nsb` super-blocks a row, `per` ints each.
inline LaneInts& lane_ints(int64_t nsb, int64_t per) {
  thread_local LaneInts g;
  if (g.nsb != nsb || g.per != per) g.resize(nsb, per);
  return g;
}

// kLanes weight rows (`rows[l]`: lane l's first block) times kRows rows of x, into acc: the integer
// sums of each row in turn, its blocks as they lie in memory (the hardware prefetcher's one stream),
// then the super-blocks in order into float32 in the panel kernels' expressions: dot_tile_q4_k's,
// dot_tile_small_k_int's (Q6_K, 16 lanes: a super-block summed in int32) or
// dot_tile_small_k_float's (Q6_K, 8 lanes: each sub-block scaled in float32).
template <int kRows>
void q4k_group(vecf (&acc)[kRows], const Rows& rows, int lanes, const XRow* x, int64_t nsb) {
  LaneInts& g = lane_ints(nsb, 2);
  constexpr int kAtOnce = Q4K::kBlocksAtOnce;
  for (int l = 0; l < lanes; ++l) {
    for (int64_t sb = 0; sb < nsb; sb += kAtOnce) {
      const int count = static_cast<int>(std::min<int64_t>(kAtOnce, nsb - sb));
      for (int r = 0; r < count; ++r) {
        const uint8_t* block = rows[l] + (sb + r) * Q4K::kBytes;
        std::memcpy(&g.halves[(sb + r) * kLanes + l], block, 2);
        std::memcpy(&g.halves[(nsb + sb + r) * kLanes + l], block + 2, 2);
      }
#if defined(__AVX512BW__)
      if constexpr (kRows > 1) {  // each block unpacked once for the rows of x
        const int64_t stride = nsb * 2 * kLanes;  // from one row of x's ints to the next's
        for (int r = 0; r < count; ++r) {
          int32_t* out = g.at(0, sb + r, l);
          Q4K::rows_ints<kRows>(rows[l] + (sb + r) * Q4K::kBytes, x, sb + r, out, out + kLanes, stride);
        }
        continue;
      }
#endif
      for (int i = 0; i < kRows; ++i) {
        int32_t* out = g.at(i, sb, l);
        switch (count) {
          case 1: Q4K::blocks_ints<1>(rows[l], x[i], sb, out, out + kLanes, 2 * kLanes); break;
          case 2: Q4K::blocks_ints<2>(rows[l], x[i], sb, out, out + kLanes, 2 * kLanes); break;
          case 3: Q4K::blocks_ints<3>(rows[l], x[i], sb, out, out + kLanes, 2 * kLanes); break;
          default: Q4K::blocks_ints<4>(rows[l], x[i], sb, out, out + kLanes, 2 * kLanes); break;
        }
      }
    }
  }
  g.clear_lanes(lanes, kRows);
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const vecf d = g.half(0, sb), dmin = g.half(1, sb);
    for (int i = 0; i < kRows; ++i) {
      const float dx = x[i].d[sb * (kSuper / 32)];
      acc[i] += __builtin_convertvector(g.lanes(i, sb, 0), vecf) * (d * dx) -
                __builtin_convertvector(g.lanes(i, sb, 1), vecf) * (dmin * dx);
    }
  }
}

template <int kRows>
void q6k_group(vecf (&acc)[kRows], const Rows& rows, int lanes, const XRow* x, int64_t nsb) {
  constexpr int kInts = Q6K::kInts;
  LaneInts& g = lane_ints(nsb, kInts);
  std::vector<int32_t>& scales = g.scales;  // 8 lanes: [nsb][16][kLanes]
  for (int l = 0; l < lanes; ++l) {
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* block = rows[l] + sb * Q6K::kBytes;
      for (int i = 0; i < kRows; ++i) Q6K::row_ints(block, x[i], sb, g.at(i, sb, l));
      std::memcpy(&g.halves[sb * kLanes + l], block + 208, 2);
      if constexpr (kLanes != 16) {
        for (int s = 0; s < 16; ++s) scales[(sb * 16 + s) * kLanes + l] = reinterpret_cast<const int8_t*>(block + 192)[s];
      }
    }
  }
  g.clear_lanes(lanes, kRows);
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const vecf d = g.half(0, sb);
    for (int i = 0; i < kRows; ++i) {
      const float dx = x[i].d[sb * (kSuper / 32)];
      if constexpr (kLanes == 16) {
        acc[i] += __builtin_convertvector(g.lanes(i, sb, 0), vecf) * (d * dx);
      } else {
        for (int s = 0; s < 16; ++s) {
          veci sc;
          std::memcpy(&sc, &scales[(sb * 16 + s) * kLanes], sizeof(sc));
          const vecf scale = d * __builtin_convertvector(sc, vecf);
          acc[i] += __builtin_convertvector(g.lanes(i, sb, s), vecf) * (scale * dx);
        }
      }
    }
  }
}

// One part of a matrix: `rows` rows of blocks of one kind, `stride` bytes apart, from `first`.
struct Part {
  const uint8_t* first;
  int64_t stride, rows, kind;
};

// One matrix of the product: its parts, stacked by rows, the rows of x that multiply it and where
// their outputs go.
struct Matrix {
  std::vector<Part> parts;
  int64_t x_row, x_rows;  // x's rows [x_row, x_row + x_rows)
  float* out;             // out row of x_row, column 0
  int64_t height() const {
    int64_t n = 0;
    for (const Part& p : parts) n += p.rows;
    return n;
  }
};

// kLanes output rows, one part's, from output column `column`: a unit of the parallel loop.
struct Group {
  const Matrix* matrix;
  const Part* part;
  int64_t row, column;  // the first row in the part, its output column
  int lanes;
};

// The group's weight rows for kRows rows of x, into out.
template <int kRows>
void run_group(const Group& g, const XRow* x, int64_t k, float* out, int64_t out_stride) {
  vecf acc[kRows] = {};
  const Rows rows{g.part->first + g.row * g.part->stride, g.part->stride};
  if (g.part->kind == kQ4K) {
    q4k_group<kRows>(acc, rows, g.lanes, x, k / kSuper);
  } else {
    q6k_group<kRows>(acc, rows, g.lanes, x, k / kSuper);
  }
  for (int i = 0; i < kRows; ++i) std::memcpy(out + i * out_stride + g.column, &acc[i], sizeof(float) * g.lanes);
}

// Every x row of the group's matrix times the group's rows.
void run_rows(const Group& g, const Prepared& xs, int64_t k, int64_t out_stride) {
  const Matrix& m = *g.matrix;
  for (int64_t r = 0; r < m.x_rows; r += kMaxRows) {
    const XRow* x = xs.rows.data() + m.x_row + r;
    float* out = m.out + r * out_stride;
    switch (std::min<int64_t>(kMaxRows, m.x_rows - r)) {
      case 1: run_group<1>(g, x, k, out, out_stride); break;
      case 2: run_group<2>(g, x, k, out, out_stride); break;
      case 3: run_group<3>(g, x, k, out, out_stride); break;
      default: run_group<4>(g, x, k, out, out_stride); break;
    }
  }
}

// The matrices' groups of kLanes rows, one part's each (a part's last group may be short).
std::vector<Group> groups_of(const std::vector<Matrix>& matrices) {
  std::vector<Group> groups;
  for (const Matrix& m : matrices) {
    int64_t column = 0;
    for (const Part& part : m.parts) {
      for (int64_t row = 0; row < part.rows; row += kLanes) {
        groups.push_back({&m, &part, row, column + row, static_cast<int>(std::min<int64_t>(kLanes, part.rows - row))});
      }
      column += part.rows;
    }
  }
  return groups;
}

void run(const std::vector<Matrix>& matrices, const at::Tensor& x, int64_t out_stride) {
  const std::vector<Group> groups = groups_of(matrices);
  const Prepared xs(x);
  at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) run_rows(groups[g], xs, x.size(1), out_stride);
  });
}

// A matrix from its parts: each part [rows, row bytes] uint8 of kinds[p] (0: Q4_K, 1: Q6_K).
Matrix matrix_of(at::TensorList parts, at::IntArrayRef kinds, int64_t k, const char* op) {
  TORCH_CHECK(parts.size() == kinds.size() && !parts.empty(), op, ": one kind per part, and at least one part");
  Matrix m{};
  for (size_t p = 0; p < parts.size(); ++p) {
    const at::Tensor& part = parts[p];
    TORCH_CHECK(kinds[p] == kQ4K || kinds[p] == kQ6K, op, ": a part's kind must be 0 (Q4_K) or 1 (Q6_K)");
    TORCH_CHECK(part.device().is_cpu() && part.scalar_type() == at::kByte && part.dim() == 2 &&
                    part.size(1) == k / kSuper * kBlockBytes[kinds[p]] && part.stride(1) == 1,
                op, ": each part must be uint8 [rows, K / 256 * block bytes] on the CPU, rows of whole blocks");
    m.parts.push_back({part.data_ptr<uint8_t>(), part.stride(0), part.size(0), kinds[p]});
  }
  return m;
}

void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 &&
                  x.size(1) % kSuper == 0,
              op, ": x must be float32 [M, K] on the CPU with contiguous rows, K a multiple of 256");
}

// out [M, N] = x [M, K] @ W.T, W's rows the parts' in order.
at::Tensor file_linear(const at::Tensor& x, at::TensorList parts, at::IntArrayRef kinds) {
  check_x(x, "file_linear");
  const int64_t k = x.size(1);
  Matrix m = matrix_of(parts, kinds, k, "file_linear");
  const int64_t n = m.height();
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  m.x_row = 0;
  m.x_rows = x.size(0);
  m.out = out.data_ptr<float>();
  run({m}, x, n);
  return out;
}

// out [E, N]: row e of x times matrix e, matrix e the parts [e * parts_per_matrix, ...) (a row's
// routed experts in one call: batch 1 of a mixture of experts).
at::Tensor file_linear_rows(const at::Tensor& x, at::TensorList parts, at::IntArrayRef kinds,
                            int64_t parts_per_matrix) {
  check_x(x, "file_linear_rows");
  const int64_t k = x.size(1), e = x.size(0);
  TORCH_CHECK(parts_per_matrix > 0 && static_cast<int64_t>(parts.size()) == e * parts_per_matrix &&
                  kinds.size() == parts.size(),
              "file_linear_rows: parts_per_matrix parts (and kinds) per row of x");
  std::vector<Matrix> matrices;
  for (int64_t i = 0; i < e; ++i) {
    const auto from = static_cast<size_t>(i * parts_per_matrix), count = static_cast<size_t>(parts_per_matrix);
    matrices.push_back(matrix_of(parts.slice(from, count), kinds.slice(from, count), k, "file_linear_rows"));
  }
  const int64_t n = matrices[0].height();
  for (const Matrix& m : matrices) TORCH_CHECK(m.height() == n, "file_linear_rows: matrices of one height");
  at::Tensor out = at::empty({e, n}, x.options());
  for (int64_t i = 0; i < e; ++i) {
    matrices[i].x_row = i;
    matrices[i].x_rows = 1;
    matrices[i].out = out.data_ptr<float>() + i * n;
  }
  run(matrices, x, n);
  return out;
}

}  // namespace weft::file_dot

TORCH_LIBRARY_FRAGMENT(weft, m) {
  m.def("file_linear(Tensor x, Tensor[] parts, int[] kinds) -> Tensor");
  m.def("file_linear_rows(Tensor x, Tensor[] parts, int[] kinds, int parts_per_matrix) -> Tensor");
}

TORCH_LIBRARY_IMPL(weft, CPU, m) {
  m.impl("file_linear", &weft::file_dot::file_linear);
  m.impl("file_linear_rows", &weft::file_dot::file_linear_rows);
}
