"""Does rounding stage 3's parameter gathers across nodes change training? Exact stage 3 against stage 3 with
its parameters (and gradients) crossing nodes in int8, on real text, several seeds.

The byte-level GPT and corpus of benchmarks/hop_loss_curve.py (this repository's own source, every 10th file
held out), 4 ranks over gloo on 127.0.0.1 grouped into 2 "nodes" of 2 (LOCAL_WORLD_SIZE=2), so stage 3's
collectives are node-aware (Note [Two-level collectives] in shardopt/parallel/mesh_plan.py): the runs
differ only in what crosses between the nodes (Note [Stage 3's parameters across nodes, rounded]). Per seed
the same initial weights (torch.manual_seed(seed)) and the same windows (Note [Same data for every run] in
hop_loss_curve.py). AdamW, gradients clipped at 1.0.

Writes benchmarks/results/<date>-stage3-param-loss.md: per seed and run the final loss (mean of the last 20
steps), the held-out loss, and their relative differences to exact stage 3 (pass: within 0.5%).

    python benchmarks/stage3_param_loss_curve.py --steps 1000 --seeds 0,1,2
    python benchmarks/stage3_param_loss_curve.py --steps 30 --seeds 0 --out-dir /tmp     # a quick look
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]

from hop_loss_curve import CLIP, CONFIG, LR, TAIL, WD, _git_head, read_corpus, train_and_evaluate  # noqa: E402
from shardopt.cluster.ranks import run_ranks  # noqa: E402
from shardopt.parallel.gathers import Route  # noqa: E402
from shardopt.tools.gpt import GPT, num_params  # noqa: E402

NODES, PER_NODE = 2, 2
# name -> (inter_node_param_dtype, inter_node_dtype); the first is the reference.
RUNS = {"stage 3 exact": (None, None),
        "stage 3, parameters and gradients across nodes in int8": ("int8", "int8")}
TOLERANCE = 0.005
# The corpus as committed here (hop_loss_curve.read_corpus's `at`), so that later runs read the same text.
CORPUS_AT = "9f4ad72"  # the text benchmarks/onebit_suite.py trains on too


def _train(rank, world_size, params_across, grads_across, train_bytes, held_bytes, steps, batch, seed):
    import shardopt

    train = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8)
    held = torch.frombuffer(bytearray(held_bytes), dtype=torch.uint8)
    torch.manual_seed(seed)
    model = GPT(CONFIG)
    os.environ["LOCAL_WORLD_SIZE"] = str(PER_NODE)
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=LR, weight_decay=WD,
                                    fused=True, stage=3, inter_node_param_dtype=params_across,
                                    inter_node_dtype=grads_across)
    if opt.sharding.nodes is None or opt.store.gather.route is not Route.TWO_LEVEL:
        raise RuntimeError(f"stage 3 is not node-aware here: {opt.sharding}")
    losses, ev, seconds = train_and_evaluate(rank, shardopt.ShardedDDP(model, opt), opt, train, held, steps,
                                             batch, seed)
    return dict(losses=(losses / world_size).tolist(), eval=ev.item() / world_size, seconds=seconds)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8, help="windows per rank per step")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out-dir", default=os.path.join(REPO, "benchmarks", "results"))
    args = ap.parse_args()
    if args.steps < TAIL:
        ap.error(f"--steps must be at least {TAIL} (the final loss averages the last {TAIL} steps)")
    date = datetime.date.today().isoformat()
    md = os.path.join(args.out_dir, f"{date}-stage3-param-loss.md")
    raw = os.path.join(args.out_dir, f"{date}-stage3-param-loss.json")
    load = os.getloadavg()[0]
    train, held, files = read_corpus(at=CORPUS_AT)
    params = num_params(GPT(CONFIG))
    print(f"corpus at {CORPUS_AT}: {len(files)} files, {len(train):,} training bytes, {len(held):,} held out; "
          f"model {params:,} parameters; load {load:.1f}", flush=True)
    results = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name, (p, g) in RUNS.items():
            t0 = time.time()
            per_rank = run_ranks(_train, NODES * PER_NODE, p, g, train, held, args.steps, args.batch, seed,
                                 timeout=4 * 3600, collective_timeout=600)
            r = per_rank[0]
            r.update(seconds=max(x["seconds"] for x in per_rank), wall=time.time() - t0,
                     final=sum(r["losses"][-TAIL:]) / TAIL)
            results[f"{seed}/{name}"] = r
            print(f"seed {seed} {name}: final {r['final']:.4f}, held-out {r['eval']:.4f}, train {r['seconds']:.0f} s, "
                  f"wall {r['wall']:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)
            with open(raw, "w") as f:  # as it goes: a long run stopped early keeps what it finished
                json.dump(results, f)
    lines = [f"# Stage 3's parameters across nodes in int8: loss curves — {date}", "",
             f"`python benchmarks/stage3_param_loss_curve.py --steps {args.steps} --batch {args.batch} --seeds "
             f"{args.seeds}` at commit {_git_head()}. Machine: {platform.machine()}, {os.cpu_count()} cores, load "
             f"average at start {load:.1f}, torch {torch.__version__}, gloo over 127.0.0.1, 1 thread per rank.", "",
             f"Model: byte-level GPT ({CONFIG}), {params:,} parameters. Data: this repository's source as of "
             f"{CORPUS_AT} ({len(files)} files, {len(train):,} training bytes, {len(held):,} held out), "
             f"{args.batch} windows of {CONFIG.seq} bytes per rank per step. 4 ranks as 2 nodes x 2 "
             f"(LOCAL_WORLD_SIZE=2): stage 3 node-aware, AdamW(lr={LR}, weight_decay={WD}, fused=True), "
             f"`clip_grad_norm({CLIP})`. Final = mean of the last {TAIL} steps' training loss (mean over ranks); "
             f"held-out after the last step; pass = both within {TOLERANCE:.1%} of exact stage 3's.", "",
             "| seed | run | final loss | vs exact | held-out loss | vs exact | pass | train s |",
             "|---|---|---|---|---|---|---|---|"]
    ref_name = next(iter(RUNS))
    for key, r in results.items():
        seed, name = key.split("/", 1)
        ref = results[f"{seed}/{ref_name}"]
        rel, erel = r["final"] / ref["final"] - 1, r["eval"] / ref["eval"] - 1
        ok = abs(rel) <= TOLERANCE and abs(erel) <= TOLERANCE
        lines.append(f"| {seed} | {name} | {r['final']:.4f} | {rel:+.3%} | {r['eval']:.4f} | {erel:+.3%} | "
                     f"{'pass' if ok else '**FAIL**'} | {r['seconds']:.0f} |")
    lines += ["", f"Per-step losses: `{os.path.basename(raw)}`.", ""]
    with open(md, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines[-len(results) - 4:]))
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
