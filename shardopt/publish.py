"""Publishing parameters after a step: master chunks into the model's chunks, then the parameter store
puts every rank's chunks into the model (Note [One parameter store] in param_store.py): stages 1-2
all-gather them into the flat buffer, now or during the next forward (Note [Gathering in the next
forward] in prefetch.py); at stage 3 the next forward gathers what it uses and only the persistent
buckets are refreshed here."""
from __future__ import annotations

import time

from shardopt.master_step import MasterStep


class Publisher:
    """Puts every rank's updated chunks into the model and knows what is still in flight.

    Two things can be: the store's gathers (started by `publish(defer=True)`), and
    the device's copy of master chunks into the model (offload to pinned memory,
    Note [Device operations behind an interface] in device_ops.py), which must
    be done before the master chunks are written again.
    """

    def __init__(self, master: MasterStep, store, ops, device, phase: dict):
        self.master = master
        self.store = store
        self.ops = ops
        self.device = device
        self.phase = phase  # the optimizer's cumulative seconds per phase
        self.copy_back_mark = None

    def publish(self, copy_master: bool = True, defer: bool = False) -> None:
        """A collective: every rank calls it. copy_master=False when the step's kernel already wrote the
        model's copy (Note [Master weights]); defer=True only starts the gathers."""
        t0 = time.perf_counter()
        if copy_master and self.master.copy_to_model(self.ops):
            self.copy_back_mark = self.ops.mark(self.device)  # wait() waits for it
        self.phase["publish"] += time.perf_counter() - t0
        self.store.publish(defer)

    def wait(self) -> None:
        """Returns once every parameter holds the last step's value and the master chunks may be written."""
        self.store.wait()
        if self.copy_back_mark is not None:
            self.ops.host_wait(self.copy_back_mark)
            self.copy_back_mark = None

    def wait_buckets(self, buckets) -> None:
        """A module's forward pre-hook: waits for the buckets holding its parameters."""
        self.store.wait_buckets(buckets)
