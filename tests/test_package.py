"""The package's shape (docs/architecture.md): no import cycles, public surfaces that resolve, torch-free modules
that stay torch-free, and a top level that holds only the entry points and what every package shares."""

import ast
import importlib
import subprocess
import sys

import pytest

from tests.helpers.launch import ROOT

TOP_LEVEL = {"__init__", "__main__", "train", "loop", "optim", "objective", "errors", "agree", "paths", "world"}
"""The entry point, the training step's own pieces (the loop, the optimizer, the objective) and what every package
shares (errors, the agreement on them, file names, who is where)."""
TORCH_FREE = ["hpcnet.launch.cli", "hpcnet.launch.stop", "hpcnet.ckpt.fence", "hpcnet.paths", "hpcnet.agree",
              "hpcnet.errors", "hpcnet.report.build", "hpcnet.config"]
"""Imported by the supervisor, before torch in a rank, or by the report where torch may be absent."""


def _modules() -> dict[str, tuple[ast.Module, bool]]:
    modules = {}
    for path in sorted((ROOT / "hpcnet").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if package else parts)] = (ast.parse(path.read_text()), package)
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module -> the hpcnet modules it imports anywhere in its text (functions and TYPE_CHECKING blocks too: a
    deferred import is still a cycle of meaning). A module's own parent packages are not counted: Python
    initialises them first, by construction."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, (tree, package) in modules.items():
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name if package else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target) if target.startswith("hpcnet") else None
                if found and found != name and not name.startswith(found + "."):
                    deps.add(found)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_top_level_holds_the_entry_points_and_what_every_package_shares():
    top = {path.stem for path in (ROOT / "hpcnet").glob("*.py")}
    assert top == TOP_LEVEL, f"unexpected top-level modules: {sorted(top ^ TOP_LEVEL)}"


@pytest.mark.parametrize("package", sorted(p.parent.name for p in (ROOT / "hpcnet").glob("*/__init__.py")))
def test_each_subpackage_names_its_public_surface(package):
    module = importlib.import_module(f"hpcnet.{package}")
    assert module.__doc__, f"hpcnet.{package} has no docstring"
    for name in getattr(module, "__all__", []):
        assert getattr(module, name) is not None, f"hpcnet.{package}.{name}"
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018 - the lazy __getattr__ refuses what it does not export


@pytest.mark.parametrize("module", TORCH_FREE)
def test_torch_free_modules_import_no_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", f"{module} imports torch"
