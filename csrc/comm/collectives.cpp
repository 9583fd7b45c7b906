#include "collectives.h"

#include <c10/util/Exception.h>

namespace shardopt::comm {

c10::intrusive_ptr<c10d::Work> start_reduce_scatter(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                                    at::Tensor input, at::Tensor output,
                                                    const std::string& impl) {
  TORCH_CHECK(impl == "native" || impl == "auto" || impl == "ring", "unknown collective impl '", impl, "'");
  return pg->reduce_scatter_single(output, input);
}

c10::intrusive_ptr<c10d::Work> start_all_gather_rows(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                                     at::Tensor rows, const std::string& impl) {
  TORCH_CHECK(impl == "native" || impl == "auto" || impl == "ring", "unknown collective impl '", impl, "'");
  TORCH_CHECK(rows.dim() == 2 && rows.size(0) == pg->getSize() && rows.stride(1) == 1,
              "all-gather rows must be [world_size, n] with contiguous rows");
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int64_t r = 0; r < rows.size(0); ++r) outputs[0].push_back(rows.select(0, r));
  // A separate input: gloo copies input into outputs[rank], which must not alias it.
  std::vector<at::Tensor> inputs{rows.select(0, pg->getRank()).clone()};
  return pg->allgather(outputs, inputs);
}

}  // namespace shardopt::comm
