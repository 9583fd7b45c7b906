"""The parameter gather through shared memory on one host (Note [Gathering through shared memory] in
shardopt/parallel/shared_memory.py): bitwise what the process group gathers, on by default only where every
rank shares this host's /dev/shm, refused by name where asked for and impossible, never leaving a file
behind, and never letting a rank's in-place write after step() reach a slower rank's copy."""
import mmap
import os
import time

import pytest
import torch
from torch import nn

from dist_harness import run_ranks
from models import WIDE, AwkwardNet, batch, uses_branch


def _ours(pids=None):
    """Files in /dev/shm made by these processes (this one by default): each carries its maker's pid (Note [Files
    in /dev/shm]), so another job's files, a killed one's included, are never counted here."""
    pids = {os.getpid()} if pids is None else set(pids)
    return sorted(f for f in os.listdir("/dev/shm")
                  if f.startswith("shardopt-") and f.split("-")[2:3] and f.split("-")[2].isdigit()
                  and int(f.split("-")[2]) in pids)


def test_why_not_names_each_reason(monkeypatch):
    from shardopt.config import ShardConfig
    from shardopt.parallel.shared_memory import why_not_shared

    cpu = torch.device("cpu")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert why_not_shared(cpu, False, range(4), 4) is None
    assert why_not_shared(cpu, False, range(2), 2) is None
    assert "one rank" in why_not_shared(cpu, False, [3], 4)
    ShardConfig(stage=3, shared_memory_gather=True)  # stage 3's shards (Note [Gathering through shared memory])
    assert "cuda" in why_not_shared(torch.device("cuda", 0), False, range(4), 4)
    assert "node-aware" in why_not_shared(cpu, True, range(4), 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun on each of 2 nodes (real or emulated)
    assert "spans nodes [0, 1] (LOCAL_WORLD_SIZE=2 < world size 4)" in why_not_shared(cpu, False, range(4), 4)
    assert "spans nodes [0, 1]" in why_not_shared(cpu, False, [1, 2], 4)  # a mesh's shard dim across nodes
    assert why_not_shared(cpu, False, [2, 3], 4) is None  # a hybrid mesh's shard group: node 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert why_not_shared(cpu, False, range(4), 4) is None


def _train(rank, optim, stage, shared, steps=4, wide=False, **kw):
    """`wide`: buckets big enough to be mapped at stage 3 (Note [Stage-3 buckets mapped, not copied])."""
    import shardopt

    torch.manual_seed(0)
    model = AwkwardNet(**WIDE) if wide else AwkwardNet()
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=optim, stage=stage,
                                    reduce_bucket_size=70000 if wide else 300, shared_memory_gather=shared, **kw)
    wrapper = shardopt.ShardedDDP(model, opt)
    for step in range(steps):
        x, y = batch(step, rank)
        loss = nn.functional.cross_entropy(wrapper(x, uses_branch(step, rank)).reshape(-1, 37), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    opt.wait_params()
    return model, opt


def _copies_of():
    """Buckets copied out of the shards from now on (a list the copies append to)."""
    from shardopt.parallel import gathers

    copied, wait = [], gathers._Copy.wait

    def counted(self):
        if self.out is not None:
            copied.append(self.b)
        wait(self)
    gathers._Copy.wait = counted
    return copied


def _parity(rank, world_size):
    out = {}
    copied = _copies_of()
    for optim, kw in ((torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
                      (torch.optim.SGD, dict(lr=0.1, momentum=0.9))):
        for stage, wide in ((1, False), (2, False), (3, False), (3, True)):
            models, gathers = {}, {}
            for shared in (None, False):
                copied.clear()
                model, opt = _train(rank, optim, stage, shared, wide=wide, **kw)
                if wide and shared is None:  # l1, l2, branch and the frozen layer mapped; the embedding copied
                    store = opt.store
                    out[f"mapped {optim.__name__}"] = (sorted(store.buckets.maps), store.buckets.trainable, sorted(set(copied)))
                if stage == 3:
                    with opt.full_params(writeback=False):
                        models[shared] = [p.detach().clone() for p in model.parameters()]
                    gathers[shared] = opt.store.num_gathers
                else:
                    models[shared] = list(model.parameters())
                if shared is None:
                    out[f"used {optim.__name__} {stage}"] = opt.store.gather.shared is not None
                    # On this x86 host the barriers go through shared memory too (Note [Barriers in shared memory]);
                    # stage 3 uses shared memory only then.
                    out[f"used barrier {optim.__name__} {stage}"] = stage == 3 or \
                        opt.store.gather.shared.barrier is not None
                    out[f"gathers {optim.__name__} {stage}"] = opt.store.num_gathers if stage == 3 \
                        else opt.store.gather.num_all_gathers
                    out[f"files left {optim.__name__} {stage}"] = _ours()
            stage = f"{stage}{' wide' if wide else ''}"
            out[f"equal {optim.__name__} {stage}"] = all(torch.equal(p, q) for p, q in zip(models[None], models[False]))
            if gathers:  # the same walk: the same gathers counted, whichever way they travel
                out[f"equal gathers {optim.__name__} {stage}"] = gathers[None] == gathers[False]
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_shared_memory_gather_is_bitwise_the_process_groups(world_size, monkeypatch):
    # As torchrun sets it on one host; the files are named after rank 0's pid, so none can be another test's.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world_size))
    for rank, r in enumerate(run_ranks(_parity, world_size, timeout=300)):
        for key, v in r.items():
            if key.startswith(("used", "equal")):
                assert v is True, f"rank {rank} {key}: {r}"
            if key.startswith("gathers"):
                assert v > 0, f"rank {rank} {key}: {r}"
            if key.startswith("files left"):
                assert v == [], f"rank {rank} {key}: {r}"
            if key.startswith("mapped"):  # Note [Stage-3 buckets mapped, not copied]
                maps, trainable, copied = v
                assert any(b < trainable for b in maps) and any(b >= trainable for b in maps), f"rank {rank}: {v}"
                assert copied and not set(copied) & set(maps), f"rank {rank}: mapped buckets copied: {v}"


def _in_place_after_step(rank, world_size, slow_reader):
    import shardopt
    import torch.distributed as dist
    from shardopt.parallel import gathers

    if rank == 1 and slow_reader:
        copy = gathers.SharedAfterStep.finish_all_gather

        def slow(self, bucket):
            time.sleep(0.02)
            copy(self, bucket)
        gathers.SharedAfterStep.finish_all_gather = slow
    torch.manual_seed(0)
    model = AwkwardNet()
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1, reduce_bucket_size=300,
                                    shared_memory_gather=True)
    wrapper = shardopt.ShardedDDP(model, opt)
    for step in range(3):
        x, y = batch(step, rank)
        loss = nn.functional.cross_entropy(wrapper(x, uses_branch(step, rank)).reshape(-1, 37), y.reshape(-1))
        loss.backward()
        opt.step()
        with torch.no_grad():  # a hand-made decay, on every rank, right after the step
            for p in model.parameters():
                p.mul_(0.5)
        opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], t) for t in everyone)


def test_an_in_place_write_after_step_never_reaches_a_slower_ranks_copy():
    # step() returns only once every rank copied this rank's chunks: halving them right after cannot reach
    # a rank still copying (with the wait in Publisher.publish removed, the ranks end up different).
    assert run_ranks(_in_place_after_step, 2, True, timeout=120) == [True, True]


def _refusals(rank, world_size, case):
    import shardopt
    from shardopt.parallel import shared_memory

    torch.manual_seed(0)
    model = AwkwardNet()
    if case.startswith("short shm") and rank == 1:
        def full(fd, offset, length):
            raise OSError(28, "No space left on device")
        os.posix_fallocate = full
    if case == "other host":  # each rank its own /dev/shm: nobody sees the others' files
        d = f"/dev/shm/shardopt-test-host-{os.getppid()}-{rank}"
        os.makedirs(d, exist_ok=True)
        shared_memory.SHM_DIR = d
    out = {}
    for want in (None, True):
        try:
            opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1,
                                            stage=3 if case.endswith("stage 3") else 2, shared_memory_gather=want)
            out[want] = "shared" if opt.store.gather.shared is not None else "process group"
        except (ValueError, RuntimeError) as e:
            out[want] = f"{type(e).__name__}: {e}"
    import torch.distributed as dist
    dist.barrier()  # every rank past its clean-up
    out["files"] = sorted(os.listdir(shared_memory.SHM_DIR)) if case == "other host" else _ours()
    if case == "other host":
        os.rmdir(shared_memory.SHM_DIR)
    return out


@pytest.mark.parametrize("case,why", [("short shm", "RuntimeError: shared_memory_gather=True: "),
                                      ("short shm stage 3", "RuntimeError: shared_memory_gather=True: "),
                                      ("other host", "RuntimeError: shared_memory_gather=True: ")])
def test_where_it_cannot_work_the_default_falls_back_and_true_says_why(case, why):
    for rank, r in enumerate(run_ranks(_refusals, 2, case, timeout=120)):
        assert r[None] == "process group", (rank, r)
        assert r[True].startswith(why), (rank, r)
        assert r["files"] == [], (rank, r)
    if case.startswith("short shm"):
        assert "could not reserve" in r[True] or "another rank" in r[True]
    if case == "other host":
        assert "not on one host" in r[True]


def _across_nodes(rank, world_size):
    """4 ranks as 2 nodes of 2 (LOCAL_WORLD_SIZE=2, as torchrun sets it on each node)."""
    import shardopt

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    out = {}
    models = {}
    for shared in (None, False):  # hybrid: sharded inside a node, so the gather stays inside it
        model, opt = _train(rank, torch.optim.AdamW, 2, shared, shard_group="node", lr=1e-2, weight_decay=0.1)
        models[shared] = model
        if shared is None:
            out["hybrid used"] = opt.store.gather.shared is not None
    out["hybrid equal"] = all(torch.equal(p, q) for p, q in zip(models[None].parameters(),
                                                                 models[False].parameters()))
    for want in (None, True):  # flat sharding over both nodes: the process group, never shared memory
        try:
            _, opt = _train(rank, torch.optim.SGD, 2, want, steps=1, node_aware=False, lr=0.1)
            out[f"flat {want}"] = "shared" if opt.store.gather.shared is not None else "process group"
        except ValueError as e:
            out[f"flat {want}"] = str(e)
    return out


def test_a_hybrid_meshs_shard_group_gathers_through_shared_memory_and_flat_sharding_across_nodes_never():
    for rank, r in enumerate(run_ranks(_across_nodes, 4, timeout=300)):
        assert r["hybrid used"] and r["hybrid equal"], (rank, r)
        assert r["flat None"] == "process group", (rank, r)
        assert "spans nodes [0, 1]" in r["flat True"], (rank, r)


def test_barrier_through_shared_memory_only_where_it_is_safe():
    from shardopt.parallel.shm_barrier import why_not_fast

    assert why_not_fast([("x86_64", 5), ("x86_64", 5), ("x86_64", 5)]) is None
    assert why_not_fast([("AMD64", 5), ("AMD64", 5)]) is None
    assert "memory model" in why_not_fast([("aarch64", 5), ("aarch64", 5)])
    assert "memory model" in why_not_fast([("x86_64", 5), ("ppc64le", 5)])
    assert "pid namespace" in why_not_fast([("x86_64", 5), ("x86_64", 6)])
    assert "pid namespace" in why_not_fast([("x86_64", None), ("x86_64", None)])


def test_barrier_waits_for_every_rank_and_raises_for_a_dead_or_late_one():
    import subprocess
    import threading

    from shardopt.parallel.shm_barrier import ShmBarrier

    def counters(n):
        return [memoryview(bytearray(8)).cast("q") for _ in range(n)]

    shared = counters(3)
    me = os.getpid()
    # Every rank arrives (two of them late, from a thread): wait() returns, twice in a row.
    # The bars on how long a wait took are set against the barrier's timeout (30 s), the alternative to what
    # is checked, not against how fast it is (milliseconds): half of it, which a busy 2-core machine's delays
    # never approach and a wait that missed an arrival or a death (it runs to the timeout) always passes.
    timeout = 30
    barrier = ShmBarrier(shared, 0, [me] * 3, timeout_s=timeout)
    for epoch in (1, 2):
        arrival = barrier.arrive()
        late = threading.Timer(0.03, lambda e=epoch: [c.__setitem__(0, e) for c in shared[1:]])
        late.start()
        t0 = time.monotonic()
        arrival.wait()
        assert 0.02 < time.monotonic() - t0 < timeout / 2
    # A peer that exited (its pid is gone): raised within about 50 ms, naming it.
    dead = subprocess.Popen(["true"])
    dead.wait()
    # (A hybrid mesh's node: group ranks 0 and 1 are global ranks 4 and 6; the error names both.)
    barrier = ShmBarrier(counters(2), 0, [me, dead.pid], timeout_s=timeout, global_ranks=[4, 6])
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] of this host's shard group exited \(global "
                                           r"rank\(s\) \[6\], pids"):
        barrier.arrive().wait()
    assert time.monotonic() - t0 < timeout / 2  # noticed by its 50 ms liveness check, not by the timeout
    # A live peer that never arrives: raised after the group's timeout, naming it.
    barrier = ShmBarrier(counters(2), 1, [me, me], timeout_s=0.2, global_ranks=[4, 6])
    with pytest.raises(RuntimeError, match=r"for rank\(s\) \[0\] \(global rank\(s\) \[4\]\), which are alive but "
                                           r"did not arrive"):
        barrier.arrive().wait()


def _agreements(rank, world_size):
    """Stage 3's pass agreements through shared memory (Note [Agreements in shared memory]): the same answers
    as gloo's all-gather, round after round (rounds of different values: the slots alternate by epoch);
    a stage-3 store uses it."""
    import torch.distributed as dist

    import shardopt
    from shardopt.parallel.shm_exchange import open_shm_exchange

    ex = open_shm_exchange(dist.group.WORLD)
    rounds = []
    for i in range(7):
        if rank == 1 and i == 3:
            time.sleep(0.2)  # a slow rank: the fast ones must not read a slot it is about to fill
        mine = (10 * rank + i, i * i - rank)
        theirs = [None] * world_size
        dist.all_gather_object(theirs, mine)
        rounds.append(ex.exchange(*mine) == [tuple(t) for t in theirs])
    model = nn.Linear(4, 4)
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1, stage=3)
    dist.barrier()
    return rounds, opt.store.rounds.agree_shm is not None, _ours()


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage_3_agreements_through_shared_memory_equal_gloos(world_size):
    for rounds, used, left in run_ranks(_agreements, world_size):
        assert all(rounds) and len(rounds) == 7, rounds
        assert used  # one host: the store agrees through shared memory
        assert left == []  # no file left behind


def _build_a_store(rank, world_size, stage):
    import shardopt

    model = AwkwardNet()
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1, stage=stage)
    return opt.store.gather.shared is not None


@pytest.mark.parametrize("stage", [2, 3])
def test_a_killed_jobs_files_are_gone_once_the_next_job_has_run(stage):
    # Note [Files in /dev/shm]: a rank killed inside the handshake leaves its file, named with its pid. The
    # next job removes the files of dead owners, and only those: a live process's file stays.
    import multiprocessing
    dead = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    dead.start()
    dead.join()
    left = [f"shardopt-flat-{dead.pid}-0a1b2c3d4e5f-{r}" for r in range(2)]
    live = f"shardopt-flat-{os.getpid()}-0a1b2c3d4e5f-0"
    try:
        for name in left + [live]:
            with open(os.path.join("/dev/shm", name), "wb") as f:
                f.write(b"\0" * mmap.PAGESIZE)
        assert run_ranks(_build_a_store, 2, stage, timeout=120) == [True, True]
        files = os.listdir("/dev/shm")
        assert not set(left) & set(files) and live in files, sorted(f for f in files if f.startswith("shardopt"))
    finally:
        for name in left + [live]:
            if os.path.exists(os.path.join("/dev/shm", name)):
                os.unlink(os.path.join("/dev/shm", name))


def _stage_3_phases(rank, world_size, shared, slow, wide=False):
    """Stage 3 through every kind of read phase and write (Note [Gathering through shared memory]):
    training steps, a different number of forwards without gradients per rank, full_params' write-back, a
    load of the weights; rank 1 copies slowly, so a rank that wrote its shard while a peer still copied it
    would hand that peer a mix. `wide`: buckets mapped (Note [Stage-3 buckets mapped, not copied]), read where
    the modules compute, so rank 1 computes slowly (forward and backward) instead."""
    import shardopt
    from shardopt.parallel import gathers

    if slow and rank == 1:
        copy = gathers._Copy.wait

        def slow_copy(self):
            if self.out is not None:
                time.sleep(0.01)
            copy(self)
        gathers._Copy.wait = slow_copy
    torch.manual_seed(0)
    model = AwkwardNet(**WIDE) if wide else AwkwardNet()
    if slow and rank == 1 and wide:
        for m in model.modules():
            m.register_forward_pre_hook(lambda *_: time.sleep(0.01))
            m.register_full_backward_pre_hook(lambda *_: time.sleep(0.01))
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=1e-2, stage=3,
                                    reduce_bucket_size=70000 if wide else 300, param_persistence_threshold=40,
                                    shared_memory_gather=shared)
    wrapper = shardopt.ShardedDDP(model, opt)
    seen = []
    for step in range(3):
        with torch.no_grad():  # rollouts: rank 0 one forward without gradients, rank 1 three (the next
            for k in range(1 + rank * 2):  # training forward's agreement has rank 0 shadow the other two)
                seen.append(wrapper(batch(10 + k, rank)[0], uses_branch(k, rank)).sum().item())
        x, y = batch(step, rank)
        loss = nn.functional.cross_entropy(wrapper(x, uses_branch(step, rank)).reshape(-1, 37), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        with opt.full_params():  # every rank writes its chunks back right after reading its peers'
            seen.append(sum(p.sum().item() for p in model.parameters()))  # what this rank read of every chunk
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.9)
        if step == 1:
            with opt.full_params(writeback=False):
                saved = {n: p.detach().clone() for n, p in model.named_parameters()}
            with opt.full_params():
                with torch.no_grad():
                    for p in model.parameters():
                        p.zero_()
            with opt.full_params():
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(saved[n])
    with opt.full_params(writeback=False):
        final = [p.detach().clone() for p in model.parameters()]
    return dict(used=opt.store.gather.shared is not None, seen=seen, final=final, mapped=sorted(opt.store.buckets.maps),
                # arrivals at the shard's barrier: one per read phase, one per barrier of its own
                phases=opt.store.gather.shared.barrier.epoch if opt.store.gather.shared is not None else None)


@pytest.mark.parametrize("wide", [False, True], ids=["copied", "mapped"])
def test_stage_3_shared_gathers_never_read_a_write_in_progress(wide):
    shared = run_ranks(_stage_3_phases, 2, True, True, wide, timeout=180)
    plain = run_ranks(_stage_3_phases, 2, False, False, wide, timeout=180)
    for rank, (s, p) in enumerate(zip(shared, plain)):
        assert s["used"] and not p["used"], rank
        assert bool(s["mapped"]) == wide and not p["mapped"], (rank, s["mapped"])
        assert s["seen"] == p["seen"], (rank, s["seen"], p["seen"])
        assert all(torch.equal(a, b) for a, b in zip(s["final"], p["final"])), rank
    assert shared[0]["phases"] == shared[1]["phases"] > 0  # every rank walked the same read phases


def test_map_spans_shares_the_pages_and_refuses_what_it_cannot_map(tmp_path):
    """Note [Mapping a shared mapping again]: the spans end to end, what reference_spans copies; a write through
    either mapping seen through the other; a span off a page boundary, or not in shared memory, gives None."""
    from shardopt.parallel.page_map import PAGE, map_spans, reference_spans

    n = PAGE // 4
    files = []
    for k in range(3):
        path = str(tmp_path / f"buffer{k}")
        files.append(torch.from_file(path, shared=True, size=4 * n, dtype=torch.float32))
        files[-1].copy_(torch.arange(4 * n, dtype=torch.float32) + 1000 * k)
    spans = [(files[0], n, 2 * n), (files[2], 0, n), (files[1], 3 * n, n)]
    view = map_spans(spans)
    assert view is not None and torch.equal(view, reference_spans(spans))
    files[2][5] = -1.0
    assert view[2 * n + 5] == -1.0
    view[3 * n] = -2.0
    assert files[1][3 * n] == -2.0
    assert map_spans([(files[0], 1, n)]) is None  # not on a page boundary
    assert map_spans([(files[0], 0, n + 1)]) is None  # not whole pages
    private = mmap.mmap(-1, 4 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    assert map_spans([(torch.frombuffer(private, dtype=torch.float32), 0, n)]) is None  # the kernel refuses
