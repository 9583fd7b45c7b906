"""Hugging Face Trainer with ZeRO-1/2/3 from shardopt: `ShardedTrainer`, a drop-in for `transformers.Trainer`
(and `ShardedSeq2SeqTrainer` for `Seq2SeqTrainer`, whose evaluation may call generate()).

    from shardopt.integrations.transformers import ShardedTrainer
    trainer = ShardedTrainer(model=model, args=args, train_dataset=ds, shardopt_config="ds_config.json")
    trainer.train()                       # launched with torchrun, as with --deepspeed

Note [ShardedTrainer: what changes in the Trainer]
--------------------------------------------------
Everything stays the Trainer's except the optimizer (the Trainer's choice, or the config's "optimizer", as
a ShardedOptimizer over the same groups), the wrapper (ShardedDDP; accelerate wraps only the optimizer,
without device placement, which would ask for a whole state dict), the optimizer state (save_checkpoint in
`checkpoint-N/shardopt/`, loadable at any number of processes), and a DeepSpeed `shardopt_config` (Note
[Trainer "auto" values] in hf_config.py). The Trainer's zero_grad() and GradScaler act on the shards.

Note [The Trainer's clipping is the optimizer's]
------------------------------------------------
The Trainer's accelerator.clip_grad_norm_(model.parameters(), c) is torch's clip_grad_norm_ under DDP:
right over the sharded p.grad, but Python per tensor (27 ms against the optimizer's 0.5 ms at 8000
tensors). Over the model's own parameters with no frozen one holding a gradient (ShardedDDP.is_every_gradient)
both give the same norm, so it becomes opt.clip_grad_norm after accelerate's unscaling; other lists stay
accelerate's. In OneBitAdam's compression stage a flat mesh's p.grad is the rank's own, so it is always the
optimizer's (Note [Clipping by a sketch] in shardopt/onebit_sketch.py).

Note [ShardedTrainer at stage 3]
--------------------------------
A stage-3 model's parameters are empty between uses (Note [Parameters between gathers] in
shardopt/zero3/buckets.py) and its forwards gather on every rank, so evaluation needs nothing; generate()
needs `synced_gpus=True` (ShardedSeq2SeqTrainer passes it with several processes); save_model() streams
the weights into save_pretrained's layout (shardopt.save_weights; PEFT adapters as PEFT writes them), as
DeepSpeed's stage3_gather_16bit_weights_on_model_save: `gather_weights_on_save`, true unless a DeepSpeed
config says otherwise. False: save_model() writes the sharded checkpoint and says how to convert it, and
checkpoint folders hold no weights file (resume reads `shardopt/`). After train() the model stays sharded:
read weights with `with opt.full_params(): ...` on every rank.

Note [The reference model at stage 3]
-------------------------------------
TRL's DPOTrainer runs a frozen reference model as big as the policy once per micro-batch on every rank;
whole, it would cost the model again where the policy costs 1/N. So when the policy is wrapped at stage 3,
a module `ref_model` is frozen and replaced by shardopt.shard_for_inference with the policy's stage-3
options (Note [Models sharded for inference] in shardopt/zero3/inference.py), as TRL's prepare_deepspeed
does under ZeRO-3; every rank runs as many of its forwards. Not at construction: TRL may precompute
reference log-probabilities first. `sync_ref_model=True` is refused at stage 3 (TRL mixes weights in place).
"""
from __future__ import annotations

import functools
import os
import warnings
import weakref

import torch

from shardopt.checkpoint.save_load import load_checkpoint, save_checkpoint
from shardopt.ddp import ShardedDDP
from shardopt.deepspeed_config import translate
from shardopt.integrations.hf_config import check_scheduler, deepspeed_lr_lambda, resolve_auto, split_config
from shardopt.elementwise import check_elementwise
from shardopt.optimizer import ShardedOptimizer
from shardopt.weights.names import peft_adapters
from shardopt.weights.stream import save_weights
from shardopt.zero3.inference import ShardedInference, inference_options, shard_for_inference

try:
    import transformers
    from transformers import Trainer
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError("shardopt.integrations.transformers needs transformers: "
                      "pip install 'shardopt[transformers]'") from e

CHECKPOINT_SUBDIR = "shardopt"

# Note [Trainers that generate during training]
# -------------------------------------------
# TRL's online trainers generate rollouts of different lengths per rank inside the training step. Stage 3
# agrees on forwards of different counts (Note [Passes every rank agrees on] in zero3/passes.py) only with
# nothing in between, and GRPO follows generation with gathers on the default group. So at stage 3 with
# several processes the model's generate() gets `synced_gpus=True` (_synced_generate): the ranks run the
# same passes and draw the same random numbers as under DDP. GRPOTrainer and RLOOTrainer train so
# (tests/test_trl.py); the other generating trainers, not run at stage 3, are refused there by class name.
GENERATING_TRAINERS = frozenset({"PPOTrainer", "OnlineDPOTrainer", "XPOTrainer", "NashMDTrainer", "GKDTrainer"})


# Note [Unwrapping ShardedDDP]
# ----------------------------
# accelerate's unwrap_model would hand a ShardedDDP (or the reference model's ShardedInference) back as it
# is, and TRL reads model attributes on what it returns; ShardedTrainer's accelerator takes them off as it
# takes off DDP. At stage 3 the bare model's forwards still gather through the store's hooks.


class ShardedTrainer(Trainer):
    """`transformers.Trainer` with a ShardedOptimizer + ShardedDDP in place of torch.optim + DDP.

    `shardopt_config`: a DeepSpeed config (dict or JSON path, "auto" allowed), or None for the Trainer's
    optimizer at ZeRO-2; `shardopt_kwargs`: ShardedOptimizer arguments; `gather_weights_on_save`: Note
    [ShardedTrainer at stage 3]."""

    def __init__(self, *args, shardopt_config=None, shardopt_kwargs: dict | None = None,
                 gather_weights_on_save: bool | None = None, **kwargs):
        optimizers = kwargs.get("optimizers", (None, None))
        super().__init__(*args, **kwargs)
        self._shardopt_config = shardopt_config
        self._shardopt_kwargs = dict(shardopt_kwargs or {})
        self._check_arguments(optimizers)
        self._resolved = None
        from_config = None
        if shardopt_config is not None:
            self._resolved = resolve_auto(shardopt_config, self.args, self.args.world_size)
            opt_cfg, sched = split_config(self._resolved)
            t = translate(opt_cfg)  # raises listing every key that cannot be used
            check_scheduler(sched)
            from_config = bool(t.gather_weights_on_save)  # DeepSpeed's default: false
        if gather_weights_on_save is not None and not isinstance(gather_weights_on_save, bool):
            raise TypeError(f"gather_weights_on_save must be True, False or None, got {gather_weights_on_save!r}")
        # Note [ShardedTrainer at stage 3]: what save_model() writes at stage 3.
        self.gather_weights_on_save = (gather_weights_on_save if gather_weights_on_save is not None
                                       else from_config if from_config is not None else True)
        self._check_generation_in_training()
        self._check_reference_model()

    def _stage(self) -> int:
        """The stage the optimizer will have: shardopt_kwargs', else the config's, else ShardedOptimizer's default."""
        if "stage" in self._shardopt_kwargs:
            return int(self._shardopt_kwargs["stage"])
        if self._resolved is not None:
            return int(translate(split_config(self._resolved)[0]).kwargs.get("stage", 2))
        return 2

    def _check_generation_in_training(self) -> None:
        """Note [Trainers that generate during training]."""
        generating = [c.__name__ for c in type(self).__mro__ if c.__name__ in GENERATING_TRAINERS]
        if generating and self._stage() == 3 and self.args.world_size > 1:
            raise ValueError(
                f"ShardedTrainer at stage 3 cannot train {generating[0]} on {self.args.world_size} processes yet: it "
                "generates rollouts during training (different numbers of forwards per rank, each of which gathers "
                "parameters at stage 3), and it has not been run at stage 3 yet (GRPOTrainer and RLOOTrainer have). "
                "Use stage 1 or 2 (shardopt_kwargs={'stage': 2}), or one process. docs/integrations.md, TRL")

    def _check_reference_model(self) -> None:
        """Note [The reference model at stage 3]."""
        if (self._stage() == 3 and getattr(self.args, "sync_ref_model", False)
                and isinstance(getattr(self, "ref_model", None), torch.nn.Module)):
            raise ValueError(
                "ShardedTrainer at stage 3 cannot sync_ref_model=True: TRL's callback mixes the policy's weights into "
                "the reference model's in place, and at stage 3 both are sharded (empty tensors between uses). Use "
                "sync_ref_model=False, or stage 1 or 2 (shardopt_kwargs={'stage': 2}). docs/integrations.md, TRL")

    def _shard_reference_model(self, opt: ShardedOptimizer) -> None:
        """Note [The reference model at stage 3]; whole at stages 1 and 2."""
        ref = getattr(self, "ref_model", None)
        if not opt.params_sharded or not isinstance(ref, torch.nn.Module) or isinstance(ref, ShardedInference):
            return
        ref.requires_grad_(False)  # TRL leaves requires_grad as loaded
        view = opt.view
        options = inference_options(view.config)
        if view.sharding.shape.hybrid:  # sharded over the policy's shard group, replicated across the others
            options.pop("node_aware")
            self.ref_model = shard_for_inference(ref, process_group=view.process_group, **options)
        else:
            self.ref_model = shard_for_inference(ref, **options)

    def _check_arguments(self, optimizers) -> None:
        a = self.args
        refused = []
        if a.deepspeed:
            refused.append("deepspeed=...: pass the DeepSpeed config as ShardedTrainer(shardopt_config=...)")
        if a.fsdp:
            refused.append("fsdp=...: ShardedTrainer shards the optimizer itself; drop the fsdp arguments")
        if a.n_gpu > 1:
            refused.append("several GPUs in one process (DataParallel): launch one process per GPU with torchrun")
        user_opt = optimizers[0] if optimizers else None
        if user_opt is not None and not isinstance(user_opt, ShardedOptimizer):
            refused.append(f"optimizers=({type(user_opt).__name__}, ...): pass optimizer_cls_and_kwargs=(cls, "
                           "kwargs), or a ShardedOptimizer, so that the state is sharded")
        name, ck = checkpointing_kwargs(a)
        if isinstance(ck, dict) and ck.get("use_reentrant"):
            refused.append(f"{name}={{'use_reentrant': True}}: reentrant checkpointing runs nested backward "
                           "passes that would reduce gradients early; use use_reentrant=False")
        if self._shardopt_config is None or "optimizer" not in resolve_auto(
                self._shardopt_config, a, a.world_size):
            cls, _ = self._optimizer_cls_and_kwargs()
            try:
                check_elementwise(cls)
            except (ValueError, TypeError) as e:
                refused.append(f"optim={a.optim!r}: {e}")
        if refused:
            raise ValueError("ShardedTrainer cannot train with:\n  " + "\n  ".join(refused))

    def _optimizer_cls_and_kwargs(self):
        if self.optimizer_cls_and_kwargs is not None:
            return self.optimizer_cls_and_kwargs
        return self.get_optimizer_cls_and_kwargs(self.args, self.model)

    def create_optimizer(self, model=None):
        if self.optimizer is not None:
            return self.optimizer
        model = self.model if model is None else model
        if self._resolved is not None and "optimizer" in self._resolved:
            # As DeepSpeed builds it from its config: one group, the config's hyper-parameters.
            opt_cfg, _ = split_config(self._resolved)
            params = [p for p in model.parameters() if p.requires_grad]
            zero = opt_cfg.get("zero_optimization", {})
            bucket = {} if "reduce_bucket_size" in zero else self._ddp_bucket([{"params": params}])
            self.optimizer = ShardedOptimizer.from_config(params, opt_cfg, **(bucket | self._shardopt_kwargs))
            return self.optimizer
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        cls, kwargs = self._optimizer_cls_and_kwargs()
        # Stage, buckets, offload, reduce dtype from the config; the optimizer is the Trainer's.
        shard_kw = dict(translate(split_config(self._resolved)[0]).kwargs) if self._resolved is not None else {}
        shard_kw = self._ddp_bucket(groups) | shard_kw | self._shardopt_kwargs
        self.optimizer = ShardedOptimizer(groups, optim=cls, **kwargs, **shard_kw)
        return self.optimizer

    def _ddp_bucket(self, groups) -> dict:
        """ddp_bucket_cap_mb (megabytes, as DDP counts them) as a reduce bucket size in elements."""
        mb = self.args.ddp_bucket_cap_mb
        if mb is None:
            return {}
        p = groups[0]["params"][0]
        return {"reduce_bucket_size": max(1, int(mb * 1024 * 1024 // p.element_size()))}

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        sched = None
        if self._resolved is not None:
            cfg = resolve_auto(self._shardopt_config, self.args, self.args.world_size, num_training_steps)
            _, sched = split_config(cfg)
        if sched is None or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        opt = optimizer if optimizer is not None else self.optimizer
        base = opt.param_groups[0]["lr"]
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(opt, deepspeed_lr_lambda(sched, base))
        self._created_lr_scheduler = True
        return self.lr_scheduler

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if not training:
            # Once the model is ours, evaluation goes through its ShardedDDP: accelerate's prepare_model
            # would give the parameters new storage, cut loose from the optimizer's buffers.
            wrapped = self.model_wrapped
            inner = getattr(wrapped, "_orig_mod", wrapped)
            return wrapped if isinstance(inner, ShardedDDP) and inner.module is model else model
        if isinstance(model, ShardedDDP) or isinstance(getattr(model, "_orig_mod", None), ShardedDDP):
            return model
        if self.optimizer is None:
            self.create_optimizer(model)
        opt = self.optimizer.optimizer if hasattr(self.optimizer, "optimizer") else self.optimizer
        _autocast_forward(model, self.accelerator)
        # ddp_find_unused_parameters and ddp_static_graph need nothing: ShardedDDP handles unused parameters.
        broadcast = self.args.ddp_broadcast_buffers
        wrapped = ShardedDDP(model, opt, broadcast_buffers=True if broadcast is None else bool(broadcast))
        if opt.config.stage == 3 and self.args.world_size > 1:
            _synced_generate(model, opt)
        self._shard_reference_model(opt)  # Note [The reference model at stage 3]
        if self.args.torch_compile:
            wrapped = torch.compile(wrapped, backend=self.args.torch_compile_backend or "inductor",
                                    mode=self.args.torch_compile_mode)
        return wrapped

    def create_accelerator_and_postprocess(self):
        # accelerate wraps only the optimizer, without device placement (which would round-trip the whole
        # state through state_dict()); asked of prepare_optimizer, which every transformers 5.x reaches.
        super().create_accelerator_and_postprocess()
        acc = self.accelerator
        prepare_optimizer = acc.prepare_optimizer

        @functools.wraps(prepare_optimizer)
        def without_device_placement(optimizer, device_placement=None):
            if isinstance(optimizer, ShardedOptimizer):
                device_placement = False
            return prepare_optimizer(optimizer, device_placement=device_placement)

        acc.prepare_optimizer = without_device_placement
        clip = acc.clip_grad_norm_

        @functools.wraps(clip)
        def clip_grad_norm_(parameters, max_norm, norm_type=2):
            # Note [The Trainer's clipping is the optimizer's]
            if self.optimizer is None:
                return clip(parameters, max_norm, norm_type=norm_type)
            model, opt = self._sharded()
            model = getattr(model, "_orig_mod", model)  # under torch.compile
            parameters = list(parameters)
            if opt.view.compressing or (isinstance(model, ShardedDDP) and model.is_every_gradient(parameters)):
                acc.unscale_gradients()
                return opt.clip_grad_norm(max_norm, norm_type)
            return clip(parameters, max_norm, norm_type=norm_type)

        acc.clip_grad_norm_ = clip_grad_norm_
        unwrap = acc.unwrap_model

        @functools.wraps(unwrap)
        def unwrap_model(model, *args, **kwargs):
            # Note [Unwrapping ShardedDDP]
            model = unwrap(model, *args, **kwargs)
            return unwrap(model.module, *args, **kwargs) if isinstance(model, (ShardedDDP, ShardedInference)) else model

        acc.unwrap_model = unwrap_model

    def _sharded(self) -> tuple[torch.nn.Module, ShardedOptimizer]:
        opt = self.optimizer
        while not isinstance(opt, ShardedOptimizer):
            opt = opt.optimizer
        return self.model_wrapped, opt

    def _stage3(self) -> ShardedOptimizer | None:
        """The optimizer when it shards this model's parameters now (stage 3, attached to the model), else None."""
        opt = self.optimizer
        while opt is not None and not isinstance(opt, ShardedOptimizer):
            opt = getattr(opt, "optimizer", None)
        if opt is None or not opt.params_sharded or not opt.view.attached:
            return None
        return opt

    def _move_model_to_device(self, model, device):
        if any(p.is_meta for p in model.parameters()):
            return  # built on the meta device (shardopt.from_pretrained): ShardedDDP materialises it shard by shard
        super()._move_model_to_device(model, device)

    def _save_adapters(self, opt, output_dir: str) -> None:
        """A PEFT model at stage 3: its adapters (the trainable parameters, small) gathered, written as PEFT
        writes them (adapter_model.safetensors + adapter_config.json, which PeftModel.from_pretrained loads)."""
        view = opt.view
        names = {id(p): n for n, p in self.model.named_parameters()}
        state = {names[id(view.store.members[i])]: value
                 for i, value in view.store.stream(range(len(view.params))) if id(view.store.members[i]) in names}
        if self.args.should_save:
            self.model.save_pretrained(output_dir, state_dict=state)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """As Trainer.save_model; at stage 3 every rank must call it (Note [ShardedTrainer at stage 3])."""
        opt = self._stage3()
        if opt is None:
            return super().save_model(output_dir, _internal_call=_internal_call)
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if self.gather_weights_on_save:
            # Note [Weights streamed in and out]
            if peft_adapters(self.model) is not None:
                self._save_adapters(opt, output_dir)
            else:
                save_weights(self.model_wrapped, output_dir)
            if self.args.should_save:
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(output_dir)
                torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))
        elif _internal_call:
            # A checkpoint folder: its shardopt/ (written next) holds the weights.
            if self.args.should_save and hasattr(self.model, "config"):
                os.makedirs(output_dir, exist_ok=True)
                self.model.config.save_pretrained(output_dir)
        else:
            path = os.path.join(output_dir, CHECKPOINT_SUBDIR)
            save_checkpoint(path, self.model_wrapped, opt)
            if self.args.should_save:
                if hasattr(self.model, "config"):  # beside the checkpoint, where `shardopt convert` finds it
                    self.model.config.save_pretrained(output_dir)
                warnings.warn(f"save_model() wrote shardopt's sharded checkpoint to {path}, not whole weights, "
                              "because gather_weights_on_save is False (the DeepSpeed config's "
                              "stage3_gather_16bit_weights_on_model_save is false or absent): `python -m shardopt "
                              f"convert {path} {output_dir}/whole/` writes whole weights as a Hugging Face folder, "
                              "streamed; set the key to true (or "
                              "ShardedTrainer(gather_weights_on_save=True)) to write them here", stacklevel=2)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=getattr(self.args, "hub_revision", None))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # Without a weights file (gather_weights_on_save=False), load_checkpoint restores them from shardopt/.
        if os.path.isdir(os.path.join(resume_from_checkpoint, CHECKPOINT_SUBDIR)) and not any(
                os.path.isfile(os.path.join(resume_from_checkpoint, name))
                for name in (transformers.utils.SAFE_WEIGHTS_NAME, transformers.utils.WEIGHTS_NAME,
                             transformers.utils.SAFE_WEIGHTS_INDEX_NAME, transformers.utils.WEIGHTS_INDEX_NAME)):
            return
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        model, opt = self._sharded()
        save_checkpoint(os.path.join(output_dir, CHECKPOINT_SUBDIR), model, opt)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, transformers.trainer.SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, CHECKPOINT_SUBDIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{checkpoint} has no {CHECKPOINT_SUBDIR}/ folder: it was not written by "
                                    "ShardedTrainer (a Trainer + DDP checkpoint holds a whole optimizer.pt, "
                                    "which ShardedTrainer does not read; start from its weights with "
                                    "model_name_or_path instead)")
        model, opt = self._sharded()
        load_checkpoint(path, model, opt)
        sched = os.path.join(checkpoint, transformers.trainer.SCHEDULER_NAME)
        if os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))


# Note [One ShardedTrainer for every transformers 5.x]
# setup.py admits transformers>=5 (with accelerate>=1.3); CI runs tests/test_hf_trainer.py on the oldest
# and the newest. Later fields are read only when present (activation_checkpointing_kwargs, else
# gradient_checkpointing_kwargs), and hooks are ones every 5.x has (create_accelerator_and_postprocess, not
# _prepare_for_training, which 5.0 lacks).
def checkpointing_kwargs(args) -> tuple[str, object]:
    """(the argument's name, its value): the activation-checkpointing keyword arguments the Trainer passes."""
    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        value = getattr(args, name, None)
        if value:
            return name, value
    return "gradient_checkpointing_kwargs", None


def _autocast_forward(model: torch.nn.Module, accelerator) -> None:
    """The autocast accelerate's prepare_model would add (bf16/fp16 Trainer arguments), outputs back in fp32."""
    if not getattr(accelerator, "native_amp", False) or getattr(model, "_shardopt_autocast", False):
        return
    from accelerate.utils import convert_outputs_to_fp32

    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with accelerator.autocast():
            return forward(*args, **kwargs)

    model.forward = convert_outputs_to_fp32(autocast_forward)
    model._shardopt_autocast = True


def _synced_generate(model: torch.nn.Module, opt: ShardedOptimizer) -> None:
    """generate() with `synced_gpus=True` unless told otherwise while `opt` shards the model's parameters
    (Note [Trainers that generate during training]); after detach() a rank may generate alone. `opt` is held
    weakly; a later wrap of the same model replaces it."""
    model._shardopt_generate_opt = weakref.ref(opt)
    generate = getattr(model, "generate", None)
    if generate is None or getattr(model, "_shardopt_synced_generate", False):
        return

    @functools.wraps(generate)
    def synced_generate(*args, **kwargs):
        current = model._shardopt_generate_opt()
        if current is not None and current.params_sharded and current.view.attached:
            kwargs.setdefault("synced_gpus", True)
        return generate(*args, **kwargs)

    model.generate = synced_generate
    model._shardopt_synced_generate = True


class ShardedSeq2SeqTrainer(ShardedTrainer, transformers.Seq2SeqTrainer):
    """`transformers.Seq2SeqTrainer` with shardopt; at stage 3 with several processes generate() gets
    `synced_gpus=True` unless told otherwise (Note [ShardedTrainer at stage 3])."""

    def _synced(self, gen_kwargs: dict) -> dict:
        if self._stage3() is not None and self.args.world_size > 1:
            gen_kwargs.setdefault("synced_gpus", True)
        return gen_kwargs

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval", **gen_kwargs):
        return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix,
                                **self._synced(gen_kwargs))

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test", **gen_kwargs):
        return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix,
                               **self._synced(gen_kwargs))


__all__ = ["ShardedSeq2SeqTrainer", "ShardedTrainer"]
