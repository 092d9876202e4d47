// bfloat16 linear layers on AMX tiles or AVX512-BF16, the hot path of the bfloat16 verifier:
//     y[r, n] = sum_k x[r, k] W[n, k] + bias[n],
// x rounded to bfloat16, products and sums in float32 (AMX's tdpbf16ps).
//
// Layout: the weight is packed as [N / 16, K2 / 2, 16, 2] (N padded to kOutTile, K to
// kKStep with zeros): 64 bytes hold 2 consecutive inputs of 16 outputs, which is the layout
// of an AMX B tile, so 16 such groups (1 KB, contiguous) are one tile of 32 inputs by 16
// outputs. A 64-output stripe of the weight streams from memory once while every tile of up
// to 16 input rows passes over it. One row costs as much as 16, and it streams faster than
// oneDNN's bf16 product at one row and at a verifier's block (benchmarks/forward_cost.py
// --configs none:native,none:onednn). Each output element's sum runs in the same order
// whatever the other rows, so a row gives the same bits alone as in any block.
// Where the CPU has no AMX but AVX512-BF16, one vdpbf16ps adds a row's next two inputs
// (broadcast) times 16 outputs' weights to 16 float32 sums, for up to kRowTile rows per pass
// over a stripe, the weight prefetched into L2 ahead (as int4_linear.cpp). has_bf16() says
// whether either path is there; else callers use oneDNN.

#include "lanes.h"
#include "linear.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx.h"

namespace {

constexpr int kBlocks = 4;                      // tiles of 16 outputs per stripe
constexpr int64_t kOutTile = kLanes * kBlocks;  // outputs per stripe (N is padded to it)
constexpr int64_t kKStep = 32;                  // inputs per tile (K is padded to it)
constexpr int64_t kTileRows = 16;               // input rows per AMX tile at most
// Input rows per pass over a stripe (AVX512; rows_per_pass): 24 of the 32 vector registers hold
// 6 rows' sums of a stripe: an 11-row block is two passes (6 + 5), measured faster than
// passes of 4 (benchmarks/forward_cost.py --tokens 11 --configs none:native); one row is
// unchanged.
constexpr int kRowTile = 6;
constexpr int64_t kAhead = 512;                 // bytes of each block prefetched ahead (AVX512)

#ifdef CACTUS_AVX512_BF16
// sums[r][j] = sum_k x[r, k] w[j, k] for R rows (k2 apart) and one stripe, in float32.
template <int R>
void dot_stripe(const uint16_t* rows, int64_t k2, const uint16_t* stripe, float (*sums)[kOutTile]) {
  const int64_t pairs = k2 / 2;
  __m512 acc[R][kBlocks];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t q = 0; q < pairs; ++q) {
    __m512i weights[kBlocks];
    for (int b = 0; b < kBlocks; ++b) {
      const uint16_t* at = stripe + (b * pairs + q) * 32;
      _mm_prefetch(reinterpret_cast<const char*>(at) + kAhead, _MM_HINT_T1);
      weights[b] = _mm512_loadu_si512(at);
    }
    for (int r = 0; r < R; ++r) {
      int32_t two;
      std::memcpy(&two, rows + r * k2 + 2 * q, 4);
      const __m512bh x = (__m512bh)_mm512_set1_epi32(two);
      for (int b = 0; b < kBlocks; ++b) {
        acc[r][b] = _mm512_dpbf16_ps(acc[r][b], x, (__m512bh)weights[b]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < kBlocks; ++b) _mm512_storeu_ps(sums[r] + b * kLanes, acc[r][b]);
}

void dot_rows(const uint16_t* rows, int count, int64_t k2, const uint16_t* stripe,
              float (*sums)[kOutTile]) {
  using Stripe = void (*)(const uint16_t*, int64_t, const uint16_t*, float(*)[kOutTile]);
  static constexpr Stripe stripes[] = {dot_stripe<1>, dot_stripe<2>, dot_stripe<3>,
                                       dot_stripe<4>, dot_stripe<5>, dot_stripe<6>};
  static_assert(sizeof(stripes) / sizeof(stripes[0]) == kRowTile, "one kernel per row count");
  stripes[count - 1](rows, k2, stripe, sums);
}
#endif

}  // namespace

Bf16Rows bf16_rows(const float* x, int64_t m, int64_t k, int64_t k2) {
  const int64_t tiles = (m + tile_rows(m) - 1) / tile_rows(m);
  Bf16Rows rows{std::vector<uint16_t>(tiles * tile_rows(m) * k2, 0), m, k2};
  for_rows(m, k, [&](int64_t r) {
    for (int64_t i = 0; i < k; ++i) rows.x[r * k2 + i] = c10::BFloat16(x[r * k + i]).x;
  });
  return rows;
}

// The weight w [N, K] bfloat16 in the packed layout: [ceil(N / kOutTile) * 4, K2 / 2, 16, 2].
torch::Tensor pack_bf16(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16,
              "w must be a bfloat16 [N, K] tensor");
  const int64_t n = w.size(0), k = w.size(1), k2 = (k + kKStep - 1) / kKStep * kKStep;
  const int64_t np = (n + kOutTile - 1) / kOutTile * kOutTile;
  auto padded = torch::zeros({np, k2}, w.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(w);
  return padded.view({np / kLanes, kLanes, k2 / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

bool has_bf16() {
#ifdef CACTUS_AVX512_BF16
  return true;
#else
  return has_amx();
#endif
}

namespace {

// The stripes of kOutTile outputs of w, checked to be pack_bf16 of a weight with the rows' K.
int64_t bf16_stripes(const Bf16Rows& rows, const Bf16Weight& w) {
  const int64_t n = w.outputs();
  TORCH_CHECK(w.packed.scalar_type() == torch::kBFloat16 && w.packed.is_contiguous() &&
                  w.packed.size(1) * 2 == rows.k2 && w.packed.size(0) * kLanes >= n &&
                  w.bias.scalar_type() == torch::kFloat,
              "packed must be pack_bf16 of a bfloat16 [N, K] weight with x's K, bias float32 [N]");
  return (n + kOutTile - 1) / kOutTile;
}

// out's columns of stripe s = every row's products with w's stripe s plus its bias, `step`
// rows a pass (on AMX tiles configured for them where amx).
void bf16_stripe(const Bf16Rows& rows, const Bf16Weight& w, int64_t s, bool amx, int64_t step,
                 float* out) {
  const int64_t m = rows.m, n = w.outputs(), k2 = rows.k2;
  const auto* weight = reinterpret_cast<const uint16_t*>(w.packed.data_ptr<at::BFloat16>());
  const float* bias = w.bias.data_ptr<float>();
  const int64_t n0 = s * kOutTile, width = std::min(kOutTile, n - n0);
  const uint16_t* stripe = weight + s * kOutTile * k2;
  float sums[kPairRows][kOutTile];
  for (int64_t r0 = 0, count; r0 < m; r0 += count) {
    count = rows_at_once(amx, m - r0, step);
#ifdef CACTUS_AMX
    if (amx) {
      const auto* tiles = reinterpret_cast<const uint8_t*>(rows.x.data() + r0 * k2);
      amx_rows</*kBf16=*/true>(tiles, count, k2 * 2, reinterpret_cast<const uint8_t*>(stripe), sums);
    }
#endif
#ifdef CACTUS_AVX512_BF16
    if (!amx) dot_rows(rows.x.data() + r0 * k2, static_cast<int>(count), k2, stripe, sums);
#endif
    for (int64_t r = 0; r < count; ++r) {
      for (int64_t j = 0; j < width; ++j) out[(r0 + r) * n + n0 + j] = sums[r][j] + bias[n0 + j];
    }
  }
}

}  // namespace

void bf16_products(const Bf16Rows& rows, std::initializer_list<Output<Bf16Weight>> layers) {
  TORCH_CHECK(has_bf16(), "bf16 products need AMX or AVX512-BF16 (has_bf16() is false)");
  const bool amx = has_amx();
  const int64_t step = amx ? tile_rows(rows.m) : rows_per_pass(rows.m, kRowTile);
  std::vector<int64_t> counts;
  for (const auto& layer : layers) counts.push_back(bf16_stripes(rows, layer.weight));
  const auto tiles = [&] { return Tiles(amx, step); };
  for_layer_stripes(counts, tiles, [&](int64_t l, int64_t s) {
    const Output<Bf16Weight>& layer = layers.begin()[l];
    bf16_stripe(rows, layer.weight, s, amx, step, layer.out);
  });
}

// y [M, N] bfloat16 = x [M, K] (any float dtype) against the packed weight, plus the bias.
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_floating_point(), "x must be a float [M, K] tensor");
  const torch::Tensor rows = x.to(torch::kFloat).contiguous();
  const int64_t m = rows.size(0), k = rows.size(1), k2 = packed.size(1) * 2;
  TORCH_CHECK(k <= k2 && k2 - k < kKStep, "packed must be pack_bf16 of a weight with x's K");
  std::vector<float> y(m * bias.size(0));
  const Bf16Weight w{packed, bias};
  bf16_products(bf16_rows(rows.data_ptr<float>(), m, k, k2), {{w, y.data()}});
  return torch::from_blob(y.data(), {m, bias.size(0)}, torch::kFloat).to(torch::kBFloat16);
}
