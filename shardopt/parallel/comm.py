"""Asynchronous reduce-scatter and all-gather of flat buckets.

Thin wrappers over the C++ collectives in csrc/comm/ring.h: on gloo a pipelined
ring over the group's send/recv (from 4 MB buckets up, 1.5-5x faster than torch's
reduce_scatter_tensor and 1.1-3.7x faster than all_gather_into_tensor there; see
benchmarks/results/2026-11-22-collectives.md), elsewhere the group's native collectives;
and the node-aware all-gather over ranks on several nodes (csrc/comm/two_level.h).

    h = start_reduce_scatter(flat_grad, grad_chunk)   # returns at once
    ...                                              # compute meanwhile
    h.wait()                                         # grad_chunk is ready

Rules (details in ring.h):
- 1-D contiguous float32/bfloat16/float16 tensors, the same sizes on every rank;
  start collectives of a group in the same order on every rank.
- Reduce-scatter on the ring uses `input` as scratch: its contents are
  unspecified afterwards. `output` may be `input`'s own chunk (in place).
- All-gather never writes `input`, which may be `output`'s own chunk (in place).
- Do not read `output` (or write `input`) before wait(). wait() raises, never
  hangs, if a peer dies: every receive is bounded by the group's timeout, and
  the error names the peer by its global rank and host (Note [Naming a peer] in
  csrc/comm/peer_names.h; a group shardopt did not build is registered here on
  first use).
"""
import torch
import torch.distributed as dist

from shardopt._ext import _C
from shardopt.parallel.peers import ensure_named, ranks_at_address

IMPLS = ("auto", "ring", "native")


class CollectiveHandle:
    """A started collective. wait() blocks until it is done and returns its output."""

    __slots__ = ("work", "output")

    def __init__(self, work, output):
        self.work = work  # a torch.distributed Work
        self.output = output

    def wait(self):
        self.work.wait()
        return self.output

    def is_completed(self):
        return self.work.is_completed()


def _resolve(group):
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError("shardopt.parallel.comm: no process group given and torch.distributed is not "
                               "initialized")
        group = dist.group.WORLD
    ensure_named(group)
    return group


def start_reduce_scatter(input, output, group=None, impl="auto"):
    """Starts output = chunk `rank` of the sum of every rank's `input`; returns a CollectiveHandle.

    `input` has world_size * output.numel() elements. impl: "auto" (ring on gloo,
    native elsewhere), "ring" or "native".
    """
    return CollectiveHandle(_C.ring_reduce_scatter(_resolve(group), input, output, impl), output)


def start_all_gather(input, output, group=None, impl="auto"):
    """Starts output = every rank's `input` concatenated in rank order; returns a CollectiveHandle."""
    return CollectiveHandle(_C.ring_all_gather(_resolve(group), input, output, impl), output)


def start_all_to_all(input, output, group=None):
    """Starts the all-to-all of `input`'s W rows (row j to rank j) into `output` (row j from rank j), point to
    point on the group's worker, in the order of the group's other shardopt collectives; returns a
    CollectiveHandle. 1-D CPU tensors of one dtype (float32, bfloat16, float16 or uint8), numel a multiple of
    W, not overlapping. Unlike torch's all_to_all_single on gloo, a failure names the peer."""
    return CollectiveHandle(_C.all_to_all(_resolve(group), input, output), output)


def start_two_level_all_gather(input, output, node_group, across_group, impl="auto"):
    """Starts the node-aware all-gather (Note [Two-level collectives] in mesh_plan.py); returns a CollectiveHandle.

    W = R * K ranks on R nodes of K, rank = node * K + local; `node_group` is
    this rank's node, `across_group` the R ranks with this local rank. output
    (W * input.numel() elements) gets rank (node i, local j)'s input at chunk
    j * R + i (Note [Node-aware chunk order] in layout.py): the ranks of
    `across_group` gather into node chunk j across the link, then each node
    gathers its K node chunks inside. `input` may be output's own chunk (in
    place). impl applies to the first phase; the second is the ring, chained
    after it (csrc/comm/two_level.h).
    """
    ensure_named(node_group)
    ensure_named(across_group)
    return CollectiveHandle(_C.two_level_all_gather(node_group, across_group, input, output, impl), output)


def reduces_on_device(backend: str, device_type: str) -> bool:
    """Whether a tensor on `device_type` must go through the current CUDA device to be reduced by `backend`
    (dist.get_backend's string). Note [Host bookkeeping on NCCL].

    >>> reduces_on_device("nccl", "cpu"), reduces_on_device("cpu:gloo,cuda:nccl", "cpu"), reduces_on_device("gloo", "cpu")
    (True, False, False)
    """
    if device_type != "cpu":
        return False
    names = [part.split(":", 1) for part in backend.lower().split(",")]
    if any(len(n) == 2 for n in names):  # "cpu:gloo,cuda:nccl": one backend per device type
        return not any(len(n) == 2 and n[0] == "cpu" for n in names)
    return names[0][0] == "nccl"


# Note [Host bookkeeping on NCCL]
# -------------------------------
# Per-parameter flags and norms (which parameters have a gradient, their global
# norms, the step's "saw inf/nan") are small CPU tensors: the host decides with
# them (which p.grad is None, whether a step is skipped), and one read per step
# suffices. gloo reduces CPU tensors; NCCL only CUDA ones, and a group made by
# init_process_group("nccl") has no CPU backend. So all_reduce copies such a
# tensor to the current CUDA device (the rank's, set before the group was
# made), reduces it there and copies it back: one small copy each way, which
# the host reads next anyway. A group with a CPU backend ("cpu:gloo,cuda:nccl")
# reduces it where it is.
def to_staging(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of host tensor `tensor` where NCCL reduces it: on this rank's current CUDA device."""
    return tensor.to(torch.device("cuda", torch.cuda.current_device()))


def all_reduce(tensor, group, what: str, op=dist.ReduceOp.SUM) -> None:
    """torch's dist.all_reduce (gloo's or NCCL's own), whose failure names what was being reduced and the
    likely cause, as the ring's errors do: gloo alone says "Timed out waiting ...ms for send operation to
    complete" when a peer or its node is gone. A CPU tensor on an NCCL group is reduced through the current
    CUDA device (Note [Host bookkeeping on NCCL])."""
    try:
        if reduces_on_device(str(dist.get_backend(group)), tensor.device.type):
            staged = to_staging(tensor)
            dist.all_reduce(staged, op=op, group=group)
            tensor.copy_(staged)
            return
        dist.all_reduce(tensor, op=op, group=group)
    except RuntimeError as e:
        # One line: launchers and log collectors keep the first line of an error (the cause follows the symptom).
        # gloo's own collectives name no peer; where gloo gives its address, the ranks there (Note [Naming a peer]).
        where = ranks_at_address(str(e))
        msg = (f"shardopt: the {what} all-reduce failed on rank {dist.get_rank()}: {str(e).strip()} -- a peer rank "
               f"has probably exited, crashed, lost its link, or is not running the same sequence of "
               f"backward()/step() calls; see the other ranks' logs." + (f" ({where})" if where else ""))
        try:
            err = type(e)(msg)
        except Exception:  # noqa: BLE001 - an error type that takes no message
            err = RuntimeError(msg)
        raise err from e


def finish(handles):
    """Waits for every handle in order (the order they run in); returns their outputs."""
    return [h.wait() for h in handles]


__all__ = ["CollectiveHandle", "IMPLS", "all_reduce", "finish", "reduces_on_device", "start_all_gather",
           "start_all_to_all", "start_reduce_scatter", "start_two_level_all_gather"]
