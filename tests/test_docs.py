"""The docs' commands and Python run in CI, and a newcomer can get from the README to every page.

Every fenced shell block in README.md and docs/*.md carries one mark after its language:
  ```bash runnable            run here, line by line (`shardopt` and `python` mean this interpreter);
  ```bash ci                  each command (`&&`-separated) is a line of .ci/run, which runs it;
  ```bash covered-by TEST...  each named test (tests/FILE.py::test_name) exists and runs the command
                              (with smaller sizes, or on the emulated cluster where the doc says NODE0).
and so does every fenced Python block:
  ```python runnable [SETUP]  run here as written, on 2 gloo ranks, with what it leaves undefined set up
                              around it (Note [The docs' Python, run as written]);
  ```python covered-by TEST...  each named test exists and makes the same calls with what the block elides
                              (a Trainer and its data, a pretrained folder, a DeepSpeed checkpoint).
A block without a mark fails: a command or a snippet that nothing runs can break unnoticed.
"""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))
SHELLS = ("bash", "sh", "shell", "console")
MARKS = ("runnable", "ci", "covered-by")
PYTHON_MARKS = ("runnable", "covered-by")


def _blocks(page):
    """(line number, language, words after it, lines) of every fenced block of a page."""
    out, lines = [], open(os.path.join(ROOT, page)).read().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\S*)\s*(.*)$", lines[i])
        if m:
            indent, lang, info = m.groups()
            body, j = [], i + 1
            while j < len(lines) and lines[j].strip() != "```":
                body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
                j += 1
            out.append((i + 1, lang, info.split(), body))
            i = j + 1
            continue
        i += 1
    return out


def _shell_blocks():
    return [(page, *b) for page in PAGES for b in _blocks(page) if b[1] in SHELLS]


def _python_blocks():
    return [(page, *b) for page in PAGES for b in _blocks(page) if b[1] == "python"]


def _commands(body):
    """Shell commands of a block: continuation lines joined, comments dropped."""
    cmds, cur = [], ""
    for line in body:
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        cur += line.rstrip()
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        cmds.append(re.sub(r"\s+#\s.*$", "", cur).strip())
        cur = ""
    return cmds


def test_every_shell_block_is_run_somewhere():
    blocks = _shell_blocks()
    assert len(blocks) >= 8, blocks  # the parser finds the docs' blocks
    bad = [f"{page}:{line}: ```{lang} {' '.join(info)}" for page, line, lang, info, _ in blocks
           if not info or info[0] not in MARKS or (info[0] == "covered-by" and len(info) < 2)]
    assert not bad, "shell blocks nothing runs (mark them runnable, ci or covered-by TEST):\n" + "\n".join(bad)


def test_covering_tests_exist():
    missing = []
    for page, line, _, info, _ in _shell_blocks() + _python_blocks():
        if not info or info[0] != "covered-by":
            continue
        for node in info[1:]:
            path, _, name = node.partition("::")
            name = name.split("[")[0]
            full = os.path.join(ROOT, path)
            if not name or not os.path.isfile(full) or not re.search(rf"^def {re.escape(name)}\(",
                                                                       open(full).read(), re.M):
                missing.append(f"{page}:{line}: {node}")
    assert not missing, "covered-by names a test that does not exist:\n" + "\n".join(missing)


def test_ci_blocks_are_what_ci_runs():
    ci = {line.strip() for line in open(os.path.join(ROOT, ".ci", "run")).read().splitlines()}
    blocks = [(page, line, body) for page, line, _, info, body in _shell_blocks() if info[0] == "ci"]
    assert blocks, "the README's two commands are marked ci"
    for page, line, body in blocks:
        for cmd in _commands(body):
            for part in cmd.split(" && "):
                assert part.strip() in ci, f"{page}:{line}: .ci/run does not run `{part.strip()}`"


RUNNABLE = [(page, line, cmd) for page, line, _, info, body in _shell_blocks() if info[0] == "runnable"
            for cmd in _commands(body)]


@pytest.mark.parametrize("page, line, cmd", RUNNABLE, ids=[f"{p}:{ln}" for p, ln, _ in RUNNABLE])
def test_runnable_commands_run(page, line, cmd):
    words = shlex.split(cmd)
    if words[0] == "shardopt":
        words = [sys.executable, "-m", "shardopt"] + words[1:]
    elif words[0] == "python":
        words = [sys.executable] + words[1:]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(words, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{page}:{line}: `{cmd}` exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"{page}:{line}: `{cmd}` printed nothing"


def test_runnable_blocks_exist():
    assert RUNNABLE, "at least one command is run as the docs write it"


# ------------------------------------------------------------------ Python blocks
# Note [The docs' Python, run as written]
# A snippet in the docs is the part of a training script that concerns shardopt: the model, the data and the
# launch are the reader's. A `runnable` block runs here exactly as the page shows it, on 2 gloo ranks (one
# launch for all of them: Note [Several cases in one launch] in tests/dist_harness.py), each block in a folder
# of its own (a block writes "ckpt", reads "ds.json"), after SETUP has defined what it leaves to the reader:
# `MyModel` (tokens in, logits out: it trains in fp32 and bf16 and builds on the meta device), `loss_fn`,
# `loader` (3 batches, other data per rank), `my_batches` (2 on rank 0, 3 on rank 1), `step`, `ema` (an
# average of whole weights, which fails on a parameter that is not whole) and `model`, a plain MyModel().
# `runnable sharded` adds SHARDED: `model` and `opt` a ShardedDDP and its ShardedOptimizer (stage 2) after a
# step, `sched` an LR scheduler over opt; `runnable trainer` adds TRAINER: `trainer`, a ShardedTrainer at
# stage 3 over a small GPT-2, not yet trained. torchrun's part is played by the launch: the process group
# exists before a block runs, torchrun's variables are set, and a block's own
# `torch.distributed.init_process_group("gloo")` finds the group there (a stand-in that checks the backend).
# What a block elides with `...` as an argument, or what needs a pretrained folder, another library's
# checkpoint or a TRL trainer, is `covered-by` the test that makes those calls.
SETUP = '''
import os
import torch
import shardopt
from torch import nn


class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.hidden = nn.Linear(16, 64)
        self.head = nn.Linear(64, 32)

    def forward(self, x):
        return self.head(torch.relu(self.hidden(self.emb(x))))


def loss_fn(logits, y):
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def _batches(n):
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    return [(torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)) for _ in range(n)]


class EMA:
    def __init__(self, module, decay=0.9):
        self.decay, self.average = decay, [p.detach().clone().float() for p in module.parameters()]

    def update(self, module):
        with torch.no_grad():
            for a, p in zip(self.average, module.parameters(), strict=True):
                a.lerp_(p.float(), 1 - self.decay)  # a shape error where p is not whole


torch.manual_seed(0)
loader, my_batches, step = _batches(3), _batches(2 + torch.distributed.get_rank()), 3
ema = EMA(MyModel())
model = MyModel()
'''
SHARDED = '''
opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=1e-3, stage=2)
model = shardopt.ShardedDDP(model, opt)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
loss_fn(model(loader[0][0]), loader[0][1]).backward()
opt.step(); opt.zero_grad(); sched.step()
'''
# `runnable trainer`: a ShardedTrainer at stage 3 over a small GPT-2 (transformers is a test dependency).
TRAINER = '''
import transformers
from shardopt.integrations.transformers import ShardedTrainer

_cfg = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
                               eos_token_id=0)
_rows = torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(0))
trainer = ShardedTrainer(model=transformers.GPT2LMHeadModel(_cfg), train_dataset=[{"input_ids": r, "labels": r} for r in _rows],
                         args=transformers.TrainingArguments(output_dir="out", report_to="none", use_cpu=True, max_steps=2,
                                                             per_device_train_batch_size=4, save_strategy="no",
                                                             disable_tqdm=True),
                         shardopt_kwargs={"stage": 3})
'''
SETUPS = {(): SETUP, ("sharded",): SETUP + SHARDED, ("trainer",): SETUP + TRAINER}
# The files a block reads, made in its folder before the launch.
FILES = {"ds.json": {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
                     "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
                     "zero_optimization": {"stage": 2, "reduce_bucket_size": 500}}}

PYTHON_RUNNABLE = [(page, line, tuple(info[1:]), body) for page, line, _, info, body in _python_blocks()
                   if info and info[0] == "runnable"]


def _block_id(page, line):
    return f"{page}:{line}"


def _run_block(rank, world_size, page, line, setup, body, folder):
    """One docs block on this rank: SETUP, then the block as written, in `folder` (Note [The docs' Python, run as
    written]). Tracebacks name the page and its line."""
    import torch.distributed as dist

    launched = dist.init_process_group

    def init_process_group(backend=None, *args, **kwargs):  # torchrun's part: the launch made the group
        assert backend in (None, dist.get_backend()), f"the block starts {backend!r}; the launch made gloo"

    os.chdir(folder)
    # What torchrun --nproc-per-node 2 sets (shard_group="node" reads LOCAL_WORLD_SIZE, accelerate all of it;
    # nothing connects to MASTER_PORT: the group exists).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    dist.init_process_group = init_process_group
    try:
        namespace = {"__name__": "__main__"}
        exec(compile(setup, "<tests/test_docs.py SETUP>", "exec"), namespace)
        # Blank lines first, so that a traceback's line number is the page's.
        exec(compile("\n" * line + "\n".join(body), page, "exec"), namespace)
    finally:
        dist.init_process_group = launched
    dist.barrier()  # every rank done with this block before the next begins
    return True


@pytest.fixture(scope="module")
def python_launch(tmp_path_factory):
    from dist_harness import SharedLaunch

    def cases():
        root, out = tmp_path_factory.mktemp("docs-python"), {}
        for page, line, setup, body in PYTHON_RUNNABLE:
            folder = root / _block_id(page, line).replace("/", "-").replace(":", "-")
            folder.mkdir()
            for name, content in FILES.items():
                (folder / name).write_text(json.dumps(content))
            out[_block_id(page, line)] = (_run_block, (page, line, SETUPS[setup], body, str(folder)))
        return out

    return SharedLaunch(2, cases, timeout=300)


def test_every_python_block_is_run_somewhere():
    blocks = _python_blocks()
    assert len(blocks) >= 15, blocks  # the parser finds the docs' blocks
    bad = [f"{page}:{line}: ```python {' '.join(info)}" for page, line, _, info, _ in blocks
           if not info or info[0] not in PYTHON_MARKS or (info[0] == "covered-by" and len(info) < 2)
           or (info[0] == "runnable" and tuple(info[1:]) not in SETUPS)]
    assert not bad, ("Python blocks nothing runs (mark them runnable [sharded|trainer], or covered-by TEST):\n"
                     + "\n".join(bad))


@pytest.mark.parametrize("page, line", [(p, ln) for p, ln, _, _ in PYTHON_RUNNABLE],
                         ids=[_block_id(p, ln) for p, ln, _, _ in PYTHON_RUNNABLE])
def test_python_block_runs_as_written(python_launch, page, line):
    assert python_launch.results(_block_id(page, line)) == [True, True]


# ------------------------------------------------------------------ pages
def _slug(heading):
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page):
    text = open(os.path.join(ROOT, page)).read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def test_readme_is_short_and_reaches_every_page():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert len(readme.splitlines()) <= 200, f"README.md has {len(readme.splitlines())} lines: move detail to docs/"
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)", readme))
    pages = {p for p in PAGES if p.startswith("docs")}
    assert pages <= linked, f"pages the README does not link: {sorted(pages - linked)}"


def test_links_point_at_files_and_headings_that_exist():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", open(os.path.join(ROOT, page)).read(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(os.path.join(ROOT, dest)):
                broken.append(f"{page}: ({target}): no {dest}")
            elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
                broken.append(f"{page}: ({target}): no heading #{anchor} in {dest}")
    assert not broken, "\n".join(broken)


# The integrations whose oldest admitted versions CI tests, and the test files that use them.
_INTEGRATION_TESTS = {"transformers": ["tests/test_hf_trainer.py"], "accelerate": ["tests/test_hf_trainer.py"],
                      "lightning": ["tests/test_lightning.py", "tests/test_onebit.py"],
                      "deepspeed": ["tests/test_interop_deepspeed.py", "tests/test_onebit.py",
                                    "tests/test_hf_trainer.py"],
                      "trl": ["tests/test_trl.py"]}


def test_ci_tests_the_floors_setup_py_admits():
    """.ci/run's second venv installs exactly the oldest version setup.py admits of each integration and
    runs the tests that use it there: what is installed when a pytest line runs is what the install lines
    before it pinned, the later pin of a package winning (TRL's floor needs a newer accelerate than
    transformers', so its tests run after the others, on an install of their own)."""
    setup = open(os.path.join(ROOT, "setup.py")).read()
    floors = dict(re.findall(r'"(transformers|accelerate|lightning|deepspeed|trl)>=([0-9.]+)', setup))
    assert floors.keys() == _INTEGRATION_TESTS.keys(), floors
    pins, runs = {}, []
    for ln in open(os.path.join(ROOT, ".ci", "run")).read().splitlines():
        if ln.strip().startswith(".venv-oldest/bin/pip install"):  # ci_setup's indented too
            pins.update(re.findall(r"\b(transformers|accelerate|lightning|deepspeed|trl)==([0-9.]+)", ln))
        elif ln.startswith('PYTHONPATH="$PWD" .venv-oldest/bin/python -m pytest'):
            runs.append((ln.split(), dict(pins)))
    for name, files in _INTEGRATION_TESTS.items():
        for f in files:
            where = [installed for words, installed in runs if f in words]
            assert where, f"{f} ({name}) is not run in .venv-oldest by .ci/run"
            assert all(installed.get(name) == floors[name] for installed in where), (name, f, floors[name], where)


# ------------------------------------------------------------------ the version sets CI tests
def _setup_requirements(extra):
    """setup.py's install_requires plus the requirements of one of its extras, read from its source (ast: the
    module-level constants and the setup() call; nothing of setup.py runs)."""
    import ast

    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    consts = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                consts[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass

    def value(node):
        if isinstance(node, ast.Name):
            return consts[node.id]
        if isinstance(node, ast.BinOp):
            return value(node.left) + value(node.right)
        if isinstance(node, ast.List):
            return [x for e in node.elts for x in (value(e) if isinstance(value(e), list) else [value(e)])]
        return ast.literal_eval(node)

    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
    kw = {k.arg: k.value for k in call.keywords}
    extras = dict(zip((ast.literal_eval(k) for k in kw["extras_require"].keys), kw["extras_require"].values))
    return value(kw["install_requires"]) + value(extras[extra])


def _readme_installs():
    """The `pip install` parts of the README's `ci` blocks."""
    parts = [part.strip() for page, _, _, info, body in _shell_blocks() if page == "README.md" and info[0] == "ci"
             for cmd in _commands(body) for part in cmd.split(" && ")]
    return [p for p in parts if "pip install" in p]


def test_readme_installs_the_versions_ci_last_passed_with():
    """The README's set-up installs constraints.txt's versions (.ci/lock-refresh writes it from the main lane's
    venv): every pip install of it takes the file, which pins torch as the command does and every package of
    setup.py's test extra at a version setup.py admits, and not shardopt itself."""
    from packaging.requirements import Requirement

    pins = {}
    for ln in open(os.path.join(ROOT, "constraints.txt")).read().splitlines():
        if ln.strip() and not ln.startswith("#"):
            name, _, version = ln.partition("==")
            assert version, f"constraints.txt: {ln!r} is not name==version"
            pins[name.lower().replace("_", "-")] = version
    installs = _readme_installs()
    assert installs and all(" -c constraints.txt " in p for p in installs), installs
    readme_torch = {m for p in installs for m in re.findall(r"\btorch==(\S+)", p)}
    assert readme_torch == {pins.get("torch")}, (readme_torch, pins.get("torch"))
    assert "shardopt" not in pins
    wrong = []
    for req in map(Requirement, _setup_requirements("test")):
        have = pins.get(req.name.lower().replace("_", "-"))
        if have is None or have not in req.specifier:
            wrong.append(f"{req}: constraints.txt has {have}")
    assert not wrong, "constraints.txt against setup.py's test extra:\n" + "\n".join(wrong)


def test_ci_runs_the_whole_suite_on_the_newest_versions():
    """.ci/run's newest lane: .ci/newest-torch installs in ci_setup, then runs on the CUDA check's build with no
    test selection (the whole suite); it resolves the test extra without constraints.txt."""
    run = [ln.strip() for ln in open(os.path.join(ROOT, ".ci", "run")).read().splitlines()]
    assert "bash .ci/newest-torch --install-only" in run
    lane = [ln for ln in run if ln.startswith("NEWEST_TORCH_BUILD=") and ".ci/newest-torch" in ln]
    assert lane == ["NEWEST_TORCH_BUILD=cuda-check bash .ci/newest-torch --installed"], lane
    assert run.index(lane[0]) > run.index("bash .ci/check-cuda-build")
    script = open(os.path.join(ROOT, ".ci", "newest-torch")).read()
    assert "constraints.txt" not in "".join(ln for ln in script.splitlines() if "pip_quiet install" in ln)
    assert '[ $# -gt 0 ] || set -- tests' in script
