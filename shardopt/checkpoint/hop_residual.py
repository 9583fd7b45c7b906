"""The int8 inter-node hop's error-feedback residual in checkpoints.

Note [Hop residual in checkpoints]
----------------------------------
With inter_node_dtype="int8" every rank keeps what its hop's rounding lost (Note [Compressed inter-node hop]
in csrc/comm/replica_hop.h), chunk + chunk / R fp32 values per bucket, added back at the next hop: training
state, which a resume without it loses (tests/test_hybrid.py measures how much). It belongs to a *rank*, not
to parameters, and is laid out by the engine's buckets: it means something only at the same mesh and buckets.

Save: every rank writes `hop-residual-r<replica>-s<shard>.bin` into the first replica's `.partial-<tag>/`
(rank s of replica 0 hands its peers the directory and collects their entries), so the manifest lists each
file with its checksum and signature (hop format, mesh, buckets). Load: a rank whose signature matches
installs its file once every rank staged the load; otherwise it restarts from zero, and rank 0 says why.
"""
from __future__ import annotations

import dataclasses
import os
import warnings

import torch
import torch.distributed as dist

from shardopt.files import RecordWriter

FILE = "hop-residual-r{replica:03d}-s{shard:05d}.bin"


def live(opt) -> torch.Tensor | None:
    """This rank's residual (the engine's, or OneBitAdam's: Note [1-bit Adam under ZeRO]), or None."""
    onebit = opt.onebit
    if onebit is not None:
        return onebit.residual if onebit.residual.numel() else None
    engine = opt.engine
    return None if engine is None else engine.hop_residual


def signature(opt) -> dict:
    """What must be equal for a saved residual to mean the same here."""
    shape = opt.sharding.shape
    onebit = opt.onebit
    out = {"format": onebit.format_name if onebit is not None else opt.config.hop_format(),
           "mesh": [shape.replicas, shape.shards],
           "buckets": [[b.group, b.start, b.numel] for b in opt.layout.buckets]}
    nodes = getattr(opt.sharding, "nodes", None)
    if nodes is not None:  # node-aware flat sharding: its residual is laid out by node chunk
        out["nodes"] = [nodes.replicas, nodes.shards]
    return out


def _write(partial: str, opt, residual: torch.Tensor) -> dict:
    """Writes this rank's residual file; returns {"files": {name: entry}} or {"error": why}."""
    replica, shard = opt.sharding.replica, opt.rank
    try:
        name = FILE.format(replica=replica, shard=shard)
        w = RecordWriter(os.path.join(partial, name))
        try:
            ref = w.add(residual)
        except BaseException:
            w.abort()
            raise
        entry = w.close()
        entry["hop_residual"] = {"replica": replica, "shard": shard, "ref": ref, "signature": signature(opt)}
        return {"files": {name: entry}}
    except Exception as e:  # noqa: BLE001 - the first replica must learn of it and abandon the save
        return {"error": f"replica {replica} shard {shard}: writing the hop residual: {type(e).__name__}: {e}"}


class Share:
    """Replica 0's side of the save: called with the directory, returns every replica's file entries (or
    raises after the exchange); `abandon()` tells the peers when the save failed before there was one."""

    def __init__(self, opt, residual: torch.Tensor):
        self.opt, self.residual, self.started = opt, residual, False

    def __call__(self, partial: str | None) -> dict:
        from shardopt.files import CheckpointError

        self.started = True
        group = self.opt.sharding.replicate
        dist.broadcast_object_list([partial], group=group, group_src=0)
        if partial is None:
            return {}
        everyone: list = [None] * dist.get_world_size(group)
        dist.gather_object(_write(partial, self.opt, self.residual), everyone, group=group, group_dst=0)
        if errors := [m["error"] for m in everyone if "error" in m]:
            raise CheckpointError("; ".join(errors))
        return {name: entry for m in everyone for name, entry in m["files"].items()}

    def abandon(self) -> None:
        if not self.started:
            self(None)


def contribute(opt, residual: torch.Tensor) -> None:
    """The other replicas' side of the save: their residual file, into the directory replica 0 made."""
    group = opt.sharding.replicate
    box = [None]
    dist.broadcast_object_list(box, group=group, group_src=0)
    if box[0] is not None:
        dist.gather_object(_write(box[0], opt, residual), None, group=group, group_dst=0)


@dataclasses.dataclass
class Staged:
    values: torch.Tensor | None  # the saved residual, verified; None: it restarts from zero
    reason: str | None  # why it restarts from zero


def write_own(opt, residual: torch.Tensor):
    """Flat sharding (every rank writes the checkpoint): this rank's residual file, for _save's `share`."""
    def share(partial: str) -> dict:
        from shardopt.files import CheckpointError

        out = _write(partial, opt, residual)
        if "error" in out:
            raise CheckpointError(out["error"])
        return out["files"]
    return share


def stage(src, opt) -> Staged | None:
    """Reads this rank's saved residual if it applies here; None when this rank keeps no residual."""
    here = live(opt)
    if here is None:
        return None
    mine = signature(opt)
    saved = src.hop_residual_signature()
    if saved is None:
        return Staged(None, f"{src.directory} holds none (it was not saved with that compression)")
    if saved["format"] != mine["format"]:
        return Staged(None, f"it was saved by the {saved['format']} format, this run's is {mine['format']}")
    if saved["mesh"] != mine["mesh"]:
        return Staged(None, f"it was saved at mesh {tuple(saved['mesh'])} (replicas, shards) and this run's is "
                            f"{tuple(mine['mesh'])}")
    if saved != mine:
        return Staged(None, "it was saved with other buckets (another reduce_bucket_size, parameters or param "
                            "groups), and it is laid out by bucket")
    values = src.hop_residual(opt.sharding.replica, opt.rank)
    if values is None or values.shape != here.shape or values.dtype != here.dtype:
        got = "none" if values is None else f"{values.dtype} {tuple(values.shape)}"
        return Staged(None, f"the saved one of replica {opt.sharding.replica} shard {opt.rank} is {got}, this "
                            f"rank's is {here.dtype} {tuple(here.shape)}")
    return Staged(values, None)


def install(opt, staged: Staged | None) -> None:
    """After the ranks agreed: the saved residual, or zeros and one warning (world rank 0)."""
    if staged is None:
        return
    if staged.values is not None:
        live(opt).copy_(staged.values)
        return
    onebit = opt.onebit
    if onebit is not None:
        onebit.reset_residual()
    else:
        opt.engine.reset_hop_residual()  # it held the error of other weights
    what = "OneBitAdam's error-feedback residuals restart" if onebit is not None else \
        "the int8 inter-node hop's error-feedback residual restarts"
    if dist.get_rank(opt.world_group) == 0:
        warnings.warn(f"load_checkpoint: {what} from zero: "
                      f"{staged.reason}. Training goes on; only the rounding errors in flight at the save are "
                      "lost (Note [Hop residual in checkpoints])", stacklevel=3)
