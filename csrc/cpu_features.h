// Which SIMD instruction set the CPU kernels run with.
//
// Kernels are compiled once per ISA, each translation unit with its own flags
// (see setup.py / CMakeLists.txt), and the variant is chosen here at run time
// from what the CPU reports. The build never targets the build machine, so one wheel
// runs on any x86-64 or aarch64 machine.
#pragma once

#include <string>
#include <vector>

namespace shardopt {

enum class Isa { Scalar = 0, Neon = 1, Avx2 = 2, Avx512 = 3 };

const char* isa_name(Isa isa);
// Parses "scalar", "neon", "avx2", "avx512"; TORCH_CHECKs on anything else.
Isa isa_from_name(const std::string& name);

// Variants compiled into this build that this CPU can run, best last.
std::vector<Isa> supported_isas();
// The best of supported_isas().
Isa best_isa();
// The variant kernels use now: best_isa() unless overridden (tests force each).
Isa active_isa();
// Force a variant; TORCH_CHECKs that this CPU can run it. "" restores the default.
void set_isa_override(const std::string& name);

}  // namespace shardopt
