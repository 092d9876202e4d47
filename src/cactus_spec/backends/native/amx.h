// AMX tile registers (Intel AMX: 8 tiles of up to 16 rows x 64 bytes, tdpbf16ps / tdpbusd)
// as the bf16 and int8 kernels use them: C0..C3 accumulate 16 outputs each for a tile of up
// to 16 input rows, A (4) holds those rows' next 64 bytes of inputs, B (5..7) a weight tile
// of 16 x 64 bytes, which is exactly 16 consecutive groups of the packed layouts (for 32
// rows, amx_stripe_pair: A 4 and 5, B 6 and 7).
#pragma once

#include <algorithm>
#include <cstdint>

#include "simd.h"

// Whether AMX was compiled in and Linux lends this process the tile registers (it does so
// only on request, made once; a CPU without AMX or a kernel that refuses makes it false).
// A process held below AMX (CACTUS_SPEC_ISA=avx512) has a build without it.
bool has_amx();

#ifdef CACTUS_AMX
// Shape the calling thread's tiles (a thread's own state) for tiles of `rows` input rows.
void configure_tiles(int64_t rows);

// sums [rows][64] (4-byte sums) of a tile of input rows (row_bytes apart, each row_bytes
// long, a multiple of 64) against one 64-output stripe of a packed weight (four tiles of
// 16 outputs, 16 * row_bytes apart, each 64 bytes of 16 outputs' inputs per 64 bytes of a
// row): float32 sums of bfloat16 pairs (kBf16) or int32 sums of uint8 x int8 quads.
// (The tile instructions take their tile numbers as literals, hence the macro.)
#define CACTUS_TILE_DOT(c, a, b) \
  if constexpr (kBf16) {         \
    _tile_dpbf16ps(c, a, b);     \
  } else {                       \
    _tile_dpbusd(c, a, b);       \
  }
// The four weight tiles of a step this many steps ahead are fetched into the L1 cache while
// the step's products run: a tile load does not start the hardware's stream prefetch as
// vector loads do, and without it a block of 2-16 rows ran at about half the memory's rate
// (docs/RESULTS.md, "Kernels").
constexpr int64_t kTilesAhead = 2;

// Fetch the 16 lines of each of kTiles tiles at w, tile_stride apart.
template <int kTiles = 4>
inline void prefetch_tiles(const uint8_t* w, int64_t tile_stride) {
  for (int t = 0; t < kTiles; ++t) {
    for (int line = 0; line < 1024; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w + t * tile_stride + line), _MM_HINT_T0);
    }
  }
}

// Fetch the line at `at` of each of 32 rows, row_bytes apart: a pair's input rows outgrow the
// L1 cache when many pass over a stripe, and without it their tile loads waited on the L2.
inline void prefetch_rows(const uint8_t* at, int64_t row_bytes) {
  for (int r = 0; r < 32; ++r) _mm_prefetch(reinterpret_cast<const char*>(at + r * row_bytes), _MM_HINT_T0);
}

// C0..C3 to zero.
inline void zero_sums() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

template <bool kBf16>
void amx_stripe(const uint8_t* rows, int64_t row_bytes, const uint8_t* stripe, void* sums) {
  const int64_t tile_stride = 16 * row_bytes;
  zero_sums();
  for (int64_t at = 0; at < row_bytes; at += 64) {
    const uint8_t* w = stripe + at * 16;
    prefetch_tiles(w + kTilesAhead * 1024, tile_stride);
    _tile_loadd(4, rows + at, row_bytes);
    _tile_loadd(5, w, 64);
    CACTUS_TILE_DOT(0, 4, 5)
    _tile_loadd(6, w + tile_stride, 64);
    CACTUS_TILE_DOT(1, 4, 6)
    _tile_loadd(7, w + 2 * tile_stride, 64);
    CACTUS_TILE_DOT(2, 4, 7)
    _tile_loadd(5, w + 3 * tile_stride, 64);
    CACTUS_TILE_DOT(3, 4, 5)
  }
  auto* out = static_cast<uint8_t*>(sums);
  _tile_stored(0, out, 256);
  _tile_stored(1, out + 64, 256);
  _tile_stored(2, out + 128, 256);
  _tile_stored(3, out + 192, 256);
}

// sums [32][64] of two tiles of 16 input rows (the second 16 rows after the first) against a
// stripe as amx_stripe's: per half of the stripe (32 outputs), C0..C3 hold the four products of
// the rows' two A tiles (4, 5) and the half's two weight tiles (6, 7), so each tile loaded feeds
// two products (amx_stripe's five loads feed four); the rows' next lines are fetched as the
// weight's are. Each sum adds the same products in the same order as amx_stripe's, so it has
// the same bits. (A prompt's rows: 1.4-1.5x amx_stripe's speed, benchmarks/kernel_cost.py.)
template <bool kBf16>
void amx_stripe_pair(const uint8_t* rows, int64_t row_bytes, const uint8_t* stripe, void* sums) {
  const int64_t tile_stride = 16 * row_bytes;
  auto* out = static_cast<uint8_t*>(sums);
  for (int64_t half = 0; half < 2; ++half) {
    const uint8_t* weights = stripe + half * 2 * tile_stride;
    zero_sums();
    for (int64_t at = 0; at < row_bytes; at += 64) {
      const uint8_t* w = weights + at * 16;
      prefetch_tiles<2>(w + kTilesAhead * 1024, tile_stride);
      prefetch_rows(rows + at + kTilesAhead * 64, row_bytes);
      _tile_loadd(4, rows + at, row_bytes);
      _tile_loadd(6, w, 64);
      CACTUS_TILE_DOT(0, 4, 6)
      _tile_loadd(5, rows + tile_stride + at, row_bytes);
      CACTUS_TILE_DOT(2, 5, 6)
      _tile_loadd(7, w + tile_stride, 64);
      CACTUS_TILE_DOT(1, 4, 7)
      CACTUS_TILE_DOT(3, 5, 7)
    }
    uint8_t* at = out + half * 128;
    _tile_stored(0, at, 256);
    _tile_stored(1, at + 64, 256);
    _tile_stored(2, at + 16 * 256, 256);
    _tile_stored(3, at + 16 * 256 + 64, 256);
  }
}
#undef CACTUS_TILE_DOT

// sums [32][64] of the first `count` (at most 32) of the input rows against a stripe: a pair
// of tiles where more than 16 remain, one tile (amx_stripe) otherwise.
template <bool kBf16>
void amx_rows(const uint8_t* rows, int64_t count, int64_t row_bytes, const uint8_t* stripe,
              void* sums) {
  if (count > 16) {
    amx_stripe_pair<kBf16>(rows, row_bytes, stripe, sums);
  } else {
    amx_stripe<kBf16>(rows, row_bytes, stripe, sums);
  }
}
#endif

// The calling thread's tiles shaped for tiles of `rows` input rows while this lives, where
// `on` (AMX compiled in and used), released after: a thread's own state.
class Tiles {
 public:
  Tiles(bool on, int64_t rows) : on_(on) {
#ifdef CACTUS_AMX
    if (on_) configure_tiles(rows);
#endif
    (void)rows;
  }
  ~Tiles() {
#ifdef CACTUS_AMX
    if (on_) _tile_release();
#endif
  }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;

 private:
  bool on_;
};

// Input rows of a pair of AMX tiles (amx_stripe_pair).
constexpr int64_t kPairRows = 32;

// Input rows a kernel takes at once from the `left` rows of a block: a pair of AMX tiles
// where more than 16 remain, else its own `step` (a tile's rows, or a pass's without AMX).
inline int64_t rows_at_once(bool amx, int64_t left, int64_t step) {
  return std::min(amx && left > 16 ? kPairRows : step, left);
}

// Input rows per AMX tile for a block of m rows (at least 1, so no rows make no tiles).
inline int64_t tile_rows(int64_t m) { return m < 1 ? 1 : m < 16 ? m : 16; }
