"""Ranks under a memory cap (shardopt/cluster/memory_cap.py): each rank in a cgroup-v1 memory group of its own,
joined after its imports; what each was charged, who the OOM killer killed, and no group left behind.

Needs root and the cgroup-v1 memory controller at /sys/fs/cgroup/memory (skipped otherwise, with the reason).
"""
import os
import subprocess
import sys
import time

import pytest

from shardopt.cluster import memory_cap as mc

MIB = 2**20

pytestmark = pytest.mark.skipif(mc.unavailable_reason() is not None, reason=str(mc.unavailable_reason()))


def _ours() -> list[str]:
    return [g for g in os.listdir(mc.CGROUP) if g.startswith(f"{mc.PREFIX}{os.getpid()}-")]


def _touch(rank, world_size, cap, mib):
    import torch

    cap.join()
    before = cap.charged()
    t = torch.ones(mib[rank] * MIB // 4)  # every page written: charged
    during = cap.charged()
    del t
    cap.rest()
    return before, during


def test_charged_peak_and_resting_charge_per_rank():
    # Rank 0 touches 16 MiB, rank 1 48 MiB, under a 96 MiB cap: each group's peak holds its own tensor and
    # little else (the imports were charged outside), and the tensor freed is gone from the resting charge.
    run = mc.run_capped(_touch, 2, [16, 48], cap_bytes=96 * MIB, timeout=120)
    assert run.trained, run.summary()
    for r, mib in zip(run.ranks, (16, 48)):
        before, during = r.result
        assert r.outcome is mc.RankOutcome.FINISHED and r.oom_kills == 0
        assert before < 4 * MIB  # joined after the imports: they are not charged here
        assert mib * MIB <= during <= r.peak < (mib + 12) * MIB
        assert r.resting < r.peak - (mib - 4) * MIB  # MALLOC's default threshold: a 16 MiB tensor is mmapped
    assert run.max_peak == run.ranks[1].peak
    assert _ours() == []


def _anonymous_and_shared(rank, world_size, cap, path):
    import torch

    cap.join()
    t = torch.ones(16 * MIB // 4)  # anonymous memory
    with open(path, "wb") as f:  # shared memory (a tmpfs file)
        f.write(b"x" * 8 * MIB)
    stat = cap.stat()
    os.unlink(path)
    del t
    return stat


def test_stat_tells_anonymous_memory_from_shared_memory():
    path = f"/dev/shm/shardopt-cap-test-{os.getpid()}"
    run = mc.run_capped(_anonymous_and_shared, 1, path, cap_bytes=None, timeout=120)
    assert run.trained, run.summary()
    stat = run.ranks[0].result
    assert 16 * MIB <= stat["rss"] < 28 * MIB
    assert 8 * MIB <= stat["shmem"] <= stat["cache"] < 12 * MIB
    assert not os.path.exists(path) and _ours() == []


def _over_on_rank_1(rank, world_size, cap):
    import torch

    cap.join()
    if rank == 1:
        torch.ones(256 * MIB // 4)  # past the 64 MiB cap: the kernel kills this process
        time.sleep(30)
    return rank


def test_a_rank_over_its_cap_is_reported_killed_and_its_peer_finished():
    run = mc.run_capped(_over_on_rank_1, 2, cap_bytes=64 * MIB, timeout=120)
    assert not run.trained and run.oom_killed
    killed, other = run.ranks[1], run.ranks[0]
    assert killed.outcome is mc.RankOutcome.OOM_KILLED and killed.oom_kills == 1
    assert "exit code -9" in killed.error and killed.resting is None
    assert 60 * MIB <= killed.peak <= 64 * MIB  # it reached the cap
    assert other.outcome is mc.RankOutcome.FINISHED and other.oom_kills == 0
    assert "rank 1 killed by the OOM killer" in run.summary()
    assert _ours() == []


def _fails(rank, world_size, cap):
    if rank == 0:
        cap.join()
        raise ValueError("the build failed on purpose")
    return "never joined"


def test_a_failing_rank_and_a_rank_that_never_joins_are_failures_named():
    run = mc.run_capped(_fails, 2, cap_bytes=None, timeout=120)
    assert [r.outcome for r in run.ranks] == [mc.RankOutcome.FAILED, mc.RankOutcome.FAILED]
    assert run.ranks[0].error == "ValueError: the build failed on purpose"
    assert "Traceback" in run.ranks[0].detail
    assert "never called cap.join()" in run.ranks[1].error
    assert _ours() == []


def _hangs(rank, world_size, cap):
    cap.join()
    if rank == 1:
        time.sleep(600)
    return rank


def test_a_rank_past_the_timeout_is_reported_and_its_group_removed():
    # 45 s: two ranks start (spawn, import torch, a process group) in seconds, on a loaded machine in tens.
    start = time.monotonic()
    run = mc.run_capped(_hangs, 2, cap_bytes=None, timeout=45)
    assert time.monotonic() - start < 120
    assert run.ranks[1].outcome is mc.RankOutcome.TIMED_OUT
    assert run.ranks[0].outcome is mc.RankOutcome.FINISHED
    assert _ours() == []


def test_sweep_removes_only_groups_of_dead_owners():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = os.path.join(mc.CGROUP, f"{mc.PREFIX}{dead_pid}-0badf00d-r0")
    live = os.path.join(mc.CGROUP, f"{mc.PREFIX}{os.getpid()}-0badf00d-r0")
    other = os.path.join(mc.CGROUP, f"{mc.PREFIX}{dead_pid}-notours")  # not this module's form
    made = []
    try:
        for g in (stale, live, other):
            os.mkdir(g)
            made.append(g)
        removed = mc.sweep()
        assert os.path.basename(stale) in removed
        assert not os.path.exists(stale) and os.path.exists(live) and os.path.exists(other)
    finally:
        for g in made:
            if os.path.exists(g):
                os.rmdir(g)
