"""``python -m hpcnet.bench <name> [args]`` runs ``hpcnet.bench.<name>.main(args)``."""

import importlib
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print("usage: python -m hpcnet.bench <name> [options]   (e.g. checkpoint)", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(f"hpcnet.bench.{argv[0]}")
    except ModuleNotFoundError:
        print(f"no benchmark named {argv[0]!r}", file=sys.stderr)
        return 2
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
