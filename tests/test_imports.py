"""Imports go one way: no cycle among the modules of `rank_runtime/` (every import counted, those
inside functions too), and the rooms depend downwards only (launch -> orchestrator; rank_runtime ->
native); and no function of the Python rooms over 80 lines. Read from the source with ast, so that
the test sees what a reader sees."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOMS = ("rank_runtime", "orchestrator", "launch", "native")


def _modules(room):
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, room)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[dotted[: -len(".__init__")] if dotted.endswith(".__init__") else dotted] = path
    return found


def _imports(module, path):
    """The modules `module` imports, as dotted names under the project's rooms ('shardrec.' dropped);
    `from package import name` counts the submodule when `name` is one, else the package."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            out.update(f"{base}.{alias.name}" for alias in node.names)
            out.add(base)
    return {name.removeprefix("shardrec.") for name in out}


def _graph(rooms):
    modules = {}
    for room in rooms:
        modules.update(_modules(room))
    graph = {}
    for module, path in modules.items():
        targets = set()
        for name in _imports(module, path):
            # `from . import config` names rank_runtime.config; `from .x import f` names rank_runtime.x.f.
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_rank_runtime():
    graph = _graph(["rank_runtime"])
    # A package's __init__ may name its modules (lazy exports); a module importing its package to
    # reach a sibling is what would close a cycle, and counts.
    for package in [m for m in graph if os.path.basename(_modules("rank_runtime")[m]) == "__init__.py"]:
        graph[package] = {t for t in graph[package] if not t.startswith(package + ".")}
    assert _cycles(graph) == []


# The supervisor reads what ranks write, in the formats the ranks define (modules that import
# neither TensorFlow nor MPI); it never imports the runtime itself.
FORMATS = {"rank_runtime", "rank_runtime.formats", "rank_runtime.formats.sparse_checkpoint",
           "rank_runtime.formats.checkpoint_chain", "rank_runtime.formats.heartbeat_format"}


@pytest.mark.parametrize("room,forbidden", [("rank_runtime", ("orchestrator", "launch")),
                                            ("orchestrator", ("launch", "rank_runtime", "native")),
                                            ("native", ("rank_runtime", "orchestrator", "launch"))])
def test_rooms_import_downwards_only(room, forbidden):
    graph = _graph(ROOMS)
    wrong = sorted((m, t) for m, targets in graph.items() if m.split(".")[0] == room
                   for t in targets if t.split(".")[0] in forbidden and not (room == "orchestrator" and t in FORMATS))
    assert wrong == []


def test_the_formats_the_supervisor_reads_import_nothing_of_the_runtime():
    """They import the logs and the process state at most, which import nothing of shardrec."""
    graph = _graph(["rank_runtime"])
    light = FORMATS | {"rank_runtime.process", "rank_runtime.process.logs", "rank_runtime.process.state"}
    for module in light - {"rank_runtime"}:
        assert graph[module] - {"rank_runtime"} <= light, (module, graph[module])
    assert graph["rank_runtime.process.state"] == set()


def test_no_function_of_the_python_rooms_is_over_80_lines():
    long = []
    for room in ("rank_runtime", "orchestrator", "launch"):
        for module, path in _modules(room).items():
            for node in ast.walk(ast.parse(open(path).read(), path)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > 80:
                        long.append(f"{module}.{node.name}: {lines} lines")
    assert long == []
