"""The decisions of code that only runs with a GPU, run on CPU against a fake device.

Note [Device operations behind an interface] (shardopt/device_ops.py) and Note
[Device copies behind an interface] (csrc/comm/copy_device.h): pinned buffers,
the bucket engine's side-stream copies to the host, and the non-blocking copy
of master chunks back into the model decide in plain code and act through a
small interface. Here that interface is tests/fake_device.py: the decisions
(which path, non-blocking or not, when to wait) are checked call by call, and
a whole offload run through the fake must give the bits of the same run
without it. Whether CUDA honours the interface is not tested (no GPU here).
"""
import pytest
import torch

from dist_harness import run_ranks
from models import AwkwardNet, batch, uses_branch


def _C():
    from shardopt import _ext

    return _ext._C


# ---------------------------------------------------------- pure decisions
def test_pin_and_copy_back_decisions():
    from fake_device import FakeDeviceOps
    from shardopt import offload
    from shardopt.device_ops import DeviceOps

    cpu = torch.device("cpu")
    real, fake, unpinnable = DeviceOps(), FakeDeviceOps(), FakeDeviceOps(can_pin=False)
    # Pinned only when asked, for host buffers, and when the runtime can pin.
    assert fake.is_pinned(offload.zeros(4, torch.float32, cpu, True, fake))
    assert fake.calls == ["pin 4"]
    assert not fake.is_pinned(offload.zeros(4, torch.float32, cpu, False, fake))
    assert not unpinnable.is_pinned(offload.zeros(4, torch.float32, cpu, True, unpinnable))
    assert fake.calls == ["pin 4"] and unpinnable.calls == []
    t = offload.zeros(3, torch.bfloat16, cpu, True, real)   # this machine: no CUDA, nothing pinned
    assert t.dtype == torch.bfloat16 and t.shape == (3,) and not real.is_pinned(t)
    assert real.can_pin() == torch.cuda.is_available()
    # Master -> model: non-blocking only from pinned host memory to device memory.
    host = offload.zeros(4, torch.float32, cpu, True, fake)
    pageable = torch.zeros(4)                             # the fake counts it as device memory
    assert offload.copy_back_is_async(pageable, host, fake)
    assert not offload.copy_back_is_async(host, host, fake)        # host to host
    unpinned_master = offload.zeros(4, torch.float32, cpu, False, unpinnable)
    assert not offload.copy_back_is_async(pageable, unpinned_master, unpinnable)
    assert not offload.copy_back_is_async(torch.zeros(4), torch.zeros(4), real)  # a CPU model


def test_host_copier_decisions():
    """HostCopier call by call: which copies it takes, when a slot waits, when the host blocks."""
    C = _C()
    # A build against a CPU torch has no copier (the engine copies synchronously); one against a CUDA torch
    # has the CUDA one where nvcc was found (.ci/check-cuda-build proves it is compiled in).
    if torch.version.cuda is None:
        assert C.default_copy_device() is None
    dev = C.FakeCopyDevice(pinned=True)
    hc = C.HostCopier(dev)
    src, dst = torch.arange(4.0), torch.zeros(4)
    # A host destination that is not CPU memory, or no device at all: declined.
    assert not hc.start_copy(torch.zeros(4, device="meta"), src, 0)
    assert not C.HostCopier(None).start_copy(dst, src, 0)
    assert dev.log() == []
    assert hc.start_copy(dst, src, 0)
    assert dev.log() == ["copy slot=0 numel=4 non_blocking=1"]
    assert dev.queued == 1 and torch.equal(dst, torch.zeros(4))  # not landed yet: a side stream
    hc.before_reuse(1)                      # no copy of slot 1: no wait
    hc.before_reuse(0)                      # slot 0's buffer is being read: wait
    assert dev.log()[1:] == ["wait slot=0 (1 queued)"] and torch.equal(dst, src)
    hc.before_reuse(0)                      # already waited for
    hc.finish_all()                         # the host still blocks once for the copy
    hc.finish_all()                         # ... and only once
    assert dev.log()[2:] == ["sync (0 queued)"]
    hc.before_reuse(0)                      # everything landed: no wait
    assert len(dev.log()) == 3
    # Two slots in flight: finish_all lands both; into pageable memory nothing is non-blocking.
    dev2 = C.FakeCopyDevice(pinned=False)
    hc2 = C.HostCopier(dev2)
    a, b = torch.zeros(4), torch.zeros(4)
    assert hc2.start_copy(a, src, 0) and hc2.start_copy(b, src * 2, 1)
    hc2.finish_all()
    assert dev2.log() == ["copy slot=0 numel=4 non_blocking=0", "copy slot=1 numel=4 non_blocking=0",
                          "sync (2 queued)"]
    assert torch.equal(a, src) and torch.equal(b, src * 2) and dev2.queued == 0


# ------------------------------------------- a whole offload run, fake device
def _offload_run(rank, world_size, fake: bool):
    import shardopt
    from fake_device import FakeDeviceOps
    from shardopt import device_ops

    torch.manual_seed(0)
    model = AwkwardNet()
    ops = FakeDeviceOps() if fake else device_ops.current()
    with device_ops.use(ops):
        # bf16 reduction into fp32 host chunks: results cannot land in the shard
        # directly, the engine's path for a CUDA model with offload. 2 staging
        # buffers for more buckets than that: slots are reused within a backward.
        opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=1e-2, stage=2,
                                        offload="cpu", reduce_dtype=torch.bfloat16, reduce_bucket_size=1000,
                                        num_staging_buffers=2)
        wrapper = shardopt.ShardedDDP(model, opt)
    steps = []
    if fake:
        inner_step = opt.inner.step
        opt.inner.step = lambda *a, **k: (ops.calls.append("inner step"), inner_step(*a, **k))[1]
    for step in range(3):
        for micro in range(2 if step == 1 else 1):   # step 1 accumulates two backwards
            x, y = batch(step, rank, micro)
            out = wrapper(x, uses_branch(step, rank)).float()
            torch.nn.functional.cross_entropy(out.reshape(-1, 37), y.reshape(-1)).backward()
            if fake:
                steps.append(("backward", opt.engine.num_reduce_scatters, ops.engine_device.queued))
        opt.step()
        opt.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    if not fake:
        return {"params": params}
    return {"params": params, "calls": ops.calls, "log": ops.engine_device.log(), "steps": steps,
            "buckets": len(opt.layout.buckets), "master_pinned": ops.is_pinned(opt.master),
            "grad_pinned": ops.is_pinned(opt.shard_grad)}


def test_offload_through_fake_device_matches_and_waits_where_it_must():
    real = run_ranks(_offload_run, 2, False)
    fake = run_ranks(_offload_run, 2, True)
    for rank in range(2):
        r, f = real[rank], fake[rank]
        # The deferred copies landed where and when the engine relies on them.
        for i, (p, q) in enumerate(zip(r["params"], f["params"])):
            assert torch.equal(p, q), f"rank {rank}: parameter {i} differs from the run without the fake device"
        assert f["master_pinned"] and f["grad_pinned"]
        nb, log = f["buckets"], f["log"]
        assert nb > 2, "the model must have more buckets than staging buffers"
        # Backward 1 of each step: one side-stream copy per bucket, non-blocking
        # (pinned), none left queued once backward has ended (flush synchronised).
        copies = [line for line in log if line.startswith("copy")]
        assert len(copies) == 3 * nb and all(line.endswith("non_blocking=1") for line in copies)
        assert all(queued == 0 for _, _, queued in f["steps"])
        # Each backward ends with exactly one host sync; the accumulating second
        # backward of step 1 adds into the shard (no side-stream copy, no sync).
        assert sum(line.startswith("sync") for line in log) == 3
        # A slot is never reused while its copy may still read it: between a copy
        # of slot s and the next copy of slot s, there is a wait for s or a sync.
        last_copy = {}
        for i, line in enumerate(log):
            if line.startswith("copy"):
                s = line.split()[1]
                if s in last_copy:
                    between = log[last_copy[s] + 1:i]
                    assert any(x.startswith(f"wait {s} ") or x.startswith("sync") for x in between), log
                last_copy[s] = i
        # Master -> model copies are non-blocking and marked once per step; the
        # host waits for the mark before the next step writes master chunks (in
        # fact at the end of the next forward, which calls wait_params()).
        calls = [c for c in f["calls"] if not c.startswith("pin")]
        assert calls.count("inner step") == calls.count("mark") == 3, calls
        for i, c in enumerate(calls):
            if c == "mark":
                assert calls[i - 1] == "inner step" and calls[i + 1:i + 2] in (["host_wait"], []), calls
            if c == "inner step" and i > 0:
                assert calls[i - 1] == "host_wait", calls
    assert any(line.startswith("wait") for f in fake for line in f["log"]), \
        "the run should reuse a staging slot within a backward (more buckets than buffers)"


def test_host_bookkeeping_is_reduced_through_the_device_on_nccl():
    """Note [Host bookkeeping on NCCL]: CPU flags and norms go through the GPU only where the group has no
    CPU backend; gloo and mixed groups reduce them where they are, device tensors are never staged."""
    from shardopt.parallel.comm import reduces_on_device

    assert reduces_on_device("nccl", "cpu")
    assert reduces_on_device("NCCL", "cpu")
    assert reduces_on_device("cuda:nccl", "cpu")
    assert not reduces_on_device("cpu:gloo,cuda:nccl", "cpu")
    assert not reduces_on_device("gloo", "cpu")
    assert not reduces_on_device("nccl", "cuda")
    assert not reduces_on_device("gloo", "cuda")


def _nccl_like_run(rank, world_size, staged: bool):
    """AwkwardNet at stage 2 with torch's clip and inf-norm logging; staged: the group answers "nccl" and the
    staging copy is a CPU clone, so every host tensor's all-reduce takes the path an NCCL-only group takes."""
    import torch.distributed as dist

    import shardopt
    from shardopt.parallel import comm

    calls = []
    if staged:
        dist.get_backend = lambda group=None: "nccl"
        comm.to_staging = lambda t: (calls.append(1), t.clone())[1]  # a copy, as on a GPU
    torch.manual_seed(0)
    model = AwkwardNet()
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.05, momentum=0.9, stage=2,
                                    reduce_bucket_size=300)
    wrapper = shardopt.ShardedDDP(model, opt)
    norms = []
    for step in range(3):
        x, y = batch(step, rank)
        out = wrapper(x, uses_branch(step, rank)).float()
        torch.nn.functional.cross_entropy(out.reshape(-1, 37), y.reshape(-1)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None],
                                                   float("inf")).item())
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], norms, len(calls)


def test_host_bookkeeping_through_the_staging_path_matches():
    """Note [Host bookkeeping on NCCL]'s path, driven on gloo (the CPU standing in for the GPU): the same
    weights and norms, bit for bit, and the path was taken (flags, norms, the step's checks)."""
    plain = run_ranks(_nccl_like_run, 2, False)
    staged = run_ranks(_nccl_like_run, 2, True)
    for (w0, n0, c0), (w1, n1, c1) in zip(plain, staged):
        assert c0 == 0 and c1 >= 6, (c0, c1)  # at least end of backward and finish(), 3 steps
        assert n0 == n1
        assert all(torch.equal(a, b) for a, b in zip(w0, w1))
