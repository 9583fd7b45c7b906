"""The package's import graph, read with `ast` (no import runs): the engine stands without its wings.

shardopt/*.py is the engine; parallel/, checkpoint/ and zero3/ are wings it may use; integrations/, cluster/
and tools/ sit on top of it and the engine never imports them, not even inside a function. And no
module imports itself back through another (a cycle of any length), lazily or not. The parameter stores
(flat_params.py, zero3/) are imported by the optimizer's constructor alone, and no room below the engine's
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


# Note [One parameter store] (shardopt/param_store.py): the constructor picks the store once; below it, rooms
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


def test_no_room_imports_the_engine_classes(graph):
    # checkpoint/, zero3/, the stores and every room below take the optimizer's view or plain tensors instead.
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
    assert deciding <= {"shardopt.config", "shardopt.optimizer", "shardopt.flat_params"}, sorted(deciding)
    assert _stage_decisions(modules["shardopt.optimizer"]) == 1  # the one choice of store
