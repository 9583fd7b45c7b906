"""Elastic training: checkpoint every k steps, and after a lost node resume from `latest` at the new world size.

On every node (NODE0 is the address of the node that hosts the rendezvous;
it must be one that survives, see below):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --nproc-per-node 2 --max-restarts 1 \\
        --rdzv-backend c10d --rdzv-endpoint NODE0:29400 --rdzv-id job42 --local-addr THIS_NODE \\
        --rdzv-conf last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3 \\
        examples/elastic_train.py --ckpt /shared/ckpt --steps 200 --save-every 20

(The --rdzv-conf timings make a restart take seconds: by default torchrun
waits 15 s for a lost node's heartbeats to expire, then 30 s for late joiners.)

If a node dies, the ranks left raise (a peer was lost) within the process
group's timeout; torchrun restarts them (--max-restarts 1) in a new
rendezvous of the nodes still there (--nnodes 1:2: one is enough), and this
script loads the newest checkpoint, at the new world size, and goes on from
the step and data position saved with it. The run ends with the same weights
as one that was never interrupted (the steps after the checkpoint are done
again, on the same data), because the data is cut into the same *global*
batches whatever the world size: each rank takes its equal share of a global
batch, and ShardedDDP averages the shares' gradients.

Checkpoints are saved with blocking=False: each rank's part is copied to host
memory and written by a background thread while training goes on; `latest`
moves once every rank's part is on disk, so a node lost while one is being
written leaves `latest` on the one before (--blocking-save saves in the step).

Run it on one machine with two emulated nodes: tests/test_cluster.py
(test_elastic_resume_after_losing_a_node) does, and checks the weights.

Note [Restarts and the launcher's shared store]
-----------------------------------------------
By default (torch >= 2.4) the workers of every attempt use one TCPStore that
the launcher of node rank 0 creates for the first rendezvous and keeps
across restarts (torch's `_create_c10d_store` assumes "a new TCPStore for
every retry", which no longer holds). The keys of the dead attempt stay in
it, and the new attempt's init_process_group uses the same key names (the
group counter restarts at 0 in the new processes): a rank that reads a
peer's address before that peer has overwritten it gets the dead process's,
and gloo fails with "connectFullMesh failed ... Connection refused" (seen:
the refused address was the one the dead attempt's rank had reported as
"Connection closed by peer") or waits for a connection that never comes
until its timeout. It is a race, which is why a restart sometimes works.
With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the launcher's environment,
rank 0 of each attempt creates a fresh store, so each attempt starts clean.
Known upstream as pytorch/pytorch#135712 (closed, still happening in 2.13).
Measured on the emulated cluster: benchmarks/results/2026-11-23-elastic-restarts.md.

The rendezvous store itself (--rdzv-backend c10d) lives in the torchrun of
the node named by --rdzv-endpoint; if that node is lost, nothing can
rendezvous again. Host the endpoint on the node least likely to fail, or use
an etcd rendezvous for full fault tolerance.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

FEATURES, HIDDEN, CLASSES = 32, 64, 10


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, CLASSES))


def make_data(size: int = 2048):
    """A fixed synthetic classification set: every process builds the same one."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(size, FEATURES, generator=g)
    y = (x[:, :CLASSES] * torch.arange(1, CLASSES + 1)).argmax(dim=1)
    return x, y


class GlobalBatches:
    """The data loader: a new shuffle per epoch, cut into global batches; its position is its state.

    Each rank takes rows rank, rank + world_size, ... of every global batch, so
    the batches (and so the weights) do not depend on the world size.
    """

    def __init__(self, size: int, global_batch: int, seed: int = 0):
        self.size, self.global_batch, self.seed = size, global_batch, seed
        self.epoch, self.position = 0, 0

    def next_global(self) -> torch.Tensor:
        if self.position + self.global_batch > self.size:
            self.epoch, self.position = self.epoch + 1, 0
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        idx = order[self.position:self.position + self.global_batch]
        self.position += self.global_batch
        return idx

    def next_local(self, rank: int, world_size: int) -> torch.Tensor:
        if self.global_batch % world_size:
            raise ValueError(f"global batch {self.global_batch} does not split evenly over {world_size} ranks")
        return self.next_global()[rank::world_size]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


def make_optimizer_kwargs() -> dict:
    """The inner optimizer and its settings (a single-process reference uses the same)."""
    return dict(optim=torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def loss_of(model, x, y):
    return F.cross_entropy(model(x), y)


def train(a) -> None:
    import shardopt

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    model = build_model()
    opt = shardopt.ShardedOptimizer(model.parameters(), **make_optimizer_kwargs(), stage=a.stage)
    model = shardopt.ShardedDDP(model, opt)
    x_all, y_all = make_data()
    loader = GlobalBatches(len(x_all), a.global_batch)
    step, saving = 0, None
    if os.path.exists(os.path.join(a.ckpt, "latest")):
        extra = shardopt.load_checkpoint(a.ckpt, model, opt)
        step = extra["step"]
        loader.load_state_dict(extra["loader"])
    if rank == 0:
        print(f"attempt {attempt}: world size {world}, starting at step {step}", flush=True)
        if (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0
                and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1"):
            print("warning: restarts need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment "
                  "(Note [Restarts and the launcher's shared store] in this file)", file=sys.stderr, flush=True)
    try:
        while step < a.steps:
            t0 = time.monotonic()
            idx = loader.next_local(rank, world)
            loss_of(model, x_all[idx], y_all[idx]).backward()
            opt.clip_grad_norm(a.clip)
            opt.step()
            opt.zero_grad()
            step += 1
            if step % a.save_every == 0 or step == a.steps:
                # The save before waits first, and raises here on every rank if it failed.
                extra = {"step": step, "loader": loader.state_dict()}
                saving = shardopt.save_checkpoint(a.ckpt, model, opt, extra=extra, blocking=a.blocking_save)
            if rank == 0 and a.progress:
                with open(a.progress, "a") as f:
                    f.write(f"{attempt} {world} {step} {time.time():.3f}\n")
            time.sleep(max(0.0, a.step_time - (time.monotonic() - t0)))
        if saving is not None and not a.blocking_save:
            saving.result()  # the last checkpoint on disk before the process group goes
    except Exception as e:  # noqa: BLE001 - say so on this rank, then fail (torchrun restarts us)
        print(f"[rank {rank} of {world}, attempt {attempt}] stopped at step {step + 1} at t={time.time():.3f}: "
              f"a peer was lost or a collective failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # not through interpreter shutdown: gloo threads may still hold the dead sockets
    if rank == 0 and a.out:
        torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()}, a.out)
        print(f"done: {step} steps at world size {world}; weights in {a.out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint directory, on storage every node sees")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--blocking-save", action="store_true", help="save in the step (default: written behind it)")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=30, help="process group timeout, seconds")
    ap.add_argument("--out", help="rank 0 saves the final weights here (torch.save)")
    ap.add_argument("--progress", help="rank 0 appends 'attempt world_size step unix_time' here after every step")
    ap.add_argument("--step-time", type=float, default=0.0,
                    help="make every step last at least this long (seconds; demos and tests)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    train(a)
    sys.stdout.flush()
    os._exit(0)  # torch 2.13 gloo can abort at interpreter exit (README, pytorch/pytorch#190489)


if __name__ == "__main__":
    main()
