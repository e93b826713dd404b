// GGUF blocks decoded where two files need the same reading (quant.cpp packs them, rewrite.cpp
// rewrites them as another type's).
#pragma once

#include <cstdint>

namespace weft {

// A Q3_K super-block (llama.cpp's block_q3_K {hmask[32], qs[64], scales[12], d}; its
// dequantize_row_q3_K): the 16 scales sc - 32 (scale j's low 4 bits in scales[j] (j < 8) or
// scales[j - 8] >> 4, its high 2 at bits 2 (j / 4) of scales[8 + j % 4]) and the 256 quants q in
// -4..3 (feature 128 n + 32 j + l: bits 2 j of qs[32 n + l], less 4 unless bit 4 n + j of hmask[l]).
inline void decode_q3_k_block(const uint8_t* in, int8_t* scales, int8_t* q) {
  const uint8_t *hmask = in, *qs = in + 32, *sc = in + 96;
  for (int j = 0; j < 16; ++j) {
    const int low = j < 8 ? sc[j] & 0xF : sc[j - 8] >> 4, high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
    scales[j] = static_cast<int8_t>((low | high << 4) - 32);
  }
  for (int n = 0; n < 2; ++n) {
    for (int j = 0; j < 4; ++j) {
      for (int l = 0; l < 32; ++l) {
        const int v = (qs[32 * n + l] >> (2 * j)) & 3, present = (hmask[l] >> (4 * n + j)) & 1;
        q[128 * n + 32 * j + l] = static_cast<int8_t>(v - (present ? 0 : 4));
      }
    }
  }
}

}  // namespace weft
