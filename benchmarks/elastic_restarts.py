"""How often does `torchrun --max-restarts 1` resume after a lost node? N runs per launcher setting.

Each run is test_elastic_resume_after_losing_a_node's scenario on a fresh
emulated cluster (2 nodes x 2 ranks, examples/elastic_train.py, node 1
SIGKILLed after step 7 of 20, checkpoints every 5 steps), with the launcher's
shared TCPStore as torch sets it by default, or disabled with
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (Note [Restarts and the launcher's shared
store] in examples/elastic_train.py). A run passes if node 0's torchrun exits
0 after its second attempt trained at world size 2 to the last step; a
failure is reported with the first line that explains it.

    sudo .venv/bin/python benchmarks/elastic_restarts.py --runs 8 [--modes shared,disabled] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardopt.cluster.emulated import EmulatedCluster  # noqa: E402
from shardopt.cluster.elastic_runs import run_training  # noqa: E402

# Short rendezvous timings so a restart takes seconds, not the default ~45 s (same as the test).
RDZV_CONF = {"last_call_timeout": 2, "keep_alive_interval": 1, "keep_alive_max_attempt": 3, "join_timeout": 60}
_CAUSES = [r"connectFullMesh failed[^\n]*", r"Connection refused[^\n]*", r"Timed out[^\n]*", r"timed out[^\n]*",
           r"Traceback[^\n]*"]


def one_run(share_store: bool) -> tuple[bool, str, float]:
    with tempfile.TemporaryDirectory(prefix="shardopt-elastic-") as work, EmulatedCluster(2, "1gbit") as c:
        run = run_training(c, work, nodes=2, nproc=2, steps=20, save_every=5, nnodes="1:2", max_restarts=1,
                           pg_timeout=20, lose_node=1, lose_at_step=7, share_store=share_store,
                           rdzv_conf=RDZV_CONF, timeout=240)
        resumed = [p for p in run.progress if p[0] == 1]
        ok = run.codes[0] == 0 and resumed and resumed[-1][1:3] == (2, 20)
        if ok:
            return True, (f"resumed at world size 2 from step {resumed[0][2] - 1}, first step "
                          f"{resumed[0][3] - run.lost_at:.1f} s after the loss"), run.seconds
        restart_log = run.logs[0]
        for pattern in _CAUSES:
            m = re.search(pattern, restart_log.split("attempt 1", 1)[-1] if "attempt 1" in restart_log
                          else restart_log)
            if m:
                return False, m.group(0)[:200], run.seconds
        return False, f"exit {run.codes[0]}, progress {run.progress[-1:] }", run.seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--modes", default="shared,disabled")
    ap.add_argument("--out")
    a = ap.parse_args()
    lines = [f"# Elastic restart reliability, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             "", "| launcher store | run | result | seconds | detail |", "|---|---|---|---|---|"]
    summary = []
    for mode in a.modes.split(","):
        share = {"shared": True, "disabled": False}[mode]
        passed = 0
        for i in range(a.runs):
            ok, detail, secs = one_run(share)
            passed += ok
            row = f"| {mode} | {i + 1} | {'pass' if ok else 'FAIL'} | {secs:.0f} | {detail} |"
            print(row, flush=True)
            lines.append(row)
            time.sleep(1)
        summary.append(f"- {mode}: {passed} of {a.runs} runs resumed")
    text = "\n".join(lines + [""] + summary) + "\n"
    print("\n".join(summary))
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
