"""A ring of aligned host buffers that walks a scratch file's records: read ahead, used, written behind.

    for item, slot in ring.walk(file, items, span):   # span(item) -> (offset, bytes to read, bytes to write)
        ...                                           # slot: the item's record; written back after
    w = ring.start(file, items, span)                 # the same walk a step at a time (a walk left open)
    item, slot = w.next(); ...; w.done(); ...; w.close()

Note [The ring's walk]
----------------------
Item i uses slot i % count. While it is in use the next count - 2 items are being read and item i - 1 written:
a slot is read into only once its last write is done, so a walk holds `count` records however many it visits
(count 2 still overlaps a write with the next item). `done` starts the item's write and the next reads and
returns without waiting for either, so a walk left open between items (Note [The step walked in the next
forward] in pending_step.py) keeps the disk busy while its caller computes. Waits are the exposed I/O time
(`exposed`). An abandoned walk (its user raised) writes nothing more; its transfers are waited for before a
slot is used again.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable

import torch

from shardopt.tiers.disk import Request, ScratchFile, aligned_empty


class Ring:
    """`count` page-aligned buffers of `slot_bytes` each (Note [The ring's walk])."""

    def __init__(self, slot_bytes: int, count: int):
        self.slots = [aligned_empty(max(slot_bytes, 1), torch.uint8) for _ in range(count)]
        self.slot_bytes = slot_bytes
        self.exposed = 0.0  # seconds spent waiting for transfers
        self._live: dict[Request, int] = {}  # transfers started and not yet waited for -> their walk
        self._walks = 0

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * len(self.slots)

    def start(self, file: ScratchFile, items: Iterable, span: Callable) -> "RingWalk":
        """A walk over `items` (Note [The ring's walk]); an earlier walk's transfers are waited for first."""
        self._drain(lambda walk: True)
        self._walks += 1
        return RingWalk(self, self._walks, file, list(items), span)

    def walk(self, file: ScratchFile, items: Iterable, span: Callable):
        """Yields (item, slot) for each item in turn, its first read bytes read (Note [The ring's walk])."""
        return walked(lambda: self.start(file, items, span))

    def _start(self, walk: int, start, offset: int, slot: torch.Tensor, nbytes: int) -> Request | None:
        if not nbytes:
            return None
        request = start(offset, slot[:nbytes])
        self._live[request] = walk
        return request

    def _wait(self, request: Request | None) -> None:
        if request is None:
            return
        self._live.pop(request, None)
        t0 = time.perf_counter()
        try:
            request.wait()
        finally:
            self.exposed += time.perf_counter() - t0

    def _drain(self, whose: Callable) -> None:
        """Waits for the transfers of walks that `whose` names; their errors went with those walks' own."""
        for r in [r for r, walk in self._live.items() if whose(walk)]:
            del self._live[r]
            try:
                r.wait()
            except Exception:  # noqa: BLE001 - the walk that started it raised already
                pass


def walked(start: Callable):
    """Yields what next() gives for each item of the walk start() makes (when the iteration begins), done() once
    the caller's loop body is through with it, close() at the end, abandon() however the iteration ends."""
    w = start()
    try:
        for _ in range(len(w)):
            yield w.next()
            w.done()
        w.close()
    finally:
        w.abandon()


class RingWalk:
    """One walk of a Ring: next() gives the next item and its slot, done() writes it behind, close() waits."""

    def __init__(self, ring: Ring, me: int, file: ScratchFile, items: list, span: Callable):
        self.ring, self.me, self.file, self.items, self.span = ring, me, file, items, span
        self.count = len(ring.slots)
        self.ahead = max(self.count - 2, 0)
        self.reads: dict[int, Request | None] = {}
        self.writes: list[Request | None] = [None] * self.count
        self.issued = 0  # items whose read was started
        self.at = 0      # the item next() gives next

    def __len__(self) -> int:
        return len(self.items)

    def next(self):
        """(the next item, its slot), its read bytes read."""
        i = self.at
        self._issue(i + self.ahead)
        self.ring._wait(self.reads.pop(i))
        return self.items[i], self.ring.slots[i % self.count]

    def done(self) -> None:
        """The item next() gave is written behind; the reads ahead are started. Waits for nothing new."""
        i = self.at
        offset, _, nwrite = self.span(self.items[i])
        self.writes[i % self.count] = self.ring._start(self.me, self.file.start_write, offset,
                                                        self.ring.slots[i % self.count], nwrite)
        self.at += 1
        self._issue(self.at + self.ahead)

    def close(self) -> None:
        """Returns once every write of the walk is done (raises if one failed)."""
        for s in range(self.count):
            self.ring._wait(self.writes[s])
            self.writes[s] = None
        self.abandon()

    def abandon(self) -> None:
        """The walk ends here: its transfers still in flight are waited for (their errors ignored)."""
        self.ring._drain(lambda walk: walk == self.me)

    def _issue(self, upto: int) -> None:
        while self.issued <= min(upto, len(self.items) - 1):
            s = self.issued % self.count
            self.ring._wait(self.writes[s])
            self.writes[s] = None
            offset, nread, _ = self.span(self.items[self.issued])
            self.reads[self.issued] = self.ring._start(self.me, self.file.start_read, offset, self.ring.slots[s],
                                                       nread)
            self.issued += 1
