"""``python -m hpcnet.bench <name> [args]`` runs ``hpcnet.bench.<name>.main(args)``."""

import ast
import importlib
import pkgutil
import sys
from pathlib import Path


def benchmarks() -> dict[str, str]:
    """Benchmark name -> first line of its module docstring (read from the source: nothing is imported).

    A benchmark is a module of the package with a ``main``; the others are its parts (``common``, ``stepsplit``,
    ``memory_capacity``, ...).
    """
    package = Path(__file__).parent
    found = {}
    for info in pkgutil.iter_modules([str(package)]):
        if info.name.startswith("_"):
            continue
        try:
            tree = ast.parse((package / f"{info.name}.py").read_text())
        except (OSError, SyntaxError):
            continue
        if not any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            continue
        doc = (ast.get_docstring(tree) or "").strip()
        found[info.name] = doc.splitlines()[0] if doc else ""
    return found


def usage() -> str:
    lines = ["usage: python -m hpcnet.bench <name> [options]   (under mpirun: mpirun -np 2 python -m mpi4py -m "
             "hpcnet.bench <name> ...)", "", "benchmarks:"]
    lines += [f"  {name:12s} {doc}" for name, doc in sorted(benchmarks().items())]
    lines.append("\n`python -m hpcnet.bench <name> --help` lists a benchmark's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0].startswith("-"):
        print(usage(), file=sys.stderr)
        return 2
    known = benchmarks()
    if argv[0] not in known:
        print(f"no benchmark named {argv[0]!r}; choose one of: {', '.join(sorted(known))}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"hpcnet.bench.{argv[0]}")
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
