"""`python -m shardopt ...` (also installed as `shardopt`).

    demo   2 CPU ranks train a small GPT with ZeRO-2 and print loss, memory per rank and step time.
           Works under torchrun (`torchrun --nproc-per-node 2 -m shardopt demo`) or launches
           torchrun itself when run directly.
    convert  a checkpoint directory (shardopt.save_checkpoint) -> one torch file: model weights and a
           torch.optim state dict (shardopt/convert.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def _launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _relaunch(world_size: int, argv: list[str]) -> int:
    from torch.distributed.run import main as torchrun

    # A local run: keep gloo on loopback whatever the host name resolves to.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torchrun(["--standalone", f"--nproc-per-node={world_size}", "-m", "shardopt", *argv])
    return 0


def _mib(n: float) -> str:
    return f"{n / 2**20:8.1f} MiB"


def demo(args) -> int:
    import datetime

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import shardopt
    from shardopt.gpt import GPT, PRESETS, num_params, synthetic_batch

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cfg = PRESETS[args.model]
    loss_fn = torch.nn.CrossEntropyLoss()

    def say(*a):
        if rank == 0:
            print(*a, flush=True)

    def train(wrapper, opt, steps, label):
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
            loss = loss_t.item()
            losses.append(loss)
            if rank == 0 and (step % max(1, steps // 5) == 0 or step == steps - 1):
                done = (step + 1) * 20 // steps
                print(f"{label:>8} [{'#' * done}{'.' * (20 - done)}] step {step + 1:3d}/{steps} "
                      f"loss {loss:7.4f}  {times[-1] * 1e3:7.1f} ms", flush=True)
        times = sorted(times[2:] or times)
        return losses, times[len(times) // 2]

    torch.manual_seed(0)
    model = GPT(cfg)
    n = num_params(model)
    say(f"shardopt demo: GPT '{args.model}' with {n / 1e6:.2f}M parameters, {ws} gloo ranks, "
        f"ZeRO-{args.stage}, AdamW, batch {args.batch}x{args.seq} per rank, {args.steps} steps")
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=3e-3, weight_decay=0.1,
                                    fused=True, stage=args.stage, reduce_bucket_size=args.bucket)
    wrapper = shardopt.ShardedDDP(model, opt)
    losses, step_time = train(wrapper, opt, args.steps, f"ZeRO-{args.stage}")
    mem = opt.memory_stats()

    # The same model under DDP + AdamW(fused=True) for a few steps, for the comparison.
    torch.manual_seed(0)
    ref_model = GPT(cfg)
    ref = DDP(ref_model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    ref_losses, ref_time = train(ref, ref_opt, min(args.steps, 10), "DDP")
    params = list(ref_model.parameters())
    ddp_mem = {
        "params": sum(p.numel() * p.element_size() for p in params),
        "grads": sum(p.numel() * p.element_size() for p in params),
        "optimizer_state": sum(v.numel() * v.element_size() for s in ref_opt.state.values()
                               for v in s.values() if torch.is_tensor(v) and v.numel() > 1),
        "staging": 0,
    }
    everyone = [None] * ws
    dist.all_gather_object(everyone, mem)
    if rank == 0:
        k = len(ref_losses)
        diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        print(f"\nloss after {k} steps: ZeRO-{args.stage} {losses[k - 1]:.5f}, DDP {ref_losses[-1]:.5f} "
              f"(largest difference over those steps {diff:.1e}); after {args.steps}: {losses[-1]:.5f}")
        print("\nmemory per rank (counted tensors)      params       grads   opt state     staging       total")
        for r, m in enumerate(everyone):
            print(f"  ZeRO-{args.stage} rank {r:<24}" + "".join(_mib(m[k]) + "  " for k in m)
                  + _mib(sum(m.values())))
        print(f"  {'DDP + AdamW (every rank)':<31}" + "".join(_mib(ddp_mem[k]) + "  " for k in ddp_mem)
              + _mib(sum(ddp_mem.values())))
        ratio = sum(everyone[0].values()) / sum(ddp_mem.values())
        print(f"  ZeRO-{args.stage} holds {ratio:.2f}x DDP's bytes per rank")
        print(f"\nmedian step time: ZeRO-{args.stage} {step_time * 1e3:.1f} ms, DDP {ref_time * 1e3:.1f} ms "
              f"({step_time / ref_time:.2f}x) on {os.cpu_count()} CPU cores, 1 thread per rank")
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="shardopt", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="2 CPU ranks train a small GPT with ZeRO-2")
    d.add_argument("--world-size", type=int, default=2)
    d.add_argument("--steps", type=int, default=30)
    d.add_argument("--stage", type=int, default=2, choices=(1, 2))
    d.add_argument("--model", default="small", choices=("tiny", "small", "30m"))
    d.add_argument("--batch", type=int, default=8)
    # The default bucket floor (2M elements, Note [Default bucket sizes]) is half
    # of this small model; smaller buckets show stage 2's saving.
    d.add_argument("--bucket", type=int, default=500_000, help="reduce_bucket_size in elements")
    d.add_argument("--seq", type=int, default=64)
    from shardopt import convert
    convert.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "convert":
        return args.run(args)
    if args.command == "demo":
        if not _launched_by_torchrun():
            return _relaunch(args.world_size, argv)
        return demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
