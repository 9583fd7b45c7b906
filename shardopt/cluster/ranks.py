"""Runs a function on N real ranks: fresh processes joined by a gloo group over 127.0.0.1 (tests, benchmarks),
or by NCCL (gpu_check, one process per GPU).

Each call has its own FileStore, so parallel tests share no rendezvous; collectives time out, and the
parent kills every rank past `timeout`: a broken test fails with a traceback instead of hanging.
"""
import datetime
import io
import multiprocessing as mp
import os
import queue
import tempfile
import traceback

import torch

# Single-threaded ranks: 4 of them on 2 cores must not fight over torch's intra-op pool.
_RANK_THREADS = 1


def _rank_main(fn, rank, world_size, store_path, collective_timeout, results, args, kwargs, backend="gloo",
               env=None):
    if env is not None:  # a forkserver's child has the server's environment, not the caller's
        os.environ.clear()
        os.environ.update(env)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    torch.set_num_threads(_RANK_THREADS)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        if backend == "gloo":
            # Note [Every rank connected before any leaves]: a rank can leave init_process_group while a peer
            # is still connecting; if its fn returns (or kills itself) at once, the peer fails there
            # ("Connection closed by peer"). So fn starts after a barrier. NCCL connects lazily.
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=max(collective_timeout, 60)),
                                   wait_all_ranks=True)
        out = fn(rank, world_size, *args, **kwargs)
        # As bytes: a tensor on the queue would be shared through a file descriptor that dies with this process.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - already failing; the traceback above matters
                pass


class RankFailure(AssertionError):
    pass


# Note [Ranks from a forkserver]
# A spawned rank imports torch and shardopt first: 4 s for 4 ranks on 2 cores, at each of the tests'
# hundreds of launches. "forkserver" forks them from a fresh server that imported both once (0.1 s) and
# hands each the caller's environment of the moment. NCCL ranks are always spawned: CUDA must not cross a fork.
_PRELOAD = ["torch", "torch.distributed", "shardopt", "shardopt.cluster.ranks"]


def _context(start_method: str, backend: str):
    if start_method == "spawn" or backend == "nccl":
        return mp.get_context("spawn")
    if start_method != "forkserver":
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first launch)
    return ctx


def run_ranks(fn, world_size, *args, timeout=240, collective_timeout=60, backend="gloo", start_method="spawn",
              **kwargs):
    """Runs fn(rank, world_size, *args, **kwargs) on `world_size` ranks; returns [result of rank r].

    fn: a module-level function. backend: "gloo" or "nccl" (fn selects its GPU before its first
    collective). start_method: "spawn" or "forkserver" (Note [Ranks from a forkserver]). Raises
    RankFailure with every failing rank's traceback, or after `timeout` seconds naming the ranks that
    never finished.
    """
    ctx = _context(start_method, backend)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="shardopt-store-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main,
                             args=(fn, r, world_size, store_path, collective_timeout, results, args, kwargs, backend,
                                   dict(os.environ)),
                             daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        out, errors = {}, {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        try:
            while len(out) + len(errors) < world_size:
                left = (deadline - datetime.datetime.now()).total_seconds()
                if left <= 0:
                    missing = sorted(set(range(world_size)) - set(out) - set(errors))
                    raise RankFailure(f"ranks {missing} did not finish within {timeout}s"
                                      + _format(errors))
                try:
                    rank, ok, value = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs)
                            if not p.is_alive() and r not in out and r not in errors and p.exitcode != 0]
                    for r in dead:
                        errors[r] = f"rank {r} died with exit code {procs[r].exitcode}"
                    continue
                if ok:
                    out[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    errors[rank] = value
                if errors and len(out) + len(errors) < world_size:
                    # The others would wait for it until their timeout: a moment to report, then stop.
                    deadline = min(deadline, datetime.datetime.now() + datetime.timedelta(seconds=15))
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors:
            raise RankFailure(_format(errors))
        return [out[r] for r in range(world_size)]


def _format(errors):
    return "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
