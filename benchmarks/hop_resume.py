"""Issue 28's resume check at full length: N steps straight against N/2 + save + load + N/2 with the int8
inter-node hop, on 4 ranks of one host (a 2 x 2 hybrid mesh, and flat sharding over 2 "nodes" with the
node-aware int8 gradient phase), with the error-feedback residual restored and with it forgotten.

    python benchmarks/hop_resume.py --steps 300     # about 2 minutes on 2 cores

tests/test_hybrid.py::test_int8_residual_is_saved_and_restored checks the same at 8 steps (and the files,
the warnings, stage 3); this script reuses its run helper (`_int8_run`: AwkwardNet, AdamW lr 1e-2, 300-element
buckets) so that both measure the same thing. Prints the largest relative weight error of each resume
against the straight run, per rank.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from shardopt.cluster.ranks import run_ranks  # noqa: E402


def _rank(rank, world_size, path, steps, shape):
    import torch.distributed as dist
    from test_hybrid import _int8_run, _relative_error

    t0 = time.time()
    straight, _, _ = _int8_run(rank, shape, steps)
    want = [p.detach().clone() for p in straight.parameters()]
    _int8_run(rank, shape, steps // 2, save=(path, "half"))
    dist.barrier()
    first, rest = steps // 2, steps - steps // 2
    resumed, _, caught = _int8_run(rank, shape, rest, first=first, load=(path, "half"))
    forgot, _, _ = _int8_run(rank, shape, rest, first=first, load=(path, "half"), forget=True)
    return dict(rank=rank, shape=str(shape), steps=steps, with_residual=_relative_error(resumed, want),
                residual_forgotten=_relative_error(forgot, want), warnings=caught, seconds=round(time.time() - t0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    a = ap.parse_args()
    for shape in ((2, 2), ("nodes", 2)):
        with tempfile.TemporaryDirectory() as path:
            for r in run_ranks(_rank, 4, path, a.steps, shape, timeout=1800):
                print(json.dumps(r))


if __name__ == "__main__":
    main()
