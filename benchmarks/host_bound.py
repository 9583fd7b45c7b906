"""Stage 3's host cost where the host is the bottleneck: many tiny modules, batch 1 (issue 57).

Models of N blocks `Linear(64, 64)` + ReLU (N = 50, 200, 800 by default), batch 1: a step is all host
work (hooks, the schedule walk, waits, allocation, launching ops), as every step of a small model on a
GPU is. Each rank builds every contender on a copy of the same seeded model, in the same process:

    DDP + AdamW          torch's DistributedDataParallel (the anchor)
    shardopt-1/2/3       ShardedOptimizer(AdamW) + ShardedDDP at stages 1, 2, 3 (default options)
    FSDP2                fully_shard per block, then the root (reshard after forward: ZeRO-3), for the
                         record: on gloo it pays a round trip per block per collective

Note [Turns in the host-bound benchmark]
----------------------------------------
Timings on a shared 2-core machine swing 20-30% within minutes, so contenders are never timed in separate
runs: in each round every contender takes a turn of `--steps` consecutive steps (a barrier before each
turn), and a contender's figure is the median over rounds of its turns' per-step mean, on the slowest
rank. Ratios are taken within a round (contender / DDP of the same round), then the median over rounds.
Stage 3's excess over DDP at each N is fitted by least squares to `fixed + per_module x N`: the fixed
cost per step and the cost per module (a block is one module holding two parameters).

    python benchmarks/host_bound.py [--blocks 50,200,800] [--ranks 1,2] [--rounds 5] [--steps 4]
    python benchmarks/host_bound.py --profile [--blocks 200] [--ranks 1]     # where stage 3's time goes
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import platform
import pstats
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardopt.cluster.ranks import run_ranks  # noqa: E402

CONTENDERS = ("DDP", "shardopt-1", "shardopt-2", "shardopt-3", "FSDP2")
WIDTH = 64
LR = 1e-3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.relu(self.lin(x))


def make_model(blocks: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(blocks)])


def build(kind: str, blocks: int):
    """(model, optimizer) for one contender, on a fresh copy of the seeded model."""
    import torch.distributed as dist

    model = make_model(blocks)
    if kind == "DDP":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model), torch.optim.AdamW(model.parameters(), lr=LR)
    if kind.startswith("shardopt-"):
        import shardopt
        opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=LR,
                                        stage=int(kind[-1]))
        return shardopt.ShardedDDP(model, opt), opt
    if kind == "FSDP2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=LR)
    raise ValueError(kind)


def train_step(model, opt, x, phases=None) -> float:
    t0 = time.perf_counter()
    loss = model(x).square().mean()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    if phases is not None:  # forward, backward, step + zero_grad (this rank's)
        t3 = time.perf_counter()
        phases[0] += t1 - t0
        phases[1] += t2 - t1
        phases[2] += t3 - t2
    return loss.item()


def _slowest(value: float) -> float:
    import torch.distributed as dist
    t = torch.tensor([value], dtype=torch.float64)
    if dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _rank_bench(rank, world, blocks, contenders, rounds, steps, fsdp_rounds):
    import torch.distributed as dist

    built = {k: build(k, blocks) for k in contenders}
    x = torch.randn(1, WIDTH, generator=torch.Generator().manual_seed(1 + rank))
    losses = {k: [] for k in contenders}
    for k in contenders:  # warm-up: 2 steps each (first-call costs, lazy state)
        for _ in range(2):
            losses[k].append(train_step(*built[k], x))
    times = {k: [] for k in contenders}
    phases = {k: [0.0, 0.0, 0.0] for k in contenders}
    for r in range(rounds):
        for k in contenders:
            if k == "FSDP2" and r >= fsdp_rounds:
                continue
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                losses[k].append(train_step(*built[k], x, phases[k]))
            times[k].append(_slowest((time.perf_counter() - t0) / steps))
    gathers = getattr(built["shardopt-3"][1].store, "num_gathers", None) if "shardopt-3" in built else None
    phases = {k: [v / max(1, len(times[k]) * steps) for v in phases[k]] for k in contenders}
    return {"times": times, "losses": losses, "gathers": gathers, "phases": phases}


def fit(xs, ys):
    """Least squares y = a + b x: (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def bench(args) -> str:
    out = []
    for world in args.ranks:
        rows, excess, split = [], {}, []
        for n in args.blocks:
            contenders = [k for k in CONTENDERS if k != "FSDP2" or (args.fsdp and n <= args.fsdp_max_blocks)]
            res = run_ranks(_rank_bench, world, n, contenders, args.rounds, args.steps, args.fsdp_rounds,
                            timeout=1200, collective_timeout=300)[0]
            t = res["times"]
            ddp = statistics.median(t["DDP"])
            ratio = {k: statistics.median(a / d for a, d in zip(t[k], t["DDP"])) for k in contenders}
            med = {k: statistics.median(t[k]) for k in contenders}
            excess[n] = statistics.median(a - d for a, d in zip(t["shardopt-3"], t["DDP"]))
            same = all(abs(a - b) <= 1e-5 * max(1.0, abs(b))
                       for k in contenders for a, b in zip(res["losses"][k], res["losses"]["DDP"]))
            cells = [f"{ratio[k]:.2f} ({med[k] * 1e3:.1f} ms)" if k in ratio else "-" for k in CONTENDERS]
            split.append(f"| {world} | {n} | " + " | ".join(
                "/".join(f"{v * 1e3:.1f}" for v in res["phases"][k]) for k in CONTENDERS if k != "FSDP2") + " |")
            rows.append(f"| {world} | {n} | " + " | ".join(cells) + f" | {excess[n] * 1e3:+.1f} ms | "
                        f"{'yes' if same else 'NO'} |")
            print(rows[-1], flush=True)
        a, b = fit(list(excess), list(excess.values()))
        out.append("\nForward / backward / step + zero_grad, ms per step (rank 0's mean over timed turns):\n")
        out.append("| ranks | blocks | " + " | ".join(k for k in CONTENDERS if k != "FSDP2") + " |")
        out.append("|" + "---|" * (len(CONTENDERS) + 1))
        out += split
        out.append(f"\n### {world} rank{'s' if world > 1 else ''}\n")
        out.append("| ranks | blocks | " + " | ".join(f"{k} x DDP (ms/step)" for k in CONTENDERS)
                   + " | stage 3 - DDP | losses = DDP's (1e-5) |")
        out.append("|" + "---|" * (len(CONTENDERS) + 4))
        out += rows
        out.append(f"\nStage 3's excess over DDP fitted over {args.blocks} blocks: fixed **{a * 1e3:.2f} ms** "
                   f"per step + **{b * 1e6:.1f} µs** per module.")
    return "\n".join(out)


# Note [Where stage 3's host time goes]
# cProfile's own time (tottime) per function, summed into the groups the issue names by where the
# function lives: a rough split (cProfile adds its own cost per Python call, which inflates Python-heavy
# groups), but it points at the code to cut. Torch ops called from Python count as "compute" when called
# from the model and as the group of their caller otherwise (cProfile charges builtins to themselves, so
# they are grouped by name here).
GROUPS = (
    ("hooks (zero3/hooks.py, ddp.py)", ("zero3/hooks.py", "shardopt/ddp.py")),
    ("schedule walk (zero3/rounds.py)", ("zero3/rounds.py", "pack", "unpack")),
    ("waits (finish_gather, Work.wait)", ("finish_gather", "wait")),
    ("allocation/free (resize_, reshard, show)", ("allocate", "reshard", "show", "resize_")),
    ("gathers (start_gather, comm)", ("start_gather", "launch", "parallel/gathers.py", "parallel/comm.py", "all_gather",
                                      "_all_gather_base", "all_gather_into_tensor")),
    ("gradient sync (grad_sync.py, engine)", ("grad_sync.py", "sharded_grad.py")),
    ("optimizer step (optimizer.py, master_step.py, torch.optim)", ("optimizer.py", "master_step.py",
                                                                     "torch/optim/")),
)


def _group(filename: str, func: str) -> str:
    where = f"{func} ({os.path.basename(filename)})"
    for name, keys in GROUPS:
        for k in keys:
            if "/" in k or k.endswith(".py"):
                if k in filename:
                    return name
            elif (func == k and "/zero3/" in filename) or where == k or (func == k and k in (
                    "wait", "resize_", "all_gather", "_all_gather_base", "all_gather_into_tensor")):
                return name
    return "other (model compute, autograd, torch.nn hooks dispatch)"


def _rank_profile(rank, world, blocks, steps, kind):
    model, opt = build(kind, blocks)
    x = torch.randn(1, WIDTH, generator=torch.Generator().manual_seed(1 + rank))
    for _ in range(3):
        train_step(model, opt, x)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        train_step(model, opt, x)
    prof.disable()
    wall = (time.perf_counter() - t0) / steps
    return {"wall": wall, **grouped(prof), "steps": steps}


def grouped(prof) -> dict:
    """A cProfile run's own time and calls per group (Note [Where stage 3's host time goes]), and its top 25."""
    stats = pstats.Stats(prof)
    groups: dict = {}
    for (filename, _, func), (_, ncalls, tottime, _, _) in stats.stats.items():
        g = _group(filename, func)
        t, c = groups.get(g, (0.0, 0))
        groups[g] = (t + tottime, c + ncalls)
    s = io.StringIO()
    stats.stream = s
    stats.sort_stats("tottime").print_stats(25)
    return {"groups": groups, "top": s.getvalue()}


def profile(args) -> str:
    out = []
    for world in args.ranks:
        for n in args.blocks:
            for kind in args.profile_kinds:
                res = run_ranks(_rank_profile, world, n, args.steps * args.rounds, kind, timeout=1200,
                                collective_timeout=300)[0]
                steps = res["steps"]
                total = sum(t for t, _ in res["groups"].values())
                out.append(f"\n### {kind}, {n} blocks, {world} rank{'s' if world > 1 else ''}: "
                           f"{res['wall'] * 1e3:.1f} ms/step under cProfile (rank 0, {steps} steps)\n")
                out.append("| group | ms/step (own time) | share | calls/step |\n|---|---|---|---|")
                for g, (t, c) in sorted(res["groups"].items(), key=lambda kv: -kv[1][0]):
                    out.append(f"| {g} | {t / steps * 1e3:.2f} | {t / total:.0%} | {c / steps:.0f} |")
                if args.top:
                    out.append("\n```\n" + res["top"].strip() + "\n```")
                print("\n".join(out[-(len(res['groups']) + 3):]), flush=True)
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    p.add_argument("--blocks", type=ints, default=[50, 200, 800])
    p.add_argument("--ranks", type=ints, default=[1, 2])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="steps per turn (Note [Turns in the host-bound benchmark])")
    p.add_argument("--no-fsdp", dest="fsdp", action="store_false", help="leave FSDP2 out")
    p.add_argument("--fsdp-rounds", type=int, default=2, help="FSDP2 takes turns in the first rounds only (slow)")
    p.add_argument("--fsdp-max-blocks", type=int, default=200)
    p.add_argument("--profile", action="store_true", help="where stage 3's host time goes (cProfile)")
    p.add_argument("--profile-kinds", type=lambda s: s.split(","), default=["shardopt-3", "shardopt-2"])
    p.add_argument("--top", action="store_true", help="with --profile: the 25 costliest functions too")
    p.add_argument("--out", help="append the markdown here")
    args = p.parse_args(argv)
    head = (f"Machine: {platform.machine()}, {os.cpu_count()} cores, load average at start "
            f"{os.getloadavg()[0]:.1f}, torch {torch.__version__}, gloo over 127.0.0.1, 1 thread per rank, "
            f"blocks of Linear({WIDTH}, {WIDTH}) + ReLU, batch 1, AdamW(lr={LR}), fp32. "
            f"`python benchmarks/host_bound.py {' '.join(argv if argv is not None else sys.argv[1:])}`")
    print(head, flush=True)
    t0 = time.time()
    body = profile(args) if args.profile else bench(args)
    text = f"{head}\n{body}\n\nRun time {time.time() - t0:.0f} s.\n"
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
