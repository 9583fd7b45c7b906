"""A barrier of the ranks of one host through memory they share (Note [Barriers in shared memory]).

    why = why_not_fast(infos)          # pure: every rank's (machine, pid namespace); None: fast is possible
    barrier = ShmBarrier(counters, rank, pids, timeout_s)
    arrival = barrier.arrive()          # returns at once
    arrival.wait()                      # every rank arrived (raises, naming who did not, if one died)

Note [Barriers in shared memory]
--------------------------------
The shared-memory gather (Note [Gathering through shared memory] in shared_memory.py) takes two barriers a step;
gloo's, rounds of loopback TCP with the waiting rank asleep, can cost more than the optimizer step.

Here each rank owns an int64 counter, in a page every rank maps, read and written through a memoryview (no
torch dispatch). To arrive a rank stores its next epoch; to wait it reads every counter until all reach it,
yielding the CPU (the rank it waits for may need it), then sleeping. One writer per counter, so no atomics;
a rank that sees a counter must see the chunks written before it, which x86's memory model promises and
ARM's does not (why_not_fast). Never a hang: a waiting rank checks its peers' pids (within one pid
namespace) every CHECK_S and raises after the group's timeout, naming them.
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
    (platform.machine(), pid namespace inode or None), the same on every rank.

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
    """Whether process `pid` exists and has not exited (a zombie has exited); cluster/emulated.py uses it too."""
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
    """`counters[r]`: rank r's counter (a zeroed one-element int64 memoryview of shared memory); `pids[r]`: its pid."""

    def __init__(self, counters: list[memoryview], rank: int, pids: list[int], timeout_s: float,
                 global_ranks: list[int] | None = None):
        self.counters = counters
        self.rank = rank
        self.pids = pids
        self.timeout_s = timeout_s
        self.epoch = 0
        self.what = "the barrier of the parameter gather through shared memory"  # where errors say it waited
        # Group rank r is global rank global_ranks[r]: errors name both (Note [Naming a peer]).
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
