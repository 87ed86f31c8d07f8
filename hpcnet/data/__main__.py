"""``python -m hpcnet.data generate|convert ...``: write a synthetic dataset file (``hpcnet.data.synthetic``)
or convert the user's arrays into one (``hpcnet.data.convert``)."""

import sys
from collections.abc import Sequence

from hpcnet.data.cli import run_commands
from hpcnet.data.convert import add_convert_command
from hpcnet.data.synthetic import add_generate_command


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run its subcommand.

    Args:
        argv: the arguments after the program name; None reads ``sys.argv``.
    """
    return run_commands(argv, add_generate_command, add_convert_command)


if __name__ == "__main__":
    sys.exit(main())
