// The tile machinery that every panel kernel shares (linear.cpp: float and half-precision panels and
// the exact quantized ones; qdot.cpp: quantized panels with int8 activations): vectors of the
// machine's width, the tile a kernel computes, storing it, and the walk of a product over its tiles.
//
// A product out = x @ W.T (+ bias) over panels of 32 output columns is cut into tiles of up to
// Tiles::kMaxRows rows times one panel (or one half of it, where registers are few); a tile kernel
// keeps its outputs in registers while it walks down its panel. Threads take contiguous runs of
// panels; inside a thread a panel stays in L2 for the next tile of rows, and a long product goes in
// blocks of rows whose x fits in L2 beside a panel, each thread walking the blocks on its own (one
// parallel region per product: a barrier per block cost 1.5-5.6% of a bfloat16 product at 128-4,096 rows).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__F16C__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "panels.h"

namespace weft::tiles {

constexpr int64_t kPrefetchBytes = 2048;    // how far ahead of the current panel row to prefetch
constexpr int64_t kBlockBytes = 256 << 10;  // the rows of x a thread keeps in L2 while the panels pass

// Vectors of the machine's own width: 16 floats with AVX-512, else 8 (AVX2). Wider generic vectors
// than the registers are not split into register pairs: GCC moves them through the stack, and the
// AVX2 build of the 16-float kernel ran at ~5 GFLOP/s, 4x slower than torch even at one row.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
constexpr int kVecs = kPanel / kLanes;  // vectors per panel row

typedef float vecf __attribute__((vector_size(4 * kLanes)));               // aligned: panel rows
typedef float vecfu __attribute__((vector_size(4 * kLanes), aligned(4)));  // unaligned: output rows, bias

// kLanes float16, int8 or uint8 values as float32 (scales, quants): vcvtph2ps, vpmovsxbd / vpmovzxbd
// and vcvtdq2ps where the build has them, one at a time elsewhere.
inline vecf widen_halves(const void* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vecf>(_mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  return reinterpret_cast<vecf>(_mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p))));
#else
  vecf w;
  for (int c = 0; c < kLanes; ++c) w[c] = static_cast<float>(c10::Half(static_cast<const uint16_t*>(p)[c], c10::Half::from_bits()));
  return w;
#endif
}

inline vecf widen_int8(const void* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vecf>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return reinterpret_cast<vecf>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)))));
#else
  vecf w;
  for (int c = 0; c < kLanes; ++c) w[c] = static_cast<float>(static_cast<const int8_t*>(p)[c]);
  return w;
#endif
}

inline vecf widen_uint8(const void* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vecf>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return reinterpret_cast<vecf>(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)))));
#else
  vecf w;
  for (int c = 0; c < kLanes; ++c) w[c] = static_cast<float>(static_cast<const uint8_t*>(p)[c]);
  return w;
#endif
}

typedef uint32_t wordsv __attribute__((vector_size(4 * kLanes)));  // pairs of bfloat16 values, one per word

// acc[j] += x[2j + 1] * w[2j + 1], then += x[2j] * w[2j] (bfloat16 halves of 32-bit words): vdpbf16ps
// where the build has AVX512_BF16, else the same arithmetic (each product exact in float32, each sum
// rounded once, as the instruction does).
inline vecf dot_pairs(vecf acc, wordsv x, wordsv w) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return reinterpret_cast<vecf>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc), reinterpret_cast<__m512bh>(x),
                                                  reinterpret_cast<__m512bh>(w)));
#else
  acc += reinterpret_cast<vecf>(x & 0xffff0000u) * reinterpret_cast<vecf>(w & 0xffff0000u);
  acc += reinterpret_cast<vecf>(x << 16) * reinterpret_cast<vecf>(w << 16);
  return acc;
#endif
}

// f rounded to bfloat16, to nearest even (as torch rounds it), in the low 16 bits.
inline uint32_t bfloat16_bits(float f) {
  const uint32_t u = __builtin_bit_cast(uint32_t, f);
  return f != f ? 0x7fc0u : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// (low, high) rounded to bfloat16 as one 32-bit word of a pair, low in the low half.
inline uint32_t pair_word(float low, float high) { return bfloat16_bits(low) | bfloat16_bits(high) << 16; }

struct GluTile;  // linear.cpp's fused gate|up projection (packed_glu_pairs)

struct Tile {
  const float* x;      // first row of the tile
  int64_t x_stride;
  const void* xq;      // x prepared for the kernel (bfloat16 pairs, int8 blocks), the tile's first row
  int64_t xq_stride;   // its meaning is the kernel's (words per pair of the tile, bytes per row)
  const void* panel;   // the panel's blocks, of the weight type
  int64_t k;
  float* out;          // first row, first column of the tile
  int64_t out_stride;
  int64_t cols;        // valid columns of this tile (its width but in the last panel)
  const float* bias;   // the tile's bias (its first column), or nullptr
  int first_vec;       // the tile's first column vector in the panel (0, or kVecs / 2 for a right half)
  const GluTile* glu = nullptr;  // a fused gate|up projection's tile (linear.cpp's packed_glu_pairs)
};

using TileFn = void (*)(const Tile&);

// Adds the bias and stores the tile (shared by the kernels).
template <int kRows, int kV>
__attribute__((always_inline)) inline void finish_tile(const Tile& t, vecf (&acc)[kRows][kV]) {
  if (t.bias != nullptr) {
    float bias[kPanel] = {};
    std::memcpy(bias, t.bias, sizeof(float) * t.cols);
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < kV; ++j) acc[i][j] += *reinterpret_cast<const vecfu*>(bias + kLanes * j);
  }
  for (int i = 0; i < kRows; ++i) {
    float* dst = t.out + i * t.out_stride;
    if (t.cols == kV * kLanes) {
      for (int j = 0; j < kV; ++j) *reinterpret_cast<vecfu*>(dst + kLanes * j) = acc[i][j];
    } else {
      std::memcpy(dst, &acc[i][0], sizeof(float) * t.cols);
    }
  }
}

// Fetches the weights' line at p ahead of its use (kPrefetchBytes ahead of the panel row read now)
// for a tile of kRows rows. One row (a decode step at batch 1) streams the weights from memory as
// fast as the lines come in, and prefetches into L1 hold the core's few L1 fill buffers for a whole
// memory latency each: into L2 (prefetcht1) its bfloat16, Q8_0, Q4_K, Q6_K and float32 products read
// 10-30% more GB/s on the Zen 4, and the 1B Q8_0 file decodes 5-30% faster. Taller tiles spend more
// time on each line and wait on the L2 instead: into L1 they measured 6-7% faster at batch 8
// (docs/benchmarks.md). -DWEFT_PREFETCH_LOCALITY=3 (WEFT_NATIVE_CFLAGS) builds one-row tiles'
// prefetches into L1 too, for comparison.
#ifndef WEFT_PREFETCH_LOCALITY
#define WEFT_PREFETCH_LOCALITY 2
#endif
template <int kRows>
inline void prefetch_weights(const void* p) {
  __builtin_prefetch(p, 0, kRows == 1 ? WEFT_PREFETCH_LOCALITY : 3);
}

// Fetches line `step` of the tile's output for writing, for steps 0 .. kRows * lines per row - 1 (a
// kernel calls it once per step of its K loop, so the lines arrive while the tile computes): the
// output of a long product is fresh memory, and a tile's stores to its rows' lines, each a miss,
// otherwise wait at its end (measured alone: 4-6% of a bfloat16 product at 4,096 rows).
template <int kRows, int kV>
__attribute__((always_inline)) inline void prefetch_out_line(const Tile& t, int64_t step) {
  constexpr int64_t kLinesPerRow = (kV * kLanes * 4 + 63) / 64;
  if (step < kRows * kLinesPerRow)
    __builtin_prefetch(t.out + (step / kLinesPerRow) * t.out_stride + (step % kLinesPerRow) * 16, 1, 3);
}

// A tile kernel of each height 1..kRows (index 0 unused), for kV column vectors.
template <typename Tiles, int kV, int... kRows>
constexpr std::array<TileFn, sizeof...(kRows) + 1> tile_table(std::integer_sequence<int, kRows...>) {
  return {nullptr, &Tiles::template run<kRows + 1, kV>...};
}

// Whole-panel tiles of up to Tiles::kMaxRows rows and, where Tiles::kHalfRows is not 0, half-panel
// tiles of up to that many (a half reads half the panel bytes per multiply-add: what bounds a long
// prefill where registers are few).
template <typename Tiles>
constexpr auto kWholeTiles = tile_table<Tiles, kVecs>(std::make_integer_sequence<int, Tiles::kMaxRows>{});
template <typename Tiles>
constexpr auto kHalfTiles = tile_table<Tiles, kVecs / 2>(std::make_integer_sequence<int, Tiles::kHalfRows>{});

// Rows per tile: as even as possible, at most max_rows (16 rows in tiles of 12: 8 + 8, not 12 + 4).
inline int64_t tile_rows(int64_t rows, int64_t max_rows) {
  const int64_t tiles = (rows + max_rows - 1) / max_rows;
  return (rows + tiles - 1) / tiles;
}

// How run_tiles cuts M rows into tiles: whole-panel tiles, or (from kHalfRows rows, where the
// kernels have halves) half-panel tiles.
struct Tiling {
  bool halves;
  int64_t rows;  // rows per tile (the last tile may have fewer)
};

template <typename Tiles>
Tiling tiling(int64_t m) {
  const bool halves = Tiles::kHalfRows > 0 && m >= Tiles::kHalfRows;
  return {halves, tile_rows(m, halves ? Tiles::kHalfRows : Tiles::kMaxRows)};
}

// out [M, N] = x [M, K] @ W.T (+ bias) with Tiles' kernels, W as `num_panels` panels of
// `panel_bytes` each; xq (or nullptr): x prepared for the kernels, `xq_tile_bytes` per tile of rows
// (tile r / rows starts at xq + (r / rows) * xq_tile_bytes) and `xq_stride` as the kernels read it;
// `row_bytes`: what one row of x weighs in the kernels' reads (the L2 blocking).
template <typename Tiles>
void run_tiles(const at::Tensor& x, const void* panels, int64_t num_panels, int64_t panel_bytes, const float* bias,
               at::Tensor& out, const uint8_t* xq, int64_t xq_tile_bytes, int64_t xq_stride, int64_t row_bytes) {
  const int64_t m = x.size(0), n = out.size(1), k = x.size(1);
  const auto [halves, rows] = tiling<Tiles>(m);
  const int64_t width = halves ? kPanel / 2 : kPanel;
  const TileFn* kernels = halves ? kHalfTiles<Tiles>.data() : kWholeTiles<Tiles>.data();
  const float* xp = x.data_ptr<float>();
  const auto* wp = static_cast<const uint8_t*>(panels);
  float* op = out.data_ptr<float>();
  const int64_t block = rows * std::max<int64_t>(1, kBlockBytes / (row_bytes * rows));
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {  // one region: no barrier per block
    for (int64_t first = 0; first < m; first += block) {
      const int64_t last = std::min(m, first + block);
      for (int64_t p = begin; p < end; ++p) {
        for (int64_t col = p * kPanel; col < std::min((p + 1) * kPanel, n); col += width) {
          const int first_vec = static_cast<int>((col - p * kPanel) / kLanes);
          for (int64_t r = first; r < last; r += rows) {
            const int64_t count = std::min(rows, m - r);
            const Tile tile{xp + r * x.stride(0), x.stride(0), xq == nullptr ? nullptr : xq + (r / rows) * xq_tile_bytes,
                            xq_stride, wp + p * panel_bytes, k, op + r * n + col, n, std::min(width, n - col),
                            bias == nullptr ? nullptr : bias + col, first_vec};
            kernels[count](tile);
          }
        }
      }
    }
  });
}

}  // namespace weft::tiles
