// Quantized weights in weft's panel layout (panels.h): packing a GGUF tensor's blocks into panels
// once at load, and reading rows of them back (the token embeddings of a tied, quantized table).
// The products themselves are linear.cpp's tile kernels.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

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

// One column's super-block (file layout: d, dmin, scales[12], qs[128]) into its panel block.
void pack_q4_k_column(const uint8_t* file_block, int64_t c, uint8_t* block) {
  std::memcpy(block + 2 * c, file_block, 2);                 // d
  std::memcpy(block + 2 * kPanel + 2 * c, file_block + 2, 2);  // dmin
  for (int j = 0; j < kQ4KSubBlocks; ++j) {
    q4_k_scale_min(j, file_block + 4, block + kQ4KScalesOffset + j * kPanel + c, block + kQ4KMinsOffset + j * kPanel + c);
  }
  const uint8_t* qs = file_block + 16;
  uint8_t* quants = block + kQ4KQuantsOffset;
  for (int64_t k = 0; k < kQ4KBlock; ++k) {  // feature k: 64 per pair of sub-blocks, low nibbles first
    const uint8_t byte = qs[32 * (k / 64) + k % 32];
    const uint8_t q = k % 64 < 32 ? byte & 0xF : byte >> 4;
    uint8_t& dst = quants[k * (kPanel / 2) + c % 16];
    dst = c < 16 ? static_cast<uint8_t>((dst & 0xF0) | q) : static_cast<uint8_t>((dst & 0x0F) | (q << 4));
  }
}

// One column's Q6_K super-block (file layout: ql[128], qh[64], scales[16], d) into its panel block.
void pack_q6_k_column(const uint8_t* file_block, int64_t c, uint8_t* block) {
  const uint8_t *ql = file_block, *qh = file_block + 128;
  const auto* scales = reinterpret_cast<const int8_t*>(file_block + 192);
  std::memcpy(block + 2 * c, file_block + 208, 2);  // d
  for (int64_t s = 0; s < kQ6KBlock / kQ6KSubBlock; ++s) block[kQ6KScalesOffset + s * kPanel + c] = scales[s];
  auto* quants = reinterpret_cast<int8_t*>(block + kQ6KQuantsOffset);
  for (int64_t half = 0; half < 2; ++half) {  // llama.cpp's dequantize_row_q6_K, 128 features at a time
    for (int64_t l = 0; l < 32; ++l) {
      const uint8_t *lo = ql + 64 * half, *hi = qh + 32 * half;
      const int64_t k = 128 * half + l;
      quants[(k + 0) * kPanel + c] = static_cast<int8_t>(((lo[l] & 0xF) | (((hi[l] >> 0) & 3) << 4)) - 32);
      quants[(k + 32) * kPanel + c] = static_cast<int8_t>(((lo[l + 32] & 0xF) | (((hi[l] >> 2) & 3) << 4)) - 32);
      quants[(k + 64) * kPanel + c] = static_cast<int8_t>(((lo[l] >> 4) | (((hi[l] >> 4) & 3) << 4)) - 32);
      quants[(k + 96) * kPanel + c] = static_cast<int8_t>(((lo[l + 32] >> 4) | (((hi[l] >> 6) & 3) << 4)) - 32);
    }
  }
}

// The panels of a GGUF tensor's rows [N, K / block * file block bytes]: [ceil(N / 32), K / block,
// panel block bytes], zero past row N (zero scales, zero quants); `column` packs one column's block.
template <typename PackColumn>
at::Tensor pack_super_blocks(const at::Tensor& rows_in, int64_t file_bytes, int64_t block_bytes, PackColumn column,
                             const char* message) {
  TORCH_CHECK(rows_in.device().is_cpu() && rows_in.dim() == 2 && rows_in.scalar_type() == at::kByte &&
                  rows_in.size(1) % file_bytes == 0,
              message);
  const at::Tensor rows = rows_in.contiguous();
  const int64_t n = rows.size(0), blocks = rows.size(1) / file_bytes, panels = (n + kPanel - 1) / kPanel;
  auto out = at::zeros({panels, blocks, block_bytes}, rows.options());
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c) {
        const uint8_t* row = src + (p * kPanel + c) * rows.size(1);
        for (int64_t b = 0; b < blocks; ++b) column(row + b * file_bytes, c, dst + (p * blocks + b) * block_bytes);
      }
    }
  });
  return out;
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

}  // namespace weft

TORCH_LIBRARY_FRAGMENT(weft, m) {
  m.def("pack_q8_0(Tensor rows) -> Tensor");
  m.def("pack_q4_k(Tensor rows) -> Tensor");
  m.def("pack_q6_k(Tensor rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(weft, CPU, m) {
  m.impl("pack_q8_0", &weft::pack_q8_0);
  m.impl("pack_q4_k", &weft::pack_q4_k);
  m.impl("pack_q6_k", &weft::pack_q6_k);
}
