// AMX set-up shared by the kernels (see amx.h).

#include "amx.h"

#ifdef CACTUS_AMX
#include <sys/syscall.h>
#include <unistd.h>

namespace {

// ldtilecfg's 64-byte operand (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace

void configure_tiles(int64_t rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = static_cast<uint8_t>(t < 5 ? rows : 16);
  }
  // GCC does not see ldtilecfg read the struct and drops the stores above without this.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}
#endif

bool has_amx() {
#ifdef CACTUS_AMX
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                      18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
#else
  return false;
#endif
}
