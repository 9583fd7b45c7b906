// Python bindings of the ring collectives (csrc/comm/ring.h). Groups arrive as
// torch.distributed.ProcessGroup objects and the returned handle is a regular
// torch.distributed Work: torch binds both with intrusive_ptr holders.
#include <torch/csrc/utils/pybind.h>

#include "../module.h"
#include "int8_codec.h"
#include "onebit_codec.h"
#include "peer_names.h"
#include "replica_hop.h"
#include "ring.h"
#include "two_level.h"

namespace py = pybind11;

namespace shardopt {

void init_ring_bindings(py::module& m) {
  using comm::GroupPtr;
  // Starting an op may block briefly (queue lock, the native backend's own
  // enqueue), so the GIL is released for all of it.
  auto nogil = py::call_guard<py::gil_scoped_release>();

  m.def("ring_reduce_scatter",
        [](const GroupPtr& group, at::Tensor input, at::Tensor output, const std::string& impl) {
          return comm::start_reduce_scatter_auto(group, input, output, comm::parse_impl(impl));
        },
        py::arg("group"), py::arg("input"), py::arg("output"), py::arg("impl") = "auto", nogil,
        "Starts a sum reduce-scatter of 1-D `input` into `output` (chunk `rank`); returns a Work.\n"
        "impl: \"auto\" (ring on gloo, native otherwise), \"ring\" or \"native\". The ring uses\n"
        "`input` as scratch: its contents are unspecified afterwards. See csrc/comm/ring.h.");
  m.def("ring_all_gather",
        [](const GroupPtr& group, at::Tensor input, at::Tensor output, const std::string& impl) {
          return comm::start_all_gather_auto(group, input, output, comm::parse_impl(impl));
        },
        py::arg("group"), py::arg("input"), py::arg("output"), py::arg("impl") = "auto", nogil,
        "Starts an all-gather of every rank's 1-D `input` into `output`, in rank order; returns\n"
        "a Work. `input` may be output's chunk `rank` (in place). See csrc/comm/ring.h.");
  m.def("two_level_all_gather",
        [](const GroupPtr& node, const GroupPtr& across, at::Tensor input, at::Tensor output,
           const std::string& impl, std::optional<at::ScalarType> across_dtype) {
          return comm::start_two_level_all_gather(node, across, input, output, comm::parse_impl(impl), across_dtype);
        },
        py::arg("node"), py::arg("across"), py::arg("input"), py::arg("output"), py::arg("impl") = "auto",
        py::arg("across_dtype") = py::none(), nogil,
        "Starts the node-aware all-gather (Note [Two-level collectives]): across the nodes among the ranks\n"
        "of this local rank into the node chunk, then inside the node; `output` gets rank (node i, local j)'s\n"
        "input at chunk j * nodes + i. across_dtype (float32 tensors): None, torch.bfloat16 or torch.int8\n"
        "(block-scaled): the phase across nodes in that format, every output chunk (this rank's own too)\n"
        "the rounded values. Returns a Work. See csrc/comm/two_level.h.");
  m.def("all_to_all",
        [](const GroupPtr& group, at::Tensor input, at::Tensor output) {
          return comm::start_all_to_all(group, input, output);
        },
        py::arg("group"), py::arg("input"), py::arg("output"), nogil,
        "Starts an all-to-all of 1-D `input` (W rows: row j to rank j) into `output` (row j from rank j),\n"
        "point to point on the group's worker; returns a Work whose failure names the peer. See\n"
        "csrc/comm/ring.h.");
  // Note [Naming a peer] (csrc/comm/peer_names.h); shardopt/parallel/peers.py fills the registry.
  m.def("set_group_members", &comm::set_group_members, py::arg("group"), py::arg("label"), py::arg("global_ranks"),
        "Registers `group`'s members by global rank (group rank r is global_ranks[r]) and what the group is\n"
        "(label, e.g. \"node\"), for error messages.");
  m.def("has_group_members", &comm::has_group_members, py::arg("group"));
  m.def("group_label", &comm::group_label, py::arg("group"), "The label `group` was registered with (\"\": none).");
  m.def("set_rank_hosts", &comm::set_rank_hosts, py::arg("global_ranks"), py::arg("hosts"),
        "Registers the host each of `global_ranks` runs on, for error messages.");
  m.def("peer_name", &comm::peer_name, py::arg("group"), py::arg("rank"),
        "\"global rank G (host H, rank r of the L group)\": how errors name rank `rank` of `group`.");
  m.def("self_name", &comm::self_name, py::arg("group"),
        "\"rank r of W in the L group (global rank G)\": how errors name this rank in `group`.");
  m.def("ring_is_default", &comm::ring_is_default, py::arg("group"), nogil,
        "Whether impl=\"auto\" picks the ring for CPU tensors of this group.");
  m.def("replica_all_reduce",
        [](const GroupPtr& group, at::Tensor chunk, const std::string& format, std::optional<at::Tensor> residual) {
          return comm::start_replica_all_reduce(group, nullptr, chunk, comm::parse_hop_format(format),
                                                residual.value_or(at::Tensor()));
        },
        py::arg("group"), py::arg("chunk"), py::arg("format") = "exact", py::arg("residual") = py::none(), nogil,
        "Starts the in-place sum all-reduce of 1-D `chunk` over `group` (hybrid sharding's inter-node\n"
        "hop; format \"exact\", \"bfloat16\" or \"int8\"); returns a Work. See csrc/comm/replica_hop.h.");
  m.def("hop_encode",
        [](const at::Tensor& x, const std::string& format) {
          return comm::hop_encode(x, comm::parse_hop_format(format), at::kFloat);
        },
        py::arg("x"), py::arg("format"), "One message of the inter-node hop (for tests).");
  m.def("hop_decode",
        [](const at::Tensor& payload, const std::string& format, int64_t numel) {
          return comm::hop_decode(payload, comm::parse_hop_format(format), numel);
        },
        py::arg("payload"), py::arg("format"), py::arg("numel"), "Decodes hop_encode's message (for tests).");
  m.def("int8_encode",
        [](const at::Tensor& x, std::optional<at::Tensor> residual, std::optional<at::Tensor> decoded) {
          auto payload = at::empty({comm::int8_message_bytes(x.numel())}, x.options().dtype(at::kByte));
          comm::int8_encode(x, residual.value_or(at::Tensor()), payload, decoded.value_or(at::Tensor()));
          return payload;
        },
        py::arg("x"), py::arg("residual") = py::none(), py::arg("decoded") = py::none(), nogil,
        "The int8 hop's fused encode (Note [Fused int8 codec] in csrc/comm/int8_codec.h): returns the\n"
        "message of x + residual; updates `residual` (error feedback) and writes the decoded message\n"
        "into `decoded` (may be x) when given. For tests and benchmarks/bench_codec.py.");
  m.def("int8_decode",
        [](const at::Tensor& payload, const at::Tensor& out, std::optional<at::Tensor> base) {
          comm::int8_decode(payload, out, base.value_or(at::Tensor()));
        },
        py::arg("payload"), py::arg("out"), py::arg("base") = py::none(), nogil,
        "Decodes an int8 message into float32 `out`: out = decoded, or base + decoded (base may be out).");
  m.def("onebit_encode",
        [](const at::Tensor& x, const at::Tensor& payload, std::optional<at::Tensor> residual,
           std::optional<at::Tensor> decoded, int64_t block, double gain) {
          comm::onebit_encode(x, residual.value_or(at::Tensor()), payload, decoded.value_or(at::Tensor()), block,
                              gain);
        },
        py::arg("x"), py::arg("payload"), py::arg("residual") = py::none(), py::arg("decoded") = py::none(),
        py::arg("block") = comm::kOneBitBlock, py::arg("gain") = 1.0, nogil,
        "OneBitAdam's fused encode (Note [Fused 1-bit codec] in csrc/comm/onebit_codec.h): the message of\n"
        "x + residual into `payload` (uint8, onebit_message_bytes(n)), each block's scale its mean |x| times\n"
        "`gain` (0 < gain < 2); updates `residual` (error feedback) and writes the decoded message into\n"
        "`decoded` (may be x) when given.");
  m.def("onebit_decode",
        [](const at::Tensor& payload, const at::Tensor& out, std::optional<at::Tensor> base, int64_t block,
           std::optional<at::Tensor> times) {
          comm::onebit_decode(payload, out, base.value_or(at::Tensor()), block, times.value_or(at::Tensor()));
        },
        py::arg("payload"), py::arg("out"), py::arg("base") = py::none(), py::arg("block") = comm::kOneBitBlock,
        py::arg("times") = py::none(), nogil,
        "Decodes a 1-bit message into float32 `out`: out = decoded, base + decoded (base may be out) or\n"
        "decoded * times.");
  m.def("onebit_local_momentum", &comm::onebit_local_momentum, py::arg("grad"), py::arg("local"), py::arg("denom"),
        py::arg("a"), py::arg("beta1"), py::arg("x"), nogil,
        "Note [The local momentum in one pass] in csrc/comm/onebit_codec.h: local = local * beta1 + grad * a\n"
        "(in place) and x = local / denom, float32, each one IEEE rounding.");
  m.def("onebit_message_bytes", &comm::onebit_message_bytes, py::arg("n"), py::arg("block") = comm::kOneBitBlock);
  m.def("ring_piece_bytes", &comm::ring_piece_bytes);
  m.def("set_ring_piece_bytes", &comm::set_ring_piece_bytes, py::arg("bytes"),
        "Ring message size; must be equal on all ranks. For benchmarks.");
  m.def("ring_depth", &comm::ring_depth);
  m.def("set_ring_depth", &comm::set_ring_depth, py::arg("depth"),
        "Reduce-scatter receives posted ahead. For benchmarks.");
}

}  // namespace shardopt
