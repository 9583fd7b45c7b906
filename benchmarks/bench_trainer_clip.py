"""The HF Trainer's step at many parameter tensors: Trainer + DDP against ShardedTrainer, whose clipping is the
optimizer's own (Note [The Trainer's clipping is the optimizer's] in shardopt/integrations/transformers.py),
and against ShardedTrainer with accelerate's clip_grad_norm_ put back (torch's clip over the sharded p.grad,
what it ran before).

    python benchmarks/bench_trainer_clip.py                    # 500 and 8000 tensors, 3 rounds, 2 ranks
    python benchmarks/bench_trainer_clip.py --out benchmarks/results/$(date +%F)-trainer-clip.md

The model is bench_idioms.py's MLP of many small layers (N/2 Linear(16, 16) + tanh, N parameter tensors) with
an MSE loss, so the per-tensor cost of the Trainer's lines is what there is to see. Each launch trains one
mode for --steps steps (2 gloo ranks, AdamW, max_grad_norm=1.0, the same seed and data); the modes take
turns inside each round, and the report gives each mode's median step (slowest rank, the first 3 steps
dropped) over rounds, and the per-round ratios to DDP's and to the same Trainer with torch's clip: median and
range.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_idioms import WIDTH, ManyLayers  # noqa: E402
from shardopt.cluster.ranks import run_ranks  # noqa: E402

MODES = {"ddp": "Trainer + DDP (torch's clip)", "shardopt": "ShardedTrainer (the optimizer's clip)",
         "torch-clip": "ShardedTrainer, accelerate's clip put back (torch's clip)"}
DROP = 3


class ManyLayersLM(ManyLayers):
    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(super().forward(x), labels)}


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def _fit(rank, world_size, mode, tensors, steps):
    import transformers
    from accelerate.state import AcceleratorState

    from shardopt.integrations.transformers import ShardedTrainer

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    AcceleratorState._reset_state()
    times = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

    torch.manual_seed(0)
    model = ManyLayersLM(tensors)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, report_to="none", use_cpu=True, seed=0, max_steps=steps, logging_steps=steps,
            save_strategy="no", per_device_train_batch_size=8, learning_rate=1e-3, weight_decay=0.1,
            max_grad_norm=1.0, optim="adamw_torch", ddp_find_unused_parameters=False, disable_tqdm=True,
            dataloader_num_workers=0)
        cls = transformers.Trainer if mode == "ddp" else ShardedTrainer
        trainer = cls(model=model, args=args, train_dataset=Rows(8 * world_size * steps),
                      callbacks=[StepTimer()])
        if mode == "torch-clip":
            acc = trainer.accelerator
            acc.clip_grad_norm_ = acc.clip_grad_norm_.__wrapped__
        trainer.train()
    loss = next(e["train_loss"] for e in trainer.state.log_history if "train_loss" in e)
    return dict(step=statistics.median(times[DROP:]), loss=loss)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", default="500,8000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", help="write the markdown report here")
    a = ap.parse_args()
    sizes = [int(n) for n in a.tensors.split(",")]
    load = os.getloadavg()[0]
    step = {(n, m): [] for n in sizes for m in MODES}
    loss = {}
    for r in range(a.rounds):
        for n in sizes:
            for m in MODES:
                per_rank = run_ranks(_fit, 2, m, n, a.steps, timeout=1800)
                step[n, m].append(max(p["step"] for p in per_rank))
                loss[n, m] = per_rank[0]["loss"]
                print(f"round {r}, {n} tensors, {m}: {1000 * step[n, m][-1]:.1f} ms", flush=True)
    lines = [f"`python benchmarks/bench_trainer_clip.py --tensors {a.tensors} --rounds {a.rounds} --steps {a.steps}`, "
             f"{datetime.date.today().isoformat()}. Machine: {platform.machine()}, {os.cpu_count()} cores, load "
             f"average at start {load:.1f}, torch {torch.__version__}, 2 gloo ranks on 127.0.0.1.", "",
             "| tensors | mode | median step ms | / DDP, median of rounds (range) | / torch's clip in ShardedTrainer "
             "| training loss |",
             "|---|---|---|---|---|---|"]

    def ratio(n, m, base):
        r = [s / b for s, b in zip(step[n, m], step[n, base])]
        return f"{statistics.median(r):.3f} ({min(r):.2f}-{max(r):.2f})"

    for n in sizes:
        for m, name in MODES.items():
            lines.append(f"| {n} | {name} | {1000 * statistics.median(step[n, m]):.1f} | {ratio(n, m, 'ddp')} | "
                         f"{ratio(n, m, 'torch-clip') if m != 'ddp' else '-'} | {loss[n, m]:.6f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
