"""The parameter tier: this rank's chunk of every stage-3 bucket in a scratch file, a few in memory at a time.

    tier = ParamTier(config)
    chunks = tier.add(buckets, dtype)      # one tensor per bucket: empty unless held
    tier.read_ahead([b1, b2])              # reads started into free buffers
    tier.hold(b, read=True)                # chunks[b] holds its values until release
    tier.release(b, write=True)            # written back behind (what was held is kept while buffers last)

Note [The parameter shard on disk]
----------------------------------
With offload_param="nvme" a bucket's chunk reaches its gather, the step and a load through `hold` and
`release`; between them its tensor (the object the gatherer and the master step know) is empty. Each chunk
is one 4 KiB-padded record. Each gather reads the next `offload_buffer_count` buckets of the schedule ahead
(zero3/rounds.py); a released chunk stays in its buffer until the buffer is needed (least recently released
first), so a chunk the step wrote is still there for the persistent buckets' gather. Buffers: as many as are
held at once, or `offload_buffer_count`, whichever is more. A bucket's transfers never overlap (each waits for
the last). Gathers go through the process group: each rank's shard is on its own disk, not in /dev/shm.
"""
from __future__ import annotations

import collections
import logging
import time

import torch

from shardopt.tiers.disk import Request, ScratchFile, aligned_empty, round_up

logger = logging.getLogger("shardopt")


class _Held:
    """A chunk held in a buffer: by how many holds, and whether one of them changed it."""

    __slots__ = ("buf", "count", "dirty")

    def __init__(self, buf: torch.Tensor):
        self.buf, self.count, self.dirty = buf, 1, False


class ParamTier:
    """Stage 3's chunks in scratch files (one per add(): the trainable buckets, then each frozen dtype's)."""

    def __init__(self, config):
        self.config = config
        self.files: list[ScratchFile] = []
        self.records: list[tuple] = []  # per bucket: (file, offset, bytes, elements, dtype)
        self.chunks: list[torch.Tensor] = []
        self.slot_bytes = 0
        self.slots = 0  # buffers made (held, cached or free)
        self.free: list[torch.Tensor] = []
        self.held: dict[int, _Held] = {}
        self.cached: collections.OrderedDict = collections.OrderedDict()  # bucket -> buffer, oldest first
        self.ahead: set[int] = set()  # cached buckets read ahead and not held since
        self.pending: dict[int, Request] = {}  # bucket -> its transfer in flight
        self.exposed = 0.0  # seconds spent waiting for transfers
        self.producer = None  # a step left open, which writes chunks before they are read (tiers/pending_step.py)

    def add(self, buckets, dtype: torch.dtype) -> list[torch.Tensor]:
        """Records for `buckets` (their chunks' sizes) in a file of their own; returns their chunk tensors."""
        sizes = [round_up(b.chunk_numel * dtype.itemsize) for b in buckets]
        f = ScratchFile(self.config.nvme_path, "parameters", sum(sizes), self.config.aio)
        self.files.append(f)
        at, out = 0, []
        for b, nbytes in zip(buckets, sizes):
            self.records.append((f, at, nbytes, b.chunk_numel, dtype))
            at += nbytes
            out.append(torch.empty(0, dtype=dtype))
        self.chunks += out
        if max(sizes, default=0) > self.slot_bytes:  # buffers of the old size go as they come free
            self.slot_bytes = max(sizes)
            self.slots -= len(self.free)
            self.free.clear()
        return out

    # ------------------------------------------------------------ holding
    def hold(self, b: int, read: bool = True) -> torch.Tensor:
        """Bucket b's chunk in memory (its values read unless read=False) until the matching release."""
        if self.producer is not None and self.producer.pending(b):
            self.producer.through(b)  # its new values, in a buffer already (Note [The step walked in the next forward])
        if b in self.held:
            self.held[b].count += 1
            return self.chunks[b]
        buf = self.cached.pop(b, None)
        self.ahead.discard(b)
        if buf is None:
            buf = self._buffer()
            if read:
                self._start(b, buf, write=False)
        self._wait(b)
        self.held[b] = _Held(buf)
        self.chunks[b].set_(buf.untyped_storage(), 0, (self.records[b][3],))
        return self.chunks[b]

    def release(self, b: int, write: bool = False) -> None:
        """One hold of bucket b ends; write: its chunk changed, and is written back behind."""
        held = self.held[b]
        held.count -= 1
        held.dirty |= write
        if held.count:
            return
        del self.held[b]
        self.chunks[b].set_(torch.empty(0, dtype=self.chunks[b].dtype))
        if held.dirty:
            self._start(b, held.buf, write=True)
        self.cached[b] = held.buf

    def read_ahead(self, buckets) -> None:
        """Starts reading these buckets' chunks into buffers that are free or hold a chunk already used (never
        into one read ahead and not yet used)."""
        for b in buckets:
            if b in self.held or b in self.cached or self.producer is not None and self.producer.pending(b):
                continue
            if not self.free and self.slots >= self.config.offload_buffer_count \
                    and all(c in self.ahead for c in self.cached):
                return
            buf = self._buffer(ahead=True)
            self._start(b, buf, write=False)
            self.cached[b] = buf
            self.ahead.add(b)

    def settle(self) -> None:
        """A step left open finished: every chunk holds its new values (Note [The step walked in the next forward])."""
        if self.producer is not None:
            self.producer.finish()

    def written(self) -> None:
        """Returns once every write started has reached the file (raises if one failed)."""
        for b in list(self.pending):
            self._wait(b)

    # ------------------------------------------------------------ buffers
    def _buffer(self, ahead: bool = False) -> torch.Tensor:
        """A free buffer, or the least recently released one (for a read ahead: one not itself read ahead)."""
        if self.free:
            return self.free.pop()
        victims = [c for c in self.cached if not (ahead and c in self.ahead)]
        if victims and self.slots >= self.config.offload_buffer_count:
            b = victims[0]
            buf = self.cached.pop(b)
            self.ahead.discard(b)
            self._wait(b)
            if buf.numel() == self.slot_bytes:
                return buf
            self.slots -= 1
        self.slots += 1
        return aligned_empty(self.slot_bytes, torch.uint8)

    def _start(self, b: int, buf: torch.Tensor, write: bool) -> None:
        f, at, nbytes, _, _ = self.records[b]
        self._wait(b)
        self.pending[b] = (f.start_write if write else f.start_read)(at, buf[:nbytes])

    def _wait(self, b: int) -> None:
        request = self.pending.pop(b, None)
        if request is None:
            return
        t0 = time.perf_counter()
        try:
            request.wait()
        finally:
            self.exposed += time.perf_counter() - t0

    # ------------------------------------------------------------ questions
    def buffer_bytes(self) -> int:
        return self.slots * self.slot_bytes

    def disk_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)


_said_cpu = False


def open_param_tier(config, device: torch.device, world_size: int) -> ParamTier | None:
    """Stage 3's parameter tier as offload_param says, or None where the shard stays where it is."""
    global _said_cpu
    if config.offload_param == "none":
        return None
    if device.type != "cpu":
        raise NotImplementedError(f"offload_param={config.offload_param!r} with a model on {device} is not built: "
                                  f"the shard would have to reach the device ahead of each gather; use "
                                  f"offload='cpu' or 'nvme' for the optimizer's state")
    if config.offload_param == "cpu":
        if not _said_cpu:
            logger.warning("shardopt: offload_param='cpu' with a model on the CPU: the parameter shard already "
                           "lives in host memory, so nothing moves")
            _said_cpu = True
        return None
    if world_size == 1:
        raise NotImplementedError("offload_param='nvme' with one rank in the shard group is not built: its "
                                  "buckets are its chunks, gathered by pointing at them (Note [One rank holds the "
                                  "whole bucket] in zero3/buckets.py); shard over several ranks")
    return ParamTier(config)
