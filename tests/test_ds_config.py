"""DeepSpeed config -> ShardedOptimizer: the translation as tables (no processes), then one 2-rank run
built from a config against the same run built from keyword arguments.

What each key means is decided in shardopt/deepspeed_config.py (Note [DeepSpeed defaults that change
results]); the expectations here were checked against DeepSpeed 0.19.8's source.
"""
import json

import pytest
import torch

import shardopt
from shardopt.deepspeed_config import optimizer_arguments, translate
from dist_harness import run_ranks
from models import AwkwardNet, batch, uses_branch

# A real config, verbatim: DeepSpeedExamples claude_tutorials/model_configs/gpt/gpt2_baseline.json
# (commit a56a7261). Note "type": "Adam" and no adam_w_mode: DeepSpeed runs AdamW.
GPT2_BASELINE = json.loads("""
{
  "train_batch_size": 512,
  "train_micro_batch_size_per_gpu": 16,
  "gradient_accumulation_steps": 4,
  "gradient_clipping": 1.0,
  "steps_per_print": 100,
  "fp16": {"enabled": true, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
           "hysteresis": 2, "min_loss_scale": 1},
  "zero_optimization": {"stage": 1, "reduce_bucket_size": 500000000, "allgather_bucket_size": 500000000},
  "optimizer": {"type": "Adam", "params": {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 5e-5, "warmup_num_steps": 500}}
}
""")

def _minimal(**top):
    return {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "gradient_clipping": 0, **top}


def test_real_config_translates_with_its_scheduler():
    import shardopt

    assert translate(GPT2_BASELINE).scheduler == (shardopt.WarmupLR, {"warmup_min_lr": 0, "warmup_max_lr": 5e-5,
                                                                       "warmup_num_steps": 500})
    other = {**GPT2_BASELINE, "scheduler": {"type": "OneCycle", "params": {}}}
    with pytest.raises(ValueError, match="scheduler.*torch.optim.lr_scheduler"):
        translate(other)
    cfg = {k: v for k, v in GPT2_BASELINE.items() if k != "scheduler"}
    t = translate(cfg)
    assert t.optim is torch.optim.AdamW  # DeepSpeed's "Adam" with the default adam_w_mode=true
    assert t.optim_kwargs == dict(lr=5e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    assert t.kwargs == dict(stage=1, reduce_bucket_size=500_000_000, allgather_bucket_size=500_000_000,
                            reduce_dtype=torch.float16, max_grad_norm=1.0,
                            loss_scale=dict(init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5,
                                            growth_interval=1000, hysteresis=2, min_scale=1.0, dynamic=True))
    assert t.param_dtype is torch.float16
    assert set(t.ignored) == {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                              "steps_per_print"}
    assert t.gradient_accumulation_steps == 4


@pytest.mark.parametrize("type_, params, expect_cls, expect_kw", [
    ("Adam", {}, torch.optim.AdamW, {"weight_decay": 0.0}),                      # adam_w_mode defaults to true
    ("adam", {"adam_w_mode": False}, torch.optim.Adam, {"weight_decay": 0.0}),   # explicit L2 Adam
    ("AdamW", {"adam_w_mode": False}, torch.optim.AdamW, {"weight_decay": 0.0}),  # AdamW stays AdamW
    ("AdamW", {"torch_adam": True}, torch.optim.AdamW, {}),                      # torch's class and defaults
    ("Adagrad", {"lr": 0.1}, torch.optim.Adagrad, {"lr": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9}, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
])
def test_optimizer_types_mean_what_deepspeed_makes_of_them(type_, params, expect_cls, expect_kw):
    t = translate(_minimal(optimizer={"type": type_, "params": params}))
    assert (t.optim, t.optim_kwargs) == (expect_cls, expect_kw)


def test_offload_and_clipping_and_precision_keys():
    t = translate(_minimal(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                              "reduce_bucket_size": 2e8, "overlap_comm": False,
                                              "contiguous_gradients": True}))
    assert t.optim is shardopt.CPUAdam and t.optim_kwargs == {"lr": 1e-3, "weight_decay": 0.0, "adamw": True}
    assert t.kwargs == dict(stage=2, offload="cpu", pin_memory=False, reduce_bucket_size=200_000_000,
                            overlap_comm=False)
    # gradient_clipping: DeepSpeed clips at 1.0 when the key is absent; 0 means none.
    cfg = _minimal()
    del cfg["gradient_clipping"]
    assert translate(cfg).kwargs["max_grad_norm"] == 1.0
    assert "max_grad_norm" not in translate(_minimal()).kwargs
    # bf16: reduce in bf16 (DeepSpeed's default) unless communication_data_type says otherwise.
    t = translate(_minimal(bf16={"enabled": True}))
    assert t.param_dtype is torch.bfloat16 and t.kwargs["reduce_dtype"] is torch.bfloat16
    assert "loss_scale" not in t.kwargs
    t = translate(_minimal(bf16={"enabled": True}, communication_data_type="fp32"))
    assert "reduce_dtype" not in t.kwargs  # fp32 is ShardedOptimizer's default
    assert translate(_minimal(fp16={"enabled": True, "loss_scale": 128})).kwargs["loss_scale"] == 128.0
    # A disabled block's other keys do not matter (DeepSpeed ignores them too), not even "auto".
    assert translate(_minimal(fp16={"enabled": False, "auto_cast": True, "loss_scale": "auto"})).param_dtype is None
    assert "gradient_predivide_factor" in translate(_minimal(gradient_predivide_factor=1.0)).ignored


def test_every_unsupported_key_and_auto_value_in_one_error():
    cfg = _minimal(zero_optimization={"stage": 2, "reduce_scatter": False, "zero_quantized_gradients": True,
                                      "offload_optimizer": {"device": "nvme"}, "reduce_bucket_size": "auto",
                                      "stage3_prefetch_bucket_size": "auto"},  # ignored at stage 2: no complaint
                   optimizer={"type": "Lamb", "params": {"lr": "auto"}}, gradient_clipping="auto",
                   flops_profiler={"enabled": True}, fp16={"enabled": True, "consecutive_hysteresis": True})
    with pytest.raises(ValueError) as e:
        translate(cfg)
    msg = str(e.value)
    for needle in ("zero_optimization.reduce_scatter", "zero_optimization.zero_quantized_gradients",
                   "offload_optimizer.nvme_path", "needs nvme_path", "optimizer.type", "Lamb", "flops_profiler",
                   "fp16.consecutive_hysteresis", "zero_optimization.reduce_bucket_size, optimizer.params.lr, "
                   "gradient_clipping = \"auto\"", "Hugging Face", "inter_node_dtype='int8'"):
        assert needle in msg, needle
    assert "stage3_prefetch_bucket_size" not in msg
    assert msg.count("\n  ") == 7  # one line per problem, the "auto" values together


@pytest.mark.parametrize("zero, needle", [({"stage": 4}, "must be 1, 2 or 3"), ({"stage": 0}, "DistributedDataParallel"),
                                          ({"stage": 2, "reduce_bucket_size": 0}, "whole number >= 1")])
def test_bad_zero_values_name_the_fix(zero, needle):
    with pytest.raises(ValueError, match=needle):
        translate(_minimal(zero_optimization=zero))


def test_json_path_dtype_checks_and_accumulation_warning(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_minimal(gradient_accumulation_steps=8)))
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.warns(UserWarning, match="no_sync"):
        _, kw = optimizer_arguments(params, str(path), {"lr": 0.5})
    assert kw == dict(stage=2, optim=torch.optim.AdamW, lr=0.5, weight_decay=0.0)  # overrides win
    (tmp_path / "bad.json").write_text("{\"stage\": ")
    with pytest.raises(ValueError, match="not valid JSON"):
        translate(str(tmp_path / "bad.json"))
    with pytest.raises(TypeError, match=r"model.to\(torch.bfloat16\)"):
        optimizer_arguments(params, _minimal(bf16={"enabled": True}), {})
    with pytest.raises(TypeError, match="enables neither"):
        optimizer_arguments([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], _minimal(), {})
    no_opt = _minimal()
    del no_opt["optimizer"]
    with pytest.raises(ValueError, match="optim=<torch optimizer class>"):
        optimizer_arguments(params, no_opt, {})


# --------------------------------------------------------------- 2-rank parity
def _run_both(rank, world_size, config, kwargs, steps=4, overrides=None):
    """Trains AwkwardNet once from the config and once from kwargs; returns both losses and params."""
    import copy

    torch.manual_seed(0)
    base = AwkwardNet()
    out = []
    for build in ("config", "kwargs"):
        model = copy.deepcopy(base)
        if build == "config":
            opt = shardopt.ShardedOptimizer.from_config(model.parameters(), config, **(overrides or {}))
        else:
            opt = shardopt.ShardedOptimizer(model.parameters(), **kwargs)
        wrapper = shardopt.ShardedDDP(model, opt)
        losses = []
        for step in range(steps):
            x, y = batch(step, rank)
            loss = torch.nn.functional.cross_entropy(wrapper(x, uses_branch(step, rank)).reshape(-1, 37),
                                                     y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        with opt.full_params(writeback=False):  # whole weights at stage 3 (a no-op at 1 and 2)
            params = [p.detach().clone() for p in model.parameters()]
        out.append((losses, params, type(opt.inner).__name__, opt.layout.bucket_numel, opt.config))
    return out


def _assert_same(results):
    for (c_losses, c_params, *c_meta), (k_losses, k_params, *k_meta) in results:
        assert c_meta == k_meta
        assert c_losses == k_losses
        assert all(torch.equal(a, b) for a, b in zip(c_params, k_params))


def test_config_run_matches_kwargs_run():
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000, "allgather_bucket_size": 500,
                                    "overlap_comm": True, "contiguous_gradients": True},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1, "betas": [0.8, 0.99]}}}
    kwargs = dict(optim=torch.optim.AdamW, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99), stage=2,
                  reduce_bucket_size=1000, allgather_bucket_size=500, overlap_comm=True)
    results = run_ranks(_run_both, 2, config, kwargs)
    _assert_same(results)
    assert results[0][0][2] == "AdamW" and results[0][0][4].stage == 2


def test_config_run_with_clipping_and_offload_matches_kwargs_run():
    config = {"gradient_clipping": 0.5,
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000,
                                    "offload_optimizer": {"device": "cpu", "pin_memory": False}},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    kwargs = dict(optim=shardopt.CPUAdam, lr=1e-2, weight_decay=0.1, adamw=True, stage=2, reduce_bucket_size=1000,
                  offload="cpu", pin_memory=False, max_grad_norm=0.5)
    _assert_same(run_ranks(_run_both, 2, config, kwargs))


# ---------------------------------------------------------------- stage 3
# DeepSpeed's ZeRO-3 example, verbatim from its ZeRO tutorial (deepspeedai/DeepSpeed docs/_tutorials/zero.md,
# "Offloading to CPU and NVMe with ZeRO-Infinity", commit 0101896a), sizes in elements cut down to AwkwardNet
# (2,574 trainable elements): 1e7 -> 1000 (buckets of ~1/3 of the model), the persistence threshold 1e5 -> 60
# (biases and norms stay whole), max_live 1e9 -> 2000 (two buckets), max_reuse_distance and sub_group_size
# kept as written.
DS_ZERO3_TUTORIAL = json.loads("""
{
    "zero_optimization": {
        "stage": 3,
        "contiguous_gradients": true,
        "stage3_max_live_parameters": 2000,
        "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 1000,
        "stage3_param_persistence_threshold": 60,
        "reduce_bucket_size": 1000,
        "sub_group_size": 1e9,
        "offload_optimizer": {
            "device": "cpu"
         },
        "offload_param": {
            "device": "cpu"
       }
   }
}
""")


def test_zero3_tutorial_config_translates_with_its_parameter_offload():
    t = translate(DS_ZERO3_TUTORIAL)  # offload_param "cpu": on a CPU model the shard is in host memory already
    assert t.kwargs == dict(stage=3, max_live_parameters=2000, prefetch_bucket_size=1000, offload_param="cpu",
                            param_persistence_threshold=60, reduce_bucket_size=1000, offload="cpu", max_grad_norm=1.0)
    cfg = json.loads(json.dumps(DS_ZERO3_TUTORIAL))
    del cfg["zero_optimization"]["offload_param"]
    t = translate(cfg)
    assert t.kwargs == dict(stage=3, max_live_parameters=2000, prefetch_bucket_size=1000,
                            param_persistence_threshold=60, reduce_bucket_size=1000, offload="cpu", max_grad_norm=1.0)
    assert set(t.ignored) == {"zero_optimization.contiguous_gradients", "zero_optimization.sub_group_size",
                              "zero_optimization.stage3_max_reuse_distance"}
    assert t.gather_weights_on_save is None
    # offload_param with device "none" is what we do; so is a plain cpu_offload_param=false.
    cfg["zero_optimization"].update(offload_param={"device": "none"}, cpu_offload_param=False)
    assert translate(cfg).kwargs["offload"] == "cpu"


@pytest.mark.parametrize("key, value, expect", [
    ("stage3_gather_16bit_weights_on_model_save", True, ("gather", True)),
    ("stage3_gather_fp16_weights_on_model_save", False, ("gather", False)),   # DeepSpeed's older spelling
    ("stage3_allgather_sequential", True, ("kwargs", {"prefetch_bucket_size": 0})),
    ("allgather_bucket_size", 500, ("ignored", "zero_optimization.allgather_bucket_size")),  # DeepSpeed ignores it
    ("stage3_model_persistence_threshold", 10, ("refused", "stage3_param_persistence_threshold")),
    ("stage3_module_granularity_threshold", 100, ("refused", "gathers by bucket")),
    ("stage3_use_all_reduce_for_fetch_params", True, ("refused", "all-gather")),
    ("mics_shard_size", 8, ("refused", "MiCS")),
    ("cpu_offload_param", True, ("kwargs", {"offload_param": "cpu"})),
    ("offload_param", {"device": "nvme", "nvme_path": "/x"}, ("refused", "needs offload_optimizer.device")),
    ("stage3_max_live_parameters", -1, ("refused", "whole number >= 0")),
    ("stage3_prefetch_bucket_size", "auto", ("refused", "Hugging Face")),
])
def test_stage3_keys(key, value, expect):
    cfg = _minimal(zero_optimization={"stage": 3, key: value})
    kind, want = expect
    if kind == "refused":
        with pytest.raises(ValueError, match=want) as e:
            translate(cfg)
        assert key in str(e.value)
        return
    t = translate(cfg)
    if kind == "gather":
        assert t.gather_weights_on_save is want and "gather" not in str(t.kwargs)
    elif kind == "kwargs":
        assert t.kwargs == dict(stage=3, **want)
    else:
        assert want in t.ignored and t.kwargs == dict(stage=3)
    # At stages 1 and 2 DeepSpeed ignores every stage-3 key, whatever its value.
    if key.startswith("stage3_"):
        assert translate(_minimal(zero_optimization={"stage": 2, key: value})).kwargs == dict(stage=2)


def test_zero3_tutorial_config_trains_as_the_kwargs_run():
    """The tutorial's config (without offload_param) builds the same stage-3 run as the keyword arguments."""
    cfg = json.loads(json.dumps(DS_ZERO3_TUTORIAL))
    del cfg["zero_optimization"]["offload_param"]
    overrides = dict(optim=shardopt.CPUAdam, lr=1e-2, weight_decay=0.1, adamw=True)  # it has no "optimizer" block
    kwargs = dict(overrides, stage=3, max_live_parameters=2000, prefetch_bucket_size=1000,
                  param_persistence_threshold=60, reduce_bucket_size=1000, offload="cpu", max_grad_norm=1.0)
    results = run_ranks(_run_both, 2, cfg, kwargs, 4, overrides)
    _assert_same(results)
    config = results[0][0][4]
    assert (config.stage, config.offload, config.prefetch_bucket_size, config.max_live_parameters,
            config.param_persistence_threshold) == (3, "cpu", 1000, 2000, 60)


# ---------------------------------------------------------------- key names
def _deepspeed_names(model) -> set:
    return set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


def test_the_names_we_check_are_deepspeeds():
    """The tables of valid names equal the installed DeepSpeed's pydantic models (extra="forbid")."""
    config = pytest.importorskip("deepspeed.runtime.zero.config")
    offload = pytest.importorskip("deepspeed.runtime.zero.offload_config")
    precision = pytest.importorskip("deepspeed.runtime.precision_config")
    from shardopt.deepspeed_config import (DS_BF16_KEYS, DS_FP16_KEYS, DS_OFFLOAD_OPTIMIZER_KEYS,
                                           DS_OFFLOAD_PARAM_KEYS, DS_ZERO_KEYS)

    assert DS_ZERO_KEYS == _deepspeed_names(config.DeepSpeedZeroConfig)
    assert DS_OFFLOAD_OPTIMIZER_KEYS == _deepspeed_names(offload.DeepSpeedZeroOffloadOptimizerConfig)
    assert DS_OFFLOAD_PARAM_KEYS == _deepspeed_names(offload.DeepSpeedZeroOffloadParamConfig)
    assert DS_FP16_KEYS == _deepspeed_names(precision.DeepSpeedFP16Config)
    assert DS_BF16_KEYS == _deepspeed_names(precision.DeepSpeedBF16Config)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("by_alias", [False, True])
def test_every_zero_key_deepspeed_knows_at_its_default_translates(stage, by_alias):
    """DeepSpeed's own zero_optimization, every key written out at its default, is a config we take at every
    stage (translated or accepted without effect): no valid name is mistaken for a typo."""
    config = pytest.importorskip("deepspeed.runtime.zero.config")
    zero = json.loads(config.DeepSpeedZeroConfig(stage=stage).model_dump_json(by_alias=by_alias))
    assert len(zero) > 40
    t = translate(_minimal(zero_optimization=zero))
    assert t.kwargs["stage"] == stage


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_misspelt_key_is_refused_at_every_stage_with_the_nearest_name(stage):
    cfg = _minimal(zero_optimization={"stage": stage, "stage3_prefetch_bucket_sise": 1000000,
                                      "reduce_bucket_sise": 5e7, "stage3_prefetch_bucket_size": 1000,
                                      "offload_optimizer": {"devise": "cpu"}, "offload_param": {"devcie": "none"},
                                      "mics_shard_size": 8, "stage3_whatever": "auto"},
                   fp16={"enabled": False, "loss_scale_windoe": 100}, gradient_cliping=1.0)
    with pytest.raises(ValueError) as e:
        translate(cfg)
    msg = str(e.value)
    for key, near in [("zero_optimization.stage3_prefetch_bucket_sise", "stage3_prefetch_bucket_size"),
                      ("zero_optimization.reduce_bucket_sise", "reduce_bucket_size"),
                      ("zero_optimization.offload_optimizer.devise", "device"),
                      ("zero_optimization.offload_param.devcie", "device"),
                      ("gradient_cliping", "gradient_clipping")]:
        line = next((ln for ln in msg.split("\n") if ln.startswith(f"  {key} = ")), None)
        assert line is not None and f"did you mean {near!r}?" in line, (key, msg)
    assert "zero_optimization.stage3_whatever = \"auto\": unknown key" in msg  # "auto" or not
    assert "zero_optimization.mics_shard_size = 8: MiCS was removed" in msg
    assert "fp16.loss_scale_windoe = 100: unknown key, which DeepSpeed refuses too: did you mean " \
           "'loss_scale_window'?" in msg  # a disabled block's names too, as DeepSpeed checks them
    assert msg.count("\n  ") == 8, msg
    # Fixed, the same config translates; at stage 3 the prefetch the user asked for is there.
    for key in ("stage3_prefetch_bucket_sise", "reduce_bucket_sise", "mics_shard_size", "stage3_whatever"):
        del cfg["zero_optimization"][key]
    cfg["zero_optimization"].update(offload_optimizer={"device": "cpu"}, offload_param={"device": "none"})
    del cfg["gradient_cliping"], cfg["fp16"]["loss_scale_windoe"]
    assert translate(cfg).kwargs.get("prefetch_bucket_size") == (1000 if stage == 3 else None)


def test_what_is_accepted_without_effect_is_said_once_at_construction(caplog):
    cfg = _minimal(train_batch_size=64, zero_optimization={"stage": 2, "contiguous_gradients": True,
                                                           "stage3_max_live_parameters": 10})
    params = [torch.nn.Parameter(torch.zeros(3))]
    with caplog.at_level("INFO", logger="shardopt"):
        optimizer_arguments(params, cfg, {})
    lines = [r.getMessage() for r in caplog.records if r.name == "shardopt"]
    assert len(lines) == 1, lines
    for key in ("train_batch_size", "zero_optimization.contiguous_gradients",
                "zero_optimization.stage3_max_live_parameters"):
        assert key in lines[0], lines


# ------------------------------------------------------------------- tiers
# DeepSpeed's ZeRO-Infinity example (docs/_pages/config-json.md, "ZeRO-Infinity"), the nvme variant; the cpu
# variant sets both devices to "cpu" and drops the NVMe keys.
DS_ZERO_INFINITY = json.loads("""
{
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": 1000,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 4, "pin_memory": false,
                              "pipeline_read": false, "pipeline_write": false, "fast_init": false},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 5, "buffer_size": 1e8,
                          "max_in_cpu": 1e9, "pin_memory": false}
    },
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": false,
            "overlap_events": true},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
    "gradient_clipping": 0.5
}
""")


def test_zero_infinity_config_maps_onto_the_tiers():
    t = translate(DS_ZERO_INFINITY)
    assert t.optim is shardopt.CPUAdam and t.optim_kwargs == dict(lr=1e-2, weight_decay=0.1, adamw=True)
    assert t.kwargs == dict(stage=3, reduce_bucket_size=1000, offload="nvme", offload_param="nvme",
                            nvme_path="/local_nvme", offload_buffer_count=5, pin_memory=False, max_grad_norm=0.5,
                            aio=dict(block_size=1048576, queue_depth=8, thread_count=1))
    z = "zero_optimization"
    assert set(t.ignored) == {f"{z}.offload_optimizer.pipeline_read", f"{z}.offload_optimizer.pipeline_write",
                              f"{z}.offload_optimizer.fast_init", f"{z}.offload_param.buffer_size",
                              f"{z}.offload_param.max_in_cpu", "aio.single_submit", "aio.overlap_events"}
    cpu = json.loads(json.dumps(DS_ZERO_INFINITY))
    cpu[z]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    cpu[z]["offload_param"] = {"device": "cpu", "pin_memory": True}
    del cpu["aio"]
    assert translate(cpu).kwargs == dict(stage=3, reduce_bucket_size=1000, offload="cpu", offload_param="cpu",
                                         pin_memory=True, max_grad_norm=0.5)
    # DeepSpeed 0.19's name for thread_count; below stage 3 offload_param is ignored, as DeepSpeed does.
    cfg = _minimal(aio={"intra_op_parallelism": 2}, zero_optimization={"stage": 2, "offload_param": {"device": "nvme"}})
    assert translate(cfg).kwargs == dict(stage=2, aio={"thread_count": 2})


@pytest.mark.parametrize("change, needle", [
    ({"offload_param": {"device": "nvme", "nvme_path": "/other"}}, "one nvme_path for both tiers"),
    ({"offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "cpu"}}, "needs nvme_path"),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/x", "ratio": 0.5}}, "partial offload"),
    ({"offload_optimizer": {"device": "disk"}}, "must be \"none\", \"cpu\" or \"nvme\""),
    ({"offload_optimizer": {"device": "none"}}, "needs offload_optimizer.device"),
    ({"offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True}}, "one pin_memory"),
])
def test_offload_blocks_refused_with_the_reason(change, needle):
    cfg = json.loads(json.dumps(DS_ZERO_INFINITY))
    cfg["zero_optimization"].update(change)
    with pytest.raises(ValueError, match=needle):
        translate(cfg)
    for aio, needle in (({"use_gds": True}, "GPUDirect"), ({"block_size": 1000}, "multiple of 4096"),
                        ({"queue_dept": 8}, "did you mean 'queue_depth'")):
        with pytest.raises(ValueError, match=needle):
            translate(_minimal(aio=aio))


def test_zero_infinity_config_trains_as_the_kwargs_run(tmp_path):
    """The nvme variant through from_config: the same run as the keyword arguments, bit for bit."""
    cfg = json.loads(json.dumps(DS_ZERO_INFINITY))
    for block in ("offload_optimizer", "offload_param"):
        cfg["zero_optimization"][block]["nvme_path"] = str(tmp_path)
    kwargs = dict(optim=shardopt.CPUAdam, lr=1e-2, weight_decay=0.1, adamw=True, stage=3, reduce_bucket_size=1000,
                  offload="nvme", offload_param="nvme", nvme_path=str(tmp_path), offload_buffer_count=5,
                  pin_memory=False, max_grad_norm=0.5, aio=dict(block_size=1048576, queue_depth=8, thread_count=1))
    results = run_ranks(_run_both, 2, cfg, kwargs, 4)
    _assert_same(results)
    config = results[0][0][4]
    assert (config.offload, config.offload_param, config.offload_buffer_count) == ("nvme", "nvme", 5)
