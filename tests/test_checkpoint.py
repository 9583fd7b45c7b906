"""Checkpoints: resume at other world sizes / buckets / stages, torch.optim-format state, crashes, damage.

Training must continue as if never interrupted, so every run here sees the
same global batch whatever the world size (each rank takes its slice of 6
sequences) and keeps BatchNorm in eval mode (batch statistics would depend on
how the batch is split). The reference is one uninterrupted run at world size
2; a resumed run at the same world size and layout must match it bitwise,
others within 1e-6 relative (they sum gradients in another order). Resumed
runs build their model from another seed, so anything not restored shows.
Both SGD with momentum (gradient scale matters) and AdamW run on AwkwardNet
(tied, frozen, unused parameters, sizes not divisible by 2 or 3).
"""
import os
import shutil
import signal

import pytest
import torch
from torch import nn

from dist_harness import RankFailure, run_ranks
from models import VOCAB, AwkwardNet, batch, uses_branch

GLOBAL_BATCH = 6
OPTIMS = {
    "sgd": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9, weight_decay=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
}


def _param_groups(model):
    return [{"params": [p for p in model.parameters() if p.ndim >= 2]},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]


def _model(seed):
    torch.manual_seed(seed)
    model = AwkwardNet()
    model.norm.running_mean.normal_()   # buffers worth restoring
    model.norm.running_var.uniform_(0.5, 2.0)
    return model.eval()


def _build(optim, seed, stage=2, rbs=300):
    import shardopt

    model = _model(seed)
    cls, kw = OPTIMS[optim]
    opt = shardopt.ShardedOptimizer(_param_groups(model), optim=cls, stage=stage, reduce_bucket_size=rbs, **kw)
    wrapper = shardopt.ShardedDDP(model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, wrapper, sched


def _loss(model, step, rank, world_size):
    x, y = batch(step, 0, bsz=GLOBAL_BATCH)
    n = GLOBAL_BATCH // world_size
    x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    # The branch is used on some steps only, by every rank: an unused parameter's
    # step count lags, and the checkpoint must keep that.
    return nn.functional.cross_entropy(model(x, uses_branch(step, 0)).reshape(-1, VOCAB), y.reshape(-1))


def _train(wrapper, opt, sched, steps, rank, world_size):
    for step in steps:
        _loss(wrapper, step, rank, world_size).backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def _snapshot(model, opt):
    """Model state and the consolidated torch.optim state dict (None except on rank 0)."""
    opt.consolidate_state_dict(to=0)
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": opt.state_dict() if opt.rank == 0 else None}


def _differences(a, b, rtol):
    """Where two snapshots differ by more than rtol (max-abs error relative to max-abs value)."""
    out = []

    def cmp(where, x, y):
        if torch.is_tensor(x):
            if x.shape != y.shape or x.dtype != y.dtype:
                out.append(f"{where}: {x.shape}/{x.dtype} vs {y.shape}/{y.dtype}")
            elif rtol == 0:
                if not torch.equal(x, y):
                    out.append(f"{where}: not bitwise equal")
            else:
                err = ((x.double() - y.double()).abs().max() / x.double().abs().max().clamp_min(1e-12)).item()
                if err > rtol:
                    out.append(f"{where}: relative error {err:.2e}")
        elif isinstance(x, dict):
            if set(x) != set(y):
                out.append(f"{where}: keys {sorted(x, key=str)} vs {sorted(y, key=str)}")
            for k in x:
                if k in y:
                    cmp(f"{where}.{k}", x[k], y[k])
        elif isinstance(x, (list, tuple)):
            if len(x) != len(y):
                out.append(f"{where}: lengths {len(x)} vs {len(y)}")
            for i, (u, v) in enumerate(zip(x, y)):
                cmp(f"{where}[{i}]", u, v)
        elif x != y:
            out.append(f"{where}: {x!r} vs {y!r}")

    cmp("", a, b)
    return out


# --------------------------------------------------- resume at any world size
def _straight_and_save(rank, world_size, root):
    """The reference: 8 uninterrupted steps, saving after 4; then a same-size resume in fresh objects."""
    import shardopt

    out = {}
    for name in OPTIMS:
        model, opt, wrapper, sched = _build(name, seed=0)
        _train(wrapper, opt, sched, range(4), rank, world_size)
        snap4 = _snapshot(model, opt)
        shardopt.save_checkpoint(os.path.join(root, name), wrapper, opt, extra={"sched": sched.state_dict()})
        _train(wrapper, opt, sched, range(4, 8), rank, world_size)
        snap8 = _snapshot(model, opt)
        # Same world size, same layout: new objects from another seed, load, continue: bitwise.
        model, opt, wrapper, sched = _build(name, seed=1)
        sched.load_state_dict(shardopt.load_checkpoint(os.path.join(root, name), wrapper, opt)["sched"])
        _train(wrapper, opt, sched, range(4, 8), rank, world_size)
        out[name] = {"snap4": snap4, "snap8": snap8,
                     "same_size_resume": _differences(snap8, _snapshot(model, opt), rtol=0)}
    return out


def _resume(rank, world_size, root, stage, rbs, full_dicts):
    """New processes, another world size / stage / bucket size: load, then 4 more steps."""
    import shardopt

    out = {}
    for name in OPTIMS:
        model, opt, wrapper, sched = _build(name, seed=1, stage=stage, rbs=rbs)
        extra = shardopt.load_checkpoint(os.path.join(root, name), wrapper, opt)
        sched.load_state_dict(extra["sched"])
        loaded = _snapshot(model, opt)
        # The same step-4 state through a whole torch.optim state dict, every rank taking its ranges.
        model2, opt2, wrapper2, _ = _build(name, seed=2, stage=stage, rbs=rbs)
        model2.load_state_dict(full_dicts[name]["model"])
        opt2.load_state_dict(full_dicts[name]["optim"])
        via_full_dict = _differences(loaded, _snapshot(model2, opt2), rtol=0)
        _train(wrapper, opt, sched, range(4, 8), rank, world_size)
        out[name] = {"loaded": loaded, "via_full_dict": via_full_dict, "snap8": _snapshot(model, opt)}
    return out


def _plain_torch_continues(converted, steps):
    """One process, plain torch: the converted checkpoint's weights and AdamW state, 4 more steps."""
    model = _model(seed=3)
    model.load_state_dict(converted["model"])
    cls, kw = OPTIMS["adamw"]
    opt = cls(_param_groups(model), **kw)
    opt.load_state_dict(converted["optimizer"])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    sched.load_state_dict(converted["extra"]["sched"])
    _train(model, opt, sched, steps, 0, 1)
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def test_resume_at_any_world_size(tmp_path):
    import shardopt.cli

    root = str(tmp_path)
    ref = run_ranks(_straight_and_save, 2, root)[0]
    for name in OPTIMS:
        assert ref[name]["same_size_resume"] == [], (name, ref[name]["same_size_resume"])
    full = {name: ref[name]["snap4"] for name in OPTIMS}
    for world_size, stage, rbs in ((3, 1, 1000), (1, 2, 10**7)):
        got = run_ranks(_resume, world_size, root, stage, rbs, full)[0]
        for name in OPTIMS:
            where = f"{name} at world size {world_size}"
            # What was loaded is exactly what was saved, whatever the world size.
            assert _differences(ref[name]["snap4"], got[name]["loaded"], rtol=0) == [], where
            assert got[name]["via_full_dict"] == [], (where, got[name]["via_full_dict"])
            assert _differences(ref[name]["snap8"], got[name]["snap8"], rtol=1e-6) == [], where

    # `python -m shardopt convert`: the same torch.optim state as consolidation; plain AdamW continues.
    out = os.path.join(root, "adamw.pt")
    assert shardopt.cli.main(["convert", os.path.join(root, "adamw"), out]) == 0
    converted = torch.load(out, weights_only=True)
    assert _differences(ref["adamw"]["snap4"]["optim"], converted["optimizer"], rtol=0) == []
    assert _differences(ref["adamw"]["snap4"]["model"], converted["model"], rtol=0) == []
    # Tied names share one tensor, as in the model.
    assert converted["model"]["head.weight"].data_ptr() == converted["model"]["emb.weight"].data_ptr()
    plain = _plain_torch_continues(converted, range(4, 8))
    assert _differences(ref["adamw"]["snap8"], plain, rtol=1e-6) == []
