// Attention of a step's multi-token rows (prompts, prompt chunks after a cached prefix) over the
// paged KV cache [num_blocks, block_size, 2, KVH, D], read in place through the block table: no
// gathered copy of the cache, no mask tensor, and no work on the keys a query cannot see.
//
// Sequence b's queries are q[query_start[b] .. query_start[b + 1]), the last ones of its
// context_lens[b] tokens; a query at position p attends keys 0 .. p, or in a sliding-window layer
// of window W keys p - W + 1 .. p (an item starts at the block of its first query's first key). A work item is one sequence,
// one KV head and up to kChunk of its queries: the rows of the item are those queries times the
// KV head's query heads (row = query * group + head), so every row of an item shares its keys. An
// item walks its keys in blocks of kKeys (a flash-attention loop): it copies the block's keys into
// a transposed tile Kt [D][kKeys], then for each tile of kRows rows computes the scores
// S = Q Kt (the linear layers' register tile: kRows x kKeys accumulators, one key vector load per
// head dimension shared by the rows), updates each row's running softmax (max m, sum l), and adds
// P V to the rows' outputs, reading each value row in place from the cache. A tile skips the key
// blocks entirely past its last query. q is multiplied by the scale first; softmax and sums are
// float32. The products are float32 FMAs, or with bf16_dot (the model's bfloat16 products) vdpbf16ps
// on bfloat16 pairs: q and k paired along the head dimension for the scores, the probabilities and
// v paired along the keys for the output (emulated where the build lacks AVX512_BF16).
//
// Items go to threads in contiguous runs; the chunks of one sequence and head are ordered first,
// last, second, second to last ... so that a run of items holds cheap and costly ones alike.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "tiles.h"
#include "vmath.h"

namespace {

using weft::tiles::dot_pairs;
using weft::tiles::kLanes;
using weft::tiles::pair_word;
using weft::tiles::vecf;
using weft::tiles::vecfu;
using weft::tiles::wordsv;

typedef int32_t veci __attribute__((vector_size(4 * kLanes)));

constexpr int64_t kKeys = 32;             // keys per block of scores
constexpr int kKeyVecs = kKeys / kLanes;  // vectors per row of a score tile
constexpr int64_t kChunk = 32;            // queries per work item
#if defined(__AVX512F__)
constexpr int kRows = 12;     // score tile: 12 rows x 2 key vectors = 24 accumulators (of 32 registers)
constexpr int kAccRegs = 24;  // accumulators of the P V tile
#else
constexpr int kRows = 3;  // 3 x 4 (of 16 registers)
constexpr int kAccRegs = 12;
#endif
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

struct PrefillShape {
  int64_t num_heads, num_kv_heads, group, block_size, token_stride, block_stride, max_blocks;
  int64_t q_token_stride, q_head_stride;
  int64_t window;  // keys a query sees, itself included (a sliding-window layer); 0: all of them
  const float* sinks;  // [H] each head's attention sink (gpt-oss): a logit in the softmax with no value; or null
  float softcap;       // scores become softcap * tanh(score / softcap) (Gemma 2); 0: as they are
  float scale;
};

struct Item {
  int64_t seq, kv_head, first, count;  // the sequence's queries first .. first + count - 1
};

inline vecf vexp(vecf x) {
#if defined(__AVX512F__)
  return reinterpret_cast<vecf>(weft::vmath::exp16(reinterpret_cast<__m512>(x)));
#elif defined(__AVX2__) && defined(__FMA__)
  return reinterpret_cast<vecf>(weft::vmath::exp8(reinterpret_cast<__m256>(x)));
#else
  vecf e;
  for (int c = 0; c < kLanes; ++c) e[c] = weft::vmath::exp_approx(x[c]);
  return e;
#endif
}

inline float lane_max(vecf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#else
  float m = v[0];
  for (int c = 1; c < kLanes; ++c) m = std::max(m, v[c]);
  return m;
#endif
}

inline float lane_sum(vecf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.f;
  for (int c = 0; c < kLanes; ++c) s += v[c];
  return s;
#endif
}

// Word c = (a[c], b[c]) as bfloat16 pairs: vcvtne2ps2bf16 and one permute where the build has
// AVX512_BF16 (rounding to nearest even, as pair_word does for normal values), else pair_word.
inline wordsv interleaved_pairs(vecf a, vecf b) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const __m512i kInterleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);  // a[c], b[c]
  const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(reinterpret_cast<__m512>(b), reinterpret_cast<__m512>(a)));
  return reinterpret_cast<wordsv>(_mm512_permutexvar_epi16(kInterleave, both));
#else
  wordsv w;
  for (int c = 0; c < kLanes; ++c) w[c] = pair_word(a[c], b[c]);
  return w;
#endif
}

// Word c = (x[2c], x[2c + 1]) of the 2 * kLanes values x = lo, hi.
inline wordsv consecutive_pairs(vecf lo, vecf hi) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return reinterpret_cast<wordsv>(_mm512_cvtne2ps_pbh(reinterpret_cast<__m512>(hi), reinterpret_cast<__m512>(lo)));
#else
  wordsv w;
  for (int c = 0; c < kLanes / 2; ++c) w[c] = pair_word(lo[2 * c], lo[2 * c + 1]);
  for (int c = 0; c < kLanes / 2; ++c) w[kLanes / 2 + c] = pair_word(hi[2 * c], hi[2 * c + 1]);
  return w;
#endif
}

// One item's buffers: its rows' scaled queries, outputs and running softmax, one transposed key
// block, a score tile's probabilities and the block's value rows. With bfloat16 products, the
// queries, keys, probabilities and values as bfloat16 pairs instead: q and k paired along the head
// dimension, p and v along the keys.
template <int kD>
struct Scratch {
  static constexpr int kDVecs = kD / kLanes;
  std::vector<vecf> q, o;       // [rows, kDVecs] each
  std::vector<float> m, l;      // [rows]
  std::vector<vecf> kt;         // [kD, kKeyVecs]: Kt[d][key]
  std::vector<vecf> p;          // [kRows, kKeyVecs]
  std::vector<wordsv> qp;       // [rows, kD / 2] words
  std::vector<wordsv> ktp, vp;  // [kD / 2, kKeyVecs]: Kt[d pair][key]; [kKeys / 2, kDVecs]: V[key pair][d]
  std::vector<wordsv> pp;       // [kRows, kKeys / 2] words
  float alpha[kRows];           // how much each row of the tile rescales its output
  const float* values[kKeys];   // the block's value rows, in the cache (or in `widened`)
  std::vector<vecf> widened;    // [kKeys, 2, kDVecs]: a half-precision cache's keys and values in float32
  explicit Scratch(int64_t rows)
      : q(rows * kDVecs), o(rows * kDVecs), m(rows), l(rows), kt(kD * kKeyVecs), p(kRows * kKeyVecs),
        qp(rows * kDVecs / 2), ktp(kD / 2 * kKeyVecs), vp(kKeys / 2 * kDVecs), pp(kRows * kKeyVecs / 2),
        widened(kKeys * 2 * kDVecs) {}
};

// S[i][key] = q_i . k_key for the kRows rows of a tile (q rows kD floats apart).
template <int kD>
__attribute__((always_inline)) inline void score_tile(const float* q, const vecf* kt, vecf (&out)[kRows][kKeyVecs]) {
  vecf acc[kRows][kKeyVecs];  // a local tile, kept in registers (out's address escapes to the softmax)
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kKeyVecs; ++j) acc[i][j] = vecf{};
  for (int d = 0; d < kD; ++d) {
    vecf w[kKeyVecs];
    for (int j = 0; j < kKeyVecs; ++j) w[j] = kt[d * kKeyVecs + j];
    for (int i = 0; i < kRows; ++i) {
      const float x = q[i * kD + d];
      for (int j = 0; j < kKeyVecs; ++j) acc[i][j] += x * w[j];
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kKeyVecs; ++j) out[i][j] = acc[i][j];
}

// The same with bfloat16 products: q pairs [kRows][kD / 2], key pairs [kD / 2][kKeyVecs].
template <int kD>
__attribute__((always_inline)) inline void score_tile_pairs(const uint32_t* q, const wordsv* kt,
                                                            vecf (&out)[kRows][kKeyVecs]) {
  vecf acc[kRows][kKeyVecs];  // a local tile, kept in registers (out's address escapes to the softmax)
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kKeyVecs; ++j) acc[i][j] = vecf{};
  for (int dd = 0; dd < kD / 2; ++dd) {
    wordsv w[kKeyVecs];
    for (int j = 0; j < kKeyVecs; ++j) w[j] = kt[dd * kKeyVecs + j];
    for (int i = 0; i < kRows; ++i) {
      const wordsv x = wordsv{} + q[i * (kD / 2) + dd];
      for (int j = 0; j < kKeyVecs; ++j) acc[i][j] = dot_pairs(acc[i][j], x, w[j]);
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kKeyVecs; ++j) out[i][j] = acc[i][j];
}

// A tile's scores as c * tanh(score / c) (Gemma 2's attention soft-capping).
inline void soft_capped(vecf (&acc)[kRows][kKeyVecs], float cap) {
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kKeyVecs; ++j)
      for (int c = 0; c < kLanes; ++c) acc[i][j][c] = cap * std::tanh(acc[i][j][c] / cap);
}

// The running softmax of a row after one block of scores, keys kb0 .. kb0 + kKeys - 1 of which
// those before `low` or after `limit` are masked: the row's probabilities into p, its rescale into *alpha.
inline void softmax_row(const vecf (&s)[kKeyVecs], int64_t kb0, int64_t low, int64_t limit, float& m, float& l,
                        vecf* p, float* alpha) {
  vecf scores[kKeyVecs];
  veci visible[kKeyVecs];
  const bool all_visible = kb0 >= low && kb0 + kKeys - 1 <= limit;
  for (int j = 0; j < kKeyVecs; ++j) {
    if (all_visible) {
      scores[j] = s[j];
      continue;
    }
    veci key;
    for (int c = 0; c < kLanes; ++c) key[c] = static_cast<int32_t>(kb0 + j * kLanes + c);
    visible[j] = (key <= static_cast<int32_t>(limit)) & (key >= static_cast<int32_t>(low));
    scores[j] = visible[j] ? s[j] : vecf{} + kMinusInf;
  }
  vecf top = scores[0];
  for (int j = 1; j < kKeyVecs; ++j) top = top > scores[j] ? top : scores[j];
  const float new_max = std::max(m, lane_max(top));
  *alpha = m == kMinusInf ? 0.f : weft::vmath::exp_approx(m - new_max);
  vecf sum{};
  for (int j = 0; j < kKeyVecs; ++j) {
    p[j] = vexp(scores[j] - new_max);
    if (!all_visible) p[j] = visible[j] ? p[j] : vecf{};
    sum += p[j];
  }
  m = new_max;
  l = l * *alpha + lane_sum(sum);
}

// o[i] = o[i] * alpha[i] + sum over the block's keys of p[i][key] * v_key, kPvRows rows at a time.
template <int kD>
void add_values(Scratch<kD>& s, int64_t tile_row, int64_t num_keys) {
  constexpr int kDVecs = Scratch<kD>::kDVecs;
  constexpr int kPvRows = std::min(kRows, std::max(1, kAccRegs / kDVecs));
  static_assert(kRows % kPvRows == 0);
  const float* p = reinterpret_cast<const float*>(s.p.data());
  for (int i0 = 0; i0 < kRows; i0 += kPvRows) {
    vecf acc[kPvRows][kDVecs];
    vecf* o = s.o.data() + (tile_row + i0) * kDVecs;
    for (int i = 0; i < kPvRows; ++i)  // a row's first block (alpha 0) starts from zero, not from s.o
      for (int v = 0; v < kDVecs; ++v) acc[i][v] = s.alpha[i0 + i] == 0.f ? vecf{} : o[i * kDVecs + v] * s.alpha[i0 + i];
    for (int64_t key = 0; key < num_keys; ++key) {
      vecf value[kDVecs];
      for (int v = 0; v < kDVecs; ++v) value[v] = *reinterpret_cast<const vecfu*>(s.values[key] + v * kLanes);
      for (int i = 0; i < kPvRows; ++i) {
        const float pk = p[(i0 + i) * kKeys + key];
        for (int v = 0; v < kDVecs; ++v) acc[i][v] += pk * value[v];
      }
    }
    for (int i = 0; i < kPvRows; ++i)
      for (int v = 0; v < kDVecs; ++v) o[i * kDVecs + v] = acc[i][v];
  }
}

// The same with bfloat16 products, from s.pp and s.vp (pairs of keys).
template <int kD>
void add_value_pairs(Scratch<kD>& s, int64_t tile_row, int64_t num_keys) {
  constexpr int kDVecs = Scratch<kD>::kDVecs;
  constexpr int kPvRows = std::min(kRows, std::max(1, kAccRegs / kDVecs));
  for (int i0 = 0; i0 < kRows; i0 += kPvRows) {
    vecf acc[kPvRows][kDVecs];
    vecf* o = s.o.data() + (tile_row + i0) * kDVecs;
    for (int i = 0; i < kPvRows; ++i)  // as in add_values
      for (int v = 0; v < kDVecs; ++v) acc[i][v] = s.alpha[i0 + i] == 0.f ? vecf{} : o[i * kDVecs + v] * s.alpha[i0 + i];
    for (int64_t kk = 0; kk < (num_keys + 1) / 2; ++kk) {
      const wordsv* value = s.vp.data() + kk * kDVecs;
      for (int i = 0; i < kPvRows; ++i) {
        const wordsv pk = wordsv{} + reinterpret_cast<const uint32_t*>(s.pp.data())[(i0 + i) * (kKeys / 2) + kk];
        for (int v = 0; v < kDVecs; ++v) acc[i][v] = dot_pairs(acc[i][v], pk, value[v]);
      }
    }
    for (int i = 0; i < kPvRows; ++i)
      for (int v = 0; v < kDVecs; ++v) o[i * kDVecs + v] = acc[i][v];
  }
}

// A key's (or value's) row of the cache as float32: in place for a float32 cache, else widened into
// `out` (a Q8_0 row: each block's scale times its int8s, as gguf's dequantization computes them).
template <int kD, typename C>
inline const float* as_float(const C* row, float* out) {
  if constexpr (std::is_same_v<C, float>) {
    return row;
  } else if constexpr (std::is_same_v<C, weft::BlockQ8>) {
    for (int b = 0; b < kD / 32; ++b) {
      const float scale = weft::q8_scale(row[b]);
      for (int i = 0; i < 32; ++i) out[32 * b + i] = scale * row[b].qs[i];
    }
    return out;
  } else {
    for (int d = 0; d < kD; ++d) out[d] = static_cast<float>(row[d]);
    return out;
  }
}

// Keys kb0 .. kb0 + num_keys - 1 of the item's head: transposed into s.kt (zero past num_keys), or
// with bfloat16 products paired along the head dimension into s.ktp; and their value rows' addresses
// (and, paired along the keys, s.vp). A half-precision cache (C) is widened to float32 first.
template <int kD, bool kPairs, typename C>
void load_key_block(const C* cache, const int64_t* blocks, int64_t kv_head, int64_t kb0, int64_t num_keys,
                    const PrefillShape& sh, Scratch<kD>& s) {
  float* kt = reinterpret_cast<float*>(s.kt.data());
  auto* ktp = reinterpret_cast<uint32_t*>(s.ktp.data());
  float* widened = reinterpret_cast<float*>(s.widened.data());
  for (int64_t key = 0; key < kKeys; ++key) {
    const float* k = nullptr;
    if (key < num_keys) {
      const int64_t token = kb0 + key;
      const C* row = cache + blocks[token / sh.block_size] * sh.block_stride + (token % sh.block_size) * sh.token_stride +
                     kv_head * (kD / weft::kPerUnit<C>);
      k = as_float<kD>(row, widened + key * 2 * kD);
      s.values[key] = as_float<kD>(row + sh.num_kv_heads * (kD / weft::kPerUnit<C>), widened + key * 2 * kD + kD);
    }
    if constexpr (kPairs) {
      for (int v = 0; v < (kD / 2 + kLanes - 1) / kLanes; ++v) {  // kLanes pairs at a time (a head of 16: 8)
        const bool whole = (2 * v + 2) * kLanes <= kD;
        const wordsv words =
            k == nullptr ? wordsv{}
                         : consecutive_pairs(*reinterpret_cast<const vecfu*>(k + 2 * v * kLanes),
                                             whole ? *reinterpret_cast<const vecfu*>(k + (2 * v + 1) * kLanes) : vecf{});
        for (int c = 0; c < std::min(kLanes, kD / 2 - v * kLanes); ++c) ktp[(v * kLanes + c) * kKeys + key] = words[c];
      }
    } else {
      for (int d = 0; d < kD; ++d) kt[d * kKeys + key] = k == nullptr ? 0.f : k[d];
    }
  }
  if constexpr (kPairs) {
    constexpr int kDVecs = Scratch<kD>::kDVecs;
    for (int64_t kk = 0; kk < kKeys / 2; ++kk) {
      for (int v = 0; v < kDVecs; ++v) {
        const vecf v0 = 2 * kk < num_keys ? *reinterpret_cast<const vecfu*>(s.values[2 * kk] + v * kLanes) : vecf{};
        const vecf v1 = 2 * kk + 1 < num_keys ? *reinterpret_cast<const vecfu*>(s.values[2 * kk + 1] + v * kLanes) : vecf{};
        s.vp[kk * kDVecs + v] = interleaved_pairs(v0, v1);
      }
    }
  }
}

// Rows' queries scaled into s.q (float32) or s.qp (bfloat16 pairs), padding rows zero.
template <int kD, bool kPairs>
void load_queries(const Item& it, const float* q, int64_t query_start, const PrefillShape& sh, Scratch<kD>& s) {
  const int64_t rows = it.count * sh.group;
  float* qs = reinterpret_cast<float*>(s.q.data());
  std::fill(qs + rows * kD, qs + static_cast<int64_t>(s.q.size()) * kLanes, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = q + (query_start + it.first + r / sh.group) * sh.q_token_stride +
                       (it.kv_head * sh.group + r % sh.group) * sh.q_head_stride;
    for (int d = 0; d < kD; ++d) qs[r * kD + d] = src[d] * sh.scale;
  }
  if constexpr (kPairs) {  // q [rows, kD] -> pairs [rows, kD / 2], 2 * kLanes values at a time
    for (int64_t v = 0; v < static_cast<int64_t>(s.qp.size()); ++v) s.qp[v] = consecutive_pairs(s.q[2 * v], s.q[2 * v + 1]);
  }
}

template <int kD, bool kPairs, typename C>
void attend_item(const Item& it, const float* q, const C* cache, const int64_t* table, int64_t context_len,
                 int64_t query_start, int64_t query_len, const PrefillShape& sh, Scratch<kD>& s, float* out) {
  constexpr int kDVecs = Scratch<kD>::kDVecs;
  const int64_t rows = it.count * sh.group;
  const int64_t first_pos = context_len - query_len + it.first;  // the position of the item's first query
  const int64_t* blocks = table + it.seq * sh.max_blocks;
  load_queries<kD, kPairs>(it, q, query_start, sh, s);
  const float* qs = reinterpret_cast<const float*>(s.q.data());
  std::fill(s.m.begin(), s.m.end(), kMinusInf);
  std::fill(s.l.begin(), s.l.end(), 0.f);
  const int64_t last_key = first_pos + it.count - 1;
  const int64_t first_key = sh.window > 0 ? std::max<int64_t>(0, first_pos - sh.window + 1) / kKeys * kKeys : 0;
  for (int64_t kb0 = first_key; kb0 <= last_key; kb0 += kKeys) {
    const int64_t num_keys = std::min(kKeys, last_key + 1 - kb0);
    load_key_block<kD, kPairs>(cache, blocks, it.kv_head, kb0, num_keys, sh, s);
    for (int64_t t0 = 0; t0 < rows; t0 += kRows) {
      if (first_pos + (std::min(t0 + kRows, rows) - 1) / sh.group < kb0) continue;  // all past the tile
      if (sh.window > 0 && first_pos + t0 / sh.group - sh.window + 1 > kb0 + kKeys - 1) continue;  // all before it
      vecf acc[kRows][kKeyVecs];
      if constexpr (kPairs) {
        score_tile_pairs<kD>(reinterpret_cast<const uint32_t*>(s.qp.data()) + t0 * (kD / 2), s.ktp.data(), acc);
      } else {
        score_tile<kD>(qs + t0 * kD, s.kt.data(), acc);
      }
      if (sh.softcap > 0.f) soft_capped(acc, sh.softcap);
      for (int i = 0; i < kRows; ++i) {
        const int64_t r = t0 + i, limit = first_pos + r / sh.group;
        const int64_t low = sh.window > 0 ? limit - sh.window + 1 : 0;
        if (r >= rows || limit < kb0 || low > kb0 + kKeys - 1) {  // padding, or a row that sees none of the block
          std::fill(s.p.begin() + i * kKeyVecs, s.p.begin() + (i + 1) * kKeyVecs, vecf{});
          s.alpha[i] = 1.f;
          continue;
        }
        softmax_row(acc[i], kb0, low, limit, s.m[r], s.l[r], s.p.data() + i * kKeyVecs, &s.alpha[i]);
      }
      if constexpr (kPairs) {
        for (int64_t v = 0; v < kRows * kKeyVecs / 2; ++v) s.pp[v] = consecutive_pairs(s.p[2 * v], s.p[2 * v + 1]);
        add_value_pairs<kD>(s, t0, num_keys);
      } else {
        add_values<kD>(s, t0, num_keys);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out + ((query_start + it.first + r / sh.group) * sh.num_heads + it.kv_head * sh.group + r % sh.group) * kD;
    const int64_t head = it.kv_head * sh.group + r % sh.group;
    const float sink = sh.sinks == nullptr ? 0.f : weft::vmath::exp_approx(sh.sinks[head] - s.m[r]);
    const vecf inv = vecf{} + 1.f / (s.l[r] + sink);
    for (int v = 0; v < kDVecs; ++v) *reinterpret_cast<vecfu*>(dst + v * kLanes) = s.o[r * kDVecs + v] * inv;
  }
}

// The work items, each sequence's chunks ordered first, last, second, second to last, ...
std::vector<Item> work_items(const int64_t* starts, int64_t num_seqs, int64_t num_kv_heads) {
  std::vector<Item> items;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t len = starts[b + 1] - starts[b], chunks = (len + kChunk - 1) / kChunk;
    for (int64_t g = 0; g < num_kv_heads; ++g) {
      for (int64_t i = 0; i < chunks; ++i) {
        const int64_t c = i % 2 == 0 ? i / 2 : chunks - 1 - i / 2;
        items.push_back({b, g, c * kChunk, std::min(kChunk, len - c * kChunk)});
      }
    }
  }
  return items;
}

template <int kD, bool kPairs, typename C>
void prefill_kernel(const float* q, const C* cache, const int64_t* table, const int64_t* lens,
                    const int64_t* starts, int64_t num_seqs, const PrefillShape& sh, float* out) {
  const std::vector<Item> items = work_items(starts, num_seqs, sh.num_kv_heads);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch<kD> scratch(((kChunk * sh.group + kRows - 1) / kRows) * kRows);
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      attend_item<kD, kPairs>(it, q, cache, table, lens[it.seq], starts[it.seq], starts[it.seq + 1] - starts[it.seq], sh,
                      scratch, out);
    }
  });
}

void check_prefill_inputs(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                          const at::Tensor& context_lens, const at::Tensor& query_start) {
  for (const auto& t : {q, kv_cache, block_table, context_lens, query_start}) {
    TORCH_CHECK(t.device().is_cpu(), "paged_prefill_attention: every tensor must be on the CPU");
  }
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.scalar_type() == at::kFloat,
              "paged_prefill_attention: q must be float32 [T, H, D] with contiguous heads");
  const int64_t d = q.size(2);
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && weft::cache_dtype_ok(q, kv_cache) &&
                  kv_cache.size(2) == 2 && kv_cache.size(4) == weft::cache_row_size(kv_cache, d),
              "paged_prefill_attention: kv_cache must be contiguous float32, bfloat16, float16 or Q8_0 (uint8) "
              "[blocks, block_size, 2, KVH, D]");
  TORCH_CHECK(kv_cache.scalar_type() != at::kByte || d % weft::kQ8Elements == 0,
              "paged_prefill_attention: a Q8_0 cache needs head_dim a multiple of 32");
  TORCH_CHECK(d == 16 || d == 32 || d == 64 || d == 128 || d == 256,
              "paged_prefill_attention: head_dim must be 16, 32, 64, 128 or 256 (others take SDPA)");
  TORCH_CHECK(kv_cache.size(3) > 0 && q.size(1) % kv_cache.size(3) == 0,
              "paged_prefill_attention: the query heads must be a multiple of the KV heads");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 && block_table.is_contiguous(),
              "paged_prefill_attention: block_table must be contiguous [B, max_blocks] int64");
  const int64_t num_seqs = block_table.size(0);
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                  context_lens.numel() == num_seqs,
              "paged_prefill_attention: context_lens must be [B] int64");
  TORCH_CHECK(query_start.scalar_type() == at::kLong && query_start.is_contiguous() &&
                  query_start.numel() == num_seqs + 1,
              "paged_prefill_attention: query_start must be [B + 1] int64");
}

// Every sequence's queries inside q and its context, its context inside its blocks, every block
// inside the cache.
void check_prefill_lengths(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                           const int64_t* lens, const int64_t* starts) {
  const int64_t num_seqs = block_table.size(0), max_blocks = block_table.size(1), block_size = kv_cache.size(1);
  const int64_t* table = block_table.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == q.size(0),
              "paged_prefill_attention: query_start must run from 0 to the number of query tokens");
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t len = starts[b + 1] - starts[b];
    TORCH_CHECK(len >= 0 && len <= lens[b] && lens[b] <= max_blocks * block_size,
                "paged_prefill_attention: a sequence's queries exceed its context, or its context its blocks");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i) {
      TORCH_CHECK(table[b * max_blocks + i] >= 0 && table[b * max_blocks + i] < kv_cache.size(0),
                  "paged_prefill_attention: a block id is outside the cache");
    }
  }
}

template <bool kPairs, typename C>
void dispatch_head_dim(int64_t head_dim, const float* qp, const C* cache, const int64_t* table, const int64_t* lens,
                       const int64_t* starts, int64_t num_seqs, const PrefillShape& sh, float* op) {
  switch (head_dim) {
    case 16: prefill_kernel<16, kPairs>(qp, cache, table, lens, starts, num_seqs, sh, op); break;
    case 32: prefill_kernel<32, kPairs>(qp, cache, table, lens, starts, num_seqs, sh, op); break;
    case 64: prefill_kernel<64, kPairs>(qp, cache, table, lens, starts, num_seqs, sh, op); break;
    case 128: prefill_kernel<128, kPairs>(qp, cache, table, lens, starts, num_seqs, sh, op); break;
    default: prefill_kernel<256, kPairs>(qp, cache, table, lens, starts, num_seqs, sh, op); break;
  }
}

// bf16_dot: q, k, the probabilities and v rounded to bfloat16 for the two products (vdpbf16ps where
// the CPU has AVX512_BF16), float32 accumulation and softmax, as the linear layers' bf16_dot.
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                   const at::Tensor& context_lens, const at::Tensor& query_start, double scale,
                                   bool bf16_dot, int64_t window, const std::optional<at::Tensor>& sinks,
                                   double softcap) {
  check_prefill_inputs(q, kv_cache, block_table, context_lens, query_start);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* starts = query_start.data_ptr<int64_t>();
  check_prefill_lengths(q, kv_cache, block_table, lens, starts);
  PrefillShape sh{};
  sh.num_heads = q.size(1);
  sh.num_kv_heads = kv_cache.size(3);
  sh.group = sh.num_heads / sh.num_kv_heads;
  sh.block_size = kv_cache.size(1);
  sh.token_stride = 2 * sh.num_kv_heads * weft::cache_units(kv_cache, q.size(2));  // in the cache's units
  sh.block_stride = sh.block_size * sh.token_stride;
  sh.max_blocks = block_table.size(1);
  sh.q_token_stride = q.stride(0);
  sh.q_head_stride = q.stride(1);
  sh.scale = static_cast<float>(scale);
  TORCH_CHECK(window >= 0, "paged_prefill_attention: window must be >= 0 (0: no window)");
  sh.window = window;
  TORCH_CHECK(softcap >= 0, "paged_prefill_attention: softcap must be >= 0 (0: none)");
  sh.softcap = static_cast<float>(softcap);
  sh.sinks = weft::attention_sinks(sinks, sh.num_heads, "paged_prefill_attention");
  auto out = at::empty({q.size(0), sh.num_heads, q.size(2)}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t num_seqs = block_table.size(0);
  const auto attend = [&](const auto* cache) {
    if (bf16_dot) {
      dispatch_head_dim<true>(q.size(2), qp, cache, table, lens, starts, num_seqs, sh, op);
    } else {
      dispatch_head_dim<false>(q.size(2), qp, cache, table, lens, starts, num_seqs, sh, op);
    }
  };
  if (kv_cache.scalar_type() == at::kBFloat16) {
    attend(kv_cache.data_ptr<c10::BFloat16>());
  } else if (kv_cache.scalar_type() == at::kHalf) {
    attend(kv_cache.data_ptr<c10::Half>());
  } else if (kv_cache.scalar_type() == at::kByte) {
    attend(reinterpret_cast<const weft::BlockQ8*>(kv_cache.data_ptr<uint8_t>()));
  } else {
    attend(kv_cache.data_ptr<float>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(weft, m) {
  m.def(
      "paged_prefill_attention(Tensor q, Tensor kv_cache, Tensor block_table, Tensor context_lens, "
      "Tensor query_start, float scale, bool bf16_dot=False, int window=0, Tensor? sinks=None, "
      "float softcap=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(weft, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }
