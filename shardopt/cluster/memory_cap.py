"""Ranks under a memory cap: each rank in a cgroup-v1 memory group of its own, what each was charged (root).

    def train(rank, world_size, cap, size):       # a module-level function, as for run_ranks
        import transformers                       # charged outside the cap: imports, the process group
        cap.join()                                # from here on every page this rank touches is charged
        ... build, train ...
        cap.rest()                                # the charge now: the resting charge after the step
        cap.stat()["rss"], cap.stat()["shmem"]    # memory.stat: anonymous memory, shared memory, page cache ...
        return losses

    run = run_capped(train, 2, size, cap_bytes=600 << 20, timeout=300)
    run.trained                                   # every rank finished
    run.ranks[r].outcome                          # RankOutcome.FINISHED / OOM_KILLED / FAILED / TIMED_OUT
    run.ranks[r].peak, run.ranks[r].resting       # bytes: memory.max_usage_in_bytes, memory.usage_in_bytes at rest()
    run.max_peak, run.max_resting                 # over the ranks

Note [What a capped rank is charged]
------------------------------------
A memory cgroup charges a page to the group of the process that first touches it, once, whoever maps it
later: anonymous memory, page cache of the files the rank reads or writes (unless through O_DIRECT), and
shared memory. So the charge is what a memory-capped job (a container, a Slurm job, a Kubernetes pod) is
held to, where RSS counts a shared page in every rank that maps it and misses the page cache. Pages
touched before `join()` stay charged where they were (memory.move_charge_at_immigrate is left 0): the
interpreter, torch, the other imports and the process group (set up before fn runs) are outside the cap,
so the cap is what the model and the training need on top of an idle rank. Shared memory is charged to
the first toucher only, so a segment all ranks use counts in one rank's group: compare the maximum over
ranks (and the sum), never one rank's. Ranks are spawned by default, not forked from a server: a forked
rank shares its parent's pages, and its first write to one (a reference count, the garbage collector's
marks) copies it, charged after join() to a rank that did nothing new with it.

The kernel reclaims page cache before it kills, so at the cap the peak includes cache it would have given
back: a peak measured under a cap the run nearly reaches says "at most the cap"; measure peaks to compare
at a cap far above them (cap_bytes=None: no limit, still measured). A rank over its cap is killed by the
kernel's OOM killer (SIGKILL): memory.oom_control's oom_kill counts it and the rank's exit code is -9.

Each run makes its groups as /sys/fs/cgroup/memory/shardopt-cap-<pid>-<8 hex>-r<rank> and removes exactly
those when it ends, also after a failure, a timeout, an exception or SIGTERM / SIGHUP (made SystemExit
when unhandled, so that `finally` runs): a process still in one is SIGKILLed first (a rank or a process a
rank started). Ranks rendezvous through a FileStore of their own and gloo picks free ports, so runs do
not collide; the run and every collective have a timeout (run_ranks').
"""
from __future__ import annotations

import dataclasses
import enum
import os
import re
import secrets
import signal
import threading
import time

from shardopt.cluster.ranks import RankFailure, run_ranks

CGROUP = "/sys/fs/cgroup/memory"
PREFIX = "shardopt-cap-"


class RankOutcome(enum.Enum):
    FINISHED = "finished"
    OOM_KILLED = "killed by the OOM killer"
    FAILED = "failed"
    TIMED_OUT = "timed out"


def unavailable_reason() -> str | None:
    """Why ranks cannot be capped here, or None if they can (checked without creating anything)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (it makes cgroups under /sys/fs/cgroup/memory)"
    if not os.access(os.path.join(CGROUP, "cgroup.procs"), os.W_OK):
        return f"no writable cgroup-v1 memory controller at {CGROUP}"
    return None


def _read(group: str, key: str) -> str:
    with open(os.path.join(group, key)) as f:
        return f.read()


def _write(group: str, key: str, value: str) -> None:
    with open(os.path.join(group, key), "w") as f:
        f.write(value)


@dataclasses.dataclass
class MemoryCap:
    """A rank's handle on its group (fn's third argument): join it once imports are done, read the charge."""

    group: str
    resting: int | None = None
    joined: bool = False

    def join(self) -> None:
        """Moves this process (all its threads) into the group: from now on what it touches is charged there."""
        _write(self.group, "cgroup.procs", str(os.getpid()))
        self.joined = True

    def charged(self) -> int:
        """Bytes charged to the group now (memory.usage_in_bytes)."""
        return int(_read(self.group, "memory.usage_in_bytes"))

    def peak(self) -> int:
        """The most bytes charged to the group since it was made (memory.max_usage_in_bytes)."""
        return int(_read(self.group, "memory.max_usage_in_bytes"))

    def stat(self) -> dict[str, int]:
        """The group's memory.stat now: bytes of anonymous memory ("rss"), page cache ("cache", which includes
        shared memory, "shmem"), and the rest of what the kernel counts there."""
        return {k: int(v) for k, v in (line.split() for line in _read(self.group, "memory.stat").splitlines())}

    def rest(self) -> int:
        """Records the charge now as the rank's resting charge (call it after the step's zero_grad)."""
        self.resting = self.charged()
        return self.resting


@dataclasses.dataclass(frozen=True)
class RankMemory:
    rank: int
    outcome: RankOutcome
    peak: int
    """memory.max_usage_in_bytes once the rank ended: the most it was charged after join()."""
    resting: int | None
    """memory.usage_in_bytes when fn called cap.rest(); None if it did not or the rank did not finish."""
    oom_kills: int
    """memory.oom_control's oom_kill: processes of the group the kernel's OOM killer killed."""
    result: object = None
    error: str = ""
    """Why it did not finish, in one line (a failing rank's last traceback line)."""
    detail: str = ""
    """The failing rank's whole report (its traceback), at most its last 4000 characters."""


@dataclasses.dataclass(frozen=True)
class CappedRun:
    cap_bytes: int | None
    ranks: tuple[RankMemory, ...]
    seconds: float

    @property
    def trained(self) -> bool:
        return all(r.outcome is RankOutcome.FINISHED for r in self.ranks)

    @property
    def oom_killed(self) -> bool:
        return any(r.outcome is RankOutcome.OOM_KILLED for r in self.ranks)

    @property
    def max_peak(self) -> int:
        return max(r.peak for r in self.ranks)

    @property
    def max_resting(self) -> int | None:
        rest = [r.resting for r in self.ranks]
        return None if None in rest else max(rest)

    def summary(self) -> str:
        """One line: the outcome (the first failing rank's reason) or the peaks."""
        if self.trained:
            rest = self.max_resting
            return (f"trained; peak {self.max_peak / 2**20:.0f} MiB"
                    + (f", resting {rest / 2**20:.0f} MiB" if rest is not None else "") + " (max over ranks)")
        worst = next((r for r in self.ranks if r.outcome is RankOutcome.OOM_KILLED),
                     next(r for r in self.ranks if r.outcome is not RankOutcome.FINISHED))
        return f"rank {worst.rank} {worst.outcome.value}: {worst.error}"


def _capped_rank(rank, world_size, fn, groups, args, kwargs):
    cap = MemoryCap(groups[rank])
    out = fn(rank, world_size, cap, *args, **kwargs)
    if not cap.joined:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} never called cap.join(): nothing was capped or measured")
    return {"result": out, "resting": cap.resting}


def _oom_kills(group: str) -> int:
    for line in _read(group, "memory.oom_control").splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


def _rank_errors(failure: RankFailure) -> dict[int, str]:
    """Each failing rank's message out of run_ranks' RankFailure (its "--- rank r ---" sections)."""
    text = str(failure)
    errors = {int(m.group(1)): m.group(2).strip()
              for m in re.finditer(r"--- rank (\d+) ---\n(.*?)(?=\n--- rank \d+ ---|\Z)", text, re.S)}
    missing = re.search(r"ranks \[([\d, ]*)\] did not finish within", text)
    for r in (int(x) for x in missing.group(1).split(",") if x.strip()) if missing else ():
        errors.setdefault(r, "did not finish within the run's timeout")
    return errors


def _last_line(message: str) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""


def _remove(group: str, wait_s: float = 20.0) -> None:
    """Removes `group` once no process is in it; SIGKILLs what is still there (processes the run started)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            pids = [int(p) for p in _read(group, "cgroup.procs").split()]
        except FileNotFoundError:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.rmdir(group)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _exit_on(signum, _frame):
    raise SystemExit(128 + signum)


def _handle_termination() -> None:
    """SIGTERM / SIGHUP as SystemExit when nothing else handles them, so that the groups are removed."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, _exit_on)


def run_capped(fn, world_size: int, *args, cap_bytes: int | None, timeout: float = 600,
               collective_timeout: float = 120, start_method: str = "spawn", **kwargs) -> CappedRun:
    """Runs fn(rank, world_size, cap, *args, **kwargs) on `world_size` gloo ranks (run_ranks), each rank in a
    memory cgroup of its own limited to `cap_bytes` (None: no limit) that fn joins with cap.join() once its
    imports are done (Note [What a capped rank is charged]). Never raises for what a rank did: a rank killed
    by the OOM killer, failing or timing out is reported in its RankMemory."""
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(f"run_capped: {reason}")
    _handle_termination()
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    groups = [os.path.join(CGROUP, f"{name}-r{r}") for r in range(world_size)]
    made = []
    start = time.monotonic()
    try:
        for group in groups:
            os.mkdir(group)
            made.append(group)
            if cap_bytes is not None:
                _write(group, "memory.limit_in_bytes", str(int(cap_bytes)))
        outputs, errors = None, {}
        try:
            outputs = run_ranks(_capped_rank, world_size, fn, groups, args, kwargs, timeout=timeout,
                                collective_timeout=collective_timeout, start_method=start_method)
        except RankFailure as e:
            errors = _rank_errors(e) or {r: str(e) for r in range(world_size)}
        seconds = time.monotonic() - start
        ranks = []
        for r, group in enumerate(groups):
            kills = _oom_kills(group)
            peak = int(_read(group, "memory.max_usage_in_bytes"))
            message = errors.get(r, "")
            if kills or "exit code -9" in message:
                outcome = RankOutcome.OOM_KILLED if kills else RankOutcome.FAILED
                message = f"SIGKILL (exit code -9), memory.oom_control oom_kill {kills}" if kills else message
            elif r not in errors:  # run_ranks names every rank that failed or did not finish
                outcome = RankOutcome.FINISHED
            elif "did not finish" in message:
                outcome = RankOutcome.TIMED_OUT
            else:
                outcome = RankOutcome.FAILED
            out = outputs[r] if outputs is not None else {}
            ranks.append(RankMemory(rank=r, outcome=outcome, peak=peak, resting=out.get("resting"), oom_kills=kills,
                                    result=out.get("result"), error=_last_line(message),
                                    detail=errors.get(r, "")[-4000:]))
        return CappedRun(cap_bytes=cap_bytes, ranks=tuple(ranks), seconds=seconds)
    finally:
        left = []
        for group in made:
            try:
                _remove(group)
            except OSError as e:
                left.append(f"{group}: {e}")
        if left:
            raise RuntimeError("run_capped could not remove its cgroups: " + "; ".join(left))


def sweep() -> list[str]:
    """Removes the groups of runs whose owner process is dead and which no process is in (left by a SIGKILLed
    owner); returns their names. Only names exactly of this module's form are touched."""
    from shardopt.parallel.shm_barrier import pid_alive

    removed = []
    for entry in sorted(os.listdir(CGROUP)):
        m = re.fullmatch(re.escape(PREFIX) + r"(\d+)-[0-9a-f]{8}-r\d+", entry)
        if not m or pid_alive(int(m.group(1))):
            continue
        group = os.path.join(CGROUP, entry)
        if _read(group, "cgroup.procs").split():
            continue
        os.rmdir(group)
        removed.append(entry)
    return removed
