"""The tests' name for shardopt.cluster.ranks (the multi-rank launcher, shared with benchmarks/): ranks forked
from a forkserver that imported torch and shardopt once (Note [Ranks from a forkserver] there)."""
import functools

from shardopt.cluster.ranks import RankFailure  # noqa: F401
from shardopt.cluster.ranks import run_ranks as _run_ranks

run_ranks = functools.partial(_run_ranks, start_method="forkserver")
