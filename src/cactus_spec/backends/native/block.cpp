// One decoder block (Qwen2/Llama: RMSNorm, rotary embeddings, grouped-query attention,
// SwiGLU) of native int8, int4 or bfloat16 layers in a single call, the same computation as
// cactus_spec.backends.lean's Block over a KVCache, for the decode regime where a Python
// block spends more time in ~40 small tensor operations than in its products:
//
//   a = x + o(attend(rope(q(n1)), rope(k(n1)), v(n1)))     n1 = rmsnorm(x) * w1
//   y = a + down(silu(gate(n2)) * up(n2))                   n2 = rmsnorm(a) * w2
//
// The rows' new keys and values are written into the cache at their slots; query t of row i
// (slot p = start_i + t) attends to that row's keys at slots 0..p, or to those of them its
// mask shows (a token tree's: the cached prefix, its ancestors and itself; the rotary
// positions come with cos and sin, so they need not be the slots). The block computes in
// float32 whatever the model's dtype: its input, norm weights and rotary tables are read as
// float32, its output is returned in the input's dtype and keys and values are stored in the
// cache's (a bfloat16 model's block so rounds at its ends and at its products' inputs only,
// closer to float32 than a Python block that rounds after every operation).

#include "block.h"

#include "lanes.h"
#include "linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <vector>

namespace {

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, rows of length e.
void rms_norm(const float* x, int64_t m, int64_t e, const float* weight, float eps, float* out) {
  for_rows(m, e, [&](int64_t r) {
    const float* row = x + r * e;
    float squares = 0.0f;
    for (int64_t i = 0; i < e; ++i) squares += row[i] * row[i];
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(e) + eps);
    for (int64_t i = 0; i < e; ++i) out[r * e + i] = weight[i] * (row[i] * inv);
  });
}

// gate[i] = silu(gate[i]) up[i] = gate[i] / (1 + e^-gate[i]) up[i] for n values, kLanes at a
// time (exp_lanes); a last few are padded to kLanes in a copy (each value's bits do not depend
// on where it falls), the rest read in place (copies through the stack cost 5x the arithmetic).
void silu_times(float* gate, const float* up, int64_t n) {
  auto lanes = [](Lanes g, Lanes u) { return g / (1.0f + exp_lanes(-g)) * u; };
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store_lanes(gate + i, lanes(load_lanes(gate + i), load_lanes(up + i)));
  if (i == n) return;
  float g[kLanes] = {}, u[kLanes] = {};
  std::copy_n(gate + i, n - i, g);
  std::copy_n(up + i, n - i, u);
  store_lanes(g, lanes(load_lanes(g), load_lanes(u)));
  std::copy_n(g, n - i, gate + i);
}

// n floats left uninitialised: a block's buffers, each written whole before it is read.
std::unique_ptr<float[]> scratch(int64_t n) { return std::unique_ptr<float[]>(new float[n]); }

// Rotary embedding in place on `heads` heads of size d: x cos + (-x2, x1) sin.
void rope(float* x, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * d;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

// The kinds of linear layers a block may be made of, and how the block's params hold each
// layer. Int8 layers (packed codes, scales, code sums, bias or empty) read uint8 input rows.
struct Int8Kernel {
  using Weight = Int8Weight;
  using Input = Rows;
  static constexpr size_t kTensors = 4;
  static Weight weight(const std::vector<torch::Tensor>& params, size_t first) {
    const torch::Tensor& bias = params[first + 3];
    return {params[first], params[first + 1], params[first + 2],
            bias.numel() ? bias : torch::Tensor()};
  }
  static Input input(const float* x, int64_t m, int64_t k, const Weight&) {
    return quantise_rows(x, m, k);
  }
  static void products(const Input& in, std::initializer_list<Output<Weight>> layers) {
    int8_products(in, layers);
  }
};

// Int4 layers (packed codes, scales, bias) read int8 input rows.
struct Int4Kernel {
  using Weight = Int4Weight;
  using Input = SignedRows;
  static constexpr size_t kTensors = 3;
  static Weight weight(const std::vector<torch::Tensor>& params, size_t first) {
    return {params[first], params[first + 1], params[first + 2]};
  }
  static Input input(const float* x, int64_t m, int64_t k, const Weight&) {
    return signed_rows(x, m, k);
  }
  static void products(const Input& in, std::initializer_list<Output<Weight>> layers) {
    int4_products(in, layers);
  }
};

// Bfloat16 layers (packed, bias).
struct Bf16Kernel {
  using Weight = Bf16Weight;
  using Input = Bf16Rows;
  static constexpr size_t kTensors = 2;
  static Weight weight(const std::vector<torch::Tensor>& params, size_t first) {
    return {params[first], params[first + 1]};
  }
  static Input input(const float* x, int64_t m, int64_t k, const Weight& w) {
    return bf16_rows(x, m, k, w.packed.size(1) * 2);
  }
  static void products(const Input& in, std::initializer_list<Output<Weight>> layers) {
    bf16_products(in, layers);
  }
};

// The block's linear layers, in the order of params after the two norms.
enum Layer { kQ, kK, kV, kO, kGate, kUp, kDown, kLayers };

// The rows' tokens, their projections, where they go in the cache and which keys they see:
// query t of row i sees slot j <= starts[i] + t where mask[(i * count + t) * span + j] (every
// such slot when mask is null).
struct Tokens {
  int64_t b, count, heads, kv_heads, d;
  const std::vector<int64_t>& rows;
  const std::vector<int64_t>& starts;
  const bool* mask;
  int64_t span;
};

// Rotary embeddings on q and k [m, heads | kv_heads, d] in place, then k and v into the
// cache (element type T) at each row's positions.
template <typename T>
void rotate_and_store(const Tokens& tk, float* q, float* k, const float* v, const float* cos,
                      const float* sin, T* key_cache, T* value_cache, int64_t capacity) {
  const int64_t d = tk.d;
  for (int64_t i = 0; i < tk.b; ++i) {
    for (int64_t t = 0; t < tk.count; ++t) {
      const int64_t r = i * tk.count + t, at = tk.starts[i] + t;
      TORCH_CHECK(at < capacity, "a position lies beyond the cache's capacity");
      rope(q + r * tk.heads * d, tk.heads, d, cos + r * d, sin + r * d);
      rope(k + r * tk.kv_heads * d, tk.kv_heads, d, cos + r * d, sin + r * d);
      for (int64_t g = 0; g < tk.kv_heads; ++g) {
        const int64_t slot = ((tk.rows[i] * tk.kv_heads + g) * capacity + at) * d;
        const int64_t from = (r * tk.kv_heads + g) * d;
        for (int64_t c = 0; c < d; ++c) {
          key_cache[slot + c] = static_cast<T>(k[from + c]);
          value_cache[slot + c] = static_cast<T>(v[from + c]);
        }
      }
    }
  }
}

// Cache entries as float32, one (cached) or kLanes at a time (load_cached): a float32 entry as
// it is, a bfloat16 one widened (exact: its bits are a float32's upper half). Attention reads
// a bfloat16 cache in place, half the bytes of a float32 one, each entry widened as it is read.
template <typename T>
float cached(T entry) {
  return static_cast<float>(entry);
}
template <typename T>
Lanes load_cached(const T* at) {
  Lanes v;
  for (int64_t l = 0; l < kLanes; ++l) v[l] = static_cast<float>(at[l]);
  return v;
}
template <>
Lanes load_cached(const float* at) {
  return load_lanes(at);
}
template <>
Lanes load_cached(const c10::BFloat16* at) {
  return load_bf16_lanes(reinterpret_cast<const uint16_t*>(at));
}

// One query of a row's key/value head: its projection, where its output goes, the slots it
// sees (j < visible, and of them those `shown` shows when the feed is masked).
struct Query {
  const float* q;
  float* out;
  int64_t visible;
  const bool* shown;
};

// Queries scored at once against a block of kLanes keys (their sums side by side: eight
// chains of additions, so none waits on the one before it), and keys whose values every
// query adds up before the next such block (they stay in the L1 cache meanwhile).
constexpr int64_t kQueriesAtOnce = 8;
constexpr int64_t kValueBlock = 64;

// transposed [d, kLanes] = the n (<= kLanes) rows [n, d] of keys, zeros past them. AVX512: a
// 16 x 16 tile at a time in registers (two rounds of unpacks, two of 128-bit shuffles).
template <typename T>
void transpose_keys(const T* keys, int64_t n, int64_t d, float* transposed) {
#ifdef CACTUS_AVX512
  if (d % kLanes == 0) {
    for (int64_t c0 = 0; c0 < d; c0 += kLanes) {
      __m512 r[16], t[16], u[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = i < n ? (__m512)load_cached(keys + i * d + c0) : _mm512_setzero_ps();
      }
      for (int i = 0; i < 8; ++i) {  // t[2i], t[2i+1]: rows 2i, 2i+1 interleaved per 128 bits
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
      }
      for (int g = 0; g < 4; ++g) {  // u[4g + k]: rows 4g..4g+3 of column 4L + k in 128-bit lane L
        const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 2]);
        const __m512d e = _mm512_castps_pd(t[4 * g + 1]), f = _mm512_castps_pd(t[4 * g + 3]);
        u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(e, f));
        u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(e, f));
      }
      // column 4L + k: lane L of u[k], u[4 + k], u[8 + k] and u[12 + k]
      for (int k = 0; k < 4; ++k) {
        const __m512 x0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88);
        const __m512 x1 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
        const __m512 y0 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
        const __m512 y1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
        _mm512_storeu_ps(transposed + (c0 + k) * kLanes, _mm512_shuffle_f32x4(x0, y0, 0x88));
        _mm512_storeu_ps(transposed + (c0 + 4 + k) * kLanes, _mm512_shuffle_f32x4(x1, y1, 0x88));
        _mm512_storeu_ps(transposed + (c0 + 8 + k) * kLanes, _mm512_shuffle_f32x4(x0, y0, 0xDD));
        _mm512_storeu_ps(transposed + (c0 + 12 + k) * kLanes, _mm512_shuffle_f32x4(x1, y1, 0xDD));
      }
    }
    return;
  }
#endif
  for (int64_t l = 0; l < kLanes; ++l) {
    for (int64_t c = 0; c < d; ++c) {
      transposed[c * kLanes + l] = l < n ? cached(keys[l * d + c]) : 0.0f;
    }
  }
}

// scores[at * stride + j0 + l] = <q_at, keys[j0 + l]> scale for l < kLanes (keys past the
// n <= kLanes given score 0) and every query: each (query, key) sums over c in order in a
// lane of its own, each term fused (fma_lanes), whatever else the block or the group holds.
template <typename T>
void score_block(const std::vector<Query>& queries, const T* keys, int64_t j0, int64_t n,
                 int64_t stride, int64_t d, float scale, float* transposed, float* scores) {
  transpose_keys(keys + j0 * d, n, d, transposed);
  const int64_t count = static_cast<int64_t>(queries.size());
  for (int64_t at = 0; at < count; at += kQueriesAtOnce) {
    const float* q[kQueriesAtOnce];  // past the last query: the last again, its sums unused
    for (int64_t r = 0; r < kQueriesAtOnce; ++r) q[r] = queries[std::min(at + r, count - 1)].q;
    Lanes sums[kQueriesAtOnce] = {};
    for (int64_t c = 0; c < d; ++c) {
      const Lanes column = load_lanes(transposed + c * kLanes);
      for (int64_t r = 0; r < kQueriesAtOnce; ++r) {
        sums[r] = fma_lanes(column, splat_lanes(q[r][c]), sums[r]);
      }
    }
    for (int64_t r = 0; r < std::min(kQueriesAtOnce, count - at); ++r) {
      store_lanes(scores + (at + r) * stride + j0, sums[r] * scale);
    }
  }
}

// row [stride] (a multiple of kLanes) = the softmax of its first `count` scores, 0 past them:
// the max, e^(s - max) (exp_lanes) and their sum kLanes slots at a time, lane l summing the
// slots j = l mod kLanes in order, then the lanes in order. A slot past `count` weighs e^-inf
// = 0 and adds nothing to any lane, so the weights have the same bits whatever the stride.
void softmax_first(float* row, int64_t count, int64_t stride) {
  std::fill(row + count, row + stride, -INFINITY);
  if (count == 0) {  // a padded token of a tree's feed sees no slot: it weighs none
    std::fill(row, row + stride, 0.0f);
    return;
  }
  Lanes most = load_lanes(row);
  for (int64_t j = kLanes; j < stride; j += kLanes) {
    const Lanes block = load_lanes(row + j);
    most = block > most ? block : most;
  }
  float top = most[0];
  for (int64_t l = 1; l < kLanes; ++l) top = std::max(top, most[l]);
  Lanes sums = {};
  for (int64_t j = 0; j < stride; j += kLanes) {
    const Lanes weight = exp_lanes(load_lanes(row + j) - top);
    store_lanes(row + j, weight);
    sums += weight;
  }
  float total = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) total += sums[l];
  for (int64_t j = 0; j < stride; j += kLanes) store_lanes(row + j, load_lanes(row + j) / total);
}

// row [stride] = a query's softmax weights over the slots it sees, 0 elsewhere: those slots'
// scores in order (a masked query's gathered into `seen` first), as softmax_first weighs them.
// So a token's weights have the same bits wherever its seen slots lie: a draft tree's node
// weighs the keys of its path as a chain along that path does.
template <bool kMasked>
void softmax_weights(const Query& query, float* row, int64_t stride, std::vector<float>& seen) {
  if constexpr (!kMasked) {
    softmax_first(row, query.visible, stride);
  } else {
    seen.clear();
    for (int64_t j = 0; j < query.visible; ++j) {
      if (query.shown[j]) seen.push_back(row[j]);
    }
    const int64_t count = static_cast<int64_t>(seen.size());
    seen.resize((count + kLanes - 1) / kLanes * kLanes);
    softmax_first(seen.data(), count, static_cast<int64_t>(seen.size()));
    for (int64_t j = 0, at = 0; j < stride; ++j) {
      row[j] = j < query.visible && query.shown[j] ? seen[at++] : 0.0f;
    }
  }
}

// out [d] += sum_j weight[j] values[j] over the slots j0 .. j1 - 1 the query sees, each
// output in the order of j, each term fused (fma_lanes): 4 * kLanes outputs at a time (four
// sums side by side), then one by one.
template <typename T, class Sees>
void add_values(const Query& query, const float* weight, const T* values, int64_t j0,
                int64_t j1, int64_t d, const Sees& sees) {
  int64_t c0 = 0;
  for (; c0 + 4 * kLanes <= d; c0 += 4 * kLanes) {
    float* out = query.out + c0;
    Lanes s0 = load_lanes(out), s1 = load_lanes(out + kLanes), s2 = load_lanes(out + 2 * kLanes),
          s3 = load_lanes(out + 3 * kLanes);
    for (int64_t j = j0; j < j1; ++j) {
      if (!sees(query, j)) continue;
      const T* value = values + j * d + c0;
      const Lanes w = splat_lanes(weight[j]);
      s0 = fma_lanes(load_cached(value), w, s0);
      s1 = fma_lanes(load_cached(value + kLanes), w, s1);
      s2 = fma_lanes(load_cached(value + 2 * kLanes), w, s2);
      s3 = fma_lanes(load_cached(value + 3 * kLanes), w, s3);
    }
    store_lanes(out, s0);
    store_lanes(out + kLanes, s1);
    store_lanes(out + 2 * kLanes, s2);
    store_lanes(out + 3 * kLanes, s3);
  }
  for (int64_t j = j0; j < j1; ++j) {
    if (!sees(query, j)) continue;
    for (int64_t c = c0; c < d; ++c) {
      query.out[c] = std::fma(cached(values[j * d + c]), weight[j], query.out[c]);
    }
  }
}

// out [d] = sum_j softmax_j(<q, keys[j]> scale) values[j] over the slots each query sees, for
// the queries of one row's key/value head (its group's heads times the feed's tokens) at
// once: each key and value is read from memory once for all of them, and each query's sums
// run in an order of its own (its scores over c, its weights as softmax_weights sums them, its
// output over its slots in order), so a token's output has the same bits whatever else its
// feed holds: a chain's verification reproduces a decode step's q.
template <bool kMasked, typename T>
void attend_group(const std::vector<Query>& queries, const T* keys, const T* values,
                  int64_t seen, int64_t d, float scale, std::vector<float>& scores,
                  std::vector<float>& transposed) {
  const int64_t n = static_cast<int64_t>(queries.size());
  const int64_t stride = (seen + kLanes - 1) / kLanes * kLanes;
  scores.resize(n * stride);  // [n, S rounded up to kLanes]
  transposed.resize(d * kLanes);
  for (int64_t j0 = 0; j0 < seen; j0 += kLanes) {
    const int64_t block = std::min(kLanes, seen - j0);
    score_block(queries, keys, j0, block, stride, d, scale, transposed.data(), scores.data());
  }
  std::vector<float> seen_scores;
  for (int64_t at = 0; at < n; ++at) {  // each query's scores become its softmax's weights
    softmax_weights<kMasked>(queries[at], scores.data() + at * stride, stride, seen_scores);
    std::fill_n(queries[at].out, d, 0.0f);
  }
  auto sees = [](const Query& query, int64_t j) {  // j < visible: add_values stops there
    if constexpr (kMasked) return query.shown[j];
    return true;
  };
  for (int64_t j0 = 0; j0 < seen; j0 += kValueBlock) {
    for (int64_t at = 0; at < n; ++at) {
      const int64_t j1 = std::min(queries[at].visible, j0 + kValueBlock);
      add_values(queries[at], scores.data() + at * stride, values, j0, j1, d, sees);
    }
  }
}

// attended [m, heads, d]: query t of row i, head h, over key/value head h / group of row i.
template <bool kMasked, typename T>
void attend(const Tokens& tk, const float* q, const T* key_cache, const T* value_cache,
            int64_t capacity, float* attended) {
  const int64_t d = tk.d, group = tk.heads / tk.kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  at::parallel_for(0, tk.b * tk.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, transposed;
    std::vector<Query> queries;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = job / tk.kv_heads, g = job % tk.kv_heads;
      const int64_t seen = tk.starts[i] + tk.count, first = (tk.rows[i] * tk.kv_heads + g) * capacity * d;
      queries.clear();
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t t = 0; t < tk.count; ++t) {
          const int64_t r = i * tk.count + t, at = (r * tk.heads + h) * d;
          queries.push_back({q + at, attended + at, tk.starts[i] + t + 1,
                             kMasked ? tk.mask + r * tk.span : nullptr});
        }
      }
      attend_group<kMasked>(queries, key_cache + first, value_cache + first, seen, d, scale,
                            scores, transposed);
    }
  });
}

// Up to this many new tokens per row, attention runs in float32 (attend: a decode step, a
// chain's verification at any K below 32, a draft tree's nodes at any size); a prompt's chunk
// of more (the server reads 64 a turn) runs blocked in bfloat16 (attend_blocked).
constexpr int64_t kFloat32Tokens = 32;

// attended [m, heads, d] as attend<false> computes it, for long causal feeds: per row, torch's
// scaled_dot_product_attention (its CPU kernel is blocked and flash-style: it reads each block
// of keys once per block of queries, where attend reads every key once per query) in bfloat16,
// the row's queries, keys and values rounded to it, a float32 cache's too: the kernel runs
// faster in bfloat16 than in float32, and the rounding leaves the int8
// verifier's law no further from the bfloat16 model's (docs/RESULTS.md, "Prompt reads"). A
// feed from slot 0 is causal as the kernel means it; a later one sees its cached slots
// through a mask.
void attend_blocked(const Tokens& tk, const float* q, const torch::Tensor& keys,
                    const torch::Tensor& values, float* attended) {
  for (int64_t i = 0; i < tk.b; ++i) {
    const int64_t seen = tk.starts[i] + tk.count, size = tk.count * tk.heads * tk.d;
    auto query = torch::from_blob(const_cast<float*>(q) + i * size, {1, tk.count, tk.heads, tk.d})
                     .transpose(1, 2)
                     .to(at::kBFloat16);  // [1, H, T, D]
    auto row = [&](const torch::Tensor& cache) {  // [1, H_kv, S, D]
      return cache.select(0, tk.rows[i]).narrow(1, 0, seen).unsqueeze(0).to(at::kBFloat16);
    };
    auto row_keys = row(keys), row_values = row(values);
    std::optional<torch::Tensor> mask;
    if (tk.starts[i] > 0) {
      auto slots = torch::arange(seen, torch::kLong);
      auto places = torch::arange(tk.starts[i], seen, torch::kLong);
      mask = slots.unsqueeze(0) <= places.unsqueeze(1);  // [T, S]
    }
    auto out = at::scaled_dot_product_attention(query, row_keys, row_values, mask, 0.0,
                                                /*is_causal=*/!mask, std::nullopt,
                                                /*enable_gqa=*/true);  // [1, H, T, D]
    torch::from_blob(attended + i * size, {tk.count, tk.heads, tk.d})
        .copy_(out.squeeze(0).transpose(0, 1));
  }
}

// Rotary embeddings, the cache write and attention, for the cache's element type.
void attention(const Tokens& tk, float* q, float* k, const float* v, const torch::Tensor& cos,
               const torch::Tensor& sin, const torch::Tensor& keys, const torch::Tensor& values,
               float* attended) {
  const torch::Tensor c = cos.to(torch::kFloat).contiguous(), s = sin.to(torch::kFloat).contiguous();
  const int64_t capacity = keys.size(2);
  const bool blocked = !tk.mask && tk.count > kFloat32Tokens;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, keys.scalar_type(), "attention", [&] {
    scalar_t* key_cache = keys.data_ptr<scalar_t>();
    scalar_t* value_cache = values.data_ptr<scalar_t>();
    rotate_and_store(tk, q, k, v, c.data_ptr<float>(), s.data_ptr<float>(), key_cache,
                     value_cache, capacity);
    if (blocked) return;
    if (tk.mask) {
      attend<true>(tk, q, key_cache, value_cache, capacity, attended);
    } else {
      attend<false>(tk, q, key_cache, value_cache, capacity, attended);
    }
  });
  if (blocked) attend_blocked(tk, q, keys, values, attended);
}

// The mask's entries [b, count, S'] (null when there is none), checked to cover every slot a
// query may see.
const bool* mask_of(const std::optional<torch::Tensor>& mask, int64_t b, int64_t count,
                    const std::vector<int64_t>& starts) {
  if (!mask) return nullptr;
  const int64_t seen = *std::max_element(starts.begin(), starts.end()) + count;
  TORCH_CHECK(mask->scalar_type() == torch::kBool && mask->is_contiguous() && mask->dim() == 3 &&
                  mask->size(0) == b && mask->size(1) == count && mask->size(2) >= seen,
              "mask must be a contiguous bool [b, T, S'] tensor covering every row's slots");
  return mask->data_ptr<bool>();
}

// The block for a Kernel's layers (arguments: see block.h).
template <class Kernel>
torch::Tensor decoder_block(const torch::Tensor& x, const torch::Tensor& cos,
                            const torch::Tensor& sin, const torch::Tensor& keys,
                            const torch::Tensor& values, const std::vector<int64_t>& rows,
                            const std::vector<int64_t>& starts,
                            const std::optional<torch::Tensor>& mask,
                            const std::vector<torch::Tensor>& params, double eps, int64_t heads,
                            int64_t kv_heads) {
  TORCH_CHECK(x.dim() == 3 && x.is_floating_point(), "x must be a float [b, T, E] tensor");
  TORCH_CHECK(params.size() == 2 + Kernel::kTensors * kLayers,
              "params must hold 2 norms and 7 layers of ", Kernel::kTensors, " tensors");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() &&
                  params[0].scalar_type() == torch::kFloat && params[1].scalar_type() == torch::kFloat,
              "the cache must be contiguous and the norm weights float32");
  typename Kernel::Weight w[kLayers];
  for (int layer = 0; layer < kLayers; ++layer) w[layer] = Kernel::weight(params, 2 + Kernel::kTensors * layer);
  const torch::Tensor input = x.to(torch::kFloat).contiguous();
  const int64_t b = x.size(0), count = x.size(1), e = x.size(2), m = b * count, d = keys.size(3);
  const int64_t inner = w[kGate].outputs();
  const Tokens tokens{b, count, heads, kv_heads, d, rows, starts, mask_of(mask, b, count, starts),
                      mask ? mask->size(2) : 0};
  const float* in = input.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);

  const auto normed = scratch(m * e), q = scratch(m * heads * d), k = scratch(m * kv_heads * d),
             v = scratch(m * kv_heads * d), attended = scratch(m * heads * d);
  rms_norm(in, m, e, params[0].data_ptr<float>(), epsilon, normed.get());
  auto rows_in = Kernel::input(normed.get(), m, e, w[kQ]);
  Kernel::products(rows_in, {{w[kQ], q.get()}, {w[kK], k.get()}, {w[kV], v.get()}});
  attention(tokens, q.get(), k.get(), v.get(), cos, sin, keys, values, attended.get());

  // The block's output [b, T, E] in float32, first the attention's residual stream.
  torch::Tensor output = torch::empty(x.sizes(), x.options().dtype(torch::kFloat));
  float* hidden = output.data_ptr<float>();
  const auto gate = scratch(m * inner), up = scratch(m * inner), down = scratch(m * e);
  Kernel::products(Kernel::input(attended.get(), m, heads * d, w[kO]), {{w[kO], hidden}});
  for_rows(m, e, [&](int64_t r) {
    for (int64_t i = r * e; i < (r + 1) * e; ++i) hidden[i] += in[i];
  });
  rms_norm(hidden, m, e, params[1].data_ptr<float>(), epsilon, normed.get());
  rows_in = Kernel::input(normed.get(), m, e, w[kGate]);
  Kernel::products(rows_in, {{w[kGate], gate.get()}, {w[kUp], up.get()}});
  for_rows(m, inner, [&](int64_t r) { silu_times(gate.get() + r * inner, up.get() + r * inner, inner); });
  Kernel::products(Kernel::input(gate.get(), m, inner, w[kDown]), {{w[kDown], down.get()}});
  for_rows(m, e, [&](int64_t r) {
    for (int64_t i = r * e; i < (r + 1) * e; ++i) hidden[i] += down[i];
  });
  return output.to(x.scalar_type());  // a float32 model's output as it is
}

}  // namespace

DecoderBlock* const int8_block = decoder_block<Int8Kernel>;
DecoderBlock* const int4_block = decoder_block<Int4Kernel>;
DecoderBlock* const bf16_block = decoder_block<Bf16Kernel>;

DecoderStack::DecoderStack(const std::string& kind, std::vector<std::vector<torch::Tensor>> layers,
                           double eps, int64_t heads, int64_t kv_heads)
    : block_(kind == "int8" ? int8_block : kind == "int4" ? int4_block : kind == "bf16" ? bf16_block : nullptr),
      layers_(std::move(layers)), eps_(eps), heads_(heads), kv_heads_(kv_heads) {
  TORCH_CHECK(block_, "kind must be int8, int4 or bf16, got ", kind);
}

torch::Tensor DecoderStack::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                    const torch::Tensor& sin, const torch::Tensor& keys,
                                    const torch::Tensor& values, const std::vector<int64_t>& rows,
                                    const std::vector<int64_t>& starts,
                                    const std::optional<torch::Tensor>& mask) const {
  TORCH_CHECK(keys.dim() == 5 && keys.size(0) == static_cast<int64_t>(layers_.size()),
              "keys must be the whole cache [L, B, H_kv, S, D], one layer per block");
  const torch::Tensor c = cos.to(torch::kFloat).contiguous(), s = sin.to(torch::kFloat).contiguous();
  torch::Tensor hidden = x;
  for (size_t layer = 0; layer < layers_.size(); ++layer) {
    const auto at = static_cast<int64_t>(layer);
    hidden = block_(hidden, c, s, keys.select(0, at), values.select(0, at), rows, starts, mask,
                    layers_[layer], eps_, heads_, kv_heads_);
  }
  return hidden;
}
