// Sixteen floats, int32s or bytes as one value (GCC's and Clang's vector extension): one
// register where the CPU has 512-bit ones, two of 256 bits on AVX2, plain scalars elsewhere.
// Arithmetic on them is lane by lane, so it gives each lane the bits scalar code would.
// The types keep their natural alignment and memory is reached only through memcpy
// (load_lanes, store_lanes): declared under-aligned (aligned(4)), they made GCC 12's int8
// forwards on an AMX Xeon much slower (docs/RESULTS.md, "Serving under load").
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX__)
#include <immintrin.h>
#endif

constexpr int64_t kLanes = 16;  // a 512-bit register of 32-bit values: outputs per packed group
typedef float Lanes __attribute__((vector_size(4 * kLanes)));
typedef int32_t IntLanes __attribute__((vector_size(4 * kLanes)));
typedef uint8_t ByteLanes __attribute__((vector_size(kLanes)));
typedef int8_t SignedByteLanes __attribute__((vector_size(kLanes)));

// 16 floats loaded from, or stored to, any float address.
inline Lanes load_lanes(const float* at) {
  Lanes v;
  std::memcpy(&v, at, sizeof v);
  return v;
}
inline void store_lanes(float* at, Lanes v) { std::memcpy(at, &v, sizeof v); }

// 16 bfloat16s (their bits) widened to floats, exactly: each one's bits become the upper half
// of its float's.
inline Lanes load_bf16_lanes(const uint16_t* at) {
#if defined(__AVX512F__)
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
  return (Lanes)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
#else
  typedef uint16_t HalfLanes __attribute__((vector_size(2 * kLanes)));
  HalfLanes halves;
  std::memcpy(&halves, at, sizeof halves);
  return (Lanes)(__builtin_convertvector(halves, IntLanes) << 16);
#endif
}

// x in every lane (a broadcast; Lanes{} + x would add 0 to x first).
inline Lanes splat_lanes(float x) {
#if defined(__AVX512F__)
  return (Lanes)_mm512_set1_ps(x);
#elif defined(__AVX__)
  const __m256 half = _mm256_set1_ps(x);
  Lanes v;
  std::memcpy(&v, &half, sizeof half);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof half, &half, sizeof half);
  return v;
#else
  Lanes v;
  for (int64_t l = 0; l < kLanes; ++l) v[l] = x;
  return v;
#endif
}

// a * b + c in each lane, rounded once (a fused multiply-add where the CPU has one, as AVX2,
// AVX512 and ARMv8 do; -ffp-contract=off leaves every other product and sum as written).
inline Lanes fma_lanes(Lanes a, Lanes b, Lanes c) {
#if defined(__AVX512F__)
  return (Lanes)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  typedef float Half __attribute__((vector_size(4 * kLanes / 2)));
  Half halves[3][2];
  std::memcpy(halves[0], &a, sizeof a);
  std::memcpy(halves[1], &b, sizeof b);
  std::memcpy(halves[2], &c, sizeof c);
  for (int h = 0; h < 2; ++h) {
    halves[2][h] = (Half)_mm256_fmadd_ps((__m256)halves[0][h], (__m256)halves[1][h],
                                          (__m256)halves[2][h]);
  }
  std::memcpy(&c, halves[2], sizeof c);
  return c;
#else
  for (int64_t l = 0; l < kLanes; ++l) c[l] = __builtin_fmaf(a[l], b[l], c[l]);
  return c;
#endif
}

// e^x in each lane, within 1 ulp of the correctly rounded value wherever it is a normal float
// (Cephes' expf: x = n ln2 + r with n = round(x / ln2), so |r| <= ln2 / 2; e^r by a degree-7
// polynomial; 2^n put in the exponent bits): 0 below -87.33 (where e^x is subnormal), inf
// above 88 (the last 0.7 of the float range), NaN for NaN. Plain arithmetic on Lanes, so every
// level (and plain C++) gives the same bits, as std::exp on each element did not need to.
inline Lanes exp_lanes(Lanes x) {
  const Lanes lowest = Lanes{} - 87.3365447f, highest = Lanes{} + 88.0f;
  const Lanes clamped = x < lowest ? lowest : x > highest ? highest : x;
  const Lanes shift = Lanes{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const Lanes n = (clamped * 1.44269504f + shift) - shift;
  const Lanes r = clamped - n * 0.693359375f + n * 2.12194440e-4f;  // ln2 in two parts
  Lanes p = Lanes{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const IntLanes bits = (__builtin_convertvector(n, IntLanes) + 127) << 23;
  Lanes power;
  std::memcpy(&power, &bits, sizeof power);
  const Lanes y = (p * r * r + r + 1.0f) * power;
  const Lanes inf = Lanes{} + __builtin_huge_valf();
  return x != x ? x : x < lowest ? Lanes{} : x > highest ? inf : y;
}
