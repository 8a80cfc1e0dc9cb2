// The few Intel AMX tile operations the amx kernels use, behind one small interface with two
// backends: NativeTiles (the instructions) and EmuTiles (plain C++, exact by the instructions'
// definitions in Intel's ISA reference), so the amx path's code runs, and is compared bit for bit
// with the portable path, on any CPU. A backend is a type with static members:
//   config(cfg) LDTILECFG, release() TILERELEASE, load<T>(base, stride) TILELOADD,
//   zero<T>() TILEZERO, store<T>(base, stride) TILESTORED, dpbsud<C, A, B>() TDPBSUD
// (C[m][n] += sum over k of int8 A[m][k] x uint8 B[k/4][4n + k%4], int32 with wrap-around).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace spx {

// Palette 1: 8 tiles of at most 16 rows x 64 bytes.
constexpr int kTileRegs = 8;
constexpr int kTileMaxRows = 16;
constexpr int kTileMaxBytes = 64;

// LDTILECFG's 64-byte operand.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of tile i (only the first 8 exist in palette 1)
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// The emulation: each thread's tile registers and configuration, as the hardware keeps them per
// thread. Operations that would fault on the hardware (no configuration loaded, shapes that do
// not fit) stop the process with a message, so a test cannot pass over code that would crash.
struct EmuTiles {
  struct State {
    TileConfig cfg;
    bool loaded = false;
    uint8_t t[kTileRegs][kTileMaxRows][kTileMaxBytes];
  };

  static State& st() {
    thread_local State s;
    return s;
  }

  [[noreturn]] static void fault(const char* what) {
    std::fprintf(stderr, "specextend: emulated AMX fault: %s\n", what);
    std::abort();
  }

  static const State& configured(int tile) {
    const State& s = st();
    if (!s.loaded) fault("tile instruction without a loaded tile configuration");
    if (s.cfg.rows[tile] == 0 || s.cfg.colsb[tile] == 0) fault("tile used but not configured");
    return s;
  }

  static void config(const TileConfig& c) {
    if (c.palette != 1) fault("only palette 1 is used");
    for (int i = 0; i < kTileRegs; ++i)
      if (c.rows[i] > kTileMaxRows || c.colsb[i] > kTileMaxBytes || (c.rows[i] == 0) != (c.colsb[i] == 0))
        fault("tile configuration out of palette 1's bounds");
    State& s = st();
    s.cfg = c;
    s.loaded = true;
    std::memset(s.t, 0, sizeof(s.t));  // LDTILECFG zeroes every tile
  }

  static void release() {
    State& s = st();
    s.loaded = false;
    std::memset(s.t, 0, sizeof(s.t));
  }

  // Rows and bytes past the configured shape read as zero (the instructions zero them).
  template <int T>
  static void load(const void* base, int64_t stride) {
    State& s = st();
    configured(T);
    std::memset(s.t[T], 0, sizeof(s.t[T]));
    for (int r = 0; r < s.cfg.rows[T]; ++r)
      std::memcpy(s.t[T][r], static_cast<const uint8_t*>(base) + r * stride, s.cfg.colsb[T]);
  }

  template <int T>
  static void zero() {
    configured(T);
    std::memset(st().t[T], 0, sizeof(st().t[T]));
  }

  template <int T>
  static void store(void* base, int64_t stride) {
    const State& s = configured(T);
    for (int r = 0; r < s.cfg.rows[T]; ++r)
      std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.t[T][r], s.cfg.colsb[T]);
  }

  template <int C, int A, int B>
  static void dpbsud() {
    static_assert(C != A && C != B && A != B, "TDPBSUD's three tiles are distinct");
    State& s = st();
    configured(C);
    configured(A);
    configured(B);
    const TileConfig& g = s.cfg;
    if (g.rows[C] != g.rows[A] || g.colsb[C] != g.colsb[B] || g.colsb[A] != 4 * g.rows[B] || g.colsb[C] % 4 != 0)
      fault("TDPBSUD shapes do not match");
    for (int m = 0; m < g.rows[C]; ++m)
      for (int n = 0; n < g.colsb[C] / 4; ++n) {
        uint32_t c;
        std::memcpy(&c, s.t[C][m] + 4 * n, 4);
        for (int k = 0; k < g.colsb[A] / 4; ++k)
          for (int j = 0; j < 4; ++j) {
            const int32_t a = static_cast<int8_t>(s.t[A][m][4 * k + j]);
            const int32_t b = s.t[B][k][4 * n + j];
            c += static_cast<uint32_t>(a * b);
          }
        std::memcpy(s.t[C][m] + 4 * n, &c, 4);
      }
  }
};

#if defined(__x86_64__) && !defined(SPECEXTEND_EMULATE_AVX512)
// The instructions, written as asm with the whole configuration as an operand and a memory
// clobber on every one: GCC 12's own intrinsics declare that LDTILECFG reads 8 bytes of its 64 and
// that TILELOADD/TILESTORED touch no memory, so the compiler may drop the configuration's stores
// (the tiles then fault: llama.cpp's AMX crash, shared/notes/cpu-amx.md) or move a buffer's stores
// past the load that reads it. The assembler needs only to know the mnemonics (binutils 2.36+).
struct NativeTiles {
  static void config(const TileConfig& c) { asm volatile("ldtilecfg %0" : : "m"(c) : "memory"); }
  static void release() { asm volatile("tilerelease" : : : "memory"); }
  template <int T>
  static void load(const void* base, int64_t stride) {
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" : : "r"(base), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  static void zero() {
    asm volatile("tilezero %%tmm%c0" : : "i"(T) : "memory");
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    asm volatile("tilestored %%tmm%c2, (%0,%1,1)" : : "r"(base), "r"(stride), "i"(T) : "memory");
  }
  template <int C, int A, int B>
  static void dpbsud() {
    asm volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" : : "i"(C), "i"(A), "i"(B) : "memory");
  }
};
#endif

}  // namespace spx
