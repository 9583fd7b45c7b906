"""A model that does not fit one rank's memory: DDP and ZeRO-2 are killed, ZeRO-3 at 4 ranks trains it.

How the cap is enforced: each rank, once torch is imported and its process group
is up, makes a cgroup (v1 memory controller, /sys/fs/cgroup/memory) of its own
with memory.limit_in_bytes = --cap-mib, writes its pid into cgroup.procs and
only then builds the model and trains. Only memory touched after joining is
charged, so the cap is what the model, the optimizer and the training need on
top of an idle rank. A rank that goes over it is killed by the kernel's OOM
killer (SIGKILL, exit -9), which the launcher reports. The groups are removed
afterwards, also after failures. Needs root.

Every variant trains the same GPT (fp32, AdamW, 3 steps): DDP and ZeRO-2 build
it whole on every rank, as they must; ZeRO-3 builds it on the meta device and
materialises it bucket by bucket (Note [Meta-device models]) with GPT's init
(tools/gpt.py init_weights: the same distribution, other values, so its losses
start near the others' without being equal).

    python benchmarks/zero3_fit.py [--cap-mib 700] [--layers 12] [--dim 768]

--variants picks others (comma-separated): besides DDP, ZeRO-2 and ZeRO-3, OneBitAdam variants named
"<stage> <mesh> OneBitAdam" ("ZeRO-3 2x2 OneBitAdam", "ZeRO-3 flat OneBitAdam", "ZeRO-2 2x2 OneBitAdam"),
and AdamW on a mesh ("ZeRO-3 2x2"): OneBitAdam freezes after the first step, so the other two compress
(Note [1-bit Adam under ZeRO] in shardopt/onebit.py: what each mesh holds whole). With a cap no variant
reaches, the table compares what each was charged.

    python benchmarks/zero3_fit.py --cap-mib 4000 --layers 6 \
        --variants "ZeRO-3 2x2,ZeRO-3 2x2 OneBitAdam,ZeRO-2 2x2 OneBitAdam,ZeRO-3 flat OneBitAdam,ZeRO-3"
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import secrets
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardopt.cluster.ranks import RankFailure, run_ranks  # noqa: E402

CGROUP = "/sys/fs/cgroup/memory"


# The cap, shared with benchmarks/weights_memory.py: a rank joins a group of its own once it has imported
# what it needs and set up its process group, so that only what it touches from then on is charged.
def join_cgroup(name: str, cap_mib: int) -> str:
    """Makes the cgroup-v1 memory group CGROUP/name capped at `cap_mib` MiB and moves this process into it;
    returns its path. Remove it with remove_groups once the process has ended."""
    group = os.path.join(CGROUP, name)
    os.makedirs(group, exist_ok=True)
    with open(os.path.join(group, "memory.limit_in_bytes"), "w") as f:
        f.write(str(cap_mib << 20))
    with open(os.path.join(group, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    return group


def charged_peak(group: str) -> int:
    """The most bytes the group has been charged since it was made (or since reset_peak), page cache included."""
    with open(os.path.join(group, "memory.max_usage_in_bytes")) as f:
        return int(f.read())


def reset_peak(group: str) -> None:
    """Starts charged_peak afresh from the group's charge now."""
    with open(os.path.join(group, "memory.max_usage_in_bytes"), "w") as f:
        f.write("0")


def remove_groups(prefix: str) -> None:
    """Removes every group under CGROUP whose name starts with `prefix` (their processes must have ended)."""
    for name in os.listdir(CGROUP):
        if name.startswith(prefix):
            try:
                os.rmdir(os.path.join(CGROUP, name))
            except OSError as e:
                print(f"could not remove cgroup {name}: {e}", file=sys.stderr)


def _train(rank, world_size, variant, layers, dim, cap_mib, token):
    import shardopt
    from shardopt.tools.gpt import GPT, GPTConfig, init_weights, synthetic_batch

    group = join_cgroup(f"shardopt-fit-{token}-{rank}", cap_mib)
    cfg = GPTConfig(vocab=8192, dim=dim, layers=layers, heads=8, seq=128)
    torch.manual_seed(0)
    words = variant.split()
    stage3 = words[0] == "ZeRO-3"
    kw = dict(optim=torch.optim.AdamW)
    if len(words) > 1 and words[1] != "flat":  # a mesh, "RxS": R replicas of S shards
        from torch.distributed.device_mesh import init_device_mesh

        r, s = map(int, words[1].split("x"))
        kw["mesh"] = init_device_mesh("cpu", (r, s), mesh_dim_names=("replicate", "shard"))
    if words[-1] == "OneBitAdam":
        kw.update(optim=shardopt.OneBitAdam, freeze_step=1)
    if stage3:
        with torch.device("meta"):
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    if variant == "DDP":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapper, opt = DDP(model), torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = shardopt.ShardedOptimizer(model.parameters(), lr=1e-3, stage=3 if stage3 else 2,
                                        reduce_bucket_size=2_000_000, **kw)
        wrapper = shardopt.ShardedDDP(model, opt, param_init_fn=init_weights if stage3 else None)
    losses = []
    warnings.filterwarnings("ignore", message="OneBitAdam")  # the freeze's notices
    for step in range(3):
        x, y = synthetic_batch(cfg, 2, 16, step, rank)
        loss = torch.nn.functional.cross_entropy(wrapper(x).reshape(-1, cfg.vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    used = charged_peak(group)
    torch.distributed.barrier()
    return losses, used




def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap-mib", type=int, default=300)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", default="DDP,ZeRO-2,ZeRO-3")
    args = ap.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    token = secrets.token_hex(3)
    rows = []
    try:
        for variant in [v.strip() for v in args.variants.split(",")]:
            try:
                res = run_ranks(_train, args.world_size, variant, args.layers, args.dim, args.cap_mib, token, timeout=900)
                rows.append((variant, "trained", f"losses {', '.join(f'{v:.3f}' for v in res[0][0])}; "
                             f"peak charged {max(u for _, u in res) / 2**20:.0f} MiB (max rank)"))
            except RankFailure as e:
                killed = "exit code -9" in str(e)
                rows.append((variant, "killed by the OOM killer (SIGKILL)" if killed else "failed",
                             str(e).strip().splitlines()[-1][:160]))
            remove_groups(f"shardopt-fit-{token}-")
    finally:
        remove_groups(f"shardopt-fit-{token}-")
    from shardopt.tools.gpt import GPT, GPTConfig

    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(GPTConfig(vocab=8192, dim=args.dim, layers=args.layers, heads=8,
                                                 seq=128)).parameters())
    lines = [f"# A model that does not fit — {datetime.date.today().isoformat()}", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo, "
             f"{args.world_size} ranks; GPT dim {args.dim} x {args.layers} blocks ({n / 1e6:.1f}M parameters, "
             f"{16 * n / 2**20:.0f} MiB of fp32 AdamW model states), 3 steps. Per-rank cap {args.cap_mib} MiB "
             f"(cgroup v1 memory.limit_in_bytes, joined after import; see the script's docstring).", "",
             "| variant | outcome | details |", "|---|---|---|"]
    lines += [f"| {v} | {o} | {d} |" for v, o, d in rows]
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
