// Int4 linear layers for the one-row draft step, whose time is the bytes of weight it reads:
// 4-bit codes in groups of 64 inputs, each group with a float16 scale and low end,
//     W[n, k] ~ low[n, g] + s[n, g] * c[n, k],   c in 0..15,   g = k / 64.
// Each input row is quantised symmetrically to int8 on its own range (signed_rows),
// x[r, k] ~ step[r] * v[r, k] with v in -127..127, so that
//     y[r, n] = step[r] * sum_g (s[n, g] * D[r, n, g] + low[n, g] * V[r, g]) + bias[n],
//     D[r, n, g] = sum_{k in g} c[n, k] v[r, k],   V[r, g] = sum_{k in g} v[r, k],
// both exact in int32. (Codes centred on neither side would make the float sum a difference
// of large terms; here s D and low V are each of the size of the group's product, because v
// is centred on 0.) The float work is one conversion and two fused multiply-adds per group
// of 64 inputs and 16 outputs.
//
// Layout: a stripe of 64 outputs (4 blocks of 16) per group is 2 KB, contiguous: for block b,
// 8 vectors of 64 bytes; byte 4 j + t of vector i holds output b * 16 + j's codes for inputs
// 4 i + t (low nibble) and 4 (i + 8) + t (high nibble) of the group, so that masking and
// shifting one load gives two vpdpbusd operands (codes unsigned, 4 inputs of a row broadcast
// to every lane as the signed operand). The scales of a stripe and group are 64 float16 s
// then 64 float16 low (held as int16 bits). A row takes the same steps whatever the other
// rows, so it gives the same bits alone as in any block.

#include "lanes.h"
#include "linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kBlocks = 4;                      // vectors of outputs per stripe
constexpr int64_t kOutTile = kLanes * kBlocks;  // outputs per stripe (N is padded to it)
constexpr int64_t kGroup = 64;                  // inputs per group (K is padded to it)
constexpr int64_t kGroupBytes = kOutTile * kGroup / 2;  // one stripe's codes of one group
constexpr int kRowTile = 2;                     // input rows per pass over a stripe
constexpr int64_t kAhead = 16;                  // groups prefetched ahead (32 KB)

// sums[r][j] = sum_g (s D + low V) of the header for R rows from r0 and one stripe.
#ifdef CACTUS_VNNI
template <int R>
void stripe_sums(const SignedRows& rows, int64_t r0, const uint8_t* codes,
                 const at::Half* scales, int64_t groups, float (*sums)[kOutTile]) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[R][kBlocks];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dots[R][kBlocks];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < kBlocks; ++b) dots[r][b] = _mm512_setzero_si512();
    const uint8_t* group = codes + g * kGroupBytes;
    // The hardware prefetchers fall behind a stream this dense in work per byte: ask for the
    // group kAhead further on (into L2; the next stripe's, past this one's end): measured
    // faster than none, nearer, or into L1 (benchmarks/kernel_cost.py --kind int4).
    const char* next = reinterpret_cast<const char*>(group + kAhead * kGroupBytes);
    for (int64_t line = 0; line < kGroupBytes; line += 64) _mm_prefetch(next + line, _MM_HINT_T1);
    for (int i = 0; i < 8; ++i) {
      __m512i low_quad[R], high_quad[R];
      for (int r = 0; r < R; ++r) {
        const int8_t* v = rows.v.data() + (r0 + r) * rows.k4 + g * kGroup;
        int32_t four;
        std::memcpy(&four, v + 4 * i, 4);
        low_quad[r] = _mm512_set1_epi32(four);
        std::memcpy(&four, v + 4 * (i + 8), 4);
        high_quad[r] = _mm512_set1_epi32(four);
      }
      for (int b = 0; b < kBlocks; ++b) {
        const __m512i packed = _mm512_loadu_si512(group + (b * 8 + i) * 64);
        const __m512i low = _mm512_and_si512(packed, nibble);
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
        for (int r = 0; r < R; ++r) {
          dots[r][b] = dpbusd(dots[r][b], low, low_quad[r]);
          dots[r][b] = dpbusd(dots[r][b], high, high_quad[r]);
        }
      }
    }
    const at::Half* scale = scales + g * 2 * kOutTile;
    for (int b = 0; b < kBlocks; ++b) {
      const auto* s_bits = reinterpret_cast<const __m256i*>(scale + b * kLanes);
      const auto* low_bits = reinterpret_cast<const __m256i*>(scale + kOutTile + b * kLanes);
      const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(s_bits));
      const __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256(low_bits));
      for (int r = 0; r < R; ++r) {
        const __m512 sum = _mm512_set1_ps(static_cast<float>(rows.sums[(r0 + r) * groups + g]));
        acc[r][b] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(dots[r][b]), acc[r][b]);
        acc[r][b] = _mm512_fmadd_ps(low, sum, acc[r][b]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < kBlocks; ++b) _mm512_storeu_ps(sums[r] + b * kLanes, acc[r][b]);
}
#elif defined(CACTUS_AVX2)
// The same steps on halves of 8 lanes, so the same bits: each group's products exact in
// int32 (AVX-VNNI's vpdpbusd, or vpmaddubsw on codes <= 15 against |v| <= 127, which int16
// holds, then vpmaddwd), then the same two fused multiply-adds per lane.
template <int R>
void stripe_sums(const SignedRows& rows, int64_t r0, const uint8_t* codes,
                 const at::Half* scales, int64_t groups, float (*sums)[kOutTile]) {
  constexpr int kHalves = 2 * kBlocks;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
#ifndef CACTUS_AVX_VNNI
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[R][kHalves];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < kHalves; ++h) acc[r][h] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i dots[R][kHalves];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < kHalves; ++h) dots[r][h] = _mm256_setzero_si256();
    const uint8_t* group = codes + g * kGroupBytes;
    const char* next = reinterpret_cast<const char*>(group + kAhead * kGroupBytes);
    for (int64_t line = 0; line < kGroupBytes; line += 64) _mm_prefetch(next + line, _MM_HINT_T1);
    for (int i = 0; i < 8; ++i) {
      __m256i low_quad[R], high_quad[R];
      for (int r = 0; r < R; ++r) {
        const int8_t* v = rows.v.data() + (r0 + r) * rows.k4 + g * kGroup;
        int32_t four;
        std::memcpy(&four, v + 4 * i, 4);
        low_quad[r] = _mm256_set1_epi32(four);
        std::memcpy(&four, v + 4 * (i + 8), 4);
        high_quad[r] = _mm256_set1_epi32(four);
      }
      for (int h = 0; h < kHalves; ++h) {
        const auto* at = group + ((h / 2) * 8 + i) * 64 + (h % 2) * 32;
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
        const __m256i low = _mm256_and_si256(packed, nibble);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
        for (int r = 0; r < R; ++r) {
#ifdef CACTUS_AVX_VNNI
          dots[r][h] = _mm256_dpbusd_avx_epi32(dots[r][h], low, low_quad[r]);
          dots[r][h] = _mm256_dpbusd_avx_epi32(dots[r][h], high, high_quad[r]);
#else
          const __m256i lows = _mm256_madd_epi16(_mm256_maddubs_epi16(low, low_quad[r]), ones);
          const __m256i highs = _mm256_madd_epi16(_mm256_maddubs_epi16(high, high_quad[r]), ones);
          dots[r][h] = _mm256_add_epi32(dots[r][h], _mm256_add_epi32(lows, highs));
#endif
        }
      }
    }
    const at::Half* scale = scales + g * 2 * kOutTile;
    for (int h = 0; h < kHalves; ++h) {
      const auto* s_bits = reinterpret_cast<const __m128i*>(scale + h * 8);
      const auto* low_bits = reinterpret_cast<const __m128i*>(scale + kOutTile + h * 8);
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(s_bits));
      const __m256 low = _mm256_cvtph_ps(_mm_loadu_si128(low_bits));
      for (int r = 0; r < R; ++r) {
        const __m256 sum = _mm256_set1_ps(static_cast<float>(rows.sums[(r0 + r) * groups + g]));
        acc[r][h] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(dots[r][h]), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(low, sum, acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < kHalves; ++h) _mm256_storeu_ps(sums[r] + h * 8, acc[r][h]);
}
#else
template <int R>
void stripe_sums(const SignedRows& rows, int64_t r0, const uint8_t* codes,
                 const at::Half* scales, int64_t groups, float (*sums)[kOutTile]) {
  for (int r = 0; r < R; ++r) {
    const int8_t* v = rows.v.data() + (r0 + r) * rows.k4;
    for (int64_t j = 0; j < kOutTile; ++j) {
      const int64_t b = j / kLanes, lane = j % kLanes;
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t dot = 0;
        for (int i = 0; i < 8; ++i) {
          for (int t = 0; t < 4; ++t) {
            const uint8_t byte = codes[g * kGroupBytes + (b * 8 + i) * 64 + lane * 4 + t];
            dot += v[g * kGroup + 4 * i + t] * (byte & 0x0F);
            dot += v[g * kGroup + 4 * (i + 8) + t] * (byte >> 4);
          }
        }
        const at::Half* scale = scales + g * 2 * kOutTile;
        const float sum = static_cast<float>(rows.sums[(r0 + r) * groups + g]);
        acc = std::fma(static_cast<float>(scale[j]), static_cast<float>(dot), acc);
        acc = std::fma(static_cast<float>(scale[kOutTile + j]), sum, acc);
      }
      sums[r][j] = acc;
    }
  }
}
#endif

void stripe_rows(const SignedRows& rows, int64_t r0, int count, const uint8_t* codes,
                 const at::Half* scales, int64_t groups, float (*sums)[kOutTile]) {
  if (count == 2) {
    stripe_sums<2>(rows, r0, codes, scales, groups, sums);
  } else {
    stripe_sums<1>(rows, r0, codes, scales, groups, sums);
  }
}

int64_t padded_k(int64_t k) { return (k + kGroup - 1) / kGroup * kGroup; }

}  // namespace

std::vector<torch::Tensor> pack_int4(const torch::Tensor& codes, const torch::Tensor& scale,
                                     const torch::Tensor& low) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kByte,
              "codes must be a uint8 [N, K] tensor of values 0..15");
  const int64_t n = codes.size(0), k = codes.size(1), groups = (k + kGroup - 1) / kGroup;
  TORCH_CHECK(scale.sizes() == low.sizes() && scale.size(0) == n && scale.size(1) == groups &&
                  scale.scalar_type() == torch::kHalf && low.scalar_type() == torch::kHalf,
              "scale and low must be float16 [N, ceil(K / 64)] tensors");
  const int64_t np = (n + kOutTile - 1) / kOutTile * kOutTile, stripes = np / kOutTile;
  auto padded = torch::zeros({np, groups * kGroup}, codes.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(codes);
  // [stripe, block, lane, group, half, i, t] -> [stripe, group, block, i, lane, t, half]
  auto split = padded.view({stripes, kBlocks, kLanes, groups, 2, 8, 4})
                   .permute({0, 3, 1, 5, 2, 6, 4})
                   .contiguous();
  auto packed = split.select(-1, 0).bitwise_or(split.select(-1, 1).bitwise_left_shift(4));
  auto tables = torch::zeros({2, np, groups}, scale.options());
  tables[0].narrow(0, 0, n).copy_(scale);
  tables[1].narrow(0, 0, n).copy_(low);
  // [2, stripe, 64, group] -> [stripe, group, 2, 64]
  auto scales = tables.view({2, stripes, kOutTile, groups}).permute({1, 3, 0, 2}).contiguous();
  // As int16 bits: a model's .float() would turn a float16 buffer into float32.
  return {packed.contiguous(), scales.view(torch::kShort)};
}

namespace {

// The largest |x| of a row's k values (0 for none above it; max is exact in any order).
float largest_magnitude(const float* row, int64_t k) {
  float top = 0.0f;
  int64_t i = 0;
  Lanes tops = Lanes{};
  for (; i + kLanes <= k; i += kLanes) {
    const Lanes v = load_lanes(row + i);
    const Lanes magnitude = v < 0.0f ? -v : v;
    tops = magnitude > tops ? magnitude : tops;
  }
  for (int j = 0; j < kLanes; ++j) top = std::max(top, tops[j]);
  for (; i < k; ++i) top = std::max(top, std::fabs(row[i]));
  return top;
}

// out[i] = min(127, max(-127, nearbyint(row[i] * inv))). In lanes, a + 1.5 * 2^23 - 1.5 * 2^23
// is a rounded to the nearest integer, ties to even, as nearbyint rounds, for |a| < 2^22.
void signed_codes(const float* row, int64_t k, float inv, int8_t* out) {
  const Lanes shift = Lanes{} + 12582912.0f, lowest = Lanes{} - 127.0f, highest = Lanes{} + 127.0f;
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    Lanes code = (load_lanes(row + i) * inv + shift) - shift;
    code = lowest < code ? code : lowest;  // std::max(-127, code), a NaN included
    code = code < highest ? code : highest;
    const IntLanes whole = __builtin_convertvector(code, IntLanes);
    const SignedByteLanes bytes = __builtin_convertvector(whole, SignedByteLanes);
    std::memcpy(out + i, &bytes, sizeof bytes);
  }
  for (; i < k; ++i) {
    out[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(row[i] * inv))));
  }
}

}  // namespace

// Each row of x [M, K] to int8 codes on its own symmetric range, with its groups' code sums.
SignedRows signed_rows(const float* x, int64_t m, int64_t k) {
  const int64_t k4 = padded_k(k), groups = k4 / kGroup;
  SignedRows rows{std::vector<int8_t>(m * k4, 0), std::vector<float>(m),
                  std::vector<int32_t>(m * groups, 0), k4};
  for_rows(m, k, [&](int64_t r) {
    const float* row = x + r * k;
    const float top = largest_magnitude(row, k);
    const float step = top > 0.0f ? top / 127.0f : 1.0f;
    int8_t* out = rows.v.data() + r * k4;
    signed_codes(row, k, 1.0f / step, out);
    for (int64_t g = 0; g < groups; ++g) {
      int32_t sum = 0;
      for (int64_t i = g * kGroup; i < (g + 1) * kGroup; ++i) sum += out[i];
      rows.sums[r * groups + g] = sum;
    }
    rows.step[r] = step;
  });
  return rows;
}

namespace {

// The stripes of 64 outputs of w, checked to be pack_int4 of a weight with the rows' K.
int64_t int4_stripes(const SignedRows& rows, const Int4Weight& w) {
  const int64_t n = w.outputs(), groups = rows.k4 / kGroup;
  TORCH_CHECK(w.packed.scalar_type() == torch::kByte && w.packed.is_contiguous() &&
                  w.packed.size(1) == groups && w.packed.size(0) * kOutTile >= n &&
                  w.scales.scalar_type() == torch::kShort && w.scales.is_contiguous() &&
                  w.bias.scalar_type() == torch::kFloat,
              "packed and scales must be pack_int4 of a [N, K] weight with x's K, bias float32 [N]");
  return (n + kOutTile - 1) / kOutTile;
}

// out's columns of stripe s = every row's products with w's stripe s plus its bias.
void int4_stripe(const SignedRows& rows, const Int4Weight& w, int64_t s, float* out) {
  const int64_t m = static_cast<int64_t>(rows.step.size()), n = w.outputs();
  const int64_t groups = rows.k4 / kGroup;
  const uint8_t* stripe = w.packed.data_ptr<uint8_t>() + s * groups * kGroupBytes;
  const auto* scales = reinterpret_cast<const at::Half*>(w.scales.data_ptr<int16_t>()) +
                       s * groups * 2 * kOutTile;
  const float* bias = w.bias.data_ptr<float>();
  const int64_t n0 = s * kOutTile, width = std::min(kOutTile, n - n0);
  float sums[kRowTile][kOutTile];
  for (int64_t r0 = 0; r0 < m; r0 += kRowTile) {
    const int count = static_cast<int>(std::min<int64_t>(kRowTile, m - r0));
    stripe_rows(rows, r0, count, stripe, scales, groups, sums);
    for (int r = 0; r < count; ++r) {
      const float step = rows.step[r0 + r];
      float* y_row = out + (r0 + r) * n + n0;
      for (int64_t j = 0; j < width; ++j) y_row[j] = step * sums[r][j] + bias[n0 + j];
    }
  }
}

}  // namespace

void int4_products(const SignedRows& rows, std::initializer_list<Output<Int4Weight>> layers) {
  std::vector<int64_t> counts;
  for (const auto& layer : layers) counts.push_back(int4_stripes(rows, layer.weight));
  const auto nothing = [] { return 0; };  // no per-thread state
  for_layer_stripes(counts, nothing, [&](int64_t l, int64_t s) {
    const Output<Int4Weight>& layer = layers.begin()[l];
    int4_stripe(rows, layer.weight, s, layer.out);
  });
}

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales, const torch::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const SignedRows rows = signed_rows(x.data_ptr<float>(), x.size(0), x.size(1));
  auto y = torch::empty({x.size(0), bias.size(0)}, x.options());
  const Int4Weight w{packed, scales, bias};
  int4_products(rows, {{w, y.data_ptr<float>()}});
  return y;
}
