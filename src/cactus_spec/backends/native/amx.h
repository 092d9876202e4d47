// AMX tile registers (Intel AMX: 8 tiles of up to 16 rows x 64 bytes, tdpbf16ps / tdpbusd)
// as the bf16 and int8 kernels use them: C0..C3 accumulate 16 outputs each for a tile of up
// to 16 input rows, A (4) holds those rows' next 64 bytes of inputs, B (5..7) a weight tile
// of 16 x 64 bytes, which is exactly 16 consecutive groups of the packed layouts.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#include <immintrin.h>
#define CACTUS_AMX 1
#endif

// Whether AMX was compiled in and Linux lends this process the tile registers (it does so
// only on request, made once; a CPU without AMX or a kernel that refuses makes it false),
// and CACTUS_SPEC_AMX is not "0" (read at every call: the int8 kernel then takes VNNI).
bool has_amx();

#ifdef CACTUS_AMX
// Shape the calling thread's tiles (a thread's own state) for tiles of `rows` input rows.
void configure_tiles(int64_t rows);
#endif

// Input rows per AMX tile for a block of m rows.
inline int64_t tile_rows(int64_t m) { return m < 16 ? m : 16; }
