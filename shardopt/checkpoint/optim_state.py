"""ShardedOptimizer's torch.optim-format state dicts: consolidate on one rank, load on every rank.

    opt.consolidate_state_dict(to=0)      # every rank (a collective)
    full = opt.state_dict()               # rank 0: {"state": {index: {"step", "exp_avg", ...}}, "param_groups"}
    opt.load_state_dict(full)             # every rank, the same dict: each takes its own ranges

torch.optim's format (whole-parameter state in the master dtype), so the dict moves to and from a plain torch
optimizer. As with ZeroRedundancyOptimizer, state_dict() without a fresh consolidation raises. The dict is
kept on the optimizer's view (Note [The optimizer's view] in view.py).
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from shardopt.checkpoint.pieces import InnerStateSwap, assemble, group_hyper, local_chunks, resolve_hyper, split_state
from shardopt.view import view_of


def _torch_groups(opt) -> tuple[list[dict], dict]:
    """torch.optim.Optimizer.state_dict's param_groups and its {id(param): index} numbering."""
    index: dict = {}
    groups, start = [], 0
    for g in opt.param_groups:
        for i, p in enumerate(g["params"], start):
            index.setdefault(id(p), i)
        groups.append(dict(group_hyper(g), params=[index[id(p)] for p in g["params"]]))
        start += len(g["params"])
    return groups, index


def forget_consolidated(opt) -> None:
    """A consolidated copy is stale (a step, a load): drop it rather than hand it out later."""
    opt.consolidated = None


def consolidate_state_dict(opt, to: int = 0) -> None:
    """Gathers the whole optimizer state, in torch.optim's format, on group rank `to` (a collective)."""
    opt = view_of(opt)
    if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < opt.world_size:
        raise ValueError(f"to must be a rank of the optimizer's group (0..{opt.world_size - 1}), got {to!r}")
    if not opt.consolidation_hooked:
        opt.after_every_step(forget_consolidated)
        opt.consolidation_hooked = True
    chunks = [c for _, c in local_chunks(opt, range(len(opt.params)), copy=True)]
    gathered = [chunks]
    if opt.world_size > 1:
        gathered = [None] * opt.world_size if opt.rank == to else None
        dist.gather_object(chunks, gathered, group=opt.process_group, group_dst=to)
    opt.consolidated, opt.consolidated_to = None, to
    if opt.rank == to:
        groups, index = _torch_groups(opt)
        full = assemble({s.index: tuple(s.shape) for s in opt.layout.params}, (c for cs in gathered for c in cs))
        opt.consolidated = {"state": {index[id(opt.params[j])]: full[j] for j in sorted(full)},
                            "param_groups": groups}
        if opt.onebit is not None:  # (torch.optim's load_state_dict ignores the key)
            opt.consolidated["onebit"] = opt.onebit.record()


def optimizer_state_dict(opt) -> dict:
    """ShardedOptimizer.state_dict(): the consolidated torch.optim-format state (see consolidate_state_dict)."""
    opt = view_of(opt)
    sd = opt.consolidated
    if sd is None:
        where = opt.consolidated_to
        why = (f"it was consolidated on rank {where}, this is rank {opt.rank}" if where is not None
               and where != opt.rank else "the state is sharded over ranks and has not been consolidated "
               "since the last step")
        raise RuntimeError(
            f"ShardedOptimizer.state_dict(): {why}. Call optimizer.consolidate_state_dict(to=RANK) on every "
            "rank first, then state_dict() on rank RANK; or checkpoint without gathering with "
            "shardopt.save_checkpoint / load_checkpoint")
    return sd


def load_optimizer_state_dict(opt, state_dict: dict) -> None:
    """ShardedOptimizer.load_state_dict(): every rank, the same dict (no collective), takes its ranges."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("expected a torch.optim state dict ({'state': ..., 'param_groups': ...}), as "
                         "state_dict() returns after consolidate_state_dict()")
    opt = view_of(opt)
    saved_groups = state_dict["param_groups"]
    hyper = resolve_hyper(opt, [group_hyper(g) for g in saved_groups], True, "the state dict", ValueError)
    for gi, (s, g) in enumerate(zip(saved_groups, opt.param_groups)):
        if len(s["params"]) != len(g["params"]):
            raise ValueError(f"param group {gi} has {len(s['params'])} parameters in the state dict but "
                             f"{len(g['params'])} here: build the optimizer from the same parameters, in the "
                             "same order")
    # Position k of this optimizer's groups has the state saved under the k-th saved index.
    ours, index = _torch_groups(opt)
    saved_index = dict(zip((i for g in ours for i in g["params"]), (i for g in saved_groups for i in g["params"])))
    states = {}
    for i, pc in enumerate(opt.pieces):
        p = opt.params[pc.param]
        st = state_dict["state"].get(saved_index[index[id(p)]])
        if not st:
            continue
        slices, scalars = split_state(st, tuple(opt.layout.params[pc.param].shape),
                                      f"state of parameter {index[id(p)]}")
        slot = opt.layout.params[pc.param]
        a, b = pc.start - slot.offset, pc.end - slot.offset
        states[i] = {**{k: v[a:b].clone() for k, v in slices.items()},
                     **{k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}}
    InnerStateSwap(opt).apply(states, hyper)
    opt.adopt_state()  # into the state tier, bucket by bucket, if there is one
    for g, h in zip(opt.param_groups, hyper):
        g.update(h)
    forget_consolidated(opt)
    if opt.onebit is not None:  # the same dict on every rank: its steps need no collective
        steps = max((int(float(st["step"])) for st in state_dict["state"].values() if "step" in st), default=0)
        onebit_after_load(opt, state_dict.get("onebit"), "load_state_dict", "torch.optim state dict", steps)


def onebit_after_load(opt, record, call: str, what: str, steps: int | None = None) -> None:
    """OneBitAdam after a state-dict load: its steps (given, or from the loaded state: a collective), its freeze
    step from the record, and residuals from zero (such a dict holds none; save_checkpoint's does)."""
    opt.onebit.after_load(record, steps)
    if opt.onebit.compressing:
        was = torch.tensor([int(opt.onebit.residual.any())])
        if steps is None and dist.get_world_size(opt.world_group) > 1:  # (a collective call: agree on the warning)
            dist.all_reduce(was, op=dist.ReduceOp.MAX, group=opt.world_group)
        opt.onebit.reset_residual()
        if int(was) and dist.get_rank(opt.world_group) == 0:
            warnings.warn(f"{call}: OneBitAdam's error-feedback residuals restart from zero (a {what} does not "
                          "hold them; shardopt.save_checkpoint / load_checkpoint keep them)", stacklevel=3)
