#include "two_level.h"

#include "int8_codec.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

namespace shardopt::comm {

WorkPtr start_two_level_all_gather(const GroupPtr& node, const GroupPtr& across, at::Tensor input,
                                   at::Tensor output, Impl impl, std::optional<at::ScalarType> across_dtype) {
  constexpr const char* op = "two-level all_gather";
  TORCH_CHECK(node && across, op, ": the node group and the across-nodes group must both be given");
  TORCH_CHECK_VALUE(input.defined() && output.defined() && input.dim() == 1 && output.dim() == 1, op,
                    ": input and output must be 1-D tensors");
  const int64_t k = node->getSize(), r = across->getSize(), n = input.numel();
  const int64_t local = node->getRank(), at_node = across->getRank();
  TORCH_CHECK_VALUE(output.numel() == n * k * r, op, ": output numel ", output.numel(), " must be (ranks per node ",
                    k, ") * (nodes ", r, ") * input numel ", n);
  // The in-place form is output's chunk local * R + node (Note [Node-aware chunk order]); any other
  // overlap would be overwritten before it is sent.
  const int64_t mine = local * r + at_node;
  if (n > 0 && input.data_ptr() != output.narrow(0, mine * n, n).data_ptr()) {
    TORCH_CHECK_VALUE(at::get_overlap_status(output, input) == at::MemOverlapStatus::No, op,
                      ": input overlaps output but is not exactly its chunk ", mine, " (output[", mine * n, ":",
                      (mine + 1) * n, "], chunk local * nodes + node); only that in-place form is supported");
  }
  if (r == 1) return start_all_gather_auto(node, input, output, impl);  // one node: a flat gather
  auto node_chunk = output.narrow(0, local * r * n, r * n);
  if (across_dtype && *across_dtype == input.scalar_type()) across_dtype.reset();  // nothing to narrow
  if (across_dtype) {
    TORCH_CHECK_VALUE(input.scalar_type() == at::kFloat && output.scalar_type() == at::kFloat, op,
                      ": a narrower phase across nodes takes float32 tensors, got ", input.scalar_type());
    TORCH_CHECK_VALUE(*across_dtype == at::kBFloat16 || *across_dtype == at::kChar, op,
                      ": the phase across nodes can be bfloat16 or int8 (block-scaled), got ", *across_dtype);
  }
  if (across_dtype && *across_dtype == at::kChar) {
    // One message per rank, each slot padded to 4 bytes so that every message's scales are aligned.
    const int64_t bytes = int8_message_bytes(n), slot = (bytes + 3) / 4 * 4;
    auto messages = at::empty({r * slot}, input.options().dtype(at::kByte));
    messages.narrow(0, at_node * slot + bytes, slot - bytes).zero_();
    int8_encode(input.contiguous(), at::Tensor(), messages.narrow(0, at_node * slot, bytes), at::Tensor());
    auto first = start_all_gather_auto(across, messages.narrow(0, at_node * slot, slot), messages, impl);
    return start_all_gather_after(node, std::move(first), node_chunk, output,
                                  [messages, node_chunk, r, n, bytes, slot]() mutable {
                                    for (int64_t i = 0; i < r; ++i) {
                                      int8_decode(messages.narrow(0, i * slot, bytes), node_chunk.narrow(0, i * n, n),
                                                  at::Tensor());
                                    }
                                  });
  }
  if (across_dtype && *across_dtype != input.scalar_type()) {
    auto narrow_in = input.to(*across_dtype);
    auto narrow_chunk = at::empty({r * n}, input.options().dtype(*across_dtype));
    auto first = start_all_gather_auto(across, narrow_in, narrow_chunk, impl);
    // Widened on the node group's worker once the first phase is done; with one rank per node the
    // phase inside the node is then an in-place no-op (a ring of one), kept so that wait() covers it.
    return start_all_gather_after(node, std::move(first), node_chunk, output,
                                  [narrow_chunk, node_chunk]() mutable { node_chunk.copy_(narrow_chunk); });
  }
  auto first = start_all_gather_auto(across, input, node_chunk, impl);
  if (k == 1) return first;  // one rank per node: the node chunk is the whole output
  return start_all_gather_after(node, std::move(first), node_chunk, output);
}

}  // namespace shardopt::comm
