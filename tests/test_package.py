"""The package's shape (docs/architecture.md): no import cycles, public surfaces that resolve, torch-free modules
that stay torch-free, and a top level that holds only the entry points and what every package shares."""

import ast
import importlib
import subprocess
import sys

import pytest

from tests.helpers.launch import ROOT

TOP_LEVEL = {"__init__", "__main__", "train", "loop", "objective", "errors", "agree", "paths", "world", "stateful"}
"""The entry point, the training step's own pieces (the loop, the objective) and what every package
shares (errors, the agreement on them, file names, who is where, the state protocol)."""
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


def import_graph(modules: dict[str, tuple[ast.Module, bool]] | None = None) -> dict[str, set[str]]:
    """Module -> the hpcnet modules it imports anywhere in its text (functions and TYPE_CHECKING blocks too: a
    deferred import is still a cycle of meaning). ``from package import module`` is an import of the module;
    ``from package import name`` of the package's ``__init__``, its own package's too: a module that takes a name
    from the package that imports it is a cycle, deferred or not. ``modules``: name -> (parsed text, whether it is
    a package's ``__init__``); hpcnet's by default."""
    modules = _modules() if modules is None else modules

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
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target) if target.startswith("hpcnet") else None
                if found and found != name:
                    deps.add(found)
        graph[name] = deps
    return graph


def package_of(module: str) -> str:
    """The package a module belongs to: ``hpcnet.<name>``, a subpackage or a top-level module; ``hpcnet`` itself."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` (module -> modules) as package -> the other packages its modules import."""
    packages: dict[str, set[str]] = {}
    for module, deps in graph.items():
        mine = package_of(module)
        packages.setdefault(mine, set()).update(package_of(d) for d in deps if package_of(d) != mine)
    for deps in list(packages.values()):
        for dep in deps:
            packages.setdefault(dep, set())
    return packages


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


def test_no_package_imports_its_importer():
    """Between packages (``hpcnet.comm``, ``hpcnet.ckpt``, ``hpcnet.fault``, a top-level module ...) the imports go
    one way: the layers of docs/architecture.md."""
    assert cycles(package_graph(import_graph())) == []


def test_a_cycle_between_packages_is_found_where_the_modules_have_none():
    modules = {"hpcnet.a.x": {"hpcnet.b.y"}, "hpcnet.b.y": set(), "hpcnet.b.z": {"hpcnet.a.w"}, "hpcnet.a.w": set(),
               "hpcnet.c": {"hpcnet.a.x"}}
    assert cycles(modules) == []
    assert cycles(package_graph(modules)) == [["hpcnet.a", "hpcnet.b"]]
    longer = {"hpcnet.a.x": {"hpcnet.b.y"}, "hpcnet.b.y": {"hpcnet.c"}, "hpcnet.c": {"hpcnet.a.w"}, "hpcnet.a.w": set()}
    assert cycles(package_graph(longer)) == [["hpcnet.a", "hpcnet.b", "hpcnet.c"]]


def test_a_name_taken_from_the_package_that_imports_the_module_is_a_cycle():
    """A deferred ``from hpcnet.p import Name`` in ``hpcnet.p.m``, whose package imports it, is a module cycle;
    ``from hpcnet.p import m`` alone is not."""
    def parse(text, package=False):
        return ast.parse(text), package

    dodged = {"hpcnet.p": parse("from hpcnet.p.m import Memory", True),
              "hpcnet.p.m": parse("def measure():\n    from hpcnet.p import Plan\n"),
              "hpcnet.p.n": parse(""), "hpcnet.q": parse("from hpcnet.p import m")}
    assert cycles(import_graph(dodged)) == [["hpcnet.p", "hpcnet.p.m"]]
    assert import_graph(dodged)["hpcnet.q"] == {"hpcnet.p.m"}
    dodged["hpcnet.p.m"] = parse("def measure():\n    from hpcnet.p import n\n")
    assert cycles(import_graph(dodged)) == []


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


def _logic(tree: ast.Module) -> list[str]:
    """What an ``__init__`` holds besides its public surface: every statement but the docstrings, the imports and
    the surface's assignment (``__all__, __getattr__, __dir__ = _lazy_exports(...)``, or ``__all__ = [...]``)."""
    found = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign)
                   else [])
        names = {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
        if targets and names <= {"__all__", "__getattr__", "__dir__"}:
            continue
        found.append(f"line {node.lineno}: {type(node).__name__} {getattr(node, 'name', '')}".rstrip())
    return found


@pytest.mark.parametrize("package", sorted(str(p.parent.relative_to(ROOT))
                                            for p in (ROOT / "hpcnet").glob("*/**/__init__.py")))
def test_a_subpackage_s_init_holds_its_public_surface_only(package):
    """Logic lives in modules named for what it is; an ``__init__`` names the package's public surface (the root
    ``hpcnet/__init__.py`` holds what must run before anything else is imported: a standby's release signal)."""
    assert _logic(ast.parse((ROOT / package / "__init__.py").read_text())) == []


def test_logic_in_an_init_is_found():
    assert _logic(ast.parse('"""Doc."""\nimport x\n__all__: list[str] = ["f"]\n')) == []
    assert _logic(ast.parse("from x import y\nMODELS = {}\ndef build():\n    pass\n")) == [
        "line 2: Assign", "line 3: FunctionDef build"]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_torch_free_modules_import_no_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", f"{module} imports torch"
