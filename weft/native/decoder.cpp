// A whole decoder stack (the Llama family, with Qwen3's per-head q/k norms, Granite's residual scale,
// SmolLM3's layers without rotary embedding, and Gemma's norms around each branch, GeGLU, soft-capped
// scores and sliding-window layers in a pool of their own, where a model has them) for a step whose
// rows each attend as one query (decode tokens, and fast-forwarded tokens taken token by token):
// every layer's RMSNorm, fused q/k/v projection, rotary embedding, KV-cache write, paged attention,
// output projection, residual adds and gated MLP, in one call. The kernels are those of torch.ops.weft.*
// (ops.h); what this saves is the Python around them: about a dozen operator calls and module calls
// per layer, which at one row per step cost more than a third of the time outside the matrix
// products (docs/benchmarks.md).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "panels.h"
#include "stack_weights.h"

namespace {

// Per layer, in this order (see weft/model/llama.py, `_stack_weights`):
// kQkvTail: the fused q/k/v's rows after kQkv's where they come in another dot layout (a Q4_K_M file's
// Q6_K v beside Q4_K q and k, `PartedRows`), or an empty tensor; kQNorm, kKNorm: each head's RMSNorm
// of q and of k (Qwen3's and Gemma 3's [D] weights), or empty tensors; kPostNorm: the MLP's input norm;
// kAttnOutNorm, kMlpOutNorm: the norms of each branch's output before it joins the residual stream
// (Gemma's sandwich layers), or empty tensors; kSinks: each head's attention sink (gpt-oss's float32
// [H]), or an empty tensor.
enum Weight {
  kInputNorm, kQkv, kQkvTail, kQkvBias, kO, kOBias, kPostNorm, kGateUp, kDown, kQNorm, kKNorm, kAttnOutNorm,
  kMlpOutNorm, kSinks, kWeightsPerLayer
};

struct StackShape {
  int64_t num_heads, num_kv_heads, head_dim, hidden, intermediate;
  double eps, scale;
  bool bf16_dot;  // bfloat16 products (packed_linear's bf16_dot) in every matrix
  double residual_scale;  // each branch's output times this before it is added (Granite's; 1 elsewhere)
  bool sandwich;  // each branch's output normed before it is added (Gemma: kAttnOutNorm, kMlpOutNorm)
  bool gelu;  // GeGLU with tanh's GELU in the MLP (Gemma), else SwiGLU
  double softcap;  // attention scores -> softcap * tanh(score / softcap) (Gemma 2); 0: none
};

// Where one layer's attention reads and writes: its pool's slots and block tables (a sliding-window
// layer's may be a pool of its own), its window (0: every key), its rotary tables (none: no rotation).
struct LayerAttention {
  const at::Tensor* slots;
  const at::Tensor* block_table;
  const at::Tensor* context_lens;
  int64_t window;
  const at::Tensor* cos;  // nullptr: q and k as they are (SmolLM3's NoPE layers)
  const at::Tensor* sin;
};

// x += delta (times the residual scale, rounded before the add as the layer path rounds it).
void add_branch(at::Tensor& x, at::Tensor delta, const StackShape& s) {
  if (s.residual_scale != 1.0) delta.mul_(s.residual_scale);
  x.add_(delta);
}

// packed_linear with bfloat16 products where the stack asks for them and the matrix is bfloat16.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t n,
                  const StackShape& s) {
  return weft::packed_linear(x, w, bias, n, s.bf16_dot && w.scalar_type() == at::kBFloat16);
}

// The fused q/k/v projection [T, n]: one matrix, or its two parts (kQkv's panels of 32 rows each,
// then kQkvTail's) each into its columns.
at::Tensor qkv_projection(const at::Tensor& h, const at::Tensor* w, int64_t n, const StackShape& s) {
  const std::optional<at::Tensor> bias = weft::nonempty(w[kQkvBias]);
  if (w[kQkvTail].numel() == 0) return linear(h, w[kQkv], bias, n, s);
  const int64_t head = w[kQkv].size(0) * weft::kPanel;  // the first part's rows: whole panels
  const auto part_bias = [&](int64_t start, int64_t rows) {
    return bias ? std::optional<at::Tensor>(bias->narrow(0, start, rows)) : std::nullopt;
  };
  at::Tensor out = at::empty({h.size(0), n}, h.options());
  out.narrow(1, 0, head).copy_(linear(h, w[kQkv], part_bias(0, head), head, s));
  out.narrow(1, head, n - head).copy_(linear(h, w[kQkvTail], part_bias(head, n - head), n - head, s));
  return out;
}

// One token's keys and values into its slot, rounded to the cache's type C (to nearest even, as
// torch's conversions round; Q8_0 blocks as llama.cpp quantizes them).
template <typename C>
inline void store_row(const float* src, C* dst, int64_t width) {
  if constexpr (std::is_same_v<C, float>) {
    std::memcpy(dst, src, sizeof(float) * width);
  } else if constexpr (std::is_same_v<C, weft::BlockQ8>) {
    weft::quantize_q8_row(src, dst, width);
  } else {
    for (int64_t i = 0; i < width; ++i) dst[i] = static_cast<C>(src[i]);
  }
}

// kv [T, 2 * KVH * D] float32 (keys then values of each token, rows strided) -> cache slots `slots`
// (float32, bfloat16, float16 or Q8_0 blocks), in runs of tokens per thread; `op` names the caller
// in errors.
void write_kv(const at::Tensor& kv, at::Tensor& cache, const at::Tensor& slots, const char* op) {
  const int64_t tokens = kv.size(0), width = kv.size(1);
  const int64_t num_slots = cache.size(0) * cache.size(1);
  const auto type = cache.scalar_type();
  const bool q8 = type == at::kByte;
  const int64_t row = weft::cache_units(cache, width);  // a slot's units in the cache
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous() &&
                  (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf || q8) &&
                  (!q8 || width % weft::kQ8Elements == 0) &&
                  row * (q8 ? static_cast<int64_t>(sizeof(weft::BlockQ8)) : 1) == cache[0][0].numel() &&
                  kv.scalar_type() == at::kFloat && kv.stride(1) == 1,
              op, ": the KV cache must be contiguous float32, bfloat16, float16 or Q8_0 (uint8) "
              "[blocks, block_size, 2, KVH, D] and kv float32 [T, 2, KVH, D] of its heads");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == tokens,
              op, ": slots must be [T] int64, one per token");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, op, ": slot ", sp[t], " is outside the KV cache (", num_slots, " slots)");
  const float* src = kv.data_ptr<float>();
  const auto write = [&](auto* dst) {
    at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) store_row(src + t * kv.stride(0), dst + sp[t] * row, width);
    });
  };
  if (type == at::kBFloat16) {
    write(cache.data_ptr<c10::BFloat16>());
  } else if (type == at::kHalf) {
    write(cache.data_ptr<c10::Half>());
  } else if (q8) {
    write(reinterpret_cast<weft::BlockQ8*>(cache.data_ptr<uint8_t>()));
  } else {
    write(cache.data_ptr<float>());
  }
}

// A step's keys and values into the paged cache at their slots: what
// cache.view(-1, 2, KVH, D).index_copy_(0, slots, kv) does, from kv [T, 2, KVH, D] whose rows may be
// strided (the k|v part of a q|k|v projection's output), without a contiguous copy of them.
void write_kv_(at::Tensor& kv_cache, const at::Tensor& kv, const at::Tensor& slots) {
  TORCH_CHECK(kv_cache.device().is_cpu() && kv.device().is_cpu() && slots.device().is_cpu(),
              "write_kv_: the KV cache, kv and slots must be CPU tensors");
  TORCH_CHECK(kv.dim() == 4 && kv.stride(3) == 1 && kv.stride(2) == kv.size(3) && kv.stride(1) == kv.size(2) * kv.size(3),
              "write_kv_: kv must be [T, 2, KVH, D] with each token's keys and values contiguous");
  write_kv(kv.view({kv.size(0), -1}), kv_cache, slots, "write_kv_");
}

// Heads [first, first + count) of qkv [T, heads, D] through RMSNorm with weight [D], in place: the
// copy, norm and copy back of the layer path (`Attention._norm_qk`), so the same bits.
void norm_heads(at::Tensor& qkv, int64_t first, int64_t count, const at::Tensor& weight, double eps) {
  at::Tensor heads = qkv.narrow(1, first, count);
  heads.copy_(weft::rms_norm(heads.reshape({-1, qkv.size(2)}), weight, eps).view(heads.sizes()));
}

// The attention branch's output [T, hidden] (before the residual add) from its input h [T, hidden].
at::Tensor attention(const at::Tensor& h, const at::Tensor* w, at::Tensor& cache, const LayerAttention& a,
                     const at::Tensor& positions, const StackShape& s) {
  const int64_t tokens = h.size(0), heads = s.num_heads, kv_heads = s.num_kv_heads, d = s.head_dim;
  at::Tensor qkv = qkv_projection(h, w, (heads + 2 * kv_heads) * d, s).view({tokens, heads + 2 * kv_heads, d});
  if (w[kQNorm].numel() > 0) {
    norm_heads(qkv, 0, heads, w[kQNorm], s.eps);
    norm_heads(qkv, heads, kv_heads, w[kKNorm], s.eps);
  }
  at::Tensor qk = qkv.narrow(1, 0, heads + kv_heads);
  if (a.cos != nullptr) weft::rope_(qk, positions, *a.cos, *a.sin, heads + kv_heads);
  write_kv(qkv.view({tokens, -1}).narrow(1, heads * d, 2 * kv_heads * d), cache, *a.slots, "decoder_stack_");
  at::Tensor attn = weft::paged_decode_attention(qkv.narrow(1, 0, heads), cache, *a.block_table, *a.context_lens,
                                                 s.scale, a.window, s.softcap, weft::nonempty(w[kSinks]));
  return linear(attn.view({tokens, heads * d}), w[kO], weft::nonempty(w[kOBias]), s.hidden, s);
}

// The MLP branch's output [T, hidden] from its input h [T, hidden].
at::Tensor mlp(const at::Tensor& h, const at::Tensor* w, const StackShape& s) {
  at::Tensor gate_up = linear(h, w[kGateUp], std::nullopt, 2 * s.intermediate, s);
  at::Tensor act = s.gelu ? weft::gelu_mul(gate_up) : weft::silu_mul(gate_up);
  return linear(act, w[kDown], std::nullopt, s.hidden, s);
}

// The MLP's branch, or the layer's mixture of experts' (experts.cpp) where it has one.
at::Tensor mlp_or_experts(const at::Tensor& h, const at::Tensor* w, const weft::LayerExperts& experts,
                          const weft::Routing& routing, const StackShape& s) {
  if (experts.count == 0) return mlp(h, w, s);
  return weft::experts_branch(h, experts, routing, w[kGateUp], w[kDown], s.bf16_dot);
}

// One layer on the residual stream x [T, hidden], in place: x += attention(norm(x)), then
// x += mlp(norm(x)) (or its experts'); in a sandwich layer each branch's output is normed before it
// is added (the layer path's `add_normed_`, so the same bits).
void decoder_layer(at::Tensor& x, const weft::StackWeights& weights, int64_t layer, at::Tensor& cache,
                   const LayerAttention& a, const at::Tensor& positions, const StackShape& s) {
  const at::Tensor* w = &weights.layers[layer * kWeightsPerLayer];
  at::Tensor h = weft::rms_norm(x, w[kInputNorm], s.eps);
  at::Tensor out = attention(h, w, cache, a, positions, s);
  if (s.sandwich) {
    h = weft::add_normed_(x, out, w[kAttnOutNorm], w[kPostNorm], s.eps);
  } else {
    add_branch(x, out, s);
    h = weft::rms_norm(x, w[kPostNorm], s.eps);
  }
  out = mlp_or_experts(h, w, weights.experts[layer], weights.routing, s);
  if (s.sandwich) {
    weft::add_normed_(x, out, w[kMlpOutNorm], std::nullopt, s.eps);
  } else {
    add_branch(x, out, s);
  }
}

// Layer `layer`'s attention: the window tables where its window is set, its rotary tables.
LayerAttention layer_attention(int64_t layer, const at::Tensor& slots, const at::Tensor& block_table,
                               const at::Tensor& context_lens, at::TensorList window_meta, at::TensorList cos,
                               at::TensorList sin, at::IntArrayRef layer_rope, at::IntArrayRef layer_window) {
  const int64_t window = layer_window.empty() ? 0 : layer_window[layer];
  const int64_t rope = layer_rope.empty() ? 0 : layer_rope[layer];
  const bool own = window > 0 && !window_meta.empty();  // the window's own pool
  return LayerAttention{own ? &window_meta[0] : &slots, own ? &window_meta[1] : &block_table,
                        own ? &window_meta[2] : &context_lens, window, rope < 0 ? nullptr : &cos[rope],
                        rope < 0 ? nullptr : &sin[rope]};
}

void check_stack_args(const at::Tensor& x, const weft::StackWeights& weights, int64_t layers,
                      const at::Tensor& slots, at::TensorList window_meta, at::TensorList cos, at::TensorList sin,
                      at::IntArrayRef layer_rope, at::IntArrayRef layer_window, const StackShape& s) {
  TORCH_CHECK(static_cast<int64_t>(weights.layers.size()) == layers * kWeightsPerLayer &&
                  static_cast<int64_t>(weights.experts.size()) == layers,
              "decoder_stack_: expected ", kWeightsPerLayer,
              " weights and one set of experts (or none) per layer");
  TORCH_CHECK(layer_rope.empty() || static_cast<int64_t>(layer_rope.size()) == layers,
              "decoder_stack_: layer_rope must be empty or one index per layer");
  TORCH_CHECK(layer_window.empty() || static_cast<int64_t>(layer_window.size()) == layers,
              "decoder_stack_: layer_window must be empty or one window per layer");
  TORCH_CHECK(!cos.empty() && cos.size() == sin.size(), "decoder_stack_: cos and sin must be lists of one length");
  for (const int64_t rope : layer_rope)
    TORCH_CHECK(rope >= -1 && rope < static_cast<int64_t>(cos.size()), "decoder_stack_: layer_rope ", rope,
                " names no cos/sin table");
  TORCH_CHECK(window_meta.empty() || window_meta.size() == 3,
              "decoder_stack_: window_meta must be empty or [slots, block_table, context_lens]");
  TORCH_CHECK(window_meta.empty() ||
                  (window_meta[0].scalar_type() == at::kLong && window_meta[0].numel() == x.size(0)),
              "decoder_stack_: the window's slots must be [T] int64");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat &&
                  x.size(1) == s.hidden,
              "decoder_stack_: x must be contiguous float32 [T, hidden]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == x.size(0),
              "decoder_stack_: slots must be [T] int64");
}

// x [T, hidden] float32, updated in place through every layer. weights: kWeightsPerLayer per layer
// (an empty tensor for a missing bias or norm) and each layer's experts (stack_weights.h);
// kv_caches: one per layer; slots [T], block_table [T, max_blocks], context_lens [T] and positions
// [T] int64: row t is one query whose context (itself included) is context_lens[t] tokens. cos, sin:
// the rotary tables [P, D / 2] of the model and of the layers that rotate otherwise. shape:
// num_heads, num_kv_heads, head_dim, hidden, intermediate. bf16_dot: bfloat16 products in every
// matrix (bfloat16 weights; see linear.cpp). residual_scale: Granite's residual multiplier (1
// elsewhere). layer_rope: per layer, its index in cos and sin (-1: no rotation, SmolLM3's NoPE
// layers); empty: every layer's 0. sandwich, gelu, softcap: Gemma's norms around each branch, its
// GeGLU, Gemma 2's soft-capped scores. layer_window: per layer, the keys a query sees (0: all; empty:
// every layer's 0); window_meta: [slots, block_table, context_lens] of the sliding-window layers' own
// pool, or empty (they share the model's).
void decoder_stack_(at::Tensor& x, const c10::intrusive_ptr<weft::StackWeights>& weights, at::TensorList kv_caches,
                    const at::Tensor& slots, const at::Tensor& block_table, const at::Tensor& context_lens,
                    const at::Tensor& positions, at::TensorList cos, at::TensorList sin, at::IntArrayRef shape,
                    double eps, double scale, bool bf16_dot, double residual_scale, at::IntArrayRef layer_rope,
                    bool sandwich, bool gelu, double softcap, at::IntArrayRef layer_window,
                    at::TensorList window_meta) {
  TORCH_CHECK(shape.size() == 5, "decoder_stack_: shape must be [heads, kv_heads, head_dim, hidden, intermediate]");
  const StackShape s{shape[0], shape[1], shape[2], shape[3], shape[4], eps, scale, bf16_dot, residual_scale,
                     sandwich, gelu, softcap};
  const auto layers = static_cast<int64_t>(kv_caches.size());
  check_stack_args(x, *weights, layers, slots, window_meta, cos, sin, layer_rope, layer_window, s);
  for (int64_t layer = 0; layer < layers; ++layer) {
    at::Tensor cache = kv_caches[layer];
    const LayerAttention a =
        layer_attention(layer, slots, block_table, context_lens, window_meta, cos, sin, layer_rope, layer_window);
    decoder_layer(x, *weights, layer, cache, a, positions, s);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(weft, m) {
  m.class_<weft::StackWeights>("StackWeights")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                       std::vector<double>>());
  m.def(
      "decoder_stack_(Tensor(a!) x, __torch__.torch.classes.weft.StackWeights weights, Tensor(b!)[] kv_caches, "
      "Tensor slots, Tensor block_table, Tensor context_lens, Tensor positions, Tensor[] cos, Tensor[] sin, "
      "int[] shape, float eps, float scale, bool bf16_dot, float residual_scale, int[] layer_rope, bool sandwich, "
      "bool gelu, float softcap, int[] layer_window, Tensor[] window_meta) -> ()");
  m.def("write_kv_(Tensor(a!) kv_cache, Tensor kv, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(weft, CPU, m) {
  m.impl("decoder_stack_", &decoder_stack_);
  m.impl("write_kv_", &write_kv_);
}
