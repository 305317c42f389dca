"""The package's import graph, read from the source (`ast`): no circles, and the layering rules of
docs/ARCHITECTURE.md. Imports anywhere in a module count (inside functions too: a lazy import does not
hide a circle), except those under `if TYPE_CHECKING:`, which exist for annotations only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Where each sub-package's source lives (kernels/, models/ and tui/ install under localserve).
SOURCES = {"localserve": ROOT / "localserve", "localserve.kernels": ROOT / "kernels",
           "localserve.models": ROOT / "models", "localserve.tui": ROOT / "tui"}
TORCH_FREE = ("localserve.engine.scheduler", "localserve.engine.step", "localserve.kv.block_manager")


def module_files() -> dict[str, Path]:
    modules = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if package == "localserve" and parts[0] in ("kernels", "models", "tui"):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def imports_of(path: Path, module: str, is_package: bool) -> set[str]:
    """Every module or package `module` imports, at any depth of its code."""
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    type_only = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
                 for statement in node.body for inner in ast.walk(statement)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = module_files()
    edges = {}
    for module, path in modules.items():
        imported = imports_of(path, module, path.name == "__init__.py")
        edges[module] = {name for name in imported if name in modules and name != module}
        edges[module] |= {name.split(".")[0] for name in imported if name.split(".")[0] in ("torch", "triton")}
    return edges


def test_no_import_circles(graph):
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if target in graph and not state.get(target):
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if not state.get(module):
            visit(module, [module])


def forbidden_imports(graph, source_prefix: str, target_prefixes: tuple[str, ...]) -> list[str]:
    return [f"{module} imports {target}" for module, targets in graph.items()
            if module == source_prefix or module.startswith(source_prefix + ".")
            for target in targets if any(target == t or target.startswith(t + ".") for t in target_prefixes)]


@pytest.mark.parametrize("source,forbidden", [
    ("localserve.kv", ("localserve.engine", "localserve.server")),
    ("localserve.engine", ("localserve.server", "localserve.tui")),
    ("localserve.attention", ("localserve.engine", "localserve.server", "localserve.tui")),
    ("localserve.models", ("localserve.engine", "localserve.server", "localserve.tui")),
])
def test_layering(graph, source, forbidden):
    assert forbidden_imports(graph, source, forbidden) == []


def test_kernels_import_only_torch_triton_and_the_standard_library():
    allowed = {"torch", "triton"} | set(sys.stdlib_module_names)
    for path in SOURCES["localserve.kernels"].rglob("*.py"):
        for name in imports_of(path, "localserve.kernels", True):
            top = name.split(".")[0]
            assert top in allowed or name.startswith("localserve.kernels"), f"{path.name} imports {name}"


@pytest.mark.parametrize("module", TORCH_FREE)
def test_bookkeeping_modules_import_no_torch(graph, module):
    reachable, todo = set(), [module]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in reachable:
                reachable.add(target)
                todo.append(target)
    assert "torch" not in reachable, f"{module} reaches torch"
    # And at run time: importing it leaves torch out of the process.
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_cli_imports_no_torch_for_the_chat_client():
    code = ("import sys; from localserve.cli import build_parser; build_parser(); "
            "import localserve.server.chat_client; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
