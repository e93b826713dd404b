// Quantized linear layers with int8 activations (llama.cpp's arithmetic): y = x @ W.T + b where W
// is in dot panels (panels.h: Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, Q4_K, Q5_K, Q6_K, and Q6_K with mins,
// which holds every k-quant; Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4) and x is
// quantized once per call, each row in blocks of 32 features (Q8_0 weights) or 256 (k-quants), to
// int8 quants with a scale d = max |x| / 127 (and the sum of every 16 quants), exactly
// as llama.cpp quantizes activations for the same weights. The products are byte dot
// products: vpdpbusd (AVX-512 VNNI), or vpmaddubsw + vpmaddwd (AVX-512BW, AVX2), four features
// per 32-bit lane, summed exactly in int32 over a sub-block and then scaled in float32:
//
//   y = sum over sub-blocks of  d_x * (d * sc) * sum(q * x8)  -  d_x * (dmin * m) * sum(x8)
//
// (the k-quants with AVX-512: each sub-block's sum times its integer scale sc, added up in int32
// over the super-block, then scaled once by d_x * d, as llama.cpp does).
//
// Not the float32 product of the dequantized weights (x is rounded to 8 bits, as llama.cpp rounds
// it), at a quarter of the instructions per weight of widening the weights to float32: what lets a
// 4-bit matrix stream at the machine's read bandwidth at one row, and prefill run at 4 products per
// lane per instruction. matmul_precision="float32" keeps the exact panels of linear.cpp instead.
//
// vpdpbusd multiplies unsigned by signed bytes: k-quant quants are unsigned (0..63), and a Q8_0
// weight w goes in as w + 128 (w ^ 0x80) with 128 * sum(x8) taken off the block's sum. vpmaddubsw
// saturates its pair sums at 32,767, so without VNNI a Q8_0 product is |w| * (x8 signed by w).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "panels.h"
#include "tiles.h"

namespace {

using weft::kDotGroup;
using weft::kPanel;
using weft::tiles::finish_tile;
using weft::tiles::prefetch_out_line;
using weft::tiles::prefetch_weights;
using weft::tiles::kLanes;
using weft::tiles::kPrefetchBytes;  // 2 KB: 4, 8 and 16 KB measured the same here
using weft::tiles::kVecs;
using weft::tiles::Tile;
using weft::tiles::vecf;
using weft::tiles::widen_halves;
using weft::tiles::widen_int8;

typedef int32_t veci __attribute__((vector_size(4 * kLanes)));   // int32 lanes: one column each
typedef int8_t vecb __attribute__((vector_size(4 * kLanes)));    // the same bytes: 4 features a lane
typedef uint32_t vecw __attribute__((vector_size(4 * kLanes)));  // for shifts of packed quants
typedef int16_t vech __attribute__((vector_size(4 * kLanes)));   // 16-bit sums of byte pairs: 2 a lane

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

// ---- activations: x [M, K] float32 -> per row int8 q[K] | float32 d[K / 32] | int32 sums[K / 16]

constexpr int64_t kActBlock = 32;  // features per activation scale
constexpr int64_t kSumGroup = 16;  // features per stored sum of quants

int64_t act_row_bytes(int64_t k) { return k + 4 * (k / kActBlock) + 4 * (k / kSumGroup); }

struct ActRow {
  const int8_t* q;
  const float* d;
  const int32_t* sums;
};

inline ActRow act_row(const Tile& t, int i) {
  const auto* row = static_cast<const int8_t*>(t.xq) + i * t.xq_stride;
  return {row, reinterpret_cast<const float*>(row + t.k),
          reinterpret_cast<const int32_t*>(row + t.k + 4 * (t.k / kActBlock))};
}

// x rounded as llama.cpp rounds it for the same weights, so that weft computes what llama.cpp
// computes from a GGUF file: for Q8_0 weights (quantize_row_q8_0) blocks of 32 with
// d = float16(max |x| / 127) and q = x * (127 / max |x|) rounded to nearest even; for k-quants
// (quantize_row_q8_K) blocks of 256 with q = x * (127 / max |x|) rounded and d = 1 / (127 / max |x|),
// float32. d is stored per 32 features either way (a k-quant block's repeated 8 times). For Q4_1
// and Q5_1 weights (quantize_row_q8_1) the Q8_0 rounding, and in place of each block's two sums of
// 16 its float16 s = float16(max |x| / 127 * sum(q)) (the float32 scale's, not d's), as a float in
// the first of the two (`block_s`).
enum class ActBlocks { kQ8_0, kQ8_1, kQ8_K };

inline float block_s(const int32_t* sums, int64_t b) {
  float s;
  std::memcpy(&s, sums + 2 * b, 4);
  return s;
}

// max |x| over a block of n (a multiple of 16) features, NaN left out as std::max leaves it out
// (vmaxps returns its second operand where either is NaN: the running maximum).
inline float block_amax(const float* x, int64_t n) {
#if defined(__AVX512F__)
  __m512 m = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + j)), m);
  return _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), magnitude), m);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  return *std::max_element(lanes, lanes + 8);
#else
  float amax = 0.0f;
  for (int64_t j = 0; j < n; ++j) amax = std::max(amax, std::fabs(x[j]));
  return amax;
#endif
}

// out[j] = x[j] * inv rounded to the nearest integer (ties to even), 0 where that is outside
// [-127, 127] (a non-finite x), for the 16 features of a sum group; returns their sum.
inline int32_t quantize_group(const float* x, float inv, int8_t* out) {
  static_assert(kSumGroup == 16);
#if defined(__AVX512F__) || defined(__AVX2__)
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
#endif
#if defined(__AVX512F__)
  const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(inv)), kRound);
  const __mmask16 in_range = _mm512_cmp_ps_mask(r, _mm512_set1_ps(-127.0f), _CMP_GE_OQ) &
                             _mm512_cmp_ps_mask(r, _mm512_set1_ps(127.0f), _CMP_LE_OQ);
  const __m512i v = _mm512_maskz_cvtps_epi32(in_range, r);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(v));
  return _mm512_reduce_add_epi32(v);
#elif defined(__AVX2__)
  __m256i v[2];
  for (int h = 0; h < 2; ++h) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * h), _mm256_set1_ps(inv)), kRound);
    const __m256 in_range = _mm256_and_ps(_mm256_cmp_ps(r, _mm256_set1_ps(-127.0f), _CMP_GE_OQ),
                                          _mm256_cmp_ps(r, _mm256_set1_ps(127.0f), _CMP_LE_OQ));
    v[h] = _mm256_cvtps_epi32(_mm256_and_ps(r, in_range));
  }
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(v[0], v[1]), 0xD8);  // 16 int16 in order
  const __m256i bytes = _mm256_packs_epi16(words, words);  // per 128-bit lane: its 8 bytes, twice
  const __m128i ordered = _mm_unpacklo_epi64(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), ordered);
  const __m256i total = _mm256_add_epi32(v[0], v[1]);
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), total);
  int32_t sum = 0;
  for (int32_t lane : lanes) sum += lane;
  return sum;
#else
  int32_t sum = 0;
  for (int64_t j = 0; j < kSumGroup; ++j) {
    const float r = std::nearbyint(x[j] * inv);
    const int v = r >= -127.0f && r <= 127.0f ? static_cast<int>(r) : 0;  // non-finite x: 0
    out[j] = static_cast<int8_t>(v);
    sum += v;
  }
  return sum;
#endif
}

template <ActBlocks kBlocks>
void quantize_row(const float* x, int64_t k, int8_t* out) {
  constexpr int64_t kBlock = kBlocks == ActBlocks::kQ8_K ? 256 : kActBlock;
  auto* d = reinterpret_cast<float*>(out + k);
  auto* sums = reinterpret_cast<int32_t*>(out + k + 4 * (k / kActBlock));
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    const float amax = block_amax(xb, kBlock);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const float scale = kBlocks != ActBlocks::kQ8_K ? static_cast<float>(c10::Half(amax / 127.0f))
                        : amax > 0.0f                ? 1.0f / inv
                                                     : 0.0f;
    for (int64_t j = 0; j < kBlock / kActBlock; ++j) d[b * (kBlock / kActBlock) + j] = scale;
    for (int64_t g = 0; g < kBlock / kSumGroup; ++g) {
      sums[b * (kBlock / kSumGroup) + g] = quantize_group(xb + g * kSumGroup, inv, out + b * kBlock + g * kSumGroup);
    }
    if constexpr (kBlocks == ActBlocks::kQ8_1) {
      const float s = static_cast<float>(c10::Half(amax / 127.0f * static_cast<float>(sums[2 * b] + sums[2 * b + 1])));
      std::memcpy(sums + 2 * b, &s, 4);
      sums[2 * b + 1] = 0;
    }
  }
}

// [M, K] float32 -> [M, act_row_bytes(K)] int8
template <ActBlocks kBlocks>
at::Tensor quantize_activations(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), bytes = act_row_bytes(k);
  auto out = at::empty({m, bytes}, x.options().dtype(at::kChar));
  const float* xp = x.data_ptr<float>();
  int8_t* op = out.data_ptr<int8_t>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) quantize_row<kBlocks>(xp + i * x.stride(0), k, op + i * bytes);
  });
  return out;
}

// ---- byte dot products

// The sums of adjacent byte products u * s (u unsigned, s signed) as 16-bit lanes, 2 per 32-bit lane:
// vpmaddubsw, which saturates at 32,767; the callers keep every sum below that.
inline vech pair_sums(vecb u, vecb s) {
#if defined(__AVX512BW__)
  return reinterpret_cast<vech>(_mm512_maddubs_epi16(reinterpret_cast<__m512i>(u), reinterpret_cast<__m512i>(s)));
#elif defined(__AVX2__) && !defined(__AVX512F__)
  return reinterpret_cast<vech>(_mm256_maddubs_epi16(reinterpret_cast<__m256i>(u), reinterpret_cast<__m256i>(s)));
#else
  vech p;
  for (int h = 0; h < 2 * kLanes; ++h) {
    p[h] = static_cast<int16_t>(static_cast<uint8_t>(u[2 * h]) * s[2 * h] + static_cast<uint8_t>(u[2 * h + 1]) * s[2 * h + 1]);
  }
  return p;
#endif
}

// Each 32-bit lane's two 16-bit products a * b added: vpmaddwd.
inline veci madd_pairs(vech a, vech b) {
#if defined(__AVX512BW__)
  return reinterpret_cast<veci>(_mm512_madd_epi16(reinterpret_cast<__m512i>(a), reinterpret_cast<__m512i>(b)));
#elif defined(__AVX2__) && !defined(__AVX512F__)
  return reinterpret_cast<veci>(_mm256_madd_epi16(reinterpret_cast<__m256i>(a), reinterpret_cast<__m256i>(b)));
#else
  veci w;
  for (int l = 0; l < kLanes; ++l) w[l] = a[2 * l] * b[2 * l] + a[2 * l + 1] * b[2 * l + 1];
  return w;
#endif
}

// Each 32-bit lane's two 16-bit sums added: vpmaddwd by ones.
inline veci widen_pairs(vech p) { return madd_pairs(p, reinterpret_cast<vech>(veci{} + 0x10001)); }

// acc[lane] += the sum over the lane's 4 bytes of u * s (u unsigned, at most 128 unless VNNI; s signed).
inline veci dot_bytes(veci acc, vecb u, vecb s) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  return reinterpret_cast<veci>(_mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc), reinterpret_cast<__m512i>(u),
                                                    reinterpret_cast<__m512i>(s)));
#else
  return acc + widen_pairs(pair_sums(u, s));
#endif
}

// acc += w * x for signed w (Q8_0): with VNNI (w + 128) * x, the caller taking 128 * sum(x) off;
// else |w| * (x negated where w < 0).
inline veci dot_signed(veci acc, vecb w, vecb x) {
  if constexpr (kVnni) {
    return dot_bytes(acc, w ^ static_cast<int8_t>(-128), x);
  } else {
#if defined(__AVX512BW__)
    const __m512i wi = reinterpret_cast<__m512i>(w);
    const __m512i xs = _mm512_mask_sub_epi8(reinterpret_cast<__m512i>(x), _mm512_movepi8_mask(wi),
                                            _mm512_setzero_si512(), reinterpret_cast<__m512i>(x));
    return dot_bytes(acc, reinterpret_cast<vecb>(_mm512_abs_epi8(wi)), reinterpret_cast<vecb>(xs));
#elif defined(__AVX2__) && !defined(__AVX512F__)
    const __m256i wi = reinterpret_cast<__m256i>(w);
    return dot_bytes(acc, reinterpret_cast<vecb>(_mm256_abs_epi8(wi)),
                     reinterpret_cast<vecb>(_mm256_sign_epi8(reinterpret_cast<__m256i>(x), wi)));
#else
    const vecb sign = w >> 7;  // -1 where w < 0
    return dot_bytes(acc, (w ^ sign) - sign, (x ^ sign) - sign);
#endif
  }
}

// One vector of bytes from p (unaligned). Not a memcpy into an array of vectors: GCC merges those
// into one copy through the stack, whose 16-byte stores then stall the 32-byte loads (Q8_0 at one
// row ran at a third of its speed from L2 on AVX2).
inline vecb load_bytes(const int8_t* p) {
  typedef int8_t unaligned __attribute__((vector_size(sizeof(vecb)), aligned(1)));
  return *reinterpret_cast<const unaligned*>(p);
}

inline vecb broadcast4(const int8_t* q) {  // 4 quants of x into every lane
  int32_t word;
  std::memcpy(&word, q, 4);
  return reinterpret_cast<vecb>(veci{} + word);
}

// Column vector v of a 64-byte group of nibbles (panels.h): quants 0..15 as bytes, 4 features a lane.
inline vecb nibbles(const int8_t* group, int v) {
  constexpr int kHalf = kVecs / 2;
  vecw raw;
  std::memcpy(&raw, group + 4 * kLanes * (v % kHalf), sizeof(raw));
  return reinterpret_cast<vecb>((v < kHalf ? raw : raw >> 4) & 0x0F0F0F0Fu);
}

// The high 2 bits of a Q6_K quant, for column vector v of a 32-byte group (column c at bit 2 (c / 8)
// of the bytes of c % 8), shifted into place (<< 4); `shift`: high_shift(v).
inline vecw high_shift(int v) {
  vecw shift;
  for (int l = 0; l < kLanes; ++l) shift[l] = 2 * ((kLanes * v + l) / 8);
  return shift;
}

inline vecw load_high(const int8_t* chunk) {  // a chunk's 32 bytes of high bits in every 32-byte half
#if defined(__AVX512F__)
  return reinterpret_cast<vecw>(_mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk))));
#else
  vecw raw;
  std::memcpy(&raw, chunk, sizeof(raw));
  return raw;
#endif
}

inline vecb high_bits(const int8_t* group, vecw shift) {
  return reinterpret_cast<vecb>(((load_high(group) >> shift) & 0x03030303u) << 4);
}

// The fifth bits of Q5_0 quants for column vector v of a 32-byte chunk (panels.h: column c's at bit
// c / 8, and at bit 4 + c / 8 for the chunk's second group), in place (bit 4 of each byte):
// (raw << (4 - c / 8)) & 0x10 for the first group, (raw >> (c / 8)) & 0x10 for the second.
inline vecw fifth_shift(int v) {
  vecw shift;
  for (int l = 0; l < kLanes; ++l) shift[l] = (kLanes * v + l) / 8;
  return shift;
}

// The fifth bits of a chunk's group `second` (0 or 1) from its 32 bytes `high` (load_high), in place.
inline vecb fifth_bits(vecw high, bool second, vecw shift) {
  return reinterpret_cast<vecb>((second ? high >> shift : high << (4 - shift)) & 0x10101010u);
}

// A tile's float32 outputs and the current sub-block's int32 sums. (Summing a sub-block in 2-4
// interleaved parts, against vpdpbusd's 4-5 cycles of latency, measured no faster at one row.)
template <int kRows, int kV>
struct Accumulators {
  vecf acc[kRows][kV];
  veci sub[kRows][kV];
  Accumulators() {
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < kV; ++j) acc[i][j] = vecf{};
  }
  void clear_sub() {
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < kV; ++j) sub[i][j] = veci{};
  }
  // sub += w (unsigned bytes, or with kSigned signed: Q8_0) . the 4 quants of each row at x[i].q + offset.
  template <bool kSigned = false>
  void dot(const ActRow (&x)[kRows], int64_t offset, const vecb (&w)[kV]) {
    for (int i = 0; i < kRows; ++i) {
      const vecb xb = broadcast4(x[i].q + offset);
      for (int j = 0; j < kV; ++j) sub[i][j] = kSigned ? dot_signed(sub[i][j], w[j], xb) : dot_bytes(sub[i][j], w[j], xb);
    }
  }
};

// pairs[i][j] += the 16-bit pair sums of w[j] with row i's 4 quants at x[i].q + offset.
template <int kRows, int kV>
inline void add_pair_sums(const ActRow (&x)[kRows], int64_t offset, const vecb (&w)[kV], vech (&pairs)[kRows][kV]) {
  for (int i = 0; i < kRows; ++i) {
    const vecb xb = broadcast4(x[i].q + offset);
    for (int j = 0; j < kV; ++j) pairs[i][j] += pair_sums(w[j], xb);
  }
}

// pairs[i][j] = the 16-bit pair sums of row i's products with kGroups consecutive groups
// (weights(g, w): group g's unsigned quants; x at offset + 4 g), summed in 16 bits, where the caller
// bounds them: kGroups * 2 * max(w) * 127 <= 32,767. One vpmaddubsw and one vpaddw a group and
// vector, where dot_bytes takes a vpmaddwd and a vpaddd more.
template <int kGroups, int kRows, int kV, typename Weights>
inline void group_pair_sums(const ActRow (&x)[kRows], int64_t offset, Weights&& weights, vech (&pairs)[kRows][kV]) {
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kV; ++j) pairs[i][j] = vech{};
#pragma GCC unroll 1  // unrolled, GCC hoists every product ahead of the sums and spills them
  for (int g = 0; g < kGroups; ++g) {
    vecb w[kV];
    weights(g, w);
    add_pair_sums(x, offset + kDotGroup * g, w, pairs);
  }
}

// ---- tile kernels (one per dot panel kind; tiles.h walks the product)

// The tile's first column vector in its panel: a constant for whole-panel tiles, so that their
// quants' unpacking (low or high nibbles) is known at compile time.
template <int kV>
inline int first_vec(const Tile& t) { return kV == kVecs ? 0 : t.first_vec; }

template <int kRows, int kV>
void dot_tile_q8_0(const Tile& t) {
  Accumulators<kRows, kV> a;
  ActRow x[kRows];
  for (int i = 0; i < kRows; ++i) x[i] = act_row(t, i);
  const int v0 = first_vec<kV>(t);
  const auto* panel = static_cast<const int8_t*>(t.panel);
  for (int64_t b = 0; b < t.k / weft::kQ8Block; ++b) {
    prefetch_out_line<kRows, kV>(t, b);
    const int8_t* block = panel + b * weft::kQ8DotBlockBytes;
    vecf d[kV];  // read first: the block's bytes in order (panels.h)
    for (int j = 0; j < kV; ++j) d[j] = widen_halves(block + 2 * kLanes * (v0 + j));
    a.clear_sub();
    for (int64_t g = 0; g < weft::kQ8Block / kDotGroup; ++g) {
      const int8_t* group = block + weft::kQ8DotQuantsOffset + kDotGroup * kPanel * g;
      prefetch_weights<kRows>(group + kPrefetchBytes);
      prefetch_weights<kRows>(group + kPrefetchBytes + 64);
      vecb w[kV];
      for (int j = 0; j < kV; ++j) w[j] = load_bytes(group + 4 * kLanes * (v0 + j));
      a.template dot<true>(x, b * weft::kQ8Block + kDotGroup * g, w);
    }
    for (int i = 0; i < kRows; ++i) {
      const int32_t offset = kVnni ? 128 * (x[i].sums[2 * b] + x[i].sums[2 * b + 1]) : 0;
      const float dx = x[i].d[b];
      for (int j = 0; j < kV; ++j) a.acc[i][j] += __builtin_convertvector(a.sub[i][j] - offset, vecf) * (d[j] * dx);
    }
  }
  finish_tile<kRows, kV>(t, a.acc);
}

// What a legacy block's nibbles stand for: unsigned quants (Q4_0, Q5_0, Q4_1, Q5_1), or indices of
// signed levels, IQ4's (kIq4Levels, under a float16 d) or MXFP4's (kMxfp4Levels, under an E8M0
// exponent byte).
enum class Codes { kQuants, kIq4, kMxfp4 };

// Nibbles as the bytes of `table` (16), by vpshufb within each 128-bit lane.
inline vecb looked_up(vecb nibbles, const int8_t* table) {
#if defined(__AVX512BW__)
  const __m512i levels = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table)));
  return reinterpret_cast<vecb>(_mm512_shuffle_epi8(levels, reinterpret_cast<__m512i>(nibbles)));
#elif defined(__AVX2__) && !defined(__AVX512F__)
  const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table)));
  return reinterpret_cast<vecb>(_mm256_shuffle_epi8(levels, reinterpret_cast<__m256i>(nibbles)));
#else
  vecb out;
  for (int b = 0; b < 4 * kLanes; ++b) out[b] = table[nibbles[b] & 0xF];
  return out;
#endif
}

// Signed levels plus `bias`, as the unsigned bytes that vpdpbusd and vpmaddubsw take.
constexpr std::array<int8_t, 16> biased(const int8_t (&levels)[16], int bias) {
  std::array<int8_t, 16> out{};
  for (int i = 0; i < 16; ++i) out[i] = static_cast<int8_t>(static_cast<uint8_t>(levels[i] + bias));
  return out;
}

// kLanes bytes as int32: uint8, or with kSigned int8 (vpmovzxbd, vpmovsxbd).
template <bool kSigned = false>
inline veci widen_bytes(const void* p) {
  using Byte = std::conditional_t<kSigned, int8_t, uint8_t>;
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return reinterpret_cast<veci>(kSigned ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64(static_cast<const __m128i*>(p));
  return reinterpret_cast<veci>(kSigned ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
#else
  veci v;
  for (int l = 0; l < kLanes; ++l) v[l] = static_cast<const Byte*>(p)[l];
  return v;
#endif
}

// kLanes E8M0 exponents e as the floats 2^(e - 128) (llama.cpp's GGML_E8M0_TO_FP32_HALF: MXFP4's
// doubled levels halved back), exactly: e = 0 and 1 are float32's subnormals 2^-128 and 2^-127.
inline vecf e8m0_halves(const void* p) {
  const veci e = widen_bytes(p);
  const veci normal = (e - 1) << 23, subnormal = (veci{} + 0x00200000) << e;
  return reinterpret_cast<vecf>(e < 2 ? subnormal : normal);
}

// A legacy dot block's layout (panels.h) and arithmetic: its bytes, its scales, where group g's
// nibbles are, and what they are multiplied as. Quants are unsigned, and so are levels with a bias
// (the caller takes bias * sum(x8) off): MXFP4's + 12 (0..24), IQ4's + 128 with VNNI; without VNNI
// IQ4's stay signed (dot_signed). Without VNNI unsigned bytes' pair sums add up in 16 bits over 8
// groups (4 bits: at most 8 * 2 * 15 * 127 = 30,480) or over 4 (5 bits: 4 * 2 * 31 * 127 = 31,496;
// MXFP4: 4 * 2 * 24 * 127 = 24,384) before one vpmaddwd widens them.
template <bool kHigh, bool kMin, Codes kCodes>
struct LegacyLayout {
  static constexpr bool kMx = kCodes == Codes::kMxfp4;
  static constexpr bool kSigned = kCodes == Codes::kIq4 && !kVnni;
  static constexpr int32_t kBias = kMx ? 12 : kCodes == Codes::kIq4 ? (kVnni ? 128 : 0) : kMin ? 0 : kHigh ? 16 : 8;
  static constexpr std::array<int8_t, 16> kTable = kMx ? biased(weft::kMxfp4Levels, 12)
                                                   : biased(weft::kIq4Levels, kVnni ? 128 : 0);
  static constexpr int kChunks = weft::kQ8Block / (2 * kDotGroup);
  static constexpr int kRun = kHigh || kMx ? 2 : kChunks;  // chunks whose pair sums add up in 16 bits
  static constexpr bool kPairs = !kVnni && !kSigned;
  static constexpr int64_t kBlockBytes = kMx ? weft::kMxfp4DotBlockBytes : weft::legacy_dot_block_bytes(kHigh, kMin);
  static constexpr int64_t nibbles(int64_t g) {
    return kMx ? weft::mxfp4_dot_nibbles(g) : weft::legacy_dot_nibbles(kHigh, kMin, g);
  }
  static vecf scale(const int8_t* block, int v) {  // column vector v's d (MXFP4: 2^(e - 128))
    return kMx ? e8m0_halves(block + kLanes * v) : widen_halves(block + 2 * kLanes * v);
  }
  static vecb levels(vecb w) {
    if constexpr (kCodes == Codes::kQuants) return w;
    return looked_up(w, kTable.data());
  }
};

// The legacy types, Q4_0 and Q5_0 (kHigh) and with kMin Q4_1 and Q5_1, and the levels of IQ4_NL,
// IQ4_XS and MXFP4 (LegacyLayout): a block's sum(q * x8) of its unsigned quants (0..15, or 0..31)
// in int32, scaled by d * d_x, less 8 or 16 times x8's block sum (in int32), or plus m * s (Q4_1,
// Q5_1: s the activations' float16 d_x * sum(x8), llama.cpp's q8_1 `s`, `block_s`).
template <int kRows, int kV, bool kHigh, bool kMin, Codes kCodes = Codes::kQuants>
void dot_tile_legacy(const Tile& t) {
  using Layout = LegacyLayout<kHigh, kMin, kCodes>;
  Accumulators<kRows, kV> a;
  ActRow x[kRows];
  for (int i = 0; i < kRows; ++i) x[i] = act_row(t, i);
  const int v0 = first_vec<kV>(t);
  const auto* panel = static_cast<const int8_t*>(t.panel);
  constexpr int64_t kBlockBytes = Layout::kBlockBytes;
  constexpr int kChunks = Layout::kChunks, kRun = Layout::kRun;
  constexpr int32_t kBias = Layout::kBias;
  constexpr bool kPairs = Layout::kPairs;
  vecw shift[kV];
  for (int j = 0; j < kV; ++j) shift[j] = fifth_shift(v0 + j);
  for (int64_t b = 0; b < t.k / weft::kQ8Block; ++b) {
    prefetch_out_line<kRows, kV>(t, b);
    const int8_t* block = panel + b * kBlockBytes;
    for (int64_t line = 0; line < kBlockBytes; line += 64)  // into L1: measured faster than into L2 here,
      __builtin_prefetch(block + kPrefetchBytes + line);     // where a block's lines come in one burst
    vecf d[kV], m[kV];
    for (int j = 0; j < kV; ++j) {
      d[j] = Layout::scale(block, v0 + j);
      if constexpr (kMin) m[j] = widen_halves(block + 2 * kPanel + 2 * kLanes * (v0 + j));
    }
    a.clear_sub();
    for (int run = 0; run < kChunks / kRun; ++run) {
      vech pairs[kRows][kV] = {};
#pragma GCC unroll 1  // unrolled, GCC hoists every product ahead of the sums and spills them
      for (int h = kRun * run; h < kRun * (run + 1); ++h) {
        vecw high{};
        if constexpr (kHigh) high = load_high(block + weft::legacy_dot_chunk(kHigh, kMin, h));
        for (int g = 0; g < 2; ++g) {  // the chunk's two groups
          vecb w[kV];
          for (int j = 0; j < kV; ++j) {
            w[j] = nibbles(block + Layout::nibbles(2 * h + g), v0 + j);
            if constexpr (kHigh) w[j] |= fifth_bits(high, g == 1, shift[j]);
            w[j] = Layout::levels(w[j]);
          }
          const int64_t offset = b * weft::kQ8Block + kDotGroup * (2 * h + g);
          if constexpr (kPairs) {
            add_pair_sums(x, offset, w, pairs);
          } else {
            a.template dot<Layout::kSigned>(x, offset, w);
          }
        }
      }
      if constexpr (kPairs) {
        for (int i = 0; i < kRows; ++i)
          for (int j = 0; j < kV; ++j) a.sub[i][j] += widen_pairs(pairs[i][j]);
      }
    }
    for (int i = 0; i < kRows; ++i) {
      const float dx = x[i].d[b];
      if constexpr (kMin) {
        const float s = block_s(x[i].sums, b);
        for (int j = 0; j < kV; ++j) a.acc[i][j] += __builtin_convertvector(a.sub[i][j], vecf) * (d[j] * dx) + m[j] * s;
      } else {
        const int32_t bias = kBias * (x[i].sums[2 * b] + x[i].sums[2 * b + 1]);
        for (int j = 0; j < kV; ++j) a.acc[i][j] += __builtin_convertvector(a.sub[i][j] - bias, vecf) * (d[j] * dx);
      }
    }
  }
  finish_tile<kRows, kV>(t, a.acc);
}

// Q4_K's dot layout, and with kFifth Q5_K's (panels.h): where a sub-block's scales, mins and groups
// of nibbles are, and column vector v of group g's quants (0..15, or 0..31 with the fifth bits of
// its chunk, `high`, shifted by fifth_shift(v) as Q5_0's).
template <bool kFifth>
struct Q4KLayout {
  static constexpr int64_t kBlockBytes = kFifth ? weft::kQ5KDotBlockBytes : weft::kQ4KDotBlockBytes;
  static constexpr int64_t sub_block(int64_t s) { return kFifth ? weft::q5k_dot_sub_block(s) : weft::q4k_dot_sub_block(s); }
  static constexpr int64_t nibbles(int64_t g) { return kFifth ? weft::q5k_dot_nibbles(g) : 2 * kPanel + 64 * g; }
  static vecb quants(const int8_t* sub, int64_t g, int v, vecw shift) {
    vecb w = ::nibbles(sub + nibbles(g), v);
    if constexpr (kFifth) {
      const vecw high = load_high(sub + weft::q5k_dot_fifth(g));
      w |= fifth_bits(high, g % 2 == 1, shift);
    }
    return w;
  }
};

// Each lane's two 16-bit halves: lo and hi (int16 values) as one 32-bit word, for madd_pairs.
inline vech halves(veci lo, veci hi) { return reinterpret_cast<vech>((lo & 0xFFFF) | (hi << 16)); }

// The activations' sum of quants over block b of 32 (|sum| <= 4,064).
inline int32_t block_sum(const ActRow& x, int64_t b) { return x.sums[2 * b] + x.sums[2 * b + 1]; }

// sum over kSubBlocks sub-blocks s of c_s * sum_s in int32, c_s = coefficients(s) (each column's
// scale or min, int32 lanes) and sum_s = sums(s) (the row's sum of quants over the sub-block): one
// vpmaddwd per pair of sub-blocks, each value in 16 bits.
template <int64_t kSubBlocks, typename Coefficients, typename Sums>
inline veci sub_block_dot(Coefficients&& coefficients, Sums&& sums) {
  veci total{};
  for (int64_t s = 0; s < kSubBlocks; s += 2) {
    total += madd_pairs(halves(coefficients(s), coefficients(s + 1)), halves(veci{} + sums(s), veci{} + sums(s + 1)));
  }
  return total;
}

// sum over a super-block's 8 sub-blocks s of m_s * xsum_s (each column's 6-bit mins m, the row's
// sums of quants from activation block xb on).
template <typename Layout>
inline veci mins_dot(const int8_t* block, int64_t column, const ActRow& x, int64_t xb) {
  return sub_block_dot<weft::kQ4KSubBlocks>(
      [&](int64_t s) { return widen_bytes(block + Layout::sub_block(s) + kPanel + column); },
      [&](int64_t s) { return block_sum(x, xb + s); });
}

// Q4_K and Q5_K with vpdpbusd, in llama.cpp's arithmetic: each sub-block's int32 sums times its
// 6-bit scale (vpmulld), added up over the super-block in int32 (at most 8 * 63 * 32 * 31 * 127 <
// 2^26), and the mins times the activations' sums likewise (`mins_dot`), so that a super-block
// meets float32 once, not once per sub-block. (Scaled in float32 per sub-block, the 1B shape's
// gate|up at 128 rows ran at 517 GFLOP/s in Q5_K and 571-575 in Q4_K on a Zen 4; so, 567-577 and
// 592-601: docs/benchmarks.md.)
template <int kRows, int kV, bool kFifth>
void dot_tile_q4_k_vnni(const Tile& t) {
  using Layout = Q4KLayout<kFifth>;
  Accumulators<kRows, kV> a;
  ActRow x[kRows];
  for (int i = 0; i < kRows; ++i) x[i] = act_row(t, i);
  const int v0 = first_vec<kV>(t);
  const auto* panel = static_cast<const int8_t*>(t.panel);
  constexpr int64_t kSub = weft::kQ4KBlock / weft::kQ4KSubBlocks;  // 32: one activation block
  vecw shift[kV];
  for (int j = 0; j < kV; ++j) shift[j] = fifth_shift(v0 + j);
  for (int64_t sb = 0; sb < t.k / weft::kQ4KBlock; ++sb) {
    const int8_t* block = panel + sb * Layout::kBlockBytes;
    veci scaled[kRows][kV] = {};
    for (int64_t s = 0; s < weft::kQ4KSubBlocks; ++s) {
      prefetch_out_line<kRows, kV>(t, sb * weft::kQ4KSubBlocks + s);
      const int8_t* sub = block + Layout::sub_block(s);  // scales, mins, then quants
      a.clear_sub();
      for (int64_t g = 0; g < kSub / kDotGroup; ++g) {
        prefetch_weights<kRows>(sub + Layout::nibbles(g) + kPrefetchBytes);
        vecb w[kV];
        for (int j = 0; j < kV; ++j) w[j] = Layout::quants(sub, g, v0 + j, shift[j]);
        a.dot(x, sb * weft::kQ4KBlock + s * kSub + kDotGroup * g, w);
      }
      for (int j = 0; j < kV; ++j) {
        const veci scale = widen_bytes(sub + kLanes * (v0 + j));
        for (int i = 0; i < kRows; ++i) scaled[i][j] += a.sub[i][j] * scale;
      }
    }
    const int64_t xb = sb * (weft::kQ4KBlock / kActBlock);  // the super-block's first activation block
    for (int j = 0; j < kV; ++j) {
      const vecf d = widen_halves(block + 2 * kLanes * (v0 + j));
      const vecf dmin = widen_halves(block + 2 * kPanel + 2 * kLanes * (v0 + j));
      for (int i = 0; i < kRows; ++i) {
        const float dx = x[i].d[xb];  // one activation scale a super-block
        const veci mins = mins_dot<Layout>(block, kLanes * (v0 + j), x[i], xb);
        a.acc[i][j] += __builtin_convertvector(scaled[i][j], vecf) * (d * dx) - __builtin_convertvector(mins, vecf) * (dmin * dx);
      }
    }
  }
  finish_tile<kRows, kV>(t, a.acc);
}

// kLanes 6-bit values (scales or mins of a sub-block, one per column) as 16-bit multipliers for
// madd_pairs: the value in both halves of its column's lane (`both`), or in the low half only.
inline vech pair_multipliers(const int8_t* p, bool both) {
  veci v;
  for (int l = 0; l < kLanes; ++l) v[l] = static_cast<uint8_t>(p[l]);
  return reinterpret_cast<vech>(both ? v | v << 16 : v);
}

// Q4_K and Q5_K without VNNI (llama.cpp's AVX2 arithmetic): a sub-block's 16-bit pair sums are
// multiplied by its scale in the widening vpmaddwd itself, and its mins by the activations' sums in
// another, so that a super-block is summed in int32 (at most 8 * 2 * 2 * 31,496 * 63 < 2^31) and
// meets float32 once, not once per sub-block. Q4_K's pair sums add up over a sub-block's 8 groups
// (8 * 2 * 15 * 127 = 30,480), Q5_K's over 4 (4 * 2 * 31 * 127 = 31,496), each run widened alone.
template <int kRows, int kV, bool kFifth>
void dot_tile_q4_k_pairs(const Tile& t) {
  using Layout = Q4KLayout<kFifth>;
  vecf acc[kRows][kV] = {};
  ActRow x[kRows];
  for (int i = 0; i < kRows; ++i) x[i] = act_row(t, i);
  const int v0 = first_vec<kV>(t);
  const auto* panel = static_cast<const int8_t*>(t.panel);
  constexpr int64_t kSub = weft::kQ4KBlock / weft::kQ4KSubBlocks;  // 32: one activation block
  constexpr int kGroups = kFifth ? 4 : 8;  // groups whose pair sums add up in 16 bits
  vecw shift[kV];
  for (int j = 0; j < kV; ++j) shift[j] = fifth_shift(v0 + j);
  for (int64_t sb = 0; sb < t.k / weft::kQ4KBlock; ++sb) {
    const int8_t* block = panel + sb * Layout::kBlockBytes;
    veci scaled[kRows][kV] = {}, mins[kRows][kV] = {};
    for (int64_t s = 0; s < weft::kQ4KSubBlocks; ++s) {
      prefetch_out_line<kRows, kV>(t, sb * weft::kQ4KSubBlocks + s);
      const int8_t* sub = block + Layout::sub_block(s);  // scales, mins, then quants
      vech scale[kV];
      for (int j = 0; j < kV; ++j) scale[j] = pair_multipliers(sub + kLanes * (v0 + j), true);
      for (int run = 0; run < kSub / kDotGroup / kGroups; ++run) {
        vech pairs[kRows][kV];
        group_pair_sums<kGroups>(x, sb * weft::kQ4KBlock + s * kSub + kDotGroup * kGroups * run, [&](int g, vecb (&w)[kV]) {
          prefetch_weights<kRows>(sub + Layout::nibbles(kGroups * run + g) + kPrefetchBytes);
          for (int j = 0; j < kV; ++j) w[j] = Layout::quants(sub, kGroups * run + g, v0 + j, shift[j]);
        }, pairs);
        for (int j = 0; j < kV; ++j)
          for (int i = 0; i < kRows; ++i) scaled[i][j] += madd_pairs(pairs[i][j], scale[j]);
      }
      const int64_t xb = sb * (weft::kQ4KBlock / kActBlock) + s;  // the activation block
      vech sums[kRows];  // each row's sum of the block's quants, |sum| <= 4,064
      for (int i = 0; i < kRows; ++i) sums[i] = reinterpret_cast<vech>(veci{} + (x[i].sums[2 * xb] + x[i].sums[2 * xb + 1]));
      for (int j = 0; j < kV; ++j) {
        const vech min = pair_multipliers(sub + kPanel + kLanes * (v0 + j), false);
        for (int i = 0; i < kRows; ++i) mins[i][j] += madd_pairs(min, sums[i]);
      }
    }
    const int64_t xb = sb * (weft::kQ4KBlock / kActBlock);  // one activation scale a super-block
    for (int j = 0; j < kV; ++j) {
      const vecf d = widen_halves(block + 2 * kLanes * (v0 + j));
      const vecf dmin = widen_halves(block + 2 * kPanel + 2 * kLanes * (v0 + j));
      for (int i = 0; i < kRows; ++i) {
        const float dx = x[i].d[xb];
        acc[i][j] += __builtin_convertvector(scaled[i][j], vecf) * (d * dx) - __builtin_convertvector(mins[i][j], vecf) * (dmin * dx);
      }
    }
  }
  finish_tile<kRows, kV>(t, acc);
}

template <int kRows, int kV, bool kFifth>
void dot_tile_q4_k(const Tile& t) {
  if constexpr (kVnni) {
    dot_tile_q4_k_vnni<kRows, kV, kFifth>(t);
  } else {
    dot_tile_q4_k_pairs<kRows, kV, kFifth>(t);
  }
}

// The k-quants of sub-blocks of 16 (panels.h), by bits a quant: Q6_K (6: nibbles and a plane of
// high pairs, q' - 32, or with mins any fused k-quant), Q3_K (3: a plane of low pairs and one of
// third bits, q' - 4) and Q2_K (2: a plane of pairs, with its mins).
template <int kBits, bool kMins>
struct SmallKLayout {
  static constexpr bool kThird = kBits == 3;
  static constexpr int32_t kBias = kBits == 6 ? 32 : 4;  // without mins: q' - kBias
  static constexpr int64_t block_bytes() {
    return kBits == 6 ? weft::kQ6KDotBlockBytes(kMins) : weft::low_k_pair(kThird, kMins, weft::kQ6KSubBlocks / 2);
  }
  static constexpr int64_t pair(int64_t p) { return kBits == 6 ? weft::q6k_dot_pair(kMins, p) : weft::low_k_pair(kThird, kMins, p); }
  static constexpr int64_t prefetch_at(int64_t group) {
    return kBits == 6 ? weft::q6k_dot_low(group) : weft::low_k_chunk(kThird) * (group / 2);
  }
  // Column vector v of group `group` of a pair's quants, unsigned (0..63, 0..7 or 0..3); shift:
  // high_shift(v) (2 (c / 8) per lane), third: fifth_shift(v) (c / 8).
  static vecb quants(const int8_t* q, int64_t group, int v, vecw shift, vecw third) {
    if constexpr (kBits == 6) {
      return nibbles(q + weft::q6k_dot_low(group), v) | high_bits(q + weft::q6k_dot_high(group), shift);
    } else {
      const int8_t* chunk = q + weft::low_k_chunk(kThird) * (group / 2);
      vecw w = (load_high(chunk + 32 * (group % 2)) >> shift) & 0x03030303u;
      if constexpr (kThird) w |= ((load_high(chunk + 64) >> (third + static_cast<uint32_t>(4 * (group % 2)))) & 0x01010101u) << 2;
      return reinterpret_cast<vecb>(w);
    }
  }
};

// sum over a super-block's 16 sub-blocks s of c_s * xsum_s: each column's int8 scales (`offset` 0
// in a pair) or mins (2 * kPanel), times the row's sums of 16 quants from xs on.
template <typename Layout>
inline veci pair_dot(const int8_t* block, int64_t offset, int64_t column, const ActRow& x, int64_t xs) {
  return sub_block_dot<weft::kQ6KSubBlocks>(
      [&](int64_t s) { return widen_bytes<true>(block + Layout::pair(s / 2) + offset + (s % 2) * kPanel + column); },
      [&](int64_t s) { return x.sums[xs + s]; });
}

// a.sub = sub-block s of super-block sb (of a small k-quant; `quants` its pair's) times the
// activations, in int32 (shift and third: high_shift and fifth_shift of each column vector).
template <typename Layout, int kRows, int kV>
inline void sub_block_sums(Accumulators<kRows, kV>& a, const ActRow (&x)[kRows], const int8_t* quants, int64_t sb,
                           int64_t s, int v0, const vecw (&shift)[kV], const vecw (&third)[kV]) {
  constexpr int64_t kSub = weft::kQ6KSubBlock, kGroups = kSub / kDotGroup;
  a.clear_sub();
  for (int64_t g = 0; g < kGroups; ++g) {
    const int64_t group = (s % 2) * kGroups + g;  // of the pair
    prefetch_weights<kRows>(quants + Layout::prefetch_at(group) + kPrefetchBytes);
    vecb w[kV];
    for (int j = 0; j < kV; ++j) w[j] = Layout::quants(quants, group, v0 + j, shift[j], third[j]);
    a.dot(x, sb * weft::kQ6KBlock + s * kSub + kDotGroup * g, w);
  }
}

// The k-quants of sub-blocks of 16 with AVX-512's 32 registers, in llama.cpp's arithmetic: each
// sub-block's int32 sums times its int8 scale (vpmulld), added up over the super-block in int32 (at
// most 16 * 128 * 16 * 63 * 127 < 2^28), the bias or the mins through the activations' sums
// (`pair_dot`): a super-block meets float32 once. (Scaled in float32 per sub-block, as with 8-lane
// vectors below, the 1B shape's Q6_K down at 128 rows ran at 383-392 GFLOP/s on a Zen 4; so,
// 396-412.)
template <int kRows, int kV, int kBits, bool kMins>
void dot_tile_small_k_int(const Tile& t) {
  using Layout = SmallKLayout<kBits, kMins>;
  Accumulators<kRows, kV> a;
  ActRow x[kRows];
  for (int i = 0; i < kRows; ++i) x[i] = act_row(t, i);
  const int v0 = first_vec<kV>(t);
  const auto* panel = static_cast<const int8_t*>(t.panel);
  vecw shift[kV], third[kV];
  for (int j = 0; j < kV; ++j) {
    shift[j] = high_shift(v0 + j);
    third[j] = fifth_shift(v0 + j);
  }
  for (int64_t sb = 0; sb < t.k / weft::kQ6KBlock; ++sb) {
    const int8_t* block = panel + sb * Layout::block_bytes();
    veci scaled[kRows][kV] = {};
    for (int64_t s = 0; s < weft::kQ6KSubBlocks; ++s) {
      prefetch_out_line<kRows, kV>(t, sb * weft::kQ6KSubBlocks + s);
      const int8_t* pair = block + Layout::pair(s / 2);  // scales (mins), then quants
      const int8_t* quants = pair + weft::q6k_dot_pair_scales(kMins);
      sub_block_sums<Layout>(a, x, quants, sb, s, v0, shift, third);
      for (int j = 0; j < kV; ++j) {
        const veci scale = widen_bytes<true>(pair + (s % 2) * kPanel + kLanes * (v0 + j));
        for (int i = 0; i < kRows; ++i) scaled[i][j] += a.sub[i][j] * scale;
      }
    }
    const int64_t xb = sb * weft::kQ6KBlock / kActBlock, xs = sb * weft::kQ6KBlock / kSumGroup;
    for (int j = 0; j < kV; ++j) {
      const int64_t column = kLanes * (v0 + j);
      const vecf d = widen_halves(block + 2 * column);
      for (int i = 0; i < kRows; ++i) {
        const float dx = x[i].d[xb];  // one activation scale a super-block
        if constexpr (kMins) {
          const vecf dmin = widen_halves(block + 2 * kPanel + 2 * column);
          const veci mins = pair_dot<Layout>(block, 2 * kPanel, column, x[i], xs);
          a.acc[i][j] += __builtin_convertvector(scaled[i][j], vecf) * (d * dx) - __builtin_convertvector(mins, vecf) * (dmin * dx);
        } else {  // q' - 32 or q' - 4: the bias comes off in int32
          const veci bias = pair_dot<Layout>(block, 0, column, x[i], xs) * Layout::kBias;
          a.acc[i][j] += __builtin_convertvector(scaled[i][j] - bias, vecf) * (d * dx);
        }
      }
    }
  }
  finish_tile<kRows, kV>(t, a.acc);
}

// The same with 8-lane vectors (16 registers, no room for the int32 super-block sums): each
// sub-block's sums scaled in float32.
template <int kRows, int kV, int kBits, bool kMins>
void dot_tile_small_k_float(const Tile& t) {
  using Layout = SmallKLayout<kBits, kMins>;
  Accumulators<kRows, kV> a;
  ActRow x[kRows];
  for (int i = 0; i < kRows; ++i) x[i] = act_row(t, i);
  const int v0 = first_vec<kV>(t);
  const auto* panel = static_cast<const int8_t*>(t.panel);
  constexpr int64_t kSub = weft::kQ6KSubBlock;
  for (int64_t sb = 0; sb < t.k / weft::kQ6KBlock; ++sb) {
    const int8_t* block = panel + sb * Layout::block_bytes();
    vecf d[kV], dmin[kV];
    vecw shift[kV], third[kV];
    for (int j = 0; j < kV; ++j) {
      shift[j] = high_shift(v0 + j);
      third[j] = fifth_shift(v0 + j);
      d[j] = widen_halves(block + 2 * kLanes * (v0 + j));
      dmin[j] = kMins ? widen_halves(block + 2 * kPanel + 2 * kLanes * (v0 + j)) : vecf{};
    }
    for (int64_t s = 0; s < weft::kQ6KSubBlocks; ++s) {
      prefetch_out_line<kRows, kV>(t, sb * weft::kQ6KSubBlocks + s);
      const int8_t* pair = block + Layout::pair(s / 2);  // scales (mins), then quants
      const int8_t* quants = pair + weft::q6k_dot_pair_scales(kMins);
      vecf scale[kV], min[kV];
      for (int j = 0; j < kV; ++j) {
        const int64_t col = (s % 2) * kPanel + kLanes * (v0 + j);
        scale[j] = d[j] * widen_int8(pair + col);
        min[j] = kMins ? dmin[j] * widen_int8(pair + 2 * kPanel + col) : vecf{};
      }
      sub_block_sums<Layout>(a, x, quants, sb, s, v0, shift, third);
      const int64_t xb = (sb * weft::kQ6KBlock + s * kSub) / kActBlock, xs = (sb * weft::kQ6KBlock + s * kSub) / kSumGroup;
      for (int i = 0; i < kRows; ++i) {
        const float dx = x[i].d[xb];
        const int32_t sum = x[i].sums[xs];
        for (int j = 0; j < kV; ++j) {
          if constexpr (kMins) {
            a.acc[i][j] += __builtin_convertvector(a.sub[i][j], vecf) * (scale[j] * dx) - min[j] * (dx * static_cast<float>(sum));
          } else {  // q' - 32 or q' - 4: the bias comes off in int32
            a.acc[i][j] += __builtin_convertvector(a.sub[i][j] - Layout::kBias * sum, vecf) * (scale[j] * dx);
          }
        }
      }
    }
  }
  finish_tile<kRows, kV>(t, a.acc);
}

template <int kRows, int kV, int kBits, bool kMins>
void dot_tile_small_k(const Tile& t) {
  if constexpr (kLanes == 16) {
    dot_tile_small_k_int<kRows, kV, kBits, kMins>(t);
  } else {
    dot_tile_small_k_float<kRows, kV, kBits, kMins>(t);
  }
}

// Tiles with AVX-512: up to 6 rows x 32 columns (6 x 2 float and 6 x 2 int32 accumulators of the
// 32 registers). With 8-lane vectors (16 registers), measured on a Zen 3 at 8-512 rows: Q8_0 one row
// x 32 columns or half panels of 2 rows (its 2 x 4 whole tiles spill and run at half the speed);
// the k-quants whole panels of up to 3 rows, where their quants are unpacked once for 3 rows (Q6_K
// 1.3-1.5x the half panels of 2 rows; 4 rows spill).
struct Q8DotTiles {
  static constexpr int kMaxRows = kLanes == 16 ? 6 : 1;
  static constexpr int kHalfRows = kLanes == 16 ? 0 : 2;
  static constexpr ActBlocks kActivations = ActBlocks::kQ8_0;
  template <int kRows, int kV> static void run(const Tile& t) { dot_tile_q8_0<kRows, kV>(t); }
};
// The legacy types: with 16 registers whole panels of up to 3 rows (a group's nibbles unpacked once
// for 3 rows), half panels of 4 from 4 rows (Q4_0, Q5_0: 1.0-1.1x the whole ones at 8-256 rows on a
// Zen 3).
template <bool kHigh, bool kMin>
struct LegacyDotTiles {
  static constexpr int kMaxRows = kLanes == 16 ? 6 : 3;
  static constexpr int kHalfRows = kLanes == 16 ? 0 : 4;
  static constexpr ActBlocks kActivations = kMin ? ActBlocks::kQ8_1 : ActBlocks::kQ8_0;
  template <int kRows, int kV> static void run(const Tile& t) { dot_tile_legacy<kRows, kV, kHigh, kMin>(t); }
};
// IQ4_NL and IQ4_XS: the legacy tiles with their nibbles looked up, with Q8_0 or k-quant activations;
// MXFP4 likewise, under its exponents, with Q8_0 activations.
template <ActBlocks kBlocks, Codes kCodes = Codes::kIq4>
struct LevelDotTiles : LegacyDotTiles<false, false> {
  static constexpr ActBlocks kActivations = kBlocks;
  template <int kRows, int kV> static void run(const Tile& t) { dot_tile_legacy<kRows, kV, false, false, kCodes>(t); }
};
struct KQuantTiles {
  static constexpr int kMaxRows = kLanes == 16 ? 6 : 3;
  static constexpr int kHalfRows = 0;
  static constexpr ActBlocks kActivations = ActBlocks::kQ8_K;
};
template <bool kFifth>  // Q5_K
struct Q4KDotTiles : KQuantTiles {
  template <int kRows, int kV> static void run(const Tile& t) { dot_tile_q4_k<kRows, kV, kFifth>(t); }
};
template <int kBits, bool kMins>
struct SmallKDotTiles : KQuantTiles {
  template <int kRows, int kV> static void run(const Tile& t) { dot_tile_small_k<kRows, kV, kBits, kMins>(t); }
};

template <typename Tiles>
void run_dot(const at::Tensor& x, const at::Tensor& panels, const float* bias, at::Tensor& out) {
  const at::Tensor xq = quantize_activations<Tiles::kActivations>(x);
  const int64_t row_bytes = xq.size(1), rows = weft::tiles::tiling<Tiles>(x.size(0)).rows;
  weft::tiles::run_tiles<Tiles>(x, panels.data_ptr(), panels.size(0), panels.stride(0), bias, out,
                                static_cast<const uint8_t*>(xq.data_ptr()), rows * row_bytes, row_bytes, row_bytes);
}

// out[e] = x[e] @ W_e.T for one row per matrix (a layer's routed experts at batch 1), each W_e of
// `panels` (one shape, one kind): one quantization of the rows and one parallel region over every
// panel of every matrix, where a call per matrix is a region each, its threads' streams ramping up
// anew for a matrix of a megabyte or two.
template <typename Tiles>
void run_dot_rows(const at::Tensor& x, at::TensorList panels, at::Tensor& out) {
  const at::Tensor xq = quantize_activations<Tiles::kActivations>(x);  // [E, row bytes]
  const int64_t row_bytes = xq.size(1), k = x.size(1), n = out.size(1);
  const int64_t per = panels[0].size(0), panel_bytes = panels[0].stride(0);
  const weft::tiles::TileFn kernel = weft::tiles::kWholeTiles<Tiles>[1];
  const float* xp = x.data_ptr<float>();
  const auto* xqp = static_cast<const uint8_t*>(xq.data_ptr());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(panels.size()) * per, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = i / per, col = (i % per) * kPanel;
      const auto* wp = static_cast<const uint8_t*>(panels[e].data_ptr()) + (i % per) * panel_bytes;
      const Tile tile{xp + e * x.stride(0), x.stride(0), xqp + e * row_bytes, row_bytes, wp, k, op + e * n + col, n,
                      std::min<int64_t>(kPanel, n - col), nullptr, 0};
      kernel(tile);
    }
  });
}

// fn(Tiles{}) for the tiles of dot panel blocks of `block_bytes` bytes (panels.h).
template <typename Fn>
void with_dot_tiles(int64_t block_bytes, Fn&& fn) {
  switch (block_bytes) {
    case weft::kQ8DotBlockBytes: fn(Q8DotTiles{}); break;
    case weft::kIq4NlDotBlockBytes: fn(LevelDotTiles<ActBlocks::kQ8_0>{}); break;
    case weft::kIq4XsDotBlockBytes: fn(LevelDotTiles<ActBlocks::kQ8_K>{}); break;
    case weft::kMxfp4DotBlockBytes: fn(LevelDotTiles<ActBlocks::kQ8_0, Codes::kMxfp4>{}); break;
    case weft::kQ4_0DotBlockBytes: fn(LegacyDotTiles<false, false>{}); break;
    case weft::kQ5_0DotBlockBytes: fn(LegacyDotTiles<true, false>{}); break;
    case weft::kQ4_1DotBlockBytes: fn(LegacyDotTiles<false, true>{}); break;
    case weft::kQ5_1DotBlockBytes: fn(LegacyDotTiles<true, true>{}); break;
    case weft::kQ4KDotBlockBytes: fn(Q4KDotTiles<false>{}); break;
    case weft::kQ5KDotBlockBytes: fn(Q4KDotTiles<true>{}); break;
    case weft::kQ3KDotBlockBytes: fn(SmallKDotTiles<3, false>{}); break;
    case weft::kQ2KDotBlockBytes: fn(SmallKDotTiles<2, true>{}); break;
    case weft::kQ6KDotBlockBytes(false): fn(SmallKDotTiles<6, false>{}); break;
    default: fn(SmallKDotTiles<6, true>{}); break;
  }
}

}  // namespace

namespace weft {

at::Tensor quantize_q8k_rows(const at::Tensor& x) { return quantize_activations<ActBlocks::kQ8_K>(x); }

void dot_linear_rows(const at::Tensor& x, at::TensorList panels, at::Tensor& out) {
  with_dot_tiles(panels[0].size(2), [&](auto tiles) { run_dot_rows<decltype(tiles)>(x, panels, out); });
}

bool is_dot_panels(const at::Tensor& panels, int64_t k) {
  if (panels.scalar_type() != at::kChar || panels.dim() != 3 || !panels.is_contiguous()) return false;
  const int64_t block = dot_block_features(panels.size(2));
  return block > 0 && k % block == 0 && panels.size(1) == k / block;
}

void dot_linear(const at::Tensor& x, const at::Tensor& panels, const float* bias, at::Tensor& out) {
  with_dot_tiles(panels.size(2), [&](auto tiles) { run_dot<decltype(tiles)>(x, panels, bias, out); });
}

}  // namespace weft
