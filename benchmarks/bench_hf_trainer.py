"""Hugging Face Trainer: ShardedTrainer vs Trainer + DDP vs Trainer --deepspeed (ZeRO-2), one run, interleaved.

    python benchmarks/bench_hf_trainer.py --rounds 2 --out benchmarks/results/$(date +%F)-hf-trainer.md

Each round runs examples/hf_trainer_gpt2.py once per mode under torchrun (2
processes, the same model, data, seed and steps), in turns, so that a noisy
neighbour hits every mode alike; the report gives each mode's median step time
over rounds, its ratio to DDP's in the same round, the final loss, and the
peak resident memory per rank (ru_maxrss, with MALLOC_MMAP_THRESHOLD_=65536 so
that freed gradient-sized blocks go back to the OS instead of staying in glibc's
heap: without it the peak mostly measures the allocator).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "hf_trainer_gpt2.py")
MODES = ("ddp", "shardopt", "deepspeed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(mode: str, a) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.procs),
           "--master-port", str(_free_port()), EXAMPLE, "--mode", mode, "--steps", str(a.steps),
           "--embd", str(a.embd), "--layers", str(a.layers), "--batch", str(a.batch), "--seq", str(a.seq),
           "--out", f"/tmp/bench_hf_trainer_{mode}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith('{"mode"')]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--embd", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--out", help="write the markdown report here")
    a = ap.parse_args()

    rows = []
    for r in range(a.rounds):
        for mode in MODES:
            res = run_mode(mode, a)
            res["round"] = r
            rows.append(res)
            print(json.dumps(res), flush=True)
    ddp = {r["round"]: r["median_step_s"] for r in rows if r["mode"] == "ddp"}
    lines = [f"# Hugging Face Trainer: ShardedTrainer vs Trainer + DDP vs Trainer --deepspeed ({datetime.date.today()})",
             "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch CPU, gloo, {a.procs} processes "
             f"(torchrun), OMP_NUM_THREADS=1. GPT-2 from GPT2Config (n_embd {a.embd}, {a.layers} layers, "
             f"vocab 256, {rows[0]['params_M']}M parameters), batch {a.batch}x{a.seq} per process, AdamW, "
             f"clipping 1.0, linear warmup, fp32, {a.steps} steps; `examples/hf_trainer_gpt2.py --mode MODE`, "
             f"modes in turns, {a.rounds} rounds. Step time: median over steps 3.. of each run; ratio: to "
             "DDP's in the same round. Peak RSS: ru_maxrss per rank with MALLOC_MMAP_THRESHOLD_=65536.",
             "", "| round | mode | median step (s) | x DDP | final loss | peak RSS per rank (MiB) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['round']} | {r['mode']} | {r['median_step_s']:.3f} | "
                     f"{r['median_step_s'] / ddp[r['round']]:.2f} | {r['final_loss']:.4f} | "
                     f"{', '.join(f'{x:.0f}' for x in r['peak_rss_MiB_per_rank'])} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if a.out:
        with open(a.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
