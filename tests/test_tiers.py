"""Tiers (Note [Tiers] in shardopt/tiers/__init__.py): training state on disk equals it in memory, bit for bit.

offload="nvme" keeps the fp32 masters and the inner optimizer's state in a scratch file and the gradient shard
in a mapped one; the step walks them bucket by bucket. The same CPU Adam (or torch optimizer) steps the same
elements with the same values, so every weight and every state tensor must equal offload="cpu"'s exactly, at
stages 1-3, fp32 and bf16 models, on AwkwardNet with buckets small enough that parameters straddle buckets
and chunks. Checkpoints move between tiered and untiered runs and world sizes: at the world size that saved,
bitwise; at another within 1e-6 (another summation order), as in test_checkpoint.py. The cases of one world
size share a launch (Note [Several cases in one launch] in dist_harness.py).
"""
import os

import pytest
import torch
from torch import nn

from dist_harness import SharedLaunch
from models import VOCAB, AwkwardNet, batch, uses_branch
from same_state import same as _same

GLOBAL_BATCH = 6
STEPS = 6


def _model(seed, dtype=torch.float32):
    torch.manual_seed(seed)
    return AwkwardNet().eval().to(dtype)


def _build(model, nvme, offload, stage=2, **kw):
    import shardopt

    groups = [{"params": [p for p in model.parameters() if p.ndim >= 2]},
              {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    kw.setdefault("lr", 1e-2)
    kw.setdefault("nvme_path", nvme if offload == "nvme" else None)
    opt = shardopt.ShardedOptimizer(groups, stage=stage, offload=offload, reduce_bucket_size=kw.pop("rbs", 300),
                                    max_grad_norm=0.5, **kw)
    return opt, shardopt.ShardedDDP(model, opt)


def _train(wrapper, opt, steps, rank, world_size, micro=1):
    """micro > 1: each rank's batch in that many micro-batches, all but the last under no_sync."""
    for step in steps:
        _backward(wrapper, step, rank, world_size, micro)
        opt.step()
        opt.zero_grad()


def _backward(wrapper, step, rank, world_size, micro=1):
    """The forward and backward passes of `step` (its batch in `micro` micro-batches)."""
    import contextlib

    x, y = batch(step, 0, bsz=GLOBAL_BATCH * micro)
    n = GLOBAL_BATCH // world_size
    for m in range(micro):
        at = slice((rank * micro + m) * n, (rank * micro + m + 1) * n)
        with wrapper.no_sync() if m < micro - 1 else contextlib.nullcontext():
            out = wrapper(x[at], uses_branch(step, 0)).float()
            loss = nn.functional.cross_entropy(out.reshape(-1, VOCAB), y[at].reshape(-1)) / micro
            loss.backward()


def _weights(model, opt):
    with opt.full_params(writeback=False):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _pieces(opt):
    """This rank's master values and optimizer state, piece by piece (a bucket at a time from the tier)."""
    out = []
    for members in opt.view.resident_pieces():
        for i in members:
            t = opt.view.piece_params[i]
            st = opt.inner.state.get(t, {})
            out.append([t.clone()] + [(k, v.clone()) for k, v in sorted(st.items()) if torch.is_tensor(v)])
    return out


def _close(a: dict, b: dict, rtol: float) -> list:
    return [k for k in a if not torch.allclose(a[k].double(), b[k].double(), rtol=rtol, atol=rtol)]


# --------------------------------------------------------- bit for bit
PARITY = [  # (stage, optimizer, its options, model dtype); micro: micro-batches accumulated per step
    (1, None, {}, torch.float32),
    (2, "sgd", dict(lr=5e-2, momentum=0.9, weight_decay=0.01, micro=2), torch.float32),
    (3, None, dict(weight_decay=0.1), torch.float32),
    (2, None, dict(weight_decay=0.1), torch.bfloat16),
    (3, "sgd", dict(lr=5e-2, momentum=0.9), torch.bfloat16),
    (1, "adamw", dict(weight_decay=0.1), torch.bfloat16),
]


# With the parameter shard on disk too (stage 3): against the untiered run with the same offload.
PARAM_PARITY = [  # (offload, optimizer, its options, model dtype)
    ("nvme", None, dict(weight_decay=0.1), torch.float32),
    ("cpu", "sgd", dict(lr=5e-2, momentum=0.9), torch.bfloat16),
    ("nvme", "adamw", dict(weight_decay=0.1), torch.bfloat16),
]
_OPTIMS = {None: None, "sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


def _parity(rank, world_size, nvme, cases, param_cases):
    out = {}
    for stage, optim, kw, dtype in cases:
        runs = [_run(rank, world_size, nvme, dtype, stage=stage, offload=offload, optim=_OPTIMS[optim], **kw)
                for offload in ("cpu", "nvme")]
        out[f"stage {stage} {optim or 'CPUAdam'} {dtype} {kw.get('micro', 1)} micro-batches"] = _compare(*runs)
    for offload, optim, kw, dtype in param_cases:
        runs = [_run(rank, world_size, nvme, dtype, stage=3, offload=offload, optim=_OPTIMS[optim],
                     offload_param=where, offload_buffer_count=2, **kw) for where in ("none", "nvme")]
        out[f"offload_param nvme, offload {offload}, {optim or 'CPUAdam'} {dtype}"] = _compare(*runs)
    return out


def _run(rank, world_size, nvme, dtype, **kw):
    model = _model(0, dtype)
    kw.setdefault("offload_buffer_count", 3)
    if kw.get("offload_param") == "nvme":
        kw["nvme_path"] = nvme
    micro = kw.pop("micro", 1)
    opt, wrapper = _build(model, nvme, kw.pop("offload"), **kw)
    _train(wrapper, opt, range(STEPS), rank, world_size, micro)
    return _weights(model, opt), _pieces(opt), opt.memory_stats()


def _compare(a, b):
    (wa, pa, _), (wb, pb, stats) = a, b
    return _same(wa, wb), _same(pa, pb), len(pa), stats


# --------------------------------------------------- a step left open
def _open_steps(rank, world_size, root):
    """Stage 3 with both tiers on disk leaves each step's walk open for the next forward (Note [The step walked in
    the next forward] in tiers/pending_step.py). What a loop does between a step and the next forward sees the
    step whole, and the run equals the untiered one bit for bit: an LR schedule moved right after step(),
    zero_grad(set_to_none=False) every other step, micro-batches, full_params and a torch.optim state dict
    between a step and the next forward, a checkpoint there; its resume equals the run."""
    import shardopt

    nvme, runs = os.path.join(root, "nvme"), {}
    for where in ("none", "nvme"):
        model = _model(0)
        tiers = dict(offload_param="nvme", nvme_path=nvme) if where == "nvme" else {}
        opt, wrapper = _build(model, nvme, "nvme" if where == "nvme" else "cpu", stage=3, weight_decay=0.1,
                              offload_buffer_count=2, **tiers)
        schedule = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
        seen = []
        for step in range(6):
            _backward(wrapper, step, rank, world_size, micro=2 if step % 3 == 1 else 1)
            opt.step()
            schedule.step()
            if step == 2:
                seen.append(_weights(model, opt))
            if step == 3:
                opt.consolidate_state_dict(to=0)
                seen.append(opt.state_dict() if rank == 0 else None)
            if step == 4:
                shardopt.save_checkpoint(os.path.join(root, f"open-{where}"), wrapper, opt)
            opt.zero_grad(set_to_none=step % 2 == 0)
        runs[where] = (_weights(model, opt), _pieces(opt), seen)
    model, opt, wrapper = _reference_parts(nvme, "nvme", seed=1, stage=3, offload_param="nvme")
    shardopt.load_checkpoint(os.path.join(root, "open-nvme"), wrapper, opt)
    _backward(wrapper, 5, rank, world_size)
    opt.step()
    return {"equal": _same(runs["none"], runs["nvme"]), "resumed": _same(runs["nvme"][0], _weights(model, opt))}


# ------------------------------------------------------- checkpoints
def _reference(rank, world_size, root):
    """The uninterrupted run on disk (8 steps, saving after 4), resumed bitwise in a tiered run and an untiered
    one at the same world size; a torch.optim state dict of the tiered state equals the untiered run's."""
    import shardopt

    nvme = os.path.join(root, "nvme")
    model, opt, wrapper = _reference_parts(nvme, "nvme")
    _train(wrapper, opt, range(4), rank, world_size)
    shardopt.save_checkpoint(os.path.join(root, "ckpt"), wrapper, opt)
    _train(wrapper, opt, range(4, 8), rank, world_size)
    opt.consolidate_state_dict(to=0)
    out = {"weights": _weights(model, opt), "state_dict": opt.state_dict() if rank == 0 else None}
    plain, popt, pwrapper = _reference_parts(nvme, "cpu")
    _train(pwrapper, popt, range(8), rank, world_size)
    popt.consolidate_state_dict(to=0)
    out["untiered"] = (_same(out["weights"], _weights(plain, popt)),
                       rank != 0 or _same(out["state_dict"], popt.state_dict()))
    for offload in ("nvme", "cpu"):
        m2, o2, w2 = _reference_parts(nvme, offload, seed=1)
        shardopt.load_checkpoint(os.path.join(root, "ckpt"), w2, o2)
        _train(w2, o2, range(4, 8), rank, world_size)
        out[f"resumed {offload}"] = _same(out["weights"], _weights(m2, o2))
    # A torch.optim-format state dict (the same on every rank) into a tiered optimizer, and back out.
    sd = [out["state_dict"]]
    torch.distributed.broadcast_object_list(sd, src=0)
    _, o3, _ = _reference_parts(nvme, "nvme", seed=1)
    o3.load_state_dict(sd[0])
    o3.consolidate_state_dict(to=0)
    out["state dict round trip"] = rank != 0 or _same(sd[0], o3.state_dict())
    return out


def _failures(rank, world_size, root):
    """Bad disks at construction and an I/O error in a step: every rank raises, none hangs; the checkpoint from
    before the failure resumes the run as if nothing happened."""
    import shardopt
    from shardopt.tiers import disk

    out, nvme = {}, os.path.join(root, "nvme")
    bad = {"missing": os.path.join(root, "no-such-dir"), "tmpfs": "/dev/shm", "too small": nvme}
    for what, path in bad.items():
        real = os.statvfs
        if what == "too small" and rank == 1:  # this rank's disk has 4 KiB left
            disk.os.statvfs = lambda p: os.statvfs_result((4096, 4096, 1, 1, 1, 1, 1, 1, 0, 255))
        for stage, params in ((2, "none"), (3, "nvme")):
            try:
                _reference_parts(path if rank == 1 else nvme, "nvme", stage=stage, offload_param=params)
                out[f"{what} stage {stage}"] = None
            except shardopt.TierError as e:
                out[f"{what} stage {stage}"] = str(e)
        disk.os.statvfs = real
    # A write fails on rank 1 in the step after the save: every rank raises; the save resumes bitwise.
    model, opt, wrapper = _reference_parts(nvme, "nvme")
    _train(wrapper, opt, range(4), rank, world_size)
    shardopt.save_checkpoint(os.path.join(root, "before-failure"), wrapper, opt)
    transfer = disk.ScratchFile._transfer

    def failing(self, offset, piece, write):
        if write:
            raise disk.TierError("injected: EIO")
        return transfer(self, offset, piece, write)

    if rank == 1:
        disk.ScratchFile._transfer = failing
    try:
        _train(wrapper, opt, range(4, 5), rank, world_size)
        out["mid-step"] = None
    except shardopt.TierError as e:
        out["mid-step"] = str(e)
    finally:
        disk.ScratchFile._transfer = transfer
    # A read of the state fails on rank 1 while the next forward steps the buckets the last step left open (Note
    # [The step walked in the next forward]): no rank hangs in that forward's gathers; the step after raises.
    _, opt3, wrapper3 = _reference_parts(nvme, "nvme", stage=3, offload_param="nvme")
    _train(wrapper3, opt3, range(2), rank, world_size)

    def failing_read(self, offset, piece, write):
        if not write and self.kind == "optimizer":
            raise disk.TierError("injected: EIO")
        return transfer(self, offset, piece, write)

    if rank == 1:
        disk.ScratchFile._transfer = failing_read
    try:
        _backward(wrapper3, 2, rank, world_size)
        out["open step forward"] = "passed"
        opt3.step()
        out["open step"] = None
    except shardopt.TierError as e:
        out["open step"] = str(e)
    finally:
        disk.ScratchFile._transfer = transfer
    model, opt, wrapper = _reference_parts(nvme, "nvme", seed=1)
    shardopt.load_checkpoint(os.path.join(root, "before-failure"), wrapper, opt)
    _train(wrapper, opt, range(4, 8), rank, world_size)
    out["resumed"] = _weights(model, opt)
    out["named files"] = os.listdir(nvme)
    return out


def _killed(rank, world_size, nvme):
    """A rank SIGKILLed in a step with every tier on disk."""
    import signal

    _, opt, wrapper = _reference_parts(nvme, "nvme", stage=3, offload_param="nvme")
    _train(wrapper, opt, range(1), rank, world_size)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    _train(wrapper, opt, range(1, 3), rank, world_size)


def _reference_parts(nvme, offload, seed=0, stage=2, offload_param="none"):
    model = _model(seed)
    opt, wrapper = _build(model, nvme, offload, stage=stage, weight_decay=0.1, offload_param=offload_param,
                          nvme_path=nvme if "nvme" in (offload, offload_param) else None)
    return model, opt, wrapper


RESUMES = {"nvme stage 2": ("nvme", 2, "none"), "cpu stage 2": ("cpu", 2, "none"),
           "nvme stage 3": ("nvme", 3, "none"), "nvme stage 3, parameters on disk": ("nvme", 3, "nvme")}


def _resume_elsewhere(rank, world_size, root, want):
    """The checkpoint of the 2-rank tiered run resumed here (another world size), tiered and not, at stages 2
    and 3, the parameters on disk too; checkpoints saved here by tiered runs, for the way back."""
    import shardopt

    out, nvme = {}, os.path.join(root, "nvme")
    for name, (offload, stage, params) in RESUMES.items():
        model, opt, wrapper = _reference_parts(nvme, offload, seed=1, stage=stage, offload_param=params)
        shardopt.load_checkpoint(os.path.join(root, "ckpt"), wrapper, opt)
        if offload == "nvme" and stage == 2 or params == "nvme":
            shardopt.save_checkpoint(os.path.join(root, f"ckpt3-{params}"), wrapper, opt)
        _train(wrapper, opt, range(4, 8), rank, world_size)
        out[name] = _close(want, _weights(model, opt), 1e-6)
    return out


def _back(rank, world_size, root, want):
    """The 3-rank tiered runs' checkpoints resumed at 2 ranks without tiers."""
    import shardopt

    out = []
    for params in ("none", "nvme"):
        model, opt, wrapper = _reference_parts(os.path.join(root, "nvme"), "cpu", seed=1)
        shardopt.load_checkpoint(os.path.join(root, f"ckpt3-{params}"), wrapper, opt)
        _train(wrapper, opt, range(4, 8), rank, world_size)
        out += _close(want, _weights(model, opt), 1e-6)
    return out


def _weights_io(rank, world_size, root):
    """save_weights / load_weights / full_params with the parameter shard on disk, against the shard in memory."""
    import shardopt
    from safetensors.torch import load_file

    out, nvme = {}, os.path.join(root, "nvme")
    models = {}
    for params in ("none", "nvme"):
        model, opt, wrapper = _reference_parts(nvme, "nvme", stage=3, offload_param=params)
        _train(wrapper, opt, range(2), rank, world_size)
        with opt.full_params(), torch.no_grad():  # an edit between steps reaches the chunks (on disk)
            model.l1.weight.mul_(0.5)
        _train(wrapper, opt, range(2, 3), rank, world_size)
        shardopt.save_weights(wrapper, os.path.join(root, f"weights-{params}"))
        models[params] = _weights(model, opt)
    out["trained with an edit"] = _same(models["none"], models["nvme"])
    files = [load_file(os.path.join(root, f"weights-{p}", "model.safetensors")) for p in ("none", "nvme")]
    out["saved"] = _same(*files)
    model, opt, wrapper = _reference_parts(nvme, "nvme", seed=1, stage=3, offload_param="nvme")
    shardopt.load_weights(wrapper, os.path.join(root, "weights-none"))
    loaded = _weights(model, opt)
    out["loaded"] = _same({k: v for k, v in loaded.items() if k in files[0]}, files[0])
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiers"))
    os.makedirs(os.path.join(path, "nvme"))
    return path


@pytest.fixture(scope="module")
def two(root):
    nvme = os.path.join(root, "nvme")
    return SharedLaunch(2, lambda: {"parity": (_parity, (nvme, PARITY, PARAM_PARITY)),
                                    "reference": (_reference, (root,)), "failures": (_failures, (root,)),
                                    "open steps": (_open_steps, (root,))},
                        timeout=600)


def test_offload_nvme_equals_offload_cpu_bit_for_bit(two, three):
    for rank, cases in enumerate(two.results("parity") + three.results("parity")):
        for name, (weights, state, pieces, stats) in cases.items():
            assert weights and state, f"rank {rank}, {name}: the tiered run differs (weights {weights}, state {state})"
            assert pieces > 0
            if "offload_param" in name:  # between passes no parameter is in memory: the shard is on disk
                assert stats["params"] == 0 and stats["on_disk"]["params"] > 0, stats
            if "offload cpu" not in name:  # stage 1's full-size gradients stay with the model; the shard is on disk
                assert stats["master"] == stats["optimizer_state"] == 0 and stats["on_disk"]["grads"] > 0, stats
                assert stats["tier_buffers"] > 0 and stats["on_disk"]["optimizer_state"] > 0, stats


def test_tiered_checkpoints_resume_bitwise_and_match_the_untiered_run(two):
    for rank, out in enumerate(two.results("reference")):
        assert out["untiered"] == (True, True), f"rank {rank}: the tiered run is not the untiered one"
        assert out["resumed nvme"], f"rank {rank}: a tiered resume differs"
        assert out["resumed cpu"], f"rank {rank}: an untiered resume of a tiered checkpoint differs"
        assert out["state dict round trip"], f"rank {rank}: load_state_dict into the tier lost state"


def test_a_step_left_open_is_whole_to_whatever_reads_it(two):
    for rank, out in enumerate(two.results("open steps")):
        assert out == {"equal": True, "resumed": True}, f"rank {rank}: {out}"


@pytest.fixture(scope="module")
def three(root, two):
    want = two.results("reference")[0]["weights"]
    nvme = os.path.join(root, "nvme")
    return SharedLaunch(3, lambda: {"parity": (_parity, (nvme, [PARITY[i] for i in (1, 2, 5)], PARAM_PARITY[:1])),
                                    "resume": (_resume_elsewhere, (root, want)),
                                    "weights": (_weights_io, (root,))}, timeout=600)


def test_tiered_checkpoints_move_between_world_sizes(two, three, root):
    from dist_harness import run_ranks

    for rank, out in enumerate(three.results("resume")):
        assert out == {name: [] for name in RESUMES}, f"rank {rank}: {out}"
    want = two.results("reference")[0]["weights"]
    for rank, out in enumerate(run_ranks(_back, 2, root, want, timeout=300)):
        assert out == [], f"rank {rank}: {out}"


def test_weights_in_and_out_with_the_parameters_on_disk(three):
    for rank, out in enumerate(three.results("weights")):
        assert out == {"trained with an edit": True, "saved": True, "loaded": True}, f"rank {rank}: {out}"


def test_bad_disks_and_io_errors_raise_on_every_rank(two, root):
    from dist_harness import RankFailure, run_ranks

    want = two.results("reference")[0]["weights"]
    for rank, out in enumerate(two.results("failures")):
        for what, fix in (("missing", "does not exist"), ("tmpfs", "tmpfs"), ("too small", "GiB free")):
            for stage in (2, 3):
                msg = out[f"{what} stage {stage}"]
                assert msg is not None, f"rank {rank}: a {what} nvme_path on rank 1 was taken at stage {stage}"
                assert (fix in msg) if rank == 1 else ("rank 1" in msg and fix in msg), (rank, msg)
        msg = out["mid-step"]
        assert msg is not None and "EIO" in msg and (rank == 1 or "rank 1" in msg), (rank, msg)
        msg = out["open step"]
        assert out.get("open step forward") == "passed", f"rank {rank}: the forward raised instead of the step"
        assert msg is not None and "EIO" in msg and (rank == 1 or "rank 1" in msg), (rank, msg)
        assert _same(out["resumed"], want), f"rank {rank}: the resume after the failure differs"
        assert out["named files"] == [], out["named files"]  # the scratch files have no names
    # A rank killed mid-run: its peer does not hang, and no file is left.
    nvme = os.path.join(root, "killed")
    os.makedirs(nvme)
    with pytest.raises(RankFailure, match="rank 1"):
        run_ranks(_killed, 2, nvme, timeout=120, collective_timeout=10)
    assert os.listdir(nvme) == []


# ------------------------------------------------------------- memory
CGROUP = "/sys/fs/cgroup/memory"


def _charged_peak(rank, world_size, nvme, offload):
    """Peak bytes charged to this rank's own memory cgroup (v1: page cache included) while it builds the
    optimizer and trains 3 steps of a 12M-parameter model at stage 3."""
    import ctypes

    import shardopt

    ctypes.CDLL(None).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD fixed: glibc keeps no freed heap growing
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1000, 1000) for _ in range(12)])
    path = os.path.join(CGROUP, f"shardopt-tiers-test-{os.getpid()}")
    os.mkdir(path)
    try:
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        tiers = dict(offload="nvme", offload_param="nvme", nvme_path=nvme) if offload == "nvme" else dict(offload="cpu")
        opt = shardopt.ShardedOptimizer(model.parameters(), stage=3, lr=1e-3, **tiers)
        wrapper = shardopt.ShardedDDP(model, opt)
        for step in range(3):
            wrapper(torch.randn(4, 1000, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            opt.step()
            opt.zero_grad()
        with open(os.path.join(path, "memory.max_usage_in_bytes")) as f:
            peak = int(f.read())
    finally:
        with open(os.path.join(CGROUP, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        os.rmdir(path)
    return peak, opt.memory_stats()


@pytest.mark.skipif(not os.access(CGROUP, os.W_OK), reason="needs a writable cgroup v1 memory hierarchy (root)")
def test_tiered_memory_charged_stays_below_the_state_it_moved(root):
    """What each rank is charged (page cache included) drops by most of the state the tiers move to disk."""
    from dist_harness import run_ranks

    nvme = os.path.join(root, "nvme")
    cpu = run_ranks(_charged_peak, 2, nvme, "cpu", timeout=300)
    disk = run_ranks(_charged_peak, 2, nvme, "nvme", timeout=300)
    for (peak_cpu, _), (peak_disk, stats) in zip(cpu, disk):
        moved = sum(stats["on_disk"].values())  # masters, state, gradients and parameters: 20 bytes a parameter
        assert peak_disk < peak_cpu - moved / 2, (peak_cpu, peak_disk, moved, stats)
