// What the AMX kernels (prefill_attention_amx.cpp, paged_attention_amx.cpp) share: whether this process may
// run tile instructions (false on every build without AVX512-BF16, and off x86-64 Linux), and the tile
// configuration's layout.
#pragma once

#include <cstdint>

#if defined(__x86_64__) && defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__linux__)
#define CHUNKWISE_AMX_BUILT 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define CHUNKWISE_AMX_BUILT 0
#endif

namespace chunkwise_amx {

#if CHUNKWISE_AMX_BUILT

// The CPU has AMX-TILE and AMX-BF16 (CPUID 7.0 EDX bits 24 and 22) and Linux granted this process the tile
// data state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked once; oneDNN asks the same).
inline bool usable() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1u) || !((d >> 22) & 1u)) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}
#else
inline bool usable() { return false; }
#endif

// ldtilecfg's 64-byte operand (palette 1): bytes per row and rows of each of the 8 tiles.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void set(int tile, int rows_, int colsb_) {
    rows[tile] = static_cast<uint8_t>(rows_);
    colsb[tile] = static_cast<uint16_t>(colsb_);
  }
};

}  // namespace chunkwise_amx
