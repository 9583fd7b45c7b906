"""The flat layout as pure tables: no process group needed (see Note [Flat layout])."""
import pytest

from shardopt.layout import CHUNK_ALIGN, first_difference, plan_launch_order, plan_layout


def _layout(shapes_per_group, ws, rbs, agbs=10**9):
    groups = [[(f"g{g}p{i}", s) for i, s in enumerate(shapes)] for g, shapes in enumerate(shapes_per_group)]
    return plan_layout(groups, ws, rbs, agbs)


@pytest.mark.parametrize("ws", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("rbs", [1, 100, 384, 1000, 10**6])
@pytest.mark.parametrize("shapes", [
    [[(10, 7), (13,), (1,), (0,), (300, 3)]],           # odd sizes, an empty one, one bigger than a bucket
    [[(5,), (129,)], [(3, 3), (1000,)], []],             # several groups, one with no trainable params
    [[(1,)]],
])
def test_invariants(ws, rbs, shapes):
    lay = _layout(shapes, ws, rbs)
    align = lay.align
    assert align % ws == 0 and align % CHUNK_ALIGN == 0
    # Buckets tile the buffer with no gap and every bucket splits evenly.
    at = 0
    for b in lay.buckets:
        assert b.start == at and b.numel % align == 0 and 0 < b.numel <= lay.bucket_numel
        at = b.end
    assert at == lay.total_numel
    # Parameters are disjoint contiguous runs; each group's region is contiguous and reversed.
    runs = sorted((p.offset, p.end) for p in lay.params)
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(runs, runs[1:]))
    for g in range(len(shapes)):
        mine = [p for p in lay.params if p.group == g]
        assert [p.offset for p in mine] == sorted((p.offset for p in mine), reverse=True)
        for b in lay.buckets:
            if b.group == g:
                assert all(lay.params[i].group == g for i in b.params)
    # Bucket membership is exactly overlap.
    for b in lay.buckets:
        want = {p.index for p in lay.params if p.numel and p.offset < b.end and p.end > b.start}
        assert set(b.params) == want
    # Pieces of all ranks cover every parameter element exactly once.
    covered = {p.index: 0 for p in lay.params}
    for r in range(ws):
        for pc in lay.pieces(r):
            b = lay.buckets[pc.bucket]
            cs, ce = b.chunk(r)
            assert cs <= pc.start < pc.end <= ce
            covered[pc.param] += pc.numel
    assert covered == {p.index: p.numel for p in lay.params}
    assert lay.shard_numel() * ws == lay.total_numel
    order = plan_launch_order(lay, list(range(len(lay.params))))
    assert sorted(order) == list(range(len(lay.buckets)))
    # Gathers cover each chunk exactly.
    for b in lay.buckets:
        spans = [(g.lo, g.hi) for g in lay.gather_spans if g.bucket == b.index]
        assert spans[0][0] == 0 and spans[-1][1] == b.chunk_numel
        assert all(h == lo for (_, h), (lo, _) in zip(spans, spans[1:]))


def test_worked_example():
    # Two params of 200 and 100 elements, ws=2, buckets of 128: reverse order puts
    # p1 (100) first at 0..100, p0 at 100..300; region padded to 384 -> 3 buckets.
    lay = _layout([[(20, 10), (100,)]], ws=2, rbs=100)
    assert [(p.offset, p.end) for p in lay.params] == [(100, 300), (0, 100)]
    assert [(b.start, b.numel, b.params) for b in lay.buckets] == [(0, 128, (1, 0)), (128, 128, (0,)),
                                                                   (256, 128, (0,))]
    # Rank 1 owns 64..128, 192..256, 320..384: p1 and p0 share its first chunk, and
    # its last chunk is all padding, so it holds no piece there.
    assert [(pc.param, pc.start, pc.end) for pc in lay.pieces(1)] == [(1, 64, 100), (0, 100, 128), (0, 192, 256)]
    assert [(pc.param, pc.start, pc.end) for pc in lay.pieces(0)] == [(1, 0, 64), (0, 128, 192), (0, 256, 300)]


def test_allgather_bucket_size_changes_gathers():
    small = _layout([[(4096,)]], ws=2, rbs=4096, agbs=512)
    big = _layout([[(4096,)]], ws=2, rbs=4096, agbs=10**6)
    assert len(big.gather_spans) == 1
    assert len(small.gather_spans) == 2048 // 256


def test_reduce_bucket_size_changes_buckets():
    assert len(_layout([[(10000,)]], 2, 1000).buckets) == 10
    assert len(_layout([[(10000,)]], 2, 10**6).buckets) == 1


def test_launch_order_follows_backward_across_groups():
    # Group 0 holds the last-registered layer's weight; group 1 its bias. Backward
    # reaches both early, so their buckets launch before earlier layers' buckets.
    groups = [[("w0", (256,)), ("w1", (256,))], [("b0", (256,)), ("b1", (256,))]]
    lay = plan_layout(groups, 2, 256, 10**6)
    positions = [0, 2, 1, 3]  # registered as w0, b0, w1, b1
    names = [[lay.params[i].name for i in lay.buckets[b].params] for b in plan_launch_order(lay, positions)]
    assert names == [["b1"], ["w1"], ["b0"], ["w0"]]
    # Positions in group order (no model to ask) launch the later group first.
    names = [[lay.params[i].name for i in lay.buckets[b].params] for b in plan_launch_order(lay, range(4))]
    assert names == [["b1"], ["b0"], ["w1"], ["w0"]]


def test_signature_names_first_difference():
    a = _layout([[(3, 4), (5,)]], 2, 1000).signature()
    b = _layout([[(4, 3), (5,)]], 2, 1000).signature()
    diff = first_difference(a, b)
    assert "g0p0" in diff and "[3, 4]" in diff and "[4, 3]" in diff
    assert first_difference(a, a) is None


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, None])
def test_bad_bucket_size(bad):
    with pytest.raises(ValueError, match="reduce_bucket_size"):
        plan_layout([[("p", (3,))]], 2, bad, 100)


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
@pytest.mark.parametrize("rbs", [1, 200, 1000, 10**6])
def test_whole_params_never_straddle(ws, rbs):
    # Stage 3 (Note [Stage-3 buckets hold whole parameters]): a parameter is a view of one bucket's own
    # storage, so it lies inside one bucket; small ones (here the 1-D shapes) sit in persistent buckets.
    shapes = [[(10, 7), (13,), (1,), (0,), (300, 3), (5,), (129,)], [(3, 3), (1000,)], []]
    groups = [[(f"g{g}p{i}", s) for i, s in enumerate(ss)] for g, ss in enumerate(shapes)]
    flat = [s for ss in shapes for s in ss]
    persistent = frozenset(i for i, s in enumerate(flat) if len(s) == 1 and s[0] < 200)
    lay = plan_layout(groups, ws, rbs, 10**9, whole_params=True, persistent=persistent)
    at = 0
    for b in lay.buckets:
        assert b.start == at and b.numel % lay.align == 0
        at = b.end
        for i in b.params:
            p = lay.params[i]
            assert b.start <= p.offset and p.end <= b.end          # whole, never straddling
            assert (i in persistent) == b.persistent
        # A bucket is over the size only when it holds one parameter that alone is.
        if b.numel > lay.bucket_numel:
            assert len(b.params) == 1 and lay.params[b.params[0]].numel > lay.bucket_numel - lay.align
    assert at == lay.total_numel
    covered = {p.index: 0 for p in lay.params}
    for r in range(ws):
        for pc in lay.pieces(r):
            covered[pc.param] += pc.numel
    assert covered == {p.index: p.numel for p in lay.params}
    assert lay.shard_numel() * ws == lay.total_numel
    assert "whole_params=True" in lay.signature()[0]


def test_whole_params_worked_example():
    # Two ranks, buckets of 256, align 128: reversed order puts c (100) first; b (200) would cross 256, so
    # c's bucket closes (padded to 128) and b starts one (256); a (300) is alone and over size (384);
    # d persists, in a bucket of its own at the end.
    groups = [[("a", (300,)), ("b", (200,)), ("c", (100,)), ("d", (4,))]]
    lay = plan_layout(groups, 2, 256, 10**9, whole_params=True, persistent=frozenset({3}))
    assert [(b.start, b.numel, b.params, b.persistent) for b in lay.buckets] == [
        (0, 128, (2,), False), (128, 256, (1,), False), (384, 384, (0,), False), (768, 128, (3,), True)]
    assert [p.offset for p in lay.params] == [384, 128, 0, 768]


def test_persistent_needs_whole_params():
    with pytest.raises(ValueError, match="whole_params"):
        plan_layout([[("a", (4,))]], 2, 256, 256, persistent=frozenset({0}))


@pytest.mark.parametrize("ws", [2, 3])
def test_stage_3_pads_big_buckets_to_whole_pages_per_chunk(ws):
    """Note [Stage-3 buckets mapped, not copied]: with page_numel, a non-persistent bucket whose chunk reaches
    MAP_MIN_PAGES pages is padded until every chunk is whole pages; smaller and persistent ones are not."""
    from shardopt.layout import MAP_MIN_PAGES

    page = 1024
    big, small = (MAP_MIN_PAGES * page * ws + 1,), (5000,)
    groups = [[("big", big), ("small", small), ("norm", (7,))]]
    plain = plan_layout(groups, ws, 10**4, 10**4, whole_params=True, persistent=frozenset({2}))
    paged = plan_layout(groups, ws, 10**4, 10**4, whole_params=True, persistent=frozenset({2}), page_numel=page)
    by_first = {lay: {lay.params[b.params[0]].name: b for b in lay.buckets} for lay in (plain, paged)}
    for name in ("small", "norm"):  # under the minimum, or persistent: as without pages
        assert by_first[paged][name].numel == by_first[plain][name].numel
    b = by_first[paged]["big"]
    assert b.chunk_numel % page == 0 and b.chunk_numel - by_first[plain]["big"].chunk_numel < page
    assert b.chunk_numel >= MAP_MIN_PAGES * page and b.numel % CHUNK_ALIGN == 0
    assert [p.shape for p in paged.params] == [p.shape for p in plain.params]
