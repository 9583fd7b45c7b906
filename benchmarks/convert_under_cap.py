"""`shardopt convert CKPT DIR` of a stage-3 checkpoint whose model is larger than the memory cap, under the cap.

Two ranks train a LlamaForCausalLM (built from a config, parameters on the meta device) one step at stage 3,
then save a shardopt checkpoint and, for comparison, `shardopt.save_weights` of the same model. Then the
conversion runs in a process of its own, capped by a cgroup-v1 memory group (memory.limit_in_bytes =
--cap-mib, joined after torch and shardopt are imported, so the cap is what the conversion itself touches;
memory.max_usage_in_bytes is its charged peak) whose cap is below the model's whole fp32 size; and, as the
control, the whole-model conversion (`--format torch`, checkpoint_to_torch) under the same cap. The groups
are removed afterwards, also after failures. Needs root.

    python benchmarks/convert_under_cap.py [--cap-mib 96] [--layers 12] [--dim 512]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import secrets
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CGROUP = "/sys/fs/cgroup/memory"

# Run in a fresh interpreter: import first, then join the group, then convert (argv: group, how, ckpt, out).
_CONVERT = """
import os, sys
import torch, shardopt
from shardopt.checkpoint.convert import checkpoint_to_torch
from shardopt.checkpoint.hf_convert import checkpoint_to_hf
import threading, time
group, how, ckpt, out = sys.argv[1:5]

def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) << 10 for l in f if l.startswith("RssAnon"))

start, peak, done = anon(), [0], []
def poll():
    while not done:
        peak[0] = max(peak[0], anon() - start)
        time.sleep(0.005)
threading.Thread(target=poll, daemon=True).start()
with open(os.path.join(group, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
if how == "hf":
    checkpoint_to_hf(ckpt, out)
else:
    torch.save(checkpoint_to_torch(ckpt), out)
done.append(1)
with open(os.path.join(group, "memory.max_usage_in_bytes")) as f:
    print("PEAK", int(f.read()), peak[0])
"""


def _config(layers: int, dim: int):
    import transformers

    return transformers.LlamaConfig(vocab_size=8000, hidden_size=dim, intermediate_size=int(dim * 2.6875),
                                    num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                                    max_position_embeddings=128, tie_word_embeddings=False)


def _train_and_save(rank, world_size, layers, dim, ckpt, ref):
    import transformers

    import shardopt

    with shardopt.weights.parameters_on_meta():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(_config(layers, dim))
    opt = shardopt.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, stage=3,
                                    reduce_bucket_size=4_000_000)
    wrapper = shardopt.ShardedDDP(model, opt)
    ids = torch.randint(0, 8000, (1, 32), generator=torch.Generator().manual_seed(rank))
    wrapper(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    shardopt.save_checkpoint(ckpt, wrapper, opt, tag="step1")
    shardopt.save_weights(wrapper, ref)
    return sum(slot.numel for slot in opt.layout.params)  # the parameters are empty between uses


def _capped(how: str, ckpt: str, out: str, cap_mib: int, token: str) -> tuple[int, tuple | None]:
    group = os.path.join(CGROUP, f"shardopt-convert-{token}-{how}")
    os.makedirs(group)
    try:
        with open(os.path.join(group, "memory.limit_in_bytes"), "w") as f:
            f.write(str(cap_mib << 20))
        run = subprocess.run([sys.executable, "-c", _CONVERT, group, how, ckpt, out], capture_output=True, text=True)
        peak = next((tuple(map(int, line.split()[1:])) for line in run.stdout.splitlines()
                     if line.startswith("PEAK")), None)
        return run.returncode, peak
    finally:
        os.rmdir(group)


def _same_folders(a: str, b: str) -> bool:
    from safetensors.torch import load_file

    def tensors(folder):
        out = {}
        for name in os.listdir(folder):
            if name.endswith(".safetensors"):
                out.update(load_file(os.path.join(folder, name)))
        return out

    ta, tb = tensors(a), tensors(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def _cpu() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                    platform.machine())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap-mib", type=int, default=96)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--out", default=None, help="the results markdown file to write")
    args = ap.parse_args()
    from shardopt.cluster.ranks import run_ranks

    token = secrets.token_hex(4)
    with tempfile.TemporaryDirectory(prefix="shardopt-convert-") as tmp:
        ckpt, ref = os.path.join(tmp, "ckpt"), os.path.join(tmp, "save_weights")
        params = run_ranks(_train_and_save, 2, args.layers, args.dim, ckpt, ref, timeout=900)[0]
        whole_mib = params * 4 / 2**20
        rows = []
        for how, out in (("hf", os.path.join(tmp, "converted")), ("torch", os.path.join(tmp, "whole.pt"))):
            rc, peak = _capped(how, os.path.join(ckpt, "step1"), out, args.cap_mib, token)
            same = _same_folders(out, ref) if how == "hf" and rc == 0 else None
            rows.append((how, rc, peak, same))
    lines = [f"# `shardopt convert` under a memory cap ({datetime.date.today()})", "",
             f"Machine: {_cpu()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}. Model: LlamaForCausalLM, {args.layers} layers, hidden {args.dim}: "
             f"{params / 1e6:.1f}M parameters, {whole_mib:.0f} MiB in fp32. A stage-3 checkpoint written at 2 "
             f"ranks after one AdamW step; each conversion in its own process, in a cgroup-v1 memory group "
             f"capped at {args.cap_mib} MiB (joined after `import torch, shardopt`; charged peak = "
             f"memory.max_usage_in_bytes, which counts the page cache of the files written, reclaimable, so it "
             f"reaches the cap; anonymous memory growth = the process's RssAnon polled every 5 ms, minus its "
             f"value at the join).", "",
             "| conversion | exit | charged peak (MiB) | anonymous memory growth (MiB) | equal to save_weights' "
             "folder |", "|---|---|---|---|---|"]
    for how, rc, peak, same in rows:
        what = "`convert CKPT DIR/` (safetensors folder, streamed)" if how == "hf" else \
            "`convert CKPT model.pt` (whole model, control)"
        status = "killed (OOM)" if rc in (-9, 137) else str(rc)
        charged, grown = (f"{peak[0] / 2**20:.1f}", f"{peak[1] / 2**20:.1f}") if peak else ("-", "-")
        lines.append(f"| {what} | {status} | {charged} | {grown} | {'yes' if same else '-' if same is None else 'NO'} |")
    lines += ["", "Command: `python benchmarks/convert_under_cap.py " + " ".join(sys.argv[1:]) + "`"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
