"""Publishing parameters after a step: master chunks into the model's, then the parameter store gathers every
rank's (Note [One parameter store] in param_store.py)."""
from __future__ import annotations

import time

from shardopt.master_step import MasterStep


class Publisher:
    """Puts every rank's updated chunks into the model; knows what is in flight (gathers, the masters' copy)."""

    def __init__(self, master: MasterStep, store, ops, device, phase: dict):
        self.master = master
        self.store = store
        self.ops = ops
        self.device = device
        self.phase = phase  # the optimizer's cumulative seconds per phase
        self.copy_back_mark = None

    def publish(self, copy_master: bool = True, defer: bool = False) -> None:
        """A collective. copy_master=False: the step's kernel wrote the model's copy; defer=True: only start gathers."""
        t0 = time.perf_counter()
        if copy_master and self.master.copy_to_model(self.ops):
            self.copy_back_mark = self.ops.mark(self.device)  # wait() waits for it
        self.phase["publish"] += time.perf_counter() - t0
        self.store.publish(defer)

    def wait(self) -> None:
        """Returns once every parameter holds the last step's value and the master chunks may be written."""
        self.master.settle()  # Note [The step walked in the next forward] in tiers/pending_step.py
        self.store.wait()
        if self.copy_back_mark is not None:
            self.ops.host_wait(self.copy_back_mark)
            self.copy_back_mark = None

    def wait_buckets(self, buckets) -> None:
        """A module's forward pre-hook: waits for the buckets holding its parameters."""
        self.store.wait_buckets(buckets)
