"""`shardopt demo`: CPU ranks train a small GPT with ZeRO and print loss, memory per rank next to DDP's,
and step time. Runs on every rank of an initialized gloo group (the CLI launches torchrun)."""
from __future__ import annotations

import os
import time


def _mib(n: float) -> str:
    return f"{n / 2**20:8.1f} MiB"


def _train(wrapper, opt, cfg, args, rank, steps, label):
    """Trains `steps` steps with a progress bar on rank 0; returns (losses, median step time)."""
    import torch

    from shardopt.tools.gpt import synthetic_batch
    from shardopt.tools.progress import ProgressBar

    loss_fn = torch.nn.CrossEntropyLoss()
    bar = ProgressBar(steps, label, enabled=rank == 0)
    times, losses = [], []
    for step in range(steps):
        x, y = synthetic_batch(cfg, args.batch, args.seq, step, rank)
        t0 = time.perf_counter()
        loss_t = loss_fn(wrapper(x).reshape(-1, cfg.vocab), y.reshape(-1))
        loss_t.backward()
        if hasattr(opt, "clip_grad_norm"):
            opt.clip_grad_norm(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(wrapper.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss_t.item())
        bar.update(step + 1, f"loss {losses[-1]:7.4f}  {times[-1] * 1e3:7.1f} ms/step")
    times = sorted(times[2:] or times)
    return losses, times[len(times) // 2]


def _sharded(model, args):
    import torch

    import shardopt

    common = dict(lr=3e-3, weight_decay=0.1, stage=args.stage, reduce_bucket_size=args.bucket)
    if args.offload == "cpu":
        # The offloaded step runs shardopt's fused CPU Adam on the host copies.
        return shardopt.ShardedOptimizer(model.parameters(), optim=shardopt.CPUAdam, adamw=True, offload="cpu",
                                         **common)
    return shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, fused=True, **common)


def run(args) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import shardopt
    from shardopt.tools.gpt import GPT, PRESETS, num_params

    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cfg = PRESETS[args.model]
    args.seq = args.seq or min(64, cfg.seq)
    if args.seq > cfg.seq:
        raise ValueError(f"--seq {args.seq} is longer than GPT '{args.model}' supports ({cfg.seq})")

    def say(*a):
        if rank == 0:
            print(*a, flush=True)

    torch.manual_seed(0)
    model = GPT(cfg)
    n = num_params(model)
    name = f"ZeRO-{args.stage}" + ("+offload" if args.offload == "cpu" else "")
    say(f"shardopt demo: GPT '{args.model}' with {n / 1e6:.2f}M parameters, {ws} gloo ranks, {name}, AdamW, "
        f"batch {args.batch}x{args.seq} per rank, {args.steps} steps")
    opt = _sharded(model, args)
    wrapper = shardopt.ShardedDDP(model, opt)
    losses, step_time = _train(wrapper, opt, cfg, args, rank, args.steps, name)
    mem = opt.memory_stats()

    # The same model under DDP + AdamW(fused=True) for a few steps, for the comparison.
    torch.manual_seed(0)
    ref_model = GPT(cfg)
    ref = DDP(ref_model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    ref_losses, ref_time = _train(ref, ref_opt, cfg, args, rank, min(args.steps, 10), "DDP")
    params = list(ref_model.parameters())
    ddp_mem = {
        "params": sum(p.numel() * p.element_size() for p in params),
        "grads": sum(p.numel() * p.element_size() for p in params),
        "optimizer_state": sum(v.numel() * v.element_size() for s in ref_opt.state.values()
                               for v in s.values() if torch.is_tensor(v) and v.numel() > 1),
    }
    everyone = [None] * ws
    dist.all_gather_object(everyone, mem)
    if rank == 0:
        k = len(ref_losses)
        diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        print(f"\nloss after {k} steps: {name} {losses[k - 1]:.5f}, DDP {ref_losses[-1]:.5f} "
              f"(largest difference over those steps {diff:.1e}); after {args.steps}: {losses[-1]:.5f}")
        # What holds memory (memory_stats' other keys, offloaded / on_device, say where it is).
        keys = ["params", "master", "grads", "optimizer_state", "staging"]

        def total(m):
            return sum(m.get(k, 0) for k in keys)

        heads = "".join(f"{k.replace('optimizer_state', 'opt state'):>14}" for k in keys)
        print(f"\nmemory per rank (counted tensors)  {heads}         total  of which offloaded")
        for r, m in enumerate(everyone):
            print(f"  {name} rank {r:<19}" + "".join(f"{_mib(m[k]):>14}" for k in keys)
                  + f"{_mib(total(m)):>14}{_mib(m['offloaded']):>19}")
        print(f"  {'DDP + AdamW (every rank)':<31}" + "".join(f"{_mib(ddp_mem.get(k, 0)):>14}" for k in keys)
              + f"{_mib(total(ddp_mem)):>14}")
        ratio = total(everyone[0]) / total(ddp_mem)
        print(f"  {name} holds {ratio:.2f}x DDP's bytes per rank")
        print(f"\nmedian step time: {name} {step_time * 1e3:.1f} ms, DDP {ref_time * 1e3:.1f} ms "
              f"({step_time / ref_time:.2f}x) on {os.cpu_count()} CPU cores, 1 thread per rank")
    return 0
