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

// Q4_K (GGUF's 4-bit k-quant): super-blocks of 256 input features, each a float16 scale d and min
// dmin and, for its 8 sub-blocks of 32, 6-bit scales sc and mins m; a weight is d * sc * q - dmin * m
// with q in 0..15. A Q4_K panel holds, per super-block, the 32 columns' d and dmin (float16, 64 bytes
// each), their sub-block scales and mins ([8][32] bytes each), then the quants [256 features][16
// bytes], byte b of a feature holding column b in its low nibble and column b + 16 in its high one:
// 4.6 bits per weight (the file: 4.5), every super-block 64-byte aligned.
constexpr int64_t kQ4KBlock = 256;
constexpr int64_t kQ4KSubBlocks = 8;
constexpr int64_t kQ4KScalesOffset = 4 * kPanel;                             // after d and dmin
constexpr int64_t kQ4KMinsOffset = kQ4KScalesOffset + kQ4KSubBlocks * kPanel;
constexpr int64_t kQ4KQuantsOffset = kQ4KMinsOffset + kQ4KSubBlocks * kPanel;  // 640
constexpr int64_t kQ4KBlockBytes = kQ4KQuantsOffset + kQ4KBlock * kPanel / 2;  // 4,736: 74 cache lines
constexpr int64_t kQ4KFileBlockBytes = 144;

// Q6_K (GGUF's 6-bit k-quant): super-blocks of 256 input features, each a float16 scale d and, for
// its 16 sub-blocks of 16, int8 scales sc; a weight is d * sc * q with q in -32..31. A Q6_K panel
// holds, per super-block, the 32 columns' d (float16, 64 bytes), their sub-block scales ([16][32]
// int8) and the quants as int8 [256 features][32 columns]: 8.6 bits per weight (the file: 6.6; the
// 6-bit packing is left for later), every super-block 64-byte aligned.
constexpr int64_t kQ6KBlock = 256;
constexpr int64_t kQ6KSubBlock = 16;
constexpr int64_t kQ6KScalesOffset = 2 * kPanel;
constexpr int64_t kQ6KQuantsOffset = kQ6KScalesOffset + kQ6KBlock / kQ6KSubBlock * kPanel;  // 576
constexpr int64_t kQ6KBlockBytes = kQ6KQuantsOffset + kQ6KBlock * kPanel;                   // 8,768
constexpr int64_t kQ6KFileBlockBytes = 210;

// Rows `ids` of a Q8_0 matrix, dequantized to float32 [T, K], from its panels [P, K / 32, 1,088].
void gather_q8_0_rows(const uint8_t* panels, int64_t k, const int64_t* ids, int64_t tokens, float* out);
// The same for a Q6_K matrix's panels [P, K / 256, 8,768].
void gather_q6_k_rows(const uint8_t* panels, int64_t k, const int64_t* ids, int64_t tokens, float* out);

}  // namespace weft
