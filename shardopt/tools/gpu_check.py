"""One command that proves or disproves shardopt's CUDA path on a machine with GPUs, into one markdown file.

    python -m shardopt.tools.gpu_check [--out gpu-check.md] [--world-sizes 1,2] [--configs zero2,bf16] [--quick]
    shardopt gpu-check ...            .ci/gpu-check ...        (the same)

Without CUDA it prints one line and exits 0 (CI runs it so). With CUDA it reports, with the GPU, driver,
CUDA, NCCL and torch versions:
  * every op of shardopt._C with a CUDA kernel against its reference in shardopt/reference.py (gpu_kernels.py);
  * ShardedOptimizer + ShardedDDP against DDP + torch.optim (bf16/fp16: the master-weight loop of
    tests/test_mixed_precision.py) at world size 1 and 2..N NCCL ranks, for every configuration of
    gpu_training.CONFIGS, at the test suite's bars (Note [Parity bars]);
  * host syncs per step, step time and peak memory against shardopt.estimate, next to DDP's.
It exits 1 if a kernel or parity check fails (or a rank crashes); speed and memory are never judged.

Note [One device interface]
---------------------------
Every call to the GPU runtime goes through `Device` below; the rest is plain code over tensors on whatever
device `Device.set_device` returns. tests/test_gpu_check.py swaps in a stand-in that answers as two GPUs
would but hands out the CPU and gloo, and runs the whole flow end to end. What only a GPU shows (the
kernels' numbers, NCCL, the side-stream copier, real syncs, timings, memory) is what this command is for.
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import warnings

import torch

DEFAULT_OUT = "gpu-check.md"


class SyncCounter:
    """Counts torch's "called a synchronizing CUDA operation" reports while active: Python warnings, and
    the lines the C++ handler writes to stderr under an extension's call; everything else is passed on."""

    MESSAGE = "called a synchronizing CUDA operation"

    def __init__(self):
        self.count = 0

    def __enter__(self):
        self._catch = warnings.catch_warnings(record=True)
        self._caught = self._catch.__enter__()
        warnings.simplefilter("always")
        sys.stderr.flush()
        self._saved_fd = os.dup(2)
        self._file = tempfile.TemporaryFile()
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self._saved_fd, 2)
        os.close(self._saved_fd)
        self._file.seek(0)
        text = self._file.read().decode(errors="replace")
        self._file.close()
        self._catch.__exit__(*exc)
        lines = text.splitlines(keepends=True)
        self.count = sum(self.MESSAGE in line for line in lines)
        self.count += sum(self.MESSAGE in str(w.message) for w in self._caught)
        sys.stderr.write("".join(line for line in lines if self.MESSAGE not in line))
        for w in self._caught:
            if self.MESSAGE not in str(w.message):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return False


class Device:
    """The GPU runtime calls gpu_check makes, and no others (Note [One device interface]): CUDA and NCCL."""

    type = "cuda"
    backend = "nccl"
    dispatch_key = "CUDA"

    def is_available(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def describe(self) -> list[tuple[str, str]]:
        """(what, value) rows for the report's header: versions and the GPUs."""
        nccl = "unknown"
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - a version string must not stop the check
            pass
        gpus = []
        for i in range(self.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(f"{p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB)")
        counted = {g: gpus.count(g) for g in gpus}
        return [("torch", torch.__version__), ("CUDA (torch built with)", str(torch.version.cuda)),
                ("driver", _driver_version()), ("NCCL", nccl),
                ("GPUs", ", ".join(f"{n} x {g}" for g, n in counted.items()))]

    def set_device(self, rank: int) -> torch.device:
        """Makes GPU `rank` this process's current device and returns it."""
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated()

    def count_host_syncs(self):
        """A context manager whose .count is the host syncs torch reported inside it."""
        return _SyncDebug()

    def has_kernel(self, op: str) -> bool:
        """Whether op (e.g. "shardopt::unscale_into") has a kernel for this device's dispatch key."""
        return torch._C._dispatch_has_kernel_for_dispatch_key(op, self.dispatch_key)


class _SyncDebug(SyncCounter):
    """SyncCounter with torch's sync debug mode on ("warn") inside it."""

    def __enter__(self):
        self._mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        return super().__enter__()

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(self._mode)
        return super().__exit__(*exc)


def _driver_version() -> str:
    out = []
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if smi.returncode == 0 and smi.stdout.strip():
            out.append(smi.stdout.split()[0])
    except (OSError, subprocess.SubprocessError):
        pass
    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    if get is not None:
        try:
            v = int(get())
            out.append(f"supports CUDA {v // 1000}.{v % 1000 // 10}")
        except Exception:  # noqa: BLE001
            pass
    return ", ".join(out) or "unknown"


def no_gpu_line() -> str:
    cuda = f"built with CUDA {torch.version.cuda}, no GPU visible" if torch.version.cuda else "built without CUDA"
    return f"gpu-check: no CUDA device here (torch {torch.__version__}, {cuda}); nothing to check, exit 0"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """gpu_check's options (shared by `python -m shardopt.tools.gpu_check` and `shardopt gpu-check`)."""
    from shardopt.tools import gpu_training as tr

    p.add_argument("--out", default=DEFAULT_OUT, help=f"the report (markdown; default {DEFAULT_OUT})")
    p.add_argument("--world-sizes", type=_int_list, default=None,
                   help="comma-separated, e.g. 1,2,8 (default: 1 and 2..number of GPUs)")
    p.add_argument("--configs", type=_config_list, default=None,
                   help=f"comma-separated, of {','.join(c.key for c in tr.CONFIGS)} (default: all)")
    p.add_argument("--steps", type=int, default=None, help="parity steps per configuration (default 20)")
    p.add_argument("--time-steps", type=int, default=None, help="timed step pairs, DDP and shardopt (default 30)")
    p.add_argument("--model", default=None, choices=("tiny", "small", "30m"),
                   help="the demo GPT preset for time, memory and syncs (default small, ~4.3M parameters)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: small kernel sizes, 4 parity steps, 3 timed pairs, one step for memory and syncs, "
                        "the tiny model")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank, which offload's CPU Adam uses (default: CPU cores / world size)")
    p.add_argument("--timeout", type=int, default=1200, help="seconds for all configurations at one world size")


def _int_list(text: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, e.g. 1,2,4; got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"world sizes must be >= 1, got {text!r}")
    return out


def _config_list(text: str) -> list[str]:
    from shardopt.tools.gpu_training import CONFIGS

    keys = [v.strip() for v in text.split(",") if v.strip()]
    known = [c.key for c in CONFIGS]
    bad = [k for k in keys if k not in known]
    if bad or not keys:
        raise argparse.ArgumentTypeError(f"unknown configuration {', '.join(bad) or repr(text)}; "
                                         f"choose from {','.join(known)}")
    return keys


def world_sizes(device_count: int, requested: list[int] | None) -> list[int]:
    """1, then 2..device_count (one rank per GPU); or those asked for, each at most device_count."""
    if requested is None:
        return [1] + list(range(2, device_count + 1))
    too_big = [w for w in requested if w > device_count]
    if too_big:
        raise ValueError(f"--world-sizes {','.join(map(str, requested))}: this machine has {device_count} GPU(s), "
                         "one rank per GPU")
    return sorted(set(requested))


def run_options(args, world_size: int):
    """What every rank of one world size runs (gpu_training.RunOptions), from the command's arguments."""
    from shardopt.tools import gpu_training as tr

    quick = args.quick
    configs = tuple(c for c in tr.CONFIGS if args.configs is None or c.key in args.configs)
    return tr.RunOptions(configs=configs,
                         steps=args.steps or (4 if quick else 20),
                         time_steps=args.time_steps or (3 if quick else 30),
                         warmup=1 if quick else 5,
                         sync_steps=1 if quick else 3,
                         memory_steps=1 if quick else 3,
                         model=args.model or ("tiny" if quick else "small"),
                         threads=args.threads or max(1, (os.cpu_count() or 1) // world_size))


def _git_commit() -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=30)
        if head.returncode != 0:
            return "not a git checkout"
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return head.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run(args, device: Device | None = None, launch=None, log=print) -> int:
    """The whole check; returns the exit code (0: every check passed or there is no GPU; 1: a failure)."""
    import shardopt
    from shardopt.tools import gpu_kernels, gpu_report, gpu_training

    device = device or Device()
    if not device.is_available():
        log(no_gpu_line())
        return 0
    if launch is None:
        from shardopt.cluster.ranks import run_ranks as launch
    try:
        sizes = world_sizes(device.device_count(), args.world_sizes)
    except ValueError as e:  # asked for more ranks than GPUs: the message says so
        print(f"gpu-check: error: {e}", file=sys.stderr)
        return 2
    header = [("date", datetime.datetime.now().strftime("%Y-%m-%d %H:%M")),
              ("shardopt", f"{shardopt.__version__}, commit {_git_commit()}")] + device.describe()
    dev = device.set_device(0)
    log(f"gpu-check: kernels against their references on {dev}")
    kernels = gpu_kernels.check_kernels(device, dev, gpu_kernels.QUICK_SIZES if args.quick else gpu_kernels.SIZES)
    runs = {}
    for ws in sizes:
        opts = run_options(args, ws)
        log(f"gpu-check: world size {ws} ({device.backend}): {', '.join(c.key for c in opts.configs)}")
        try:
            runs[ws] = launch(gpu_training.rank_main, ws, device, opts, backend=device.backend,
                              timeout=args.timeout)
        except Exception as e:  # noqa: BLE001 - a crashed world size is reported, the next one still runs
            runs[ws] = f"{type(e).__name__}: {e}"
    text = gpu_report.write(header, device.backend, kernels, runs)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    failed = gpu_report.failures(kernels, runs)
    for line in failed[:20]:
        log(f"gpu-check: FAIL {line}")
    log(f"gpu-check: {'FAIL' if failed else 'PASS'}; report in {args.out}")
    return 1 if failed else 0


def main(argv: list[str] | None = None, device: Device | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardopt.tools.gpu_check", description=__doc__.split("Note [")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv), device)


if __name__ == "__main__":
    sys.exit(main())
