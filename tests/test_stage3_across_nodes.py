"""Stage 3's parameters across nodes in fewer bytes (Note [Stage 3's parameters across nodes, rounded] in
shardopt/parallel/mesh_plan.py): inter_node_param_dtype=torch.bfloat16 or "int8" at stage 3.

The rounding itself is pure (shardopt.reference.param_phase_reference, against the int8 codec); the two-level
gather that carries it is compared bit for bit with two_level_all_gather_reference on 2 nodes x 2 and 2 x 1
ranks (LOCAL_WORLD_SIZE groups ranks of 127.0.0.1 into nodes: which link a byte takes changes no number;
tests/test_cluster.py counts the link's bytes on the emulated cluster). In training, what every rank holds
inside a pass equals the reference rounding of every rank's shard, bit for bit, and the shard itself stays
the exact master: a single-process reference whose model holds its masters rounded the same way trains
alike, whole weights are the masters, and a checkpoint resumed gives the uninterrupted run bit for bit.
"""
import copy
import os

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_ranks
from models import AwkwardNet, awkward_loss, decay_groups

FORMATS = {"bfloat16": torch.bfloat16, "int8": "int8"}  # the reference's name -> inter_node_param_dtype


# ------------------------------------------------------------------ the rounding (pure)
def _blocks_of_magnitudes(n, seed):
    """n values whose blocks of 256 span many magnitudes (and a block of zeros), so scales differ per block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    for b in range(0, n, 256):
        x[b:b + 256] *= 10.0 ** ((b // 256) % 9 - 4)
    if n > 512:
        x[256:512] = 0.0
    return x


@pytest.mark.parametrize("n", [1, 77, 256, 257, 1000, 4096 + 3])
def test_int8_rounding_is_the_codec_without_feedback_and_bounded(n):
    from shardopt._ext import _C
    from shardopt.reference import int8_block_encode_reference, param_phase_reference

    x = _blocks_of_magnitudes(n, n)
    got = param_phase_reference(x, "int8")
    # The extension's codec (what csrc/comm/two_level.cpp sends and decodes), bit for bit.
    decoded = torch.empty(n)
    payload = _C.int8_encode(x, None, decoded)
    assert payload.numel() == 4 * (-(-n // 256)) + n and torch.equal(decoded, got)
    # Each value moves by at most half its block's step; a block of zeros stays zeros; signs stay.
    scale, _ = int8_block_encode_reference(x)
    step = scale.repeat_interleave(256)[:n]
    assert bool(((got - x).abs() <= step / 2 * (1 + 1e-6)).all())
    assert bool((got[x == 0] == 0).all()) and bool((got * x >= 0).all())
    # Rounding what was rounded lands on the same int8 values (the scale may move by an ulp).
    assert torch.allclose(param_phase_reference(got, "int8"), got, rtol=1e-6, atol=0)


def test_rounding_keeps_nonfinite_values_in_their_block():
    from shardopt.reference import param_phase_reference

    x = torch.linspace(-1, 1, 768)
    x[300] = float("nan")
    got = param_phase_reference(x, "int8")
    assert bool(torch.isnan(got[256:512]).all())  # the step's inf/nan check still sees the block
    assert torch.isfinite(got[:256]).all() and torch.isfinite(got[512:]).all()
    bf16 = param_phase_reference(x, "bfloat16")
    assert torch.isnan(bf16[300]) and torch.equal(bf16[:300], x[:300].to(torch.bfloat16).float())


def test_two_level_reference_places_each_rank_and_rounds_it_alike():
    from shardopt.reference import param_phase_reference, two_level_all_gather_reference

    inputs = [_blocks_of_magnitudes(300, r) for r in range(4)]
    for fmt in (None, "bfloat16", "int8"):
        out = two_level_all_gather_reference(inputs, 2, fmt)
        for rank, x in enumerate(inputs):
            at = (rank % 2) * 2 + rank // 2  # Note [Node-aware chunk order]: local * nodes + node
            assert torch.equal(out[at * 300:(at + 1) * 300], param_phase_reference(x, fmt))
    assert torch.equal(two_level_all_gather_reference(inputs, 1, "int8"), torch.cat(inputs))  # one node: exact


def test_link_bytes_of_each_parameter_phase():
    from shardopt.estimate import EstimateConfig, estimate
    from shardopt.parallel.mesh_plan import bytes_per_element, two_level_link_bytes

    s = 4 * 10**6
    int8 = 1 + 4 / 256
    assert two_level_link_bytes(2, s, param_gathers=2) == 1.5 * s  # 3 (R-1)/R S
    assert two_level_link_bytes(2, s, "bfloat16", "bfloat16", param_gathers=2) == s / 4 + s / 2
    assert two_level_link_bytes(2, s, "int8", "int8", param_gathers=2) == pytest.approx(1.5 * s / 4 * int8)
    assert two_level_link_bytes(2, s, "bfloat16", "int8", param_gathers=2) == pytest.approx(s / 4 + s / 4 * int8)
    assert bytes_per_element(None, 2) == 2 and bytes_per_element("int8") == int8
    # estimate: per node per step from the padded layout, for each option (Note [Estimate of the link's bytes]).
    shapes = [("w", (1024, 1024))]
    rows = {}
    for grads, params in ((None, None), ("bfloat16", "bfloat16"), ("bfloat16", "int8"), ("int8", "int8")):
        cfg = EstimateConfig(world_size=4, shards=2, node_aware=True, stage=3, inter_node_dtype=grads,
                             inter_node_param_dtype=params, device="cpu")
        rows[grads, params] = estimate(shapes, cfg)
    numel = 2**20  # a multiple of lcm(4, 128): no padding
    assert rows[None, None].link == 3 * numel * 4 / 2
    assert rows["int8", "int8"].link == pytest.approx(3 * numel * int8 / 2)
    assert rows["bfloat16", "int8"].link == pytest.approx(numel * (2 + 2 * int8) / 2)
    # Stage 3's shard is the master: no second master whatever the phase (stages 1-2 keep one).
    assert {m.master for m in rows.values()} == {0}
    assert estimate(shapes, EstimateConfig(world_size=4, shards=2, node_aware=True, stage=2, device="cpu",
                                           inter_node_param_dtype="bfloat16")).master > 0
    assert estimate(shapes, EstimateConfig(world_size=4, shards=2, stage=3, device="cpu")).link == numel * 4
    assert estimate(shapes, EstimateConfig(world_size=4, stage=3, device="cpu")).link is None


def test_refusals_that_need_no_process_group():
    from shardopt.config import ShardConfig
    from shardopt.estimate import EstimateConfig

    with pytest.raises(ValueError, match="'int8' is built for stage 3"):
        ShardConfig(stage=2, inter_node_param_dtype="int8")
    with pytest.raises(ValueError, match="inter_node_param_dtype must be None"):
        ShardConfig(stage=3, inter_node_param_dtype=torch.float16)
    assert ShardConfig(stage=3, inter_node_param_dtype="int8").inter_node_param_dtype == "int8"
    assert ShardConfig(stage=3, inter_node_param_dtype=torch.bfloat16).inter_node_param_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="built for stage 3"):
        EstimateConfig(world_size=4, shards=2, node_aware=True, stage=2, inter_node_param_dtype="int8")
    with pytest.raises(ValueError, match="needs node_aware"):
        EstimateConfig(world_size=4, shards=2, stage=3, inter_node_param_dtype="int8")


# ------------------------------------------------------------------ the gather (2 nodes)
def _gather(rank, world_size):
    """comm.start_two_level_all_gather with each across_dtype vs two_level_all_gather_reference, bit for bit:
    chunks of 1 value, under a block, several blocks, and not a multiple of 4 bytes (int8 slots are padded);
    apart and in place (the owner's own chunk is overwritten by its rounding); every output chunk of every
    rank; what cannot be narrowed is refused."""
    from shardopt.layout import chunk_index
    from shardopt.parallel import comm
    from shardopt.parallel.mesh import two_level_groups
    from shardopt.parallel.mesh_plan import MeshShape
    from shardopt.reference import two_level_all_gather_reference

    out = []
    node, across = two_level_groups(MeshShape(2, world_size // 2), dist.group.WORLD)
    c = chunk_index(rank, world_size, 2)
    for fmt, dtype in (("int8", torch.int8), ("bfloat16", torch.bfloat16), (None, None)):
        for n in (1, 77, 256, 1001, 3 * 2**16 + 5):
            inputs = [_blocks_of_magnitudes(n, 10 * n + r) for r in range(world_size)]
            want = two_level_all_gather_reference(inputs, 2, fmt)
            mine = inputs[rank].clone()
            apart = torch.full((world_size * n,), -1.0)
            in_place = torch.full((world_size * n,), -1.0)
            in_place[c * n:(c + 1) * n] = inputs[rank]
            handles = [comm.start_two_level_all_gather(mine, apart, node, across, across_dtype=dtype),
                       comm.start_two_level_all_gather(in_place[c * n:(c + 1) * n], in_place, node, across,
                                                       across_dtype=dtype)]
            for name, got in zip(("apart", "in place"), comm.finish(handles)):
                if not torch.equal(got, want):
                    bad = (got != want).nonzero()[:3].flatten().tolist()
                    out.append(f"{fmt} n={n} {name}: differs from the reference at {bad}")
            if not torch.equal(mine, inputs[rank]):
                out.append(f"{fmt} n={n}: the input was written")
    for dtype, buf, match in ((torch.float16, torch.zeros(world_size * 8), "bfloat16 or int8"),
                              (torch.int8, torch.zeros(world_size * 8, dtype=torch.bfloat16), "float32")):
        try:
            comm.start_two_level_all_gather(buf[c * 8:(c + 1) * 8].clone(), buf, node, across,
                                            across_dtype=dtype).wait()
            out.append(f"across_dtype={dtype} on {buf.dtype} was accepted")
        except ValueError as e:
            if match not in str(e):
                out.append(f"across_dtype={dtype}: unclear error {e}")
    return out


@pytest.mark.parametrize("world_size", [4, 2])
def test_rounded_two_level_gather_matches_reference(world_size):
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size // 2)
    try:
        results = run_ranks(_gather, world_size, timeout=300)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}: " + "\n".join(failures[:8])


# ------------------------------------------------------------------ training (2 nodes x 2 ranks)
def _rounded_as_gathered(layout, values, fmt):
    """`values` (one per trainable parameter, in the layout's order) as every rank holds them inside a pass:
    each bucket's chunks rounded one by one (param_phase_reference), the persistent buckets exact."""
    from shardopt.reference import param_phase_reference

    flat = torch.zeros(layout.total_numel)
    for slot, v in zip(layout.params, values):
        flat[slot.offset:slot.end] = v.detach().reshape(-1)
    for b in layout.buckets:
        for c in range(b.world_size):
            lo = b.start + c * b.chunk_numel
            flat[lo:lo + b.chunk_numel] = param_phase_reference(flat[lo:lo + b.chunk_numel],
                                                                None if b.persistent else fmt)
    return [flat[slot.offset:slot.end].view(slot.shape) for slot in layout.params]


class _Reference:
    """One process, every rank's batch: the mean gradient, AdamW on fp32 masters, clipped as clip_grad_norm_;
    its model holds the masters rounded as the sharded run's gathers round them (_rounded_as_gathered).
    Each step starts from the sharded run's masters (`start_from`): a master that differs by summation order
    (1e-7) may round to the next int8 step, and one such weight would make the two runs drift apart."""

    def __init__(self, model, world_size, layout, fmt):
        self.model, self.world_size, self.layout, self.fmt = copy.deepcopy(model), world_size, layout, fmt
        groups = decay_groups(self.model)
        self.params = [p for g in groups for p in g["params"]]  # the layout's order
        self.master = [p.detach().clone() for p in self.params]
        index = {id(p): i for i, p in enumerate(self.params)}
        self.opt = torch.optim.AdamW([dict(g, params=[self.master[index[id(p)]] for p in g["params"]])
                                      for g in groups], lr=1e-2, weight_decay=0.1)
        self._publish()

    def start_from(self, masters):
        with torch.no_grad():
            for m, v in zip(self.master, masters):
                m.copy_(v)
        self._publish()

    def _publish(self):
        with torch.no_grad():
            for p, v in zip(self.params, _rounded_as_gathered(self.layout, self.master, self.fmt)):
                p.copy_(v)

    def step(self, step, clip):
        grads, losses = [None] * len(self.master), []  # None where no rank's batch reached it (the branch)
        for r in range(self.world_size):
            self.model.zero_grad(set_to_none=True)
            loss = awkward_loss(lambda x, u: self.model(x, u), step, r)
            loss.backward()
            losses.append(loss.item())
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    g = p.grad / self.world_size
                    grads[i] = g if grads[i] is None else grads[i] + g
        for m, g in zip(self.master, grads):
            m.grad = g
        torch.nn.utils.clip_grad_norm_([m for m in self.master if m.grad is not None], clip)
        self.opt.step()
        self._publish()
        return losses


def _held_like_reference(opt, fmt):
    """Failures unless every gathered bucket holds, bit for bit, every rank's chunk (its exact master) rounded
    as param_phase_reference rounds it: the owner's own chunk included, on every rank alike."""
    from shardopt.reference import two_level_all_gather_reference
    from shardopt.zero3.buckets import LIVE

    bk, out = opt.store.buckets, []
    world, nodes = dist.get_world_size(), opt.sharding.nodes.replicas
    for b, chunk in enumerate(bk.every_chunk):
        if bk.state[b] != LIVE:
            out.append(f"bucket {b} is not gathered after a forward with reshard_after_forward=False")
            continue
        chunks = [torch.empty_like(chunk) for _ in range(world)]
        dist.all_gather(chunks, chunk.contiguous())
        persistent = b < len(opt.layout.buckets) and opt.layout.buckets[b].persistent
        want = two_level_all_gather_reference(chunks, nodes, None if persistent else fmt)
        if not torch.equal(bk.full[b], want):
            out.append(f"bucket {b}: what this rank holds is not every rank's master rounded as {fmt}")
    return out


def _train_rounded(rank, world_size, fmt, grads=None, reshard=True, persist=0, steps=6):
    """Stage 3 AdamW with the parameter gathers across nodes in `fmt` (and the gradient phase in `grads`) vs
    _Reference; with reshard_after_forward=False every bucket is held after the forward, compared with
    _held_like_reference."""
    import shardopt

    what = f"{fmt} params, {grads} grads, reshard={reshard}, persistence {persist}"
    torch.manual_seed(0)
    base = AwkwardNet()
    base.frozen.requires_grad_(True)  # every weight trained: the reference rounds it by the layout
    model = copy.deepcopy(base)
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    opt = shardopt.ShardedOptimizer(decay_groups(model), optim=torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                                    stage=3, reduce_bucket_size=300, inter_node_param_dtype=FORMATS[fmt],
                                    inter_node_dtype=grads, reshard_after_forward=reshard,
                                    param_persistence_threshold=persist)
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    if opt.store.gather.route != "two-level" or opt.sharding.nodes.replicas != 2:
        return [f"{what}: not two-level over 2 nodes ({opt.store.gather.route}, {opt.sharding.nodes})"]
    wrapper = shardopt.ShardedDDP(model, opt)
    ref = _Reference(base, world_size, opt.layout, fmt)
    trained = [p for g in opt.param_groups for p in g["params"]]  # the layout's order
    names = [dict((id(p), n) for n, p in model.named_parameters())[id(p)] for p in trained]
    failures = []
    for step in range(steps):
        # Whole weights are the masters, gathered exact; full_params() with nothing written keeps them.
        shard = [c.clone() for c in opt.store.every_chunk]
        with opt.full_params():
            masters = [p.detach().clone() for p in trained]
        if not all(torch.equal(a, b) for a, b in zip(shard, opt.store.every_chunk)):
            failures.append(f"{what} step {step}: full_params() with nothing written changed the masters")
        if step and all(torch.equal(m, r) for m, r in zip(masters, _rounded_as_gathered(opt.layout, masters, fmt))):
            failures.append(f"{what} step {step}: the masters are all on the {fmt} grid: they were rounded")
        # One step from the same masters: summation order apart, the same step (with an exact gradient phase;
        # a compressed one has its own bit-for-bit reference: tests/hop_training_reference.py).
        for name, m, r in zip(names, masters, ref.master) if grads is None else ():
            err = ((m - r).abs().max() / r.abs().max().clamp_min(1e-12)).item()
            if err > 1e-5:
                failures.append(f"{what} step {step}: {name} relative error {err:.2e} vs the reference's step")
        ref.start_from(masters)
        loss = awkward_loss(wrapper, step, rank)
        if not reshard:
            failures += [f"{what} step {step}: {f}" for f in _held_like_reference(opt, fmt)]
        loss.backward()
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
        want = ref.step(step, 0.5)[rank]
        if loss.item() != want:  # the same weights, the same batch
            failures.append(f"{what} step {step}: loss {loss.item()!r} vs reference {want!r}")
    return failures


def _parity(rank, world_size):
    return (_train_rounded(rank, world_size, "int8", reshard=False)
            + _train_rounded(rank, world_size, "bfloat16", grads=torch.bfloat16, reshard=False, persist=60)
            + _train_rounded(rank, world_size, "int8", grads="int8"))


def test_rounded_parameter_gathers_train_like_the_reference():
    for rank, failures in enumerate(run_ranks(_parity, 4, timeout=600)):
        assert not failures, f"rank {rank}: " + "\n".join(failures[:8])


# ------------------------------------------------------------------ checkpoints and refusals
def _resume(rank, world_size, path, fmt):
    """Stage 3, parameters and gradients across nodes in `fmt` and int8 (its residual saved): 6 steps straight,
    saved after 3; a fresh run loads it and runs steps 3-5. Every loss of the resumed run, the first after the
    load too, and its final masters equal the straight run's bit for bit; the checkpoint holds the exact
    masters (not their rounding)."""
    import shardopt

    def build():
        torch.manual_seed(0)
        model = AwkwardNet()
        os.environ["LOCAL_WORLD_SIZE"] = "2"
        opt = shardopt.ShardedOptimizer(decay_groups(model), optim=torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                                        stage=3, reduce_bucket_size=300, inter_node_param_dtype=FORMATS[fmt],
                                        inter_node_dtype="int8")
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        return shardopt.ShardedDDP(model, opt), opt

    def train(wrapper, opt, steps):
        losses = []
        for step in steps:
            loss = awkward_loss(wrapper, step, rank)
            loss.backward()
            opt.clip_grad_norm(0.5)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    def masters(opt):
        return [c.clone() for c in opt.store.every_chunk]

    wrapper, opt = build()
    straight = train(wrapper, opt, range(3))
    shardopt.save_checkpoint(path, wrapper, opt, tag=f"s3-{fmt}")
    saved = masters(opt)
    straight += train(wrapper, opt, range(3, 6))
    final = masters(opt)
    del wrapper, opt
    wrapper, opt = build()
    shardopt.load_checkpoint(path, wrapper, opt, tag=f"s3-{fmt}")
    out = []
    if not all(torch.equal(a, b) for a, b in zip(masters(opt), saved)):
        out.append(f"{fmt}: the loaded masters differ from the saved run's")
    resumed = train(wrapper, opt, range(3, 6))
    if resumed != straight[3:]:
        out.append(f"{fmt}: losses after the load {resumed} vs the straight run's {straight[3:]}")
    if not all(torch.equal(a, b) for a, b in zip(masters(opt), final)):
        out.append(f"{fmt}: the resumed run's final masters differ from the straight run's")
    return out


def _resumes(rank, world_size, path):
    return _resume(rank, world_size, path, "int8") + _resume(rank, world_size, path, "bfloat16")


def test_checkpoint_resumes_bit_for_bit(tmp_path):
    for rank, failures in enumerate(run_ranks(_resumes, 4, str(tmp_path), timeout=300)):
        assert not failures, f"rank {rank}: " + "\n".join(failures)


def _refusals(rank, world_size):
    """inter_node_param_dtype is refused by name wherever no two-level gather carries stage 3's parameters."""
    import shardopt
    from torch.distributed.device_mesh import init_device_mesh

    out = []

    def refused(match, local=None, model=None, **kw):
        if local is not None:
            os.environ["LOCAL_WORLD_SIZE"] = str(local)
        try:
            shardopt.ShardedOptimizer((model or AwkwardNet()).parameters(), lr=1e-3, stage=3, **kw)
            out.append(f"{kw} (LOCAL_WORLD_SIZE={local}) was accepted")
        except (ValueError, TypeError, NotImplementedError) as e:
            if match not in str(e):
                out.append(f"{kw}: unclear error {e}")
        finally:
            os.environ.pop("LOCAL_WORLD_SIZE", None)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for fmt in FORMATS.values():
        refused("never sends parameters across nodes", mesh=mesh, inter_node_param_dtype=fmt)  # hybrid
        refused("one node", local=4, inter_node_param_dtype=fmt)  # every rank on one node
        refused("one node", inter_node_param_dtype=fmt)  # not launched across nodes (no LOCAL_WORLD_SIZE)
        refused("node_aware=False", local=2, node_aware=False, inter_node_param_dtype=fmt)
        refused("already cross", local=2, model=AwkwardNet().bfloat16(), inter_node_param_dtype=fmt)
    refused("must be None", local=2, inter_node_param_dtype=torch.float16)
    return out


def test_refused_where_no_two_level_gather_carries_the_parameters():
    for rank, failures in enumerate(run_ranks(_refusals, 4, timeout=300)):
        assert not failures, f"rank {rank}: " + "\n".join(failures)
