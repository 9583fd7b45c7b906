"""TRL's trainers with shardopt: `class ShardedSFT(ShardedTrainer, SFTTrainer)` (and DPO's, GRPO's and RLOO's
likewise) against the same TRL trainer under DDP, at 2 gloo ranks (docs/integrations.md, "TRL").

A small LlamaForCausalLM built from a config (no download, no dropout), a character-level tokenizer and
datasets made in memory from a seeded generator's code-like text. Each sharded run (a ShardedOptimizer
through ShardedDDP: one reduce-scatter per bucket per step, the optimizer's own clipping) is compared with
the same TRL trainer under DDP replaying it (Note [DDP replaying the sharded run] in test_hf_trainer.py):
its logged losses, learning rates and final weights bit for bit those of DDP clipping by the
sharded run's norms, and those norms within 1e-5 of torch's of the same gradients at every step.
"""
import contextlib
import copy
import os
import random

import pytest
import torch

from test_hf_trainer import _clipping_active, _env, _is_sharded, _norms, _replayed, train_observed

import transformers  # noqa: E402  (the [test] extra installs it)
import trl  # noqa: E402  (a test dependency: setup.py's `test` extra; missing, this file fails)
from datasets import Dataset  # noqa: E402  (trl's own dependency)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGE3 = {"stage": 3, "reduce_bucket_size": 2000, "param_persistence_threshold": 100}
STEPS = 4   # of every training here (max_steps)


def _corpus() -> str:
    """Fixed text made here: code-like lines from a seeded generator (it was shardopt/*.py read from disk, so
    every edit of those files changed the data, and with it whether a fixed 1e-5 bar held against plain DDP:
    Note [DDP replaying the sharded run] in test_hf_trainer.py). Seeds 0-5 each pass on TRL 1.0.0 and 1.16.0."""
    rng = random.Random(3)
    words = ["shard", "bucket", "gather", "rank", "step", "grad", "param", "stage", "loss", "adam", "scale",
             "chunk", "world", "model", "layer", "token", "norm", "clip", "mean", "sum", "view", "copy"]
    lines = []
    for _ in range(400):
        a, b, c = rng.choice(words), rng.choice(words), rng.choice(words)
        lines.append(rng.choice([f"{a}_{b} = {c}({a}, {rng.randint(0, 99)})", f"if {a} > {b}: return {c}",
                                 f"for {a} in {b}.{c}():", f"{a}.{b}_({c}[{rng.randint(0, 9)}:])"]))
    return "\n".join(lines)


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
                per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=3e-3,
                weight_decay=0.1, warmup_steps=1, lr_scheduler_type="linear", max_grad_norm=0.5,
                ddp_find_unused_parameters=False, disable_tqdm=True, dataloader_num_workers=0, max_length=32)
    base.update(kw)
    return cls(**{k: v for k, v in base.items() if v is not None})  # None: not an argument of this config


def sharded(trainer_cls):
    """ShardedTrainer's behaviour on any Trainer subclass: the class a user writes in one line."""
    from shardopt.integrations.transformers import ShardedTrainer

    return type(f"Sharded{trainer_cls.__name__}", (ShardedTrainer, trainer_cls), {})


def _fit(trainer, model, is_sharded, replay=None):
    """Train; (logs, final weights, trainer). replay: the grad norms a sharded run logged, for DDP replaying
    it (Note [DDP replaying the sharded run]; torch's own norms then in trainer.torch_norms)."""
    train_observed(trainer, replay)
    logs = [{k: v for k, v in e.items() if k in ("loss", "grad_norm", "learning_rate", "step")}
            for e in trainer.state.log_history if "loss" in e]
    with trainer._sharded()[1].full_params(writeback=False) if is_sharded else contextlib.nullcontext():
        weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return logs, weights, trainer


def _train(kind, out, shardopt_kwargs=None, ref_by_trl=False, replay=None):
    """One TRL trainer from the seed, plain (DDP) or, given shardopt_kwargs, sharded: _fit's (logs, weights, trainer).
    ref_by_trl (DPO): no ref_model=, TRL builds it from the policy's folder (the initial weights, saved here).
    replay: DDP clipping by these norms, a sharded run's (Note [DDP replaying the sharded run])."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    tokenizer = char_tokenizer()
    model = tiny_llama(tokenizer)
    if kind == "sft":
        cls, kw = trl.SFTTrainer, dict(train_dataset=sft_dataset())
        args = _config(trl.SFTConfig, out)
    else:
        # The frozen reference model: a copy of the initial policy (at stage 3 ShardedTrainer shards it: Note
        # [The reference model at stage 3]).
        cls, kw = trl.DPOTrainer, dict(train_dataset=dpo_dataset(), ref_model=copy.deepcopy(model))
        if ref_by_trl:
            folder = f"{out}-initial"
            if torch.distributed.get_rank() == 0:  # (transformers writes config.json on rank 0 only)
                model.save_pretrained(folder)
            torch.distributed.barrier()
            model.config._name_or_path = folder  # where TRL's DPOTrainer loads the reference model from
            del kw["ref_model"]
        args = _config(trl.DPOConfig, out, beta=0.5, learning_rate=1e-3)
    if shardopt_kwargs is not None:
        cls, kw = sharded(cls), dict(kw, shardopt_kwargs=shardopt_kwargs)
    trainer = cls(model=model, args=args, processing_class=tokenizer, **kw)
    return _fit(trainer, model, shardopt_kwargs is not None, replay)


def _reference_model(trainer, stage, world_size, what):
    """DPO's reference model after training (Note [The reference model at stage 3]): at stage 3 sharded for
    inference, each rank holding about 1/world_size of its parameters' bytes between forwards; whole below.
    Returns (failures, the bytes held on this rank and the whole model's)."""
    from shardopt import ShardedInference

    ref = trainer.ref_model
    if stage < 3:
        whole = isinstance(ref, torch.nn.Module) and not isinstance(ref, ShardedInference)
        return ([] if whole else [f"{what}: reference model {type(ref).__name__}, not whole"]), {}
    if not isinstance(ref, ShardedInference):
        return [f"{what}: reference model {type(ref).__name__}, not sharded"], {}
    # Every storage its parameters point at between forwards (the persistent ones: norms), and its chunks.
    storages = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in ref.module.parameters()}
    stats = ref.memory_stats()
    facts = {"held": sum(storages.values()) + stats["shard"], "whole": stats["whole"],
             "peak_gathered": stats["peak_gathered"]}
    if facts["held"] > 1.05 * facts["whole"] / world_size:
        return [f"{what}: the reference model holds {facts['held']} bytes on this rank of {facts['whole']}"], facts
    return [], facts


def _replay_facts(replay, what):
    """What makes DDP's replay a test: every step logged, and torch's own norms above the clip at some step."""
    steps = [] if len(replay[0]) == STEPS else [f"{what}: {len(replay[0])} logged steps"]
    return steps + _clipping_active(replay, what)


def _parity(rank, world_size, tmp, kind, stages):
    """The sharded trainer at each stage against DDP replaying it (Note [DDP replaying the sharded run]), in
    one launch (the ranks import TRL once); a stage given as "3-trl": DPO at stage 3 with the reference model
    TRL builds itself. Returns (failures, facts about DPO's reference model per stage)."""
    _env(rank, world_size)
    failures, facts = [], {}
    for name in stages:
        stage, by_trl, what = int(str(name)[0]), name == "3-trl", f"{kind} stage {name}"
        ours = _train(kind, f"{tmp}/{kind}-{name}", {**STAGE3, "stage": stage}, ref_by_trl=by_trl)
        replay = _train(kind, f"{tmp}/{kind}-{name}-ddp", ref_by_trl=by_trl, replay=_norms(ours))
        failures += _replayed(ours, replay, 1e-5, what) + _replay_facts(replay, what)
        failures += _is_sharded(ours[2], what)
        if ours[2]._sharded()[1].config.stage != stage:
            failures.append(f"{what}: trained at stage {ours[2]._sharded()[1].config.stage}")
        if kind == "dpo":
            more, facts[name] = _reference_model(ours[2], stage, world_size, what)
            failures += more
    return failures, facts


def test_sft_matches_sft_trainer_with_ddp(launches):
    """ShardedTrainer mixed into SFTTrainer (prompt-completion data, completion-only loss) at stages 1, 2 and 3:
    SFTTrainer + DDP's numbers (DDP replaying each run: Note [DDP replaying the sharded run])."""
    for rank, (failures, _) in enumerate(launches.results("sft")):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def _sft_save_and_resume(rank, world_size, tmp):
    """Stage 3 SFT for 4 steps saving checkpoints at 2 and 4, then save_model(); then a new trainer resumed
    from checkpoint-2 to step 4. Returns what rank 0 checks."""
    from accelerate.state import AcceleratorState

    _env(rank, world_size)
    tokenizer = char_tokenizer()

    def trainer(out, other_start=False):
        AcceleratorState._reset_state()
        model = tiny_llama(tokenizer)
        if other_start:  # only the checkpoint's weights (and Adam state) can bring it back on course
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05)
        args = _config(trl.SFTConfig, out, save_strategy="steps", save_steps=2)
        return sharded(trl.SFTTrainer)(model=model, args=args, processing_class=tokenizer,
                                       train_dataset=sft_dataset(), shardopt_kwargs=STAGE3), model

    first, model = trainer(f"{tmp}/run")
    logs, weights, _ = _fit(first, model, True)
    first.save_model(f"{tmp}/saved")  # every rank calls it; rank 0 writes whole weights
    again, model = trainer(f"{tmp}/run", other_start=True)
    again.train(resume_from_checkpoint=f"{tmp}/run/checkpoint-2")
    resumed = [{k: v for k, v in e.items() if k in ("loss", "grad_norm", "learning_rate", "step")}
               for e in again.state.log_history if "loss" in e]
    with again._sharded()[1].full_params(writeback=False):
        resumed_weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return logs, weights, resumed, resumed_weights, sorted(os.listdir(f"{tmp}/run"))


def test_sft_save_model_and_resume_at_stage_3(launches):
    """The sharded SFTTrainer at stage 3: save_model() writes whole weights that transformers loads (equal to
    the trained ones), and a run resumed from its step-2 checkpoint ends as the uninterrupted run did."""
    logs, weights, resumed, resumed_weights, kept = launches.results("sft_save_and_resume")[0]
    tmp_path = launches.root / "sft_save_and_resume"
    assert [f for f in kept if f.startswith("checkpoint-")] == ["checkpoint-2", "checkpoint-4"], kept
    saved = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "saved"))
    for n, p in saved.named_parameters():
        assert torch.equal(p, weights[n]), n
    resumed = [e for e in resumed if e["step"] > 2]  # (the log history holds the checkpoint's steps too)
    assert [e["step"] for e in resumed] == [3, 4], resumed
    for a, b in zip(logs[2:], resumed):
        assert a["step"] == b["step"] and abs(a["loss"] - b["loss"]) <= 1e-5 * max(1, abs(a["loss"])), (a, b)
    assert all(torch.allclose(weights[n], resumed_weights[n], rtol=1e-5, atol=1e-6) for n in weights)


def test_dpo_matches_dpo_trainer_with_ddp(launches):
    """ShardedTrainer mixed into DPOTrainer with a frozen reference model at stages 2 and 3: DPOTrainer + DDP's
    numbers. At stage 3 the reference model is sharded for inference too (Note [The reference model at stage 3]),
    passed as ref_model= or built by TRL from the policy's folder: each rank holds about half of its parameters'
    bytes between forwards; at stage 2 it is whole."""
    ranks = launches.results("dpo")
    for rank, (failures, facts) in enumerate(ranks):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)
        assert facts[3]["held"] > 0 and facts["3-trl"] == facts[3], facts
    print(f"\nDPO's reference model at stage 3, bytes per rank: {[facts[3] for _, facts in ranks]}")


def _reward(completions, **kw):
    """Longer completions and more of some characters score higher: the groups' rewards differ."""
    return [float(len(c)) + sum(ch in "aeiouy_" for ch in c) for c in completions]


# What the rollouts of each step were, as TRL logs them: the same sampled completions give the same values.
ROLLOUTS = ("completions/mean_length", "completions/min_length", "completions/max_length", "reward", "reward_std")


def _generate_and_train(kind, out, is_sharded=False, replay=None):
    """GRPOTrainer or RLOOTrainer from the seed: _fit's (logs, weights, trainer), the rollouts' statistics per
    logged step, and how many forwards without gradients ran on this rank."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    tokenizer = char_tokenizer()
    model = tiny_llama(tokenizer)
    # A quarter of the vocabulary ends a completion (the model is untrained: near uniform), so
    # rollouts end after 1 to 12 tokens and each rank's longest differs from the other's. TRL 1.16
    # masks after the model's eos ids, older TRL after the tokenizer's: generation stops on them in both.
    stops = [tokenizer.eos_token_id, *range(0, len(tokenizer) - 3, 4)]
    model.generation_config.eos_token_id = stops
    args = _config(getattr(trl, f"{kind}Config"), out, per_device_train_batch_size=4, num_generations=4,
                   max_completion_length=12, max_length=None, beta=0.0, generation_kwargs={"eos_token_id": stops})
    cls = getattr(trl, f"{kind}Trainer")
    extra = dict(shardopt_kwargs=STAGE3) if is_sharded else {}
    trainer = (sharded(cls) if is_sharded else cls)(
        model=model, reward_funcs=_reward, args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"prompt": s} for s in _lines(32, 6)]), **extra)
    count = [0]
    model.register_forward_pre_hook(lambda m, a: count.__setitem__(0, count[0] + (not torch.is_grad_enabled())))
    fit = _fit(trainer, model, is_sharded, replay)
    rollouts = [{k: e.get(k) for k in ROLLOUTS} for e in trainer.state.log_history if "loss" in e]
    return fit, rollouts, count[0]


def _generating(rank, world_size, tmp):
    """GRPOTrainer and RLOOTrainer at stage 3 against DDP replaying them (Note [DDP replaying the sharded run]):
    (kind, failures, DDP's no-grad forwards on this rank) each."""
    _env(rank, world_size)
    results = []
    for kind in ("GRPO", "RLOO"):
        what = f"{kind} stage 3"
        ours, rollouts, _ = _generate_and_train(kind, f"{tmp}/{kind}-sharded", is_sharded=True)
        ref, ref_rollouts, looks = _generate_and_train(kind, f"{tmp}/{kind}-ddp", replay=_norms(ours))
        failures = _replayed(ours, ref, 1e-5, what) + _replay_facts(ref, what)
        failures += _is_sharded(ours[2], what)
        # The same completions sampled: their lengths and rewards exactly DDP's (and logged: else nothing is checked).
        if rollouts != ref_rollouts or any(v is None for e in ref_rollouts for v in e.values()):
            failures.append(f"{what}: rollouts {rollouts}, under DDP {ref_rollouts}")
        if ours[2]._sharded()[1].config.stage != 3:
            failures.append(f"{kind}: trained at stage {ours[2]._sharded()[1].config.stage}")
        results.append((kind, failures, looks))
    return results


def test_generating_trainers_at_stage_3_match_ddp(launches):
    """GRPOTrainer and RLOOTrainer generate rollouts of different lengths on each rank before every step; at stage
    3 generate() runs synced (Note [Trainers that generate during training]) and the numbers are DDP's: the same
    sampled completions (their lengths and rewards as logged), losses and final weights as DDP's
    replaying the run, bit for bit, and grad norms within 1e-5 of torch's (Note [DDP replaying the sharded run])."""
    ranks = launches.results("generating")
    for rank, results in enumerate(ranks):
        for kind, failures, _ in results:
            assert not failures, f"rank {rank}:\n" + "\n".join(failures)
    for (kind, _, looks0), (_, _, looks1) in zip(*ranks):
        # Under DDP each rank generates until its own rollouts end: the lengths did differ per rank.
        assert looks0 != looks1, f"{kind}: both ranks ran {looks0} forwards without gradients under DDP"


def test_untested_generating_trainers_are_refused_at_stage_3():
    """The trainers that generate and have not been run at stage 3 are refused there by name at construction,
    naming what works; not at stage 2, nor on one process (matched by class name: no TRL needed)."""
    from types import SimpleNamespace

    from shardopt.integrations.transformers import ShardedTrainer

    def check(name, stage, world_size):
        stub = type(name, (), {"_stage": lambda self: stage, "args": SimpleNamespace(world_size=world_size)})()
        ShardedTrainer._check_generation_in_training(stub)

    with pytest.raises(ValueError, match=r"cannot train PPOTrainer on 2 processes.*GRPOTrainer.*stage 1 or 2"):
        check("PPOTrainer", 3, 2)
    check("PPOTrainer", 2, 2)
    check("PPOTrainer", 3, 1)
    check("GRPOTrainer", 3, 2)


def test_sync_ref_model_is_refused_at_stage_3():
    """TRL's sync_ref_model edits the reference weights in place, which at stage 3 are sharded (Note [The reference
    model at stage 3]): refused there at construction, naming the way out; not at stage 2, nor without a reference
    model (PEFT)."""
    from types import SimpleNamespace

    from shardopt.integrations.transformers import ShardedTrainer

    def check(stage, sync, ref):
        stub = type("DPO", (), {"_stage": lambda self: stage, "args": SimpleNamespace(sync_ref_model=sync),
                                "ref_model": ref})()
        ShardedTrainer._check_reference_model(stub)

    with pytest.raises(ValueError, match=r"sync_ref_model=True.*sync_ref_model=False, or stage 1 or 2"):
        check(3, True, torch.nn.Linear(2, 2))
    check(2, True, torch.nn.Linear(2, 2))
    check(3, False, torch.nn.Linear(2, 2))
    check(3, True, None)


def test_generate_is_synced_only_while_the_parameters_are_sharded():
    """What ShardedTrainer gives a stage-3 model's generate() (Note [Trainers that generate during training]):
    synced_gpus=True by default while its optimizer shards the parameters, an explicit value kept, and the
    model's own generate() once the optimizer has let go (detach()) or is gone, so a rank may generate alone."""
    import gc
    from types import SimpleNamespace

    from shardopt.integrations.transformers import _synced_generate

    class Model(torch.nn.Module):
        def generate(self, **kwargs):
            return kwargs

    class Optimizer:
        params_sharded, view = True, SimpleNamespace(attached=True)

    model, opt = Model(), Optimizer()
    _synced_generate(model, opt)
    assert model.generate() == {"synced_gpus": True}
    assert model.generate(synced_gpus=False) == {"synced_gpus": False}
    opt.view = SimpleNamespace(attached=False)
    assert model.generate() == {}
    again = Optimizer()
    _synced_generate(model, again)  # a later wrap of the same model: its optimizer decides
    assert model.generate() == {"synced_gpus": True}
    del again
    gc.collect()
    assert model.generate() == {}


# ------------------------------------------------------------ the launches
# Note [Several cases in one launch] (tests/dist_harness.py): the 2-rank cases of this file run in one launch
# (the ranks import TRL, transformers and accelerate once, not four times), each in its own folder; each test
# asserts its own case, and a case that raised fails its test only, naming the case and the rank's traceback.
@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    from dist_harness import SharedLaunch

    r = tmp_path_factory.mktemp("trl")

    def cases():
        for d in ("sft", "sft_save_and_resume", "dpo", "generating"):
            (r / d).mkdir()   # as each test's tmp_path was
        return {
            "sft": (_parity, (str(r / "sft"), "sft", (1, 2, 3))),
            "sft_save_and_resume": (_sft_save_and_resume, (str(r / "sft_save_and_resume"),)),
            "dpo": (_parity, (str(r / "dpo"), "dpo", (2, 3, "3-trl"))),
            "generating": (_generating, (str(r / "generating"),)),
        }

    return SharedLaunch(2, cases, timeout=850, root=r)
