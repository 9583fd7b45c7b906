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

Spawning ranks dominates the run time, so one reference run (the `reference`
fixture) feeds every test, and each resumed run also tries the faults that
need a checkpoint: the reference run ends with a rank SIGKILLed halfway
through a save, so every resume also shows that the previous checkpoint still
loads; the world-size-3 run first tries damaged copies of it.
"""
import copy
import os
import shutil
import signal

import pytest
import torch
from torch import nn

from dist_harness import RankFailure, run_ranks
from models import VOCAB, AwkwardNet, batch, uses_branch
from same_state import snapshot as _snapshot

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


def _build(name, seed, stage=2, rbs=300, dtype=torch.float32, **options):
    import shardopt

    model = _model(seed).to(dtype)
    cls, kw = OPTIMS[name]
    kw = dict(kw, **{"optim": cls, **options})  # options may override optim (None: the default)
    opt = shardopt.ShardedOptimizer(_param_groups(model), stage=stage, reduce_bucket_size=rbs, **kw)
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


# ------------------------------------------------------- the reference run
def _reference(rank, world_size, root, out):
    """8 uninterrupted steps saving after 4; a same-size resume; then rank 1 dies in a second save."""
    import shardopt
    import shardopt.checkpoint.save_load

    results = {}
    for name in OPTIMS:
        path = os.path.join(root, name)
        model, opt, wrapper, sched = _build(name, seed=0)
        _train(wrapper, opt, sched, range(4), rank, world_size)
        snap4 = _snapshot(model, opt)
        shardopt.save_checkpoint(path, wrapper, opt, extra={"sched": sched.state_dict()})
        _train(wrapper, opt, sched, range(4, 8), rank, world_size)
        try:  # consolidated before 4 steps (on rank 0 only): stale, so state_dict() refuses
            opt.state_dict()
            results[f"{name} stale state_dict"] = None
        except RuntimeError as e:
            results[f"{name} stale state_dict"] = str(e)
        snap8 = _snapshot(model, opt)
        # Same world size, same layout: new objects from another seed, load, continue: bitwise.
        model2, opt2, wrapper2, sched2 = _build(name, seed=1)
        sched2.load_state_dict(shardopt.load_checkpoint(path, wrapper2, opt2)["sched"])
        _train(wrapper2, opt2, sched2, range(4, 8), rank, world_size)
        results[name] = {"snap4": snap4, "snap8": snap8,
                         "same_size_resume": _differences(snap8, _snapshot(model2, opt2), rtol=0)}

    # Saving over an existing tag is refused on every rank, and writes nothing.
    before = sorted(os.listdir(path))
    try:
        shardopt.save_checkpoint(path, wrapper, opt, tag="ckpt-000001")
        results["tag exists"] = None
    except shardopt.CheckpointError as e:
        results["tag exists"] = str(e)
    results["tag exists: wrote"] = sorted(os.listdir(path)) != before
    if rank == 0:
        torch.save(results, out)
    torch.distributed.barrier()  # the results are on disk before anyone dies

    # The crash: rank 1 is SIGKILLed halfway through writing the step-8 checkpoint.
    if rank == 1:
        class Dying(shardopt.checkpoint.save_load.RecordWriter):
            def add(self, t):
                ref = super().add(t)
                self._f.flush()
                os.kill(os.getpid(), signal.SIGKILL)  # mid-file: no cleanup, no goodbye
                return ref

        shardopt.checkpoint.save_load.RecordWriter = Dying
    shardopt.save_checkpoint(path, wrapper, opt, extra={"sched": sched.state_dict()})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    out = os.path.join(root, "reference.pt")
    with pytest.raises(RankFailure) as info:
        run_ranks(_reference, 2, root, out, timeout=240, collective_timeout=10)
    return root, torch.load(out, weights_only=False), str(info.value)


def test_same_world_size_resume_is_bitwise(reference):
    _, ref, _ = reference
    for name in OPTIMS:
        assert ref[name]["same_size_resume"] == [], (name, ref[name]["same_size_resume"])
    assert "already exists" in ref["tag exists"] and not ref["tag exists: wrote"], ref["tag exists"]
    for name in OPTIMS:
        assert "consolidate_state_dict(to=RANK)" in ref[f"{name} stale state_dict"]


def test_rank_killed_during_save_leaves_previous_checkpoint(reference):
    root, _, msg = reference
    assert "rank 1 died with exit code -9" in msg, msg
    # Rank 0 raised (it did not hang until the launcher's deadline), saying a peer is gone.
    assert "--- rank 0 ---" in msg and "did not finish" not in msg, msg
    assert "Connection" in msg or "peer" in msg, msg
    path = os.path.join(root, "adamw")
    assert open(os.path.join(path, "latest")).read().strip() == "ckpt-000001"
    assert os.path.isdir(os.path.join(path, ".partial-ckpt-000002"))  # the crashed save, ignored
    # ...and the resumes below load ckpt-000001 from this very directory.


# ------------------------------------------------ resumes at other world sizes
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


def _check_resumed(ref, got, world_size):
    for name in OPTIMS:
        where = f"{name} at world size {world_size}"
        # What was loaded is exactly what was saved, whatever the world size.
        assert _differences(ref[name]["snap4"], got[name]["loaded"], rtol=0) == [], where
        assert got[name]["via_full_dict"] == [], (where, got[name]["via_full_dict"])
        assert _differences(ref[name]["snap8"], got[name]["snap8"], rtol=1e-6) == [], where


def _damage(src, dst, name, how):
    """A copy of checkpoint src/adamw/ckpt-000001, under dst, with file `name` damaged; returns the copy."""
    dst = os.path.join(dst, f"damaged-{how}")
    shutil.copytree(os.path.join(src, "adamw", "ckpt-000001"), dst)
    path = os.path.join(dst, name)
    data = bytearray(open(path, "rb").read())
    if how == "flip":
        data[len(data) // 2] ^= 0x40
    elif how == "truncate":
        data = data[:len(data) // 2]
    elif how == "manifest":
        data = data.replace(b'"stage":2', b'"stage":1')  # still valid JSON: only the checksum can tell
    assert data != open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data)
    return dst


def _damaged_then_resume(rank, world_size, root, bad, full_dicts):
    """Every damaged checkpoint is refused on every rank, changing nothing; then the resume."""
    import shardopt

    model, opt, wrapper, sched = _build("adamw", seed=1, stage=1, rbs=1000)
    _train(wrapper, opt, sched, range(1), rank, world_size)  # state that must survive
    before = _snapshot(model, opt)
    errors = {}
    for what, path in bad.items():
        try:
            shardopt.load_checkpoint(path, wrapper, opt)
            errors[what] = None
        except shardopt.CheckpointError as e:
            errors[what] = str(e)
        errors[what + ": changed"] = _differences(before, _snapshot(model, opt), rtol=0)
    # Another model: a layer more, one less, one of another shape.
    other = _model(seed=1)
    other.l2 = nn.Linear(53, 25)
    other.extra_layer = nn.Linear(3, 3)
    del other.branch
    other_opt = shardopt.ShardedOptimizer(other.parameters(), optim=torch.optim.AdamW, reduce_bucket_size=1000)
    try:
        shardopt.load_checkpoint(os.path.join(root, "adamw"), shardopt.ShardedDDP(other, other_opt), other_opt)
        errors["other model"] = None
    except shardopt.CheckpointError as e:
        errors["other model"] = str(e)
    return errors, _resume(rank, world_size, root, 1, 1000, full_dicts)


def test_resume_at_world_size_3_refusing_damaged_checkpoints(reference, tmp_path):
    root, ref, _ = reference
    bad = {"flipped byte": _damage(root, str(tmp_path), "rank-00001.bin", "flip"),
           "truncated": _damage(root, str(tmp_path), "rank-00000.bin", "truncate"),
           "edited manifest": _damage(root, str(tmp_path), "manifest.json", "manifest"),
           "no checkpoint": str(tmp_path)}
    results = run_ranks(_damaged_then_resume, 3, root, bad, {n: ref[n]["snap4"] for n in OPTIMS})
    needles = {"flipped byte": "checksum mismatch", "truncated": "truncated",
               "edited manifest": "manifest is corrupted", "no checkpoint": "no checkpoint at"}
    for rank, (errors, _) in enumerate(results):
        for what, needle in needles.items():
            assert errors[what] is not None, f"rank {rank}: {what} loaded"
            assert errors[what + ": changed"] == [], (rank, what, errors[what + ": changed"])
            # The rank that read the damage names it; the others say which rank failed.
            assert needle in errors[what] or "failed, so every rank stops" in errors[what], (rank, errors[what])
        assert any(needle in errors[what] for errors, _ in results), (what, [e[what] for e, _ in results])
        other = errors["other model"]
        assert "missing from the checkpoint: extra_layer.bias, extra_layer.weight" in other, other
        assert "unexpected (in the checkpoint, not in this model): branch.bias, branch.weight" in other, other
        assert "mis-shaped: l2.bias (checkpoint [24], model [25])" in other, other
    _check_resumed(ref, results[0][1], 3)


def _resume_then_save(rank, world_size, root, full_dicts):
    import shardopt

    out = _resume(rank, world_size, root, 2, 10**7, full_dicts)
    model, opt, wrapper, sched = _build("adamw", seed=1)
    shardopt.load_checkpoint(os.path.join(root, "adamw"), wrapper, opt)
    # The next save cleans up after the crashed one and takes its tag.
    return out, shardopt.save_checkpoint(os.path.join(root, "adamw"), wrapper, opt)


def _plain_torch_continues(model_state, optim_state, sched_state, steps):
    """One process, plain torch.optim.AdamW from the given state dicts, more steps."""
    model = _model(seed=3)
    model.load_state_dict(model_state)
    cls, kw = OPTIMS["adamw"]
    opt = cls(_param_groups(model), **kw)
    opt.load_state_dict(copy.deepcopy(optim_state))  # torch keeps (and steps) the tensors it is given
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    sched.load_state_dict(sched_state)
    _train(model, opt, sched, steps, 0, 1)
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def test_resume_at_world_size_1_and_convert_to_plain_torch(reference, tmp_path):
    import shardopt.tools.cli

    ref_root, ref, _ = reference
    root = str(tmp_path)
    for name in OPTIMS:  # a copy: this test saves into it
        shutil.copytree(os.path.join(ref_root, name), os.path.join(root, name))
    got, saved = run_ranks(_resume_then_save, 1, root, {n: ref[n]["snap4"] for n in OPTIMS})[0]
    _check_resumed(ref, got, 1)
    assert saved.endswith("ckpt-000002") and ".partial-ckpt-000002" not in os.listdir(os.path.join(root, "adamw"))

    # `python -m shardopt convert`: the same torch.optim state as consolidation.
    out = os.path.join(root, "adamw.pt")
    assert shardopt.tools.cli.main(["convert", os.path.join(root, "adamw"), out, "--tag", "ckpt-000001"]) == 0
    converted = torch.load(out, weights_only=True)
    assert _differences(ref["adamw"]["snap4"]["optim"], converted["optimizer"], rtol=0) == []
    assert _differences(ref["adamw"]["snap4"]["model"], converted["model"], rtol=0) == []
    # Tied names share one tensor, as in the model.
    assert converted["model"]["head.weight"].data_ptr() == converted["model"]["emb.weight"].data_ptr()
    # consolidate_state_dict + state_dict (identical to the converted file, checked above) in plain
    # torch.optim.AdamW on one process: training continues as the sharded run did.
    plain = _plain_torch_continues(ref["adamw"]["snap4"]["model"], ref["adamw"]["snap4"]["optim"],
                                   converted["extra"]["sched"], range(4, 8))
    assert _differences(ref["adamw"]["snap8"], plain, rtol=1e-6) == []


# ------------------------------------------- offload and precision (issue 5)
def _offload_and_bf16(rank, world_size, root, ref):
    import shardopt

    path = os.path.join(root, "adamw")
    out = {}
    # offload="cpu" (CPUAdam on host master chunks by default) loads torch AdamW's state and continues.
    model, opt, wrapper, sched = _build("adamw", seed=1, offload="cpu", optim=None)
    sched.load_state_dict(shardopt.load_checkpoint(path, wrapper, opt)["sched"])
    loaded = _snapshot(model, opt)
    _train(wrapper, opt, sched, range(4, 8), rank, world_size)
    done = _snapshot(model, opt)
    if rank == 0:
        out["offload loaded"] = _differences(
            {"model": ref["snap4"]["model"], "state": ref["snap4"]["optim"]["state"]},
            {"model": loaded["model"], "state": loaded["optim"]["state"]}, rtol=0)
        out["offload continued"] = _differences(
            {"model": ref["snap8"]["model"], "state": ref["snap8"]["optim"]["state"]},
            {"model": done["model"], "state": done["optim"]["state"]}, rtol=1e-5)
    # A bf16 model keeps fp32 masters: loading, saving and loading into fp32 again loses nothing.
    model, opt, wrapper, _ = _build("adamw", seed=1, dtype=torch.bfloat16)
    shardopt.load_checkpoint(path, wrapper, opt)
    loaded = _snapshot(model, opt)
    bf16_path = shardopt.save_checkpoint(os.path.join(root, f"bf16-{world_size}"), wrapper, opt)
    model32, opt32, wrapper32, _ = _build("adamw", seed=2)
    shardopt.load_checkpoint(bf16_path, wrapper32, opt32)
    again = _snapshot(model32, opt32)
    if rank == 0:
        want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in ref["snap4"]["model"].items()}
        out["bf16 model"] = _differences(want, loaded["model"], rtol=0)
        out["bf16 state"] = _differences(ref["snap4"]["optim"]["state"], loaded["optim"]["state"], rtol=0)
        # Trainable parameters come back from the fp32 masters bit for bit; frozen parameters and
        # buffers have no master, so they went through bf16 with the model.
        trainable = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        want = {"model": {k: v if k in trainable or not v.is_floating_point() else v.to(torch.bfloat16).float()
                          for k, v in ref["snap4"]["model"].items()},
                "optim": ref["snap4"]["optim"]}
        out["bf16 round trip"] = _differences(want, again, rtol=0)
    return out


def test_checkpoint_moves_between_offload_and_precision_settings(reference, tmp_path):
    """offload="cpu" loads torch AdamW state into CPUAdam; a bf16 model keeps the fp32 masters bitwise."""
    root, ref, _ = reference
    for name in ("adamw",):
        shutil.copytree(os.path.join(root, name), os.path.join(str(tmp_path), name))
    out = run_ranks(_offload_and_bf16, 2, str(tmp_path), ref["adamw"])[0]
    for what, diffs in out.items():
        assert diffs == [], (what, diffs[:5])



def _edit_then_save(rank, world_size, root):
    import shardopt

    model, opt, wrapper, sched = _build("adamw", seed=1, offload="cpu")
    _train(wrapper, opt, sched, range(2), rank, world_size)
    model.branch.weight.data.fill_(0.5)  # through .data (torch does not count it): the save compares values
    through_data = shardopt.save_checkpoint(os.path.join(root, "through-data"), wrapper, opt)
    with torch.no_grad():
        model.l1.weight.fill_(0.25)  # e.g. pretrained weights copied in: the masters learn of it at the save
    path = shardopt.save_checkpoint(os.path.join(root, "edited"), wrapper, opt)
    out = []
    for saved, name, value in ((through_data, "branch", 0.5), (path, "l1", 0.25)):
        fresh, opt2, wrapper2, _ = _build("adamw", seed=2, offload="cpu")
        shardopt.load_checkpoint(saved, wrapper2, opt2)
        out.append(bool((getattr(fresh, name).weight == value).all()))
    return out + [torch.equal(fresh.l2.weight, model.l2.weight)]


def test_a_weight_edited_in_place_before_a_save_is_saved(tmp_path):
    # Note [Weights edited in place]: with offload the checkpoint holds the fp32 masters, which had not taken
    # an edit made since the last step (through p.data too: Lightning's WeightAveraging puts its average in so).
    for through_data, edited, rest in run_ranks(_edit_then_save, 2, str(tmp_path)):
        assert through_data and edited and rest


# ------------------------------------------------------------------- stage 3
def _stage3_resume_and_save(rank, world_size, root, full_dicts):
    """Stage 3 at world size 3 loads the stage-2 checkpoint (and the whole state dicts), then saves its own."""
    import shardopt

    from shardopt.checkpoint import save_load

    out = _resume(rank, world_size, root, 3, 300, full_dicts)
    model, opt, wrapper, sched = _build("sgd", seed=1, stage=3)
    kept, keep = {}, save_load.keep_other

    def spy(opt, info, name, values):  # what the load keeps of the frozen parameters the store shards
        parts = keep(opt, info, name, values)
        if name in info.held:
            kept[name] = (values.numel(), sum(p.numel() for p in parts))
        return parts

    save_load.keep_other = spy
    try:
        sched.load_state_dict(shardopt.load_checkpoint(os.path.join(root, "sgd"), wrapper, opt)["sched"])
    finally:
        save_load.keep_other = keep
    return out, shardopt.save_checkpoint(os.path.join(root, "stage3"), wrapper, opt,
                                         extra={"sched": sched.state_dict()}), kept


def _stage1_from_stage3(rank, world_size, root):
    import shardopt

    model, opt, wrapper, sched = _build("sgd", seed=2, stage=1, rbs=1000)
    sched.load_state_dict(shardopt.load_checkpoint(os.path.join(root, "stage3"), wrapper, opt)["sched"])
    loaded = _snapshot(model, opt)
    _train(wrapper, opt, sched, range(4, 8), rank, world_size)
    return loaded, _snapshot(model, opt)


def test_stage3_checkpoints_move_between_stages_and_world_sizes(reference, tmp_path):
    ref_root, ref, _ = reference
    root = str(tmp_path)
    for name in OPTIMS:
        shutil.copytree(os.path.join(ref_root, name), os.path.join(root, name))
    # Stage 2 at 2 ranks -> stage 3 at 3 ranks: what was saved is what is loaded, and training goes on.
    results = run_ranks(_stage3_resume_and_save, 3, root, {n: ref[n]["snap4"] for n in OPTIMS})
    got, saved, _ = results[0]
    _check_resumed(ref, got, 3)
    # The frozen parameter, sharded at stage 3, is kept as each rank's parts only until the load applies it
    # (not the whole value on every rank): every element on exactly one rank.
    kept = [r[2] for r in results]
    assert kept[0] and all(k.keys() == kept[0].keys() for k in kept), kept
    for name, (whole, _) in kept[0].items():
        assert sum(k[name][1] for k in kept) == whole, (name, kept)
    largest = max(kept[0], key=lambda n: kept[0][n][0])  # frozen.weight, over 3 ranks' chunks
    assert all(k[largest][1] < k[largest][0] for k in kept), kept
    # Stage 3 at 3 ranks -> stage 1 at 2 ranks, other buckets: the same state, the same continuation.
    loaded, snap8 = run_ranks(_stage1_from_stage3, 2, root)[0]
    assert _differences(ref["sgd"]["snap4"], loaded, rtol=0) == []
    assert _differences(ref["sgd"]["snap8"], snap8, rtol=1e-6) == []
