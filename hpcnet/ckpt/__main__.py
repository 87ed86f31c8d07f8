"""``python -m hpcnet.ckpt``: inspect, verify and export checkpoints (``hpcnet.ckpt.tool``)."""

import sys

from hpcnet.ckpt.tool import main

sys.exit(main())
