"""ZeRO-1/2 behaviour beyond parity: collectives issued, memory released, overlap, and failures.

Every failure test says what bad thing it tries; tests/README.md lists them.
"""
import functools
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_harness import RankFailure, run_ranks
from models import AwkwardNet, batch, uses_branch


def _build(stage=2, rbs=1000, agbs=10**9, overlap=True, optim=torch.optim.SGD, **kw):
    import shardopt

    torch.manual_seed(0)
    model = AwkwardNet()
    kw = kw or dict(lr=0.1, momentum=0.9)
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=optim, stage=stage, reduce_bucket_size=rbs,
                                    allgather_bucket_size=agbs, overlap_comm=overlap, **kw)
    return model, opt, shardopt.ShardedDDP(model, opt)


def _one_step(wrapper, opt, step=0, rank=0):
    x, y = batch(step, rank)
    loss = nn.functional.cross_entropy(wrapper(x, uses_branch(step, rank)).reshape(-1, 37), y.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


# ---------------------------------------------------------------- collectives
def _count_collectives(rank, world_size):
    out = {}
    for rbs, agbs in ((300, 10**9), (10**7, 10**9), (10**7, 256)):
        # The engine's gathers: shared memory on one host would gather by copying (parallel/shared_memory.py).
        _, opt, wrapper = _build(rbs=rbs, agbs=agbs, lr=0.1, momentum=0.9, shared_memory_gather=False)
        for step in range(3):
            _one_step(wrapper, opt, step, rank)
        out[(rbs, agbs)] = (opt.engine.num_reduce_scatters, opt.engine.num_all_gathers,
                            len(opt.layout.buckets), len(opt.layout.gather_spans))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_bucket_sizes_change_collectives(world_size):
    counts = run_ranks(_count_collectives, world_size)[0]
    small, big, big_small_gather = counts[(300, 10**9)], counts[(10**7, 10**9)], counts[(10**7, 256)]
    # One reduce-scatter per bucket per backward; one all-gather per span per step.
    for rs, ag, nb, ng in counts.values():
        assert (rs, ag) == (3 * nb, 3 * ng)
    # reduce_bucket_size: a bucket smaller than the model means more reduce-scatters.
    assert small[2] > big[2] == 1  # one param group: a big bucket holds the whole model
    # allgather_bucket_size: smaller spans mean more all-gathers, the same reduce-scatters.
    assert big_small_gather[3] > big[3] and big_small_gather[0] == big[0]


def _all_reduces_per_step(rank, world_size):
    # Note [The step's flags ride the end of backward] in shardopt/grad_sync.py: one all-reduce per
    # backward carries the norms and the step's flags; step() and the clips add none.
    from shardopt.parallel import comm

    real, real_comm = dist.all_reduce, comm.all_reduce
    calls, whats = [], []

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    def naming(tensor, group, what, *args, **kwargs):
        whats.append(what.split(" (")[0])
        return real_comm(tensor, group, what, *args, **kwargs)

    out = {}
    for stage in (1, 2, 3):
        model, opt, wrapper = _build(stage=stage, rbs=300)
        steps = []
        for step in range(4):
            dist.all_reduce, comm.all_reduce = counting, naming
            try:
                calls.clear()
                whats.clear()
                x, y = batch(step, rank)
                for micro in range(1 + step % 2):  # odd steps: two backwards before the step
                    out_ = wrapper(x + micro, uses_branch(step, rank))
                    nn.functional.cross_entropy(out_.reshape(-1, 37), y.reshape(-1)).backward()
                if step == 2:  # user code replaces a gradient between backward and step
                    with opt.full_params(writeback=False):  # stage 3: a parameter is whole only in there
                        model.l2.bias.grad = torch.ones_like(model.l2.bias)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.clip_grad_norm(1.0)
                opt.step()
                opt.zero_grad()
                steps.append((len(calls), list(whats)))
            finally:
                dist.all_reduce, comm.all_reduce = real, real_comm
        out[stage] = steps
    # Stage 3, outside full_params(): the parameter is empty, and so is a tensor made like it.
    x, y = batch(0, rank)
    nn.functional.cross_entropy(wrapper(x, True).reshape(-1, 37), y.reshape(-1)).backward()
    model.l2.bias.grad = torch.ones_like(model.l2.bias)
    try:
        opt.step()
        out["empty replacement"] = "stepped"
    except ValueError as e:
        out["empty replacement"] = str(e)
    return out


def test_one_all_reduce_per_backward_and_none_for_the_step():
    end = "end-of-backward"
    want = [[end], [end, end], [end, "gradient norms of order 2.0"], [end, end]]
    for rank, results in enumerate(run_ranks(_all_reduces_per_step, 2)):
        error = results.pop("empty replacement")
        assert "p.grad replaced by a tensor of shape (0,)" in error and "opt.full_params()" in error, error
        for stage, steps in results.items():
            # One all-reduce per backward (steps 1 and 3 run two); the step's flags add none: they used to
            # take an all-reduce of their own in step(), a second wait for the slowest rank. A replaced
            # gradient (step 2) needs its norm again: the clips' one all-reduce, shared by both.
            assert [n for n, _ in steps] == [len(w) for w in want], f"rank {rank}, stage {stage}: {steps}"
            assert [w for _, w in steps] == want, f"rank {rank}, stage {stage}: {steps}"


# ------------------------------------------------------------------- memory
def _memory(rank, world_size, stage):
    model, opt, wrapper = _build(stage=stage, rbs=300)
    x, y = batch(0, rank)
    nn.functional.cross_entropy(wrapper(x, True).reshape(-1, 37), y.reshape(-1)).backward()
    from shardopt.sharded_grad import ShardedGrad

    managed = [p for p in model.parameters() if p.requires_grad]
    # Once reduced, p.grad is a storage-less stand-in for the shard (Note [Sharded p.grad]).
    grads_alive = sum(p.grad is not None and not isinstance(p.grad, ShardedGrad) for p in managed)
    assert all(isinstance(p.grad, ShardedGrad) for p in managed)
    stats = opt.memory_stats()
    opt.step()
    return grads_alive, len(managed), stats, opt.layout.total_numel, opt.layout.shard_numel(), \
        opt.engine.num_staging_buffers, len(opt.layout.buckets)


@pytest.mark.parametrize("stage", [1, 2])
def test_stage2_releases_full_gradients(stage):
    ws = 2
    alive, managed, stats, total, shard, staging, nbuckets = run_ranks(_memory, ws, stage)[0]
    if stage == 2:
        assert alive == 0  # every full-size gradient was released during backward
        assert stats["grads"] == shard * 4
        assert staging == 2 < nbuckets  # a fixed pool, not a buffer per bucket
    else:
        assert alive == 0  # autograd accumulated into views of the persistent flat buffer
        assert stats["grads"] == (total + shard) * 4
    assert stats["params"] == total * 4


def _overlap(rank, world_size, overlap):
    model, opt, wrapper = _build(rbs=300, overlap=overlap)
    seen = []
    # l1 is registered early, so backward reaches it last: by then the buckets
    # of later layers must already have been launched.
    model.l1.weight.register_hook(lambda g: seen.append(opt.engine.num_reduce_scatters))
    x, y = batch(0, rank)
    # Every parameter used: an unused one holds back the buckets launched after
    # its own until backward ends (launch order is fixed across ranks).
    nn.functional.cross_entropy(wrapper(x, True).reshape(-1, 37), y.reshape(-1)).backward()
    return seen[0], len(opt.layout.buckets)


@pytest.mark.parametrize("overlap", [True, False])
def test_reduce_scatter_starts_during_backward(overlap):
    launched_before_l1, nbuckets = run_ranks(_overlap, 2, overlap)[0]
    assert 0 < launched_before_l1 < nbuckets


# Note [Overlap shown by holding a peer back]
# -------------------------------------------
# The test above counts launches, which overlap_comm=False makes too: it waits for each reduce-scatter
# right after launching it. What overlap adds is that backward goes on while a reduce-scatter is still in
# flight. To show that without a clock, rank 1 holds its whole backward (before any of its gradients or
# collectives) until rank 0 says that its own backward reached l1 (registered early, so reached after
# every later layer: their buckets have launched). A reduce-scatter needs both ranks, so nothing rank 0
# launched can finish while rank 1 is held: every one counted then is in flight. Overlapping, rank 0 gets
# to l1 and lets rank 1 go; waiting at each launch (overlap_comm=False, or a launch that blocks), rank 0
# is stuck in its first bucket's collective, never reaches l1, and rank 1's wait for it times out.
# Enough staging buffers for every bucket: with fewer, stage 2 waits for the oldest reduce-scatter to hand
# its buffer back (overlap is bounded by num_staging_buffers, by design), which also needs rank 1.
# Stage 3 (where overlap_comm=True is required) with reshard_after_forward=False: otherwise backward
# gathers the parameters again, a collective rank 1 would have to join while held.
_HOLD_SECONDS = 60  # rank 0's backward of a 6k-parameter model: milliseconds; generous on a loaded machine


class _HoldBackward(torch.autograd.Function):
    """Identity; its backward (the first node of the rank's backward) waits for rank 0 to reach l1."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import datetime

        store = dist.distributed_c10d._get_default_store()
        try:
            store.wait(["rank0_reached_l1"], datetime.timedelta(seconds=_HOLD_SECONDS))
        except Exception as e:  # noqa: BLE001 - the store's timeout error type differs across versions
            raise AssertionError(f"rank 0 did not reach l1 within {_HOLD_SECONDS}s while rank 1 held its "
                                 "backward: rank 0 waited for a reduce-scatter during backward") from e
        return grad


def _in_flight_when_backward_reaches_l1(rank, world_size, stage):
    # Stage 3 keeps its gathered parameters to the end of backward: no all-gather there either.
    more = dict(reshard_after_forward=False) if stage == 3 else {}
    model, opt, wrapper = _build(stage=stage, rbs=300, num_staging_buffers=64, lr=0.1, momentum=0.9, **more)
    seen = {}
    store = dist.distributed_c10d._get_default_store()

    def reached_l1(grad):
        seen["launched"] = opt.engine.num_reduce_scatters
        if rank == 0:
            store.set("rank0_reached_l1", "1")

    model.l1.weight.register_hook(reached_l1)
    x, y = batch(0, rank)
    out = wrapper(x, True)
    if rank == 1:
        out = _HoldBackward.apply(out)
    nn.functional.cross_entropy(out.reshape(-1, 37), y.reshape(-1)).backward()
    return seen["launched"], len(opt.layout.buckets)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_reduce_scatters_are_in_flight_while_backward_goes_on(stage):
    # Note [Overlap shown by holding a peer back]
    (in_flight, nbuckets), _ = run_ranks(_in_flight_when_backward_reaches_l1, 2, stage)
    assert 0 < in_flight < nbuckets  # launched by rank 0, none finished (rank 1 was held): all in flight


# ------------------------------------------------------------ wrap-time sync
def _broadcast_at_wrap(rank, world_size):
    import shardopt

    torch.manual_seed(rank)  # every rank starts from different weights and buffers
    model = AwkwardNet()
    model.norm.running_mean.fill_(float(rank))
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1, reduce_bucket_size=300)
    shardopt.ShardedDDP(model, opt)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_parameters_and_buffers_come_from_rank_0():
    states = run_ranks(_broadcast_at_wrap, 3)
    torch.manual_seed(0)
    want = AwkwardNet().state_dict()
    want["norm.running_mean"].fill_(0.0)
    for rank, state in enumerate(states):
        for k, v in want.items():
            assert torch.equal(state[k], v), f"rank {rank}: {k} differs from rank 0's"


def _buffers_replaced_after_wrap(rank, world_size):
    import shardopt

    torch.manual_seed(0)
    model = AwkwardNet()
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1, reduce_bucket_size=300)
    wrapped = shardopt.ShardedDDP(model, opt)
    model.eval()  # BatchNorm reads its running statistics and leaves them as they are
    x, _ = batch(0, rank)
    seen = []
    # Each forward broadcasts rank 0's buffers first (DDP's broadcast_buffers): also a buffer replaced after
    # wrapping, by attribute (a registration) or behind torch's hooks (as model.to() / _apply do).
    for replace in (lambda t: setattr(model.norm, "running_mean", t),
                    lambda t: model.norm._buffers.__setitem__("running_var", t)):
        replace(torch.full((model.norm.num_features,), 10.0 + rank))
        wrapped(x, True)
        seen.append((model.norm.running_mean.clone(), model.norm.running_var.clone()))
    return seen


def test_buffers_replaced_after_wrapping_are_broadcast():
    # Note [Parameters fixed at wrap time]: the buffer list is taken at wrap time, and taken again when a buffer
    # is registered or no longer in its slot.
    for rank, (first, second) in enumerate(run_ranks(_buffers_replaced_after_wrap, 2)):
        assert torch.equal(first[0], torch.full_like(first[0], 10.0)), rank   # rank 0's new running_mean
        assert torch.equal(second[1], torch.full_like(second[1], 10.0)), rank  # and its new running_var


# ---------------------------------------------------------- rank disagreement
def _build_differently(rank, what):
    """Rank 1 builds something different from rank 0 in one respect: `what`."""
    import shardopt

    torch.manual_seed(0)
    model = AwkwardNet()
    kw = dict(optim=torch.optim.AdamW, stage=2, reduce_bucket_size=1000)
    other = rank == 1
    if what == "shape" and other:
        model.l2 = nn.Linear(53, 24, bias=False)
        model.l2.bias = nn.Parameter(torch.zeros(25))
    if what == "dtype" and other:
        model.double()
    if what == "frozen" and other:
        model.l2.bias.requires_grad_(False)
    if what == "buffer" and other:
        model.register_buffer("step_count", torch.zeros(1))
    params = list(model.parameters())
    if what == "order" and other:
        params[1], params[2] = params[2], params[1]
    if other:
        kw.update({"stage": dict(stage=1), "bucket": dict(reduce_bucket_size=2000), "lr": dict(lr=0.5),
                   "agbucket": dict(allgather_bucket_size=512), "optimizer": dict(optim=torch.optim.Adam),
                   "overlap": dict(overlap_comm=False)}.get(what, {}))
    opt = shardopt.ShardedOptimizer(params, **kw)
    shardopt.ShardedDDP(model, opt)


DISAGREEMENTS = {
    "shape": "l2.bias|param 3|shape",   # different model
    "order": "param 1",                 # same params, different order
    "stage": "stage", "bucket": "reduce_bucket_size", "agbucket": "allgather_bucket_size",
    "dtype": "dtype", "lr": "lr", "optimizer": "optimizer torch.optim",
    "frozen": "param",                  # one rank froze a parameter
    "buffer": "step_count",             # caught by ShardedDDP
    "overlap": "overlap_comm",
}


def _disagree(rank, world_size):
    # Each case raises on both ranks, so the next one starts in step: one spawn for all.
    out = {}
    for what in DISAGREEMENTS:
        try:
            _build_differently(rank, what)
            out[what] = None
        except ValueError as e:
            out[what] = str(e)
    return out


def test_ranks_that_disagree_fail_at_construction():
    import re

    for rank, out in enumerate(run_ranks(_disagree, 2, timeout=120, collective_timeout=30)):
        for what, needle in DISAGREEMENTS.items():
            # Every rank raises (no rank is left waiting), naming what differs.
            assert out[what] is not None, f"rank {rank}: {what}: no error"
            assert "ranks disagree" in out[what] and re.search(needle, out[what]), (rank, what, out[what])


# --------------------------------------------------------------- dead peers
def _peer_dies(rank, world_size, when):
    import signal
    import time

    model, opt, wrapper = _build(rbs=300)
    _one_step(wrapper, opt, 0, rank)
    if rank == 1:
        if when == "between steps":
            os._exit(3)  # no cleanup, no goodbye
        # SIGKILL after this rank's optimizer step, before its share of the
        # all-gather: the survivor is left waiting inside step().
        inner_step = opt.inner.step
        opt.inner.step = lambda: (inner_step(), os.kill(os.getpid(), signal.SIGKILL))
    start = time.monotonic()
    try:
        _one_step(wrapper, opt, 1, rank)
    except Exception as e:  # noqa: BLE001 - re-raised with how long it took to notice
        raise RuntimeError(f"noticed after {time.monotonic() - start:.1f}s: {e}") from e


@pytest.mark.parametrize("when,code", [("between steps", 3), ("sigkill mid-step", -9)])
def test_dead_peer_fails_loudly_instead_of_hanging(when, code):
    import re

    with pytest.raises(RankFailure) as info:
        run_ranks(_peer_dies, 2, when, timeout=90, collective_timeout=10)
    msg = str(info.value)
    assert f"rank 1 died with exit code {code}" in msg
    assert "peer rank has probably exited" in msg or "peer may have died" in msg \
        or "Connection" in msg or "closed" in msg.lower() or "of this host's shard group exited" in msg, msg
    # The survivor raised within the group's timeout (10 s here), not the launcher's deadline.
    took = re.search(r"noticed after ([0-9.]+)s", msg)
    assert took and float(took.group(1)) <= 10 + 5, msg


# ------------------------------------------------------------- bad arguments
def _bad_args(rank, world_size):
    import shardopt

    model = AwkwardNet()
    errors = {}

    def expect(name, exc, fn):
        try:
            fn()
        except exc as e:
            errors[name] = str(e)
        else:
            errors[name] = None

    P = lambda: AwkwardNet().parameters()  # noqa: E731
    expect("bucket<=0", ValueError, lambda: shardopt.ShardedOptimizer(P(), reduce_bucket_size=0))
    expect("agbucket<=0", ValueError, lambda: shardopt.ShardedOptimizer(P(), allgather_bucket_size=-1))
    expect("stage4", ValueError, lambda: shardopt.ShardedOptimizer(P(), stage=4))
    expect("stage3+overlap_gather", ValueError, lambda: shardopt.ShardedOptimizer(P(), stage=3, overlap_gather=True))
    expect("stage3-no-overlap", ValueError, lambda: shardopt.ShardedOptimizer(P(), stage=3, overlap_comm=False))
    expect("meta-stage2", ValueError, lambda: shardopt.ShardedOptimizer(
        nn.Linear(3, 3, device="meta").parameters(), stage=2))
    expect("offload", ValueError, lambda: shardopt.ShardedOptimizer(P(), offload="nvme"))
    assert shardopt.ShardedOptimizer(P(), offload=None).config.offload == "none"  # FSDP's cpu_offload=None
    expect("lbfgs", ValueError, lambda: shardopt.ShardedOptimizer(P(), optim=torch.optim.LBFGS))
    expect("not-a-class", TypeError, lambda: shardopt.ShardedOptimizer(P(), optim="adam"))
    expect("bad-kwarg", TypeError, lambda: shardopt.ShardedOptimizer(P(), lr=1e-3, betas2=0.1))
    mixed = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3).double()])
    expect("mixed-dtype", TypeError, lambda: shardopt.ShardedOptimizer(mixed.parameters()))
    meta = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3, device="meta"))]
    expect("mixed-device", ValueError, lambda: shardopt.ShardedOptimizer(meta))
    expect("no-trainable", ValueError,
           lambda: shardopt.ShardedOptimizer(nn.Linear(2, 2).requires_grad_(False).parameters()))

    # The model has a trainable parameter the optimizer does not know.
    opt = shardopt.ShardedOptimizer(list(model.parameters())[1:], optim=torch.optim.SGD, lr=0.1)
    expect("param-not-in-opt", ValueError, lambda: shardopt.ShardedDDP(model, opt))

    # step() without ShardedDDP, and step() before any backward.
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    expect("no-ddp", RuntimeError, opt.step)
    wrapper = shardopt.ShardedDDP(model, opt)
    expect("step-before-backward", RuntimeError, opt.step)

    # A sparse gradient.
    sparse = nn.Embedding(10, 4, sparse=True)
    opt = shardopt.ShardedOptimizer(sparse.parameters(), optim=torch.optim.SGD, lr=0.1)
    w = shardopt.ShardedDDP(sparse, opt)
    expect("sparse-grad", RuntimeError, lambda: w(torch.tensor([1, 2])).sum().backward())
    expect("add-group", NotImplementedError, lambda: opt.add_param_group({"params": [nn.Parameter(torch.ones(1))]}))
    expect("state-dict", RuntimeError, opt.state_dict)
    expect("load-state-dict", ValueError, lambda: opt.load_state_dict({"state": {}, "param_groups": []}))
    expect("consolidate-to", ValueError, lambda: opt.consolidate_state_dict(to=world_size))
    expect("stage-str", ValueError, lambda: shardopt.ShardedOptimizer(P(), stage="2"))

    # Checkpoints: a model and optimizer that do not belong together, and loading before wrapping.
    model2 = AwkwardNet()
    opt2 = shardopt.ShardedOptimizer(model2.parameters(), optim=torch.optim.SGD, lr=0.1)
    expect("save-wrong-pair", ValueError, lambda: shardopt.save_checkpoint("/nonexistent", model, opt2))
    expect("load-unwrapped", RuntimeError, lambda: shardopt.load_checkpoint("/nonexistent", model2, opt2))
    return errors


def _backward_raises(rank, world_size):
    model, opt, wrapper = _build(rbs=300)
    x, y = batch(0, rank)
    out = wrapper(x, True)

    def boom(grad):
        raise ValueError("user hook failed")

    model.l1.weight.register_hook(boom)  # reached late in backward, after buckets launched
    try:
        nn.functional.cross_entropy(out.reshape(-1, 37), y.reshape(-1)).backward()
    except ValueError:
        pass
    try:
        wrapper(x, True)
    except RuntimeError as e:
        return str(e)
    return None


def test_forward_after_a_failed_backward_refuses_to_continue():
    # A backward that raised mid-way left buckets half reduced: training on would
    # pair mismatched collectives, so the next forward says so instead.
    msg = run_ranks(_backward_raises, 1)[0]
    assert msg is not None and "did not finish" in msg


def test_bad_arguments_raise_clear_errors():
    errors = run_ranks(_bad_args, 2)[0]
    needles = {
        "bucket<=0": "reduce_bucket_size", "agbucket<=0": "allgather_bucket_size", "stage4": "stage must be 1, 2 or 3",
        "stage3+overlap_gather": "drop overlap_gather=True", "stage3-no-overlap": "needs overlap_comm=True",
        "meta-stage2": "meta device: stage=3",
        "offload": "offload", "lbfgs": "LBFGS", "not-a-class": "torch.optim.Optimizer class",
        "bad-kwarg": "betas2", "mixed-dtype": "one parameter dtype", "mixed-device": "one device",
        "no-trainable": "requires grad", "param-not-in-opt": "not in the ShardedOptimizer",
        "no-ddp": "ShardedDDP", "step-before-backward": "before any backward", "sparse-grad": "sparse",
        "add-group": "after construction", "state-dict": "consolidate_state_dict(to=",
        "load-state-dict": "param groups", "consolidate-to": "to must be a rank", "stage-str": "stage",
        "save-wrong-pair": "not a parameter of this model", "load-unwrapped": "ShardedDDP(model, optimizer)",
    }
    for name, needle in needles.items():
        assert errors[name] is not None, f"{name}: no error raised"
        assert needle in errors[name], f"{name}: {errors[name]!r} does not mention {needle!r}"


# ---------------------------------------------------------------- lifetime
def _wrapper_lifetime(rank, world_size):
    import gc
    import weakref

    import shardopt

    out = {}
    for stage, overlap_gather in ((1, False), (2, True)):
        torch.manual_seed(0)
        model = AwkwardNet()
        opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9,
                                        stage=stage, reduce_bucket_size=1000, overlap_gather=overlap_gather)
        wrapper = shardopt.ShardedDDP(model, opt)
        _one_step(wrapper, opt, 0, rank)
        refs = [weakref.ref(o) for o in (model, opt, wrapper)]
        del model, opt, wrapper
        gc.collect()
        out[f"stage {stage} freed"] = [r() is None for r in refs]

    # The wrapper alone dropped: the model is a plain module again and the
    # optimizer, which no gradient reaches any more, refuses to step.
    model, opt, wrapper = _build(stage=2)
    _one_step(wrapper, opt, 0, rank)
    del wrapper
    gc.collect()
    x, y = batch(1, rank)
    loss = nn.functional.cross_entropy(model(x, uses_branch(1, rank)).reshape(-1, 37), y.reshape(-1))
    loss.backward()
    out["plain grads kept"] = sum(p.grad is not None for p in model.parameters())
    try:
        opt.step()
        out["step error"] = None
    except RuntimeError as e:
        out["step error"] = str(e)
    # ... and a new wrapper attaches and trains.
    model.zero_grad(set_to_none=True)
    out["rewrapped loss"] = _one_step(shardopt.ShardedDDP(model, opt), opt, 2, rank)

    # Stage 3: a dropped wrapper leaves empty parameters (Note [Orphaned stage-3 modules] in ddp.py):
    # forward and state_dict() refuse, naming the fix, until a new wrapper takes the module again.
    model, opt, wrapper = _build(stage=3)
    _one_step(wrapper, opt, 0, rank)
    expected = {k: v.clone() for k, v in wrapper.module.state_dict().items()}
    del wrapper
    gc.collect()
    for what, call in (("forward", lambda: model(*batch(1, rank)[:1], uses_branch(1, rank))),
                       ("state_dict", model.state_dict)):
        try:
            call()
            out[f"orphan {what}"] = None
        except RuntimeError as e:
            out[f"orphan {what}"] = str(e)
    wrapper = shardopt.ShardedDDP(model, opt)
    out["stage 3 rewrapped state equal"] = all(torch.equal(v, expected[k])
                                              for k, v in wrapper.module.state_dict().items())
    out["stage 3 rewrapped loss"] = _one_step(wrapper, opt, 2, rank)
    whole = wrapper.detach()
    del wrapper
    gc.collect()
    out["detached state equal"] = all(v.numel() > 0 for v in whole.state_dict().values())
    return out


def test_dropped_wrapper_frees_model_and_removes_its_hooks():
    # Gradient hooks live in C++, out of the garbage collector's sight: if they held
    # the wrapper strongly, a dropped model + optimizer (and their process group)
    # would never be freed (Note [Hooks die with the wrapper] in ddp.py).
    out = run_ranks(_wrapper_lifetime, 2)[0]
    assert out["stage 1 freed"] == [True, True, True] and out["stage 2 freed"] == [True, True, True], out
    assert out["plain grads kept"] > 0  # stage 2 hooks would have set every .grad to None
    assert out["step error"] is not None and "ShardedDDP" in out["step error"]
    assert 0 < out["rewrapped loss"] < 100
    for what in ("forward", "state_dict"):
        assert out[f"orphan {what}"] is not None and "detach()" in out[f"orphan {what}"], out
    assert out["stage 3 rewrapped state equal"] and 0 < out["stage 3 rewrapped loss"] < 100
    assert out["detached state equal"]  # detach() leaves no refusal behind


# ---------------------------------------------------------------- hooks in C++
def _python_calls_in_backward(rank, world_size):
    """Per stage and model size: Python hooks on the parameters, C++ hooks, Python calls per backward."""
    import sys

    import shardopt

    import collections

    out = {}
    for stage in (1, 2, 3):
        for layers in (5, 40):
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
            opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1, stage=stage,
                                            reduce_bucket_size=37)  # many buckets, straddling parameters
            wrapper = shardopt.ShardedDDP(model, opt)
            python_hooks = sum(bool(p._backward_hooks) + (p._post_accumulate_grad_hooks is not None)
                               for p in model.parameters())
            calls, most = [], []
            for step in range(3):
                x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
                loss = wrapper(x).square().sum()
                count = [0]
                per_function = collections.Counter()

                def profile(frame, event, arg):
                    if event == "call":
                        count[0] += 1
                        per_function[(frame.f_code.co_filename, frame.f_code.co_name)] += 1

                sys.setprofile(profile)
                try:
                    if step == 1:
                        with wrapper.no_sync():
                            loss.backward()
                    else:
                        loss.backward()
                finally:
                    sys.setprofile(None)
                calls.append(count[0])
                most.append(max(per_function.values(), default=0))
                if step != 1:
                    opt.step()
                    wrapper.zero_grad()
            out[(stage, 2 * layers)] = (python_hooks, opt.store.grad_hooks.num_hooks, calls, most)
    out.update(_user_hooks(rank))
    return out


def _user_hooks(rank):
    """Stage 3's C++ hook sits on the parameter itself, where a user's first p.register_hook clears it."""
    import shardopt

    def train(stage, hook_after_wrapping):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
        opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1, stage=stage,
                                        reduce_bucket_size=37)
        wrapper = shardopt.ShardedDDP(model, opt)
        if hook_after_wrapping:
            model[1].weight.register_hook(lambda g: 3 * g)  # (the first: Python's setter clears the list)
        for step in range(2):
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            wrapper(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        with opt.full_params(writeback=False):
            return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])

    out = {"hooked 3": train(3, True), "hooked 2": train(2, True), "plain 3": train(3, False)}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1, stage=3)
    wrapper = shardopt.ShardedDDP(model, opt)
    loss = wrapper(torch.randn(2, 4)).square().sum()
    model[0].weight.register_hook(lambda g: g)  # between the forward and its backward
    try:
        loss.backward()
        out["late hook"] = None
    except RuntimeError as e:
        out["late hook"] = str(e)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1, stage=3)
    wrapper = shardopt.ShardedDDP(model, opt)
    model[1].bias.register_post_accumulate_grad_hook(lambda p: None)
    try:
        wrapper(torch.randn(2, 4)).square().sum().backward()
        out["post-accumulate hook"] = None
    except RuntimeError as e:
        out["post-accumulate hook"] = str(e)
    return out


@functools.cache
def _hook_results():
    return run_ranks(_python_calls_in_backward, 2)[0]


def test_stage_1_2_gradient_hooks_are_cpp():
    # Note [Gradient hooks in C++]: no Python hook on any parameter, and the Python called during a
    # backward pass (one call at its start, the end-of-backward reduction) does not grow with the number
    # of parameters - a Python hook per parameter (or a per-parameter Python call) coming back fails here.
    out = _hook_results()
    for stage in (1, 2):
        (hooks_few, cpp_few, few, _), (hooks_many, cpp_many, many, _) = out[(stage, 10)], out[(stage, 80)]
        assert hooks_few == hooks_many == 0, out
        assert cpp_few == 2 * 10 and cpp_many == 2 * 80, out
        assert few == many and 0 < few[1] <= few[0], f"stage {stage}: Python calls per backward {few} vs {many}"


def test_stage_3_gradient_hooks_are_cpp():
    # Note [Stage 3's gradient hooks in C++]: no Python hook on any parameter, one C++ hook on each. Stage
    # 3's backward still runs Python per saved weight (unpack asks for its bucket) and per bucket (freed
    # once its gradients are in), so the calls grow with the layers; but no Python function runs once per
    # parameter or more: with 80 parameters in 40 layers the busiest one ran 80+ times per backward while
    # the hooks were Python.
    out = _hook_results()
    (hooks_few, cpp_few, _, _), (hooks_many, cpp_many, _, most) = out[(3, 10)], out[(3, 80)]
    assert hooks_few == hooks_many == 0, out
    assert cpp_few == 10 and cpp_many == 80, out
    assert 0 < max(most) < 80, f"stage 3: a Python function ran {most} times per backward over 80 parameters"


def test_stage_3_hook_survives_user_hooks_and_refuses_a_late_one():
    # A user's p.register_hook after wrapping (the tensor's first: Python's setter clears the tensor's
    # hooks, stage 3's C++ one with them) trains as stage 2 does with the same hook (its hook sees and
    # changes the gradient first); one registered between a forward and its backward raises at the end
    # of that backward, naming the fix, instead of losing gradients; a post-accumulate hook is refused.
    out = _hook_results()
    assert torch.allclose(out["hooked 3"], out["hooked 2"], atol=1e-6), (out["hooked 3"], out["hooked 2"])
    assert (out["hooked 3"] - out["plain 3"]).abs().max() > 1e-3  # the hook did change the result
    assert out["late hook"] and "register parameter hooks before the forward" in out["late hook"], out
    # A post-accumulate hook could never run at stage 3 (nothing accumulates into the parameter): refused.
    assert out["post-accumulate hook"] and "register_post_accumulate_grad_hook" in out["post-accumulate hook"], out
