"""A rank SIGKILLed at a random moment of a background checkpoint save (issue 71), many times: `latest` must always
name a complete checkpoint, the previous one must load, and the next save must leave no partial folder.

Each trial: 2 ranks (stage 2, an MLP of --width x --width x --layers, AdamW) take 2 steps and save a checkpoint
blocking (the previous one), then save again with blocking=False; one rank, drawn at random, is SIGKILLed by a
timer at a moment drawn uniformly from [0, --window] seconds after the call (the write takes about that long;
the first trial measures it). The survivor waits for its save. Then a fresh launch at 1 rank checks: `latest`
names a folder whose manifest and every file's checksum verify, the checkpoint before loads, and a new save
leaves no `.partial-*` folder beside the checkpoints.

    python benchmarks/async_checkpoint_kills.py --trials 20 --out benchmarks/results/DATE-async-checkpoint-kills.md
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model(args):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])


def _trial(rank, world, args, path, victim, delay):
    import shardopt

    model = _model(args)
    opt = shardopt.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, stage=2)
    wrapper = shardopt.ShardedDDP(model, opt)
    for _ in range(2):
        wrapper(torch.randn(4, args.width)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    previous = shardopt.save_checkpoint(path, wrapper, opt)
    if rank == victim and delay is not None:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    t = time.perf_counter()
    try:
        handle = shardopt.save_checkpoint(path, wrapper, opt, blocking=False)  # the staging's collectives
    except Exception as e:  # noqa: BLE001 - a peer killed before the call returned
        outcome = f"the call raised {type(e).__name__}: {str(e)[:120]}"
    else:
        try:
            handle.result()
            outcome = "committed"
        except Exception as e:  # noqa: BLE001 - reported as it is (CheckpointError expected)
            outcome = f"result() raised {type(e).__name__}: {str(e)[:160]}"
    seconds = time.perf_counter() - t
    with open(f"{path}-rank{rank}.json", "w") as f:  # the survivor's word, whatever becomes of the launch
        json.dump({"outcome": outcome, "seconds": seconds}, f)
    return {"previous": previous, "outcome": outcome, "seconds": seconds}


def _check(rank, world, args, path, previous):
    import shardopt
    from shardopt.checkpoint.save_load import resolve_checkpoint_dir
    from shardopt.files import RecordReader, read_manifest

    latest = resolve_checkpoint_dir(path)
    body = read_manifest(latest)
    reader = RecordReader(latest, body["files"])
    for name in body["files"]:
        reader.verify_file(name)
    reader.close()
    model = _model(args)
    opt = shardopt.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, stage=2)
    wrapper = shardopt.ShardedDDP(model, opt)
    shardopt.load_checkpoint(previous, wrapper, opt)
    shardopt.save_checkpoint(path, wrapper, opt)
    return {"latest": os.path.basename(latest), "left": sorted(n for n in os.listdir(path) if n.startswith("."))}


def main():
    from shardopt.cluster.ranks import RankFailure, run_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rng = random.Random(args.seed)
    root = tempfile.mkdtemp(prefix="async-kills-")
    load = os.getloadavg()
    calibration = run_ranks(_trial, 2, args, os.path.join(root, "calibration"), 0, None, start_method="forkserver")
    window = max(r["seconds"] for r in calibration)
    lines = [f"load (uptime) at the start: {load}; the write took {window:.2f} s unkilled (calibration); "
             f"each trial kills one rank at a moment drawn from [0, {window:.2f}] s after the call", "",
             "| trial | victim | kill after (s) | survivor saw | latest | verifies | previous loads | "
             "partial folders after the next save |", "|---|---|---|---|---|---|---|---|"]
    bad = 0
    for trial in range(args.trials):
        path = os.path.join(root, f"trial-{trial}")
        victim, delay = rng.randrange(2), rng.uniform(0, window)
        try:
            run_ranks(_trial, 2, args, path, victim, delay, timeout=300, collective_timeout=30,
                      start_method="forkserver")
            killed = " (the kill came after the victim's end)"
        except RankFailure:
            killed = ""
        try:
            with open(f"{path}-rank{1 - victim}.json") as f:
                seen = json.load(f)["outcome"] + killed
        except OSError:
            seen = "no outcome: the survivor did not get past its save"
        previous = os.path.join(path, "ckpt-000001")
        try:
            check = run_ranks(_check, 1, args, path, previous, timeout=300, start_method="forkserver")[0]
            verdict = (check["latest"], "yes", "yes", check["left"] or "none")
            bad += bool(check["left"])
        except RankFailure as e:
            verdict = ("?", "NO", "?", str(e).splitlines()[-1][:120])
            bad += 1
        lines.append(f"| {trial} | {victim} | {delay:.2f} | {seen} | {' | '.join(map(str, verdict))} |")
        print(lines[-1], flush=True)
        shutil.rmtree(path, ignore_errors=True)
        for rank in range(2):
            if os.path.exists(f"{path}-rank{rank}.json"):
                os.unlink(f"{path}-rank{rank}.json")
    lines += ["", f"{args.trials - bad} of {args.trials} trials: latest complete, the previous checkpoint loaded, "
                  "no partial folder left after the next save"]
    shutil.rmtree(root, ignore_errors=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
