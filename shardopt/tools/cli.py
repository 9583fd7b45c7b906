"""`python -m shardopt ...` (also installed as `shardopt`).

    demo      CPU ranks train a small GPT with ZeRO (stage 2 unless `--stage`; progress bar) and print
              loss, memory per rank next to DDP's, and step time. `--world-size`, `--steps`, `--stage`,
              `--offload`.
    estimate  memory per rank for a parameter count (7e9, 125M) or a `module:factory` model built on
              the meta device, over world sizes / stages / offload (device, host, disk), as a table with
              DDP's for reference; `--memory 16GiB`: which offload setting fits, or none.
    tune      times the `module:factory` model over a grid of reduce/allgather bucket sizes (stage 3:
              reduce sizes, the unit of gathering too) at the current world size; prints a table,
              writes a PNG, recommends sizes as a config snippet.
    convert   a checkpoint directory (shardopt.save_checkpoint, or DeepSpeed's) -> its whole weights as a
              Hugging Face safetensors folder, streamed (OUT a folder), or one torch file with model weights
              and a torch.optim state dict (OUT a .pt file) (shardopt/checkpoint/convert.py).
    bench     runs scenarios of the source tree's benchmarks/ and writes a dated markdown report with
              charts.
    gpu-check on a machine with GPUs: the CUDA kernels, parity with DDP on NCCL, syncs, time and memory,
              in one markdown file; exits 1 on a failure (shardopt/tools/gpu_check.py). Without a GPU it
              prints one line and exits 0.

demo and tune run on every rank: under torchrun (`torchrun --nproc-per-node 2 -m shardopt demo`) they use
its ranks; run directly, they launch torchrun themselves with --world-size ranks.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import sys


def _launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _relaunch(world_size: int, argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # gloo on loopback, whatever the host name resolves to
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        torchrun(["--standalone", f"--nproc-per-node={world_size}", "-m", "shardopt", *argv])
    except ChildFailedError:
        print(f"shardopt {argv[0]}: a rank failed; its traceback is above", file=sys.stderr)
        return 1
    return 0


def _on_ranks(fn, args, argv: list[str], timeout_s: int) -> int:
    """Runs fn(args) on every rank: in this process group, torchrun's, or a torchrun launched here."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return fn(args)
    if not _launched_by_torchrun():
        return _relaunch(args.world_size, argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        code = fn(args)
    finally:
        dist.destroy_process_group()
    _exit_rank(code)


# Note [Ranks leave without interpreter shutdown]
# In torch 2.13 a gloo thread dropping the last reference to a tensor Python has seen during interpreter
# shutdown aborts the process (exit -6, pytorch/pytorch#190489; the demo's last all_gather_object leaves
# one). A rank this command started flushes its output and leaves without interpreter shutdown.
def _exit_rank(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def parse_count(text: str) -> int:
    """'7e9', '7B', '125M', '350k', '2_000_000' -> an integer count."""
    t = text.strip().replace("_", "").replace(",", "")
    scale = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}.get(t[-1:].lower(), 1)
    if scale != 1:
        t = t[:-1]
    try:
        value = float(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (e.g. 7e9, 7B, 125M, 2000000)") from None
    if value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"not a positive whole count: {text!r}")
    return int(value)


def parse_bytes(text: str) -> int:
    """'16GiB', '16G', '512MiB', '1.5TB', '4096' -> bytes (K/M/G/T: powers of 1024, as GiB)."""
    t = text.strip().lower().replace("_", "").removesuffix("b").removesuffix("i")
    scale = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale != 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 16GiB, 512MiB, 2T)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r}")
    return int(value)


def _list(convert):
    def parse(text: str):
        try:
            return [convert(v) for v in text.split(",") if v.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _demo(args) -> int:
    from shardopt.tools import demo

    return demo.run(args)


def _tune(args) -> int:
    from shardopt.tools import tune

    tune.run(args.factory, args.batch, args.reduce_sizes, args.allgather_sizes, stage=args.stage,
             steps=args.steps, rounds=args.rounds, out_dir=args.out_dir)
    return 0


def _estimate(args) -> int:
    from shardopt import estimate as est

    spec = args.params or args.model
    if spec is None:
        raise ValueError("shardopt estimate needs a model: a parameter count (7e9, 125M; or --params) or "
                         "module:factory")
    if ":" in spec:
        model = est.meta_model(spec)
        shapes, frozen = est.trainable_shapes(model), est.frozen_shapes(model)
    else:
        shapes, frozen = est.count_shapes(parse_count(spec)), []
    n = sum(math.prod(s) for _, s in shapes)
    dtype = est.DTYPES[args.dtype]
    rows, verdicts = [], []
    for ws in args.world_size:
        if args.ranks_per_node and ws % args.ranks_per_node:
            raise SystemExit(f"shardopt estimate: world size {ws} is not a whole number of nodes of "
                             f"--ranks-per-node={args.ranks_per_node}")
        for stage in args.stage:
            base = est.EstimateConfig(world_size=ws, stage=stage, param_dtype=dtype, optimizer=args.optimizer,
                                      reduce_bucket_size=args.reduce_bucket_size,
                                      allgather_bucket_size=args.allgather_bucket_size,
                                      num_staging_buffers=args.num_staging_buffers, device=args.device,
                                      shards=args.ranks_per_node, inter_node_dtype=args.inter_node_dtype,
                                      node_aware=args.node_aware, inter_node_param_dtype=args.inter_node_param_dtype,
                                      offload_buffer_count=args.offload_buffer_count)
            if args.memory is not None:  # every tier setting, and the fastest that fits
                tried, chosen = est.fit(shapes, base, args.memory, args.host_memory, frozen)
                rows += [(c, m) for c, m, _ in tried]
                verdicts.append(est.describe_fit(base, tried, chosen, args.memory))
                continue
            for offload in args.offload:
                for params in args.offload_param:
                    if params != "none" and (stage != 3 or offload == "none" or (args.ranks_per_node or ws) == 1):
                        continue  # ShardedOptimizer refuses it (the parameter tier: stage 3, several ranks)
                    cfg = dataclasses.replace(base, offload=offload, offload_param=params)
                    rows.append((cfg, est.estimate(shapes, cfg, frozen)))
    print(est.format_table(n, rows, est.estimate_ddp(shapes, dtype, args.optimizer)))
    if verdicts:
        print("\n" + "\n".join(verdicts))
    return 0


def _bench(args) -> int:
    from shardopt.tools import bench

    bench.run(args.scenarios, args.quick, args.out_dir, args.benchmarks_dir, args.python)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardopt", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="CPU ranks train a small GPT with ZeRO (--stage 1, 2, 3)")
    d.add_argument("--world-size", type=int, default=2, help="ranks to launch when not under torchrun")
    d.add_argument("--steps", type=int, default=30)
    d.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    d.add_argument("--offload", default="none", choices=("none", "cpu"),
                   help="cpu: master weights and optimizer state on the host, stepped by the fused CPU Adam")
    d.add_argument("--model", default="small", choices=("tiny", "small", "30m"))
    d.add_argument("--batch", type=int, default=8)
    # The default bucket floor (Note [Default bucket sizes]) is half this model; smaller ones show stage 2's saving.
    d.add_argument("--bucket", type=int, default=500_000, help="reduce_bucket_size in elements")
    d.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: 64, at most the model's)")

    e = sub.add_parser("estimate", help="memory per rank for a model, before building it")
    e.add_argument("model", nargs="?", default=None,
                   help="a parameter count (7e9, 7B, 125M) or module:factory (built on the meta device)")
    e.add_argument("--params", default=None, help="the parameter count or module:factory (instead of MODEL)")
    e.add_argument("--world-size", "--ranks", type=_list(int), default=[1, 2, 4, 8], help="comma-separated, e.g. 2,4,8")
    e.add_argument("--stage", type=_list(int), default=[1, 2, 3], help="comma-separated, e.g. 3")
    e.add_argument("--offload", type=_list(str), default=["none", "cpu"], help="comma-separated: none,cpu,nvme")
    e.add_argument("--offload-param", type=_list(str), default=["none"],
                   help="comma-separated: none,nvme (stage 3, --device cpu: the parameter shard on disk)")
    e.add_argument("--offload-buffer-count", type=int, default=4, help="the disk tiers' buffers")
    e.add_argument("--memory", type=parse_bytes, default=None,
                   help="per rank (16GiB): which offload setting fits it, fastest first (a CPU model's memory is "
                        "the host's; a GPU model's device memory, with --host-memory for the host's)")
    e.add_argument("--host-memory", type=parse_bytes, default=None, help="with --memory, a GPU model: host per rank")
    e.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"), help="the model's parameter dtype")
    e.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd, sgd-momentum, adagrad, rmsprop, ...")
    e.add_argument("--reduce-bucket-size", type=parse_count, default=None)
    e.add_argument("--allgather-bucket-size", type=parse_count, default=None)
    e.add_argument("--num-staging-buffers", type=int, default=2)
    e.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="the model's device type")
    e.add_argument("--ranks-per-node", type=int, default=None,
                   help="hybrid sharding (shard_group='node'): shard over this many ranks, replicate across nodes; "
                        "the rows then read NODESxRANKS")
    e.add_argument("--node-aware", action="store_true",
                   help="with --ranks-per-node: flat sharding over every rank with node-aware collectives (the "
                        "default when ranks span nodes) instead of hybrid sharding")
    e.add_argument("--inter-node-dtype", default=None, choices=("bfloat16", "int8"),
                   help="with --ranks-per-node: the hop's format (int8 keeps an error-feedback residual)")
    e.add_argument("--inter-node-param-dtype", default=None, choices=("bfloat16", "int8"),
                   help="with --node-aware, fp32: parameters cross nodes in bf16 (stages 1-2 keep fp32 master "
                        "chunks) or, at stage 3, int8 (block-scaled); the link's bytes per node follow each row")

    t = sub.add_parser("tune", help="time the model over a grid of bucket sizes and recommend one")
    t.add_argument("factory", help="module:factory that builds the model (no arguments)")
    t.add_argument("--batch", default=None, help="module:function returning the model's positional inputs "
                                                "(default: example_batch in the factory's module)")
    t.add_argument("--reduce-sizes", type=_list(parse_count), default=[500_000, 2_000_000, 8_000_000, 32_000_000])
    t.add_argument("--allgather-sizes", type=_list(parse_count), default=None,
                   help="default: the same as each reduce size (stage 1/2 only: stage 3 gathers whole buckets)")
    t.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    t.add_argument("--steps", type=int, default=3, help="timed steps per grid point per round")
    t.add_argument("--rounds", type=int, default=2)
    t.add_argument("--out-dir", default=".")
    t.add_argument("--world-size", type=int, default=2, help="ranks to launch when not under torchrun")

    b = sub.add_parser("bench", help="run benchmarks/ scenarios and write a dated report")
    b.add_argument("--scenarios", type=_list(str), default=["step", "memory", "peers"],
                   help="comma-separated: step, peers, memory, collectives, cpu-adam")
    b.add_argument("--quick", action="store_true")
    b.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    b.add_argument("--benchmarks-dir", default=None)
    b.add_argument("--python", default=None, help="interpreter for the scripts (e.g. one with deepspeed)")

    from shardopt.tools import gpu_check
    gpu_check.add_arguments(sub.add_parser("gpu-check", help="prove the CUDA path on a machine with GPUs"))

    from shardopt.checkpoint import convert
    convert.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.command == "convert":
        return args.run(args)
    if args.command == "demo":
        return _on_ranks(_demo, args, argv, timeout_s=120)
    if args.command == "tune":
        if args.stage == 3 and args.allgather_sizes:
            from shardopt.tools import tune

            print(f"shardopt tune: error: {tune.STAGE3_ALLGATHER}", file=sys.stderr)
            return 2
        return _on_ranks(_tune, args, argv, timeout_s=600)
    if args.command == "gpu-check":
        from shardopt.tools import gpu_check

        return gpu_check.run(args)
    try:
        return _estimate(args) if args.command == "estimate" else _bench(args)
    except (ValueError, TypeError, ImportError, AttributeError, RuntimeError, OSError,
            argparse.ArgumentTypeError) as e:
        # Bad input: the message names the problem and the fix, which a traceback would bury.
        print(f"shardopt {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
