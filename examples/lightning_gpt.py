"""Train shardopt's small GPT with PyTorch Lightning and `Trainer(strategy="shardopt")`.

    python examples/lightning_gpt.py --devices 2                    # 2 CPU processes, ZeRO-2, fp32
    python examples/lightning_gpt.py --devices 2 --precision bf16-mixed --stage 1
    python examples/lightning_gpt.py --devices 2 --out ckpt/        # saves ckpt/last.ckpt (a directory)
    python examples/lightning_gpt.py --devices 1 --resume ckpt/last.ckpt --max-steps 40

Lightning starts the other processes itself (it re-runs this script with
LOCAL_RANK set), so run it with plain `python`; under torchrun it uses the
processes torchrun made. Needs `pip install 'shardopt[lightning]'`.
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl

import shardopt.integrations.lightning  # noqa: F401  (registers strategy="shardopt" with Lightning)
from shardopt.tools.gpt import GPT, PRESETS


class Sequences(Dataset):
    """Token sequences with learnable structure (next token = a fixed function of the current one)."""

    def __init__(self, vocab: int, seq: int, size: int):
        self.vocab, self.seq, self.size = vocab, seq, size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        start = torch.randint(0, self.vocab, (1,), generator=torch.Generator().manual_seed(i))
        idx = (start * 31 + 7 * torch.arange(self.seq + 1)) % self.vocab
        return idx[:-1], idx[1:]


class LitGPT(pl.LightningModule):
    def __init__(self, preset: str, lr: float, warmup: int, max_steps: int):
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(PRESETS[preset])

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        # Any elementwise torch optimizer; the strategy shards it, groups and scheduler included.
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=self.hparams.lr)
        h = self.hparams

        def schedule(step):  # linear warmup, cosine decay
            if step < h.warmup:
                return (step + 1) / h.warmup
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - h.warmup) / max(1, h.max_steps - h.warmup))))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--precision", default="32-true", help="32-true, bf16-mixed or 16-mixed")
    ap.add_argument("--stage", type=int, default=2, choices=(1, 2))
    ap.add_argument("--batch", type=int, default=8, help="sequences per device and micro-batch")
    ap.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=1.0, help="gradient_clip_val (global norm over all shards)")
    ap.add_argument("--out", default=None, help="directory for last.ckpt (a sharded checkpoint directory)")
    ap.add_argument("--resume", default=None, help="checkpoint to continue from (any --devices)")
    args = ap.parse_args()

    pl.seed_everything(0)
    cfg = PRESETS[args.preset]
    # The registered names; ShardedStrategy(stage=..., reduce_bucket_size=...) takes every option.
    strategy = "shardopt" if args.stage == 2 else "shardopt_stage_1"
    callbacks = []
    if args.out:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.out, save_last=True, save_top_k=0,
                                                      every_n_train_steps=max(1, args.max_steps // 2)))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, precision=args.precision,
                         max_steps=args.max_steps, accumulate_grad_batches=args.accumulate,
                         gradient_clip_val=args.clip, logger=False, enable_checkpointing=bool(args.out),
                         callbacks=callbacks, enable_model_summary=False, enable_progress_bar=False)
    model = LitGPT(args.preset, args.lr, warmup=max(1, args.max_steps // 10), max_steps=args.max_steps)
    size = args.batch * args.devices * args.accumulate * args.max_steps
    loader = DataLoader(Sequences(cfg.vocab, cfg.seq, size), batch_size=args.batch)
    trainer.fit(model, loader, ckpt_path=args.resume)
    loss = trainer.callback_metrics["loss"].item()
    if trainer.is_global_zero:
        print(f"steps {trainer.global_step}, devices {args.devices}, {args.precision}")
        print(f"final loss {loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
