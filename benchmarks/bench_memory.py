"""Per-rank memory of parameters, gradients and optimizer state after a step.

Compares DDP + AdamW with shardopt ZeRO-1 and ZeRO-2 at world sizes 2 and 4 on
gloo (CPU), against the ideal bytes per parameter for fp32 Adam:
  DDP    4 (params) + 4 (grads) + 8 (Adam state)           = 16
  ZeRO-1 4 + 4 + 12/N                                      (full grads, plus the reduced
                                                           gradient shard and Adam state)
  ZeRO-2 4 + (4 + 8)/N = 4 + 12/N                          (grads sharded too)
With offload="cpu" the master copy, gradient shard and Adam state move to
host memory, so what stays with the model is its parameters and the staging
buffers ("on device" column; on this CPU-only machine both are host RAM, but
they are separate tensors and are counted separately). A bf16 model adds
fp32 master chunks (4/N) and halves parameters (2):
  ZeRO-2 fp32 offload  4 + (4 + 4 + 8)/N = 4 + 16/N (a separate master), on device 4
  ZeRO-2 bf16          2 + (4 + 4 + 8)/N = 2 + 16/N, on device 2 + 16/N
  ZeRO-2 bf16 offload                     on device 2 (+ staging)
Two measurements: counting the tensors each holds, and the growth of the
process's resident set (RSS) from before the model is built to after 3 steps,
which also sees what counting misses (DDP's bucket copies of the gradients,
our staging buffers, allocator slack).

    python benchmarks/bench_memory.py [--model 30m] [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardopt.cluster.ranks import run_ranks  # noqa: E402


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# variant -> (stage, offload, model dtype)
SHARDED = {"zero1": (1, "none", torch.float32), "zero2": (2, "none", torch.float32),
           "zero2+offload": (2, "cpu", torch.float32), "zero2 bf16": (2, "none", torch.bfloat16),
           "zero2 bf16+offload": (2, "cpu", torch.bfloat16)}
ROLES = ("params", "master", "grads", "optimizer_state", "staging")


def _measure(rank, world_size, variant, model_name):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import shardopt
    from shardopt.tools.gpt import GPT, PRESETS, num_params, synthetic_batch

    cfg = PRESETS[model_name]
    gc.collect()
    before = _rss()
    torch.manual_seed(0)
    model = GPT(cfg)
    n = num_params(model)
    if variant != "ddp":
        model = model.to(SHARDED[variant][2])
    if variant == "ddp":
        wrapper = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    else:
        stage, offload, _ = SHARDED[variant]
        # AdamW either way: torch's fused one with the model, the fused CPU Adam (the default) offloaded.
        kw = dict(optim=torch.optim.AdamW, fused=True) if offload == "none" else {}
        opt = shardopt.ShardedOptimizer(model.parameters(), lr=1e-3, stage=stage, offload=offload, **kw)
        wrapper = shardopt.ShardedDDP(model, opt)
    for step in range(3):
        x, y = synthetic_batch(cfg, 2, 16, step, rank)
        torch.nn.functional.cross_entropy(wrapper(x).reshape(-1, cfg.vocab), y.reshape(-1)).backward()
        opt.step()
        if variant != "ddp":
            opt.zero_grad()
    gc.collect()
    grown = _rss() - before
    if variant == "ddp":
        params = list(model.parameters())
        counted = {"params": sum(p.numel() * 4 for p in params),
                   "grads": sum(p.numel() * 4 for p in params if p.grad is not None),
                   "optimizer_state": sum(v.numel() * v.element_size() for s in opt.state.values()
                                          for v in s.values() if torch.is_tensor(v) and v.numel() > 1),
                   "master": 0, "staging": 0}
        counted["on_device"] = sum(counted[k] for k in ROLES)
    else:
        counted = opt.memory_stats()
    dist.barrier()
    return n, counted, grown


IDEAL = {"ddp": lambda n: 16.0, "zero1": lambda n: 8 + 12 / n, "zero2": lambda n: 4 + 12 / n,
         "zero2+offload": lambda n: 4 + 16 / n, "zero2 bf16": lambda n: 2 + 16 / n,
         "zero2 bf16+offload": lambda n: 2 + 16 / n}
# What stays on the model's device (staging excluded).
IDEAL_ON_DEVICE = dict(IDEAL, **{"zero2+offload": lambda n: 4.0, "zero2 bf16+offload": lambda n: 2.0})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="30m")
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--quick", action="store_true", help="small model, world size 2 only")
    ap.add_argument("--out", default=None, help="markdown report path")
    args = ap.parse_args()
    if args.quick:
        args.model, args.world_sizes = "small", "2"
    # glibc raises its mmap threshold after large frees and then keeps freed
    # blocks in the heap, so RSS would show every tensor ever freed. A fixed
    # threshold returns large blocks to the OS: RSS then tracks live memory.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    rows = []
    for ws in [int(w) for w in args.world_sizes.split(",")]:
        for variant in ("ddp",) + tuple(SHARDED):
            res = run_ranks(_measure, ws, variant, args.model, timeout=900)
            n, counted, grown = res[0]
            total = sum(counted[k] for k in ROLES)
            ideal = IDEAL[variant](ws) * n
            excess = (total - counted["staging"]) / ideal - 1
            rows.append((ws, variant, n, counted, total, grown, ideal, excess,
                         max(r[2] for r in res)))
    lines = [f"# Memory per rank — {datetime.date.today().isoformat()}", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo, "
             f"GPT '{args.model}' ({rows[0][2] / 1e6:.1f}M parameters), AdamW, fp32 unless the row says bf16. "
             "Bytes per parameter; 'ideal' is the table in bench_memory.py's docstring.", "",
             "| ws | variant | params | master | grads | opt state | staging | counted B/param | ideal | counted - staging vs ideal | on device (ideal) | RSS growth B/param (max rank) | RSS vs DDP |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ddp_rss = {r[0]: r[8] for r in rows if r[1] == "ddp"}
    for ws, variant, n, c, total, grown, ideal, excess, max_grown in rows:
        lines.append(f"| {ws} | {variant} | {c['params'] / n:.2f} | {c['master'] / n:.2f} | {c['grads'] / n:.2f} | "
                     f"{c['optimizer_state'] / n:.2f} | {c['staging'] / n:.2f} | {total / n:.2f} | "
                     f"{ideal / n:.2f} | {excess * 100:+.1f}% | {c['on_device'] / n:.2f} "
                     f"({IDEAL_ON_DEVICE[variant](ws):.2f} + staging) | {max_grown / n:.2f} | "
                     f"{max_grown / ddp_rss[ws]:.2f}x |")
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
