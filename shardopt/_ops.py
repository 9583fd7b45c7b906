"""Fake implementations of the shardopt ops (csrc/ops.cpp) for torch.compile and opcheck: each op mutates
its inputs and returns nothing, so a fake only accepts the arguments."""
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
