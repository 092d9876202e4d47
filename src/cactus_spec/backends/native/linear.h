// The linear layers of the decode regime (a few rows against a large weight): int8 codes
// (int8_linear.cpp), int4 codes (int4_linear.cpp) and bfloat16 on AMX tiles
// (bf16_linear.cpp). Each kernel turns its input rows into its own form once (quantise_rows,
// signed_rows, bf16_rows), so layers that read the same input (q, k, v; gate, up) share it,
// then multiplies them by a packed weight into float32 sums.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

// each(r) for r in [0, m), rows of `width` elements split among torch's threads where each
// thread gets enough elements to pay for waking it (a verification's 11 rows of 1,536; a
// prompt's chunk), on the calling thread otherwise (a decode step's one row).
template <class F>
void for_rows(int64_t m, int64_t width, const F& each) {
  constexpr int64_t kElementsPerThread = 8192;
  const int64_t rows_per_thread =
      std::max<int64_t>(1, kElementsPerThread / std::max<int64_t>(1, width));
  at::parallel_for(0, m, rows_per_thread, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) each(r);
  });
}

// Rows per pass over a stripe for m >= 0 rows: the fewest passes of at most `most` rows,
// split evenly (11 rows, at most 6: 6 + 5; 16 rows, at most 12: 8 + 8); 0 for m = 0, so no
// pass runs.
inline int64_t rows_per_pass(int64_t m, int64_t most) {
  const int64_t passes = m > most ? (m + most - 1) / most : 1;
  return (m + passes - 1) / passes;
}

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
  int64_t outputs() const { return scale.size(0); }
};

Rows quantise_rows(const float* x, int64_t m, int64_t k);

// out [M, N] = the rows' products with the weight (plus its bias).
void int8_products(const Rows& rows, const Int8Weight& w, float* out);

torch::Tensor pack_int8(const torch::Tensor& w);
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scale, const torch::Tensor& code_sums,
                          const c10::optional<torch::Tensor>& bias);

// Input rows quantised to int8 codes symmetrically, each on its own range, x[r] ~ step[r] v,
// with each group of 64 codes' sum (int4_linear.cpp).
struct SignedRows {
  std::vector<int8_t> v;         // [M, K4] codes, K zero padded
  std::vector<float> step;       // [M]
  std::vector<int32_t> sums;     // [M, K4 / 64]
  int64_t k4;                    // K rounded up to 64
};

// A linear layer's int4 weight: pack_int4 codes with float16 scales and low ends per group of
// 64 inputs (as int16 bits), and a float32 bias [N] (zeros when the layer has none).
struct Int4Weight {
  torch::Tensor packed, scales, bias;
  int64_t outputs() const { return bias.size(0); }
};

SignedRows signed_rows(const float* x, int64_t m, int64_t k);

// out [M, N] = the rows' products with the int4 weight plus its bias.
void int4_products(const SignedRows& rows, const Int4Weight& w, float* out);

std::vector<torch::Tensor> pack_int4(const torch::Tensor& codes, const torch::Tensor& scale,
                                     const torch::Tensor& low);
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales, const torch::Tensor& bias);

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
  int64_t outputs() const { return bias.size(0); }
};

Bf16Rows bf16_rows(const float* x, int64_t m, int64_t k, int64_t k2);

// out [M, N] = the rows' products with the weight (float32 sums) plus its bias.
void bf16_products(const Bf16Rows& rows, const Bf16Weight& w, float* out);

torch::Tensor pack_bf16(const torch::Tensor& w);
// Whether bf16_products can run here: AMX tiles (has_amx()) or AVX512-BF16.
bool has_bf16();
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& bias);
