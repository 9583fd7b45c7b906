"""shardopt/weights/reader.py and writer.py: Hugging Face weight files read by range and written in pieces.

No process group. What we write is read back by safetensors itself (load_file, safe_open) and by
transformers (from_pretrained); what transformers and huggingface_hub write is read by us; the split
into files is compared with huggingface_hub's and transformers' own. Damaged or inconsistent files and
unfinished writes fail with errors naming the file and the tensor; a failed write leaves the previous
folder byte-identical.
"""
import json
import os
import random
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shardopt.weights.format import SAFE_INDEX, SAFETENSORS_DTYPES, WeightFileError, safetensors_code
from shardopt.weights.reader import open_weights
from shardopt.weights.writer import WeightWriter, file_names, parse_size, plan_files

SEED = 20261129


# ------------------------------------------------------------------ helpers
def _random(dtype, shape, gen):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 3).to(dtype)
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


def _tensors() -> dict:
    """Every dtype the module knows, odd sizes, a 0-d, an empty and a non-contiguous (transposed) one."""
    gen = torch.Generator().manual_seed(SEED)
    shapes = {torch.float64: (), torch.float32: (0, 7), torch.bfloat16: (37, 16), torch.float16: (3, 4, 5),
              torch.int64: (11,), torch.int32: (2, 3), torch.int16: (5,), torch.int8: (7, 3),
              torch.uint8: (13,), torch.bool: (5, 3)}
    out = {f"t_{safetensors_code(dt).lower()}": _random(dt, shapes.get(dt, (9,)), gen)
           for dt in SAFETENSORS_DTYPES.values()}
    out["transposed"] = torch.randn(6, 8, generator=gen).t()
    assert not out["transposed"].is_contiguous()
    return out


def _bits(t):
    return t.reshape(-1).contiguous().view(torch.uint8)


def _same(a, b) -> bool:
    """Bitwise: dtype, shape and every byte (float8 and bool have no torch.equal of their own)."""
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(_bits(a), _bits(b))


def _strided(flat):
    """The same values as a non-contiguous 1-D view (stride 2), as a gathered bucket may hand them."""
    wide = torch.zeros(flat.numel(), 2, dtype=flat.dtype)
    wide[:, 0] = flat
    return wide[:, 0]


def _entries(tensors):
    return [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]


def _write_in_pieces(dest, tensors, max_shard_size="5GB", seed=0, **kwargs):
    """Every tensor cut into random pieces, all pieces of all tensors written in a shuffled order."""
    rng = random.Random(seed)
    pieces = []
    for name, t in tensors.items():
        n = t.numel()
        cuts = sorted({0, n, *(rng.randrange(n + 1) for _ in range(3))})
        pieces += [(name, lo, hi) for lo, hi in zip(cuts, cuts[1:])]
    rng.shuffle(pieces)
    with WeightWriter(dest, _entries(tensors), max_shard_size=max_shard_size, **kwargs) as w:
        for name, lo, hi in pieces:
            w.write(name, _strided(tensors[name].reshape(-1))[lo:hi], lo)


def _snapshot(folder) -> dict:
    """Relative path -> bytes of every file under `folder`."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(root, f)
            out[os.path.relpath(path, folder)] = open(path, "rb").read()
    return out


def _siblings(dest) -> list:
    """Leftovers of a write beside `dest` (partial or replaced folders)."""
    parent, name = os.path.split(str(dest))
    return [f for f in os.listdir(parent) if f.startswith(f".{name}.")]


def _check_reads(weights, tensors, rng):
    """Every tensor through our reader: whole, empty ranges at both ends, and random [lo, hi)."""
    for name, t in tensors.items():
        flat, n = t.reshape(-1), t.numel()
        assert weights.shape(name) == tuple(t.shape) and weights.dtype(name) == t.dtype, name
        ranges = [(0, n), (0, 0), (n, n)] + [tuple(sorted((rng.randrange(n + 1), rng.randrange(n + 1))))
                                             for _ in range(4)]
        for lo, hi in ranges:
            got = weights.read(name, lo, hi)
            assert _same(got, flat[lo:hi]), (name, lo, hi)


# ------------------------------------------------------------ round trips
def test_pieces_written_in_any_order_read_back_by_safetensors_and_by_range(tmp_path):
    tensors, dest = _tensors(), tmp_path / "out"
    assert {t.dtype for t in tensors.values()} == set(SAFETENSORS_DTYPES.values())   # every dtype tried
    pieces_dest = tmp_path / "pieces"
    _write_in_pieces(pieces_dest, tensors, seed=1)
    # One call per tensor too, with the transposed tensor handed over as it is (2-D, non-contiguous).
    with WeightWriter(dest, _entries(tensors)) as w:
        for name, t in reversed(tensors.items()):
            w.write(name, t)
    assert sorted(os.listdir(dest)) == ["model.safetensors"] and not _siblings(dest)
    assert _snapshot(dest) == _snapshot(pieces_dest)            # the same bytes, however the pieces came

    loaded = load_file(dest / "model.safetensors")
    assert loaded.keys() == tensors.keys()
    assert all(_same(loaded[k], t) for k, t in tensors.items())
    with safe_open(dest / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"} and set(f.keys()) == tensors.keys()
        assert all(_same(f.get_tensor(k), t) for k, t in tensors.items())
        assert _same(f.get_slice("t_bf16")[3:9], tensors["t_bf16"][3:9])

    with open_weights(dest) as weights:
        assert set(weights.names()) == tensors.keys() and weights.metadata == {"format": "pt"}
        _check_reads(weights, tensors, random.Random(SEED))
        assert torch.equal(weights.read("t_bf16", 5, 40, dtype=torch.float32),
                           tensors["t_bf16"].reshape(-1)[5:40].float())
        with pytest.raises(ValueError, match=r"\[3, 99\) are outside 't_i64'"):
            weights.read("t_i64", 3, 99)


def test_every_tensor_starts_aligned_to_its_itemsize(tmp_path):
    # Odd byte counts (bf16 x 3, int8 x 5) written before float64: the layout puts the wider ones first.
    gen = torch.Generator().manual_seed(SEED)
    tensors = {"a": _random(torch.bfloat16, (3,), gen), "b": _random(torch.int8, (5,), gen),
               "c": _random(torch.float64, (2,), gen), "d": _random(torch.float32, (3,), gen)}
    _write_in_pieces(tmp_path / "out", tensors)
    raw = open(tmp_path / "out" / "model.safetensors", "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert (8 + n) % 8 == 0 and raw[8:8 + n].rstrip(b" ").endswith(b"}")
    for name, t in tensors.items():
        begin, end = header[name]["data_offsets"]
        assert begin % t.dtype.itemsize == 0, (name, begin)
        assert raw[8 + n + begin:8 + n + end] == bytes(_bits(t).numpy())


def test_a_sharded_write_is_split_and_indexed_as_huggingface_hub_does(tmp_path):
    from huggingface_hub import save_torch_state_dict

    tensors = {k: t.contiguous().clone() for k, t in _tensors().items()}
    big = tensors.pop("t_bf16")                       # 1184 bytes: over the limit, met in the middle
    names = list(tensors)
    tensors = {**{k: tensors[k] for k in names[:5]}, "t_bf16": big, **{k: tensors[k] for k in names[5:]}}
    tensors.update({f"extra.{i}": _random(torch.float32, (40 + i,), torch.Generator().manual_seed(i))
                    for i in range(4)})
    _write_in_pieces(tmp_path / "ours", tensors, max_shard_size="1KB", seed=2)
    (tmp_path / "hub").mkdir()
    save_torch_state_dict(tensors, tmp_path / "hub", max_shard_size="1KB")

    ours, hub = _snapshot(tmp_path / "ours"), _snapshot(tmp_path / "hub")
    assert ours.keys() == hub.keys() and len(ours) > 3            # same file names, an index, >2 shards
    ours_index, hub_index = json.loads(ours[SAFE_INDEX]), json.loads(hub[SAFE_INDEX])
    assert ours_index["weight_map"] == hub_index["weight_map"]
    assert ours_index["metadata"] == {"total_size": hub_index["metadata"]["total_size"]}
    assert ours[SAFE_INDEX].decode() == json.dumps(ours_index, indent=2, sort_keys=True) + "\n"
    for file in ours.keys() - {SAFE_INDEX}:
        mine, theirs = load_file(tmp_path / "ours" / file), load_file(tmp_path / "hub" / file)
        assert mine.keys() == theirs.keys() and all(_same(mine[k], theirs[k]) for k in mine), file
    with open_weights(tmp_path / "ours") as weights:
        _check_reads(weights, tensors, random.Random(SEED))
        assert all(os.path.basename(weights.file_of(k)) == f for k, f in ours_index["weight_map"].items())


@pytest.mark.parametrize("text, size", [
    ("5GB", 5 * 10**9), ("5GiB", 5 * 2**30), ("500MB", 500 * 10**6), ("100KB", 10**5), (" 2 mib ", 2 * 2**20),
    ("1.5GB", 1_500_000_000), ("1TB", 10**12), (1234, 1234), ("4096", 4096)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["5XB", "GB", "", 0, -3, True, 1.5])
def test_parse_size_refuses(bad):
    with pytest.raises((ValueError, TypeError)):
        parse_size(bad)


def _sized(*sizes):
    """Entries of uint8 tensors with these byte counts, named a, b, c, ..."""
    return [(chr(ord("a") + i), torch.uint8, (s,)) for i, s in enumerate(sizes)]


@pytest.mark.parametrize("sizes, limit, files", [
    ((6, 6, 2, 6, 2, 2), 10, ["a", "bc", "def"]),        # huggingface_hub's docstring example
    ((4, 20, 4), 10, ["b", "ac"]),                        # too big: a file of its own, placed first
    ((10, 0, 1), 10, ["ab", "c"]),                        # exactly at the limit; empty fits anywhere
    ((3, 3), 100, ["ab"]),
    ((), 10, [""]),                                       # nothing: one empty file
])
def test_plan_files(sizes, limit, files):
    assert plan_files(_sized(*sizes), limit) == [list(f) for f in files]


def test_file_names():
    assert file_names(1) == ["model.safetensors"]
    assert file_names(3) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


# ----------------------------------------------------- transformers' files
@pytest.fixture(scope="module")
def gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(SEED)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def _file_keys(folder) -> set:
    keys = set()
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), framework="pt") as g:
                keys |= set(g.keys())
        elif f.endswith(".bin"):
            keys |= set(torch.load(os.path.join(folder, f), weights_only=True))
    return keys


def test_reads_what_transformers_and_huggingface_hub_write(gpt2, tmp_path):
    from huggingface_hub import save_torch_state_dict

    state = {k: v.detach() for k, v in gpt2.state_dict().items()}
    gpt2.save_pretrained(tmp_path / "single")
    gpt2.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    written = _file_keys(tmp_path / "single")                 # GPT-2's tied lm_head is written once
    assert written and written <= state.keys()
    plain = {k: state[k].contiguous() for k in state if k in written}
    for sub, kw in {"bin": {}, "bin_sharded": {"max_shard_size": "20KB"}}.items():
        (tmp_path / sub).mkdir()
        save_torch_state_dict(plain, tmp_path / sub, safe_serialization=False, **kw)
    assert os.listdir(tmp_path / "bin") == ["pytorch_model.bin"]
    assert "pytorch_model.bin.index.json" in os.listdir(tmp_path / "bin_sharded")
    assert SAFE_INDEX in os.listdir(tmp_path / "sharded")

    for sub, suffix in [("single", ".safetensors"), ("sharded", ".safetensors"), ("bin", ".bin"),
                        ("bin_sharded", ".bin")]:
        with open_weights(tmp_path / sub) as weights:
            assert set(weights.names()) == _file_keys(tmp_path / sub) == written, sub
            assert all(weights.file_of(k).endswith(suffix) for k in written), sub
            _check_reads(weights, plain, random.Random(SEED))
    # Both kinds in one folder: safetensors wins, as in transformers.
    os.link(tmp_path / "bin" / "pytorch_model.bin", tmp_path / "single" / "pytorch_model.bin")
    with open_weights(tmp_path / "single") as weights:
        assert weights.file_of("transformer.wte.weight").endswith("model.safetensors")


def test_our_split_and_index_equal_transformers_and_from_pretrained_reads_our_folder(gpt2, tmp_path):
    import transformers

    gpt2.save_pretrained(tmp_path / "theirs", max_shard_size="20KB")
    theirs = json.loads(open(tmp_path / "theirs" / SAFE_INDEX).read())
    state = {k: v.detach() for k, v in gpt2.state_dict().items() if k in theirs["weight_map"]}
    _write_in_pieces(tmp_path / "ours", state, max_shard_size="20KB", seed=3,
                     extra_files={"config.json": gpt2.config.to_json_string().encode()})
    ours = json.loads(open(tmp_path / "ours" / SAFE_INDEX).read())
    assert ours["weight_map"] == theirs["weight_map"] and len(set(ours["weight_map"].values())) > 2
    assert ours["metadata"]["total_size"] == theirs["metadata"]["total_size"]

    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ours")
    got = loaded.state_dict()
    assert all(_same(got[k], v) for k, v in gpt2.state_dict().items())    # lm_head tied back to wte


# ------------------------------------------------------------- torch files
def test_torch_state_dict_files_are_mapped_and_sliced_into_new_tensors(tmp_path, monkeypatch):
    tensors = _tensors()
    # torch's legacy (non-zip) format cannot hold float8 or uint16-64 (torch.load fails on them itself).
    no_legacy = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")}
    legacy = {k: t for k, t in tensors.items() if t.dtype not in no_legacy}
    torch.save(tensors, tmp_path / "weights.pt")                          # transposed stays a view
    torch.save(legacy, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    calls, real_load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: calls.append(kw) or real_load(*a, **kw))
    for name, tensors in (("weights.pt", tensors), ("legacy.bin", legacy)):
        with open_weights(tmp_path / name) as weights:
            assert weights.names() == list(tensors) and weights.metadata == {}
            _check_reads(weights, tensors, random.Random(SEED))
            got = weights.read("t_i64", 2, 6)
            got.fill_(-1)                                                  # a new tensor: the source unchanged
            assert _same(weights.read("t_i64", 2, 6), tensors["t_i64"][2:6])
    assert [(c["mmap"], c["weights_only"]) for c in calls] == [(True, True), (False, True)]


def test_a_range_read_reads_only_its_bytes(tmp_path, monkeypatch):
    big = torch.arange(1 << 18, dtype=torch.float32)                        # 1 MiB
    save_file({"big": big, "small": torch.ones(3, dtype=torch.bfloat16)}, tmp_path / "w.safetensors")
    read, real = [], os.preadv
    with open_weights(tmp_path / "w.safetensors") as weights:
        monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: read.append(real(fd, bufs, off)) or read[-1])
        assert torch.equal(weights.read("big", 1000, 1100), big[1000:1100])
        assert sum(read) == 400
        weights.read("big")
        assert sum(read) == 400 + 4 * (1 << 18)                           # the counter sees whole reads too


# --------------------------------------------------------- damaged sources
def _raw_safetensors(path, header: dict, data: bytes) -> str:
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
    return str(path)


F32_2x2 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


@pytest.mark.parametrize("header, data, message", [
    ({"w": {**F32_2x2, "data_offsets": [0, 12]}}, bytes(12), r"'w': data_offsets \[0, 12\] hold 12 bytes .* needs 16"),
    ({"w": {**F32_2x2, "dtype": "F4"}}, bytes(16), r"'w' has dtype 'F4', which this reader does not know"),
    ({"w": F32_2x2, "v": {**F32_2x2, "data_offsets": [20, 36]}}, bytes(36), r"'v' starts at data byte 20"),
    ({"w": F32_2x2}, bytes(10), r"truncated: \d+ bytes, header needs \d+ \(tensor 'w'"),
    ({"w": {**F32_2x2, "shape": [2, -2]}}, bytes(16), r"'w' has shape \[2, -2\]"),
    ({"__metadata__": {"step": 3}}, b"", r"__metadata__ must map strings to strings"),
])
def test_damaged_headers_are_refused_naming_file_and_tensor(tmp_path, header, data, message):
    path = _raw_safetensors(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(WeightFileError, match=message) as e:
        open_weights(path)
    assert str(e.value).startswith(path)


def test_unreadable_headers_are_refused(tmp_path):
    cases = {"json": struct.pack("<Q", 8) + b"{nope!!}", "length": struct.pack("<Q", 500) + b"{}",
             "short": b"\x01\x02", "twice": struct.pack("<Q", 30) + b'{"w": 1, "w": 2}'.ljust(30)}
    messages = {"json": "the header is not valid JSON", "length": "truncated: 10 bytes, header needs 508",
                "short": "truncated: 2 bytes, header needs 8", "twice": "'w' appears twice in the header"}
    for name, raw in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(raw)
        with pytest.raises(WeightFileError, match=messages[name]):
            open_weights(path)


def test_a_truncated_shard_is_refused_naming_it(tmp_path):
    tensors = {f"w{i}": torch.randn(64) for i in range(4)}
    _write_in_pieces(tmp_path / "out", tensors, max_shard_size=300)          # one tensor per file
    shard = tmp_path / "out" / "model-00002-of-00004.safetensors"
    size = os.path.getsize(shard)
    os.truncate(shard, size - 3)
    with pytest.raises(WeightFileError, match=rf"truncated: {size - 3} bytes, header needs {size} \(tensor 'w1'") as e:
        open_weights(tmp_path / "out")
    assert str(e.value).startswith(str(shard))


def test_index_problems_are_refused_naming_file_and_tensor(tmp_path):
    tensors = {f"w{i}": torch.randn(64) for i in range(3)}
    _write_in_pieces(tmp_path / "out", tensors, max_shard_size=300)
    os.remove(tmp_path / "out" / "model-00002-of-00003.safetensors")
    with pytest.raises(WeightFileError, match=r"out/model-00002-of-00003.safetensors listed in "
                                              r"model.safetensors.index.json for 'w1' is missing"):
        open_weights(tmp_path / "out")

    two = tmp_path / "two"
    two.mkdir()
    save_file({"w": torch.ones(2), "a": torch.ones(1)}, two / "a.safetensors")
    save_file({"w": torch.zeros(2), "b": torch.ones(1)}, two / "b.safetensors")
    (two / SAFE_INDEX).write_text(json.dumps({"weight_map": {"w": "a.safetensors", "b": "b.safetensors"}}))
    with pytest.raises(WeightFileError, match=r"'w' is in two files: .*a.safetensors and .*b.safetensors"):
        open_weights(two)

    (two / SAFE_INDEX).write_text(json.dumps({"weight_map": {"a": "a.safetensors", "x": "a.safetensors"}}))
    os.remove(two / "b.safetensors")
    with pytest.raises(WeightFileError, match=r"lists 'x' in a.safetensors, which holds no such tensor"):
        open_weights(two)


def test_sources_that_are_not_weights_are_refused(tmp_path):
    with pytest.raises(WeightFileError, match="holds no Hugging Face weights: looked for model.safetensors, "
                                              "model.safetensors.index.json, pytorch_model.bin"):
        open_weights(tmp_path)
    with pytest.raises(FileNotFoundError, match="nowhere does not exist"):
        open_weights(tmp_path / "nowhere")
    torch.save({"model": {"w": torch.ones(1)}, "step": 3}, tmp_path / "ckpt.pt")
    with pytest.raises(WeightFileError, match="ckpt.pt: entry 'model' is a dict"):
        open_weights(tmp_path / "ckpt.pt")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(WeightFileError, match="notes.txt: neither a safetensors file nor a state dict"):
        open_weights(tmp_path / "notes.txt")


# ------------------------------------------------------ writes that fail
def test_commit_refuses_a_hole_naming_the_tensor_and_then_takes_the_rest(tmp_path):
    w = WeightWriter(tmp_path / "out", [("a", torch.float32, (4, 4)), ("b", torch.int8, (3,))])
    w.write("a", torch.ones(4), 0)
    w.write("a", torch.ones(6), 10)
    with pytest.raises(WeightFileError, match=r"'a' lacks elements \[4, 10\) of 16; 'b' lacks elements \[0, 3\)"):
        w.commit()
    assert not (tmp_path / "out").exists()
    w.write("a", torch.full((6,), 2.0), 4)
    w.write("b", torch.tensor([1, 2, 3], dtype=torch.int8))
    w.commit()
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["a"].reshape(-1),
                       torch.tensor([1.0] * 4 + [2.0] * 6 + [1.0] * 6))
    with pytest.raises(RuntimeError, match="was committed"):
        w.write("b", torch.ones(1, dtype=torch.int8))


def test_bad_writes_are_refused_before_any_byte(tmp_path):
    with WeightWriter(tmp_path / "out", [("a", torch.bfloat16, (8,))]) as w:
        w.write("a", torch.ones(4, dtype=torch.bfloat16), 2)
        with pytest.raises(ValueError, match=r"elements \[5, 6\) of 'a' were written already"):
            w.write("a", torch.zeros(2, dtype=torch.bfloat16), 5)
        with pytest.raises(TypeError, match="'a' is written as bfloat16 but the values are float32: cast"):
            w.write("a", torch.ones(2), 0)
        with pytest.raises(ValueError, match=r"\[6, 10\) are outside 'a'"):
            w.write("a", torch.ones(4, dtype=torch.bfloat16), 6)
        with pytest.raises(KeyError, match="'b' is not among"):
            w.write("b", torch.ones(1))
        w.write("a", torch.full((2,), 3.0, dtype=torch.bfloat16), 0)
        w.write("a", torch.full((2,), 4.0, dtype=torch.bfloat16), 6)
    assert load_file(tmp_path / "out" / "model.safetensors")["a"].tolist() == [3, 3, 1, 1, 1, 1, 4, 4]
    with pytest.raises(ValueError, match="listed twice"):
        WeightWriter(tmp_path / "x", [("a", torch.float32, (1,)), ("a", torch.float32, (1,))])
    with pytest.raises(TypeError, match="safetensors has no dtype for complex64"):
        WeightWriter(tmp_path / "x", [("a", torch.complex64, (1,))])
    with pytest.raises(ValueError, match="'../x' must be a plain file name"):
        WeightWriter(tmp_path / "x", [], extra_files={"../x": b""})
    assert not (tmp_path / "x").exists() and not _siblings(tmp_path / "x")


def test_a_failed_write_leaves_the_previous_folder_byte_identical(tmp_path):
    dest, tensors = tmp_path / "model", {"w": torch.randn(5, 3), "b": torch.randn(3)}
    _write_in_pieces(dest, tensors, extra_files={"config.json": b'{"v": 1}'})
    (dest / "sub").mkdir()
    (dest / "sub" / "notes.txt").write_text("kept")
    before = _snapshot(dest)
    new = {"w": torch.zeros(5, 3), "b": torch.zeros(3)}

    with pytest.raises(RuntimeError, match="boom"):
        with WeightWriter(dest, _entries(new)) as w:
            w.write("w", new["w"])
            w.write("b", new["b"])
            raise RuntimeError("boom")
    assert _snapshot(dest) == before and not _siblings(dest)

    with pytest.raises(WeightFileError, match="'b' lacks"):          # a clean exit with a hole
        with WeightWriter(dest, _entries(new)) as w:
            w.write("w", new["w"])
    assert _snapshot(dest) == before and not _siblings(dest)

    w = WeightWriter(dest, _entries(new))
    w.write("w", new["w"])
    w.abort()
    assert _snapshot(dest) == before and not _siblings(dest)


def test_commit_keeps_the_old_folder_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    dest = tmp_path / "model"
    _write_in_pieces(dest, {"w": torch.randn(4)}, extra_files={"stale.txt": b"old"})
    before, new = _snapshot(dest), {"w": torch.zeros(4), "v": torch.ones(2, dtype=torch.int64)}
    seen, real_rename = [], os.rename

    def rename(src, dst, fail=False):
        if os.path.basename(src).startswith(".model.partial-"):        # step 2: the new folder -> dest
            aside = [f for f in _siblings(dest) if f.startswith(".model.replaced-")]
            seen.append((os.path.exists(dest), [_snapshot(tmp_path / f) for f in aside], _snapshot(src)))
            if fail:
                raise OSError("no room")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", lambda s, d: rename(s, d, fail=True))
    with pytest.raises(OSError, match="no room"):
        _write_in_pieces(dest, new)
    # At step 2 the old folder was whole beside dest (a crash there loses nothing); the error put it back.
    assert seen[-1][0] is False and seen[-1][1] == [before] and "model.safetensors" in seen[-1][2]
    assert _snapshot(dest) == before and not _siblings(dest)

    monkeypatch.setattr(os, "rename", rename)
    _write_in_pieces(dest, new, extra_files={"config.json": b"{}"})
    assert seen[-1][1] == [before]
    assert sorted(os.listdir(dest)) == ["config.json", "model.safetensors"] and not _siblings(dest)
    loaded = load_file(dest / "model.safetensors")
    assert loaded.keys() == new.keys() and all(torch.equal(loaded[k], v) for k, v in new.items())


def test_empty_and_zero_d_tensors_alone(tmp_path):
    tensors = {"scalar": torch.tensor(2.5), "none": torch.empty(0, dtype=torch.int32)}
    with WeightWriter(tmp_path / "out", _entries(tensors), metadata={"note": "tiny"}) as w:
        w.write("scalar", tensors["scalar"])
    loaded = load_file(tmp_path / "out" / "model.safetensors")
    assert all(_same(loaded[k], t) for k, t in tensors.items())
    with open_weights(tmp_path / "out") as weights:
        assert weights.metadata == {"note": "tiny"} and weights.shape("scalar") == ()
        assert _same(weights.read("scalar"), torch.tensor([2.5]))
    with WeightWriter(tmp_path / "nothing", []):
        pass
    assert load_file(tmp_path / "nothing" / "model.safetensors") == {}


def test_peer_writers_fill_the_owners_files_and_the_owner_counts_their_writes(tmp_path):
    # save_weights' parallel write in one process: the owner makes the folder, each peer writes its ranges
    # through descriptors of its own, the owner counts what they wrote; a range nobody wrote refuses the commit.
    torch.manual_seed(0)
    tensors = {"a": torch.randn(5, 7), "b": torch.randn(30).to(torch.bfloat16), "c": torch.arange(11)}
    entries = [(k, v.dtype, v.shape) for k, v in tensors.items()]
    dest = str(tmp_path / "out")
    owner = WeightWriter(dest, entries, max_shard_size=200)
    peers = [WeightWriter(dest, entries, max_shard_size=200, into=owner.partial) for _ in range(2)]
    for k, v in tensors.items():
        flat = v.reshape(-1)
        cut = [0, flat.numel() // 3, 2 * flat.numel() // 3, flat.numel()]
        for writer, lo, hi in zip([owner] + peers, cut, cut[1:]):
            if k != "c" or writer is owner:
                writer.write(k, flat[lo:hi], lo)
    written = [p.finish() for p in peers]
    owner.add_written(written[0])
    with pytest.raises(WeightFileError, match="'b' lacks elements"):
        owner.commit()
    owner.add_written(written[1])
    with pytest.raises(WeightFileError, match="'c' lacks elements"):
        owner.commit()
    late = WeightWriter(dest, entries, max_shard_size=200, into=owner.partial)
    late.write("c", tensors["c"][3:], 3)
    with pytest.raises(ValueError, match="written twice"):
        owner.add_written({"a": [(0, 1)]})
    owner.add_written(late.finish())
    owner.commit()
    got = {}
    for f in os.listdir(dest):
        got.update(load_file(os.path.join(dest, f)) if f.endswith(".safetensors") else {})
    assert sorted(os.listdir(dest)) == sorted(file_names(len(os.listdir(dest)) - 1)) + [SAFE_INDEX]
    assert all(torch.equal(got[k], v) for k, v in tensors.items())


def test_a_killed_writers_partial_folder_is_removed_by_the_next_write_and_a_live_ones_kept(tmp_path):
    import subprocess

    from shardopt.files import OWNER, mark_owner

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs
    made = {
        "dead, by the pid in its name": f".out.partial-{gone.pid}-0a1b2c3d",
        "dead, by its owner line": f".other.partial-{os.getpid()}-00ff00ff",
        "alive": f".out.partial-{os.getppid()}-12345678",
        "another host's": f".out.partial-{gone.pid}-9abcdef0",
        "not a partial folder": f".out.replaced-{gone.pid}-0a1b2c3d",
    }
    for what, name in made.items():
        os.mkdir(tmp_path / name)

    def owned_by(name, pid, host=None):  # the line mark_owner writes, for another process
        mark_owner(str(tmp_path / name))
        here, namespace, _ = open(tmp_path / name / OWNER).read().split()
        with open(tmp_path / name / OWNER, "w") as f:
            f.write(f"{host or here} {namespace} {pid}\n")

    owned_by(made["dead, by its owner line"], gone.pid)
    owned_by(made["alive"], os.getppid())
    owned_by(made["another host's"], gone.pid, host="elsewhere")
    with WeightWriter(str(tmp_path / "out"), [("w", torch.float32, (3,))]) as w:
        w.write("w", torch.ones(3))
    left = sorted(os.listdir(tmp_path))
    assert left == sorted(["out", made["alive"], made["another host's"], made["not a partial folder"]]), left
