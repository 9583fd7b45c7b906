"""shardopt.estimate against what a real ShardedOptimizer holds (memory_stats()), world sizes 1-3,
stages 1-2, on models whose sizes do not divide evenly (padding, straddling buckets, tied and frozen
parameters). The issue asks for 10%; fp32 without offload should be exact. With the disk tiers, world sizes
2-3, stages 1-3: bytes on disk exact, host memory and the tiers' buffers within 10% or bounded."""
import dataclasses

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
        measured = {k: max(r[i][4][k] for r in per_rank) for k, v in per_rank[0][i][4].items() if not isinstance(v, dict)}
        # Without disk tiers no rank has bytes on disk.
        assert all(r[i][4]["on_disk"] == {} for r in per_rank), per_rank[0][i][4]
        nodes = dict(shards=1, node_aware=True) if "-nodes" in name else {}
        if name.endswith("-bf16p"):
            nodes["inter_node_param_dtype"] = "bfloat16"
        est = estimate(shapes[0], EstimateConfig(world_size=world_size, stage=stage, reduce_bucket_size=rbs,
                                                 param_dtype=dtype, offload=offload, device="cpu", **nodes),
                       frozen=shapes[1])
        predicted = est.as_stats()
        assert predicted.pop("on_disk") == {}
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
                # The pool grows instead of waiting in backward (Note [Stage 3 never waits in backward]) and
                # is back at its bound after it (Note [The staging pool between backward passes]): at least
                # the estimate's buffers.
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
    with pytest.raises(ValueError, match="inter_node_param_dtype='int8' is built for stage 3"):
        EstimateConfig(world_size=4, shards=2, node_aware=True, stage=2, inter_node_param_dtype="int8")
    with pytest.raises(ValueError, match="offload_param='nvme' needs several ranks"):
        EstimateConfig(world_size=1, stage=3, device="cpu", offload="nvme", offload_param="nvme")
    with pytest.raises(ValueError, match="offload_param='nvme' needs stage 3"):
        EstimateConfig(world_size=2, stage=2, device="cpu", offload="nvme", offload_param="nvme")
    with pytest.raises(ValueError, match="with a model on cuda is not built"):
        EstimateConfig(world_size=2, stage=3, offload="nvme", offload_param="nvme")


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


def _measure_tiers(rank, world_size, nvme):
    """memory_stats() after a step with the disk tiers: offload="nvme" at stages 1-3, and at stage 3 with the
    parameter shard on disk too (offload "cpu" or "nvme")."""
    import shardopt

    out = []
    cases = [(stage, "nvme", "none") for stage in (1, 2, 3)] + [(3, "cpu", "nvme"), (3, "nvme", "nvme")]
    for stage, offload, offload_param in cases:
        torch.manual_seed(0)
        model = AwkwardNet()
        shapes, frozen = trainable_shapes(model), frozen_shapes(model)
        opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=1e-3, stage=stage,
                                        reduce_bucket_size=1000, offload=offload, offload_param=offload_param,
                                        nvme_path=nvme)
        wrapper = shardopt.ShardedDDP(model, opt)
        x, _ = batch(0, rank)
        wrapper(x, True).float().pow(2).mean().backward()  # the branch too: every parameter has state
        opt.step()
        out.append((stage, offload, offload_param, (shapes, frozen), opt.memory_stats()))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_estimate_matches_memory_stats_with_disk_tiers(world_size, tmp_path):
    """The estimate for offload="nvme" / offload_param="nvme" says what a real run holds: host memory, the
    tiers' buffers, and bytes on disk per kind of state (Note [Estimate for the disk tiers])."""
    per_rank = run_ranks(_measure_tiers, world_size, str(tmp_path))
    for i, (stage, offload, offload_param, shapes, _) in enumerate(per_rank[0]):
        where = f"stage={stage} offload={offload} offload_param={offload_param} ws={world_size}"
        est = estimate(shapes[0], EstimateConfig(world_size=world_size, stage=stage, reduce_bucket_size=1000,
                                                 offload=offload, offload_param=offload_param, device="cpu"),
                       frozen=shapes[1])
        predicted = est.as_stats()
        for key in ("params", "on_device"):  # between steps: no bucket gathered
            predicted[key] -= est.gathered
        stats = [r[i][4] for r in per_rank]
        assert set(predicted) == set(stats[0]), where
        # Bytes on disk are exact on every rank: each rank's chunks are the same size (the padding is in them).
        for s in stats:
            assert s["on_disk"] == predicted["on_disk"], (where, s["on_disk"], predicted["on_disk"])
        assert predicted["on_disk"].keys() == ({"master", "optimizer_state", "grads"} if offload == "nvme" else set()) \
            | ({"params"} if offload_param == "nvme" else set()), where
        # The parameter tier holds a buffer per chunk held at once: at least the estimate's, at most one per bucket
        # (AwkwardNet's modules gather several buckets together; Note [Estimate for the disk tiers]).
        most = estimate(shapes[0], EstimateConfig(world_size=world_size, stage=stage, reduce_bucket_size=1000,
                                                  offload=offload, offload_param=offload_param, device="cpu",
                                                  live_buckets=10**9), frozen=shapes[1]).tier_buffers
        for key in predicted.keys() - {"on_disk"}:
            value = max(s[key] for s in stats)
            if key in ("staging", "on_device", "offloaded", "tier_buffers") and offload_param == "nvme":
                assert predicted[key] <= value, (where, key, predicted, stats[0])
                if key == "tier_buffers":
                    assert value <= most, (where, value, most)
                continue
            if key in ("staging", "on_device") and stage == 3:
                assert predicted[key] <= value, (where, key, predicted, stats[0])  # at least its bound (see above)
                continue
            assert abs(predicted[key] - value) <= TOLERANCE * max(value, 1), (where, key, predicted, stats[0])


def test_tier_settings_move_memory_to_disk_and_fit_picks_the_fastest(capsys):
    """A 1B-parameter model at 8 ranks, stage 3: each tier setting keeps less in memory and more on disk; `fit`
    (and `shardopt estimate --memory`) picks the fastest setting that fits a memory limit, or says none does."""
    from shardopt.estimate import count_shapes, fit
    from shardopt.tools import cli

    shapes, base = count_shapes(10**9), EstimateConfig(world_size=8, stage=3, device="cpu")
    rows, _ = fit(shapes, base, memory=2**40)
    settings = [(c.offload, c.offload_param) for c, _, _ in rows]
    assert settings == [("none", "none"), ("cpu", "none"), ("cpu", "nvme"), ("nvme", "none"), ("nvme", "nvme")]
    m = {s: e for s, (_, e, _) in zip(settings, rows)}
    # 16 bytes a parameter per 8 ranks (and gathered buckets, staging); on disk, 4 (master) + 8 (Adam) + 4 (gradients).
    n, plain = 10**9 / 8, m["none", "none"]
    assert plain.disk == 0 and abs(plain.total - plain.gathered - plain.staging - 16 * n) < 0.01 * 16 * n
    assert abs(m["nvme", "none"].disk - 16 * n) < 0.01 * 16 * n and m["nvme", "none"].optimizer_state == 0
    assert abs(m["nvme", "nvme"].disk - 20 * n) < 0.01 * 20 * n
    assert m["nvme", "nvme"].total < m["nvme", "none"].total < m["cpu", "none"].total
    assert m["nvme", "nvme"].total < 0.25 * m["none", "none"].total  # buffers and gathered buckets only
    for memory, want in ((2**40, ("none", "none")), (int(0.5 * m["none", "none"].total), ("nvme", "none")),
                         (m["nvme", "nvme"].total, ("nvme", "nvme"))):
        _, chosen = fit(shapes, base, memory)
        assert (chosen.offload, chosen.offload_param) == want, (memory, chosen)
    assert fit(shapes, base, m["nvme", "nvme"].total - 1)[1] is None
    # A GPU model: no parameter tier (not built); host memory is counted apart from the device's.
    gpu, _ = fit(shapes, dataclasses.replace(base, device="cuda"), memory=2**40)
    assert [(c.offload, c.offload_param) for c, _, _ in gpu] == [("none", "none"), ("cpu", "none"), ("nvme", "none")]

    assert cli.main(["estimate", "1B", "--world-size", "8", "--stage", "3", "--device", "cpu",
                     "--memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "8 ranks, stage 3: offload='nvme' fits in 1.000 GiB per rank: memory 0.809, disk 1.863" in out, out
    assert cli.main(["estimate", "1B", "--world-size", "8", "--stage", "3", "--device", "cpu",
                     "--memory", "1MiB"]) == 0
    assert "nothing fits in" in capsys.readouterr().out
    assert cli.main(["estimate", "--params", "1B", "--stage", "3", "--device", "cpu", "--offload", "nvme",
                     "--offload-param", "none,nvme", "--world-size", "8"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:4] == ["8", "3", "nvme", "nvme"]]
    assert len(rows) == 1 and float(rows[0][-2]) > 2  # disk column: 20 bytes a parameter / 8 ranks = 2.3 GiB
