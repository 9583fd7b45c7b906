"""Step time of shardopt ZeRO-1/ZeRO-2 against DDP + AdamW(fused=True) and torch's ZeroRedundancyOptimizer.

Every variant trains its own copy of the same GPT (same seed, same data) in
the same processes, and steps are interleaved round-robin (variant A step,
variant B step, ...) so that the machine's noise hits all variants alike;
the report gives medians and in-run ratios to DDP. Time is split into
forward, backward (for shardopt and DDP this includes the communication not
hidden behind backward) and optimizer step (for shardopt: inner step +
all-gather; for torch ZeRO: step + broadcast).

    python benchmarks/bench_step.py                    # 2 and 4 ranks, both shapes
    python benchmarks/bench_step.py --sweep-buckets    # ZeRO-2 step time against reduce_bucket_size
    python benchmarks/bench_step.py --quick
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardopt.testing import run_ranks  # noqa: E402

SHAPES = {"compute-bound 8x128": (8, 128), "comm-bound 1x16": (1, 16)}


def _make(variant, cfg, rbs):
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    import shardopt
    from shardopt.gpt import GPT

    torch.manual_seed(0)
    model = GPT(cfg)
    kw = dict(lr=1e-3, weight_decay=0.1)
    if variant == "DDP":
        return DDP(model), torch.optim.AdamW(model.parameters(), fused=True, **kw)
    if variant == "torch ZeRO":
        return DDP(model), ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                                   fused=True, **kw)
    stage = int(variant.split("-")[1][0])
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, fused=True, stage=stage,
                                    reduce_bucket_size=rbs, allgather_bucket_size=rbs, **kw)
    del dist
    return shardopt.ShardedDDP(model, opt), opt


def _bench(rank, world_size, variants, model_name, shape, steps):
    import torch.distributed as dist

    from shardopt.gpt import PRESETS, synthetic_batch

    cfg = PRESETS[model_name]
    bsz, seq = shape
    built = [(name, *_make(kind, cfg, rbs)) for name, kind, rbs in variants]
    times = {name: {"fwd": [], "bwd": [], "step": [], "total": []} for name, *_ in built}
    losses = {name: [] for name, *_ in built}
    for step in range(steps + 2):
        x, y = synthetic_batch(cfg, bsz, seq, step, rank)
        for name, wrapper, opt in built:
            dist.barrier()
            t0 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(wrapper(x).reshape(-1, cfg.vocab), y.reshape(-1))
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t3 = time.perf_counter()
            losses[name].append(loss.item())
            if step >= 2:  # warm-up
                for k, v in (("fwd", t1 - t0), ("bwd", t2 - t1), ("step", t3 - t2), ("total", t3 - t0)):
                    times[name][k].append(v)
    med = {n: {k: statistics.median(v) for k, v in ph.items()} for n, ph in times.items()}
    return med, losses


def _table(results, ws, shape_name, steps):
    # The slowest rank's median per phase: a step is as slow as its slowest rank.
    per_rank = [r[0] for r in results]
    losses = results[0][1]
    names = list(per_rank[0])
    med = {n: {k: max(r[n][k] for r in per_rank) for k in per_rank[0][n]} for n in names}
    base = med["DDP"]["total"]
    ref_loss = losses["DDP"]
    lines = [f"### {ws} ranks, {shape_name}, {steps} interleaved steps", "",
             "| variant | fwd ms | bwd ms | step ms | total ms | x DDP | max abs loss diff to DDP |",
             "|---|---|---|---|---|---|---|"]
    for n in names:
        m = med[n]
        diff = max(abs(a - b) for a, b in zip(losses[n], ref_loss))
        lines.append(f"| {n} | {m['fwd'] * 1e3:.1f} | {m['bwd'] * 1e3:.1f} | {m['step'] * 1e3:.1f} | "
                     f"{m['total'] * 1e3:.1f} | {m['total'] / base:.2f} | {diff:.1e} |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="30m")
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--sweep-buckets", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.model, args.world_sizes, args.steps = "small", "2", 4
    if args.sweep_buckets:
        variants = [("DDP", "DDP", None)] + [(f"ZeRO-2 rbs={r / 1e6:g}M", "ZeRO-2", r)
                                            for r in (250_000, 1_000_000, 4_000_000, 16_000_000, 64_000_000)]
    else:
        variants = [("DDP", "DDP", None), ("torch ZeRO", "torch ZeRO", None),
                    ("shardopt ZeRO-1", "ZeRO-1", None), ("shardopt ZeRO-2", "ZeRO-2", None)]
    lines = [f"# Step time — {datetime.date.today().isoformat()}", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, load average at start "
             f"{os.getloadavg()[0]:.1f}, torch {torch.__version__}, gloo over 127.0.0.1, 1 thread per rank, "
             f"GPT '{args.model}', AdamW (fused=True inside every variant). Medians of the slowest rank.", ""]
    for ws in [int(w) for w in args.world_sizes.split(",")]:
        for shape_name, shape in SHAPES.items():
            res = run_ranks(_bench, ws, variants, args.model, shape, args.steps, timeout=3600,
                            collective_timeout=600)
            lines += _table(res, ws, shape_name, args.steps) + [""]
            print("\n".join(lines[-(len(variants) + 5):]), flush=True)
    report = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
