"""Publishing parameters after a step: master chunks into the model's chunks, then (stages 1-2) every
rank's chunks all-gathered into the flat buffer, now or during the next forward (Note [Gathering in the
next forward] in prefetch.py). At stage 3 the next forward gathers what it uses (sharded_param.py); only
the persistent buckets are refreshed here."""
from __future__ import annotations

import time

import torch

from shardopt.master_step import MasterStep


class Publisher:
    """Puts every rank's updated chunks into the model and knows what is still in flight.

    Two things can be: all-gathers started by `publish(defer=True)`, and the
    device's copy of master chunks into the model (offload to pinned memory,
    Note [Device operations behind an interface] in device_ops.py), which must
    be done before the master chunks are written again.
    """

    def __init__(self, master: MasterStep, flat_param: torch.Tensor | None, ops, device, phase: dict,
                 param_shard=None):
        self.master = master
        self.param_shard = param_shard  # stage 3
        self.flat_param = flat_param
        self.ops = ops
        self.device = device
        self.phase = phase  # the optimizer's cumulative seconds per phase
        self.engine = None  # set once ShardedDDP built it
        # One host: the gathers copy out of the other ranks' shared buffers instead (Note [Gathering through
        # shared memory] in parallel/shared_flat.py); None: the bucket engine's collectives.
        self.shared_gather = None
        self.gather_pending = False
        self.copy_back_mark = None

    def publish(self, copy_master: bool = True, defer: bool = False) -> None:
        """A collective: every rank calls it. copy_master=False when the step's kernel already wrote the
        model's copy (Note [Master weights]); defer=True only starts the gathers."""
        t0 = time.perf_counter()
        if copy_master and self.master.copy_to_model(self.ops):
            self.copy_back_mark = self.ops.mark(self.device)  # wait() waits for it
        t1 = time.perf_counter()
        if self.param_shard is not None:
            self.param_shard.refresh_persistent()
            self.phase["publish"] += t1 - t0
            return
        self.gatherer.start_all_gather_params(self.flat_param)
        self.gather_pending = self.gatherer.num_pending_gathers > 0
        self.phase["publish"] += t1 - t0
        self.phase["gather"] += time.perf_counter() - t1
        if not defer:
            self.wait_gathers()
            self.wait_readers()  # step() returns once no rank reads this one's chunks

    @property
    def gatherer(self):
        """Who gathers parameters after a step: the shared buffers on one host, else the bucket engine."""
        return self.shared_gather if self.shared_gather is not None else self.engine

    def wait_readers(self) -> None:
        if self.shared_gather is not None:
            t0 = time.perf_counter()
            self.shared_gather.wait_readers()
            self.phase["gather"] += time.perf_counter() - t0

    def wait(self) -> None:
        """Returns once every parameter holds the last step's value and the master chunks may be written."""
        self.wait_gathers()
        self.wait_readers()
        if self.copy_back_mark is not None:
            self.ops.host_wait(self.copy_back_mark)
            self.copy_back_mark = None

    def wait_gathers(self) -> None:
        if self.gather_pending:
            t0 = time.perf_counter()
            self.gatherer.finish_all_gather_params()
            self.gather_pending = False
            self.phase["gather"] += time.perf_counter() - t0

    def wait_buckets(self, buckets) -> None:
        """A module's forward pre-hook: waits for the buckets holding its parameters."""
        if self.gather_pending:
            t0 = time.perf_counter()
            for b in buckets:
                self.gatherer.finish_all_gather(b)
            self.gather_pending = self.gatherer.num_pending_gathers > 0
            self.phase["gather"] += time.perf_counter() - t0
