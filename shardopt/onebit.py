"""1-bit Adam as a ShardedOptimizer mode: exact AdamW for `freeze_step` steps, then a frozen variance and
a momentum exchange of one bit per element (Note [1-bit Adam under ZeRO]).

    opt = ShardedOptimizer(model.parameters(), optim=shardopt.OneBitAdam, lr=3e-4, freeze_step=400)

or a DeepSpeed config with "type": "OneBitAdam". Here: the options, the 1-bit format and the compressed
all-reduce; the step is onebit_step.py. Measurements: docs/multi-node-and-hybrid.md, benchmarks/results/.

Note [1-bit Adam under ZeRO]
----------------------------
1-bit Adam (Tang et al. 2021; DeepSpeed's OnebitAdam) runs exact Adam for a warm-up (our AdamW path, bit
for bit), then freezes Adam's variance v and exchanges only the momentum m, as signs and one scale per
block (Note [1-bit format]), with error feedback: what an encoding loses is added to the same elements
next time. Rank r owns chunk r of every bucket (its shard, n elements); G_i is rank i's local gradient,
T the step v froze at, d = sqrt(v) / sqrt(bc2(T)) + eps the frozen denominator. Everything exchanged is
divided by d: with v frozen the update is linear in m, so over d each element is in the units of its own
update and one scale fits a block of very different variances; d is constant, so error feedback
telescopes as on raw values. The exchange is DeepSpeed's two-phase compressed all-reduce (allreduce_1bit):
every rank sends part j 1-bit to rank j, which sums the parts in rank order in fp32 and sends their mean
back 1-bit, with error feedback on both sides (the worker and server residuals). What crosses is each
rank's local momentum:
  flat mesh (W ranks): rank i keeps L_i = b1*L_i + (1-b1)*G_i over every chunk (at the first compression
    step every owner's exact m, all-gathered once) and all-reduces M_i = L_i / d, row j being chunk j of
    every bucket over owner j's d (in rank order: OneBitStep._rows); owner j's m = decoded row j * d_j.
  hybrid mesh (R replicas of S shards): backward reduces gradients exactly inside the shard group, with the
    engine's hop across replicas off (sync_engine); times (1-b1) that is replica k's increment D_k. Replica
    k keeps L_k = b1*L_k + D_k (at first m), all-reduces L_k / d and sets m = decoded * d, bit-equal on all.
    hybrid_exchange="increment" sends D_k / d and adds b1*m instead.
Each rank then steps its shard: p = p * (1 - lr*wd) - lr / bc1(t) * m / d, by foreach ops or the fused CPU
Adam kernel at beta1 = 0, beta2 = 1 (offload="cpu").
Bytes per rank per step (blocks of B): flat 2 (W-1)/W * (P/8 + 4P/(W B)) for P parameters, instead of
(W-1)/W * 4P in fp32; hybrid 2 (R-1)/R * n/8 (+ scales), 32x less per node than the exact fp32 hop.
Memory per rank besides AdamW's: state_bytes, and on a flat mesh a whole local gradient (as DDP).
Stage 3 runs the same exchange (a model too large for one device wants a hybrid mesh: a flat one holds
whole local gradients). Checkpoints hold the residuals and local momentum per rank (Note [Hop residual in
checkpoints]); another mesh restarts them from zero and from the owners' m. The mean gradient never
exists, so clip_grad_norm estimates its norm (Note [Clipping by a sketch] in onebit_sketch.py) and step()
scales every local gradient by the coefficient before the exchange (clipping each by its own norm, as
DeepSpeed's engine does, clips far harder: noise dominates small local batches). A step with inf/nan
anywhere is skipped before any encoding.

Note [Why the local momentum crosses]
-------------------------------------
DeepSpeed's scheme sends b1*m + (1-b1)*G_i, m the last exchange's decoded mean. The encoding's error e_t
then enters the momentum, m_t = exact_t + sum_k b1^(t-k) (e_(k-1) - e_k), and the weights through every
later b1*m: lr * (e_0 - e_t) / (1 - b1) / d, an error of 1 / (1 - b1) steps (500 at b1 = 0.998). With the
local momenta the mean sent is the exact momentum, m_t = exact_t + e_(t-1) - e_t, and the weights carry
lr * (e_0 - e_t) / d: one step. The price is memory (a flat mesh holds a whole model's fp32), not bytes.

Note [The gains of the 1-bit scales]
------------------------------------
A block is sent as s sign(v), v = x + the residual; error feedback keeps r' = v - s sign(v). With
s = g * mean|v| over c elements, |r'|^2 = |v|^2 - c mean|v|^2 g (2 - g): any gain in (0, 2) shrinks what
an encode is given, so the residual stays bounded. A larger gain sends large elements sooner (an element
above s waits in the residual) at the cost of noise on small ones. The owners' messages, means of the
ranks' signs, understate where ranks agree more: hence 1.5 on the ranks' messages and 1.75 on the owners'
(chosen on benchmarks/onebit_suite.py).

Note [The step the variance froze at]
-------------------------------------
d's bias correction is bc2(T) = 1 - b2^T, T the Adam steps that built v: freeze_step, or more after a load
(AdamW's 1500 steps loaded into OneBitAdam(freeze_step=75): T = 75 would make every d 3.3x too large). So
T is recorded when v freezes and kept in checkpoints (manifest, consolidated state_dict(), shardopt.dcp);
a state that never froze freezes at the next compression step. A OneBitAdam checkpoint without the record
froze at freeze_step (checkpoint/save_load.py).

Note [1-bit format]
-------------------
A message of n elements is one fp32 scale per block of ONEBIT_BLOCK (B) elements, then one bit per element
(1 for x >= 0), element 8k+i in bit i of byte k: 4*ceil(n/B) + ceil(n/8) bytes; an element decodes to
+-scale. The scale is the block's "mean" |x| or "rms" (OneBitConfig.scale, summed in fp64) times a gain
(in fp32). The fused C++ codec encodes the mean |x|; for the RMS encode_feedback rewrites its scales.
Pure-PyTorch reference: reference.py (onebit_*_reference).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from shardopt import _ext
from shardopt.parallel import comm as _comm

ONEBIT_BLOCK = 1024
_DS_FREEZE_STEP_DEFAULT = 100000  # DeepSpeed's OnebitAdam default


class OneBitAdam(torch.optim.AdamW):
    """1-bit Adam's hyper-parameters, as `optim=` of ShardedOptimizer (Note [1-bit Adam under ZeRO]).

    Alone it is AdamW, as DeepSpeed's OnebitAdam; ShardedOptimizer runs the compression stage.
    `cuda_aware` and `comm_backend_name` (DeepSpeed's MPI / NCCL choices) are accepted and ignored.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 freeze_step: int = _DS_FREEZE_STEP_DEFAULT, cuda_aware: bool = False,
                 comm_backend_name: str | None = None, **kwargs):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)


@dataclasses.dataclass(frozen=True)
class OneBitConfig:
    freeze_step: int
    block: int = ONEBIT_BLOCK
    hybrid_exchange: str = "momentum"  # over replicas: the local momentum, or "increment" (+ b1*m)
    scale: str = "mean"  # each block's statistic (Note [1-bit format]): "mean" |x| or "rms"
    gains: tuple = (1.5, 1.75)  # on the ranks' messages, the owners' (Note [The gains of the 1-bit scales])

    def __post_init__(self):
        if isinstance(self.freeze_step, bool) or not isinstance(self.freeze_step, int) or self.freeze_step < 1:
            raise ValueError(f"OneBitAdam's freeze_step must be a whole number >= 1 (the exact-Adam warm-up "
                             f"steps before the variance freezes), got {self.freeze_step!r}")
        if self.hybrid_exchange not in ("momentum", "increment"):
            raise ValueError(f"hybrid_exchange must be \"momentum\" or \"increment\", got {self.hybrid_exchange!r}")
        if self.scale not in ("rms", "mean"):
            raise ValueError(f"the 1-bit scale must be \"rms\" or \"mean\", got {self.scale!r}")
        if len(self.gains) != 2 or not all(isinstance(g, (int, float)) and 0.0 < g < 2.0 for g in self.gains):
            raise ValueError(f"the 1-bit scales' gains must be two numbers in (0, 2) (the ranks' messages', the "
                             f"owners'; Note [The gains of the 1-bit scales]), got {self.gains!r}")


def split_options(optim, optim_kwargs: dict, offload: str):
    """(inner optimizer class, its kwargs, OneBitConfig or None) for ShardedOptimizer's `optim=`; the
    warm-up runs torch.optim.AdamW, or the fused CPUAdam (adamw=True) with offload."""
    if not (isinstance(optim, type) and issubclass(optim, OneBitAdam)):
        return optim, optim_kwargs, None
    kwargs = dict(optim_kwargs)
    config = OneBitConfig(freeze_step=kwargs.pop("freeze_step", _DS_FREEZE_STEP_DEFAULT))
    kwargs.pop("cuda_aware", None)
    kwargs.pop("comm_backend_name", None)
    kwargs.setdefault("weight_decay", 0.0)
    if offload == "cpu":
        from shardopt.cpu_adam import CPUAdam
        return CPUAdam, {**kwargs, "adamw": True}, config
    return torch.optim.AdamW, kwargs, config


# One message per row, by the fused C++ codec (Note [Fused 1-bit codec] in csrc/comm/onebit_codec.h).
def message_bytes(n: int, block: int = ONEBIT_BLOCK) -> int:
    """Bytes of one 1-bit message of n elements (Note [1-bit format])."""
    return 4 * (-(-n // block)) + (-(-n // 8))


def residual_numel(n: int, shards: int, replicas: int, block: int = ONEBIT_BLOCK) -> int:
    """fp32 elements of a rank's residual tensor for a shard of n elements: the worker residual, the server
    residual, a flag and the local momentum (hybrid: n, n / R, 1, n; flat over W > 1 ranks: W n, n, 1, W n)."""
    if replicas > 1:
        return n + n // replicas + 1 + n
    if shards > 1:
        return shards * n + n + 1 + shards * n
    return 0


def state_bytes(n: int, shards: int, replicas: int, block: int = ONEBIT_BLOCK) -> int:
    """Host bytes of the compression state once compressing, as memory_stats()["onebit"] counts them: the
    residual tensor, the frozen denominator (n), and on a flat mesh every owner's (W n)."""
    rows = shards * n if replicas == 1 and shards > 1 else 0
    return (residual_numel(n, shards, replicas, block) + n + rows) * 4


def encode(rows: torch.Tensor, block: int = ONEBIT_BLOCK) -> torch.Tensor:
    """fp32 [k, n] -> uint8 [k, message_bytes(n)]: per row the scales (fp32 bytes), then the sign bits."""
    return encode_feedback(rows, None, block=block)


def decode(msgs: torch.Tensor, n: int, block: int = ONEBIT_BLOCK, skip: int | None = None,
           times: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 [k, message_bytes(n)] -> fp32 [k, n] (row `skip` left unwritten: the caller fills it), each value
    times `times` ([k, n] fp32, in the same pass) when given."""
    out = torch.empty(msgs.shape[0], n, dtype=torch.float32)
    for i in range(msgs.shape[0]):
        if i != skip:
            _ext._C.onebit_decode(msgs[i], out[i], block=block, times=None if times is None else times[i])
    return out


def encode_feedback(rows: torch.Tensor, residual: torch.Tensor | None, keep: int | None = None,
                    block: int = ONEBIT_BLOCK, scale: str = "mean", gain: float = 1.0) -> torch.Tensor:
    """The messages of rows + residual ([k, n] fp32 each); residual becomes what the encoding lost. Row
    `keep` is not sent (the caller's own): its message is left zero and its residual stays zero. `scale`:
    each block's "mean" |x| (the fused C++ codec) or "rms" (Note [1-bit format]), times `gain` in fp32."""
    k, n = rows.shape
    rows = rows.contiguous()
    msgs = torch.zeros(k, message_bytes(n, block), dtype=torch.uint8)
    for i in range(k):
        if i == keep:
            continue
        if scale == "mean":
            _ext._C.onebit_encode(rows[i], msgs[i], residual=None if residual is None else residual[i], block=block,
                                  gain=gain)
            continue
        v = rows[i] if residual is None else rows[i] + residual[i]
        _ext._C.onebit_encode(v, msgs[i], block=block)  # the signs (and mean |x| scales, replaced below)
        scales = rms_scales(v, block).mul_(gain)
        msgs[i, :4 * scales.numel()].copy_(scales.view(torch.uint8))
        if residual is not None:
            _ext._C.onebit_decode(msgs[i], residual[i], block=block)
            torch.sub(v, residual[i], out=residual[i])
    if residual is not None and keep is not None:
        residual[keep].zero_()
    return msgs


def rms_scales(v: torch.Tensor, block: int = ONEBIT_BLOCK) -> torch.Tensor:
    """Each block's root mean square (squares summed in fp64, where an fp32's square is exact), fp32."""
    n = v.numel()
    full = n - n % block
    sq = v.double().square()
    sums = sq[:full].view(-1, block).sum(1)
    means = sums / block
    if full < n:
        means = torch.cat([means, (sq[full:].sum() / (n - full)).view(1)])
    return means.sqrt().float()


def allreduce_1bit(chunk: torch.Tensor, group, replica: int, worker: torch.Tensor, server: torch.Tensor,
                   block: int = ONEBIT_BLOCK, scale: str = "mean", gains: tuple = (1.0, 1.0)):
    """The group's mean of `chunk` (n fp32, n % R == 0), 1-bit both ways with error feedback in the worker
    (n) and server (n / R) residuals (reference.onebit_allreduce_reference; gains[0] on the ranks' messages,
    gains[1] on the owners'). Returns the R server messages ([R, message_bytes(n / R)] uint8): every rank
    decodes the mean from the same bytes (decode(...).reshape(-1)), or only the parts it needs."""
    r = dist.get_world_size(group)
    n = chunk.numel()
    m = n // r
    msgs = encode_feedback(chunk.view(r, m), worker.view(r, m), keep=replica, block=block, scale=scale, gain=gains[0])
    got = torch.empty_like(msgs)
    # Point to point on the group's worker, not gloo's all_to_all_single: a lost peer's error names it
    # (Note [Naming a peer] in csrc/comm/peer_names.h).
    _comm.start_all_to_all(msgs.view(-1), got.view(-1), group).wait()
    parts = decode(got, m, block, skip=replica)
    parts[replica] = chunk.view(r, m)[replica]  # this rank's own part, exact
    total = parts[0].clone()  # summed in rank order in fp32, as the reference
    for i in range(1, r):
        total += parts[i]
    mine = encode_feedback((total / r).view(1, m), server.view(1, m), block=block, scale=scale, gain=gains[1])
    every = torch.empty(r * mine.numel(), dtype=torch.uint8)
    _comm.start_all_gather(mine.view(-1), every, group).wait()
    return every.view(r, -1)

