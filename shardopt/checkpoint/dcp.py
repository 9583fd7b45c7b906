"""torch.distributed.checkpoint (DCP) state dicts for ShardedDDP + ShardedOptimizer, as FSDP2's.

    import torch.distributed.checkpoint as dcp
    model_sd, optim_sd = shardopt.dcp.get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id="ckpt")          # every rank
    ...
    model_sd, optim_sd = shardopt.dcp.get_state_dict(model, opt)      # in another run, any world size
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id="ckpt")
    shardopt.dcp.set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)

The dicts have the keys and nesting of torch's get_state_dict for FSDP2 (FQN-keyed), so checkpoints move
between an FSDP2 run and this one, each at its own world size.

Note [How ZeRO-1/2 state is described to DCP]
---------------------------------------------
FSDP2 describes a parameter as a DTensor sharded on dim 0. Our state is per piece: a flat range that may
start and end mid-row, several per rank (Note [Flat layout] in layout.py), which no DTensor can say. So a
parameter is a ShardedTensor whose local shards are *boxes*: a flat range of a row-major tensor is the union
of at most 2 (ndim - 1) + 1 contiguous boxes (rest of the first row, whole rows, start of the last;
recursively inside a row), each a view of the piece. Every rank computes every rank's boxes from the layout,
so no communication; DCP saves each element once and loads each box from whatever overlaps it (FSDP2's rows,
another world size's boxes). Trainable parameters are the fp32 masters as boxes, frozen ones stage 3 shards
boxes of the store's chunks; other tensors are the model's own, a step count a 0-d tensor, as FSDP2's.
A rank's dicts hold only what it has pieces of: DCP's load planner drops a ShardedTensor with no local shard,
then takes the checkpoint for a pre-2.4 one. The dicts are views of the live state (dcp.load writes in
place); as torch does for FSDP2, an unstepped optimizer's state is created first (zero gradients, lr 0).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from shardopt.checkpoint.save_load import _agree_or_undo, _check_pair, _unwrap, describe_model, put_other
from shardopt.checkpoint.source import PARAM
from shardopt.files import CheckpointError
from shardopt.checkpoint.pieces import SCALAR_KEYS, Chunk, InnerStateSwap, cut, group_hyper, resolve_hyper
from shardopt.checkpoint.optim_state import forget_consolidated


def range_to_boxes(shape, start: int, end: int) -> list[tuple[tuple, tuple]]:
    """[(offsets, sizes)] of the boxes tiling flat elements [start, end) of a row-major `shape` (the Note)."""
    shape = tuple(shape)
    if start >= end:
        return []
    if len(shape) == 1:
        return [((start,), (end - start,))]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(end, inner)

    def in_row(r, a, b):
        return [((r,) + o, (1,) + s) for o, s in range_to_boxes(shape[1:], a, b)]

    if r0 == r1:
        return in_row(r0, c0, c1)
    out = []
    if c0:
        out += in_row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + shape[1:]))
    if c1:
        out += in_row(r1, 0, c1)
    return out


def _flat_offset(shape, offsets) -> int:
    at = 0
    for n, o in zip(shape, offsets):
        at = at * n + o
    return at


def _sharded_tensor(shape, dtype, device, boxes, local, group):
    """A ShardedTensor of `shape` from every rank's boxes [(rank, offsets, sizes)] and this rank's tensors."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    def placement(r):
        return f"rank:{dist.get_global_rank(group, r) if group is not None else r}/{device}"

    mds = [ShardMetadata(shard_offsets=list(o), shard_sizes=list(s), placement=placement(r)) for r, o, s in boxes]
    me = dist.get_rank(group)
    mine = [md for (r, _, _), md in zip(boxes, mds) if r == me]
    pinned = bool(local) and local[0].is_pinned()
    props = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=pinned)
    meta = ShardedTensorMetadata(shards_metadata=mds, size=torch.Size(shape), tensor_properties=props)
    shards = [Shard(tensor=t, metadata=md) for t, md in zip(local, mine)]
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta, process_group=group)


def _refuse_hybrid(opt) -> None:
    """Refuses the optimizers whose state DCP cannot take as live tensors: hybrid-sharded, or on disk."""
    if opt.state_tier is not None:
        raise NotImplementedError(
            "DCP state dicts of an optimizer with offload='nvme' are not supported: its state lives on disk and is "
            "in memory a bucket at a time, never whole as DCP's tensors must be. Save with "
            "shardopt.save_checkpoint (it reads the state bucket by bucket and loads into any run, tiered or not).")
    if opt.sharding.shape.hybrid:
        raise NotImplementedError(
            f"DCP state dicts of a hybrid-sharded optimizer (mesh {opt.sharding.shape}) are not supported yet: "
            "its replicas hold the same shards and DCP would see each piece R times. Save with "
            "shardopt.save_checkpoint (it loads into any mesh or flat world), or build the optimizer flat "
            "(process_group=...) for the DCP export.")


def _is_sharded(v) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(v, ShardedTensor)


class _Plan:
    """Every rank's pieces per parameter, as param-relative ranges and boxes (pure, from the layout)."""

    def __init__(self, opt, names):
        self.names = names
        self.ranges: dict = {}   # param index -> [(rank, a, b)]
        for r in range(opt.world_size):
            for pc in opt.layout.pieces(r):
                off = opt.layout.params[pc.param].offset
                self.ranges.setdefault(pc.param, []).append((r, pc.start - off, pc.end - off))
        for j, p in enumerate(opt.params):
            if p.dim() == 0:
                raise NotImplementedError(f"parameter {names[j]!r} is 0-d: shardopt.checkpoint.dcp cannot describe a 0-d "
                                          "parameter's pieces to DCP (make it shape (1,))")

    def boxes(self, j, shape):
        return [(r, o, s) for r, a, b in self.ranges.get(j, ()) for o, s in range_to_boxes(shape, a, b)]


def held_boxes(layout, i: int, world_size: int) -> list:
    """Every rank's boxes [(rank, offsets, sizes)] of store member `i` (a frozen parameter stage 3 shards)."""
    slot, out = layout.params[i], []
    for bucket in layout.buckets:
        if i not in bucket.params:
            continue
        for r in range(world_size):
            cs, ce = bucket.chunk(r)
            s, e = max(cs, slot.offset), min(ce, slot.end)
            if s < e:
                out += [(r, o, z) for o, z in range_to_boxes(slot.shape, s - slot.offset, e - slot.offset)]
    return out


def _local_views(shape, piece_tensors: list[tuple[int, int, torch.Tensor]]) -> list[torch.Tensor]:
    """This rank's pieces [(a, b, flat tensor)] as box-shaped views, in box order."""
    out = []
    for a, b, t in piece_tensors:
        at = 0
        for _, sizes in range_to_boxes(shape, a, b):
            n = math.prod(sizes)
            out.append(t[at:at + n].view(sizes))
            at += n
    return out


def _init_inner_state(opt) -> None:
    """Creates the inner optimizer's state (as torch's get_state_dict does): zero grads, lr 0, one step."""
    inner = opt.inner
    if inner is None or inner.state:
        return
    lrs = [g["lr"] for g in inner.param_groups]
    try:
        for t in opt.piece_params:
            t.grad = torch.zeros_like(t)
        for g in inner.param_groups:
            g["lr"] = 0.0 if not torch.is_tensor(g["lr"]) else torch.zeros_like(g["lr"])
        with torch.no_grad():
            inner.step()
    finally:
        for g, lr in zip(inner.param_groups, lrs):
            g["lr"] = lr
        for t in opt.piece_params:
            t.grad = None


def get_state_dict(model, optimizer) -> tuple[dict, dict]:
    """(model state dict, optimizer state dict) in FSDP2's format for DCP; a collective (the module docstring)."""
    opt = _check_pair(model, optimizer)
    _refuse_hybrid(opt)
    opt.wait_params()
    opt.take_model_edits(saving=True)  # the masters handed out hold edited weights (Note [Weights edited in place])
    module = _unwrap(model)
    info = describe_model(module, opt)
    plan = _Plan(opt, info.names)
    _init_inner_state(opt)
    group = opt.process_group
    index = {id(p): j for j, p in enumerate(opt.params)}

    mine: dict = {}   # param index -> [(a, b, piece index)]
    for i, pc in enumerate(opt.pieces):
        off = opt.layout.params[pc.param].offset
        mine.setdefault(pc.param, []).append((pc.start - off, pc.end - off, i))

    def sharded(j, tensors):
        shape = tuple(opt.layout.params[j].shape)  # at stage 3 the parameter is empty between uses
        local = _local_views(shape, [(a, b, t) for (a, b, _), t in zip(mine.get(j, ()), tensors)])
        dtype = tensors[0].dtype if tensors else opt.master_dtype
        device = tensors[0].device if tensors else opt.master_device
        return _sharded_tensor(shape, dtype, device, plan.boxes(j, shape), local, group)

    masters = {j: sharded(j, [opt.piece_params[i] for _, _, i in mine[j]]) for j in mine}
    model_sd = {}
    for k, v in module.state_dict(keep_vars=True).items():
        j = index.get(id(v))
        if k in info.held:
            held = _held_tensor(opt, info.held[k], group)
            if held is not None:  # this rank holds some of it (a rank's dict has only what it holds)
                model_sd[k] = held
        elif j is None:
            model_sd[k] = v.detach()
        elif j in masters:
            model_sd[k] = masters[j]

    state = {}
    inner_state = opt.inner.state if opt.inner is not None else {}
    for j, name in enumerate(info.names):
        pieces = [opt.piece_params[i] for _, _, i in mine.get(j, ())]
        sts = [inner_state.get(t, {}) for t in pieces]
        keys = set(sts[0]) if sts else set()
        if not keys:
            continue  # not stepped, or no piece here (DCP merges every rank's keys)
        entry = {}
        for k in sorted(keys):
            if k in SCALAR_KEYS or not torch.is_tensor(sts[0][k]) or sts[0][k].dim() == 0:
                entry[k] = _scalar(opt, j, k, sts)
            else:
                entry[k] = sharded(j, [st[k] for st in sts])
        state[name] = entry
    groups = [dict(group_hyper(g), params=[n for n in names if n is not None])
              for g, names in zip(opt.param_groups, info.group_names)]
    optim_sd = {"state": state, "param_groups": groups}
    if opt.onebit is not None:  # Note [The step the variance froze at] in onebit.py
        optim_sd["onebit"] = opt.onebit.record()
    return model_sd, optim_sd


def _held_tensor(opt, i: int, group):
    """Store member i (a frozen parameter stage 3 shards) as a ShardedTensor of this rank's chunks, or None."""
    store = opt.store
    slot = store.layout.params[i]
    local = _local_views(slot.shape, [(a, b, view) for a, b, view in store.local_parts(i)])
    if not local:
        return None
    return _sharded_tensor(slot.shape, local[0].dtype, local[0].device,
                           held_boxes(store.layout, i, opt.world_size), local, group)


def _held_parts(opt, info, name: str, value) -> list:
    """This rank's parts of a sharded frozen parameter from a state-dict value, for put_other."""
    i = info.held[name]
    shape = opt.store.layout.params[i].shape
    chunks = _chunks_of(value, name, PARAM, shape)
    return [cut(chunks, a, b, f"frozen parameter {name!r}")[0][PARAM] for a, b, _ in opt.store.local_parts(i)]


def _scalar(opt, j, k, sts):
    """A per-parameter scalar (the step): the live 0-d tensor, as FSDP2's dicts hold it."""
    v = sts[0][k]
    return v.detach() if torch.is_tensor(v) else torch.tensor(float(v))


def _chunks_of(value, name: str, key: str, shape) -> list[Chunk]:
    """A state-dict value (our ShardedTensor, or a whole tensor) as chunks of the flattened parameter."""
    if _is_sharded(value):
        out = [Chunk(name, _flat_offset(shape, s.metadata.shard_offsets),
                     _flat_offset(shape, s.metadata.shard_offsets) + s.tensor.numel(), {key: s.tensor.reshape(-1)}, {})
               for s in value.local_shards()]
        return sorted(out, key=lambda c: c.start)
    if torch.is_tensor(value) and not _is_dtensor(value):
        if tuple(value.shape) != tuple(shape):
            raise CheckpointError(f"{name!r} {key}: shape {tuple(value.shape)}, the parameter's is {tuple(shape)}")
        return [Chunk(name, 0, math.prod(shape), {key: value.detach().reshape(-1)}, {})]
    raise CheckpointError(f"{name!r} {key}: a {type(value).__name__}; pass the dicts shardopt.dcp.get_state_dict "
                          "returned (after dcp.load into them), or whole tensors")


def _is_dtensor(v) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(v, DTensor)


def _piece_values(opt, info, value, name, key, i):
    pc = opt.pieces[i]
    slot = opt.layout.params[pc.param]
    a, b = pc.start - slot.offset, pc.end - slot.offset
    slices, _ = cut(_chunks_of(value, name, key, slot.shape), a, b, f"{key} of parameter {name!r}")
    return slices[key]


def set_state_dict(model, optimizer, *, model_state_dict: dict | None = None,
                   optim_state_dict: dict | None = None) -> None:
    """Installs get_state_dict's dicts after dcp.load (or whole tensors; None: left as is); a collective that
    refuses another model's or optimizer's on every rank, changing nothing."""
    opt = _check_pair(model, optimizer)
    _refuse_hybrid(opt)
    opt.wait_params()
    module = _unwrap(model)
    swap = InnerStateSwap(opt)
    error = masters = others = hyper = None
    try:
        if opt.engine is None:
            raise RuntimeError("set_state_dict needs the model wrapped: build shardopt.ShardedDDP(model, "
                               "optimizer) first (loading ends by all-gathering the weights)")
        info = describe_model(module, opt)
        if model_state_dict is not None:
            held = {info.names[pc.param] for pc in opt.pieces}
            holding = {k for k, i in info.held.items() if opt.store.local_parts(i)}
            missing = [k for k in held if k not in model_state_dict] + \
                      [k for k in info.others if k not in model_state_dict and (k not in info.held or k in holding)]
            if missing:
                raise CheckpointError(f"model state dict lacks {', '.join(sorted(missing)[:10])}")
            masters = {i: _piece_values(opt, info, model_state_dict[info.names[pc.param]], info.names[pc.param],
                                        PARAM, i) for i, pc in enumerate(opt.pieces)}
            others = {}
            for k, (t, _) in info.others.items():
                if k not in model_state_dict:
                    continue  # a sharded frozen parameter this rank holds none of
                v = model_state_dict[k]
                if tuple(v.size()) != info.shapes[k]:
                    raise CheckpointError(f"{k!r}: shape {tuple(v.size())} in the state dict, {info.shapes[k]} here")
                others[k] = _held_parts(opt, info, k, v) if k in info.held else v
        if optim_state_dict is not None:
            hyper = _install_optim(opt, info, optim_state_dict, swap)
    except Exception as e:  # noqa: BLE001 - handed to _agree, which raises it on this rank
        error = e
    _agree_or_undo(opt, error, swap)
    with torch.no_grad():
        if hyper is not None:
            for g, h in zip(opt.param_groups, hyper):
                g.update(h)
        for i, values in (masters or {}).items():
            if values.data_ptr() != opt.piece_params[i].data_ptr():
                opt.piece_params[i].copy_(values)
        for k, v in (others or {}).items():
            put_other(opt, info, k, v)
    forget_consolidated(opt)
    opt.zero_grad()
    if hyper is not None and opt.onebit is not None:
        from shardopt.checkpoint.optim_state import onebit_after_load
        onebit_after_load(opt, optim_state_dict.get("onebit"), "set_state_dict", "DCP state dict")
    opt.publish_params()
    opt.store.after_load()


def _install_optim(opt, info, sd: dict, swap: InnerStateSwap) -> list:
    if not isinstance(sd, dict) or not {"state", "param_groups"} <= set(sd):
        raise CheckpointError("expected an optimizer state dict {'state': ..., 'param_groups': ...} as "
                              "shardopt.dcp.get_state_dict returns")
    saved_groups = sd["param_groups"]
    for gi, (s, names) in enumerate(zip(saved_groups, info.group_names)):
        ours = [n for n in names if n is not None]
        if list(s.get("params", ours)) != ours:
            raise CheckpointError(f"param group {gi} holds {list(s.get('params'))[:5]}... in the state dict, "
                                  f"{ours[:5]}... here: build the optimizer with the same param groups")
    hyper = resolve_hyper(opt, [group_hyper(g) for g in saved_groups], True, "the optimizer state dict")
    states = {}
    for i, pc in enumerate(opt.pieces):
        name = info.names[pc.param]
        st = sd["state"].get(name)
        if not st:
            continue
        shape = opt.layout.params[pc.param].shape
        piece = {}
        for k, v in st.items():
            if _is_sharded(v) or (torch.is_tensor(v) and k not in SCALAR_KEYS and tuple(v.shape) == tuple(shape)
                                  and len(shape) > 0):
                piece[k] = _piece_values(opt, info, v, name, k, i).clone()
            else:
                piece[k] = v.detach().clone() if torch.is_tensor(v) else v
        states[i] = piece
    swap.apply(states, hyper)
    return hyper
