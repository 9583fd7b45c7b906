"""A torchrun worker for tests/test_cluster.py: ZeRO-1/2/3 on an emulated cluster against a single-process reference.

    torchrun ... tests/cluster_parity_worker.py --out DIR [--steps 10]

Every rank trains AwkwardNet (tests/models.py) under ShardedDDP with two
micro-batches per step (the first under no_sync) and global-norm clipping,
and beside it runs the single-process reference: every rank's micro-batches
through one copy of the model, gradients divided by the world size and
summed in fp32, clipped with torch.nn.utils.clip_grad_norm_ and stepped by
the same torch optimizer on fp32 master weights (for an fp32 model the
master is the model). Bars as in test_zero_parity.py (fp32: 1e-5 relative)
and test_mixed_precision.py (bf16 model: 2e-2). Half the cases use SGD with
momentum and the clipping norm itself is compared, since Adam and clipping
would both hide a wrong gradient scale. Stage 3 (parameters gathered in two
levels across the nodes, as its gradients are reduced) against the same
reference, fp32 with SGD-momentum and bf16 with AdamW. Each rank writes DIR/rank-<r>.json:
{"world_size", "rank", "node", "failures": [...]}.
"""
import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import AwkwardNet, batch, uses_branch  # noqa: E402

MICRO = 2
CLIP = 0.5
# (stage, model dtype, optimizer, kwargs, tolerance)
CASES = [(1, torch.float32, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), 1e-5),
         (2, torch.float32, torch.optim.SGD, dict(lr=5e-2, momentum=0.9), 1e-5),
         (1, torch.bfloat16, torch.optim.SGD, dict(lr=5e-2, momentum=0.9), 2e-2),
         (2, torch.bfloat16, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), 2e-2),
         (3, torch.float32, torch.optim.SGD, dict(lr=5e-2, momentum=0.9), 1e-5),
         (3, torch.bfloat16, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), 2e-2)]


def _loss(fn, step, rank, micro):
    x, y = batch(step, rank, micro)
    out = fn(x, uses_branch(step, rank)).float()
    return nn.functional.cross_entropy(out.reshape(-1, 37), y.reshape(-1)) / MICRO


def _reference_step(model, master, opt, world_size, step):
    """One step of the single-process reference; returns (each rank's loss, the global gradient norm)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads, losses = [None] * len(trainable), []
    for r in range(world_size):
        model.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(MICRO):
            loss = _loss(model, step, r, m)
            loss.backward()
            total += loss.item()
        losses.append(total)
        for i, p in enumerate(trainable):
            if p.grad is not None:
                g = p.grad.float() / world_size
                grads[i] = g if grads[i] is None else grads[i] + g
    for m, g in zip(master, grads):
        m.grad = g
    norm = torch.nn.utils.clip_grad_norm_([m for m in master if m.grad is not None], CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        for m, p in zip(master, trainable):
            p.copy_(m)
    return losses, float(norm)


def run_case(rank, world_size, steps, stage, dtype, optim, kw, tol):
    import shardopt

    what = f"stage {stage} {str(dtype).split('.')[-1]} {optim.__name__}"
    torch.manual_seed(0)
    model = AwkwardNet().to(dtype)
    ref = AwkwardNet().to(dtype)
    ref.load_state_dict(model.state_dict())
    master = [p.detach().float().clone() for p in ref.parameters() if p.requires_grad]
    ref_opt = optim(master, **kw)
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=optim, stage=stage, reduce_bucket_size=1000, **kw)
    wrapper = shardopt.ShardedDDP(model, opt)
    failures = []
    # Ranks on several nodes: node-aware collectives are on by default (Note [Two-level collectives]).
    nodes = world_size // int(os.environ["LOCAL_WORLD_SIZE"])
    if nodes > 1 and (opt.sharding.nodes is None or opt.sharding.nodes.replicas != nodes
                      or (stage == 3 and opt.store.gather.route != "two-level")):
        failures.append(f"{what}: node-aware collectives are not on over {nodes} nodes ({opt.sharding.nodes})")
    for step in range(steps):
        total = 0.0
        for m in range(MICRO):
            if m < MICRO - 1:
                with wrapper.no_sync():
                    loss = _loss(wrapper, step, rank, m)
                    loss.backward()
            else:
                loss = _loss(wrapper, step, rank, m)
                loss.backward()
            total += loss.item()
        norm = float(opt.clip_grad_norm(CLIP))
        opt.step()
        opt.zero_grad()
        ref_losses, ref_norm = _reference_step(ref, master, ref_opt, world_size, step)
        for name, got, want in (("loss", total, ref_losses[rank]), ("grad norm", norm, ref_norm)):
            if abs(got - want) > tol * max(1.0, abs(want)):
                failures.append(f"{what} step {step}: {name} {got!r} vs reference {want!r}")
    with opt.full_params(writeback=False):  # stage 3: whole weights only inside
        for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
            err = ((p.float() - q.float()).abs().max() / p.float().abs().max().clamp_min(1e-12)).item()
            if err > tol:
                failures.append(f"{what}: final {name} relative error {err:.2e} > {tol}")
    if any(p.dtype != dtype for p in model.parameters()):
        failures.append(f"{what}: model parameters are no longer {dtype}")
    return failures


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=60, help="process group timeout, seconds")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    failures = []
    for case in CASES:
        failures += run_case(rank, world_size, a.steps, *case)
    with open(os.path.join(a.out, f"rank-{rank}.json"), "w") as f:
        json.dump({"world_size": world_size, "rank": rank, "node": int(os.environ.get("GROUP_RANK", -1)),
                   "failures": failures}, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # torch 2.13 gloo can abort at interpreter exit (README, pytorch/pytorch#190489)


if __name__ == "__main__":
    main()
