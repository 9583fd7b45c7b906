"""On one GPU: torch's clip_grad_norm_(model.parameters()) under ShardedDDP, against opt.clip_grad_norm and
against the same torch call over DDP's plain gradients, at 8000 and 500 parameter tensors (bench_idioms.py's
MLP, width 64); the three totals compared bit for bit.

    python benchmarks/clip_on_device.py        # world size 1, NCCL, cuda:0; without a GPU: one line, exit 0

Each time: the median of 25 calls between torch.cuda.synchronize() calls, on norms cached by one backward.
Results: benchmarks/results/2026-11-26-idioms.md (Note [torch's total norm in one piece] in
shardopt/sharded_grad.py).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_idioms import ManyLayers  # noqa: E402


def _ms(fn, calls: int = 25) -> float:
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    if not torch.cuda.is_available():
        print("clip_on_device: no CUDA device here; nothing to measure")
        return 0
    from shardopt import ShardedDDP, ShardedOptimizer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29771")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    clip = torch.nn.utils.clip_grad_norm_
    for tensors, width in ((8000, 64), (500, 64)):
        torch.manual_seed(0)
        module = ManyLayers(tensors, width).cuda()
        ref = ManyLayers(tensors, width).cuda()
        ref.load_state_dict(module.state_dict())
        ddp = torch.nn.parallel.DistributedDataParallel(ref)
        opt = ShardedOptimizer(module.parameters(), torch.optim.AdamW, lr=1e-3, fused=True)
        model = ShardedDDP(module, opt)
        x = torch.randn(8, width, device="cuda")
        model(x).square().mean().backward()
        ddp(x).square().mean().backward()
        total = clip(model.parameters(), 1e9)
        each = torch.linalg.vector_norm(torch.stack(list(torch._foreach_norm([p.grad for p in model.parameters()], 2))))
        plain = clip(ddp.parameters(), 1e9)
        print(f"{tensors} tensors, width {width}: total one-piece {total.item():.9g}, per-gradient {each.item():.9g}, "
              f"equal={torch.equal(total, each)}; DDP plain {plain.item():.9g} "
              f"(rel diff {abs(total.item() - plain.item()) / plain.item():.2e})")
        print(f"  ms per call: torch idiom (shardopt) {_ms(lambda: clip(model.parameters(), 1e9)):.2f}, "
              f"opt.clip_grad_norm {_ms(lambda: opt.clip_grad_norm(1e9)):.2f}, "
              f"torch idiom (DDP, plain grads) {_ms(lambda: clip(ddp.parameters(), 1e9)):.2f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
