"""Ring reduce-scatter / all-gather (csrc/comm/ring.cpp) on real gloo ranks.

One spawn per world size runs every configuration in a loop (spawning costs
seconds; the collectives milliseconds). References:
- integer-valued data: every partial sum is an integer well inside the exact
  range of bfloat16 (|sum| <= 4 * 8 < 256), so ours must equal torch's
  all_reduce + slice / all_gather_into_tensor bit for bit, whatever the order;
- random data: a float64 sum of every rank's (regenerated) input, within the
  error bound of summing in the dtype (see _check_close).
"""
import time

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_ranks

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Chunk sizes (elements per rank), with pieces of SMALL_PIECE bytes:
#   0: empty buckets still run (and agree across ranks);
#   1, 7: a chunk smaller than a piece, and smaller than the ring;
#   129: not a multiple of the piece (16 fp32 / 32 bf16 elements), so the
#        last piece is short (1 element);
#   1000: many pieces, more than the scratch depth, so slots are reused.
CHUNKS = (0, 1, 7, 129, 1000)
SMALL_PIECE = 64  # bytes


def _inputs(kind, chunk, world_size, rank, dtype, seed):
    """Rank `rank`'s input; any rank can regenerate any other's for a reference."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    n = chunk * world_size
    if kind == "int":
        return torch.randint(-8, 9, (n,), generator=g).to(dtype)
    return torch.randn(n, generator=g).to(dtype)


def _check_close(ours, inputs_all, rank, chunk, dtype, world_size):
    """Random data against a float64 reference.

    Ours adds world_size terms in `dtype`, rounding after each of the
    world_size-1 additions; each rounding errs by at most u = eps/2 of the
    partial sum, and |partial| <= sum_i |x_i|. So |ours - exact| <=
    (world_size-1) * u * sum_i |x_i|, elementwise. (The inputs are exactly
    representable: they were rounded to dtype before anyone summed them.)
    """
    sl = slice(rank * chunk, (rank + 1) * chunk)
    parts = torch.stack([x[sl].double() for x in inputs_all])
    exact, magnitude = parts.sum(0), parts.abs().sum(0)
    u = torch.finfo(dtype).eps / 2
    bound = (world_size - 1) * u * magnitude
    err = (ours.double() - exact).abs()
    assert bool((err <= bound).all()), (
        f"{dtype} chunk {chunk}: max error {err.max().item()} exceeds bound "
        f"{bound[err.argmax()].item()}")


def _reference_rs(x):
    """torch's answer: all_reduce + slice (exact for integer data)."""
    full = x.clone()
    dist.all_reduce(full)
    r, w = dist.get_rank(), dist.get_world_size()
    n = x.numel() // w
    return full[r * n:(r + 1) * n]


def _reference_ag(x):
    out = torch.empty(x.numel() * dist.get_world_size(), dtype=x.dtype)
    dist.all_gather_into_tensor(out, x)
    return out


def _exactness(rank, world_size):
    from shardopt import _C
    from shardopt.parallel import comm

    assert _C.ring_is_default(dist.group.WORLD)  # "auto" means the ring on gloo
    _C.set_ring_piece_bytes(SMALL_PIECE)
    seed = 0
    # ("auto" is the ring here, as asserted above; the last block below runs it.)
    for impl in ("ring", "native"):
        for depth in ((1, 4) if impl == "ring" else (4,)):
            _C.set_ring_depth(depth)
            for dtype in DTYPES:
                for chunk in CHUNKS:
                    seed += 1
                    where = f"impl={impl} depth={depth} {dtype} chunk={chunk}"
                    # Reduce-scatter, integer data: bitwise equal to all_reduce + slice.
                    x = _inputs("int", chunk, world_size, rank, dtype, seed)
                    out = torch.full((chunk,), float("nan"), dtype=dtype)
                    comm.start_reduce_scatter(x.clone(), out, impl=impl).wait()
                    assert torch.equal(out, _reference_rs(x)), where

                    # Same, in place: output is input's own chunk.
                    buf = x.clone()
                    own = buf[rank * chunk:(rank + 1) * chunk]
                    comm.start_reduce_scatter(buf, own, impl=impl).wait()
                    assert torch.equal(own, _reference_rs(x)), where + " in-place"

                    # Random data, against float64.
                    xs = [_inputs("randn", chunk, world_size, r, dtype, seed) for r in range(world_size)]
                    out = torch.empty(chunk, dtype=dtype)
                    comm.start_reduce_scatter(xs[rank].clone(), out, impl=impl).wait()
                    _check_close(out, xs, rank, chunk, dtype, world_size)

                    # All-gather: bitwise equal to all_gather_into_tensor; input untouched.
                    y = _inputs("randn", chunk, 1, rank, dtype, seed)
                    y_before = y.clone()
                    gathered = torch.full((chunk * world_size,), float("nan"), dtype=dtype)
                    comm.start_all_gather(y, gathered, impl=impl).wait()
                    assert torch.equal(gathered, _reference_ag(y)), where
                    assert torch.equal(y, y_before), where + " all-gather wrote its input"

                    # In place: input is a view of output's own chunk; the rest is garbage.
                    flat = torch.full((chunk * world_size,), float("nan"), dtype=dtype)
                    flat[rank * chunk:(rank + 1) * chunk] = y
                    comm.start_all_gather(flat[rank * chunk:(rank + 1) * chunk], flat, impl=impl).wait()
                    assert torch.equal(flat, _reference_ag(y)), where + " in-place"
    # One size spanning several default-size pieces, with the default depth.
    _C.set_ring_piece_bytes(1 << 20)
    _C.set_ring_depth(4)
    chunk = (3 << 20) // 4 + 5  # 3 MB of fp32 per chunk: 4 pieces, the last 20 bytes
    x = _inputs("int", chunk, world_size, rank, torch.float32, 999)
    out = torch.empty(chunk)
    comm.start_reduce_scatter(x.clone(), out).wait()
    assert torch.equal(out, _reference_rs(x))
    gathered = torch.empty(chunk * world_size)
    comm.start_all_gather(out, gathered).wait()
    assert torch.equal(gathered, _reference_ag(out))
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_exact_against_torch(world_size):
    assert run_ranks(_exactness, world_size, timeout=200) == [True] * world_size


def _many_in_flight(rank, world_size):
    """8 reduce-scatters and 8 all-gathers of different sizes and dtypes, all
    started before any is waited for: each must still get its own data."""
    from shardopt import _C
    from shardopt.parallel import comm

    _C.set_ring_piece_bytes(256)
    ops = []
    for i in range(8):
        dtype = DTYPES[i % 3]
        chunk = 50 * i + 3
        x = _inputs("int", chunk, world_size, rank, dtype, 100 + i)
        out = torch.empty(chunk, dtype=dtype)
        y = _inputs("int", chunk, 1, rank, dtype, 200 + i)
        gathered = torch.empty(chunk * world_size, dtype=dtype)
        ops.append((x, comm.start_reduce_scatter(x.clone(), out), y, comm.start_all_gather(y, gathered)))
    # torch's references run on gloo's own threads and tags, concurrently with ours.
    for x, rs, y, ag in ops:
        assert torch.equal(rs.wait(), _reference_rs(x))
        assert torch.equal(ag.wait(), _reference_ag(y))
    # The handle is a regular torch Work, whose future yields the output.
    x = _inputs("int", 4, world_size, rank, torch.float32, 300)
    h = comm.start_reduce_scatter(x.clone(), torch.empty(4))
    (out,) = h.work.get_future().wait()
    assert h.is_completed()
    assert torch.equal(out, _reference_rs(x))
    return True


def test_many_buckets_in_flight():
    # 3 ranks: messages are forwarded around the ring, not just exchanged.
    assert run_ranks(_many_in_flight, 3) == [True] * 3


def _bad_inputs(rank, world_size):
    from shardopt import _C
    from shardopt.parallel import comm

    f = torch.zeros
    cases = [
        # (reduce-scatter input, output, message fragment)
        (f(8, 2), f(8), "1-D"),
        (f(16)[::2], f(4), "contiguous"),
        (f(8), f(4, dtype=torch.float16), "dtypes differ"),
        (f(8, dtype=torch.int32), f(4, dtype=torch.int32), "dtype must be"),
        (f(7), f(3), "not a multiple of world size"),
        (f(8), f(3), "must be input numel / world size"),
    ]
    for impl in ("ring", "native"):
        for x, out, msg in cases:
            with pytest.raises(ValueError, match=msg):
                comm.start_reduce_scatter(x, out, impl=impl)
        with pytest.raises(ValueError, match="must be world size"):
            comm.start_all_gather(f(4), f(7), impl=impl)
        buf = f(8)
        with pytest.raises(ValueError, match="not exactly its chunk"):
            comm.start_reduce_scatter(buf, buf[1:5], impl=impl)  # overlaps, wrong place
        with pytest.raises(ValueError, match="not exactly its chunk"):
            comm.start_all_gather(buf[1:5], buf, impl=impl)
    with pytest.raises(ValueError, match="impl must be"):
        comm.start_reduce_scatter(f(8), f(4), impl="fast")
    with pytest.raises(ValueError, match="positive"):
        _C.set_ring_piece_bytes(0)
    # Refused inputs never reached the queue: the group still works.
    x = _inputs("int", 4, world_size, rank, torch.float32, 1)
    assert torch.equal(comm.start_reduce_scatter(x.clone(), f(4)).wait(), _reference_rs(x))
    return True


def test_bad_inputs_raise_before_anything_runs():
    assert run_ranks(_bad_inputs, 2) == [True, True]


def _all_to_all_and_bytes(rank, world_size):
    """comm.start_all_to_all (OneBitAdam's first exchange, point to point on the group's worker) equals torch's
    all_to_all_single bit for bit, uint8 and fp32, rows of 1 and of 3000 elements, several in flight beside a
    ring op; the ring all-gather moves uint8 as torch's all_gather_into_tensor; bad inputs are refused."""
    from shardopt.parallel import comm

    out = []
    g = torch.Generator().manual_seed(rank)
    for dtype, n in ((torch.uint8, 1), (torch.uint8, 3000), (torch.float32, 3000)):
        x = torch.randint(0, 255, (world_size * n,), generator=g).to(dtype)
        want = torch.empty_like(x)
        dist.all_to_all_single(want, x)
        got = [torch.full_like(x, 7) for _ in range(2)]
        handles = [comm.start_all_to_all(x, got[0]),
                   comm.start_reduce_scatter(torch.ones(4 * world_size), torch.empty(4)),
                   comm.start_all_to_all(x, got[1])]
        comm.finish(handles)
        out += [f"all_to_all {dtype} n={n}: differs" for t in got if not torch.equal(t, want)]
        mine = x[:n].contiguous()
        want_ag = torch.empty_like(x)
        dist.all_gather_into_tensor(want_ag, mine)
        if not torch.equal(comm.start_all_gather(mine, torch.empty_like(x)).wait(), want_ag):
            out.append(f"all_gather {dtype} n={n}: differs")
    for bad, match in (((torch.zeros(3 * world_size + 1), torch.zeros(3 * world_size + 1)), "multiple of the group"),
                       ((torch.zeros(6 * world_size), torch.zeros(3 * world_size)), "same numel"),
                       ((torch.zeros(6, dtype=torch.int32), torch.zeros(6, dtype=torch.int32)), "dtype must be")):
        try:
            comm.start_all_to_all(*bad)
            out.append(f"all_to_all {match}: not refused")
        except ValueError as e:
            if match not in str(e):
                out.append(f"all_to_all: unclear error {e}")
    buf = torch.zeros(3 * world_size)
    try:
        comm.start_all_to_all(buf, buf)
        out.append("all_to_all in place: not refused")
    except ValueError as e:
        if "overlap" not in str(e):
            out.append(f"all_to_all: unclear error {e}")
    return out


def test_all_to_all_and_byte_gathers_equal_torch():
    for rank, failures in enumerate(run_ranks(_all_to_all_and_bytes, 3)):
        assert not failures, f"rank {rank}: " + "\n".join(failures)


def _waited_twice(rank, world_size):
    """Note [gloo's reduce-scatter copies on every wait] (csrc/comm/gloo_reduce_scatter.h): gloo's own reduce-scatter
    copies its result into the output at each wait(). Waited for from two threads, with the output summed
    into in between (what an inter-node phase does), the second wait must leave the output alone."""
    import threading

    from shardopt.parallel import comm

    out = []
    for impl in ("native", "ring"):
        x = _inputs("int", 4, world_size, rank, torch.float32, 2)
        handle = comm.start_reduce_scatter(x.clone(), torch.empty(4), impl=impl)
        waiter = threading.Thread(target=handle.wait)
        waiter.start()
        waiter.join()
        done = handle.is_completed()
        handle.output.add_(100.0)  # the inter-node phase's sum, in place
        out.append((impl, done, torch.equal(handle.wait(), _reference_rs(x) + 100.0)))
    return out


def test_a_reduce_scatter_waited_twice_keeps_what_came_after_the_first_wait():
    for rank, results in enumerate(run_ranks(_waited_twice, 2)):
        for impl, done, kept in results:
            assert done, f"rank {rank} {impl}: is_completed() is False after wait() returned"
            assert kept, f"rank {rank} {impl}: a second wait() overwrote the output"


GROUP_TIMEOUT = 3  # seconds


def _peer_fails(rank, world_size, how):
    """Rank 1 never joins the collective: it exits ("dies") or idles ("hangs").
    Rank 0 must get an error from wait() within the group timeout (plus slack),
    and every later op of the group must fail at once (Note [Failure is sticky])."""
    from shardopt.parallel import comm

    if rank == 1:
        if how == "hangs":
            time.sleep(GROUP_TIMEOUT + 2)  # outlive rank 0's wait, then leave
        return None
    x, out = torch.ones(1 << 16), torch.empty(1 << 15)
    if how == "dies":
        time.sleep(1)  # let rank 1 get out of the group first
    t0 = time.monotonic()
    with pytest.raises(dist.DistBackendError) as err:
        comm.start_reduce_scatter(x, out).wait()
    elapsed = time.monotonic() - t0
    t0 = time.monotonic()
    with pytest.raises(dist.DistBackendError, match="earlier shardopt collective"):
        comm.start_all_gather(out, x).wait()
    return str(err.value), elapsed, time.monotonic() - t0


@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_dead_peer_makes_wait_raise(how):
    (msg, elapsed, later), _ = run_ranks(_peer_fails, 2, how, timeout=60, collective_timeout=GROUP_TIMEOUT)
    # The peer by its global rank and host (Note [Naming a peer]); tests/test_peer_errors.py: every path.
    assert "shardopt ring reduce_scatter on rank 0 of 2 in the world group (global rank 0)" in msg, msg
    assert "from global rank 1 (" in msg and "rank 1 of the world group)" in msg, msg
    assert elapsed < GROUP_TIMEOUT + 5, f"wait() took {elapsed:.1f}s, group timeout {GROUP_TIMEOUT}s"
    if how == "hangs":  # nothing tells rank 0 but the clock: the group's timeout must be the one used
        assert elapsed > GROUP_TIMEOUT * 0.9, f"gave up after {elapsed:.1f}s, before the group timeout"
    # Sticky: the next op fails at once, without waiting. One that waited would fail only when the group's
    # timeout ran out (>= GROUP_TIMEOUT, as the hang above shows), so the bar sits just under that, not at a
    # second: an op that raises in milliseconds can still be descheduled for a while on a busy 2-core machine.
    assert later < GROUP_TIMEOUT * 0.9, f"the op after the failure took {later:.1f}s to fail"



def _native_peer_fails(rank, world_size):
    """Rank 1 idles past the group's timeout while rank 0 is in a native all-reduce (gloo's own, as the
    end-of-backward flags are): rank 0's error must say a peer is probably gone and what was reduced, not
    only gloo's "Timed out waiting ...ms for send operation"."""
    from shardopt.parallel import comm

    if rank == 1:
        time.sleep(GROUP_TIMEOUT + 2)
        return None
    with pytest.raises(RuntimeError) as err:  # gloo's own type (RuntimeError or DistBackendError), kept
        comm.all_reduce(torch.ones(4), dist.group.WORLD, "end-of-backward")
    return str(err.value)


def test_native_all_reduce_failure_names_the_cause():
    msg, _ = run_ranks(_native_peer_fails, 2, timeout=60, collective_timeout=GROUP_TIMEOUT)
    assert "the end-of-backward all-reduce failed on rank 0" in msg and "peer rank has probably exited" in msg, msg
