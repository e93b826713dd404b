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

// GGUF Q8_0 rows [N, K / 32 * 34] (per block: a float16 scale, then 32 int8 quants) -> panels
// [ceil(N / 32), K / 32, 1,088], zero past row N (a zero scale and zero quants).
at::Tensor pack_q8_0(const at::Tensor& rows_in) {
  TORCH_CHECK(rows_in.device().is_cpu() && rows_in.dim() == 2 && rows_in.scalar_type() == at::kByte &&
                  rows_in.size(1) % kQ8FileBlockBytes == 0,
              "pack_q8_0: expected a Q8_0 tensor's rows as uint8 [N, K / 32 * 34] on the CPU");
  const at::Tensor rows = rows_in.contiguous();
  const int64_t n = rows.size(0), blocks = rows.size(1) / kQ8FileBlockBytes, panels = (n + kPanel - 1) / kPanel;
  auto out = at::zeros({panels, blocks, kQ8BlockBytes}, rows.options());
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c) {
        const uint8_t* row = src + (p * kPanel + c) * rows.size(1);
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* file_block = row + b * kQ8FileBlockBytes;
          uint8_t* block = dst + (p * blocks + b) * kQ8BlockBytes;
          std::memcpy(block + 2 * c, file_block, 2);
          for (int64_t kk = 0; kk < kQ8Block; ++kk) block[2 * kPanel + kk * kPanel + c] = file_block[2 + kk];
        }
      }
    }
  });
  return out;
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

// GGUF Q4_K rows [N, K / 256 * 144] -> panels [ceil(N / 32), K / 256, 4,736], zero past row N.
at::Tensor pack_q4_k(const at::Tensor& rows_in) {
  TORCH_CHECK(rows_in.device().is_cpu() && rows_in.dim() == 2 && rows_in.scalar_type() == at::kByte &&
                  rows_in.size(1) % kQ4KFileBlockBytes == 0,
              "pack_q4_k: expected a Q4_K tensor's rows as uint8 [N, K / 256 * 144] on the CPU");
  const at::Tensor rows = rows_in.contiguous();
  const int64_t n = rows.size(0), blocks = rows.size(1) / kQ4KFileBlockBytes, panels = (n + kPanel - 1) / kPanel;
  auto out = at::zeros({panels, blocks, kQ4KBlockBytes}, rows.options());
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c) {
        const uint8_t* row = src + (p * kPanel + c) * rows.size(1);
        for (int64_t b = 0; b < blocks; ++b) {
          pack_q4_k_column(row + b * kQ4KFileBlockBytes, c, dst + (p * blocks + b) * kQ4KBlockBytes);
        }
      }
    }
  });
  return out;
}

}  // namespace

void gather_q8_0_rows(const uint8_t* panels, int64_t k, const int64_t* ids, int64_t tokens, float* out) {
  const int64_t blocks = k / kQ8Block;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t c = ids[t] % kPanel;
    const uint8_t* panel = panels + (ids[t] / kPanel) * blocks * kQ8BlockBytes;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = panel + b * kQ8BlockBytes;
      uint16_t bits;
      std::memcpy(&bits, block + 2 * c, 2);
      const float scale = static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
      for (int64_t kk = 0; kk < kQ8Block; ++kk) {
        out[t * k + b * kQ8Block + kk] = scale * static_cast<float>(static_cast<int8_t>(block[2 * kPanel + kk * kPanel + c]));
      }
    }
  }
}

}  // namespace weft

TORCH_LIBRARY_FRAGMENT(weft, m) {
  m.def("pack_q8_0(Tensor rows) -> Tensor");
  m.def("pack_q4_k(Tensor rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(weft, CPU, m) {
  m.impl("pack_q8_0", &weft::pack_q8_0);
  m.impl("pack_q4_k", &weft::pack_q4_k);
}
