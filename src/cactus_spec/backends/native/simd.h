// The SIMD every kernel compiles for, decided here once from the compiler's target (the level
// `isa` builds the extension for): each kernel tests these macros, never the compiler's own.
//   CACTUS_AMX          AMX tiles (bfloat16 and int8 products), beside AVX512 (amx.h)
//   CACTUS_VNNI         AVX512-VNNI with AVX512BW: vpdpbusd on 512 bits (dpbusd below)
//   CACTUS_AVX2         AVX2 with FMA and F16C, where AVX512-VNNI is not
//   CACTUS_AVX_VNNI     AVX-VNNI's vpdpbusd on 256 bits, within CACTUS_AVX2
//   CACTUS_AVX512_BF16  AVX512-BF16's vdpbf16ps (bf16_linear.cpp)
//   CACTUS_AVX512       AVX512F: the attention's in-register transposes (block.cpp)
// Nothing defined: plain C++ (any other CPU, ARM included).
#pragma once

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define CACTUS_AMX 1
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define CACTUS_VNNI 1
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define CACTUS_AVX2 1
#if defined(__AVXVNNI__)
#define CACTUS_AVX_VNNI 1
#endif
#endif

#if defined(__AVX512BF16__)
#define CACTUS_AVX512_BF16 1
#endif

#if defined(__AVX512F__)
#define CACTUS_AVX512 1
#endif

#ifdef CACTUS_VNNI
// acc + a's unsigned bytes times b's signed bytes, four products to each int32 lane
// (vpdpbusd), in assembly: GCC 12 moves the accumulator of _mm512_dpbusd_epi32 to a fresh
// register around every call (a pass of 4 rows over 4 groups ran 32 moves beside its 16
// products) and spills the sums of more rows to memory. The same instruction, so the same bits.
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
#endif

// The instructions the int8 and int4 products were compiled for: "AVX512-VNNI", "AVX-VNNI",
// "AVX2" or "portable C++" (one row; blocks of rows take AMX tiles where has_amx()).
inline const char* int_simd() {
#if defined(CACTUS_VNNI)
  return "AVX512-VNNI";
#elif defined(CACTUS_AVX_VNNI)
  return "AVX-VNNI";
#elif defined(CACTUS_AVX2)
  return "AVX2";
#else
  return "portable C++";
#endif
}
