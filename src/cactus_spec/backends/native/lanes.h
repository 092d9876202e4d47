// Sixteen floats, int32s or bytes as one value (GCC's and Clang's vector extension): one
// register where the CPU has 512-bit ones, two of 256 bits on AVX2, plain scalars elsewhere.
// Arithmetic on them is lane by lane, so it gives each lane the bits scalar code would.
// The types keep their natural alignment and memory is reached only through memcpy
// (load_lanes, store_lanes): declared under-aligned (aligned(4)), they made GCC 12's int8
// forwards on an AMX Xeon much slower (docs/RESULTS.md, "Serving under load").
#pragma once

#include <cstdint>
#include <cstring>

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
