"""Plain-PyTorch references of shardopt's kernels, for tests.

One function per kernel. Each does in tensor ops exactly what its kernel
promises, favouring clarity over speed, and is the ground truth the kernel's
tests compare against.
"""
import math

import torch


def adam_step_reference(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay,
                        adamw, step, bias_correction=True):
    """One Adam/AdamW step on fp32 tensors, in place; the reference of ``shardopt::adam_step``.

    ``step`` counts the step being taken (1 for the first). Bias corrections and
    every scalar coefficient are computed in double and rounded to fp32 once,
    as torch's fused Adam does; the element-wise math is fp32 with each
    operation rounded separately, in the kernel's order (Note [Adam operation
    order] in csrc/adam/adam_element.h):

        g = grad + weight_decay * param            (Adam, weight_decay != 0)
        param = param * (1 - lr * weight_decay)    (AdamW)
        exp_avg = exp_avg * beta1 + g * (1 - beta1)
        exp_avg_sq = exp_avg_sq * beta2 + (g * g) * (1 - beta2)
        param = param - (lr / bc1 * exp_avg) / (sqrt(exp_avg_sq) / sqrt(bc2) + eps)

    with bc1 = 1 - beta1**step and bc2 = 1 - beta2**step, or both 1 when
    ``bias_correction`` is False. Returns ``param``.
    """
    def f32(x):  # a double rounded to fp32 once, as a 0-dim tensor (torch would keep a Python float in double)
        return torch.tensor(x, dtype=torch.float32)

    bc1 = 1.0 - beta1 ** step if bias_correction else 1.0
    bc2 = 1.0 - beta2 ** step if bias_correction else 1.0
    g = grad
    if not adamw and weight_decay != 0:
        g = g + param * f32(weight_decay)
    p = param * f32(1.0 - lr * weight_decay) if adamw else param.clone()
    exp_avg.copy_(exp_avg * f32(beta1) + g * f32(1.0 - beta1))
    exp_avg_sq.copy_(exp_avg_sq * f32(beta2) + (g * g) * f32(1.0 - beta2))
    # The kernel's sqrt is IEEE (correctly rounded); torch's vectorised fp32 sqrt
    # is off by an ulp now and then. sqrt in double rounded to fp32 is exact.
    sqrt_v = exp_avg_sq.double().sqrt().float()
    denom = sqrt_v / f32(math.sqrt(bc2)) + f32(eps)
    param.copy_(p - (f32(lr / bc1) * exp_avg) / denom)
    return param


def unscale_into_reference(src, dst, divisor, found):
    """``dst = src / divisor`` cast to dst's dtype; ``found`` set to 1 if src holds an inf/nan.

    The reference of ``shardopt::unscale_into`` on every device (the bucket
    engine's gradient copy: Note [Unscaling inside the reduction] in
    shardopt/precision.py; CPU and CUDA kernels share their arithmetic, Note
    [Unscale rounding] in csrc/precision/unscale_element.h). The division is in
    fp32, or fp64 when src or dst is fp64, with the divisor rounded to that
    dtype once, and the quotient is rounded once into dst's dtype. ``found`` is
    only ever raised, never cleared, and only by non-finite *src* values.
    """
    acc = torch.float64 if torch.float64 in (src.dtype, dst.dtype) else torch.float32
    v = src.to(acc)
    if not torch.isfinite(v).all():
        found.fill_(1.0)
    dst.copy_(v / torch.tensor(divisor, dtype=acc))
    return dst


def int8_block_encode_reference(x, block=256):
    """The int8 inter-node hop's encoding of fp32 ``x`` (Note [Fused int8 codec] in
    csrc/comm/int8_codec.h): per block of ``block`` elements (the last one zero-padded),
    scale = max|x| / 127 in fp32, q = round-half-to-even(x * (1 / scale)) clamped to [-127, 127]
    (0 where scale is 0, and where x * (1 / scale) is nan). Returns (scales fp32, q int8)."""
    m = x.numel()
    nb = -(-m // block)
    padded = torch.zeros(nb * block, dtype=torch.float32)
    padded[:m] = x
    rows = padded.view(nb, block)
    scale = rows.abs().amax(1) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(rows * inv[:, None]).clamp(-127, 127).nan_to_num(0.0).to(torch.int8)
    return scale, q.view(-1)[:m]


def int8_block_decode_reference(scale, q, block=256):
    """Inverse of int8_block_encode_reference: q * scale of its block, in fp32."""
    m = q.numel()
    nb = scale.numel()
    padded = torch.zeros(nb * block, dtype=torch.float32)
    padded[:m] = q.float()
    return (padded.view(nb, block) * scale[:, None]).view(-1)[:m]


def int8_encode_feedback_reference(x, residual=None, block=256):
    """The hop's encode with error feedback (Note [Fused int8 codec]): v = x + residual in fp32
    is encoded, and ``residual`` (if given) becomes, in place, v - decode(message): what the
    rounding lost. Returns (scales, q, decoded)."""
    v = x.float() if residual is None else x.float() + residual
    scale, q = int8_block_encode_reference(v, block)
    decoded = int8_block_decode_reference(scale, q, block)
    if residual is not None:
        residual.copy_(v - decoded)
    return scale, q, decoded


def int8_decode_reference(scale, q, out, base=None, block=256):
    """The hop's decode into fp32 ``out``: out = decoded, or out = base + decoded (fp32) given ``base``."""
    decoded = int8_block_decode_reference(scale, q, block)
    return out.copy_(decoded if base is None else base + decoded)


def int8_hop_reference(chunks, residuals=None, block=256):
    """The int8 inter-node hop (Note [Compressed inter-node hop] in csrc/comm/replica_hop.h) of all
    R replicas at once: ``chunks[k]`` is replica k's chunk (n elements, fp32/bf16/fp16),
    ``residuals[k]`` its error-feedback residual (n + n / R fp32, updated in place) or None.
    Returns the chunk every replica ends with. Part j (n / R elements) is owned by replica j: the
    others send it encoded (with their residual for it), j sums in rank order in fp32 (its own
    part exact), encodes the sum (with its residual's last n / R elements), and everyone decodes."""
    reps = len(chunks)
    n = chunks[0].numel()
    m = n // reps
    out = torch.empty(n, dtype=chunks[0].dtype)
    for j in range(reps):
        lo, hi = j * m, (j + 1) * m
        addends = []
        for k in range(reps):
            x = chunks[k][lo:hi].float()
            if k == j:
                addends.append(x)
            else:
                addends.append(int8_encode_feedback_reference(x, residuals[k][lo:hi] if residuals else None,
                                                              block)[2])
        total = addends[0].clone()
        for a in addends[1:]:
            total += a
        out[lo:hi] = int8_encode_feedback_reference(total, residuals[j][n:] if residuals else None, block)[2]
    return out


# ------------------------------------------------------------------ 1-bit format
# Note [1-bit format] in shardopt/onebit.py: per block of ONEBIT_BLOCK elements one fp32 scale (the
# mean |x| of the block's real elements, or with scale="rms" their root mean square) and one sign bit per
# element (1: x >= 0), packed 8 to a byte, element 8k+i in bit i of byte k; a value decodes to +scale or
# -scale.
def onebit_encode_reference(x, block=1024, scale="mean", gain=1.0):
    """fp32 ``x`` (n elements) -> (scales fp32 [ceil(n / block)], bits uint8 [ceil(n / 8)]); every block's scale
    its mean |x| or RMS (``scale``) times ``gain``, the product in fp32."""
    n = x.numel()
    nb = -(-n // block)
    x = x.float()
    scales = torch.empty(nb, dtype=torch.float32)
    for k in range(nb):
        part = x[k * block:(k + 1) * block]
        acc = 0.0  # fp64, in element order
        for f in part.tolist():
            acc += abs(f) if scale == "mean" else f * f  # (an fp32's square is exact in fp64)
        mean = acc / part.numel()
        scales[k] = torch.tensor(mean if scale == "mean" else math.sqrt(mean), dtype=torch.float64).float()
    scales = scales * gain  # fp32 times a Python number: an fp32 product
    # element 8k+i in bit i of byte k (whole tensor ops: the same bits as setting them one by one)
    ones = torch.zeros(-(-n // 8) * 8, dtype=torch.int32)
    ones[:n] = (x >= 0).to(torch.int32)
    bits = (ones.view(-1, 8) << torch.arange(8, dtype=torch.int32)).sum(1).to(torch.uint8)
    return scales, bits


def onebit_decode_reference(scales, bits, n, block=1024):
    """Inverse of onebit_encode_reference, in fp32: +scale of the block where the bit is 1, else -scale."""
    i = torch.arange(n)
    s = scales[i // block]
    one = (bits[i // 8].to(torch.int32) >> (i % 8)) & 1
    return torch.where(one == 1, s, -s)


def onebit_encode_feedback_reference(x, residual=None, block=1024, scale="mean", gain=1.0):
    """Encode with error feedback: v = x + residual (fp32) is encoded and ``residual`` becomes, in place,
    v - decode(message). Returns (scales, bits, decoded)."""
    v = x.float() if residual is None else x.float() + residual
    scales, bits = onebit_encode_reference(v, block, scale, gain)
    decoded = onebit_decode_reference(scales, bits, v.numel(), block)
    if residual is not None:
        residual.copy_(v - decoded)
    return scales, bits, decoded


def onebit_local_momentum_reference(grad, local, denom, a, beta1):
    """Note [The local momentum in one pass] (csrc/comm/onebit_codec.h): ``local`` = local * beta1 + grad * a, in
    place, in fp32 ops (each scalar an fp32 as ATen takes a Python float); returns local / denom."""
    local.mul_(beta1).add_(grad.float().mul(a))
    return local / denom


def onebit_allreduce_reference(chunks, worker_residuals, server_residuals, block=1024, scale="mean", gains=(1.0, 1.0)):
    """The compressed all-reduce of 1-bit Adam's momentum over R ranks, replicas on a hybrid mesh or every rank on a flat
    one (Note [1-bit Adam under ZeRO]):
    ``chunks[k]`` replica k's fp32 momentum (n elements, n % R == 0), ``worker_residuals[k]`` (n) and
    ``server_residuals[k]`` (n / R) its residuals, updated in place. Part j is owned by replica j: the
    others send it 1-bit with their worker residual, j averages in rank order in fp32 (its own part
    exact), encodes the mean with its server residual, and every replica decodes that (every message's
    scale per block: "mean" |x| or "rms", times gains[0] on the replicas' messages and gains[1] on the owners').
    Returns the chunk every replica ends with."""
    reps = len(chunks)
    n = chunks[0].numel()
    m = n // reps
    out = torch.empty(n, dtype=torch.float32)
    for j in range(reps):
        lo, hi = j * m, (j + 1) * m
        total = None
        for k in range(reps):
            x = chunks[k][lo:hi].float()
            part = x.clone() if k == j else onebit_encode_feedback_reference(x, worker_residuals[k][lo:hi],
                                                                             block, scale, gains[0])[2]
            total = part if total is None else total + part
        out[lo:hi] = onebit_encode_feedback_reference(total / reps, server_residuals[j], block, scale, gains[1])[2]
    return out
