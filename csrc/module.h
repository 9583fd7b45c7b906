// Each component that binds Python classes or functions adds its init here.
#pragma once

#include <torch/extension.h>

namespace shardopt {
void init_comm_bindings(pybind11::module& m);
void init_ring_bindings(pybind11::module& m);
void init_adam_bindings(pybind11::module& m);
}  // namespace shardopt
