"""Fine-tune a small GPT-2 with the Hugging Face Trainer: ZeRO-2 from shardopt, or plain DDP, or DeepSpeed.

    torchrun --nproc-per-node 2 examples/hf_trainer_gpt2.py --mode shardopt      # ShardedTrainer, ZeRO-2
    torchrun --nproc-per-node 2 examples/hf_trainer_gpt2.py --mode ddp           # transformers.Trainer + DDP
    torchrun --nproc-per-node 2 examples/hf_trainer_gpt2.py --mode deepspeed     # Trainer --deepspeed ZeRO-2
    torchrun --nproc-per-node 2 examples/hf_trainer_gpt2.py --mode shardopt --config ds_config.json --bf16

The model is built from a GPT2Config (no download) and the text is this
repository's own Python sources, byte-level (vocabulary 256), so the script
runs offline. The change from a Trainer script is two lines: import
ShardedTrainer, and construct it instead of Trainer (with the DeepSpeed config,
if you have one, as shardopt_config=). Rank 0 prints the final loss, the
median step time and the peak resident memory of every rank.
Needs `pip install 'shardopt[transformers]'` (and deepspeed for --mode deepspeed).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import transformers

from shardopt.integrations.transformers import ShardedTrainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The ZeRO-2 config of the Trainer's DeepSpeed docs ("auto" is filled from TrainingArguments).
ZERO2 = {
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": "auto", "allgather_bucket_size": 5e8},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


class SourceText(torch.utils.data.Dataset):
    """Byte-level windows over this repository's Python sources."""

    def __init__(self, seq: int):
        files = sorted(glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True))
        data = b"".join(open(f, "rb").read() for f in files if ".venv" not in os.path.relpath(f, ROOT))
        ids = torch.tensor(list(data), dtype=torch.long)
        n = len(ids) // seq
        self.rows = ids[: n * seq].view(n, seq)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class StepTimer(transformers.TrainerCallback):
    def __init__(self):
        self.times, self._t = [], None

    def on_step_begin(self, args, state, control, **kw):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self._t)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("shardopt", "ddp", "deepspeed"), default="shardopt")
    ap.add_argument("--config", help="DeepSpeed-format JSON (default: the docs' ZeRO-2 config)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4, help="per process")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--embd", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--out", default="/tmp/hf_trainer_gpt2")
    a = ap.parse_args()

    config = json.load(open(a.config)) if a.config else ZERO2
    args = transformers.TrainingArguments(
        output_dir=a.out, report_to="none", use_cpu=True, seed=0, max_steps=a.steps, learning_rate=1e-3,
        warmup_steps=max(1, a.steps // 10), weight_decay=0.1, max_grad_norm=1.0, per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=1, logging_steps=max(1, a.steps // 10), save_strategy="no", bf16=a.bf16,
        disable_tqdm=True, deepspeed=config if a.mode == "deepspeed" else None)
    torch.manual_seed(0)
    # Byte-level: 256 tokens. GPT2Config's bos/eos ids (50256) are outside that vocabulary; byte 0, which
    # source text never holds, stands in for both.
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_positions=a.seq, n_embd=a.embd, n_layer=a.layers, n_head=max(1, a.embd // 64),
        bos_token_id=0, eos_token_id=0))
    timer = StepTimer()
    kw = dict(model=model, args=args, train_dataset=SourceText(a.seq), callbacks=[timer])
    if a.mode == "shardopt":
        trainer = ShardedTrainer(**kw, shardopt_config=config)
    else:
        trainer = transformers.Trainer(**kw)
    result = trainer.train()
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])  # MiB
    if dist.is_initialized():
        every = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(every, rss)
        rss = torch.cat(every)
    if trainer.is_world_process_zero():
        steady = sorted(timer.times[2:]) or timer.times
        print(json.dumps({"mode": a.mode, "params_M": round(model.num_parameters() / 1e6, 2),
                          "final_loss": round(result.training_loss, 4),
                          "last_logged_loss": [e["loss"] for e in trainer.state.log_history if "loss" in e][-1],
                          "median_step_s": round(steady[len(steady) // 2], 4),
                          "peak_rss_MiB_per_rank": [round(x, 1) for x in rss.tolist()]}))


if __name__ == "__main__":
    main()
    # A gloo rank of torch 2.13 can abort at interpreter exit after its work is done (a gloo thread
    # dropping a tensor during shutdown, pytorch/pytorch#190489): leave without interpreter shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
