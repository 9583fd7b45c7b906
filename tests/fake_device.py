"""A fake GPU for CPU tests: DeviceOps that answer as a machine with CUDA would, and record every call.

Note [Device operations behind an interface] in shardopt/device_ops.py says
why. Layout it models: a CUDA model with offload="cpu". Buffers it allocated
as pinned are host memory; every other tensor counts as device memory. The
bucket engine gets a FakeCopyDevice (csrc/comm/fake_copy_device.h), which
performs each host copy only when a real device would be known to have done
it, so a missing wait shows up as wrong numbers.
"""
import torch

from shardopt import _ext
from shardopt.device_ops import DeviceOps


class FakeDeviceOps(DeviceOps):
    def __init__(self, can_pin: bool = True):
        self._can_pin = can_pin
        self._pinned = set()           # storage addresses of the "pinned" buffers
        self.calls: list[str] = []     # "pin N", "mark", "host_wait", in call order (tests may append)
        self.engine_device = _ext._C.FakeCopyDevice(pinned=can_pin)

    def can_pin(self) -> bool:
        return self._can_pin

    def pinned_zeros(self, numel, dtype):
        t = torch.zeros(numel, dtype=dtype)
        self._pinned.add(t.untyped_storage().data_ptr())
        self.calls.append(f"pin {numel}")
        return t

    def is_pinned(self, t) -> bool:
        return t.device.type == "cpu" and t.untyped_storage().data_ptr() in self._pinned

    def is_device_memory(self, t) -> bool:
        return not self.is_pinned(t)

    def copy_device(self):
        return self.engine_device

    def mark(self, device):
        self.calls.append("mark")
        return len(self.calls)

    def host_wait(self, mark) -> None:
        self.calls.append("host_wait")
