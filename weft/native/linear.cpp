// weft's float32 matrix multiply for the linear layers on CPU: y = x @ W.T + b with W stored once,
// at load time, as column panels ("pack_linear_weight"), so that every step streams each weight
// exactly once, front to back, whatever the number of rows.
//
// Layout: W [N, K] becomes P = ceil(N / 32) panels of [K, 32] (the last one zero-padded), one
// contiguous block each. A tile of up to 12 rows of x times one panel keeps its 12 x 32 outputs in
// 24 vector registers while it walks down the panel, one 128-byte panel row per step of k.
// Threads take contiguous runs of panels; inside a thread the panel stays in L2 for the next tile
// of rows. A software prefetch 2 KB ahead keeps enough of the stream in flight: without it the
// decode-sized products (2-32 rows) reached only 60-75% of the bandwidth of a single row (see
// docs/benchmarks.md). Written with GCC vector extensions, so it compiles to AVX-512, AVX2 or SSE
// as the machine has.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

constexpr int64_t kPanel = 32;               // columns per panel
constexpr int kVecs = kPanel / 16;           // 16-float vectors per panel row
constexpr int64_t kMaxTileRows = 12;         // rows per tile: 12 x 2 accumulators + 2 panel vectors
constexpr int64_t kPrefetchRows = 16;        // panel rows ahead (16 x 128 bytes)

typedef float vec16 __attribute__((vector_size(64)));                // aligned: panel rows
typedef float vec16u __attribute__((vector_size(64), aligned(4)));   // unaligned: output rows, bias

struct Tile {
  const float* x;      // first row of the tile
  int64_t x_stride;
  const float* panel;  // [K, 32]
  int64_t k;
  float* out;          // first row, first column of the tile
  int64_t out_stride;
  int64_t cols;        // valid columns of this panel (32 but in the last panel)
  const float* bias;   // the panel's bias, or nullptr
};

// out[i, :cols] = x[i, :] @ panel (+ bias) for the tile's kRows rows.
template <int kRows>
void tile_kernel(const Tile& t) {
  vec16 acc[kRows][kVecs];
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kVecs; ++j) acc[i][j] = vec16{};
  for (int64_t k = 0; k < t.k; ++k) {
    const float* row = t.panel + k * kPanel;
    vec16 w[kVecs];
    for (int j = 0; j < kVecs; ++j) w[j] = *reinterpret_cast<const vec16*>(row + 16 * j);
    __builtin_prefetch(row + kPrefetchRows * kPanel);  // past the panel's end: the thread's next panel
    __builtin_prefetch(row + kPrefetchRows * kPanel + 16);
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
constexpr TileFn kTileKernels[kMaxTileRows + 1] = {
    nullptr,         tile_kernel<1>, tile_kernel<2>, tile_kernel<3>,  tile_kernel<4>,  tile_kernel<5>,  tile_kernel<6>,
    tile_kernel<7>,  tile_kernel<8>, tile_kernel<9>, tile_kernel<10>, tile_kernel<11>, tile_kernel<12>};

// W [N, K] float32 -> panels [ceil(N / 32), K, 32], zero-padded past column N.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_linear_weight: weight must be a float32 [out, in] matrix on the CPU");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  auto padded = at::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, kPanel, k}).permute({0, 2, 1}).contiguous();
}

// Rows per tile: as even as possible, at most kMaxTileRows (16 rows: 8 + 8, not 12 + 4).
int64_t tile_rows(int64_t rows) {
  const int64_t tiles = (rows + kMaxTileRows - 1) / kMaxTileRows;
  return (rows + tiles - 1) / tiles;
}

// y = x @ W.T + b: x [M, K] float32, panels from pack_linear_weight, bias [N] or none.
at::Tensor packed_linear(const at::Tensor& x_in, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  TORCH_CHECK(x_in.device().is_cpu() && panels.device().is_cpu() && (!bias.has_value() || bias->device().is_cpu()),
              "packed_linear: x, the weight and the bias must be CPU tensors");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "packed_linear: x must be a float32 [M, K] matrix");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
                  panels.scalar_type() == at::kFloat,
              "packed_linear: weight must come from pack_linear_weight");
  TORCH_CHECK(panels.size(1) == x_in.size(1), "packed_linear: x and the packed weight differ in input features");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(panels.data_ptr()) % 64 == 0,
              "packed_linear: the packed weight must be 64-byte aligned (a whole tensor, not a view)");
  const int64_t num_panels = panels.size(0), k = panels.size(1), n = out_features;
  TORCH_CHECK(n > (num_panels - 1) * kPanel && n <= num_panels * kPanel,
              "packed_linear: out_features does not match the packed weight");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->is_contiguous() && bias->numel() == n &&
                                     bias->scalar_type() == at::kFloat),
              "packed_linear: bias must be a contiguous float32 [out_features]");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t m = x.size(0);
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const int64_t rows = tile_rows(m);
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t col = p * kPanel;
      for (int64_t r = 0; r < m; r += rows) {
        const int64_t count = std::min(rows, m - r);
        const Tile tile{xp + r * x.stride(0), x.stride(0), wp + p * k * kPanel, k, op + r * n + col, n,
                        std::min(kPanel, n - col), bp == nullptr ? nullptr : bp + col};
        kTileKernels[count](tile);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(weft, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(weft, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
}
