// weft's matrix multiply for the linear layers on CPU: y = x @ W.T + b with W stored once, at load
// time, as column panels ("pack_linear_weight"), so that every step streams each weight exactly
// once, front to back, whatever the number of rows. x, y and the bias are float32; W is float32,
// bfloat16 or float16, and half-precision weights are widened to float32 in registers as they
// stream in (float32 accumulation), so a half-precision model reads half the bytes per step.
//
// Layout: W [N, K] becomes P = ceil(N / 32) panels of [K, 32] (the last one zero-padded), one
// contiguous block each: a panel row is 128 bytes in float32, one 64-byte cache line in half
// precision. A tile of up to 12 rows of x (AVX-512; 3 with AVX2's sixteen 8-float registers) times
// one panel keeps its outputs in vector registers while it walks down the panel, one panel row per
// step of k. Threads take contiguous
// runs of panels; inside a thread the panel stays in L2 for the next tile of rows. A software
// prefetch 2 KB ahead keeps enough of the stream in flight: without it the decode-sized products
// (2-32 rows) reached only 60-75% of the bandwidth of a single row (see docs/benchmarks.md).
//
// Widening: a bfloat16 is the top half of a float32. A bfloat16 panel stores its rows in pairs:
// the 32-bit word of column c for rows 2i and 2i + 1 holds row 2i in its low half, so one 64-byte
// load gives 16 columns of row 2i as `word << 16` and of row 2i + 1 as `word & 0xffff0000`: two
// integer operations per 32 weights, shared by every row of the tile, and the sum still runs over
// k in order (a bfloat16 load computes exactly what a float32 load of the same weights does).
// float16 rows keep the natural order and widen with vcvtph2ps (F16C), or one value at a time on
// machines without it. Written with GCC vector extensions of the machine's own vector width
// (kLanes), so it compiles to AVX-512 or AVX2.
//
// bfloat16 products (`bf16_dot`, the caller's choice per call): the same pair layout feeds
// vdpbf16ps directly, two products per lane per instruction, with x rounded to bfloat16 once per
// call (as llama.cpp, oneDNN and every GPU do): twice the arithmetic rate where a step is
// compute-bound (prefill, large batches). Builds for CPUs without AVX512_BF16 compute the same
// arithmetic with two multiply-adds per pair (slower than widening: for tests, and for a user who
// asks for it), so every build takes both paths.
//
// Q8_0 (GGUF's 8-bit type): blocks of 32 input features, each a float16 scale d and 32 int8 quants q,
// the weight being d * q (exact in float32). A Q8_0 panel holds, per block, the scales of its 32
// columns (64 bytes) and then the quants [32 features][32 columns] (1,024 bytes): 8.5 bits per
// weight, as in the file. The tile kernel widens a row of quants to float32 (vpmovsxbd, vcvtdq2ps)
// and multiplies it by the block's scales, which gives the dequantized weights exactly, and then
// accumulates as the float panels do: the float32 product of the dequantized matrix, in the same
// order as a float32 panel of it computes, at 8.5 bits read per weight. Q4_K and Q6_K panels work the
// same way. These exact panels are matmul_precision="float32"'s; by default quantized weights are
// int8 dot panels (int8 tensors), multiplied by int8 activations in qdot.cpp, which packed_linear
// calls for them.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "panels.h"
#include "tiles.h"
#include "vmath.h"

namespace {

using weft::kPanel;  // columns per panel
using weft::kQ8Block;
using weft::kQ8BlockBytes;
using weft::tiles::finish_tile;
using weft::tiles::kLanes;
using weft::tiles::kPrefetchBytes;
using weft::tiles::kVecs;
using weft::tiles::prefetch_out_line;
using weft::tiles::prefetch_weights;
using weft::tiles::Tile;
using weft::tiles::vecf;
using weft::tiles::vecfu;
using weft::tiles::widen_halves;
using weft::tiles::widen_int8;
using weft::tiles::widen_uint8;
using weft::tiles::bfloat16_bits;
using weft::tiles::pair_word;
using weft::tiles::dot_pairs;
using weft::tiles::wordsv;

#if defined(__AVX512F__)
constexpr int kMaxTileRows = 12;  // rows per tile: 12 x 2 accumulators + 2 panel vectors (of 32)
#else
constexpr int kMaxTileRows = 3;   // 3 x 4 accumulators + a panel vector + broadcasts (of 16)
#endif


// One panel row of each weight type, widened to kVecs vectors of kLanes float32 columns.
// Row k of a panel (its base `panel`), widened to float32 columns 0-15 and 16-31; and a prefetch
// kPrefetchBytes ahead of it (past the panel's end: the thread's next panel).
struct Float32Row {
  using Storage = float;
  static constexpr bool kPaired = false;
  template <int kV>  // vectors first_vec .. first_vec + kV - 1 of the row
  static void load(const float* panel, int64_t k, int first_vec, vecf w[kV]) {
    const float* row = panel + k * kPanel + kLanes * first_vec;
    for (int j = 0; j < kV; ++j) w[j] = *reinterpret_cast<const vecf*>(row + kLanes * j);
  }
  template <int kRows>
  static void prefetch(const float* panel, int64_t k) {
    const char* ahead = reinterpret_cast<const char*>(panel + k * kPanel) + kPrefetchBytes;
    prefetch_weights<kRows>(ahead);
    prefetch_weights<kRows>(ahead + 64);
  }
};

// bfloat16 panels: rows in pairs (see the top); one pair of rows of 32 columns is 128 bytes.
constexpr int64_t kPairElems = 2 * kPanel;

struct BFloat16Row {  // rows in pairs: row k is the low (even k) or high (odd k) half of each word
  using Storage = uint16_t;
  static constexpr bool kPaired = true;
  template <int kHalf, int kV>  // k % 2, known at compile time: one shift or one mask per vector
  static void load(const uint16_t* panel, int64_t k, int first_vec, vecf w[kV]) {
    const wordsv* pair = reinterpret_cast<const wordsv*>(panel + (k / 2) * kPairElems) + first_vec;
    for (int j = 0; j < kV; ++j)
      w[j] = reinterpret_cast<vecf>(kHalf == 0 ? pair[j] << 16 : pair[j] & 0xffff0000u);
  }
  template <int kRows>
  static void prefetch(const uint16_t* panel, int64_t k) {  // the pair's two lines
    const char* ahead = reinterpret_cast<const char*>(panel + (k / 2) * kPairElems) + kPrefetchBytes;
    prefetch_weights<kRows>(ahead);
    prefetch_weights<kRows>(ahead + 64);
  }
};

struct Float16Row {  // natural column order
  using Storage = uint16_t;
  static constexpr bool kPaired = false;
  template <int kRows>
  static void prefetch(const uint16_t* panel, int64_t k) {
    prefetch_weights<kRows>(reinterpret_cast<const char*>(panel + k * kPanel) + kPrefetchBytes);
  }
  template <int kV>
  static void load(const uint16_t* panel, int64_t k, int first_vec, vecf w[kV]) {
    const uint16_t* row = panel + k * kPanel + kLanes * first_vec;
    for (int j = 0; j < kV; ++j) w[j] = widen_halves(row + kLanes * j);
  }
};

// out[i, :cols] = x[i, :] @ panel (+ bias) for the tile's kRows rows.
// acc[i] += x[i, k] * w for the tile's rows (w: row k of the panel, widened).
template <int kRows, int kV>
__attribute__((always_inline)) inline void add_row(vecf (&acc)[kRows][kV], const Tile& t, int64_t k,
                                                   const vecf (&w)[kV]) {
  prefetch_out_line<kRows, kV>(t, k);
  for (int i = 0; i < kRows; ++i) {
    const float xv = t.x[i * t.x_stride + k];
    for (int j = 0; j < kV; ++j) acc[i][j] += xv * w[j];
  }
}

// kRows rows times kV column vectors of the panel (all kVecs, or a half: see run_panels).
template <int kRows, int kV, typename Row>
void tile_kernel(const Tile& t) {
  using Storage = typename Row::Storage;
  vecf acc[kRows][kV];
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kV; ++j) acc[i][j] = vecf{};
  const Storage* panel = static_cast<const Storage*>(t.panel);
  vecf w[kV];
  if constexpr (Row::kPaired) {  // two rows per step, the sum still over k in order
    int64_t k = 0;
    for (; k + 1 < t.k; k += 2) {
      Row::template load<0, kV>(panel, k, t.first_vec, w);
      Row::template prefetch<kRows>(panel, k);
      add_row<kRows, kV>(acc, t, k, w);
      Row::template load<1, kV>(panel, k, t.first_vec, w);
      add_row<kRows, kV>(acc, t, k + 1, w);
    }
    if (k < t.k) {  // an odd K: the last pair's second row is padding
      Row::template load<0, kV>(panel, k, t.first_vec, w);
      add_row<kRows, kV>(acc, t, k, w);
    }
  } else {
    for (int64_t k = 0; k < t.k; ++k) {
      Row::template load<kV>(panel, k, t.first_vec, w);
      Row::template prefetch<kRows>(panel, k);
      add_row<kRows, kV>(acc, t, k, w);
    }
  }
  finish_tile<kRows, kV>(t, acc);
}

// bfloat16 panel, dot products of pairs with x rounded to bfloat16 (`bf16_dot`).
template <int kRows, int kV>
void tile_kernel_bf16_dot(const Tile& t) {
  vecf acc[kRows][kV];
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kV; ++j) acc[i][j] = vecf{};
  const uint16_t* panel = static_cast<const uint16_t*>(t.panel);
  const int64_t pairs = (t.k + 1) / 2;
  const auto* xq = static_cast<const uint32_t*>(t.xq);  // the tile's rows side by side: one pointer, immediate offsets (and with
                              // AVX-512 each broadcast folds into its vdpbf16ps as a {1to16} operand)
  for (int64_t kk = 0; kk < pairs; ++kk, xq += t.xq_stride) {
    const wordsv* pair = reinterpret_cast<const wordsv*>(panel + kk * kPairElems) + t.first_vec;  // of words
    BFloat16Row::prefetch<kRows>(panel, 2 * kk);
    prefetch_out_line<kRows, kV>(t, kk);
    for (int i = 0; i < kRows; ++i) {
      const wordsv xv = wordsv{} + xq[i];  // broadcast
      for (int j = 0; j < kV; ++j) acc[i][j] = dot_pairs(acc[i][j], xv, pair[j]);
    }
  }
  finish_tile<kRows, kV>(t, acc);
}

// silu(gate) * up, lane by lane, as silu_mul computes it (kernels.cpp): the same vmath functions.
inline vecf silu_times(vecf gate, vecf up) {
#if defined(__AVX512F__)
  return reinterpret_cast<vecf>(_mm512_mul_ps(weft::vmath::silu16(reinterpret_cast<__m512>(gate)), reinterpret_cast<__m512>(up)));
#elif defined(__AVX2__) && defined(__FMA__)
  return reinterpret_cast<vecf>(_mm256_mul_ps(weft::vmath::silu8(reinterpret_cast<__m256>(gate)), reinterpret_cast<__m256>(up)));
#else
  vecf out;
  for (int c = 0; c < kLanes; ++c) out[c] = weft::vmath::silu(gate[c]) * up[c];
  return out;
#endif
}

}  // namespace

// What a tile of a fused gate|up projection (`packed_glu_pairs`) needs besides its gate panel: the
// up panel of the same MLP columns, and where its activation goes: the down projection's bfloat16
// pairs ([tiles, I / 2, pair_rows], as bfloat16_pairs lays out x) and the tile's place in them.
struct weft::tiles::GluTile {
  const void* up_panel;
  uint32_t* pairs;
  int64_t pairs_per_row;  // I / 2
  int64_t pair_rows;      // rows per tile of the pairs layout
  int64_t first_row;      // the tile's first row of x
  int64_t first_col;      // its first MLP column
};

namespace {

// The lanes of v rounded to bfloat16 as bfloat16_bits rounds each (to nearest even, NaN as 0x7fc0),
// in pairs: words[c] = lane 2c | lane 2c + 1 << 16.
inline void bfloat16_pair_words(vecf v, uint32_t words[kLanes / 2]) {
  const wordsv u = reinterpret_cast<wordsv>(v);
  const wordsv rounded = v != v ? wordsv{} + 0x7fc0u : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(words), _mm512_cvtepi32_epi16(reinterpret_cast<__m512i>(rounded)));
#else
  for (int c = 0; c < kLanes / 2; ++c) words[c] = rounded[2 * c] | rounded[2 * c + 1] << 16;
#endif
}

// Row `row`'s word of the tile's first MLP column pair in the pairs layout; the next pair's is
// pair_rows words on.
inline uint32_t* glu_words(const weft::tiles::GluTile& glu, int64_t row) {
  return glu.pairs + (row / glu.pair_rows) * glu.pairs_per_row * glu.pair_rows + row % glu.pair_rows +
         (glu.first_col / 2) * glu.pair_rows;
}

// A fused gate|up projection with its activation: vectors first_vec .. + kV of a gate panel and of
// the up panel of the same MLP columns, as tile_kernel_bf16_dot computes each, stored as
// silu(gate) * up rounded to bfloat16 pairs, the down projection's input. As many
// accumulators as a whole-panel tile of 2 * kV vectors, and the same panel bytes per multiply-add.
template <int kRows, int kV>
void tile_kernel_bf16_dot_glu(const Tile& t) {
  vecf gate[kRows][kV], up[kRows][kV];
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kV; ++j) gate[i][j] = up[i][j] = vecf{};
  const auto* gate_panel = static_cast<const uint16_t*>(t.panel);
  const auto* up_panel = static_cast<const uint16_t*>(t.glu->up_panel);
  const int64_t pairs = (t.k + 1) / 2;
  const auto* xq = static_cast<const uint32_t*>(t.xq);
  for (int64_t kk = 0; kk < pairs; ++kk, xq += t.xq_stride) {
    const wordsv* g = reinterpret_cast<const wordsv*>(gate_panel + kk * kPairElems) + t.first_vec;
    const wordsv* u = reinterpret_cast<const wordsv*>(up_panel + kk * kPairElems) + t.first_vec;
    prefetch_weights<kRows>(reinterpret_cast<const char*>(g) + kPrefetchBytes);  // the line of the half it reads
    prefetch_weights<kRows>(reinterpret_cast<const char*>(u) + kPrefetchBytes);
    for (int i = 0; i < kRows; ++i) {
      const wordsv xv = wordsv{} + xq[i];  // broadcast
      for (int j = 0; j < kV; ++j) {
        gate[i][j] = dot_pairs(gate[i][j], xv, g[j]);
        up[i][j] = dot_pairs(up[i][j], xv, u[j]);
      }
    }
  }
  const weft::tiles::GluTile& glu = *t.glu;  // (its output, half as many lines as a float tile's, is not
  for (int i = 0; i < kRows; ++i) {           // prefetched: that measured no faster)
    uint32_t* words = glu_words(glu, glu.first_row + i);
    for (int j = 0; j < kV; ++j) {
      uint32_t pairs[kLanes / 2];
      bfloat16_pair_words(silu_times(gate[i][j], up[i][j]), pairs);
      for (int c = 0; c < kLanes / 2; ++c) words[(kLanes * j / 2 + c) * glu.pair_rows] = pairs[c];
    }
  }
}

// Q8_0 panels (panels.h): per block of 32 input features, 32 float16 scales, then [32, 32] int8.
template <int kRows, int kV>
void tile_kernel_q8_0(const Tile& t) {
  vecf acc[kRows][kV];
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kV; ++j) acc[i][j] = vecf{};
  const uint8_t* panel = static_cast<const uint8_t*>(t.panel);
  for (int64_t b = 0; b < t.k / kQ8Block; ++b) {
    const uint8_t* block = panel + b * kQ8BlockBytes;
    vecf scale[kV];
    Float16Row::load<kV>(reinterpret_cast<const uint16_t*>(block), 0, t.first_vec, scale);
    const int8_t* quants = reinterpret_cast<const int8_t*>(block + 2 * kPanel) + kLanes * t.first_vec;
    for (int kk = 0; kk < kQ8Block; ++kk) {
      if (kk < kQ8BlockBytes / 64) prefetch_weights<kRows>(block + kPrefetchBytes + 64 * kk);
      vecf w[kV];
      for (int j = 0; j < kV; ++j) w[j] = scale[j] * widen_int8(quants + kk * kPanel + kLanes * j);
      add_row<kRows, kV>(acc, t, b * kQ8Block + kk, w);
    }
  }
  finish_tile<kRows, kV>(t, acc);
}

// Columns kLanes * v .. of one Q4_K feature row (16 bytes: column c in the low nibble of byte c for
// c < 16, in the high nibble of byte c - 16 above) as float32 quants 0..15.
template <int kShift>
inline vecf widen_nibbles(const uint8_t* b) {
#if defined(__AVX512F__)
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  return reinterpret_cast<vecf>(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, kShift), _mm512_set1_epi32(15))));
#elif defined(__AVX2__)
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  return reinterpret_cast<vecf>(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, kShift), _mm256_set1_epi32(15))));
#else
  vecf w;
  for (int c = 0; c < kLanes; ++c) w[c] = static_cast<float>((b[c] >> kShift) & 15);
  return w;
#endif
}

inline vecf q4_k_quants(const uint8_t* row, int v) {  // row: a feature's 16 bytes; v: the column vector
  const uint8_t* b = row + (kLanes * v) % (kPanel / 2);
  return kLanes * v < kPanel / 2 ? widen_nibbles<0>(b) : widen_nibbles<4>(b);
}

// Q4_K panels (panels.h): per sub-block, scale = d * sc and min = dmin * m (exact in float32), and
// each weight scale * q - min, rounded once as the dequantization rounds it.
template <int kRows, int kV>
void tile_kernel_q4_k(const Tile& t) {
  vecf acc[kRows][kV];
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kV; ++j) acc[i][j] = vecf{};
  const uint8_t* panel = static_cast<const uint8_t*>(t.panel);
  for (int64_t sb = 0; sb < t.k / weft::kQ4KBlock; ++sb) {
    const uint8_t* block = panel + sb * weft::kQ4KBlockBytes;
    vecf d[kV], dmin[kV];
    Float16Row::load<kV>(reinterpret_cast<const uint16_t*>(block), 0, t.first_vec, d);
    Float16Row::load<kV>(reinterpret_cast<const uint16_t*>(block + 2 * kPanel), 0, t.first_vec, dmin);
    for (int s = 0; s < weft::kQ4KSubBlocks; ++s) {
      vecf scale[kV], min[kV];
      for (int j = 0; j < kV; ++j) {
        const int64_t col = kLanes * (t.first_vec + j) + s * kPanel;
        scale[j] = d[j] * widen_uint8(block + weft::kQ4KScalesOffset + col);
        min[j] = dmin[j] * widen_uint8(block + weft::kQ4KMinsOffset + col);
      }
      const uint8_t* rows = block + weft::kQ4KQuantsOffset + s * 32 * (kPanel / 2);
      for (int kk = 0; kk < 32; ++kk) {
        const uint8_t* row = rows + kk * (kPanel / 2);
        if (kk % 4 == 0) prefetch_weights<kRows>(row + kPrefetchBytes);
        vecf w[kV];
        for (int j = 0; j < kV; ++j) w[j] = q4_k_quants(row, t.first_vec + j) * scale[j] - min[j];
        add_row<kRows, kV>(acc, t, sb * weft::kQ4KBlock + s * 32 + kk, w);
      }
    }
  }
  finish_tile<kRows, kV>(t, acc);
}

// Q6_K panels (panels.h): per sub-block of 16, scale = d * sc (exact in float32), each weight
// scale * q rounded once, as the dequantization rounds it.
template <int kRows, int kV>
void tile_kernel_q6_k(const Tile& t) {
  vecf acc[kRows][kV];
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kV; ++j) acc[i][j] = vecf{};
  const uint8_t* panel = static_cast<const uint8_t*>(t.panel);
  constexpr int64_t kSub = weft::kQ6KSubBlock;
  for (int64_t sb = 0; sb < t.k / weft::kQ6KBlock; ++sb) {
    const uint8_t* block = panel + sb * weft::kQ6KBlockBytes;
    vecf d[kV];
    Float16Row::load<kV>(reinterpret_cast<const uint16_t*>(block), 0, t.first_vec, d);
    const int8_t* quants = reinterpret_cast<const int8_t*>(block + weft::kQ6KQuantsOffset) + kLanes * t.first_vec;
    for (int64_t s = 0; s < weft::kQ6KBlock / kSub; ++s) {
      vecf scale[kV];
      for (int j = 0; j < kV; ++j)
        scale[j] = d[j] * widen_int8(block + weft::kQ6KScalesOffset + s * kPanel + kLanes * (t.first_vec + j));
      for (int kk = 0; kk < kSub; ++kk) {
        const int8_t* row = quants + (s * kSub + kk) * kPanel;
        if (kk % 2 == 0) prefetch_weights<kRows>(row + kPrefetchBytes);
        vecf w[kV];
        for (int j = 0; j < kV; ++j) w[j] = scale[j] * widen_int8(row + kLanes * j);
        add_row<kRows, kV>(acc, t, sb * weft::kQ6KBlock + s * kSub + kk, w);
      }
    }
  }
  finish_tile<kRows, kV>(t, acc);
}

// The tile kernel of each weight type and path, for 1..kMaxTileRows rows, and half-panel tiles of
// twice the rows where registers are few: AVX2's sixteen hold 3 rows x 32 columns (12 accumulators)
// or 6 rows x 16 columns, and the second reads half the panel bytes per multiply-add, which is what
// bounds a long prefill there (a decode step of 1-3 rows streams the weights once either way and
// keeps whole panels).
struct PanelTiles {
  static constexpr int kMaxRows = kMaxTileRows;
  static constexpr int kHalfRows = kLanes == 8 ? 2 * kMaxTileRows : 0;
};
template <typename Row>
struct RowTiles : PanelTiles {
  template <int kRows, int kV> static void run(const Tile& t) { tile_kernel<kRows, kV, Row>(t); }
};
using Float32Tiles = RowTiles<Float32Row>;
using Float16Tiles = RowTiles<Float16Row>;
using BFloat16Tiles = RowTiles<BFloat16Row>;
struct BFloat16DotTiles : PanelTiles {
  template <int kRows, int kV> static void run(const Tile& t) { tile_kernel_bf16_dot<kRows, kV>(t); }
};
struct Q8Tiles : PanelTiles {
  template <int kRows, int kV> static void run(const Tile& t) { tile_kernel_q8_0<kRows, kV>(t); }
};
struct Q4KTiles : PanelTiles {
  template <int kRows, int kV> static void run(const Tile& t) { tile_kernel_q4_k<kRows, kV>(t); }
};
struct Q6KTiles : PanelTiles {
  template <int kRows, int kV> static void run(const Tile& t) { tile_kernel_q6_k<kRows, kV>(t); }
};

struct BFloat16GluTiles {
  template <int kRows, int kV> static void run(const Tile& t) { tile_kernel_bf16_dot_glu<kRows, kV>(t); }
};

// Rows of a panel: K, or for bfloat16 K rounded up to whole pairs.
inline int64_t panel_rows(at::ScalarType type, int64_t k) { return type == at::kBFloat16 ? k + k % 2 : k; }

// Where weight (column c of the panel, input feature i) lives in its panel.
inline int64_t panel_offset(bool paired, int64_t c, int64_t i) {
  return paired ? (i / 2) * kPairElems + c * 2 + i % 2 : i * kPanel + c;
}

template <typename Storage>
void pack_panels(const Storage* w, int64_t n, int64_t k, bool paired, Storage* out) {
  const int64_t panels = (n + kPanel - 1) / kPanel, rows = paired ? k + k % 2 : k;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      Storage* panel = out + p * rows * kPanel;
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t col = p * kPanel + c;  // output feature, a row of W
        const Storage* src = w + col * k;
        for (int64_t i = 0; i < rows; ++i) panel[panel_offset(paired, c, i)] = col < n && i < k ? src[i] : Storage{};
      }
    }
  });
}

// W [N, K] float32, bfloat16 or float16 -> panels [ceil(N / 32), K', 32] of the same type (K' = K,
// or for bfloat16 K rounded up to even, rows in pairs), zero-padded past column N and row K, in
// one pass (so loading a checkpoint holds one matrix twice at most).
at::Tensor pack_linear_weight(const at::Tensor& weight_in) {
  const auto type = weight_in.scalar_type();
  TORCH_CHECK(weight_in.device().is_cpu() && weight_in.dim() == 2 &&
                  (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf),
              "pack_linear_weight: weight must be a float32, bfloat16 or float16 [out, in] matrix on the CPU");
  const at::Tensor weight = weight_in.contiguous();
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  auto out = at::empty({panels, panel_rows(type, k), kPanel}, weight.options());
  if (type == at::kFloat) {
    pack_panels(weight.data_ptr<float>(), n, k, false, out.data_ptr<float>());
  } else {
    pack_panels(static_cast<const uint16_t*>(weight.data_ptr()), n, k, type == at::kBFloat16,
                static_cast<uint16_t*>(out.data_ptr()));
  }
  return out;
}

template <typename Storage>
float widen(Storage v, at::ScalarType type) {
  if constexpr (std::is_same_v<Storage, float>) {
    return v;
  } else if (type == at::kBFloat16) {
    return static_cast<float>(c10::BFloat16(v, c10::BFloat16::from_bits()));
  } else {
    return static_cast<float>(c10::Half(v, c10::Half::from_bits()));
  }
}

template <typename Storage>
void gather_columns(const Storage* panels, int64_t rows, int64_t k, at::ScalarType type, const int64_t* ids,
                    int64_t tokens, float* out) {
  const bool paired = type == at::kBFloat16;
  for (int64_t t = 0; t < tokens; ++t) {
    const Storage* panel = panels + (ids[t] / kPanel) * rows * kPanel;
    for (int64_t i = 0; i < k; ++i) out[t * k + i] = widen(panel[panel_offset(paired, ids[t] % kPanel, i)], type);
  }
}

// Quantized panels (uint8, panels.h), told apart by their block size: the input features per block.
int64_t quant_block_features(const at::Tensor& panels) {
  if (panels.scalar_type() != at::kByte || panels.dim() != 3 || !panels.is_contiguous()) return 0;
  switch (panels.size(2)) {
    case kQ8BlockBytes: return kQ8Block;
    case weft::kQ4KBlockBytes: return weft::kQ4KBlock;
    case weft::kQ6KBlockBytes: return weft::kQ6KBlock;
    default: return 0;
  }
}

bool is_quantized(const at::Tensor& panels, int64_t k) {
  const int64_t block = quant_block_features(panels);
  return block > 0 && k % block == 0 && panels.size(1) == k / block;
}

// The token ids of an embedding lookup, each checked to be a row of the table.
const int64_t* checked_ids(const at::Tensor& ids, int64_t num_rows) {
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < ids.size(0); ++t) {
    TORCH_CHECK(ip[t] >= 0 && ip[t] < num_rows, "embedding_from_panels: a token id is outside the table");
  }
  return ip;
}

at::Tensor embedding_from_quantized(const at::Tensor& ids, const at::Tensor& panels, int64_t num_rows, int64_t k) {
  const int64_t block = quant_block_features(panels);
  TORCH_CHECK((block == kQ8Block || block == weft::kQ6KBlock) && is_quantized(panels, k) &&
                  num_rows > (panels.size(0) - 1) * kPanel && num_rows <= panels.size(0) * kPanel,
              "embedding_from_panels: quantized panels must be Q8_0 or Q6_K ones of a [num_rows, K] matrix");
  const int64_t* ip = checked_ids(ids, num_rows);
  auto out = at::empty({ids.size(0), k}, panels.options().dtype(at::kFloat));
  if (block == kQ8Block) {
    weft::gather_q8_0_rows(panels.data_ptr<uint8_t>(), k, ip, ids.size(0), out.data_ptr<float>());
  } else {
    weft::gather_q6_k_rows(panels.data_ptr<uint8_t>(), k, ip, ids.size(0), out.data_ptr<float>());
  }
  return out;
}

at::Tensor embedding_from_dot_panels(const at::Tensor& ids, const at::Tensor& panels, int64_t num_rows, int64_t k) {
  TORCH_CHECK(weft::is_dot_panels(panels, k) && num_rows > (panels.size(0) - 1) * kPanel &&
                  num_rows <= panels.size(0) * kPanel,
              "embedding_from_panels: int8 panels must be dot panels of a [num_rows, K] matrix");
  const int64_t* ip = checked_ids(ids, num_rows);
  auto out = at::empty({ids.size(0), k}, panels.options().dtype(at::kFloat));
  weft::gather_dot_rows(panels.data_ptr<int8_t>(), panels.size(2), k, ip, ids.size(0), out.data_ptr<float>());
  return out;
}

// Rows `ids` of W from its panels, as float32 [T, K]: the token embeddings of a model whose
// embedding table is tied to its packed lm_head, so the table is not kept a second time.
at::Tensor embedding_from_panels(const at::Tensor& ids, const at::Tensor& panels, int64_t num_rows,
                                 int64_t num_features) {
  const auto type = panels.scalar_type();
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(),
              "embedding_from_panels: ids must be a contiguous [T] int64 CPU tensor");
  if (type == at::kByte) return embedding_from_quantized(ids, panels, num_rows, num_features);
  if (type == at::kChar) return embedding_from_dot_panels(ids, panels, num_rows, num_features);
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
                  (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf) &&
                  num_rows > (panels.size(0) - 1) * kPanel && num_rows <= panels.size(0) * kPanel,
              "embedding_from_panels: panels must come from pack_linear_weight of a [num_rows, K] matrix");
  TORCH_CHECK(panels.size(1) == panel_rows(type, num_features),
              "embedding_from_panels: num_features does not match the panels");
  const int64_t tokens = ids.size(0), rows = panels.size(1), k = num_features;
  const int64_t* ip = checked_ids(ids, num_rows);
  auto out = at::empty({tokens, k}, panels.options().dtype(at::kFloat));
  if (type == at::kFloat) {
    gather_columns(panels.data_ptr<float>(), rows, k, type, ip, tokens, out.data_ptr<float>());
  } else {
    gather_columns(static_cast<const uint16_t*>(panels.data_ptr()), rows, k, type, ip, tokens, out.data_ptr<float>());
  }
  return out;
}

void check_linear_inputs(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                         int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu() && (!bias.has_value() || bias->device().is_cpu()),
              "packed_linear: x, the weight and the bias must be CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "packed_linear: x must be a float32 [M, K] matrix");
  const auto type = panels.scalar_type();
  if (type == at::kChar) {
    TORCH_CHECK(weft::is_dot_panels(panels, x.size(1)),
                "packed_linear: int8 weights must be dot panels (pack_dot) of as many input features as x has");
  } else if (type == at::kByte) {
    TORCH_CHECK(is_quantized(panels, x.size(1)),
                "packed_linear: uint8 weights must be Q8_0, Q4_K or Q6_K panels (pack_q8_0, pack_q4_k, pack_q6_k) "
                "of as many input features as x has");
  } else {
    TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
                    (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf),
                "packed_linear: weight must come from pack_linear_weight or pack_q8_0");
    TORCH_CHECK(panels.size(1) == panel_rows(type, x.size(1)),
                "packed_linear: x and the packed weight differ in input features");
  }
  TORCH_CHECK(reinterpret_cast<uintptr_t>(panels.data_ptr()) % 64 == 0,
              "packed_linear: the packed weight must be 64-byte aligned (a whole tensor, not a view)");
  TORCH_CHECK(n > (panels.size(0) - 1) * kPanel && n <= panels.size(0) * kPanel,
              "packed_linear: out_features does not match the packed weight");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->is_contiguous() && bias->numel() == n &&
                                     bias->scalar_type() == at::kFloat),
              "packed_linear: bias must be a contiguous float32 [out_features]");
}

// out[e] = x[e] @ W_e.T: row e of x [E, K] float32 times the e-th of `panels`, int8 dot panels of
// one shape and kind (pack_dot) without a bias, into out [E, out_features]: a layer's routed experts
// at batch 1 (model/moe.py), each the same numbers as packed_linear(x[e : e + 1], panels[e]), in one
// parallel region.
at::Tensor packed_linear_rows(const at::Tensor& x_in, at::TensorList panels, int64_t out_features) {
  TORCH_CHECK(!panels.empty() && x_in.dim() == 2 && x_in.size(0) == static_cast<int64_t>(panels.size()),
              "packed_linear_rows: x must be [E, K], one row for each of the E matrices");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  for (const auto& p : panels) {
    check_linear_inputs(x, p, std::nullopt, out_features);
    TORCH_CHECK(p.scalar_type() == at::kChar && p.sizes() == panels[0].sizes(),
                "packed_linear_rows: the matrices must be int8 dot panels of one shape and kind");
  }
  auto out = at::empty({x.size(0), out_features}, x.options());
  weft::dot_linear_rows(x, panels, out);
  return out;
}

// The K values of a row rounded to bfloat16 as (K + 1) / 2 pair words (the last one's high half 0
// where K is odd), a vector at a time (a scalar loop took 1 ms of a 4,096 x 576 product's 13).
inline void round_to_pairs(const float* row, int64_t k, uint32_t* words) {
  int64_t kk = 0;
  for (; 2 * kk + kLanes <= k; kk += kLanes / 2) bfloat16_pair_words(*reinterpret_cast<const vecfu*>(row + 2 * kk), words + kk);
  for (; kk < k / 2; ++kk) words[kk] = pair_word(row[2 * kk], row[2 * kk + 1]);
  if (k % 2 != 0) words[k / 2] = bfloat16_bits(row[k - 1]);
}

// x [M, K] as bfloat16 pairs of features in 32-bit words, feature 2i in the low half, laid out
// tile by tile: [tiles, K / 2, rows], pair kk of the tile's row i at [kk, i] (the last tile
// zero-padded to `rows`). One pass, tiles split between threads: `round(r, words)` writes row r's
// words (r < M), which then go down its column of the tile (which stays in L1 meanwhile).
template <typename Round>
at::Tensor pairs_by_rows(int64_t m, int64_t k, int64_t rows, const at::TensorOptions& options, const Round& round) {
  const int64_t pairs = (k + 1) / 2, tiles = (m + rows - 1) / rows;
  auto out = at::empty({tiles, pairs, rows}, options.dtype(at::kInt));
  auto* op = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> words(pairs);
    for (int64_t t = begin; t < end; ++t) {
      uint32_t* tile = op + t * pairs * rows;
      for (int64_t i = 0; i < rows; ++i) {
        if (t * rows + i >= m) {
          std::fill(words.begin(), words.end(), 0u);
        } else {
          round(t * rows + i, words.data());
        }
        for (int64_t kk = 0; kk < pairs; ++kk) tile[kk * rows + i] = words[kk];
      }
    }
  });
  return out;
}

// x rounded to bfloat16 pairs in the tile layout of `rows` rows (pairs_by_rows).
at::Tensor bfloat16_pairs(const at::Tensor& x, int64_t rows) {
  const float* xp = x.data_ptr<float>();
  const int64_t k = x.size(1), stride = x.stride(0);
  return pairs_by_rows(x.size(0), k, rows, x.options(),
                       [&](int64_t r, uint32_t* words) { round_to_pairs(xp + r * stride, k, words); });
}

// Rows per tile of the bfloat16 pairs of M rows that bfloat16 products read.
inline int64_t pair_tile_rows(int64_t m) { return weft::tiles::tiling<BFloat16DotTiles>(std::max<int64_t>(m, 1)).rows; }

// x[t] += delta[t] in place (where delta is given), then rms_norm(x[t]) as the bfloat16 pairs of
// bfloat16 products (pairs_by_rows, in the tiling of M rows): bit for bit the pairs that
// packed_linear(add_rms_norm_(x, delta, weight, eps), ..., bf16_dot) makes, without the norm's float32
// [M, K] in memory. The input of an attention's q|k|v or an MLP's gate|up projection.
at::Tensor add_rms_norm_pairs_(at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                               double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "add_rms_norm_pairs_: x must be a contiguous float32 [T, H] CPU tensor");
  TORCH_CHECK(!delta.has_value() || (delta->sizes() == x.sizes() && delta->is_contiguous() &&
                                     delta->scalar_type() == at::kFloat && delta->device().is_cpu()),
              "add_rms_norm_pairs_: delta must be a contiguous float32 CPU tensor of x's shape");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "add_rms_norm_pairs_: weight must be float32 [H]");
  const int64_t m = x.size(0), k = x.size(1);
  float* xp = x.data_ptr<float>();
  const float* dp = delta.has_value() ? delta->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  return pairs_by_rows(m, k, pair_tile_rows(m), x.options(), [&](int64_t r, uint32_t* words) {
    float* row = xp + r * k;
    if (dp != nullptr) {
#pragma omp simd
      for (int64_t i = 0; i < k; ++i) row[i] += dp[r * k + i];
    }
    thread_local std::vector<float> normed;
    normed.resize(k);
    weft::vmath::rms_norm_row(row, wp, normed.data(), k, static_cast<float>(eps));
    round_to_pairs(normed.data(), k, words);
  });
}

template <typename Tiles, typename Storage>
void run_panels(const at::Tensor& x, const at::Tensor& panels, const float* bias, at::Tensor& out,
                const at::Tensor& xq) {
  const int64_t panel_bytes = panels.stride(0) * static_cast<int64_t>(sizeof(Storage));
  if (!xq.defined()) {
    weft::tiles::run_tiles<Tiles>(x, panels.data_ptr(), panels.size(0), panel_bytes, bias, out, nullptr, 0, 0,
                                  4 * x.size(1));
    return;
  }
  const int64_t rows = xq.size(2);  // bfloat16 pairs [tiles, K / 2, rows]
  weft::tiles::run_tiles<Tiles>(x, panels.data_ptr(), panels.size(0), panel_bytes, bias, out,
                                static_cast<const uint8_t*>(xq.data_ptr()), 4 * xq.size(1) * rows, rows,
                                4 * xq.size(1));
}

// y = x @ W.T + b: x [M, K] float32, panels from pack_linear_weight, bias [N] float32 or none.
// bf16_dot (bfloat16 panels only): x rounded to bfloat16, bfloat16 products accumulated in float32.
at::Tensor packed_linear(const at::Tensor& x_in, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                         int64_t out_features, bool bf16_dot) {
  check_linear_inputs(x_in, panels, bias, out_features);
  TORCH_CHECK(!bf16_dot || panels.scalar_type() == at::kBFloat16,
              "packed_linear: bf16_dot needs bfloat16 panels (the products of other weights are float32)");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  auto out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return out;
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  switch (panels.scalar_type()) {
    case at::kBFloat16:
      if (bf16_dot) {
        run_panels<BFloat16DotTiles, uint16_t>(x, panels, bp, out, bfloat16_pairs(x, pair_tile_rows(x.size(0))));
      } else {
        run_panels<BFloat16Tiles, uint16_t>(x, panels, bp, out, at::Tensor());
      }
      break;
    case at::kHalf: run_panels<Float16Tiles, uint16_t>(x, panels, bp, out, at::Tensor()); break;
    case at::kChar: weft::dot_linear(x, panels, bp, out); break;
    case at::kByte:
      if (panels.size(2) == kQ8BlockBytes) {
        run_panels<Q8Tiles, uint8_t>(x, panels, bp, out, at::Tensor());
      } else if (panels.size(2) == weft::kQ4KBlockBytes) {
        run_panels<Q4KTiles, uint8_t>(x, panels, bp, out, at::Tensor());
      } else {
        run_panels<Q6KTiles, uint8_t>(x, panels, bp, out, at::Tensor());
      }
      break;
    default: run_panels<Float32Tiles, float>(x, panels, bp, out, at::Tensor()); break;
  }
  return out;
}

// silu(x @ Wg.T) * (x @ Wu.T): an MLP's fused gate|up projection, packed as one [2I, K] bfloat16
// matrix (gate rows, then up rows; I a multiple of 32, so that gate panel p and up panel p + I / 32
// hold the same MLP columns), multiplied with bfloat16 products as packed_linear's bf16_dot, its
// activation applied and rounded to the down projection's bfloat16 pairs as the tiles are stored
// (`pairs`, in the same tiling as x's): bit for bit the pairs packed_linear(silu_mul(packed_linear(
// ...)), bf16_dot) would make, without the [M, 2I] product or the [M, I] activation in float32 in
// memory. x comes as its bfloat16 pairs xq [tiles, K / 2, rows]; tiles of up to kMaxTileRows of
// those rows (a pairs tile in one or more) and half a panel of gate and up each; threads take runs
// of MLP columns, over blocks of rows that fit in L2.
void run_glu(const at::Tensor& xq, int64_t m, const at::Tensor& panels, int64_t intermediate, uint32_t* pairs) {
  const int64_t k = 2 * xq.size(1), rows = xq.size(2), gate_panels = intermediate / kPanel;
  constexpr auto kernels = weft::tiles::tile_table<BFloat16GluTiles, kVecs / 2>(std::make_integer_sequence<int, kMaxTileRows>{});
  const auto* wp = static_cast<const uint8_t*>(panels.data_ptr());
  const auto* xqp = static_cast<const uint8_t*>(xq.data_ptr());
  const int64_t panel_bytes = panels.stride(0) * 2, xq_tile_bytes = 4 * xq.size(1) * rows;
  const int64_t block = rows * std::max<int64_t>(1, weft::tiles::kBlockBytes / xq_tile_bytes);
  at::parallel_for(0, 2 * gate_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < m; first += block) {
      const int64_t last = std::min(m, first + block);
      for (int64_t half = begin; half < end; ++half) {  // 16 MLP columns: half of panel half / 2
        const int64_t p = half / 2, col = half * kPanel / 2;
        for (int64_t r = first; r < std::min(last, m); r += std::min<int64_t>(kMaxTileRows, rows - r % rows)) {
          const int64_t count = std::min({static_cast<int64_t>(kMaxTileRows), rows - r % rows, m - r});
          const weft::tiles::GluTile glu{wp + (p + gate_panels) * panel_bytes, pairs, intermediate / 2, rows, r, col};
          const Tile tile{nullptr, 0, xqp + (r / rows) * xq_tile_bytes + 4 * (r % rows), rows,
                          wp + p * panel_bytes, k, nullptr, 0, kPanel / 2,
                          nullptr, static_cast<int>(half % 2) * kVecs / 2, &glu};
          kernels[count](tile);
        }
      }
    }
  });
}

// xq: the bfloat16 pairs of M rows in the tiling of bfloat16 products (pair_tile_rows), or an error
// that names `op`; K (rounded up to even).
int64_t checked_pairs(const at::Tensor& xq, int64_t m, const char* op) {
  TORCH_CHECK(xq.scalar_type() == at::kInt && xq.dim() == 3 && xq.is_contiguous() && xq.device().is_cpu() && m >= 0 &&
                  xq.size(2) == pair_tile_rows(m) && xq.size(0) == (m + xq.size(2) - 1) / xq.size(2),
              op, ": xq must be the bfloat16 pairs of M rows (packed_glu_pairs, add_rms_norm_pairs_)");
  return 2 * xq.size(1);
}

// The fused gate|up projection and its activation (run_glu) of x given as its bfloat16 pairs xq:
// the down projection's input as bfloat16 pairs, int32 [tiles, I / 2, rows] in the same tiling.
at::Tensor packed_glu_pairs_from_pairs(const at::Tensor& xq, int64_t m, const at::Tensor& panels, int64_t intermediate) {
  const int64_t k = checked_pairs(xq, m, "packed_glu_pairs");
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && intermediate % kPanel == 0 && intermediate > 0 &&
                  panels.dim() == 3 && panels.size(0) == 2 * intermediate / kPanel && panels.size(1) == k,
              "packed_glu_pairs: the gate|up panels must be bfloat16 [2I / 32, K, 32] of a multiple of 32 MLP "
              "columns I (use packed_linear and silu_mul otherwise); got panels ", panels.sizes(), " for I = ",
              intermediate, " and K = ", k);
  const int64_t rows = xq.size(2), tiles = xq.size(0);
  auto pairs = at::empty({tiles, intermediate / 2, rows}, xq.options());
  if (m == 0) return pairs;
  if (m % rows != 0) pairs[tiles - 1].narrow(1, m % rows, rows - m % rows).zero_();
  run_glu(xq, m, panels, intermediate, reinterpret_cast<uint32_t*>(pairs.data_ptr<int32_t>()));
  return pairs;
}

// The same from x [M, K] float32.
at::Tensor packed_glu_pairs(const at::Tensor& x_in, const at::Tensor& panels, int64_t intermediate) {
  check_linear_inputs(x_in, panels, std::nullopt, 2 * intermediate);
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t m = x.size(0);
  return packed_glu_pairs_from_pairs(bfloat16_pairs(x, pair_tile_rows(m)), m, panels, intermediate);
}

// y = x @ W.T + b with bfloat16 products (packed_linear's bf16_dot), x of M rows given as its
// bfloat16 pairs (packed_glu_pairs' output) instead of float32.
at::Tensor packed_linear_pairs(const at::Tensor& xq, int64_t m, const at::Tensor& panels,
                               const std::optional<at::Tensor>& bias, int64_t out_features) {
  checked_pairs(xq, m, "packed_linear_pairs");
  // x itself is not read by the bfloat16 tiles (they read xq): a view of one float stands for its shape
  const at::Tensor shape = at::zeros({1}, xq.options().dtype(at::kFloat)).expand({m, 2 * xq.size(1)});
  check_linear_inputs(shape, panels, bias, out_features);
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16, "packed_linear_pairs: the panels must be bfloat16");
  auto out = at::empty({m, out_features}, shape.options());
  if (m == 0) return out;
  run_panels<BFloat16DotTiles, uint16_t>(shape, panels, bias.has_value() ? bias->data_ptr<float>() : nullptr, out, xq);
  return out;
}

// The vector instruction sets this build of the kernels uses (it is compiled for the machine).
std::string build_info() {
  std::string isa;
#if defined(__AVX512F__)
  isa += "avx512f ";
#elif defined(__AVX2__)
  isa += "avx2 ";
#endif
#if defined(__AVX512BW__)
  isa += "avx512bw ";
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  isa += "avx512_bf16 ";
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  isa += "avx512_vnni ";
#endif
#if defined(__F16C__)
  isa += "f16c ";
#endif
#if defined(__FMA__)
  isa += "fma ";
#endif
  return isa.empty() ? "scalar" : isa.substr(0, isa.size() - 1);
}

}  // namespace

namespace weft {  // for decoder.cpp (ops.h)

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                         int64_t out_features, bool bf16_dot) {
  return ::packed_linear(x, panels, bias, out_features, bf16_dot);
}

}  // namespace weft

TORCH_LIBRARY_FRAGMENT(weft, m) {
  m.def("build_info() -> str", &build_info);
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("embedding_from_panels(Tensor ids, Tensor panels, int num_rows, int num_features) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor panels, Tensor? bias, int out_features, bool bf16_dot=False) -> Tensor");
  m.def("packed_linear_rows(Tensor x, Tensor[] panels, int out_features) -> Tensor");
  m.def("packed_glu_pairs(Tensor x, Tensor panels, int intermediate) -> Tensor");
  m.def("packed_linear_pairs(Tensor xq, int m, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("packed_glu_pairs_from_pairs(Tensor xq, int m, Tensor panels, int intermediate) -> Tensor");
  m.def("add_rms_norm_pairs_(Tensor(a!) x, Tensor? delta, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(weft, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("embedding_from_panels", &embedding_from_panels);
  m.impl("packed_linear", &packed_linear);
  m.impl("packed_linear_rows", &packed_linear_rows);
  m.impl("packed_glu_pairs", &packed_glu_pairs);
  m.impl("packed_linear_pairs", &packed_linear_pairs);
  m.impl("packed_glu_pairs_from_pairs", &packed_glu_pairs_from_pairs);
  m.impl("add_rms_norm_pairs_", &add_rms_norm_pairs_);
}
