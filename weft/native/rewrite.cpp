// GGUF types that weft multiplies as another type's blocks, rewritten once at load (quant.cpp then
// packs the rewritten rows like any other of that type):
//
//   Q3_K   -> Q6_K, exactly: a Q3_K weight is d * (sc - 32) * q with q in -4..3 and a 6-bit sc per
//             sub-block of 16, which is Q6_K's d * sc' * q' (q' in -32..31, int8 sc') for the same d
//             (the dequantization is bit-identical): its exact panels, and in a fusion with other
//             k-quants the Q6_K dot layout with mins (alone, Q3_K has dot panels of its own).
//   IQ4_NL -> Q8_0, exactly: d * kvalues[q] per block of 32, kvalues int8 (8.5 bits instead of 4.5):
//             the exact panels, and dot panels where the input features are not a multiple of 128
//             (elsewhere IQ4_NL has dot panels of its own, panels.h).
//   IQ4_XS -> IQ4_NL with each sub-block's scale d * (ls - 32) rounded to float16 (at most 2^-11 of it
//             where it is a normal float16, against the 2^-8 of the int8 activations of a dot product;
//             4.5 bits instead of 4.25), for its dot panels. Exact products dequantize the file's blocks.
//   MXFP4  -> Q5_0, exactly (gpt-oss's experts; weft/model/mxfp4.py says how, and holds the same
//             rewrite in numpy for when these kernels are not built): 5.5 bits a weight instead of 4.25.
//
// The layouts are llama.cpp's (ggml-common.h): block_q3_K {hmask[32], qs[64], scales[12], d},
// block_q6_K {ql[128], qh[64], scales[16], d}, block_iq4_nl {d, qs[16]}, block_iq4_xs {d,
// scales_h, scales_l[4], qs[128]}.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "blocks.h"
#include "panels.h"

namespace weft {

namespace {

constexpr int64_t kSuper = 256;  // features per k-quant super-block
constexpr int64_t kIq4NlBytes = 18, kIq4XsBytes = 136;  // (the other file blocks' sizes: panels.h)


// Q6_K's block from its 256 quants q (-32..31), 16 int8 scales and float16 d (bits): feature
// 128 h + 32 r + l (r 0..3, l < 32) in the low (r 0, 1) or high (r 2, 3) nibble of ql[64 h + l + 32 (r % 2)]
// and its top two bits at bits 2 r of qh[32 h + l] (llama.cpp's dequantize_row_q6_K, reversed).
void encode_q6_k(const int8_t* q, const int8_t* scales, uint16_t d, uint8_t* out) {
  uint8_t *ql = out, *qh = out + 128;
  std::memset(out, 0, kQ6KFileBlockBytes);
  for (int64_t f = 0; f < kSuper; ++f) {
    const int64_t h = f / 128, r = (f % 128) / 32, l = f % 32;
    const auto v = static_cast<uint8_t>(q[f] + 32);  // 0..63
    ql[64 * h + l + 32 * (r % 2)] |= static_cast<uint8_t>((v & 0xF) << (4 * (r / 2)));
    qh[32 * h + l] |= static_cast<uint8_t>((v >> 4) << (2 * r));
  }
  std::memcpy(out + 192, scales, 16);
  std::memcpy(out + 208, &d, 2);
}

// A Q3_K block as Q6_K: its scales and quants as they are, under the same d.
void q3_k_as_q6_k(const uint8_t* in, uint8_t* out) {
  int8_t scales[16], q[kSuper];
  decode_q3_k_block(in, scales, q);
  uint16_t d;
  std::memcpy(&d, in + 108, 2);
  encode_q6_k(q, scales, d, out);
}

// Q8_0's block: float16 d (bits) and the 32 levels of 16 bytes of IQ4 nibbles (feature j < 16 in the
// low nibble of qs[j], j >= 16 in the high one of qs[j - 16]).
void iq4_nl_as_q8_0(const uint8_t* in, uint8_t* out) {
  std::memcpy(out, in, 2);
  const uint8_t* qs = in + 2;
  for (int j = 0; j < 16; ++j) {
    out[2 + j] = static_cast<uint8_t>(kIq4Levels[qs[j] & 0xF]);
    out[18 + j] = static_cast<uint8_t>(kIq4Levels[qs[j] >> 4]);
  }
}

// An IQ4_XS super-block as 8 IQ4_NL blocks: sub-block b's scale ls is 4 bits of scales_l[b / 2] (low
// for even b) and bits 2 b of scales_h above them; its float16 d is d * (ls - 32), rounded.
void iq4_xs_as_iq4_nl(const uint8_t* in, uint8_t* out) {
  uint16_t d_bits, high;
  std::memcpy(&d_bits, in, 2);
  std::memcpy(&high, in + 2, 2);
  const float d = static_cast<float>(c10::Half(d_bits, c10::Half::from_bits()));
  for (int b = 0; b < 8; ++b) {
    const int ls = ((in[4 + b / 2] >> (4 * (b % 2))) & 0xF) | (((high >> (2 * b)) & 3) << 4);
    const c10::Half scale(d * static_cast<float>(ls - 32));
    TORCH_CHECK(std::isfinite(static_cast<float>(scale)), "rewrite_blocks: an IQ4_XS scale overflows float16");
    std::memcpy(out + kIq4NlBytes * b, &scale.x, 2);
    std::memcpy(out + kIq4NlBytes * b + 2, in + 8 + 16 * b, 16);
  }
}

// An MXFP4 block {e, qs[16]} (weight j: kvalues[code j] * 2^(e - 128), code j in the low nibble of
// qs[j] for j < 16, the high one of qs[j - 16] above) as Q5_0's {d, qh, qs[16]}: d = 2^(e - 128) as
// float16 (rounded to 0 below 2^-24, as the numpy rewrite's float16 cast rounds it), q = kvalue + 16.
void mxfp4_as_q5_0(const uint8_t* in, uint8_t* out) {
  const int e = static_cast<int>(in[0]) - 128;
  TORCH_CHECK(e <= 15, "rewrite_blocks: an MXFP4 block's scale is above 2^15, past what Q5_0's float16 scale holds");
  const c10::Half d(std::ldexp(1.0f, e));
  std::memcpy(out, &d.x, 2);
  uint32_t high = 0;
  uint8_t low[32];
  for (int j = 0; j < 32; ++j) {
    const int code = j < 16 ? in[1 + j] & 0xF : in[1 + j - 16] >> 4;
    const int q = kMxfp4Levels[code] + 16;  // 4..28
    high |= static_cast<uint32_t>((q >> 4) & 1) << j;
    low[j] = static_cast<uint8_t>(q & 0xF);
  }
  std::memcpy(out + 2, &high, 4);  // little-endian, as x86 stores it
  for (int j = 0; j < 16; ++j) out[6 + j] = static_cast<uint8_t>(low[j] | (low[j + 16] << 4));
}

using Rewrite = void (*)(const uint8_t*, uint8_t*);

at::Tensor rewrite_rows(const at::Tensor& rows_in, int64_t in_bytes, int64_t out_bytes, Rewrite rewrite) {
  TORCH_CHECK(rows_in.device().is_cpu() && rows_in.dim() == 2 && rows_in.scalar_type() == at::kByte &&
                  rows_in.size(1) % in_bytes == 0,
              "rewrite_blocks: expected a GGUF tensor's rows as uint8 [N, K / block * ", in_bytes, "]");
  const at::Tensor rows = rows_in.contiguous();
  const int64_t blocks = rows.numel() / in_bytes;
  auto out = at::empty({rows.size(0), rows.size(1) / in_bytes * out_bytes}, rows.options());
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) rewrite(src + b * in_bytes, dst + b * out_bytes);
  });
  return out;
}

// The rows of a GGUF tensor of `kind` ("q3_k", "iq4_nl", "iq4_xs", "mxfp4") as rows of the type weft
// packs it as (Q6_K, Q8_0, IQ4_NL, Q5_0).
at::Tensor rewrite_blocks(const at::Tensor& rows, c10::string_view kind) {
  if (kind == "q3_k") return rewrite_rows(rows, kQ3KFileBlockBytes, kQ6KFileBlockBytes, q3_k_as_q6_k);
  if (kind == "iq4_nl") return rewrite_rows(rows, kIq4NlBytes, kQ8FileBlockBytes, iq4_nl_as_q8_0);
  if (kind == "mxfp4") return rewrite_rows(rows, kMxfp4FileBlockBytes, kQ5_0FileBlockBytes, mxfp4_as_q5_0);
  TORCH_CHECK(kind == "iq4_xs", "rewrite_blocks: kind must be q3_k, iq4_nl, iq4_xs or mxfp4, not ", kind);
  return rewrite_rows(rows, kIq4XsBytes, 8 * kIq4NlBytes, iq4_xs_as_iq4_nl);
}

}  // namespace

}  // namespace weft

TORCH_LIBRARY_FRAGMENT(weft, m) { m.def("rewrite_blocks(Tensor rows, str kind) -> Tensor"); }

TORCH_LIBRARY_IMPL(weft, CPU, m) { m.impl("rewrite_blocks", &weft::rewrite_blocks); }
