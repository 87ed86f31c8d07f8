"""``python -m hpcnet.data generate|convert ...``: write a synthetic dataset file (``hpcnet.data.synthetic``)
or convert the user's arrays into one (``hpcnet.data.convert``)."""

import argparse
import sys
from collections.abc import Sequence

from hpcnet.data.convert import add_convert_command
from hpcnet.data.synthetic import add_generate_command


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run its subcommand.

    Args:
        argv: the arguments after the program name; None reads ``sys.argv``.
    """
    parser = argparse.ArgumentParser(prog="python -m hpcnet.data", description="hpcnet dataset tools")
    commands = parser.add_subparsers(dest="command", required=True)
    add_generate_command(commands)
    add_convert_command(commands)
    args = parser.parse_args(argv)
    return args.handler(args, parser)


if __name__ == "__main__":
    sys.exit(main())
