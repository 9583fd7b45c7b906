"""On one GPU (world size 1, NCCL): checkpoints (stages 2 and 3), the Lightning strategy and ShardedTrainer,
each through the test suite's own parity functions with the device switched from the CPU to the GPU.

    python .ci/gpu_integrations.py [checkpoint] [lightning] [hf_trainer]      # on a machine with a GPU
                                                              # (.ci/gpu-check runs it after gpu_check)
    DEV=cpu python .ci/gpu_integrations.py checkpoint                         # the same on the CPU (tests)

Prints "NAME: PASS", "NAME: FAIL" and the failures, or "NAME: ERROR" and the traceback, per part; it
complements .ci/gpu-check (kernels, parity of ShardedOptimizer itself, syncs, time, memory), which it does
not repeat. Results of its first run: benchmarks/results/2026-11-26-gpu-check.md.
"""
import os
import shutil
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

CUDA = os.environ.get("DEV", "cuda") == "cuda"
TMP = tempfile.mkdtemp()


def section(name, fn):
    print(f"== {name}", flush=True)
    t0 = time.time()
    try:
        failures = fn()
        print(f"{name}: {'PASS' if not failures else 'FAIL'} ({time.time() - t0:.0f} s)", flush=True)
        for f in failures or []:
            print("  ", f)
        return not failures
    except Exception:  # noqa: BLE001 - reported, and the next part still runs
        print(f"{name}: ERROR ({time.time() - t0:.0f} s)")
        traceback.print_exc(file=sys.stdout)
        return False
    finally:
        sys.stdout.flush()


def checkpoint():
    import shardopt
    from torch import nn
    from shardopt.tools.gpt import GPT, PRESETS, synthetic_batch

    c, dev = PRESETS["tiny"], torch.device("cuda" if CUDA else "cpu")
    batches = [tuple(t.to(dev) for t in synthetic_batch(c, 4, c.seq, i, 0)) for i in range(6)]
    failures = []
    for stage in (2, 3):
        def build():
            torch.manual_seed(0)
            model = GPT(c).to(dev)
            opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=stage, lr=1e-2,
                                            weight_decay=0.1, reduce_bucket_size=20000)
            return shardopt.ShardedDDP(model, opt), opt

        def train(wrapper, opt, steps):
            for i in steps:
                x, y = batches[i]
                out = wrapper(x)
                nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
                torch.nn.utils.clip_grad_norm_(wrapper.parameters(), 0.5)
                opt.step()
                opt.zero_grad()

        def weights(wrapper, opt):
            with opt.full_params(writeback=False):
                return [p.detach().cpu().clone() for p in wrapper.module.parameters()]

        path = os.path.join(TMP, f"ckpt{stage}")
        wrapper, opt = build()
        train(wrapper, opt, range(3))
        shardopt.save_checkpoint(path, wrapper, opt)
        train(wrapper, opt, range(3, 6))
        ref = weights(wrapper, opt)
        wrapper2, opt2 = build()
        shardopt.load_checkpoint(path, wrapper2, opt2)
        train(wrapper2, opt2, range(3, 6))
        got = weights(wrapper2, opt2)
        err = max((a - b).abs().max().item() for a, b in zip(ref, got))
        print(f"   stage {stage}: resumed run vs uninterrupted, max abs weight difference {err:.1e}")
        if err != 0:
            failures.append(f"stage {stage}: resume differs by {err:.1e}")
    return failures


def lightning():
    import test_lightning as L

    def trainer(world_size, strategy, **kw):
        kw = {"max_epochs": 1, "enable_checkpointing": False, **kw}
        return L.pl.Trainer(accelerator="gpu" if CUDA else "cpu", devices=1, strategy=strategy, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw)

    L._trainer = trainer
    return L._parity(0, 1)


def hf_trainer():
    import test_hf_trainer as T

    args = T._args
    T._args = lambda out, cls=None, **kw: args(out, cls, **dict(kw, use_cpu=not CUDA))
    failures = T._parity(0, 1, TMP)
    # At world size 1 accelerate skips no_sync, so each micro-batch reduces (a copy): the count differs.
    counts = [f for f in failures if "reduce-scatters for" in f]
    for f in counts:
        print("   (world size 1, no no_sync from accelerate)", f)
    return [f for f in failures if f not in counts]


def main(argv) -> int:
    if CUDA and not torch.cuda.is_available():
        print(f"gpu-integrations: no CUDA device here (torch {torch.__version__}); nothing to check, exit 0")
        return 0
    if CUDA:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if CUDA else "gloo", store=dist.FileStore(os.path.join(TMP, "store"), 1),
                            rank=0, world_size=1)
    try:
        results = [section(name, globals()[name]) for name in (argv or ["checkpoint", "lightning", "hf_trainer"])]
    finally:
        dist.destroy_process_group()
        shutil.rmtree(TMP, ignore_errors=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
