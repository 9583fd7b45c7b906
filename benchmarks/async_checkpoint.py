"""How long a checkpoint save stops training (issue 71): shardopt's save_checkpoint, blocking and blocking=False
(its writer a thread, at nice +10 or not, or a process), against FSDP2 + torch.distributed.checkpoint (dcp.save,
async_save with its thread and with its process), 2 ranks, the contenders interleaved in one run.

The model is an MLP of --layers Linear(--width, --width) with ReLU (8 x 2048: 33.6M parameters, 134 MB in fp32),
trained with AdamW on random batches: every rank's checkpoint part is its half of the fp32 values, exp_avg and
exp_avg_sq, 201 MB. Each rank builds it twice, as shardopt (stage 2) and as FSDP2 (fully_shard per layer and
the root), and each round runs every contender once, in an order rotated round by round: --before steps, the
save (the time the call takes: training is blocked for it), --after steps (those that start while the write is
still running "overlap" it), then the wait for what is left of the write. A contender's clean steps are its
framework's steps with no write running. Memory: the process's PSS (/proc/self/smaps_rollup) right before
the call and right after it returns, and its most across the steps after.

shardopt's process writer exists only here: the staging slabs are files in /dev/shm, and a child process
started once per rank (python -c, no torch) maps them and writes each file (the same request sizes,
checksums, fsync and page-cache drop as the thread writer), while shardopt's thread waits for it and commits.

    python benchmarks/async_checkpoint.py --rounds 3 --out benchmarks/results/DATE-async-checkpoint.json

Run on a host shared with other work: the report gives `uptime`'s load before and after.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONTENDERS = ["shardopt blocking", "shardopt thread", "shardopt thread nice 0", "shardopt process",
              "dcp save", "dcp async thread", "dcp async process"]

CHILD = r"""
import json, mmap, os, sys, zlib
os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + int(sys.argv[1])))
maps = {}
for line in sys.stdin:
    path, records = json.loads(line)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    crc, crcs = 0, []
    for slab, at, n in records:
        if slab not in maps:
            f = os.open(slab, os.O_RDONLY)
            maps[slab] = memoryview(mmap.mmap(f, 0, prot=mmap.PROT_READ))
            os.close(f)
        data = maps[slab][at:at + n]
        crcs.append(zlib.crc32(data))
        crc = zlib.crc32(data, crc)
        done = 0
        while done < n:
            done += os.write(fd, data[done:done + (16 << 20)])
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    sys.stdout.write(json.dumps([crc, crcs]) + "\n")
    sys.stdout.flush()
"""


def pss_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def mlp(width: int, layers: int) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])


class ProcessWriter:
    """shardopt's writer as a child process: staging slabs in /dev/shm, files written by the child."""

    def __init__(self, nice: int):
        self.child = subprocess.Popen([sys.executable, "-c", CHILD, str(nice)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        self.names: dict = {}
        self.folder = tempfile.mkdtemp(prefix="shardopt-bench-", dir="/dev/shm")

    def alloc(self, nbytes: int) -> torch.Tensor:
        path = os.path.join(self.folder, f"slab-{len(self.names)}")
        t = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        self.names[t.data_ptr()] = path
        return t

    def write_staged(self, plan) -> dict:
        import numpy as np

        records = [(self.names[np.frombuffer(mem, dtype=np.uint8).ctypes.data], at, n)
                   for mem, at, n, _ in plan.records]
        self.child.stdin.write(json.dumps([plan.path, records]) + "\n")
        self.child.stdin.flush()
        crc, crcs = json.loads(self.child.stdout.readline())
        for (_, _, _, ref), c in zip(plan.records, crcs):
            ref["crc32"] = c
        return {"size": plan.size, "crc32": crc}

    def close(self) -> None:
        self.child.stdin.close()
        self.child.wait()
        for path in self.names.values():
            os.unlink(path)
        os.rmdir(self.folder)


def _step(model, opt, x) -> None:
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _rank(rank, world, args, root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import shardopt
    from shardopt.checkpoint import background, staging

    # DCP's process writer starts a child process, which a daemonic process (a launcher's rank) may not.
    multiprocessing.current_process().daemon = False
    torch.manual_seed(0)
    ours = mlp(args.width, args.layers)
    opt = shardopt.ShardedOptimizer(ours.parameters(), torch.optim.AdamW, lr=1e-4, stage=2)
    wrapper = shardopt.ShardedDDP(ours, opt)
    theirs = mlp(args.width, args.layers)
    mesh = init_device_mesh("cpu", (world,))
    for layer in theirs:
        fully_shard(layer, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    topt = torch.optim.AdamW(theirs.parameters(), lr=1e-4)
    dcp_group = dist.new_group(backend="gloo")  # DCP's async saves collect on a group of their own, as advised
    x = torch.randn(args.batch, args.width)
    for _ in range(2):  # optimizer state exists before the first save
        _step(wrapper, opt, x)
        _step(theirs, topt, x)
    background.saver_of(opt.view)
    thread_staging = opt.view.saver.staging
    process = ProcessWriter(background.WRITER_NICE)
    process_staging = staging.Staging(process.alloc)
    write_staged = background.write_staged

    def start(name, path):
        """The save begins; returns (is it done?, wait for it)."""
        if name.startswith("shardopt"):
            background.WRITER_NICE = 0 if name.endswith("nice 0") else 10
            opt.view.saver.staging = process_staging if name.endswith("process") else thread_staging
            background.write_staged = process.write_staged if name.endswith("process") else write_staged
            if name == "shardopt blocking":
                shardopt.save_checkpoint(path, wrapper, opt)
                return lambda: True, lambda: None
            handle = shardopt.save_checkpoint(path, wrapper, opt, blocking=False)
            return handle.done, handle.result
        msd, osd = get_state_dict(theirs, topt)
        state = {"model": msd, "optim": osd}
        if name == "dcp save":
            dcp.save(state, checkpoint_id=path)
            return lambda: True, lambda: None
        kind = AsyncCheckpointerType.PROCESS if name.endswith("process") else AsyncCheckpointerType.THREAD
        future = dcp.async_save(state, checkpoint_id=path, process_group=dcp_group, async_checkpointer_type=kind)
        return future.done, future.result

    records = []
    names = [n for n in CONTENDERS if n in args.contenders]
    for round_ in range(args.rounds):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            model, o = (wrapper, opt) if name.startswith("shardopt") else (theirs, topt)
            steps = []
            for _ in range(args.before):
                t = time.perf_counter()
                _step(model, o, x)
                steps.append((time.perf_counter() - t, False))
            dist.barrier()
            path = os.path.join(root, name.replace(" ", "-"), f"round-{round_}")
            pss0 = pss_bytes()
            t0 = time.perf_counter()
            done, wait = start(name, path)
            blocked = time.perf_counter() - t0
            pss1 = peak = pss_bytes()
            written_at = None
            for _ in range(args.after):
                overlapping = not done()
                if not overlapping and written_at is None:
                    written_at = time.perf_counter() - t0
                t = time.perf_counter()
                _step(model, o, x)
                steps.append((time.perf_counter() - t, overlapping))
                peak = max(peak, pss_bytes())
            t = time.perf_counter()
            wait()
            tail = time.perf_counter() - t
            if written_at is None:
                written_at = time.perf_counter() - t0
            records.append({"rank": rank, "round": round_, "contender": name, "blocked_s": blocked,
                            "written_s": written_at, "tail_wait_s": tail, "steps": steps,
                            "pss_before": pss0, "pss_after_call": pss1, "pss_peak": peak})
            dist.barrier()
    background.write_staged = write_staged
    process.close()
    return records


def summarize(records: list, load: tuple) -> str:
    def med(xs):
        return statistics.median(xs) if xs else float("nan")

    lines = [f"load (uptime) before/after: {load[0]} / {load[1]}", "",
             "| contender | saves | blocked per save (median, s) | blocked, first save (s) | write done after (s) "
             "| overlapping steps (median, s) | clean steps of its framework (median, s) | slowdown "
             "| PSS added by the call, first / later saves (MB) |", "|---|---|---|---|---|---|---|---|---|"]
    clean = {}
    for fw in ("shardopt", "dcp"):
        clean[fw] = med([d for r in records if r["contender"].startswith(fw) for d, o in r["steps"] if not o])
    for name in CONTENDERS:
        rs = [r for r in records if r["contender"] == name]
        if not rs:
            continue
        fw = "shardopt" if name.startswith("shardopt") else "dcp"
        first = [r for r in rs if r["round"] == min(x["round"] for x in rs)]
        later = [r for r in rs if r not in first]
        over = [d for r in rs for d, o in r["steps"] if o]
        slow = med(over) / clean[fw] - 1 if over else float("nan")
        added = [med([r["pss_after_call"] - r["pss_before"] for r in rs_]) / 1e6 for rs_ in (first, later)]
        lines.append(f"| {name} | {len(rs) // 2} per rank | {med([r['blocked_s'] for r in later or rs]):.3f} | "
                     f"{max(r['blocked_s'] for r in first):.3f} | {med([r['written_s'] for r in rs]):.2f} | "
                     f"{med(over):.3f} ({len(over)}) | {clean[fw]:.3f} | {slow * 100:+.0f}% | "
                     f"{added[0]:.0f} / {added[1]:.0f} |")
    return "\n".join(lines)


def main():
    from shardopt.cluster.ranks import run_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before", type=int, default=3)
    p.add_argument("--after", type=int, default=8)
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--root", default=None, help="where the checkpoints go (default: a folder under /tmp)")
    p.add_argument("--out", default=None, help="the records, as JSON (a .md summary beside it)")
    args = p.parse_args()
    args.contenders = args.contenders.split(",")
    root = args.root or tempfile.mkdtemp(prefix="async-ckpt-")
    before = os.getloadavg()
    try:
        per_rank = run_ranks(_rank, 2, args, root, timeout=3000, collective_timeout=600)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    after = os.getloadavg()
    records = [r for rs in per_rank for r in rs]
    text = summarize(records, (before, after))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "load": [before, after], "records": records}, f)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
