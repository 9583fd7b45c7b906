"""How far DDP parts from itself by summation order alone: the wide AwkwardNet of tests/models.py trained
8 steps as test_stage3.py trains it (AdamW lr 1e-2 wd 0.1, or SGD-momentum; clipping at 0.5), by DDP with
its default 25 MB bucket and by DDP with a 0.05 MB one (gloo's ring adds an element's W addends in an order
that depends on where the element falls in its bucket). The largest relative difference of the final weights
is the floor under any parity bar against DDP on this model: test_stage3.py keeps this model on SGD because
with AdamW stage 3 parts from DDP by 1-7e-5 at 3 and 4 ranks, inside what DDP does to itself.

    python benchmarks/ddp_summation_order.py
"""
import copy
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def train(rank, world_size, optim):
    from models import VOCAB, WIDE, AwkwardNet, batch, uses_branch
    torch.manual_seed(0)
    base = AwkwardNet(**WIDE)
    out = []
    for cap in (25, 0.05):
        m = copy.deepcopy(base)
        ddp = DDP(m, find_unused_parameters=True, bucket_cap_mb=cap)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) if optim == "adamw" else \
            torch.optim.SGD(m.parameters(), lr=5e-2, momentum=0.9, weight_decay=0.01)
        for step in range(8):
            x, y = batch(step, rank, 0)
            loss = torch.nn.functional.cross_entropy(ddp(x, uses_branch(step, rank)).reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        out.append({n: p.detach().clone() for n, p in m.named_parameters()})
    worst = max(((out[0][n] - out[1][n]).abs().max() / out[0][n].abs().max().clamp_min(1e-12)).item() for n in out[0])
    return worst


if __name__ == "__main__":
    import platform

    from shardopt.cluster.ranks import run_ranks
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
    for optim in ("adamw", "sgd"):
        for w in (2, 3, 4):
            r = run_ranks(train, w, optim)
            print(f"{optim} {w} ranks: DDP (25 MB buckets) against DDP (0.05 MB), largest relative difference of "
                  f"the final weights {max(r):.2e}", flush=True)
