// A mixture of experts in the fused decoder stack (decoder.cpp): model/moe.py's SparseMoE, op for op
// and in its order, so that a decode step's numbers are the layer path's to the bit. The router's
// softmax and top k, each row's experts grouped by expert (a row alone: its experts in two grouped
// products, `dot_linear_rows` or `file_linear_rows`), their outputs scaled, put back in row order and
// summed, and Qwen2-MoE's shared expert. What the stack saves here is the Python around them: about
// 30 operator and module calls a layer, a third of a Qwen3-30B-A3B decode step at batch 1.

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

// x [T, K] @ W.T (+ bias) through packed_linear, W [n, K] in panels (bfloat16 products where asked
// and W is bfloat16).
at::Tensor product(const at::Tensor& x, const at::Tensor& w, int64_t n, bool bf16_dot,
                   const std::optional<at::Tensor>& bias = std::nullopt) {
  return packed_linear(x, w, bias, n, bf16_dot && w.scalar_type() == at::kBFloat16);
}

// Rows x [n, K] times one of an expert's matrices (`parts` of them from `first`) plus its bias: its dot
// panels, or its parts in the file's blocks, as `Linear` multiplies them.
at::Tensor expert_product(const at::Tensor& x, const std::vector<at::Tensor>& matrices, int64_t first,
                          int64_t parts, const std::vector<int64_t>& kinds, int64_t n,
                          const std::optional<at::Tensor>& bias) {
  if (kinds.empty()) return product(x, matrices[first], n, false, bias);
  at::Tensor out = file_dot::file_linear(x, at::TensorList(matrices).slice(first, parts), kinds);
  return bias ? out.add_(*bias) : out;
}

// SwiGLU over gate|up [N, 2I] -> [N, I], or gpt-oss's clamped one (Expert.activation): gate clamped
// above and up on both sides at the limit, then (up + 1) * gate * sigmoid(alpha * gate).
at::Tensor activation(const at::Tensor& gate_up, const Routing& r) {
  if (r.limit == 0.0) return silu_mul(gate_up);
  const std::vector<at::Tensor> halves = gate_up.chunk(2, -1);  // gate, up: [N, I] each
  const at::Tensor gate = at::clamp(halves[0], std::nullopt, r.limit);
  const at::Tensor glu = gate * at::sigmoid(gate * r.alpha);
  return at::clamp(halves[1], -r.limit, r.limit).add_(1.0).mul_(glu);
}

std::optional<at::Tensor> bias_row(const at::Tensor& biases, int64_t ex) {
  return biases.numel() > 0 ? std::optional<at::Tensor>(biases[ex]) : std::nullopt;
}

// Expert `ex` over rows x [n, hidden]: down(activation(gate|up)).
at::Tensor routed_expert(const at::Tensor& x, const LayerExperts& e, int64_t ex, const Routing& r) {
  const at::Tensor gate_up = expert_product(x, e.gate_up, ex * e.gate_up_parts, e.gate_up_parts, e.gate_up_kinds,
                                            2 * r.intermediate, bias_row(e.gate_up_bias, ex));
  return expert_product(activation(gate_up, r), e.down, ex * e.down_parts, e.down_parts, e.down_kinds, x.size(1),
                        bias_row(e.down_bias, ex));
}

// Row i of x [k, K] times the matrix of the i-th of `ids` (k experts), every matrix in one call:
// `dot_linear_rows` over dot panels, `file_linear_rows` over the file's blocks.
at::Tensor rows_product(const at::Tensor& x, const std::vector<at::Tensor>& matrices, int64_t parts,
                        const std::vector<int64_t>& kinds, const int64_t* ids, int64_t n) {
  const int64_t k = x.size(0);
  std::vector<at::Tensor> chosen;
  for (int64_t i = 0; i < k; ++i) {
    const auto first = matrices.begin() + ids[i] * parts;
    chosen.insert(chosen.end(), first, first + parts);
  }
  if (!kinds.empty()) {
    std::vector<int64_t> all_kinds;
    for (int64_t i = 0; i < k; ++i) all_kinds.insert(all_kinds.end(), kinds.begin(), kinds.end());
    return file_dot::file_linear_rows(x, chosen, all_kinds, parts);
  }
  at::Tensor out = at::empty({k, n}, x.options());
  dot_linear_rows(x, chosen, out);
  return out;
}

// Each row's experts [T, k] int64 and their weights [T, k] float32 (SparseMoE.route).
std::pair<at::Tensor, at::Tensor> route(const at::Tensor& x, const LayerExperts& e, const Routing& r,
                                        bool bf16_dot) {
  const at::Tensor logits = product(x, e.router, e.count, bf16_dot, nonempty(e.router_bias));
  const at::Tensor probs = at::softmax(logits, -1);  // [T, E]
  auto [weights, chosen] = at::topk(probs, r.top_k, -1);
  if (r.normalize) weights = weights / weights.sum(-1, true);
  return {weights, chosen};
}

// One row's k experts in two grouped products: [1, hidden] -> [1, hidden] (SparseMoE._one_row).
at::Tensor one_row(const at::Tensor& x, const LayerExperts& e, const Routing& r, const at::Tensor& weights,
                   const at::Tensor& chosen) {
  const int64_t k = chosen.size(1), hidden = x.size(1);
  const at::Tensor ids = chosen.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  at::Tensor sums =
      rows_product(x.expand({k, hidden}), e.gate_up, e.gate_up_parts, e.gate_up_kinds, id, 2 * r.intermediate);
  if (e.gate_up_bias.numel() > 0) sums.add_(e.gate_up_bias.index_select(0, ids.view({-1})));  // (as a tile adds it)
  at::Tensor y = rows_product(activation(sums, r), e.down, e.down_parts, e.down_kinds, id, hidden);  // [k, hidden]
  if (e.down_bias.numel() > 0) y.add_(e.down_bias.index_select(0, ids.view({-1})));
  return y.mul_(weights.select(0, 0).unsqueeze(1)).view({1, k, hidden}).sum(1);
}

// Rows x [T, hidden], T > 1, grouped by expert: each routed expert multiplies its rows once; their
// outputs, scaled, put back in row order and summed (SparseMoE._rows).
at::Tensor grouped_rows(const at::Tensor& x, const LayerExperts& e, const Routing& r, const at::Tensor& weights,
                        const at::Tensor& chosen) {
  const int64_t rows = x.size(0), hidden = x.size(1), k = r.top_k;
  const at::Tensor flat = chosen.flatten();  // [T * k]: row t's choices at t * k ...
  const at::Tensor order = at::argsort(flat, /*stable=*/true);  // the choices grouped by expert
  const at::Tensor counts = at::bincount(flat, {}, e.count);
  const at::Tensor row_of = at::div(order, k, "floor");  // [T * k] the row of each grouped choice
  const at::Tensor scale = weights.flatten().index_select(0, order);  // [T * k]
  at::Tensor grouped = at::empty({rows * k, hidden}, x.options());
  int64_t start = 0;
  for (int64_t ex = 0; ex < e.count; ++ex) {
    const int64_t count = counts.data_ptr<int64_t>()[ex];
    if (count > 0) {
      const at::Tensor y = routed_expert(x.index_select(0, row_of.narrow(0, start, count)), e, ex, r);
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
  if (e.shared_gate.numel() > 0) {  // [T, hidden], scaled by [T, 1]
    const at::Tensor act = silu_mul(product(x, shared_gate_up, 2 * r.shared_intermediate, bf16_dot));
    at::Tensor shared = product(act, shared_down, x.size(1), bf16_dot);
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

// A layer's experts from its tensors: router, its bias, shared gate, layout, gate|up biases, down
// biases (each an empty tensor where there is none), E gate|up matrices' parts, E down matrices' parts.
LayerExperts layer_experts(const at::Tensor* t, int64_t count, const Routing& r) {
  constexpr int64_t kHead = 6;  // the tensors before the matrices
  TORCH_CHECK(count > kHead, "StackWeights: a layer's experts are its router and its bias, its shared gate, its "
              "layout, its experts' biases and their matrices");
  LayerExperts e{t[0], t[1], t[2], t[4], t[5]};
  const at::Tensor layout = t[3].contiguous();
  if (layout.numel() > 0) {  // the file's blocks: [gate|up's parts, down's parts, their kinds...]
    TORCH_CHECK(layout.scalar_type() == at::kLong && layout.numel() >= 2, "StackWeights: a layout is int64");
    const int64_t* v = layout.data_ptr<int64_t>();
    e.gate_up_parts = v[0];
    e.down_parts = v[1];
    TORCH_CHECK(e.gate_up_parts > 0 && e.down_parts > 0 && layout.numel() == 2 + e.gate_up_parts + e.down_parts,
                "StackWeights: a layout is [gate|up's parts, down's parts, then a kind for each part]");
    e.gate_up_kinds.assign(v + 2, v + 2 + e.gate_up_parts);
    e.down_kinds.assign(v + 2 + e.gate_up_parts, v + layout.numel());
  }
  const int64_t per_expert = e.gate_up_parts + e.down_parts;
  TORCH_CHECK((count - kHead) % per_expert == 0, "StackWeights: every expert's matrices must have their parts");
  e.count = (count - kHead) / per_expert;
  e.gate_up.assign(t + kHead, t + kHead + e.count * e.gate_up_parts);
  e.down.assign(t + kHead + e.count * e.gate_up_parts, t + count);
  for (const at::Tensor* bias : {&e.router_bias, &e.gate_up_bias, &e.down_bias}) {
    TORCH_CHECK(bias->numel() == 0 || (bias->scalar_type() == at::kFloat && bias->is_contiguous()),
                "StackWeights: the experts' biases must be contiguous float32");
  }
  if (!e.in_file()) {  // (the file's parts are checked as each product reads them)
    check_expert_panels(e.gate_up, r.hidden, "gate|up");
    check_expert_panels(e.down, r.intermediate, "down");
  }
  TORCH_CHECK(r.top_k > 0 && r.top_k <= e.count, "StackWeights: top_k must be between 1 and the number of experts");
  return e;
}

}  // namespace

StackWeights::StackWeights(std::vector<at::Tensor> layers_in, std::vector<at::Tensor> experts_in,
                           std::vector<int64_t> experts_per_layer, std::vector<int64_t> routing_in,
                           std::vector<double> swiglu)
    : layers(std::move(layers_in)) {
  TORCH_CHECK(swiglu.size() == 2, "StackWeights: swiglu is [limit, alpha]");
  TORCH_CHECK(routing_in.size() == 6, "StackWeights: routing is [top_k, normalize, hidden, intermediate, "
              "shared_intermediate, chunk_rows]");
  const std::vector<int64_t>& v = routing_in;
  routing = Routing{v[0], v[1] != 0, v[2], v[3], v[4], std::max<int64_t>(1, v[5]), swiglu[0], swiglu[1]};
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
