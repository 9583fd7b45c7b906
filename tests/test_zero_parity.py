"""ZeRO-1/2 against DDP + the same torch optimizer, on real gloo ranks.

Each rank trains two copies of AwkwardNet from the same seed on the same data:
one under torch's DistributedDataParallel (find_unused_parameters=True) with a
plain torch optimizer, one under ShardedDDP + ShardedOptimizer. Losses and
final parameters must agree within 1e-5 relative: both reduce the same
pre-divided fp32 gradients, so the only differences are summation order in the
reduction and the norm (a few ulps per step). A missing divide-by-world-size,
a wrong chunk, a skipped bucket or a stepped unused parameter is far outside it.
SGD with momentum is there because Adam is scale-invariant and would hide a
wrong gradient scale.
"""
import copy
import itertools

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from models import AwkwardNet, batch, uses_branch

# 12 steps (20 until 2026-11-29): one whole period of uses_branch's pattern (lcm(3, 4): steps where both ranks,
# one, or no rank uses the branch, so an unused parameter stepped shows at steps 1, 5 and 9), and the StepLR
# halving at step 7 with 5 steps after it. Each fault the docstring names moves the first step already; the
# 8 steps cut took 40% of the file's time, here and in .ci/newest-torch.
STEPS = 12


def _optim(name):
    """(class for ShardedOptimizer, its kwargs, class for the DDP reference, its kwargs)."""
    import shardopt

    adamw = dict(lr=1e-2, weight_decay=0.1)
    return {
        "adamw": (torch.optim.AdamW, adamw, torch.optim.AdamW, adamw),
        "sgd": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9, weight_decay=0.01),) * 2,
        "cpuadam": (shardopt.CPUAdam, dict(adamw, adamw=True), torch.optim.AdamW, adamw),
        "adagrad": (torch.optim.Adagrad, dict(lr=5e-2),) * 2,
        "rmsprop": (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5),) * 2,
        # The rest of shardopt.elementwise's list: each with weight decay, as the decay / no-decay groups vary it.
        "adamax": (torch.optim.Adamax, dict(lr=1e-2, weight_decay=0.01),) * 2,
        "nadam": (torch.optim.NAdam, dict(lr=1e-2, weight_decay=0.01, decoupled_weight_decay=True),) * 2,
        "radam": (torch.optim.RAdam, dict(lr=1e-2, weight_decay=0.01),) * 2,  # un-rectified until step 6
        "adadelta": (torch.optim.Adadelta, dict(lr=1.0, weight_decay=0.01),) * 2,
    }[name]


OPTIMS = ("adamw", "sgd")
# 300: smaller than the big parameters (buckets round up to lcm(ws, 128) = 384 here);
# 1000: parameters straddle buckets and chunks; 10**7: one bucket for the model.
BUCKETS = [300, 1000, 10**7]


def _param_groups(model):
    # Two groups with different hyper-parameters, as with decay / no-decay.
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def _train(rank, world_size, optim_name, stage, overlap, rbs, agbs, accum, clip, gather, pg_gather=False,
           options=None, group=None):
    """options: what both sides are given on top (test_options_match_ddp): "ddp" (DDP's and ShardedDDP's
    keyword arguments), "reduce_dtype" (ShardedOptimizer's; DDP reduces in it with torch's compression hook);
    group: the process group both train on (None: the world)."""
    import shardopt
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    options = options or {}
    cls, kw, ref_cls, ref_kw = _optim(optim_name)
    torch.manual_seed(0)
    base = AwkwardNet()
    ref_model = copy.deepcopy(base)
    ref = DDP(ref_model, find_unused_parameters=True, process_group=group, **options.get("ddp", {}))
    if options.get("reduce_dtype") == torch.float16:
        ref.register_comm_hook(group, default_hooks.fp16_compress_hook)
    ref_opt = ref_cls(_param_groups(ref_model), **ref_kw)
    model = copy.deepcopy(base)
    opt = shardopt.ShardedOptimizer(_param_groups(model), optim=cls, stage=stage, overlap_comm=overlap,
                                    overlap_gather=gather, reduce_bucket_size=rbs, allgather_bucket_size=agbs,
                                    shared_memory_gather=False if pg_gather else None, process_group=group,
                                    reduce_dtype=options.get("reduce_dtype"), **kw)
    # One host: the default gathers through shared memory (Note [Gathering through shared memory]; that it
    # is used where it can be is test_shared_gather.py's to check).
    assert opt.store.gather.shared is None or not pg_gather
    sharded = shardopt.ShardedDDP(model, opt, **options.get("ddp", {}))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=7, gamma=0.5)
    loss_fn = torch.nn.CrossEntropyLoss()
    failures = []
    for step in range(STEPS):
        micro = 2 if accum != "none" else 1
        losses = []
        for wrapper, optimizer, sync_ctx in ((ref, ref_opt, ref.no_sync), (sharded, opt, sharded.no_sync)):
            total = 0.0
            for m in range(micro):
                x, y = batch(step, rank, m)
                ctx = sync_ctx() if (accum == "no_sync" and m < micro - 1) else _null()
                with ctx:
                    loss = loss_fn(wrapper(x, uses_branch(step, rank)).reshape(-1, 37), y.reshape(-1)) / micro
                    loss.backward()
                total += loss.item()
            if clip:
                if optimizer is opt:
                    norm = opt.clip_grad_norm(0.5)
                else:
                    norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5)
                total += 0 * float(norm)
                losses.append(float(norm))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(total)
        sched.step()
        ref_sched.step()
        half = len(losses) // 2
        for a, b in zip(losses[:half], losses[half:]):
            if abs(a - b) > 1e-5 * max(1.0, abs(a)):
                failures.append(f"step {step}: ref {a!r} vs sharded {b!r}")
    # Read outside a forward: with overlap_gather the last gather may be in flight, at stage 3 the
    # weights exist whole only inside full_params().
    with opt.full_params(writeback=False):
        for (name, p), (_, q) in zip(ref_model.named_parameters(), model.named_parameters()):
            err = ((p - q).abs().max() / p.abs().max().clamp_min(1e-12)).item()
            if err > 1e-5:
                failures.append(f"final {name}: relative error {err:.2e}")
    for (name, b), (_, c) in zip(ref_model.named_buffers(), model.named_buffers()):
        # Running stats follow the (ulp-close) parameters, so they are close, not equal.
        if not torch.allclose(b.double(), c.double(), rtol=1e-5, atol=1e-7):
            failures.append(f"buffer {name} differs: {b.flatten()[:3]} vs {c.flatten()[:3]}")
    return failures, opt.engine.num_reduce_scatters, opt.store.gather.num_all_gathers


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _matrix(rank, world_size, configs):
    out = {}
    for cfg in configs:
        failures, _, _ = _train(rank, world_size, *cfg)
        if failures:
            out[str(cfg)] = failures[:5]
    return out


def _configs(world_size):
    """Every (optimizer, stage, overlap, bucket size) at world sizes 1 and 2; at 3 and 4 (slow on
    2 cores) alternate halves, so that each combination still runs at one of them. Accumulation
    mode, clipping, small all-gather spans, overlap_gather and the gather's path (shared memory or the
    process group) rotate so every half sees each of them."""
    configs = []
    for i, (optim_name, stage, overlap, rbs) in enumerate(
            itertools.product(OPTIMS, (1, 2), (True, False), BUCKETS)):
        j = i // 2
        accum = ("none", "no_sync", "accumulate")[j % 3]
        clip = j % 2 == 0
        agbs = 256 if j % 4 == 1 else 10**9  # several all-gathers per bucket
        gather = j % 4 in (1, 2)  # gathers finish in the next forward
        pg_gather = (j // 2) % 2 == 1  # the gather through the process group, not shared memory
        configs.append((optim_name, stage, overlap, rbs, agbs, accum, clip, gather, pg_gather))
    return configs if world_size <= 2 else configs[world_size % 2::2]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_parity_with_ddp(world_size):
    from dist_harness import run_ranks

    results = run_ranks(_matrix, world_size, _configs(world_size), timeout=600)
    for rank, failed in enumerate(results):
        assert not failed, f"rank {rank}: " + "\n".join(f"{k}: {v}" for k, v in failed.items())


@pytest.mark.parametrize("world_size", [2, 3])
def test_other_optimizers_match_ddp(world_size):
    """shardopt.CPUAdam inside ShardedOptimizer against torch's AdamW, and the other elementwise optimizers."""
    from dist_harness import run_ranks

    configs = [("cpuadam", 2, True, 1000, 10**9, "accumulate", True, True),
               ("adagrad", 1, True, 300, 256, "no_sync", False, False),
               ("rmsprop", 2, False, 10**7, 10**9, "none", True, False)]
    if world_size == 2:  # the rest of shardopt.elementwise's list, at 2 ranks only (a second or two each)
        configs += [("adamax", 2, True, 300, 256, "no_sync", True, False),
                    ("nadam", 1, True, 1000, 10**9, "accumulate", False, True),
                    ("radam", 2, False, 10**7, 10**9, "none", True, False),
                    ("adadelta", 2, True, 300, 10**9, "none", False, True)]
    results = run_ranks(_matrix, world_size, configs, timeout=600)
    for rank, failed in enumerate(results):
        assert not failed, f"rank {rank}: " + "\n".join(f"{k}: {v}" for k, v in failed.items())


def _options(rank, world_size):
    """Options accepted and not shown elsewhere, each against DDP given the same. At 3 ranks: buffers not
    broadcast (each rank's BatchNorm statistics its own); then on the subgroup of ranks 1 and 2 (rank 0
    idles: it is no member, and the group's rank 0 is world rank 1), plain, and reducing in fp16 (at 2 ranks
    a sum has one order, so DDP's fp16 compression hook, cast then divided by 2, and shardopt, divided then
    cast, give the same fp16 sums but where halving an fp16 subnormal rounds: ~6e-8 of a gradient)."""
    out = {}
    failures, _, _ = _train(rank, world_size, "sgd", 2, True, 300, 10**9, "no_sync", True, False, False,
                            options={"ddp": {"broadcast_buffers": False}})
    out["broadcast_buffers=False"] = failures[:5]
    # Made after the world's optimizer above: one made before it that leaves a rank out breaks shardopt's
    # copies of the world group (test_a_subgroup_made_before_the_optimizer_that_leaves_out_a_rank).
    group = dist.new_group([1, 2])  # every rank takes part in making it
    cases = [("process_group=[1, 2]", group, ("adamw", 2, True, 1000, 10**9, "none", True, True, False, None)),
             ("process_group=[1, 2], stage 1", group, ("sgd", 1, False, 300, 256, "accumulate", False, False,
                                                        True, None)),
             ("reduce_dtype=float16", group, ("sgd", 2, True, 300, 10**9, "none", True, False, False,
                                              {"reduce_dtype": torch.float16}))]
    for name, grp, cfg in cases:
        if rank not in (1, 2):
            continue
        failures, _, _ = _train(rank, world_size, *cfg[:9], options=cfg[9], group=grp)
        out[name] = failures[:5]
    return out


def test_options_match_ddp():
    from dist_harness import run_ranks

    results = run_ranks(_options, 3, timeout=600)
    assert sorted(results[0]) == ["broadcast_buffers=False"] and len(results[1]) == len(results[2]) == 4
    for rank, res in enumerate(results):
        failed = {k: v for k, v in res.items() if v}
        assert not failed, f"rank {rank}: " + "\n".join(f"{k}: {v}" for k, v in failed.items())


def _subgroup_first(rank, world_size):
    import shardopt

    dist.new_group([1, 2])  # rank 0 is no member: torch registers the group on ranks 1 and 2 only
    shardopt.ShardedOptimizer(AwkwardNet().parameters(), optim=torch.optim.SGD, lr=0.1, stage=2)
    return "built"


def test_a_subgroup_made_before_the_optimizer_that_leaves_out_a_rank():
    """A user's group that leaves out rank 0, made before the optimizer: the optimizer's copies of the world
    group are named alike on every rank (Note [Naming a copied group] in shardopt/parallel/mesh.py; before,
    copy_group's local naming counted the groups each rank had registered, and the rendezvous timed out)."""
    from dist_harness import run_ranks

    assert run_ranks(_subgroup_first, 3, timeout=60, collective_timeout=2) == ["built"] * 3
