// weft's matrix multiply for the linear layers on CPU: y = x @ W.T + b with W stored once, at load
// time, as column panels ("pack_linear_weight"), so that every step streams each weight exactly
// once, front to back, whatever the number of rows. x, y and the bias are float32; W is float32,
// bfloat16 or float16, and half-precision weights are widened to float32 in registers as they
// stream in (float32 accumulation), so a half-precision model reads half the bytes per step.
//
// Layout: W [N, K] becomes P = ceil(N / 32) panels of [K, 32] (the last one zero-padded), one
// contiguous block each: a panel row is 128 bytes in float32, one 64-byte cache line in half
// precision. A tile of up to 12 rows of x times one panel keeps its 12 x 32 outputs in 24 vector
// registers while it walks down the panel, one panel row per step of k. Threads take contiguous
// runs of panels; inside a thread the panel stays in L2 for the next tile of rows. A software
// prefetch 2 KB ahead keeps enough of the stream in flight: without it the decode-sized products
// (2-32 rows) reached only 60-75% of the bandwidth of a single row (see docs/benchmarks.md).
//
// Widening: a bfloat16 is the top half of a float32. The packer stores each half-precision panel
// row with columns j and j + 16 side by side in one 32-bit word (j low), so one 64-byte load gives
// columns 0-15 as `word << 16` and columns 16-31 as `word & 0xffff0000`: two integer operations per
// panel row, shared by every row of the tile. float16 rows keep their natural order and widen with
// vcvtph2ps (F16C), or one value at a time on machines without it. Written with GCC vector
// extensions, so it compiles to AVX-512, AVX2 or SSE as the machine has.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;               // columns per panel
constexpr int kVecs = kPanel / 16;           // 16-float vectors per panel row
constexpr int64_t kMaxTileRows = 12;         // rows per tile: 12 x 2 accumulators + 2 panel vectors
constexpr int64_t kPrefetchBytes = 2048;     // how far ahead of the current panel row to prefetch

typedef float vec16 __attribute__((vector_size(64)));                // aligned: panel rows
typedef float vec16u __attribute__((vector_size(64), aligned(4)));   // unaligned: output rows, bias
typedef uint32_t words16 __attribute__((vector_size(64)));           // a half-precision panel row

// One panel row of each weight type, widened to two vectors of 16 float32 columns (0-15, 16-31).
struct Float32Row {
  using Storage = float;
  static void load(const float* row, vec16 w[kVecs]) {
    for (int j = 0; j < kVecs; ++j) w[j] = *reinterpret_cast<const vec16*>(row + 16 * j);
  }
};

struct BFloat16Row {  // interleaved by the packer: word j = column j (low half) | column j + 16
  using Storage = uint16_t;
  static void load(const uint16_t* row, vec16 w[kVecs]) {
    const words16 words = *reinterpret_cast<const words16*>(row);
    w[0] = reinterpret_cast<vec16>(words << 16);
    w[1] = reinterpret_cast<vec16>(words & 0xffff0000u);
  }
};

struct Float16Row {  // natural column order
  using Storage = uint16_t;
  static void load(const uint16_t* row, vec16 w[kVecs]) {
#if defined(__AVX512F__)
    for (int j = 0; j < kVecs; ++j)
      w[j] = reinterpret_cast<vec16>(_mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(row + 16 * j))));
#elif defined(__F16C__)
    for (int j = 0; j < kVecs; ++j)
      for (int h = 0; h < 2; ++h) {
        const __m256 part = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(row + 16 * j + 8 * h)));
        std::memcpy(reinterpret_cast<float*>(&w[j]) + 8 * h, &part, sizeof(part));
      }
#else
    for (int c = 0; c < kPanel; ++c) reinterpret_cast<float*>(w)[c] = static_cast<float>(c10::Half(row[c], c10::Half::from_bits()));
#endif
  }
};

struct Tile {
  const float* x;      // first row of the tile
  int64_t x_stride;
  const void* panel;   // [K, 32] of the weight type
  int64_t k;
  float* out;          // first row, first column of the tile
  int64_t out_stride;
  int64_t cols;        // valid columns of this panel (32 but in the last panel)
  const float* bias;   // the panel's bias, or nullptr
};

// out[i, :cols] = x[i, :] @ panel (+ bias) for the tile's kRows rows.
template <int kRows, typename Row>
void tile_kernel(const Tile& t) {
  using Storage = typename Row::Storage;
  constexpr int64_t kRowBytes = kPanel * sizeof(Storage);
  constexpr int64_t kAhead = kPrefetchBytes / sizeof(Storage);  // elements
  vec16 acc[kRows][kVecs];
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kVecs; ++j) acc[i][j] = vec16{};
  const Storage* panel = static_cast<const Storage*>(t.panel);
  for (int64_t k = 0; k < t.k; ++k) {
    const Storage* row = panel + k * kPanel;
    vec16 w[kVecs];
    Row::load(row, w);
    for (int64_t line = 0; line < kRowBytes; line += 64)  // past the panel's end: the thread's next panel
      __builtin_prefetch(reinterpret_cast<const char*>(row + kAhead) + line);
    for (int i = 0; i < kRows; ++i) {
      const float xv = t.x[i * t.x_stride + k];
      for (int j = 0; j < kVecs; ++j) acc[i][j] += xv * w[j];
    }
  }
  if (t.bias != nullptr) {
    float bias[kPanel] = {};
    std::memcpy(bias, t.bias, sizeof(float) * t.cols);
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < kVecs; ++j) acc[i][j] += *reinterpret_cast<const vec16u*>(bias + 16 * j);
  }
  for (int i = 0; i < kRows; ++i) {
    float* dst = t.out + i * t.out_stride;
    if (t.cols == kPanel) {
      for (int j = 0; j < kVecs; ++j) *reinterpret_cast<vec16u*>(dst + 16 * j) = acc[i][j];
    } else {
      std::memcpy(dst, &acc[i][0], sizeof(float) * t.cols);
    }
  }
}

using TileFn = void (*)(const Tile&);

template <typename Row, int... kRows>
constexpr std::array<TileFn, sizeof...(kRows) + 1> tile_table(std::integer_sequence<int, kRows...>) {
  return {nullptr, &tile_kernel<kRows + 1, Row>...};
}

template <typename Row>
constexpr auto kTileKernels = tile_table<Row>(std::make_integer_sequence<int, kMaxTileRows>{});

template <typename Storage>
void pack_panels(const Storage* w, int64_t n, int64_t k, bool pair_halves, Storage* out) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t col = p * kPanel + c;  // output feature, a row of W
        // bfloat16 pairs column j with column j + 16 in one 32-bit word (see the top)
        const int64_t slot = pair_halves ? (c % 16) * 2 + c / 16 : c;
        Storage* dst = out + p * k * kPanel + slot;
        if (col >= n) {
          for (int64_t i = 0; i < k; ++i) dst[i * kPanel] = Storage{};
        } else {
          const Storage* src = w + col * k;
          for (int64_t i = 0; i < k; ++i) dst[i * kPanel] = src[i];
        }
      }
    }
  });
}

// W [N, K] float32, bfloat16 or float16 -> panels [ceil(N / 32), K, 32] of the same type,
// zero-padded past column N, in one pass (so loading a checkpoint holds one matrix twice at most).
at::Tensor pack_linear_weight(const at::Tensor& weight_in) {
  const auto type = weight_in.scalar_type();
  TORCH_CHECK(weight_in.device().is_cpu() && weight_in.dim() == 2 &&
                  (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf),
              "pack_linear_weight: weight must be a float32, bfloat16 or float16 [out, in] matrix on the CPU");
  const at::Tensor weight = weight_in.contiguous();
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  auto out = at::empty({panels, k, kPanel}, weight.options());
  if (type == at::kFloat) {
    pack_panels(weight.data_ptr<float>(), n, k, false, out.data_ptr<float>());
  } else {
    pack_panels(static_cast<const uint16_t*>(weight.data_ptr()), n, k, type == at::kBFloat16,
                static_cast<uint16_t*>(out.data_ptr()));
  }
  return out;
}

template <typename Storage>
float widen(Storage v, at::ScalarType type) {
  if constexpr (std::is_same_v<Storage, float>) {
    return v;
  } else if (type == at::kBFloat16) {
    return static_cast<float>(c10::BFloat16(v, c10::BFloat16::from_bits()));
  } else {
    return static_cast<float>(c10::Half(v, c10::Half::from_bits()));
  }
}

template <typename Storage>
void gather_columns(const Storage* panels, int64_t k, at::ScalarType type, const int64_t* ids, int64_t tokens,
                    float* out) {
  const bool paired = type == at::kBFloat16;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t c = ids[t] % kPanel, slot = paired ? (c % 16) * 2 + c / 16 : c;
    const Storage* src = panels + (ids[t] / kPanel) * k * kPanel + slot;
    for (int64_t i = 0; i < k; ++i) out[t * k + i] = widen(src[i * kPanel], type);
  }
}

// Rows `ids` of W from its panels, as float32 [T, K]: the token embeddings of a model whose
// embedding table is tied to its packed lm_head, so the table is not kept a second time.
at::Tensor embedding_from_panels(const at::Tensor& ids, const at::Tensor& panels, int64_t num_rows) {
  const auto type = panels.scalar_type();
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(),
              "embedding_from_panels: ids must be a contiguous [T] int64 CPU tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
                  (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf) &&
                  num_rows > (panels.size(0) - 1) * kPanel && num_rows <= panels.size(0) * kPanel,
              "embedding_from_panels: panels must come from pack_linear_weight of a [num_rows, K] matrix");
  const int64_t tokens = ids.size(0), k = panels.size(1);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(ip[t] >= 0 && ip[t] < num_rows, "embedding_from_panels: a token id is outside the table");
  }
  auto out = at::empty({tokens, k}, panels.options().dtype(at::kFloat));
  if (type == at::kFloat) {
    gather_columns(panels.data_ptr<float>(), k, type, ip, tokens, out.data_ptr<float>());
  } else {
    gather_columns(static_cast<const uint16_t*>(panels.data_ptr()), k, type, ip, tokens, out.data_ptr<float>());
  }
  return out;
}

// Rows per tile: as even as possible, at most kMaxTileRows (16 rows: 8 + 8, not 12 + 4).
int64_t tile_rows(int64_t rows) {
  const int64_t tiles = (rows + kMaxTileRows - 1) / kMaxTileRows;
  return (rows + tiles - 1) / tiles;
}

void check_linear_inputs(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                         int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu() && (!bias.has_value() || bias->device().is_cpu()),
              "packed_linear: x, the weight and the bias must be CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "packed_linear: x must be a float32 [M, K] matrix");
  const auto type = panels.scalar_type();
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
                  (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf),
              "packed_linear: weight must come from pack_linear_weight");
  TORCH_CHECK(panels.size(1) == x.size(1), "packed_linear: x and the packed weight differ in input features");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(panels.data_ptr()) % 64 == 0,
              "packed_linear: the packed weight must be 64-byte aligned (a whole tensor, not a view)");
  TORCH_CHECK(n > (panels.size(0) - 1) * kPanel && n <= panels.size(0) * kPanel,
              "packed_linear: out_features does not match the packed weight");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->is_contiguous() && bias->numel() == n &&
                                     bias->scalar_type() == at::kFloat),
              "packed_linear: bias must be a contiguous float32 [out_features]");
}

template <typename Row>
void run_panels(const at::Tensor& x, const at::Tensor& panels, const float* bias, at::Tensor& out) {
  using Storage = typename Row::Storage;
  const int64_t m = x.size(0), n = out.size(1), num_panels = panels.size(0), k = panels.size(1);
  const int64_t rows = tile_rows(m);
  const float* xp = x.data_ptr<float>();
  const Storage* wp = static_cast<const Storage*>(panels.data_ptr());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t col = p * kPanel;
      for (int64_t r = 0; r < m; r += rows) {
        const int64_t count = std::min(rows, m - r);
        const Tile tile{xp + r * x.stride(0), x.stride(0), wp + p * k * kPanel, k, op + r * n + col, n,
                        std::min(kPanel, n - col), bias == nullptr ? nullptr : bias + col};
        kTileKernels<Row>[count](tile);
      }
    }
  });
}

// y = x @ W.T + b: x [M, K] float32, panels from pack_linear_weight, bias [N] float32 or none.
at::Tensor packed_linear(const at::Tensor& x_in, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  check_linear_inputs(x_in, panels, bias, out_features);
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  auto out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return out;
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  switch (panels.scalar_type()) {
    case at::kBFloat16: run_panels<BFloat16Row>(x, panels, bp, out); break;
    case at::kHalf: run_panels<Float16Row>(x, panels, bp, out); break;
    default: run_panels<Float32Row>(x, panels, bp, out); break;
  }
  return out;
}

// The vector instruction sets this build of the kernels uses (it is compiled for the machine).
std::string build_info() {
  std::string isa;
#if defined(__AVX512F__)
  isa += "avx512f ";
#elif defined(__AVX2__)
  isa += "avx2 ";
#endif
#if defined(__AVX512BF16__)
  isa += "avx512_bf16 ";
#endif
#if defined(__F16C__)
  isa += "f16c ";
#endif
#if defined(__FMA__)
  isa += "fma ";
#endif
  return isa.empty() ? "scalar" : isa.substr(0, isa.size() - 1);
}

}  // namespace

namespace weft {  // for decoder.cpp (ops.h)

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  return ::packed_linear(x, panels, bias, out_features);
}

}  // namespace weft

TORCH_LIBRARY_FRAGMENT(weft, m) {
  m.def("build_info() -> str", &build_info);
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("embedding_from_panels(Tensor ids, Tensor panels, int num_rows) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(weft, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("embedding_from_panels", &embedding_from_panels);
  m.impl("packed_linear", &packed_linear);
}
