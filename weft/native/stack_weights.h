// The weights of a whole decoder stack (decoder.cpp), handed to the kernel once, when the model is
// loaded, as a torch custom class (`torch.classes.weft.StackWeights`): a step then passes one object
// where it passed every layer's tensors (13 a layer, and a mixture of experts' 2 a routed expert:
// 12,000 tensors at Qwen3-30B-A3B's shape, a millisecond a step to convert from a Python list).
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <vector>

namespace weft {

// A layer's mixture of experts, as model/moe.py's SparseMoE holds it (Qwen3-MoE, Mixtral, Qwen2-MoE,
// gpt-oss): its router, each expert's gate|up and down matrices (gpt-oss's with biases), and
// Qwen2-MoE's shared expert's gate (the shared expert's own matrices are the layer's MLP weights,
// kGateUp and kDown). An expert's matrix is int8 dot panels, or (`expert_weights="file"`) its parts
// in the GGUF file's own blocks, each of the kind file_dot.cpp codes (gate|up: gate's rows, then up's).
struct LayerExperts {
  at::Tensor router;  // [E, hidden] panels (packed_linear)
  at::Tensor router_bias;  // [E] float32, or empty: none
  at::Tensor shared_gate;  // [1, hidden] panels, or empty: no shared expert
  at::Tensor gate_up_bias, down_bias;  // [E, 2I] and [E, hidden] float32, or empty: none
  int64_t count = 0;  // E; 0: the layer has an MLP
  int64_t gate_up_parts = 1, down_parts = 1;  // tensors an expert's matrix (1: dot panels)
  std::vector<int64_t> gate_up_kinds, down_kinds;  // each part's kind in the file; empty: dot panels
  std::vector<at::Tensor> gate_up, down;  // E * parts each, expert by expert

  bool in_file() const { return !gate_up_kinds.empty(); }
};

// How every mixture of experts of the stack routes and multiplies (SparseMoE's settings).
struct Routing {
  int64_t top_k;  // experts per row
  bool normalize;  // the top k's weights divided by their sum (norm_topk_prob)
  int64_t hidden;  // the model's
  int64_t intermediate;  // each routed expert's columns
  int64_t shared_intermediate;  // the shared expert's (0: none)
  int64_t chunk_rows;  // a step routes its rows this many at a time (moe.py's MOE_CHUNK_BYTES)
  double limit;  // gpt-oss's clamped SwiGLU's limit (`swiglu_limit`); 0: plain SwiGLU
  double alpha;  // and its sigmoid's scale
};

struct StackWeights : torch::CustomClassHolder {
  // layers: kWeightsPerLayer tensors a layer (decoder.cpp's `Weight` order). experts: per layer
  // `experts_per_layer[i]` tensors, none for a layer with an MLP, else its router, the router's
  // bias, its shared expert's gate, its layout (for dot panels an empty tensor, else int64
  // [gate|up's parts, down's parts, their kinds...]), the experts' gate|up biases and down biases
  // (an empty tensor for each one it has not), its E gate|up matrices' parts and its E down
  // matrices' parts. routing: top_k, normalize, hidden, intermediate, shared_intermediate,
  // chunk_rows (unused without experts); swiglu: limit and alpha (limit 0: plain SwiGLU).
  StackWeights(std::vector<at::Tensor> layers, std::vector<at::Tensor> experts, std::vector<int64_t> experts_per_layer,
               std::vector<int64_t> routing, std::vector<double> swiglu);

  std::vector<at::Tensor> layers;
  std::vector<LayerExperts> experts;  // per layer (`count` 0 where it has an MLP)
  Routing routing{};
};

// The branch of a layer's mixture of experts: [T, hidden] -> [T, hidden], op for op as model/moe.py
// computes it (the same bits). shared_gate_up, shared_down: Qwen2-MoE's shared expert, else empty.
// bf16_dot: bfloat16 products where the router's or the shared expert's matrices are bfloat16.
at::Tensor experts_branch(const at::Tensor& h, const LayerExperts& e, const Routing& r,
                          const at::Tensor& shared_gate_up, const at::Tensor& shared_down, bool bf16_dot);

}  // namespace weft
