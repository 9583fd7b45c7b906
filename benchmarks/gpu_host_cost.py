"""The GPU version of the host-bound table (issue 57): step time x DDP of shardopt stages 1-3 and FSDP2, one GPU.

On a GPU a small model's step is the host launching kernels, so stage 3's per-module host work (hooks, the
schedule walk, gathers) is the step; at a realistic size the kernels should hide it. Three models, each
contender built on a copy of the same seeded model in the same process, timed in turns (Note [Turns in the
host-bound benchmark] in host_bound.py; torch.cuda.synchronize() around each turn):

    blocks    200 blocks of Linear(64, 64) + ReLU, batch 1, fp32 (the CPU benchmark's model)
    demo      the demo GPT (shardopt.tools.gpt preset "small", 5.3M parameters counted once each), batch 8 x 128, fp32
    demo-b1   the demo GPT at batch 1 x 16: on the CPU, the host-bound regime of the GPU's demo (--cpu-stand-in)
    deep-b1   the 370M GPT's 24 layers at width 64, batch 1 x 16: its module count where the host is the step
    gpt-370m  GPT(vocab 32768, dim 1024, 24 layers, 16 heads, seq 512), ~370M parameters, bf16, batch 4 x 512

Contenders: DDP + AdamW(fused), ShardedOptimizer(AdamW(fused)) + ShardedDDP at stages 1, 2, 3, FSDP2
fully_shard per block then the root (reshard after forward). Issue 57's bar: stage 3 <= 1.20x DDP on the
demo, <= 1.05x at 300M+ parameters, at world size 1.

    .ci/gpu-bench [--world-size 1] [--models blocks,demo,gpt-370m] [--rounds 5] [--steps 5] [--out FILE]
    .ci/gpu-bench --profile [--models demo] [--profile-kinds shardopt-3,shardopt-2,DDP] [--top]

`--trace` instead times each contender's forward, backward and step + zero_grad apart (synchronize() between
them) and lists torch.profiler's costliest ops by device time and by host time: where a slower step's extra
time is spent on the device, not only on the host. (cProfile sees the main thread only; on a GPU autograd runs
the backward hooks on its device thread.)

`--profile` runs cProfile over each named contender's steps instead (rank 0), grouped as host_bound.py's
profile is (Note [Where stage 3's host time goes]): where the host's time goes at the GPU's pace.

Without a CUDA device it prints one line and exits 0 (nothing is measured). `--cpu-stand-in` runs the same
flow on the CPU over gloo with small models (blocks: 10, demo: the "tiny" preset, no 370M model), so the suite
runs it (tests/test_host_cost.py); its times say nothing about a GPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

CONTENDERS = ("DDP", "shardopt-1", "shardopt-2", "shardopt-3", "FSDP2")
LR = 1e-4


def _gpt_config(name: str):
    from shardopt.tools.gpt import PRESETS, GPTConfig
    if name in ("demo", "tiny", "demo-b1"):
        return PRESETS["tiny" if name == "tiny" else "small"]
    if name == "deep-b1":
        return GPTConfig(vocab=512, dim=64, layers=24, heads=2, seq=32)
    return GPTConfig(vocab=32768, dim=1024, layers=24, heads=16, seq=512)


def make(name: str, device):
    """(model, units FSDP2 shards one by one, batch maker, loss) for one model, on `device`."""
    torch.manual_seed(0)
    if name in ("blocks", "blocks-10"):
        from host_bound import make_model, WIDTH
        model = make_model(200 if name == "blocks" else 10).to(device)
        x = torch.randn(1, WIDTH, device=device)
        return model, list(model), lambda: (x,), lambda out: out.square().mean()
    from shardopt.tools.gpt import GPT
    c = _gpt_config(name)
    model = GPT(c).to(device)
    batch, seq = {"demo": (8, 128), "tiny": (2, 32), "demo-b1": (1, 16), "deep-b1": (1, 16)}.get(name, (4, 512))
    if name == "gpt-370m":
        model = model.to(torch.bfloat16)
    idx = torch.randint(0, c.vocab, (batch, seq), device=device)
    return (model, list(model.blocks), lambda: (idx,),
            lambda out: nn.functional.cross_entropy(out.float().reshape(-1, c.vocab), idx.reshape(-1)))


def build(kind: str, name: str, device):
    import torch.distributed as dist
    model, units, batch, loss_fn = make(name, device)
    if kind == "DDP":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model), torch.optim.AdamW(model.parameters(), lr=LR, fused=True), batch, loss_fn
    if kind.startswith("shardopt-"):
        import shardopt
        opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=LR, fused=True,
                                        stage=int(kind[-1]))
        return shardopt.ShardedDDP(model, opt), opt, batch, loss_fn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, fused=True), batch, loss_fn


def _step(model, opt, batch, loss_fn) -> torch.Tensor:
    loss = loss_fn(model(*batch()))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _rank(rank, world, models, rounds, steps, cuda=True):
    import torch.distributed as dist
    device, sync = _device(rank, cuda)
    out = {}
    for name in models:
        built = {k: build(k, name, device) for k in CONTENDERS}
        for k in CONTENDERS:
            for _ in range(3):  # warm-up: lazy state, allocator, kernels chosen
                _step(*built[k])
        times = {k: [] for k in CONTENDERS}
        for _ in range(rounds):
            for k in CONTENDERS:
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                for _ in range(steps):
                    _step(*built[k])
                sync()
                t = torch.tensor([(time.perf_counter() - t0) / steps], device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[k].append(t.item())
        params = sum(p.numel() for p in make(name, "meta")[0].parameters())
        out[name] = {"times": times, "params": params}
        del built
        if cuda:
            torch.cuda.empty_cache()
    return out


def _device(rank: int, cuda: bool):
    """This rank's device and the synchronize() that waits for it (a no-op on the CPU)."""
    if cuda:
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank), torch.cuda.synchronize
    return torch.device("cpu"), (lambda: None)


def _rank_profile(rank, world, models, kinds, steps, cuda=True):
    """cProfile over `steps` steps of each contender in `kinds`, per model: own time per group and the top 25."""
    import cProfile
    from host_bound import grouped
    device, sync = _device(rank, cuda)
    out = {}
    for name in models:
        for kind in kinds:
            built = build(kind, name, device)
            for _ in range(3):
                _step(*built)
            sync()
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            for _ in range(steps):
                _step(*built)
            sync()
            prof.disable()
            out[(name, kind)] = {"wall": (time.perf_counter() - t0) / steps, **grouped(prof), "steps": steps}
            del built
            if cuda:
                torch.cuda.empty_cache()
    return out


def _rank_trace(rank, world, models, kinds, steps, cuda=True):
    """Per contender: forward / backward / step ms (synchronized apart), and torch.profiler's top ops."""
    from torch.profiler import ProfilerActivity, profile as tprofile
    device, sync = _device(rank, cuda)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = {}
    for name in models:
        for kind in kinds:
            model, opt, batch, loss_fn = build(kind, name, device)
            for _ in range(3):
                _step(model, opt, batch, loss_fn)
            phases = [0.0, 0.0, 0.0]
            for _ in range(steps):
                sync()
                t0 = time.perf_counter()
                loss = loss_fn(model(*batch()))
                sync()
                t1 = time.perf_counter()
                loss.backward()
                sync()
                t2 = time.perf_counter()
                opt.step()
                opt.zero_grad()
                sync()
                t3 = time.perf_counter()
                for i, d in enumerate((t1 - t0, t2 - t1, t3 - t2)):
                    phases[i] += d / steps
            with tprofile(activities=activities) as prof:
                for _ in range(steps):
                    _step(model, opt, batch, loss_fn)
                sync()
            avg = prof.key_averages()
            dev = "self_device_time_total" if hasattr(avg[0], "self_device_time_total") else "self_cuda_time_total"
            tables = {}
            for key in ([dev] if cuda else []) + ["self_cpu_time_total"]:
                rows = sorted(avg, key=lambda e: -getattr(e, key))[:15]
                tables[key] = [(e.key, e.count / steps, getattr(e, key) / steps / 1e3) for e in rows]
            out[(name, kind)] = {"phases": phases, "tables": tables}
            del model, opt
            if cuda:
                torch.cuda.empty_cache()
    return out


def trace_text(results: dict) -> str:
    out = []
    for (name, kind), r in results.items():
        f, b, s = (x * 1e3 for x in r["phases"])
        out.append(f"\n### {kind}, {name}: forward {f:.2f} ms, backward {b:.2f} ms, step + zero_grad {s:.2f} ms "
                   f"(synchronized apart; sum {f + b + s:.2f})\n")
        for key, rows in r["tables"].items():
            out.append(f"| op ({key.replace('_total', '')}) | calls/step | ms/step |\n|---|---|---|")
            out += [f"| `{k[:70]}` | {c:.0f} | {t:.3f} |" for k, c, t in rows]
            out.append("")
    return "\n".join(out)


def profile_text(results: dict, top: bool) -> str:
    out = []
    for (name, kind), r in results.items():
        steps, total = r["steps"], sum(t for t, _ in r["groups"].values())
        out.append(f"\n### {kind}, {name}: {r['wall'] * 1e3:.2f} ms/step under cProfile (rank 0, {steps} steps)\n")
        out.append("| group | ms/step (own time) | share | calls/step |\n|---|---|---|---|")
        for g, (t, c) in sorted(r["groups"].items(), key=lambda kv: -kv[1][0]):
            out.append(f"| {g} | {t / steps * 1e3:.2f} | {t / total:.0%} | {c / steps:.0f} |")
        if top:
            out.append("\n```\n" + r["top"].strip() + "\n```")
    return "\n".join(out)


def table(results: dict, world: int) -> str:
    lines = [f"| model | parameters | " + " | ".join(f"{k} ms (x DDP)" for k in CONTENDERS) + " | stage 3 / stage 2 |",
             "|" + "---|" * (len(CONTENDERS) + 3)]
    for name, r in results.items():
        t = r["times"]
        ratio = {k: statistics.median(a / d for a, d in zip(t[k], t["DDP"])) for k in CONTENDERS}
        s32 = statistics.median(a / b for a, b in zip(t["shardopt-3"], t["shardopt-2"]))
        cells = [f"{statistics.median(t[k]) * 1e3:.2f} ({ratio[k]:.2f})" for k in CONTENDERS]
        lines.append(f"| {name} | {r['params'] / 1e6:.1f}M | " + " | ".join(cells) + f" | {s32:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--models", type=lambda s: s.split(","), default=["blocks", "demo", "gpt-370m"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", help="append the markdown here")
    p.add_argument("--cpu-stand-in", action="store_true", help="the same flow on the CPU (gloo), for the tests")
    p.add_argument("--profile", action="store_true", help="cProfile each of --profile-kinds instead of timing")
    p.add_argument("--profile-kinds", type=lambda s: s.split(","), default=["shardopt-3", "shardopt-2", "DDP"])
    p.add_argument("--top", action="store_true", help="with --profile: the 25 costliest functions too")
    p.add_argument("--trace", action="store_true", help="phase times and torch.profiler's top ops per contender")
    args = p.parse_args(argv)
    rank_fn, text_fn = (_rank_trace, trace_text) if args.trace else (_rank_profile, None)
    if args.cpu_stand_in:
        from shardopt.cluster.ranks import run_ranks
        if args.profile or args.trace:
            res = run_ranks(rank_fn, args.world_size, args.models, args.profile_kinds,
                            args.rounds * args.steps, False, timeout=600)[0]
            body = trace_text(res) if args.trace else profile_text(res, args.top)
            print(f"CPU stand-in (not a GPU measurement)\n{body}")
            return 0
        results = run_ranks(_rank, args.world_size, args.models, args.rounds, args.steps, False, timeout=600)[0]
        print(f"CPU stand-in (not a GPU measurement), world size {args.world_size}\n\n{table(results, args.world_size)}")
        return 0
    if not (torch.cuda.is_available() and torch.cuda.device_count() >= args.world_size):
        print(f"gpu-bench: no CUDA device ({torch.cuda.device_count() if torch.cuda.is_available() else 0} "
              f"visible, {args.world_size} needed): skipped, nothing measured")
        return 0
    from shardopt.cluster.ranks import run_ranks
    t0 = time.time()
    if args.profile or args.trace:
        res = run_ranks(rank_fn, args.world_size, args.models, args.profile_kinds, args.rounds * args.steps,
                        backend="nccl", timeout=3600, collective_timeout=600)[0]
        what, body = ("torch.profiler", trace_text(res)) if args.trace else ("cProfile", profile_text(res, args.top))
        text = (f"{torch.cuda.get_device_name(0)}, world size {args.world_size}, torch {torch.__version__}: {what} "
                f"(`.ci/gpu-bench {' '.join(argv if argv is not None else sys.argv[1:])}`, {time.time() - t0:.0f} s)\n"
                f"{body}\n")
        print(text)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text)
        return 0
    results = run_ranks(_rank, args.world_size, args.models, args.rounds, args.steps, backend="nccl",
                        timeout=3600, collective_timeout=600)[0]
    head = (f"{torch.cuda.get_device_name(0)}, world size {args.world_size}, torch {torch.__version__}, NCCL; "
            f"medians of {args.rounds} rounds of {args.steps}-step turns (slowest rank), ratios within a round. "
            f"`.ci/gpu-bench {' '.join(argv if argv is not None else sys.argv[1:])}` ({time.time() - t0:.0f} s)")
    text = f"{head}\n\n{table(results, args.world_size)}\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
