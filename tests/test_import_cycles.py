"""No import cycle between torch_shift's modules, counting every import statement (those inside functions too:
a lazy import that closes a cycle only hides it)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "torch_shift"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The torch_shift modules `path` imports (a package's __init__ when the name is not a submodule)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                     for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for other in sorted(graph[node]):
            if state.get(other) == 1:
                return path[path.index(other):] + [other]
            if other not in state:
                cycle = visit(other)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycle():
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imports(p, modules) - {module_name(p)} for p in paths}
    # a package importing its own modules (its __init__ re-exporting them) is the package's content, not a cycle
    for name in list(graph):
        graph[name] = {other for other in graph[name] if not (other.startswith(name + ".") and
                                                              name in {module_name(p) for p in paths
                                                                       if p.name == "__init__.py"})}
    assert len(graph) > 50
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_importing_torch_shift_leaves_dtensor_and_sympy_for_later():
    """`import torch_shift` (and so `torch-shift --help`) does not import DTensor, which brings sympy: 1.5 s of a
    4 s import here; the plans and the sources that need it import it when they run."""
    import subprocess
    import sys

    code = ("import sys, torch_shift\n"
            "loaded = [m for m in ('torch.distributed.tensor', 'sympy') if m in sys.modules]\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True)
