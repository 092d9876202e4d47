// Whole decoder blocks of native layers over the lean KV cache (block.cpp): x [b, T, E];
// cos, sin [b, 1, T, D]; keys, values: the layer's cache [B, H_kv, S, D]; rows[i], starts[i]:
// row i's cache row and first slot; mask: which slots each query sees, bool [b, T, S'] (a
// token tree's), or none: query t of row i sees slots 0..starts[i] + t (causal); params: the
// two norm weights (float32), then each of q, k, v, o, gate, up, down as its kernel holds it.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

using DecoderBlock = torch::Tensor(const torch::Tensor& x, const torch::Tensor& cos,
                                   const torch::Tensor& sin, const torch::Tensor& keys,
                                   const torch::Tensor& values, const std::vector<int64_t>& rows,
                                   const std::vector<int64_t>& starts,
                                   const std::optional<torch::Tensor>& mask,
                                   const std::vector<torch::Tensor>& params, double eps,
                                   int64_t heads, int64_t kv_heads);

extern DecoderBlock* const int8_block;  // int8 layers (int8_linear)
extern DecoderBlock* const int4_block;  // int4 layers (int4_linear)
extern DecoderBlock* const bf16_block;  // bfloat16 layers on AMX tiles (bf16_linear)

// A model's decoder blocks, all of one kind ("int8", "int4" or "bf16"), in one call: x through
// each layer's block in turn, layer l over keys[l] and values[l] (the whole cache [L, B, H_kv,
// S, D]), the rotary tables read as float32 once. The same computation, bit for bit, as one
// block call per layer, without a Python call and 23 tensors converted per layer: a one-token
// draft step makes 24 such calls.
class DecoderStack {
 public:
  DecoderStack(const std::string& kind, std::vector<std::vector<torch::Tensor>> layers,
               double eps, int64_t heads, int64_t kv_heads);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& keys, const torch::Tensor& values,
                        const std::vector<int64_t>& rows, const std::vector<int64_t>& starts,
                        const std::optional<torch::Tensor>& mask) const;

 private:
  DecoderBlock* block_;
  std::vector<std::vector<torch::Tensor>> layers_;  // each layer's params (see above)
  double eps_;
  int64_t heads_, kv_heads_;
};
