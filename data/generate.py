"""Write a synthetic hpcnet dataset file: ``python data/generate.py images|tokens --out PATH [options]``.

The same as ``python -m hpcnet.data generate ...``; see ``--help``.
"""

import sys
from pathlib import Path


def run() -> int:
    """Call ``hpcnet.data.synthetic.main`` with ``generate`` and this script's arguments."""
    try:
        from hpcnet.data.synthetic import main
    except ModuleNotFoundError:
        # Run from a checkout without installing hpcnet: the package sits next to this folder.
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from hpcnet.data.synthetic import main
    return main(["generate", *sys.argv[1:]])


if __name__ == "__main__":
    raise SystemExit(run())
