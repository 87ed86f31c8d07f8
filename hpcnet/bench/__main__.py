"""``python -m hpcnet.bench <name> [args]`` runs ``hpcnet.bench.<name>.main(args)``."""

import ast
import importlib
import pkgutil
import sys
from pathlib import Path

# helper modules of the package (stepsplit: bench train's instrumented block; recovery_cluster: recovery --cluster)
_NOT_BENCHMARKS = {"common", "stepsplit", "recovery_cluster"}


def benchmarks() -> dict[str, str]:
    """Benchmark name -> first line of its module docstring (read from the source: nothing is imported)."""
    package = Path(__file__).parent
    found = {}
    for info in pkgutil.iter_modules([str(package)]):
        if info.name.startswith("_") or info.name in _NOT_BENCHMARKS:
            continue
        try:
            doc = ast.get_docstring(ast.parse((package / f"{info.name}.py").read_text())) or ""
        except (OSError, SyntaxError):
            doc = ""
        found[info.name] = doc.strip().splitlines()[0] if doc.strip() else ""
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
