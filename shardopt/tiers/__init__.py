"""Tiers: where a rank's training state lives between uses when it does not fit the rank's memory.

Note [Tiers]
------------
Per kind of state, as users spell it: the optimizer's state, fp32 master and gradient shard (`offload`:
"none", "cpu", "nvme") and stage 3's parameter shard (`offload_param`: "none", "cpu", "nvme"). On disk each
lives in scratch files of this rank's own in `nvme_path` (disk.py: unnamed, reserved up front, direct I/O),
walked bucket by bucket: the chunk layout is bucket-major, so a bucket's state is one contiguous record.
    optimizer_state.py  masters and the inner optimizer's state, stepped through a ring of buffers (ring.py)
    grad_shard.py       the gradient shard, a mapped file whose pages the step drops as it reads them
    param_shard.py      stage 3's chunks, read ahead of each gather in the schedule's order, written behind
The tensors the rest of shardopt holds stay the same objects, pointed at a buffer while in use. The files are
made on every rank or on none, and an I/O error in a step raises on every rank (disk.made_everywhere,
disk.failed_anywhere), so no rank waits alone in a collective.
"""
