// Each component that binds Python classes or functions adds its init here.
#pragma once

// Not <torch/extension.h>: that one brings torch's whole C++ frontend (torch/all.h: nn, optim, data,
// serialization), which none of csrc/ uses, and alone takes longer to compile than most of our files
// (Note [Unity build] in build_support/unity.py). pybind11 and torch's type casters are all a binding needs.
#include <torch/csrc/utils/pybind.h>

namespace shardopt {
void init_comm_bindings(pybind11::module& m);
void init_ring_bindings(pybind11::module& m);
void init_adam_bindings(pybind11::module& m);
}  // namespace shardopt
