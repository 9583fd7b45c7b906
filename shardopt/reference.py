"""Plain-PyTorch references of shardopt's kernels: one per kernel, clear rather than fast, the ground truth its
tests compare against."""
import math

import torch


def adam_step_reference(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay,
                        adamw, step, bias_correction=True):
    """One Adam/AdamW step on fp32 tensors, in place: ``shardopt::adam_step``'s reference. Scalar coefficients
    in double, rounded to fp32 once (as torch's fused Adam); elementwise fp32, each operation rounded, in the
    kernel's order (Note [Adam operation order] in csrc/adam/adam_element.h):

        g = grad + weight_decay * param            (Adam, weight_decay != 0)
        param = param * (1 - lr * weight_decay)    (AdamW)
        exp_avg = exp_avg * beta1 + g * (1 - beta1)
        exp_avg_sq = exp_avg_sq * beta2 + (g * g) * (1 - beta2)
        param = param - (lr / bc1 * exp_avg) / (sqrt(exp_avg_sq) / sqrt(bc2) + eps)

    with bc1 = 1 - beta1**step and bc2 = 1 - beta2**step (both 1 without ``bias_correction``).
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
    # The kernel's sqrt is correctly rounded, torch's vectorised fp32 one not always: sqrt in double is.
    sqrt_v = exp_avg_sq.double().sqrt().float()
    denom = sqrt_v / f32(math.sqrt(bc2)) + f32(eps)
    param.copy_(p - (f32(lr / bc1) * exp_avg) / denom)
    return param


def unscale_into_reference(src, dst, divisor, found):
    """``shardopt::unscale_into``: ``dst = src / divisor`` in fp32 (fp64 if src or dst is), rounded once into
    dst's dtype; ``found`` raised, never cleared, if src holds an inf/nan (Note [Unscale rounding])."""
    acc = torch.float64 if torch.float64 in (src.dtype, dst.dtype) else torch.float32
    v = src.to(acc)
    if not torch.isfinite(v).all():
        found.fill_(1.0)
    dst.copy_(v / torch.tensor(divisor, dtype=acc))
    return dst


def int8_block_encode_reference(x, block=256):
    """The int8 hop's (scales, q) of fp32 ``x`` (Note [Fused int8 codec]): per zero-padded block scale = max|x| /
    127, q = round-half-even(x * (1 / scale)) clamped to +-127 (0 where scale is 0 or the product nan)."""
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
    """Encodes v = x + residual (fp32); ``residual`` becomes v - decode(message). Returns (scales, q, decoded)."""
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
    """The int8 hop of R replicas' ``chunks`` (residuals n + n / R fp32, or None): the chunk every replica ends
    with. Replica j owns part j: the others send it encoded, j sums in rank order in fp32 (its own part exact)
    and sends the sum back encoded with its residual's last n / R (Note [Compressed inter-node hop])."""
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


def param_phase_reference(chunk, fmt, block=256):
    """What every rank holds of one rank's fp32 ``chunk`` after a two-level gather whose phase across nodes is
    ``fmt`` (None, "bfloat16" or "int8": Note [Stage 3's parameters across nodes, rounded]): the chunk, its bf16
    rounding, or its int8 message (no error feedback) decoded."""
    if fmt is None:
        return chunk.clone()
    if fmt == "bfloat16":
        return chunk.to(torch.bfloat16).float()
    if fmt == "int8":
        return int8_block_decode_reference(*int8_block_encode_reference(chunk.float(), block), block)
    raise ValueError(f"fmt must be None, 'bfloat16' or 'int8', got {fmt!r}")


def two_level_all_gather_reference(inputs, nodes, fmt=None, block=256):
    """``csrc/comm/two_level.h``'s all-gather of W = len(inputs) ranks on ``nodes`` nodes (rank = node * K +
    local): rank (node i, local j)'s input, each rounded as ``fmt`` crosses, at chunk j * nodes + i."""
    world = len(inputs)
    per_node = world // nodes
    n = inputs[0].numel()
    out = torch.empty(world * n, dtype=inputs[0].dtype)
    for rank, x in enumerate(inputs):
        at = (rank % per_node) * nodes + rank // per_node
        out[at * n:(at + 1) * n] = param_phase_reference(x, fmt if nodes > 1 else None, block)
    return out


def onebit_encode_reference(x, block=1024, scale="mean", gain=1.0):
    """fp32 ``x`` -> (fp32 scale per block: mean |x| or RMS, times ``gain``; sign bits, element 8k+i in bit i
    of byte k, 1 for x >= 0): Note [1-bit format] in onebit.py."""
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
    """Encodes v = x + residual (fp32); ``residual`` becomes v - decode(message). Returns (scales, bits, decoded)."""
    v = x.float() if residual is None else x.float() + residual
    scales, bits = onebit_encode_reference(v, block, scale, gain)
    decoded = onebit_decode_reference(scales, bits, v.numel(), block)
    if residual is not None:
        residual.copy_(v - decoded)
    return scales, bits, decoded


def onebit_local_momentum_reference(grad, local, denom, a, beta1):
    """``local`` = local * beta1 + grad * a in place, fp32 ops; returns local / denom (Note [The local momentum in
    one pass] in csrc/comm/onebit_codec.h)."""
    local.mul_(beta1).add_(grad.float().mul(a))
    return local / denom


def onebit_allreduce_reference(chunks, worker_residuals, server_residuals, block=1024, scale="mean", gains=(1.0, 1.0)):
    """1-bit Adam's all-reduce of R ranks' fp32 momentum ``chunks`` (Note [1-bit Adam under ZeRO]), worker (n)
    and server (n / R) residuals updated in place. Rank j owns part j: the others send it 1-bit (gains[0]), j
    averages in rank order in fp32 and sends the mean back 1-bit (gains[1]). Returns every rank's result."""
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
