"""gpu_check (shardopt/tools/gpu_check.py) on a machine without a GPU.

Note [One device interface] in gpu_check.py: every call to the GPU runtime goes
through its Device. Here a stand-in answers as a machine with two GPUs would
but hands out the CPU and gloo, so the whole flow runs: the kernel checks
(against the CPU kernel), one 2-rank run of every configuration (training for
real on gloo), the report file, the exit code. Sabotaged ops and a sabotaged
optimizer show that each check can fail. What only a GPU can show (the CUDA
kernel's numbers, NCCL, the copier, real syncs, time, memory) is not shown here.
"""
import argparse
import gc
import math
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

from shardopt.tools import cli, gpu_check, gpu_kernels, gpu_report, gpu_training as tr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEAK = 7 * 2**20  # what the stand-in reports as every run's peak


class StandIn(gpu_check.Device):
    """Two "GPUs" that are the CPU; the process group is gloo. Picklable: the ranks get a copy."""

    type, backend, dispatch_key = "cpu", "gloo", "CPU"

    def __init__(self, available=True, count=2, kernels=True):
        self.available, self.count, self.kernels = available, count, kernels

    def is_available(self):
        return self.available

    def device_count(self):
        return self.count

    def describe(self):
        return [("torch", torch.__version__), ("GPUs", f"{self.count} x stand-in (the CPU)")]

    def set_device(self, rank):
        return torch.device("cpu")

    def synchronize(self):
        pass

    def reset_peak_memory(self):
        pass

    def max_memory_allocated(self):
        return PEAK

    def count_host_syncs(self):
        return gpu_check.SyncCounter()

    def has_kernel(self, op):
        return self.kernels and super().has_kernel(op)


def _args(*argv):
    parser = argparse.ArgumentParser()
    gpu_check.add_arguments(parser)
    return parser.parse_args(list(argv))


# ------------------------------------------------------------ without a GPU
def test_without_a_gpu_one_line_and_exit_0(tmp_path):
    out = tmp_path / "report.md"
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")  # no GPU, even on a machine with one
    proc = subprocess.run([sys.executable, "-m", "shardopt.tools.gpu_check", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1 and proc.stdout.startswith("gpu-check: no CUDA device here"), proc.stdout
    assert "nothing to check" in proc.stdout and not out.exists()


def test_cli_subcommand_and_argument_errors(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_check, "Device", lambda: StandIn(available=False))
    assert cli.main(["gpu-check", "--out", str(tmp_path / "r.md")]) == 0
    assert capsys.readouterr().out == gpu_check.no_gpu_line() + "\n"
    with pytest.raises(SystemExit):
        gpu_check.main(["--configs", "zero2,zero9"])
    assert "unknown configuration zero9; choose from zero1,zero2,zero2-sgd,zero3,bf16,fp16,offload" \
        in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.main(["--world-sizes", "0"])
    assert "world sizes must be >= 1" in capsys.readouterr().err
    # More ranks than GPUs: named, exit 2, nothing written.
    assert gpu_check.main(["--world-sizes", "4", "--out", str(tmp_path / "r.md")], device=StandIn()) == 2
    assert "this machine has 2 GPU(s)" in capsys.readouterr().err and not (tmp_path / "r.md").exists()


def test_world_sizes_and_options():
    assert gpu_check.world_sizes(1, None) == [1]
    assert gpu_check.world_sizes(4, None) == [1, 2, 3, 4]
    assert gpu_check.world_sizes(8, [2, 8, 2]) == [2, 8]
    with pytest.raises(ValueError, match="has 2 GPU"):
        gpu_check.world_sizes(2, [1, 3])
    full = gpu_check.run_options(_args(), 2)
    assert (full.steps, full.time_steps, full.model) == (20, 30, "small")
    assert [c.key for c in full.configs] == ["zero1", "zero2", "zero2-sgd", "zero3", "bf16", "fp16", "offload"]
    quick = gpu_check.run_options(_args("--quick", "--configs", "offload,zero1", "--steps", "7"), 2)
    assert (quick.steps, quick.time_steps, quick.model) == (7, 3, "tiny")
    assert full.threads == max(1, (os.cpu_count() or 1) // 2) and gpu_check.run_options(_args("--threads", "3"), 2).threads == 3
    assert [c.key for c in quick.configs] == ["zero1", "offload"]  # CONFIGS' order
    assert _args().out == "gpu-check.md"
    # Stage 3 is listed, and runs exactly when the build has it.
    from shardopt.config import STAGES
    assert next(c for c in tr.CONFIGS if c.key == "zero3").in_build() == (3 in STAGES)


# --------------------------------------------------------------- sync counter
def test_sync_counter_counts_python_warnings_and_stderr_lines(capfd):
    # torch's report arrives as a Python warning, or (raised under an extension's call) as a
    # line the C++ default handler writes to fd 2; everything else is passed on.
    with warnings.catch_warnings(record=True) as outer:
        warnings.simplefilter("always")
        with gpu_check.SyncCounter() as n:
            warnings.warn("called a synchronizing CUDA operation (Triggered internally at x.cpp:1.)")
            warnings.warn("called a synchronizing CUDA operation")
            os.write(2, b"[W x.cpp:1] Warning: called a synchronizing CUDA operation (function f)\n")
            os.write(2, b"something else\n")
            warnings.warn("an unrelated warning")
    assert n.count == 3
    assert [str(w.message) for w in outer] == ["an unrelated warning"]
    err = capfd.readouterr().err
    assert "something else" in err and "synchronizing" not in err
    with gpu_check.SyncCounter() as none:
        pass
    assert none.count == 0


# ------------------------------------------------------------------- kernels
def test_kernel_checks_pass_on_the_cpu_kernel_and_catch_wrong_ones():
    cpu = torch.device("cpu")
    ok = gpu_kernels.check_kernels(StandIn(), cpu, gpu_kernels.QUICK_SIZES)
    by_op = {k.op: k for k in ok}
    assert set(by_op) == {"shardopt::unscale_into", "shardopt::adam_step", "shardopt::stream_limit"}
    assert by_op["shardopt::unscale_into"].status == "pass", by_op["shardopt::unscale_into"].detail
    assert by_op["shardopt::unscale_into"].cases > 16 * 4 * 3
    assert by_op["shardopt::adam_step"].status == "CPU only"

    real = torch.ops.shardopt.unscale_into

    def off_by_one_ulp(src, dst, divisor, found):
        real(src, dst, divisor * (1 + 2**-20), found)

    def blind_to_nan(src, dst, divisor, found):
        real(torch.nan_to_num(src, nan=0.0), dst, divisor, found)

    def clears_flag(src, dst, divisor, found):
        found.zero_()
        real(src, dst, divisor, found)

    for wrong, says in ((off_by_one_ulp, "elements differ"), (blind_to_nan, "nan at"), (clears_flag, "cleared")):
        checks = {"shardopt::unscale_into": lambda dev, sizes, w=wrong: gpu_kernels.check_unscale_into(dev, sizes, w)}
        [k] = gpu_kernels.check_kernels(StandIn(), cpu, gpu_kernels.QUICK_SIZES, ops=["shardopt::unscale_into"],
                                        checks=checks)
        assert k.status == "FAIL" and says in k.detail, (wrong.__name__, k.detail)
    # A build without the device's kernel; an op nobody told gpu_check about.
    [k] = gpu_kernels.check_kernels(StandIn(kernels=False), cpu, (1,), ops=["shardopt::unscale_into"])
    assert k.status == "FAIL" and "built without CUDA" in k.detail
    [k] = gpu_kernels.check_kernels(StandIn(), cpu, (1,), ops=["shardopt::new_op"])
    assert k.status == "FAIL" and "KERNEL_CHECKS" in k.detail


# -------------------------------------------------------------- comparisons
def test_parity_comparisons():
    assert tr.relative_error(2.0, 2.0) == 0.0
    assert tr.relative_error(100.0, 100.001) == pytest.approx(1e-5)
    assert tr.relative_error(0.5, 0.5 + 1e-6) == pytest.approx(1e-6)  # small values: absolute
    assert tr.relative_error(1.0, math.nan) == math.inf
    a = torch.tensor([[1.0, -4.0], [2.0, 0.5]], dtype=torch.float64)
    assert tr.relative_error(a, a + torch.tensor([[0, 0], [4e-5, 0]], dtype=torch.float64)) == pytest.approx(1e-5)
    assert tr.relative_error(a, a.flatten()) == math.inf
    want = [("w", a), ("b", torch.ones(3))]
    worst, bad = tr.compare_params(want, [("w", a.clone()), ("b", torch.ones(3))], 1e-5)
    assert worst == 0.0 and bad == []
    worst, bad = tr.compare_params(want, [("w", a * (1 + 3e-5)), ("b", torch.ones(3))], 1e-5)
    assert worst == pytest.approx(3e-5, rel=1e-3) and len(bad) == 1 and bad[0].startswith("final w: relative error")
    assert tr.compare_params(want, [("w", a)], 1e-5)[1][0].startswith("parameter names differ")


# -------------------------------------------------------------------- report
def _result(key, failures=(), error=None, skipped=None):
    cfg = next(c for c in tr.CONFIGS if c.key == key)
    if skipped:
        return tr.ConfigResult(cfg, skipped=skipped)
    parity = tr.ParityResult(cfg.bar, 1e-7, 2e-7, tuple(failures), ("a note",))
    perf = tr.PerfResult(ddp_ms=10.0, ours_ms=11.0, ratios=(1.1, 1.0, 1.2), ddp_syncs=0.0, ours_syncs=2.0,
                         ddp_peak=3 * 2**20, ours_peak=2 * 2**20, ours_model_states=2**20, ours_estimate=2**20,
                         ddp_estimate=2 * 2**20, num_params=1234)
    return tr.ConfigResult(cfg, parity, None if error else perf, error)


def test_report_and_exit_code_from_results():
    kernels = [gpu_kernels.KernelResult("shardopt::unscale_into", "pass", 10),
               gpu_kernels.KernelResult("shardopt::adam_step", "CPU only", 0, "the fused CPU Adam")]
    good = {1: [[_result("zero2"), _result("zero3", skipped="not in this build")]]}
    assert gpu_report.failures(kernels, good) == []
    text = gpu_report.write([("torch", "9.9")], "nccl", kernels, good)
    assert text.startswith("# shardopt GPU check\n\n**PASS**") and "| torch | 9.9 |" in text
    assert "| `zero2` ZeRO-2, fp32, AdamW | pass | 1e-05 | 1.0e-07 | 2.0e-07 | a note |" in text
    assert "| `zero3` ZeRO-3, fp32, AdamW | not in this build |" in text
    assert "| 1 | zero2 | 10.00 | 11.00 | 1.100 |" in text        # median ratio of (1.1, 1.0, 1.2)
    assert "| 1 | zero2 | 0 | 2.0 | 1.0 | 1.0 | 1.0 | 3.0 | 2.0 |" in text  # MiB per rank
    assert "| 1 | zero2 | 0 | 2 |" in text and "## Failures\n\nNone." in text
    # A parity failure on one rank, a rank that raised, a world size that never finished, a failed kernel.
    bad = {1: [[_result("zero2")]],
           2: [[_result("zero2"), _result("bf16", error="Traceback...\nRuntimeError: NCCL error")],
               [_result("zero2", failures=["step 3 loss: reference 1.0 vs sharded 1.1"]), _result("bf16")]],
           4: "RankFailure: ranks [3] did not finish within 1200s"}
    failed = gpu_report.failures(kernels + [gpu_kernels.KernelResult("shardopt::x", "FAIL", 0, "why")], bad)
    assert failed == ["kernel shardopt::x: why",
                      "world size 2, bf16, rank 0: raised RuntimeError: NCCL error",
                      "world size 2, zero2, rank 1: step 3 loss: reference 1.0 vs sharded 1.1",
                      "world size 4: the ranks did not finish: RankFailure: ranks [3] did not finish within 1200s"]
    text = gpu_report.write([], "nccl", kernels, bad)
    assert text.startswith("# shardopt GPU check\n\n**FAIL**: 3 failed check(s)")
    assert "| `zero2` ZeRO-2, fp32, AdamW | **FAIL** |" in text and "| **ERROR** |" in text
    assert "Traceback, world size 2, `bf16`, rank 0" in text and "**The ranks did not finish:**" in text


# -------------------------------------------------------------- end to end
def _in_process(fn, world_size, *args, backend, timeout):
    """A one-rank "launch" in this process, so that a monkeypatch reaches the rank."""
    import torch.distributed as dist

    assert world_size == 1
    threads = torch.get_num_threads()
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        return [fn(0, 1, *args)]
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
        gc.unfreeze()  # rank_main froze what this process held


def test_a_wrong_step_fails_the_run_with_exit_1(tmp_path, monkeypatch, capsys):
    import shardopt

    real_step = shardopt.ShardedOptimizer.step

    def slightly_off(self, *a, **k):  # as a wrong scale or chunk would, by less than one percent
        out = real_step(self, *a, **k)
        with torch.no_grad():
            self.store.flat_param.mul_(1 + 1e-3)
        return out

    monkeypatch.setattr(shardopt.ShardedOptimizer, "step", slightly_off)
    out = tmp_path / "r.md"
    args = _args("--quick", "--world-sizes", "1", "--configs", "zero2", "--threads", "1", "--out", str(out))
    assert gpu_check.run(args, StandIn(count=1), launch=_in_process, log=lambda *a: None) == 1
    text = out.read_text()
    assert text.startswith("# shardopt GPU check\n\n**FAIL**")
    assert re.search(r"world size 1, zero2, rank 0: step \d loss: reference", text), text


def test_end_to_end_on_two_gloo_ranks(tmp_path):
    """The whole command on the stand-in: every configuration on 2 gloo ranks, the report read back."""
    from shardopt.config import STAGES
    from shardopt.estimate import EstimateConfig, estimate, trainable_shapes
    from shardopt.tools.gpt import GPT, PRESETS

    out = tmp_path / "gpu-check.md"
    lines = []
    code = gpu_check.run(_args("--quick", "--world-sizes", "2", "--out", str(out)), StandIn(), log=lines.append)
    text = out.read_text()
    assert code == 0, text
    assert lines[-1] == f"gpu-check: PASS; report in {out}"
    assert text.startswith("# shardopt GPU check\n\n**PASS**") and "| GPUs | 2 x stand-in (the CPU) |" in text
    assert "| `shardopt::unscale_into` | pass |" in text and "| `shardopt::adam_step` | CPU only |" in text
    for cfg in tr.CONFIGS:
        row = re.search(rf"^\| `{cfg.key}` [^|]+ \| ([^|]+) \| ([^|]+) \| ([^|]*) \| ([^|]*) \|", text, re.M)
        assert row, cfg.key
        if cfg.stage in STAGES:
            assert row.group(1) == "pass" and float(row.group(3)) <= cfg.bar and float(row.group(4)) <= cfg.bar
        else:
            assert row.group(1).startswith("not in this build")
    assert "overflow at step 2 on rank 1: skipped here, scale 4096 -> 2048" in text
    assert "pinned memory and the side-stream copier not checked: the model is on cpu" in text
    # Memory: a row per rank, the stand-in's peak, shardopt.estimate's bytes for the configuration.
    with torch.device("meta"):
        shapes = trainable_shapes(GPT(PRESETS["tiny"]))
    est = estimate(shapes, EstimateConfig(world_size=2, stage=2, device="cpu"))
    for rank in (0, 1):
        assert f"| 2 | zero2 | {rank} | 7.0 | {est.total / 2**20:.1f} | {est.total / 2**20:.1f} |" in text
    assert re.search(r"^\| 2 \| offload \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", text, re.M)  # step time
    assert "## Failures\n\nNone." in text


# The script's parts in two processes at once, each part in the process it shares with the parts of its row:
# at world size 1 one process keeps one core busy, and this test was the suite's longest with the other core
# idle (139 s at a load of 4 on the 2-core VM). Run together as on a GPU the parts are .ci/gpu-check's job;
# each part starts from the same numerics either way (the script's section()). One thread each: two processes
# of torch's default two OpenMP threads on 2 cores spin against each other (the idioms part took 178 s so,
# 23 s alone).
INTEGRATION_PARTS = (("idioms", "compiled", "precision", "host_syncs"),
                     ("checkpoint", "lightning", "hf_trainer", "dcp", "onebit"))


def test_gpu_integrations_script_on_the_cpu(tmp_path):
    """.ci/gpu_integrations.py (the suite's integration parity moved to a GPU) runs every part with DEV=cpu,
    so they do not rot between the rare runs on a GPU: resume equals the uninterrupted run, and the suite
    tests it runs at world size 1 in its own process pass."""
    procs = []
    for i, parts in enumerate(INTEGRATION_PARTS):
        out = open(tmp_path / f"out{i}.txt", "w+")   # files, not pipes: neither process waits on a full pipe
        procs.append((parts, out, subprocess.Popen(
            [sys.executable, os.path.join(ROOT, ".ci", "gpu_integrations.py"), *parts],
            env={**os.environ, "DEV": "cpu", "OMP_NUM_THREADS": "1"}, stdout=out, stderr=subprocess.STDOUT,
            text=True)))
    try:
        for _, _, proc in procs:
            proc.wait(timeout=300)
    finally:
        for _, _, proc in procs:
            if proc.poll() is None:   # timed out, or the wait above raised
                proc.kill()
    stdout = ""
    for parts, out, proc in procs:
        out.seek(0)
        text = out.read()
        out.close()
        assert proc.returncode == 0, f"parts {parts}:\n{text}"
        for part in parts:
            assert f"{part}: PASS" in text, text
        stdout += text
    for stage in (2, 3):
        assert f"stage {stage}: resumed run vs uninterrupted, max abs weight difference 0.0e+00" in stdout
    # Every idiom of tests/test_idioms.py but one that needs 2 ranks, at stages 1-3 (idioms and compiled).
    assert stdout.count("test_idiom_matches_ddp") >= 75 and ": FAIL" not in stdout, stdout


def test_ci_gpu_check_without_a_gpu_runs_both_parts_and_exits_0(tmp_path):
    """.ci/gpu-check, the one command: gpu_check then the integrations script, each one line here."""
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("DEV", None)
    proc = subprocess.run([os.path.join(ROOT, ".ci", "gpu-check"), "--out", str(tmp_path / "r.md")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("gpu-check: no CUDA device here"), proc.stdout
    assert lines[1].startswith("gpu-integrations: no CUDA device here"), proc.stdout
