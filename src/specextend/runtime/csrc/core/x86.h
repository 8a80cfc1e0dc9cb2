// The x86 intrinsics; the exactness program may swap the AVX-512 ones for an emulation
// (test/emulate_avx512.h) to run the avx512 path's code on a CPU without AVX-512.
#pragma once

#if defined(SPECEXTEND_EMULATE_AVX512)
#include "../test/emulate_avx512.h"
#else
#include <immintrin.h>
#endif
