"""ZeRO stage 3 (parameters sharded too) against DDP + the same torch optimizer, on real gloo ranks.

StackNet (tests/models.py) is built for it: blocks in a ModuleList, so every block is gathered on its own
and freed after use; a head tied to the embedding, used first and last; a frozen layer; experts that each
rank reaches or skips by step (a rank runs an expert its peer does not: if gathers followed module calls,
the ranks would wait for each other forever). The parity bar is test_zero_parity's (1e-5 relative on
losses, norms and final weights): stage 3 reduces the same gradients as stage 2 and only the place the
parameters live differs.
"""
import contextlib
import copy
import os
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_harness import run_ranks
from models import DIM, VOCAB, WIDE, AwkwardNet, StackNet, batch, expert_of, uses_branch

STEPS = 8


def _opt_kwargs(name):
    if name == "sgd":
        return torch.optim.SGD, dict(lr=5e-2, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)


def _train(rank, world_size, cfg):
    """Trains DDP and ShardedDDP stage 3 side by side; returns a list of differences (empty: parity)."""
    import shardopt

    cfg = dict(dict(optim="adamw", net="stack", rbs=1000, accum="none", clip=True, checkpoint=False,
                    reshard=True, prefetch=None, max_live=None, persist=0, offload="none", nodes=None), **cfg)
    cls, kw = _opt_kwargs(cfg["optim"])
    torch.manual_seed(0)
    base = StackNet() if cfg["net"] == "stack" else AwkwardNet(**WIDE) if cfg["net"] == "wide" else AwkwardNet()
    ref_model = copy.deepcopy(base)
    ref = DDP(ref_model, find_unused_parameters=True)
    ref_opt = cls(ref_model.parameters(), **kw)
    model = copy.deepcopy(base)
    if cfg["offload"] == "cpu":
        kw = dict(kw, adamw=True) if cls is torch.optim.AdamW else kw
        cls = shardopt.CPUAdam if cls is torch.optim.AdamW else cls
    if cfg["nodes"]:  # ranks on several nodes (as torchrun says): node-aware collectives, on by default
        os.environ["LOCAL_WORLD_SIZE"] = str(world_size // cfg["nodes"])
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=cls, stage=3, reduce_bucket_size=cfg["rbs"],
                                    reshard_after_forward=cfg["reshard"], prefetch_bucket_size=cfg["prefetch"],
                                    max_live_parameters=cfg["max_live"],
                                    param_persistence_threshold=cfg["persist"], offload=cfg["offload"], **kw)
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    if cfg["nodes"] and not (opt.sharding.nodes is not None and opt.store.gather.route == "two-level"
                             and opt.sharding.nodes.replicas == cfg["nodes"] and opt.store.gather.group is None):
        return [f"node-aware collectives are not on for stage 3's gathers ({opt.sharding.nodes})"], 0, 0
    sharded = shardopt.ShardedDDP(model, opt)
    loss_fn = torch.nn.CrossEntropyLoss()
    failures, most_live = [], 0
    for step in range(STEPS):
        micro = 2 if cfg["accum"] != "none" else 1
        results = []
        for wrapper, optimizer in ((ref, ref_opt), (sharded, opt)):
            total = 0.0
            for m in range(micro):
                x, y = batch(step, rank, m)
                if cfg["net"] == "stack":
                    args = (x, expert_of(step + m, rank), cfg["checkpoint"])
                else:
                    args = (x, uses_branch(step, rank))
                quiet = cfg["accum"] == "no_sync" and m < micro - 1
                with wrapper.no_sync() if quiet else contextlib.nullcontext():
                    loss = loss_fn(wrapper(*args).reshape(-1, VOCAB), y.reshape(-1)) / micro
                    loss.backward()
                total += loss.item()
            if cfg["clip"]:
                norm = (opt.clip_grad_norm(0.5) if optimizer is opt
                        else torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5))
                results.append(float(norm))
            optimizer.step()
            optimizer.zero_grad()
            results.append(total)
        half = len(results) // 2
        for a, b in zip(results[:half], results[half:]):
            if abs(a - b) > 1e-5 * max(1.0, abs(a)):
                failures.append(f"step {step}: ref {a!r} vs stage 3 {b!r}")
    assert opt.store.live_bytes() == 0 or cfg["persist"], "buckets left gathered after the step"
    # On this one host the wide model's big buckets, trainable and frozen, were mapped out of the shards
    # (Note [Stage-3 buckets mapped, not copied]), not copied.
    if cfg["net"] == "wide" and not (opt.store.buckets.maps and max(opt.store.buckets.maps) >= opt.store.buckets.trainable
                                     > min(opt.store.buckets.maps)):
        failures.append(f"wide: buckets {sorted(opt.store.buckets.maps)} mapped of {len(opt.store.buckets.full)}")
    most_live = opt.store.peak_live
    with opt.full_params(writeback=False):
        for (name, p), (_, q) in zip(ref_model.named_parameters(), model.named_parameters()):
            err = ((p - q).abs().max() / p.abs().max().clamp_min(1e-12)).item()
            if err > 1e-5:
                failures.append(f"final {name}: relative error {err:.2e}")
    return failures, opt.store.num_gathers, most_live


def _matrix(rank, world_size, configs):
    out = {}
    for cfg in configs:
        failures, gathers, _ = _train(rank, world_size, cfg)
        out[str(cfg)] = (failures[:5], gathers)
    return out


# Every knob at least once; the awkward shapes come from the models (sizes prime, straddling chunks).
CONFIGS = [
    dict(optim="adamw", rbs=1000, accum="no_sync"),
    dict(optim="sgd", rbs=300, accum="accumulate", clip=False),
    dict(optim="adamw", rbs=10**7),                                    # the whole model in one bucket
    dict(optim="sgd", net="awkward", rbs=1000),                        # branch, frozen, tied, BatchNorm
    dict(optim="adamw", rbs=300, reshard=False, prefetch=2000, max_live=3000),
    dict(optim="sgd", rbs=1000, persist=100, checkpoint=True),         # small parameters stay whole
    # Big buckets: mapped out of the shards on this host (Note [Stage-3 buckets mapped, not copied]); SGD: with
    # AdamW this wide model parts from DDP by 1-7e-5 at 3 and 4 ranks, mapped or copied, padded or not, and DDP
    # from itself by 4e-5 / 1.3e-4 with another bucket size (the summation order: benchmarks/
    # ddp_summation_order.py, 2026-11-29-ddp-summation-order.md; at 2 ranks bitwise, test_shared_gather.py).
    dict(optim="sgd", net="wide", rbs=70000, reshard=False),
    dict(optim="sgd", net="wide", rbs=70000, accum="no_sync"),
]


# Ranks on 2 nodes of 2 (LOCAL_WORLD_SIZE=2 at 4 ranks): node-aware collectives (Note [Two-level
# collectives]), the parameter gathers two-level; the same bar as flat (only the summation order differs).
NODE_CONFIGS = [
    dict(optim="sgd", rbs=300, accum="accumulate", clip=False, persist=100, checkpoint=True, nodes=2),
    dict(optim="adamw", rbs=1000, accum="no_sync", reshard=False, prefetch=2000, max_live=3000, nodes=2),
]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_stage3_matches_ddp(world_size):
    configs = CONFIGS if world_size == 2 else CONFIGS[world_size % 2::2] + (NODE_CONFIGS if world_size == 4 else [])
    results = run_ranks(_matrix, world_size, configs, timeout=600)
    for cfg in results[0]:
        for rank, res in enumerate(results):
            assert not res[cfg][0], f"rank {rank} {cfg}: " + "\n".join(res[cfg][0])
        # Every rank walked the same schedule, whatever modules it ran (Note [Stage-3 schedule]).
        assert len({res[cfg][1] for res in results}) == 1, f"{cfg}: gathers per rank differ"


@pytest.mark.isa_kernels  # the offload case steps CPUAdam: again under every other SIMD variant (test_isa_variants.py)
def test_activation_checkpointing_and_offload_match_ddp():
    configs = [dict(optim="adamw", checkpoint=True, accum="no_sync"), dict(optim="adamw", offload="cpu"),
               dict(optim="sgd", checkpoint=True, reshard=False)]
    results = run_ranks(_matrix, 2, configs, timeout=600)
    for cfg in results[0]:
        for rank, res in enumerate(results):
            assert not res[cfg][0], f"rank {rank} {cfg}: " + "\n".join(res[cfg][0])


# ------------------------------------------------- a weight no backward formula saves
def _unsaved_weights(rank, world_size):
    """An untied embedding (as GPT-2's position embedding) alone in its bucket: backward never unpacks it (the
    embedding's backward does not save its weight), yet autograd lays its gradient out like the parameter, so
    the bucket must be whole when the gradient lands (Note [Parameters between gathers])."""
    import shardopt

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 24), torch.nn.Linear(24, 53), torch.nn.ReLU(),
                               torch.nn.Linear(53, VOCAB))
    ref_model = copy.deepcopy(base)
    ref, ref_opt = DDP(ref_model), torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    model = copy.deepcopy(base)
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=1e-2, stage=3,
                                    reduce_bucket_size=900)
    wrapper = shardopt.ShardedDDP(model, opt)
    failures = []
    for step in range(3):
        x, y = batch(step, rank)
        for w, o in ((ref, ref_opt), (wrapper, opt)):
            torch.nn.functional.cross_entropy(w(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
            o.step()
            o.zero_grad()
    with opt.full_params(writeback=False):
        for (n, a), b in zip(ref_model.named_parameters(), model.parameters()):
            if (a - b).abs().max() > 1e-5 * a.abs().max().clamp_min(1.0):
                failures.append(n)
    alone = [b for b in opt.layout.buckets if b.params == (0,)]  # the embedding's bucket holds nothing else
    return failures, len(alone)


def test_a_parameter_whose_weight_backward_does_not_save():
    for failures, alone in run_ranks(_unsaved_weights, 2, timeout=120):
        assert not failures and alone == 1, (failures, alone)


# ------------------------------------------------------------ a rank that skips
def _one_rank_branches(rank, world_size):
    """Rank 0 runs expert 0 in every step; rank 1 never does (nor any expert)."""
    import shardopt

    torch.manual_seed(0)
    model = StackNet()
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=3, reduce_bucket_size=300)
    wrapper = shardopt.ShardedDDP(model, opt)
    for step in range(3):
        x, y = batch(step, rank)
        loss = torch.nn.functional.cross_entropy(wrapper(x, 0 if rank == 0 else None).reshape(-1, VOCAB),
                                                 y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    shard = opt.store
    gathers = shard.num_gathers
    # Note [The seam between forward and backward]: a forward whose backward follows keeps the buckets
    # the backward starts with, and the backward does not gather them again; a no-grad forward keeps none.
    seam = sorted(shard.rounds.schedule.backward[:1 + shard.rounds.prefetch])
    x, y = batch(9, rank)
    with torch.no_grad():
        wrapper(x, None)
    after_eval = [b for b, st in enumerate(shard.buckets.state) if st != "free"]
    loss = torch.nn.functional.cross_entropy(wrapper(x, None).reshape(-1, VOCAB), y.reshape(-1))
    after_forward = [b for b, st in enumerate(shard.buckets.state) if st != "free"]
    loss.backward()
    opt.step()
    n = len(shard.rounds.schedule.forward)
    return gathers, dict(seam=seam, after_eval=after_eval, after_forward=after_forward,
                         eval_and_step=shard.num_gathers - gathers, want=n + 2 * n - len(seam))


def test_a_rank_that_skips_a_module_does_not_hang():
    # If gathers followed module calls, rank 0 would wait in expert 0's gather for a rank that never
    # issues it (DeepSpeed stage 3's hang): with the fixed schedule both ranks issue the same gathers.
    t0 = time.perf_counter()
    results = run_ranks(_one_rank_branches, 2, timeout=120, collective_timeout=20)
    assert results[0][0] == results[1][0] > 0
    assert time.perf_counter() - t0 < 60
    for gathers, seam in results:
        assert len(seam["seam"]) == 2 and seam["after_eval"] == [] and seam["after_forward"] == seam["seam"], seam
        assert seam["eval_and_step"] == seam["want"], seam


def _one_bucket_kept_then_freed(rank, world_size):
    """One bucket for the model and room for one (max_live_parameters): the forward keeps it for its backward
    (the seam), and the backward walk cannot move past it while it is live. Rank 0 runs the expert, so all of
    the bucket's gradients arrive and rank 0 frees it; rank 1 skips the expert and holds it to the end. A
    walk that asked "is it free?" there gathered on rank 0 alone, and both ranks hung (found by a randomised
    parity run). Against DDP + AdamW (find_unused_parameters) on the same data."""
    import shardopt

    torch.manual_seed(0)
    base = StackNet(experts=1)  # rank 0 runs every module
    ref_model = copy.deepcopy(base)
    ref = DDP(ref_model, find_unused_parameters=True)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    model = copy.deepcopy(base)
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=1e-2, stage=3,
                                    reduce_bucket_size=10**6, max_live_parameters=10**6)
    wrapper = shardopt.ShardedDDP(model, opt)
    assert len(opt.layout.buckets) == 1 and opt.store.rounds.max_live == 1
    for step in range(3):
        x, y = batch(step, rank)
        for w, o in ((ref, ref_opt), (wrapper, opt)):
            loss = torch.nn.functional.cross_entropy(w(x, 0 if rank == 0 else None).reshape(-1, VOCAB),
                                                     y.reshape(-1))
            loss.backward()
            o.step()
            o.zero_grad()
    with opt.full_params(writeback=False):
        err = max(((p - q).abs().max() / p.abs().max().clamp_min(1e-12)).item()
                  for p, q in zip(ref_model.parameters(), model.parameters()))
    return opt.store.num_gathers, err


def test_a_rank_that_skips_a_module_does_not_hang_when_the_seam_is_freed_first():
    (g0, err0), (g1, err1) = run_ranks(_one_bucket_kept_then_freed, 2, timeout=120, collective_timeout=20)
    assert g0 == g1 > 0 and max(err0, err1) < 1e-5, (g0, g1, err0, err1)


# --------------------------------------------- weights that backward never reads
class _UnreadWeights(torch.nn.Module):
    """Weights whose backward never needs them, each alone in its bucket (Note [Gradients of parameters
    not gathered]): an untied embedding (its backward needs the indices), a first Linear on an input
    without grad (grad_W needs the input only), and nn.MultiheadAttention (reads out_proj directly)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.inp = torch.nn.Linear(7, 16)
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = torch.nn.Linear(16, VOCAB)

    def forward(self, idx, feats):
        h = self.emb(idx) + self.inp(feats)
        return self.out(self.attn(h, h, h, need_weights=False)[0])


def _unread_weights(rank, world_size):
    import shardopt

    torch.manual_seed(0)
    base = _UnreadWeights()
    ref_model = copy.deepcopy(base)
    ref = DDP(ref_model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    model = copy.deepcopy(base)
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=1e-2, stage=3,
                                    reduce_bucket_size=200)
    sharded = shardopt.ShardedDDP(model, opt)
    losses = {"ddp": [], "stage 3": []}
    for step in range(3):
        for key, wrapper, optimizer in (("ddp", ref, ref_opt), ("stage 3", sharded, opt)):
            micro = 2 if step == 1 else 1   # step 1 accumulates: the gradient waits on a placeholder
            for m in range(micro):
                x, y = batch(step, rank, m)
                feats = torch.randn(*x.shape, 7, generator=torch.Generator().manual_seed(step * 10 + rank + m))
                with wrapper.no_sync() if m < micro - 1 else contextlib.nullcontext():
                    loss = torch.nn.functional.cross_entropy(wrapper(x, feats).reshape(-1, VOCAB), y.reshape(-1))
                    loss.backward()
                losses[key].append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
    with opt.full_params(writeback=False):
        errors = {n: ((p - q).abs().max() / p.abs().max()).item()
                  for (n, p), (_, q) in zip(ref_model.named_parameters(), model.named_parameters())}
    return losses, errors, len(opt.layout.buckets), [tuple(p.shape) for p in model.parameters()]


def test_weights_backward_never_reads_match_ddp():
    for losses, errors, buckets, shapes in run_ranks(_unread_weights, 2, timeout=120):
        assert buckets >= 8                                    # nearly one parameter per bucket
        for a, b in zip(losses["ddp"], losses["stage 3"]):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), losses
        assert max(errors.values()) < 1e-5, errors
        assert set(shapes) == {(0,)}                           # the stand-ins went again


# ------------------------------------------------- state dicts, full_params, memory
def _whole_weights(rank, world_size):
    import shardopt

    torch.manual_seed(0)
    eager = StackNet()
    torch.manual_seed(0)
    with torch.device("meta"):
        lazy = StackNet()
    opt = shardopt.ShardedOptimizer(lazy.parameters(), optim=torch.optim.AdamW, stage=3, reduce_bucket_size=300)
    wrapper = shardopt.ShardedDDP(lazy, opt)
    # Trainable and frozen parameters (StackNet has a frozen layer: sharded too, Note [Frozen parameters at
    # stage 3]); the store's layout holds both once the wrapper took the module.
    out = {"total": opt.store.layout.total_numel * 4, "trainable": opt.layout.total_numel * 4,
           "peak_at_build": opt.store.peak_live}
    # A meta-device model built shard by shard gets the values an eager build gets (same seed).
    sd = wrapper.module.state_dict()                      # whole, copies (a collective)
    out["state_dict vs eager"] = [k for k, v in eager.state_dict().items() if not torch.equal(v, sd[k])]
    out["freed after state_dict"] = opt.store.live_bytes()
    out["between uses"] = [tuple(p.shape) for p in lazy.parameters()]  # frozen ones too
    # load_state_dict writes every rank's chunk; full_params(writeback) too (an EMA-style write).
    new = {k: v + 1 if v.is_floating_point() else v for k, v in sd.items()}
    wrapper.module.load_state_dict(new)
    with opt.full_params(), torch.no_grad():
        out["after load"] = [k for k, v in lazy.state_dict().items() if not torch.equal(v, new[k])]
        lazy.head.weight.mul_(2)                          # tied: the embedding too
    with opt.full_params(writeback=False), torch.no_grad():
        out["writeback"] = torch.equal(lazy.emb.weight, new["emb.weight"] * 2)
        lazy.emb.weight.zero_()                           # not written back
    with opt.full_params(writeback=False):
        out["no writeback"] = torch.equal(lazy.emb.weight, new["emb.weight"] * 2)
    # One step: masters took the loaded values (they are what the optimizer steps).
    x, y = batch(0, rank)
    torch.nn.functional.cross_entropy(wrapper(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    opt.step()
    out["stats"] = opt.memory_stats()
    # param_init_fn replaces reset_parameters() while materialising.
    with torch.device("meta"):
        other = StackNet()
    opt2 = shardopt.ShardedOptimizer(other.parameters(), optim=torch.optim.SGD, lr=0.1, stage=3,
                                     reduce_bucket_size=300)
    shardopt.ShardedDDP(other, opt2, param_init_fn=lambda m: [p.data.fill_(0.5) for p in m.parameters(recurse=False)])
    with opt2.full_params(writeback=False):
        out["param_init_fn"] = all(bool((p == 0.5).all()) for p in other.parameters())
    return out


def test_meta_init_state_dicts_and_full_params():
    for rank, out in enumerate(run_ranks(_whole_weights, 2, timeout=240)):
        assert out["state_dict vs eager"] == [], (rank, out["state_dict vs eager"])
        assert out["peak_at_build"] < out["total"] / 2, out     # never the whole model at once
        assert out["freed after state_dict"] == 0
        assert set(out["between uses"]) == {(0,)}, out["between uses"]  # Note [Parameters between gathers]
        assert out["after load"] == [], out["after load"]
        assert out["writeback"] and out["no writeback"]
        assert out["param_init_fn"]
        # Between steps a rank holds its chunks only: a half of the padded model at 2 ranks, frozen layer included.
        assert out["total"] > out["trainable"], out
        assert out["stats"]["params"] == out["total"] // 2, out["stats"]


# ------------------------------------------------------------- one rank
def _one_rank(rank, world_size):
    """World size 1: the chunk is the whole bucket, so a gather is no copy (Note [One rank holds the whole
    bucket] in zero3/buckets.py). Parity with DDP on every knob that changes the walk, the parameters inside a
    forward living in this rank's chunks themselves, and full_params / state dicts as with several ranks."""
    import shardopt

    out = {"matrix": _matrix(rank, world_size, [CONFIGS[k] for k in (0, 3, 4, 5)])}
    torch.manual_seed(0)
    model = StackNet()
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=3, reduce_bucket_size=300,
                                    param_persistence_threshold=100)
    wrapper = shardopt.ShardedDDP(model, opt)
    chunks = {c.untyped_storage()._cdata for c in opt.store.every_chunk}  # frozen buckets' chunks too
    seen = []

    def look(mod, args):
        seen.extend(p.untyped_storage()._cdata in chunks for p in mod.parameters(recurse=False) if p.numel())

    handles = [m.register_forward_pre_hook(look) for m in model.modules()]
    for step in range(2):
        x, y = batch(step, rank)
        torch.nn.functional.cross_entropy(wrapper(x, expert_of(step, rank)).reshape(-1, VOCAB),
                                          y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    for h in handles:
        h.remove()
    out["in the chunks"] = (len(seen), sum(seen))
    out["bytes gathered"] = opt.store.peak_live
    out["whole"] = _whole_weights(rank, world_size)
    return out


def test_one_rank_gathers_no_copy():
    out = run_ranks(_one_rank, 1, timeout=300)[0]
    for cfg, (failures, _) in out["matrix"].items():
        assert not failures, f"{cfg}: " + "\n".join(failures)
    n, inside = out["in the chunks"]
    assert n > 0 and inside == n, out["in the chunks"]  # every parameter a forward used was its chunk
    assert out["bytes gathered"] == 0                    # nothing held beyond the shard
    whole = out["whole"]
    assert whole["state_dict vs eager"] == [] and whole["after load"] == [], whole
    assert whole["freed after state_dict"] == 0 and set(whole["between uses"]) == {(0,)}, whole
    assert whole["writeback"] and whole["no writeback"] and whole["param_init_fn"], whole
    assert whole["stats"]["params"] == whole["total"], whole["stats"]  # the whole model, nothing more


# ------------------------------------------------------------- low precision
def _low_precision(rank, world_size, dtype):
    """A bf16 / fp16 (loss-scaled) StackNet at stage 3 and at stage 2: the same master-weight math."""
    import shardopt

    runs = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = StackNet().to(dtype)
        opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=5e-2, momentum=0.9,
                                        stage=stage, reduce_bucket_size=300)
        wrapper = shardopt.ShardedDDP(model, opt)
        losses = []
        for step in range(6):
            x, y = batch(step, rank)
            loss = torch.nn.functional.cross_entropy(wrapper(x, expert_of(step, rank)).float().reshape(-1, VOCAB),
                                                     y.reshape(-1))
            opt.scale_loss(loss).backward()
            opt.clip_grad_norm(1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        opt.consolidate_state_dict(to=0)
        with opt.full_params(writeback=False):
            weights = [p.detach().float().clone() for p in model.parameters()]
        runs[stage] = (losses, weights, opt.state_dict() if rank == 0 else None, opt.loss_scale)
    return runs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_stage3_matches_stage2(dtype):
    for rank, runs in enumerate(run_ranks(_low_precision, 2, dtype, timeout=300)):
        (l2, w2, s2, scale2), (l3, w3, s3, scale3) = runs[2], runs[3]
        assert scale2 == scale3
        # Low-precision stage 3 against plain PyTorch is test_mixed_precision.py's (AwkwardNet, bf16 AdamW and
        # fp16 loss-scaled SGD: bit for bit at 2 ranks). This adds StackNet (blocks gathered on their own,
        # experts one rank skips) under clipping, against stage 2: the global norm is summed over shards cut
        # differently at the two stages (stage 3's buckets hold whole parameters), so the clip coefficients
        # differ in their last bits, and a master near a rounding boundary then rounds into the model an ulp
        # apart; these bars are measured, not derived (the fp32 masters are what both step).
        for a, b in zip(l2, l3):
            assert abs(a - b) <= 1e-2 * max(1.0, abs(a)), (rank, l2, l3)
        for a, b in zip(w2, w3):
            assert (a - b).abs().max() <= 2e-2 * a.abs().max().clamp_min(1e-3), rank
        if rank == 0:
            for k, st in s2["state"].items():
                for key, v in st.items():
                    if torch.is_tensor(v) and v.numel() > 1:
                        err = (v - s3["state"][k][key]).abs().max() / v.abs().max().clamp_min(1e-12)
                        assert err <= 1e-3, (k, key, float(err))


# ------------------------------------------------------------------ staging pool
def _staging_pool(rank, world_size, impl):
    import shardopt

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(16)])
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=3, comm_impl=impl,
                                    reduce_bucket_size=64 * 65)
    wrapper = shardopt.ShardedDDP(model, opt)
    for _ in range(3):
        wrapper(torch.randn(4, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    return opt.engine.num_staging_buffers, len(opt.layout.buckets)


@pytest.mark.parametrize("impl", ["ring", "native"])
def test_stage3_staging_pool_stays_small(impl):
    # Stage 3 takes a staging buffer back once its reduce-scatter says it is done, and grows the pool when
    # none does soon (Note [Stage 3 never waits in backward]). gloo's own reduce-scatter never said so: with
    # comm_impl="native" the pool grew to a buffer per bucket, a whole model's gradient (Note [gloo's
    # reduce-scatter copies on every wait] in csrc/comm/gloo_reduce_scatter.h).
    for staging, buckets in run_ranks(_staging_pool, 2, impl):
        assert buckets == 16 and staging <= 4, (impl, staging, buckets)


SLOW_STEP = 1


def _slow_step(rank, world_size, slow):
    """Stage 3 with rank 1 asleep at the start of backward in step SLOW_STEP (when `slow`): rank 0's
    reduce-scatters then lag and its staging pool grows. Returns the pool's bytes at construction, at each
    step's start, at the end of each step's backward (before flush), and the final weights."""
    import shardopt

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(16)])
    # Parameters stay gathered from forward to backward: backward waits for no gather, only reduce-scatters
    # lag, and the 16 buckets' reductions are all that the sleeping rank holds back.
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=3, lr=1e-2,
                                    reduce_bucket_size=64 * 65, num_staging_buffers=2,
                                    reshard_after_forward=False)
    wrapper = shardopt.ShardedDDP(model, opt)
    built, at_start, in_backward = opt.memory_stats()["staging"], [], []
    # The first layer's weight gets its gradient last in backward: the pool as backward leaves it.
    model[0].weight.register_hook(lambda g: in_backward.append(opt.memory_stats()["staging"]))
    for step in range(3):
        at_start.append(opt.memory_stats()["staging"])
        torch.manual_seed(100 + 10 * step + rank)
        out = wrapper(torch.randn(4, 64))
        if slow and rank == 1 and step == SLOW_STEP:
            out.register_hook(lambda g: time.sleep(0.5))  # far past the engine's 20 ms patience
        out.sum().backward()
        opt.step()
        opt.zero_grad()
    at_start.append(opt.memory_stats()["staging"])
    with opt.full_params(writeback=False):
        weights = [p.detach().clone() for p in model.parameters()]
    return built, at_start, in_backward, weights


def test_stage3_staging_pool_returns_to_its_bound_after_a_slow_step():
    """Issue 73: the pool grows while a peer's reduce-scatters lag (Note [Stage 3 never waits in backward]) and
    gives the growth back once the backward's reductions are done (Note [The staging pool between backward
    passes] in csrc/comm/bucket_engine.cpp): by the next step's start it is num_staging_buffers again, and the
    weights are those of the same run without the slow step, bit for bit."""
    slow = run_ranks(_slow_step, 2, True, timeout=120)
    even = run_ranks(_slow_step, 2, False, timeout=120)
    built, at_start, in_backward, _ = slow[0]
    assert built > 0, slow[0][:3]
    # Rank 0 did not sleep: its reductions waited for rank 1, so the pool grew during the slow step's backward.
    assert in_backward[SLOW_STEP] > built, (built, at_start, in_backward)
    for rank, (built, at_start, _, _) in enumerate(slow + even):
        assert at_start == [built] * len(at_start), (rank % 2, built, at_start)
    for (_, _, _, ws), (_, _, _, we) in zip(slow, even):
        assert all(torch.equal(a, b) for a, b in zip(ws, we))


def _inference(rank, world_size):
    """A frozen StackNet sharded for inference against the same model whole: (failures, facts)."""
    import shardopt

    torch.manual_seed(0)
    whole = StackNet().requires_grad_(False)
    model = copy.deepcopy(whole)
    ref = shardopt.shard_for_inference(model, reduce_bucket_size=300, param_persistence_threshold=30)
    store, failures = ref._store, []

    def held():  # bytes of the model's parameters on this rank: their storages, and the chunks behind them
        storages = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in model.parameters()}
        return sum(storages.values()) + ref.memory_stats()["shard"]

    total = sum(p.numel() * p.element_size() for p in whole.parameters())
    facts = {"held": held(), "whole": total, "buckets": len(store.layout.buckets)}

    def check(step, expert, grad=False):
        x, _ = batch(step, rank)
        with torch.no_grad():
            want = whole(x, expert)
        with contextlib.nullcontext() if grad else torch.no_grad():
            got = ref(x, expert=expert)
        if not torch.equal(got, want) or got.requires_grad:
            failures.append(f"step {step} expert {expert}: differs by {(got - want).abs().max():.3e}")
        if held() != facts["held"]:
            failures.append(f"step {step}: {held()} bytes held after a forward, {facts['held']} before")

    # The same forwards on every rank (experts some ranks skip), one under grad mode (its input needs none).
    for step in range(3):
        check(step, expert_of(step, rank), grad=step == 1)
    # Different numbers of forwards per rank (3 on rank 0, 1 on the others), then sync(): no hang, and every
    # rank has issued the same gathers.
    for step in range(3 if rank == 0 else 1):
        check(10 + step, None)
    ref.sync()
    ref.sync()  # twice in a row: a no-op pair, not a skipped exchange
    check(20, 1)
    facts["gathers"] = store.num_gathers
    facts["peak_gathered"] = ref.memory_stats()["peak_gathered"]
    state = ref.state_dict()
    if sorted(state) != sorted(f"module.{k}" for k in whole.state_dict()) or not all(
            torch.equal(state[f"module.{k}"], v) for k, v in whole.state_dict().items()):
        failures.append("state_dict() is not the whole model's")
    if held() != facts["held"]:
        failures.append("state_dict() left parameters gathered")
    # Refused, naming the problem (all before any collective).
    x, _ = batch(0, rank)
    emb = whole.emb(x).requires_grad_()
    linear = shardopt.shard_for_inference(torch.nn.Linear(DIM, DIM).requires_grad_(False))
    refusals = [(lambda: linear(emb), RuntimeError, "input that requires grad"),
                (lambda: ref.module.blocks[0](emb), RuntimeError, "called on its own under grad mode"),
                (lambda: shardopt.shard_for_inference(StackNet(), stage=3), ValueError, "requires grad"),
                (lambda: shardopt.shard_for_inference(copy.deepcopy(whole), stage=2), ValueError, "stage 3"),
                (lambda: shardopt.shard_for_inference(copy.deepcopy(whole), offload="cpu"), TypeError, "offload"),
                (lambda: shardopt.shard_for_inference(model), ValueError, "already")]
    policy = torch.nn.Linear(DIM, DIM)  # a trained model holding the frozen one inside (its ShardedDDP would
    opt = shardopt.ShardedOptimizer(policy.parameters(), torch.optim.SGD, lr=0.1, stage=1)  # take its params)
    refusals.append((lambda: shardopt.ShardedDDP(torch.nn.ModuleDict({"policy": policy, "ref": ref}), opt),
                     ValueError, "submodule 'ref' is sharded for inference"))
    for call, error, says in refusals:
        try:
            call()
            failures.append(f"not refused: {says}")
        except error as e:
            if says not in str(e):
                failures.append(f"refused without saying {says!r}: {e}")
    return failures, facts


def test_a_frozen_model_sharded_for_inference():
    """shardopt.shard_for_inference (Note [Models sharded for inference]): a frozen StackNet at 2 ranks gives the
    whole model's outputs bit for bit (experts some ranks skip, a forward under grad mode), each rank holds its
    chunks (about 1/2 of the model's bytes) and nothing else between forwards, ranks that ran 3 and 1 forwards
    meet at sync() with the same gathers, state_dict() is the whole model's, and bad input is refused by name."""
    ranks = run_ranks(_inference, 2, timeout=120)
    for rank, (failures, facts) in enumerate(ranks):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)
        # Its chunks (padded to 128 elements per bucket and rank) plus the persistent norm parameters.
        assert facts["held"] <= facts["whole"] / 2 + facts["buckets"] * 128 * 4 + 2 * 24 * 4, facts
        assert facts["peak_gathered"] < facts["whole"], facts
    assert ranks[0][1]["gathers"] == ranks[1][1]["gathers"], [f for _, f in ranks]
    print(f"\ninference shard of StackNet at 2 ranks: {[f for _, f in ranks]}")
