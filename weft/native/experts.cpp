// A mixture of experts in the fused decoder stack (decoder.cpp): model/moe.py's SparseMoE, op for op
// and in its order, so that a decode step's numbers are the layer path's to the bit. The router's
// softmax and top k, each row's experts grouped by expert (a row alone: its experts in two grouped
// products, `dot_linear_rows`), their outputs scaled, put back in row order and summed, and
// Qwen2-MoE's shared expert. What the stack saves here is the Python around them: about 30 operator
// and module calls a layer, a third of a Qwen3-30B-A3B decode step at batch 1.

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "ops.h"
#include "stack_weights.h"

namespace weft {
namespace {

// x [T, K] @ W.T through packed_linear, W [n, K] in panels (bfloat16 products where asked and W is
// bfloat16).
at::Tensor product(const at::Tensor& x, const at::Tensor& w, int64_t n, bool bf16_dot) {
  return packed_linear(x, w, std::nullopt, n, bf16_dot && w.scalar_type() == at::kBFloat16);
}

// An expert's SwiGLU over rows x [n, hidden]: down(silu(gate) * up).
at::Tensor expert(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down, int64_t intermediate,
                  bool bf16_dot) {
  return product(silu_mul(product(x, gate_up, 2 * intermediate, bf16_dot)), down, x.size(1), bf16_dot);
}

// Each row's experts [T, k] int64 and their weights [T, k] float32 (SparseMoE.route).
std::pair<at::Tensor, at::Tensor> route(const at::Tensor& x, const LayerExperts& e, const Routing& r,
                                        bool bf16_dot) {
  const int64_t count = static_cast<int64_t>(e.gate_up.size());
  const at::Tensor probs = at::softmax(product(x, e.router, count, bf16_dot), -1);  // [T, E]
  auto [weights, chosen] = at::topk(probs, r.top_k, -1);
  if (r.normalize) weights = weights / weights.sum(-1, true);
  return {weights, chosen};
}

// One row's k experts in two grouped products: [1, hidden] -> [1, hidden] (SparseMoE._one_row).
at::Tensor one_row(const at::Tensor& x, const LayerExperts& e, const Routing& r, const at::Tensor& weights,
                   const at::Tensor& chosen) {
  const int64_t k = chosen.size(1), hidden = x.size(1);
  const at::Tensor ids = chosen.contiguous();
  std::vector<at::Tensor> gate_up, down;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t id = ids.data_ptr<int64_t>()[i];
    gate_up.push_back(e.gate_up[id]);
    down.push_back(e.down[id]);
  }
  at::Tensor sums = at::empty({k, 2 * r.intermediate}, x.options());  // [k, 2I]
  dot_linear_rows(x.expand({k, hidden}), gate_up, sums);
  const at::Tensor act = silu_mul(sums);  // [k, I]
  at::Tensor y = at::empty({k, hidden}, x.options());
  dot_linear_rows(act, down, y);
  return y.mul_(weights.select(0, 0).unsqueeze(1)).view({1, k, hidden}).sum(1);
}

// Rows x [T, hidden], T > 1, grouped by expert: each routed expert multiplies its rows once; their
// outputs, scaled, put back in row order and summed (SparseMoE._rows).
at::Tensor grouped_rows(const at::Tensor& x, const LayerExperts& e, const Routing& r, const at::Tensor& weights,
                        const at::Tensor& chosen) {
  const int64_t rows = x.size(0), hidden = x.size(1), k = r.top_k;
  const at::Tensor flat = chosen.flatten();  // [T * k]: row t's choices at t * k ...
  const at::Tensor order = at::argsort(flat, /*stable=*/true);  // the choices grouped by expert
  const at::Tensor counts = at::bincount(flat, {}, static_cast<int64_t>(e.gate_up.size()));
  const at::Tensor row_of = at::div(order, k, "floor");  // [T * k] the row of each grouped choice
  const at::Tensor scale = weights.flatten().index_select(0, order);  // [T * k]
  at::Tensor grouped = at::empty({rows * k, hidden}, x.options());
  int64_t start = 0;
  for (size_t ex = 0; ex < e.gate_up.size(); ++ex) {
    const int64_t count = counts.data_ptr<int64_t>()[ex];
    if (count > 0) {
      const at::Tensor y = expert(x.index_select(0, row_of.narrow(0, start, count)), e.gate_up[ex], e.down[ex],
                                  r.intermediate, false);
      at::Tensor out = grouped.narrow(0, start, count);
      at::mul_out(out, y, scale.narrow(0, start, count).unsqueeze(1));
    }
    start += count;
  }
  const at::Tensor placed = at::empty_like(grouped).index_copy_(0, order, grouped);  // [T * k, hidden]
  return placed.view({rows, k, hidden}).sum(1);
}

// One chunk of rows through the experts, Qwen2-MoE's shared expert added.
at::Tensor chunk_branch(const at::Tensor& x, const LayerExperts& e, const Routing& r, const at::Tensor& shared_gate_up,
                        const at::Tensor& shared_down, bool bf16_dot) {
  const auto [weights, chosen] = route(x, e, r, bf16_dot);
  at::Tensor out = x.size(0) == 1 ? one_row(x, e, r, weights, chosen) : grouped_rows(x, e, r, weights, chosen);
  if (e.shared_gate.defined()) {  // [T, hidden], scaled by [T, 1]
    at::Tensor shared = expert(x, shared_gate_up, shared_down, r.shared_intermediate, bf16_dot);
    out.add_(shared.mul_(at::sigmoid(product(x, e.shared_gate, 1, bf16_dot))));
  }
  return out;
}

void check_expert_panels(const std::vector<at::Tensor>& panels, int64_t k, const char* what) {
  for (const at::Tensor& p : panels) {
    TORCH_CHECK(is_dot_panels(p, k) && p.device().is_cpu() && p.sizes() == panels[0].sizes() &&
                    reinterpret_cast<uintptr_t>(p.data_ptr()) % 64 == 0,
                "StackWeights: every expert's ", what, " must be int8 dot panels of one shape (whole tensors)");
  }
}

// A layer's experts from its tensors: router, shared gate (or empty), E gate|up, E down.
LayerExperts layer_experts(const at::Tensor* t, int64_t count, const Routing& r) {
  TORCH_CHECK(count >= 4 && count % 2 == 0,
              "StackWeights: a layer's experts are its router, its shared gate and two matrices an expert");
  const int64_t num = (count - 2) / 2;
  LayerExperts e{t[0], t[1].numel() > 0 ? t[1] : at::Tensor(), {t + 2, t + 2 + num}, {t + 2 + num, t + count}};
  check_expert_panels(e.gate_up, r.hidden, "gate|up");
  check_expert_panels(e.down, r.intermediate, "down");
  TORCH_CHECK(r.top_k > 0 && r.top_k <= num, "StackWeights: top_k must be between 1 and the number of experts");
  return e;
}

}  // namespace

StackWeights::StackWeights(std::vector<at::Tensor> layers_in, std::vector<at::Tensor> experts_in,
                           std::vector<int64_t> experts_per_layer, std::vector<int64_t> routing_in)
    : layers(std::move(layers_in)) {
  TORCH_CHECK(routing_in.size() == 6, "StackWeights: routing is [top_k, normalize, hidden, intermediate, "
              "shared_intermediate, chunk_rows]");
  const std::vector<int64_t>& v = routing_in;
  routing = Routing{v[0], v[1] != 0, v[2], v[3], v[4], std::max<int64_t>(1, v[5])};
  int64_t offset = 0;
  for (const int64_t count : experts_per_layer) {
    TORCH_CHECK(count >= 0 && offset + count <= static_cast<int64_t>(experts_in.size()),
                "StackWeights: experts_per_layer counts more tensors than experts holds");
    experts.push_back(count == 0 ? LayerExperts{} : layer_experts(experts_in.data() + offset, count, routing));
    offset += count;
  }
  TORCH_CHECK(offset == static_cast<int64_t>(experts_in.size()),
              "StackWeights: experts_per_layer must count every tensor of experts");
}

at::Tensor experts_branch(const at::Tensor& h, const LayerExperts& e, const Routing& r,
                          const at::Tensor& shared_gate_up, const at::Tensor& shared_down, bool bf16_dot) {
  const int64_t rows = h.size(0);
  if (rows <= r.chunk_rows) return chunk_branch(h, e, r, shared_gate_up, shared_down, bf16_dot);
  at::Tensor out = at::empty_like(h);  // [T, hidden]: a long step, chunk_rows rows at a time
  for (int64_t start = 0; start < rows; start += r.chunk_rows) {
    const int64_t n = std::min(r.chunk_rows, rows - start);
    out.narrow(0, start, n).copy_(chunk_branch(h.narrow(0, start, n), e, r, shared_gate_up, shared_down, bf16_dot));
  }
  return out;
}

}  // namespace weft
