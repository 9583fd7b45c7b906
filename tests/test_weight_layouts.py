"""Checkpoints whose layout is not the model's, loaded as transformers loads them (shardopt/weights/conversions.py).

transformers 5 renames keys and converts tensors on load, by rules it keeps per model: Mixtral's per-expert
`block_sparse_moe.experts.N.w1/w2/w3` (the layout of the checkpoints people download, and of what
save_pretrained writes) become the fused `mlp.experts.gate_up_proj` / `down_proj`; GPT-NeoX's `embed_out.`
is `lm_head.` in the versions whose model calls it so. First the op chains of those rules, one at a time,
read by element range against transformers' own convert of the same tensors (no processes). Then 2 gloo
ranks load real folders at stages 1-3 (stage 3 by shardopt.from_pretrained, its parameters never whole):
every weight and the logits of a batch equal transformers' from_pretrained in this process, each rank
reading about its half of the bytes and the two together each byte once; save_weights' folder loads back
into transformers. Small configs, no downloads.
"""
import copy
import inspect
import json
import math
import os
import re
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")  # a test dependency (setup.py [test]); here for the message
core = pytest.importorskip("transformers.core_model_loading")  # transformers >= 5: its conversion rules
from safetensors.torch import load_file, save_file  # noqa: E402

from shardopt.weights.conversions import ModelShapes, converted_tensors  # noqa: E402
from shardopt.weights.format import WeightFileError  # noqa: E402
from shardopt.weights.reader import open_weights  # noqa: E402

transformers.utils.logging.disable_progress_bar()
VOCAB, SEQ = 64, 8
HEADS = types.SimpleNamespace(num_attention_heads=2)  # the config PermuteForRope reads


# ------------------------------------------------------------ op chains, one process
def _chains():
    """(name, converter, {file key: shape}, {model name: shape}): the ops transformers' rules use, each cutting
    where runs of elements must split (a transpose, a chunk of the last dimension) and where they need not."""
    c = core
    experts = {f"experts.{e}.{w}.weight": (6, 5) for e in range(3) for w in ("w1", "w3")}
    chains = [
        ("mixtral gate_up", c.WeightConverter([".experts.*.w1.weight", ".experts.*.w3.weight"], ".experts.gate_up_proj",
                                              operations=[c.MergeModulelist(dim=0), c.Concatenate(dim=1)]),
         experts, {"experts.gate_up_proj": (3, 12, 5)}),
        ("stack on dim 1", c.WeightConverter(".experts.*.w1.weight", ".experts.w1",
                                             operations=[c.MergeModulelist(dim=1)]),
         {k: s for k, s in experts.items() if "w1" in k}, {"experts.w1": (6, 3, 5)}),
        ("qkv chunked on rows", c.WeightConverter("attn.qkv.weight", [f"attn.{x}.weight" for x in "qkv"],
                                                  operations=[c.Chunk(dim=0)]),
         {"attn.qkv.weight": (9, 4)}, {f"attn.{x}.weight": (3, 4) for x in "qkv"}),
        ("chunked inside rows", c.WeightConverter("attn.qkv.weight", ["attn.q.weight", "attn.k.weight"],
                                                  operations=[c.Chunk(dim=1)]),
         {"attn.qkv.weight": (3, 10)}, {f"attn.{x}.weight": (3, 5) for x in "qk"}),
        ("concatenated along rows", c.WeightConverter(["attn.q.weight", "attn.k.weight"], "attn.qk.weight",
                                                      operations=[c.Concatenate(dim=1)]),
         {"attn.q.weight": (4, 3), "attn.k.weight": (4, 5)}, {"attn.qk.weight": (4, 8)}),
        ("transposed", c.WeightConverter("gate_kernel", "gate.weight", operations=[c.Transpose(dim0=0, dim1=1)]),
         {"gate_kernel": (7, 5)}, {"gate.weight": (5, 7)}),
        ("stacked, then last two dims transposed",
         c.WeightConverter(".experts.*.w1.weight", ".experts.w1", operations=[c.MergeModulelist(dim=0),
                                                                                c.Transpose(dim0=1, dim1=2)]),
         {k: s for k, s in experts.items() if "w1" in k}, {"experts.w1": (3, 5, 6)}),
    ]
    if hasattr(c, "Interleave"):  # newer transformers
        chains.append(("interleaved", c.WeightConverter("mlp.fused", "mlp.gate_up", operations=[c.Interleave(dim=0)]),
                       {"mlp.fused": (8, 3)}, {"mlp.gate_up": (8, 3)}))
    if hasattr(c, "Split"):
        chains.append(("split by the model's sizes",
                       c.WeightConverter("attn.qkv.weight", ["attn.q.weight", "attn.k.weight"],
                                         operations=[c.Split(dim=0)]),
                       {"attn.qkv.weight": (7, 3)}, {"attn.q.weight": (4, 3), "attn.k.weight": (3, 3)}))
    if "subconfig_key" in inspect.signature(c.PermuteForRope).parameters:  # the form that runs
        chains.append(("rope halves interleaved", c.WeightConverter("attn.wq", "attn.q.weight",
                                                                     operations=[c.PermuteForRope()]),
                       {"attn.wq": (8, 3)}, {"attn.q.weight": (8, 3)}))
    at = "layers.0."  # as in a model: the rules' patterns match inside names
    return [(n, conv, {at + k: v for k, v in files.items()}, {at + k: v for k, v in model.items()})
            for n, conv, files, model in chains]


def _group(converter, keys):
    """(first model name, [(file key, pattern)]) as transformers files the keys: its renaming, its order."""
    first, out = None, []
    for key in sorted(keys, key=core.dot_natural_key):
        name, pattern = core.rename_source_key(key, [], [converter])
        assert pattern is not None, key
        first = first or name
        out.append((key, pattern))
    return first, out


@pytest.mark.parametrize("name,converter,files,model", _chains(), ids=[c[0] for c in _chains()])
def test_each_op_chain_reads_what_transformers_makes(tmp_path, monkeypatch, name, converter, files, model):
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    values = {k: torch.randn(s, generator=gen) for k, s in files.items()}
    save_file(values, tmp_path / "w.safetensors")
    first, keys = _group(converter, files)
    # transformers, on the values
    theirs = copy.deepcopy(converter)
    for key, pattern in keys:
        theirs.add_tensor(first, key, pattern, values[key])
    expected = theirs.convert(first, model=ModelShapes(model, HEADS), config=HEADS)
    expected = {k: (v[0] if isinstance(v, list) else v) for k, v in
                (expected[0] if isinstance(expected, tuple) else expected).items()}
    with open_weights(tmp_path / "w.safetensors") as src:
        ours = converted_tensors(src, copy.deepcopy(converter), first, keys, ModelShapes(model, HEADS))
        assert set(ours) == set(expected) == set(model), (set(ours), set(expected))
        read = []
        real = os.preadv
        monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: read.append(real(fd, bufs, off)) or read[-1])
        for target, t in ours.items():
            want = expected[target].reshape(-1)
            assert t.shape == tuple(expected[target].shape) == model[target]
            n = want.numel()
            for lo, hi in [(0, n), (1, n - 2), (n // 3, n // 3 + 1), (n // 2, n), (n - 3, n - 1)]:
                got = t.read(src, lo, hi, torch.float32)
                assert torch.equal(got, want[lo:hi]), (target, lo, hi)
        # Whole tensors read once each: every byte of the file tensors once (the ranges above read more).
        read.clear()
        for t in ours.values():
            t.read(src, 0, math.prod(t.shape), torch.float32)
        assert sum(read) == sum(v.numel() * 4 for v in values.values()), (sum(read), name)


def test_an_op_that_computes_values_is_refused_by_name(tmp_path):
    class Scale(core.ConversionOps):
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            return {target_patterns[0]: next(iter(input_dict.values()))[0] * 2.0}

    converter = core.WeightConverter("w.scaled", "w.weight", operations=[Scale()])
    save_file({"w.scaled": torch.ones(3, 2)}, tmp_path / "w.safetensors")
    with open_weights(tmp_path / "w.safetensors") as src:
        with pytest.raises(WeightFileError, match=r"'w.weight' is made from 'w.scaled'.*Scale.*computes values"):
            converted_tensors(src, converter, "w.weight", [("w.scaled", "w.scaled")], ModelShapes({}, None))


# ------------------------------------------------------------ real folders, 2 ranks
def _mixtral_config():
    return transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=3,
                                      num_experts_per_tok=2, max_position_embeddings=32, tie_word_embeddings=False)


def _neox_config():
    return transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=32, hidden_dropout=0.0,
                                      attention_dropout=0.0, tie_word_embeddings=False)


CLASSES = {"mixtral": "MixtralForCausalLM", "neox": "GPTNeoXForCausalLM"}
CONFIGS = {"mixtral": _mixtral_config, "neox": _neox_config}


def _class(arch):
    return getattr(transformers, CLASSES[arch.split("-")[0]])


def _saved(root, arch):
    """save_pretrained's own folder, in several shards."""
    folder = os.path.join(root, arch)
    torch.manual_seed(11)
    _class(arch)(CONFIGS[arch]()).save_pretrained(folder, max_shard_size="20KB")
    return folder


def _per_expert(root, saved):
    """A Mixtral folder laid out as downloaded ones are: per-expert keys in bf16, sharded so that one layer's
    experts lie in several files (w3 before w1, the experts in reverse: transformers orders them, not the files)."""
    folder = os.path.join(root, "mixtral-per-expert")
    os.makedirs(folder)
    tensors = {}
    for f in sorted(os.listdir(saved)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(saved, f)))
    keys = sorted(tensors, key=lambda k: (".w1." in k, -int(k.split(".experts.")[1].split(".")[0])
                                          if ".experts." in k else 0, k))
    assert any(".block_sparse_moe.experts.2.w1.weight" in k for k in keys)  # save_pretrained's per-expert names
    shards = [keys[i::3] for i in range(3)]
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({k: tensors[k].to(torch.bfloat16) for k in names}, os.path.join(folder, file), {"format": "pt"})
        weight_map.update({k: file for k in names})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    _mixtral_config().save_pretrained(folder)
    return folder


def _ids():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _load(rank, world, folder, arch, stage, out):
    """Built as a user of that stage builds it, loaded, its weights, logits and bytes read; saved at stage 3."""
    import shardopt

    transformers.utils.logging.disable_progress_bar()
    cls = _class(arch)
    torch.manual_seed(100 + rank)  # other random values on every rank: the load must replace them all
    model = shardopt.from_pretrained(cls, folder) if stage == 3 else cls(CONFIGS[arch.split("-")[0]]())
    opt = shardopt.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, stage=stage,
                                    reduce_bucket_size=2000)
    read, real = [], os.preadv

    def counting(fd, bufs, off):
        read.append(real(fd, bufs, off))
        return read[-1]

    os.preadv = counting  # only values are read with preadv (headers with pread)
    try:
        wrapper = shardopt.ShardedDDP(model, opt)  # stage 3: loads the folder from_pretrained named
        if stage != 3:
            shardopt.load_weights(wrapper, folder)
    finally:
        os.preadv = real
    with torch.no_grad():
        logits = wrapper(input_ids=_ids()).logits
    with opt.full_params(writeback=False):
        state = {k: v.clone() for k, v in model.state_dict().items()}
    if out is not None:
        shardopt.save_weights(wrapper, out, max_shard_size="20KB")
    return {"read": sum(read), "logits": logits, "state": state}


# (arch, stage): save_pretrained's Mixtral at every stage; the downloaded layout and GPT-NeoX at stage 3 and 2.
CASES = [("mixtral", 3), ("mixtral", 2), ("mixtral", 1), ("mixtral-per-expert", 3), ("neox", 3), ("neox", 2)]


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    from dist_harness import SharedLaunch

    root = tmp_path_factory.mktemp("layouts")
    folders = {}

    def cases():
        folders["mixtral"] = _saved(root, "mixtral")
        folders["neox"] = _saved(root, "neox")
        folders["mixtral-per-expert"] = _per_expert(root, folders["mixtral"])
        return {f"{arch} stage {stage}": (_load, (folders[arch], arch, stage,
                                                  os.path.join(root, f"saved-{arch}") if stage == 3 else None))
                for arch, stage in CASES}

    launch = SharedLaunch(2, cases, timeout=600)
    launch.folders, launch.root = folders, root
    return launch


def _reference(folder, arch):
    model = _class(arch).from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model, model(input_ids=_ids()).logits


def _data_bytes(folder):
    with open_weights(folder) as src:
        return sum(math.prod(src.shape(k)) * src.dtype(k).itemsize for k in src.names())


@pytest.mark.parametrize("arch,stage", CASES, ids=[f"{a}-stage{s}" for a, s in CASES])
def test_a_folder_transformers_reads_loads_equal_to_from_pretrained(loads, arch, stage):
    results = loads.results(f"{arch} stage {stage}")
    folder = loads.folders[arch]
    model, logits = _reference(folder, arch)
    want = model.state_dict()
    for r in results:
        assert set(r["state"]) == set(want), set(r["state"]) ^ set(want)
        wrong = [k for k, v in want.items() if not torch.equal(r["state"][k], v)]
        assert not wrong, wrong
        assert torch.allclose(r["logits"], logits, rtol=1e-6, atol=1e-6), (r["logits"] - logits).abs().max()
    if stage == 3:  # each rank reads its chunks' bytes, from however many file tensors make them up
        total = _data_bytes(folder)
        assert sum(r["read"] for r in results) == total, ([r["read"] for r in results], total)
        assert all(r["read"] < 0.65 * total for r in results), ([r["read"] for r in results], total)


@pytest.mark.parametrize("arch", ["mixtral", "mixtral-per-expert", "neox"])
def test_save_weights_writes_a_folder_transformers_loads(loads, arch):
    loads.results(f"{arch} stage 3")
    out = os.path.join(loads.root, f"saved-{arch}")
    again, info = _class(arch).from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    want = _reference(loads.folders[arch], arch)[0].state_dict()
    wrong = [k for k, v in again.state_dict().items() if not torch.equal(v, want[k])]
    assert not wrong, wrong


def test_two_file_tensors_for_one_model_tensor_are_refused(tmp_path):
    """A GPT-NeoX folder holding the head under both names: the load refuses, naming the second, rather than
    take one and drop the other in silence."""
    import shardopt

    folder = _saved(tmp_path, "neox")
    with open_weights(folder) as src:
        other = "lm_head.weight" if "embed_out.weight" in src.names() else "embed_out.weight"
    save_file({other: torch.zeros(VOCAB, 16)}, os.path.join(folder, "extra.safetensors"))
    path = os.path.join(folder, "model.safetensors.index.json")
    with open(path) as f:
        index = json.load(f)
    index["weight_map"][other] = "extra.safetensors"
    with open(path, "w") as f:
        json.dump(index, f)
    with pytest.raises(shardopt.WeightsError, match=r"1 not in the model: " + re.escape(other)):
        shardopt.load_weights(_class("neox")(_neox_config()), folder)
