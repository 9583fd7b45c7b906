"""A barrier of the ranks of one host through memory they share: one counter per rank (Note [Barriers in
shared memory]).

    why = why_not_fast(infos)          # pure: every rank's (machine, pid namespace); None: fast is possible
    barrier = ShmBarrier(counters, rank, pids, timeout_s)
    arrival = barrier.arrive()          # returns at once
    arrival.wait()                      # every rank arrived (raises, naming who did not, if one died)

Note [Barriers in shared memory]
--------------------------------
The gather through shared memory (Note [Gathering through shared memory] in shared_flat.py) takes two
barriers a step. On gloo a barrier is a round of loopback TCP messages, and a waiting rank sleeps in the
kernel until its message comes: on the project VM (2 cores) the two cost 3-4 ms of a 26 ms step at 2 ranks
(benchmarks/results/2026-11-26-idioms-flags.md), more than the optimizer step itself.

Here each rank owns one int64 counter, in a page of its own after its flat buffer's file, that every rank
maps (read and written through a memoryview: a plain load or store, not a torch operation, so waiting
reads nothing through the dispatcher and counts as no host read). To arrive, a rank stores its next epoch
in its counter; to wait, it reads every rank's counter until
all reached that epoch, yielding the CPU between reads (on a host with more ranks than cores, the rank it
waits for runs meanwhile) and, after 10 ms, sleeping 0.2 ms between reads. Each counter has one writer, so
no atomic read-modify-write is needed. What it orders: a rank writes its chunks and then its counter; a
rank that sees the counter must see the chunks. x86's memory model promises that (stores become visible in
program order, loads are not reordered with older loads); ARM and POWER do not, and there the gloo barrier
stays (why_not_fast).

Never a hang: every 50 ms a waiting rank checks that each rank it still waits for is alive (the pids are
exchanged when the buffers are opened, and used only if every rank is in the same pid namespace: else the
gloo barrier stays), and raises after the group's timeout, naming the ranks it waited for. A rank that
exited or was killed is noticed within 50 ms, as gloo notices its closed socket.
"""
from __future__ import annotations

import os
import time


FAST_MACHINES = ("x86_64", "amd64", "i386", "i686")  # platform.machine(), lower case
SPIN_S = 0.010    # yield between reads for this long, then sleep
SLEEP_S = 0.0002
CHECK_S = 0.050   # how often a waiting rank looks for dead peers and the timeout


def why_not_fast(infos: list[tuple[str, int | None]]) -> str | None:
    """Why the ranks cannot use the shared-memory barrier (None: they can). infos: every rank's
    (platform.machine(), inode of its pid namespace or None); the same list on every rank, so every rank
    decides the same.

    >>> why_not_fast([("x86_64", 7), ("x86_64", 7)]) is None
    True
    >>> why_not_fast([("aarch64", 7), ("aarch64", 7)])
    "machine 'aarch64': its memory model does not order a rank's stores for the others (x86 only)"
    """
    for machine, _ in infos:
        if machine.lower() not in FAST_MACHINES:
            return f"machine {machine!r}: its memory model does not order a rank's stores for the others (x86 only)"
    if any(ns is None for _, ns in infos) or len({ns for _, ns in infos}) > 1:
        return "the ranks are not all in one pid namespace: a dead peer could not be told from a live one"
    return None


def pid_namespace() -> int | None:
    """The inode of this process's pid namespace (None: unknown)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie, a killed child its parent has not reaped
    yet, has). Also the emulated cluster's test for a namespace's owner (cluster/emulated.py)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists; it is someone else's
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc to ask: it exists
    return state not in (b"Z", b"X")


class ShmBarrier:
    """`counters[r]`: rank r's counter (a one-element int64 memoryview of shared memory, format "q", zero
    at the start); `pids[r]`: its process."""

    def __init__(self, counters: list[memoryview], rank: int, pids: list[int], timeout_s: float,
                 global_ranks: list[int] | None = None):
        self.counters = counters
        self.rank = rank
        self.pids = pids
        self.timeout_s = timeout_s
        self.epoch = 0
        self.what = "the barrier of the parameter gather through shared memory"  # where errors say it waited
        # Group rank r is global rank global_ranks[r]: errors name both (Note [Naming a peer] in
        # csrc/comm/peer_names.h). None: the group ranks are the global ones.
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(len(counters)))

    def arrive(self) -> "Arrival":
        """This rank is here: store the next epoch. Returns what to wait on."""
        self.epoch += 1
        self.counters[self.rank][0] = self.epoch
        return Arrival(self, self.epoch)

    def late(self, epoch: int) -> list[int]:
        return [r for r, c in enumerate(self.counters) if c[0] < epoch]


class Arrival:
    """One arrival at the barrier; wait() returns once every rank arrived (as a dist Work's wait)."""

    __slots__ = ("barrier", "epoch")

    def __init__(self, barrier: ShmBarrier, epoch: int):
        self.barrier = barrier
        self.epoch = epoch

    def wait(self) -> None:
        b = self.barrier
        start = time.monotonic()
        check = start + CHECK_S
        while True:
            late = b.late(self.epoch)
            if not late:
                return
            now = time.monotonic()
            if now >= check:
                dead = [r for r in late if not pid_alive(b.pids[r])]
                g = b.global_ranks
                if dead:
                    raise RuntimeError(
                        f"shardopt: rank(s) {dead} of this host's shard group exited (global rank(s) "
                        f"{[g[r] for r in dead]}, pids {[b.pids[r] for r in dead]}) while rank {b.rank} (global "
                        f"rank {g[b.rank]}) waited for them at {b.what}; see their logs.")
                if now - start > b.timeout_s:
                    raise RuntimeError(
                        f"shardopt: rank {b.rank} (global rank {g[b.rank]}) waited {now - start:.0f} s (the "
                        f"group's timeout) at {b.what} for rank(s) {late} (global rank(s) {[g[r] for r in late]}), which are alive but did not "
                        f"arrive: are they running the same sequence of step() calls?")
                check = now + CHECK_S
            if now - start < SPIN_S:
                os.sched_yield()
            else:
                time.sleep(SLEEP_S)
