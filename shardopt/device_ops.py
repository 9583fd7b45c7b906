"""The few device operations shardopt uses only with a GPU, behind one small interface.

Note [Device operations behind an interface]
--------------------------------------------
Offload with a CUDA model is the only place shardopt calls a GPU runtime: pinned host buffers, the engine's
side-stream copies of gradients to the host (csrc/comm/host_copier.h), and the non-blocking copy of masters
into the model, waited for before the next step. Each call goes through a DeviceOps, so the decisions (what
to pin, which copy is non-blocking, when the host waits) run in CPU tests against a fake GPU that records
every call (tests/fake_device.py). An optimizer takes `current()` at construction; tests `use(fake)`.
"""
from __future__ import annotations

import contextlib

import torch


class DeviceOps:
    """The real operations: torch.cuda (each degrades to "no device" when CUDA is absent)."""

    def can_pin(self) -> bool:
        """Whether host memory can be pinned (needs a CUDA runtime)."""
        return torch.cuda.is_available()

    def pinned_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, pin_memory=True)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and self.can_pin() and t.is_pinned()

    def is_device_memory(self, t: torch.Tensor) -> bool:
        """Whether t lives on an accelerator (not host memory)."""
        return t.device.type == "cuda"

    def copy_device(self):
        """The bucket engine's CopyDevice (csrc/comm/copy_device.h); None: this build's default."""
        return None

    def mark(self, device: torch.device):
        """A mark after the work queued so far on `device`'s current stream."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def host_wait(self, mark) -> None:
        """Blocks the host until the device has passed `mark`."""
        mark.synchronize()


_current = DeviceOps()


def current() -> DeviceOps:
    return _current


@contextlib.contextmanager
def use(ops: DeviceOps):
    """Optimizers built inside the block use `ops` (tests: a fake device)."""
    global _current
    previous, _current = _current, ops
    try:
        yield ops
    finally:
        _current = previous


def materialization_device(device: torch.device) -> torch.device:
    """Where meta-device parameters get storage: the current accelerator, else the CPU (Note [Meta-device models])."""
    if device.type != "meta":
        return device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
