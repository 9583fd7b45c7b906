"""Fake (meta) implementations of the shardopt ops, for torch.compile and opcheck.

The schemas are declared in csrc/ops.cpp. Every op here mutates its inputs in
place and returns nothing, so its fake implementation only has to accept the
arguments: there are no outputs whose shapes it would have to describe.
"""
import torch


@torch.library.register_fake("shardopt::adam_step")
def _adam_step_fake(params, grads, exp_avgs, exp_avg_sqs, lowp_out, lr, beta1, beta2, eps,
                    weight_decay, adamw, step, bias_correction):
    return None


@torch.library.register_fake("shardopt::stream_limit")
def _stream_limit_fake(params, grads, exp_avgs, exp_avg_sqs):
    return None


@torch.library.register_fake("shardopt::unscale_into")
def _unscale_into_fake(src, dst, divisor, found):
    return None
