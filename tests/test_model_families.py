"""Models of the transformers families people fine-tune, built the ways their users build them, against the
same model in one plain process (docs/zero3.md, "How a model is built").

Families (tiny configs: 2 layers, hidden 32, vocabulary 96): Llama (RoPE: inv_freq, original_inv_freq),
Gemma (embed_scale too, and RMSNorm weights around zero), GPT-2 (learned positions, head tied), Mixtral (MoE),
BERT (position_ids and token_type_ids), BART (encoder-decoder; final_logits_bias, a persistent buffer).
Every non-persistent buffer among them is computed by the model's code and is in no checkpoint.
Build paths:
  whole            built on every rank (random values, each rank its own), then shardopt.load_weights;
  from_pretrained  shardopt.from_pretrained(cls, folder) (stage 3);
  meta             `with torch.device("meta")`, then shardopt.load_weights (stage 3; stages 1-2 refuse it);
  to_empty         torchtitan's: on the meta device, to_empty(device="cpu"), the model's own init_weights(),
                   then load_weights (what stages 1-2 ask of a meta model).
Each at stages 1-3 on 2 ranks: logits on a fixed batch before training within 1e-5 of the plain model's
(relative to max(1, |logit|): the same weights, so equal up to summation order), every buffer equal, and the
weights after 3 AdamW steps at tests/test_weights.py's bar (the ranks' gradients averaged, summed in another
order). initializer_range 0.1 gives attention enough weight that a RoPE table of zeros moves the logits by
0.6 (at 0.02, by 1e-3). The same under the HF Trainer (model_init builds the model on the meta device) and
Lightning (configure_model does), against the same framework with the model built whole.
"""
import os
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")  # a test dependency (setup.py [test])

STEPS, LR, BSZ, SEQ, VOCAB = 3, 1e-3, 2, 8, 96
STAGES = (1, 2, 3)
PATHS = ("whole", "from_pretrained", "meta", "to_empty")
META_ONLY_AT_STAGE_3 = ("from_pretrained", "meta")


def _family(name: str):
    """(model class, config) of a tiny model of family `name`."""
    t = transformers
    rope = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32, initializer_range=0.1)
    return {
        "llama": lambda: (t.LlamaForCausalLM, t.LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=False, **rope)),
        "gemma": lambda: (t.GemmaForCausalLM, t.GemmaConfig(vocab_size=VOCAB, head_dim=8, **rope)),
        "gpt2": lambda: (t.GPT2LMHeadModel, t.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, initializer_range=0.1,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
        "mixtral": lambda: (t.MixtralForCausalLM, t.MixtralConfig(
            vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2, **{**rope, "intermediate_size": 48})),
        "bert": lambda: (t.BertForMaskedLM, t.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=32, initializer_range=0.1, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)),
        "bart": lambda: (t.BartForConditionalGeneration, t.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
            init_std=0.1, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)),
    }[name]()


FAMILIES = ("llama", "gemma", "gpt2", "mixtral", "bert", "bart")


def _pretrained(root, name: str) -> str:
    """The family's "pretrained" folder: the seed-7 model, as save_pretrained writes it. Mixtral's is written
    in the model's own tensor names (experts fused): save_pretrained writes the per-expert names downloaded
    checkpoints have, which load_weights does not read yet."""
    folder = os.path.join(root, f"pretrained-{name}")
    cls, config = _family(name)
    torch.manual_seed(7)
    model = cls(config)
    if name == "mixtral":
        from safetensors.torch import save_file

        config.save_pretrained(folder)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    else:
        model.save_pretrained(folder)
    return folder


def _inputs(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(3, VOCAB, (BSZ, SEQ), generator=g)  # BART's pad, bos and eos (0-2) left out
    return {"input_ids": ids, "labels": ids}


FIXED = -1  # the step number of the batch the logits before training are taken on


def _reference(name: str, world: int) -> dict:
    """The plain model (the folder's: built with the same seed) in this process: its logits, its buffers, and
    its weights after STEPS AdamW steps on the ranks' batches averaged (DDP's gradient)."""
    cls, config = _family(name)
    torch.manual_seed(7)
    model = cls(config)
    with torch.no_grad():
        logits = model(**_inputs(FIXED, 0)).logits
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        for r in range(world):
            (model(**_inputs(step, r)).loss / world).backward()
        opt.step()
        opt.zero_grad()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"logits": logits, "buffers": buffers, "state": state}


def _build(name: str, path: str, folder: str, rank: int):
    """The model as path `path` builds it, and whether load_weights must follow."""
    import shardopt

    cls, config = _family(name)
    if path == "whole":
        torch.manual_seed(100 + rank)  # each rank its own values: the broadcast and the load must replace them
        return cls(config), True
    if path == "from_pretrained":
        return shardopt.from_pretrained(cls, folder), False
    with torch.device("meta"):
        model = cls(config)
    if path == "to_empty":
        model.to_empty(device="cpu")
        model.init_weights()
    return model, True


def _sharded(name: str, path: str, folder: str, stage: int, rank: int) -> dict:
    import shardopt

    model, load = _build(name, path, folder, rank)
    opt = shardopt.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, stage=stage,
                                    reduce_bucket_size=3000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapper = shardopt.ShardedDDP(model, opt)
    if load:
        shardopt.load_weights(wrapper, folder)
    with torch.no_grad():
        logits = wrapper(**_inputs(FIXED, 0)).logits
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    for step in range(STEPS):
        wrapper(**_inputs(step, rank)).loss.backward()
        opt.step()
        opt.zero_grad()
    with opt.full_params(writeback=False):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"logits": logits, "buffers": buffers, "state": state,
            "warnings": [str(w.message) for w in caught if "meta-device model" in str(w.message)]}


def _differences(ref: dict, got: dict, what: str) -> list:
    out = [f"{what}: {w}" for w in got["warnings"]]
    err = ((ref["logits"] - got["logits"]).abs().max() / ref["logits"].abs().max().clamp_min(1.0)).item()
    if err > 1e-5:
        out.append(f"{what}: logits before training {err:.2e} off (relative)")
    if ref["buffers"].keys() != got["buffers"].keys():
        out.append(f"{what}: buffers {sorted(got['buffers'])} vs {sorted(ref['buffers'])}")
    out += [f"{what}: buffer {n} is {got['buffers'][n].flatten()[:4].tolist()}..., the model's own "
            f"{b.flatten()[:4].tolist()}..." for n, b in ref["buffers"].items()
            if n in got["buffers"] and not torch.equal(b, got["buffers"][n])]
    for k, v in ref["state"].items():
        # tests/test_weights.py's bar: AdamW moves each weight by up to lr a step, and where a gradient is near
        # zero its update turns on the last bits of the summed gradient, whose order differs between a
        # reduce-scatter and one process's sum. A wrong buffer or weight moves weights by whole steps.
        if k not in got["state"] or not torch.allclose(got["state"][k], v, rtol=1e-5, atol=1e-2 * LR * STEPS):
            off = (got["state"][k] - v).abs().max().item() if k in got["state"] else "missing"
            out.append(f"{what}: {k} after {STEPS} steps: {off} off")
    return out


def _matrix(rank, world, name, folder):
    """Every stage and build path of family `name`: the differences from the plain model, and what the
    paths stages 1-2 refuse said."""
    ref = _reference(name, world)
    fails, refused = [], {}
    for stage in STAGES:
        for path in PATHS:
            what = f"{name} stage {stage} {path}"
            if stage < 3 and path in META_ONLY_AT_STAGE_3:
                try:
                    _sharded(name, path, folder, stage, rank)
                    fails.append(f"{what}: built; stages 1-2 keep whole parameters and refuse a meta model")
                except ValueError as e:
                    refused[what] = str(e)
                continue
            fails += _differences(ref, _sharded(name, path, folder, stage, rank), what)
    return fails, refused


@pytest.mark.parametrize("name", FAMILIES)
def test_every_build_path_trains_the_model_it_loaded(launch, name):
    """The families x build paths x stages 1-3: logits before training, every buffer, and the weights after
    3 AdamW steps equal the plain model's; no warning of zeros; stages 1-2 refuse a meta-device model
    naming what to do (to_empty, then its own initialisation: the to_empty path)."""
    for rank, (fails, refused) in enumerate(launch.results(name)):
        assert not fails, f"rank {rank}:\n" + "\n".join(fails)
        assert len(refused) == 4 and all("meta device" in m and "to_empty" in m for m in refused.values()), refused


# ---------------------------------------------------------------- a buffer no initialisation writes
class Sinusoid(torch.nn.Module):
    """A table computed in the constructor, no initialisation of its own (as a hand-written RoPE)."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("freqs", 1.0 / 100 ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, h):
        pos = torch.arange(h.shape[1], dtype=h.dtype)[:, None] * self.freqs
        return h + torch.cat([pos.sin(), pos.cos()], dim=-1)


class TableNet(torch.nn.Module):
    def __init__(self, table: bool = True):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.pos = Sinusoid(8) if table else torch.nn.Identity()
        self.register_buffer("scale", torch.full((8,), 2.0))  # persistent: a checkpoint holds it
        self.head = torch.nn.Linear(8, 16)

    def forward(self, x):
        return self.head(self.pos(self.emb(x)) * self.scale)


def _freqs(module):
    if hasattr(module, "freqs"):
        module.freqs.copy_(Sinusoid(8).freqs)


def _unwritten_buffers(rank, world, root):
    """A meta-device model with a buffer no initialisation writes: refused on every rank (none hangs), naming
    the buffer and both fixes; with a param_init_fn that writes it, built, the table the constructor's. A
    persistent buffer left unwritten is named in a warning, and a checkpoint without it is refused."""
    import shardopt

    def wrap(model, **kw):
        opt = shardopt.ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, stage=3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            return shardopt.ShardedDDP(model, opt, **kw), [str(w.message) for w in caught]

    out = {}
    for case, kw in (("no init", {}), ("rank 1 only", {"param_init_fn": lambda m: rank == 1 and _freqs(m)})):
        with torch.device("meta"):
            model = TableNet()
        try:
            wrap(model, **kw)
            out[case] = "built"
        except ValueError as e:
            out[case] = str(e)
    with torch.device("meta"):
        model = TableNet()
    wrapper, caught = wrap(model, param_init_fn=_freqs)
    out["param_init_fn"] = (torch.equal(model.pos.freqs, TableNet().pos.freqs), caught)
    # The persistent buffer: zeros, named; then a checkpoint without it refused, one with it loaded.
    with torch.device("meta"):
        model = TableNet(table=False)
    wrapper, caught = wrap(model)
    out["persistent"] = (model.scale.tolist(), caught)
    torch.manual_seed(0)
    whole = TableNet(table=False)
    full, lacking = os.path.join(root, "full.pt"), os.path.join(root, "lacking.pt")
    if rank == 0:
        torch.save(whole.state_dict(), full)
        torch.save({k: v for k, v in whole.state_dict().items() if k != "scale"}, lacking)
    torch.distributed.barrier()
    try:
        shardopt.load_weights(wrapper, lacking)
        out["lacking"] = "loaded"
    except shardopt.WeightsError as e:
        out["lacking"] = str(e)
    shardopt.load_weights(wrapper, full)
    out["loaded"] = model.scale.tolist()
    return out


def test_a_buffer_no_initialisation_writes_is_refused_by_name(launch):
    for rank, out in enumerate(launch.results("unwritten")):
        msg = out["no init"]
        assert "pos.freqs" in msg and "shardopt.from_pretrained" in msg and "param_init_fn" in msg, (rank, msg)
        assert "scale" not in msg, msg  # persistent: a checkpoint gives it, not refused
        # A param_init_fn that writes the table on rank 1 only: rank 0 refuses, rank 1 says rank 0 did.
        assert ("pos.freqs" if rank == 0 else "rank 0 could not build") in out["rank 1 only"], (rank, out)
        same, caught = out["param_init_fn"]
        assert same and not any("freqs" in w for w in caught), out["param_init_fn"]
        scale, caught = out["persistent"]
        assert scale == [0.0] * 8 and any("persistent buffers scale" in w for w in caught), out["persistent"]
        assert "missing from the file: scale" in out["lacking"], out["lacking"]
        assert out["loaded"] == [2.0] * 8


# ---------------------------------------------------------------- the frameworks build the model
TRAINER_FAMILY = "llama"


def _trainer_builds(rank, world, root, folder):
    """ShardedTrainer at stage 3 whose model_init builds the model on the meta device (a callback loads the
    folder when training begins), against the same Trainer given the model built whole."""
    import shardopt
    from accelerate.state import AcceleratorState
    from shardopt.integrations.transformers import ShardedTrainer

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    cls, config = _family(TRAINER_FAMILY)
    rows = [_inputs(i // 2, i % 2) for i in range(2 * STEPS * world)]
    data = [{k: v[j] for k, v in row.items()} for row in rows for j in range(BSZ)]

    class Load(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            shardopt.load_weights(trainer.model, folder)

    def meta_model():
        with torch.device("meta"):
            return cls(config)

    runs = {}
    for how in ("whole", "model_init"):
        AcceleratorState._reset_state()
        args = transformers.TrainingArguments(
            output_dir=os.path.join(root, how), report_to="none", use_cpu=True, seed=0, logging_steps=1,
            save_strategy="no", per_device_train_batch_size=BSZ, max_steps=STEPS, learning_rate=LR,
            lr_scheduler_type="constant", disable_tqdm=True, dataloader_num_workers=0)
        built = {"model": cls.from_pretrained(folder)} if how == "whole" else \
            {"model_init": meta_model, "callbacks": [Load()]}
        trainer = ShardedTrainer(args=args, train_dataset=data, shardopt_kwargs={"stage": 3}, **built)
        trainer.train()
        opt = trainer._sharded()[1]
        with opt.full_params(writeback=False):
            weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        runs[how] = ([e["loss"] for e in trainer.state.log_history if "loss" in e],
                     {n: b.clone() for n, b in trainer.model.named_buffers()}, weights)
    return runs


LIGHTNING_FAMILY = "gemma"


def _lightning_builds(rank, world, folder):
    """ShardedStrategy(stage=3) whose configure_model builds the model on the meta device (on_fit_start loads
    the folder), against the same strategy with configure_model building it whole."""
    import lightning.pytorch as pl
    import shardopt
    from shardopt.integrations.lightning import ShardedStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # the ranks exist already (tests/test_lightning.py)
    cls, config = _family(LIGHTNING_FAMILY)

    class Module(pl.LightningModule):
        def __init__(self, meta):
            super().__init__()
            self.meta = meta

        def configure_model(self):
            torch.manual_seed(100 + rank)
            with torch.device("meta") if self.meta else torch.device("cpu"):
                self.model = cls(config)

        def on_fit_start(self):
            shardopt.load_weights(self, folder)

        def training_step(self, batch, i):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    ids = torch.cat([_inputs(step, r)["input_ids"] for step in range(STEPS) for r in range(world)])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=BSZ)
    runs = {}
    for meta in (False, True):
        module = Module(meta)
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=ShardedStrategy(stage=3), max_steps=STEPS,
                             logger=False, enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, num_sanity_val_steps=0)
        trainer.fit(module, loader)
        runs[meta] = ({n: b.clone() for n, b in module.model.named_buffers()}, module.model.state_dict())
    return runs


def _same_training(a_weights, b_weights):
    return [k for k, v in a_weights.items() if not torch.allclose(b_weights[k], v, rtol=1e-5, atol=1e-7)]


def test_the_hf_trainer_builds_the_model_on_the_meta_device(launch):
    """model_init building on the meta device: the model's own buffers, and the training of the model built
    whole (losses and weights)."""
    cls, config = _family(TRAINER_FAMILY)
    own = dict(cls(config).named_buffers())
    for rank, runs in enumerate(launch.results("trainer")):
        (losses, buffers, weights), (meta_losses, meta_buffers, meta_weights) = runs["whole"], runs["model_init"]
        assert own.keys() == meta_buffers.keys() and all(torch.equal(b, meta_buffers[n]) for n, b in own.items())
        assert len(losses) == STEPS, losses
        assert all(abs(a - b) <= 1e-5 * max(1.0, abs(a)) for a, b in zip(losses, meta_losses)), (losses, meta_losses)
        assert not _same_training(weights, meta_weights), (rank, _same_training(weights, meta_weights))


def test_lightning_builds_the_model_on_the_meta_device(launch):
    """configure_model building on the meta device under ShardedStrategy(stage=3): the model's own buffers
    (Gemma's embed_scale and RoPE tables), and the training of configure_model building it whole."""
    cls, config = _family(LIGHTNING_FAMILY)
    own = dict(cls(config).named_buffers())
    for rank, runs in enumerate(launch.results("lightning")):
        (_, weights), (meta_buffers, meta_weights) = runs[False], runs[True]
        assert own.keys() == meta_buffers.keys() and all(torch.equal(b, meta_buffers[n]) for n, b in own.items())
        assert not _same_training(weights, meta_weights), (rank, _same_training(weights, meta_weights))


# ---------------------------------------------------------------- the launch
# Note [Several cases in one launch] (tests/dist_harness.py): every case of this file runs in one 2-rank launch
# (the ranks import transformers once); the frameworks' cases last, as they import accelerate and Lightning.
@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    from dist_harness import SharedLaunch

    root = tmp_path_factory.mktemp("families")

    def cases():
        folders = {name: _pretrained(root, name) for name in FAMILIES}
        (root / "unwritten").mkdir()
        return {**{name: (_matrix, (name, folders[name])) for name in FAMILIES},
                "unwritten": (_unwritten_buffers, (str(root / "unwritten"),)),
                "trainer": (_trainer_builds, (str(root / "trainer"), folders[TRAINER_FAMILY])),
                "lightning": (_lightning_builds, (folders[LIGHTNING_FAMILY],))}

    return SharedLaunch(2, cases, timeout=600, root=root)
