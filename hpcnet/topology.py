"""``python -m hpcnet.topology``: probe and print the topology (``hpcnet.comm.topology``)."""

import sys

from hpcnet.comm.topology import main

if __name__ == "__main__":
    sys.exit(main())
