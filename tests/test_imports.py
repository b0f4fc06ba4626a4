"""The house as built. Imports go one way: no cycle among the modules of `rank_runtime/`,
`orchestrator/` or `launch/` (every import counted: those inside functions and those under
TYPE_CHECKING too), and the rooms depend downwards only (launch -> orchestrator; rank_runtime ->
native). Sizes: no function of the Python rooms over 80 lines, no Python module (tests included)
over 500 lines, no native source over 600, no room with more than 12 entries at its top. State: a
module's state is one `_STATE`, an instance of a dataclass of its own, which no other module (nor
a test) names; nothing else at module level holds state. Read from the source with ast, so that
the test sees what a reader sees; the limits are said in docs/internals/architecture.md."""
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


def _imports(module, path, type_checking=False):
    """The modules `module` imports, as dotted names under the project's rooms ('shardrec.' dropped);
    `from package import name` counts the submodule when `name` is one, else the package.
    type_checking: those under `if TYPE_CHECKING:` count too."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = set()
    tree = ast.parse(open(path).read(), path)
    for node in (ast.walk(tree) if type_checking else _runtime_nodes(tree)):
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


def _runtime_nodes(tree):
    """Every node of `tree` but those under `if TYPE_CHECKING:` (names for type checkers, never
    imported when the code runs)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    return [n for n in ast.walk(tree) if id(n) not in skipped]


def _graph(rooms, type_checking=False):
    modules = {}
    for room in rooms:
        modules.update(_modules(room))
    graph = {}
    for module, path in modules.items():
        targets = set()
        for name in _imports(module, path, type_checking):
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


def test_no_import_cycle_in_rank_runtime_type_checking_imports_counted():
    """Names imported for type checkers count, and imports inside functions: process/state.py named
    the types of the rooms above it under TYPE_CHECKING (config, world, table, export, the stream,
    metrics), a 20-module cycle through it that a rule over run-time imports did not see."""
    graph = _graph(["rank_runtime"], type_checking=True)
    # A package's __init__ may name its modules (lazy exports); a module importing its package to
    # reach a sibling is what would close a cycle, and counts.
    for package in [m for m in graph if os.path.basename(_modules("rank_runtime")[m]) == "__init__.py"]:
        graph[package] = {t for t in graph[package] if not t.startswith(package + ".")}
    assert _cycles(graph) == []


def test_no_import_cycle_in_the_supervisor_and_the_commands_type_checking_imports_counted():
    """Names imported for type checkers only count: attempt.py named supervisor.py's JobSpec under
    TYPE_CHECKING while supervisor.py imported attempt.py, a cycle the runtime-only rule missed
    (JobSpec now has a module of its own)."""
    assert _cycles(_graph(["orchestrator", "launch"], type_checking=True)) == []


# The supervisor reads what ranks write, in the formats the ranks define (modules that import
# neither TensorFlow nor MPI); it never imports the runtime itself.
FORMATS = {"rank_runtime", *(m for m in _modules("rank_runtime") if m.split(".")[:2] == ["rank_runtime", "formats"])}


@pytest.mark.parametrize("room,forbidden", [("rank_runtime", ("orchestrator", "launch")),
                                            ("orchestrator", ("launch", "rank_runtime", "native")),
                                            ("native", ("rank_runtime", "orchestrator", "launch"))])
def test_rooms_import_downwards_only(room, forbidden):
    graph = _graph(ROOMS)
    wrong = sorted((m, t) for m, targets in graph.items() if m.split(".")[0] == room
                   for t in targets if t.split(".")[0] in forbidden and not (room == "orchestrator" and t in FORMATS))
    assert wrong == []


def test_the_formats_the_supervisor_reads_import_nothing_of_the_runtime():
    """They import the logs at most, which import nothing of shardrec."""
    graph = _graph(["rank_runtime"], type_checking=True)
    light = FORMATS | {"rank_runtime.process", "rank_runtime.process.logs"}
    for module in light - {"rank_runtime"}:
        assert graph[module] - {"rank_runtime"} <= light, (module, graph[module])
    assert graph["rank_runtime.process.logs"] == set()


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


PY_MODULE_LINES, NATIVE_FILE_LINES, ROOM_TOP_ENTRIES = 500, 600, 12
NATIVE_SOURCES = (".h", ".cc", ".cpp")


def _python_files(room):
    return sorted(_modules(room).values())


def _native_files():
    return sorted(os.path.join(folder, name) for folder, _, files in os.walk(os.path.join(ROOT, "native", "src"))
                  for name in files if name.endswith(NATIVE_SOURCES))


def _lines(path):
    with open(path) as f:
        return sum(1 for _ in f)


def _over(paths, limit):
    return [f"{os.path.relpath(p, ROOT)}: {_lines(p)} lines" for p in paths if _lines(p) > limit]


def test_no_module_of_the_python_rooms_or_the_tests_is_over_500_lines_and_no_native_source_over_600():
    tests = sorted(os.path.join(folder, name) for folder, _, files in os.walk(os.path.join(ROOT, "tests"))
                   for name in files if name.endswith(".py"))
    assert _over([p for room in ROOMS[:3] for p in _python_files(room)] + tests, PY_MODULE_LINES) == []
    assert _over(_native_files(), NATIVE_FILE_LINES) == []


def _room_tops():
    """Every package folder of the rooms and native/src with its sub-folders: {folder: its entries
    (modules and sub-rooms; __init__.py, caches and built libraries not counted)}."""
    tops = {}
    for base in (*ROOMS[:3], os.path.join("native", "src")):
        for folder, dirs, files in os.walk(os.path.join(ROOT, base)):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
            entries = [f for f in files if f.endswith((".py",) + NATIVE_SOURCES) and f != "__init__.py"] + dirs
            tops[os.path.relpath(folder, ROOT)] = sorted(entries)
    return tops


def test_no_room_holds_more_than_12_entries_at_its_top():
    crowded = {folder: len(entries) for folder, entries in _room_tops().items() if len(entries) > ROOM_TOP_ENTRIES}
    assert crowded == {}


MUTATORS = {"append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "remove", "discard",
            "clear"}
MUTABLE_FACTORIES = {"list", "dict", "set", "defaultdict", "OrderedDict", "Counter", "deque"}
STATE_NAME = "_STATE"
LOOSE_TYPES = {"Any", "object", "dict", "list", "set", "tuple"}


def _is_mutable(value):
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        return (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) in MUTABLE_FACTORIES
    return False


def _dataclasses(tree):
    """{name: ClassDef} of the module's own dataclasses."""
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)
            and any("dataclass" in ast.unparse(d) for d in node.decorator_list)}


def module_state(source):
    """What in `source` (a module's text) is module-level state other than its `_STATE`: a name
    rebound by `global`, a module-level container whose name is not a CONSTANT's, a CONSTANT container
    that the module changes (an item set or deleted, or a mutating method called on it), an instance
    of the module's own dataclass under another name; and a `_STATE` that is not one such instance,
    or whose dataclass leaves a field's type loose (Any, object, a bare dict, list, set or tuple)."""
    tree = ast.parse(source)
    found = []
    containers = {}
    own = _dataclasses(tree)
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        value = getattr(node, "value", None)
        for t in targets:
            if not isinstance(t, ast.Name) or value is None:
                continue
            made = value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else None
            if t.id == STATE_NAME:
                if made not in own:
                    found.append(f"line {node.lineno}: {STATE_NAME} is not an instance of a dataclass of this module")
                else:
                    found += [f"line {f.lineno}: {made}.{f.target.id} is typed {ast.unparse(f.annotation)}"
                              for f in own[made].body if isinstance(f, ast.AnnAssign)
                              and ast.unparse(f.annotation).strip("'\"") in LOOSE_TYPES]
            elif made in own:
                found.append(f"line {node.lineno}: {t.id} holds an instance of {made} (a module's state is {STATE_NAME})")
            elif _is_mutable(value) and not (t.id.startswith("__") and t.id.endswith("__")):
                containers[t.id] = node.lineno
    for name, line in containers.items():
        if not name.lstrip("_").isupper():
            found.append(f"line {line}: {name} holds a container")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"line {node.lineno}: global {', '.join(node.names)}")
        changed = None
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            for t in getattr(node, "targets", None) or [node.target]:
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):
                    changed = t.value.id
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS \
                and isinstance(node.func.value, ast.Name):
            changed = node.func.value.id
        if changed in containers and changed.lstrip("_").isupper():
            found.append(f"line {node.lineno}: {changed} is changed")
    return found


def others_state(source):
    """Where `source` names another module's state: `_STATE` imported, or read as an attribute."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and any(a.name == STATE_NAME for a in node.names):
            found.append(f"line {node.lineno}: imports {'.' * node.level}{node.module or ''}.{STATE_NAME}")
        elif isinstance(node, ast.Attribute) and node.attr == STATE_NAME:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_state_finder_finds_state():
    assert module_state("x = []\n") == ["line 1: x holds a container"]
    assert module_state("_x = None\ndef f():\n    global _x\n    _x = 1\n") == ["line 3: global _x"]
    assert module_state("T = {}\ndef f(k):\n    T[k] = 1\n") == ["line 3: T is changed"]
    assert module_state("T = {}\ndef f(k):\n    T.setdefault(k, 1)\n") == ["line 3: T is changed"]
    assert module_state("T = {'a': 1}\n__all__ = ['f']\ndef f(k):\n    d = {}\n    d[k] = T[k]\n") == []
    held = "@dataclass\nclass S:\n    n: int = 0\n"
    assert module_state(held + "_STATE = S()\n") == []
    assert module_state(held + "_beats = S()\n") == ["line 4: _beats holds an instance of S (a module's state is _STATE)"]
    assert module_state("_STATE = {}\n") == ["line 1: _STATE is not an instance of a dataclass of this module"]
    assert module_state("@dataclass\nclass S:\n    d: dict = None\n_STATE = S()\n") == ["line 3: S.d is typed dict"]
    assert others_state("from .heartbeat import _STATE\nx = metrics._STATE.samples\n") == \
        ["line 1: imports .heartbeat._STATE", "line 2: metrics._STATE"]


def test_each_module_owns_its_state_and_no_other_module_names_it():
    """One owner for each piece of state: the module that makes it. Others, tests too, ask its
    functions."""
    found = {}
    for room in ROOMS[:3]:
        for module, path in _modules(room).items():
            source = open(path).read()
            found.update({f"{module}: {what}": None for what in module_state(source) + others_state(source)})
    for name in sorted(os.listdir(os.path.join(ROOT, "tests"))):
        if name.endswith(".py") and name != os.path.basename(__file__):
            found.update({f"tests/{name}: {what}": None
                          for what in others_state(open(os.path.join(ROOT, "tests", name)).read())})
    assert list(found) == []
