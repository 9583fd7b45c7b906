"""`run_ranks` on an emulated cluster: fn(rank, world_size, *args) on nodes x nproc ranks started by torchrun.

    with EmulatedCluster(2, "1gbit") as c:
        results = run_ranks_on_cluster(c, 2, 2, my_module.fn, arg)    # [fn's result on rank r]

run_ranks' contract, so a benchmark runs across emulated nodes unchanged; fn and its arguments travel in a
file to node_rank_worker.py (a `__main__` script is loaded again there, its main block not run).
"""
from __future__ import annotations

import os
import sys
import tempfile

import torch

from shardopt.cluster.ranks import RankFailure

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "node_rank_worker.py")


def run_ranks_on_cluster(cluster, nodes: int, nproc: int, fn, *args, timeout: float = 600,
                         collective_timeout: float = 60, threads: int = 1, **kwargs):
    if fn.__module__ == "__main__":
        module, path = None, os.path.abspath(sys.modules["__main__"].__file__)
    else:
        module, path = fn.__module__, None
    spec = dict(module=module, path=path, name=fn.__qualname__, args=args, kwargs=kwargs, sys_path=list(sys.path),
                collective_timeout=collective_timeout, threads=threads)
    world = nodes * nproc
    with tempfile.TemporaryDirectory(prefix="shardopt-cluster-ranks-") as tmp:
        torch.save(spec, os.path.join(tmp, "spec.pt"))
        rdzv_id, port = cluster.new_job()
        logs = [os.path.join(tmp, f"node{i}.log") for i in range(nodes)]
        procs = [cluster.torchrun(i, nproc, WORKER, [tmp], nnodes=nodes, log=logs[i], rdzv_id=rdzv_id, port=port,
                                  threads=threads)
                 for i in range(nodes)]
        try:
            codes = cluster.wait(procs, timeout)
        except TimeoutError as e:
            codes = [str(e)] * nodes
        out, errors = {}, {}
        for r in range(world):
            path_r = os.path.join(tmp, f"rank-{r}.pt")
            if not os.path.exists(path_r):
                errors[r] = "no result"
                continue
            ok, value = torch.load(path_r, weights_only=False)
            (out if ok else errors)[r] = value
        if errors or any(c != 0 for c in codes):
            tails = "".join(f"\n--- node {i} (exit {c}), last lines ---\n" + _tail(p) for i, (c, p) in
                            enumerate(zip(codes, logs)))
            raise RankFailure("".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())) + tails)
        return [out[r] for r in range(world)]


def _tail(path: str, lines: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
