"""A step left open: its buckets stepped as the next forward gathers them, under that forward's compute.

    pending = PendingStep(state_tier.start_walk(order), step_bucket, phase)
    pending.through(b)     # every bucket up to b (in the walk's order) stepped; b's new chunk is in memory
    pending.finish()       # the rest stepped, every write done; pending.error: the first failure, if any

Note [The step walked in the next forward]
------------------------------------------
With the optimizer's state on disk a step is a walk over its records (Note [The ring's walk] in ring.py), and
reading and writing them is most of its time: a CPU Adam pass over a bucket takes a fraction of its record's
I/O. At stage 3 with the parameter shard on disk too, nothing needs a bucket's new values before a gather
reads its chunk, so step() steps the buckets gathered between passes (persistent ones) and leaves the walk
open, in the order the next forward gathers buckets: each hold of a chunk still to be stepped (a gather, a
read-ahead is skipped) first steps every bucket up to it (`through`). The walk's reads ahead and writes
behind then run while the forward computes, and a bucket's new chunk is in memory for its gather instead of
being written and read back. Each bucket is stepped with what step() saw: the gradients (clipped), the
inner optimizer's hyper-parameters (set at step()), which parameters got a gradient; so weights and state
are the same bit for bit as a step walked at once.
What reads or writes what the step changes finishes it first (`finish`): another walk of the state (a save,
a load, state_dict), the end of a forward and the start of a backward (it writes the gradients),
zero_grad(set_to_none=False), wait_params() (full_params, checkpoints, the next step()). An error while
stepping (the disk) is kept, not raised, since a rank raising inside a forward would leave its peers waiting
in a gather: the walk stops there, and the next step() raises it on every rank (disk.failed_anywhere).
"""
from __future__ import annotations

import time
from typing import Callable

import torch


class PendingStep:
    """The buckets of a step not yet stepped, walked through `walk` (a StateWalk) by `step_bucket(b)`."""

    def __init__(self, walk, step_bucket: Callable[[int], None], phase: dict, on_end: Callable[["PendingStep"], None]):
        self.walk, self.step_bucket, self.phase, self.on_end = walk, step_bucket, phase, on_end
        self.left = set(walk.order)  # buckets still to be stepped
        self.error: BaseException | None = None
        self.ended = False

    def pending(self, b: int) -> bool:
        """Whether bucket b's chunk and state still wait for this step."""
        return b in self.left

    def through(self, b: int) -> None:
        """Every bucket up to b in the walk's order stepped (b's too); errors kept (Note above)."""
        if b not in self.left:
            return
        t0 = time.perf_counter()
        try:
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                while b in self.left:
                    c = self.walk.next()
                    self.left.discard(c)  # before its step, which holds its chunk to write it
                    self.step_bucket(c)
                    self.walk.done()
        except Exception as e:  # noqa: BLE001 - raised at the next step() on every rank
            self._fail(e)
        finally:
            self.phase["step"] += time.perf_counter() - t0
        if not self.left:
            self.finish()

    def finish(self) -> None:
        """Every bucket stepped and every write done (or the walk stopped at an error, kept in `error`)."""
        if self.ended:
            return
        if self.left and self.error is None:
            self.through(self.walk.order[-1])
            return  # through() finishes
        self.ended = True
        t0 = time.perf_counter()
        try:
            if self.error is None:
                self.walk.close()
        except Exception as e:  # noqa: BLE001 - as above
            self.error = e
        finally:
            self.phase["step"] += time.perf_counter() - t0
            self.on_end(self)

    def _fail(self, e: BaseException) -> None:
        if self.error is None:
            self.error = e
        self.left.clear()
        self.walk.abandon()
