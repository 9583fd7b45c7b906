"""The tests' name for shardopt.cluster.ranks (the multi-rank launcher, shared with benchmarks/): ranks forked
from a forkserver that imported torch and shardopt once (Note [Ranks from a forkserver] there)."""
import functools

from shardopt.cluster.ranks import RankFailure  # noqa: F401
from shardopt.cluster.ranks import run_ranks as _run_ranks

run_ranks = functools.partial(_run_ranks, start_method="forkserver")


# Note [Several cases in one launch]
# A launch costs more than its fork: each rank sets up its process group and imports what the case needs
# beyond torch and shardopt (transformers and accelerate, Lightning, DeepSpeed, TRL: seconds per rank on 2
# cores). Tests that launch the same world size with the same imports share one launch: run_cases runs
# each case on every rank in turn, catching what a case raises, so that one case's failure is reported
# under its own name (and the rank's traceback) and the other cases still run and report theirs.
def _run_cases(rank, world_size, cases):
    import traceback

    out = {}
    for name, (fn, args) in cases.items():
        try:
            out[name] = (True, fn(rank, world_size, *args))
        except Exception:  # noqa: BLE001 - reported under the case's name (case_results)
            out[name] = (False, traceback.format_exc())
    return out


def run_cases(world_size, cases, timeout):
    """cases: {name: (fn, args)}, each run as fn(rank, world_size, *args) on every rank of one launch, in
    order. Returns {name: per-rank outcomes}; case_results turns one into the ranks' results or a failure
    naming the case."""
    per_rank = run_ranks(_run_cases, world_size, cases, timeout=timeout)
    return {name: [r[name] for r in per_rank] for name in cases}


def case_results(outcomes, name):
    """The ranks' results of case `name` of run_cases' outcomes; an AssertionError naming the case and
    each failing rank's traceback if any rank raised."""
    failed = [f"case {name!r}, rank {r} raised:\n{value}" for r, (ok, value) in enumerate(outcomes[name]) if not ok]
    if failed:
        raise AssertionError("\n".join(failed))
    return [value for _, value in outcomes[name]]


class SharedLaunch:
    """One launch of `world_size` ranks for the cases of a file's tests (Note [Several cases in one launch]),
    made the first time a test asks for one of them: `cases()` returns run_cases' {name: (fn, args)} (and makes
    whatever folders they write into, under `root`)."""

    def __init__(self, world_size, cases, timeout, root=None):
        self.world_size, self.cases, self.timeout, self.root = world_size, cases, timeout, root
        self.outcomes = None

    def results(self, name):
        if self.outcomes is None:
            self.outcomes = run_cases(self.world_size, self.cases(), self.timeout)
        return case_results(self.outcomes, name)
