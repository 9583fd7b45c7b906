// The Python module shardopt._C. Ops live in the `shardopt` torch library
// (TORCH_LIBRARY in ops.cpp, reachable as torch.ops.shardopt.*); this module
// only binds what is not an op: CPU feature queries and stateful classes.
#include "cpu_features.h"
#include "module.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "shardopt C++ extension";
  m.def("supported_isas", [] {
    std::vector<std::string> out;
    for (auto isa : shardopt::supported_isas()) out.emplace_back(shardopt::isa_name(isa));
    return out;
  }, "SIMD variants this build and CPU can run, best last.");
  m.def("intra_op_parallel", [] {
#ifdef INTRA_OP_PARALLEL
    return true;
#else
    return false;
#endif
  }, "Whether at::parallel_for in this build forks threads (Note [at::parallel_for needs -fopenmp]).");
  m.def("best_isa", [] { return std::string(shardopt::isa_name(shardopt::best_isa())); });
  m.def("active_isa", [] { return std::string(shardopt::isa_name(shardopt::active_isa())); });
  m.def("set_isa_override", &shardopt::set_isa_override, py::arg("name"),
        "Force a SIMD variant (\"\" restores the default). For tests and benchmarks.");
  shardopt::init_comm_bindings(m);
  shardopt::init_ring_bindings(m);
  shardopt::init_adam_bindings(m);
}
