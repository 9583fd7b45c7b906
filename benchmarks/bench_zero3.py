"""ZeRO-3 memory per rank: shardopt stage 3 against FSDP2 fully_shard and DeepSpeed ZeRO-3 (and ZeRO-2, DDP).

Every rank builds the model the way its library recommends for a model that
does not fit: shardopt and FSDP2 on the meta device (shardopt materialises it
bucket by bucket, FSDP2 after fully_shard with to_empty + reset_parameters),
DeepSpeed inside deepspeed.zero.Init; ZeRO-2 and DDP build it whole. Then 3
AdamW steps on a small batch (activations are small next to model states).

Measured per rank (the largest rank is reported): the peak of the process's
resident set (ru_maxrss) minus its resident set just before the model is
built, with MALLOC_MMAP_THRESHOLD_=1 MiB so that freed tensors leave the RSS.
For shardopt, also the bytes it counts (memory_stats after the last step:
parameter chunks, gradient chunks, Adam state) and the peak of gathered
buckets (opt.store.peak_live). The arithmetic: fp32 AdamW holds 16 bytes
per parameter (4 weights + 4 gradients + 8 state); sharded over N ranks,
16P/N, plus the buckets gathered at once.

    python benchmarks/bench_zero3.py [--world-size 4] [--layers 10] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import resource
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardopt.cluster.ranks import run_ranks  # noqa: E402

VARIANTS = ("shardopt ZeRO-3", "FSDP2 fully_shard", "DeepSpeed ZeRO-3", "shardopt ZeRO-2", "DDP")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _build(variant, cfg, rank, world_size, bucket):
    import torch.distributed as dist

    import shardopt
    from shardopt.tools.gpt import GPT, init_weights

    torch.manual_seed(0)
    if variant == "shardopt ZeRO-3":
        with torch.device("meta"):
            model = GPT(cfg)
        opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=1e-3, stage=3,
                                        reduce_bucket_size=bucket)
        return shardopt.ShardedDDP(model, opt, param_init_fn=init_weights), opt
    if variant == "FSDP2 fully_shard":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = GPT(cfg)
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        for m in model.modules():
            init_weights(m)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    if variant == "DeepSpeed ZeRO-3":
        os.environ.setdefault("LOCAL_RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
        import logging

        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
                  "zero_optimization": {"stage": 3, "reduce_bucket_size": bucket,
                                        "stage3_prefetch_bucket_size": bucket,
                                        "stage3_param_persistence_threshold": 0, "overlap_comm": True},
                  "zero_allow_untested_optimizer": True}
        with deepspeed.zero.Init(config_dict_or_path=config, remote_device="cpu", pin_memory=False):
            model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
        return engine, engine
    model = GPT(cfg)
    if variant == "shardopt ZeRO-2":
        opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=1e-3, stage=2,
                                        reduce_bucket_size=bucket)
        return shardopt.ShardedDDP(model, opt), opt
    from torch.nn.parallel import DistributedDataParallel as DDP

    assert dist.get_world_size() == world_size
    return DDP(model), torch.optim.AdamW(model.parameters(), lr=1e-3)


def _measure(rank, world_size, variant, layers, bucket):
    from shardopt.tools.gpt import GPTConfig, synthetic_batch

    cfg = GPTConfig(vocab=8192, dim=512, layers=layers, heads=8, seq=128)
    gc.collect()
    before = _rss()
    wrapper, opt = _build(variant, cfg, rank, world_size, bucket)
    for step in range(3):
        x, y = synthetic_batch(cfg, 2, 16, step, rank)
        loss = torch.nn.functional.cross_entropy(wrapper(x).reshape(-1, cfg.vocab), y.reshape(-1))
        if variant == "DeepSpeed ZeRO-3":
            wrapper.backward(loss)
            wrapper.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()
    gc.collect()
    out = {"peak_growth": _peak() - before, "n": sum(int(torch.Size(s).numel()) for s in _shapes(cfg))}
    if variant.startswith("shardopt"):
        out["stats"] = opt.memory_stats()
        if opt.params_sharded:
            out["peak_live"] = opt.store.peak_live
    torch.distributed.barrier()
    return out


def _shapes(cfg):
    from shardopt.estimate import trainable_shapes
    from shardopt.tools.gpt import GPT

    with torch.device("meta"):
        return [s for _, s in trainable_shapes(GPT(cfg))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--layers", type=int, default=10, help="GPT blocks of dim 512 (10: 35M parameters)")
    ap.add_argument("--bucket", type=int, default=2_000_000, help="elements per bucket, every library")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    ws = args.world_size
    rows = []
    for variant in args.variants.split(","):
        try:
            res = run_ranks(_measure, ws, variant, args.layers, args.bucket, timeout=900)
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported in the table
            rows.append((variant, None, str(e).strip().splitlines()[-1][:200]))
            continue
        rows.append((variant, res, None))
    n = next(r[1][0]["n"] for r in rows if r[1])
    ideal = 16 * n / ws
    lines = [f"# ZeRO-3 memory per rank — {datetime.date.today().isoformat()}", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo, {ws} ranks, "
             f"GPT dim 512 x {args.layers} blocks ({n / 1e6:.1f}M parameters), fp32, AdamW, buckets of "
             f"{args.bucket:,} elements, batch 2x16 tokens, 3 steps. Peak RSS growth per rank (max over ranks; "
             "ru_maxrss minus the RSS before the model is built, MALLOC_MMAP_THRESHOLD_=1 MiB). "
             f"16P/N = {ideal / 2**20:.1f} MiB.", "",
             "| variant | peak RSS growth, MiB (max rank) | / 16P/N | shardopt counts: chunks + grads + state, MiB "
             "| gathered at peak, MiB | counted vs 16P/N |",
             "|---|---|---|---|---|---|"]
    for variant, res, err in rows:
        if res is None:
            lines.append(f"| {variant} | failed: {err} | | | | |")
            continue
        peak = max(r["peak_growth"] for r in res)
        counted = live = ""
        ratio_counted = ""
        if "stats" in res[0]:
            s = max(res, key=lambda r: r["stats"]["params"])["stats"]
            c = s["params"] + s["grads"] + s["optimizer_state"]
            counted = f"{c / 2**20:.1f}"
            ratio_counted = f"{c / ideal - 1:+.1%}"
            if "peak_live" in res[0]:
                live = f"{max(r['peak_live'] for r in res) / 2**20:.1f}"
        lines.append(f"| {variant} | {peak / 2**20:.1f} | {peak / ideal:.2f} | {counted} | {live} | {ratio_counted} |")
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
