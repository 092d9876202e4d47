// Int8 linear layers for the decode regime (a few rows against a large weight), the hot
// path of the int8 draft and verifier. See cactus_spec/backends/native/__init__.py for the
// math; in short, each input row r is quantised to uint8 on its own range,
//     x[r, k] ~ lo[r] + step[r] * u[r, k] = mid[r] + step[r] * (u[r, k] - 128),   u in 0..255,
// each weight row n is int8 with its own scale, W[n, k] ~ scale[n] * w[n, k], and
//     y[r, n] = scale[n] * (step[r] * (sum_k u[r, k] w[n, k] - 128 sum_k w[n, k])
//                          + mid[r] * sum_k w[n, k]) + bias[n],
// the bracketed integer exact in int32 (centred, so the float part does not cancel).
//
// Layout: the weight is packed as [N / 16, K / 4, 16, 4] (N padded to kOutTile, K to kKStep with
// zeros): 64 bytes hold 4 consecutive inputs of 16 outputs. For blocks of rows where the CPU has
// AMX, 16 such groups (1 KB, contiguous) are one B tile of 64 inputs by 16 outputs, and tdpbusd
// adds a tile of up to 16 rows' products to 16 outputs per row; elsewhere one AVX512-VNNI
// vpdpbusd against 4 inputs of a row broadcast to all lanes adds their products to 16 outputs
// at once, with no horizontal sums. Both sum in int32, exactly, so they give the same bits. A
// stripe of kBlocks * 16 outputs stays in the L2 cache while every tile of input rows passes
// over it, so the weight is read from memory once per call. With VNNI a block of up to 12 rows
// (a verifier's 11) is one pass, 2 groups at a time, so the products keep pace with the stream
// from memory instead of following it (docs/RESULTS.md, "Kernels by instruction set";
// benchmarks/kernel_cost.py).

#include "linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "amx.h"
#include "lanes.h"

namespace {

// Whether dot_tile's sums are centred, sum_k (u - 128) w (AVX2 without VNNI), rather than
// sum_k u w. A build for AVX2 has no AMX, so every sum of such a build is centred.
#if defined(CACTUS_AVX2) && !defined(CACTUS_AVX_VNNI)
constexpr bool kCentredDots = true;
#else
constexpr bool kCentredDots = false;
#endif

}  // namespace

namespace {

constexpr int kBlocks = 4;                    // packed groups of outputs per tile
constexpr int64_t kOutTile = kLanes * kBlocks;  // outputs per tile (N is padded to it)
constexpr int64_t kKStep = 64;                // inputs per AMX tile (K is padded to it)
// Input rows per pass over a stripe (kRowTile), and how many of its groups a pass of R rows
// takes at a time (kGroupsAtOnce<R>; see the header for why one pass). VNNI: up to 4 rows over
// all 4 groups (16 sums of 32 registers), 5 to 12 over 2 at a time (24 sums). AVX2: up to 4
// rows over all 4 groups; their 8 R sums outgrow the 16 registers, yet a group at a time (no
// spills, but each row's inputs prepared 4 times) ran slower held to AVX2 (kernel_cost.py).
#ifdef CACTUS_VNNI
constexpr int kRowTile = 12;
template <int R>
constexpr int kGroupsAtOnce = R <= 4 ? kBlocks : 2;
constexpr int64_t kAhead = 512;  // bytes of each group prefetched ahead
#else
constexpr int kRowTile = 4;
template <int R>
constexpr int kGroupsAtOnce = kBlocks;
#endif

// dots[r][j] = sum_k u[r, k] w[j, k] for R rows and the B groups of 16 outputs from group
// `first` of one tile (centred, sum_k (u[r, k] - 128) w[j, k], where kCentredDots).
#ifdef CACTUS_VNNI
template <int R, int B>
void dot_groups(const uint8_t* u, int64_t k4, const int8_t* tile, int first,
                int32_t (*dots)[kOutTile]) {
  const int64_t quads = k4 / 4;
  __m512i acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_si512();
  for (int64_t q = 0; q < quads; ++q) {
    __m512i wv[B];
    for (int b = 0; b < B; ++b) {
      const int8_t* at = tile + ((first + b) * quads + q) * 64;
      _mm_prefetch(reinterpret_cast<const char*>(at) + kAhead, _MM_HINT_T1);
      wv[b] = _mm512_loadu_si512(at);
    }
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, u + r * k4 + q * 4, 4);
      const __m512i uv = _mm512_set1_epi32(four);
      for (int b = 0; b < B; ++b) acc[r][b] = dpbusd(acc[r][b], uv, wv[b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) _mm512_storeu_si512(dots[r] + (first + b) * kLanes, acc[r][b]);
}
#elif defined(CACTUS_AVX2)
// Each 64-byte group is two halves of 8 outputs' 4 inputs. AVX-VNNI: vpdpbusd in 256 bits.
// AVX2 alone: with s = u - 128 (int8), sum_k u w = sum_k s w + 128 sum_k w, and the pairs
// s w are summed exactly in int16 by vpmaddubsw on |s| (<= 128, unsigned) against w carrying
// s's sign (|w| <= 127: 2 * 128 * 127 < 2^15), then in int32 by vpmaddwd: the centred sums
// the caller would otherwise form from sum_k u w.
template <int R, int B>
void dot_groups(const uint8_t* u, int64_t k4, const int8_t* tile, int first,
                int32_t (*dots)[kOutTile]) {
  const int64_t quads = k4 / 4;
  constexpr int kHalves = 2 * B;
  __m256i acc[R][kHalves];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < kHalves; ++h) acc[r][h] = _mm256_setzero_si256();
#ifndef CACTUS_AVX_VNNI
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
#endif
  for (int64_t q = 0; q < quads; ++q) {
    __m256i uv[R];
#ifndef CACTUS_AVX_VNNI
    __m256i magnitude[R];
#endif
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, u + r * k4 + q * 4, 4);
      uv[r] = _mm256_set1_epi32(four);
#ifndef CACTUS_AVX_VNNI
      uv[r] = _mm256_xor_si256(uv[r], flip);  // s = u - 128
      magnitude[r] = _mm256_abs_epi8(uv[r]);  // |s|, read unsigned (|-128| is 0x80 = 128)
#endif
    }
    for (int h = 0; h < kHalves; ++h) {
      const auto* at = tile + ((first + h / 2) * quads + q) * 64 + (h % 2) * 32;
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
      for (int r = 0; r < R; ++r) {
#ifdef CACTUS_AVX_VNNI
        acc[r][h] = _mm256_dpbusd_avx_epi32(acc[r][h], uv[r], wv);
#else
        const __m256i pairs = _mm256_maddubs_epi16(magnitude[r], _mm256_sign_epi8(wv, uv[r]));
        acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(pairs, ones));
#endif
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < kHalves; ++h)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots[r] + first * kLanes + h * 8), acc[r][h]);
}
#else
template <int R, int B>
void dot_groups(const uint8_t* u, int64_t k4, const int8_t* tile, int first,
                int32_t (*dots)[kOutTile]) {
  const int64_t quads = k4 / 4;
  for (int r = 0; r < R; ++r) {
    for (int64_t j = first * kLanes; j < (first + B) * kLanes; ++j) {
      const int8_t* group = tile + (j / kLanes) * quads * 64 + (j % kLanes) * 4;
      int32_t sum = 0;
      for (int64_t q = 0; q < quads; ++q) {
        for (int i = 0; i < 4; ++i) sum += u[r * k4 + q * 4 + i] * group[q * 64 + i];
      }
      dots[r][j] = sum;
    }
  }
}
#endif

// All the groups of a tile for R rows, kGroupsAtOnce<R> at a time.
template <int R>
void dot_tile(const uint8_t* u, int64_t k4, const int8_t* tile, int32_t (*dots)[kOutTile]) {
  constexpr int B = kGroupsAtOnce<R>;
  for (int first = 0; first < kBlocks; first += B) dot_groups<R, B>(u, k4, tile, first, dots);
}

using Tile = void (*)(const uint8_t*, int64_t, const int8_t*, int32_t (*)[kOutTile]);

template <std::size_t... I>
constexpr std::array<Tile, sizeof...(I)> tile_kernels(std::index_sequence<I...>) {
  return {dot_tile<static_cast<int>(I) + 1>...};
}

void dot_rows(const uint8_t* u, int rows, int64_t k4, const int8_t* tile,
              int32_t (*dots)[kOutTile]) {
  static constexpr auto tiles = tile_kernels(std::make_index_sequence<kRowTile>());
  tiles[rows - 1](u, k4, tile, dots);
}

int64_t padded_k(int64_t k) { return (k + kKStep - 1) / kKStep * kKStep; }

// The lowest and the highest of a row's k values (min and max are exact: any order gives them).
std::pair<float, float> row_range(const float* row, int64_t k) {
  float low = row[0], high = row[0];
  int64_t i = 0;
  if (k >= kLanes) {
    Lanes lows = load_lanes(row), highs = lows;
    for (i = kLanes; i + kLanes <= k; i += kLanes) {
      const Lanes v = load_lanes(row + i);
      lows = v < lows ? v : lows;
      highs = v > highs ? v : highs;
    }
    for (int j = 0; j < kLanes; ++j) {
      low = std::min(low, lows[j]);
      high = std::max(high, highs[j]);
    }
  }
  for (; i < k; ++i) {
    low = std::min(low, row[i]);
    high = std::max(high, row[i]);
  }
  return {low, high};
}

// out[i] = min(255, (row[i] - low) * inv + 0.5) truncated: the code of the nearest step.
void row_codes(const float* row, int64_t k, float low, float inv, uint8_t* out) {
  const Lanes top = Lanes{} + 255.0f;
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    Lanes code = (load_lanes(row + i) - low) * inv + 0.5f;
    code = code < top ? code : top;
    const IntLanes whole = __builtin_convertvector(code, IntLanes);  // truncated, as a cast
    const ByteLanes bytes = __builtin_convertvector(whole, ByteLanes);
    std::memcpy(out + i, &bytes, sizeof bytes);
  }
  for (; i < k; ++i) out[i] = static_cast<uint8_t>(std::min(255.0f, (row[i] - low) * inv + 0.5f));
}

float as_float(int32_t v) { return static_cast<float>(v); }
Lanes as_float(IntLanes v) { return __builtin_convertvector(v, Lanes); }

// y[j] = scale[j] (step (dot[j] - 128 sums[j]) + mid sums[j]) + bias[j] for j < width, a row's
// outputs from its sums (see the header; the dots already centred where kCentredDots), kLanes
// at a time then one by one: the same operations in the same order, so the same bits.
void outputs(const int32_t* dot, int64_t width, float step, float mid, const float* scale,
             const int32_t* sums, const float* bias, float* y) {
  auto value = [&](auto d, auto code_sum, auto s, auto b) {
    const auto centred = kCentredDots ? d : d - 128 * code_sum;
    return s * (step * as_float(centred) + mid * as_float(code_sum)) + b;
  };
  int64_t j = 0;
  for (; j + kLanes <= width; j += kLanes) {
    IntLanes d, code_sum;
    std::memcpy(&d, dot + j, sizeof d);
    std::memcpy(&code_sum, sums + j, sizeof code_sum);
    const Lanes b = bias ? load_lanes(bias + j) : Lanes{};
    store_lanes(y + j, value(d, code_sum, load_lanes(scale + j), b));
  }
  for (; j < width; ++j) y[j] = value(dot[j], sums[j], scale[j], bias ? bias[j] : 0.0f);
}

}  // namespace

// Each row of x [M, K] to uint8 codes on its own range (see the header).
Rows quantise_rows(const float* x, int64_t m, int64_t k) {
  const int64_t tiles = (m + tile_rows(m) - 1) / tile_rows(m);
  Rows rows{std::vector<uint8_t>(tiles * tile_rows(m) * padded_k(k), 0), std::vector<float>(m),
            std::vector<float>(m), padded_k(k)};
  for_rows(m, k, [&](int64_t r) {
    const float* row = x + r * k;
    const auto [low, high] = row_range(row, k);
    const float step = high > low ? (high - low) / 255.0f : 1.0f;
    row_codes(row, k, low, 1.0f / step, rows.u.data() + r * rows.k4);
    rows.mid[r] = low + 128.0f * step;
    rows.step[r] = step;
  });
  return rows;
}

// The weight w [N, K] int8 in the packed layout: [ceil(N / kOutTile) * 4, K4 / 4, 16, 4].
torch::Tensor pack_int8(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kChar, "w must be an int8 [N, K] tensor");
  const int64_t n = w.size(0), k = w.size(1), k4 = padded_k(k);
  const int64_t np = (n + kOutTile - 1) / kOutTile * kOutTile;
  auto padded = torch::zeros({np, k4}, w.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(w);
  return padded.view({np / kLanes, kLanes, k4 / 4, 4}).permute({0, 2, 1, 3}).contiguous();
}

namespace {

// The stripes of kOutTile outputs of w, checked to be pack_int8 of a weight with the rows' K.
int64_t int8_stripes(const Rows& rows, const Int8Weight& w) {
  const int64_t n = w.outputs();
  TORCH_CHECK(w.packed.scalar_type() == torch::kChar && w.packed.is_contiguous() &&
                  w.packed.size(1) * 4 == rows.k4 && w.packed.size(0) * kLanes >= n,
              "packed must be pack_int8 of an int8 [N, K] weight with x's K");
  return (n + kOutTile - 1) / kOutTile;
}

// out's columns of stripe s = every row's products with w's stripe s (plus its bias), `step`
// rows a pass (on AMX tiles configured for them where amx).
void int8_stripe(const Rows& rows, const Int8Weight& w, int64_t s, bool amx, int64_t step,
                 float* out) {
  const int64_t m = static_cast<int64_t>(rows.step.size()), n = w.outputs();
  const int8_t* stripe = w.packed.data_ptr<int8_t>() + s * kOutTile * rows.k4;
  const float* sc = w.scale.data_ptr<float>();
  const int32_t* sums = w.code_sums.data_ptr<int32_t>();
  const float* b = w.bias.defined() ? w.bias.data_ptr<float>() : nullptr;
  const int64_t n0 = s * kOutTile, width = std::min(kOutTile, n - n0);
  int32_t dots[kPairRows][kOutTile];
  for (int64_t r0 = 0, count; r0 < m; r0 += count) {
    count = rows_at_once(amx, m - r0, step);
#ifdef CACTUS_AMX
    if (amx) {
      amx_rows</*kBf16=*/false>(rows.u.data() + r0 * rows.k4, count, rows.k4,
                                reinterpret_cast<const uint8_t*>(stripe), dots);
    }
#endif
    if (!amx) dot_rows(rows.u.data() + r0 * rows.k4, static_cast<int>(count), rows.k4, stripe, dots);
    for (int64_t r = 0; r < count; ++r) {
      outputs(dots[r], width, rows.step[r0 + r], rows.mid[r0 + r], sc + n0, sums + n0,
              b ? b + n0 : nullptr, out + (r0 + r) * n + n0);
    }
  }
}

}  // namespace

void int8_products(const Rows& rows, std::initializer_list<Output<Int8Weight>> layers) {
  const int64_t m = static_cast<int64_t>(rows.step.size());
  const bool amx = m > 1 && has_amx();  // one row: VNNI streams the weight faster
  const int64_t step = amx ? tile_rows(m) : rows_per_pass(m, kRowTile);
  std::vector<int64_t> counts;
  for (const auto& layer : layers) counts.push_back(int8_stripes(rows, layer.weight));
  const auto tiles = [&] { return Tiles(amx, step); };
  for_layer_stripes(counts, tiles, [&](int64_t l, int64_t s) {
    const Output<Int8Weight>& layer = layers.begin()[l];
    int8_stripe(rows, layer.weight, s, amx, step, layer.out);
  });
}

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scale, const torch::Tensor& code_sums,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const Rows rows = quantise_rows(x.data_ptr<float>(), x.size(0), x.size(1));
  auto y = torch::empty({x.size(0), scale.size(0)}, x.options());
  const Int8Weight w{packed, scale, code_sums, bias.value_or(torch::Tensor())};
  int8_products(rows, {{w, y.data_ptr<float>()}});
  return y;
}
