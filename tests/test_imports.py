"""The package's shape, read with `ast` (no import runs): the engine stands without its wings.

shardopt/*.py is the engine; parallel/, checkpoint/ and zero3/ are wings it may use; integrations/, cluster/
and tools/ sit on top of it and the engine never imports them, not even inside a function. And no
module imports itself back through another (a cycle of any length), lazily or not. The parameter stores
(flat_params.py, zero3/) are imported by the optimizer's constructor alone, and no module below the engine's
classes (ShardedOptimizer, ShardedDDP) imports them: checkpoint/ included. The stage is decided in three
modules (the config, the constructor's one choice of store, the flat store's stage 1 vs 2).
"""
import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shardopt")
TOP_WINGS = ("shardopt.integrations", "shardopt.cluster", "shardopt.tools")
PUBLIC = {"shardopt", "shardopt.__main__"}  # the front door may import anything


def _modules() -> dict:
    """Dotted name -> path of every module of the package."""
    out = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(folder, f)
    return out


def _imports(path: str, modules: dict) -> set:
    """shardopt modules that the file at `path` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` imports pkg.mod when that is a module, else a name of pkg
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                      for a in node.names}
    return {m for m in found if m in modules}


@pytest.fixture(scope="module")
def graph():
    modules = _modules()
    return {m: _imports(p, modules) for m, p in modules.items()}


def test_the_graph_is_read(graph):
    # Guards the check itself: a parser that found nothing would pass everything below.
    assert "shardopt.optimizer" in graph["shardopt.ddp"]
    assert "shardopt.checkpoint.source" in graph["shardopt.checkpoint.deepspeed_reader"]
    assert len(graph) > 40


def test_the_engine_imports_no_top_wing(graph):
    engine = [m for m in graph if m.count(".") == 1 and m not in PUBLIC
              and os.path.isfile(os.path.join(ROOT, m.split(".")[1] + ".py"))]
    assert "shardopt.optimizer" in engine and "shardopt.layout" in engine
    bad = sorted(f"{m} imports {i}" for m in engine for i in graph[m] if i.startswith(TOP_WINGS))
    assert not bad, "the engine must not import integrations/, cluster/ or tools/:\n" + "\n".join(bad)


def test_no_import_cycles(graph):
    # The package's own __init__ files re-export names, so an edge into a package counts as an edge into
    # its __init__ only; cycles through shardopt/__init__ (the public API) are not this test's business.
    edges = {m: {i for i in deps if i not in PUBLIC and i != m} for m, deps in graph.items() if m not in PUBLIC}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# Note [One parameter store] (shardopt/param_store.py): the constructor picks the store once; below it, modules
# ask the store and never import a store, and nothing below the engine's classes imports them back.
ENGINE_CLASSES = ("shardopt.optimizer", "shardopt.ddp")
STORES = ("shardopt.flat_params", "shardopt.zero3")
ABOVE_THE_ENGINE = PUBLIC | {"shardopt.ddp"}  # ddp wraps the optimizer; the front door re-exports both


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_only_the_constructor_picks_a_store(graph):
    bad = sorted(f"{m} imports {i}" for m, deps in graph.items() for i in deps
                 if _within(i, STORES) and not _within(m, STORES) and m != "shardopt.optimizer"
                 and not m.startswith(TOP_WINGS) and m not in PUBLIC)
    assert "shardopt.zero3.store" in graph["shardopt.optimizer"] and "shardopt.flat_params" in graph["shardopt.optimizer"]
    assert not bad, "a store is chosen once, in ShardedOptimizer's constructor:\n" + "\n".join(bad)


def test_nothing_below_imports_the_engine_classes(graph):
    # checkpoint/, zero3/, the stores and every module below take the optimizer's view or plain tensors instead.
    bad = sorted(f"{m} imports {i}" for m, deps in graph.items() for i in deps
                 if i in ENGINE_CLASSES and m not in ABOVE_THE_ENGINE and not m.startswith(TOP_WINGS))
    assert "shardopt.checkpoint.save_load" in graph and "shardopt.zero3.hooks" in graph
    assert not bad, "only the front door and the top wings import ShardedOptimizer / ShardedDDP:\n" + "\n".join(bad)


def test_the_stores_import_no_wing_above_them(graph):
    bad = sorted(f"{m} imports {i}" for m in graph if _within(m, STORES) for i in graph[m]
                 if i.startswith(("shardopt.checkpoint",) + TOP_WINGS) or i in ENGINE_CLASSES)
    assert not bad, "\n".join(bad)


# Modules that read the stage number only to translate or describe a configuration (DeepSpeed's JSON and
# checkpoints, the memory estimate), and the top wings, which build optimizers per stage: they choose
# nothing about how parameters are kept.
DESCRIBES_THE_STAGE = ("shardopt.deepspeed_config", "shardopt.estimate", "shardopt.checkpoint.deepspeed_reader",
                       "shardopt.checkpoint.deepspeed_zero3")


def _stage_decisions(path: str) -> int:
    """Comparisons of `stage` and its stand-ins (`param_shard is None`, `min(stage, 2)`, `if stage3`)."""
    def stage(n):
        return (isinstance(n, ast.Name) and n.id in ("stage", "stage3")) or \
            (isinstance(n, ast.Attribute) and n.attr in ("stage", "stage3"))

    count = 0
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            count += any(stage(x) or (isinstance(x, ast.Attribute) and x.attr == "param_shard") for x in sides)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
            count += any(stage(a) for a in node.args)
        elif isinstance(node, (ast.If, ast.IfExp, ast.While)):
            count += stage(node.test)
        elif isinstance(node, ast.BoolOp):
            count += any(stage(v) for v in node.values)
    return count


def test_the_stage_is_decided_in_three_modules():
    modules = _modules()
    deciding = {m for m, path in modules.items() if _stage_decisions(path)
                and not m.startswith(TOP_WINGS) and m not in DESCRIBES_THE_STAGE}
    assert _stage_decisions(modules["shardopt.config"]) > 0  # guards the counter
    assert deciding <= {"shardopt.config", "shardopt.optimizer"}, sorted(deciding)
    assert _stage_decisions(modules["shardopt.optimizer"]) == 1  # the one choice of store


def _private_members(tree: ast.AST) -> set:
    """Private names a module defines on its classes: methods `def _x` and attributes `self._x = ...`."""
    names = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_"):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr.startswith("_"):
                names.add(node.attr)
    return {n for n in names if not (n.startswith("__") and n.endswith("__"))}


def _reaches(tree: ast.AST, names: set) -> list:
    """`x._name` for `_name` in `names`, where x is not the module's own self or cls."""
    return sorted({(node.lineno, node.attr) for node in ast.walk(tree)
                   if isinstance(node, ast.Attribute) and node.attr in names
                   and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))})


def test_the_stage_3_modules_are_used_through_public_members():
    # zero3/hooks.py and every module outside zero3/ call the stage-3 modules' public members only; so does
    # each stage-3 module with another's (a private member is its own module's to change).
    modules = _modules()
    trees = {m: ast.parse(open(p, encoding="utf-8").read()) for m, p in modules.items()}
    stage3 = {m: _private_members(t) for m, t in trees.items() if _within(m, ("shardopt.zero3",))}
    assert "_point" in stage3["shardopt.zero3.buckets"]  # guards the reader
    bad = []
    for m, tree in trees.items():
        others = set().union(*(names for owner, names in stage3.items() if owner != m)) - _private_members(tree)
        bad += [f"{m}:{line} reaches {name}" for line, name in _reaches(tree, others)]
    assert not bad, "private members of stage-3 modules used from outside them:\n" + "\n".join(bad)


def test_no_import_climbs(graph):
    # The wings (parallel/, checkpoint/, weights/, zero3/, integrations/, ...) form layers: a wing may import
    # wings below it and the engine's modules, never a wing that imports it back (weights/ below checkpoint/:
    # the file helpers both use are shardopt/files.py).
    def wing(m):
        parts = m.split(".")
        return parts[1] if len(parts) > 2 or os.path.isdir(os.path.join(ROOT, parts[-1])) and len(parts) == 2 \
            else None
    above: dict = {}
    for m, deps in graph.items():
        for d in deps:
            a, b = wing(m), wing(d)
            if a and b and a != b:
                above.setdefault(a, {}).setdefault(b, []).append(f"{m} imports {d}")
    assert "weights" in above.get("checkpoint", {})  # guards the reader
    climbs = [line for a, below in above.items() for b, lines in below.items() if a in above.get(b, {})
              for line in lines]
    assert not climbs, "wings importing each other:\n" + "\n".join(sorted(climbs))


def test_modules_and_classes_stay_small():
    # One job per module: a module over 700 lines or a class over 40 methods does several.
    big = []
    for m, path in _modules().items():
        text = open(path, encoding="utf-8").read()
        if len(text.splitlines()) > 700:
            big.append(f"{m}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
                if methods > 40:
                    big.append(f"{m}.{node.name}: {methods} methods")
    assert not big, "\n".join(big)


def _prose_lines(text: str) -> tuple[int, int]:
    """(non-blank lines, of those: comment or docstring lines)."""
    doc = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            doc.update(range(node.lineno, node.end_lineno + 1))
    lines = [(i, line.strip()) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    return len(lines), sum(1 for i, line in lines if i in doc or line.startswith("#"))


def test_prose_leaves_room_for_the_code():
    # Comments and docstrings say what is true now and why; history and dated measurements live in commit
    # messages and benchmarks/results/.
    total = prose = 0
    for path in _modules().values():
        n, c = _prose_lines(open(path, encoding="utf-8").read())
        total, prose = total + n, prose + c
    assert total > 5000 and prose > 500  # guards the counter
    assert prose <= 0.20 * total, f"{prose} of {total} non-blank lines of shardopt/ are comments or docstrings"


def test_no_dated_lines_in_the_source():
    import re
    csrc = os.path.join(os.path.dirname(ROOT), "csrc")
    paths = list(_modules().values()) + [os.path.join(d, f) for d, _, fs in os.walk(csrc) for f in fs]
    dated = [f"{os.path.relpath(p, os.path.dirname(ROOT))}:{i}" for p in paths
             for i, line in enumerate(open(p, encoding="utf-8", errors="replace"), 1)
             if re.search(r"\b20\d\d-\d\d-\d\d\b", line)]
    assert not dated, "dated lines (measurements belong in benchmarks/results/):\n" + "\n".join(dated)
