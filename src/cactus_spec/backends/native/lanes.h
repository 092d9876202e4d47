// Sixteen floats, int32s or bytes as one value (GCC's and Clang's vector extension): one
// register where the CPU has 512-bit ones, two of 256 bits on AVX2, plain scalars elsewhere.
// Arithmetic on them is lane by lane, so it gives each lane the bits scalar code would.
#pragma once

#include <cstdint>
#include <cstring>

constexpr int64_t kLanes = 16;  // a 512-bit register of 32-bit values: outputs per packed group
typedef float Lanes __attribute__((vector_size(4 * kLanes), aligned(4)));
typedef int32_t IntLanes __attribute__((vector_size(4 * kLanes), aligned(4)));
typedef uint8_t ByteLanes __attribute__((vector_size(kLanes), aligned(1)));
typedef int8_t SignedByteLanes __attribute__((vector_size(kLanes), aligned(1)));

// 16 floats loaded from, or stored to, any float address.
inline Lanes load_lanes(const float* at) {
  Lanes v;
  std::memcpy(&v, at, sizeof v);
  return v;
}
inline void store_lanes(float* at, Lanes v) { std::memcpy(at, &v, sizeof v); }
