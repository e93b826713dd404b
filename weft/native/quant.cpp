// Quantized weights in weft's panel layout (panels.h): packing a GGUF tensor's blocks into panels
// once at load, and reading rows of them back (the token embeddings of a tied, quantized table).
// The products themselves are linear.cpp's tile kernels.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "blocks.h"
#include "panels.h"

namespace weft {

namespace {

// One column's Q8_0 block (file layout: a float16 scale, 32 int8 quants) into its panel block.
void pack_q8_0_column(const uint8_t* file_block, int64_t c, uint8_t* block) {
  std::memcpy(block + 2 * c, file_block, 2);
  for (int64_t kk = 0; kk < kQ8Block; ++kk) block[2 * kPanel + kk * kPanel + c] = file_block[2 + kk];
}

// The 6-bit scale and min of sub-block j of a Q4_K super-block (llama.cpp's get_scale_min_k4).
void q4_k_scale_min(int j, const uint8_t* q, uint8_t* scale, uint8_t* min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One column's k-quant super-block of 256 features, decoded to the form the panels hold: d and dmin
// (float16 bits), a scale and a min per sub-block of 16, and the quants q (0..63): each weight
// d * sc * q - dmin * m.
struct KBlock {
  uint16_t d, dmin;
  int8_t sc[kQ6KSubBlocks], m[kQ6KSubBlocks];
  uint8_t q[kQ4KBlock];
};

uint16_t half_bits(float value) { return c10::Half(value).x; }

// The head of a Q4_K or Q5_K super-block (d, dmin, scales[12]): sc and m 0..63 per sub-block of 32
// (both of its halves).
KBlock decode_k_head(const uint8_t* file_block) {
  KBlock b{};
  std::memcpy(&b.d, file_block, 2);
  std::memcpy(&b.dmin, file_block + 2, 2);
  for (int j = 0; j < kQ4KSubBlocks; ++j) {
    uint8_t scale, min;
    q4_k_scale_min(j, file_block + 4, &scale, &min);
    b.sc[2 * j] = b.sc[2 * j + 1] = static_cast<int8_t>(scale);
    b.m[2 * j] = b.m[2 * j + 1] = static_cast<int8_t>(min);
  }
  return b;
}

// A Q4_K super-block (file layout: d, dmin, scales[12], qs[128]): q 0..15.
KBlock decode_q4_k(const uint8_t* file_block) {
  KBlock b = decode_k_head(file_block);
  const uint8_t* qs = file_block + 16;
  for (int64_t j = 0; j < kQ4KBlock / 64; ++j) {  // 64 features per pair of sub-blocks, low nibbles first
    for (int64_t l = 0; l < 32; ++l) {
      b.q[64 * j + l] = qs[32 * j + l] & 0xF;
      b.q[64 * j + 32 + l] = qs[32 * j + l] >> 4;
    }
  }
  return b;
}

// A Q5_K super-block (file layout: d, dmin, scales[12] as Q4_K's, qh[32], qs[128]): q 0..31 (the
// low 4 bits as Q4_K's, the fifth of feature 64 j + l (l < 32) bit 2 j of qh[l], of 64 j + 32 + l
// bit 2 j + 1), sc and m 0..63 per sub-block of 32: each weight d * sc * q - dmin * m, which the
// Q6_K dot layout with mins holds exactly.
KBlock decode_q5_k(const uint8_t* file_block) {
  KBlock b = decode_k_head(file_block);
  const uint8_t *qh = file_block + 16, *qs = file_block + 48;
  for (int64_t j = 0; j < kQ4KBlock / 64; ++j) {
    for (int64_t l = 0; l < 32; ++l) {
      b.q[64 * j + l] = static_cast<uint8_t>((qs[32 * j + l] & 0xF) | (((qh[l] >> (2 * j)) & 1) << 4));
      b.q[64 * j + 32 + l] = static_cast<uint8_t>((qs[32 * j + l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4));
    }
  }
  return b;
}

// A Q2_K super-block (file layout: scales[16], qs[64], d, dmin): per sub-block of 16 a 4-bit scale
// (low nibble) and min (high), q 0..3 at bits 2 j of qs[32 n + l] for feature 128 n + 32 j + l:
// each weight d * sc * q - dmin * m, which the Q6_K dot layout with mins holds exactly.
KBlock decode_q2_k(const uint8_t* file_block) {
  KBlock b{};
  const uint8_t *scales = file_block, *qs = file_block + 16;
  std::memcpy(&b.d, file_block + 80, 2);
  std::memcpy(&b.dmin, file_block + 82, 2);
  for (int64_t s = 0; s < kQ6KSubBlocks; ++s) {
    b.sc[s] = static_cast<int8_t>(scales[s] & 0xF);
    b.m[s] = static_cast<int8_t>(scales[s] >> 4);
  }
  for (int64_t n = 0; n < 2; ++n) {
    for (int64_t j = 0; j < 4; ++j) {
      for (int64_t l = 0; l < 32; ++l) b.q[128 * n + 32 * j + l] = (qs[32 * n + l] >> (2 * j)) & 3;
    }
  }
  return b;
}

// A Q3_K super-block (blocks.h) for its own dot panels: q + 4 (0..7) and int8 sc - 32.
KBlock decode_q3_k(const uint8_t* file_block) {
  KBlock b{};
  std::memcpy(&b.d, file_block + 108, 2);
  int8_t q[kQ6KBlock];
  decode_q3_k_block(file_block, b.sc, q);
  for (int64_t k = 0; k < kQ6KBlock; ++k) b.q[k] = static_cast<uint8_t>(q[k] + 4);
  return b;
}

// A Q6_K super-block (file layout: ql[128], qh[64], scales[16], d): q + 32 (0..63), int8 sc, and
// dmin = 32 d, m = sc, so that d * sc * (q + 32) - dmin * m = d * sc * q.
KBlock decode_q6_k(const uint8_t* file_block) {
  KBlock b{};
  const uint8_t *ql = file_block, *qh = file_block + 128;
  std::memcpy(&b.d, file_block + 208, 2);
  b.dmin = half_bits(32.0f * static_cast<float>(c10::Half(b.d, c10::Half::from_bits())));  // inf past 2047
  std::memcpy(b.sc, file_block + 192, kQ6KSubBlocks);
  std::memcpy(b.m, b.sc, kQ6KSubBlocks);
  for (int64_t half = 0; half < 2; ++half) {  // llama.cpp's dequantize_row_q6_K, 128 features at a time
    const uint8_t *lo = ql + 64 * half, *hi = qh + 32 * half;
    for (int64_t l = 0; l < 32; ++l) {
      uint8_t* q = b.q + 128 * half + l;
      q[0] = (lo[l] & 0xF) | (((hi[l] >> 0) & 3) << 4);
      q[32] = (lo[l + 32] & 0xF) | (((hi[l] >> 2) & 3) << 4);
      q[64] = (lo[l] >> 4) | (((hi[l] >> 4) & 3) << 4);
      q[96] = (lo[l + 32] >> 4) | (((hi[l] >> 6) & 3) << 4);
    }
  }
  return b;
}

// Column c's quant q into its byte: the low nibble for columns 0-15, the high one for 16-31.
void put_nibble(uint8_t& dst, int64_t c, uint8_t q) {
  dst = c < 16 ? static_cast<uint8_t>((dst & 0xF0) | q) : static_cast<uint8_t>((dst & 0x0F) | (q << 4));
}

// One column's Q4_K super-block into its panel block.
void pack_q4_k_column(const uint8_t* file_block, int64_t c, uint8_t* block) {
  const KBlock b = decode_q4_k(file_block);
  std::memcpy(block + 2 * c, &b.d, 2);
  std::memcpy(block + 2 * kPanel + 2 * c, &b.dmin, 2);
  for (int j = 0; j < kQ4KSubBlocks; ++j) {
    block[kQ4KScalesOffset + j * kPanel + c] = static_cast<uint8_t>(b.sc[2 * j]);
    block[kQ4KMinsOffset + j * kPanel + c] = static_cast<uint8_t>(b.m[2 * j]);
  }
  for (int64_t k = 0; k < kQ4KBlock; ++k) put_nibble(block[kQ4KQuantsOffset + k * (kPanel / 2) + c % 16], c, b.q[k]);
}

// One column's Q6_K super-block into its panel block (quants as int8 q).
void pack_q6_k_column(const uint8_t* file_block, int64_t c, uint8_t* block) {
  const KBlock b = decode_q6_k(file_block);
  std::memcpy(block + 2 * c, &b.d, 2);
  for (int64_t s = 0; s < kQ6KSubBlocks; ++s) block[kQ6KScalesOffset + s * kPanel + c] = static_cast<uint8_t>(b.sc[s]);
  for (int64_t k = 0; k < kQ6KBlock; ++k) block[kQ6KQuantsOffset + k * kPanel + c] = static_cast<uint8_t>(b.q[k] - 32);
}

// Where dot panels (panels.h) keep feature k of column c within a super-block: the byte of its nibble
// (low for columns 0-15, high for 16-31), the byte of its high 2 bits (Q6_K; at bit 2 (c / 8)), and
// its sub-block's scale and min.
struct DotSpot {
  int64_t nibble, high, scale, min;
};

DotSpot q4k_dot_spot(int64_t k, int64_t c) {
  const int64_t sub = q4k_dot_sub_block(k / 32), group = (k % 32) / kDotGroup;
  return {sub + 2 * kPanel + 64 * group + kDotGroup * (c % 16) + k % kDotGroup, -1, sub + c, sub + kPanel + c};
}

DotSpot q6k_dot_spot(bool mins, int64_t k, int64_t c) {
  const int64_t pair = q6k_dot_pair(mins, k / 32), half = (k % 32) / kQ6KSubBlock, group = (k % 32) / kDotGroup;
  const int64_t quants = pair + q6k_dot_pair_scales(mins), f = k % kDotGroup;
  return {quants + q6k_dot_low(group) + kDotGroup * (c % 16) + f, quants + q6k_dot_high(group) + kDotGroup * (c % 8) + f,
          pair + half * kPanel + c, pair + 2 * kPanel + half * kPanel + c};
}

void pack_q8_0_dot_column(const uint8_t* file_block, int64_t c, uint8_t* block) {
  std::memcpy(block + 2 * c, file_block, 2);
  for (int64_t kk = 0; kk < kQ8Block; ++kk) {
    block[kQ8DotQuantsOffset + kDotGroup * kPanel * (kk / kDotGroup) + kDotGroup * c + kk % kDotGroup] = file_block[2 + kk];
  }
}

// A legacy block of 32 features (file layout: d, with kMin m, with kHigh the fifth bits qh as a
// little-endian uint32, then qs[16]: feature j < 16 in the low nibble of qs[j], j >= 16 in the high
// one of qs[j - 16]), decoded: its unsigned quants q (0..15, or 0..31).
template <bool kHigh, bool kMin>
std::array<uint8_t, kQ8Block> decode_legacy(const uint8_t* file_block) {
  constexpr int64_t kHighAt = kMin ? 4 : 2;
  std::array<uint8_t, kQ8Block> q{};
  uint32_t high = 0;
  if (kHigh) std::memcpy(&high, file_block + kHighAt, 4);
  const uint8_t* qs = file_block + kHighAt + (kHigh ? 4 : 0);
  for (int64_t j = 0; j < kQ8Block; ++j) {
    q[j] = static_cast<uint8_t>((j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4) | (((high >> j) & 1) << 4));
  }
  return q;
}

// Where a legacy dot panel block keeps feature kk of column c: its nibble's byte and (Q5_0, Q5_1)
// the byte and bit of its fifth bit.
struct LegacySpot {
  int64_t nibble, high, bit;
};

LegacySpot legacy_dot_spot(bool high, bool min, int64_t kk, int64_t c) {
  const int64_t group = kk / kDotGroup, f = kk % kDotGroup;
  return {legacy_dot_nibbles(high, min, group) + kDotGroup * (c % 16) + f,
          high ? legacy_dot_chunk(high, min, group / 2) + kDotGroup * (c % 8) + f : -1, 4 * (group % 2) + c / 8};
}

// The file blocks of a panel block's 32 columns (nullptr past the matrix's last row).
using Columns = std::array<const uint8_t*, kPanel>;

// A packing's input and output: a GGUF tensor's rows [N, K / block * file block bytes] and their
// panels [ceil(N / 32), K / block, panel block bytes], zero past row N (zero scales, zero quants).
struct Panels {
  at::Tensor rows, out;  // the rows (contiguous) and the panels, zeroed
  int64_t n, blocks, panels, row_bytes;
  const uint8_t* src;
  uint8_t* dst;
};

Panels start_panels(const at::Tensor& rows_in, int64_t file_bytes, int64_t block_bytes, const char* message,
                    at::ScalarType type) {
  TORCH_CHECK(rows_in.device().is_cpu() && rows_in.dim() == 2 && rows_in.scalar_type() == at::kByte &&
                  rows_in.size(1) % file_bytes == 0,
              message);
  Panels job;
  job.rows = rows_in.contiguous();
  job.n = job.rows.size(0), job.blocks = job.rows.size(1) / file_bytes, job.panels = (job.n + kPanel - 1) / kPanel;
  job.row_bytes = job.rows.size(1);
  job.out = at::zeros({job.panels, job.blocks, block_bytes}, job.rows.options().dtype(type));
  job.src = job.rows.data_ptr<uint8_t>();
  job.dst = static_cast<uint8_t*>(job.out.data_ptr());
  return job;
}

// The panels of a GGUF tensor's rows: `pack(columns, block)` packs one panel block from its columns'
// file blocks, the panel blocks shared out over the threads.
template <typename PackBlock>
at::Tensor pack_panel_blocks(const at::Tensor& rows, int64_t file_bytes, int64_t block_bytes, PackBlock pack,
                             const char* message, at::ScalarType type) {
  const Panels job = start_panels(rows, file_bytes, block_bytes, message, type);
  at::parallel_for(0, job.panels * job.blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = i / job.blocks, b = i % job.blocks;
      Columns columns{};
      for (int64_t c = 0; c < kPanel && p * kPanel + c < job.n; ++c) {
        columns[c] = job.src + (p * kPanel + c) * job.row_bytes + b * file_bytes;
      }
      pack(columns, job.dst + i * block_bytes);
    }
  });
  return job.out;
}

// The same, one column at a time: `column(file_block, c, block)` puts column c's file block into
// its panel block; a thread takes whole panels and reads each row front to back (for the kinds
// whose columns are plain copies: Q8_0, and the exact panels).
template <typename PackColumn>
at::Tensor pack_super_blocks(const at::Tensor& rows, int64_t file_bytes, int64_t block_bytes, PackColumn column,
                             const char* message, at::ScalarType type = at::kByte) {
  const Panels job = start_panels(rows, file_bytes, block_bytes, message, type);
  at::parallel_for(0, job.panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < kPanel && p * kPanel + c < job.n; ++c) {
        const uint8_t* row = job.src + (p * kPanel + c) * job.row_bytes;
        for (int64_t b = 0; b < job.blocks; ++b) {
          column(row + b * file_bytes, c, job.dst + (p * job.blocks + b) * block_bytes);
        }
      }
    }
  });
  return job.out;
}

at::Tensor pack_q8_0(const at::Tensor& rows) {
  return pack_super_blocks(rows, kQ8FileBlockBytes, kQ8BlockBytes, pack_q8_0_column,
                           "pack_q8_0: expected a Q8_0 tensor's rows as uint8 [N, K / 32 * 34] on the CPU");
}

at::Tensor pack_q4_k(const at::Tensor& rows) {
  return pack_super_blocks(rows, kQ4KFileBlockBytes, kQ4KBlockBytes, pack_q4_k_column,
                           "pack_q4_k: expected a Q4_K tensor's rows as uint8 [N, K / 256 * 144] on the CPU");
}

at::Tensor pack_q6_k(const at::Tensor& rows) {
  return pack_super_blocks(rows, kQ6KFileBlockBytes, kQ6KBlockBytes, pack_q6_k_column,
                           "pack_q6_k: expected a Q6_K tensor's rows as uint8 [N, K / 256 * 210] on the CPU");
}

// ---- Q4_K quantization: llama.cpp's reference (quantize_row_q4_K_ref without an importance matrix),
// line for line, so that a matrix quantized here gets the blocks llama.cpp's quantizer writes.

// Against llama.cpp 0.3.36's own Q4_K_M of the same float32 weights, 92% of blocks are byte-identical
// and the rest differ by one level of one sub-block's 6-bit scale; building this with
// -ffp-contract=fast or =off changes nothing, so FMA fusion is not the cause (not found yet).

// Round to nearest, ties to even, as llama.cpp's nearest_int does it (|x| < 2^22).
int nearest_int(float value) {
  const float shifted = value + 12582912.f;
  int32_t bits;
  std::memcpy(&bits, &shifted, 4);
  return (bits & 0x007fffff) - 0x00400000;
}

// llama.cpp's make_qkx2_quants: the scale and min (returned, and in *the_min as -min) of n values in
// levels 0..nmax, least weighted squared error over nstep + 1 trial scales.
float make_qkx2_quants(int n, int nmax, const float* x, const float* weights, uint8_t* levels, float* the_min,
                       uint8_t* trial, float rmin, float rdelta, int nstep) {
  float min = x[0], max = x[0], sum_w = weights[0], sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    min = std::min(min, x[i]);
    max = std::max(max, x[i]);
    sum_w += weights[i];
    sum_x += weights[i] * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    std::memset(levels, 0, n);
    *the_min = -min;
    return 0.f;
  }
  float iscale = nmax / (max - min), scale = 1 / iscale, best_error = 0;
  for (int i = 0; i < n; ++i) {
    levels[i] = static_cast<uint8_t>(std::max(0, std::min(nmax, nearest_int(iscale * (x[i] - min)))));
    const float diff = scale * levels[i] + min - x[i];
    best_error += weights[i] * (diff * diff);
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * is + nmax) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      const int l = std::max(0, std::min(nmax, nearest_int(iscale * (x[i] - min))));
      trial[i] = static_cast<uint8_t>(l);
      sum_l += weights[i] * l;
      sum_l2 += weights[i] * l * l;
      sum_xl += weights[i] * l * x[i];
    }
    const float det = sum_w * sum_l2 - sum_l * sum_l;
    if (det <= 0) continue;
    float this_scale = (sum_w * sum_xl - sum_x * sum_l) / det, this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
    if (this_min > 0) {
      this_min = 0;
      this_scale = sum_xl / sum_l2;
    }
    float error = 0;
    for (int i = 0; i < n; ++i) {
      const float diff = this_scale * trial[i] + this_min - x[i];
      error += weights[i] * (diff * diff);
    }
    if (error < best_error) {
      std::memcpy(levels, trial, n);
      best_error = error;
      scale = this_scale;
      min = this_min;
    }
  }
  *the_min = -min;
  return scale;
}

// One super-block of 256 values into its 144-byte Q4_K block (d, dmin, scales[12], qs[128]).
void quantize_q4_k_block(const float* x, uint8_t* out) {
  uint8_t levels[kQ4KBlock], trial[32], packed[12] = {};
  float weights[32], mins[kQ4KSubBlocks], scales[kQ4KSubBlocks], max_scale = 0, max_min = 0;
  for (int j = 0; j < kQ4KSubBlocks; ++j) {
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(x[32 * j + l]);
    scales[j] = make_qkx2_quants(32, 15, x + 32 * j, weights, levels + 32 * j, &mins[j], trial, -1.f, 0.1f, 20);
    max_scale = std::max(max_scale, scales[j]);
    max_min = std::max(max_min, mins[j]);
  }
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f, inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  for (int j = 0; j < kQ4KSubBlocks; ++j) {
    const auto ls = static_cast<uint8_t>(std::min(63, nearest_int(inv_scale * scales[j])));
    const auto lm = static_cast<uint8_t>(std::min(63, nearest_int(inv_min * mins[j])));
    if (j < 4) {
      packed[j] = ls;
      packed[j + 4] = lm;
    } else {
      packed[j + 4] = static_cast<uint8_t>((ls & 0xF) | ((lm & 0xF) << 4));
      packed[j - 4] |= static_cast<uint8_t>((ls >> 4) << 6);
      packed[j] |= static_cast<uint8_t>((lm >> 4) << 6);
    }
  }
  const uint16_t d = half_bits(max_scale / 63.f), dmin = half_bits(max_min / 63.f);
  for (int j = 0; j < kQ4KSubBlocks; ++j) {
    uint8_t sc, m;
    q4_k_scale_min(j, packed, &sc, &m);
    const float scale = static_cast<float>(c10::Half(d, c10::Half::from_bits())) * sc;
    if (scale == 0) continue;
    const float offset = static_cast<float>(c10::Half(dmin, c10::Half::from_bits())) * m;
    for (int l = 0; l < 32; ++l) {
      levels[32 * j + l] = static_cast<uint8_t>(std::max(0, std::min(15, nearest_int((x[32 * j + l] + offset) / scale))));
    }
  }
  std::memcpy(out, &d, 2);
  std::memcpy(out + 2, &dmin, 2);
  std::memcpy(out + 4, packed, 12);
  for (int j = 0; j < kQ4KBlock; j += 64) {
    for (int l = 0; l < 32; ++l) out[16 + j / 2 + l] = static_cast<uint8_t>(levels[j + l] | (levels[j + l + 32] << 4));
  }
}

// x [N, K] float32 (K a multiple of 256) -> Q4_K rows, uint8 [N, K / 256 * 144].
at::Tensor quantize_q4_k(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(1) % kQ4KBlock == 0,
              "quantize_q4_k: expected a float32 [N, K] CPU matrix with K a multiple of 256");
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.size(0), blocks = x.size(1) / kQ4KBlock;
  auto out = at::empty({n, blocks * kQ4KFileBlockBytes}, x.options().dtype(at::kByte));
  const float* src = x.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) quantize_q4_k_block(src + b * kQ4KBlock, dst + b * kQ4KFileBlockBytes);
  });
  return out;
}

// ---- dot panel blocks written whole: the 32 columns' quants decoded first (q [32][features], zero
// for missing columns), then each byte of the block written once, in order (one column at a time,
// every nibble took a read-modify-write and packing a 1B Q4_K_M model took 7 s).

// Features k0 .. k0 + 3 of the 32 columns (q: column c's at q[c * stride + k]) as 64 bytes of
// nibbles: byte 4 (c % 16) + f holds column c's feature k0 + f, columns 0-15 in the low nibble.
void put_nibbles(const uint8_t* q, int64_t stride, int64_t k0, uint8_t* out) {
  for (int64_t c = 0; c < 16; ++c) {
    const uint8_t *low = q + c * stride + k0, *high = q + (c + 16) * stride + k0;
    for (int64_t f = 0; f < kDotGroup; ++f) out[kDotGroup * c + f] = static_cast<uint8_t>((low[f] & 0xF) | (high[f] << 4));
  }
}

// Bits `shift` .. `shift` + width - 1 of features k0 .. k0 + 3 as 32 bytes: byte 4 (c % 8) + f holds
// column c's at bit width * (c / 8) + `at` (Q5's fifth bits: width 1, `at` 0 or 4 for a chunk's two
// groups; Q6_K's high pairs: width 2).
void put_bits(const uint8_t* q, int64_t stride, int64_t k0, int shift, int width, int at, uint8_t* out) {
  const int mask = (1 << width) - 1;
  for (int64_t c8 = 0; c8 < 8; ++c8) {
    for (int64_t f = 0; f < kDotGroup; ++f) {
      int byte = out[kDotGroup * c8 + f];
      for (int64_t part = 0; part < 4; ++part) byte |= ((q[(c8 + 8 * part) * stride + k0 + f] >> shift) & mask) << (width * part + at);
      out[kDotGroup * c8 + f] = static_cast<uint8_t>(byte);
    }
  }
}

template <bool kHigh, bool kMin>
void pack_legacy_dot_block(const Columns& columns, uint8_t* block) {
  uint8_t q[kPanel * kQ8Block] = {};
  for (int64_t c = 0; c < kPanel && columns[c] != nullptr; ++c) {
    std::memcpy(block + 2 * c, columns[c], 2);
    if (kMin) std::memcpy(block + 2 * kPanel + 2 * c, columns[c] + 2, 2);
    const auto decoded = decode_legacy<kHigh, kMin>(columns[c]);
    std::memcpy(q + c * kQ8Block, decoded.data(), kQ8Block);
  }
  for (int64_t g = 0; g < kQ8Block / kDotGroup; ++g) {
    if (kHigh) put_bits(q, kQ8Block, kDotGroup * g, 4, 1, 4 * (g % 2), block + legacy_dot_chunk(kHigh, kMin, g / 2));
    put_nibbles(q, kQ8Block, kDotGroup * g, block + legacy_dot_nibbles(kHigh, kMin, g));
  }
}

// An MXFP4 dot panel block (panels.h): each column's exponent byte e, then its codes (the file's
// qs[16]: code j < 16 in the low nibble of qs[j], j >= 16 in the high one of qs[j - 16]) as nibbles.
void pack_mxfp4_dot_block(const Columns& columns, uint8_t* block) {
  uint8_t q[kPanel * kQ8Block] = {};
  for (int64_t c = 0; c < kPanel && columns[c] != nullptr; ++c) {
    block[c] = columns[c][0];
    const uint8_t* qs = columns[c] + 1;
    for (int64_t j = 0; j < kQ8Block; ++j) q[c * kQ8Block + j] = j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4;
  }
  for (int64_t g = 0; g < kQ8Block / kDotGroup; ++g) put_nibbles(q, kQ8Block, kDotGroup * g, block + mxfp4_dot_nibbles(g));
}

// A Q4_K or (kFifth) Q5_K dot panel block (panels.h: Q5_K's sub-blocks hold their quants in chunks
// of fifth bits and nibbles).
template <bool kFifth>
void pack_q4_k_dot_block(const Columns& columns, uint8_t* block) {
  constexpr auto sub_block = [](int64_t s) { return kFifth ? q5k_dot_sub_block(s) : q4k_dot_sub_block(s); };
  uint8_t q[kPanel * kQ4KBlock] = {};
  for (int64_t c = 0; c < kPanel && columns[c] != nullptr; ++c) {
    const KBlock b = kFifth ? decode_q5_k(columns[c]) : decode_q4_k(columns[c]);
    std::memcpy(block + 2 * c, &b.d, 2);
    std::memcpy(block + 2 * kPanel + 2 * c, &b.dmin, 2);
    for (int64_t s = 0; s < kQ4KSubBlocks; ++s) {
      block[sub_block(s) + c] = static_cast<uint8_t>(b.sc[2 * s]);
      block[sub_block(s) + kPanel + c] = static_cast<uint8_t>(b.m[2 * s]);
    }
    std::memcpy(q + c * kQ4KBlock, b.q, kQ4KBlock);
  }
  for (int64_t s = 0; s < kQ4KSubBlocks; ++s) {
    uint8_t* sub = block + sub_block(s);
    for (int64_t g = 0; g < 32 / kDotGroup; ++g) {
      if (kFifth) put_bits(q, kQ4KBlock, 32 * s + kDotGroup * g, 4, 1, 4 * (g % 2), sub + q5k_dot_fifth(g));
      put_nibbles(q, kQ4KBlock, 32 * s + kDotGroup * g, sub + (kFifth ? q5k_dot_nibbles(g) : 2 * kPanel + 64 * g));
    }
  }
}

// A Q6_K dot panel block (kMins: with dmin and mins, from either kind's decoded super-block).
template <bool kMins, KBlock (*kDecode)(const uint8_t*)>
void pack_q6_k_dot_block(const Columns& columns, uint8_t* block) {
  uint8_t q[kPanel * kQ6KBlock] = {};
  for (int64_t c = 0; c < kPanel && columns[c] != nullptr; ++c) {
    const KBlock b = kDecode(columns[c]);
    TORCH_CHECK(!kMins || std::isfinite(static_cast<float>(c10::Half(b.dmin, c10::Half::from_bits()))),
                "pack_dot: a Q6_K scale d above 2047 cannot go into the layout with mins (32 d is its float16 dmin)");
    std::memcpy(block + 2 * c, &b.d, 2);
    if (kMins) std::memcpy(block + 2 * kPanel + 2 * c, &b.dmin, 2);
    for (int64_t s = 0; s < kQ6KSubBlocks; ++s) {
      const int64_t at = q6k_dot_pair(kMins, s / 2) + (s % 2) * kPanel + c;
      block[at] = static_cast<uint8_t>(b.sc[s]);
      if (kMins) block[at + 2 * kPanel] = static_cast<uint8_t>(b.m[s]);
    }
    std::memcpy(q + c * kQ6KBlock, b.q, kQ6KBlock);
  }
  for (int64_t p = 0; p < kQ6KSubBlocks / 2; ++p) {
    uint8_t* quants = block + q6k_dot_pair(kMins, p) + q6k_dot_pair_scales(kMins);
    for (int64_t g = 0; g < 32 / kDotGroup; ++g) {
      put_nibbles(q, kQ6KBlock, 32 * p + kDotGroup * g, quants + q6k_dot_low(g));
      put_bits(q, kQ6KBlock, 32 * p + kDotGroup * g, 4, 2, 0, quants + q6k_dot_high(g));
    }
  }
}

// A Q3_K or (kMins) Q2_K dot panel block (panels.h: the Q6_K layout's order, 2-bit planes and, with
// kThird, a plane of third bits).
template <bool kThird, bool kMins, KBlock (*kDecode)(const uint8_t*)>
void pack_low_k_dot_block(const Columns& columns, uint8_t* block) {
  uint8_t q[kPanel * kQ6KBlock] = {};
  for (int64_t c = 0; c < kPanel && columns[c] != nullptr; ++c) {
    const KBlock b = kDecode(columns[c]);
    std::memcpy(block + 2 * c, &b.d, 2);
    if (kMins) std::memcpy(block + 2 * kPanel + 2 * c, &b.dmin, 2);
    for (int64_t s = 0; s < kQ6KSubBlocks; ++s) {
      const int64_t at = low_k_pair(kThird, kMins, s / 2) + (s % 2) * kPanel + c;
      block[at] = static_cast<uint8_t>(b.sc[s]);
      if (kMins) block[at + 2 * kPanel] = static_cast<uint8_t>(b.m[s]);
    }
    std::memcpy(q + c * kQ6KBlock, b.q, kQ6KBlock);
  }
  for (int64_t p = 0; p < kQ6KSubBlocks / 2; ++p) {
    uint8_t* quants = block + low_k_pair(kThird, kMins, p) + q6k_dot_pair_scales(kMins);
    for (int64_t g = 0; g < 32 / kDotGroup; ++g) {
      uint8_t* chunk = quants + low_k_chunk(kThird) * (g / 2);
      put_bits(q, kQ6KBlock, 32 * p + kDotGroup * g, 0, 2, 0, chunk + 32 * (g % 2));
      if (kThird) put_bits(q, kQ6KBlock, 32 * p + kDotGroup * g, 2, 1, 4 * (g % 2), chunk + 64);
    }
  }
}

// GGUF rows of `kind` ("q8_0", "q4_0", "q5_0", "q4_1", "q5_1", "q2_k", "q4_k", "q5_k", "q6_k", "mxfp4") into dot panels
// (int8; panels.h); with `mins` (Q2_K, Q4_K, Q5_K or Q6_K) the Q6_K layout with mins, which holds them all (a
// fusion that mixes them). Q3_K (without mins), Q2_K and Q5_K have layouts of their own.
at::Tensor pack_dot(const at::Tensor& rows, c10::string_view kind, bool mins) {
  const char* message = "pack_dot: expected a GGUF tensor's rows of its kind as uint8 [N, K / block * block bytes]";
  if (kind == "q8_0" && !mins) {
    return pack_super_blocks(rows, kQ8FileBlockBytes, kQ8DotBlockBytes, pack_q8_0_dot_column, message, at::kChar);
  }
  if (kind == "q4_0" && !mins) {
    return pack_panel_blocks(rows, kQ4_0FileBlockBytes, kQ4_0DotBlockBytes, pack_legacy_dot_block<false, false>, message,
                             at::kChar);
  }
  if (kind == "q5_0" && !mins) {
    return pack_panel_blocks(rows, kQ5_0FileBlockBytes, kQ5_0DotBlockBytes, pack_legacy_dot_block<true, false>, message,
                             at::kChar);
  }
  if (kind == "q4_1" && !mins) {
    return pack_panel_blocks(rows, kQ4_1FileBlockBytes, kQ4_1DotBlockBytes, pack_legacy_dot_block<false, true>, message,
                             at::kChar);
  }
  if (kind == "q5_1" && !mins) {
    return pack_panel_blocks(rows, kQ5_1FileBlockBytes, kQ5_1DotBlockBytes, pack_legacy_dot_block<true, true>, message,
                             at::kChar);
  }
  if (kind == "mxfp4" && !mins) {
    return pack_panel_blocks(rows, kMxfp4FileBlockBytes, kMxfp4DotBlockBytes, pack_mxfp4_dot_block, message, at::kChar);
  }
  if (kind == "q4_k" && !mins) {
    return pack_panel_blocks(rows, kQ4KFileBlockBytes, kQ4KDotBlockBytes, pack_q4_k_dot_block<false>, message, at::kChar);
  }
  if (kind == "q5_k" && !mins) {
    return pack_panel_blocks(rows, kQ5KFileBlockBytes, kQ5KDotBlockBytes, pack_q4_k_dot_block<true>, message, at::kChar);
  }
  if (kind == "q5_k") {  // in a fusion: the Q6_K layout with mins, which holds it exactly
    return pack_panel_blocks(rows, kQ5KFileBlockBytes, kQ6KDotBlockBytes(true), pack_q6_k_dot_block<true, decode_q5_k>,
                             message, at::kChar);
  }
  if (kind == "q2_k" && !mins) {
    return pack_panel_blocks(rows, kQ2KFileBlockBytes, kQ2KDotBlockBytes, pack_low_k_dot_block<false, true, decode_q2_k>,
                             message, at::kChar);
  }
  if (kind == "q2_k") {
    return pack_panel_blocks(rows, kQ2KFileBlockBytes, kQ6KDotBlockBytes(true), pack_q6_k_dot_block<true, decode_q2_k>,
                             message, at::kChar);
  }
  if (kind == "q3_k" && !mins) {
    return pack_panel_blocks(rows, kQ3KFileBlockBytes, kQ3KDotBlockBytes, pack_low_k_dot_block<true, false, decode_q3_k>,
                             message, at::kChar);
  }
  if (kind == "q4_k") {
    return pack_panel_blocks(rows, kQ4KFileBlockBytes, kQ6KDotBlockBytes(true), pack_q6_k_dot_block<true, decode_q4_k>,
                             message, at::kChar);
  }
  TORCH_CHECK(kind == "q6_k", "pack_dot: kind must be q8_0, q4_0, q5_0, q4_1, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k or mxfp4 (mins: q2_k, q4_k, q5_k or q6_k), not ", kind);
  if (mins) {
    return pack_panel_blocks(rows, kQ6KFileBlockBytes, kQ6KDotBlockBytes(true), pack_q6_k_dot_block<true, decode_q6_k>,
                             message, at::kChar);
  }
  return pack_panel_blocks(rows, kQ6KFileBlockBytes, kQ6KDotBlockBytes(false), pack_q6_k_dot_block<false, decode_q6_k>,
                           message, at::kChar);
}

}  // namespace

namespace {

// Rows `ids` of a quantized matrix, dequantized, from its panels of `block_bytes` per block of
// `block` features: weight(block, column, feature in block) forms one weight as the kernels do.
template <typename Weight>
void gather_rows(const uint8_t* panels, int64_t k, const int64_t* ids, int64_t tokens, float* out, int64_t block,
                 int64_t block_bytes, Weight weight) {
  const int64_t blocks = k / block;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t c = ids[t] % kPanel;
    const uint8_t* panel = panels + (ids[t] / kPanel) * blocks * block_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t kk = 0; kk < block; ++kk) out[t * k + b * block + kk] = weight(panel + b * block_bytes, c, kk);
    }
  }
}

float half_at(const uint8_t* p) {  // a float16 stored at p
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

}  // namespace

void gather_q6_k_rows(const uint8_t* panels, int64_t k, const int64_t* ids, int64_t tokens, float* out) {
  gather_rows(panels, k, ids, tokens, out, kQ6KBlock, kQ6KBlockBytes, [](const uint8_t* block, int64_t c, int64_t kk) {
    const auto sc = static_cast<int8_t>(block[kQ6KScalesOffset + (kk / kQ6KSubBlock) * kPanel + c]);
    const auto q = static_cast<int8_t>(block[kQ6KQuantsOffset + kk * kPanel + c]);
    return half_at(block + 2 * c) * static_cast<float>(sc) * static_cast<float>(q);  // (d * sc) * q
  });
}

void gather_q8_0_rows(const uint8_t* panels, int64_t k, const int64_t* ids, int64_t tokens, float* out) {
  gather_rows(panels, k, ids, tokens, out, kQ8Block, kQ8BlockBytes, [](const uint8_t* block, int64_t c, int64_t kk) {
    return half_at(block + 2 * c) * static_cast<float>(static_cast<int8_t>(block[2 * kPanel + kk * kPanel + c]));
  });
}

namespace {

// One weight of a k-quant dot panel block: (d * sc) * q - dmin * m, as the dequantization rounds it.
template <bool kQ4K, bool kMins>
float k_dot_weight(const uint8_t* block, int64_t c, int64_t kk) {
  const DotSpot at = kQ4K ? q4k_dot_spot(kk, c) : q6k_dot_spot(kMins, kk, c);
  const uint8_t byte = block[at.nibble];
  int q = c < 16 ? byte & 0xF : byte >> 4;
  if (!kQ4K) q |= ((block[at.high] >> (2 * (c / 8))) & 3) << 4;
  const float sc = kQ4K ? static_cast<float>(block[at.scale]) : static_cast<float>(static_cast<int8_t>(block[at.scale]));
  const float d = half_at(block + 2 * c);
  if (!kQ4K && !kMins) return d * sc * static_cast<float>(q - 32);
  const float m = kQ4K ? static_cast<float>(block[at.min]) : static_cast<float>(static_cast<int8_t>(block[at.min]));
  return d * sc * static_cast<float>(q) - half_at(block + 2 * kPanel + 2 * c) * m;
}

// One weight of a Q3_K (kThird) or Q2_K (kMins) dot panel block: (d * sc) * (q - 4) or (d * sc) * q - dmin * m.
template <bool kThird, bool kMins>
float low_k_dot_weight(const uint8_t* block, int64_t c, int64_t kk) {
  const int64_t pair = low_k_pair(kThird, kMins, kk / 32), g = (kk % 32) / kDotGroup, at = kDotGroup * (c % 8) + kk % kDotGroup;
  const uint8_t* chunk = block + pair + q6k_dot_pair_scales(kMins) + low_k_chunk(kThird) * (g / 2);
  int q = (chunk[32 * (g % 2) + at] >> (2 * (c / 8))) & 3;
  if (kThird) q |= ((chunk[64 + at] >> (4 * (g % 2) + c / 8)) & 1) << 2;
  const int64_t scale = pair + ((kk % 32) / kQ6KSubBlock) * kPanel + c;
  const float d = half_at(block + 2 * c), sc = static_cast<float>(static_cast<int8_t>(block[scale]));
  if (!kMins) return d * sc * static_cast<float>(q - 4);
  return d * sc * static_cast<float>(q) - half_at(block + 2 * kPanel + 2 * c) * static_cast<float>(static_cast<int8_t>(block[scale + 2 * kPanel]));
}

// One weight of a legacy dot panel block: d * (q - 8), d * (q - 16) or (kMin) d * q + m.
template <bool kHigh, bool kMin>
float legacy_dot_weight(const uint8_t* block, int64_t c, int64_t kk) {
  const LegacySpot at = legacy_dot_spot(kHigh, kMin, kk, c);
  int q = c < 16 ? block[at.nibble] & 0xF : block[at.nibble] >> 4;
  if (kHigh) q |= ((block[at.high] >> at.bit) & 1) << 4;
  if (kMin) return half_at(block + 2 * c) * static_cast<float>(q) + half_at(block + 2 * kPanel + 2 * c);
  return half_at(block + 2 * c) * static_cast<float>(q - (kHigh ? 16 : 8));
}

}  // namespace

void gather_dot_rows(const int8_t* panels_in, int64_t block_bytes, int64_t k, const int64_t* ids, int64_t tokens,
                     float* out) {
  const auto* panels = reinterpret_cast<const uint8_t*>(panels_in);
  if (block_bytes == kIq4NlDotBlockBytes || block_bytes == kIq4XsDotBlockBytes) {  // Q4_0's blocks, looked up
    gather_rows(panels, k, ids, tokens, out, kQ8Block, kQ4_0DotBlockBytes, [](const uint8_t* block, int64_t c, int64_t kk) {
      const LegacySpot at = legacy_dot_spot(false, false, kk, c);
      const int q = c < 16 ? block[at.nibble] & 0xF : block[at.nibble] >> 4;
      return half_at(block + 2 * c) * static_cast<float>(kIq4Levels[q]);
    });
  } else if (block_bytes == kMxfp4DotBlockBytes) {
    gather_rows(panels, k, ids, tokens, out, kQ8Block, block_bytes, [](const uint8_t* block, int64_t c, int64_t kk) {
      const uint8_t byte = block[mxfp4_dot_nibbles(kk / kDotGroup) + kDotGroup * (c % 16) + kk % kDotGroup];
      const int e = block[c];  // 2^(e - 128), as llama.cpp's GGML_E8M0_TO_FP32_HALF
      return std::ldexp(static_cast<float>(kMxfp4Levels[c < 16 ? byte & 0xF : byte >> 4]), e - 128);
    });
  } else if (block_bytes == kQ8DotBlockBytes) {
    gather_rows(panels, k, ids, tokens, out, kQ8Block, block_bytes, [](const uint8_t* block, int64_t c, int64_t kk) {
      const auto q = static_cast<int8_t>(block[kQ8DotQuantsOffset + kDotGroup * kPanel * (kk / kDotGroup) + kDotGroup * c + kk % kDotGroup]);
      return half_at(block + 2 * c) * static_cast<float>(q);
    });
  } else if (block_bytes == kQ4_0DotBlockBytes) {
    gather_rows(panels, k, ids, tokens, out, kQ8Block, block_bytes, legacy_dot_weight<false, false>);
  } else if (block_bytes == kQ5_0DotBlockBytes) {
    gather_rows(panels, k, ids, tokens, out, kQ8Block, block_bytes, legacy_dot_weight<true, false>);
  } else if (block_bytes == kQ4_1DotBlockBytes) {
    gather_rows(panels, k, ids, tokens, out, kQ8Block, block_bytes, legacy_dot_weight<false, true>);
  } else if (block_bytes == kQ5_1DotBlockBytes) {
    gather_rows(panels, k, ids, tokens, out, kQ8Block, block_bytes, legacy_dot_weight<true, true>);
  } else if (block_bytes == kQ4KDotBlockBytes) {
    gather_rows(panels, k, ids, tokens, out, kQ4KBlock, block_bytes, k_dot_weight<true, false>);
  } else if (block_bytes == kQ5KDotBlockBytes) {
    gather_rows(panels, k, ids, tokens, out, kQ4KBlock, block_bytes, [](const uint8_t* block, int64_t c, int64_t kk) {
      const uint8_t* sub = block + q5k_dot_sub_block(kk / 32);
      const int64_t g = (kk % 32) / kDotGroup, f = kk % kDotGroup;
      const uint8_t byte = sub[q5k_dot_nibbles(g) + kDotGroup * (c % 16) + f];
      const int q = (c < 16 ? byte & 0xF : byte >> 4) | ((sub[q5k_dot_fifth(g) + kDotGroup * (c % 8) + f] >> (4 * (g % 2) + c / 8)) & 1) << 4;
      const float d = half_at(block + 2 * c), sc = static_cast<float>(sub[c]), m = static_cast<float>(sub[kPanel + c]);
      return d * sc * static_cast<float>(q) - half_at(block + 2 * kPanel + 2 * c) * m;
    });
  } else if (block_bytes == kQ3KDotBlockBytes) {
    gather_rows(panels, k, ids, tokens, out, kQ4KBlock, block_bytes, low_k_dot_weight<true, false>);
  } else if (block_bytes == kQ2KDotBlockBytes) {
    gather_rows(panels, k, ids, tokens, out, kQ4KBlock, block_bytes, low_k_dot_weight<false, true>);
  } else if (block_bytes == kQ6KDotBlockBytes(false)) {
    gather_rows(panels, k, ids, tokens, out, kQ4KBlock, block_bytes, k_dot_weight<false, false>);
  } else {
    gather_rows(panels, k, ids, tokens, out, kQ4KBlock, block_bytes, k_dot_weight<false, true>);
  }
}

}  // namespace weft

TORCH_LIBRARY_FRAGMENT(weft, m) {
  m.def("pack_q8_0(Tensor rows) -> Tensor");
  m.def("pack_q4_k(Tensor rows) -> Tensor");
  m.def("pack_q6_k(Tensor rows) -> Tensor");
  m.def("pack_dot(Tensor rows, str kind, bool mins=False) -> Tensor");
  m.def("quantize_q4_k(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(weft, CPU, m) {
  m.impl("pack_q8_0", &weft::pack_q8_0);
  m.impl("pack_q4_k", &weft::pack_q4_k);
  m.impl("pack_q6_k", &weft::pack_q6_k);
  m.impl("pack_dot", &weft::pack_dot);
  m.impl("quantize_q4_k", &weft::quantize_q4_k);
}
