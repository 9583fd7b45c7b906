"""On one GPU (world size 1, NCCL): checkpoints (stages 2 and 3), the Lightning strategy and ShardedTrainer,
each through the test suite's own parity functions with the device switched from the CPU to the GPU.

    python .ci/gpu_integrations.py [checkpoint] [lightning] [hf_trainer] [idioms] [compiled] [dcp]
                                   [precision] [host_syncs] [onebit]
                                                      # on a machine with a GPU (.ci/gpu-check runs it)
    DEV=cpu python .ci/gpu_integrations.py checkpoint # the same on the CPU (tests)

idioms, compiled and precision run test functions of tests/test_idioms.py (every idiom, stages 1-3;
torch.compile's in `compiled`) and tests/test_mixed_precision.py (what user code does between backward
and step) in this process at world size 1, model and batches on the GPU (Note [Suite tests at world size
1 on one GPU]); dcp runs tests/test_interop_dcp.py's FSDP2 <-> shardopt checkpoint runs (DCP, stages 2 and 3)
the same way; host_syncs counts CUDA's host syncs per step with the torch idioms; onebit runs
tests/test_onebit.py's OneBitAdam runs (warm-up, frozen-variance stage, offload, fp16, stage 3, resume, the
Lightning docs' config) at world size 1.

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


def _numerics():
    """Process-wide switches a part may turn (accelerate turns TF32 on for a compiled fp32 Trainer on CUDA)."""
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            torch.get_float32_matmul_precision())


def _restore_numerics(saved, name):
    if _numerics() != saved:
        print(f"   ({name} changed TF32 / matmul precision {saved} -> {_numerics()}: restored)")
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


def section(name, fn):
    print(f"== {name}", flush=True)
    t0 = time.time()
    # Each part starts from the same numerics. On an H200 the compiled idioms, alone in a process, matched DDP;
    # run after hf_trainer (whose compiled fp32 case makes accelerate turn TF32 on) they were 6.3e-5 off.
    saved = _numerics()
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
        _restore_numerics(saved, name)
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
    failures = L._parity(0, 1)
    # WeightAveraging: resumed bit for bit (fp32 with offload, bf16), refused at stage 3. Without the buffers:
    # torch's AveragedModel averages a CUDA model's tensors with foreach ops, which refuse an integer buffer
    # (BatchNorm's num_batches_tracked: "Integer division with addcdiv is no longer supported"; torch 2.11 on
    # an H200, 2026-11-27, under any strategy: torch.optim.swa_utils.get_swa_multi_avg_fn()'s integer branch
    # raises the same on the CPU when called directly).
    out = L._weight_averaging_resume(0, 1, os.path.join(TMP, "averaging"), use_buffers=False)
    if "cannot average a ShardedStrategy(stage=3) model" not in out.pop("stage 3"):
        failures.append("WeightAveraging at stage 3 was not refused")
    for precision, result in out.items():
        ok = not isinstance(result, str) and not result[0] and result[1]  # (averages that differ, masters equal)
        print(f"   WeightAveraging resume, {precision}: {'bit for bit' if ok else result}")
        if not ok:
            failures.append(f"WeightAveraging resume, {precision}: {result}")
    return failures


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


# Note [Suite tests at world size 1 on one GPU]
# The suite's multi-rank tests launch ranks through run_ranks(fn, world_size, *args) and build AwkwardNet and
# its batches on the CPU. Here run_ranks runs fn(0, 1, *args) in this process (whose NCCL group of one is
# already up), and the test module's AwkwardNet and batch put the model and the batches on the GPU; every
# tensor the tests make after that follows the model's device (full_like, zeros_like). The tests' own
# assertions then judge. Idioms whose world-size-2 sense differs (a branch one rank takes) still hold at 1:
# DDP + torch.optim at world size 1 is the plain loop.
def _on_the_device(module):
    import models

    dev = torch.device("cuda" if CUDA else "cpu")
    module.run_ranks = lambda fn, world_size, *args, **kw: [fn(0, 1, *args)]
    module.AwkwardNet = lambda *a, **kw: models.AwkwardNet(*a, **kw).to(dev)
    module.batch = lambda *a, **kw: tuple(t.to(dev) for t in models.batch(*a, **kw))
    return module


def _run_tests(calls):
    failures = []
    for name, fn, args in calls:
        t0 = time.time()
        try:
            fn(*args)
            print(f"   {name}{list(args) if args else ''}: pass ({time.time() - t0:.1f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - an assertion or an error, reported per test
            failures.append(f"{name}{list(args) if args else ''}: {type(e).__name__}: {str(e)[-3000:]}")
            print(f"   {name}{list(args) if args else ''}: FAIL", flush=True)
    return failures


_COMPILED = ("compile_model", "compile_overlap_gather")


def _idioms(keep):
    """tests/test_idioms.py on the device, its MATCH list cut to the idioms `keep` names (its results cache
    cleared: idioms and compiled may run in one process)."""
    import test_idioms as I

    _on_the_device(I)
    if not hasattr(I, "_ALL_MATCH"):
        I._ALL_MATCH = list(I.MATCH)
    I.MATCH[:] = [f for f in I._ALL_MATCH if keep(f.__name__)]
    I._results.cache_clear()
    return I


def _matches(I, rounding=()):
    """test_idiom_matches_ddp for every idiom left in I.MATCH at stages 1-3; those in `rounding` at a 1e-5 bar."""
    tol = I.TOL

    def judged(idiom, stage):
        I.TOL = 1e-5 if idiom in rounding else tol
        try:
            I.test_idiom_matches_ddp(idiom, stage)
        finally:
            I.TOL = tol
    return [("test_idiom_matches_ddp" + (" (bar 1e-5)" if f.__name__ in rounding else ""), judged, (f.__name__, s))
            for s in (1, 2, 3) for f in I.MATCH if not (s == 3 and f.__name__ in I.NOT_AT_STAGE_3)]


def idioms():
    # torch.compile's are the part `compiled`. ema_after_step_overlap_gather checks that reads waited for
    # gathers in flight: at world size 1 nothing is gathered.
    I = _idioms(lambda name: name not in _COMPILED and name != "ema_after_step_overlap_gather")
    # At world size 1 the DDP side's clip total is torch's float32 norm of each whole gradient; ours sums the
    # norms of a parameter's pieces (parameters straddle these tiny buckets) in float64. With the decay groups'
    # layout that total differs in its last bits, and AdamW makes 1.6e-6 of it in 4 steps on the CPU (the
    # suite's 2 ranks stay inside 1e-6). Judged at 1e-5 here, and said so.
    calls = _matches(I, rounding={"clip_with_decay_groups"})
    calls += [("test_idiom_raises_documented_error", I.test_idiom_raises_documented_error, (f.__name__, s))
              for s in (1, 2, 3) for f in I.RAISE if s == 3 or f.__name__ not in I.ONLY_AT_STAGE_3]
    return _run_tests(calls)


def compiled():
    """The torch.compile idioms (Inductor: about 90 s for the first on an H200, seconds after), and that a
    compiled wrapper is not compiled again every step (Note [Registrations under torch.compile])."""
    I = _idioms(lambda name: name in _COMPILED)
    calls = _matches(I)
    calls += [("test_a_compiled_wrapper_is_not_compiled_again_every_step",
               I.test_a_compiled_wrapper_is_not_compiled_again_every_step, (s,)) for s in (2, 3)]
    return _run_tests(calls)


def dcp():
    """tests/test_interop_dcp.py's runs at world size 1 on the device: FSDP2 (fully_shard) saves through
    torch.distributed.checkpoint, shardopt loads it at stages 2 and 3 and goes on; shardopt (stages 2 and 3)
    saves, FSDP2 loads it and goes on. The test's bars: what was loaded equals what was saved bit for bit,
    and K more steps end within 1e-5 of the run it came from."""
    import test_interop_dcp as D

    D.DEVICE = torch.device("cuda" if CUDA else "cpu")
    root = os.path.join(TMP, "dcp")
    two, three = D._two_ranks(0, 1, root), D._three_ranks(0, 1, root)
    back = D._fsdp2_from_stage3(0, 1, root)
    failures = []
    for name, (saved, loaded, went_on, own) in {
            "FSDP2 -> shardopt stage 2": (two["fsdp2 saved"], three["shardopt loaded"], three["shardopt continued"],
                                          two["fsdp2 continued"]),
            "FSDP2 -> shardopt stage 3": (two["fsdp2 saved"], three["shardopt-3 loaded"],
                                          three["shardopt-3 continued"], two["fsdp2 continued"]),
            "shardopt stage 2 -> FSDP2": (two["shardopt saved"], three["fsdp2 loaded"], three["fsdp2 continued"],
                                          two["shardopt continued"]),
            "shardopt stage 3 -> FSDP2": (three["shardopt-3 saved"], back["fsdp2 loaded"], back["fsdp2 continued"],
                                          three["shardopt-3 own"])}.items():
        differ = D._differences(saved, loaded, 0) + D._differences(own, went_on, 1e-5)
        print(f"   {name}: {'loaded bit for bit, went on within 1e-5' if not differ else differ[:5]}", flush=True)
        failures += [f"{name}: {d}" for d in differ]
    return failures


def precision():
    import test_mixed_precision as M

    _on_the_device(M)
    return _run_tests([(name, getattr(M, name), ()) for name in (
        "test_a_gradient_replaced_before_step_decides_the_skip",
        "test_reading_weights_in_full_params_keeps_the_fp32_masters")])


def onebit():
    """tests/test_onebit.py's runs at world size 1 on the device: OneBitAdam against Adam with the variance frozen
    at freeze_step, written out in plain PyTorch (bar 1e-5; stage 2, stage 3, offload="cpu": the fused kernel's
    frozen-variance step); against our AdamW, bit for bit until freeze_step and compressing from the step after it
    (fp32, and bf16 / fp16 with loss scaling with offload); stage 3 bit for bit with stage 2; the clip's sketch
    against the exact norm; a resume in the compression stage bit for bit; the Lightning docs' DeepSpeed config
    through from_config + ShardedDDP and through the Lightning strategy on the GPU (32-true, 16-mixed, stage 3).
    At world size 1 nothing is exchanged: the 1-bit codec and the exchange between ranks are not on trial. (Nor
    is the suite's "within 10% of AdamW's loss after the freeze": on one rank AwkwardNet's branch has one
    gradient in the 4 warm-up steps, and a variance frozen from one sample sends it far: 1-bit Adam's premise,
    not the device. The frozen-variance reference judges the compression stage here.)"""
    import test_onebit as O

    _on_the_device(O)
    O.ACCELERATOR = "gpu" if CUDA else "cpu"
    failures = []

    def one_rank(stage, offload):
        diffs, _ = O._one_rank(0, 1, stage, offload)  # (per-step differences, the SIMD variant it ran)
        print(f"   stage {stage}, offload={offload}: max |OneBitAdam - frozen-variance Adam| per step: "
              f"{['%.1e' % d for d in diffs]}")
        assert max(diffs) < 1e-5, diffs  # test_onebit's bar (its bit-for-bit warm-up: the host's kernel, not here)

    def train_pair(stage, offload, dtype):
        # asserts the warm-up bit for bit and the step compression starts at (skipped fp16 steps included)
        diffs, _ = O._train_pair(0, 1, None, stage, offload, dtype, 12, 4)
        assert diffs[0] == 0.0 and diffs[-1] > 0.0, diffs

    def stage3_is_stage2(offload, dtype):
        same = O._stage3_is_stage2(0, 1, None, offload, dtype)
        assert all(same), same

    def clip():
        norms = O._clip_norms(0, 1, None, 2)
        assert norms[0][0] == norms[0][1] and norms[1][0] == norms[1][1], norms
        exact, sketched = norms[2]
        assert abs(sketched - exact) <= 1e-5 * abs(exact), norms

    def from_config(stage):
        lrs, losses = O._from_config(0, 1, stage)
        assert lrs[:2] == [0.0, 0.0] and lrs[-1] == 3e-5 and losses[-1] < losses[1], (lrs, losses)

    def lightning(precision, stage):
        seen = O._lightning(0, 1, precision, stage)
        assert all(c == (s >= 3) for s, c, _ in seen) and seen[-1][1], seen
        assert seen[0][2] == 0.0 and seen[-1][2] == 3e-5, seen

    failures += _run_tests(
        [("one rank = Adam with a frozen variance", one_rank, args) for args in ((2, "none"), (3, "none"),
                                                                                 (2, "cpu"))]
        + [("warm-up = our AdamW, then compression", train_pair, args) for args in (
            (2, "none", torch.float32), (2, "cpu", torch.bfloat16), (2, "cpu", torch.float16))]
        + [("stage 3 = stage 2", stage3_is_stage2, args) for args in (("none", torch.float32),
                                                                      ("cpu", torch.float16))]
        + [("clip by the sketch", clip, ())]
        + [("resume in the compression stage", O._resume, (0, 1, os.path.join(TMP, f"onebit{s}"), None, s)) for s in (2, 3)]
        + [("docs' config through from_config", from_config, (s,)) for s in (2, 3)]
        + [("docs' config under Lightning", lightning, args) for args in (("32-true", 2), ("16-mixed", 2),
                                                                         ("32-true", 3))])
    _onebit_step_time()
    return failures


def _onebit_step_time(pairs=20):
    """Reported, not judged: a compressing OneBitAdam step against our AdamW step (stage 2, the demo GPT 'small',
    alternated pairs, each step between two synchronize() calls), and host syncs per step. At world size 1 the
    compression stage still brings the local gradient to the host and the momentum back (its exchange works on
    CPU tensors: Note [1-bit Adam under ZeRO]); this is what that round trip costs on the device."""
    import shardopt
    from torch import nn
    from shardopt.tools.gpt import GPT, PRESETS, synthetic_batch
    from shardopt.tools.gpu_check import Device, SyncCounter

    c = PRESETS["small" if CUDA else "tiny"]
    dev = torch.device("cuda" if CUDA else "cpu")
    sync = torch.cuda.synchronize if CUDA else (lambda: None)
    counter = Device().count_host_syncs if CUDA else SyncCounter
    runs = {}
    for name, optim in (("AdamW", torch.optim.AdamW), ("OneBitAdam", shardopt.OneBitAdam)):
        torch.manual_seed(0)
        model = GPT(c).to(dev)
        kw = {"freeze_step": 2} if optim is shardopt.OneBitAdam else {}
        opt = shardopt.ShardedOptimizer(model.parameters(), optim=optim, lr=1e-4, stage=2, **kw)
        runs[name] = (shardopt.ShardedDDP(model, opt), opt)
    x, y = (t.to(dev) for t in synthetic_batch(c, 8, c.seq, 0, 0))

    def step(name):
        ddp, opt = runs[name]
        out = ddp(x)
        nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(4):  # OneBitAdam compresses from its third step
            for name in runs:
                step(name)
        syncs = {}
        for name in runs:
            with counter() as count:
                step(name)
            syncs[name] = count.count
        times = {name: [] for name in runs}
        for i in range(pairs if CUDA else 3):
            for name in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
                sync()
                t0 = time.perf_counter()
                step(name)
                sync()
                times[name].append(time.perf_counter() - t0)
    assert runs["OneBitAdam"][1].onebit.compressing
    ratios = sorted(b / a for a, b in zip(times["AdamW"], times["OneBitAdam"]))
    med = {name: sorted(t)[len(t) // 2] * 1e3 for name, t in times.items()}
    print(f"   step time, GPT '{'small' if CUDA else 'tiny'}' ({sum(p.numel() for p in runs['AdamW'][0].parameters()):,}"
          f" parameters), stage 2, world size 1: AdamW {med['AdamW']:.2f} ms, OneBitAdam compressing "
          f"{med['OneBitAdam']:.2f} ms, OneBitAdam / AdamW {ratios[len(ratios) // 2]:.3f} (median of {len(ratios)} "
          f"alternated pairs; p25-p75 {ratios[len(ratios) // 4]:.3f}-{ratios[3 * len(ratios) // 4]:.3f}); host syncs "
          f"per step: AdamW {syncs['AdamW']}, OneBitAdam {syncs['OneBitAdam']}", flush=True)


def host_syncs():
    """tests/test_host_reads.py's step (GradScaler, clip_grad_value_, clip_grad_norm_, per-parameter norms,
    zero_grad) on the GPU, ShardedDDP at stages 1-3 and DDP: host syncs per step as CUDA reports them, at 10
    and 80 parameter tensors. shardopt's must not grow with the tensors."""
    import shardopt
    import test_host_reads as H
    from torch.nn.parallel import DistributedDataParallel as DDP
    from shardopt.tools.gpu_check import Device, SyncCounter

    dev = torch.device("cuda" if CUDA else "cpu")
    counter = Device().count_host_syncs if CUDA else SyncCounter  # on the CPU nothing syncs: the path only
    failures, seen = [], {}
    for name in ("ddp", "stage 1", "stage 2", "stage 3"):
        for tensors in (10, 80):
            model = H._model(tensors).to(dev)
            if name == "ddp":
                opt = torch.optim.AdamW(model.parameters(), fused=True, lr=1e-2)
                model = DDP(model)
            else:
                opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, fused=True, lr=1e-2,
                                                stage=int(name[-1]), reduce_bucket_size=37)
                model = shardopt.ShardedDDP(model, opt)
            scaler = torch.amp.GradScaler(dev.type, init_scale=2.0 ** 8)
            counts = []
            for step in range(4):
                count = counter()
                H._step(model, opt, scaler, step, 0, count)
                counts.append(count.count)
            seen[name, tensors] = counts[1:]  # step 0 builds state
        print(f"   {name}: host syncs per step (steps 1-3) {seen[name, 10]} at 10 tensors, {seen[name, 80]} at 80",
              flush=True)
        if name != "ddp" and seen[name, 10] != seen[name, 80]:
            failures.append(f"{name}: host syncs grow with the tensors: {seen[name, 10]} -> {seen[name, 80]}")
    return failures


def main(argv) -> int:
    if CUDA and not torch.cuda.is_available():
        print(f"gpu-integrations: no CUDA device here (torch {torch.__version__}); nothing to check, exit 0")
        return 0
    if CUDA:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if CUDA else "gloo", store=dist.FileStore(os.path.join(TMP, "store"), 1),
                            rank=0, world_size=1)
    try:
        results = [section(name, globals()[name]) for name in (argv or ["checkpoint", "lightning", "hf_trainer",
                                                                       "idioms", "compiled", "dcp",
                                                                       "precision", "host_syncs", "onebit"])]
    finally:
        dist.destroy_process_group()
        shutil.rmtree(TMP, ignore_errors=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
