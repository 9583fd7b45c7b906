// Maps a run-time ISA choice to the Adam kernel compiled for it. Shared by the
// op (cpu_adam.cpp) and the C++ tests, so both exercise the same dispatch.
#pragma once

#include "../cpu_features.h"
#include "adam_kernel.h"

namespace shardopt {

// The kernel for `isa`; variants not compiled into this build (no
// SHARDOPT_HAVE_<ISA>) fall back to scalar, but supported_isas() never
// offers them in the first place.
inline AdamKernelFn adam_kernel_for(Isa isa) {
  switch (isa) {
#if defined(SHARDOPT_HAVE_AVX512)
    case Isa::Avx512: return adam_kernel_avx512;
#endif
#if defined(SHARDOPT_HAVE_AVX2)
    case Isa::Avx2: return adam_kernel_avx2;
#endif
#if defined(SHARDOPT_HAVE_NEON)
    case Isa::Neon: return adam_kernel_neon;
#endif
    default: return adam_kernel_scalar;
  }
}

}  // namespace shardopt
