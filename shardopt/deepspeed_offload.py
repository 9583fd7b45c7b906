"""DeepSpeed's offload keys -> ShardedOptimizer's tiers (part of deepspeed_config.py's translation).

Note [DeepSpeed's offload keys]
-------------------------------
zero_optimization.offload_optimizer.device "cpu" | "nvme" is `offload` (masters, gradient shard and optimizer
state on the host, or on disk between steps: Note [Tiers] in tiers/__init__.py); at stage 3
offload_param.device "cpu" | "nvme" is `offload_param` (below stage 3 DeepSpeed ignores it, and so does this).
Both blocks' nvme_path is one `nvme_path` (two different ones are refused), their buffer_count one
`offload_buffer_count` (the larger), their pin_memory one `pin_memory`. The top-level "aio" block's block_size,
queue_depth and thread_count (intra_op_parallelism in DeepSpeed 0.19) are `aio`'s. Accepted without effect,
each for a reason: pipeline_read / pipeline_write (the step always reads ahead and writes behind),
fast_init (the scratch files are made empty), buffer_size (a buffer holds one bucket's chunk: reduce_bucket_size
sets it), max_in_cpu (only the buffers are in memory), aio.single_submit / overlap_events (how DeepSpeed's
libaio submits; a thread pool here). Refused: ratio below 1.0 (partial offload), aio.use_gds (GPUDirect
Storage), offload_param "nvme" without offload_optimizer "cpu" or "nvme" (the step writes each bucket's
chunk from separate masters).
"""
from __future__ import annotations

import dataclasses

DS_OFFLOAD_OPTIMIZER_KEYS = frozenset({"device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read",
                                       "pipeline_write", "fast_init", "ratio", "super_offload", "cpuadam_cores_perc"})
DS_OFFLOAD_PARAM_KEYS = frozenset({"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"})
DS_AIO_KEYS = frozenset({"block_size", "queue_depth", "intra_op_parallelism", "thread_count", "single_submit",
                         "overlap_events", "use_gds"})  # runtime/swap_tensor/constants.py, and the older name
_DEVICES = ("none", "cpu", "nvme")
_NO_EFFECT = {"pipeline_read", "pipeline_write", "fast_init", "buffer_size", "max_in_cpu", "single_submit",
              "overlap_events"}


@dataclasses.dataclass
class Offload:
    """What the offload blocks said so far, per tier: device, nvme_path, buffer_count, pin_memory (None: absent)."""

    optimizer: dict = dataclasses.field(default_factory=lambda: {"device": "none"})
    param: dict = dataclasses.field(default_factory=lambda: {"device": "none"})


def read_block(r, path: str, value, block: dict, names) -> None:
    """An offload_optimizer / offload_param object into `block`; refusals and no-effect keys go to `r`."""
    if value is None:
        return
    if not isinstance(value, dict):
        r.refuse(path, value, "must be an object like {\"device\": \"cpu\", \"pin_memory\": true}")
        return
    for key, v in value.items():
        sub = f"{path}.{key}"
        if not r.known(sub, key, v, names):
            continue
        if key == "device":
            if v in _DEVICES:
                block["device"] = v
            else:
                r.refuse(sub, v, "must be \"none\", \"cpu\" or \"nvme\"")
        elif key == "pin_memory":
            if r.flag(sub, v) is not None:
                block["pin_memory"] = v
        elif key == "nvme_path":
            if v is not None and not isinstance(v, str):
                r.refuse(sub, v, "must be a directory path")
            elif v is not None:
                block["nvme_path"] = v
        elif key == "buffer_count":
            n = r.whole(sub, v)
            if n is not None:
                block["buffer_count"] = n
        elif key == "ratio":
            if v != 1.0:
                r.refuse(sub, v, "partial offload is not supported; only 1.0")
        elif key in _NO_EFFECT:
            r.ignored.append(sub)
        else:
            r.refuse(sub, v, "not supported by shardopt; remove it")


def read_aio(r, value, out: dict) -> None:
    """The top-level "aio" block -> ShardedOptimizer's `aio` (Note [DeepSpeed's offload keys])."""
    if not isinstance(value, dict):
        r.refuse("aio", value, "must be an object like {\"block_size\": 1048576, \"queue_depth\": 8}")
        return
    aio = {}
    for key, v in value.items():
        sub = f"aio.{key}"
        if not r.known(sub, key, v, DS_AIO_KEYS):
            continue
        if key in ("block_size", "queue_depth", "thread_count", "intra_op_parallelism"):
            n = r.whole(sub, v)
            if n is not None and key == "block_size" and n % 4096:
                r.refuse(sub, v, "must be a multiple of 4096 bytes (direct I/O)")
            elif n is not None:
                aio["thread_count" if key == "intra_op_parallelism" else key] = n
        elif key == "use_gds":
            if v is not False:
                r.refuse(sub, v, "GPUDirect Storage is not supported; only false")
        else:
            r.ignored.append(sub)
    if aio:
        out["aio"] = aio


def finish(r, offload: Offload, out: dict) -> str:
    """The tiers' ShardedOptimizer arguments from both blocks (offload_param read at stage 3 only); returns the
    optimizer's offload device."""
    opt, param = offload.optimizer, offload.param
    device, where = opt["device"], param["device"]
    if device != "none":
        out["offload"] = device
    if where != "none":
        out["offload_param"] = where
        if where == "nvme" and device == "none":
            r.refuse("zero_optimization.offload_param.device", where, "needs offload_optimizer.device \"cpu\" or "
                     "\"nvme\": the step writes each bucket's chunk from separate master weights")
    for name, b in (("offload_optimizer", opt), ("offload_param", param)):
        if b["device"] != "nvme":  # DeepSpeed's NVMe tuning, meaningless for this block
            r.ignored += [f"zero_optimization.{name}.{k}" for k in ("nvme_path", "buffer_count") if k in b]
    on_disk = [b for b in (opt, param) if b["device"] == "nvme"]
    paths = {b["nvme_path"] for b in on_disk if "nvme_path" in b}
    if len(paths) > 1:
        r.refuse("zero_optimization.offload_param.nvme_path", param["nvme_path"], "shardopt has one nvme_path for "
                 f"both tiers; offload_optimizer.nvme_path is {opt['nvme_path']!r}: give both the same directory")
    elif on_disk and not paths:
        r.refuse("zero_optimization.offload_optimizer.nvme_path", None, "device \"nvme\" needs nvme_path: a "
                 "directory on a local disk", even_auto=True)
    elif paths:
        out["nvme_path"] = paths.pop()
    counts = [b["buffer_count"] for b in on_disk if "buffer_count" in b]
    if counts:
        out["offload_buffer_count"] = max(counts)
    pins = {b["pin_memory"] for b in (opt, param) if b["device"] != "none" and "pin_memory" in b}
    if len(pins) > 1:
        r.refuse("zero_optimization.offload_param.pin_memory", param["pin_memory"],
                 "shardopt has one pin_memory for both tiers: give both blocks the same")
    elif pins:
        out["pin_memory"] = pins.pop()
    return device
