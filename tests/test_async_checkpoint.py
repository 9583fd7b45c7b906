"""save_checkpoint(..., blocking=False): the files equal a blocking save's, training after the call changes nothing
saved, a failed background write is raised on every rank by the next call with `latest` unmoved, and a rank
killed while its writer runs leaves the previous checkpoint loadable and no partial folder after the next save.

Every case of a world size runs in one launch (Note [Several cases in one launch] in dist_harness.py): stages
1-3 on AwkwardNet (tied, frozen, unused parameters; odd sizes straddling buckets and chunks), and the disk tiers
(offload="nvme" at stage 2, offload_param="nvme" with offload="nvme" at stage 3), at 2 and 3 ranks.
"""
import errno
import os
import shutil
import signal

import pytest
import torch
from torch import nn

from dist_harness import RankFailure, case_results, run_cases, run_ranks
from faults import die_at_the_next_object_broadcast
from models import VOCAB, AwkwardNet, batch, uses_branch
from same_state import same as _same
from same_state import snapshot as _snapshot

GLOBAL_BATCH = 6
CONFIGS = {  # name -> (stage, options): every stage, and the disk tiers
    "stage1": (1, {}),
    "stage2": (2, {}),
    "stage3": (3, {}),
    "stage2 offload=nvme": (2, {"offload": "nvme", "optim": None}),
    "stage3 offload_param=nvme": (3, {"offload": "nvme", "offload_param": "nvme", "optim": None,
                                      "offload_buffer_count": 2}),
}


def _build(root, stage, seed=0, **options):
    import shardopt

    torch.manual_seed(seed)
    model = AwkwardNet().eval()
    options = {"optim": torch.optim.AdamW, **options}
    if "nvme" in (options.get("offload"), options.get("offload_param")):
        options["nvme_path"] = os.path.join(root, "nvme")
        os.makedirs(options["nvme_path"], exist_ok=True)
    opt = shardopt.ShardedOptimizer(model.parameters(), lr=1e-2, weight_decay=0.1, stage=stage,
                                    reduce_bucket_size=300, **options)
    return model, opt, shardopt.ShardedDDP(model, opt)


def _train(wrapper, opt, steps, rank, world_size):
    n = GLOBAL_BATCH // world_size
    for step in steps:
        x, y = batch(step, 0, bsz=GLOBAL_BATCH)
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        nn.functional.cross_entropy(wrapper(x, uses_branch(step, 0)).reshape(-1, VOCAB), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()


def _folder_differences(a: str, b: str) -> list:
    """Files that differ between two checkpoint folders (manifests: their bodies but the creation time)."""
    from shardopt.files import read_manifest

    names = sorted(os.listdir(a))
    if names != sorted(os.listdir(b)):
        return [f"files {names} vs {sorted(os.listdir(b))}"]
    out = []
    for name in names:
        if name == "manifest.json":
            x, y = read_manifest(a), read_manifest(b)
            x.pop("created"), y.pop("created")
            if x != y:
                out.append(f"{name}: keys differing {[k for k in x if x[k] != y.get(k)]}")
        elif open(os.path.join(a, name), "rb").read() != open(os.path.join(b, name), "rb").read():
            out.append(name)
    return out


# ----------------------------------------------------------------- cases, each on every rank of a launch
def _case_same_files(rank, world_size, root, config):
    """A blocking save and an async save of the same state give the same files; the async one loads."""
    import shardopt

    stage, options = CONFIGS[config]
    where = os.path.join(root, config.replace(" ", "_"))
    model, opt, wrapper = _build(where, stage, **options)
    _train(wrapper, opt, range(3), rank, world_size)
    before = _snapshot(model, opt)
    blocking = shardopt.save_checkpoint(os.path.join(where, "blocking"), wrapper, opt, extra={"step": 3})
    handle = shardopt.save_checkpoint(os.path.join(where, "async"), wrapper, opt, extra={"step": 3},
                                      blocking=False)
    saved = handle.result()
    differences = _folder_differences(blocking, saved) if rank == 0 else []
    model2, opt2, wrapper2 = _build(where, stage, seed=1, **options)
    extra = shardopt.load_checkpoint(os.path.join(where, "async"), wrapper2, opt2)
    return {"differences": differences, "loaded": _same(before, _snapshot(model2, opt2)),
            "extra": extra, "latest": open(os.path.join(where, "async", "latest")).read().strip()}


def _case_training_after_the_call(rank, world_size, root):
    """Steps taken while the writer runs change nothing saved (it writes the staged copy)."""
    import shardopt

    model, opt, wrapper = _build(root, 2)
    _train(wrapper, opt, range(2), rank, world_size)
    before = _snapshot(model, opt)
    handle = shardopt.save_checkpoint(os.path.join(root, "overlap"), wrapper, opt, blocking=False)
    _train(wrapper, opt, range(2, 5), rank, world_size)
    with torch.no_grad():
        model.l1.weight.fill_(7.0)  # an edit too
    handle.result()
    model2, opt2, wrapper2 = _build(root, 2, seed=1)
    shardopt.load_checkpoint(os.path.join(root, "overlap"), wrapper2, opt2)
    # A second async save reuses the staging memory: the next one holds the new state.
    again = shardopt.save_checkpoint(os.path.join(root, "overlap"), wrapper, opt, blocking=False)
    after = _snapshot(model, opt)
    model3, opt3, wrapper3 = _build(root, 2, seed=2)
    shardopt.load_checkpoint(again.result(), wrapper3, opt3)  # result() before the load waits too
    return _same(before, _snapshot(model2, opt2)), _same(after, _snapshot(model3, opt3)), again.path


def _case_disk_full(rank, world_size, root):
    """ENOSPC in rank 1's writer: the next call raises on every rank, `latest` stays, nothing is left over."""
    import shardopt
    from shardopt.checkpoint import staging

    path = os.path.join(root, "full")
    model, opt, wrapper = _build(root, 3)
    _train(wrapper, opt, range(2), rank, world_size)
    good = shardopt.save_checkpoint(path, wrapper, opt, blocking=False).result()
    write_all = staging.write_all

    def full(fd, view):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if rank == 1:
        staging.write_all = full
    try:
        handle = shardopt.save_checkpoint(path, wrapper, opt, blocking=False)
        _train(wrapper, opt, range(2, 3), rank, world_size)
        state = _snapshot(model, opt)
        try:
            shardopt.save_checkpoint(path, wrapper, opt, blocking=False)
            raised = None
        except shardopt.CheckpointError as e:
            raised = str(e)
    finally:
        staging.write_all = write_all
    untouched = _same(state, _snapshot(model, opt))
    latest = open(os.path.join(path, "latest")).read().strip()
    try:
        handle.result()  # already raised by the call above: result() still says so
        told = None
    except shardopt.CheckpointError as e:
        told = str(e)
    # The save after the failure works and takes the failed one's tag; its partial folder is gone.
    retried = shardopt.save_checkpoint(path, wrapper, opt, blocking=False).result()
    model2, opt2, wrapper2 = _build(root, 3, seed=1)
    shardopt.load_checkpoint(path, wrapper2, opt2)
    return {"raised": raised, "told": told, "latest": latest, "good": os.path.basename(good),
            "untouched": untouched, "retried": os.path.basename(retried), "left": sorted(os.listdir(path)),
            "loaded": _same(_snapshot(model, opt), _snapshot(model2, opt2))}


def _cases(world_size, root):
    cases = {f"same files {c}": (_case_same_files, (root, c)) for c in CONFIGS}
    cases["training after the call"] = (_case_training_after_the_call, (os.path.join(root, "overlap"),))
    cases["disk full"] = (_case_disk_full, (os.path.join(root, "full"),))
    for folder in ("overlap", "full"):
        os.makedirs(os.path.join(root, folder), exist_ok=True)
    return cases


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def launch(request, tmp_path_factory):
    world_size = request.param
    root = str(tmp_path_factory.mktemp(f"async{world_size}"))
    return world_size, run_cases(world_size, _cases(world_size, root), timeout=300)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_async_save_writes_the_blocking_saves_files(launch, config):
    world_size, outcomes = launch
    results = case_results(outcomes, f"same files {config}")
    assert results[0]["differences"] == [], results[0]["differences"]
    for r in results:
        assert r["loaded"] and r["extra"] == {"step": 3} and r["latest"] == "ckpt-000001", r


def test_training_after_the_call_changes_nothing_saved(launch):
    _, outcomes = launch
    for first, second, path in case_results(outcomes, "training after the call"):
        assert first and second and path.endswith("ckpt-000002")


def test_a_failed_background_write_is_raised_on_every_rank_at_the_next_call(launch):
    world_size, outcomes = launch
    results = case_results(outcomes, "disk full")
    for rank, r in enumerate(results):
        assert r["raised"] is not None, f"rank {rank} went on"
        assert "No space left on device" in r["raised"] and "rank 1" in r["raised"], r["raised"]
        assert "No space left on device" in r["told"], r["told"]
        assert r["latest"] == r["good"] == "ckpt-000001" and r["untouched"], r
        assert r["retried"] == "ckpt-000002" and r["loaded"], r
        assert r["left"] == ["ckpt-000001", "ckpt-000002", "latest"], r["left"]


# ------------------------------------------------------------------ a rank killed while its writer runs
def _killed_while_writing(rank, world_size, root):
    """Rank 1 is SIGKILLed by its writer thread halfway through its file; rank 0's result() raises."""
    import shardopt
    from shardopt.checkpoint import staging

    with open(os.path.join(root, f"stderr-{rank}"), "w") as f:  # what the process prints until it exits
        os.dup2(f.fileno(), 2)
    path = os.path.join(root, "ckpt")
    model, opt, wrapper = _build(root, 3)
    _train(wrapper, opt, range(2), rank, world_size)
    shardopt.save_checkpoint(path, wrapper, opt)
    snap = _snapshot(model, opt)
    if rank == 1:
        def dying(fd, view):
            os.write(fd, view[:len(view) // 2])
            os.kill(os.getpid(), signal.SIGKILL)  # mid-file: no cleanup, no goodbye

        staging.write_all = dying
    handle = shardopt.save_checkpoint(path, wrapper, opt, tag="step-2", blocking=False)
    try:
        handle.result()
        outcome = None
    except shardopt.CheckpointError as e:
        outcome = str(e)
    torch.save({"snap": snap, "outcome": outcome, "partial": os.path.isdir(os.path.join(path, ".partial-step-2")),
                "latest": open(os.path.join(path, "latest")).read().strip()}, os.path.join(root, "rank0.pt"))


def _resume_after_the_kill(rank, world_size, root):
    import shardopt

    path = os.path.join(root, "ckpt")
    model, opt, wrapper = _build(root, 2, seed=1)
    shardopt.load_checkpoint(path, wrapper, opt)
    loaded = _snapshot(model, opt)
    saved = shardopt.save_checkpoint(path, wrapper, opt, blocking=False).result()
    return loaded, os.path.basename(saved), sorted(os.listdir(path))


def test_a_rank_killed_while_writing_leaves_the_previous_checkpoint(tmp_path):
    root = str(tmp_path)
    with pytest.raises(RankFailure) as info:
        run_ranks(_killed_while_writing, 2, root, timeout=120, collective_timeout=10)
    assert "rank 1 died with exit code -9" in str(info.value), str(info.value)
    seen = torch.load(os.path.join(root, "rank0.pt"), weights_only=False)
    # Rank 0 heard of it from result() (it did not hang), and `latest` still names the first checkpoint.
    assert seen["outcome"] is not None and "step-2" in seen["outcome"] and "rank(s) [1]" in seen["outcome"], seen

    assert seen["latest"] == "ckpt-000001" and seen["partial"], seen  # the killed save's folder is left
    # The survivor exits without a traceback (its ShardedDDP let go of the dead peer with one warning).
    printed = open(os.path.join(root, "stderr-0")).read()
    assert "Traceback" not in printed and "Exception ignored" not in printed, printed
    # Another world size loads the previous checkpoint; its next save removes the killed save's partial folder.
    results = run_ranks(_resume_after_the_kill, 3, root)
    for loaded, saved, listing in results:
        assert _same(seen["snap"]["model"], loaded["model"]) and saved == "ckpt-000002"
        assert listing == ["ckpt-000001", "ckpt-000002", "latest"], listing
    assert _same(seen["snap"]["optim"], results[0][0]["optim"])


def _killed_while_staging(rank, world_size, root, first):
    """Rank 1 is SIGKILLed in the call of a non-blocking save, before that call's first collective: in the first such
    save, as the save's process group is made; in a later one, as it stages. Rank 0's call raises, naming rank 1."""
    import shardopt
    from shardopt.checkpoint import background

    path = os.path.join(root, "ckpt")
    model, opt, wrapper = _build(root, 2)
    _train(wrapper, opt, range(1), rank, world_size)
    shardopt.save_checkpoint(path, wrapper, opt)  # ckpt-000001, blocking: no background saver yet
    if not first:
        shardopt.save_checkpoint(path, wrapper, opt, blocking=False).result()  # ckpt-000002: the saver made
    if rank == 1:
        def dying(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        if first:
            background.Saver = dying
        else:
            background.Saver.sink = dying
    try:
        shardopt.save_checkpoint(path, wrapper, opt, tag="killed", blocking=False)
        raised = None
    except Exception as e:  # noqa: BLE001 - what the survivor is told is the test
        raised = (type(e).__name__, str(e))
    torch.save({"raised": raised, "latest": open(os.path.join(path, "latest")).read().strip()},
               os.path.join(root, "rank0.pt"))


@pytest.mark.parametrize("first", [True, False], ids=["first-async-save", "later-async-save"])
def test_a_rank_killed_in_the_call_is_named_by_the_survivor(tmp_path, first):
    root = str(tmp_path)
    with pytest.raises(RankFailure, match="rank 1 died with exit code -9"):
        run_ranks(_killed_while_staging, 2, root, first, timeout=120, collective_timeout=10)
    seen = torch.load(os.path.join(root, "rank0.pt"))
    assert seen["raised"] is not None and seen["raised"][0] == "CheckpointError", seen
    assert "rank(s) [1] (exited) lost" in seen["raised"][1], seen
    assert "nothing of this save was committed" in seen["raised"][1], seen
    assert seen["latest"] == ("ckpt-000001" if first else "ckpt-000002"), seen


def _killed_after_the_commit(rank, world_size, root):
    """Rank 1 SIGKILLed once its writer handed rank 0 its part: rank 0's save is complete and says so."""
    import warnings

    import shardopt
    from shardopt.checkpoint import background

    model, opt, wrapper = _build(root, 1)
    _train(wrapper, opt, range(1), rank, world_size)
    if rank == 1:
        write_staged = background.write_staged

        def written(plan):
            out = write_staged(plan)
            die_at_the_next_object_broadcast()  # rank 0's broadcast of the outcome: its commit comes first
            return out
        background.write_staged = written
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        saved = shardopt.save_checkpoint(os.path.join(root, "ckpt"), wrapper, opt, blocking=False).result()
    torch.save({"saved": saved, "warnings": [str(w.message) for w in seen]}, os.path.join(root, "rank0.pt"))


def test_a_rank_killed_after_the_commit_leaves_a_complete_save(tmp_path):
    root = str(tmp_path)
    with pytest.raises(RankFailure, match="rank 1 died with exit code -9"):
        run_ranks(_killed_after_the_commit, 2, root, timeout=120, collective_timeout=10)
    seen = torch.load(os.path.join(root, "rank0.pt"))
    assert seen["saved"] == os.path.join(root, "ckpt", "ckpt-000001"), seen
    assert open(os.path.join(root, "ckpt", "latest")).read().strip() == "ckpt-000001"
    assert all("is complete; rank(s) [1] (exited) was lost after the commit" in w for w in seen["warnings"]), seen
