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
