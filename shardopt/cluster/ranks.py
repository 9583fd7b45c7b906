"""Runs a function on N real ranks: fresh processes joined by a gloo group over 127.0.0.1 (tests, benchmarks),
or by NCCL (gpu_check, one process per GPU).

Each call gets its own FileStore in a temp dir, so parallel tests never share a
port or a rendezvous; gloo itself binds ephemeral ports on loopback. Every
collective has the group's timeout, and the parent kills every rank if the
whole run exceeds `timeout`, so a broken test fails with the rank's traceback
instead of hanging.
"""
import datetime
import io
import multiprocessing as mp
import os
import queue
import tempfile
import traceback

import torch

# Spawned ranks re-import the test module; keep them single-threaded so 4 ranks
# on 2 cores do not fight over torch's intra-op pool.
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
            # Note [Every rank connected before any leaves]: gloo connects the group's ranks pairwise inside
            # init_process_group, and a rank can return from it while a peer is still connecting; a rank whose fn
            # then returns at once (or kills itself, as the peer-loss tests do) closes its sockets under that peer,
            # which fails in init_process_group ("Connection closed by peer": CI, 2026-11-29), not in what the test
            # checks. So no rank starts fn before every rank is connected (a barrier with a generous timeout:
            # forked ranks of a loaded machine start seconds apart). NCCL connects lazily, and its ranks pick
            # their GPU in fn, before their first collective.
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=max(collective_timeout, 60)),
                                   wait_all_ranks=True)
        out = fn(rank, world_size, *args, **kwargs)
        # torch.save copies tensor data into the bytes; a tensor put on the
        # queue as is would be shared through a file descriptor that dies with
        # this process.
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
# A spawned rank is a new interpreter that imports torch and shardopt before it
# runs anything: about 4 s for 4 ranks on this 2-core VM, paid by each of the
# test suite's hundreds of launches. start_method="forkserver" (the tests' choice,
# tests/dist_harness.py) forks each rank from a server process that imported
# them once (multiprocessing's forkserver with a preload): 0.1 s for the same 4
# ranks. The server is a fresh process too, started from nothing of the caller's
# but its sys.path, so no torch state of the caller leaks in either way; it is
# started once, so each rank is given the caller's environment of the moment
# (a forkserver child would otherwise have the server's). NCCL ranks are always
# spawned: nothing CUDA may be inherited through a fork.
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

    backend: the process group's ("nccl": fn selects its GPU before its first collective).
    start_method: "spawn" (a new interpreter per rank) or "forkserver" (forked from a process that
    imported torch and shardopt once: Note [Ranks from a forkserver]).

    fn must be a module-level function (ranks start in fresh processes, so torch
    state from the calling process never leaks in). Raises RankFailure with every
    failing rank's traceback, or after `timeout` seconds naming the ranks that
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
                    # One rank failed: the rest would wait for it in a collective
                    # until their timeout. Give them a moment to report, then stop.
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
