// The linear layers of the decode regime (a few rows against a large weight): int8 codes
// (int8_linear.cpp), int4 codes (int4_linear.cpp) and bfloat16 on AMX tiles
// (bf16_linear.cpp). Each kernel turns its input rows into its own form once (quantise_rows,
// signed_rows, bf16_rows), so layers that read the same input (q, k, v; gate, up) share it,
// then multiplies them by the layers' packed weights into float32 sums, every layer's stripes
// of outputs in one parallel region (share_stripes).
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <utility>
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

// The stripes 0 .. n - 1 of a parallel region, in one contiguous range per part (a thread):
// next(t) is part t's next stripe, from the front of its own range while it has one, then from
// the back of the others' (the next part's first), -1 once none is left. Each stripe is taken
// once (a compare-and-swap on its range's two ends).
class StripeRanges {
 public:
  StripeRanges(int64_t n, int64_t parts) : parts_(parts), ranges_(new Range[parts]) {
    for (int64_t t = 0; t < parts; ++t) ranges_[t].ends.store(ends(n * t / parts, n * (t + 1) / parts));
  }

  int64_t next(int64_t t) {
    for (int64_t i = 0; i < parts_; ++i) {
      const int64_t s = take(ranges_[(t + i) % parts_], /*front=*/i == 0);
      if (s >= 0) return s;
    }
    return -1;
  }

 private:
  struct alignas(64) Range {  // [low, high) as low | high << 32, a cache line of its own
    std::atomic<uint64_t> ends;
  };
  static uint64_t ends(int64_t low, int64_t high) {
    return static_cast<uint64_t>(low) | static_cast<uint64_t>(high) << 32;
  }
  static int64_t take(Range& range, bool front) {
    uint64_t now = range.ends.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t low = static_cast<int64_t>(now & 0xFFFFFFFFu), high = static_cast<int64_t>(now >> 32);
      if (low >= high) return -1;
      const uint64_t left = front ? ends(low + 1, high) : ends(low, high - 1);
      if (range.ends.compare_exchange_weak(now, left, std::memory_order_relaxed)) {
        return front ? low : high - 1;
      }
    }
  }

  int64_t parts_;
  std::unique_ptr<Range[]> ranges_;
};

// work(next) once on each of torch's threads (up to n of them), next() giving the thread's
// stripes of 0 .. n - 1 one at a time (StripeRanges), then -1. A thread streams its own share
// of the weight as a fixed split would, and a thread done early takes the last stripes of one
// still busy: with the split fixed, two threads sharing the memory bus finished a region 13%
// of its time apart on average (the int4 draft's one-row step on the AVX512 EPYC), the first
// idle meanwhile. Each stripe's outputs are its own, whichever thread sums them. (Handed out
// one by one to whichever thread asks, the stripes interleave, and each thread's stream of
// the weight breaks up: that step took 40% longer.)
template <class F>
void share_stripes(int64_t n, const F& work) {
  const int64_t parts = std::min<int64_t>(n, at::get_num_threads());
  if (parts <= 0) return;
  StripeRanges stripes(n, parts);
  at::parallel_for(0, parts, 1, [&](int64_t part, int64_t) {
    work([&stripes, part] { return stripes.next(part); });
  });
}

// Several layers' stripes numbered one after another (layer 0's, then layer 1's, ...), so
// that one parallel region computes them all (share_stripes): q, k and v of a one-row step
// are 14, 2 and 2 stripes, each a region's worth of waking and joining threads on its own.
class LayerStripes {
 public:
  explicit LayerStripes(const std::vector<int64_t>& counts) : first_{0} {
    for (int64_t count : counts) first_.push_back(first_.back() + count);
  }
  int64_t total() const { return first_.back(); }
  // (layer, stripe within it) of stripe i of all.
  std::pair<int64_t, int64_t> at(int64_t i) const {
    const auto layer = std::upper_bound(first_.begin(), first_.end(), i) - first_.begin() - 1;
    return {layer, i - first_[layer]};
  }

 private:
  std::vector<int64_t> first_;  // [layers + 1]: each layer's first stripe, then the total
};

// each(layer, s) for every stripe s of every layer (counts[layer] of them), all in one
// parallel region (share_stripes), each thread holding what start() gives it meanwhile (its
// AMX tiles' shape).
template <class Start, class Each>
void for_layer_stripes(const std::vector<int64_t>& counts, const Start& start, const Each& each) {
  const LayerStripes all(counts);
  share_stripes(all.total(), [&](const auto& next) {
    [[maybe_unused]] const auto held = start();
    for (int64_t i = next(); i >= 0; i = next()) {
      const auto [layer, s] = all.at(i);
      each(layer, s);
    }
  });
}

// A layer of a product: its weight and its outputs [M, N]; a product of several reads the
// same input rows.
template <class Weight>
struct Output {
  const Weight& weight;
  float* out;
};

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

// Each layer's out [M, N] = the rows' products with its weight (plus its bias).
void int8_products(const Rows& rows, std::initializer_list<Output<Int8Weight>> layers);

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

// Each layer's out [M, N] = the rows' products with its int4 weight plus its bias.
void int4_products(const SignedRows& rows, std::initializer_list<Output<Int4Weight>> layers);

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

// Each layer's out [M, N] = the rows' products with its weight (float32 sums) plus its bias.
void bf16_products(const Bf16Rows& rows, std::initializer_list<Output<Bf16Weight>> layers);

torch::Tensor pack_bf16(const torch::Tensor& w);
// Whether bf16_products can run here: AMX tiles (has_amx()) or AVX512-BF16.
bool has_bf16();
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& bias);
