"""The tests' name for shardopt.cluster.ranks (the multi-rank launcher, shared with benchmarks/)."""
from shardopt.cluster.ranks import RankFailure, run_ranks  # noqa: F401
