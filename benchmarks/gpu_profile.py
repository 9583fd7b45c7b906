"""Where shardopt's step time and host syncs go on one GPU: DDP, ZeRO-2 and ZeRO-3 on the demo GPT, AdamW fp32,
world size 1 (NCCL), each step with torch's clip_grad_norm_(model.parameters(), 1.0) as the HF Trainer clips.

    PYTHONPATH=. python benchmarks/gpu_profile.py [small|30m]     # on a machine with a GPU
    DEV=cpu PYTHONPATH=. python benchmarks/gpu_profile.py tiny    # a dry run of the script, on the CPU

Prints, per contender: the Python stack of each host sync torch reports in one step
(torch.cuda.set_sync_debug_mode("warn"); syncs raised inside shardopt._C's engine carry no Python stack),
the phases' times between synchronize() calls (median of 20), and torch.profiler's tables over 10 steps.
Results: benchmarks/results/2026-11-26-gpu-check.md.
"""
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

import shardopt
from shardopt.tools.gpt import GPT, PRESETS, synthetic_batch

CUDA = os.environ.get("DEV", "cuda") == "cuda"
CONTENDERS = ("ddp", "zero2", "zero3")


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def loss_of(out, y):
    return nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


def build(kind, c, dev):
    torch.manual_seed(0)
    model = GPT(c).to(dev)
    if kind == "ddp":
        return DistributedDataParallel(model), torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=int(kind[-1]), lr=1e-3,
                                    weight_decay=0.1)
    return shardopt.ShardedDDP(model, opt), opt


def step(wrapper, opt, batch) -> None:
    x, y = batch
    loss_of(wrapper(x), y).backward()
    torch.nn.utils.clip_grad_norm_(wrapper.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def sync_stacks(wrapper, opt, batch) -> list[str]:
    """The Python stack of each host sync torch reports during one step."""
    seen = []

    def show(message, *args, **kwargs):
        if "called a synchronizing CUDA operation" in str(message):  # not torch's note that the mode is a prototype
            seen.append("".join(traceback.format_stack(limit=9)[:-2]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        if CUDA:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            step(wrapper, opt, batch)
        finally:
            if CUDA:
                torch.cuda.set_sync_debug_mode(0)
    return seen


def phases(wrapper, opt, batches, n=20) -> dict[str, float]:
    """Median ms of each phase, synchronize() between phases."""
    times = {"fwd": [], "bwd": [], "clip": [], "step": [], "zero": []}
    for i in range(n):
        x, y = batches[i % len(batches)]
        sync()
        t0 = time.perf_counter()
        loss = loss_of(wrapper(x), y)
        marks = [t0]
        for work in (lambda: None, loss.backward, lambda: torch.nn.utils.clip_grad_norm_(wrapper.parameters(), 1.0),
                     opt.step, opt.zero_grad):
            work()
            sync()
            marks.append(time.perf_counter())
        for (name, values), a, b in zip(times.items(), marks[:-1], marks[1:]):
            values.append(b - a)
    return {name: round(statistics.median(v) * 1e3, 2) for name, v in times.items()}


def main(model_name: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if CUDA else "gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1),
                                rank=0, world_size=1)
        dev = torch.device("cuda", 0) if CUDA else torch.device("cpu")
        if CUDA:
            torch.cuda.set_device(dev)
        c = PRESETS[model_name]
        batches = [tuple(t.to(dev) for t in synthetic_batch(c, 8, c.seq, i, 0)) for i in range(8)]
        runs = {k: build(k, c, dev) for k in CONTENDERS}
        for wrapper, opt in runs.values():
            for i in range(5):
                step(wrapper, opt, batches[i % len(batches)])
        sync()

        print("== host syncs in one step (Python stacks)")
        for k, (wrapper, opt) in runs.items():
            stacks = sync_stacks(wrapper, opt, batches[0])
            print(f"-- {k}: {len(stacks)}")
            print("\n".join(stacks))
        print("== phases (ms, median of 20; synchronize() between phases)")
        for k, (wrapper, opt) in runs.items():
            ph = phases(wrapper, opt, batches)
            print(k, ph, "total", round(sum(ph.values()), 2))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
        for k, (wrapper, opt) in runs.items():
            with profile(activities=activities) as prof:
                for i in range(10):
                    step(wrapper, opt, batches[i % len(batches)])
                sync()
            print(f"== profile {k}, 10 steps, by self CPU time")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
            if CUDA:
                print(f"== profile {k}, 10 steps, by CUDA time")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "small")
