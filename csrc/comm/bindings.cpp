#include "../module.h"

namespace shardopt {
void init_comm_bindings(pybind11::module& m) {
  (void)m;
}
}  // namespace shardopt
