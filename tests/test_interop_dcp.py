"""torch.distributed.checkpoint both ways: FSDP2 at 2 ranks -> shardopt at 3, shardopt at 2 -> FSDP2 at 3;
and with shardopt at stage 3: FSDP2 at 2 -> shardopt stage 3 at 3, shardopt stage 3 at 3 -> FSDP2 at 2.

One 2-rank run trains K steps with FSDP2 (fully_shard) and, in the same
processes, with shardopt; each saves with dcp.save from its get_state_dict,
then trains K more (the references). One 3-rank run loads each checkpoint
into the other library (shardopt from FSDP2's, FSDP2 from shardopt's), checks
that what was loaded equals what was saved bit for bit (weights, exp_avg,
exp_avg_sq, step, frozen parameters, buffers) and trains K more: both must
end within 1e-5 of the run they came from (AdamW either way; sums in another
order). The 3-rank run also loads FSDP2's checkpoint into a stage-3 shardopt
(parameters sharded too), and trains a stage-3 run of its own that saves to
DCP and goes on; a third run, FSDP2 at 2 ranks, loads that and must end
within 1e-5 of it. Every run sees the same global batch, so world size does
not change the averaged gradient.
"""
import os

import pytest
import torch
from torch import nn

from models import TinyNet
from dist_harness import run_ranks

K = 3
GLOBAL_BATCH = 6
LR, WD = 1e-2, 0.1
DEVICE = torch.device("cpu")  # .ci/gpu_integrations.py's dcp part runs these functions on a GPU


def _model(seed):
    torch.manual_seed(seed)
    m = TinyNet()
    m.shift.normal_()
    return m.to(DEVICE)


def _groups(model):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if p.ndim >= 2], "weight_decay": WD},
            {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0}]


def _train(model, opt, steps, rank, world_size):
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)
        n = GLOBAL_BATCH // world_size
        x, y = x[rank * n:(rank + 1) * n].to(DEVICE), y[rank * n:(rank + 1) * n].to(DEVICE)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


# ----------------------------------------------------------------- FSDP2
def _fsdp2(seed, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(seed)
    mesh = init_device_mesh(DEVICE.type, (world_size,))
    fully_shard(model.l1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(_groups(model), lr=LR)


def _fsdp2_full(model, opt):
    """Whole weights and optimizer state by name (every rank calls; rank 0's is returned)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if torch.distributed.get_rank() != 0:  # full state dicts are on rank 0 only
        return None
    out = {"model": {k: v.clone() for k, v in msd.items()}}
    out["state"] = {n: {k: v.clone() for k, v in st.items()} for n, st in osd["state"].items()}
    return out


# --------------------------------------------------------------- shardopt
def _shardopt(seed, stage=2):
    import shardopt

    model = _model(seed)
    opt = shardopt.ShardedOptimizer(_groups(model), optim=torch.optim.AdamW, lr=LR, reduce_bucket_size=150,
                                    stage=stage)
    return model, shardopt.ShardedDDP(model, opt), opt


def _shardopt_full(model, opt):
    """The same as _fsdp2_full, from shardopt's pieces (fp32 masters)."""
    opt.consolidate_state_dict(to=0)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}  # a collective at stage 3
    if opt.rank != 0:
        return None
    names = {id(p): n for n, p in model.named_parameters()}
    sd = opt.state_dict()
    order = [p for g in opt.param_groups for p in g["params"]]
    return {"model": weights, "state": {names[id(order[i])]: st for i, st in sd["state"].items()}}


def _save(path, msd, osd):
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _load(path, msd, osd):
    import torch.distributed.checkpoint as dcp

    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    return sd["model"], sd["optim"]


def _two_ranks(rank, world_size, root):
    import shardopt.checkpoint.dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = {}
    model, opt = _fsdp2(0, world_size)
    _train(model, opt, range(K), rank, world_size)
    out["fsdp2 saved"] = _fsdp2_full(model, opt)
    _save(os.path.join(root, "fsdp2"), *get_state_dict(model, opt))
    _train(model, opt, range(K, 2 * K), rank, world_size)
    out["fsdp2 continued"] = _fsdp2_full(model, opt)

    model, wrapper, opt = _shardopt(0)
    _train(wrapper, opt, range(K), rank, world_size)
    out["shardopt saved"] = _shardopt_full(model, opt)
    _save(os.path.join(root, "shardopt"), *shardopt.dcp.get_state_dict(wrapper, opt))
    _train(wrapper, opt, range(K, 2 * K), rank, world_size)
    out["shardopt continued"] = _shardopt_full(model, opt)
    return out if rank == 0 else None


def _three_ranks(rank, world_size, root):
    import shardopt.checkpoint.dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = {}
    # FSDP2's checkpoint into shardopt.
    model, wrapper, opt = _shardopt(1)
    msd, osd = _load(os.path.join(root, "fsdp2"), *shardopt.dcp.get_state_dict(wrapper, opt))
    shardopt.dcp.set_state_dict(wrapper, opt, model_state_dict=msd, optim_state_dict=osd)
    out["shardopt loaded"] = _shardopt_full(model, opt)
    _train(wrapper, opt, range(K, 2 * K), rank, world_size)
    out["shardopt continued"] = _shardopt_full(model, opt)
    out["shardopt hyper"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]

    # FSDP2's checkpoint into shardopt at stage 3 (parameters sharded too: nothing whole between uses).
    model, wrapper, opt = _shardopt(2, stage=3)
    msd, osd = _load(os.path.join(root, "fsdp2"), *shardopt.dcp.get_state_dict(wrapper, opt))
    shardopt.dcp.set_state_dict(wrapper, opt, model_state_dict=msd, optim_state_dict=osd)
    out["shardopt-3 loaded"] = _shardopt_full(model, opt)
    _train(wrapper, opt, range(K, 2 * K), rank, world_size)
    out["shardopt-3 continued"] = _shardopt_full(model, opt)

    # A stage-3 run of its own saves to DCP (for FSDP2 at 2 ranks: _fsdp2_from_stage3), and goes on.
    model, wrapper, opt = _shardopt(0, stage=3)
    _train(wrapper, opt, range(K), rank, world_size)
    out["shardopt-3 saved"] = _shardopt_full(model, opt)
    msd, osd = shardopt.dcp.get_state_dict(wrapper, opt)
    # The frozen parameters, sharded at stage 3, go to DCP as this rank's chunks (boxes), not whole copies.
    out["shardopt-3 frozen"] = {k: (type(msd[k]).__name__, sum(s.tensor.numel() for s in msd[k].local_shards()),
                                    msd[k].size().numel()) if k in msd else None
                                for k, p in model.named_parameters() if not p.requires_grad}
    _save(os.path.join(root, "shardopt-3"), msd, osd)
    _train(wrapper, opt, range(K, 2 * K), rank, world_size)
    out["shardopt-3 own"] = _shardopt_full(model, opt)

    # shardopt's checkpoint into FSDP2.
    model, opt = _fsdp2(1, world_size)
    msd, osd = _load(os.path.join(root, "shardopt"), *get_state_dict(model, opt))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    out["fsdp2 loaded"] = _fsdp2_full(model, opt)
    _train(model, opt, range(K, 2 * K), rank, world_size)
    out["fsdp2 continued"] = _fsdp2_full(model, opt)
    return out if rank == 0 else {"shardopt-3 frozen": out["shardopt-3 frozen"]}


def _fsdp2_from_stage3(rank, world_size, root):
    """FSDP2 at 2 ranks loads the checkpoint a shardopt stage-3 run saved at 3 ranks, and goes on."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _fsdp2(1, world_size)
    msd, osd = _load(os.path.join(root, "shardopt-3"), *get_state_dict(model, opt))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    out = {"fsdp2 loaded": _fsdp2_full(model, opt)}
    _train(model, opt, range(K, 2 * K), rank, world_size)
    out["fsdp2 continued"] = _fsdp2_full(model, opt)
    return out if rank == 0 else None


def _differences(want, got, rtol):
    out = []
    for part in ("model", "state"):
        assert set(want[part]) == set(got[part]), (part, sorted(want[part]), sorted(got[part]))
        for n in want[part]:
            a, b = want[part][n], got[part][n]
            for k, (x, y) in ({"": (a, b)} if torch.is_tensor(a) else {k: (a[k], b[k]) for k in a}).items():
                x, y = x.double().cpu(), y.double().cpu()
                err = ((x - y).abs().max() / x.abs().max().clamp_min(1e-12)).item() if x.numel() else 0.0
                if (rtol == 0 and not torch.equal(x, y)) or err > rtol:
                    out.append(f"{part} {n} {k}: relative error {err:.2e}")
    return out


@pytest.fixture(scope="module")
def dcp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dcp"))


@pytest.fixture(scope="module")
def runs(dcp_root):
    root = dcp_root
    two = run_ranks(_two_ranks, 2, root, timeout=300)[0]
    every = run_ranks(_three_ranks, 3, root, timeout=300)
    three = dict(every[0], frozen=[r["shardopt-3 frozen"] for r in every])
    return two, three


def test_fsdp2_checkpoint_resumes_in_shardopt_at_another_world_size(runs):
    two, three = runs
    assert _differences(two["fsdp2 saved"], three["shardopt loaded"], 0) == []
    assert _differences(two["fsdp2 continued"], three["shardopt continued"], 1e-5) == []
    assert [h["weight_decay"] for h in three["shardopt hyper"]] == [WD, 0.0]


def test_fsdp2_checkpoint_resumes_in_shardopt_stage3(runs):
    two, three = runs
    assert _differences(two["fsdp2 saved"], three["shardopt-3 loaded"], 0) == []
    assert _differences(two["fsdp2 continued"], three["shardopt-3 continued"], 1e-5) == []


def test_shardopt_stage3_checkpoint_resumes_in_fsdp2(runs, dcp_root):
    _, three = runs
    # Each rank hands DCP its part of the sharded frozen parameters (ShardedTensors of its chunks, or nothing
    # where it holds none), every element on one rank only, not a whole copy on each (here rank 0's chunk
    # holds them all: 30 elements are less than a stage-3 chunk).
    for name, whole in (("frozen.weight", 25), ("frozen.bias", 5)):
        held = [r[name] for r in three["frozen"] if r[name] is not None]
        assert all(kind == "ShardedTensor" for kind, _, _ in held), three["frozen"]
        assert sum(local for _, local, _ in held) == whole, three["frozen"]
    back = run_ranks(_fsdp2_from_stage3, 2, dcp_root, timeout=300)[0]
    assert _differences(three["shardopt-3 saved"], back["fsdp2 loaded"], 0) == []
    assert _differences(three["shardopt-3 own"], back["fsdp2 continued"], 1e-5) == []


def test_shardopt_checkpoint_resumes_in_fsdp2_at_another_world_size(runs):
    two, three = runs
    assert _differences(two["shardopt saved"], three["fsdp2 loaded"], 0) == []
    assert _differences(two["shardopt continued"], three["fsdp2 continued"], 1e-5) == []


@pytest.mark.parametrize("shape,start,end,boxes", [
    ((10,), 3, 7, [((3,), (4,))]),
    ((4, 5), 0, 20, [((0, 0), (4, 5))]),                          # whole tensor: one box
    ((4, 5), 5, 15, [((1, 0), (2, 5))]),                          # whole rows
    ((4, 5), 3, 17, [((0, 3), (1, 2)), ((1, 0), (2, 5)), ((3, 0), (1, 2))]),  # cut rows at both ends
    ((4, 5), 6, 8, [((1, 1), (1, 2))]),                           # inside one row
    ((4, 5), 3, 7, [((0, 3), (1, 2)), ((1, 0), (1, 2))]),         # two partial rows, no whole one
    ((2, 3, 4), 5, 19, [((0, 1, 1), (1, 1, 3)), ((0, 2, 0), (1, 1, 4)), ((1, 0, 0), (1, 1, 4)),
                        ((1, 1, 0), (1, 1, 3))]),                 # 3-D: recursion inside rows
    ((4, 5), 7, 7, []),
])
def test_range_to_boxes(shape, start, end, boxes):
    from shardopt.checkpoint.dcp import range_to_boxes

    got = range_to_boxes(shape, start, end)
    assert got == boxes
    # The boxes are the range: same elements, in flat order.
    ids = torch.arange(torch.Size(shape).numel()).reshape(shape)
    flat = [ids[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1) for off, size in got]
    assert (torch.cat(flat).tolist() if flat else []) == list(range(start, end))


def _one_rank(rank, world_size, root):
    """bf16 -> fp32 through DCP keeps the fp32 masters; dicts of another optimizer / model are refused."""
    import shardopt
    import shardopt.checkpoint.dcp

    out = {}
    model = _model(0).to(torch.bfloat16)
    opt = shardopt.ShardedOptimizer(_groups(model), optim=torch.optim.AdamW, lr=LR, reduce_bucket_size=150)
    wrapper = shardopt.ShardedDDP(model, opt)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)
        nn.functional.mse_loss(wrapper(x.bfloat16()).float(), y).backward()
        opt.step()
        opt.zero_grad()
    msd, osd = shardopt.dcp.get_state_dict(wrapper, opt)
    # One rank holds every piece, in flat order: the boxes put together are the masters.
    out["masters"] = {k: torch.cat([s.tensor.reshape(-1) for s in v.local_shards()]).reshape(v.size())
                      for k, v in msd.items() if hasattr(v, "local_shards")}
    _save(os.path.join(root, "bf16"), msd, osd)

    model, wrapper, opt = _shardopt(1)
    _train(wrapper, opt, range(1), 0, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    msd, osd = shardopt.dcp.get_state_dict(wrapper, opt)
    bad_groups = dict(osd, param_groups=[dict(osd["param_groups"][0], params=osd["param_groups"][0]["params"][::-1]),
                                         osd["param_groups"][1]])
    bad_model = {k: v for k, v in msd.items() if k != "shift"}
    for what, kw in {"groups": dict(optim_state_dict=bad_groups), "model": dict(model_state_dict=bad_model)}.items():
        try:
            shardopt.dcp.set_state_dict(wrapper, opt, **kw)
            out[what] = None
        except shardopt.CheckpointError as e:
            out[what] = str(e)
        out[what + " changed"] = any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    msd, osd = _load(os.path.join(root, "bf16"), msd, osd)
    shardopt.dcp.set_state_dict(wrapper, opt, model_state_dict=msd, optim_state_dict=osd)
    out["loaded"] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out


def test_bf16_masters_move_through_dcp_and_mismatched_dicts_are_refused(tmp_path):
    out = run_ranks(_one_rank, 1, str(tmp_path))[0]
    assert set(out["masters"]) == set(out["loaded"]) and out["masters"]["l1.weight"].dtype == torch.float32
    for n, want in out["masters"].items():
        assert torch.equal(out["loaded"][n], want), n
    assert "param group 0 holds" in out["groups"] and not out["groups changed"], out["groups"]
    assert "model state dict lacks shift" in out["model"] and not out["model changed"], out["model"]


def _onebit(rank, world_size, root):
    """OneBitAdam through DCP in its compression stage: the steps taken and the step its variance froze at come
    back (Note [The step the variance froze at]), and the residuals restart, said once."""
    import warnings

    import shardopt
    import torch.distributed.checkpoint as dcp

    def build():
        torch.manual_seed(0)
        model = TinyNet()
        opt = shardopt.ShardedOptimizer(model.parameters(), optim=shardopt.OneBitAdam, lr=1e-2, freeze_step=2,
                                        reduce_bucket_size=64)
        return model, opt, shardopt.ShardedDDP(model, opt)

    model, opt, wrapper = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(4):
            x = torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * step + rank))
            wrapper(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert opt.onebit.compressing and opt.onebit.frozen_at == 2
    msd, osd = shardopt.dcp.get_state_dict(wrapper, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "onebit"))
    model, opt, wrapper = build()
    opt.onebit.residual.fill_(1.0)  # what a run in flight would hold
    msd, osd = shardopt.dcp.get_state_dict(wrapper, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=os.path.join(root, "onebit"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shardopt.dcp.set_state_dict(wrapper, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    said = [str(w.message) for w in caught if "residuals restart" in str(w.message)]
    return opt.onebit.steps, opt.onebit.frozen_at, bool(opt.onebit.residual.any()), said


def test_onebit_state_moves_through_dcp(tmp_path):
    out = run_ranks(_onebit, 2, str(tmp_path))
    assert [o[:3] for o in out] == [(4, 2, False)] * 2, out
    assert len(out[0][3]) == 1 and out[1][3] == [], out
