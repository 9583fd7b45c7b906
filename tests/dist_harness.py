"""The tests' name for shardopt.testing (the multi-rank launcher, shared with benchmarks/)."""
from shardopt.testing import RankFailure, run_ranks  # noqa: F401
