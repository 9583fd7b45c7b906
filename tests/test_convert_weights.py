"""`shardopt convert CKPT DIR`: a checkpoint's whole weights as the Hugging Face folder save_weights writes,
streamed (shardopt/checkpoint/hf_convert.py).

A stage-3 run at 2 ranks of a real GPT2LMHeadModel built from a small config (head tied to the embedding,
one frozen parameter: sharded at stage 3 and saved as model state) saves, in the same rank function, a
sharded checkpoint and `shardopt.save_weights`' folder. Converting the checkpoint must give that folder
file for file and byte for byte (fp32 and bf16 models), which `from_pretrained` loads with nothing missing
or unexpected. The memory check converts a model of 32 equal layers in a fresh process and compares the
growth of its peak resident memory with the model's size, against the torch-file output (which holds the
whole model) as a control that the measurement sees a whole model when one is held.
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.dist_harness import run_ranks

transformers = pytest.importorskip("transformers")  # a test dependency (setup.py [test]); here for the message
from safetensors.torch import load_file  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = (torch.float32, torch.bfloat16)


def _gpt2(dtype):
    torch.manual_seed(5)
    config = transformers.GPT2Config(vocab_size=96, n_embd=40, n_layer=2, n_head=4, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).to(dtype)
    model.transformer.wpe.weight.requires_grad_(False)  # frozen: stage 3 shards it, checkpoints keep it whole
    return model


def _train_and_save(rank, world, root):
    """Per dtype: 2 steps at stage 3, then a sharded checkpoint and save_weights' folder of the same model."""
    import shardopt

    for dtype in DTYPES:
        name = str(dtype).split(".")[-1]
        model = _gpt2(dtype)
        opt = shardopt.ShardedOptimizer([p for p in model.parameters() if p.requires_grad], torch.optim.AdamW,
                                        lr=1e-2, stage=3, reduce_bucket_size=3000)
        wrapper = shardopt.ShardedDDP(model, opt)
        for step in range(2):
            ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(10 * step + rank))
            wrapper(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        # As a Trainer's checkpoint-N: the model's config beside the save_checkpoint folder.
        shardopt.save_checkpoint(os.path.join(root, name, "run", "shardopt"), wrapper, opt)
        shardopt.save_weights(model, os.path.join(root, name, "saved"), max_shard_size="50KB")


def _files(folder):
    out = {}
    for f in sorted(os.listdir(folder)):
        with open(os.path.join(folder, f), "rb") as fh:
            out[f] = fh.read()
    return out


def _tensors(folder):
    out = {}
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("convert"))
    run_ranks(_train_and_save, 2, root, timeout=300)
    for dtype in DTYPES:  # the run folder holds the model's config, as a Trainer's checkpoint-N does
        where = os.path.join(root, str(dtype).split(".")[-1])
        for f in ("config.json", "generation_config.json"):
            shutil.copy(os.path.join(where, "saved", f), os.path.join(where, "run", f))
    return root


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_convert_gives_the_folder_save_weights_writes(trained, tmp_path, dtype, capsys):
    from shardopt.tools import cli

    where = os.path.join(trained, str(dtype).split(".")[-1])
    saved = os.path.join(where, "saved")
    assert os.path.exists(os.path.join(saved, "model.safetensors.index.json"))  # several files
    out = str(tmp_path / "converted")
    assert cli.main(["convert", os.path.join(where, "run", "shardopt"), out, "--max-shard-size", "50KB"]) == 0
    assert "config from" in capsys.readouterr().out
    # Byte for byte: the same files, headers, split, tied weight once, config.json and generation_config.json.
    assert _files(out) == _files(saved)
    again, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert again.dtype == dtype

    # The tag folder given, another split, the fp32 masters: the same weights (rounded to bf16: the model's).
    tag = os.path.join(where, "run", "shardopt", "ckpt-000001")
    masters = str(tmp_path / "masters")
    assert cli.main(["convert", tag, masters, "--dtype", "master", "--config", "none"]) == 0
    got, want = _tensors(masters), _tensors(saved)
    assert sorted(os.listdir(masters)) == ["model.safetensors"] and got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k].to(v.dtype), v), k
        assert got[k].dtype == (v.dtype if k == "transformer.wpe.weight" else torch.float32), k  # wpe: frozen


def test_convert_refuses_to_replace_a_folder_that_is_not_weights(trained, tmp_path):
    from shardopt.tools import cli

    ckpt = os.path.join(trained, "float32", "run", "shardopt")
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    assert cli.main(["convert", ckpt, str(other)]) == 1
    assert os.listdir(other) == ["todo.txt"]
    out = str(tmp_path / "w")
    assert cli.main(["convert", ckpt, out]) == 0 and cli.main(["convert", ckpt, out + "/"]) == 0  # replaced
    assert cli.main(["convert", ckpt, str(tmp_path / "w.pt"), "--dtype", "bf16"]) == 2  # torch file: no --dtype
    assert cli.main(["convert", ckpt, str(tmp_path / "w.pt")]) == 0
    assert set(torch.load(str(tmp_path / "w.pt"), weights_only=True)) == {"model", "optimizer", "extra"}


# ------------------------------------------------------------------ memory
LAYERS, WIDTH = 32, 512  # 32 parameters of 1 MiB: a model of 32 MiB


def _save_wide(rank, world, path):
    import shardopt

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    opt = shardopt.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, stage=3,
                                    reduce_bucket_size=WIDTH * WIDTH)
    shardopt.save_checkpoint(path, shardopt.ShardedDDP(model, opt), opt)


_MEASURE = textwrap.dedent("""
    import sys
    import safetensors.torch, shardopt.checkpoint.hf_convert  # noqa: F401 - imported before measuring
    from shardopt.tools import cli

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    before = status("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident size starts again from now
    except OSError:
        pass
    assert cli.main(["convert", sys.argv[1], sys.argv[2]]) == 0
    print(status("VmHWM") - before)
""")


def _growth(ckpt, out):
    """Peak resident memory a convert adds, in bytes, measured in a fresh process."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _MEASURE, ckpt, out], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stdout.split()[-1])


def test_convert_holds_one_parameter_not_the_model(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_save_wide, 2, ckpt, timeout=300)
    model = LAYERS * WIDTH * WIDTH * 4
    streamed = _growth(ckpt, str(tmp_path / "folder"))
    whole = _growth(ckpt, str(tmp_path / "model.pt"))
    print(f"peak growth: folder {streamed / 2**20:.1f} MiB, torch file {whole / 2**20:.1f} MiB, model "
          f"{model / 2**20:.0f} MiB")
    assert whole > model, (whole, model)  # the control: a path that holds the whole model is seen doing so
    assert streamed < model / 4, (streamed, model)  # measured: about one parameter (1 MiB)
    assert _tensors(str(tmp_path / "folder")).keys() == {f"{i}.weight" for i in range(LAYERS)}
