"""The disk's own sequential direct-I/O rate in a directory, and what shardopt's ScratchFile gets from it.

The tiers (shardopt/tiers/, Note [Direct I/O for the tiers]) move a rank's state through a scratch file with
O_DIRECT; issue 70 judges them against "the disk's own sequential read and write rate, measured with direct
I/O". This script measures both in the same run, in the same directory:

- the disk: `dd` with oflag=direct / iflag=direct (the kernel's own path, no Python), one stream with 64 MiB
  requests (the block layer splits each into max_sectors_kb pieces, all in flight) and 4 streams on
  disjoint quarters of the file with 16 MiB requests; each over the whole file, which is made with
  posix_fallocate first, as ScratchFile reserves its space.
- ScratchFile at a grid of aio settings (block_size x queue_depth, thread_count 1): the file written from
  one page-aligned 64 MiB buffer at successive offsets, two transfers outstanding, then read back the same
  way. Before any speed is printed, a pattern written through ScratchFile is read back and compared.

Writes are timed twice, into freshly reserved space (ext4 converts unwritten extents as it goes) and over
written blocks (what a tier does at every step); reads follow the overwrite and an fsync (not timed). A write
is timed until its requests complete, with no fsync, on both sides: a tier's scratch file needs no
durability. Rates are MiB/s (2^20 bytes per second), the best of --repeats. The file is 2 GiB (--gib);
--quick: 0.5 GiB, one repeat and a smaller grid.

    python benchmarks/bench_disk.py [--dir /tmp] [--gib 2] [--quick] [--out benchmarks/results/DATE-disk.md]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardopt.tiers.disk import AioConfig, ScratchFile, aligned_empty, filesystem_of  # noqa: E402

MIB = 2**20
BUFFER = 64 * MIB


def _dd(path: str, nbytes: int, streams: int, request: int, write: bool) -> float:
    """Seconds for `streams` dd processes to move `nbytes` of `path` with direct I/O in `request`-byte requests,
    each stream its own contiguous part of the file."""
    part = nbytes // streams
    count = part // request
    cmds = []
    for s in range(streams):
        at = s * count  # in requests
        if write:
            cmds.append(["dd", "if=/dev/zero", f"of={path}", f"bs={request}", f"count={count}", f"seek={at}",
                         "oflag=direct", "conv=notrunc", "status=none"])
        else:
            cmds.append(["dd", f"if={path}", "of=/dev/null", f"bs={request}", f"count={count}", f"skip={at}",
                         "iflag=direct", "status=none"])
    start = time.perf_counter()
    procs = [subprocess.Popen(c, stderr=subprocess.PIPE) for c in cmds]
    for p, c in zip(procs, cmds):
        _, err = p.communicate(timeout=600)
        if p.returncode:
            raise RuntimeError(f"{' '.join(c)} failed: {err.decode().strip()}")
    return time.perf_counter() - start


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _reserve(path: str, nbytes: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)


def disk_rates(directory: str, nbytes: int, repeats: int) -> list[dict]:
    """dd's rates: one row per (streams, request size), first write, overwrite and read in MiB/s."""
    rows = []
    fd, path = tempfile.mkstemp(prefix=".bench-disk-", dir=directory)
    os.close(fd)
    try:
        for streams, request in ((1, 64 * MIB), (4, 16 * MIB)):
            best = {"first write": 0.0, "overwrite": 0.0, "read": 0.0}
            for _ in range(repeats):
                _reserve(path, nbytes)
                best["first write"] = max(best["first write"], nbytes / _dd(path, nbytes, streams, request, True))
                best["overwrite"] = max(best["overwrite"], nbytes / _dd(path, nbytes, streams, request, True))
                _fsync(path)
                best["read"] = max(best["read"], nbytes / _dd(path, nbytes, streams, request, False))
            rows.append({"how": f"dd, {streams} stream{'s' * (streams > 1)} x {request // MIB} MiB requests",
                         **{k: v / MIB for k, v in best.items()}})
    finally:
        os.unlink(path)
    return rows


def _sweep(f: ScratchFile, buf: torch.Tensor, nbytes: int, write: bool) -> float:
    """Seconds to move the whole file through `buf`, two transfers outstanding."""
    start = time.perf_counter()
    pending = []
    for offset in range(0, nbytes, len(buf) * buf.element_size()):
        pending.append(f.start_write(offset, buf) if write else f.start_read(offset, buf))
        if len(pending) > 1:
            pending.pop(0).wait()
    for r in pending:
        r.wait()
    return time.perf_counter() - start


def check_round_trip(directory: str) -> str:
    """A pattern written through ScratchFile at two offsets reads back equal (correctness before speed)."""
    numel = (8 * MIB) // 8
    buf = aligned_empty(numel, torch.int64)
    f = ScratchFile(directory, "bench", 32 * MIB, AioConfig(block_size=1 * MIB, queue_depth=4))
    try:
        for offset, seed in ((0, 1), (24 * MIB, 2)):
            torch.arange(numel, out=buf).mul_(seed).add_(seed)
            f.start_write(offset, buf).wait()
        for offset, seed in ((0, 1), (24 * MIB, 2)):
            buf.zero_()
            f.start_read(offset, buf).wait()
            if not torch.equal(buf, torch.arange(numel, dtype=torch.int64) * seed + seed):
                return f"MISMATCH at offset {offset}"
    finally:
        f.close()
    return "equal (2 x 8 MiB written at offsets 0 and 24 MiB, read back)"


def scratch_rates(directory: str, nbytes: int, grid, repeats: int) -> list[dict]:
    buf = aligned_empty(BUFFER // 4, torch.float32)
    buf.uniform_()
    rows = []
    for block_size, queue_depth in grid:
        aio = AioConfig(block_size=block_size, queue_depth=queue_depth, thread_count=1)
        best = {"first write": 0.0, "overwrite": 0.0, "read": 0.0}
        for _ in range(repeats):
            f = ScratchFile(directory, "bench", nbytes, aio)  # freshly reserved space each time
            try:
                best["first write"] = max(best["first write"], nbytes / _sweep(f, buf, nbytes, True))
                best["overwrite"] = max(best["overwrite"], nbytes / _sweep(f, buf, nbytes, True))
                os.fsync(f.fd)
                best["read"] = max(best["read"], nbytes / _sweep(f, buf, nbytes, False))
            finally:
                f.close()
        rows.append({"how": f"ScratchFile, block_size {block_size // 1024} KiB, queue_depth {queue_depth}",
                     **{k: v / MIB for k, v in best.items()}})
    return rows


def _cpu() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                    platform.machine())


def _device_of(directory: str) -> str:
    """The block device under `directory` and its queue settings, as far as sysfs tells."""
    st = os.stat(directory)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sys_dev = f"/sys/dev/block/{dev}"
    try:
        name = os.path.basename(os.path.realpath(sys_dev))
        queue = os.path.join(os.path.realpath(sys_dev), "queue")
        if not os.path.isdir(queue):  # a partition: the disk's queue is one level up
            queue = os.path.join(os.path.dirname(os.path.realpath(sys_dev)), "queue")

        def read(key):
            with open(os.path.join(queue, key)) as f:
                return f.read().strip()
        return (f"/dev/{name} ({filesystem_of(directory)}; rotational {read('rotational')}, "
                f"max_sectors_kb {read('max_sectors_kb')}, nr_requests {read('nr_requests')}, "
                f"scheduler {read('scheduler')})")
    except OSError:
        return f"device {dev} ({filesystem_of(directory)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the disk to measure")
    ap.add_argument("--gib", type=float, default=2.0, help="the file's size in GiB")
    ap.add_argument("--repeats", type=int, default=2, help="best of this many")
    ap.add_argument("--quick", action="store_true", help="0.5 GiB, one repeat, a smaller grid (about a minute)")
    ap.add_argument("--out", default=None, help="the markdown file to write")
    args = ap.parse_args()
    if args.quick:
        args.gib, args.repeats = 0.5, 1
        grid = [(256 * 1024, 4), (1 * MIB, 8), (4 * MIB, 8)]
    else:
        grid = [(b, q) for b in (256 * 1024, 1 * MIB, 4 * MIB) for q in (1, 4, 8, 16)]
    nbytes = int(args.gib * 2**30) // BUFFER * BUFFER
    load = os.getloadavg()

    check = check_round_trip(args.dir)
    print(f"ScratchFile round trip: {check}", flush=True)
    rows = disk_rates(args.dir, nbytes, args.repeats)
    for r in rows:
        print(r, flush=True)
    ours = scratch_rates(args.dir, nbytes, grid, args.repeats)
    for r in ours:
        print(r, flush=True)

    def best(key, table):
        return max(r[key] for r in table)

    lines = [f"# Sequential direct I/O: the disk and ScratchFile ({datetime.date.today().isoformat()})", "",
             f"Machine: {_cpu()}, {os.cpu_count()} cores, torch {torch.__version__}. Directory {args.dir} on "
             f"{_device_of(args.dir)}. File {nbytes / 2**30:.2f} GiB, best of {args.repeats}; load average "
             f"{load[0]:.2f} at the start (the machine is shared). MiB/s = 2^20 bytes per second. First write: "
             f"into space just reserved with posix_fallocate; overwrite: the same blocks again (what a tier does "
             f"every step); read: after the overwrite. Writes are timed to completion without fsync. dd: the "
             f"kernel's path with no Python; ScratchFile: "
             f"shardopt/tiers/disk.py, one 64 MiB page-aligned buffer, two transfers outstanding, thread_count 1.",
             "", f"Correctness first: {check}.", "",
             "| how | first write MiB/s | overwrite MiB/s | read MiB/s |", "|---|---|---|---|"]
    lines += [f"| {r['how']} | {r['first write']:.0f} | {r['overwrite']:.0f} | {r['read']:.0f} |" for r in rows + ours]
    lines += ["", f"The disk (best of dd): write {best('overwrite', rows):.0f} MiB/s, read {best('read', rows):.0f} "
              f"MiB/s. ScratchFile's best: write {best('overwrite', ours):.0f} MiB/s "
              f"({best('overwrite', ours) / best('overwrite', rows):.2f}x the disk), read {best('read', ours):.0f} "
              f"MiB/s ({best('read', ours) / best('read', rows):.2f}x).", "",
              f"Command: `python benchmarks/bench_disk.py {' '.join(sys.argv[1:])}`"]
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
