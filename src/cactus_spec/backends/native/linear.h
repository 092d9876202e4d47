// The linear layers of the decode regime (a few rows against a large weight): int8 codes
// (int8_linear.cpp) and bfloat16 on AMX tiles (bf16_linear.cpp). Each kernel turns its input
// rows into its own form once (quantise_rows, bf16_rows), so layers that read the same input
// (q, k, v; gate, up) share it, then multiplies them by a packed weight into float32 sums.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

// Input rows quantised to uint8 codes, each on its own range: x[r] ~ mid[r] + step[r] (u - 128).
struct Rows {
  std::vector<uint8_t> u;  // [M', K4] codes, zero padded (rows to whole AMX tiles)
  std::vector<float> mid, step;
  int64_t k4;  // K rounded up to 64
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

// Input rows rounded to bfloat16 (bits), K zero padded to the packing's K2, and the rows
// zero padded to a whole number of AMX tiles.
struct Bf16Rows {
  std::vector<uint16_t> x;  // [M', K2]
  int64_t m, k2;
};

// A linear layer's bfloat16 weight: pack_bf16 of it and a float32 bias [N] (zeros when the
// layer has none), which also gives N.
struct Bf16Weight {
  torch::Tensor packed, bias;
};

Bf16Rows bf16_rows(const float* x, int64_t m, int64_t k, int64_t k2);

// out [M, N] = the rows' products with the weight (float32 sums) plus its bias.
void bf16_products(const Bf16Rows& rows, const Bf16Weight& w, float* out);

torch::Tensor pack_bf16(const torch::Tensor& w);
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& bias);
