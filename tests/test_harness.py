"""The multi-rank harness itself: it must report a failing rank and never hang."""
import pytest
import torch
import torch.distributed as dist

from dist_harness import RankFailure, run_ranks


def _allreduce_rank(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _one_rank_raises(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    t = torch.zeros(1)
    dist.all_reduce(t)  # rank 1 never joins: must time out, not hang
    return t.item()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_all_reduce_runs(world_size):
    expected = world_size * (world_size + 1) / 2
    assert run_ranks(_allreduce_rank, world_size) == [expected] * world_size


def test_failing_rank_is_reported_not_hung():
    with pytest.raises(RankFailure, match="boom on rank 1"):
        run_ranks(_one_rank_raises, 2, timeout=60, collective_timeout=5)


def _environment(rank, world_size):
    import os

    return os.environ.get("SHARDOPT_TEST_HARNESS_VALUE")


def test_ranks_see_the_callers_environment_of_the_moment(monkeypatch):
    # Note [Ranks from a forkserver]: the server is started once, so each launch hands its ranks the caller's
    # environment as it is then (set before this launch, changed before the next).
    monkeypatch.setenv("SHARDOPT_TEST_HARNESS_VALUE", "first")
    assert run_ranks(_environment, 2) == ["first"] * 2
    monkeypatch.setenv("SHARDOPT_TEST_HARNESS_VALUE", "second")
    assert run_ranks(_environment, 2) == ["second"] * 2
    monkeypatch.delenv("SHARDOPT_TEST_HARNESS_VALUE")
    assert run_ranks(_environment, 2) == [None] * 2
