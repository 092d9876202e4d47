// One decoder block of an int8 model (Qwen2/Llama: RMSNorm, rotary embeddings, grouped-query
// attention, SwiGLU) in a single call, the same computation as cactus_spec.backends.lean's
// Block over a KVCache, for the decode regime where a Python block spends more time in ~40
// small tensor operations than in its products:
//
//   a = x + o(attend(rope(q(n1)), rope(k(n1)), v(n1)))     n1 = rmsnorm(x) * w1
//   y = a + down(silu(gate(n2)) * up(n2))                   n2 = rmsnorm(a) * w2
//
// The rows' new keys and values are written into the cache at their positions; query t of
// row i (position p = start_i + t) attends to that row's keys 0..p.

#include "int8_linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, rows of length e.
void rms_norm(const float* x, int64_t m, int64_t e, const float* weight, float eps, float* out) {
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x + r * e;
    float squares = 0.0f;
    for (int64_t i = 0; i < e; ++i) squares += row[i] * row[i];
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(e) + eps);
    for (int64_t i = 0; i < e; ++i) out[r * e + i] = weight[i] * (row[i] * inv);
  }
}

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

// sum_c a[c] b[c] in 16 independent partial sums, which the compiler turns into vector lanes
// (one running sum would be a chain of dependent additions it may not reorder).
float dot(const float* a, const float* b, int64_t d) {
  constexpr int64_t kLanes = 16;
  float partial[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= d; c += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) partial[l] += a[c + l] * b[c + l];
  }
  float total = 0.0f;
  for (; c < d; ++c) total += a[c] * b[c];
  for (int64_t l = 0; l < kLanes; ++l) total += partial[l];
  return total;
}

// The block's linear layers, in the order of params after the two norms, 4 tensors each.
enum Layer { kQ, kK, kV, kO, kGate, kUp, kDown, kLayers };

Int8Weight weight_at(const std::vector<torch::Tensor>& params, Layer layer) {
  const size_t first = 2 + 4 * static_cast<size_t>(layer);
  const torch::Tensor& bias = params[first + 3];
  return {params[first], params[first + 1], params[first + 2],
          bias.numel() ? bias : torch::Tensor()};
}

}  // namespace

// params: the two norm weights, then packed, scale, code_sums, bias (empty: none) for each
// of q, k, v, o, gate, up, down. x [b, T, E]; cos, sin [b, 1, T, D]; keys, values: the
// layer's cache [B, H_kv, S, D]; rows[i], starts[i]: row i's cache row and first position.
torch::Tensor int8_block(const torch::Tensor& x, const torch::Tensor& cos,
                         const torch::Tensor& sin, const torch::Tensor& keys,
                         const torch::Tensor& values, const std::vector<int64_t>& rows,
                         const std::vector<int64_t>& starts,
                         const std::vector<torch::Tensor>& params, double eps, int64_t heads,
                         int64_t kv_heads) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [b, T, E] tensor");
  TORCH_CHECK(params.size() == 2 + 4 * kLayers,
              "params must hold 2 norms and 7 layers of 4 tensors");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && cos.is_contiguous() &&
                  sin.is_contiguous(),
              "the cache and the rotary tables must be contiguous");
  const int64_t b = x.size(0), count = x.size(1), e = x.size(2), m = b * count;
  const int64_t d = keys.size(3), capacity = keys.size(2), group = heads / kv_heads;
  const Int8Weight wq = weight_at(params, kQ), wk = weight_at(params, kK),
                   wv = weight_at(params, kV), wo = weight_at(params, kO),
                   wg = weight_at(params, kGate), wu = weight_at(params, kUp),
                   wd = weight_at(params, kDown);
  const int64_t inner = wg.scale.size(0);
  const float* in = x.data_ptr<float>();
  float* key_cache = keys.data_ptr<float>();
  float* value_cache = values.data_ptr<float>();

  std::vector<float> normed(m * e), q(m * heads * d), k(m * kv_heads * d), v(m * kv_heads * d);
  rms_norm(in, m, e, params[0].data_ptr<float>(), static_cast<float>(eps), normed.data());
  Rows quantised = quantise_rows(normed.data(), m, e);
  int8_products(quantised, wq, q.data());
  int8_products(quantised, wk, k.data());
  int8_products(quantised, wv, v.data());
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t t = 0; t < count; ++t) {
      const int64_t r = i * count + t, at = starts[i] + t;
      TORCH_CHECK(at < capacity, "a position lies beyond the cache's capacity");
      const float* c = cos.data_ptr<float>() + r * d;
      const float* s = sin.data_ptr<float>() + r * d;
      rope(q.data() + r * heads * d, heads, d, c, s);
      rope(k.data() + r * kv_heads * d, kv_heads, d, c, s);
      for (int64_t g = 0; g < kv_heads; ++g) {
        const int64_t slot = ((rows[i] * kv_heads + g) * capacity + at) * d;
        std::copy_n(k.data() + (r * kv_heads + g) * d, d, key_cache + slot);
        std::copy_n(v.data() + (r * kv_heads + g) * d, d, value_cache + slot);
      }
    }
  }

  std::vector<float> attended(m * heads * d);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  at::parallel_for(0, b * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = job / heads, h = job % heads, g = h / group;
      const float* row_keys = key_cache + (rows[i] * kv_heads + g) * capacity * d;
      const float* row_values = value_cache + (rows[i] * kv_heads + g) * capacity * d;
      for (int64_t t = 0; t < count; ++t) {
        const int64_t r = i * count + t, visible = starts[i] + t + 1;
        const float* query = q.data() + (r * heads + h) * d;
        scores.assign(visible, 0.0f);
        float top = -INFINITY;
        for (int64_t j = 0; j < visible; ++j) {
          scores[j] = dot(query, row_keys + j * d, d) * scale;
          top = std::max(top, scores[j]);
        }
        float total = 0.0f;
        for (int64_t j = 0; j < visible; ++j) total += scores[j] = std::exp(scores[j] - top);
        float* out = attended.data() + (r * heads + h) * d;
        std::fill_n(out, d, 0.0f);
        for (int64_t j = 0; j < visible; ++j) {
          const float weight = scores[j] / total;
          for (int64_t c = 0; c < d; ++c) out[c] += weight * row_values[j * d + c];
        }
      }
    }
  });

  auto y = torch::empty_like(x);
  float* hidden = y.data_ptr<float>();
  int8_products(quantise_rows(attended.data(), m, heads * d), wo, hidden);
  for (int64_t i = 0; i < m * e; ++i) hidden[i] += in[i];
  rms_norm(hidden, m, e, params[1].data_ptr<float>(), static_cast<float>(eps), normed.data());
  quantised = quantise_rows(normed.data(), m, e);
  std::vector<float> gate(m * inner), up(m * inner), down(m * e);
  int8_products(quantised, wg, gate.data());
  int8_products(quantised, wu, up.data());
  for (int64_t i = 0; i < m * inner; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
  int8_products(quantise_rows(gate.data(), m, inner), wd, down.data());
  for (int64_t i = 0; i < m * e; ++i) hidden[i] += down[i];
  return y;
}
