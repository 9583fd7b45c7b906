"""TRL's trainers with shardopt: `class ShardedSFT(ShardedTrainer, SFTTrainer)` (and DPO's likewise) against the
same TRL trainer under DDP, at 2 gloo ranks (docs/integrations.md, "TRL").

A small LlamaForCausalLM built from a config (no download, no dropout), a character-level tokenizer made
here from this repository's own text, datasets made in memory. The comparison is test_hf_trainer.py's:
logged losses, grad norms, learning rates and final weights within 1e-5, trained by a ShardedOptimizer
through ShardedDDP (one reduce-scatter per bucket per step, the optimizer's own clipping).
"""
import contextlib
import copy
import glob
import os

import pytest
import torch

from dist_harness import run_ranks
from test_hf_trainer import _compare, _env, _is_sharded

import transformers  # noqa: E402  (the [test] extra installs it)
import trl  # noqa: E402  (a test dependency: setup.py's `test` extra; missing, this file fails)
from datasets import Dataset  # noqa: E402  (trl's own dependency)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGE3 = {"stage": 3, "reduce_bucket_size": 2000, "param_persistence_threshold": 100}


def _corpus() -> str:
    return "".join(open(f).read() for f in sorted(glob.glob(os.path.join(ROOT, "shardopt", "*.py"))))


def char_tokenizer():
    """A character-level PreTrainedTokenizerFast over the corpus' characters, with pad and eos tokens."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    chars = sorted(set(_corpus()) - {" "}) + ["<pad>", "<eos>", "<unk>"]
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def tiny_llama(tokenizer):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
                                   eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return transformers.LlamaForCausalLM(cfg)


def _lines(n: int, width: int) -> list[str]:
    """n pieces of the corpus, width characters each, spaces removed (the tokenizer splits no words)."""
    text = _corpus().replace(" ", "")
    return [text[i * width:(i + 1) * width] for i in range(n)]


def sft_dataset(n=48):
    # Prompt and completion: SFT's loss on the completion only (its default for this format).
    return Dataset.from_list([{"prompt": s[:10], "completion": s[10:]} for s in _lines(n, 24)])


def dpo_dataset(n=24):
    # chosen: the corpus' own continuation; rejected: it reversed.
    return Dataset.from_list([{"prompt": s[:8], "chosen": s[8:], "rejected": s[8:][::-1]} for s in _lines(n, 20)])


def _config(cls, out, **kw):
    base = dict(output_dir=out, report_to="none", use_cpu=True, seed=0, logging_steps=1, save_strategy="no",
                per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=4, learning_rate=3e-3,
                weight_decay=0.1, warmup_steps=1, lr_scheduler_type="linear", max_grad_norm=0.5,
                ddp_find_unused_parameters=False, disable_tqdm=True, dataloader_num_workers=0, max_length=32)
    base.update(kw)
    return cls(**{k: v for k, v in base.items() if v is not None})  # None: not an argument of this config


def sharded(trainer_cls):
    """ShardedTrainer's behaviour on any Trainer subclass: the class a user writes in one line."""
    from shardopt.integrations.transformers import ShardedTrainer

    return type(f"Sharded{trainer_cls.__name__}", (ShardedTrainer, trainer_cls), {})


def _fit(trainer, model, is_sharded):
    trainer.torch_clips = 0
    from unittest import mock
    with mock.patch.object(torch.nn.utils, "clip_grad_norm_", wraps=torch.nn.utils.clip_grad_norm_) as clip:
        trainer.train()
    trainer.torch_clips = clip.call_count
    logs = [{k: v for k, v in e.items() if k in ("loss", "grad_norm", "learning_rate", "step")}
            for e in trainer.state.log_history if "loss" in e]
    with trainer._sharded()[1].full_params(writeback=False) if is_sharded else contextlib.nullcontext():
        weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return logs, weights, trainer


def _run(kind, rank, world_size, tmp, shardopt_kwargs):
    """One TRL trainer, plain (DDP) and sharded, from the same seed: (reference, ours)."""
    from accelerate.state import AcceleratorState

    _env(rank, world_size)
    out = []
    for is_sharded in (False, True):
        AcceleratorState._reset_state()
        tokenizer = char_tokenizer()
        model = tiny_llama(tokenizer)
        if kind == "sft":
            cls, kw = trl.SFTTrainer, dict(train_dataset=sft_dataset())
            args = _config(trl.SFTConfig, f"{tmp}/{kind}-{is_sharded}")
        else:
            # The frozen reference model: a copy of the initial policy, on every rank whole (see docs).
            cls, kw = trl.DPOTrainer, dict(train_dataset=dpo_dataset(), ref_model=copy.deepcopy(model))
            args = _config(trl.DPOConfig, f"{tmp}/{kind}-{is_sharded}", beta=0.5, learning_rate=1e-3)
        extra = dict(shardopt_kwargs=shardopt_kwargs) if is_sharded else {}
        trainer = (sharded(cls) if is_sharded else cls)(model=model, args=args, processing_class=tokenizer, **kw,
                                                         **extra)
        out.append(_fit(trainer, model, is_sharded))
    return out


def _parity(rank, world_size, tmp, kind, stage):
    ref, ours = _run(kind, rank, world_size, tmp, {**STAGE3, "stage": stage})
    failures = _compare(ref, ours, 1e-5, f"{kind} stage {stage}") + _is_sharded(ours[2], f"{kind} stage {stage}")
    if ours[2]._sharded()[1].config.stage != stage:
        failures.append(f"trained at stage {ours[2]._sharded()[1].config.stage}")
    if not any(e["grad_norm"] > 0.5 for e in ref[0]):
        failures.append(f"clipping never active (grad norms {[e['grad_norm'] for e in ref[0]]})")
    if len(ref[0]) != 4:
        failures.append(f"{len(ref[0])} logged steps")
    return failures


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sft_matches_sft_trainer_with_ddp(tmp_path, stage):
    """ShardedTrainer mixed into SFTTrainer (prompt-completion data, completion-only loss): SFTTrainer + DDP's numbers."""
    for rank, failures in enumerate(run_ranks(_parity, 2, str(tmp_path), "sft", stage, timeout=400)):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


@pytest.mark.parametrize("stage", [2, 3])
def test_dpo_matches_dpo_trainer_with_ddp(tmp_path, stage):
    """ShardedTrainer mixed into DPOTrainer with a frozen reference model: DPOTrainer + DDP's numbers."""
    for rank, failures in enumerate(run_ranks(_parity, 2, str(tmp_path), "dpo", stage, timeout=400)):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def _grpo(rank, world_size, tmp, stage):
    """Constructs GRPOTrainer with ShardedTrainer mixed in at the given stage: the error's text, or None."""
    _env(rank, world_size)
    tokenizer = char_tokenizer()
    args = _config(trl.GRPOConfig, f"{tmp}/grpo", per_device_train_batch_size=2, gradient_accumulation_steps=1,
                   num_generations=2, max_completion_length=8, max_length=None)
    prompts = Dataset.from_list([{"prompt": s} for s in _lines(8, 6)])
    try:
        sharded(trl.GRPOTrainer)(model=tiny_llama(tokenizer), reward_funcs=lambda completions, **kw: [0.0] * len(
            completions), args=args, train_dataset=prompts, processing_class=tokenizer,
            shardopt_kwargs={"stage": stage})
    except ValueError as e:
        return str(e)
    return None


def test_grpo_at_stage_3_is_refused_at_construction(tmp_path):
    """Rollouts of different lengths per rank have the ranks gather different numbers of times; no generating
    trainer has been run at stage 3 yet, so it is refused by name at construction, before any collective, naming what works (Note [Trainers that generate
    during training]); at stage 2 it is not refused."""
    for error in run_ranks(_grpo, 2, str(tmp_path), 3, timeout=120):
        assert error and "GRPOTrainer" in error and "stage 1 or 2" in error and "generates rollouts" in error, error
    assert run_ranks(_grpo, 2, str(tmp_path), 2, timeout=120) == [None, None]
