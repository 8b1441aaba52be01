"""The package's shape, checked by reading its source (AST; nothing is imported):

- no import cycle between the workbench's modules, counting imports made inside functions;
- no import cycle between the folders of `workbench/_src` (its layers), counting every import;
- no module over MAX_MODULE_LINES lines, and the process layer (`launch/`) within its budget;
- no module but the backend registry compares a backend's name;
- no private TensorFlow, Keras, CPython or pytest name outside `workbench/_src/compat.py`;
- `import workbench` loads no numpy, TensorFlow or pandas (this one runs a fresh interpreter).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "workbench"
REGISTRY = PACKAGE / "_src" / "core" / "registry.py"
COMPAT = PACKAGE / "_src" / "compat.py"
BACKEND_NAMES = {"single", "mirrored", "multi-worker", "async-ps", "tpu"}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(encoding="utf-8"), str(path)) for name, path in MODULES.items()}


def _imported(name: str, tree: ast.AST) -> set[str]:
    """The workbench modules `name` imports, wherever the import statement stands."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, result = {}, {}, [], set(), []

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
                result.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return result


def test_no_import_cycle_counting_imports_inside_functions():
    # `workbench/__init__.py` re-exports the public names: it imports, nobody imports it back.
    graph = {name: _imported(name, tree) - {"workbench"} for name, tree in TREES.items()}
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


SRC = "workbench._src"


def _imported_anywhere(name: str, tree: ast.AST) -> set[str]:
    """Every module path `name` imports, absolute or relative, at module level or in a function
    (`from a import b` counts as a.b too: b may be a module)."""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _layer(module: str) -> str | None:
    """The folder of `workbench/_src` a module belongs to (a top-level module is its own)."""
    if not module.startswith(SRC + "."):
        return None
    return module[len(SRC) + 1 :].split(".")[0]


def _layer_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    graph: dict[str, set[str]] = {}
    why: dict[tuple[str, str], list[str]] = {}
    for name, tree in TREES.items():
        mine = _layer(name)
        if mine is None:
            continue
        graph.setdefault(mine, set())
        for target in _imported_anywhere(name, tree):
            theirs = _layer(target)
            if theirs is not None and theirs != mine:
                graph[mine].add(theirs)
                graph.setdefault(theirs, set())
                why.setdefault((mine, theirs), []).append(f"{name} imports {target}")
    return graph, why


def test_no_import_cycle_between_the_folders_of_src():
    # The layers, bottom up: compat; core; plots; sinks; store; launch; placements; backends;
    # numerics, studies; options; notebook; scripts. Every import counts, also one inside a
    # function: a cycle there is a tangle all the same, only found later.
    graph, why = _layer_graph()
    cycles = _cycles(graph)
    edges = {
        f"{a} -> {b}": why[(a, b)][:3] for cycle in cycles for a in cycle for b in graph[a] if b in cycle
    }
    assert cycles == [], f"folders in an import cycle: {cycles}; their imports: {edges}"


def test_the_layer_check_counts_relative_imports_and_imports_in_functions():
    tree = ast.parse("def f():\n    from ..core import errors\n    import workbench._src.sinks.runstore\n")
    found = _imported_anywhere("workbench._src.launch.pool", tree)
    assert {"workbench._src.core.errors", "workbench._src.sinks.runstore"} <= found
    assert {_layer(t) for t in found} >= {"core", "sinks"}


def _placement_uses(name: str, tree: ast.AST) -> list[str]:
    """What of `workbench._src.placements` module `name` reaches: any import of it (absolute or
    relative, at module level or in a function) and any string naming one of its modules (an
    importlib path)."""
    placements = f"{SRC}.placements"
    uses = sorted(t for t in _imported_anywhere(name, tree) if t == placements or t.startswith(placements + "."))
    uses += [
        repr(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(placements)
    ]
    return uses


def test_no_backend_imports_a_placement():
    # Backends declare roles and one TF_CONFIG builder (launch/placement.py MemberPlan); which
    # placement places them is chosen in launch/ from what `cluster=` names.
    found = {
        str(MODULES[name].relative_to(PACKAGE.parent)): uses
        for name, tree in TREES.items()
        if _layer(name) == "backends" and (uses := _placement_uses(name, tree))
    }
    assert found == {}, "a backend declares roles (launch/placement.py Role), never a placement"


@pytest.mark.parametrize(
    "source",
    [
        "from workbench._src.placements.ray.cluster import RayCluster",
        "def f():\n    from ..placements.local import processes",
        "import workbench._src.placements.local.servers",
        "importlib.import_module('workbench._src.placements.local.servers')",
    ],
)
def test_the_placement_check_finds_each_kind(source):
    assert _placement_uses("workbench._src.backends.remote", ast.parse(source))


MAX_MODULE_LINES = 450  # a module past ~400 lines is a smell (STYLE.md): split it by concept
MAX_LAUNCH_LINES = 3000  # the process layer above the placements (launch/), all of it


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_module_over_the_limit():
    long = {
        str(p.relative_to(PACKAGE.parent)): n for p in MODULES.values() if (n := _lines(p)) > MAX_MODULE_LINES
    }
    assert long == {}, f"split these by concept (at most {MAX_MODULE_LINES} lines a module)"


def test_the_process_layer_within_its_budget():
    total = sum(_lines(p) for p in (PACKAGE / "_src" / "launch").rglob("*.py"))
    assert total <= MAX_LAUNCH_LINES


def test_import_workbench_loads_no_numpy_tensorflow_or_pandas():
    code = (
        "import sys, workbench; heavy = [m for m in ('numpy', 'tensorflow', 'pandas') if m in sys.modules]; "
        "print(heavy, '|', sorted(m for m in sys.modules if m.startswith('workbench')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    heavy, modules = out.stdout.strip().split(" | ")
    assert heavy == "[]", out.stdout
    # The package, and the hook that keeps a later `import tensorflow` quiet (core/tf_setup.py
    # with the errors it raises): nothing a public name needs is loaded before it is used.
    expected = ["workbench", "workbench._src", "workbench._src.core", "workbench._src.core.errors",
                "workbench._src.core.tf_setup"]  # fmt: skip
    assert modules == str(expected), f"`import workbench` loaded {modules}: load public names lazily"


def _backend_name_comparisons(tree: ast.AST) -> list[int]:
    def names_a_backend(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in BACKEND_NAMES
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names_a_backend(e) for e in node.elts)
        return False

    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare) and any(names_a_backend(n) for n in [node.left, *node.comparators])
    ]


def test_only_the_registry_compares_backend_names():
    found = {
        str(MODULES[name].relative_to(PACKAGE.parent)): lines
        for name, tree in TREES.items()
        if MODULES[name] != REGISTRY and (lines := _backend_name_comparisons(tree))
    }
    assert found == {}, "use the backend's spec (core/registry.py) instead of its name"


def test_the_name_check_finds_a_comparison():
    assert _backend_name_comparisons(ast.parse("if repl.backend in ('multi-worker', 'x'): pass")) == [1]
    assert _backend_name_comparisons(ast.parse("if spec.in_processes: pass")) == []


def _defined_private_names() -> set[str]:
    """Every `_name` the workbench defines itself (functions, classes, attributes, variables)."""
    names = set()
    for tree in TREES.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[-1])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)  # self.__dict__["_x"] = ..., setattr(obj, "_x", ...)
    return {n for n in names if n.startswith("_")}


# Underscored by design, documented as public: os._exit, namedtuple's _fields/_asdict/_replace.
PUBLIC_UNDERSCORED = {"_exit", "_fields", "_asdict", "_replace", "_make"}
OURS = _defined_private_names() | PUBLIC_UNDERSCORED


# TensorFlow's and Keras's private trees (their public API is `tensorflow` / `keras` and the
# names under them), and pytest's internals.
PRIVATE_MODULES = ("tensorflow.python", "tensorflow.core", "keras.src", "_pytest")


def _private_uses(tree: ast.AST) -> list[str]:
    """Private names of other projects: an attribute `_x` the workbench never defines, the
    `tensorflow.python`, `tensorflow.core` and `keras.src` trees, pytest's `_pytest`, CPython's
    `pythonapi` and `_exitfunc`."""
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            if (private and node.attr not in OURS) or node.attr == "pythonapi":
                uses.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            uses += [f"{node.lineno}: import {m}" for m in modules if m.startswith(PRIVATE_MODULES)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith(PRIVATE_MODULES):
                uses.append(f"{node.lineno}: {node.value!r}")
    return uses


def test_private_names_of_other_projects_only_in_compat():
    found = {
        str(MODULES[name].relative_to(PACKAGE.parent)): uses
        for name, tree in TREES.items()
        if MODULES[name] != COMPAT and (uses := _private_uses(tree))
    }
    assert found == {}, "move each into workbench/_src/compat.py, with the version and the reason"


@pytest.mark.parametrize(
    "source",
    [
        "opt._clip_gradients(g)",
        "import tensorflow.python.data",
        "from tensorflow.core.util import event_pb2",
        "from keras.src import backend",
        "from _pytest.doctest import DoctestModule",
        "ctypes.pythonapi.Py_IncRef(x)",
        "sys.modules.get('tensorflow.python.data.ops.iterator_ops')",
    ],
)
def test_the_private_check_finds_each_kind(source):
    assert _private_uses(ast.parse(source))


def test_the_test_modules_do_not_import_each_other():
    tests = Path(__file__).resolve().parent
    test_modules = {p.stem for p in tests.glob("test_*.py")}
    importing = {}
    for path in tests.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module in test_modules:
                importing.setdefault(path.name, []).append(node.module)
            elif isinstance(node, ast.Import):
                importing.setdefault(path.name, []).extend(
                    a.name for a in node.names if a.name in test_modules
                )
    assert {k: v for k, v in importing.items() if v} == {}, "shared helpers go in tests/helpers.py"
