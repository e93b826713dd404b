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

TORCH_LIBRARY_FRAGMENT(weft, m) { m.def("pack_q8_0(Tensor rows) -> Tensor"); }

TORCH_LIBRARY_IMPL(weft, CPU, m) { m.impl("pack_q8_0", &weft::pack_q8_0); }
