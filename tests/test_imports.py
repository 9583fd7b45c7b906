"""The package's import graph, read with `ast` (no import runs): the engine stands without its wings.

shardopt/*.py is the engine; parallel/ and checkpoint/ are wings it may use; integrations/, cluster/
and tools/ sit on top of it and the engine never imports them, not even inside a function. And no
module imports itself back through another (a cycle of any length), lazily or not.
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
