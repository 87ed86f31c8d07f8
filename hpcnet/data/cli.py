"""The command line of ``python -m hpcnet.data``: one parser whose subcommands the data modules add (``generate``:
``hpcnet.data.synthetic``, ``convert``: ``hpcnet.data.convert``), and the run of the one chosen.

Torch-free, as the generator's command line is (``data/generate.py``).
"""

import argparse
from collections.abc import Callable, Sequence
from typing import Any


def run_commands(argv: Sequence[str] | None, *commands: Callable[[Any], object]) -> int:
    """Parse ``argv`` (None: ``sys.argv``) with the subcommands ``commands`` add (each takes the subparsers) and
    return the chosen one's handler's status; argparse's usage error, status 2, on a bad command line."""
    parser = argparse.ArgumentParser(prog="python -m hpcnet.data", description="hpcnet dataset tools")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add in commands:
        add(subparsers)
    args = parser.parse_args(argv)
    return args.handler(args, parser)
