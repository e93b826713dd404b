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

// Q5_K (GGUF's 5-bit k-quant): super-blocks of 256 as Q4_K's (d, dmin, 6-bit scales and mins per
// sub-block of 32) with a fifth bit per quant (q 0..31). Dot panels of its own (Q4_K's with a plane
// of fifth bits, below: 5.6 bits a weight, the file 5.5), and in a fusion with other k-quants the
// Q6_K layout with mins (7.1 bits); no exact panels.
constexpr int64_t kQ5KFileBlockBytes = 176;

// Q2_K (GGUF's 2-bit k-quant): super-blocks of 256 with d and dmin, a 4-bit scale and min per
// sub-block of 16 and q 0..3. Dot panels of its own (below), and in a fusion with other k-quants the
// Q6_K layout with mins, which holds it exactly (7.1 bits a weight; the file: 2.6); no exact panels.
constexpr int64_t kQ2KFileBlockBytes = 84;
constexpr int64_t kQ3KFileBlockBytes = 110;  // Q3_K: hmask[32], qs[64], scales[12], d

// Dot panels (int8 tensors; qdot.cpp multiplies them by activations quantized to int8): the same
// blocks laid out for byte dot products (vpdpbusd, or vpmaddubsw + vpmaddwd), each 32-bit lane one
// column and its 4 consecutive input features. Features go in groups of 4; a group's quants are
// [32 columns][4 features] of one byte (Q8_0) or, for 4-bit quants, 64 bytes whose byte 4c + f holds
// column c in its low nibble and column c + 16 in its high one. Every block is in the order the
// kernel reads it, each sub-block's scales just before its quants: read out of order (the scales
// after the quants) the blocks streamed from memory at half the rate (11 against 26 GB/s on one Zen
// 4 core). All blocks stay 64-byte aligned.
constexpr int64_t kDotGroup = 4;  // input features per byte dot product

// Q8_0: per block of 32 features, the 32 columns' float16 d, then 8 groups of [32][4] int8.
constexpr int64_t kQ8DotBlockBytes = 2 * kPanel + kQ8Block * kPanel;  // 1,088
constexpr int64_t kQ8DotQuantsOffset = 2 * kPanel;


// Q4_0, Q5_0, Q4_1 and Q5_1 (GGUF's legacy 4- and 5-bit types): per block of 32 features, the 32
// columns' float16 d (and for Q4_1 / Q5_1, `min`, their float16 m), then 4 chunks of two groups:
// (Q5_0, Q5_1: `high`) the two groups' fifth bits in 32 bytes, byte 4 (c % 8) + f holding column c's
// bit at bit c / 8 for the first group and at bit 4 + c / 8 for the second, then the two groups' low
// 4 bits as nibbles (2 x 64 bytes). A weight is d * (q - 8) or d * (q - 16), or d * q + m: 4.5, 5.5,
// 5 and 6 bits a weight, as in the file.
constexpr int64_t kQ4_0DotChunkBytes = 2 * 64;
constexpr int64_t kQ5_0DotChunkBytes = 32 + 2 * 64;
constexpr int64_t legacy_dot_header(bool min) { return 2 * kPanel * (min ? 2 : 1); }
constexpr int64_t legacy_dot_chunk(bool high, bool min, int64_t h) {
  return legacy_dot_header(min) + h * (high ? kQ5_0DotChunkBytes : kQ4_0DotChunkBytes);
}
constexpr int64_t legacy_dot_nibbles(bool high, bool min, int64_t g) {
  return legacy_dot_chunk(high, min, g / 2) + (high ? 32 : 0) + 64 * (g % 2);
}
constexpr int64_t legacy_dot_block_bytes(bool high, bool min) { return legacy_dot_chunk(high, min, 4); }
constexpr int64_t kQ4_0DotBlockBytes = legacy_dot_block_bytes(false, false);  // 576
constexpr int64_t kQ5_0DotBlockBytes = legacy_dot_block_bytes(true, false);   // 704
constexpr int64_t kQ4_1DotBlockBytes = legacy_dot_block_bytes(false, true);   // 640
constexpr int64_t kQ5_1DotBlockBytes = legacy_dot_block_bytes(true, true);    // 768
constexpr int64_t kQ4_0FileBlockBytes = 18;  // d, qs[16]
constexpr int64_t kQ5_0FileBlockBytes = 22;  // d, qh[4], qs[16]
constexpr int64_t kQ4_1FileBlockBytes = 20;  // d, m, qs[16]
constexpr int64_t kQ5_1FileBlockBytes = 24;  // d, m, qh[4], qs[16]
// IQ4_NL and IQ4_XS: Q4_0's dot blocks whose nibbles index llama.cpp's 16 int8 levels (kvalues_iq4nl)
// instead of standing for q - 8: IQ4_NL's 4 to a block of 128 features (4.5 bits a weight, as in the
// file; multiplied with Q8_0's activations), IQ4_XS's 8 to a super-block of 256 (each sub-block's
// scale d * (ls - 32) as its float16 d: 4.5 bits, the file 4.25; with k-quant activations), as
// llama.cpp multiplies each.
constexpr int64_t kIq4NlDotBlockBytes = 4 * kQ4_0DotBlockBytes;  // 2,304
constexpr int64_t kIq4XsDotBlockBytes = 8 * kQ4_0DotBlockBytes;  // 4,608
constexpr int8_t kIq4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// MXFP4 (gpt-oss's experts; a file block: an E8M0 exponent e, then 16 bytes of 4-bit e2m1 codes):
// per block of 32 features the 32 columns' exponents (a byte each), then Q4_0's 8 groups of nibbles,
// each code looked up as its doubled e2m1 level (kMxfp4Levels) and scaled by 2^(e - 128), as
// llama.cpp multiplies MXFP4 with Q8_0 activations: 4.25 bits a weight, as in the file. Blocks of
// 544 bytes: every other one starts 32 bytes into a cache line (each 32-byte half of a group's
// vector still within one line).
constexpr int64_t kMxfp4DotHeaderBytes = kPanel;
constexpr int64_t kMxfp4DotBlockBytes = kMxfp4DotHeaderBytes + kQ8Block * kPanel / 2;  // 544
constexpr int64_t kMxfp4FileBlockBytes = 17;
constexpr int64_t mxfp4_dot_nibbles(int64_t g) { return kMxfp4DotHeaderBytes + 64 * g; }
constexpr int8_t kMxfp4Levels[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr bool is_legacy_dot_block(int64_t block_bytes) {
  return block_bytes == kQ4_0DotBlockBytes || block_bytes == kQ5_0DotBlockBytes || block_bytes == kQ4_1DotBlockBytes ||
         block_bytes == kQ5_1DotBlockBytes;
}

// Q4_K: per super-block of 256, d and dmin (float16), then per sub-block of 32 its 6-bit scales and
// mins (uint8 [32] each) and 8 groups of 64 bytes of nibbles (quants 0..15): 4.6 bits a weight.
constexpr int64_t kQ4KDotHeaderBytes = 4 * kPanel;
constexpr int64_t kQ4KDotSubBlockBytes = 2 * kPanel + 32 * kPanel / 2;  // 576
constexpr int64_t q4k_dot_sub_block(int64_t s) { return kQ4KDotHeaderBytes + s * kQ4KDotSubBlockBytes; }
constexpr int64_t kQ4KDotBlockBytes = q4k_dot_sub_block(kQ4KSubBlocks);  // 4,736

// Q5_K: Q4_K's layout with, in each sub-block after its scales and mins, 4 chunks of two groups:
// the two groups' fifth bits in 32 bytes (as Q5_0's: byte 4 (c % 8) + f holding column c's at bit
// c / 8 for the first group, 4 + c / 8 for the second), then their nibbles (2 x 64 bytes): 5.6 bits
// a weight.
constexpr int64_t kQ5KDotChunkBytes = 32 + 2 * 64;
constexpr int64_t kQ5KDotSubBlockBytes = 2 * kPanel + 4 * kQ5KDotChunkBytes;  // 704
constexpr int64_t q5k_dot_sub_block(int64_t s) { return kQ4KDotHeaderBytes + s * kQ5KDotSubBlockBytes; }
constexpr int64_t q5k_dot_fifth(int64_t g) { return 2 * kPanel + kQ5KDotChunkBytes * (g / 2); }  // in a sub-block
constexpr int64_t q5k_dot_nibbles(int64_t g) { return q5k_dot_fifth(g) + 32 + 64 * (g % 2); }
constexpr int64_t kQ5KDotBlockBytes = q5k_dot_sub_block(kQ4KSubBlocks);  // 5,760

// Q6_K: per super-block of 256, d (float16), then per pair of sub-blocks of 16 their int8 scales
// ([2][32]) and their quants biased to q + 32 (0..63) in 4 chunks of two groups: the two groups'
// low 4 bits as nibbles (2 x 64 bytes), then their high 2 bits (2 x 32 bytes, byte 4 (c % 8) + f
// holding column c's at bit 2 (c / 8)): 6.6 bits a weight, as in the file. A weight is
// d * sc * (q' - 32).
// "Q6_K with mins" holds Q4_K and Q6_K matrices alike, for a fused q/k/v or gate/up that mixes them:
// d and dmin, int8 scales and mins per sub-block of 16 (the pair's [2][32] mins after its scales), a
// weight d * sc * q' - dmin * m, with q' = q and the Q4_K sc and m for Q4_K rows, and q' = q + 32,
// dmin = 32 d, m = sc for Q6_K ones: both exact (7.1 bits a weight).
constexpr int64_t kQ6KSubBlocks = kQ6KBlock / kQ6KSubBlock;  // 16
constexpr int64_t q6k_dot_header(bool mins) { return 2 * kPanel * (mins ? 2 : 1); }
constexpr int64_t q6k_dot_pair_scales(bool mins) { return 2 * kPanel * (mins ? 2 : 1); }  // sc (and m)
constexpr int64_t q6k_dot_pair_bytes(bool mins) { return q6k_dot_pair_scales(mins) + 2 * kQ6KSubBlock * kPanel * 3 / 4; }
constexpr int64_t q6k_dot_pair(bool mins, int64_t p) { return q6k_dot_header(mins) + p * q6k_dot_pair_bytes(mins); }
constexpr int64_t q6k_dot_low(int64_t g) { return 192 * (g / 2) + 64 * (g % 2); }  // group g of a pair's quants
constexpr int64_t q6k_dot_high(int64_t g) { return 192 * (g / 2) + 128 + 32 * (g % 2); }
constexpr int64_t kQ6KDotBlockBytes(bool mins) { return q6k_dot_pair(mins, kQ6KSubBlocks / 2); }
static_assert(kQ6KDotBlockBytes(false) == 6720 && kQ6KDotBlockBytes(true) == 7296);

// Q3_K and Q2_K, in the Q6_K layout's order with fewer bits: per super-block of 256, d (Q2_K: and
// dmin), then per pair of sub-blocks of 16 their int8 scales [2][32] (Q2_K: and mins [2][32]) and
// the quants in 4 chunks of two groups: the two groups' low 2 bits (2 x 32 bytes, byte 4 (c % 8) + f
// holding column c's at bit 2 (c / 8), as Q6_K's high pairs) and, for Q3_K, their third bits (32
// bytes, as Q5_0's fifth bits). Q3_K's quants biased to q + 4 (0..7), a weight d * sc * (q' - 4):
// 3.6 bits a weight (the file: 3.4); Q2_K's d * sc * q - dmin * m: 3.1 bits (the file: 2.6).
constexpr int64_t low_k_chunk(bool third) { return 2 * 32 + (third ? 32 : 0); }  // two groups' quants
constexpr int64_t low_k_pair_bytes(bool third, bool mins) { return q6k_dot_pair_scales(mins) + 4 * low_k_chunk(third); }
constexpr int64_t low_k_pair(bool third, bool mins, int64_t p) { return q6k_dot_header(mins) + p * low_k_pair_bytes(third, mins); }
constexpr int64_t kQ3KDotBlockBytes = low_k_pair(true, false, kQ6KSubBlocks / 2);  // 3,648
constexpr int64_t kQ2KDotBlockBytes = low_k_pair(false, true, kQ6KSubBlocks / 2);  // 3,200
static_assert(kQ3KDotBlockBytes == 3648 && kQ2KDotBlockBytes == 3200);

// Rows `ids` of a Q8_0 matrix, dequantized to float32 [T, K], from its panels [P, K / 32, 1,088].
void gather_q8_0_rows(const uint8_t* panels, int64_t k, const int64_t* ids, int64_t tokens, float* out);
// The same for a Q6_K matrix's panels [P, K / 256, 8,768].
void gather_q6_k_rows(const uint8_t* panels, int64_t k, const int64_t* ids, int64_t tokens, float* out);
// Rows `ids` of a matrix in dot panels [P, blocks, block bytes] (int8), dequantized to float32 [T, K].
void gather_dot_rows(const int8_t* panels, int64_t block_bytes, int64_t k, const int64_t* ids, int64_t tokens,
                     float* out);

// Whether `block_bytes` is a dot panel block's size, and the input features of its blocks (0: not one).
constexpr int64_t dot_block_features(int64_t block_bytes) {
  return (block_bytes == kQ8DotBlockBytes || is_legacy_dot_block(block_bytes) || block_bytes == kMxfp4DotBlockBytes)
             ? kQ8Block
         : block_bytes == kIq4NlDotBlockBytes                                     ? 4 * kQ8Block
         : (block_bytes == kQ4KDotBlockBytes || block_bytes == kQ5KDotBlockBytes || block_bytes == kIq4XsDotBlockBytes ||
            block_bytes == kQ3KDotBlockBytes ||
            block_bytes == kQ2KDotBlockBytes || block_bytes == kQ6KDotBlockBytes(false) ||
            block_bytes == kQ6KDotBlockBytes(true))
             ? kQ4KBlock
             : 0;
}

}  // namespace weft
