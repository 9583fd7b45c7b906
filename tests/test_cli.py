"""The command line: demo (through torchrun, as the README runs it), estimate, tune, bench."""
import contextlib
import io
import os
import re
import subprocess
import sys
import textwrap

import pytest

from dist_harness import run_ranks
from shardopt.tools import bench, cli, tune

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_cli(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "shardopt", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def test_demo_launches_ranks_and_reports_loss_memory_and_time():
    proc = _run_cli("demo", "--model", "tiny", "--steps", "4", "--world-size", "2", "--stage", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "2 gloo ranks, ZeRO-1" in out
    assert re.search(r"ZeRO-1 \[#+\]\s+4/4 loss", out), out  # the progress bar reached the end
    assert "loss after 4 steps" in out and "largest difference over those steps" in out
    # Every step's loss within the parity bar of DDP's, said so (Note [Demo learning rate]).
    diff = float(re.search(r"largest difference over those steps ([0-9.e+-]+) \(relative; parity bar 1e-05\)", out)[1])
    assert diff <= 1e-5 and "within the parity bar" in out, out
    assert "ZeRO-1 rank 1" in out and "DDP + AdamW (every rank)" in out and "median step time" in out
    # The ratio from turns in the same processes, with its range (Note [Demo step ratio]).
    assert re.search(r"ZeRO-1 / DDP: [0-9.]+x \(range [0-9.]+-[0-9.]+ over 1 rounds: the two take turns", out), out
    # 2 ranks of ZeRO-1 with AdamW: 4 + 4 + (4 + 8) / 2 = 14 bytes per parameter against DDP's 16.
    ratio = float(re.search(r"ZeRO-1 holds ([0-9.]+)x DDP's bytes", out).group(1))
    assert 0.8 < ratio < 0.95, out


def test_demo_offload_flag_and_stage3_memory():
    proc = _run_cli("demo", "--model", "small", "--steps", "2", "--batch", "2", "--seq", "16", "--offload", "cpu",
                    "--stage", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "ZeRO-3+offload" in out and "median step time" in out
    # The weights fall per rank at stage 3: each rank's params column is about half of DDP's at 2 ranks.
    ours = float(re.search(r"ZeRO-3\+offload rank 0\s+([0-9.]+) MiB", out).group(1))
    ddp = float(re.search(r"DDP \+ AdamW \(every rank\)\s+([0-9.]+) MiB", out).group(1))
    assert 0.4 * ddp < ours < 0.6 * ddp, out
    peak = float(re.search(r"this rank's 1/2 of the weights between steps .* peaked at ([0-9.]+) MiB", out).group(1))
    assert peak < ddp, out   # buckets of 500,000 elements: never the whole model at once
    # On this one host the big buckets are mapped out of the shards (Note [Stage-3 buckets mapped, not copied]):
    # the whole model's weights, none of them memory of this rank's own.
    mapped = float(re.search(r"and ([0-9.]+) MiB of buckets are every rank's shards mapped", out).group(1))
    assert 0.9 * ddp < peak + mapped < 1.1 * ddp, out


def test_estimate_prints_a_table_and_refuses_bad_counts(capsys):
    assert cli.main(["estimate", "125M", "--world-size", "2,4", "--stage", "2", "--offload", "none"]) == 0
    out = capsys.readouterr().out
    assert "125,000,000 trainable parameters" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:3] in (["2", "2", "none"], ["4", "2", "none"])]
    assert len(rows) == 2 and float(rows[1][-1]) < float(rows[0][-1])  # more ranks, less memory
    assert "DDP + the same optimizer" in out
    assert cli.parse_count("7B") == 7 * 10**9 and cli.parse_count("2e6") == 2_000_000
    assert cli.main(["estimate", "12x"]) == 2
    assert "not a count: '12x'" in capsys.readouterr().err
    assert cli.main(["estimate", "shardopt.tools.gpt:nope"]) == 2
    assert "has no attribute 'nope'" in capsys.readouterr().err


# ---------------------------------------------------------------------- tune
def test_grid_and_recommendation_are_plain_functions():
    assert tune.grid([1000, 4000], None) == [(1000, 1000), (4000, 4000)]
    assert tune.grid([1000, 4000], [1000, 4000]) == [(1000, 1000), (4000, 1000), (4000, 4000)]
    pts = [tune.GridPoint(1000, 1000, 9, 8000, 0.30), tune.GridPoint(4000, 4000, 3, 32000, 0.20),
           tune.GridPoint(8000, 8000, 2, 64000, 0.20)]
    assert tune.recommend(pts) == pts[1]  # fastest; on a tie the one with less staging memory


def _tune_rank(rank, world_size, out_dir):
    out = []
    for stage in (2, 3):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = cli.main(["tune", "shardopt.tools.gpt:tiny_model", "--reduce-sizes", "1000,20000,200000",
                             "--steps", "2", "--rounds", "1", "--stage", str(stage),
                             "--out-dir", os.path.join(out_dir, str(stage))])
        out += [code, buf.getvalue()]
    return out


def test_tune_measures_the_grid_and_recommends_the_measured_best(tmp_path):
    (code, out, code3, out3), (code1, out1, *_) = run_ranks(_tune_rank, 2, str(tmp_path))
    tmp_path = tmp_path / "2"
    assert code == code1 == 0 and out1 == ""  # rank 0 reports
    # Stage 3: reduce sizes only (the unit of gathering); what each costs in gathered memory.
    rows3 = re.findall(r"^\| ([\d,]+) \| ([\d.]+); ([\d.]+) \| (\d+) \| [\d.]+ \| [\d.]+ \| [\d.]+( \*\*best\*\*)? \|$",
                       out3, re.M)
    assert code3 == 0 and "gathered MiB (peak; mapped)" in out3 and len(rows3) == 3, out3
    whole = [float(r[1]) + float(r[2]) for r in rows3]
    assert 0 < whole[0] < whole[2], out3  # bigger buckets, more whole parameters at once
    # On this one host the biggest buckets are mapped out of the shards, no memory of their own (Note [Stage-3
    # buckets mapped, not copied]); most of the smallest are copied (a parameter bigger than one: its own, mapped).
    assert float(rows3[0][2]) < float(rows3[2][2]) and float(rows3[0][1]) > 0 == float(rows3[2][1]), out3
    assert '"stage": 3, "reduce_bucket_size"' in out3 and "allgather" not in out3.split("Recommended")[1]
    assert cli.main(["tune", "shardopt.tools.gpt:tiny_model", "--stage", "3", "--allgather-sizes", "1000"]) == 2
    row = r"^\| ([\d,]+) \| ([\d,]+) \| (\d+) \| [\d.]+ \| ([\d.]+) \| [\d.]+( \*\*best\*\*)? \|$"
    rows = re.findall(row, out, re.M)
    assert len(rows) == 3, out
    best = [r for r in rows if r[4]]
    assert len(best) == 1 and float(best[0][3]) == min(float(r[3]) for r in rows)
    assert int(rows[0][2]) > int(rows[2][2])  # smaller buckets, more of them
    size = best[0][0].replace(",", "_")
    assert f"reduce_bucket_size={size}" in out and '"zero_optimization"' in out
    pngs = [f for f in os.listdir(tmp_path) if f.endswith(".png")]
    reports = [f for f in os.listdir(tmp_path) if f.endswith(".md")]
    assert len(pngs) == 1 and len(reports) == 1 and os.path.getsize(tmp_path / pngs[0]) > 1000
    assert "**best**" in (tmp_path / reports[0]).read_text()


def test_tune_without_an_example_batch_names_the_fix():
    with pytest.raises(ValueError, match="--batch"):
        tune.load_batch(None, "models:AwkwardNet")


# --------------------------------------------------------------------- bench
def test_bench_collects_reports_charts_them_and_reports_failures(tmp_path):
    # Stand-in scripts: the plumbing is what is tested here (the real scenarios take minutes).
    scripts = tmp_path / "benchmarks"
    scripts.mkdir()
    (scripts / "bench_step.py").write_text(textwrap.dedent("""
        import sys
        out = sys.argv[sys.argv.index("--out") + 1]
        if "--peers" in sys.argv:
            sys.exit("peers exploded")
        open(out, "w").write("# Step time\\n\\n### 2 ranks\\n\\n| variant | total ms | x DDP |\\n|---|---|---|\\n"
                             "| DDP | 10 | 1.00 |\\n| shardopt ZeRO-2 | 9 | 0.90 |\\n")
    """))
    out_dir = tmp_path / "results"
    report = bench.run(["step", "peers"], quick=True, out_dir=str(out_dir), bench_dir=str(scripts), log=lambda *a: None)
    text = open(report).read()
    assert "## step" in text and "\n### Step time" in text and "##### 2 ranks" in text  # nested under "step"
    assert "| shardopt ZeRO-2 | 9 | 0.90 |" in text
    assert "## peers" in text and "**failed**" in text and "peers exploded" in text
    png = re.search(r"!\[step\]\((.+\.png)\)", text).group(1)
    assert os.path.getsize(out_dir / png) > 1000
    with pytest.raises(ValueError, match="unknown scenario"):
        bench.run(["nope"], quick=True, out_dir=str(out_dir), bench_dir=str(scripts))
    with pytest.raises(FileNotFoundError, match="source checkout"):
        bench.benchmarks_dir(str(tmp_path / "missing"))
