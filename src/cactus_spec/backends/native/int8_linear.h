// Int8 linear layers for the decode regime: see int8_linear.cpp.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

// Input rows quantised to uint8 codes, each on its own range: x[r] ~ mid[r] + step[r] (u - 128).
struct Rows {
  std::vector<uint8_t> u;  // [M, K4] codes, zero padded
  std::vector<float> mid, step;
  int64_t k4;  // K rounded up to 4
};

// A linear layer's int8 weight: pack_int8 codes, per-output scales and code sums, a bias
// (undefined when the layer has none).
struct Int8Weight {
  torch::Tensor packed, scale, code_sums, bias;
};

Rows quantise_rows(const float* x, int64_t m, int64_t k);

// out [M, N] = the rows' products with the weight (plus its bias).
void int8_products(const Rows& rows, const Int8Weight& w, float* out);

torch::Tensor pack_int8(const torch::Tensor& w);
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scale, const torch::Tensor& code_sums,
                          const c10::optional<torch::Tensor>& bias);
bool has_vnni();
