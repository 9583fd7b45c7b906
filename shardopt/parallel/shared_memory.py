"""Every rank's buffer in shared memory on one host, and gathers that copy (or map) chunks out of them.

    shared = open_shared_flat(numel, dtype, group, want, why_not)   # a collective; None: use the process group
    chunks = SharedChunks(shared, what)     # shared.buffers[r] is rank r's buffer, shared.flat this rank's
    chunks.add(shared, buckets, offsets)    # where each rank's chunk of each bucket lies
    chunks.copy(b, out); chunks.mapping(b)  # bucket b gathered by copying, or mapped end to end (no copy)
    chunks.end_reads(); chunks.wait_readers(); chunks.sync()

Note [Gathering through shared memory]
--------------------------------------
On one host gloo carries a gather over loopback TCP, copying every byte into the kernel and out again on
the cores that compute. So when every rank of a shard group is on this host, each rank's buffer (the flat
parameter buffer at stages 1-2, the shard at stage 3) is a file in /dev/shm that every rank maps, and a
gather copies rank r's chunk straight out of rank r's buffer: no staging memory, the same bytes the
process group would deliver (a run is bit for bit the same either way).
Read phases keep readers and writers apart. A read phase is whatever reads peers' chunks (the gather after
a step, a pass, a whole-weights walk); writes (a step, a load, full_params' write-back) happen outside:
  - a read phase ends with an arrival at the group's barrier (`end_reads`), and a write first waits until
    every rank has arrived as often as this one (`wait_readers`): no peer still reads the old values;
  - a read phase starts after the peers' writes: after a barrier (`sync`), or an agreement every rank
    posts once its writes are done (stage 3's pass agreement; stages 1-2's `written` arrival).
The barrier is the shared-memory one where it can be (Note [Barriers in shared memory] in shm_barrier.py),
else a gloo barrier; either way with the group's timeout. Used (shared_memory_gather=None) for a CPU model
whose shard group is inside one node; each rank reserves its file with posix_fallocate, so a short
/dev/shm falls back to the process group at construction. True raises where it cannot be used.

Note [Files in /dev/shm]
------------------------
Each rank's file is shardopt-<kind>-<pid>-<token>-<rank>, with its maker's pid, unlinked as soon as every
rank has mapped it. Only a rank killed inside the handshake leaves its file behind, so every store a job
builds first removes the shardopt files whose owner is gone (looked up in this pid namespace, as the
barriers' dead-peer checks are): the next job on the host cleans up after a killed one.

Note [Stage-3 buckets mapped, not copied]
-----------------------------------------
A stage-3 bucket's full storage is its W chunks end to end, and the chunks already lie in shared memory.
If each chunk is whole pages, those pages can be mapped a second time, end to end (Note [Mapping a shared
mapping again] in page_map.py), and that mapping *is* the bucket gathered: no copy, no memory. The layout
pads such buckets to whole pages per chunk (layout.plan_layout's page_numel, layout.place_chunks), and
the store points their parameters at the mapping from the first pass on. full_params works on private
copies and points the parameters back on exit. A write into a parameter inside a pass reaches the shards
here, where a copied bucket loses it at its free (write through full_params() between steps). Persistent
buckets stay private copies: they are read between passes too, while a peer may be writing its chunk.
"""
from __future__ import annotations

import mmap
import os
import platform
import re
import secrets
from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardopt.layout import mappable, page_numel
from shardopt.parallel.mesh import group_timeout, copy_group
from shardopt.parallel.page_map import map_spans
from shardopt.parallel.shm_barrier import ShmBarrier, pid_namespace, why_not_fast

SHM_DIR = "/dev/shm"
_MARK = 16  # bytes of the handshake mark at the start of each file
_OURS = re.compile(r"^shardopt-[a-z]+-(\d+)-")  # Note [Files in /dev/shm]: the owner's pid


def why_not_shared(device: torch.device, node_aware: bool, shard_ranks: Sequence[int],
                   world: int) -> str | None:
    """Why the buffers of the shard group of global ranks `shard_ranks` (of `world` in all) cannot be shared
    (None: they can, if the handshake agrees). Reads LOCAL_WORLD_SIZE; no process group."""
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


def remove_dead_files(directory: str | None = None) -> list[str]:
    """Removes the shardopt files in `directory` (/dev/shm) whose owner process is gone (Note [Files in
    /dev/shm]); returns their names."""
    directory = SHM_DIR if directory is None else directory
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _OURS.match(name)
        if m is None or _alive(int(m.group(1))):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass  # another process removed it first, or it is not ours to remove
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


class SharedFlat:
    """This rank's buffer (`flat`) and every rank's, mapped (`buffers[r]`, `buffers[rank] is flat`); the barrier
    through shared memory (None: the gloo barrier on `barrier_group`)."""

    def __init__(self, buffers: list[torch.Tensor], rank: int, barrier_group, barrier: ShmBarrier | None = None):
        self.buffers = buffers
        self.rank = rank
        self.flat = buffers[rank]
        self.barrier_group = barrier_group
        self.barrier = barrier


def open_shared_flat(numel: int, dtype: torch.dtype, group, want: bool | None, why_not: str | None
                     ) -> SharedFlat | None:
    """A collective over `group`: every rank's buffer of numel elements in shared memory, or None (want=None and
    not possible; want=True raises instead). Zero-filled, as torch.zeros."""
    remove_dead_files()  # Note [Files in /dev/shm]: whatever this job ends up using
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
    owners: list = [None] * world
    dist.all_gather_object(owners, (secrets.token_hex(6), os.getpid()), group=group)
    token = owners[0][0]
    names = [os.path.join(SHM_DIR, f"shardopt-flat-{pid}-{token}-{r}") for r, (_, pid) in enumerate(owners)]
    mark = f"{token}:{rank}".encode().ljust(_MARK, b"\0")[:_MARK]
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
            reason = _check_marks(names, token, rank)
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


class SharedChunks:
    """Gathers out of shared buffers, bucket by bucket, and the read phases they need (Note [Gathering through
    shared memory])."""

    def __init__(self, shared: SharedFlat, what: str):
        self.shared = shared
        self.barrier = shared.barrier
        if self.barrier is not None:
            self.barrier.what = what
        # Per bucket: (rank r's buffer, where chunk r starts there, where it goes in `out`, length).
        self.spans: dict[int, list] = {}
        self.mappable: set[int] = set()  # buckets whose chunks are whole pages on page boundaries
        self.last_reads = None  # the arrival after this rank's last read phase

    def add(self, shared: SharedFlat, buckets, offsets: list[int]) -> list[torch.Tensor]:
        """`buckets` have every rank's chunk at `offsets` of that rank's buffer in `shared` (stage 3's shard, or a
        frozen region), each going to its place in the whole bucket; returns this rank's chunk of each."""
        chunks = []
        for b, at in zip(buckets, offsets):
            self.spans[b.index] = [(shared.buffers[r], at, b.chunk(r)[0] - b.start, b.chunk_numel)
                                   for r in range(b.world_size)]
            if mappable(b, page_numel(shared.flat.dtype.itemsize)):
                self.mappable.add(b.index)
            chunks.append(shared.flat[at:at + b.chunk_numel])
        return chunks

    def add_in_place(self, buckets) -> None:
        """`buckets` lie at the same place of every rank's buffer (stages 1-2's flat buffers): the other ranks'
        chunks are copied into the same place of this rank's."""
        for b in buckets:
            self.spans[b.index] = [(self.shared.buffers[r], b.chunk(r)[0], b.chunk(r)[0], b.chunk_numel)
                                   for r in range(b.world_size) if r != self.shared.rank]

    def holds(self, b: int) -> bool:
        return b in self.spans

    def copy(self, b: int, out: torch.Tensor) -> None:
        for buffer, src, dst, n in self.spans[b]:
            out[dst:dst + n].copy_(buffer[src:src + n])

    def mapping(self, b: int) -> torch.Tensor | None:
        """Bucket b whole: every rank's chunk mapped end to end, no copy (Note [Stage-3 buckets mapped, not
        copied]); None if it cannot be."""
        if b not in self.mappable:
            return None
        spans = sorted(self.spans[b], key=lambda s: s[2])  # in the bucket's order
        return map_spans([(buffer, src, n) for buffer, src, _, n in spans])

    def arrive(self):
        """This rank's arrival at the group's barrier; returns what to wait() on."""
        if self.barrier is not None:
            return self.barrier.arrive()
        return dist.barrier(group=self.shared.barrier_group, async_op=True)

    def end_reads(self) -> None:
        """This rank reads nothing more of its peers' buffers in this read phase."""
        self.last_reads = self.arrive()

    def wait_readers(self) -> None:
        """Returns once no peer still reads this rank's buffer in a phase this rank has finished."""
        if self.last_reads is not None:
            arrival, self.last_reads = self.last_reads, None
            arrival.wait()

    def sync(self) -> None:
        """A barrier: once it returns, every peer's writes before it are seen here (a collective)."""
        self.arrive().wait()
        self.last_reads = None
