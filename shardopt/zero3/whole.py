"""Whole weights at stage 3, between passes: every bucket gathered at once (`gathered`: full_params,
state_dict), bucket by bucket (`stream`: save_weights, the Hugging Face layout), or copied out for good
(`whole_copies`: ShardedDDP.detach), and the persistent buckets refreshed after a step.

Each is a collective every rank enters, and a read phase of its own (Note [Gathering through shared memory]
in parallel/shared_memory.py): it starts after a barrier and ends with an arrival.
"""
from __future__ import annotations

import contextlib

import torch

from shardopt.zero3.buckets import FREE, GATHERING, Buckets


@contextlib.contextmanager
def gathered(buckets: Buckets, in_pass: bool, writeback: bool = True):
    """Every bucket gathered; on exit this rank's chunk takes what the full parameters hold (writeback) and
    the buckets gathered for it are freed."""
    if in_pass:
        raise RuntimeError("full_params() inside a forward or backward pass: use it between steps")
    bk = buckets
    # Written into, so copies: the mapped buckets take their private storage back for it, and their mappings
    # after (Note [Stage-3 buckets mapped, not copied] in parallel/shared_memory.py).
    shown = [b for b in bk.mapped() if bk.state[b] != FREE]
    for b in shown:
        bk.reshard(b)
    for b in bk.mapped():
        bk.unmap(b)
    was_free = [b for b, s in enumerate(bk.state) if s == FREE]
    bk.sync()  # after the peers' writes
    for b in was_free:
        bk.start_gather(b, exact=True)  # the shard's own values (Note [Stage 3's parameters across nodes, rounded])
    for b in was_free:
        bk.finish_gather(b)
    # One rank alone writes into its chunks themselves (Note [One rank holds the whole bucket] in buckets.py):
    # without writeback they take back what they held, as a gathered copy would have been dropped.
    before = [c.clone() for c in bk.every_chunk] if bk.aliased and not writeback else None
    try:
        yield
    finally:
        if writeback:
            bk.sync()  # every peer has read this rank's chunk before it is written
            bk.take_chunks()
        elif before is not None:
            with torch.no_grad():
                for c, v in zip(bk.every_chunk, before):
                    c.copy_(v)
        for b in was_free:
            bk.reshard(b)
        bk.install_maps()
        for b in shown:
            bk.allocate(b)
        if not writeback:
            bk.end_reads()


def stream(buckets: Buckets, in_pass: bool, indices):
    """Members `indices` whole, (index, value) one after the other, gathered bucket by bucket (each value a
    copy); a collective every rank iterates to its end."""
    bk = buckets
    by_bucket: dict = {}
    for i in indices:
        if bk.layout.params[i].numel:
            by_bucket.setdefault(bk.buckets_of_param[i][0], []).append(i)
        else:
            yield i, bk.views[i]
    if by_bucket and in_pass:
        raise RuntimeError("weights streamed inside a forward or backward pass: do it between steps")
    if by_bucket:
        bk.sync()  # after the peers' writes
    try:
        for b in sorted(by_bucket):
            was_free = bk.state[b] == FREE
            if was_free:
                bk.start_gather(b, exact=True)
            if bk.state[b] == GATHERING:
                bk.finish_gather(b)
            try:
                for i in by_bucket[b]:
                    # A copy: a consumer that hands the bytes to numpy (a file writer) pins their storage, and
                    # the bucket's must be freed again.
                    yield i, bk.views[i].clone()
            finally:
                if was_free:
                    bk.reshard(b)
    finally:
        if by_bucket:
            bk.end_reads()


def whole_copies(buckets: Buckets, in_pass: bool, trainable: int) -> list:
    """Every member whole in a tensor of its own; the frozen ones keep theirs (ShardedDDP.detach sets the
    trainable ones)."""
    with gathered(buckets, in_pass, writeback=False), torch.no_grad():
        copies = [p.detach().clone() for p in buckets.members]
    for p, value in zip(buckets.members[trainable:], copies[trainable:]):
        p.data = value
    return copies[:trainable]


def refresh_persistent(buckets: Buckets, upto: int) -> None:
    """The persistent buckets among the first `upto` take every rank's updated chunk (after a step: as stage 2
    publishes; the frozen ones only after a load, as a step does not change them)."""
    keep = [b.index for b in buckets.layout.buckets[:upto] if b.persistent]
    if not keep:
        return
    buckets.sync()  # after every rank wrote its chunks
    buckets.gather_persistent(keep)
    buckets.end_reads()
