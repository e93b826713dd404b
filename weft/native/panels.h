// The panel layouts that weft's linear kernels (linear.cpp) read and the packing and lookups of the
// quantized ones (quant.cpp): sizes shared by both files.
#pragma once

#include <cstdint>

namespace weft {

constexpr int64_t kPanel = 32;  // output columns per panel

// Q8_0 (GGUF's 8-bit type): blocks of 32 input features, each a float16 scale and 32 int8 quants. A
// Q8_0 panel holds, per block, its 32 columns' scales (64 bytes), then the quants [32 features][32
// columns] (1,024 bytes): 8.5 bits per weight, as in the file, and every block 64-byte aligned.
constexpr int64_t kQ8Block = 32;                                  // input features per block
constexpr int64_t kQ8BlockBytes = 2 * kPanel + kQ8Block * kPanel;  // 1,088: 17 cache lines
constexpr int64_t kQ8FileBlockBytes = 2 + kQ8Block;               // one block of one row in the file

// Rows `ids` of a Q8_0 matrix, dequantized to float32 [T, K], from its panels [P, K / 32, 1,088].
void gather_q8_0_rows(const uint8_t* panels, int64_t k, const int64_t* ids, int64_t tokens, float* out);

}  // namespace weft
