"""Checks that every rank built the same thing, at construction, before any collective can mismatch; what every
rank learns of every rank's failure; a decision rank 0 takes for every rank.

Note [A peer lost after rank 0 decided]
---------------------------------------
A save's commit is rank 0's: every rank hands it its part (`exchange`), rank 0 renames the partial folder into
place, and the others learn the outcome from its broadcast. A peer that dies after handing over its part but
before that broadcast does not undo the commit, so rank 0 returns what it committed and warns, naming the lost
peer (a peer on its host whose pid is gone, else "a peer" and the process group's error). A rank that loses
rank 0 there cannot know whether the rename happened, and says so.
"""
from __future__ import annotations

import hashlib
import os
import socket
import time
import warnings
from typing import Sequence

import torch.distributed as dist

from shardopt.layout import first_difference
from shardopt.parallel.shm_barrier import pid_alive

LOST_WAIT_S = 1.0  # how long a rank that lost a peer looks for its exit before it says "a peer"


def check_same_across_ranks(lines: Sequence[str], what: str, group) -> None:
    """Raises ValueError on every rank, naming the first entry that differs, if any rank's `lines` differ (a
    digest first; the lines only on a mismatch)."""
    ws = dist.get_world_size(group)
    if ws == 1:
        return
    lines = list(lines)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    digests: list = [None] * ws
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) == 1:
        return
    everyone: list = [None] * ws
    dist.all_gather_object(everyone, lines, group=group)
    rank = dist.get_rank(group)
    ref = 0 if digests[rank] != digests[0] else next(r for r, d in enumerate(digests) if d != digests[0])
    diff = first_difference(lines, everyone[ref])
    rank, ref = dist.get_global_rank(group, rank), dist.get_global_rank(group, ref)  # as the logs number them
    raise ValueError(
        f"shardopt: ranks disagree on the {what}: rank {rank} vs rank {ref}: {diff}. Every rank must "
        "build the same model (same parameters, order, shapes and dtypes) and the same optimizer "
        "configuration before wrapping it.")


def first_failure(error: BaseException | None, group) -> tuple[int, str] | None:
    """Every rank learns of every rank's error (a collective), so none goes on into a collective a failed peer
    will not join: raises `error` here; else returns (global rank, "Type: message") of the first failure, or None."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    everyone = [mine]
    if group is not None and dist.get_world_size(group) > 1:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    if error is not None:
        raise error
    failed = next(((r, m) for r, m in enumerate(everyone) if m is not None), None)
    if failed is not None and group is not None:
        failed = (dist.get_global_rank(group, failed[0]), failed[1])
    return failed


def whoami() -> tuple[str, int]:
    """(host, pid): how a peer's death is told on its host (Note [A peer lost after rank 0 decided])."""
    return socket.gethostname(), os.getpid()


def lost(group, peers: list, otherwise: str | None = "a peer") -> str | None:
    """Which peers of this rank are gone, as far as this host can tell (`otherwise` if none is); peers[r]: rank r's
    whoami()."""
    here, me = whoami()
    deadline = time.monotonic() + LOST_WAIT_S
    while True:  # a killed peer's sockets close before its pid says it exited
        gone = [dist.get_global_rank(group, r) for r, (host, pid) in enumerate(peers)
                if host == here and pid != me and not pid_alive(pid)]
        if gone or time.monotonic() > deadline:
            return f"rank(s) {gone} (exited)" if gone else otherwise
        time.sleep(0.02)


def exchange(group, mine: dict, fn, what: str, error_type: type = RuntimeError):
    """Every rank's `mine` to rank 0 of `group`, which returns fn(everyone); every rank returns that value or
    raises fn's error as `error_type`. A peer lost after fn returned: Note [A peer lost after rank 0 decided]."""
    world, rank = (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)
    mine = dict(mine, peer=whoami())
    everyone = [mine]
    if world > 1:
        everyone = [None] * world if rank == 0 else None
        dist.gather_object(mine, everyone, group=group, group_dst=0)
    out = [None]
    if rank == 0:
        try:
            out = [("ok", fn(everyone))]
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            out = [("error", f"{type(e).__name__}: {e}")]
    if world > 1:
        try:
            dist.broadcast_object_list(out, group=group, group_src=0)
        except Exception as e:  # noqa: BLE001 - Note [A peer lost after rank 0 decided]
            if rank == 0 and out[0][0] == "ok":
                peers = lost(group, [m["peer"] for m in everyone])
                warnings.warn(f"{what} is complete; {peers} was lost after the commit: "
                              f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)
                return out[0][1]
            if rank != 0:
                raise error_type(f"rank 0 was lost while it committed {what}, which may or may not be complete: "
                                 f"{type(e).__name__}: {e}") from e
            raise
    status, value = out[0]
    if status == "error":
        raise error_type(f"rank 0: {value}")
    return value
