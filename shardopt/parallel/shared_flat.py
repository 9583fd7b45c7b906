"""One host, stages 1-2: every rank's flat parameter buffer in shared memory, and the parameter all-gather
after a step done by copying the other ranks' chunks straight out of their buffers (Note [Gathering
through shared memory]).

    shared = open_shared_flat(numel, dtype, group, want)   # a collective; None: not on one host
    flat = shared.flat                                     # this rank's buffer, as torch.zeros(numel)
    gather = SharedGather(layout, rank, shared)            # start_/finish_ as the bucket engine's gathers

Note [Gathering through shared memory]
--------------------------------------
On one host, gloo carries the all-gather after a step over loopback TCP: every byte is copied into the
kernel and out again, by the CPU, which on a CPU-trained model is the one doing the compute. Measured
on the project VM (2 cores, torch 2.13; benchmarks/bench_shared_gather.py, results in
benchmarks/results/2026-11-26-shared-gather.md): a 16 MB buffer gathers in 10.7 ms on our gloo ring and
4.6 ms through shared memory at 2 ranks (18.4 and 10.1 at 4). That gather is the part of a ZeRO step
DDP does not have (DDP's all-reduce hides behind backward; the gather follows the optimizer step): on
one host flat ZeRO-2 went from 1.02-1.08x DDP to 0.99-1.03x (0.74-0.75x where communication dominates).

So when every rank of a flat shard group is on this host, each rank's flat parameter buffer (the
model's parameters are views into it) is a file in /dev/shm that every rank maps, unlinked as soon as
all have mapped it (a run that ends, however it ends, leaves nothing; only a rank killed inside the
constructor's handshake can leave its file, named shardopt-flat-<pid of rank 0>-<token>-<rank>). The
gather of bucket b copies, for each other rank r, its chunk r of b out of r's buffer into the same place
of this rank's. No staging memory: the buffers exist anyway; shared memory just lets the others read
them (a process's Rss then counts the other ranks' pages it read, (W-1)/W of the buffer; its Pss, and
the host's memory, do not grow). The values are the same bytes the process group would deliver: a run
is bit for bit the same with it on or off.

Two barriers keep readers and writers apart. On x86 they go through shared memory too (a counter per
rank in a page after its buffer: Note [Barriers in shared memory] in shm_barrier.py); elsewhere they are
gloo barriers on a group of their own. Either way with the shard group's timeout: a lost rank raises,
never hangs.
  written:   started when this rank's own chunks hold the step's values (Publisher.publish, after the
             master copy); a bucket is copied only after it completed on every rank.
  read_done: started once this rank copied every bucket; waited before this rank writes its own chunks
             again (the next step, a load: everything that calls Publisher.wait() first).
Without overlap_gather step() waits for read_done before returning, so code that writes parameters in
place after step() (a hand-made decay, an EMA written back) cannot change what a slower rank is still
copying. With overlap_gather the copies happen in the next forward's pre-hooks, and writing parameters
before that forward needs wait_params() first, as with the process group's gathers in flight.

When it is used (shared_memory_gather=None, the default): stages 1-2, a CPU model, and a shard group
(the ranks that gather) inside one node: every rank when LOCAL_WORLD_SIZE is unset or equals the world
size; a hybrid mesh's shard group (shard_group="node", or a mesh whose shard ranks share rank //
LOCAL_WORLD_SIZE, torchrun's node numbering) on any number of nodes. Flat sharding across nodes (real,
or the emulated cluster's network namespaces) keeps the process group, node-aware collectives included.
And every rank must see the others' files (a handshake at construction). /dev/shm must hold every rank's
buffer (a container's 64 MB default often does not): each rank reserves its file with posix_fallocate,
so a short /dev/shm falls back to the process group at construction instead of failing later.
shared_memory_gather=True raises, naming the reason, where any of this does not hold; False never uses it.
"""
from __future__ import annotations

import mmap
import os
import platform
import secrets
from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardopt.parallel.mesh import group_timeout, copy_group
from shardopt.parallel.shm_barrier import ShmBarrier, pid_namespace, why_not_fast

SHM_DIR = "/dev/shm"
_MARK = 16  # bytes of the handshake mark at the start of each file


def why_not_shared(device: torch.device, node_aware: bool, shard_ranks: Sequence[int],
                   world: int) -> str | None:
    """Why the flat buffers of the shard group of global ranks `shard_ranks` (of `world` in all) cannot be
    shared (None: they can, if the handshake agrees). Reads LOCAL_WORLD_SIZE; no process group."""
    if len(shard_ranks) == 1:
        return "one rank: nothing to gather"
    if device.type != "cpu":
        return f"the model is on {device}: shared memory holds CPU buffers"
    if node_aware:
        return "node-aware collectives: the ranks span nodes"
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is not None and raw.isdigit() and 0 < int(raw) < world:
        # torchrun numbers ranks node by node: rank // LOCAL_WORLD_SIZE is the node.
        nodes = sorted({r // int(raw) for r in shard_ranks})
        if len(nodes) > 1:
            return (f"the shard group spans nodes {nodes} (LOCAL_WORLD_SIZE={raw} < world size {world}); a "
                    f"hybrid mesh's shard group inside one node can use it")
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} does not exist"
    return None


class SharedFlat:
    """This rank's flat buffer (`flat`) and every rank's, mapped (`buffers[r]`, `buffers[rank] is flat`); the
    barrier through shared memory (None: the gloo barrier on `barrier_group`)."""

    def __init__(self, buffers: list[torch.Tensor], rank: int, barrier_group, barrier: ShmBarrier | None = None):
        self.buffers = buffers
        self.flat = buffers[rank]
        self.barrier_group = barrier_group
        self.barrier = barrier


def open_shared_flat(numel: int, dtype: torch.dtype, group, want: bool | None, why_not: str | None
                     ) -> SharedFlat | None:
    """A collective over `group`: every rank's flat buffer of numel elements in shared memory, or None
    (want=None and not possible; want=True raises instead). Zero-filled, as torch.zeros."""
    if want is False:
        return None
    if why_not is not None:
        if want:
            raise ValueError(f"shared_memory_gather=True cannot be used: {why_not}. Drop it (None uses "
                             f"shared memory where it can) or pass False.")
        return None
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    # The buffer, then one page holding this rank's barrier counter (Note [Barriers in shared memory]).
    data_bytes = -(-max(numel * dtype.itemsize, _MARK) // mmap.PAGESIZE) * mmap.PAGESIZE
    nbytes = data_bytes + mmap.PAGESIZE
    token = [f"{os.getpid()}-{secrets.token_hex(6)}" if rank == 0 else None]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
    names = [os.path.join(SHM_DIR, f"shardopt-flat-{token[0]}-{r}") for r in range(world)]
    mark = f"{token[0]}:{rank}".encode().ljust(_MARK, b"\0")[:_MARK]
    buffers: list[torch.Tensor | None] = [None] * world
    counters: list[memoryview | None] = [None] * world
    reason = None
    try:
        # 1. Each rank makes and reserves its own file (a short /dev/shm says so here, not with a SIGBUS later).
        try:
            fd = os.open(names[rank], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)
                os.pwrite(fd, mark, 0)
            finally:
                os.close(fd)
        except OSError as e:
            reason = f"rank {rank} could not reserve {nbytes / 2**20:.1f} MiB in {SHM_DIR}: {e}"
        # 2. Each rank reads every other's mark: the same host, the same /dev/shm.
        if _all_ok(reason is None, group):
            reason = _check_marks(names, token[0], rank)
            if _all_ok(reason is None, group):
                for r in range(world):
                    buffers[r] = torch.from_file(names[r], shared=True, size=numel, dtype=dtype)
                    counters[r] = _map_counter(names[r], data_bytes)
                buffers[rank].zero_()  # the mark
                counters[rank][0] = 0
            elif reason is None:
                reason = "another rank could not use shared memory"
        elif reason is None:
            reason = "another rank could not use shared memory"
        dist.barrier(group=group)  # every rank mapped every file (or gave up)
    finally:
        try:
            os.unlink(names[rank])  # mappings outlive the name
        except FileNotFoundError:
            pass
    dist.barrier(group=group)  # and every name is gone when any rank returns
    if reason is None:
        return SharedFlat(buffers, rank, copy_group(group), _open_barrier(counters, rank, group))
    if want:
        raise RuntimeError(f"shared_memory_gather=True: {reason}. Pass None to fall back to the process group.")
    return None


def _map_counter(name: str, at: int) -> memoryview:
    """The int64 counter at byte `at` (a page boundary) of file `name`, mapped shared."""
    fd = os.open(name, os.O_RDWR)
    try:
        page = mmap.mmap(fd, mmap.PAGESIZE, offset=at)
    finally:
        os.close(fd)  # the mapping stays
    return memoryview(page).cast("q")[:1]


def _open_barrier(counters: list[memoryview], rank: int, group) -> ShmBarrier | None:
    """The barrier through shared memory, if every rank can use it (a collective: every rank decides the
    same); None: the gloo barrier."""
    infos: list = [None] * len(counters)
    dist.all_gather_object(infos, (platform.machine(), pid_namespace(), os.getpid()), group=group)
    if why_not_fast([(m, ns) for m, ns, _ in infos]) is not None:
        return None
    timeout = group_timeout(group)
    return ShmBarrier(counters, rank, [pid for _, _, pid in infos],
                      timeout.total_seconds() if timeout is not None else 1800.0,
                      dist.get_process_group_ranks(group))


def _check_marks(names: list[str], token: str, rank: int) -> str | None:
    """Why this rank cannot see every other rank's file (None: it sees them all)."""
    for r, name in enumerate(names):
        if r == rank:
            continue
        want_mark = f"{token}:{r}".encode().ljust(_MARK, b"\0")[:_MARK]
        try:
            with open(name, "rb") as f:
                seen = f.read(_MARK)
        except OSError:
            seen = b""
        if seen != want_mark:
            return f"rank {rank} cannot see rank {r}'s file in {SHM_DIR}: the ranks are not on one host"
    return None


def _all_ok(ok: bool, group) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class SharedGather:
    """The all-gather of parameters after a step, through shared buffers. The same calls as the bucket
    engine's gathers (Publisher uses either): start_all_gather_params, finish_all_gather(bucket),
    finish_all_gather_params, num_pending_gathers; plus wait_readers() before this rank's own chunks
    are written again (Note [Gathering through shared memory])."""

    def __init__(self, layout, rank: int, shared: SharedFlat):
        self.shared = shared
        self.group = shared.barrier_group
        world = layout.world_size
        # Per bucket: (rank r, start, end) of every other rank's chunk.
        self.spans = [[(r, *b.chunk(r)) for r in range(world) if r != rank] for b in layout.buckets]
        self.pending: set[int] = set()
        self.written = None    # Work: every rank's own chunks hold this step's values
        self.read_done = None  # Work: every rank copied every bucket
        self.num_all_gathers = 0

    def _barrier(self):
        """Starts a barrier of the shard group; returns what to wait() on."""
        if self.shared.barrier is not None:
            return self.shared.barrier.arrive()
        return dist.barrier(group=self.group, async_op=True)

    @property
    def num_pending_gathers(self) -> int:
        return len(self.pending)

    def start_all_gather_params(self, flat: torch.Tensor) -> None:
        """This rank's own chunks of `flat` (its shared buffer) hold the step's values: let the others copy
        them."""
        if self.pending:
            raise RuntimeError("start_all_gather_params: the previous all-gather of parameters was not finished")
        self.wait_readers()  # Publisher.wait() did it already; a no-op then
        self.written = self._barrier()
        self.pending = set(range(len(self.spans)))
        self.num_all_gathers += len(self.spans)

    def finish_all_gather(self, bucket: int) -> None:
        if bucket not in self.pending:
            return
        self.written.wait()
        flat, buffers = self.shared.flat, self.shared.buffers
        for r, s, e in self.spans[bucket]:
            flat[s:e].copy_(buffers[r][s:e])
        self.pending.discard(bucket)
        if not self.pending:
            self.written = None
            self.read_done = self._barrier()

    def finish_all_gather_params(self) -> None:
        for b in sorted(self.pending):
            self.finish_all_gather(b)

    def wait_readers(self) -> None:
        """Returns once no rank still copies out of this rank's buffer (its own chunks may be written)."""
        if self.read_done is not None:
            work, self.read_done = self.read_done, None
            work.wait()
