"""Why the demo's ZeRO-2 and DDP losses parted at lr 3e-3 (Note [Demo learning rate] in shardopt/tools/demo.py).

Trains the demo's GPT (`shardopt demo`'s set-up: batch 8x64 per rank, AdamW weight decay 0.1, clipping at 1.0,
the same synthetic batches) three ways for each learning rate, one after another in the same 2 ranks:
  ddp    DDP + AdamW(fused=True), torch's clip_grad_norm_ (the demo's reference);
  twin   the same, but the clipping norm summed in another order (parameters reversed, one at a time):
         a clip coefficient an ulp away, nothing else changed;
  zero2  ShardedDDP + ShardedOptimizer(stage=2), opt.clip_grad_norm (the demo's contender).
and prints each run's relative loss difference to ddp at every step. If the twin parts from DDP as ZeRO-2 does,
the parting is the training amplifying fp32 rounding, not shardopt.

    torchrun --nproc-per-node 2 benchmarks/demo_parity.py small 30 3e-3,1e-3 float32 ddp,twin,zero2
"""
import sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import shardopt
from shardopt.tools.gpt import GPT, PRESETS, synthetic_batch

def run(kind, lr, dtype, steps, cfg, rank, batch=8, seq=None, wd=0.1):
    seq = seq or min(64, cfg.seq)
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    if kind == "zero2":
        opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, fused=True, lr=lr, weight_decay=wd, stage=2, reduce_bucket_size=500_000)
        w = shardopt.ShardedDDP(model, opt)
    else:
        w = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, fused=True)
    lf = torch.nn.CrossEntropyLoss()
    losses, coefs = [], []
    for s in range(steps):
        x, y = synthetic_batch(cfg, batch, seq, s, rank)
        loss = lf(w(x).reshape(-1, cfg.vocab), y.reshape(-1)); loss.backward()
        if kind == "zero2":
            n = opt.clip_grad_norm(1.0)
        elif kind == "twin":   # the same clip, the norm summed in another order (params reversed, one at a time)
            ps = [p for p in model.parameters()][::-1]
            n = torch.zeros((), dtype=dtype)
            for p in ps: n = n + p.grad.pow(2).sum()
            n = n.sqrt(); c = torch.clamp(1.0 / (n + 1e-6), max=1.0)
            for p in ps: p.grad.mul_(c)
        else:
            n = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); opt.zero_grad()
        losses.append(loss.item()); coefs.append(float(n))
    return losses, coefs

dist.init_process_group("gloo"); rank = dist.get_rank(); torch.set_num_threads(1)
cfg = PRESETS[sys.argv[1]]; steps = int(sys.argv[2]); dt = getattr(torch, sys.argv[4])
for lr in map(float, sys.argv[3].split(",")):
  res = {k: run(k, lr, dt, steps, cfg, rank) for k in sys.argv[5].split(",")}
  if rank == 0:
    ddp = res["ddp"][0]
    for k, (l, n) in res.items():
        d = [abs(a - b) / abs(b) for a, b in zip(l, ddp)]
        first = next((i for i, v in enumerate(d) if v > 1e-5), None)
        print(f"{sys.argv[1]} lr={lr} {sys.argv[4]} {k:6s} final {l[-1]:.6f} maxrel {max(d):.2e} first>1e-5 at step {first} rel by step " + " ".join(f"{v:.0e}" for v in d), flush=True)
    print("ddp losses", " ".join(f"{v:.3f}" for v in ddp))
    print("ddp norms ", " ".join(f"{v:.2f}" for v in res['ddp'][1]), flush=True)
dist.destroy_process_group()
