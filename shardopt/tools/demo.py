"""`shardopt demo`: CPU ranks train a small GPT with ZeRO and with DDP, taking turns in the same processes, and
print loss, memory per rank next to DDP's, and the step-time ratio with its spread (Note [Demo step ratio]).
Runs on every rank of an initialized gloo group (the CLI launches torchrun)."""
from __future__ import annotations

import os
import time


def _mib(n: float) -> str:
    return f"{n / 2**20:8.1f} MiB"


# Note [Demo step ratio]
# Step times swing 20-30% on a shared machine, so, as benchmarks/bench_step.py (Note [Turns] there), both
# variants live in the same processes and take turns of TURN steps; each round compares neighbouring turns
# (the first is warm-up), and the demo prints the median ratio and its range. Times are the slowest rank's.
TURN = 5

# Note [Demo learning rate]
# The demo prints the losses' largest relative difference from DDP's against the tests' parity bar. Sums in
# another order differ by ulps, which a stable training keeps small and an unstable one amplifies: at 3e-3
# even DDP parts from a twin summing its clipping norm in another order (benchmarks/demo_parity.py).
LR = 1e-3
PARITY_BAR = 1e-5


def _step(wrapper, opt, cfg, args, rank, step, loss_fn):
    """One training step (as a user writes it); returns (loss, seconds)."""
    import torch

    from shardopt.tools.gpt import synthetic_batch

    x, y = synthetic_batch(cfg, args.batch, args.seq, step, rank)
    t0 = time.perf_counter()
    loss = loss_fn(wrapper(x).reshape(-1, cfg.vocab), y.reshape(-1))
    loss.backward()
    if hasattr(opt, "clip_grad_norm"):
        opt.clip_grad_norm(1.0)
    else:
        torch.nn.utils.clip_grad_norm_(wrapper.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss.item(), time.perf_counter() - t0


def _train_interleaved(sides, cfg, args, rank, label):
    """Trains both (wrapper, opt) sides args.steps steps in turns (Note [Demo step ratio]).

    Returns per side: losses, and per round the mean step time (slowest rank)."""
    import torch
    import torch.distributed as dist

    from shardopt.tools.progress import ProgressBar

    loss_fn = torch.nn.CrossEntropyLoss()
    bar = ProgressBar(args.steps, label, enabled=rank == 0)
    losses = [[] for _ in sides]
    rounds = [[] for _ in sides]
    done = 0
    while done < args.steps:
        turn = min(TURN, args.steps - done)
        for k, (wrapper, opt) in enumerate(sides):
            dist.barrier()
            spent = 0.0
            for step in range(done, done + turn):
                loss, dt = _step(wrapper, opt, cfg, args, rank, step, loss_fn)
                losses[k].append(loss)
                spent += dt
            rounds[k].append(spent / turn)
        done += turn
        bar.update(done, f"loss {losses[0][-1]:7.4f} (DDP {losses[1][-1]:7.4f})")
    times = torch.tensor(rounds, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return losses, times


def _sharded(model, args):
    import torch

    import shardopt

    common = dict(lr=LR, weight_decay=0.1, stage=args.stage, reduce_bucket_size=args.bucket)
    if args.offload == "cpu":
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
    torch.manual_seed(0)
    ref_model = GPT(cfg)
    ref = DDP(ref_model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=0.1, fused=True)
    (losses, ref_losses), times = _train_interleaved([(wrapper, opt), (ref, ref_opt)], cfg, args, rank, name)
    mem = opt.memory_stats()
    # Stage 3: whole buckets gathered during forward and backward, at most this many bytes at once.
    mem["gathered_peak"] = opt.store.peak_live if opt.params_sharded else 0
    # On one host big buckets are the peers' shards mapped, not copies (Note [Stage-3 buckets mapped, not copied]).
    mem["mapped"] = opt.store.mapped_bytes() if opt.params_sharded else 0
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
        # Note [Demo learning rate]
        diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
        print(f"\nloss after {args.steps} steps: {name} {losses[-1]:.5f}, DDP {ref_losses[-1]:.5f}")
        verdict = ("within the parity bar: the same numbers as DDP up to fp32 summation order" if diff <= PARITY_BAR
                   else "ABOVE the parity bar, which the tests hold: unexpected, please report it with this output")
        print(f"  largest difference over those steps {diff:.1e} (relative; parity bar {PARITY_BAR:.0e}): {verdict}")
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
        if args.stage == 3:
            peak = max(m["gathered_peak"] for m in everyone)
            print(f"  ZeRO-3 params: this rank's 1/{ws} of the weights between steps (DDP: all of them); whole "
                  f"buckets gathered during forward and backward peaked at {peak / 2**20:.1f} MiB on top")
            mapped = max(m["mapped"] for m in everyone)
            if mapped:
                print(f"  and {mapped / 2**20:.1f} MiB of buckets are every rank's shards mapped end to end from shared "
                      f"memory when gathered: no memory of their own, no copy")
        timed = times[:, 1:] if times.shape[1] > 1 else times  # the first round is warm-up
        ratios = sorted((timed[0] / timed[1]).tolist())
        ours, theirs = timed[0].median().item(), timed[1].median().item()
        print(f"\nmedian step time: {name} {ours * 1e3:.1f} ms, DDP {theirs * 1e3:.1f} ms on {os.cpu_count()} CPU "
              f"cores, 1 thread per rank")
        print(f"  {name} / DDP: {ratios[len(ratios) // 2]:.2f}x (range {ratios[0]:.2f}-{ratios[-1]:.2f} over "
              f"{len(ratios)} rounds: the two take turns of up to {TURN} steps in the same processes)")
    return 0
