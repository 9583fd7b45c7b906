"""The full fine-tune journey of a model too big for one rank (benchmarks/weights_memory.py's ours-full, run as
is) under a cgroup-v1 memory cap per rank: from_pretrained on meta, ShardedDDP reading each rank's shards,
AdamW steps, save_weights streamed. A small LlamaForCausalLM (40.6M parameters) at 2 ranks, capped at 90% of
the whole fp32 model plus its own shard (4P + 16P/N), as issue 53 asks: the journey must complete; building
the model must cost its shard, not the whole model; loading it must add less than the whole model; and the
save must not grow a rank that writes nothing by half the whole model (a whole gather on every rank grows
each by 4P).

Needs root and the cgroup-v1 memory controller at /sys/fs/cgroup/memory (skipped otherwise); the ranks'
groups are removed afterwards, also after failures.
"""
import ctypes
import os
import secrets
import sys

import pytest
import torch

from tests.dist_harness import RankFailure, run_ranks

transformers = pytest.importorskip("transformers")

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
CGROUP = "/sys/fs/cgroup/memory"
# Buckets of the largest parameter (the embedding, 1.05M elements) rather than the default P/16: at stage 3
# the staging pool grows past num_staging_buffers while reduce-scatters lag (Note [Stage 3 never waits in
# backward] in csrc/comm/bucket_engine.cpp; here 2 ranks share 2 cores), each slot the largest bucket's size,
# and with P/16 buckets the pool and the gathered buckets came to more than the whole model (6 layers:
# peaks of 242-248 MiB against 4P + 16P/N = 244 MiB; with these buckets 224-226).
SPEC = dict(hidden=512, inter=1408, layers=12, heads=8, vocab=2048, seq=16, shard_size="20MB",
            ours_options={"reduce_bucket_size": 1_050_000})
WORLD = 2

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(os.path.join(CGROUP, "cgroup.procs"), os.W_OK),
    reason="needs root and the cgroup-v1 memory controller at /sys/fs/cgroup/memory")


def _weights_memory():
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    import weights_memory

    return weights_memory


def _rank(rank, world, spec):
    # Large blocks straight back to the kernel when freed (the benchmark sets MALLOC_MMAP_THRESHOLD_ for its
    # spawned ranks; a forked rank has its server's environment from the start): M_MMAP_THRESHOLD = -3.
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)
    return _weights_memory()._ours_full(rank, world, spec)


def test_full_fine_tune_fits_below_whole_model_plus_shard(tmp_path):
    wm = _weights_memory()
    folder = os.path.join(tmp_path, "pretrained")
    wm.write_pretrained(SPEC, folder)  # by this process: its pages are cached, charged here, not to the ranks
    wm.warm(folder)
    n = wm._count(SPEC)
    whole, shard = 4 * n, 16 * n // WORLD
    cap_mib = int(0.9 * (whole + shard)) >> 20  # measured: peaks of 377-388 MiB against 418
    prefix = f"shardopt-test-wm-{secrets.token_hex(3)}-"
    logdir = os.path.join(tmp_path, "logs")
    os.makedirs(logdir)
    spec = dict(SPEC, folder=folder, out=os.path.join(tmp_path, "out"), cap_mib=cap_mib, group_prefix=prefix,
                logdir=logdir)
    try:
        results = run_ranks(_rank, WORLD, spec, timeout=120)
    except RankFailure as e:
        pytest.fail(f"the journey did not complete under {cap_mib} MiB per rank (4P + 16P/N = "
                    f"{(whole + shard) >> 20} MiB): {str(e)[-2000:]}")
    finally:
        wm.remove_groups(prefix)
    assert not [g for g in os.listdir(CGROUP) if g.startswith(prefix)]
    for rank, result in enumerate(results):
        phases = {p["phase"]: p for p in result["phases"]}
        # Built on meta: its own parameter and gradient shards (4P/N each) and little else, where a model built
        # whole costs 4P. (On one host the parameter shard is reserved in /dev/shm when the optimizer is built,
        # Note [Gathering through shared memory], so it is charged here, not when its values come.)
        build = phases["from_pretrained on meta + optimizer"]
        assert build["peak"] < 2 * whole // WORLD + whole // 8, (rank, build["peak"] >> 20, whole >> 20)
        # Loaded shard by shard: the gradient shard, staging and one part at a time, never the whole model.
        load = phases["ShardedDDP: materialise, read own shards"]["peak"] - build["after"]
        assert load < whole, (rank, load >> 20, whole >> 20)
        if rank:  # rank 0 writes the files: their page cache is charged to it
            save = phases["save_weights (streamed)"]["peak"] - phases["step 2"]["after"]
            assert save < whole // 2, (rank, save >> 20, whole >> 20)  # no whole gather
    again, info = transformers.LlamaForCausalLM.from_pretrained(spec["out"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert torch.isfinite(torch.tensor(results[0]["losses"])).all()
