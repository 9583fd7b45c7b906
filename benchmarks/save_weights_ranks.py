"""save_weights with every rank writing its own bytes vs rank 0 writing what the store gathers (issue 71): the
time of the call and the bytes each rank sends over TCP, at stage 3, interleaved in one run per world size.

The model is an MLP of --layers Linear(--width, --width) (12 x 2048: 50.4M parameters, 201 MB in fp32), sharded at
stage 3 with AdamW (one step taken). Contenders, each a save_weights of the whole model as a Hugging Face folder:
  own       every rank writes the bytes of its chunks into rank 0's files (Note [Every rank writes its own
            bytes] in shardopt/weights/stream.py): nothing gathered
  gathered  rank 0 writes everything as the store gathers it bucket by bucket (the path before, and still the
            path when the ranks do not share the destination): every rank gathers every bucket
--gather picks how stage 3 gathers: "gloo" (shared_memory_gather=False: the process group carries the chunks,
as between nodes) or "shared" (one host's shared memory: no bytes on the network, but the copies). Bytes sent
are each rank's TCP bytes acknowledged during the call (shardopt/cluster/traffic.py). The folders of the two
contenders are compared byte for byte once.

    python benchmarks/save_weights_ranks.py --world-sizes 2,4 --rounds 3 \
        --out benchmarks/results/DATE-save-weights-ranks.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _digest(folder: str) -> dict:
    out = {}
    for name in sorted(os.listdir(folder)):
        h = hashlib.sha256()
        with open(os.path.join(folder, name), "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
        out[name] = h.hexdigest()
    return out


def _rank(rank, world, args, root):
    import torch.distributed as dist

    import shardopt
    from shardopt.cluster.traffic import tcp_bytes_sent
    from shardopt.weights import stream

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    opt = shardopt.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, stage=3,
                                    shared_memory_gather=args.gather == "shared")
    wrapper = shardopt.ShardedDDP(model, opt)
    wrapper(torch.randn(4, args.width)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    shared = stream._shared_partial
    records, digests = [], {}
    for round_ in range(args.rounds):
        order = ["own", "gathered"] if round_ % 2 == 0 else ["gathered", "own"]
        for name in order:
            dest = os.path.join(root, f"{name}-{world}")
            stream._shared_partial = shared if name == "own" else (lambda m, writer: None)
            dist.barrier()
            sent, t = tcp_bytes_sent(), time.perf_counter()
            shardopt.save_weights(wrapper, dest, max_shard_size="100MB", config=False)
            seconds, sent = time.perf_counter() - t, tcp_bytes_sent() - sent
            stream._shared_partial = shared
            dist.barrier()
            if rank == 0 and round_ == 0:
                digests[name] = _digest(dest)
            records.append({"world": world, "rank": rank, "round": round_, "contender": name, "seconds": seconds,
                            "sent": sent})
            dist.barrier()
    if rank == 0:
        records.append({"same bytes": digests["own"] == digests["gathered"], "world": world,
                        "bytes": sum(os.path.getsize(os.path.join(root, f"own-{world}", n))
                                     for n in os.listdir(os.path.join(root, f"own-{world}")))})
    return records


def summarize(records: list, args, load) -> str:
    lines = [f"load (uptime) before/after: {load[0]} / {load[1]}; stage 3 gathers through {args.gather}", "",
             "| world size | contender | save_weights (median s, per round) | bytes sent per rank (median) | "
             "same bytes |", "|---|---|---|---|---|"]
    for world in sorted({r["world"] for r in records}):
        check = next(r for r in records if r["world"] == world and "same bytes" in r)
        for name in ("gathered", "own"):
            rs = [r for r in records if r.get("contender") == name and r["world"] == world]
            rounds = sorted({r["round"] for r in rs})
            per_round = [max(r["seconds"] for r in rs if r["round"] == k) for k in rounds]
            lines.append(f"| {world} | {name} | {statistics.median(per_round):.2f} "
                         f"({', '.join(f'{s:.2f}' for s in per_round)}) | "
                         f"{statistics.median(r['sent'] for r in rs) / 1e6:.3f} MB | {check['same bytes']} "
                         f"({check['bytes'] / 1e6:.0f} MB of files) |")
    return "\n".join(lines)


def main():
    from shardopt.cluster.ranks import run_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gather", choices=("gloo", "shared"), default="gloo")
    p.add_argument("--root", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    before, records = os.getloadavg(), []
    for world in [int(w) for w in args.world_sizes.split(",")]:
        root = tempfile.mkdtemp(prefix="save-weights-", dir=args.root)
        for rs in run_ranks(_rank, world, args, root, timeout=3000, collective_timeout=600):
            records += rs
        shutil.rmtree(root)
    text = summarize(records, args, (before, os.getloadavg()))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "records": records}, f)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
