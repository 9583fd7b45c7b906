"""Asynchronous reduce-scatter and all-gather of flat buckets.

On gloo a pipelined ring over send/recv (csrc/comm/ring.h; faster than torch's from 4 MB buckets up, measured
in benchmarks/results/). wait() raises if a peer dies, naming it (Note [Naming a peer] in csrc/comm/peer_names.h).
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
    """Starts output = chunk `rank` of the sum of every rank's `input` (`input` is scratch on the ring)."""
    return CollectiveHandle(_C.ring_reduce_scatter(_resolve(group), input, output, impl), output)


def start_all_gather(input, output, group=None, impl="auto"):
    """Starts output = every rank's `input` concatenated in rank order; returns a CollectiveHandle."""
    return CollectiveHandle(_C.ring_all_gather(_resolve(group), input, output, impl), output)


def start_all_to_all(input, output, group=None):
    """Starts the all-to-all of `input`'s W rows (row j to rank j) into `output`; a failure names the peer."""
    return CollectiveHandle(_C.all_to_all(_resolve(group), input, output), output)


def start_two_level_all_gather(input, output, node_group, across_group, impl="auto", across_dtype=None):
    """Starts the node-aware all-gather (Note [Two-level collectives] in mesh_plan.py; Note [Node-aware chunk
    order] in layout.py): across the link by `across_group` first, then inside each node by `node_group`.
    across_dtype: None, torch.bfloat16 or torch.int8 (block-scaled): the first phase's format, every chunk of
    `output` rounded alike (csrc/comm/two_level.h)."""
    ensure_named(node_group)
    ensure_named(across_group)
    return CollectiveHandle(_C.two_level_all_gather(node_group, across_group, input, output, impl, across_dtype),
                            output)


def reduces_on_device(backend: str, device_type: str) -> bool:
    """Whether a tensor on `device_type` must go through the CUDA device to be reduced by `backend` (Note [Host
    bookkeeping on NCCL]).

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
# Flags and norms are CPU tensors; an NCCL-only group reduces them on the current CUDA device and copies back.
def to_staging(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.device("cuda", torch.cuda.current_device()))


def all_reduce(tensor, group, what: str, op=dist.ReduceOp.SUM) -> None:
    """torch's dist.all_reduce, whose failure names what was reduced and the likely cause (gloo's does not)."""
    try:
        if reduces_on_device(str(dist.get_backend(group)), tensor.device.type):
            staged = to_staging(tensor)
            dist.all_reduce(staged, op=op, group=group)
            tensor.copy_(staged)
            return
        dist.all_reduce(tensor, op=op, group=group)
    except RuntimeError as e:
        # One line: log collectors keep an error's first line. gloo names no peer; its address names the ranks.
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
