// The instruction-set paths of the kernels and what this CPU can run.
//
// A path names the code that computes a kernel; every path computes the same arithmetic in the
// same order, so each gives the portable path's bits (and a token's outputs do not depend on
// which path, or which other tokens, shared the call). Paths differ only in speed.
#pragma once

#include <cstdint>

namespace spx {

// AMX: Intel's tile unit for the many-row linear layers, the avx512 path for everything else.
// AMXEmulated: the amx path's code with its tile operations emulated in plain C++ (a test switch:
// it runs on any CPU, slowly, so that the amx code is compared bit for bit everywhere; never
// chosen by `auto`), beside the fastest vector path this CPU runs.
enum class Path : int { Portable = 0, AVX2 = 1, AVX512 = 2, NEON = 3, AMX = 4, AMXEmulated = 5 };
constexpr int kPaths = 6;

// Whether `p` is compiled into this build and this CPU runs it.
bool cpu_supports(Path p);

// The vector path whose kernels `p` runs outside its own (amx: avx512 for one row, activations
// and attention; amx-emulated: the fastest vector path this CPU runs); `p` itself otherwise.
Path vector_path(Path p);

// AVX-512 attention uses VDPBF16PS where the CPU has it; elsewhere the avx512 path runs the
// AVX2 attention kernel (same bits).
bool cpu_has_avx512_bf16();
// Whether VDPBF16PS beats float32 FMAs here (timed once a process, cpu.cpp): AMD's Zen 4 and
// 5 run it at twice their FMA rate, Intel's Xeons at half of theirs, so there attention's
// many-row runs compute its bits with two FMAs a pair.
bool avx512_bf16_dot_pays();

const char* path_name(Path p);

// What decides whether AMX runs, gathered once per process (cpu.cpp). Each step is checked only
// after the ones before it passed, so a CPU or OS without AMX never executes a tile instruction.
struct AmxProbe {
  bool x86 = false;               // an x86-64 build with the amx code compiled in
  bool avx512 = false;            // the vector half of the path (every AMX CPU has it)
  bool tile = false, int8 = false;  // CPUID.(7,0):EDX bits 24 (AMX-TILE) and 25 (AMX-INT8)
  uint32_t max_palette = 0;       // CPUID.(0x1D,0):EAX
  uint32_t palette1[4] = {0, 0, 0, 0};  // CPUID.(0x1D,1): EAX, EBX, ECX, EDX
  bool osxsave = false;           // CPUID.1:ECX bit 27 (XGETBV usable)
  uint64_t xcr0 = 0;              // XGETBV(0): bits 17 (XTILECFG) and 18 (XTILEDATA) set by the OS
  int permission = -1;            // arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA): 0 granted, else errno
};

// Why AMX cannot run given `probe` (one short clause), or null when it can. Pure: tests feed it
// made-up probes.
const char* amx_refusal(const AmxProbe& probe);

// This process's probe and verdict. SPECEXTEND_TEST_AMX_PERMISSION=deny (a test switch) makes the
// permission request fail without asking the kernel, as a VM or container that forbids AMX would.
const AmxProbe& amx_probe();
const char* amx_status();  // null when the amx path runs here

}  // namespace spx
