#include "cpu_features.h"

#include <atomic>
#include <cstdlib>

#include <c10/util/Exception.h>

namespace shardopt {
namespace {

// -1 means "no override"; otherwise the Isa value forced by set_isa_override.
std::atomic<int> g_override{-1};

bool cpu_runs(Isa isa) {
  switch (isa) {
    case Isa::Scalar:
      return true;
#if defined(SHARDOPT_HAVE_AVX2)
    case Isa::Avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
#endif
#if defined(SHARDOPT_HAVE_AVX512)
    case Isa::Avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
#if defined(SHARDOPT_HAVE_NEON)
    case Isa::Neon:
      return true;  // Advanced SIMD is part of the aarch64 baseline.
#endif
    default:
      return false;
  }
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Scalar: return "scalar";
    case Isa::Neon: return "neon";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
  }
  return "unknown";
}

Isa isa_from_name(const std::string& name) {
  for (Isa isa : {Isa::Scalar, Isa::Neon, Isa::Avx2, Isa::Avx512}) {
    if (name == isa_name(isa)) return isa;
  }
  TORCH_CHECK(false, "unknown ISA '", name, "': expected one of scalar, neon, avx2, avx512");
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::Scalar, Isa::Neon, Isa::Avx2, Isa::Avx512}) {
    if (cpu_runs(isa)) out.push_back(isa);
  }
  return out;
}

Isa best_isa() {
  static const Isa best = [] {
    Isa b = supported_isas().back();
    // SHARDOPT_ISA lets a user pin a variant without code changes (e.g. to
    // rule out an AVX-512 frequency drop); an unsupported value is an error.
    if (const char* env = std::getenv("SHARDOPT_ISA")) {
      if (*env) {
        Isa want = isa_from_name(env);
        TORCH_CHECK(cpu_runs(want), "SHARDOPT_ISA=", env, " but this CPU cannot run it; supported: ",
                    isa_name(b), " and below");
        b = want;
      }
    }
    return b;
  }();
  return best;
}

Isa active_isa() {
  int o = g_override.load(std::memory_order_relaxed);
  return o < 0 ? best_isa() : static_cast<Isa>(o);
}

void set_isa_override(const std::string& name) {
  if (name.empty()) {
    g_override.store(-1);
    return;
  }
  Isa isa = isa_from_name(name);
  TORCH_CHECK(cpu_runs(isa), "cannot force ISA '", name, "': this CPU does not support it");
  g_override.store(static_cast<int>(isa));
}

}  // namespace shardopt
