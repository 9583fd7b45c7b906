"""Where a tiered step's time goes: stage 3 with the optimizer state and the parameters on disk against the
same model untiered, steps interleaved in the same ranks, with the disk's direct-I/O rate measured in the run.

Per rank and variant: the step's wall time (forward + backward + step), the bytes read and written by the
scratch files (ScratchFile's counters) and by the process as the kernel counts them (/proc/self/io: the
gradient shard's mapped pages too), and phase_seconds() (io: the exposed waits). The bar (issue 70): the
tiered step <= 1.2 x max(the untiered step, the bytes it moves / the disk's direct-I/O rate).

    python benchmarks/tier_overlap.py [--width 2048] [--layers 12] [--steps 6] [--nvme DIR] [--buffers 4]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardopt.cluster.ranks import run_ranks  # noqa: E402
from shardopt.tiers.disk import AioConfig  # noqa: E402

VARIANTS = {  # name: ShardConfig options
    "untiered": dict(offload="cpu"),
    "tiered": dict(offload="nvme", offload_param="nvme"),
    "untiered-pg": dict(offload="cpu", shared_memory_gather=False),  # gathers through the process group
    "state-tier": dict(offload="nvme"),
}


def _io() -> tuple[int, int]:
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _disk_rate(nvme: str, nbytes: int, aio) -> tuple[float, float]:
    """(read, write) bytes/s of one rank's direct I/O while its peers do the same (a barrier around each)."""
    import torch.distributed as dist

    from shardopt.tiers.disk import ScratchFile, aligned_empty

    block = 64 << 20
    f = ScratchFile(nvme, "rate", nbytes, aio)
    bufs = [aligned_empty(block, torch.uint8).fill_(1) for _ in range(2)]
    rates = []
    for write in (True, False):
        dist.barrier()
        t0 = time.perf_counter()
        pending = []
        for i, at in enumerate(range(0, nbytes, block)):
            if len(pending) == 2:
                pending.pop(0).wait()
            start = f.start_write if write else f.start_read
            pending.append(start(at, bufs[i % 2]))
        for r in pending:
            r.wait()
        dist.barrier()
        rates.append(nbytes / (time.perf_counter() - t0))
    f.close()
    return rates[1], rates[0]


def _model(width, layers):
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.GELU())])


def _files(opt):
    files = []
    if opt.state_tier is not None:
        files.append(opt.state_tier.file)
    if opt.store.tier is not None:
        files += opt.store.tier.files
    return files


def _marks(opt) -> dict:
    """Counters read before and after each part of a step: page faults, and each tier's exposed waits."""
    import resource

    use = resource.getrusage(resource.RUSAGE_SELF)
    out = dict(majflt=use.ru_majflt, minflt=use.ru_minflt, cpu=use.ru_utime + use.ru_stime)
    out["params_wait"] = opt.store.tier.exposed if opt.store.tier is not None else 0.0
    out["ring_wait"] = opt.state_tier.ring.exposed if opt.state_tier is not None else 0.0
    out["grad_drop"] = opt.grad_file.exposed if opt.grad_file is not None else 0.0
    out["gather"] = opt.phase_seconds()["gather"]
    return out


def _rank(rank, world_size, args):
    import shardopt

    torch.set_num_threads(args.threads)
    nvme = os.path.join(args.nvme, f"rank{rank}")
    os.makedirs(nvme, exist_ok=True)
    built = {}
    for name in args.variants.split(","):
        kw = VARIANTS[name]
        model = _model(args.width, args.layers)
        params = sum(p.numel() for p in model.parameters())
        disk = dict(nvme_path=nvme, offload_buffer_count=args.buffers) if "nvme" in kw.values() else {}
        opt = shardopt.ShardedOptimizer(model.parameters(), stage=3, lr=1e-3, reduce_bucket_size=args.bucket,
                                        **disk, **kw)
        built[name] = (shardopt.ShardedDDP(model, opt), opt)
    read_rate, write_rate = _disk_rate(nvme, args.rate_bytes, AioConfig())
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
    rows = {name: [] for name in built}
    for step in range(args.steps):
        for name, (model, opt) in built.items():
            files = _files(opt)
            before = [(f.bytes_read, f.bytes_written) for f in files]
            phases = opt.phase_seconds()
            io0, mark = _io(), _marks(opt)
            t0 = time.perf_counter()
            loss = model(x).square().mean()
            tf, fwd = time.perf_counter(), _marks(opt)
            loss.backward()
            t1, bwd = time.perf_counter(), _marks(opt)
            opt.step()
            opt.zero_grad()
            t2, end = time.perf_counter(), _marks(opt)
            io1 = _io()
            after = opt.phase_seconds()
            rows[name].append(dict(
                wall=t2 - t0, fwd=tf - t0, bwd=t1 - tf, opt_step=t2 - t1,
                read=sum(f.bytes_read - b[0] for f, b in zip(files, before)),
                written=sum(f.bytes_written - b[1] for f, b in zip(files, before)),
                proc_read=io1[0] - io0[0], proc_written=io1[1] - io0[1],
                **{f"phase_{k}": after[k] - phases.get(k, 0.0) for k in after},
                **{f"{part}_{k}": b[k] - a[k] for part, a, b in (("fwd", mark, fwd), ("bwd", fwd, bwd),
                                                                  ("step", bwd, end)) for k in a}))
    weights = []
    for model, opt in built.values():
        with opt.full_params(writeback=False):
            weights.append([p.detach().clone() for p in model.parameters()])
    same = all(torch.equal(a, b) for w in weights[1:] for a, b in zip(weights[0], w))
    return dict(rows=rows, read_rate=read_rate, write_rate=write_rate, same=same,
                params=params)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bucket", type=int, default=1 << 22)
    p.add_argument("--buffers", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rate-bytes", type=int, default=512 << 20)
    p.add_argument("--nvme", default=None)
    p.add_argument("--variants", default="untiered,tiered", help=f"of {', '.join(VARIANTS)}")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.nvme or os.getcwd(), prefix="tier-overlap-") as tmp:
        args.nvme = tmp
        out = run_ranks(_rank, args.ranks, args, timeout=1800, collective_timeout=600)
    print(f"{platform.node()} load {os.getloadavg()[0]:.1f}; {out[0]['params'] / 1e6:.1f}M parameters, "
          f"{args.ranks} ranks, stage 3, bucket {args.bucket} elements, buffers {args.buffers}; "
          f"weights equal across variants: {all(o['same'] for o in out)}")
    for rank, o in enumerate(out):
        print(f"rank {rank}: disk direct I/O read {o['read_rate'] / 2**20:.0f} MiB/s, "
              f"write {o['write_rate'] / 2**20:.0f} MiB/s (every rank at once)")
        for name, rows in o["rows"].items():
            rows = rows[args.warmup:]
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            disk_s = med["read"] / o["read_rate"] + med["written"] / o["write_rate"]
            phases = " ".join(f"{k[6:]} {v:.3f}" for k, v in med.items() if k.startswith("phase_") and v > 0.0005)
            walls = " ".join(f"{r['wall']:.2f}" for r in rows)
            parts = "\n".join(f"            {part}: " + " ".join(
                f"{k} {med[f'{part}_{k}']:.3f}" if isinstance(med[f'{part}_{k}'], float) else f"{k} {med[f'{part}_{k}']}"
                for k in ("cpu", "majflt", "minflt", "params_wait", "ring_wait", "grad_drop", "gather"))
                for part in ("fwd", "bwd", "step"))
            print(f"  {name:9s} step {med['wall']:.3f}s (fwd {med['fwd']:.3f} bwd {med['bwd']:.3f} opt.step "
                  f"{med['opt_step']:.3f}); phases: {phases}\n{parts}\n"
                  f"            files read {med['read'] / 2**20:.0f} MiB written {med['written'] / 2**20:.0f} MiB "
                  f"(/proc/self/io {med['proc_read'] / 2**20:.0f}/{med['proc_written'] / 2**20:.0f} MiB): disk time "
                  f"{disk_s:.3f}s; steps {walls}")
        u = statistics.median(r["wall"] for r in o["rows"]["untiered"][args.warmup:])
        t_rows = o["rows"]["tiered"][args.warmup:]
        t = statistics.median(r["wall"] for r in t_rows)
        disk_s = statistics.median(r["read"] / o["read_rate"] + r["written"] / o["write_rate"] for r in t_rows)
        print(f"  bar: tiered {t:.3f}s <= 1.2 x max({u:.3f}, {disk_s:.3f}) = {1.2 * max(u, disk_s):.3f}s: "
              f"{t <= 1.2 * max(u, disk_s)}")


if __name__ == "__main__":
    main()
