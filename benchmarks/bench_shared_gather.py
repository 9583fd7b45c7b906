"""The parameter all-gather after a step on one host: through shared memory against the process group.

    python benchmarks/bench_shared_gather.py [--sizes 4,16,64] [--world-sizes 2,4] [--trials 20]

For each size (MB of the full fp32 buffer) and world size, interleaved round-robin in the same processes:
  shared    shardopt.parallel.gathers.SharedAfterStep over one bucket: barrier, copy the other ranks'
            chunks out of their shared buffers, barrier (what step() does: Note [Gathering through shared
            memory])
  ring      shardopt.parallel.comm.start_all_gather (the bucket engine's gloo ring), chunk -> bucket
  torch     dist.all_gather_into_tensor
A trial's time is the slowest rank's (barrier, op, max over ranks); medians over trials. Ranks are spawned
processes, one thread each, gloo over 127.0.0.1. Every trial's result is checked against the expected
values (every rank's chunk filled with its rank and trial).

Then memory (--memory-model, default the 29.5M-parameter GPT): each rank builds the model, ZeRO-2 with
AdamW, trains 2 steps, with shared_memory_gather False then None, in fresh processes; growth from before
the model is built of the resident set (Rss) and of the proportional set (Pss: a page mapped by k
processes counts 1/k in each), from /proc/self/smaps_rollup, summed over ranks. Rss counts the pages of
the other ranks' buffers a rank has read (they are mapped into it); Pss counts every page once across the
processes, which is what the host really holds.
"""
import argparse
import os
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from shardopt.cluster.ranks import run_ranks  # noqa: E402

MB = 1 << 20
OPS = ("shared", "ring", "torch")


def _rank(rank, world_size, sizes, trials):
    from shardopt.layout import plan_layout
    from shardopt.parallel import comm
    from shardopt.parallel.gathers import SharedAfterStep
    from shardopt.parallel.shared_memory import SharedChunks, open_shared_flat, why_not_shared

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    out = {}
    for size in sizes:
        n = int(size * MB) // 4
        layout = plan_layout([[("flat", (n,))]], world_size, n, n)  # one bucket, as big as the buffer
        total = layout.total_numel
        shared = open_shared_flat(total, torch.float32, dist.group.WORLD, True,
                                  why_not_shared(torch.device("cpu"), False, range(world_size), world_size))
        gather = SharedAfterStep(layout, SharedChunks(shared, "the benchmark's gather"))
        flat, bucket = shared.flat, torch.empty(total)
        lo, hi = layout.buckets[0].chunk(rank)
        chunk = torch.empty(hi - lo)

        def fill(t):
            flat[lo:hi].fill_(rank + t)
            chunk.fill_(rank + t)

        ops = {
            "shared": lambda: (gather.start_all_gather_params(flat), gather.finish_all_gather_params(),
                               gather.wait_readers()),
            "ring": lambda: comm.start_all_gather(chunk, bucket).wait(),
            "torch": lambda: dist.all_gather_into_tensor(bucket, chunk),
        }
        expected = [torch.arange(world_size, dtype=torch.float32).repeat_interleave(hi - lo) + t
                    for t in range(trials + 1)]
        times = {name: [] for name in ops}
        for t in range(trials + 1):  # trial 0: warm-up (connections, first-touch pages)
            names = list(ops)[t % len(ops):] + list(ops)[:t % len(ops)]
            for name in names:
                fill(t)
                dist.barrier()
                t0 = time.perf_counter()
                ops[name]()
                dt = time.perf_counter() - t0
                got = flat if name == "shared" else bucket
                if not torch.equal(got, expected[t]):
                    raise AssertionError(f"{name} gathered wrong values at trial {t}")
                if t:
                    times[name].append(dt)
        for name in ops:
            t = torch.tensor(times[name], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out[(size, name)] = statistics.median(t.tolist())
    return out


def _smaps() -> dict:
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _memory_rank(rank, world_size, model_name, shared):
    import shardopt
    from shardopt.tools.gpt import GPT, PRESETS, synthetic_batch

    torch.set_num_threads(1)
    cfg = PRESETS[model_name]
    before = _smaps()
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=1e-3,
                                    shared_memory_gather=shared)
    wrapper = shardopt.ShardedDDP(model, opt)
    for step in range(2):
        x, y = synthetic_batch(cfg, 1, 16, step, rank)
        torch.nn.functional.cross_entropy(wrapper(x).reshape(-1, cfg.vocab), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    after = _smaps()
    used = opt.store.gather.shared is not None
    return {k: after[k] - before[k] for k in after}, used, sum(p.numel() for p in model.parameters())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4,16,64", help="MB of the full fp32 buffer")
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--memory-model", default="30m", help="GPT preset for the memory table ('' to skip)")
    args = ap.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    print(f"Machine: {platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start, "
          f"torch {torch.__version__}; one thread per rank, gloo over 127.0.0.1; medians of {args.trials} trials "
          f"of the slowest rank.\n")
    print("| ranks | buffer MB | shared memory ms | gloo ring ms | all_gather_into_tensor ms | ring / shared |")
    print("|---|---|---|---|---|---|")
    for w in (int(x) for x in args.world_sizes.split(",")):
        res = run_ranks(_rank, w, sizes, args.trials, timeout=600)[0]
        for size in sizes:
            s, r, t = (res[(size, k)] * 1e3 for k in OPS)
            print(f"| {w} | {size} | {s:.2f} | {r:.2f} | {t:.2f} | {r / s:.2f} |")
    if not args.memory_model:
        return
    print(f"\nMemory, GPT '{args.memory_model}', ZeRO-2 + AdamW, 2 steps of 1x16 tokens; growth summed over ranks, "
          f"MiB (MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}):\n")
    print("| ranks | gather | Rss growth | Pss growth | fp32 parameter bytes, MiB |")
    print("|---|---|---|---|---|")
    for w in (int(x) for x in args.world_sizes.split(",")):
        for shared in (False, None):
            res = run_ranks(_memory_rank, w, args.memory_model, shared, timeout=600)
            used = {u for _, u, _ in res}
            if used != {shared is None}:
                raise AssertionError(f"shared_memory_gather={shared}: used on ranks {used}")
            rss, pss = (sum(m[k] for m, _, _ in res) / MB for k in ("Rss", "Pss"))
            print(f"| {w} | {'shared memory' if shared is None else 'process group'} | {rss:.0f} | {pss:.0f} | "
                  f"{res[0][2] * 4 / MB:.0f} |")


if __name__ == "__main__":
    main()
