"""The final check of benchmarks/onebit_suite.py on real ranks: one task of the suite trained by
ShardedOptimizer at 4 gloo ranks (flat, or a 2 x 2 mesh), AdamW and OneBitAdam, each rank drawing the suite's
batches for its rank. The simulation's "ours" is tests/onebit_training_reference.py, bit for bit with this
code from the freeze on; the warm-up differs from the simulation's only in the summation order of the mean
gradient (4 addends in gloo's order), so the losses agree to rounding, not bit for bit.

    python benchmarks/onebit_suite_ranks.py --task regress-seed --seed 0 --mesh flat
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def _train(rank, world_size, task_name, seed, kind, mesh):
    import torch.distributed as dist

    import onebit_suite as S
    import shardopt

    torch.set_num_threads(1)
    task = S.TASKS[task_name]
    model, batch_loss, held_loss = task.make(seed)
    kw = {}
    if mesh == "2x2":
        from torch.distributed.device_mesh import init_device_mesh
        kw["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hp = dict(lr=task.lr, betas=task.betas, eps=task.eps, weight_decay=task.weight_decay)
    if kind == "onebit":
        opt = shardopt.ShardedOptimizer(model.parameters(), optim=shardopt.OneBitAdam, freeze_step=task.freeze,
                                        **hp, **kw)
    else:
        opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, **hp, **kw)
    ddp = shardopt.ShardedDDP(model, opt)
    losses, said = [], []
    for t in range(task.steps):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            loss = batch_loss(t, rank)(ddp)
            loss.backward()
            opt.step()
            opt.zero_grad()
        said += [str(w.message) for w in got if "OneBitAdam" in str(w.message)]
        x = loss.detach().clone()
        dist.all_reduce(x)
        losses.append(x.item() / world_size)
    with torch.no_grad():
        held = float(held_loss(model))
    tail = max(1, task.steps // 8)
    return dict(final=sum(losses[-tail:]) / tail, held=held, said=said)


def main():
    from shardopt.cluster.ranks import run_ranks

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="regress-seed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mesh", default="flat", choices=["flat", "2x2"])
    a = ap.parse_args()
    out = {}
    for kind in ("adamw", "onebit"):
        out[kind] = run_ranks(_train, 4, a.task, a.seed, kind, a.mesh, timeout=1800, collective_timeout=600)[0]
    out["onebit vs adamw"] = [out["onebit"][k] / out["adamw"][k] - 1 for k in ("final", "held")]
    print(json.dumps(dict(args=vars(a), **out)))


if __name__ == "__main__":
    main()
