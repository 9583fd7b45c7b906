"""shardopt.estimate against what a real ShardedOptimizer holds (memory_stats()), world sizes 1-3,
stages 1-2, on models whose sizes do not divide evenly (padding, straddling buckets, tied and frozen
parameters). The issue asks for 10%; fp32 without offload should be exact."""
import pytest
import torch

from dist_harness import run_ranks
from models import AwkwardNet, batch
from shardopt.estimate import EstimateConfig, estimate, estimate_ddp, frozen_shapes, meta_model, trainable_shapes
from shardopt.tools.gpt import num_params, small_model

TOLERANCE = 0.10


def _measure(rank, world_size):
    import os

    import shardopt
    from shardopt.tools.gpt import example_batch, tiny_model

    out = []
    cases = [("awkward", AwkwardNet, rbs, torch.float32, "none") for rbs in (None, 1000)] \
        + [("gpt-tiny", tiny_model, 20_000, torch.float32, "none"), ("awkward", AwkwardNet, 1000, torch.float32, "cpu"),
           ("awkward", AwkwardNet, 1000, torch.bfloat16, "none"), ("gpt-tiny", tiny_model, 20_000, torch.bfloat16, "cpu")]
    # One rank per node (LOCAL_WORLD_SIZE=1): node-aware collectives, stage 3's two-level gathers too.
    cases += [("awkward-nodes", AwkwardNet, 1000, torch.float32, "none")] if world_size > 1 else []
    # ... with the parameters across nodes in bf16 (fp32 masters; stages 1-2 only)
    cases += [("awkward-nodes-bf16p", AwkwardNet, 1000, torch.float32, "none")] if world_size > 1 else []
    for name, factory, rbs, dtype, offload in cases:
        for stage in (1, 2) if name.endswith("-bf16p") else (1, 2, 3):
            torch.manual_seed(0)
            model = factory().to(dtype)
            shapes = trainable_shapes(model)  # before stage 3 empties the parameters between uses
            frozen = frozen_shapes(model)     # AwkwardNet's frozen layer: sharded at stage 3 too
            if "-nodes" in name:
                os.environ["LOCAL_WORLD_SIZE"] = "1"
            extra = {"inter_node_param_dtype": torch.bfloat16} if name.endswith("-bf16p") else {}
            opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=1e-3, stage=stage,
                                            reduce_bucket_size=rbs, offload=offload, **extra)
            os.environ.pop("LOCAL_WORLD_SIZE", None)
            assert (opt.sharding.nodes is not None) == ("-nodes" in name), (name, stage, opt.sharding)
            wrapper = shardopt.ShardedDDP(model, opt)
            if name.startswith("awkward"):
                x, y = batch(0, rank)
                out_ = wrapper(x, True)  # the branch too: every parameter gets a gradient, so all have state
            else:
                out_ = wrapper(example_batch())
            out_.float().pow(2).mean().backward()
            opt.step()
            out.append((name, rbs, stage, (shapes, frozen), opt.memory_stats(), dtype, offload))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_estimate_matches_memory_stats(world_size):
    per_rank = run_ranks(_measure, world_size)
    for i, (name, rbs, stage, shapes, _, dtype, offload) in enumerate(per_rank[0]):
        # The estimate is for the rank holding the most (rank 0: the padding sits in the last rank's chunk).
        measured = {k: max(r[i][4][k] for r in per_rank) for k in per_rank[0][i][4]}
        nodes = dict(shards=1, node_aware=True) if "-nodes" in name else {}
        if name.endswith("-bf16p"):
            nodes["inter_node_param_dtype"] = "bfloat16"
        est = estimate(shapes[0], EstimateConfig(world_size=world_size, stage=stage, reduce_bucket_size=rbs,
                                                 param_dtype=dtype, offload=offload, device="cpu", **nodes),
                       frozen=shapes[1])
        predicted = est.as_stats()
        # Stage 3 between steps holds its chunks only; the estimate adds the peak of gathered buckets. Node-aware:
        # the node chunks of buckets being reduced exist only in backward.
        for key in ("params", "on_device"):
            predicted[key] -= est.gathered
        for key in ("staging", "on_device"):
            predicted[key] -= est.in_flight
        where = f"{name} rbs={rbs} stage={stage} ws={world_size} {dtype} offload={offload}"
        assert set(predicted) == set(measured), where
        for key, value in measured.items():
            if stage == 3 and key in ("staging", "on_device"):
                # The pool grows instead of waiting in backward (Note [Stage 3 never waits in backward]):
                # at least the estimate's buffers, never more than one per bucket.
                assert predicted[key] <= value, (where, key, predicted, measured)
                continue
            assert abs(predicted[key] - value) <= TOLERANCE * max(value, 1), (where, key, predicted, measured)


def test_meta_model_and_arithmetic():
    # Built on the meta device: shapes only. Tied embedding/head counted once, as the optimizer does.
    model = meta_model("shardopt.tools.gpt:small_model")
    assert next(model.parameters()).device.type == "meta"
    shapes = trainable_shapes(model)
    n = sum(torch.Size(s).numel() for _, s in shapes)
    assert n == num_params(small_model())
    ddp = estimate_ddp(shapes)
    assert ddp.total == 16 * n  # fp32 AdamW: 4 + 4 + 8 bytes per parameter
    # ZeRO-2 tends to 4 + 12/N bytes per parameter, plus staging; padding adds at most a bucket's alignment.
    for ws in (2, 4, 8):
        e = estimate(shapes, EstimateConfig(world_size=ws, stage=2))
        ideal = (4 + 12 / ws) * n
        assert 0 <= e.total - e.staging - ideal < 16 * 128 * ws
    # bf16 with offload: master and state move to the host, the model keeps 2-byte parameters.
    e = estimate(shapes, EstimateConfig(world_size=4, stage=2, offload="cpu", param_dtype=torch.bfloat16))
    assert e.host == e.master + e.grads + e.optimizer_state and e.params < 2 * n + 4 * 128 * 4


def test_bad_estimate_input_names_the_fix():
    with pytest.raises(ValueError, match="module:factory"):
        meta_model("shardopt.tools.gpt")
    with pytest.raises(RuntimeError, match="no arguments"):
        meta_model("shardopt.tools.gpt:GPT")
    with pytest.raises(ValueError, match="stage"):
        EstimateConfig(stage=4)
    with pytest.raises(ValueError, match="ranks-per-node"):
        EstimateConfig(world_size=4, node_aware=True)
    with pytest.raises(ValueError, match="inter_node_param_dtype needs node_aware"):
        EstimateConfig(world_size=4, shards=2, inter_node_param_dtype="bfloat16")
    with pytest.raises(ValueError, match="inter_node_param_dtype needs node_aware, stage 1 or 2"):
        EstimateConfig(world_size=4, shards=2, node_aware=True, stage=3, inter_node_param_dtype="bfloat16")


def test_node_aware_stage3_estimate():
    """`shardopt estimate --node-aware --stage 3`: flat stage 3's memory (parameters, gradients and state 1/W),
    not the hybrid's 1/K, plus the node chunks of buckets in flight; the CLI prints its row."""
    from shardopt.tools import cli

    shapes = [("w", (1000, 1000)), ("b", (1000,))]
    node_aware = estimate(shapes, EstimateConfig(world_size=8, shards=2, node_aware=True, stage=3))
    flat = estimate(shapes, EstimateConfig(world_size=8, stage=3))
    hybrid = estimate(shapes, EstimateConfig(world_size=8, shards=2, stage=3))
    for key in ("params", "grads", "optimizer_state", "gathered"):
        assert getattr(node_aware, key) == getattr(flat, key), key
    assert node_aware.optimizer_state < hybrid.optimizer_state / 3
    assert node_aware.in_flight > 0 and node_aware.staging == flat.staging + node_aware.in_flight
    assert cli.main(["estimate", "1M", "--world-size", "8", "--ranks-per-node", "2", "--node-aware",
                     "--stage", "3"]) == 0
