"""A DeepSpeed config written for the Hugging Face Trainer -> ShardedTrainer settings (pure, no Trainer needed).

Note [Trainer "auto" values]
----------------------------
As the Trainer does for DeepSpeed, `resolve_auto` fills every "auto" from TrainingArguments and refuses
explicit values that contradict them (a run must not train with one learning rate and log another):
  train_micro_batch_size_per_gpu <- per_device_train_batch_size
  gradient_accumulation_steps    <- gradient_accumulation_steps
  train_batch_size               <- world size x both of the above
  gradient_clipping              <- max_grad_norm
  optimizer.params lr / betas / eps / weight_decay
                                 <- learning_rate / (adam_beta1, adam_beta2) / adam_epsilon / weight_decay
  scheduler.params warmup_min_lr / warmup_max_lr / warmup_num_steps / total_num_steps
                                 <- 0 / learning_rate / warmup steps / max_steps
  fp16.enabled, bf16.enabled     <- fp16, bf16
  zero_optimization bucket sizes and stage3 thresholds <- shardopt's defaults (only speed depends on them)
`split_config` takes out what belongs to the Trainer: clipping (its clip_grad_norm_ logs grad_norm), the
batch keys, fp16/bf16 (its autocast over fp32 weights, the masters, as with DDP), and the scheduler, which
becomes a LambdaLR with DeepSpeed's formula (`deepspeed_lr_lambda`).
"""
from __future__ import annotations

import copy
import math
from typing import Any, Callable

from shardopt.deepspeed_config import load_config

_AUTO = "auto"


def _is_auto(v) -> bool:
    return isinstance(v, str) and v.strip().lower() == _AUTO


def resolve_auto(config, args, world_size: int, max_steps: int | None = None) -> dict:
    """The config with every "auto" filled from TrainingArguments; raises on contradictions (Note above)."""
    cfg = copy.deepcopy(load_config(config))
    problems: list[str] = []

    def fill(node: dict, key: str, value, what: str) -> None:
        if key not in node:
            return
        if _is_auto(node[key]):
            node[key] = value
        elif value is not None and node[key] != value and not _same_number(node[key], value):
            problems.append(f"  {what} is {node[key]!r} in the config but {value!r} in TrainingArguments: "
                            f"set one of them to match, or write \"auto\" in the config")

    micro, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    fill(cfg, "train_micro_batch_size_per_gpu", micro, "train_micro_batch_size_per_gpu")
    fill(cfg, "gradient_accumulation_steps", accum, "gradient_accumulation_steps")
    fill(cfg, "train_batch_size", micro * accum * world_size, "train_batch_size")
    fill(cfg, "gradient_clipping", args.max_grad_norm, "gradient_clipping")
    opt = cfg.get("optimizer", {}).get("params")
    if isinstance(opt, dict):
        fill(opt, "lr", args.learning_rate, "optimizer.params.lr")
        fill(opt, "betas", [args.adam_beta1, args.adam_beta2], "optimizer.params.betas")
        fill(opt, "eps", args.adam_epsilon, "optimizer.params.eps")
        fill(opt, "weight_decay", args.weight_decay, "optimizer.params.weight_decay")
    sched = cfg.get("scheduler", {}).get("params")
    if isinstance(sched, dict):
        fill(sched, "warmup_min_lr", 0.0, "scheduler.params.warmup_min_lr")
        fill(sched, "warmup_max_lr", args.learning_rate, "scheduler.params.warmup_max_lr")
        steps = args.get_warmup_steps(max_steps) if max_steps is not None else None
        fill(sched, "warmup_num_steps", steps, "scheduler.params.warmup_num_steps")
        fill(sched, "total_num_steps", max_steps, "scheduler.params.total_num_steps")
    for block, flag in (("fp16", args.fp16), ("bf16", args.bf16)):
        if isinstance(cfg.get(block), dict):
            fill(cfg[block], "enabled", bool(flag), f"{block}.enabled")
    zero = cfg.get("zero_optimization", {})
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                "stage3_param_persistence_threshold"):
        if _is_auto(zero.get(key)):
            del zero[key]  # shardopt's default (only speed depends on it)
    if problems:
        raise ValueError("the DeepSpeed config disagrees with the TrainingArguments:\n" + "\n".join(problems))
    return cfg


def _same_number(a, b) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    except (TypeError, ValueError):
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
            return all(_same_number(x, y) for x, y in zip(a, b))
        return False


def split_config(cfg: dict) -> tuple[dict, dict | None]:
    """(what ShardedOptimizer.from_config translates, the scheduler block or None); see the Note above."""
    cfg = copy.deepcopy(cfg)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        cfg.pop(key, None)
    cfg["gradient_clipping"] = 0  # the Trainer clips (max_grad_norm); 0 = none inside the optimizer
    for block in ("fp16", "bf16"):
        cfg.pop(block, None)  # the Trainer's autocast (fp32 weights are the master weights)
    return cfg, cfg.pop("scheduler", None)


_DS_SCHEDULERS = ("WarmupLR", "WarmupDecayLR")


def check_scheduler(scheduler: dict | None) -> None:
    """Raises for a scheduler block ShardedTrainer cannot reproduce (at construction)."""
    if scheduler is not None and scheduler.get("type") not in _DS_SCHEDULERS:
        raise ValueError(f"DeepSpeed scheduler {scheduler.get('type')!r} is not supported by ShardedTrainer "
                         f"(supported: {', '.join(_DS_SCHEDULERS)}): remove the \"scheduler\" block and use the "
                         f"Trainer's lr_scheduler_type / warmup_steps instead")


def deepspeed_lr_lambda(scheduler: dict, base_lr: float) -> Callable[[int], float]:
    """A LambdaLR factor reproducing DeepSpeed's WarmupLR / WarmupDecayLR (deepspeed/runtime/lr_schedules.py):
    step k runs at iteration k-1's rate (step 0 at warmup_min_lr), gamma = log(i+1)/log(warmup) ("log") or
    i/warmup ("linear") during warmup, then 1 (WarmupLR) or a linear decay to 0 at total_num_steps."""
    check_scheduler(scheduler)
    kind = scheduler["type"]
    p: dict[str, Any] = dict(scheduler.get("params", {}))
    unknown = set(p) - {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"}
    if unknown:
        raise ValueError(f"unknown {kind} parameters {sorted(unknown)}")
    lo = float(p.get("warmup_min_lr", 0.0))
    hi = float(p.get("warmup_max_lr", base_lr))
    warmup = p.get("warmup_num_steps", 1000)
    if not isinstance(warmup, int) or warmup <= 0:
        raise ValueError(f"{kind} warmup_num_steps must be a positive integer, got {warmup!r} (with \"auto\" it "
                         "comes from warmup_steps / warmup_ratio: set one of them)")
    warmup = max(2, warmup)  # as DeepSpeed
    log_warmup = p.get("warmup_type", "log") != "linear"
    total = p.get("total_num_steps")
    if kind == "WarmupDecayLR" and not isinstance(total, int):
        raise ValueError(f"WarmupDecayLR needs total_num_steps (an int or \"auto\"), got {total!r}")
    if base_lr <= 0:
        raise ValueError("a DeepSpeed scheduler needs a positive optimizer learning rate")

    def gamma(i: int) -> float:
        if i < warmup:
            return math.log(i + 1) / math.log(warmup) if log_warmup else i / warmup
        if kind == "WarmupDecayLR":
            return max(0.0, (total - i) / max(1.0, total - warmup))
        return 1.0

    def factor(step: int) -> float:
        lr = lo if step == 0 else lo + (hi - lo) * gamma(step - 1)
        return lr / base_lr

    return factor
