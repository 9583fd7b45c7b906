"""Checks that every rank built the same thing, at construction, before any collective can mismatch."""
from __future__ import annotations

import hashlib
from typing import Sequence

import torch.distributed as dist

from shardopt.layout import first_difference


def check_same_across_ranks(lines: Sequence[str], what: str, group) -> None:
    """Raises ValueError on every rank if any rank's `lines` differ from another's.

    Ranks first exchange a digest (cheap); only on a mismatch do they exchange
    the full lines, so the error names the first entry that differs.
    """
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
    # Global ranks, as the launcher and the logs number them (the group may be a mesh's slice).
    rank, ref = dist.get_global_rank(group, rank), dist.get_global_rank(group, ref)
    raise ValueError(
        f"shardopt: ranks disagree on the {what}: rank {rank} vs rank {ref}: {diff}. Every rank must "
        "build the same model (same parameters, order, shapes and dtypes) and the same optimizer "
        "configuration before wrapping it.")


def first_failure(error: BaseException | None, group) -> tuple[int, str] | None:
    """Every rank learns of every rank's error (a collective): raises `error` on its own rank; else returns
    (global rank, "Type: message") of the first rank that failed, or None. So no rank goes on into a
    collective that a failed peer will never join."""
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
